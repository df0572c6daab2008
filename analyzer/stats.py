"""Correlation of NC metrics with a target (eval loss): Pearson r, R², partial r, and permutation p-values.

Scales. Each metric is correlated with the target twice: raw, and with log10 of the metric where the metric is
positive on every selected checkpoint (the paper plots eval loss against log-scaled NC axes and fits there). The
target itself is never logged. R² is that of the least-squares line, i.e. r².

Partial correlation. Controls are expressions over the metrics table (pandas ``eval`` syntax, evaluated by
``expr`` over the columns and an allow-list of functions); by default
``log(n_params)`` (scale) and ``log1p(global_step)`` (training progress: loss falls roughly as a power of the step,
so its log is the linear scale; the +1 keeps a step-0 checkpoint). Absolute step, not the fraction of a run's last
step, because a final checkpoint has fraction 1 whether its run trained one epoch or ten. Controls that are
constant or collinear on the selected rows are dropped (and said so).

Permutation p-values are two-sided, P(|r*| >= |r|): for r the target is permuted; for the partial r the
target's residuals on the controls are permuted (Freedman & Lane 1983), y* = yhat_Z + P e_Z. All permutations of
a chunk, and all metrics, are one matrix product. When n! <= the number of permutations every permutation is
enumerated and p is exact; otherwise p = (1 + #{|r*| >= |r|}) / (1 + B) (Phipson & Smyth), as in
``scipy.stats.permutation_test``.

Multiple comparisons. Many metrics are tested at once, so the permutation p-values are also given Holm-adjusted
(``p_holm``, ``partial_p_holm``; Holm 1979, statsmodels ``multipletests``) across the metrics with a finite p, per
scale: the raw and the log scale are two families, not one, since each metric appears in both.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np
import pandas as pd
from scipy.linalg import orth

from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.expr import evaluate
from ncanalyze.analyzer.schema import SCALARS

METRICS = SCALARS  # the metrics tested by default: all of them
CONTROLS = ("log(n_params)", "log1p(global_step)")
MIN_N = 3  # fewest points for which a correlation means anything
_TIE = 100 * np.finfo(float).eps  # relative tolerance for ties with the observed statistic (as scipy)
_CHUNK_ELEMS = 2 ** 20  # permutations per chunk x n: bounds memory at a few (chunk x n) float arrays


def _unit(a: np.ndarray) -> np.ndarray:
    """Centred columns scaled to unit norm, so that a dot product of two is their Pearson r."""
    a = a - a.mean(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return a / np.linalg.norm(a, axis=0)


def permutation_chunks(n: int, n_perm: int, seed: int | None) -> tuple[Iterator[np.ndarray], int, bool]:
    """Index arrays (chunk x n) of permutations of range(n), their total and whether they are all n! of them."""
    chunk = max(1, _CHUNK_ELEMS // max(n, 1))
    if math.factorial(n) <= n_perm:
        perms = itertools.permutations(range(n))
        gen = (np.array(block) for block in iter(lambda: list(itertools.islice(perms, chunk)), []))
        return gen, math.factorial(n), True
    rng = np.random.default_rng(seed)
    base = np.arange(n)
    sizes = [chunk] * (n_perm // chunk) + ([n_perm % chunk] if n_perm % chunk else [])
    return (rng.permuted(np.broadcast_to(base, (b, n)), axis=1) for b in sizes), n_perm, False


def perm_test(y: np.ndarray, X: np.ndarray, C: np.ndarray | None = None, n_perm: int = 10_000,
              seed: int | None = 0) -> dict[str, np.ndarray]:
    """Pearson r of ``y`` (n) with each column of ``X`` (n x m), partial r given controls ``C`` (n x k), and
    two-sided permutation p-values for both (Freedman-Lane for the partial r). All inputs finite."""
    n = len(y)
    C = np.empty((n, 0)) if C is None else np.asarray(C, float).reshape(n, -1)
    if n < MIN_N:
        raise ValueError(f"perm_test needs n >= {MIN_N}, got {n}")
    Q = orth(np.column_stack([np.ones(n), C]))  # orthonormal basis of span{1, controls}
    resid = lambda a: a - Q @ (Q.T @ a)  # noqa: E731  residual maker R = I - QQ^T
    zy, zx = _unit(y), _unit(X)
    ey, ex = resid(y), resid(X)
    with np.errstate(invalid="ignore", divide="ignore"):
        ex = ex / np.linalg.norm(ex, axis=0)
        r = zy @ zx
        pr = ey @ ex / np.linalg.norm(ey)
    out = {"r": r, "partial_r": pr, "p_perm": np.full_like(r, np.nan), "partial_p_perm": np.full_like(r, np.nan),
           "n_perm": 0, "exact": False}
    if n_perm <= 0:
        return out
    chunks, total, exact = permutation_chunks(n, n_perm, seed)
    hits_r = np.zeros(r.shape, np.int64)
    hits_pr = np.zeros(r.shape, np.int64)
    for idx in chunks:
        E = ey[idx]  # permuted residuals, one permutation per row; R(P e) has norm^2 = |e|^2 - |Q^T P e|^2
        with np.errstate(invalid="ignore", divide="ignore"):
            r_null = zy[idx] @ zx
            pr_null = (E @ ex) / np.sqrt(ey @ ey - ((E @ Q) ** 2).sum(1))[:, None]
        hits_r += (np.abs(r_null) >= np.abs(r) * (1 - _TIE)).sum(0)
        hits_pr += (np.abs(pr_null) >= np.abs(pr) * (1 - _TIE)).sum(0)
    add = 0 if exact else 1
    with np.errstate(invalid="ignore"):
        out["p_perm"] = np.where(np.isfinite(r), (hits_r + add) / (total + add), np.nan)
        out["partial_p_perm"] = np.where(np.isfinite(pr), (hits_pr + add) / (total + add), np.nan)
    out.update(n_perm=total, exact=exact)
    return out


def independent_controls(C: pd.DataFrame) -> list[str]:
    """The controls, in order, that add rank to [1, controls so far] (constant or collinear ones dropped)."""
    keep: list[str] = []
    basis = np.ones((len(C), 1))
    for name in C.columns:
        trial = np.column_stack([basis, C[name].to_numpy(float)])
        if np.linalg.matrix_rank(trial) > basis.shape[1]:
            keep.append(name)
            basis = trial
    return keep


def _numeric(df: pd.DataFrame, col: str, what: str) -> pd.Series:
    if col not in df.columns:
        raise UserError(f"{what} {col!r} is not a column of the metrics table; columns: {', '.join(df.columns)}")
    return pd.to_numeric(df[col], errors="coerce").astype(float)


def _numbers(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with object columns that hold only numbers or None as floats (a store may lack an attribute)."""
    out = df.copy()
    for c in out.columns[out.dtypes == object]:
        v = pd.to_numeric(out[c], errors="coerce")
        if v.notna().sum() == out[c].notna().sum():
            out[c] = v.astype(float)
    return out


