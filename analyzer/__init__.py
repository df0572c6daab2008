"""Neural-collapse statistics and metrics: the maths. Arrays and datasets in, numbers and datasets out; this
package imports neither ``ncanalyze.store`` nor ``ncanalyze.cli``.

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
