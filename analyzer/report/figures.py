"""The report's figures: target against each metric (the paper's Figures 1-3), the training dynamics, the depth
figure with ``--layers``; each saved as PNG, PDF and SVG, byte-identical from run to run."""
from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axis import Axis
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ncanalyze.analyzer.metric_records import RECORDS
from ncanalyze.analyzer.registry import FIGURE_FORMATS
from ncanalyze.analyzer.schema import PLUGIN_OF
from ncanalyze.analyzer.report.depth import depth_figure
from ncanalyze.analyzer.report.escape import drawn, write_csv
from ncanalyze.analyzer.report.tables import fmt_p
from ncanalyze.analyzer.stats import NoteKind, has_note
from ncanalyze.analyzer.report.ticks import (
    DPI,
    TickedFigure,
    count_text,
    declutter,
    limits,
    set_ticks,
    subplots,
)

LABELS = {r.name: r.label for r in RECORDS if r.label} | {  # panel titles: the metrics' records', then the targets'
    "eval_loss": "validation loss", "val_loss": "validation loss (ncanalyze)"}
FIGURES = {  # file stem: (title, metrics); the paper's Figures 1-3
    "fig1_nc_vs_loss": ("NC properties against {target}",
                        ("nc1_cdnv", "gnc2_log_std", "unc3_cos_cv", "nc4_agreement")),
    "fig2_nc2_vs_gnc2": ("NC2's equinorm and equiangularity and GNC2's mean log kernel against {target}; GNC2's "
                         "hyperspherical uniformity is in Fig. 1",
                         ("nc2_norm_cv", "nc2_cos_std", "gnc2_log_mean")),
    "fig3_nc3_vs_unc3": ("NC3's self-duality and UNC3's uniform duality against {target}",
                         ("nc3_cos_mean", "unc3_cos_cv")),
}
DYNAMICS = ("fig4_dynamics", "Training dynamics: NC properties and {target} against the training step")
TARGET_TITLES = {"eval_loss": "the Trainer's validation loss", "val_loss": "the validation loss measured by ncanalyze"}
BY_STEP = ("fig5_r_by_step", "Between models: r across runs at each step of Figure 1's metrics with {target}")
TITLES = {stem: title for stem, (title, _) in FIGURES.items()} | {DYNAMICS[0]: DYNAMICS[1], BY_STEP[0]: BY_STEP[1]}
FORMATS = FIGURE_FORMATS  # every format a figure can be saved in (ReportSettings.formats picks)


def estimated(metrics: Sequence[str], estimates: str, table: pd.DataFrame) -> tuple[str, ...]:
    """``metrics`` as ``report --estimates`` draws them: with ``debiased``, each plug-in metric whose debiased form
    (schema.PLUGIN_OF) is among ``metrics`` too, with values in ``table``, gives way to that form; with ``plugin``, the
    debiased forms are left out."""
    has = {d for d in PLUGIN_OF if d in metrics and d in table and table[d].notna().any()}
    if estimates == "plugin":
        return tuple(m for m in metrics if m not in PLUGIN_OF)
    plugins = {PLUGIN_OF[d] for d in has}
    return tuple(m for m in metrics if m not in plugins or m in PLUGIN_OF)


def chosen(fig_metrics: Sequence[str], metrics: Sequence[str]) -> list[str]:
    """A figure's metrics among ``metrics``, a plug-in shown as its debiased form where ``metrics`` holds that form
    instead (:func:`estimated`)."""
    debiased = {p: d for d, p in PLUGIN_OF.items()}
    return [m if m in metrics else debiased[m] for m in fig_metrics
            if m in metrics or debiased.get(m) in metrics]

MAX_MARKED_RUNS = 10  # up to this many runs, each gets its own marker (and colour when all sizes are equal)
MARKERS = "osD^v<>pPXh*"
RUN_COLOURS = matplotlib.colormaps["tab10"].colors
_MARGINS = dict(left=0.8, right=0.25, bottom=0.65, top=0.45)  # inches; a fixed layout draws fast
_CBAR_W = 1.35  # inches to the right of the panels for a colour bar and its label
MAX_WIDTH = 2000 / DPI  # inches: no figure is wider than 2000 px; more panels wrap onto further rows
_PANEL_H, _ROW_GAP, _TITLE_LINE = 2.65, 0.8, 0.25  # inches: a panel's height, between rows, a line of the title


