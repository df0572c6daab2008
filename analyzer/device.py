"""The kept classes' geometry in torch float64 on a device (a GPU; the CPU in the tests): what geometry.py's host path
computes, with the O(|V| d) work done where the Gram runs.

Each (vocab, hidden) array (the class means, the classifier) is read once from the dataset, moved once (in its
stored dtype) and made float64 there; the kept rows are gathered, centred and normalised on the device, the d x d
moments and the pairwise sums (pairs.torch_pair_sums) read them in place, and only vectors of length |K| or d (r,
u_c . s, the duality terms, the per-class CDNV sums) and d x d matrices come back to the host, where metrics.py
keeps its numpy semantics. Peak device memory: about three |V| x d float64 arrays (the classifier's step) and
one Gram panel's few temporaries.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
import xarray as xr

from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.moments import check_centred, finish_moments, pair_mean
from ncanalyze.analyzer.pairs import side_of, torch_pair_sums

__all__ = ["device_parts"]
HEAD_ROWS = 1 << 14  # classifier rows outside K made float64 at a time


def device_parts(ds: xr.Dataset, K: np.ndarray, p: np.ndarray, has_var: np.ndarray, sigma_w: np.ndarray | None,
                 device: str, panel: int | None = None) -> dict[str, Any]:
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
        Classes per row panel of the pairwise sums (default: pairs.TORCH_CELLS Gram cells over |K|).

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
        mom |= _classifier_moments(ds["classifier"], K, M, dev)
    out = {"var": var, "r": r_host, "m_sum": M.sum(0).cpu().numpy()}
    U = M.div_(r[:, None])                                        # u_c = m_c / r_c, in M's place: M is done
    del M
    s = U.sum(0)
    out["s"] = s.cpu().numpy()
    out["t0"] = pair_mean(out["s"], K.size)
    side = torch.as_tensor(side_of(r_host, var, p, has_var), device=dev)
    out["pairs"], out["row_cdnv"], out["coincident"] = torch_pair_sums(U, side, out["t0"], panel)
    out["us"] = (U @ s).cpu().numpy()
    delta = mom.pop("delta")
    mu = (mu_G + delta).cpu().numpy()
    mom = {k: v.cpu().numpy() for k, v in mom.items()}
    out["mom"] = finish_moments(mom, sigma_w, delta.cpu().numpy(), mu, K.size, device)
    return out


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
    delta = sum_c f_c a_c (see geometry._moments)."""
    mf, af = M * fK.sqrt()[:, None], A * fA.sqrt()[:, None]
    return {"MtM": M.T @ M, "MtFM": mf.T @ mf + af.T @ af, "delta": fK @ M + fA @ A}


def _classifier_moments(var: xr.DataArray, K: np.ndarray, M: torch.Tensor,
                        dev: torch.device) -> dict[str, torch.Tensor]:
    """W^T W over K, the row norms ``wn``, the row products ``wm`` (w_c . m_c), the column sums ``w_sum`` and
    ``head``, W^T W over the whole vocabulary: the classifier moved once in its stored dtype, its rows made float64
    on the device (those outside K in blocks of HEAD_ROWS)."""
    full = _moved(var.values, dev)
    W = full[torch.as_tensor(K, device=dev)].to(torch.float64)
    out = {"WtW": W.T @ W, "wn": torch.linalg.vector_norm(W, dim=1), "wm": torch.einsum("ij,ij->i", W, M),
           "w_sum": W.sum(0)}
    del W
    outside = torch.ones(len(full), dtype=torch.bool, device=dev)
    outside[torch.as_tensor(K, device=dev)] = False
    head = out["WtW"].clone()
    for a in range(0, len(full), HEAD_ROWS):
        w = full[a:a + HEAD_ROWS][outside[a:a + HEAD_ROWS]].to(torch.float64)
        if len(w):
            head += w.T @ w
    return out | {"head": head}
