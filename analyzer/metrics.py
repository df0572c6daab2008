"""The metrics of SPEC section 4, exact (float64) and out-of-core: one small function per metric, named as in the SPEC.

Reading order: :func:`~ncanalyze.analyzer.geometry.geometry` gathers what the definitions read into a
:class:`~ncanalyze.analyzer.geometry.Geometry` (the centred means' algebra, the pairwise sums of pairs.py, the d x d
moments and spectra of spectral.py, in one dask compute); then each metric is one function of it whose docstring
gives the formula and the citation: the neural-collapse metrics here (``nc1_cdnv`` ... ``nc4_agreement`` and the
per-class views), the representation geometry beyond NC in spectral.py (``within_erank`` ... ``gnc2_log_mean_freq``).
:func:`measure_all` applies them all.

Everything that is not a pairwise sum is d x d or O(n d) algebra on M (n x d, the centred means): the ETF error
from the eigenvalues of M^T M, the dual error from <M^T M, W^T W>, the mean cosine from s = sum_c u_c.
"""
from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import threadpoolctl
import xarray as xr

from ncanalyze.analyzer import spectral
from ncanalyze.analyzer.engines import engine_device
from ncanalyze.analyzer.geometry import DECAY_RANKS, Geometry, geometry, needs
from ncanalyze.analyzer.metric_records import BY_NAME
from ncanalyze.analyzer.registry import MEASURE
from ncanalyze.analyzer.schema import CLASS_COUNTS, LABELS, NO_CLASSIFIER, PER_CLASS, SCALARS, vocabulary_classes
from ncanalyze.core.errors import UserError
from ncanalyze.core.threads import available

# ---------------------------------------------------------------- neural collapse (SPEC section 4, first table)
# Each takes the Geometry and returns a float; `needs` names the Geometry field it requires (the metric is left out
# of the result where that is missing). Their names are schema.SCALARS and schema.PER_CLASS.

def nc1_cdnv(g: Geometry) -> float:
    """mean over the pairs of kept classes with a variance (n_c >= 2: a class seen once has none) of
    (var_c + var_c') / (2 ||mu_c - mu_c'||^2): class-distance normalized variance (Galanti et al. 2022, "On the role
    of neural collapse in transfer learning"), with population variances (their code: the same). +inf when two such
    class means coincide; nan, with a warning, where fewer than 2 kept classes have a variance."""
    return g.pairs.cdnv / (2 * g.n_var_pairs) if g.n_var >= 2 else math.nan


def nc1_cdnv_p2(g: Geometry) -> float:
    """nc1_cdnv with ||mu_c - mu_c'||^4 in the denominator: the form in Wu & Papyan's code (2024)."""
    return g.pairs.cdnv_p2 / (2 * g.n_var_pairs) if g.n_var >= 2 else math.nan


def nc1_cdnv_debiased(g: Geometry) -> float:
    """nc1_cdnv as the whole population of tokens would give it, over a class set fixed by the train split (SPEC
    section 4, "Budget-stable estimates"): mean over the pairs of the fixed set (geometry.fixed_set: split share >=
    DEBIAS_SHARE, 2 or more tokens in the sample) of (v*_c + v*_c') / (2 D*_cc'), v*_c = var_c n_c/(n_c - 1) the
    unbiased variance and D* = ||mu^_c - mu^_c'||^2 - v*_c/n_c - v*_c'/n_c' the squared distance less the two means'
    noise (E||mu^_c - mu^_c'||^2 = ||mu_c - mu_c'||^2 + tr Sigma_c/n_c + tr Sigma_c'/n_c'), and 1/D* with its
    second-order (delta-method) term, which assumes Gaussian noise of the pooled within-class shape (pairs.py). A pair
    whose corrected distance is not clearly positive (D* below the noise it removed, i.e. the plug-in distance below
    twice that noise: the sample does not resolve the pair) takes the noise as its distance, a floor that keeps its
    term finite and errs low; such pairs are counted (``n_pairs_unresolved``, a warning where any). nan, with a
    warning, where fewer than 2 classes of the set are measured."""
    n = int(g.fixed.sum()) if g.fixed is not None else 0
    return g.pairs.cdnv_deb / (n * (n - 1)) if n >= 2 else math.nan


