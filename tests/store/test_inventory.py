"""A store a newcomer can see into: ``ncanalyze.store.open`` is lazy (dask, out-of-core), groups come in step order,
``ncanalyze ls`` lists what a store holds, and ``ncanalyze rm`` removes checkpoints, runs or tags safely. On real
stores extracted from the conftest's Trainer run."""
from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
from pathlib import Path

import dask.array as da
import numpy as np
import pandas as pd
import pytest
import zarr
from conftest import EXTRACT_OPTS, cli_process, kill_when, lock_held, make_corpus, run_cli
from test_metrics import assert_metrics, brute_force

import ncanalyze.store
from ncanalyze.analyzer import CLASS_COUNTS, SCALARS, measure
from ncanalyze.store import io
from ncanalyze.store.layout import group_order
from ncanalyze.store.inventory import disk_bytes, files_of
from ncanalyze.store.measure import measure_store

N_EMB = 400
OTHER = "neo-2x32@other/checkpoint-40"  # the tagged checkpoint of ``study``


@pytest.fixture(scope="module")
def study(extracted_store, trained_run, tmp_path_factory) -> Path:
    """``extracted_store`` (checkpoint-20/40/60 of ``trained_run``) plus checkpoint-40 on another dataset with
    --tag other, every layer and saved embeddings."""
    d = tmp_path_factory.mktemp("inventory")
    store = d / "study.zarr"
    shutil.copytree(extracted_store, store)
    (d / "other").mkdir()
    make_corpus(d / "other" / "train.txt", 400, seed=7)
    make_corpus(d / "other" / "validation.txt", 100, seed=8)
    run_cli("extract", trained_run / "checkpoint-40", "--dataset", d / "other" / "train.txt", "--store", store,
            "--tag", "other", "--layers", "all", "--save-embeddings", N_EMB, *EXTRACT_OPTS)
    return store


@pytest.fixture
def store(study, tmp_path) -> Path:
    """A private copy of ``study`` (the test may change it)."""
    shutil.copytree(study, tmp_path / "s.zarr")
    return tmp_path / "s.zarr"


def files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, with its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def ls(store: Path) -> dict:
    return json.loads(run_cli("ls", store, "--json").output)


# ---------------------------------------------------------------- lazy

def test_open_is_lazy_and_the_flox_snippet_stays_out_of_core(store):
    tree = ncanalyze.store.open(store)
    for node in tree.subtree:
        for name, var in node.to_dataset(inherit=False).data_vars.items():
            assert isinstance(var.data, da.Array), (node.path, name)
            chunks = zarr.open_array(store, path=f"{node.path.strip('/')}/{name}", mode="r").chunks
            assert var.data.chunksize == tuple(min(c, s) for c, s in zip(chunks, var.shape)), (node.path, name)
    ds = tree[f"{OTHER}/layers/1"].to_dataset()
    assert ds.sizes["position"] == N_EMB
    E = zarr.open_array(store, path=f"{OTHER}/layers/1/embeddings", mode="r")
    L = zarr.open_array(store, path=f"{OTHER}/layers/1/label", mode="r")[:]
    # the data is read when computed, not when opened: change it on disk after opening, and the result follows
    original = E[:]
    zarr.open_array(store, path=f"{OTHER}/layers/1/embeddings", mode="r+")[:] = 2 * original
    means = ds.embeddings.groupby(ds.label.load()).mean()  # the README's snippet, as written
    assert isinstance(means.data, da.Array)  # a dask graph, nothing computed yet
    got = means.compute()
    labels = np.unique(L)
    np.testing.assert_array_equal(got["label"].values, labels)
    want = np.stack([2 * original[L == c].astype(np.float64).mean(0) for c in labels])  # brute force, numpy
    np.testing.assert_allclose(got.values, want, rtol=1e-5, atol=1e-6)


def test_measure_on_a_lazily_opened_group_gives_the_stored_numbers(store):
    run_cli("measure", store)
    g = "neo-2x32/checkpoint-40"
    ds = ncanalyze.store.open(store)[g].to_dataset()
    assert isinstance(ds["mean"].data, da.Array)
    got = measure(ds, se=False)
    stored = zarr.open_group(store, path=g, mode="r").attrs["metrics"]
    assert got == pytest.approx({k: stored[k] for k in (*SCALARS, *CLASS_COUNTS)}, rel=1e-12, nan_ok=True)
    assert got == measure(ds.load(), se=False)
    assert_metrics(got, brute_force(ds, 1)[0])


# ---------------------------------------------------------------- step order

