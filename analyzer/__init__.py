"""Neural-collapse statistics and metrics."""
from ncanalyze.analyzer.accumulate import ClassStats
from ncanalyze.analyzer.errors import UserError

__all__ = ["ClassStats", "UserError"]
