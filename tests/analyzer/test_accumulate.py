"""The accumulator contract (analyzer/accumulate.py ``Accumulator``): any split of a stream of (features, labels)
into parts, each part accumulated on its own and the parts merged in any order (any merge tree), equals one pass over
the stream: float64 statistics to 1e-12, counts exact, the reservoir exact, NC4's decision counts exact, the loss sums
to 1e-12; and one pass equals brute force. Then the one flatten/unflatten of nested states, and resume states in the
names today's and earlier code wrote."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ncanalyze.analyzer.accumulate import Accumulator, ClassStats, DecisionCounts, FoldStats
from ncanalyze.core.errors import CheckpointError
from ncanalyze.store.extraction.layers import plan
from ncanalyze.store.extraction.loss import NextTokenLoss
from ncanalyze.store.extraction.reservoir import Reservoir, position_keys
from ncanalyze.store.extraction.resume import Phase, flatten, save_state, unflatten
from ncanalyze.store.extraction.running import Extraction, LayerState
from ncanalyze.store.sources.anatomy import LogitTransform
from scipy.special import logsumexp

SEED = 7  # the reservoir's hash seed


def make_all(V: int, d: int, k: int, w: torch.Tensor, b: torch.Tensor, mu: torch.Tensor,
             kept: torch.Tensor) -> dict[str, Accumulator]:
    """A fresh accumulator of each kind; the decision counts and the loss share one fixed head and class means."""
    return {"stats": ClassStats(V, d), "folds": FoldStats(3, V, d), "reservoir": Reservoir(V, k, d, SEED),
            "decisions": DecisionCounts(w, b, mu, kept),
            "loss": NextTokenLoss(w, b, LogitTransform(multiply=1.5, softcap=4.0))}


def feed(accs: dict[str, Accumulator], h: torch.Tensor, y: torch.Tensor, pos: np.ndarray) -> None:
    for name, a in accs.items():
        if name == "reservoir":
            a.update(h, y.numpy(), pos)
        elif name == "folds":  # each token's fold from its stream position: the same however the stream is cut
            a.update(h, y, torch.from_numpy(pos % 3))
        else:
            a.update(h, y)


@st.composite
def streams(draw):
    n = draw(st.integers(0, 48))
    V, d, k = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(0, 3))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=5)))  # repeated cuts: empty parts
    seed = draw(st.integers(0, 2**31 - 1))
    merges = draw(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100)), min_size=6, max_size=6))
    return n, V, d, k, cuts, seed, merges


@settings(max_examples=50, deadline=None)
@given(streams())
def test_any_split_merged_in_any_order_equals_one_pass(stream):
    n, V, d, k, cuts, seed, merges = stream
    rng = np.random.default_rng(seed)
    h = torch.from_numpy(rng.normal(size=(n, d)) * rng.uniform(0.1, 10.0)).float()
    y = torch.from_numpy(rng.integers(0, V, n))
    pos = rng.permutation(10 * n + 1)[:n].astype(np.int64) + 1000  # distinct global stream positions
    w = torch.from_numpy(rng.normal(size=(V, d)))
    b = torch.from_numpy(rng.normal(size=V))
    mu = torch.from_numpy(rng.normal(size=(V, d)))
    kept = torch.from_numpy(np.flatnonzero(rng.random(V) < 0.7) if V > 1 else np.arange(1))
    if len(kept) == 0:
        kept = torch.arange(V)

    one = make_all(V, d, k, w, b, mu, kept)
    feed(one, h, y, pos)

    edges = [0, *cuts, n]
    parts = []
    for a, z in zip(edges, edges[1:]):
        acc = make_all(V, d, k, w, b, mu, kept)
        feed(acc, h[a:z], y[a:z], pos[a:z])
        parts.append(acc)
    for i, j in merges:  # any merge tree, in any order: fold a random part into another until one is left
        if len(parts) == 1:
            break
        i, j = i % len(parts), j % (len(parts) - 1)
        j += j >= i
        for name, a in parts[i].items():
            assert a.merge(parts[j][name]) is a
        parts.pop(j)
    while len(parts) > 1:
        for name, a in parts[0].items():
            a.merge(parts[-1][name])
        parts.pop()
    merged = parts[0]

    one["reservoir"].canonical(), merged["reservoir"].canonical()
    for name in one:
        got, want = flatten(merged[name].state_dict()), flatten(one[name].state_dict())
        assert got.keys() == want.keys()
        for key in want:
            if want[key].dtype.kind == "f" and name in ("stats", "loss", "folds"):
                np.testing.assert_allclose(got[key], want[key], rtol=1e-12, atol=1e-12, err_msg=f"{name}.{key}")
            else:  # counts, the reservoir (keys, positions, float32 samples) and decisions: exact
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name}.{key}")

    # one pass against brute force in float64
    H, Y = h.double().numpy(), y.numpy()
    s = one["stats"]
    count = np.bincount(Y, minlength=V)
    np.testing.assert_array_equal(s.count.numpy(), count)
    mean = np.zeros((V, d))
    for c in np.flatnonzero(count):
        mean[c] = H[Y == c].mean(0)
    dev = H - mean[Y]
    np.testing.assert_allclose(s.mean.numpy(), mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.m2.numpy(), np.bincount(Y, (dev * dev).sum(1), minlength=V), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.scatter.numpy(), dev.T @ dev, rtol=1e-12, atol=1e-12)
    r = one["reservoir"]
    for c in range(V):
        idx = np.flatnonzero(Y == c)
        best = idx[np.argsort(position_keys(pos[idx], SEED))[:k]]
        np.testing.assert_array_equal(r.position[c, :len(best)], pos[best])
        np.testing.assert_array_equal(r.samples[c, :len(best)], h[best].numpy())
    K, W, B, M = kept.numpy(), w.numpy(), b.numpy(), mu.numpy()
    linear = K[(H @ W[K].T + B[K]).argmax(1)] if n else np.zeros(0, dtype=np.int64)
    ncc = K[((H[:, None, :] - M[K][None]) ** 2).sum(-1).argmin(1)] if n else np.zeros(0, dtype=np.int64)
    counts = one["decisions"].counts
    np.testing.assert_array_equal(counts["val_count"].numpy(), count)
    np.testing.assert_array_equal(counts["val_correct"].numpy(), np.bincount(Y[linear == Y], minlength=V))
    np.testing.assert_array_equal(counts["val_ncc_agree"].numpy(), np.bincount(Y[linear == ncc], minlength=V))
    logits = 4.0 * np.tanh(1.5 * (H @ W.T + B) / 4.0)
    loss = one["loss"].state
    nll = logsumexp(logits, axis=1) - logits[np.arange(n), Y]
    assert float(loss["loss_sum"]) == pytest.approx(float(nll.sum()), rel=1e-12, abs=1e-12)
    assert int(loss["tokens"]) == n
    assert int(loss["correct"]) == int((logits.argmax(1) == Y).sum())


def test_every_accumulator_declares_the_protocol():
    V, d = 4, 3
    w, mu = torch.randn(V, d, dtype=torch.float64), torch.randn(V, d, dtype=torch.float64)
    for acc in make_all(V, d, 2, w, None, mu, torch.arange(V)).values():
        assert isinstance(acc, Accumulator) and Accumulator in type(acc).__mro__
    assert not isinstance(object(), Accumulator)


def test_flatten_and_unflatten_are_inverse_with_the_names_of_saved_states():
    layer = LayerState(5, 3, 2, 0, "cpu")
    layer.stats.update(torch.randn(7, 3), torch.tensor([0, 1, 1, 4, 4, 4, 2]))
    flat = flatten({"layer3": layer.state_dict(), "phase": 1})
    assert {"layer3.stats.count", "layer3.stats.scatter", "layer3.reservoir.pool", "layer3.val.val_ncc_agree",
            "layer3.lm.loss_sum", "phase"} <= flat.keys()
    assert all(isinstance(v, np.ndarray) for v in flat.values())
    back = unflatten(flat)
    assert int(back["phase"]) == 1
    for k, v in layer.stats.state_dict().items():
        np.testing.assert_array_equal(back["layer3"]["stats"][k], v.numpy())
    assert flatten(back).keys() == flat.keys()


def layer_state(ex: LayerState, l: int, phase: int, batches: int, at: int = 0) -> dict[str, np.ndarray]:
    """A resume state of a plan whose pass ``at`` holds layer ``l`` alone, built by hand from ``ex``'s arrays."""
    arrays = flatten({f"layer{l}": ex.state_dict()})
    return arrays | {"pass": np.array(at), "phase": np.array(phase), "batches": np.array(batches),
                     "stream": np.array("abc"), "passes": np.array("[]"), "config": np.array("{}")}


