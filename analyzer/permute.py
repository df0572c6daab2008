"""Permutation tests that respect the design: which rearrangements of the rows are equally likely under the null.

Exchangeability. A permutation test is valid when, under the null, the data's distribution does not change under
the permutations it draws (Winkler et al. 2014, "Permutation inference for the general linear model",
NeuroImage 92). Checkpoints of one training run are not independent units: they share the run's seed, size,
data order and schedule, so a run's metric and its loss each carry a run-level offset and a run's own trend. Row
permutations then break the rows of a run apart and compare the observed r with a null far narrower than the
truth (in tests/analyzer/test_permute.py, 7 runs of 3-4 checkpoints, they call an unrelated metric significant 25-40%
of the time at alpha = 0.05). The rows of one run are therefore an exchangeability block, and a :class:`Scheme`
permutes whole blocks: the target's values of run A (or, for Freedman-Lane, its residuals on the controls) move as one
unit onto the rows of run B, position by position in step order. This is a valid test of "metric and target
are related" when runs differ: if the metric's runs and the target's runs are independent, pairing the metric
of run A with the target of run B is as likely as with its own. What all runs share at the same position (a
common trend in step) stays paired in every permutation, so only association beyond it counts as evidence.

Unequal runs. Moving run B's values onto run A's rows needs as many rows in both, so blocks are exchangeable only
with blocks of the same size (Winkler's variance groups, here: runs with the same number of checkpoints). With
``k_g`` runs of each size ``g`` there are prod_g k_g! distinct permutations, the identity among them; when that
is at most the requested count every one is enumerated and p is exact, else they are drawn at random (uniform
over the product). Few distinct permutations bound the smallest p from below: an equal-tailed p is twice the smaller
tail, and the identity is always in it, so p >= 2/N (with 3 runs, 1/3; with 4 runs of one row, 2/24).

Why not the alternatives. Shuffling checkpoints within each run (within-block permutation) tests only the
within-run association and assumes a run's checkpoints exchangeable, which any trend in step breaks; correlating
one summary per run throws away the checkpoints and the step control (``--per-run last`` is that choice, made
explicitly). Whole-run permutation keeps every row and is exact for r and rho; for the partial r it permutes
Freedman-Lane residuals, exact only asymptotically, as everywhere (Winkler et al. 2014; tests/analyzer/test_permute.py
measures its rate).

A selection with one checkpoint per run (or no run labels) is the plain case: every row is its own block and
the permutations are those of the rows, as before.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.linalg import orth
from scipy.stats import rankdata

from ncanalyze.analyzer.registry import N_PERM, REPORT

MIN_N = 3  # fewest points for which a correlation means anything
_TIE = 100 * np.finfo(float).eps  # relative tolerance for ties with the observed statistic (as scipy)
_CHUNK_ELEMS = 2 ** 20  # permutations per chunk x n: bounds memory at a few (chunk x n) float arrays
_CONSTANT = 1e-9  # a column whose spread is at most this fraction of its size is constant (rounding spread)
_DEGENERATE = 1e-10  # a residual this small relative to its centred variable is zero (determined by the controls)
ROWS, WHOLE_RUNS = "rows", "whole runs"  # the schemes' names, as stats.csv writes them


@dataclass(frozen=True)
class Scheme:
    """Which permutations of ``n`` rows are drawn. ``groups``: one (k x s) array of row indices per block size s,
    each row a block's rows in position order; blocks of one group are exchanged as wholes."""
    n: int
    groups: tuple[np.ndarray, ...]
    name: str

    @classmethod
    def rows(cls, n: int) -> "Scheme":
        """Every row its own exchangeable unit: all n! permutations of the rows."""
        return cls(n, (np.arange(n)[:, None],), ROWS)

    @classmethod
    def whole_blocks(cls, labels: np.ndarray | pd.Series, order: np.ndarray | pd.Series | None = None) -> "Scheme":
        """Blocks by ``labels`` (a missing label: a block of its own), rows in a block ranked by ``order`` (e.g.
        global_step; ties and missing values keep the rows' order). One row per block: :meth:`rows`."""
        codes, _ = pd.factorize(pd.Series(labels).reset_index(drop=True), use_na_sentinel=True)
        n = len(codes)
        lone = codes < 0
        codes[lone] = codes.max(initial=-1) + 1 + np.arange(lone.sum())
        key = np.zeros(n) if order is None else pd.to_numeric(pd.Series(order), errors="coerce").to_numpy(float)
        rows = np.lexsort((np.arange(n), np.nan_to_num(key, nan=np.inf), codes))  # by block, then order
        size = np.bincount(codes)
        if (size == 1).all():
            return cls.rows(n)
        starts = np.cumsum(size) - size  # block b's rows are rows[starts[b]: starts[b] + size[b]]
        groups = tuple(np.stack([rows[starts[b]:starts[b] + s] for b in np.flatnonzero(size == s)])
                       for s in np.unique(size))
        return cls(n, groups, WHOLE_RUNS)

    @property
    def n_units(self) -> int:
        """How many blocks (runs, or rows) are permuted."""
        return sum(len(g) for g in self.groups)

    @property
    def n_distinct(self) -> int:
        """How many distinct permutations the scheme has: prod over block sizes of (blocks of that size)!."""
        return math.prod(math.factorial(len(g)) for g in self.groups)

    def chunks(self, n_perm: int, seed: int | None) -> tuple[Iterator[np.ndarray], int, bool]:
        """Index arrays (chunk x n): row i of a permuted vector is ``v[idx[i]]``; their total, and whether they
        are all :attr:`n_distinct` permutations (enumerated) rather than ``n_perm`` random ones."""
        chunk = max(1, _CHUNK_ELEMS // max(self.n, 1))
        total = self.n_distinct
        if total <= n_perm:
            every = [np.array(list(itertools.permutations(range(len(g)))), dtype=np.intp) for g in self.groups]
            shape = tuple(len(e) for e in every)
            picks = (np.unravel_index(np.arange(a, min(a + chunk, total)), shape) for a in range(0, total, chunk))
            return (self._indices([e[i] for e, i in zip(every, pick)]) for pick in picks), total, True
        rng = np.random.default_rng(seed)
        sizes = [chunk] * (n_perm // chunk) + ([n_perm % chunk] if n_perm % chunk else [])
        draw = lambda b: [rng.permuted(np.broadcast_to(np.arange(len(g)), (b, len(g))), axis=1)  # noqa: E731
                          for g in self.groups]
        return (self._indices(draw(b)) for b in sizes), n_perm, False

    def _indices(self, perms: list[np.ndarray]) -> np.ndarray:
        """Row indices (b x n) from one (b x k) permutation of the blocks per group: block i's rows take block
        perm[i]'s values, position by position."""
        idx = np.empty((len(perms[0]), self.n), dtype=np.intp)
        for g, p in zip(self.groups, perms):
            idx[:, g.ravel()] = g[p].reshape(len(p), -1)
        return idx


def permutation_chunks(n: int, n_perm: int, seed: int | None) -> tuple[Iterator[np.ndarray], int, bool]:
    """Index arrays (chunk x n) of permutations of range(n), their total and whether they are all n! of them."""
    return Scheme.rows(n).chunks(n_perm, seed)


def _unit(a: np.ndarray) -> np.ndarray:
    """Centred columns scaled to unit norm, so that a dot product of two is their Pearson r (nan if constant, up to
    rounding: a spread of at most :data:`_CONSTANT` of the column's size)."""
    c = a - a.mean(axis=0)
    norm = np.linalg.norm(c, axis=0)
    norm = np.where(norm > _CONSTANT * np.linalg.norm(a, axis=0), norm, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        return c / norm


def _p(low: np.ndarray, high: np.ndarray, stat: np.ndarray, total: int, exact: bool) -> np.ndarray:
    """Two-sided, equal-tailed permutation p from the counts of null <= observed (``low``) and null >= observed
    (``high``): twice the smaller tail, at most 1; a tail is hits / N when every permutation was counted (the
    identity among them), else (1 + hits) / (1 + B) (Phipson & Smyth 2010, as scipy). Equal tails, not |null| >=
    |observed|: the null need not be centred at 0 (what all runs share at a step stays paired in it)."""
    add = 0 if exact else 1
    tail = np.minimum(low, high)
    return np.where(np.isfinite(stat), np.minimum(1.0, 2 * (tail + add) / (total + add)), np.nan)


def perm_test(y: np.ndarray, X: np.ndarray, C: np.ndarray | None = None, n_perm: int = N_PERM,
              seed: int | None = REPORT.seed, scheme: Scheme | None = None, rho: bool = True) -> dict:
    """Pearson r, Spearman rho and partial r (given controls ``C``, n x k) of ``y`` (n) with each column of
    ``X`` (n x m), with two-sided permutation p-values under ``scheme`` (default: rows): r and rho permute y,
    the partial r permutes y's residuals on [1, C] (Freedman & Lane 1983: y* = yhat_C + P e_C). All inputs finite.

    ``rho=False`` skips Spearman's rho (nan), e.g. where only r and the partial r are wanted (leave-one-out).
    The two-sided p is equal-tailed (:func:`_p`); ``*_null`` is the mean of the statistic over the permutations
    counted, the null's centre (what the design alone yields: a trend shared by all runs keeps it off 0).

    Returns
    -------
    dict
        r, rho, partial_r, p_perm, rho_p, partial_p_perm, r_null, rho_null, partial_r_null (arrays of m); n_perm (permutations counted), exact
        (all enumerated), n_distinct (the scheme's distinct permutations), scheme (its name), n_units.
    """
    n = len(y)
    scheme = scheme or Scheme.rows(n)
    C = np.empty((n, 0)) if C is None else np.asarray(C, float).reshape(n, -1)
    if n < MIN_N:
        raise ValueError(f"perm_test needs n >= {MIN_N}, got {n}")
    Q = orth(np.column_stack([np.ones(n), C]))  # orthonormal basis of span{1, controls}
    resid = lambda a: a - Q @ (Q.T @ a)  # noqa: E731  residual maker R = I - QQ^T
    zy, zx = _unit(y), _unit(X)
    ry, rx = (_unit(rankdata(y)), _unit(rankdata(X, axis=0))) if rho else (np.zeros(n), np.zeros(X.shape))
    ey, ex = resid(y), resid(X)
    ey = ey * (np.linalg.norm(ey) > _DEGENERATE * np.linalg.norm(y - y.mean()))  # determined by C: zero, so nan
    ex = ex * (np.linalg.norm(ex, axis=0) > _DEGENERATE * np.linalg.norm(X - X.mean(axis=0), axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        ex = ex / np.linalg.norm(ex, axis=0)
        stat = {"r": zy @ zx, "rho": ry @ rx if rho else np.full(X.shape[1], np.nan),
                "partial_r": ey @ ex / np.linalg.norm(ey)}
    out = stat | {k: np.full_like(stat["r"], np.nan) for k in ("p_perm", "rho_p", "partial_p_perm", "r_null",
                                                              "rho_null", "partial_r_null")}
    out |= dict(n_perm=0, exact=False, n_distinct=scheme.n_distinct, scheme=scheme.name, n_units=scheme.n_units)
    if n_perm <= 0:
        return out
    chunks, total, exact = scheme.chunks(n_perm, seed)
    low = {k: np.zeros(stat["r"].shape, np.int64) for k in stat}
    high, total_null = {k: np.zeros_like(low[k]) for k in stat}, {k: np.zeros(stat["r"].shape) for k in stat}
    for idx in chunks:
        E = ey[idx]  # permuted residuals, one permutation per row; R(P e) has norm^2 = |e|^2 - |Q^T P e|^2
        with np.errstate(invalid="ignore", divide="ignore"):
            null = {"r": zy[idx] @ zx, "rho": ry[idx] @ rx if rho else np.zeros((len(idx), X.shape[1])),
                    "partial_r": (E @ ex) / np.sqrt(ey @ ey - ((E @ Q) ** 2).sum(1))[:, None]}
        for k in stat:
            tol = np.abs(stat[k]) * _TIE
            low[k] += (null[k] <= stat[k] + tol).sum(0)
            high[k] += (null[k] >= stat[k] - tol).sum(0)
            total_null[k] += null[k].sum(0)
    with np.errstate(invalid="ignore"):
        out.update({p: _p(low[k], high[k], stat[k], total, exact) for k, p in
                    (("r", "p_perm"), ("rho", "rho_p"), ("partial_r", "partial_p_perm"))})
        out.update({f"{k}_null": np.where(np.isfinite(stat[k]), total_null[k] / total, np.nan) for k in stat})
    out.update(n_perm=total, exact=exact)
    return out
