"""Each claim's statistic measured against a planted truth (issue 47): within training beyond what all runs share at
a step (the two-way fixed-effects r), the floor of an equal-tailed p, R²'s interval, fragility by one run's
influence, the design's controls, and the studies where no estimand is defined."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import statsmodels.formula.api as smf

from ncanalyze.analyzer.stats import control_choice, correlations
from ncanalyze.core.errors import UserError

STEPS = (120, 240, 360, 480)
PLANTED = ("own", "between", "unrelated", "flat", "clock")


def worked_shape(seed: int, n_runs: int = 21) -> pd.DataFrame:
    """A study shaped like the worked study (21 runs x 4 steps): the loss is a run's level, the trend every run
    shares, and the run's own moves. ``own`` tracks those moves; ``between`` is a run's level and the shared
    trend only (a relation between models, none within training beyond the trend); ``unrelated`` has a level and
    the trend but no relation; ``flat`` is noise; ``clock`` is 1/global_step, the same in every run."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_runs):
        level, other = rng.normal(0, 0.3), rng.normal(0, 0.3)
        for step in STEPS:
            trend, move = 1.5 / np.sqrt(step / 120), rng.normal(0, 0.05)
            loss = 3 + level + trend + move
            rows.append(dict(run=f"run{i}", global_step=step, eval_loss=loss, n_params=1e6,
                             own=1 + other + 0.5 * trend + move + rng.normal(0, 0.04),
                             between=2 + level + 0.8 * trend + rng.normal(0, 0.01),
                             unrelated=2 + other + trend + rng.normal(0, 0.05),
                             flat=1 + rng.normal(0, 0.05), clock=1 / step))
    return pd.DataFrame(rows)


def fe_r(df: pd.DataFrame, metric: str) -> float:
    """The two-way fixed-effects r by brute force: both residualised on C(run) + C(global_step) by statsmodels."""
    e = {v: smf.ols(f"{v} ~ C(run) + C(global_step)", df).fit().resid for v in (metric, "eval_loss")}
    return float(np.corrcoef(e[metric], e["eval_loss"])[0, 1])


@pytest.mark.slow
def test_within_training_finds_each_run_s_own_moves_and_not_the_shared_trend():
    found = {m: 0 for m in PLANTED}
    fragile_between = 0
    for seed in range(5):
        df = worked_shape(seed)
        st = correlations(df, list(PLANTED), "eval_loss", ("log1p(global_step)",), n_perm=2000, seed=seed,
                          runs="run", n_boot=0).set_index(["metric", "scale"])
        for m in PLANTED:
            s = st.loc[(m, "raw")]
            found[m] += bool(s.within_p < 0.05 and s.within_r > 0)
            if m != "clock":
                assert s.within_r == pytest.approx(fe_r(df, m), abs=1e-10)  # the estimand, by statsmodels
                assert s.within_ci_low <= s.within_r <= s.within_ci_high and s.ci_units == 21
        clock = st.loc[("clock", "raw")]
        assert np.isnan(clock.within_r) and np.isnan(clock.within_p) and "run and step effects" in clock.within_why
        fragile_between += st.loc[("between", "raw"), "robust"] == 0
        assert st.loc[("between", "raw"), "between_r_last"] > 0.9  # the relation it has: between models
    assert found["own"] >= 4, found
    assert all(found[m] <= 1 for m in ("between", "unrelated", "flat", "clock")), found
    assert fragile_between <= 1


def test_the_floor_of_an_equal_tailed_p_is_2_over_n_and_the_report_says_no_test_reaches_alpha(tmp_path):
    from ncanalyze.analyzer.report import ReportOptions, write_report
    rng = np.random.default_rng(0)
    loss = rng.normal(3, 0.2, 4)
    df = pd.DataFrame(dict(run=[f"r{i}" for i in range(4)], checkpoint="final", global_step=100,
                           eval_loss=loss, nc1_cdnv=loss, n_params=[1e5, 2e5, 4e5, 8e5]))
    st = correlations(df, ["nc1_cdnv"], "eval_loss", (), n_perm=10_000, runs="run", n_boot=0)
    raw = st.set_index("scale").loc["raw"]
    assert raw.r == pytest.approx(1) and raw.exact and raw.n_distinct_perms == 24
    assert raw.p_perm == pytest.approx(2 / 24) and raw.p_floor == pytest.approx(2 / 24)
    r = write_report(df, tmp_path, ReportOptions(metrics=("nc1_cdnv",), target="eval_loss", controls=(),
                                                 n_perm=10_000, n_boot=0, formats=("png",)))
    text = r.files["report"].read_text()
    assert "can reach 0.05 after Holm's adjustment, whatever the data" in text
    assert "p falls below 2/24 = 0.0833" in text and "permutations were drawn" not in text


