"""How Figure 1's metrics move with min_count: report.md's table and min_count.csv are measure() at 1, 2, 5 and 20 of
each run's latest checkpoint, with the kept classes counted by numpy here; absent from a report made from a CSV."""
from __future__ import annotations

import math
import shutil
import warnings
from dataclasses import replace
from functools import partial

import numpy as np
import pandas as pd
import pytest
from ncanalyze.analyzer import UserError, class_stats, measure
from ncanalyze.analyzer.report import FIGURES, ReportOptions, write_report
from ncanalyze.analyzer.report.mincount import MIN_COUNTS, min_count_table
from ncanalyze.store.io import read_group
from test_report import markdown_tables

HEADLINE = FIGURES["fig1_nc_vs_loss"][1]
SECTION = "## How the headline metrics move with min_count"


def gaussians(counts: list[int], seed: int):
    """Class statistics of Gaussian classes with ``counts`` train tokens each, a classifier near the means and
    NC4's counts over the classes with count >= 5 (as an extraction with --min-count 5 counts them)."""
    rng = np.random.default_rng(seed)
    k, d = len(counts), 6
    mu = rng.normal(0, 3, (k, d))
    y = np.repeat(np.arange(k), counts)
    h = mu[y] + rng.normal(0, 1, (y.size, d))
    yv = rng.integers(0, k, 200)
    hv = mu[yv] + rng.normal(0, 1, (200, d))
    return class_stats(h, y, k, classifier=mu + rng.normal(0, 0.3, (k, d)), val_embeddings=hv, val_labels=yv,
                       min_count=5)


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def check_against_measure(table: pd.DataFrame, datasets: dict, notes: list[str]) -> None:
    """Every value is measure(ds, min_count=m) of its checkpoint, computed here; every kept count numpy's."""
    measured = {}
    for _, row in table.iterrows():
        ds = datasets[f"{row.run}/{row.checkpoint}"]
        count = np.asarray(ds["count"].values)
        values = []
        for m in MIN_COUNTS:
            assert row[f"n_kept_{m}"] == (count >= m).sum()
            if (count >= m).sum() < 2:  # measure refuses: nan, and the note says why
                with pytest.raises(UserError, match="need at least 2"):
                    measure(ds, min_count=m)
                expected = math.nan
                assert any("not measured" in n and f"{row.run}/{row.checkpoint} at {m}" in n for n in notes)
            else:
                if (row.run, m) not in measured:
                    with warnings.catch_warnings():  # NC4's note, checked apart
                        warnings.simplefilter("ignore")
                        measured[row.run, m] = measure(ds, min_count=m)
                expected = measured[row.run, m][row.metric]
            assert same(row[f"value_{m}"], expected), (row.run, row.metric, m)
            values.append(expected)
        v = np.array(values)
        want = (v.max() - v.min()) / abs(v[0]) if np.isfinite(v).all() and v[0] != 0 else math.nan
        assert same(row.rel_change, want)


@pytest.mark.slow  # measure() at four min_counts of three runs: about 3 s on the shared cores
def test_each_runs_latest_checkpoint_at_each_min_count_capped_and_nc4_at_each():
    counts = {"r0": [1, 3, 6, 10, 25, 30, 40, 3], "r1": [5, 5, 6, 12, 22, 31, 45, 7], "r2": [1, 3, 6, 10, 25, 2, 4, 8]}
    datasets, rows = {}, []
    for i, (run, c) in enumerate(counts.items()):
        for ckpt, step in (("checkpoint-100", 100), ("checkpoint-20", 20)):  # names sort against the steps
            datasets[f"{run}/{ckpt}"] = gaussians(c if step == 100 else c[::-1], seed=10 * i + step)
            rows.append({"run": run, "checkpoint": ckpt, "global_step": step})
    sel = pd.DataFrame(rows)

    capped, notes = min_count_table(sel, datasets.__getitem__, max_runs=2)
    assert notes[0] == "3 runs selected: the first 2 by name are measured"
    assert list(capped.run.unique()) == ["r0", "r1"] and set(capped.checkpoint) == {"checkpoint-100"}

    table, notes = min_count_table(sel, datasets.__getitem__)
    assert list(table.columns) == ["run", "checkpoint", "metric", "value_1", "n_kept_1", "value_2", "n_kept_2",
                                   "value_5", "n_kept_5", "value_20", "n_kept_20", "rel_change"]  # 1: issue 51
    assert len(table) == 3 * len(HEADLINE) and list(table.metric[:4]) == list(HEADLINE)
    check_against_measure(table, datasets, notes)
    pd.testing.assert_frame_equal(capped, table[table.run != "r2"])
    nc4 = table[table.metric == "nc4_agreement"].set_index("run")
    # NC4 was counted over count >= 5 and, in the same pass, over the kept sets of 1, 2, 5 and 20: measured at 2 too
    # (r0 and r2 have classes of 2-4 tokens: another kept set), its value check_against_measure's
    assert nc4.value_5.between(0, 1).all() and nc4.loc[["r0", "r2"], "value_2"].between(0, 1).all()
    assert nc4.loc["r1", "value_2"] == nc4.loc["r1", "value_5"]  # r1: count >= 2 keeps the same classes as >= 5
    assert nc4.loc["r0", "value_2"] != nc4.loc["r0", "value_5"]
    assert not any("counted at extraction" in n for n in notes)
    assert table.set_index("run").loc["r2"].value_20.isna().all()  # one class of 25 tokens: not measured

    bare, notes = min_count_table(sel[sel.run == "r0"], lambda g: datasets[g].drop_vars("mean"))  # nothing to measure
    assert bare.filter(like="value_").isna().all().all() and list(bare.n_kept_5) == [5] * len(HEADLINE)
    assert notes == ["not measured: the group lacks mean (r0/checkpoint-100 at 1, r0/checkpoint-100 at 2, "
                     "r0/checkpoint-100 at 5, r0/checkpoint-100 at 20)"]


