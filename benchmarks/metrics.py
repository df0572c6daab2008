"""Benchmark: the whole metric suite of one checkpoint against one symmetric Gram of its centred means.

    python benchmarks/metrics.py                 # K = 8,192, d = 256
    python benchmarks/metrics.py --paper         # also K = 29,233, d = 1,024 (the paper's scale; ~2 GB, minutes)
    python benchmarks/metrics.py --sizes 20000x64 --rounds 1
    python benchmarks/metrics.py --classes 128256 --width 4096 --cuda    # Llama-3's vocabulary and width, one GPU
    python benchmarks/metrics.py --classes 128256 --width 64 --engine torch --rounds 1   # the GPU's code on the CPU

For each size it prints the median time of `measure` with ``se=False`` (the point values alone: no jackknife errors,
whose cost ``benchmarks/jackknife.py errors`` measures) of all the metrics of schema.SCALARS, NC and representation
geometry, with the per-class views' pairwise sums, the d x d moments and their six eigendecompositions: M^T M,
Sigma_W, Sigma_T, the raw second moment, LiDAR's whitened Sigma_B and the head's W^T W) and of the Gram G = M M^T of the centred means,
computed three ways in the same run: tile by tile over the upper triangle (the work the metrics do, |K|^2 d / 2
multiply-adds) with multi-threaded BLAS, the same tiles as dask tasks with one BLAS thread each (how the metrics
run), and, where it fits in a quarter of the memory, as one BLAS call. The ratio is taken over the fastest of the
three: `measure` and that Gram run in alternating rounds and the median of the per-round ratios is printed, so that
the slow spells of a shared machine hit both sides. The six d x d eigendecompositions alone are timed too (they are
part of `measure`'s time). Peak memory of `measure` is traced with tracemalloc (numpy's buffers; BLAS's own small
buffers are not seen) and set against |K|^2 x 8 bytes. The same ratio in CPU seconds of the process (every thread)
is printed beside it: the work each side does, which a busy shared machine stretches less than the wall time.

Smaller problems (``--small``, K = 512, d = 64, the tiny recipe's size, up to about engine_numba.SYNC_WORK's work) are
each timed as `measure` chooses to run it
(engine_numba.workers: the caller's thread below SYNC_WORK multiply-adds, else as many threads as the load measured
between calls leaves cores idle, core.threads.available) against the other way (the caller's thread or the thread
pool), and the default size likewise: the choice is right where each chosen time is the lower.

With ``--cuda`` (or ``--engine torch``: the same code on the CPU) `measure` runs in torch float64 on the device
(``device="cuda"``, analyzer/engine_torch.py) and is set against one float64 Gram M M^T of the centred means on that device
(all K^2 cells, in row panels into one buffer: 2 K^2 d flops, then a synchronise), with the peak device memory. The
metrics' time is `measure`'s from the host dataset to the host floats (which waits for the device): moving the means
and the classifier to the device, the 14 NC metrics of the target and the 10 geometry metrics beside them (their four
more eigendecompositions included), as `ncanalyze measure --device cuda` runs them once a checkpoint is read; the
statistics are random (float64), so the store's read is not in either time.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import timeit
import tracemalloc

import dask
import numpy as np
import psutil
import threadpoolctl
import xarray as xr
from ncanalyze.analyzer import engine_numba
from ncanalyze.analyzer.engine_numba import auto_tile
from ncanalyze.analyzer.metrics import measure
from ncanalyze.analyzer.moments import lidar_spectrum
from ncanalyze.analyzer.engine_torch import torch_pair_sums
from ncanalyze.analyzer.schema import NC_METRICS, SCALARS


def checkpoint(k: int, d: int, seed: int = 0) -> xr.Dataset:
    """A synthetic checkpoint's statistics: random class means, variances, covariance, classifier, NC4 counts."""
    rng = np.random.default_rng(seed)
    mean = rng.standard_normal((k, d))
    a = rng.standard_normal((d, d)) / d
    val = rng.integers(1, 50, k)
    return xr.Dataset({
        "count": ("vocab", rng.integers(1, 1000, k)), "mean": (("vocab", "hidden"), mean),
        "variance": ("vocab", rng.random(k) * d), "within_covariance": (("hidden", "hidden2"), a @ a.T),
        "classifier": (("vocab", "hidden"), mean + rng.standard_normal((k, d))),
        "val_count": ("vocab", val), "val_ncc_agree": ("vocab", rng.integers(0, val + 1)),
        "unit_sum": ("hidden", rng.standard_normal(d))}, attrs={"min_count": 1})


def tiled_gram(M: np.ndarray, tile: int) -> float:
    """The upper-triangle tiles of M M^T, each computed once, BLAS using every core (a checksum, so nothing is
    optimised away)."""
    total = 0.0
    for a in range(0, len(M), tile):
        for c in range(a, len(M), tile):
            total += (M[a:a + tile] @ M[c:c + tile].T)[0, 0]
    return total


