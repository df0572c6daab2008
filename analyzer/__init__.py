"""Neural-collapse statistics and metrics."""
from ncanalyze.analyzer.accumulate import ClassStats
from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.metrics import PER_CLASS, SCALARS, class_metrics, class_stats, kept_classes, measure, measure_all

__all__ = ["ClassStats", "UserError", "class_stats", "measure", "class_metrics", "measure_all", "kept_classes",
           "SCALARS", "PER_CLASS", "measure_store"]


def __getattr__(name: str):
    if name == "measure_store":  # the store side imports zarr/tqdm: only when asked for
        from ncanalyze.analyzer.measure_store import measure_store
        return measure_store
    raise AttributeError(name)
