"""The report's text: the selection of checkpoints, the display table of the statistics and the notes on them, and
tables.tex (LaTeX, booktabs); report.md is composed in :mod:`.document`."""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from ncanalyze.analyzer.expr import condition
from ncanalyze.analyzer.report.escape import md_name, visible
from ncanalyze.analyzer.report.tokens import token_rows
from ncanalyze.analyzer.schema import SCALE_DEPENDENT
from ncanalyze.analyzer.stats import ALPHA, GEOMETRY, NC, split_tags, unreachable
from ncanalyze.core.errors import UserError

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


def no_control(stats: pd.DataFrame) -> bool:
    """Whether no row's partial r holds anything fixed (stats.csv's ``controls`` empty everywhere: none asked, or
    none varies among the checkpoints), so that it equals r and its columns repeat r's."""
    if "controls" not in stats or stats.empty:
        return False
    return bool(stats.controls.fillna("").astype(str).str.strip().eq("").all())


def no_control_text(stats: pd.DataFrame) -> str:
    """report.md's sentence where :func:`no_control`: why, and that the repeated columns are left out."""
    asked = [c for c in stats.attrs.get("controls", []) if c]
    why = (f"none of the controls ({', '.join(code(c) for c in asked)}) varies among these checkpoints"
           if asked else "no control was asked")
    return f"partial r: {why}, so it equals r; its columns (partial r, p FL, p FL Holm) are left out."


def summary(stats: pd.DataFrame) -> pd.DataFrame:
    """One display row per metric: n, Spearman's rho and its permutation p, and R², r, permutation p (and
    Holm-adjusted) and the partial r with its Freedman-Lane p (and Holm-adjusted), raw and on log scale (the partial
    r's columns left out where no control is in use: :func:`no_control`). Empty cells are explained in the notes. One tag's statistics (rows of several tags are a UserError: never pooled).

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
    plain = no_control(stats)
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
            if plain:  # no control: the partial r is r, its columns would repeat r's
                for k in ("partial r", "p FL", "p FL Holm"):
                    row.pop(k + sfx)
        rows.append(row)
    return pd.DataFrame(rows)


FAMILY_NAMES = {NC: "NC metrics", GEOMETRY: "geometry metrics"}


def family_name(family: str) -> str:
    """A Holm family as report.md names it."""
    if family in SCALE_DEPENDENT:
        return f"`{family}` alone (scale-dependent)"
    return FAMILY_NAMES.get(family, f"`{family}`")


def survivors(stats: pd.DataFrame, alpha: float = 0.05) -> list[str]:
    """Sentences: per scale and Holm family, how many of the metrics tested keep p < alpha after Holm's
    adjustment, for r and for the partial r, and which.

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
    families = stats.family if "family" in stats else pd.Series(NC, index=stats.index)
    for scale, what in (("raw", "raw scale"), ("log", "log scale")):
        for fam in dict.fromkeys(families):
            rows = stats[(stats.scale == scale) & (families == fam)]
            for col, name in (("p_holm", "r"), ("partial_p_holm", "partial r")):
                if col not in rows:
                    continue
                tested = rows[np.isfinite(rows[col].astype(float))]
                if tested.empty:
                    continue
                ok = tested[tested[col] < alpha]
                named = [beside_design(row) if col == "p_holm" else row.metric for _, row in ok.iterrows()]
                out.append(f"{name}, {what}, {family_name(fam)}: {len(ok)} of {len(tested)} metric(s) survive at "
                           f"{alpha:g}" + (f" ({'; '.join(named)})" if len(ok) else ""))
    return out


def beside_design(row: pd.Series, alpha: float = ALPHA) -> str:
    """A metric whose r survives, with its partial r given the design and whether the association survives it:
    'nc1_cdnv: given the controls, partial r +0.53 (p FL 0.160, Holm 0.480): it does not survive them'."""
    if not row.get("controls") or not np.isfinite(row.get("partial_r", np.nan)):
        return f"{row.metric}: no partial r (no control varies here)"
    p, holm = row.partial_p_perm, row.get("partial_p_holm", np.nan)
    said = ("it survives them" if np.isfinite(holm) and holm < alpha else "it does not survive them"
            if np.isfinite(p) else "untested")
    return f"{row.metric}: given the controls, partial r {row.partial_r:+.2f} (p FL {fmt_p(p)}, Holm {fmt_p(holm)}): {said}"


