"""The orchestration of extraction: one checkpoint (:func:`extract_checkpoint`, a table of contents of its steps), the
checkpoints under a path (:func:`extract`), one checkpoint in shards (:func:`extract_sharded`), and the result of
every extraction, local, Hub (hub.py) or cluster (cluster.py): :class:`ExtractResult`. The configuration is
config.py, the paths beside the store layout.py, the passes passes.py and layers.py, the group write io.py.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tqdm.auto import tqdm

from ncanalyze.analyzer.errors import CheckpointError, UserError
from ncanalyze.store import io, layers, shards as sh
from ncanalyze.store.config import (ExtractConfig, Resolved, Status, checkpoint_status, config_hash, differences,
                                    held_out_line, open_data, refusal, resolve)
from ncanalyze.store.data import Blocks
from ncanalyze.store.discover import Checkpoint, discover, tagged, training_metadata
from ncanalyze.store.estimate import (START, Arch, announcement, architecture, checkpoint_architecture, per_architecture,
                                      progress, timed_arch)
from ncanalyze.store.memory import check_memory, fit_plan, parse_size, state_bytes
from ncanalyze.store.layout import CheckpointFiles, StoreLayout
from ncanalyze.store.load import decoded_tokens, find_tokenizer, head, load_model, n_layers
from ncanalyze.store.lock import checkpoint_lock
from ncanalyze.store.loss import loss_attrs
from ncanalyze.store.passes import run_passes
from ncanalyze.store.result import ExtractResult
from ncanalyze.store.resume import DeferredInterrupt, Phase, Saver, drop_state, load_state, prune, record_of
from ncanalyze.store.running import Extraction

log = logging.getLogger(__name__)


class Loaded(NamedTuple):
    """A checkpoint's model, loaded, and what comes with it."""
    model: torch.nn.Module
    tokenizer: object | None
    tokenizer_name: str | None
    seconds: float                # the time the load took (for the estimate)
    classifier: torch.Tensor      # the output layer's weight (vocab x hidden) and bias
    bias: torch.Tensor | None
    plan: layers.Plan             # the run's plan, its passes fitted to the memory under --layers-per-pass auto


def extract_checkpoint(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, overwrite: bool = False,
                       restart: bool = False, announce: Callable[..., None] | None = None,
                       interrupt: DeferredInterrupt | None = None, extra_attrs: dict | None = None) -> str:
    """Extract one checkpoint into ``<store>/<run>/<checkpoint>``.

    One writer at a time per checkpoint (a lock beside the store; a second one waits, then finds it done). A
    finished checkpoint is skipped without loading its weights.

    Parameters
    ----------
    ckpt, store, cfg
        The checkpoint, the store and the configuration.
    overwrite
        Replace a group extracted under another configuration.
    restart
        Discard a saved resume state.
    announce
        ``announce(model, seconds_to_load, train, val, plan)``, called before the passes start (the estimate is
        logged there, :func:`announcer`).
    interrupt
        A pending Ctrl-C is taken at the next batch boundary, after saving the state.
    extra_attrs
        Go into the group's attributes last (a Hub revision's origin and step).

    Returns
    -------
    str
        'done', 'skipped' or 'resumed'.
    """
    store = Path(store)
    run = resolve(ckpt, cfg)
    files = StoreLayout(store).checkpoint(ckpt)
    with checkpoint_lock(files.lock, ckpt.group):
        if _settle(ckpt, store, cfg, run.record, files, overwrite) is Status.SKIP:
            return "skipped"
        loaded = _load(ckpt, cfg, run)
        run = run._replace(plan=loaded.plan)
        train, val = _data(store, cfg, run, loaded.tokenizer)
        if announce:  # before the state is made: the estimate times a few batches on a scratch state of its own
            announce(loaded.model, loaded.seconds, train, val, run.plan)
        status = _passes_and_write(ckpt, store, cfg, run, files, loaded, train, val, overwrite, restart, interrupt,
                                   extra_attrs)
        drop_state(files.state)
        return status


def _settle(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, record: dict, files: CheckpointFiles,
            overwrite: bool) -> Status:
    """The checkpoint's status, after putting back a group an overwrite left aside; a skipped one's leftovers (a
    state or a staged copy left by a run killed after its write) are removed, a refused one raises."""
    io.recover_swap(store, ckpt.group, files)
    existing = io.group_attrs(store, ckpt.group, corrupt_ok=overwrite)
    status = checkpoint_status(existing, record, files.state, overwrite)
    if status is Status.SKIP:
        drop_state(files.state)
        for stale in (files.staging, files.old):
            shutil.rmtree(stale, ignore_errors=True)
    if status is Status.REFUSE:
        raise refusal(ckpt.group, store, existing, record, cfg.tag)
    return status


