"""The delete-one-fold jackknife: against an independent brute force (class_stats of each leave-one-fold-out subset of
the raw features, the metrics written out in test_metrics), against the spread over independent samples of planted
Gaussians, the fold sums against the totals, and the nan cases."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from test_metrics import brute_force, brute_nc4, random_study

from ncanalyze.analyzer import SCALARS, class_stats, measure
from ncanalyze.analyzer.accumulate import ClassStats, FoldStats, fold_of
from ncanalyze.analyzer.jackknife import (
    EXACT,
    EXACT_UP_TO,
    budgets,
    fold_problems,
    jackknife,
    merged,
    nested_budgets,
    unsettled,
    without,
)
from ncanalyze.analyzer.metrics import measure_all
from ncanalyze.core.errors import UserError

FOLDS, BLOCK, MIN = 4, 16, 20


def folds_of(n: int, folds: int = FOLDS, block: int = BLOCK) -> np.ndarray:
    return (np.arange(n) // block) % folds


def jackknife_se(theta: np.ndarray) -> float:
    k = len(theta)
    return math.sqrt((k - 1) / k * np.sum((theta - theta.mean()) ** 2))


@pytest.fixture(scope="module")
def folded():
    h, y, W, b, hv, yv = random_study()
    ds = class_stats(h, y, 60, classifier=W, classifier_bias=b, val_embeddings=hv, val_labels=yv, min_count=MIN,
                     folds=FOLDS, block_size=BLOCK)
    return h, y, W, b, hv, yv, ds


def test_fold_sums_are_the_folds_own_statistics_and_leave_the_totals_alone(folded):
    h, y, W, b, hv, yv, ds = folded
    plain = class_stats(h, y, 60, classifier=W, classifier_bias=b, val_embeddings=hv, val_labels=yv, min_count=MIN)
    for name in plain.variables:  # the totals bit for bit
        np.testing.assert_array_equal(ds[name].values, plain[name].values, err_msg=name)
    f = folds_of(len(y))
    for i in range(FOLDS):
        own = ClassStats(60, h.shape[1])
        own.update(torch.as_tensor(h[f == i]), torch.as_tensor(y[f == i]))
        np.testing.assert_array_equal(ds["fold_count"].values[i], own.count.numpy())
        np.testing.assert_allclose(ds["fold_mean"].values[i], own.mean.numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ds["fold_scatter"].values[i], own.scatter.numpy(), rtol=1e-10, atol=1e-10)
    fv = folds_of(len(yv))
    kept = np.flatnonzero(ds["count"].values >= MIN)
    for i in range(FOLDS):
        count, correct, agree = brute_nc4(hv[fv == i], yv[fv == i], W, b, ds["mean"].values, kept)
        np.testing.assert_array_equal(ds["fold_val_count"].values[i], count)
        np.testing.assert_array_equal(ds["fold_val_correct"].values[i], correct)
        np.testing.assert_array_equal(ds["fold_val_ncc_agree"].values[i], agree)
    for name in ("count", "val_count", "val_ncc_agree"):
        np.testing.assert_array_equal(ds[f"fold_{name}"].values.sum(0), ds[name].values)


@pytest.mark.slow
def test_jackknife_matches_a_brute_force_over_leave_one_fold_out_subsets(folded):
    """Each replicate: class_stats of the raw rows outside fold i, measured by test_metrics' brute force (its own
    kept classes); NC4 from the validation tokens outside fold i, decided with the means of the train rows outside
    fold i over its own kept classes (the means' noise in the error, issue 48). The error:
    sqrt((F - 1) / F sum (theta_i - mean)^2)."""
    h, y, W, b, hv, yv, ds = folded
    f, fv = folds_of(len(y)), folds_of(len(yv))
    theta = {}
    for i in range(FOLDS):
        sub = class_stats(h[f != i], y[f != i], 60, classifier=W, classifier_bias=b, min_count=MIN)
        want, _ = brute_force(sub, MIN)
        K = np.flatnonzero(sub["count"].values >= MIN)
        count, _, agree = brute_nc4(hv[fv != i], yv[fv != i], W, b, sub["mean"].values, K)
        want["nc4_agreement"] = agree[K].sum() / count[K].sum()
        for k, v in want.items():
            theta.setdefault(k, []).append(v)
    got = measure(ds, min_count=MIN, se=True, device="cpu")
    assert set(got) >= {f"{m}_se" for m in SCALARS}
    for k, values in theta.items():
        want = jackknife_se(np.array(values))  # nan where the metric is (unc3_cos_cv here: its mean is near 0)
        assert math.isclose(got[f"{k}_se"], want, rel_tol=1e-6, abs_tol=1e-12) or (
            math.isnan(want) and math.isnan(got[f"{k}_se"]) and math.isnan(got[k])), (k, got[f"{k}_se"], want)
    assert sum(v > 0 for k, v in got.items() if k.endswith("_se") and k[:-3] in theta) >= len(theta) - 1


def test_merging_other_folds_is_the_subset_to_rounding(folded):
    h, y, W, b, hv, yv, ds = folded
    f = folds_of(len(y))
    rest = merged(ds, [0, 2, 3])
    sub = class_stats(h[f != 1], y[f != 1], 60)
    np.testing.assert_array_equal(rest["count"].values, sub["count"].values)
    for name in ("mean", "variance", "within_covariance", "unit_sum"):
        np.testing.assert_allclose(rest[name].values, sub[name].values, rtol=1e-11, atol=1e-12, err_msg=name)


def test_without_folds_or_with_an_empty_fold_the_error_is_nan_with_a_note():
    h, y, W, b, hv, yv = random_study()
    plain = class_stats(h, y, 60, min_count=MIN)
    with pytest.warns(UserWarning, match="no folds"):
        got = measure(plain, min_count=MIN, se=True, device="cpu")
    assert all(math.isnan(got[f"{m}_se"]) for m in SCALARS)
    few = class_stats(h[:40], y[:40], 60, folds=8, block_size=16)  # 3 blocks: folds 3..7 are empty
    se, notes = jackknife(few, lambda d: measure_all(d, min_count=1, device="cpu")[0])
    assert all(math.isnan(v) for v in se.values()) and "hold no train token" in notes[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_equal(measure(plain, min_count=MIN, device="cpu", se=False), measure(  # folds change no
            class_stats(h, y, 60, min_count=MIN, folds=FOLDS, block_size=BLOCK), min_count=MIN, device="cpu",
            se=False))  # metric


def test_fold_sums_are_checked_against_the_totals(folded):
    """Issue 49: the counts must sum exactly and the folds merged must give the totals to float64 rounding; a forged
    fold mean, a doubled fold count or a count moved between classes is found, and every error is nan with a note
    naming the fix, never a changed number."""
    h, y, W, b, hv, yv, ds = folded
    measure = lambda d: measure_all(d, min_count=MIN, device="cpu")[0]  # noqa: E731
    assert fold_problems(ds) == []
    assert np.array_equal(ds["fold_count"].values.sum(0), ds["count"].values)  # the invariant, brute force
    fine, notes = jackknife(ds, measure)
    assert notes == [] or all("fold sums" not in n for n in notes)
    assert np.isfinite(fine["nc1_cdnv_se"])
    c = int(np.argmax(ds["fold_count"].values[0]))
    forged, doubled, moved, nudged = (ds.copy(deep=True) for _ in range(4))
    forged["fold_mean"].values[0, c] += 0.5
    doubled["fold_count"].values[1] *= 2
    moved["fold_count"].values[2, c] -= 1
    moved["fold_count"].values[2, c + 1] += 1  # the same total, another class's
    nudged["fold_mean"].values[0, c] *= 1 + 1e-6  # far above rounding
    for bad, why in ((forged, "differ from mean"), (doubled, "fold_count sums to"), (moved, "fold_count sums to"),
                     (nudged, "differ from mean")):
        assert any(why in p for p in fold_problems(bad)), fold_problems(bad)
        se, notes = jackknife(bad, measure)
        assert all(math.isnan(v) for v in se.values()), se
        assert "fold sums do not add up" in notes[0] and "--overwrite" in notes[0], notes


@pytest.mark.parametrize("folds, block_size, bad", [(4, 0, "block_size"), (4, -3, "block_size"),
                                                    (4, 2.5, "block_size"), (2.5, 16, "folds"),
                                                    (0, 16, "folds"), (65, 16, "folds"), (True, 16, "folds")])
def test_class_stats_refuses_a_bad_fold_setting_in_one_line(folds, block_size, bad):
    """Issue 49: block_size 0, -3 or 2.5 were accepted silently, folds=2.5 raised a TypeError."""
    h, y = np.zeros((8, 2)), np.arange(8) % 2
    with pytest.raises(UserError, match=rf"^class_stats {bad} must be a whole number from 1 to \d+, got "):
        class_stats(h, y, 2, folds=folds, block_size=block_size)


def planted(rng: np.random.Generator, n: int, centres: np.ndarray, spread: np.ndarray, p: np.ndarray):
    y = rng.choice(len(centres), size=n, p=p)
    return centres[y] + rng.standard_normal((n, centres.shape[1])) * spread[y, None], y


@pytest.mark.slow
def test_jackknife_error_is_the_spread_over_independent_samples_of_planted_gaussians():
    """Planted Gaussian classes of known means and spreads: over 30 independent samples, the mean jackknife error
    of each smooth metric is within a factor 1.6 of the metric's standard deviation across the samples."""
    rng = np.random.default_rng(7)
    V, d, n = 12, 6, 4096
    centres, spread = rng.standard_normal((V, d)) * 2, 0.5 + rng.random(V)
    p = rng.dirichlet(np.full(V, 3.0))
    names = ("nc1_cdnv", "nc2_norm_cv", "nc2_cos_std", "within_erank", "between_erank", "anisotropy")
    values, errors = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(30):
            h, y = planted(rng, n, centres, spread, p)
            got = measure(class_stats(h, y, V, folds=8, block_size=32), se=True, device="cpu")
            values.append([got[m] for m in names])
            errors.append([got[f"{m}_se"] for m in names])
    ratio = np.mean(errors, 0) / np.std(values, 0, ddof=1)
    assert ((ratio > 1 / 1.6) & (ratio < 1.6)).all(), dict(zip(names, ratio.round(2)))


def test_fold_stats_deal_whole_blocks_and_merge_fold_by_fold():
    rng = np.random.default_rng(1)
    h, y = torch.as_tensor(rng.standard_normal((96, 5))), torch.as_tensor(rng.integers(0, 7, 96))
    fold = fold_of(2, 6, 16, 4)  # blocks 2..7 of 16 tokens: folds 2, 3, 0, 1, 2, 3
    assert fold.tolist() == sum(([f] * 16 for f in (2, 3, 0, 1, 2, 3)), [])
    whole = FoldStats(4, 7, 5)
    whole.update(h, y, fold)
    a, b = FoldStats(4, 7, 5), FoldStats(4, 7, 5)
    a.update(h[:48], y[:48], fold[:48])
    b.update(h[48:], y[48:], fold[48:])
    a.merge(b)
    for k, v in whole.state_dict().items():
        np.testing.assert_allclose(a.state_dict()[k].numpy(), v.numpy(), rtol=1e-12, atol=1e-12, err_msg=k)
    with pytest.raises(ValueError, match="cannot merge"):
        a.merge(FoldStats(3, 7, 5))


def test_nested_budgets_and_the_unsettled_line(folded):
    *_, ds = folded
    assert budgets(8) == [1, 2, 4, 8] and budgets(6) == [1, 2, 4, 6] and budgets(1) == [1]
    table = nested_budgets(ds, lambda d: measure_all(d, min_count=MIN, device="cpu")[0])
    assert table["folds"].tolist() == [1, 2, 4] and table["tokens"].iloc[-1] == int(ds["count"].sum())
    point = measure(ds, min_count=MIN, device="cpu")
    for m in ("nc1_cdnv", "nc2_etf_error", "within_erank"):
        assert math.isclose(table[m].iloc[-1], point[m], rel_tol=1e-9)
    assert math.isnan(table["nc1_cdnv_se"].iloc[0]) and table["nc1_cdnv_se"].iloc[-1] > 0
    moved = table.copy()
    moved.loc[moved.index[-2], "nc1_cdnv"] = moved["nc1_cdnv"].iloc[-1] + 10 * moved["nc1_cdnv_se"].iloc[-1]
    lines = unsettled(moved, ["nc1_cdnv", "within_erank"])
    assert any(line.startswith(f"`nc1_cdnv` has not settled at {int(ds['count'].sum()):,} tokens") for line in lines)


def test_the_whole_budget_is_the_stored_measurement_where_given(folded):
    """The report passes the group's stored metrics and errors as the last budget (all folds): taken as they are,
    and equal to what measuring the merged folds again gives, to rounding; the smaller budgets are unchanged."""
    *_, ds = folded  # 4 folds: budgets 1, 2, 4
    ms = lambda d: measure_all(d, min_count=MIN, device="cpu")[0]  # noqa: E731
    computed = nested_budgets(ds, ms)
    whole = {m: float(v) for m, v in computed.iloc[-1].items()} | {"nc1_cdnv": 123.0, "nc1_cdnv_se": 4.5}
    given = nested_budgets(ds, ms, whole)
    assert given["nc1_cdnv"].iloc[-1] == 123.0 and given["nc1_cdnv_se"].iloc[-1] == 4.5
    pd.testing.assert_frame_equal(given.iloc[:-1], computed.iloc[:-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stored = measure(ds, min_count=MIN, se=True, device="cpu")  # as measure writes it into the group
    for m in ("nc1_cdnv", "nc1_cdnv_se", "within_erank", "within_erank_se"):
        assert math.isclose(computed[m].iloc[-1], stored[m], rel_tol=1e-9), m


def test_the_accessor_gives_the_same_errors(folded):
    import ncanalyze.analyzer  # noqa: F401  (registers ds.nc)

    *_, ds = folded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_equal(ds.nc.measure(min_count=MIN, se=True), measure(ds, min_count=MIN, se=True, device="auto"))


def test_nc4_at_another_min_count_has_no_error_and_says_why():
    """NC4 is measured at min_count 2 of an extraction at 5 (its decisions counted over each report min_count), but
    its fold counts are at 5 only: its error is nan with that said, never a fold-noise note or a number."""
    rng = np.random.default_rng(0)
    k, d = 8, 6
    y = rng.permutation(np.repeat(np.arange(k), [2, 3, 6, 10, 25, 30, 40, 3]))
    mu = rng.normal(0, 3, (k, d))
    h = mu[y] + rng.normal(0, 1, (y.size, d))
    yv = rng.integers(0, k, 400)
    hv = mu[yv] + rng.normal(0, 1, (400, d))
    ds = class_stats(h, y, k, classifier=mu + rng.normal(0, 0.3, (k, d)), val_embeddings=hv, val_labels=yv,
                     min_count=5, folds=4, block_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        at5, at2 = measure(ds, min_count=5, se=True), measure(ds, min_count=2, se=True)
    assert np.isfinite(at5["nc4_agreement_se"]) and np.isfinite(at2["nc4_agreement"])
    assert np.isnan(at2["nc4_agreement_se"])
    assert any("nc4_agreement: nan error at min_count 2: NC4's fold counts are those of the extraction's "
               "--min-count 5 only" in str(w.message) for w in caught)


def test_leaving_a_fold_out_downdates_the_totals_to_the_other_folds_own_statistics():
    """Issue 52: the statistics without fold i come from the totals less fold i (not F - 1 merges): equal to
    class_stats of the raw rows outside fold i to 1e-12, a class whose tokens all lie in fold i empty (variance nan),
    one left with a single token of variance 0; the validation counts less fold i's exactly."""
    h, y, W, b, hv, yv = random_study(seed=3)
    f = folds_of(len(y))
    y = y.copy()
    only = np.flatnonzero(f == 2)[:3]
    y[only] = 60                                    # class 60: three tokens, all in fold 2
    pair = [np.flatnonzero(f == 2)[5], np.flatnonzero(f == 0)[0]]
    y[pair] = 61                                    # class 61: one token in fold 2, one in fold 0
    ds = class_stats(h, y, 62, classifier=np.r_[W, W[:2]], val_embeddings=hv, val_labels=yv, folds=FOLDS,
                     block_size=BLOCK)
    fv = folds_of(len(yv))
    for i in range(FOLDS):
        got, want = without(ds, i), class_stats(h[f != i], y[f != i], 62)
        np.testing.assert_array_equal(got["count"].values, want["count"].values)
        for name in ("mean", "variance", "within_covariance", "unit_sum"):
            np.testing.assert_allclose(got[name].values, want[name].values, rtol=1e-12, atol=1e-12, err_msg=name)
        np.testing.assert_array_equal(got["val_count"].values, np.bincount(yv[fv != i], minlength=62))
    assert np.isnan(without(ds, 2)["variance"].values[60]) and without(ds, 2)["count"].values[60] == 0
    assert without(ds, 2)["variance"].values[61] == 0.0 and without(ds, 1)["variance"].values[61] > 0


def test_replicates_over_the_counted_classes_alone_measure_what_the_whole_vocabulary_does():
    """Issue 52: the sampled jackknife measures each leave-one-fold-out set over the classes with a train token alone
    (counted_only: the rows a replicate can keep), fold_mean read in place; every metric of every such set equals the
    one measured over the whole vocabulary to 1e-12, the debiased metrics' class set included, though most of the
    split's labels are on classes outside the sample (its share is of the whole split's count, not the cut's)."""
    from ncanalyze.analyzer.jackknife import counted_only

    h, y, W, b, hv, yv = random_study(seed=5)
    ds = class_stats(h, y, 64, classifier=np.r_[W, W[:4]], val_embeddings=hv, val_labels=yv, folds=FOLDS,
                     block_size=BLOCK)
    count = ds["count"].values
    split = count * 10
    split[60:] = 10**5                               # classes 60-63: no train token, most of the split's labels
    ds["split_count"] = ("vocab", split)
    K = np.flatnonzero(count >= 1)
    cut, K_cut, counted = counted_only(ds, K)
    assert np.array_equal(counted[K_cut], K) and cut.sizes["vocab"] == K.size < 64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(FOLDS):
            got = measure_all(without(cut, i, counted), min_count=1, device="cpu")[0]
            want = measure_all(without(ds, i), min_count=1, device="cpu")[0]
            assert 2 <= want["n_classes_debiased"] < want["n_classes"]      # the whole split's share decides
            assert got.keys() == want.keys()
            for m in set(want) - {"head_erank"}:  # the replicates' head is the point's W^T W (the test below)
                assert got[m] == pytest.approx(want[m], rel=1e-12, abs=1e-15, nan_ok=True), (i, m)


def many_classes(seed: int = 0, V: int = 6000, d: int = 8, N: int = 90_000):
    """A study with more kept classes than EXACT_UP_TO (so the errors sample the pairs): Zipf-like frequencies,
    Gaussian classes of their own spreads in a few dimensions (large cosines: the logs' controls are far from exact),
    a classifier and validation tokens; 8 folds of 16-token blocks."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, V + 1) ** -0.7
    p /= p.sum()
    y = rng.choice(V, size=N, p=p)
    centres, spread = rng.standard_normal((V, d)), 0.3 + rng.random(V)
    h = centres[y] + rng.standard_normal((N, d)) * spread[y, None]
    yv = rng.choice(V, size=4000, p=p)
    hv = centres[yv] + rng.standard_normal((4000, d))
    return class_stats(h, y, V, classifier=centres + rng.standard_normal((V, d)), val_embeddings=hv, val_labels=yv,
                       folds=8, block_size=16)


@pytest.mark.slow
def test_sampled_pairs_keep_the_exact_errors_and_the_pair_errors_within_their_sampling_error():
    """Issue 52: above EXACT_UP_TO kept classes the pair metrics' leave-one-fold-out sums are estimated (jackknife.py);
    the point values are unchanged, every other metric's error equals the exact jackknife's (every replicate measured
    in full, as below it) to 1e-12, and each pair metric's error is within 3 times its stated sampling error of the
    exact one (nc2_cos_std's is exact: its replicates' sums follow from d x d algebra); the method and the sampling
    errors are recorded beside the errors."""
    ds = many_classes()
    assert (ds["count"].values >= 1).sum() > EXACT_UP_TO
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = measure_all(ds, device="cpu")[0]
        got, per_class = measure_all(ds, device="cpu", se=True)
        exact, _ = jackknife(ds, lambda d: measure_all(d, device="cpu")[0], point=plain)
    assert {k: got[k] for k in plain} == plain
    sampling = per_class.attrs["se_sampling_error"]
    assert per_class.attrs["se_method"] != EXACT and "two independent samples of pairs" in per_class.attrs["se_method"]
    pair = {"nc1_cdnv", "nc1_cdnv_p2", "nc1_cdnv_freq", "nc1_cdnv_debiased", "gnc2_log_mean", "gnc2_log_std",
            "gnc2_log_mean_freq"}
    assert {k.removesuffix("_se") for k in sampling} == pair
    for m in SCALARS:
        e, want = got[f"{m}_se"], exact[f"{m}_se"]
        assert math.isfinite(e) == math.isfinite(want) or (m in pair and math.isnan(e)), m
        if m == "nc2_cos_std":  # its sum of x^2 from d x d algebra in each replicate: exact, to its rounding
            assert math.isclose(e, want, rel_tol=1e-8), (m, e, want)
        elif m in pair and math.isnan(e):  # not above its own sampling error: nan (said), never a made-up 0
            assert want <= 3 * sampling[f"{m}_se"], (m, want, sampling[f"{m}_se"])
        elif m in pair:
            assert e > sampling[f"{m}_se"] and abs(e - want) <= 3 * sampling[f"{m}_se"] + 1e-9 * want, (
                m, e, want, sampling[f"{m}_se"])
        elif math.isfinite(want):
            assert math.isclose(e, want, rel_tol=1e-12, abs_tol=1e-15), (m, e, want)
    for m in ("nc1_cdnv", "nc1_cdnv_debiased"):  # the samples resolve these well even at d = 8 (the logs: at d >= 64)
        assert sampling[f"{m}_se"] < 0.5 * exact[f"{m}_se"], (m, sampling[f"{m}_se"], exact[f"{m}_se"])


@pytest.mark.slow
def test_sampled_replicates_leave_the_head_alone_and_read_the_same_numbers_in_any_order():
    """Issue 52: where the pairs are sampled, a leave-one-fold-out set that loses classes (a rare class seen in one
    fold only) keeps the classifier: head_erank's replicates are its point value exactly, so its error is 0, not
    rounding; and the replicates measured at once on threads give the errors measured one after another."""
    from ncanalyze.analyzer.jackknife import Sampled, sample_design, sampled_jackknife
    from ncanalyze.analyzer.geometry import geometry
    from ncanalyze.analyzer.metrics import _replicate

    rng = np.random.default_rng(3)
    V, d, N = 12_000, 8, 60_000
    p = 1 / np.arange(1, V + 1)
    y = rng.choice(V, size=N, p=p / p.sum())
    centres = rng.standard_normal((V, d))
    h = centres[y] + rng.standard_normal((N, d)) * 0.5
    W = (centres + rng.standard_normal((V, d))).astype(np.float32)
    ds = class_stats(h, y, V, classifier=W, folds=8, block_size=16)
    count, folds = ds["count"].values, ds["fold_count"].values
    assert (count >= 1).sum() > EXACT_UP_TO
    assert ((folds > 0) & (folds == count)).any(1).all()           # every replicate loses some kept class
    Wd = W.astype(np.float64)                                       # brute force: the head's spectrum in float64
    s = np.linalg.svd(Wd, compute_uv=False)                         # erank weighs the singular values
    q = s / s.sum()
    want = math.exp(-np.sum(q[q > 0] * np.log(q[q > 0])))
    kw = dict(min_count=1, tile=None, device="cpu", engine=None, decay_ranks=(4, 100))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = measure_all(ds, device="cpu", se=True)[0]
        blocks = sample_design(ds, 1)
        g = geometry(ds, 1, device="cpu", sample=blocks)
        runs = [sampled_jackknife(ds, Sampled(g.K, blocks, np.array(g.pairs), g.sample_sums, np.array(g.controls),
                                              lambda r, b: _replicate(r, b, kw, g.head), workers=w))[0]
                for w in (1, 3)]
    assert math.isclose(got["head_erank"], want, rel_tol=1e-10)
    assert got["head_erank_se"] == 0.0
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))  # noqa: E731
    assert all(same(runs[0][k], runs[1][k]) for k in runs[0])
    assert all(same(runs[0][k], got[k]) for k in got if k.endswith("_se"))
