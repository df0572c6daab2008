"""The ``ncanalyze`` console script: a click group, its global options, and the commands registered on it."""
from __future__ import annotations

import logging
import os
import sys
import warnings

import click
from ncanalyze.cli.extract import extract
from ncanalyze.cli.ls import ls
from ncanalyze.cli.measure import measure
from ncanalyze.cli.report import report
from ncanalyze.cli.rm import rm
from ncanalyze.core.errors import UserError
from tqdm.auto import tqdm

import ncanalyze

log = logging.getLogger(__name__)
ROOT_LOGGER = "ncanalyze"  # configured here; every module's logging.getLogger(__name__) propagates to it


class _ClickHandler(logging.Handler):
    """Log records as lines on stderr, written above the progress bars (tqdm.write clears and redraws them)."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    log.warning("warning: %s: %s", category.__name__, message)


class _OneLineUsageError(click.ClickException):
    exit_code = 2


class _Group(click.Group):
    """A :class:`UserError` (and a full disk) is a one-line error and exit code 1; anything else is a bug and shows
    its traceback. With ``--debug`` every error shows its traceback."""

    def invoke(self, ctx: click.Context):
        debug = ctx.params.get("debug", False)
        try:
            with warnings.catch_warnings():
                warnings.showwarning = _show_warning
                return super().invoke(ctx)
        except click.UsageError as e:  # one line, as every other error: what is wrong and where the help is
            if debug:
                raise
            cmd = f"{ctx.info_name} {e.ctx.info_name}" if e.ctx and e.ctx is not ctx else ctx.info_name
            raise _OneLineUsageError(f"{e.format_message()} (see `{cmd} --help`)") from None
        except KeyboardInterrupt as e:
            if debug:
                raise
            click.echo(str(e) if str(e) else "interrupted", err=True)
            ctx.exit(130)
        except UserError as e:
            if debug:
                e.__suppress_context__ = False  # show what it was raised from
                raise
            raise click.ClickException(str(e)) from None
        except OSError as e:
            if e.errno != 28 or debug:  # ENOSPC
                raise
            where = "--out" if ctx.invoked_subcommand == "report" else "--store"
            raise click.ClickException(
                f"disk full while writing ({e.filename or ('the report' if where == '--out' else 'the store')}); free space or pass {where} on another disk, "
                "then run the same command again" + (" to resume" if where == "--store" else "")) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(ncanalyze.__version__, prog_name="ncanalyze")
@click.option("--debug", is_flag=True, help="Show the full traceback of every error.")
@click.option("-v", "--verbose", count=True, help="More messages (-v: debug detail).")
@click.option("-q", "--quiet", count=True, help="Fewer messages (-q: warnings and errors only).")
def main(debug: bool, verbose: int, quiet: int) -> None:
    """Neural collapse in causal language models, measured post hoc over training checkpoints.

    \b
    Typical use, after any Hugging Face training run:
      ncanalyze extract runs/my-run --dataset roneneldan/TinyStories
      ncanalyze report --out report/

    The store (default ./ncanalyze.zarr, or $NCANALYZE_STORE) is a Zarr v3 store that
    xarray opens: ncanalyze.store.open(path) gives one group per checkpoint.
    """
    handler = _ClickHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger(ROOT_LOGGER)
    root.handlers[:] = [handler]
    root.propagate = False
    root.setLevel(logging.INFO + 10 * (quiet - verbose))
    if quiet > verbose:
        _quiet_libraries()


def _quiet_libraries() -> None:
    """``-q``: no progress bars of the Hub's downloads and of datasets' passes either (ours: ncanalyze.store.bars):
    their switches where they are loaded, else the variables they read when they load."""
    for module, variable in (("huggingface_hub.utils", "HF_HUB_DISABLE_PROGRESS_BARS"),
                             ("datasets", "HF_DATASETS_DISABLE_PROGRESS_BARS")):
        if module in sys.modules:
            sys.modules[module].disable_progress_bars()
        else:
            os.environ[variable] = "1"


main.add_command(extract)
main.add_command(measure)
main.add_command(report)
main.add_command(ls)
main.add_command(rm)
