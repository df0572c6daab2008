"""Find the checkpoints under a path and read their training metadata."""
from __future__ import annotations

import filecmp
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from ncanalyze.core.errors import CheckpointError, UserError
from ncanalyze.core.names import check_name, shown

_CKPT = re.compile(r"^checkpoint-(\d+)$")
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_SAFE_SUFFIXES = (".safetensors", ".safetensors.index.json")
ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter (LoRA ...): its base model is named there
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
FSDP_PREFIX = "pytorch_model_fsdp_"     # FSDP's sharded state dict (torch.distributed.checkpoint), through accelerate
_ZERO_STEP = re.compile(r"^global_step\d+$")  # DeepSpeed ZeRO's shards, as the Trainer saves them
LAYOUTS = ("model", "adapter", "fsdp", "zero")


@dataclass(frozen=True)
class Checkpoint:
    run: str          # the run's name: its folder
    name: str         # "checkpoint-N", or "final" for a model saved at the run's root
    path: Path        # the folder holding config.json and the weights
    run_dir: Path     # the run folder (trainer_state.json, eval_results.json, tokenizer)
    base: str | None = None  # an adapter's base model as --base names it (None: as its adapter_config.json does)

    @property
    def group(self) -> str:
        return f"{self.run}/{self.name}"


# what names a local file rather than a Hub id (Hub ids such as Qwen/Qwen2.5-0.5B have dots, so not any suffix)
LOCAL_SUFFIXES = (".txt", ".text", ".json", ".jsonl", ".parquet", ".csv", ".tsv", ".npy", ".bin", ".arrow",
                  ".safetensors", ".pt", ".pth", ".gz", ".zst", ".xz", ".zip", ".tar", ".model")


def looks_local(spec: str) -> bool:
    """Whether ``spec`` names a local file or folder rather than a Hub id: it starts with ``.``, ``/`` or ``~``, has
    more than one ``/`` or a backslash, ends in a file extension (:data:`LOCAL_SUFFIXES`), or its parent folder
    exists (``runs/nope`` beside a ``runs/`` folder). ``ORG/NAME`` and ``NAME`` are Hub ids otherwise.

    Parameters
    ----------
    spec
        A PATH, ``--dataset``, ``--val-dataset`` or ``--tokenizer``.

    Returns
    -------
    bool
        It looks local.
    """
    return (spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec
            or spec.lower().endswith(LOCAL_SUFFIXES) or "/" in spec and Path(spec).parent.is_dir())


def check_local(named: dict[str, list[str | None]]) -> None:
    """Refuse, before anything reaches the Hub, a path that looks local (:func:`looks_local`) and is not there.

    Parameters
    ----------
    named
        Each option (``PATH``, ``--dataset`` ...) and its values (None: not given).
    """
    for flag, values in named.items():
        for v in values:
            if v and looks_local(str(v)) and not Path(v).exists():
                raise UserError(f"no such file or folder: {v} ({flag}); check the path (a Hub name has no "
                                "extension and at most one /)")


def is_model_dir(p: Path) -> bool:
    """Whether ``p`` holds a model in one of the :data:`LAYOUTS` (:func:`layout`).

    Parameters
    ----------
    p
        A folder.

    Returns
    -------
    bool
        It does.
    """
    return layout(p) is not None


def layout(p: Path) -> str | None:
    """How the folder ``p`` holds its model: ``model`` (config.json and whole weights, safetensors or pickle),
    ``adapter`` (a PEFT adapter: adapter_config.json and adapter_model.*), ``fsdp`` (config.json and FSDP's sharded
    ``pytorch_model_fsdp_*/``), ``zero`` (config.json and DeepSpeed ZeRO's ``global_step*/`` shards); None: no model.

    Parameters
    ----------
    p
        A folder.

    Returns
    -------
    str or None
        One of :data:`LAYOUTS`, or None.
    """
    config = (p / "config.json").is_file()
    if (p / ADAPTER_CONFIG).is_file() and any((p / w).is_file() for w in ADAPTER_WEIGHTS):
        return "adapter"
    if config and any((p / w).is_file() for w in WEIGHTS + PICKLE_WEIGHTS):
        return "model"
    if config and fsdp_dirs(p):
        return "fsdp"
    if config and zero_dirs(p):
        return "zero"
    return None


