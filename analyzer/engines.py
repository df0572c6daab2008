"""The one chooser of the engine that computes the pairwise and spectral sums (as flox has one module per engine and
one chooser): engine_numba.py (numpy and numba on the host, the CPU's default) or engine_torch.py (torch float64
on a device, CUDA's default). Nothing else imports an engine; the engines compute the same numbers (to 1e-12,
tests/analyzer/test_engine_torch.py), so the choice is about speed only."""
from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import xarray as xr

from ncanalyze.core.errors import UserError
from ncanalyze.core.setting import default, device_of

ENGINES = ("numba", "torch")


def engine_device(device: str | None = default("device"), engine: str | None = None) -> str | None:
    """Where the pairwise sums and the d x d work run: None for the numba pass and numpy on the CPU (the CPU's
    default), else the torch device that runs them in float64.

    Parameters
    ----------
    device
        ``auto`` (CUDA when torch sees one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.
    engine
        ``numba`` or ``torch`` to choose the CPU's path (``torch`` with ``cpu``: the GPU's code on the CPU, as
        the tests run it); default: torch on CUDA, numba on the CPU.

    Returns
    -------
    str or None
        The torch device, or None for numba.
    """
    device = device_of(device or "auto")
    if engine not in (None, *ENGINES):
        raise UserError(f"engine must be numba or torch (got {engine!r})")
    if device == "cpu" or (device == "auto" and (engine == "numba" or not gpu_possible())):
        return "cpu" if engine == "torch" else None
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else ("cpu" if engine == "torch" else None)
    if engine == "numba":
        raise UserError(f"the numba engine runs on the CPU only: drop engine='numba' to measure on {device}")
    if not torch.cuda.is_available():
        raise UserError(f"--device {device}: torch sees no CUDA device (torch.cuda.is_available() is False); use "
                        "--device cpu or auto")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise UserError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s), numbered from 0")
    return device


GPU_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")  # NVIDIA, WSL, ROCm


def gpu_possible(files: tuple[str, ...] = GPU_FILES) -> bool:
    """Whether torch could see a CUDA (or ROCm) device, answered without importing torch where it cannot (its import
    is much of a short measure or report): on Linux, where none of the drivers' files exists, it cannot; elsewhere,
    or once torch is imported, ask torch."""
    if sys.platform != "linux" or "torch" in sys.modules:
        return True
    return any(os.path.exists(f) for f in files)


def kept_parts(ds: xr.Dataset, K: np.ndarray, p: np.ndarray, has_var: np.ndarray, sigma_w: np.ndarray | None,
               on: str | None, tile: int | None, debias: tuple | None = None, sample: list | None = None,
               all_pairs: bool = True, head: np.ndarray | None = None) -> dict[str, Any]:
    """The Geometry's fields that read the class means and the classifier, by the engine ``on`` names
    (:func:`engine_device`'s answer: None for the host's, else the torch device); ``tile`` is the host's tile or the
    device's row panel, in classes (None: each engine's own default); ``debias`` the debiased CDNV's per-class rows
    (v*, z, b; pairs.side_of); ``sample`` blocks of sampled pairs and ``all_pairs`` whether to sum every pair
    (the jackknife's replicates: jackknife.py), ``head`` W^T W over the vocabulary where known (not computed
    again). Keys as engine_torch.device_parts."""
    if on is None:
        from ncanalyze.analyzer.engine_numba import host_parts

        return host_parts(ds, K, p, has_var, sigma_w, tile, debias, sample, all_pairs, head)
    from ncanalyze.analyzer.engine_torch import device_parts  # torch loads only when a device is asked for

    return device_parts(ds, K, p, has_var, sigma_w, on, tile, debias, sample, all_pairs, head)