def nc1_cdnv_pooled(g: Geometry) -> float:
    """The CDNV of the pooled pairs: sum (var_c + var_c') / sum 2 ||mu_c - mu_c'||^2 over the pairs of kept classes
    with a variance (nc1_cdnv's pairs): the pairs' mean variance over their mean squared distance, so no single
    pair's near-zero distance rules it. In closed form over S (|S| = s, m_c the centred means):
    (s - 1) sum var_c / (2 (s sum ||m_c||^2 - ||sum m_c||^2)). nan where fewer than 2 such classes."""
    return pooled_cdnv(g.var, g.r, g.m_sums[0], 0.0, g.has_var)


def nc1_cdnv_pooled_debiased(g: Geometry) -> float:
    """nc1_cdnv_pooled as the whole population of tokens would give it, over the debiased metrics' fixed class set:
    sum (v*_c + v*_c') / sum 2 D*_cc', v* the unbiased variances and D* the squared distances less the two means'
    noise z_c = v*_c / n_c. Numerator and denominator are each unbiased sums over all pairs, so the ratio has no
    pair whose noise dominates (``benchmarks/budget.py`` shows it beside nc1_cdnv_debiased, a mean of ratios that
    moves with its unresolved pairs, on a real checkpoint at growing budgets). nan, with
    a warning, where the corrected distances do not sum above 0 (the means are not resolved from their noise)."""
    if g.fixed is None:
        return math.nan
    value = pooled_cdnv(g.vstar, g.r, g.m_sums[1], g.noise, g.fixed)
    if value < 0:
        warnings.warn("nc1_cdnv_pooled_debiased is nan: the class means' distances do not exceed their noise "
                      "(extract more train tokens)", stacklevel=3)
        return math.nan
    return value


def pooled_cdnv(var: np.ndarray, r: np.ndarray, m_sum: np.ndarray, noise: np.ndarray | float,
                inside: np.ndarray) -> float:
    """(s - 1) sum_S var / (2 (s sum_S r^2 - ||m_sum||^2 - (s - 1) sum_S noise)) over S = ``inside`` (s classes):
    the pooled pairs' variance over their squared distance, each distance less its two means' ``noise``."""
    s = int(np.count_nonzero(inside))
    if s < 2:
        return math.nan
    inside = np.asarray(inside, dtype=bool)
    pair_distance = s * float(np.sum(r[inside] ** 2)) - float(m_sum @ m_sum)
    pair_noise = (s - 1) * float(np.sum(np.broadcast_to(noise, r.shape)[inside]))
    return (s - 1) * float(np.sum(var[inside])) / (2 * (pair_distance - pair_noise))


@needs("sigma_w")
def nc1_trace(g: Geometry) -> float:
    """Tr(Sigma_W Sigma_B^+) / |K| (Papyan, Han & Donoho 2020), Sigma_B = M^T M / n. With M^T M = V diag(lam) V^T,
    Sigma_B^+ = n V diag(1/lam) V^T over lam > d eps max(lam) (numpy's pinv cut), so the value is
    sum_i v_i^T Sigma_W v_i / lam_i (``vsv``, computed with the spectra: on the device where they are).
    No debiased form: the class means' noise adds sum_c Sigma_c / (n_c |K|) to Sigma_B, which needs each class's
    covariance (the store keeps the pooled Sigma_W and each class's trace only), and a pseudo-inverse of a corrected
    Sigma_B is not an unbiased estimate; like the CDNV it drifts with the budget (the report's token budget says)."""
    keep = g.lam > g.lam.size * np.finfo(float).eps * g.lam.max()
    return float(np.sum(g.vsv[keep] / g.lam[keep]))


