"""The store's format version (a root attribute): written with the root by every writer, and a store of another format
(or of none: written before stores were versioned) refused by every command with one line saying to extract again."""
from __future__ import annotations

import json
import shutil

import pytest
import zarr
from conftest import run_cli
from ncanalyze.core.errors import UserError
from ncanalyze.store import io


def test_the_root_carries_the_format(extracted_store):
    assert zarr.open_group(extracted_store, mode="r", zarr_format=3).attrs[io.FORMAT_KEY] == io.FORMAT
    io.check_format(extracted_store)  # this version's own store reads


def with_format(src, dest, value):
    """A copy of store ``src`` whose root says format ``value`` (None: no format at all)."""
    shutil.copytree(src, dest)
    meta = json.loads((dest / "zarr.json").read_text())
    meta.setdefault("attributes", {}).pop(io.FORMAT_KEY, None)
    if value is not None:
        meta["attributes"][io.FORMAT_KEY] = value
    (dest / "zarr.json").write_text(json.dumps(meta))
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("value, words", [(None, "before ncanalyze versioned its stores"),
                                          (io.FORMAT + 1, f"in store format {io.FORMAT + 1}"),
                                          ("1", "in store format '1'")])
def test_a_store_of_another_format_is_refused_by_every_command(extracted_store, trained_run, corpus, tmp_path,
                                                                value, words):
    store = with_format(extracted_store, tmp_path / "other.zarr", value)
    before = sorted(p.relative_to(store).as_posix() for p in store.rglob("*"))
    for args in (["ls"], ["measure"], ["report", "--out", tmp_path / "r"], ["rm", "neo-2x32", "--dry-run"],
                 ["extract", trained_run / "checkpoint-20", "--dataset", corpus["train"], "--max-train-tokens", 256,
                  "--max-val-tokens", 256]):
        r = run_cli(*args, "--store", store, ok=False)
        errors = [line for line in r.output.splitlines() if "Error:" in line]
        assert len(errors) == 1 and words in errors[0] and "extract again" in errors[0], (args, r.output)
        assert "Traceback" not in r.output
    assert sorted(p.relative_to(store).as_posix() for p in store.rglob("*")) == before  # nothing written
    with pytest.raises(UserError, match="extract again"):
        io.open_tree(store)


def test_every_writer_creates_the_root_with_its_format(tmp_path):
    """The root is created with its format in the same metadata write, also when a run's group comes first."""
    for target in ("", "run", "run/checkpoint-1"):
        store = tmp_path / f"s{len(target)}.zarr"
        io.ensure_group(store, target)
        assert zarr.open_group(store, mode="r", zarr_format=3).attrs[io.FORMAT_KEY] == io.FORMAT


def test_a_group_measured_under_other_metric_definitions_is_measured_again(extracted_store, tmp_path):
    """The metrics record their definitions' version (schema.METRICS_VERSION); a group measured under another (an
    earlier release's erank or CDNV) is measured again, with today's numbers, and one of this version is not."""
    from ncanalyze.analyzer.schema import METRICS_VERSION
    from ncanalyze.store.measure import measure_store

    store = tmp_path / "s.zarr"
    shutil.copytree(extracted_store, store)
    measure_store(store)
    groups, _ = io.checkpoint_groups(store)
    fresh = {g: io.group_attrs(store, g)["metrics"] for g in groups}
    assert all(io.group_attrs(store, g)["metrics_version"] == METRICS_VERSION for g in groups)
    g = zarr.open_group(store, path=groups[0], mode="r+", zarr_format=3)
    g.attrs.update({"metrics_version": METRICS_VERSION - 1, "metrics": {**fresh[groups[0]], "nc1_cdnv": 123.0}})
    again = measure_store(store)
    assert again.measured == [groups[0]]  # that group alone
    assert io.group_attrs(store, groups[0])["metrics"] == fresh[groups[0]]  # today's numbers, not the stale 123
