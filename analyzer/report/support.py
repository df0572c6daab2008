"""What a report's numbers rest on: per checkpoint the kept classes, the singletons among them and the train and
validation token counts (metrics.csv's ``n_kept``, ``n_singletons``, ``n_thin``, ``train_tokens``,
``val_tokens``), which direction of each metric is "more collapse" (its record's), and the warning when many kept
classes rest on a handful of tokens."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ncanalyze.analyzer.report.tokens import GroupReader
from ncanalyze.analyzer.metric_records import BY_NAME, RECORDS

SUPPORT = ("n_kept", "n_singletons", "n_thin", "train_tokens", "val_tokens")
THIN = 5  # a kept class with fewer train tokens than this is "thin": its mean and variance are noise
THIN_SHARE = 0.25  # report.md warns where more than this share of the kept classes is thin

DIRECTION = {r.name: r.direction for r in RECORDS}  # metric: which way is more collapse (None: no direction)


def _counts(ds) -> dict[str, float]:
    """One checkpoint's support from its dataset: kept classes (count >= the min_count it was measured with),
    singletons and thin classes among them, and the token counts."""
    count = np.asarray(ds["count"].values, dtype=np.int64)
    min_count = int(ds.attrs.get("metrics_min_count") or ds.attrs.get("min_count") or 1)
    kept = count >= max(min_count, 1)
    val = ds.attrs.get("val_tokens")
    if val is None and "val_count" in ds:
        val = int(np.asarray(ds["val_count"].values).sum())
    return {"n_kept": int(kept.sum()), "n_singletons": int((count[kept] == 1).sum()),
            "n_thin": int((count[kept] < THIN).sum()), "train_tokens": int(ds.attrs.get("train_tokens", count.sum())),
            "val_tokens": math.nan if val is None else int(val)}


def with_support(df: pd.DataFrame, read_group: GroupReader | None) -> pd.DataFrame:
    """``df`` with the :data:`SUPPORT` columns, read from each checkpoint's group (its count vector and
    attributes; the same at every layer); without a store the columns an earlier metrics.csv has are kept and the
    others are NaN.

    Parameters
    ----------
    df
        The metrics table (run and checkpoint columns name the groups ``run/checkpoint``).
    read_group
        Gives a checkpoint's dataset by group, or None (a metrics CSV).

    Returns
    -------
    pandas.DataFrame
        A copy with the support columns (nullable integers) after the descriptive ones.
    """
    out = df.copy()
    if read_group is not None and {"run", "checkpoint"} <= set(df.columns):
        keys = list(dict.fromkeys(zip(df["run"].astype(str), df["checkpoint"].astype(str))))
        found = {k: _counts(read_group(f"{k[0]}/{k[1]}")) for k in keys}
        for col in SUPPORT:
            out[col] = [found[r, c][col] for r, c in zip(df["run"].astype(str), df["checkpoint"].astype(str))]
    for col in SUPPORT:
        out[col] = pd.to_numeric(out[col], errors="coerce").round().astype("Int64") if col in out else pd.NA
    return out.astype({c: "Int64" for c in SUPPORT})


def direction_lines(metrics: list[str]) -> list[str]:
    """report.md's list of which direction of each metric is more collapse.

    Parameters
    ----------
    metrics
        The metrics of the report.

    Returns
    -------
    list of str
        One Markdown bullet per metric.
    """
    out = []
    for m in metrics:
        said = BY_NAME[m].direction_text if m in BY_NAME else "not an NC property (no collapse direction)"
        out.append(f"- `{m}`: {said}")
    return out


def thin_warning(df: pd.DataFrame, share: float = THIN_SHARE) -> str | None:
    """A warning when, in some checkpoint, more than ``share`` of the kept classes have fewer than :data:`THIN`
    train tokens (their means and variances are noise, and the NC1 metrics move with ``--min-count``).

    Parameters
    ----------
    df
        The selected checkpoints with :data:`SUPPORT` columns.
    share
        The share of thin classes above which to warn.

    Returns
    -------
    str or None
        The warning, naming how many checkpoints and the worst, or None.
    """
    if not {"n_kept", "n_thin"} <= set(df.columns):
        return None
    frac = (df["n_thin"].astype(float) / df["n_kept"].astype(float)).where(df["n_kept"].astype(float) > 0)
    over = frac[frac > share]
    if over.empty:
        return None
    worst = df.loc[over.idxmax()]
    return (f"In {len(over)} of {len(df)} checkpoint(s) more than {share:.0%} of the kept classes have fewer than "
            f"{THIN} train tokens (worst: {worst.get('run')}/{worst.get('checkpoint')}, {over.max():.0%} of "
            f"{int(worst['n_kept'])}): the NC1 metrics rest on noisy means and variances and move with --min-count; "
            "raise --min-count or extract more train tokens (--max-train-tokens).")
