"""The kept classes' geometry, gathered once per checkpoint for every metric: the one place where min_count is applied,
the O(n d) algebra on the centred means, and one dask compute for the pairwise sums (pairs.py), the d x d moments
and their spectra (spectral.py); or all of that in torch float64 on a device (device.py, ``measure --device cuda``).

Notation, over the kept classes K = {c : count_c >= min_count} (n = |K|, pairs P = {c < c'}):
m_c = mu_c - mu_G (centred mean), r_c = ||m_c||, u_c = m_c / r_c, T_cc' = ||u_c - u_c'||^2 = 2 - 2 cos(m_c, m_c'),
D_cc' = ||mu_c - mu_c'||^2, p_c = n_c / sum_K n_c (token frequency), a_c = 1 where n_c >= 2 (the class has a
variance: the CDNV family reads only such classes), else 0.
"""
from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import dask
import numpy as np
import psutil
import threadpoolctl
import xarray as xr
from dask.delayed import Delayed

from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.moments import check_centred, check_covariance, check_finite, finish_moments, pair_mean
from ncanalyze.analyzer.pairs import COINCIDENT, PairSums, blocks, pair_sums

MAX_TILE = 2048
DECAY_RANKS = (4, 100)  # eigen_decay's fit range of ranks, as Agrawal et al. fit alpha-ReQ (Stringer et al. 2019)



# ---------------------------------------------------------------- the kept set

def kept_classes(count: Any, min_count: int) -> np.ndarray:
    """K = {c : count_c >= min_count}, sorted: the one place where min_count is applied."""
    if int(min_count) < 1:
        raise UserError(f"min_count must be at least 1 (got {min_count})")
    return np.flatnonzero(np.asarray(count) >= int(min_count))