def test_resume_states_load_under_layer_names_or_are_refused(tmp_path):
    """Every layer's arrays are saved under ``layer<l>.`` (the default plan's last layer too); a state is loaded as
    saved, and one that lacks a name, misfits or does not add up is refused with the --restart line."""
    V, d, k = 6, 3, 2
    src = LayerState(V, d, k, 0, "cpu")
    h, y = torch.randn(10, d), torch.tensor([0, 1, 2, 2, 3, 3, 3, 5, 5, 0])
    src.stats.update(h, y)
    src.reservoir.update(h, y.numpy(), np.arange(10))
    ex = Extraction(plan(n=2), V, d, k, 0, "cpu")
    ex.load(layer_state(src, 2, int(Phase.TRAIN), 2), tokens_per_batch=5, where="s.npz")
    assert (ex.pass_index, ex.phase, ex.batches, ex.stream) == (0, Phase.TRAIN, 2, "abc")
    for n, v in src.stats.state_dict().items():
        np.testing.assert_array_equal(ex.main().stats.state_dict()[n].numpy(), v.numpy())
    np.testing.assert_array_equal(ex.main().reservoir.samples, src.reservoir.samples)
    assert ex.state({}).keys() == layer_state(src, 2, 0, 2).keys()
    for name in ("layer2.lm.loss_sum", "stream", "layer2.stats.unit_sum"):  # every name a state is written with
        lacking = {n: v for n, v in layer_state(src, 2, int(Phase.VALIDATION), 1).items() if n != name}
        with pytest.raises(CheckpointError, match=f"{name} \\(missing\\).*pass --restart"):
            ex.load(lacking, tokens_per_batch=5, where="s.npz")
    # inconsistent (10 tokens counted, at most 5 in one batch) or misshapen: refused with the --restart line
    with pytest.raises(CheckpointError, match="inconsistent.*pass --restart"):
        ex.load(layer_state(src, 2, int(Phase.TRAIN), 1), tokens_per_batch=5, where="s.npz")
    with pytest.raises(CheckpointError, match="does not fit.*pass --restart"):
        Extraction(plan(n=2), V + 1, d, k, 0, "cpu").load(layer_state(src, 2, 0, 2), 5, "s.npz")
    # a layered plan in its second pass: the first pass's layers wait, finished, in its folder
    layered = plan("all", 2, 0, "float32", 2)
    for l in (0, 1):
        save_state(tmp_path / f"layer-{l}.npz", flatten(src.state_dict()))
    ex = Extraction(layered, V, d, k, 0, "cpu", tmp_path)
    saved = {n: v for n, v in layer_state(src, 2, 0, 2, at=1).items() if n != "passes"}  # K given: no auto passes
    ex.load(saved, tokens_per_batch=5, where="s.npz")
    assert (ex.pass_index, [s.index for s in ex.layers]) == (1, [2])
    np.testing.assert_array_equal(ex.main().stats.mean.numpy(), src.stats.mean.numpy())
    assert ex.state({}).keys() == saved.keys()


