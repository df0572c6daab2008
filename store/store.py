"""The store as one object: :class:`Store`, its path and layout resolved once (by the command line, or by
:func:`Store.at`), offering the store's operations, so that no module rebuilds a layout from a path.

Modelled on xarray's ``ZarrStore``: the reads and writes themselves are io.py's (the only module that touches zarr),
the paths beside the store layout.py's, the lock lock.py's; a :class:`Store` binds them to one store. It behaves as
its path where a path is wanted (``os.fspath``, ``str``, f-strings), so messages name the folder.
"""
from __future__ import annotations

import enum
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ncanalyze.store import io
from ncanalyze.store.layout import CheckpointFiles, Named, StoreLayout, default_store, prune
from ncanalyze.store.lock import checkpoint_lock


class Status(enum.Enum):
    """What to do with a checkpoint, given what is on disk (:meth:`Store.status`)."""
    SKIP = "skip"        # in the store, complete, under the same configuration
    REFUSE = "refuse"    # in the store, complete, under another configuration (config.refusal() says so)
    RESUME = "resume"    # not in the store; a resume state is there
    FRESH = "fresh"      # neither


def decide(existing: dict | None, config_hash: str, state: Path, overwrite: bool = False,
           restart: bool = False) -> Status:
    """The one decision of what to do with a checkpoint.

    Parameters
    ----------
    existing
        The attributes of its group in the store (None: not there).
    config_hash
        The hash of the configuration record it would be extracted under.
    state
        Its resume state's path.
    overwrite
        A complete group is to be replaced (never skipped or refused).
    restart
        A resume state is to be discarded (never resumed).

    Returns
    -------
    Status
        SKIP, REFUSE, RESUME or FRESH.
    """
    if existing and existing.get("complete") and not overwrite:
        return Status.SKIP if existing.get("config_hash") == config_hash else Status.REFUSE
    return Status.RESUME if state.exists() and not restart else Status.FRESH


@dataclass(frozen=True)
class Store:
    """One store: its path, every path beside it (:attr:`layout`) and its operations.

    Parameters
    ----------
    layout
        The store's layout (its path: ``layout.store``).
    """
    layout: StoreLayout

    @classmethod
    def at(cls, path: str | Path | Store | None = None) -> Store:
        """The store at ``path`` [default: ``$NCANALYZE_STORE``, else ``./ncanalyze.zarr``]; a Store is itself."""
        if isinstance(path, Store):
            return path
        return cls(StoreLayout(Path(path if path is not None else default_store())))

    @property
    def path(self) -> Path:
        """The store's folder."""
        return self.layout.store

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def absolute(self) -> Store:
        """The same store by its absolute path (for workers that run elsewhere)."""
        return Store(StoreLayout(self.path.absolute()))

    # --- reading ---

    def exists(self) -> bool:
        """Whether a store is there (its root ``zarr.json``)."""
        return (self.path / "zarr.json").is_file()

    def require(self) -> None:
        """The one-line error for a path that is not a store (none when it is)."""
        if not self.exists():
            io.open_tree(self.path)

    def tree(self):
        """The whole store as a lazy ``xarray.DataTree`` (io.open_tree; ``ncanalyze.store.open``)."""
        return io.open_tree(self.path)

    def check_format(self) -> None:
        """A one-line error unless the store is of this version's format (io.check_format)."""
        io.check_format(self.path)

    def checkpoint_groups(self) -> tuple[list[str], dict[str, str]]:
        """The complete groups in study order, and the unreadable ones with why (io.checkpoint_groups)."""
        return io.checkpoint_groups(self.path)

    def attrs(self, group: str, corrupt_ok: bool = False) -> dict | None:
        """A group's attributes, None if absent (io.group_attrs)."""
        return io.group_attrs(self.path, group, corrupt_ok)

    def read(self, group: str, **kwargs):
        """A group's dataset, lazily (io.read_group)."""
        return io.read_group(self.path, group, **kwargs)

    def statistics(self, group: str, head=None):
        """A group's measured variables, loaded and checked (io.read_statistics)."""
        return io.read_statistics(self.path, group, head)

    def damage(self, group: str, only: Iterable[str] | None = None) -> list[str]:
        """What is wrong with a complete group's arrays (io.damage)."""
        return io.damage(self.path, group, only)

    def status(self, group: str, config_hash: str, overwrite: bool = False, restart: bool = False) -> Status:
        """What to do with checkpoint ``group`` under the configuration hashed ``config_hash`` (:func:`decide`); a
        corrupt group reads as absent when ``overwrite`` replaces it."""
        return decide(self.attrs(group, corrupt_ok=overwrite), config_hash, self.group_files(group).state,
                      overwrite, restart)

    # --- the files beside it ---

    def files(self, ckpt: Named) -> CheckpointFiles:
        """A checkpoint's files beside the store (layout.py)."""
        return self.layout.checkpoint(ckpt)

    def group_files(self, group: str) -> CheckpointFiles:
        """The files beside the store of checkpoint ``group`` (``run/checkpoint``)."""
        return self.layout.group_files(group)

    def lock(self, group: str, doing: str | None = None):
        """Checkpoint ``group``'s writer's lock (lock.py), as a context manager."""
        kwargs = {} if doing is None else {"doing": doing}
        return checkpoint_lock(self.group_files(group).lock, group, **kwargs)

    def prune(self) -> None:
        """Remove the empty folders of work in progress beside the store (layout.prune)."""
        prune(self.layout.partial)

    # --- writing ---

    def prepare(self) -> None:
        """Check, before any work, that the store can be written, creating nothing (io.prepare)."""
        io.prepare(self.path, self.layout.partial)
        self.layout.check_links()  # never work through a link in the work folders

    def ensure(self, group: str = "") -> None:
        """Make sure ``group`` and the root exist (io.ensure_group)."""
        io.ensure_group(self.path, group)

    def recover(self, group: str) -> None:
        """Put back a group an overwrite left aside (io.recover_swap)."""
        io.recover_swap(self.path, group, self.group_files(group))

    def write_checkpoint(self, group: str, ds, layers: Iterable = ()) -> None:
        """Write a finished checkpoint as ``group``, staged then swapped in (io.write_checkpoint)."""
        io.write_checkpoint(self.path, group, ds, self.group_files(group), layers=layers)

    def write_metrics(self, group: str, scalars: dict[str, float], per_class, min_count: int,
                      config_hash: str | None) -> dict:
        """Store a group's metrics, the record last (io.write_metrics); returns the record."""
        return io.write_metrics(self.path, group, scalars, per_class, min_count, config_hash)

    def write_rate(self, sample) -> float | None:
        """Bytes per second at which the store writes ``sample`` (io.write_rate, in the partial folder)."""
        return io.write_rate(sample, self.layout.partial)
