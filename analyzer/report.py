"""Tables and figures of a study from its metrics table (one row per checkpoint): CSV, Markdown, LaTeX and PNG."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import xarray as xr  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from ncanalyze.analyzer.depth import TITLE, depth_figure, depth_table, has_depth, last_layer  # noqa: E402
from ncanalyze.analyzer.errors import UserError  # noqa: E402
from ncanalyze.analyzer.schema import INFO as ID_COLUMNS  # noqa: E402
from ncanalyze.analyzer.stats import CONTROLS, METRICS, MIN_N, correlations  # noqa: E402
LABELS = {  # panel titles
    "nc1_cdnv": "NC1: within-class variability (CDNV)", "nc1_cdnv_p2": "NC1: CDNV, squared distances",
    "nc1_trace": "NC1: Tr(Σ_W Σ_B⁺)/K", "nc2_norm_cv": "NC2: equinorm (CV of norms)",
    "nc2_lognorm_std": "NC2: std of log norms", "nc2_cos_mean": "NC2: mean cosine",
    "nc2_cos_std": "NC2: equiangularity (std of cosines)", "nc2_etf_error": "NC2: distance to simplex ETF",
    "gnc2_log_mean": "GNC2: mean log inverse distance", "gnc2_log_std": "GNC2: hyperspherical uniformity",
    "nc3_cos_mean": "NC3: self-duality (mean cosine)", "unc3_cos_cv": "UNC3: uniform duality (CV of cosines)",
    "nc3_dual_error": "NC3: distance to self-dual ETF", "nc4_agreement": "NC4: agreement with nearest class mean",
    "eval_loss": "validation loss",
}
FIGURES = {  # file stem: (title, metrics); the paper's Figures 1-3
    "fig1_nc_vs_loss": ("NC properties against {target}",
                        ("nc1_cdnv", "gnc2_log_std", "unc3_cos_cv", "nc4_agreement")),
    "fig2_nc2_vs_gnc2": ("Equinorm and equiangularity (NC2) against hyperspherical uniformity (GNC2)",
                         ("nc2_norm_cv", "nc2_cos_std", "gnc2_log_std")),
    "fig3_nc3_vs_unc3": ("Self-duality (NC3) against uniform duality (UNC3)", ("nc3_cos_mean", "unc3_cos_cv")),
}
TOKEN_VARIABLES = {"count": "count", "variance": "variance", "class_norm": "norm", "class_cdnv": "mean CDNV",
                   "class_interference": "mean interference", "class_duality": "duality cos", "class_nc4": "NC4 rate"}
AVERAGE_TOKEN = "(average token)"
FIGSIZE = lambda panels: (3.9 * panels + 1.2, 4.0)  # noqa: E731  inches, for 1 x panels scatter plots


def label(name: str) -> str:
    return LABELS.get(name, name)


def select(df: pd.DataFrame, where: str | None) -> pd.DataFrame:
    """The rows matching the pandas query ``where`` (all rows without one)."""
    if not where:
        return df
    try:
        out = df.query(where)
    except Exception as e:
        raise UserError(f"--where {where!r} is not a valid pandas query on the metrics table ({e}); columns: "
                        f"{', '.join(df.columns)}") from None
    if out.empty:
        raise UserError(f"no checkpoint matches --where {where!r} ({len(df)} in the table)")
    return out


MISSING = "—"


def fmt_p(p: float) -> str:
    return MISSING if not np.isfinite(p) else f"{p:.3f}" if p >= 1e-3 else f"{p:.1e}"


def fmt(x: float, digits: int = 3) -> str:
    return MISSING if not np.isfinite(x) else f"{x:.{digits}f}"


def summary(stats: pd.DataFrame) -> pd.DataFrame:
    """One display row per metric: n, and R², r, permutation p and the partial r with its Freedman-Lane p, raw and
    on log scale. Empty cells are explained in the notes."""
    r2 = "R²"
    rows = []
    for metric, s in stats.groupby("metric", sort=False):
        row = {"metric": metric, "n": int(s.n.max())}
        for _, t in s.iterrows():
            sfx = " (log)" if t.scale == "log" else ""
            row |= {r2 + sfx: fmt(t.r2), "r" + sfx: fmt(t.r), "p" + sfx: fmt_p(t.p_perm),
                    "partial r" + sfx: fmt(t.partial_r), "p FL" + sfx: fmt_p(t.partial_p_perm)}
        rows.append(row)
    return pd.DataFrame(rows)


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


def scatter_figure(df: pd.DataFrame, metrics: Sequence[str], target: str, stats: pd.DataFrame, title: str):
    """One panel per metric: target against the metric (log axis where the metric is positive), points coloured by
    n_params on a log colour scale, the least-squares line with its R² in the legend."""
    k, (w, h) = len(metrics), FIGSIZE(len(metrics))
    left, right, bottom, top, gap = 0.75, 1.3, 0.6, 0.65, 0.15  # margins in inches; a fixed layout draws fast
    fig, axes = plt.subplots(1, k, figsize=(w, h), sharey=True, squeeze=False)
    fig.subplots_adjust(left=left / w, right=1 - right / w, bottom=bottom / h, top=1 - top / h,
                        wspace=gap * k / (w - left - right - gap * (k - 1)))
    sizes = pd.to_numeric(df.get("n_params", pd.Series(np.nan, index=df.index)), errors="coerce")
    lo, hi = (sizes.min(), sizes.max()) if sizes.gt(0).any() else (np.nan, np.nan)
    norm = LogNorm(lo / 1.5, hi * 1.5) if lo == hi else LogNorm(lo, hi) if np.isfinite(lo) else None
    mappable = None
    for ax, m in zip(axes[0], metrics):
        st = stats[(stats.metric == m)].set_index("scale") if m in set(stats.metric) else None
        ax.set_title(label(m), fontsize=10)
        d = pd.DataFrame({"x": pd.to_numeric(df[m], errors="coerce"), "y": pd.to_numeric(df[target], errors="coerce"),
                          "c": sizes}).replace([np.inf, -np.inf], np.nan).dropna(subset=["x", "y"])
        if st is None or d.empty:
            ax.text(0.5, 0.5, f"{m}:\nno values", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            continue
        scale = "log" if (d.x > 0).all() and "not positive" not in st.loc["log", "note"] else "raw"
        if scale == "log":
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        kw = dict(c=d.c, cmap="viridis", norm=norm) if norm is not None else dict(color="tab:blue")
        mappable = ax.scatter(d.x, d.y, s=24, edgecolors="black", linewidths=0.3, **kw)
        s = st.loc[scale]
        if np.isfinite(s.r):
            u = np.log10(d.x) if scale == "log" else d.x
            slope, icept = np.polyfit(u, d.y, 1)
            grid = np.linspace(u.min(), u.max(), 50)
            ax.plot(10 ** grid if scale == "log" else grid, icept + slope * grid, "--", color="crimson",
                    label=f"fit: $R^2$ = {s.r2:.2f} (n = {s.n})")
        else:
            ax.plot([], [], " ", label=f"$R^2$: n/a (n = {s.n})")
        ax.legend(loc="best", fontsize=8, framealpha=0.85)
        ax.set_xlabel(m + (" (log scale)" if scale == "log" else ""))
        ax.grid(alpha=0.3, which="both" if scale == "raw" else "major")
    axes[0][0].set_ylabel(label(target))
    if norm is not None and mappable is not None:
        cax = fig.add_axes((1 - (right - 0.2) / w, bottom / h, 0.15 / w, 1 - (bottom + top) / h))
        fig.colorbar(mappable, cax=cax, label="parameters (log scale)")
    fig.suptitle(title)
    return fig


# ------------------------------------------------------------------ per-token table (the paper's Table 5)

def resolve_token(spec: str, strings: np.ndarray | None, tokenizer: str | None, vocab_size: int) -> int:
    """A token id from an integer or a token string: the decoded ``token`` coordinate (exact match first, then a
    unique match ignoring surrounding spaces), else the checkpoint's tokenizer if it encodes ``spec`` as one token."""
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
            return int(near[0])
        if len(near) > 1:
            raise UserError(f"token {spec!r} is ambiguous: {', '.join(repr(strings[i]) for i in near)}; pass the "
                            "exact string (with its spaces) or the id")
    if tokenizer:
        from transformers import AutoTokenizer

        try:
            ids = AutoTokenizer.from_pretrained(tokenizer).encode(spec, add_special_tokens=False)
        except Exception as e:
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


