"""Representation geometry beyond NC (SPEC section 4, second table) against brute force from raw features, planted
geometries with known answers, the unit_sum accumulator, and a real extraction."""
from __future__ import annotations

import math
import shutil
import warnings

import ncanalyze.store
import numpy as np
import pytest
import torch
from conftest import EXTRACT_OPTS
from ncanalyze.analyzer import (
    GEOMETRY_METRICS,
    ClassStats,
    class_stats,
    measure,
    measure_all,
)
from ncanalyze.store.measure import measure_store
from scipy.linalg import sqrtm
from transformers import AutoModelForCausalLM, AutoTokenizer

RTOL = 1e-9


# ---------------------------------------------------------------- brute force, written from SPEC section 4

def erank_of(singular_values: np.ndarray, d: int) -> float:
    """exp of the entropy of the normalised singular values (the square roots of the covariance's eigenvalues),
    those whose square is at most d eps times the largest one's counting as 0 (SPEC: rounding noise)."""
    s = singular_values[singular_values ** 2 > d * np.finfo(float).eps * singular_values.max() ** 2]
    p = s / s.sum()
    return math.exp(-sum(x * math.log(x) for x in p))


def weighted_decay(lam: np.ndarray, first: int = 4, last: int = 100) -> float:
    """Stringer et al.'s fit, written independently: numpy's polyfit of log lambda_i on log i with weights
    sqrt(1/i) on the residuals (so 1/i on their squares) over i = first..min(last, r), r = #{lambda > 1e-10
    lambda_1}, eigenvalues in decreasing order."""
    lam = np.sort(lam)[::-1]
    r = int(np.sum(lam > 1e-10 * lam[0]))
    i = np.arange(first, min(last, r) + 1)
    if i.size < 2:
        return math.nan
    return -np.polyfit(np.log(i), np.log(lam[i - 1]), 1, w=np.sqrt(1 / i))[0]


def brute_force(h: np.ndarray, y: np.ndarray, W: np.ndarray, min_count: int) -> tuple[dict, np.ndarray]:
    """Every geometry metric from the raw features: covariances as explicit matrices, spectra from numpy.linalg,
    anisotropy from every pairwise cosine, the frequency-weighted pair means by double loops."""
    V = len(W)
    count = np.bincount(y, minlength=V)
    K = np.flatnonzero(count >= min_count)
    mean = np.array([h[y == c].mean(0) if count[c] else np.zeros(h.shape[1]) for c in range(V)])
    var = np.array([np.sum((h[y == c] - mean[c]) ** 2, 1).mean() if count[c] else np.nan for c in range(V)])
    dev = h - mean[y]
    sigma_w = dev.T @ dev / len(h)
    m = mean[K] - mean[K].mean(0)
    sigma_b = m.T @ m / len(K)
    sigma_t = np.cov(h.T, bias=True)                                  # the covariance of all train features
    lam_t = np.linalg.eigvalsh(sigma_t)
    delta = 1e-4 * np.trace(sigma_w) / h.shape[1]
    root = np.real(sqrtm(np.linalg.inv(sigma_w + delta * np.eye(h.shape[1]))))
    lam_l = np.linalg.eigvalsh(root @ sigma_b @ root)
    q = np.clip(lam_l, 0, None) / np.clip(lam_l, 0, None).sum()
    u = h / np.linalg.norm(h, axis=1, keepdims=True)
    cos = u @ u.T
    N = len(h)
    pairs = [(a, b) for i, a in enumerate(K) for b in K[i + 1:]]
    w = np.array([count[a] * count[b] for a, b in pairs], dtype=float)
    var_pairs = [(a, b) for a, b in pairs if count[a] >= 2 and count[b] >= 2]      # classes with a variance
    w_var = np.array([count[a] * count[b] for a, b in var_pairs], dtype=float)
    cdnv = np.array([(var[a] + var[b]) / (2 * np.sum((mean[a] - mean[b]) ** 2)) for a, b in var_pairs])
    unit = {c: (mean[c] - mean[K].mean(0)) / np.linalg.norm(mean[c] - mean[K].mean(0)) for c in K}
    gnc = np.array([math.log(1 / np.linalg.norm(unit[a] - unit[b])) for a, b in pairs])
    share = np.array([sum(count[c] * count[o] for o in K if o != c) for c in K]) / (2 * w.sum())
    d = h.shape[1]
    out = {"within_erank": erank_of(np.linalg.svd(dev, compute_uv=False), d),
           "between_erank": erank_of(np.linalg.svd(m, compute_uv=False), d),
           "total_erank": erank_of(np.linalg.svd(h - h.mean(0), compute_uv=False), d),
           "rankme": erank_of(np.linalg.svd(h, compute_uv=False), d),
           "eigen_decay": weighted_decay(lam_t),
           "lidar": math.exp(-np.sum(q[q > 0] * np.log(q[q > 0]))),
           "anisotropy": (cos.sum() - np.trace(cos)) / (N * (N - 1)),
           "head_erank": erank_of(np.linalg.svd(W, compute_uv=False), d),
           "nc1_cdnv_freq": np.sum(w_var * cdnv) / w_var.sum(), "gnc2_log_mean_freq": np.sum(w * gnc) / w.sum()}
    return out, share


