"""examples/claims.py: the worked study's findings said question by question, each verdict from its rule, and the
committed findings.md equal to what the committed results give (the README quotes it; test_examples checks that)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT, _load_example

claims = _load_example("claims")
RESULTS = ROOT / "examples" / "results"
NAN = np.nan


def stat(r=0.9, p_holm=1e-3, lo=0.5, hi=0.97, **kw) -> pd.Series:
    return pd.Series(dict(r=r, p_holm=p_holm, r_ci_low=lo, r_ci_high=hi) | kw)


@pytest.mark.parametrize("s, sign, said", [
    (stat(), +1, "**reproduced**"),
    (stat(r=-0.9, lo=-0.97, hi=-0.5), -1, "**reproduced**"),
    (stat(), -1, "**opposite sign** to the paper's"),
    (stat(p_holm=0.2), +1, "not reproduced (no association beyond chance after Holm)"),
    (stat(p_holm=0.05), +1, "not reproduced (no association beyond chance after Holm)"),  # Holm at alpha: not under
    (stat(p_holm=NAN), +1, "not reproduced (no association beyond chance after Holm)"),
    (stat(lo=-0.1), +1, "not reproduced (Holm p under 0.05, but the interval over runs holds 0)"),
    (stat(lo=NAN, hi=NAN), +1, "**reproduced**"),  # no interval drawn (too few runs): the permutation p decides
])
def test_between_model_verdicts_follow_their_rule(s, sign, said):
    assert claims.verdict(s, sign) == said


@pytest.mark.parametrize("lo, hi, sign, said", [
    (0.2, 0.6, +1, "the paper's direction"), (-0.6, -0.2, +1, "the opposite direction"),
    (-0.6, -0.2, -1, "the paper's direction"), (-0.1, 0.4, +1, "undecided (the interval holds 0)"),
    (NAN, NAN, +1, "no interval")])
def test_within_training_direction_is_read_from_its_interval(lo, hi, sign, said):
    assert claims.direction(pd.Series(dict(within_ci_low=lo, within_ci_high=hi)), sign) == said


def test_intervals_and_sentences_print_the_numbers_they_are_given():
    assert claims.ci(0.8123, 0.5, 0.93) == "+0.81 [+0.50, +0.93]"
    assert claims.ci(0.8123, 0.5, 0.93, "") == "0.81 [0.50, 0.93]"
    assert claims.ci(0.8123, NAN, NAN) == "+0.81" and claims.ci(NAN, 0, 1) == "—"
    assert claims.first_up("between models: R² 0.5, Holm 0.01") == "Between models: R² 0.5, Holm 0.01"
    frail = pd.Series(dict(loo_r_min=0.1, loo_r_max=0.9, robust=0.0, loo_flips="run-3 (r), run-3 (partial r)",
                           n_units=10))
    assert claims.fragility(frail) == ("; without any one run r +0.10 to +0.90, dropping `run-3` changes the Holm "
                                       "verdict of its r and partial r")
    many = ", ".join(f"run-{i} (r)" for i in range(5))
    assert claims.flipped(many, 10) == "dropping any one of 5 of its 10 runs changes a Holm verdict"
    spaced = "my run (r), my run (partial r)"  # a run name with a space: the report's own reading of loo_flips
    assert claims.flipped(spaced, 4) == "dropping `my run` changes the Holm verdict of its r and partial r"
    hostile = "a`b\n# head (r)"  # markup in a run name stays inline code, never a heading or a broken span
    assert claims.flipped(hostile, 4).startswith("dropping `a\\x60b\\n# head` changes")
    note = pd.Series(dict(note="5 rows dropped; the sign flips between models: r across runs +0.81 at step 120, "
                                "-0.88 at step 240 (the sign flips between step 120 and 240)"))
    assert claims.sign_note(note).startswith(" Note: the sign flips between models: r across runs +0.81 at step 120")
    assert "5 rows dropped" not in claims.sign_note(note)


def _frame(metric_r2: dict[str, tuple[float, float, float]]) -> pd.DataFrame:
    return pd.DataFrame([dict(metric=m, scale="raw", r2=r2, r2_ci_low=lo, r2_ci_high=hi)
                         for m, (r2, lo, hi) in metric_r2.items()])


def test_a_comparison_is_reproduced_only_where_the_intervals_part():
    apart = {"final": _frame({"a": (0.9, 0.8, 0.95), "b": (0.3, 0.1, 0.6)}),
             "all": _frame({"a": (0.7, 0.5, 0.8), "b": (0.6, 0.4, 0.7)})}
    said = claims.comparison(apart, "a", "b", "A above B")
    assert said == ("- *A above B* (`a` against `b`): **reproduced** between models (the intervals do not overlap); "
                    "final models: R² 0.90 [0.80, 0.95] against 0.30 [0.10, 0.60]; every checkpoint: R² 0.70 "
                    "[0.50, 0.80] against 0.60 [0.40, 0.70].")
    overlap = {"final": _frame({"a": (0.9, 0.5, 0.95), "b": (0.3, 0.1, 0.6)}), "all": apart["all"]}
    assert "higher between models, the intervals overlapping" in claims.comparison(overlap, "a", "b", "A above B")
    lower = {"final": _frame({"a": (0.2, 0.1, 0.6), "b": (0.3, 0.1, 0.6)}), "all": apart["all"]}
    assert "not reproduced between models" in claims.comparison(lower, "a", "b", "A above B")


def test_a_metric_missing_from_stats_is_refused_in_one_line():
    with pytest.raises(SystemExit, match="nc1_cdnv .log. is not in stats.csv"):
        claims.row(_frame({"a": (0.1, 0.0, 0.2)}), "nc1_cdnv", "log")


def test_the_committed_findings_are_what_the_committed_results_give():
    """examples/results/findings.md is claims.findings of the files beside it, so no figure in it is typed by hand."""
    assert (RESULTS / "findings.md").read_text() == claims.findings(RESULTS)


def test_the_committed_findings_quote_the_files_they_rest_on():
    """Independent of claims.py's formatting: the headline figures of the committed findings are stats.csv's."""
    text = (RESULTS / "findings.md").read_text()
    final = pd.read_csv(RESULTS / "final" / "stats.csv")
    every = pd.read_csv(RESULTS / "all" / "stats.csv")
    for metric, scale in (("nc1_cdnv", "log"), ("gnc2_log_std", "raw"), ("unc3_cos_cv", "raw"),
                          ("nc4_agreement", "raw")):
        f = final[(final.metric == metric) & (final.scale == scale)].iloc[0]
        e = every[(every.metric == metric) & (every.scale == scale)].iloc[0]
        line = next(x for x in text.splitlines() if f"(`{metric}`" in x)
        assert f"r {f.r:+.2f} [{f.r_ci_low:+.2f}, {f.r_ci_high:+.2f}], R² {f.r ** 2:.2f}" in line
        assert f"pooled ({len(pd.read_csv(RESULTS / 'all' / 'metrics.csv'))} checkpoints): r {e.r:+.2f}" in line
        if np.isfinite(e.within_r):
            assert f"mean within-run r {e.within_r:+.2f} [{e.within_ci_low:+.2f}, {e.within_ci_high:+.2f}]" in line