def markdown(sel: pd.DataFrame, stats: pd.DataFrame, tok: pd.DataFrame | None, figures: dict[str, Path], *,
             target: str, controls: Sequence[str], where: str | None, n_perm: int, seed: int | None,
             store: str | Path | None) -> str:
    """report.md: the correlation table with how to read it, notes, figure links and the per-token tables."""
    n_runs = sel["run"].nunique() if "run" in sel else 1
    perm = (f"{n_perm} random permutations (seed {seed}); exact, over all n! permutations, where n! <= {n_perm}"
            if n_perm > 0 else "no permutations")
    md = [f"# ncanalyze report: NC metrics against {target}", "",
          f"{len(sel)} checkpoints from {n_runs} run(s)" + (f" (`{where}`)" if where else "") +
          (f" in `{store}`" if store else "") + ".", "",
          f"## Correlation with {target}", "", summary(stats).to_markdown(index=False, disable_numparse=True), ""]
    if len(sel) < MIN_N:
        md += [f"**Only {len(sel)} checkpoint(s): correlations need at least {MIN_N}.**", ""]
    md += ["r: Pearson's r of the metric with the target; R² = r², the fit of the least-squares line. "
           "\"(log)\": log10 of the metric (the paper's axes), where it is positive; the target is not logged. "
           f"partial r: controlling for {', '.join(f'`{c}`' for c in controls)} (pingouin.partial_corr). "
           f"p: two-sided permutation p-value, P(|r*| ≥ |r|), {perm}; "
           "p FL: the same for the partial r, permuting the target's residuals on the controls (Freedman-Lane). "
           "Parametric p-values and the partial r's 95% CI are in stats.csv.", ""]
    if notes(stats):
        md += ["Notes:", ""] + [f"- {n}" for n in notes(stats)] + [""]
    md += ["## Figures", ""] + [f"![{FIGURES[k][0].format(target=label(target))}]({f.name})\n"
                                for k, f in figures.items()]
    if tok is not None:
        md += ["## Per-token statistics", "", "Mean CDNV and mean interference are to the other kept classes; "
               "the average token is the mean over the kept classes.", ""]
        for g, t in tok.groupby("checkpoint", sort=False):
            rows = _token_rows(t, lambda x: repr(x).replace("|", r"\|"))
            md += [f"### {g}", "", rows.to_markdown(index=False, floatfmt=".4g"), ""]
    md += ["## Files", "", "- `metrics.csv`: one row per checkpoint", "- `stats.csv`: every statistic",
           "- `tables.tex`: the tables for LaTeX (needs `\\usepackage{booktabs}`)"]
    if tok is not None:
        md += ["- `tokens.csv`: the per-token table"]
    return "\n".join(md) + "\n"


