"""Extraction at every layer (``--layers all``) over a bare forward pass that forms the same hidden states.

    python benchmarks/extract_layers.py                 # width-256, 4-layer GPT-Neo, GPT-2 vocabulary: 5 layers kept

Prints tokens/s of the layered train pass (one forward with ``output_hidden_states=True``; per layer the float64
Chan statistics with the pooled within-class covariance, and the reservoir) and of the base model's forward with
``output_hidden_states=True`` alone, on the same batches; medians of --repeats alternating runs, and their ratio.
Beside benchmarks/extract.py (the last layer only), with the same model and data.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import GPTNeoConfig, GPTNeoForCausalLM

from ncanalyze.store.data import open_blocks
from ncanalyze.store.layers import plan
from ncanalyze.store.passes import run_passes
from ncanalyze.store.resume import Saver
from ncanalyze.store.running import Extraction

sys.path.insert(0, str(Path(__file__).parent))
from extract import tokens  # noqa: E402  (the same Zipf-like ids, or a tokenized text)


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
    p.add_argument("--layers-per-pass", type=int, default=0, help="0: every layer in one pass")
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
    layered = plan("all", args.layers_per_pass, 0, "float32", args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "train.npy"
        np.save(ids_file, tokens(args, args.vocab, args.tokens))
        blocks = open_blocks(str(ids_file), "train", args.block_size, args.tokens, "text", None)
        batches = list(blocks.batches(args.batch_size))
        n_tok = sum(b.shape[0] * (b.shape[1] - 1) for b in batches)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()

        @torch.inference_mode()
        def forward() -> float:
            t0 = time.perf_counter()
            for b in batches:
                model.base_model(input_ids=torch.from_numpy(b).to(device), output_hidden_states=True)
            sync()
            return time.perf_counter() - t0

        def ours() -> float:
            ex = Extraction(layered, args.vocab, args.width, args.samples_per_class, 0, device, Path(tmp) / "stage")
            ex.start()
            saver = Saver(Path(tmp) / "state.npz", dict, every=1e9)
            t0 = time.perf_counter()
            run_passes(model, blocks, None, ex, model.get_output_embeddings().weight, None, 1, args.batch_size, saver,
                       "bench")
            sync()
            return time.perf_counter() - t0

        forward()  # warm-up
        times = {"extract --layers all": [], "forward, hidden states": []}
        for _ in range(args.repeats):
            times["extract --layers all"].append(ours())
            times["forward, hidden states"].append(forward())
    rate = {k: n_tok / statistics.median(v) for k, v in times.items()}
    print(f"GPT-Neo width {args.width}, {args.layers} layers ({len(layered.layers)} hidden states kept, "
          f"{len(layered.passes)} pass(es)), vocab {args.vocab:,}, batch {args.batch_size} x {args.block_size}, "
          f"{n_tok:,} tokens, {device}, median of {args.repeats}")
    for k, r in rate.items():
        print(f"  {k:>24}: {r:>10,.0f} tokens/s")
    ratio = rate["extract --layers all"] / rate["forward, hidden states"]
    print(f"ratio extract --layers all / forward with output_hidden_states: {ratio:.2f} "
          f"({1 / ratio:.1f}x the forward's time)")


if __name__ == "__main__":
    main()
