"""How sure one checkpoint's number is: the delete-one-fold jackknife over the fold sums that extraction keeps beside
the totals (SPEC section 3), and the metrics on nested token budgets (the first 1, 2, 4, ..., F folds).

The folds are disjoint sets of whole token blocks (block i -> fold i mod F), so their statistics are exact sums: the
statistics without fold i are the other F - 1 folds merged with Chan's formula (:class:`ClassStats.merge`, exact to
rounding), never a resample of tokens. Each metric is recomputed on each leave-one-out set by the same code as the
point value (``metrics.measure_all``), and its error is

    se = sqrt((F - 1) / F * sum_i (theta_(i) - theta_bar)^2)        (Efron & Stein 1981; Quenouille 1956).

Each replicate keeps its own classes (``min_count`` of its own train tokens), as an independent sample would. NC4's
decisions are counted at extraction: its replicate without fold i reads ``fold_val_ncc_agree_without`` (the
agreements of the validation tokens outside fold i with the nearest of the train means without fold i, over the
classes of ``min_count`` train tokens outside it; ``schema.NC4_WITHOUT``), so its error holds the noise of the class
means as well as that of the validation tokens. A group extracted before it (no such variable), and the nested
budgets' jackknife over the first k < F folds, vary the validation folds alone (the means fixed: an error about 0.7
of the spread over disjoint samples). A metric whose replicates are not all finite, or that rests on a fold without a token, has a nan error with a
note: never a made-up number.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.schema import NC4_WITHOUT, SCALARS, VAL_COUNTS, stats_dataset

Measure = Callable[[xr.Dataset], Mapping[str, float]]  # a dataset's scalar metrics (metrics.measure_all's first)

# the fold sums of a checkpoint group (dimension ``fold``): ClassStats' state per fold, and NC4's counts per fold
FOLD_STATS = ("count", "mean", "m2", "scatter", "unit_sum")
FOLD_VARS = (*(f"fold_{n}" for n in FOLD_STATS), *(f"fold_{n}" for n in (*VAL_COUNTS, NC4_WITHOUT)))
_DIMS = {"count": ("fold", "vocab"), "mean": ("fold", "vocab", "hidden"), "m2": ("fold", "vocab"),
         "scatter": ("fold", "hidden", "hidden2"), "unit_sum": ("fold", "hidden")}


def se_name(metric: str) -> str:
    """The column of ``metric``'s jackknife error: ``<metric>_se``."""
    return f"{metric}_se"


def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def fold_variables(stats: Mapping[str, Any], val: Mapping[str, Any] | None) -> dict[str, tuple]:
    """A group's fold variables from a :class:`~ncanalyze.analyzer.accumulate.FoldStats` state and the per-fold
    validation counts (folds x vocab), as ``Dataset.assign`` takes them."""
    out = {f"fold_{n}": (_DIMS[n], _np(stats[n])) for n in FOLD_STATS if n in stats}
    return out | {f"fold_{n}": (("fold", "vocab"), _np(v)) for n, v in (val or {}).items()}


def n_folds(ds: xr.Dataset) -> int:
    """The folds a dataset holds (1: none)."""
    return int(ds.sizes.get("fold", 1)) if "fold_count" in ds else 1


def merged(ds: xr.Dataset, folds: Sequence[int], without: int | None = None) -> xr.Dataset:
    """The dataset of the tokens of ``folds`` alone: their statistics merged (Chan, in the order given) into the
    variables the metrics read, with ``ds``'s head, attributes and ``split_count`` (the debiased metrics' class set
    is the split's, the same for every subset of folds). ``without``: ``folds`` are every fold but this one, and
    NC4's agreements are those counted with the means without it (``fold_val_ncc_agree_without``), where stored."""
    from ncanalyze.analyzer.accumulate import merged_stats

    parts = ({n: np.asarray(ds[f"fold_{n}"].values[f]) for n in FOLD_STATS if f"fold_{n}" in ds} for f in folds)
    acc = merged_stats(parts, ds.sizes["vocab"], ds.sizes["hidden"], scatter="fold_scatter" in ds)
    val = {n: np.asarray(ds[f"fold_{n}"].values)[list(folds)].sum(0) for n in VAL_COUNTS if f"fold_{n}" in ds}
    if without is not None and f"fold_{NC4_WITHOUT}" in ds and "val_ncc_agree" in val:
        val["val_ncc_agree"] = np.asarray(ds[f"fold_{NC4_WITHOUT}"].values)[without]
    head = {h: ds[h].values for h in ("classifier", "classifier_bias") if h in ds.variables}
    with np.errstate(invalid="ignore", divide="ignore"):
        return stats_dataset(acc.count, acc.mean, acc.variance, acc.within_covariance, unit_sum=acc.unit_sum,
                             val=val or None, attrs={**ds.attrs, "folds": len(folds)},
                             split_count=ds["split_count"].values if "split_count" in ds else None, **head)


