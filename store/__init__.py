"""Checkpoint discovery, extraction of exact per-class statistics, and the Zarr store."""
from __future__ import annotations

from pathlib import Path

import xarray as xr

from ncanalyze.analyzer.errors import UserError


def open(path: str | Path = "ncanalyze.zarr") -> xr.DataTree:  # noqa: A001  (the SPEC's name)
    """The whole store as a lazy ``xarray.DataTree``: one group per checkpoint at ``<run>/<checkpoint>``."""
    p = Path(path)
    if not (p / "zarr.json").is_file():
        raise UserError(f"no ncanalyze store at {p}: run `ncanalyze extract CHECKPOINTS --store {p}` first, "
                        "or pass the right path (or set NCANALYZE_STORE)")
    return xr.open_datatree(p, engine="zarr", consolidated=False, zarr_format=3)
