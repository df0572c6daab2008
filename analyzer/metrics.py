"""The neural-collapse metrics of SPEC section 4, exact (float64) and out-of-core.

Notation, over the kept classes K = {c : count_c >= min_count} (n = |K|, pairs P = {c < c'}):
m_c = mu_c - mu_G (centred mean), r_c = ||m_c||, u_c = m_c / r_c, T_cc' = ||u_c - u_c'||^2 = 2 - 2 cos(m_c, m_c'),
D_cc' = ||mu_c - mu_c'||^2.

Everything that is not a pairwise sum is d x d or O(n d) algebra on M (n x d, the centred means): the ETF error
from the eigenvalues of M^T M, the dual error from <M^T M, W^T W>, the mean cosine from s = sum_c u_c.
The pairwise sums (CDNV, the spread of the cosines, GNC2) come from pairs.py: one Gram block per tile pair
i <= j and one fused pass over it; no n x n array is ever formed. Both run in one dask compute, one BLAS thread
per task.

Reading order: :func:`geometry` gathers those quantities into a :class:`Geometry`; then each metric is one small
function of it, named as in SPEC section 4 (``nc1_cdnv`` ... ``nc4_agreement``, and the per-class views), whose
docstring gives the formula and the citation; :func:`measure_all` applies them.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import dask
import dask.array as da
import numpy as np
import psutil
import threadpoolctl
import xarray as xr
from dask.delayed import Delayed

from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.pairs import COINCIDENT, PairSums, blocks, pair_sums, reference_pair_sums
from ncanalyze.analyzer.schema import PER_CLASS, SCALARS, stats_dataset

MAX_TILE = 2048


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


# ---------------------------------------------------------------- plain arrays -> statistics

def class_stats(embeddings: Any, labels: Any, num_classes: int, *, classifier: Any = None,
                classifier_bias: Any = None, val_embeddings: Any = None, val_labels: Any = None,
                min_count: int = 1, batch_size: int = 65536) -> xr.Dataset:
    """Exact class statistics of plain arrays (numpy, dask or torch; n x d features, n labels) as a dataset with
    the store's variables, ready for :func:`measure`.

    ``classifier`` (num_classes x d) and ``classifier_bias`` add NC3; with them, ``val_embeddings`` and
    ``val_labels`` add NC4's counts (decisions over the classes with count >= ``min_count``, as extraction does).
    """
    from ncanalyze.analyzer.accumulate import ClassStats

    acc = None
    for h, y in _batches(embeddings, labels, batch_size, num_classes, "embeddings"):
        if acc is None:
            acc = ClassStats(num_classes, h.shape[1], device=h.device)
        acc.update(h, y)
    if acc is None or int(acc.count.sum()) == 0:
        raise UserError("class_stats got no embeddings: pass a non-empty (n x d) array and n labels")
    d = acc.mean.shape[1]
    W = None if classifier is None else _numpy(classifier, (num_classes, d), "classifier")
    b = None if W is None or classifier_bias is None else _numpy(classifier_bias, (num_classes,), "classifier_bias")
    ds = stats_dataset(acc.count, acc.mean, acc.variance, acc.within_covariance, classifier=W, classifier_bias=b,
                       attrs={"min_count": int(min_count), "train_tokens": int(acc.count.sum())})
    if val_embeddings is not None:
        if classifier is None or val_labels is None:
            raise UserError("NC4 needs the classifier and the labels: pass classifier= (and classifier_bias=) and "
                            "val_labels= with val_embeddings")
        for name, v in _val_counts(ds, val_embeddings, val_labels, min_count, batch_size).items():
            ds[name] = "vocab", v
        ds.attrs["val_tokens"] = int(ds["val_count"].sum())
    return ds


def _numpy(x: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
    x = np.asarray(x, dtype=np.float64)
    if x.shape != shape:
        raise UserError(f"{what} must have shape {shape} (classes x hidden); got {x.shape}")
    return x


def _batches(h: Any, y: Any, batch_size: int, num_classes: int, what: str):
    """(features, labels) as float64 / int64 torch batches, validated; dask input chunk by chunk."""
    import torch

    if h.ndim != 2 or y.ndim != 1 or h.shape[0] != y.shape[0]:
        raise UserError(f"{what} must be (n x d) with n labels; got shapes {tuple(h.shape)} and {tuple(y.shape)}")
    if isinstance(h, da.Array) or isinstance(y, da.Array):
        h, y = da.asarray(h), da.asarray(y)
        y = y.rechunk((h.chunks[0],))
        parts = ((hb, yb) for hb, yb in zip(h.to_delayed()[:, 0], y.to_delayed()))
        parts = (dask.compute(hb, yb) for hb, yb in parts)
    else:
        parts = ((h[s:s + batch_size], y[s:s + batch_size]) for s in range(0, h.shape[0], batch_size))
    for hb, yb in parts:
        hb, yb = torch.as_tensor(hb), torch.as_tensor(yb)
        if yb.dtype.is_floating_point or yb.dtype == torch.bool:
            raise UserError(f"{what} labels must be integers (got {yb.dtype})")
        hb, yb = hb.to(torch.float64), yb.to(torch.int64)
        if len(yb) and (int(yb.min()) < 0 or int(yb.max()) >= num_classes):
            raise UserError(f"{what} labels must lie in [0, {num_classes}); got {int(yb.min())}..{int(yb.max())}")
        if not torch.isfinite(hb).all():
            raise UserError(f"{what} contain NaN or Inf")
        yield hb, yb


def _val_counts(ds: xr.Dataset, h: Any, y: Any, min_count: int, batch_size: int) -> dict[str, np.ndarray]:
    """NC4's counts per true class, over the kept classes, exactly as extraction counts them."""
    import torch

    from ncanalyze.analyzer.accumulate import DecisionCounts

    K = torch.as_tensor(kept_classes(ds["count"].values, min_count))
    bias = torch.as_tensor(ds["classifier_bias"].values) if "classifier_bias" in ds else None
    counts = DecisionCounts(torch.as_tensor(ds["classifier"].values), bias, torch.as_tensor(ds["mean"].values), K)
    for hb, yb in _batches(h, y, batch_size, ds.sizes["vocab"], "val_embeddings"):
        counts.update(hb, yb)
    return {k: v.cpu().numpy() for k, v in counts.counts.items()}


