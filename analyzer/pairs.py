"""The pairwise sums of the metrics: what they are, for both engines (engine_numba.py, engine_torch.py).

Over the pairs c < c' of the kept classes, with g = u_c . u_c' (the Gram of the unit centred means), these are
the sums the metrics need (SPEC section 4):

- T = ||u_c - u_c'||^2 = 2 - 2g, shifted by t0 (T's mean over the pairs, from d-dimensional algebra) so that
  second moments stay exact: x = T/t0 - 1 (sum x^2: the spread of the cosines) and l = log(T/t0) (sums l, l^2:
  GNC2);
- D = ||mu_c - mu_c'||^2 = r r' (r/r' + r'/r - 2g), from the same g and the norms (the CDNV sums, over the pairs
  whose classes both have a variance, a_c a_c' = 1: a class seen once has none);
- the same CDNV and log terms weighted by w = p_c p_c', p_c the classes' token frequencies (nc1_cdnv_freq,
  gnc2_log_mean_freq);
- the debiased CDNV (nc1_cdnv_debiased) over the pairs of the fixed class set (b_c b_c' = 1): with the unbiased
  variances v*_c = var_c n_c/(n_c - 1) and each mean's noise z_c = v*_c / n_c (E||mu^_c - mu_c||^2), the term
  (v*_c + v*_c') / D* (1 - V / D*^2), D* = D - z_c - z_c': the squared distance less the two means' noise, with
  the second-order (delta-method) term of 1/D*, V = k1 D* N + k2 N^2 (N = z_c + z_c') the variance of the sample
  distance under Gaussian noise whose covariance has the pooled within-class shape (k1 = 4/d, k2 = 2/d_eff, d_eff =
  tr(Sigma_W)^2 / tr(Sigma_W^2)), the factor floored at 0. Where the corrected distance is not clearly positive
  (D below twice the noise: the pair is not resolved by the sample) the term is (v*_c + v*_c') / N, the noise taken
  as the distance; such pairs are counted in ``unresolved``; finite even for coincident means, except two without any
  variance (den below COINCIDENT r r': +inf, as the plug-in);
- the count of pairs whose directions coincide (T below COINCIDENT), where those logs are meaningless (the
  metrics that read them are then inf or nan by definition; a few such pairs are kept to name in a warning). Two
  coincident means (D below COINCIDENT r r') make their CDNV terms +inf.

No |K| x |K| array is ever formed: the engines work tile by tile. Here are the definitions they share:
:func:`reference_tile_sums`, one tile's sums in plain numpy that reads like the definitions above (O(tile^2)
temporaries; the tests hold both engines to it, tile by tile, and the metrics of the two engines to each other to
1e-12), the per-class rows the engines read (:func:`side_of`) and the few coincident pairs a warning names.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

COINCIDENT = 1e-10  # T = ||u_c - u_c'||^2 below this: the two centred means point the same way (to float64)
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
    cdnv_deb: float     # sum b b' (v*_c + v*_c') / max(D - z_c - z_c', z_c + z_c')  (b_c = 1 in the fixed class set)
    unresolved: float   # #{b b' = 1 and D <= 2 (z_c + z_c')}: pairs whose corrected distance is floored


SUMS = PairSums._fields


def blocks(n: int, tile: int) -> list[slice]:
    """The row blocks of ``tile`` classes that the tasks work on."""
    return [slice(a, min(a + tile, n)) for a in range(0, n, tile)]


def subset_sums(M, has_var: np.ndarray, debias: tuple | None, to=np.asarray):
    """The sums of the centred means m_c over the classes with a variance and over the fixed class set (2 x d; the
    pooled CDNVs' ||sum_S m_c||^2); ``M`` numpy or torch, ``to`` makes its kind of array from numpy."""
    b = np.zeros(len(has_var)) if debias is None else np.broadcast_to(np.asarray(debias[2], dtype=np.float64),
                                                                        has_var.shape)
    return to(np.stack([np.asarray(has_var, dtype=np.float64), b])) @ M


def side_of(r: np.ndarray, var: np.ndarray, p: np.ndarray, a: np.ndarray | None = None,
            debias: tuple | None = None) -> np.ndarray:
    """The per-class rows the passes read: r, 1/r, var, p, a (1 where the class has a variance, else 0; default
    every class), then the debiased CDNV's v* (unbiased variance), z (its mean's noise v*/n), b (1 in the fixed
    class set, else 0) and its second-order constants k1, k2 (the same in every column); ``debias`` (v*, z, b, k1,
    k2), default none in the set (10 x n). Outside the set v* and z are 0."""
    a = np.ones_like(r) if a is None else np.asarray(a, dtype=np.float64)
    vs, z, b, k1, k2 = (0.0,) * 5 if debias is None else debias
    b = np.broadcast_to(np.asarray(b, dtype=np.float64), r.shape)
    return np.stack([r, 1 / r, var, p, a, np.where(b > 0, vs, 0.0), np.where(b > 0, z, 0.0), b,
                     np.full_like(r, k1), np.full_like(r, k2)])


def reference_tile_sums(Ui: np.ndarray, side_i: np.ndarray, Uj: np.ndarray, side_j: np.ndarray, t0: float,
                        diag: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`tile_sums` computes, written as the definitions in plain numpy (for tests and for reading). Also
    the meaning of coincident pairs: the CDNV terms of two coincident means (D below COINCIDENT r r', including
    0/0 for two zero variances) are +inf, and the logs of coincident directions are not used. The CDNV terms read
    only the pairs whose classes both have a variance (a a' = 1)."""
    (ri, _, vi, pi, ai, si, zi, bi, k1, k2), (rj, _, vj, pj, aj, sj, zj, bj, _, _) = side_i, side_j
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
    noise = zi[:, None] + zj[None, :]                              # z_c + z_c'
    fixed = (np.outer(bi, bj) > 0) & pair                          # pairs of the fixed class set
    den = np.maximum(D - noise, noise)                             # ~0 only for coincident means without variance
    with np.errstate(divide="ignore", invalid="ignore"):
        h = noise / den                                            # 1 - V / den^2 = 1 - h (k1 + k2 h)
        second = np.where(D > 2 * noise, np.maximum(1 - h * (k1[0] + k2[0] * h), 0), 1)
        qd = np.where(den > COINCIDENT * np.outer(ri, rj), (si[:, None] + sj[None, :]) / den * second, np.inf)
    sums = [np.sum(T[pair] < COINCIDENT), np.sum(x[pair] ** 2), np.sum(l[pair]), np.sum(l[pair] ** 2),
            np.sum(q[pair]), np.sum(q2[pair]), np.sum((w * q)[pair]), np.sum((w * l)[pair]), np.sum(qd[fixed]),
            np.sum(~(D[fixed] > 2 * noise[fixed]))]
    q = np.where(pair, q, 0.0)
    return np.array(sums, dtype=np.float64), q.sum(1), q.sum(0)


def examples(Ui: np.ndarray, side_i: np.ndarray, Uj: np.ndarray, side_j: np.ndarray, diag: bool,
             offsets: tuple[int, int] = (0, 0)) -> list[tuple[int, int, bool]]:
    """A few of a tile's pairs (i, j) whose directions coincide, with whether their means coincide too
    (:func:`few` of them, indexed like the kept classes through ``offsets``)."""
    return block_hits(Ui @ Uj.T, side_i[0], side_j[0], diag, offsets)


def few(found: list[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    """The first EXAMPLES pairs with coincident means and the first EXAMPLES with only coincident directions (the
    warning names a few; a list of every such pair once took gigabytes at the embedding layer)."""
    found = sorted(found)
    return [f for f in found if f[2]][:EXAMPLES] + [f for f in found if not f[2]][:EXAMPLES]


def block_hits(G: np.ndarray, ri: np.ndarray, rj: np.ndarray, diag: bool,
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


# ---------------------------------------------------------------- control sums (the jackknife's sampled pairs)
#
# With c = 2/t0, x = T/t0 - 1 = (c - 1) - c g is linear in g, so the sums over pairs of x, x^2 and p p' x follow
# from d-dimensional algebra (sum g: the sets' sums of u dotted; sum g^2 = ||U^T U||_F^2 over every pair), over
# every pair or over a block: jackknife.py samples the logs' change less these controls' (log(1 + x) - x + x^2/2 is
# ~x^3/3), whose totals it knows exactly.

CONTROLS = ("x", "xx", "px")  # sum x, x^2, p p' x


def control_block(Ua, pa, Ub, pb, t0: float, xx: float) -> list[float]:
    """The :data:`CONTROLS` over every pair of the rows of ``Ua`` with those of ``Ub`` (two disjoint sets of unit
    centred means, numpy or torch; ``pa``, ``pb`` their token frequencies), ``xx`` the pass's own sum of x^2 over
    them (the block's Gram is not formed again)."""
    c = 2 / t0
    g, pg = float(Ua.sum(0) @ Ub.sum(0)), float((pa @ Ua) @ (pb @ Ub))
    return [(c - 1) * len(Ua) * len(Ub) - c * g, xx, (c - 1) * float(pa.sum() * pb.sum()) - c * pg]


def control_totals(U, p, t0: float) -> list[float]:
    """The :data:`CONTROLS` over the pairs c < c' of all the rows of ``U``: half the sums over every ordered pair
    less the n diagonal ones (g = 1, x = -1); sum g^2 over every ordered pair is ||U^T U||_F^2."""
    c, n, pp = 2 / t0, len(U), float((p * p).sum())
    s, ps, gram = U.sum(0), p @ U, U.T @ U
    g, pg, gg = float(s @ s), float(ps @ ps), float((gram * gram).sum())
    both = [(c - 1) * n * n - c * g, (c - 1) ** 2 * n * n - 2 * c * (c - 1) * g + c * c * gg,
            (c - 1) * float(p.sum()) ** 2 - c * pg]
    return [(both[0] + n) / 2, (both[1] - n) / 2, (both[2] + pp) / 2]
