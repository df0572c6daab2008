"""Chan's update of a batch's classes on the CPU in one numba pass (:func:`chan_rows`, which accumulate.ClassStats
runs on the CPU): the arithmetic of accumulate.chan_update and unit_sums (torch, which a GPU runs) without their dozen
kernels and gathered copies, each a pass over the batch's rows (a fold's update is a few hundred tokens: those passes,
not the arithmetic, were its cost). Numpy arrays in, in place; ``tests/analyzer/test_accumulate.py`` holds it to brute
force and to the torch update."""
from __future__ import annotations

import math

import numba
import numpy as np

# a float64 norm below it (or not finite): its squares may have under- or overflowed (accumulate.unit_sums too)
NORM_FLOOR = np.finfo(np.float64).tiny ** 0.5 * 1e14


@numba.njit(fastmath={"reassoc", "contract", "nsz"}, nogil=True, error_model="numpy", boundscheck=False, cache=True)
def _unit_add(x: np.ndarray, unit: np.ndarray) -> None:
    """unit += x / ||x|| in float64 (x / max|x| first where the norm's squares would under- or overflow; 0 for a
    zero row; NaN where x holds NaN or Inf)."""
    s = 0.0
    for k in range(x.size):
        s += np.float64(x[k]) * np.float64(x[k])
    norm = math.sqrt(s)
    scale = 1.0
    if not (math.isfinite(norm) and norm > NORM_FLOOR):
        top = 0.0
        for k in range(x.size):
            top = max(top, abs(np.float64(x[k])))
        if top == 0.0:
            return
        scale, s = 1.0 / top, 0.0
        for k in range(x.size):
            s += (np.float64(x[k]) * scale) ** 2
        norm = math.sqrt(s) if math.isfinite(top) else math.nan
    inv = 1.0 / norm
    for k in range(x.size):
        unit[k] += np.float64(x[k]) * scale * inv


@numba.njit(fastmath={"reassoc", "contract", "nsz"}, nogil=True, error_model="numpy", boundscheck=False, cache=True)
def chan_rows(h: np.ndarray, order: np.ndarray, classes: np.ndarray, lengths: np.ndarray, count: np.ndarray,
              mean: np.ndarray, m2: np.ndarray, unit: np.ndarray, rows: np.ndarray) -> int:
    """Fold the groups (``classes``, ``lengths``; their tokens the rows ``order`` of ``h``, consecutive) into
    ``count``, ``mean``, ``m2`` and ``unit`` in place; write to ``rows`` the rows whose Gram is the scatter's
    increment (each token's deviation from its group's batch mean where the group has two or more, sqrt(w) delta
    where the class was seen before) and return how many."""
    d = h.shape[1]
    mean_b = np.empty(d)
    r = t = 0
    for j in range(classes.size):
        c, n_b = classes[j], lengths[j]
        mean_b[:] = 0.0
        for i in range(t, t + n_b):
            x = h[order[i]]
            for k in range(d):
                mean_b[k] += np.float64(x[k])
            _unit_add(x, unit)
        mean_b /= n_b
        m2_b = 0.0
        if n_b > 1:
            for i in range(t, t + n_b):
                x, row = h[order[i]], rows[r]
                for k in range(d):
                    dev = np.float64(x[k]) - mean_b[k]
                    row[k] = dev
                    m2_b += dev * dev
                r += 1
        n_a, mu = count[c], mean[c]
        if n_a == 0:                      # a new class: its mean is its batch mean, its delta row adds 0
            mu += mean_b
            m2[c] += m2_b
        else:
            n = np.float64(n_a + n_b)
            w, row, sq = n_a * np.float64(n_b) / n, rows[r], 0.0
            for k in range(d):
                delta = mean_b[k] - mu[k]
                sq += delta * delta
                row[k] = delta * math.sqrt(w)
                mu[k] += delta * (n_b / n)
            m2[c] += m2_b + w * sq
            r += 1
        count[c] += n_b
        t += n_b
    return r
