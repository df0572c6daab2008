"""The one line printed before extraction starts: tokens, time (from a timed forward pass) and disk."""
from __future__ import annotations

import time
from pathlib import Path

import psutil
import torch

from ncanalyze.analyzer.errors import UserError
from ncanalyze.store.data import Blocks
from ncanalyze.store.passes import features


def state_bytes(vocab: int, dim: int, samples_per_class: int, device: torch.device) -> tuple[int, int]:
    """(bytes per layer, bytes shared by the layers) of an extraction's running state on ``device``: per layer the
    float64 means, the per-class vectors (count, M2, 3 validation counts), the d x d scatter, and in the validation
    pass the kept means' float64 copy; shared, the head's float64 copy. The reservoir (CPU) counts on the CPU only."""
    per_layer = 2 * vocab * dim * 8 + 5 * vocab * 8 + dim * dim * 8
    if device.type == "cpu":
        per_layer += vocab * samples_per_class * (4 * dim + 16)
    return per_layer, vocab * dim * 8


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device``: torch.cuda.mem_get_info on CUDA, psutil's available memory on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def check_memory(sizes: tuple[int, int], per_pass: int | None, device: torch.device,
                 available: int | None = None) -> None:
    """A UserError if the state of ``per_pass`` layers (1 without --layers) does not fit in the ``available`` memory
    of ``device`` (default: what is free now), naming how many layers per pass would."""
    per_layer, shared = sizes
    k = per_pass or 1
    free = available_bytes(device) if available is None else available
    if k * per_layer + shared <= free:
        return
    fits = (free - shared) // per_layer
    hint = (f"pass fewer --layers, or --layers-per-pass {fits} (several passes over the data, exact either way)"
            if fits >= 1 else "use a device with more memory, or --device cpu")
    raise UserError(f"the float64 state of {k} layer(s) needs ~{(k * per_layer + shared) / 2**30:.1f} GiB on {device} "
                    f"but {free / 2**30:.1f} GiB is free: {hint}")


def estimate(n_ckpts: int, model, train: Blocks, batch_size: int, samples_per_class: int, max_val_tokens: int | None,
             store: Path, state_layers: int = 1) -> str:
    """Tokens, time and disk for ``n_ckpts`` checkpoints like ``model`` over ``train``, and the size of the running
    state of ``state_layers`` layers (a pass's) on the device."""
    device = next(model.parameters()).device
    vocab, d = model.get_output_embeddings().weight.shape
    per_layer, shared = state_bytes(vocab, d, samples_per_class, device)
    state = f"; state ~{(state_layers * per_layer + shared) / 1e6:,.0f} MB on {device} ({state_layers} layer(s))"
    return _estimate(n_ckpts, model, train, batch_size, samples_per_class, max_val_tokens, store) + state


def _estimate(n_ckpts: int, model, train: Blocks, batch_size: int, samples_per_class: int, max_val_tokens: int | None,
              store: Path) -> str:
    device = next(model.parameters()).device
    vocab, d = model.get_output_embeddings().weight.shape
    ids = torch.randint(0, vocab, (batch_size, train.block_size), device=device)
    features(model, ids)  # warm-up
    t0 = time.perf_counter()
    features(model, ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = batch_size * train.block_size / (time.perf_counter() - t0)
    per_ckpt = vocab * d * (8 + 4 + 4 * samples_per_class) + vocab * 8 * 6 + d * d * 8
    disk = f"~{n_ckpts * per_ckpt / 1e6:,.0f} MB in {store}"
    n_train, n_val = train.total and train.total * train.block_size, max_val_tokens
    if n_train is None:
        return (f"{n_ckpts} checkpoint(s); train tokens unknown (uncapped text: pass --max-train-tokens for a "
                f"bound); forward pass ~{rate:,.0f} tokens/s on {device}; {disk}")
    secs = n_ckpts * (n_train + (n_val or 0)) / rate
    took = f"{secs:,.0f} s" if secs < 120 else f"{secs / 60:,.1f} min" if secs < 7200 else f"{secs / 3600:,.1f} h"
    val = "no validation" if n_val == 0 else f"{n_val:,} val tokens" if n_val else "the validation split"
    return (f"{n_ckpts} checkpoint(s) x {n_train:,} train tokens + {val}; ~{took} "
            f"{'' if n_val is not None else '+ validation '}at ~{rate:,.0f} tokens/s on {device}; {disk}")
