"""Representation geometry beyond NC (SPEC section 4, second table), from the statistics already stored: no new pass.

The spectra are the eigenvalues of d x d float64 matrices (numpy.linalg, gathered by ``moments.spectra``):
Sigma_W (the stored within_covariance), Sigma_B = (1/|K|) sum_K m_c m_c^T, Sigma_T = Sigma_W + sum_c (n_c/N)
(mu_c - mu)(mu_c - mu)^T (the law of total covariance: the covariance of all train features), LiDAR's whitened
Sigma_B, and the head's W^T W. The frequency-weighted CDNV and GNC2 are pair sums of the same tiled pass as the
others (pairs.py), with weights p_c p_c'. Anisotropy reads ``unit_sum``, the train pass's sum of unit features.
Each metric is one function of the :class:`~ncanalyze.analyzer.geometry.Geometry`, named as in the SPEC.
"""
from __future__ import annotations

import math

import numpy as np

from ncanalyze.analyzer.geometry import Geometry, needs

EIGEN_FLOOR = 1e-10  # eigen_decay fits the ranks whose eigenvalues are above this fraction of the largest


def erank(lam: np.ndarray) -> float:
    """Effective rank exp(-sum_i p_i log p_i), p_i = s_i / sum_j s_j, s_i = sqrt(lambda_i) over the eigenvalues
    above d eps lambda_max (the rest are rounding noise and count as 0: nc1_trace's cut, numpy's pinv's), terms with
    p_i = 0 left out (Roy & Vetterli 2007; RankMe, Garrido et al. 2023): the s_i are the singular values of the
    features whose covariance (or second moment) has eigenvalues lambda_i. In [1, d]; nan for a zero matrix or a
    spectrum holding NaN.

    The weights are sqrt(lambda) (singular values), as Roy & Vetterli and RankMe define it; LiDAR's entropy weighs
    lambda itself (:func:`lidar`), which counts fewer directions for the same spectrum (the docs' metric cards: how much)."""
    lam = np.asarray(lam, dtype=np.float64)
    if lam.size == 0 or not np.isfinite(lam).all() or lam.max() <= 0:
        return math.nan
    s = np.sqrt(lam[lam > lam.size * np.finfo(np.float64).eps * lam.max()] / lam.max())
    p = s / s.sum()
    return math.exp(-float(np.sum(p * np.log(p))))


@needs("sigma_w")
def within_erank(g: Geometry) -> float:
    """erank(Sigma_W): how many directions the within-class noise spreads over."""
    return erank(g.spectra["within"])


def between_erank(g: Geometry) -> float:
    """erank(Sigma_B): how many directions the class means span (at most |K| - 1; a simplex ETF fills them
    evenly)."""
    return erank(g.spectra["between"])


@needs("sigma_w")
def total_erank(g: Geometry) -> float:
    """erank(Sigma_T), Sigma_T the covariance of all train features: RankMe of the centred features."""
    return erank(g.spectra["total"])


@needs("sigma_w")
def rankme(g: Geometry) -> float:
    """RankMe as published (Garrido et al. 2023, without their epsilon): erank of the raw features' second moment
    E[h h^T] = Sigma_W + sum_c (n_c/N) mu_c mu_c^T = Sigma_T + mu mu^T, i.e. of the singular values of the
    uncentred N x d feature matrix (the mean direction counts as one more direction, as in their code)."""
    return erank(g.spectra["second"])


def decay_fit(lam: np.ndarray, ranks: tuple[int, int] = (4, 100)) -> float:
    """alpha of lambda_i ~ i^-alpha as Stringer et al. (2019) fit it (alpha-ReQ, Agrawal et al. 2022, uses their
    code): minus the slope of log lambda_i on log i by least squares weighted by 1/i over the ranks
    i = ranks[0]..min(ranks[1], r) (1-based, eigenvalues in decreasing order), r = #{lambda_i > 1e-10 lambda_1};
    nan where fewer than 2 ranks remain."""
    lam = np.sort(np.asarray(lam, dtype=np.float64))[::-1]
    if lam.size == 0 or not np.isfinite(lam).all() or lam[0] <= 0:
        return math.nan
    r = int(np.sum(lam > EIGEN_FLOOR * lam[0]))
    i = np.arange(ranks[0], min(ranks[1], r) + 1)
    if i.size < 2:
        return math.nan
    x, y, w = np.log(i), np.log(lam[i - 1]), 1.0 / i
    xm, ym = (w @ x) / w.sum(), (w @ y) / w.sum()
    return -float(w @ ((x - xm) * (y - ym)) / (w @ (x - xm) ** 2))


