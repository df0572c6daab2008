"""``write_report``: a study's metrics table in, its statistics, figures, per-token table and documents out."""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ncanalyze.analyzer.report.depth import depth_table, has_depth, last_layer, undefined
from ncanalyze.analyzer.report.document import markdown
from ncanalyze.analyzer.report.escape import write_csv
from ncanalyze.analyzer.report.figures import (
    BY_STEP,
    DYNAMICS,
    FIGURES,
    FORMATS,
    depth_files,
    draw_figures,
    draw_step_figure,
    estimated,
    tag_suffix,
)
from ncanalyze.analyzer.report.html import write_html
from ncanalyze.analyzer.report.mincount import HEADLINE, min_count_table
from ncanalyze.analyzer.report.precision import budget_figure, errors_latex, final_budget_table
from ncanalyze.analyzer.report.report_options import ReportOptions, ReportResult
from ncanalyze.analyzer.report.support import SUPPORT, with_support
from ncanalyze.analyzer.report.tables import default_target, latex, select
from ncanalyze.analyzer.report.tokens import GroupReader, latest_checkpoints, per_token
from ncanalyze.analyzer.schema import INFO as ID_COLUMNS
from ncanalyze.analyzer.stats import by_step, correlations_by_tag, last_per_run, split_tags
from ncanalyze.core.errors import UserError

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


def _selection(df: pd.DataFrame, options: ReportOptions, read_group: GroupReader | None) -> pd.DataFrame:
    """The rows ``where`` selects (every layer; with ``per_run="last"`` each run's latest checkpoint), identity
    columns first, then what the numbers rest on (:data:`~ncanalyze.analyzer.report.support.SUPPORT`)."""
    rows = select(df, options.where)
    if options.per_run == "last":
        rows = last_per_run(rows)
    rows = with_support(rows, read_group)
    first = [c for c in (*ID_COLUMNS, *SUPPORT) if c in rows.columns]
    return rows[first + [c for c in rows.columns if c not in first]]


def _figures(r: ReportResult, options: ReportOptions, out: Path) -> dict[str, Path]:
    """Figures 1-4 of each tag apart (never pooled); stems suffixed with the tag where there are several."""
    tags = split_tags(r.selected)
    metrics = estimated(options.metrics, options.estimates, r.selected)
    figures = {}
    for tag, rows in tags:
        stats = r.stats[r.stats.tag.isna()] if tag is None else r.stats[r.stats.tag == tag]
        suffix = tag_suffix(tag) if len(tags) > 1 else ""
        figures |= draw_figures(rows, metrics, r.target, stats, out, suffix, options.formats)
        if r.by_step is not None:
            steps = r.by_step[r.by_step.tag.isna()] if tag is None else r.by_step[r.by_step.tag == tag]
            figures |= draw_step_figure(steps, stats, metrics, r.target, out, suffix, options.formats)
    return figures


