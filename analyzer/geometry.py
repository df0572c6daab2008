"""The kept classes' geometry, gathered once per checkpoint for every metric: the one place where min_count is applied,
the O(n d) algebra on the centred means, the pairwise sums (pairs.py), the d x d moments
and their spectra (spectral.py), by one engine (engines.py chooses: numpy and numba on the host, engine_numba.py;
torch float64 on a device, engine_torch.py, ``measure --device cuda``).

Notation, over the kept classes K = {c : count_c >= min_count} (n = |K|, pairs P = {c < c'}):
m_c = mu_c - mu_G (centred mean), r_c = ||m_c||, u_c = m_c / r_c, T_cc' = ||u_c - u_c'||^2 = 2 - 2 cos(m_c, m_c'),
D_cc' = ||mu_c - mu_c'||^2, p_c = n_c / sum_K n_c (token frequency), a_c = 1 where n_c >= 2 (the class has a
variance: the CDNV family reads only such classes), else 0.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xarray as xr

from ncanalyze.analyzer.engines import engine_device, kept_parts
from ncanalyze.analyzer.moments import check_covariance
from ncanalyze.analyzer.pairs import COINCIDENT, PairSums
from ncanalyze.analyzer.registry import MEASURE
from ncanalyze.analyzer.schema import DEBIAS_SHARE, NC4_MIN_COUNT, VAL_AT
from ncanalyze.core.errors import UserError

DECAY_RANKS = (4, 100)  # eigen_decay's fit range of ranks, as Agrawal et al. fit alpha-ReQ (Stringer et al. 2019)
SPLIT_TOTAL = "split_total"  # attribute of a dataset cut to some classes: the whole split's label count (fixed_set)



# ---------------------------------------------------------------- the kept set

def kept_classes(count: Any, min_count: int) -> np.ndarray:
    """K = {c : count_c >= min_count}, sorted: the one place where min_count is applied."""
    if int(min_count) < 1:
        raise UserError(f"min_count must be at least 1 (got {min_count})")
    return np.flatnonzero(np.asarray(count) >= int(min_count))


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
    pairs: PairSums | None                 # None in a jackknife replicate whose pairs are sampled (sample_sums)
    row_cdnv: np.ndarray | None
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
    head: np.ndarray | None = None         # W^T W over the whole vocabulary (head_erank's matrix)
    decay_ranks: tuple[int, int] = DECAY_RANKS
    fixed: np.ndarray | None = None        # per kept class: in the debiased metrics' fixed class set (fixed_set)
    debias_note: str | None = None         # the fixed set's classes left out here, and why
    m_sums: np.ndarray | None = None       # sum of m_c over the classes with a variance, and over the fixed set (2 x d)
    vstar: np.ndarray | None = None        # the fixed set's unbiased variances v*_c (0 outside it)
    noise: np.ndarray | None = None        # the fixed set's means' noise z_c = v*_c / n_c (0 outside it)
    sample_sums: np.ndarray | None = None  # the pair sums over each block of sampled pairs (jackknife.py)
    controls: list[float] | None = None    # with them, pairs.CONTROLS over every pair

    duality: np.ndarray | None = None      # cos(w_c, m_c) per kept class, with the classifier
    # the counts and weights every metric reads, set once (__post_init__) from K, has_var and p, which never change:
    n: int = field(init=False)                 # |K|
    n_pairs: float = field(init=False)         # |P| = n (n - 1) / 2
    pair_weight: float = field(init=False)     # sum over P of p_c p_c' = (1 - sum p^2) / 2
    n_var: int = field(init=False)             # the kept classes with a variance (n_c >= 2): the CDNV family's
    n_var_pairs: float = field(init=False)
    var_pair_weight: float = field(init=False)  # sum of p_c p_c' over the pairs of classes with a variance

    def __post_init__(self) -> None:
        self.n = self.K.size
        self.n_pairs = self.n * (self.n - 1) / 2
        self.pair_weight = (1 - float(self.p @ self.p)) / 2
        self.n_var = int(self.has_var.sum())
        self.n_var_pairs = self.n_var * (self.n_var - 1) / 2
        q = self.p[self.has_var]
        self.var_pair_weight = (float(q.sum()) ** 2 - float(q @ q)) / 2


def geometry(ds: xr.Dataset, min_count: int = MEASURE.min_count, tile: int | None = MEASURE.tile,
             device: str = MEASURE.device, engine: str | None = None, sample: list | None = None,
             all_pairs: bool = True, head: np.ndarray | None = None) -> Geometry:
    """The kept classes' geometry from a checkpoint dataset: the O(n d) algebra, the pairwise sums, the d x d moments
    and their spectra, by the engine engines.py chooses for ``device`` and ``engine`` (engine_numba.py: one dask
    compute on the host, one BLAS thread per task; engine_torch.py: torch float64 on a device). With ``sample``
    (blocks of pairs, each two disjoint index arrays into K) also the pair sums of each block (``sample_sums``);
    without ``all_pairs`` no sum over every pair (``pairs`` None: a jackknife replicate, jackknife.py); ``head``
    W^T W over the whole vocabulary where known (a replicate's is its point value's: the folds leave it alone). Degenerate
    input is a UserError naming it."""
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
    fixed, debias, note = fixed_set(ds, K, count)
    parts = kept_parts(ds, K, p, has_var, sigma_w, on, tile, debias, sample, all_pairs, head)
    mom = parts.pop("mom")
    if parts["coincident"]:
        _warn_coincident(parts["coincident"], K, bool(np.isinf(parts["pairs"].cdnv)))  # found with every pair
    g = Geometry(K=K, p=p, has_var=has_var, MtM=mom["MtM"], lam=mom["lam"], V=mom["V"], spectra=mom["spectra"],
                 n_tokens=int(count.sum()), sigma_w=sigma_w, vsv=mom.get("vsv"), fixed=fixed, debias_note=note,
                 vstar=debias[0], noise=debias[1], **parts)
    if "wn" in mom:
        dead = np.flatnonzero(mom["wn"] == 0)
        if dead.size:
            raise UserError(f"classifier row(s) of class(es) {K[dead[:5]].tolist()} are zero: NC3 is undefined")
        g.w_norm, g.wm, g.WtW, g.w_sum = mom["wn"], mom["wm"], mom["WtW"], mom["w_sum"]
        g.duality = g.wm / (g.w_norm * g.r)
        g.head, g.head_nan_because = mom["head"], _head_nan(ds, K, mom["head"])
    _validation(g, ds, min_count)
    _unit_sum(g, ds)
    return g


def fixed_set(ds: xr.Dataset, K: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, tuple, str | None]:
    """The debiased metrics' class set over K, their per-class rows and a note on the classes it leaves out.

    The set is fixed by the train split, not by the sample: the classes whose share of the split's labels
    (``split_count``, counted from the token ids at extraction) is at least DEBIAS_SHARE, within K (a min_count above 2 narrows it, as asked). Of
    those, a class with fewer than 2 tokens in the sample (no variance) is left out, named in the note. A dataset
    without ``split_count`` (:func:`class_stats`' plain arrays, a text split read as a stream) takes the classes with
    2 or more tokens in the sample: the sample is then the population, and the set is not budget-stable. A dataset
    cut to some classes (the jackknife's replicates) holds the whole split's count in its ``split_total`` attribute.
    Rows (pairs.side_of): v*_c = var_c
    n_c/(n_c - 1) (the unbiased variance), z_c = v*_c / n_c (the noise E||mu^_c - mu_c||^2 of the class mean), b_c.
    """
    if "split_count" in ds:
        split = np.asarray(ds["split_count"].values, dtype=np.float64)
        wanted = split >= DEBIAS_SHARE * float(ds.attrs.get(SPLIT_TOTAL, split.sum()))
    else:                                                          # no split: the sample is all there is
        wanted = np.asarray(count) >= 2
    n = count[K].astype(np.float64)
    fixed = wanted[K] & (n >= 2)
    var = np.asarray(ds["variance"].values)[K].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        vs = np.where(fixed, var * n / (n - 1), 0.0)
        z = np.where(fixed, vs / n, 0.0)
    out = np.flatnonzero(wanted & (np.asarray(count) < 2))
    note = None
    if out.size:
        note = (f"{out.size} of the {int(wanted.sum())} classes of the fixed set (share >= {DEBIAS_SHARE:.3g} of "
                f"the train split's labels) are left out, with fewer than 2 train tokens in the sample "
                f"({', '.join(map(str, out[:8].tolist()))}{' ...' if out.size > 8 else ''}): extract more tokens")
    return fixed, (vs, z, fixed, *second_order(ds)), note


def second_order(ds: xr.Dataset) -> tuple[float, float]:
    """The debiased CDNV's second-order constants (pairs.py): k1 = 4/d and k2 = 2/d_eff, d_eff = tr(Sigma_W)^2 /
    tr(Sigma_W^2) the participation ratio of the pooled within-class covariance (d without one): the variance of a
    sample squared distance is k1 D N + k2 N^2 where the means' noise has the pooled shape and the distance a
    direction at random to it."""
    d = ds.sizes["hidden"]
    if "within_covariance" not in ds:
        return 4 / d, 2 / d
    S = np.asarray(ds["within_covariance"].values, dtype=np.float64)
    top = float(np.abs(S).max())
    S = S / top if top > 0 else S                                 # scale-free: the squares neither overflow nor vanish
    tr, tr2 = float(np.trace(S)), float(np.sum(S * S))
    return 4 / d, (2 * tr2 / tr ** 2 if tr > 0 else 2 / d)


def _validation(g: Geometry, ds: xr.Dataset, min_count: int) -> None:
    """NC4's counts over the kept set, or why NC4 is not measurable here."""
    if "val_ncc_agree" not in ds or int(np.asarray(ds["val_count"].values).sum()) == 0:
        return
    g.val_count, g.val_agree = (np.asarray(ds[v].values)[g.K].astype(np.float64)
                                for v in ("val_count", "val_ncc_agree"))
    extract_min = int(ds.attrs.get("min_count", 1))
    if not np.array_equal(g.K, kept_classes(ds["count"].values, extract_min)):
        row = _counted_at(ds, g.K)
        if row is None:
            at = (f" (and over the kept sets of min_count {', '.join(map(str, ds[NC4_MIN_COUNT].values))})"
                  if VAL_AT[1] in ds else "")
            g.nc4_nan_because = (
                f"its decisions were counted at extraction over the classes with count >= {extract_min}{at}, not "
                f"over those with count >= {min_count}; extract again with --min-count {min_count} to measure it here")
            return
        g.val_agree = np.asarray(ds[VAL_AT[1]].values)[row][g.K].astype(np.float64)
    if g.val_count.sum() == 0:
        g.nc4_nan_because = "no validation token has a kept label"


def _counted_at(ds: xr.Dataset, K: np.ndarray) -> int | None:
    """The row of the ``VAL_AT`` counts (one per ``NC4_MIN_COUNTS``) whose kept set is ``K``, or None."""
    if VAL_AT[1] not in ds:
        return None
    count = ds["count"].values
    for i, m in enumerate(np.asarray(ds[NC4_MIN_COUNT].values)):
        if np.array_equal(K, kept_classes(count, int(m))):
            return i
    return None


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
