"""The report's default target: val_loss where every selected checkpoint has it, else eval_loss; measure_store's
table carries val_loss and val_accuracy from the groups."""
from __future__ import annotations

import shutil

import ncanalyze.store
import numpy as np
import pandas as pd
import pytest
from conftest import run_cli
from ncanalyze.analyzer.report import ReportOptions, write_report
from ncanalyze.store.measure import measure_store
from test_stats import study

pytestmark = pytest.mark.slow  # every test here takes over ~2 s with its fixtures


def _with_val_loss(seed: int = 3) -> pd.DataFrame:
    df = study(n_runs=3, per_run=5, seed=seed)
    rng = np.random.default_rng(seed)
    df["val_loss"] = df["eval_loss"] * 0.9 + rng.normal(0, 0.05, len(df))
    df["val_accuracy"] = rng.uniform(0.1, 0.5, len(df))
    return df


def _r(stats: pd.DataFrame, metric: str) -> float:
    return float(stats[(stats.metric == metric) & (stats.scale == "raw")].r.iloc[0])


def test_default_target_is_val_loss_when_every_selected_checkpoint_has_it(tmp_path):
    df = _with_val_loss()
    files = write_report(df, tmp_path / "a", ReportOptions(formats="png", metrics=["nc1_cdnv"], n_perm=0)).files
    assert "Target: `val_loss`" in files["report"].read_text()
    assert _r(pd.read_csv(files["stats"]), "nc1_cdnv") == pytest.approx(np.corrcoef(df.nc1_cdnv, df.val_loss)[0, 1])

    files = write_report(df, tmp_path / "b", ReportOptions(formats="png",
                                                           metrics=["nc1_cdnv"], n_perm=0, target="eval_loss")).files
    assert "Target: `eval_loss`" in files["report"].read_text()
    assert _r(pd.read_csv(files["stats"]), "nc1_cdnv") == pytest.approx(np.corrcoef(df.nc1_cdnv, df.eval_loss)[0, 1])

    df.loc[4, "val_loss"] = np.nan  # one checkpoint without it: eval_loss, unless --where leaves it out
    files = write_report(df, tmp_path / "c", ReportOptions(formats="png", metrics=["nc1_cdnv"], n_perm=0)).files
    assert "Target: `eval_loss`" in files["report"].read_text()
    where = f"not (run == {df.run[4]!r} and global_step == {df.global_step[4]})"
    files = write_report(df, tmp_path / "d", ReportOptions(formats="png",
                                                           metrics=["nc1_cdnv"], n_perm=0, where=where)).files
    assert "Target: `val_loss`" in files["report"].read_text()


def test_cli_default_and_explicit_target(tmp_path):
    csv = tmp_path / "m.csv"
    _with_val_loss().to_csv(csv, index=False)
    run_cli("report", csv, "--out", tmp_path / "r", "--metrics", "nc1_cdnv", "--permutations", 0)
    assert "Target: `val_loss`" in (tmp_path / "r" / "report.md").read_text()
    run_cli("report", csv, "--out", tmp_path / "e", "--metrics", "nc1_cdnv", "--permutations", 0,
            "--target", "eval_loss")
    assert "Target: `eval_loss`" in (tmp_path / "e" / "report.md").read_text()
    old = tmp_path / "old.csv"  # a table from before val_loss
    pd.read_csv(csv).drop(columns=["val_loss", "val_accuracy"]).to_csv(old, index=False)
    run_cli("report", old, "--out", tmp_path / "o", "--metrics", "nc1_cdnv", "--permutations", 0)
    assert "Target: `eval_loss`" in (tmp_path / "o" / "report.md").read_text()


def test_measure_store_table_carries_val_loss_and_accuracy(extracted_store, tmp_path):
    store = tmp_path / "copy.zarr"
    shutil.copytree(extracted_store, store)
    df = measure_store(store).table
    tree = ncanalyze.store.open(store)
    for _, row in df.iterrows():
        attrs = tree[f"{row.run}/{row.checkpoint}"].attrs
        assert row.val_loss == attrs["val_loss"] and row.val_accuracy == attrs["val_accuracy"]
    assert list(df.columns).index("val_loss") == list(df.columns).index("eval_loss") + 1
    run_cli("report", store, "--out", tmp_path / "r", "--permutations", 0)
    assert "Target: `val_loss`" in (tmp_path / "r" / "report.md").read_text()
