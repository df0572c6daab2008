"""The up-front estimate: its arithmetic on planted costs (one architecture and several), the work left read from
real resume states, the kept classes and the disk size against brute force and a real group, the timing's slice and
its bound at a 50,257 vocabulary, and the one line a real run over two widths prints. How close it comes to the
actual time is a benchmark (benchmarks/estimate.py), not a timed test."""
from __future__ import annotations

import os
import re
import shutil
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import EXTRACT_OPTS, run_cli, tmpfs, train_sweep
from ncanalyze.core.sizes import bytes_text
from ncanalyze.store import io
from ncanalyze.store.data.blocks import open_blocks
from ncanalyze.store.extraction import estimate as est, progress as progress_of_run
from ncanalyze.store.extraction.estimate import (
    START,
    Arch,
    Costs,
    batch_seconds,
    count_kept_classes,
    depths,
    estimate,
    per_architecture,
    progress,
)
from ncanalyze.store.extraction.layers import plan
from ncanalyze.store.extraction.memory import group_bytes
from ncanalyze.store.extraction.resume import Phase, save_state
from ncanalyze.store.extraction.running import Extraction
from ncanalyze.store.sources.discover import Checkpoint

# planted: forward 1 s, a layer's statistics 2 s, a layer's decisions 3 s, the loss 5 s, load 7 s, 1 byte/s
COSTS = Costs(load=7.0, forward=1.0, train=2.0, decide=3.0, loss=5.0, write_rate=1.0)


@pytest.mark.parametrize("at, passes, want", [  # the last layer's validation part is the loss alone (its decisions
    # read from the loss's logits): a batch there 1 + 5, a batch of k layers below it 1 + 3k
    (START, [1], 10 * (1 + 2) + 4 * (1 + 5)),                         # 54: the default extraction from the start
    ((0, Phase.TRAIN, 4), [1], 6 * 3 + 4 * 6),                       # 4 train batches done
    ((0, Phase.VALIDATION, 1), [1], 3 * 6),                          # in the validation pass
    ((0, Phase.DONE, 0), [1], 0),                                    # only the write is left
    (START, [2, 2, 1], 2 * (10 * (1 + 4) + 4 * (1 + 6)) + 10 * 3 + 4 * 6),  # 5 layers in 3 passes, loss in the last
    ((1, Phase.VALIDATION, 2), [2, 2, 1], 2 * (1 + 6) + 10 * 3 + 4 * 6),
    ((2, Phase.TRAIN, 10), [2, 2, 1], 4 * 6),
    (START, [3], 10 * (1 + 6) + 4 * (1 + 2 * 3 + 5)),                # 3 layers in one pass: 2 below the last
])
def test_seconds_left_of_planted_costs(at, passes, want):
    assert COSTS.left(at, passes, n_train=10, n_val=4) == want


def test_passes_below_the_last_layer_cost_the_blocks_they_run():
    # 8 blocks, layers 0..8 in passes of 4: (0..3) stops before block 3, (4..7) before block 7, (8) runs them all
    fixed = plan("all", 4, 0, "float32", 8)
    assert depths(fixed) == [3 / 8, 7 / 8, 1.0]
    assert depths(plan("2", None, 0, "float32", 8)) == [1.0]  # layers 2 and 8 in one pass: the whole forward
    assert depths(plan("0,8", 1, 0, "float32", 8)) == [0.0, 1.0]  # the embedding output alone: no block runs
    # by hand, 10 train and 4 validation batches: pass 0: 10 x (3/8 + 4 x 2) + 4 x (3/8 + 4 x 3) = 133.25;
    # pass 1: 10 x (7/8 + 8) + 4 x (7/8 + 12) = 140.25; the last pass: 10 x (1 + 2) + 4 x (1 + 5) = 54
    assert COSTS.left(START, [4, 4, 1], 10, 4, depths(fixed)) == 133.25 + 140.25 + 54
    assert COSTS.left((1, Phase.VALIDATION, 2), [4, 4, 1], 10, 4, depths(fixed)) == 2 * 12.875 + 54
    assert COSTS.left(START, [4, 4, 1], 10, 4) == 2 * (10 * 9 + 4 * 13) + 54  # without depths: every forward whole


