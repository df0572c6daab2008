"""The extraction's up-front estimate against the time a multi-checkpoint run really takes.

    python benchmarks/estimate.py --repeats 3       # 4 checkpoints of a GPT-Neo width 128, 2 layers, vocab 8,192, CPU
    python benchmarks/estimate.py --widths 64,128,256 --repeats 3   # a mixed sweep: 3 architectures, 3 runs
    python benchmarks/estimate.py --extract-layers all --layers 4    # NC at every depth
    python benchmarks/estimate.py --load-at 0.3 --busy 2   # 2 busy processes from 30% of the predicted time on

Builds one run folder of randomly initialised checkpoints (save_pretrained, safetensors) per width and a token file,
runs ``ncanalyze extract RUN [RUN ...]`` over them in one command (the CLI, in this process), reads the number in
its one ``estimate:`` line, and prints it beside the wall time of the whole command (model loads, both passes, the
writes, the estimate's own timing of every architecture). The aim (issues 12 and 20) is within +-30%.

Under a load that changes mid-run (``--load-at F``: ``--busy`` spinning processes start at the fraction F of the
predicted time, bounded and ended with the run, Ctrl-C included), it also prints the run's refreshed estimate of the
time in all (elapsed + the time left at the run's own rate: ncanalyze.store.extraction.progress) at a quarter, half,
three quarters and the end of the actual time, each against the actual time (aim, issue 41: the refreshed figure
within 0.5-2x where the first figure, a snapshot of one batch, cannot know the load to come).
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from ncanalyze.cli.main import main as cli
from ncanalyze.store.extraction import progress
from threads import load  # benchmarks/threads.py: bounded busy processes
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
    p.add_argument("--load-at", type=float, default=None, help="start --busy spinning processes at this fraction "
                   "of the predicted time")
    p.add_argument("--busy", type=int, default=2, help="spinning processes of --load-at")
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
    said: list[float] = []  # when the estimate line came (perf_counter)

    def emit(record) -> None:
        lines.append(record.getMessage())
        if lines[-1].startswith("estimate:") and not said:
            said.append(time.perf_counter())
    handler.emit = emit
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
        with ExitStack() as stack:
            finished = threading.Event()
            stack.callback(finished.set)  # before the busy processes end: none start after the run
            if args.load_at is not None:
                threading.Thread(target=_load_later, args=(args, lines, start, stack, finished), daemon=True).start()
            cli(["extract", *command], standalone_mode=False)
            end = time.perf_counter()
            actual = end - start
    logger.removeHandler(handler)
    (line,) = [x for x in lines if x.startswith("estimate:")]  # one line over every run
    est = seconds(line)
    print(line)
    n = args.checkpoints * len(args.widths)
    print(f"{n} checkpoints (widths {', '.join(map(str, args.widths))}) x {args.train_tokens:,} train + "
          f"{args.val_tokens:,} val tokens: estimated {est:,.1f} s, took {actual:,.1f} s; estimate / actual = "
          f"{est / actual:.2f} (aim: 0.7-1.3); from the line to the end {end - said[0]:,.1f} s: "
          f"{est / (end - said[0]):.2f}", flush=True)
    _refreshed(progress.last(), actual)
    return est / actual


def _load_later(args, lines: list[str], start: float, stack: ExitStack, finished: threading.Event) -> None:
    """Once the estimate line is out, wait for ``--load-at`` of its time, then start the busy processes (ended with
    the run by ``stack``; each ends itself after twice the predicted time in any case)."""
    while not any(x.startswith("estimate:") for x in lines):
        if finished.wait(0.2):
            return
    predicted = seconds(next(x for x in lines if x.startswith("estimate:")))
    if finished.wait(max(0.0, start + args.load_at * predicted - time.perf_counter())):
        return
    stack.enter_context(load(args.busy, 2 * predicted + 60))
    print(f"[{time.perf_counter() - start:.0f} s: {args.busy} busy processes started]", flush=True)


def _refreshed(tracker, actual: float) -> None:
    """The run's refreshed estimate of the time in all at points of the actual time, against the actual time."""
    if tracker is None or not tracker.history:
        print("no refreshed estimate (the run's length is unknown)")
        return
    marks = []
    for q in (0.25, 0.5, 0.75, 1.0):
        at = [h for h in tracker.history if h[0] <= q * actual]
        if at:
            t, total = at[-1]
            marks.append(f"at {t:,.0f} s: {total:,.0f} s ({total / actual:.2f})")
    print(f"refreshed estimate of the time in all (/ actual {actual:,.0f} s): " + "; ".join(marks), flush=True)


if __name__ == "__main__":
    main()
