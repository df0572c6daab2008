"""The ``ncanalyze`` console script: a click group whose commands live beside it in this package."""
from __future__ import annotations

import click

from ncanalyze.analyzer.errors import UserError
from ncanalyze.cli.common import version


class _Group(click.Group):
    """Turns a :class:`UserError` (and a full disk) into a one-line error and exit code 1, never a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            if e.errno == 28:  # ENOSPC
                raise click.ClickException(
                    f"disk full while writing ({e.filename or 'store'}); free space or pass --store on another disk, "
                    "then run the same command again to resume") from None
            raise


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(version(), prog_name="ncanalyze")
def main() -> None:
    """Neural collapse in causal language models, measured post hoc over training checkpoints.

    \b
    Typical use, after any Hugging Face training run:
      ncanalyze extract runs/my-run --dataset roneneldan/TinyStories
      ncanalyze report --out report/

    The store (default ./ncanalyze.zarr, or $NCANALYZE_STORE) is a Zarr v3 store that
    xarray opens: ncanalyze.store.open(path) gives one group per checkpoint.
    """


# each module adds its command to `main`
from ncanalyze.cli import extract, measure, report  # noqa: E402,F401
