"""Errors where the numbers are read: the final checkpoints' table (report.md, tables.tex), the error bars drawn only
where wider than the marker, and the token budget's lines."""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import pandas as pd  # noqa: E402

from ncanalyze.analyzer.report.figures import error_bars  # noqa: E402
from ncanalyze.analyzer.report.precision import (  # noqa: E402
    budget_figure,
    budget_lines,
    error_lines,
    errors_latex,
    final_rows,
)


def table() -> pd.DataFrame:
    return pd.DataFrame({"run": ["a", "a", "b"], "checkpoint": ["c-1", "c-2", "c-9"], "global_step": [1, 2, 9],
                         "nc1_cdnv": [1.0, 0.5, 0.25], "nc1_cdnv_se": [0.1, 0.05, math.nan],
                         "unc3_cos_cv": [0.3, 0.2, 0.1], "unc3_cos_cv_se": [0.01, 0.02, 0.03]})


def test_the_final_checkpoints_errors_in_report_md_and_tables_tex():
    assert final_rows(table()).checkpoint.tolist() == ["c-2", "c-9"]
    md = "\n".join(error_lines(table(), ["nc1_cdnv", "unc3_cos_cv"]))
    assert "| `a` | `c-2` | 0.500 ± 0.050 | 0.200 ± 0.020 |" in md and "| `b` | `c-9` | 0.250 | 0.100 ± 0.030 |" in md
    assert "point values" in md
    tex = errors_latex(table(), ["nc1_cdnv", "unc3_cos_cv"])
    assert r"0.500 $\pm$ 0.050" in tex and r"\label{tab:errors}" in tex
    assert error_lines(table().drop(columns=["nc1_cdnv_se", "unc3_cos_cv_se"]), ["nc1_cdnv"]) == []


def test_error_bars_only_where_wider_than_the_marker():
    fig, ax = plt.subplots(figsize=(4, 3), dpi=100)
    d = pd.DataFrame({"x": [1.0, 2.0, 3.0], "y": [1.0, 2.0, 3.0], "e": [0.5, 0.001, math.nan]})
    ax.set_xlim(0, 4)
    ax.set_ylim(0, 4)
    assert error_bars(ax, d, "y", size=5) == 1  # 0.5 of 4 over ~230 px: wide; 0.001: inside the marker; nan: none
    assert error_bars(ax, d.assign(e=np.nan), "x", size=5) == 0
    plt.close(fig)


def test_budget_lines_name_the_unsettled_metric():
    t = pd.DataFrame({"run": "a", "checkpoint": "c", "folds": [1, 2, 4], "tokens": [100, 200, 400],
                      "nc1_cdnv": [1.0, 2.0, 2.01], "nc1_cdnv_se": [math.nan, 0.1, 0.1],
                      "unc3_cos_cv": [1.0, 1.0, 1.5], "unc3_cos_cv_se": [math.nan, 0.1, 0.1]})
    md = "\n".join(budget_lines(t, ["x: no folds"], ["nc1_cdnv", "unc3_cos_cv"]))
    assert "`unc3_cos_cv` has not settled at 400 tokens" in md and "raise --max-train-tokens" in md
    assert "`nc1_cdnv` has not" not in md and "- x: no folds" in md


def test_the_budget_figure_draws_a_metric_undefined_at_every_budget(tmp_path):
    """A metric NaN at every budget (unc3_cos_cv of a near-random head: its mean cosine not above its noise) is an
    empty panel saying so; the others keep their log axis (the report once stopped with matplotlib's 'Data cannot
    be log-scaled')."""
    t = pd.DataFrame({"run": "a", "checkpoint": "c", "folds": [1, 2, 4], "tokens": [100, 200, 400],
                      "nc1_cdnv": [1.0, 2.0, 2.01], "nc1_cdnv_se": [math.nan, 0.1, 0.1],
                      "unc3_cos_cv": math.nan, "unc3_cos_cv_se": math.nan})
    path = budget_figure(t, ["nc1_cdnv", "unc3_cos_cv"], tmp_path)
    assert path == tmp_path / "budget.png" and path.stat().st_size > 0


def drifting(split_tokens: float, last_se: float = 0.1) -> pd.DataFrame:
    """A checkpoint whose plug-in CDNV doubles over the budgets while its debiased form scatters within its error."""
    return pd.DataFrame({"run": "a", "checkpoint": "c", "folds": [1, 2, 4, 8], "tokens": [100, 200, 400, 800],
                         "nc1_cdnv": [1.0, 1.4, 1.8, 2.0], "nc1_cdnv_se": [math.nan, 0.1, 0.1, last_se],
                         "nc1_cdnv_debiased": [2.1, 1.95, 2.05, 2.0],
                         "nc1_cdnv_debiased_se": [math.nan, 0.2, 0.15, last_se],
                         "split_tokens": split_tokens})


