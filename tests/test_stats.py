"""Correlations, partial correlations and permutation p-values against numpy, pingouin and scipy."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pingouin as pg
import pytest
from scipy import stats as sps

from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.stats import METRICS, correlations, perm_test, permutation_chunks


def study(n_runs: int = 6, per_run: int = 8, seed: int = 0) -> pd.DataFrame:
    """Runs of several sizes, checkpoints along training; metrics with a mix of positive and signed values."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(n_runs):
        n_params = int(rng.integers(1, 100)) * 10 ** 5
        for s in range(1, per_run + 1):
            loss = 2 + 30 / n_params ** 0.25 + 2 / s ** 0.5 + rng.normal(0, 0.05)
            row = dict(run=f"r{r}", checkpoint=f"checkpoint-{100 * s}", global_step=100 * s, n_params=n_params,
                       eval_loss=loss)
            row |= {m: np.exp(rng.normal(0, 0.3) + (i % 3) * loss) for i, m in enumerate(METRICS)}
            row["nc2_cos_mean"] = -0.05 * loss + rng.normal(0, 0.02)  # signed: no log scale
            rows.append(row)
    return pd.DataFrame(rows)


def residual(a: np.ndarray, Z: np.ndarray) -> np.ndarray:
    """a minus its least-squares fit on [1, Z] (columns of a, or a batch in the last axis transposed)."""
    A = np.column_stack([np.ones(len(Z)), Z])
    return a - A @ np.linalg.lstsq(A, a, rcond=None)[0]


# ---------------------------------------------------------------- r, R², partial r

def test_r_r2_and_partial_r_equal_numpy_and_pingouin():
    df = study()
    df.loc[[3, 17], "nc1_trace"] = np.nan  # missing values: that metric uses the complete rows only
    out = correlations(df, n_perm=0).set_index(["metric", "scale"])
    controls = pd.DataFrame({"ln": np.log(df.n_params), "ls": np.log1p(df.global_step)})
    for m in METRICS:
        for scale in ("raw", "log"):
            row = out.loc[(m, scale)]
            if scale == "log" and m == "nc2_cos_mean":
                assert np.isnan(row.r) and "not positive" in row.note
                continue
            x = df[m] if scale == "raw" else np.log10(df[m])
            ok = x.notna()
            r_np = np.corrcoef(x[ok], df.eval_loss[ok])[0, 1]
            assert row.n == ok.sum()
            assert row.r == pytest.approx(r_np, abs=1e-12)
            assert row.r2 == pytest.approx(r_np ** 2, abs=1e-12)
            assert row.r == pytest.approx(pg.corr(x[ok], df.eval_loss[ok])["r"].iloc[0], abs=1e-12)
            assert row.p_param == pytest.approx(sps.pearsonr(x[ok], df.eval_loss[ok]).pvalue, rel=1e-9)
            data = pd.concat({"x": x, "y": df.eval_loss, "ln": controls.ln, "ls": controls.ls}, axis=1)[ok]
            pc = pg.partial_corr(data, x="x", y="y", covar=["ln", "ls"])
            assert row.partial_r == pytest.approx(pc["r"].iloc[0], abs=1e-12)
            assert row.partial_p_param == pytest.approx(pc["p_val"].iloc[0], rel=1e-9)
            # and the residual definition, computed independently
            ex = residual(x[ok].to_numpy(), controls[ok].to_numpy())
            ey = residual(df.eval_loss[ok].to_numpy(), controls[ok].to_numpy())
            assert row.partial_r == pytest.approx(np.corrcoef(ex, ey)[0, 1], abs=1e-12)


