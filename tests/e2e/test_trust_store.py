"""A store that is damaged, shared or mounted oddly (issue 30): each damaged group is named with its fix and the others
go on; a group removed while ``measure`` runs is skipped in one line; a store on its own mount point is staged on its
own file system; a read-only store is refused cleanly. Real stores from the conftest's Trainer run, real processes,
real mounts."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import zarr
from conftest import cli_process, lock_held, run_cli


def ls(store: Path) -> dict[str, str]:
    """``ncanalyze ls --json``: group -> status."""
    return {c["group"]: c["status"] for c in json.loads(run_cli("ls", store, "--json").output)["checkpoints"]}


@pytest.fixture
def store(extracted_store, tmp_path) -> Path:
    """A private copy of ``extracted_store`` with two more checkpoints (copies of checkpoint-60 at steps 80 and 100),
    so that four can be damaged and one stays whole."""
    s = tmp_path / "s.zarr"
    shutil.copytree(extracted_store, s)
    run = next(d.name for d in s.iterdir() if d.is_dir())
    for step in (80, 100):
        shutil.copytree(s / run / "checkpoint-60", s / run / f"checkpoint-{step}")
        zarr.open_group(s, path=f"{run}/checkpoint-{step}", mode="r+").attrs.update(
            {"checkpoint": f"checkpoint-{step}", "global_step": step})
    return s


def run_of(store: Path) -> str:
    return next(d.name for d in store.iterdir() if d.is_dir())


# ---------------------------------------------------------------- 9, 11: one damaged group never stops the others

@pytest.mark.slow
def test_each_damaged_group_is_named_with_its_fix_and_the_others_go_on(store, tmp_path):
    run = run_of(store)
    g = {s: f"{run}/checkpoint-{s}" for s in (20, 40, 60, 80, 100)}
    text = (store / g[20] / "count" / "zarr.json").read_text()
    (store / g[20] / "count" / "zarr.json").write_text(text[: len(text) // 2])  # a truncated array zarr.json
    shutil.rmtree(store / g[40] / "count")                                      # a missing count array
    (store / g[60] / "zarr.json").write_text("null")                            # a group zarr.json not an object
    meta = json.loads((store / g[80] / "zarr.json").read_text())
    meta["attributes"]["global_step"] = "eighty"                                # a non-number global_step
    (store / g[80] / "zarr.json").write_text(json.dumps(meta))
    status = ls(store)
    assert status[g[20]].startswith("corrupt: it has corrupt array metadata (count/zarr.json: not JSON"), status
    assert status[g[40]].startswith("corrupt: it lacks the array (count)"), status
    assert status[g[60]].startswith("corrupt: its metadata") and "not an object" in status[g[60]], status
    assert status[g[80]].startswith("corrupt: its attribute global_step is \"eighty\", not a number"), status
    assert all("--overwrite" in status[g[s]] and "ncanalyze rm" in status[g[s]] for s in (20, 40, 60, 80)), status
    assert status[g[100]] == "ok"
    (store / g[20].replace("checkpoint-20", "checkpoint-30")).mkdir()  # ls's table too, without a traceback
    (store / g[20].replace("checkpoint-20", "checkpoint-30") / "zarr.json").write_text("[]")
    assert "5 not ok" in run_cli("ls", store).output

    r = run_cli("measure", store)
    for s, why in [(20, "corrupt array metadata"), (40, "lacks the array (count)"), (60, "not an object"),
                   (80, "global_step")]:
        line = next((line for line in r.output.splitlines() if f"{g[s]}: skipped" in line), "")
        assert why in line and "--overwrite" in line, (s, r.output)
    assert "measured 1 of 6 checkpoints" in r.output and "5 left out" in r.output, r.output
    out = tmp_path / "report"
    run_cli("report", store, "--out", out, "--permutations", 0)
    assert list(pd.read_csv(out / "metrics.csv").checkpoint) == ["checkpoint-100"]
    md = (out / "report.md").read_text()
    assert all(g[s] in md for s in (20, 40, 60, 80))


@pytest.mark.slow
def test_fold_sums_that_do_not_add_up_name_the_group_and_its_fix(store):
    """Issue 49: a forged fold_mean and a doubled fold_count changed `_se` silently. The real store's folds add up
    (counts exactly, the count-weighted means to float64 rounding: a brute force over the arrays here); a group
    whose folds do not is left out, named with its fix, nothing stored for it; the others are measured."""
    import numpy as np

    run = run_of(store)
    g = {s: f"{run}/checkpoint-{s}" for s in (20, 40, 60, 80, 100)}
    z = zarr.open_group(store, path=g[20], mode="r+")
    n, m, fn, fm = (np.asarray(z[v][...], np.float64) for v in ("count", "mean", "fold_count", "fold_mean"))
    assert fn.shape[0] > 1 and np.array_equal(fn.sum(0), n)
    weighted = n[:, None] * m
    np.testing.assert_allclose((fn[..., None] * fm).sum(0), weighted, rtol=0, atol=1e-12 * np.abs(weighted).max())
    c = int(np.argmax(fn[0]))  # the most frequent class of fold 0
    z["fold_mean"][0, c] = fm[0, c] + 1.0  # forged
    z40 = zarr.open_group(store, path=g[40], mode="r+")
    z40["fold_count"][1] = 2 * np.asarray(z40["fold_count"][1])  # a block counted twice

    r = run_cli("measure", store)
    for s, why in [(20, "the folds merged differ from mean"), (40, "fold_count sums to")]:
        line = next((line for line in r.output.splitlines() if f"{g[s]}: skipped" in line), "")
        assert "fold sums do not add up to its totals" in line and why in line and "--overwrite" in line, r.output
        assert "metrics" not in zarr.open_group(store, path=g[s], mode="r").attrs  # no `_se` stored as if fine
    assert "measured 3 of 5 checkpoints" in r.output, r.output
    for s in (60, 80, 100):
        se = zarr.open_group(store, path=g[s], mode="r").attrs["metrics"]["nc1_cdnv_se"]
        assert np.isfinite(se) and se > 0


@pytest.mark.slow
def test_a_deleted_head_is_named_by_ls_and_measure(store):
    run = run_of(store)
    g = f"{run}/checkpoint-40"
    shutil.rmtree(store / g / "classifier")
    status = ls(store)
    assert status[g].startswith("corrupt: it lacks the array (classifier)"), status
    r = run_cli("measure", store)
    assert f"{g}: skipped: lacks the array (classifier)" in r.output and "--overwrite" in r.output, r.output
    assert "metrics" not in zarr.open_group(store, path=g, mode="r").attrs  # never stored without nc3_*/head_erank
    assert "measured 4 of 5 checkpoints" in r.output


# ---------------------------------------------------------------- 7: rm while measure runs

@pytest.mark.slow
def test_a_group_removed_while_measure_runs_is_skipped_in_one_line(store):
    """``measure`` lists the groups, then waits to store checkpoint-20's metrics (the test holds its lock); meanwhile
    a real ``ncanalyze rm`` removes checkpoint-40; released, measure stores checkpoint-20's, says checkpoint-40 was
    removed in one line, and measures every later checkpoint."""
    run = run_of(store)
    first, gone = f"{run}/checkpoint-20", f"{run}/checkpoint-40"
    with lock_held(store, first):
        proc = cli_process(["measure", store], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        lines: list[str] = []
        while not any("being extracted by another process" in line for line in lines):  # the test's lock says so
            lines.append(proc.stdout.readline().decode())
            assert lines[-1], "".join(lines)  # it ended without waiting
        rm = run_cli("rm", store, gone, "--yes")
        assert "removed 1 checkpoint group(s)" in rm.output and not (store / gone).exists()
    out = "".join(lines) + proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0 and "Traceback" not in out and "GroupNotFound" not in out, out
    said = [line for line in out.splitlines() if gone in line]
    assert len(said) == 1 and "removed while being measured" in said[0], out
    assert "measured 4 of 5 checkpoints" in out, out
    for s in (20, 60, 80, 100):
        assert "metrics" in zarr.open_group(store, path=f"{run}/checkpoint-{s}", mode="r").attrs, s
    assert not (store / gone).exists()  # nothing of it recreated by the write of its metrics
    assert not Path(f"{store}.partial").exists()


@pytest.mark.slow
def test_rm_waits_for_a_measure_storing_metrics_and_says_so(store):
    """The lock ``measure`` takes to store a group's metrics is the one rm takes: rm waits, saying what it waits for."""
    run = run_of(store)
    g = f"{run}/checkpoint-20"
    with lock_held(store, g, doing="measured", seconds=60):
        proc = cli_process(["rm", store, g, "--yes"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        lines: list[str] = []
        while not any("by another process" in line for line in lines):
            lines.append(proc.stdout.readline().decode())
            assert lines[-1], "".join(lines)  # it ended without waiting
        assert "is being measured by another process" in lines[-1] and proc.poll() is None, lines
    assert proc.wait(60) == 0 and not (store / g).exists()


# ---------------------------------------------------------------- 10: a store on its own mount point; read-only

@pytest.mark.slow
def test_a_store_that_is_its_own_mount_point_is_written_and_removed_in_place(trained_run, corpus, tmp_path):
    """A real tmpfs mounted at the store's own path: its ``.partial`` folder beside it is on the parent's disk, so the
    groups are staged, moved aside and removed inside it (on its file system); an overwrite and an rm work; read-only
    (remounted), rm is one line naming the fix and removes nothing."""
    import warnings

    import ncanalyze.store
    from conftest import tmpfs

    group = f"{trained_run.name}/checkpoint-20"
    args = ("extract", trained_run / "checkpoint-20", "--dataset", corpus["train"], "--max-train-tokens", 1024,
            "--max-val-tokens", 512, "--samples-per-class", 1)
    with tmpfs(tmp_path / "s.zarr", "size=64m") as store:
        run_cli(*args, "--store", store)
        run_cli(*args, "--store", store, "--overwrite")  # the old group moved aside and back out, in the store
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert list(ncanalyze.store.open(store)[trained_run.name].children) == ["checkpoint-20"]
        assert not (store / ".ncanalyze.partial").exists() and ls(store) == {group: "ok"}
        run_cli("rm", store, group, "--yes")
        assert ls(store) == {} and not (store / ".ncanalyze.partial").exists()
        run_cli(*args, "--store", store)
        before = sorted(p.relative_to(store) for p in store.rglob("*"))
        subprocess.run(["mount", "-o", "remount,ro", str(store)], check=True)
        r = run_cli("rm", store, group, "--yes", ok=False)
        error = [line for line in r.output.splitlines() if "Error:" in line]
        assert len(error) == 1 and "not writable" in error[0] and "nothing was removed" in error[0], r.output
        assert sorted(p.relative_to(store) for p in store.rglob("*")) == before
        r = run_cli("measure", store)  # measured without storing, said once
        assert r.output.count("is not writable") == 1 and "measured 1 of 1" in r.output, r.output
        subprocess.run(["mount", "-o", "remount,rw", str(store)], check=True)
