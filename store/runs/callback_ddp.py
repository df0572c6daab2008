"""The callback's measurement under DDP (torchrun): each rank runs the train pass over its contiguous share of the
train batches (shards.py's ranges, with global stream positions, so reservoir keys agree), the float64 states are
gathered on rank 0 and merged in shards.py's fixed tree (Chan for the statistics, counts summed, bottom-k for the
reservoir), and rank 0 alone runs the validation pass and writes: equal to one process to 1e-12.

Every rank meets the same collectives in the same order, and an error on any rank is agreed on by all
(:func:`agree`), so a bad share never leaves another rank waiting. Before the first share, the ranks agree on a
content hash of the train blocks (:func:`agreed_batches`): ranks given different data are refused in one line.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging

import torch.distributed as dist
from ncanalyze.core.errors import UserError
from ncanalyze.store.extraction.passes import train_pass
from ncanalyze.store.extraction.resume import Phase, unflatten
from ncanalyze.store.extraction.running import Extraction
from ncanalyze.store.runs import shards as sh

log = logging.getLogger(__name__)


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one.

    Returns
    -------
    tuple of int
        This process's rank and the number of processes.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree(error: str | None) -> str | None:
    """Every rank's error, agreed: the first rank's that has one, on every rank (a barrier too).

    Parameters
    ----------
    error
        This rank's error, or None.

    Returns
    -------
    str or None
        The first error of any rank, or None.
    """
    _, world = rank_world()
    if world == 1:
        return error
    errors: list = [None] * world
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def agreed_folds(folds: int) -> int:
    """The fewest folds any rank's memory holds (memory.fit_folds), on every rank: the ranks' fold sums must have
    the same folds to merge."""
    _, world = rank_world()
    if world == 1:
        return folds
    seen: list = [None] * world
    dist.all_gather_object(seen, folds)
    return min(seen)


def agreed_batches(blocks, batch_size: int) -> int:
    """The train batches, once every rank has hashed the blocks it would read (all of them: sha256 of their tokens,
    the cap applied) and the ranks agree: a UserError on every rank, naming the ranks and their data, where any
    differ (each rank would cut its own data into ranges and the merge would mix them silently).

    Parameters
    ----------
    blocks
        This rank's train blocks.
    batch_size
        Blocks per batch.

    Returns
    -------
    int
        The train batches in all.
    """
    digest, n_blocks = hashlib.sha256(), 0
    for batch in blocks.batches(batch_size):
        digest.update(batch.tobytes())
        n_blocks += len(batch)
    _, world = rank_world()
    seen: list = [None] * world
    dist.all_gather_object(seen, (n_blocks, digest.hexdigest()[:12], blocks.spec))
    if len(set((n, h) for n, h, _ in seen)) > 1:
        ranks = "; ".join(f"rank {r}: {n} blocks of {spec}, sha256 {h}" for r, (n, h, spec) in enumerate(seen))
        raise UserError(f"the ranks read different train data ({ranks}): give every rank the same train_data and "
                        "settings (the ranks share out one stream of blocks)")
    return -(-n_blocks // batch_size)


def share_train(model, train, ex: Extraction, batch_size: int, total: int, desc: str) -> bool:
    """This rank's share of the train pass, merged on rank 0 into ``ex`` (then in its validation phase).

    Parameters
    ----------
    model
        The live model.
    train
        The train blocks.
    ex
        The running state (the default plan: the last layer alone).
    batch_size
        Blocks per batch.
    total
        The train batches in all (:func:`agreed_batches`).
    desc
        The group, for progress bars and errors.

    Returns
    -------
    bool
        True on rank 0, which goes on with the validation pass and the write; False on the others.
    """
    rank, world = rank_world()
    parts = sh.ranges(total, world)
    start, stop = parts[rank] if rank < len(parts) else (total, total)
    error = None
    if start < stop:
        cap = stop * batch_size
        blocks = dataclasses.replace(train, max_blocks=cap if train.max_blocks is None else min(train.max_blocks, cap))
        ex.batches = start  # the batches before it are read and skipped; positions stay global
        try:
            train_pass(model, blocks, ex, batch_size, _Never(), f"{desc} [{start}:{stop}]")
        except UserError as e:
            error = str(e)
    main = ex.main()
    state = sh.shard_state({"main": main})  # shards' layout, one site
    gathered: list | None = [None] * world if rank == 0 else None
    dist.gather_object((error, state if start < stop else None), gathered, dst=0)
    error = agree(gathered and next((e for e, _ in gathered if e), None))
    if error:
        raise UserError(error)
    if rank != 0:
        return False
    states = [s for _, s in gathered if s is not None]
    k, seed = ex.args[2], ex.args[3]
    for level in sh.merge_order(len(states)):
        states = [states[i] if j < 0 else sh.merge_states(states[i], states[j], k, seed) for i, j in level]
    merged = unflatten(states[0])["main"]
    main.stats.load_state_dict(merged["stats"])
    main.reservoir.load_state_dict(merged["reservoir"])
    if main.folds is not None:  # merged fold by fold
        main.folds.load_state_dict(merged["folds"])
    ex.next_phase(Phase.VALIDATION)
    return True


class _Never:
    def maybe(self, force: bool = False) -> None:
        """Save nothing."""