def test_budget_lines_say_which_metric_drifts_and_which_number_to_compare():
    md = "\n".join(budget_lines(drifting(800), [], ["nc1_cdnv"]))
    row = next(line for line in md.splitlines() if line.startswith("- `a/c` `nc1_cdnv`:"))
    assert "drifts with the budget (bias)" in row and "+6.0 errors" in row and "`nc1_cdnv_debiased` across budgets" in row
    row = next(line for line in md.splitlines() if line.startswith("- `a/c` `nc1_cdnv_debiased`:"))
    assert "only scatters (noise)" in row and "+0.3 errors" in row   # (2.0 - 1.95) / 0.2
    assert "sampling error" in md and "how sure" not in md


def test_where_the_mean_of_ratios_drifts_even_debiased_the_pooled_pairs_are_the_number_to_compare():
    """The KJV's shape (benchmarks/results/budget.md): the plug-in and the debiased CDNV both climb; the pooled pairs'
    debiased CDNV scatters. Without the pooled column, no form holds still and the report says so."""
    t = drifting(800).assign(nc1_cdnv_debiased=[1.2, 1.4, 1.8, 2.0], nc1_cdnv_pooled_debiased=[0.66, 0.67, 0.66, 0.665],
                             nc1_cdnv_pooled_debiased_se=[math.nan, 0.01, 0.01, 0.01])
    md = "\n".join(budget_lines(t, [], ["nc1_cdnv"]))
    for m in ("nc1_cdnv", "nc1_cdnv_debiased"):
        row = next(line for line in md.splitlines() if line.startswith(f"- `a/c` `{m}`:"))
        assert "drifts with the budget (bias)" in row and "compare `nc1_cdnv_pooled_debiased` across budgets" in row
    row = next(line for line in md.splitlines() if line.startswith("- `a/c` `nc1_cdnv_pooled_debiased`:"))
    assert "only scatters (noise)" in row and "-0.5 errors" in row        # (0.665 - 0.67) / 0.01
    md = "\n".join(budget_lines(t.drop(columns=["nc1_cdnv_pooled_debiased", "nc1_cdnv_pooled_debiased_se"]), [],
                                ["nc1_cdnv"]))
    row = next(line for line in md.splitlines() if line.startswith("- `a/c` `nc1_cdnv`:"))
    assert "no form of it holds still here: at equal budgets only" in row


def test_raise_the_budget_only_where_the_split_holds_more_tokens():
    read_all = "\n".join(budget_lines(drifting(800), [], ["nc1_cdnv"]))
    assert "`nc1_cdnv` has not settled at 800 tokens" in read_all and "raise --max-train-tokens" not in read_all
    assert "the whole split was read: compare at this budget, or use the debiased number" in read_all
    more = "\n".join(budget_lines(drifting(10_000), [], ["nc1_cdnv"]))
    assert "raise --max-train-tokens" in more and "whole split was read" not in more


def test_settled_needs_errors():
    """--folds 64 over 10 blocks: the last budgets' errors are nan, so nothing is said to have settled."""
    md = "\n".join(budget_lines(drifting(800, last_se=math.nan), [], ["nc1_cdnv"]))
    assert "moved less than its" not in md
    assert "Whether `nc1_cdnv`, `nc1_cdnv_debiased` settled is not known" in md


@pytest.mark.slow
def test_the_budget_figure_draws_both_numbers_in_every_format(tmp_path):
    from ncanalyze.analyzer.report.precision import budget_figure

    png = budget_figure(drifting(800), ["nc1_cdnv"], tmp_path, ("png", "pdf", "svg"))
    assert png == tmp_path / "budget.png"
    assert {p.name for p in tmp_path.iterdir()} == {"budget.png", "budget.pdf", "budget.svg"}
    assert "nc1_cdnv_debiased" in (tmp_path / "budget.svg").read_text()   # the dashed line's legend


def test_estimates_choose_the_number_the_figures_and_claims_use():
    from ncanalyze.core.errors import UserError
    from ncanalyze.analyzer.report import ReportOptions
    from ncanalyze.analyzer.report.figures import FIGURES, chosen, estimated

    fig1, every = FIGURES["fig1_nc_vs_loss"][1], ("nc1_cdnv", "nc1_cdnv_debiased", "gnc2_log_std")
    has = pd.DataFrame({"nc1_cdnv": [1.0], "nc1_cdnv_debiased": [2.0]})
    assert chosen(fig1, estimated(every, "debiased", has)) == ["nc1_cdnv_debiased", "gnc2_log_std"]
    assert chosen(fig1, estimated(every, "plugin", has)) == ["nc1_cdnv", "gnc2_log_std"]
    older = pd.DataFrame({"nc1_cdnv": [1.0], "nc1_cdnv_debiased": [math.nan]})   # measured before the debiased form
    assert chosen(fig1, estimated(every, "debiased", older)) == ["nc1_cdnv", "gnc2_log_std"]
    asked = ("nc1_cdnv", "gnc2_log_std")                                     # --metrics without the debiased form
    assert chosen(fig1, estimated(asked, "debiased", has)) == ["nc1_cdnv", "gnc2_log_std"]
    assert ReportOptions().estimates == "debiased"
    with pytest.raises(UserError, match="estimates"):
        ReportOptions(estimates="both")