def units(n: int, unit: str) -> str:
    """'1 run', '4 runs', '1 checkpoint', '16 checkpoints'."""
    return f"{int(n)} {unit.removesuffix('s') if int(n) == 1 else unit}"


def _runs_needed(m: int, alpha: float) -> int:
    """The fewest runs of one length whose whole-run permutations (K!) put the floor 2/K! below alpha/m."""
    k = 2
    while math.factorial(k) * alpha <= 2 * m:
        k += 1
    return k


def unreachable_lines(stats: pd.DataFrame, alpha: float = ALPHA) -> list[str]:
    """report.md's opening warning: per tag and Holm family where no Holm-adjusted permutation p can fall below
    ``alpha`` whatever the data (:func:`ncanalyze.analyzer.stats.unreachable`), why (the floor of p against
    alpha/m) and what would lift it; empty where every family can.

    Parameters
    ----------
    stats
        :func:`ncanalyze.analyzer.stats.correlations_by_tag`.
    alpha
        The family-wise error rate.

    Returns
    -------
    list of str
        A bold lead sentence and one bullet per (tag, family).
    """
    bad = unreachable(stats, alpha=alpha)
    if bad.empty:
        return []
    keys = [c for c in ("tag", "family") if c in bad]
    tested = stats[np.isfinite(stats.p_perm.astype(float)) & (stats.n_perm > 0)]
    every = len(bad) == len(tested.groupby([c for c in ("tag", "family", "scale") if c in tested], dropna=False))
    lines = [f"**No p-value {'in this report ' if every else 'of the families below '}can reach {alpha:g} after "
             "Holm's adjustment, whatever the data.**", ""]
    for _, g in bad.groupby(keys, dropna=False, sort=False):
        u, m = g.iloc[0], int(g.m.max())
        tag = "" if "tag" not in g or pd.isna(u.get("tag")) else f"tag `{u.tag}`, "
        u = g.sort_values("p_floor", ascending=False, kind="stable").iloc[0]  # one row: the largest floor
        floor, exact = float(u.p_floor), bool(u.exact)
        unit = f"{'whole runs' if u.perm_unit == 'runs' else 'rows'} permuted ({units(u.n_units, u.perm_unit)})"
        why = (f"{unit} have only {units(u.n_distinct_perms, 'distinct permutations')}, so every equal-tailed p is 1"
               if exact and floor >= 1 else
               f"{unit} have only {int(u.n_distinct_perms)} distinct permutations, so no equal-tailed p falls "
               f"below 2/{int(u.n_distinct_perms)} = {floor:.3g}" if exact else
               f"only {int(u.n_perm)} permutations were drawn, so no equal-tailed p falls below {floor:.3g}")
        fix = (f"runs of one length need at least {_runs_needed(m, alpha)} of them" if exact and
               u.perm_unit == "runs" else f"{int(math.ceil(2 * m / alpha))} or more permutations (--permutations)" if
               not exact else f"at least {_runs_needed(m, alpha)} checkpoints")
        lines.append(f"- {tag}{family_name(u.family)} ({', '.join(g.scale)} scale): Holm multiplies the smallest "
                     f"of {m} p-values by {m}, so a survivor needs p < {alpha:g}/{m} = {alpha / m:.3g}; but {why} "
                     f"(to reach it: {fix}).")
    return lines + [""]


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
    text = visible(text)  # a newline would end the line: a heading or raw HTML after it
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


FIT = r"\resizebox{\ifdim\width>\linewidth\linewidth\else\width\fi}{!}{%"  # shrink to the line, never grow


def _latex(table: pd.DataFrame, caption: str, label_: str, rule_before: str | None = None) -> str:
    """A booktabs table; cells and headers escaped, R² set as math; shrunk to the line width where wider (graphicx);
    a rule before the row whose first cell is ``rule_before``."""
    table = table.rename(columns=lambda c: tex_escape(c).replace("R²", "$R^2$"))
    sty = table.style.hide(axis="index").format(escape="latex", na_rep="---")
    tex = sty.to_latex(hrules=True, caption=caption, label=label_, position="htbp", position_float="centering",
                       column_format="l" + "r" * (table.shape[1] - 1))
    if rule_before is not None:
        tex = tex.replace(f"\n{tex_escape(rule_before)} &", f"\n\\midrule\n{tex_escape(rule_before)} &", 1)
    return tex.replace("\\begin{tabular}", FIT + "\n\\begin{tabular}").replace("\\end{tabular}", "\\end{tabular}}")


