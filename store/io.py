"""The store: every read and write of the Zarr hierarchy goes through here, with its settings defined once.

Layout (SPEC section 3): a Zarr v3 group per checkpoint at ``<run>/<checkpoint>``, its attribute ``complete`` set
last, so a group without it is an interrupted write; `ncanalyze measure` adds the metrics to the group.
"""
from __future__ import annotations

import errno
import math
import os
import shutil
from importlib.metadata import PackageNotFoundError, version as _pkg_version
from pathlib import Path

import numpy as np
import xarray as xr
import zarr
import zarr.errors

from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.schema import PER_CLASS

ZARR = {"zarr_format": 3}                    # for zarr.open_group
XR = {"zarr_format": 3, "consolidated": False}  # for xarray: no consolidated metadata (groups are written one by one)
RECORD = ("metrics", "metrics_min_count", "metrics_config_hash")  # what `measure` writes into a group's attributes
DEFAULT = "ncanalyze.zarr"
MISSING_GROUP = (FileNotFoundError, KeyError, zarr.errors.GroupNotFoundError, zarr.errors.NodeTypeValidationError)


def version() -> str:
    """The installed package's version (recorded in every group as ``ncanalyze_version``)."""
    try:
        return _pkg_version("ncanalyze")
    except PackageNotFoundError:
        return "0+unknown"


def open_tree(path: str | Path = DEFAULT) -> xr.DataTree:
    """The whole store as a lazy ``xarray.DataTree``: one group per checkpoint at ``<run>/<checkpoint>``."""
    p = Path(path)
    if not (p / "zarr.json").is_file():
        raise UserError(f"no ncanalyze store at {p}: run `ncanalyze extract CHECKPOINTS --store {p}` first, "
                        "or pass the right path (or set NCANALYZE_STORE)")
    return xr.open_datatree(p, engine="zarr", **XR)


def checkpoint_groups(tree: xr.DataTree) -> list[str]:
    """``run/checkpoint`` of every complete checkpoint group."""
    return [node.path.strip("/") for node in tree.subtree
            if node.attrs.get("complete") is True and "mean" in node.data_vars]


def read_group(path: str | Path, group: str) -> xr.Dataset:
    """One checkpoint's dataset, lazily."""
    try:
        return xr.open_zarr(Path(path), group=group, **XR)
    except MISSING_GROUP:
        raise UserError(f"no checkpoint group {group!r} in {path}; groups are <run>/<checkpoint>, as in "
                        "metrics.csv") from None


CORRUPT = (ValueError, zarr.errors.MetadataValidationError, zarr.errors.NodeTypeValidationError)  # bad zarr.json


def group_attrs(path: str | Path, group: str, corrupt_ok: bool = False) -> dict | None:
    """The attributes of ``group`` if it exists, else None; a corrupt group is an error (None with ``corrupt_ok``,
    for a caller that will replace it)."""
    try:
        return dict(zarr.open_group(path, path=group, mode="r", **ZARR).attrs)
    except MISSING_GROUP:
        return None
    except CORRUPT as e:
        if corrupt_ok:
            return None
        raise UserError(f"the metadata of group {group} ({Path(path) / group / 'zarr.json'}) is corrupt ({e}); pass "
                        "--overwrite to extract it again") from None


def ensure_group(path: str | Path, group: str = "") -> None:
    """Make sure ``group`` (and its parents, up to the root) exists, safely when other processes do the same at once
    (checkpoints written in parallel by a cluster's workers): zarr's create-if-missing checks, then writes, and a
    writer that loses the race between the two gets ContainsGroupError; the group is there then, so it is opened.
    Metadata writes are atomic (a temporary file renamed), so no reader ever sees half a zarr.json."""
    for attempt in range(3):
        try:
            zarr.open_group(path, path=group, mode="a", **ZARR)
            return
        except zarr.errors.ContainsGroupError:
            continue  # created by another writer between zarr's check and its write: open it
    zarr.open_group(path, path=group, mode="r", **ZARR)


