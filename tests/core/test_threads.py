"""The thread policy (--threads auto|N): its arithmetic on given readings, the cgroup quota and /proc/stat as the
kernel writes them, and real runs that restore the caller's thread counts."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch
from ncanalyze.analyzer.registry import MeasureSettings
from ncanalyze.core import threads
from ncanalyze.core.errors import UserError
from ncanalyze.store.extraction.settings import ExtractConfig
from threadpoolctl import threadpool_info


@pytest.mark.parametrize("allowed, others, want", [
    (2, 0.0, 2), (2, 0.49, 2), (2, 0.51, 1), (2, 1.1, 1), (2, 1.9, 1), (2, 7.5, 1),   # load above the cores: still 1
    (16, 3.2, 13), (16, 0.0, 16), (1.5, 0.0, 1), (4, 4.0, 1), (4, 3.0, 1), (8, 2.5, 6)])
def test_choose_is_the_idle_cores_rounded(allowed, others, want):
    assert threads.choose(allowed, others) == want


def test_others_busy_is_the_busy_time_less_our_own():
    before = threads.Reading(at=100.0, busy=500.0, own=10.0)
    after = threads.Reading(at=104.0, busy=507.0, own=13.0)  # 7 CPU-s busy in 4 s, 3 of them ours
    assert threads.others_busy(before, after) == pytest.approx(1.0)
    assert threads.others_busy(after, after) == 0.0
    assert threads.others_busy(before, threads.Reading(104.0, 502.0, 13.0)) == 0.0  # never below 0


def test_busy_seconds_reads_only_the_allowed_cpus(tmp_path):
    tick = __import__("os").sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    stat.write_text("cpu  30 0 6 1000 40 0 0 0 0 0\ncpu0 10 0 2 500 20 1 1 1 0 0\n"
                    "cpu1 20 0 4 500 20 0 0 0 0 0\nintr 5 0\n")
    assert threads.busy_seconds({0}, stat) == pytest.approx(15 / tick)
    assert threads.busy_seconds({0, 1}, stat) == pytest.approx(39 / tick)
    assert threads.busy_seconds({0}, tmp_path / "none") is None


def test_quota_v2_v1_and_none(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert threads.quota(v2) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert threads.quota(v2) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.quota(tmp_path / "v1") == 3.0
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.quota(tmp_path / "v1") is None
    assert threads.quota(tmp_path / "nothing") is None


def test_allowed_cores_take_the_least_of_affinity_quota_and_omp():
    assert threads.allowed_cores({0, 1, 2, 3}) == 4
    assert threads.allowed_cores({0, 1, 2, 3}, 1.5) == 1.5
    assert threads.allowed_cores({0, 1}, 8.0) == 2
    assert threads.allowed_cores({0, 1, 2, 3}, None, 3) == 3
    assert threads.omp_cap({"OMP_NUM_THREADS": "3"}) == 3
    assert threads.omp_cap({"OMP_NUM_THREADS": "x"}) is None and threads.omp_cap({}) is None


@pytest.mark.parametrize("value", [0, -1, "0", "two", 1.5, True])
def test_a_bad_setting_is_one_line_in_every_registry(value):
    with pytest.raises(UserError, match=r"threads \(--threads\) must be auto or an integer from 1 to 1024"):
        ExtractConfig(dataset="x", threads=value)
    with pytest.raises(UserError, match=r"threads \(--threads\) must be auto or an integer from 1 to 1024"):
        MeasureSettings(threads=value)
    assert ExtractConfig(dataset="x", threads="3").threads == 3
    assert MeasureSettings(threads="AUTO").threads == "auto"


def _blas() -> list[int]:
    return [p["num_threads"] for p in threadpool_info()]


def test_a_fixed_setting_is_used_and_everything_restored():
    torch.set_num_threads(2)
    blas = _blas()
    try:
        with pytest.raises(RuntimeError):
            with threads.policy(1) as p:
                assert torch.get_num_threads() == 1 and p.threads == 1
                assert all(n == 1 for n in _blas())
                assert p.describe() == "1 thread (--threads 1)"
                raise RuntimeError("a measurement that fails")
        assert torch.get_num_threads() == 2 and _blas() == blas  # the caller's, even after an error
    finally:
        torch.set_num_threads(1)


def _spin(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        pass


@pytest.mark.skipif(len(threads.affinity()) < 2, reason="one CPU: auto has nothing to choose")
def test_auto_measures_a_real_load_and_again_between_batches(monkeypatch):
    """A spinning process (ours, bounded) is other work: auto counts at least half a core busy, chooses by its rule
    within the allowed cores, and measures again once its interval has passed."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite's cap of 1 would leave nothing to choose
    monkeypatch.setattr(threads, "_kept", {})  # no earlier reading: the policy samples the load as it starts
    proc = mp.get_context("spawn").Process(target=_spin, args=(3.0,), daemon=True)
    proc.start()
    try:
        time.sleep(0.5)
        with threads.policy("auto", interval=0.2) as p:
            assert p.others is not None and p.others >= 0.4
            assert p.threads == threads.choose(p.allowed, p.others) == torch.get_num_threads()
            first = p.last
            _spin(0.3)
            threads.tick()
            assert p.last is not first and p.threads == threads.choose(p.allowed, p.others)
            assert "busy with other work" in p.describe()
    finally:
        proc.terminate()
        proc.join(5)
    threads.tick()  # outside a policy: nothing
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with threads.policy("auto") as p:  # one core allowed: 1 thread, no reading to take
        assert (p.threads, p.last, p.describe()) == (1, None, "1 thread (auto: 1 core allowed)")


