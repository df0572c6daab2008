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


@pytest.mark.parametrize("r, p, sign, said", [
    (0.4, 0.01, +1, "the paper's direction (p 0.0100)"), (-0.4, 0.01, +1, "the opposite direction (p 0.0100)"),
    (-0.4, 0.003, -1, "the paper's direction (p 0.00300)"), (0.4, 0.07, +1, "undecided (p 0.0700)"),
    (0.4, 0.05, +1, "undecided (p 0.0500)"), (NAN, NAN, +1, "not defined here")])
def test_within_training_direction_is_read_from_its_whole_run_permutation_test(r, p, sign, said):
    assert claims.direction(pd.Series(dict(within_r=r, within_p=p)), sign) == said


@pytest.mark.parametrize("holm, said", [(0.01, "it survives the design"),
                                         (0.16, "it does not survive the design (size explains it as well)")])
def test_a_verdict_carries_the_partial_r_given_the_design(holm, said):
    s = stat(controls="log(n_layers), log(hidden_size)", partial_r=0.53, partial_r_ci_low=-0.2,
             partial_r_ci_high=0.85, partial_p_perm=0.16, partial_p_holm=holm)
    assert claims.design(s) == ("given the design (log(n_layers), log(hidden_size)) partial r +0.53 [-0.20, +0.85], "
                                f"p 0.160, Holm {claims.p_text(holm)}: {said}")
    assert claims.design(stat(controls=NAN, partial_r=0.9)).startswith("no design factor varies here")


def test_intervals_and_sentences_print_the_numbers_they_are_given():
    assert claims.ci(0.8123, 0.5, 0.93) == "+0.81 [+0.50, +0.93]"
    assert claims.ci(0.8123, 0.5, 0.93, "") == "0.81 [0.50, 0.93]"
    assert claims.ci(0.8123, NAN, NAN) == "+0.81" and claims.ci(NAN, 0, 1) == "—"
    assert claims.first_up("between models: R² 0.5, Holm 0.01") == "Between models: R² 0.5, Holm 0.01"
    frail = pd.Series(dict(loo_r_min=0.1, loo_r_max=0.9, loo_p_min=0.001, loo_p_max=0.3, robust=0.0,
                           loo_flips="run-3 (r), run-3 (partial r)", n_units=10))
    assert claims.fragility(frail) == ("; without any one run r +0.10 to +0.90 (p 0.00100 to 0.300), leaving out "
                                       "`run-3` moves its r and partial r by more than half the interval")
    many = ", ".join(f"run-{i} (r)" for i in range(5))
    assert claims.flipped(many, 10) == "leaving out any one of 5 of its 10 runs moves r by more than half its interval"
    spaced = "my run (r), my run (partial r)"  # a run name with a space: the report's own reading of loo_flips
    assert claims.flipped(spaced, 4) == "leaving out `my run` moves its r and partial r by more than half the interval"
    hostile = "a`b\n# head (r)"  # markup in a run name stays inline code, never a heading or a broken span
    assert claims.flipped(hostile, 4).startswith("leaving out `a\\x60b\\n# head` moves")
    note = pd.Series(dict(note="5 rows dropped; the sign flips between models: r across runs +0.81 at step 120, "
                                "-0.88 at step 240 (the sign flips between step 120 and 240)"))
    assert claims.sign_note(note).startswith(" Note: the sign flips between models: r across runs +0.81 at step 120")
    assert "5 rows dropped" not in claims.sign_note(note)


def _frame(metric_r2: dict[str, tuple[float, float, float]], d: tuple | None = None) -> pd.DataFrame:
    rows = [dict(metric=m, scale="raw", r2=r2, r2_ci_low=lo, r2_ci_high=hi, vs_metric="", d_r2=NAN, d_r2_ci_low=NAN,
                 d_r2_ci_high=NAN, d_r2_p_le0=NAN) for m, (r2, lo, hi) in metric_r2.items()]
    if d is not None:
        rows[0] |= dict(vs_metric="b", d_r2=d[0], d_r2_ci_low=d[1], d_r2_ci_high=d[2], d_r2_p_le0=d[3])
    return pd.DataFrame(rows)


def test_a_comparison_is_reproduced_only_where_the_paired_difference_lies_above_0():
    every = _frame({"a": (0.7, 0.5, 0.8), "b": (0.6, 0.4, 0.7)}, (0.1, 0.02, 0.2, 0.01))
    above = {"final": _frame({"a": (0.9, 0.5, 0.95), "b": (0.3, 0.0, 0.6)}, (0.6, 0.1, 0.9, 0.017)), "all": every}
    said = claims.comparison(above, "a", "b", "A above B")
    assert said == ("- *A above B* (`a` against `b`): **reproduced** between models (ΔR²'s interval lies above 0); "
                    "final models: R² 0.90 [0.50, 0.95] against 0.30 [0.00, 0.60], ΔR² +0.60 [+0.10, +0.90], P(ΔR² "
                    "<= 0) 0.017; every checkpoint: R² 0.70 [0.50, 0.80] against 0.60 [0.40, 0.70], ΔR² +0.10 [+0.02, "
                    "+0.20], P(ΔR² <= 0) 0.010.")
    holds = {"final": _frame({"a": (0.9, 0.8, 0.95), "b": (0.3, 0.1, 0.6)}, (0.6, -0.1, 0.9, 0.2)), "all": every}
    assert "not reproduced between models (ΔR²'s interval holds 0)" in claims.comparison(holds, "a", "b", "A")
    below = {"final": _frame({"a": (0.2, 0.1, 0.6), "b": (0.3, 0.1, 0.6)}, (-0.1, -0.2, -0.01, 0.99)), "all": every}
    assert "the opposite between models" in claims.comparison(below, "a", "b", "A above B")
    untested = {"final": _frame({"a": (0.2, 0.1, 0.6), "b": (0.3, 0.1, 0.6)}), "all": every}
    assert "not tested between models" in claims.comparison(untested, "a", "b", "A above B")


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
        assert (f"r {f.r:+.2f} [{f.r_ci_low:+.2f}, {f.r_ci_high:+.2f}], R² {f.r ** 2:.2f} [{f.r2_ci_low:.2f}, "
                f"{f.r2_ci_high:.2f}]") in line
        assert f"partial r {f.partial_r:+.2f}" in line
        assert ("it survives the design" if f.partial_p_holm < 0.05 else "it does not survive the design") in line
        assert f"pooled ({len(pd.read_csv(RESULTS / 'all' / 'metrics.csv'))} checkpoints): r {e.r:+.2f}" in line
        if np.isfinite(e.within_r):
            assert (f"beyond what all runs share at a step: r {e.within_r:+.2f} [{e.within_ci_low:+.2f}, "
                    f"{e.within_ci_high:+.2f}] (null {e.within_r_null:+.2f})") in line
