"""--tag: the same checkpoint measured on two datasets in one store, at distinct groups, selectable by `tag`."""
from __future__ import annotations

import ncanalyze.store
import numpy as np
import pandas as pd
import pytest
from conftest import lone_model, make_corpus, run_cli

pytestmark = pytest.mark.slow  # every test here takes over ~2 s with its fixtures

OPTS = ("--max-train-tokens", 2048, "--max-val-tokens", 1024, "--samples-per-class", 2)


def test_two_datasets_in_one_store_by_tag(trained_run, corpus, tmp_path):
    ck = lone_model(trained_run, tmp_path / "model")
    other = tmp_path / "other"
    other.mkdir()
    make_corpus(other / "train.txt", 400, seed=7)
    make_corpus(other / "validation.txt", 100, seed=8)
    store = tmp_path / "s.zarr"
    run_cli("extract", ck, "--dataset", corpus["train"], "--store", store, *OPTS)

    r = run_cli("extract", ck, "--dataset", other / "train.txt", "--store", store, *OPTS, ok=False)
    assert "another configuration" in r.output and "--tag" in r.output and len(r.output.strip().splitlines()) == 1
    run_cli("extract", ck, "--dataset", other / "train.txt", "--store", store, "--tag", "other", *OPTS)
    r = run_cli("extract", ck, "--dataset", other / "train.txt", "--store", store, "--tag", "other", *OPTS)
    assert "1 already in" in r.output  # a re-run with the tag is a no-op

    alone = tmp_path / "alone.zarr"  # the same dataset without a tag, in a store of its own
    run_cli("extract", ck, "--dataset", other / "train.txt", "--store", alone, *OPTS)
    tree = ncanalyze.store.open(store)
    assert sorted(tree.children) == ["model", "model@other"]
    tagged, ref = tree["model@other/final"].to_dataset(), ncanalyze.store.open(alone)["model/final"].to_dataset()
    for name in ref.data_vars:
        np.testing.assert_array_equal(tagged[name].values, ref[name].values, err_msg=name)
    assert tagged.attrs["tag"] == "other" and tagged.attrs["run"] == "model@other"
    assert tagged.attrs["config_hash"] == ref.attrs["config_hash"]  # the tag is where, not what
    assert tree["model/final"].attrs["tag"] is None
    assert not np.array_equal(tree["model/final"]["count"].values, tagged["count"].values)

    run_cli("report", store, "--out", tmp_path / "r", "--where", "tag == 'other'", "--permutations", 0)
    table = pd.read_csv(tmp_path / "r" / "metrics.csv")
    assert list(table.tag) == ["other"] and list(table.run) == ["model@other"]

    bad = run_cli("extract", ck, "--dataset", other / "train.txt", "--store", store, "--tag", "a/b", ok=False)
    assert "--tag" in bad.output