# ---------------------------------------------------------------- statistics -> the geometry of the kept classes

@dataclass
class Geometry:
    """What the definitions below read, over the kept classes K (n = |K|; vectors are indexed like K).

    m_c = mu_c - mu_G, r_c = ||m_c||, u_c = m_c / r_c, s = sum_c u_c, t0 = mean over P of T = ||u_c - u_c'||^2;
    ``pairs`` holds the pairwise sums (pairs.py) and ``row_cdnv`` each class's sum of (var_c + var_c') / D over the
    others; ``lam``, ``V`` the eigen-decomposition of M^T M. The NC3 fields need the classifier (``w_norm``
    ||w_c||, ``wm`` w_c . m_c, W^T W, sum_c w_c), ``sigma_w`` the within-class covariance, the NC4 fields the
    validation counts over the same kept set.
    """
    K: np.ndarray
    var: np.ndarray
    r: np.ndarray
    U: np.ndarray
    s: np.ndarray
    t0: float
    pairs: PairSums
    row_cdnv: np.ndarray
    MtM: np.ndarray
    lam: np.ndarray
    V: np.ndarray
    m_sum: np.ndarray
    sigma_w: np.ndarray | None = None
    w_norm: np.ndarray | None = None
    wm: np.ndarray | None = None
    WtW: np.ndarray | None = None
    w_sum: np.ndarray | None = None
    coincident: list[tuple[int, int]] = field(default_factory=list)  # pairs whose directions coincide (T ~ 0)
    val_count: np.ndarray | None = None
    val_agree: np.ndarray | None = None
    nc4_nan_because: str | None = None   # NC4 is defined here but not measurable, and why

    @property
    def n(self) -> int:
        return self.K.size

    @property
    def n_pairs(self) -> float:
        return self.n * (self.n - 1) / 2

    @property
    def duality(self) -> np.ndarray:
        """cos(w_c, m_c) per kept class."""
        return self.wm / (self.w_norm * self.r)

    def has(self, needs: str | None) -> bool:
        return needs is None or getattr(self, needs) is not None


