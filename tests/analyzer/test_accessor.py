"""The xarray accessor ``nc`` (SPEC section 3) on real stores from the conftest fixtures: ``ds.nc.measure()`` and
``ds.nc.class_metrics()`` are the analyzer's functions, ``tree.nc.table()`` is the table ``measure`` and
``metrics.csv`` give, row for row; and importing ``ncanalyze`` (or any subpackage) registers it."""
from __future__ import annotations

import math
import shutil
import subprocess
import sys

import ncanalyze.store
import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
from conftest import run_cli
from ncanalyze.analyzer import class_metrics, measure
from ncanalyze.analyzer.schema import CLASS_COUNTS, ERRORS, INFO, LAYER, SCALARS
from ncanalyze.store.io import checkpoint_groups
from ncanalyze.store.measure import measure_store


def assert_same_metrics(got: dict[str, float], want: dict[str, float]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-15, nan_ok=True), k


@pytest.fixture(scope="module")
def measured(extracted_store, tmp_path_factory):
    """A copy of the extracted store (every checkpoint of the trained run), measured with min_count 2."""
    store = tmp_path_factory.mktemp("accessor") / "s.zarr"
    shutil.copytree(extracted_store, store)
    return store, measure_store(store, min_count=2).table


@pytest.mark.slow
def test_dataset_accessor_is_the_analyzer(extracted_store):
    tree = ncanalyze.store.open(extracted_store)
    ds = tree["neo-2x32/checkpoint-40"].to_dataset()
    assert_same_metrics(ds.nc.measure(), measure(ds))
    count = ds["count"].values
    k = int(np.median(count[count > 0])) + 1  # a min_count that leaves out about half the classes
    with pytest.warns(UserWarning, match="nc4_agreement is nan"):  # NC4's kept set was fixed at extraction
        some, per_class = ds.nc.measure(min_count=k), ds.nc.class_metrics(min_count=k)
    with pytest.warns(UserWarning, match="nc4_agreement is nan"):
        assert_same_metrics(some, measure(ds, min_count=k))
        xr.testing.assert_identical(per_class, class_metrics(ds, min_count=k))
    assert some["nc1_cdnv"] != ds.nc.measure(min_count=1)["nc1_cdnv"]  # min_count reaches the metrics
    assert int(np.isfinite(per_class.class_norm).sum()) == int((count >= k).sum())
    assert_same_metrics(ds.nc.measure(tile=7), measure(ds, tile=7))


@pytest.mark.slow
def test_tree_table_is_the_metrics_table(measured, tmp_path):
    store, df = measured
    tree = ncanalyze.store.open(store)
    table = tree.nc.table()
    assert list(table.columns) == [*INFO, LAYER, "site", "labels", "class_axis", *CLASS_COUNTS, *SCALARS, *ERRORS]
    pd.testing.assert_frame_equal(table, df)
    assert [f"{r}/{c}" for r, c in zip(table.run, table.checkpoint)] == checkpoint_groups(store)[0]
    for row in table.itertuples():
        ds = tree[f"{row.run}/{row.checkpoint}"].to_dataset()
        assert_same_metrics({k: getattr(row, k) for k in (*SCALARS, *CLASS_COUNTS, *ERRORS)},
                            measure(ds, min_count=2))  # the errors too: se, the same default everywhere
        assert (row.global_step, row.n_params, row.layer) == (ds.attrs["global_step"], ds.attrs["n_params"], 2)
        assert math.isnan(row.tag)  # no --tag: nan, as metrics.csv reads back
    run_cli("report", store, "--out", tmp_path / "r", "--permutations", 0, "--min-count", 2)
    csv = pd.read_csv(tmp_path / "r" / "metrics.csv")
    pd.testing.assert_frame_equal(csv[table.columns], table, check_dtype=False, rtol=1e-12)


def test_an_unmeasured_or_unfinished_checkpoint_in_the_table(extracted_store, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(extracted_store, store)
    table = ncanalyze.store.open(store).nc.table()
    groups = checkpoint_groups(store)[0]
    assert len(table) == len(groups) >= 3 and table[list(SCALARS)].isna().all().all()  # not measured: nan
    zarr.open_group(store, path=groups[0], mode="r+", zarr_format=3).attrs["complete"] = False
    table = ncanalyze.store.open(store).nc.table()
    assert [f"{r}/{c}" for r, c in zip(table.run, table.checkpoint)] == groups[1:]
    assert list(measure_store(store).table.checkpoint) == list(table.checkpoint)  # the same groups as the store's reader


@pytest.mark.slow
def test_one_row_per_checkpoint_and_layer(trained_run, corpus, tmp_path):
    store = tmp_path / "layers.zarr"
    run_cli("extract", trained_run / "checkpoint-20", "--dataset", corpus["train"], "--store", store, "--layers",
            "all", "--max-train-tokens", 1024, "--max-val-tokens", 512, "--samples-per-class", 1)
    df = measure_store(store).table
    tree = ncanalyze.store.open(store)
    table = tree.nc.table()
    pd.testing.assert_frame_equal(table, df)
    assert list(table.layer) == [0, 1, 2]
    for row in table.itertuples():
        g = "neo-2x32/checkpoint-20" + ("" if row.layer == 2 else f"/layers/{row.layer}")
        assert_same_metrics({k: getattr(row, k) for k in (*SCALARS, *CLASS_COUNTS, *ERRORS)},
                            measure(tree[g].to_dataset()))


@pytest.mark.slow
@pytest.mark.parametrize("code", [
    "import ncanalyze, xarray",  # the accessor registers the moment xarray loads
    "import xarray, ncanalyze",  # or at once when it is already loaded
    "import ncanalyze.analyzer, xarray",  # a subpackage imports the package, which registers it
    # a library that probes for xarray first (transformers, peft) imports nothing: the import after it registers
    "import ncanalyze, importlib.util; importlib.util.find_spec('xarray'); import xarray",
])
def test_importing_ncanalyze_registers_the_accessor(code, tmp_path):
    check = (f"{code}; import sys; assert hasattr(xarray.Dataset, 'nc') and hasattr(xarray.DataTree, 'nc'); "
             "assert xarray.Dataset.nc is sys.modules['ncanalyze.analyzer.accessor'].DatasetAccessor")
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