@needs("sigma_w")
def eigen_decay(g: Geometry) -> float:
    """alpha-ReQ (Agrawal et al. 2022) fitted as its authors fit it (:func:`decay_fit`, ranks ``g.decay_ranks``,
    default 4..100) on Sigma_T's eigenvalues: the spectrum falls as i^-alpha; a large alpha is a few dominant
    directions, a small one a flat spectrum."""
    return decay_fit(g.spectra["total"], g.decay_ranks)


@needs("sigma_w")
def lidar(g: Geometry) -> float:
    """LiDAR (Thilak et al. 2023): exp(-sum p_i log p_i), p_i = lambda_i / sum lambda_j over the eigenvalues of
    (Sigma_W + delta I)^(-1/2) Sigma_B (Sigma_W + delta I)^(-1/2), delta = 1e-4 tr(Sigma_W) / d: the effective
    rank of the class means measured in units of the within-class noise (the LDA matrix). nan without
    within-class noise. The published code adds a fixed delta (1e-4 or 1e-6); relative to tr(Sigma_W)/d, ours is
    the same at every feature scale (its metric card gives the gap at a 1e-3 feature scale)."""
    return eigen_entropy_rank(g.spectra["lidar"])


def eigen_entropy_rank(lam: np.ndarray) -> float:
    """exp(-sum p_i log p_i), p_i = lambda_i / sum lambda_j (LiDAR's weighting: lambda, not sqrt(lambda) as in
    :func:`erank`), negative rounding noise counted as 0; nan for a zero or non-finite spectrum."""
    lam = np.maximum(np.asarray(lam, dtype=np.float64), 0.0)
    if not np.isfinite(lam).all() or lam.sum() == 0:
        return math.nan
    p = lam[lam > 0] / lam.sum()
    return math.exp(-float(np.sum(p * np.log(p))))


def anisotropy(g: Geometry) -> float:
    """Mean cosine over ordered pairs of distinct train tokens, (||sum_i h_i/||h_i|| ||^2 - N) / (N (N - 1))
    (Ethayarajh 2019): 0 for isotropic features, 1 when all point one way. nan, with a warning, for a dataset
    without a finite ``unit_sum``."""
    if g.anisotropy_nan_because or g.n_tokens < 2:
        return math.nan
    N = g.n_tokens
    return (float(g.unit_sum @ g.unit_sum) - N) / (N * (N - 1))


@needs("WtW")
def head_erank(g: Geometry) -> float:
    """erank(W^T W) over every vocabulary row of the classifier: the effective rank of the output layer. nan, with a
    warning, where a row holds NaN or Inf (``g.head_nan_because``)."""
    return erank(g.spectra["head"])


def nc1_cdnv_freq(g: Geometry) -> float:
    """nc1_cdnv with the pair (c, c') weighted by n_c n_c': sum w (var_c + var_c') / (2 ||mu_c - mu_c'||^2) / sum w,
    w = p_c p_c', over the pairs of kept classes with a variance (n_c >= 2, as nc1_cdnv; frequent tokens' pairs
    dominate, as they do the loss); nan where fewer than 2 such classes."""
    if g.n_var < 2:
        return math.nan
    return g.pairs.cdnv_freq / (2 * g.var_pair_weight)


def gnc2_log_mean_freq(g: Geometry) -> float:
    """gnc2_log_mean with the pair (c, c') weighted by n_c n_c': sum_P w log(1/||u_c - u_c'||) / sum_P w =
    -(sum_P w l / sum_P w + log t0) / 2, l = log(T/t0). +inf when two directions coincide."""
    if g.coincident:
        return math.inf
    return -0.5 * (g.pairs.l_freq / g.pair_weight + math.log(g.t0))


def class_freq_weight(g: Geometry) -> np.ndarray:
    """Each kept class's share of the frequency weight of the pairs: half the weight p_c p_c' of every pair it is
    in, p_c (1 - p_c) / (1 - sum p^2) (the shares add up to 1)."""
    return g.p * (1 - g.p) / (2 * g.pair_weight)
