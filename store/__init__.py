"""The Zarr store and what lies beside it: ``io`` (every read and write of the Zarr hierarchy), ``store`` (the
store as one object), ``layout`` (every path beside a store, and removing a checkpoint's leftovers), ``lock`` (one
writer per checkpoint), ``chunks`` (the arrays' chunk shapes), ``classifier`` (the classifier stored once),
``inventory`` (``ls``, ``rm``), ``measure`` (the metrics into the groups' attributes), ``client`` (the Dask client) and
``bars`` (progress bars). The extraction pipeline climbs above it: ``sources`` -> ``data`` -> ``extraction`` -> ``runs``.

Each floor imports only the floors below it (``tests/test_architecture.py``); between packages imports go
``ncanalyze.cli`` -> ``ncanalyze.store`` -> ``ncanalyze.analyzer`` -> ``ncanalyze.core``. Importing this package is
light: :func:`open` (the SPEC's ``ncanalyze.store.open(path)``, io.open_tree) and ``Store`` (store.py, the store as one
object: its path, layout and operations) load zarr and xarray when first used.
"""
from __future__ import annotations

from ncanalyze.core.errors import refuse_a_shadowing_clone

refuse_a_shadowing_clone()
__all__ = ["Store", "open"]


def __getattr__(name: str):
    if name == "open":
        from ncanalyze.store.io import open_tree  # zarr and xarray, on first use only

        return open_tree
    if name == "Store":
        from ncanalyze.store.store import Store  # the store as one object (store.py)

        return Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
