"""report.md, section by section: the selection and target, per tag the correlation table with how to read it,
the permutations behind its p-values, Holm's survivors, the notes and the figures; what the numbers rest on; the
per-token tables; how Figure 1's metrics move with min_count (with a store); the files; the depth section."""
from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from ncanalyze.analyzer.registry import REPORT
from ncanalyze.analyzer.report.depth import TITLE as DEPTH_TITLE
from ncanalyze.analyzer.report.escape import md_name, md_names, md_text
from ncanalyze.analyzer.report.figures import FIGURES, TITLES, chosen, estimated, tag_suffix, title_target
from ncanalyze.analyzer.report.mincount import min_count_lines
from ncanalyze.analyzer.report.report_options import ReportOptions, ReportResult
from ncanalyze.analyzer.report.support import THIN, direction_lines, thin_warning
from ncanalyze.analyzer.report.tables import (code, control_robustness, controls_text, design_factors_text, family_name,
                                               fragility_lines, interval_table, intervals_how, no_control,
                                               no_control_text, notes, questions_table, summary, survivors,
                                               target_note, unreachable_lines)
from ncanalyze.analyzer.report.tokens import token_rows
from ncanalyze.analyzer.report.precision import budget_lines, error_lines
from ncanalyze.analyzer.schema import PLUGIN_OF
from ncanalyze.analyzer.stats import ALPHA, GEOMETRY, MIN_N, NC, permutation_text, split_tags


def tag_name(tag: str | None) -> str:
    """A tag as report.md names it."""
    return "(untagged)" if tag is None else md_name(tag)


def tags_text(tags: list) -> str:
    """The sentence on a selection of several tags: which, and that they are never pooled (report.md, report.html)."""
    return (f"The selection holds {len(tags)} tags (datasets): {', '.join(tag_name(t) for t, _ in tags)}. Tags "
            "are never pooled: each has its own statistics (Holm within the tag) and figures below. One tag "
            "alone: `--where \"tag == 'NAME'\"`; the untagged rows: `--where \"tag.isna()\"` (or `tag == ''`).")


def header(r: ReportResult, o: ReportOptions, tags: list) -> list[str]:
    """The title, the selection (checkpoints, runs, tags) and the target."""
    sel, target = r.selected, r.target
    n_runs = sel["run"].nunique() if "run" in sel else 1
    md = [f"# ncanalyze report: NC metrics against {target}", "",
          f"{len(sel)} checkpoints from {n_runs} run(s)" + (f" ({code(o.where)})" if o.where else "")
          + (f" in {md_name(o.store)}" if o.store else "") + ".", ""]
    md += unreachable_lines(r.stats)
    if o.per_run == "last":
        md += ["`--per-run last`: each run's latest checkpoint only (one row per run).", ""]
    if len(tags) > 1:
        md += [tags_text(tags), ""]
    return md + [target_note(target), ""] + reading(o, r.stats, len(tags) > 1)


def _families(stats: pd.DataFrame) -> str:
    """The Holm families of the metrics tested, each with its metrics."""
    fams = stats.drop_duplicates("metric").groupby("family", sort=False).metric.apply(list)
    order = [f for f in (NC, GEOMETRY) if f in fams] + [f for f in fams.index if f not in (NC, GEOMETRY)]
    return "; ".join(f"{family_name(f)} ({len(fams[f])}: {', '.join(fams[f])})" for f in order)


