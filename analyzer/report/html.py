"""report.html: the report as one self-contained page (plotly.js, the page's script and its style inlined; it opens
from disk with no server and no network). The figures are drawn in the browser from the rows of metrics.csv and
stats.csv embedded once as JSON (the same DataFrames the CSVs are written from, never recomputed), so the metric,
layer and tag pickers redraw without a copy of the data per choice; the text is report.md's own."""
from __future__ import annotations

import html
import json
import re
from importlib.resources import files
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import LogNorm, Normalize, to_hex

from ncanalyze.analyzer.report.depth import has_depth, last_layer
from ncanalyze.analyzer.report.document import LICENSE, header, tag_stats
from ncanalyze.analyzer.report.escape import drawn, plotly_text
from ncanalyze.analyzer.report.figures import (FIGURES, MARKERS, RUN_COLOURS, chosen, design_text, estimated, label,
                                               r2_text)
from ncanalyze.analyzer.report.report_options import ReportOptions, ReportResult
from ncanalyze.analyzer.report.support import thin_warning
from ncanalyze.analyzer.report.tables import fmt, fmt_p, notes, survivors
from ncanalyze.analyzer.report.ticks import count_text
from ncanalyze.analyzer.report.tokens import token_rows
from ncanalyze.analyzer.schema import GEOMETRY_METRICS, LAYER, NC_METRICS, SITE
from ncanalyze.analyzer.stats import permutation_text, split_tags

UNTAGGED = "(untagged)"
SYMBOLS = dict(zip(MARKERS, ("circle", "square", "diamond", "triangle-up", "triangle-down", "triangle-left",
                                   "triangle-right", "pentagon", "cross", "x", "hexagon", "star")))  # the PNG's
DASHES = ("solid", "dash", "dot", "dashdot")  # a run's line past the 12 markers
ROW_COLUMNS = ("run", "tag", "checkpoint", "global_step", "n_params", "n_kept", LAYER, SITE)  # hover and grouping
# the statistics table's columns: header, stats.csv's column, display (report.md's)
STATS_COLUMNS = (("n", "n", "{:d}"), ("R²", "r2", fmt), ("r", "r", fmt), ("rho", "rho", fmt),
                 ("p rho", "rho_p", fmt_p), ("p", "p_perm", fmt_p), ("p Holm", "p_holm", fmt_p),
                 ("partial r", "partial_r", fmt), ("p FL", "partial_p_perm", fmt_p),
                 ("p FL Holm", "partial_p_holm", fmt_p),
                 # the claims (issue 39): intervals over runs, the null's centre, the two questions, one run left out
                 ("r CI low", "r_ci_low", fmt), ("r CI high", "r_ci_high", fmt), ("null r", "r_null", fmt),
                 ("partial r CI low", "partial_r_ci_low", fmt), ("partial r CI high", "partial_r_ci_high", fmt),
                 ("r across runs, last step", "between_r_last", fmt), ("within r beyond the shared trend", "within_r", fmt),
                 ("p within", "within_p", fmt_p),
                 ("r without one run, min", "loo_r_min", fmt), ("max", "loo_r_max", fmt))


