"""The report's text: the selection of checkpoints, the display table of the statistics and the notes on them,
report.md (Markdown) and tables.tex (LaTeX, booktabs)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from ncanalyze.analyzer.depth import TITLE as DEPTH_TITLE
from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.expr import condition
from ncanalyze.analyzer.report.figures import TITLES, label
from ncanalyze.analyzer.report.options import ReportOptions, ReportResult
from ncanalyze.analyzer.report.tokens import token_rows
from ncanalyze.analyzer.stats import MIN_N

MISSING = "—"
_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def select(df: pd.DataFrame, where: str | None) -> pd.DataFrame:
    """The rows matching a condition over the table's columns.

    Parameters
    ----------
    df
        The metrics table.
    where
        A condition in pandas query syntax, evaluated by :mod:`ncanalyze.analyzer.expr` (never as code); None or
        empty: every row.

    Returns
    -------
    pandas.DataFrame
        The matching rows; a :class:`UserError` where none matches.
    """
    if not where:
        return df
    out = df[condition(where, df, "--where")]
    if out.empty:
        raise UserError(f"no checkpoint matches --where (ReportOptions.where) {where!r} ({len(df)} in the table)")
    return out


def fmt_p(p: float) -> str:
    """A p-value for display: 3 decimals, scientific under 0.001, a dash where missing.

    Parameters
    ----------
    p
        The p-value (NaN where none).

    Returns
    -------
    str
    """
    return MISSING if not np.isfinite(p) else f"{p:.3f}" if p >= 1e-3 else f"{p:.1e}"


def fmt(x: float, digits: int = 3) -> str:
    """A statistic for display with ``digits`` decimals, a dash where missing.

    Parameters
    ----------
    x
        The value (NaN where none).
    digits
        Decimals shown.

    Returns
    -------
    str
    """
    return MISSING if not np.isfinite(x) else f"{x:.{digits}f}"


def summary(stats: pd.DataFrame) -> pd.DataFrame:
    """One display row per metric: n, and R², r, permutation p (and Holm-adjusted) and the partial r with its
    Freedman-Lane p (and Holm-adjusted), raw and on log scale. Empty cells are explained in the notes.

    Parameters
    ----------
    stats
        :func:`ncanalyze.analyzer.stats.correlations`.

    Returns
    -------
    pandas.DataFrame
        Formatted strings, one row per metric.
    """
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
    the partial r, and which.

    Parameters
    ----------
    stats
        :func:`ncanalyze.analyzer.stats.correlations` with its Holm columns.
    alpha
        The family-wise error rate.

    Returns
    -------
    list of str
    """
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
    """Markdown inline code that may itself contain backticks (a backticked column name).

    Parameters
    ----------
    text
        The code.

    Returns
    -------
    str
    """
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def controls_text(controls: Sequence[str], code: Callable[[str], str] = code,
                  how: str = " (pingouin.partial_corr)") -> str:
    """'controlling for a, b (how)', or what the partial r is without controls.

    Parameters
    ----------
    controls
        The partial correlation's controls.
    code
        How a control is written (:func:`code` in Markdown, :func:`tex_escape` in LaTeX).
    how
        What computes it, after the list.

    Returns
    -------
    str
    """
    if not controls:
        return "with no controls, equal to r"
    return "controlling for " + ", ".join(code(c) for c in controls) + how


def notes(stats: pd.DataFrame) -> list[str]:
    """Each distinct note of the statistics with the metrics it applies to.

    Parameters
    ----------
    stats
        :func:`ncanalyze.analyzer.stats.correlations` (its ``note`` column, notes joined by '; ').

    Returns
    -------
    list of str
        'note: metric, metric (log), ...' ('(log)' when it holds for one scale only), or 'note: every metric' when
        it holds for every row with statistics.
    """
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


def default_target(sel: pd.DataFrame) -> str:
    """``val_loss`` where every selected checkpoint has it (measured by ncanalyze on the same validation tokens),
    else ``eval_loss`` (the Trainer's).

    Parameters
    ----------
    sel
        The selected checkpoints.

    Returns
    -------
    str
    """
    has = "val_loss" in sel and len(sel) > 0 and pd.to_numeric(sel["val_loss"], errors="coerce").notna().all()
    return "val_loss" if has else "eval_loss"


