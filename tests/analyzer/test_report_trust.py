"""Issue 37, the report's documents as others open them: run names with markup in report.md (rendered by a
CommonMark renderer here), report.html's embedded data and plotly labels, formulas in the CSVs, the files a report
may overwrite or write through, and a step of 1e308 on the figures' axes."""
from __future__ import annotations

import csv
import json
import os
import re

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from markdown_it import MarkdownIt
from test_stats import study

from ncanalyze.analyzer.report import ReportOptions, write_report
from ncanalyze.analyzer.report.escape import md_name, spreadsheet_safe
from ncanalyze.analyzer.report.html import payload
from ncanalyze.analyzer.schema import SCALARS
from ncanalyze.core.errors import UserError

FAST = ReportOptions(metrics=["nc1_cdnv"], target="eval_loss", n_perm=0)
NO_HTML = ReportOptions(metrics=["nc1_cdnv"], target="eval_loss", n_perm=0, html=False)
HOSTILE = ["<!--<script>", "</script><script>document.title='pwned'</script>", "<img src=x onerror=alert(1)>",
           'r\n# Injected heading\n<img src=y onerror=alert(2)>', "tick`<img src=z onerror=alert(3)>`",
           '<a href="https:evil.example">HELP', "pipe|<b>bold</b>|", "bidi\u202eevil\x1b]0;title\x07"]


def hostile_study(names=HOSTILE, per_run: int = 3) -> pd.DataFrame:
    df = study(n_runs=len(names), per_run=per_run, seed=3)
    df["run"] = df["run"].map(dict(zip([f"r{i}" for i in range(len(names))], names)))
    return df


SKIPPED = {name + "/checkpoint-9": "cannot read <img src=s onerror=alert(5)>\n# Skipped heading" for name in HOSTILE}
TAG = "<img src=t onerror=alert(4)>"


@pytest.fixture(scope="module")
def hostile_report(tmp_path_factory):
    """One report (report.md, report.html) of runs, a tag and skipped checkpoints with hostile names."""
    df = hostile_study()
    df["tag"] = TAG
    return write_report(df, tmp_path_factory.mktemp("hostile") / "r", FAST, skipped=SKIPPED)


def data_block(page: str) -> str:
    return page.split('<script id="ncanalyze-data" type="application/json">', 1)[1].split("</script>", 1)[0]


# ---------------------------------------------------------------- class 12: report.html's embedded data

@pytest.mark.slow
def test_no_less_than_sign_in_the_embedded_data_so_no_name_blanks_the_page(hostile_report):
    page = hostile_report.files["html"].read_text(encoding="utf-8")
    block = data_block(page)
    assert "<" not in block and ">" not in block and "&" not in block  # <!-- in a script element eats the page
    data = json.loads(block)
    assert set(data["rows"]["run"]) == set(HOSTILE)  # the names themselves, intact
    assert page.count('<script id="ncanalyze-data"') == 1 and "draw().then" in page.split(block, 1)[1]


# ---------------------------------------------------------------- class 20: plotly draws names as text

@pytest.mark.slow
def test_plotly_gets_names_as_text_not_label_markup(hostile_report):
    r = hostile_report
    rows = payload(r, FAST)["rows"]
    shown = dict(zip(rows["run"], rows["_shown_run"]))
    assert shown['<a href="https:evil.example">HELP'] == '&lt;a href="https:evil.example"&gt;HELP'
    assert all("<" not in s and ">" not in s for s in shown.values())
    assert rows["_shown_checkpoint"] == rows["checkpoint"]  # plain names stay as they are
    js = (r.files["html"].parent / "report.html").read_text(encoding="utf-8")
    assert "name: R._shown_run[g[0]]" in js and "return [R._shown_run[i]" in js  # the legend and the hovers
    assert not re.search(r"name: run\b|return \[R\.run\[i\]", js)


# ---------------------------------------------------------------- class 18: report.md's names

def rendered(md: str) -> str:
    """report.md as CommonMark renders it (raw HTML passed through, as CommonMark and Jupyter do), GFM tables on."""
    return MarkdownIt("commonmark", {"html": True}).enable("table").render(md)


def injected(html: str) -> list[str]:
    """The elements of rendered HTML that are not the report's own: scripts, links, bold, images but its figures."""
    return [t for t in re.findall(r"<(?:img|script|a|b)\b[^>]*>", html) if not re.fullmatch(
        r'<img src="(fig\d_\w+|depth)\.png" alt="[^"<>]*" />', t)]


@pytest.mark.slow
def test_report_md_shows_names_as_text_when_rendered(hostile_report):
    md = hostile_report.files["report"].read_text(encoding="utf-8")
    html = rendered(md)
    assert not injected(html), injected(html)[:3]
    assert re.findall(r"<h1>", html) == ["<h1>"] and "<h1>Injected" not in html and "Skipped heading</h" not in html
    assert "\x1b" not in md and "\u202e" not in md  # terminal and bidi controls shown as escapes
    assert md_name("bidi\u202eevil\x1b]0;t\x07") == "`bidi\\u202eevil\\x1b]0;t\\x07`"
    for name in ("r\n# Injected heading\n<img src=y onerror=alert(2)>", "<!--<script>"):
        assert md_name(name + "/checkpoint-9") in md  # each skipped name is said, escaped


