"""Fidelity to the published definitions and trust at the edges (issues 29-31): the erank's noise cut on every path,
RankMe, alpha-ReQ's weighted fit, scale-freedom from 1e-150 to 1e150, identical classes, a NaN head row, a corrupt
within_covariance, coefficients of variation over a mean that is not clearly positive, and NC1 over the classes
that have a variance; each against a brute force written here or a planted answer, on the numba and torch paths."""
from __future__ import annotations

import math
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from test_geometry import erank_of, exact_white, weighted_decay
from test_metrics import simplex, stats_dataset

from ncanalyze.analyzer import CLASS_COUNTS, SCALARS, UserError, class_stats, measure, measure_all
from ncanalyze.core.errors import CheckpointError

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import fidelity  # noqa: E402  (benchmarks/fidelity.py: the README's departure figures)

TORCH = {"device": "cpu", "engine": "torch"}
EPS = np.finfo(float).eps


def quiet(f, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return f(*a, **kw)


def both(ds, **kw) -> tuple[dict, dict]:
    """measure on the numba path and on the torch path (the GPU's code, on the CPU)."""
    return quiet(measure, ds, device="cpu", **kw), quiet(measure, ds, **TORCH, **kw)


def assert_close(got: dict, want: dict, keys, rtol: float) -> None:
    bad = {k: (got[k], want[k]) for k in keys if not math.isclose(got[k], want[k], rel_tol=rtol, abs_tol=1e-300)}
    assert not bad, bad


# ---------------------------------------------------------------- A1 / B3: the erank's noise cut, every path

def test_a_simplex_etf_head_has_erank_exactly_c_minus_1():
    """W's rows an exact simplex ETF of C classes in d > C dimensions: W^T W has C - 1 equal eigenvalues and d - C + 1
    rounding-noise ones; the cut leaves exactly C - 1 (without it, the noise's square roots add ~1e-7)."""
    C, d = 12, 40
    W = simplex(C, d, scale=2.0)
    W -= W.mean(0)                                                 # centred: the ETF itself
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(C), 5)
    ds = class_stats(rng.standard_normal((len(y), d)), y, C, classifier=W)
    fast, dev = both(ds)
    s = np.linalg.svd(W, compute_uv=False)                        # the explicit matrix's singular values
    assert erank_of(s, d) == pytest.approx(C - 1, abs=1e-12)
    assert fast["head_erank"] == pytest.approx(C - 1, abs=1e-12)
    assert dev["head_erank"] == pytest.approx(C - 1, abs=1e-12)
    noise = np.sort(np.abs(np.linalg.eigvalsh(W.T @ W)))[: d - C + 1]
    assert noise.max() > 0                                         # the failure the cut closes is there
    uncut = np.sqrt(np.r_[np.full(C - 1, 1.0), noise / np.linalg.eigvalsh(W.T @ W).max()])
    p = uncut / uncut.sum()
    assert abs(math.exp(-np.sum(p[p > 0] * np.log(p[p > 0]))) - (C - 1)) > 1e-9


@pytest.mark.slow
def test_a_rank_10_between_matrix_at_d_1024():
    """11 class means spanning 10 dimensions of R^1024: between_erank = the SVD's erank of the centred means, and
    the 1014 null eigenvalues (noise around 1e-16 lambda_max) are cut on both paths."""
    rng = np.random.default_rng(1)
    d, n = 1024, 11
    basis = np.linalg.qr(rng.standard_normal((d, 10)))[0].T
    means = rng.standard_normal((n, 10)) * rng.uniform(0.5, 3, 10) @ basis + rng.standard_normal(d)
    ds = stats_dataset(means, classifier=means - means.mean(0))
    ds["within_covariance"] = ("hidden", "hidden2"), np.eye(d) * 0.5
    fast, dev = both(ds)
    m = means - means.mean(0)
    want = erank_of(np.linalg.svd(m, compute_uv=False), d)
    assert 5 < want < 10
    assert fast["between_erank"] == pytest.approx(want, rel=1e-12)
    assert dev["between_erank"] == pytest.approx(want, rel=1e-12)
    lam = np.linalg.eigvalsh(m.T @ m)                             # what the cut removes: 1014 values of noise
    assert np.sum(np.abs(lam) > d * EPS * lam.max()) == 10
    s_all = np.sqrt(np.abs(lam))
    p = s_all / s_all.sum()
    assert abs(math.exp(-np.sum(p[p > 0] * np.log(p[p > 0]))) / want - 1) > 1e-7   # uncut: the noise counts


