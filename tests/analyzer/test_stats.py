"""Correlations, partial correlations and permutation p-values against numpy, pingouin and scipy."""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import pingouin as pg
import pytest
from scipy import stats as sps

from ncanalyze.core.errors import UserError
from statsmodels.stats.multitest import multipletests

from ncanalyze.analyzer.permute import Scheme, perm_test, permutation_chunks
from ncanalyze.analyzer.schema import GEOMETRY_METRICS, NC_METRICS
from ncanalyze.analyzer.stats import (
    METRICS,
    correlations,
    correlations_by_tag,
    last_per_run,
    permutation_text,
    split_tags,
)


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

@pytest.mark.slow
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
            assert row.p_param_iid == pytest.approx(sps.pearsonr(x[ok], df.eval_loss[ok]).pvalue, rel=1e-9)
            data = pd.concat({"x": x, "y": df.eval_loss, "ln": controls.ln, "ls": controls.ls}, axis=1)[ok]
            pc = pg.partial_corr(data, x="x", y="y", covar=["ln", "ls"])
            assert row.partial_r == pytest.approx(pc["r"].iloc[0], abs=1e-12)
            assert row.partial_p_param_iid == pytest.approx(pc["p_val"].iloc[0], rel=1e-9)
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

def _r(x, y):
    return lambda a, axis=-1: sps.pearsonr(a, y, axis=axis).statistic


def test_exact_permutation_p_equals_scipy():
    """n = 6: 720 <= 10^4 permutations, so both enumerate all of them and must agree exactly."""
    rng = np.random.default_rng(2)
    y = rng.normal(size=6)
    X = np.column_stack([y + rng.normal(size=6), rng.normal(size=6), -y + 0.3 * rng.normal(size=6)])
    res = perm_test(y, X, None, n_perm=10_000)
    assert res["exact"] and res["n_perm"] == 720
    for j in range(X.shape[1]):
        ref = sps.permutation_test((y,), _r(y, X[:, j]), permutation_type="pairings", vectorized=True,
                                   n_resamples=10_000, alternative="two-sided")  # equal-tailed, as ours
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
        ref = sps.permutation_test((y,), _r(y, X[:, j]), permutation_type="pairings", vectorized=True,
                                   n_resamples=b, alternative="two-sided", rng=1).pvalue
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
            return r.reshape(np.shape(e_perm)[:-1])

        ref = sps.permutation_test((e,), stat, permutation_type="pairings", vectorized=True, n_resamples=b,
                                   alternative="two-sided", rng=2).pvalue
        assert 0.005 < ref < 0.995
        assert abs(res["partial_p_perm"][j] - ref) < _mc_tol(ref, b), (j, res["partial_p_perm"][j], ref)


@pytest.mark.slow
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


@pytest.mark.slow
def test_partial_r_needs_more_points_than_controls():
    df = study(n_runs=2, per_run=2)  # 4 points, 2 varying controls: r yes, partial r no (needs 5)
    out = correlations(df, metrics=["nc1_cdnv"], n_perm=100)
    raw = out[out.scale == "raw"].iloc[0]
    assert np.isfinite(raw.r) and np.isnan(raw.partial_r)
    assert "too few for a partial r with 2 control(s)" in raw.note


@pytest.mark.slow
def test_constant_control_is_dropped_and_said_so():
    df = study(n_runs=1, per_run=12)  # one run: n_params constant
    out = correlations(df, metrics=["nc1_cdnv"], n_perm=100, controls=["log(n_params)", "log1p(global_step)"])
    raw = out[out.scale == "raw"].iloc[0]
    assert "ignores log(n_params)" in raw.note and raw.controls == "log1p(global_step)"
    d = pd.DataFrame({"x": df.nc1_cdnv, "y": df.eval_loss, "s": np.log1p(df.global_step)})
    assert raw.partial_r == pytest.approx(pg.partial_corr(d, "x", "y", ["s"])["r"].iloc[0], abs=1e-12)


def test_constant_metric_says_so():
    df = study().assign(nc1_cdnv=1.0)
    out = correlations(df, metrics=["nc1_cdnv"], n_perm=10)
    assert out.r.isna().all() and out.note.str.contains("metric constant").all()


