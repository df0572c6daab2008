"""Correlation of NC metrics with a target (eval loss): Pearson r, Spearman rho, R², partial r, permutation p-values.

Scales. Each metric is correlated with the target twice: raw, and with log10 of the metric where the metric is
positive on every selected checkpoint (the paper plots eval loss against log-scaled NC axes and fits there). The
target itself is never logged. R² is that of the least-squares line, i.e. r². Spearman's rho (the r of the ranks)
is the same on both scales, log10 being monotone.

Partial correlation. Controls are expressions over the metrics table (pandas ``eval`` syntax, evaluated by
``expr`` over the columns and an allow-list of functions); by default
``design`` (scale: the architecture factors that vary among the selected rows, :func:`expand_design`: depth,
width, parameters from the stored config) and ``log1p(global_step)`` (training progress: loss falls roughly as a power of the step,
so its log is the linear scale; the +1 keeps a step-0 checkpoint). Absolute step, not the fraction of a run's last
step, because a final checkpoint has fraction 1 whether its run trained one epoch or ten. Controls that are
constant or collinear on the selected rows are dropped (and said so); a control that uses the target or a metric
under test is refused (a partial correlation cannot hold fixed what it correlates).

Permutation p-values are two-sided and equal-tailed, twice the smaller tail (at most 1; the null need not be
centred at 0, its mean is ``r_null``): for r and rho the target is permuted; for the partial r the
target's residuals on the controls are permuted (Freedman & Lane 1983). Which permutations: with ``runs`` (the
column naming each row's run) and several checkpoints in a run, whole runs are permuted among runs with as many
checkpoints, matched by step order (runs are exchangeability blocks; :mod:`ncanalyze.analyzer.permute` says why);
otherwise the rows. When the scheme has at most ``n_perm`` distinct permutations all are enumerated and p is
exact; otherwise each tail is (1 + #{r* beyond r}) / (1 + B) (Phipson & Smyth), as in
``scipy.stats.permutation_test``.

Claims. Beside the pooled r: 95% intervals that respect the runs (Fisher's z where each run is one row, the
jackknife over runs otherwise), R²'s from r's, the two questions apart (between models at each step; within
training beyond what all runs share at a step, the two-way fixed-effects r) with notes where their tested signs
disagree (:mod:`ncanalyze.analyzer.questions`, :mod:`ncanalyze.analyzer.resample`), the paper's "A relates more than
B" comparisons by a paired bootstrap of the difference in R² (:func:`compare_r2`), and leave-one-run-out: how far
one run moves r (:func:`leave_one_out`).

Never pooled. Rows of different tags (datasets) are never one statistic: :func:`correlations_by_tag` computes each
tag's apart (untagged rows are a group of their own), with a ``tag`` column. :func:`last_per_run` keeps one
checkpoint per run (``--per-run last``).

Multiple comparisons. Many metrics are tested at once, so the permutation p-values are also given Holm-adjusted
(``p_holm``, ``partial_p_holm``, ``rho_p_holm``; Holm 1979, ``pingouin.multicomp``) across the metrics with
a finite p, within a family (:func:`family`: the NC metrics the paper tests, ``schema.NC_METRICS``, and the
geometry metrics, ``schema.GEOMETRY_METRICS``; any other column is a family of its own), per scale and per tag: the
raw and the log scale are two families, not one, since each metric appears in both, and each tag is a study of its
own. An equal-tailed permutation p cannot fall below the scheme's floor (``p_floor``: 2/N for N distinct
permutations, all enumerated; 2/(1 + B) for B drawn: twice the smallest tail), so a Holm p over m metrics cannot
fall below m x floor: with few runs no metric can survive, whatever the data (:func:`unreachable`).

Controls. Controls that are constant or collinear on the selected rows are dropped, and so are controls nearly
collinear with the others (variance inflation factor above :data:`MAX_VIF`, the largest first: on a depth x width
grid, log parameters is nearly a function of the two): the partial r would rest on a handful of residual degrees of
freedom. Each drop is said in a note.

Independence. Only the permutation p-values respect runs; the parametric ones (``p_param_iid``,
``partial_p_param_iid``) and the partial r's Fisher CI (``partial_ci_low_iid``, ``partial_ci_high_iid``) assume
independent rows, which checkpoints of one run are not: the suffix says so in stats.csv.
"""
from __future__ import annotations

import enum
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pandas as pd

from ncanalyze.analyzer.expr import evaluate
from ncanalyze.analyzer.permute import MIN_N, ROWS, Scheme, perm_test
from ncanalyze.analyzer.questions import CLAIM_COLUMNS, STEP_COLUMNS, claims, residual_r, sign_notes
from ncanalyze.analyzer.registry import N_BOOT, N_PERM, REPORT, enough_resamples
from ncanalyze.analyzer.resample import paired_bootstrap, run_codes
from ncanalyze.analyzer.schema import (
    COMPARISONS,
    CONTROLS,
    DESIGN,
    DESIGN_FACTORS,
    GEOMETRY_METRICS,
    NC_METRICS,
    SCALARS,
    SCALE_DEPENDENT,
)
from ncanalyze.core.errors import UserError

METRICS = SCALARS  # the metrics tested by default: all of them
ALPHA = 0.05  # the level report.md speaks of
MAX_VIF = 30  # a control whose variance inflation factor is above this is dropped (nearly collinear)
NC, GEOMETRY = "NC", "geometry"  # the two Holm families (stats.csv's ``family``)
LOSSES = ("val_loss", "eval_loss")  # the targets the report is for


class StatisticsWarning(RuntimeWarning):
    """A numerical warning raised while computing one metric's statistics, re-raised naming the metric."""


def family(metric: str) -> str:
    """The Holm family of a metric: :data:`NC` (the paper's NC metrics, less the scale-dependent
    ``schema.SCALE_DEPENDENT``), :data:`GEOMETRY` (the representation geometry beyond NC), or the column's own name
    for any other column (a scale-dependent metric among them)."""
    if metric in SCALE_DEPENDENT:
        return metric
    return NC if metric in NC_METRICS else GEOMETRY if metric in GEOMETRY_METRICS else metric


def _valid_targets(df: pd.DataFrame, metrics: Sequence[str]) -> str:
    """The columns a target may be, for a message: the losses present, then the other numeric columns."""
    numeric = [c for c in df.columns if c not in metrics and c not in LOSSES
               and pd.to_numeric(df[c], errors="coerce").notna().any()]
    losses = [c for c in LOSSES if c in df.columns]
    text = "valid targets: " + (", ".join(losses) + " (the losses)" if losses else "no loss column here")
    return text + (f"; other numeric columns: {', '.join(map(str, numeric))}" if numeric else "")


