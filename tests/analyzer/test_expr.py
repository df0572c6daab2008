"""Report expressions: the known escapes are refused without side effects; valid ones equal pandas."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import numpy as np
import pandas as pd
import pytest
from ncanalyze.analyzer.expr import condition, evaluate
from ncanalyze.analyzer.report import ReportOptions, select, write_report
from ncanalyze.analyzer.stats import eval_controls
from ncanalyze.core.errors import UserError
from test_stats import study


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
    ("(-8) ** (1 / 3) > 0", "not a real number"),
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
        write_report(df, tmp_path / "r", ReportOptions(formats="png", where=f"@df.to_csv('{f}')", n_perm=0))
    with pytest.raises(UserError, match="control"):
        write_report(df, tmp_path / "r", ReportOptions(formats="png",
                                                       controls=[f"__import__('os').system('touch {f}')"], n_perm=0))
    assert not f.exists()


# ---------------------------------------------------------------- the budget: RE2, bounded length and nesting

@contextlib.contextmanager
def answers_within(seconds: int):
    """Fails (instead of hanging the suite) when the block runs longer than ``seconds``."""
    def late(*_):
        raise AssertionError(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - start < seconds


TEXTS = ["neo-a", "NEO-b", "gpt-c", "a\nNeo", "x.y", "", None]
REGEXES = [("contains", "neo", {}), ("contains", "neo", {"case": False}), ("contains", "NEO", {"flags": 2}),
           ("contains", "^neo", {"flags": 2 | 8}), ("contains", "a.neo", {"flags": 2 | 16}),
           ("contains", "a.neo", {}), ("contains", "x.y", {"regex": False}), ("contains", "[bc]$", {}),
           ("match", "ne", {}), ("match", "NE", {"case": False}), ("match", "a|n", {}), ("fullmatch", "neo-.", {}),
           ("fullmatch", "neo|gpt-c", {}), ("fullmatch", "n.*", {"flags": 2})]


@pytest.mark.parametrize("method, pat, kw", REGEXES)
def test_regexes_on_re2_agree_with_python_re(method, pat, kw):
    df = pd.DataFrame({"run": pd.array(TEXTS, dtype="str"), "n": range(len(TEXTS))})
    flags = kw.get("flags", 0) | (re.IGNORECASE if kw.get("case") is False else 0)
    find = {"contains": re.search, "match": re.match, "fullmatch": re.fullmatch}[method]
    want = [s is not None and (pat in s if kw.get("regex") is False else find(pat, s, flags) is not None)
            for s in TEXTS]
    args = ", ".join([repr(pat), *(f"{k}={v!r}" for k, v in kw.items())])
    assert condition(f"run.str.{method}({args})", df).tolist() == want
    negated = f"~run.str.{method}({args}) & (n >= 0)"  # a missing text: False, so its negation True, as in pandas
    pd.testing.assert_frame_equal(select(df, negated), df.query(negated))


@pytest.mark.parametrize("expr, want", [("run.str.contains('(.|.|.)*X', flags=2)", [0, 0, 1, 0]),
                                        ("run.str.match('(a|aa)*b', case=False)", [0, 0, 0, 1]),
                                        ("run.str.fullmatch('(a+)+$')", [1, 0, 0, 0]),
                                        ("run.str.contains('(a*)*(b|c)')", [0, 0, 1, 1])])
def test_catastrophic_regexes_answer_at_once(expr, want):
    """Patterns on which Python's re backtracks for ever over the first two texts; planted answers."""
    df = pd.DataFrame({"run": ["a" * 40, "a" * 39 + "!", "a" * 30 + "xb", "b" * 5]})
    with answers_within(5):
        assert condition(expr, df).tolist() == [bool(w) for w in want]


@pytest.mark.parametrize("expr, match", [
    (r"run.str.contains('(a)\\1')", "not accepted by RE2.*backreferences"),
    ("run.str.contains('(?=neo)')", "not accepted by RE2"),
    ("run.str.contains('a', flags=64)", r"flags=64 not allowed: RE2 takes re.IGNORECASE \(2\)"),
    ("run.str.contains('a', flags=re.I)", "attribute access"),
    ("n_params.str.contains('1')", "needs a text column"),
    ("run.str.match(1)", "string pattern"),
    ("run.str.contains('a{1001}')", "not accepted by RE2"),
    ("x" * 1001, "1001 characters, over the limit of 1000: shorten it"),
    ("-" * 900 + "global_step < 0", "nested 902 levels deep, over the limit of 50: simplify it"),
    ("not " * 200 + "n_params > 0", "over the limit of 50"),
    ("(" * 300 + "global_step" + ")" * 300, "nested deeper than the limit of 50"),
    (" + ".join(["global_step"] * 60) + " > 0", "nested 61 levels deep"),
    ("log(" * 100 + "n_params" + ")" * 100 + " > 0", "over the limit of 50"),
    ("[" * 200 + "]" * 200, "over the limit of 50"),
])
def test_over_budget_is_one_line_at_once(df, expr, match):
    for what, call in (("--where", lambda: select(df, expr)), ("control", lambda: eval_controls(df, [expr]))):
        with answers_within(5), pytest.raises(UserError, match=match) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and len(msg) < 600 and what in msg, msg


def test_within_budget_is_evaluated(df):
    deep = "(" * 40 + "global_step" + " + 1)" * 40 + " > 0"  # 41 levels
    pd.testing.assert_frame_equal(select(df, deep), df.query(deep))
    long = " or ".join(["global_step == 20"] * 47)  # 983 characters, flat
    assert len(long) < 1000
    pd.testing.assert_frame_equal(select(df, long), df.query("global_step == 20"))