def target_note(target: str) -> str:
    """report.md's line on which target was used, and why.

    Parameters
    ----------
    target
        The target column.

    Returns
    -------
    str
    """
    if target == "val_loss":
        return ("Target: `val_loss`, the model's own next-token loss measured by ncanalyze over the validation tokens "
                "of the extraction (every selected checkpoint has it; `--target eval_loss` uses the Trainer's).")
    if target == "eval_loss":
        return ("Target: `eval_loss`, the Trainer's logged evaluation loss (not every selected checkpoint has "
                "`val_loss`, or `--target eval_loss` was given).")
    return f"Target: `{target}` (`--target`)."


# ------------------------------------------------------------------ report.md, section by section

def _correlation_section(r: ReportResult, o: ReportOptions) -> list[str]:
    """The header, the correlation table with how to read it, Holm's survivors and the notes."""
    sel, stats, target = r.selected, r.stats, r.target
    n_runs = sel["run"].nunique() if "run" in sel else 1
    perm = (f"{o.n_perm} random permutations (seed {o.seed}); exact, over all n! permutations, where n! <= {o.n_perm}"
            if o.n_perm > 0 else "no permutations")
    md = [f"# ncanalyze report: NC metrics against {target}", "",
          f"{len(sel)} checkpoints from {n_runs} run(s)" + (f" ({code(o.where)})" if o.where else "") +
          (f" in `{o.store}`" if o.store else "") + ".", "", target_note(target), "",
          f"## Correlation with {target}", "", summary(stats).to_markdown(index=False, disable_numparse=True), ""]
    if len(sel) < MIN_N:
        md += [f"**Only {len(sel)} checkpoint(s): correlations need at least {MIN_N}.**", ""]
    md += ["r: Pearson's r of the metric with the target; R² = r², the fit of the least-squares line. "
           "\"(log)\": log10 of the metric (the paper's axes), where it is positive; the target is not logged. "
           f"partial r: {controls_text(o.controls)}. "
           f"p: two-sided permutation p-value, P(|r*| ≥ |r|), {perm}; "
           "p FL: the same for the partial r, permuting the target's residuals on the controls (Freedman-Lane). "
           "p Holm, p FL Holm: Holm-adjusted across the metrics with a p-value, per scale (raw and log are "
           "separate families). Parametric p-values and the partial r's 95% CI are in stats.csv.", ""]
    if survivors(stats):
        md += ["Multiple comparisons (Holm, family-wise error 0.05):", ""] + [f"- {s}" for s in survivors(stats)]
        md += [""]
    if notes(stats):
        md += ["Notes:", ""] + [f"- {n}" for n in notes(stats)] + [""]
    return md


def _token_section(r: ReportResult) -> list[str]:
    """The per-token tables, one per checkpoint, after the notes on the tokens."""
    if r.tokens is None:
        return []
    md = ["## Per-token statistics", "", "Mean CDNV and mean interference are to the other kept classes; "
          "the average token is the mean over the kept classes.", ""]
    md += [f"**Note:** {n}.\n" for n in r.notes]
    for g, t in r.tokens.groupby("checkpoint", sort=False):
        rows = token_rows(t, lambda x: repr(x).replace("|", r"\|"))
        md += [f"### {g}", "", rows.to_markdown(index=False, floatfmt=".4g"), ""]
    return md


def _files_section(r: ReportResult, skipped: dict[str, str] | None) -> list[str]:
    """The checkpoints skipped (group: why) and the list of files."""
    md = []
    if skipped:
        md += ["## Skipped checkpoints", "", f"{len(skipped)} checkpoint(s) could not be measured and are left out:",
               ""] + [f"- `{g}`: {why}" for g, why in skipped.items()] + [""]
    md += ["## Files", "", "- `metrics.csv`: one row per checkpoint", "- `stats.csv`: every statistic",
           "- `tables.tex`: the tables for LaTeX (needs `\\usepackage{booktabs}`)"]
    if r.figures:
        md += ["- " + ", ".join(f"`{f.stem}`" for f in r.figures.values()) + ": the figures, each as `.png` "
               "(150 dpi), `.pdf` (fonts embedded) and `.svg`"]
    if r.tokens is not None:
        md += ["- `tokens.csv`: the per-token table"]
    return md


