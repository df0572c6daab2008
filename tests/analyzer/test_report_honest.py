"""Issue 20, the report side: statistics that respect the runs (whole-run permutations, exact when few, a simulated
null), tags never pooled, depth only where a checkpoint has several layers, what the numbers rest on, and the smaller
items (tokens, p-value display, --help, measure's NaN keys)."""
from __future__ import annotations

import itertools
import shutil
import warnings
from functools import partial

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from conftest import _load_example, lone_model, run_cli
from ncanalyze.analyzer.report import ReportOptions, write_report
from ncanalyze.analyzer.report.support import DIRECTION, THIN
from ncanalyze.analyzer.report.tables import fmt_p
from ncanalyze.analyzer.schema import CLASS_COUNTS, SCALARS, stats_dataset
from ncanalyze.analyzer.permute import Scheme, perm_test
from ncanalyze.analyzer.stats import correlations_by_tag
from ncanalyze.store.io import ensure_group, read_group
from scipy.stats import pearsonr, spearmanr

NC3_NC4 = ("nc3_cos_mean", "unc3_cos_cv", "nc3_dual_error", "nc4_agreement", "head_erank")


def null_study(rng: np.random.Generator, n_runs: int = 6, per_run: int = 3) -> pd.DataFrame:
    """Runs that differ (a run effect on both the metric and the loss), metric and loss unrelated within and
    across runs: every true correlation is 0, but rows of one run are alike."""
    run_y, run_x = rng.normal(0, 1, n_runs), rng.normal(0, 1, n_runs)
    rows = [dict(run=f"r{i}", checkpoint=f"checkpoint-{10 * s}", global_step=10 * s, n_params=1e6,
                 eval_loss=3 + run_y[i] + rng.normal(0, 0.2), nc1_cdnv=np.exp(run_x[i] + rng.normal(0, 0.2)))
            for i in range(n_runs) for s in range(1, per_run + 1)]
    return pd.DataFrame(rows)


def rejection_rate(runs: str | None, n_sim: int, seed: int = 0, partial: bool = True,
                   checked: int = 10) -> dict[str, float]:
    """The share of simulated null studies with p < 0.05, for r, rho and (``partial``) the partial r on the step:
    each p from :func:`~ncanalyze.analyzer.permute.perm_test` under the scheme the report's statistics use (whole
    runs ranked by step, or rows), the function behind their p-values; for the first ``checked`` studies, it is
    shown to be the p of :func:`correlations_by_tag` itself (to 1e-12), the rest spared its other statistics."""
    rng = np.random.default_rng(seed)
    hits = {"p_perm": 0, "rho_p": 0} | ({"partial_p_perm": 0} if partial else {})
    for k in range(n_sim):
        study = null_study(rng)
        scheme = (Scheme.rows(len(study)) if runs is None else
                  Scheme.whole_blocks(study[runs].to_numpy(), study.global_step.to_numpy()))
        C = np.log1p(study[["global_step"]].to_numpy(float)) if partial else None
        p = perm_test(study.eval_loss.to_numpy(float), study[["nc1_cdnv"]].to_numpy(float), C, n_perm=720, seed=k,
                      scheme=scheme)
        if k < checked:
            s = correlations_by_tag(study, ["nc1_cdnv"], "eval_loss", ["log1p(global_step)"] if partial else [],
                                    n_perm=720, seed=k, runs=runs, n_boot=0)
            raw = s[s.scale == "raw"].iloc[0]
            for col in hits:
                assert raw[col] == pytest.approx(p[col][0], abs=1e-12), (k, col)
        for col in hits:
            hits[col] += p[col][0] < 0.05
    return {c: h / n_sim for c, h in hits.items()}


@pytest.mark.slow
def test_whole_run_permutations_hold_alpha_under_a_null_where_rows_do_not():
    """300 null studies for the whole-run scheme (binomial: a true rate of 0.12 passes the bound 0.088 with
    probability 0.04). 100 for the row scheme, only shown to be far above alpha: its rate is about 0.3 (it fails
    the 0.15 with probability 4e-4; 0.011 at a rate of 0.25), and a scheme holding 0.05 would pass it with
    probability 4e-5 (16 of 100 where 5 are expected)."""
    blocks = rejection_rate("run", 300)  # binomial sd of a 0.05 rate: 0.0126
    rows = rejection_rate(None, 100, partial=False)
    for col, rate in blocks.items():
        assert 0.01 <= rate <= 0.05 + 3 * 0.0126, (col, blocks)
    assert rows["p_perm"] > 0.15 and rows["rho_p"] > 0.15, rows  # the old row-level test: far above alpha


