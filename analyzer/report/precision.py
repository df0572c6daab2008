"""How sure the report's numbers are: each final checkpoint's headline metrics with their delete-one-fold jackknife
errors (report.md, tables.tex), and the token budget (the metrics on the first 1, 2, 4, ..., F folds of each run's
latest checkpoint, the plug-in and the debiased number side by side: ``budget.csv``, the ``budget`` figure, and in
report.md, per metric, whether it drifts with the budget (bias) or only scatters (noise), which number to compare,
and each that has not settled). The correlation statistics rest on the point values; the errors are shown where the
numbers are read. The "±" is the sampling error (the token sample's noise), never how sure a drifting number is."""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ncanalyze.analyzer.registry import FIGURE_FORMATS as FORMATS
from ncanalyze.analyzer.report.escape import md_name, md_text
from ncanalyze.analyzer.report.mincount import HEADLINE, MAX_RUNS
from ncanalyze.analyzer.report.tables import code, fmt, tex_escape
from ncanalyze.analyzer.report.tokens import GroupReader, latest_checkpoints
from ncanalyze.analyzer.schema import COMPANION, PLUGIN_OF
from ncanalyze.core.errors import UserError

DRIFT = 2  # a metric drifts where it moved from the smallest budget with an error to the whole sample by more than
# this many of that budget's sampling errors (the nested samples' difference has a smaller error than that one)

STATED = "The correlation statistics rest on the point values; the errors are not propagated into them."


def _with_error(value: float, se: float) -> str:
    """'0.123 ± 0.004', or the value alone where there is no error."""
    return fmt(value) if not np.isfinite(se) else f"{fmt(value)} ± {fmt(se)}"


def final_rows(sel: pd.DataFrame) -> pd.DataFrame:
    """Each run's latest selected checkpoint (its last layer rows)."""
    if sel.empty:
        return sel
    if "run" not in sel:  # rows of no run: the last (latest) one
        return sel.sort_values("global_step", kind="stable").tail(1) if "global_step" in sel else sel.tail(1)
    order = sel.sort_values(["run", "global_step"] if "global_step" in sel else ["run"], kind="stable")
    return order.groupby("run", sort=True, dropna=False).tail(1)


def error_lines(sel: pd.DataFrame, metrics: Sequence[str] = HEADLINE) -> list[str]:
    """report.md's table of the final checkpoints' metrics with their jackknife errors (value ± se)."""
    rows = final_rows(sel)
    metrics = [m for m in metrics if m in rows.columns]
    if rows.empty or not metrics or not any(f"{m}_se" in rows for m in metrics):
        return []
    head = "| run | checkpoint | " + " | ".join(code(m) for m in metrics) + " |"
    lines = ["## Errors of the final checkpoints", "",
             "Each metric ± its delete-one-fold jackknife standard error (the token sample's noise; the folds are "
             f"disjoint sets of whole blocks). {STATED}", "", head, "|" + " --- |" * (len(metrics) + 2)]
    for _, r in rows.iterrows():
        cells = [_with_error(r[m], r.get(f"{m}_se", math.nan)) for m in metrics]
        names = (md_name(r.get(c, ""), table=True) for c in ("run", "checkpoint"))
        lines.append("| " + " | ".join([*names, *cells]) + " |")
    return lines + [""]