@pytest.mark.slow
def test_report_on_a_store_has_the_table_and_a_csv_report_does_not(extracted_store, kept_store, tmp_path):
    from ncanalyze.store.measure import measure_store

    store = tmp_path / "study.zarr"
    shutil.copytree(extracted_store, store)
    df = measure_store(store).table
    options = ReportOptions(formats="png", n_perm=0, store=store, html=False)
    result = write_report(df, tmp_path / "out", options, read_group=partial(read_group, store))
    table = pd.read_csv(result.files["min_count"])
    pd.testing.assert_frame_equal(table, result.min_count, check_dtype=False)
    last = df.sort_values("global_step").groupby("run").tail(1)
    assert sorted(zip(table.run, table.checkpoint)) == sorted(
        (r, c) for r, c in zip(last.run, last.checkpoint) for _ in HEADLINE)
    datasets = {f"{r}/{c}": read_group(store, f"{r}/{c}") for r, c in zip(last.run, last.checkpoint)}
    check_against_measure(table, datasets, result.min_count_notes)

    text = (result.files["report"]).read_text()
    assert SECTION in text and "- `min_count.csv`" in text
    shown = next(t for t in markdown_tables(text) if "min_count 2 (kept)" in t[0])
    assert len(shown) == 1 + len(table)
    for cells, (_, row) in zip(shown[1:], table.iterrows()):
        for m in MIN_COUNTS:
            assert cells[shown[0].index(f"min_count {m} (kept)")] == f"{row[f'value_{m}']:.4g} ({row[f'n_kept_{m}']})"

    small = tmp_path / "small.zarr"  # 1024 train tokens: classes below 5 and 20 tokens, so min_count bites
    shutil.copytree(kept_store, small)
    sel = measure_store(small).table
    table, notes = min_count_table(sel, partial(read_group, small))
    ds = read_group(small, f"{sel.run[0]}/{sel.checkpoint[0]}")
    check_against_measure(table, {f"{sel.run[0]}/{sel.checkpoint[0]}": ds}, notes)
    assert (table.n_kept_1 >= table.n_kept_2).all()  # min_count 1: every other table's, now in this one too
    assert (table.n_kept_2 > table.n_kept_5).all() and (table.n_kept_5 > table.n_kept_20).all()
    assert table[table.metric == "nc1_cdnv"].rel_change.iloc[0] > 0
    count, extracted = ds["count"].values, ds.attrs["min_count"]  # NC4's decisions were counted over count >= that
    nc4 = table[table.metric == "nc4_agreement"].iloc[0]
    other = [m for m in MIN_COUNTS if ((count >= m) != (count >= extracted)).any()]
    assert other and all(0 < nc4[f"value_{m}"] < 1 for m in MIN_COUNTS)  # other kept sets: counted in the same pass
    assert not any("counted at extraction" in n for n in notes)

    csv = write_report(pd.read_csv(result.files["metrics"]), tmp_path / "from_csv", replace(options, store=None))
    assert "min_count" not in csv.files and csv.min_count is None
    assert not (tmp_path / "from_csv" / "min_count.csv").exists()
    assert SECTION not in csv.files["report"].read_text() and "min_count.csv" not in csv.files["report"].read_text()


def test_the_first_runs_by_name_whatever_the_rows_order_and_ties_in_step():
    """"The first 12 runs by name" is what is measured: the runs in name order, each its latest checkpoint, with
    the rows shuffled and every run's latest at the same step."""
    from ncanalyze.analyzer.report.tokens import latest_checkpoints
    runs = [f"run{i:02d}" for i in range(15)]
    sel = pd.DataFrame([{"run": r, "checkpoint": f"checkpoint-{s}", "global_step": s} for r in runs for s in (10, 40)])
    for seed in range(5):
        shuffled = sel.sample(frac=1, random_state=seed)
        assert latest_checkpoints(shuffled) == [f"{r}/checkpoint-40" for r in runs]
    ds = gaussians([6, 7, 8, 9, 10, 11, 12, 13], seed=1)
    table, notes = min_count_table(sel.sample(frac=1, random_state=3), lambda g: ds)
    assert notes[0] == "15 runs selected: the first 12 by name are measured"
    assert list(table.run.unique()) == runs[:12] and set(table.checkpoint) == {"checkpoint-40"}