def dask_gram(M: np.ndarray, tile: int) -> float:
    """The same tiles as dask tasks on the threaded scheduler, one BLAS thread per task (as the metrics run)."""
    def block(a: int, c: int) -> float:
        return float((M[a:a + tile] @ M[c:c + tile].T)[0, 0])
    tasks = [dask.delayed(block)(a, c) for a in range(0, len(M), tile) for c in range(a, len(M), tile)]
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        return sum(dask.compute(*tasks))


def eigendecompositions(MtM: np.ndarray, WtW: np.ndarray, sigma_w: np.ndarray) -> None:
    """The d x d spectra `measure` takes, as it takes them (float64 numpy.linalg): eigh of M^T M, eigvalsh of
    Sigma_W, Sigma_T, the second moment (RankMe) and W^T W, and LiDAR's (a Cholesky factor, two triangular solves,
    one eigvalsh)."""
    np.linalg.eigh(MtM)
    for S in (sigma_w, sigma_w + MtM / len(MtM), sigma_w + MtM / len(MtM) + 1.0, WtW):
        np.linalg.eigvalsh(S)
    lidar_spectrum(sigma_w, MtM / len(MtM))


def ratios(f, g, rounds: int, cpu: list | None = None) -> tuple[float, float, float]:
    """Median seconds of f and of g, and the median of their per-round ratio f/g: the two run alternately, so a
    shared machine's slow spells hit both. ``cpu``, where given, receives each round's ratio of CPU seconds (every
    thread of the process)."""
    tf, tg, cf, cg = [], [], [], []
    for _ in range(rounds):
        for fn, t, c in ((f, tf, cf), (g, tg, cg)):
            c0 = time.process_time()
            t.append(timeit.timeit(fn, number=1))
            c.append(time.process_time() - c0)
    if cpu is not None:
        cpu += np.divide(cf, cg).tolist()
    return statistics.median(tf), statistics.median(tg), statistics.median(np.divide(tf, tg))


def threading(k: int, d: int, rounds: int) -> str:
    """`measure` at K = k, d = d as it chooses to run (engine_numba.workers) and forced the other way (the caller's
    thread or the thread pool), alternating: both medians, and which was chosen."""
    ds = checkpoint(k, d)
    chosen = "thread pool" if engine_numba.workers(k * (k - 1) / 2, 0, k, d) > 1 else "caller's thread"
    keep = engine_numba.SYNC_WORK
    forced = {"caller's thread": math.inf, "thread pool": 0.0}
    times: dict[str, list[float]] = {name: [] for name in forced}
    try:
        for _ in range(rounds):
            for name, work in forced.items():
                engine_numba.SYNC_WORK = work
                measure(ds, se=False)  # warm: the pool started
                times[name].append(timeit.timeit(lambda: measure(ds, se=False), number=1))
    finally:
        engine_numba.SYNC_WORK = keep
    med = {name: statistics.median(t) for name, t in times.items()}
    other = next(name for name in forced if name != chosen)
    return (f"K={k:,} d={d}: chosen ({chosen}) {med[chosen] * 1e3:.1f} ms, {other} {med[other] * 1e3:.1f} ms "
            f"({'right' if med[chosen] <= med[other] else 'WRONG'} choice)")


def run(k: int, d: int, rounds: int) -> None:
    ds = checkpoint(k, d)
    M = ds["mean"].values - ds["mean"].values.mean(0)
    tile = auto_tile(k)
    measure(ds, se=False)  # warm-up: imports, thread pools, the compiled pass
    grams = {"tiled": lambda: tiled_gram(M, tile), "tiled on dask": lambda: dask_gram(M, tile)}
    full_bytes = k * k * 8
    if full_bytes < psutil.virtual_memory().available / 4:
        grams["one call"] = lambda: M @ M.T
    times = {name: statistics.median(timeit.repeat(g, number=1, repeat=rounds)) for name, g in grams.items()}
    gram = grams[min(times, key=times.get)]
    cpu: list[float] = []
    t_metrics, t_gram, ratio = ratios(lambda: measure(ds, se=False), gram, rounds, cpu)
    cpu_ratio = statistics.median(cpu)
    W, sigma_w = ds["classifier"].values, ds["within_covariance"].values
    MtM, WtW = M.T @ M, W.T @ W
    t_eigen = statistics.median(timeit.repeat(lambda: eigendecompositions(MtM, WtW, sigma_w), number=1,
                                              repeat=rounds))
    tracemalloc.start()
    measure(ds, se=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"K={k:,} d={d:,} tile={tile}, {len(SCALARS)} metrics: Gram "
          + ", ".join(f"{name} {t:.2f} s" for name, t in times.items()) +
          f" | {rounds} alternating rounds: metrics (se=False: no jackknife errors) {t_metrics:.2f} s, fastest Gram "
          f"{t_gram:.2f} s, ratio {ratio:.2f} (median per round; target <= 1.0), in CPU seconds {cpu_ratio:.2f}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; the six d x d eigendecompositions alone "
          f"{t_eigen:.3f} s, so the suite's floor (that Gram and these alone, no pair pass) is "
          f"{1 + t_eigen / t_gram:.2f} of the Gram | peak {peak / 2**20:,.0f} MiB traced "
          f"(|K| d x 8 = {k * d * 8 / 2**20:,.0f} MiB, |K|^2 x 8 = {full_bytes / 2**20:,.0f} MiB)", flush=True)


