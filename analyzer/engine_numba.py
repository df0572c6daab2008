"""The host engine (numpy and numba) of the pairwise and spectral sums: the kept rows, the d x d moments and
numpy.linalg's spectra (moments.py, ``la=numpy.linalg``) and the pairwise sums in one dask compute. The pairwise sums
go one Gram block per tile pair (one BLAS call), then one fused numba pass over it (a log, a reciprocal and a few
multiply-adds per pair), so the whole costs about one tiled Gram; the tiles are the tasks of one dask graph
(:func:`pair_sums`), the sums pairs.py's. engines.py chooses this engine or engine_torch.py.

The tests hold :func:`tile_sums` to pairs.reference_tile_sums tile by tile, and the metrics of this engine to the
torch engine's to 1e-12 (tests/analyzer/test_engine_numba.py, test_engine_torch.py).
"""
from __future__ import annotations

import functools
import math
import os
import sys
import uuid
from typing import Any

import dask
import dask.local
import dask.threaded
import numba
import numpy as np
import psutil
import threadpoolctl
import xarray as xr
from dask.delayed import Delayed
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ncanalyze.analyzer.moments import check_centred, check_finite, finish_moments, pair_mean
from ncanalyze.analyzer.pairs import (COINCIDENT, CONTROLS, EXAMPLES, SUMS, PairSums, block_hits, blocks, control_block,
                                      control_totals, few, side_of, subset_sums)
from ncanalyze.core.threads import available

PANEL_CELLS = 1 << 20  # Gram cells per BLAS call (8 MiB): few calls, and the block stays in cache for the pass
MAX_TILE = 2048


# ---------------------------------------------------------------- the kept classes' parts on the host

