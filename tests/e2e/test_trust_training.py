"""The training callback trusted with a shared store (issue 30): DDP ranks given different data are refused in one
line; a second training under the same folder name is refused, keeping the first one's groups; the callback's
``step-N`` and extract's ``checkpoint-N`` of one model and step count once in measure and report. Real Trainer runs,
real torchrun."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import run_cli
from test_training import CLI_OPTS, EVERY, OPTS, said, train


def train_width(corpus, out: Path, callbacks, width: int):
    """test_training's run (EVERY steps, evaluated then, nothing saved) of a GPT-Neo of another width."""
    return train(corpus, out, callbacks, steps=EVERY, width=width, save_strategy="no")


# ---------------------------------------------------------------- 5: two trainings under one folder name

@pytest.mark.slow
def test_a_second_model_under_the_same_run_name_is_refused_and_the_first_kept(corpus, tmp_path, caplog):
    import ncanalyze.store

    from ncanalyze.training import NeuralCollapseCallback

    store = tmp_path / "s.zarr"
    train_width(corpus, tmp_path / "a" / "out", [NeuralCollapseCallback(store, str(corpus["train"]),
                                                                        str(corpus["val"]), **OPTS)], 32)
    first = ncanalyze.store.open(store)[f"out/step-{EVERY}"]
    assert first.attrs["output_dir"] == str((tmp_path / "a" / "out").resolve()) and first.attrs["hidden_size"] == 32
    before = ncanalyze.store.open(store).to_dict()
    cb = NeuralCollapseCallback(store, str(corpus["train"]), str(corpus["val"]), **OPTS)
    with said(caplog) as lines:
        trainer = train_width(corpus, tmp_path / "b" / "out", [cb], 64)
    assert trainer.state.global_step == EVERY  # training went on
    assert len(lines) == 1 and "already holds run out of another model" in lines[0], lines
    assert "width 32" in lines[0] and "width 64" in lines[0] and str(tmp_path / "b" / "out") in lines[0], lines
    assert "run_name" in lines[0] and "training goes on" in lines[0], lines
    after = ncanalyze.store.open(store).to_dict()
    assert list(after) == list(before)
    for g, node in before.items():
        assert node.identical(after[g]), g


# ---------------------------------------------------------------- 16: one unit per model and step

@pytest.mark.slow
def test_the_callbacks_and_extracts_groups_of_one_model_and_step_count_once(corpus, tmp_path):
    from ncanalyze.training import NeuralCollapseCallback

    store = tmp_path / "s.zarr"
    cb = NeuralCollapseCallback(store, str(corpus["train"]), str(corpus["val"]), **OPTS)
    train(corpus, tmp_path / "neo", [cb])
    run_cli("extract", tmp_path / "neo", "--dataset", corpus["train"], "--val-dataset", corpus["val"], "--store",
            store, *CLI_OPTS)
    r = run_cli("measure", store)
    for step in (10, 20):
        said = [line for line in r.output.splitlines() if f"neo/step-{step}: skipped" in line]
        assert len(said) == 1 and f"the same model and step as neo/checkpoint-{step}" in said[0], r.output
    out = tmp_path / "report"
    run_cli("report", store, "--out", out, "--permutations", 0)
    table = pd.read_csv(out / "metrics.csv")
    assert sorted(table.checkpoint) == ["checkpoint-10", "checkpoint-20"], table.checkpoint
    assert "neo/step-10" in (out / "report.md").read_text()


# ---------------------------------------------------------------- 4: DDP ranks given different data

DDP_SCRIPT = """
import os, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + '/store/runs']  # tests/ (conftest) and test_training's folder
from test_training import OPTS, train
from ncanalyze.training import NeuralCollapseCallback
corpus = {"train": sys.argv[2], "val": sys.argv[3], "tokenizer": sys.argv[4]}
mine = corpus["train"] if os.environ["RANK"] == "0" else corpus["val"]  # rank 1 given other data
cb = NeuralCollapseCallback(sys.argv[6], mine, corpus["val"], **{**OPTS, "batch_size": 3})
trainer = train(corpus, sys.argv[5], [cb], steps=10, ddp_backend="gloo")
assert trainer.state.global_step == 10
"""


@pytest.mark.slow
def test_ddp_ranks_given_different_data_are_refused_in_one_line(corpus, tmp_path):
    import ncanalyze.store

    script = tmp_path / "ddp_train.py"
    script.write_text(DDP_SCRIPT)
    tests = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          "29534", str(script), str(tests), str(corpus["train"]), str(corpus["val"]),
                          str(corpus["tokenizer"]), str(tmp_path / "neo"), str(tmp_path / "live.zarr")],
                         capture_output=True, text=True, timeout=600, cwd=tests)
    assert run.returncode == 0, run.stderr[-3000:]  # training went on, on both ranks
    said = [line for line in run.stderr.splitlines() if "ranks read different train data" in line]
    assert len(said) == 1 and "rank 0:" in said[0] and "rank 1:" in said[0], run.stderr[-3000:]
    assert "training goes on" in said[0] and "validation.txt" in said[0], said
    live = tmp_path / "live.zarr"
    assert not (live / "zarr.json").exists() or not list(ncanalyze.store.open(live).subtree)[1:]
