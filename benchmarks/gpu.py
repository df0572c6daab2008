"""Every CUDA check in one command, under 8 minutes on one H100; ``--small`` runs the same code on the CPU in seconds
(tests/test_gpu_script.py runs it, so the script cannot rot).

    python benchmarks/gpu.py                    # on the GPU: prints the ratios, writes gpu.json
    python benchmarks/gpu.py --small --out /tmp/gpu.json      # the same checks, tiny shapes, CPU

The checks, each with its peak memory (torch's peak allocated on CUDA, the process's peak RSS on the CPU):

1. ``extract_bf16``: the default extraction (the last layer: float64 statistics, reservoir) of a Llama of the
   published 1B shape (benchmarks/extract_layers.py's ``--preset llama-3.2-1b``), bf16, against the bare forward of
   its base model on the same batches (target >= 0.9);
2. ``layers_8b``: every layer of a Llama-3.1-8B-shaped model (random weights, built from its config: no download),
   bf16, in the passes ``--layers-per-pass auto`` picks on this device (memory.fit_plan), against the forward: the
   ratio per pass (target >= 0.5, at most 3 passes on an 80 GB GPU);
3. ``folds_1b``: the same extraction of the 1B shape with ``--folds 8`` (extract's default: the fold sums of the
   jackknife beside the totals) against ``--folds 1``, alternating on the same batches: the train pass's ratio
   (goal <= 1.10; a whole checkpoint adds the validation pass and the write, the same at any F save the write);
4. ``metrics``: the whole metric suite at K = 128,256 classes and d = 4,096 in torch float64 on the device against one
   float64 Gram M M^T of the centred means (benchmarks/metrics.py's ``--classes 128256 --width 4096 --cuda``; target
   <= 1.5).

Ratios are medians of ``--repeats`` alternating runs; the JSON holds every time, ratio, peak and shape.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import numpy as np
import torch
from ncanalyze.analyzer.metrics import measure
from ncanalyze.core import threads
from ncanalyze.store.data.blocks import open_blocks
from ncanalyze.store.extraction.layers import plan
from ncanalyze.store.extraction.memory import fit_plan
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from extract import tokens  # noqa: E402  (Zipf-like ids)
from extract_layers import PRESETS, passes_on_80gb, timers  # noqa: E402
from metrics import checkpoint, device_gram, ratios  # noqa: E402

# (check: preset, scale, vocabulary [None: the preset's], tokens, repeats) at full size and --small
FULL = {"extract_bf16": ("llama-3.2-1b", 1, None, 65536, 3), "layers_8b": ("llama-3.1-8b", 1, None, 32768, 2),
        "folds_1b": ("llama-3.2-1b", 1, None, 65536, 3), "metrics": (128256, 4096, 2)}
SMALL = {"extract_bf16": ("llama-3.2-1b", 64, 512, 512, 2), "layers_8b": ("llama-3.1-8b", 64, 512, 512, 1),
         "folds_1b": ("llama-3.2-1b", 64, 512, 512, 2), "metrics": (384, 16, 1)}


def build(preset: str, scale: int, vocab: int | None, device: torch.device) -> LlamaForCausalLM:
    """A Llama of ``preset``'s published shape divided by ``scale`` (extract_layers' rule: width, MLP, heads and
    blocks, at least 2 blocks), random weights from its config; bf16 on CUDA, float32 on the CPU."""
    width, blocks, heads, kv, mlp, full_vocab = PRESETS[preset]
    heads, kv = max(1, heads // scale), max(1, kv // scale)
    config = LlamaConfig(vocab_size=vocab or full_vocab, hidden_size=width // scale,
                         num_hidden_layers=max(2, blocks // scale), num_attention_heads=heads,
                         num_key_value_heads=kv if heads % kv == 0 else heads, intermediate_size=mlp // scale,
                         max_position_embeddings=8192, tie_word_embeddings=False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: an 8B model made on the host would take minutes
        return LlamaForCausalLM._from_config(config, dtype=dtype).eval()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> dict:
    """The peak memory since :func:`reset_peak`: torch's allocated on CUDA; on the CPU the process's peak RSS (since
    it started: an upper bound for the check)."""
    if device.type == "cuda":
        return {"peak_device_bytes": int(torch.cuda.max_memory_allocated(device))}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if platform.system() == "Darwin" else 1024)
    return {"peak_rss_bytes": int(rss)}


def _timed(model, which: str, n_tokens: int, repeats: int, device: torch.device, batch_size: int,
           folds: tuple[int, ...] = (1,)) -> tuple:
    """The plan auto picks here for ``which`` layers, and the times of ``repeats`` alternating runs over the same
    batches: ``extract<F>`` for each of ``folds`` (the extraction with F fold sums) and ``forward`` (the base
    model's)."""
    vocab, width = model.get_output_embeddings().weight.shape
    layered = fit_plan(plan(which, "auto", 0, "float32", model.config.num_hidden_layers), vocab, width, 2, device)
    block = 256 if n_tokens >= 4096 else 64
    times: dict[str, list[float]] = {**{f"extract{f}": [] for f in folds}, "forward": []}
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "train.npy", tokens(Namespace(text=None), vocab, n_tokens))
        blocks = open_blocks(str(Path(tmp) / "train.npy"), "train", block, n_tokens, "text", None)
        runs = {}
        for f in folds:
            args = Namespace(device=str(device), which_layers=which, samples_per_class=2, batch_size=batch_size,
                             folds=f)
            runs[f"extract{f}"], runs["forward"] = timers(model, layered, args, blocks, tmp).values()
        runs["forward"]()  # warm-up: kernels, the allocator
        for _ in range(repeats):
            for k, run in runs.items():
                times[k].append(run())
            threads.tick()
    return layered, times


