"""The d x d end of the geometry, shared by both engines (engine_numba.py, engine_torch.py): the eigen-decomposition
of M^T M and the spectra of the representation geometry, written once over the engine's linear algebra ``la``
(numpy.linalg, or engine_torch.TorchLinalg on a device), and the checks and sums both engines make of the centred
means."""
from __future__ import annotations

import numpy as np
from scipy.linalg import solve_triangular

from ncanalyze.core.errors import CheckpointError, UserError

SAME_MEANS = 1e-10  # centred means below this fraction of the means' own norm: rounding noise, not classes
SAME_SPREAD = 1e-6  # nor below this fraction of the features' within-class spread (each class centred on 0)


def pair_mean(s: np.ndarray, n: int) -> float:
    """t0, the mean over P of T = ||u_c - u_c'||^2 = 2 - 2 cos, from s = sum_c u_c.

    Parameters
    ----------
    s
        The sum of the n unit centred means.
    n
        The number of kept classes.

    Returns
    -------
    float
        t0 = 2 - 2 (||s||^2 - n) / (n (n - 1)).
    """
    return 2 - 2 * (float(s @ s) - n) / (n * (n - 1))


def check_finite(x: np.ndarray, what: str) -> None:
    """A CheckpointError naming ``what`` where ``x`` holds NaN or Inf (corrupt statistics)."""
    if not np.isfinite(x).all():
        raise CheckpointError(f"the {what} of kept classes contain NaN or Inf: the statistics are corrupt; extract "
                              "again")


def check_covariance(sigma_w: np.ndarray | None) -> None:
    """A CheckpointError where the stored within_covariance holds NaN or Inf (corrupt statistics: an
    eigendecomposition would read one triangle of it and give numbers anyway)."""
    if sigma_w is not None and not np.isfinite(sigma_w).all():
        bad = int(np.size(sigma_w) - np.isfinite(sigma_w).sum())
        raise CheckpointError(f"within_covariance holds {bad} NaN or Inf entries: the statistics are corrupt; extract "
                              "again (--overwrite)")


def check_centred(r: np.ndarray, var: np.ndarray, K: np.ndarray, scale: float) -> None:
    """A CheckpointError where the norms r_c of the centred means or the variances are not finite, where every
    centred mean is zero or rounding noise (max r_c <= SAME_MEANS x ``scale``, or <= SAME_SPREAD x the within-class
    spread, the root of the mean variance: the classes share one mean, up to rounding of the features' own scale,
    even where that mean is 0), or where an r_c is zero.

    Parameters
    ----------
    r, var
        Per kept class: ||m_c|| and the variance.
    K
        The kept classes (named in the message).
    scale
        The means' own scale, max_c ||mu_c|| over K.
    """
    check_finite(np.r_[r, var], "class means or variances")
    spread = float(np.sqrt(var.mean()))
    if not (r.max() > SAME_MEANS * scale and r.max() > SAME_SPREAD * spread):
        size = "all zero" if r.max() == 0 else (
            f"{r.max() / spread:.1e} of the within-class spread" if r.max() <= SAME_SPREAD * spread
            else f"{r.max() / scale:.1e} of the means' own norm") + ", rounding noise"
        raise CheckpointError(
            f"the {K.size} kept classes have one and the same mean (the centred means are {size}): the features do "
            "not depend on the class (as after a final norm with gain 0), so the metrics are undefined; measure "
            "another layer or checkpoint")
    zero = np.flatnonzero(r <= 1e-12 * r.max())
    if zero.size:
        raise UserError(f"class(es) {K[zero[:5]].tolist()} have a zero-norm centred mean (their mean equals the "
                        "global mean of the kept classes), so cosines, GNC2 and NC3 are undefined; raise "
                        "--min-count or leave them out")