def reading(o: ReportOptions, stats: pd.DataFrame, several: bool) -> list[str]:
    """How to read the correlation tables (said once, before them)."""
    return ["r: Pearson's r of the metric with the target; R² = r², the fit of the least-squares line; rho: "
            "Spearman's rank correlation (the same on both scales). \"(log)\": log10 of the metric (the paper's "
            f"axes), where it is positive; the target is not logged. partial r: "
            f"{controls_text(stats.attrs.get('controls', o.controls))}{_design_said(o, stats)}. "
            "p, p rho: two-sided permutation p-values, equal-tailed (twice the smaller tail, at most 1: the null need "
            "not be centred at 0, see \"null r\" below); p FL: the same for the partial r, permuting "
            "the target's residuals on the controls (Freedman-Lane); the permutations behind them are said under "
            "each table. p Holm, p FL Holm: Holm-adjusted within a family of metrics, the NC metrics the paper tests "
            "(a scale-dependent one, such as `nc1_cdnv_p2`, alone) and the geometry metrics being two families (the geometry does not make the NC metrics' p more "
            "conservative), per scale (raw and log are separate families)" + (" and per tag" if several else "")
            + f". The families here: {_families(stats)}. p-values show 3 significant figures, more where rounding "
            f"would cross {ALPHA:g}. rho's Holm p is in stats.csv, as are parametric p-values and the partial r's "
            "95% CI, which assume independent rows (checkpoints of one run are not; their columns end in `_iid`).",
            ""]


def _design_said(o: ReportOptions, stats: pd.DataFrame) -> str:
    """What ``design`` in the controls stood for here (the varying architecture factors), or ''."""
    if "design" not in [c.strip() for c in o.controls]:
        return ""
    used = design_factors_text(stats.attrs.get("controls", []))
    return (f" (`design`: the architecture factors that vary among the selected runs, read from the stored config: "
            f"{used})" if used else " (`design`: no architecture factor varies among the selected runs, so no "
            "scale control)")


LICENSE = ("What licenses a claim: the permutation test. A metric is related to the target where its permutation "
           "p (after Holm, within its family) is small, against the null's centre (null r: what the shared design "
           "alone yields, e.g. a trend every run shares). An interval of r that excludes 0 while p is large says that "
           "the shared design, not the metric, carries r. Each claim answers one question: between models (r across "
           "runs at one step), within training beyond what all runs share at a step (the fixed-effects r), or the "
           "pooled r, which mixes both. Where a scale control is held fixed, say whether the association survives it "
           "(partial r, p FL).")


def claims_lines(r: ReportResult, stats: pd.DataFrame, rows: pd.DataFrame,
                 estimates: str = REPORT.estimates) -> list[str]:
    """The claims a reader may draw, said with what they rest on: what licenses a claim, the two questions apart
    (between models at each step, within training beyond the shared trend) beside the pooled r, the intervals over
    runs with the null's centre and leave-one-run-out, the runs that move r, the paper's comparisons and the partial
    r under each scale control (of Figure 1's metrics as ``--estimates`` chooses them)."""
    md = ["### Claims", "", LICENSE, ""]
    q = questions_table(stats)
    if len(q):
        md += ["### Between models and within training", "",
               "The pooled r mixes two questions. Between models: r across runs at one step (every step at least 4 "
               "runs share; p: permutations of the runs at that step, equal-tailed); the range over those steps and "
               "their count. Within training, beyond what all runs share at a step: the two-way fixed-effects r "
               "(metric and target less each run's level and each step's value common to all runs), so a trend every "
               "run follows (the training clock) carries no weight; p: whole runs permuted (equal-tailed), null r its "
               "centre; the 95% interval from the jackknife over runs. Per step: `by_step.csv`.", "",
               q.to_markdown(index=False, disable_numparse=True), ""]
    md += undefined_lines(stats)
    table = interval_table(stats)
    if len(table):
        md += ["### Intervals over runs, the null and one run's influence", "",
               f"{intervals_how(stats)}. R²'s interval is r's squared (from 0 where r's holds 0). null r: the mean r "
               "over the permutations, the centre to read r against. Without one run: r's and p's range with each "
               "run left out in turn; one run moves it: whether leaving out some run moves r (or the partial r) by "
               "more than half its interval.", "",
               table.to_markdown(index=False, disable_numparse=True), ""]
    fragile = fragility_lines(stats)
    if fragile:
        md += ["Claims one run moves (leave-one-run-out):", ""] + [f"- {f}" for f in fragile] + [""]
    md += comparison_lines(stats)
    fig1 = FIGURES["fig1_nc_vs_loss"][1]
    ctrl, undefined = control_robustness(rows, chosen(fig1, estimated((*fig1, *PLUGIN_OF), estimates, rows)), r.target)
    if len(ctrl):
        md += ["### Figure 1's metrics under each scale control", "",
               "The partial r with the target, by what stands for model scale (each beside log1p(step), training "
               "progress, where the step varies): none, log parameters, the design factors that vary here, and "
               "one fixed effect per architecture (n_layers, hidden_size, n_params; where an architecture has "
               "several runs or checkpoints, else a dash).", "",
               ctrl.to_markdown(index=False, disable_numparse=True), ""]
    if undefined:
        md += ["Notes:", ""] + [f"- {n}" for n in undefined] + [""]
    return md


