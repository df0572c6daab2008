"""Every CUDA check in one command, about 5 minutes on one H200 (its checks ran there in three calls: RESULTS.md);
``--small`` runs the same code on the CPU in seconds (tests/test_gpu_script.py runs it, so the script cannot rot).

    python benchmarks/gpu.py                    # on the GPU: prints the ratios, writes gpu.json
    python benchmarks/gpu.py --small --out /tmp/gpu.json      # the same checks, tiny shapes, CPU

The checks, each with its peak memory (torch's peak allocated on CUDA, the process's peak RSS on the CPU):

1. ``extract_bf16``: the extraction of the last layer (float64 statistics, reservoir; ``--folds 1``: the default's
   8 fold sums are ``folds_1b``'s) of a Llama of the published 1B shape (benchmarks/extract_layers.py's ``--preset
   llama-3.2-1b``), bf16, against the bare forward of its base model on the same batches (target >= 0.9);
2. ``layers_8b``: every layer of a Llama-3.1-8B-shaped model (random weights, built from its config: no download),
   bf16, in the passes ``--layers-per-pass auto`` picks on this device (memory.fit_plan), against the forward: the
   ratio per pass (target >= 0.5, at most 3 passes on an 80 GB GPU), timed on auto's last pass (the widest, the whole
   forward) alone, since staging the earlier passes' layers (4.3 GB each) outgrows the GPU machine's 64 GiB disk;
3. ``folds_1b``: the same extraction of the 1B shape with ``--folds 8`` (extract's default: the fold sums of the
   jackknife beside the totals) against ``--folds 1``, alternating on the same batches: the train pass's ratio
   (goal <= 1.10; a whole checkpoint adds the validation pass and the write, the same at any F save the write);
4. ``metrics``: the whole metric suite at K = 128,256 classes and d = 4,096 in torch float64 on the device against one
   float64 Gram M M^T of the centred means (benchmarks/metrics.py's ``--classes 128256 --width 4096 --cuda``; target
   <= 1.5);
5. ``agree``: ``ncanalyze extract`` (every layer, the default folds, NC4's validation pass) and ``ncanalyze measure``
   of one tiny GPT-Neo in float64 on ``--device`` and on the CPU: every array and numeric attribute of the two
   stores equal (integers exactly, floats to 1e-9 relative), the CUDA path's correctness on the real commands.

Ratios are medians of ``--repeats`` alternating runs; the JSON holds every time, ratio, peak and shape.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
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
FULL = {"agree": (64, 2, 512, 8192),
        "extract_bf16": ("llama-3.2-1b", 1, None, 65536, 3), "layers_8b": ("llama-3.1-8b", 1, None, 32768, 2),
        "folds_1b": ("llama-3.2-1b", 1, None, 65536, 3), "metrics": (128256, 4096, 2)}
SMALL = {"agree": (16, 2, 128, 1024),
         "extract_bf16": ("llama-3.2-1b", 64, 512, 512, 2), "layers_8b": ("llama-3.1-8b", 64, 512, 512, 1),
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
           folds: tuple[int, ...] = (1,), last_pass: bool = False) -> tuple:
    """The plan auto picks here for ``which`` layers, and the times of ``repeats`` alternating runs over the same
    batches: ``extract<F>`` for each of ``folds`` (the extraction with F fold sums) and ``forward`` (the base
    model's). ``last_pass``: the extraction runs auto's last pass alone (the widest, the whole forward), not staging
    the earlier passes' layers to disk (at the 8B shape 4.3 GB a layer, more than a 64 GiB disk holds)."""
    vocab, width = model.get_output_embeddings().weight.shape
    layered = fit_plan(plan(which, "auto", 0, "float32", model.config.num_hidden_layers), vocab, width, 2, device)
    timed = dataclasses.replace(layered, groups=(layered.passes[-1],)) if last_pass else layered
    block = 256 if n_tokens >= 4096 else 64
    times: dict[str, list[float]] = {**{f"extract{f}": [] for f in folds}, "forward": []}
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "train.npy", tokens(Namespace(text=None), vocab, n_tokens))
        blocks = open_blocks(str(Path(tmp) / "train.npy"), "train", block, n_tokens, "text", None)
        runs = {}
        for f in folds:
            args = Namespace(device=str(device), which_layers=which, samples_per_class=2, batch_size=batch_size,
                             folds=f)
            runs[f"extract{f}"], runs["forward"] = timers(model, timed, args, blocks, tmp).values()
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
    last_pass = which == "all"
    layered, times = _timed(model, which, n_tokens, repeats, device, batch_size, last_pass=last_pass)
    times["extract"] = times.pop("extract1")
    ex, fw = (statistics.median(times[k]) for k in ("extract", "forward"))
    n_pass = 1 if last_pass else len(layered.passes)
    out = {"model": f"{preset}{f' / {scale}' if scale > 1 else ''}", "width": int(width), "vocab": int(vocab),
           "blocks": model.config.num_hidden_layers, "dtype": str(model.dtype).removeprefix("torch."),
           "layers": which, "passes": [[s.recorded for s in p] for p in layered.passes], "tokens": n_tokens,
           "timed": "auto's last pass alone" if last_pass else "every pass",
           "extract_s": times["extract"], "forward_s": times["forward"], "ratio_per_pass": fw * n_pass / ex,
           **peak(device)}
    if scale == 1 and preset == "llama-3.1-8b":
        out["passes_by_formula_on_80gb"] = len(passes_on_80gb(preset, 2).passes)
    print(line(name, out), flush=True)
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
    print(line("folds_1b", out), flush=True)
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
    print(line("metrics", out), flush=True)
    return out


