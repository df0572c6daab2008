"""Marginal extraction throughput against the bare forward pass of the same model, batch and device.

    python benchmarks/extract.py                      # GPT-Neo width 256, 2 layers, vocab 50,257, batch 16 x 256, CPU
    python benchmarks/extract.py --cuda               # width 1024, 12 layers, --device cuda --dtype bfloat16
    python benchmarks/extract.py --text ../shared/data/kjv.txt --tokenizer ../shared/data/gpt2-tokenizer

Each contender runs twice per repeat, over a short and a long prefix of the same batches; the time of the short run is
subtracted from the long one's, so start-up (allocations, first-call costs, the reservoir's first fills) and fixed
costs cancel, and the marginal rate is tokens / seconds of the difference, with the minimum time of each length over
--repeats (the least disturbed by other load on a shared machine); and, the figure the targets are read on, the median
over the --repeats rounds of each round's ratio (the contenders alternate within a round, so a burst of load hits
them alike). Contenders, on the same batches:

- ``extract``: ncanalyze's train pass (features; float64 Chan statistics with the pooled within-class covariance, at
  ``--folds`` 8 by default as ``ncanalyze extract``: the fold sums, the totals made from them; the reservoir), as
  ``ncanalyze extract`` runs it (``--parts``: first, where a batch's time goes);
- ``extract, shard``: the same pass as one shard of a ``--shards`` run (it starts at a batch offset, positions
  global) plus the merge of its state into another (``merge_states``), the cluster's code path;
- ``base-model forward``: ``model.transformer(ids)`` alone (no output layer), the reference (target >= 0.9);
- ``causal-LM forward``: ``model(ids)`` with the 50,257-way logits, for scale.

``--validation`` times the validation pass instead (``val_pass`` as ``ncanalyze extract`` runs it at the default
last layer: NC4's decisions over the kept classes and over each NC4_MIN_COUNTS kept set, their fold counts, the model's
loss), after one train pass over ``--train-batches`` batches of half Zipf, half uniform ids (the kept classes: ~45,000
of 50,257 at the default 40), against ``causal-LM forward`` (target >= 0.5, issue 52); beside them ``floor``,
the features, their float64 head logits (in the loss's chunks) with their log-sum-exp, and one float32 product of
every token with every kept class mean (the nearest-mean screen's GEMM) alone: the ratio no validation pass that keeps val_loss in float64
and NC4's decisions exact can pass on this machine.

Every contender runs under the thread policy (``--threads``, default auto), ``--conditions quiet,loaded`` times them
without and with busy processes of our own on every allowed core.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from ncanalyze.analyzer.screen import cache_step
from ncanalyze.core import threads
from ncanalyze.store.data.blocks import open_blocks
from ncanalyze.store.extraction.layers import plan
from ncanalyze.store.extraction.loss import CELLS
from ncanalyze.store.extraction.passes import train_pass, val_pass
from ncanalyze.store.extraction.resume import Phase, Saver
from ncanalyze.store.extraction.running import Extraction, LayerState
from ncanalyze.store.runs.shards import merge_states, shard_state
from ncanalyze.store.sources.anatomy import features, head
from threads import load  # benchmarks/threads.py: bounded busy processes
from transformers import GPTNeoConfig, GPTNeoForCausalLM


def tokens(args, vocab: int, n: int, uniform: float = 0.0) -> np.ndarray:
    """``n`` token ids: of --text, else Zipf-like ids with a share ``uniform`` drawn uniformly over the vocabulary."""
    if args.text:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        text = Path(args.text).read_text()[: n * 6]
        return np.array(tok(text)["input_ids"][:n], dtype=np.int64)
    rng = np.random.default_rng(0)  # Zipf-like ids: a realistic number of distinct classes per batch
    ids = np.minimum(rng.zipf(1.2, n) - 1, vocab - 1).astype(np.int64)
    flat = rng.random(n) < uniform
    ids[flat] = rng.integers(0, vocab, int(flat.sum()))
    return ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--short", type=int, default=3, help="batches of the short run")
    p.add_argument("--long", type=int, default=11, help="batches of the long run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--samples-per-class", type=int, default=8)
    p.add_argument("--folds", type=int, default=8, help="--folds of the extraction (default 8, ncanalyze's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--cuda", action="store_true", help="the GPU setting: width 1024, 12 layers, --device cuda "
                   "--dtype bfloat16, 40 and 120 batches")
    p.add_argument("--threads", default="auto", help="--threads of the timed work (auto: the thread policy)")
    p.add_argument("--conditions", default="quiet", help="comma-separated: quiet (no load of ours), loaded "
                   "(--busy spinning processes per allowed core, bounded, ended by the script)")
    p.add_argument("--busy", type=int, default=1)
    p.add_argument("--parts", action="store_true", help="first, where a train batch's time goes (parts())")
    p.add_argument("--validation", action="store_true", help="time the validation pass against the causal-LM "
                   "forward (see above)")
    p.add_argument("--train-batches", type=int, default=40, help="with --validation: batches of the train pass that "
                   "sets the kept classes and their means")
    p.add_argument("--text", help="a text file to tokenize (else Zipf-distributed random ids)")
    p.add_argument("--tokenizer", help="tokenizer folder for --text")
    args = p.parse_args()
    if args.cuda:
        args.width, args.layers, args.device, args.dtype, args.short, args.long = 1024, 12, "cuda", "bfloat16", 40, 120

    torch.manual_seed(0)
    config = GPTNeoConfig(vocab_size=args.vocab, hidden_size=args.width, num_layers=args.layers, num_heads=8,
                          attention_types=[[["global", "local"], args.layers // 2]], max_position_embeddings=2048,
                          intermediate_size=4 * args.width)
    device = torch.device(args.device)
    model = GPTNeoForCausalLM(config).to(device, getattr(torch, args.dtype)).eval()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per_batch = args.batch_size * args.block_size
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "train.npy"
        np.save(ids_file, tokens(args, args.vocab, (args.long + 1) * per_batch))

        def blocks(n_batches: int):
            return open_blocks(str(ids_file), "train", args.block_size, n_batches * per_batch, "text", None)

        batches = [torch.from_numpy(b).to(device) for b in blocks(args.long).batches(args.batch_size)]
        saver = Saver(Path(tmp) / "state.npz", dict, every=float("inf"))
        empty = LayerState(args.vocab, args.width, args.samples_per_class, 0, "cpu", args.folds)
        other = shard_state({"layer-1": empty})

        @torch.inference_mode()
        def forward(fn, n: int) -> float:
            sync()
            t0 = time.perf_counter()
            for b in batches[:n]:
                fn(b)
            sync()
            return time.perf_counter() - t0

        def extract(n: int, shard: bool = False) -> float:
            ex = Extraction(plan(), args.vocab, args.width, args.samples_per_class, 0, device, folds=args.folds)
            data = blocks(n + shard)
            if shard:  # one shard of a --shards run: it starts at an offset (n batches after it), then is merged
                ex.batches = 1
            sync()
            t0 = time.perf_counter()
            train_pass(model, data, ex, args.batch_size, saver, "bench")
            if shard:
                merge_states(shard_state({"layer-1": ex.main()}), other,
                             args.samples_per_class, 0)
            sync()
            return time.perf_counter() - t0

        def validation() -> Callable[[int], float]:
            """The validation pass over n batches, after one train pass (the kept classes, their means)."""
            np.save(Path(tmp) / "fit.npy", tokens(args, args.vocab, args.train_batches * per_batch, uniform=0.5))
            fit = open_blocks(str(Path(tmp) / "fit.npy"), "train", args.block_size,
                              args.train_batches * per_batch, "text", None)
            ex = Extraction(plan(), args.vocab, args.width, args.samples_per_class, 0, device, folds=args.folds)
            train_pass(model, fit, ex, args.batch_size, saver, "bench")
            classifier, bias = head(model)
            print(f"[validation: {int((ex.first().stats.count >= 1).sum()):,} kept classes, folds {args.folds}]")
            kept32.append(ex.first().stats.mean[ex.first().stats.count >= 1].float())

            def run(n: int) -> float:
                ex.next_phase(Phase.VALIDATION)
                sync()
                t0 = time.perf_counter()
                val_pass(model, blocks(n), ex, classifier, bias, 1, args.batch_size, saver, "bench")
                sync()
                return time.perf_counter() - t0
            return run

        def floor(ids: torch.Tensor) -> None:
            """The least a validation pass with the float64 loss and NC4's exact decisions does: the features, their
            float64 head logits in the loss's chunks (loss.CELLS) and their log-sum-exp (the loss's own in-place
            arithmetic), and one float32 score per token and kept class (the nearest-mean screen's product, in its
            cache steps); no topk, no recheck, no jackknife replicate."""
            h = features(model, ids).reshape(-1, args.width).double()
            step = max(1, CELLS // len(w64))
            for s in range(0, len(h), step):
                z = torch.addmm(b64, h[s:s + step], w64.T) if b64 is not None else h[s:s + step] @ w64.T
                z.sub_(z.amax(1, keepdim=True)).exp_().sum(1).log_()
            h32, means = h.float(), kept32[0]
            for a in range(0, len(h32), max(1, (1 << 25) // len(means))):
                x = h32[a:a + (1 << 25) // len(means)]
                step = cache_step(len(x), len(means), h.device)
                for s in range(0, len(means), step):
                    x @ means[s:s + step].T

        if args.validation:
            w64, b64 = (None if t is None else t.double() for t in head(model))
            kept32: list[torch.Tensor] = []
            best = timed({"validation pass": validation(), "causal-LM forward": lambda n: forward(model, n),
                          "floor": lambda n: forward(floor, n)}, args)
            report_validation(best, args, device)
            return
        contenders = {
            "extract": extract,
            "extract, shard": lambda n: extract(n, shard=True),
            "base-model forward": lambda n: forward(model.transformer, n),
            "causal-LM forward": lambda n: forward(model, n),
        }
        if args.parts:
            with threads.policy(args.threads):
                parts(model, batches, args, device, sync)
        for condition in filter(None, args.conditions.split(",")):  # "": the parts alone
            with ExitStack() as stack:
                if condition == "loaded":
                    stack.enter_context(load(args.busy * int(threads.allowed_cores(threads.affinity(),
                                                                                   threads.quota())), 1800))
                policy = stack.enter_context(threads.policy(args.threads))
                best = timed(contenders, args)
                print(f"[{condition}: {policy.describe()}; load average {os.getloadavg()[0]:.1f}]")
            report(best, args, device)


@torch.inference_mode()
def parts(model, batches: list, args, device, sync) -> None:
    """Where a train batch's time goes, against the base-model forward timed on the same batch just before (so a
    burst of load hits both alike): the extraction's forward (features), then the batch's accumulators as the train
    pass runs them (``passes.batch_tasks`` on ``workers.Workers``: with folds, each fold's sums, and the reservoir, at
    once on the cores the thread policy gives), and, each on a state of its own through the same workers, the
    statistics alone (with folds: the fold sums alone) and the reservoir alone; for comparison, the totals updated
    batch by batch beside the fold sums (``ClassStats.update`` and ``FoldStats.update`` in the caller, as the pass did
    before issue 52); medians over the batches after the first two, each a share of the forward's median. The totals
    made from the folds (once a pass and at each state save) are timed after the last batch, as a share of one
    batch's forward."""
    from ncanalyze.analyzer.accumulate import ClassStats, FoldStats, Groups, fold_of
    from ncanalyze.store.extraction.passes import batch_tasks
    from ncanalyze.store.extraction.workers import Workers

    def state() -> Extraction:
        return Extraction(plan(), args.vocab, args.width, args.samples_per_class, 0, device, folds=args.folds)

    pass_, alone = state(), state()
    totals, folds = ClassStats(args.vocab, args.width, device), FoldStats(max(2, args.folds), args.vocab, args.width,
                                                                           device)
    took: dict[str, list[float]] = {}

    def clock(name: str, fn):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        took.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    L = args.block_size
    with Workers(device) as run:
        for i, b in enumerate(batches):
            clock("base-model forward", lambda: model.transformer(b))
            h = clock("features (the extraction's forward)", lambda: features(model, b)).reshape(1, -1, args.width)
            y = b[:, 1:].reshape(-1)
            fold = fold_of(i * args.batch_size, len(b), L - 1, args.folds, device) if args.folds > 1 else None
            pos = ((i * args.batch_size + np.arange(len(b)))[:, None] * L + np.arange(L - 1)).ravel()
            ys = y.cpu().numpy()
            clock("accumulators (as the train pass runs them)", lambda: run(batch_tasks(pass_, h, y, fold, ys, pos)))
            tasks = batch_tasks(alone, h, y, fold, ys, pos)
            clock("statistics alone (with folds: fold sums)", lambda: run(tasks[1:]))
            clock("reservoir alone", lambda: run(tasks[:1]))
            if fold is not None:
                clock("totals beside the folds (before)", lambda: (totals.update(h[0], y, Groups(y)),
                                                                   folds.update(h[0], y, fold)))
    clock("totals from the folds (once)", lambda: pass_.first().stats)
    base = np.median(took["base-model forward"][2:])
    print(f"parts of a train batch ({len(batches)} batches, --folds {args.folds}, {torch.get_num_threads()} "
          f"thread(s)), medians against the base-model forward's {base * 1e3:.0f} ms; load average "
          f"{os.getloadavg()[0]:.1f}")
    for name, t in took.items():
        print(f"  {name:>42}: {np.median(t[2:] or t) * 1e3:8.1f} ms  {np.median(t[2:] or t) / base:6.3f}")
    forward, base_t = (np.array(took[k][2:]) for k in ("features (the extraction's forward)", "base-model forward"))
    acc = np.array(took["accumulators (as the train pass runs them)"][2:])
    share = np.median(acc / base_t)
    # the extraction's forward is the base model's own call: the ratio is the accumulators' share of it, read per
    # batch against the forward timed just before (the two forwards' own difference is noise, not cost)
    print(f"  accumulators (as the train pass runs them) / base-model forward, median per batch: {share:.3f}; the "
          f"train pass / base-model forward they imply, 1 / (1 + share): {1 / (1 + share):.3f}  (target >= 0.9)")
    ratio = base_t / (forward + acc)  # each batch's own ratio, then their median: a burst of load is one batch's
    print(f"  train batch (features and accumulators) / base-model forward, median of per-batch ratios: "
          f"{np.median(ratio):.3f}")
    noise = base_t / forward  # the same call twice: its spread is this line's noise, not a cost
    print(f"  the noise in that ratio: base-model forward / features (the same call), per batch from "
          f"{noise.min():.3f} to {noise.max():.3f}, median {np.median(noise):.3f}")


