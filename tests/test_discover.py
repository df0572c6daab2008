"""Checkpoint discovery: the three folder shapes, numeric step order, and the training metadata."""
from __future__ import annotations

import json

import pytest

from ncanalyze.analyzer.errors import UserError
from ncanalyze.store.discover import discover, training_metadata


def model(d, weights: bytes = b"w", state: dict | None = None):
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(weights)
    if state is not None:
        (d / "trainer_state.json").write_text(json.dumps(state))
    return d


def state(step: int) -> dict:
    log = [{"step": s, "epoch": s / 100, "eval_loss": 10 / s} for s in (5, 20, 100, 900) if s <= step]
    return {"global_step": step, "max_steps": 900, "log_history": log}


def test_trainer_folder_sorts_by_step_and_adds_a_distinct_final(tmp_path):
    run = tmp_path / "run-a"
    for s in (900, 20, 100, 5):
        model(run / f"checkpoint-{s}", weights=str(s).encode(), state=state(s))
    (run / "checkpoint-7").mkdir()  # no weights: not a checkpoint
    (run / "config.json").write_text("{}")
    (run / "model.safetensors").write_bytes(b"final")
    (run / "eval_results.json").write_text(json.dumps({"eval_loss": 0.5, "epoch": 9.0}))
    found = discover(run)
    assert [c.name for c in found] == ["checkpoint-5", "checkpoint-20", "checkpoint-100", "checkpoint-900", "final"]
    assert {c.run for c in found} == {"run-a"}
    meta = [training_metadata(c) for c in found]
    assert [m["global_step"] for m in meta] == [5, 20, 100, 900, 900]
    assert [m["eval_loss"] for m in meta] == [2.0, 0.5, 0.1, 10 / 900, 0.5]
    assert meta[2]["epoch"] == 1.0 and meta[4]["epoch"] == 9.0


def test_final_equal_to_the_last_checkpoint_is_not_repeated(tmp_path):
    run = tmp_path / "run"
    model(run / "checkpoint-10", weights=b"same")
    (run / "config.json").write_text("{}")
    (run / "model.safetensors").write_bytes(b"same")
    assert [c.name for c in discover(run)] == ["checkpoint-10"]


def test_single_model_folder_and_single_checkpoint(tmp_path):
    m = model(tmp_path / "gpt-neo-tiny")
    assert [(c.run, c.name, c.path) for c in discover(m)] == [("gpt-neo-tiny", "final", m)]
    ck = model(tmp_path / "run" / "checkpoint-3")
    assert [(c.run, c.name) for c in discover(ck)] == [("run", "checkpoint-3")]


def test_folder_of_runs(tmp_path):
    for r in ("b-run", "a-run"):
        for s in (100, 50):
            model(tmp_path / r / f"checkpoint-{s}", weights=f"{r}{s}".encode())
    model(tmp_path / "c-model")
    (tmp_path / "notes").mkdir()
    assert [c.group for c in discover(tmp_path)] == [
        "a-run/checkpoint-50", "a-run/checkpoint-100", "b-run/checkpoint-50", "b-run/checkpoint-100", "c-model/final"]


@pytest.mark.parametrize("make, words", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "not a folder"),
    (lambda p: p, "no checkpoints found"),
])
def test_no_checkpoints_is_a_user_error(tmp_path, make, words):
    with pytest.raises(UserError, match=words):
        discover(make(tmp_path))