def latex(stats: pd.DataFrame, tok: pd.DataFrame | None, target: str, controls: Sequence[str]) -> str:
    """tables.tex: the correlation table and the per-token tables (booktabs; tokens as Python ASCII literals)."""
    tex = ["% ncanalyze report tables; \\usepackage{booktabs}",
           _latex(summary(stats), f"NC metrics against {tex_escape(target)}: Pearson $r$, $R^2$, permutation $p$; "
                  f"partial $r$ controlling for {tex_escape(', '.join(controls))} with Freedman-Lane $p$.",
                  "tab:nc-correlations")]
    if tok is not None:
        for i, (g, t) in enumerate(tok.groupby("checkpoint", sort=False)):
            rows = _token_rows(t, ascii).map(lambda v: f"{v:.4g}" if isinstance(v, float) else v)
            tex.append(_latex(rows, f"Per-token statistics, {tex_escape(g)}.", f"tab:tokens-{i}"))
    return "\n".join(tex)


def write_report(df: pd.DataFrame, out: str | Path, *, metrics: Sequence[str] = METRICS, target: str = "eval_loss",
                 controls: Sequence[str] = CONTROLS, where: str | None = None, n_perm: int = 10_000,
                 seed: int | None = 0, store: str | Path | None = None, tokens: Sequence[str] = (),
                 checkpoints: Sequence[str] = (), read_group: Callable[[str], xr.Dataset] | None = None
                 ) -> dict[str, Path]:
    """Write metrics.csv, stats.csv, the figures, tokens.csv (with ``tokens``), report.md and tables.tex into
    ``out``; returns their paths by name. ``store`` names the data's source in report.md; the per-token table reads
    checkpoints through ``read_group``."""
    missing = [m for m in metrics if m not in df.columns]
    if missing:
        raise UserError(f"unknown metric(s) {', '.join(missing)}; the table has: {', '.join(df.columns)}")
    if tokens and read_group is None:
        raise UserError("--tokens needs a store (per-class statistics), not a metrics CSV")
    every_layer = select(df, where)
    first = [c for c in ID_COLUMNS if c in every_layer.columns]
    every_layer = every_layer[first + [c for c in every_layer.columns if c not in first]]
    sel = last_layer(every_layer)  # the statistics, the figures of Fig. 1-3 and the token table: the last layer
    stats = correlations(sel, metrics, target, controls, n_perm, seed)
    tok = token_table(read_group, list(checkpoints) or latest_checkpoints(sel), tokens) if tokens else None

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
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
            figures[stem] = out / f"{stem}.png"
            fig.savefig(figures[stem], dpi=150)
            plt.close(fig)
    files |= figures
    files |= depth_files(every_layer, out)
    files["report"] = out / "report.md"
    files["report"].write_text(markdown(sel, stats, tok, figures, target=target, controls=controls, where=where,
                                        n_perm=n_perm, seed=seed, store=store) + depth_markdown(every_layer, files))
    files["tex"] = out / "tables.tex"
    files["tex"].write_text(latex(stats, tok, target, controls))
    return files