def study(seed: int = 0, V: int = 40, d: int = 9, N: int = 1500):
    """Uneven classes (some empty, some rare), class-dependent spreads, a classifier over the whole vocabulary."""
    rng = np.random.default_rng(seed)
    y = rng.choice(V, size=N, p=rng.dirichlet(np.full(V, 0.5)))
    centres = rng.standard_normal((V, d)) * 2 + rng.standard_normal(d)
    h = centres[y] + rng.standard_normal((N, d)) * (0.3 + rng.random(V))[y, None] @ np.diag(rng.uniform(0.2, 2, d))
    return h, y, rng.standard_normal((V, d))


@pytest.mark.parametrize("min_count,tile", [(1, 4), (1, 1000), (15, 3)])
def test_every_geometry_metric_matches_brute_force(min_count, tile):
    h, y, W = study(seed=min_count)
    ds = class_stats(h, y, len(W), classifier=W)
    count = ds["count"].values
    assert (count == 0).any() and ((count > 0) & (count < 15)).any()  # empty classes; rare ones that 15 leaves out
    want, share = brute_force(h, y, W, min_count)
    got, per = measure_all(ds, min_count=min_count, tile=tile)
    assert set(GEOMETRY_METRICS) <= set(got)
    bad = {k: (got[k], v) for k, v in want.items() if not math.isclose(got[k], v, rel_tol=RTOL, abs_tol=1e-14)}
    assert not bad, bad
    K = np.flatnonzero(count >= min_count)
    np.testing.assert_allclose(per["class_freq_weight"].values[K], share, rtol=RTOL)
    assert np.isnan(np.delete(per["class_freq_weight"].values, K)).all()


def test_frequency_weights_change_the_pair_means():
    """The weighted means are not the unweighted ones in disguise: a frequent pair far apart pulls them."""
    h, y, W = study(seed=5)
    got = measure(class_stats(h, y, len(W), classifier=W))
    assert abs(got["nc1_cdnv_freq"] / got["nc1_cdnv"] - 1) > 1e-3
    assert abs(got["gnc2_log_mean_freq"] - got["gnc2_log_mean"]) > 1e-3


# ---------------------------------------------------------------- planted geometries

def exact_white(N: int, d: int, seed: int) -> np.ndarray:
    """N x d features whose mean is 0 and whose covariance is exactly I (orthonormal centred columns x sqrt N)."""
    x = np.random.default_rng(seed).standard_normal((N, d))
    q, _ = np.linalg.qr(x - x.mean(0))
    return q * math.sqrt(N)


def test_isotropic_gaussians():
    rng = np.random.default_rng(0)
    N, d = 100_000, 6
    h = rng.standard_normal((N, d))
    got = measure(class_stats(h, rng.integers(0, 12, N), 12))
    assert d - 0.01 < got["total_erank"] <= d and d - 0.01 < got["within_erank"] <= d
    assert abs(got["anisotropy"]) < 1e-3
    assert abs(got["eigen_decay"]) < 0.05                             # a flat spectrum
    exact = measure(class_stats(exact_white(5000, d, 1), rng.integers(0, 12, 5000), 12))
    assert exact["total_erank"] == pytest.approx(d, rel=1e-12)
    assert abs(exact["eigen_decay"]) < 1e-10