def _folder(out: str | Path) -> Path:
    """The output folder, made where missing; a UserError where a file is in the way."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise UserError(f"--out (write_report's out) {out}: cannot make the folder ({e.strerror}: {e.filename}); "
                        "pass a folder path that is not under a file") from None
    clash = sorted((e for e in os.scandir(out) if _written_by_report(e.name)), key=lambda e: e.name)
    links = [e.name for e in clash if e.is_symlink() or not e.is_file(follow_symlinks=False)]
    if links:
        raise UserError(f"--out {out} holds {', '.join(map(repr, links[:5]))}, a link or not a plain file where the "
                        "report writes a file: a report never writes through a link; pass another --out, or remove "
                        "them")
    theirs = [e.name for e in clash]
    if theirs and not _ours(out / "report.md"):
        raise UserError(f"--out {out} holds {', '.join(map(repr, theirs[:5]))}"
                        f"{f' and {len(theirs) - 5} more' if len(theirs) > 5 else ''} that no ncanalyze report wrote "
                        "(no report.md of ours beside them), which the report would overwrite; pass another --out, "
                        "or move them")
    return out


# files a report writes: these, and the figures (FIGURES' stems, fig4_dynamics, fig5_r_by_step, depth and
# budget; per tag with __<tag>) as PNG, PDF and SVG
MANIFEST = ".ncanalyze-report"  # the names of the files the last report in --out wrote, one a line
OUTPUTS = ("metrics.csv", "stats.csv", "by_step.csv", "tokens.csv", "layers.csv", "min_count.csv", "tables.tex",
           "report.md", "report.html", "budget.csv", MANIFEST)
_STEMS = (*FIGURES, DYNAMICS[0], BY_STEP[0], "depth", "budget")
_FIGURE_FILE = re.compile(rf"({'|'.join(map(re.escape, _STEMS))})(__[A-Za-z0-9._-]+)?"
                          rf"\.({'|'.join(FORMATS)})")


def _written_by_report(name: str) -> bool:
    """Whether a report writes a file of this name (it would overwrite one there)."""
    return name in OUTPUTS or bool(_FIGURE_FILE.fullmatch(name))


def _earlier(out: Path) -> set[str]:
    """The files an earlier report in ``out`` wrote: its manifest's names, else (a report from before the manifest,
    whose report.md :func:`_folder` found ours) the names a report writes that are there."""
    try:
        return set((out / MANIFEST).read_text(encoding="utf-8").splitlines()) - {"", MANIFEST}
    except (OSError, UnicodeDecodeError):
        return {e.name for e in os.scandir(out) if _written_by_report(e.name)} - {MANIFEST}


def _sweep(out: Path, earlier: set[str], r: ReportResult, formats) -> list[str]:
    """Remove the files of ``earlier`` that this report did not write (a report.html after --no-html, a budget, a
    figure or a table this selection has none of), never a link or another name; write the manifest of this
    report's files. Returns the names removed."""
    written = {p.name for p in r.files.values()}
    written |= {f"{p.stem}.{ext}" for p in r.files.values() if p.suffix == ".png" for ext in formats
                if (out / f"{p.stem}.{ext}").is_file()}
    gone = sorted(n for n in earlier - written if _written_by_report(n) and (out / n).is_file()
                  and not (out / n).is_symlink())
    for name in gone:
        (out / name).unlink()
    (out / MANIFEST).write_text("".join(f"{n}\n" for n in sorted(written)), encoding="utf-8")
    return gone


def _budget_files(r: ReportResult, out: Path, formats: Sequence[str]) -> dict[str, Path]:
    """budget.csv and the budget figure in ``formats``, where there is a token budget (a store whose checkpoints have
    folds)."""
    if r.budget is None or r.budget.empty:
        return {}
    write_csv(r.budget, out / "budget.csv")
    png = budget_figure(r.budget, HEADLINE, out, formats)
    return {"budget": out / "budget.csv"} | ({"fig_budget": png} if png else {})


def _ours(report_md: Path) -> bool:
    """Whether ``report_md`` is a report.md that ncanalyze wrote (its title line)."""
    try:
        with open(report_md, encoding="utf-8") as f:
            return f.readline().startswith("# ncanalyze report")
    except (OSError, UnicodeDecodeError):
        return False


def _write_tables(r: ReportResult, out: Path) -> None:
    """metrics.csv, stats.csv and, with tokens, tokens.csv; with a store, min_count.csv; text cells a spreadsheet
    would read as formulas guarded (:func:`~ncanalyze.analyzer.report.escape.write_csv`)."""
    r.files |= {"metrics": out / "metrics.csv", "stats": out / "stats.csv"}
    write_csv(r.metrics, r.files["metrics"])
    write_csv(r.stats, r.files["stats"])
    if r.by_step is not None and len(r.by_step):
        r.files["by_step"] = out / "by_step.csv"
        write_csv(r.by_step, r.files["by_step"])
    if r.tokens is not None:
        r.files["tokens"] = out / "tokens.csv"
        write_csv(r.tokens, r.files["tokens"])
    if r.min_count is not None:
        r.files["min_count"] = out / "min_count.csv"
        write_csv(r.min_count, r.files["min_count"])