@pytest.mark.skipif(len(threads.affinity()) < 2, reason="one CPU: auto has nothing to choose")
def test_a_policy_soon_after_a_kept_reading_measures_the_load_since_it(monkeypatch):
    """Issue 52: a policy starting within its interval of a kept reading (the last policy's end, or the training
    callback's remember() as training begins) measures the load since that reading, without waiting to sample it;
    one older than the interval is not used; every policy keeps a reading as it ends."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_kept", {})
    cpus = (os.getpid(), frozenset(threads.affinity()))
    proc = mp.get_context("spawn").Process(target=_spin, args=(3.0,), daemon=True)
    proc.start()
    try:
        time.sleep(0.3)
        threads.remember()
        kept = threads._kept[cpus]
        time.sleep(0.3)
        with threads.policy("auto", interval=2.0) as p:
            assert p.others == threads.others_busy(kept, p.last) >= 0.4  # over the 0.3 s since the kept reading
        assert threads._kept[cpus].at >= p.last.at  # kept as it ended
        stale = threads.Reading(threads._kept[cpus].at - 3.0, kept.busy, kept.own)
        threads._kept[cpus] = stale
        with threads.policy("auto", interval=2.0) as p:
            assert p.others != threads.others_busy(stale, p.last)  # older than the interval: sampled afresh
    finally:
        proc.terminate()
        proc.join(5)


def _policy_in_a_child(kept: threads.Reading, out) -> None:
    mine = threads._kept.get((os.getpid(), frozenset(threads.affinity())))  # taken as it was forked
    time.sleep(0.15)
    with threads.policy("auto", interval=2.0) as p:
        out.put((p.others == threads.others_busy(kept, p.last),
                 mine is not None and p.others == threads.others_busy(mine, p.last)))


@pytest.mark.skipif(len(threads.affinity()) < 2, reason="one CPU: auto has nothing to choose")
def test_a_forked_child_never_measures_from_its_parents_reading(monkeypatch):
    """A forked child's own CPU time starts from 0: its parent's kept reading would count the parent's own seconds
    as other processes' load, so the child measures from the reading it took as it was forked."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_kept", {})
    threads.remember()
    kept = threads._kept[os.getpid(), frozenset(threads.affinity())]
    _spin(0.3)  # the parent's own seconds since its reading
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_policy_in_a_child, args=(kept, out))
    child.start()
    used = out.get(timeout=30)
    child.join(10)
    assert used == (False, True)


FRESH = """
import os, time
from ncanalyze.core import threads
mine = threads._kept[os.getpid(), frozenset(threads.affinity())]
time.sleep(0.15)
with threads.policy("auto", interval=2.0) as p:
    print(p.others == threads.others_busy(mine, p.last))
"""


@pytest.mark.skipif(len(threads.affinity()) < 2, reason="one CPU: auto has nothing to choose")
def test_a_new_processs_first_policy_measures_the_load_since_it_started():
    """Issue 52: a process keeps a reading as it imports the policy, so its first policy (a command's extract or
    measure, the 0.15 s before it here) measures the load since then instead of waiting to sample it."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout
    assert out.strip() == "True", out


@pytest.mark.slow
@pytest.mark.skipif(len(threads.affinity()) < 2, reason="one CPU: nothing to choose")
def test_outside_a_policy_the_threads_available_follow_the_load_measured_between_calls(monkeypatch):
    """Issue 52: a parallel step outside any policy (the metrics' dask tasks, measure() called as a library) runs
    auto's rule over the load measured since the previous call: the cores allowed at the first call (no time spent
    sampling), fewer once a spinning process holds a core, the same count again within GAP seconds."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_seen", [])
    allowed = threads.allowed_cores(None, threads.quota(), threads.omp_cap())
    assert threads.available() == int(allowed)
    proc = mp.get_context("spawn").Process(target=_spin, args=(3.0,), daemon=True)
    proc.start()
    try:
        time.sleep(1.0)
        threads._seen[0] = threads.read(threads.affinity())           # the reading taken with the spinner running
        time.sleep(threads.GAP + 0.2)
        busy = threads.available()
        assert 1 <= busy <= max(1, int(allowed - 0.4))                 # at least ~0.9 of a core busy elsewhere
        assert threads.available() == busy                             # within GAP: not measured again
    finally:
        proc.terminate()
        proc.join(5)


@pytest.mark.parametrize("command", ["measure", "extract"])
def test_the_commands_take_the_flag_and_refuse_a_bad_value_in_one_line(command, tmp_path):
    from conftest import run_cli

    args = ["extract", tmp_path, "--dataset", tmp_path / "x.npy"] if command == "extract" else ["measure", tmp_path]
    out = run_cli(*args, "--threads", "0", ok=False).output
    assert "threads (--threads) must be auto or an integer from 1 to 1024, got '0'" in out, out
    assert "--threads auto|N" in run_cli(command, "--help").output
