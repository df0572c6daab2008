"""The resume state of one checkpoint's extraction: where it lives, its phases, and atomic saves.

It lives beside the store (``<store>.partial/<run>/<checkpoint>.npz``), so the Zarr hierarchy stays clean; it holds
the running statistics, the reservoir, the validation counts, the phase, the batches done in that phase, and the
configuration record it was made under.
"""
from __future__ import annotations

import enum
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ncanalyze.store.discover import Checkpoint


class Phase(enum.IntEnum):
    """Where an extraction stands (stored as its number)."""
    TRAIN = 0        # the train pass: class statistics and the reservoir
    VALIDATION = 1   # the validation pass: NC4's decision counts
    DONE = 2         # both passes done; the group is written next


def state_path(store: Path, ckpt: Checkpoint) -> Path:
    return store.with_name(store.name + ".partial") / ckpt.run / f"{ckpt.name}.npz"


def save_state(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Atomically: a kill leaves the old state or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def drop_state(path: Path) -> None:
    """Remove a finished checkpoint's state, and its folders once empty."""
    path.unlink(missing_ok=True)
    for d in (path.parent, path.parent.parent):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()


def record_of(arrays) -> dict:
    """The configuration record a saved state was made under."""
    return json.loads(str(arrays["config"]))


class Saver:
    """Saves ``state()`` every ``every`` seconds (and when forced), atomically."""

    def __init__(self, path: Path, state: Callable[[], dict[str, np.ndarray]], every: float):
        self.path, self.state, self.every, self.last = path, state, every, time.monotonic()

    def maybe(self, force: bool = False) -> None:
        if force or time.monotonic() - self.last >= self.every:
            save_state(self.path, self.state())
            self.last = time.monotonic()
