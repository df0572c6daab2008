"""measure_store and ``ncanalyze measure``: metrics stored back per checkpoint, recomputed only when needed, equal on
a dask.distributed cluster, and right (against brute force) on checkpoints extracted from a real Trainer run."""
from __future__ import annotations

import math
import shutil
import socketserver
import subprocess
import threading
import time
import warnings

import numpy as np
from ncanalyze.analyzer.table import metrics_row
import pandas as pd
import pytest
import zarr
from click.testing import CliRunner
from conftest import forked_workers, tmpfs
from test_metrics import assert_metrics, brute_force, random_study

from ncanalyze.analyzer.jackknife import EXACT
import ncanalyze.store
import ncanalyze.store.client
import ncanalyze.store.measure
from ncanalyze.analyzer import CLASS_COUNTS, PER_CLASS, SCALARS, UserError, class_stats, measure_all
from ncanalyze.analyzer.schema import ERRORS, INFO
from ncanalyze.store.io import ensure_group
from ncanalyze.store.measure import measure_store
from ncanalyze.cli.main import main


def write_checkpoint(store, run: str, step: int, seed: int, complete: bool = True):
    """A checkpoint group as extraction leaves it: the statistics, its attributes, then ``complete``."""
    h, y, W, b, hv, yv = random_study(seed=seed, V=40, d=6, N=2000)
    ds = class_stats(h, y, 40, classifier=W, classifier_bias=b, val_embeddings=hv, val_labels=yv)
    group = f"{run}/checkpoint-{step}"
    ds.attrs |= {"run": run, "checkpoint": f"checkpoint-{step}", "global_step": step, "epoch": step / 10,
                 "n_params": 1000, "n_layers": 2, "hidden_size": 6, "eval_loss": 4 - step / 100,
                 "config_hash": f"hash-{seed}", "complete": False}
    ensure_group(store)  # a store of this version's format
    ds.to_zarr(store, group=group, mode="w", consolidated=False, zarr_format=3)
    if complete:
        zarr.open_group(store, path=group, mode="r+", zarr_format=3).attrs["complete"] = True
    return ds


@pytest.fixture
def small_store(tmp_path):
    store = tmp_path / "study.zarr"
    data = {f"a/checkpoint-{s}": write_checkpoint(store, "a", s, seed=s) for s in (20, 10)}
    data["b/checkpoint-5"] = write_checkpoint(store, "b", 5, seed=5)
    write_checkpoint(store, "b", 99, seed=99, complete=False)  # an interrupted extraction: not measured
    return store, data


def attrs(store, group: str) -> dict:
    return dict(zarr.open_group(store, path=group, mode="r", zarr_format=3).attrs)


def test_measures_every_complete_checkpoint_and_stores_the_results(small_store):
    store, data = small_store
    result = measure_store(store, tile=7)
    df = result.table
    assert list(df.columns) == [*INFO, "layer", "site", "labels", "class_axis", *CLASS_COUNTS, *SCALARS, *ERRORS]
    assert list(df.site) == ["resid:2"] * 3  # the checkpoint group: the last layer
    assert set(df["labels"]) == {"next"}  # groups that record no labels are next-token groups
    assert [f"{r}/{c}" for r, c in zip(df.run, df.checkpoint)] == ["a/checkpoint-10", "a/checkpoint-20",
                                                                  "b/checkpoint-5"]
    assert sorted(result.measured) == sorted(data) and result.skipped == [] and result.failed == {}
    assert result.new.equals(df) and not result.has_layers
    tree = ncanalyze.store.open(store)
    for row in df.itertuples():
        g = f"{row.run}/{row.checkpoint}"
        ds = data[g]
        assert (row.global_step, row.epoch, row.eval_loss) == (ds.attrs["global_step"], ds.attrs["epoch"],
                                                              ds.attrs["eval_loss"])
        want, want_per = brute_force(ds, 1)
        assert_metrics(row._asdict(), want)
        a = attrs(store, g)
        stored_row = metrics_row(a)  # a null metric (a CV whose mean is not clearly positive) reads back as nan
        assert all(np.array_equal(stored_row[k], getattr(row, k), equal_nan=True) for k in (*SCALARS, *CLASS_COUNTS))
        assert all(np.isnan(stored_row[k]) for k in ERRORS)  # a hand-made group without folds: no errors
        assert {k: "nan" for k in ERRORS}.items() <= a["metrics_nonfinite"].items()
        assert (a["metrics_min_count"], a["metrics_config_hash"], a["complete"]) == (1, ds.attrs["config_hash"], True)
        assert a["metrics_se_method"] == EXACT and "metrics_se_sampling_error" not in a  # how the errors are made
        stored = tree[g].to_dataset()
        K = np.flatnonzero(ds["count"].values >= 1)
        for name in PER_CLASS:
            assert stored[name].dims == ("vocab",) and stored[name].dtype == np.float64
            np.testing.assert_allclose(stored[name].values[K], want_per[name], rtol=1e-9, err_msg=name)
        np.testing.assert_array_equal(stored["mean"].values, ds["mean"].values)  # the statistics are untouched


