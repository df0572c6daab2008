"""How many threads torch's CPU kernels run with (``--threads auto|N``): the one thread policy of extract, measure
and the training callback.

Why a policy: torch's CPU kernels run on an OpenMP team (libgomp) of ``torch.get_num_threads()`` threads, whose
every parallel region ends at a barrier. When another process holds a core, one thread of the team is descheduled
and the others wait for it at each barrier (spinning, then sleeping), for as long as the scheduler's time slice:
on a shared 2-core machine two threads ran 6-10x slower than one (benchmarks/threads.py measures it). So ``auto``
runs as many threads as there are cores that other processes leave idle, and never more than this process may use:

    threads = clamp(round(allowed - others), 1, floor(allowed))

with ``allowed`` the cores this process may run on (:func:`allowed_cores`: ``os.sched_getaffinity``, a cgroup CPU
quota, v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``, and ``OMP_NUM_THREADS`` where the user set it) and ``others`` the
cores other processes kept busy over the last interval (:func:`others_busy`: the busy time of the allowed CPUs in
``/proc/stat``, less this process's own CPU time). It is measured again every :data:`INTERVAL` seconds between
batches (:func:`tick`), so a load that comes or goes mid-run changes it; at its start, over the seconds since the
last policy ended, :func:`remember` or the process's start (or fork) where that is under :data:`INTERVAL` ago, else
over :data:`SAMPLE` seconds waited. An integer N is used as given (capped at nothing: the user asked); ``auto``
where ``/proc/stat`` is unreadable (not Linux) is the allowed cores. The thread count the caller had is restored when
the policy ends (:func:`policy`), so the training callback leaves training's own setting as it was. The same count
goes to the BLAS and OpenMP pools numpy and numba load (threadpoolctl), which ``measure``'s d x d work runs on, and
bounds the threads of the metrics' dask tasks (:func:`in_use`, analyzer/engine_numba.py).
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ncanalyze.core.setting import parse_threads as parse
from threadpoolctl import threadpool_limits

AUTO = "auto"
INTERVAL = 5.0   # seconds between measurements of the load (between batches)
SAMPLE = 0.1     # seconds sampled at the start where no earlier reading is recent enough
_kept: dict[tuple[int, frozenset[int]], Reading] = {}  # (pid, CPUs) -> the last reading (:func:`remember`); a
# forked child's own CPU time starts again from 0, so it never uses its parent's


def quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cgroup CPU quota in cores (v2 ``cpu.max`` "QUOTA PERIOD", v1 ``cpu/cpu.cfs_quota_us`` and
    ``cfs_period_us``); None where there is none ("max", -1) or it can't be read."""
    try:
        if (root / "cpu.max").is_file():
            q, p = (root / "cpu.max").read_text().split()[:2]
            return None if q == "max" else int(q) / int(p)
        v1 = root / "cpu"
        q, p = int((v1 / "cpu.cfs_quota_us").read_text()), int((v1 / "cpu.cfs_period_us").read_text())
        return None if q <= 0 else q / p
    except (OSError, ValueError):
        return None