def undefined_lines(stats: pd.DataFrame) -> list[str]:
    """One line per question that has no estimand here (one run, one step, copies of one run), or nothing."""
    out = []
    for col, what in (("claims_why", "Intervals and verdicts"), ("within_why", "Within training")):
        why = stats[col].dropna().astype(str) if col in stats else pd.Series([], dtype=str)
        why = why[why != ""]
        if len(why) and len(why) == len(stats[stats.r.notna()]) and why.nunique() == 1:
            out += [f"**{what}: not defined here** ({md_text(why.iloc[0])}).", ""]
    return out


def comparison_lines(stats: pd.DataFrame) -> list[str]:
    """The paper's "A relates to the target more than B", each from a paired bootstrap of R²(A) - R²(B)."""
    rows = stats[stats.vs_metric.fillna("") != ""] if "vs_metric" in stats else stats.iloc[:0]
    if rows.empty:
        return []
    md = ["### Does one metric relate more than another?", "",
          "R²(A) - R²(B) on the same checkpoints, with its 95% percentile interval from a paired bootstrap of whole "
          "runs (each resample draws the same runs for both) and the share of resamples where the difference is <= "
          "0; the interval's ends carry a Monte-Carlo error from the number of resamples.", ""]
    for _, s in rows.iterrows():
        said = ("more" if s.d_r2_ci_low > 0 else "less" if s.d_r2_ci_high < 0 else "not clearly more or less")
        md.append(f"- `{s.metric}` against `{s.vs_metric}` ({s.scale}): ΔR² {s.d_r2:+.3f} [{s.d_r2_ci_low:+.3f}, "
                  f"{s.d_r2_ci_high:+.3f}], P(ΔR² <= 0) = {s.d_r2_p_le0:.3f} over {int(s.d_r2_n_boot)} resamples "
                  f"(Monte-Carlo error of the ends ±{s.d_r2_mc_error:.2g}): {s.metric} relates {said}.")
    return md + [""]


def tag_stats(stats: pd.DataFrame, tag: str | None) -> pd.DataFrame:
    """One tag's rows of the statistics (None: the untagged), with the statistics' attributes (the seed)."""
    out = (stats[stats.tag.isna()] if tag is None else stats[stats.tag == tag]).reset_index(drop=True)
    out.attrs.update(stats.attrs)
    return out


