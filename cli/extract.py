"""``ncanalyze extract``: exact per-class statistics of every checkpoint into the store."""
from __future__ import annotations

from collections.abc import Callable

import click
import cloup
from ncanalyze.cli.common import open_store
from ncanalyze.cli.options import option, setting_groups
from ncanalyze.store.extraction.settings import SECTIONS, ExtractConfig


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
    return setting_groups(SECTIONS, "extract", ExtractConfig, more=HAND_WRITTEN)(f)


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
    from ncanalyze.core.errors import UserError
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