def timed(contenders: dict, args) -> dict:
    """The minimum seconds of each contender over the short and the long run, alternating over --repeats; under
    ``"rounds"``, each round's marginal seconds (long - short) per contender, for the median of per-round ratios."""
    for f in contenders.values():  # warm-up
        f(args.short)
        threads.tick()
    best = {k: {args.short: float("inf"), args.long: float("inf")} for k in contenders}
    rounds = []
    for _ in range(args.repeats):  # alternate, so that a burst of load hits every contender alike
        took = {}
        for k, f in contenders.items():
            for n in (args.short, args.long):
                took[k, n] = f(n)
                best[k][n] = min(best[k][n], took[k, n])
                threads.tick()
        rounds.append({k: took[k, args.long] - took[k, args.short] for k in contenders})
    return best | {"rounds": rounds}


def per_round(best: dict, a: str, b: str) -> str:
    """The median over rounds of each round's ratio of rates a / b (a round's marginal seconds of b over a's), and
    the rounds' range."""
    r = np.array([t[b] / t[a] if t[a] > 0 < t[b] else np.nan for t in best["rounds"]])
    return f"median of {len(r)} rounds' ratios {np.nanmedian(r):.3f} (range {np.nanmin(r):.3f}-{np.nanmax(r):.3f})"


