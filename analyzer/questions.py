"""The two questions a study of several runs with several checkpoints asks, kept apart, and the claims' intervals.

- *Between models*: at one training step, do the runs with the higher metric have the higher loss? The r across
  runs at each step that at least :data:`MIN_RUNS` runs share (:func:`per_step`), with its permutation p over runs
  (rows at one step are one per run: independent units).
- *Within training, beyond what all runs share*: as one run trains, does its loss move with its metric more than
  every run's does at that step? The two-way fixed-effects r (:func:`within_fe`): metric and target residualised
  on run and step (each run's offset and the trend every run shares removed), tested by permuting whole runs
  (equal-tailed, with the null's centre) and given an interval over runs. The mean of each run's own r over its
  checkpoints, which an earlier version reported, measures the clock all runs share: a metric equal to
  1/global_step scored +1.00 there; here it has no r (the step's effect absorbs it). A mixed model with a random
  run intercept would answer a blend of both questions (its slope pools the between- and within-run variation
  unless the run means are added); the fixed-effects r answers this one alone, and exactly, so it is primary.
- The pooled r (every checkpoint of every run at once, stats.py's ``r``) mixes the two; where their signs disagree,
  each side tested (p < 0.05), :func:`sign_notes` says so ("the sign flips between step 120 and 240").

:func:`claims` adds to each (metric, scale) the intervals of r, R², rho and the partial r (Fisher's z where each
run is one row, the jackknife over runs where runs have several rows: :mod:`ncanalyze.analyzer.resample`), the two
questions and their notes. :func:`ncanalyze.analyzer.stats.control_table` gives the partial r under each choice of
scale control (none, log parameters, the varying design factors, architecture fixed effects).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncanalyze.analyzer.permute import MIN_N, Scheme, perm_test
from ncanalyze.analyzer.resample import (FISHER, JACKKNIFE, fisher_interval, jackknife_interval, loo_weights,
                                         r2_interval, run_codes, weighted_partial, weighted_rho)

MIN_RUNS = 4  # fewest runs at a step for a between-model r
MIN_UNITS = 4  # fewest distinct runs (rows, where each run is one) for an interval
STEP_COLUMNS = ("metric", "scale", "step", "n_runs", "r", "r2", "rho", "p_perm", "rho_p", "r_null")
CLAIM_COLUMNS = ("ci_method", "ci_unit", "ci_units", "r_ci_low", "r_ci_high", "r2_ci_low", "r2_ci_high", "rho_ci_low",
                 "rho_ci_high", "partial_r_ci_low", "partial_r_ci_high", "within_r", "within_p", "within_r_null",
                 "within_ci_low", "within_ci_high", "within_n_runs", "within_why", "claims_why", "between_steps",
                 "between_r_min", "between_r_max", "between_step_last", "between_r_last",
                 "between_p_last")  # the columns :func:`claims` adds, in order


def per_step(y: pd.Series, X: pd.DataFrame, labels: pd.Series | None, steps: pd.Series | None, n_perm: int,
             seed: int | None) -> pd.DataFrame:
    """Between models: at each step that at least :data:`MIN_RUNS` runs share, the r, R², rho of y with each column
    of X across the runs (all rows finite), with permutation p-values over the runs (equal-tailed) and the null's
    centre; no r where the metric is the same in every run there (up to rounding). Columns :data:`STEP_COLUMNS`;
    empty without runs or steps."""
    if labels is None or steps is None:
        return pd.DataFrame(columns=STEP_COLUMNS)
    s = pd.to_numeric(steps, errors="coerce")
    rows = []
    for step, idx in s.groupby(s, sort=True).groups.items():
        at = labels.loc[idx]
        if at.nunique() < MIN_RUNS or at.duplicated().any():
            continue
        res = perm_test(y.loc[idx].to_numpy(), X.loc[idx].to_numpy(), None, n_perm, seed, Scheme.rows(len(idx)))
        for j, (metric, scale) in enumerate(X.columns):
            rows.append(dict(metric=metric, scale=scale, step=step, n_runs=len(idx), r=res["r"][j],
                             r2=res["r"][j] ** 2, rho=res["rho"][j], p_perm=res["p_perm"][j], rho_p=res["rho_p"][j],
                             r_null=res["r_null"][j]))
    return pd.DataFrame(rows, columns=STEP_COLUMNS)


def fixed_effects(codes: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """The two-way fixed effects' design: one dummy per run and per step, each less its first level (n x (R-1 +
    S-1)); with the intercept it spans every run's offset and every step's shared value."""
    _, step_codes = np.unique(steps, return_inverse=True)
    runs = (codes[:, None] == np.arange(1, codes.max(initial=0) + 1)).astype(float)
    at = (step_codes[:, None] == np.arange(1, step_codes.max(initial=0) + 1)).astype(float)
    return np.column_stack([runs, at])


def _demean(a: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Each run's rows less the run's mean (column by column)."""
    k = codes.max(initial=-1) + 1
    size = np.bincount(codes, minlength=k)
    sums = np.stack([np.bincount(codes, a[:, j], k) for j in range(a.shape[1])], 1)
    return a - (sums / size[:, None])[codes]