def geometry(ds: xr.Dataset, min_count: int = 1, tile: int | None = None) -> Geometry:
    """The kept classes' geometry from a checkpoint dataset: the O(n d) algebra here, the pairwise sums and the
    d x d moments in one dask compute (one BLAS thread per task). Degenerate input is a UserError naming it."""
    K = kept_classes(ds["count"].values, min_count)
    n = K.size
    if n < 2:
        raise UserError(f"only {n} class(es) have count >= min_count={min_count}; the metrics need at least 2: "
                        "lower --min-count or extract more train tokens")
    tile = int(tile or auto_tile(n))
    if tile < 1:
        raise UserError(f"tile must be a positive number of classes (got {tile})")
    M = _rows(ds["mean"], K)
    M -= M.mean(0)                                                # m_c = mu_c - mu_G
    var = _rows(ds["variance"], K)
    r = np.sqrt(np.einsum("ij,ij->i", M, M))
    _check_finite(np.r_[r, var], "class means or variances")
    zero = np.flatnonzero(r <= 1e-12 * r.max())
    if zero.size:
        raise UserError(f"class(es) {K[zero[:5]].tolist()} have a zero-norm centred mean (their mean equals the "
                        "global mean of the kept classes), so cosines, GNC2 and NC3 are undefined; raise "
                        "--min-count or leave them out")
    U = M / r[:, None]
    s = U.sum(0)
    t0 = 2 - 2 * (s @ s - n) / (n * (n - 1))                      # mean over P of T = 2 - 2 cos
    W = _rows(ds["classifier"], K) if "classifier" in ds else None
    spans = blocks(n, tile)
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        (pairs, row_cdnv), mom = dask.compute(pair_sums(U, r, var, t0, spans), _moments(M, W, spans))
    coincident: list[tuple[int, int]] = []
    if pairs.coincident or not np.isfinite(pairs).all():
        pairs, row_cdnv, coincident = reference_pair_sums(U, r, var, t0, spans)
        _warn_coincident(coincident, M, r, K)
    g = Geometry(K=K, var=var, r=r, U=U, s=s, t0=t0, pairs=pairs, row_cdnv=row_cdnv, MtM=mom["MtM"],
                 lam=mom["lam"], V=mom["V"], m_sum=M.sum(0), coincident=coincident)
    if "within_covariance" in ds:
        g.sigma_w = np.asarray(ds["within_covariance"].values, dtype=np.float64)
    if W is not None:
        dead = np.flatnonzero(mom["wn"] == 0)
        if dead.size:
            raise UserError(f"classifier row(s) of class(es) {K[dead[:5]].tolist()} are zero: NC3 is undefined")
        g.w_norm, g.wm, g.WtW, g.w_sum = mom["wn"], mom["wm"], mom["WtW"], mom["w_sum"]
    if "val_ncc_agree" in ds and int(np.asarray(ds["val_count"].values).sum()) > 0:
        g.val_count, g.val_agree = (np.asarray(ds[v].values)[K].astype(np.float64)
                                    for v in ("val_count", "val_ncc_agree"))
        extract_min = int(ds.attrs.get("min_count", 1))
        if not np.array_equal(K, kept_classes(ds["count"].values, extract_min)):
            g.nc4_nan_because = (
                f"its decisions were counted at extraction over the classes with count >= {extract_min}, not over "
                f"those with count >= {min_count}; extract again with --min-count {min_count} to measure it here")
        elif g.val_count.sum() == 0:
            g.nc4_nan_because = "no validation token has a kept label"
    return g


# ---------------------------------------------------------------- the metrics (SPEC section 4), one function each
# Each takes the Geometry and returns a float; `needs` names the Geometry field it requires (the metric is left out
# of the result where that is missing). Their names are schema.SCALARS and schema.PER_CLASS.

def needs(field: str):
    def mark(f):
        f.needs = field
        return f
    return mark


def nc1_cdnv(g: Geometry) -> float:
    """mean over P of (var_c + var_c') / (2 ||mu_c - mu_c'||^2): class-distance normalized variance (Galanti et
    al. 2022, "On the role of neural collapse in transfer learning"). +inf when two class means coincide."""
    return g.pairs.cdnv / (2 * g.n_pairs)


