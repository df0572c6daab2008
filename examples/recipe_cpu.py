"""Linguistic Collapse at CPU scale, end to end, in one command (about 20 minutes on 2 cores):

    python examples/recipe_cpu.py [--text FILE] [--out examples/out/cpu]

1. corpus: --text, else ../shared/data/kjv.txt, else the King James Bible from the `bible` command (Debian or
   Ubuntu: apt-get install bible-kjv); split into train/validation, a 1,024-token BPE trained on the train split,
   both splits tokenized once (examples/prepare_text.py)
2. a GPT-Neo depth x width grid with checkpoints over training, and seed replicas of one architecture
   (examples/train_sweep.py), one run per core
3. ncanalyze extract (train statistics capped at --train-tokens per checkpoint, blocks spread over the whole split),
   measure, and three reports against val_loss with whole-run permutations: every checkpoint; the grid's final
   models; the seed replicas' final models (the paper's Table 1)
4. every layer of the grid's final models (`--layers all`, a store of its own) and its report (the depth figure)
5. one replica trained again with ncanalyze.training.NeuralCollapseCallback (its step-N groups measured during
   training), its checkpoints extracted into the same store, and the two compared metric by metric
6. examples/explore_store.py on the store; with --results, the reports copied there with a summary table
   (summary.md) and the findings (findings.md, examples/claims.py) that the README and the docs' results page quote

Each step prints the equivalent shell command. Finished work is skipped when the command runs again (trained
runs, extracted and measured checkpoints), so an interrupted recipe continues. Wall times are appended to
timings.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_MININTERVAL", "10")  # progress bars update every 10 s: a readable log
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))


def find_text(text: Path | None, out: Path) -> Path:
    """--text, else ../shared/data/kjv.txt beside the repository, else the KJV from `bible` (bible-kjv)."""
    if text is None:
        shared = ROOT.parent / "shared" / "data" / "kjv.txt"
        if shared.is_file():
            text = shared
        elif shutil.which("bible"):
            text = out / "kjv.txt"
            if not text.is_file() or text.stat().st_size == 0:
                print("$ bible gen1:1-rev22:21 > " + str(text))
                text.write_bytes(subprocess.run(["bible", "gen1:1-rev22:21"], check=True, capture_output=True).stdout)
        else:
            raise SystemExit("error: no text to train on. Pass one (--text FILE), or install the King James Bible "
                             "(Debian/Ubuntu: sudo apt-get install bible-kjv), which the recipe then reads with "
                             "`bible gen1:1-rev22:21`.")
    if not text.is_file() or text.stat().st_size == 0:
        raise SystemExit(f"error: {text} is not a non-empty file")
    return text


def ncanalyze(*args: str) -> None:
    """Run an ncanalyze command in this process (the console script would import everything again)."""
    import click
    from ncanalyze.cli.main import main

    print("$ ncanalyze " + shlex.join(args), flush=True)
    try:
        main(list(args), standalone_mode=False)
    except click.ClickException as e:
        e.show()
        raise SystemExit(1) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--text", type=Path, help="UTF-8 text to train on [default: ../shared/data/kjv.txt, else "
                   "`bible gen1:1-rev22:21`]")
    p.add_argument("--out", type=Path, default=HERE / "out" / "cpu", help="working folder")
    p.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary")
    p.add_argument("--depths", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--widths", nargs="+", type=int, default=[16, 32, 64, 128])
    p.add_argument("--replicas", default="2x64", help="DEPTHxWIDTH of the seed replicas")
    p.add_argument("--replica-seeds", nargs="+", type=int, default=list(range(10)))
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128, help="tokens per block (the paper: 1024)")
    p.add_argument("--batch-size", type=int, default=16, help="blocks per step (the paper: 16)")
    p.add_argument("--steps", type=int, default=480, help="steps per run (480 x 16 x 128: 0.69 epoch of the KJV)")
    p.add_argument("--save-steps", type=int, default=120, help="a checkpoint and an eval loss every N steps")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine, 5%% warmup)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW (the paper ablates 0.0005 and 0.1)")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once (one per core)")
    p.add_argument("--train-tokens", type=int, default=131072, help="train tokens per checkpoint for the statistics")
    p.add_argument("--val-tokens", type=int, default=65536, help="validation tokens per checkpoint for NC4")
    p.add_argument("--permutations", type=int, default=10_000, help="per permutation p-value")
    p.add_argument("--formats", default="png,pdf,svg", help="the reports' figure formats (ncanalyze report --formats)")
    p.add_argument("--tokens", default=" the, LORD, God, and,:",
                   help="comma-separated tokens for the per-token table and the embedding plot")
    p.add_argument("--results", type=Path, help="copy the reports, the comparison and a summary table here "
                   "(examples/results for the committed study)")
    p.add_argument("--restate", action="store_true", help="with --results: only the statistics again, from the "
                   "committed metrics.csv of all/, final/, seeds/ and depth/ (no training or extraction: the metrics are "
                   "those the last full run measured), then summary.md and findings.md")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.restate:
        if not args.results:
            raise SystemExit("error: --restate needs --results (the folder of a published study)")
        restate(args.results.resolve(), args)
        return 0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t_start = t = time.time()

    def lap(name: str) -> None:
        nonlocal t
        times[name] = round(time.time() - t, 1)
        print(f"== {name}: {times[name]:.0f} s (total {time.time() - t_start:.0f} s)\n", flush=True)
        t = time.time()

    text = find_text(args.text, out)
    data = out / "data"
    if not (data / "validation.npy").is_file():
        import prepare_text

        cmd = [str(text), str(data), "--vocab", str(args.vocab)]
        print("$ python examples/prepare_text.py " + shlex.join(cmd), flush=True)
        prepare_text.main(cmd)
    lap("corpus")

    import train_sweep

    sweep = ["--out", str(out / "runs"), "--train-tokens", str(data / "train.npy"),
             "--val-tokens", str(data / "validation.npy"), "--tokenizer", str(data / "tokenizer"),
             "--depths", *map(str, args.depths), "--widths", *map(str, args.widths), "--seeds", "0",
             "--replicas", args.replicas, "--replica-seeds", *map(str, args.replica_seeds),
             "--block-size", str(args.block_size), "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
             "--save-steps", str(args.save_steps), "--lr", str(args.lr), "--lr-scheduler", "cosine",
             "--warmup-steps", str(args.steps // 20), "--weight-decay", str(args.weight_decay),
             "--heads", str(args.heads), "--attention", "global", "--jobs", str(args.jobs)]
    print("$ python examples/train_sweep.py " + shlex.join(sweep), flush=True)
    before = len(list((out / "runs").glob("*/eval_results.json")))
    train_sweep.main(sweep)
    lap("training")
    times["runs_trained_before"] = before  # trained by an earlier invocation: their time is not in this one's

    store = str(out / "store.zarr")
    extract_opts = ["--dataset", str(data / "train.npy"), "--val-dataset", str(data / "validation.npy"),
                    "--block-size", str(args.block_size), "--batch-size", "32", "--max-train-tokens",
                    str(args.train_tokens), "--max-val-tokens", str(args.val_tokens), "--device", "cpu"]
    ncanalyze("extract", str(out / "runs"), "--store", store, *extract_opts)
    lap("extract")
    ncanalyze("measure", store)
    lap("measure")

    depth, width = args.replicas.lower().split("x")
    tag = train_sweep.run_name(0, 0, 0, args.weight_decay).split("-s0")[1]  # "-wd0.1" or ""
    perms = ["--permutations", str(args.permutations), "--formats", args.formats]
    smallest, largest = (train_sweep.run_name(f(args.depths), f(args.widths), 0, args.weight_decay) for f in (min, max))
    ncanalyze("report", store, "--out", str(out / "report-all"), *perms, "--tokens", args.tokens,
              "--checkpoint", f"{smallest}/checkpoint-{args.steps}", "--checkpoint", f"{largest}/checkpoint-{args.steps}")
    ncanalyze("report", store, "--out", str(out / "report-final"), *perms,
              "--where", f"global_step == {args.steps} and run.str.endswith('-s0{tag}')")
    ncanalyze("report", store, "--out", str(out / "report-seeds"), *perms,
              "--where", f"n_layers == {depth} and hidden_size == {width} and global_step == {args.steps}")
    lap("report")

    finals = [str(out / "runs" / train_sweep.run_name(d, w, 0, args.weight_decay) / f"checkpoint-{args.steps}")
              for d in args.depths for w in args.widths]
    depth_store = str(out / "depth.zarr")
    ncanalyze("extract", *finals, "--store", depth_store, *extract_opts, "--layers", "all")
    ncanalyze("report", depth_store, "--out", str(out / "report-depth"), *perms)
    lap("depth")

    compare = callback_run(args, out, data, extract_opts)
    lap("callback")

    import explore_store

    cmd = [store, "--out", str(out / "explore"), "--tokens", *args.tokens.split(",")]
    print("$ python examples/explore_store.py " + shlex.join(cmd), flush=True)
    explore_store.main(cmd)
    lap("explore")
    times["total"] = round(time.time() - t_start, 1)
    line = json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), **times}) + "\n"
    with open(out / "timings.jsonl", "a") as f:  # one line per invocation (a rerun skips finished work)
        f.write(line)
    if args.results:
        publish(out, args.results.resolve(), compare)
    print(f"done in {times['total'] / 60:.1f} min: reports in {out}/report-{{all,final,seeds}}, "
          f"store {store}, figures of the store in {out}/explore")
    return 0



def callback_run(args, out: Path, data: Path, extract_opts: list[str]) -> Path:
    """The replica architecture, seed 0, trained again with the callback measuring it at every evaluation into
    callback.zarr; its checkpoints then extracted into the same store with the recipe's settings, and the callback's
    stored metrics compared with extract's, step by step: compare.csv (the relative difference of each metric)."""
    import numpy as np
    import pandas as pd
    import train_sweep
    from ncanalyze.training import NeuralCollapseCallback

    depth, width = map(int, args.replicas.lower().split("x"))
    run = out / "callback" / train_sweep.run_name(depth, width, 0, args.weight_decay)
    nc = out / "callback.zarr"
    if not (run / "eval_results.json").is_file():
        print(f"$ python examples/train_sweep.py ... with NeuralCollapseCallback({nc}) -> {run}", flush=True)
        callback = NeuralCollapseCallback(str(nc), str(data / "train.npy"), str(data / "validation.npy"),
                                          max_train_tokens=args.train_tokens, max_val_tokens=args.val_tokens,
                                          block_size=args.block_size, batch_size=32, device="cpu")
        train_sweep.train(None, None, data / "tokenizer", run, n_layer=depth, width=width, n_head=args.heads,
                          block_size=args.block_size, batch_size=args.batch_size, max_steps=args.steps,
                          learning_rate=args.lr, weight_decay=args.weight_decay, save_steps=args.save_steps, seed=0,
                          data=train_sweep.token_datasets(data / "train.npy", data / "validation.npy",
                                                          args.block_size),
                          attention="global", lr_scheduler="cosine", warmup_steps=args.steps // 20,
                          save_only_model=True, callbacks=[callback])
    ncanalyze("extract", str(run), "--store", str(nc), *extract_opts)
    ncanalyze("measure", str(nc))
    import ncanalyze.store as ncstore

    tree, rows = ncstore.open(str(nc)), []
    for node in tree[run.name].children.values():
        if not node.name.startswith("step-"):
            continue
        post = tree[f"{run.name}/checkpoint-{node.name.removeprefix('step-')}"].attrs["metrics"]
        for metric, value in node.attrs["metrics"].items():
            other = post.get(metric)
            both = value is not None and other is not None
            rows.append({"step": int(node.name.removeprefix("step-")), "metric": metric, "callback": value,
                         "extract": other, "rel_diff": abs(value - other) / max(abs(other), 1e-300) if both
                         else np.nan})
    table = pd.DataFrame(rows)
    table.to_csv(out / "callback_compare.csv", index=False)
    print(f"callback vs extract, {table.step.nunique()} steps x {table.metric.nunique()} metrics: largest relative "
          f"difference {table.rel_diff.max():.3g}", flush=True)
    return out / "callback_compare.csv"


