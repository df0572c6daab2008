"""Report expressions: the known escapes are refused without side effects; valid ones equal pandas."""
from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
from test_stats import study

from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.expr import condition, evaluate
from ncanalyze.analyzer.report import ReportOptions, select, write_report
from ncanalyze.analyzer.stats import eval_controls


@pytest.fixture
def df():
    out = study(n_runs=4, per_run=3, seed=5)
    out["run"] = ["neo-a", "neo-b", "gpt-c", "neo-d"] * 3
    out["n_layers"] = [1, 2, 4, 4] * 3
    out["hidden_size"] = [64, 128, 256, 256] * 3
    out["global_step"] = [0, 20, 40] * 4
    out["odd name"] = np.arange(len(out))
    return out


ESCAPES = [
    ("@pd.io.common.os.system('touch {f}')", "'@'"),
    ("@df.to_csv('{f}')", "'@'"),
    ("n_params > 0 and @df.to_csv('{f}')", "'@'"),
    ("__import__('os').system('touch {f}')", r"method \.system\(\) not allowed"),
    ("__import__('os')", "call of '__import__' not allowed"),
    ("().__class__.__bases__[0].__subclasses__()", "not allowed"),
    ("n_params.__class__", r"attribute access \.__class__ not allowed"),
    ("run.to_csv('{f}')", r"method \.to_csv\(\) not allowed"),
    ("(lambda: open('{f}', 'w'))()", "not allowed"),
    ("open('{f}', 'w')", "call of 'open' not allowed"),
    ("eval(\"open('{f}', 'w')\")", "call of 'eval' not allowed"),
    ("[open('{f}', 'w') for _ in [1]]", "comprehensions not allowed"),
    ("run.str.__class__", "not allowed"),
    ("run.str.cat('{f}')", "not allowed"),
    ("n_params[0]", "subscripts"),
    ("(x := 1)", "assignment"),
    ("f'{{run}}'", "f-strings"),
    ("10 ** 10 ** 10", "too large"),
    ("((10 ** 999) ** 999) ** 999", "cannot be evaluated"),
]


@pytest.mark.parametrize("text, match", ESCAPES)
def test_escapes_are_refused_without_side_effect(df, tmp_path, text, match):
    f = tmp_path / "pwned"
    expr = text.format(f=f)
    before = os.listdir(tmp_path)
    for call in (lambda: select(df, expr), lambda: eval_controls(df, [expr])):
        with pytest.raises(UserError, match=match) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "columns: run, checkpoint" in msg
    assert not f.exists() and os.listdir(tmp_path) == before


VALID_WHERE = ["n_layers == 4 and hidden_size == 256", "run.str.startswith('neo')", "global_step in [20, 40]",
               "global_step not in [20, 40]", "run.str.endswith('-d') or n_layers < 2",
               "not (n_layers == 4) & (hidden_size > 64)", "run.str.contains('eo-[ab]')", "1 < n_layers <= 4",
               "n_layers == [1, 4]", "n_layers != [1, 4]", "run == 'neo-a' | run == 'gpt-c'",
               "log(n_params) > 15 and global_step >= 20", "`odd name` % 2 == 0", "-global_step < -10",
               "eval_loss * 2 - 1 > 5.5", "~(global_step == 0)",
               "n_layers == 4 & hidden_size == 256 | global_step == 0"]


@pytest.mark.parametrize("expr", VALID_WHERE)
def test_valid_conditions_equal_pandas_query(df, expr):
    pd.testing.assert_frame_equal(select(df, expr), df.query(expr))


VALID_VALUES = ["log(n_params)", "log1p(global_step)", "log10(n_params) * 2", "sqrt(global_step) + 1",
                "exp(-eval_loss)", "abs(nc2_cos_mean)", "global_step / 40 ** 2", "global_step // 7 % 3",
                "`odd name` + 1"]


@pytest.mark.parametrize("expr", VALID_VALUES)
def test_valid_values_equal_pandas_eval(df, expr):
    got = eval_controls(df, [expr])[expr]
    want = pd.to_numeric(df.eval(expr), errors="coerce").astype(float).rename(expr)
    pd.testing.assert_series_equal(got, want)
    pd.testing.assert_series_equal(evaluate(expr, df).astype(float).rename(expr), want)


def test_missing_values_do_not_match(df):
    df.loc[[0, 3], "n_layers"] = np.nan
    assert condition("n_layers == 4", df).sum() == 5
    pd.testing.assert_frame_equal(select(df, "n_layers != 4"), df.query("n_layers != 4"))


@pytest.mark.parametrize("expr, match", [("n_params >", "syntax error"), ("nope == 1", "unknown name 'nope'"),
                                         ("`no such` == 1", "unknown column `no such`"),
                                         ("n_params + 1", "not a condition"), ("log", "must be called"),
                                         ("global_step in 20", "list literal"), ("run + 'x'", "on a string")])
def test_mistakes_are_one_line_user_errors(df, expr, match):
    with pytest.raises(UserError, match=match) as e:
        select(df, expr)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--where {expr!r}")


def test_report_refuses_escapes_in_where_and_controls(df, tmp_path):
    f = tmp_path / "pwned.csv"
    with pytest.raises(UserError, match="'@'"):
        write_report(df, tmp_path / "r", ReportOptions(where=f"@df.to_csv('{f}')", n_perm=0))
    with pytest.raises(UserError, match="control"):
        write_report(df, tmp_path / "r", ReportOptions(controls=[f"__import__('os').system('touch {f}')"], n_perm=0))
    assert not f.exists()
