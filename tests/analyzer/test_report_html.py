"""report.html in a real browser: headless Chromium (Debian's chromium and chromium-driver) driven by selenium, the
page opened from disk with the network off. Its points, hovers and tables are read back from the page and held to
metrics.csv, stats.csv and tokens.csv.

A screenshot of each page is kept under the test's tmp path and, where the environment variable
NCANALYZE_ARTIFACTS names a folder, copied there (``report_html_<name>.png``)."""
from __future__ import annotations

import html
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import headless_chromium, run_cli
from test_stats import study

from ncanalyze.analyzer.report import ReportOptions, write_report
from ncanalyze.analyzer.report.html import md_inline
from ncanalyze.analyzer.stats import METRICS

LOCAL = ("file:", "data:", "blob:", "about:")


# ---------------------------------------------------------------- the browser and the pages

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium with the browser's console and network logs, its network off for every page."""
    driver = headless_chromium(tmp_path_factory.mktemp("chromium-profile"))
    driver.set_network_conditions(offline=True, latency=0, throughput=0)
    yield driver
    driver.quit()


def open_page(driver, page: Path) -> None:
    """Open ``page`` from disk, wait until every figure is drawn; fail on a console error or any request that is
    not to the file itself (or data the page holds)."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("browser"), driver.get_log("performance")  # what came before: not this page's
    driver.get(page.as_uri())
    WebDriverWait(driver, 60).until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")
    assert driver.execute_script("return navigator.onLine") is False  # the network is off indeed
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    sent = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
    sent = [m["params"] for m in sent if m["method"] == "Network.requestWillBeSent"]
    ours = [m["request"]["url"] for m in sent if m.get("documentURL") == page.as_uri()]
    assert page.as_uri() in ours and all(u.startswith(LOCAL) for u in ours), ours  # the page asks for nothing
    remote = [m["request"]["url"] for m in sent if re.match(r"(https?|wss?|ftp):", m["request"]["url"])]
    assert not remote, remote  # nor does anything else in the browser meanwhile


def wait_ready(driver) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")


def pick(driver, select: str, value: str) -> None:
    """Choose ``value`` in a picker as a user does, and wait for the figures to be redrawn."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    element = Select(driver.find_element(By.ID, select))
    if element.first_selected_option.get_attribute("value") == value:
        return
    driver.execute_script("document.body.dataset.ready = ''")
    element.select_by_value(value)
    wait_ready(driver)


def points(driver, plot: str) -> list[dict]:
    """Every point of a plot as drawn: its trace's x axis, run, checkpoint, step, layer, x and y (gd.data; not the
    nulls that end one line in a trace of several)."""
    return driver.execute_script(
        "const gd = document.getElementById(arguments[0]); const out = [];"
        "gd.data.forEach((t, c) => t.x.forEach((x, i) => t.customdata[i] && out.push({axis: t.xaxis || 'x',"
        " run: t.customdata[i][0], checkpoint: t.customdata[i][1], step: t.customdata[i][2],"
        " layer: t.customdata[i][6], x: x, y: t.y[i], curve: c, point: i,"
        " visible: t.visible === undefined ? true : t.visible})));"
        "return out;", plot)


def drawn_markers(driver, plot: str) -> int:
    """The markers Plotly drew in a plot's SVG (not only its data)."""
    return driver.execute_script(f"return document.querySelectorAll('#{plot} .scatterlayer path.point').length")


def hover_lines(driver, plot: str, curve: int, point: int, subplot: str = "xy") -> list[str]:
    """Hover one point (Plotly.Fx.hover) and read back its hover label's lines."""
    return driver.execute_script(
        "Plotly.Fx.hover(arguments[0], [{curveNumber: arguments[1], pointNumber: arguments[2]}], arguments[3]);"
        "return Array.from(document.querySelectorAll('#' + arguments[0] + ' .hoverlayer .hovertext tspan.line'))"
        ".map(t => t.textContent);", plot, curve, point, subplot)


