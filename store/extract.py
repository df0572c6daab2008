"""Extraction of every checkpoint under a path into the store: the configuration and its hash, resume or skip,
the two passes (passes.py), the group write (io.py). Loading is load.py, the resume state resume.py, the estimate
estimate.py.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ncanalyze.analyzer.errors import CheckpointError, UserError
from ncanalyze.store import io, layers, tokens
from ncanalyze.store.data import (Blocks, check_block_size, default_val_spec, is_token_file, model_positions,
                                  open_blocks)
from ncanalyze.store.discover import Checkpoint, discover, training_metadata
from ncanalyze.store.estimate import START, check_memory, estimate, measure_costs, progress, state_bytes
from ncanalyze.store.load import (decoded_tokens, default_block_size, find_tokenizer, head, load_config, load_model,
                                  n_layers, resolve_device, weights_fingerprint)
from ncanalyze.store.loss import loss_attrs
from ncanalyze.store.passes import run_passes
from ncanalyze.store.running import Extraction
from ncanalyze.store.lock import checkpoint_lock
from ncanalyze.store.resume import (DeferredInterrupt, Phase, Saver, drop_state, load_state, partial_dir, prune, record_of,
                                    state_path)

log = logging.getLogger("ncanalyze")


def setting(default=None, *, hashed: bool, omit_default: bool = False):
    """A configuration field; ``hashed``: it determines the numbers, so it goes into the config hash (every field
    must say). ``omit_default``: a hashed field left out of the record (and so of the hash) while it has its default
    value, so that adding it keeps the hash of every store made before it existed; any other value is recorded."""
    return field(default=default, metadata={"hashed": hashed, "omit_default": omit_default})


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
    keep_linebreaks: bool = setting(True, hashed=True, omit_default=True)  # plain text keeps its "\n" (run_clm)
    tag: str | None = setting(hashed=False)  # where, not what: tagged checkpoints live at <run>@<tag>/<checkpoint>
    token_cache: bool = setting(True, hashed=False)  # text tokenized once into <store>.tokens/ (the same blocks)
    layers: str = setting("last", hashed=True, omit_default=True)  # recorded resolved (indices), see store/layers.py
    layers_per_pass: int | None = setting(None, hashed=True, omit_default=True)
    save_embeddings: int = setting(0, hashed=True, omit_default=True)
    embeddings_dtype: str = setting("float32", hashed=True, omit_default=True)


def config_record(ckpt: Checkpoint | None, cfg: ExtractConfig, device: torch.device, block_size: int,
                  val_spec: str | None, val_split: str | None, weights: str | None = None) -> dict:
    """The settings that determine a checkpoint's numbers, resolved; their hash guards resumes and re-runs.
    ``weights``: the weights' fingerprint when already known (else read from ``ckpt``)."""
    hashed = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.metadata["hashed"]
              and not (f.metadata.get("omit_default") and getattr(cfg, f.name) == f.default)}
    return {**hashed, "val_dataset": val_spec, "val_split": val_split, "block_size": block_size,
            "device_type": device.type, "weights": weights or weights_fingerprint(ckpt.path)}


def val_data(cfg: ExtractConfig) -> tuple[str | None, str | None]:
    """(spec, split) of the validation data: none with --max-val-tokens 0, else --val-dataset, else beside/of
    --dataset."""
    if cfg.max_val_tokens == 0:
        return None, None
    if cfg.val_dataset:
        return cfg.val_dataset, cfg.val_split
    return default_val_spec(cfg.dataset, cfg.val_split)