def eval_controls(df: pd.DataFrame, controls: Sequence[str]) -> pd.DataFrame:
    """Evaluate each control expression (over the table's columns and an allow-list of functions, by
    :mod:`ncanalyze.analyzer.expr`; never as code) to a column named by the expression."""
    out = {}
    df = _numbers(df)
    for expr in controls:
        v = evaluate(expr, df, "control")
        if not isinstance(v, pd.Series):
            raise UserError(f"control {expr!r} uses no column of the metrics table (it is the constant {v!r}); "
                            f"columns: {', '.join(df.columns)}")
        out[expr] = pd.to_numeric(v, errors="coerce").astype(float)
    return pd.DataFrame(out, index=df.index).replace([np.inf, -np.inf], np.nan)


def scaled_metrics(df: pd.DataFrame, metrics: Sequence[str]) -> tuple[pd.DataFrame, dict]:
    """Columns (metric, "raw") and (metric, "log") = log10 where the metric is positive on every row (else nan),
    and a note per column saying why it is empty."""
    cols, notes = {}, {}
    for m in metrics:
        x = _numeric(df, m, "metric")
        x = x.where(np.isfinite(x))
        positive = x.notna().any() and bool((x.dropna() > 0).all())
        cols[m, "raw"] = x
        cols[m, "log"] = np.log10(x.where(x > 0)) if positive else x * np.nan
        if x.isna().all():
            notes[m, "raw"] = notes[m, "log"] = ["no values (not measurable here)"]
        else:
            notes[m, "raw"], notes[m, "log"] = [], ([] if positive else ["not positive everywhere: no log scale"])
    return pd.DataFrame(cols, index=df.index), notes