def brute_p(x: np.ndarray, y: np.ndarray, runs: list[str]) -> tuple[float, int]:
    """Two-sided, equal-tailed p (twice the smaller tail, at most 1) over every permutation of whole runs (all of
    one size), each run's y moved position by position."""
    names = list(dict.fromkeys(runs))
    idx = {r: [i for i, q in enumerate(runs) if q == r] for r in names}
    r0 = np.corrcoef(x, y)[0, 1]
    low = high = total = 0
    for perm in itertools.permutations(names):
        yp = np.empty_like(y)
        for src, dst in zip(perm, names):
            yp[idx[dst]] = y[idx[src]]
        r = np.corrcoef(x, yp)[0, 1]
        low, high, total = low + (r <= r0 + 1e-12), high + (r >= r0 - 1e-12), total + 1
    return min(1.0, 2 * min(low, high) / total), total


def two_tags(rng: np.random.Generator) -> pd.DataFrame:
    """Two tags over the same 4 runs x 2 checkpoints: in 'a' the metric follows the loss, in 'b' it is noise; and
    three untagged runs' last checkpoints."""
    rows = []
    for tag in ("a", "b", None):
        for r in range(4 if tag else 3):
            for s in (3,) if tag is None else (1, 2):
                loss = 3 + r * 0.3 + rng.normal(0, 0.1) - 0.2 * s
                metric = np.exp(loss + rng.normal(0, 0.05)) if tag == "a" else np.exp(rng.normal(0, 1))
                rows.append(dict(run=f"r{r}", tag=tag, checkpoint=f"checkpoint-{s}", global_step=s,
                                 n_params=1e6 * (r + 1), eval_loss=loss, nc1_cdnv=metric,
                                 nc4_agreement=rng.uniform(0.1, 0.5)))
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def tagged_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tagged")
    df = two_tags(np.random.default_rng(3))
    options = ReportOptions(metrics=["nc1_cdnv", "nc4_agreement"], target="eval_loss", n_perm=1000, seed=1)
    return df, out, write_report(df, out, options)


@pytest.mark.slow
def test_stats_per_tag_exact_whole_run_p_and_rho(tagged_report):
    df, out, r = tagged_report
    stats = pd.read_csv(out / "stats.csv", keep_default_na=False, na_values=[""])
    assert {"tag", "rho", "rho_p", "perm_scheme", "n_distinct_perms", "exact"} <= set(stats.columns)
    assert set(stats.tag.fillna("(none)")) == {"a", "b", "(none)"}
    for tag in ("a", "b"):
        rows = df[df.tag == tag]
        s = stats[(stats.tag == tag) & (stats.metric == "nc1_cdnv") & (stats.scale == "raw")].iloc[0]
        x, y = rows.nc1_cdnv.to_numpy(float), rows.eval_loss.to_numpy(float)
        assert s.n == 8 and s.r == pytest.approx(pearsonr(x, y)[0], abs=1e-12)
        assert s.rho == pytest.approx(spearmanr(x, y)[0], abs=1e-12)
        p, total = brute_p(x, y, list(rows.run))
        assert s.perm_scheme == "whole runs" and s.n_distinct_perms == total == 24 and bool(s.exact)
        assert s.p_perm == pytest.approx(p, abs=1e-12)
        family = stats[(stats.tag == tag) & (stats.scale == "raw")]  # Holm within the tag: 2 metrics
        ps = family.p_perm.to_numpy(float)
        order = np.argsort(ps)
        holm = np.minimum(1, np.maximum.accumulate(ps[order] * (len(ps) - np.arange(len(ps)))))
        np.testing.assert_allclose(family.p_holm.to_numpy(float)[order], holm, atol=1e-12)
    untagged = stats[stats.tag.isna() & (stats.metric == "nc1_cdnv")]
    assert (untagged.n == 3).all() and (untagged.perm_scheme == "rows").all()  # one checkpoint per run: rows


