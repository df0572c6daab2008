"""``ncanalyze report``: measure what is new, then tables, figures and statistics over the store."""
from __future__ import annotations

import logging

import click
from ncanalyze.analyzer.schema import CONTROLS
from ncanalyze.cli.common import resolve_store
from ncanalyze.cli.options import option, store_argument

log = logging.getLogger(__name__)


def _split(s: str | None) -> list[str]:
    return [x for x in (s or "").split(",") if x.strip()]


@click.command(short_help="Tables, figures and statistics of the metrics against the validation loss.")
@store_argument("report")
@click.option("--out", type=click.Path(file_okay=False), default="ncanalyze-report", show_default=True,
              help="Folder for report.md, report.html, metrics.csv, stats.csv, min_count.csv (from a store: "
              "Figure 1's metrics of each run's latest checkpoint at min_count 2, 5 and 20), tables.tex and the "
              "figures (PNG, PDF and SVG).")
@click.option("--where", help="Condition over the table's columns selecting the checkpoints the report covers, in "
              "pandas query syntax, e.g. \"n_layers == 4 and hidden_size == 256\" (the seed replicas of one "
              "architecture); "
              "columns, literals, comparisons, and/or/not, in [...], log/log10/log1p/exp/sqrt/abs, "
              ".str.contains/startswith/endswith and .isna()/.notna() only: never run as code. One tag: "
              "\"tag == 'NAME'\"; the untagged checkpoints: \"tag.isna()\" or \"tag == ''\".")
@click.option("--metrics", "metrics_", help="Comma-separated metric columns (default: all of them).")
@click.option("--target", help="Column to correlate the metrics with [default: val_loss where every selected "
              "checkpoint has it, else eval_loss].")
@click.option("--controls", default=",".join(CONTROLS), show_default=True,
              help="Comma-separated expressions over the columns held fixed by the partial correlation "
              "(the same allowed syntax as --where; \"\" for none).")
@click.option("--permutations", type=click.IntRange(min=0), default=10_000, show_default=True,
              help="Permutations per p-value (0: none). Runs with several checkpoints are permuted whole; all "
              "permutations, and an exact p, where there are no more than this.")
@click.option("--per-run", type=click.Choice(["all", "last"]), default="all", show_default=True,
              help="'last': each run's latest checkpoint only (one row per run, per tag).")
@option("seed", "report")
@click.option("--tokens", help="Comma-separated tokens (strings as decoded, or ids) for the per-token table.")
@click.option("--checkpoint", "checkpoints", multiple=True, metavar="RUN/CHECKPOINT",
              help="Checkpoint(s) of the per-token table (default: each selected run's latest). Repeatable.")
@click.option("--html/--no-html", default=True, show_default=True,
              help="Also write report.html, one self-contained interactive page (see above); --no-html: not.")
@option("min_count", "report")
@option("scheduler", "report")
def report(store_positional, store, out, where, metrics_, target, controls, permutations, seed, per_run, tokens,
           checkpoints, html, min_count, scheduler):
    """Tables, figures and statistics of NC metrics against the target (default: val_loss, the loss ncanalyze
    measured on the validation tokens, where every selected checkpoint has it; else eval_loss, the Trainer's) over
    a STORE (or --store; default $NCANALYZE_STORE, else ./ncanalyze.zarr; a metrics.csv from an earlier report
    also works).

    \b
    For every metric: Pearson r and R² (raw, and with log10 of the metric where positive), Spearman's rho, the
    partial r controlling for model size and training progress, and permutation p-values (Freedman-Lane for the
    partial r; runs with several checkpoints permuted whole). Tags are never pooled: each tag is reported apart.

    \b
    report.html is one file that opens offline from disk (plotly.js inlined): Figure 1's panels (hover a point
    for its run, checkpoint, step, tag, size, metric, target and kept classes), a picker for the metric (NC and
    geometry) and, where there are several, the layer and the tag; the picked metric against the target and
    against the step (a line per run: click a run in the legend to show it alone), the depth figure with
    layers, the sortable statistics table, the per-token tables with --tokens, and report.md's caveats (the
    permutation unit and count, thin classes, tags kept apart).
    """
    from ncanalyze.analyzer.report import ReportOptions, write_report
    from ncanalyze.analyzer.stats import METRICS, MIN_N, NoteKind, has_note
    from ncanalyze.store.measure import load_table
    from ncanalyze.store.store import Store

    df, store_path, failed = load_table(resolve_store(store_positional, store), min_count, scheduler)
    metrics = _split(metrics_) or [m for m in METRICS if m in df.columns] or list(METRICS)
    options = ReportOptions(metrics=metrics, target=target, controls=_split(controls), where=where,
                            n_perm=permutations, seed=seed, store=store_path, tokens=_split(tokens),
                            checkpoints=checkpoints, per_run=per_run, html=html)
    result = write_report(df, out, options, read_group=store_path and Store.at(store_path).read, skipped=failed)
    n = len(result.selected)  # checkpoints, not their layers
    if n < MIN_N:
        log.warning("warning: only %d checkpoint(s) selected; correlations need at least %d", n, MIN_N)
    for line in sorted(set(result.stats.note[has_note(result.stats, NoteKind.TOO_FEW)].dropna()) - {""}):
        log.warning("note: %s", line)
    click.echo(f"{n} checkpoints, {len(metrics)} metrics -> {result.files['report']}")
    for f in result.files.values():
        click.echo(f"  {f}")
