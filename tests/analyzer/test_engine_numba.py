"""The host engine's fused pass over Gram blocks (analyzer/engine_numba.py) against brute force and
pairs.reference_tile_sums, panel by panel."""
import numpy as np
import pytest

from ncanalyze.analyzer.engine_numba import tile_sums, vlog
from ncanalyze.analyzer.pairs import COINCIDENT, SUMS, blocks, reference_tile_sums, side_of


def test_log_is_within_one_ulp_of_numpy():
    rng = np.random.default_rng(0)
    y = np.r_[np.exp(rng.uniform(-700, 700, 10**5)), rng.uniform(0.25, 4, 10**5), 1 + np.arange(-500, 500) * 2.0**-52,
              np.sqrt(0.5) * (1 + np.arange(-50, 50) * 2.0**-52), np.sqrt(2) * (1 + np.arange(-50, 50) * 2.0**-52),
              2.0 ** np.arange(-1020, 1020), np.nextafter(2.0 ** np.arange(-1020, 1020), 0)]
    want = np.log(y)
    ulps = np.abs(vlog(y) - want) / np.spacing(np.maximum(np.abs(want), np.finfo(float).tiny))
    assert ulps.max() <= 1
    assert vlog(np.array([1.0]))[0] == 0.0


def brute(U, r, v, p, t0, pairs, a=None, deb=None):
    """Every sum of one tile in float64 from explicit loops over its pairs (i, j); the CDNV terms only where both
    classes have a variance (a = 1); the debiased CDNV's over the pairs of the fixed set (deb: v*, z, b per side)."""
    a = a or [np.ones(len(U[0])), np.ones(len(U[1]))]
    vs, z, b, k1, k2 = deb or ([np.zeros(len(u)) for u in U],) * 3 + (0.0, 0.0)
    acc, rows, cols = np.zeros(len(SUMS)), np.zeros(len(U[0])), np.zeros(len(U[1]))
    for i, j in pairs:
        g = float(U[0][i] @ U[1][j])
        T = float(np.sum((U[0][i] - U[1][j]) ** 2))
        D = float(np.sum((r[0][i] * U[0][i] - r[1][j] * U[1][j]) ** 2))
        c = (v[0][i] + v[1][j]) / D if a[0][i] and a[1][j] else 0.0
        w = p[0][i] * p[1][j]
        fixed, noise = b[0][i] and b[1][j], z[0][i] + z[1][j]
        second = max(1 - (k1 * (D - noise) * noise + k2 * noise ** 2) / (D - noise) ** 2, 0) if D > 2 * noise else 1
        cd = (vs[0][i] + vs[1][j]) / max(D - noise, noise) * second if fixed else 0.0
        acc += [g > 1 - COINCIDENT / 2, (T / t0 - 1) ** 2, np.log(T / t0), np.log(T / t0) ** 2, c, c and c / D, w * c,
                w * np.log(T / t0), cd, bool(fixed and D < 2 * noise)]
        rows[i] += c
        cols[j] += c
    return acc, rows, cols


@pytest.mark.parametrize("diag", [False, True])
@pytest.mark.parametrize("panel_rows", [1, 3, 7, 100])
@pytest.mark.parametrize("singletons", [False, True])
def test_tile_sums_match_loops_over_pairs(diag, panel_rows, singletons):
    rng = np.random.default_rng(panel_rows)
    (ni, nj), d = ((17, 17) if diag else (13, 19)), 6
    U = [rng.standard_normal((n, d)) for n in (ni, nj)]
    U = [u / np.linalg.norm(u, axis=1, keepdims=True) for u in U]
    if diag:
        U[1] = U[0]
    r = [rng.uniform(0.5, 3, n) for n in (ni, nj)]
    v = [rng.uniform(0, 2, n) for n in (ni, nj)]
    p = [rng.uniform(0.01, 0.2, n) for n in (ni, nj)]
    a = [(rng.random(n) < 0.7 if singletons else np.ones(n)).astype(float) for n in (ni, nj)]  # has a variance
    vs = [x * rng.uniform(1, 1.5, len(x)) for x in v]                # unbiased variances
    z = [x / rng.integers(2, 4, len(x)) for x in vs]                # their means' noise: some pairs not resolved
    b = [x * (rng.random(len(x)) < 0.8) for x in a]                 # the fixed set
    if diag:
        r[1], v[1], p[1], a[1], vs[1], z[1], b[1] = r[0], v[0], p[0], a[0], vs[0], z[0], b[0]
    t0 = 1.7
    side = [side_of(r[k], v[k], p[k], a[k], (vs[k], z[k], b[k], 0.2, 0.5)) for k in (0, 1)]
    got = tile_sums(U[0], side[0], U[1], side[1], t0, diag, panel_cells=panel_rows * nj)
    pairs = [(i, j) for i in range(ni) for j in range(nj) if j > i or not diag]
    assert not singletons or 0 < got[0][SUMS.index("cdnv")] < brute(U, r, v, p, t0, pairs)[0][SUMS.index("cdnv")]
    want = brute(U, r, v, p, t0, pairs, a, (vs, z, b, 0.2, 0.5))
    assert want[0][SUMS.index("unresolved")] > 0 and want[0][SUMS.index("cdnv_deb")] > 0
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)


