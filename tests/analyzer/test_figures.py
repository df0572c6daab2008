"""The report's figures as a reader sees them: labelled, non-overlapping ticks at any data range (by rendered text
extents), an honest colour scale, runs told apart, the training-dynamics figure, and PNG + PDF + SVG files."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PathCollection
from ncanalyze.analyzer.report import (
    DYNAMICS,
    FIGURES,
    FORMATS,
    ReportOptions,
    dynamics_figure,
    scatter_figure,
    write_report,
)
from ncanalyze.analyzer.stats import correlations
from ncanalyze.core.errors import UserError
from test_stats import study

FIG1 = FIGURES["fig1_nc_vs_loss"][1]


def table(lo: float, hi: float, n_runs: int = 3, per_run: int = 4, sizes=(1e5, 8e5), seed: int = 0) -> pd.DataFrame:
    """Runs whose Fig. 1 metrics and target all span [lo, hi] (geometrically where positive)."""
    rng = np.random.default_rng(seed)
    n = n_runs * per_run
    if lo == hi:
        values = np.full(n, lo)
    elif lo > 0:
        values = np.geomspace(lo, hi, n)
    else:
        values = np.linspace(lo, hi, n)
    df = pd.DataFrame({"run": np.repeat([f"run{i}" for i in range(n_runs)], per_run),
                       "checkpoint": [f"checkpoint-{s}" for s in np.tile(np.arange(per_run) * 100, n_runs)],
                       "global_step": np.tile(np.arange(per_run) * 100, n_runs),
                       "n_params": np.repeat([sizes[i % len(sizes)] for i in range(n_runs)], per_run)})
    for m in FIG1:
        df[m] = rng.permutation(values)
    df["eval_loss"] = rng.permutation(values) if lo != hi else lo
    return df


def tick_texts(axis, renderer):
    """The visible, non-empty tick labels of an Axis and their rendered bounding boxes."""
    texts = [t for t in axis.get_ticklabels() if t.get_visible() and t.get_text().strip()]
    return texts, [t.get_window_extent(renderer) for t in texts]


def check_readable(fig, axes) -> None:
    """Every axis listed has at least 3 labelled ticks and no two of its tick labels overlap."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for axis in axes:
        texts, boxes = tick_texts(axis, renderer)
        assert len(texts) >= 3, [t.get_text() for t in axis.get_ticklabels()]
        for i, a in enumerate(boxes):
            for j in range(i + 1, len(boxes)):
                assert not a.overlaps(boxes[j]), (texts[i].get_text(), texts[j].get_text())


def panel_axes(fig, k: int):
    return fig.axes[:k]


RANGES = [(1e-4, 0.2), (0.95, 1.05), (3e-2, 4e-1), (0.5, 0.5), (-0.05, 0.03), (2e5, 3e7), (1e-7, 3e-7)]


@pytest.mark.slow
@pytest.mark.parametrize("lo, hi", RANGES)
def test_tick_labels_readable_at_any_range(lo, hi):
    df = table(lo, hi)
    stats = correlations(df, FIG1, n_perm=0)
    fig = scatter_figure(df, FIG1, "eval_loss", stats, "t")
    panels = panel_axes(fig, len(FIG1))
    axes = [ax.xaxis for ax in panels] + ([panels[0].yaxis] if lo != hi else [])
    axes += [cb.yaxis for cb in fig.axes[len(FIG1):]]  # the colour bar
    check_readable(fig, axes)
    plt.close(fig)
    fig = dynamics_figure(df, FIG1, "eval_loss", stats, "t")
    panels = panel_axes(fig, len(FIG1) + 1)
    check_readable(fig, [ax.xaxis for ax in panels] + [ax.yaxis for ax in panels[:len(FIG1)] if lo != hi])
    plt.close(fig)


