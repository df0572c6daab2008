"""THE test of honest p-values: under a null where runs differ but the metric and the loss are unrelated, the
permutation p-values that respect runs reject at about alpha, and row-level permutations (the old defect) do not.

The null: each run has its own size, its own offset and its own slope in log(step) for the loss, and,
independently, its own offset and slope for the metric; both fall with training on average (a trend every run
shares), several checkpoints per run, noise on top. The metric carries no information on the loss beyond what
every run shares by position, so a test of "metric and loss related" must reject at rate alpha.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from ncanalyze.analyzer.permute import Scheme, perm_test
from ncanalyze.analyzer.stats import correlations, correlations_by_tag
from scipy import stats as sps

ALPHA = 0.05
N_DATASETS = 400
N_PERM = 199
MAX_RATE = 0.08  # P(> 32 of 400 | rate 0.05) = 0.004: a valid test almost never goes past it
SIZES = {"equal runs (7 x 4 checkpoints: 5040 permutations, 199 drawn)": [4] * 7,
         "unequal runs (3 x 3 and 4 x 4 checkpoints: 3! 4! = 144 permutations, all)": [3, 3, 3, 4, 4, 4, 4]}


def null_study(seed: int, sizes: list[int]) -> pd.DataFrame:
    """Runs with their own size, loss and metric offsets and slopes in log step, metric and loss independent;
    run r has checkpoints at steps 250, 500, ... (sizes[r] of them), rows shuffled."""
    rng = np.random.default_rng(seed)
    rows = []
    for r, k in enumerate(sizes):
        n_params = float(rng.choice([1, 2, 4, 8]) * 1e6)
        loss0, slope_loss = rng.normal(0, 0.3), rng.normal(-0.4, 0.15)
        metric0, slope_metric = rng.normal(0, 1.0), rng.normal(-0.5, 0.3)
        for step in 250 * np.arange(1, k + 1):
            t = np.log(step) - np.log(500)
            rows.append(dict(run=f"r{r}", global_step=int(step), n_params=n_params,
                             loss=3 - 0.2 * np.log2(n_params / 1e6) + loss0 + slope_loss * t + rng.normal(0, 0.05),
                             metric=metric0 + slope_metric * t + rng.normal(0, 0.1)))
    return pd.DataFrame(rows).sample(frac=1, random_state=seed).reset_index(drop=True)


def p_values(df: pd.DataFrame, seed: int, scheme: Scheme) -> np.ndarray:
    """(p of r, p of rho, Freedman-Lane p of the partial r given log n_params and log1p step) under ``scheme``."""
    C = np.column_stack([np.log(df.n_params), np.log1p(df.global_step)])
    res = perm_test(df.loss.to_numpy(), df[["metric"]].to_numpy(), C, N_PERM, seed, scheme)
    return np.array([res["p_perm"][0], res["rho_p"][0], res["partial_p_perm"][0]])


@pytest.mark.slow
@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
def test_false_positive_rate_stays_near_alpha_when_runs_are_permuted_whole(sizes):
    whole, rows = [], []
    for seed in range(N_DATASETS):
        df = null_study(seed, sizes)
        whole.append(p_values(df, seed, Scheme.whole_blocks(df.run, df.global_step)))
        rows.append(p_values(df, seed, Scheme.rows(len(df))))
    whole_rate = (np.array(whole) <= ALPHA).mean(axis=0)  # r, rho, partial r
    rows_rate = (np.array(rows) <= ALPHA).mean(axis=0)
    assert sps.binom.sf(MAX_RATE * N_DATASETS, N_DATASETS, ALPHA) < 0.005
    assert (whole_rate <= MAX_RATE).all(), whole_rate
    assert (whole_rate >= 0.02).all(), whole_rate  # a test that can reject at all, not one that never does
    # the defect it fixes: row permutations treat a run's checkpoints as independent and call the unrelated metric
    # significant several times more often than alpha
    assert (rows_rate >= 4 * ALPHA).all(), rows_rate


@pytest.mark.slow
def test_the_report_statistics_use_the_same_scheme_and_p_values():
    """correlations(..., runs="run") and correlations_by_tag (runs by default) give exactly the p-values counted
    above, and say which scheme (6 seeds, 3 of each design; no bootstrap: its intervals are tested in test_stats)."""
    for seed in range(6):
        sizes = list(SIZES.values())[seed % 2]
        df = null_study(seed, sizes)
        got = correlations(df, ["metric"], "loss", n_perm=N_PERM, seed=seed, runs="run", n_boot=0)
        raw = got[got.scale == "raw"].iloc[0]
        want = p_values(df, seed, Scheme.whole_blocks(df.run, df.global_step))
        np.testing.assert_array_equal([raw.p_perm, raw.rho_p, raw.partial_p_perm], want)
        assert raw.perm_scheme == "whole runs" and raw.n_units == 7
        assert raw.n_distinct_perms == (5040 if seed % 2 == 0 else 144) and raw.exact == (seed % 2 == 1)
        by_tag = correlations_by_tag(df, ["metric"], "loss", n_perm=N_PERM, seed=seed, n_boot=0)  # the report's
        pd.testing.assert_frame_equal(by_tag.drop(columns="tag"), got, check_dtype=False)
        rows = correlations(df, ["metric"], "loss", n_perm=N_PERM, seed=seed, n_boot=0)  # runs not given: rows
        assert rows[rows.scale == "raw"].iloc[0].perm_scheme == "rows"
        np.testing.assert_array_equal(rows[rows.scale == "raw"].iloc[0][["p_perm", "rho_p", "partial_p_perm"]]
                                      .to_numpy(float), p_values(df, seed, Scheme.rows(len(df))))


def test_the_null_centre_is_the_mean_r_over_every_whole_run_permutation():
    """With a trend every run shares, the whole-run null is not centred at 0: r_null is the mean r over the
    enumerated permutations (itertools, one at a time); the p is equal-tailed (twice the smaller tail)."""
    df = null_study(3, [3, 3, 3, 3, 3])  # 5! = 120 permutations, all enumerated
    scheme = Scheme.whole_blocks(df.run, df.global_step)
    y, x = df.loss.to_numpy(), df.metric.to_numpy()
    res = perm_test(y, x[:, None], None, 1000, 0, scheme)
    chunks, total, exact = scheme.chunks(1000, 0)
    null = np.array([np.corrcoef(x, y[idx])[0, 1] for chunk in chunks for idx in chunk])
    assert exact and total == len(null) == 120
    assert res["r_null"][0] == pytest.approx(null.mean(), abs=1e-12) and abs(null.mean()) > 0.05
    r = np.corrcoef(x, y)[0, 1]
    tail = min((null <= r + 1e-12).mean(), (null >= r - 1e-12).mean())
    assert res["p_perm"][0] == pytest.approx(min(1, 2 * tail), abs=1e-12)