def auto_tile(n: int, threads: int | None = None, budget: float = 0.1) -> int:
    """Tile size: at most 2048 classes, small enough that a t x t float64 Gram block per worker thread fits
    ``budget`` of the available memory (a task holds one such block plus O(t d) inputs), and at most n/8 (but
    not below 256) so that the tile pairs spread evenly over the threads."""
    threads = threads or os.cpu_count() or 1
    t = int(math.sqrt(budget * psutil.virtual_memory().available / threads / 8))
    return max(1, min(n, MAX_TILE, t, max(256, -(-n // 8))))


# ---------------------------------------------------------------- statistics -> the geometry of the kept classes

def needs(field: str):
    """Mark a metric as requiring the Geometry field ``field`` (left out of the result where that is None)."""
    def mark(f):
        f.needs = field
        return f
    return mark


@dataclass
class Geometry:
    """What the metric definitions read, over the kept classes K (n = |K|; vectors are indexed like K).

    m_c = mu_c - mu_G, r_c = ||m_c||, u_c = m_c / r_c, s = sum_c u_c, ``us`` u_c . s (no n x d array is kept),
    t0 = mean over P of T = ||u_c - u_c'||^2, p_c = n_c / sum_K n_c, ``has_var`` n_c >= 2 (the classes the CDNV
    family reads); ``pairs`` holds the pairwise sums (pairs.py) and ``row_cdnv`` each class's sum of
    (var_c + var_c') / D over the other classes with a variance (0 for a class without); ``lam``, ``V`` the
    eigen-decomposition of M^T M; ``spectra`` the eigenvalues of the d x d matrices of the representation geometry
    (moments.py). The NC3 fields need the classifier (``w_norm`` ||w_c||, ``wm`` w_c . m_c, W^T W, sum_c w_c),
    ``sigma_w`` the within-class covariance, the NC4 fields the validation counts over the same kept set,
    ``unit_sum`` the sum of the N = ``n_tokens`` unit train features (anisotropy).
    """
    K: np.ndarray
    has_var: np.ndarray
    var: np.ndarray
    r: np.ndarray
    s: np.ndarray
    us: np.ndarray                         # u_c . s per kept class (class_interference)
    t0: float
    p: np.ndarray
    pairs: PairSums
    row_cdnv: np.ndarray
    MtM: np.ndarray
    lam: np.ndarray
    V: np.ndarray
    m_sum: np.ndarray
    spectra: dict[str, np.ndarray]
    n_tokens: int
    sigma_w: np.ndarray | None = None
    vsv: np.ndarray | None = None          # v_i^T Sigma_W v_i over the eigenvectors v_i of M^T M (nc1_trace)
    w_norm: np.ndarray | None = None
    wm: np.ndarray | None = None
    WtW: np.ndarray | None = None
    w_sum: np.ndarray | None = None
    coincident: list[tuple[int, int, bool]] = field(default_factory=list)  # a few pairs whose directions
    # coincide (T ~ 0), with whether their means do too; empty where none do
    val_count: np.ndarray | None = None
    val_agree: np.ndarray | None = None
    nc4_nan_because: str | None = None   # NC4 is defined here but not measurable, and why
    unit_sum: np.ndarray | None = None
    anisotropy_nan_because: str | None = None
    head_nan_because: str | None = None   # the classifier holds NaN or Inf, and where
    decay_ranks: tuple[int, int] = DECAY_RANKS

    @property
    def n(self) -> int:
        return self.K.size

    @property
    def n_pairs(self) -> float:
        return self.n * (self.n - 1) / 2

    @property
    def pair_weight(self) -> float:
        """sum over P of p_c p_c' = ((sum p)^2 - sum p^2) / 2 = (1 - sum p^2) / 2."""
        return (1 - float(self.p @ self.p)) / 2

    @property
    def n_var(self) -> int:
        """The kept classes with a variance (n_c >= 2): the CDNV family's classes."""
        return int(self.has_var.sum())

    @property
    def n_var_pairs(self) -> float:
        return self.n_var * (self.n_var - 1) / 2

    @property
    def var_pair_weight(self) -> float:
        """sum of p_c p_c' over the pairs of classes with a variance (nc1_cdnv_freq's normaliser)."""
        q = self.p[self.has_var]
        return (float(q.sum()) ** 2 - float(q @ q)) / 2

    @property
    def duality(self) -> np.ndarray:
        """cos(w_c, m_c) per kept class."""
        return self.wm / (self.w_norm * self.r)

    def has(self, needs: str | None) -> bool:
        return needs is None or getattr(self, needs) is not None


def geometry(ds: xr.Dataset, min_count: int = 1, tile: int | None = None, device: str = "auto",
             engine: str | None = None) -> Geometry:
    """The kept classes' geometry from a checkpoint dataset: the O(n d) algebra, the pairwise sums, the d x d moments
    and their spectra in one dask compute on the host (:func:`_host_parts`, one BLAS thread per task), or all of it
    in torch float64 on ``device`` (:func:`engine_device`; device.py). Degenerate input is a UserError naming it."""
    K = kept_classes(ds["count"].values, min_count)
    n = K.size
    if n < 2:
        raise UserError(f"only {n} class(es) have count >= min_count={min_count}; the metrics need at least 2: "
                        "lower --min-count or extract more train tokens")
    on = engine_device(device, engine)
    if tile is not None and int(tile) < 1:
        raise UserError(f"tile must be a positive number of classes (got {tile})")
    count = np.asarray(ds["count"].values)
    p = count[K] / count[K].sum()                                 # token frequencies within K
    sigma_w = np.asarray(ds["within_covariance"].values, dtype=np.float64) if "within_covariance" in ds else None
    check_covariance(sigma_w)
    has_var = count[K] >= 2
    if on is None:
        parts = _host_parts(ds, K, p, has_var, sigma_w, tile)
    else:
        from ncanalyze.analyzer.device import device_parts

        parts = device_parts(ds, K, p, has_var, sigma_w, on, tile)
    mom = parts.pop("mom")
    if parts["coincident"]:
        _warn_coincident(parts["coincident"], K, bool(np.isinf(parts["pairs"].cdnv)))
    g = Geometry(K=K, p=p, has_var=has_var, MtM=mom["MtM"], lam=mom["lam"], V=mom["V"], spectra=mom["spectra"],
                 n_tokens=int(count.sum()), sigma_w=sigma_w, vsv=mom.get("vsv"), **parts)
    if "wn" in mom:
        dead = np.flatnonzero(mom["wn"] == 0)
        if dead.size:
            raise UserError(f"classifier row(s) of class(es) {K[dead[:5]].tolist()} are zero: NC3 is undefined")
        g.w_norm, g.wm, g.WtW, g.w_sum = mom["wn"], mom["wm"], mom["WtW"], mom["w_sum"]
        g.head_nan_because = _head_nan(ds, K, mom["head"])
    _validation(g, ds, min_count)
    _unit_sum(g, ds)
    return g


def _host_parts(ds: xr.Dataset, K: np.ndarray, p: np.ndarray, has_var: np.ndarray, sigma_w: np.ndarray | None,
                tile: int | None) -> dict[str, Any]:
    """The Geometry's fields that read the class means and the classifier, on the host: numpy, then the numba pair
    sums and the moments in one dask compute. Keys as :func:`~ncanalyze.analyzer.device.device_parts`."""
    M, var, r, mu_G = _centred_means(ds, K)
    U = M / r[:, None]
    s = U.sum(0)
    t0 = pair_mean(s, K.size)
    W = _rows(ds["classifier"], K) if "classifier" in ds else None
    tile = int(tile or auto_tile(K.size))
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        (pairs, row_cdnv, coincident), mom = dask.compute(pair_sums(U, r, var, p, has_var, t0, blocks(K.size, tile)),
                                                          _moments(ds, K, M, mu_G, W, sigma_w, tile))
    return {"var": var, "r": r, "s": s, "t0": t0, "us": U @ s, "m_sum": M.sum(0), "pairs": pairs,
            "row_cdnv": row_cdnv, "coincident": coincident, "mom": mom}


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


def _validation(g: Geometry, ds: xr.Dataset, min_count: int) -> None:
    """NC4's counts over the kept set, or why NC4 is not measurable here."""
    if "val_ncc_agree" not in ds or int(np.asarray(ds["val_count"].values).sum()) == 0:
        return
    g.val_count, g.val_agree = (np.asarray(ds[v].values)[g.K].astype(np.float64)
                                for v in ("val_count", "val_ncc_agree"))
    extract_min = int(ds.attrs.get("min_count", 1))
    if not np.array_equal(g.K, kept_classes(ds["count"].values, extract_min)):
        g.nc4_nan_because = (
            f"its decisions were counted at extraction over the classes with count >= {extract_min}, not over "
            f"those with count >= {min_count}; extract again with --min-count {min_count} to measure it here")
    elif g.val_count.sum() == 0:
        g.nc4_nan_because = "no validation token has a kept label"


def _unit_sum(g: Geometry, ds: xr.Dataset) -> None:
    """The train pass's sum of unit features, or why anisotropy is not measurable (a dataset without it, made by
    hand, or not finite)."""
    if "unit_sum" not in ds:
        g.anisotropy_nan_because = ("the dataset holds no unit_sum (the sum of the unit train features, which "
                                    "ncanalyze extract stores)")
        return
    g.unit_sum = np.asarray(ds["unit_sum"].values, dtype=np.float64)
    if not np.isfinite(g.unit_sum).all():
        g.anisotropy_nan_because = "the dataset's unit_sum is not finite"


def _moments(ds: xr.Dataset, K: np.ndarray, M: np.ndarray, mu_G: np.ndarray, W: np.ndarray | None,
             sigma_w: np.ndarray | None, tile: int) -> Delayed:
    """A dask task for M^T M (= |K| Sigma_B) with its eigenvalues ``lam`` and eigenvectors ``V``; with W, also
    W^T W, the row norms ``wn`` of W, the row products ``wm`` (w_c . m_c) and the column sums ``w_sum``; and the
    ``spectra`` of moments.py. Sigma_T's between-class part sum_c f_c (mu_c - mu)(mu_c - mu)^T (f_c = n_c/N
    over every class with a train token, mu = sum_c f_c mu_c) is sum_c f_c a_c a_c^T - delta delta^T with
    a_c = mu_c - mu_G and delta = mu - mu_G = sum_c f_c a_c, so the kept rows reuse M; the classes counted but not
    kept and the classifier rows outside K come in blocks of their own. One task per row block (O(tile d^2) each),
    then their sum and the eigendecompositions (O(d^3))."""
    count, f, rest, A, delta = _outside(ds, K, M, mu_G)
    kept = [dask.delayed(_block_moments)(M[s], f[K][s], None if W is None else W[s]) for s in blocks(K.size, tile)]
    outside = [dask.delayed(_scatter)(A[s], f[rest][s]) for s in blocks(rest.size, tile)]
    if W is not None and K.size < count.size:                    # the head's rows outside K, read in place
        W_all, out_K = ds["classifier"].values, ~np.isin(np.arange(count.size), K)
        outside += [dask.delayed(_head)(W_all[s], out_K[s]) for s in blocks(count.size, tile) if out_K[s].any()]
    return dask.delayed(_sum_moments)(kept, outside, sigma_w, delta, mu_G + delta, K.size)


def _outside(ds: xr.Dataset, K: np.ndarray, M: np.ndarray, mu_G: np.ndarray) -> tuple[np.ndarray, ...]:
    """The train counts, f_c = n_c / N, the classes counted but not kept, their rows a_c = mu_c - mu_G, and
    delta = sum_c f_c a_c (see :func:`_moments`)."""
    count = np.asarray(ds["count"].values)
    f = count / count.sum()
    rest = np.setdiff1d(np.flatnonzero(count > 0), K)             # counted, not kept
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
                 sigma_w: np.ndarray | None, delta: np.ndarray, mu: np.ndarray, n: int) -> dict[str, np.ndarray]:
    out = {k: np.concatenate([p[k] for p in parts]) if k in ("wn", "wm") else sum(p[k] for p in parts)
           for k in parts[0]}
    out["MtFM"] = out["MtFM"] + sum(p["MtFM"] for p in outside if "MtFM" in p)
    if "WtW" in out:
        out["head"] = out["WtW"] + sum(p["head"] for p in outside if "head" in p)
    return finish_moments(out, sigma_w, delta, mu, n)


def engine_device(device: str | None = "auto", engine: str | None = None) -> str | None:
    """Where the pairwise sums and the d x d work run: None for the numba pass and numpy on the CPU (the CPU's
    default), else the torch device that runs them in float64.

    Parameters
    ----------
    device
        ``auto`` (CUDA when torch sees one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.
    engine
        ``numba`` or ``torch`` to choose the CPU's path (``torch`` with ``cpu``: the GPU's code on the CPU, as
        the tests run it); default: torch on CUDA, numba on the CPU.

    Returns
    -------
    str or None
        The torch device, or None for numba.
    """
    device = str(device or "auto").strip().lower()
    if engine not in (None, "numba", "torch"):
        raise UserError(f"engine must be numba or torch (got {engine!r})")
    if device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", device):
        raise UserError(f"--device must be auto, cpu, cuda or cuda:N (got {device!r})")
    if device == "cpu" or (device == "auto" and engine == "numba"):
        return "cpu" if engine == "torch" else None
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else ("cpu" if engine == "torch" else None)
    if engine == "numba":
        raise UserError(f"the numba engine runs on the CPU only: drop engine='numba' to measure on {device}")
    if not torch.cuda.is_available():
        raise UserError(f"--device {device}: torch sees no CUDA device (torch.cuda.is_available() is False); use "
                        "--device auto or cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise UserError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s), numbered from 0")
    return device


def _rows(var: xr.DataArray, K: np.ndarray) -> np.ndarray:
    """The kept classes' rows of a (vocab, ...) variable as a new float64 array (np.take always copies, so the
    caller may write to it), read once: O(|V| d) memory."""
    return np.take(var.values, K, axis=0).astype(np.float64, copy=False)


def _head_nan(ds: xr.Dataset, K: np.ndarray, head: np.ndarray) -> str | None:
    """Why head_erank is nan where the classifier holds NaN or Inf (its rows found only then: one more read), else
    None. Such a head gives NaN logits for every token, so it has no honest rank; the other metrics are computed
    (NC3 reads the kept rows, and is nan where one of those is not finite)."""
    if np.isfinite(head).all():
        return None
    W = np.asarray(ds["classifier"].values)
    rows = np.flatnonzero(~np.isfinite(W).all(1))
    inside = np.intersect1d(rows, K)
    return (f"the classifier's rows of {rows.size} token(s) ({rows[:5].tolist()}{' ...' if rows.size > 5 else ''}) "
            "hold NaN or Inf, so the output layer has no rank (its logits are NaN)"
            + ("; nc3_* are nan too: kept classes' rows are among them" if inside.size else
               "; they are no kept class's, so every other metric is computed"))


def _warn_coincident(pairs: list[tuple[int, int, bool]], K: np.ndarray, cdnv_inf: bool) -> None:
    """Say which kept classes coincide (a few pairs (i, j, means coincide)) and what that makes of the metrics (the
    others stay exact): coincident means make the CDNV family inf (``cdnv_inf``) only where both classes have a
    variance."""
    same = [(i, j) for i, j, s in pairs if s]
    names = lambda ps: ", ".join(f"{K[i]} and {K[j]}" for i, j in ps[:3]) + (" ..." if len(ps) > 2 else "")  # noqa
    if same and cdnv_inf:
        warnings.warn(f"classes {names(same)} have coincident means: nc1_cdnv, nc1_cdnv_p2, nc1_cdnv_freq and their "
                      "class_cdnv are inf; gnc2_log_mean(_freq) is inf and gnc2_log_std nan; the other metrics are "
                      "exact (raise --min-count to leave such classes out)", stacklevel=3)
    elif same:
        warnings.warn(f"classes {names(same)} have coincident means (a class seen once has no variance, so the CDNV "
                      "family leaves them out): gnc2_log_mean(_freq) is inf and gnc2_log_std nan; the other metrics "
                      "are exact (raise --min-count to leave such classes out)", stacklevel=3)
    else:
        warnings.warn(f"the centred means of classes {names([(i, j) for i, j, _ in pairs])} point the same way "
                      f"(||u - u'||^2 < {COINCIDENT:g}): gnc2_log_mean(_freq) is inf and gnc2_log_std nan; the other "
                      "metrics are exact (raise --min-count to leave such classes out)", stacklevel=3)