@pytest.mark.slow
def test_report_md_has_a_section_per_tag_with_its_permutations_and_figures(tagged_report):
    df, out, r = tagged_report
    text = (out / "report.md").read_text()
    assert "holds 3 tags" in text and "never pooled" in text and "tag.isna()" in text
    for tag in ("`a`", "`b`", "(untagged)"):
        assert f"## Correlation with eval_loss, tag {tag}" in text
    assert text.count("whole runs (4 runs;") == 2 and "24 distinct permutations, all enumerated (exact p)" in text
    assert "no equal-tailed p can fall below 2/6" in text  # when N <= 2/alpha: 3! and 4!
    assert "no equal-tailed p can fall below 2/24 = 0.0833, so none reaches 0.05" in text
    top = text[:text.index("## Correlation")]  # and Holm over 2 metrics needs p < 0.025: 2/24 cannot, said first
    assert "- tag `a`, NC metrics (raw, log scale): Holm multiplies the smallest of 2 p-values by 2" in top
    assert "only 24 distinct permutations, so no equal-tailed p falls below 2/24 = 0.0833" in top
    for stem in ("fig1_nc_vs_loss__a", "fig1_nc_vs_loss__b", "fig1_nc_vs_loss__untagged"):
        assert (out / f"{stem}.png").is_file() and (out / f"{stem}.pdf").is_file() and f"({stem}.png)" in text
    assert not (out / "fig1_nc_vs_loss.png").exists()
    tex = (out / "tables.tex").read_text()
    assert "tag a:" in tex and "tag b:" in tex and "tag (untagged):" in tex


@pytest.mark.slow
def test_tag_is_a_plain_column_for_where_and_per_run_last_keeps_one_row_per_run(tmp_path):
    df = two_tags(np.random.default_rng(4))
    csv = tmp_path / "m.csv"
    df.to_csv(csv, index=False)
    for where, n in (("tag == 'a'", 8), ("tag.isna()", 3), ("tag == ''", 3), ("tag != ''", 16), ("tag.notna()", 16),
                     ("tag.isna() and global_step == 3", 3)):
        run_cli("report", csv, "--out", tmp_path / "w", "--where", where, "--metrics", "nc1_cdnv",
                "--target", "eval_loss", "--permutations", 50)
        assert len(pd.read_csv(tmp_path / "w" / "metrics.csv")) == n, where
    run_cli("report", csv, "--out", tmp_path / "last", "--where", "tag == 'a'", "--per-run", "last",
            "--metrics", "nc1_cdnv", "--target", "eval_loss", "--permutations", 50)
    metrics = pd.read_csv(tmp_path / "last" / "metrics.csv")
    assert sorted(metrics.run) == ["r0", "r1", "r2", "r3"] and (metrics.global_step == 2).all()
    stats = pd.read_csv(tmp_path / "last" / "stats.csv")
    assert (stats.n == 4).all() and (stats.perm_scheme == "rows").all() and (stats.n_distinct_perms == 24).all()
    text = (tmp_path / "last" / "report.md").read_text()
    assert "`--per-run last`" in text and "rows (4 checkpoints" in text and "no p can fall below 1/24" not in text
    err = run_cli("report", csv, "--out", tmp_path / "bad", "--per-run", "first", ok=False)
    assert "first" in err.output


def test_p_values_never_look_the_same_across_alpha():
    survivor, not_one = fmt_p(0.049995), fmt_p(0.0505)
    assert survivor != not_one and float(survivor) < 0.05 <= float(not_one)
    assert fmt_p(0.0123456) == "0.0123" and fmt_p(0.5) == "0.500" and fmt_p(2.5e-5) == "2.50e-05"
    assert float(fmt_p(0.04999999)) < 0.05 and fmt_p(np.nan) == "—"


def depth_rows(layers_of: dict[str, list[int]]) -> pd.DataFrame:
    """A metrics table: per run (n_layers = the last layer) three checkpoints at the given layers; layer 0's CDNV
    and GNC2 infinite."""
    rows = []
    rng = np.random.default_rng(0)
    for run, layers in layers_of.items():
        for s in (1, 2, 3):
            for layer in layers:
                rows.append(dict(run=run, checkpoint=f"checkpoint-{s}", global_step=s, n_layers=max(layers),
                                 n_params=1e5 * max(layers), eval_loss=3 - 0.3 * s + rng.normal(0, 0.05), layer=layer,
                                 nc1_cdnv=np.inf if layer == 0 else rng.uniform(1, 2),
                                 gnc2_log_std=np.nan if layer == 0 else rng.uniform(0, 1),
                                 nc4_agreement=rng.uniform(0.2, 0.6)))
    return pd.DataFrame(rows)


