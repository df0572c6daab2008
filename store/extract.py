"""Extraction of every checkpoint under a path into the store: the configuration and its hash, resume or skip,
the two passes (passes.py), the group write (io.py). Loading is load.py, the resume state resume.py, the estimate
estimate.py.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ncanalyze.analyzer.errors import CheckpointError, UserError
from ncanalyze.store import io
from ncanalyze.store.data import Blocks, check_block_size, default_val_spec, model_positions, open_blocks
from ncanalyze.store.discover import Checkpoint, discover, training_metadata
from ncanalyze.store.estimate import estimate
from ncanalyze.store.load import (decoded_tokens, default_block_size, find_tokenizer, load_config, load_model,
                                  n_layers, resolve_device, weights_fingerprint)
from ncanalyze.store.passes import Extraction, train_pass, val_pass
from ncanalyze.store.lock import checkpoint_lock
from ncanalyze.store.resume import (Phase, Saver, drop_state, load_state, partial_dir, prune, record_of,
                                    state_path)

log = logging.getLogger("ncanalyze")


def setting(default=None, *, hashed: bool):
    """A configuration field; ``hashed``: it determines the numbers, so it goes into the config hash (every field
    must say)."""
    return field(default=default, metadata={"hashed": hashed})


@dataclass
class ExtractConfig:
    """Everything that determines the numbers (``hashed``, and so the config hash), plus how to run."""
    dataset: str = field(metadata={"hashed": True})
    val_dataset: str | None = setting(hashed=True)
    split: str = setting("train", hashed=True)
    val_split: str = setting("validation", hashed=True)
    text_column: str = setting("text", hashed=True)
    block_size: int | None = setting(hashed=True)
    max_train_tokens: int | None = setting(hashed=True)
    max_val_tokens: int | None = setting(hashed=True)
    batch_size: int = setting(8, hashed=True)
    device: str = setting("auto", hashed=False)  # only its type (cpu/cuda) is hashed, as device_type
    dtype: str = setting("float32", hashed=True)
    samples_per_class: int = setting(8, hashed=True)
    tokenizer: str | None = setting(hashed=True)
    min_count: int = setting(1, hashed=True)
    seed: int = setting(0, hashed=True)
    allow_pickle: bool = setting(False, hashed=False)
    trust_remote_code: bool = setting(False, hashed=False)
    state_every: float = setting(120.0, hashed=False)  # seconds between resume-state saves (0: every batch)


def config_record(ckpt: Checkpoint, cfg: ExtractConfig, device: torch.device, block_size: int, val_spec: str | None,
                  val_split: str | None) -> dict:
    """The settings that determine a checkpoint's numbers, resolved; their hash guards resumes and re-runs."""
    hashed = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.metadata["hashed"]}
    return {**hashed, "val_dataset": val_spec, "val_split": val_split, "block_size": block_size,
            "device_type": device.type, "weights": weights_fingerprint(ckpt.path)}


