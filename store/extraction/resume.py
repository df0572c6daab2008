"""The resume state of one checkpoint's extraction: where it lives, its phases, atomic saves and checked loads.

It lives beside the store (``StoreLayout.checkpoint(ckpt).state``, layout.py), so the Zarr hierarchy stays clean; it
holds the running statistics, the reservoir, the validation counts, the phase, the batches done in that phase, a hash of
the token blocks read so far in that phase, and the configuration record it was made under. The same folder holds
the checkpoint's lock (lock.py) and the staging copy of its group while it is written (io.write_checkpoint).
"""
from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import signal
import threading
import time
import uuid
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ncanalyze.core.errors import CheckpointError

log = logging.getLogger(__name__)


class Phase(enum.IntEnum):
    """Where an extraction stands (stored as its number)."""
    TRAIN = 0        # the train pass: class statistics and the reservoir
    VALIDATION = 1   # the validation pass: NC4's decision counts
    DONE = 2         # both passes done; the group is written next


def flatten(state: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """A nested state (dicts of arrays, tensors and scalars, e.g. accumulators' ``state_dict`` under their names)
    as the flat names of a saved state: ``{"stats": {"mean": m}}`` -> ``{"stats.mean": m}``, tensors as numpy arrays
    on the CPU. The one place state names are made (:func:`unflatten` reads them back).

    Parameters
    ----------
    state : the nested state.
    prefix : a name put before every key (with a dot).

    Returns
    -------
    dict : flat name -> numpy array.
    """
    flat: dict[str, np.ndarray] = {}
    for k, v in state.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping):
            flat |= flatten(v, name)
        else:
            flat[name] = v.cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
    return flat


def unflatten(arrays: Mapping[str, Any]) -> dict[str, Any]:
    """The nested state of flat names (:func:`flatten`'s inverse): ``{"layer3.stats.mean": m}`` ->
    ``{"layer3": {"stats": {"mean": m}}}``. ``arrays`` may be an open npz file (its names in ``files``).

    Parameters
    ----------
    arrays : flat name -> array.

    Returns
    -------
    dict : the nested state.
    """
    nested: dict[str, Any] = {}
    for name in getattr(arrays, "files", arrays):
        *path, leaf = name.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = arrays[name]
    return nested


RESTART = "pass --restart to discard it and extract this checkpoint from the start"
DIGEST = "digest"  # the name of a saved state's integrity digest (:func:`digest`)


def digest(arrays: Mapping[str, np.ndarray]) -> str:
    """The sha256 of a state's arrays (all but :data:`DIGEST`): each one's name, dtype, shape and bytes, in name order.

    It proves that a state is the one ncanalyze wrote (no bit rot, no array altered without recomputing it); it is
    not a signature: whoever can run this function can forge it.

    Parameters
    ----------
    arrays : flat name -> array.

    Returns
    -------
    str : the hex digest.
    """
    h = hashlib.sha256()
    for name in sorted(k for k in arrays if k != DIGEST):
        a = np.ascontiguousarray(arrays[name])
        h.update(json.dumps([name, a.dtype.str, list(a.shape)]).encode())
        h.update(a.reshape(-1).view(np.uint8) if a.size else b"")
    return h.hexdigest()


def save_state(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Atomically, through a temporary file of this process's own: a kill leaves the old state or the new one. The
    arrays are saved with their :func:`digest`, which :func:`load_state` checks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp.npz")
    try:
        np.savez(tmp, **arrays, **{DIGEST: np.array(digest(arrays))})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# what a truncated, empty, garbage or bit-flipped .npz raises when it is read
UNREADABLE = (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile)


def load_state(path: Path, needs: tuple[str, ...] = ("config", "phase", "batches")) -> dict[str, np.ndarray]:
    """Every array of a saved state, read (and so checksummed by zip) now and checked against the digest saved with
    them; the scalars ``needs`` must be there. A one-line error naming ``--restart`` if any of it fails.

    Parameters
    ----------
    path : the state (a checkpoint's, or a finished layer's in the layers folder with ``needs=()``).
    needs : names of scalars it must hold.

    Returns
    -------
    dict : name -> array, the digest left out.
    """
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except UNREADABLE as e:
        raise CheckpointError(f"the resume state {path} is unreadable ({type(e).__name__}: {e}); {RESTART}") from None
    saved = arrays.pop(DIGEST, None)
    if saved is None or saved.shape != () or str(saved) != digest(arrays):
        raise CheckpointError(f"the resume state {path} fails its integrity check (its arrays are not the ones "
                              f"saved: damaged, altered, or not written by ncanalyze); {RESTART}")
    bad = [k for k in needs if k not in arrays or arrays[k].shape != ()]
    if bad:
        raise CheckpointError(f"the resume state {path} lacks {', '.join(bad)} (or holds them with a shape); "
                              f"{RESTART}")
    if "config" in needs:
        try:
            record_of(arrays)
        except ValueError as e:
            raise CheckpointError(f"the resume state {path} holds an unreadable configuration ({e}); {RESTART}") \
                from None
    return arrays


def record_of(arrays) -> dict:
    """The configuration record a saved state was made under."""
    return json.loads(str(arrays["config"]))


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, taken at a batch boundary after the state was saved."""


class DeferredInterrupt:
    """Within ``with DeferredInterrupt():``, Ctrl-C (SIGINT) only sets ``pending``; the extraction takes it at its
    next batch boundary, where its state is whole (:meth:`Saver.maybe`). A second Ctrl-C stops at once. Outside the
    main thread (a dask worker) signals can't be caught, and this does nothing."""

    def __init__(self) -> None:
        self.pending, self._previous = False, None

    def _handler(self, signum, frame) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if self.pending and exc[0] is None:  # not taken at a batch boundary (no batch came): take it now
            raise KeyboardInterrupt


class Saver:
    """Saves ``state()`` every ``every`` seconds (and when forced), atomically; a pending ``interrupt`` is taken here,
    at a batch boundary where the state is whole: saved, then :class:`Interrupted` is raised."""

    def __init__(self, path: Path, state: Callable[[], dict[str, np.ndarray]], every: float,
                 interrupt: DeferredInterrupt | None = None):
        self.path, self.state, self.every, self.last = path, state, every, time.monotonic()
        self.interrupt = interrupt

    def maybe(self, force: bool = False) -> None:
        """Called at batch boundaries only."""
        interrupted = self.interrupt is not None and self.interrupt.pending
        if force or interrupted or time.monotonic() - self.last >= self.every:
            save_state(self.path, self.state())
            self.last = time.monotonic()
        if interrupted:
            self.interrupt.pending = False
            raise Interrupted(f"interrupted: state saved in {self.path}; run the same command to resume")