def test_a_family_s_floor_comes_from_one_row_and_no_advice_to_draw_where_all_were_enumerated(tmp_path):
    from ncanalyze.analyzer.report.tables import unreachable_lines
    df = pd.DataFrame(dict(run=[f"r{i}" for i in range(5) for _ in range(2)], global_step=[100, 200] * 5,
                           eval_loss=np.random.default_rng(1).normal(3, 0.2, 10)))
    df["nc1_cdnv"] = np.random.default_rng(2).normal(1, 0.1, 10)
    df["gnc2_log_std"] = np.random.default_rng(3).normal(1, 0.1, 10)
    df.loc[9, "gnc2_log_std"] = np.nan  # one metric missing at one checkpoint: 4 whole runs of 2 and one of 1
    st = correlations(df, ["nc1_cdnv", "gnc2_log_std"], "eval_loss", (), n_perm=10_000, runs="run", n_boot=0)
    assert set(st.n_distinct_perms) == {120, 24}
    lines = "\n".join(unreachable_lines(st))
    assert "2/24 = 0.0833" in lines and "drawn" not in lines and "--permutations" not in lines


def test_r2_intervals_start_at_0_where_r_s_interval_holds_0():
    df = worked_shape(3)
    st = correlations(df, list(PLANTED[:4]), "eval_loss", (), n_perm=0, runs="run", n_boot=0)
    spans = (st.r_ci_low <= 0) & (st.r_ci_high >= 0)
    assert spans.any() and (st.r2_ci_low[spans] == 0).all()
    assert (st.r2_ci_low[~spans] > 0).all()


def test_a_paired_bootstrap_says_whether_a_relates_more_than_b():
    rng = np.random.default_rng(4)
    loss = rng.normal(3, 0.3, 30)
    df = pd.DataFrame(dict(run=[f"r{i}" for i in range(30)], global_step=100, eval_loss=loss,
                           unc3_cos_cv=loss + rng.normal(0, 0.1, 30), nc3_cos_mean=loss + rng.normal(0, 1.0, 30)))
    st = correlations(df, ["unc3_cos_cv", "nc3_cos_mean"], "eval_loss", (), n_perm=0, runs="run", n_boot=4000)
    s = st.set_index(["metric", "scale"]).loc[("unc3_cos_cv", "raw")]
    assert s.vs_metric == "nc3_cos_mean" and s.d_r2_n_boot == 4000 and s.d_r2_dropped == 0
    r2 = {m: np.corrcoef(df[m], loss)[0, 1] ** 2 for m in ("unc3_cos_cv", "nc3_cos_mean")}
    assert s.d_r2 == pytest.approx(r2["unc3_cos_cv"] - r2["nc3_cos_mean"], abs=1e-12)
    assert 0 < s.d_r2_ci_low < s.d_r2 < s.d_r2_ci_high and s.d_r2_p_le0 < 0.01 and 0 < s.d_r2_mc_error < 0.02


def test_a_diverged_run_does_not_drop_resamples():
    """One run's metric 1e5 times the others' (a diverged run): resamples without it still have a spread, small
    against the whole sample's but real against their own; none is dropped (issue 49)."""
    from ncanalyze.analyzer.resample import bootstrap_weights, run_codes, weighted_partial
    rng = np.random.default_rng(2)
    y = rng.normal(size=40)
    x = 1 + 0.5 * y + rng.normal(size=40)
    x[:4] *= 1e5
    codes = run_codes(np.repeat(np.arange(10), 4), 40)
    W = bootstrap_weights(codes, 500, 0)
    r = weighted_partial(W, x[:, None], y)[:, 0]
    assert np.isfinite(r).all()
    for b in range(0, 500, 50):  # against numpy on the resample itself
        i = np.repeat(np.arange(40), W[b].astype(int))
        assert r[b] == pytest.approx(np.corrcoef(x[i], y[i])[0, 1], abs=1e-9)