@pytest.mark.slow
def test_a_metric_without_values_is_a_note():
    df = study().assign(nc4_agreement=np.nan)  # e.g. extracted without validation tokens
    out = correlations(df, metrics=["nc1_cdnv", "nc4_agreement"], n_perm=100).set_index(["metric", "scale"])
    assert out.loc["nc4_agreement"].r.isna().all() and (out.loc["nc4_agreement"].note == "no values "
                                                           "(not measurable here)").all()
    assert np.isfinite(out.loc[("nc1_cdnv", "raw"), "r"])


@pytest.mark.parametrize("kw, match", [
    (dict(target="nope"), "target 'nope' is not a column"),
    (dict(target="run"), "target 'run' is not a number \\(--target; it holds text, e.g. 'r0'\\).*valid "
                         "targets: eval_loss \\(the losses\\)"),
    (dict(target="nc1_cdnv"), "target 'nc1_cdnv' is a metric under test \\(--target, --metrics\\)"),
    (dict(metrics=["nope"]), "metric 'nope' is not a column"),
    (dict(controls=["log(nope)"]), "control 'log\\(nope\\)': unknown name 'nope'"),
])
def test_bad_input_is_a_user_error(kw, match):
    with pytest.raises(UserError, match=match):
        correlations(study(), n_perm=10, **kw)


@pytest.mark.slow
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

@pytest.mark.slow
def test_holm_columns_equal_statsmodels_per_scale():
    from statsmodels.stats.multitest import multipletests

    df = study(n_runs=4, per_run=4, seed=8)
    df["nc4_agreement"] = np.nan  # no values: no p, not in the family
    out = correlations(df, n_perm=300, seed=1)
    assert list(out.family.unique()) == ["NC", "nc1_cdnv_p2", "geometry", "nc1_cdnv_debiased",  # 1/length², debiased:
                                         "nc1_cdnv_pooled_debiased"]                           # each its own
    assert set(out.metric[out.family == "NC"]) == set(NC_METRICS) - {"nc1_cdnv_p2"}
    assert set(out.metric[out.family == "geometry"]) == set(GEOMETRY_METRICS)
    p2 = out[out.metric == "nc1_cdnv_p2"]
    assert (p2.p_holm == p2.p_perm).all() and p2.note_kinds.str.contains("scale_dependent").all()
    assert p2.note.str.startswith("scales as 1/length²").all()
    for scale, fam in itertools.product(("raw", "log"), ("NC", "geometry")):
        rows = out[(out.scale == scale) & (out.family == fam)]
        for col, adj in (("p_perm", "p_holm"), ("partial_p_perm", "partial_p_holm")):
            ok = np.isfinite(rows[col])
            # nc4 empty; nc2_cos_mean has no log scale
            assert ok.sum() == (len(NC_METRICS) - 2 - (scale == "log") if fam == "NC" else len(GEOMETRY_METRICS))
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


# ---------------------------------------------------------------- runs as exchangeability blocks

def runs_study(sizes: Sequence[int], seed: int = 0, effect: float = 0.3) -> pd.DataFrame:
    """Runs of the given numbers of checkpoints, each with its own size, offsets and steps (not on one grid), a
    metric related to the loss by ``effect``; rows shuffled, so that step order must come from global_step."""
    rng = np.random.default_rng(seed)
    rows = []
    for r, k in enumerate(sizes):
        n_params, a, b = float(rng.integers(1, 50) * 1e5), rng.normal(0, 0.3), rng.normal(0, 0.3)
        for step in np.sort(rng.choice(np.arange(100, 5000, 100), k, replace=False)):
            loss = 3 + a - 0.3 * np.log10(step) + rng.normal(0, 0.1)
            rows.append(dict(run=f"run{r}", global_step=int(step), n_params=n_params, eval_loss=loss,
                             nc1_cdnv=np.exp(b + effect * loss + rng.normal(0, 0.2))))
    return pd.DataFrame(rows).sample(frac=1, random_state=seed).reset_index(drop=True)


