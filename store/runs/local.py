"""Extraction of the checkpoints under local paths: :func:`extract` (the estimate announced once, then each checkpoint
by :func:`~ncanalyze.store.extraction.checkpoint.extract_checkpoint`), and one checkpoint in shards
(:func:`extract_sharded`)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
from ncanalyze.analyzer.errors import CheckpointError, UserError
from ncanalyze.store import io
from ncanalyze.store.data.blocks import Blocks
from ncanalyze.store.extraction import layers
from ncanalyze.store.extraction.checkpoint import extract_checkpoint, load_checkpoint, open_inputs
from ncanalyze.store.extraction.config import (
    Status,
    held_out_line,
    resolve,
)
from ncanalyze.store.extraction.settings import ExtractConfig
from ncanalyze.store.extraction.estimate import (
    START,
    Arch,
    announcement,
    architecture,
    checkpoint_architecture,
    per_architecture,
    progress,
    timed_arch,
)
from ncanalyze.store.layout import StoreLayout
from ncanalyze.store.resume import (
    DeferredInterrupt,
    prune,
)
from ncanalyze.store.runs import shards as sh
from ncanalyze.store.runs.result import ExtractResult
from ncanalyze.store.sources.discover import (
    Checkpoint,
    discover,
    tagged,
)
from tqdm.auto import tqdm

log = logging.getLogger(__name__)


def announcer(todo: list[Checkpoint], cfg: ExtractConfig, store: Path, restart: bool = False,
              local: bool = False) -> Callable[..., None]:
    """The estimate, logged once, at the first checkpoint that does work: each architecture among ``todo`` is timed
    once, on its first checkpoint (the one at hand; the others loaded for it), and one line gives the total.

    Parameters
    ----------
    todo
        The checkpoints to do (those of every PATH of a command: :func:`announcer_over`).
    cfg, store
        The configuration and the store.
    restart
        Resume states are to be discarded (else what they hold is left out of the estimate).
    local
        ``todo`` are local folders, whose configs tell their architectures (Hub revisions: all the first's).

    Returns
    -------
    callable
        ``announce(model, loaded, train, val, plan)`` for :func:`extract_checkpoint`.
    """
    announced = False
    where = StoreLayout(store)

    def time_first(ckpt: Checkpoint) -> Arch | None:  # another architecture's first checkpoint, loaded to be timed
        try:
            other = load_checkpoint(ckpt, cfg, run := resolve(ckpt, cfg))
            return timed_arch(other.model, other.seconds, *open_inputs(store, cfg, run, other.tokenizer), run.plan, cfg,
                              where.partial)
        except CheckpointError:
            return None

    def announce(model, loaded: float, train: Blocks, val: Blocks | None, plan: layers.Plan) -> None:
        nonlocal announced
        if announced:
            return
        announced = True
        archs = per_architecture(todo, architecture(model.config, cfg.dtype, cfg.block_size),
                                 lambda c: checkpoint_architecture(c, cfg) if local else None,
                                 timed_arch(model, loaded, train, val, plan, cfg, where.partial), time_first,
                                 lambda c: START if restart else progress(where.checkpoint(c).state))
        log.info("estimate: %s", announcement(archs, cfg, store, next(model.parameters()).device))

    return announce


def announcer_over(paths: list, store: Path, cfg: ExtractConfig, overwrite: bool = False,
                   restart: bool = False) -> Callable[..., None]:
    """:func:`announcer` over the checkpoints to do under every one of ``paths`` (a command's PATHS), for
    :func:`extract`'s ``announce``: one estimate line, one total.

    Parameters
    ----------
    paths
        The PATHS (local).
    store, cfg, overwrite, restart
        As for :func:`extract`.

    Returns
    -------
    callable
        As :func:`announcer`'s.
    """
    ckpts = [c for p in paths for c in tagged(discover(p), cfg.tag)]
    return announcer(todo(Path(store), ckpts, overwrite), cfg, Path(store), restart, local=True)


def check_settings(cfg: ExtractConfig, store: Path, shards: int = 1) -> None:
    """Refuse, before any work, settings that can't go together and a store that can't be written.

    Parameters
    ----------
    cfg, store
        The configuration and the store (checked writable, not created: it appears with its first checkpoint).
    shards
        Shards per checkpoint.
    """
    if cfg.max_train_tokens is not None and cfg.min_count > cfg.max_train_tokens:
        raise UserError(f"--min-count {cfg.min_count} is above --max-train-tokens {cfg.max_train_tokens}, so no class "
                        "could be kept: lower --min-count")
    if shards > 1 and (cfg.layers != "last" or cfg.save_embeddings):
        raise UserError("--shards splits the last layer's statistics only: drop --layers/--save-embeddings, or "
                        "--shards")
    io.prepare(Path(store), StoreLayout(Path(store)).partial)
    if line := held_out_line(cfg):  # the validation data is resolved here, so its refusals come before any work
        log.info("%s", line)


def todo(store: Path, ckpts: list[Checkpoint], overwrite: bool) -> list[Checkpoint]:
    """The checkpoints left to do.

    Parameters
    ----------
    store, ckpts
        The store and the checkpoints.
    overwrite
        All are to be done again.

    Returns
    -------
    list of Checkpoint
        Those not yet complete in ``store`` (all of them with ``overwrite``).
    """
    return [c for c in ckpts
            if overwrite or not (io.group_attrs(store, c.group, corrupt_ok=True) or {}).get("complete")]


def extract(path: str | Path, store: str | Path, cfg: ExtractConfig, overwrite: bool = False,
            restart: bool = False, shards: int = 1, announce: Callable[..., None] | None = None) -> ExtractResult:
    """Extract every checkpoint under ``path`` into ``store`` (each status logged as it goes).

    A checkpoint that is bad in itself (a CheckpointError: corrupt weights, NaN features) fails alone, as
    'failed: <why>', and the others go on; any other error stops the run.

    Parameters
    ----------
    path
        A Trainer output folder, a model folder, or a folder of runs.
    store, cfg
        The store and the configuration.
    overwrite, restart
        As for :func:`extract_checkpoint`.
    shards
        > 1: each checkpoint's train stream cut into that many parts, run one after another and merged exactly
        (:func:`extract_sharded`; the same computation a cluster runs in parallel).
    announce
        The estimate, where it spans more than ``path`` (:func:`announcer_over`); else one for ``path``.

    Returns
    -------
    ExtractResult
        Labelled with ``path``.
    """
    result = ExtractResult(str(path), str(store))
    store = Path(store)
    ckpts = tagged(discover(path), cfg.tag)
    check_settings(cfg, store, shards)
    announce = announce or announcer(todo(store, ckpts, overwrite), cfg, store, restart, local=True)
    try:
        with DeferredInterrupt() as interrupt:
            for ckpt in tqdm(ckpts, desc="checkpoints", unit="ckpt", disable=len(ckpts) < 2):
                result.statuses[ckpt.group] = _one(ckpt, store, cfg, overwrite, restart, announce, interrupt,
                                                   len(ckpts), shards)
                log.info("%s: %s", ckpt.group, result.statuses[ckpt.group])
    finally:
        prune(StoreLayout(store).partial)
    return result


def _one(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, overwrite: bool, restart: bool, announce,
         interrupt: DeferredInterrupt, n: int, shards: int = 1) -> str:
    """One checkpoint's status; a CheckpointError is its status ('failed: why') when it is one of several."""
    try:
        if shards > 1:
            return extract_sharded(ckpt, store, cfg, shards, overwrite, restart, interrupt)
        return extract_checkpoint(ckpt, store, cfg, overwrite, restart, announce, interrupt)
    except CheckpointError as e:
        if n == 1:
            raise
        return f"failed: {e}"


def finish_sharded(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, merged: dict[str, np.ndarray],
                   overwrite: bool = False, interrupt: DeferredInterrupt | None = None) -> str:
    """The merged train state saved as the checkpoint's resume state (:func:`~ncanalyze.store.runs.shards.save_merged`),
    then :func:`extract_checkpoint` resumes from it: the validation pass and the write.

    Parameters
    ----------
    ckpt, store, cfg
        The checkpoint, the store and the configuration.
    merged
        The shards' states, merged.
    overwrite, interrupt
        As for :func:`extract_checkpoint`.

    Returns
    -------
    str
        'done' ('resumed' when run again after its worker died in the validation pass, 'skipped' if another writer
        finished it meanwhile).
    """
    saved = sh.save_merged(ckpt, store, cfg, merged, overwrite)
    if saved is Status.SKIP:
        return "skipped"
    status = extract_checkpoint(ckpt, store, cfg, overwrite, restart=False, interrupt=interrupt)
    return "done" if status == "resumed" and saved is Status.FRESH else status


def extract_sharded(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, shards: int, overwrite: bool = False,
                    restart: bool = False, interrupt: DeferredInterrupt | None = None) -> str:
    """The sharded extraction of one checkpoint in this process: the shards one after another, the same merge tree
    as on a cluster, then the validation pass.

    Parameters
    ----------
    ckpt, store, cfg
        The checkpoint, the store and the configuration.
    shards
        How many parts to cut the train stream into.
    overwrite, restart, interrupt
        As for :func:`extract_checkpoint`; a Ctrl-C stops a shard at its next batch boundary (its work is not
        kept), the validation pass with its state saved.

    Returns
    -------
    str
        'done', 'skipped' or 'resumed'.
    """
    parts = sh.plan(ckpt, store, cfg, shards, overwrite, restart)
    if parts == "skipped":
        return "skipped"
    if parts == sh.WHOLE:
        return extract_checkpoint(ckpt, store, cfg, overwrite, restart=False, interrupt=interrupt)
    states = [sh.train_shard(ckpt, cfg, a, b, interrupt) for a, b in parts]
    for level in sh.merge_order(len(states)):
        states = [states[i] if j < 0 else sh.merge_states(states[i], states[j], cfg.samples_per_class, cfg.seed)
                  for i, j in level]
    return finish_sharded(ckpt, store, cfg, states[0], overwrite, interrupt)
