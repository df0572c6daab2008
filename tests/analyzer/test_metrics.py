"""The metrics against independent brute-force float64 computations, planted geometries, scale and bad input."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import dask.array as da
import numpy as np
import pytest
import torch
import xarray as xr

from ncanalyze.analyzer import CLASS_COUNTS, SCALARS, UserError, class_metrics, class_stats, measure, measure_all

RTOL = 1e-9


# ---------------------------------------------------------------- brute force, written from SPEC section 4

def cv(x: np.ndarray) -> float:
    """std/mean, nan where the mean is not clearly positive (not more than 3 std/sqrt(n) above 0): SPEC section 4."""
    return x.std() / x.mean() if x.mean() > 3 * x.std() / math.sqrt(x.size) else math.nan


def brute_force(ds: xr.Dataset, min_count: int) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Every metric by explicit pair loops and full |K| x |K| matrices (small K only). The CDNV family over the
    pairs of kept classes with 2 or more train tokens (a class seen once has no variance)."""
    K = np.flatnonzero(ds["count"].values >= min_count)
    n = len(K)
    mu, v = ds["mean"].values[K].astype(float), ds["variance"].values[K].astype(float)
    has_var = ds["count"].values[K] >= 2
    m = mu - mu.mean(0)
    norm = np.linalg.norm(m, axis=1)
    u = m / norm[:, None]
    cdnv, cdnv2, cos, gnc = [], [], [], []
    per_cdnv, per_cos = np.zeros(n), np.zeros(n)
    for a in range(n):
        for b in range(a + 1, n):
            dist2 = float(np.sum((mu[a] - mu[b]) ** 2))
            if has_var[a] and has_var[b]:
                cdnv.append((v[a] + v[b]) / (2 * dist2))
                cdnv2.append((v[a] + v[b]) / (2 * dist2 ** 2))
                per_cdnv[[a, b]] += cdnv[-1]
            cos.append(float(m[a] @ m[b]) / (norm[a] * norm[b]))
            gnc.append(math.log(1 / np.linalg.norm(u[a] - u[b])))
            per_cos[[a, b]] += cos[-1]
    target = (np.eye(n) - np.ones((n, n)) / n) / math.sqrt(n - 1)
    G = m @ m.T
    sigma_b = m.T @ m / n
    out = {"nc1_cdnv": np.mean(cdnv) if cdnv else math.nan, "nc1_cdnv_p2": np.mean(cdnv2) if cdnv else math.nan,
           "nc1_trace": np.trace(ds["within_covariance"].values @ np.linalg.pinv(sigma_b)) / n,
           "nc2_norm_cv": cv(norm), "nc2_lognorm_std": np.log(norm).std(),
           "nc2_cos_mean": np.mean(cos), "nc2_cos_std": np.std(cos),
           "nc2_etf_error": np.linalg.norm(G / np.linalg.norm(G) - target),
           "gnc2_log_mean": np.mean(gnc), "gnc2_log_std": np.std(gnc)}
    freq = ds["count"].values[K].astype(float)
    weight = np.array([[freq[a] * freq[b] * (a != b) for b in range(n)] for a in range(n)])   # n_c n_c', c != c'
    per = {"class_norm": norm, "class_cdnv": np.where(has_var, per_cdnv / (has_var.sum() - 1), np.nan),
           "class_interference": per_cos / (n - 1),
           "class_freq_weight": weight.sum(1) / weight.sum()}
    if "classifier" in ds:
        w = ds["classifier"].values[K].astype(float)
        dual = np.array([w[c] @ m[c] / (np.linalg.norm(w[c]) * norm[c]) for c in range(n)])
        S = m @ w.T
        out |= {"nc3_cos_mean": dual.mean(), "unc3_cos_cv": cv(dual),
                "nc3_dual_error": np.linalg.norm(S / np.linalg.norm(S) - target)}
        per["class_duality"] = dual
    if "val_count" in ds:
        vc, agree = ds["val_count"].values[K], ds["val_ncc_agree"].values[K]
        out["nc4_agreement"] = agree.sum() / vc.sum()
        per["class_nc4"] = np.where(vc > 0, agree / np.maximum(vc, 1), np.nan)
    return out, per