def _target(df: pd.DataFrame, target: str, metrics: Sequence[str]) -> pd.Series:
    """The target column as floats; a one-line UserError naming it and the valid targets where it is absent, not
    numeric, a metric under test or without values."""
    valid = _valid_targets(df, metrics)
    if target not in df.columns:
        raise UserError(f"target {target!r} is not a column of the metrics table (--target); {valid}")
    if target in metrics:
        raise UserError(f"target {target!r} is a metric under test (--target, --metrics): it would be correlated with itself; "
                        f"{valid}")
    raw = df[target]
    y = pd.to_numeric(raw, errors="coerce").astype(float)
    text = raw[y.isna() & raw.notna() & (raw.astype(str).str.strip() != "")]
    if len(text):
        raise UserError(f"target {target!r} is not a number (--target; it holds text, e.g. {text.iloc[0]!r}): the "
                        f"metrics are correlated with a numeric column; {valid}")
    if y.isna().all():
        why = {"eval_loss": "the runs logged no evaluation (no eval_loss in trainer_state.json)",
               "val_loss": "ncanalyze measured no validation loss (extracted without validation tokens)"}
        raise UserError(f"target {target!r} has no values in the selected checkpoints (--target)"
                        f"{': ' + why[target] if target in why else ''}; {valid}")
    return y


class NoteKind(enum.Enum):
    """What a note on a statistic says (stats.csv's ``note_kinds``, comma-separated values)."""
    NO_VALUES = "no_values"          # the metric was not measurable here
    NOT_POSITIVE = "not_positive"    # no log scale
    TOO_FEW = "too_few"              # too few checkpoints for a correlation, a partial r or its CI
    FEW_PERMUTATIONS = "few_permutations"  # too few distinct permutations for a small p
    CONSTANT = "constant"            # metric or target constant
    CONTROLS = "controls"            # a control dropped, unused, or determining the metric
    LEFT_OUT = "left_out"            # rows left out (an infinite target)
    SIGN_FLIP = "sign_flip"          # between models, within training and pooled disagree in sign
    FRAGILE = "fragile"              # one run moves r by more than half its interval
    UNDEFINED = "undefined"          # an interval, a verdict or a question has no estimand here
    SCALE_DEPENDENT = "scale_dependent"  # the metric is not scale-free (schema.SCALE_DEPENDENT says how)


class Note(NamedTuple):
    """One note on a row of the statistics: its kind and its words."""
    kind: NoteKind
    text: str


def note_columns(notes: Sequence[Note]) -> dict[str, str]:
    """A row's ``note`` (the words, '; '-joined) and ``note_kinds`` (the kinds' values, comma-joined)."""
    return {"note": "; ".join(n.text for n in notes),
            "note_kinds": ",".join(dict.fromkeys(n.kind.value for n in notes))}


def has_note(stats: pd.DataFrame, kind: NoteKind) -> pd.Series:
    """Which rows of the statistics carry a note of ``kind``."""
    return stats.note_kinds.fillna("").str.split(",").map(lambda kinds: kind.value in kinds)


def independent_controls(C: pd.DataFrame) -> list[str]:
    """The controls, in order, that :func:`control_choice` keeps."""
    return control_choice(C)[0]


def control_choice(C: pd.DataFrame) -> tuple[list[str], dict[str, str]]:
    """The controls kept, in order, and why each other one was dropped: constant or collinear (adds no rank to [1,
    controls so far]), or nearly collinear (a variance inflation factor above :data:`MAX_VIF`, the largest dropped
    first, the factors recomputed after each drop)."""
    keep: list[str] = []
    why: dict[str, str] = {}
    basis = np.ones((len(C), 1))
    for name in C.columns:
        trial = np.column_stack([basis, C[name].to_numpy(float)])
        if np.linalg.matrix_rank(trial) > basis.shape[1]:
            keep.append(name)
            basis = trial
        else:
            why[name] = "constant or collinear here"
    while len(keep) > 1 and len(C) > len(keep) + 1:
        vif = np.diag(np.linalg.pinv(np.corrcoef(C[keep].to_numpy(float), rowvar=False)))
        j = int(np.argmax(vif))
        if not vif[j] > MAX_VIF:
            break
        why[keep[j]] = f"nearly collinear with the others (VIF {vif[j]:.0f} > {MAX_VIF})"
        keep.pop(j)
    return keep, why


def _numeric(df: pd.DataFrame, col: str, what: str) -> pd.Series:
    if col not in df.columns:
        raise UserError(f"{what} {col!r} is not a column of the metrics table; columns: {', '.join(df.columns)}")
    return pd.to_numeric(df[col], errors="coerce").astype(float)