FOLD_RTOL = 1e-9  # fold sums merged vs the totals: float64 rounding over a merge is ~1e-15 of the largest value
REEXTRACT = "extract it again (ncanalyze extract ... --overwrite)"  # the fix of a damaged group


def fold_problems(ds: xr.Dataset) -> list[str]:
    """Where a group's fold sums do not add up to its totals, each in a few words (none: they do). The counts must
    sum exactly (``sum(fold_count) == count``, the validation counts too); the folds merged (Chan) must give the
    totals' mean, variance, within-class covariance and unit sum to float64 rounding (:data:`FOLD_RTOL` of each
    variable's largest value). A forged fold, or a merge that counted a block twice, is found here."""
    if "fold_count" not in ds:
        return []
    out = []
    for n in ("count", *VAL_COUNTS):
        if f"fold_{n}" in ds and n in ds:
            summed, total = np.asarray(ds[f"fold_{n}"].values).sum(0), np.asarray(ds[n].values)
            if summed.shape != total.shape or not np.array_equal(summed, total):
                out.append(f"fold_{n} sums to {int(summed.sum()):,}, {n} to {int(total.sum()):,}")
    if out:
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = merged(ds, range(n_folds(ds)))
    for n in ("mean", "variance", "within_covariance", "unit_sum"):
        if n in ds and n in whole:
            a, b = np.asarray(whole[n].values, np.float64), np.asarray(ds[n].values, np.float64)
            scale = np.nanmax(np.abs(b), initial=0.0)
            if not np.allclose(a, b, rtol=0, atol=FOLD_RTOL * scale, equal_nan=True):
                out.append(f"the folds merged differ from {n} by up to {np.nanmax(np.abs(a - b)) / (scale or 1):.2g} "
                           f"of its largest value")
    return out


def replicates(ds: xr.Dataset, folds: Sequence[int], measure: Measure) -> tuple[pd.DataFrame, list[str]]:
    """Each leave-one-out set of ``folds``' scalar metrics (rows: the fold left out; nan where not measurable, why in
    the notes), measured by ``measure`` as the point value is."""
    rows, notes = {}, []
    every = list(folds) == list(range(n_folds(ds)))  # NC4's replicates with the means without fold i: all folds only
    for i in folds:
        rest = [f for f in folds if f != i]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                rows[i] = measure(merged(ds, rest, i if every else None))
            except UserError as e:
                rows[i] = {}
                notes.append(f"without fold {i}: {e}")
    return pd.DataFrame.from_dict(rows, orient="index").reindex(columns=list(SCALARS)).astype(float), notes


