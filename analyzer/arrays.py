"""Plain arrays (numpy, dask or torch) -> a checkpoint dataset with the store's variables: the exact class statistics
that extraction accumulates, for non-LM use and ad-hoc study (SPEC section 4, ``class_stats``)."""
from __future__ import annotations

from typing import Any

import dask
import dask.array as da
import numpy as np
import xarray as xr

from ncanalyze.analyzer.geometry import kept_classes
from ncanalyze.analyzer.registry import MEASURE
from ncanalyze.analyzer.schema import NC4_MIN_COUNT, NC4_MIN_COUNTS, NC4_WITHOUT, VAL_AT, stats_dataset
from ncanalyze.core.errors import UserError

MAX_FOLDS = 64  # as extraction's --folds


def class_stats(embeddings: Any, labels: Any, num_classes: int, *, classifier: Any = None,
                classifier_bias: Any = None, val_embeddings: Any = None, val_labels: Any = None,
                min_count: int = MEASURE.min_count, batch_size: int = 65536, folds: int = 1, block_size: int = 1) -> xr.Dataset:
    """Exact class statistics of plain arrays (numpy, dask or torch; n x d features, n labels) as a dataset with
    the store's variables, ready for :func:`measure`.

    ``classifier`` (num_classes x d) and ``classifier_bias`` add NC3; with them, ``val_embeddings`` and
    ``val_labels`` add NC4's counts (decisions over the classes with count >= ``min_count``, as extraction does).
    ``folds`` > 1 adds the fold sums, as extraction keeps them: row i is in block i // ``block_size``, and block b in
    fold b mod ``folds`` (train and validation alike); then :func:`measure` gives the jackknife errors too (without
    folds they are nan, with a warning; ``measure(..., se=False)`` asks for the point values alone).
    """
    from ncanalyze.analyzer.accumulate import ClassStats, FoldStats

    folds, block_size = _whole("folds", folds, MAX_FOLDS), _whole("block_size", block_size, 2**63 - 1)
    acc, parts, start = None, None, 0
    for h, y in _batches(embeddings, labels, batch_size, num_classes, "embeddings"):
        if acc is None:
            acc = ClassStats(num_classes, h.shape[1], device=h.device)
            parts = FoldStats(folds, num_classes, h.shape[1], device=h.device) if folds > 1 else None
        acc.update(h, y)
        if parts is not None:
            parts.update(h, y, _fold(start, len(y), block_size, folds))
        start += len(y)
    if acc is None or int(acc.count.sum()) == 0:
        raise UserError("class_stats got no embeddings: pass a non-empty (n x d) array and n labels")
    d = acc.mean.shape[1]
    W = None if classifier is None else _numpy(classifier, (num_classes, d), "classifier")
    b = None if W is None or classifier_bias is None else _numpy(classifier_bias, (num_classes,), "classifier_bias")
    ds = stats_dataset(acc.count, acc.mean, acc.variance, acc.within_covariance, unit_sum=acc.unit_sum, classifier=W,
                       classifier_bias=b, attrs={"min_count": int(min_count), "train_tokens": int(acc.count.sum())})
    if val_embeddings is not None:
        if classifier is None or val_labels is None:
            raise UserError("NC4 needs the classifier and the labels: pass classifier= (and classifier_bias=) and "
                            "val_labels= with val_embeddings")
        val, fold_val = _val_counts(ds, val_embeddings, val_labels, min_count, batch_size, folds, block_size, parts)
        for name, v in val.items():  # VAL_AT: one row per NC4_MIN_COUNTS, so NC4 is measurable at each
            ds[name] = ((NC4_MIN_COUNT, "vocab") if name in VAL_AT else "vocab"), v
        ds = ds.assign_coords({NC4_MIN_COUNT: np.asarray(NC4_MIN_COUNTS, dtype=np.int64)})
        ds.attrs["val_tokens"] = int(ds["val_count"].sum())
    if parts is not None:
        from ncanalyze.analyzer.jackknife import fold_variables

        ds = ds.assign(fold_variables(parts.state_dict(), fold_val if val_embeddings is not None else None))
        ds.attrs["folds"] = folds
    return ds


