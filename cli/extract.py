"""``ncanalyze extract``: exact per-class statistics of every checkpoint into the store."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import click
import cloup
from ncanalyze.cli.common import open_store
from ncanalyze.cli.options import option
from ncanalyze.store.extraction.settings import SECTIONS, ExtractConfig, flag_of


def setting_option(f: dataclasses.Field) -> Callable[[Callable], Callable]:
    """The click option of one :class:`ExtractConfig` setting, made from its field: flag, help, default and metavar.
    Its value is checked by ``ExtractConfig`` itself (so the command and the library refuse alike, in one line);
    ``--help`` shows its range or choices."""
    meta, name = f.metadata, f.name
    flag, kind = flag_of(name), meta["kind"]
    default = None if f.default is dataclasses.MISSING else f.default
    if kind is bool:
        if default is False:
            return click.option(flag, name, is_flag=True, default=False, help=meta["help"])
        return click.option(f"{flag}/--no-{flag[2:]}", name, default=True, show_default=True, help=meta["help"])
    choices = meta["choices"] and "[" + "|".join(meta["choices"]) + "]"
    return click.option(flag, name, cls=SettingOption, type={int: click.INT, float: click.FLOAT}.get(kind, click.STRING),
                        default=default, show_default=default is not None,
                        required=f.default is dataclasses.MISSING, metavar=meta["metavar"] or choices, help=meta["help"],
                        bounds=_bounds(meta))


def _bounds(meta: dict) -> str | None:
    """A setting's range as ``--help`` shows it (``x>=1``, ``0<=x<=99``), or None."""
    low, high = meta["minimum"], meta["maximum"]
    if low is None:
        return None
    return f"x>={low}" if high is None or high > 2**32 else f"{low}<=x<={high}"


class SettingOption(click.Option):
    """A setting's option: ``--help`` shows its range beside its default, as click's own ranges do."""

    def __init__(self, *args, bounds: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.bounds = bounds

    def get_help_extra(self, ctx: click.Context) -> dict:
        extra = super().get_help_extra(ctx)
        if self.bounds:
            extra["range"] = self.bounds
        return extra


HAND_WRITTEN = {  # the options that are not settings of the extraction: where it goes, what it starts from
    "Hub": [
        click.option("--revision", "revisions", multiple=True, metavar="REV",
                     help="For a Hub model id: a revision (branch, tag or commit) to extract as checkpoint "
                          "<NAME>/<REV>. Repeatable [default: main]."),
        click.option("--revisions", "revision_ranges", multiple=True, metavar="START:STOP:STEP|@FILE",
                     help="Many revisions at once: step1000:143000:1000 (inclusive, the prefix kept) or @FILE (one per "
                          "line). Repeatable; combines with --revision."),
        click.option("--delete-downloads", is_flag=True, help="Remove each Hub snapshot this run downloaded after its "
                     "extraction (snapshots already in the cache are never removed)."),
    ],
    "Run control": [
        option("store", "extract"),
        click.option("--overwrite", is_flag=True, help="Replace checkpoints already extracted (or interrupted) under "
                     "another configuration."),
        click.option("--restart", is_flag=True, help="Discard any saved resume state and extract from the start."),
    ],
    "Cluster": [
        option("scheduler", "extract"),
        click.option("--shards", type=click.IntRange(1), default=1, show_default=True,
                     help="Cut each checkpoint's train stream into N contiguous parts, computed as separate tasks (in "
                          "turn without --scheduler) and merged exactly; equal to one pass within float64 rounding "
                          "(1e-12)."),
    ],
}


def sections(f: Callable) -> Callable:
    """Every option of ``extract`` in its ``--help`` section (:data:`SECTIONS`): the settings' generated from
    :class:`ExtractConfig`, then the hand-written ones."""
    for title in reversed(SECTIONS):
        settings = [setting_option(fl) for fl in dataclasses.fields(ExtractConfig) if fl.metadata["section"] == title]
        f = cloup.option_group(title, *settings, *HAND_WRITTEN.get(title, []))(f)
    return f


@cloup.command(short_help="Exact per-class statistics of every checkpoint into the store.", align_option_groups=False)
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@sections
def extract(paths, store, overwrite, restart, revisions, revision_ranges, delete_downloads, scheduler, shards,
            **options):
    """Extract the statistics of every checkpoint under PATHS into the store.

    \b
    PATHS: a Trainer output folder (checkpoint-N/ subfolders), a single model folder
    (config.json + model.safetensors), or a folder of several runs. A PATH that is not a
    local folder is a Hub model id: each --revision is a checkpoint at <NAME>/<REV>.

    One streamed pass over the train tokens gives, per token class, the exact count, mean,
    variance and pooled within-class covariance (float64); a short pass over validation
    tokens gives NC4's decision counts. Interrupted runs resume where they stopped; finished
    checkpoints are skipped.

    \b
    Example:
      ncanalyze extract runs/neo-L2-d64 --dataset data/train.txt --max-train-tokens 1000000
      ncanalyze extract EleutherAI/pythia-70m --revisions step1000:143000:1000 --dataset data/val.bin
    """
    cfg = ExtractConfig(**options)  # every setting checked (light), as the library checks it
    from ncanalyze.store.sources.discover import (
        check_local,  # light: a typo is said before torch and the Hub are loaded
    )

    check_local({"PATH": list(paths), **{f"--{k.replace('_', '-')}": [options[k]]
                                         for k in ("dataset", "val_dataset", "tokenizer")}})
    from ncanalyze.analyzer.errors import UserError
    from ncanalyze.store.runs.dispatch import extract_paths

    store = open_store(None, store)  # resolved once, passed down
    results = extract_paths(paths, store, cfg, overwrite=overwrite, restart=restart, revisions=revisions,
                            revision_ranges=revision_ranges, delete_downloads=delete_downloads, scheduler=scheduler,
                            shards=shards, done=lambda r: click.echo(r.summary()))  # each printed as it comes
    failed = [line for r in results for line in r.failures]
    if failed:
        more = "; ..." if len(failed) > 3 else ""
        raise UserError(f"{len(failed)} checkpoint(s) or revision(s) failed, the others are in {store}: "
                        f"{'; '.join(failed[:3])}{more} (fix them and run the same command again)")
