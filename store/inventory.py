"""What a store holds (``ncanalyze ls``), and removing checkpoints, runs or tags from it safely (``ncanalyze rm``).

Listing reads metadata only (attributes and file sizes, no data chunks). A removal takes each checkpoint's lock (the
one extraction holds, store/lock.py), moves the group out of the store in one rename to a folder beside it, removes
its resume state, then deletes what it moved: a kill leaves the store with the whole group or without it, never half
of it (and ``rm`` run again deletes what is left beside it).
"""
from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ncanalyze.analyzer.schema import LAYER
from ncanalyze.core.errors import UserError
from ncanalyze.core.names import shown
from ncanalyze.store import io
from ncanalyze.store.classifier import checkpoint_group
from ncanalyze.store.layout import CheckpointFiles, drop_state, group_order, probe_writable
from ncanalyze.store.store import Store

log = logging.getLogger(__name__)

PER_CHECKPOINT = {"weights"}  # config keys that differ between checkpoints by nature: not a setting of the study


def files_of(store: str | Path | Store, group: str) -> CheckpointFiles:
    """The files beside the store of checkpoint ``group`` (``run/checkpoint``), where extraction keeps them (a thin
    function of a path, for the tests; the commands ask their :class:`Store`)."""
    return Store.at(store).group_files(group)


