"""How the store's arrays are chunked and compressed, defined once (io.write_checkpoint writes with it), and the rate
at which a group is written that way (the estimate's write time)."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import xarray as xr
import zarr

from ncanalyze.analyzer.schema import HEAD

XR = {"zarr_format": 3, "consolidated": False}  # for xarray: no consolidated metadata (groups are written one by one)


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


def encoding(ds: xr.Dataset) -> dict:
    """The Zarr encoding of a group's data variables and of the head where it is a coordinate (schema.HEAD): chunks
    along vocab of ~32 MB of float64 class rows, and at most ~8 MB for each variable's chunk; along position (saved
    embeddings) ~32 MB; zstd with its frame checksum, so that a flipped bit in a chunk is an error on read, never a
    wrong number.

    Parameters
    ----------
    ds
        The dataset to write.

    Returns
    -------
    dict
        ``to_zarr``'s ``encoding``.
    """
    d = ds.sizes["hidden"]
    rows = max(1, min(ds.sizes["vocab"], (32 << 20) // (8 * d)))
    enc = {}
    for name in [*ds.data_vars, *(h for h in HEAD if h in ds.coords)]:
        var = ds.variables[name]
        if "vocab" in var.dims:
            per_row = int(np.prod([ds.sizes[x] for x in var.dims if x != "vocab"]))
            n = max(1, min(ds.sizes["vocab"], (8 << 20) // max(1, per_row * var.dtype.itemsize)))
            enc[name] = {"chunks": tuple(min(rows, n) if x == "vocab" else ds.sizes[x] for x in var.dims)}
        elif "position" in var.dims:
            n = position_chunk(ds.sizes["position"], int(np.prod([ds.sizes[x] for x in var.dims if x != "position"]))
                               * var.dtype.itemsize)
            enc[name] = {"chunks": tuple(n if x == "position" else ds.sizes[x] for x in var.dims)}
        enc.setdefault(name, {})["compressors"] = [zarr.codecs.ZstdCodec(level=0, checksum=True)]
    return enc


def write_rate(sample: np.ndarray, folder: Path) -> float | None:
    """Bytes per second at which a group's (vocab x hidden) ``sample`` is written the way io.write_checkpoint writes
    (chunks, zstd with checksums, to disk), timed in a scratch folder under ``folder`` that is removed after (and,
    left by a killed run, an hour later); None where it can't be written (a full disk: the write will say).

    Parameters
    ----------
    sample
        A slice of a group's (vocab x hidden) float64 array.
    folder
        Where to write it (``StoreLayout.partial``).

    Returns
    -------
    float or None
        Bytes per second.
    """
    for stale in folder.glob(".write-rate-*"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".write-rate-"))
    except OSError:
        return None
    try:
        ds = xr.Dataset({"mean": (("vocab", "hidden"), sample)})
        t0 = time.perf_counter()
        ds.to_zarr(tmp / "g", mode="w", encoding=encoding(ds), **XR)
        return sample.nbytes / max(time.perf_counter() - t0, 1e-6)
    except OSError:
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
