"""Trust at study scale (issue 10): broken resume states, changed data, two writers, an --overwrite that meets a full
disk, Ctrl-C, and corrupt or degenerate checkpoints among healthy ones. Real checkpoints, real files, real
processes; each bad case is one line and loses nothing."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import ncanalyze.store
import numpy as np
import pandas as pd
import pytest
import zarr
from conftest import assert_same_group, cli_process, cli_run, kill_when, lone_model, run_cli, tmpfs
from ncanalyze.store.extraction.resume import DIGEST, save_state

SMALL = ("--max-train-tokens", 1024, "--max-val-tokens", 512, "--samples-per-class", 2)


def one_line_error(r) -> str:
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    return errors[0]


@pytest.fixture(scope="module")
def model(trained_run, tmp_path_factory) -> Path:
    return lone_model(trained_run, tmp_path_factory.mktemp("m") / "checkpoint-60")


@pytest.fixture(scope="module")
def reference(model, corpus, tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("ref") / "ref.zarr"
    run_cli("extract", model, "--dataset", corpus["train"], "--store", store, *SMALL, "--batch-size", 2)
    return store


def group(model: Path) -> str:
    return f"{model.parent.name}/{model.name}"


def state_of(store: Path, model: Path) -> Path:
    return store.with_name(store.name + ".partial") / model.parent.name / f"{model.name}.npz"


def killed_state(model, corpus, store) -> Path:
    """A real resume state: extraction killed (SIGKILL) in its train pass after a few batches."""
    kill_when(extract_args(model, corpus, store, "--state-every", 0), state_of(store, model), batches=4)
    return state_of(store, model)


def extract_args(model, corpus, store, *extra):
    return ("extract", model, "--dataset", corpus["train"], "--store", store, *SMALL, "--batch-size", 2, *extra)


# ---------------------------------------------------------------- resume states

@pytest.fixture(scope="module")
def saved_state(model, corpus, tmp_path_factory) -> bytes:
    """The bytes of a real resume state: extraction killed (SIGKILL) in its train pass after a few batches."""
    return killed_state(model, corpus, tmp_path_factory.mktemp("killed") / "s.zarr").read_bytes()


def put_state(store: Path, model: Path, data: bytes) -> Path:
    state = state_of(store, model)
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_bytes(data)
    return state


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "bit-flipped"])
def test_a_corrupt_resume_state_is_one_line_and_restart_discards_it(damage, model, corpus, reference, saved_state,
                                                                     tmp_path):
    data = saved_state
    damaged = {"truncated": data[: len(data) // 2], "garbage": os.urandom(len(data)), "empty": b"",
               "bit-flipped": data[:200] + bytes([data[200] ^ 0x10]) + data[201:]}[damage]
    store = tmp_path / "s.zarr"
    state = put_state(store, model, damaged)
    line = one_line_error(run_cli(*extract_args(model, corpus, store), ok=False))
    assert str(state) in line and "--restart" in line
    flag = "--restart" if damage in ("truncated", "empty") else "--overwrite"  # each discards it
    run_cli(*extract_args(model, corpus, store, flag))
    assert_same_group(reference, store, group(model))


@pytest.mark.slow
@pytest.mark.parametrize("edit", ["phase 7", "negative batches", "huge batches", "counts do not add up",
                                  "wrong shape"])
def test_an_inconsistent_resume_state_is_refused(edit, model, corpus, saved_state, tmp_path):
    store = tmp_path / "s.zarr"
    state = put_state(store, model, saved_state)
    with np.load(state) as f:
        arrays = {k: f[k] for k in f.files if k != DIGEST}
    if edit == "phase 7":
        arrays["phase"] = np.array(7)
    elif edit == "negative batches":
        arrays["batches"] = np.array(-3)
    elif edit == "huge batches":
        arrays["batches"] = np.array(10**9)
    elif edit == "counts do not add up":
        arrays["layer2.stats.count"] = arrays["layer2.stats.count"] * 2  # the 2-block model's last layer
    else:
        arrays["layer2.stats.mean"] = arrays["layer2.stats.mean"][:, :-1]
    save_state(state, arrays)  # with a valid digest: the consistency checks behind it are what is tested here
    line = one_line_error(run_cli(*extract_args(model, corpus, store), ok=False))
    assert str(state) in line and "--restart" in line
    assert not (store / model.parent.name / model.name).exists()


@pytest.mark.slow
def test_a_resume_on_changed_data_is_refused(model, corpus, reference, tmp_path):
    train = tmp_path / "train.txt"
    shutil.copy(corpus["train"], train)
    store = tmp_path / "s.zarr"
    args = ("extract", model, "--dataset", train, "--val-dataset", corpus["val"], "--store", store, *SMALL,
            "--batch-size", 2)
    kill_when((*args, "--state-every", 0), state_of(store, model), batches=4)
    lines = train.read_text().splitlines(keepends=True)
    train.write_text("".join(lines[:3] + ["the big dog sees the red fox .\n"] + lines[4:]))  # one line changed
    line = one_line_error(run_cli(*args, "--state-every", 0, ok=False))
    assert "the content of the data changed: train.txt" in line and "interrupted extraction" in line
    train.write_text("".join(lines))  # restored: the resume goes on, and equals an uninterrupted run
    assert "1 resumed" in run_cli(*args, "--state-every", 0).output
    ref = tmp_path / "ref.zarr"
    run_cli(*args[:7], ref, *args[8:])
    assert_same_group(ref, store, group(model))


# ---------------------------------------------------------------- two writers, swaps, Ctrl-C

@pytest.mark.slow
def test_two_writers_on_one_checkpoint_end_with_one_writers_store(model, corpus, reference, tmp_path):
    store = tmp_path / "s.zarr"
    cmd = extract_args(model, corpus, store, "--state-every", 0)
    procs = [cli_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(o.count("1 extracted") for o in outs) == [0, 1]  # one did the work, the other found it done
    assert any("1 already in" in o for o in outs)
    assert_same_group(reference, store, group(model))
    assert not store.with_name(store.name + ".partial").exists()


def test_overwrite_on_a_full_disk_keeps_the_old_group(model, corpus, tmp_path):
    with tmpfs(tmp_path / "disk", "size=3m") as disk:
        store = disk / "s.zarr"
        run_cli(*extract_args(model, corpus, store))
        before = ncanalyze.store.open(store)[group(model)].to_dataset().load()
        free = os.statvfs(disk)
        (disk / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 300_000))
        r = run_cli(*extract_args(model, corpus, store, "--overwrite", "--seed", 1), ok=False)
        assert "disk full" in r.output
        after = ncanalyze.store.open(store)[group(model)].to_dataset().load()
        assert after.identical(before) and after.attrs["complete"] is True


@pytest.mark.slow
def test_ctrl_c_saves_the_state_and_the_resume_is_bit_identical(model, corpus, reference, tmp_path):
    store = tmp_path / "s.zarr"
    cmd = extract_args(model, corpus, store, "--state-every", 1000)
    proc = cli_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    partial = store.with_name(store.name + ".partial") / model.parent.name
    while proc.poll() is None and not (partial / f"{model.name}.lock").exists():
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)  # taken at the first batch boundary after it
    out = proc.communicate(timeout=120)[0]
    if proc.returncode == 0:
        pytest.skip("the extraction finished before the interrupt arrived")
    assert proc.returncode == 130 and "interrupted: state saved" in out and "Traceback" not in out, out
    assert (partial / f"{model.name}.npz").is_file()  # saved at once, although --state-every is 1000 s
    assert "1 resumed" in run_cli(*extract_args(model, corpus, store, "--state-every", 1000)).output
    assert_same_group(reference, store, group(model))


# ---------------------------------------------------------------- one bad checkpoint never stops the study

@pytest.mark.slow
def test_report_goes_on_past_a_corrupt_and_a_degenerate_checkpoint(extracted_store, trained_run, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(extracted_store, store)
    run = trained_run.name
    chunk = next((store / run / "checkpoint-40" / "mean" / "c").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    chunk.write_bytes(os.urandom(chunk.stat().st_size))                     # garbage in a data chunk
    g = zarr.open_group(store, path=f"{run}/checkpoint-20", mode="r+", zarr_format=3)
    count = g["count"][:]
    g["count"][:] = np.where(np.arange(count.size) == np.argmax(count), count, 0)  # one class left: degenerate
    for name in [n for n in g.array_keys() if n.startswith("fold_")]:  # its fold sums would no longer add up to
        del g[name]  # the count (a forged group, refused as such: test_trust_store.py); without folds: no errors
    out = tmp_path / "report"
    r = run_cli("report", "--store", store, "--out", out, "--permutations", 0)
    assert f"{run}/checkpoint-40: skipped" in r.output and "corrupt data" in r.output and "--overwrite" in r.output
    assert f"{run}/checkpoint-20: skipped" in r.output and "only 1 class" in r.output
    table = pd.read_csv(out / "metrics.csv")
    healthy = sorted(set(ncanalyze.store.open(extracted_store)[run].children) - {"checkpoint-20", "checkpoint-40"})
    assert healthy and sorted(table.checkpoint) == healthy
    md = (out / "report.md").read_text()
    assert f"{run}/checkpoint-40" in md and f"{run}/checkpoint-20" in md and "Skipped" in md


@pytest.mark.slow
def test_a_missing_chunk_says_a_fix_that_works(trained_run, corpus, tmp_path):
    store = tmp_path / "s.zarr"
    ck = trained_run / "checkpoint-20"
    args = ("extract", ck, "--dataset", corpus["train"], "--store", store, *SMALL)
    run_cli(*args)
    for f in (store / trained_run.name / "checkpoint-20" / "count" / "c").rglob("*"):
        if f.is_file():
            f.unlink()
    r = run_cli("measure", "--store", store, ok=False)
    assert "count" in r.output and "lacks data chunks" in r.output and "--overwrite" in r.output
    assert "only 0" not in r.output
    run_cli(*args, "--overwrite")  # the fix the message gives
    assert "measured 1 of 1" in run_cli("measure", "--store", store).output


def test_metrics_that_are_not_finite_are_strict_json(tmp_path):
    from ncanalyze.analyzer import class_stats
    from ncanalyze.store import io
    from ncanalyze.store.layout import CheckpointFiles
    from ncanalyze.store.measure import measure_store

    rng = np.random.default_rng(0)
    h, y = rng.standard_normal((32, 3)), np.r_[np.repeat(np.arange(4), 7), 4, 4, 5, 5]
    h[30:] = h[28:30]  # two classes of two tokens at one mean, each with a variance: CDNV inf, GNC2 std nan
    ds = class_stats(h, y, 6)
    ds.attrs |= {"run": "r", "checkpoint": "checkpoint-1", "global_step": 1, "config_hash": "x"}
    io.write_checkpoint(tmp_path / "s.zarr", "r/checkpoint-1", ds, CheckpointFiles(tmp_path / "staging.npz"))
    with pytest.warns(UserWarning, match="coincident means"):
        df = measure_store(tmp_path / "s.zarr").table
    assert df.nc1_cdnv[0] == math.inf and math.isnan(df.gnc2_log_std[0]) and df.gnc2_log_mean[0] == math.inf
    meta = (tmp_path / "s.zarr" / "r" / "checkpoint-1" / "zarr.json").read_text()
    json.loads(meta, parse_constant=lambda c: pytest.fail(f"zarr.json holds {c}"))
    again = measure_store(tmp_path / "s.zarr").table  # read back from the store: the same values
    assert again.nc1_cdnv[0] == math.inf and math.isnan(again.gnc2_log_std[0])


# ---------------------------------------------------------------- one line where a traceback was

def test_bad_stores_and_options_are_one_line_and_change_nothing(model, corpus, extracted_store, tmp_path):
    base = ("extract", model, "--dataset", corpus["train"], *SMALL)
    measured = tmp_path / "measured.zarr"  # report measures before it writes: never the shared fixture's store
    shutil.copytree(extracted_store, measured)
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    (tmp_path / "p.zarr.partial").write_text("x")
    cases = {
        "parent is a file": ((*base, "--store", afile / "s.zarr"), "cannot write the store"),
        "store is a file": ((*base, "--store", afile), "is a file"),
        "a folder of other files": ((*base, "--store", tmp_path / "busy"), "not an ncanalyze store"),
        ".partial is a file": ((*base, "--store", tmp_path / "p.zarr"), "resume states"),
        "absurd samples per class": ((*base[:-2], "--samples-per-class", 10**9, "--store", tmp_path / "a.zarr"),
                                     "must be between 0 and 65536"),
        "seed out of range": ((*base, "--seed", -1, "--store", tmp_path / "b.zarr"), "--seed"),
        "unknown device": ((*base, "--device", "tpu", "--store", tmp_path / "c.zarr"), "--device"),
        "min-count above the cap": ((*base, "--min-count", 5000, "--store", tmp_path / "d.zarr"), "--min-count"),
        "scheduler not an address": (("measure", "--store", measured, "--scheduler", "not an address"),
                                     "scheduler"),
        "report --out under a file": (("report", "--store", measured, "--out", afile / "r",
                                       "--permutations", 0), "--out"),
    }
    for name, (args, words) in cases.items():
        r = run_cli(*args, ok=False)
        assert words in r.output and len(r.output.strip().splitlines()) == 1, (name, r.output)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine" and afile.read_text() == "x"


@pytest.mark.slow
def test_corrupt_metadata_is_one_line(model, corpus, tmp_path):
    store = tmp_path / "s.zarr"
    run_cli(*extract_args(model, corpus, store))
    meta = store / model.parent.name / model.name / "zarr.json"
    meta.write_text("{ not json")
    line = one_line_error(run_cli(*extract_args(model, corpus, store), ok=False))
    assert str(meta) in line and "--overwrite" in line
    run_cli(*extract_args(model, corpus, store, "--overwrite"))
    (store / "zarr.json").write_text("garbage")
    line = one_line_error(run_cli(*extract_args(model, corpus, store), ok=False))
    assert "zarr.json" in line and "corrupt" in line


def test_a_read_only_store_is_refused_before_any_work(model, corpus, tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as disk:
        start = time.monotonic()
        line = one_line_error(run_cli(*extract_args(model, corpus, disk / "new.zarr"), ok=False))
        assert "read-only" in line and time.monotonic() - start < 30


@pytest.mark.slow
def test_a_broken_checkpoint_is_one_line_without_the_load_report(trained_run, corpus, tmp_path):
    """transformers prints a table of missing tensors; only our one line may reach the user (a real process, since
    transformers' log handler holds the stderr it was imported with)."""
    from safetensors.torch import load_file, save_file

    ck = lone_model(trained_run, tmp_path / "checkpoint-60")
    tensors = load_file(ck / "model.safetensors")
    tensors.pop(next(iter(tensors)))
    save_file(tensors, ck / "model.safetensors", metadata={"format": "pt"})
    r = cli_run(["extract", ck, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", "--max-train-tokens", 256])
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "lacks 1 tensors" in lines[0], lines
