"""Neural-collapse statistics and metrics.

Exports load on first use, so that importing the package (the CLI, dask workers) does not pull in torch.
"""
from importlib import import_module

from ncanalyze.analyzer.errors import UserError

_LAZY = {
    "ClassStats": "accumulate",
    "class_stats": "metrics", "measure": "metrics", "class_metrics": "metrics", "measure_all": "metrics",
    "kept_classes": "metrics", "SCALARS": "metrics", "PER_CLASS": "metrics",
    "measure_store": "measure_store",
}

__all__ = ["UserError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"ncanalyze.analyzer.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