def finish_moments(out: dict[str, np.ndarray], sigma_w: np.ndarray | None, delta: np.ndarray, mu: np.ndarray,
                   n: int, la=np.linalg) -> dict[str, np.ndarray]:
    """The moments with the eigen-decomposition of M^T M (``lam``, ``V``) and the ``spectra``, by the engine's
    linear algebra ``la`` (numpy.linalg on the host; engine_torch.TorchLinalg, torch.linalg on a device).

    Parameters
    ----------
    out
        The d x d moments (``MtM``, ``MtFM``; with the classifier ``WtW``, ``head``) and per-class ``wn``, ``wm``.
    sigma_w
        The within-class covariance, or None.
    delta, mu, n
        sum_c f_c a_c (see engine_numba._moments), the token-weighted mean of all train features mu = mu_G + delta,
        and the number of kept classes.
    la
        numpy.linalg's eigh, eigvalsh and cholesky (numpy.linalg itself, or an engine's object with them, and with
        ``quad`` and ``solve_lower`` where it has its own).

    Returns
    -------
    dict
        ``out`` with ``lam``, ``V``, ``vsv`` (with sigma_w) and ``spectra``.
    """
    out["lam"], out["V"] = la.eigh(out["MtM"])
    if sigma_w is not None:                                       # v_i^T Sigma_W v_i (nc1_trace): O(d^3) too
        quad = getattr(la, "quad", None) or (lambda S, V: np.sum(V * (S @ V), 0))
        out["vsv"] = quad(sigma_w, out["V"])
    out["spectra"] = _spectra(out, sigma_w, delta, mu, n, la)
    return out


def _spectra(mom: dict[str, np.ndarray], sigma_w: np.ndarray | None, delta: np.ndarray, mu: np.ndarray, n: int,
             la=np.linalg) -> dict[str, np.ndarray]:
    """The eigenvalues (ascending, ``la.eigvalsh`` in float64) of the d x d matrices of spectral.py:
    ``between`` Sigma_B = M^T M / n; with Sigma_W, ``within`` Sigma_W, ``total`` Sigma_T = Sigma_W + sum_c f_c
    (mu_c - mu)(mu_c - mu)^T (the law of total covariance), ``second`` the raw features' second moment
    E[h h^T] = Sigma_T + mu mu^T (RankMe) and ``lidar`` (:func:`lidar_spectrum`); with the classifier, ``head``
    W^T W over the whole vocabulary (nan where the classifier holds NaN or Inf: an eigendecomposition would fail)."""
    out = {"between": mom["lam"] / n}
    if sigma_w is not None:
        total = sigma_w + mom["MtFM"] - np.outer(delta, delta)
        out |= {"within": la.eigvalsh(sigma_w), "total": la.eigvalsh(total),
                "second": la.eigvalsh(total + np.outer(mu, mu)), "lidar": lidar_spectrum(sigma_w, mom["MtM"] / n, la)}
    if "WtW" in mom:
        head = mom["head"]
        out["head"] = la.eigvalsh(head) if np.isfinite(head).all() else np.full(len(head), np.nan)
    return out


def lidar_spectrum(sigma_w: np.ndarray, sigma_b: np.ndarray, la=np.linalg, eps: float | None = None) -> np.ndarray:
    """The eigenvalues of (Sigma_W + eps I)^(-1/2) Sigma_B (Sigma_W + eps I)^(-1/2), eps = 1e-4 tr(Sigma_W) / d
    (or the given ``eps``: the published code's absolute 1e-4 or 1e-6, for comparison), as those of the similar
    matrix L^-1 Sigma_B L^-T (L L^T = Sigma_W + eps I, Cholesky): one factorisation, two triangular solves and one
    eigvalsh (``la``: numpy's and scipy's, or engine_torch.TorchLinalg). nan where Sigma_W is zero (no within-class noise)
    or not positive semi-definite (corrupt statistics)."""
    eps = 1e-4 * np.trace(sigma_w) / len(sigma_w) if eps is None else eps
    try:
        L = la.cholesky(sigma_w + eps * np.eye(len(sigma_w))) if eps > 0 else None
    except np.linalg.LinAlgError:
        L = None
    if L is None:
        return np.full(len(sigma_w), np.nan)
    solve = getattr(la, "solve_lower", None) or (lambda L, B: solve_triangular(L, B, lower=True))
    X = solve(L, sigma_b)                                         # L^-1 Sigma_B
    return la.eigvalsh(solve(L, X.T))