def brute_force_block_p(df: pd.DataFrame, x: np.ndarray, tol: float = 1e-9) -> tuple[float, float, float, int]:
    """p of r, rho and the Freedman-Lane partial r over every permutation of whole runs among runs with as many
    rows, run i's rows (in step order) taking run pi(i)'s values: written out with itertools, one at a time."""
    y = df.eval_loss.to_numpy()
    Z = np.column_stack([np.log(df.n_params), np.log1p(df.global_step)])
    e = residual(y, Z)
    yhat, ex = y - e, residual(x, Z)
    rows = {r: g.sort_values("global_step").index.to_numpy() for r, g in df.groupby("run")}
    by_size: dict[int, list] = {}
    for r, idx in rows.items():
        by_size.setdefault(len(idx), []).append(idx)

    def stats(v, ev):
        return (np.corrcoef(x, v)[0, 1], sps.spearmanr(x, v).statistic,
                np.corrcoef(ex, residual(yhat + ev, Z))[0, 1])

    observed = np.array(stats(y, e))
    low, high, total = np.zeros(3), np.zeros(3), 0
    for combo in itertools.product(*(itertools.permutations(range(len(b))) for b in by_size.values())):
        order = np.arange(len(y))
        for blocks, perm in zip(by_size.values(), combo):
            for i, j in enumerate(perm):
                order[blocks[i]] = blocks[j]
        null = np.array(stats(y[order], e[order]))
        low += null <= observed + tol * abs(observed)
        high += null >= observed - tol * abs(observed)
        total += 1
    return (*np.minimum(1, 2 * np.minimum(low, high) / total), total)  # equal-tailed: twice the smaller tail


def test_whole_run_permutation_p_equals_brute_force_enumeration():
    df = runs_study([2, 3, 2, 3, 2, 3, 2], seed=4)  # 4! * 3! = 144 permutations, all enumerated
    got = correlations(df, ["nc1_cdnv"], n_perm=10_000, runs="run").set_index("scale")
    for scale, x in (("raw", df.nc1_cdnv), ("log", np.log10(df.nc1_cdnv))):
        row = got.loc[scale]
        p_r, p_rho, p_fl, total = brute_force_block_p(df, x.to_numpy())
        assert total == 144 and row.n_distinct_perms == 144 and row.n_perm == 144 and row.exact
        assert row.perm_scheme == "whole runs" and row.n_units == 7
        assert 0.05 < p_r < 0.95 and 0.05 < p_fl < 0.95  # values a wrong pairing would move
        assert (row.p_perm, row.rho_p, row.partial_p_perm) == pytest.approx((p_r, p_rho, p_fl), abs=1e-12)
        assert row.rho == pytest.approx(sps.spearmanr(x, df.eval_loss).statistic, abs=1e-12)


def test_random_whole_run_permutations_agree_with_exact_within_monte_carlo_error():
    df = runs_study([3] * 7, seed=6)  # 7! = 5040
    exact = correlations(df, ["nc1_cdnv"], n_perm=5040, runs="run").iloc[0]
    b = 3000
    drawn = correlations(df, ["nc1_cdnv"], n_perm=b, seed=1, runs="run").iloc[0]
    assert exact.exact and not drawn.exact and drawn.n_perm == b and drawn.n_distinct_perms == 5040
    for col in ("p_perm", "rho_p", "partial_p_perm"):
        assert 0.02 < exact[col] < 0.98
        assert abs(drawn[col] - exact[col]) < 4 * math.sqrt(exact[col] * (1 - exact[col]) / b) + 2 / b, col


def test_drawn_permutations_move_whole_runs_onto_runs_of_the_same_size_in_step_order():
    labels = np.array(["a", "b", "a", "c", "b", "c", "d", "a", "d", "e", "e", "e"])
    step = np.array([30, 20, 10, 5, 10, 7, 1, 20, 2, 9, 3, 6])
    scheme = Scheme.whole_blocks(labels, step)
    assert scheme.n_units == 5 and scheme.n_distinct == math.factorial(3) * math.factorial(2)
    ordered = {r: np.flatnonzero(labels == r)[np.argsort(step[labels == r])] for r in "abcde"}
    chunks, total, exact = scheme.chunks(10, seed=0)  # 12 > 10: drawn
    idx = np.concatenate(list(chunks))
    assert not exact and total == 10 and idx.shape == (10, 12)
    for perm in idx:
        image = {r: perm[ordered[r]] for r in "abcde"}  # run r's rows take these rows' values, in step order
        sources = [next(s for s in "abcde" if np.array_equal(ordered[s], image[r])) for r in "abcde"]
        assert sorted(sources) == list("abcde")  # a bijection of runs, each moved whole, position by position
        assert all(len(ordered[s]) == len(ordered[r]) for r, s in zip("abcde", sources))
    every = np.concatenate(list(scheme.chunks(12, seed=0)[0]))
    assert len({tuple(p) for p in every}) == 12  # all enumerated, each once


