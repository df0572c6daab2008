"""Benchmark: the report over a synthetic study, 200 checkpoints x 23 metrics x 10^4 permutations, and its
report.html over the same checkpoints at 9 layers each.

    python benchmarks/report.py
    python benchmarks/report.py --checkpoints 1000 --permutations 100000 --repeats 1
    python benchmarks/report.py --html-only --layers 9

Prints the median time of (1) the permutation tests alone (r and Freedman-Lane partial r for the 23 metrics on
both scales: one matrix product per chunk of permutations), (2) all statistics (adds pingouin's partial
correlations, the parametric and the Holm-adjusted p-values, the intervals over runs, the paired bootstrap of the
R² comparisons (10^4 resamples), the within-training fixed-effects r with its whole-run permutations, the r across
runs at each of the 10 steps with its permutations, and leave-one-run-out: 20 more permutation tests) and (3) the whole report: CSVs, five figures (Figures 1-3, the training dynamics and the
per-step r) each as PNG, PDF and SVG, report.md and tables.tex. Target (issue 39): under 30 s on a 2-core machine
with the bootstrap and leave-one-run-out (under 10 s without them before).

Then report.html (issue 32) over the checkpoints at ``--layers`` layers each (a row per checkpoint and layer, as
``--layers all`` stores them): the page's size (target < 10 MB), the time its step adds to the report (the step
alone, and the whole report with and without it; target < 2 s) and the time headless Chromium takes to open it from
disk until every figure is drawn (target < 3 s; /usr/bin/chromium and chromedriver, skipped without them).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import timeit
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
from ncanalyze.analyzer.report import ReportOptions, write_report
from ncanalyze.analyzer.report.html import write_html
from ncanalyze.analyzer.permute import perm_test
from ncanalyze.analyzer.schema import CONTROLS
from ncanalyze.analyzer.stats import METRICS, correlations, eval_controls, scaled_metrics


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


def layered(df: pd.DataFrame, layers: int, seed: int = 1) -> pd.DataFrame:
    """The checkpoints at layers 0..layers-1 (the last: the rows of ``df``; the others: its metrics times noise)."""
    rng = np.random.default_rng(seed)
    last = df.assign(n_layers=layers - 1)
    rows = [last.assign(layer=l, **{m: last[m] * rng.uniform(0.5, 2, len(last)) for m in METRICS})
            for l in range(layers - 1)]
    return pd.concat([*rows, last.assign(layer=layers - 1)], ignore_index=True)


def open_seconds(page: Path, repeats: int) -> list[float] | None:
    """Seconds headless Chromium takes from navigating to ``page`` (file://, network off) until the page says every
    figure is drawn; None without Chromium."""
    if not (Path("/usr/bin/chromium").exists() and Path("/usr/bin/chromedriver").exists()):
        return None
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    with tempfile.TemporaryDirectory() as profile:
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--window-size=1400,1000", f"--user-data-dir={profile}"):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        driver.set_network_conditions(offline=True, latency=0, throughput=0)
        out = []
        try:
            for _ in range(repeats):
                driver.get("about:blank")
                t = time.perf_counter()
                driver.get(page.as_uri())
                WebDriverWait(driver, 120, poll_frequency=0.02).until(
                    lambda d: d.execute_script("return document.body.dataset.ready") == "1")
                out.append(time.perf_counter() - t)
        finally:
            driver.quit()
    return out


def html_benchmark(df: pd.DataFrame, layers: int, n_perm: int, repeats: int) -> None:
    """report.html over ``df`` at ``layers`` layers: size, the step's time, the report with and without it, the
    time to open it in headless Chromium."""
    table = layered(df, layers)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        opts = ReportOptions(n_perm=n_perm, seed=0)
        r = write_report(table, out / "with", opts)
        page = r.files["html"]
        t_step = timed(lambda: write_html(r, opts, out / "with"), repeats)
        without, with_ = [], []  # alternating rounds: the load of these shared cores moves between them
        for _ in range(repeats):
            without.append(timed(lambda: write_report(table, out / "without", replace(opts, html=False)), 1))
            with_.append(timed(lambda: write_report(table, out / "with", opts), 1))
        t_without, t_with = statistics.median(without), statistics.median(with_)
        added = statistics.median(w - o for w, o in zip(with_, without))
        opened = open_seconds(page, repeats)
        print(f"report.html: {len(df)} checkpoints x {layers} layers = {len(table)} rows x {len(METRICS)} metrics, "
              f"median of {repeats}:")
        print(f"  size                               {page.stat().st_size / 1e6:7.2f} MB   target < 10 MB")
        print(f"  the html step alone                {t_step:7.2f} s    target < 2 s")
        print(f"  whole report without / with html   {t_without:7.2f} s / {t_with:.2f} s "
              f"(adds {added:.2f} s, median of the rounds' differences)")
        if opened is None:
            print("  opening it: no /usr/bin/chromium and chromedriver here")
        else:
            print(f"  opening it in headless Chromium    {statistics.median(opened):7.2f} s    target < 3 s "
                  f"(each: {', '.join(f'{x:.2f}' for x in opened)})")


def timed(f, repeats: int) -> float:
    """Median seconds of ``repeats`` calls."""
    return statistics.median(timeit.repeat(f, number=1, repeat=repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=200)
    ap.add_argument("--permutations", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=9, help="layers per checkpoint of report.html's table")
    ap.add_argument("--html-only", action="store_true", help="report.html's figures only")
    args = ap.parse_args()
    df = study(args.checkpoints)
    if args.html_only:
        return html_benchmark(df, args.layers, args.permutations, args.repeats)
    X, _ = scaled_metrics(df, METRICS)
    X = X.dropna(axis=1)
    y, C = df.eval_loss.to_numpy(), eval_controls(df, CONTROLS).to_numpy()
    n, m, b = len(df), X.shape[1], args.permutations
    t_perm = timed(lambda: perm_test(y, X.to_numpy(), C, b, seed=0), args.repeats)
    t_stats = timed(lambda: correlations(df, METRICS, n_perm=b, seed=0, runs="run"), args.repeats)
    with tempfile.TemporaryDirectory() as out:
        t_all = timed(lambda: write_report(df, out, ReportOptions(n_perm=b, seed=0)), args.repeats)
    print(f"{n} checkpoints x {len(METRICS)} metrics ({m} metric columns, raw and log) x {b} permutations, "
          f"median of {args.repeats}:")
    print(f"  permutation tests (r and Freedman-Lane partial r) {t_perm:7.2f} s")
    print(f"  all statistics (+ pingouin, bootstrap, per step, leave-one-run-out) {t_stats:7.2f} s")
    print(f"  whole report (CSV, 5 figures x PNG/PDF/SVG, Markdown, LaTeX, HTML) {t_all:7.2f} s   target < 30 s")
    html_benchmark(df, args.layers, args.permutations, args.repeats)


if __name__ == "__main__":
    main()
