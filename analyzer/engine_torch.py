"""The torch engine: the kept classes' geometry in torch float64 on a device (a GPU; the CPU in the tests), what
engine_numba.py computes on the host, with the O(|V| d) work done where the Gram runs: the pairwise sums
(:func:`torch_pair_sums`) and the d x d spectra (:class:`TorchLinalg`). engines.py chooses this engine or the
host's.

Each (vocab, hidden) array (the class means, the classifier) is read once from the dataset, moved once (in its
stored dtype) and made float64 there; the kept rows are gathered, centred and normalised on the device, the d x d
moments and the pairwise sums read them in place, and only vectors of length |K| or d (r, u_c . s, the duality
terms, the per-class CDNV sums) and d x d matrices come back to the host, where metrics.py keeps its numpy
semantics. Peak device memory: about three |V| x d float64 arrays (the classifier's step) and one Gram panel's few
temporaries.
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch
import xarray as xr

from ncanalyze.analyzer.moments import check_centred, finish_moments, pair_mean
from ncanalyze.analyzer.pairs import (
    COINCIDENT,
    CONTROLS,
    EXAMPLES,
    SUMS,
    PairSums,
    control_block,
    control_totals,
    examples,
    few,
    side_of,
    subset_sums,
)
from ncanalyze.core.errors import UserError

HEAD_ROWS = 1 << 14  # classifier rows outside K made float64 at a time


def device_parts(ds: xr.Dataset, K: np.ndarray, p: np.ndarray, has_var: np.ndarray, sigma_w: np.ndarray | None,
                 device: str, panel: int | None = None, debias: tuple | None = None, sample: list | None = None,
                 all_pairs: bool = True, head: np.ndarray | None = None) -> dict[str, Any]:
    """The Geometry's fields that read the class means and the classifier, computed in torch float64 on ``device``.

    Parameters
    ----------
    ds
        One checkpoint's statistics (``count``, ``mean``, ``variance``; ``classifier`` where present).
    K
        The kept classes (geometry.kept_classes).
    p
        Their token frequencies within K.
    has_var
        Per kept class, whether it has a variance (n_c >= 2: the classes the CDNV family reads).
    sigma_w
        The within-class covariance, or None.
    device
        A torch device (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
    panel
        Classes per row panel of the pairwise sums (default: TORCH_CELLS Gram cells over |K|).
    debias
        The debiased CDNV's per-class rows (v*, z, b; pairs.side_of), or None.
    sample
        Blocks of sampled pairs, each two disjoint arrays of indices into K (every pair of one with the other), or
        None: their pair sums come back as ``sample_sums`` (blocks x SUMS).
    all_pairs
        Whether to sum over every pair (False: ``pairs`` and ``row_cdnv`` are None, for the jackknife's
        replicates, whose pairs are sampled).
    head
        W^T W over the whole vocabulary where known (a jackknife replicate's: its point value's), not summed again.

    Returns
    -------
    dict
        Host numpy values: ``var``, ``r``, ``s``, ``t0``, ``us`` (u_c . s), ``m_sum``, ``pairs``, ``row_cdnv``,
        ``coincident`` and ``mom`` (geometry.finish_moments' dict: M^T M, its eigen-decomposition, the spectra;
        with the classifier W^T W, ``wn``, ``wm``, ``w_sum``).
    """
    dev = torch.device(device)
    count = np.asarray(ds["count"].values)
    f = count / count.sum()                                       # f_c = n_c / N over every class
    rest = np.setdiff1d(np.flatnonzero(count > 0), K)             # counted, not kept
    M, A = _gathered(ds["mean"], (K, rest), dev)
    scale = float(torch.linalg.vector_norm(M, dim=1).max())
    mu_G = M.mean(0)
    M -= mu_G                                                     # m_c = mu_c - mu_G
    A -= mu_G
    r = torch.linalg.vector_norm(M, dim=1)
    var = np.asarray(ds["variance"].values)[K].astype(np.float64)
    r_host = r.cpu().numpy()
    check_centred(r_host, var, K, scale)
    if not bool(torch.isfinite(A).all()):
        raise UserError("the means of the classes counted but not kept contain NaN or Inf: the statistics are "
                        "corrupt; extract again")
    mom = _moments(M, A, torch.as_tensor(f[K], device=dev), torch.as_tensor(f[rest], device=dev))
    del A
    if "classifier" in ds:
        mom |= _classifier_moments(ds["classifier"], K, M, dev, head)
    out = {"var": var, "r": r_host, "m_sum": M.sum(0).cpu().numpy(),
           "m_sums": subset_sums(M, has_var, debias, lambda a: torch.as_tensor(a, device=dev)).cpu().numpy()}
    U = M.div_(r[:, None])                                        # u_c = m_c / r_c, in M's place: M is done
    del M
    s = U.sum(0)
    out["s"] = s.cpu().numpy()
    out["t0"] = pair_mean(out["s"], K.size)
    side = torch.as_tensor(side_of(r_host, var, p, has_var, debias), device=dev)
    out["pairs"], out["row_cdnv"], out["coincident"] = (torch_pair_sums(U, side, out["t0"], panel) if all_pairs
                                                         else (None, None, []))
    if sample is not None:
        out["sample_sums"] = np.stack([_sample_block(U, side, out["t0"], a, b) for a, b in sample])
        out["controls"] = control_totals(U, side[3], out["t0"])
    out["us"] = (U @ s).cpu().numpy()
    delta = mom.pop("delta")
    mu = (mu_G + delta).cpu().numpy()
    mom = {k: v.cpu().numpy() for k, v in mom.items()}
    out["mom"] = finish_moments(mom, sigma_w, delta.cpu().numpy(), mu, K.size, TorchLinalg(device))
    return out


def _sample_block(U, side, t0: float, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The pair sums (``SUMS``, then pairs.CONTROLS) over every pair of class ``a_k`` with class ``b_l`` (two
    disjoint index sets)."""
    if not (len(a) and len(b)):
        return np.zeros(len(SUMS) + len(CONTROLS))
    a, b = (torch.as_tensor(i, device=U.device) for i in (a, b))
    sums = _torch_block(U[a], side[:, a], U[b], side[:, b], t0, False)[0][:len(SUMS)].cpu().numpy()
    return np.r_[sums, control_block(U[a], side[3, a], U[b], side[3, b], t0, sums[1])]


def _gathered(var: xr.DataArray, rows: tuple[np.ndarray, ...], dev: torch.device) -> list[torch.Tensor]:
    """The given rows of a (vocab, hidden) variable as new float64 tensors on ``dev``: the array read once and moved
    once in its stored dtype, each set of rows gathered there (a copy) and made float64."""
    full = _moved(var.values, dev)
    out = [full[torch.as_tensor(i, device=dev)].to(torch.float64) for i in rows]
    del full
    return out


def _moved(x: np.ndarray, dev: torch.device) -> torch.Tensor:
    """A host array on ``dev`` (shared, not copied, on the CPU: read it, never write to it)."""
    with warnings.catch_warnings():                               # a read-only store array: torch only reads it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.as_tensor(np.asarray(x), device=dev)


def _moments(M: torch.Tensor, A: torch.Tensor, fK: torch.Tensor, fA: torch.Tensor) -> dict[str, torch.Tensor]:
    """M^T M, sum_c f_c a_c a_c^T over every counted class (``MtFM``: the kept rows M, the others A) and
    delta = sum_c f_c a_c (see engine_numba._moments)."""
    mf, af = M * fK.sqrt()[:, None], A * fA.sqrt()[:, None]
    return {"MtM": M.T @ M, "MtFM": mf.T @ mf + af.T @ af, "delta": fK @ M + fA @ A}


def _classifier_moments(var: xr.DataArray, K: np.ndarray, M: torch.Tensor, dev: torch.device,
                        head: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """W^T W over K, the row norms ``wn``, the row products ``wm`` (w_c . m_c), the column sums ``w_sum`` and
    ``head``, W^T W over the whole vocabulary: the classifier moved once in its stored dtype, its rows made float64
    on the device (those outside K in blocks of HEAD_ROWS; ``head`` where given is used as it is)."""
    full = _moved(var.values, dev)
    W = full[torch.as_tensor(K, device=dev)].to(torch.float64)
    out = {"WtW": W.T @ W, "wn": torch.linalg.vector_norm(W, dim=1), "wm": torch.einsum("ij,ij->i", W, M),
           "w_sum": W.sum(0)}
    del W
    if head is not None:
        return out | {"head": torch.as_tensor(head, device=dev)}
    outside = torch.ones(len(full), dtype=torch.bool, device=dev)
    outside[torch.as_tensor(K, device=dev)] = False
    head = out["WtW"].clone()
    for a in range(0, len(full), HEAD_ROWS):
        w = full[a:a + HEAD_ROWS][outside[a:a + HEAD_ROWS]].to(torch.float64)
        if len(w):
            head += w.T @ w
    return out | {"head": head}


# ---------------------------------------------------------------- the pairwise sums in torch (any device)
#
# The definitions of pairs.reference_tile_sums as whole-array torch float64 operations on a device (a GPU, or the CPU for
# the tests): the upper triangle of the Gram in row panels [a, b) x [a, n), each split into its diagonal square (the
# pairs j > i) and the rectangle right of it (all pairs); each block is read a few times by products with per-class
# vectors rather than through a dozen elementwise temporaries (see _torch_block).

TORCH_CELLS = {"cuda": 1 << 25, "cpu": 1 << 20}  # Gram cells per panel (256 MiB, 8 MiB): ~3 temporaries each


def torch_pair_sums(U, side, t0: float, panel: int | None = None
                    ) -> tuple[PairSums, np.ndarray, list[tuple[int, int, bool]]]:
    """What engine_numba.pair_sums computes, in torch float64 on the device that holds ``U``: the sums over the pairs,
    per class its CDNV sum over the others and a few coincident pairs (pairs.examples, found on the host in the
    panels that hold any, from slices of the device's arrays).

    Parameters
    ----------
    U
        The unit centred means u_c, a float64 tensor (n x d) on the device.
    side
        pairs.side_of's rows as a float64 tensor (8 x n) on the same device.
    t0
        The mean of T over the pairs.
    panel
        Classes per row panel (default: ``TORCH_CELLS`` Gram cells over the number of classes).

    Returns
    -------
    tuple
        (PairSums, per-class CDNV sums, coincident pairs (i, j, means coincide)), on the host.
    """
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
    (ri, bi, vi, pi, ai), (rj, bj, vj, pj, aj) = Si[:5], Sj[:5]
    g = Ui @ Uj.T                                                  # cos(m_c, m_c')
    e = torch.addmm(g, torch.stack([ri, bi], 1), torch.stack([bj, rj]), beta=-2)   # D/(r r')
    deb, unres = _debiased_block(e, Si, Sj, diag)
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
                        cdnv_p2, cdnv_freq, pi @ lr[:, 1], deb, unres, n_same])
    return sums, rows, cols