def test_perm_test_observed_partial_r_is_pingouins():
    rng = np.random.default_rng(1)
    n = 25
    Z = rng.normal(size=(n, 2))
    y = Z @ [1.0, -0.5] + rng.normal(size=n)
    X = np.column_stack([y + rng.normal(size=n), Z[:, 0] + rng.normal(size=n), rng.normal(size=n)])
    res = perm_test(y, X, Z, n_perm=0)
    for j in range(X.shape[1]):
        d = pd.DataFrame({"x": X[:, j], "y": y, "z0": Z[:, 0], "z1": Z[:, 1]})
        assert res["partial_r"][j] == pytest.approx(pg.partial_corr(d, "x", "y", ["z0", "z1"])["r"].iloc[0],
                                                    abs=1e-12)
        assert res["r"][j] == pytest.approx(np.corrcoef(X[:, j], y)[0, 1], abs=1e-12)


# ---------------------------------------------------------------- permutation p-values against scipy

def _abs_r(x, y):
    return lambda a, axis=-1: np.abs(sps.pearsonr(a, y, axis=axis).statistic)


def test_exact_permutation_p_equals_scipy():
    """n = 6: 720 <= 10^4 permutations, so both enumerate all of them and must agree exactly."""
    rng = np.random.default_rng(2)
    y = rng.normal(size=6)
    X = np.column_stack([y + rng.normal(size=6), rng.normal(size=6), -y + 0.3 * rng.normal(size=6)])
    res = perm_test(y, X, None, n_perm=10_000)
    assert res["exact"] and res["n_perm"] == 720
    for j in range(X.shape[1]):
        ref = sps.permutation_test((y,), _abs_r(y, X[:, j]), permutation_type="pairings", vectorized=True,
                                   n_resamples=10_000, alternative="greater")
        assert res["p_perm"][j] == pytest.approx(ref.pvalue, abs=1e-12)


def _mc_tol(p: float, b: int) -> float:
    """4 standard errors of the difference of two independent Monte-Carlo estimates of p from b draws each."""
    return 4 * math.sqrt(2 * p * (1 - p) / b) + 2 / b


def test_random_permutation_p_agrees_with_scipy_within_monte_carlo_error():
    rng = np.random.default_rng(3)
    n, b = 30, 10_000
    y = rng.normal(size=n)
    X = np.column_stack([0.35 * y + rng.normal(size=n), 0.2 * y + rng.normal(size=n), rng.normal(size=n)])
    res = perm_test(y, X, None, n_perm=b, seed=0)
    assert not res["exact"] and res["n_perm"] == b
    for j in range(X.shape[1]):
        ref = sps.permutation_test((y,), _abs_r(y, X[:, j]), permutation_type="pairings", vectorized=True,
                                   n_resamples=b, alternative="greater", rng=1).pvalue
        assert 0.005 < ref < 0.995  # a p that Monte-Carlo error can actually move
        assert abs(res["p_perm"][j] - ref) < _mc_tol(ref, b), (j, res["p_perm"][j], ref)


def test_freedman_lane_p_agrees_with_scipy_on_permuted_residuals():
    """Freedman-Lane written directly: permute e = resid(y | Z), y* = yhat + e*, statistic |partial r(x, y* | Z)|."""
    rng = np.random.default_rng(4)
    n, b = 40, 10_000
    Z = np.column_stack([rng.normal(size=n), rng.uniform(size=n)])
    y = Z @ [1.0, 2.0] + rng.normal(size=n)
    X = np.column_stack([Z[:, 0] + 0.3 * y + rng.normal(size=n), Z[:, 1] + rng.normal(size=n)])
    res = perm_test(y, X, Z, n_perm=b, seed=5)
    e = residual(y, Z)
    yhat = y - e
    for j in range(X.shape[1]):
        ex = residual(X[:, j], Z)

        def stat(e_perm, axis=-1):
            ystar = np.atleast_2d(yhat + e_perm)
            ey = residual(ystar.T, Z).T
            r = ey @ ex / np.linalg.norm(ey, axis=-1) / np.linalg.norm(ex)
            return np.abs(r).reshape(np.shape(e_perm)[:-1])

        ref = sps.permutation_test((e,), stat, permutation_type="pairings", vectorized=True, n_resamples=b,
                                   alternative="greater", rng=2).pvalue
        assert 0.005 < ref < 0.995
        assert abs(res["partial_p_perm"][j] - ref) < _mc_tol(ref, b), (j, res["partial_p_perm"][j], ref)


