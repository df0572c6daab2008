"""The train split's label counts (``split_count``, SPEC section 4 "Budget-stable estimates"): how often each token is
a label over every block of the split, whatever the cap reads, so that the debiased metrics' class set is the
split's, not the sample's. One pass over the token ids, no forward pass; for tokenized text it is cached beside the
token cache (``<key>.npy.<sha256>.counts``, named by the cache file's verified checksum, so a cache tokenized again
is counted again; a numpy file no ``*.npy`` glob of the caches picks up), for token files the memory-mapped ids are
counted directly."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from ncanalyze.store.data.blocks import Blocks
BATCH = 4096  # blocks counted at a time


def label_counts(blocks: Blocks | None, vocab: int) -> np.ndarray | None:
    """Each token's count as a label (each block's ids after its first, as the train pass labels them) over the
    whole split that ``blocks`` are drawn from (``blocks.whole``), int64 over ``vocab``; cached beside a token cache
    file. Text read as a stream (``--no-token-cache``) is read once more to count it, as a spread cap reads it once
    to count its blocks. None where the whole split is not known (``--cap-mode prefix`` over text, whose cache holds
    the first blocks only): the debiased metrics then take the sample's classes with 2 or more tokens."""
    whole = None if blocks is None else blocks.whole
    if whole is None:
        return None
    cache = None if whole.source is None else _cache_path(Path(whole.source))
    if cache is not None and cache.is_file():
        with open(cache, "rb") as f:
            counts = np.load(f, allow_pickle=False)
        if counts.shape == (vocab,):
            return counts
    counts = np.zeros(vocab, dtype=np.int64)
    for batch in whole.batches(BATCH):
        ids = batch[:, 1:].ravel()
        counts += np.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab)[:vocab]
    if cache is not None:
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, counts)
        os.replace(tmp, cache)  # complete or absent: never half a file
    return counts


def _cache_path(source: Path) -> Path | None:
    """Where the counts of the token cache file ``source`` are kept: named by the sha256 beside it (None without)."""
    try:
        digest = source.with_name(source.name + ".sha256").read_text().strip().lower()[:16]
    except (OSError, UnicodeDecodeError):
        return None
    return source.with_name(f"{source.name}.{digest}.counts")
