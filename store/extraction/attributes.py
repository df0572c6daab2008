"""A checkpoint group's attributes, built in one place for ``ncanalyze extract`` (checkpoint.py) and the Trainer
callback (runs/callback.py): what was measured, on what data and under which configuration (SPEC section 3)."""
from __future__ import annotations

import json

import torch
from ncanalyze.store import io
from ncanalyze.store.data.token_cache import tokenizer_fingerprint
from ncanalyze.store.extraction.config import Resolved, cap_mode, config_hash
from ncanalyze.store.extraction.loss import loss_attrs
from ncanalyze.store.extraction.running import Extraction
from ncanalyze.store.extraction.settings import ExtractConfig
from ncanalyze.store.sources import adapters
from ncanalyze.store.sources.anatomy import n_layers


def group_attributes(group: str, when: dict, model: torch.nn.Module, ex: Extraction, classifier: torch.Tensor,
                     cfg: ExtractConfig, run: Resolved, tokenizer, tokenizer_name: str | None, *, dtype: str,
                     device: torch.device, source: str, extra: dict | None = None) -> dict:
    """The attributes of checkpoint ``group`` (``<run>/<checkpoint>``) after its passes.

    Parameters
    ----------
    group
        The group; its run and checkpoint names are recorded.
    when
        ``global_step``, ``epoch`` and ``eval_loss`` (a checkpoint's trainer_state, or the Trainer's state now).
    model, ex, classifier
        The model, its finished extraction and its output layer's weight (vocab x hidden).
    cfg, run
        The configuration and what it resolved to (config.resolve): block size, splits, validation, record.
    tokenizer, tokenizer_name
        The tokenizer (fingerprinted) and where it came from.
    dtype, device
        The weights' dtype and the device the passes ran on, as recorded.
    source
        Where the weights came from: the checkpoint's folder, ``hf://...`` or ``training``.
    extra
        Last, replacing any key before (a Hub revision's origin and step; the callback's ``output_dir``).
        An adapted model (PEFT) adds its base's and adapter's identity (adapters.adapter_identity).

    Returns
    -------
    dict
        The group's attributes (JSON-serialisable).
    """
    main, (run_name, name) = ex.main(), group.split("/")
    return {
        "run": run_name, "tag": cfg.tag, "checkpoint": name, **when,
        "n_params": sum(p.numel() for p in model.parameters()), "n_layers": n_layers(model.config),
        "hidden_size": int(classifier.shape[1]), "vocab_size": int(classifier.shape[0]),
        "model_type": model.config.model_type, "train_tokens": int(main.stats.count.sum()),
        "val_tokens": int(main.val["val_count"].sum()),
        **loss_attrs(main.lm, ex.transform), "min_count": cfg.min_count, "block_size": run.block_size,
        "dataset": cfg.dataset, "split": run.split, "val_dataset": run.val_spec, "val_split": run.val_split,
        "val_held_out": run.held_out, "tokenizer": tokenizer_name,
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer), "dtype": dtype, "device": str(device),
        "samples_per_class": cfg.samples_per_class, "seed": cfg.seed, "cap_mode": cap_mode(cfg),
        "source": source,
        "ncanalyze_version": io.version(), "config_hash": config_hash(run.record),
        "config": json.dumps(run.record, sort_keys=True), **adapters.adapter_identity(model, source), **(extra or {}),
    }
