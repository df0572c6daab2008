"""A uniform sample of at most K raw features per class, exact, mergeable and resumable.

Each token position gets a pseudo-random key (splitmix64 of its position in the stream and a seed);
a class keeps the K positions with the smallest keys (bottom-k sampling), which is a uniform sample
without replacement. Keys depend only on positions, so a resumed run keeps the same sample and every
checkpoint of a run samples the same positions: an embedding can be followed over training.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from ncanalyze.analyzer.accumulate import Accumulator
from ncanalyze.core.setting import default

log = logging.getLogger(__name__)

EMPTY = np.iinfo(np.uint64).max


def position_keys(pos: np.ndarray, seed: int = default("seed")) -> np.ndarray:
    """splitmix64 of ``pos + seed * golden``: a bijective hash, so keys never tie."""
    with np.errstate(over="ignore"):
        z = pos.astype(np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) >> np.uint64(1)  # never EMPTY


class Reservoir(Accumulator):
    """At most ``k`` raw features per class (float32), the bottom-k by :func:`position_keys` of their stream
    positions: ``key``, ``position`` (-1 in an empty slot) and ``samples`` (classes x k [x d])."""

    def __init__(self, num_classes: int, k: int, dim: int, seed: int = default("seed")):
        self.k, self.seed = k, seed
        self.key = np.full((num_classes, k), EMPTY, dtype=np.uint64)
        self.position = np.full((num_classes, k), -1, dtype=np.int64)
        # lazy zero pages: memory only for the classes seen (at 128,256 x 8 x 4,096 a layer's samples are 16.8 GB of
        # host memory if written up front); the price is a page fault on a class's first sample (3 layers at
        # V = 128,256, d = 1,024, a fresh process: 7.0 s of train pass against 2.7 s written up front)
        self.samples = np.zeros((num_classes, k, dim), dtype=np.float32)

    def update(self, h: torch.Tensor, y: np.ndarray, pos: np.ndarray) -> None:
        """Offer features ``h`` (n x d) with labels ``y`` and stream positions ``pos``."""
        if self.k == 0:
            return
        keys = position_keys(pos, self.seed)
        cand = np.flatnonzero(keys < self.key[y].max(1))  # beats its class's largest kept key, or an empty slot
        if cand.size == 0:
            return
        cls, inv = np.unique(y[cand], return_inverse=True)
        k, u = self.k, len(cls)
        all_key = np.concatenate([self.key[cls].ravel(), keys[cand]])
        all_cls = np.concatenate([np.repeat(np.arange(u), k), inv])
        # ties are only between empty slots: the highest sort first, so the lowest are the ones freed
        tie = np.concatenate([-np.tile(np.arange(k), u), np.zeros(len(cand), dtype=np.int64)])
        order = np.lexsort((tie, all_key, all_cls))
        starts = np.searchsorted(all_cls[order], np.arange(u))
        rank = np.arange(len(order)) - starts[all_cls[order]]
        keep = order[rank < k]  # the k smallest keys of each class
        stays = np.zeros(u * k, dtype=bool)
        stays[keep[keep < u * k]] = True
        freed = np.flatnonzero(~stays)  # evicted or empty slots, in class order, as many as new winners
        new = cand[keep[keep >= u * k] - u * k]  # the winners among the offered tokens, in class order
        rows, slots = cls[freed // k], freed % k
        self.key[rows, slots] = keys[new]
        self.position[rows, slots] = pos[new]
        self.samples[rows, slots] = h.index_select(0, torch.from_numpy(new).to(h.device)).float().cpu().numpy()

    def merge(self, other: "Reservoir", rows: int = 4096) -> "Reservoir":
        """Fold in the reservoir of another part of the same stream (positions are global stream positions, so keys
        agree): each class keeps the k smallest keys of the union, exactly the sample one pass over both parts
        keeps. The slots come out in key order (see :meth:`canonical`). Returns self."""
        if (other.k, other.seed) != (self.k, self.seed):
            raise ValueError(f"cannot merge reservoirs of k={other.k}, seed={other.seed} into k={self.k}, "
                             f"seed={self.seed}")
        for s in range(0, self.key.shape[0], rows):
            sl = slice(s, s + rows)
            key = np.concatenate([self.key[sl], other.key[sl]], 1)
            order = np.argsort(key, axis=1, kind="stable")[:, :self.k]
            pos = np.concatenate([self.position[sl], other.position[sl]], 1)
            samples = np.concatenate([self.samples[sl], other.samples[sl]], 1)
            self.key[sl] = np.take_along_axis(key, order, 1)
            self.position[sl] = np.take_along_axis(pos, order, 1)
            self.samples[sl] = np.take_along_axis(samples, order[:, :, None], 1)
        return self

    def canonical(self) -> "Reservoir":
        """The slots of every class in key order (filled slots first, the first j of them a uniform sample of j), so
        that the stored layout depends only on the sample, not on the order the stream was read in. Returns self."""
        order = np.argsort(self.key, axis=1, kind="stable")
        moved = np.flatnonzero((order != np.arange(self.k)).any(1))
        for s in range(0, len(moved), 4096):
            rows, o = moved[s:s + 4096], order[moved[s:s + 4096]]
            self.key[rows] = np.take_along_axis(self.key[rows], o, 1)
            self.position[rows] = np.take_along_axis(self.position[rows], o, 1)
            self.samples[rows] = np.take_along_axis(self.samples[rows], o[:, :, None], 1)
        return self

    @property
    def n_samples(self) -> np.ndarray:
        return (self.key != EMPTY).sum(1).astype(np.int64)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"key": self.key, "position": self.position, "samples": self.samples}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, v in state.items():
            getattr(self, name)[...] = v