def test_single_value_target_still_has_labelled_y_ticks():
    df = table(0.5, 0.5)
    fig = scatter_figure(df, FIG1, "eval_loss", correlations(df, FIG1, n_perm=0), "t")
    check_readable(fig, [fig.axes[0].yaxis])
    plt.close(fig)


@pytest.mark.slow
def test_no_colour_bar_when_all_sizes_are_equal_but_a_legend():
    df = table(0.1, 1, sizes=(3e5,))
    fig = scatter_figure(df, FIG1, "eval_loss", correlations(df, FIG1, n_perm=0), "t")
    assert len(fig.axes) == len(FIG1)  # panels only
    (legend,) = fig.legends
    assert "all 300K parameters" in legend.get_title().get_text()
    assert [t.get_text() for t in legend.get_texts()] == ["run0", "run1", "run2"]
    plt.close(fig)


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [(1e5, 8e5), (22e3, 94e4), (1e6, 1.3e6), (1e5, 3e5, 1e9)])
def test_colour_bar_labelled_across_its_range(sizes):
    df = table(0.1, 1, n_runs=len(sizes), sizes=sizes)
    fig = scatter_figure(df, FIG1, "eval_loss", correlations(df, FIG1, n_perm=0), "t")
    (cbar,) = fig.axes[len(FIG1):]
    check_readable(fig, [cbar.yaxis])
    fig.canvas.draw()
    ticks = [t for t, lab in zip(cbar.yaxis.get_majorticklocs(), cbar.yaxis.get_ticklabels()) if lab.get_text()]
    lo, hi = min(sizes), max(sizes)
    assert all(lo <= t <= hi for t in ticks)
    # labels across the range: the labelled ticks cover most of it on the log scale
    assert np.log(max(ticks) / min(ticks)) >= 0.5 * np.log(hi / lo)
    plt.close(fig)


@pytest.mark.slow
def test_runs_joined_in_step_order_and_told_apart():
    df = table(0.1, 1, n_runs=3, per_run=5).sample(frac=1, random_state=0)  # rows out of order
    fig = scatter_figure(df, FIG1, "eval_loss", correlations(df, FIG1, n_perm=0), "t")
    for ax, m in zip(fig.axes, FIG1):
        joins = [ln for ln in ax.get_lines() if ln.get_linestyle() == "-"]
        assert len(joins) == 3
        for ln in joins:
            run = df[np.isin(df[m], ln.get_xdata())].sort_values("global_step")
            assert list(ln.get_xdata()) == list(run[m]) and list(ln.get_ydata()) == list(run.eval_loss)
        markers = {tuple(map(tuple, c.get_paths()[0].vertices.round(3))) for c in ax.collections
                   if isinstance(c, PathCollection)}
        assert len(markers) == 3  # a marker shape per run
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["run0", "run1", "run2"]
    plt.close(fig)


@pytest.mark.slow
def test_many_runs_share_a_marker_and_have_no_legend():
    df = table(0.1, 1, n_runs=15, per_run=2, sizes=(1e5, 2e5, 4e5))
    fig = scatter_figure(df, FIG1, "eval_loss", correlations(df, FIG1, n_perm=0), "t")
    assert not fig.legends
    assert sum(ln.get_linestyle() == "-" for ln in fig.axes[0].get_lines()) == 15
    plt.close(fig)


