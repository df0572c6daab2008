"""PEFT adapters (LoRA and the other adapters peft injects into a model's layers): a checkpoint folder holding
``adapter_config.json`` is the base model named there (a local folder, or a Hub id read from the local Hub cache)
with the adapter applied by the ``peft`` library (the optional extra ``ncanalyze[peft]``). What is measured is the
adapted model: the base model with the adapter's layers in it (``PeftModel.get_base_model()``), whose forward runs
them; the group records the base's and the adapter's identity (:func:`identity`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from ncanalyze.analyzer.errors import CheckpointError, UserError
from ncanalyze.store.sources.discover import ADAPTER_CONFIG, ADAPTER_WEIGHTS, Checkpoint, layout
from ncanalyze.store.sources.fingerprint import files_fingerprint, plain_fingerprint

EXTRA = "pip install 'ncanalyze[peft]'"
LIVE = "live"  # an adapter being trained: its weights are no file


def require_peft():
    """The ``peft`` module, or a one-line UserError naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise UserError(f"this checkpoint is a PEFT adapter and the peft library is not installed: {EXTRA}") from None
    return peft


def adapter_config(path: Path) -> dict:
    """The adapter's ``adapter_config.json`` (a JSON object naming its base model), or a one-line CheckpointError."""
    where = path / ADAPTER_CONFIG
    try:
        config = json.loads(where.read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict) or not isinstance(config.get("base_model_name_or_path"), str) \
            or not config["base_model_name_or_path"]:
        raise CheckpointError(f"{where} is not a PEFT adapter config naming its base model "
                              "(base_model_name_or_path); save the adapter again with peft")
    return config


def base_of(path: Path) -> tuple[Path, str, str | None]:
    """Where the base model of the adapter in ``path`` is: (its folder, its name as the adapter names it, its revision:
    the Hub commit for a Hub id, else None)."""
    config = adapter_config(path)
    return locate_base(config["base_model_name_or_path"], config.get("revision"), str(path))


def locate_base(name: str, revision: str | None, adapter: str) -> tuple[Path, str, str | None]:
    """The base model ``name`` (at ``revision``) of ``adapter``, as :func:`base_of`: a local folder holding a model,
    or a Hub id read from the local Hub cache only."""
    local = Path(name).expanduser()
    if local.is_dir():
        folder = local.resolve()
        if layout(folder) in (None, "adapter"):
            raise CheckpointError(f"the base model of the adapter in {adapter}, {folder}, holds no model of its own "
                                  "(an adapter of an adapter?); merge the first adapter into its base and save it")
        return folder, name, None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(name, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        raise CheckpointError(f"the base model of the adapter in {adapter}, {name!r}"
                              f"{f' at revision {revision}' if revision else ''}, is neither a local folder nor in "
                              f"the local Hub cache: download it (`hf download {name}`) or name the base model's "
                              f"folder in base_model_name_or_path of its {ADAPTER_CONFIG}") from None
    return folder, name, folder.name


def base_checkpoint(ckpt: Checkpoint) -> Checkpoint:
    """The base model of adapter ``ckpt`` as a checkpoint of its own (to load its config and weights)."""
    folder = base_of(ckpt.path)[0]
    return Checkpoint(folder.name, folder.name, folder, folder)


def apply(base: torch.nn.Module, path: Path, dtype: torch.dtype, allow_pickle: bool) -> torch.nn.Module:
    """``base`` with the adapter in ``path`` applied by ``peft``, in eval mode, its adapter weights in ``dtype``.

    Parameters
    ----------
    base
        The base model, loaded.
    path
        The adapter's folder.
    dtype
        The extraction's dtype (the adapter's weights are cast to it, as the base's were).
    allow_pickle
        A pickled ``adapter_model.bin`` may be read.

    Returns
    -------
    torch.nn.Module
        The adapted model: the base with the adapter's layers in it (``PeftModel.get_base_model()``).
    """
    peft = require_peft()
    if not (path / ADAPTER_WEIGHTS[0]).is_file() and not allow_pickle:
        raise CheckpointError(f"{path} has only pickle adapter weights ({ADAPTER_WEIGHTS[1]}), which can run "
                              "arbitrary code when loaded; save the adapter with safetensors or pass --allow-pickle "
                              "if you trust the file")
    try:
        config = peft.PeftConfig.from_pretrained(str(path))
        if config.is_prompt_learning:
            raise CheckpointError(f"{path} is a {config.peft_type} adapter (prompt learning), which changes the input "
                                  "rather than the model's layers; extract a LoRA-type adapter")
        model = peft.PeftModel.from_pretrained(base, str(path), is_trainable=False)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"cannot apply the adapter in {path} to its base model: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__} "
                              "(is it the base the adapter was trained on?)") from None
    return unwrap(model.to(dtype)).eval()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model whose forward is measured: a ``PeftModel``'s base model with the adapter's layers in it; any other
    model as it is."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the model it wraps) has peft's adapter layers in it."""
    return bool(getattr(unwrap(model), "peft_config", None))


def trainable_params(model: torch.nn.Module) -> int:
    """The adapter's parameters in ``model`` (what trains under peft): those of every tuner layer's adapter layers
    (``lora_A``, ``lora_B`` ...) and of ``modules_to_save``'s copies."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    seen: dict[int, int] = {}
    for m in unwrap(model).modules():
        if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            for name in m.adapter_layer_names:
                part = m._modules.get(name) if name in m._modules else m._parameters.get(name)
                params = part.parameters() if isinstance(part, torch.nn.Module) else [part] if part is not None else []
                seen.update((id(p), p.numel()) for p in params)
    return sum(seen.values())


def base_identity(model: torch.nn.Module) -> dict:
    """The adapted model's base and adapter type (empty for a plain model): ``adapter_type``, ``base_model``,
    ``base_revision`` and ``base_weights`` (the fingerprint of the base's weight files; None where the base is no
    longer found)."""
    configs = getattr(unwrap(model), "peft_config", None) or {}
    if not configs:
        return {}
    config = next(iter(configs.values()))
    name = config.base_model_name_or_path
    try:
        folder, _, revision = locate_base(name, config.revision, "being measured")
        weights = plain_fingerprint(folder)
    except CheckpointError:
        revision, weights = config.revision, None
    return {"adapter_type": str(getattr(config.peft_type, "value", config.peft_type)), "base_model": name,
            "base_revision": revision, "base_weights": weights}


def adapter_identity(model: torch.nn.Module, source: str) -> dict:
    """The group attributes of an adapted model (empty for a plain one): :func:`base_identity`, the adapter's names
    and the fingerprint of its weight files (``live`` while it trains), and ``n_trainable_params``.

    Parameters
    ----------
    model
        The model measured.
    source
        Where its weights came from: the adapter's folder, or ``training``.

    Returns
    -------
    dict
        The attributes.
    """
    base = base_identity(model)
    if not base:
        return {}
    folder = Path(source)
    adapter = LIVE if source == "training" else adapter_fingerprint(folder) if folder.is_dir() else None
    return {**base, "adapter_names": ",".join(unwrap(model).peft_config), "adapter_weights": adapter,
            "n_trainable_params": trainable_params(model)}


def adapter_fingerprint(path: Path) -> str:
    """The fingerprint of the adapter's weight files in ``path`` (as :func:`~fingerprint.files_fingerprint`)."""
    return files_fingerprint([path / w for w in ADAPTER_WEIGHTS if (path / w).is_file()])
