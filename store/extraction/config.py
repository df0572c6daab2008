"""An extraction's configuration: the settings (``ExtractConfig``), the record of those that determine the numbers and
its hash, what they resolve to for one checkpoint, the data they open, and what a checkpoint already on disk means
under them (:func:`refusal`, where :func:`ncanalyze.store.store.decide` refuses it).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import fields
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from ncanalyze.core.errors import UserError
from ncanalyze.store.data import token_cache as tokens
from ncanalyze.store.data.blocks import (
    VAL_NAMES,
    Blocks,
    base_split,
    check_block_size,
    is_token_file,
    open_blocks,
    spread,
)
from ncanalyze.store.data.identity import data_name, data_sha256
from ncanalyze.store.extraction import layers
from ncanalyze.store.extraction.labels import Labels, resolve_labels
from ncanalyze.store.extraction.settings import ExtractConfig
from ncanalyze.store.sources.anatomy import default_block_size, model_positions, n_layers
from ncanalyze.store.sources.discover import Checkpoint
from ncanalyze.store.sources.load import load_config, resolve_device, weights_fingerprint
from ncanalyze.store.store import Store

log = logging.getLogger(__name__)


def config_record(ckpt: Checkpoint | None, cfg: ExtractConfig, device: torch.device, block_size: int,
                  val_spec: str | None, val_split: str | None, plan: layers.Plan, weights: str | None = None,
                  held_out: int | None = None) -> dict:
    """The settings that determine a checkpoint's numbers, every hashed one, resolved; their hash guards resumes and
    re-runs.

    Parameters
    ----------
    ckpt
        The checkpoint (its weights are fingerprinted unless ``weights`` is given).
    cfg
        The configuration.
    device
        The device it runs on (only its type is recorded).
    block_size, val_spec, val_split
        The block size and the validation data, resolved.
    plan
        The layer plan: ``layers`` is recorded as its sites (Site.recorded: the residual ones as their indices,
        ``--layers -1`` as the last layer's; ``--sites`` is recorded there, resolved, not as a setting of its own).
    weights
        The weights' fingerprint when already known.
    held_out
        The percentage of the train data held out as validation (:func:`validation_of`): then ``split`` is the
        train slice left; ``val_held_out`` is recorded either way.

    Returns
    -------
    dict
        The record (JSON-serialisable).
    """
    hashed = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.metadata["hashed"] and f.name != "labels"}
    record = {**hashed, "layers": [s.recorded for s in plan.layers], "cap_mode": cap_mode(cfg), "val_dataset": val_spec,
              "val_split": val_split, "val_held_out": held_out, "block_size": block_size, "device_type": device.type,
              "weights": weights or weights_fingerprint(ckpt.path, ckpt.base)}
    if held_out is not None:
        record["split"] = f"{cfg.split}[{held_out}%:]"
    record |= {"dataset": data_name(cfg.dataset), "val_dataset": data_name(val_spec),  # by content, not by path
               "data_sha256": data_sha256(cfg.dataset, val_spec)}
    return record | Labels(cfg.labels).record()


def cap_mode(cfg: ExtractConfig) -> str | None:
    """How a token cap reads the data (``spread`` or ``prefix``; the group's attribute ``cap_mode``), None without a
    cap (where the mode reads nothing different, so two records without a cap never differ by it)."""
    return cfg.cap_mode if cfg.max_train_tokens is not None or cfg.max_val_tokens else None


def config_hash(record: dict) -> str:
    """The hash of a configuration record.

    Parameters
    ----------
    record
        A record of :func:`config_record`.

    Returns
    -------
    str
        16 hex digits of the SHA-256 of its sorted JSON.
    """
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def differences(a: dict, b: dict) -> str:
    """What differs between two configuration records.

    Parameters
    ----------
    a, b
        The records (old and new).

    Returns
    -------
    str
        ``key: old -> new`` for every key where they differ, comma-separated.
    """
    data = ", ".join(str(b[k]) for k in ("dataset", "val_dataset") if b.get(k))
    said = {"data_sha256": f" (the content of the data changed: {data})"}
    return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}{said.get(k, '')}" for k in sorted(set(a) | set(b))
                     if a.get(k) != b.get(k))


class Validation(NamedTuple):
    """Where validation comes from, and the train split that goes with it."""
    spec: str | None         # the validation data (None: none)
    split: str | None        # its split (a slice of the train split when held out)
    train_split: str         # the train split: --split, or its slice left after the held-out part
    held_out: int | None     # the percentage of the train data held out as validation, or None


def validation_of(spec: str, split: str, val_split: str, percentage: int) -> Validation:
    """The validation data of ``spec`` when none is given: a sibling file (``val.bin`` beside ``train.bin``), else
    ``val_split`` where the data has it, else, as ``run_clm``'s ``validation_split_percentage``, the first
    ``percentage`` % of the train data held out (``train[:P%]``, and ``train[P%:]`` is trained on), so validation is
    never the train tokens.

    Parameters
    ----------
    spec, split, val_split
        ``--dataset``, ``--split`` and ``--val-split``.
    percentage
        ``--val-split-percentage`` (0: nothing held out; a token file without a sibling is then refused, and
        other data is validated at ``val_split``).

    Returns
    -------
    Validation
        The validation spec and split, the train split and the percentage held out (None when nothing is).
    """
    p = Path(spec)
    if p.is_file():
        stem = p.name
        for a in ("train", "training"):
            for v in VAL_NAMES if a in stem else ():
                cand = p.with_name(stem.replace(a, v, 1))
                if cand.is_file():
                    return Validation(str(cand), val_split, split, None)
    splits = _local_splits(p, split)
    if splits is None or base_split(val_split) in splits:  # a Hub dataset: its split, or datasets' refusal
        return Validation(spec, val_split, split, None)
    if percentage == 0:
        if is_token_file(spec):
            raise UserError(f"no validation tokens found beside {spec} (looked for val/validation/valid/test files "
                            "named like it); pass --val-dataset FILE, --val-split-percentage P to hold out P% of it, "
                            "or --max-val-tokens 0 to skip NC4")
        return Validation(spec, val_split, split, None)
    if "[" in split:
        raise UserError(f"--split {split!r} is a slice and {spec} has no split {val_split!r} to validate on; pass "
                        f"--val-split with a disjoint slice (e.g. --split '{base_split(split)}[5%:]' --val-split "
                        f"'{base_split(split)}[:5%]'), or --val-dataset FILE")
    return Validation(spec, f"{split}[:{percentage}%]", f"{split}[{percentage}%:]", percentage)


def _local_splits(p: Path, split: str) -> set[str] | None:
    """The splits local data has: a file or a saved ``Dataset`` is the one split it is read as (``--split``'s name); a
    saved ``DatasetDict`` its splits; a folder of data files the splits ``datasets`` infers from the file names. None
    for a Hub dataset, or a folder whose splits cannot be told (its read will say why)."""
    if p.is_file() or (p / "state.json").is_file():
        return {base_split(split)}
    if (p / "dataset_dict.json").is_file():
        try:
            return set(json.loads((p / "dataset_dict.json").read_text())["splits"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    if not p.is_dir():
        return None
    from datasets.data_files import get_data_patterns

    try:
        return set(get_data_patterns(str(p)))
    except Exception:  # noqa: BLE001 - datasets' EmptyDatasetError and kin: the read names the problem
        return None


def val_data(cfg: ExtractConfig) -> Validation:
    """The validation data of a configuration.

    Parameters
    ----------
    cfg
        The configuration.

    Returns
    -------
    Validation
        None with ``--max-val-tokens 0``, else ``--val-dataset``, else beside, of or held out of ``--dataset``
        (:func:`validation_of`).
    """
    if cfg.max_val_tokens == 0:
        return Validation(None, None, cfg.split, None)
    if cfg.val_dataset:
        return Validation(cfg.val_dataset, cfg.val_split, cfg.split, None)
    return validation_of(cfg.dataset, cfg.split, cfg.val_split, cfg.val_split_percentage)


def held_out_line(cfg: ExtractConfig) -> str | None:
    """The line that says what is held out of the train data as validation, or None when nothing is.

    Parameters
    ----------
    cfg
        The configuration.

    Returns
    -------
    str or None
        The line.
    """
    v = val_data(cfg)
    if v.held_out is None:
        return None
    what = "blocks" if is_token_file(cfg.dataset) else "rows"
    return (f"validation: {cfg.dataset} has no validation data beside or in it, so the first {v.held_out}% of its "
            f"{what} ({v.split!r}) is held out as validation and the train pass reads the rest ({v.train_split!r}), "
            "disjoint; --val-dataset, --val-split or --val-split-percentage change this")


def layer_plan(cfg: ExtractConfig, n: int | None) -> layers.Plan:
    """The layers to extract and how.

    Parameters
    ----------
    cfg
        The configuration (``layers``, ``sites``, ``layers_per_pass``, ``save_embeddings``, ``embeddings_dtype``).
    n
        The model's number of blocks (None: not known).

    Returns
    -------
    layers.Plan
        The plan.
    """
    return layers.plan(cfg.layers, cfg.layers_per_pass, cfg.save_embeddings, cfg.embeddings_dtype, n, cfg.sites)


class Resolved(NamedTuple):
    """What a configuration means for one checkpoint here."""
    device: torch.device
    config: object            # the model's transformers config
    block_size: int
    split: str                # the train split (a slice of --split when validation is held out of it)
    val_spec: str | None
    val_split: str | None
    held_out: int | None      # the percentage held out as validation, or None
    record: dict              # config_record
    plan: layers.Plan         # layer_plan
    labels: Labels = Labels()  # --labels, checked against the train data


def rows_width(cfg: ExtractConfig) -> int | None:
    """The width of the rows of a 2-D token array given as ``--dataset``: the block length actually used, recorded
    in its place (``--block-size`` does not apply; one that differs is refused). None for any other data (or a file
    open_data will refuse).

    Parameters
    ----------
    cfg
        The configuration.

    Returns
    -------
    int or None
        The width, or None.
    """
    if not (cfg.dataset.endswith(".npy") and Path(cfg.dataset).is_file()):
        return None
    try:
        shape = np.load(cfg.dataset, mmap_mode="r", allow_pickle=False).shape
    except (OSError, ValueError, EOFError, AttributeError):
        return None
    if len(shape) != 2:
        return None
    if cfg.block_size is not None and cfg.block_size != shape[1]:
        raise UserError(f"--block-size {cfg.block_size} does not apply to {cfg.dataset}, a 2-D token array whose rows "
                        f"are the blocks ({shape[1]} tokens each); drop --block-size")
    return int(shape[1])


def resolve(ckpt: Checkpoint | None, cfg: ExtractConfig, model_config=None, device: torch.device | None = None,
            weights: str | None = None, known: tuple[int | None, int | None] | None = None) -> Resolved:
    """What ``cfg`` means for ``ckpt`` here, without loading its weights; or, for the model a Trainer is training
    (the callback: no checkpoint folder), for its live ``model_config``, ``device`` and ``weights``. Called once per
    checkpoint, by :func:`~ncanalyze.store.extraction.job.make_job` alone: everything downstream is given its Job.

    Parameters
    ----------
    ckpt
        The checkpoint (None for a live model).
    cfg
        The configuration.
    model_config
        The model's transformers config [default: read from ``ckpt``].
    device
        Where it runs [default: ``cfg.device`` resolved].
    weights
        The record's ``weights`` [default: the fingerprint of ``ckpt``'s weight files].
    known
        (blocks, block size) of a model known without its files (a Hub revision in the store, not fetched): no
        config is read (``Resolved.config`` is None).

    Returns
    -------
    Resolved
        Device, model config, block size, train split, validation spec and split, the percentage held out,
        configuration record and layer plan.
    """
    labels = resolve_labels(cfg.labels, cfg.dataset)  # a bad label file is said before any work
    device = device if device is not None else resolve_device(cfg.device)
    if known is not None:
        config, (depth, default) = model_config, known
    else:
        config = model_config if model_config is not None else load_config(ckpt, cfg.trust_remote_code)
        depth, default = n_layers(config), None
    block_size = rows_width(cfg) or cfg.block_size or (default if known is not None else default_block_size(config))
    val = val_data(cfg)
    plan = layer_plan(cfg, depth)
    record = config_record(ckpt, cfg, device, block_size, val.spec, val.split, plan, weights=weights,
                           held_out=val.held_out)
    return Resolved(device, config, block_size, val.train_split, val.spec, val.split, val.held_out, record, plan,
                    labels)


def open_data(spec: str, split: str, cap: int | None, cap_flag: str, cfg: ExtractConfig, block_size: int, config,
              tokenizer, store: Store | None = None) -> Blocks:
    """The data as blocks, no longer than the model's positions; text through the token cache beside ``store``.

    Parameters
    ----------
    spec, split
        The data (any form ``--dataset`` takes) and its split.
    cap, cap_flag
        The cap on tokens read, and its flag (named in errors).
    cfg
        The configuration (text column, line breaks, token cache, and ``cap_mode`` with ``seed``: a cap reads blocks
        spread over the whole split, from the cache of the whole split for text, or its first blocks).
    block_size
        Tokens per block.
    config
        The model's transformers config (its positions).
    tokenizer
        The tokenizer for text (None: token ids only).
    store
        The store, beside which text is cached tokenized (None: no cache).

    Returns
    -------
    Blocks
        The blocks.
    """
    tokenize = None if tokenizer is None else (lambda texts: tokenizer(texts, return_attention_mask=False)["input_ids"])
    blocks = open_blocks(spec, split, block_size, cap, cfg.text_column, tokenize, cap_flag,
                         keep_linebreaks=cfg.keep_linebreaks, cap_mode="prefix")  # the cap is applied below
    check_block_size(blocks.block_size, model_positions(config), blocks.spec, blocks.rows_from_file)
    if store is None or not cfg.token_cache or tokenizer is None or is_token_file(spec):
        return spread(blocks, cfg.seed) if cfg.cap_mode == "spread" else blocks
    if cfg.cap_mode == "prefix":  # the cache holds the first blocks only (not the whole split: no split counts)
        return tokens.cached(store.layout.tokens, blocks, tokens.cache_key(spec, split, cfg.text_column, tokenizer,
                                                                          block_size, cap, cfg.keep_linebreaks))
    whole = tokens.cached(store.layout.tokens, dataclasses.replace(blocks, max_blocks=None), tokens.cache_key(
        spec, split, cfg.text_column, tokenizer, block_size, None, cfg.keep_linebreaks))  # the whole split, once
    return spread(dataclasses.replace(whole, max_blocks=blocks.max_blocks, whole=whole), cfg.seed)


def open_inputs(store: Store | None, cfg: ExtractConfig, run: Resolved, tokenizer,
                flags: tuple[str, str] = ("--max-train-tokens", "--max-val-tokens"),
                validation: bool = True) -> tuple[Blocks, Blocks | None]:
    """The train and validation blocks of a resolved configuration (none without validation data), text through the
    token cache beside ``store``: the one opening of an extraction's inputs (a checkpoint, its estimate, its shards,
    the Trainer callback).

    Parameters
    ----------
    store
        The store (None: no token cache).
    cfg, run
        The configuration and what it resolved to (:func:`resolve`).
    tokenizer
        The tokenizer for text (None: token ids only).
    flags
        The caps' names in errors (the command's flags, or the callback's arguments).
    validation
        Open the validation data too (a shard reads the train data only).

    Returns
    -------
    tuple
        (train, validation or None).
    """
    train = open_data(cfg.dataset, run.split, cfg.max_train_tokens, flags[0], cfg, run.block_size, run.config,
                      tokenizer, store)
    if run.labels.path is not None:  # read as the train data is: the same split, blocks and cap
        train = dataclasses.replace(train, labels=open_data(run.labels.path, run.split, cfg.max_train_tokens,
                                                            flags[0], cfg, run.block_size, run.config, None))
    val = None if run.val_spec is None or not validation else open_data(
        run.val_spec, run.val_split, cfg.max_val_tokens, flags[1], cfg, run.block_size, run.config, tokenizer, store)
    return train, val


def refusal(group: str, store: Store, existing: dict, record: dict, tag: str | None) -> UserError:
    """The error for a checkpoint that :func:`ncanalyze.store.store.decide` refuses, naming the settings that differ.

    Parameters
    ----------
    group
        The checkpoint's group.
    store
        The store.
    existing
        The group's attributes (its ``config``, the record it was made under).
    record
        The record asked for now.
    tag
        ``--tag`` (without one, the message suggests it).

    Returns
    -------
    UserError
        The one-line error.
    """
    keep_both = "" if tag else "; to keep both (e.g. another dataset), pass --tag NAME"
    return UserError(f"{group} is already in {store} under another configuration "
                     f"({differences(json.loads(existing.get('config', '{}')), record)}); "
                     f"rerun with the same options, or pass --overwrite to replace it{keep_both}")

