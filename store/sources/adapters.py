"""PEFT adapters (LoRA and the other adapters peft injects into a model's layers): a checkpoint folder holding
``adapter_config.json`` is the base model named there (a local folder, or a Hub id read from the local Hub cache)
with the adapter applied by the ``peft`` library (the optional extra ``ncanalyze[peft]``). What is measured is the
adapted model: the base model with the adapter's layers in it (``PeftModel.get_base_model()``), whose forward runs
them; the group records the base's and the adapter's identity (:func:`identity`).
"""
from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

import torch
from ncanalyze.core.errors import CheckpointError, UserError
from ncanalyze.store.sources.adapter_bounds import bounded
from ncanalyze.store.sources.discover import ADAPTER_CONFIG, ADAPTER_WEIGHTS, Checkpoint, layout
from ncanalyze.store.sources.fingerprint import files_fingerprint, plain_fingerprint

EXTRA = "pip install 'ncanalyze[peft]'"
LIVE = "live"  # an adapter being trained: its weights are no file
log = logging.getLogger(__name__)
_SAID: set[tuple[str, Path]] = set()  # (adapter, base folder) already said in the log


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
    except RecursionError:
        raise CheckpointError(f"{where} is nested deeper than Python's recursion limit allows, which no peft config "
                              "is; save the adapter again with peft") from None
    except (OSError, ValueError):  # unreadable, not JSON (or not UTF-8)
        config = None
    if not isinstance(config, dict) or not isinstance(config.get("base_model_name_or_path"), str) \
            or not config["base_model_name_or_path"]:
        raise CheckpointError(f"{where} is not a PEFT adapter config naming its base model "
                              "(base_model_name_or_path); save the adapter again with peft")
    return config


def base_of(path: Path, base: str | None = None) -> tuple[Path, str, str | None]:
    """Where the base model of the adapter in ``path`` is: (its folder, its name as the adapter names it, its revision:
    the Hub commit for a Hub id, else None); ``base`` (``--base``) names it instead of the adapter's config."""
    if base is not None:
        return locate_base(base, None, str(path), flag=True)
    config = adapter_config(path)
    revision = config.get("revision")
    return locate_base(config["base_model_name_or_path"], revision if isinstance(revision, str) else None, str(path),
                       against=path)


def locate_base(name: str, revision: str | None, adapter: str, against: Path | None = None,
                flag: bool = False) -> tuple[Path, str, str | None]:
    """The base model ``name`` (at ``revision``) of ``adapter``, as :func:`base_of`: a local folder holding a model (a
    relative ``name`` read from the folder ``against``, the adapter's; said once in the log), or a Hub id read from
    the local Hub cache only; ``flag``: ``name`` came from ``--base``."""
    named = f"--base {name}" if flag else f"the base model of the adapter in {adapter}, {name!r}"
    local = Path(name).expanduser()
    if against is not None and not local.is_absolute():
        local = against / local
    if local.is_dir():
        folder = local.resolve()
        if layout(folder) in (None, "adapter"):
            raise CheckpointError(f"{named}: {folder} holds no model of its own (an adapter of an adapter?); "
                                  "merge the first adapter into its base and save it")
        relative = not Path(name).expanduser().is_absolute()
        if (flag or relative) and (adapter, folder) not in _SAID:
            _SAID.add((adapter, folder))
            how = "--base" if flag else f"{name} resolved against the adapter's folder"
            log.info("the base model of the adapter in %s is %s (%s)", adapter, folder, how)
        return folder, str(folder) if relative else name, None
    folder = folder_in_cache(name, revision, named, local if against is not None else None)
    return folder, name, folder.name