def config_hash(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def _differences(a: dict, b: dict) -> str:
    return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def _open(spec: str, split: str, cap: int | None, cap_flag: str, cfg: ExtractConfig, block_size: int, config,
          tokenizer) -> Blocks:
    """The data as blocks, no longer than the model's positions."""
    tokenize = None if tokenizer is None else (lambda texts: tokenizer(texts)["input_ids"])
    blocks = open_blocks(spec, split, block_size, cap, cfg.text_column, tokenize, cap_flag)
    check_block_size(blocks.block_size, model_positions(config), blocks.spec, blocks.rows_from_file)
    return blocks


def _resume(ex: Extraction, spath: Path, record: dict, overwrite: bool, restart: bool, batch_size: int,
            train: Blocks, val: Blocks | None, group: str) -> str:
    """Load the saved state into ``ex`` if there is one for this configuration: 'resumed', else 'done' (a fresh
    start). A state under another configuration, or unreadable, or inconsistent, is refused unless ``overwrite``
    (or ``restart``) discards it."""
    if restart or not spath.exists():
        drop_state(spath)
        return "done"
    try:
        arrays = load_state(spath)
        old = record_of(arrays)
        if old != record:
            raise UserError(f"an interrupted extraction of {group} used another configuration "
                            f"({_differences(old, record)}); rerun with the same options to resume it, "
                            "or pass --overwrite to start again")
        blocks = val if int(arrays["phase"]) == Phase.VALIDATION and val is not None else train
        ex.load(arrays, batch_size * (blocks.block_size - 1), str(spath))
    except UserError as e:
        if not overwrite:
            raise
        log.info("%s: discarding its resume state (%s)", group, e)
        drop_state(spath)
        ex.__init__(ex.stats.count.shape[0], ex.stats.mean.shape[1], ex.reservoir.k, ex.reservoir.seed,
                    ex.stats.mean.device)
        return "done"
    return "resumed"


def _check_memory(shape: tuple[int, int], samples_per_class: int) -> None:
    """Refuse a reservoir that cannot fit in memory, before any work."""
    import psutil

    vocab, d = shape
    need = vocab * samples_per_class * (4 * d + 16)
    if need > psutil.virtual_memory().available:
        raise UserError(f"--samples-per-class {samples_per_class} needs {need / 2**30:,.1f} GiB for {vocab:,} classes "
                        f"of width {d} (this machine has {psutil.virtual_memory().available / 2**30:,.1f} GiB free); "
                        "lower it")


def resolve(ckpt: Checkpoint, cfg: ExtractConfig) -> tuple:
    """What ``cfg`` means for ``ckpt`` here, without loading its weights: (device, model config, block size,
    validation spec, validation split, configuration record)."""
    device = resolve_device(cfg.device)
    config = load_config(ckpt, cfg.trust_remote_code)
    block_size = cfg.block_size or default_block_size(config)
    if cfg.max_val_tokens == 0:
        val_spec, val_split = None, None
    elif cfg.val_dataset:
        val_spec, val_split = cfg.val_dataset, cfg.val_split
    else:
        val_spec, val_split = default_val_spec(cfg.dataset, cfg.val_split)
    return device, config, block_size, val_spec, val_split, config_record(ckpt, cfg, device, block_size, val_spec,
                                                                          val_split)


def check_options(cfg: ExtractConfig) -> None:
    """Refuse, before any work, options that cannot give a result."""
    if cfg.max_train_tokens is not None and cfg.min_count > cfg.max_train_tokens:
        raise UserError(f"--min-count {cfg.min_count} is above --max-train-tokens {cfg.max_train_tokens}, so no class "
                        "could be kept: lower --min-count")


def extract_checkpoint(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, overwrite: bool = False,
                       restart: bool = False, announce: Callable[[object, Blocks], None] | None = None) -> str:
    """Extract one checkpoint into ``<store>/<run>/<checkpoint>``; returns 'done', 'skipped' or 'resumed'.

    One writer at a time per checkpoint (a lock beside the store; a second one waits, then finds it done).
    ``overwrite`` replaces a group extracted under another configuration, ``restart`` discards a saved resume
    state; ``announce(model, train_blocks)`` is called before the passes start (the estimate is logged there)."""
    device, config, block_size, val_spec, val_split, record = resolve(ckpt, cfg)
    chash = config_hash(record)
    spath = state_path(store, ckpt)
    with checkpoint_lock(spath.with_suffix(".lock"), ckpt.group):
        io.recover_swap(store, ckpt.group, spath.with_suffix(".zarr"))
        existing = io.group_attrs(store, ckpt.group, corrupt_ok=overwrite)
        if existing and existing.get("complete") and not overwrite:
            if existing.get("config_hash") == chash:
                drop_state(spath)  # a state left by a run killed after its write
                return "skipped"
            raise UserError(f"{ckpt.group} is already in {store} under another configuration "
                            f"({_differences(json.loads(existing.get('config', '{}')), record)}); "
                            "rerun with the same options, or pass --overwrite to replace it")
        # only now: a finished checkpoint is skipped without loading its weights
        model = load_model(ckpt, cfg.dtype, device, cfg.allow_pickle, cfg.trust_remote_code)
        tokenizer, tok_name = find_tokenizer(ckpt, cfg.tokenizer, cfg.trust_remote_code)
        out = model.get_output_embeddings()
        classifier = out.weight.detach()
        bias = out.bias.detach() if getattr(out, "bias", None) is not None else None
        _check_memory(classifier.shape, cfg.samples_per_class)
        train = _open(cfg.dataset, cfg.split, cfg.max_train_tokens, "--max-train-tokens", cfg, block_size, config,
                      tokenizer)
        val = None if val_spec is None else _open(val_spec, val_split, cfg.max_val_tokens, "--max-val-tokens", cfg,
                                                  block_size, config, tokenizer)
        ex = Extraction(classifier.shape[0], classifier.shape[1], cfg.samples_per_class, cfg.seed, device)
        status = _resume(ex, spath, record, overwrite, restart, cfg.batch_size, train, val, ckpt.group)
        saver = Saver(spath, lambda: ex.state(record), cfg.state_every)
        if announce:
            announce(model, train)
        with saver.on_interrupt():
            if ex.phase == Phase.TRAIN:
                train_pass(model, train, ex, cfg.batch_size, saver, ckpt.group)
                if not (ex.stats.count >= cfg.min_count).any():
                    raise UserError(f"no class has --min-count {cfg.min_count} train tokens in {ckpt.group} (the most "
                                    f"is {int(ex.stats.count.max())}): lower --min-count")
                ex.next_phase(Phase.VALIDATION)
                saver.maybe(force=True)
            if ex.phase == Phase.VALIDATION:
                if val is not None:
                    val_pass(model, val, ex, classifier, bias, cfg.min_count, cfg.batch_size, saver, ckpt.group)
                ex.next_phase(Phase.DONE)
        attrs = {
            "run": ckpt.run, "checkpoint": ckpt.name, **training_metadata(ckpt),
            "n_params": sum(p.numel() for p in model.parameters()), "n_layers": n_layers(model.config),
            "hidden_size": int(classifier.shape[1]), "vocab_size": int(classifier.shape[0]),
            "model_type": model.config.model_type, "train_tokens": int(ex.stats.count.sum()),
            "val_tokens": int(ex.val["val_count"].sum()), "min_count": cfg.min_count, "block_size": block_size,
            "dataset": cfg.dataset, "split": cfg.split, "val_dataset": val_spec,
            "val_split": val_split, "tokenizer": tok_name, "dtype": cfg.dtype, "device": str(device),
            "samples_per_class": cfg.samples_per_class, "seed": cfg.seed, "source": str(ckpt.path.resolve()),
            "ncanalyze_version": io.version(), "config_hash": chash, "config": json.dumps(record, sort_keys=True),
        }
        ds = ex.dataset(classifier, bias, decoded_tokens(tokenizer, classifier.shape[0]), attrs)
        io.write_checkpoint(store, ckpt.group, ds, spath.with_suffix(".zarr"))
        drop_state(spath)
        return status


def extract(path: str | Path, store: str | Path, cfg: ExtractConfig, overwrite: bool = False,
            restart: bool = False, shards: int = 1) -> dict[str, str]:
    """Extract every checkpoint under ``path`` into ``store``; returns {group: status} (logged as it goes).
    ``shards`` > 1 cuts each checkpoint's train stream into that many parts, run one after another and merged
    exactly (shards.py; the same computation a cluster runs in parallel).

    A checkpoint that is bad in itself (a CheckpointError: corrupt weights, NaN features) fails alone, as
    'failed: <why>', and the others go on; any other error stops the run."""
    store = Path(store)
    ckpts = discover(path)
    check_options(cfg)
    io.prepare(store, partial_dir(store))
    todo = sum(overwrite or not (io.group_attrs(store, c.group, corrupt_ok=True) or {}).get("complete")
               for c in ckpts)
    announced = False

    def announce(model, train: Blocks) -> None:  # once, at the first checkpoint that does work
        nonlocal announced
        if not announced:
            log.info("estimate: %s", estimate(todo, model, train, cfg.batch_size, cfg.samples_per_class,
                                              cfg.max_val_tokens, store))
            announced = True

    results = {}
    try:
        for ckpt in tqdm(ckpts, desc="checkpoints", unit="ckpt", disable=len(ckpts) < 2):
            try:
                if shards > 1:
                    from ncanalyze.store.shards import extract_sharded
                    results[ckpt.group] = extract_sharded(ckpt, store, cfg, shards, overwrite, restart)
                else:
                    results[ckpt.group] = extract_checkpoint(ckpt, store, cfg, overwrite, restart, announce)
            except CheckpointError as e:
                if len(ckpts) == 1:
                    raise
                results[ckpt.group] = f"failed: {e}"
            log.info("%s: %s", ckpt.group, results[ckpt.group])
    finally:
        prune(partial_dir(store))
    return results
