"""Find the checkpoints under a path and read their training metadata."""
from __future__ import annotations

import filecmp
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ncanalyze.analyzer.errors import UserError

_CKPT = re.compile(r"^checkpoint-(\d+)$")
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class Checkpoint:
    run: str          # the run's name: its folder
    name: str         # "checkpoint-N", or "final" for a model saved at the run's root
    path: Path        # the folder holding config.json and the weights
    run_dir: Path     # the run folder (trainer_state.json, eval_results.json, tokenizer)

    @property
    def group(self) -> str:
        return f"{self.run}/{self.name}"


def is_model_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and any((p / w).is_file() for w in WEIGHTS + PICKLE_WEIGHTS)


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
    for w in WEIGHTS[:1] + PICKLE_WEIGHTS[:1]:
        if (a / w).is_file() and (b / w).is_file():
            return filecmp.cmp(a / w, b / w, shallow=False)
    return False


def discover(path: str | Path) -> list[Checkpoint]:
    """Checkpoints under ``path``: a Trainer output folder, a single model folder, or a folder of runs.

    Within a run, checkpoints sort by step number; a model at the run's root is added as ``final``
    unless its weights equal the last checkpoint's.
    """
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p} does not exist: pass a Trainer output folder, a model folder or a folder of runs")
    if not p.is_dir():
        raise UserError(f"{p} is not a folder: pass a Trainer output folder, a model folder or a folder of runs")
    if _CKPT.match(p.name) and is_model_dir(p):
        return [Checkpoint(p.parent.name, p.name, p, p.parent)]
    found = _run_checkpoints(p)
    if not found:
        for sub in sorted(d for d in p.iterdir() if d.is_dir()):
            found += _run_checkpoints(sub)
    if not found:
        raise UserError(f"no checkpoints found under {p}: expected config.json with model.safetensors, "
                        "checkpoint-N/ subfolders of a Trainer run, or a folder of such runs")
    return found


def _json(p: Path) -> dict | None:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def training_metadata(ckpt: Checkpoint) -> dict:
    """``global_step``, ``epoch`` and ``eval_loss`` (the last eval at or before the step) of a checkpoint."""
    state = _json(ckpt.path / "trainer_state.json") or _json(ckpt.run_dir / "trainer_state.json")
    m = _CKPT.match(ckpt.name)
    step = int(m.group(1)) if m else None
    if step is None and state:
        step = state.get("global_step") or state.get("max_steps")
    if step is None:  # a final model without its own trainer_state: the last checkpoint's run length
        last = _step_dirs(ckpt.run_dir)
        st = _json(last[-1] / "trainer_state.json") if last else None
        step = st and (st.get("max_steps") or st.get("global_step"))
        state = state or st
    history = (state or {}).get("log_history", [])
    evals = [e for e in history if "eval_loss" in e and (step is None or e.get("step", 0) <= step)]
    epoch = max((e["epoch"] for e in history if "epoch" in e and (step is None or e.get("step", 0) <= step)),
                default=(state or {}).get("epoch"))
    eval_loss = evals[-1]["eval_loss"] if evals else None
    if ckpt.name == "final":
        res = _json(ckpt.run_dir / "eval_results.json") or _json(ckpt.run_dir / "all_results.json") or {}
        eval_loss = res.get("eval_loss", eval_loss)
        epoch = res.get("epoch", epoch)
    return {"global_step": step, "epoch": epoch, "eval_loss": eval_loss}