def auto_tile(n: int, threads: int | None = None, budget: float = 0.1) -> int:
    """Tile size: at most 2048 classes, small enough that a t x t float64 Gram block per worker thread fits
    ``budget`` of the available memory (a task holds one such block plus O(t d) inputs), and at most n/8 (but
    not below 256) so that the tile pairs spread evenly over the threads."""
    threads = threads or os.cpu_count() or 1
    t = int(math.sqrt(budget * psutil.virtual_memory().available / threads / 8))
    return max(1, min(n, MAX_TILE, t, max(256, -(-n // 8))))


def host_parts(ds: xr.Dataset, K: np.ndarray, p: np.ndarray, has_var: np.ndarray, sigma_w: np.ndarray | None,
                tile: int | None, debias: tuple | None = None, sample: list | None = None,
                all_pairs: bool = True, head: np.ndarray | None = None) -> dict[str, Any]:
    """The Geometry's fields that read the class means and the classifier, on the host: numpy, then the numba pair
    sums and the moments in one dask compute, on :func:`workers` threads, every BLAS call on one thread (the tasks
    are the parallelism; a BLAS team of its own would wait at its barriers for a core another process holds). Keys as
    :func:`~ncanalyze.analyzer.engine_torch.device_parts` (``sample``, ``all_pairs``, ``head``: as there)."""
    M, var, r, mu_G = _centred_means(ds, K)
    U = M / r[:, None]
    s = U.sum(0)
    t0 = pair_mean(s, K.size)
    W = _rows(ds["classifier"], K) if "classifier" in ds else None
    tile = int(tile or auto_tile(K.size))
    work = {"mom": _moments(ds, K, M, mu_G, W, sigma_w, tile, head)}
    if all_pairs:
        work["pairs"] = pair_sums(U, r, var, p, has_var, t0, blocks(K.size, tile), debias)
    if sample is not None:
        side = side_of(r, var, p, has_var, debias)
        half = len(sample) // 2  # a task per half (each a few dozen Gram blocks); not pure: no hash of U
        work["sample_sums"] = dask.delayed(np.concatenate)([dask.delayed(_block_sums)(U, side, t0, s)
                                                            for s in (sample[:half], sample[half:])])
        work["controls"] = dask.delayed(control_totals)(U, p, t0)
    n = workers(K.size * (K.size - 1) / 2 if all_pairs else 0, sum(len(a) * len(b) for a, b in sample or ()),
                _moment_rows(ds, K, W is not None and head is None), M.shape[1])
    with _blas_controller().limit(limits=1, user_api="blas"):                     # the same sums either way
        got = dask.compute(work, **_scheduler(n))[0]
        pairs, row_cdnv, coincident = got.pop("pairs", (None, None, []))
        return {"var": var, "r": r, "s": s, "t0": t0, "us": U @ s, "m_sum": M.sum(0),
                "m_sums": subset_sums(M, has_var, debias), "pairs": pairs,
                "row_cdnv": row_cdnv, "coincident": coincident, **got}


SYNC_WORK = 1.5e8  # multiply-adds below which the host computes in the caller's thread: where the thread pool stopped
# losing on 2 cores (benchmarks/metrics.py's smaller problems: the caller's thread at 1.4e8, the pool at 2.0e8)


def work(pairs: float, sampled: float, rows: int, d: int) -> float:
    """The host's multiply-adds: (``pairs`` + ``sampled`` pairs) x d for the Gram blocks, ``rows`` x d^2 for the
    moments."""
    return (pairs + sampled) * d + rows * d * d


def workers(pairs: float, sampled: float, rows: int, d: int) -> int:
    """The threads of the host's one dask compute: 1 (the caller's thread, dask's sync scheduler: no pool to start,
    no task handed over) where the work (:func:`work`) is below :data:`SYNC_WORK`; else the thread policy's count
    where one runs (core/threads.py: ``--threads N``, or under ``auto`` the cores other processes leave idle), else
    the cores this process may use (affinity, cgroup quota, ``OMP_NUM_THREADS``). The tasks are independent (no
    barrier), so a busy core costs them its share only."""
    return 1 if work(pairs, sampled, rows, d) < SYNC_WORK else available()


def _scheduler(n: int) -> dict[str, Any]:
    """dask.compute's scheduler for ``n`` threads (:func:`workers`); where this process has a distributed Client
    (``--scheduler``, ``DASK_SCHEDULER_ADDRESS``), its cluster, whatever the work's size: the user chose it."""
    if "distributed" in sys.modules:  # else no Client can exist: importing it would cost ~0.4 s for nothing
        try:
            sys.modules["distributed"].default_client()
            return {}
        except ValueError:
            pass
    # dask's own functions, not their names: a name has dask import distributed to look for a Client
    return {"scheduler": dask.local.get_sync} if n == 1 else {"scheduler": dask.threaded.get, "num_workers": n}


def _moment_rows(ds: xr.Dataset, K: np.ndarray, head: bool) -> int:
    """The rows the moments read: the counted classes, and the whole vocabulary again for the head's W^T W where it
    is summed here (``head``)."""
    counted = int(np.count_nonzero(np.asarray(ds["count"].values)))
    return max(counted, K.size) + (ds["count"].size if head else 0)


def _block_sums(U: np.ndarray, side: np.ndarray, t0: float, sample: list) -> np.ndarray:
    """Per block (a, b) of ``sample``, the pair sums (``SUMS``, then pairs.CONTROLS) over every pair of class
    ``a_k`` with class ``b_l`` (two disjoint index sets): blocks x (SUMS + CONTROLS)."""
    out = np.zeros((len(sample), len(SUMS) + len(CONTROLS)))
    for k, (a, b) in enumerate(sample):
        if len(a) and len(b):
            Ua, Ub, sa, sb = U[a], U[b], np.ascontiguousarray(side[:, a]), np.ascontiguousarray(side[:, b])
            sums = tile_sums(Ua, sa, Ub, sb, t0, False)[0]   # rows contiguous: the pass vectorises (3x faster)
            out[k] = np.r_[sums, control_block(Ua, sa[3], Ub, sb[3], t0, sums[1])]
    return out


@functools.cache
def _blas_controller() -> threadpoolctl.ThreadpoolController:
    """The process's BLAS libraries, found once (each ``threadpool_limits`` call would scan the loaded libraries
    again: ~3.5 ms, more than a small checkpoint's metrics); numpy's, which the tasks call, is loaded with numpy."""
    return threadpoolctl.ThreadpoolController()


def _centred_means(ds: xr.Dataset, K: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """M (the centred means m_c), the variances, r_c = ||m_c|| and mu_G, checked finite, not all one mean, and
    non-zero."""
    M = _rows(ds["mean"], K)
    scale = float(np.sqrt(np.einsum("ij,ij->i", M, M)).max())
    mu_G = M.mean(0)
    M -= mu_G                                                     # m_c = mu_c - mu_G
    var = _rows(ds["variance"], K)
    r = np.sqrt(np.einsum("ij,ij->i", M, M))
    check_centred(r, var, K, scale)
    return M, var, r, mu_G


def _moments(ds: xr.Dataset, K: np.ndarray, M: np.ndarray, mu_G: np.ndarray, W: np.ndarray | None,
             sigma_w: np.ndarray | None, tile: int, head: np.ndarray | None = None) -> Delayed:
    """A dask task for M^T M (= |K| Sigma_B) with its eigenvalues ``lam`` and eigenvectors ``V``; with W, also
    W^T W, the row norms ``wn`` of W, the row products ``wm`` (w_c . m_c) and the column sums ``w_sum``; and the
    ``spectra`` of moments.py. Sigma_T's between-class part sum_c f_c (mu_c - mu)(mu_c - mu)^T (f_c = n_c/N
    over every class with a train token, mu = sum_c f_c mu_c) is sum_c f_c a_c a_c^T - delta delta^T with
    a_c = mu_c - mu_G and delta = mu - mu_G = sum_c f_c a_c, so the kept rows reuse M; the classes counted but not
    kept and the classifier rows outside K come in blocks of their own. One task per row block (O(tile d^2) each),
    then their sum and the eigendecompositions (O(d^3)); ``head`` where given is not summed again."""
    count, f, rest, A, delta = _outside(ds, K, M, mu_G)
    fK = f[K]
    kept = [dask.delayed(_block_moments)(M[s], fK[s], None if W is None else W[s]) for s in blocks(K.size, tile)]
    outside = [dask.delayed(_scatter)(A[s], f[rest][s]) for s in blocks(rest.size, tile)]
    if W is not None and K.size < count.size and head is None:  # the head's rows outside K, read in place
        W_all, out_K = ds["classifier"].values, np.ones(count.size, dtype=bool)
        out_K[K] = False
        outside += [dask.delayed(_head)(W_all[s], out_K[s]) for s in blocks(count.size, tile) if out_K[s].any()]
    return dask.delayed(_sum_moments)(kept, outside, sigma_w, delta, mu_G + delta, K.size, head)


def _outside(ds: xr.Dataset, K: np.ndarray, M: np.ndarray, mu_G: np.ndarray) -> tuple[np.ndarray, ...]:
    """The train counts, f_c = n_c / N, the classes counted but not kept, their rows a_c = mu_c - mu_G, and
    delta = sum_c f_c a_c (see :func:`_moments`)."""
    count = np.asarray(ds["count"].values)
    f = count / count.sum()
    outside = count > 0
    outside[K] = False
    rest = np.flatnonzero(outside)                                # counted, not kept (K sorted: no sort)
    A = _rows(ds["mean"], rest) - mu_G
    check_finite(A, "class means (counted but not kept)")
    return count, f, rest, A, f[K] @ M + f[rest] @ A


def _block_moments(m: np.ndarray, f: np.ndarray, w: np.ndarray | None) -> dict[str, np.ndarray]:
    mf = m * np.sqrt(f)[:, None]                                  # s^T s: numpy's symmetric product (syrk)
    out = {"MtM": m.T @ m, "MtFM": mf.T @ mf}
    if w is not None:
        out |= {"WtW": w.T @ w, "wn": np.sqrt(np.einsum("ij,ij->i", w, w)), "wm": np.einsum("ij,ij->i", w, m),
                "w_sum": w.sum(0)}
    return out


def _scatter(a: np.ndarray, f: np.ndarray) -> dict[str, np.ndarray]:
    af = a * np.sqrt(f)[:, None]
    return {"MtFM": af.T @ af}


def _head(w: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
    w = w[rows].astype(np.float64, copy=False)
    return {"head": w.T @ w}


def _sum_moments(parts: list[dict[str, np.ndarray]], outside: list[dict[str, np.ndarray]],
                 sigma_w: np.ndarray | None, delta: np.ndarray, mu: np.ndarray, n: int,
                 head: np.ndarray | None = None) -> dict[str, np.ndarray]:
    out = {k: np.concatenate([p[k] for p in parts]) if k in ("wn", "wm") else sum(p[k] for p in parts)
           for k in parts[0]}
    out["MtFM"] = out["MtFM"] + sum(p["MtFM"] for p in outside if "MtFM" in p)
    if "WtW" in out:
        out["head"] = out["WtW"] + sum(p["head"] for p in outside if "head" in p) if head is None else head
    return finish_moments(out, sigma_w, delta, mu, n)


def _rows(var: xr.DataArray, K: np.ndarray) -> np.ndarray:
    """The kept classes' rows of a (vocab, ...) variable as a new float64 array (np.take always copies, so the
    caller may write to it), read once: O(|V| d) memory."""
    return np.take(var.values, K, axis=0).astype(np.float64, copy=False)


# ---------------------------------------------------------------- the pairwise sums, tile by tile


def pair_sums(U: np.ndarray, r: np.ndarray, var: np.ndarray, p: np.ndarray, a: np.ndarray, t0: float,
              spans: list[slice], debias: tuple | None = None) -> Delayed:
    """A dask task for the sums over the pairs c < c' of the kept classes (``SUMS``: the coincident count; x^2, l,
    l^2; (v_c + v_c')/D, (v_c + v_c')/D^2 for the CDNV; and p_c p_c' (v_c + v_c')/D, p_c p_c' l), per class its
    CDNV sum over the others, and a few of the pairs whose directions coincide (:func:`~ncanalyze.analyzer.pairs.examples`).

    ``U`` holds the unit centred means, ``r`` their norms, ``var`` the class variances, ``p`` the token frequencies,
    ``a`` 1 where a class has a variance (2 or more train tokens; the CDNV terms read only pairs of such classes),
    else 0, ``debias`` the debiased CDNV's (v*, z, b) (side_of), and ``t0`` the mean of T over the pairs; one task per pair of row blocks i <= j of ``spans``. The graph is
    written as a plain dask graph (a dict of tasks): built through dask.delayed it took ~0.7 ms a task, a tenth of
    the whole run at K = 8,192, d = 256.
    """
    token = uuid.uuid4().hex
    data, out = f"unit-side-{token}", f"pair_sums-{token}"
    graph: dict = {data: (U, side_of(r, var, p, a, debias))}      # per class: u_c; side_of's rows
    pairs = [(i, j) for i in range(len(spans)) for j in range(i, len(spans))]
    for i, j in pairs:
        graph[(f"tile_sums-{token}", i, j)] = (_tile, data, spans[i], spans[j], t0)
    graph[out] = (_gather, [(f"tile_sums-{token}", i, j) for i, j in pairs], [(spans[i], spans[j]) for i, j in pairs],
                  len(U))
    return Delayed(out, graph)


def _tile(data: tuple[np.ndarray, np.ndarray], si: slice, sj: slice, t0: float):
    U, side = data
    found: list = []
    return (*tile_sums(U[si], side[:, si], U[sj], side[:, sj], t0, si == sj, found=found, offsets=(si.start, sj.start)),
            found)


def _gather(tiles: list, spans: list[tuple[slice, slice]], n: int) -> tuple[PairSums, np.ndarray, list]:
    """The tiles' sums added up, per class its sum of (var_c + var_c') / D over the other classes, and a few
    coincident pairs."""
    acc, row, found = np.zeros(len(SUMS)), np.zeros(n), []
    for (si, sj), (a, rows, cols, pairs) in zip(spans, tiles):
        acc += a
        row[si] += rows
        row[sj] += cols
        found += pairs
    return PairSums(*acc.tolist()), row, few(found)


def tile_sums(Ui: np.ndarray, side_i: np.ndarray, Uj: np.ndarray, side_j: np.ndarray, t0: float, diag: bool,
              panel_cells: int = PANEL_CELLS, found: list | None = None,
              offsets: tuple[int, int] = (0, 0)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One tile pair's sums (in ``SUMS`` order), row sums and column sums of (v + v')/D, over its pairs (on a
    diagonal tile, i < j only); ``side`` holds each class's r, 1/r, variance, token frequency p and a (see
    :func:`side_of`). The Gram goes
    in row panels of about ``panel_cells`` into one reused buffer; on a diagonal tile, each panel's Gram starts at
    its own first column. Where a panel holds coincident directions, a few of them go into ``found`` (as
    :func:`~ncanalyze.analyzer.pairs.examples`, indexed through ``offsets``), read from the same buffer.
    """
    acc, rows, cols = np.zeros(len(SUMS)), np.zeros(len(Ui)), np.zeros(len(Uj))
    step = max(1, min(panel_cells // len(Uj), len(Ui)))           # a buffer no larger than the block's Gram
    if diag:  # in (at least) 4 panels, whose Grams skip most of the lower triangle
        step = min(step, -(-len(Ui) // 4))
    buf = np.empty(step * len(Uj))
    for a in range(0, len(Ui), step):
        b, c0 = min(a + step, len(Ui)), (a if diag else 0)
        G = np.matmul(Ui[a:b], Uj[c0:].T, out=buf[:(b - a) * (len(Uj) - c0)].reshape(b - a, -1))
        before = acc[0]
        _pass(G, *side_i[:, a:b], *side_j[:, c0:], 2 / t0, diag, acc, rows[a:b], cols[c0:])
        if found is not None and acc[0] > before and sum(same for *_, same in found) < EXAMPLES:
            found[:] = few(found + block_hits(G, side_i[0, a:b], side_j[0, c0:], diag, (offsets[0] + a, offsets[1] + c0)))
    return acc, rows, cols


# ---------------------------------------------------------------- the fused pass (numba)
#
# Invariants of the pass; change none of them without re-running tests/analyzer/test_engine_numba.py and benchmarks/metrics.py.
# - fastmath is {"reassoc", "contract", "nsz"}: reassoc lets LLVM reorder the running sums so the loop vectorises;
#   contract allows fused multiply-adds; nsz ignores the sign of zero. "nnan" and "ninf" are excluded on purpose: a
#   coincident pair makes T ~ 0 and D = 0, and the resulting inf/nan must reach the sums, where the caller's
#   isfinite check and the coincident count catch them; with nnan/ninf LLVM may assume they never occur. "arcp" and
#   "afn" are excluded too: they would replace the one division and the log with approximations.
# - The log is musl's, on positive normal input only: y = T/t0 = x + 1 in (0, 4/t0]. A zero or subnormal y
#   (coincident directions) gives a wrong finite log, which is harmless only because such a pair is counted in
#   `coincident` (T < COINCIDENT), and any count above zero makes the metrics that read the logs inf or nan.
# - Coincident means (e = D/(r r') <= COINCIDENT) give +inf CDNV terms, by a select (the loop still vectorises);
#   their other terms are those of coincident directions.
# - Every term is float64. The order of the sums differs from a sequential loop's (reassociation, and the
#   tiles' own order), so results agree with reference_tile_sums to about 1e-13 relative, not bit for bit; they
#   are bit-reproducible for a given tile size and machine.

@intrinsic
def _bits(typingctx, x):
    """The bits of a float64 as an int64 (a bitcast, so loops around it still vectorise)."""
    return types.int64(types.float64), lambda context, builder, sig, args: builder.bitcast(args[0], ir.IntType(64))


@intrinsic
def _float(typingctx, i):
    """The float64 whose bits are this int64."""
    return types.float64(types.int64), lambda context, builder, sig, args: builder.bitcast(args[0], ir.DoubleType())


# musl's log (from FreeBSD's e_log.c): ln 2 in two parts and the minimax coefficients of its polynomial
LN2_HI, LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
LG1, LG2, LG3, LG4 = 6.666666666666735130e-01, 3.999999999940941908e-01, 2.857142874366239149e-01, 2.222219843214978396e-01
LG5, LG6, LG7 = 1.818357216161805012e-01, 1.531383769920937332e-01, 1.479819860511658591e-01
_SQRT_HALF_HI = 0x3FE6A09E00000000  # the high word of sqrt(1/2): the mantissa is reduced into [sqrt(1/2), sqrt(2))


@numba.njit(inline="always", error_model="numpy")
def _reduce(y: float) -> tuple[float, float]:
    """y = 2^k (1 + f) with 1 + f in [sqrt(1/2), sqrt(2)): (k, f), branch-free, for positive normal y."""
    ix = _bits(y) + (0x3FF0000000000000 - _SQRT_HALF_HI)
    k = float((ix >> 52) - 0x3FF)
    f = _float((ix & 0x000FFFFFFFFFFFFF) + _SQRT_HALF_HI) - 1.0  # no carry: the constant's low word is 0
    return k, f


@numba.njit(inline="always", error_model="numpy")
def _log_reduced(k: float, f: float, s: float) -> float:
    """log(2^k (1 + f)) given s = f / (2 + f) (musl's log, < 1 ulp)."""
    hfsq = 0.5 * f * f
    z = s * s
    t = z * (LG1 + z * (LG2 + z * (LG3 + z * (LG4 + z * (LG5 + z * (LG6 + z * LG7))))))  # Horner: fewest operations
    return s * (hfsq + t) + k * LN2_LO - hfsq + f + k * LN2_HI


@numba.njit(error_model="numpy", cache=True)
def vlog(y: np.ndarray) -> np.ndarray:
    """The natural log of positive normal values, as the pass computes it (for tests)."""
    out = np.empty_like(y)
    for i in range(y.size):
        k, f = _reduce(y[i])
        out[i] = _log_reduced(k, f, f / (2.0 + f))
    return out


@numba.njit(fastmath={"reassoc", "contract", "nsz"}, nogil=True, error_model="numpy", boundscheck=False,
            cache=True)
def _pass(G, ri, bi, vi, pi, ai, si, zi, fi, k1, k2, rj, bj, vj, pj, aj, sj, zj, fj, _k1, _k2, c, diag, acc, rows, cols):
    """Accumulate one Gram block's pair sums into acc (SUMS order), rows and cols (see tile_sums); on a diagonal
    block only the pairs j > i.

    x = T/t0 - 1 = (c - 1) - c g with c = 2/t0 (given ready-made: from t0, reassociation would turn it into a
    division per pair); e = r/r' + r'/r - 2g = D/(r r'), so with b = 1/r, 1/D = b b'/e and every CDNV sum is a
    weighted sum of 1/e and 1/e^2; the frequency-weighted sums take p_i p_j as two more multiply-adds a pair (p_j
    within the row, p_i once per row); the CDNV terms are multiplied by a_i a_j (a pair of classes that both have a
    variance: 1, else 0), and a coincident pair outside them is 0, not inf. The log shares that division:
    1/(e (2 + f)) gives both 1/e and musl's
    s = f/(2 + f). Reductions may be reordered (fastmath reassoc), which is what lets the loop vectorise; every
    term is float64. The debiased CDNV (pairs.py) reads D = e r r' and shares the same division (1/(e (2 + f) den)
    gives 1/(e (2 + f)) and 1/den, den = max(D - N, N) > 0 wherever e is), over the pairs of the fixed class set (f_i f_j = 1; s the unbiased variances, z the means' noise, k1 and k2 its second-order constants,
    the same in every column).
    """
    g_max = 1.0 - COINCIDENT / 2                                  # T = 2 - 2g < COINCIDENT
    col = np.zeros(G.shape[1])                                    # sum_i (v_i + v_j) / D_ij
    bad = xx = l1 = l2 = cdnv = p2 = cdnv_f = l_f = deb = unres = 0.0
    c1, c2 = (k1[0], k2[0]) if ri.size else (0.0, 0.0)
    for i in range(G.shape[0]):
        r_i, b_i, v_i, a_i, s_i, z_i, f_i = ri[i], bi[i], vi[i], ai[i], si[i], zi[i], fi[i]
        lo = i + 1 if diag else 0
        g_row, r_j, b_j, v_j, p_j, a_j, col_j = G[i, lo:], rj[lo:], bj[lo:], vj[lo:], pj[lo:], aj[lo:], col[lo:]
        s_j, z_j, f_j = sj[lo:], zj[lo:], fj[lo:]
        row = row2 = row_f = l_row = 0.0
        for j in range(g_row.size):
            g = g_row[j]
            bad += 1.0 if g > g_max else 0.0
            x = (c - 1.0) - c * g                                 # T/t0 - 1
            xx += x * x
            k, f = _reduce(x + 1.0)
            e = r_i * b_j[j] + b_i * r_j[j] - 2.0 * g             # D/(r r')
            rr = r_i * r_j[j]
            d = e * rr                                            # D
            nz = z_i + z_j[j]                                     # the two means' noise (0 outside the fixed set)
            den = max(d - nz, nz)                                 # the debiased CDNV's distance (D outside the set)
            ef = e * (2.0 + f)
            one = 1.0 / (ef * den)                                # the pass's one division
            inv = one * den                                       # 1 / (e (2 + f))
            l = _log_reduced(k, f, f * e * inv)                   # log(T/t0)
            l1 += l
            l2 += l * l
            l_row += p_j[j] * l
            both = a_i * a_j[j]                                   # 1 where both classes have a variance, else 0
            qb = inv * (2.0 + f) * b_j[j]                         # b'/e = r/D
            t = qb * (v_i + v_j[j]) * both                        # (v + v') r / D
            if e <= COINCIDENT:                                   # coincident means: +inf, as the reference says
                qb = t = np.inf if both > 0.0 else 0.0
            row += t
            row2 += t * qb                                        # (v + v') r^2 / D^2
            row_f += p_j[j] * t
            col_j[j] += t * b_i
            fixed = f_i * f_j[j] > 0.0
            q = nz * one * ef                                     # N / den
            resolved = d > 2.0 * nz
            second = max(1.0 - q * (c1 + c2 * q), 0.0) if resolved else 1.0   # 1 - V / den^2
            deb += ((s_i + s_j[j]) * one * ef * second if den > COINCIDENT * rr else np.inf) if fixed else 0.0
            unres += 1.0 if fixed and not resolved else 0.0
        rows[i] += b_i * row
        cdnv += b_i * row
        p2 += b_i * b_i * row2
        cdnv_f += pi[i] * b_i * row_f
        l_f += pi[i] * l_row
    cols += col
    acc += np.array([bad, xx, l1, l2, cdnv, p2, cdnv_f, l_f, deb, unres])
