"""Benchmark: the report over a synthetic study, 200 checkpoints x 14 metrics x 10^4 permutations.

    python benchmarks/report.py
    python benchmarks/report.py --checkpoints 1000 --permutations 100000 --repeats 1

Prints the median time of (1) the permutation tests alone (r and Freedman-Lane partial r for the 14 metrics on
both scales: one matrix product per chunk of permutations), (2) all statistics (adds pingouin's partial
correlations, the parametric and the Holm-adjusted p-values) and (3) the whole report: CSVs, four figures (Figures
1-3 and the training dynamics) each as PNG, PDF and SVG, report.md and tables.tex. Target (SPEC section 6):
seconds, under 10 s on a 2-core machine.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import timeit

import numpy as np
import pandas as pd
from ncanalyze.analyzer.report import ReportOptions, write_report
from ncanalyze.analyzer.stats import (
    CONTROLS,
    METRICS,
    correlations,
    eval_controls,
    perm_test,
    scaled_metrics,
)


def study(n: int, seed: int = 0) -> pd.DataFrame:
    """n checkpoints of 20 runs of random size; loss falls with size and step; metrics follow the loss noisily."""
    rng = np.random.default_rng(seed)
    runs = np.arange(n) % 20
    n_params = (10 ** rng.uniform(6, 9, 20))[runs].round()
    step = 1000 * (np.arange(n) // 20 + 1)
    loss = 1.5 + 40 / n_params ** 0.25 + 3 / step ** 0.25 + rng.normal(0, 0.03, n)
    df = pd.DataFrame({"run": [f"run{r}" for r in runs], "checkpoint": [f"checkpoint-{s}" for s in step],
                       "global_step": step, "epoch": step / step.max(), "n_params": n_params, "n_layers": 4,
                       "hidden_size": 256, "eval_loss": loss})
    for i, m in enumerate(METRICS):
        df[m] = np.exp(rng.normal(0, 0.3, n) + (i % 3) * loss)
    return df


def timed(f, repeats: int) -> float:
    """Median seconds of ``repeats`` calls."""
    return statistics.median(timeit.repeat(f, number=1, repeat=repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=200)
    ap.add_argument("--permutations", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    df = study(args.checkpoints)
    X, _ = scaled_metrics(df, METRICS)
    X = X.dropna(axis=1)
    y, C = df.eval_loss.to_numpy(), eval_controls(df, CONTROLS).to_numpy()
    n, m, b = len(df), X.shape[1], args.permutations
    t_perm = timed(lambda: perm_test(y, X.to_numpy(), C, b, seed=0), args.repeats)
    t_stats = timed(lambda: correlations(df, METRICS, n_perm=b, seed=0), args.repeats)
    with tempfile.TemporaryDirectory() as out:
        t_all = timed(lambda: write_report(df, out, ReportOptions(n_perm=b, seed=0)), args.repeats)
    print(f"{n} checkpoints x {len(METRICS)} metrics ({m} metric columns, raw and log) x {b} permutations, "
          f"median of {args.repeats}:")
    print(f"  permutation tests (r and Freedman-Lane partial r) {t_perm:7.2f} s")
    print(f"  all statistics (+ pingouin, parametric p)          {t_stats:7.2f} s")
    print(f"  whole report (CSV, 4 figures x PNG/PDF/SVG, Markdown, LaTeX) {t_all:7.2f} s   target < 10 s")


if __name__ == "__main__":
    main()
