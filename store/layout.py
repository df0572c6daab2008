"""Where everything lives: the default store, and every path beside a store.

A store ``<store>`` (a Zarr v3 group, read and written by io.py) has two folders beside it, on the same disk:

- ``<store>.partial/``: work in progress. Per checkpoint ``<run>/<checkpoint>``: its resume state
  ``<checkpoint>.npz`` (resume.py), its writer's lock ``<checkpoint>.lock`` (lock.py), the staged group
  ``<checkpoint>.zarr`` renamed into place when whole and the old group ``<checkpoint>.zarr.old`` moved aside meanwhile
  (io.write_checkpoint), and ``<checkpoint>.layers/``, the finished layers and staged embeddings of a ``--layers``
  extraction (layers.py). Scratch folders of the estimate's write timing live at its top.
- ``<store>.tokens/``: text tokenized once, ``<key>.npy`` per source (token_cache.py).

A group moves into and out of the store by renames, which work within one file system only: where the store folder
is its own mount point (on another file system than the folder it sits in), the staged, old and removed groups live
in ``<store>/.ncanalyze.partial/`` instead (the same names), on the store's own file system, removed when empty.

This module imports nothing heavy (no zarr, xarray or torch), so that the command line's ``--help`` stays fast.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

DEFAULT_STORE = "ncanalyze.zarr"
ENV = "NCANALYZE_STORE"


def default_store() -> str:
    """The store a command or ``ncanalyze.store.open()`` uses when given none.

    Returns
    -------
    str
        ``$NCANALYZE_STORE`` when set, else ``ncanalyze.zarr`` (in the working directory).
    """
    return os.environ.get(ENV) or DEFAULT_STORE


def probe_writable(d: Path) -> None:
    """Write and remove a file in ``d``, or in its nearest existing folder when ``d`` is not there yet, creating
    nothing that stays (a command that fails leaves no empty store); raises the OSError a write would.

    Parameters
    ----------
    d
        A folder, there or to be made.
    """
    near = Path(d)
    while not near.exists() and near.parent != near:
        near = near.parent
    if not near.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(near))
    probe = near / f".write-test-{os.getpid()}"
    probe.touch()
    probe.unlink()


class Named(Protocol):
    """What a checkpoint's paths need of it (discover.Checkpoint has both)."""
    run: str
    name: str


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one checkpoint's extraction in progress, in ``<store>.partial/<run>/``; the groups renamed into
    or out of the store under ``moved`` (``<checkpoint>.npz`` in the folder for them, :attr:`StoreLayout.moves`)."""
    state: Path  # <checkpoint>.npz; the others are named after it
    moved: Path | None = None  # where the staged, old and removed groups are named after, when not beside ``state``

    @property
    def lock(self) -> Path:
        """The writer's lock (lock.py)."""
        return self.state.with_suffix(".lock")

    @property
    def staging(self) -> Path:
        """The new group, written here whole and then renamed into the store."""
        return (self.moved or self.state).with_suffix(".zarr")

    @property
    def old(self) -> Path:
        """The replaced group, moved here between the two renames of an overwrite."""
        return (self.moved or self.state).with_suffix(".zarr.old")

    @property
    def layers(self) -> Path:
        """A ``--layers`` extraction's finished layers and staged embeddings."""
        return self.state.with_suffix(".layers")

    @property
    def removing(self) -> Path:
        """A group ``ncanalyze rm`` moved out of the store, to be deleted (nothing restores it)."""
        return (self.moved or self.state).with_suffix(".zarr.removing")

    def tidy(self) -> None:
        """Remove the folders of the moved groups that are left empty (in the store, where it is a mount point)."""
        if self.moved is not None:
            for d in (self.moved.parent, self.moved.parent.parent):
                with contextlib.suppress(OSError):
                    d.rmdir()  # only when empty

    @property
    def all(self) -> tuple[Path, ...]:
        """Every file or folder of this checkpoint beside the store, the lock aside."""
        return self.state, self.layers, self.staging, self.old, self.removing


_BESIDE = (".zarr.old", ".zarr.removing", ".npz")  # what names a checkpoint beside the store (a state or a moved group)


@dataclass(frozen=True)
class StoreLayout:
    """A store's path and every path beside it.

    Parameters
    ----------
    store
        The store's path (a folder holding the Zarr hierarchy).
    """
    store: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "store", Path(self.store))

    @property
    def partial(self) -> Path:
        """``<store>.partial``: resume states, locks and staged groups."""
        return self.store.with_name(self.store.name + ".partial")

    @property
    def moves(self) -> Path:
        """Where groups are staged, and moved aside or out, to be renamed: ``partial``, or ``<store>/.ncanalyze.partial``
        where the store folder is its own mount point (a rename across file systems fails)."""
        try:
            own_mount = self.store.stat().st_dev != self.store.parent.stat().st_dev
        except OSError:  # no store yet: it is not a mount point
            own_mount = False
        return self.store / ".ncanalyze.partial" if own_mount else self.partial

    @property
    def tokens(self) -> Path:
        """``<store>.tokens``: the token cache."""
        return self.store.with_name(self.store.name + ".tokens")

    def checkpoint(self, ckpt: Named) -> CheckpointFiles:
        """The files of ``ckpt``'s extraction in progress.

        Parameters
        ----------
        ckpt
            A checkpoint (its ``run`` and ``name``, the group ``<run>/<name>``).

        Returns
        -------
        CheckpointFiles
            Its resume state, lock, staged group, replaced group and layers folder.
        """
        return self._files(ckpt.run, ckpt.name)

    def group_files(self, group: str) -> CheckpointFiles:
        """:meth:`checkpoint` of the group ``<run>/<checkpoint>``."""
        run, name = group.split("/")
        return self._files(run, name)

    def _files(self, run: str, name: str) -> CheckpointFiles:
        moves = self.moves
        return CheckpointFiles(self.partial / run / f"{name}.npz",
                               None if moves == self.partial else moves / run / f"{name}.npz")

    def groups_beside(self) -> list[str]:
        """The checkpoint groups ``<run>/<checkpoint>`` that have a resume state or a moved group beside the store."""
        found = []
        folders = {self.partial, self.moves}
        for f in (f for d in folders if d.is_dir() for f in d.glob("[!.]*/*")):
            ends = [s for s in _BESIDE if f.name.endswith(s)]
            if ends and not f.name.endswith(".tmp.npz"):
                found.append(f"{f.parent.name}/{f.name.removesuffix(ends[0])}")
        return list(dict.fromkeys(found))


def _natural(name: str) -> tuple:
    """A sort key reading the numbers in ``name`` as numbers: checkpoint-20 before checkpoint-100."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def group_order(group: str, steps: dict[str, int | None]) -> tuple:
    """The sort key of ``group`` (``run``, ``run/checkpoint`` or ``run/checkpoint/layers/<l>``): the run's name; the
    checkpoint's ``global_step`` (from ``steps``, by checkpoint group; none last), then ``final`` after a checkpoint
    of the same step, then its name (numbers read as numbers); then the checkpoint group before its layers, which go
    by index (layers/10 after layers/9)."""
    run, checkpoint, layer = (group.split("/", 2) + ["", ""])[:3]
    if not checkpoint:
        return (run,)
    step = steps.get(f"{run}/{checkpoint}")
    known = isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step)
    return (run, not known, step if known else 0, checkpoint == "final", _natural(checkpoint),
            _natural(layer))