def test_features_on_a_k_dimensional_subspace():
    rng = np.random.default_rng(1)
    N, d, k = 4000, 16, 3
    basis = np.linalg.qr(rng.standard_normal((d, k)))[0].T             # k orthonormal rows in R^d
    y = rng.integers(0, 20, N)
    z = rng.standard_normal((20, k))[y] * 3 + rng.standard_normal((N, k))
    W = rng.standard_normal((20, k)) @ basis
    got = measure(class_stats(z @ basis + 1.0, y, 20, classifier=W))
    for name in ("within_erank", "between_erank", "total_erank", "head_erank"):
        assert k - 1 < got[name] <= k + 1e-5, name
    assert got["lidar"] > k - 1                                      # the null directions carry no signal


def test_all_features_one_direction():
    rng = np.random.default_rng(2)
    v = rng.standard_normal(7)
    y = rng.integers(0, 3, 500)
    h = (np.array([1.0, 3.0, 6.5])[y] + rng.random(500))[:, None] * v   # positive multiples of v
    with pytest.warns(UserWarning, match="point the same way"):
        got = measure(class_stats(h, y, 3))
    assert got["anisotropy"] == pytest.approx(1, abs=1e-12)
    assert got["total_erank"] == pytest.approx(1, abs=1e-6) and got["between_erank"] == pytest.approx(1, abs=1e-6)
    assert math.isnan(got["eigen_decay"])                             # one eigenvalue above 1e-10 lambda_1


@pytest.mark.parametrize("alpha", [0.7, 1.5])
def test_power_law_spectrum(alpha):
    """Sigma_T's eigenvalues exactly i^-alpha (white features scaled along a random rotation): eigen_decay = alpha."""
    rng = np.random.default_rng(3)
    N, d = 6000, 24
    rotation = np.linalg.qr(rng.standard_normal((d, d)))[0]
    h = exact_white(N, d, 4) * np.arange(1, d + 1) ** (-alpha / 2) @ rotation + 5.0
    got = measure(class_stats(h, rng.integers(0, 30, N), 30))
    assert got["eigen_decay"] == pytest.approx(alpha, rel=1e-9)


def test_a_random_spectrum_is_not_a_power_law():
    """The planted answer is not what any input gives: an uneven spectrum's fit is no planted alpha."""
    rng = np.random.default_rng(6)
    h = exact_white(3000, 12, 7) * rng.uniform(0.1, 3, 12)
    got = measure(class_stats(h, rng.integers(0, 10, 3000), 10))
    assert not any(math.isclose(got["eigen_decay"], a, rel_tol=1e-3) for a in (0.7, 1.5))
    assert 1 < got["total_erank"] < 11.9


# ---------------------------------------------------------------- the unit_sum accumulator