def within_fe(y: np.ndarray, X: np.ndarray, codes: np.ndarray, steps: np.ndarray, n_perm: int,
              seed: int | None) -> dict:
    """Within training, beyond what all runs share at a step: the two-way fixed-effects r of y with each column of X
    (both residualised on run and step dummies), its equal-tailed p from permuting whole runs (Freedman-Lane on the
    fixed effects' residuals; runs exchanged with runs of as many checkpoints, step by step) and the null's centre,
    and its jackknife interval over runs (the fixed-effects r with each run left out, by Frisch-Waugh-Lovell: the
    run-demeaned variables' partial r given the run-demeaned step dummies). Rows without a step are left out.

    Returns within_r, within_p, within_r_null, within_ci_low, within_ci_high (arrays of m), within_n_runs (runs
    with at least 2 checkpoints) and within_why (why there is no r: '' where there is)."""
    m = X.shape[1]
    nan = np.full(m, np.nan)
    out = dict(within_r=nan, within_p=nan, within_r_null=nan, within_ci_low=nan, within_ci_high=nan,
               within_n_runs=0, within_why="")
    ok = np.isfinite(steps)
    y, X, steps = y[ok], X[ok], steps[ok]
    codes = run_codes(codes[ok], int(ok.sum()))
    size = np.bincount(codes)
    out["within_n_runs"] = int((size >= 2).sum())
    if out["within_n_runs"] < 2:
        return out | dict(within_why="fewer than 2 runs with several checkpoints")
    if len(np.unique(steps)) < 2:
        return out | dict(within_why="one step: no training to follow")
    D = fixed_effects(codes, steps)
    if len(y) - np.linalg.matrix_rank(np.column_stack([np.ones(len(y)), D])) < MIN_N:
        return out | dict(within_why="too few checkpoints beyond the run and step effects (the runs share too few "
                                     "steps)")
    res = perm_test(y, X, D, n_perm, seed, Scheme.whole_blocks(codes, steps), rho=False)
    out |= dict(within_r=res["partial_r"], within_p=res["partial_p_perm"], within_r_null=res["partial_r_null"],
                within_why=np.where(np.isfinite(res["partial_r"]), "", "nothing beyond the run and step effects (the "
                                    "metric or the target moves with them alone)"))
    if out["within_n_runs"] >= MIN_UNITS:
        S = _demean(D[:, codes.max():], codes)  # the step dummies, run-demeaned
        jack = weighted_partial(loo_weights(codes), _demean(X, codes), _demean(y[:, None], codes)[:, 0], S)
        out["within_ci_low"], out["within_ci_high"] = jackknife_interval(res["partial_r"], jack)
    return out