def fsdp_dirs(p: Path) -> list[Path]:
    """The FSDP sharded state dicts in ``p`` (``pytorch_model_fsdp_<i>/`` holding a ``.metadata``), in order."""
    return sorted(d for d in p.glob(f"{FSDP_PREFIX}*") if d.is_dir() and not d.is_symlink()
                  and (d / ".metadata").is_file())


def zero_dirs(p: Path) -> list[Path]:
    """DeepSpeed ZeRO's ``global_step<N>/`` shard folders in ``p``."""
    return sorted(d for d in p.glob("global_step*") if _ZERO_STEP.match(d.name) and d.is_dir() and not d.is_symlink())


def check_safe_weights(path: str | Path, allow_pickle: bool) -> bool:
    """Check the weight files ``from_pretrained`` would read in ``path``; True: load with ``use_safetensors=True``.

    "safetensors only" means no file but ``.safetensors`` is ever deserialised: a safetensors index (or
    config.json's ``transformers_weights``) naming a ``.bin`` or other shard is refused unless ``allow_pickle``,
    as are pickle-only folders. A shard an index names but the folder lacks, or an index that is not JSON, is
    a one-line error here rather than deep in ``transformers``. False: only pickle weights, allowed.

    Extraction must call this in ``load_model`` before ``from_pretrained``:
    ``safe = check_safe_weights(ckpt.path, cfg.allow_pickle)`` and pass ``use_safetensors=safe``.

    Parameters
    ----------
    path
        The model folder.
    allow_pickle
        Pickle weights (``.bin``) may be loaded.

    Returns
    -------
    bool
        Load with ``use_safetensors=True``.
    """
    path = Path(path)
    explicit = (_json(path / "config.json", warn=False) or {}).get("transformers_weights")
    if isinstance(explicit, str) and explicit:
        if not explicit.endswith(_SAFE_SUFFIXES) and not allow_pickle:
            raise CheckpointError(f"{path / 'config.json'} names weights {explicit!r} (transformers_weights), which is not "
                            "a .safetensors file and may be a pickle that runs code when loaded; remove the key, "
                            "convert the weights to safetensors, or pass --allow-pickle if you trust the file")
        if not (path / explicit).is_file():
            raise CheckpointError(f"{path / 'config.json'} names weights {explicit!r} (transformers_weights), which is "
                            f"missing from {path}; copy the file there or remove the key")
    index = path / WEIGHTS[1]
    if index.is_file():
        for shard in _index_shards(index):
            if not shard.endswith(".safetensors") and not allow_pickle:
                raise CheckpointError(f"{index} maps tensors to {shard!r}, which is not a .safetensors file and may be a "
                                "pickle that runs code when loaded; convert that shard to safetensors, or pass "
                                "--allow-pickle if you trust the file")
            _need_shard(index, path, shard)
    if any((path / w).is_file() for w in WEIGHTS):
        return True
    if not any((path / w).is_file() for w in PICKLE_WEIGHTS):
        raise CheckpointError(f"{path} has no weight file ({', '.join(WEIGHTS + PICKLE_WEIGHTS)}); pass a folder "
                        "holding a saved model")
    if not allow_pickle:
        raise CheckpointError(f"{path} has only pickle weights ({'/'.join(PICKLE_WEIGHTS)}), which can run arbitrary "
                        "code when loaded; convert them to safetensors or pass --allow-pickle if you trust the file")
    pindex = path / PICKLE_WEIGHTS[1]
    if not (path / PICKLE_WEIGHTS[0]).is_file() and pindex.is_file():
        for shard in _index_shards(pindex):
            _need_shard(pindex, path, shard)
    return False


def _index_shards(index: Path) -> list[str]:
    """The shard file names of a sharded-weights index (its ``weight_map`` values)."""
    try:
        wmap = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON (or not UTF-8), not an object
        wmap = None
    if not isinstance(wmap, dict) or not wmap or not all(isinstance(v, str) for v in wmap.values()):
        raise UserError(f"{index} is not a weights index (a JSON object whose weight_map maps tensor names to "
                        "shard files); save the model again, or remove the index if a single weight file is there")
    return sorted(set(wmap.values()))


