"""``ncanalyze extract``: exact per-class statistics of every checkpoint into the store."""
from __future__ import annotations

import click
from ncanalyze.cli.common import default_store
from ncanalyze.cli.options import option


def _per_pass(ctx, param, value: str) -> str | int:
    """``auto`` or a positive integer (an int, so the record hashes as before)."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter(f"{value!r} is not auto or a positive integer")
    return int(value)


@click.command(short_help="Exact per-class statistics of every checkpoint into the store.")
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@option("store", "extract")
@click.option("--dataset", required=True, metavar="SPEC",
              help="Train data: a Hub name, a local dataset folder, a .txt/.json/.jsonl/.parquet/.csv file, or token "
                   "ids in .npy (1-D stream or 2-D blocks) or nanoGPT .bin (uint16 stream).")
@click.option("--val-dataset", metavar="SPEC",
              help="Validation data (NC4, val_loss), any form --dataset takes. Default: a sibling file (val.bin "
                   "beside train.bin, validation.txt beside train.txt), else the --val-split of --dataset where it "
                   "has one, else --val-split-percentage of the train data held out (never the train tokens).")
@click.option("--split", default="train", show_default=True, help="Split of --dataset (slices like 'train[:95%]' "
              "work for local data).")
@click.option("--val-split", default="validation", show_default=True, help="Split of the validation data.")
@click.option("--val-split-percentage", type=click.IntRange(0, 99), default=5, show_default=True, metavar="P",
              help="With no validation data given or found, hold out the first P% of the train data as validation "
                   "and train on the rest, as run_clm's validation_split_percentage: splits 'train[:P%]' and "
                   "'train[P%:]' (text, datasets), or the first P% of the blocks (.npy/.bin). 0: validate on "
                   "--val-split of --dataset as before (a token file without a sibling is then refused).")
@click.option("--text-column", default="text", show_default=True, help="Column holding the text.")
@click.option("--block-size", type=click.IntRange(2), help="Block length for 1-D streams and text "
              "[default: the model's context, at most 1024].")
@click.option("--max-train-tokens", type=click.IntRange(0), help="Cap on train tokens read: whole blocks, spread over "
              "the whole split (see --cap-mode).")
@click.option("--max-val-tokens", type=click.IntRange(0), help="Cap on validation tokens read (as --max-train-tokens); "
              "0 skips NC4.")
@click.option("--cap-mode", type=click.Choice(["spread", "prefix"]), default="spread", show_default=True,
              help="How a token cap reads a split: 'spread', whole blocks drawn over all of it (one from each of N "
                   "equal stretches, N the blocks the cap allows; drawn with --seed, the same for every checkpoint "
                   "and across a resume; text is tokenized whole into the token cache first); 'prefix', its first "
                   "blocks. Recorded where a cap is set (attribute cap_mode; spread also in the config hash).")
@click.option("--batch-size", type=click.IntRange(1), default=8, show_default=True, help="Blocks per forward pass.")
@option("device", "extract")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "float64"]), default="float32",
              show_default=True, help="Model dtype; statistics are always accumulated in float64.")
@click.option("--samples-per-class", type=click.IntRange(0), default=8, show_default=True,
              help="Raw features kept per class (uniform reservoir sample).")
@click.option("--tokenizer", metavar="PATH_OR_NAME", help="Tokenizer for text data [default: the checkpoint's, "
              "else its run folder's].")
@option("min_count", "extract")
@option("seed", "extract")
@click.option("--keep-linebreaks/--no-keep-linebreaks", default=True, show_default=True,
              help="Plain text files (.txt, folders of them) keep each line's line break, as run_clm reads them; "
                   "--no-keep-linebreaks strips them.")
@click.option("--token-cache/--no-token-cache", default=True, show_default=True,
              help="Tokenize text once into <store>.tokens/ (keyed by data, tokenizer, block size, cap and line "
                   "breaks) and reuse it for every checkpoint; progress bars and the estimate then know the totals.")
@click.option("--tag", metavar="NAME", help="Store these checkpoints under <run>@NAME/<checkpoint> (attribute and "
              "metrics.csv column `tag`): the same checkpoints measured on several datasets in one store.")
@click.option("--allow-pickle", is_flag=True, help="Load pickle weights (pytorch_model.bin); only for trusted files.")
@click.option("--trust-remote-code", is_flag=True, help="Allow custom model or tokenizer code from the checkpoint.")
@click.option("--revision", "revisions", multiple=True, metavar="REV",
              help="For a Hub model id: a revision (branch, tag or commit) to extract as checkpoint <NAME>/<REV>. "
                   "Repeatable [default: main].")
@click.option("--revisions", "revision_ranges", multiple=True, metavar="START:STOP:STEP|@FILE",
              help="Many revisions at once: step1000:143000:1000 (inclusive, the prefix kept) or @FILE (one per "
                   "line). Repeatable; combines with --revision.")
@click.option("--delete-downloads", is_flag=True, help="Remove each Hub snapshot this run downloaded after its "
              "extraction (snapshots already in the cache are never removed).")
@click.option("--overwrite", is_flag=True, help="Replace checkpoints already extracted (or interrupted) under "
              "another configuration.")
@click.option("--restart", is_flag=True, help="Discard any saved resume state and extract from the start.")
@click.option("--state-every", type=click.FloatRange(0), default=120.0, show_default=True,
              help="Seconds between saves of the resume state (a killed run continues from the last save).")
@click.option("--layers", default="last", show_default=True, metavar="last|all|I,J,...",
              help="Layers to extract: transformers' hidden_states indices (0: the embedding output; the last: after "
                   "the final norm, the checkpoint group itself), negative from the end. Others are stored at "
                   "<run>/<checkpoint>/layers/<l>; NC4 there uses the logit lens (the head after the final norm).")
@click.option("--layers-per-pass", default="auto", show_default=True, metavar="auto|K", callback=_per_pass,
              help="At most K layers' state at a time: several passes over the data (exact either way); auto: as many "
                   "as --state-memory holds, the deepest layers together.")
@click.option("--state-memory", metavar="SIZE",
              help="Memory the float64 state may take under --layers-per-pass auto, e.g. 40GB or 512MiB "
                   "[default: the device's free memory after the model, less a tenth (at least 1 GiB)].")
@click.option("--save-embeddings", type=click.IntRange(0), default=0, show_default=True, metavar="N",
              help="Keep the first N train positions' features of each stored layer as a chunked Zarr array "
                   "embeddings (position, hidden) with label (position).")
@click.option("--embeddings-dtype", type=click.Choice(["float32", "float16", "float64"]), default="float32",
              show_default=True, help="dtype of --save-embeddings.")
@option("scheduler", "extract")
@click.option("--shards", type=click.IntRange(1), default=1, show_default=True,
              help="Cut each checkpoint's train stream into N contiguous parts, computed as separate tasks (in turn "
                   "without --scheduler) and merged exactly; equal to one pass within float64 rounding (1e-12).")
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
    from ncanalyze.store.sources.discover import (
        check_local,  # light: a typo is said before torch and the Hub are loaded
    )

    check_local({"PATH": list(paths), **{f"--{k.replace('_', '-')}": [options[k]]
                                         for k in ("dataset", "val_dataset", "tokenizer")}})
    from ncanalyze.analyzer.errors import UserError
    from ncanalyze.store.extraction.config import ExtractConfig
    from ncanalyze.store.runs.hub import extract_hub, is_hub_id, parse_revisions
    from ncanalyze.store.runs.local import announcer_over
    from ncanalyze.store.runs.local import extract as extract_local

    if not options["layers"].strip(" ,"):
        raise click.UsageError(f"--layers {options['layers']!r} names no layer: pass last, all, or indices like 0,-1")
    store = store or default_store()
    cfg = ExtractConfig(**options)
    hub = [p for p in paths if is_hub_id(p)]
    local = [p for p in paths if p not in hub]
    if (revisions or revision_ranges) and not hub:
        raise click.UsageError("--revision/--revisions apply to Hub model ids; none of PATHS is one "
                               "(local folders are extracted with their checkpoints)")
    if hub and (scheduler or shards > 1):
        raise click.UsageError("Hub revisions are extracted in this process: pass --scheduler/--shards only with "
                               "local checkpoint folders (or fetch the revisions first)")
    revs = parse_revisions(revisions, revision_ranges) if hub else []
    results = []  # each printed as it comes (a later one may raise)
    for path in hub:
        results.append(extract_hub(path, revs, store, cfg, overwrite=overwrite, delete_downloads=delete_downloads,
                                   restart=restart))
        click.echo(results[-1].summary())
    if scheduler and local:
        from ncanalyze.store.runs.cluster import extract_on_cluster

        results.append(extract_on_cluster(local, store, cfg, scheduler, overwrite, restart, shards))
        click.echo(results[-1].summary())
    elif local:
        announce = announcer_over(local, store, cfg, overwrite, restart)  # one estimate over every PATH
        for path in local:
            results.append(extract_local(path, store, cfg, overwrite=overwrite, restart=restart, shards=shards,
                                         announce=announce))
            click.echo(results[-1].summary())
    failed = [line for r in results for line in r.failures]
    if failed:
        more = "; ..." if len(failed) > 3 else ""
        raise UserError(f"{len(failed)} checkpoint(s) or revision(s) failed, the others are in {store}: "
                        f"{'; '.join(failed[:3])}{more} (fix them and run the same command again)")