@pytest.mark.slow
def test_recomputes_only_when_statistics_or_min_count_change(small_store):
    store, data = small_store
    first = measure_store(store).table
    assert measure_store(store).measured == []
    # re-extraction rewrites a group (new statistics, new config hash, no metrics): only it is measured again
    new = write_checkpoint(store, "a", 10, seed=11)
    result = measure_store(store)
    again = result.table
    assert result.measured == ["a/checkpoint-10"] and result.skipped == ["a/checkpoint-20", "b/checkpoint-5"]
    assert len(result.new) == 1 and result.new.iloc[0].equals(again.iloc[0])
    assert_metrics(again.iloc[0].to_dict(), brute_force(new, 1)[0])
    assert again.iloc[1:].equals(first.iloc[1:])
    # a group whose statistics changed under the same metrics record (hash differs) is measured again
    zarr.open_group(store, path="b/checkpoint-5", mode="r+", zarr_format=3).attrs["config_hash"] = "changed"
    assert measure_store(store).measured == ["b/checkpoint-5"]
    # another min_count: everything, over the new kept set, and NC4 is nan (its kept set was fixed at extraction)
    with pytest.warns(UserWarning, match=r"nc4_agreement is nan: .* count >= 60; .* \(3 checkpoints: a/checkpoint-10, a/checkpoint-20, "
                                             r"b/checkpoint-5\)"):
        result = measure_store(store, min_count=60)
    df = result.table
    assert len(result.measured) == 3
    assert df.nc4_agreement.isna().all() and attrs(store, "a/checkpoint-20")["metrics"]["nc4_agreement"] is None
    assert_metrics(df.iloc[1].to_dict(), {k: v for k, v in brute_force(data["a/checkpoint-20"], 60)[0].items()
                                          if k != "nc4_agreement"})
    assert measure_store(store, min_count=60).measured == []
    with pytest.warns(UserWarning, match="nc4_agreement is nan"):
        assert len(measure_store(store, min_count=60, force=True).measured) == 3


def test_a_write_cut_short_is_measured_again(small_store):
    store, _ = small_store
    measure_store(store)
    g = zarr.open_group(store, path="a/checkpoint-20", mode="r+", zarr_format=3)
    del g.attrs["metrics_config_hash"]  # what a crash between the arrays and the record leaves
    assert measure_store(store).measured == ["a/checkpoint-20"]



@pytest.mark.slow
def test_a_record_without_errors_is_measured_again_for_them(small_store):
    """A record made without the jackknife errors (``se=False``, as the training callback's live metrics are) stands
    for a measurement without them, and is measured again, its errors added, by a measurement that wants them."""
    store, _ = small_store
    assert len(measure_store(store, se=False).measured) == 3
    g = "a/checkpoint-20"
    assert "metrics_se_method" not in attrs(store, g) and not set(ERRORS) & set(attrs(store, g)["metrics"])
    assert measure_store(store, se=False).measured == []
    plain = attrs(store, g)["metrics"]
    assert sorted(measure_store(store).measured) == ["a/checkpoint-10", "a/checkpoint-20", "b/checkpoint-5"]
    record = attrs(store, g)
    assert record["metrics_se_method"] == EXACT and set(ERRORS) <= set(record["metrics"])
    assert {k: v for k, v in record["metrics"].items() if k not in ERRORS} == plain
    assert measure_store(store).measured == [] and measure_store(store, se=False).measured == []

