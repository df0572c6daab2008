"""Checkpoints in, the store out: discovery, data, extraction, and every read and write of the Zarr store (io.py).

Imports go one way: ``ncanalyze.cli`` -> ``ncanalyze.store`` -> ``ncanalyze.analyzer``. Importing this package is
light: :func:`open` (the SPEC's ``ncanalyze.store.open(path)``, io.open_tree) loads zarr and xarray when first used.
"""
from __future__ import annotations

__all__ = ["open"]


def __getattr__(name: str):
    if name == "open":
        from ncanalyze.store.io import open_tree  # zarr and xarray, on first use only

        return open_tree
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
