"""Measure the checkpoints of a store: the scalar metrics go into each group's attributes (``metrics``, with
``metrics_min_count`` and ``metrics_config_hash``), the per-class views into variables ``class_*`` (vocab).
The maths is ``ncanalyze.analyzer.measure_all``; reading and writing the store is io.py."""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.metrics import measure_all
from ncanalyze.analyzer.schema import INFO, SCALARS
from ncanalyze.store.cluster import client
from ncanalyze.store.io import checkpoint_groups, open_tree, write_metrics


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
    raised: dict[tuple[type[Warning], str], list[str]] = {}  # (category, message) -> the groups that raised it
    with client(scheduler):
        for g in tqdm(todo, desc="measuring", unit="checkpoint", disable=None):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    scalars, per_class = measure_all(tree[g].to_dataset(), min_count, tile)
                except UserError as e:
                    raise UserError(f"{g}: {e}") from None
            for w in caught:
                raised.setdefault((w.category, str(w.message)), []).append(g)
            attrs[g] |= write_metrics(store, g, scalars, per_class, min_count, attrs[g].get("config_hash"))
    for (category, message), where in raised.items():  # once each, naming the checkpoints, in its own category
        warnings.warn(f"{message} ({_some(where)})", category, stacklevel=2)
    df = pd.DataFrame([{**{k: attrs[g].get(k) for k in INFO}, **_floats(attrs[g]["metrics"])} for g in groups],
                      columns=[*INFO, *SCALARS])
    df = df.sort_values(["run", "global_step"], kind="stable", ignore_index=True)
    df.attrs["measured"] = todo
    return df


def _some(groups: list[str], shown: int = 3) -> str:
    """'N checkpoint(s): a, b, c and M more'."""
    groups = sorted(groups)
    more = f" and {len(groups) - shown} more" if len(groups) > shown else ""
    return f"{len(groups)} checkpoint{'s' * (len(groups) > 1)}: " + ", ".join(groups[:shown]) + more


def _floats(metrics: dict) -> dict[str, float]:
    return {k: math.nan if metrics.get(k) is None else float(metrics[k]) for k in SCALARS}
