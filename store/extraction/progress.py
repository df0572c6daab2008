"""The run's time left, measured on the run itself as it goes (the estimate's up-front line is a snapshot of one
timed batch: estimate.py).

The up-front estimate predicts, for every checkpoint to do, the seconds of each batch (its architecture's timed
costs, the layers of its pass, the fraction of the blocks the pass runs) and of each load and write. As the passes
run, each batch done adds its predicted seconds to the work done; the rate of the run is the wall seconds per
predicted second over the last :data:`WINDOW` seconds (all of the run while it is shorter), and

    time left = (predicted seconds in all - predicted seconds done) x that rate

so a load that comes or goes mid-run changes the rate within a window, and a snapshot that was off (a burst of load
during the timing) is corrected after the first window. Shown on each pass's progress bar (``run ~3.5 min left``)
and logged every :data:`LOG_EVERY` seconds; ``history`` keeps every figure (benchmarks/estimate.py reads it).
"""
from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

WINDOW = 30.0     # seconds of the run the rate is measured over
LOG_EVERY = 60.0  # seconds between the logged lines of the time left


def pass_depth(plan, index: int) -> float:
    """The fraction of the model's blocks pass ``index`` of ``plan`` runs: a pass below the last layer stops before
    the block of its deepest layer l (anatomy.cut_forward), so it runs l of the ``plan.last`` blocks (B + 1 for a
    sublayer site of block B, Site.blocks); the pass of the last layer runs them all."""
    p, n = plan.passes[index], plan.last.index
    return 1.0 if plan.last in p or n <= 0 else max(p).blocks / n


def duration(secs: float) -> str:
    """``45 s``, ``3.5 min``, ``1.2 h``."""
    return f"{secs:,.0f} s" if secs < 120 else f"{secs / 60:,.1f} min" if secs < 7200 else f"{secs / 3600:,.1f} h"


@dataclass
class Tracker:
    """The time left of a run whose predicted seconds in all are ``total``; ``cost(ex)`` the predicted seconds of a
    batch of the running state ``ex`` (its pass, phase and layers), ``fixed(ex)`` those of its checkpoint's load and
    write (counted at its first batch). ``history``: (seconds since the start, estimated seconds in all) at each
    refresh."""
    total: float
    cost: Callable[[object], float]
    fixed: Callable[[object], float]
    window: float = WINDOW
    clock: Callable[[], float] = time.monotonic
    done: float = 0.0
    history: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.clock()
        self.samples: deque[tuple[float, float]] = deque([(self.start, 0.0)])
        self.seen: weakref.WeakSet = weakref.WeakSet()  # the running states met: not their id(), which a later
        # checkpoint's state may take over once an earlier one is freed (its load and write then never counted)
        self.logged = self.start

    def batch(self, ex) -> None:
        """A batch of ``ex`` is done: its predicted seconds (and its checkpoint's load and write, at its first) join
        the work done."""
        if ex not in self.seen:
            self.seen.add(ex)
            self.done += self.fixed(ex)
        self.done += self.cost(ex)
        now = self.clock()
        self.samples.append((now, self.done))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()
        left = self.left()
        if left is not None:
            self.history.append((now - self.start, now - self.start + left))

    def rate(self) -> float | None:
        """Wall seconds per predicted second over the last window (None before any work is done)."""
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return (t1 - t0) / (d1 - d0) if d1 > d0 else None

    def left(self) -> float | None:
        """Seconds left: the predicted seconds left at the measured rate."""
        rate = self.rate()
        return None if rate is None else max(0.0, self.total - self.done) * rate

    def describe(self) -> str:
        """``run ~3.5 min left`` (``run: timing`` before the first batch)."""
        left = self.left()
        return "run: timing" if left is None else f"run ~{duration(left)} left"


_tracker: list[Tracker] = []
_last: list[Tracker] = []


def track(tracker: Tracker | None) -> None:
    """Follow ``tracker`` from now on (None: nothing), in place of any earlier run's."""
    _tracker[:] = [tracker] if tracker is not None else []
    _last[:] = _tracker or _last


def last() -> Tracker | None:
    """The last run's :class:`Tracker`, followed or not (its ``history`` for benchmarks/estimate.py)."""
    return _last[0] if _last else None


def batch(ex, bar=None) -> None:
    """A batch of ``ex`` is done: the tracked run's time left refreshed, on ``bar`` (a tqdm bar) and, every
    :data:`LOG_EVERY` seconds, in the log."""
    if not _tracker:
        return
    t = _tracker[0]
    t.batch(ex)
    if bar is not None:
        bar.set_postfix_str(t.describe(), refresh=False)
    if t.left() is not None and t.clock() - t.logged >= LOG_EVERY:
        t.logged = t.clock()
        log.info("estimate: %s, at the rate of the last %s (%s done)", t.describe().removeprefix("run "),
                 duration(min(t.window, t.clock() - t.start)), duration(t.clock() - t.start))


def current() -> Tracker | None:
    """The tracked run's :class:`Tracker` (None: none)."""
    return _tracker[0] if _tracker else None
