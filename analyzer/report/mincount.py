"""How much Figure 1's metrics move with ``min_count``: each selected run's latest checkpoint (its last layer, the
checkpoint group) measured by :func:`~ncanalyze.analyzer.metrics.measure` at min_count 1, 2, 5 and 20, with the kept
classes at each and the relative change (report.md's section and ``min_count.csv``; a store only)."""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd

from ncanalyze.analyzer.report.figures import FIGURES
from ncanalyze.analyzer.report.tokens import GroupReader, latest_checkpoints
from ncanalyze.analyzer.schema import MEASURED
from ncanalyze.core.errors import UserError

MIN_COUNTS = (1, 2, 5, 20)  # the min_counts compared (1: the value every other table uses)
MAX_RUNS = 12  # at most this many runs (the first by name): one measure per (run's latest checkpoint, min_count)
HEADLINE = FIGURES["fig1_nc_vs_loss"][1]  # Figure 1's metrics
NEEDED = ("mean", "variance")  # what measure cannot do without (beside count)


def relative_change(values: Sequence[float]) -> float:
    """(max - min) / |first| over ``values`` (the first: at the smallest min_count); nan unless every value is
    finite and the first is not 0."""
    v = np.asarray(values, dtype=np.float64)
    if not np.isfinite(v).all() or v[0] == 0:
        return math.nan
    return float((v.max() - v.min()) / abs(v[0]))


def _measure_at(ds, m: int) -> tuple[dict[str, float], list[str]]:
    """:func:`measure` at min_count ``m``: the headline metrics and ``n_kept``, and measure's warnings that concern
    them (or the error that made it measure nothing) as notes."""
    from ncanalyze.analyzer.geometry import kept_classes  # the compiled metrics load only when needed
    from ncanalyze.analyzer.metrics import measure

    n, lacks = kept_classes(ds["count"].values, m).size, [v for v in NEEDED if v not in ds.variables]
    if lacks:
        return {**{k: math.nan for k in HEADLINE}, "n_kept": n}, [f"not measured: the group lacks {', '.join(lacks)}"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = measure(ds, min_count=m, se=False)
        except UserError as e:
            return {**{k: math.nan for k in HEADLINE}, "n_kept": n}, [f"not measured: {e}"]
    notes = [str(w.message) for w in caught if any(k in str(w.message) for k in HEADLINE)]
    return {**{k: got[k] for k in HEADLINE}, "n_kept": int(got["n_classes"])}, notes


def min_count_table(sel: pd.DataFrame, read_group: GroupReader, min_counts: Sequence[int] = MIN_COUNTS,
                    max_runs: int = MAX_RUNS) -> tuple[pd.DataFrame, list[str]]:
    """Figure 1's metrics of each run's latest selected checkpoint at each min_count.

    Parameters
    ----------
    sel
        The selected checkpoints' last-layer rows (run, checkpoint, global_step; tag where present).
    read_group
        Gives a checkpoint's dataset (:class:`GroupReader`).
    min_counts
        The min_counts, smallest first (the relative change is to the first's value).
    max_runs
        At most this many runs, the first by name; a note says so where there are more.

    Returns
    -------
    table, notes
        One row per run and metric: run, [tag,] checkpoint, metric, ``value_<m>`` and ``n_kept_<m>`` per min_count,
        ``rel_change`` ((max - min) / |value at the first min_count|, nan unless all are finite); and the notes:
        the cap, then each distinct warning or error of :func:`measure` with the checkpoints and min_counts it
        came from.
    """
    groups = latest_checkpoints(sel)
    notes = [f"{len(groups)} runs selected: the first {max_runs} by name are measured"] if len(groups) > max_runs \
        else []
    tags = sel.set_index(["run", "checkpoint"])["tag"].to_dict() if "tag" in sel and sel["tag"].notna().any() else {}
    said: dict[str, list[str]] = {}
    rows = []
    for g in groups[:max_runs]:
        run, ckpt = g.split("/", 1)
        try:
            ds = read_group(g)
        except UserError as e:
            said.setdefault(f"not read: {e}", []).append(g)
            continue
        ds = ds[[v for v in MEASURED if v in ds.variables]].load()  # read once for every min_count
        at = {}
        for m in min_counts:
            at[m], found = _measure_at(ds, m)
            for n in found:
                said.setdefault(n, []).append(f"{g} at {m}")
        for k in HEADLINE:
            row = {"run": run, **({"tag": tags.get((run, ckpt))} if tags else {}), "checkpoint": ckpt, "metric": k}
            for m in min_counts:
                row |= {f"value_{m}": at[m][k], f"n_kept_{m}": at[m]["n_kept"]}
            rows.append(row | {"rel_change": relative_change([at[m][k] for m in min_counts])})
    notes += [f"{n} ({', '.join(where)})" for n, where in said.items()]
    return pd.DataFrame(rows), notes


def min_count_lines(table: pd.DataFrame, notes: list[str], min_counts: Sequence[int] = MIN_COUNTS) -> list[str]:
    """report.md's section: what the table is, the table (values to 4 significant figures, kept classes beside
    them) and the notes."""
    ms = ", ".join(str(m) for m in min_counts)
    md = ["## How the headline metrics move with min_count", "",
          f"Figure 1's metrics of each selected run's latest checkpoint (its last layer), measured again at min_count "
          f"{ms} (`measure(ds, min_count=m)`): each value with the kept classes it rests on (count ≥ m), and the "
          f"relative change (max - min) / |value at {min_counts[0]}| over the {len(min_counts)} (empty where a "
          "value is not finite). NC4's decisions were counted at extraction over the kept set of its `--min-count` "
          "and, in the same validation pass, over those of min_count 1, 2, 5 and 20, so it is measured at each; a "
          "store extracted before that has NC4 at its own `--min-count` only (nan elsewhere, with the note below). "
          "The same numbers, unrounded, in `min_count.csv`.", ""]
    if not table.empty:
        show = table.copy()
        for m in min_counts:
            show[f"min_count {m} (kept)"] = [f"{v:.4g} ({k})" for v, k in zip(show.pop(f"value_{m}"),
                                                                               show.pop(f"n_kept_{m}"))]
        show["relative change"] = [("" if math.isnan(v) else f"{v:.3g}") for v in show.pop("rel_change")]
        md += [show.to_markdown(index=False, disable_numparse=True), ""]
    if notes:
        md += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return md