def test_report_cli_answers_a_hostile_where_in_one_line(df, tmp_path):
    from click.testing import CliRunner
    from ncanalyze.cli.main import main

    df.to_csv(tmp_path / "m.csv", index=False)
    for where in ["-" * 900 + "global_step < 0", "run.str.contains('(a)\\\\1', flags=2)"]:
        with answers_within(60):
            r = CliRunner().invoke(main, ["report", str(tmp_path / "m.csv"), "--out", str(tmp_path / "r"),
                                          "--where", where, "--permutations", "0"])
        assert r.exit_code == 1 and r.output.startswith("Error: --where") and len(r.output.splitlines()) == 1, \
            r.output
    assert not (tmp_path / "r" / "report.md").exists()


# ---------------------------------------------------------------- the budget holds for every operator on every type

HOSTILE = [  # each would take gigabytes or run for ever if text could be repeated or numbers grew without bound
    ("(run * 300000000).str.len() > 0", "'\\*' on text \\(run\\) not allowed"),
    ("run * 10 ** 9 == ''", "'\\*' on text \\(run\\) not allowed"),
    ("(run.str.upper() * 300000000).str.len() > 0", "'\\*' on text"),
    ("300000000 * run == ''", "'\\*' on text"),
    ("run + run == ''", "'\\+' on text"),
    ("run ** 99999 == ''", "'\\*\\*' on text"),
    ("'ab' * 300000000 == run", "'\\*' on a string not allowed"),
    ("-run == ''", "'-' on text"),
    ("log(run) > 0", "'log\\(\\)' on text"),
    ("run.str.strip() % 2 == 0", "'%' on text"),
]


@pytest.mark.parametrize("expr, match", HOSTILE)
def test_text_takes_no_arithmetic_refused_at_once_in_one_line(df, expr, match):
    for what, call in (("--where", lambda: select(df, expr)), ("control", lambda: eval_controls(df, [expr]))):
        with answers_within(5), pytest.raises(UserError, match=match) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{what} {expr!r}: ") and "nested" not in msg, msg


NUMERIC = [  # numbers stay fixed-width: overflow to inf (or a one-line error) at once, never a growing Python int
    ("((obj ** 999) ** 999) ** 999 > 0", "all"), ("(obj ** obj) ** obj > 0", "all"),
    ("obj * 99999999999999999999999999 ** 30 > 0", "all"), ("((10 ** 999) ** 999) ** 999 > obj", "all"),
    ("(global_step * 99999999999999999999999999) ** 999 > 0", "stepped"), ("global_step ** 1e308 > 0", "stepped"),
    ("(run.str.len() * 10 ** 300) ** 999 > 0", "all"), ("exp(exp(exp(n_params))) > 0", "all"),
]


@pytest.mark.parametrize("expr, want", NUMERIC)
def test_numbers_never_grow_past_a_column(df, expr, want):
    df["obj"] = pd.Series([10 ** 20 + i for i in range(len(df))], dtype=object)  # Python ints, as a store may give
    with answers_within(5):
        got = condition(expr, df)
    assert got.tolist() == ([True] * len(df) if want == "all" else (df.global_step > 0).tolist())


def test_arithmetic_on_number_columns_of_python_objects_equals_floats(df):
    df["obj"] = pd.Series(list(df.global_step), dtype=object)
    pd.testing.assert_series_equal(evaluate("obj * 2 + 1", df), (df.global_step * 2 + 1).astype(float).rename("obj"))


# ---------------------------------------------------------------- issue 37: arithmetic never wraps, overflow is inf

def test_integer_columns_never_wrap_in_arithmetic(df):
    df["n_params"] = np.array([6_900_000_000, 3, 10, 2 ** 40] * 3, dtype=np.int64)
    got = evaluate("n_params * n_params", df)
    want = df.n_params.to_numpy(dtype=np.float64) ** 2  # the float64 brute force: every square positive
    assert got.dtype == np.float64 and np.array_equal(got.to_numpy(), want) and (got > 0).all()
    assert condition("n_params * n_params > 0", df).all()  # int64 wraps 6.9e9 ** 2 to a negative: rows dropped
    assert condition("n_params * n_params * n_params * n_params > 1e38", df).tolist() == [True, False, False,
                                                                                          True] * 3


@pytest.mark.parametrize("expr", ["10.0 ** 400", "9 ** 999", "10 ** 308 * 10", "-(9 ** 999)",
                                  "2.0 ** 1000 * 2.0 ** 24"])
def test_overflow_of_literals_is_inf_as_promised(df, expr):
    got = evaluate(expr, df)
    assert np.isinf(got) and np.sign(got) == (-1 if expr.startswith("-") else 1)


@pytest.mark.parametrize("expr", ["(-8) ** (1 / 3)", "(-2) ** 0.5", "-8 ** 0.5 > 0 or (0 - 8) ** 0.25 > 0"])
def test_a_complex_result_is_refused_in_one_line(df, expr):
    with pytest.raises(UserError, match="not a real number") as e:
        evaluate(expr, df)
    assert "\n" not in str(e.value)
    assert evaluate("(-8) ** 3", df) == -512.0 and abs(evaluate("8 ** (1 / 3)", df) - 2.0) < 1e-15


@pytest.mark.parametrize("literal", ["'a`b`'", '"`odd name`"', "'x`'", "'`'"])
def test_a_backtick_inside_a_string_literal_is_text_not_a_column(df, literal):
    text = eval(literal)  # the test's own literal, not user input
    df.loc[3, "run"] = text
    assert condition(f"run == {literal}", df).tolist() == [i == 3 for i in range(len(df))]
    assert condition(f"`odd name` == 3 and run == {literal}", df).tolist() == [i == 3 for i in range(len(df))]