def test_one_checkpoint_per_run_is_the_row_permutation_test():
    df = study(n_runs=9, per_run=1, seed=2)
    rows = correlations(df, ["nc1_cdnv", "nc2_norm_cv"], n_perm=500, seed=3)
    runs = correlations(df, ["nc1_cdnv", "nc2_norm_cv"], n_perm=500, seed=3, runs="run")
    units = ["note", "note_kinds", "within_why", "loo_r_min", "loo_r_max", "loo_p_min", "loo_p_max", "robust",
             "loo_flips"]  # runs name them
    pd.testing.assert_frame_equal(rows.drop(columns=units), runs.drop(columns=units), check_dtype=False)
    assert (runs.perm_scheme == "rows").all() and (runs.n_distinct_perms == math.factorial(9)).all()
    no_run_column = correlations(df.drop(columns="run"), ["nc1_cdnv"], n_perm=500, seed=3, runs="run")
    assert (no_run_column.perm_scheme == "rows").all()


@pytest.mark.slow
def test_spearman_rho_and_its_row_permutation_p_equal_scipy():
    rng = np.random.default_rng(7)
    y = rng.normal(size=7)
    X = np.column_stack([y + rng.normal(size=7), np.exp(rng.normal(size=7))])
    res = perm_test(y, X, None, n_perm=10_000)  # 7! = 5040: exact
    for j in range(2):
        assert res["rho"][j] == pytest.approx(sps.spearmanr(X[:, j], y).statistic, abs=1e-12)
        ref = sps.permutation_test((y,), lambda a: sps.spearmanr(a, X[:, j]).statistic,
                                   permutation_type="pairings", vectorized=False, n_resamples=10_000,
                                   alternative="two-sided")
        assert res["rho_p"][j] == pytest.approx(ref.pvalue, abs=1e-12)


def test_a_related_metric_is_found_across_runs():
    df = runs_study([4] * 8, seed=3, effect=3.0)
    out = correlations(df, ["nc1_cdnv"], n_perm=2000, runs="run")
    assert (out.p_perm < 0.01).all() and (out.rho_p < 0.01).all() and not out.exact.any()


def test_too_few_runs_say_that_no_p_can_reach_alpha():
    df = runs_study([4, 4, 4], seed=1)  # 3! = 6 permutations of whole runs
    out = correlations(df, ["nc1_cdnv"], n_perm=1000, runs="run")
    assert (out.n_distinct_perms == 6).all() and out.exact.all() and (out.p_perm >= 2 / 6 - 1e-12).all()
    assert (out.p_floor == 2 / 6).all()  # equal-tailed: twice the smallest tail, the identity in it
    assert out.note.str.contains("only 6 distinct permutations of whole runs \\(3 runs\\): no equal-tailed p below "
                                 "2/6").all()
    text = permutation_text(out)
    assert "whole runs (3 runs" in text and "6 distinct permutations, all enumerated (exact p)" in text
    assert "no equal-tailed p can fall below 2/6 = 0.333, so none reaches 0.05" in text
    lone = correlations(runs_study([2, 3, 4], seed=1), ["nc1_cdnv"], n_perm=1000, runs="run")
    assert (lone.n_distinct_perms == 1).all() and (lone.p_perm == 1).all()  # no run has a partner: no test


