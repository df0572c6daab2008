"""The train split's label counts (split_count): counted from the token ids the extraction draws its blocks from,
the same at every budget, cached beside the token cache; and the debiased CDNV they fix the class set of, measured
on a Trainer checkpoint at a small and a 16x larger budget."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from conftest import run_cli

import ncanalyze.store
from ncanalyze.analyzer import measure
from ncanalyze.analyzer.schema import DEBIAS_SHARE

GROUP = "neo-2x32/checkpoint-60"


@pytest.fixture(scope="module")
def budgets(trained_run, corpus, tmp_path_factory):
    """checkpoint-60 extracted at 2,048 and at 32,768 train tokens (16x), into one folder's two stores."""
    d = tmp_path_factory.mktemp("budgets")
    out = {}
    for tokens in (2048, 32768):
        store = d / f"b{tokens}.zarr"
        run_cli("extract", trained_run / "checkpoint-60", "--dataset", corpus["train"], "--store", store,
                "--max-train-tokens", tokens, "--max-val-tokens", 1024, "--samples-per-class", 1)
        out[tokens] = store
    return out


def group(store):
    return ncanalyze.store.open(store)[GROUP].to_dataset().load()


@pytest.mark.slow
def test_split_count_is_the_bincount_of_the_cached_split_at_every_budget(budgets):
    small, big = (group(budgets[t]) for t in (2048, 32768))
    caches = sorted((budgets[2048].parent / "b2048.zarr.tokens").glob("*.npy"))
    blocks = [np.load(p) for p in caches]                                           # the train and validation splits
    ids = max(blocks, key=len)                                                      # the whole train split's blocks
    want = np.bincount(ids[:, 1:].ravel(), minlength=small.sizes["vocab"])       # each block's labels
    np.testing.assert_array_equal(small["split_count"].values, want)
    np.testing.assert_array_equal(big["split_count"].values, want)
    assert small["count"].sum() < big["count"].sum() < want.sum()                   # the samples are the split's part
    assert len(list(caches[0].parent.glob("*.npy.*.counts"))) == 1                    # cached beside the token cache


@pytest.mark.slow
def test_the_debiased_class_set_is_the_splits_at_both_budgets(budgets):
    """The class set does not grow with the budget: the classes of split share >= DEBIAS_SHARE, at 2,048 tokens as
    at 16x that. (Whether the debiased CDNV holds within 10% over 16x the tokens is benchmarks/budget.py's to show:
    this corpus's toy grammar draws every noun, adjective and verb uniformly in its slot, so the features before
    'cat' and before 'dog' have one distribution, the true distance between those classes' means is 0 and the
    population CDNV is infinite; the debiased number counts such pairs as not resolved, and both numbers grow with
    the tokens.)"""
    ds = {t: group(budgets[t]) for t in budgets}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = {t: measure(d) for t, d in ds.items()}
    split = ds[2048]["split_count"].values
    want = int(np.sum((split >= DEBIAS_SHARE * split.sum()) & (ds[2048]["count"].values >= 2)))
    assert got[2048]["n_classes_debiased"] == got[32768]["n_classes_debiased"] == want
    assert all(math.isfinite(g["nc1_cdnv_debiased"]) and g["n_pairs_unresolved"] > 0 for g in got.values())
