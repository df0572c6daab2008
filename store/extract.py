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

from ncanalyze.analyzer.errors import UserError
from ncanalyze.store import io, layers
from ncanalyze.store.data import Blocks, default_val_spec, open_blocks
from ncanalyze.store.discover import Checkpoint, discover, training_metadata
from ncanalyze.store.estimate import check_memory, estimate, state_bytes
from ncanalyze.store.load import (decoded_tokens, default_block_size, find_tokenizer, load_config, load_model,
                                  n_layers, resolve_device, weights_fingerprint)
from ncanalyze.store.passes import Extraction, train_pass, val_pass
from ncanalyze.store.resume import Phase, Saver, drop_state, record_of, state_path

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
    layers: str = setting("last", hashed=True, omit_default=True)  # recorded resolved (indices), see store/layers.py
    layers_per_pass: int | None = setting(None, hashed=True, omit_default=True)
    save_embeddings: int = setting(0, hashed=True, omit_default=True)
    embeddings_dtype: str = setting("float32", hashed=True, omit_default=True)


def config_record(ckpt: Checkpoint, cfg: ExtractConfig, device: torch.device, block_size: int, val_spec: str | None,
                  val_split: str | None) -> dict:
    """The settings that determine a checkpoint's numbers, resolved; their hash guards resumes and re-runs."""
    hashed = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.metadata["hashed"]
              and not (f.metadata.get("omit_default") and getattr(cfg, f.name) == f.default)}
    return {**hashed, "val_dataset": val_spec, "val_split": val_split, "block_size": block_size,
            "device_type": device.type, "weights": weights_fingerprint(ckpt.path)}


