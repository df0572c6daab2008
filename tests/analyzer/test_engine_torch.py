"""The torch engine (the GPU's code, run here on the CPU: analyzer/engine_torch.py) against the numba engine, brute force and the reference tile sums: classes counted but not kept, classifier rows
outside K, stored float32, a lazy dataset read once, no classifier or within_covariance, corrupt input; where it
runs (``engine_device``); and coincident classes in bounded memory."""
from __future__ import annotations

import collections
import math
import os
import warnings

import dask
import numpy as np
import pytest
import torch
import xarray as xr
from test_geometry import brute_force as geometry_brute_force
from test_geometry import study as geometry_study
from test_metrics import assert_degenerate_like_brute_force, assert_metrics, brute_force, random_study, stats_dataset

from ncanalyze.analyzer import CLASS_COUNTS, SCALARS, UserError, class_stats, measure_all
from ncanalyze.analyzer.engine_torch import _torch_block
from ncanalyze.analyzer.engines import GPU_FILES, engine_device
from ncanalyze.analyzer.geometry import geometry
from ncanalyze.analyzer.pairs import COINCIDENT, EXAMPLES, SUMS, reference_tile_sums, side_of

TORCH = {"device": "cpu", "engine": "torch"}
SAME = 1e-12  # the torch path equals the CPU's to this (relative; values 0 in exact arithmetic to 1e-14 absolute)


def assert_same(got: dict, want: dict) -> None:
    bad = {k: (got[k], want[k]) for k in want if not (got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k]))
                                                    or math.isclose(got[k], want[k], rel_tol=SAME, abs_tol=1e-14))}
    assert not bad, bad


@pytest.fixture(scope="module")
def study():
    h, y, W, b, hv, yv = random_study(seed=5, V=80, d=16, N=6000)
    return class_stats(h, y, 80, classifier=W, classifier_bias=b, val_embeddings=hv, val_labels=yv, min_count=10)


@pytest.mark.parametrize("tile", [3, 7, None])
def test_torch_path_equals_the_numba_path_and_brute_force(study, tile):
    """Every scalar and per-class metric: torch (in row panels of ``tile`` classes, or one panel) = numba to 1e-12,
    and both = the brute force of test_metrics."""
    K = np.flatnonzero(study["count"].values >= 10)
    assert 20 < K.size < 80
    fast, fast_per = measure_all(study, 10, tile, device="cpu", se=False)
    got, per = measure_all(study, 10, tile, se=False, **TORCH)
    assert list(got) == [*SCALARS, *CLASS_COUNTS]
    assert_same(got, fast)
    assert_metrics(got, brute_force(study, 10)[0])
    for name in per:
        np.testing.assert_allclose(per[name].values, fast_per[name].values, rtol=SAME, atol=1e-14, err_msg=name)


