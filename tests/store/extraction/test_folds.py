"""Fold sums at extraction: the totals made from them equal to those of --folds 1 and of numpy's brute force to
float64 rounding (counts exactly), the folds adding up to them, F fitted to the memory budget and recorded."""
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


def _brute_totals(ds) -> dict[str, np.ndarray]:
    """The totals of a group's saved embeddings (every train position's features, float32 as the model gave them),
    in float64 by numpy's own two-pass sums: count, mean, variance, within-class covariance, unit-vector sum."""
    h, y = ds["embeddings"].values.astype(np.float64), ds["label"].values
    vocab = ds.sizes["vocab"]
    count = np.bincount(y, minlength=vocab)
    mean = np.zeros((vocab, h.shape[1]))
    np.add.at(mean, y, h)
    seen = count > 0
    mean[seen] /= count[seen, None]
    dev = h - mean[y]
    variance = np.full(vocab, np.nan)
    variance[seen] = np.bincount(y, (dev * dev).sum(1), minlength=vocab)[seen] / count[seen]
    unit = (h / np.linalg.norm(h, axis=1, keepdims=True)).sum(0)
    return {"count": count, "mean": mean, "variance": variance, "within_covariance": dev.T @ dev / len(y),
            "unit_sum": unit}


def _close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """``a`` equal to ``b`` to 1e-12 of each value and of the variable's largest magnitude."""
    scale = np.nanmax(np.abs(b), initial=0.0)
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * scale, equal_nan=True, err_msg=what)


@pytest.mark.slow
def test_totals_made_from_the_folds_equal_folds_1_and_brute_force(trained_run, corpus, tmp_path):
    """--folds 4 makes the totals from the fold sums (attribute totals: folds): every total equals --folds 1's (counts
    and NC4's counts exactly, the float64 statistics to 1e-12 relative) and numpy's float64 sums over every train
    position's features (saved with --save-embeddings), at every layer; the folds add up to the totals."""
    ck, g = trained_run / "checkpoint-20", f"{trained_run.name}/checkpoint-20"
    opts = ("--dataset", corpus["train"], "--max-train-tokens", 2048, "--max-val-tokens", 1024, "--layers", "all",
            "--save-embeddings", 4096)
    run_cli("extract", ck, *opts, "--folds", 1, "--store", tmp_path / "one.zarr")
    run_cli("extract", ck, *opts, "--folds", 4, "--store", tmp_path / "four.zarr")
    one, four = (ncanalyze.store.open(tmp_path / s) for s in ("one.zarr", "four.zarr"))
    for group in (g, f"{g}/layers/0", f"{g}/layers/1"):
        a, b = one[group].to_dataset(), four[group].to_dataset()
        assert not [v for v in a.variables if v.startswith("fold_")] and (a.attrs["folds"], b.attrs["folds"]) == (1, 4)
        assert (a.attrs["totals"], b.attrs["totals"]) == ("batches", "folds")
        assert len(b["label"]) == int(b["count"].sum()) == 2048 // 32 * 31  # every train position (64 blocks)
        brute = _brute_totals(b)
        for name in a.variables:
            if a[name].dtype.kind == "f":
                _close(b[name].values, a[name].values, f"{group} {name} vs --folds 1")
            else:  # counts, labels, positions, NC4's decisions: exactly
                np.testing.assert_array_equal(b[name].values, a[name].values, err_msg=f"{group} {name}")
            if name in brute:
                _close(b[name].values, brute[name], f"{group} {name} vs numpy")
        np.testing.assert_array_equal(b["count"].values, brute["count"])
        assert b.sizes["fold"] == 4
        for name in ("count", "val_count", "val_correct", "val_ncc_agree"):
            np.testing.assert_array_equal(b[f"fold_{name}"].values.sum(0), b[name].values, err_msg=name)
        np.testing.assert_allclose(b["fold_unit_sum"].values.sum(0), b["unit_sum"].values, rtol=1e-12)
        n = b["fold_count"].values.sum(1)
        assert (n > 0).all() and n.max() - n.min() <= 31 * 8  # whole blocks dealt in turn: within a batch or so


def test_a_resume_keeps_the_saved_folds_and_refuses_fold_sums_that_miss_the_totals(tmp_path):
    from ncanalyze.core.errors import CheckpointError
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


def test_a_resumed_state_makes_its_totals_from_its_folds():
    """A saved layer state with folds (this version's, or an earlier one's whose totals were accumulated batch by
    batch beside them, here totals off by 1e-9) resumes with the totals made from its fold sums: the same bits as
    the uninterrupted state's, and what the attribute totals (folds) says."""
    from ncanalyze.store.extraction.running import LayerState
    from ncanalyze.store.extraction.resume import flatten, unflatten

    rng = np.random.default_rng(0)
    live = LayerState(10, 3, 1, 0, "cpu", folds=3)
    for b in range(4):
        y = torch.from_numpy(rng.integers(0, 10, 32))
        live.update(torch.from_numpy(rng.normal(size=(32, 3))).float(), y, None, torch.arange(32) // 8 % 3)
    saved = {k: np.array(v) for k, v in flatten(live.state_dict()).items()}
    earlier = dict(saved)
    earlier["stats.mean"] = saved["stats.mean"] + 1e-9
    for state in (saved, earlier):
        resumed = LayerState(10, 3, 1, 0, "cpu", folds=3)
        resumed.load_state_dict(unflatten(state))
        assert resumed.totals == "folds"
        for name, want in live.stats.state_dict().items():
            np.testing.assert_array_equal(resumed.stats.state_dict()[name].numpy(), want.numpy(), err_msg=name)
