"""The CPU recipe (examples/recipe_cpu.py) end to end in a tiny configuration: train, extract, measure, report."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from conftest import ROOT, make_corpus

TINY = [  # a 2 x 2 grid and 3 seed replicas of one of its architectures, 10 steps each, checkpoints at 5 and 10
    "--vocab", "300", "--block-size", "32", "--batch-size", "8", "--steps", "10", "--save-steps", "5",
    "--heads", "2", "--depths", "1", "2", "--widths", "16", "32", "--replicas", "1x16", "--replica-seeds", "0", "1",
    "2", "--train-tokens", "4096", "--val-tokens", "2048", "--jobs", "2", "--permutations", "199",
    "--formats", "png",
    "--tokens", " the, and",
]
RUNS = ["neo-L1-d16-s0-wd0.1", "neo-L1-d32-s0-wd0.1", "neo-L2-d16-s0-wd0.1", "neo-L2-d32-s0-wd0.1",
        "neo-L1-d16-s1-wd0.1", "neo-L1-d16-s2-wd0.1"]
RECIPE = ROOT / "examples" / "recipe_cpu.py"


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("recipe")
    text = make_corpus(tmp / "corpus.txt", 3000, seed=3)
    out = tmp / "out"
    proc = subprocess.run([sys.executable, str(RECIPE), "--text", str(text), "--out", str(out), *TINY,
                           "--results", str(out / "published")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.slow  # the recipe fixture: a whole tiny study
def test_runs_are_trainer_folders_with_checkpoints(recipe):
    runs = recipe[0] / "runs"
    assert sorted(p.name for p in runs.iterdir() if p.name.startswith("neo-")) == sorted(RUNS)
    for run in RUNS:
        assert sorted(p.name for p in (runs / run).glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-5"]
        state = json.loads((runs / run / "checkpoint-10" / "trainer_state.json").read_text())
        evals = [e["step"] for e in state["log_history"] if "eval_loss" in e]
        assert evals == [5, 10]
        assert (runs / run / "model.safetensors").is_file() and (runs / run / "tokenizer.json").is_file()


@pytest.mark.slow  # the recipe fixture: a whole tiny study
def test_seed_replicas_differ_and_grid_models_have_their_shapes(recipe):
    recipe = recipe[0]
    cfg = json.loads((recipe / "runs" / "neo-L2-d32-s0-wd0.1" / "config.json").read_text())
    assert (cfg["num_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (2, 32, 300)
    losses = {run: json.loads((recipe / "runs" / run / "eval_results.json").read_text())["eval_loss"]
              for run in RUNS}
    replicas = [losses[r] for r in RUNS if r.startswith("neo-L1-d16-")]
    assert len(set(replicas)) == 3  # different seeds, different models
    assert all(np.isfinite(v) and v < np.log(300) for v in losses.values())  # they learned something


@pytest.mark.slow  # the recipe fixture: a whole tiny study
def test_store_holds_every_checkpoint_measured(recipe):
    recipe = recipe[0]
    tree = xr.open_datatree(recipe / "store.zarr", engine="zarr", consolidated=False)
    for run in RUNS:
        for ckpt in ("checkpoint-5", "checkpoint-10"):
            node = tree[f"{run}/{ckpt}"]
            assert {"count", "mean", "variance", "classifier", "samples", "class_cdnv"} <= set(node.variables)
            assert node.attrs["global_step"] == int(ckpt.split("-")[1])
            assert node.attrs["train_tokens"] == 4096 // 32 * 31  # 128 blocks; a block's last token has no label
            assert np.isfinite(node.attrs["metrics"]["nc1_cdnv"])


@pytest.mark.slow  # the recipe fixture: a whole tiny study
def test_reports_and_figures(recipe):
    recipe, stdout = recipe
    for name, n_rows in (("report-all", 12), ("report-final", 4), ("report-seeds", 3)):
        folder = recipe / name
        assert (folder / "report.md").is_file() and any(folder.glob("*.png")), name
        table = pd.read_csv(folder / "metrics.csv")
        assert len(table) == n_rows, name
    seeds = pd.read_csv(recipe / "report-seeds" / "metrics.csv")
    assert set(seeds["run"]) == {"neo-L1-d16-s0-wd0.1", "neo-L1-d16-s1-wd0.1", "neo-L1-d16-s2-wd0.1"}
    assert (recipe / "explore" / "embeddings.png").is_file() and (recipe / "explore" / "cdnv_hist.png").is_file()
    times = [json.loads(line) for line in (recipe / "timings.jsonl").read_text().splitlines()]
    assert len(times) == 1
    assert set(times[0]) == {"date", "corpus", "training", "runs_trained_before", "extract", "measure", "report",
                             "depth", "callback", "explore", "total"}
    assert times[0]["runs_trained_before"] == 0
    assert "$ ncanalyze extract " in stdout and "done in" in stdout


def test_recipe_explains_a_missing_text(tmp_path):
    proc = subprocess.run([sys.executable, str(RECIPE), "--text", str(tmp_path / "missing.txt"), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "missing.txt is not a non-empty file" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # the recipe fixture: a whole tiny study
def test_every_layer_of_the_final_models_and_the_depth_figure(recipe):
    recipe = recipe[0]
    depth = pd.read_csv(recipe / "report-depth" / "metrics.csv")
    assert len(depth.drop_duplicates(["run", "checkpoint"])) == 4  # the grid's four final models
    assert set(depth.groupby("run").layer.nunique()) == {2, 3}  # depth 1: hidden states 0-1; depth 2: 0-2
    assert any((recipe / "report-depth").glob("*depth*.png"))


@pytest.mark.slow  # the recipe fixture: a whole tiny study
def test_the_callback_run_equals_its_post_hoc_extraction(recipe):
    """The replica trained again with the callback: its step-N groups' metrics equal extract's of the checkpoints the
    same training saved, metric by metric (the callback runs the extraction's own passes on the same blocks)."""
    recipe, stdout = recipe
    table = pd.read_csv(recipe / "callback_compare.csv")
    assert sorted(table.step.unique()) == [5, 10] and table.metric.nunique() >= 20
    finite = table.dropna(subset=["rel_diff"])
    assert len(finite) >= 2 * 15 and finite.rel_diff.max() < 1e-9, finite.sort_values("rel_diff").tail()
    assert "callback vs extract" in stdout


@pytest.mark.slow  # the recipe fixture: a whole tiny study
def test_results_are_published_with_a_summary_from_stats(recipe):
    out = recipe[0] / "published"
    for name in ("all", "final", "seeds", "depth", "explore"):
        assert (out / name).is_dir(), name
    summary = (out / "summary.md").read_text()
    stats = pd.read_csv(out / "final" / "stats.csv")
    raw = stats[stats.scale == "raw"]
    assert summary.count("| nc1_cdnv |") == 3 and f"{raw.r[raw.metric == 'nc1_cdnv'].iloc[0]:.3g}" in summary
    assert "permuted: whole runs" in summary and "p >= " in summary
    assert (out / "callback" / "compare.csv").is_file() and len((out / "timings.jsonl").read_text().splitlines()) == 1
    assert "r 95% CI (runs)" in summary


@pytest.mark.slow  # the recipe fixture: a whole tiny study
def test_findings_say_each_question_from_the_published_files(recipe):
    """findings.md of the tiny study: the design line counts the replicas, and each Figure 1 metric's sentence
    carries the final models' r with its interval (final/stats.csv) and the pooled r (all/stats.csv)."""
    out = recipe[0] / "published"
    text = (out / "findings.md").read_text()
    assert "12 checkpoints of 6 runs at steps 5, 10; 4 architectures, and 3 of the 6 runs are replicas" in text
    final, every = (pd.read_csv(out / k / "stats.csv") for k in ("final", "all"))
    for metric, scale in (("nc1_cdnv", "log"), ("nc4_agreement", "raw")):
        f = final[(final.metric == metric) & (final.scale == scale)].iloc[0]
        e = every[(every.metric == metric) & (every.scale == scale)].iloc[0]
        line = next(x for x in text.splitlines() if f"(`{metric}`" in x)
        assert f"Between models at the final step (4 models): r {f.r:+.2f} [{f.r_ci_low:+.2f}, {f.r_ci_high:+.2f}]" \
            in line
        assert f"pooled (12 checkpoints): r {e.r:+.2f}" in line
    assert "**Seed replicas** (the paper's Table 1; 3 runs of 1 x 16" in text and "**Depth**" in text


def test_the_readme_quotes_the_committed_findings_as_generated():
    """The README's findings are the committed examples/results/findings.md, verbatim, so they cannot drift
    (findings.md itself is checked against its files in test_claims.py; the site includes findings.md and
    summary.md from the files at build time, tests/test_docs.py)."""
    name = "findings"
    readme = (ROOT / "README.md").read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    quoted = readme[readme.index(start) + len(start):readme.index(end)].strip()
    assert quoted == (ROOT / "examples" / "results" / f"{name}.md").read_text().strip()
