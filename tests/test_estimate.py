"""The up-front estimate: its arithmetic on planted costs, the work left read from real resume states, the kept
classes and the disk size against brute force and a real group, and the line a real run prints. How close it comes
to the actual time is a benchmark (benchmarks/estimate.py), not a timed test."""
from __future__ import annotations

import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import EXTRACT_OPTS, run_cli, tmpfs
from ncanalyze.store import io
from ncanalyze.store.data import open_blocks
from ncanalyze.store.estimate import START, Arch, Costs, estimate, group_bytes, kept_classes, progress
from ncanalyze.store.layers import plan
from ncanalyze.store.running import Extraction
from ncanalyze.store.resume import Phase, save_state

# planted: forward 1 s, a layer's statistics 2 s, a layer's decisions 3 s, the loss 5 s, load 7 s, 1 byte/s
COSTS = Costs(load=7.0, forward=1.0, train=2.0, decide=3.0, loss=5.0, write_rate=1.0)


@pytest.mark.parametrize("at, passes, want", [
    (START, [1], 10 * (1 + 2) + 4 * (1 + 3 + 5)),                     # 66: the default extraction from the start
    ((0, Phase.TRAIN, 4), [1], 6 * 3 + 4 * 9),                       # 4 train batches done
    ((0, Phase.VALIDATION, 1), [1], 3 * 9),                          # in the validation pass
    ((0, Phase.DONE, 0), [1], 0),                                    # only the write is left
    (START, [2, 2, 1], 2 * (10 * (1 + 4) + 4 * (1 + 6)) + 10 * 3 + 4 * 9),  # 5 layers in 3 passes, loss in the last
    ((1, Phase.VALIDATION, 2), [2, 2, 1], 2 * (1 + 6) + 10 * 3 + 4 * 9),
    ((2, Phase.TRAIN, 10), [2, 2, 1], 4 * 9),
])
def test_seconds_left_of_planted_costs(at, passes, want):
    assert COSTS.left(at, passes, n_train=10, n_val=4) == want


def test_estimate_line_adds_load_passes_and_write_for_every_checkpoint(tmp_path):
    tokens = np.arange(40 * 16) % 50
    np.save(tmp_path / "t.npy", tokens)
    train = open_blocks(str(tmp_path / "t.npy"), "train", 16, None, "text", None)  # 40 blocks: 10 batches of 4
    val = open_blocks(str(tmp_path / "t.npy"), "train", 16, 16 * 16, "text", None)  # 16 blocks: 4 batches
    disk = group_bytes(50, 8, 2)
    at = [START, (0, Phase.VALIDATION, 1), START]
    line = estimate([Arch("a", COSTS, train, val, 50, 8, at=at)], 4, 2, tmp_path / "s.zarr")
    want = 3 * (7 + disk) + 66 + 27 + 66
    took = re.search(r"~([\d.,]+) (s|min|h) in all", line)
    assert float(took[1].replace(",", "")) * {"s": 1, "min": 60, "h": 3600}[took[2]] == pytest.approx(want, rel=0.05)
    assert line.startswith("3 checkpoint(s) to do (1 partly done) x 640 train tokens + 256 val tokens")
    assert "train pass 30.0 s, validation 36.0 s" in line
    unknown = estimate([Arch("a", None, train, val, 50, 8, at=[START])], 4, 2, tmp_path / "s.zarr")
    assert "unknown" in unknown and "in all" not in unknown


def test_progress_of_real_resume_states(tmp_path):
    ex = Extraction(plan(), 20, 4, 2, 0, torch.device("cpu"))
    ex.next_phase(Phase.VALIDATION)
    ex.batches = 3
    save_state(tmp_path / "a.npz", ex.state({"x": 1}))
    assert progress(tmp_path / "a.npz") == (0, Phase.VALIDATION, 3)
    save_state(tmp_path / "layered.npz", {"pass": np.array(2), "phase": np.array(0), "batches": np.array(5)})
    assert progress(tmp_path / "layered.npz") == (2, Phase.TRAIN, 5)
    (tmp_path / "garbage.npz").write_bytes(b"not a zip")
    assert progress(tmp_path / "garbage.npz") == START == progress(tmp_path / "missing.npz")


@pytest.mark.parametrize("min_count", [1, 3, 50])
def test_kept_classes_against_counting_by_hand(tmp_path, min_count):
    rng = np.random.default_rng(0)
    tokens = np.minimum(rng.zipf(1.3, 5000) - 1, 199)
    np.save(tmp_path / "t.npy", tokens)
    blocks = open_blocks(str(tmp_path / "t.npy"), "train", 32, 4000, "text", None)
    labels = Counter()
    for b in range(4000 // 32):
        labels.update(tokens[b * 32 + 1:(b + 1) * 32].tolist())  # every position of a block but the first
    want = sum(c >= min_count for c in labels.values())
    assert kept_classes(blocks, 200, min_count) == want > 0


def test_disk_size_is_a_real_groups_size(extracted_store):
    group = io.checkpoint_groups(extracted_store)[0][0]
    ds = io.read_group(extracted_store, group)
    size = group_bytes(ds.sizes["vocab"], ds.sizes["hidden"], ds.sizes["slot"])
    assert size == pytest.approx(ds.nbytes, rel=0.05)


def test_a_run_estimates_only_the_checkpoints_left(extracted_store, trained_run, corpus, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(extracted_store, store)
    groups = io.checkpoint_groups(store)[0]
    shutil.rmtree(store / groups[1])
    out = run_cli("extract", trained_run, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS).output
    (line,) = [x for x in out.splitlines() if "estimate:" in x]
    assert "1 checkpoint(s) to do x 8,192 train tokens + 4,096 val tokens" in line and " in all. " in line
    assert not list(Path(f"{store}.partial").glob("**/.write-rate-*"))  # the write timing's scratch is gone


def test_the_write_timing_on_a_full_disk_is_left_out_and_its_leftovers_are_removed(tmp_path):
    sample = np.random.default_rng(0).standard_normal((2048, 64)).astype(np.float32)  # 512 KiB, incompressible
    assert io.write_rate(sample, tmp_path / "partial") > 0
    assert not list((tmp_path / "partial").iterdir())
    old, fresh = tmp_path / "partial" / ".write-rate-killed", tmp_path / "partial" / ".write-rate-running"
    old.mkdir()
    fresh.mkdir()
    os.utime(old, (time.time() - 7200, time.time() - 7200))  # left by a run killed two hours ago
    io.write_rate(sample, tmp_path / "partial")
    assert not old.exists() and fresh.exists()  # another run's, still in use, is kept
    with tmpfs(tmp_path / "disk", "size=64k") as disk:
        assert io.write_rate(sample, disk / "partial") is None
        costs = Costs(7.0, 1.0, 2.0, 3.0, 5.0, None)
        np.save(tmp_path / "t.npy", np.arange(40 * 16) % 50)
        train = open_blocks(str(tmp_path / "t.npy"), "train", 16, None, "text", None)
        line = estimate([Arch("a", costs, train, None, 50, 8, at=[START])], 4, 2, disk / "s.zarr")
        assert "write not timed" in line and "~37 s in all" in line  # 7 + 10 x 3, no write counted
