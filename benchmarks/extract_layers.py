"""Extraction at every layer (``--layers all``) over a bare forward pass of the same model and batches.

    python benchmarks/extract_layers.py                 # width-256, 4-layer GPT-Neo, GPT-2 vocabulary: 5 layers kept
    python benchmarks/extract_layers.py --preset llama-3.1-8b --cuda       # the real shape, bf16, on one GPU
    python benchmarks/extract_layers.py --preset llama-3.2-1b --scale 16 --samples-per-class 2 --state-memory 1GB
    python benchmarks/extract_layers.py --preset llama-3.2-1b --cuda --which-layers last    # the 1B target (>= 0.9)

``--preset`` builds a Llama of the published shape (llama-3.2-1b: width 2048, 16 blocks, 32 heads, 8 KV heads, MLP
8192; llama-3.1-8b: 4096, 32, 32, 8, 14336; vocabulary 128,256), random-initialised from its config (no download),
bf16 on CUDA; ``--scale s`` divides its width, MLP width, heads and blocks by s (at least 2 blocks, the vocabulary
kept) so it runs on a CPU. The layers are grouped by ``--layers-per-pass auto`` (memory.fit_plan, under
``--state-memory`` or the device's free memory), and the number of passes it chose is printed; with ``--preset``, also
the passes ``auto`` would choose for the full shape on one 80 GB GPU, by the memory formula (on any device).

Prints tokens/s of the extraction (every pass's train pass: a forward cut at the pass's deepest layer, per layer the
float64 Chan statistics and the reservoir), per pass (tokens x passes / time), and of the base model's forward alone
(no hidden states, as the model is run for its logits less the head) on the same batches; medians of --repeats
alternating runs, and the ratio per pass against the forward.
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
from ncanalyze.core.errors import UserError
from ncanalyze.store.data.blocks import open_blocks
from ncanalyze.store.extraction.layers import Plan, plan
from ncanalyze.store.extraction.memory import budget_of, fit_plan
from ncanalyze.store.extraction.passes import run_passes
from ncanalyze.store.extraction.resume import Saver
from ncanalyze.store.extraction.running import Extraction
from ncanalyze.store.extraction.settings import parse_size
from transformers import GPTNeoConfig, GPTNeoForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from extract import tokens  # noqa: E402  (the same Zipf-like ids, or a tokenized text)

# the published shapes: width, blocks, heads, KV heads, MLP width, vocabulary
PRESETS = {"llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256), "llama-3.1-8b": (4096, 32, 32, 8, 14336, 128256)}


def build(args) -> tuple[torch.nn.Module, str]:
    """The model (random-initialised from its config, on ``args.device``) and its name."""
    if args.preset:
        width, blocks, heads, kv, mlp, vocab = PRESETS[args.preset]
        s = args.scale
        heads, kv = max(1, heads // s), max(1, kv // s)
        config = LlamaConfig(vocab_size=vocab, hidden_size=width // s, num_hidden_layers=max(2, blocks // s),
                             num_attention_heads=heads, num_key_value_heads=kv if heads % kv == 0 else heads,
                             intermediate_size=mlp // s, max_position_embeddings=8192, tie_word_embeddings=False)
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model = LlamaForCausalLM(config).to(device=args.device, dtype=dtype).eval()
        name = f"{args.preset}{f' / {s}' if s > 1 else ''} (Llama, {dtype})"
        return model, name
    config = GPTNeoConfig(vocab_size=args.vocab, hidden_size=args.width, num_layers=args.layers, num_heads=8,
                          attention_types=[[["global", "local"], args.layers // 2]], max_position_embeddings=2048,
                          intermediate_size=4 * args.width)
    return GPTNeoForCausalLM(config).to(args.device).eval(), "GPT-Neo"


def passes_on_80gb(preset: str, samples_per_class: int) -> Plan:
    """The passes ``--layers all --layers-per-pass auto`` chooses for the preset's full shape on one 80 GiB GPU, by
    memory.state_bytes: the bf16 weights (counted on a meta-device model: nothing is allocated) and state_budget's
    margin taken from 80 GiB, the reservoirs in the host's memory (128 GiB, as the H100 machines here have)."""
    width, blocks, heads, kv, mlp, vocab = PRESETS[preset]
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=blocks, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=mlp, tie_word_embeddings=False)
    with torch.device("meta"):
        weights = 2 * sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    return fit_plan(plan("all", "auto", 0, "float32", blocks), vocab, width, samples_per_class, torch.device("cuda"),
                    budget_of(80 * 2**30 - weights), budget_of(128 * 2**30))