def test_coincident_directions_are_counted():
    u = np.array([[1.0, 0.0], [np.cos(1e-6), np.sin(1e-6)], [0.0, 1.0]])     # T = 1e-12 between the first two
    side = np.ones((10, 3))
    acc, _, _ = tile_sums(u, side, u, side, 1.0, True)
    assert acc[SUMS.index("coincident")] == 1


@pytest.mark.parametrize("tile", [5, 16, 64])
def test_fast_pass_equals_the_numpy_reference_tile_by_tile(tile):
    """Over every tile pair i <= j of a realistic kept set (unit means of centred Gaussian class means), the fused
    pass and the plain-numpy statement of the definitions agree to rounding."""
    rng = np.random.default_rng(tile)
    n, d = 150, 24
    M = rng.standard_normal((n, d)) * rng.uniform(0.5, 2, (n, 1))
    M -= M.mean(0)
    r = np.linalg.norm(M, axis=1)
    U = M / r[:, None]
    v = rng.uniform(0.1, 3, n)
    side = side_of(r, v, rng.dirichlet(np.ones(n)), rng.random(n) < 0.8, (v * 1.2, v / rng.integers(2, 9, n),
                                                                          rng.random(n) < 0.7, 0.1, 0.3))
    s = U.sum(0)
    t0 = 2 - 2 * (s @ s - n) / (n * (n - 1))
    spans = blocks(n, tile)
    for a, si in enumerate(spans):
        for sj in spans[a:]:
            args = (U[si], side[:, si], U[sj], side[:, sj], t0, si == sj)
            for fast, ref in zip(tile_sums(*args), reference_tile_sums(*args)):
                np.testing.assert_allclose(fast, ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("diag", [False, True])
def test_coincident_tiles_keep_the_reference_meaning(diag):
    """A tile with coincident directions and coincident means: the fused pass's count, x^2 and CDNV sums (+inf for
    coincident means), rows and columns are the reference's; the logs are not used there. ``found`` names the
    coincident pairs, those with coincident means marked."""
    rng = np.random.default_rng(7)
    n, d = 40, 5
    U = rng.standard_normal((n, d))
    U[[9, 30]] = U[3], U[3] * 2                                     # directions of 3, 9, 30 coincide
    U /= np.linalg.norm(U, axis=1, keepdims=True)
    r = rng.uniform(0.5, 3, n)
    r[9] = r[3]                                                    # and the means of 3 and 9
    side = side_of(r, rng.uniform(0, 2, n), rng.dirichlet(np.ones(n)))
    a, b = (slice(0, n), slice(0, n)) if diag else (slice(0, 20), slice(20, n))
    if not diag:                                                   # put a coincident mean across the two blocks
        U[25], r[25] = U[3], r[3]
        side = side_of(r, side[2], side[3])
    args = (U[a], side[:, a], U[b], side[:, b], 1.4, diag)
    found: list = []
    got = tile_sums(*args, panel_cells=7 * n, found=found, offsets=(a.start, b.start))
    want = reference_tile_sums(*args)
    keep = [SUMS.index(k) for k in ("coincident", "xx", "cdnv", "cdnv_p2", "cdnv_freq")]
    np.testing.assert_allclose(got[0][keep], want[0][keep], rtol=1e-12)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g, w, rtol=1e-12)
    if diag:
        assert found == [(3, 9, True), (3, 30, False), (9, 30, False)] and got[0][0] == 3
    else:
        assert found == [(3, 25, True), (9, 25, True), (3, 30, False), (9, 30, False)] and got[0][0] == 4
        assert np.isinf(got[1][[3, 9]]).all() and np.isinf(got[2][25 - 20]) and np.isfinite(got[2][30 - 20])