def affinity() -> set[int]:
    """The CPUs this process may run on (all of ``os.cpu_count()`` where the platform can't say)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def omp_cap(environ=os.environ) -> int | None:
    """``OMP_NUM_THREADS`` where the user set it to a positive integer (``auto`` never runs more), else None."""
    value = environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) >= 1 else None


def allowed_cores(cpus: set[int] | None = None, cores_quota: float | None = None, cap: int | None = None) -> float:
    """The cores this process may use: its CPUs, less where a cgroup quota allows fewer (a quota of 1.5: 1.5) or
    ``OMP_NUM_THREADS`` (``cap``) asks for fewer."""
    n = len(affinity() if cpus is None else cpus)
    return float(min(n, cores_quota or n, cap or n))


def choose(allowed: float, others: float) -> int:
    """The thread count for ``allowed`` cores with ``others`` of them kept busy by other processes: the cores left
    idle, rounded, at least 1 and at most ``floor(allowed)``. Measured on 2 cores (benchmarks/threads.py): idle, 2
    threads beat 1 by 1.55x; with both cores busy with other work 1 beat 2 by 2-8x; with one other busy process it
    went either way (1.5-1.6x each way in two runs), and an extra thread is the side whose loss is unbounded.

    Examples
    --------
    >>> choose(2, 0.1), choose(2, 0.6), choose(2, 1.7), choose(16, 3.2), choose(1.5, 0)
    (2, 1, 1, 13, 1)
    """
    return int(max(1, min(math.floor(allowed), math.floor(allowed - others + 0.5))))


@dataclass(frozen=True)
class Reading:
    """One look at the machine: when (``time.monotonic``), the busy CPU-seconds of the allowed CPUs since boot, and
    this process's own CPU-seconds."""
    at: float
    busy: float
    own: float