def nc1_cdnv_p2(g: Geometry) -> float:
    """mean over P of (var_c + var_c') / (2 ||mu_c - mu_c'||^4): the form in Wu & Papyan's code (2024)."""
    return g.pairs.cdnv_p2 / (2 * g.n_pairs)


@needs("sigma_w")
def nc1_trace(g: Geometry) -> float:
    """Tr(Sigma_W Sigma_B^+) / |K| (Papyan, Han & Donoho 2020), Sigma_B = M^T M / n. With M^T M = V diag(lam) V^T,
    Sigma_B^+ = n V diag(1/lam) V^T over lam > d eps max(lam) (numpy's pinv cut), so the value is
    sum_i v_i^T Sigma_W v_i / lam_i."""
    keep = g.lam > g.lam.size * np.finfo(float).eps * g.lam.max()
    V = g.V[:, keep]
    return float(np.sum(np.sum(V * (g.sigma_w @ V), 0) / g.lam[keep]))


def nc2_norm_cv(g: Geometry) -> float:
    """std / mean of ||m_c|| over K: equinorm (Papyan, Han & Donoho 2020)."""
    return g.r.std() / g.r.mean()


def nc2_lognorm_std(g: Geometry) -> float:
    """std of log ||m_c|| over K (Wu & Papyan 2024)."""
    return np.log(g.r).std()


def nc2_cos_mean(g: Geometry) -> float:
    """mean over P of cos(m_c, m_c') = (||s||^2 - n) / (n (n - 1)), s = sum_c u_c."""
    return (g.s @ g.s - g.n) / (g.n * (g.n - 1))


def nc2_cos_std(g: Geometry) -> float:
    """std over P of cos(m_c, m_c'): equiangularity (Papyan, Han & Donoho 2020). cos = 1 - T/2, so
    cos - mean = -(t0/2) x with x = T/t0 - 1, and the std is (t0/2) sqrt(mean x^2)."""
    return g.t0 / 2 * math.sqrt(g.pairs.xx / g.n_pairs)


def nc2_etf_error(g: Geometry) -> float:
    """||G/||G||_F - (I - 11^T/n)/sqrt(n-1)||_F, G = Gram of the m_c: distance to a simplex ETF (Papyan et al.)."""
    return etf_error_from_spectrum(g.lam, g.n)


def gnc2_log_mean(g: Geometry) -> float:
    """mean over P of log(1/||u_c - u_c'||) = -(mean l + log t0) / 2, l = log(T/t0): the logarithmic energy of
    hyperspherical uniformity (Liu et al. 2023; Wu & Papyan 2024). +inf when two directions coincide."""
    if g.coincident:
        return math.inf
    return -0.5 * (g.pairs.l / g.n_pairs + math.log(g.t0))


def gnc2_log_std(g: Geometry) -> float:
    """std over P of log(1/||u_c - u_c'||) = std(l) / 2: hyperspherical uniformity (GNC2, Wu & Papyan 2024).
    Undefined (nan) when two directions coincide: the spread of a set holding +inf."""
    if g.coincident:
        return math.nan
    ml = g.pairs.l / g.n_pairs
    return 0.5 * math.sqrt(max(g.pairs.ll / g.n_pairs - ml * ml, 0.0))


@needs("wm")
def nc3_cos_mean(g: Geometry) -> float:
    """mean over K of cos(w_c, m_c): self-duality (Papyan, Han & Donoho 2020)."""
    return g.duality.mean()


@needs("wm")
def unc3_cos_cv(g: Geometry) -> float:
    """std / mean over K of cos(w_c, m_c): uniform duality (UNC3, Wu & Papyan 2024)."""
    return g.duality.std() / g.duality.mean()


@needs("wm")
def nc3_dual_error(g: Geometry) -> float:
    """nc2_etf_error with G replaced by S = [m_c . w_c'] (Papyan, Han & Donoho 2020)."""
    return dual_error(g.MtM, g.WtW, g.wm.sum(), g.m_sum, g.w_sum, g.n)