def test_group_order_key():
    steps = {"r/checkpoint-100": 100, "r/checkpoint-20": 20, "r/final": 100, "r/checkpoint-x": None,
             "a/checkpoint-5": 5, "r/checkpoint-3": 3.0}
    groups = ["r/final", "r/checkpoint-x", "r/checkpoint-100", "r/checkpoint-20/layers/10", "r/checkpoint-20",
              "r/checkpoint-20/layers/9", "a/checkpoint-5", "r", "r/checkpoint-3"]
    assert sorted(groups, key=lambda g: group_order(g, steps)) == [
        "a/checkpoint-5", "r", "r/checkpoint-3", "r/checkpoint-20", "r/checkpoint-20/layers/9",
        "r/checkpoint-20/layers/10", "r/checkpoint-100", "r/final", "r/checkpoint-x"]


@pytest.mark.slow
def test_checkpoints_in_step_order_everywhere(study, tmp_path):
    """checkpoint-100 sorts before checkpoint-20 as a string; layers/10 before layers/9."""
    store = tmp_path / "order.zarr"
    shutil.copytree(study, store, ignore=shutil.ignore_patterns("neo-2x32@other"))
    run = store / "neo-2x32"
    for name, step in (("checkpoint-100", 100), ("checkpoint-9", 9)):  # real groups under names whose string order
        shutil.copytree(study / "neo-2x32" / "checkpoint-40", run / name)  # is not their step order
        zarr.open_group(run / name, mode="r+").attrs.update({"checkpoint": name, "global_step": step})
    zarr.open_group(run / "checkpoint-20" / "layers", mode="w")  # the layers group, as extraction writes it
    for l in (10, 9):
        shutil.copytree(study / OTHER / "layers" / "1", run / "checkpoint-20" / "layers" / str(l))
        zarr.open_group(run / "checkpoint-20" / "layers" / str(l), mode="r+").attrs.update(  # as if extracted here
            {"layer": l, "run": "neo-2x32", "checkpoint": "checkpoint-20", "tag": None})
    want = ["neo-2x32/checkpoint-9", "neo-2x32/checkpoint-20", "neo-2x32/checkpoint-20/layers/9",
            "neo-2x32/checkpoint-20/layers/10", "neo-2x32/checkpoint-40", "neo-2x32/checkpoint-60",
            "neo-2x32/checkpoint-100"]
    assert io.checkpoint_groups(store) == (want, {})
    tree = ncanalyze.store.open(store)
    assert list(tree["neo-2x32"].children) == ["checkpoint-9", "checkpoint-20", "checkpoint-40", "checkpoint-60",
                                               "checkpoint-100"]
    assert list(tree["neo-2x32/checkpoint-20/layers"].children) == ["9", "10"]
    assert measure_store(store).measured == want  # measured in that order
    assert [c["checkpoint"] for c in ls(store)["checkpoints"]] == ["checkpoint-9", "checkpoint-20", "checkpoint-40",
                                                                  "checkpoint-60", "checkpoint-100"]
    assert ls(store)["checkpoints"][1]["layers"] == [2, 9, 10]
    run_cli("report", store, "--out", tmp_path / "r", "--permutations", 0)
    table = pd.read_csv(tmp_path / "r" / "metrics.csv")
    last = table[table.layer == table.n_layers]
    assert list(last.global_step) == [9, 20, 40, 60, 100]


# ---------------------------------------------------------------- ls

@pytest.mark.slow
def test_ls_lists_runs_checkpoints_tags_layers_settings_measured_and_sizes(study, store):
    inv = ls(store)
    assert inv["runs"] == ["neo-2x32", "neo-2x32@other"] and inv["tags"] == ["other"]
    groups = [c["group"] for c in inv["checkpoints"]]
    assert groups == ["neo-2x32/checkpoint-20", "neo-2x32/checkpoint-40", "neo-2x32/checkpoint-60", OTHER]
    rows = {c["group"]: c for c in inv["checkpoints"]}
    assert [rows[g]["global_step"] for g in groups] == [20, 40, 60, 40]
    assert rows[OTHER]["tag"] == "other" and rows[groups[0]]["tag"] is None
    assert rows[OTHER]["layers"] == [0, 1, 2] and rows[groups[0]]["layers"] == [2]
    assert rows[OTHER]["dataset"].endswith("other/train.txt") and rows[groups[0]]["dataset"] != rows[OTHER]["dataset"]
    # the settings that differ: those of the tagged extraction; the weights differ by nature and are not listed
    configs = [json.loads(zarr.open_group(store, path=g, mode="r").attrs["config"]) for g in groups]
    differ = sorted(k for k in set().union(*configs) - {"weights", "dataset"}
                    if len({json.dumps(c.get(k)) for c in configs}) > 1)
    assert inv["settings"] == differ and {"layers", "save_embeddings", "data_sha256"} <= set(differ)
    assert rows[OTHER]["settings"]["save_embeddings"] == N_EMB and rows[groups[0]]["settings"]["layers"] == [2]
    assert all(rows[g]["measured"] == "no" and rows[g]["status"] == "ok" for g in groups)
    for g in groups:
        assert rows[g]["bytes"] == sum(f.stat().st_size for f in (store / g).rglob("*") if f.is_file()) > 0
    assert inv["bytes"] == disk_bytes(store) + disk_bytes(Path(f"{store}.tokens"))
    text = run_cli("ls", "--store", store).output
    for needle in ("checkpoint-60", "other", "0-2", "save_embeddings", "tags: other", "2 run(s), 4 checkpoint(s)"):
        assert needle in text, (needle, text)

    run_cli("measure", store, "--min-count", 2)
    assert {c["measured"] for c in ls(store)["checkpoints"]} == {"min_count=2"}
    zarr.open_group(store, path=groups[1], mode="r+").attrs["config_hash"] = "extracted-again"
    assert ls(store)["checkpoints"][1]["measured"] == "stale"