def _debiased_block(e, Si, Sj, diag: bool):
    """One block's debiased CDNV sum and its count of unresolved pairs (pairs.reference_tile_sums): over the pairs
    of the fixed class set (f f' = 1), (v* + v*') / max(D - z - z', z + z') with its second-order factor where
    resolved, D = e r r'; +inf where the denominator is below COINCIDENT r r'."""
    (ri, _, _, _, _, si, zi, fi, k1, k2), (rj, _, _, _, _, sj, zj, fj, _, _) = Si, Sj
    fixed = (fi[:, None] * fj[None, :]) > 0
    if diag:
        fixed.triu_(1)
    D = e * ri[:, None] * rj[None, :]
    noise = zi[:, None] + zj[None, :]
    den = torch.maximum(D - noise, noise)
    resolved = D > 2 * noise
    unres = (fixed & ~resolved).sum().to(e.dtype)
    num = torch.where(fixed, si[:, None] + sj[None, :], 0.0)
    tiny = den <= COINCIDENT * ri[:, None] * rj[None, :]             # coincident means without variance: +inf
    inv = torch.where(tiny, 1.0, den).reciprocal()
    q = noise * inv                                                # N / den: scale-free (no square of a distance)
    second = torch.where(resolved, (1 - q * (k1[0] + k2[0] * q)).clamp(min=0), 1.0)
    q = torch.where(fixed & tiny, math.inf, num * inv * second)
    return q.sum(), unres