def correlations(df: pd.DataFrame, metrics: Sequence[str] = METRICS, target: str = "eval_loss",
                 controls: Sequence[str] = CONTROLS, n_perm: int = 10_000, seed: int | None = 0) -> pd.DataFrame:
    """One row per (metric, scale in raw|log): n, r, r2, p_perm, p_param, partial_r, partial_p_perm,
    partial_p_param, partial_ci_low/high, the controls used, a note saying why a statistic is missing, and
    p_holm / partial_p_holm: the permutation p-values Holm-adjusted across the metrics (per scale).
    Rows with a missing or infinite target, or a missing metric or control, are left out of that metric's
    statistics (an infinite target is said in the notes)."""
    y = _numeric(df, target, "target")
    infinite = int(np.isinf(y).sum())
    y = y.where(np.isfinite(y))  # an infinite loss (a diverged run) would make every r nan: such rows are left out
    if y.isna().all():
        raise UserError(f"target {target!r} has no values in the selected checkpoints (for eval_loss: the runs "
                        "logged no evaluation); pass --target with another column")
    C = eval_controls(df, controls)
    empty = [c for c in C.columns if C.loc[y.notna(), c].isna().all()]  # e.g. a step no checkpoint recorded
    C = C.drop(columns=empty)
    ok = y.notna() & C.notna().all(axis=1)
    y, C = y[ok], C[ok]
    X, notes = scaled_metrics(df[ok], metrics)
    unused = [f"control {c} has no values: not used" for c in empty]
    if infinite:
        unused.append(f"{infinite} checkpoint(s) with an infinite {target} left out")
    # columns with the same rows present share one permutation run, all of them in one matrix product
    groups: dict[bytes, list] = {}
    for key in X.columns:
        groups.setdefault(X[key].notna().to_numpy().tobytes(), []).append(key)
    rows = []
    for keys in groups.values():
        mask = X[keys[0]].notna()
        rows += _group_stats(y[mask], X.loc[mask, keys], C[mask], notes, unused, n_perm, seed)
    out = pd.DataFrame(rows)
    order = {m: i for i, m in enumerate(metrics)}
    out = out.sort_values(["metric", "scale"], key=lambda s: s.map(order) if s.name == "metric" else s != "raw")
    out = out.reset_index(drop=True)
    out["p_holm"], out["partial_p_holm"] = holm(out, "p_perm"), holm(out, "partial_p_perm")
    out.attrs.update(target=target, controls=list(controls), n_perm=int(n_perm), seed=seed)
    return out


def holm(stats: pd.DataFrame, column: str) -> pd.Series:
    """Holm-adjusted ``column`` across the metrics, per scale (raw and log separately), over the finite
    p-values only (statsmodels ``multipletests``); nan elsewhere."""
    from statsmodels.stats.multitest import multipletests

    out = pd.Series(np.nan, index=stats.index)
    for _, rows in stats.groupby("scale"):
        p = rows[column].astype(float)
        p = p[np.isfinite(p)]
        if len(p):
            out[p.index] = multipletests(p.to_numpy(), method="holm")[1]
    return out


def _group_stats(y: pd.Series, X: pd.DataFrame, C: pd.DataFrame, notes: dict, unused: list[str], n_perm: int,
                 seed: int | None) -> list[dict]:
    """Statistics of the columns of X, which all have the same rows, against y given controls C; ``notes`` say
    why a column has none, ``unused`` is said of every column."""
    n = len(y)
    ctrl = independent_controls(C) if n else []
    dropped = [c for c in C.columns if c not in ctrl]
    res = perm_test(y.to_numpy(), X.to_numpy(), C[ctrl].to_numpy(), n_perm, seed) if n >= MIN_N else None
    rows = []
    for j, (metric, scale) in enumerate(X.columns):
        row = dict(metric=metric, scale=scale, n=n, r=np.nan, r2=np.nan, p_perm=np.nan, p_param=np.nan,
                   partial_r=np.nan, partial_p_perm=np.nan, partial_p_param=np.nan, partial_ci_low=np.nan,
                   partial_ci_high=np.nan, controls=", ".join(ctrl), n_perm=0, exact=False)
        note = notes[metric, scale] or _fill(row, X[metric, scale], y, C[ctrl], res, j, dropped) + unused
        rows.append(row | {"note": "; ".join(note)})
    return rows


def _fill(row: dict, x: pd.Series, y: pd.Series, C: pd.DataFrame, res: dict | None, j: int,
          dropped: list[str]) -> list[str]:
    """Put column j's r, R², p-values and partial r (pingouin) into ``row``; return notes on what is missing."""
    import pingouin as pg  # seconds to import: not at the CLI's start
    from scipy.stats import pearsonr
    n, k = len(x), C.shape[1]
    if n < MIN_N:
        return [f"n={n} < {MIN_N} checkpoints: too few for a correlation"]
    if x.nunique() < 2 or y.nunique() < 2:
        return [("metric" if x.nunique() < 2 else "target") + " constant over the selected checkpoints"]
    r = float(res["r"][j])
    row.update(r=r, r2=r * r, p_perm=res["p_perm"][j], n_perm=res["n_perm"], exact=res["exact"],
               p_param=float(pearsonr(x, y).pvalue))
    note = [f"partial r ignores {', '.join(dropped)} (constant or collinear here)"] if dropped else []
    if n < k + MIN_N:
        return note + [f"n={n} too few for a partial r with {k} control(s) (needs >= {k + MIN_N})"]
    if not np.isfinite(res["partial_r"][j]):
        return note + ["metric or target is determined by the controls: no partial r"]
    data = pd.concat({"x": x, "y": y, **{f"c{i}": C[c] for i, c in enumerate(C.columns)}}, axis=1)
    part = pg.partial_corr(data, x="x", y="y", covar=[f"c{i}" for i in range(k)] or None)
    lo, hi = part["CI95"].iloc[0]
    row.update(partial_r=float(part["r"].iloc[0]), partial_p_perm=res["partial_p_perm"][j],
               partial_p_param=float(part["p_val"].iloc[0]), partial_ci_low=lo, partial_ci_high=hi)
    return note