def test_layernorm_features_give_the_same_eranks_on_both_paths():
    """Features centred across the hidden dimensions (a LayerNorm without gain: rank d - 1, the all-ones null
    direction): within, total and RankMe's eranks equal between the numba/numpy and torch paths to 1e-12, and the
    SVDs of the features."""
    rng = np.random.default_rng(2)
    N, d, C = 3000, 24, 15
    y = rng.integers(0, C, N)
    h = rng.standard_normal((C, d))[y] * 2 + rng.standard_normal((N, d)) @ np.diag(rng.uniform(0.2, 2, d))
    h -= h.mean(1, keepdims=True)
    h /= h.std(1, keepdims=True)
    ds = class_stats(h, y, C)
    fast, dev = both(ds)
    assert_close(dev, fast, ("within_erank", "total_erank", "rankme", "between_erank"), 1e-12)
    mean = np.array([h[y == c].mean(0) for c in range(C)])
    assert fast["within_erank"] == pytest.approx(erank_of(np.linalg.svd(h - mean[y], compute_uv=False), d), rel=1e-10)
    assert fast["total_erank"] == pytest.approx(erank_of(np.linalg.svd(h - h.mean(0), compute_uv=False), d), rel=1e-10)
    assert fast["rankme"] == pytest.approx(erank_of(np.linalg.svd(h, compute_uv=False), d), rel=1e-10)
    assert fast["total_erank"] < d - 1                             # the null direction counts as 0


# ---------------------------------------------------------------- A2: RankMe

@pytest.mark.parametrize("offset", [0.0, 5.0])
def test_rankme_is_the_erank_of_the_raw_feature_matrix(offset):
    """RankMe = erank of the singular values of the uncentred N x d feature matrix (brute force from the raw arrays),
    from the stored statistics on both paths; with a common offset it counts the mean direction, total_erank not."""
    rng = np.random.default_rng(3)
    N, d, C = 2000, 10, 25
    y = rng.integers(0, C, N)
    h = rng.standard_normal((C, d))[y] + rng.standard_normal((N, d)) @ np.diag(rng.uniform(0.1, 2, d)) + offset
    fast, dev = both(class_stats(h, y, C))
    want = erank_of(np.linalg.svd(h, compute_uv=False), d)
    assert fast["rankme"] == pytest.approx(want, rel=1e-10)
    assert dev["rankme"] == pytest.approx(fast["rankme"], rel=1e-12)
    if offset:
        assert fast["rankme"] < fast["total_erank"] - 0.5         # one dominant mean direction


# ---------------------------------------------------------------- A3: eigen_decay as alpha-ReQ fits it

@pytest.mark.parametrize("alpha", [0.6, 1.0, 2.3])
def test_eigen_decay_recovers_an_exact_power_law(alpha):
    """Sigma_T's eigenvalues exactly i^-alpha, d = 150 (the fit reads ranks 4..100): alpha to 1e-10, both paths."""
    rng = np.random.default_rng(4)
    N, d = 2000, 150
    rotation = np.linalg.qr(rng.standard_normal((d, d)))[0]
    h = exact_white(N, d, 5) * np.arange(1, d + 1) ** (-alpha / 2) @ rotation + 1.0
    fast, dev = both(class_stats(h, rng.integers(0, 20, N), 20))
    assert fast["eigen_decay"] == pytest.approx(alpha, abs=1e-10)
    assert dev["eigen_decay"] == pytest.approx(alpha, abs=1e-10)