def rates(best: dict, args) -> dict:
    """Each contender's marginal tokens/s (nan where its longer run was not slower: noise)."""
    extra_tokens = (args.long - args.short) * args.batch_size * (args.block_size - 1)
    return {k: extra_tokens / (t[args.long] - t[args.short]) if t[args.long] > t[args.short] else float("nan")
            for k, t in best.items() if k != "rounds"}


def report_validation(best: dict, args, device) -> None:
    """The validation pass's marginal rate against the causal-LM forward's."""
    rate = rates(best, args)
    print(f"GPT-Neo width {args.width}, {args.layers} layers, vocab {args.vocab:,}, batch {args.batch_size} x "
          f"{args.block_size}, {device}, {args.dtype}; marginal over {args.long} - {args.short} batches, minimum of "
          f"{args.repeats}")
    for k, r in rate.items():
        print(f"  {k:>20}: {r:>10,.0f} tokens/s")
    print(f"ratio validation pass / causal-LM forward: {rate['validation pass'] / rate['causal-LM forward']:.3f}, "
          f"{per_round(best, 'validation pass', 'causal-LM forward')}  (target >= 0.5)")
    print(f"ratio floor / causal-LM forward: {rate['floor'] / rate['causal-LM forward']:.3f}, "
          f"{per_round(best, 'floor', 'causal-LM forward')}: the most a validation pass reaches that keeps val_loss in "
          "float64 and NC4's decisions exact (its features, float64 head logits and their log-sum-exp, and one "
          "float32 product with the kept means alone: no topk, recheck or jackknife replicate)")


def report(best: dict, args, device) -> None:
    """The marginal rates and their ratios."""
    extra_tokens = (args.long - args.short) * args.batch_size * (args.block_size - 1)
    # a longer run no slower than the shorter one leaves no marginal to measure (noise on shared cores): nan, said
    rate = rates(best, args)
    print(f"GPT-Neo width {args.width}, {args.layers} layers, vocab {args.vocab:,}, batch {args.batch_size} x "
          f"{args.block_size}, {device}, {args.dtype}, --folds {args.folds}; marginal over {args.long} - {args.short} "
          f"batches "
          f"({extra_tokens:,} tokens), minimum of {args.repeats}")
    for k, r in rate.items():
        print(f"  {k:>20}: " + (f"{r:>10,.0f} tokens/s" if r == r else "not measured: its longer run was not slower "
                                "than its shorter one (noise); run again"))
    base = rate["base-model forward"]
    for k in ("extract", "extract, shard"):
        print(f"ratio {k} / base-model forward: {rate[k] / base:.3f} (of the minima), "
              f"{per_round(best, k, 'base-model forward')}  (target >= 0.9)")
    print(f"ratio extract / causal-LM forward: {rate['extract'] / rate['causal-LM forward']:.3f}")


if __name__ == "__main__":
    main()