def design_caption(stats: pd.DataFrame) -> str:
    """The permutations behind one tag's p-values, for a caption: the unit permuted, how many distinct
    permutations, exact or drawn, and the floor of p.

    Parameters
    ----------
    stats
        One tag's :func:`ncanalyze.analyzer.stats.correlations`.

    Returns
    -------
    str
        Plain text (escape it for LaTeX).
    """
    cols = ["perm_scheme", "perm_unit", "n_units", "n_distinct_perms", "n_perm", "exact", "p_floor"]
    used = stats.loc[stats.n_perm > 0, [c for c in cols if c in stats]].drop_duplicates()
    if used.empty or "p_floor" not in used:
        return "no permutation p-values"
    parts = []
    for _, u in used.iterrows():
        unit = "whole runs" if u.perm_scheme != "rows" else "rows"
        count = "all enumerated, exact" if u.exact else f"{int(u.n_perm)} drawn"
        floor = (fmt_p(u.p_floor) if u.p_floor >= 1 or not u.exact else
                 f"2/{int(u.n_distinct_perms)} = {fmt_p(u.p_floor)}")
        parts.append(f"{unit} permuted ({units(u.n_units, u.perm_unit)}; {count}), so p >= {floor}")
    return "; ".join(parts)


def _scale_table(rows: pd.DataFrame, scale: str) -> pd.DataFrame:
    """One scale's columns of :func:`summary` (rho only on the raw scale: it is the same on both), headers
    without the scale."""
    table = summary(rows)
    sfx = " (log)" if scale == "log" else ""
    keep = ["metric", "n"] + (["rho", "p rho"] if scale == "raw" else [])
    keep += [c + sfx for c in ("R²", "r", "p", "p Holm", "partial r", "p FL", "p FL Holm")]
    return table[[c for c in keep if c in table]].rename(columns=lambda c: c.removesuffix(sfx))