def test_eigen_decay_is_the_weighted_fit_over_ranks_4_to_100_and_the_range_is_a_keyword():
    """A spectrum that is no power law: measure = numpy's polyfit with weights sqrt(1/i) over 4..min(100, r), and
    the closed form of the 1/i-weighted slope; another range through measure and ds.nc.measure; fewer than 2 ranks:
    nan; a bad range: one line."""
    rng = np.random.default_rng(6)
    N, d = 3000, 130
    h = exact_white(N, d, 7) * np.sort(rng.uniform(0.01, 3, d))[::-1] ** 1.5
    y = rng.integers(0, 12, N)
    ds = class_stats(h, y, 12)
    lam = np.linalg.eigvalsh(np.cov(h.T, bias=True))
    want = weighted_decay(lam)
    i = np.arange(4, 101)
    x, z, w = np.log(i), np.log(np.sort(lam)[::-1][3:100]), 1 / i
    closed = -(w.sum() * (w * x * z).sum() - (w * x).sum() * (w * z).sum()) / (w.sum() * (w * x * x).sum()
                                                                               - (w * x).sum() ** 2)
    assert want == pytest.approx(closed, rel=1e-10)
    fast, dev = both(ds)
    assert fast["eigen_decay"] == pytest.approx(want, rel=1e-10)
    assert dev["eigen_decay"] == pytest.approx(want, rel=1e-10)
    unweighted = -np.polyfit(np.log(np.arange(1, d + 1)), np.log(np.sort(lam)[::-1]), 1)[0]   # the old fit
    assert abs(unweighted - want) > 1e-3
    other = quiet(ds.nc.measure, decay_ranks=(2, 50))["eigen_decay"]
    assert other == pytest.approx(weighted_decay(lam, 2, 50), rel=1e-10) and abs(other - want) > 1e-3
    small = class_stats(rng.standard_normal((200, 4)), rng.integers(0, 5, 200), 5)
    assert math.isnan(quiet(measure, small)["eigen_decay"])       # ranks 4..4: one rank
    for bad in ((0, 10), (5, 5), (4,), "4-100"):
        with pytest.raises(UserError, match="decay_ranks must be two whole ranks"):
            measure(ds, decay_ranks=bad)


# ---------------------------------------------------------------- A4: the departures the README quotes

def test_the_departure_figures_rest_on_a_checked_brute_force():
    """benchmarks/fidelity.py's variants agree with measure where they compute our definition, and the departures
    it reports are real: LiDAR's absolute delta moves it at a 1e-3 feature scale, not at 1; a token-mean centre moves
    the centred-mean metrics on Zipfian counts; n_c - 1 raises CDNV; lambda weights count fewer directions."""
    small, unit = quiet(fidelity.lidar_gap, 1e-3), quiet(fidelity.lidar_gap, 1.0)
    assert small["ours"] == pytest.approx(unit["ours"], rel=1e-9)            # ours is scale-free
    assert small["ours"] == pytest.approx(small["ours (brute)"], rel=1e-12)
    assert small["abs 0.0001"] / small["ours"] - 1 > 0.2 and abs(unit["abs 0.0001"] / unit["ours"] - 1) < 1e-3
    h, y = fidelity.planted(zipf=True)
    ds = class_stats(h, y, int(y.max()) + 1)
    got = quiet(measure, ds)
    mu = ds["mean"].values
    ours = fidelity.centred_metrics(mu, mu.mean(0), ds["within_covariance"].values)
    assert_close(got, ours, ours, 1e-9)
    gaps = quiet(fidelity.mu_g_gap)
    assert all(abs(b / a - 1) > 1e-3 for a, b in gaps.values())
    pop, measured, unbiased = quiet(fidelity.cdnv_gap)
    assert measured == pytest.approx(pop, rel=1e-12) and unbiased > pop
    assert all(b < a for a, b in fidelity.weight_gap().values())