def errors_latex(sel: pd.DataFrame, metrics: Sequence[str] = HEADLINE) -> str:
    """tables.tex's table of the final checkpoints' metrics with their jackknife errors ('' where there are none)."""
    rows = final_rows(sel)
    metrics = [m for m in metrics if m in rows.columns and f"{m}_se" in rows.columns]
    if rows.empty or not metrics:
        return ""
    cols = "ll" + "r" * len(metrics)
    head = " & ".join(["run", "checkpoint", *(tex_escape(m) for m in metrics)]) + r" \\"
    body = [" & ".join([tex_escape(str(r.get("run", ""))), tex_escape(str(r.get("checkpoint", ""))),
                        *(_with_error(r[m], r[f"{m}_se"]).replace("±", r"$\pm$") for m in metrics)]) + r" \\"
            for _, r in rows.iterrows()]
    fit = "\\resizebox{\\ifdim\\width>\\linewidth\\linewidth\\else\\width\\fi}{!}{%"  # within the line, as the others
    return "\n".join([r"\begin{table}[t]", r"\centering", r"\small", fit, rf"\begin{{tabular}}{{{cols}}}",
                      r"\toprule", head, r"\midrule", *body, r"\bottomrule", r"\end{tabular}}",
                      r"\caption{The final checkpoints' metrics $\pm$ their delete-one-fold jackknife standard errors. "
                      + tex_escape(STATED) + "}", r"\label{tab:errors}", r"\end{table}", ""])


def final_budget_table(sel: pd.DataFrame, read_group: GroupReader, metrics: Sequence[str] = HEADLINE,
                 max_runs: int = MAX_RUNS) -> tuple[pd.DataFrame, list[str]]:
    """The token budget of each run's latest selected checkpoint: its metrics and jackknife errors on the first 1,
    2, 4, ..., F folds (:func:`~ncanalyze.analyzer.jackknife.nested_budgets`), at the min_count it was measured with.

    Parameters
    ----------
    sel : the selected checkpoints' last-layer rows.
    read_group : gives a checkpoint's dataset.
    metrics : the metrics shown (Figure 1's).
    max_runs : at most this many runs, the first by name.

    Returns
    -------
    table, notes : one row per (checkpoint, budget): run, checkpoint, folds, tokens, each metric and ``<m>_se``
        (the debiased forms of those that have one beside them), ``split_tokens`` (the train split's labels, nan
        where not recorded); the notes: checkpoints without folds, or that could not be read.
    """
    from ncanalyze.analyzer import jackknife
    from ncanalyze.analyzer.metrics import measure_all
    from ncanalyze.analyzer.schema import MEASURED

    frames, notes = [], []
    for g in latest_checkpoints(sel)[:max_runs]:
        try:
            ds = read_group(g)
        except UserError as e:
            notes.append(f"{g}: no token budget ({e})")
            continue
        if "fold_count" not in ds or jackknife.n_folds(ds) < 2:
            notes.append(f"{g}: no token budget (extracted without folds: --folds 1, or before format 3)")
            continue
        whole, min_count = stored_metrics(ds.attrs), int(ds.attrs.get("metrics_min_count") or 1)
        ds = ds[[v for v in (*MEASURED, *jackknife.FOLD_VARS) if v in ds.variables]].load()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = jackknife.nested_budgets(ds, lambda d: measure_all(d, min_count=min_count, device="cpu", se=False)[0], whole)
        run, _, checkpoint = g.partition("/")
        keep = ["folds", "tokens", *(c for m in with_debiased(metrics) for c in (m, f"{m}_se"))]
        split = int(ds["split_count"].sum()) if "split_count" in ds else math.nan  # the split's train labels
        frames.append(t[keep].assign(run=run, checkpoint=checkpoint, split_tokens=split))
    if not frames:
        return pd.DataFrame(), notes
    table = pd.concat(frames, ignore_index=True)
    return table[["run", "checkpoint", *(c for c in table.columns if c not in ("run", "checkpoint"))]], notes


def stored_metrics(attrs: dict) -> dict[str, float] | None:
    """A group's stored metrics and their jackknife errors (``measure``'s record, at ``metrics_min_count``), where
    they are current (:func:`~ncanalyze.analyzer.table.is_measured`) and hold the errors; else None."""
    from ncanalyze.analyzer.schema import ERRORS
    from ncanalyze.analyzer.table import is_measured, metrics_row

    current = is_measured(attrs, attrs.get("metrics_min_count"))
    return metrics_row(attrs) if current and set(ERRORS) <= set(attrs["metrics"] or {}) else None