def disk_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (a file or a folder; 0 if absent)."""
    if path.is_file():
        return path.stat().st_size
    return sum((Path(d) / f).lstat().st_size for d, _, files in os.walk(path) for f in files)


def _leftovers(store: Store, group: str) -> list[Path]:
    """What beside the store belongs to checkpoint ``group``: resume state, staged layers, staged or old copy, and
    what a removal cut short left."""
    return [p for p in store.group_files(group).all if p.exists()]


def linked(store: Store) -> dict[str, str]:
    """The runs and checkpoint groups of ``store`` that are symbolic links -> where they point: ncanalyze reads
    nothing through them, ``ls`` shows them as links and ``rm`` removes the link only."""
    found = {}
    for d in (d for d in store.path.iterdir() if not d.name.startswith(".")):
        if d.is_symlink():
            found[d.name] = os.readlink(d)
        elif d.is_dir():
            found |= {f"{d.name}/{c.name}": os.readlink(c) for c in d.iterdir() if c.is_symlink()}
    return found


def _nested(folder: Path) -> bool:
    """Whether ``folder`` is the root of a store (its own ``ncanalyze_format``): a store nested in another."""
    try:
        return io.FORMAT_KEY in (json.loads((folder / "zarr.json").read_bytes()).get("attributes") or {})
    except (OSError, ValueError, AttributeError):
        return False


def known(store: Store) -> dict[str, list[str]]:
    """Every run of ``store`` -> its checkpoint groups (``run/checkpoint``): those in the store, and those that exist
    only beside it (a resume state, or an old copy left by a write or removal cut short), in study order. Links
    (:func:`linked`) and stores nested in it are none of them."""
    runs: dict[str, set[str]] = {}
    for run in (d for d in store.path.iterdir() if (d / "zarr.json").is_file() and not d.name.startswith(".")
                and not d.is_symlink() and not _nested(d)):
        runs[run.name] = {f"{run.name}/{c.name}" for c in run.iterdir()
                          if (c / "zarr.json").is_file() and not c.is_symlink()}
    for group in store.layout.groups_beside():
        runs.setdefault(group.split("/")[0], set()).add(group)
    steps = {g: (store.attrs(g, corrupt_ok=True) or {}).get("global_step")
             for gs in runs.values() for g in gs}
    return {r: sorted(gs, key=lambda g: group_order(g, steps)) for r, gs in sorted(runs.items())}


# ---------------------------------------------------------------------------------------------------------- listing

@dataclass
class Entry:
    """One checkpoint of a store as ``ls`` shows it."""
    group: str
    status: str = "ok"      # ok | incomplete | corrupt: why | interrupted extraction | interrupted removal
    attrs: dict = field(default_factory=dict)
    layers: list[int | str] = field(default_factory=list)  # the residual layers, then the sublayer sites (attn:1)
    measured: str = "no"    # min_count=N | no | stale | partly
    bytes: int = 0

    def row(self, settings: list[str]) -> dict:
        """The entry as one plain record (``ls --json``): the settings are the config keys in ``settings``."""
        run, checkpoint = self.group.split("/", 1)
        config = _config(self.attrs)
        tag = self.attrs.get("tag", run.rsplit("@", 1)[1] if "@" in run else None)  # (no attributes: from the name)
        return {"group": self.group, "run": run, "checkpoint": checkpoint, "global_step": self.attrs.get("global_step"),
                "tag": tag, "layers": self.layers, "dataset": self.attrs.get("dataset"),
                "settings": {k: config.get(k) for k in settings}, "measured": self.measured, "bytes": self.bytes,
                "status": self.status}


def _config(attrs: dict) -> dict:
    """The extraction's configuration record of a group (its ``config`` attribute, JSON), {} if absent or unreadable."""
    try:
        config = json.loads(attrs.get("config") or "{}")
    except (TypeError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _measured(attrs: list[dict]) -> str:
    """Whether a checkpoint's groups (its own and its layers') hold metrics, current ones (measured since the
    statistics were written), and under which min_count: 'min_count=N', 'no', 'stale' or 'partly'."""
    has = [a for a in attrs if "metrics" in a]
    current = [a for a in has if a.get("metrics_config_hash") == a.get("config_hash")]
    counts = {a.get("metrics_min_count") for a in current}
    if len(current) == len(attrs) and len(counts) == 1:
        return f"min_count={counts.pop()}"
    return "no" if not has else "stale" if not current else "partly"


def _checkpoint(store: Store, group: str, good: set[str], bad: dict[str, str]) -> Entry:
    """The entry of checkpoint ``group``: its status, layers, measurement and size (its leftovers included)."""
    entry = Entry(group, bytes=disk_bytes(store.path / group) + sum(disk_bytes(p) for p in _leftovers(store, group)))
    run = group.split("/")[0]
    if not (store.path / group).is_dir():
        removing = store.group_files(group).removing.exists()
        entry.status = ("interrupted removal (rm it again to finish)" if removing else
                        "interrupted extraction: a resume state or old copy only (extract again to finish, or rm it)")
        return entry
    if run in bad or group in bad:
        entry.status = f"corrupt: {bad.get(run, bad.get(group))}"
        return entry
    if group not in good:
        entry.status = "incomplete: an interrupted write (extract again to finish, or rm it)"
        return entry
    entry.attrs = store.attrs(group)
    subs = sorted((g for g in [*good, *bad] if g.startswith((f"{group}/layers/", f"{group}/sites/"))),
                  key=lambda g: group_order(g, {}))
    own = entry.attrs.get(LAYER, entry.attrs.get("n_layers"))
    names = [g.removeprefix(f"{group}/").split("/", 1) for g in subs]  # (layers, 3) or (sites, attn_1)
    residual = {int(n) for kind, n in names if kind == "layers" and n.isdigit()} | ({own} if isinstance(own, int)
                                                                                 else set())
    entry.layers = [*sorted(residual), *(":".join(n.rsplit("_", 1)) for kind, n in names if kind == "sites")]
    problems = [f"{g.removeprefix(group + '/')} corrupt ({bad[g]})" for g in subs if g in bad]
    for g in (g for g in [group, *subs] if g in good):
        try:
            problems += [f"{g.removeprefix(group).strip('/') or 'it'} {p}" for p in store.damage(g)]
        except io.CORRUPT as e:
            problems.append(f"an array's metadata is corrupt ({e})")
    if problems:
        entry.status = "corrupt: " + "; ".join(problems) + f": {io.FIX}"
    entry.measured = _measured([entry.attrs, *(store.attrs(g) for g in subs if g in good)])
    return entry


def inventory(store: str | Path | Store) -> dict:
    """What ``store`` holds, from metadata only: ``entries`` (an :class:`Entry` per checkpoint, in study order),
    ``settings`` (the configuration keys whose values differ between the store's checkpoints; ``dataset`` is always
    shown), ``runs``, ``tags``, ``bytes`` (the store, its resume folder and its token cache) and ``store``."""
    store = Store.at(store)
    store.require()  # the one-line error for a path that is not a store
    good, bad = store.checkpoint_groups()
    entries = [_checkpoint(store, g, set(good), bad) for gs in known(store).values() for g in gs]
    listed = {e.group.split("/")[0] for e in entries}
    entries += [Entry(f"{run}/-", status=why if io.NESTED_FIX in why else f"corrupt: {why}",  # nothing below it
                      bytes=disk_bytes(store.path / run))
                for run, why in bad.items() if "/" not in run and run not in listed]
    entries += [Entry(name if "/" in name else f"{name}/-", status=f"linked: a symbolic link to {target}, not read "
                      "through (ncanalyze rm removes the link only)") for name, target in linked(store).items()]
    configs = [_config(e.attrs) for e in entries if e.attrs]
    keys = sorted({k for c in configs for k in c} - PER_CHECKPOINT - {"dataset"})
    settings = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]
    layout = store.layout
    total = sum(disk_bytes(p) for p in (store.path, layout.partial, layout.tokens))
    return {"store": str(store), "entries": entries, "settings": settings, "bytes": total,
            "runs": sorted({e.group.split("/")[0] for e in entries}),
            "tags": sorted({e.row([])["tag"] for e in entries} - {None}),
            "token_cache_bytes": disk_bytes(layout.tokens)}