def _distinct_runs(codes: np.ndarray, A: np.ndarray) -> int:
    """How many runs differ in their rows (a run copied under another name counts once)."""
    keys = {b"".join(sorted(row.tobytes() for row in A[codes == c])) for c in np.unique(codes)}
    return len(keys)


def intervals(y: np.ndarray, X: np.ndarray, C: np.ndarray, codes: np.ndarray) -> dict:
    """The 95% intervals of r, R², rho and the partial r (given C) of y with each column of X: Fisher's z where
    every run is one row (partial r: n - k - 3 degrees of freedom; rho: Bonett & Wright's variance), the jackknife
    over runs on Fisher's z where runs have several rows. None where fewer than :data:`MIN_UNITS` distinct runs (or
    too few rows for the partial r's) carry them: ``claims_why`` says so."""
    m, n, k = X.shape[1], len(y), C.shape[1]
    nan = np.full(m, np.nan)
    clustered = np.bincount(codes).max(initial=0) > 1
    out = {f"{s}_ci_{e}": nan for s in ("r", "r2", "rho", "partial_r") for e in ("low", "high")}
    out |= dict(ci_method=JACKKNIFE if clustered else FISHER, ci_unit="runs", ci_units=codes.max(initial=-1) + 1,
                claims_why="")
    distinct = _distinct_runs(codes, np.column_stack([y, X]))
    if distinct < MIN_UNITS:
        copies = " (the runs hold the same numbers)" if distinct < out["ci_units"] else ""
        return out | dict(claims_why=f"{distinct} distinct run(s){copies}: no interval or verdict (needs "
                                     f"{MIN_UNITS})")
    one = np.ones((1, n))
    r, rho, part = weighted_partial(one, X, y)[0], weighted_rho(one, X, y)[0], weighted_partial(one, X, y, C)[0]
    if clustered:
        J = loo_weights(codes)
        ci = {"r": jackknife_interval(r, weighted_partial(J, X, y)), "rho": jackknife_interval(rho, weighted_rho(J, X, y)),
              "partial_r": jackknife_interval(part, weighted_partial(J, X, y, C))}
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            ci = {"r": fisher_interval(r, np.full(m, 1 / np.sqrt(n - 3))),
                  "rho": fisher_interval(rho, np.sqrt((1 + rho ** 2 / 2) / (n - 3))),
                  "partial_r": fisher_interval(part, np.full(m, 1 / np.sqrt(n - k - 3)) if n - k > 3 else nan)}
    for name, (lo, hi) in ci.items():
        out[f"{name}_ci_low"], out[f"{name}_ci_high"] = lo, hi
    out["r2_ci_low"], out["r2_ci_high"] = r2_interval(*ci["r"])
    return out


def _sign(x: float) -> str:
    return "positive" if x > 0 else "negative"


def sign_notes(pooled: float, steps: pd.DataFrame, within: float, within_p: float = np.nan,
               alpha: float = 0.05) -> list[str]:
    """Where the answers disagree in sign: per-step r's of both signs (each change between consecutive steps
    named), the pooled r against a per-step sign that all steps share, and within training against between.
    Only tested answers count: a step where its permutation p < ``alpha``, within training where ``within_p`` <
    ``alpha``; a sign that noise alone gives, or one with no test behind it (no permutations), is not a flip."""
    out = []
    s = steps[np.isfinite(steps.r.astype(float)) & (steps.r != 0)].sort_values("step")
    s = s[s.p_perm.astype(float) < alpha]
    signs = np.sign(s.r.to_numpy(float))
    if len(s) and (signs != signs[0]).any():
        at = np.flatnonzero(signs[1:] != signs[:-1])
        out.append("the sign flips between models: r across runs " + ", ".join(
            f"{s.r.iloc[i]:+.2f} at step {_num(s.step.iloc[i])}, {s.r.iloc[i + 1]:+.2f} at step "
            f"{_num(s.step.iloc[i + 1])}" for i in at)
                   + f" (the sign flips between step {_num(s.step.iloc[at[0]])} and {_num(s.step.iloc[at[0] + 1])})")
    elif len(s) and np.isfinite(pooled) and np.sign(pooled) != signs[0]:
        out.append(f"the pooled r ({pooled:+.2f}) is {_sign(pooled)} but the r across runs is {_sign(signs[0])} at "
                   f"every step where it differs from 0 ({s.r.min():+.2f} to {s.r.max():+.2f}): pooling mixes "
                   "between models and within training")
    between = signs[-1] if len(s) else 0
    if np.isfinite(within) and within != 0 and between and within_p < alpha and np.sign(within) != between:
        out.append(f"within training, beyond what all runs share at a step, the association is {_sign(within)} "
                   f"(fixed-effects r {within:+.2f}, p {within_p:.3g}), between models {_sign(between)} (r "
                   f"{s.r.iloc[-1]:+.2f} at step {_num(s.step.iloc[-1])})")
    return out