def _need_shard(index: Path, path: Path, shard: str) -> None:
    if not (path / shard).is_file():
        raise UserError(f"{index} names shard {shard!r}, which is missing from {path}; copy the missing shard "
                        "there (or save the model again)")


def _step_dirs(p: Path) -> list[Path]:
    found = [(int(m.group(1)), d) for d in p.iterdir() if d.is_dir() and (m := _CKPT.match(d.name)) and is_model_dir(d)]
    return [d for _, d in sorted(found)]


def _run_checkpoints(run_dir: Path) -> list[Checkpoint]:
    steps = _step_dirs(run_dir)
    out = [Checkpoint(run_dir.name, d.name, d, run_dir) for d in steps]
    if is_model_dir(run_dir) and not (steps and _same_weights(run_dir, steps[-1])):
        out.append(Checkpoint(run_dir.name, "final", run_dir, run_dir))
    return out


def _same_weights(a: Path, b: Path) -> bool:
    for w in WEIGHTS[:1] + PICKLE_WEIGHTS[:1] + ADAPTER_WEIGHTS:
        if (a / w).is_file() and (b / w).is_file():
            return filecmp.cmp(a / w, b / w, shallow=False)
    return False


def discover(path: str | Path) -> list[Checkpoint]:
    """Checkpoints under ``path``: a Trainer output folder, a single model folder, or a folder of runs.

    Within a run, checkpoints sort by step number; a model at the run's root is added as ``final``
    unless its weights equal the last checkpoint's.

    Parameters
    ----------
    path
        The folder.

    Returns
    -------
    list of Checkpoint
        Run by run, in step order; a one-line UserError when there are none.
    """
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p} does not exist: pass a Trainer output folder, a model folder or a folder of runs")
    if not p.is_dir():
        raise UserError(f"{p} is not a folder: pass a Trainer output folder, a model folder or a folder of runs")
    p = Path(os.path.abspath(p))  # '.', '..' or a relative checkpoint-N: names come from the real folders
    if _CKPT.match(p.name) and is_model_dir(p):
        return [Checkpoint(p.parent.name, p.name, p, p.parent)]
    found = _run_checkpoints(p)
    if not found:
        for sub in sorted(d for d in p.iterdir() if d.is_dir()):
            found += _run_checkpoints(sub)
    if not found:
        raise UserError(f"no checkpoints found under {p}: expected config.json with model.safetensors (or "
                        "pytorch_model_fsdp_0/ or global_stepN/ shards), a PEFT adapter (adapter_config.json), "
                        "checkpoint-N/ subfolders of a Trainer run, or a folder of such runs")
    for c in found:  # each run's folder names its group: one plain name, never a path (before any work)
        check_name(c.run, f"the run folder {shown(c.run_dir)}:", "rename the folder to a plain name")
    return found


def _json(p: Path, warn: bool = True) -> dict | None:
    """A JSON object from ``p``; None if it is missing or unreadable, with a warning (``warn``) if it is there but
    is not a JSON object."""
    try:
        obj = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # unreadable, not JSON, not UTF-8
        if warn:
            warnings.warn(f"{p} is not readable JSON; its training metadata is left out", stacklevel=3)
        return None
    if not isinstance(obj, dict):
        if warn:
            warnings.warn(f"{p} holds a JSON {type(obj).__name__}, not an object; its training metadata is left "
                          "out", stacklevel=3)
        return None
    return obj


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v) -> int | None:
    return int(v) if _number(v) and math.isfinite(v) and v == int(v) and v >= 0 else None


def _loss(v, where: str, at: str) -> float | None:
    """A finite eval loss, else None with a warning: strict JSON holds no NaN or Infinity, and a wrong loss is
    worse than none."""
    if _number(v) and math.isfinite(v):
        return float(v)
    warnings.warn(f"{where}: eval_loss{' ' + at if at else ''} is {v!r}, not a finite number; it is stored as None",
                  stacklevel=3)
    return None