def _depth_section(r: ReportResult) -> list[str]:
    """The depth figure and the per-layer table (nothing with one layer)."""
    if r.depth is None:
        return []
    return ["", "## Across depth", "", "Layer l is transformers' `hidden_states[l]` (0: the embedding "
            "output; the last: after the final norm, the checkpoint group). NC4 at the other layers uses the "
            "logit lens (the head after the final norm); the correlations above use the last layer only.", "",
            f"![{DEPTH_TITLE}]({r.files['depth'].name})", "", r.depth.to_markdown(index=False, floatfmt=".4g"), "",
            "- `layers.csv`: the per-layer table", ""]


def markdown(result: ReportResult, options: ReportOptions, skipped: dict[str, str] | None = None) -> str:
    """report.md: the correlation table with how to read it, notes, figure links, the per-token tables, the
    checkpoints skipped and the files; the depth section with layers.

    Parameters
    ----------
    result
        What the report computed (its figures and depth files already written).
    options
        What it was asked for.
    skipped
        Checkpoints that could not be measured: group to why.

    Returns
    -------
    str
    """
    md = _correlation_section(result, options)
    md += ["## Figures", "", "Each figure is also in PDF and SVG beside its PNG.", ""]
    md += [f"![{TITLES[k].format(target=label(result.target))}]({f.name})\n" for k, f in result.figures.items()]
    md += _token_section(result) + _files_section(result, skipped)
    return "\n".join(md) + "\n" + "\n".join(_depth_section(result))


# ------------------------------------------------------------------ tables.tex

def tex_escape(s: str) -> str:
    """Text with LaTeX's special characters escaped.

    Parameters
    ----------
    s
        The text.

    Returns
    -------
    str
    """
    return "".join(_TEX.get(c, c) for c in str(s))


def _latex(table: pd.DataFrame, caption: str, label_: str) -> str:
    """A booktabs table; cells and headers escaped, R² set as math."""
    table = table.rename(columns=lambda c: tex_escape(c).replace("R²", "$R^2$"))
    sty = table.style.hide(axis="index").format(escape="latex", na_rep="---")
    return sty.to_latex(hrules=True, caption=caption, label=label_, position="htbp", position_float="centering",
                        column_format="l" + "r" * (table.shape[1] - 1))


def latex(stats: pd.DataFrame, tok: pd.DataFrame | None, target: str, controls: Sequence[str]) -> str:
    """tables.tex: the correlation table and the per-token tables (booktabs; tokens as Python ASCII literals).

    Parameters
    ----------
    stats
        :func:`ncanalyze.analyzer.stats.correlations`.
    tok
        The per-token table, or None.
    target
        The target column (in the caption).
    controls
        The partial correlation's controls (in the caption).

    Returns
    -------
    str
    """
    tex = ["% ncanalyze report tables; \\usepackage{booktabs}",
           _latex(summary(stats), f"NC metrics against {tex_escape(target)}: Pearson $r$, $R^2$, permutation $p$; "
                  f"partial $r$ ({controls_text(controls, tex_escape, '').replace(' r', ' $r$')}) with "
                  "Freedman-Lane $p$; "
                  "Holm: adjusted across the metrics, per scale.",
                  "tab:nc-correlations")]
    if tok is not None:
        for i, (g, t) in enumerate(tok.groupby("checkpoint", sort=False)):
            rows = token_rows(t, ascii).map(lambda v: f"{v:.4g}" if isinstance(v, float) else v)
            tex.append(_latex(rows, f"Per-token statistics, {tex_escape(g)}.", f"tab:tokens-{i}"))
    return "\n".join(tex)
