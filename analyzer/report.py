"""Tables and figures of a study from its metrics table (one row per checkpoint): CSV, Markdown, LaTeX, and
PNG, PDF and SVG figures."""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import xarray as xr  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import (FixedFormatter, FixedLocator, LogLocator, MaxNLocator, NullFormatter,  # noqa: E402
                               NullLocator)

from ncanalyze.analyzer.depth import TITLE, depth_figure, depth_table, has_depth, last_layer  # noqa: E402
from ncanalyze.analyzer.errors import UserError  # noqa: E402
from ncanalyze.analyzer.schema import INFO as ID_COLUMNS  # noqa: E402
from ncanalyze.analyzer.expr import condition  # noqa: E402
from ncanalyze.analyzer.stats import CONTROLS, METRICS, MIN_N, correlations  # noqa: E402
LABELS = {  # panel titles
    "nc1_cdnv": "NC1: within-class variability (CDNV)", "nc1_cdnv_p2": "NC1: CDNV, squared distances",
    "nc1_trace": "NC1: Tr(Σ_W Σ_B⁺)/K", "nc2_norm_cv": "NC2: equinorm (CV of norms)",
    "nc2_lognorm_std": "NC2: std of log norms", "nc2_cos_mean": "NC2: mean cosine",
    "nc2_cos_std": "NC2: equiangularity (std of cosines)", "nc2_etf_error": "NC2: distance to simplex ETF",
    "gnc2_log_mean": "GNC2: mean log inverse distance", "gnc2_log_std": "GNC2: hyperspherical uniformity",
    "nc3_cos_mean": "NC3: self-duality (mean cosine)", "unc3_cos_cv": "UNC3: uniform duality (CV of cosines)",
    "nc3_dual_error": "NC3: distance to self-dual ETF", "nc4_agreement": "NC4: agreement with nearest class mean",
    "eval_loss": "validation loss", "val_loss": "validation loss (measured by ncanalyze)",
}
FIGURES = {  # file stem: (title, metrics); the paper's Figures 1-3
    "fig1_nc_vs_loss": ("NC properties against {target}",
                        ("nc1_cdnv", "gnc2_log_std", "unc3_cos_cv", "nc4_agreement")),
    "fig2_nc2_vs_gnc2": ("Equinorm and equiangularity (NC2) and GNC2's mean log kernel against {target} "
                         "(GNC2's hyperspherical uniformity: Fig. 1)",
                         ("nc2_norm_cv", "nc2_cos_std", "gnc2_log_mean")),
    "fig3_nc3_vs_unc3": ("Self-duality (NC3) against uniform duality (UNC3), both against {target}",
                         ("nc3_cos_mean", "unc3_cos_cv")),
}
TOKEN_VARIABLES = {"count": "count", "variance": "variance", "class_norm": "norm", "class_cdnv": "mean CDNV",
                   "class_interference": "mean interference", "class_duality": "duality cos", "class_nc4": "NC4 rate"}
AVERAGE_TOKEN = "(average token)"


def label(name: str) -> str:
    return LABELS.get(name, name)


def select(df: pd.DataFrame, where: str | None) -> pd.DataFrame:
    """The rows matching ``where``, a condition over the table's columns in pandas query syntax evaluated by
    :mod:`ncanalyze.analyzer.expr` (never as code); all rows without one."""
    if not where:
        return df
    out = df[condition(where, df, "--where")]
    if out.empty:
        raise UserError(f"no checkpoint matches --where {where!r} ({len(df)} in the table)")
    return out


MISSING = "—"


def fmt_p(p: float) -> str:
    return MISSING if not np.isfinite(p) else f"{p:.3f}" if p >= 1e-3 else f"{p:.1e}"


def fmt(x: float, digits: int = 3) -> str:
    return MISSING if not np.isfinite(x) else f"{x:.{digits}f}"


def summary(stats: pd.DataFrame) -> pd.DataFrame:
    """One display row per metric: n, and R², r, permutation p (and Holm-adjusted) and the partial r with its
    Freedman-Lane p (and Holm-adjusted), raw and on log scale. Empty cells are explained in the notes."""
    r2 = "R²"
    rows = []
    for metric, s in stats.groupby("metric", sort=False):
        row = {"metric": metric, "n": int(s.n.max())}
        for _, t in s.iterrows():
            sfx = " (log)" if t.scale == "log" else ""
            row |= {r2 + sfx: fmt(t.r2), "r" + sfx: fmt(t.r), "p" + sfx: fmt_p(t.p_perm),
                    "p Holm" + sfx: fmt_p(t.get("p_holm", np.nan)), "partial r" + sfx: fmt(t.partial_r),
                    "p FL" + sfx: fmt_p(t.partial_p_perm), "p FL Holm" + sfx: fmt_p(t.get("partial_p_holm", np.nan))}
        rows.append(row)
    return pd.DataFrame(rows)