def _num(x: float) -> str:
    return f"{int(x)}" if float(x).is_integer() else f"{x:g}"


def claims(y: pd.Series, X: pd.DataFrame, C: pd.DataFrame, labels: pd.Series | None, steps: pd.Series | None,
           n_perm: int, seed: int | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """For columns of X that share their rows (all finite): the intervals over runs (r, R², rho, partial r given
    C; :func:`intervals`), the between-model summary over steps and the within-training fixed-effects r
    (:func:`within_fe`); and the per-step table. The first frame is indexed by X's (metric, scale) columns."""
    codes = run_codes(None if labels is None else labels.to_numpy(), len(y))
    yv, Xv = y.to_numpy(float), X.to_numpy(float)
    cols = intervals(yv, Xv, C.to_numpy(float), codes)
    several = labels is not None and np.bincount(codes).max(initial=0) > 1
    if several and steps is not None:
        cols |= within_fe(yv, Xv, codes, pd.to_numeric(steps, errors="coerce").to_numpy(float), n_perm, seed)
    else:
        nan = np.full(X.shape[1], np.nan)
        cols |= dict(within_r=nan, within_p=nan, within_r_null=nan, within_ci_low=nan, within_ci_high=nan,
                     within_n_runs=0, within_why="one checkpoint per run" if labels is not None else "no runs")
    steps_df = per_step(y, X, labels, steps, n_perm, seed) if several else pd.DataFrame(columns=STEP_COLUMNS)
    out = pd.DataFrame(cols, index=X.columns)
    g = steps_df.groupby(["metric", "scale"], sort=False)
    last = steps_df.sort_values("step").groupby(["metric", "scale"], sort=False).last()
    out["between_steps"] = g.size().reindex(out.index).fillna(0).astype(int)
    out["between_r_min"], out["between_r_max"] = g.r.min().reindex(out.index), g.r.max().reindex(out.index)
    out["between_step_last"] = last.step.reindex(out.index)
    out["between_r_last"], out["between_p_last"] = last.r.reindex(out.index), last.p_perm.reindex(out.index)
    return out[list(CLAIM_COLUMNS)], steps_df


def residual_r(x: np.ndarray, y: np.ndarray, Z: np.ndarray) -> float:
    """The r of x and y after least squares on [1, Z] (the partial r); nan when too few rows or one is determined."""
    A = np.column_stack([np.ones(len(x)), Z])
    if len(x) < np.linalg.matrix_rank(A) + MIN_N:
        return np.nan
    ex, ey = (v - A @ np.linalg.lstsq(A, v, rcond=None)[0] for v in (x, y))
    nx, ny = np.linalg.norm(ex), np.linalg.norm(ey)
    if nx < 1e-10 * np.linalg.norm(x - x.mean()) or ny < 1e-10 * np.linalg.norm(y - y.mean()):
        return np.nan
    return float(ex @ ey / (nx * ny))
