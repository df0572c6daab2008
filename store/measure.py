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
from ncanalyze.analyzer.metrics import DEFINITIONS, measure_all
from ncanalyze.analyzer.schema import INFO, LAYER, SCALARS
from ncanalyze.store.cluster import client
from ncanalyze.store.io import checkpoint_groups, group_attrs, open_tree, read_statistics, write_metrics


ALWAYS = tuple(k for k, f in DEFINITIONS.items() if not hasattr(f, "needs"))  # recorded for every measured group


def is_measured(attrs: dict, min_count: int) -> bool:
    """Measured with this min_count, since the group's statistics were last written, and with every metric that
    any checkpoint has (a group measured before the geometry metrics existed is measured again)."""
    return ("metrics" in attrs and set(ALWAYS) <= set(attrs["metrics"]) and attrs.get("metrics_min_count") == min_count
            and attrs.get("metrics_config_hash") == attrs.get("config_hash"))


def measure_store(store: str | Path, min_count: int = 1, scheduler: str | None = None, tile: int | None = None,
                  force: bool = False) -> pd.DataFrame:
    """Measure every complete checkpoint of ``store`` not yet measured with ``min_count`` (all with ``force``),
    store the results in its group, and return one row per measured checkpoint and stored layer: run, checkpoint,
    global_step, epoch, n_params, n_layers, hidden_size, eval_loss, ..., layer (a checkpoint group is its last layer,
    n_layers; its ``layers/<l>`` groups are the others) and the 14 metrics (nan where not measurable).

    A checkpoint that can't be measured (corrupt or missing data, fewer than 2 kept classes, ...) is left out with a
    warning naming it and the fix; the others go on. ``df.attrs["measured"]`` lists the groups measured by this
    call, ``df.attrs["skipped"]`` maps each left-out group to why. ``scheduler``: a dask.distributed scheduler
    address (default ``$DASK_SCHEDULER_ADDRESS``); without one the local threaded scheduler.
    """
    if not (Path(store) / "zarr.json").is_file():
        open_tree(store)  # the one-line error for a path that is not a store
    groups, skipped = checkpoint_groups(store)
    attrs = {g: group_attrs(store, g) for g in groups}
    todo = [g for g in groups if force or not is_measured(attrs[g], min_count)]
    raised: dict[tuple[type[Warning], str], list[str]] = {}  # (category, message) -> the groups that raised it
    with client(scheduler):
        for g in tqdm(todo, desc="measuring", unit="checkpoint", disable=None):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    scalars, per_class = measure_all(read_statistics(store, g), min_count, tile)
                except UserError as e:
                    skipped[g] = str(e).removeprefix(f"{g} ")
                    continue
            for w in caught:
                raised.setdefault((w.category, str(w.message)), []).append(g)
            attrs[g] |= write_metrics(store, g, scalars, per_class, min_count, attrs[g].get("config_hash"))
    for (category, message), where in raised.items():  # once each, naming the checkpoints, in its own category
        warnings.warn(f"{message} ({_some(where)})", category, stacklevel=2)
    for g, why in skipped.items():
        warnings.warn(f"{g}: skipped: {why}", SkippedCheckpoint, stacklevel=2)
    kept = [g for g in groups if g not in skipped]
    if not kept:
        raise UserError(f"no checkpoint in {store} can be measured ({len(skipped)} skipped, see above)" if skipped else
                        f"no complete checkpoint in {store}: run `ncanalyze extract CHECKPOINTS --store {store}` first")
    df = pd.DataFrame([{**{k: attrs[g].get(k) for k in INFO}, LAYER: attrs[g].get(LAYER, attrs[g].get("n_layers")),
                        **_floats(attrs[g])} for g in kept], columns=[*INFO, LAYER, *SCALARS])
    df = df.fillna(math.nan)  # an attribute absent or null (tag, val_loss) is nan, as in metrics.csv read back
    df = df.sort_values(["run", "global_step", LAYER], kind="stable", ignore_index=True)
    df.attrs["measured"] = [g for g in todo if g not in skipped]
    df.attrs["skipped"] = skipped
    return df


class SkippedCheckpoint(UserWarning):
    """A checkpoint left out of a measurement or report, with why."""


def _some(groups: list[str], shown: int = 3) -> str:
    """'N checkpoint(s): a, b, c and M more'."""
    groups = sorted(groups)
    more = f" and {len(groups) - shown} more" if len(groups) > shown else ""
    return f"{len(groups)} checkpoint{'s' * (len(groups) > 1)}: " + ", ".join(groups[:shown]) + more


def _floats(attrs: dict) -> dict[str, float]:
    """The metrics of a group's record as floats (a null is the value in ``metrics_nonfinite``, else nan)."""
    metrics, nonfinite = attrs.get("metrics") or {}, attrs.get("metrics_nonfinite") or {}
    return {k: float(nonfinite.get(k, "nan")) if metrics.get(k) is None else float(metrics[k]) for k in SCALARS}