def _correlation_section(r: ReportResult, o: ReportOptions, tag: str | None, rows: pd.DataFrame,
                         several: bool) -> list[str]:
    """One tag's correlation table with how to read it, its permutations, Holm's survivors, notes and figures."""
    stats = tag_stats(r.stats, tag)
    md = [f"## Correlation with {r.target}" + (f", tag {tag_name(tag)} ({len(rows)} checkpoints)" if several else ""),
          "", summary(stats).to_markdown(index=False, disable_numparse=True), ""]
    md += [no_control_text(stats), ""] if no_control(stats) else []
    if len(rows) < MIN_N:
        md += [f"**Only {len(rows)} checkpoint(s): correlations need at least {MIN_N}.**", ""]
    md += [permutation_text(stats, o.seed), ""]
    md += claims_lines(r, stats, rows, o.estimates)
    if survivors(stats):
        md += ["Multiple comparisons (Holm, family-wise error 0.05):", ""] + [f"- {s}" for s in survivors(stats)]
        md += [""]
    if notes(stats):
        md += ["Notes:", ""] + [f"- {md_text(n)}" for n in notes(stats)] + [""]
    suffix = tag_suffix(tag) if several else ""
    figures = {k: f for k, f in r.figures.items() if (k.endswith(suffix) if suffix else "__" not in k)}
    others = [f.upper() for f in o.formats if f != "png"]
    md += ["### Figures" if several else "## Figures", "", (f"Each figure is also in {' and '.join(others)} beside "
           "its PNG." if others else "Each figure is a PNG only (`--formats png`)."), ""]
    return md + [f"![{TITLES[k.split('__')[0]].format(target=title_target(r.target))}]({f.name})\n"
                 for k, f in figures.items()]


def _support_section(r: ReportResult, o: ReportOptions) -> list[str]:
    """What the numbers rest on: kept classes, singletons, token counts; which direction is more collapse."""
    md = ["## What the numbers rest on", ""]
    sel = r.selected
    if "n_kept" in sel and sel["n_kept"].notna().any():
        def span(col: str) -> str:
            v = sel[col].dropna()
            return "—" if v.empty else (f"{int(v.min())}" if v.min() == v.max() else f"{int(v.min())}-{int(v.max())}")
        md += [f"Per checkpoint (metrics.csv): {span('n_kept')} kept classes (`n_kept`), {span('n_singletons')} of "
               f"them seen once (`n_singletons`), {span('n_thin')} with fewer than {THIN} train tokens (`n_thin`); "
               f"{span('train_tokens')} train tokens, {span('val_tokens')} validation tokens.", ""]
        if "n_pairs_unresolved" in sel and sel["n_pairs_unresolved"].notna().any():
            md += [f"`nc1_cdnv_debiased` rests on {span('n_classes_debiased')} classes of the set fixed by the split's "
                   f"token frequencies (`n_classes_debiased`); {span('n_pairs_unresolved')} of their pairs are not "
                   "resolved by the sample (`n_pairs_unresolved`: their means' distance below twice its noise, "
                   "floored at it, so their terms err low; more train tokens resolve them).", ""]
    else:
        md += ["The kept-class and token counts are not in this table (a metrics CSV without them): report from the "
               "store to see them.", ""]
    warning = thin_warning(sel)
    if warning:
        md += [f"**Warning:** {md_text(warning)}", ""]
    return md + ["Which way is more collapse:", ""] + direction_lines(list(o.metrics)) + [""]


def _token_section(r: ReportResult) -> list[str]:
    """The per-token tables, one per checkpoint, after the notes on the tokens."""
    if r.tokens is None:
        return [f"**Note:** {md_text(n)}.\n" for n in r.notes]
    md = ["## Per-token statistics", "", "Mean CDNV and mean interference are to the other kept classes; "
          "the average token is the mean over the kept classes.", ""]
    md += [f"**Note:** {md_text(n)}.\n" for n in r.notes]
    for g, t in r.tokens.groupby("checkpoint", sort=False):
        rows = token_rows(t, lambda x: md_text(repr(x)).replace("|", r"\|"))
        md += [f"### {md_name(g)}", "", rows.to_markdown(index=False, floatfmt=".4g"), ""]
    return md


