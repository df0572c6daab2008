"""``write_report``: a study's metrics table in, its statistics, figures, per-token table and documents out."""
from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from ncanalyze.analyzer.depth import depth_table, has_depth, last_layer
from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.report.figures import depth_files, draw_figures
from ncanalyze.analyzer.report.options import ReportOptions, ReportResult
from ncanalyze.analyzer.report.tables import default_target, latex, markdown, select
from ncanalyze.analyzer.report.tokens import GroupReader, latest_checkpoints, per_token
from ncanalyze.analyzer.schema import INFO as ID_COLUMNS
from ncanalyze.analyzer.stats import correlations

log = logging.getLogger(__name__)


def _check(df: pd.DataFrame, options: ReportOptions, read_group: GroupReader | None) -> None:
    """A UserError for metrics the table lacks, or tokens without a store to read them from."""
    missing = [m for m in options.metrics if m not in df.columns]
    if missing:
        raise UserError(f"unknown metric(s) {', '.join(missing)} (--metrics, ReportOptions.metrics); the table has: "
                        f"{', '.join(df.columns)}")
    if options.tokens and read_group is None:
        raise UserError("--tokens (ReportOptions.tokens) needs a store (per-class statistics, write_report's "
                        "read_group), not a metrics CSV")


def _selection(df: pd.DataFrame, where: str | None) -> pd.DataFrame:
    """The rows ``where`` selects (every layer), identity columns first."""
    rows = select(df, where)
    first = [c for c in ID_COLUMNS if c in rows.columns]
    return rows[first + [c for c in rows.columns if c not in first]]


def _folder(out: str | Path) -> Path:
    """The output folder, made where missing; a UserError where a file is in the way."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise UserError(f"--out (write_report's out) {out}: cannot make the folder ({e.strerror}: {e.filename}); "
                        "pass a folder path that is not under a file") from None
    return out


def _write_tables(r: ReportResult, out: Path) -> None:
    """metrics.csv, stats.csv and, with tokens, tokens.csv."""
    r.files |= {"metrics": out / "metrics.csv", "stats": out / "stats.csv"}
    r.metrics.to_csv(r.files["metrics"], index=False)
    r.stats.to_csv(r.files["stats"], index=False)
    if r.tokens is not None:
        r.files["tokens"] = out / "tokens.csv"
        r.tokens.to_csv(r.files["tokens"], index=False)


def write_report(df: pd.DataFrame, out: str | Path, options: ReportOptions = ReportOptions(),
                 read_group: GroupReader | None = None) -> ReportResult:
    """Write metrics.csv, stats.csv, the figures, tokens.csv (with tokens), the depth figure and layers.csv (with
    layers), report.md and tables.tex into a folder.

    The statistics, Figures 1-4 and the token table use each selected checkpoint's last layer. Tokens resolved other
    than as written, or given twice, are logged as warnings now and said in report.md.

    Parameters
    ----------
    df
        The metrics table, one row per checkpoint (and layer); ``df.attrs["skipped"]`` (group: why) is listed in
        report.md.
    out
        The folder, made where missing.
    options
        What to report (:class:`ReportOptions`).
    read_group
        Gives a checkpoint's dataset for the per-token table (:class:`GroupReader`); needed with
        ``options.tokens``.

    Returns
    -------
    ReportResult
        The tables computed and the paths of the files written.
    """
    _check(df, options, read_group)
    every_layer = _selection(df, options.where)
    sel = last_layer(every_layer)
    target = options.target or default_target(sel)
    r = ReportResult(metrics=every_layer, selected=sel, target=target,
                     stats=correlations(sel, options.metrics, target, options.controls, options.n_perm, options.seed))
    if options.tokens:
        groups = list(options.checkpoints) or latest_checkpoints(sel)
        r.tokens, r.notes = per_token(read_group, groups, options.tokens)
    for note in r.notes:
        log.warning("note: %s", note)
    r.depth = depth_table(every_layer) if has_depth(every_layer) else None

    out = _folder(out)
    _write_tables(r, out)
    r.figures = draw_figures(sel, options.metrics, target, r.stats, out)
    r.files |= r.figures
    r.files |= depth_files(every_layer, r.depth, out)
    r.files |= {"report": out / "report.md", "tex": out / "tables.tex"}
    r.files["report"].write_text(markdown(r, options, skipped=df.attrs.get("skipped")))
    r.files["tex"].write_text(latex(r.stats, r.tokens, target, options.controls))
    return r
