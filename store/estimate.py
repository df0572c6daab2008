"""The one line printed before extraction starts: tokens, time (from a timed forward pass) and disk."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ncanalyze.store.data import Blocks
from ncanalyze.store.passes import features


def estimate(n_ckpts: int, model, train: Blocks, batch_size: int, samples_per_class: int, max_val_tokens: int | None,
             store: Path) -> str:
    """Tokens, time and disk for ``n_ckpts`` checkpoints like ``model`` over ``train``."""
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
