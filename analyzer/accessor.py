"""The xarray accessor ``nc`` (SPEC section 3), registered when ``ncanalyze`` is imported: ``ds.nc.measure()`` and
``ds.nc.class_metrics()`` on a checkpoint's dataset, ``tree.nc.table()`` on a store's tree. Each delegates to the
function of the same meaning (:func:`ncanalyze.analyzer.measure`, :func:`~ncanalyze.analyzer.class_metrics`,
:func:`ncanalyze.analyzer.table.metrics_table`); nothing is computed here."""
from __future__ import annotations

import logging
from collections.abc import Iterator

import pandas as pd
import xarray as xr

from ncanalyze.analyzer.registry import MEASURE
from ncanalyze.analyzer.table import metrics_table

log = logging.getLogger(__name__)
NAME = "nc"


@xr.register_dataset_accessor(NAME)
class DatasetAccessor:
    """``ds.nc``: the neural-collapse metrics of one checkpoint's dataset (a store group, or ``class_stats``).

    A layer group's classifier is stored once, in its checkpoint group: ``ncanalyze.store.open(path)[layer]`` has it
    (attached, lazily); on a tree of plain ``xarray.open_datatree`` take ``node.to_dataset(inherit="all_coords")``,
    else NC3 and the head's erank are nan (with a warning)."""

    def __init__(self, ds: xr.Dataset) -> None:
        self._ds = ds

    def measure(self, min_count: int = MEASURE.min_count, tile: int | None = MEASURE.tile,
                decay_ranks: tuple[int, int] = (4, 100), se: bool = MEASURE.se) -> dict[str, float]:
        """The scalar metrics (SPEC section 4) and how many classes they rest on, as
        :func:`ncanalyze.analyzer.measure`.

        Parameters
        ----------
        min_count
            Keep only classes with at least this many train tokens (``--min-count``).
        tile
            Classes per tile of the pairwise sums (``--tile``); default from the available memory.
        decay_ranks
            The ranks (first, last) of Sigma_T's eigenvalues that ``eigen_decay`` fits (alpha-ReQ's 4..100).
        se
            Add each metric's delete-one-fold jackknife error ``<metric>_se`` (from the group's fold sums; nan, with
            a warning, for a group without folds), as ``ncanalyze measure`` does; ``se=False``: the point values
            alone.

        Returns
        -------
        dict
            Metric name -> value, then ``n_classes`` and ``n_classes_var`` (then the errors, with ``se``).
        """
        from ncanalyze.analyzer.metrics import measure

        return measure(self._ds, min_count=min_count, tile=tile, decay_ranks=decay_ranks, se=se)

    def class_metrics(self, min_count: int = MEASURE.min_count, tile: int | None = MEASURE.tile) -> xr.Dataset:
        """The per-class views (``class_norm``, ``class_cdnv``, ...; nan outside the kept set), as
        :func:`ncanalyze.analyzer.class_metrics`.

        Parameters
        ----------
        min_count
            Keep only classes with at least this many train tokens (``--min-count``).
        tile
            Classes per tile of the pairwise sums (``--tile``); default from the available memory.

        Returns
        -------
        xarray.Dataset
            One variable per view, along ``vocab``.
        """
        from ncanalyze.analyzer.metrics import class_metrics

        return class_metrics(self._ds, min_count=min_count, tile=tile)


@xr.register_datatree_accessor(NAME)
class TreeAccessor:
    """``tree.nc``: a store's tree (``ncanalyze.store.open(path)``) as a whole."""

    def __init__(self, tree: xr.DataTree) -> None:
        self._tree = tree

    def table(self) -> pd.DataFrame:
        """The metrics table, as ``metrics.csv``: one row per complete checkpoint group and each of its layer groups,
        with the metrics ``ncanalyze measure`` stored in their attributes (nan where not yet measured).

        Returns
        -------
        pandas.DataFrame
            The columns of :data:`ncanalyze.analyzer.table.COLUMNS`, sorted by run, step and layer.
        """
        return metrics_table(node.attrs for node in _groups(self._tree))


def _groups(node: xr.DataTree) -> Iterator[xr.DataTree]:
    """The statistics groups under ``node``, in path order; an unfinished checkpoint (``complete`` not set: an
    interrupted write) is left out with its layer groups."""
    if "mean" in node.data_vars:
        if node.attrs.get("complete") is not True:
            log.debug("%s: not complete, left out of the table", node.path)
            return
        yield node
    for name in sorted(node.children):
        yield from _groups(node.children[name])