SUMMARY_COLUMNS = {"metric": "metric", "r": "r", "r_ci": "r 95% CI (runs)", "r2": "R²", "rho": "rho", "p_perm": "p",
                   "p_holm": "p Holm", "partial_r": "partial r", "partial_p_perm": "p FL",
                   "partial_p_holm": "p FL Holm"}


def summary(folder: Path, title: str) -> list[str]:
    """A Markdown table of one report's raw-scale statistics (stats.csv's own numbers, rounded to 3 figures), headed
    by what its p-values rest on: the unit permuted, how many permutations, their floor, and the Holm families; r's
    interval is over runs (the jackknife over runs, or Fisher's z where each run is one row)."""
    import numpy as np
    import pandas as pd

    s = pd.read_csv(folder / "stats.csv")
    s, first = s[s.scale == "raw"].copy(), s.iloc[0]
    s["r_ci"] = [f"[{lo:.3g}, {hi:.3g}]" if np.isfinite(lo) else "—" for lo, hi in zip(s.r_ci_low, s.r_ci_high)]
    runs = pd.read_csv(folder / "metrics.csv").run.nunique()
    drawn = "all of them (exact)" if bool(first.exact) else f"{int(first.n_perm):,} drawn"
    plain = s.controls.isna().all()  # no control varies among these runs: the partial r is r
    columns = {c: h for c, h in SUMMARY_COLUMNS.items() if not (plain and c.startswith("partial_"))}
    controls = ("no control varies among these runs, so the partial r equals r (its columns left out)" if plain
                else f"partial r controls for {first.controls}")
    lines = [f"**{title}**: {int(s.n.max())} checkpoints of {runs} runs; permuted: {first.perm_scheme} "
             f"({int(first.n_units)} {first.perm_unit}, {first.n_distinct_perms:.3g} distinct permutations, "
             f"{drawn}), so p >= {first.p_floor:.2g}; {controls}; Holm within the NC "
             "and the geometry families", "", "| " + " | ".join(columns.values()) + " |",
             "|" + "---|" * len(columns)]
    for _, row in s.iterrows():
        lines.append("| " + " | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c])
                                       for c in columns) + " |")
    return lines + [""]


