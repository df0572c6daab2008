"""The delete-one-fold jackknife error, calibrated and costed.

    python benchmarks/jackknife.py calibrate CHECKPOINT TEXT [--tokenizer DIR] [--caps 20] [--cap-tokens 8192]
    python benchmarks/jackknife.py cost [--vocab 50257] [--width 256] [--batches 12] [--repeats 3]
    python benchmarks/jackknife.py whole [--vocab 50257] [--width 256] [--layers 2] [--train-tokens 131072]
                                         [--val-tokens 16384]
    python benchmarks/jackknife.py errors [--vocab 128256] [--seen 57000] [--width 128] [--folds 8] [--rounds 2]

``calibrate``: the checkpoint's last-layer features of ``caps`` disjoint caps of whole blocks of the text (independent
token samples of one checkpoint, each 80% train, 20% validation), each cap's statistics with 8 folds (class_stats, the
same accumulators as extraction) and its metrics with their jackknife errors; per metric, the mean jackknife error
over the caps divided by the standard deviation of the metric across the caps (1 is calibrated; with 20 caps the SD
itself is uncertain by about 16%, so ratios in 0.7-1.4 are consistent with 1).

``cost``: the train pass of a GPT-Neo (random weights) over the same batches with ``--folds`` 8 and 1, alternating, each
over a short and a long prefix of the batches, the minimum of ``repeats`` (the least disturbed on a shared machine): the
marginal time ratio (the short run's time subtracted, so the state's allocation, a fixed cost per checkpoint, cancels),
the share of each F = 8 pass spent inside the fold update, and the running state's bytes at F = 8 and F = 1 against what
``--state-memory`` would keep (memory.fit_folds).

``whole``: one checkpoint (a GPT-Neo with random weights, saved with ``save_pretrained``) extracted end to end as
``ncanalyze extract`` runs it (``runs.local.extract``: load, train pass, validation pass with NC4's decisions and the
loss, the group's write), with ``--folds`` 8 and 1 alternating, into a fresh store each time; the medians of
``repeats``, each part timed inside the same run (the train pass, the validation pass, the write); the goal is a
checkpoint's time at most +10% with folds. The checkpoint's ratio depends on how its tokens split between the passes:
the validation pass costs the same at any F, so the train pass's ratio is the bound as the validation tokens shrink,
printed beside it.

``errors``: what the errors cost `measure` at a Llama-shaped scale without a model: a checkpoint's fold sums planted
(Zipf counts over ``vocab`` classes, about ``seen`` of them with a train token, split over the folds at random; Gaussian
fold means around random centres; the totals merged from the folds as extraction's fold sums add up to them), then
``measure_all`` with and without ``se`` in alternating rounds (the median of the per-round ratios: the goal is <= 1.5),
the peak resident memory of each above the memory before it (sampled every 5 ms), and how the errors were made, with
each error's own sampling error where the pairs were sampled. ``python benchmarks/record.py jackknife.py errors``
records its run in benchmarks/results/jackknife.md.
"""
from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch


