"""Checkpoints in, the store out: discovery, data, extraction, and every read and write of the Zarr store (io.py).

Imports go one way: ``ncanalyze.cli`` -> ``ncanalyze.store`` -> ``ncanalyze.analyzer``.
"""
from __future__ import annotations

from ncanalyze.store.io import open_tree as open  # noqa: A001  (the SPEC's name: ncanalyze.store.open(path))

__all__ = ["open"]
