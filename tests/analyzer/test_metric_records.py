"""The metric records (analyzer/metric_records.py): one per scalar metric, naming the function that computes it and
the store variables it reads; the schema's families, the report's directions and labels and `measure`'s columns are
read from them."""
from __future__ import annotations

import importlib
import math
import warnings

import numpy as np
import pytest

from ncanalyze.analyzer.metric_records import BY_NAME, RECORDS
from ncanalyze.analyzer.schema import GEOMETRY_METRICS, MEASURED, NC_METRICS, SCALARS, SCALE_DEPENDENT, stats_dataset


def test_every_metric_has_one_record_whose_function_computes_it():
    from ncanalyze.analyzer.metrics import DEFINITIONS

    assert [r.name for r in RECORDS] == list(SCALARS) and len(BY_NAME) == len(RECORDS)
    for r in RECORDS:
        module, name = r.function.rsplit(".", 1)
        assert getattr(importlib.import_module(module), name) is DEFINITIONS[r.name]
    assert set(NC_METRICS) == {r.name for r in RECORDS if r.family == "nc"}
    assert set(GEOMETRY_METRICS) == {r.name for r in RECORDS if r.family == "geometry"}
    assert SCALE_DEPENDENT == {"nc1_cdnv_p2": BY_NAME["nc1_cdnv_p2"].scale}


def planted(seed: int = 0):
    """A checkpoint dataset with every variable the metrics read: 10 classes of 3-30 tokens in 8 dimensions, drawn
    around separated means (finite values for every metric)."""
    rng = np.random.default_rng(seed)
    v, d = 10, 8
    mean = rng.normal(size=(v, d)) * 4
    count = rng.integers(3, 30, v)
    W = mean + rng.normal(size=(v, d)) * 0.5
    val_count = rng.integers(5, 20, v)
    val = {"val_count": val_count, "val_correct": val_count // 2, "val_ncc_agree": val_count // 3}
    unit = mean / np.linalg.norm(mean, axis=1, keepdims=True)
    return stats_dataset(count, mean, rng.uniform(0.5, 1.0, v), np.eye(d) * 0.8, classifier=W, val=val,
                         unit_sum=(unit * count[:, None]).sum(0))


BASE = ("count", "mean", "variance")  # every measurement reads these (a dataset without them is refused)


def test_a_record_names_what_its_metric_reads():
    """Each metric is finite on a dataset holding only what its record names, and NaN or absent when one of
    those variables is taken away (so `needs` is neither short nor padded)."""
    from ncanalyze.analyzer.metrics import measure

    full = planted()
    for r in RECORDS:
        kept = full.drop_vars([v for v in MEASURED if v in full and v not in (*r.needs, *BASE)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert math.isfinite(measure(kept)[r.name]), r.name
        for v in r.needs:
            if v in BASE:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    got = measure(kept.drop_vars(v)).get(r.name, math.nan)
                except Exception:  # a variable every metric reads: the dataset is refused
                    continue
            assert not math.isfinite(got), (r.name, v)


@pytest.mark.parametrize("name", SCALARS)
def test_every_metric_says_which_way_is_more_collapse(name):
    """report.md's line for each metric is its record's: a direction, or the reason it has none."""
    from ncanalyze.analyzer.report.support import direction_lines

    line = direction_lines([name])[0]
    assert line == f"- `{name}`: {BY_NAME[name].direction_text}"
    assert "is more collapse" in line or "no collapse direction" in line or "not read as more or less" in line