def busy_seconds(cpus: set[int], stat: Path = Path("/proc/stat")) -> float | None:
    """The CPU-seconds the CPUs ``cpus`` spent busy since boot (``/proc/stat``: all but idle and iowait); None
    where it can't be read."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(x) for x in fields[:8]]
            total += sum(values) - values[3] - values[4]
    return total / tick


def read(cpus: set[int]) -> Reading | None:
    """A :class:`Reading` now (None where ``/proc/stat`` can't be read)."""
    busy = busy_seconds(cpus)
    if busy is None:
        return None
    t = os.times()
    return Reading(time.monotonic(), busy, t.user + t.system)


def others_busy(before: Reading, after: Reading) -> float:
    """The cores other processes kept busy between two readings: the busy CPU-seconds, less this process's own,
    over the seconds between (0 where no time passed)."""
    wall = after.at - before.at
    if wall <= 0:
        return 0.0
    return max(0.0, (after.busy - before.busy) - (after.own - before.own)) / wall


def _torch():
    """torch where this process has imported it, else None (a policy never imports it: measure and report on the
    CPU run without it)."""
    return sys.modules.get("torch")


class Policy:
    """The thread count of ``setting`` (:func:`parse`), set on torch and, under ``auto``, measured again every
    ``interval`` seconds (:meth:`tick`). ``threads`` the count in use, ``others`` the busy cores last measured."""

    def __init__(self, setting: int | str | None = AUTO, interval: float = INTERVAL):
        self.setting, self.interval = parse(setting), interval
        self.cpus = affinity()
        self.allowed = allowed_cores(self.cpus, quota(), omp_cap())
        self.others: float | None = None
        self.last = read(self.cpus) if self.setting == AUTO and self.allowed >= 2 else None  # one core: nothing to ask
        self.threads = self.setting if self.setting != AUTO else self._auto(first=True)
        self.limits = None
        self._set(self.threads)

    def _set(self, n: int) -> None:
        """``n`` threads for torch (where imported) and for the BLAS and OpenMP libraries numpy and numba load
        (threadpoolctl); the first change remembers what to restore."""
        if (torch := _torch()) is not None:
            torch.set_num_threads(n)
        limits = threadpool_limits(limits=n)
        self.limits = self.limits or limits

    def restore(self, before: int | None) -> None:
        """The thread counts as they were before the policy: torch's ``before`` (None: torch was not imported), the
        libraries' own."""
        if self.limits is not None:
            self.limits.restore_original_limits()
        if before is not None and (torch := _torch()) is not None:
            torch.set_num_threads(before)

    def _auto(self, first: bool = False) -> int:
        if self.last is None:
            return max(1, math.floor(self.allowed))
        if first:  # the load since a reading taken SAMPLE to INTERVAL seconds ago, else over SAMPLE seconds from now
            earlier = _kept.get((os.getpid(), frozenset(self.cpus)))
            if earlier is not None and SAMPLE <= self.last.at - earlier.at <= self.interval:
                self.last = earlier
            else:
                time.sleep(SAMPLE)
        now = read(self.cpus)
        self.others, self.last = others_busy(self.last, now), now
        return choose(self.allowed, self.others)

    def tick(self) -> int:
        """Between batches: under ``auto``, where ``interval`` seconds have passed, measure the load again and set
        the thread count it gives; the count in use."""
        if self.setting == AUTO and self.last is not None and time.monotonic() - self.last.at >= self.interval:
            n = self._auto()
            if n != self.threads:
                self.threads = n
                self._set(n)
        return self.threads

    def describe(self) -> str:
        """``2 threads (auto: 2 cores allowed, 0.1 busy with other work)`` or ``1 thread (--threads 1)``."""
        n = f"{self.threads} thread{'s' if self.threads > 1 else ''}"
        if self.setting != AUTO:
            return f"{n} (--threads {self.setting})"
        if self.allowed < 2:
            return f"{n} (auto: {self.allowed:g} core allowed)"
        busy = "load unknown" if self.others is None else f"{self.others:.1f} busy with other work"
        return f"{n} (auto: {self.allowed:g} cores allowed, {busy})"


_current: list[Policy] = []


@contextmanager
def policy(setting: int | str | None = AUTO, interval: float = INTERVAL) -> Iterator[Policy]:
    """Run the block under the thread policy ``setting``; :func:`tick` between batches re-measures it. The caller's
    thread count is restored at the end (the training callback: training's own setting stays as it was). torch is
    set where the process has imported it (extract and the callback import it first), never imported here: measure
    and report on the CPU run without it."""
    before = torch.get_num_threads() if (torch := _torch()) is not None else None
    p = Policy(setting, interval)
    _current.append(p)
    try:
        yield p
    finally:
        _current.remove(p)
        p.restore(before)
        if p.last is not None:
            remember(p.cpus)


def remember(cpus: set[int] | None = None) -> None:
    """Keep a reading of ``cpus`` (this process's) now: a policy that starts within :data:`INTERVAL` seconds
    measures the load since it instead of sampling :data:`SAMPLE` seconds (a policy keeps one as it ends; the training
    callback keeps one as training begins, so that no measurement waits)."""
    cpus = affinity() if cpus is None else cpus
    now = read(cpus)
    if now is not None:
        _kept[os.getpid(), frozenset(cpus)] = now


GAP = 0.5  # seconds between two readings of the machine outside a policy (a shorter interval says too little)
_seen: list = []  # outside a policy: the last reading and the count it gave (:func:`available`)


def available() -> int:
    """The threads a parallel step of the caller's (the metrics' dask tasks, the jackknife's replicates) may run at
    once: the innermost running :func:`policy`'s count (``--threads N``, or under ``auto`` the cores other
    processes leave idle); outside one, ``auto``'s rule over the load measured since the previous call at least
    :data:`GAP` seconds before (the cores allowed at the first call: no time is spent sampling)."""
    if _current:
        return _current[-1].threads
    allowed = allowed_cores(None, quota(), omp_cap())
    now = read(affinity()) if allowed >= 2 else None
    if now is None:
        return max(1, math.floor(allowed))
    if not _seen:
        _seen[:] = [now, math.floor(allowed)]
    elif now.at - _seen[0].at >= GAP:
        _seen[:] = [now, choose(allowed, others_busy(_seen[0], now))]
    return _seen[1]


def tick() -> None:
    """Between batches: the innermost running :func:`policy` re-measures the load if its interval has passed (nothing
    outside one)."""
    if _current:
        _current[-1].tick()


# a reading as this process starts, and as it is forked (a child's own CPU time starts from 0): its first policy
# measures the load since then where that is SAMPLE to INTERVAL seconds ago, instead of waiting to sample it
remember()
if hasattr(os, "register_at_fork"):  # not on Windows, where no process is forked
    os.register_at_fork(after_in_child=remember)