def test_permutation_text_for_rows_and_drawn_permutations():
    out = correlations(study(n_runs=6, per_run=5), ["nc1_cdnv"], n_perm=300, seed=4, runs="run")
    assert permutation_text(out).endswith("whole runs (6 runs; a run's target values, and for the partial r its "
                                          "residuals on the controls, move as one block onto another run with as "
                                          "many checkpoints, position by position in step order), 720 distinct "
                                          "permutations, 300 drawn at random (seed 4).")
    rows = correlations(study(n_runs=6, per_run=5), ["nc1_cdnv"], n_perm=300, seed=4)
    assert "rows (30 checkpoints, each its own unit), about 10^32 distinct permutations, 300 drawn" in \
        permutation_text(rows)
    assert permutation_text(correlations(study(), ["nc1_cdnv"], n_perm=0)).startswith("No permutation p-values")
    many = correlations(study(n_runs=25, per_run=8), ["nc1_cdnv"], n_perm=100, seed=4)  # 200! > float's range
    assert np.isinf(many.n_distinct_perms).all() and (many.n_perm == 100).all() and many.p_perm.notna().all()
    assert "rows (200 checkpoints, each its own unit), more than 10^308 distinct permutations" in \
        permutation_text(many)


# ---------------------------------------------------------------- tags never pooled, one row per run

@pytest.mark.slow
def test_tags_are_never_pooled_and_holm_stays_within_a_tag():
    a, b, c = study(n_runs=4, per_run=4, seed=1), study(n_runs=4, per_run=4, seed=2), study(n_runs=3, per_run=4)
    df = pd.concat([a.assign(tag="heldout"), b.assign(tag=None), c.assign(tag="")], ignore_index=True)
    df.loc[df.index[-1], "tag"] = np.nan
    assert [t for t, _ in split_tags(df)] == ["heldout", None]
    assert len(split_tags(df)[1][1]) == len(b) + len(c)  # None, '' and NaN: the untagged group
    out = correlations_by_tag(df, n_perm=200, seed=1, runs="run")
    assert out.columns[0] == "tag" and list(out.tag.unique()) == ["heldout", None]
    for tag, rows in (("heldout", a), (None, pd.concat([b, c], ignore_index=True))):
        got = out[out.tag == tag] if tag else out[out.tag.isna()]
        want = correlations(rows, n_perm=200, seed=1, runs="run")
        pd.testing.assert_frame_equal(got.drop(columns="tag").reset_index(drop=True), want, check_dtype=False)
        for scale, fam in itertools.product(("raw", "log"), ("NC", "geometry")):  # Holm within tag, scale, family
            s = got[(got.scale == scale) & (got.family == fam) & got.p_perm.notna()]
            assert len(s) >= len(GEOMETRY_METRICS)
            np.testing.assert_allclose(s.p_holm, multipletests(s.p_perm, method="holm")[1], rtol=0, atol=1e-15)
    untagged = correlations_by_tag(a, n_perm=0)
    assert untagged.tag.isna().all() and len(untagged) == 2 * len(METRICS)


def test_a_tag_without_the_target_is_named():
    df = pd.concat([study(n_runs=3, per_run=3).assign(tag="a"), study(n_runs=3, per_run=3).assign(tag="b",
                                                                                                  eval_loss=np.nan)])
    with pytest.raises(UserError, match="^tag 'b': target 'eval_loss' has no values"):
        correlations_by_tag(df, n_perm=0)


def test_last_per_run_keeps_each_runs_highest_step_per_tag_with_its_layers():
    df = study(n_runs=3, per_run=4)
    layered = pd.concat([df.assign(layer=1), df.assign(layer=2)], ignore_index=True)
    tagged = pd.concat([layered.assign(tag="x"), layered[layered.global_step < 400].assign(tag=None)])
    got = last_per_run(tagged)
    want = {(r, t, s) for r in df.run.unique() for t, s in (("x", 400), (None, 300))}
    assert {(r, t, s) for r, t, s in zip(got.run, got.tag, got.global_step)} == want
    assert len(got) == 2 * len(want)  # both layers of each
    assert last_per_run(df).set_index("run").global_step.to_dict() == {r: 400 for r in df.run.unique()}
    with pytest.raises(UserError, match="--per-run last needs the column 'global_step'"):
        last_per_run(df.drop(columns="global_step"))
    nostep = df.astype({"global_step": float})
    nostep.loc[nostep.run == "r1", "global_step"] = np.nan
    with pytest.raises(UserError, match="run 'r1' has no global_step"):
        last_per_run(nostep)