# ---------------------------------------------------------------- B1: scale-free from 1e-150 to 1e150

SCALE_FREE = [k for k in SCALARS if k not in ("nc1_cdnv_p2", "nc4_agreement")]


def test_scale_free_metrics_are_the_same_from_1e_minus_150_to_1e150():
    """The same planted geometry (features x s, the classifier as it is) at s = 1e-150 ... 1e150, float64 through
    class_stats: every scale-free metric equal to ~1e-12 relative on both paths (before, the ETF and dual errors
    squared M^T M's eigenvalues (inf or 0 there) and anisotropy's unit features had an absolute 1e-12 floor);
    nc1_cdnv_p2 scales as s^-2."""
    rng = np.random.default_rng(8)
    C, d = 6, 5
    y = np.repeat(np.arange(C), 20)
    centres = rng.standard_normal((C, d)) * 2
    h = centres[y] + rng.standard_normal((len(y), d)) + 0.5
    W = centres - centres.mean(0) + 0.3 * rng.standard_normal((C, d))  # duality mean clearly positive
    ref = both(class_stats(h, y, C, classifier=W))
    assert all(math.isfinite(ref[0][k]) for k in SCALE_FREE)
    for s in (1e-150, 1e-77, 1e77, 1e150):
        for got, want in zip(both(class_stats(h * s, y, C, classifier=W)), ref):
            assert_close(got, want, SCALE_FREE, 1e-11)
            assert got["nc1_cdnv_p2"] * s * s == pytest.approx(want["nc1_cdnv_p2"], rel=1e-11)


# ---------------------------------------------------------------- B2: identical classes

@pytest.mark.parametrize("noise", [0.0, 1e-15])
@pytest.mark.parametrize("engine", ["numba", "torch"])
def test_identical_class_means_are_refused(noise, engine):
    """Every class mean the same (a dead final norm with gain 0: identical features), exactly or up to 1e-15
    relative noise: one line saying so, not metrics from noise nor a division by zero."""
    rng = np.random.default_rng(9)
    V, d = 8, 6
    means = np.tile(rng.standard_normal(d) * 3, (V, 1)) * (1 + noise * rng.standard_normal((V, d)))
    ds = stats_dataset(means, classifier=rng.standard_normal((V, d)))
    with pytest.raises(CheckpointError, match="the 8 kept classes have one and the same mean .*gain 0"):
        measure(ds, device="cpu", engine=engine)
    zero = class_stats(np.zeros((40, d)), np.arange(40) % V, V)    # no bias either: every feature 0
    with pytest.raises(CheckpointError, match="one and the same mean .the centred means are all zero"):
        measure(zero, device="cpu", engine=engine)
    means[3] += 1e-6 * np.abs(means).max()                         # one class apart: measured
    assert math.isfinite(quiet(measure, stats_dataset(means), device="cpu", engine=engine)["nc2_cos_mean"])


@pytest.mark.parametrize("engine", ["numba", "torch"])
def test_classes_centred_on_one_point_are_refused_not_measured_from_rounding(engine):
    """Every class's features centred on 0 (its mean 0 up to rounding, its spread ~1): the centred means are rounding
    noise of the within-class spread, though not of the means' own (equally tiny) norm. One line saying so, not
    nc1_cdnv ~1e32 from noise; classes apart by 1e-4 of the spread are measured, their CDNV as the brute force."""
    rng = np.random.default_rng(37)
    V, d, n = 8, 6, 50
    y = np.repeat(np.arange(V), n)
    h = rng.standard_normal((V * n, d))
    h -= np.repeat(h.reshape(V, n, d).mean(1), n, axis=0)  # each class centred on 0
    ds = class_stats(h, y, V, classifier=rng.standard_normal((V, d)))
    assert 0 < np.abs(ds["mean"].values).max() < 1e-15  # the means: rounding
    with pytest.raises(CheckpointError, match=r"one and the same mean .*e-1\d of the within-class spread"):
        quiet(measure, ds, device="cpu", engine=engine)
    apart = h + 1e-4 * np.repeat(rng.standard_normal((V, d)), n, axis=0)
    got = quiet(measure, class_stats(apart, y, V), device="cpu", engine=engine)
    mu = np.stack([apart[y == c].mean(0) for c in range(V)])  # float64 brute force of nc1_cdnv
    var = np.array([((apart[y == c] - mu[c]) ** 2).sum(1).mean() for c in range(V)])
    pairs = [(var[a] + var[b]) / (2 * np.sum((mu[a] - mu[b]) ** 2)) for a in range(V) for b in range(a + 1, V)]
    assert got["nc1_cdnv"] == pytest.approx(np.mean(pairs), rel=1e-9)