def _numbers(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with object columns that hold only numbers or None as floats (a store may lack an attribute)."""
    out = df.copy()
    for c in out.columns[out.dtypes == object]:
        v = pd.to_numeric(out[c], errors="coerce")
        if v.notna().sum() == out[c].notna().sum():
            out[c] = v.astype(float)
    return out


def expand_design(df: pd.DataFrame, controls: Sequence[str]) -> list[str]:
    """``controls`` with :data:`~ncanalyze.analyzer.schema.DESIGN` replaced by the design factors
    (``DESIGN_FACTORS``: depth, width, parameters) whose column varies among the rows of ``df`` (none: nothing)."""
    out: list[str] = []
    for c in controls:
        if c.strip() != DESIGN:
            out.append(c)
            continue
        for expr, col in zip(DESIGN_FACTORS, ("n_layers", "hidden_size", "n_params")):
            v = pd.to_numeric(df[col], errors="coerce") if col in df.columns else pd.Series(dtype=float)
            if v[v > 0].nunique() > 1:
                out.append(expr)
    return list(dict.fromkeys(out))


def eval_controls(df: pd.DataFrame, controls: Sequence[str]) -> pd.DataFrame:
    """Evaluate each control expression (over the table's columns and an allow-list of functions, by
    :mod:`ncanalyze.analyzer.expr`; never as code) to a column named by the expression; ``design`` first stands for
    the design factors that vary (:func:`expand_design`)."""
    out = {}
    df = _numbers(df)
    for expr in expand_design(df, controls):
        v = evaluate(expr, df, "control")
        if not isinstance(v, pd.Series):
            raise UserError(f"control {expr!r} uses no column of the metrics table (it is the constant {v!r}); "
                            f"columns: {', '.join(df.columns)}")
        out[expr] = pd.to_numeric(v, errors="coerce").astype(float)
        if out[expr].isna().all() and v.notna().any():  # text (e.g. run): held fixed it would mean nothing
            raise UserError(f"control {expr!r} is not a number (it gives {v.dropna().iloc[0]!r}); --controls take "
                            "numeric expressions, e.g. log(n_params); select one run with --where instead")
    return pd.DataFrame(out, index=df.index).replace([np.inf, -np.inf], np.nan)


def scaled_metrics(df: pd.DataFrame, metrics: Sequence[str]) -> tuple[pd.DataFrame, dict]:
    """Columns (metric, "raw") and (metric, "log") = log10 where the metric is positive on every row (else nan),
    and a note per column saying why it is empty."""
    cols, notes = {}, {}
    for m in metrics:
        x = _numeric(df, m, "metric")
        x = x.where(np.isfinite(x))
        positive = x.notna().any() and bool((x.dropna() > 0).all())
        cols[m, "raw"] = x
        cols[m, "log"] = np.log10(x.where(x > 0)) if positive else x * np.nan
        if x.isna().all():
            notes[m, "raw"] = notes[m, "log"] = [Note(NoteKind.NO_VALUES, "no values (not measurable here)")]
        else:
            notes[m, "raw"], notes[m, "log"] = [], ([] if positive else [
                Note(NoteKind.NOT_POSITIVE, "not positive everywhere: no log scale")])
    return pd.DataFrame(cols, index=df.index), notes


def refuse_correlated_controls(df: pd.DataFrame, C: pd.DataFrame, target: str, metrics: Sequence[str]) -> None:
    """A one-line UserError if a control (``C``, evaluated by :func:`eval_controls`) uses the target or a metric
    under test: a partial correlation cannot hold fixed what it correlates. A control uses a column when blanking
    that column changes the control's values."""
    def users(cols: list[str]) -> list[str]:
        try:
            blank = eval_controls(df.assign(**{c: np.nan for c in cols}), list(C.columns))
        except UserError:  # cannot be evaluated without them
            return list(C.columns)
        return [e for e in C.columns if not C[e].equals(blank[e])]

    forbidden = [c for c in dict.fromkeys([target, *metrics]) if c in df.columns]
    if not len(C.columns) or not forbidden or not users(forbidden):  # the usual case: one evaluation
        return
    for col in forbidden:
        for expr in users([col]):
            if col == target:
                raise UserError(f"control {expr!r} uses the target {col!r}: a partial correlation cannot control "
                                "for the variable it correlates; leave it out of --controls (or pick another --target)")
            raise UserError(f"control {expr!r} uses {col!r}, a metric under test (its partial r would control for "
                            "itself); leave it out of --controls, or leave that metric out of --metrics")


def correlations(df: pd.DataFrame, metrics: Sequence[str] = METRICS, target: str = "eval_loss",
                 controls: Sequence[str] = CONTROLS, n_perm: int = N_PERM, seed: int | None = REPORT.seed, *,
                 runs: str | None = None, step: str = "global_step", n_boot: int = N_BOOT) -> pd.DataFrame:
    """Statistics of each metric against ``target``, one row per (metric, scale in raw|log): the pooled r with its
    permutation p and null centre, the bootstrap intervals over runs, the two questions apart (between models at
    each step, within training; :mod:`ncanalyze.analyzer.questions`) and leave-one-run-out (:func:`leave_one_out`).

    Parameters
    ----------
    df : the metrics table (one row per checkpoint) of one tag; see :func:`correlations_by_tag`.
    metrics, target, controls : column names, and control expressions over the columns.
    n_perm, seed : permutations (all of them when the scheme has no more) and the seed of random ones.
    runs : the column naming each row's run. Given (the report passes ``"run"``) and present, runs with several
        checkpoints are exchangeability blocks, permuted whole (:class:`ncanalyze.analyzer.permute.Scheme`);
        None (default) or absent: every row is an exchangeable unit.
    step : the column that orders a run's rows, to match runs position by position.
    n_boot : resamples of the paired bootstrap over whole runs behind the R² comparisons (0: none); seeded.

    Returns
    -------
    pd.DataFrame
        metric, family (the Holm family, :func:`family`), scale, n, r, r2, rho, p_perm, rho_p, p_param_iid,
        partial_r, partial_p_perm, partial_p_param_iid, partial_ci_low_iid/high_iid (``_iid``: assume
        independent rows), controls (used), perm_scheme ("rows" | "whole runs"), perm_unit ("runs" |
        "checkpoints"), n_units (runs or rows permuted), n_distinct_perms, n_perm (permutations counted), exact
        (all enumerated), p_floor (the smallest p the permutations can give), note (why a statistic is missing,
        or what bounds it) with note_kinds (:class:`NoteKind` values, comma-separated), and p_holm / rho_p_holm /
        partial_p_holm (Holm within the family, per scale); r_null, rho_null, partial_r_null (the permutation
        null's mean); {r,r2,rho,partial_r}_ci_low/high (95% intervals over runs,
        ``ci_method``: Fisher's z where each run is one row, the jackknife over runs otherwise; ``ci_units``
        the runs they rest on; R²'s from r's); within_r, within_p, within_r_null, within_ci_low/high,
        within_n_runs, within_why (within training beyond what all runs share at a step: the two-way
        fixed-effects r, its whole-run permutation p and null centre, its interval over runs; why it is
        missing); between_steps, between_r_min/max, between_step_last, between_r_last, between_p_last (r across
        runs per step); loo_r_min/max, loo_p_min/max, robust, loo_flips (leave one run out); vs_metric, d_r2,
        d_r2_ci_low/high, d_r2_p_le0, d_r2_mc_error, d_r2_dropped, d_r2_n_boot (the paired bootstrap of
        R² minus the compared metric's, :data:`~ncanalyze.analyzer.schema.COMPARISONS`). Rows
        with a missing or infinite target, or a missing metric or control, are left out of that metric's
        statistics (an infinite target is said in the notes).
    """
    try:
        enough_resamples(n_boot)
    except ValueError as e:
        raise UserError(f"n_boot (--bootstrap) {e}, got {n_boot}") from None
    lacking, C_all = _lacking_controls(df, metrics, target, controls)
    if lacking.any():  # a checkpoint without a step: in r, not in partial r
        return _partial_apart(df, lacking, C_all, metrics, target, controls, n_perm, seed, runs, step, n_boot)
    y, X, C, notes, labels, order, unused = _prepare(df, metrics, target, controls, runs, step)
    groups = _column_groups(X)
    rows, extra = [], []
    for keys, mask in groups:
        scheme = (Scheme.rows(int(mask.sum())) if labels is None else
                  Scheme.whole_blocks(labels[mask], None if order is None else order[mask]))
        rows += _group_stats(y[mask], X.loc[mask, keys], C[mask], notes, unused, n_perm, seed, scheme)
        if mask.sum() >= MIN_N:
            ctrl = independent_controls(C[mask])
            extra.append(claims(y[mask], X.loc[mask, keys], C.loc[mask, ctrl], None if labels is None else
                                labels[mask], None if order is None else order[mask], n_perm, seed))
    out = pd.DataFrame(rows)
    out.insert(1, "family", out.metric.map(family))
    for i in out.index[out.metric.isin(list(SCALE_DEPENDENT))]:  # said wherever the row is printed
        _add_notes(out, i, [Note(NoteKind.SCALE_DEPENDENT, SCALE_DEPENDENT[out.metric[i]])])
    _note_left_out(out, X, df)
    rank = {m: i for i, m in enumerate(metrics)}
    out = out.sort_values(["metric", "scale"], key=lambda s: s.map(rank) if s.name == "metric" else s != "raw")
    out = out.reset_index(drop=True)
    out["p_holm"], out["rho_p_holm"], out["partial_p_holm"] = (holm(out, c) for c in ("p_perm", "rho_p",
                                                                                      "partial_p_perm"))
    out = _with_claims(out, extra)
    out = leave_one_out(out, y, X, C, labels, order, groups, n_perm, seed)
    out = compare_r2(out, y, X, labels, n_boot, seed)
    out.attrs.update(target=target, controls=list(C.columns), n_perm=int(n_perm), seed=seed, runs=runs,
                     n_boot=int(n_boot))
    return out


def _lacking_controls(df: pd.DataFrame, metrics: Sequence[str], target: str,
                      controls: Sequence[str]) -> tuple[pd.Series, pd.DataFrame]:
    """The rows with a finite target but no value for some control (a checkpoint without a finite, non-negative
    global_step), and the controls' values (those with any value)."""
    y = _target(df, target, metrics)
    y = y.where(np.isfinite(y))
    C = eval_controls(df.loc[y.notna()], controls).reindex(df.index)
    C = C.where(np.isfinite(C))
    C = C.drop(columns=[c for c in C.columns if C.loc[y.notna(), c].isna().all()])
    return y.notna() & C.isna().any(axis=1), C


def _prepare(df: pd.DataFrame, metrics: Sequence[str], target: str, controls: Sequence[str], runs: str | None,
             step: str) -> tuple:
    """The target, metric columns (raw and log), controls, notes, run labels and steps of the usable rows, and the
    notes said of every column."""
    y = _target(df, target, metrics)
    infinite = int(np.isinf(y).sum())
    y = y.where(np.isfinite(y))  # an infinite loss (a diverged run) would make every r nan: such rows are left out
    C = eval_controls(df.loc[y.notna()], controls).reindex(df.index)
    refuse_correlated_controls(df, eval_controls(df, list(C.columns)), target, metrics)
    C = C.where(np.isfinite(C))  # log1p of an infinite or negative step: no value
    empty = [c for c in C.columns if C.loc[y.notna(), c].isna().all()]  # e.g. a step no checkpoint recorded
    C = C.drop(columns=empty)
    ok = y.notna() & C.notna().all(axis=1)
    y, C = y[ok], C[ok]
    X, notes = scaled_metrics(df[ok], metrics)
    labels = df.loc[ok, runs] if runs is not None and runs in df.columns else None
    order = df.loc[ok, step] if step in df.columns else None
    unused = [Note(NoteKind.CONTROLS, f"control {c} has no values: not used") for c in empty]
    if infinite:
        unused.append(Note(NoteKind.LEFT_OUT, f"{infinite} checkpoint(s) with an infinite {target} left out"))
    return y, X, C, notes, labels, order, unused


def _column_groups(X: pd.DataFrame) -> list[tuple[list, pd.Series]]:
    """Columns with the same rows present, with those rows: each group shares one permutation run, all of its
    columns in one matrix product."""
    groups: dict[bytes, list] = {}
    for key in X.columns:
        groups.setdefault(X[key].notna().to_numpy().tobytes(), []).append(key)
    return [(keys, X[keys[0]].notna()) for keys in groups.values()]


def _with_claims(out: pd.DataFrame, extra: list[tuple[pd.DataFrame, pd.DataFrame]]) -> pd.DataFrame:
    """The statistics with the claims' columns (:func:`ncanalyze.analyzer.questions.claims`) joined by (metric,
    scale), a note where an interval has no estimand, and one where the tested questions disagree in sign."""
    if not extra:  # too few rows for any statistic: the columns, empty
        return out.assign(**{c: np.nan for c in CLAIM_COLUMNS}).assign(between_steps=0, within_n_runs=0,
                                                                         within_why="", claims_why="")
    cl = pd.concat([e for e, _ in extra])
    steps = pd.concat([s for _, s in extra if len(s)] or [pd.DataFrame(columns=STEP_COLUMNS)])
    keys = pd.MultiIndex.from_frame(out[["metric", "scale"]])
    joined = cl.reindex(keys).reset_index(drop=True)
    joined[["between_steps", "within_n_runs"]] = joined[["between_steps", "within_n_runs"]].fillna(0).astype(int)
    joined[["within_why", "claims_why"]] = joined[["within_why", "claims_why"]].fillna("")
    out = pd.concat([out, joined], axis=1)
    for i, row in out.iterrows():
        mine = steps[(steps.metric == row.metric) & (steps.scale == row.scale)]
        extra_notes = [Note(NoteKind.UNDEFINED, row.claims_why)] if row.claims_why and np.isfinite(row.r) else []
        extra_notes += [Note(NoteKind.SIGN_FLIP, t) for t in sign_notes(row.r, mine, row.within_r, row.within_p,
                                                                        ALPHA)]
        if extra_notes:
            _add_notes(out, i, extra_notes)
    return out


def _note_left_out(out: pd.DataFrame, X: pd.DataFrame, df: pd.DataFrame) -> None:
    """A ``left_out`` note on each row whose metric has no finite value on some usable checkpoints (a metric nan
    for one run), naming the first of them."""
    for i in out.index:
        lost = X[out.metric[i], "raw"].isna()
        if 0 < lost.sum() < len(lost):
            rows = df.loc[lost.index[lost]]
            named = (rows["run"].astype(str) + "/" + rows["checkpoint"].astype(str) if {"run", "checkpoint"} <=
                     set(df.columns) else rows.index.astype(str)).tolist()
            more = f" and {len(named) - 5} more" if len(named) > 5 else ""
            _add_notes(out, i, [Note(NoteKind.LEFT_OUT, f"{len(named)} checkpoint(s) without a finite "
                                     f"{out.metric[i]} left out: {', '.join(named[:5])}{more}")])


def _add_notes(out: pd.DataFrame, i: int, extra: list[Note]) -> None:
    """Append notes to row i's ``note`` and ``note_kinds``."""
    text = "; ".join(n.text for n in extra)
    old = out.at[i, "note"]
    out.at[i, "note"] = text if not isinstance(old, str) or not old else f"{old}; {text}"
    kinds = [k for k in str(out.at[i, "note_kinds"] or "").split(",") if k] + [n.kind.value for n in extra]
    out.at[i, "note_kinds"] = ",".join(dict.fromkeys(kinds))


def by_step(df: pd.DataFrame, metrics: Sequence[str] = METRICS, target: str = "eval_loss",
            n_perm: int = N_PERM, seed: int | None = REPORT.seed, *, runs: str = "run", step: str = "global_step",
            tag: str = "tag") -> pd.DataFrame:
    """Between models, step by step: per tag, :func:`ncanalyze.analyzer.questions.per_step` of each metric (raw and
    log) over the rows :func:`correlations` uses (by_step.csv; the report's per-step figure)."""
    from ncanalyze.analyzer.questions import per_step
    parts = []
    for t, rows in split_tags(df, tag):
        if runs not in rows.columns or step not in rows.columns:
            continue
        y, X, _, _, labels, order, _ = _prepare(rows, metrics, target, (), runs, step)
        for keys, mask in _column_groups(X):
            parts.append(per_step(y[mask], X.loc[mask, keys], labels[mask], order[mask], n_perm, seed).assign(tag=t))
    out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=[*STEP_COLUMNS, "tag"])
    return out[["tag", *STEP_COLUMNS]]