@pytest.mark.slow
def test_depth_tables_escape_names_in_cells(tmp_path):
    rows = []
    for run in ("<img src=x onerror=alert(1)>", "a|b\nc"):
        for s in (1, 2, 3):
            for layer in (0, 1, 2):
                rows.append(dict(run=run, checkpoint=f"checkpoint-{s}", global_step=s, n_layers=2, n_params=1e5,
                                 eval_loss=3 - 0.3 * s + 0.01 * layer, layer=layer, nc1_cdnv=1 + s + layer))
    write_report(pd.DataFrame(rows), tmp_path / "r", NO_HTML)
    md = (tmp_path / "r" / "report.md").read_text(encoding="utf-8")
    html = rendered(md)
    assert not injected(html) and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert re.search(r"<td[^>]*><code>a\|b\\nc</code></td>", html)  # one cell: the pipe does not split the row


# ---------------------------------------------------------------- class 19: formulas in the CSVs

FORMULAS = ["=1+1", '=HYPERLINK("https://evil.example","click")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)",
            "\t=1+1", "\r=1+1"]


def test_csv_cells_a_spreadsheet_reads_as_formulas_are_guarded_and_numbers_stay(tmp_path):
    from ncanalyze.analyzer.report.report_options import ReportResult
    from ncanalyze.analyzer.report.write import _write_tables

    df = hostile_study(FORMULAS)
    df["tag"] = "-0.5"  # a text cell that is a number: left as it is
    r = ReportResult(metrics=df, selected=df, target="eval_loss", stats=pd.DataFrame({"metric": ["=1+1"]}))
    _write_tables(r, tmp_path)  # as write_report writes them
    assert pd.read_csv(r.files["stats"]).metric.tolist() == ["'=1+1"]
    with open(r.files["metrics"], newline="", encoding="utf-8") as f:
        cells = list(csv.DictReader(f))
    assert {c["run"] for c in cells} == {"'" + n for n in FORMULAS}
    assert {c["tag"] for c in cells} == {"-0.5"}
    back = pd.read_csv(r.files["metrics"])
    for col in ("global_step", "n_params", "eval_loss", "nc1_cdnv", "nc2_cos_mean"):
        assert np.array_equal(back[col].to_numpy(float), r.metrics[col].to_numpy(float)), col  # numbers unchanged
    assert (back.nc2_cos_mean < 0).any()  # negative numbers among them, not prefixed
    mc = pd.DataFrame({"run": ["=1+1", "ok"], "checkpoint": ["@x", "checkpoint-3"], "value_2": [-1.5, 2.0]})
    safe = spreadsheet_safe(mc)
    assert safe.run.tolist() == ["'=1+1", "ok"] and safe.checkpoint.tolist() == ["'@x", "checkpoint-3"]
    assert safe.value_2.tolist() == [-1.5, 2.0] and mc.run.tolist() == ["=1+1", "ok"]  # numbers, and no side effect


def test_min_count_csv_is_guarded(tmp_path):
    from ncanalyze.analyzer.report.report_options import ReportResult
    from ncanalyze.analyzer.report.write import _write_tables

    r = ReportResult(metrics=pd.DataFrame({"run": ["=1+1"]}), selected=pd.DataFrame(), target="eval_loss",
                     stats=pd.DataFrame({"metric": ["nc1_cdnv"]}))
    r.min_count = pd.DataFrame({"run": ['=HYPERLINK("x")'], "checkpoint": ["c"], "value_2": [-3.0]})
    _write_tables(r, tmp_path)
    text = (tmp_path / "min_count.csv").read_text(encoding="utf-8")
    assert text.splitlines()[1] == "\"'=HYPERLINK(\"\"x\"\")\",c,-3.0"


# ---------------------------------------------------------------- class 10: every file a report writes

@pytest.mark.parametrize("theirs", ["fig1_nc_vs_loss.pdf", "fig4_dynamics.svg", "depth.png",
                                    "fig2_nc2_vs_gnc2__neo.png", "layers.csv"])
def test_a_users_own_figure_is_never_overwritten(tmp_path, theirs):
    out = tmp_path / "mine"
    out.mkdir()
    (out / theirs).write_bytes(b"my own")
    with pytest.raises(UserError, match=re.escape(theirs) + ".*no ncanalyze report wrote") as e:
        write_report(study(n_runs=3, per_run=3), out, FAST)
    assert "\n" not in str(e.value) and (out / theirs).read_bytes() == b"my own"
    assert not (out / "report.md").exists()


