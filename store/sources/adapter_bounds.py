"""An adapter's config made safe for peft before peft builds anything from it: every regular expression in it that
peft would match with Python's backtracking ``re`` (a string ``target_modules`` or ``exclude_modules``, the keys of
``rank_pattern`` and ``alpha_pattern``) is matched here on RE2, the linear-time engine ``--where`` uses, and replaced
by the module names it matches; the other names peft puts inside a regular expression (``modules_to_save``,
``layers_pattern``, the keys of the other ``*_pattern`` fields) must be plain module names; and each rank is checked
against the shape of the layer it adapts and against the adapter's weight file (its safetensors header: nothing is
allocated), so a forged ``r`` is one line.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import torch
from ncanalyze.core.errors import CheckpointError
from ncanalyze.store.sources.discover import ADAPTER_CONFIG, ADAPTER_WEIGHTS

PLAIN = re.compile(r"[\w.\-]{1,512}")  # a module name: no quantifier, group or alternation for re to backtrack on
FULL = r"\A(?:{})\z"                   # re.fullmatch, as peft matches a string target_modules / exclude_modules
SUFFIX = r"\A(?:.*\.)?(?:{})\z"        # re.match(rf"(.*\.)?({key})$"), as peft's get_pattern_key
MATCHED = ("target_modules", "exclude_modules", "feedforward_modules")
PATTERNS = ("rank_pattern", "alpha_pattern")
ALL_LINEAR = "all-linear"  # peft's shorthand, not a regular expression


def bounded(config, base: torch.nn.Module, path: Path):
    """``config`` (the adapter's peft config) with no regular expression left for peft to backtrack on, its ranks and
    scales checked (:func:`check_ranks`); a one-line CheckpointError naming the field otherwise.

    Parameters
    ----------
    config
        The adapter's ``PeftConfig``, changed in place.
    base
        The base model (its module names and shapes).
    path
        The adapter's folder.

    Returns
    -------
    PeftConfig
        ``config``.
    """
    where = path / ADAPTER_CONFIG
    names = [n for n, _ in base.named_modules() if n]
    _plain_only(config, where)
    for field in MATCHED:
        value = getattr(config, field, None)
        if isinstance(value, str) and not (field == "target_modules" and value == ALL_LINEAR):
            found = {n for n, hit in zip(names, _matches(value, names, FULL, field, where)) if hit}
            if field == "target_modules" and not found:
                raise CheckpointError(f"{where}: target_modules {value!r} matches no module of the base model; "
                                      "it is not an adapter of this model")
            setattr(config, field, found)
    targeted = _targeted(config, base, names)
    ranks = {field: _by_module(getattr(config, field, None), targeted, field, where) for field in PATTERNS
             if hasattr(config, field)}
    for field, found in ranks.items():  # longest first: an escaped name matches itself before its suffixes
        setattr(config, field, {re.escape(n): v for n, v in sorted(found.items(), key=lambda kv: -len(kv[0]))})
    check_ranks(config, dict(base.named_modules()), targeted, ranks.get("rank_pattern", {}), path)
    return config


def _plain_only(config, where: Path) -> None:
    """Refuse a name peft would put inside a regular expression unless it is a plain module name: those of
    ``modules_to_save`` and ``layers_pattern``, and the keys of the other ``*_pattern`` fields (FourierFT's
    ``n_frequency_pattern``, C3A's ``block_size_pattern`` ...)."""
    for field, value in vars(config).items():
        if field != "modules_to_save" and not field.endswith("_pattern") or field in PATTERNS or not value:
            continue
        for name in [value] if isinstance(value, str) else value:  # a list's items, a dict's keys
            if not isinstance(name, str) or not PLAIN.fullmatch(name):
                raise CheckpointError(f"{where}: {field} holds {str(name)[:80]!r}, not a module name (letters, "
                                      "digits, _ . -); write the plain names of the modules")


def _matches(pattern, names: list[str], template: str, field: str, where: Path) -> list[bool]:
    """Whether each of ``names`` matches ``pattern`` (in ``template``), on RE2 (time linear in the names)."""
    if not isinstance(pattern, str):
        raise CheckpointError(f"{where}: {field} holds {pattern!r}, not a string; write module names")
    try:
        return pc.match_substring_regex(pa.array(names, pa.string()), template.format(pattern)).to_pylist()
    except pa.ArrowInvalid as e:
        raise CheckpointError(f"{where}: {field} {pattern[:80]!r} is not a regular expression RE2, the linear-time "
                              f"engine, accepts ({str(e).split(': ', 1)[-1]}); write the module names as a list"
                              ) from None


def _targeted(config, base: torch.nn.Module, names: list[str]) -> list[str]:
    """The modules the adapter adapts, as peft picks them (its own matching, on the literal config): every module
    with a weight where the config leaves it to peft (``all-linear``, or no ``target_modules``)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = getattr(config, "target_modules", None)
    if targets is None or targets == ALL_LINEAR:
        return [n for n, m in base.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
    return [n for n in names if check_target_module_exists(config, n)]


def _by_module(patterns, targeted: list[str], field: str, where: Path) -> dict:
    """``{module: value}`` for each targeted module a key of ``patterns`` matches (the first key, as peft takes it)."""
    if not patterns:
        return {}
    if not isinstance(patterns, dict):
        raise CheckpointError(f"{where}: {field} is a {type(patterns).__name__}, not an object mapping module names "
                              "to values; write it as {\"name\": value}")
    found: dict = {}
    for key, value in patterns.items():
        for name, hit in zip(targeted, _matches(key, targeted, SUFFIX, f"{field} key", where)):
            if hit:
                found.setdefault(name, value)
    return found


def check_ranks(config, modules: dict[str, torch.nn.Module], targeted: list[str], ranks: dict, path: Path) -> None:
    """Each ``lora_alpha`` is a finite number and each rank of a LoRA adapter (``r``, or its ``rank_pattern`` value)
    a positive integer no larger than the largest dimension of the layer it adapts and equal to the rank of that
    layer's weights in the adapter's safetensors file: the config's own values, checked before peft allocates."""
    where, r = path / ADAPTER_CONFIG, getattr(config, "r", None)
    alphas = [getattr(config, "lora_alpha", 1), *(getattr(config, "alpha_pattern", None) or {}).values()]
    if not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in alphas):
        raise CheckpointError(f"{where}: lora_alpha or alpha_pattern holds a value that is not a finite number; "
                              "write a number")
    if str(getattr(config.peft_type, "value", config.peft_type)) != "LORA" or r is None:
        return  # other adapters' ranks are no LoRA rank (AdaLoRA's rank_pattern holds masks)
    saved = _saved_ranks(path)
    for name in targeted:
        rank = ranks.get(name, r)
        weight = getattr(modules[name], "weight", None)
        widest = max(weight.shape) if isinstance(weight, torch.Tensor) and weight.dim() else None
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1 or widest and rank > widest:
            shape = " x ".join(map(str, weight.shape)) if widest else "?"
            raise CheckpointError(f"{where}: rank {rank!r} for {name} is not a positive integer at most the "
                                  f"largest dimension of that layer ({shape}); the config's r or rank_pattern is "
                                  "wrong: save the adapter again with peft")
        if name in saved and saved[name] != rank:
            raise CheckpointError(f"{where}: rank {rank} for {name}, but the weights saved beside it have rank "
                                  f"{saved[name]} there; the config does not match its weights: save the adapter "
                                  "again with peft (or restore its config's r and rank_pattern)")


def _saved_ranks(path: Path) -> dict[str, int]:
    """The rank of each LoRA layer in the adapter's safetensors file (``lora_A``'s first dimension), read from its
    header; empty for a pickle file."""
    from safetensors import safe_open

    file, prefix = path / ADAPTER_WEIGHTS[0], "base_model.model."
    if not file.is_file():
        return {}
    with safe_open(str(file), framework="pt") as f:
        heads = {k: k[len(prefix):].rsplit(".lora_", 1)[0] for k in f.keys()
                 if k.startswith(prefix) and k.endswith((".lora_A.weight", ".lora_embedding_A"))}
        return {name: f.get_slice(k).get_shape()[0] for k, name in heads.items()}