def title_target(name: str) -> str:
    """A target as a figure's title names it (no parentheses, so a title never has two in a row).

    Parameters
    ----------
    name
        The target column.

    Returns
    -------
    str
    """
    return TARGET_TITLES.get(name, name)


def label(name: str) -> str:
    """A column's panel title (its name where it has none).

    Parameters
    ----------
    name
        The column.

    Returns
    -------
    str
    """
    return LABELS.get(name, name)


def tag_suffix(tag: str | None) -> str:
    """The file-stem suffix of one tag's figures where a selection holds several tags (``__untagged`` for none).

    Parameters
    ----------
    tag
        The tag, or None.

    Returns
    -------
    str
    """
    return "__" + ("untagged" if tag is None else re.sub(r"[^A-Za-z0-9._-]+", "_", str(tag)))


def _numeric(df: pd.DataFrame, column: str) -> pd.Series:
    """A column as numbers (NaN where absent or not a number)."""
    return pd.to_numeric(df.get(column, pd.Series(np.nan, index=df.index)), errors="coerce")


class _Style:
    """How checkpoints are drawn: colour by size (a log colour scale and a colour bar) when sizes differ, else by
    run; a marker per run, and a legend of runs, when there are at most MAX_MARKED_RUNS."""

    def __init__(self, df: pd.DataFrame):
        self.runs = list(dict.fromkeys(df["run"].astype(str))) if "run" in df else ["all"]
        sizes = _numeric(df, "n_params")
        sizes = sizes[sizes > 0]
        self.norm = LogNorm(sizes.min(), sizes.max()) if sizes.nunique() > 1 else None
        self.size_note = f"all {count_text(sizes.iloc[0])} parameters" if sizes.nunique() == 1 else None
        self.marked = len(self.runs) <= MAX_MARKED_RUNS
        self.cmap = matplotlib.colormaps["viridis"]
        self.ringed = False  # some run's last step is ringed (last_steps)

    def groups(self, d: pd.DataFrame) -> Iterator[tuple]:
        """(run, its rows in step order, marker, colour or colours, line colour) for each run present in ``d``."""
        key = d["run"].astype(str) if "run" in d else pd.Series("all", index=d.index)
        order = "step" if "step" in d else None
        for i, run in enumerate(self.runs):
            g = d[key == run]
            if g.empty:
                continue
            if order:
                g = g.sort_values(order)
            marker = MARKERS[i % len(MARKERS)] if self.marked else "o"
            if self.norm is not None:
                colour = self.cmap(self.norm(g["c"].to_numpy(float)))
                line = self.cmap(self.norm(float(g["c"].iloc[0]))) if g["c"].notna().any() else "0.5"
            else:
                colour = line = RUN_COLOURS[i % len(RUN_COLOURS)] if self.marked else "tab:blue"
            yield run, g, marker, colour, line

    def legend_rows(self) -> int:
        return math.ceil(len(self.runs) / self.legend_cols()) if self.marked else 0

    def legend_cols(self) -> int:
        return min(len(self.runs), 5)

    def finish(self, fig: Figure, w: float, h: float, margins: dict) -> list[Axis]:
        """The colour bar (sizes differ) or a note of the one size, and the legend of runs; returns the Axis
        objects whose ticks were set (the colour bar's)."""
        out = []
        if self.norm is not None:
            cax = fig.add_axes((1 - (_CBAR_W - 0.25) / w, margins["bottom"] / h, 0.15 / w,
                                1 - (margins["bottom"] + margins["top"]) / h))
            cb = fig.colorbar(ScalarMappable(self.norm, self.cmap), cax=cax)
            cb.set_label("parameters (log scale)")
            set_ticks(cb.ax.yaxis, self.norm.vmin, self.norm.vmax, True, count_text)
            out.append(cb.ax.yaxis)
        if self.marked:
            neutral = self.norm is not None
            handles = [Line2D([], [], ls="-", lw=0.8, marker=MARKERS[i % len(MARKERS)], ms=6,
                              color="0.35" if neutral else RUN_COLOURS[i % len(RUN_COLOURS)],
                              mec="black", mew=0.3) for i in range(len(self.runs))]
            fig.legend(handles, [drawn(r) for r in self.runs], loc="lower center", ncol=self.legend_cols(),
                       fontsize=8, frameon=False,
                       title="runs" + (f" ({self.size_note})" if self.size_note else "")
                       + ("; ringed: each run's last step" if self.ringed else ""), title_fontsize=8,
                       bbox_to_anchor=(0.5, 0.0))
        else:
            said = [t for t in (self.size_note, "ringed: each run's last step" if self.ringed else None) if t]
            if said:
                fig.text(0.99, 0.01, "; ".join(said), ha="right", va="bottom", fontsize=8)
        return out


