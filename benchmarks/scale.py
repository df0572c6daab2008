"""Speed-ups of extraction on a Dask cluster (a LocalCluster of --workers processes, one thread each, on this machine).

    python benchmarks/scale.py                 # --rounds 3; medians of the per-round times
    python benchmarks/scale.py --width 256 --tokens 262144

1. checkpoints as tasks: --checkpoints checkpoints on the cluster, against one local process extracting them in turn
   (torch with every core of the machine);
2. shards: one checkpoint with --shards --workers on the cluster, against the same checkpoint unsharded, both as one
   local process and as one task on the same cluster.

The checkpoints are random GPT-Neo models saved as a Trainer would (``checkpoint-N/``), the data Zipf-distributed
token ids (.npy). Workers are started and warmed (torch imported) before any timing; every round writes a fresh store.
On a machine shared with other jobs the times move with their load: quote the medians, and the load.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def make_run(root: Path, n: int, width: int, layers: int, vocab: int, tokens: int) -> tuple[Path, Path]:
    import torch
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    run = root / "neo"
    for i in range(1, n + 1):
        torch.manual_seed(i)
        config = GPTNeoConfig(vocab_size=vocab, hidden_size=width, num_layers=layers, num_heads=4,
                              attention_types=[[["global", "local"], layers // 2]], max_position_embeddings=256,
                              intermediate_size=4 * width)
        GPTNeoForCausalLM(config).save_pretrained(run / f"checkpoint-{100 * i}")
    rng = np.random.default_rng(0)
    for name, m in (("train.npy", tokens), ("val.npy", tokens // 8)):
        np.save(root / name, np.minimum(rng.zipf(1.2, m) - 1, vocab - 1).astype(np.int64))
    return run, root / "train.npy"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=131072, help="train tokens per checkpoint")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    logging.getLogger("ncanalyze").setLevel(logging.WARNING)
    os.environ.setdefault("TQDM_DISABLE", "1")

    from distributed import Client, LocalCluster
    from ncanalyze.store.extraction.settings import ExtractConfig
    from ncanalyze.store.runs.cluster import extract_on_cluster
    from ncanalyze.store.runs.local import extract

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run, train = make_run(tmp, args.checkpoints, args.width, args.layers, args.vocab, args.tokens)
        cfg = ExtractConfig(dataset=str(train), block_size=128, batch_size=8, max_val_tokens=args.tokens // 16,
                            samples_per_class=4, device="cpu")
        one = run / f"checkpoint-{100 * args.checkpoints}"
        with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None,
                          silence_logs=logging.ERROR) as lc, Client(lc) as client:
            client.run(lambda: __import__("ncanalyze.store.runs.shards"))
            address = lc.scheduler_address
            times: dict[str, list[float]] = {}
            counter = iter(range(10 ** 6))

            def timed(name, f):
                store = tmp / f"s{next(counter)}.zarr"
                t0 = time.perf_counter()
                f(store)
                times.setdefault(name, []).append(time.perf_counter() - t0)

            for _ in range(args.rounds):
                timed("checkpoints, local", lambda s: extract(run, s, cfg))
                timed("checkpoints, cluster", lambda s: extract_on_cluster([run], s, cfg, address))
                timed("one checkpoint, local", lambda s: extract(one, s, cfg))
                timed("one checkpoint, one task", lambda s: extract_on_cluster([one], s, cfg, address))
                timed("one checkpoint, shards", lambda s: extract_on_cluster([one], s, cfg, address,
                                                                             shards=args.workers))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"GPT-Neo width {args.width}, {args.layers} layers, vocab {args.vocab:,}, {args.tokens:,} train tokens per "
          f"checkpoint, {args.workers} workers x 1 thread, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"medians of {args.rounds} rounds (s)")
    for k, v in times.items():
        print(f"  {k:>26}: {med[k]:7.2f}  ({', '.join(f'{x:.2f}' for x in v)})")
    print(f"speed-up, {args.checkpoints} checkpoints as tasks vs one local process: "
          f"{med['checkpoints, local'] / med['checkpoints, cluster']:.2f}x")
    print(f"speed-up, --shards {args.workers} vs unsharded local: "
          f"{med['one checkpoint, local'] / med['one checkpoint, shards']:.2f}x; vs unsharded as one task: "
          f"{med['one checkpoint, one task'] / med['one checkpoint, shards']:.2f}x")


if __name__ == "__main__":
    main()