def survivors(stats: pd.DataFrame, alpha: float = 0.05) -> list[str]:
    """Sentences: per scale, how many of the metrics tested keep p < alpha after Holm's adjustment, for r and for
    the partial r, and which."""
    out = []
    for scale, what in (("raw", "raw scale"), ("log", "log scale")):
        rows = stats[stats.scale == scale]
        for col, name in (("p_holm", "r"), ("partial_p_holm", "partial r")):
            if col not in rows:
                continue
            tested = rows[np.isfinite(rows[col].astype(float))]
            if tested.empty:
                continue
            ok = tested[tested[col] < alpha]
            out.append(f"{name}, {what}: {len(ok)} of {len(tested)} metric(s) survive at {alpha:g}"
                       + (f" ({', '.join(ok.metric)})" if len(ok) else ""))
    return out


def code(text: str) -> str:
    """Markdown inline code that may itself contain backticks (a backticked column name)."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def controls_text(controls: Sequence[str], code=code, how: str = " (pingouin.partial_corr)") -> str:
    """'controlling for a, b (how)', or what the partial r is without controls."""
    if not controls:
        return "with no controls, equal to r"
    return "controlling for " + ", ".join(code(c) for c in controls) + how


def notes(stats: pd.DataFrame) -> list[str]:
    """Each distinct note with the metrics it applies to ('metric (log)' when it holds for one scale only, 'every
    metric' when it holds for every row with statistics)."""
    atoms = stats.assign(note=stats.note.str.split("; ")).explode("note")
    atoms = atoms[atoms.note.fillna("") != ""]
    computed = set(stats.index[stats.r.notna()])
    out = []
    for note, g in atoms.groupby("note", sort=False):
        if computed and computed <= set(g.index):
            out.append(f"{note}: every metric")
            continue
        scales = g.groupby("metric", sort=False).scale.apply(list)
        names = [m if len(sc) == 2 else f"{m} ({sc[0]})" for m, sc in scales.items()]
        out.append(f"{note}: {', '.join(names)}")
    return out


# ------------------------------------------------------------------ figures

MAX_MARKED_RUNS = 10  # up to this many runs, each gets its own marker (and colour when all sizes are equal)
MARKERS = "osD^v<>pPXh*"
RUN_COLOURS = plt.get_cmap("tab10").colors
MIN_TICK_LABELS = 3
_MARGINS = dict(left=0.8, right=0.25, bottom=0.65, top=0.7)  # inches; a fixed layout draws fast
_CBAR_W = 1.35  # inches to the right of the panels for a colour bar and its label


def _nice_linear(lo: float, hi: float, nbins: int = 5) -> list[float]:
    ticks = MaxNLocator(nbins=nbins, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
    eps = 1e-9 * (hi - lo or abs(hi) or 1)
    return [float(t) for t in ticks if lo - eps <= t <= hi + eps]


def tick_values(lo: float, hi: float, log: bool) -> tuple[list[float], bool]:
    """At least MIN_TICK_LABELS ticks inside [lo, hi] (the axis limits): on a log axis decades (every k-th of
    many), else 1-2-5 of each decade, else evenly spaced values (a range under a factor of ~5); on a linear axis
    evenly spaced values. Returns the ticks and whether they are evenly spaced."""
    if log and lo > 0:
        e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        inside = lambda vs: [v for v in vs if lo <= v <= hi]  # noqa: E731
        decades = inside([10.0 ** e for e in range(e0, e1 + 1)])
        if len(decades) > 7:
            decades = decades[::math.ceil(len(decades) / 6)]
        if len(decades) >= MIN_TICK_LABELS:
            return decades, False
        for subs in ((1, 2, 5), (1, 2, 3, 5)):
            ticks = inside([m * 10.0 ** e for e in range(e0, e1 + 1) for m in subs])
            if MIN_TICK_LABELS <= len(ticks) <= 7:
                return ticks, False
    for nbins in (5, 6, 8):
        ticks = _nice_linear(lo, hi, nbins)
        if len(ticks) >= MIN_TICK_LABELS:
            return ticks, True
    return ticks, True


def _sci(v: float) -> str:
    """A compact label: plain between 1e-3 and 1e4, else m×10^e in mathtext."""
    if v == 0 or 1e-3 <= abs(v) < 1e4:
        return f"{v:.4g}"
    e = math.floor(math.log10(abs(v)))
    m = float(f"{v / 10 ** e:.3g}")
    return f"$10^{{{e}}}$" if m == 1 else f"${m:g}{{\\times}}10^{{{e}}}$"


def tick_labels(ticks: Sequence[float], even: bool) -> list[str]:
    """Labels of ``ticks``: evenly spaced ones with the decimals their step needs (scientific when all are tiny
    or huge), others compactly one by one."""
    if not even or len(ticks) < 2:
        return [_sci(v) for v in ticks]
    step = min(b - a for a, b in zip(ticks, ticks[1:]))
    big = max(abs(v) for v in ticks)
    if big and not 1e-3 <= big < 1e5:
        e = math.floor(math.log10(big))
        digits = max(0, e - math.floor(math.log10(step)))
        return ["0" if v == 0 else f"${v / 10 ** e:.{digits}f}{{\\times}}10^{{{e}}}$" for v in ticks]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    while decimals < 10 and any(abs(float(f"{v:.{decimals}f}") - v) > 1e-6 * step for v in ticks):
        decimals += 1  # 0.975 is "0.975", not "0.98"
    return [f"{v:.{decimals}f}" for v in ticks]


def human(v: float) -> str:
    """A parameter count as 22K, 1.2M, 7B."""
    for unit, f in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(v) >= f:
            return f"{v / f:.3g}{unit}"
    return f"{v:.3g}"


def set_ticks(axis, lo: float, hi: float, log: bool, fmt=None) -> None:
    """Limits [lo, hi] and several labelled ticks inside them on a matplotlib Axis (x, y or a colour bar's)."""
    ticks, even = tick_values(lo, hi, log)
    labels = [fmt(v) for v in ticks] if fmt else tick_labels(ticks, even)
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FixedFormatter(labels))
    axis.set_minor_formatter(NullFormatter())
    if log:
        axis.set_minor_locator(LogLocator(subs="auto") if math.log10(hi / lo) > 1 else NullLocator())
    else:
        axis.set_minor_locator(NullLocator())
    axis.set_view_interval(lo, hi, ignore=True)


def limits(values: pd.Series, log: bool) -> tuple[float, float]:
    """Axis limits around the values with a small margin; a single value gets a range of ±10% (or ±0.5 at 0)."""
    lo, hi = float(values.min()), float(values.max())
    if log:
        pad = max((hi / lo) ** 0.05, 1.02) if hi > lo else 1.1
        return lo / pad, hi * pad
    span = hi - lo if hi > lo else (abs(hi) * 0.2 or 1.0)
    pad = 0.05 * span if hi > lo else span / 2
    return lo - pad, hi + pad


def overlapping_labels(axis, renderer) -> bool:
    """Whether two visible, non-empty tick labels of the axis overlap (their rendered bounding boxes)."""
    boxes = [t.get_window_extent(renderer) for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def _declutter(fig, axes: Sequence) -> None:
    """Where tick labels overlap (long labels on a narrow panel), blank every other one, keeping their ticks and
    at least MIN_TICK_LABELS labels: by rendered text extents, not by a guess at the font."""
    for _ in range(3):
        fig.draw_without_rendering()  # lays the text out (the extents below) without rasterizing
        renderer = fig.canvas.get_renderer()
        crowded = [a for a in axes if overlapping_labels(a, renderer)]
        if not crowded:
            return
        for axis in crowded:
            labels = [t.get_text() for t in axis.get_ticklabels()]
            shown = [i for i, t in enumerate(labels) if t]
            if len(shown) // 2 + len(shown) % 2 < MIN_TICK_LABELS:
                for t in axis.get_ticklabels():
                    t.set_fontsize(t.get_fontsize() * 0.8)
                continue
            keep = set(shown[::2])
            axis.set_major_formatter(FixedFormatter([t if i in keep else "" for i, t in enumerate(labels)]))


class _Style:
    """How checkpoints are drawn: colour by size (a log colour scale and a colour bar) when sizes differ, else by
    run; a marker per run, and a legend of runs, when there are at most MAX_MARKED_RUNS."""

    def __init__(self, df: pd.DataFrame):
        self.runs = list(dict.fromkeys(df["run"].astype(str))) if "run" in df else ["all"]
        sizes = pd.to_numeric(df.get("n_params", pd.Series(np.nan, index=df.index)), errors="coerce")
        sizes = sizes[sizes > 0]
        self.norm = LogNorm(sizes.min(), sizes.max()) if sizes.nunique() > 1 else None
        self.size_note = f"all {human(sizes.iloc[0])} parameters" if sizes.nunique() == 1 else None
        self.marked = len(self.runs) <= MAX_MARKED_RUNS
        self.cmap = plt.get_cmap("viridis")

    def groups(self, d: pd.DataFrame):
        """(run, its rows in step order, marker, colour or colours) for each run present in ``d``."""
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

    def finish(self, fig, w: float, h: float, margins: dict, labels: list[str] = ()) -> list:
        """The colour bar (sizes differ) or a note of the one size, and the legend of runs; returns the Axis
        objects whose ticks were set (the colour bar's)."""
        out = []
        if self.norm is not None:
            cax = fig.add_axes((1 - (_CBAR_W - 0.25) / w, margins["bottom"] / h, 0.15 / w,
                                1 - (margins["bottom"] + margins["top"]) / h))
            cb = fig.colorbar(plt.cm.ScalarMappable(self.norm, self.cmap), cax=cax)
            cb.set_label("parameters (log scale)")
            set_ticks(cb.ax.yaxis, self.norm.vmin, self.norm.vmax, True, human)
            out.append(cb.ax.yaxis)
        if self.marked:
            neutral = self.norm is not None
            handles = [Line2D([], [], ls="-", lw=0.8, marker=MARKERS[i % len(MARKERS)], ms=6,
                              color="0.35" if neutral else RUN_COLOURS[i % len(RUN_COLOURS)],
                              mec="black", mew=0.3) for i in range(len(self.runs))]
            fig.legend(handles, self.runs, loc="lower center", ncol=self.legend_cols(), fontsize=8, frameon=False,
                       title="runs" + (f" ({self.size_note})" if self.size_note else ""), title_fontsize=8,
                       bbox_to_anchor=(0.5, 0.0))
        elif self.size_note:
            fig.text(0.99, 0.01, self.size_note, ha="right", va="bottom", fontsize=8)
        return out


def _frame(k: int, style: _Style, panel_w: float = 3.9, gap: float = 0.15, sharey: bool = True):
    """A figure of k panels in a row, with the fixed margins, room for a colour bar and the legend of runs."""
    m = dict(_MARGINS)
    m["right"] += _CBAR_W if style.norm is not None else 0.0
    m["bottom"] += 0.18 * (style.legend_rows() + 1) + 0.1 if style.marked else 0.0
    w = panel_w * k + gap * (k - 1) + m["left"] + m["right"]
    h = 4.0 - 0.65 + m["bottom"]
    fig, axes = plt.subplots(1, k, figsize=(w, h), sharey=sharey, squeeze=False)
    fig.subplots_adjust(left=m["left"] / w, right=1 - m["right"] / w, bottom=m["bottom"] / h, top=1 - m["top"] / h,
                        wspace=gap * k / (w - m["left"] - m["right"] - gap * (k - 1)))
    return fig, axes[0], w, h, m


def _log_scale(values: pd.Series, m: str, stats: pd.DataFrame | None) -> bool:
    if not (values > 0).all():
        return False
    if stats is None or m not in set(stats.metric):
        return True
    st = stats[(stats.metric == m) & (stats.scale == "log")]
    return st.empty or "not positive" not in str(st.note.iloc[0])


def scatter_figure(df: pd.DataFrame, metrics: Sequence[str], target: str, stats: pd.DataFrame, title: str):
    """One panel per metric: target against the metric (log axis where the metric is positive), each run's
    checkpoints joined by a thin line in step order, coloured by n_params on a log colour scale (by run when all
    sizes are equal), a marker per run and a legend of runs when they are few; the least-squares line with its R²."""
    style = _Style(df)
    fig, axes, w, h, margins = _frame(len(metrics), style)
    sizes = pd.to_numeric(df.get("n_params", pd.Series(np.nan, index=df.index)), errors="coerce")
    step = pd.to_numeric(df.get("global_step", pd.Series(np.nan, index=df.index)), errors="coerce")
    y_all = pd.to_numeric(df[target], errors="coerce").replace([np.inf, -np.inf], np.nan).dropna()
    ticked = []
    for ax, m in zip(axes, metrics):
        st = stats[(stats.metric == m)].set_index("scale") if m in set(stats.metric) else None
        ax.set_title(label(m), fontsize=10)
        d = pd.DataFrame({"x": pd.to_numeric(df[m], errors="coerce"), "y": pd.to_numeric(df[target], errors="coerce"),
                          "c": sizes, "step": step, "run": df["run"] if "run" in df else "all"})
        d = d.replace([np.inf, -np.inf], np.nan).dropna(subset=["x", "y"])
        if st is None or d.empty:
            ax.text(0.5, 0.5, f"{m}:\nno values", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            continue
        log = _log_scale(d.x, m, stats)
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
            grid = np.linspace(u.min(), u.max(), 50)
            ax.plot(10 ** grid if log else grid, icept + slope * grid, "--", color="crimson", zorder=3,
                    label=f"fit: $R^2$ = {s.r2:.2f} (n = {s.n})")
        else:
            ax.plot([], [], " ", label=f"$R^2$: n/a (n = {s.n})")
        ax.legend(loc="best", fontsize=8, framealpha=0.85)
        ax.set_xlabel(m + (" (log scale)" if log else ""))
        set_ticks(ax.xaxis, *limits(d.x, log), log)
        ticked.append(ax.xaxis)
        ax.grid(alpha=0.3, which="major")
    if not y_all.empty:
        set_ticks(axes[0].yaxis, *limits(y_all, False), False)
        ticked.append(axes[0].yaxis)
    axes[0].set_ylabel(label(target))
    ticked += style.finish(fig, w, h, margins)
    fig.suptitle(title)
    _declutter(fig, ticked)
    return fig


DYNAMICS = ("fig4_dynamics", "Training dynamics: NC properties and {target} against the training step")


def dynamics_figure(df: pd.DataFrame, metrics: Sequence[str], target: str, stats: pd.DataFrame | None, title: str):
    """One panel per metric and one for the target, each against global_step on a log axis (global_step + 1 when
    a checkpoint is at step 0), one line per run in step order, coloured by size (by run when sizes are equal)."""
    style = _Style(df)
    columns = list(metrics) + [target]
    fig, axes, w, h, margins = _frame(len(columns), style, panel_w=3.3, gap=0.8, sharey=False)
    step = pd.to_numeric(df["global_step"], errors="coerce")
    shift = 1 if (step == 0).any() else 0
    sizes = pd.to_numeric(df.get("n_params", pd.Series(np.nan, index=df.index)), errors="coerce")
    ticked = []
    for ax, m in zip(axes, columns):
        ax.set_title(label(m), fontsize=10)
        d = pd.DataFrame({"x": step + shift, "y": pd.to_numeric(df[m], errors="coerce"), "c": sizes, "step": step,
                          "run": df["run"] if "run" in df else "all"})
        d = d.replace([np.inf, -np.inf], np.nan).dropna(subset=["x", "y"])
        d = d[d.x > 0]
        if d.empty:
            ax.text(0.5, 0.5, f"{m}:\nno values", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
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
        ticked += [ax.xaxis, ax.yaxis]
        ax.grid(alpha=0.3, which="major")
    ticked += style.finish(fig, w, h, margins)
    fig.suptitle(title)
    _declutter(fig, ticked)
    return fig


FORMATS = ("png", "pdf", "svg")


def save_figure(fig, out: Path, stem: str) -> Path:
    """PNG (150 dpi), PDF with embedded TrueType fonts (fonttype 42) and SVG, byte-identical from run to run (no
    dates, fixed SVG ids); returns the PNG's path."""
    undated = {"png": None, "pdf": {"CreationDate": None}, "svg": {"Date": None}}
    with plt.rc_context({"pdf.fonttype": 42, "ps.fonttype": 42, "svg.hashsalt": "ncanalyze"}):
        for ext in FORMATS:
            fig.savefig(out / f"{stem}.{ext}", dpi=150 if ext == "png" else "figure", metadata=undated[ext])
    plt.close(fig)
    return out / f"{stem}.png"


# ------------------------------------------------------------------ per-token table (the paper's Table 5)

class TokenNote(UserWarning):
    """A token resolved other than as written (e.g. 'the' as ' the'): said in report.md and printed."""


def resolve_token(spec: str, strings: np.ndarray | None, tokenizer: str | None, vocab_size: int) -> int:
    """A token id from an integer or a token string: the decoded ``token`` coordinate (exact match first, then a
    unique match ignoring surrounding spaces, with a :class:`TokenNote` warning), else the checkpoint's tokenizer if
    it encodes ``spec`` as one token."""
    if spec.strip().isdigit():
        i = int(spec)
        if i >= vocab_size:
            raise UserError(f"token id {i} is outside the vocabulary (size {vocab_size})")
        return i
    if strings is not None:
        exact = np.flatnonzero(strings == spec)
        if len(exact):
            return int(exact[0])
        near = np.flatnonzero(pd.Series(strings).str.strip() == spec.strip())
        if len(near) == 1:
            i = int(near[0])
            warnings.warn(TokenNote(f"token {spec!r} is not in the vocabulary as written: using {strings[i]!r} "
                                    f"(id {i}); pass {strings[i]!r} or {i} to say so"), stacklevel=2)
            return i
        if len(near) > 1:
            raise UserError(f"token {spec!r} is ambiguous: {', '.join(repr(strings[i]) for i in near)}; pass the "
                            "exact string (with its spaces) or the id")
    if tokenizer:
        from transformers import AutoTokenizer

        try:
            ids = AutoTokenizer.from_pretrained(tokenizer).encode(spec, add_special_tokens=False)
        except (OSError, ValueError, KeyError) as e:  # a missing or unreadable tokenizer folder
            raise UserError(f"cannot load the checkpoint's tokenizer {tokenizer!r} to resolve {spec!r} ({e}); pass "
                            "token ids instead") from None
        if len(ids) == 1:
            return int(ids[0])
        raise UserError(f"{spec!r} is {len(ids)} tokens ({ids}) for this checkpoint's tokenizer, not one; pass a "
                        "single token (e.g. with its leading space) or an id")
    raise UserError(f"token {spec!r} not found: the store has no decoded tokens or tokenizer; pass token ids")


def token_table(read_group: Callable[[str], xr.Dataset], groups: Sequence[str], tokens: Sequence[str]) -> pd.DataFrame:
    """Per group and token: id, count, variance, norm, mean CDNV to the other kept classes, mean interference,
    duality and NC4 rate where measured, and an average-token row (the mean over the kept classes).
    ``read_group(group)`` gives a checkpoint's dataset (``ncanalyze.store.io.read_group`` on a store)."""
    rows = []
    for g in groups:
        ds = read_group(g)
        strings = np.array(ds["token"].values.tolist(), dtype=object) if "token" in ds.coords else None
        ids = [resolve_token(t, strings, ds.attrs.get("tokenizer"), ds.sizes["vocab"]) for t in tokens]
        per_class = ds[[v for v in TOKEN_VARIABLES if v in ds]].load()
        kept = per_class["class_cdnv"].notnull() if "class_cdnv" in per_class else per_class["count"] > 0
        for i in ids:
            tok = strings[i] if strings is not None else str(i)
            rows.append({"checkpoint": g, "token": tok, "id": i,
                         **{TOKEN_VARIABLES[v]: float(per_class[v][i]) for v in per_class.data_vars}})
        avg = per_class.where(kept).mean("vocab")
        rows.append({"checkpoint": g, "token": AVERAGE_TOKEN, "id": None,
                     **{TOKEN_VARIABLES[v]: float(avg[v]) for v in per_class.data_vars}})
    return pd.DataFrame(rows).astype({"id": "Int64"})


def per_token(read_group: Callable[[str], xr.Dataset], groups: Sequence[str],
              tokens: Sequence[str]) -> tuple[pd.DataFrame, list[str]]:
    """token_table with each token listed once per checkpoint (however often, or in whichever spelling, it was
    given), and the notes on tokens resolved other than as written or given twice."""
    specs = list(dict.fromkeys(tokens))
    notes_ = [f"token {t!r} given more than once: listed once" for t in specs if list(tokens).count(t) > 1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TokenNote)
        tok = token_table(read_group, groups, specs)
    for w in caught:
        if issubclass(w.category, TokenNote):
            notes_.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    twice = tok[tok.id.notna() & tok.duplicated(["checkpoint", "id"])]
    for t in dict.fromkeys(twice.token):
        notes_.append(f"token {t!r} given more than once (in different spellings): listed once")
    return tok.drop(index=twice.index).reset_index(drop=True), list(dict.fromkeys(notes_))


def latest_checkpoints(df: pd.DataFrame) -> list[str]:
    """``run/checkpoint`` of each run's latest checkpoint (by global_step) among the rows."""
    last = df.sort_values("global_step").groupby("run", sort=True).tail(1)
    return [f"{r}/{c}" for r, c in zip(last.run, last.checkpoint)]


# ------------------------------------------------------------------ depth (--layers)

def depth_files(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """With more than one layer in the table: the depth figure (depth.png) and the per-layer table (layers.csv)."""
    if not has_depth(df):
        return {}
    files = {"depth": out / "depth.png", "layers": out / "layers.csv"}
    fig = depth_figure(df, labels=LABELS)
    fig.savefig(files["depth"], dpi=150)
    plt.close(fig)
    depth_table(df).to_csv(files["layers"], index=False)
    return files


def depth_markdown(df: pd.DataFrame, files: dict[str, Path]) -> str:
    """report.md's depth section (empty without layers)."""
    if "depth" not in files:
        return ""
    return "\n".join(["", "## Across depth", "", "Layer l is transformers' `hidden_states[l]` (0: the embedding "
                      "output; the last: after the final norm, the checkpoint group). NC4 at the other layers uses the "
                      "logit lens (the head after the final norm); the correlations above use the last layer only.", "",
                      f"![{TITLE}]({files['depth'].name})", "",
                      depth_table(df).to_markdown(index=False, floatfmt=".4g"), "",
                      "- `layers.csv`: the per-layer table", ""])


# ------------------------------------------------------------------ the whole report

_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def tex_escape(s: str) -> str:
    return "".join(_TEX.get(c, c) for c in str(s))


def _latex(table: pd.DataFrame, caption: str, label_: str) -> str:
    """A booktabs table; cells and headers escaped, R² set as math."""
    table = table.rename(columns=lambda c: tex_escape(c).replace("R²", "$R^2$"))
    sty = table.style.hide(axis="index").format(escape="latex", na_rep="---")
    return sty.to_latex(hrules=True, caption=caption, label=label_, position="htbp", position_float="centering",
                        column_format="l" + "r" * (table.shape[1] - 1))


def _token_rows(t: pd.DataFrame, quote) -> pd.DataFrame:
    """A checkpoint's token rows for display: tokens quoted with ``quote``, ids as integers."""
    return t.drop(columns="checkpoint").assign(token=[x if x == AVERAGE_TOKEN else quote(x) for x in t.token],
                                               id=t.id.map(lambda i: "" if pd.isna(i) else str(int(i))))


def default_target(sel: pd.DataFrame) -> str:
    """``val_loss`` where every selected checkpoint has it (measured by ncanalyze on the same validation tokens),
    else ``eval_loss`` (the Trainer's)."""
    has = "val_loss" in sel and len(sel) > 0 and pd.to_numeric(sel["val_loss"], errors="coerce").notna().all()
    return "val_loss" if has else "eval_loss"


def target_note(target: str) -> str:
    """report.md's line on which target was used, and why."""
    if target == "val_loss":
        return ("Target: `val_loss`, the model's own next-token loss measured by ncanalyze over the validation tokens "
                "of the extraction (every selected checkpoint has it; `--target eval_loss` uses the Trainer's).")
    if target == "eval_loss":
        return ("Target: `eval_loss`, the Trainer's logged evaluation loss (not every selected checkpoint has "
                "`val_loss`, or `--target eval_loss` was given).")
    return f"Target: `{target}` (`--target`)."


def markdown(sel: pd.DataFrame, stats: pd.DataFrame, tok: pd.DataFrame | None, figures: dict[str, Path], *,
             target: str, controls: Sequence[str], where: str | None, n_perm: int, seed: int | None,
             store: str | Path | None, skipped: dict[str, str] | None = None,
             token_notes: Sequence[str] = ()) -> str:
    """report.md: the correlation table with how to read it, notes, figure links, the per-token tables (with
    ``token_notes``), and the checkpoints ``skipped`` (group: why)."""
    n_runs = sel["run"].nunique() if "run" in sel else 1
    perm = (f"{n_perm} random permutations (seed {seed}); exact, over all n! permutations, where n! <= {n_perm}"
            if n_perm > 0 else "no permutations")
    md = [f"# ncanalyze report: NC metrics against {target}", "",
          f"{len(sel)} checkpoints from {n_runs} run(s)" + (f" ({code(where)})" if where else "") +
          (f" in `{store}`" if store else "") + ".", "", target_note(target), "",
          f"## Correlation with {target}", "", summary(stats).to_markdown(index=False, disable_numparse=True), ""]
    if len(sel) < MIN_N:
        md += [f"**Only {len(sel)} checkpoint(s): correlations need at least {MIN_N}.**", ""]
    md += ["r: Pearson's r of the metric with the target; R² = r², the fit of the least-squares line. "
           "\"(log)\": log10 of the metric (the paper's axes), where it is positive; the target is not logged. "
           f"partial r: {controls_text(controls)}. "
           f"p: two-sided permutation p-value, P(|r*| ≥ |r|), {perm}; "
           "p FL: the same for the partial r, permuting the target's residuals on the controls (Freedman-Lane). "
           "p Holm, p FL Holm: Holm-adjusted across the metrics with a p-value, per scale (raw and log are "
           "separate families). Parametric p-values and the partial r's 95% CI are in stats.csv.", ""]
    if survivors(stats):
        md += ["Multiple comparisons (Holm, family-wise error 0.05):", ""] + [f"- {s}" for s in survivors(stats)]
        md += [""]
    if notes(stats):
        md += ["Notes:", ""] + [f"- {n}" for n in notes(stats)] + [""]
    titles = {k: t for k, (t, _) in FIGURES.items()} | {DYNAMICS[0]: DYNAMICS[1]}
    md += ["## Figures", "", "Each figure is also in PDF and SVG beside its PNG.", ""]
    md += [f"![{titles[k].format(target=label(target))}]({f.name})\n" for k, f in figures.items()]
    if tok is not None:
        md += ["## Per-token statistics", "", "Mean CDNV and mean interference are to the other kept classes; "
               "the average token is the mean over the kept classes.", ""]
        md += [f"**Note:** {n}.\n" for n in token_notes]
        for g, t in tok.groupby("checkpoint", sort=False):
            rows = _token_rows(t, lambda x: repr(x).replace("|", r"\|"))
            md += [f"### {g}", "", rows.to_markdown(index=False, floatfmt=".4g"), ""]
    if skipped:
        md += ["## Skipped checkpoints", "", f"{len(skipped)} checkpoint(s) could not be measured and are left out:",
               ""] + [f"- `{g}`: {why}" for g, why in skipped.items()] + [""]
    md += ["## Files", "", "- `metrics.csv`: one row per checkpoint", "- `stats.csv`: every statistic",
           "- `tables.tex`: the tables for LaTeX (needs `\\usepackage{booktabs}`)"]
    if figures:
        md += ["- " + ", ".join(f"`{f.stem}`" for f in figures.values()) + ": the figures, each as `.png` "
               "(150 dpi), `.pdf` (fonts embedded) and `.svg`"]
    if tok is not None:
        md += ["- `tokens.csv`: the per-token table"]
    return "\n".join(md) + "\n"


def latex(stats: pd.DataFrame, tok: pd.DataFrame | None, target: str, controls: Sequence[str]) -> str:
    """tables.tex: the correlation table and the per-token tables (booktabs; tokens as Python ASCII literals)."""
    tex = ["% ncanalyze report tables; \\usepackage{booktabs}",
           _latex(summary(stats), f"NC metrics against {tex_escape(target)}: Pearson $r$, $R^2$, permutation $p$; "
                  f"partial $r$ ({controls_text(controls, tex_escape, '').replace(' r', ' $r$')}) with "
                  "Freedman-Lane $p$; "
                  "Holm: adjusted across the metrics, per scale.",
                  "tab:nc-correlations")]
    if tok is not None:
        for i, (g, t) in enumerate(tok.groupby("checkpoint", sort=False)):
            rows = _token_rows(t, ascii).map(lambda v: f"{v:.4g}" if isinstance(v, float) else v)
            tex.append(_latex(rows, f"Per-token statistics, {tex_escape(g)}.", f"tab:tokens-{i}"))
    return "\n".join(tex)


def write_report(df: pd.DataFrame, out: str | Path, *, metrics: Sequence[str] = METRICS, target: str | None = None,
                 controls: Sequence[str] = CONTROLS, where: str | None = None, n_perm: int = 10_000,
                 seed: int | None = 0, store: str | Path | None = None, tokens: Sequence[str] = (),
                 checkpoints: Sequence[str] = (), read_group: Callable[[str], xr.Dataset] | None = None,
                 echo: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Write metrics.csv, stats.csv, the figures, tokens.csv (with ``tokens``), report.md and tables.tex into
    ``out``; returns their paths by name. ``store`` names the data's source in report.md; the per-token table reads
    checkpoints through ``read_group``. ``echo`` is given each note the user should see now (tokens resolved other
    than as written); they are in report.md too. ``target``: default :func:`default_target` of the selected
    checkpoints."""
    missing = [m for m in metrics if m not in df.columns]
    if missing:
        raise UserError(f"unknown metric(s) {', '.join(missing)}; the table has: {', '.join(df.columns)}")
    if tokens and read_group is None:
        raise UserError("--tokens needs a store (per-class statistics), not a metrics CSV")
    every_layer = select(df, where)
    first = [c for c in ID_COLUMNS if c in every_layer.columns]
    every_layer = every_layer[first + [c for c in every_layer.columns if c not in first]]
    sel = last_layer(every_layer)  # the statistics, the figures of Fig. 1-3 and the token table: the last layer
    target = target or default_target(sel)
    stats = correlations(sel, metrics, target, controls, n_perm, seed)
    tok, token_notes = None, []
    if tokens:
        tok, token_notes = per_token(read_group, list(checkpoints) or latest_checkpoints(sel), tokens)
    for n in token_notes:
        (echo or (lambda m: warnings.warn(m, TokenNote, stacklevel=2)))(n)

    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise UserError(f"--out {out}: cannot make the folder ({e.strerror}: {e.filename}); pass a folder path that "
                        "is not under a file") from None
    files = {"metrics": out / "metrics.csv", "stats": out / "stats.csv"}
    every_layer.to_csv(files["metrics"], index=False)
    stats.to_csv(files["stats"], index=False)
    if tok is not None:
        files["tokens"] = out / "tokens.csv"
        tok.to_csv(files["tokens"], index=False)
    figures = {}
    for stem, (title, fig_metrics) in FIGURES.items():
        shown = [m for m in fig_metrics if m in metrics]
        if shown:
            fig = scatter_figure(sel, shown, target, stats, title.format(target=label(target)))
            figures[stem] = save_figure(fig, out, stem)
    shown = [m for m in FIGURES["fig1_nc_vs_loss"][1] if m in metrics]
    if "global_step" in sel and pd.to_numeric(sel.global_step, errors="coerce").nunique() >= 2:  # else no dynamics
        stem, title = DYNAMICS
        fig = dynamics_figure(sel, shown, target, stats, title.format(target=label(target)))
        figures[stem] = save_figure(fig, out, stem)
    files |= figures
    files |= depth_files(every_layer, out)
    files["report"] = out / "report.md"
    files["report"].write_text(markdown(sel, stats, tok, figures, target=target, controls=controls, where=where,
                                        n_perm=n_perm, seed=seed, store=store,
                                        skipped=df.attrs.get("skipped"), token_notes=token_notes)
                                        + depth_markdown(every_layer, files))
    files["tex"] = out / "tables.tex"
    files["tex"].write_text(latex(stats, tok, target, controls))
    return files
