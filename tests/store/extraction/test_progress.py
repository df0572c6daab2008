"""The run's time left, refreshed from the run's own rate: its arithmetic on planted predictions and a clock that
moves as a machine whose load changes, and a real run that logs it."""
from __future__ import annotations

import re
import shutil

import pytest
from conftest import EXTRACT_OPTS, run_cli
from ncanalyze.store import io
from ncanalyze.store.extraction import progress
from ncanalyze.store.extraction.layers import Plan
from ncanalyze.store.extraction.progress import Tracker, pass_depth


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Ex:  # the two things the tracker reads of a running state: which it is, and (through cost) its batch
    pass


def test_time_left_is_the_predicted_work_left_at_the_measured_rate():
    clock, ex = Clock(), Ex()
    t = Tracker(total=200.0, cost=lambda e: 10.0, fixed=lambda e: 0.0, window=30.0, clock=clock)
    assert t.left() is None and t.describe() == "run: timing"
    for _ in range(3):  # the machine is 2x slower than predicted: 20 s a batch of 10 predicted s
        clock.now += 20
        t.batch(ex)
    assert t.rate() == pytest.approx(2.0)
    assert t.left() == pytest.approx((200 - 30) * 2.0)
    assert t.history[-1] == pytest.approx((60.0, 60.0 + 340.0))
    for _ in range(8):  # the load goes: 5 s a batch; after 30 s the window holds only the new rate
        clock.now += 5
        t.batch(ex)
    assert t.rate() == pytest.approx(0.5)
    assert t.left() == pytest.approx((200 - 110) * 0.5)
    assert t.describe() == "run ~45 s left"


def test_a_checkpoints_load_and_write_count_at_its_first_batch():
    clock = Clock()
    t = Tracker(total=50.0, cost=lambda e: 5.0, fixed=lambda e: 10.0, clock=clock)
    a, b = Ex(), Ex()
    for ex in (a, a, b):
        clock.now += 1
        t.batch(ex)
    assert t.done == pytest.approx(10 + 5 + 5 + 10 + 5)
    assert t.left() == pytest.approx(max(0.0, 50 - 35) * 3 / 35)


def test_a_new_checkpoint_counts_its_load_and_write_where_it_takes_a_freed_ones_id():
    """Each checkpoint's running state is freed before the next is made, and CPython may give the next the freed one's
    id(): its load and write still count (a run's work done reached 2.5 of its 2.9 predicted seconds when they did not)."""
    clock = Clock()
    t = Tracker(total=100.0, cost=lambda e: 1.0, fixed=lambda e: 10.0, clock=clock)
    ids = set()
    for _ in range(5):
        ex = Ex()
        ids.add(id(ex))
        clock.now += 1
        t.batch(ex)
        del ex
    assert len(ids) < 5  # the planted reuse happened (else this test would test nothing)
    assert t.done == pytest.approx(5 * (10 + 1))


@pytest.mark.parametrize("passes, last, want", [(((0, 1), (2, 3), (4,)), 4, [0.25, 0.75, 1.0]),
                                                (((3, 4),), 4, [1.0]), (((0,),), 0, [1.0]),
                                                ((("attn:0", 1), ("mlp:2",), (4,)), 4, [0.25, 0.75, 1.0])])
def test_pass_depth_is_the_blocks_a_pass_runs(passes, last, want):
    """A pass stops before the block of its deepest residual site, after the block of its deepest sublayer site."""
    from ncanalyze.store.extraction.sites import Site

    passes = tuple(tuple(Site.of(s) for s in g) for g in passes)
    p = Plan(layers=tuple(l for g in passes for l in g), last=Site.of(last), per_pass=0, save_embeddings=0,
             embeddings_dtype="float32", groups=passes)
    assert [pass_depth(p, i) for i in range(len(passes))] == want


def test_a_real_run_refreshes_its_time_left(extracted_store, trained_run, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY", 0.0)
    store = tmp_path / "s.zarr"
    shutil.copytree(extracted_store, store)
    shutil.rmtree(store / io.checkpoint_groups(store)[0][1])
    out = run_cli("extract", trained_run, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS,
                  "--threads", "1").output
    left = r"estimate: ~[\d.,]+ (s|min|h) left, at the rate of the last [\d.,]+ s \([\d.,]+ s done\)"
    assert re.search(left, out), out
    assert progress.current() is None  # the run is over: followed no further
