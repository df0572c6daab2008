"""The extraction's up-front estimate against the time a multi-checkpoint run really takes.

    python benchmarks/estimate.py --repeats 3       # 4 checkpoints of a GPT-Neo width 128, 2 layers, vocab 8,192, CPU
    python benchmarks/estimate.py --widths 64,128,256 --repeats 3   # a mixed sweep: 3 architectures, 3 runs
    python benchmarks/estimate.py --extract-layers all --layers 4    # NC at every depth

Builds one run folder of randomly initialised checkpoints (save_pretrained, safetensors) per width and a token file,
runs ``ncanalyze extract RUN [RUN ...]`` over them in one command (the CLI, in this process), reads the number in
its one ``estimate:`` line, and prints it beside the wall time of the whole command (model loads, both passes, the
writes, the estimate's own timing of every architecture). The aim (issues 12 and 20) is within +-30%.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from ncanalyze.cli.main import main as cli
from transformers import GPTNeoConfig, GPTNeoForCausalLM


def seconds(line: str) -> float:
    """The total time in an estimate line ("~12 s in all", "~3.5 min in all", "~1.2 h in all")."""
    m = re.search(r"~([\d,.]+) (s|min|h) in all", line)
    if m is None:
        raise SystemExit(f"no time in the estimate line: {line!r}")
    return float(m.group(1).replace(",", "")) * {"s": 1, "min": 60, "h": 3600}[m.group(2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", type=int, default=None, help="per width [default: 4, 3 with several widths]")
    p.add_argument("--widths", default="128", help="comma-separated: one run of --checkpoints per width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--train-tokens", type=int, default=131072)
    p.add_argument("--val-tokens", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--extract-layers", default="last", help="ncanalyze extract's --layers (e.g. all)")
    p.add_argument("--layers-per-pass", type=int, default=None)
    p.add_argument("--repeats", type=int, default=1, help="runs; the median ratio is printed after them")
    args = p.parse_args()
    args.widths = [int(w) for w in args.widths.split(",")]
    args.checkpoints = args.checkpoints or (4 if len(args.widths) == 1 else 3)

    ratios = []
    for _ in range(args.repeats):
        ratios.append(run_once(args))
        print(f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    if len(ratios) > 1:
        print(f"estimate / actual over {len(ratios)} runs: {', '.join(f'{r:.2f}' for r in ratios)}; median "
              f"{float(np.median(ratios)):.2f} (aim: 0.7-1.3)")


def runs(args, tmp: Path) -> list[Path]:
    """One run folder of ``args.checkpoints`` random checkpoints per width, the widest first."""
    out = []
    for width in sorted(args.widths, reverse=True):
        run = tmp / f"neo-{args.layers}x{width}"
        config = GPTNeoConfig(vocab_size=args.vocab, hidden_size=width, num_layers=args.layers, num_heads=4,
                              attention_types=[[["global", "local"], args.layers // 2]],
                              max_position_embeddings=args.block_size, intermediate_size=4 * width)
        for i in range(args.checkpoints):
            torch.manual_seed(i)
            GPTNeoForCausalLM(config).save_pretrained(run / f"checkpoint-{(i + 1) * 10}")
        out.append(run)
    return out


def run_once(args) -> float:
    """One multi-checkpoint extraction: prints its estimate line and the ratio, returns estimate / actual."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("ncanalyze.store.runs.local")  # the CLI sets the handlers of "ncanalyze" itself
    logger.addHandler(handler)
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        for name, n in (("train", args.train_tokens), ("val", args.val_tokens)):
            np.save(Path(tmp) / f"{name}.npy", np.minimum(rng.zipf(1.2, n) - 1, args.vocab - 1).astype(np.int64))
        command = [*map(str, runs(args, Path(tmp))), "--dataset", str(Path(tmp) / "train.npy"),
                   "--val-dataset", str(Path(tmp) / "val.npy"), "--store", str(Path(tmp) / "s.zarr"),
                   "--block-size", str(args.block_size), "--batch-size", str(args.batch_size), "--device", "cpu",
                   "--layers", args.extract_layers]
        command += ["--layers-per-pass", str(args.layers_per_pass)] if args.layers_per_pass else []
        start = time.perf_counter()
        cli(["extract", *command], standalone_mode=False)
        actual = time.perf_counter() - start
    logger.removeHandler(handler)
    (line,) = [x for x in lines if x.startswith("estimate:")]  # one line over every run
    est = seconds(line)
    print(line)
    n = args.checkpoints * len(args.widths)
    print(f"{n} checkpoints (widths {', '.join(map(str, args.widths))}) x {args.train_tokens:,} train + "
          f"{args.val_tokens:,} val tokens: estimated {est:,.1f} s, took {actual:,.1f} s; estimate / actual = "
          f"{est / actual:.2f} (aim: 0.7-1.3)", flush=True)
    return est / actual


if __name__ == "__main__":
    main()
