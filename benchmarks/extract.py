"""Extraction throughput over a bare forward pass of the same model, batch and device.

    python benchmarks/extract.py                       # width-256 GPT-Neo, GPT-2 vocabulary (50,257)
    python benchmarks/extract.py --text ../shared/data/kjv.txt --tokenizer ../shared/data/gpt2-tokenizer

Prints tokens/s of ``ncanalyze``'s train pass (features, float64 Chan statistics with the pooled
within-class covariance, reservoir) and of two baselines measured in the same run on the same
batches: the causal-LM forward (``model(ids)``, logits included: what a training or eval step does)
and the base-model forward alone (no output layer). Medians of --repeats alternating runs.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import GPTNeoConfig, GPTNeoForCausalLM

from ncanalyze.store.data import open_blocks
from ncanalyze.store.passes import Extraction, train_pass
from ncanalyze.store.resume import Saver


def tokens(args, vocab: int) -> np.ndarray:
    if args.text:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        text = Path(args.text).read_text()[: args.tokens * 6]
        return np.array(tok(text)["input_ids"][: args.tokens], dtype=np.int64)
    rng = np.random.default_rng(0)  # Zipf-like ids: a realistic number of distinct classes per batch
    return np.minimum(rng.zipf(1.2, args.tokens) - 1, vocab - 1).astype(np.int64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=65536, help="train tokens per timed run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samples-per-class", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--text", help="a text file to tokenize (else Zipf-distributed random ids)")
    p.add_argument("--tokenizer", help="tokenizer folder for --text")
    args = p.parse_args()

    torch.manual_seed(0)
    config = GPTNeoConfig(vocab_size=args.vocab, hidden_size=args.width, num_layers=args.layers, num_heads=8,
                          attention_types=[[["global", "local"], args.layers // 2]], max_position_embeddings=2048,
                          intermediate_size=4 * args.width)
    device = torch.device(args.device)
    model = GPTNeoForCausalLM(config).to(device).eval()
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "train.npy"
        np.save(ids_file, tokens(args, args.vocab))
        blocks = open_blocks(str(ids_file), "train", args.block_size, args.tokens, "text", None)
        batches = list(blocks.batches(args.batch_size))
        n_tok = sum(b.shape[0] * (b.shape[1] - 1) for b in batches)

        @torch.inference_mode()
        def forward(fn) -> float:
            t0 = time.perf_counter()
            for b in batches:
                fn(torch.from_numpy(b).to(device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        def ours() -> float:
            ex = Extraction(args.vocab, args.width, args.samples_per_class, 0, device)
            saver = Saver(Path(tmp) / "state.npz", dict, every=1e9)
            t0 = time.perf_counter()
            train_pass(model, blocks, ex, args.batch_size, saver, "bench")
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        forward(model)  # warm-up
        times = {"extract": [], "causal-LM forward": [], "base-model forward": []}
        for _ in range(args.repeats):
            times["extract"].append(ours())
            times["causal-LM forward"].append(forward(model))
            times["base-model forward"].append(forward(model.base_model))
    rate = {k: n_tok / statistics.median(v) for k, v in times.items()}
    print(f"GPT-Neo width {args.width}, {args.layers} layers, vocab {args.vocab:,}, batch {args.batch_size} x "
          f"{args.block_size}, {n_tok:,} tokens, {device}, median of {args.repeats}")
    for k, r in rate.items():
        print(f"  {k:>20}: {r:>10,.0f} tokens/s")
    print(f"ratio extract / causal-LM forward: {rate['extract'] / rate['causal-LM forward']:.2f}  (target >= 0.9)")
    print(f"ratio extract / base-model forward: {rate['extract'] / rate['base-model forward']:.2f}")


if __name__ == "__main__":
    main()