# ---------------------------------------------------------------- controls that are what is correlated

@pytest.mark.parametrize("control, match", [
    ("eval_loss", "control 'eval_loss' uses the target 'eval_loss': .* leave it out of --controls"),
    ("log(eval_loss)", "control 'log\\(eval_loss\\)' uses the target"),
    ("nc1_cdnv", "control 'nc1_cdnv' uses 'nc1_cdnv', a metric under test .* or leave that metric out of --metrics"),
    ("2 * nc1_cdnv + log(n_params)", "uses 'nc1_cdnv', a metric under test"),
])
def test_a_control_that_uses_the_target_or_a_metric_is_a_user_error(control, match):
    with pytest.raises(UserError, match=match):
        correlations(study(), ["nc1_cdnv", "nc1_trace"], controls=[control], n_perm=10)


def test_a_control_on_a_metric_not_under_test_is_fine():
    out = correlations(study(), ["nc1_trace"], controls=["log(nc1_cdnv)"], n_perm=0)
    assert out.partial_r.notna().all() and (out.controls == "log(nc1_cdnv)").all()


# ---------------------------------------------------------------- issue 39: resampling runs, against brute force

def _resampled(W_row: np.ndarray) -> np.ndarray:
    """The rows of one resample, each repeated as often as its weight."""
    return np.repeat(np.arange(len(W_row)), W_row.astype(int))


def test_weighted_r_rho_and_partial_r_equal_numpy_scipy_pingouin_on_each_resample():
    from ncanalyze.analyzer.resample import bootstrap_weights, loo_weights, weighted_partial, weighted_rho
    rng = np.random.default_rng(11)
    codes = np.repeat(np.arange(8), 3)
    y, X, C = rng.normal(size=24), rng.normal(size=(24, 2)), rng.normal(size=(24, 2))
    X[:, 1] = np.round(X[:, 1])  # ties in the ranks
    W = np.vstack([bootstrap_weights(codes, 6, 0), loo_weights(codes)])
    r, p, rho = weighted_partial(W, X, y), weighted_partial(W, X, y, C), weighted_rho(W, X, y)
    for b, w in enumerate(W):
        i = _resampled(w)
        for j in range(2):
            assert r[b, j] == pytest.approx(np.corrcoef(X[i, j], y[i])[0, 1], abs=1e-10)
            assert rho[b, j] == pytest.approx(sps.spearmanr(X[i, j], y[i]).statistic, abs=1e-10)
            d = pd.DataFrame({"x": X[i, j], "y": y[i], "c0": C[i, 0], "c1": C[i, 1]})
            assert p[b, j] == pytest.approx(pg.partial_corr(d, "x", "y", ["c0", "c1"])["r"].iloc[0], abs=1e-10)


def test_bootstrap_draws_whole_runs():
    from ncanalyze.analyzer.resample import bootstrap_weights, percentile_interval
    codes = np.array([0, 0, 1, 1, 1, 2, 3, 3])
    W = bootstrap_weights(codes, 200, 1)
    assert (W.sum(1) > 0).all() and all(len(set(w[codes == c])) == 1 for w in W for c in range(4))  # runs whole
    assert np.allclose(W[:, [0, 2, 5, 6]].sum(1), 4)  # a row per run: 4 runs drawn each time
    s = np.random.default_rng(0).normal(size=(4001, 1))
    lo, hi, _ = percentile_interval(s)
    assert (lo[0], hi[0]) == pytest.approx(tuple(np.quantile(s[:, 0], [0.025, 0.975])), abs=1e-12)


