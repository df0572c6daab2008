"""The train split's label counts (``split_count``, SPEC section 4 "Budget-stable estimates"): how often each token is
a label over every block of the split, whatever the cap reads, so that the debiased metrics' class set is the
split's, not the sample's. One pass over the token ids, no forward pass; for tokenized text it is cached beside the
token cache (``<key>.npy.counts.npy``), for token files the memory-mapped ids are counted directly."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from ncanalyze.store.data.blocks import Blocks

log = logging.getLogger("ncanalyze")
BATCH = 4096  # blocks counted at a time


def label_counts(blocks: Blocks | None, vocab: int) -> np.ndarray | None:
    """Each token's count as a label (each block's ids after its first, as the train pass labels them) over the
    whole split that ``blocks`` are drawn from (``blocks.whole``), int64 over ``vocab``; cached beside a token cache
    file. None where the whole split is not at hand without reading a stream again (text without the token cache, or
    under ``--cap-mode prefix``): the debiased metrics then take the sample's own counts, and say so."""
    whole = None if blocks is None else blocks.whole
    if whole is None or whole.n_blocks is None:
        return None
    cache = None if whole.source is None else Path(f"{whole.source}.counts.npy")
    if cache is not None and cache.is_file():
        counts = np.load(cache, allow_pickle=False)
        if counts.shape == (vocab,):
            return counts
    counts = np.zeros(vocab, dtype=np.int64)
    for batch in whole.batches(BATCH):
        ids = batch[:, 1:].ravel()
        counts += np.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab)[:vocab]
    if cache is not None:
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp.npy")
        np.save(tmp, counts)
        os.replace(tmp, cache)  # complete or absent: never half a file
    return counts