def _store_values(path: Path) -> dict:
    """Every array (as numpy) and numeric attribute of the store at ``path``, keyed by where it lies."""
    import zarr
    out = {}
    for where, node in zarr.open_group(path, mode="r").members(max_depth=None):
        if isinstance(node, zarr.Array):
            out[where] = np.asarray(node[...])
        out.update({f"{where}@{k}": v for k, v in node.attrs.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.endswith(("_s", "seconds"))})
    return out


def agreement(spec: tuple, device: torch.device) -> dict:
    """``ncanalyze extract`` and ``measure`` of one float64 GPT-Neo on ``device`` and on the CPU, every stored number
    compared: integers must be equal, floats within 1e-9 relative (of the larger magnitude, 1e-12 absolute)."""
    from click.testing import CliRunner
    from ncanalyze.cli.main import main as cli
    from transformers import GPTNeoConfig, GPTNeoForCausalLM
    width, blocks, vocab, n_tokens = spec
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        config = GPTNeoConfig(vocab_size=vocab, hidden_size=width, num_layers=blocks, num_heads=4,
                              attention_types=[[["global", "local"], blocks // 2]], max_position_embeddings=256,
                              bos_token_id=0, eos_token_id=0)
        GPTNeoForCausalLM(config).save_pretrained(tmp / "neo")
        ids = tokens(Namespace(text=None), vocab, 2 * n_tokens)
        np.save(tmp / "train.npy", ids[:n_tokens].reshape(-1, 64))
        np.save(tmp / "val.npy", ids[n_tokens:].reshape(-1, 64))
        stores = []
        for i, where in enumerate([str(device), "cpu"]):
            store = tmp / f"{i}.zarr"
            for args in (["extract", str(tmp / "neo"), "--dataset", str(tmp / "train.npy"), "--val-dataset",
                          str(tmp / "val.npy"), "--store", str(store), "--device", where, "--dtype", "float64",
                          "--layers", "all"], ["measure", str(store), "--device", where]):
                r = CliRunner().invoke(cli, args)
                assert r.exit_code == 0, f"{' '.join(args[:2])} on {where}: {r.output[-2000:]}"
            stores.append(_store_values(store))
    a, b = stores
    worst, unequal, missing = 0.0, [], sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        x, y = np.asarray(a[key]), np.asarray(b[key])
        if x.dtype.kind in "fc":
            scale = np.maximum(np.abs(x), np.abs(y))
            rel = np.abs(x - y)[np.isfinite(scale)] / np.maximum(scale[np.isfinite(scale)], 1e-3)
            worst = max(worst, float(rel.max(initial=0.0)))
            if not (np.allclose(x, y, rtol=1e-9, atol=1e-12, equal_nan=True)):
                unequal.append(key)
        elif x.shape != y.shape or not np.array_equal(x, y):
            unequal.append(key)
    out = {"model": f"GPT-Neo width {width}, {blocks} blocks, V {vocab}, float64", "tokens": n_tokens,
           "device": str(device),
           "compared": len(set(a) & set(b)), "worst_relative": worst, "unequal": unequal, "missing": missing,
           "agree": not unequal and not missing}
    print(line("agree", out), flush=True)
    return out


def line(name: str, c: dict) -> str:
    """The line a check prints, from its JSON entry (the run's, and --summary's of a recorded JSON)."""
    gib = c.get("peak_device_bytes", c.get("peak_rss_bytes", 0)) / 2**30
    if name == "agree":
        said = "equal" if c["agree"] else "UNEQUAL " + ", ".join((c["unequal"] + c["missing"])[:12])
        return (f"agree: {c['model']}: {c['compared']} arrays and attributes of extract + measure on "
                f"{c.get('device', 'cuda')} and the CPU: {said} (worst relative difference {c['worst_relative']:.2e})")
    if name == "folds_1b":
        f8, f1 = statistics.median(c["folds8_s"]), statistics.median(c["folds1_s"])
        return (f"folds_1b: {c['model']} ({c['dtype']}, the last layer): --folds 8 {f8:.2f} s, --folds 1 {f1:.2f} s, "
                f"ratio {c['ratio']:.3f} (goal <= 1.10), peak {gib:.1f} GiB")
    if name == "metrics":
        return (f"metrics: K={c['classes']:,} d={c['width']:,}: the suite {c['metrics_s']:.2f} s, one Gram "
                f"{c['gram_s']:.2f} s, ratio {c['ratio']:.2f} (target <= 1.5), peak {gib:.1f} GiB")
    ex, fw = statistics.median(c["extract_s"]), statistics.median(c["forward_s"])
    return (f"{name}: {c['model']} ({c['dtype']}, --layers {c['layers']}, {len(c['passes'])} pass(es), timed: "
            f"{c.get('timed', 'every pass')}): extraction {ex:.2f} s, forward {fw:.2f} s, ratio per pass "
            f"{c['ratio_per_pass']:.2f} (target >= {0.5 if c['layers'] == 'all' else 0.9}), peak {gib:.1f} GiB")


def source_digest() -> str:
    """The first 12 hex digits of a sha256 over the ncanalyze package's Python files as imported (their names and
    bytes): which code a run measured, where the GPU machine's copy of the tree has no git."""
    import ncanalyze
    from ncanalyze import analyzer, cli, core, store
    h = hashlib.sha256()
    for pkg, files in [(ncanalyze, "*.py"), *((p, "**/*.py") for p in (core, analyzer, store, cli))]:
        root = Path(pkg.__file__).parent
        for f in sorted(root.glob(files)):
            h.update(f"{pkg.__name__}/{f.relative_to(root).as_posix()}\n".encode() + f.read_bytes())
    return h.hexdigest()[:12]


def summary(paths: list[str]) -> None:
    """The lines of recorded runs (their JSONs, as ``--out`` wrote them on the GPU machine), with where they ran and
    whether on this code (:func:`source_digest`)."""
    print("measured on the GPU machine named with each JSON below; printed here from those JSONs (a record's "
          "header then says when they were printed, not where they ran)")
    here = source_digest()
    for path in paths:
        result = json.loads(Path(path).read_text())
        source = result.get("source")
        code = ("code not recorded" if source is None else
                f"code {source}, {'this code' if source == here else f'not this code ({here})'}")
        print(f"{Path(path).name}: {', '.join(result['checks'])} on {result['device']}, torch {result['torch']}, "
              f"{code}")
        for name, c in result["checks"].items():
            print("  " + line(name, c))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU (the tests' run)")
    p.add_argument("--device", default=None, help="[default: cuda, cpu with --small]")
    p.add_argument("--out", default="gpu.json", help="the JSON of every figure")
    p.add_argument("--only", default="agree,extract_bf16,layers_8b,folds_1b,metrics", help="comma-separated checks")
    p.add_argument("--summary", nargs="+", metavar="JSON", help="print the lines of recorded runs' JSONs, run nothing")
    a = p.parse_args(argv)
    if a.summary:
        return summary(a.summary)
    device = torch.device(a.device or ("cpu" if a.small else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or --small on the CPU")
    sizes, started = SMALL if a.small else FULL, time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    result = {"device": name, "small": a.small, "torch": torch.__version__, "source": source_digest(), "checks": {}}
    checks = {"agree": lambda: agreement(sizes["agree"], device),
              "extract_bf16": lambda: extraction("extract_bf16", "last", sizes["extract_bf16"], device, 8),
              "layers_8b": lambda: extraction("layers_8b", "all", sizes["layers_8b"], device, 8),
              "folds_1b": lambda: fold_cost(sizes["folds_1b"], device, 8),
              "metrics": lambda: metric_suite(sizes["metrics"], device)}
    with threads.policy("auto"):
        for check in a.only.split(","):
            result["checks"][check] = checks[check]()
            Path(a.out).write_text(json.dumps(result, indent=1))  # what a time limit cuts short is kept
    result["seconds"] = time.perf_counter() - started
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{len(result['checks'])} check(s) in {result['seconds']:.0f} s on {name}; written to {a.out}")
    return result


if __name__ == "__main__":
    main()