def test_p_values_are_reproducible_for_a_seed():
    df = study(seed=5)
    a, b = correlations(df, n_perm=2000, seed=7), correlations(df, n_perm=2000, seed=7)
    pd.testing.assert_frame_equal(a, b)
    c = correlations(df, n_perm=2000, seed=8)
    moderate = a.p_perm.between(0.02, 0.98)
    assert moderate.any() and not np.allclose(a.p_perm[moderate], c.p_perm[moderate])


def test_permutation_chunks_cover_the_requested_count_with_true_permutations():
    n = 3000  # chunks of 2**20 // 3000 = 349 permutations
    chunks, total, exact = permutation_chunks(n, 1000, seed=0)
    blocks = list(chunks)
    assert total == 1000 and not exact and len(blocks) == 3
    allp = np.concatenate(blocks)
    assert allp.shape == (1000, n)
    assert (np.sort(allp, axis=1) == np.arange(n)).all()
    chunks, total, exact = permutation_chunks(4, 100, seed=0)
    perms = np.concatenate(list(chunks))
    assert exact and total == 24 and len({tuple(p) for p in perms}) == 24


# ---------------------------------------------------------------- Freedman-Lane on planted data

def planted(seed: int, n: int = 60):
    """Loss driven by size and training; 'confounded' follows the same controls but not the loss itself,
    'related' follows the loss."""
    rng = np.random.default_rng(seed)
    Z = np.column_stack([rng.uniform(14, 20, n), np.log1p(rng.integers(100, 10_000, n))])
    loss = 8 - 0.2 * Z[:, 0] - 0.3 * Z[:, 1] + rng.normal(0, 0.1, n)
    confounded = 1 - 0.05 * Z[:, 0] - 0.08 * Z[:, 1] + rng.normal(0, 0.03, n)
    related = loss + rng.normal(0, 0.1, n)
    return loss, np.column_stack([confounded, related]), Z


def test_freedman_lane_separates_confounded_from_related_metrics():
    p_r, p_fl, p_fl_related = [], [], []
    for seed in range(40):
        y, X, Z = planted(seed)
        res = perm_test(y, X, Z, n_perm=2000, seed=seed)
        p_r.append(res["p_perm"][0])
        p_fl.append(res["partial_p_perm"][0])
        p_fl_related.append(res["partial_p_perm"][1])
    p_r, p_fl = np.array(p_r), np.array(p_fl)
    assert (p_r < 0.01).all()  # the raw correlation is strong: size and training drive both
    # controlled, the confounded metric is null: about uniform p, 5% rejections (P(>= 7 of 40) < 0.3%)
    assert (p_fl < 0.05).sum() <= 6 and np.median(p_fl) > 0.25
    assert (np.array(p_fl_related) < 0.01).all()


# ---------------------------------------------------------------- too little data, bad input

def test_too_few_checkpoints_give_a_note_not_a_number():
    df = study().head(2)
    out = correlations(df, n_perm=100)
    assert out.r.isna().all()
    assert out[out.scale == "raw"].note.str.contains("n=2 < 3 checkpoints: too few for a correlation").all()


def test_partial_r_needs_more_points_than_controls():
    df = study(n_runs=2, per_run=2)  # 4 points, 2 varying controls: r yes, partial r no (needs 5)
    out = correlations(df, metrics=["nc1_cdnv"], n_perm=100)
    raw = out[out.scale == "raw"].iloc[0]
    assert np.isfinite(raw.r) and np.isnan(raw.partial_r)
    assert "too few for a partial r with 2 control(s)" in raw.note