def assert_same_per_class(got: xr.Dataset, want: xr.Dataset) -> None:
    for name in want:
        np.testing.assert_allclose(got[name].values, want[name].values, rtol=SAME, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("min_count", [1, 15])
def test_classes_counted_but_not_kept_and_the_head_outside_K(min_count):
    """Empty classes, rare ones that min_count 15 leaves out (Sigma_T still counts them) and a classifier over the
    whole vocabulary (head_erank reads the rows outside K): the torch path = numba to 1e-12 and = test_geometry's
    brute force from the raw features (covariances as explicit matrices, SVDs of the features and of W)."""
    h, y, W = geometry_study(seed=min_count)
    ds = class_stats(h, y, len(W), classifier=W)
    count = ds["count"].values
    assert (count == 0).any() and ((count > 0) & (count < 15)).any()
    got, per = measure_all(ds, min_count, 5, **TORCH)
    want, per_want = measure_all(ds, min_count, 5, device="cpu")
    assert_same(got, want)
    assert_same_per_class(per, per_want)
    brute, share = geometry_brute_force(h, y, W, min_count)
    assert_metrics({k: got[k] for k in brute}, brute)
    np.testing.assert_allclose(per["class_freq_weight"].values[count >= min_count], share, rtol=1e-9)


def test_each_vocab_by_hidden_array_is_read_once():
    """From a lazy (dask) dataset, the torch path computes the means and the classifier once each (the host path
    reads each twice: the kept rows, then the others); the metrics stay those of the numba path."""
    h, y, W = geometry_study(seed=15)
    ds = class_stats(h, y, len(W), classifier=W).chunk({"vocab": 7})
    names = {v: ds[v].data.name for v in ("mean", "classifier")}
    reads: collections.Counter = collections.Counter()

    def counting_get(graph, keys, **kw):
        held = {k[0] if isinstance(k, tuple) else k for k in graph.__dask_graph__().keys()}
        reads.update(v for v, name in names.items() if name in held)
        return dask.get(graph, keys, **kw)

    with dask.config.set(scheduler=counting_get):
        got, per = measure_all(ds, 15, 5, **TORCH)
    assert reads == {"mean": 1, "classifier": 1}
    want, per_want = measure_all(ds.compute(), 15, 5, device="cpu")
    assert_same(got, want)
    assert_same_per_class(per, per_want)


def test_without_classifier_or_within_covariance():
    """What is defined without them equals the numba path; what is not is nan on both (every key present)."""
    h, y, *_ = random_study(seed=4, V=30, d=6, N=1200)
    ds = class_stats(h, y, 30).drop_vars("within_covariance")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, per = measure_all(ds, 2, 4, **TORCH)
        want, per_want = measure_all(ds, 2, 4, device="cpu")
    assert list(got) == list(want) and "nc1_trace" not in got and "nc3_cos_mean" not in got and "lidar" not in got
    assert_same(got, want)
    assert_same_per_class(per, per_want)
    assert np.isnan(per["class_duality"].values).all()


def test_stored_float32_means_and_classifier_are_made_float64_on_the_device():
    """A classifier (and means) stored in float32 travel in float32 and are made float64 there: the same numbers
    as the numba path, which makes them float64 on the host."""
    rng = np.random.default_rng(8)
    V, d = 300, 12
    ds = stats_dataset((rng.standard_normal((V, d)) * 3).astype(np.float32), rng.uniform(0.5, 2, V),
                       classifier=rng.standard_normal((V, d)).astype(np.float32))
    ds["count"] = ("vocab", rng.integers(0, 40, V))
    assert ds["mean"].dtype == ds["classifier"].dtype == np.float32
    assert_same(measure_all(ds, 5, 64, **TORCH)[0], measure_all(ds, 5, 64, device="cpu")[0])


@pytest.mark.parametrize("min_count", [1, 3])
def test_the_torch_path_leaves_its_input_untouched(min_count):
    """On the CPU torch shares the dataset's memory: gathering, centring and normalising must not write to it."""
    rng = np.random.default_rng(3)
    ds = stats_dataset(rng.standard_normal((40, 5)) + 2, classifier=rng.standard_normal((40, 5)))
    ds["count"] = ("vocab", np.arange(40) % 6)
    before = ds.copy(deep=True)
    measure_all(ds, min_count, 7, **TORCH)
    xr.testing.assert_identical(ds, before)


def test_corrupt_input_on_the_torch_path():
    """The numba path's one-line errors, from the device's checks."""
    rng = np.random.default_rng(0)
    means = rng.standard_normal((8, 3))
    cases = [(stats_dataset(means, variance=np.r_[1.0, np.nan, 1, 1, 1, 1, 1, 1]), 1, "NaN or Inf"),
             (stats_dataset(np.r_[[[1.0, 2.0], [-1.0, -2.0], [0.0, 0.0], [3.0, -1.0], [-3.0, 1.0]]]), 1,
              r"class\(es\) \[2\] have a zero-norm centred mean"),
             (stats_dataset(means, classifier=np.where(np.arange(8)[:, None] == 4, 0.0, means)), 1,
              r"classifier row\(s\) of class\(es\) \[4\] are zero")]
    outside = stats_dataset(np.where(np.arange(8)[:, None] == 6, np.inf, means))
    outside["count"] = ("vocab", np.r_[np.full(6, 10), 1, 0])          # class 6: counted, not kept, corrupt
    cases.append((outside, 5, "means of the classes counted but not kept contain NaN or Inf"))
    for ds, min_count, said in cases:
        with pytest.raises(UserError, match=said):
            measure_all(ds, min_count, **TORCH)
        with pytest.raises(UserError):
            measure_all(ds, min_count, device="cpu")


def test_torch_path_equals_numba_over_many_panels():
    """A few thousand classes with Zipf counts (the frequency-weighted sums matter) in panels of 97 rows against the
    numba pass in tiles of 256."""
    rng = np.random.default_rng(11)
    V, d = 3000, 24
    means = rng.standard_normal((V, d)) * rng.uniform(0.5, 2, (V, 1)) + rng.standard_normal(d)
    ds = stats_dataset(means, rng.uniform(0.1, 4, V), classifier=rng.standard_normal((V, d)),
                       sigma_w=np.cov(rng.standard_normal((d, 3 * d))))
    ds["count"] = ("vocab", rng.zipf(1.3, V).clip(1, 10**6))
    assert_same(measure_all(ds, 1, 97, **TORCH)[0], measure_all(ds, 1, 256, device="cpu")[0])


def _block_case(rng, ni: int, nj: int, d: int, coincide: bool):
    U = [rng.standard_normal((n, d)) for n in (ni, nj)]
    if coincide:                                                   # shared directions, one with the same mean too
        U[1][:3] = U[0][:3] * [[1.0], [2.5], [1.0]]
    U = [u / np.linalg.norm(u, axis=1, keepdims=True) for u in U]
    side = [side_of(rng.uniform(0.5, 3, n), v := rng.uniform(0, 2, n), rng.uniform(0.01, 0.2, n), None,
                    (v * 1.2, v / rng.integers(2, 5, n), rng.random(n) < 0.8, 0.1, 0.3)) for n in (ni, nj)]
    if coincide:
        side[1][:2, 0] = side[0][:2, 0]                            # pair (0, 0): the same r, so the same mean
    return U, side


@pytest.mark.parametrize("coincide", [False, True])
@pytest.mark.parametrize("diag", [False, True])
def test_torch_block_is_the_reference_tile(diag, coincide):
    """_torch_block's sums, rows and columns are reference_tile_sums', coincident pairs (inf CDNV terms, 0/0 for two
    zero variances) included, on a diagonal block too; its last sum counts the pairs whose means coincide."""
    rng = np.random.default_rng(int(diag) + 2 * int(coincide))
    U, side = _block_case(rng, 23, 23 if diag else 31, 8, coincide and not diag)
    if diag:
        if coincide:              # within the block: 2 and 5 one mean and no variance (0/0), 3 and 8 one direction
            U[0][[5, 8]] = U[0][[2, 3]]
            side[0][:, 5] = side[0][:, 2]
            side[0][np.ix_([2, 5, 6], [2, 5])] = 0.0   # no variance, plug-in or unbiased
            side[0][7, [2, 5]] = 1.0
        U[1], side[1] = U[0], side[0]
    t0 = 1.3
    want = reference_tile_sums(U[0], side[0], U[1], side[1], t0, diag)
    T = [torch.from_numpy(x) for x in (U[0], side[0], U[1], side[1])]
    sums, rows, cols = (x.numpy() for x in _torch_block(*T, t0, diag))
    keep = [0, 1, 4, 5, 6, 8, 9] if coincide else range(len(SUMS))   # the logs at T ~ 0 are not used
    np.testing.assert_allclose(sums[list(keep)], want[0][list(keep)], rtol=SAME, atol=1e-14)
    np.testing.assert_allclose(rows, want[1], rtol=SAME, atol=1e-14)
    np.testing.assert_allclose(cols, want[2], rtol=SAME, atol=1e-14)
    assert sums[len(SUMS)] == (1 if coincide else 0)
    if coincide:
        i, j = (2, 5) if diag else (0, 0)
        assert sums[0] == (2 if diag else 3) and np.isinf(rows[i]) and np.isinf(cols[j])
        assert np.isinf(sums[[SUMS.index("cdnv"), SUMS.index("cdnv_p2"), SUMS.index("cdnv_freq")]]).all()
        assert np.isinf(sums[SUMS.index("cdnv_deb")]) == diag    # finite where the coincident means have a variance
        assert np.isfinite(np.delete(rows, i)).all() and np.isfinite(np.delete(cols, j)).all()


@pytest.mark.parametrize("engine", ["numba", "torch"])
def test_many_coincident_classes_keep_a_few_examples(engine):
    """400 classes on 40 distinct means (1,800 coincident pairs, as at an embedding layer): the metrics still equal
    the brute force (the CDNV and GNC2 infinite), the warning names the first pair, and only a few pairs are kept
    (a list of all of them once took gigabytes)."""
    rng = np.random.default_rng(4)
    means = rng.standard_normal((40, 6))[np.r_[np.arange(40), rng.integers(0, 40, 360)]]
    first = next((i, j) for i in range(400) for j in range(i + 1, 400) if (means[i] == means[j]).all())
    kw = {"tile": 64, "device": "cpu", "engine": engine}
    assert_degenerate_like_brute_force(stats_dataset(means), f"classes {first[0]} and {first[1]}, ",
                                       per_class_inf=list(first), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = geometry(stats_dataset(means), **kw)
    assert len(g.coincident) == EXAMPLES and all(same for *_, same in g.coincident)
    assert g.coincident[0][:2] == first and g.pairs.coincident >= 360


def test_parallel_means_on_the_torch_path():
    means = np.array([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [-3.0, -1.0]])    # centred: (1,0) and (2,0) align
    assert_degenerate_like_brute_force(stats_dataset(means), "classes 0 and 1 point the same way", **TORCH)
    assert 2 - 2 * np.cos(0) < COINCIDENT


def test_where_the_metrics_run():
    cuda = torch.cuda.is_available()
    assert engine_device("cpu") is None and engine_device("CPU", "numba") is None
    assert engine_device("cpu", "torch") == "cpu"
    assert engine_device("auto", "numba") is None
    assert engine_device("auto") == ("cuda" if cuda else None)
    assert engine_device("auto", "torch") == ("cuda" if cuda else "cpu")
    for device, engine, msg in [("gpu", None, r"device \(--device\) must be auto, cpu, cuda or cuda:N, got 'gpu'"),
                                ("cpu", "jax", "engine must be numba or torch"),
                                ("cuda:x", None, r"\(--device\) must be")]:
        with pytest.raises(UserError, match=msg):
            engine_device(device, engine)
    if cuda:
        with pytest.raises(UserError, match="numba engine runs on the CPU only"):
            engine_device("cuda", "numba")
        with pytest.raises(UserError, match="CUDA device"):
            engine_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(UserError, match="torch sees no CUDA device"):
            engine_device("cuda")
        with pytest.raises(UserError, match="torch sees no CUDA device"):
            measure_all(stats_dataset(np.eye(3)), device="cuda:0")


NO_TORCH = """
import sys
from ncanalyze.analyzer.engines import gpu_possible
from ncanalyze.cli.main import main
there = sys.argv[2]
print(gpu_possible(), gpu_possible(("/nowhere/nvidia0", there)), gpu_possible(("/nowhere/nvidia0",)))
main(["-q", "measure", sys.argv[1]], standalone_mode=False)
print("torch" in sys.modules)
"""


@pytest.mark.slow  # a new Python that imports the measuring libraries
@pytest.mark.skipif(any(os.path.exists(f) for f in GPU_FILES), reason="a GPU driver's file is here: torch is asked")
def test_auto_where_no_gpu_driver_file_exists_measures_without_importing_torch(tmp_path):
    """Issue 52: ``--device auto`` on a Linux machine without a GPU driver's files (this one) runs the numba engine
    without importing torch (~1 s of every measure and report): ``ncanalyze measure`` in a new Python stores the same
    metrics and leaves torch unimported; any one driver file there and torch is asked."""
    import subprocess
    import sys

    from test_measure_store import write_checkpoint

    from ncanalyze.analyzer.table import metrics_row
    from ncanalyze.store.io import group_attrs

    store = tmp_path / "s.zarr"
    ds = write_checkpoint(store, "a", 10, seed=10)
    there = tmp_path / "nvidia0"
    there.touch()
    out = subprocess.run([sys.executable, "-c", NO_TORCH, str(store), str(there)], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip().split("\n")
    assert (out[0], out[-1]) == ("False True False", "False"), out  # the table measure prints between
    assert_same(metrics_row(group_attrs(store, "a/checkpoint-10")), measure_all(ds)[0])


def test_measure_cli_takes_device(tmp_path):
    """``ncanalyze measure --device cpu`` measures; a device that is not there or not a device is one line."""
    from click.testing import CliRunner
    from test_measure_store import write_checkpoint

    from ncanalyze.cli.main import main
    from ncanalyze.store.io import group_attrs

    store = tmp_path / "s.zarr"
    ds = write_checkpoint(store, "a", 10, seed=10)
    r = CliRunner().invoke(main, ["measure", str(store), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    from ncanalyze.analyzer.table import metrics_row
    assert_same(metrics_row(group_attrs(store, "a/checkpoint-10")), measure_all(ds, **TORCH)[0])  # a null is nan
    bad = [("tpu", "device (--device) must be auto, cpu, cuda or cuda:N, got 'tpu'")]
    if not torch.cuda.is_available():
        bad.append(("cuda", "torch sees no CUDA device"))
    for device, said in bad:
        r = CliRunner().invoke(main, ["measure", str(store), "--device", device, "--force"])
        assert r.exit_code == 1 and said in r.output and len(r.output.strip().splitlines()) == 1, r.output
