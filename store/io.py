"""The store: every read and write of the Zarr hierarchy goes through here, with its settings defined once.

Layout (SPEC section 3): a Zarr v3 group per checkpoint at ``<run>/<checkpoint>``, its attribute ``complete`` set
last, so a group without it is an interrupted write; `ncanalyze measure` adds the metrics to the group. Layers other
than the last (``--layers``) are groups of the same schema at ``<run>/<checkpoint>/layers/<l>``, written before the
checkpoint is marked complete, except the classifier: stored once, in the checkpoint group (classifier.py).
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _pkg_version
from pathlib import Path

import numpy as np
import xarray as xr
import zarr
import zarr.errors
from ncanalyze.analyzer.jackknife import FOLD_VARS, fold_problems
from ncanalyze.analyzer.schema import HEAD, MEASURED, METRICS_VERSION, PER_CLASS, VAL_COUNTS, vocabulary_classes
from ncanalyze.core.errors import UserError
from ncanalyze.store import classifier
from ncanalyze.store.chunks import chunks
from ncanalyze.store.layout import CheckpointFiles, default_store, group_order, probe_writable

ZARR = {"zarr_format": 3}                    # for zarr.open_group
XR = {"zarr_format": 3, "consolidated": False}  # for xarray: no consolidated metadata (groups are written one by one)
# what `measure` writes into a group's attributes; strict JSON, so a metric that is not finite is null in
# `metrics` and its value ("inf", "-inf", "nan") is in `metrics_nonfinite`
# the store's format, a root attribute written when the root is created. 2: every group records its layer and lens,
# the configuration record every hashed setting, a resume state every layer under its name (1: stop 27's stores);
# 3: the record identifies the data by content (data_sha256) and names local data by its file's name, not its path; fold sums (the fold
# dimension, attribute folds) beside the totals, for the jackknife errors
FORMAT_KEY, FORMAT = "ncanalyze_format", 3
RECORD = ("metrics", "metrics_nonfinite", "metrics_min_count", "metrics_config_hash", "metrics_version",
          "metrics_se_method", "metrics_se_sampling_error")
CHUNK_ERRORS = (RuntimeError, ValueError, OSError)  # what a garbage, truncated or bit-flipped chunk raises on read
MISSING_GROUP = (FileNotFoundError, KeyError, zarr.errors.GroupNotFoundError, zarr.errors.NodeTypeValidationError)
STATISTICS = ("count", "mean", "variance", "within_covariance")  # every checkpoint group holds them
FROM_MODEL = (HEAD[0], *VAL_COUNTS)  # and one extracted from a model (it records vocab_size) these, its head's once
NESTED_FIX = "move it out of the store (measure it as a store of its own), or remove it (ncanalyze rm)"
FIX = "extract it again (ncanalyze extract ... --overwrite) or remove it (ncanalyze rm)"


class CorruptMetadata(ValueError):
    """A zarr.json that is not Zarr metadata: truncated, not JSON, or JSON that is not an object naming a node."""


def metadata_problem(file: Path) -> str | None:
    """Why ``file`` (a ``zarr.json``) is not Zarr metadata, or None; read with json before zarr parses it, so that
    every kind of damage (a truncated write, ``null``, ``[]``) is one reason, never a zarr or Python traceback."""
    try:
        meta = json.loads(Path(file).read_bytes())
    except FileNotFoundError:
        return None  # absent: not a node (the caller says what that means)
    except (OSError, ValueError) as e:
        return f"not JSON: {e}"
    if not isinstance(meta, dict) or meta.get("node_type") not in ("group", "array"):
        return f"JSON {json.dumps(meta)[:40]}, not an object naming its node_type"
    if not isinstance(meta.get("attributes", {}), (dict, type(None))):
        return f"its attributes are JSON {json.dumps(meta['attributes'])[:40]}, not an object"
    return None


def open_group(path: str | Path, group: str = "", mode: str = "r") -> zarr.Group:
    """``zarr.open_group`` with this store's settings, its zarr.json checked first (:func:`metadata_problem`): a
    damaged one raises :class:`CorruptMetadata` (one of ``CORRUPT``), a missing group one of ``MISSING_GROUP``."""
    problem = metadata_problem(Path(path) / group / "zarr.json")
    if problem:
        raise CorruptMetadata(problem)
    return zarr.open_group(path, path=group, mode=mode, **ZARR)


def version() -> str:
    """The installed package's version (recorded in every group as ``ncanalyze_version``).

    Returns
    -------
    str
        The version, or ``0+unknown`` where the package is not installed.
    """
    try:
        return _pkg_version("ncanalyze")
    except PackageNotFoundError:
        return "0+unknown"


def open_tree(path: str | Path | None = None) -> xr.DataTree:
    """The whole store as a lazy ``xarray.DataTree``: one group per checkpoint at ``<run>/<checkpoint>``, in study
    order (:func:`group_order`), every variable a dask array chunked as its Zarr array, so that opening reads
    metadata only and work on it is out-of-core.

    Parameters
    ----------
    path
        The store [default: ``$NCANALYZE_STORE``, else ``./ncanalyze.zarr``].

    Returns
    -------
    xarray.DataTree
        The store's groups, lazily.
    """
    p = Path(path if path is not None else default_store())
    if not (p / "zarr.json").is_file():
        raise UserError(f"no ncanalyze store at {p}: run `ncanalyze extract CHECKPOINTS --store {p}` first, "
                        "or pass the right path (or set NCANALYZE_STORE)")
    check_format(p)
    with warnings.catch_warnings():  # zarr names the folder of groups being moved in a store on its own mount point
        warnings.filterwarnings("ignore", message="Object at .ncanalyze.partial is not recognized")
        tree = xr.open_datatree(p, engine="zarr", chunks={}, **XR)  # dask arrays in the Zarr chunks: nothing read yet
    for node in [n for n in tree.subtree if n is not tree and FORMAT_KEY in n.attrs]:  # a store nested in this one
        warnings.warn(f"{node.path.strip('/')}: a store nested in {p}, not read as groups of it: {NESTED_FIX}",
                      stacklevel=2)
        if node.parent is not None:
            node.parent.children = {k: v for k, v in node.parent.children.items() if v is not node}
    steps = {node.path.strip("/"): node.attrs.get("global_step") for node in tree.subtree}
    for node in [n for n in tree.subtree if len(n.children) > 1]:  # runs, checkpoints and layers in study order
        node.children = dict(sorted(node.children.items(), key=lambda kv: group_order(kv[1].path.strip("/"), steps)))
    return classifier.attach(tree)  # each layer node with its checkpoint's head (stored once), lazily


def checkpoint_groups(path: str | Path) -> tuple[list[str], dict[str, str]]:
    """The complete checkpoint groups (``run/checkpoint``, and its layer groups ``run/checkpoint/layers/<l>``), and
    the groups whose metadata cannot be read, with why. Group by group, so one corrupt group hides no other.

    In study order (:func:`group_order`): runs by name, a run's checkpoints by ``global_step``, each checkpoint
    followed by its layer groups by index.

    Parameters
    ----------
    path
        The store.

    Returns
    -------
    tuple
        (complete groups, {group: why} for the unreadable ones).
    """
    root, good, bad, steps = Path(path), [], {}, {}
    check_format(root)
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))  # .ncanalyze.partial: groups being moved (layout.py)
        rel = Path(d).relative_to(root).as_posix()
        if "zarr.json" not in files or rel == ".":
            continue
        try:
            g = open_group(root, rel)
        except (zarr.errors.ContainsArrayError, zarr.errors.NodeTypeValidationError):  # an array: no group below
            dirs[:] = []
            continue
        except CORRUPT as e:
            bad[rel] = f"its metadata {Path(d) / 'zarr.json'} is corrupt ({e}): {FIX}"
            dirs[:] = []
            continue
        checkpoint = "mean" in dirs or "count" in dirs or g.attrs.get("complete") is not None
        if FORMAT_KEY in g.attrs:  # a store's root, nested in this one (copied in): never read as this store's groups
            bad[rel] = f"a store nested in this store (its own {FORMAT_KEY}), not read as groups of it: {NESTED_FIX}"
            dirs[:] = []
        elif checkpoint and not _checkpoint_depth(rel):
            bad[rel] = f"a checkpoint group at {rel}, not at <run>/<checkpoint>: {NESTED_FIX}"
            dirs[:] = []
        elif checkpoint and g.attrs.get("complete") is not True:
            dirs[:] = []  # not finished (ncanalyze moves a group in whole; this one is not its): nor its layer groups
        elif checkpoint and _bad_attrs(g.attrs):
            bad[rel] = f"{_bad_attrs(g.attrs)}: {FIX}"
            dirs[:] = []
        elif checkpoint:
            good.append(rel)
            steps[rel] = g.attrs.get("global_step")
    return sorted(good, key=lambda rel: group_order(rel, steps)), bad


def _checkpoint_depth(rel: str) -> bool:
    """Whether a checkpoint group at ``rel`` is where a store keeps one: ``<run>/<checkpoint>`` or its layer
    ``<run>/<checkpoint>/layers/<l>``, or its sublayer site ``<run>/<checkpoint>/sites/<kind>_<B>``."""
    parts = rel.split("/")
    return len(parts) == 2 or len(parts) == 4 and parts[2] in (classifier.LAYERS, classifier.SITES)


def _bad_attrs(attrs) -> str | None:
    """What is wrong with a complete group's descriptive attributes (the metrics table sorts and plots them): a
    ``global_step`` or ``epoch`` that is not a number (or null), or None."""
    for key in ("global_step", "epoch"):
        value = attrs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"its attribute {key} is {json.dumps(value)[:40]}, not a number"
    return None


def read_group(path: str | Path, group: str, **kwargs) -> xr.Dataset:
    """One group's dataset, lazily; a layer group's with its checkpoint's classifier, stored once (classifier.py).

    Parameters
    ----------
    path, group
        The store and the group (``<run>/<checkpoint>``, or a layer group ``<run>/<checkpoint>/layers/<l>``).
    kwargs
        ``xarray.open_zarr``'s (``chunks``).

    Returns
    -------
    xarray.Dataset
        Its variables, lazily.
    """
    try:
        ds = xr.open_zarr(Path(path), group=group, **XR, **kwargs)
        owner = classifier.checkpoint_group(group)
        if owner != group:
            ds = classifier.with_head(ds, xr.open_zarr(Path(path), group=owner, **XR, **kwargs))
        return ds
    except MISSING_GROUP:
        raise UserError(f"no checkpoint group {group!r} in {path}; groups are <run>/<checkpoint>, as in "
                        "metrics.csv") from None


def read_statistics(path: str | Path, group: str, head: xr.Dataset | None = None) -> xr.Dataset:
    """The variables of a group that the metrics read (schema.MEASURED), loaded (a layer group's with its
    checkpoint's classifier); a UserError naming the group and the fix if any of its data is missing or corrupt.

    Parameters
    ----------
    path, group
        The store and the group.
    head
        The checkpoint's head (schema.HEAD) already loaded, for a layer group that refers to it: used instead of
        reading it again (``measure`` reads a checkpoint's head once for all its layers).

    Returns
    -------
    xarray.Dataset
        The measured variables, in memory.
    """
    owner = classifier.checkpoint_group(group)
    fix = f"extract it again (ncanalyze extract ... --overwrite) or remove {Path(path) / owner}"  # the checkpoint
    try:
        problems = damage(path, group)
        shared = owner != group  # a layer group: the head is its checkpoint's, stored once
        if shared and head is None and not problems:
            problems = [p.replace("(", f"({owner}'s ", 1) for p in damage(path, owner, HEAD)]
    except CORRUPT as e:
        problems = [f"has corrupt metadata ({e})"]
    except MISSING_GROUP:
        raise UserError(f"no checkpoint group {group!r} in {path}: it was removed (ncanalyze rm?)") from None
    if problems:
        raise UserError(f"{group} {'; '.join(problems)}: {fix}")
    ds = read_group(path, group, chunks=None)  # read straight into one array each (through dask: twice the memory)
    if shared and head is not None:
        ds = ds.assign_coords({h: head[h].variable for h in HEAD if h in head.variables})
    try:
        ds = ds[[v for v in (*MEASURED, *FOLD_VARS) if v in ds]].load()
    except CHUNK_ERRORS as e:
        raise UserError(f"{group} holds corrupt data ({type(e).__name__}: {e}): {fix}") from None
    damaged = fold_problems(ds)
    if damaged:  # a forged fold or a block counted twice: neither its errors nor its totals can be trusted
        raise UserError(f"{group} is damaged: its fold sums do not add up to its totals ({'; '.join(damaged)}): {fix}")
    return ds


CORRUPT = (ValueError, zarr.errors.MetadataValidationError, zarr.errors.NodeTypeValidationError)  # bad zarr.json


def group_attrs(path: str | Path, group: str, corrupt_ok: bool = False) -> dict | None:
    """The attributes of ``group`` if it exists, else None; a corrupt group is an error (None with ``corrupt_ok``,
    for a caller that will replace it).

    Parameters
    ----------
    path, group
        The store and the group.
    corrupt_ok
        A corrupt group reads as absent.

    Returns
    -------
    dict or None
        Its attributes.
    """
    try:
        return dict(open_group(path, group).attrs)
    except MISSING_GROUP:
        return None
    except CORRUPT as e:
        if corrupt_ok:
            return None
        raise UserError(f"the metadata of group {group} ({Path(path) / group / 'zarr.json'}) is corrupt ({e}); pass "
                        "--overwrite to extract it again") from None


def check_format(path: str | Path) -> None:
    """A one-line UserError unless the store at ``path`` is of this version's :data:`FORMAT` (its root attribute
    ``ncanalyze_format``); a path without a store, or a root that cannot be read, is left to the caller.

    Parameters
    ----------
    path
        The store.
    """
    try:
        found = zarr.open_group(path, mode="r", **ZARR).attrs.get(FORMAT_KEY)
    except (*MISSING_GROUP, *CORRUPT):
        return
    if found != FORMAT:
        when = "before ncanalyze versioned its stores" if found is None else f"in store format {found!r}"
        raise UserError(f"the store {path} was written {when}, and this ncanalyze {version()} reads format {FORMAT} "
                        "only: extract again into a new store (--store NEW.zarr); stores are not migrated before 1.0")


def ensure_group(path: str | Path, group: str = "") -> None:
    """Make sure ``group`` (and its parents, up to the root) exists, safely when other processes do the same at once
    (checkpoints written in parallel by a cluster's workers): zarr's create-if-missing checks, then writes, and a
    writer that loses the race between the two gets ContainsGroupError; the group is there then, so it is opened.
    Metadata writes are atomic (a temporary file renamed), so no reader ever sees half a zarr.json.

    Parameters
    ----------
    path
        The store.
    group
        The group ("" for the root).
    """
    for where, attrs in (("", {FORMAT_KEY: FORMAT}), (group, {})):  # the root first, its format in the same write
        for attempt in range(3):
            try:
                zarr.open_group(path, path=where, mode="a", attributes=attrs, **ZARR)
                break
            except zarr.errors.ContainsGroupError:
                continue  # created by another writer between zarr's check and its write: open it
        zarr.open_group(path, path=where, mode="r", **ZARR)


def prepare(path: Path, partial: Path) -> None:
    """Check, before any work, that ``path`` can hold a store and that it and ``partial`` (the resume states beside
    it) can be written, creating neither: the store appears with its first checkpoint (:func:`write_checkpoint`),
    ``partial`` with the first lock, so a command that fails leaves no empty store. Each failure is one line naming
    the fix.

    Parameters
    ----------
    path
        The store.
    partial
        The folder of work in progress beside it (``StoreLayout.partial``).
    """
    if path.is_symlink() and not path.exists():  # dangling, or a loop: nothing could be written through it
        raise UserError(f"--store {path} is a symbolic link to {os.readlink(path)}, which does not lead to a folder "
                        "(dangling, or a loop): pass the store's real path, or a new one")
    if path.exists() and not path.is_dir():
        raise UserError(f"--store {path} is a file, not a store: pass a new path such as ncanalyze.zarr")
    if path.is_dir() and not (path / "zarr.json").exists() and any(path.iterdir()):
        raise UserError(f"--store {path} is a folder of other files, not an ncanalyze store: pass a new path such as "
                        f"{path / 'ncanalyze.zarr'}")
    if partial.exists() and not partial.is_dir():
        raise UserError(f"{partial} is a file, but ncanalyze keeps its resume states there: move it away")
    try:
        if (path / "zarr.json").exists():
            zarr.open_group(path, mode="r", **ZARR)
            check_format(path)
        for d in (path, partial):
            probe_writable(d)
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
    """chunks.py's chunk shapes; zstd with its frame checksum: a flipped bit in a chunk is an error on read, never a
    wrong number. Level 1, not zstd's default 3: float64 statistics compress alike at both, and level 1 writes faster
    (a callback-sized group, fold sums of 8 x 8,192 x 128, in 0.17-0.24 s against 0.27-0.34 s in one unrecorded run)."""
    return {name: {**enc, "compressors": [zarr.codecs.ZstdCodec(level=1, checksum=True)]}
            for name, enc in chunks(ds).items()}


def write_checkpoint(path: str | Path, group: str, ds: xr.Dataset, files: CheckpointFiles,
                     layers: Iterable[tuple[str, xr.Dataset]] = ()) -> None:
    """Write a finished checkpoint dataset as ``group``, replacing any group there, without a moment where neither
    the old group nor the new one is whole: the new group is written at ``files.staging`` (a folder on the store's own
    file system: beside it, or in it where it is a mount point, layout.py), marked complete, and then renamed into place; the old one is moved aside (``files.old``) first
    and removed last (``recover_swap`` puts it back if a crash comes between the two renames). The other ``layers``
    ((path, dataset), made one at a time; path ``layers/<l>`` or ``sites/<kind>_<B>``) go into the staged group first, so they arrive with it,
    without the classifier, which is written once, as coordinates of the checkpoint group (classifier.py). Every
    chunk is written, even one of fill values only, so that a missing chunk can be told from an empty one.

    Parameters
    ----------
    path
        The store.
    group
        The checkpoint's group, ``<run>/<checkpoint>``.
    ds
        The checkpoint's dataset (the last layer).
    files
        The checkpoint's files beside the store (layout.py): where it is staged and the old group moved aside.
    layers
        The other sites' datasets, as (their path below the checkpoint group, dataset).
    """
    dest, staging, old = Path(path) / group, files.staging, files.old
    shutil.rmtree(staging, ignore_errors=True)
    ds.attrs |= {"complete": False}
    with zarr.config.set({"array.write_empty_chunks": True}):
        ds = classifier.on_checkpoint(ds)  # the head once, as coordinates the layer groups inherit
        ds.to_zarr(staging, mode="w", encoding=_encoding(ds), **XR)
        for sub, lds in layers:
            lds = classifier.without_head(lds)
            lds.attrs |= {"complete": True}
            lds.to_zarr(staging, group=sub, mode="w", encoding=_encoding(lds), **XR)
    zarr.open_group(staging, mode="r+", **ZARR).attrs["complete"] = True
    parent = group.rsplit("/", 1)[0] if "/" in group else ""
    ensure_group(path, parent)                                  # the run's group (and the root) exist
    if dest.exists():
        os.rename(dest, old)
    os.rename(staging, dest)
    shutil.rmtree(old, ignore_errors=True)
    files.tidy()


def write_rate(sample: np.ndarray, folder: Path) -> float | None:
    """Bytes per second at which a group's (vocab x hidden) ``sample`` is written the way :func:`write_checkpoint`
    writes (chunks, zstd with checksums, to disk), timed in a scratch folder under ``folder`` that is removed after
    (and, left by a killed run, an hour later); None where it can't be written (a full disk: the write will say).

    Parameters
    ----------
    sample
        A slice of a group's (vocab x hidden) float64 array.
    folder
        Where to write it (``StoreLayout.partial``).

    Returns
    -------
    float or None
        Bytes per second.
    """
    for stale in folder.glob(".write-rate-*"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".write-rate-"))
    except OSError:
        return None
    try:
        ds = xr.Dataset({"mean": (("vocab", "hidden"), sample)})
        t0 = time.perf_counter()
        ds.to_zarr(tmp / "g", mode="w", encoding=_encoding(ds), **XR)
        return sample.nbytes / max(time.perf_counter() - t0, 1e-6)
    except OSError:
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def recover_swap(path: str | Path, group: str, files: CheckpointFiles) -> None:
    """After a crash between write_checkpoint's two renames: the old group (at ``files.old``) back in place.

    Parameters
    ----------
    path, group
        The store and the group.
    files
        The checkpoint's files beside the store (layout.py).
    """
    dest, old = Path(path) / group, files.old
    if old.is_dir() and not dest.exists():
        os.rename(old, dest)


def damage(path: str | Path, group: str, only: Iterable[str] | None = None) -> list[str]:
    """What is wrong with a complete group's arrays, from metadata only, as phrases after its name (``lacks data chunks
    (mean (1 of 4 chunks))``): an array whose zarr.json is damaged, an array every such group holds that is missing
    (``STATISTICS``; ``FROM_MODEL`` where it records ``vocab_size``, the classifier in its checkpoint group), data
    chunks missing (:func:`missing_chunks`). ``ls`` and ``measure`` both ask here.

    Parameters
    ----------
    path, group
        The store and the group.
    only
        Look at these arrays only (a layer group's read of its checkpoint's head).

    Returns
    -------
    list of str
        The problems; none for a whole group.
    """
    root = Path(path) / group
    names = [d.name for d in sorted(root.iterdir()) if (d / "zarr.json").is_file() and d.name not in (classifier.LAYERS, classifier.SITES)
             and (only is None or d.name in only)]
    corrupt = [f"{n}/zarr.json: {why}" for n in names for why in [metadata_problem(root / n / "zarr.json")] if why]
    if corrupt:
        return [f"has corrupt array metadata ({'; '.join(corrupt[:3])})"]
    g = open_group(path, group)
    own = group == classifier.checkpoint_group(group)
    head = "vocab_size" in g.attrs and vocabulary_classes(g.attrs)  # a label file's classes have no head
    need = [*STATISTICS, *(n for n in FROM_MODEL if head and (own or n not in HEAD))]
    lacking = [n for n in need if n not in names and (only is None or n in only)]
    problems = [f"lacks the array{'s' * (len(lacking) > 1)} ({', '.join(lacking)})"] if lacking else []
    short = missing_chunks(path, group, only)
    return problems + ([f"lacks data chunks ({', '.join(short[:3])})"] if short else [])


def missing_chunks(path: str | Path, group: str, only: Iterable[str] | None = None) -> list[str]:
    """The arrays of a group that lack chunks (ncanalyze writes every chunk, even one of fill values only).

    Parameters
    ----------
    path, group
        The store and the group.

    Returns
    -------
    list of str
        ``name (missing of all chunks)`` for each array that lacks chunks.
    """
    g = open_group(path, group)
    return [f"{name} ({a.nchunks - a.nchunks_initialized} of {a.nchunks} chunks)" for name, a in g.arrays()
            if (only is None or name in only) and a.nchunks_initialized < a.nchunks]


def write_metrics(path: str | Path, group: str, scalars: dict[str, float], per_class: xr.Dataset, min_count: int,
                  config_hash: str | None) -> dict:
    """Store a checkpoint's metrics: the per-class arrays first, the record (``RECORD``) last, so an interrupted
    write is measured again; returns the record.

    Parameters
    ----------
    path, group
        The store and the group.
    scalars
        The scalar metrics.
    per_class
        The per-class metrics (schema.PER_CLASS); their attributes ``se_method`` and ``se_sampling_error`` (how the
        errors were made, metrics.measure_all) go into the record as ``metrics_se_method`` and
        ``metrics_se_sampling_error``.
    min_count
        The ``--min-count`` they were measured with.
    config_hash
        The group's configuration hash when measured.

    Returns
    -------
    dict
        The record written into the group's attributes.
    """
    g = zarr.open_group(path, path=group, mode="r+", **ZARR)
    for k in RECORD:
        if k in g.attrs:
            del g.attrs[k]
    with zarr.config.set({"array.write_empty_chunks": True}):
        for name in PER_CLASS:
            values = per_class[name].values
            arr = g.create_array(name, shape=values.shape, dtype="float64", dimension_names=("vocab",),
                                 fill_value=np.nan, overwrite=True)
            arr[:] = values
    record = {"metrics": {k: v if math.isfinite(v) else None for k, v in scalars.items()},
              "metrics_nonfinite": {k: str(v) for k, v in scalars.items() if not math.isfinite(v)},
              "metrics_min_count": min_count, "metrics_config_hash": config_hash, "metrics_version": METRICS_VERSION}
    for k in ("se_method", "se_sampling_error"):  # how the errors were made (analyzer.jackknife), where they were
        if k in per_class.attrs:
            record[f"metrics_{k}"] = per_class.attrs[k]
    g.attrs.update(record)
    return record