@pytest.mark.parametrize("diag", [False, True])
def test_coincident_means_of_a_class_without_variance_stay_out_of_the_cdnv(diag):
    """Classes 3 and 9 coincide, and 9 was seen once (no variance): their pair is no CDNV term, so the CDNV sums
    stay finite (not +inf), equal to the reference's and to the loops' over the pairs of classes with a variance."""
    rng = np.random.default_rng(8)
    n, d = 30, 5
    U = rng.standard_normal((n, d))
    U[9] = U[3]
    U /= np.linalg.norm(U, axis=1, keepdims=True)
    r, v, p = rng.uniform(0.5, 3, n), rng.uniform(0, 2, n), rng.dirichlet(np.ones(n))
    r[9] = r[3]
    a = np.ones(n)
    a[9] = 0
    side = side_of(r, v, p, a)
    s1, s2 = (slice(0, n), slice(0, n)) if diag else (slice(0, 5), slice(5, n))
    args = (U[s1], side[:, s1], U[s2], side[:, s2], 1.3, diag)
    got, want = tile_sums(*args), reference_tile_sums(*args)
    cd = [SUMS.index(k) for k in ("cdnv", "cdnv_p2", "cdnv_freq")]
    assert np.isfinite(got[0][cd]).all() and np.isfinite(got[1]).all() and np.isfinite(got[2]).all()
    np.testing.assert_allclose(got[0][cd], want[0][cd], rtol=1e-12)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g, w, rtol=1e-12)
    pairs = [(i, j) for i in range(s1.stop - s1.start) for j in range(s2.stop - s2.start) if j > i or not diag]
    with np.errstate(divide="ignore"):                             # the logs of the coincident pair: not compared
        loops = brute([U[s1], U[s2]], [r[s1], r[s2]], [v[s1], v[s2]], [p[s1], p[s2]], 1.3, pairs, [a[s1], a[s2]])
    np.testing.assert_allclose(got[0][cd], loops[0][cd], rtol=1e-12)
    np.testing.assert_allclose(got[1], loops[1], rtol=1e-12)


def test_the_host_computes_small_problems_in_its_own_thread_and_the_rest_on_the_policys_threads(monkeypatch):
    """Issue 52: the host engine's threads follow the work and the thread policy (engine_numba.workers): below
    SYNC_WORK multiply-adds the caller's thread; above, the innermost --threads policy's count (1 under --threads 1,
    where dask's own pool would take every core), else the cores allowed; and the sums are the same either way."""
    import warnings

    from test_metrics import random_study

    from ncanalyze.analyzer import class_stats, engine_numba
    from ncanalyze.analyzer.metrics import measure
    from ncanalyze.core import threads

    d = 64
    small, large = 256 * 255 / 2, 8192 * 8191 / 2                  # pairs of 256 and of 8,192 classes
    assert small * d + 256 * d * d < engine_numba.SYNC_WORK < large * d
    assert engine_numba.workers(small, 0, 256, d) == 1
    assert engine_numba.workers(0, small, 256, d) == 1              # a replicate's sampled pairs count alike
    assert engine_numba.workers(large, 0, 8192, d) == threads.available() >= 1
    for n in (1, 3):
        with threads.policy(n):
            assert engine_numba.workers(large, 0, 8192, d) == n
    h, y, W, b, hv, yv = random_study(V=300, d=16, N=20_000)
    ds = class_stats(h, y, 300, classifier=W, val_embeddings=hv, val_labels=yv, min_count=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        here = measure(ds, min_count=2, se=False, device="cpu", tile=32)
        monkeypatch.setattr(engine_numba, "SYNC_WORK", 0.0)          # the same tasks on the thread pool
        pool = measure(ds, min_count=2, se=False, device="cpu", tile=32)
    np.testing.assert_equal(here, pool)
