"""Every layer against the last layer alone, at the real vocabulary: ``ncanalyze extract --layers all`` and
``--layers last`` of the same checkpoint and data, as a user runs them (issue 24's own workload).

    python benchmarks/frontier.py                       # Llama shape, V = 128,256, width 128, 8 blocks, 131,072 tokens
    python benchmarks/frontier.py --train-tokens 16384 --blocks 2     # a quick run
    python benchmarks/frontier.py --state-memory 900MB                 # issue 52: every layer in several passes

The model is random-initialised from a Llama config (no download) and saved as a checkpoint; the data are Zipf(1.1)
ids mixed half and half with uniform ones (many classes first seen, a hot head), train and validation apart. Each
command runs in its own process; printed: its wall time and peak RSS (``os.wait4``), and the ratio all / last.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def checkpoint(folder: Path, vocab: int, width: int, blocks: int) -> Path:
    """A random-initialised Llama saved as a checkpoint folder."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=blocks, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=4 * width, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder / "llama")
    return folder / "llama"


def data(folder: Path, vocab: int, n: int, name: str, rng: np.random.Generator) -> Path:
    """``n`` token ids, half Zipf(1.1) and half uniform, shuffled, as a .npy stream."""
    ids = np.concatenate([np.minimum(rng.zipf(1.1, n // 2), vocab) - 1, rng.integers(0, vocab, n - n // 2)])
    rng.shuffle(ids)
    np.save(folder / f"{name}.npy", ids.astype(np.int32))
    return folder / f"{name}.npy"


def run(args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (GB) of ``ncanalyze extract ARGS`` in its own process."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", "from ncanalyze.cli.main import main; main()", "extract", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(out[-2000:])
    return time.perf_counter() - started, usage.ru_maxrss / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--train-tokens", type=int, default=131_072)
    p.add_argument("--val-tokens", type=int, default=8_192)
    p.add_argument("--samples-per-class", type=int, default=2)
    p.add_argument("--state-memory", help="extract's --state-memory for both runs (e.g. 900MB; default: its own)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder, rng = Path(tmp), np.random.default_rng(0)
        model = checkpoint(folder, a.vocab, a.width, a.blocks)
        train, val = data(folder, a.vocab, a.train_tokens, "train", rng), data(folder, a.vocab, a.val_tokens,
                                                                               "validation", rng)
        common = ["--dataset", str(train), "--val-dataset", str(val), "--samples-per-class", str(a.samples_per_class),
                  "--block-size", "256", "--batch-size", "8"]
        common += ["--state-memory", a.state_memory] if a.state_memory else []
        took = {}
        for layers in ("all", "last"):
            secs, rss = run([str(model), *common, "--store", str(folder / f"{layers}.zarr"), "--layers", layers])
            took[layers] = secs
            print(f"--layers {layers}: {secs:.1f} s, peak RSS {rss:.2f} GB", flush=True)
        print(f"V = {a.vocab:,}, width {a.width}, {a.blocks} blocks ({a.blocks + 1} hidden states), "
              f"{a.train_tokens:,} train + {a.val_tokens:,} validation tokens: all / last = "
              f"{took['all'] / took['last']:.2f}")


if __name__ == "__main__":
    main()