def test_constant_control_is_dropped_and_said_so():
    df = study(n_runs=1, per_run=12)  # one run: n_params constant
    out = correlations(df, metrics=["nc1_cdnv"], n_perm=100)
    raw = out[out.scale == "raw"].iloc[0]
    assert "ignores log(n_params)" in raw.note and raw.controls == "log1p(global_step)"
    d = pd.DataFrame({"x": df.nc1_cdnv, "y": df.eval_loss, "s": np.log1p(df.global_step)})
    assert raw.partial_r == pytest.approx(pg.partial_corr(d, "x", "y", ["s"])["r"].iloc[0], abs=1e-12)


def test_constant_metric_says_so():
    df = study().assign(nc1_cdnv=1.0)
    out = correlations(df, metrics=["nc1_cdnv"], n_perm=10)
    assert out.r.isna().all() and out.note.str.contains("metric constant").all()


def test_a_metric_without_values_is_a_note():
    df = study().assign(nc4_agreement=np.nan)  # e.g. extracted without validation tokens
    out = correlations(df, metrics=["nc1_cdnv", "nc4_agreement"], n_perm=100).set_index(["metric", "scale"])
    assert out.loc["nc4_agreement"].r.isna().all() and (out.loc["nc4_agreement"].note == "no values "
                                                           "(not measurable here)").all()
    assert np.isfinite(out.loc[("nc1_cdnv", "raw"), "r"])


@pytest.mark.parametrize("kw, match", [
    (dict(target="nope"), "target 'nope' is not a column"),
    (dict(target="run"), "target 'run' has no values"),
    (dict(metrics=["nope"]), "metric 'nope' is not a column"),
    (dict(controls=["log(nope)"]), "control 'log\\(nope\\)': unknown name 'nope'"),
])
def test_bad_input_is_a_user_error(kw, match):
    with pytest.raises(UserError, match=match):
        correlations(study(), n_perm=10, **kw)


def test_a_control_nobody_recorded_is_not_used_and_said_so():
    df = study().astype({"global_step": object})
    df["global_step"] = None  # e.g. model folders without trainer_state.json
    out = correlations(df, metrics=["nc1_cdnv"], n_perm=100)
    raw = out[out.scale == "raw"].iloc[0]
    assert raw.n == len(df) and raw.controls == "log(n_params)"
    assert "control log1p(global_step) has no values: not used" in raw.note
    d = pd.DataFrame({"x": df.nc1_cdnv, "y": df.eval_loss, "s": np.log(df.n_params)})
    assert raw.partial_r == pytest.approx(pg.partial_corr(d, "x", "y", ["s"])["r"].iloc[0], abs=1e-12)


# ---------------------------------------------------------------- Holm across the metrics

def test_holm_columns_equal_statsmodels_per_scale():
    from statsmodels.stats.multitest import multipletests

    df = study(n_runs=4, per_run=4, seed=8)
    df["nc4_agreement"] = np.nan  # no values: no p, not in the family
    out = correlations(df, n_perm=300, seed=1)
    for scale in ("raw", "log"):
        rows = out[out.scale == scale]
        for col, adj in (("p_perm", "p_holm"), ("partial_p_perm", "partial_p_holm")):
            ok = np.isfinite(rows[col])
            assert ok.sum() == len(METRICS) - 1 - (scale == "log")  # nc4 empty; nc2_cos_mean has no log scale
            ref = multipletests(rows.loc[ok, col], method="holm")[1]
            np.testing.assert_allclose(rows.loc[ok, adj], ref, rtol=0, atol=0)
            assert rows.loc[~ok, adj].isna().all()
            assert (rows.loc[ok, adj] >= rows.loc[ok, col]).all()


def test_an_infinite_target_is_left_out_with_a_note():
    df = study(n_runs=3, per_run=4)
    bad = df.copy()
    bad.loc[bad.index[0], "eval_loss"] = np.inf
    got = correlations(bad, ["nc1_cdnv"], n_perm=0)
    want = correlations(df.drop(index=df.index[0]), ["nc1_cdnv"], n_perm=0)
    np.testing.assert_allclose(got.r, want.r)
    assert (got.n == len(df) - 1).all() and got.note.str.contains("1 checkpoint\\(s\\) with an infinite eval_loss").all()
