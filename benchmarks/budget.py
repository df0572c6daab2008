"""The token budget's bias, shown: one Trainer checkpoint measured at growing train-token budgets, the paper's plug-in
CDNV beside the debiased one (issue 48's table).

    python benchmarks/budget.py                          # kjv.txt from ../shared/data where present, else generated text
    python benchmarks/budget.py --text FILE --budgets 32768,524288 --steps 600 --work DIR   # DIR kept (the stores)

It trains a GPT-Neo (2 layers, width 64, a 1,024-token byte-level BPE trained on the text) with transformers.Trainer
on the text's first 95% of lines (the last 5% its validation split), extracts its final checkpoint with
``ncanalyze extract`` once per budget (``--max-train-tokens``; blocks spread over the whole split, so the smaller
sample is not a prefix), each into a store of its own, and prints one markdown row per budget: the train tokens, the
plug-in nc1_cdnv and its jackknife error, nc1_cdnv_debiased and its error, gnc2_log_std, nc4_agreement, and the
classes and unresolved pairs the debiased number rests on; then the move of each CDNV between the first budget and
the last, and at each budget the pair of the fixed set with the largest debiased term (its distance against its
means' noise). Without a text file it writes one: sentences over a 3,000-word Zipf vocabulary in which each word's
successor depends on it (so classes differ in context, as a language's do).

``python benchmarks/record.py budget.py`` records its run in benchmarks/results/budget.md (the documentation's
performance page shows it).
What its table shows on a real text: the plug-in CDNV grows with the budget, the debiased one much less, over one
fixed class set; the pairs the sample does not resolve fall as tokens grow. What remains is not noise: classes that
follow the same contexts (on the KJV '.' and ':') have a sample distance at the size of its noise at every budget, so
the population's distance is ~0 and its CDNV term, hence the mean over pairs, grows with every token. A mean of
ratios has no budget-stable estimate where such pairs exist; the report says such a metric drifts. The pooled pairs'
CDNV (nc1_cdnv_pooled_debiased: the pairs' summed variances over their summed corrected distances, two unbiased sums)
is the number that holds still.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KJV = ROOT.parent / "shared" / "data" / "kjv.txt"
COLUMNS = ("nc1_cdnv", "nc1_cdnv_se", "nc1_cdnv_debiased", "nc1_cdnv_debiased_se", "nc1_cdnv_pooled",
           "nc1_cdnv_pooled_debiased", "nc1_cdnv_pooled_debiased_se", "gnc2_log_std", "nc4_agreement")
MOVES = ("nc1_cdnv", "nc1_cdnv_debiased", "nc1_cdnv_pooled", "nc1_cdnv_pooled_debiased")


def sweep():
    """examples/train_sweep.py (the tokenizer and the Trainer run the tests use)."""
    spec = importlib.util.spec_from_file_location("train_sweep", ROOT / "examples" / "train_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_sweep"] = mod
    spec.loader.exec_module(mod)
    return mod


def generated(path: Path, lines: int = 60_000, seed: int = 0) -> Path:
    """Text over a Zipf vocabulary where each word draws its successor from a few words of its own."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(3000)]
    p = 1 / np.arange(1, 3001) ** 1.05
    p /= p.sum()
    follow = rng.choice(3000, size=(3000, 8), p=p)
    with open(path, "w") as f:
        for _ in range(lines):
            w, out = rng.choice(3000, p=p), []
            for _ in range(rng.integers(6, 16)):
                out.append(words[w])
                w = follow[w, rng.integers(8)] if rng.random() < 0.8 else rng.choice(3000, p=p)
            f.write(" ".join(out) + " .\n")
    return path


def split(text: Path, folder: Path) -> tuple[Path, Path]:
    """The text's first 95% of lines and the rest, as train.txt and validation.txt."""
    lines = text.read_text(encoding="utf-8").splitlines(keepends=True)
    cut = int(0.95 * len(lines))
    (folder / "train.txt").write_text("".join(lines[:cut]), encoding="utf-8")
    (folder / "validation.txt").write_text("".join(lines[cut:]), encoding="utf-8")
    return folder / "train.txt", folder / "validation.txt"