# ---------------------------------------------------------------- B8: a NaN row in the output layer

def test_a_nan_head_row_makes_head_erank_nan_and_leaves_the_rest():
    """A token the data never holds with a NaN row in the classifier: W^T W is NaN, so head_erank is nan with a
    warning naming it and the row (not numpy's LinAlgError), and every other metric is what it is without it."""
    rng = np.random.default_rng(10)
    V, d = 30, 7
    y = rng.integers(0, V - 3, 1500)                              # the last 3 tokens never occur
    W = rng.standard_normal((V, d))
    ds = class_stats(rng.standard_normal((V, d))[y] + rng.standard_normal((1500, d)), y, V, classifier=W)
    clean = both(ds)
    ds["classifier"] = ds["classifier"].copy(data=np.where(np.arange(V)[:, None] == V - 2, np.nan, W))
    for kw, want in zip(({"device": "cpu"}, TORCH), clean):
        why = rf"head_erank is nan: the classifier's rows of 1 token\(s\) \(\[{V - 2}\]\)"
        with pytest.warns(UserWarning, match=why):
            got = measure(ds, **kw)
        assert math.isnan(got["head_erank"]) and math.isfinite(want["head_erank"])
        rest = [k for k in SCALARS if k not in ("head_erank", "nc4_agreement", "unc3_cos_cv")]
        assert_close(got, want, rest, 1e-12)
        assert math.isnan(got["unc3_cos_cv"]) and math.isnan(want["unc3_cos_cv"])  # a random head: no CV


# ---------------------------------------------------------------- B14: a corrupt within_covariance

@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_corrupt_within_covariance_is_a_checkpoint_error(bad, tmp_path):
    """NaN or Inf in one triangle of the stored within_covariance: a CheckpointError naming the variable (an
    eigendecomposition reads one triangle and would give numbers), on both paths; the store's measure skips that
    checkpoint with the fix and measures the others."""
    from ncanalyze.store.measure import measure_store
    from test_measure_store import write_checkpoint

    rng = np.random.default_rng(11)
    y = rng.integers(0, 10, 500)
    ds = class_stats(rng.standard_normal((500, 4)) + rng.standard_normal((10, 4))[y], y, 10)
    cov = ds["within_covariance"].values.copy()
    cov[0, 3] = bad                                               # the upper triangle only
    ds["within_covariance"] = ds["within_covariance"].copy(data=cov)
    for kw in ({"device": "cpu"}, TORCH):
        with pytest.raises(CheckpointError, match=r"within_covariance holds 1 NaN or Inf entries.*extract again"):
            measure(ds, **kw)
    store = tmp_path / "s.zarr"
    write_checkpoint(store, "a", 1, seed=1)
    broken = write_checkpoint(store, "a", 2, seed=2)
    cov = broken["within_covariance"].values.copy()
    cov[1, 2] = bad
    xr.Dataset({"within_covariance": broken["within_covariance"].copy(data=cov)}).to_zarr(
        store, group="a/checkpoint-2", mode="r+", consolidated=False, zarr_format=3)
    with pytest.warns(UserWarning, match="a/checkpoint-2: skipped: within_covariance holds 1 NaN or Inf"):
        df = quiet_except_skips(measure_store, store).table
    assert list(df.checkpoint) == ["checkpoint-1"]