def nc2_norm_cv(g: Geometry) -> float:
    """std / mean of ||m_c|| over K: equinorm (Papyan, Han & Donoho 2020). No debiased form: E||m^_c||^2 exceeds
    ||m_c||^2 by z_c (1 - 2/|K|) + sum_c' z_c'/|K|^2 (z_c = v*_c/n_c), but a std/mean of square roots of corrected
    squares is not unbiased, and a corrected square may be negative for a class near mu_G."""
    return coefficient_of_variation(g.r, "nc2_norm_cv", "||m_c||")


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
    Undefined (nan) when two directions coincide: the spread of a set holding +inf. No debiased form: the log of a
    distance between unit vectors is not linear in the means' noise (their noise moves both the directions and the
    norms that normalise them), so no term can be removed exactly; the report's token budget says how it drifts."""
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
    """std / mean over K of cos(w_c, m_c): uniform duality (UNC3, Wu & Papyan 2024); nan, with a warning, where the
    mean duality cosine is not clearly positive (:func:`coefficient_of_variation`)."""
    return coefficient_of_variation(g.duality, "unc3_cos_cv", "cos(w_c, m_c)")


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
    """mean over the other kept classes with a variance of (var_c + var_c') / (2 ||mu_c - mu_c'||^2), for each kept
    class with a variance (n_c >= 2; nan for a class seen once, and where fewer than 2 classes have one)."""
    if g.n_var < 2:
        return np.full(g.n, np.nan)
    return np.where(g.has_var, g.row_cdnv / (2 * (g.n_var - 1)), np.nan)


def class_interference(g: Geometry) -> np.ndarray:
    """mean over c' != c in K of cos(m_c, m_c') = (u_c . s - 1) / (n - 1)."""
    return (g.us - 1) / (g.n - 1)


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


CV_MIN_SE = 3  # a coefficient of variation needs a mean above this many standard errors, std / sqrt(n) (SPEC 4)


def coefficient_of_variation(x: np.ndarray, name: str, what: str) -> float:
    """std / mean of ``x`` (population std), or nan with a warning naming ``name`` where the mean is not clearly
    positive: not more than CV_MIN_SE standard errors (std / sqrt(n), the mean's own sampling noise) above 0. A
    random classifier's duality cosines average 0 up to that noise, and a ratio to such a mean is no measure of
    spread. Scale-free: ``x`` is divided by its largest magnitude first (std's squares neither overflow nor
    underflow)."""
    x = np.asarray(x, dtype=np.float64)
    top = np.abs(x).max()
    x = x / top if top > 0 else x
    mean, std = float(x.mean()), float(x.std())
    se = std / math.sqrt(x.size)
    if not (mean > 0 and mean > CV_MIN_SE * se):
        warnings.warn(f"{name} is nan: the mean of {what} over the kept classes is {mean * top:.3g}, not more than "
                      f"{CV_MIN_SE} standard errors ({CV_MIN_SE} x {se * top:.3g}, std/sqrt({x.size})) above 0, "
                      "so std/mean measures nothing", stacklevel=4)
        return math.nan
    return std / mean


_ALL = {**vars(spectral), **globals()}
DEFINITIONS = {name: BY_NAME[name].compute or _ALL[name] for name in SCALARS}  # a record's own function, else ours
# the metrics that read the pairwise sums (g.pairs, g.coincident), and any a record computes itself (it may): a
# jackknife replicate whose pairs are sampled measures these on each estimate of its sums, the rest once
PAIR_METRICS = frozenset({"nc1_cdnv", "nc1_cdnv_p2", "nc1_cdnv_debiased", "nc2_cos_std", "gnc2_log_mean",
                          "gnc2_log_std", "nc1_cdnv_freq", "gnc2_log_mean_freq",
                          *(name for name in SCALARS if BY_NAME[name].compute is not None)})
PER_CLASS_DEFINITIONS = {name: _ALL[name] for name in PER_CLASS}


# ---------------------------------------------------------------- the entry points

