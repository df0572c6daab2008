"""Tick craft: limits around the data, at least MIN_TICK_LABELS labelled ticks inside them on linear and log axes,
compact labels, and blanking every other label where rendered labels would overlap."""
from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import pandas as pd
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedFormatter, FixedLocator, LogLocator, MaxNLocator, NullFormatter, NullLocator

MIN_TICK_LABELS = 3
DPI = 150  # of the PNGs, where tick labels are measured
_MAX = sys.float_info.max  # axis limits stay finite: a step of 1e308 padded by 5% would be inf
_MAX_EXP = math.floor(math.log10(_MAX))


def _nice_linear(lo: float, hi: float, nbins: int = 5) -> list[float]:
    big = max(abs(lo), abs(hi))
    f = 10.0 ** math.floor(math.log10(big)) if big > 1e300 else 1.0  # matplotlib's locator overflows near 1e308
    ticks = MaxNLocator(nbins=nbins, steps=[1, 2, 2.5, 5, 10]).tick_values(lo / f, hi / f)
    eps = 1e-9 * (hi / f - lo / f or abs(hi / f) or 1)
    return [float(t) * f for t in ticks if lo / f - eps <= t <= hi / f + eps and math.isfinite(float(t) * f)]


def tick_values(lo: float, hi: float, log: bool) -> tuple[list[float], bool]:
    """At least MIN_TICK_LABELS ticks inside the axis limits.

    On a log axis decades (every k-th of many), else 1-2-5 of each decade, else evenly spaced values (a range under
    a factor of ~5); on a linear axis evenly spaced values.

    Parameters
    ----------
    lo, hi
        The axis limits.
    log
        Whether the axis is logarithmic.

    Returns
    -------
    ticks, even
        The tick values and whether they are evenly spaced.
    """
    if log and lo > 0:
        e0, e1 = math.floor(math.log10(lo)), min(math.ceil(math.log10(hi)), _MAX_EXP)  # 10.0 ** 309 raises
        inside = lambda vs: [v for v in vs if lo <= v <= hi]  # noqa: E731
        decades = inside([10.0 ** e for e in range(e0, e1 + 1)])
        if len(decades) > 7:
            decades = decades[::math.ceil(len(decades) / 6)]
        if len(decades) >= MIN_TICK_LABELS:
            return decades, False
        for subs in ((1, 2, 5), (1, 2, 3, 5)):
            ticks = inside([m * 10.0 ** e for e in range(e0, e1 + 1) for m in subs])
            if MIN_TICK_LABELS <= len(ticks) <= 7:
                return ticks, False
    for nbins in (5, 6, 8):
        ticks = _nice_linear(lo, hi, nbins)
        if len(ticks) >= MIN_TICK_LABELS:
            return ticks, True
    return ticks, True


def _sci(v: float) -> str:
    """A compact label: plain between 1e-3 and 1e4, else m×10^e in mathtext."""
    if v == 0 or 1e-3 <= abs(v) < 1e4:
        return f"{v:.4g}"
    e = math.floor(math.log10(abs(v)))
    m = float(f"{v / 10 ** e:.3g}")
    return f"$10^{{{e}}}$" if m == 1 else f"${m:g}{{\\times}}10^{{{e}}}$"


def tick_labels(ticks: Sequence[float], even: bool) -> list[str]:
    """Labels of ticks: evenly spaced ones with the decimals their step needs (scientific when all are tiny or huge),
    others compactly one by one.

    Parameters
    ----------
    ticks
        The tick values, ascending.
    even
        Whether they are evenly spaced (as :func:`tick_values` says).

    Returns
    -------
    list of str
        One label per tick (mathtext for powers of ten).
    """
    if not even or len(ticks) < 2:
        return [_sci(v) for v in ticks]
    step = min(b - a for a, b in zip(ticks, ticks[1:]))
    big = max(abs(v) for v in ticks)
    if big and not 1e-3 <= big < 1e5:
        e = math.floor(math.log10(big))
        digits = max(0, e - math.floor(math.log10(step)))
        return ["0" if v == 0 else f"${v / 10 ** e:.{digits}f}{{\\times}}10^{{{e}}}$" for v in ticks]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    while decimals < 10 and any(abs(float(f"{v:.{decimals}f}") - v) > 1e-6 * step for v in ticks):
        decimals += 1  # 0.975 is "0.975", not "0.98"
    return [f"{v:.{decimals}f}" for v in ticks]


def count_text(v: float) -> str:
    """A parameter count as 22K, 1.2M, 7B.

    Parameters
    ----------
    v
        The count.

    Returns
    -------
    str
    """
    for unit, f in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(v) >= f:
            return f"{v / f:.3g}{unit}"
    return f"{v:.3g}"