def test_bad_stores(tmp_path):
    with pytest.raises(UserError, match="no ncanalyze store"):
        measure_store(tmp_path / "missing.zarr")
    write_checkpoint(tmp_path / "s.zarr", "a", 1, seed=1, complete=False)
    with pytest.raises(UserError, match="no complete checkpoint"):
        measure_store(tmp_path / "s.zarr")


@pytest.mark.slow
def test_distributed_cluster_equals_local(small_store, tmp_path):
    distributed = pytest.importorskip("distributed")
    store, _ = small_store
    other = tmp_path / "copy.zarr"
    shutil.copytree(store, other)
    done = measure_store(store, tile=7)
    local = done.table
    with forked_workers(), \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cl, \
            distributed.Client(cl) as client:
        result = CliRunner().invoke(main, ["measure", str(other), "--tile", "7"],
                                    env={"DASK_SCHEDULER_ADDRESS": cl.scheduler_address})
        assert result.exit_code == 0, result.output
        ran = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.task_prefixes))
    assert any("tile_sums" in p for p in ran), ran  # the pairwise sums ran on the cluster
    again = measure_store(other)
    remote = again.table
    assert again.measured == []
    np.testing.assert_allclose(remote[list(SCALARS)].to_numpy(float), local[list(SCALARS)].to_numpy(float),
                               rtol=1e-13, atol=0)
    a, b = ncanalyze.store.open(store), ncanalyze.store.open(other)
    for g in done.measured:
        for name in PER_CLASS:
            np.testing.assert_allclose(b[g][name].values, a[g][name].values, rtol=1e-13, equal_nan=True)


@pytest.mark.filterwarnings("ignore:nc4_agreement is nan")  # min_count 2 is not the extraction's kept set
def test_cli(small_store):
    store, _ = small_store
    runner = CliRunner()
    result = runner.invoke(main, ["measure", "--min-count", "2"], env={"NCANALYZE_STORE": str(store)})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:4] == ["run", "checkpoint", "global_step", "nc1_cdnv"]
    assert [ln.split()[1] for ln in lines[1:4]] == ["checkpoint-10", "checkpoint-20", "checkpoint-5"]
    assert "measured 3 of 3 checkpoints" in result.output
    result = runner.invoke(main, ["measure", str(store), "--min-count", "2"])
    assert result.exit_code == 0 and "all 3 checkpoints" in result.output and "already measured" in result.output
    result = runner.invoke(main, ["measure", str(store.parent / "nothing.zarr")])
    assert result.exit_code == 1 and result.output.startswith("Error: no ncanalyze store")
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


# ---------------------------------------------------------------- a real Trainer run, extracted

@pytest.fixture
def real_store(extracted_store, tmp_path):
    """A private copy of the session's extracted store (other tests measure theirs)."""
    store = tmp_path / "real.zarr"
    shutil.copytree(extracted_store, store)
    return store


@pytest.mark.slow
def test_real_checkpoints_match_brute_force(real_store):
    result = CliRunner().invoke(main, ["measure", str(real_store), "--tile", "16"])
    assert result.exit_code == 0, result.output
    result = measure_store(real_store)
    df = result.table
    assert result.measured == []
    assert {"checkpoint-20", "checkpoint-40", "checkpoint-60"} <= set(df.checkpoint)
    assert df.global_step.notna().all() and df.eval_loss.notna().all() and df.n_params.gt(0).all()
    tree = ncanalyze.store.open(real_store)
    for row in df.itertuples():
        ds = tree[f"{row.run}/{row.checkpoint}"].to_dataset()
        n_kept = int((ds["count"].values >= 1).sum())
        assert 20 < n_kept < ds.sizes["vocab"]  # several tiles of 16, and unseen tokens left out
        want, want_per = brute_force(ds, 1)
        assert_metrics(row._asdict(), want)
        K = np.flatnonzero(ds["count"].values >= 1)
        for name, values in want_per.items():
            np.testing.assert_allclose(ds[name].values[K], values, rtol=1e-9, err_msg=name)
        assert 0 < row.nc4_agreement <= 1 and not math.isnan(row.nc1_trace)
    # the same numbers straight from measure_all on the stored dataset, with another tile
    g = f"{df.run[0]}/{df.checkpoint[0]}"
    got, _ = measure_all(tree[g].to_dataset(), 1, tile=1000)
    assert_metrics(got, df.iloc[0][list(SCALARS)].to_dict())