def test_nearly_collinear_design_controls_are_reduced_and_said():
    depth = np.repeat([2, 4, 6, 8], 3).astype(float)
    width = np.tile([64, 128, 256], 4).astype(float)
    params = 12 * depth * width ** 2 * (1 + np.random.default_rng(0).normal(0, 0.01, 12))
    C = pd.DataFrame({"log(n_layers)": np.log(depth), "log(hidden_size)": np.log(width),
                      "log(n_params)": np.log(params)})
    keep, why = control_choice(C)
    assert keep == ["log(n_layers)", "log(hidden_size)"] and "VIF" in why["log(n_params)"]
    vif = np.diag(np.linalg.inv(np.corrcoef(C.to_numpy(), rowvar=False)))
    assert vif.max() > 30 and f"VIF {vif[2]:.0f} > 30" in why["log(n_params)"]


def test_no_estimand_no_interval_or_verdict():
    one_run = worked_shape(0, n_runs=1)
    st = correlations(one_run, ["own"], "eval_loss", (), n_perm=100, runs="run", n_boot=1000)
    assert st.r_ci_low.isna().all() and st.within_r.isna().all() and st.robust.isna().all()
    assert st.claims_why.str.contains("1 distinct run").all() and "undefined" in st.note_kinds.iloc[0]
    one_step = worked_shape(0)[lambda d: d.global_step == 480]
    st = correlations(one_step, ["own"], "eval_loss", (), n_perm=100, runs="run", n_boot=1000)
    assert st.within_r.isna().all() and (st.within_why == "one checkpoint per run").all()
    copies = pd.concat([worked_shape(0, n_runs=1).assign(run=f"copy{i}") for i in range(5)])
    st = correlations(copies, ["own"], "eval_loss", (), n_perm=100, runs="run", n_boot=1000)
    assert st.r_ci_low.isna().all() and st.robust.isna().all() and st.d_r2.isna().all()
    assert st.claims_why.str.contains("the runs hold the same numbers").all()


def test_without_permutations_no_sign_is_called_a_flip():
    df = worked_shape(1)
    df["noise"] = np.random.default_rng(9).normal(size=len(df))
    st = correlations(df, ["noise", "flat", "unrelated"], "eval_loss", (), n_perm=0, runs="run", n_boot=0)
    assert not st.note_kinds.fillna("").str.contains("sign_flip").any()


def test_a_bootstrap_too_small_for_its_tails_is_refused_in_one_line(tmp_path):
    from conftest import run_cli
    df = worked_shape(0, n_runs=6)
    df.to_csv(tmp_path / "metrics.csv", index=False)
    with pytest.raises(UserError, match="at least 1000"):
        correlations(df, ["own"], "eval_loss", (), n_perm=0, runs="run", n_boot=999)
    r = run_cli("report", tmp_path / "metrics.csv", "--out", tmp_path / "out", "--bootstrap", "1", ok=False)
    error = [line for line in r.output.splitlines() if "Error" in line or "error" in line]
    assert r.exit_code != 0 and len(error) == 1 and "at least 1000" in error[0] and "Traceback" not in r.output


def test_a_metric_the_same_in_every_run_at_a_step_gets_no_r_there():
    """1/global_step computed per run with a rounding spread (each run's own arithmetic): no r across runs at a
    step, not '+0.00 (p 0.883)' from the last bits."""
    df = worked_shape(2)
    odd = df.run.str[3:].astype(int) % 2 == 1
    df["clock"] = np.where(odd, np.nextafter(1 / df.global_step, 1), 1 / df.global_step)  # one ulp apart
    assert df.groupby("global_step").clock.nunique().max() > 1  # the rounding spread is there
    st = correlations(df, ["clock"], "eval_loss", (), n_perm=200, runs="run", n_boot=0)
    assert st.between_steps.eq(0).all() or st.between_r_min.isna().all()
    from ncanalyze.analyzer.stats import by_step
    steps = by_step(df, ["clock"], "eval_loss", n_perm=200)
    assert len(steps) and steps.r.isna().all()


def test_a_constant_target_gets_no_comparison_and_no_crash():
    df = worked_shape(0, n_runs=8).assign(eval_loss=3.0, unc3_cos_cv=lambda d: d.own, nc3_cos_mean=lambda d: d.flat)
    st = correlations(df, ["unc3_cos_cv", "nc3_cos_mean"], "eval_loss", (), n_perm=50, runs="run", n_boot=1000)
    assert st.d_r2.isna().all() and (st.vs_metric == "").all() and st.note.str.contains("target constant").all()
