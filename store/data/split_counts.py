"""The train split's label counts (``split_count``, SPEC section 4 "Budget-stable estimates"): how often each token is
a label over every block of the split, whatever the cap reads, so that the debiased metrics' class set is the
split's, not the sample's. One pass over the token ids, no forward pass; for tokenized text it is cached beside the
token cache (``<key>.npy.<sha256>.counts``, named by the cache file's verified checksum, so a cache tokenized again
is counted again; a numpy file no ``*.npy`` glob of the caches picks up), for token files the memory-mapped ids are
counted directly."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from ncanalyze.store.data.blocks import Blocks

BATCH = 4096  # blocks counted at a time


class Labelling(Protocol):
    """What a position's class is (``store.extraction.labels.Labels``, a floor above)."""
    setting: str

    def rows(self, batch: np.ndarray, marks: np.ndarray | None, first: int) -> Any: ...


def label_bincount(blocks: Blocks, labels: Labelling | None, size: int, batch_size: int = BATCH) -> np.ndarray:
    """Each class's labels over ``blocks`` (default: the next tokens; those outside 0..size-1 left out), int64."""
    counts = np.zeros(size, dtype=np.int64)
    for batch, marks in blocks.labelled(batch_size):
        y = batch[:, 1:].ravel() if labels is None else labels.rows(batch, marks, 0).y
        counts += np.bincount(y[(y >= 0) & (y < size)], minlength=size)[:size]
    return counts


def label_counts(blocks: Blocks | None, vocab: int, labels: Labelling | None = None) -> np.ndarray | None:
    """Each class's count as a label (as the train pass labels them, by ``labels``, a
    :class:`~ncanalyze.store.extraction.labels.Labels`: default, the next tokens) over the whole split that ``blocks``
    are drawn from (``blocks.whole``, with its label file's), int64 over ``vocab`` classes; cached beside a token cache
    file. Text read as a stream (``--no-token-cache``) is read once more to count it, as a spread cap reads it once
    to count its blocks. None where the whole split is not known (``--cap-mode prefix`` over text, whose cache holds
    the first blocks only): the debiased metrics then take the sample's classes with 2 or more tokens."""
    whole = None if blocks is None else blocks.whole
    if whole is None:
        return None
    if blocks.labels is not None:
        whole = dataclasses.replace(whole, labels=blocks.labels.whole)
    cache = None if whole.source is None else _cache_path(Path(whole.source), labels)
    if cache is not None and cache.is_file():
        with open(cache, "rb") as f:
            counts = np.load(f, allow_pickle=False)
        if counts.shape == (vocab,):
            return counts
    counts = label_bincount(whole, labels, vocab, BATCH)
    if cache is not None:
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, counts)
        os.replace(tmp, cache)  # complete or absent: never half a file
    return counts


def _cache_path(source: Path, labels: Labelling | None = None) -> Path | None:
    """Where the counts of the token cache file ``source`` are kept: named by the sha256 beside it (None without),
    and by the label kind where it is not the next token."""
    try:
        digest = source.with_name(source.name + ".sha256").read_text().strip().lower()[:16]
    except (OSError, UnicodeDecodeError):
        return None
    kind = "" if labels is None or labels.setting == "next" else f".{labels.setting}"  # a label file needs token files
    return source.with_name(f"{source.name}.{digest}{kind}.counts")