def publish(out: Path, results: Path, compare: Path) -> None:
    """The reports into ``results`` (all, final, seeds, depth, explore; report.html of all/ only), the callback
    comparison, every invocation's timings, summary.md (the statistics of every checkpoint, of the final models and
    of the seed replicas) and findings.md (the paper's statements answered question by question, examples/claims.py),
    as the README and the docs' results page quote them."""
    for name, src in (("all", "report-all"), ("final", "report-final"), ("seeds", "report-seeds"),
                      ("depth", "report-depth"), ("explore", "explore")):
        shutil.rmtree(results / name, ignore_errors=True)
        shutil.copytree(out / src, results / name)
        if name != "all":  # each page carries its own 4.8 MB of plotly.js: the committed study keeps one, all/'s
            (results / name / "report.html").unlink(missing_ok=True)
    (results / "callback").mkdir(parents=True, exist_ok=True)
    shutil.copy(compare, results / "callback" / "compare.csv")
    shutil.copy(out / "timings.jsonl", results / "timings.jsonl")  # every invocation's line: a rerun skips work
    write_summaries(results)


def write_summaries(results: Path) -> None:
    """summary.md and findings.md of a published study, from its files."""
    text = ["<!-- generated by examples/recipe_cpu.py --results: do not edit -->", ""]
    text += (summary(results / "all", "Every checkpoint") + summary(results / "final", "The grid's final models")
             + summary(results / "seeds", "Seed replicas of 2 x 64, final"))
    (results / "summary.md").write_text("\n".join(text))
    import claims

    (results / "findings.md").write_text(claims.findings(results))
    print(f"results in {results}", flush=True)


def restate(results: Path, args: argparse.Namespace) -> None:
    """The statistics of a published study again (``--restate``): each of all/, final/, seeds/ and depth/ reported anew from
    its own metrics.csv, its statistics, figures and report.md replacing the old ones (the store's own sections,
    the per-token, min_count and budget tables, stay as the full run wrote them); then the summaries."""
    for name in ("all", "final", "seeds", "depth"):
        folder = results / name
        fresh = results / f".{name}-restated"
        shutil.rmtree(fresh, ignore_errors=True)
        here = Path.cwd()
        os.chdir(folder)  # the report names its input as given: the metrics.csv beside it, not a path of this machine
        try:
            ncanalyze("report", "metrics.csv", "--out", str(fresh), "--permutations", str(args.permutations),
                      "--formats", args.formats, *([] if name == "all" else ["--no-html"]))
        finally:
            os.chdir(here)
        for f in fresh.iterdir():
            if f.name != "metrics.csv":  # the measured metrics stay as the full run wrote them
                shutil.move(str(f), str(folder / f.name))
        shutil.rmtree(fresh)
    write_summaries(results)

if __name__ == "__main__":
    sys.exit(main())