# ---------------------------------------------------------------- hostile schedulers, a read-only store

def _measure_cli(*args, env=None) -> tuple[int, str, float]:
    start = time.monotonic()
    r = CliRunner().invoke(main, ["measure", *map(str, args)], env=env)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r.exit_code, r.output, time.monotonic() - start


@pytest.mark.slow
def test_a_scheduler_without_workers_is_one_line_after_a_bounded_wait(small_store, monkeypatch):
    distributed = pytest.importorskip("distributed")
    store, _ = small_store
    monkeypatch.setattr(ncanalyze.store.measure, "WORKER_WAIT_S", 3)
    with distributed.LocalCluster(n_workers=0, protocol="tcp://", dashboard_address=None) as cl:
        code, out, took = _measure_cli(store, "--scheduler", cl.scheduler_address)
    errors = [ln for ln in out.splitlines() if ln.startswith("Error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in out, out
    assert f"{cl.scheduler_address} has no workers (waited 3 s for one): start some (`dask worker" in errors[0]
    assert 3 <= took < 30
    assert "metrics" not in attrs(store, "a/checkpoint-10")  # nothing half-written


class _Stranger(socketserver.ThreadingTCPServer):
    """A real TCP server that is not a Dask scheduler: it answers every connection with an HTTP error at once
    (``answer``), or reads and never answers."""
    daemon_threads = allow_reuse_address = True

    def __init__(self, answer: bool):
        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                if answer:
                    self.request.sendall(b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    time.sleep(1)
                else:
                    while self.request.recv(1 << 16):
                        pass
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.server_address[1]}"


@pytest.mark.slow
@pytest.mark.parametrize("answer, said", [(True, "answered, but not as a dask scheduler (MemoryError)"),
                                          (False, "no dask scheduler answered at tcp://127.0.0.1:")])
def test_an_address_that_is_not_a_dask_scheduler_is_one_line(small_store, monkeypatch, answer, said):
    pytest.importorskip("distributed")
    store, _ = small_store
    monkeypatch.setattr(ncanalyze.store.client, "CONNECT_S", 3)
    stranger = _Stranger(answer)
    try:
        code, out, took = _measure_cli(store, "--scheduler", stranger.address)
    finally:
        stranger.shutdown()
        stranger.server_close()
    assert code == 1 and out.startswith("Error: ") and len(out.strip().splitlines()) == 1, out
    assert said in out and "EiB" not in out and took < 20, (out, took)


def test_an_address_of_a_dask_worker_is_one_line(small_store):
    distributed = pytest.importorskip("distributed")
    store, _ = small_store
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cl:
        worker = next(iter(cl.scheduler_info["workers"]))
        code, out, _ = _measure_cli(store, "--scheduler", worker)
    assert code == 1 and f"{worker} answered as a dask Worker, not a scheduler" in out, out


@pytest.fixture
def read_only_store(small_store, tmp_path):
    """A copy of the small store on a real read-only file system (a tmpfs remounted ro: chmod does not stop root)."""
    store, data = small_store
    with tmpfs(tmp_path / "ro", "size=64m") as mnt:
        shutil.copytree(store, mnt / "study.zarr")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(OSError):
            (mnt / "probe").write_text("x")
        yield mnt / "study.zarr", data


def _tree_bytes(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_measure_on_a_read_only_store_measures_without_writing_and_says_so(read_only_store):
    store, data = read_only_store
    before = _tree_bytes(store)
    code, out, _ = _measure_cli(store, "--tile", "7")
    assert code == 0 and "Traceback" not in out, out
    said = [ln for ln in out.splitlines() if "not writable" in ln]
    assert len(said) == 1 and "Read-only file system" in said[0] and "measuring 3 checkpoint(s) without storing" \
        in said[0], out
    assert _tree_bytes(store) == before
    with pytest.warns(UserWarning, match="not writable"):
        result = measure_store(store)
    df = result.table
    assert sorted(result.measured) == sorted(data)  # nothing was stored: measured again
    for row in df.itertuples():
        assert_metrics(row._asdict(), brute_force(data[f"{row.run}/{row.checkpoint}"], 1)[0])


@pytest.mark.slow
def test_report_on_a_read_only_store_writes_its_report_elsewhere(read_only_store, tmp_path):
    store, _ = read_only_store
    out_dir = tmp_path / "report"
    r = CliRunner().invoke(main, ["report", str(store), "--out", str(out_dir), "--permutations", "0"])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output + repr(r.exception)
    assert sum("not writable" in ln for ln in r.output.splitlines()) == 1, r.output
    table = pd.read_csv(out_dir / "metrics.csv")
    assert len(table) == 3 and table.nc1_cdnv.notna().all()


def test_a_full_disk_while_storing_keeps_the_numbers_and_loses_nothing(tmp_path):
    """A real tmpfs filled to the last byte after the store is copied in: the metrics are right and returned, said in
    one warning, the groups' metadata intact, and the checkpoints measured again once there is room."""
    src = tmp_path / "src.zarr"
    data = {f"a/checkpoint-{s}": write_checkpoint(src, "a", s, seed=s) for s in (10, 20)}
    with tmpfs(tmp_path / "full", "size=1m") as mnt:
        store = mnt / "s.zarr"
        shutil.copytree(src, store)
        with pytest.raises(OSError), open(mnt / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        with pytest.warns(UserWarning, match=r"cannot store the metrics in .* \(No space left on device\): measuring "
                                             "the rest without storing"):
            df = measure_store(store).table
        for row in df.itertuples():
            assert_metrics(row._asdict(), brute_force(data[f"{row.run}/{row.checkpoint}"], 1)[0])
        for g, ds in data.items():
            a = attrs(store, g)
            assert a["complete"] is True and a["config_hash"] == ds.attrs["config_hash"] and "metrics" not in a
        (mnt / "filler").unlink()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zarr notes the half-created array the full disk left
            assert sorted(measure_store(store).measured) == sorted(data)
        assert measure_store(store).measured == []


@pytest.mark.parametrize("content", ["{nope", "[1, 2]", '{"address": 5}', ""])
def test_a_scheduler_file_without_an_address_is_one_line(small_store, tmp_path, content):
    pytest.importorskip("distributed")
    store, _ = small_store
    (tmp_path / "sched.json").write_text(content)
    code, out, _ = _measure_cli(store, "--scheduler", tmp_path / "sched.json")
    assert code == 1 and len(out.strip().splitlines()) == 1 and "holds no scheduler address" in out, out


@pytest.mark.slow
def test_measure_at_min_count_5_has_nc4_of_a_store_extracted_at_1(kept_store, tmp_path):
    """`ncanalyze measure --min-count 5` of a store extracted at --min-count 1 (a kept set that differs: classes
    under 5 train tokens) has NC4, from the decisions counted at 5 in the same validation pass."""
    from conftest import run_cli
    from ncanalyze.store.io import read_group

    store = tmp_path / "s.zarr"
    shutil.copytree(kept_store, store)
    ds = read_group(store, "neo-2x32/checkpoint-20")
    count = ds["count"].values
    assert ((count >= 1) != (count >= 5)).any()  # another kept set at 5
    run_cli("measure", store, "--min-count", 5, "--no-se")
    got = ncanalyze.store.open(store)["neo-2x32/checkpoint-20"].attrs["metrics"]["nc4_agreement"]
    kept = count >= 5
    agree = ds["val_ncc_agree_at"].values[list(ds["nc4_min_count"].values).index(5)]
    assert got == pytest.approx(agree[kept].sum() / ds["val_count"].values[kept].sum(), rel=1e-12) and 0 < got < 1
