"""The reservoir keeps exactly the K positions with the smallest keys per class, filled slots first."""
import numpy as np
import pytest
import torch
from ncanalyze.store.extraction.reservoir import Reservoir, position_keys


@pytest.mark.parametrize("seed", range(4))
def test_bottom_k_whatever_the_batching(seed):
    rng = np.random.default_rng(seed)
    V, K, d, n = 9, 3, 4, 700
    y = rng.integers(0, V - 1, n)
    y[int(rng.integers(n))] = V - 1  # one class seen once
    h, pos = torch.randn(n, d), np.arange(n) + 1000 * seed
    r = Reservoir(V, K, d, seed=5)
    step = int(rng.integers(1, 80))
    for s in range(0, n, step):
        r.update(h[s:s + step], y[s:s + step], pos[s:s + step])
    keys = position_keys(pos, 5)
    assert len(set(keys.tolist())) == n  # a bijective hash: no ties
    for c in range(V):
        idx = np.flatnonzero(y == c)
        best = idx[np.argsort(keys[idx])[:K]]
        m = r.n_samples[c]
        assert m == min(K, len(idx))
        assert set(r.position[c, :m].tolist()) == set(pos[best].tolist())
        assert (r.position[c, m:] == -1).all()
        rows = r.position[c, :m] - 1000 * seed
        np.testing.assert_array_equal(r.samples[c, :m], h[rows].numpy())


def test_keys_are_uniform():
    u = position_keys(np.arange(200_000)) / 2.0 ** 63
    hist = np.histogram(u, bins=20, range=(0, 1))[0]
    expected = len(u) / 20
    assert ((hist - expected) ** 2 / expected).sum() < 43.8  # chi-square, 19 dof, p = 0.001


def test_reservoir_merge_is_the_one_pass_sample():
    rng = np.random.default_rng(1)
    V, K, d, n = 12, 3, 4, 900
    y, h, pos = rng.integers(0, V, n), torch.randn(n, d), np.arange(n)
    one = Reservoir(V, K, d, seed=3)
    one.update(h, y, pos)
    a, b = Reservoir(V, K, d, seed=3), Reservoir(V, K, d, seed=3)
    a.update(h[:400], y[:400], pos[:400])
    b.update(h[400:], y[400:], pos[400:])
    a.merge(b)
    one.canonical()
    for x in ("key", "position", "samples"):
        np.testing.assert_array_equal(getattr(a, x), getattr(one, x), err_msg=x)