@pytest.mark.slow
@pytest.mark.parametrize("with_step0", [True, False])
def test_dynamics_figure_panels_and_lines(with_step0):
    df = table(0.1, 1, n_runs=4, per_run=4, sizes=(1e5, 8e5))
    if not with_step0:
        df["global_step"] += 20
    fig = dynamics_figure(df, FIG1, "eval_loss", correlations(df, FIG1, n_perm=0), "t")
    panels, rest = fig.axes[:len(FIG1) + 1], fig.axes[len(FIG1) + 1:]
    assert len(rest) == 1  # the colour bar: two sizes
    assert [ax.get_title() for ax in panels][-1] == "validation loss"
    for ax, m in zip(panels, [*FIG1, "eval_loss"]):
        assert ax.get_xscale() == "log"
        lines = [ln for ln in ax.get_lines() if (ln.get_gid() or "").startswith("run:")]
        assert sorted(ln.get_gid() for ln in lines) == [f"run:run{i}" for i in range(4)]
        for ln in lines:
            run = df[df.run == ln.get_gid()[4:]].sort_values("global_step")
            assert list(ln.get_xdata()) == list(run.global_step + (1 if with_step0 else 0))
            assert list(ln.get_ydata()) == list(run[m])
        assert ("+ 1" in ax.get_xlabel()) == with_step0
    colours = {ln.get_gid(): ln.get_color() for ln in panels[0].get_lines()}
    assert colours["run:run0"] == colours["run:run2"] != colours["run:run1"]  # by size
    plt.close(fig)


@pytest.fixture(scope="module")
def every_format(tmp_path_factory) -> tuple[pd.DataFrame, Path, dict[str, Path]]:
    """A 4-run study's report in every format (the default), shared by the two tests of --formats."""
    df = study(n_runs=4, per_run=4, seed=1)
    out = tmp_path_factory.mktemp("formats")
    return df, out, write_report(df, out, ReportOptions(n_perm=0, n_boot=0)).files


