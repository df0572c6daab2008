"""Thread settings of torch's CPU kernels, idle and under a load this script makes itself.

    python benchmarks/threads.py                   # GPT-Neo width 256, 2 layers, vocab 8,192, batch 8 x 128, CPU
    python benchmarks/threads.py --seconds 4 --busy 3

The work is one train batch of the extraction as ``ncanalyze extract`` runs it (the forward pass to the last hidden
state, then the float64 class statistics), timed as the median of the batches of ``--rounds`` alternating rounds
over ``--seconds`` per setting. Contenders: ``1`` thread, ``N`` threads (the cores this process may use: affinity
and cgroup quota), and the default, ``--threads auto`` (ncanalyze.core.threads: the cores other processes leave
idle, measured again between batches). Conditions: ``idle`` (no load of ours; the machine's own load average is
printed: a shared machine is not idle), ``1 busy``: one spinning process, and ``loaded``: ``--busy`` spinning
processes per allowed core (default 1), each ending itself after ``--limit`` seconds or when this script is gone,
and ended by this script when it is done, Ctrl-C included. Prints the seconds per batch and each setting's ratio to
the best of the condition; the default should be within 1.2x of the best idle and loaded.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from ncanalyze.analyzer.accumulate import ClassStats
from ncanalyze.core import threads
from ncanalyze.store.sources.anatomy import features
from transformers import GPTNeoConfig, GPTNeoForCausalLM


def spin(deadline: float) -> None:
    """A busy process: spins until ``deadline`` (time.time) or until its parent is gone (killed without cleaning
    up), so it ends even if nobody ends it."""
    parent, x = os.getppid(), 0
    while time.time() < deadline and os.getppid() == parent:
        for _ in range(100_000):
            x += 1


@contextmanager
def load(n: int, limit: float) -> Iterator[list[mp.Process]]:
    """``n`` spinning processes for the block, each bounded by ``limit`` seconds, ended at the block's end however it
    ends (Ctrl-C included)."""
    procs = [mp.get_context("spawn").Process(target=spin, args=(time.time() + limit,), daemon=True)
             for _ in range(n)]
    try:
        for p in procs:
            p.start()
        time.sleep(0.5)  # running before anything is timed
        yield procs
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            p.terminate()
        for p in started:
            p.join(5)


def batch(width: int, layers: int, vocab: int, size: int, block: int):
    """The model, a batch of ids and a fresh state: one train batch is ``step()``."""
    torch.manual_seed(0)
    config = GPTNeoConfig(vocab_size=vocab, hidden_size=width, num_layers=layers, num_heads=4,
                          attention_types=[[["global"], layers]], max_position_embeddings=block,
                          intermediate_size=4 * width)
    model = GPTNeoForCausalLM(config).eval()
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(np.minimum(rng.zipf(1.2, (size, block)) - 1, vocab - 1).astype(np.int64))
    stats = ClassStats(vocab, width, "cpu")

    def step() -> None:
        with torch.no_grad():
            h = features(model, ids)
        stats.update(h.reshape(-1, width), ids[:, 1:].reshape(-1))
    return step


def timed(step, setting, seconds: float) -> tuple[list[float], str]:
    """Seconds of ``step`` over ``seconds`` under the thread policy ``setting`` (re-measured between batches as in a
    run, every second here), and what the policy chose."""
    with threads.policy(setting, interval=1.0) as p:
        step()
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 2:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            threads.tick()
        return times, p.describe()


def condition(name: str, step, settings: list, seconds: float, rounds: int) -> dict[str, float]:
    """The settings timed in alternating rounds (so a load that moves meets each alike); each one's median seconds
    per batch, and its ratio to the best."""
    load1 = os.getloadavg()[0]
    times: dict[str, list[float]] = {str(s): [] for s in settings}
    chose: dict[str, str] = {}
    for _ in range(rounds):
        for s in settings:
            t, chose[str(s)] = timed(step, s, seconds / rounds)
            times[str(s)] += t
    median = {k: statistics.median(v) for k, v in times.items()}
    best = min(median.values())
    for k, v in median.items():
        print(f"  {name:>7}  --threads {k:>4}: {v * 1e3:8.1f} ms/batch, {v / best:5.2f}x the best  "
              f"[{len(times[k])} batches; last round: {chose[k]}]", flush=True)
    print(f"  {name:>7}: load average {load1:.1f} before, {os.getloadavg()[0]:.1f} after", flush=True)
    return {k: v / best for k, v in median.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--seconds", type=float, default=6.0, help="timed seconds per setting and condition")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the settings per condition")
    p.add_argument("--busy", type=int, default=1, help="spinning processes per allowed core under load")
    p.add_argument("--limit", type=float, default=300.0, help="seconds after which a busy process ends itself")
    a = p.parse_args()
    n = max(1, int(threads.allowed_cores(threads.affinity(), threads.quota())))
    settings = [1, n, threads.AUTO] if n > 1 else [1, threads.AUTO]
    step = batch(a.width, a.layers, a.vocab, a.batch_size, a.block_size)
    print(f"{n} cores allowed (affinity {len(threads.affinity())}, cgroup quota {threads.quota()}); torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads by default; batch {a.batch_size} x {a.block_size}, "
          f"GPT-Neo width {a.width}, {a.layers} layers, vocab {a.vocab:,}", flush=True)
    ratios = {"idle": condition("idle", step, settings, a.seconds, a.rounds)}
    for name, busy in (("1 busy", 1), ("loaded", a.busy * n)) if n > 1 else (("loaded", a.busy),):
        with load(busy, a.limit):
            ratios[name] = condition(name, step, settings, a.seconds, a.rounds)
    worst = max(r[threads.AUTO] for r in ratios.values())
    print(f"default (auto) against the best setting: at most {worst:.2f}x (aim: <= 1.2x)")


if __name__ == "__main__":
    main()