def config_hash(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def _differences(a: dict, b: dict) -> str:
    return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def _open(spec: str, split: str, cap: int | None, cap_flag: str, cfg: ExtractConfig, block_size: int, config,
          tokenizer, store: Path | None = None) -> Blocks:
    """The data as blocks, no longer than the model's positions; text through the token cache beside ``store``."""
    tokenize = None if tokenizer is None else (lambda texts: tokenizer(texts)["input_ids"])
    blocks = open_blocks(spec, split, block_size, cap, cfg.text_column, tokenize, cap_flag,
                         keep_linebreaks=cfg.keep_linebreaks)
    check_block_size(blocks.block_size, model_positions(config), blocks.spec, blocks.rows_from_file)
    if store is None or not cfg.token_cache or tokenizer is None or is_token_file(spec):
        return blocks
    return tokens.cached(store, blocks, tokens.cache_key(spec, split, cfg.text_column, tokenizer, block_size, cap,
                                                         cfg.keep_linebreaks))


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
                            f"({_differences(old, record)}); rerun with the same options to resume it, "
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


def resolve(ckpt: Checkpoint, cfg: ExtractConfig) -> tuple:
    """What ``cfg`` means for ``ckpt`` here, without loading its weights: (device, model config, block size,
    validation spec, validation split, configuration record)."""
    device = resolve_device(cfg.device)
    config = load_config(ckpt, cfg.trust_remote_code)
    block_size = cfg.block_size or default_block_size(config)
    val_spec, val_split = val_data(cfg)
    record = config_record(ckpt, cfg, device, block_size, val_spec, val_split)
    layers.record_layers(record, layer_plan(cfg, config))
    return device, config, block_size, val_spec, val_split, record


def layer_plan(cfg: ExtractConfig, config) -> layers.Plan:
    """The layers to extract and how (the default: the last layer only)."""
    return layers.plan(cfg.layers, cfg.layers_per_pass, cfg.save_embeddings, cfg.embeddings_dtype, n_layers(config))


def extract_checkpoint(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, overwrite: bool = False,
                       restart: bool = False, announce: Callable[..., None] | None = None,
                       interrupt: DeferredInterrupt | None = None, extra_attrs: dict | None = None) -> str:
    """Extract one checkpoint into ``<store>/<run>/<checkpoint>``; returns 'done', 'skipped' or 'resumed'.

    One writer at a time per checkpoint (a lock beside the store; a second one waits, then finds it done).
    ``overwrite`` replaces a group extracted under another configuration, ``restart`` discards a saved resume
    state; ``announce(model, seconds_to_load, train, val, plan)`` is called before the passes start (the estimate
    is logged there, :func:`announcer`); a pending ``interrupt`` (Ctrl-C) is taken at the next batch boundary, after
    saving the state; ``extra_attrs`` go into the group's attributes last (a Hub revision's origin and step)."""
    device, config, block_size, val_spec, val_split, record = resolve(ckpt, cfg)
    plan = layer_plan(cfg, config)
    chash = config_hash(record)
    spath = state_path(store, ckpt)
    with checkpoint_lock(spath.with_suffix(".lock"), ckpt.group):
        io.recover_swap(store, ckpt.group, spath.with_suffix(".zarr"))
        existing = io.group_attrs(store, ckpt.group, corrupt_ok=overwrite)
        if existing and existing.get("complete") and not overwrite:
            if existing.get("config_hash") == chash:
                drop_state(spath)  # a state (or a staged copy) left by a run killed after its write
                for stale in (spath.with_suffix(".zarr"), spath.with_suffix(".zarr.old")):
                    shutil.rmtree(stale, ignore_errors=True)
                return "skipped"
            keep_both = "" if cfg.tag else "; to keep both (e.g. another dataset), pass --tag NAME"
            raise UserError(f"{ckpt.group} is already in {store} under another configuration "
                            f"({_differences(json.loads(existing.get('config', '{}')), record)}); "
                            f"rerun with the same options, or pass --overwrite to replace it{keep_both}")
        # only now: a finished checkpoint is skipped without loading its weights
        started = time.perf_counter()
        model = load_model(ckpt, cfg.dtype, device, cfg.allow_pickle, cfg.trust_remote_code)
        tokenizer, tok_name = find_tokenizer(ckpt, cfg.tokenizer, cfg.trust_remote_code)
        loaded = time.perf_counter() - started
        classifier, bias = head(model)
        check_memory(state_bytes(*classifier.shape, cfg.samples_per_class, device), plan and plan.widest_pass, device)
        train = _open(cfg.dataset, cfg.split, cfg.max_train_tokens, "--max-train-tokens", cfg, block_size, config,
                      tokenizer, store)
        val = None if val_spec is None else _open(val_spec, val_split, cfg.max_val_tokens, "--max-val-tokens", cfg,
                                                  block_size, config, tokenizer, store)
        if announce:  # before the state is made: the estimate times a few batches on a scratch state of its own
            announce(model, loaded, train, val, plan)
        ex = Extraction(plan, *classifier.shape, cfg.samples_per_class, cfg.seed, device, layers.stage(spath))
        status = _resume(ex, spath, record, overwrite, restart, cfg.batch_size, train, val, ckpt.group)
        saver = Saver(spath, lambda: ex.state(record), cfg.state_every, interrupt)
        run_passes(model, train, val, ex, classifier, bias, cfg.min_count, cfg.batch_size, saver, ckpt.group)
        main = ex.main()
        attrs = {
            "run": ckpt.run, "tag": cfg.tag, "checkpoint": ckpt.name, **training_metadata(ckpt),
            "n_params": sum(p.numel() for p in model.parameters()), "n_layers": n_layers(model.config),
            "hidden_size": int(classifier.shape[1]), "vocab_size": int(classifier.shape[0]),
            "model_type": model.config.model_type, "train_tokens": int(main.stats.count.sum()),
            "val_tokens": int(main.val["val_count"].sum()),
            **loss_attrs(main.lm, ex.transform), "min_count": cfg.min_count, "block_size": block_size,
            "dataset": cfg.dataset, "split": cfg.split, "val_dataset": val_spec,
            "val_split": val_split, "tokenizer": tok_name, "dtype": cfg.dtype, "device": str(device),
            "samples_per_class": cfg.samples_per_class, "seed": cfg.seed, "source": str(ckpt.path.resolve()),
            "ncanalyze_version": io.version(), "config_hash": chash, "config": json.dumps(record, sort_keys=True),
            **(extra_attrs or {}),
        }
        tokens_ = decoded_tokens(tokenizer, classifier.shape[0])
        norm = layers.final_norm(model)
        ds, others = ex.datasets(classifier, bias, tokens_, attrs, norm and norm[0])
        io.write_checkpoint(store, ckpt.group, ds, spath.with_suffix(".zarr"), layers=others)
        ex.cleanup()
        drop_state(spath)
        return status


_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def tagged(ckpts: list[Checkpoint], tag: str | None) -> list[Checkpoint]:
    """With ``tag``, each checkpoint's run becomes ``<run>@<tag>``: the group ``<run>@<tag>/<checkpoint>`` (and its
    resume state) is distinct from the untagged ``<run>/<checkpoint>`` and from other tags."""
    if tag is None:
        return ckpts
    if not _TAG.match(tag):
        raise UserError(f"--tag {tag!r} is not a plain name: use letters, digits and _ . + - (e.g. --tag kjv)")
    return [replace(c, run=f"{c.run}@{tag}") for c in ckpts]


def announcer(todo: list[Checkpoint], cfg: ExtractConfig, store: Path, restart: bool = False) -> Callable[..., None]:
    """``announce(model, loaded, train, val, plan)`` for :func:`extract_checkpoint`: once, at the first checkpoint
    that does work, times its passes (:func:`~ncanalyze.store.estimate.measure_costs`, only where the data's length
    is known) and logs the estimate for the checkpoints ``todo``, less what their resume states hold (unless
    ``restart`` discards them)."""
    announced = False

    def announce(model, loaded: float, train: Blocks, val: Blocks | None, plan: layers.Plan | None) -> None:
        nonlocal announced
        if announced:
            return
        announced = True
        device = next(model.parameters()).device
        vocab, d = model.get_output_embeddings().weight.shape
        known = train.total is not None and (val is None or val.total is not None)
        costs = measure_costs(model, loaded, train, val, cfg.batch_size, cfg.samples_per_class, cfg.min_count,
                              cfg.seed, partial_dir(store)) if known else None
        at = [START if restart else progress(state_path(store, c)) for c in todo]
        passes = None if plan is None else [len(p) for p in plan.passes]
        extra = {} if plan is None else {"embeddings": plan.save_embeddings, "embeddings_dtype": plan.embeddings_dtype}
        per_layer, shared = state_bytes(vocab, d, cfg.samples_per_class, device)
        k = 1 if plan is None else plan.widest_pass
        log.info("estimate: %s; state ~%s MB on %s (%d layer(s))",
                 estimate(at, costs, train, val, cfg.batch_size, vocab, d, cfg.samples_per_class, store, passes,
                          **extra), f"{(k * per_layer + shared) / 1e6:,.0f}", device, k)

    return announce


def check_settings(cfg: ExtractConfig, store: Path, shards: int = 1) -> None:
    """What can be refused before any work: settings that can't go together, and a store that can't be written."""
    if cfg.max_train_tokens is not None and cfg.min_count > cfg.max_train_tokens:
        raise UserError(f"--min-count {cfg.min_count} is above --max-train-tokens {cfg.max_train_tokens}, so no class "
                        "could be kept: lower --min-count")
    if shards > 1 and (cfg.layers != "last" or cfg.save_embeddings):
        raise UserError("--shards splits the last layer's statistics only: drop --layers/--save-embeddings, or "
                        "--shards")
    io.prepare(store, partial_dir(store))


def extract(path: str | Path, store: str | Path, cfg: ExtractConfig, overwrite: bool = False,
            restart: bool = False, shards: int = 1) -> dict[str, str]:
    """Extract every checkpoint under ``path`` into ``store``; returns {group: status} (logged as it goes).
    ``shards`` > 1 cuts each checkpoint's train stream into that many parts, run one after another and merged
    exactly (shards.py; the same computation a cluster runs in parallel).

    A checkpoint that is bad in itself (a CheckpointError: corrupt weights, NaN features) fails alone, as
    'failed: <why>', and the others go on; any other error stops the run."""
    store = Path(store)
    ckpts = tagged(discover(path), cfg.tag)
    check_settings(cfg, store, shards)
    todo = [c for c in ckpts if overwrite or not (io.group_attrs(store, c.group, corrupt_ok=True) or {}).get("complete")]
    announce = announcer(todo, cfg, store, restart)
    results = {}
    try:
        with DeferredInterrupt() as interrupt:
            for ckpt in tqdm(ckpts, desc="checkpoints", unit="ckpt", disable=len(ckpts) < 2):
                results[ckpt.group] = _one(ckpt, store, cfg, overwrite, restart, announce, interrupt, len(ckpts),
                                           shards)
                log.info("%s: %s", ckpt.group, results[ckpt.group])
    finally:
        prune(partial_dir(store))
    return results


def _one(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, overwrite: bool, restart: bool, announce,
         interrupt: DeferredInterrupt, n: int, shards: int = 1) -> str:
    """One checkpoint's status; a CheckpointError is its status ('failed: why') when it is one of several."""
    try:
        if shards > 1:
            from ncanalyze.store.shards import extract_sharded

            return extract_sharded(ckpt, store, cfg, shards, overwrite, restart)
        return extract_checkpoint(ckpt, store, cfg, overwrite, restart, announce, interrupt)
    except CheckpointError as e:
        if n == 1:
            raise
        return f"failed: {e}"
