"""Measure the checkpoints of a store: the scalar metrics go into each group's attributes (``metrics``, with
``metrics_min_count`` and ``metrics_config_hash``), the per-class views into variables ``class_*`` (vocab)."""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import dask
import numpy as np
import pandas as pd
import xarray as xr
import zarr
from tqdm.auto import tqdm

from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.metrics import PER_CLASS, SCALARS, measure_all

INFO = ("run", "checkpoint", "global_step", "epoch", "n_params", "n_layers", "hidden_size", "eval_loss")
RECORD = ("metrics", "metrics_min_count", "metrics_config_hash")


def open_tree(store: str | Path) -> xr.DataTree:
    """The store as a lazy DataTree (``ncanalyze.store.open``)."""
    from ncanalyze.store import open as open_store

    return open_store(store)


def checkpoint_groups(tree: xr.DataTree) -> list[str]:
    """``run/checkpoint`` of every complete checkpoint group."""
    return [node.path.strip("/") for node in tree.subtree
            if node.attrs.get("complete") is True and "mean" in node.data_vars]


def is_measured(attrs: dict, min_count: int) -> bool:
    """Measured with this min_count, and since the group's statistics were last written."""
    return ("metrics" in attrs and attrs.get("metrics_min_count") == min_count
            and attrs.get("metrics_config_hash") == attrs.get("config_hash"))


def measure_store(store: str | Path, min_count: int = 1, scheduler: str | None = None, tile: int | None = None,
                  force: bool = False) -> pd.DataFrame:
    """Measure every complete checkpoint of ``store`` not yet measured with ``min_count`` (all with ``force``),
    store the results in its group, and return one row per checkpoint: run, checkpoint, global_step, epoch,
    n_params, n_layers, hidden_size, eval_loss and the 14 metrics (nan where not measurable).

    ``scheduler``: a dask.distributed scheduler address (default ``$DASK_SCHEDULER_ADDRESS``); without one the
    local threaded scheduler. ``df.attrs["measured"]`` lists the groups measured by this call.
    """
    tree = open_tree(store)
    groups = checkpoint_groups(tree)
    if not groups:
        raise UserError(f"no complete checkpoint in {store}: run `ncanalyze extract CHECKPOINTS --store {store}` first")
    attrs = {g: dict(tree[g].attrs) for g in groups}
    todo = [g for g in groups if force or not is_measured(attrs[g], min_count)]
    with _scheduler(scheduler), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for g in tqdm(todo, desc="measuring", unit="checkpoint", disable=None):
            scalars, per_class = measure_all(tree[g].to_dataset(), min_count, tile)
            attrs[g] |= write_metrics(store, g, scalars, per_class, min_count, attrs[g].get("config_hash"))
    for message in dict.fromkeys(str(w.message) for w in caught):  # once each, not once per checkpoint
        n = sum(str(w.message) == message for w in caught)
        warnings.warn(f"{message} ({n} checkpoint{'s' * (n > 1)})", stacklevel=2)
    df = pd.DataFrame([{**{k: attrs[g].get(k) for k in INFO}, **_floats(attrs[g]["metrics"])} for g in groups],
                      columns=[*INFO, *SCALARS])
    df = df.sort_values(["run", "global_step"], kind="stable", ignore_index=True)
    df.attrs["measured"] = todo
    return df


def write_metrics(store: str | Path, group: str, scalars: dict[str, float], per_class: xr.Dataset, min_count: int,
                  config_hash: str | None) -> dict:
    """Per-class arrays first, the record last, so an interrupted write is measured again; returns the record."""
    g = zarr.open_group(store, path=group, mode="r+", zarr_format=3)
    for k in RECORD:
        if k in g.attrs:
            del g.attrs[k]
    for name in PER_CLASS:
        values = per_class[name].values
        arr = g.create_array(name, shape=values.shape, dtype="float64", dimension_names=("vocab",),
                             fill_value=np.nan, overwrite=True)
        arr[:] = values
    record = {"metrics": {k: None if math.isnan(v) else v for k, v in scalars.items()},  # strict JSON: null for nan
              "metrics_min_count": min_count, "metrics_config_hash": config_hash}
    g.attrs.update(record)
    return record


def _floats(metrics: dict) -> dict[str, float]:
    return {k: math.nan if metrics.get(k) is None else float(metrics[k]) for k in SCALARS}


@contextlib.contextmanager
def _scheduler(address: str | None) -> Iterator[None]:
    """A dask.distributed client on ``address`` (or ``$DASK_SCHEDULER_ADDRESS``), else the threaded scheduler."""
    address = address or os.environ.get("DASK_SCHEDULER_ADDRESS")
    if not address:
        with dask.config.set(scheduler="threads"):
            yield
        return
    from distributed import Client

    try:
        client = Client(address, timeout="10s", set_as_default=True)
    except (OSError, TimeoutError) as e:
        raise UserError(f"cannot reach the dask scheduler at {address} ({e}); start it, or drop --scheduler / "
                        "DASK_SCHEDULER_ADDRESS to run locally") from None
    with client:
        yield