@pytest.mark.parametrize("link", ["stats.csv", "report.md", "fig1_nc_vs_loss.png", "report.html"])
def test_a_report_never_writes_through_a_link(tmp_path, link):
    out = tmp_path / "r"
    out.mkdir()
    (out / "report.md").write_text("# ncanalyze report: NC metrics against eval_loss\n")  # ours: it may be replaced
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious")
    (out / link).unlink(missing_ok=True)
    os.symlink(target, out / link)
    with pytest.raises(UserError, match=re.escape(repr(link)) + ".*never writes through a link"):
        write_report(study(n_runs=3, per_run=3), out, FAST)
    assert target.read_text() == "precious" and (out / link).is_symlink()
    (out / link).unlink()
    os.symlink(tmp_path / "dangling", out / link)
    with pytest.raises(UserError, match="never writes through a link"):
        write_report(study(n_runs=3, per_run=3), out, FAST)
    assert not (tmp_path / "dangling").exists()


# ---------------------------------------------------------------- class 23: measure --help's count of metrics

def test_measure_help_counts_the_metrics_it_writes():
    from ncanalyze.cli.main import main

    text = CliRunner().invoke(main, ["measure", "--help"]).output
    assert re.search(r"The (\d+) scalar metrics", text).group(1) == str(len(SCALARS)) == "27"  # 24, nc1_cdnv_debiased and the pooled pair


# ---------------------------------------------------------------- class 17: a step of 1e308 on the axes

@pytest.mark.parametrize("values", [[100, 1e308], [-1e308, 1.7e308], [1e-320, 1e308], [1.7e308], [-1.79e308]])
@pytest.mark.parametrize("log", [False, True])
def test_axis_limits_and_ticks_stay_finite_up_to_the_largest_float(values, log):
    from ncanalyze.analyzer.report.ticks import MIN_TICK_LABELS, limits, tick_labels, tick_values

    if log and min(values) <= 0:
        return
    lo, hi = limits(pd.Series(values), log)
    assert np.isfinite([lo, hi]).all() and lo <= min(values) and max(values) <= hi and (lo > 0 or not log)
    ticks, even = tick_values(lo, hi, log)
    assert len(ticks) >= MIN_TICK_LABELS and np.isfinite(ticks).all() and all(lo <= t <= hi for t in ticks)
    assert len(tick_labels(ticks, even)) == len(ticks)


@pytest.mark.slow
def test_one_group_at_step_1e308_does_not_crash_the_report(tmp_path):
    df = study(n_runs=3, per_run=3, seed=1)
    df["global_step"] = df.global_step.astype(float)
    df.loc[df.run == "r1", "global_step"] = [100, 200, 1e308]
    r = write_report(df, tmp_path / "r", FAST)
    assert {"fig1_nc_vs_loss", "fig4_dynamics", "html"} <= set(r.files) and r.files["fig4_dynamics"].stat().st_size
    assert pd.read_csv(r.files["metrics"]).global_step.max() == 1e308


# ---------------------------------------------------------------- class 3: a checkpoint without a step

def test_a_checkpoint_without_a_step_is_in_r_and_left_out_of_the_partial_r_with_a_note():
    import pingouin as pg

    from ncanalyze.analyzer.stats import correlations
    from ncanalyze.analyzer.table import metrics_table

    df = study(n_runs=8, per_run=1, seed=4)
    df["global_step"] = 100.0 * np.arange(1, 9)
    df.loc[[0, 1, 2], "global_step"] = [np.nan, np.inf, -5.0]  # none, non-finite, negative
    controls = ["log(n_params)", "log1p(global_step)"]
    s = correlations(df, ["nc1_cdnv"], "eval_loss", controls, n_perm=0, seed=0, runs="run").set_index("scale")
    r_all = np.corrcoef(df.nc1_cdnv, df.eval_loss)[0, 1]  # float64 brute force over all 8 checkpoints
    assert s.loc["raw", "n"] == 8 and s.loc["raw", "r"] == pytest.approx(r_all, abs=1e-12)
    kept = df.iloc[3:].assign(ln=np.log(df.n_params[3:]), ls=np.log1p(df.global_step[3:]))
    want = pg.partial_corr(kept, "nc1_cdnv", "eval_loss", covar=["ln", "ls"]).r.iloc[0]
    assert s.loc["raw", "partial_r"] == pytest.approx(want, abs=1e-10)  # over the 5 with a step
    assert "left_out" in s.loc["raw", "note_kinds"].split(",")
    assert "partial r leaves out 3 checkpoint(s) where log1p(global_step) has no value" in s.loc["raw", "note"]
    assert all(f"r{i}/checkpoint-100" in s.loc["raw", "note"] for i in range(3))
    groups = [{"run": f"r{i}", "checkpoint": "c", "global_step": v, "metrics": {}} for i, v in
              enumerate([None, float("inf"), -5, float("nan"), True, "7", 40])]
    assert metrics_table(groups).global_step.isna().tolist() == [True] * 6 + [False]  # only r6's 40 is a step
