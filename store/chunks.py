"""The chunk shapes of the store's arrays, defined once: along vocab ~32 MB of float64 class rows and at most ~8 MB
per chunk, along position (saved embeddings) ~32 MB. io.py adds the codec and writes with them."""
from __future__ import annotations

import numpy as np
import xarray as xr
from ncanalyze.analyzer.schema import HEAD


def position_chunk(n: int, row_bytes: int) -> int:
    """Rows per chunk along ``position`` (saved embeddings): ~32 MB.

    Parameters
    ----------
    n
        Rows in all.
    row_bytes
        Bytes per row.

    Returns
    -------
    int
        Rows per chunk.
    """
    return max(1, min(n, (32 << 20) // max(1, row_bytes)))


def chunks(ds: xr.Dataset) -> dict[str, dict]:
    """The chunk shape of each data variable of ``ds`` and of the head where it is a coordinate (schema.HEAD), as
    ``to_zarr``'s encoding (``{}``: one chunk, for an array along neither vocab nor position).

    Parameters
    ----------
    ds
        A group's dataset.

    Returns
    -------
    dict
        name -> ``{"chunks": shape}`` or ``{}``.
    """
    d = ds.sizes["hidden"]
    rows = max(1, min(ds.sizes["vocab"], (32 << 20) // (8 * d)))
    enc: dict[str, dict] = {}
    for name in [*ds.data_vars, *(h for h in HEAD if h in ds.coords)]:
        var = ds.variables[name]
        enc[name] = {}
        if "vocab" in var.dims:
            per_row = int(np.prod([ds.sizes[x] for x in var.dims if x != "vocab"]))
            n = max(1, min(ds.sizes["vocab"], (8 << 20) // max(1, per_row * var.dtype.itemsize)))
            enc[name]["chunks"] = tuple(min(rows, n) if x == "vocab" else ds.sizes[x] for x in var.dims)
        elif "position" in var.dims:
            n = position_chunk(ds.sizes["position"], int(np.prod([ds.sizes[x] for x in var.dims if x != "position"]))
                               * var.dtype.itemsize)
            enc[name]["chunks"] = tuple(n if x == "position" else ds.sizes[x] for x in var.dims)
    return enc