def leave_one_out(out: pd.DataFrame, y: pd.Series, X: pd.DataFrame, C: pd.DataFrame, labels: pd.Series | None,
                  order: pd.Series | None, groups: list, n_perm: int, seed: int | None) -> pd.DataFrame:
    """One run's influence: with each run left out in turn, the range of r (``loo_r_min``, ``loo_r_max``) and of its
    permutation p (``loo_p_min``, ``loo_p_max``); a run moves a claim where r without it lies more than half its
    interval's width from r (the partial r likewise, against its own interval). ``robust``: no run does (nan
    without an interval); ``loo_flips`` names those runs ('run (r)', 'run (partial r)'), also said in a note. The
    data decide it, not the design: no Holm verdict crossing 0.05 by a few permutations counts. Without runs: nan."""
    out = out.assign(loo_r_min=np.nan, loo_r_max=np.nan, loo_p_min=np.nan, loo_p_max=np.nan, robust=np.nan,
                     loo_flips="")
    names = None if labels is None else pd.unique(labels.dropna())
    if names is None or len(names) <= MIN_N:
        return out
    pos = {k: i for i, k in enumerate(zip(out.metric, out.scale))}
    lab, yv, Cv = labels.to_numpy(), y.to_numpy(float), C.to_numpy(float)
    step = None if order is None else order.to_numpy()
    cols = [([pos[k] for k in keys], X[keys].to_numpy(float), mask.to_numpy()) for keys, mask in groups]
    loo = {k: np.full((len(names), len(out)), np.nan) for k in ("r", "p_perm", "partial_r")}
    for d, name in enumerate(names):
        for at, Xg, mask in cols:
            m = mask & (lab != name)
            if m.sum() < MIN_N:
                continue
            res = perm_test(yv[m], Xg[m], Cv[m][:, _independent(Cv[m])], n_perm, seed,
                            Scheme.whole_blocks(lab[m], None if step is None else step[m]), rho=False)
            for k in loo:
                loo[k][d, at] = res[k]
    flips: list[list[str]] = [[] for _ in range(len(out))]
    judged = np.zeros(len(out), bool)
    for what, col in (("r", "r"), ("partial r", "partial_r")):
        half = (out[f"{col}_ci_high"] - out[f"{col}_ci_low"]).to_numpy(float) / 2
        with np.errstate(invalid="ignore"):
            moved = np.abs(loo[col] - out[col].to_numpy(float)) > half
        judged |= np.isfinite(half)
        for d, i in zip(*np.nonzero(moved)):
            flips[i].append(f"{names[d]} ({what})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a metric without r in every drop
        out["loo_r_min"], out["loo_r_max"] = np.nanmin(loo["r"], 0), np.nanmax(loo["r"], 0)
        out["loo_p_min"], out["loo_p_max"] = np.nanmin(loo["p_perm"], 0), np.nanmax(loo["p_perm"], 0)
    out["robust"] = np.where(judged, [not f for f in flips], np.nan)
    out["loo_flips"] = [", ".join(f) for f in flips]
    for i in out.index[out.loo_flips != ""]:
        _add_notes(out, i, [Note(NoteKind.FRAGILE, "one run moves r by more than half its interval: "
                                 + out.at[i, "loo_flips"])])
    return out


def _independent(C: np.ndarray) -> list[int]:
    """:func:`independent_controls` of a numpy array: the column indices kept."""
    return [list(map(str, range(C.shape[1]))).index(c) for c in
            independent_controls(pd.DataFrame(C, columns=list(map(str, range(C.shape[1])))))]


def compare_r2(out: pd.DataFrame, y: pd.Series, X: pd.DataFrame, labels: pd.Series | None, n_boot: int,
               seed: int | None) -> pd.DataFrame:
    """The paper's "A relates to the target more than B" (:data:`~ncanalyze.analyzer.schema.COMPARISONS`), per
    scale where both were measured: on the rows where both are, R²(A) - R²(B) with the percentile interval and the
    share of resamples <= 0 of a paired bootstrap over whole runs (the same resamples for both:
    :func:`~ncanalyze.analyzer.resample.paired_bootstrap`), on A's row (``vs_metric`` names B)."""
    cols = ("d_r2", "d_r2_ci_low", "d_r2_ci_high", "d_r2_p_le0", "d_r2_mc_error", "d_r2_dropped", "d_r2_n_boot")
    out = out.assign(vs_metric="", **{c: np.nan for c in cols})
    if n_boot <= 0:
        return out
    for a, b in COMPARISONS:
        for scale in ("raw", "log"):
            if (a, scale) not in X.columns or (b, scale) not in X.columns:
                continue
            ok = (X[a, scale].notna() & X[b, scale].notna()).to_numpy()
            codes = run_codes(None if labels is None else labels.to_numpy()[ok], int(ok.sum()))
            i = out.index[(out.metric == a) & (out.scale == scale)]
            if codes.max(initial=-1) + 1 <= MIN_N or not len(i):
                continue
            res = paired_bootstrap(y.to_numpy(float)[ok], X[a, scale].to_numpy(float)[ok],
                                   X[b, scale].to_numpy(float)[ok], codes, n_boot, seed)
            if not np.isfinite(res["d_r2"]):  # a metric or the target constant: no R² to compare
                continue
            out.loc[i[0], "vs_metric"] = b
            out.loc[i[0], list(cols)] = [res[c] for c in cols]
            if res["d_r2_dropped"]:
                _add_notes(out, i[0], [Note(NoteKind.LEFT_OUT, f"R² against {b}: {res['d_r2_dropped']} of {n_boot} "
                                        "resamples of runs left out (a metric without spread in them)")])
    return out


def _partial_apart(df: pd.DataFrame, lacking: pd.Series, C: pd.DataFrame, metrics: Sequence[str], target: str,
                   controls: Sequence[str], n_perm: int, seed: int | None, runs: str | None, step: str,
                   n_boot: int) -> pd.DataFrame:
    """:func:`correlations` where some rows lack a control's value (a checkpoint without a finite, non-negative
    global_step: a plain model folder, a Hub revision): r, rho and their p-values over every row, the partial r
    over the rows with every control, with a ``left_out`` note naming the rows it leaves out."""
    plain = correlations(df, metrics, target, (), n_perm, seed, runs=runs, step=step, n_boot=n_boot)
    partial = correlations(df[~lacking], metrics, target, controls, n_perm, seed, runs=runs, step=step,
                           n_boot=n_boot)
    named = (df.loc[lacking, "run"].astype(str) + "/" + df.loc[lacking, "checkpoint"].astype(str)
             if {"run", "checkpoint"} <= set(df.columns) else df.index[lacking].astype(str))
    missing = [c for c in C.columns if C.loc[lacking, c].isna().any()]
    left = Note(NoteKind.LEFT_OUT, f"partial r leaves out {int(lacking.sum())} checkpoint(s) where "
                f"{', '.join(missing)} has no value (no global_step recorded, or a non-finite or negative one): {', '.join(named[:5])}"
                + (f" and {len(named) - 5} more" if len(named) > 5 else ""))
    own = [c for c in partial.columns if c.startswith("partial_")] + ["controls"]
    out = plain.drop(columns=own).merge(partial[["metric", "scale", "note", "note_kinds", *own]],
                                        on=["metric", "scale"], how="left", suffixes=("", "_partial"))
    for i, row in out.iterrows():
        extra = [t for t in str(row.pop("note_partial") or "").split("; ") if "partial" in t] + [left.text]
        kinds = [k for k in str(row.pop("note_kinds_partial") or "").split(",") if k in ("controls", "too_few")
                 and len(extra) > 1] + [NoteKind.LEFT_OUT.value]
        out.loc[i, "note"] = "; ".join([t for t in [str(row.note or "")] if t] + extra)
        out.loc[i, "note_kinds"] = ",".join(dict.fromkeys([k for k in str(row.note_kinds or "").split(",") if k]
                                                          + kinds))
    out = out.drop(columns=["note_partial", "note_kinds_partial"])[list(partial.columns)]
    out["partial_p_holm"] = holm(out, "partial_p_perm")
    out.attrs.update(plain.attrs | {"controls": list(controls)})
    return out


def holm_families(stats: pd.DataFrame) -> list[str]:
    """The columns whose values split ``stats`` into Holm families: tag (where present), family and scale."""
    return [c for c in ("tag", "family", "scale") if c in stats.columns]


def holm(stats: pd.DataFrame, column: str) -> pd.Series:
    """Holm-adjusted ``column`` across the metrics of a family (:func:`family`), per scale (raw and log
    separately) and per tag (where the table has a ``tag`` column), over the finite p-values only
    (``pingouin.multicomp``, equal to statsmodels' ``multipletests``, which runs a full garbage collection per
    call); nan elsewhere."""
    import pingouin as pg

    out = pd.Series(np.nan, index=stats.index)
    for _, rows in stats.groupby(holm_families(stats), dropna=False, sort=False):
        p = rows[column].astype(float)
        p = p[np.isfinite(p)]
        if len(p):
            out[p.index] = pg.multicomp(p.to_numpy(), method="holm")[1]
    return out


def _group_stats(y: pd.Series, X: pd.DataFrame, C: pd.DataFrame, notes: dict, unused: list[Note], n_perm: int,
                 seed: int | None, scheme: Scheme) -> list[dict]:
    """Statistics of the columns of X, which all have the same rows, against y given controls C, permuting under
    ``scheme``; ``notes`` say why a column has none, ``unused`` is said of every column."""
    n = len(y)
    ctrl, dropped = control_choice(C) if n else ([], {})
    res = perm_test(y.to_numpy(), X.to_numpy(), C[ctrl].to_numpy(), n_perm, seed, scheme) if n >= MIN_N else None
    n_distinct = scheme.n_distinct
    few = ([Note(NoteKind.FEW_PERMUTATIONS, f"only {n_distinct} distinct permutations of {scheme.name} "
                 f"({scheme.n_units} {_unit_name(scheme)}): no equal-tailed p below 2/{n_distinct} = "
                 f"{2 / n_distinct:.3g}")]
           if res and n_perm > 0 and n_distinct <= 2 / ALPHA else [])
    rows = []
    for j, (metric, scale) in enumerate(X.columns):
        row = dict(metric=metric, scale=scale, n=n, r=np.nan, r2=np.nan, rho=np.nan, p_perm=np.nan, rho_p=np.nan,
                   p_param_iid=np.nan, partial_r=np.nan, partial_p_perm=np.nan, partial_p_param_iid=np.nan,
                   partial_ci_low_iid=np.nan, partial_ci_high_iid=np.nan, r_null=np.nan, rho_null=np.nan,
                   partial_r_null=np.nan, controls=", ".join(ctrl),
                   perm_scheme=scheme.name, perm_unit=_unit_name(scheme), n_units=scheme.n_units,
                   n_distinct_perms=_as_float(n_distinct), n_perm=0, exact=False, p_floor=np.nan)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            note = notes[metric, scale] or _fill(row, X[metric, scale], y, C[ctrl], res, j, dropped) + few + unused
        for w in caught:  # none is expected (every undefined case is a note): one that comes names its metric
            warnings.warn(f"{metric} ({scale} scale) against {y.name}: {w.category.__name__}: {w.message}",
                          StatisticsWarning, stacklevel=2)
        rows.append(row | note_columns(note))
    return rows


def _unit_name(scheme: Scheme) -> str:
    return "checkpoints" if scheme.name == ROWS else "runs"


def _as_float(count: int) -> float:
    """A count as a float for a CSV column (inf beyond float range: n! of a few hundred rows)."""
    return float(count) if count < 1e308 else np.inf


def _fill(row: dict, x: pd.Series, y: pd.Series, C: pd.DataFrame, res: dict | None, j: int,
          dropped: dict[str, str]) -> list[str]:
    """Put column j's r, R², rho, p-values and partial r (pingouin) into ``row``; return notes on what is
    missing."""
    import pingouin as pg  # seconds to import: not at the CLI's start
    from scipy.stats import pearsonr
    n, k = len(x), C.shape[1]
    if n < MIN_N:
        return [Note(NoteKind.TOO_FEW, f"n={n} < {MIN_N} checkpoints: too few for a correlation")]
    if x.nunique() < 2 or y.nunique() < 2:
        return [Note(NoteKind.CONSTANT, ("metric" if x.nunique() < 2 else "target") + " constant over the selected checkpoints")]
    r = float(res["r"][j])
    if not np.isfinite(r):
        what = "target" if y.std() <= 1e-9 * y.abs().max() else "metric"
        return [Note(NoteKind.CONSTANT, f"{what} constant over the selected checkpoints, up to rounding")]
    row.update(r=r, r2=r * r, rho=float(res["rho"][j]), p_perm=res["p_perm"][j], rho_p=res["rho_p"][j],
               r_null=res["r_null"][j], rho_null=res["rho_null"][j],
               n_perm=res["n_perm"], exact=res["exact"], p_param_iid=float(pearsonr(x, y).pvalue),
               p_floor=p_floor(res["n_distinct"], res["n_perm"], res["exact"]) if res["n_perm"] else np.nan)
    note = [Note(NoteKind.CONTROLS, "partial r ignores " + ", ".join(f"{c} ({why})" for c, why in dropped.items()))] \
        if dropped else []
    if n < k + MIN_N:
        return note + [Note(NoteKind.TOO_FEW, f"n={n} too few for a partial r with {k} control(s) (needs >= {k + MIN_N})")]
    if not np.isfinite(res["partial_r"][j]):
        return note + [Note(NoteKind.CONTROLS, "metric or target is determined by the controls: no partial r")]
    data = pd.concat({"x": x, "y": y, **{f"c{i}": C[c] for i, c in enumerate(C.columns)}}, axis=1)
    distinct = len(data.drop_duplicates())
    if distinct < k + MIN_N:  # a checkpoint repeated (a copy as another run): its residuals are ±1 by construction
        return note + [Note(NoteKind.TOO_FEW, f"only {distinct} distinct rows (a checkpoint repeated): too few for a "
                                              f"partial r with {k} control(s) (needs >= {k + MIN_N})")]
    if np.linalg.matrix_rank(((data - data.mean()) / data.std()).cov()) < k + 2:  # as pingouin tests it
        note.append(Note(NoteKind.CONTROLS, "metric and target exactly linearly related given the controls: |partial r| = 1"))
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The covariance matrix is rank-deficient")  # the note above says it
        part = pg.partial_corr(data, x="x", y="y", covar=[f"c{i}" for i in range(k)] or None)
    lo, hi = part["CI95"].iloc[0]
    if n - k <= 3:  # Fisher's z has standard error 1/sqrt(n - k - 3): no CI (pingouin would divide by zero)
        lo = hi = np.nan
        note.append(Note(NoteKind.TOO_FEW, f"n={n} too few for the partial r's 95% CI with {k} control(s) (needs >= {k + 4})"))
    row.update(partial_r=float(part["r"].iloc[0]), partial_p_perm=res["partial_p_perm"][j],
               partial_r_null=res["partial_r_null"][j],
               partial_p_param_iid=float(part["p_val"].iloc[0]), partial_ci_low_iid=lo, partial_ci_high_iid=hi)
    return note


def p_floor(n_distinct: float, n_perm: int, exact: bool) -> float:
    """The smallest equal-tailed permutation p a scheme can give (twice the smallest tail, the identity always in
    it): 2/N when all N distinct permutations are enumerated, else 2/(1 + B) for B drawn (Phipson & Smyth)."""
    return min(1.0, 2 / n_distinct if exact else 2 / (1 + n_perm))


def unreachable(stats: pd.DataFrame, column: str = "p_perm", alpha: float = ALPHA) -> pd.DataFrame:
    """The Holm families (tag, family, scale) of ``stats`` in which no adjusted ``column`` can fall below
    ``alpha`` whatever the data: Holm multiplies the smallest of m p-values by m, and no p falls below the
    scheme's floor, so none survives where m x floor >= alpha. A family's floor, permutations and units are those
    of its row with the largest floor (one source: a metric missing at one checkpoint has fewer rows and may have
    fewer permutations than the rest).

    Returns
    -------
    pd.DataFrame
        One row per such family: its keys, m (metrics with a p), p_floor, n_distinct_perms, n_perm, exact,
        perm_unit, n_units.
    """
    tested = stats[np.isfinite(stats[column].astype(float)) & (stats.n_perm > 0)]
    keys = holm_families(tested)
    cols = ["p_floor", "n_distinct_perms", "n_perm", "exact", "perm_unit", "n_units"]
    if tested.empty:
        return pd.DataFrame(columns=[*keys, "m", *cols])
    top = tested.sort_values("p_floor", ascending=False, kind="stable").groupby(keys, dropna=False, sort=False)
    g = top[cols].first().join(top[column].size().rename("m")).reset_index()
    return g[g.m * g.p_floor >= alpha][[*keys, "m", *cols]].reset_index(drop=True)


# ---------------------------------------------------------------- what is pooled: tags, runs

def split_tags(df: pd.DataFrame, column: str = "tag") -> list[tuple[str | None, pd.DataFrame]]:
    """The rows of each tag (dataset) apart, in order of first appearance; untagged rows (NaN, None or '') are
    one group, with tag None. A table without the column is one untagged group."""
    if column not in df.columns:
        return [(None, df)]
    untagged = df[column].isna() | (df[column].astype(str).str.strip() == "")
    tags = dict.fromkeys(None if u else t for t, u in zip(df[column], untagged))
    return [(t, df[untagged if t is None else ~untagged & (df[column] == t)]) for t in tags]


def correlations_by_tag(df: pd.DataFrame, metrics: Sequence[str] = METRICS, target: str = "eval_loss",
                        controls: Sequence[str] = CONTROLS, n_perm: int = N_PERM, seed: int | None = REPORT.seed, *,
                        runs: str | None = "run", step: str = "global_step", tag: str = "tag",
                        n_boot: int = N_BOOT) -> pd.DataFrame:
    """:func:`correlations` of each tag's rows apart (:func:`split_tags`; never pooled), concatenated with a
    ``tag`` column first (None: untagged). Holm's families are per tag and scale. Runs are exchangeability blocks
    by default (``runs="run"``, where the table has that column), as the report wants them.

    Returns
    -------
    pd.DataFrame
        tag, then :func:`correlations`' columns; a tag's bad input is a UserError naming the tag.
    """
    parts = []
    groups = split_tags(df, tag)
    for t, rows in groups:
        name = f"tag {'(untagged)' if t is None else repr(t)}"
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", StatisticsWarning)
                stats = correlations(rows, metrics, target, controls, n_perm, seed, runs=runs, step=step,
                                     n_boot=n_boot)
        except UserError as e:
            if len(groups) == 1:
                raise
            raise UserError(f"{name}: {e}") from None
        for w in caught:
            text = f"{name}: {w.message}" if len(groups) > 1 and w.category is StatisticsWarning else w.message
            warnings.warn_explicit(text, w.category, w.filename, w.lineno)
        parts.append(stats.assign(tag=t))
    out = pd.concat(parts, ignore_index=True)
    out = out[["tag", *(c for c in out.columns if c != "tag")]]
    out.attrs.update(parts[0].attrs)
    return out


def last_per_run(df: pd.DataFrame, runs: str = "run", step: str = "global_step") -> pd.DataFrame:
    """``--per-run last``: the rows of each run's latest checkpoint (the highest ``step``), per tag where the table
    has a ``tag`` column; a checkpoint's layers stay together. Rows without a step are left out of a run that has
    steps; a run without any is a UserError."""
    for col in (runs, step):
        if col not in df.columns:
            raise UserError(f"--per-run last needs the column {col!r}, which the metrics table lacks; "
                            f"columns: {', '.join(map(str, df.columns))}")
    s = pd.to_numeric(df[step], errors="coerce")
    keys = [df[runs].astype(str)] + ([df["tag"].fillna("").astype(str)] if "tag" in df.columns else [])
    top = s.groupby(keys, dropna=False).transform("max")
    if top.isna().any():
        raise UserError(f"--per-run last: run {df.loc[top.isna(), runs].iloc[0]!r} has no {step} (no "
                        "trainer_state.json); leave it out with --where, or drop --per-run")
    return df[s == top]


def permutation_text(stats: pd.DataFrame, seed: int | None = None) -> str:
    """report.md's sentence on the permutations behind the p-values: the unit permuted, how many distinct
    permutations exist, whether all were enumerated, and when none can fall below ALPHA (per tag)."""
    seed = stats.attrs.get("seed") if seed is None else seed
    cols = [c for c in ("tag", "perm_scheme", "n_units", "n_distinct_perms", "n_perm", "exact") if c in stats]
    used = stats.loc[stats.n_perm > 0, cols].drop_duplicates()
    if used.empty:
        return "No permutation p-values (no permutations asked for, or too few checkpoints)."
    parts = []
    for _, u in used.iterrows():
        n, many = u.n_distinct_perms, _count_text(u.n_distinct_perms)
        text = (f"{'' if 'tag' not in u or pd.isna(u.tag) else f'tag {u.tag}: '}"
                + (f"whole runs ({u.n_units} runs; a run's target values, and for the partial r its residuals on the "
                   "controls, move as one block onto another run with as many checkpoints, position by position "
                   f"in step order), {many} distinct permutations" if u.perm_scheme != ROWS else
                   f"rows ({u.n_units} checkpoints, each its own unit), {many} distinct permutations")
                + (", all enumerated (exact p)" if u.exact else f", {int(u.n_perm)} drawn at random (seed {seed})"))
        if n <= 2 / ALPHA:
            text += f"; no equal-tailed p can fall below 2/{int(n)} = {2 / n:.3g}, so none reaches {ALPHA:g}"
        parts.append(text)
    return ("Permutations (rows of one run are not independent, so runs with several checkpoints are permuted "
            "whole, as exchangeability blocks; Winkler et al. 2014): " + "; ".join(parts) + ".")


def _count_text(n: float) -> str:
    return f"{int(n)}" if n < 1e6 else ("more than 10^308" if np.isinf(n) else f"about 10^{np.log10(n):.0f}")


def control_table(df: pd.DataFrame, metrics: Sequence[str], target: str, scale_controls: dict[str, pd.DataFrame],
                  progress: pd.DataFrame) -> pd.DataFrame:
    """The partial r of each metric (raw and log10 where positive) with ``target`` under each scale control of
    ``scale_controls`` (name: numeric columns, or dummies for fixed effects), each beside the training-progress
    control ``progress`` (empty: none), and r with no control at all. One row per (metric, scale)."""
    y = pd.to_numeric(df[target], errors="coerce").astype(float)
    X, _ = scaled_metrics(df, metrics)
    rows = []
    for metric, scale in X.columns:
        x = X[metric, scale]
        ok = x.notna() & np.isfinite(y) & progress.notna().all(axis=1)
        if ok.sum() < MIN_N or not x[ok].notna().any():
            continue
        row = {"metric": metric, "scale": scale, "n": int(ok.sum()), "none": float(np.corrcoef(x[ok], y[ok])[0, 1])}
        for name, Z in scale_controls.items():
            row[name] = np.nan if Z is None else residual_r(x[ok].to_numpy(), y[ok].to_numpy(), np.column_stack(
                [Z[ok].to_numpy(float), progress[ok].to_numpy(float)]))
        rows.append(row)
    return pd.DataFrame(rows)