def _features(model, ids: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    from ncanalyze.store.sources.anatomy import features

    hs, ys = [], []
    with torch.inference_mode():
        for s in range(0, len(ids), batch):
            b = torch.from_numpy(ids[s:s + batch])
            hs.append(features(model, b).double().numpy())
            ys.append(ids[s:s + batch, 1:])
    return np.concatenate(hs), np.concatenate(ys)


def calibrate(args) -> None:
    from ncanalyze.analyzer import SCALARS, class_stats, measure
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.checkpoint)
    L = args.block_size
    stream = np.array(tok(Path(args.text).read_text())["input_ids"], dtype=np.int64)
    per_cap = -(-args.cap_tokens // (L - 1))
    need = args.caps * per_cap
    if len(stream) // L < need:
        raise SystemExit(f"{args.text} holds {len(stream) // L} blocks of {L}; {args.caps} caps of {per_cap} need {need}")
    blocks = stream[:need * L].reshape(need, L)
    h, y = _features(model, blocks, 32)
    W = model.get_output_embeddings().weight.detach().double().numpy()
    V = W.shape[0]
    values, errors = [], []
    for c in range(args.caps):
        cap_h, cap_y = h[c * per_cap:(c + 1) * per_cap], y[c * per_cap:(c + 1) * per_cap]
        n_train = int(0.8 * per_cap)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = class_stats(cap_h[:n_train].reshape(-1, h.shape[-1]), cap_y[:n_train].ravel(), V, classifier=W,
                             val_embeddings=cap_h[n_train:].reshape(-1, h.shape[-1]),
                             val_labels=cap_y[n_train:].ravel(), folds=args.folds, block_size=L - 1,
                             min_count=args.min_count)
            got = measure(ds, min_count=args.min_count, se=True, device="cpu")
        values.append([got[m] for m in SCALARS])
        errors.append([got[f"{m}_se"] for m in SCALARS])
    values, errors = np.array(values), np.array(errors)
    print(f"{args.checkpoint}: {args.caps} disjoint caps of {per_cap} blocks x {L - 1} tokens (80% train, "
          f"{int(0.8 * per_cap) * (L - 1):,} train tokens each), {args.folds} folds, min_count {args.min_count}")
    print(f"{'metric':>20} {'mean value':>12} {'SD over caps':>13} {'mean jackknife se':>18} {'ratio':>6}")
    for j, m in enumerate(SCALARS):
        sd, se = np.nanstd(values[:, j], ddof=1), np.nanmean(errors[:, j])
        ratio = se / sd if sd > 1e-9 * abs(np.nanmean(values[:, j])) else float("nan")  # a constant: no spread
        print(f"{m:>20} {np.nanmean(values[:, j]):>12.4g} {sd:>13.3g} {se:>18.3g} {ratio:>6.2f}")


def _model(args):
    """A GPT-Neo of ``args``' shape, random weights (seed 0): global and local attention alternating as in
    TinyStories' models (a last global layer where the layers are odd)."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(0)
    attention = [[["global", "local"], args.layers // 2]] + ([[["global"], 1]] if args.layers % 2 else [])
    return GPTNeoForCausalLM(GPTNeoConfig(vocab_size=args.vocab, hidden_size=args.width, num_layers=args.layers,
                                          num_heads=8, attention_types=attention, max_position_embeddings=2048,
                                          intermediate_size=4 * args.width)).eval()


def _state_bytes(ex) -> int:
    from ncanalyze.store.extraction.resume import flatten

    return sum(v.nbytes for s in ex.layers.values() for v in flatten(s.state_dict()).values())


def cost(args) -> None:
    from ncanalyze.store.data.blocks import open_blocks
    from ncanalyze.store.extraction.layers import bytes_text, plan
    from ncanalyze.store.extraction.memory import fit_folds
    from ncanalyze.store.extraction.passes import train_pass
    from ncanalyze.analyzer.accumulate import FoldStats
    from ncanalyze.store.extraction.running import Extraction
    from ncanalyze.store.extraction.resume import Saver

    model = _model(args)
    per_batch = args.batch_size * args.block_size
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.2, (args.batches + 1) * per_batch) - 1, args.vocab - 1).astype(np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "train.npy", ids)
        saver = Saver(Path(tmp) / "state.npz", dict, every=float("inf"))

        spent = {"folds": 0.0}  # seconds inside FoldStats.update, timed in the same pass as the rest
        update = FoldStats.update

        def timed(self, *a):
            t = time.perf_counter()
            update(self, *a)
            spent["folds"] += time.perf_counter() - t

        FoldStats.update = timed

        def run(folds: int, batches: int) -> tuple[float, float, int]:
            t0 = time.perf_counter()
            ex = Extraction(plan(), args.vocab, args.width, args.samples_per_class, 0, "cpu", folds=folds)
            made = time.perf_counter() - t0  # the state's allocation: a fixed cost per checkpoint
            data = open_blocks(str(Path(tmp) / "train.npy"), "train", args.block_size, batches * per_batch, "text",
                               None)
            t0 = time.perf_counter()
            train_pass(model, data, ex, args.batch_size, saver, "bench")
            return time.perf_counter() - t0, made, _state_bytes(ex)

        run(1, args.short)  # warm-up
        best = {(f, n): float("inf") for f in (8, 1) for n in (args.short, args.batches)}
        made, size, share = {8: float("inf"), 1: float("inf")}, {}, []
        for _ in range(args.repeats):  # alternate, so that a burst of load hits both alike
            for f in (8, 1):
                for n in (args.short, args.batches):
                    spent["folds"] = 0.0
                    t, m, size[f] = run(f, n)
                    best[f, n], made[f] = min(best[f, n], t), min(made[f], m)
                    if f == 8 and n == args.batches:
                        share.append(spent["folds"] / t)
        FoldStats.update = update
    marginal = {f: best[f, args.batches] - best[f, args.short] for f in (8, 1)}
    tokens = (args.batches - args.short) * args.batch_size * (args.block_size - 1)
    print(f"GPT-Neo width {args.width}, {args.layers} layers, vocab {args.vocab:,}, batch {args.batch_size} x "
          f"{args.block_size}, CPU; marginal over {args.batches} - {args.short} batches ({tokens:,} tokens), minimum "
          f"of {args.repeats}")
    for f in (1, 8):
        print(f"  --folds {f}: {tokens / marginal[f]:,.0f} tokens/s; state {bytes_text(size[f])}, allocated in "
              f"{made[f]:.2f} s (once per checkpoint)")
    print(f"  marginal time F=8 / F=1: {marginal[8] / marginal[1]:.3f} (the train pass alone; the +10% goal is a "
          f"checkpoint's: `whole`); state F=8 / F=1: {size[8] / size[1]:.2f}")
    med = float(np.median(share))
    print(f"  the fold update's share of the F=8 pass, timed inside it: median {med:.1%} over {len(share)} passes "
          f"({', '.join(f'{x:.1%}' for x in share)}), so F=8 / F=1 = 1 / (1 - share) = {1 / (1 - med):.3f} (load "
          "hits the share's two parts alike)")
    for budget in (size[1] * 2, size[8]):
        kept = fit_folds(8, args.vocab, args.width, args.samples_per_class, 1, torch.device("cpu"), budget=budget)
        print(f"  --state-memory {bytes_text(budget)}: {kept} fold(s) kept")


def whole(args) -> None:
    import logging
    import os
    import statistics

    os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is imported
    from ncanalyze.store import Store
    from ncanalyze.store.extraction import passes
    from ncanalyze.store.extraction.checkpoint import Outcome
    from ncanalyze.store.extraction.settings import ExtractConfig
    from ncanalyze.store.runs.local import extract

    logging.getLogger("ncanalyze").setLevel(logging.WARNING)
    model = _model(args)
    rng = np.random.default_rng(0)
    spent: dict[str, float] = {}

    def timed(name, f):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return run

    passes.train_pass, passes.val_pass = timed("train", passes.train_pass), timed("validation", passes.val_pass)
    Store.write_checkpoint = timed("write", Store.write_checkpoint)
    times: dict[int, list[dict[str, float]]] = {8: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model.save_pretrained(tmp / "model")
        for split, n in (("train", args.train_tokens), ("val", args.val_tokens)):
            ids = np.minimum(rng.zipf(1.2, n + args.block_size) - 1, args.vocab - 1).astype(np.int64)
            np.save(tmp / f"{split}.npy", ids)
        for r in range(args.repeats + 1):  # the first round warms up and is not counted
            for f in (8, 1):
                spent.clear()
                cfg = ExtractConfig(dataset=str(tmp / "train.npy"), val_dataset=str(tmp / "val.npy"),
                                    block_size=args.block_size, batch_size=args.batch_size, folds=f,
                                    max_train_tokens=args.train_tokens, max_val_tokens=args.val_tokens,
                                    samples_per_class=args.samples_per_class, device="cpu")
                t = time.perf_counter()
                done = extract(tmp / "model", tmp / f"s{r}-{f}.zarr", cfg)
                spent["checkpoint"] = time.perf_counter() - t
                if done.failures or done.count(Outcome.DONE) != 1:  # a time of nothing extracted is no figure
                    raise SystemExit(f"the extraction did not run: {done.summary()} {done.failures}")
                if r:
                    times[f].append(dict(spent))
    med = {f: {k: statistics.median(x[k] for x in v) for k in v[0]} for f, v in times.items()}
    print(f"GPT-Neo width {args.width}, {args.layers} layers, vocab {args.vocab:,}, batch {args.batch_size} x "
          f"{args.block_size}, CPU, {os.cpu_count()} cores; {args.train_tokens:,} train and {args.val_tokens:,} "
          f"validation tokens; medians of {args.repeats} alternating runs (s), F=1 / F=8 and the ratio")
    for k in ("checkpoint", "train", "validation", "write"):
        print(f"  {k:>10}: {med[1][k]:7.2f} / {med[8][k]:7.2f}   {med[8][k] / med[1][k]:.3f}"
              + ("   (goal <= 1.10)" if k == "checkpoint" else ""))


def planted_folds(vocab: int, seen: int, width: int, folds: int, seed: int = 0):
    """A checkpoint's statistics with ``folds`` fold sums, planted (see ``errors``): counts Poisson with Zipf rates
    (exponent 1.1) scaled so that about ``seen`` classes are expected to hold a token, dealt to the folds at random;
    each fold's class means Gaussian around the class's centre with its own spread; the totals the folds merged."""
    import xarray as xr
    from scipy.optimize import brentq

    from ncanalyze.analyzer.jackknife import merged

    rng = np.random.default_rng(seed)
    rate = np.arange(1, vocab + 1, dtype=np.float64) ** -1.1
    scale = brentq(lambda a: float(np.sum(-np.expm1(-a * rate))) - seen, 1.0, 1e15)
    count = rng.multinomial(rng.poisson(scale * rate), np.full(folds, 1 / folds)).T       # folds x vocab
    centre, spread = rng.standard_normal((vocab, width)), 0.5 + rng.random(vocab)
    mean = np.zeros((folds, vocab, width))
    for f in range(folds):
        n = count[f]
        mean[f] = np.where(n[:, None] > 0, centre + rng.standard_normal((vocab, width)) * (spread / np.sqrt(
            np.maximum(n, 1)))[:, None], 0.0)
    m2 = spread ** 2 * width * np.maximum(count - 1, 0)
    basis = rng.standard_normal((width, width)) / np.sqrt(width)
    scatter = np.stack([basis @ basis.T * m2[f].sum() / width for f in range(folds)])
    val = rng.poisson(0.1 * count)
    fold = {"fold_count": count, "fold_mean": mean, "fold_m2": m2, "fold_scatter": scatter,
            "fold_unit_sum": rng.standard_normal((folds, width)) * np.sqrt(count.sum(1))[:, None],
            "fold_val_count": val, "fold_val_correct": rng.binomial(val, 0.3), "fold_val_ncc_agree": rng.binomial(val, 0.5)}
    dims = {"fold_mean": ("fold", "vocab", "hidden"), "fold_scatter": ("fold", "hidden", "hidden2"),
            "fold_unit_sum": ("fold", "hidden")}
    ds = xr.Dataset({k: (dims.get(k, ("fold", "vocab")), v) for k, v in fold.items()}, attrs={"min_count": 1})
    ds["classifier"] = (("vocab", "hidden"), (centre + rng.standard_normal((vocab, width))).astype(np.float32))
    return merged(ds, range(folds)).assign(ds.data_vars)


def _peak_rss(f) -> tuple[float, int]:
    """Seconds ``f`` takes and the peak resident memory above the memory before it (sampled every 5 ms)."""
    import threading

    import psutil

    proc, peak, done = psutil.Process(), [0], threading.Event()
    base = proc.memory_info().rss

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], proc.memory_info().rss)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t = time.perf_counter()
    f()
    t = time.perf_counter() - t
    done.set()
    watcher.join()
    return t, max(peak[0], proc.memory_info().rss) - base


def errors(args) -> None:
    import os
    import statistics

    from ncanalyze.analyzer.metrics import measure_all
    from ncanalyze.analyzer.schema import SCALARS

    t = time.perf_counter()
    ds = planted_folds(args.vocab, args.seen, args.width, args.folds)
    made = time.perf_counter() - t
    kept = int((ds["count"].values >= args.min_count).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measure_all(ds, args.min_count, device="cpu", se=False)  # warm-up: the compiled pass, the thread pools
        times: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        peak: dict[bool, int] = {False: 0, True: 0}
        got: dict = {}
        for _ in range(args.rounds):  # alternating, so that a shared machine's slow spells hit both
            for se in (False, True):
                c = time.process_time()
                t, p = _peak_rss(lambda: got.__setitem__(se, measure_all(ds, args.min_count, device="cpu", se=se)))
                cpu[se].append(time.process_time() - c)
                times[se].append(t)
                peak[se] = max(peak[se], p)
    ratio = statistics.median(np.divide(times[True], times[False]))
    cpu_ratio = statistics.median(np.divide(cpu[True], cpu[False]))
    print(f"planted: vocab {args.vocab:,}, {kept:,} kept classes (min_count {args.min_count}), width {args.width}, "
          f"{args.folds} folds, {int(ds['count'].sum()):,} train tokens (made in {made:.0f} s); {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}; {args.rounds} alternating rounds")
    print(f"  measure without errors: median {statistics.median(times[False]):.1f} s, peak +"
          f"{peak[False] / 2**30:.2f} GiB")
    print(f"  measure with errors:    median {statistics.median(times[True]):.1f} s, peak +"
          f"{peak[True] / 2**30:.2f} GiB (the dataset itself: {ds.nbytes / 2**30:.2f} GiB)")
    print(f"  with / without errors: {ratio:.2f} (median of the per-round ratios; goal <= 1.5); in CPU seconds of "
          f"the process (all threads: what a busy machine's load does not stretch) {statistics.median(cpu[True]):.1f}"
          f" / {statistics.median(cpu[False]):.1f} s, ratio {cpu_ratio:.2f}")
    scalars, per_class = got[True]
    method = per_class.attrs.get("se_method", "the exact jackknife (F + 1 full measurements)")
    print(f"  errors: {method}")
    sampling = per_class.attrs.get("se_sampling_error", {})
    for m in SCALARS:
        extra = f" (its sampling error {sampling[m + '_se']:.2g})" if m + "_se" in sampling else ""
        print(f"    {m:>22} {scalars.get(m, float('nan')):>11.4g} +- {scalars.get(m + '_se', float('nan')):.3g}{extra}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("checkpoint")
    c.add_argument("text")
    c.add_argument("--tokenizer")
    c.add_argument("--caps", type=int, default=20)
    c.add_argument("--cap-tokens", type=int, default=8192)
    c.add_argument("--block-size", type=int, default=32)
    c.add_argument("--folds", type=int, default=8)
    c.add_argument("--min-count", type=int, default=1)
    k, w = sub.add_parser("cost"), sub.add_parser("whole")
    for q in (k, w):  # the model's shape and the batches
        q.add_argument("--vocab", type=int, default=50257)
        q.add_argument("--width", type=int, default=256)
        q.add_argument("--layers", type=int, default=2)
        q.add_argument("--block-size", type=int, default=256)
        q.add_argument("--batch-size", type=int, default=8)
        q.add_argument("--repeats", type=int, default=3)
        q.add_argument("--samples-per-class", type=int, default=8)
    k.add_argument("--batches", type=int, default=10, help="batches of the long run")
    k.add_argument("--short", type=int, default=2, help="batches of the short run")
    w.add_argument("--train-tokens", type=int, default=131072)
    w.add_argument("--val-tokens", type=int, default=16384)
    e = sub.add_parser("errors")
    e.add_argument("--vocab", type=int, default=128256)
    e.add_argument("--seen", type=int, default=57000, help="classes expected to hold a train token")
    e.add_argument("--width", type=int, default=128)
    e.add_argument("--folds", type=int, default=8)
    e.add_argument("--min-count", type=int, default=1)
    e.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    {"calibrate": calibrate, "cost": cost, "whole": whole, "errors": errors}[args.what](args)


if __name__ == "__main__":
    main()