def prepare(path: Path, partial: Path) -> None:
    """Check, before any work, that ``path`` can hold a store and that it and ``partial`` (the resume states beside
    it) are writable; create the root group. Each failure is one line naming the fix."""
    if path.exists() and not path.is_dir():
        raise UserError(f"--store {path} is a file, not a store: pass a new path such as ncanalyze.zarr")
    if path.is_dir() and not (path / "zarr.json").exists() and any(path.iterdir()):
        raise UserError(f"--store {path} is a folder of other files, not an ncanalyze store: pass a new path such as "
                        f"{path / 'ncanalyze.zarr'}")
    if partial.exists() and not partial.is_dir():
        raise UserError(f"{partial} is a file, but ncanalyze keeps its resume states there: move it away")
    try:
        ensure_group(path)
        for d in (path, partial):
            d.mkdir(parents=True, exist_ok=True)
            probe = d / f".write-test-{os.getpid()}"
            probe.touch()
            probe.unlink()
    except CORRUPT as e:
        raise UserError(f"the store's root metadata {path / 'zarr.json'} is corrupt ({e}): restore it, or move the "
                        "store aside and extract into a new one") from None
    except (PermissionError, NotADirectoryError, FileExistsError) as e:
        raise UserError(f"cannot write the store {path} ({e.strerror}: {e.filename}): pass --store on a writable "
                        "disk, or fix its permissions") from None
    except OSError as e:
        if e.errno != errno.EROFS:
            raise
        raise UserError(f"the store {path} is on a read-only file system: pass --store on a writable disk") from None


def _encoding(ds: xr.Dataset) -> dict:
    """Chunks along vocab: ~32 MB of float64 class rows, and at most ~8 MB for each variable's chunk."""
    d = ds.sizes["hidden"]
    rows = max(1, min(ds.sizes["vocab"], (32 << 20) // (8 * d)))
    enc = {}
    for name, var in ds.data_vars.items():
        if "vocab" in var.dims:
            per_row = int(np.prod([ds.sizes[x] for x in var.dims if x != "vocab"]))
            n = max(1, min(ds.sizes["vocab"], (8 << 20) // max(1, per_row * var.dtype.itemsize)))
            enc[name] = {"chunks": tuple(min(rows, n) if x == "vocab" else ds.sizes[x] for x in var.dims)}
    return enc


def write_checkpoint(path: str | Path, group: str, ds: xr.Dataset, staging: Path) -> None:
    """Write a finished checkpoint dataset as ``group``, replacing any group there, without a moment where neither
    the old group nor the new one is whole: the new group is written at ``staging`` (a folder beside the store, on
    the same disk), marked complete, and then renamed into place; the old one is moved aside first and removed last
    (``recover_swap`` puts it back if a crash comes between the two renames). Every chunk is written, even one of
    fill values only, so that a missing chunk can be told from an empty one (``missing_chunks``)."""
    dest, old = Path(path) / group, staging.with_name(staging.name + ".old")
    shutil.rmtree(staging, ignore_errors=True)
    ds.attrs |= {"complete": False, "all_chunks": True}
    with zarr.config.set({"array.write_empty_chunks": True}):
        ds.to_zarr(staging, mode="w", encoding=_encoding(ds), **XR)
    zarr.open_group(staging, mode="r+", **ZARR).attrs["complete"] = True
    parent = group.rsplit("/", 1)[0] if "/" in group else ""
    ensure_group(path, parent)                                  # the run's group (and the root) exist
    if dest.exists():
        os.rename(dest, old)
    os.rename(staging, dest)
    shutil.rmtree(old, ignore_errors=True)


def recover_swap(path: str | Path, group: str, staging: Path) -> None:
    """After a crash between write_checkpoint's two renames: the old group back in place."""
    dest, old = Path(path) / group, staging.with_name(staging.name + ".old")
    if old.is_dir() and not dest.exists():
        os.rename(old, dest)


def missing_chunks(path: str | Path, group: str) -> list[str]:
    """The arrays of a group written with every chunk (``all_chunks``) that lack some (none for older groups)."""
    g = zarr.open_group(path, path=group, mode="r", **ZARR)
    if not g.attrs.get("all_chunks"):
        return []
    return [f"{name} ({a.nchunks - a.nchunks_initialized} of {a.nchunks} chunks)" for name, a in g.arrays()
            if a.nchunks_initialized < a.nchunks]


def write_metrics(path: str | Path, group: str, scalars: dict[str, float], per_class: xr.Dataset, min_count: int,
                  config_hash: str | None) -> dict:
    """Store a checkpoint's metrics: the per-class arrays first, the record (``RECORD``) last, so an interrupted
    write is measured again; returns the record. nan is stored as null (strict JSON)."""
    g = zarr.open_group(path, path=group, mode="r+", **ZARR)
    for k in RECORD:
        if k in g.attrs:
            del g.attrs[k]
    for name in PER_CLASS:
        values = per_class[name].values
        arr = g.create_array(name, shape=values.shape, dtype="float64", dimension_names=("vocab",),
                             fill_value=np.nan, overwrite=True)
        arr[:] = values
    record = {"metrics": {k: None if math.isnan(v) else v for k, v in scalars.items()},
              "metrics_min_count": min_count, "metrics_config_hash": config_hash}
    g.attrs.update(record)
    return record