def _load(ckpt: Checkpoint, cfg: ExtractConfig, run: Resolved) -> Loaded:
    """The model and tokenizer, timed, and the head; the running state checked against the free memory."""
    started = time.perf_counter()
    model = load_model(ckpt, cfg.dtype, run.device, cfg.allow_pickle, cfg.trust_remote_code)
    tokenizer, tok_name = find_tokenizer(ckpt, cfg.tokenizer, cfg.trust_remote_code)
    loaded = time.perf_counter() - started
    classifier, bias = head(model)
    plan = fit_plan(run.plan, *classifier.shape, cfg.samples_per_class, run.device, parse_size(cfg.state_memory))
    check_memory(state_bytes(*classifier.shape, cfg.samples_per_class, run.device), plan.widest_pass, run.device)
    return Loaded(model, tokenizer, tok_name, loaded, classifier, bias, plan)


def _data(store: Path, cfg: ExtractConfig, run: Resolved, tokenizer) -> tuple[Blocks, Blocks | None]:
    """The train and validation blocks (none without validation data)."""
    train = open_data(cfg.dataset, run.split, cfg.max_train_tokens, "--max-train-tokens", cfg, run.block_size,
                      run.config, tokenizer, store)
    val = None if run.val_spec is None else open_data(run.val_spec, run.val_split, cfg.max_val_tokens,
                                                      "--max-val-tokens", cfg, run.block_size, run.config, tokenizer,
                                                      store)
    return train, val


def _passes_and_write(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, run: Resolved, files: CheckpointFiles,
                      loaded: Loaded, train: Blocks, val: Blocks | None, overwrite: bool, restart: bool,
                      interrupt: DeferredInterrupt | None, extra_attrs: dict | None) -> str:
    """The running state (resumed where saved), the train and validation passes, the group's attributes and its write;
    'done' or 'resumed'."""
    model, classifier, bias, record = loaded.model, loaded.classifier, loaded.bias, run.record
    positions = None if train.total is None else train.total * (train.block_size - 1)
    ex = Extraction(layers.fit_embeddings(run.plan, positions), *classifier.shape, cfg.samples_per_class, cfg.seed,
                    run.device, files.layers)
    status = _resume(ex, files.state, record, overwrite, restart, cfg.batch_size, train, val, ckpt.group)
    saver = Saver(files.state, lambda: ex.state(record), cfg.state_every, interrupt)
    io.ensure_group(store)  # the store appears now, its inputs all opened: a command that fails before leaves none
    run_passes(model, train, val, ex, classifier, bias, cfg.min_count, cfg.batch_size, saver, ckpt.group)
    main = ex.main()
    attrs = {
        "run": ckpt.run, "tag": cfg.tag, "checkpoint": ckpt.name, **training_metadata(ckpt),
        "n_params": sum(p.numel() for p in model.parameters()), "n_layers": n_layers(model.config),
        "hidden_size": int(classifier.shape[1]), "vocab_size": int(classifier.shape[0]),
        "model_type": model.config.model_type, "train_tokens": int(main.stats.count.sum()),
        "val_tokens": int(main.val["val_count"].sum()),
        **loss_attrs(main.lm, ex.transform), "min_count": cfg.min_count, "block_size": run.block_size,
        "dataset": cfg.dataset, "split": run.split, "val_dataset": run.val_spec, "val_split": run.val_split,
        "val_held_out": run.held_out, "tokenizer": loaded.tokenizer_name, "dtype": cfg.dtype, "device": str(run.device),
        "samples_per_class": cfg.samples_per_class, "seed": cfg.seed, "source": str(ckpt.path.resolve()),
        "ncanalyze_version": io.version(), "config_hash": config_hash(record),
        "config": json.dumps(record, sort_keys=True), **(extra_attrs or {}),
    }
    norm = layers.final_norm(model)
    ds, others = ex.datasets(classifier, bias, decoded_tokens(loaded.tokenizer, classifier.shape[0]), attrs, norm and norm[0])
    io.write_checkpoint(store, ckpt.group, ds, files, layers=others)
    ex.cleanup()
    return status


def _resume(ex: Extraction, spath: Path, record: dict, overwrite: bool, restart: bool, batch_size: int,
            train: Blocks, val: Blocks | None, group: str) -> str:
    """Load the saved state into ``ex`` if there is one for this configuration: 'resumed', else 'done' (a fresh
    start). A state under another configuration, or unreadable, or inconsistent, is refused unless ``overwrite``
    (or ``restart``) discards it."""
    if restart or not spath.exists():
        drop_state(spath)
        ex.start()
        return "done"
    try:
        arrays = load_state(spath)
        old = record_of(arrays)
        if old != record:
            raise UserError(f"an interrupted extraction of {group} used another configuration "
                            f"({differences(old, record)}); rerun with the same options to resume it, "
                            "or pass --overwrite to start again")
        blocks = val if int(arrays["phase"]) == Phase.VALIDATION and val is not None else train
        ex.load(arrays, batch_size * (blocks.block_size - 1), str(spath))
    except UserError as e:
        if not overwrite:
            raise
        log.info("%s: discarding its resume state (%s)", group, e)
        drop_state(spath)
        ex.reset()
        return "done"
    return "resumed"


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
            other = _load(ckpt, cfg, run := resolve(ckpt, cfg))
            return timed_arch(other.model, other.seconds, *_data(store, cfg, run, other.tokenizer), run.plan, cfg,
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
    """The merged train state saved as the checkpoint's resume state (:func:`~ncanalyze.store.shards.save_merged`),
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
