"""The metrics table (SPEC section 5, ``metrics.csv``) from the checkpoint groups' attributes: one row per checkpoint
and stored layer, the descriptive columns (``INFO``), ``layer``, then the scalar metrics. Pure: attributes in, a
DataFrame out; the store (``ncanalyze.store.measure``) and the accessor (``tree.nc.table()``) both build it here."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from ncanalyze.analyzer.schema import CLASS_COUNTS, INFO, LAYER, SCALARS

COLUMNS = (*INFO, LAYER, *CLASS_COUNTS, *SCALARS)


def metrics_row(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """One group's row: its descriptive attributes, its layer (a checkpoint group without ``layer`` is its last,
    ``n_layers``), how many classes the metrics rest on (``CLASS_COUNTS``, nan where measured before they were
    recorded) and its metrics as floats (a null metric is its value in ``metrics_nonfinite``, else nan).

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
              for k in (*CLASS_COUNTS, *SCALARS)}
    return {**{k: attrs.get(k) for k in INFO}, LAYER: attrs.get(LAYER, attrs.get("n_layers")), **floats}


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