def extraction(name: str, which: str, spec: tuple, device: torch.device, batch_size: int) -> dict:
    """Extraction of ``which`` layers (``last`` or ``all`` in the passes auto picks here) against the base model's
    forward on the same batches: the medians of ``repeats`` alternating runs, their ratio per pass."""
    preset, scale, vocab, n_tokens, repeats = spec
    reset_peak(device)
    model = build(preset, scale, vocab, device)
    vocab, width = model.get_output_embeddings().weight.shape
    layered, times = _timed(model, which, n_tokens, repeats, device, batch_size)
    times["extract"] = times.pop("extract1")
    ex, fw = (statistics.median(times[k]) for k in ("extract", "forward"))
    n_pass = len(layered.passes)
    out = {"model": f"{preset}{f' / {scale}' if scale > 1 else ''}", "width": int(width), "vocab": int(vocab),
           "blocks": model.config.num_hidden_layers, "dtype": str(model.dtype).removeprefix("torch."),
           "layers": which, "passes": [[s.recorded for s in p] for p in layered.passes], "tokens": n_tokens,
           "extract_s": times["extract"], "forward_s": times["forward"], "ratio_per_pass": fw * n_pass / ex,
           **peak(device)}
    if scale == 1 and preset == "llama-3.1-8b":
        out["passes_by_formula_on_80gb"] = len(passes_on_80gb(preset, 2).passes)
    print(f"{name}: {out['model']} ({out['dtype']}, --layers {which}, {n_pass} pass(es)): extraction "
          f"{ex:.2f} s, forward {fw:.2f} s, ratio per pass {out['ratio_per_pass']:.2f}", flush=True)
    del model
    return out


def fold_cost(spec: tuple, device: torch.device, batch_size: int) -> dict:
    """The default extraction (the last layer) with 8 fold sums against 1, alternating on the same batches: the
    medians of ``repeats`` runs, their ratio (goal <= 1.10), the peak (the F = 8 state's)."""
    preset, scale, vocab, n_tokens, repeats = spec
    reset_peak(device)
    model = build(preset, scale, vocab, device)
    vocab, width = model.get_output_embeddings().weight.shape
    _, times = _timed(model, "last", n_tokens, repeats, device, batch_size, folds=(8, 1))
    f8, f1 = (statistics.median(times[f"extract{f}"]) for f in (8, 1))
    out = {"model": f"{preset}{f' / {scale}' if scale > 1 else ''}", "width": int(width), "vocab": int(vocab),
           "dtype": str(model.dtype).removeprefix("torch."), "tokens": n_tokens, "folds8_s": times["extract8"],
           "folds1_s": times["extract1"], "ratio": f8 / f1, **peak(device)}
    print(f"folds_1b: {out['model']} ({out['dtype']}, the last layer): --folds 8 {f8:.2f} s, --folds 1 {f1:.2f} s, "
          f"ratio {out['ratio']:.3f} (goal <= 1.10)", flush=True)
    del model
    return out


def metric_suite(spec: tuple, device: torch.device) -> dict:
    """The metric suite in torch float64 on ``device`` against one float64 Gram of the centred means (metrics.py's
    ``run_torch``): medians of alternating rounds, the ratio, the peak."""
    k, d, rounds = spec
    ds = checkpoint(k, d)
    kw = {"device": str(device), "engine": "torch"}
    M = torch.as_tensor(ds["mean"].values - ds["mean"].values.mean(0), device=device)
    panel = max(1, (1 << 27 if device.type == "cuda" else 1 << 22) // k)
    measure(ds, se=False, **kw)  # warm-up: kernels, cuBLAS and cuSOLVER handles
    device_gram(M, panel)
    reset_peak(device)
    t_metrics, t_gram, ratio = ratios(lambda: measure(ds, se=False, **kw), lambda: device_gram(M, panel), rounds)
    out = {"classes": k, "width": d, "metrics_s": t_metrics, "gram_s": t_gram, "ratio": ratio, **peak(device)}
    print(f"metrics: K={k:,} d={d:,}: the suite {t_metrics:.2f} s, one Gram {t_gram:.2f} s, ratio {ratio:.2f}",
          flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU (the tests' run)")
    p.add_argument("--device", default=None, help="[default: cuda, cpu with --small]")
    p.add_argument("--out", default="gpu.json", help="the JSON of every figure")
    p.add_argument("--only", default="extract_bf16,layers_8b,folds_1b,metrics", help="comma-separated checks")
    a = p.parse_args(argv)
    device = torch.device(a.device or ("cpu" if a.small else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or --small on the CPU")
    sizes, started = SMALL if a.small else FULL, time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    result = {"device": name, "small": a.small, "torch": torch.__version__, "checks": {}}
    checks = {"extract_bf16": lambda: extraction("extract_bf16", "last", sizes["extract_bf16"], device, 8),
              "layers_8b": lambda: extraction("layers_8b", "all", sizes["layers_8b"], device, 8),
              "folds_1b": lambda: fold_cost(sizes["folds_1b"], device, 8),
              "metrics": lambda: metric_suite(sizes["metrics"], device)}
    with threads.policy("auto"):
        for check in a.only.split(","):
            result["checks"][check] = checks[check]()
    result["seconds"] = time.perf_counter() - started
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{len(result['checks'])} check(s) in {result['seconds']:.0f} s on {name}; written to {a.out}")
    return result


if __name__ == "__main__":
    main()