@pytest.mark.slow
def test_depth_only_where_a_checkpoint_has_several_layers_with_gaps_said(tmp_path):
    options = ReportOptions(metrics=["nc1_cdnv", "nc4_agreement"], target="eval_loss", n_perm=0)
    lasts = depth_rows({"neo-1x32": [1], "neo-2x32": [2]})  # 1- and 2-block models, last layers only
    r = write_report(lasts, tmp_path / "flat", options)
    assert r.depth is None and not (tmp_path / "flat" / "depth.png").exists()
    assert "Across depth" not in (tmp_path / "flat" / "report.md").read_text()
    deep = depth_rows({"neo-2x32": [0, 1, 2]})
    r = write_report(deep, tmp_path / "deep", options)
    for ext in ("png", "pdf", "svg"):
        assert (tmp_path / "deep" / f"depth.{ext}").is_file()
    from PIL import Image
    assert 1500 < Image.open(tmp_path / "deep" / "depth.png").size[0] <= 2000  # three panels a row, not four
    text = (tmp_path / "deep" / "report.md").read_text()
    assert "`nc1_cdnv` is infinite at layer(s) 0 (3 of 9 rows): a gap in its panel" in text
    assert "`gnc2_log_std` is undefined (nan) at layer(s) 0 (3 of 9 rows)" in text
    assert list(pd.read_csv(tmp_path / "deep" / "layers.csv").layer) == [0, 1, 2] * 3


def measured_store(path, counts: list[np.ndarray], min_count: int = 1) -> pd.DataFrame:
    """A store of one run whose checkpoints have these train counts (with the attributes extraction and measure
    write), and its metrics table."""
    rows = []
    for s, count in enumerate(counts, 1):
        v = len(count)
        ds = xr.Dataset({"count": ("vocab", count), "val_count": ("vocab", np.full(v, 3))},
                        coords={"vocab": np.arange(v)},
                        attrs={"run": "runA", "checkpoint": f"checkpoint-{s}", "train_tokens": int(count.sum()),
                               "val_tokens": 3 * v, "metrics_min_count": min_count})
        ensure_group(path)  # a store of this version's format
        ds.to_zarr(path, group=f"runA/checkpoint-{s}", mode="w", consolidated=False, zarr_format=3)
        rows.append(dict(run="runA", checkpoint=f"checkpoint-{s}", global_step=s, n_params=1e6,
                         eval_loss=3.0 - 0.1 * s, nc1_cdnv=1.0 + 0.2 * s, nc4_agreement=0.1 * s))
    return pd.DataFrame(rows)


@pytest.mark.slow
def test_metrics_csv_says_what_the_numbers_rest_on_and_warns_on_thin_classes(tmp_path):
    rng = np.random.default_rng(1)
    thin = [rng.integers(0, 5, 200) for _ in range(3)]  # most kept classes under 5 tokens
    store = tmp_path / "thin.zarr"
    df = measured_store(store, thin, min_count=2)
    options = ReportOptions(formats="png",
                            metrics=["nc1_cdnv", "nc4_agreement"], target="eval_loss", n_perm=0, store=store)
    write_report(df, tmp_path / "thin", options, read_group=partial(read_group, store))
    metrics = pd.read_csv(tmp_path / "thin" / "metrics.csv")
    for count, (_, row) in zip(thin, metrics.iterrows()):
        kept = count >= 2
        assert row.n_kept == kept.sum() and row.n_singletons == 0 and row.n_thin == ((count < THIN) & kept).sum()
        assert row.train_tokens == count.sum() and row.val_tokens == 600
    text = (tmp_path / "thin" / "report.md").read_text()
    assert "**Warning:** In 3 of 3 checkpoint(s) more than 25% of the kept classes have fewer than 5" in text
    assert "- `nc1_cdnv`: lower is more collapse" in text and "- `nc4_agreement`: higher is more collapse" in text
    thick = [rng.integers(1, 4, 200) * 10 for _ in range(3)]
    thick[0][:7] = 1  # seven singletons
    store = tmp_path / "thick.zarr"
    df = measured_store(store, thick)
    write_report(df, tmp_path / "thick", options, read_group=partial(read_group, store))
    metrics = pd.read_csv(tmp_path / "thick" / "metrics.csv")
    assert list(metrics.n_singletons) == [7, 0, 0] and list(metrics.n_kept) == [200] * 3
    assert "**Warning:**" not in (tmp_path / "thick" / "report.md").read_text()
    assert set(DIRECTION) == set(SCALARS)


def test_measure_without_a_classifier_gives_every_key_nan_with_a_warning():
    from ncanalyze.analyzer.metrics import measure

    rng = np.random.default_rng(0)
    v, d = 12, 6
    ds = stats_dataset(rng.integers(2, 9, v), rng.normal(size=(v, d)), rng.uniform(0.5, 1, v), np.eye(d))
    with pytest.warns(UserWarning, match="nc3_cos_mean.* are nan: the dataset lacks"):
        out = measure(ds, se=False)
    assert set(out) == {*SCALARS, *CLASS_COUNTS}
    assert all(np.isnan(out[k]) for k in NC3_NC4)
    assert np.isfinite(out["nc1_cdnv"])