def device_gram(M, panel: int) -> None:
    """M M^T in torch on M's device: every cell, in row panels of ``panel`` classes into one reused buffer."""
    import torch

    buf = torch.empty((panel, len(M)), dtype=M.dtype, device=M.device)
    for a in range(0, len(M), panel):
        b = min(a + panel, len(M))
        torch.matmul(M[a:b], M.T, out=buf[:b - a])
    if M.is_cuda:
        torch.cuda.synchronize(M.device)


def run_torch(k: int, d: int, rounds: int, device: str) -> None:
    """`measure` in torch float64 on ``device`` against one float64 Gram of the centred means there."""
    import torch

    ds = checkpoint(k, d)
    kw = {"device": device, "engine": "torch"}
    M = torch.as_tensor(ds["mean"].values - ds["mean"].values.mean(0), device=device)
    panel = max(1, (1 << 27 if device.startswith("cuda") else 1 << 22) // k)
    measure(ds, se=False, **kw)  # warm-up: kernels, cuBLAS and cuSOLVER handles
    device_gram(M, panel)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    t_metrics, t_gram, ratio = ratios(lambda: measure(ds, se=False, **kw), lambda: device_gram(M, panel), rounds)  # synchronised
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else math.nan
    U = M / torch.linalg.vector_norm(M, dim=1)[:, None]                   # the pairwise sums alone (r = 1 here)
    one = torch.ones(k, dtype=M.dtype, device=device)
    side = torch.stack([one, one, torch.as_tensor(ds["variance"].values, device=device), one / k])
    t_pairs = statistics.median(timeit.repeat(lambda: torch_pair_sums(U, side, 1.0), number=1, repeat=rounds))
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU (torch)"
    flops = 2 * k * k * d
    print(f"K={k:,} d={d:,} on {name}, the {len(NC_METRICS)} NC metrics (and {len(SCALARS) - len(NC_METRICS)} geometry "
          f"metrics) in torch float64: metrics {t_metrics:.2f} s, one "
          f"float64 Gram M M^T {t_gram:.2f} s ({flops / t_gram / 1e9:,.0f} GFLOP/s), ratio {ratio:.2f} (median of "
          f"{rounds} alternating rounds; target <= 1.5); of which the pairwise sums alone {t_pairs:.2f} s | peak "
          f"device memory {peak:.1f} GiB "
          f"(M: {k * d * 8 / 2**30:.1f} GiB)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", action="store_true", help="also K = 29,233, d = 1,024 (heavy)")
    p.add_argument("--sizes", nargs="*", default=None, help="KxD sizes instead of the defaults, e.g. 8192x256")
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds of metrics and Gram")
    p.add_argument("--classes", type=int, help="one size: this many classes (with --width)")
    p.add_argument("--width", type=int, default=4096, help="the hidden width with --classes [4096]")
    p.add_argument("--cuda", action="store_true", help="measure in torch float64 on the GPU, against its Gram")
    p.add_argument("--engine", choices=("numba", "torch"), default="numba",
                   help="on the CPU: the numba pass (default) or the GPU's torch code")
    p.add_argument("--small", default="512x64,1024x128,2048x64,2048x128,1024x256",
                   help="KxD,... of the smaller problems whose threading is checked, about SYNC_WORK (engine_numba) "
                        "[512x64,1024x128,2048x64,2048x128,1024x256]")
    args = p.parse_args()
    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes] if args.sizes else [(8192, 256)]
    if args.classes:
        sizes = [(args.classes, args.width)]
    if args.paper:
        sizes.append((29233, 1024))
    for k, d in sizes:
        if args.cuda or args.engine == "torch":
            run_torch(k, d, args.rounds, "cuda" if args.cuda else "cpu")
        else:
            run(k, d, args.rounds)
            print("threading as chosen vs the other way, median of " f"{min(args.rounds, 5)} alternating rounds: "
                  + threading(k, d, min(args.rounds, 5)), flush=True)
    if not (args.cuda or args.engine == "torch"):
        for size in args.small.split(","):
            k, d = map(int, size.split("x"))
            work = engine_numba.work(k * (k - 1) / 2, 0, k, d)
            print(f"threading of a smaller problem ({work:.1e} multiply-adds; the caller's thread below "
                  f"{engine_numba.SYNC_WORK:.1e}), median of {args.rounds} alternating rounds: "
                  + threading(k, d, args.rounds), flush=True)


if __name__ == "__main__":
    main()