def measure(ds: xr.Dataset, min_count: int = MEASURE.min_count, tile: int | None = MEASURE.tile,
            device: str = MEASURE.device, engine: str | None = None, decay_ranks: tuple[int, int] = DECAY_RANKS,
            se: bool = MEASURE.se) -> dict[str, float]:
    """The scalar metrics of one checkpoint (SPEC section 4): name -> float, then how many classes they rest on
    (``n_classes`` |K|, ``n_classes_var`` the kept classes with 2 or more train tokens, which the CDNV family reads).
    nc3_* and head_erank need ``classifier``, nc4 needs ``val_*`` counts taken over the same kept set (else
    nc4_agreement is nan, with a warning saying why), anisotropy needs ``unit_sum`` (else nan, with a warning). Every
    metric is a key: one whose inputs are missing (plain arrays without a classifier: nc3_*, unc3_cos_cv,
    nc4_agreement, head_erank) is nan, with one warning naming them; so is a coefficient of variation whose mean is
    not clearly positive, and head_erank where the classifier holds NaN or Inf. Every default is ``ncanalyze
    measure``'s (the registry's, :data:`~ncanalyze.analyzer.registry.MEASURE`): the jackknife errors too.

    Parameters
    ----------
    ds
        One checkpoint's statistics (a store group, or :func:`class_stats`).
    min_count
        The kept classes' least train count.
    tile
        Classes per tile of the pairwise sums (row panel, on torch); default from the memory.
    device
        ``auto`` (CUDA where torch sees one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``: where the pairwise
        sums and the d x d work run (torch float64 on a GPU; on the CPU, the numba pass).
    engine
        ``torch`` runs the GPU's code on the CPU (``device="cpu"``), ``numba`` insists on the CPU's; default: as
        ``device`` says (:func:`~ncanalyze.analyzer.geometry.engine_device`).
    decay_ranks
        (first, last): the ranks of Sigma_T's eigenvalues (1-based, decreasing) that ``eigen_decay`` fits, the
        last capped at r = #{lambda_i > 1e-10 lambda_1}; default (4, 100), as alpha-ReQ's authors fit it.
    se
        Add each metric's delete-one-fold jackknife error ``<metric>_se`` (jackknife.py; nan with a warning where
        the dataset holds no folds or a fold too few tokens); ``se=False``: the point values alone.

    Returns
    -------
    dict
        Metric name -> value (schema.SCALARS), then schema.CLASS_COUNTS (then the errors, with ``se``).
    """
    scalars = measure_all(ds, min_count, tile, device, engine, decay_ranks, se=se)[0]
    missing = [k for k in DEFINITIONS if k not in scalars]
    if missing:
        needs = sorted({str(getattr(DEFINITIONS[k], "needs", "")) for k in missing} - {""})
        if vocabulary_classes(ds.attrs):  # else measure_all said why
            warnings.warn(f"{', '.join(missing)} are nan: the dataset lacks what they need ({', '.join(needs)})",
                          stacklevel=2)
    errors = tuple(f"{m}_se" for m in DEFINITIONS) if se else ()
    return {k: scalars.get(k, float("nan")) for k in (*DEFINITIONS, *CLASS_COUNTS, *errors)}


def class_metrics(ds: xr.Dataset, min_count: int = MEASURE.min_count, tile: int | None = MEASURE.tile,
                  device: str = MEASURE.device, engine: str | None = None) -> xr.Dataset:
    """Per-class views over the kept set (nan elsewhere): ``class_norm`` ||m_c||, ``class_cdnv`` mean CDNV to the
    other kept classes with a variance (nan for a class seen once), ``class_interference`` mean cos(m_c, m_c') over
    them, ``class_duality`` cos(w_c, m_c), ``class_nc4`` val_ncc_agree / val_count, ``class_freq_weight`` the class's
    share of the pairs' frequency weight (gnc2_log_mean_freq's). Parameters as :func:`measure`."""
    return measure_all(ds, min_count, tile, device, engine, se=False)[1]


def measure_all(ds: xr.Dataset, min_count: int = MEASURE.min_count, tile: int | None = MEASURE.tile,
                device: str = MEASURE.device, engine: str | None = None, decay_ranks: tuple[int, int] = DECAY_RANKS,
                se: bool = MEASURE.se) -> tuple[dict[str, float], xr.Dataset]:
    """:func:`measure` and :func:`class_metrics` from one pass (the scalars: the metrics that are defined here, then
    schema.CLASS_COUNTS, then with ``se`` each metric's jackknife error ``<metric>_se``)."""
    from ncanalyze.analyzer.jackknife import sample_design

    ranks = _ranks(decay_ranks)
    sample = sample_design(ds, min_count) if se else None         # the pairs the errors sample, where they do
    g = geometry(ds, min_count, tile, device, engine, sample=sample)
    g.decay_ranks = ranks
    for name, why in (("nc4_agreement", g.nc4_nan_because), ("anisotropy", g.anisotropy_nan_because),
                      ("head_erank", g.head_nan_because)):
        if why:
            warnings.warn(f"{name} is nan: {why}", stacklevel=2)
    if g.n_var < 2:
        warnings.warn(f"nc1_cdnv, nc1_cdnv_p2, nc1_cdnv_freq, nc1_cdnv_pooled and class_cdnv are nan: only {g.n_var} of the {g.n} kept "
                      "classes have 2 or more train tokens (a class seen once has no variance); extract more tokens",
                      stacklevel=2)
    values = _each(g, DEFINITIONS | PER_CLASS_DEFINITIONS)  # the scalars and the per-class vectors, module by module
    scalars = {name: float(values[name]) for name in DEFINITIONS if name in values}
    if not vocabulary_classes(ds.attrs):
        warnings.warn(f"{', '.join(k for k in DEFINITIONS if k not in scalars)} are nan: {NO_CLASSIFIER} (labels "
                      f"{ds.attrs[LABELS]})", stacklevel=2)
    n_fixed = int(g.fixed.sum())
    scalars |= {"n_classes": float(g.n), "n_classes_var": float(g.n_var), "n_classes_debiased": float(n_fixed),
                "n_pairs_unresolved": float(g.pairs.unresolved)}
    _warn_debiased(g, n_fixed)
    per = {name: values[name] for name in PER_CLASS_DEFINITIONS if name in values}
    per_class = _per_class(ds, g.K, per)
    if se:
        errors, per_class.attrs = _errors(ds, scalars, g, sample, dict(min_count=min_count, tile=tile, device=device,
                                                                engine=engine, decay_ranks=decay_ranks, se=False))
        scalars |= errors
    return scalars, per_class