def timers(model, layered: Plan, args, blocks, tmp: str) -> dict:
    """The two timed runs over the same batches: the extraction's passes, and the base model's forward alone."""
    device = torch.device(args.device)
    batches = list(blocks.batches(args.batch_size))
    vocab, width = model.get_output_embeddings().weight.shape

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def forward() -> float:
        t0 = time.perf_counter()
        for b in batches:
            model.base_model(input_ids=torch.from_numpy(b).to(device))
        sync()
        return time.perf_counter() - t0

    def ours() -> float:
        ex = Extraction(layered, vocab, width, args.samples_per_class, 0, device, Path(tmp) / "stage",
                        folds=args.folds)
        ex.start()
        saver = Saver(Path(tmp) / "state.npz", dict, every=1e9)
        t0 = time.perf_counter()
        run_passes(model, blocks, None, ex, model.get_output_embeddings().weight, None, 1, args.batch_size, saver,
                   "bench")
        sync()
        took = time.perf_counter() - t0
        del ex
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return took

    fw = "forward (bf16 on CUDA)" if device.type == "cuda" else "forward"
    return {f"extract --layers {args.which_layers}": ours, fw: forward}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="a Llama of this published shape (else a GPT-Neo)")
    p.add_argument("--scale", type=int, default=1, help="with --preset: divide width, MLP, heads and blocks by this")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=65536, help="train tokens per timed run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samples-per-class", type=int, default=8)
    p.add_argument("--folds", type=int, default=1, help="fold sums beside the totals (extract's default is 8; the "
                   "figures in the README were taken at 1)")
    p.add_argument("--which-layers", choices=("all", "last"), default="all",
                   help="the layers extracted: all (default) or last (the default extraction, e.g. the 1B target)")
    p.add_argument("--layers-per-pass", default="auto", help="auto (default) or layers per pass")
    p.add_argument("--state-memory", help="auto's budget, e.g. 40GB (default: the device's free memory less a margin)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cuda", action="store_const", const="cuda", dest="device", help="--device cuda")
    p.add_argument("--text", help="a text file to tokenize (else Zipf-distributed random ids)")
    p.add_argument("--tokenizer", help="tokenizer folder for --text")
    args = p.parse_args()

    torch.manual_seed(0)
    model, name = build(args)
    vocab, width = model.get_output_embeddings().weight.shape
    blocks_n = model.config.num_hidden_layers
    per_pass = args.layers_per_pass if args.layers_per_pass == "auto" else int(args.layers_per_pass)
    try:
        layered = fit_plan(plan(args.which_layers, per_pass, 0, "float32", blocks_n), vocab, width,
                           args.samples_per_class,
                           torch.device(args.device), parse_size(args.state_memory))
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "train.npy"
        np.save(ids_file, tokens(args, vocab, args.tokens))
        blocks = open_blocks(str(ids_file), "train", args.block_size, args.tokens, "text", None)
        n_tok = sum(b.shape[0] * (b.shape[1] - 1) for b in blocks.batches(args.batch_size))
        runs = timers(model, layered, args, blocks, tmp)
        runs_fw = list(runs.values())[1]
        runs_fw()  # warm-up
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.repeats):
            for k, run in runs.items():
                times[k].append(run())
    rate = {k: n_tok / statistics.median(v) for k, v in times.items()}
    n_pass = len(layered.passes)
    print(f"{name}: width {width}, {blocks_n} blocks ({len(layered.layers)} hidden states kept), vocab {vocab:,}, "
          f"batch {args.batch_size} x {args.block_size}, {n_tok:,} tokens, {args.device}, median of {args.repeats}")
    print(f"  passes: {n_pass} (--layers-per-pass {args.layers_per_pass}: "
          f"{'; '.join(','.join(map(str, q)) for q in layered.passes)})")
    if args.preset:
        full = passes_on_80gb(args.preset, args.samples_per_class)
        print(f"  on one 80 GB GPU beside a 128 GiB host, {args.preset} at its full shape, --samples-per-class "
              f"{args.samples_per_class}: {len(full.passes)} pass(es) of at most "
              f"{full.widest_pass} layers by memory.state_bytes (--layers all --layers-per-pass auto)")
    (ours, r_ours), (fw, r_fw) = rate.items()
    print(f"  {ours:>24}: {r_ours:>10,.0f} tokens/s, {r_ours * n_pass:,.0f} tokens/s per pass")
    print(f"  {fw:>24}: {r_fw:>10,.0f} tokens/s")
    print(f"ratio per pass, extraction / forward: {r_ours * n_pass / r_fw:.2f}; --layers {args.which_layers} takes "
          f"{r_fw / r_ours:.1f}x the forward's time")


if __name__ == "__main__":
    main()