def md_inline(text: str) -> str:
    """One line of report.md's Markdown as HTML: escaped, with its inline code and bold.

    Parameters
    ----------
    text
        The Markdown (``code``, ``` `` code with ` `` ```, ``**bold**``).

    Returns
    -------
    str
    """
    out, parts = [], re.split(r"(``\s.*?\s``|`[^`]*`)", text)
    for part in parts:
        if part.startswith("`"):
            out.append(f"<code>{html.escape(part.strip('`').strip())}</code>")
        else:
            out.append(re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", html.escape(part, quote=False)))
    return "".join(out)


def md_blocks(lines: list[str]) -> list[tuple[str, list[str]]]:
    """report.md's lines as HTML blocks: ``("ul", items)`` for each run of bullets (``- ...``), ``("p", [text])`` for
    every other line that is not empty; each as :func:`md_inline`."""
    out: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("- "):
            if not out or out[-1][0] != "ul":
                out.append(("ul", []))
            out[-1][1].append(md_inline(line[2:]))
        elif line:
            out.append(("p", [md_inline(line)]))
    return out


def _values(s: pd.Series) -> list:
    """A column as JSON values: numbers where numeric (null where missing or infinite), else strings (null where
    missing)."""
    if pd.api.types.is_bool_dtype(s):
        return [bool(v) for v in s]
    if pd.api.types.is_numeric_dtype(s):
        v = pd.to_numeric(s, errors="coerce").astype(float).to_numpy()
        whole = pd.api.types.is_integer_dtype(s)
        return [None if not np.isfinite(x) else (int(x) if whole else float(x)) for x in v]
    return [None if pd.isna(v) else str(v) for v in s]


def _tag_keys(df: pd.DataFrame) -> list[str]:
    """Each row's tag as the picker names it (:func:`~ncanalyze.analyzer.stats.split_tags`' groups)."""
    keys = pd.Series(UNTAGGED, index=df.index)
    for tag, rows in split_tags(df):
        keys[rows.index] = UNTAGGED if tag is None else str(tag)
    return list(keys)


def _colours(df: pd.DataFrame, run: pd.Series) -> dict:
    """Colour by size (viridis on log n_params, as the PNG figures) when sizes differ, else by run; by step for
    the depth figure's lines."""
    runs = list(dict.fromkeys(run))
    size = pd.to_numeric(df.get("n_params", pd.Series(np.nan, index=df.index)), errors="coerce").groupby(run).first()
    positive = size[size > 0]
    viridis = colormaps["viridis"]
    out: dict = {"size_scale": None, "symbol": {r: SYMBOLS[MARKERS[i % len(MARKERS)]] for i, r in enumerate(runs)},
                 "dash": {r: DASHES[(i // len(MARKERS)) % len(DASHES)] for i, r in enumerate(runs)}}
    if positive.nunique() > 1:
        norm = LogNorm(positive.min(), positive.max())
        out["run"] = {r: to_hex(viridis(norm(size[r]))) if size[r] > 0 else "#808080" for r in runs}
        ticks = bar_ticks(positive.min(), positive.max())
        out["size_scale"] = {"cmin": float(np.log10(positive.min())), "cmax": float(np.log10(positive.max())),
                             "tickvals": [float(np.log10(t)) for t in ticks], "ticktext": [count_text(t) for t in ticks]}
    else:
        out["run"] = {r: to_hex(RUN_COLOURS[i % len(RUN_COLOURS)]) for i, r in enumerate(runs)}
        out["size_note"] = f"all {count_text(positive.iloc[0])} parameters" if len(positive) else None
    step = pd.to_numeric(df.get("global_step", pd.Series(np.nan, index=df.index)), errors="coerce")
    lo, hi = (step.min(), step.max()) if step.notna().any() else (0, 1)
    norm = Normalize(lo, hi if hi > lo else lo + 1)
    out["step"] = [to_hex(viridis(norm(s))) if np.isfinite(s) else "#808080" for s in step]
    out["step_range"] = [float(lo), float(hi if hi > lo else lo + 1)]
    return out


def bar_ticks(lo: float, hi: float, room: float = 0.12) -> np.ndarray:
    """The colour bar's ticks: both ends and the decades between, leaving out a decade nearer an end than
    ``room`` of the bar's log length (its label would overprint the end's).

    Parameters
    ----------
    lo, hi
        The bar's ends (positive).
    room
        The least gap between two labels, as a fraction of the bar.

    Returns
    -------
    numpy.ndarray
    """
    a, b = np.log10(lo), np.log10(hi)
    decades = np.arange(np.ceil(a), b + 1e-9)
    decades = decades[(decades - a > room * (b - a)) & (b - decades > room * (b - a))]
    return np.unique(np.r_[lo, 10.0 ** decades, hi])


def _metric_groups(metrics: list[str]) -> list[tuple[str, list[str]]]:
    """The picker's option groups: NC, geometry, others."""
    groups = [("NC", [m for m in metrics if m in NC_METRICS]),
              ("geometry", [m for m in metrics if m in GEOMETRY_METRICS]),
              ("other", [m for m in metrics if m not in NC_METRICS and m not in GEOMETRY_METRICS])]
    return [(g, ms) for g, ms in groups if ms]


def _r2(selected: pd.DataFrame, stats: pd.DataFrame, target: str) -> dict:
    """Each Figure 1 panel's line by tag, metric and scale, as the PNG's legend says it: stats.csv's R² with its
    scale (:func:`~ncanalyze.analyzer.report.figures.r2_text`), the permutation p with its unit and the runs and
    checkpoints it rests on (:func:`~ncanalyze.analyzer.report.figures.design_text`)."""
    out: dict = {}
    for tag, rows in split_tags(selected):
        st = tag_stats(stats, tag)
        y = pd.to_numeric(rows.get(target), errors="coerce")
        runs = rows["run"].astype(str) if "run" in rows else pd.Series("(all)", index=rows.index)
        for m, by_scale in st.groupby("metric", sort=False):
            by_scale = by_scale.set_index("scale")
            x = pd.to_numeric(rows[m], errors="coerce") if m in rows else pd.Series(np.nan, index=rows.index)
            for scale, s in by_scale.iterrows():
                ok = np.isfinite(x) & np.isfinite(y) & ((x > 0) if scale == "log" else True)
                text = r2_text(by_scale, scale == "log", "R²")
                if ok.any():
                    text += ", " + design_text(s, runs[ok]).replace("\n", ", ")
                out.setdefault(UNTAGGED if tag is None else str(tag), {}).setdefault(m, {})[scale] = {"text": text}
    return out


def payload(r: ReportResult, options: ReportOptions) -> dict:
    """What the page draws: metrics.csv's rows (every layer; the identity, support, target and metric columns),
    which are each checkpoint's last layer, the colours, the pickers' choices and stats.csv's R².

    Parameters
    ----------
    r
        The report's result (its ``metrics`` and ``stats`` are the CSVs' DataFrames).
    options
        What it was asked for.

    Returns
    -------
    dict
        JSON-ready.
    """
    df = r.metrics.reset_index(drop=True)
    metrics = [m for m in options.metrics if m in df.columns]
    cols = [c for c in ROW_COLUMNS if c in df.columns] + [c for c in [r.target, *metrics] if c in df.columns]
    cols += [f"{m}_se" for m in metrics if f"{m}_se" in df.columns]  # the hover's "value ± error"
    rows = {c: _values(df[c]) for c in dict.fromkeys(cols)}
    run = df["run"].astype(str) if "run" in df else pd.Series("(all)", index=df.index)  # a table without runs
    rows["run"] = list(run)
    for c in ("run", "checkpoint", "tag"):  # as plotly draws them: text, not its label markup
        if c in rows:
            rows["_shown_" + c] = [None if v is None else plotly_text(drawn(v)) for v in rows[c]]
    rows["_last"] = [bool(x) for x in df.index.isin(last_layer(df).index)]
    rows["_tag"] = _tag_keys(df)
    colours = _colours(df, run)
    rows["_step_colour"] = colours.pop("step")
    at = sorted(set(pd.to_numeric(df[LAYER], errors="coerce").dropna())) if has_depth(df) else []
    layers = [int(x) if float(x).is_integer() else float(x) for x in at]  # a sublayer site's B + 0.5 kept
    return {"rows": rows, "target": r.target, "labels": {c: label(c) for c in [r.target, *metrics]},
            "metrics": _metric_groups(metrics), "fig1": chosen(FIGURES["fig1_nc_vs_loss"][1], estimated(metrics, options.estimates, r.selected)),
            "tags": list(dict.fromkeys(rows["_tag"])), "layers": layers,
            "colours": colours, "r2": _r2(r.selected, r.stats, r.target)}


WITHIN = ("Within training (the table's \"within r beyond the shared trend\"): the two-way fixed-effects r, metric "
          "and target less each run's level and each step's value common to all runs, tested by permuting whole runs "
          "(\"p within\"); a trend every run follows carries no weight in it.")


def caveats(r: ReportResult, options: ReportOptions, skipped: dict[str, str] | None = None) -> list[str]:
    """report.md's own sentences on what the numbers rest on: per tag the permutations (unit and count), Holm's
    survivors and the notes; the thin-class warning; the depth figure's gaps; the token notes; the skipped."""
    out = [LICENSE, WITHIN]
    tags = split_tags(r.selected)
    for tag, _ in tags:
        stats = tag_stats(r.stats, tag)
        of = f"Tag {UNTAGGED if tag is None else f'`{tag}`'}: " if len(tags) > 1 else ""
        out += [of + permutation_text(stats, options.seed)]
        if survivors(stats):
            out += [of + "Multiple comparisons (Holm, family-wise error 0.05): " + "; ".join(survivors(stats)) + "."]
        out += [of + "Note: " + n for n in notes(stats)]
    warning = thin_warning(r.selected)
    out += [f"**Warning:** {warning}"] if warning else []
    out += [f"Across depth: {n}." for n in r.depth_notes]
    out += [f"**Note:** {n}." for n in r.notes]
    out += [f"Skipped `{g}`: {why}" for g, why in (skipped or {}).items()]
    return out


def _cell(value, how) -> str:
    """A sortable cell: the display text (report.md's formatting), the exact value to sort by."""
    if value is None or (isinstance(value, float) and not np.isfinite(value)) or value is pd.NA:
        return '<td data-v="">—</td>'
    text = how.format(int(value)) if isinstance(how, str) else how(float(value))
    return f'<td data-v="{float(value)!r}" title="{float(value)!r}">{html.escape(text)}</td>'


def stats_table(stats: pd.DataFrame) -> str:
    """stats.csv's rows as a sortable table: tag (with several), metric, scale, then R², r, rho and partial r with
    their permutation p-values and Holm's, as report.md shows them; the exact value in each cell's title.

    Parameters
    ----------
    stats
        The report's statistics (stats.csv).

    Returns
    -------
    str
        An HTML table.
    """
    several = len(split_tags(stats)) > 1
    head = (["tag"] if several else []) + ["metric", "scale"] + [h for h, _, _ in STATS_COLUMNS] + ["note"]
    body = []
    for _, s in stats.iterrows():
        cells = [f"<td>{html.escape(UNTAGGED if pd.isna(s.tag) else str(s.tag))}</td>"] if several else []
        cells += [f"<td>{html.escape(str(s.metric))}</td>", f"<td>{html.escape(str(s.scale))}</td>"]
        cells += [_cell(s.get(col), how) for _, col, how in STATS_COLUMNS]
        cells += [f"<td class='note'>{html.escape('' if pd.isna(s.note) else str(s.note))}</td>"]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return _table("stats", head, body)


def step_figure_html(r: ReportResult) -> str:
    """The per-step r figures (between models, step by step) as images inlined in the page, with their titles;
    '' where none was drawn.

    Parameters
    ----------
    r
        The report's result, its figures written.

    Returns
    -------
    str
        HTML.
    """
    import base64

    from ncanalyze.analyzer.report.figures import BY_STEP
    out = []
    for key, png in r.figures.items():
        if key.split("__")[0] != BY_STEP[0]:
            continue
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        title = html.escape(BY_STEP[1].format(target=r.target))
        out.append(f'<figure><img alt="{title}" src="data:image/png;base64,{data}" style="max-width:100%">'
                   f"<figcaption>{title} (filled: p &lt; 0.05 at the step; dashed: the pooled r; "
                   f"{html.escape(key)}.png)</figcaption></figure>")
    return "".join(out)


def token_tables(tokens: pd.DataFrame | None) -> list[tuple[str, str]]:
    """The per-token tables, one per checkpoint as report.md has them (tokens as Python literals, numbers to 4
    significant figures), sortable.

    Parameters
    ----------
    tokens
        The per-token table (tokens.csv), or None.

    Returns
    -------
    list of (checkpoint, HTML table)
    """
    if tokens is None:
        return []
    out = []
    for g, t in tokens.groupby("checkpoint", sort=False):
        rows = token_rows(t, repr)
        body = []
        for _, row in rows.iterrows():
            cells = []
            for c, v in row.items():
                if isinstance(v, float | np.floating):
                    cells.append(_cell(v, lambda x: f"{x:.4g}"))
                elif c == "count" or (c == "id" and v != ""):
                    cells.append(f'<td data-v="{int(v)}">{int(v)}</td>')
                else:
                    cells.append(f"<td>{html.escape(str(v))}</td>")
            body.append("<tr>" + "".join(cells) + "</tr>")
        out.append((str(g), _table(f"tokens-{len(out)}", list(rows.columns), body)))
    return out


def _table(name: str, head: list[str], body: list[str]) -> str:
    ths = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return (f'<table class="sortable" id="table-{name}"><thead><tr>{ths}</tr></thead><tbody>' + "\n".join(body)
            + "</tbody></table>")


def _json(value: dict) -> str:
    """JSON safe inside a <script> element: no ``<`` at all (``\\u003c``, as ``>`` and ``&``), so no ``</script>`` and
    no ``<!--`` (which makes the parser look for ``-->`` past the element's end and blanks the page) in any string."""
    text = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_html(r: ReportResult, options: ReportOptions, out: Path, skipped: dict[str, str] | None = None) -> Path:
    """Write report.html into ``out``: report.md's header and caveats, the pickers (metric; layer and tag where
    there are several), Figure 1's panels, the picked metric against the target and the step (a line per run), the
    depth figure (with layers), the statistics and the per-token tables; plotly.js inlined.

    Parameters
    ----------
    r
        The report's result, its CSVs written.
    options
        What it was asked for.
    out
        The folder.
    skipped
        Checkpoints that could not be measured: group to why.

    Returns
    -------
    Path
        report.html's path.
    """
    import jinja2
    from plotly.offline import get_plotlyjs, get_plotlyjs_version  # here: `ncanalyze --help` stays light

    here = files("ncanalyze.analyzer.report")
    env = jinja2.Environment(autoescape=True)
    page = env.from_string((here / "page.html.j2").read_text(encoding="utf-8"))
    md = header(r, options, split_tags(r.selected))
    data = payload(r, options)
    text = page.render(
        title=md[0].lstrip("# "), intro=md_blocks(md[1:]),
        caveats=[md_inline(c) for c in caveats(r, options, skipped)], data=_json(data),
        metrics=data["metrics"], labels=data["labels"], layers=data["layers"], tags=data["tags"],
        stats=step_figure_html(r) + stats_table(r.stats), tokens=token_tables(r.tokens), plotly_js=get_plotlyjs(),
        plotly_version=get_plotlyjs_version(), script=(here / "page.js").read_text(encoding="utf-8"),
        style=(here / "page.css").read_text(encoding="utf-8"))
    path = out / "report.html"
    path.write_text(text, encoding="utf-8")
    return path