def _log_history(state: dict | None, where: str) -> list[dict]:
    """The entries of ``log_history`` that are JSON objects; a warning when any are left out."""
    if not state or "log_history" not in state:
        return []
    history = state["log_history"]
    if not isinstance(history, list):
        warnings.warn(f"{where}: log_history is a {type(history).__name__}, not a list; it is left out", stacklevel=3)
        return []
    good = [e for e in history if isinstance(e, dict)]
    if len(good) < len(history):
        warnings.warn(f"{where}: {len(history) - len(good)} log_history entries are not objects; they are left out",
                      stacklevel=3)
    return good


def training_metadata(ckpt: Checkpoint) -> dict:
    """``global_step``, ``epoch`` and ``eval_loss`` (the last eval at or before the step) of a checkpoint.

    A trainer_state.json of the wrong shape never stops an extraction: what is valid is read, the rest is None,
    with a warning naming the file. A non-finite or non-numeric eval_loss is None (never an older eval's loss).

    Parameters
    ----------
    ckpt
        The checkpoint (its folder's, else its run's trainer_state.json).

    Returns
    -------
    dict
        ``global_step``, ``epoch``, ``eval_loss`` (each None where unknown).
    """
    where = ckpt.path / "trainer_state.json"
    state = _json(where)
    if state is None:
        where = ckpt.run_dir / "trainer_state.json"
        state = _json(where)
    m = _CKPT.match(ckpt.name)
    step = int(m.group(1)) if m else None
    if step is None and state:
        step = _int(state.get("global_step")) or _int(state.get("max_steps"))
    if step is None:  # a final model without its own trainer_state: the last checkpoint's run length
        last = _step_dirs(ckpt.run_dir)
        st = _json(last[-1] / "trainer_state.json") if last else None
        step = st and (_int(st.get("max_steps")) or _int(st.get("global_step")))
        if state is None and st is not None:
            state, where = st, last[-1] / "trainer_state.json"
    history = _log_history(state, str(where))

    def upto(e: dict) -> bool:  # logged at or before the step (an entry without a numeric step counts as step 0)
        s = e.get("step", 0)
        return step is None or (_number(s) and s <= step) or "step" not in e

    evals = [e for e in history if "eval_loss" in e and upto(e)]
    epochs = [e["epoch"] for e in history if _number(e.get("epoch")) and math.isfinite(e["epoch"]) and upto(e)]
    epoch = max(epochs, default=None)
    if epoch is None and state and _number(state.get("epoch")) and math.isfinite(state["epoch"]):
        epoch = state["epoch"]
    eval_loss = _loss(evals[-1]["eval_loss"], str(where), f"at step {evals[-1].get('step')!r}") if evals else None
    if ckpt.name == "final":
        rpath = ckpt.run_dir / "eval_results.json"
        res = _json(rpath)
        if res is None:
            rpath = ckpt.run_dir / "all_results.json"
            res = _json(rpath)
        if res is not None:
            if "eval_loss" in res:
                eval_loss = _loss(res["eval_loss"], str(rpath), "")
            if _number(res.get("epoch")) and math.isfinite(res["epoch"]):
                epoch = res["epoch"]
    return {"global_step": step, "epoch": epoch, "eval_loss": eval_loss}


_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def tagged(ckpts: list[Checkpoint], tag: str | None, base: str | None = None) -> list[Checkpoint]:
    """The checkpoints as ``--tag`` places them (and ``--base``: the base model of every adapter among them).

    Parameters
    ----------
    ckpts
        The checkpoints.
    tag
        A plain name, or None.
    base
        ``--base``, or None.

    Returns
    -------
    list of Checkpoint
        With ``tag``, each checkpoint's run becomes ``<run>@<tag>``: the group ``<run>@<tag>/<checkpoint>`` (and its
        resume state) is distinct from the untagged ``<run>/<checkpoint>`` and from other tags.
    """
    if base is not None:
        ckpts = [replace(c, base=base) for c in ckpts]
    if tag is None:
        return ckpts
    if not _TAG.match(tag):
        raise UserError(f"--tag {tag!r} is not a plain name: use letters, digits and _ . + - (e.g. --tag kjv)")
    return [replace(c, run=f"{c.run}@{tag}") for c in ckpts]
