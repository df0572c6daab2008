"""NC4's float32 screen with a float64 recheck (analyzer/screen.py, issue 52): every decision equals a float64 brute
force on planted exact ties and near-ties (margins of 1e-7 of the scale), over nested kept sets, and the screen's error
stays within its stated bound."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from ncanalyze.analyzer import screen
from ncanalyze.analyzer.screen import U32, Screen


def brute(h: np.ndarray, mu: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """argmin over ``kept`` of the float64 squared distance, the first (smallest) class of equal distances."""
    d2 = ((h[:, None, :] - mu[kept][None]) ** 2).sum(-1)
    return kept[d2.argmin(1)]


def planted(rng: np.random.Generator, V: int = 60, d: int = 16, offset: float = 50.0):
    """Means with a large shared part and three equal rows (exact ties); tokens at the equal rows, near the
    mid-plane of pairs of classes with margins of +-1e-7 and +-1e-9 of ||h|| ||mu|| (raw scale) and +-1e-7 of the
    shifted scale (inside the float32 bound: rechecked), and at random."""
    common = rng.normal(size=d) * offset
    mu = common + rng.normal(size=(V, d))
    mu[1], mu[7] = mu[3], mu[3]
    for a in (10, 20, 30, 40):  # pairs close enough that their mid-plane's tokens are nearest to them
        mu[a + 1] = mu[a] + 0.05 * rng.normal(size=d)
    raw, shifted = np.linalg.norm(mu, axis=1).max() ** 2, np.linalg.norm(mu - mu.mean(0), axis=1).max() ** 2
    near = []
    for a, b in [(10, 11), (20, 21), (30, 31), (40, 41)]:
        v = mu[b] - mu[a]
        for lam in (1e-7 * raw, 1e-9 * raw, 1e-7 * shifted):
            for sign in (1, -1):  # ||h - mu_a||^2 - ||h - mu_b||^2 = 2 lam: b nearer for +, a for -
                near.append((mu[a] + mu[b]) / 2 + sign * lam * v / (v @ v))
    h = np.concatenate([mu[[3, 1, 7]], np.stack(near), common + rng.normal(size=(200, d)) * 1.5])
    return mu, h


@pytest.mark.parametrize("budget, hold, steps", [(1 << 25, True, None), (16 * 7, True, None),
                                                 (16 * 7, False, None), (1 << 25, True, 5)],
                         ids=["one-tile", "tiles-of-7", "tiles-of-7-per-call", "cache-steps-of-5"])
def test_the_screen_decides_as_a_float64_brute_force_on_planted_ties_and_near_ties(budget, hold, steps, monkeypatch):
    """Every kept set's decisions equal the brute force, with the float32 rows held (the CPU's way) or made per call
    (CUDA's way, run here on the CPU)."""
    if steps:  # the CPU's cache-sized steps of classes (screen.cache_step), here of 5 classes
        monkeypatch.setattr(screen, "CACHE32", 1)
        monkeypatch.setattr(screen, "FEWEST", steps)
    rng = np.random.default_rng(3)
    mu, h = planted(rng)
    count = rng.integers(0, 30, len(mu))
    count[[1, 3, 7, 10, 11, 20, 21, 30, 31, 40, 41]] = 25  # the tied classes in every kept set
    count[0] = 0
    sets = [np.nonzero(count >= m)[0] for m in (1, 2, 5, 20)]
    s = Screen(torch.from_numpy(mu), [torch.from_numpy(k) for k in sets], budget=budget, hold=hold)
    got = s.argmax(torch.from_numpy(h))
    for kept, g in zip(sets, got):
        np.testing.assert_array_equal(g.numpy(), brute(h, mu, kept))
    assert got[0][:3].tolist() == [1, 1, 1]  # at the three equal rows: the first of them
    assert got[0][3:3 + 24].tolist() == [b if i % 2 == 0 else a for a, b in [(10, 11), (20, 21), (30, 31), (40, 41)]
                                         for i in range(6)]
    assert s.rechecked >= 4 * (3 + 8) and s.screened > 0.8 * 4 * len(h)  # the ties went to float64, the rest not


def test_exact_ties_between_distinct_means_go_to_the_first_class():
    """Integer means and tokens (every score exact in float32 and float64): tokens equidistant from distinct means
    go to the smallest class, as the float64 argmin does."""
    rng = np.random.default_rng(4)
    mu = rng.integers(-8, 9, size=(30, 6)).astype(np.float64) * 2
    a, b = rng.integers(0, 30, (2, 400))
    h = (mu[a] + mu[b]) / 2  # midpoints: exact ties where a != b (unless a nearer mean exists)
    kept = np.arange(30)
    got = Screen(torch.from_numpy(mu), [torch.from_numpy(kept)]).argmax(torch.from_numpy(h))[0].numpy()
    np.testing.assert_array_equal(got, brute(h, mu, kept))


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_the_screens_error_stays_within_its_bound(scale):
    """|screened - exact| <= E(x) for every token and class (the exact shifted score in float64), and E is small
    beside the score's scale (a bound that recheck everything would be sound and useless)."""
    rng = np.random.default_rng(5)
    d = 256
    mu = (rng.normal(size=(500, d)) + 20) * scale
    h = (rng.normal(size=(300, d)) + 20) * scale
    s = Screen(torch.from_numpy(mu), [torch.arange(500)])
    xs = torch.from_numpy(h) - s.shift
    r = torch.from_numpy(mu)[s.union] - s.shift
    exact = xs @ r.T - 0.5 * (r * r).sum(1)
    err = (s.scores(xs.float()).double() - exact).abs()
    e = s.bound(xs)
    assert (err <= e[:, None]).all()
    assert float(e.max()) < 1e-3 * float(exact.abs().mean())
    assert float(e.max()) > float(err.max())  # and it is a bound, not a guess: near what float32 gives
    assert s.coef == pytest.approx((1.02 * d + 4) * U32)


def test_nested_sets_are_required():
    with pytest.raises(ValueError, match="nested"):
        Screen(torch.zeros(5, 2, dtype=torch.float64), [torch.tensor([0, 1]), torch.tensor([2, 3])])


def near_pairs(rows: np.ndarray, pairs, scale: float) -> list[np.ndarray]:
    """Tokens near the mid-plane of each pair of ``rows``: margins +-1e-7 and +-1e-9 of ``scale``."""
    out = []
    for a, b in pairs:
        v = rows[b] - rows[a]
        for lam in (1e-7 * scale, 1e-9 * scale):
            out += [(rows[a] + rows[b]) / 2 + sign * lam * v / (v @ v) for sign in (1, -1)]
    return out


@pytest.mark.parametrize("budget, hold, steps", [(1 << 25, True, None), (16 * 7, True, None),
                                                 (16 * 7, False, None), (1 << 25, True, 5)],
                         ids=["one-tile", "tiles-of-7", "tiles-of-7-per-call", "cache-steps-of-5"])
def test_leave_one_fold_out_decisions_equal_a_float64_brute_force_on_planted_near_ties(budget, hold, steps, monkeypatch):
    """NC4's replicate decisions (accumulate.WithoutFold: the full screen's best scores for the classes fold 0 does
    not move, one screen of the moved ones, the unclear tokens screened again in full) equal a float64 brute force over
    the means without fold 0, at near-ties between a moved and an unmoved class, two unmoved, two moved, exact ties
    (the first class wins), a class fold 0 holds alone (not kept), and at random; both ways of deciding are used, with
    the float32 rows held (the CPU's way) or made per call (CUDA's way, run here on the CPU)."""
    if steps:  # the CPU's cache-sized steps of classes (screen.cache_step), here of 5 classes
        monkeypatch.setattr(screen, "CACHE32", 1)
        monkeypatch.setattr(screen, "FEWEST", steps)
    from ncanalyze.analyzer.accumulate import FoldStats, WithoutFold
    rng = np.random.default_rng(5)
    F, V, d = 4, 48, 16
    common = rng.normal(size=d) * 20
    fold_mean = common + rng.normal(size=(F, V, d))
    count = rng.integers(0, 4, (F, V))
    count[:, 0] = [0, 0, 0, 0]  # never seen
    count[:, 2] = [5, 0, 0, 0]  # fold 0 alone: not kept without it
    move, still = [10, 30, 31, 7], [11, 20, 21, 5, 6, 8]  # classes fold 0 holds (moved), and does not (still)
    count[:, move] = [[3], [3], [0], [0]]
    count[:, still] = [[0], [3], [3], [0]]
    fold_mean[2, still] = fold_mean[1, still]  # a still class's mean is its folds' common one
    for a, b in [(10, 11), (20, 21), (30, 31)]:  # pairs close without fold 0 (a moved class: its fold-1 mean)
        fold_mean[1:3, b] = fold_mean[1, a] + 0.05 * rng.normal(size=d)
    fold_mean[:, [7, 8]] = np.round(fold_mean[:, [7, 8]] * 4) / 4  # dyadic: 7's mean without fold 0 is exact
    fold_mean[1:3, 6], fold_mean[1, 7] = fold_mean[1, 5], fold_mean[1, 8]  # exact ties: 5 = 6 (still), 7 = 8
    fs = FoldStats(F, V, d, scatter=False)
    fs.count[:] = torch.from_numpy(count)
    fs.mean[:] = torch.from_numpy(fold_mean)
    n = count.sum(0)
    mean = torch.from_numpy(np.where(n[:, None] > 0, (count[..., None] * fold_mean).sum(0) / np.maximum(n, 1)[:, None],
                                     0.0))
    mean[still] = torch.from_numpy(fold_mean[1, still])  # exactly their fold means
    kept = torch.nonzero(torch.from_numpy(n) >= 1).squeeze(1)
    main = Screen(mean, [kept], budget=budget, hold=hold)
    without = WithoutFold(fs, main, 0, 1, budget, hold)
    rows = without.rows[torch.arange(V)].numpy()
    h = np.concatenate([rows[[5, 6, 7, 8]], np.stack(near_pairs(rows, [(10, 11), (20, 21), (30, 31)],
                                                                np.linalg.norm(rows[without.kept], axis=1).max() ** 2)),
                        common + rng.normal(size=(300, d)) * 1.5])
    _, top, cls, e = main.argmax(torch.from_numpy(h), WithoutFold.FIRST)
    got = without.argmax(torch.from_numpy(h), top, cls, e).numpy()
    np.testing.assert_array_equal(got, brute(h, rows, without.kept.numpy()))
    assert got[:4].tolist() == [5, 5, 7, 7] and 2 not in got and 2 not in without.kept.tolist()
    assert got[4:16].tolist() == [b if i % 2 == 0 else a for a, b in [(10, 11), (20, 21), (30, 31)] for i in range(4)]
    assert without.rechecked >= 4 + 6 and without.decided > 250  # the ties and the 1e-9 near-ties at least


@pytest.mark.parametrize("k", [1, 3, 16, 60])
@pytest.mark.parametrize("tile", [7, 60])
def test_leaders_decide_each_set_as_a_brute_force_argmax_or_leave_the_row_open(k, tile):
    """Scores of few distinct values (ties everywhere, across the list's end), tiles merged: for every class set
    (sparse, dense, whole, empty) each row the list decides gets the first class of the set's largest score, as
    numpy's argmax over the set's columns; every other row is left open (NONE), and both kinds occur."""
    from ncanalyze.analyzer.screen import NONE, Leaders

    rng = np.random.default_rng(k * 100 + tile)
    n, V = 300, 60
    scores = torch.from_numpy(rng.integers(0, 40, (n, V)).astype(np.float64))
    scores[:5] = 1.0  # rows all tied
    scores[5:10, :20] = 50.0  # a tie of 20 at the top
    lead = None
    for s in range(0, V, tile):
        part = Leaders.of(scores[:, s:s + tile], torch.arange(s, min(V, s + tile)), k)
        lead = part if lead is None else part.merge(lead, k)  # either order
    assert lead.complete == (k >= V)
    opened = decided = 0
    for density in (0.05, 0.5, 1.0, 0.0):
        member = torch.from_numpy(rng.random(V) < density)
        pick, sure = lead.first(member if density < 1 else None)
        cols = np.flatnonzero(member.numpy()) if density < 1 else np.arange(V)
        if len(cols):
            want = cols[scores.numpy()[:, cols].argmax(1)]
            np.testing.assert_array_equal(pick.numpy()[sure.numpy()], want[sure.numpy()])
        else:
            assert not sure.any()
        assert (pick[~sure] == NONE).all()
        opened, decided = opened + int((~sure).sum()) * bool(len(cols)), decided + int(sure.sum())
    assert (decided > 0) == (k > 1) and (opened > 0) == (k < V)  # one score alone never shows its set's is first


@pytest.mark.parametrize("budget, steps", [(1 << 25, None), (7 * 16, None), (1 << 25, 5)],
                         ids=["one-tile", "tiles-of-7", "cache-steps-of-5"])
def test_the_linear_screens_leaders_decide_as_a_float64_brute_force_on_near_ties_beyond_the_list(budget, steps,
                                                                                                  monkeypatch):
    """A head with a group of 30 rows 1e-9 apart (near-ties float32 cannot order, more than the LEADERS list holds),
    a group of 20 exact duplicates and random rows, a bias, tokens at two scales: every row the float32 screen's
    leaders decide gets, at every class set, the first class of the set's largest float64 logit (numpy's argmax over
    the set's columns); the screen's float32 scores are within its bound E of the float64 ones; rows whose best is a
    random row are decided, and some rows are left open (the floor: a tie group larger than the list)."""
    if steps:  # the CPU's cache-sized steps of classes (screen.cache_step), here of 5 classes
        monkeypatch.setattr(screen, "CACHE32", 1)
        monkeypatch.setattr(screen, "FEWEST", steps)
    from ncanalyze.analyzer.screen import LEADERS, LinearScreen

    rng = np.random.default_rng(3)
    V, d, n = 120, 16, 400
    W = rng.normal(size=(V, d))
    W[:30] = W[0] + rng.normal(size=(30, d)) * 1e-9
    W[30:50] = W[30]
    W[:50] *= 3  # the groups often hold the best logit
    b = rng.normal(size=V) * 0.1
    b[:30], b[30:50] = b[0], b[30]
    Z = rng.normal(size=(n, d)) * np.where(np.arange(n) % 2, 1.0, 1e3)[:, None]
    Wt, bt, Zt = (torch.from_numpy(a) for a in (W, b, Z))
    cls = torch.from_numpy(np.sort(rng.choice(V, 100, replace=False)))
    cls = torch.unique(torch.cat([cls, torch.arange(50)]))
    lin = LinearScreen(Wt, bt, cls, budget)
    lead = lin.leaders(Zt)
    logits = Z @ W.T + b
    np.testing.assert_allclose(lead.vals.numpy(), np.take_along_axis(logits, lead.cls.numpy(), 1), rtol=1e-13)
    s32 = (Zt.float() @ Wt.float().T + bt.float()).double().numpy()
    e = lin.bound(Zt).numpy()[:, None]
    assert lin.coef == pytest.approx((1.02 * d + 4) * 2.0 ** -24)
    np.testing.assert_allclose(e[:, 0], lin.coef * (np.linalg.norm(Z, axis=1) * np.linalg.norm(W[cls], axis=1).max()
                                                    + np.abs(b[cls]).max()), rtol=1e-12)
    assert (np.abs(s32[:, cls] - logits[:, cls]) <= e).all()
    assert len(lead.vals[0]) == LEADERS
    best = cls.numpy()[logits[:, cls].argmax(1)]
    clear = best >= 50  # a random row's best: the float32 screen separates it
    assert 20 < clear.sum() < n and bool(lead.first(None)[1][torch.from_numpy(clear)].float().mean() > 0.95)
    opened = decided = 0
    for density in (1.0, 0.5, 0.1):
        member = torch.zeros(V, dtype=torch.bool)
        member[cls[torch.from_numpy(rng.random(len(cls)) < density)]] = True
        pick, sure = lead.first(member)
        cols = np.flatnonzero(member.numpy())
        want = cols[logits[:, cols].argmax(1)]
        np.testing.assert_array_equal(pick.numpy()[sure.numpy()], want[sure.numpy()])
        opened, decided = opened + int((~sure).sum()), decided + int(sure.sum())
    assert opened > 0 and decided > 0