def latex(stats: pd.DataFrame, tok: pd.DataFrame | None, target: str, controls: Sequence[str]) -> str:
    """tables.tex: per tag the correlation table of each scale (raw, log10) and the per-token tables (booktabs,
    graphicx; tokens as Python ASCII literals). Each correlation table fits the line (11 columns at most, shrunk
    where wider), says in its caption the unit permuted and the floor of p, and has a rule between its Holm
    families.

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
    tex = ["% ncanalyze report tables; \\usepackage{booktabs,graphicx}"]
    tags = split_tags(stats)
    for i, (tag, rows) in enumerate(tags):
        of = "" if len(tags) == 1 else f", tag {'(untagged)' if tag is None else tex_escape(tag)}"
        design = tex_escape(design_caption(rows)).replace(">=", "$\\geq$")
        geometry = rows.metric[rows.family == GEOMETRY] if "family" in rows else pd.Series([], dtype=object)
        for scale, what in (("raw", "raw"), ("log", "log10 of the metric")):
            if not (rows.scale == scale).any():
                continue
            cap = (f"Metrics ({what}) against {tex_escape(target)}{of}: "
                   + ("Spearman $\\rho$, " if scale == "raw" else "") + "Pearson $r$, $R^2$, two-sided "
                   f"permutation $p$: {design}; "
                   + ("no control varies, so partial $r$ equals $r$ (left out); " if no_control(rows) else
                      f"partial $r$ ({controls_text(controls, tex_escape, '').replace(' r', ' $r$')}) with "
                      "Freedman-Lane $p$; ")
                   + "Holm: adjusted within the NC metrics (a scale-dependent one, such as nc1\\_cdnv\\_p2, alone) "
                   "and within the geometry metrics (below the rule), per scale"
                   + (" and tag" if of else "") + ". Parametric p-values (independent rows assumed) are in stats.csv.")
            label_ = "tab:nc-correlations" + ("" if i == 0 else f"-{i}") + ("" if scale == "raw" else "-log")
            tex.append(_latex(_scale_table(rows[rows.scale == scale], scale), cap, label_,
                              geometry.iloc[0] if len(geometry) and len(geometry) < rows.metric.nunique() else None))
        if "r_ci_low" in rows and rows.r_ci_low.notna().any():  # the intervals over runs (none with under 4 runs)
            tex.append(claims_latex(rows, target, of, "tab:nc-intervals" + ("" if i == 0 else f"-{i}")))
    if tok is not None:
        for i, (g, t) in enumerate(tok.groupby("checkpoint", sort=False)):
            rows = token_rows(t, ascii).map(lambda v: f"{v:.4g}" if isinstance(v, float) else v)
            tex.append(_latex(rows, f"Per-token statistics, {tex_escape(g)}.", f"tab:tokens-{i}"))
    return "\n".join(tex)


# ------------------------------------------------------------------ the claims: intervals, the two questions, fragility

def interval(x: float, low: float, high: float, digits: int = 2, sign: str = "") -> str:
    """'0.81 [0.52, 0.93]': a statistic with its interval (a dash where missing; no brackets without one).

    Parameters
    ----------
    x, low, high
        The statistic and its interval's ends (NaN where none).
    digits
        Decimals shown.
    sign
        "+": every number signed ('+0.81 [+0.52, +0.93]', for correlations).

    Returns
    -------
    str
    """
    if x is None or not np.isfinite(x):
        return MISSING
    f = f"{{:{sign}.{digits}f}}".format
    if not (np.isfinite(low) and np.isfinite(high)):
        return f(x)
    return f"{f(x)} [{f(low)}, {f(high)}]"


def _name(row: pd.Series) -> str:
    return row.metric + (" (log)" if row.scale == "log" else "")


def intervals_how(stats: pd.DataFrame) -> str:
    """How the intervals were made, for a sentence: 'Fisher's z (12 runs, one row each)', 'the jackknife over runs on
    Fisher's z (21 runs; t with 20 degrees of freedom)', or that there are none and why.

    Parameters
    ----------
    stats
        One tag's :func:`ncanalyze.analyzer.stats.correlations`.

    Returns
    -------
    str
    """
    from ncanalyze.analyzer.resample import FISHER
    got = stats[stats.r_ci_low.notna()] if "r_ci_low" in stats else stats.iloc[:0]
    if got.empty:
        why = stats.claims_why[stats.claims_why.fillna("") != ""] if "claims_why" in stats else pd.Series([], dtype=str)
        return "no intervals" + (f" ({why.iloc[0]})" if len(why) else " (fewer than 4 runs)")
    u = got.iloc[0]
    if u.ci_method == FISHER:
        return (f"95% intervals from Fisher's z ({units(u.ci_units, 'runs')}, one row each: independent units; the "
                "partial r's with n - k - 3 degrees of freedom, rho's with Bonett and Wright's variance)")
    return (f"95% intervals from the jackknife over runs on Fisher's z ({units(u.ci_units, 'runs')}; t with "
            f"{int(u.ci_units) - 1} degrees of freedom): a run's checkpoints leave together, so the interval respects "
            "the design (in simulation it covers 95%, where the bootstrap over runs covered 84-90%)")


def interval_table(stats: pd.DataFrame) -> pd.DataFrame:
    """One display row per metric and scale: r, R², rho and the partial r with their 95% intervals over runs, the
    permutation null's centre beside r, the permutation p, and leave-one-run-out (the range of r and of p, and
    whether any one run moves r by more than half its interval).

    Parameters
    ----------
    stats
        One tag's :func:`ncanalyze.analyzer.stats.correlations`.

    Returns
    -------
    pandas.DataFrame
        Formatted strings.
    """
    rows = []
    for _, s in stats[stats.r.notna()].iterrows():
        robust = s.get("robust", np.nan)
        loo = np.isfinite(s.get("loo_r_min", np.nan))
        rows.append({"metric": _name(s), "r [95% CI]": interval(s.r, s.r_ci_low, s.r_ci_high),
                     "R² [95% CI]": interval(s.r2, s.r2_ci_low, s.r2_ci_high),
                     "rho [95% CI]": interval(s.rho, s.rho_ci_low, s.rho_ci_high),
                     "partial r [95% CI]": interval(s.partial_r, s.partial_r_ci_low, s.partial_r_ci_high),
                     "null r": fmt(s.r_null, 2), "p": fmt_p(s.p_perm),
                     "r without one run": f"{s.loo_r_min:.2f} to {s.loo_r_max:.2f}" if loo else MISSING,
                     "p without one run": (f"{fmt_p(s.loo_p_min)} to {fmt_p(s.loo_p_max)}"
                                           if loo and np.isfinite(s.get("loo_p_min", np.nan)) else MISSING),
                     "one run moves it": MISSING if not np.isfinite(robust) else ("no" if robust else "yes")})
    return pd.DataFrame(rows)


def questions_table(stats: pd.DataFrame) -> pd.DataFrame:
    """Between models and within training apart, beside the pooled r: per metric and scale, the r across runs at
    the last step that enough runs share (its permutation p over runs) and the range over all such steps, and
    within training beyond what all runs share at a step: the fixed-effects r with its interval over runs, its
    whole-run permutation p and the null's centre.

    Parameters
    ----------
    stats
        One tag's :func:`ncanalyze.analyzer.stats.correlations`.

    Returns
    -------
    pandas.DataFrame
        Formatted strings; empty where no run has several checkpoints.
    """
    rows = []
    shown = stats[(stats.r.notna()) & ((stats.between_steps > 0) | (stats.within_n_runs > 0))]
    for _, s in shown.iterrows():
        last = (f"{s.between_r_last:+.2f} (p {fmt_p(s.between_p_last)}, step {s.between_step_last:g})"
                if s.between_steps > 0 and np.isfinite(s.between_r_last) else MISSING)
        spread = (f"{s.between_r_min:+.2f} to {s.between_r_max:+.2f} ({int(s.between_steps)})"
                  if s.between_steps > 0 and np.isfinite(s.between_r_min) else MISSING)
        within = interval(s.within_r, s.within_ci_low, s.within_ci_high, sign="+")
        rows.append({"metric": _name(s), "pooled r [95% CI]": interval(s.r, s.r_ci_low, s.r_ci_high),
                     "between models: r at the last step": last, "r over steps": spread,
                     "within training beyond the shared trend: r [95% CI]": within,
                     "p (null r)": (f"{fmt_p(s.within_p)} ({s.within_r_null:+.2f})" if np.isfinite(s.within_p)
                                    else MISSING),
                     "runs": f"{int(s.within_n_runs)}" if s.within_n_runs else MISSING})
    return pd.DataFrame(rows)


def loo_flip_runs(flips: str) -> dict[str, list[str]]:
    """stats.csv's ``loo_flips`` ('run (r), run (partial r), ...') read back: each run, in order, with the
    statistics ('r', 'partial r') that its removal moves by more than half their interval."""
    out: dict[str, list[str]] = {}
    for f in (flips or "").split(", "):
        run, _, what = f.rpartition(" (")
        if run and what.endswith(")"):
            out.setdefault(run, []).append(what[:-1])
    return out


def fragility_lines(stats: pd.DataFrame) -> list[str]:
    """Sentences naming, per metric, the runs whose removal moves r (or the partial r) by more than half its
    interval, with r's range without one run: the data decide these, not the design.

    Parameters
    ----------
    stats
        One tag's :func:`ncanalyze.analyzer.stats.correlations`.

    Returns
    -------
    list of str
    """
    out = []
    for _, s in stats[stats.get("loo_flips", pd.Series("", index=stats.index)).fillna("") != ""].iterrows():
        flips = loo_flip_runs(s.loo_flips)
        parts = []
        for what, col in (("r", "r"), ("partial r", "partial_r")):
            runs = [run for run, stats_ in flips.items() if what in stats_]
            if runs:
                parts.append(f"{what} {interval(s[col], s[f'{col}_ci_low'], s[f'{col}_ci_high'], sign='+')} moves by "
                             "more than half its interval when run " + " or ".join(md_name(r) for r in runs)
                             + " is left out")
        out.append(f"{_name(s)}: {'; '.join(parts)} (r with one run left out: {s.loo_r_min:+.2f} to "
                   f"{s.loo_r_max:+.2f}; p {fmt_p(s.loo_p_min)} to {fmt_p(s.loo_p_max)}).")
    return out


def claims_latex(stats: pd.DataFrame, target: str, of: str, label_: str) -> str:
    """tables.tex's table of the intervals over runs (:func:`interval_table`) of one tag.

    Parameters
    ----------
    stats
        One tag's statistics.
    target
        The target (in the caption).
    of
        ', tag NAME' or ''.
    label_
        The LaTeX label.

    Returns
    -------
    str
    """
    how = tex_escape(intervals_how(stats))
    design = tex_escape(design_caption(stats)).replace(">=", "$\\geq$")
    cap = (f"Metrics against {tex_escape(target)}{of}: $r$, $R^2$, Spearman $\\rho$ and partial $r$ with {how}; "
           "null $r$: the mean $r$ over the permutations (what the design alone yields); $p$: equal-tailed "
           f"permutation $p$, {design}; $r$ and $p$ with one run "
           "left out, and whether one run moves $r$ by more than half its interval.")
    table = interval_table(stats)
    return _latex(table, cap, label_) if len(table) else ""


def design_factors_text(controls: Sequence[str]) -> str:
    """The design factors among ``controls``, each said: 'log(n_layers) (depth), log(hidden_size) (width)'."""
    from ncanalyze.analyzer.schema import DESIGN_FACTORS
    return ", ".join(f"{c} ({DESIGN_FACTORS[c]})" for c in controls if c in DESIGN_FACTORS)


def undefined_note(sel: pd.DataFrame, metric: str, target: str) -> str:
    """Why ``metric``'s correlations over ``sel`` are not defined, in a sentence naming it (numpy warned)."""
    values = lambda c: pd.to_numeric(sel[c], errors="coerce").dropna()  # noqa: E731
    if values(target).nunique() <= 1:
        return f"{md_name(target)} is constant over these checkpoints, so no r with it is defined (a dash)"
    if values(metric).nunique() <= 1:
        return f"{md_name(metric)} is constant over these checkpoints, so its r is not defined (a dash)"
    return (f"{md_name(metric)}: a control leaves it (or the target) nothing to vary, so its partial r is not defined "
            "(a dash)")


