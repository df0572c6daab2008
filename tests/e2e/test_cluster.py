"""Extraction on a Dask cluster (a real ``distributed.LocalCluster`` of two worker processes, CPU): checkpoints as
tasks equal the local run bit for bit, shards merge exactly (Chan), a worker killed mid-checkpoint changes nothing,
a bad checkpoint fails alone, and racing writers never break the store."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import time

import ncanalyze.store
import numpy as np
import pytest
import xarray as xr
from conftest import EXACT, EXTRACT_OPTS, cli_process, forked_workers, run_cli


def groups(store) -> dict[str, xr.Dataset]:
    tree = ncanalyze.store.open(store)
    return {n.path.strip("/"): n.to_dataset() for n in tree.subtree if "mean" in n.data_vars}


def assert_same_store(a, b, only=None) -> None:
    """Every array of every group (of ``only``), bit for bit, and the attributes."""
    ga, gb = groups(a), groups(b)
    names = only or sorted(ga)
    assert set(names) <= set(gb), (names, sorted(gb))
    for g in names:
        assert set(ga[g].variables) == set(gb[g].variables), g
        for v in ga[g].variables:  # the classifier, stored once per checkpoint, is a coordinate
            np.testing.assert_array_equal(ga[g][v].values, gb[g][v].values, err_msg=f"{g} {v}")
        assert ga[g].attrs == gb[g].attrs, g


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, LocalCluster

    with forked_workers(), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as lc, \
            Client(lc) as client:
        client.run(lambda: __import__("ncanalyze.store.runs.local"))  # warm the workers' imports once
        yield lc.scheduler_address, client


# --- racing writers ----------------------------------------------------------------------------------------------

def _writer(store: str, me: int, barrier, runs: int) -> None:
    from ncanalyze.store import io
    from ncanalyze.store.layout import CheckpointFiles

    ds = xr.Dataset({"mean": (("vocab", "hidden"), np.full((3, 2), float(me)))}, attrs={"writer": me})
    barrier.wait()
    for r in range(runs):  # every writer creates every run group at the same moment as the others
        files = CheckpointFiles(io.Path(store + f".partial/stage-{me}-{r}.npz"))
        io.write_checkpoint(store, f"run-{r}/ck-{me}", ds.copy(), files)


@pytest.mark.slow
def test_concurrent_writers_keep_the_root_and_every_group(tmp_path):
    from ncanalyze.store import io
    n, runs = 6, 6
    for trial in range(2):
        store = tmp_path / f"s{trial}.zarr"
        (tmp_path / f"s{trial}.zarr.partial").mkdir()
        ctx = multiprocessing.get_context("fork")
        barrier = ctx.Barrier(n)
        procs = [ctx.Process(target=_writer, args=(str(store), i, barrier, runs)) for i in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * n
        tree = ncanalyze.store.open(store)
        for r in range(runs):
            assert sorted(tree[f"run-{r}"].children) == [f"ck-{i}" for i in range(n)]
            for i in range(n):
                assert tree[f"run-{r}/ck-{i}"].attrs["writer"] == i and tree[f"run-{r}/ck-{i}"].attrs["complete"]
        assert io.group_attrs(store, "") == {io.FORMAT_KEY: io.FORMAT}  # the root: its format, nothing else


# --- on the cluster ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_checkpoints_as_tasks_equal_the_local_run(cluster, trained_run, corpus, extracted_store, tmp_path):
    address, _ = cluster
    store = tmp_path / "cluster.zarr"
    r = run_cli("extract", trained_run, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS,
                "--scheduler", address)
    n = len(groups(extracted_store))
    assert n >= 3 and f"{n} extracted, 0 resumed, 0 already in" in r.output, r.output
    assert_same_store(extracted_store, store)
    # a re-run is a no-op
    r = run_cli("extract", trained_run, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS,
                "--scheduler", address)
    assert f"0 extracted, 0 resumed, {n} already in" in r.output, r.output


@pytest.mark.slow
def test_shards_merge_exactly(cluster, trained_run, corpus, extracted_store, tmp_path):
    address, _ = cluster
    ck, g = trained_run / "checkpoint-40", f"{trained_run.name}/checkpoint-40"
    sharded = tmp_path / "sharded.zarr"
    run_cli("extract", ck, "--dataset", corpus["train"], "--store", sharded, *EXTRACT_OPTS, "--shards", 3,
            "--scheduler", address)
    ref, got = groups(extracted_store)[g], groups(sharded)[g]
    for v in ref.data_vars:
        if v in EXACT:
            np.testing.assert_array_equal(got[v].values, ref[v].values, err_msg=v)
        else:
            np.testing.assert_allclose(got[v].values, ref[v].values, rtol=1e-12, atol=1e-12 * float(
                np.nanmax(np.abs(ref[v].values))), err_msg=v)
    assert {k: v for k, v in got.attrs.items()} == {k: v for k, v in ref.attrs.items()}
    # without a scheduler the same shards run in turn and merge in the same tree: the same bits as on the cluster
    local = tmp_path / "local-sharded.zarr"
    run_cli("extract", ck, "--dataset", corpus["train"], "--store", local, *EXTRACT_OPTS, "--shards", 3)
    assert_same_store(sharded, local)


@pytest.mark.slow
def test_sites_and_labels_under_shards_on_the_cluster_equal_the_local_shards(cluster, trained_run, corpus, tmp_path):
    """Sublayer sites with the current token as label, in shards on the cluster: the same bits as the same shards run
    in turn locally, every site's group (issue 50)."""
    address, _ = cluster
    args = ["extract", trained_run / "checkpoint-40", "--dataset", corpus["train"], *EXTRACT_OPTS, "--sites",
            "attn:0,mlp:1", "--labels", "current", "--shards", 2]
    on_cluster, local = tmp_path / "cluster.zarr", tmp_path / "local.zarr"
    run_cli(*args, "--store", on_cluster, "--scheduler", address)
    run_cli(*args, "--store", local)
    g = f"{trained_run.name}/checkpoint-40"
    assert sorted(groups(local)) == [g, f"{g}/sites/attn_0", f"{g}/sites/mlp_1"]
    assert_same_store(on_cluster, local)