@needs("val_count")
def nc4_agreement(g: Geometry) -> float:
    """Over validation tokens with a kept label: the fraction where argmax_c (w_c . h + b_c) equals
    argmin_c ||h - mu_c||^2, both over K (Papyan, Han & Donoho 2020), counted at extraction (DecisionCounts)."""
    if g.nc4_nan_because:
        return math.nan
    return g.val_agree.sum() / g.val_count.sum()


def class_norm(g: Geometry) -> np.ndarray:
    """||m_c||."""
    return g.r


def class_cdnv(g: Geometry) -> np.ndarray:
    """mean over c' != c in K of (var_c + var_c') / (2 ||mu_c - mu_c'||^2)."""
    return g.row_cdnv / (2 * (g.n - 1))


def class_interference(g: Geometry) -> np.ndarray:
    """mean over c' != c in K of cos(m_c, m_c') = (u_c . s - 1) / (n - 1)."""
    return (g.U @ g.s - 1) / (g.n - 1)


@needs("wm")
def class_duality(g: Geometry) -> np.ndarray:
    """cos(w_c, m_c)."""
    return g.duality


@needs("val_count")
def class_nc4(g: Geometry) -> np.ndarray:
    """val_ncc_agree / val_count (nan where a class has no validation token)."""
    if g.nc4_nan_because:
        return np.full(g.n, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(g.val_count > 0, g.val_agree / g.val_count, np.nan)


DEFINITIONS = {name: globals()[name] for name in SCALARS}
PER_CLASS_DEFINITIONS = {name: globals()[name] for name in PER_CLASS}


# ---------------------------------------------------------------- the entry points

def measure(ds: xr.Dataset, min_count: int = 1, tile: int | None = None) -> dict[str, float]:
    """The scalar metrics of one checkpoint (SPEC section 4): name -> float. nc3_* need ``classifier``, nc4 needs
    ``val_*`` counts taken over the same kept set (else nc4_agreement is nan, with a warning saying why)."""
    return measure_all(ds, min_count, tile)[0]


def class_metrics(ds: xr.Dataset, min_count: int = 1, tile: int | None = None) -> xr.Dataset:
    """Per-class views over the kept set (nan elsewhere): ``class_norm`` ||m_c||, ``class_cdnv`` mean CDNV to the
    other kept classes, ``class_interference`` mean cos(m_c, m_c') over them, ``class_duality`` cos(w_c, m_c),
    ``class_nc4`` val_ncc_agree / val_count."""
    return measure_all(ds, min_count, tile)[1]


def measure_all(ds: xr.Dataset, min_count: int = 1, tile: int | None = None) -> tuple[dict[str, float], xr.Dataset]:
    """:func:`measure` and :func:`class_metrics` from one pass."""
    g = geometry(ds, min_count, tile)
    if g.nc4_nan_because:
        warnings.warn(f"nc4_agreement is nan: {g.nc4_nan_because}", stacklevel=2)
    scalars = {name: float(f(g)) for name, f in DEFINITIONS.items() if g.has(getattr(f, "needs", None))}
    per = {name: f(g) for name, f in PER_CLASS_DEFINITIONS.items() if g.has(getattr(f, "needs", None))}
    return scalars, _per_class(ds, g.K, per)


def _per_class(ds: xr.Dataset, K: np.ndarray, per: dict[str, np.ndarray]) -> xr.Dataset:
    vocab = ds.sizes["vocab"]
    data = {}
    for name in PER_CLASS:
        full = np.full(vocab, np.nan)
        if name in per:
            full[K] = per[name]
        data[name] = ("vocab", full)
    coords = {"vocab": ds["vocab"].values} if "vocab" in ds.coords else None
    return xr.Dataset(data, coords=coords)


def _moments(M: np.ndarray, W: np.ndarray | None, spans: list[slice]) -> Delayed:
    """A dask task for M^T M (= |K| Sigma_B) with its eigenvalues ``lam`` and eigenvectors ``V``; with W, also
    W^T W, the row norms ``wn`` of W, the row products ``wm`` (w_c . m_c) and the column sums ``w_sum``. One task
    per row block (O(tile d^2) each), then their sum and the eigendecomposition (O(d^3))."""
    parts = [dask.delayed(_block_moments)(M[s], None if W is None else W[s]) for s in spans]
    return dask.delayed(_sum_moments)(parts)


def _block_moments(m: np.ndarray, w: np.ndarray | None) -> dict[str, np.ndarray]:
    out = {"MtM": m.T @ m}
    if w is not None:
        out |= {"WtW": w.T @ w, "wn": np.sqrt(np.einsum("ij,ij->i", w, w)), "wm": np.einsum("ij,ij->i", w, m),
                "w_sum": w.sum(0)}
    return out


def _sum_moments(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    out = {k: np.concatenate([p[k] for p in parts]) if k in ("wn", "wm") else sum(p[k] for p in parts)
           for k in parts[0]}
    out["lam"], out["V"] = np.linalg.eigh(out["MtM"])
    return out


def _rows(var: xr.DataArray, K: np.ndarray) -> np.ndarray:
    """The kept classes' rows of a (vocab, ...) variable as a new float64 array (np.take always copies, so the
    caller may write to it), read once: O(|V| d) memory."""
    return np.take(var.values, K, axis=0).astype(np.float64, copy=False)


def _check_finite(x: np.ndarray, what: str) -> None:
    if not np.isfinite(x).all():
        raise UserError(f"the {what} of kept classes contain NaN or Inf: the statistics are corrupt; extract again")


def etf_error_from_spectrum(lam: np.ndarray, n: int) -> float:
    """||G/||G||_F - (I - 11^T/n)/sqrt(n-1)||_F from the eigenvalues of M^T M (= the non-zero ones of G = M M^T).

    M is centred, so G lives on the (n-1)-space orthogonal to 1, where the simplex target is I/sqrt(n-1): the
    error is a sum of squares over G's n-1 eigenvalues there (the top ones of M^T M, padded with zeros), exact to
    rounding even at 0.
    """
    lam = np.sort(lam)[::-1][: n - 1]
    g = math.sqrt(float(np.sum(lam * lam)))
    target = 1 / math.sqrt(n - 1)
    return math.sqrt(float(np.sum((lam / g - target) ** 2)) + (n - 1 - lam.size) * target ** 2)


def dual_error(MtM: np.ndarray, WtW: np.ndarray, trace_s: float, m_sum: np.ndarray, w_sum: np.ndarray,
               n: int) -> float:
    """||S/||S||_F - (I - 11^T/n)/sqrt(n-1)||_F for S = M W^T, from d x d quantities: ||S||_F^2 = <M^T M, W^T W>,
    <S, I - 11^T/n> = tr S - (1^T M)(W^T 1)/n. The expanded square loses ~1e-8 absolute near 0."""
    s_norm = math.sqrt(float(np.sum(MtM * WtW)))
    inner = (trace_s - float(m_sum @ w_sum) / n) / (s_norm * math.sqrt(n - 1))
    return math.sqrt(max(2 - 2 * inner, 0.0))


def _warn_coincident(pairs: list[tuple[int, int]], M: np.ndarray, r: np.ndarray, K: np.ndarray) -> None:
    """Say which kept classes coincide and what that makes of the metrics (the others stay exact)."""
    same = [(i, j) for i, j in pairs if float(np.sum((M[i] - M[j]) ** 2)) <= COINCIDENT * r[i] * r[j]]
    names = lambda ps: ", ".join(f"{K[i]} and {K[j]}" for i, j in ps[:3]) + (" ..." if len(ps) > 3 else "")  # noqa
    if same:
        warnings.warn(f"classes {names(same)} have coincident means: nc1_cdnv, nc1_cdnv_p2 and their class_cdnv are "
                      "inf; gnc2_log_mean is inf and gnc2_log_std nan; the other metrics are exact (raise "
                      "--min-count to leave such classes out)", stacklevel=3)
    else:
        warnings.warn(f"the centred means of classes {names(pairs)} point the same way (||u - u'||^2 < "
                      f"{COINCIDENT:g}): gnc2_log_mean is inf and gnc2_log_std nan; the other metrics are exact "
                      "(raise --min-count to leave such classes out)", stacklevel=3)