def quiet_except_skips(f, *a):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?!.*skipped)")
        return f(*a)


# ---------------------------------------------------------------- C1: coefficients of variation

def duality_dataset(cosines: np.ndarray) -> xr.Dataset:
    """Simplex class means with classifier rows at the given cosines to their centred means."""
    C, d = len(cosines), len(cosines) + 2
    means = simplex(C, d)
    m = means - means.mean(0)
    u = m / np.linalg.norm(m, axis=1, keepdims=True)
    rng = np.random.default_rng(12)
    perp = rng.standard_normal((C, d))
    perp -= np.sum(perp * u, 1, keepdims=True) * u
    perp /= np.linalg.norm(perp, axis=1, keepdims=True)
    W = (cosines[:, None] * u + np.sqrt(1 - cosines ** 2)[:, None] * perp) * rng.uniform(0.5, 2, (C, 1))
    return stats_dataset(means, classifier=W)


@pytest.mark.parametrize("kind", ["zero", "negative", "tiny"])
def test_unc3_cos_cv_is_nan_where_the_mean_duality_is_not_clearly_positive(kind):
    cos = {"zero": np.array([0.4, -0.4, 0.2, -0.2, 0.1, -0.1, 0.3, -0.3]),
           "negative": np.array([-0.5, -0.3, -0.6, -0.2, -0.4, -0.35, -0.45, -0.5]),
           "tiny": np.array([0.4, -0.4, 0.2, -0.2, 0.1, -0.1, 0.3, -0.2996])}[kind]
    assert kind != "tiny" or 0 < cos.mean() <= 1e-3 * cos.std()
    ds = duality_dataset(cos)
    for kw in ({"device": "cpu"}, TORCH):
        with pytest.warns(UserWarning, match="unc3_cos_cv is nan: the mean of cos.w_c, m_c. over the kept classes"):
            got = measure(ds, **kw)
        assert math.isnan(got["unc3_cos_cv"]) and got["nc3_cos_mean"] == pytest.approx(cos.mean(), abs=1e-12)
        assert math.isfinite(got["nc2_norm_cv"])


def test_unc3_cos_cv_of_20_random_heads_is_nan():
    """A random classifier's duality cosines average 0 up to their sampling noise: "clearly positive" is more than 3
    standard errors (std/sqrt(n)) above 0, so every one of 20 random heads gives nan (the old rule, mean > 1e-3 std,
    gave most of them a finite CV), with the warning; the brute-force cosines say the same."""
    rng = np.random.default_rng(37)
    V, d, old_rule, cvs, said = 64, 32, 0, [], 0
    for _ in range(20):
        means, W = rng.standard_normal((V, d)), rng.standard_normal((V, d))
        m = means - means.mean(0)
        cos = np.sum(W * m, 1) / (np.linalg.norm(W, axis=1) * np.linalg.norm(m, axis=1))  # float64 brute force
        old_rule += cos.mean() > 0 and cos.mean() > 1e-3 * cos.std()
        assert cos.mean() <= 3 * cos.std() / np.sqrt(V)  # noise: within 3 standard errors of 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = measure(stats_dataset(means, classifier=W), device="cpu")
        said += any(re.search(r"unc3_cos_cv is nan: .* not more than 3 standard errors", str(w.message))
                    for w in caught)
        cvs.append(got["unc3_cos_cv"])
        assert got["nc3_cos_mean"] == pytest.approx(cos.mean(), abs=1e-12)
    assert [c for c in cvs if not math.isnan(c)] == [] and said == 20
    assert old_rule >= 6  # the test can fail: the old rule gave these heads a number


