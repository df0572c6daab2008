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


NEW_RECORD = '''

def norm_ratio(g):
    """max ||m_c|| / min ||m_c|| over K: how far the class means are from equinorm."""
    return float(g.r.max() / g.r.min())


RECORDS = (*RECORDS[:-2], MetricRecord("norm_ratio", "metric_records", GEOMETRY, LOWER, "NC2: norm ratio",
                                       shown=True, compute=norm_ratio, published="none: a newcomer's metric"),
           *RECORDS[-2:])
BY_NAME = {r.name: r for r in RECORDS}
'''
PROBE = '''
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("ncanalyze.analyzer.metric_records", sys.argv[1])
records = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = records
spec.loader.exec_module(records)
sys.path.insert(0, sys.argv[2])
import numpy as np
from click.testing import CliRunner
from hooks import metric_cards
from ncanalyze.analyzer import schema, table
from ncanalyze.analyzer.metrics import measure
from ncanalyze.analyzer.report.figures import LABELS
from ncanalyze.analyzer.report.support import direction_lines
from ncanalyze.cli.main import main
ds = schema.stats_dataset(*(np.load(sys.argv[3])[k] for k in ("count", "mean", "variance", "cov")))
print(json.dumps({"value": measure(ds)["norm_ratio"], "geometry": "norm_ratio" in schema.GEOMETRY_METRICS,
                  "columns": "norm_ratio" in table.COLUMNS and "norm_ratio_se" in schema.ERRORS,
                  "again": table.is_measured({"metrics": {k: 1.0 for k in schema.SCALARS if k != "norm_ratio"},
                                              "metrics_version": schema.METRICS_VERSION, "metrics_min_count": 1},
                                             1),
                  "direction": direction_lines(["norm_ratio"])[0], "label": LABELS["norm_ratio"],
                  "help": CliRunner().invoke(main, ["measure", "--help"]).output,
                  "docs": metric_cards()}))
'''


@pytest.mark.slow
def test_a_new_metric_is_one_record_in_one_module(tmp_path):
    """A newcomer's metric written as one record with its function beside it, in a copy of metric_records.py alone
    (the rest of the package as it is): the schema's family and the table's columns hold it, ``measure`` computes
    it (against max/min of the class means' distances to their mean, in float64 here) and measures again a group
    measured before it (no version to bump), the report says its direction and titles its panel, ``measure --help`` prints it and the docs give it a card with its docstring."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import ncanalyze.analyzer.metric_records as records

    copy = tmp_path / "metric_records.py"
    copy.write_text(Path(records.__file__).read_text() + NEW_RECORD)
    rng = np.random.default_rng(3)
    count, mean = rng.integers(1, 9, 12), rng.normal(size=(12, 5)) * rng.uniform(0.5, 3, (12, 1))
    np.savez(tmp_path / "stats.npz", count=count, mean=mean, variance=rng.uniform(0.1, 1, 12), cov=np.eye(5) * 0.3)
    docs = Path(__file__).resolve().parents[2] / "docs"
    out = subprocess.run([sys.executable, "-c", PROBE, str(copy), str(docs), str(tmp_path / "stats.npz")],
                         capture_output=True, text=True, check=True).stdout
    got = json.loads(out.splitlines()[-1])
    norms = np.linalg.norm(mean - mean.mean(0), axis=1)  # m_c about the unweighted mean of the class means
    assert got["value"] == pytest.approx(norms.max() / norms.min(), rel=1e-12)
    assert got["geometry"] and got["columns"] and not got["again"]  # a store measured before it is measured again
    assert got["direction"] == "- `norm_ratio`: lower is more collapse" and got["label"] == "NC2: norm ratio"
    assert "norm_ratio" in got["help"]
    assert "### `norm_ratio`" in got["docs"] and "how far the class means are from equinorm" in got["docs"]
