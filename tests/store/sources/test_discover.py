"""Checkpoint discovery: the three folder shapes, numeric step order, and the training metadata."""
from __future__ import annotations

import json

import pytest
from ncanalyze.core.errors import UserError
from ncanalyze.store.sources.discover import discover, training_metadata


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


# ---------------------------------------------------------------- issue 10: trust at study scale

import math  # noqa: E402
import os  # noqa: E402
import warnings  # noqa: E402

import ncanalyze.store  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from conftest import lone_model, run_cli  # noqa: E402
from ncanalyze.store.sources.discover import check_safe_weights  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def _shard(ck, second: str = "model-00002-of-00002.safetensors", drop: str | None = None):
    """Split a real checkpoint's model.safetensors into two shards and an index; the second saved as ``second``
    (a pickle unless it ends in .safetensors); ``drop`` deletes one shard after the index names it."""
    w = load_file(ck / "model.safetensors")
    keys = sorted(w)
    a, b = keys[: len(keys) // 2], keys[len(keys) // 2:]
    save_file({k: w[k] for k in a}, ck / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    if second.endswith(".safetensors"):
        save_file({k: w[k] for k in b}, ck / second, metadata={"format": "pt"})
    else:
        torch.save({k: w[k] for k in b}, ck / second)
    wmap = {**{k: "model-00001-of-00002.safetensors" for k in a}, **{k: second for k in b}}
    (ck / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    (ck / "model.safetensors").unlink()
    if drop:
        (ck / drop).unlink()
    return ck


def _one_line_error(fn, *words):
    with pytest.raises(UserError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


def test_an_index_naming_a_pickle_shard_is_refused_without_allow_pickle(trained_run, tmp_path):
    ck = _shard(lone_model(trained_run, tmp_path / "checkpoint-60"), second="model-00002-of-00002.bin")
    _one_line_error(lambda: check_safe_weights(ck, False), "model.safetensors.index.json", "model-00002-of-00002.bin",
                    "not a .safetensors", "--allow-pickle")
    assert check_safe_weights(ck, True) is True  # trusted: from_pretrained reads the index


def test_a_missing_shard_or_a_broken_index_is_one_line(trained_run, tmp_path):
    ck = _shard(lone_model(trained_run, tmp_path / "a" / "checkpoint-60"), drop="model-00002-of-00002.safetensors")
    for allow in (False, True):
        _one_line_error(lambda: check_safe_weights(ck, allow), "model-00002-of-00002.safetensors", "missing")
    for text in ("", "not json", "[1, 2]", '{"weight_map": {}}', '{"weight_map": {"a": 3}}'):
        (ck / "model.safetensors.index.json").write_text(text)
        _one_line_error(lambda: check_safe_weights(ck, False), "is not a weights index")


def test_safe_and_pickle_folders(trained_run, tmp_path):
    ck = lone_model(trained_run, tmp_path / "checkpoint-60")
    assert check_safe_weights(ck, False) is True
    sharded = _shard(lone_model(trained_run, tmp_path / "s" / "checkpoint-60"))
    assert check_safe_weights(sharded, False) is True
    torch.save(load_file(ck / "model.safetensors"), ck / "pytorch_model.bin")
    (ck / "model.safetensors").unlink()
    _one_line_error(lambda: check_safe_weights(ck, False), "only pickle weights", "--allow-pickle")
    assert check_safe_weights(ck, True) is False
    cfg = json.loads((sharded / "config.json").read_text())
    (sharded / "config.json").write_text(json.dumps({**cfg, "transformers_weights": "adapter_model.bin"}))
    _one_line_error(lambda: check_safe_weights(sharded, False), "transformers_weights", "adapter_model.bin",
                    "--allow-pickle")


def test_a_pickle_shard_through_the_cli(trained_run, corpus, tmp_path):
    ck = _shard(lone_model(trained_run, tmp_path / "checkpoint-60"), second="model-00002-of-00002.bin")
    r = run_cli("extract", ck, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", "--max-train-tokens",
                512, "--max-val-tokens", 0, ok=False)
    assert "not a .safetensors file" in r.output and "--allow-pickle" in r.output, r.output


@pytest.mark.parametrize("where", ["run", "checkpoint", "parent"])
def test_relative_run_paths_name_their_runs(tmp_path, monkeypatch, where):
    run = tmp_path / "run-b"
    for s in (10, 20):
        model(run / f"checkpoint-{s}", weights=str(s).encode())
    if where == "run":
        monkeypatch.chdir(run)
        found, groups = discover("."), ["run-b/checkpoint-10", "run-b/checkpoint-20"]
    elif where == "checkpoint":
        monkeypatch.chdir(run)
        found, groups = discover("checkpoint-20"), ["run-b/checkpoint-20"]
        monkeypatch.chdir(run / "checkpoint-20")
        assert [c.group for c in discover(".")] == groups
    else:
        monkeypatch.chdir(run / "checkpoint-10")
        found, groups = discover(".."), ["run-b/checkpoint-10", "run-b/checkpoint-20"]
    assert [c.group for c in found] == groups
    assert all(c.path.is_dir() and c.path.is_absolute() for c in found)


def test_relative_run_path_through_the_cli(trained_run, corpus, tmp_path, monkeypatch):
    ck = lone_model(trained_run, tmp_path / "my-run" / "checkpoint-60")
    monkeypatch.chdir(ck.parent)
    store = tmp_path / "s.zarr"
    run_cli("extract", "checkpoint-60", "--dataset", corpus["train"], "--store", store, "--max-train-tokens", 256,
            "--max-val-tokens", 0, "--samples-per-class", 1)
    assert sorted(ncanalyze.store.open(store).children) == ["my-run"]
    assert list(ncanalyze.store.open(store)["my-run"].children) == ["checkpoint-60"]


BAD_STATES = {  # trainer_state.json contents of the wrong shape: what is valid is kept
    "a list": ([1, 2, 3], {"global_step": 20, "epoch": None, "eval_loss": None}),
    "log_history a dict": ({"global_step": 20, "epoch": 0.5, "log_history": {"eval_loss": 1.0}},
                           {"global_step": 20, "epoch": 0.5, "eval_loss": None}),
    "entries not objects": ({"log_history": ["x", 3, {"step": 10, "epoch": 0.2, "eval_loss": 2.5}, None]},
                            {"global_step": 20, "epoch": 0.2, "eval_loss": 2.5}),
    "eval_loss a string": ({"log_history": [{"step": 10, "eval_loss": 2.0}, {"step": 20, "eval_loss": "low"}]},
                           {"global_step": 20, "epoch": None, "eval_loss": None}),
    "eval_loss None": ({"log_history": [{"step": 20, "eval_loss": None}]},
                       {"global_step": 20, "epoch": None, "eval_loss": None}),
    "eval_loss infinite": ({"log_history": [{"step": 20, "epoch": 1, "eval_loss": math.inf}]},
                           {"global_step": 20, "epoch": 1, "eval_loss": None}),
    "eval_loss NaN": ({"log_history": [{"step": 20, "epoch": 1, "eval_loss": math.nan}]},
                      {"global_step": 20, "epoch": 1, "eval_loss": None}),
    "steps and epochs strings": ({"log_history": [{"step": "ten", "epoch": "one", "eval_loss": 1.5},
                                                  {"step": 5, "epoch": 0.1, "eval_loss": 3.0}]},
                                 {"global_step": 20, "epoch": 0.1, "eval_loss": 3.0}),
    "not JSON": ("{not json", {"global_step": 20, "epoch": None, "eval_loss": None}),
}


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_a_trainer_state_of_the_wrong_shape_is_read_as_far_as_it_is_valid(tmp_path, case):
    content, want = BAD_STATES[case]
    ck = model(tmp_path / "run" / "checkpoint-20")
    f = ck / "trainer_state.json"
    f.write_text(content if isinstance(content, str) else json.dumps(content))  # json writes NaN/Infinity
    [c] = discover(ck)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = training_metadata(c)
    assert meta == want
    if case != "steps and epochs strings":  # entries with a non-numeric step are skipped quietly
        assert any(str(f) in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert json.loads(json.dumps(meta, allow_nan=False)) == meta  # strict JSON holds it


def test_a_final_models_infinite_eval_loss_is_none(tmp_path):
    run = tmp_path / "run"
    model(run)
    (run / "eval_results.json").write_text('{"eval_loss": Infinity, "epoch": 3.0}')
    [c] = discover(run)
    with pytest.warns(UserWarning, match="eval_results.json: eval_loss is inf"):
        assert training_metadata(c) == {"global_step": None, "epoch": 3.0, "eval_loss": None}


def test_an_infinite_eval_loss_is_stored_as_none_through_the_cli(trained_run, corpus, tmp_path):
    ck = lone_model(trained_run, tmp_path / "checkpoint-60")
    state = json.loads((ck / "trainer_state.json").read_text())
    evals = [e for e in state["log_history"] if "eval_loss" in e]
    assert evals, "the fixture's checkpoints log eval_loss"
    evals[-1]["eval_loss"] = math.inf
    (ck / "trainer_state.json").write_text(json.dumps(state))
    store = tmp_path / "s.zarr"
    r = run_cli("extract", ck, "--dataset", corpus["train"], "--store", store, "--max-train-tokens", 256,
                "--max-val-tokens", 0, "--samples-per-class", 1)
    assert "warning: UserWarning:" in r.output and "not a finite number" in r.output  # one line, its category kept
    attrs = ncanalyze.store.open(store)[f"{tmp_path.name}/checkpoint-60"].attrs
    assert attrs["eval_loss"] is None and attrs["global_step"] == 60
    for f in os.listdir(store / tmp_path.name / "checkpoint-60"):
        if f.endswith(".json"):
            json.loads((store / tmp_path.name / "checkpoint-60" / f).read_text(),
                       parse_constant=lambda c: pytest.fail(f"{f} holds {c}"))
    np.testing.assert_equal(attrs["train_tokens"], 8 * 31)


# ---------------------------------------------------------------- issue 40: every layout a training run saves

from ncanalyze.store.sources.discover import LAYOUTS, layout  # noqa: E402


def adapter(d, weights: bytes = b"a", name: str = "adapter_model.safetensors"):
    """A PEFT adapter as peft saves it (no config.json: its base model is named in adapter_config.json)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/base", "peft_type": "LORA"}))
    (d / name).write_bytes(weights)
    return d


def fsdp(d):
    """accelerate's FSDP SHARDED_STATE_DICT: config.json and pytorch_model_fsdp_0/ (torch.distributed.checkpoint)."""
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "pytorch_model_fsdp_0").mkdir()
    for f in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (d / "pytorch_model_fsdp_0" / f).write_bytes(b"x")
    return d


def zero(d, step: int):
    """The Trainer under DeepSpeed ZeRO-3 without gathering: config.json, latest, zero_to_fp32.py, global_stepN/."""
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "latest").write_text(f"global_step{step}")
    (d / "zero_to_fp32.py").write_text("#")
    (d / f"global_step{step}").mkdir()
    (d / f"global_step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    return d


def test_a_run_mixing_every_layout_is_one_run_in_step_order(tmp_path):
    run = tmp_path / "mixed"
    model(run / "checkpoint-10", state=state(5))
    model(run / "checkpoint-20", weights=b"p").joinpath("model.safetensors").rename(
        run / "checkpoint-20" / "pytorch_model.bin")
    adapter(run / "checkpoint-30")
    adapter(run / "checkpoint-40", name="adapter_model.bin")
    fsdp(run / "checkpoint-50")
    zero(run / "checkpoint-60", 60)
    (run / "checkpoint-70").mkdir()  # nothing in it: not a checkpoint
    fsdp(run / "checkpoint-80").joinpath("pytorch_model_fsdp_0", ".metadata").unlink()  # no metadata: incomplete
    (run / "checkpoint-90").mkdir()
    (run / "checkpoint-90" / "adapter_config.json").write_text("{}")  # an adapter config without its weights
    adapter(run, weights=b"final")  # the adapter saved at the end, unlike the last checkpoint's
    found = discover(run)
    assert [c.name for c in found] == [f"checkpoint-{s}" for s in (10, 20, 30, 40, 50, 60)] + ["final"]
    assert {c.run for c in found} == {"mixed"}
    assert [layout(c.path) for c in found] == ["model", "model", "adapter", "adapter", "fsdp", "zero", "adapter"]
    assert set(LAYOUTS) == {layout(c.path) for c in found}


def test_a_final_adapter_equal_to_the_last_checkpoints_is_not_repeated(tmp_path):
    run = tmp_path / "lora"
    adapter(run / "checkpoint-10", weights=b"same")
    adapter(run, weights=b"same")
    assert [c.name for c in discover(run)] == ["checkpoint-10"]


def test_a_folder_of_runs_of_every_layout(tmp_path):
    adapter(tmp_path / "a-lora" / "checkpoint-5")
    fsdp(tmp_path / "b-fsdp" / "checkpoint-5")
    zero(tmp_path / "c-zero" / "checkpoint-5", 5)
    model(tmp_path / "d-model")
    adapter(tmp_path / "e-adapter")
    assert [c.group for c in discover(tmp_path)] == [
        "a-lora/checkpoint-5", "b-fsdp/checkpoint-5", "c-zero/checkpoint-5", "d-model/final", "e-adapter/final"]
    assert [(c.run, c.name) for c in discover(tmp_path / "c-zero" / "checkpoint-5")] == [("c-zero", "checkpoint-5")]
