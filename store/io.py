"""The store: every read and write of the Zarr hierarchy goes through here, with its settings defined once.

Layout (SPEC section 3): a Zarr v3 group per checkpoint at ``<run>/<checkpoint>``, its attribute ``complete`` set
last, so a group without it is an interrupted write; `ncanalyze measure` adds the metrics to the group. Layers other
than the last (``--layers``) are groups of the same schema at ``<run>/<checkpoint>/layers/<l>``, written before the
checkpoint is marked complete.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
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
    """``run/checkpoint`` of every complete checkpoint group, and ``run/checkpoint/layers/<l>`` of its layer groups."""
    return [node.path.strip("/") for node in tree.subtree
            if node.attrs.get("complete") is True and "mean" in node.data_vars
            and not _in_unfinished_checkpoint(node)]


def _in_unfinished_checkpoint(node: xr.DataTree) -> bool:
    """A layer group (``<checkpoint>/layers/<l>``) whose checkpoint group is not (yet) complete."""
    ckpt = node.parent.parent if node.parent is not None and node.parent.name == "layers" else None
    return ckpt is not None and "mean" in ckpt.data_vars and ckpt.attrs.get("complete") is not True


def read_group(path: str | Path, group: str) -> xr.Dataset:
    """One checkpoint's dataset, lazily."""
    try:
        return xr.open_zarr(Path(path), group=group, **XR)
    except MISSING_GROUP:
        raise UserError(f"no checkpoint group {group!r} in {path}; groups are <run>/<checkpoint>, as in "
                        "metrics.csv") from None


def group_attrs(path: str | Path, group: str) -> dict | None:
    """The attributes of ``group`` if it exists, else None."""
    try:
        return dict(zarr.open_group(path, path=group, mode="r", **ZARR).attrs)
    except MISSING_GROUP:
        return None


def create(path: str | Path) -> None:
    """The root group, so that the store opens even before its first checkpoint is written."""
    zarr.open_group(path, mode="a", **ZARR)


def position_chunk(n: int, row_bytes: int) -> int:
    """Rows per chunk along ``position`` (saved embeddings): ~32 MB."""
    return max(1, min(n, (32 << 20) // max(1, row_bytes)))


def _encoding(ds: xr.Dataset) -> dict:
    """Chunks along vocab: ~32 MB of float64 class rows, and at most ~8 MB for each variable's chunk; along
    position (saved embeddings) ~32 MB."""
    d = ds.sizes["hidden"]
    rows = max(1, min(ds.sizes["vocab"], (32 << 20) // (8 * d)))
    enc = {}
    for name, var in ds.data_vars.items():
        if "vocab" in var.dims:
            per_row = int(np.prod([ds.sizes[x] for x in var.dims if x != "vocab"]))
            n = max(1, min(ds.sizes["vocab"], (8 << 20) // max(1, per_row * var.dtype.itemsize)))
            enc[name] = {"chunks": tuple(min(rows, n) if x == "vocab" else ds.sizes[x] for x in var.dims)}
        elif "position" in var.dims:
            n = position_chunk(ds.sizes["position"], int(np.prod([ds.sizes[x] for x in var.dims if x != "position"]))
                               * var.dtype.itemsize)
            enc[name] = {"chunks": tuple(n if x == "position" else ds.sizes[x] for x in var.dims)}
    return enc


def write_checkpoint(path: str | Path, group: str, ds: xr.Dataset,
                     layers: Iterable[tuple[int, xr.Dataset]] = ()) -> None:
    """Write a finished checkpoint dataset, then its other ``layers`` ((l, dataset), written one at a time at
    ``<group>/layers/<l>``), then mark the group complete: an interrupted write is never taken as done."""
    ds.attrs["complete"] = False
    ds.to_zarr(path, group=group, mode="w", encoding=_encoding(ds), **XR)  # mode "w" drops old layer groups too
    for layer, lds in layers:
        write_checkpoint(path, f"{group}/layers/{layer}", lds)
    zarr.open_group(path, path=group, mode="r+", **ZARR).attrs["complete"] = True


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