def test_fisher_and_jackknife_intervals_equal_their_formulas_by_hand():
    from ncanalyze.analyzer.questions import intervals
    rng = np.random.default_rng(5)
    y, X, C = rng.normal(size=12), rng.normal(size=(12, 2)), rng.normal(size=(12, 1))
    X[:, 0] += y
    one = intervals(y, X, C, np.arange(12))  # a row per run: Fisher's z
    r = np.corrcoef(X[:, 0], y)[0, 1]
    assert one["ci_method"] == "Fisher z"
    assert one["r_ci_low"][0] == pytest.approx(np.tanh(np.arctanh(r) - 1.959963984540054 / 3), abs=1e-12)
    rho = sps.spearmanr(X[:, 0], y).statistic
    se = np.sqrt((1 + rho ** 2 / 2) / 9)  # Bonett & Wright
    assert one["rho_ci_high"][0] == pytest.approx(np.tanh(np.arctanh(rho) + 1.959963984540054 * se), abs=1e-12)
    d = pd.DataFrame({"x": X[:, 0], "y": y, "c": C[:, 0]})
    pr = pg.partial_corr(d, "x", "y", ["c"])["r"].iloc[0]
    assert one["partial_r_ci_low"][0] == pytest.approx(np.tanh(np.arctanh(pr) - 1.959963984540054 / np.sqrt(8)),
                                                       abs=1e-12)
    codes = np.repeat(np.arange(4), 3)  # 4 runs of 3 rows: the jackknife over runs on Fisher's z, t with 3 df
    jk = intervals(y, X, C, codes)
    zj = np.array([np.arctanh(np.corrcoef(X[codes != i, 0], y[codes != i])[0, 1]) for i in range(4)])
    half = sps.t.ppf(0.975, 3) * np.sqrt(3 / 4 * ((zj - zj.mean()) ** 2).sum())
    assert jk["ci_method"].startswith("jackknife over runs")
    assert (jk["r_ci_low"][0], jk["r_ci_high"][0]) == pytest.approx((np.tanh(np.arctanh(r) - half),
                                                                      np.tanh(np.arctanh(r) + half)), abs=1e-12)


def test_r2_interval_starts_at_0_where_r_s_spans_it():
    from ncanalyze.analyzer.resample import r2_interval
    lo, hi = r2_interval(np.array([-0.81, 0.2, -0.9]), np.array([0.58, 0.7, -0.3]))
    np.testing.assert_allclose(lo, [0, 0.04, 0.09])
    np.testing.assert_allclose(hi, [0.81 ** 2, 0.49, 0.81])


def test_leave_one_run_out_range_of_r_equals_brute_force():
    df = study(n_runs=6, per_run=4, seed=3)
    out = correlations(df, ["nc1_trace"], n_perm=200, runs="run", n_boot=0).set_index("scale")
    rs = [np.corrcoef(g.nc1_trace, g.eval_loss)[0, 1] for _, g in (
        (name, df[df.run != name]) for name in df.run.unique())]
    assert out.loc["raw", "loo_r_min"] == pytest.approx(min(rs), abs=1e-12)
    assert out.loc["raw", "loo_r_max"] == pytest.approx(max(rs), abs=1e-12)
    assert out.loc["raw", "robust"] in (0, 1) and out.loc["raw", "ci_units"] == 6
    assert out.loc["raw", "ci_method"].startswith("jackknife over runs") and out.loc["raw", "ci_unit"] == "runs"
    assert out.loc["raw", "r_ci_low"] <= out.loc["raw", "r"] <= out.loc["raw", "r_ci_high"]
    ps = [perm_test(g.eval_loss.to_numpy(), g[["nc1_trace"]].to_numpy(), None, 200, 0,
                    Scheme.whole_blocks(g.run, g.global_step))["p_perm"][0]
          for g in (df[df.run != name] for name in df.run.unique())]
    assert (out.loc["raw", "loo_p_min"], out.loc["raw", "loo_p_max"]) == pytest.approx((min(ps), max(ps)), abs=1e-12)


def test_design_controls_are_the_architecture_factors_that_vary():
    from ncanalyze.analyzer.stats import expand_design
    df = pd.DataFrame({"n_layers": [2, 2, 4, 4], "hidden_size": [64, 64, 64, 64], "n_params": [1, 2, 3, 4]})
    assert expand_design(df, ["design", "log1p(global_step)"]) == ["log(n_layers)", "log(n_params)",
                                                                   "log1p(global_step)"]
    assert expand_design(df.iloc[:2].assign(n_params=1), ["design"]) == []
    assert expand_design(df, ["log(n_params)"]) == ["log(n_params)"]  # --controls overrides
