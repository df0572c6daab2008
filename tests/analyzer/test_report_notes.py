"""Issue 49's report classes through the real CLI on a metrics CSV: statistics undefined for a metric are notes naming
it (no bare numpy warning), a metric missing for one run drops its rows with a ``left_out`` note, CSV cells that begin
with a formula after white space or an invisible character are guarded, a run named " " is shown, and the minor
options (``--formats "png, pdf"``, ``--checkpoint`` without ``--tokens``)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from conftest import run_cli
from test_stats import study

from ncanalyze.analyzer.report import ReportOptions
from ncanalyze.analyzer.report.escape import drawn, spreadsheet_safe
from ncanalyze.core.errors import UserError
from ncanalyze.core.names import name_problem, shown


def report(tmp_path, df: pd.DataFrame, *args) -> tuple[str, object]:
    """The CLI's report of ``df`` (written as a CSV) into tmp_path/out: (its output, the folder)."""
    df.to_csv(tmp_path / "metrics.csv", index=False)
    out = tmp_path / "out"
    r = run_cli("report", tmp_path / "metrics.csv", "--out", out, "--permutations", 0, "--bootstrap", 0, *args)
    return r.output, out


@pytest.mark.slow
def test_a_constant_metric_is_a_note_naming_it_never_a_bare_warning(tmp_path):
    """Issue 49: a constant metric printed numpy's 'invalid value encountered in divide' four times (the control
    table's r), naming no metric."""
    df = study(n_runs=5, per_run=3, seed=1).assign(nc1_cdnv=0.5)
    assert np.std(df.nc1_cdnv) == 0  # its r is 0/0
    output, out = report(tmp_path, df, "--estimates", "plugin")  # Figure 1's CDNV is then the plug-in's
    assert "RuntimeWarning" not in output and "invalid value" not in output, output
    md = (out / "report.md").read_text()
    assert "- `nc1_cdnv` is constant over these checkpoints, so its r is not defined (a dash)" in md


@pytest.mark.slow
def test_a_metric_missing_for_one_run_drops_its_rows_with_a_left_out_note(tmp_path):
    df = study(n_runs=5, per_run=3, seed=2)
    df.loc[df.run == "r1", "nc1_cdnv"] = np.nan
    _, out = report(tmp_path, df)
    stats = pd.read_csv(out / "stats.csv")
    row = stats[(stats.metric == "nc1_cdnv") & (stats.scale == "raw")].iloc[0]
    kept = df[df.run != "r1"]
    assert row.n == len(kept) == 12
    assert row.r == pytest.approx(np.corrcoef(kept.nc1_cdnv, kept.eval_loss)[0, 1], abs=1e-12)
    assert "left_out" in row.note_kinds.split(",")
    assert "3 checkpoint(s) without a finite nc1_cdnv left out: r1/checkpoint-100, r1/checkpoint-200" in row.note
    other = stats[(stats.metric == "nc2_norm_cv") & (stats.scale == "raw")].iloc[0]
    assert other.n == len(df) and "left_out" not in str(other.note_kinds)
    assert "without a finite nc1_cdnv left out" in (out / "report.md").read_text()


CELLS = [" =1+2", "\u200b=HYPERLINK(\"http://x\")", "\u00a0@SUM(A1)", "\ufeff+1+1", " \t-2+3", "\u2060=1"]


def test_a_formula_after_white_space_or_an_invisible_character_is_guarded():
    """Issue 49: a space or U+200B before ``=`` passed the guard (spreadsheets skip them and read a formula)."""
    df = pd.DataFrame({"run": CELLS + [" -0.5", "plain", "a=b"], "x": range(len(CELLS) + 3)})
    safe = spreadsheet_safe(df)
    assert list(safe.run[:len(CELLS)]) == ["'" + c for c in CELLS]
    assert list(safe.run[len(CELLS):]) == [" -0.5", "plain", "a=b"]  # a number, and text that is no formula


@pytest.mark.slow
def test_run_names_guarded_and_shown_in_the_reports_files(tmp_path):
    df = study(n_runs=4, per_run=3, seed=3)
    df["run"] = df.run.map({"r0": CELLS[0], "r1": CELLS[1], "r2": " ", "r3": "r3"})
    _, out = report(tmp_path, df)
    cells = pd.read_csv(out / "metrics.csv", keep_default_na=False).run
    assert set(cells) == {"'" + CELLS[0], "'" + CELLS[1], " ", "r3"}
    page = (out / "report.html").read_text()
    assert '"_shown_run":[' in page and '"\\\\x20"' in page  # the run named " " as plotly draws it: visible
    assert drawn(" ") == "\\x20" and drawn("r 3") == "r 3"  # and in the figures' legends
    assert shown(" ") == "\\x20" and shown("\u3000") == "\\u3000" and shown("a b") == "a b"
    assert name_problem(" ") == "is only white space (invisible wherever it is shown)"
    assert name_problem(" ", controls=False) is None  # a folder already in a store is read, and shown


def test_formats_with_spaces_and_checkpoint_without_tokens(tmp_path):
    assert ReportOptions(formats="png, pdf").formats == ("png", "pdf")
    with pytest.raises(UserError, match=r"^--checkpoint .* without --tokens there is none: pass --tokens too"):
        ReportOptions(checkpoints=["run/checkpoint-20"])
    r = run_cli("report", tmp_path / "m.csv", "--checkpoint", "run/checkpoint-20", "--out", tmp_path / "o", ok=False)
    assert "pass --tokens too, or leave --checkpoint out" in r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_formats_with_a_space_on_the_command_line(tmp_path):
    _, out = report(tmp_path, study(n_runs=4, per_run=2, seed=4), "--formats", "png, pdf")
    assert (out / "fig1_nc_vs_loss.pdf").is_file() and not (out / "fig1_nc_vs_loss.svg").exists()