@pytest.mark.slow
def test_a_worker_killed_mid_checkpoint_changes_nothing(cluster, trained_run, corpus, tmp_path):
    address, client = cluster
    ck = trained_run / "checkpoint-20"
    args = ["extract", ck, "--dataset", corpus["train"], "--max-train-tokens", 4096, "--max-val-tokens", 2048,
            "--batch-size", 1, "--samples-per-class", 2, "--state-every", 0]
    ref = tmp_path / "ref.zarr"
    run_cli(*args, "--store", ref)
    store = tmp_path / "killed.zarr"
    proc = cli_process([*args, "--store", store, "--scheduler", address], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    state = store.with_name(store.name + ".partial") / trained_run.name / "checkpoint-20.npz"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with np.load(state) as s:
                if int(s["batches"]) >= 5:
                    break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    busy = [w for w, keys in client.processing().items() if any("extract" in str(k) for k in keys)]
    pids = client.run(os.getpid)
    assert len(busy) == 1
    os.kill(pids[busy[0]], signal.SIGKILL)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "0 extracted, 1 resumed" in out, out
    assert_same_store(ref, store)
    assert not store.with_name(store.name + ".partial").exists()
    client.wait_for_workers(2, timeout=60)  # the nanny brought it back


@pytest.mark.slow
def test_a_bad_checkpoint_fails_alone_and_is_named(cluster, trained_run, corpus, extracted_store, tmp_path):
    address, _ = cluster
    run = tmp_path / trained_run.name
    shutil.copytree(trained_run, run)
    (run / "checkpoint-40" / "model.safetensors").write_bytes(b"\x10\x00garbage")
    store = tmp_path / "s.zarr"
    r = run_cli("extract", run, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS, "--scheduler", address,
                ok=False)
    good = [g for g in groups(extracted_store) if not g.endswith("checkpoint-40")]
    assert f"{len(good)} extracted" in r.output and "1 failed" in r.output, r.output
    assert f"{run.name}/checkpoint-40" in r.output and "cannot load the model" in r.output, r.output
    assert sorted(groups(store)) == sorted(good)
    ga, gb = groups(extracted_store), groups(store)
    for g in good:
        for v in ga[g].data_vars:
            np.testing.assert_array_equal(ga[g][v].values, gb[g][v].values, err_msg=f"{g} {v}")


@pytest.mark.slow
@pytest.mark.parametrize("address", ["not an address", "http://host:8786", "host", "tcp://host:99999"])
def test_a_bad_scheduler_address_is_one_line(address, trained_run, corpus, extracted_store, tmp_path):
    for cmd in (["extract", trained_run, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr"],
                ["measure", "--store", extracted_store]):
        r = run_cli(*cmd, "--scheduler", address, ok=False)
        assert not (tmp_path / "s.zarr").exists()
        assert "is not a Dask scheduler address" in r.output and "tcp://host:8786" in r.output, r.output