def test_estimate_line_adds_load_passes_and_write_for_every_checkpoint(tmp_path):
    tokens = np.arange(40 * 16) % 50
    np.save(tmp_path / "t.npy", tokens)
    train = open_blocks(str(tmp_path / "t.npy"), "train", 16, None, "text", None)  # 40 blocks: 10 batches of 4
    val = open_blocks(str(tmp_path / "t.npy"), "train", 16, 16 * 16, "text", None)  # 16 blocks: 4 batches
    disk = group_bytes(50, 8, 2)
    at = [START, (0, Phase.VALIDATION, 1), START]
    line = estimate([Arch("a", COSTS, train, val, 50, 8, at=at)], 4, 2, tmp_path / "s.zarr")
    want = 3 * (7 + disk) + 54 + 18 + 54  # each checkpoint's load and write, and its passes left
    took = re.search(r"~([\d.,]+) (s|min|h) in all", line)
    assert float(took[1].replace(",", "")) * {"s": 1, "min": 60, "h": 3600}[took[2]] == pytest.approx(want, rel=0.05)
    assert line.startswith("3 checkpoint(s) to do (1 partly done) x 640 train tokens + 256 val tokens")
    assert "train pass 30.0 s, validation 24.0 s" in line
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
    blocks = open_blocks(str(tmp_path / "t.npy"), "train", 32, 4000, "text", None, cap_mode="prefix")  # counted below
    labels = Counter()
    for b in range(4000 // 32):
        labels.update(tokens[b * 32 + 1:(b + 1) * 32].tolist())  # every position of a block but the first
    want = sum(c >= min_count for c in labels.values())
    assert count_kept_classes(blocks, 200, min_count) == want > 0


def test_disk_size_is_a_real_groups_size(extracted_store):
    group = io.checkpoint_groups(extracted_store)[0][0]
    ds = io.read_group(extracted_store, group)
    size = group_bytes(ds.sizes["vocab"], ds.sizes["hidden"], ds.sizes["slot"], folds=ds.attrs["folds"])
    assert size == pytest.approx(ds.nbytes, rel=0.05)


@pytest.mark.slow
def test_a_run_estimates_only_the_checkpoints_left(extracted_store, trained_run, corpus, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(extracted_store, store)
    groups = io.checkpoint_groups(store)[0]
    shutil.rmtree(store / groups[1])
    out = run_cli("extract", trained_run, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS).output
    (line,) = [x for x in out.splitlines() if "estimate:" in x]
    assert "1 checkpoint(s) to do x 8,192 train tokens + 4,096 val tokens" in line and " in all. " in line
    assert re.search(r"a snapshot, timed on one batch \(median of a few calls\) at a load average of [\d.]+ on \d+ "
                     r"core\(s\), \d+ thread\(s\): each pass's progress bar shows the run's time left at the rate "
                     r"measured on the run itself, refreshed every batch$", line), line
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


def _blocks(tmp_path):
    """Train blocks of 10 batches of 4 and validation blocks of 4 batches (block 16, 50 token ids)."""
    np.save(tmp_path / "t.npy", np.arange(40 * 16) % 50)
    return (open_blocks(str(tmp_path / "t.npy"), "train", 16, None, "text", None),
            open_blocks(str(tmp_path / "t.npy"), "train", 16, 16 * 16, "text", None))


def test_each_architecture_timed_once_and_one_total_of_planted_costs(tmp_path):
    train, val = _blocks(tmp_path)
    ckpts = {n: Checkpoint(n[0], n, tmp_path / n, tmp_path) for n in ("a1", "a2", "b1", "b2", "b3", "u1", "c1")}
    A, B, C = (("gpt_neo", 2, 8, 50, 4, None, "float32", 16), ("gpt_neo", 2, 4, 60, 2, 16, "float32", 16),
               ("gpt2", 4, 8, 50, 4, None, "float32", 16))
    keys = {"a1": A, "a2": A, "b1": B, "b2": B, "b3": B, "u1": None, "c1": C}  # u1: config unreadable -> A's
    # A: the planted COSTS with a write of 4 s; B: load 1, forward 0.5, statistics 1, decisions 2, loss 1, write 2 s
    first = Arch("", replace(COSTS, write_rate=group_bytes(50, 8, 2) / 4), train, val, 50, 8)
    b = Arch("", Costs(1.0, 0.5, 1.0, 2.0, 1.0, group_bytes(60, 4, 2) / 2), train, val, 60, 4)
    timed: list[str] = []

    def time_first(c):
        timed.append(c.name)
        return b if c.name == "b1" else None  # c1 does not load

    at = {"a2": (0, Phase.VALIDATION, 1)}
    todo = [ckpts[n] for n in ("b1", "a1", "b2", "u1", "a2", "b3", "c1")]
    archs = per_architecture(todo, A, lambda c: keys[c.name], first, time_first, lambda c: at.get(c.name, START))
    assert timed == ["b1", "c1"]  # once per other architecture, on its first checkpoint to do
    assert [a.at for a in archs] == [[START, START, (0, Phase.VALIDATION, 1)], [START] * 3, [START]]
    assert archs[0].name.startswith("gpt_neo L2 d8 V50 h4") and archs[1].name.startswith("gpt_neo L2 d4 V60 h2 ff16")
    assert "not timed: c/c1 did not load" in archs[2].name and archs[2].costs is first.costs
    line = estimate(archs[:2], 4, 2, tmp_path / "s.zarr")
    # A: 3 x (load 7 + write 4) + 54 + 54 + 18 (a2 in its validation pass) = 159;
    # B: 3 x (load 1 + write 2) + 3 x (10 x (0.5 + 1) + 4 x (0.5 + 1)) = 9 + 63 = 72; in all 231 s = 3.9 min
    assert line.startswith("6 checkpoint(s) to do (1 partly done) in 2 architectures x 640 train tokens + 256 val "
                           "tokens; ~3.9 min in all. Per checkpoint, timed on the first of each architecture: ")
    assert "V50 h4 float32 block 16 (3): load and set-up 7.0 s, train pass 30.0 s, validation 24.0 s, write 4.0 s; " in line
    assert "ff16 float32 block 16 (3): load and set-up 1.0 s, train pass 15.0 s, validation 6.0 s, write 2.0 s; " in line
    assert f"~{bytes_text(3 * (group_bytes(50, 8, 2) + group_bytes(60, 4, 2)))} (before compression)" in line


def test_a_step_is_timed_on_a_slice_and_scaled():
    calls: list[int] = []

    def step(m: int) -> None:  # planted: 1 ms a position
        calls.append(m)
        time.sleep(m * 1e-3)

    started = time.perf_counter()
    secs = est._per_rows(step, 2040, 50_257, 32, torch.device("cpu"))
    assert calls == [-(-est.CELLS // 50_257)] == [84]  # 84 positions x 50,257 classes: 4.2 M scores, timed once
    assert secs == pytest.approx(2.04, rel=0.25) and time.perf_counter() - started < 0.5
    calls.clear()
    est._per_rows(step, 20, 300, 32, torch.device("cpu"))
    assert set(calls) == {20} and len(calls) >= 4  # a cheap batch: whole, a warm-up and at least 3 timed calls
    calls.clear()
    est._per_rows(lambda m: calls.append(m), 2040, 50_257, 4096, torch.device("cpu"))
    assert set(calls) == {est.WORK // (50_257 * 4096)} == {2}  # a wide model: bounded by the work


def test_the_timing_is_bounded_at_a_gpt2_vocabulary():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(0)
    model = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=50_257, hidden_size=32, num_layers=1, num_heads=4,
                                           attention_types=[[["global"], 1]], max_position_embeddings=256)).eval()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 50_257, (8, 256)))
    started, cpu = time.perf_counter(), time.process_time()
    forward, train, decide, loss = batch_seconds(model, ids, 4, np.ones(50_257, dtype=np.int64), 1, seed=0, folds=8)
    took, cpu = time.perf_counter() - started, time.process_time() - cpu
    # a whole batch's decisions against 50,257 classes take ~4-8 s here; the old timing ran them 4 times (~12 s). The
    # bound is on the CPU time (these 2 cores are shared: the wall time follows the load)
    assert cpu < 2.0 and took < 6.0, (cpu, took)
    assert min(forward, train, decide, loss) > 0 and decide + loss > took  # the parts timed cost more than the timing


@pytest.mark.slow
def test_one_line_over_two_runs_of_different_widths(trained_run, corpus, tmp_path):
    narrow = train_sweep.train([corpus["train"]], [corpus["val"]], corpus["tokenizer"], tmp_path / "neo-2x16",
                               n_layer=2, width=16, n_head=4, block_size=32, batch_size=8, max_steps=4,
                               save_steps=2, seed=0)
    out = run_cli("extract", trained_run, narrow, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr",
                  *EXTRACT_OPTS).output
    (line,) = [x for x in out.splitlines() if "estimate:" in x]
    groups = io.checkpoint_groups(tmp_path / "s.zarr")[0]
    n, wide = len(groups), sum(g.startswith(f"{trained_run.name}/") for g in groups)
    assert f"{n} checkpoint(s) to do in 2 architectures x 8,192 train tokens + 4,096 val tokens" in line
    parts = re.findall(r"gpt_neo L2 d(\d+) V\d+ [^(]*\((\d+)\): load and set-up ([\d.]+) s, train pass ([\d.,]+) s, "
                       r"validation ([\d.,]+) s, write ([\d.]+) s", line)
    assert sorted((int(w), int(k)) for w, k, *_ in parts) == [(16, n - wide), (32, wide)], line
    assert all(float(setup) > 0 for _, _, setup, *_ in parts), line  # each architecture's own, timed on its first
    total = sum(int(k) * sum(float(x.replace(",", "")) for x in xs) for _, k, *xs in parts)
    took = re.search(r"~([\d.,]+) (s|min|h) in all", line)
    shown = float(took[1].replace(",", "")) * {"s": 1, "min": 60, "h": 3600}[took[2]]
    assert shown == pytest.approx(total, rel=0.05, abs=1.0)  # the total is the sum of each architecture's parts
    tracker = progress_of_run.last()  # the run's time left followed to its end, over both PATHS
    assert tracker.done == pytest.approx(tracker.total, rel=1e-9), (tracker.done, tracker.total)
    assert progress_of_run.current() is None  # and no further once the command ends