def test_unc3_cos_cv_where_the_mean_is_positive():
    cos = np.array([0.9, 0.7, 0.8, 0.5, 0.95, 0.6, 0.85, 0.75])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cv is nan")
        fast, dev = both(duality_dataset(cos))
    assert fast["unc3_cos_cv"] == pytest.approx(cos.std() / cos.mean(), rel=1e-12)
    assert dev["unc3_cos_cv"] == pytest.approx(fast["unc3_cos_cv"], rel=1e-12)


# ---------------------------------------------------------------- C2: NC1 over the classes that have a variance

def brute_cdnv(count, mu, var, K):
    """nc1_cdnv, _p2, _freq and per-class CDNV over the kept classes with n >= 2, by loops."""
    V2 = [c for c in K if count[c] >= 2]
    terms = {(a, b): ((var[a] + var[b]) / (2 * np.sum((mu[a] - mu[b]) ** 2)), np.sum((mu[a] - mu[b]) ** 2))
             for i, a in enumerate(V2) for b in V2[i + 1:]}
    q = np.array([t for t, _ in terms.values()])
    w = np.array([count[a] * count[b] for a, b in terms], dtype=float)
    per = {c: np.mean([terms[min(c, o), max(c, o)][0] for o in V2 if o != c]) for c in V2}
    return {"nc1_cdnv": q.mean(), "nc1_cdnv_p2": np.mean([t / D for t, D in terms.values()]),
            "nc1_cdnv_freq": np.sum(w * q) / w.sum()}, per


@pytest.mark.parametrize("min_count", [1, 2])
def test_cdnv_reads_only_classes_with_two_or_more_tokens(min_count):
    rng = np.random.default_rng(13)
    V, d = 40, 6
    counts = np.r_[rng.integers(2, 30, 25), np.ones(10, int), np.zeros(5, int)]
    y = np.repeat(np.arange(V), counts)
    h = rng.standard_normal((V, d))[y] * 2 + rng.standard_normal((len(y), d))
    ds = class_stats(h, y, V)
    K = np.flatnonzero(counts >= min_count)
    want, per_want = brute_cdnv(counts, ds["mean"].values, ds["variance"].values, K)
    for kw in ({"device": "cpu"}, TORCH):
        got, per = quiet(measure_all, ds, min_count, 7, **kw)
        assert_close(got, want, want, 1e-10)
        assert (got["n_classes"], got["n_classes_var"]) == (len(K), 25)
        cd = per["class_cdnv"].values
        np.testing.assert_allclose(cd[list(per_want)], list(per_want.values()), rtol=1e-10)
        assert np.isnan(np.delete(cd, list(per_want))).all()
        m = ds["mean"].values[K] - ds["mean"].values[K].mean(0)   # the other metrics: the kept set as it was
        u = m / np.linalg.norm(m, axis=1, keepdims=True)
        s = u.sum(0)
        assert got["nc2_cos_mean"] == pytest.approx((s @ s - len(K)) / (len(K) * (len(K) - 1)), rel=1e-12)
    assert list(quiet(measure, ds, min_count, se=False)) == [*SCALARS, *CLASS_COUNTS]


def test_cdnv_without_two_classes_with_a_variance_is_nan_with_a_warning():
    rng = np.random.default_rng(14)
    y = np.r_[0, 0, 0, np.arange(1, 8)]                            # one class seen 3 times, seven seen once
    ds = class_stats(rng.standard_normal((10, 3)), y, 8)
    with pytest.warns(UserWarning, match="nc1_cdnv, nc1_cdnv_p2, nc1_cdnv_freq, nc1_cdnv_pooled and class_cdnv are nan: only 1 of "
                      "the 8 kept classes"):
        got, per = measure_all(ds)
    assert all(math.isnan(got[k]) for k in ("nc1_cdnv", "nc1_cdnv_p2", "nc1_cdnv_freq"))
    assert np.isnan(per["class_cdnv"].values).all() and math.isfinite(got["nc2_cos_mean"])
