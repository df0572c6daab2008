"""NC across depth (``--layers``, ``--sites``): which rows of a metrics table are the last layer, the depth figure (each
Figure 1 metric against the layer, one line per checkpoint and site kind, coloured by step; the attention and MLP
sites of block B at B + 0.5, dotted and dash-dotted) and the per-layer table."""
from __future__ import annotations

from collections.abc import Sequence

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.lines import Line2D
from matplotlib.transforms import blended_transform_factory

from ncanalyze.analyzer.report.ticks import subplots
from ncanalyze.analyzer.schema import LAYER, SITE

DEPTH_METRICS = ("nc1_cdnv", "gnc2_log_std", "unc3_cos_cv", "nc4_agreement",   # Figure 1's, then the geometry's
                 "total_erank", "eigen_decay", "lidar", "anisotropy")
MARKERS, DASHES = "osD^v<>pPXh*", ("-", "--", ":", "-.")  # a run's marker, then its dash past 12 runs
PANELS_PER_ROW = 3  # 3.9 in each: the figure stays within 2000 px at 150 dpi, as the report's others
TITLE = "NC properties across depth (layer 0: embedding output; the last: after the final norm)"
KIND_DASHES = {"attn": ":", "mlp": "-."}  # a sublayer site kind's line style (the residual sites keep the run's)


def kinds(df: pd.DataFrame) -> pd.Series:
    """Each row's site kind (``resid`` where the table has no site column or the row no site)."""
    site = df[SITE] if SITE in df.columns else pd.Series(None, index=df.index, dtype=object)
    return site.fillna("resid:").astype(str).str.split(":").str[0]