def with_debiased(metrics: Sequence[str]) -> list[str]:
    """``metrics``, each followed by its debiased form (schema.PLUGIN_OF) and its budget-stable companion
    (schema.COMPANION) where it has them."""
    debiased = {p: d for d, p in PLUGIN_OF.items()}
    return list(dict.fromkeys(x for m in metrics for x in (m, debiased.get(m), COMPANION.get(m)) if x is not None))


def _moves(t: pd.DataFrame, m: str) -> tuple[pd.Series, float, bool] | None:
    """Metric ``m`` over one checkpoint's budgets: its first row with a sampling error, its move from there to the
    whole sample in errors of that row, and whether that is a drift (beyond DRIFT errors); None without errors."""
    if f"{m}_se" not in t:
        return None
    has = t[np.isfinite(t[f"{m}_se"].to_numpy(float)) & (t[f"{m}_se"].to_numpy(float) > 0)]
    last = t.iloc[-1]
    if len(has) < 1 or not np.isfinite(last[f"{m}_se"]) or len(t) < 2:
        return None
    first = has.iloc[0]
    moves = (last[m] - first[m]) / first[f"{m}_se"]
    return first, moves, bool(abs(moves) > DRIFT and first["tokens"] < last["tokens"])


def _stable(t: pd.DataFrame, names: Sequence[str | None]) -> str | None:
    """The first of ``names`` measured here whose sampling error says it does not drift."""
    for n in names:
        got = _moves(t, n) if n else None
        if got is not None and not got[2]:
            return n
    return None


def drift_row(t: pd.DataFrame, m: str) -> dict[str, str]:
    """One checkpoint's reading of metric ``m`` over its budgets: from the smallest budget with a sampling error to
    the whole sample, the move in errors of that budget, and whether it drifts (bias), only scatters (noise) or has
    no error to tell; with the number to compare."""
    got = _moves(t, m)
    if got is None:
        return {"metric": code(m), "move": "–", "reading": "no sampling error (fewer blocks than folds?): not known",
                "compare": "–"}
    (first, moves, drifts), last = got, t.iloc[-1]
    debiased = {p: d for d, p in PLUGIN_OF.items()}
    plugin = PLUGIN_OF.get(m, m)
    instead = _stable(t, (debiased.get(m), COMPANION.get(plugin)))
    if not drifts:
        compare = "this number, across budgets (within its sampling error)"
    elif instead:
        compare = f"{code(instead)} across budgets and with other studies; this one at equal budgets only"
    elif m in PLUGIN_OF or m in debiased:
        compare = "no form of it holds still here: at equal budgets only"
    else:
        compare = "at equal budgets only (no debiased form: see its documentation)"
    return {"metric": code(m), "move": f"{fmt(first[m])} → {fmt(last[m])} ({moves:+.1f} errors, "
            f"{int(first['tokens']):,} → {int(last['tokens']):,} tokens)",
            "reading": "drifts with the budget (bias)" if drifts else "only scatters (noise)", "compare": compare}


def _said(row: dict[str, str]) -> str:
    """A :func:`drift_row` as a line of report.md."""
    return f"{row['metric']}: {row['reading']}; {row['move']}; compare {row['compare']}"