def grid(k: int, panel_w: float, gap: float, colour_bar: bool) -> tuple[int, int]:
    """(rows, columns) for k panels: as many columns as fit in :data:`MAX_WIDTH` with the margins, the panels
    spread evenly over the rows (4 panels: 2 x 2, not 3 + 1)."""
    room = MAX_WIDTH - _MARGINS["left"] - _MARGINS["right"] - (_CBAR_W if colour_bar else 0.0)
    most = max(1, int((room + gap) // (panel_w + gap)))
    rows = -(-k // most)
    return rows, -(-k // rows)


def _frame(k: int, style: _Style, title: str, panel_w: float = 3.9, gap: float = 0.15, sharey: bool = True):
    """A figure of k panels (wrapped onto rows at :data:`MAX_WIDTH`), with the fixed margins, the title wrapped to
    the width, room for a colour bar and the legend of runs; returns (fig, the k panels, w, h, margins, title)."""
    rows, cols = grid(k, panel_w, gap, style.norm is not None)
    m = dict(_MARGINS)
    m["right"] += _CBAR_W if style.norm is not None else 0.0
    m["bottom"] += 0.18 * (style.legend_rows() + 1) + 0.1 if style.marked else 0.0
    w = panel_w * cols + gap * (cols - 1) + m["left"] + m["right"]
    title = textwrap.fill(title, width=int(w * 72 / (12 * 0.55)))  # characters of 12 pt text across the width
    m["top"] += _TITLE_LINE * (title.count("\n") + 1)
    h = _PANEL_H * rows + _ROW_GAP * (rows - 1) + m["bottom"] + m["top"]
    fig, axes = subplots(rows, cols, TickedFigure, sharey=sharey, squeeze=False, figsize=(w, h))
    for ax in axes.flat[k:]:
        ax.remove()
    fig.subplots_adjust(left=m["left"] / w, right=1 - m["right"] / w, bottom=m["bottom"] / h, top=1 - m["top"] / h,
                        wspace=gap * cols / (w - m["left"] - m["right"] - gap * (cols - 1)),
                        hspace=_ROW_GAP * rows / (h - m["bottom"] - m["top"] - _ROW_GAP * (rows - 1)))
    return fig, list(axes.flat[:k]), w, h, m, title


def _log_scale(values: pd.Series, m: str, stats: pd.DataFrame | None) -> bool:
    """A log axis for a positive metric, unless its statistics found it not positive."""
    if not (values > 0).all():
        return False
    if stats is None or m not in set(stats.metric):
        return True
    st = stats[(stats.metric == m) & (stats.scale == "log")]
    return st.empty or not has_note(st, NoteKind.NOT_POSITIVE).iloc[0]


def _no_values(ax, m: str) -> None:
    ax.text(0.5, 0.5, f"{m}:\nno values", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])


def design_text(s: pd.Series, runs: pd.Series) -> str:
    """What a panel's R² rests on, for its legend: the runs and checkpoints, and the permutation p with its unit
    (``p_runs`` where whole runs, or runs of one checkpoint, are permuted; ``p_rows`` where rows of one run are) and
    its floor where every permutation was counted (exact p: 2/N, equal-tailed), e.g. "p_runs = 0.250 (min 2/24)\n4 runs ×
    4 ckpts".

    Parameters
    ----------
    s
        The panel's statistics row (:func:`ncanalyze.analyzer.stats.correlations`, one scale).
    runs
        The run of each point drawn.

    Returns
    -------
    str
    """
    per_run = runs.astype(str).value_counts()
    k, each = len(per_run), int(per_run.iloc[0])
    design = (f"{k} run{'s' * (k != 1)} × {each} ckpt{'s' * (each != 1)}" if per_run.nunique() == 1
              else f"{k} runs, {int(s.n)} ckpts")
    if not s.n_perm or not np.isfinite(s.p_perm):
        return f"no permutation p\n{design}"
    unit = "runs" if s.perm_scheme != "rows" or per_run.max() == 1 else "rows"
    few = ((" (min 1)" if s.p_floor >= 1 else f" (min 2/{int(s.n_distinct_perms)})") if s.exact  # p's floor
           else "")
    return f"p_{unit} = {fmt_p(s.p_perm)}{few}\n{design}"


def r2_text(st: pd.DataFrame, log: bool, symbol: str = "$R^2$") -> str:
    """A panel's R² with the scale it is on: the drawn scale's ("$R^2$ (log x) = 0.67") and, on a log axis, the
    raw one beside it ("raw x: 0.93"), so the figure and the tables read the same number.

    Parameters
    ----------
    st
        The metric's statistics rows indexed by scale ("raw", "log").
    log
        Whether the panel's x axis is the log scale.
    symbol
        How R² is written (mathtext in the PNGs, "R²" in report.html).

    Returns
    -------
    str
    """
    def value(scale: str) -> str:
        r2 = st.r2.get(scale, np.nan) if scale in st.index else np.nan
        return f"{r2:.2f}" if np.isfinite(r2) else "n/a"

    if not log:
        return f"{symbol} (raw x) = {value('raw')}"
    return f"{symbol} (log x) = {value('log')}, raw x: {value('raw')}"


def last_steps(ax, style: _Style, d: pd.DataFrame) -> None:
    """A trajectory's direction: a ring around each run's last step where a run has several checkpoints (the
    legend of runs, or a note, says so)."""
    ends = [g.iloc[[-1]] for _, g, _, _, _ in style.groups(d) if len(g) > 1]
    if ends:
        end = pd.concat(ends)
        ax.scatter(end.x, end.y, s=90, facecolors="none", edgecolors="black", linewidths=0.9, zorder=2.5,
                   gid="last-steps")
        style.ringed = True


def _scatter_panel(ax, d: pd.DataFrame, m: str, st: pd.DataFrame, style: _Style, log: bool) -> None:
    """One metric's panel: each run's checkpoints joined in step order, the points, the least-squares line and R²."""
    if log:
        ax.set_xscale("log")
    points = []
    for run, g, marker, colour, line in style.groups(d):
        if len(g) > 1:
            ax.plot(g.x, g.y, "-", lw=0.6, color=line, alpha=0.6, zorder=1)
        points.append((g, marker, [colour] if isinstance(colour, tuple | str) else list(colour)))
    if not style.marked:  # one marker for all: one collection draws much faster than one per run
        points = [(pd.concat([g for g, _, _ in points]), "o", [c for _, _, cs in points for c in cs])]
    for g, marker, colours in points:
        ax.scatter(g.x, g.y, s=26, marker=marker, c=colours, edgecolors="black", linewidths=0.3, zorder=2)
    s = st.loc["log" if log else "raw"]
    if np.isfinite(s.r):
        u = np.log10(d.x) if log else d.x
        slope, icept = np.polyfit(u, d.y, 1)
        line = np.linspace(u.min(), u.max(), 50)
        ax.plot(10 ** line if log else line, icept + slope * line, "--", color="crimson", zorder=3,
                label=f"fit: {r2_text(st, log)}\n{design_text(s, d.run)}")
    else:
        ax.plot([], [], " ", label=f"{r2_text(st, log)}\n{design_text(s, d.run)}")
    last_steps(ax, style, d)
    ax.legend(loc="best", fontsize=8, framealpha=0.85)
    ax.set_xlabel(m + (" (log scale)" if log else ""))
    set_ticks(ax.xaxis, *limits(d.x, log), log)
    error_bars(ax, d, "x", size=math.sqrt(26))
    ax.grid(alpha=0.3, which="major")


def _error(df: pd.DataFrame, m: str) -> pd.Series:
    """``m``'s jackknife error column (``<m>_se``), nan where there is none."""
    return pd.to_numeric(df[f"{m}_se"], errors="coerce") if f"{m}_se" in df else pd.Series(np.nan, index=df.index)


def error_bars(ax, d: pd.DataFrame, along: str, size: float) -> int:
    """Each point's jackknife error (``d.e``) as a bar along ``along`` ("x" or "y") where the bar is wider than
    the marker (``size`` points across); call once the axis limits are set. Returns the bars drawn."""
    fig = ax.figure
    e = d.e if "e" in d else pd.Series(dtype=float)
    ok = d[np.isfinite(e) & (e > 0)] if len(e) else d.iloc[:0]
    if ok.empty:
        return 0
    lo, hi = ok[along] - ok.e, ok[along] + ok.e
    other = ok["y" if along == "x" else "x"]
    a = np.column_stack([lo, other] if along == "x" else [other, lo])
    b = np.column_stack([hi, other] if along == "x" else [other, hi])
    with np.errstate(invalid="ignore"):
        span = np.abs(ax.transData.transform(b) - ax.transData.transform(a))[:, 0 if along == "x" else 1]
    wide = ok[np.isfinite(span) & (span > size * fig.dpi / 72)]
    if wide.empty:
        return 0
    kw = {"xerr": wide.e} if along == "x" else {"yerr": wide.e}
    ax.errorbar(wide.x, wide.y, fmt="none", ecolor="0.35", elinewidth=0.7, capsize=1.5, zorder=1.5, **kw)
    return len(wide)


def scatter_figure(df: pd.DataFrame, metrics: Sequence[str], target: str, stats: pd.DataFrame, title: str) -> Figure:
    """One panel per metric: the target against the metric.

    A log axis where the metric is positive, each run's checkpoints joined by a thin line in step order, coloured
    by n_params on a log colour scale (by run when all sizes are equal), a marker per run and a legend of runs when
    they are few; the least-squares line with its R².

    Parameters
    ----------
    df
        The checkpoints (one row each).
    metrics
        The metric columns, one panel each.
    target
        The target column (the shared y axis).
    stats
        :func:`ncanalyze.analyzer.stats.correlations` of ``df`` (the R² and the log scale of each metric).
    title
        The figure's title.

    Returns
    -------
    matplotlib.figure.Figure
    """
    style = _Style(df)
    fig, axes, w, h, margins, title = _frame(len(metrics), style, title)
    sizes, step = _numeric(df, "n_params"), _numeric(df, "global_step")
    y_all = pd.to_numeric(df[target], errors="coerce").replace([np.inf, -np.inf], np.nan).dropna()
    ticked = []
    for ax, m in zip(axes, metrics):
        st = stats[(stats.metric == m)].set_index("scale") if m in set(stats.metric) else None
        ax.set_title(label(m), fontsize=10)
        d = pd.DataFrame({"x": pd.to_numeric(df[m], errors="coerce"), "y": pd.to_numeric(df[target], errors="coerce"),
                          "c": sizes, "step": step, "run": df["run"] if "run" in df else "all", "e": _error(df, m)})
        d = d.replace([np.inf, -np.inf], np.nan).dropna(subset=["x", "y"])
        if st is None or d.empty:
            _no_values(ax, m)
            continue
        _scatter_panel(ax, d, m, st, style, _log_scale(d.x, m, stats))
        ticked.append(ax.xaxis)
    if not y_all.empty:
        set_ticks(axes[0].yaxis, *limits(y_all, False), False)
        ticked.append(axes[0].yaxis)
    for ax in axes:
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel(label(target))
    ticked += style.finish(fig, w, h, margins)
    fig.suptitle(title)
    declutter(fig, ticked)
    return fig


def dynamics_figure(df: pd.DataFrame, metrics: Sequence[str], target: str, stats: pd.DataFrame | None,
                    title: str) -> Figure:
    """One panel per metric and one for the target, each against global_step.

    The step on a log axis (global_step + 1 when a checkpoint is at step 0), one line per run in step order,
    coloured by size (by run when sizes are equal).

    Parameters
    ----------
    df
        The checkpoints (one row each), with a global_step column.
    metrics
        The metric columns, one panel each.
    target
        The target column (the last panel).
    stats
        The correlations of ``df`` (whether a metric is drawn on a log axis), or None.
    title
        The figure's title.

    Returns
    -------
    matplotlib.figure.Figure
    """
    style = _Style(df)
    columns = list(metrics) + [target]
    fig, axes, w, h, margins, title = _frame(len(columns), style, title, panel_w=3.0, gap=0.8, sharey=False)
    step = pd.to_numeric(df["global_step"], errors="coerce")
    shift = 1 if (step == 0).any() else 0
    sizes = _numeric(df, "n_params")
    ticked = []
    for ax, m in zip(axes, columns):
        ax.set_title(label(m), fontsize=10)
        d = pd.DataFrame({"x": step + shift, "y": pd.to_numeric(df[m], errors="coerce"), "c": sizes, "step": step,
                          "run": df["run"] if "run" in df else "all", "e": _error(df, m)})
        d = d.replace([np.inf, -np.inf], np.nan).dropna(subset=["x", "y"])
        d = d[d.x > 0]
        if d.empty:
            _no_values(ax, m)
            continue
        ax.set_xscale("log")
        ylog = m != target and _log_scale(d.y, m, stats)
        if ylog:
            ax.set_yscale("log")
        for run, g, marker, colour, line in style.groups(d):
            ax.plot(g.x, g.y, "-", lw=1.0, color=line, marker=marker, ms=4.5, mec="black", mew=0.3, label=run,
                    gid=f"run:{run}")
        ax.set_xlabel("global step" + (" + 1" if shift else "") + " (log scale)")
        set_ticks(ax.xaxis, *limits(d.x, True), True)
        set_ticks(ax.yaxis, *limits(d.y, ylog), ylog)
        error_bars(ax, d, "y", size=4.5)
        ticked += [ax.xaxis, ax.yaxis]
        ax.grid(alpha=0.3, which="major")
    ticked += style.finish(fig, w, h, margins)
    fig.suptitle(title)
    declutter(fig, ticked)
    return fig


def save_figure(fig: Figure, out: Path, stem: str, formats: Sequence[str] = FORMATS) -> Path:
    """Save a figure as PNG (150 dpi), PDF with embedded TrueType fonts (fonttype 42) and SVG (those of ``formats``),
    byte-identical from run to run (no dates, fixed SVG ids), and close it; its files in the formats left out (an
    earlier report's) are removed, not left stale beside the new ones.

    Parameters
    ----------
    fig
        The figure.
    out
        The folder.
    stem
        The file name without its extension.
    formats
        The formats written (PNG among them).

    Returns
    -------
    Path
        The PNG's path.
    """
    undated = {"png": None, "pdf": {"CreationDate": None}, "svg": {"Date": None}}
    with matplotlib.rc_context({"pdf.fonttype": 42, "ps.fonttype": 42, "svg.hashsalt": "ncanalyze"}):
        for ext in FORMATS:
            if ext in formats:
                fig.savefig(out / f"{stem}.{ext}", dpi=DPI if ext == "png" else "figure", metadata=undated[ext])
            else:
                (out / f"{stem}.{ext}").unlink(missing_ok=True)
    return out / f"{stem}.png"


def draw_figures(sel: pd.DataFrame, metrics: Sequence[str], target: str, stats: pd.DataFrame,
                 out: Path, suffix: str = "", formats: Sequence[str] = FORMATS) -> dict[str, Path]:
    """Figures 1-3 with the chosen metrics each shows, and the training dynamics when the checkpoints span two
    steps or more.

    Parameters
    ----------
    sel
        The selected checkpoints (their last layer).
    metrics
        The metrics of the report (a figure shows those of its own that are among them; a figure with none is left
        out).
    target
        The target column.
    stats
        The correlations of ``sel``.
    out
        The folder the figures are saved in (:func:`save_figure`).
    suffix
        Added to each file stem and key (``__<tag>``: one tag's figures where the selection holds several).
    formats
        The formats saved (:func:`save_figure`).

    Returns
    -------
    dict of str to Path
        Each figure's PNG by file stem (with the suffix), in the order drawn.
    """
    figures = {}
    for stem, (title, fig_metrics) in FIGURES.items():
        shown = chosen(fig_metrics, metrics)
        if shown:
            fig = scatter_figure(sel, shown, target, stats, title.format(target=title_target(target)))
            figures[stem + suffix] = save_figure(fig, out, stem + suffix, formats)
    shown = chosen(FIGURES["fig1_nc_vs_loss"][1], metrics)
    if "global_step" in sel and pd.to_numeric(sel.global_step, errors="coerce").nunique() >= 2:  # else no dynamics
        stem, title = DYNAMICS
        fig = dynamics_figure(sel, shown, target, stats, title.format(target=title_target(target)))
        figures[stem + suffix] = save_figure(fig, out, stem + suffix, formats)
    return figures


def depth_files(df: pd.DataFrame, table: pd.DataFrame | None, out: Path,
                formats: Sequence[str] = FORMATS) -> dict[str, Path]:
    """With a checkpoint of several layers: the depth figure (depth.png, .pdf, .svg) and the per-layer table
    (layers.csv).

    Parameters
    ----------
    df
        The selected rows of every layer.
    table
        Their :func:`ncanalyze.analyzer.report.depth.depth_table`, or None without layers.
    out
        The folder.

    Returns
    -------
    dict of str to Path
        ``depth`` and ``layers`` by name; empty without layers.
    """
    if table is None:
        return {}
    files = {"depth": save_figure(depth_figure(df, labels=LABELS), out, "depth", formats), "layers": out / "layers.csv"}
    write_csv(table, files["layers"])
    return files


def step_r_figure(steps: pd.DataFrame, stats: pd.DataFrame, metrics: Sequence[str], title: str) -> Figure:
    """Between models, step by step: the r across runs at each step of each metric (log scale where it has one),
    filled where its permutation p < 0.05; a dashed line at the pooled r; a metric whose sign flips says so in
    the legend, which also gives within training beyond what all runs share at a step (the fixed-effects r, p).

    Parameters
    ----------
    steps
        :func:`ncanalyze.analyzer.stats.by_step` of one tag.
    stats
        The correlations of the same rows (the pooled r and the notes).
    metrics
        The metrics drawn.
    title
        The figure's title.

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, ax = subplots(figsize=(7.5, 4.2), dpi=DPI)
    flipped = set(stats.metric[has_note(stats, NoteKind.SIGN_FLIP)]) if "note_kinds" in stats else set()
    for i, m in enumerate(metrics):
        mine = steps[steps.metric == m]
        scale = "log" if mine[mine.scale == "log"].r.notna().any() else "raw"
        d = mine[mine.scale == scale].sort_values("step")
        if d.r.notna().sum() == 0:
            continue
        colour = RUN_COLOURS[i % len(RUN_COLOURS)]
        row = stats[(stats.metric == m) & (stats.scale == scale)]
        within = (f"; within beyond the shared trend r {row.within_r.iloc[0]:+.2f} (p {fmt_p(row.within_p.iloc[0])})"
                  if len(row) and "within_p" in row and np.isfinite(row.within_p.iloc[0]) else "")
        name = m + (" (log)" if scale == "log" else "") + (": sign flips" if m in flipped else "") + within
        ax.plot(d.step, d.r, "-", color=colour, label=name)
        sig = d.p_perm.astype(float) < 0.05
        ax.plot(d.step[sig], d.r[sig], "o", color=colour)
        ax.plot(d.step[~sig], d.r[~sig], "o", mfc="white", color=colour)
        pooled = stats[(stats.metric == m) & (stats.scale == scale)].r
        if len(pooled) and np.isfinite(pooled.iloc[0]):
            ax.axhline(pooled.iloc[0], color=colour, ls="--", lw=0.8)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set(xlabel="training step", ylabel="r across runs at the step", ylim=(-1.05, 1.05))
    ax.legend(fontsize=7, loc="best", title="filled: p < 0.05 at the step; dashed: pooled r", title_fontsize=7)
    fig.suptitle("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    fig.tight_layout()
    return fig


def draw_step_figure(steps: pd.DataFrame, stats: pd.DataFrame, metrics: Sequence[str], target: str, out: Path,
                     suffix: str = "", formats: Sequence[str] = FORMATS) -> dict[str, Path]:
    """The per-step r figure (:func:`step_r_figure`) of Figure 1's metrics among ``metrics``, saved in ``formats``
    (:func:`save_figure`); nothing where no step is shared by enough runs."""
    shown = [m for m in chosen(FIGURES["fig1_nc_vs_loss"][1], metrics) if m in set(steps.metric)]
    if not shown or steps.r.notna().sum() == 0:
        return {}
    stem, title = BY_STEP
    fig = step_r_figure(steps, stats, shown, title.format(target=title_target(target)))
    return {stem + suffix: save_figure(fig, out, stem + suffix, formats)}
