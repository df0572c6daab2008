"""The metrics table (SPEC section 5, ``metrics.csv``) from the checkpoint groups' attributes: one row per checkpoint
and stored layer, the descriptive columns (``INFO``), ``layer``, then the scalar metrics. Pure: attributes in, a
DataFrame out; the store (``ncanalyze.store.measure``) and the accessor (``tree.nc.table()``) both build it here, and
whether a group's stored record is current (:func:`is_measured`: measure's skip, the report's token budget)."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from ncanalyze.analyzer.schema import (CLASS_AXIS, CLASS_COUNTS, ERRORS, INFO, LABELS, LAYER, METRICS_VERSION,
                                      NEXT_TOKEN, SCALARS, SITE, class_axis)

COLUMNS = (*INFO, LAYER, SITE, LABELS, CLASS_AXIS, *CLASS_COUNTS, *SCALARS, *ERRORS)


def is_measured(attrs: Mapping[str, Any], min_count: int | None, errors: bool = False) -> bool:
    """Measured with this min_count, since the group's statistics were last written, under this version's metric
    definitions (``schema.METRICS_VERSION``: a group measured under other definitions is measured again), with
    every metric there is (a group measured before a metric was added is measured again: no version to bump), and with
    ``errors``, with its metrics' jackknife errors too (a record made without them, as the training callback's live
    metrics are, is measured again to add them)."""
    return ("metrics" in attrs and attrs.get("metrics_version") == METRICS_VERSION
            and set(SCALARS) <= set(attrs["metrics"] or {})
            and attrs.get("metrics_min_count") == min_count
            and attrs.get("metrics_config_hash") == attrs.get("config_hash")
            and (not errors or "metrics_se_method" in attrs))


def metrics_row(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """One group's row: its descriptive attributes, its layer and site (:func:`where`), its labels (``next`` where none
    are recorded) and what its class axis holds (:func:`~ncanalyze.analyzer.schema.class_axis`), how many classes the metrics rest on (``CLASS_COUNTS``, nan where not measured) and its metrics
    as floats (a null metric is its value in ``metrics_nonfinite``, else nan).

    Parameters
    ----------
    attrs
        The group's attributes, as ``measure`` wrote them (``metrics``, ``metrics_nonfinite``).

    Returns
    -------
    dict
        Column name -> value, for every name in :data:`COLUMNS`.
    """
    metrics, nonfinite = attrs.get("metrics") or {}, attrs.get("metrics_nonfinite") or {}
    floats = {k: float(nonfinite.get(k, "nan")) if metrics.get(k) is None else float(metrics[k])
              for k in (*CLASS_COUNTS, *SCALARS, *ERRORS)}
    info = {k: attrs.get(k) for k in INFO}
    info["global_step"] = _step(info.get("global_step"))
    return {**info, **where(attrs), LABELS: attrs.get(LABELS, NEXT_TOKEN), CLASS_AXIS: class_axis(attrs), **floats}


def where(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """A group's ``layer`` and ``site``: a checkpoint group without ``layer`` is its last, ``n_layers``; a layer group
    is ``resid:<layer>``; a sublayer site's group (attribute ``site``, ``attn:B``) is at layer ``block + 0.5``."""
    if attrs.get(SITE) is not None:
        block = attrs.get("block")
        return {LAYER: block + 0.5 if isinstance(block, (int, float)) else math.nan, SITE: attrs[SITE]}
    layer = attrs.get(LAYER, attrs.get("n_layers"))
    return {LAYER: layer, SITE: None if layer is None else f"resid:{layer}"}


def _step(value: Any) -> Any:
    """A checkpoint's global_step, or nan where it has none (a plain model folder, a Hub revision) or it is not a
    finite number >= 0: the statistics that need the step leave such a row out, saying so; the others use it."""
    try:
        ok = value is not None and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    except TypeError:
        ok = False
    return value if ok else math.nan


def metrics_table(groups: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """The metrics table of some groups' attributes, sorted by run, step and layer.

    Parameters
    ----------
    groups
        The attributes of each checkpoint group and layer group to tabulate.

    Returns
    -------
    pandas.DataFrame
        One row per group, columns :data:`COLUMNS`; an absent or null attribute (``tag``, ``val_loss``) is nan, as in
        ``metrics.csv`` read back.
    """
    df = pd.DataFrame([metrics_row(a) for a in groups], columns=list(COLUMNS)).fillna(math.nan)
    return df.sort_values(["run", "global_step", LAYER], kind="stable", ignore_index=True)


def same_model_and_step(groups: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The groups that repeat another's model and step, with why: the training callback's ``<run>/step-N`` (source
    ``training``) where the store also holds that run's saved checkpoint of the same step extracted by ``ncanalyze
    extract`` (its ``source`` inside the callback's ``output_dir``; for a group recorded before ``output_dir``, the same
    run, architecture and parameter count), layer by layer. The extracted checkpoint is kept: one unit per model and
    step, so that no model is counted twice in a report.

    Parameters
    ----------
    groups
        Group name -> its attributes.

    Returns
    -------
    dict
        Group left out -> why (naming the group kept).
    """
    def model(a: Mapping[str, Any]) -> tuple:
        return a.get("run"), a.get("global_step"), a.get(SITE) or a.get(LAYER, a.get("n_layers"))

    def same(live: Mapping[str, Any], saved: Mapping[str, Any]) -> bool:
        if live.get("output_dir"):
            source = str(saved.get("source") or "")
            return source == live["output_dir"] or source.rsplit("/", 1)[0] == live["output_dir"]
        return all(live.get(k) == saved.get(k) for k in ("model_type", "n_params", "hidden_size", "n_layers"))

    saved = {}
    for g, a in groups.items():
        if a.get("source") != "training" and a.get("global_step") is not None:
            saved.setdefault(model(a), []).append(g)
    out = {}
    for g, a in groups.items():
        twin = next((c for c in saved.get(model(a), []) if same(a, groups[c])), None) if a.get("source") == "training" \
            else None
        if twin:
            out[g] = (f"the same model and step as {twin} (the training callback's measurement of a checkpoint also "
                      f"extracted): counted once, as {twin}")
    return out