def budget_lines(table: pd.DataFrame, notes: Sequence[str], metrics: Sequence[str] = HEADLINE) -> list[str]:
    """report.md's token-budget section: per checkpoint and metric (the debiased forms beside), whether it drifts
    with the budget or only scatters, and which number to compare; each metric that has not settled (it moved
    between the last two budgets by more than its sampling error), with "raise --max-train-tokens" only where the
    split holds more tokens; "settled" only where every metric shown has an error at the last budget; the notes."""
    from ncanalyze.analyzer.jackknife import unsettled

    if table.empty and not notes:
        return []
    lines = ["## Token budget", "",
             "Each run's latest checkpoint measured on the first 1, 2, 4, ..., F folds of its tokens (budget.csv and "
             "the budget figure: the paper's plug-in numbers solid, the debiased ones dashed, each with its "
             "sampling-error band). The ± is the sampling error (the noise of the token sample); a number that "
             f"drifts with the budget (a move beyond {DRIFT} sampling errors) is biased by the budget, and its ± does "
             "not say how far it is from the population's value."]
    moving, rows, unknown = [], [], []
    for (run, checkpoint), t in (table.groupby(["run", "checkpoint"], sort=True) if not table.empty else []):
        t = t.reset_index(drop=True)
        shown = [m for m in with_debiased(metrics) if m in t]
        rows += [f"- {md_name(f'{run}/{checkpoint}')} {line}" for line in map(_said, (drift_row(t, m) for m in shown))]
        split = t["split_tokens"].iloc[-1] if "split_tokens" in t else math.nan
        more = None if not np.isfinite(split) else bool(split > t["tokens"].iloc[-1])
        moving += [f"- {md_name(f'{run}/{checkpoint}')}: {line}" for line in unsettled(t, shown, more)]
        unknown += [code(m) for m in shown if not np.isfinite(t[f"{m}_se"].iloc[-1])]
    if not table.empty:
        lines += ["", "![token budget](budget.png)", "", *rows, ""]
        lines += moving
        if unknown:
            lines += [f"Whether {', '.join(dict.fromkeys(unknown))} settled is not known: no sampling error at the "
                      "last budget (a fold without tokens, e.g. more --folds than blocks)."]
        elif not moving:
            lines += ["Every metric shown moved less than its sampling error between the last two budgets."]
    return lines + [f"- {md_text(n)}" for n in notes] + [""]


def budget_figure(table: pd.DataFrame, metrics: Sequence[str], out: Path,
                  formats: Sequence[str] = FORMATS) -> Path | None:
    """The budget figure (budget.png and the other ``formats``): each metric against the train tokens used, one line
    per checkpoint, its debiased form (where it has one) dashed in the same panel, each with its sampling-error
    band."""
    from ncanalyze.analyzer.report.figures import save_figure
    from ncanalyze.analyzer.report.ticks import subplots

    if table.empty:
        return None
    metrics = [m for m in metrics if m in table]
    fig, axes = subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.0), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for (run, checkpoint), t in table.groupby(["run", "checkpoint"], sort=True):
            colour = None
            for k, c in enumerate(x for x in with_debiased([m]) if x in t):
                x, y, e = t["tokens"].to_numpy(float), t[c].to_numpy(float), t[f"{c}_se"].to_numpy(float)
                line, = ax.plot(x, y, ("-o", "--s", ":^")[k], ms=3, lw=1, color=colour,
                                label=f"{run}/{checkpoint}" + (f" {c}" if k else ""))
                colour = line.get_color()
                band = np.isfinite(e)
                ax.fill_between(x[band], (y - e)[band], (y + e)[band], color=colour, alpha=0.2, lw=0)
        shown = [x for x in with_debiased([m]) if x in table]
        if np.isfinite(table[shown].to_numpy(float)).any():  # a log axis over no point cannot be drawn
            ax.set_xscale("log", base=2)
        else:
            ax.text(0.5, 0.5, "undefined at every budget", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(" / ".join(shown), fontsize=8)
        ax.set_xlabel("train tokens (log scale)")
        ax.grid(alpha=0.3)
    if table.groupby(["run", "checkpoint"]).ngroups <= 8:
        axes[0][0].legend(fontsize=6)
    fig.suptitle("Token budget: the metrics on the first 1, 2, 4, ..., F folds (solid: the paper's plug-in; dashed: "
                 "debiased; dotted: the budget-stable companion; band: ± sampling error)", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, Path(out), "budget", formats)
