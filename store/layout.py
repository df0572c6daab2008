"""Where everything lives: the default store, and every path beside a store; removing what an extraction leaves
there (:func:`drop_state`, :func:`prune`).

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

from ncanalyze.core.errors import UserError
from ncanalyze.core.names import check_name, name_problem, shown

DEFAULT_STORE = "ncanalyze.zarr"
ENV = "NCANALYZE_STORE"
NAME_FIX = "a group is <run>/<checkpoint>, each a plain folder name"


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
        """Where groups are staged, and moved aside or out, to be renamed: ``partial``, or
        ``<store>/.ncanalyze.partial`` where the store folder is its own mount point (a rename across mounts fails,
        even to a bind mount of the same file system)."""
        return self.store / ".ncanalyze.partial" if is_mount_point(self.store) else self.partial

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
        check_name(run, "the run", NAME_FIX, controls=False)  # a path beside the store: never out of its folder
        check_name(name, "the checkpoint", NAME_FIX, controls=False)
        moves = self.moves
        files = CheckpointFiles(self.partial / run / f"{name}.npz",
                                None if moves == self.partial else moves / run / f"{name}.npz")
        no_links([self.partial, self.partial / run, moves, moves / run, files.lock, *files.all])
        return files

    def check_links(self) -> None:
        """A one-line UserError where a work folder beside (or in) the store is a symbolic link (:func:`no_links`)."""
        no_links([self.partial, self.moves])

    def groups_beside(self) -> list[str]:
        """The checkpoint groups ``<run>/<checkpoint>`` that have a resume state or a moved group beside the store."""
        found = []
        folders = {self.partial, self.moves}
        for f in (f for d in folders if d.is_dir() for f in d.glob("[!.]*/*")):
            ends = [s for s in _BESIDE if f.name.endswith(s)]
            run, name = f.parent.name, f.name.removesuffix(ends[0]) if ends else ""
            if ends and not f.name.endswith(".tmp.npz") and not (name_problem(run, False) or name_problem(name, False)):
                found.append(f"{run}/{name}")  # a stray '...npz' names no checkpoint: checked as the user's names
        return list(dict.fromkeys(found))


def no_links(paths: list[Path]) -> None:
    """A one-line UserError where one of ``paths`` (work folders and files beside the store) is a symbolic link:
    ncanalyze never follows a link in its work folders (it would delete or write inside the link's target)."""
    for p in dict.fromkeys(paths):
        if p.is_symlink():
            raise UserError(f"{shown(p)} is a symbolic link (to {shown(os.readlink(p))}), in a folder where ncanalyze "
                            "keeps its work in progress and never follows links: remove the link (rm, not rm -r)")


def _unescape(field: str) -> str:
    """A path of the mount table, whose space, tab, newline and backslash are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def is_mount_point(path: Path) -> bool:
    """Whether ``path`` is a mount point: on another device than its parent, or named in the mount table
    (``/proc/self/mountinfo``: a bind mount is on the same device, yet a rename across it fails with EXDEV).

    Parameters
    ----------
    path
        A folder (absent: not a mount point).

    Returns
    -------
    bool
        It is one.
    """
    try:
        if path.stat().st_dev != path.parent.stat().st_dev or os.path.ismount(path):
            return True
        real = os.path.realpath(path)
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            return any(_unescape(line.split(" ")[4]) == real for line in f if line.count(" ") >= 4)
    except OSError:  # no store yet, or no mount table (not Linux): not a mount point we can see
        return False


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


def prune(partial: Path) -> None:
    """Remove the empty folders left in ``partial`` (and itself, once empty)."""
    if not partial.is_dir():
        return
    if partial.is_symlink():  # never followed (layout.no_links refuses it where work is done)
        return
    for d in sorted((p for p in partial.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: len(p.parts),
                    reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    if not any(partial.iterdir()):
        partial.rmdir()


def drop_state(path: Path) -> None:
    """Remove a checkpoint's state and any temporary files left beside it, and the folders once empty."""
    path.unlink(missing_ok=True)
    for tmp in path.parent.glob(f"{path.stem}.*.tmp.npz") if path.parent.is_dir() else ():
        tmp.unlink(missing_ok=True)
    for d in (path.parent, path.parent.parent):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