def test_ls_names_corrupt_and_interrupted_groups_without_a_traceback(store):
    (store / "neo-2x32/checkpoint-20/zarr.json").write_text("{not json")
    shutil.rmtree(store / OTHER / "layers/0/mean/c")  # a layer's data chunks gone
    zarr.open_group(store, path="neo-2x32/checkpoint-60", mode="r+").attrs["complete"] = False
    rows = {c["group"]: c for c in ls(store)["checkpoints"]}
    assert rows["neo-2x32/checkpoint-20"]["status"].startswith("corrupt: its metadata")
    assert rows[OTHER]["status"].startswith("corrupt: layers/0 lacks data chunks (mean (1 of 1 chunks))")
    assert rows["neo-2x32/checkpoint-60"]["status"].startswith("incomplete")
    assert rows["neo-2x32/checkpoint-40"]["status"] == "ok"
    text = run_cli("ls", store).output
    assert "corrupt" in text and "incomplete" in text and "3 not ok" in text
    (store / "neo-2x32@other/zarr.json").write_text("")  # a run's own metadata: its checkpoint is still listed
    assert {c["group"]: c for c in ls(store)["checkpoints"]}[OTHER]["status"].startswith("corrupt: its metadata")
    run_cli("rm", store, "neo-2x32/checkpoint-20", "neo-2x32/checkpoint-60", "neo-2x32@other", "--yes")
    assert [c["group"] for c in ls(store)["checkpoints"]] == ["neo-2x32/checkpoint-40"]  # what was bad can be removed
    r = run_cli("ls", store.parent / "nope.zarr", ok=False)
    assert "no ncanalyze store" in r.output and len(r.output.strip().splitlines()) == 1


# ---------------------------------------------------------------- rm

def test_rm_refuses_unknown_names_and_unconfirmed_removals_in_one_line(store):
    before = files(store)
    for args, words in [(["neo-2x32/checkpoint-2"], ["did you mean", "neo-2x32/checkpoint-20"]),
                        (["neo-2x23"], ["did you mean neo-2x32"]),
                        (["--tag", "others"], ["tag 'others'", "tags here: other"]),
                        ([f"{OTHER}/layers/1"], ["remove the whole checkpoint"]),
                        (["neo-2x32/checkpoint-20"], ["without confirmation", "--yes"]),  # stdin is not a terminal
                        ([], ["name what to remove"])]:
        r = run_cli("rm", store, *args, ok=False)
        assert len(r.output.strip().splitlines()) == 1 and all(w in r.output for w in words), (args, r.output)
    r = run_cli("rm", "--store", store, "neo-2x32", "--tag", "other", "--dry-run")
    assert "would remove 4 checkpoint group(s)" in r.output and OTHER in r.output
    assert files(store) == before


@pytest.mark.slow
def test_rm_a_checkpoint_leaves_the_rest_bit_identical_and_measure_report_work(store, tmp_path):
    before = files(store)
    g = "neo-2x32/checkpoint-40"
    run_cli("rm", store, g, "--yes")
    assert files(store) == {k: v for k, v in before.items() if not k.startswith(f"{g}/")}
    assert not Path(f"{store}.partial").exists()
    assert [c["group"] for c in ls(store)["checkpoints"]] == ["neo-2x32/checkpoint-20", "neo-2x32/checkpoint-60", OTHER]
    r = run_cli("measure", store)
    # the two checkpoints left and the tagged one, whose two other layers make 5 groups: each checkpoint counted once
    assert "measured 3 of 3 checkpoints (5 of 5 layer groups" in r.output, r.output
    header = next(line for line in r.output.splitlines() if "checkpoint" in line and "global_step" in line).split()
    assert header[:4] == ["run", "checkpoint", "layer", "global_step"], r.output
    rows = sorted((row[1], row[2]) for row in map(str.split, r.output.splitlines()) if row and row[0].startswith("neo-2x32"))
    assert rows == [("checkpoint-20", "2"), ("checkpoint-40", "0"), ("checkpoint-40", "1"), ("checkpoint-40", "2"),
                    ("checkpoint-60", "2")], r.output
    run_cli("report", store, "--out", tmp_path / "r", "--permutations", 0, "--where", "run == 'neo-2x32'")
    table = pd.read_csv(tmp_path / "r" / "metrics.csv")
    assert list(table.checkpoint) == ["checkpoint-20", "checkpoint-60"]