def screenshot(driver, tmp_path: Path, name: str) -> Path:
    """A full-page screenshot, kept under tmp_path and in $NCANALYZE_ARTIFACTS where set."""
    height = driver.execute_script("return document.body.scrollHeight")
    driver.set_window_size(1400, min(height, 8000))
    png = tmp_path / f"report_html_{name}.png"
    assert driver.save_screenshot(str(png)) and png.stat().st_size > 50_000, "blank screenshot"
    if os.environ.get("NCANALYZE_ARTIFACTS"):
        folder = Path(os.environ["NCANALYZE_ARTIFACTS"])
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(png, folder / png.name)
    driver.set_window_size(1400, 1000)
    return png


def read_csv(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, float_precision="round_trip")  # the values as written, bit for bit


def number(line: str) -> float:
    """The number after '=' in a hover line, before its error (' ± se'; d3 may write a minus as U+2212)."""
    return float(line.split("=", 1)[1].split(" ± ")[0].strip().replace("\u2212", "-"))


def finite(df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    return df[np.isfinite(df[list(cols)].astype(float)).all(axis=1)]


# ---------------------------------------------------------------- a real store's report

@pytest.fixture(scope="module")
def real(extracted_store, tmp_path_factory) -> Path:
    """``ncanalyze report`` over a copy of the session's extracted store, with the per-token table."""
    tmp = tmp_path_factory.mktemp("html-real")
    store = tmp / "study.zarr"
    shutil.copytree(extracted_store, store)  # report measures into the store: leave the session's one as it is
    run_cli("report", store, "--out", tmp / "report", "--tokens", "the,red,5", "--permutations", 200,
            "--estimates", "plugin")  # Figure 1 with the paper's plug-in nc1_cdnv, as these tests read it
    return tmp / "report"


@pytest.mark.slow
def test_the_page_is_one_file_that_opens_offline_and_draws_every_row(real, browser, tmp_path):
    page = real / "report.html"
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"<(script|link|img|iframe|source)\b[^>]*\b(src|href)\s*=", text, re.I)  # all inlined
    assert not re.search(r"""@import|url\(\s*['"]?https?:""", text.split("<script")[0])  # no remote style
    open_page(browser, page)
    metrics = read_csv(real / "metrics.csv")
    target = "val_loss"
    fig1 = ("nc1_cdnv", "gnc2_log_std", "unc3_cos_cv", "nc4_agreement")
    got = pd.DataFrame(points(browser, "fig1"))
    for axis, m in zip(("x", "x2", "x3", "x4"), fig1):  # a panel per Figure 1 metric, a point per row
        panel = got[got.axis == axis].set_index(["run", "checkpoint"]).sort_index()
        want = metrics.set_index(["run", "checkpoint"]).sort_index()
        assert len(panel) == len(metrics) >= 3 and panel.index.equals(want.index)
        assert panel.x.tolist() == want[m].tolist() and panel.y.tolist() == want[target].tolist()
    assert drawn_markers(browser, "fig1") == 4 * len(finite(metrics, target))
    for plot in ("scatter", "dynamics"):
        assert len(points(browser, plot)) == len(metrics) == drawn_markers(browser, plot)
    assert not browser.execute_script("return document.getElementById('depth')")  # one layer: no depth figure
    assert screenshot(browser, tmp_path, "real_store").exists()


@pytest.mark.slow
def test_the_opening_warning_is_a_list_and_the_page_fits_1400_pixels(real, browser):
    """Issue 51: the warning's bullets were paragraphs starting "- ", and the page needed a horizontal scrollbar at
    1,400 px (the statistics table)."""
    bullets = [line[2:] for line in (real / "report.md").read_text().split("\n\n## ")[0].splitlines()
               if line.startswith("- ")]
    assert len(bullets) >= 2  # report.md's opening warning: one bullet per Holm family that no p can pass
    open_page(browser, real / "report.html")
    assert browser.execute_script("return window.innerWidth") == 1400
    items = browser.execute_script("return Array.from(document.querySelectorAll('body > ul > li'), e => e.innerHTML)")
    assert items == [md_inline(b) for b in bullets]
    assert not browser.execute_script(
        "return Array.from(document.querySelectorAll('p'), e => e.textContent).filter(t => t.startsWith('- '))")
    wide, seen = browser.execute_script("return [document.documentElement.scrollWidth, "
                                        "document.documentElement.clientWidth]")
    assert wide <= seen, (wide, seen)  # no horizontal scrollbar


