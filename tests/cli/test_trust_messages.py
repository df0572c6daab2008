"""Issue 21, item 19: messages that named the wrong problem now name the right one (each on a real failure)."""
from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
from conftest import run_cli
from test_stats import study


def one_line(result) -> str:
    lines = [l for l in result.output.strip().splitlines() if l.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def layered_csv(tmp_path):
    """A metrics table with every layer of 2-block models, as metrics.csv is with --layers all."""
    df = study(n_runs=4, per_run=3, seed=5)
    df = pd.concat([df.assign(layer=l, n_layers=2) for l in (0, 1, 2)], ignore_index=True)
    csv = tmp_path / "m.csv"
    df.to_csv(csv, index=False)
    return csv


@pytest.mark.slow
def test_a_selection_of_intermediate_layers_says_the_correlations_use_last_layers(tmp_path):
    line = one_line(run_cli("report", layered_csv(tmp_path), "--out", tmp_path / "r", "--where", "layer == 0",
                            "--permutations", 0, ok=False))
    assert "last layer" in line and "layers.csv" in line and "no evaluation" not in line
    run_cli("report", layered_csv(tmp_path), "--out", tmp_path / "ok", "--permutations", 0)  # all layers: fine


def test_a_text_control_is_refused_not_printed_as_controlled_for(tmp_path):
    csv = tmp_path / "m.csv"
    study(n_runs=4, per_run=3, seed=6).to_csv(csv, index=False)
    line = one_line(run_cli("report", csv, "--out", tmp_path / "r", "--controls", "run", "--permutations", 0,
                            ok=False))
    assert "'run' is not a number" in line and "--where" in line
    assert not (tmp_path / "r" / "report.md").exists()


@pytest.mark.slow
def test_a_users_own_metrics_csv_in_out_is_never_overwritten(tmp_path):
    csv = tmp_path / "m.csv"
    study(n_runs=4, per_run=3, seed=7).to_csv(csv, index=False)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "metrics.csv").write_text("my,own\n1,2\n")
    line = one_line(run_cli("report", csv, "--out", out, "--permutations", 0, ok=False))
    assert "metrics.csv" in line and "another --out" in line
    assert (out / "metrics.csv").read_text() == "my,own\n1,2\n"
    ours = ("report", csv, "--out", tmp_path / "ours", "--permutations", 0, "--metrics", "nc1_cdnv")  # files, not maths
    run_cli(*ours)
    run_cli(*ours)  # our own report is replaced


@pytest.mark.slow
def test_weights_of_another_shape_than_the_config_say_so(trained_run, corpus, tmp_path):
    ckpt = tmp_path / "run" / "checkpoint-20"
    shutil.copytree(trained_run / "checkpoint-20", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["intermediate_size"] = 4 * config["hidden_size"] + 8  # the MLP's weights no longer fit the config
    (ckpt / "config.json").write_text(json.dumps(config))
    line = one_line(run_cli("extract", ckpt, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr",
                            "--max-train-tokens", 1024, "--max-val-tokens", 512, ok=False))
    assert "do not match its config.json" in line and "above report" not in line