def brute_nc4(h, y, W, b, means, kept) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """val_count, val_correct, val_ncc_agree token by token: argmax over kept classes of w.h + b, and
    argmin over kept classes of ||h - mu||^2."""
    V = len(W)
    count, correct, agree = np.zeros(V, int), np.zeros(V, int), np.zeros(V, int)
    for x, c in zip(h, y):
        linear = kept[np.argmax([W[k] @ x + b[k] for k in kept])]
        ncc = kept[np.argmin([np.sum((x - means[k]) ** 2) for k in kept])]
        count[c] += 1
        correct[c] += linear == c
        agree[c] += linear == ncc
    return count, correct, agree


def assert_metrics(got: dict, want: dict, rtol: float = RTOL) -> None:
    """Equal to ``rtol``; values that are 0 in exact arithmetic (two classes are always a simplex) to 1e-13; nan
    where the brute force is nan (a coefficient of variation over a mean that is not clearly positive)."""
    assert set(want) <= set(got)
    bad = {k: (got[k], want[k]) for k in want if not (math.isclose(got[k], want[k], rel_tol=rtol, abs_tol=1e-13)
                                                      or (math.isnan(got[k]) and math.isnan(want[k])))}
    assert not bad, bad


def random_study(seed: int = 0, V: int = 60, d: int = 12, N: int = 5000, bias: bool = True):
    """Uneven classes (some empty, some tiny), per-class spreads, a random classifier and validation tokens."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(V, 0.4))
    y = rng.choice(V, size=N, p=p)
    centres = rng.standard_normal((V, d)) * 2
    h = centres[y] + rng.standard_normal((N, d)) * (0.2 + rng.random(V))[y, None]
    W, b = rng.standard_normal((V, d)), (rng.standard_normal(V) if bias else None)
    yv = rng.choice(V, size=400, p=p)
    hv = centres[yv] + rng.standard_normal((400, d)) * 1.5
    return h, y, W, b, hv, yv


@pytest.fixture(scope="module")
def study():
    h, y, W, b, hv, yv = random_study()
    return h, y, W, b, hv, yv, class_stats(h, y, 60, classifier=W, classifier_bias=b, val_embeddings=hv,
                                          val_labels=yv, min_count=20)


# ---------------------------------------------------------------- class_stats

@pytest.mark.parametrize("kind", ["numpy", "torch", "dask"])
def test_class_stats_matches_brute_force(kind):
    h, y, *_ = random_study(seed=1, V=30, d=5, N=3000)
    arrays = {"numpy": (h, y), "torch": (torch.from_numpy(h).float(), torch.from_numpy(y)),
              "dask": (da.from_array(h, chunks=(700, 5)), da.from_array(y, chunks=1100))}[kind]
    ds = class_stats(*arrays, 30, batch_size=512)
    if kind == "torch":
        h = h.astype(np.float32).astype(np.float64)  # what the float32 tensor holds
    scatter = np.zeros((5, 5))
    for c in range(30):
        hc = h[y == c]
        assert ds["count"].values[c] == len(hc)
        if len(hc) == 0:
            assert np.isnan(ds["variance"].values[c]) and not ds["mean"].values[c].any()
            continue
        mc = hc.mean(0)
        np.testing.assert_allclose(ds["mean"].values[c], mc, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(ds["variance"].values[c], np.mean(np.sum((hc - mc) ** 2, 1)), rtol=1e-11)
        scatter += (hc - mc).T @ (hc - mc)
    np.testing.assert_allclose(ds["within_covariance"].values, scatter / len(h), rtol=1e-11, atol=1e-14)
    assert ds["count"].dtype == np.int64 and ds["mean"].dtype == np.float64
    assert ds["mean"].dims == ("vocab", "hidden") and ds["within_covariance"].dims == ("hidden", "hidden2")


def test_class_stats_val_counts_match_token_by_token(study):
    h, y, W, b, hv, yv, ds = study
    kept = np.flatnonzero(ds["count"].values >= 20)
    count, correct, agree = brute_nc4(hv, yv, W, b, ds["mean"].values, kept)
    np.testing.assert_array_equal(ds["val_count"].values, count)
    np.testing.assert_array_equal(ds["val_correct"].values, correct)
    np.testing.assert_array_equal(ds["val_ncc_agree"].values, agree)
    assert agree.sum() > 0 and correct.sum() > 0


# ---------------------------------------------------------------- every metric against brute force

@pytest.mark.parametrize("tile", [5, 16, 1000])
def test_every_metric_matches_brute_force(study, tile):
    *_, ds = study
    K = np.flatnonzero(ds["count"].values >= 20)
    assert 10 < len(K) < 50  # some classes excluded by min_count
    assert tile > len(K) or -(-len(K) // tile) >= 3  # one tile, or several
    want, want_per = brute_force(ds, 20)
    got, per = measure_all(ds, min_count=20, tile=tile, se=False)
    assert list(got) == [*SCALARS, *CLASS_COUNTS]
    assert_metrics(got, want)
    for name, values in want_per.items():
        np.testing.assert_allclose(per[name].values[K], values, rtol=RTOL, err_msg=name)
        assert np.isnan(np.delete(per[name].values, K)).all(), name


def test_min_count_one_and_no_bias_match_brute_force():
    h, y, W, _, hv, yv = random_study(seed=3, V=40, d=7, N=2000, bias=False)
    ds = class_stats(h, y, 40, classifier=W, val_embeddings=hv, val_labels=yv)
    assert (ds["count"].values == 0).any()  # empty classes are left out by min_count = 1
    want, _ = brute_force(ds, 1)
    assert_metrics(measure(ds, tile=6), want)


@pytest.mark.parametrize("V,d", [(2, 3), (3, 2), (9, 30)])
def test_few_classes_and_more_dimensions_than_classes(V, d):
    rng = np.random.default_rng(V)
    ds = stats_dataset(rng.standard_normal((V, d)), variance=rng.random(V), classifier=rng.standard_normal((V, d)),
                       sigma_w=np.cov(rng.standard_normal((d, 4 * d))))
    want, _ = brute_force(ds, 1)
    assert_metrics(measure(ds, tile=2), want)


def test_class_metrics_is_measure_alls_per_class_view(study):
    *_, ds = study
    xr.testing.assert_identical(class_metrics(ds, 20, tile=9), measure_all(ds, 20, tile=9, se=False)[1])


def test_nc4_needs_the_extraction_kept_set(study):
    *_, ds = study
    with pytest.warns(UserWarning, match=r"count >= 20 \(and over the kept sets of min_count 1, 2, 5, 20\), not over "
                                         "those with count >= 30"):
        got = measure(ds, min_count=30)
    assert math.isnan(got["nc4_agreement"])
    assert not math.isnan(got["nc1_cdnv"])
    # a min_count that keeps the same classes is the same kept set: NC4 is measured
    counts = ds["count"].values
    same = int(counts[counts >= 20].min())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="unc3_cos_cv is nan")  # a random classifier: duality mean ~ 0
        assert measure(ds, min_count=same, se=False)["nc4_agreement"] == \
                measure(ds, min_count=20, se=False)["nc4_agreement"]


def test_nc4_at_each_min_count_of_the_report_is_counted_in_the_same_pass(study):
    """Extracted at min_count 20, NC4's decisions are also counted over the kept sets of 1, 2, 5 and 20
    (val_*_at): each row is the brute force token by token over that kept set, and measure at those min_counts
    reads its row (the same value as a dataset counted at that min_count)."""
    h, y, W, b, hv, yv, ds = study
    count = ds["count"].values
    assert list(ds["nc4_min_count"].values) == [1, 2, 5, 20]
    for i, m in enumerate((1, 2, 5, 20)):
        kept = np.flatnonzero(count >= m)
        n, correct, agree = brute_nc4(hv, yv, W, b, ds["mean"].values, kept)
        np.testing.assert_array_equal(ds["val_correct_at"].values[i], correct)
        np.testing.assert_array_equal(ds["val_ncc_agree_at"].values[i], agree)
        np.testing.assert_array_equal(ds["val_count"].values, n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = measure(ds, min_count=m)
            own = measure(class_stats(h, y, 60, classifier=W, classifier_bias=b, val_embeddings=hv, val_labels=yv,
                                      min_count=m), min_count=m)
        assert got["nc4_agreement"] == pytest.approx(agree[kept].sum() / n[kept].sum(), rel=1e-12)
        assert got["nc4_agreement"] == own["nc4_agreement"]
    np.testing.assert_array_equal(ds["val_ncc_agree_at"].values[3], ds["val_ncc_agree"].values)  # 20: the same


def test_without_classifier_or_validation_only_what_is_defined():
    h, y, *_ = random_study(seed=4, V=20, d=6, N=1000)
    with pytest.warns(UserWarning, match="nc3_cos_mean, unc3_cos_cv, nc3_dual_error, nc4_agreement, head_erank are "
                      "nan: the dataset lacks"):
        got = measure(class_stats(h, y, 20), se=False)
    assert list(got) == [*SCALARS, *CLASS_COUNTS]  # every key, NaN where undefined
    assert [k for k in SCALARS if np.isnan(got[k])] == ["nc3_cos_mean", "unc3_cos_cv", "nc3_dual_error",
                                                        "nc4_agreement", "head_erank"]


# ---------------------------------------------------------------- planted geometries

def stats_dataset(means: np.ndarray, variance: np.ndarray | float = 1.0, classifier: np.ndarray | None = None,
                  sigma_w: np.ndarray | None = None) -> xr.Dataset:
    V, d = means.shape
    ds = xr.Dataset({"count": ("vocab", np.full(V, 10)), "mean": (("vocab", "hidden"), means),
                     "variance": ("vocab", np.broadcast_to(np.asarray(variance, float), (V,)).copy()),
                     "within_covariance": (("hidden", "hidden2"), np.eye(d) if sigma_w is None else sigma_w)})
    if classifier is not None:
        ds["classifier"] = ("vocab", "hidden"), classifier
    return ds


def test_measure_leaves_its_input_untouched():
    """Every class is kept, so no indexing copies on the way: the centring must still not write to the dataset."""
    rng = np.random.default_rng(3)
    ds = stats_dataset(rng.standard_normal((40, 5)) + 2, classifier=rng.standard_normal((40, 5)))
    before = ds.copy(deep=True)
    measure(ds, tile=7)
    xr.testing.assert_identical(ds, before)


def simplex(K: int, d: int, scale: float = 3.0, seed: int = 0) -> np.ndarray:
    """K vertices of a regular simplex, randomly rotated into d >= K - 1 dimensions and shifted off the origin."""
    rng = np.random.default_rng(seed)
    e = np.eye(K) - 1 / K
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    basis = np.linalg.svd(e)[2][: K - 1]                    # an orthonormal basis of the simplex's hyperplane
    return scale * (e @ basis.T) @ q[: K - 1] + rng.standard_normal(d)


@pytest.mark.parametrize("K,d", [(12, 11), (30, 40)])
def test_simplex_etf(K, d):
    M = simplex(K, d)
    m = M - M.mean(0)
    got = measure(stats_dataset(M, classifier=m), tile=7)
    assert got["nc2_cos_mean"] == pytest.approx(-1 / (K - 1), rel=1e-12)
    assert got["nc2_cos_std"] < 1e-12
    assert got["nc2_etf_error"] < 1e-12
    assert got["nc2_norm_cv"] < 1e-12
    assert got["nc2_lognorm_std"] < 1e-12
    assert got["gnc2_log_std"] < 1e-12
    assert got["gnc2_log_mean"] == pytest.approx(-0.5 * math.log(2 + 2 / (K - 1)), rel=1e-12)
    # classifier rows equal to the centred means: self-duality
    assert got["nc3_cos_mean"] == pytest.approx(1, abs=1e-12)
    assert got["unc3_cos_cv"] < 1e-12
    assert got["nc3_dual_error"] < 1e-7  # the expanded square loses ~sqrt(eps) at exactly 0


def test_random_means_are_not_an_etf():
    """The planted answers are not what any input gives: random means are far from all of them."""
    rng = np.random.default_rng(0)
    M = rng.standard_normal((12, 11))
    got = measure(stats_dataset(M, classifier=rng.standard_normal((12, 11))))
    assert got["nc2_cos_std"] > 0.1 and got["nc2_etf_error"] > 0.1 and got["nc2_norm_cv"] > 0.05
    assert got["nc3_dual_error"] > 0.5 and abs(got["nc3_cos_mean"]) < 0.5


def test_gaussian_classes_of_known_variance_and_spacing():
    """K Gaussian classes N(mu_c, s^2 I) on a simplex with pairwise distance delta, n tokens each, d = K - 1.

    E var_c = d s^2 (n-1)/n and E ||mu_c - mu_c'||^2 = delta^2 + 2 d s^2/n, so CDNV ~ d s^2 / delta^2; the
    tolerance is 6 standard errors of the ratio (relative sd of var: sqrt(2/(n d)); of the squared distance:
    2 sqrt(2 s^2/n)/delta).
    """
    K, n, s, delta = 10, 2000, 1.0, 10.0
    d = K - 1
    rng = np.random.default_rng(5)
    mu = simplex(K, d, scale=delta / math.sqrt(2))              # vertex distance: scale * sqrt(2)
    assert np.linalg.norm(mu[0] - mu[1]) == pytest.approx(delta)
    y = np.repeat(np.arange(K), n)
    h = mu[y] + s * rng.standard_normal((K * n, d))
    got = measure(class_stats(h, y, K), tile=3)
    var = d * s ** 2 * (n - 1) / n
    dist2 = delta ** 2 + 2 * d * s ** 2 / n
    tol = 6 * (math.sqrt(2 / (n * d)) + 2 * math.sqrt(2 * s ** 2 / n) / delta)
    assert got["nc1_cdnv"] == pytest.approx(var / dist2, rel=tol)
    assert got["nc1_cdnv_p2"] == pytest.approx(var / dist2 ** 2, rel=2 * tol)
    # Sigma_W = s^2 I, Sigma_B has K - 1 eigenvalues delta^2/(2K): Tr(Sigma_W Sigma_B^+)/K = 2 s^2 (K-1)/delta^2
    assert got["nc1_trace"] == pytest.approx(2 * s ** 2 * (K - 1) / delta ** 2, rel=2 * tol)


def test_zero_within_class_noise():
    """Every token sits on its class mean: no within-class variability, and with the classifier w_c = mu_c,
    b_c = -||mu_c||^2/2 the linear decision is the nearest class mean."""
    rng = np.random.default_rng(6)
    V, d = 25, 8
    mu = rng.standard_normal((V, d)) * 2
    y = rng.integers(0, V, 3000)
    yv = rng.integers(0, V, 500)
    ds = class_stats(mu[y], y, V, classifier=mu, classifier_bias=-0.5 * np.sum(mu * mu, 1),
                     val_embeddings=mu[yv] + 2.0 * rng.standard_normal((500, d)), val_labels=yv)
    got = measure(ds, tile=4)
    assert ds["variance"].max() < 1e-25  # zero but for the accumulator's rounding of repeated means
    assert got["nc1_cdnv"] < 1e-24 and got["nc1_cdnv_p2"] < 1e-24 and got["nc1_trace"] < 1e-24
    assert got["nc4_agreement"] == 1
    assert 100 < ds["val_correct"].sum() < 450  # noisy validation tokens: often wrong, yet both decisions agree


# ---------------------------------------------------------------- scale

def big_study(K: int, d: int) -> xr.Dataset:
    rng = np.random.default_rng(7)
    means = rng.standard_normal((K, d))
    return stats_dataset(means, variance=rng.random(K) + 0.5, classifier=means + rng.standard_normal((K, d)))


PEAK_SCRIPT = """
import json, sys
import psutil
sys.path.insert(0, {tests!r})
from test_metrics import big_study
from ncanalyze.analyzer import measure
ds = big_study({K}, {d})
before = psutil.Process().memory_info().rss
got = measure(ds, tile=1024, se=False)
# VmHWM, this process's own peak: ru_maxrss would carry over the forking parent's size across exec
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({{"growth": peak - before, "metrics": got}}))
"""


@pytest.mark.slow
def test_twenty_thousand_classes_in_bounded_memory():
    """K = 20,000, d = 64, in a fresh process: the growth of its resident memory (peak RSS, so BLAS and dask
    included) stays far below the 3.2 GB of one K x K float64 matrix."""
    K, d = 20_000, 64
    script = PEAK_SCRIPT.format(tests=str(Path(__file__).parent), K=K, d=d)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["growth"] < 0.1 * K * K * 8, f"peak growth {result['growth'] / 2**20:.0f} MiB"
    got = result["metrics"]
    assert list(got) == [*SCALARS, *CLASS_COUNTS] and math.isnan(got["nc4_agreement"])  # no val_* data: NaN
    assert all(math.isfinite(v) for k, v in got.items() if k not in ("anisotropy", "nc4_agreement"))  # no unit_sum
    # spot checks that need no K x K matrix: the cosine mean, and the ETF error from ||M M^T||_F = ||M^T M||_F
    m = big_study(K, d)["mean"].values
    m = m - m.mean(0)
    u = m / np.linalg.norm(m, axis=1, keepdims=True)
    s = u.sum(0)
    assert got["nc2_cos_mean"] == pytest.approx((s @ s - K) / (K * (K - 1)), rel=1e-9)
    etf2 = 2 - 2 * np.sum(m * m) / (math.sqrt(np.sum((m.T @ m) ** 2)) * math.sqrt(K - 1))
    assert got["nc2_etf_error"] == pytest.approx(math.sqrt(etf2), rel=1e-9)


# ---------------------------------------------------------------- degenerate input

def test_fewer_than_two_kept_classes():
    ds = stats_dataset(np.eye(3))
    ds["count"] = "vocab", np.array([5, 0, 1])
    with pytest.raises(UserError, match="only 1 class.*at least 2"):
        measure(ds, min_count=2)
    with pytest.raises(UserError, match="at least 1"):
        measure(ds, min_count=0)


def test_zero_norm_centred_mean():
    ds = stats_dataset(np.array([[1.0, 2.0], [-1.0, -2.0], [0.0, 0.0], [3.0, -1.0], [-3.0, 1.0]]))
    with pytest.raises(UserError, match=r"class\(es\) \[2\] have a zero-norm centred mean"):
        measure(ds)


def assert_degenerate_like_brute_force(ds: xr.Dataset, warning: str, per_class_inf: list[int] = (), **kw) -> None:
    """Coincident pairs: the metrics infinite by definition are inf (GNC2's std nan), with a warning naming the pair;
    every other metric equals the brute force."""
    with pytest.warns(UserWarning, match=warning):
        got, per = measure_all(ds, **kw)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        want = brute_force(ds, 1)[0]
    assert got["gnc2_log_mean"] == math.inf and math.isnan(got["gnc2_log_std"])
    finite = {k: v for k, v in want.items() if np.isfinite(v)}
    assert_metrics({k: got[k] for k in finite}, finite)
    for k in set(want) - set(finite) - {"gnc2_log_std"}:
        assert got[k] == math.inf, k
    assert np.isinf(per["class_cdnv"].values[list(per_class_inf)]).all()


def test_coincident_means_make_cdnv_and_gnc2_infinite_and_leave_the_rest_exact():
    means = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [-2.0, -1.0, 0.5]])
    assert_degenerate_like_brute_force(stats_dataset(means), "classes 1 and 3 have coincident means",
                                       per_class_inf=[1, 3], tile=2)


def test_two_singleton_classes_with_the_same_feature():
    """As in real data under min_count 1: two tokens seen once, at the same feature. A class seen once has no
    variance, so the CDNV family leaves both out (finite, the brute force over the classes with n >= 2; their
    class_cdnv nan); their directions coincide, so GNC2's log mean is inf."""
    rng = np.random.default_rng(3)
    h = rng.standard_normal((40, 4))
    y = np.r_[np.repeat(np.arange(6), 6), 6, 7, 8, 9]
    h[37] = h[36]                                                  # classes 6 and 7: one token each, same feature
    ds = class_stats(h, y, 10)
    assert_degenerate_like_brute_force(ds, "classes 6 and 7 have coincident means .a class seen once has no variance")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, per = measure_all(ds)
    assert math.isfinite(got["nc1_cdnv"]) and (got["n_classes"], got["n_classes_var"]) == (10, 6)
    assert np.isnan(per["class_cdnv"].values[6:]).all() and np.isfinite(per["class_cdnv"].values[:6]).all()


def test_parallel_centred_means_make_only_gnc2_infinite():
    means = np.array([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [-3.0, -1.0]])    # centred: (1,0) and (2,0) align
    assert_degenerate_like_brute_force(stats_dataset(means), "classes 0 and 1 point the same way")


def test_corrupt_statistics_and_classifier():
    means = np.random.default_rng(0).standard_normal((6, 3))
    with pytest.raises(UserError, match="NaN or Inf"):
        measure(stats_dataset(means, variance=np.r_[1.0, np.nan, 1, 1, 1, 1]))
    w = means.copy()
    w[4] = 0
    with pytest.raises(UserError, match=r"classifier row\(s\) of class\(es\) \[4\] are zero"):
        measure(stats_dataset(means, classifier=w))


def test_class_stats_bad_input():
    h, y = np.ones((10, 3)), np.arange(10) % 4
    with pytest.raises(UserError, match=r"labels must lie in \[0, 3\)"):
        class_stats(h, y, 3)
    with pytest.raises(UserError, match="NaN or Inf"):
        class_stats(np.where(np.arange(30).reshape(10, 3) == 7, np.nan, h), y, 4)
    with pytest.raises(UserError, match="n labels"):
        class_stats(h, y[:9], 4)
    with pytest.raises(UserError, match="integers"):
        class_stats(h, y.astype(float), 4)
    with pytest.raises(UserError, match="no embeddings"):
        class_stats(np.ones((0, 3)), np.zeros(0, int), 4)
    with pytest.raises(UserError, match="needs the classifier"):
        class_stats(h, y, 4, val_embeddings=h, val_labels=y)
    with pytest.raises(UserError, match=r"classifier must have shape \(4, 3\)"):
        class_stats(h, y, 4, classifier=np.ones((4, 2)))
