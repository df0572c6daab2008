"""The two questions a study of several runs with several checkpoints asks, kept apart, and the claims' intervals.

- *Between models*: at one training step, do the runs with the higher metric have the higher loss? The r across
  runs at each step that at least :data:`MIN_RUNS` runs share (:func:`per_step`), with its permutation p over runs
  (rows at one step are one per run: independent units).
- *Within training*: as one run trains, does its loss move with its metric? The mean over runs of each run's own r
  over its checkpoints (:func:`within_run`), with a BCa interval from resampling runs.
- The pooled r (every checkpoint of every run at once, stats.py's ``r``) mixes the two; where their signs disagree
  :func:`sign_notes` says so ("the sign flips between step 120 and 240").

:func:`claims` adds to each (metric, scale) the bootstrap intervals over whole runs of r, R², rho and the partial
r (:mod:`ncanalyze.analyzer.resample`), the two questions and their notes. :func:`ncanalyze.analyzer.stats.control_table` gives the partial r
under each choice of scale control (none, log parameters, the varying design factors, architecture fixed effects).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from ncanalyze.analyzer.permute import MIN_N, Scheme, perm_test
from ncanalyze.analyzer.resample import METHOD, bca_interval, bootstrap_weights, run_bootstrap, run_codes

MIN_RUNS = 4  # fewest runs at a step for a between-model r
MIN_BOOT_UNITS = 4  # fewest runs (or rows) to resample for an interval
STEP_COLUMNS = ("metric", "scale", "step", "n_runs", "r", "r2", "rho", "p_perm", "rho_p", "r_null")
CLAIM_COLUMNS = ("n_boot", "boot_unit", "boot_method", "r_ci_low", "r_ci_high", "r2_ci_low", "r2_ci_high", "rho_ci_low",
                 "rho_ci_high", "partial_r_ci_low", "partial_r_ci_high", "within_r", "within_ci_low", "within_ci_high",
                 "within_n_runs", "between_steps", "between_r_min", "between_r_max", "between_step_last",
                 "between_r_last", "between_p_last")  # the columns :func:`claims` adds, in order


def per_step(y: pd.Series, X: pd.DataFrame, labels: pd.Series | None, steps: pd.Series | None, n_perm: int,
             seed: int | None) -> pd.DataFrame:
    """Between models: at each step that at least :data:`MIN_RUNS` runs share, the r, R², rho of y with each column
    of X across the runs (all rows finite), with permutation p-values over the runs (equal-tailed) and the null's
    centre. Columns :data:`STEP_COLUMNS`; empty without runs or steps."""
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


def within_run(y: np.ndarray, X: np.ndarray, codes: np.ndarray, n_boot: int, seed: int | None) -> dict:
    """Within training: each run's own r of y with each column of X over its checkpoints (runs with at least
    MIN_N and neither constant), their mean over runs and its BCa interval from resampling those runs.
    Returns within_r, within_ci_low, within_ci_high (arrays of m) and within_n_runs."""
    k = codes.max(initial=-1) + 1
    size = np.bincount(codes, minlength=k)
    mean = lambda a: np.stack([np.bincount(codes, a[:, j], k) for j in range(a.shape[1])], 1) / size[:, None]  # noqa
    dy = y - mean(y[:, None])[codes, 0]
    dx = X - mean(X)[codes]
    sxy, sxx = mean(dx * dy[:, None]), mean(dx * dx)
    syy = mean((dy * dy)[:, None])
    ok = (size >= MIN_N)[:, None] & (sxx > 1e-12 * (1 + np.abs(mean(X)) ** 2)) & (syy > 1e-24)
    with np.errstate(invalid="ignore", divide="ignore"):
        r_run = np.where(ok, sxy / np.sqrt(sxx * syy), np.nan)  # runs x m
    m = X.shape[1]
    n_runs = int(ok.any(1).sum())
    out = dict(within_r=np.full(m, np.nan), within_ci_low=np.full(m, np.nan), within_ci_high=np.full(m, np.nan),
               within_n_runs=ok.sum(0))
    if n_runs < 2:
        return out
    valid = np.isfinite(r_run)
    out["within_r"] = np.where(valid.sum(0) >= 2, np.nansum(r_run, 0) / np.maximum(valid.sum(0), 1), np.nan)
    if n_runs >= MIN_BOOT_UNITS and n_boot > 0:
        counts = bootstrap_weights(np.arange(k), n_boot, seed)  # n_boot x runs
        jack = 1 - np.eye(k)  # leave one run out
        with np.errstate(invalid="ignore", divide="ignore"):
            boot, loo = ((w @ np.nan_to_num(r_run)) / (w @ valid) for w in (counts, jack))
        lo, hi, _ = bca_interval(boot, out["within_r"], loo)
        out |= dict(within_ci_low=lo, within_ci_high=hi)
    return out


def _sign(x: float) -> str:
    return "positive" if x > 0 else "negative"


def sign_notes(pooled: float, steps: pd.DataFrame, within: float, within_ci: tuple[float, float] = (np.nan, np.nan),
               alpha: float = 0.05) -> list[str]:
    """Where the answers disagree in sign: per-step r's of both signs (each change between consecutive steps
    named), the pooled r against a per-step sign that all steps share, and within training against between.
    A step counts where its permutation p < ``alpha`` (every step where no p was computed), and within training
    where its interval excludes 0 (or has none): a sign that noise alone gives is not a flip."""
    out = []
    s = steps[np.isfinite(steps.r.astype(float)) & (steps.r != 0)].sort_values("step")
    p = s.p_perm.astype(float)
    s = s[(p < alpha) | p.isna()]
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
    firm = not (np.isfinite(within_ci[0]) and within_ci[0] <= 0 <= within_ci[1])
    if np.isfinite(within) and within != 0 and between and firm and np.sign(within) != between:
        out.append(f"within training the association is {_sign(within)} (mean within-run r {within:+.2f}), between "
                   f"models {_sign(between)} (r {s.r.iloc[-1]:+.2f} at step {_num(s.step.iloc[-1])})")
    return out


def _num(x: float) -> str:
    return f"{int(x)}" if float(x).is_integer() else f"{x:g}"


def claims(y: pd.Series, X: pd.DataFrame, C: pd.DataFrame, labels: pd.Series | None, steps: pd.Series | None,
           n_perm: int, n_boot: int, seed: int | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """For columns of X that share their rows (all finite): the bootstrap intervals over runs (r, R², rho, partial
    r given C), the between-model summary over steps and the within-run r with their notes; and the per-step
    table. The first frame is indexed by X's (metric, scale) columns."""
    codes = run_codes(None if labels is None else labels.to_numpy(), len(y))
    yv, Xv = y.to_numpy(float), X.to_numpy(float)
    units = codes.max(initial=-1) + 1
    cols: dict[str, np.ndarray | float | str] = {"n_boot": 0, "boot_unit": "runs" if labels is not None else
                                                 "checkpoints", "boot_method": METHOD}
    nan = np.full(X.shape[1], np.nan)
    for name in ("r", "r2", "rho", "partial_r"):
        cols[f"{name}_ci_low"], cols[f"{name}_ci_high"] = nan, nan
    if units >= MIN_BOOT_UNITS and n_boot > 0 and len(y) >= MIN_N:
        boot = run_bootstrap(yv, Xv, C.to_numpy(float), codes, n_boot, seed)
        for name, (lo, hi, _) in boot.items():
            cols[f"{name}_ci_low"], cols[f"{name}_ci_high"] = lo, hi
        cols["n_boot"] = n_boot
    several = labels is not None and np.bincount(codes).max(initial=0) > 1
    cols |= within_run(yv, Xv, codes, n_boot, seed) if several else dict(
        within_r=nan, within_ci_low=nan, within_ci_high=nan, within_n_runs=np.zeros(X.shape[1], int))
    steps_df = per_step(y, X, labels, steps, n_perm, seed) if several else pd.DataFrame(columns=STEP_COLUMNS)
    out = pd.DataFrame(cols, index=X.columns)
    g = steps_df.groupby(["metric", "scale"], sort=False)
    last = steps_df.sort_values("step").groupby(["metric", "scale"], sort=False).last()
    out["between_steps"] = g.size().reindex(out.index).fillna(0).astype(int)
    out["between_r_min"], out["between_r_max"] = g.r.min().reindex(out.index), g.r.max().reindex(out.index)
    out["between_step_last"] = last.step.reindex(out.index)
    out["between_r_last"], out["between_p_last"] = last.r.reindex(out.index), last.p_perm.reindex(out.index)
    return out, steps_df


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