def config_hash(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def _differences(a: dict, b: dict) -> str:
    return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def _open(spec: str, split: str, cap: int | None, cfg: ExtractConfig, block_size: int, tokenizer) -> Blocks:
    tokenize = None if tokenizer is None else (lambda texts: tokenizer(texts)["input_ids"])
    return open_blocks(spec, split, block_size, cap, cfg.text_column, tokenize)


def extract_checkpoint(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, overwrite: bool = False,
                       announce: Callable[[object, Blocks], None] | None = None) -> str:
    """Extract one checkpoint into ``<store>/<run>/<checkpoint>``; returns 'done', 'skipped' or 'resumed'.

    ``announce(model, train_blocks)`` is called before the passes start (the estimate is logged there)."""
    device = resolve_device(cfg.device)
    config = load_config(ckpt, cfg.trust_remote_code)
    block_size = cfg.block_size or default_block_size(config)
    plan = layers.plan(cfg.layers, cfg.layers_per_pass, cfg.save_embeddings, cfg.embeddings_dtype, n_layers(config))
    if cfg.max_val_tokens == 0:
        val_spec, val_split = None, None
    elif cfg.val_dataset:
        val_spec, val_split = cfg.val_dataset, cfg.val_split
    else:
        val_spec, val_split = default_val_spec(cfg.dataset, cfg.val_split)
    record = config_record(ckpt, cfg, device, block_size, val_spec, val_split)
    layers.record_layers(record, plan)
    chash = config_hash(record)

    existing = io.group_attrs(store, ckpt.group)
    if existing and existing.get("complete") and not overwrite:
        if existing.get("config_hash") == chash:
            return "skipped"
        raise UserError(f"{ckpt.group} is already in {store} under another configuration "
                        f"({_differences(json.loads(existing.get('config', '{}')), record)}); "
                        "rerun with the same options, or pass --overwrite to replace it")
    # only now: a finished checkpoint is skipped without loading its weights
    model = load_model(ckpt, cfg.dtype, device, cfg.allow_pickle, cfg.trust_remote_code)
    tokenizer, tok_name = find_tokenizer(ckpt, cfg.tokenizer, cfg.trust_remote_code)
    spath = state_path(store, ckpt)
    out = model.get_output_embeddings()
    classifier, bias = out.weight.detach(), (out.bias.detach() if getattr(out, "bias", None) is not None else None)
    check_memory(state_bytes(*classifier.shape, cfg.samples_per_class, device), plan and plan.widest_pass, device)
    if plan is None:
        ex = Extraction(classifier.shape[0], classifier.shape[1], cfg.samples_per_class, cfg.seed, device)
    else:
        ex = layers.Layered(plan, *classifier.shape, cfg.samples_per_class, cfg.seed, device, layers.stage(spath))
    resume = None
    status = "done"
    if spath.exists():
        with np.load(spath, allow_pickle=False) as arrays:
            old = record_of(arrays)
            if old != record and not overwrite:
                raise UserError(f"an interrupted extraction of {ckpt.group} in {store} used another configuration "
                                f"({_differences(old, record)}); rerun with the same options to resume it, "
                                "or pass --overwrite to start again")
            if old == record:
                ex.load(arrays) if plan is None else ex.start(arrays)
                resume = status = "resumed"
    if plan is not None and resume is None:
        ex.start()
    saver = Saver(spath, lambda: ex.state(record), cfg.state_every)

    train = _open(cfg.dataset, cfg.split, cfg.max_train_tokens, cfg, block_size, tokenizer)
    if announce:
        announce(model, train)
    if plan is not None:
        ex.run(model, train, lambda: val_spec and _open(val_spec, val_split, cfg.max_val_tokens, cfg, block_size,
                                                        tokenizer), classifier, bias, cfg.min_count, cfg.batch_size,
               saver, ckpt.group)
    if plan is None and ex.phase == Phase.TRAIN:
        train_pass(model, train, ex, cfg.batch_size, saver, ckpt.group)
        ex.phase, ex.batches = Phase.VALIDATION, 0
        saver.maybe(force=True)
    if plan is None and ex.phase == Phase.VALIDATION:
        if val_spec is not None:
            val = _open(val_spec, val_split, cfg.max_val_tokens, cfg, block_size, tokenizer)
            val_pass(model, val, ex, classifier, bias, cfg.min_count, cfg.batch_size, saver, ckpt.group)
        ex.phase = Phase.DONE

    main = ex if plan is None else ex.main()
    attrs = {
        "run": ckpt.run, "checkpoint": ckpt.name, **training_metadata(ckpt),
        "n_params": sum(p.numel() for p in model.parameters()), "n_layers": n_layers(model.config),
        "hidden_size": int(classifier.shape[1]), "vocab_size": int(classifier.shape[0]),
        "model_type": model.config.model_type, "train_tokens": int(main.stats.count.sum()),
        "val_tokens": int(main.val["val_count"].sum()), "min_count": cfg.min_count, "block_size": block_size,
        "dataset": cfg.dataset, "split": cfg.split, "val_dataset": val_spec,
        "val_split": val_split, "tokenizer": tok_name, "dtype": cfg.dtype, "device": str(device),
        "samples_per_class": cfg.samples_per_class, "seed": cfg.seed, "source": str(ckpt.path.resolve()),
        "ncanalyze_version": io.version(), "config_hash": chash, "config": json.dumps(record, sort_keys=True),
    }
    tokens = decoded_tokens(tokenizer, classifier.shape[0])
    if plan is None:
        io.write_checkpoint(store, ckpt.group, ex.dataset(classifier, bias, tokens, attrs))
    else:
        norm = layers.final_norm(model)
        io.write_checkpoint(store, ckpt.group, *ex.datasets(classifier, bias, tokens, attrs, norm and norm[0]))
        ex.cleanup()
    drop_state(spath)
    return status


def extract(path: str | Path, store: str | Path, cfg: ExtractConfig, overwrite: bool = False) -> dict[str, str]:
    """Extract every checkpoint under ``path`` into ``store``; returns {group: status} (logged as it goes)."""
    store = Path(store)
    ckpts = discover(path)
    io.create(store)
    todo = sum(overwrite or not (io.group_attrs(store, c.group) or {}).get("complete") for c in ckpts)
    announced = False

    def announce(model, train: Blocks) -> None:  # once, at the first checkpoint that does work
        nonlocal announced
        if not announced:
            p = layers.plan(cfg.layers, cfg.layers_per_pass, cfg.save_embeddings, cfg.embeddings_dtype,
                            n_layers(model.config))
            log.info("estimate: %s", estimate(todo, model, train, cfg.batch_size, cfg.samples_per_class,
                                              cfg.max_val_tokens, store, p.widest_pass if p else 1))
            announced = True

    results = {}
    for ckpt in tqdm(ckpts, desc="checkpoints", unit="ckpt", disable=len(ckpts) < 2):
        results[ckpt.group] = extract_checkpoint(ckpt, store, cfg, overwrite, announce)
        log.info("%s: %s", ckpt.group, results[ckpt.group])
    return results