def test_rm_a_tag_or_a_run(store, tmp_path):
    before = files(store)
    run_cli("rm", store, "--tag", "other", "--yes")
    assert files(store) == {k: v for k, v in before.items() if not k.startswith("neo-2x32@other/")}
    assert not (store / "neo-2x32@other").exists()
    assert ls(store)["tags"] == []
    run_cli("rm", "--store", store, "neo-2x32", "-y")
    assert files(store) == {"zarr.json": before["zarr.json"]}
    assert ls(store)["checkpoints"] == []


@pytest.mark.slow
def test_rm_removes_a_resume_state_and_finishes_an_interrupted_removal(store, trained_run, corpus):
    ck = "neo-2x32/checkpoint-40"
    # an extraction killed midway (a new tag, so it does not find the checkpoint done): its resume state
    args = ["extract", trained_run / "checkpoint-40", "--dataset", corpus["train"], "--store", store, "--tag", "killed",
            "--max-train-tokens", 4096, "--batch-size", 1, "--state-every", 0]
    state = files_of(store, "neo-2x32@killed/checkpoint-40").state
    kill_when(args, state, batches=3)
    assert state.is_file()
    rows = {c["group"]: c for c in ls(store)["checkpoints"]}
    assert rows["neo-2x32@killed/checkpoint-40"]["status"].startswith("interrupted")
    run_cli("rm", store, "neo-2x32@killed/checkpoint-40", "--yes")
    assert not state.exists() and "neo-2x32@killed/checkpoint-40" not in {c["group"] for c in ls(store)["checkpoints"]}

    # a write cut short between its two renames leaves the old group beside the store: ls names it, the next
    # extraction puts it back whole, and rm removes it
    before = files(store / ck)
    old = files_of(store, ck).old
    old.parent.mkdir(parents=True)
    os.rename(store / ck, old)
    assert {c["group"]: c for c in ls(store)["checkpoints"]}[ck]["status"].startswith("interrupted")
    r = run_cli("extract", trained_run / "checkpoint-40", "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS)
    assert "already in" in r.output and files(store / ck) == before
    run_cli("rm", store, ck, "--yes")
    assert not (store / ck).exists() and not Path(f"{store}.partial").exists()

    # a removal killed midway (while deleting) leaves a folder beside the store that nothing restores
    ck = "neo-2x32/checkpoint-60"
    trash = files_of(store, ck).removing
    trash.parent.mkdir(parents=True)
    os.rename(store / ck, trash)
    shutil.rmtree(trash / "mean")
    status = {c["group"]: c for c in ls(store)["checkpoints"]}[ck]["status"]
    assert status == "interrupted removal (rm it again to finish)"
    run_cli("rm", store, ck, "--yes")
    assert not trash.exists() and not Path(f"{store}.partial").exists()
    assert [c["group"] for c in ls(store)["checkpoints"]] == ["neo-2x32/checkpoint-20", OTHER]


@pytest.mark.slow
def test_rm_waits_for_the_extraction_lock(store):
    g = "neo-2x32/checkpoint-20"
    with lock_held(store, g, seconds=60):
        proc = cli_process(["rm", store, g, "--yes"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        lines = []
        while not any("being extracted by another process" in line for line in lines):
            lines.append(proc.stdout.readline().decode())
            assert lines[-1], "".join(lines)  # it ended without waiting
        assert proc.poll() is None and (store / g / "zarr.json").is_file()  # waiting, nothing removed
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0 and "removed 1 checkpoint group(s)" in out, out
    assert not (store / g).exists()


@pytest.mark.slow
@pytest.mark.parametrize("answer", ["n", "y"])
def test_rm_asks_on_a_terminal(store, answer):
    g = "neo-2x32/checkpoint-60"
    master, slave = pty.openpty()
    proc = cli_process(["rm", store, g], stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    os.close(slave)
    os.write(master, f"{answer}\n".encode())
    out = proc.communicate(timeout=60)[0].decode()
    os.close(master)
    assert "remove 1 checkpoint group(s)" in out and "[y/N]" in out, out
    assert (store / g).exists() == (answer == "n") and proc.returncode == (0 if answer == "y" else 1)