def last_layer(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of each checkpoint's last layer (its checkpoint group): the rows the correlations use. A table without
    a layer column (one of the user's own) is all last-layer rows."""
    if LAYER not in df.columns:
        return df
    layer, n = pd.to_numeric(df[LAYER], errors="coerce"), pd.to_numeric(df.get("n_layers"), errors="coerce")
    return df[layer.isna() | n.isna() | (layer == n)]


def has_depth(df: pd.DataFrame) -> bool:
    """Some checkpoint with more than one layer in the table (``--layers``): then the report adds the depth figure
    and the per-layer table. Models of different depths with their last layer only have no depth to show."""
    if LAYER not in df.columns or not {"run", "checkpoint"} <= set(df.columns):
        return False
    return bool((df.groupby(["run", "checkpoint"], dropna=False)[LAYER].nunique() > 1).any())


def undefined(df: pd.DataFrame, metrics: Sequence[str] = DEPTH_METRICS) -> list[str]:
    """The depth figure's gaps: for each metric, the layers where it is infinite or missing (e.g. CDNV and GNC2 at
    layer 0, where two tokens share one input embedding), as sentences for report.md."""
    out = []
    for m in (m for m in metrics if m in df.columns):
        v = pd.to_numeric(df[m], errors="coerce")
        bad = df.loc[~np.isfinite(v), LAYER]
        if len(bad):
            what = " or ".join(k for k, hit in (("infinite", np.isinf(v).any()), ("undefined (nan)", v.isna().any()))
                               if hit)
            at = pd.to_numeric(bad, errors="coerce").dropna()
            layers = ", ".join(f"{x:g}" for x in sorted(set(at)))
            out.append(f"`{m}` is {what} at layer(s) {layers} ({len(bad)} of {len(df)} rows): a gap in its panel")
    return out


def depth_table(df: pd.DataFrame, metrics: Sequence[str] = DEPTH_METRICS) -> pd.DataFrame:
    """One row per checkpoint and site: run, checkpoint, global_step, layer, site and ``metrics``, by run, step,
    layer."""
    cols = [c for c in ("run", "checkpoint", "global_step", LAYER, SITE) if c in df.columns]
    out = df[cols + [m for m in metrics if m in df.columns]]
    return out.sort_values([c for c in ("run", "global_step", LAYER) if c in cols], kind="stable", ignore_index=True)


def _mark_gaps(ax, df: pd.DataFrame, m: str) -> None:
    """Keep every layer on the panel's axis; shade a layer "undefined" only where ``m`` is undefined (inf or nan)
    in every row of it, and say "undefined in k of n" without shading where only some rows are."""
    layers = pd.to_numeric(df[LAYER], errors="coerce")
    ax.set_xlim(layers.min() - 0.4, layers.max() + 0.4)
    bad = pd.Series(~np.isfinite(pd.to_numeric(df[m], errors="coerce")), index=df.index)
    counts = bad.groupby(layers).agg(["sum", "size"])
    at = blended_transform_factory(ax.transData, ax.transAxes)
    for layer, (k, n) in counts[counts["sum"] > 0].iterrows():
        if k == n:
            ax.axvspan(layer - 0.3, layer + 0.3, color="0.92", zorder=0)
        ax.text(layer, 0.5, "undefined" if k == n else f"undefined in {k} of {n}", transform=at, rotation=90,
                ha="center", va="center", fontsize=8 if k == n else 7, color="0.4")


def _run_styles(df: pd.DataFrame) -> dict[str, tuple[str, str]]:
    """Each run's (marker, line style): runs told apart where the colour is the step's."""
    runs = list(dict.fromkeys(df["run"].astype(str)))
    return {r: (MARKERS[i % len(MARKERS)], DASHES[(i // len(MARKERS)) % len(DASHES)]) for i, r in enumerate(runs)}


def depth_figure(df: pd.DataFrame, metrics: Sequence[str] = DEPTH_METRICS, labels: dict[str, str] | None = None):
    """One panel per metric against the layer; one line per (run, checkpoint), coloured by global_step."""
    metrics = [m for m in metrics if m in df.columns]
    k = len(metrics)
    rows, cols = -(-k // PANELS_PER_ROW), min(k, PANELS_PER_ROW)
    styles = _run_styles(df)
    extra = 0.2 * (-(-len(styles) // 6) + 1) if len(styles) > 1 else 0.0  # inches for the legend of runs
    h = 4.0 * rows + extra
    fig, axes = subplots(rows, cols, figsize=(3.9 * cols + 1.2, h), squeeze=False)
    for ax in axes.flat[k:]:
        ax.set_visible(False)
    steps = pd.to_numeric(df.get("global_step"), errors="coerce")
    norm = Normalize(steps.min(), steps.max() if steps.max() > steps.min() else steps.min() + 1)
    cmap = matplotlib.colormaps["viridis"]
    kind = kinds(df)
    for ax, m in zip(axes.flat, metrics):
        for (run, ckpt, k), g in df.groupby(["run", "checkpoint", kind], sort=False):
            g = g.sort_values(LAYER)
            step = pd.to_numeric(g["global_step"], errors="coerce").iloc[0]
            values = pd.to_numeric(g[m], errors="coerce").replace([np.inf, -np.inf], np.nan)  # a gap, not a drop
            marker, dash = styles[str(run)]
            ax.plot(g[LAYER], values, marker=marker, ls=KIND_DASHES.get(k, dash), ms=3.5, lw=1.2, mec="black",
                    mew=0.3, color=cmap(norm(step)) if np.isfinite(step) else "grey", gid=f"run:{run}")
        _mark_gaps(ax, df, m)
        ax.set_title((labels or {}).get(m, m), fontsize=10)
        ax.set_xlabel("layer (hidden_states index; a block's attn/mlp at +0.5)" if set(kind) - {"resid"} else
                      "layer (hidden_states index)")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    bottom, top = (0.6 + extra) / h, 0.6 / h
    fig.subplots_adjust(left=0.06, right=0.9, bottom=bottom, top=1 - top, wspace=0.3, hspace=0.35)
    cax = fig.add_axes((0.92, bottom, 0.012, 1 - bottom - top))
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), cax=cax, label="global step")
    if len(styles) > 1:
        handles = [Line2D([], [], color="0.35", marker=mk, ls=ls, ms=5, mec="black", mew=0.3)
                   for mk, ls in styles.values()]
        fig.legend(handles, list(styles), loc="lower center", ncol=min(len(styles), 6), fontsize=7, frameon=False,
                   title="runs (colour: the step)", title_fontsize=7, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(TITLE)
    return fig
