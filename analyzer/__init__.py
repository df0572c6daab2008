"""Neural-collapse statistics and metrics: the maths. Arrays and datasets in, numbers and datasets out; this
package imports only ``ncanalyze.core`` (never ``ncanalyze.store`` nor ``ncanalyze.cli``).

- the statistics: ``accumulate`` (exact streaming per-class statistics; ``chan_numba``, its CPU pass), ``arrays``
  (plain arrays into a checkpoint dataset), ``screen`` (NC4's nearest-class-mean decisions);
- the metrics: ``schema`` (the names), ``metric_records`` (one record per metric), ``metrics`` (one function each),
  ``geometry`` (the kept classes, once per checkpoint), ``pairs`` and ``moments`` (the pairwise sums and the d x d
  end), ``engines`` (the one chooser of ``engine_numba`` and ``engine_torch``), ``spectral`` (geometry beyond NC),
  ``jackknife`` (each number's error), ``accessor`` (``ds.nc``), ``table`` (the metrics table);
- the statistics over checkpoints: ``stats`` (correlations), ``permute`` (permutation tests), ``resample`` (the
  bootstrap over runs), ``questions`` (the two questions a study asks), ``expr`` (report expressions);
- ``registry``: the settings of ``measure`` and ``report`` (the mechanism: ``ncanalyze.core.setting``);
- ``report``: the tables and figures of a study (a subpackage).

Exports load on first use, so that importing the package (the CLI, dask workers) does not pull in torch.
"""
from importlib import import_module

from ncanalyze.core.errors import UserError, refuse_a_shadowing_clone

refuse_a_shadowing_clone()

_LAZY = {
    "ClassStats": "accumulate",
    "class_stats": "arrays", "measure": "metrics", "class_metrics": "metrics", "measure_all": "metrics",
    "kept_classes": "geometry", "SCALARS": "schema", "NC_METRICS": "schema", "GEOMETRY_METRICS": "schema",
    "CLASS_COUNTS": "schema",
    "PER_CLASS": "schema", "INFO": "schema",
    "stats_dataset": "schema",
}

__all__ = ["UserError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"ncanalyze.analyzer.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
