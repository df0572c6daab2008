"""Resampling whole runs, vectorised: the bootstrap over runs and leave-one-run-out as row weights.

A resample of runs (drawn with replacement, or all but one) is a weight per row: the number of times its run was
drawn (0 when left out). Every statistic here is a weighted moment of the rows, so B resamples are one (B x n)
weight matrix and a few matrix products, never a Python loop over resamples:

- :func:`weighted_partial`: Pearson's r (no controls) or the partial r given controls, from the weighted covariance
  of [x, y, controls] (the Schur complement of the controls' block: the covariance of the residuals on them);
- :func:`weighted_ranks`: the mid-ranks of a column within each resample (a run drawn twice ties with itself), so
  Spearman's rho of a resample is the weighted r of its ranks.

The interval is BCa, the bias-corrected and accelerated percentile interval (Efron & Tibshirani 1993, ch. 14;
the acceleration from the jackknife over runs, i.e. leave-one-run-out): a pooled r over a dozen runs is biased
towards 0 (the runs' spread is estimated from few of them), which the plain percentile interval, resampling the
same few, repeats; BCa corrects it (tests/analyzer/test_report_design.py measures its coverage). stats.csv's
``boot_method`` says it. Resamples where a statistic is undefined
(every drawn run of one size, so a control is constant) are left out of its interval, and counted.
"""
from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
from scipy.stats import rankdata

METHOD = "BCa"  # the bootstrap interval (stats.csv's boot_method)
LEVEL = 0.95
TIE = 1e-12  # relative: a resample this close to the estimate is a tie (rounding, not a difference)
_CHUNK_ELEMS = 2 ** 22  # resamples x rows x columns per chunk of the rank computation


def run_codes(labels: pd.Series | np.ndarray | None, n: int) -> np.ndarray:
    """Each row's run as 0..R-1 (a missing label, or no labels: a run of its own)."""
    if labels is None:
        return np.arange(n)
    codes, _ = pd.factorize(pd.Series(labels).reset_index(drop=True), use_na_sentinel=True)
    lone = codes < 0
    codes[lone] = codes.max(initial=-1) + 1 + np.arange(lone.sum())
    return codes


def bootstrap_weights(codes: np.ndarray, n_boot: int, seed: int | None) -> np.ndarray:
    """(n_boot x n) row weights: each resample draws as many runs as there are, with replacement (uniform), and a
    row weighs as often as its run was drawn."""
    k = codes.max(initial=-1) + 1
    counts = np.random.default_rng(seed).multinomial(k, np.full(k, 1 / k), size=n_boot) if k else np.zeros((n_boot, 0))
    return counts[:, codes].astype(float)


def loo_weights(codes: np.ndarray) -> np.ndarray:
    """(R x n) row weights: resample i leaves run i out."""
    return (codes[None, :] != np.arange(codes.max(initial=-1) + 1)[:, None]).astype(float)