def _has(g: Geometry, f) -> bool:
    """Whether ``g`` holds the field the metric ``f`` needs (``@needs``; every metric without one)."""
    needs = getattr(f, "needs", None)
    return needs is None or getattr(g, needs) is not None


def _each(g: Geometry, definitions: dict) -> dict:
    """The definitions defined on ``g`` (those whose Geometry fields are there), computed module by module (this
    module's, then spectral.py's: the path does not go back and forth), returned in the definitions' order."""
    ready = [(name, f) for name, f in definitions.items() if _has(g, f)]
    got = {name: f(g) for name, f in sorted(ready, key=lambda nf: nf[1].__module__ != __name__)}
    return {name: got[name] for name, _ in ready}


def _scalars(g: Geometry, names=None) -> dict[str, float]:
    """The scalar metrics defined on ``g``, or those of them in ``names``."""
    chosen = DEFINITIONS if names is None else {n: f for n, f in DEFINITIONS.items() if n in names}
    return {name: float(v) for name, v in _each(g, chosen).items()}


def _warn_debiased(g: Geometry, n_fixed: int) -> None:
    """Say what nc1_cdnv_debiased rests on where it is not the whole fixed set: the classes of the set left out
    (fewer than 2 tokens in the sample), or why it is nan."""
    if n_fixed < 2:
        warnings.warn(f"nc1_cdnv_debiased is nan: only {n_fixed} class(es) of the fixed set have 2 or more train "
                      f"tokens{'; ' + g.debias_note if g.debias_note else ''}", stacklevel=3)
        return
    if g.debias_note:
        warnings.warn(f"nc1_cdnv_debiased: {g.debias_note}", stacklevel=3)
    # pairs not resolved by the sample are normal at any budget (classes sharing their contexts): counted in
    # n_pairs_unresolved beside the metric and said by the report, not warned at every checkpoint