def test_unit_sum_merges_and_resumes_like_one_stream():
    rng = np.random.default_rng(4)
    h, y = torch.from_numpy(rng.standard_normal((900, 5)) + 1), torch.from_numpy(rng.integers(0, 7, 900))
    whole, a, b = ClassStats(7, 5), ClassStats(7, 5), ClassStats(7, 5)
    whole.update(h, y)
    a.update(h[:400], y[:400])
    b.update(h[400:], y[400:])
    want = (h / h.norm(dim=1, keepdim=True)).sum(0).double()
    torch.testing.assert_close(whole.unit_sum, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.merge(b).unit_sum, want, rtol=1e-12, atol=1e-12)
    resumed = ClassStats(7, 5)
    resumed.load_state_dict(whole.state_dict())
    torch.testing.assert_close(resumed.unit_sum, whole.unit_sum, rtol=0, atol=0)  # the saved state, bit for bit
    torch.testing.assert_close(resumed.unit_sum, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(KeyError, match="unit_sum"):  # a state without it is not one ClassStats wrote
        resumed.load_state_dict({k: v for k, v in whole.state_dict().items() if k != "unit_sum"})


def test_statistics_without_unit_sum_give_nan_anisotropy_with_a_warning():
    h, y, W = study(seed=2)
    ds = class_stats(h, y, len(W), classifier=W)
    full = measure(ds)
    with pytest.warns(UserWarning, match="anisotropy is nan: the dataset holds no unit_sum"):
        old = measure(ds.drop_vars("unit_sum"))  # a dataset made by hand
    assert math.isnan(old["anisotropy"])
    rest = [k for k in full if k != "anisotropy"]  # nc4_agreement is nan in both (no validation counts)
    np.testing.assert_array_equal([old[k] for k in rest], [full[k] for k in rest])
    ds["unit_sum"] = ds["unit_sum"] * np.nan
    with pytest.warns(UserWarning, match="anisotropy is nan: the dataset's unit_sum is not finite"):
        assert math.isnan(measure(ds)["anisotropy"])


# ---------------------------------------------------------------- a real extraction

def features(model_dir, train: np.ndarray) -> np.ndarray:
    """The model's last hidden states (after the final norm) at every position but the last, float64."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(torch.from_numpy(train), output_hidden_states=True).hidden_states[-1]
    return hs[:, :-1].reshape(-1, hs.shape[-1]).double().numpy()


def train_blocks(path, tokenizer, max_tokens: int, block: int = 32) -> np.ndarray:
    """The blocks extract reads (run_clm's grouping, the cap spread over the split): test_extract's reference."""
    from test_extract import text_blocks

    return text_blocks(path, tokenizer, max_tokens, block)


@pytest.mark.slow
def test_extraction_stores_unit_sum_and_anisotropy(extracted_store, trained_run, corpus, tmp_path):
    ds = ncanalyze.store.open(extracted_store)["neo-2x32/checkpoint-60"].to_dataset()
    train = train_blocks(corpus["train"], AutoTokenizer.from_pretrained(str(trained_run)), EXTRACT_OPTS[1])
    H = features(trained_run / "checkpoint-60", train)
    U = H / np.linalg.norm(H, axis=1, keepdims=True)
    assert ds["unit_sum"].dims == ("hidden",) and ds["unit_sum"].dtype == np.float64
    np.testing.assert_allclose(ds["unit_sum"].values, U.sum(0), rtol=1e-9, atol=1e-9)
    N = len(U)
    assert N == int(ds["count"].sum())
    off_diagonal = sum(float((U[s:s + 1000] @ U.T).sum()) for s in range(0, N, 1000)) - N   # every cosine, i != j
    got = measure(ds.load())
    assert got["anisotropy"] == pytest.approx(off_diagonal / (N * (N - 1)), rel=1e-9)
    assert 0 < got["anisotropy"] < 1 and all(math.isfinite(got[k]) for k in GEOMETRY_METRICS)

    old = tmp_path / "old.zarr"                                       # the same store, its unit_sum removed
    shutil.copytree(extracted_store, old)
    for group in ("checkpoint-20", "checkpoint-40", "checkpoint-60"):
        shutil.rmtree(old / "neo-2x32" / group / "unit_sum")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = measure_store(old, force=True).table
    assert table["anisotropy"].isna().all() and table["total_erank"].notna().all()
    assert any("anisotropy is nan" in str(w.message) for w in caught)


def test_a_group_measured_under_other_definitions_is_measured_again():
    """A group is measured again unless measured under this version's definitions (schema.METRICS_VERSION), with
    the same min_count and statistics, and with every metric there is (one added since: measured again)."""
    from ncanalyze.analyzer import NC_METRICS
    from ncanalyze.analyzer.schema import METRICS_VERSION
    from ncanalyze.store.measure import is_measured

    from ncanalyze.analyzer.schema import SCALARS

    attrs = {"metrics": {k: 1.0 for k in SCALARS}, "metrics_min_count": 1, "metrics_config_hash": "h",
             "config_hash": "h"}
    assert not is_measured(attrs, 1)  # no version: measured before definitions were versioned
    assert not is_measured(attrs | {"metrics_version": METRICS_VERSION - 1}, 1)
    assert is_measured(attrs | {"metrics_version": METRICS_VERSION}, 1)
    assert not is_measured(attrs | {"metrics_version": METRICS_VERSION}, 2)  # another min_count
    assert not is_measured(attrs | {"metrics_version": METRICS_VERSION, "config_hash": "other"}, 1)
    # measured before a metric was added (its record holds every metric but that one): measured again
    older = {k: 1.0 for k in NC_METRICS + GEOMETRY_METRICS}
    assert not is_measured(attrs | {"metrics_version": METRICS_VERSION, "metrics": older}, 1)
