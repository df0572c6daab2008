"""Checkpoints whose weights are shards of a distributed training, read into one state dict on one process with the
training library's own utilities: FSDP's sharded state dict (``pytorch_model_fsdp_<i>/``, the
``torch.distributed.checkpoint`` format accelerate writes) and DeepSpeed ZeRO's ``global_step<N>/`` shards
(consolidated by ``deepspeed.utils.zero_to_fp32``). Both formats are pickles underneath: they are read only with
``--allow-pickle``.
"""
from __future__ import annotations

import shlex
import warnings
from pathlib import Path

import torch
from ncanalyze.core.errors import CheckpointError
from ncanalyze.store.sources.discover import fsdp_dirs, zero_dirs

PICKLE_FLAG = "--allow-pickle"


def fsdp_state_dict(path: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    """The model's state dict from the FSDP sharded checkpoint in ``path`` (its first ``pytorch_model_fsdp_<i>/``),
    read whole on this process by ``torch.distributed.checkpoint`` without a process group.

    Parameters
    ----------
    path
        The checkpoint folder (config.json and ``pytorch_model_fsdp_0/``).
    allow_pickle
        The files may be read: the format's ``.metadata`` is a pickle.

    Returns
    -------
    dict
        Parameter name to tensor, as the model's ``state_dict`` names them.
    """
    shards = fsdp_dirs(path)
    if not allow_pickle:
        raise CheckpointError(f"{shards[0]} is an FSDP sharded checkpoint, whose metadata is a pickle that can run "
                              f"code when loaded; pass {PICKLE_FLAG} if you trust the files")
    if len(shards) > 1:
        raise CheckpointError(f"{path} holds {len(shards)} FSDP models ({', '.join(d.name for d in shards)}); "
                              "pass a checkpoint of one model")
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    try:
        with warnings.catch_warnings():  # "no process group: loading in a single process", which is the intent
            warnings.simplefilter("ignore", UserWarning)
            loaded = _load_state_dict_from_keys(checkpoint_id=str(shards[0]))
    except Exception as e:  # noqa: BLE001 -- torch's reader raises CheckpointException and others on a bad folder
        raise CheckpointError(f"cannot read the FSDP checkpoint {shards[0]}: {_first_line(e)} (is it complete?)"
                              ) from None
    state = loaded.get("model", loaded) if isinstance(loaded, dict) else None  # accelerate saves {"model": ...}
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{shards[0]} does not hold a model's state dict (saved by accelerate's FSDP with "
                              "SHARDED_STATE_DICT); save the model with FULL_STATE_DICT instead")
    return state


def zero_state_dict(path: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    """The model's fp32 state dict consolidated from the DeepSpeed ZeRO shards in ``path`` by DeepSpeed's own
    ``get_fp32_state_dict_from_zero_checkpoint``.

    Parameters
    ----------
    path
        The checkpoint folder (config.json, ``global_step<N>/`` and ``latest``).
    allow_pickle
        The shards may be read: they are pickles.

    Returns
    -------
    dict
        Parameter name to tensor.
    """
    steps = zero_dirs(path)
    command = consolidation(path)
    if not allow_pickle:
        raise CheckpointError(f"{path} holds only DeepSpeed ZeRO shards ({steps[-1].name}/), which are pickles that "
                              "can run code when loaded: if you trust the files, consolidate them with DeepSpeed's "
                              f"installed module (`{command}`) and extract again, or pass {PICKLE_FLAG} with "
                              "deepspeed installed")
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise CheckpointError(f"{path} holds only DeepSpeed ZeRO shards ({steps[-1].name}/) and deepspeed is not "
                              f"installed: pip install deepspeed, then pass {PICKLE_FLAG} again (or consolidate them "
                              f"with `{command}` and extract again)") from None
    tag = None if (path / "latest").is_file() else steps[-1].name
    try:
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag))
    except Exception as e:  # noqa: BLE001 -- DeepSpeed raises ValueError, FileNotFoundError, pickle errors ...
        raise CheckpointError(f"cannot consolidate the DeepSpeed ZeRO shards in {path}: {_first_line(e)}; try "
                              f"`{command}`") from None


def consolidation(path: Path) -> str:
    """The shell command that consolidates the ZeRO shards in ``path`` into ``model.safetensors`` beside them with
    DeepSpeed's installed module (never the copy of its script in the untrusted folder), the path quoted for a POSIX
    shell (a space or ``$(...)`` in a folder name pastes as part of the path)."""
    folder = shlex.quote(str(path))
    return f"python -m deepspeed.utils.zero_to_fp32 {folder} {folder} --safe_serialization"


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
