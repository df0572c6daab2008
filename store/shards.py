"""One checkpoint's train pass cut into shards: contiguous ranges of batches, each an exact float64 ``ClassStats`` and
reservoir over its batches, merged with Chan's formula in a fixed tree, then the validation pass and the write.

The steps are plain functions of picklable arguments, so that a cluster runs them as tasks (cluster.py) and the local
run calls them one after another (``extract_sharded``); both merge in the same order and so give the same bits.

- :func:`plan`: skip a finished checkpoint, hand a saved resume state back to the one-task path, else the ranges;
- :func:`train_shard`: the train pass over one range, with global stream positions (so reservoir keys agree);
- :func:`merge_states`: two shards' states into one (Chan for the statistics, bottom-k for the reservoir);
- :func:`finish`: the merged state saved as the checkpoint's resume state at the start of the validation pass,
  then ``extract_checkpoint`` resumes from it: the validation pass, the write, its lock, its resume, unchanged.

A shard keeps no resume state of its own: one that is lost (its worker died) is computed again from the start.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from ncanalyze.analyzer.accumulate import ClassStats
from ncanalyze.analyzer.errors import UserError
from ncanalyze.store import io, layers
from ncanalyze.store.discover import Checkpoint
from ncanalyze.store.estimate import check_memory, state_bytes
from ncanalyze.store.extract import ExtractConfig, _open, config_hash, extract_checkpoint, resolve
from ncanalyze.store.load import find_tokenizer, load_model
from ncanalyze.store.lock import checkpoint_lock
from ncanalyze.store.passes import train_pass
from ncanalyze.store.reservoir import Reservoir
from ncanalyze.store.resume import Phase, Saver, drop_state, flatten, save_state, state_path, unflatten
from ncanalyze.store.running import Extraction

log = logging.getLogger(__name__)

WHOLE = "whole"  # plan's answer when the checkpoint should run as one task (a saved state to resume, or a refusal)


def ranges(n_batches: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous [start, stop) ranges of batches, sizes differing by at most one, none empty."""
    shards = max(1, min(shards, n_batches))
    edges = [n_batches * i // shards for i in range(shards + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:])]


def _train_blocks(ckpt: Checkpoint, cfg: ExtractConfig):
    device, config, block_size, *_ = resolve(ckpt, cfg)
    tokenizer, _ = find_tokenizer(ckpt, cfg.tokenizer, cfg.trust_remote_code)
    return device, _open(cfg.dataset, cfg.split, cfg.max_train_tokens, "--max-train-tokens", cfg, block_size, config,
                         tokenizer)


def plan(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, shards: int, overwrite: bool = False,
         restart: bool = False) -> str | list[tuple[int, int]]:
    """'skipped' (already in the store under this configuration), ``WHOLE`` (run it as one task: a saved resume
    state to continue, or a group under another configuration for extract_checkpoint to refuse), else the shards'
    batch ranges. Loads no weights; counts the train batches by reading the data once when its length is unknown."""
    *_, record = resolve(ckpt, cfg)
    spath = state_path(store, ckpt)
    with checkpoint_lock(spath.with_suffix(".lock"), ckpt.group):
        io.recover_swap(store, ckpt.group, spath.with_suffix(".zarr"))
        existing = io.group_attrs(store, ckpt.group, corrupt_ok=overwrite)
        if existing and existing.get("complete") and not overwrite:
            return "skipped" if existing.get("config_hash") == config_hash(record) else WHOLE
        if restart:
            drop_state(spath)
        elif spath.exists():
            return WHOLE
    _, blocks = _train_blocks(ckpt, cfg)
    if blocks.n_blocks is not None:
        n_blocks = blocks.total
    else:  # text: its length is known only once tokenized
        n_blocks = sum(len(b) for b in blocks.batches(cfg.batch_size))
    n_batches = -(-n_blocks // cfg.batch_size)
    if n_batches == 0:
        raise UserError(f"{blocks.spec} holds no full block of {blocks.block_size} tokens: the dataset is empty or "
                        "shorter than --block-size")
    return ranges(n_batches, shards)


def train_shard(ckpt: Checkpoint, cfg: ExtractConfig, start: int, stop: int) -> dict[str, np.ndarray]:
    """The train pass over batches [start, stop) of the stream: statistics and reservoir state, on the CPU."""
    device, blocks = _train_blocks(ckpt, cfg)
    model = load_model(ckpt, cfg.dtype, device, cfg.allow_pickle, cfg.trust_remote_code)
    vocab, dim = model.get_output_embeddings().weight.shape
    check_memory(state_bytes(vocab, dim, cfg.samples_per_class, device), None, device)
    cap = stop * cfg.batch_size
    blocks = dataclasses.replace(blocks, max_blocks=cap if blocks.max_blocks is None else min(blocks.max_blocks, cap))
    ex = Extraction(layers.plan(), vocab, dim, cfg.samples_per_class, cfg.seed, device)
    ex.batches = start  # batch_features reads (and skips) the batches before it; positions stay global
    never = Saver(Path("unused"), dict, every=float("inf"))
    train_pass(model, blocks, ex, cfg.batch_size, never, f"{ckpt.group} [{start}:{stop}]")
    return _arrays(ex.main().stats, ex.main().reservoir)


def _arrays(stats: ClassStats, reservoir: Reservoir) -> dict[str, np.ndarray]:
    return flatten({"stats": stats.state_dict(), "reservoir": reservoir.state_dict()})


def _objects(arrays: dict[str, np.ndarray], k: int, seed: int) -> tuple[ClassStats, Reservoir]:
    state = unflatten(arrays)
    vocab, dim = state["stats"]["mean"].shape
    stats = ClassStats(vocab, dim, "cpu", scatter="scatter" in state["stats"])
    stats.load_state_dict(state["stats"])
    reservoir = Reservoir(vocab, k, dim, seed)
    reservoir.load_state_dict(state["reservoir"])
    return stats, reservoir


def merge_states(a: dict[str, np.ndarray], b: dict[str, np.ndarray], k: int, seed: int) -> dict[str, np.ndarray]:
    """The state of the stream of ``a`` followed by that of ``b`` (disjoint tokens)."""
    sa, ra = _objects(a, k, seed)
    sb, rb = _objects(b, k, seed)
    return _arrays(sa.merge(sb), ra.merge(rb))


def merge_order(n: int) -> list[list[tuple[int, int]]]:
    """The merge tree over ``n`` states, level by level: pairs of neighbours (i, i + 1) at each level, an odd one out
    carried up. Indices are into the previous level's list."""
    levels = []
    while n > 1:
        levels.append([(i, i + 1) for i in range(0, n - 1, 2)] + ([(n - 1, -1)] if n % 2 else []))
        n = (n + 1) // 2
    return levels


def finish(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, merged: dict[str, np.ndarray],
           overwrite: bool = False) -> str:
    """Save the merged train state as the checkpoint's resume state at the start of the validation pass, then let
    ``extract_checkpoint`` resume from it; 'done' ('resumed' when run again after its worker died in the validation
    pass, 'skipped' if another writer finished it meanwhile)."""
    *_, record = resolve(ckpt, cfg)
    stats, reservoir = _objects(merged, cfg.samples_per_class, cfg.seed)
    count = stats.count
    if not (count >= cfg.min_count).any():
        raise UserError(f"no class has --min-count {cfg.min_count} train tokens in {ckpt.group} (the most is "
                        f"{int(count.max())}): lower --min-count")
    spath = state_path(store, ckpt)
    with checkpoint_lock(spath.with_suffix(".lock"), ckpt.group):
        existing = io.group_attrs(store, ckpt.group, corrupt_ok=overwrite)
        if existing and existing.get("complete") and not overwrite and existing.get("config_hash") == config_hash(record):
            return "skipped"
        # a state here is this task's own, saved in the validation pass by a run whose worker died (plan() left no
        # other): resume it rather than start the validation pass again
        resumed = spath.exists()
        if not resumed:
            ex = Extraction(layers.plan(), *stats.mean.shape, cfg.samples_per_class, cfg.seed, "cpu")
            ex.main().stats, ex.main().reservoir = stats, reservoir
            ex.next_phase(Phase.VALIDATION)
            save_state(spath, ex.state(record))
    status = extract_checkpoint(ckpt, store, cfg, overwrite, restart=False)
    return "done" if status == "resumed" and not resumed else status


def extract_sharded(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, shards: int, overwrite: bool = False,
                    restart: bool = False) -> str:
    """The sharded extraction of one checkpoint in this process: the shards one after another, the same merge tree
    as on a cluster, then the validation pass. Returns 'done', 'skipped' or 'resumed'."""
    todo = plan(ckpt, store, cfg, shards, overwrite, restart)
    if todo == "skipped":
        return "skipped"
    if todo == WHOLE:
        return extract_checkpoint(ckpt, store, cfg, overwrite, restart=False)
    states = [train_shard(ckpt, cfg, a, b) for a, b in todo]
    for level in merge_order(len(states)):
        states = [states[i] if j < 0 else merge_states(states[i], states[j], cfg.samples_per_class, cfg.seed)
                  for i, j in level]
    return finish(ckpt, store, cfg, states[0], overwrite)