def _whole(name: str, value: Any, maximum: int) -> int:
    """``value`` as a whole number from 1 to ``maximum``; else a UserError in one line naming ``name``."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 1 <= value <= maximum:
        return int(value)
    raise UserError(f"class_stats {name} must be a whole number from 1 to {maximum}, got {value!r}")


def _fold(start: int, n: int, block_size: int, folds: int):
    """The fold of rows ``start .. start + n - 1``: block row // block_size, fold block mod folds."""
    import torch

    return (torch.arange(start, start + n) // block_size) % folds


def _numpy(x: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
    x = np.asarray(x, dtype=np.float64)
    if x.shape != shape:
        raise UserError(f"{what} must have shape {shape} (classes x hidden); got {x.shape}")
    return x


def _batches(h: Any, y: Any, batch_size: int, num_classes: int, what: str):
    """(features, labels) as float64 / int64 torch batches, validated; dask input chunk by chunk."""
    import torch

    if h.ndim != 2 or y.ndim != 1 or h.shape[0] != y.shape[0]:
        raise UserError(f"{what} must be (n x d) with n labels; got shapes {tuple(h.shape)} and {tuple(y.shape)}")
    if isinstance(h, da.Array) or isinstance(y, da.Array):
        h, y = da.asarray(h), da.asarray(y)
        y = y.rechunk((h.chunks[0],))
        parts = ((hb, yb) for hb, yb in zip(h.to_delayed()[:, 0], y.to_delayed()))
        parts = (dask.compute(hb, yb) for hb, yb in parts)
    else:
        parts = ((h[s:s + batch_size], y[s:s + batch_size]) for s in range(0, h.shape[0], batch_size))
    for hb, yb in parts:
        hb, yb = torch.as_tensor(hb), torch.as_tensor(yb)
        if yb.dtype.is_floating_point or yb.dtype == torch.bool:
            raise UserError(f"{what} labels must be integers (got {yb.dtype})")
        hb, yb = hb.to(torch.float64), yb.to(torch.int64)
        if len(yb) and (int(yb.min()) < 0 or int(yb.max()) >= num_classes):
            raise UserError(f"{what} labels must lie in [0, {num_classes}); got {int(yb.min())}..{int(yb.max())}")
        if not torch.isfinite(hb).all():
            raise UserError(f"{what} contain NaN or Inf")
        yield hb, yb


def _val_counts(ds: xr.Dataset, h: Any, y: Any, min_count: int, batch_size: int, folds: int = 1,
                block_size: int = 1, parts: Any = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """NC4's counts per true class, over the kept classes, exactly as extraction counts them (and per fold with
    ``folds`` > 1: folds x vocab, with the agreements under the means without each fold of ``parts``, the
    FoldStats; else None)."""
    import torch

    from ncanalyze.analyzer.accumulate import DecisionCounts

    K = torch.as_tensor(kept_classes(ds["count"].values, min_count))
    bias = torch.as_tensor(ds["classifier_bias"].values) if "classifier_bias" in ds else None
    per_fold = None if folds == 1 else DecisionCounts.zeros(ds.sizes["vocab"], "cpu", folds) | {
        NC4_WITHOUT: torch.zeros(folds, ds.sizes["vocab"], dtype=torch.int64)}
    counts = DecisionCounts(torch.as_tensor(ds["classifier"].values), bias, torch.as_tensor(ds["mean"].values), K,
                            folds=per_fold, train_count=torch.as_tensor(ds["count"].values), fold_stats=parts,
                            min_count=min_count)
    start = 0
    for hb, yb in _batches(h, y, batch_size, ds.sizes["vocab"], "val_embeddings"):
        counts.begin(_fold(start, len(yb), block_size, folds) if per_fold is not None else None)
        counts.update(hb, yb)
        start += len(yb)
    as_np = {k: v.cpu().numpy() for k, v in counts.counts.items()}
    return as_np, None if per_fold is None else {k: v.cpu().numpy() for k, v in per_fold.items()}

