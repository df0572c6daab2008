"""``ncanalyze report``: measure what is new, then tables, figures and statistics over the store."""
from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import click
from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.stats import CONTROLS, METRICS, MIN_N
from ncanalyze.cli.common import resolve_store
from ncanalyze.cli.options import option, store_argument

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import pandas as pd


def _split(s: str | None) -> list[str]:
    return [x for x in (s or "").split(",") if x.strip()]


def load_table(source: str, min_count: int, scheduler: str | None
               ) -> tuple[pd.DataFrame, str | None, dict[str, str]]:
    """The metrics table from a store (measuring what is not yet measured) or from a metrics CSV.

    Parameters
    ----------
    source
        A store's path, or a ``.csv`` metrics table (an earlier report's metrics.csv).
    min_count
        Keep classes with at least this many train tokens (when measuring).
    scheduler
        A Dask scheduler address for measuring, or None.

    Returns
    -------
    table, store, failed
        The metrics table, the store's path (None for a CSV), and the groups left out of it with why.
    """
    import pandas as pd

    path = Path(source)
    if path.suffix == ".csv":
        if not path.is_file():
            raise UserError(f"no metrics table at {path}")
        return pd.read_csv(path), None, {}
    if not path.exists():
        raise UserError(f"no store at {path}: run `ncanalyze extract CHECKPOINTS --store {path}` first, pass the "
                        "store's path, or set NCANALYZE_STORE")
    from ncanalyze.store.measure import measure_store

    result = measure_store(str(path), min_count=min_count, scheduler=scheduler)
    return result.table, str(path), result.failed


@click.command(short_help="Tables, figures and statistics of the metrics against the validation loss.")
@store_argument("report")
@click.option("--out", type=click.Path(file_okay=False), default="ncanalyze-report", show_default=True,
              help="Folder for report.md, metrics.csv, stats.csv, tables.tex and the figures "
              "(PNG, PDF and SVG).")
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
@option("min_count", "report")
@option("scheduler", "report")
def report(store_positional, store, out, where, metrics_, target, controls, permutations, seed, per_run, tokens,
           checkpoints, min_count, scheduler):
    """Tables, figures and statistics of NC metrics against the target (default: val_loss, the loss ncanalyze
    measured on the validation tokens, where every selected checkpoint has it; else eval_loss, the Trainer's) over
    a STORE (or --store; default $NCANALYZE_STORE, else ./ncanalyze.zarr; a metrics.csv from an earlier report
    also works).

    \b
    For every metric: Pearson r and R² (raw, and with log10 of the metric where positive), Spearman's rho, the
    partial r controlling for model size and training progress, and permutation p-values (Freedman-Lane for the
    partial r; runs with several checkpoints permuted whole). Tags are never pooled: each tag is reported apart.
    """
    from ncanalyze.analyzer.report import ReportOptions, write_report
    from ncanalyze.store.io import read_group

    df, store_path, failed = load_table(resolve_store(store_positional, store), min_count, scheduler)
    metrics = _split(metrics_) or [m for m in METRICS if m in df.columns] or list(METRICS)
    options = ReportOptions(metrics=metrics, target=target, controls=_split(controls), where=where,
                            n_perm=permutations, seed=seed, store=store_path, tokens=_split(tokens),
                            checkpoints=checkpoints, per_run=per_run)
    result = write_report(df, out, options, read_group=store_path and partial(read_group, store_path), skipped=failed)
    n = len(result.selected)  # checkpoints, not their layers
    if n < MIN_N:
        log.warning("warning: only %d checkpoint(s) selected; correlations need at least %d", n, MIN_N)
    for line in sorted(set(result.stats.note.dropna()) - {""}):
        if "too few" in line:
            log.warning("note: %s", line)
    click.echo(f"{n} checkpoints, {len(metrics)} metrics -> {result.files['report']}")
    for f in result.files.values():
        click.echo(f"  {f}")
