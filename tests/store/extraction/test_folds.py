"""Fold sums at extraction: the totals bit for bit those of --folds 1, the folds adding up to them, F fitted to the
memory budget and recorded."""
from __future__ import annotations


import ncanalyze.store
import numpy as np
import pytest
import torch
from conftest import run_cli

from ncanalyze.store.extraction.memory import fit_folds, fold_bytes, leave_out_bytes, state_bytes

CPU = torch.device("cpu")


def test_fit_folds_keeps_what_the_budget_holds_and_says_so(caplog):
    per_layer, shared = state_bytes(1000, 64, 4, CPU)
    each = fold_bytes(1000, 64) + leave_out_bytes(1000, 64, CPU)  # and NC4's screen of the means without the fold
    room = lambda k: shared + 2 * per_layer + k * 2 * each  # noqa: E731
    assert fit_folds(8, 1000, 64, 4, 2, CPU, budget=room(8)) == 8
    assert fit_folds(1, 1000, 64, 4, 2, CPU, budget=0) == 1
    from conftest import listening

    with listening(caplog, "ncanalyze.store.extraction.memory", "WARNING"):
        assert fit_folds(8, 1000, 64, 4, 2, CPU, budget=room(5) + 1) == 5
        assert "--folds 8" in caplog.text and "keeping 5 folds" in caplog.text
        assert fit_folds(8, 1000, 64, 4, 2, CPU, budget=room(1)) == 1
    assert "no folds: no jackknife errors" in caplog.text


@pytest.mark.slow
def test_folds_leave_every_total_bit_for_bit_and_add_up_to_it(trained_run, corpus, tmp_path):
    ck, g = trained_run / "checkpoint-20", f"{trained_run.name}/checkpoint-20"
    opts = ("--dataset", corpus["train"], "--max-train-tokens", 2048, "--max-val-tokens", 1024, "--layers", "all")
    run_cli("extract", ck, *opts, "--folds", 1, "--store", tmp_path / "one.zarr")
    run_cli("extract", ck, *opts, "--folds", 4, "--store", tmp_path / "four.zarr")
    one, four = (ncanalyze.store.open(tmp_path / s) for s in ("one.zarr", "four.zarr"))
    for group in (g, f"{g}/layers/0", f"{g}/layers/1"):
        a, b = one[group].to_dataset(), four[group].to_dataset()
        assert not [v for v in a.variables if v.startswith("fold_")] and (a.attrs["folds"], b.attrs["folds"]) == (1, 4)
        for name in a.variables:  # every total, bit for bit
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=f"{group} {name}")
        assert b.sizes["fold"] == 4
        for name in ("count", "val_count", "val_correct", "val_ncc_agree"):
            np.testing.assert_array_equal(b[f"fold_{name}"].values.sum(0), b[name].values, err_msg=name)
        np.testing.assert_allclose(b["fold_unit_sum"].values.sum(0), b["unit_sum"].values, rtol=1e-12)
        n = b["fold_count"].values.sum(1)
        assert (n > 0).all() and n.max() - n.min() <= 31 * 8  # whole blocks dealt in turn: within a batch or so


def test_a_resume_keeps_the_saved_folds_and_refuses_fold_sums_that_miss_the_totals(tmp_path):
    from ncanalyze.analyzer.errors import CheckpointError
    from ncanalyze.store.extraction.layers import plan
    from ncanalyze.store.extraction.running import Extraction

    saved = Extraction(plan(), 10, 3, 1, 0, "cpu", tmp_path / "a", folds=4)
    saved.start()
    state = saved.state({})
    assert [k for k in state if k.endswith("folds.count")] and state[next(
        k for k in state if k.endswith("folds.count"))].shape == (4, 10)
    resumed = Extraction(plan(), 10, 3, 1, 0, "cpu", tmp_path / "b", folds=8)  # the memory now holds 8
    resumed.load(state, 64, "state.npz")
    assert resumed.n_folds == 4 and resumed.main().folds.count.shape == (4, 10)
    key = next(k for k in state if k.endswith("folds.count"))
    state[key] = state[key].copy()
    state[key][0, 0] += 1  # a fold count the totals do not have
    with pytest.raises(CheckpointError, match="inconsistent"):
        Extraction(plan(), 10, 3, 1, 0, "cpu", tmp_path / "c", folds=4).load(state, 64, "state.npz")
    one = Extraction(plan(), 10, 3, 1, 0, "cpu", tmp_path / "d", folds=1)
    one.start()
    assert not [k for k in one.state({}) if ".folds." in k]  # --folds 1: the state of before