def formats_text(formats: Sequence[str]) -> str:
    """'`.png` (150 dpi), `.pdf` (fonts embedded) and `.svg`': the figures' files, as ``formats`` asked."""
    said = {"png": "`.png` (150 dpi)", "pdf": "`.pdf` (fonts embedded)", "svg": "`.svg`"}
    parts = [said[f] for f in formats]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _files_section(r: ReportResult, skipped: dict[str, str] | None, formats: Sequence[str]) -> list[str]:
    """The checkpoints skipped (group: why) and the list of files."""
    md = []
    if skipped:
        md += ["## Skipped checkpoints", "", f"{len(skipped)} checkpoint(s) could not be measured and are left out:",
               ""] + [f"- {md_name(g)}: {md_text(why)}" for g, why in skipped.items()] + [""]
    md += ["## Files", "", "- `metrics.csv`: one row per checkpoint",
           "- `stats.csv`: every statistic, with its Holm `family`, the unit permuted (`perm_unit`) and the floor of "
           "the permutation p (`p_floor`), the null's centre (`r_null`), the intervals over runs (`*_ci_low`, "
           "`*_ci_high`, `ci_method`, `ci_units`), the two questions (`between_*`; `within_*`, the fixed-effects r "
           "beyond what all runs share at a step), leave-one-run-out (`loo_r_min`, `loo_r_max`, `loo_p_min`, "
           "`loo_p_max`, `robust`, `loo_flips`) and the paired comparisons of R² (`vs_metric`, `d_r2*`); columns "
           "ending in `_iid` assume independent rows",
           "- `by_step.csv`: between models, r across runs at each step that at least 4 runs share",
           "- `tables.tex`: the tables for LaTeX, a raw and a log10 table per tag (needs "
           "`\\usepackage{booktabs,graphicx}`)"]
    if r.figures:
        md += ["- " + ", ".join(f"`{f.stem}`" for f in r.figures.values()) + ": the figures, each as "
               + formats_text(formats)]
    if r.tokens is not None:
        md += ["- `tokens.csv`: the per-token table"]
    if r.min_count is not None:
        md += ["- `min_count.csv`: Figure 1's metrics of each run's latest checkpoint at min_count 1, 2, 5 and 20, "
               "with the kept classes at each (`value_<m>`, `n_kept_<m>`) and the relative change (`rel_change`)"]
    return md


def _depth_section(r: ReportResult, formats: Sequence[str]) -> list[str]:
    """The depth figure, its gaps and the per-layer table (nothing unless a checkpoint has several layers)."""
    if r.depth is None:
        return []
    md = ["", "## Across depth", "", "Layer l is transformers' `hidden_states[l]` (0: the embedding "
          "output; the last: after the final norm, the checkpoint group). NC4 at the other layers uses the "
          "logit lens (the head after the final norm); the correlations above use the last layer only.", "",
          f"![{DEPTH_TITLE}]({r.files['depth'].name})", ""]
    if r.depth_notes:
        md += ["Gaps in the figure (values not defined there, e.g. at layer 0 two tokens can share one input "
               "embedding, so a distance between class means is 0 and CDNV and GNC2 are infinite):", ""]
        md += [f"- {md_text(n)}" for n in r.depth_notes] + [""]
    return md + [md_names(r.depth).to_markdown(index=False, floatfmt=".4g"), "",
                 "- `layers.csv`: the per-layer table; `depth`: the figure, as " + formats_text(formats), ""]


def markdown(result: ReportResult, options: ReportOptions, skipped: dict[str, str] | None = None) -> str:
    """report.md: the selection, per tag the correlation table with how to read it, notes and figure links, what
    the numbers rest on, the per-token tables, how Figure 1's metrics move with min_count (with a store), the
    checkpoints skipped and the files; the depth section with a checkpoint of several layers.

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
    tags = split_tags(result.selected)
    md = header(result, options, tags)
    for tag, rows in tags:
        md += _correlation_section(result, options, tag, rows, len(tags) > 1)
    md += _support_section(result, options) + _token_section(result)
    if result.min_count is not None:
        md += min_count_lines(md_names(result.min_count), [md_text(n) for n in result.min_count_notes])
    md += error_lines(result.selected)
    if result.budget is not None:
        md += budget_lines(result.budget, result.budget_notes)
    md += _files_section(result, skipped, options.formats)
    return "\n".join(md) + "\n" + "\n".join(_depth_section(result, options.formats))
