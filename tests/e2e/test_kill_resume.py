"""Kill-and-resume identity (a real SIGKILL in each pass), the config guards of a resume and of a re-run, and a
real full disk: a clean error, then a resume."""
from __future__ import annotations

import os

import ncanalyze.store
import numpy as np
import pytest
from conftest import assert_same_group, kill_when, run_cli, tmpfs


def _state(store):
    return store.with_name(store.name + ".partial")


@pytest.mark.slow
def test_kill_and_resume_is_bit_identical(trained_run, corpus, tmp_path):
    ck = trained_run / "checkpoint-40"
    args = ["extract", ck, "--dataset", corpus["train"], "--max-train-tokens", 2048, "--max-val-tokens", 2048,
            "--batch-size", 1, "--state-every", 0]
    ref = tmp_path / "ref.zarr"
    run_cli(*args[:-2], "--store", ref)  # no state saved at every batch: a run control, not recorded

    store = tmp_path / "killed.zarr"
    for phase in (0, 1):  # kill once in the train pass and once in the validation pass
        state = _state(store) / trained_run.name / "checkpoint-40.npz"
        kill_when([*args, "--store", store], state, at={"phase": phase})
        with np.load(state) as s:
            assert int(s["phase"]) == phase
        # the killed store still opens, and holds no half-finished group
        tree = ncanalyze.store.open(store)
        assert f"{trained_run.name}/checkpoint-40" not in tree.to_dict()

    # a resume under another configuration is refused, and loses nothing
    r = run_cli(*args[:-4], "--batch-size", 4, "--state-every", 0, "--store", store, ok=False)
    assert "another configuration" in r.output and "batch_size: 1 -> 4" in r.output and "--overwrite" in r.output
    r = run_cli(*args, "--store", store)
    assert "1 resumed" in r.output
    assert_same_group(ref, store, f"{trained_run.name}/checkpoint-40")
    assert not _state(store).exists()

    # finished: a re-run is a no-op, another config is refused unless --overwrite
    r = run_cli(*args, "--store", store)
    assert "1 already in" in r.output
    r = run_cli(*args[:-4], "--batch-size", 4, "--store", store, ok=False)
    assert "already in" in r.output and "--overwrite" in r.output
    assert_same_group(ref, store, f"{trained_run.name}/checkpoint-40")


@pytest.mark.slow
def test_full_disk_is_a_clean_error_and_resumes(trained_run, corpus, tmp_path):
    with tmpfs(tmp_path / "disk", "size=4m") as disk:
        store = disk / "s.zarr"
        opts = ["--dataset", corpus["train"], "--store", store, "--max-train-tokens", 1024, "--max-val-tokens", 512,
                "--samples-per-class", 1]
        run_cli("extract", trained_run / "checkpoint-20", *opts)
        before = ncanalyze.store.open(store).to_dict()
        free = os.statvfs(disk)
        (disk / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 16384))
        r = run_cli("extract", trained_run, *opts, ok=False)
        assert "disk full" in r.output and "resume" in r.output
        tree = ncanalyze.store.open(store)
        g = f"{trained_run.name}/checkpoint-20"
        assert tree[g].to_dataset().identical(before[f"/{g}"])
        (disk / "filler").unlink()
        r = run_cli("extract", trained_run, *opts)
        assert sorted(ncanalyze.store.open(store)[trained_run.name].children) == [
            "checkpoint-20", "checkpoint-40", "checkpoint-60"]