def write_report(df: pd.DataFrame, out: str | Path, options: ReportOptions = ReportOptions(),
                 read_group: GroupReader | None = None, skipped: dict[str, str] | None = None) -> ReportResult:
    """Write metrics.csv, stats.csv, the figures, tokens.csv (with tokens), the depth figure and layers.csv (with
    layers), min_count.csv (with a store), report.md, tables.tex and (unless ``options.html`` is False) report.html
    into a folder.

    The statistics, Figures 1-4 and the token table use each selected checkpoint's last layer. Tags (datasets) are
    never pooled: each tag's statistics (Holm within the tag) and figures are its own. Runs with several
    checkpoints are permuted whole (:func:`ncanalyze.analyzer.stats.correlations`). Tokens resolved other than as
    written, given twice or not one token are logged as warnings now and said in report.md. With a store, Figure
    1's metrics of each run's latest checkpoint are measured again at min_count 1, 2, 5 and 20 (at most 12 runs;
    :mod:`~ncanalyze.analyzer.report.mincount`).

    Parameters
    ----------
    df
        The metrics table, one row per checkpoint (and layer).
    out
        The folder, made where missing.
    options
        What to report (:class:`ReportOptions`).
    read_group
        Gives a checkpoint's dataset for the per-token table (:class:`GroupReader`) and the min_count table; needed
        with ``options.tokens``; None (a metrics CSV): neither.
    skipped
        The groups that could not be measured, with why (group: why): listed in report.md.

    Returns
    -------
    ReportResult
        The tables computed and the paths of the files written.
    """
    _check(df, options, read_group)
    every_layer = _selection(df, options, read_group)
    sel = last_layer(every_layer)
    if sel.empty and not every_layer.empty:
        raise UserError("the selection holds no checkpoint's last layer (--where picked intermediate layers only): the "
                        "correlations use each checkpoint's last layer, the other layers are in depth.png and "
                        "layers.csv; select checkpoints, not layers (e.g. drop the layer condition)")
    target = options.target or default_target(sel)
    stats = correlations_by_tag(sel, options.metrics, target, options.controls, options.n_perm, options.seed,
                                runs="run", n_boot=options.n_boot)
    r = ReportResult(metrics=every_layer, selected=sel, target=target, stats=stats)
    r.by_step = by_step(sel, options.metrics, target, options.n_perm, options.seed)
    if options.tokens:
        groups = list(options.checkpoints) or latest_checkpoints(sel)
        r.tokens, r.notes = per_token(read_group, groups, options.tokens)
    for note in r.notes:
        log.warning("note: %s", note)
    if read_group is not None:
        r.min_count, r.min_count_notes = min_count_table(sel, read_group)
        r.budget, r.budget_notes = final_budget_table(sel, read_group)
    if has_depth(every_layer):
        r.depth, r.depth_notes = depth_table(every_layer), undefined(every_layer)

    out = _folder(out)
    earlier = _earlier(out)
    _write_tables(r, out)
    r.figures = _figures(r, options, out)
    r.files |= r.figures
    r.files |= depth_files(every_layer, r.depth, out, options.formats)
    r.files |= _budget_files(r, out, options.formats)
    r.files |= {"report": out / "report.md", "tex": out / "tables.tex"}
    r.files["report"].write_text(markdown(r, options, skipped=skipped))
    r.files["tex"].write_text(latex(r.stats, r.tokens, target, options.controls) + "\n" + errors_latex(sel))
    if options.html:
        r.files["html"] = write_html(r, options, out, skipped=skipped)
    _sweep(out, earlier, r, options.formats)
    return r