def folder_in_cache(name: str, revision: str | None, named: str, tried: Path | None) -> Path:
    """The Hub id ``name``'s snapshot in the local Hub cache, or a one-line CheckpointError whose fix downloads it only
    where ``name`` can be a Hub id (never ``hf download`` of a path)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    fix = "pass --base with the base model's folder" + ("" if tried is None else " (or write its absolute path in "
                                                          f"base_model_name_or_path of {ADAPTER_CONFIG})")
    hub = not name.startswith((".", "/", "~")) and name.count("/") <= 1 and "\\" not in name
    try:
        return Path(snapshot_download(name, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        where = f" (no folder {tried})" if tried is not None else ""
        download = f", or if it is a Hub id download it (`hf download {shlex.quote(name)}`)" if hub else ""
        raise CheckpointError(f"{named}{f' at revision {revision}' if revision else ''} is neither a local folder"
                              f"{where} nor in the local Hub cache: {fix}{download}") from None


def base_checkpoint(ckpt: Checkpoint) -> Checkpoint:
    """The base model of adapter ``ckpt`` as a checkpoint of its own (to load its config and weights)."""
    folder = base_of(ckpt.path, ckpt.base)[0]
    return Checkpoint(folder.name, folder.name, folder, folder)


def check_one_base(ckpts: list[Checkpoint]) -> None:
    """Refuse, in one line before any work, a run whose adapters name different base models: one run is one
    trajectory of one model (an adapter whose base is not found fails alone at its turn)."""
    first: dict[str, tuple[Path, str]] = {}
    for c in ckpts:
        if layout(c.path) != "adapter":
            continue
        try:
            folder = base_of(c.path, c.base)[0]
        except CheckpointError:
            continue
        seen, name = first.setdefault(c.run, (folder, c.name))
        if seen != folder:
            raise UserError(f"the adapters of run {c.run} name different base models ({name}: {seen}; {c.name}: "
                            f"{folder}), so they are no one trajectory: move each base's adapters into a run folder "
                            "of their own, or pass --base to measure them all on one base")


def apply(base: torch.nn.Module, path: Path, dtype: torch.dtype, allow_pickle: bool,
          base_name: str | None = None) -> torch.nn.Module:
    """``base`` with the adapter in ``path`` applied by ``peft``, in eval mode, its adapter weights in ``dtype``: its
    config made safe and checked first (:func:`~adapter_bounds.bounded`), its layers built empty and filled from its
    weight file (``low_cpu_mem_usage``), and refused where the file does not cover them (:func:`check_covered`).

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
    base_name
        The base as it was found (:func:`base_of`), recorded as the adapter's base model.

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
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path / ADAPTER_CONFIG} is not a valid peft config: {_first_line(e)}; save the "
                              "adapter again with peft") from None
    if config.is_prompt_learning:
        raise CheckpointError(f"{path} is a {config.peft_type} adapter (prompt learning), which changes the input "
                              "rather than the model's layers; extract a LoRA-type adapter")
    config.base_model_name_or_path = base_name or config.base_model_name_or_path
    try:
        model = peft.PeftModel.from_pretrained(base, str(path), config=bounded(config, base, path),
                                               is_trainable=False, low_cpu_mem_usage=True)
    except RuntimeError as e:
        if "size mismatch" not in str(e):
            raise
        line = next(x for x in str(e).splitlines() if "size mismatch" in x).strip().rstrip(".")
        raise CheckpointError(f"the adapter in {path} does not fit its base model ({line}): is it the base the "
                              "adapter was trained on? (--base names another)") from None
    check_covered(model, path)
    return unwrap(model.to(dtype)).eval()


def check_covered(model, path: Path) -> None:
    """Refuse an adapted model whose weight file does not hold exactly the tensors its config makes (peft's own state
    dict of it): tensors missing (left empty on the meta device by ``low_cpu_mem_usage``, or a module to save left as
    the base's), tensors no layer takes, ``use_dora`` turned on over LoRA weights or off over DoRA weights."""
    from peft import get_peft_model_state_dict

    saved = _saved_keys(path)
    missing = sorted(set(get_peft_model_state_dict(model, save_embedding_layers=False)) - saved)
    missing = missing or [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    unused = sorted(saved - set(get_peft_model_state_dict(model, save_embedding_layers=True)))
    dora = next((n for n in missing + unused if "lora_magnitude_vector" in n), None)
    if dora:
        turned = "on, but its weights hold no DoRA magnitudes" if dora in missing else "off, but its weights are DoRA's"
        raise CheckpointError(f"{path / ADAPTER_CONFIG} turns use_dora {turned} (e.g. {dora}): the config does not "
                              "match its weights; set use_dora as it was trained, or save the adapter again with peft")
    if missing or unused:
        what = f"lack {len(missing)} of" if missing else f"hold {len(unused)} tensors beyond"
        raise CheckpointError(f"the adapter weights in {path} {what} its config's tensors (e.g. {(missing or unused)[0]}"
                              "); they are incomplete or saved under another config: save the adapter again with peft")


def _saved_keys(path: Path) -> set[str]:
    """The names of the tensors in the adapter's weight file (a safetensors header; a pickle, allowed, read by peft)."""
    from peft.utils import load_peft_weights
    from safetensors import safe_open

    if (path / ADAPTER_WEIGHTS[0]).is_file():
        with safe_open(str(path / ADAPTER_WEIGHTS[0]), framework="pt") as f:
            return set(f.keys())
    return set(load_peft_weights(str(path), device="cpu"))


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


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