@pytest.mark.slow
def test_every_figure_in_png_pdf_and_svg_with_embedded_fonts(every_format, tmp_path):
    df, first, files = every_format
    stems = [*FIGURES, DYNAMICS[0]]
    assert all(stem in files for stem in stems)
    for stem in stems:
        for ext in FORMATS:
            assert (first / f"{stem}.{ext}").stat().st_size > 1000
        assert (first / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pdf = (first / f"{stem}.pdf").read_bytes()
        assert pdf.startswith(b"%PDF") and b"/FontFile2" in pdf and b"/Type3" not in pdf  # TrueType (42), embedded
        assert ET.parse(first / f"{stem}.svg").getroot().tag.endswith("svg")
    assert "PDF and SVG" in files["report"].read_text()
    again = write_report(df, tmp_path / "again", ReportOptions(n_perm=0, n_boot=0)).files
    for stem in stems:  # no dates or random ids: a regenerated figure is the same file
        for ext in FORMATS:
            assert (first / f"{stem}.{ext}").read_bytes() == (again[stem].parent / f"{stem}.{ext}").read_bytes()
    assert "![Training dynamics" in files["report"].read_text()


@pytest.mark.slow
def test_formats_png_writes_the_pngs_only_and_removes_an_earlier_reports_pdf_and_svg(every_format, tmp_path):
    """--formats png: the same PNGs as the full set (byte for byte), no PDF or SVG, and those an earlier report left
    in --out removed (never stale beside a new PNG); report.md says which formats; png is required."""
    df, first, full = every_format
    stems = [*FIGURES, DYNAMICS[0]]
    shutil.copytree(first, tmp_path / "again")  # the earlier report, every format
    assert (tmp_path / "again" / f"{stems[0]}.pdf").is_file()
    pngs = {stem: full[stem].read_bytes() for stem in stems}
    files = write_report(df, tmp_path / "again", ReportOptions(n_perm=0, n_boot=0, formats="png")).files
    for stem in stems:
        assert files[stem].read_bytes() == pngs[stem]
        assert not (tmp_path / "again" / f"{stem}.pdf").exists() and not (tmp_path / "again" / f"{stem}.svg").exists()
    md = files["report"].read_text()
    assert "Each figure is a PNG only (`--formats png`)." in md and "each as `.png` (150 dpi)\n" in md
    svg = write_report(df, tmp_path / "svg", ReportOptions(n_perm=0, n_boot=0, formats="svg,png")).files
    assert (tmp_path / "svg" / f"{stems[0]}.svg").is_file() and not (tmp_path / "svg" / f"{stems[0]}.pdf").exists()
    assert "Each figure is also in SVG beside its PNG." in svg["report"].read_text()
    with pytest.raises(UserError, match=r"--formats\) must be png and any of pdf, svg"):
        ReportOptions(formats="pdf")
    with pytest.raises(UserError, match=r"--formats\) must be png and any of pdf, svg"):
        ReportOptions(formats="png,jpg")


@pytest.mark.slow
def test_no_dynamics_figure_without_steps_or_with_one_step(tmp_path):
    df = study(n_runs=3, per_run=3)
    files = write_report(df.drop(columns="global_step"), tmp_path / "a",
                         ReportOptions(formats="png", n_perm=0, controls=["log(n_params)"])).files
    assert DYNAMICS[0] not in files and not (tmp_path / "a" / f"{DYNAMICS[0]}.png").exists()
    files = write_report(df, tmp_path / "b", ReportOptions(formats="png", n_perm=0, where="global_step == 300")).files
    assert DYNAMICS[0] not in files and "Training dynamics" not in files["report"].read_text()


def test_fig2_does_not_repeat_the_gnc2_panel_of_fig1():
    shown = [m for _, ms in FIGURES.values() for m in ms]
    assert "gnc2_log_std" not in FIGURES["fig2_nc2_vs_gnc2"][1]
    assert shown.count("gnc2_log_std") == 1


def crowded_figure():
    """A narrow TickedFigure whose 8 x tick labels overlap (not yet handed to declutter)."""
    from matplotlib.ticker import FixedFormatter, FixedLocator
    from ncanalyze.analyzer.report.ticks import TickedFigure

    fig, ax = plt.subplots(figsize=(2.5, 2), FigureClass=TickedFigure)
    ax.set_xlim(0, 7)
    ax.xaxis.set_major_locator(FixedLocator(range(8)))
    ax.xaxis.set_major_formatter(FixedFormatter([f"0.000{i}5" for i in range(8)]))
    return fig, ax


def test_declutter_blanks_every_other_label_where_they_would_collide():
    from ncanalyze.analyzer.report.ticks import declutter, overlapping_labels

    fig, ax = crowded_figure()
    fig.canvas.draw()
    assert overlapping_labels(ax.xaxis, fig.canvas.get_renderer())
    declutter(fig, [ax.xaxis])
    check_readable(fig, [ax.xaxis])
    assert len(ax.get_xticks()) == 8  # the ticks stay
    plt.close(fig)



@pytest.mark.parametrize("first", ["png", "svg", "pdf"])
def test_the_first_draw_in_any_format_is_decluttered_and_later_ones_show_the_same_labels(first, tmp_path):
    """The check rides on the PNG's own draw (drawn again only where labels were thinned: one draw where none
    overlap); a vector file saved first is preceded by a raster draw aside; every later file shows those labels."""
    from ncanalyze.analyzer.report.ticks import TickedFigure, declutter

    draws = []
    fig, ax = crowded_figure()
    declutter(fig, [ax.xaxis])
    fig.canvas.mpl_connect("draw_event", lambda e: draws.append(type(e.renderer).__name__))
    fig.savefig(tmp_path / f"a.{first}", dpi=150 if first == "png" else "figure")
    shown = [t.get_text() for t in ax.xaxis.get_ticklabels()]
    assert 3 <= sum(map(bool, shown)) < 8, shown
    assert draws.count("RendererAgg") >= 2 and len(draws) == draws.count("RendererAgg") + (first != "png"), draws
    for ext in ("png", "svg", "pdf"):
        fig.savefig(tmp_path / f"b.{ext}")
        assert [t.get_text() for t in ax.xaxis.get_ticklabels()] == shown
    fig.set_dpi(150)  # the PNGs' resolution, where the labels were measured
    check_readable(fig, [ax.xaxis])
    plt.close(fig)

    draws.clear()
    fig, ax = plt.subplots(figsize=(6, 2), FigureClass=TickedFigure)  # wide: nothing overlaps
    ax.set_xlim(0, 7)
    declutter(fig, [ax.xaxis])
    fig.canvas.mpl_connect("draw_event", lambda e: draws.append(type(e.renderer).__name__))
    fig.savefig(tmp_path / "c.png")
    assert draws == ["RendererAgg"]  # the PNG's draw alone
    plt.close(fig)
    with pytest.raises(TypeError, match="TickedFigure"):
        declutter(plt.figure(), [])

def test_each_panel_says_the_scale_of_its_r2_and_rings_the_last_step():
    """A log-axis panel prints the log-scale R² saying "log x" with the raw R² beside it (both stats.csv's); a
    linear panel says "raw x"; each run's last step is ringed (a trajectory's direction)."""
    df = table(0.1, 1, n_runs=3, per_run=4)
    df["unc3_cos_cv"] = np.linspace(-0.5, 0.5, len(df))  # not positive: a linear axis
    st = correlations(df, FIG1, n_perm=0)
    fig = scatter_figure(df, FIG1, "eval_loss", st, "t")
    for ax, m in zip(fig.axes, FIG1):
        fit = [t.get_text() for t in ax.get_legend().get_texts() if t.get_text().startswith("fit")][0]
        fit = fit.replace("\n", ", ")
        r2 = st[st.metric == m].set_index("scale").r2
        if m == "unc3_cos_cv":
            assert ax.get_xscale() == "linear" and fit.startswith(f"fit: $R^2$ (raw x) = {r2['raw']:.2f},")
        else:
            assert ax.get_xscale() == "log"
            assert fit.startswith(f"fit: $R^2$ (log x) = {r2['log']:.2f}, raw x: {r2['raw']:.2f},")
        rings = [c for c in ax.collections if isinstance(c, PathCollection) and c.get_gid() == "last-steps"]
        last = df.sort_values("global_step").groupby("run").tail(1)
        assert sorted(rings[0].get_offsets()[:, 0]) == sorted(last[m])
    assert fig.legends[0].get_title().get_text() == "runs; ringed: each run's last step"
    plt.close(fig)


def test_depth_figure_tells_runs_apart_and_shades_only_wholly_undefined_layers():
    """Each run its own marker (a legend of runs; colour is the step); a layer is shaded "undefined" only where
    every row is, and says "undefined in 1 of 4" where one row of four is."""
    from matplotlib.patches import Polygon, Rectangle
    from ncanalyze.analyzer.report.depth import depth_figure
    rows = [{"run": f"r{r}", "checkpoint": f"checkpoint-{s}", "global_step": s, "layer": layer, "n_layers": 2,
             "nc1_cdnv": np.nan if layer == 0 else 1.0 + layer + s / 100}
            for r in range(2) for s in (100, 200) for layer in range(3)]
    df = pd.DataFrame(rows)
    df.loc[(df.run == "r1") & (df.global_step == 200) & (df.layer == 2), "nc1_cdnv"] = np.inf
    fig = depth_figure(df, ["nc1_cdnv"])
    ax = fig.axes[0]
    shaded = [p for p in ax.patches if isinstance(p, Polygon | Rectangle)]
    assert len(shaded) == 1  # layer 0 only
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == ["undefined", "undefined in 1 of 4"]
    markers = {ln.get_gid(): ln.get_marker() for ln in ax.get_lines()}
    assert markers == {"run:r0": "o", "run:r1": "s"}
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["r0", "r1"]
    plt.close(fig)


@pytest.mark.slow
def test_the_report_chooses_no_matplotlib_backend_at_import():
    """A user's notebook keeps its own backend: the report's modules draw on plain Figures, never through pyplot."""
    code = ("import sys, matplotlib; import ncanalyze.analyzer.report.write, ncanalyze.analyzer.report.figures; "
            "print('matplotlib.pyplot' in sys.modules, matplotlib.rcParams._get_backend_or_none())")
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["False", "None"]
