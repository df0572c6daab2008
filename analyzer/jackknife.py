"""How sure one checkpoint's number is: the delete-one-fold jackknife over the fold sums that extraction keeps beside
the totals (SPEC section 3), and the metrics on nested token budgets (the first 1, 2, 4, ..., F folds).

The folds are disjoint sets of whole token blocks (block i -> fold i mod F), so their statistics are exact sums: the
statistics without fold i are the totals with fold i taken out (:func:`without`, Chan's merge undone) and those of a
subset of folds the folds merged (:func:`merged`), exact to rounding, never a resample of tokens. Each metric is
measured on each leave-one-out set (theta_(i)) as the point value is, and its error is

    se = sqrt((F - 1) / F * sum_i (theta_(i) - theta_bar)^2)        (Efron & Stein 1981; Quenouille 1956).

Up to :data:`EXACT_UP_TO` kept classes every leave-one-out set is measured by the same code as the point value
(``metrics.measure_all``: the exact jackknife). Above it, a leave-one-out set costs what the pairs cost (|K|^2 d /
2), so its pair sums (pairs.SUMS: the CDNV family, nc2_cos_std, gnc2_*) are estimated, and every other metric is
still measured exactly on it (the d x d moments, the per-class algebra, NC3, NC4):

- its sums are the whole sample's exact sums plus their change;
- the change of x^2 (x = T/t0 - 1, the cosines' spread) and of the controls below is exact, from d x d algebra
  (pairs.CONTROLS: sum x, x^2, p p' x over every pair);
- the rest of the change (the logs less their controls x - x^2/2, x^2, p p' x, whose remainders are ~x^3/3, ~x^3,
  ~x^2/2; the CDNV terms whole) is summed on two independent samples of pairs, each 1/(2 PAIR_BLOCKS) of them in blocks
  (:func:`pair_blocks`: every class with as many partners, so each class's own change is summed in full and only
  the pairs' interactions are sampled), the same pairs in every leave-one-out set, scaled to all pairs (unbiased:
  each pair is equally likely to be in a sample);
- the metrics of the mean of the two samples' estimates give the error; the samples' noise adds
  (F - 1)/F sum_i ((d_i - d_bar) / 2)^2 to its square in expectation (d_i: a metric from the first sample's sums less
  from the second's), which is taken off (not below 0) and stated, its square root, as the error's own sampling
  error (``se_sampling_error``, recorded with ``se_method`` where the errors are written).

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
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from ncanalyze.analyzer.registry import MEASURE
from ncanalyze.analyzer.schema import HEAD, MEASURED, NC4_WITHOUT, SCALARS, VAL_COUNTS, stats_dataset
from ncanalyze.core.errors import UserError

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


def merged(ds: xr.Dataset, folds: Sequence[int]) -> xr.Dataset:
    """The dataset of the tokens of ``folds`` alone: their statistics merged in one step (:func:`merge`) into the
    variables the metrics read, with ``ds``'s head, attributes and ``split_count`` (the debiased metrics' class set
    is the split's, the same for every subset of folds)."""
    folds = list(folds)
    m = merge(ds, folds)
    return _dataset(ds, m["count"], m["mean"], m["m2"], m.get("scatter"), m.get("unit_sum"),
                    {n: np.asarray(ds[f"fold_{n}"].values)[folds].sum(0) for n in VAL_COUNTS if f"fold_{n}" in ds},
                    len(folds))