# ---------------------------------------------------------------- the d x d linear algebra in torch

class TorchLinalg:
    """numpy.linalg's eigh, eigvalsh and cholesky (and a lower-triangular solve) in torch float64 on a device:
    numpy in, numpy out."""

    def __init__(self, device: str):
        import torch

        self.torch, self.device = torch, torch.device(device)

    def _on(self, a: np.ndarray) :
        return self.torch.as_tensor(np.asarray(a, dtype=np.float64), device=self.device)

    def eigh(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lam, V = self.torch.linalg.eigh(self._on(a))
        return lam.cpu().numpy(), V.cpu().numpy()

    def eigvalsh(self, a: np.ndarray) -> np.ndarray:
        return self.torch.linalg.eigvalsh(self._on(a)).cpu().numpy()

    def cholesky(self, a: np.ndarray) -> np.ndarray:
        L, info = self.torch.linalg.cholesky_ex(self._on(a))
        if int(info):
            raise np.linalg.LinAlgError("not positive definite")
        return L.cpu().numpy()

    def quad(self, S: np.ndarray, V: np.ndarray) -> np.ndarray:
        """v_i^T S v_i for the columns v_i of V."""
        V = self._on(V)
        return (V * (self._on(S) @ V)).sum(0).cpu().numpy()

    def solve_lower(self, L: np.ndarray, B: np.ndarray) -> np.ndarray:
        return self.torch.linalg.solve_triangular(self._on(L), self._on(B), upper=False).cpu().numpy()
