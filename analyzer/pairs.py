"""The pairwise sums of the metrics, tile by tile: one Gram block per tile pair, then one fused pass over it.

Over the pairs c < c' of the kept classes, with g = u_c . u_c' (the Gram of the unit centred means), these are
the sums the metrics need (SPEC section 4):

- T = ||u_c - u_c'||^2 = 2 - 2g, shifted by t0 (T's mean over the pairs, from d-dimensional algebra) so that
  second moments stay exact: x = T/t0 - 1 (sum x^2: the spread of the cosines) and l = log(T/t0) (sums l, l^2:
  GNC2);
- D = ||mu_c - mu_c'||^2 = r r' (r/r' + r'/r - 2g), from the same g and the norms (the CDNV sums, over the pairs
  whose classes both have a variance, a_c a_c' = 1: a class seen once has none);
- the same CDNV and log terms weighted by w = p_c p_c', p_c the classes' token frequencies (nc1_cdnv_freq,
  gnc2_log_mean_freq);
- the count of pairs whose directions coincide (T below COINCIDENT), where those logs are meaningless (the
  metrics that read them are then inf or nan by definition; a few such pairs are kept to name in a warning). Two
  coincident means (D below COINCIDENT r r') make their CDNV terms +inf.

The Gram block is one BLAS call; everything after it is one numba loop over the block (a log, a reciprocal and
a few multiply-adds per pair), so the whole costs about one tiled Gram. No |K| x |K| array is ever formed.

Three implementations of one tile's sums, with the same result: :func:`reference_tile_sums`, plain numpy that
reads like the definitions above (O(tile^2) temporaries), :func:`tile_sums`, the fused pass that the metrics run on
the CPU, and :func:`torch_pair_sums`, the definitions in torch float64 on a device (a GPU). The tests hold the
others to the first, tile by tile, and the metrics of the last two to each other to 1e-12.
"""
from __future__ import annotations

import math
import uuid
from typing import NamedTuple

import numba
import numpy as np
from dask.delayed import Delayed
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

COINCIDENT = 1e-10  # T = ||u_c - u_c'||^2 below this: the two centred means point the same way (to float64)
PANEL_CELLS = 1 << 20  # Gram cells per BLAS call (8 MiB): few calls, and the block stays in cache for the pass
EXAMPLES = 3          # coincident pairs of each kind kept, to name in the warning


class PairSums(NamedTuple):
    """Sums over the pairs P = {c < c'} of the kept classes (x = T/t0 - 1, l = log(T/t0), D = ||mu_c - mu_c'||^2)."""
    coincident: float   # #{T < COINCIDENT}
    xx: float           # sum x^2
    l: float            # sum l
    ll: float           # sum l^2
    cdnv: float         # sum a a' (var_c + var_c') / D  (a_c = 1 where class c has a variance, else 0)
    cdnv_p2: float      # sum a a' (var_c + var_c') / D^2
    cdnv_freq: float    # sum a a' w (var_c + var_c') / D, w = p_c p_c'
    l_freq: float       # sum w l


SUMS = PairSums._fields


def blocks(n: int, tile: int) -> list[slice]:
    """The row blocks of ``tile`` classes that the tasks work on."""
    return [slice(a, min(a + tile, n)) for a in range(0, n, tile)]


def pair_sums(U: np.ndarray, r: np.ndarray, var: np.ndarray, p: np.ndarray, a: np.ndarray, t0: float,
              spans: list[slice]) -> Delayed:
    """A dask task for the sums over the pairs c < c' of the kept classes (``SUMS``: the coincident count; x^2, l,
    l^2; (v_c + v_c')/D, (v_c + v_c')/D^2 for the CDNV; and p_c p_c' (v_c + v_c')/D, p_c p_c' l), per class its
    CDNV sum over the others, and a few of the pairs whose directions coincide (:func:`examples`).

    ``U`` holds the unit centred means, ``r`` their norms, ``var`` the class variances, ``p`` the token frequencies,
    ``a`` 1 where a class has a variance (2 or more train tokens; the CDNV terms read only pairs of such classes),
    else 0, and ``t0`` the mean of T over the pairs; one task per pair of row blocks i <= j of ``spans``. The graph is
    written as a plain dask graph (a dict of tasks): built through dask.delayed it took ~0.7 ms a task, a tenth of
    the whole run at K = 8,192, d = 256.
    """
    token = uuid.uuid4().hex
    data, out = f"unit-side-{token}", f"pair_sums-{token}"
    graph: dict = {data: (U, side_of(r, var, p, a))}              # per class: u_c; r_c, 1/r_c, var_c, p_c, a_c
    pairs = [(i, j) for i in range(len(spans)) for j in range(i, len(spans))]
    for i, j in pairs:
        graph[(f"tile_sums-{token}", i, j)] = (_tile, data, spans[i], spans[j], t0)
    graph[out] = (_gather, [(f"tile_sums-{token}", i, j) for i, j in pairs], [(spans[i], spans[j]) for i, j in pairs],
                  len(U))
    return Delayed(out, graph)