def test_report_and_explore_store_read_a_bare_word_alike(tmp_path):
    from ncanalyze.analyzer.report import TokenNote, resolve_token

    strings = np.array(["<eos>", "and", " and", "the"], dtype=object)
    ds = xr.Dataset({"count": ("vocab", np.ones(4))}, coords={"vocab": np.arange(4), "token": ("vocab", strings)})
    explore = _load_example("explore_store")
    with pytest.warns(TokenNote, match="for the token 'and' itself pass its id 1"):
        assert resolve_token("and", strings, None, 4) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert explore.token_id("and", ds) == 2 and explore.token_id("1", ds) == 1
        assert explore.token_id("the", ds) == resolve_token("the", strings, None, 4) == 3


def test_help_says_the_default_target_is_val_loss():
    text = " ".join(run_cli("report", "--help").output.split())
    assert "default: val_loss" in text and "else eval_loss" in text and "--per-run [all|last]" in text
    assert "against eval loss" not in text
    assert "tag.isna()" in text


def one_block(trained_run, dest):
    """The trained 2-block checkpoint cut to its first block: a real 1-block GPT-Neo checkpoint with the tokenizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lone_model(trained_run, dest.parent / "two-copy"))
    model.transformer.h = model.transformer.h[:1]
    model.config.num_layers, model.config.attention_layers = 1, model.config.attention_layers[:1]
    model.config.attention_types = [[model.config.attention_layers, 1]]
    model.save_pretrained(dest)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained_run / f, dest / f)
    return dest


@pytest.mark.slow
def test_a_store_of_1_and_2_block_models_without_layers_draws_no_depth(trained_run, corpus, tmp_path):
    store = tmp_path / "depths.zarr"
    two = lone_model(trained_run, tmp_path / "neo-2")
    one = one_block(trained_run, tmp_path / "neo-1")
    for path in (one, two):
        run_cli("extract", path, "--dataset", corpus["train"], "--store", store, "--max-train-tokens", 2048,
                "--max-val-tokens", 1024, "--batch-size", 8, "--samples-per-class", 1)
    run_cli("report", store, "--out", tmp_path / "r", "--permutations", 0, "--target", "val_loss")
    metrics = pd.read_csv(tmp_path / "r" / "metrics.csv")
    assert sorted(metrics.n_layers) == [1, 2] and (metrics.layer == metrics.n_layers).all()
    assert not any((tmp_path / "r" / f"depth.{ext}").exists() for ext in ("png", "pdf", "svg"))
    assert not (tmp_path / "r" / "layers.csv").exists()
    assert "Across depth" not in (tmp_path / "r" / "report.md").read_text()


@pytest.mark.slow
def test_nc1_cdnv_p2_is_said_to_scale_as_one_over_length_squared_not_read_as_collapse():
    """Doubling the features divides nc1_cdnv_p2 by 4 (CDNV stays): its direction line says so, not "lower is more
    collapse"; it is a Holm family of its own; its panel title says it."""
    from ncanalyze.analyzer import class_stats, measure
    from ncanalyze.analyzer.report.figures import label
    from ncanalyze.analyzer.report.support import direction_lines
    from ncanalyze.analyzer.stats import family
    rng = np.random.default_rng(0)
    y = rng.integers(0, 6, 600)
    h = rng.normal(size=(6, 8))[y] * 3 + rng.normal(size=(600, 8))
    one, two = measure(class_stats(h, y, 6)), measure(class_stats(2 * h, y, 6))  # the features doubled
    assert two["nc1_cdnv_p2"] == pytest.approx(one["nc1_cdnv_p2"] / 4, rel=1e-9)
    assert two["nc1_cdnv"] == pytest.approx(one["nc1_cdnv"], rel=1e-9)
    (line,) = direction_lines(["nc1_cdnv_p2"])
    assert line.startswith("- `nc1_cdnv_p2`: scales as 1/length² (") and "doubling the features divides it by 4" in line
    assert "not read as more or less collapse" in line and "lower is more collapse" not in line
    assert family("nc1_cdnv_p2") == "nc1_cdnv_p2" and family("nc1_cdnv") == "NC"
    assert "1/length²" in label("nc1_cdnv_p2")