# ---------------------------------------------------------------------------------------------------------- removal

@dataclass
class Removal:
    """What ``rm`` removes: checkpoint groups (``run/checkpoint``, with their layers and what lies beside the store
    for them), whole runs (every checkpoint, then the run's own group) and links (runs or checkpoints that are
    symbolic links: the link only, never what it points to)."""
    store: Store
    groups: list[str]
    runs: list[str]
    links: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(disk_bytes(self.store.path / g) + sum(disk_bytes(p) for p in _leftovers(self.store, g))
                   for g in self.groups)


def plan_removal(store: str | Path | Store, names: list[str], tags: list[str] = ()) -> Removal:
    """Resolve ``names`` (``run/checkpoint`` or ``run``) and ``tags`` (every ``<run>@<tag>`` run) against ``store``;
    a UserError, in one line, for the names that match nothing, with the close matches."""
    store = Store.at(store)
    store.require()  # the one-line error for a path that is not a store
    store.check_format()  # a store of another format: extract again, nothing removed
    runs_, links = known(store), linked(store)
    groups = [g for gs in runs_.values() for g in gs]
    runs, picked, unknown, unlink = [], [], [], []
    for given in dict.fromkeys(names):
        name = given.strip("/") if given.strip("/") else given  # a trailing / of a run's folder; '/' itself stays
        if name in links:
            unlink.append(name)
        elif name in runs_:
            runs.append(name)
        elif name in groups:
            picked.append(name)
        elif checkpoint_group(name) in groups:
            raise UserError(f"{name} is a layer of {checkpoint_group(name)}, whose configuration names its layers: "
                            "remove the whole checkpoint, or extract it again with other --layers --overwrite")
        else:
            close = difflib.get_close_matches(name, [*runs_, *groups], n=3, cutoff=0.6)
            unknown.append(shown(repr(given)) + (f" (did you mean {' or '.join(map(shown, close))}?)" if close else ""))
    for tag in tags:
        tagged = [r for r in runs_ if r.endswith(f"@{tag}")]
        if not tagged:
            there = sorted({r.rsplit("@", 1)[1] for r in runs_ if "@" in r})
            unknown.append(f"tag {tag!r} (tags here: {', '.join(there) or 'none'})")
        runs += tagged
    if unknown:
        raise UserError(f"nothing in {store} named {'; '.join(unknown)}: `ncanalyze ls {store}` lists what it holds")
    runs = list(dict.fromkeys(runs))
    picked = [g for g in picked if g.split("/")[0] not in runs]
    return Removal(store, picked + [g for r in runs for g in runs_[r]], runs, unlink)


def remove_checkpoint(store: Store, group: str) -> None:
    """Remove checkpoint ``group`` under its extraction lock: the group leaves the store in one rename (to a folder
    beside it that nothing restores), then its resume state, staged files and the moved group are deleted. A kill
    leaves the store with the whole group or without it; what is left beside it, ``ls`` names and ``rm`` run again
    removes."""
    files = store.group_files(group)
    with store.lock(group, doing="removed"):
        store.recover(group)  # a write cut short: its old group is the one
        if (store.path / group).exists():
            shutil.rmtree(files.removing, ignore_errors=True)
            files.removing.parent.mkdir(parents=True, exist_ok=True)
            os.rename(store.path / group, files.removing)
        drop_state(files.state)
        for path in (files.layers, files.staging, files.old, files.removing):
            shutil.rmtree(path, ignore_errors=True)
        files.tidy()


def remove(removal: Removal) -> list[str]:
    """Carry out ``removal``: each checkpoint (:func:`remove_checkpoint`), then each whole run's own group once
    nothing else is left in it. Returns what was left behind, with why (a run holding other folders)."""
    store, left = removal.store, []
    for folder in {store.path, *(store.path / g.split("/")[0] for g in removal.groups)}:
        try:
            probe_writable(folder)
        except OSError as e:
            raise UserError(f"cannot remove anything from {store}: {folder} is not writable ({e.strerror}); nothing "
                            "was removed: remount it read-write or fix its permissions") from None
    try:
        for link in removal.links:  # the link itself, never what it points to
            with contextlib.suppress(FileNotFoundError):
                os.unlink(store.path / link)
        for group in removal.groups:
            remove_checkpoint(store, group)
            log.debug("removed %s", group)
        for run in removal.runs:
            folder = store.path / run
            others = [p.name for p in folder.iterdir() if p.name != "zarr.json"] if folder.is_dir() else []
            if others:
                left.append(f"{run} (it also holds {', '.join(sorted(others)[:3])})")
                continue
            (folder / "zarr.json").unlink(missing_ok=True)
            with contextlib.suppress(FileNotFoundError):
                folder.rmdir()
    finally:
        with contextlib.suppress(OSError):
            store.prune()
    return left