def side_of(r: np.ndarray, var: np.ndarray, p: np.ndarray, a: np.ndarray | None = None) -> np.ndarray:
    """The per-class rows the passes read: r, 1/r, var, p and a (1 where the class has a variance, else 0; default
    every class) (5 x n)."""
    return np.stack([r, 1 / r, var, p, np.ones_like(r) if a is None else np.asarray(a, dtype=np.float64)])


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


def reference_tile_sums(Ui: np.ndarray, side_i: np.ndarray, Uj: np.ndarray, side_j: np.ndarray, t0: float,
                        diag: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`tile_sums` computes, written as the definitions in plain numpy (for tests and for reading). Also
    the meaning of coincident pairs: the CDNV terms of two coincident means (D below COINCIDENT r r', including
    0/0 for two zero variances) are +inf, and the logs of coincident directions are not used. The CDNV terms read
    only the pairs whose classes both have a variance (a a' = 1)."""
    (ri, _, vi, pi, ai), (rj, _, vj, pj, aj) = side_i, side_j
    g = Ui @ Uj.T                                                  # cos(m_c, m_c')
    T = 2 - 2 * g                                                  # ||u_c - u_c'||^2
    D = ri[:, None] ** 2 + rj[None, :] ** 2 - 2 * np.outer(ri, rj) * g   # ||m_c - m_c'||^2 = ||mu_c - mu_c'||^2
    pair = np.triu(np.ones(g.shape, dtype=bool), k=1) if diag else np.ones(g.shape, dtype=bool)
    same = D <= COINCIDENT * np.outer(ri, rj)                      # coincident means
    with np.errstate(divide="ignore", invalid="ignore"):        # a diagonal tile's c = c' cells, left out below
        q = np.where(same, np.inf, (vi[:, None] + vj[None, :]) / D)
        x, l = T / t0 - 1, np.log(T / t0)
        q2 = np.where(same, np.inf, q / D)
    w = np.outer(pi, pj)                                           # p_c p_c'
    both = np.outer(ai, aj) > 0                                    # both classes have a variance
    q, q2 = np.where(both, q, 0.0), np.where(both, q2, 0.0)
    sums = [np.sum(T[pair] < COINCIDENT), np.sum(x[pair] ** 2), np.sum(l[pair]), np.sum(l[pair] ** 2),
            np.sum(q[pair]), np.sum(q2[pair]), np.sum((w * q)[pair]), np.sum((w * l)[pair])]
    q = np.where(pair, q, 0.0)
    return np.array(sums, dtype=np.float64), q.sum(1), q.sum(0)


def examples(Ui: np.ndarray, side_i: np.ndarray, Uj: np.ndarray, side_j: np.ndarray, diag: bool,
             offsets: tuple[int, int] = (0, 0)) -> list[tuple[int, int, bool]]:
    """A few of a tile's pairs (i, j) whose directions coincide, with whether their means coincide too
    (:func:`few` of them, indexed like the kept classes through ``offsets``)."""
    return _hits(Ui @ Uj.T, side_i[0], side_j[0], diag, offsets)


def few(found: list[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    """The first EXAMPLES pairs with coincident means and the first EXAMPLES with only coincident directions (the
    warning names a few; a list of every such pair once took gigabytes at the embedding layer)."""
    found = sorted(found)
    return [f for f in found if f[2]][:EXAMPLES] + [f for f in found if not f[2]][:EXAMPLES]


def tile_sums(Ui: np.ndarray, side_i: np.ndarray, Uj: np.ndarray, side_j: np.ndarray, t0: float, diag: bool,
              panel_cells: int = PANEL_CELLS, found: list | None = None,
              offsets: tuple[int, int] = (0, 0)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One tile pair's sums (in ``SUMS`` order), row sums and column sums of (v + v')/D, over its pairs (on a
    diagonal tile, i < j only); ``side`` holds each class's r, 1/r, variance, token frequency p and a (see
    :func:`side_of`). The Gram goes
    in row panels of about ``panel_cells`` into one reused buffer; on a diagonal tile, each panel's Gram starts at
    its own first column. Where a panel holds coincident directions, a few of them go into ``found`` (as
    :func:`examples`, indexed through ``offsets``), read from the same buffer.
    """
    acc, rows, cols = np.zeros(len(SUMS)), np.zeros(len(Ui)), np.zeros(len(Uj))
    step = max(1, panel_cells // len(Uj))
    if diag:  # in (at least) 4 panels, whose Grams skip most of the lower triangle
        step = min(step, -(-len(Ui) // 4))
    buf = np.empty(step * len(Uj))
    for a in range(0, len(Ui), step):
        b, c0 = min(a + step, len(Ui)), (a if diag else 0)
        G = np.matmul(Ui[a:b], Uj[c0:].T, out=buf[:(b - a) * (len(Uj) - c0)].reshape(b - a, -1))
        before = acc[0]
        _pass(G, *side_i[:, a:b], *side_j[:, c0:], 2 / t0, diag, acc, rows[a:b], cols[c0:])
        if found is not None and acc[0] > before and sum(same for *_, same in found) < EXAMPLES:
            found[:] = few(found + _hits(G, side_i[0, a:b], side_j[0, c0:], diag, (offsets[0] + a, offsets[1] + c0)))
    return acc, rows, cols


def _hits(G: np.ndarray, ri: np.ndarray, rj: np.ndarray, diag: bool,
          offsets: tuple[int, int]) -> list[tuple[int, int, bool]]:
    """The pairs of a Gram block whose directions coincide (T = 2 - 2g < COINCIDENT; on a diagonal block j > i),
    with whether their means coincide (D <= COINCIDENT r r'), indexed through ``offsets``."""
    i, j = np.nonzero(G > 1 - COINCIDENT / 2)
    if diag:
        i, j = i[j > i], j[j > i]
    g, r1, r2 = G[i, j], ri[i], rj[j]
    same = r1 * r1 + r2 * r2 - 2 * r1 * r2 * g <= COINCIDENT * r1 * r2
    first = np.r_[np.flatnonzero(same)[:EXAMPLES], np.flatnonzero(~same)[:EXAMPLES]]   # row-major: the first ones
    return few(list(zip((i[first] + offsets[0]).tolist(), (j[first] + offsets[1]).tolist(), same[first].tolist())))


# ---------------------------------------------------------------- the fused pass (numba)
#
# Invariants of the pass; change none of them without re-running tests/analyzer/test_pairs.py and benchmarks/metrics.py.
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
def _pass(G, ri, bi, vi, pi, ai, rj, bj, vj, pj, aj, c, diag, acc, rows, cols):
    """Accumulate one Gram block's pair sums into acc (SUMS order), rows and cols (see tile_sums); on a diagonal
    block only the pairs j > i.

    x = T/t0 - 1 = (c - 1) - c g with c = 2/t0 (given ready-made: from t0, reassociation would turn it into a
    division per pair); e = r/r' + r'/r - 2g = D/(r r'), so with b = 1/r, 1/D = b b'/e and every CDNV sum is a
    weighted sum of 1/e and 1/e^2; the frequency-weighted sums take p_i p_j as two more multiply-adds a pair (p_j
    within the row, p_i once per row); the CDNV terms are multiplied by a_i a_j (a pair of classes that both have a
    variance: 1, else 0), and a coincident pair outside them is 0, not inf. The log shares that division:
    1/(e (2 + f)) gives both 1/e and musl's
    s = f/(2 + f). Reductions may be reordered (fastmath reassoc), which is what lets the loop vectorise; every
    term is float64.
    """
    g_max = 1.0 - COINCIDENT / 2                                  # T = 2 - 2g < COINCIDENT
    col = np.zeros(G.shape[1])                                    # sum_i (v_i + v_j) / D_ij
    bad = xx = l1 = l2 = cdnv = p2 = cdnv_f = l_f = 0.0
    for i in range(G.shape[0]):
        r_i, b_i, v_i, a_i = ri[i], bi[i], vi[i], ai[i]
        lo = i + 1 if diag else 0
        g_row, r_j, b_j, v_j, p_j, a_j, col_j = G[i, lo:], rj[lo:], bj[lo:], vj[lo:], pj[lo:], aj[lo:], col[lo:]
        row = row2 = row_f = l_row = 0.0
        for j in range(g_row.size):
            g = g_row[j]
            bad += 1.0 if g > g_max else 0.0
            x = (c - 1.0) - c * g                                 # T/t0 - 1
            xx += x * x
            k, f = _reduce(x + 1.0)
            e = r_i * b_j[j] + b_i * r_j[j] - 2.0 * g             # D/(r r')
            inv = 1.0 / (e * (2.0 + f))
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
        rows[i] += b_i * row
        cdnv += b_i * row
        p2 += b_i * b_i * row2
        cdnv_f += pi[i] * b_i * row_f
        l_f += pi[i] * l_row
    cols += col
    acc += np.array([bad, xx, l1, l2, cdnv, p2, cdnv_f, l_f])


# ---------------------------------------------------------------- the same sums in torch (any device)
#
# The definitions of reference_tile_sums as whole-array torch float64 operations on a device (a GPU, or the CPU for
# the tests): the upper triangle of the Gram in row panels [a, b) x [a, n), each split into its diagonal square (the
# pairs j > i) and the rectangle right of it (all pairs); each block is read a few times by products with per-class
# vectors rather than through a dozen elementwise temporaries (see _torch_block).

TORCH_CELLS = {"cuda": 1 << 25, "cpu": 1 << 20}  # Gram cells per panel (256 MiB, 8 MiB): ~3 temporaries each


def torch_pair_sums(U, side, t0: float, panel: int | None = None
                    ) -> tuple[PairSums, np.ndarray, list[tuple[int, int, bool]]]:
    """What :func:`pair_sums` computes, in torch float64 on the device that holds ``U``: the sums over the pairs,
    per class its CDNV sum over the others and a few coincident pairs (:func:`examples`, found on the host in the
    panels that hold any, from slices of the device's arrays).

    Parameters
    ----------
    U
        The unit centred means u_c, a float64 tensor (n x d) on the device.
    side
        :func:`side_of`'s rows r, 1/r, var, p as a float64 tensor (4 x n) on the same device.
    t0
        The mean of T over the pairs.
    panel
        Classes per row panel (default: ``TORCH_CELLS`` Gram cells over the number of classes).

    Returns
    -------
    tuple
        (PairSums, per-class CDNV sums, coincident pairs (i, j, means coincide)), on the host.
    """
    import torch

    n, dev = len(U), U.device
    acc = torch.zeros(len(SUMS) + 1, dtype=torch.float64, device=dev)     # SUMS and the count of coincident means
    row = torch.zeros(n, dtype=torch.float64, device=dev)
    step = panel or max(1, TORCH_CELLS.get(dev.type, TORCH_CELLS["cuda"]) // n)
    hits = []
    for a in range(0, n, step):
        b = min(a + step, n)
        for c0, c1, diag in ((a, b, True), (b, n, False)):
            if c1 > c0:
                sums, rows, cols = _torch_block(U[a:b], side[:, a:b], U[c0:c1], side[:, c0:c1], t0, diag)
                acc += sums
                row[a:b] += rows
                row[c0:c1] += cols
                hits.append((sums[0], a, b, c0, c1, diag))
    acc = acc.cpu().numpy()
    found = []
    if acc[0]:
        counts = torch.stack([h[0] for h in hits]).cpu().numpy()
        want = min(EXAMPLES, acc[-1]) + min(EXAMPLES, acc[0] - acc[-1])   # of each kind, as many as there are
        host = lambda x: x.cpu().numpy()                                  # noqa: E731
        for count, (_, a, b, c0, c1, diag) in zip(counts, hits):
            if diag and len(found) >= want:                        # a new row panel: the first pairs are found
                break
            if count:
                found = few(found + examples(host(U[a:b]), host(side[:, a:b]), host(U[c0:c1]), host(side[:, c0:c1]),
                                             diag, (a, c0)))
    return PairSums(*acc[:len(SUMS)].tolist()), row.cpu().numpy(), found


def _torch_block(Ui, Si, Uj, Sj, t0: float, diag: bool):
    """One block's sums (SUMS order, then the count of coincident means), row and column sums of (v + v')/D: the
    definitions of :func:`reference_tile_sums` (on a ``diag`` block, the pairs j > i only), arranged so that the
    block is read about a dozen times rather than forming a dozen temporaries (a GPU's time here is memory traffic).

    As in the numba pass, e = D/(r r') = r/r' + r'/r - 2g (one rank-2 update of the Gram) and, with b = 1/r and
    h = 1/e, (v + v')/D = (v + v') b b' h: every CDNV sum is a product of h (or h^2) with a few per-class vectors,
    one pass over the block per side. A row or column holding coincident means (e <= COINCIDENT) is +inf, and so is
    every CDNV sum of such a block, as the reference says; the CDNV terms read only the pairs whose classes both have
    a variance (b and b' multiplied by a and a', and a coincident pair outside them is 0).
    x = T/t0 - 1 = (c - 1) - c g (c = 2/t0, in g's place),
    l = log1p(x); the logs of coincident directions (-inf or nan) are not used (the metrics are inf or nan there).
    """
    import torch

    (ri, bi, vi, pi, ai), (rj, bj, vj, pj, aj) = Si, Sj
    g = Ui @ Uj.T                                                  # cos(m_c, m_c')
    e = torch.addmm(g, torch.stack([ri, bi], 1), torch.stack([bj, rj]), beta=-2)   # D/(r r')
    bad, same = g > 1 - COINCIDENT / 2, e <= COINCIDENT            # T < COINCIDENT; coincident means
    h = e.reciprocal_()                                            # r r'/D
    h.masked_fill_(same, 0.0)                                      # their CDNV terms are inf (below) or left out
    if diag:                                                       # c = c' and the lower triangle: no pairs
        off = torch.ones_like(same).tril_()
        bad.masked_fill_(off, False)
        same.masked_fill_(off, False)
        h.masked_fill_(off, 0.0)
    inside = same & (ai[:, None] * aj[None, :] > 0)               # coincident means whose CDNV terms count: +inf
    bj, bi = bj * aj, bi * ai                                      # a_c a_c': the CDNV terms of classes with a variance
    hr = h @ torch.stack([bj, bj * vj, bj * pj, bj * vj * pj]).T  # per row: sum_j h b', h b' v', h b' p', h b' v' p'
    hc = torch.stack([bi, bi * vi]) @ h                            # per column: sum_i h b, h b v
    h.square_()
    h2 = h @ torch.stack([bj * bj, bj * bj * vj]).T              # (k, n) stacks, transposed: BLAS's fast layout
    inf = torch.tensor(math.inf, dtype=g.dtype, device=g.device)
    rows = torch.where(inside.any(1), inf, bi * (vi * hr[:, 0] + hr[:, 1]))    # sum_j (v + v') / D
    cols = torch.where(inside.any(0), inf, bj * (hc[1] + vj * hc[0]))
    n_same, n_inside = same.sum().to(g.dtype), inside.sum()
    cdnv_p2, cdnv_freq = (torch.where(n_inside > 0, inf, t) for t in ((bi * bi * (vi * h2[:, 0] + h2[:, 1])).sum(),
                                                                      pi @ (bi * (vi * hr[:, 2] + hr[:, 3]))))
    x = g.addmm_(torch.ones_like(ri)[:, None], torch.full_like(rj, 2 / t0 - 1)[None], beta=-2 / t0)  # T/t0 - 1
    if diag:
        x.masked_fill_(off, 0.0)
    xx = torch.dot(x.view(-1), x.view(-1))
    l = x.log1p_()                                                 # log(T/t0)
    lr = l @ torch.stack([torch.ones_like(pj), pj]).T
    sums = torch.stack([bad.sum().to(g.dtype), xx, lr[:, 0].sum(), torch.dot(l.view(-1), l.view(-1)), rows.sum(),
                        cdnv_p2, cdnv_freq, pi @ lr[:, 1], n_same])
    return sums, rows, cols
