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
from ncanalyze.core.errors import CheckpointError
from ncanalyze.core.setting import default
from ncanalyze.store.extraction.resume import RESTART

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
    positions: ``key``, ``position`` (-1 in an empty slot) and ``row`` (classes x k), a filled slot's sample being
    the row ``row`` of ``pool`` (-1 in an empty slot); ``samples`` (classes x k x d) is the dense array they stand for.

    The pool holds the samples kept and nothing else, in the order they arrived (a replaced sample's row taken by its
    successor): host memory and page faults grow with the samples taken, not with classes x k x d (at 128,256 x 2 x
    4,096 the dense array is 4.2 GB a layer, whose first touch cost an H200 host 21 ms a layer a batch: 0.06 of the
    8B forward with every layer)."""

    def __init__(self, num_classes: int, k: int, dim: int, seed: int = default("seed")):
        self.k, self.seed, self.dim = k, seed, dim
        self.key = np.full((num_classes, k), EMPTY, dtype=np.uint64)
        self.position = np.full((num_classes, k), -1, dtype=np.int64)
        self.row = np.full((num_classes, k), -1, dtype=np.int64)
        self._pool, self.used = np.empty((0, dim), dtype=np.float32), 0

    @property
    def pool(self) -> np.ndarray:
        """The kept samples (used rows x d), a view."""
        return self._pool[:self.used]

    def _take_rows(self, m: int) -> np.ndarray:
        """``m`` new rows at the pool's end, its capacity doubled where they do not fit (at most classes x k: a row is
        taken only by an empty slot, so ``used + m`` never exceeds it)."""
        if self.used + m > len(self._pool):
            cap = min(max(2 * len(self._pool), self.used + m, 1024), self.key.size)
            grown = np.empty((cap, self.dim), dtype=np.float32)
            grown[:self.used] = self._pool[:self.used]
            self._pool = grown
        self.used += m
        return np.arange(self.used - m, self.used)

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
        target = self.row[rows, slots]  # an evicted sample's row takes its successor; an empty slot a new row
        empty = target < 0
        target[empty] = self._take_rows(int(empty.sum()))
        self.key[rows, slots], self.position[rows, slots], self.row[rows, slots] = keys[new], pos[new], target
        self._pool[target] = h.index_select(0, torch.from_numpy(new).to(h.device)).float().cpu().numpy()

    @property
    def samples(self) -> np.ndarray:
        """The dense samples (classes x k x d, zero in an empty slot), made from the pool."""
        dense = np.zeros((*self.key.shape, self.dim), dtype=np.float32)
        filled = self.row >= 0
        dense[filled] = self._pool[self.row[filled]]
        return dense

    def _reorder(self, order: np.ndarray, key: np.ndarray, position: np.ndarray, row: np.ndarray) -> None:
        """Take the slots ``order`` picks (classes x k indices into the columns of ``key``, ``position``, ``row``)."""
        self.key = np.take_along_axis(key, order, 1)
        self.position = np.take_along_axis(position, order, 1)
        self.row = np.take_along_axis(row, order, 1)

    def merge(self, other: "Reservoir") -> "Reservoir":
        """Fold in the reservoir of another part of the same stream (positions are global stream positions, so keys
        agree): each class keeps the k smallest keys of the union, exactly the sample one pass over both parts
        keeps. The slots come out in key order (see :meth:`canonical`), the pool holding the kept samples alone.
        Returns self."""
        if (other.k, other.seed, other.dim) != (self.k, self.seed, self.dim):
            raise ValueError(f"cannot merge reservoirs of k={other.k}, seed={other.seed}, d={other.dim} into "
                             f"k={self.k}, seed={self.seed}, d={self.dim}")
        key = np.concatenate([self.key, other.key], 1)
        theirs = np.where(other.row >= 0, other.row + self.used, -1)
        self._reorder(np.argsort(key, axis=1, kind="stable")[:, :self.k], key,
                      np.concatenate([self.position, other.position], 1), np.concatenate([self.row, theirs], 1))
        self._compact(np.concatenate([self.pool, other.pool]))
        return self

    def _compact(self, pool: np.ndarray) -> None:
        """The pool made anew from ``pool`` (which ``row`` points into): the filled slots' samples in slot order."""
        filled = self.row >= 0
        self._pool, self.used = pool[self.row[filled]], int(filled.sum())
        self.row[filled] = np.arange(self.used)

    def canonical(self) -> "Reservoir":
        """The slots of every class in key order (filled slots first, the first j of them a uniform sample of j) and
        the pool in slot order, so that the state depends only on the sample, not on the order the stream was read
        in. Returns self."""
        self._reorder(np.argsort(self.key, axis=1, kind="stable"), self.key, self.position, self.row)
        self._compact(self._pool)
        return self

    @property
    def n_samples(self) -> np.ndarray:
        return (self.key != EMPTY).sum(1).astype(np.int64)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"key": self.key, "position": self.position, "row": self.row, "pool": self.pool}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a saved state, refused (a CheckpointError) where its rows do not point one to one into its pool at
        exactly its filled slots."""
        key, row, pool = (np.asarray(state[n]) for n in ("key", "row", "pool"))
        filled = row[row >= 0]
        if (pool.ndim != 2 or pool.shape[1] != self.dim or not np.array_equal(row >= 0, key != EMPTY)
                or not np.array_equal(np.sort(filled), np.arange(len(pool)))):
            raise CheckpointError(f"a saved reservoir's rows do not match its {len(pool)} samples; {RESTART}")
        self.key[...], self.position[...], self.row[...] = key, state["position"], row
        self._pool, self.used = np.array(pool, dtype=np.float32), len(pool)
