"""One checkpoint's train pass cut into shards: contiguous ranges of batches, each an exact float64 ``ClassStats`` and
reservoir over its batches for every site of the plan (all in one pass: :func:`one_pass`), merged site by site with
Chan's formula in a fixed tree, then the validation pass and the write.

The steps are plain functions of picklable arguments, so that a cluster runs them as tasks (cluster.py) and the local
run calls them one after another (extract.extract_sharded); both merge in the same order and so give the same bits.

- :func:`plan`: skip a finished checkpoint, hand a saved resume state back to the one-task path, else the ranges
  (a :class:`ShardPlan`);
- :func:`train_shard`: the train pass over one range, with global stream positions (so reservoir keys agree);
- :func:`merge_states`: two shards' states into one (Chan for the statistics, bottom-k for the reservoir);
- :func:`save_merged`: the merged state saved as the checkpoint's resume state at the start of the validation pass,
  from which ``extract_checkpoint`` resumes (extract.finish_sharded): the validation pass, the write, its lock, its
  resume, unchanged.

A shard keeps no resume state of its own: one that is lost (its worker died) is computed again from the start.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np
from ncanalyze.analyzer.accumulate import ClassStats, FoldStats
from ncanalyze.core import threads
from ncanalyze.core.errors import UserError
from ncanalyze.store.extraction import layers
from ncanalyze.store.extraction.job import Job
from ncanalyze.store.extraction.memory import check_memory, fit_folds, state_bytes
from ncanalyze.store.extraction.passes import train_pass
from ncanalyze.store.extraction.reservoir import Reservoir
from ncanalyze.store.extraction.resume import (
    DeferredInterrupt,
    Interrupted,
    Phase,
    Saver,
    flatten,
    save_state,
    unflatten,
)
from ncanalyze.store.extraction.running import Extraction, LayerState
from ncanalyze.store.extraction.settings import parse_size
from ncanalyze.store.layout import drop_state
from ncanalyze.store.sources.anatomy import check_sites
from ncanalyze.store.sources.load import find_tokenizer, load_model
from ncanalyze.store.store import Status, Store

log = logging.getLogger(__name__)

class Route(enum.Enum):
    """How :func:`plan` sends a checkpoint on."""
    SKIP = "skip"      # already in the store under this configuration
    WHOLE = "whole"    # one task: a saved resume state to continue, or a group under another configuration to refuse
    SHARDS = "shards"  # its train pass in ranges of batches


class ShardPlan(NamedTuple):
    """:func:`plan`'s answer: the route, and the shards' [start, stop) batch ranges under SHARDS."""
    route: Route
    ranges: tuple[tuple[int, int], ...] = ()


def ranges(n_batches: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous [start, stop) ranges of batches, sizes differing by at most one, none empty."""
    shards = max(1, min(shards, n_batches))
    edges = [n_batches * i // shards for i in range(shards + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:])]


def _train_blocks(job: Job):
    tokenizer, _ = find_tokenizer(job.ckpt, job.cfg.tokenizer, job.cfg.trust_remote_code)
    return job.inputs(None, tokenizer, validation=False)[0]  # train only, uncached


def shard_plan(job: Job, store: Store, shards: int) -> ShardPlan:
    """SKIP (already in the store under this configuration), WHOLE (run it as one task: a saved resume state to
    continue, or a group under another configuration for extract_checkpoint to refuse), else SHARDS with the shards'
    batch ranges. Loads no weights; counts the train batches by reading the data once when its length is unknown.

    Parameters
    ----------
    job, store
        The checkpoint's job (its ``overwrite`` and ``restart`` apply) and the store.
    shards
        How many ranges to cut the train batches into (fewer when there are fewer batches).

    Returns
    -------
    ShardPlan
        The route, and the [start, stop) batch ranges under SHARDS.
    """
    cfg, files = job.cfg, store.files(job.ckpt)
    one_pass(job)  # an explicit --layers-per-pass that splits the sites: refused before any work
    with store.lock(job.group):
        store.recover(job.group)
        status = job.status(store)
        if status is Status.SKIP:
            return ShardPlan(Route.SKIP)
        if status is not Status.FRESH:  # REFUSE: extract_checkpoint says why; RESUME: it continues the state
            return ShardPlan(Route.WHOLE)
        if job.restart:
            drop_state(files.state)
    blocks = _train_blocks(job)
    if blocks.n_blocks is not None:
        n_blocks = blocks.total
    else:  # text: its length is known only once tokenized
        n_blocks = sum(len(b) for b in blocks.batches(cfg.batch_size))
    n_batches = -(-n_blocks // cfg.batch_size)
    if n_batches == 0:
        raise UserError(f"{blocks.spec} holds no full block of {blocks.block_size} tokens: the dataset is empty or "
                        "shorter than --block-size")
    return ShardPlan(Route.SHARDS, tuple(ranges(n_batches, shards)))


class _ShardSaver(Saver):
    """A shard keeps no state: nothing is saved; a pending Ctrl-C (``interrupt``) stops it at a batch boundary."""

    def __init__(self, interrupt: DeferredInterrupt | None, group: str):
        super().__init__(Path("unused"), dict, every=float("inf"))
        self.pending, self.group = interrupt, group

    def maybe(self, force: bool = False) -> None:
        if self.pending is not None and self.pending.pending:
            self.pending.pending = False
            raise Interrupted(f"interrupted: {self.group} was in its train shards, which keep no state (it starts "
                              "again); the checkpoints finished before it are in the store; run the same command to "
                              "go on")


def one_pass(job: Job) -> layers.Plan:
    """The job's plan as the shards run it: every site in one pass (``--layers-per-pass auto`` recorded as that one
    group, so that the resume after the merge continues it); an explicit ``--layers-per-pass`` that splits the sites
    is refused, before any work."""
    plan_ = job.plan
    if not plan_.auto and len(plan_.passes) > 1:
        raise UserError(f"--shards runs every site in one pass, and --layers-per-pass {plan_.per_pass} splits the "
                        f"{len(plan_.layers)} sites into {len(plan_.passes)}: drop --layers-per-pass, or --shards")
    return dataclasses.replace(plan_, groups=(plan_.layers,))


def train_shard(job: Job, start: int, stop: int,
                interrupt: DeferredInterrupt | None = None) -> dict[str, np.ndarray]:
    """The train pass over batches [start, stop) of the job's stream, every site of its plan in one pass: each
    site's statistics and reservoir state, on the CPU; a pending Ctrl-C in ``interrupt`` (this process's) stops it
    at its next batch boundary (:class:`Interrupted`)."""
    ckpt, cfg, device, plan_ = job.ckpt, job.cfg, job.run.device, one_pass(job)
    blocks = _train_blocks(job)
    model = load_model(ckpt, cfg.dtype, device, cfg.allow_pickle, cfg.trust_remote_code)
    check_sites(model, plan_.layers)
    vocab, dim = model.get_output_embeddings().weight.shape
    check_memory(state_bytes(vocab, dim, cfg.samples_per_class, device), plan_.widest_pass, device)
    cap = stop * cfg.batch_size
    blocks = dataclasses.replace(blocks, max_blocks=cap if blocks.max_blocks is None else min(blocks.max_blocks, cap))
    folds = fit_folds(cfg.folds, vocab, dim, cfg.samples_per_class, plan_.widest_pass, device,
                      parse_size(cfg.state_memory))
    ex = Extraction(plan_, vocab, dim, cfg.samples_per_class, cfg.seed, device, folds=folds, labels=job.run.labels)
    ex.batches = start  # batch_features reads (and skips) the batches before it; positions stay global
    with threads.policy(cfg.threads):  # a Dask worker's OMP_NUM_THREADS=1 caps auto at 1
        train_pass(model, blocks, ex, cfg.batch_size, _ShardSaver(interrupt, ckpt.group),
                   f"{ckpt.group} [{start}:{stop}]")
    return shard_state({f"layer{l.key}": s for l, s in ex.layers.items()})


def shard_state(sites: Mapping[str, LayerState]) -> dict[str, np.ndarray]:
    """The sites' accumulators as one shard hands them to :func:`merge_states` (flat, one key per site)."""
    return flatten({key: site_state(s.stats, s.reservoir, s.folds) for key, s in sites.items()})


def site_state(stats: ClassStats, reservoir: Reservoir, folds: FoldStats | None = None) -> dict[str, dict]:
    """One site's accumulators as a nested state, the layout :func:`merge_states` merges (per site key)."""
    return {"stats": stats.state_dict(), "reservoir": reservoir.state_dict()} | (
        {} if folds is None else {"folds": folds.state_dict()})


def _objects(state: dict, k: int, seed: int) -> tuple[ClassStats, Reservoir, FoldStats | None]:
    """One site's accumulators from its nested state."""
    vocab, dim = state["stats"]["mean"].shape
    stats = ClassStats(vocab, dim, "cpu", scatter="scatter" in state["stats"])
    stats.load_state_dict(state["stats"])
    reservoir = Reservoir(vocab, k, dim, seed)
    reservoir.load_state_dict(state["reservoir"])
    folds = None
    if "folds" in state:  # the fold sums beside the totals (merged fold by fold)
        folds = FoldStats(len(state["folds"]["count"]), vocab, dim, "cpu", scatter="scatter" in state["folds"])
        folds.load_state_dict(state["folds"])
    return stats, reservoir, folds


def _merge_site(a: dict, b: dict, k: int, seed: int) -> dict[str, dict]:
    """One site's state of the stream of ``a`` followed by that of ``b``."""
    sa, ra, fa = _objects(a, k, seed)
    sb, rb, fb = _objects(b, k, seed)
    if (fa is None) != (fb is None):
        raise UserError("shards with and without fold sums cannot be merged (their --folds was fitted to different "
                        "memory): pass --folds explicitly, or --state-memory, the same for every worker")
    if fa is None:
        return site_state(sa.merge(sb), ra.merge(rb))
    return site_state(fa.merge(fb).totals(into=sa), ra.merge(rb), fa)


def merge_states(a: dict[str, np.ndarray], b: dict[str, np.ndarray], k: int, seed: int) -> dict[str, np.ndarray]:
    """The state of the stream of ``a`` followed by that of ``b`` (disjoint tokens), site by site: their fold sums
    fold by fold and the totals made from them (FoldStats.totals, as one task makes them), or without folds the
    totals merged."""
    na, nb = unflatten(a), unflatten(b)
    return flatten({site: _merge_site(na[site], nb[site], k, seed) for site in na})


def merge_order(n: int) -> list[list[tuple[int, int]]]:
    """The merge tree over ``n`` states, level by level: pairs of neighbours (i, i + 1) at each level, an odd one out
    carried up. Indices are into the previous level's list."""
    levels = []
    while n > 1:
        levels.append([(i, i + 1) for i in range(0, n - 1, 2)] + ([(n - 1, -1)] if n % 2 else []))
        n = (n + 1) // 2
    return levels


def save_merged(job: Job, store: Store, merged: dict[str, np.ndarray]) -> Status:
    """Save the merged train state as the checkpoint's resume state at the start of the validation pass, for
    ``extract_checkpoint`` to resume (:func:`~ncanalyze.store.runs.local.finish_sharded`).

    Parameters
    ----------
    job, store
        The checkpoint's job (with ``overwrite``, a complete group under any configuration is to be replaced) and
        the store.
    merged
        The state of all the shards, merged (:func:`merge_states`).

    Returns
    -------
    Status
        FRESH: saved; SKIP: another writer finished it meanwhile; RESUME: a state is there already, this task's own,
        saved in the validation pass by a run whose worker died (shard_plan() left no other), to be resumed rather than
        started again; REFUSE: nothing saved (extract_checkpoint refuses it).
    """
    ckpt, cfg, run = job.ckpt, job.cfg, job.run
    sites = {key: _objects(state, cfg.samples_per_class, cfg.seed) for key, state in unflatten(merged).items()}
    stats, _, folds = sites[f"layer{run.plan.last.key}"]
    count = stats.count
    if not (count >= cfg.min_count).any():
        raise UserError(f"no class has --min-count {cfg.min_count} train tokens in {ckpt.group} (the most is "
                        f"{int(count.max())}): " + ("lower --min-count" if cfg.min_count > 1 and count.max() else
                                                     "no train token was read: check --dataset and --max-train-tokens"))
    files = store.files(ckpt)
    with store.lock(ckpt.group):
        status = job.status(store)  # the job resuming (finish_sharded): restart was spent by plan()
        if status is Status.FRESH:
            ex = Extraction(one_pass(job), *stats.mean.shape, cfg.samples_per_class, cfg.seed, "cpu",
                            folds=1 if folds is None else len(folds.parts), labels=run.labels)
            for l, s in ex.layers.items():
                s.stats, s.reservoir, s.folds = sites[f"layer{l.key}"]
            ex.next_phase(Phase.VALIDATION)
            save_state(files.state, ex.state(run.record))
    return status