def set_ticks(axis: Axis, lo: float, hi: float, log: bool, fmt: Callable[[float], str] | None = None) -> None:
    """Set limits [lo, hi] and several labelled ticks inside them on a matplotlib Axis (x, y or a colour bar's).

    Parameters
    ----------
    axis
        The Axis to set.
    lo, hi
        Its limits.
    log
        Whether it is logarithmic (then minor ticks mark a range over a decade).
    fmt
        The label of a tick value; default :func:`tick_labels`.
    """
    ticks, even = tick_values(lo, hi, log)
    labels = [fmt(v) for v in ticks] if fmt else tick_labels(ticks, even)
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FixedFormatter(labels))
    axis.set_minor_formatter(NullFormatter())
    if log:
        axis.set_minor_locator(LogLocator(subs="auto") if math.log10(hi / lo) > 1 else NullLocator())
    else:
        axis.set_minor_locator(NullLocator())
    axis.set_view_interval(lo, hi, ignore=True)


def limits(values: pd.Series, log: bool) -> tuple[float, float]:
    """Axis limits around the values with a small margin; a single value gets a range of ±10% (or ±0.5 at 0).

    Parameters
    ----------
    values
        The finite values the axis shows (positive where ``log``).
    log
        Whether the axis is logarithmic (then the margin is a factor).

    Returns
    -------
    lo, hi
        The limits.
    """
    lo, hi = float(values.min()), float(values.max())
    if log:
        pad = max((hi / lo) ** 0.05, 1.02) if hi > lo else 1.1
        return (lo / pad if lo / pad > 0 else lo), min(hi * pad, _MAX)
    span = hi / 2 - lo / 2 if hi > lo else (abs(hi) * 0.2 or 1.0)  # halves: hi - lo may overflow
    pad = 0.1 * span if hi > lo else span / 2
    return max(lo - pad, -_MAX), min(hi + pad, _MAX)


def overlapping_labels(axis: Axis, renderer) -> bool:
    """Whether two visible, non-empty tick labels of the axis overlap (their rendered bounding boxes).

    Parameters
    ----------
    axis
        A drawn Axis.
    renderer
        The figure canvas's renderer.

    Returns
    -------
    bool
    """
    boxes = [t.get_window_extent(renderer) for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


class TickedFigure(Figure):
    """A Figure whose tick labels never overlap: on its first draw, the labels of the Axis objects given to
    :func:`declutter` are measured on a raster draw (the PNG's own, or one at :data:`DPI` made aside before a vector
    draw); where two overlap (long labels on a narrow panel), every other one is blanked, their ticks kept and at
    least MIN_TICK_LABELS labels left (else the font shrunk), and the figure drawn again, at most three times. Later
    draws (the PDF and SVG after the PNG) show the same labels. One draw, not two, where nothing overlaps."""

    ticked: tuple[Axis, ...] = ()

    def draw(self, renderer) -> None:
        ticked, self.ticked = self.ticked, ()
        if not ticked:
            return super().draw(renderer)
        if isinstance(renderer, RendererAgg):
            return self._draw_uncrowded(renderer, ticked)
        dpi = self.dpi  # a vector draw (72 dpi): its labels measured first on a raster at the PNGs' resolution
        self.set_dpi(DPI)
        try:
            self._draw_uncrowded(RendererAgg(int(self.bbox.width), int(self.bbox.height), DPI), ticked)
        finally:
            self.set_dpi(dpi)
        super().draw(renderer)

    def _draw_uncrowded(self, raster: RendererAgg, ticked: Sequence[Axis]) -> None:
        super().draw(raster)
        for _ in range(3):
            crowded = [a for a in ticked if overlapping_labels(a, raster)]
            if not crowded:
                return
            for axis in crowded:
                _thin(axis)
            raster.clear()
            super().draw(raster)


def declutter(fig: TickedFigure, axes: Sequence[Axis]) -> None:
    """Keep the tick labels of ``axes`` from overlapping in every draw of ``fig`` (:class:`TickedFigure`: made with
    ``plt.subplots(..., FigureClass=TickedFigure)``), by their rendered text extents, not by a guess at the font."""
    if not isinstance(fig, TickedFigure):
        raise TypeError("declutter needs a TickedFigure (plt.subplots(..., FigureClass=TickedFigure))")
    fig.ticked = tuple(axes)


def _thin(axis: Axis) -> None:
    """Blank every other visible label of ``axis``; where that would leave fewer than MIN_TICK_LABELS, shrink the
    labels' font instead."""
    labels = [t.get_text() for t in axis.get_ticklabels()]
    shown = [i for i, t in enumerate(labels) if t]
    if len(shown) // 2 + len(shown) % 2 < MIN_TICK_LABELS:
        for t in axis.get_ticklabels():
            t.set_fontsize(t.get_fontsize() * 0.8)
        return
    keep = set(shown[::2])
    axis.set_major_formatter(FixedFormatter([t if i in keep else "" for i, t in enumerate(labels)]))


def subplots(rows: int = 1, cols: int = 1, figure_class: type[Figure] = Figure, sharey: bool = False,
             squeeze: bool = True, **figure_kw):
    """pyplot's ``subplots`` without pyplot: no backend is chosen and no figure enters pyplot's registry; the figure
    draws on an Agg canvas of its own (saving picks each format's renderer)."""
    fig = figure_class(**figure_kw)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, sharey=sharey, squeeze=squeeze)