def merge(ds: xr.Dataset, folds: list[int], probe: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The statistics of ``folds`` merged in one step, the parallel form of Chan's formula (exact to rounding):
    n = sum_f n_f, mu = sum_f n_f mu_f / n, M2 = sum_f M2_f + n_f ||mu_f - mu||^2, the scatter sum_f S_f +
    sum_{f,c} n_fc (mu_fc - mu_c)(mu_fc - mu_c)^T over the classes each fold holds; with ``probe`` (d x k) the
    scatter times it (O(F |V| d k), not d^2)."""
    fold = {n: ds[f"fold_{n}"].values for n in FOLD_STATS if f"fold_{n}" in ds}   # read in place, fold by fold
    nf = fold["count"][folds].astype(np.float64)
    count = fold["count"][folds].sum(0)
    mean = np.zeros(fold["mean"].shape[1:])
    for f, n in zip(folds, nf):
        held = np.flatnonzero(n > 0)
        mean[held] += n[held, None] * fold["mean"][f][held]
    held = count > 0
    mean[held] /= count[held, None]
    out = {"count": count, "mean": mean, "m2": fold["m2"][folds].sum(0)}
    if "scatter" in fold:
        out["scatter"] = sum(fold["scatter"][f] if probe is None else fold["scatter"][f] @ probe for f in folds)
    for f, n in zip(folds, nf):                                    # each fold's spread about the merged means
        held = np.flatnonzero(n > 0)
        dev = (fold["mean"][f][held] - mean[held]) * np.sqrt(n[held])[:, None]
        out["m2"][held] += np.einsum("cd,cd->c", dev, dev)
        if "scatter" in out:
            out["scatter"] += dev.T @ (dev if probe is None else dev @ probe)
    if "unit_sum" in fold:
        out["unit_sum"] = fold["unit_sum"][folds].sum(0)
    return out


def without(ds: xr.Dataset, i: int, rows: np.ndarray | None = None) -> xr.Dataset:
    """The dataset of every fold but ``i``: the totals with fold i taken out, Chan's merge undone. For each class
    with tokens on both sides, n' = n - n_i, mu' = (n mu - n_i mu_i) / n', M2' = M2 - M2_i - w ||mu_i - mu'||^2 and
    the scatter S - S_i - sum_c w (mu_i - mu')(mu_i - mu')^T (w = n_i n' / n): O(|V| d + |V_i| d^2) where merging
    the other F - 1 folds is O(F |V| d + ...), the same numbers to float64 rounding (a class left with one token
    has M2' = 0, one left with none is empty). Variables as :func:`merged`'s. ``rows``: where ``ds`` is cut to some
    classes but its ``fold_mean`` is not (:func:`counted_only`), their rows in it."""
    count, ni = np.asarray(ds["count"].values, np.int64), np.asarray(ds["fold_count"].values[i], np.int64)
    rest = count - ni
    mean = np.array(ds["mean"].values, np.float64)
    m2 = np.where(count > 0, np.asarray(ds["variance"].values, np.float64) * count, 0.0)
    both = np.flatnonzero((ni > 0) & (rest > 0))
    n, n_i, n_r = (x[both].astype(np.float64)[:, None] for x in (count, ni, rest))
    mu_i = np.asarray(ds["fold_mean"].values[i][both if rows is None else rows[both]])
    mean[both] = mu = (n * mean[both] - n_i * mu_i) / n_r
    delta = (mu_i - mu) * np.sqrt(n_i * n_r / n)
    m2[both] -= np.asarray(ds["fold_m2"].values[i][both]) + np.einsum("cd,cd->c", delta, delta)
    mean[rest == 0] = 0.0
    m2 = np.where(rest > 1, np.maximum(m2, 0.0), 0.0)
    scatter = None
    if "fold_scatter" in ds:
        scatter = (np.asarray(ds["within_covariance"].values, np.float64) * count.sum()
                   - np.asarray(ds["fold_scatter"].values[i]) - delta.T @ delta)
    unit = (np.asarray(ds["unit_sum"].values) - np.asarray(ds["fold_unit_sum"].values[i])
            if "fold_unit_sum" in ds and "unit_sum" in ds else None)
    val = {n: np.asarray(ds[n].values) - np.asarray(ds[f"fold_{n}"].values[i]) for n in VAL_COUNTS
           if f"fold_{n}" in ds and n in ds}
    if f"fold_{NC4_WITHOUT}" in ds and "val_ncc_agree" in val:   # NC4 with the train means without fold i as well
        val["val_ncc_agree"] = np.asarray(ds[f"fold_{NC4_WITHOUT}"].values[i])
    return _dataset(ds, rest, mean, m2, scatter, unit, val, n_folds(ds) - 1)


def _dataset(ds: xr.Dataset, count: np.ndarray, mean: np.ndarray, m2: np.ndarray, scatter: np.ndarray | None,
             unit_sum: np.ndarray | None, val: dict, folds: int) -> xr.Dataset:
    """A subset of folds' statistics as the dataset the metrics read (variance M2 / n, nan for an empty class; the
    within-class covariance S / N), with ``ds``'s head, attributes and ``split_count``."""
    head = {h: ds[h].values for h in HEAD if h in ds.variables}
    with np.errstate(invalid="ignore", divide="ignore"):
        return stats_dataset(count, mean, m2 / count, None if scatter is None else scatter / count.sum(),
                             unit_sum=unit_sum, val=val or None, attrs={**ds.attrs, "folds": folds},
                             split_count=ds["split_count"].values if "split_count" in ds else None, **head)


FOLD_RTOL = 1e-9  # fold sums merged vs the totals: float64 rounding over a merge is ~1e-15 of the largest value
REEXTRACT = "extract it again (ncanalyze extract ... --overwrite)"  # the fix of a damaged group


def fold_problems(ds: xr.Dataset) -> list[str]:
    """Where a group's fold sums do not add up to its totals, each in a few words (none: they do). The counts must
    sum exactly (``sum(fold_count) == count``, the validation counts too); the folds merged (Chan) must give the
    totals' mean and within-class covariance (each along 4 fixed random directions: O(|V| d) and O(F |V| d) to
    compare, where the whole d x d is O(F |V| d^2)), variance and unit sum to float64 rounding (:data:`FOLD_RTOL` of
    each variable's largest value). A forged fold, or a merge that counted a block twice, is found here."""
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
    probe = np.random.default_rng(0).standard_normal((ds.sizes["hidden"], 4))   # the scatter along 4 directions
    whole = _merged_along(ds, probe)
    for n in ("mean", "variance", "within_covariance", "unit_sum"):
        if n in ds and whole.get(n) is not None:
            a, b = whole[n], np.asarray(ds[n].values, np.float64)
            b = b @ probe if n in ("mean", "within_covariance") else b
            scale = np.nanmax(np.abs(b), initial=0.0)
            if not np.allclose(a, b, rtol=0, atol=FOLD_RTOL * scale, equal_nan=True):
                out.append(f"the folds merged differ from {n} by up to {np.nanmax(np.abs(a - b)) / (scale or 1):.2g} "
                           f"of its largest value")
    return out


def _merged_along(ds: xr.Dataset, probe: np.ndarray) -> dict[str, np.ndarray]:
    """Every fold merged (:func:`merge`) as :func:`fold_problems` compares them to the totals: the mean and the
    within-class covariance times ``probe``, the variance and the unit sum; each fold's spread taken about the
    totals' mean (the merged mean to rounding where the folds add up, and where they do not the mean says so), so
    each fold's means are read once."""
    fold = {n: ds[f"fold_{n}"].values for n in FOLD_STATS if f"fold_{n}" in ds}   # read in place, fold by fold
    count = fold["count"].sum(0)
    mean, m2 = np.zeros((count.size, probe.shape[1])), fold["m2"].sum(0)
    scatter = sum(s @ probe for s in fold["scatter"]) if "scatter" in fold else None
    total = np.asarray(ds["mean"].values)
    for mu_f, n in zip(fold["mean"], fold["count"]):
        held = np.flatnonzero(n > 0)
        mu, w = mu_f[held], n[held].astype(np.float64)[:, None]
        mean[held] += w * (mu @ probe)
        dev = (mu - total[held]) * np.sqrt(w)
        m2[held] += np.einsum("cd,cd->c", dev, dev)
        if scatter is not None:
            scatter += dev.T @ (dev @ probe)
    mean[count > 0] /= count[count > 0, None]                     # an empty class's mean: 0, as merge's
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"mean": mean, "variance": m2 / count, "unit_sum": fold["unit_sum"].sum(0)
                if "unit_sum" in fold else None, "within_covariance": None if scatter is None else scatter / count.sum()}


def replicates(ds: xr.Dataset, folds: Sequence[int], measure: Measure) -> tuple[pd.DataFrame, list[str]]:
    """Each leave-one-out set of ``folds``' scalar metrics (rows: the fold left out; nan where not measurable, why in
    the notes), measured by ``measure`` as the point value is."""
    rows, notes = {}, []
    whole = sorted(folds) == list(range(n_folds(ds)))             # leave-one-out of the totals: downdate them
    for i in folds:
        rest = [f for f in folds if f != i]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                rows[i] = measure(without(ds, i) if whole else merged(ds, rest))
            except UserError as e:
                rows[i] = {}
                notes.append(f"without fold {i}: {e}")
    return _frame(rows), notes


def jackknife(ds: xr.Dataset, measure: Measure, folds: Sequence[int] | None = None,
              point: Mapping[str, float] | None = None,
              min_count: int = MEASURE.min_count) -> tuple[dict[str, float], list[str]]:
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
    cannot = _cannot(ds, folds)
    if cannot:
        return {se_name(m): math.nan for m in SCALARS}, cannot
    theta, notes = replicates(ds, folds, measure)
    return _errors(ds, theta, point, min_count, notes)


def _cannot(ds: xr.Dataset, folds: list[int]) -> list[str]:
    """Why there is no jackknife error over ``folds`` (fewer than 2, damaged fold sums, a fold without a token),
    or nothing."""
    if len(folds) < 2:
        return ["no folds: extracted with --folds 1 (class_stats: folds=1 by default), so no jackknife error; "
                "extract --folds F, class_stats(..., folds=F) or se=False for the point values alone"]
    damaged = fold_problems(ds)
    if damaged:
        return [f"the fold sums do not add up to the totals ({'; '.join(damaged)}): the group is damaged, so no "
                f"jackknife error; {REEXTRACT}"]
    counts = np.asarray(ds["fold_count"].values)[folds].sum(1)
    if (counts == 0).any():
        empty = [f for f, c in zip(folds, counts) if c == 0]
        return [f"fold(s) {empty} hold no train token (fewer blocks than folds): no jackknife error; extract more "
                "tokens or fewer --folds"]
    return []


def jackknife_spread(theta: pd.DataFrame) -> pd.Series:
    """The jackknife error of each column of the replicates ``theta`` (k rows): sqrt((k - 1)/k sum (theta_i -
    mean)^2)."""
    k = len(theta)
    return np.sqrt((k - 1) / k * ((theta - theta.mean()) ** 2).sum())


def _errors(ds: xr.Dataset, theta: pd.DataFrame, point: Mapping[str, float] | None, min_count: int,
            notes: list[str]) -> tuple[dict[str, float], list[str]]:
    """The errors of the replicates ``theta``, nan (with a note) where a replicate is not finite or the point value
    is not (no note: its own warning says why)."""
    se = jackknife_spread(theta)
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


# ---------------------------------------------------------------- the pair metrics' replicates over sampled pairs

EXACT_UP_TO = 4096  # kept classes up to which every replicate sums every pair (the exact jackknife)
PAIR_BLOCKS = 96    # blocks of sampled pairs in each of the two samples, 1/(2 PAIR_BLOCKS) of the pairs each
SEED = 0            # the fixed random orders of the kept classes that cut them into blocks
EXACT = "delete-one-fold jackknife, every metric measured exactly on each leave-one-fold-out set"


def sampled_method(blocks: int) -> str:
    """How the errors are made where the pairs are sampled (recorded beside the errors); ``blocks`` per sample."""
    return (f"delete-one-fold jackknife; each leave-one-fold-out set's pair sums (the CDNV family, nc2_cos_std, "
            f"gnc2_*) are the whole sample's exact sums plus their change, exact where d x d algebra gives it (the "
            f"controls of pairs.py) and on two independent samples of pairs otherwise ({blocks} blocks, 1/{2 * blocks}"
            " of the pairs each, the same in every set) scaled to all pairs; every other metric exact; what the "
            "samples' noise adds to an error's square is estimated from the two samples' difference and taken off; "
            "se_sampling_error: that noise's size, the estimated error's own sampling error")


def pair_blocks(n: int, blocks: int = PAIR_BLOCKS, seed: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Two independent samples of the pairs of n kept classes (indices 0..n-1), ``blocks`` blocks each (2 ``blocks``
    index pairs, the first sample's first): in each, the classes in a random order (from ``seed``, default
    :data:`SEED`) cut into 2 ``blocks`` chunks, block k every pair of chunk 2k with chunk 2k + 1 (each pair equally
    likely to be sampled, each class paired with as many others, up to one)."""
    rng = np.random.default_rng(SEED if seed is None else seed)
    out = []
    for _ in range(2):
        chunks = np.array_split(rng.permutation(n), 2 * blocks)
        out += [(np.sort(chunks[2 * k]), np.sort(chunks[2 * k + 1])) for k in range(blocks)]
    return out


def sample_design(ds: xr.Dataset, min_count: int, exact_up_to: int | None = None) -> list | None:
    """The blocks of sampled pairs (:func:`pair_blocks` of the kept classes) where the errors sample the pairs: more
    than ``exact_up_to`` (default :data:`EXACT_UP_TO`) kept classes and 2 or more folds; else None (the exact
    jackknife)."""
    from ncanalyze.analyzer.geometry import kept_classes

    n = kept_classes(ds["count"].values, min_count).size
    return pair_blocks(n) if n > (EXACT_UP_TO if exact_up_to is None else exact_up_to) and n_folds(ds) >= 2 else None


def _within(blocks: list, K: np.ndarray, kept: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The blocks (indices into K) in the indices of ``kept`` (a subset of K), less the classes it has not."""
    at = np.full(K.size, -1)
    at[np.searchsorted(K, kept)] = np.arange(kept.size)
    return [(at[a][at[a] >= 0], at[b][at[b] >= 0]) for a, b in blocks]


Replicate = Callable[[xr.Dataset, list], tuple[np.ndarray, np.ndarray, Callable[[Any], Mapping[str, float]]]]


def _controlled() -> np.ndarray:
    """Which pairs.CONTROLS each pair sum (pairs.SUMS) is sampled less of (SUMS x CONTROLS): x^2 is itself a control
    (exact: nothing sampled), log(T/t0) = log(1 + x) less x - x^2/2, its square less x^2, the weighted log less
    p p' x."""
    from ncanalyze.analyzer.pairs import CONTROLS, SUMS

    A = np.zeros((len(SUMS), len(CONTROLS)))
    for name, weights in (("xx", {"xx": 1}), ("l", {"x": 1, "xx": -0.5}), ("ll", {"xx": 1}),
                          ("l_freq", {"px": 1})):
        for control, w in weights.items():
            A[SUMS.index(name), CONTROLS.index(control)] = w
    return A


@dataclass
class Sampled:
    """What the jackknife over sampled pairs reads from the point measurement: its kept classes ``K``, the
    ``blocks`` of pairs (:func:`pair_blocks`, indices into K), the exact sums over every pair (``whole``,
    pairs.SUMS), the sums over each block (``whole_blocks``, blocks x (SUMS, CONTROLS)) and the controls over every
    pair (``controls``), and ``replicate``: a leave-one-fold-out dataset and its blocks -> the same two of its own
    and its scalar metrics given pair sums (metrics.py); ``workers`` the replicates measured at once (threads: each
    is independent of the others, so a descheduled thread holds no other up)."""
    K: np.ndarray
    blocks: list
    whole: np.ndarray
    whole_blocks: np.ndarray
    controls: np.ndarray
    replicate: Replicate
    min_count: int = MEASURE.min_count
    workers: int = 1


def sampled_jackknife(ds: xr.Dataset, sampled: Sampled, point: Mapping[str, float] | None = None
                      ) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """:func:`jackknife` over every fold with the pair sums of each leave-one-fold-out set estimated from two
    samples of pairs (module doc): (errors, the sampling error of each estimated one, notes). With theta_i the
    metrics of the two samples' mean sums and d_i those of their difference, the samples' noise adds
    (F - 1)/F sum_i ((d_i - mean d) / 2)^2 to an error's square in expectation: taken off (not below 0), its square
    root is the sampling error stated."""
    folds = list(range(n_folds(ds)))
    cannot = _cannot(ds, folds)
    if cannot:
        return {se_name(m): math.nan for m in SCALARS}, {}, cannot
    theta, first, second, notes = _sampled_replicates(ds, folds, sampled)
    se, notes = _errors(ds, theta, point, sampled.min_count, notes)
    noise = jackknife_spread((first - second) / 2)
    sampling, unresolved = {}, []
    for m in SCALARS:
        name = se_name(m)
        if math.isfinite(se[name]) and not first[m].equals(second[m]):   # a pair metric
            corrected = math.sqrt(max(se[name] ** 2 - noise[m] ** 2, 0.0))
            sampling[name] = float(noise[m])
            if corrected <= noise[m]:       # not above its own sampling error: no number to state (never a 0)
                unresolved.append(m)
            se[name] = corrected if corrected > noise[m] else math.nan
    if unresolved:
        notes.append(f"{', '.join(unresolved)}: nan error, the sampled pairs do not resolve it (the estimate is not "
                     "above its own sampling error)")
    return se, sampling, notes


def _sampled_replicates(ds: xr.Dataset, folds: list[int], sampled: Sampled
                        ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, list[str]]:
    """Each leave-one-fold-out set's scalar metrics from its estimated pair sums: the whole sample's plus their
    change, the exact change of their controls (:func:`_controlled`) plus the rest of the change on each sample's
    pairs scaled by 1 / its share (each pair is equally likely to be sampled, each class has as many partners: the
    classes' own changes are summed in full, only the pairs' interactions are sampled); from the mean of the two
    samples' estimates, then from each alone; notes."""
    from ncanalyze.analyzer.geometry import kept_classes
    from ncanalyze.analyzer.pairs import PairSums

    n, A = sampled.K.size, _controlled()
    ds, K, counted = counted_only(ds, sampled.K)
    half = len(sampled.blocks) // 2
    sizes = np.array([len(a) * len(b) for a, b in sampled.blocks], dtype=np.float64).reshape(2, half)
    scale = n * (n - 1) / 2 / sizes.sum(1)

    def one(i: int) -> list[Mapping[str, float]] | str:
        """The metrics without fold i from the two samples' mean sums, then from each alone (or why not)."""
        rest = without(ds, i, counted)
        try:
            sums, controls, at = sampled.replicate(rest, _within(
                sampled.blocks, K, kept_classes(rest["count"].values, sampled.min_count)))
        except UserError as e:
            return f"without fold {i}: {e}"
        change = sums - sampled.whole_blocks
        change = change[:, :len(A)] - change[:, len(A):] @ A.T  # less the controls' change on the same pairs
        exact = sampled.whole + A @ (np.asarray(controls) - sampled.controls)
        each = [exact + scale[s] * change[s * half:(s + 1) * half].sum(0) for s in (0, 1)]
        return [at(PairSums(*estimate)) for estimate in ((each[0] + each[1]) / 2, *each)]

    rows, notes = ({}, {}, {}), []
    with warnings.catch_warnings(), ThreadPoolExecutor(max(1, min(sampled.workers, len(folds)))) as pool:
        warnings.simplefilter("ignore")                            # once, here: the filters are not per thread
        for i, got in zip(folds, pool.map(one, folds)):
            if isinstance(got, str):
                notes.append(got)
            for r, k in zip(rows, range(3)):
                r[i] = {} if isinstance(got, str) else got[k]
    return (*(_frame(r) for r in rows), notes)


def counted_only(ds: xr.Dataset, K: np.ndarray) -> tuple[xr.Dataset, np.ndarray, np.ndarray]:
    """``ds`` cut to the classes with a train token, where every replicate's kept classes are (a leave-one-fold-out
    set keeps a class only where its tokens outside the fold reach min_count >= 1), the kept classes ``K``
    renumbered into it, and the classes counted. Each replicate then reads, downdates and copies those rows alone (at
    a 128k vocabulary with 57k classes seen, 44% of them). The head goes in float64 once (exact: every float32 is a
    float64); ``fold_mean`` stays whole, read in place (:func:`without`'s ``rows``: no copy of every fold's means),
    and what the metrics do not read (the reservoir) is left behind; the whole split's label count goes with it
    (geometry.SPLIT_TOTAL: the debiased metrics' class set is a share of it)."""
    from ncanalyze.analyzer.geometry import SPLIT_TOTAL

    counted = np.flatnonzero(np.asarray(ds["count"].values) > 0)
    read = [v for v in (*MEASURED, *FOLD_VARS) if v in ds.data_vars and v != "fold_mean"]  # no reservoir copied
    cut = ds[read].isel(vocab=counted)
    cut["fold_mean"] = (("fold", "all_vocab", "hidden"), ds["fold_mean"].values)
    if "split_count" in ds:
        cut.attrs[SPLIT_TOTAL] = int(np.asarray(ds["split_count"].values).sum())
    for h in HEAD:
        if h in cut.variables:
            cut[h] = cut[h].astype(np.float64, copy=False)
    return cut, np.searchsorted(counted, K), counted


def _frame(rows: dict) -> pd.DataFrame:
    return pd.DataFrame.from_dict(rows, orient="index").reindex(columns=list(SCALARS)).astype(float)