def extract(ckpt: Path, train: Path, store: Path, tokens: int, val_tokens: int) -> None:
    from click.testing import CliRunner

    from ncanalyze.cli.main import main

    args = ["extract", str(ckpt), "--dataset", str(train), "--store", str(store), "--max-train-tokens", str(tokens),
            "--max-val-tokens", str(val_tokens), "--samples-per-class", "1", "--batch-size", "16"]
    r = CliRunner().invoke(main, args)
    if r.exit_code != 0:
        raise SystemExit(r.output)


def measured(store: Path) -> dict[str, float]:
    """The metrics with their errors, and the fixed set's pair with the largest debiased term (by brute force)."""
    import ncanalyze.store
    from ncanalyze.analyzer import measure
    from ncanalyze.analyzer.geometry import fixed_set, kept_classes

    tree = ncanalyze.store.open(store)
    group = next(p for p, node in tree.subtree_with_keys if "count" in node.ds)
    ds = tree[group].to_dataset().load()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = measure(ds, se=True) | {"train_tokens": tree[group].attrs["train_tokens"]}
    K = kept_classes(ds["count"].values, 1)
    fixed, (vs, z, *_), _ = fixed_set(ds, K, ds["count"].values)
    mu, vs, z, names = ds["mean"].values[K][fixed], vs[fixed], z[fixed], ds["token"].values[K][fixed]
    i, j = np.triu_indices(len(vs), 1)
    d2 = ((mu[i] - mu[j]) ** 2).sum(1)
    k = int(np.argmax((vs[i] + vs[j]) / np.maximum(d2 - z[i] - z[j], z[i] + z[j])))
    out["top_pair"] = (f"{names[i[k]]!r} and {names[j[k]]!r}: D {d2[k]:.3g}, the means' noise {z[i[k]] + z[j[k]]:.3g}, "
                       f"variances {vs[i[k]]:.3g}, {vs[j[k]]:.3g}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", type=Path, default=KJV if KJV.is_file() else None)
    ap.add_argument("--budgets", default="32768,131072,524288")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--val-tokens", type=int, default=32768)
    ap.add_argument("--work", type=Path, help="a folder to keep the run and the stores in (default: a temporary one)")
    run_budgets(ap.parse_args())


def run_budgets(a: argparse.Namespace) -> None:
    """Train, extract at each budget, print the table and the moves."""
    ts = sweep()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = a.work or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        text = a.text or generated(tmp / "generated.txt")
        train, val = split(text, tmp)
        started = time.perf_counter()
        run, trained = tmp / "neo-2x64", "kept from --work"
        if not (run / f"checkpoint-{a.steps}").is_dir():                 # a kept --work folder is reused
            ts.train_tokenizer([train], vocab_size=1024, out_dir=tmp / "tok")
            run = ts.train([train], [val], tmp / "tok", run, n_layer=2, width=64, n_head=4, block_size=128,
                           batch_size=16, max_steps=a.steps, save_steps=a.steps, seed=0)
            trained = f"trained in {time.perf_counter() - started:.0f} s"
        ckpt = max(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        print(f"text: {text.name if a.text else 'generated'}; {ckpt.name} {trained}")
        rows = []
        for tokens in (int(x) for x in a.budgets.split(",")):
            store = tmp / f"b{tokens}.zarr"
            extract(ckpt, train, store, tokens, a.val_tokens)
            rows.append(measured(store))
    print("\n| train tokens | " + " | ".join(COLUMNS) + " | classes (debiased) | unresolved pairs |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    for m in rows:
        print(f"| {int(m['train_tokens']):,} | " + " | ".join(f"{m[c]:.4g}" for c in COLUMNS)
              + f" | {int(m['n_classes_debiased'])} | {int(m['n_pairs_unresolved'])} |")
    for m in rows:
        print(f"{int(m['train_tokens']):,} tokens, the largest debiased term: {m['top_pair']}")
    for c in MOVES:
        first, last = rows[0][c], rows[-1][c]
        print(f"{c}: {first:.4g} -> {last:.4g} ({(last / first - 1):+.1%}; "
              f"{abs(last - first) / math.hypot(rows[0][c + '_se'], rows[-1][c + '_se']):.1f} errors)")


if __name__ == "__main__":
    main()