def _errors(ds: xr.Dataset, scalars: dict[str, float], g: Geometry, sample: list | None,
            kw: dict) -> tuple[dict[str, float], dict]:
    """Each metric's jackknife error (jackknife.py), nan where its point value is not finite, and how they were made
    (``se_method``; where the pairs are sampled, ``se_sampling_error``: each estimated error's own sampling error);
    the notes of the nan ones in one warning. ``g``: the point value's geometry, with the sums of ``sample``'s
    blocks of pairs where they are sampled."""
    from ncanalyze.analyzer.jackknife import EXACT, Sampled, jackknife, sampled_jackknife, sampled_method, se_name

    how: dict = {"se_method": EXACT}
    if sample is None:
        errors, notes = jackknife(ds, lambda d: measure_all(d, **kw)[0], point=scalars, min_count=kw["min_count"])
    else:
        host = engine_device(kw["device"], kw["engine"]) is None   # the host's engine: a replicate per core
        sampled = Sampled(g.K, sample, np.array(g.pairs), g.sample_sums, np.array(g.controls),
                          lambda d, blocks: _replicate(d, blocks, kw, g.head), kw["min_count"],
                          workers=available() if host else 1)
        with threadpoolctl.threadpool_limits(1, user_api="blas") if host else contextlib.nullcontext():
            errors, sampling, notes = sampled_jackknife(ds, sampled, point=scalars)  # one BLAS thread per replicate
        how = {"se_method": sampled_method(len(sampled.blocks) // 2), "se_sampling_error": sampling}
    if notes:
        warnings.warn("jackknife errors: " + "; ".join(notes), stacklevel=3)
    return {se_name(m): errors[se_name(m)] for m in DEFINITIONS if m in scalars}, how


def _replicate(ds: xr.Dataset, blocks: list, kw: dict, head: np.ndarray | None = None):
    """A leave-one-fold-out set whose pairs are sampled (jackknife.py): the pair sums of its ``blocks``, the
    controls over every pair (pairs.CONTROLS), and its scalar metrics given estimated sums over every pair (all else
    exact, as :func:`measure_all` has it); ``head`` the point value's W^T W over the vocabulary (the folds leave the
    classifier alone)."""
    g = geometry(ds, kw["min_count"], kw["tile"], kw["device"], kw["engine"], sample=blocks, all_pairs=False,
                 head=head)
    g.decay_ranks = _ranks(kw["decay_ranks"])

    rest: dict[str, float] = {}  # the metrics that read no pair sum: the same for every estimate of them

    def at(pairs) -> dict[str, float]:
        g.pairs = pairs  # a sampled pair whose directions coincide: the log metrics are inf or nan, as with all pairs
        g.coincident = [(-1, -1, False)] if pairs.coincident > 0 else []
        if not rest:
            rest.update(_scalars(g))
            return dict(rest)
        return rest | _scalars(g, PAIR_METRICS)
    return g.sample_sums, g.controls, at


def _ranks(decay_ranks: tuple[int, int]) -> tuple[int, int]:
    """``decay_ranks`` checked: two whole ranks 1 <= first < last."""
    try:
        first, last = (int(x) for x in decay_ranks)
        ok = 1 <= first < last and (first, last) == tuple(decay_ranks)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UserError(f"decay_ranks must be two whole ranks (first, last) with 1 <= first < last (got "
                        f"{decay_ranks!r}); the default is {DECAY_RANKS}")
    return first, last


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



def etf_error_from_spectrum(lam: np.ndarray, n: int) -> float:
    """||G/||G||_F - (I - 11^T/n)/sqrt(n-1)||_F from the eigenvalues of M^T M (= the non-zero ones of G = M M^T).

    M is centred, so G lives on the (n-1)-space orthogonal to 1, where the simplex target is I/sqrt(n-1): the
    error is a sum of squares over G's n-1 eigenvalues there (the top ones of M^T M, padded with zeros), exact to
    rounding even at 0.
    """
    lam = np.sort(lam)[::-1][: n - 1]
    lam = lam / lam[0] if lam[0] > 0 else lam                     # scale-free: the squares neither overflow nor vanish
    g = math.sqrt(float(np.sum(lam * lam)))
    target = 1 / math.sqrt(n - 1)
    return math.sqrt(float(np.sum((lam / g - target) ** 2)) + (n - 1 - lam.size) * target ** 2)


def dual_error(MtM: np.ndarray, WtW: np.ndarray, trace_s: float, m_sum: np.ndarray, w_sum: np.ndarray,
               n: int) -> float:
    """||S/||S||_F - (I - 11^T/n)/sqrt(n-1)||_F for S = M W^T, from d x d quantities: ||S||_F^2 = <M^T M, W^T W>,
    <S, I - 11^T/n> = tr S - (1^T M)(W^T 1)/n. The expanded square loses ~1e-8 absolute near 0. Scale-free: M^T M and
    W^T W are divided by their largest entries (a, b) before their product, and so are the terms of the inner
    product (by sqrt(a b)), so nothing is squared at the features' own scale."""
    a, b = float(np.abs(MtM).max()), float(np.abs(WtW).max())
    s_norm = math.sqrt(float(np.sum((MtM / a) * (WtW / b))))       # ||S||_F / sqrt(a b)
    root = math.sqrt(a) * math.sqrt(b)
    inner = (trace_s / root - float((m_sum / math.sqrt(a)) @ (w_sum / math.sqrt(b))) / n) / (s_norm * math.sqrt(n - 1))
    return math.sqrt(max(2 - 2 * inner, 0.0))