def per_metric(compute: Callable[[str], pd.DataFrame], metrics: Sequence[str], sel: pd.DataFrame,
               target: str) -> tuple[pd.DataFrame, list[str]]:
    """``compute(metric)`` of each metric, concatenated, with the RuntimeWarnings of numpy and pingouin where a
    statistic is undefined (a constant metric: a division by a zero spread) caught and said as notes naming the
    metric (:func:`undefined_note`), each once; other warnings pass on as they were."""
    frames, notes = [], []
    for m in metrics:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            frames.append(compute(m))
        for w in caught:
            if issubclass(w.category, RuntimeWarning):
                notes.append(undefined_note(sel, m, target))
            else:
                warnings.warn(w.message, w.category, stacklevel=2)
    table = pd.concat([f for f in frames if len(f)], ignore_index=True) if any(len(f) for f in frames) else \
        pd.DataFrame()
    return table, list(dict.fromkeys(notes))


def control_robustness(sel: pd.DataFrame, metrics: Sequence[str], target: str,
                       step: str = "global_step") -> tuple[pd.DataFrame, list[str]]:
    """Figure 1's metrics' partial r under each scale control, each beside log1p(step) where the step varies: none
    at all (r), log parameters, the design factors that vary (``design``), and architecture fixed effects (a
    dummy per (n_layers, hidden_size, n_params); where an architecture has several runs or checkpoints).

    Parameters
    ----------
    sel
        One tag's selected checkpoints.
    metrics
        The metrics (Figure 1's).
    target
        The target.
    step
        The training-progress column.

    Returns
    -------
    table, notes
        Formatted strings, one row per metric and scale (empty without the columns); where a statistic is not
        defined (a constant metric), a note naming the metric (:func:`per_metric`).
    """
    from ncanalyze.analyzer.stats import control_table
    from ncanalyze.analyzer.schema import DESIGN
    from ncanalyze.analyzer.stats import eval_controls, expand_design
    ms = [m for m in metrics if m in sel.columns]
    if not ms or target not in sel.columns or len(sel) < 4:
        return pd.DataFrame(), []
    varies = lambda c: c in sel and pd.to_numeric(sel[c], errors="coerce").nunique() > 1  # noqa: E731
    progress = eval_controls(sel, [f"log1p({step})"]) if varies(step) else pd.DataFrame(index=sel.index)
    design = expand_design(sel, [DESIGN])
    arch_cols = [c for c in ("n_layers", "hidden_size", "n_params") if c in sel]
    arch = sel[arch_cols].astype(str).agg("/".join, axis=1) if arch_cols else pd.Series("", index=sel.index)
    several = arch.value_counts().max() > 1 and arch.nunique() > 1
    fe = pd.get_dummies(arch, drop_first=True, dtype=float) if several else None
    plus = " + log1p(step)" if len(progress.columns) else ""
    scale = {"log(n_params)" + plus: eval_controls(sel, ["log(n_params)"]) if varies("n_params") else None,
             "design: " + (design_factors_text(design) or "none varies") + plus:
                 eval_controls(sel, design) if design else None,
             "architecture fixed effects" + plus: fe}
    table, notes = per_metric(lambda m: control_table(sel, [m], target, scale, progress), ms, sel, target)
    if table.empty:
        return table, notes
    out = pd.DataFrame({"metric": [m + (" (log)" if s == "log" else "") for m, s in zip(table.metric, table.scale)],
                        "n": table.n.astype(str), "no control (r)": table["none"].map(lambda v: fmt(v, 2))})
    for name in scale:
        out[name] = table[name].map(lambda v: fmt(v, 2))
    return out, notes
