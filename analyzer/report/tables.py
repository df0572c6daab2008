"""The report's text: the selection of checkpoints, the display table of the statistics and the notes on them, and
tables.tex (LaTeX, booktabs); report.md is composed in :mod:`.document`."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.expr import condition
from ncanalyze.analyzer.report.tokens import token_rows
from ncanalyze.analyzer.stats import ALPHA, split_tags

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


def fmt_p(p: float, alpha: float = ALPHA) -> str:
    """A p-value for display: 3 significant figures (scientific under 0.001), more where rounding would put it on
    the other side of ``alpha`` (0.049995 is 0.049995, not 0.0500, beside 0.0505), a dash where missing.

    Parameters
    ----------
    p
        The p-value (NaN where none).
    alpha
        The level a survivor is below.

    Returns
    -------
    str
    """
    if p is None or not np.isfinite(p):
        return MISSING
    for digits in range(3, 17):
        text = f"{p:#.{digits}g}" if p >= 1e-3 else f"{p:.{digits - 1}e}"
        if (float(text) < alpha) == (p < alpha):
            return text
    return repr(float(p))


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
    """One display row per metric: n, Spearman's rho and its permutation p, and R², r, permutation p (and
    Holm-adjusted) and the partial r with its Freedman-Lane p (and Holm-adjusted), raw and on log scale. Empty cells
    are explained in the notes. One tag's statistics (rows of several tags are a UserError: never pooled).

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
    if "tag" in stats.columns and len(split_tags(stats)) > 1:
        raise UserError("summary() of several tags' statistics: pass one tag's rows (stats[stats.tag == name])")
    for metric, s in stats.groupby("metric", sort=False):
        row = {"metric": metric, "n": int(s.n.max())}
        raw = s[s.scale == "raw"]
        if "rho" in s.columns and len(raw):
            row |= {"rho": fmt(raw.rho.iloc[0]), "p rho": fmt_p(raw.rho_p.iloc[0])}
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
    tex = ["% ncanalyze report tables; \\usepackage{booktabs}"]
    tags = split_tags(stats)
    for i, (tag, rows) in enumerate(tags):
        of = "" if len(tags) == 1 else f", tag {'(untagged)' if tag is None else tex_escape(tag)}"
        tex.append(_latex(summary(rows), f"NC metrics against {tex_escape(target)}{of}: Spearman $\\rho$, Pearson $r$, "
                          f"$R^2$, permutation $p$; partial $r$ "
                          f"({controls_text(controls, tex_escape, '').replace(' r', ' $r$')}) with Freedman-Lane $p$; "
                          "Holm: adjusted across the metrics, per scale" + (" and tag." if of else "."),
                          "tab:nc-correlations" + ("" if i == 0 else f"-{i}")))
    if tok is not None:
        for i, (g, t) in enumerate(tok.groupby("checkpoint", sort=False)):
            rows = token_rows(t, ascii).map(lambda v: f"{v:.4g}" if isinstance(v, float) else v)
            tex.append(_latex(rows, f"Per-token statistics, {tex_escape(g)}.", f"tab:tokens-{i}"))
    return "\n".join(tex)
