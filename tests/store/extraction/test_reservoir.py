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


def test_the_pool_holds_the_samples_taken_and_a_state_round_trips():
    """The samples live in a pool as long as the slots filled (its capacity at most twice that, never classes x k x d):
    3,000 tokens over 20,000 classes keep their rows, not 20,000 x 2 x d floats. A saved
    state loads back to the same dense samples; one whose rows do not point one to one into its pool at exactly its
    filled slots is refused in one line, never read into wrong samples."""
    from ncanalyze.core.errors import CheckpointError

    rng = np.random.default_rng(3)
    V, K, d, n = 20_000, 2, 64, 3000
    y, h, pos = rng.integers(0, V, n), torch.randn(n, d), np.arange(n)
    r = Reservoir(V, K, d, seed=1)
    for s in range(0, n, 700):
        r.update(h[s:s + 700], y[s:s + 700], pos[s:s + 700])
    filled = int(r.n_samples.sum())
    assert r.used == filled == len(r.pool) and r._pool.shape[0] <= max(1024, 2 * filled) < V * K
    dense = r.samples
    assert dense.shape == (V, K, d)
    for c in np.unique(y)[:50]:
        m = r.n_samples[c]
        np.testing.assert_array_equal(dense[c, :m], h[r.position[c, :m]].numpy())
        assert not dense[c, m:].any()
    again = Reservoir(V, K, d, seed=1)
    again.load_state_dict({k: v.copy() for k, v in r.state_dict().items()})
    np.testing.assert_array_equal(again.samples, dense)
    state = r.state_dict()
    def flat_row(s):
        return s["row"].reshape(-1)

    for name, forge in [("a row twice", lambda s: flat_row(s).__setitem__(np.flatnonzero(s["row"] >= 0)[:2], 0)),
                        ("a row past the pool", lambda s: flat_row(s).__setitem__(s["row"].argmax(), filled)),
                        ("a sample short", lambda s: s.__setitem__("pool", s["pool"][:-1])),
                        ("an empty slot with a row", lambda s: s["key"].__setitem__(s["row"] >= 0, 2**64 - 1))]:
        bad = {k: v.copy() for k, v in state.items()}
        forge(bad)
        with pytest.raises(CheckpointError, match="reservoir's rows do not match its .* samples; pass --restart"):
            Reservoir(V, K, d, seed=1).load_state_dict(bad)