def _moments(W: np.ndarray, A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted means (B x p) and covariances (B x p x p) of the columns of A (n x p) under each row of W."""
    sw = W.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (W @ A) / sw[:, None]
        second = np.einsum("bn,ni,nj->bij", W, A, A, optimize=True) / sw[:, None, None]
    return mean, second - mean[:, :, None] * mean[:, None, :]


def weighted_partial(W: np.ndarray, X: np.ndarray, y: np.ndarray, C: np.ndarray | None = None) -> np.ndarray:
    """(B x m): under each row of weights W (B x n), the r of y (n) with each column of X (n x m) given the
    controls C (n x k; none: Pearson's r). nan where a variable is constant or determined by the controls."""
    X = np.asarray(X, float).reshape(len(y), -1)
    C = np.empty((len(y), 0)) if C is None else np.asarray(C, float).reshape(len(y), -1)
    z = lambda a: (a - a.mean(0)) / np.where(a.std(0) > 0, a.std(0), 1)  # noqa: E731  conditioning only
    k = C.shape[1]
    _, S = _moments(W, np.column_stack([z(y), z(C), z(X)]))  # order: y, controls, metrics
    syy, syc, scc = S[:, 0, 0], S[:, 0, 1:k + 1], S[:, 1:k + 1, 1:k + 1]
    sxx = np.einsum("bjj->bj", S[:, k + 1:, k + 1:])
    sxy, sxc = S[:, k + 1:, 0], S[:, k + 1:, 1:k + 1]
    if k:
        ok = np.linalg.matrix_rank(scc, hermitian=True) == k
        scc = np.where(ok[:, None, None], scc, np.eye(k))
        a_y = np.linalg.solve(scc, syc[:, :, None])[:, :, 0]  # B x k
        a_x = np.linalg.solve(scc, np.swapaxes(sxc, 1, 2))  # B x k x m
        syy = np.where(ok, syy - (syc * a_y).sum(1), np.nan)
        sxx = sxx - np.einsum("bjk,bkj->bj", sxc, a_x)
        sxy = sxy - np.einsum("bjk,bk->bj", sxc, a_y)
    tiny = 1e-10
    with np.errstate(invalid="ignore", divide="ignore"):
        r = sxy / np.sqrt(sxx * syy[:, None])
    return np.where((sxx > tiny) & (syy[:, None] > tiny), np.clip(r, -1, 1), np.nan)


def weighted_ranks(W: np.ndarray, a: np.ndarray) -> np.ndarray:
    """(B x n): the mid-rank of each row of ``a`` (n) among the rows as weighted by each resample (a row of weight
    w stands for w tied copies); rows of weight 0 get the rank they would have, which weighs nothing."""
    order = np.argsort(a, kind="stable")
    _, group = np.unique(a[order], return_inverse=True)  # ties in a share one group
    G = np.zeros((len(a), group.max(initial=-1) + 1))
    G[np.arange(len(a)), group] = 1
    gw = W[:, order] @ G  # B x groups: weight of each tie group
    below = np.cumsum(gw, 1) - gw
    ranks = np.empty_like(W)
    ranks[:, order] = (below + (gw + 1) / 2)[:, group]
    return ranks


def weighted_rho(W: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(B x m): Spearman's rho of y with each column of X under each resample (the weighted r of its mid-ranks)."""
    X = np.asarray(X, float).reshape(len(y), -1)
    ry = weighted_ranks(W, y)
    out = np.empty((len(W), X.shape[1]))
    for j in range(X.shape[1]):
        rx = weighted_ranks(W, X[:, j])
        sw = W.sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mx, my = (W * rx).sum(1) / sw, (W * ry).sum(1) / sw
            dx, dy = rx - mx[:, None], ry - my[:, None]
            out[:, j] = (W * dx * dy).sum(1) / np.sqrt((W * dx * dx).sum(1) * (W * dy * dy).sum(1))
    return out


def percentile_interval(samples: np.ndarray, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The percentile interval of each column of ``samples`` (B x m) over its finite values, and how many of the
    B were finite; nan where fewer than half were."""
    finite = np.isfinite(samples)
    q = (1 - level) / 2
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-nan column: its interval is nan
        lo, hi = np.nanquantile(samples, [q, 1 - q], axis=0)
    used = finite.sum(0)
    bad = used < len(samples) / 2
    return np.where(bad, np.nan, lo), np.where(bad, np.nan, hi), used


def bca_interval(samples: np.ndarray, theta: np.ndarray, jack: np.ndarray,
                 level: float = LEVEL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The BCa interval of each column: ``samples`` (B x m) the bootstrap values, ``theta`` (m) the estimate,
    ``jack`` (R x m) the leave-one-run-out values (the acceleration); the finite resamples counted. Falls back to
    the percentile interval where the bias or acceleration is undefined; nan where fewer than half are finite.
    The bias counts a resample within :data:`TIE` (relative) of the estimate as half below: with few runs many
    resamples draw every run once and equal the estimate up to rounding, which must not decide the interval."""
    from scipy.stats import norm
    lo_p, hi_p, used = percentile_interval(samples, level)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a constant metric: no jackknife, no interval
        tie = np.abs(samples - theta) <= TIE * np.fmax(np.abs(theta), np.nanmax(np.abs(samples), 0))
        below = (np.where(np.isfinite(samples) & ~tie, samples < theta, 0).sum(0) + 0.5 * tie.sum(0)) / used
        z0 = norm.ppf(below)
        d = np.nanmean(jack, 0) - jack
        a = np.nansum(d ** 3, 0) / (6 * np.nansum(d ** 2, 0) ** 1.5)
        z = norm.ppf([(1 - level) / 2, (1 + level) / 2])[:, None]
        q = norm.cdf(z0 + (z0 + z) / (1 - a * (z0 + z)))  # 2 x m: the adjusted levels
    out = []
    for k, fallback in enumerate((lo_p, hi_p)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            v = np.array([np.nanquantile(samples[:, j], q[k, j]) if np.isfinite(q[k, j]) and used[j] else np.nan
                          for j in range(samples.shape[1])])
        out.append(np.where(np.isfinite(v), v, fallback))
    bad = ~np.isfinite(lo_p)
    return np.where(bad, np.nan, out[0]), np.where(bad, np.nan, out[1]), used


def run_bootstrap(y: np.ndarray, X: np.ndarray, C: np.ndarray, codes: np.ndarray, n_boot: int,
                  seed: int | None) -> dict[str, tuple]:
    """The BCa intervals over runs of r, R², rho and the partial r (given C) of y with each column of X:
    {name: (low, high, finite resamples)}; one weight matrix for all resamples, one for the jackknife."""
    W, J, one = bootstrap_weights(codes, n_boot, seed), loo_weights(codes), np.ones((1, len(y)))
    r, r_jack, r_hat = (weighted_partial(w, X, y) for w in (W, J, one))
    p, p_jack, p_hat = (weighted_partial(w, X, y, C) for w in (W, J, one))
    out = {"r": bca_interval(r, r_hat[0], r_jack), "r2": bca_interval(r * r, r_hat[0] ** 2, r_jack ** 2),
           "partial_r": bca_interval(p, p_hat[0], p_jack)}
    keys = [rankdata(X[:, j]).tobytes() for j in range(X.shape[1])]  # raw and log10 share their ranks: once
    first = {k: j for j, k in reversed(list(enumerate(keys)))}
    cols = sorted(set(first.values()))
    step = max(1, _CHUNK_ELEMS // max(1, len(y) * 4))
    rho = np.concatenate([weighted_rho(W[i:i + step], X[:, cols], y) for i in range(0, len(W), step)])
    back = [cols.index(first[k]) for k in keys]
    rho_jack, rho_hat = weighted_rho(J, X[:, cols], y)[:, back], weighted_rho(one, X[:, cols], y)[0, back]
    return out | {"rho": bca_interval(rho[:, back], rho_hat, rho_jack)}