def test_class_sums_at_the_real_vocabulary_with_zipf_labels_equal_brute_force_with_one_grouping_shared():
    """Zipf labels over V = 128,256 (a few hot classes, a long tail): batches folded by the sorted segment reduction
    equal a numpy float64 brute force to 1e-12; the batch's grouping shared between layers (as the train pass shares
    it) gives bit for bit the statistics of each layer grouping on its own, and a second run is bit for bit the
    first (no atomics: deterministic); the segment reduction CUDA runs gives the CPU's sums bit for bit."""
    from ncanalyze.analyzer.accumulate import Groups

    rng = np.random.default_rng(11)
    V, d, n, batches = 128_256, 6, 3000, 4
    Y = np.minimum(rng.zipf(1.1, n * batches), V) - 1
    H = rng.normal(size=(n * batches, d)) * 3 + 1
    h, y = torch.from_numpy(H).float(), torch.from_numpy(Y)
    own, shared, again = ClassStats(V, d), ClassStats(V, d), ClassStats(V, d)
    for s in range(0, len(Y), n):
        hb, yb = h[s:s + n], y[s:s + n]
        groups = Groups(yb)
        assert torch.equal(groups.classes, torch.unique(yb)) and int(groups.lengths.sum()) == n
        sorted_rows = groups.sort(hb.double())  # CUDA's segment reduction and the CPU's index_add_: the same sums
        assert torch.equal(groups.sum(sorted_rows, segmented=True), groups.sum(sorted_rows, segmented=False))
        own.update(hb, yb)
        shared.update(hb, yb, groups)
        again.update(hb, yb, groups)
    for k, v in own.state_dict().items():
        assert torch.equal(v, shared.state_dict()[k]) and torch.equal(v, again.state_dict()[k]), k
    X = h.double().numpy()
    count = np.bincount(Y, minlength=V)
    assert count.max() > 500 and (count == 1).sum() > 100  # hot classes and a long tail
    np.testing.assert_array_equal(own.count.numpy(), count)
    sums = np.zeros((V, d))
    np.add.at(sums, Y, X)
    seen = count > 0
    mean = np.zeros((V, d))
    mean[seen] = sums[seen] / count[seen, None]
    dev = X - mean[Y]
    np.testing.assert_allclose(own.mean.numpy(), mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(own.m2.numpy(), np.bincount(Y, (dev * dev).sum(1), minlength=V), rtol=1e-12,
                               atol=1e-12)
    np.testing.assert_allclose(own.scatter.numpy(), dev.T @ dev, rtol=1e-12)
    np.testing.assert_allclose(own.unit_sum.numpy(), (X / np.linalg.norm(X, axis=1, keepdims=True)).sum(0),
                               rtol=1e-12)


def _nc4_numpy(W, b, M, kept, H, Z, y):
    """NC4's three counts by brute force in numpy float64: argmax over the kept classes of W z + b, and the nearest
    kept class mean to h by squared distance."""
    V = W.shape[0]
    linear = kept[(Z @ W[kept].T + b[kept]).argmax(1)]
    ncc = kept[((H[:, None] - M[kept][None]) ** 2).sum(-1).argmin(1)]
    return {"val_count": np.bincount(y, minlength=V), "val_correct": np.bincount(y[linear == y], minlength=V),
            "val_ncc_agree": np.bincount(y[linear == ncc], minlength=V)}


def _nc4_previous(W, b, M, kept, H, Z, y):
    """The previous path (before the tiles): the kept head rows and the kept means copied, one argmax over all."""
    V = W.shape[0]
    w, mu = W[kept], M[kept]
    linear = kept[(Z @ w.T + b[kept]).argmax(1)]
    ncc = kept[(H @ mu.T - 0.5 * (mu * mu).sum(1)).argmax(1)]
    return {"val_count": torch.bincount(y, minlength=V), "val_correct": torch.bincount(y[linear == y], minlength=V),
            "val_ncc_agree": torch.bincount(y[linear == ncc], minlength=V)}


@pytest.mark.parametrize("screen32", [True, False], ids=["float32-screen", "float64"])
@pytest.mark.parametrize("budget", [1 << 25, 7 * 24, 24], ids=["one-tile", "tiles-of-7", "tiles-of-1"])
def test_nc4_over_tiles_of_classes_equals_brute_force_and_the_previous_path(budget, screen32):
    """NC4's counts with the classes scored a tile at a time (and through a lens) equal a numpy float64 brute force
    and the previous path (the kept rows copied, one argmax), on well-separated and on near-collapsed classes."""
    from ncanalyze.analyzer.accumulate import DecisionCounts

    rng = np.random.default_rng(5)
    V, d, n = 40, 24, 300
    kept = torch.from_numpy(np.sort(rng.choice(V, 29, replace=False)))
    lens = torch.nn.LayerNorm(d).double()
    for spread in (1.0, 1e-3):
        W = torch.from_numpy(rng.normal(size=(V, d)))
        b = torch.from_numpy(rng.normal(size=V))
        M = torch.from_numpy(rng.normal(size=(V, d)) * spread)
        y = torch.from_numpy(rng.integers(0, V, n))
        H = M[y] + torch.from_numpy(rng.normal(size=(n, d))) * spread
        c = DecisionCounts(W, b, M, kept, budget=budget, lens=lens, screen32=screen32)
        assert c.tile == max(1, budget // d) if budget < 1 << 25 else c.tile >= len(kept)
        c.update(H, y)
        with torch.no_grad():
            Z = lens(H)
        want = _nc4_numpy(W.numpy(), b.numpy(), M.numpy(), kept.numpy(), H.numpy(), Z.numpy(), y.numpy())
        previous = _nc4_previous(W, b, M, kept, H, Z, y)
        for name in DecisionCounts.NAMES:
            np.testing.assert_array_equal(c.counts[name].numpy(), want[name], err_msg=f"{name} at spread {spread}")
            assert torch.equal(c.counts[name], previous[name]), name
        assert 0 < int(c.counts["val_ncc_agree"].sum()) and 0 < int(c.counts["val_correct"].sum())


def test_chan_merge_of_parts_equals_one_pass():
    rng = np.random.default_rng(0)
    V, d, n = 40, 6, 3000
    y = torch.as_tensor(rng.integers(0, V - 5, n))  # the last classes never occur
    h = torch.as_tensor(rng.normal(3.0, 2.0, (n, d)))
    one = ClassStats(V, d)
    for s in range(0, n, 100):
        one.update(h[s:s + 100], y[s:s + 100])
    parts = []
    for a, b in ((0, 700), (700, 1900), (1900, 3000)):
        p = ClassStats(V, d)
        for s in range(a, b, 100):
            p.update(h[s:s + 100], y[s:s + 100])
        parts.append(p)
    merged = parts[0].merge(parts[1]).merge(parts[2])
    assert torch.equal(merged.count, one.count)
    for name in ("mean", "m2", "scatter"):
        np.testing.assert_allclose(getattr(merged, name), getattr(one, name), rtol=1e-12, atol=1e-12, err_msg=name)
    # an empty side is copied exactly
    empty = ClassStats(V, d)
    assert torch.equal(empty.merge(parts[0]).mean, parts[0].mean)


def _brute(h: np.ndarray, y: np.ndarray, V: int) -> dict[str, np.ndarray]:
    """count, mean, m2, scatter and unit_sum of float64 rows by numpy's own two-pass sums; unit rows by math.hypot
    (scaled, so it neither overflows nor underflows)."""
    import math

    count = np.bincount(y, minlength=V)
    mean = np.zeros((V, h.shape[1]))
    np.add.at(mean, y, h)
    mean[count > 0] /= count[count > 0, None]
    dev = h - mean[y]
    norms = np.array([math.hypot(*r) for r in h])
    unit = (h / np.where(norms > 0, norms, 1)[:, None]).sum(0)
    return {"count": count, "mean": mean, "m2": np.bincount(y, (dev * dev).sum(1), minlength=V),
            "scatter": dev.T @ dev, "unit_sum": unit}


def test_the_totals_made_from_the_folds_equal_brute_force_and_stay_live():
    """FoldStats.totals (the folds merged in fold order) equals numpy's float64 statistics of every token (counts
    exactly, the rest to 1e-12 of each variable's largest value) and one ClassStats pass; ``into`` is overwritten in
    place (a view of it sees the new totals, as the validation pass reads the means)."""
    rng = np.random.default_rng(3)
    V, d, F = 40, 6, 5
    folds, one, stream = FoldStats(F, V, d), ClassStats(V, d), []
    for b in range(9):  # batches of 4 blocks of 16 tokens, block i -> fold i mod F
        h = torch.from_numpy(rng.normal(size=(64, d)) * 3 + rng.normal(size=d) * 10).float()
        y = torch.from_numpy(np.minimum(rng.zipf(1.5, 64) - 1, V - 1))
        fold = torch.arange(4 * b, 4 * b + 4).repeat_interleave(16) % F
        folds.update(h, y, fold)
        one.update(h, y)
        stream.append((h.double().numpy(), y.numpy()))
    into = ClassStats(V, d)
    view = into.mean[:3]
    made = folds.totals(into=into)
    assert made is into and view.abs().sum() > 0
    brute = _brute(np.concatenate([h for h, _ in stream]), np.concatenate([y for _, y in stream]), V)
    for name, want in brute.items():
        for got in (made.state_dict()[name], one.state_dict()[name]):
            scale = np.abs(want).max()
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12 * scale, err_msg=name)
    np.testing.assert_array_equal(made.count.numpy(), brute["count"])
    again = folds.totals(into=into)  # made again from the same folds: the same bits
    np.testing.assert_array_equal(again.mean.numpy(), made.mean.numpy())


@pytest.mark.parametrize("scale", [1e-200, 1e-3, 1.0, 1e200])
def test_unit_sums_hold_at_any_scale_and_zero_rows(scale):
    """The unit-vector sums (the CPU's numba pass and torch's matrix-vector product a fold, a GPU's; the scaled rows
    where squares would overflow or underflow) equal math.hypot's unit rows summed, at 1e-200 and 1e200 too, a zero row adding nothing."""
    rng = np.random.default_rng(5)
    h = rng.normal(size=(30, 4)) * scale
    if scale == 1e-3:  # a zero row (the scaled path); at 1.0 the weighed one alone
        h[7] = 0.0
    y = rng.integers(0, 3, 30)
    fold = torch.from_numpy(np.arange(30) % 2)
    one, folds, at_once = ClassStats(3, 4), FoldStats(2, 3, 4), FoldStats(2, 3, 4)
    one.update(torch.from_numpy(h), torch.from_numpy(y))
    folds.update(torch.from_numpy(h), torch.from_numpy(y), fold)
    at_once.update_at_once(torch.from_numpy(h), torch.from_numpy(y), fold)  # torch's sums (a GPU's), on the CPU
    want = _brute(h, y, 3)["unit_sum"]
    np.testing.assert_allclose(one.unit_sum.numpy(), want, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(folds.totals().unit_sum.numpy(), want, rtol=1e-13, atol=1e-13)
    for f in range(2):
        for path in (folds, at_once):
            np.testing.assert_allclose(path.unit_sum[f].numpy(), _brute(h[f::2], y[f::2], 3)["unit_sum"],
                                       rtol=1e-13, atol=1e-13)


def test_each_folds_scatter_equals_brute_force_where_rows_add_nothing():
    """The rows Chan's scatter update leaves out because they add exactly 0 (a token alone in its (fold, class) group
    of the batch; a group new to its fold) are left out and nothing else: each fold's statistics equal numpy's float64
    ones of that fold's tokens (1e-12 of each variable's largest value, counts exactly) over batches of every distinct
    label (every deviation row left out), of new classes in repeated groups (every delta row left out), of old classes
    only, and one that leaves a fold empty."""
    rng = np.random.default_rng(11)
    V, d, F = 50, 5, 3
    offset = rng.normal(size=d) * 20
    labels = [np.arange(12), np.repeat(np.arange(12, 18), 2), np.repeat(np.arange(6), 2), rng.integers(0, 18, 12)]
    folds, stream = FoldStats(F, V, d), []
    for b, y in enumerate(labels):
        h = rng.normal(size=(12, d)) * 2 + offset
        fold = np.repeat([0, 1, 2], 4) if b != 3 else np.repeat([0, 2], 6)  # the last batch leaves fold 1 empty
        folds.update(torch.from_numpy(h).float(), torch.from_numpy(y), torch.from_numpy(fold))
        stream.append((torch.from_numpy(h).float().double().numpy(), y, fold))
    h, y, fold = (np.concatenate(x) for x in zip(*stream))
    for f, part in enumerate(folds.parts):
        want = _brute(h[fold == f], y[fold == f], V)
        np.testing.assert_array_equal(part.count.numpy(), want["count"])
        for name in ("mean", "m2", "scatter"):
            np.testing.assert_allclose(part.state_dict()[name].numpy(), want[name], rtol=1e-12,
                                       atol=1e-12 * np.abs(want[name]).max(), err_msg=f"fold {f} {name}")


def test_every_fold_at_once_equals_each_fold_in_turn_and_brute_force():
    """FoldStats.update_at_once (the update a GPU runs: torch's Chan update over every (fold, class) cell, then each
    fold's scatter and unit-vector sum from its own rows) and the folds updated one by one (:meth:`FoldStats.update`,
    the CPU's numba pass, chan_numba.py) both equal numpy's float64 statistics of each fold's tokens (counts exactly,
    the rest to 1e-12 of each variable's largest value), over batches of every distinct label, of repeated new
    classes, of classes seen before, one leaving a fold empty, Zipf batches of hot and cold classes, and bfloat16
    features (the CPU pass converts a group's rows to float32 first)."""
    rng = np.random.default_rng(5)
    V, d, F = 60, 7, 4
    labels = [np.arange(16), np.repeat(np.arange(16, 24), 2), np.repeat(np.arange(8), 2),
              *(np.minimum(rng.zipf(1.3, 16), V) - 1 for _ in range(5))]
    one_by_one, at_once, stream = FoldStats(F, V, d), FoldStats(F, V, d), []
    for b, y in enumerate(labels):
        h = torch.from_numpy(rng.normal(size=(16, d)) * 3 + 5).to(torch.bfloat16 if b == 6 else torch.float32)
        fold = torch.from_numpy(rng.integers(0, F, 16) if b != 2 else np.repeat([0, 3], [5, 11]))  # b = 2: 1, 2 empty
        one_by_one.update(h, torch.from_numpy(y), fold)
        at_once.update_at_once(h, torch.from_numpy(y), fold)
        stream.append((h.double().numpy(), y, fold.numpy()))
    h, y, fold = (np.concatenate(x) for x in zip(*stream))
    assert one_by_one.count.sum() == 16 * len(labels)
    for f in range(F):
        want = _brute(h[fold == f], y[fold == f], V)
        for path in (one_by_one, at_once):
            np.testing.assert_array_equal(path.parts[f].count.numpy(), want["count"])
            for name in ("mean", "m2", "scatter", "unit_sum"):
                np.testing.assert_allclose(path.parts[f].state_dict()[name].numpy(), want[name], rtol=1e-12,
                                           atol=1e-12 * np.abs(want[name]).max(), err_msg=f"fold {f} {name}")


@pytest.mark.parametrize("screen32", [True, False], ids=["float32-screen", "float64"])
@pytest.mark.parametrize("budget", [1 << 25, 9 * 8], ids=["one-tile", "tiles-of-9"])
def test_nc4s_linear_decisions_at_every_kept_set_on_exact_ties_across_the_leaders_end(budget, screen32):
    """A head whose rows repeat in groups (exact ties of up to 24 classes, more than the LEADERS list holds) and a
    few distinct rows: the linear decisions at every NC4_MIN_COUNTS kept set, formed from tiles (``update``) and from
    the loss's logits (``count_logits``), count as a numpy float64 argmax over each set's columns (the first of equal
    logits); the loss's accuracy as numpy's argmax over the vocabulary, and its loss as numpy's."""
    from ncanalyze.analyzer.accumulate import DecisionCounts
    from ncanalyze.analyzer.schema import NC4_MIN_COUNTS, VAL_AT
    from ncanalyze.analyzer.screen import LEADERS
    from ncanalyze.store.extraction.loss import NextTokenLoss
    from ncanalyze.store.sources.anatomy import LogitTransform

    rng = np.random.default_rng(11)
    V, d, n = 90, 8, 400
    base = rng.normal(size=(6, d)) * 3  # the groups often hold the best logit
    group = np.r_[np.zeros(24, int), np.ones(24, int), np.arange(2, 6).repeat(3), np.full(V - 60, -1)]
    W = np.where(group[:, None] >= 0, base[np.maximum(group, 0)], rng.normal(size=(V, d)))
    b = np.where(group >= 0, 0.0, rng.normal(size=V))
    assert (np.bincount(group[group >= 0]) > LEADERS).any()
    train_count = torch.from_numpy(rng.integers(0, 30, V))
    M = torch.from_numpy(rng.normal(size=(V, d)))
    H, y = rng.normal(size=(n, d)) * 2, rng.integers(0, V, n)
    Wt, bt, Ht, yt = (torch.from_numpy(a) for a in (W, b, H, y))
    kept = torch.nonzero(train_count >= 1).squeeze(1)
    by_tiles = DecisionCounts(Wt, bt, M, kept, budget=budget, train_count=train_count, screen32=screen32)
    by_tiles.update(Ht, yt)
    by_logits = DecisionCounts(Wt, bt, M, kept, budget=budget, train_count=train_count)
    loss = NextTokenLoss(Wt, bt, LogitTransform(), budget=V * 64)
    loss.update(Ht, yt, by_logits.count_logits)
    logits = H @ W.T + b
    for i, m in enumerate(NC4_MIN_COUNTS):
        cols = np.flatnonzero(train_count.numpy() >= m)
        linear = cols[logits[:, cols].argmax(1)]
        want = np.bincount(y[linear == y], minlength=V)
        for c in (by_tiles, by_logits):
            np.testing.assert_array_equal(c.counts[VAL_AT[0]][i].numpy(), want, err_msg=f"min_count {m}")
    tied = (logits[:, :24].max(1) >= logits.max(1)) | (logits[:, 24:48].max(1) >= logits.max(1))
    assert tied.sum() > 50  # rows whose best is a tie of 24 (the list cannot hold it)
    top = logits.argmax(1)
    assert int(loss.state["correct"]) == int((top == y).sum()) > 0
    nll = logits.max(1) + np.log(np.exp(logits - logits.max(1)[:, None]).sum(1)) - logits[np.arange(n), y]
    assert float(loss.state["loss_sum"]) == pytest.approx(nll.sum(), rel=1e-12)