@pytest.mark.slow
def test_hovering_a_point_says_its_run_checkpoint_step_size_values_and_kept_classes(real, browser):
    open_page(browser, real / "report.html")
    metrics = read_csv(real / "metrics.csv").set_index(["run", "checkpoint"])
    for plot, subplot in (("scatter", "xy"), ("fig1", "x2y"), ("dynamics", "xy")):
        drawn = [p for p in points(browser, plot) if p["axis"] + "y" == subplot]
        p = drawn[len(drawn) // 2]
        row = metrics.loc[(p["run"], p["checkpoint"])]
        lines = hover_lines(browser, plot, p["curve"], p["point"], subplot)
        tag = row.tag if isinstance(row.tag, str) else "—"
        assert lines[:5] == [f"run {p['run']}", f"checkpoint {p['checkpoint']}", f"step {int(row.global_step):,}",
                             f"tag {tag}", f"parameters {int(row.n_params):,}"]
        assert lines[-1] == f"kept classes {int(row.n_kept):,}"
        metric = "gnc2_log_std" if plot == "fig1" else "nc1_cdnv"
        values = {line.split(" = ")[0]: number(line) for line in lines if " = " in line}
        assert set(values) == {metric, "val_loss"}
        assert values[metric] == pytest.approx(row[metric], rel=5e-6)  # 6 significant figures
        assert values["val_loss"] == pytest.approx(row.val_loss, rel=5e-6)


@pytest.mark.slow
def test_picking_a_metric_plots_that_column_of_metrics_csv(real, browser):
    open_page(browser, real / "report.html")
    metrics = read_csv(real / "metrics.csv").set_index(["run", "checkpoint"])
    before = {(p["run"], p["checkpoint"]): p["x"] for p in points(browser, "scatter")}
    assert before == metrics.nc1_cdnv.to_dict()
    for m in ("total_erank", "nc2_cos_mean", "nc4_agreement"):  # a geometry metric, a signed one, an NC one
        pick(browser, "metric", m)
        scatter = {(p["run"], p["checkpoint"]): (p["x"], p["y"]) for p in points(browser, "scatter")}
        assert scatter == {k: (v, metrics.val_loss[k]) for k, v in metrics[m].items()}
        dynamics = {(p["run"], p["checkpoint"]): p["y"] for p in points(browser, "dynamics")}
        assert dynamics == metrics[m].to_dict() != before
        title = browser.execute_script("return document.getElementById('scatter').layout.xaxis.title.text")
        assert title.startswith(m)
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


@pytest.mark.slow
def test_the_statistics_table_is_stats_csv_and_sorts(real, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, real / "report.html")
    stats = read_csv(real / "stats.csv")
    table = browser.find_element(By.ID, "table-stats")
    head = [th.text for th in table.find_elements(By.TAG_NAME, "th")]
    assert head[:4] == ["metric", "scale", "n", "R²"] and "p Holm" in head and "partial r" in head
    read = "return Array.from(document.querySelectorAll('#table-stats tbody tr')).map(tr => Array.from(tr.cells)" \
           ".map(td => [td.textContent, td.title]))"
    rows = browser.execute_script(read)
    assert len(rows) == len(stats) == 2 * len(METRICS)
    r2 = head.index("R²")
    for (metric, scale), cells in zip(zip(stats.metric, stats.scale), rows):
        assert [cells[0][0], cells[1][0]] == [metric, scale]
    shown = [float(c[r2][1]) if c[r2][1] else np.nan for c in rows]  # the exact value, in the cell's title
    np.testing.assert_array_equal(shown, stats.r2.to_numpy())
    header = table.find_elements(By.TAG_NAME, "th")[r2]
    header.click()
    ascending = [float(c[r2][1]) for c in browser.execute_script(read) if c[r2][1]]
    assert ascending == sorted(stats.r2.dropna()) and len(ascending) > 3
    header.click()
    assert [float(c[r2][1]) for c in browser.execute_script(read) if c[r2][1]] == ascending[::-1]
    assert rows[0][r2][0] == f"{stats.r2[0]:.3f}"  # report.md's display


@pytest.mark.slow
def test_tokens_and_caveats_are_report_mds(real, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, real / "report.html")
    tokens = read_csv(real / "tokens.csv")
    cells = browser.execute_script("return Array.from(document.querySelectorAll('#table-tokens-0 tbody tr'))"
                                   ".map(tr => Array.from(tr.cells).map(td => [td.textContent, td.title]))")
    head = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#table-tokens-0 th")]
    assert len(cells) == len(tokens) == 4 and head[:3] == ["token", "id", "count"]
    assert [c[2][0] for c in cells] == [str(v) for v in tokens["count"]]
    cdnv = head.index("mean CDNV")
    shown = [float(c[cdnv][1]) if c[cdnv][1] else np.nan for c in cells]  # the exact value in the title
    np.testing.assert_array_equal(shown, tokens["mean CDNV"].to_numpy())
    assert [c[cdnv][0] for c in cells] == [f"{v:.4g}" if np.isfinite(v) else "—" for v in tokens["mean CDNV"]]
    assert [c[0][0] for c in cells][:3] == [repr(t) for t in tokens.token[:3]]

    md = (real / "report.md").read_text()
    said = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#caveats li")]
    plain = lambda s: html.unescape(re.sub(r"`|\*\*", "", s)).strip()  # noqa: E731  (report.md writes & < > as entities)
    permutations = next(line for line in md.splitlines() if line.startswith("Permutations ("))
    assert plain(permutations) in said  # report.md's sentence: the unit permuted and the count
    assert "whole runs" in permutations or "rows (" in permutations
    notes = [line[2:] for line in md.split("Notes:")[1].split("##")[0].splitlines() if line.startswith("- ")]
    assert notes and all(f"Note: {plain(n)}" in said for n in notes)
    for line in md.splitlines():
        if line.startswith("**Note:**") or line.startswith("**Warning:**"):
            assert plain(line) in said


@pytest.mark.slow
def test_no_html_writes_no_page(tmp_path):
    df = study(n_runs=3, per_run=3, seed=2)
    files = write_report(df, tmp_path / "off", ReportOptions(formats="png",
                                                             metrics=["nc1_cdnv"], n_perm=0, html=False)).files
    assert "html" not in files and not (tmp_path / "off" / "report.html").exists()
    run_cli("report", files["metrics"], "--out", tmp_path / "cli", "--metrics", "nc1_cdnv", "--permutations", 0,
            "--no-html")
    assert (tmp_path / "cli" / "report.md").exists() and not (tmp_path / "cli" / "report.html").exists()
    on = write_report(df.drop(columns="run"), tmp_path / "on", ReportOptions(formats="png",
                                                                             metrics=["nc1_cdnv"], n_perm=0)).files
    assert on["html"] == tmp_path / "on" / "report.html" and on["html"].stat().st_size > 1_000_000  # plotly.js
    text = on["html"].read_text(encoding="utf-8")
    data = json.loads(text.split('<script id="ncanalyze-data" type="application/json">')[1].split("</script>")[0])
    assert data["rows"]["run"] == ["(all)"] * len(df)  # a table without runs: one line
    assert data["rows"]["nc1_cdnv"] == read_csv(on["metrics"]).nc1_cdnv.tolist()


# ---------------------------------------------------------------- layers and tags (a synthetic table)

@pytest.fixture(scope="module")
def layered(tmp_path_factory) -> Path:
    """Three runs of four checkpoints at layers 0-2 (CDNV infinite at layer 0), two tags."""
    last = study(n_runs=3, per_run=4, seed=5).assign(n_layers=2)
    rng = np.random.default_rng(0)
    shallow = [last.assign(layer=l, **{m: last[m] * rng.uniform(0.5, 2, len(last)) for m in METRICS}) for l in (0, 1)]
    table = pd.concat([*shallow, last.assign(layer=2)], ignore_index=True)
    table.loc[table.layer == 0, "nc1_cdnv"] = np.inf
    table["tag"] = np.where(table.run == "r2", "kjv", None)
    out = tmp_path_factory.mktemp("html-layers")
    write_report(table, out, ReportOptions(formats="png", n_perm=100, seed=1, estimates="plugin"))  # nc1_cdnv in Fig. 1
    return out


@pytest.mark.slow
def test_layers_and_tags_pick_their_rows_and_depth_draws_every_layer(layered, browser, tmp_path):
    from selenium.webdriver.common.by import By

    open_page(browser, layered / "report.html")
    tags = next(line for line in (layered / "report.md").read_text().splitlines() if line.startswith("The selection"))
    assert "never pooled" in tags and re.sub("`", "", tags) in browser.find_element(By.TAG_NAME, "body").text
    metrics = read_csv(layered / "metrics.csv")
    metrics["tag"] = metrics.tag.fillna("(untagged)")
    options = browser.execute_script("return Array.from(document.querySelectorAll('#layer option, #tag option'))"
                                     ".map(o => o.value)")
    assert options == ["last", "0", "1", "2", "(untagged)", "kjv"]
    for tag in ("kjv", "(untagged)"):
        pick(browser, "tag", tag)
        for layer in ("0", "1", "last"):
            pick(browser, "layer", layer)
            want = metrics[(metrics.tag == tag) & (metrics.layer == (2 if layer == "last" else int(layer)))]
            x = {(r.run, r.checkpoint): r.nc1_cdnv if np.isfinite(r.nc1_cdnv) else None for r in want.itertuples()}
            for plot in ("fig1", "scatter"):  # infinite at layer 0: a gap (null), not a number
                got = {(p["run"], p["checkpoint"]): p["x"] for p in points(browser, plot) if p["axis"] == "x"}
                assert got == x and len(got) == len(want) > 0
        depth = pd.DataFrame(points(browser, "depth"))  # a line per checkpoint: its layers in order, its values
        rows = metrics[metrics.tag == tag].sort_values(["run", "checkpoint", "layer"])
        assert len(depth) == len(rows) and depth.curve.nunique() == rows.run.nunique()  # a trace per run
        for (run, ckpt), line in depth.groupby(["run", "checkpoint"]):
            want = rows[(rows.run == run) & (rows.checkpoint == ckpt)]
            assert line.layer.astype(int).tolist() == [0, 1, 2] and line.point.diff().dropna().eq(1).all()
            gaps = want.nc1_cdnv.where(np.isfinite(want.nc1_cdnv))  # infinite at layer 0: a gap in the line
            np.testing.assert_array_equal(line.y.to_numpy(float), gaps.to_numpy())
    assert screenshot(browser, tmp_path, "layers_and_tags").exists()


@pytest.mark.slow
def test_a_legend_click_shows_one_run_alone(layered, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    open_page(browser, layered / "report.html")
    pick(browser, "tag", "(untagged)")
    entries = browser.find_elements(By.CSS_SELECTOR, "#dynamics .legend .traces")
    names = [e.text for e in entries]
    assert names == ["r0", "r1"]
    visible = lambda: {p["run"]: p["visible"] for p in points(browser, "dynamics")}  # noqa: E731
    assert visible() == {"r0": True, "r1": True}
    entries[1].click()  # Plotly waits out a double click's delay before it acts
    WebDriverWait(browser, 5).until(lambda _: visible() != {"r0": True, "r1": True})
    assert visible() == {"r0": "legendonly", "r1": True}
    browser.find_elements(By.CSS_SELECTOR, "#dynamics .legend .traces")[1].click()  # again: every run
    WebDriverWait(browser, 5).until(lambda _: visible() == {"r0": True, "r1": True})


def test_report_mds_markdown_becomes_html():
    assert md_inline("a `b<c>` **d** & `` x `y` z ``") == "a <code>b&lt;c&gt;</code> <strong>d</strong> &amp; " \
                                                         "<code>x `y` z</code>"


@pytest.mark.slow
def test_the_page_lists_the_skipped_checkpoints_as_report_md_does(tmp_path):
    """The checkpoints the store could not measure are named, with why, in report.html as in report.md (the page
    once read a table attribute nothing set, and listed none)."""
    skipped = {"run-z/checkpoint-9": "its class_sum has NaN: extract it again", "run-y/checkpoint-3": "no shards"}
    df = study(n_runs=3, per_run=3, seed=4)
    files = write_report(df, tmp_path, ReportOptions(formats="png",
                                                     metrics=["nc1_cdnv"], n_perm=0), skipped=skipped).files
    page, md = files["html"].read_text(encoding="utf-8"), files["report"].read_text(encoding="utf-8")
    for group, why in skipped.items():
        assert f"`{group}`: {why}" in md
        assert f"Skipped <code>{group}</code>: {why}" in page
    assert "Skipped <code>" not in write_report(df, tmp_path / "none", ReportOptions(formats="png",
                                                                                     metrics=["nc1_cdnv"], n_perm=0)
                                                ).files["html"].read_text(encoding="utf-8")


@pytest.mark.slow
def test_figure_1_says_what_the_png_says_and_tells_runs_and_direction_apart(layered, browser):
    """Each panel's line is the PNG's: R² on its scale (log x, raw beside), the permutation p with its unit and
    "2 runs × 4 ckpts" (not n = 8); each run its own symbol; each run's last step larger and ringed; the depth
    figure a trace per run with its symbol."""
    from ncanalyze.analyzer.report.figures import design_text, r2_text

    open_page(browser, layered / "report.html")
    pick(browser, "tag", "(untagged)")
    pick(browser, "layer", "last")
    stats = read_csv(layered / "stats.csv")
    stats = stats[stats.tag.isna()]
    metrics = read_csv(layered / "metrics.csv")
    last = metrics[(metrics.layer == 2) & metrics.tag.isna()]
    notes = browser.execute_script("return document.getElementById('fig1').layout.annotations.map(a => a.text)")
    for m, note in zip(["nc1_cdnv", "gnc2_log_std", "unc3_cos_cv", "nc4_agreement"], notes):
        st = stats[stats.metric == m].set_index("scale")
        log = bool((last[m] > 0).all())
        want = r2_text(st, log, "R²") + ", " + design_text(st.loc["log" if log else "raw"], last.run).replace("\n", ", ")
        assert note.endswith(want) and "2 runs × 4 ckpts" in note and "p_runs = " in note, (note, want)
        assert ("(log x)" in note) == log
    traces = browser.execute_script("return document.getElementById('fig1').data.filter(t => t.xaxis === 'x')"
                                    ".map(t => [t.name, t.marker.symbol, t.marker.size, t.line.dash])")
    assert [t[1] for t in traces] == ["circle", "square"] and all(t[3] == "solid" for t in traces)
    assert all(t[2] == [8, 8, 8, 13] for t in traces)  # the last step: larger (ringed)
    depth = browser.execute_script("return document.getElementById('depth').data.map(t => [t.name, t.marker.symbol])")
    assert depth == [["r0", "circle"], ["r1", "square"]]


def test_the_colour_bar_leaves_out_a_decade_too_near_an_end():
    from ncanalyze.analyzer.report.html import bar_ticks
    np.testing.assert_array_equal(bar_ticks(1.1e5, 9.5e6), [1.1e5, 1e6, 9.5e6])  # 1e7 is past the end
    np.testing.assert_array_equal(bar_ticks(9.5e4, 2e7), [9.5e4, 1e6, 1e7, 2e7])  # 1e5 is 2% from the bottom
    np.testing.assert_array_equal(bar_ticks(1e5, 1e7), [1e5, 1e6, 1e7])  # the ends are the decades