def jackknife(ds: xr.Dataset, measure: Measure, folds: Sequence[int] | None = None,
              point: Mapping[str, float] | None = None, min_count: int = 1) -> tuple[dict[str, float], list[str]]:
    """Every scalar metric's delete-one-fold jackknife error over ``folds`` (default: all of ``ds``'s), and notes
    for those that are nan: fewer than 2 folds, a fold without a train token, or a replicate not finite.

    Parameters
    ----------
    ds : a checkpoint dataset with its fold variables (:data:`FOLD_VARS`).
    folds : the folds to jackknife over (the nested budgets use the first k).
    point : the point values where known: a metric whose point value is not finite has a nan error, no note (the
        metric's own warning says why).
    measure : a dataset's scalar metrics, measured as the point value is (metrics.measure_all with its min_count,
        tile, device and engine).
    min_count : the min_count ``measure`` keeps classes at (NC4's fold counts are those of the extraction's).

    Returns
    -------
    (se, notes) : ``<metric>_se`` -> error (nan where there is none), and why some are nan.
    """
    folds = list(range(n_folds(ds))) if folds is None else list(folds)
    nan = {se_name(m): math.nan for m in SCALARS}
    if len(folds) < 2:
        return nan, ["no folds: extracted with --folds 1 (or by hand), so no jackknife error"]
    damaged = fold_problems(ds)
    if damaged:
        return nan, [f"the fold sums do not add up to the totals ({'; '.join(damaged)}): the group is damaged, so no "
                     f"jackknife error; {REEXTRACT}"]
    counts = np.asarray(ds["fold_count"].values)[folds].sum(1)
    if (counts == 0).any():
        empty = [f for f, c in zip(folds, counts) if c == 0]
        return nan, [f"fold(s) {empty} hold no train token (fewer blocks than folds): no jackknife error; extract "
                     "more tokens or fewer --folds"]
    theta, notes = replicates(ds, folds, measure)
    k = len(folds)
    dev = theta - theta.mean()
    se = np.sqrt((k - 1) / k * (dev ** 2).sum())
    undefined = [m for m in SCALARS if point is not None and not math.isfinite(point.get(m, math.nan))]
    bad = [m for m in SCALARS if not np.isfinite(theta[m]).all() and m not in undefined]
    mc, extract_min = int(min_count or 1), int(ds.attrs.get("min_count", 1))
    if "nc4_agreement" in bad and mc != extract_min:  # the fold counts are NC4's at the extraction's kept set only
        bad.remove("nc4_agreement")
        undefined.append("nc4_agreement")
        notes.append(f"nc4_agreement: nan error at min_count {mc}: NC4's fold counts are those of the extraction's "
                     f"--min-count {extract_min} only")
    if bad:
        notes.append(f"{', '.join(bad)}: nan error, a leave-one-fold-out value is not finite (a fold holds too few "
                     "tokens of the kept classes)")
    return {se_name(m): (float(se[m]) if m not in bad + undefined else math.nan) for m in SCALARS}, notes


def budgets(folds: int) -> list[int]:
    """The nested budgets: the first 1, 2, 4, ... folds, and all ``folds`` last."""
    out = [1 << i for i in range(max(1, folds).bit_length()) if 1 << i < folds]
    return [*out, folds]


def nested_budgets(ds: xr.Dataset, measure: Measure, whole: Mapping[str, float] | None = None) -> pd.DataFrame:
    """The metrics on the first 1, 2, 4, ..., F folds (nested token budgets): one row per budget, ``folds``,
    ``tokens`` (train tokens used), each scalar metric and its jackknife error over those folds (nan at one fold).
    The last row is the whole sample: ``whole`` where given (the group's stored metrics and errors, measured from the
    totals over every fold: not measured again), else the totals merged from the folds (equal to the stored point
    values to rounding); ``measure`` as :func:`jackknife`'s."""
    counts = np.asarray(ds["fold_count"].values).sum(1)
    rows = []
    for k in budgets(n_folds(ds)):
        first = list(range(k))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if whole is not None and k == n_folds(ds):
                point = se = whole
            else:
                try:
                    point = measure(merged(ds, first))
                except UserError:
                    point = {}
                se = jackknife(ds, measure, first)[0] if k > 1 else {}
        rows.append({"folds": k, "tokens": int(counts[:k].sum()),
                     **{m: point.get(m, math.nan) for m in SCALARS},
                     **{se_name(m): se.get(se_name(m), math.nan) for m in SCALARS}})
    return pd.DataFrame(rows)


def unsettled(table: pd.DataFrame, metrics: Sequence[str], more: bool | None = None) -> list[str]:
    """The ``metrics`` still moving between the last two budgets of a :func:`nested_budgets` table by more than their
    sampling error at the last one (jackknife): each as a line naming the tokens, and what to do: raise
    --max-train-tokens where the split holds more tokens (``more``; None: not known), else compare at this budget or
    use the debiased number."""
    if len(table) < 2:
        return []
    last, before = table.iloc[-1], table.iloc[-2]
    advice = {True: "raise --max-train-tokens", None: "raise --max-train-tokens if the split holds more tokens",
              False: "the whole split was read: compare at this budget, or use the debiased number where there is one"}
    lines = []
    for m in metrics:
        move, se = abs(last[m] - before[m]), last[se_name(m)]
        if np.isfinite(move) and np.isfinite(se) and move > se:
            lines.append(f"`{m}` has not settled at {int(last['tokens']):,} tokens (it moved {move:.3g} from "
                         f"{int(before['tokens']):,} tokens, more than its sampling error {se:.3g}): {advice[more]}")
    return lines
