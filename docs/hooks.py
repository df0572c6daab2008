"""mkdocs hooks: the pages' generated parts, written from the code and the committed results at build time.

A page holds a marker where a generated part goes, and :func:`on_page_markdown` replaces it, so nothing the code
already says is written twice:

- ``<!-- ncanalyze:metric-cards -->``: one card per metric record (analyzer/metric_records.py) with its formula
  (the function's docstring) and, where the worked study measured it, its min_count and token-budget movement;
- ``<!-- ncanalyze:cli -->``: every command's ``--help``, as click renders it;
- ``<!-- ncanalyze:map -->``: every module of the house with the first line of its docstring;
- ``<!-- ncanalyze:file PATH -->``: a file of the repository, verbatim (the worked study's generated blocks,
  benchmarks/EARLIER.md);
- ``<!-- ncanalyze:results -->``: every run a benchmark recorded (``benchmarks/record.py SCRIPT``: benchmarks/results/*.md).

The worked study's figures are copied into the site by :func:`on_files`.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pandas as pd
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- ncanalyze:([a-z-]+)(?: ([^ ]+))? -->")
FIGURES = ("examples/results/all/fig1_nc_vs_loss.png", "examples/results/depth/depth.png")
WIDTH = 110  # the reference's --help width (a terminal's COLUMNS sets the command line's)
PACKAGES = {"core": "ncanalyze.core", "analyzer": "ncanalyze.analyzer", "store": "ncanalyze.store", "cli": "ncanalyze.cli"}
STUDY = ROOT / "examples" / "results" / "all"
MIN_COUNT = ("reads the kept classes (count >= min_count); not in the worked study's min_count table (the report "
             "gives Figure 1's metrics at other min_counts in min_count.csv).")


def lay_out_package() -> None:
    """Lays the package out as it installs (``ncanalyze/analyzer`` for ``analyzer/`` ...: setup.cfg's package_dir) in
    ``build/api/``, links to the sources, where mkdocstrings reads it (``paths`` in mkdocs.yml). Run when mkdocs loads
    this module, before the plugins resolve their paths (a path that does not exist yet is dropped)."""
    pkg = ROOT / "build" / "api" / "ncanalyze"
    pkg.mkdir(parents=True, exist_ok=True)
    for name, src in {**{p.name: p for p in (ROOT / "ncanalyze").glob("*.py")},
                      **{sub: ROOT / sub for sub in PACKAGES}}.items():
        try:
            (pkg / name).symlink_to(src)
        except FileExistsError:  # laid out by an earlier build (or a concurrent one: two test workers)
            pass


def on_files(files: Files, config) -> Files:
    """Adds the worked study's figures under ``results/`` (they stay where the recipe writes them)."""
    for rel in FIGURES:
        if (ROOT / rel).exists():
            files.append(File.generated(config, "results/" + rel.replace("/", "_").removeprefix("examples_results_"),
                                        abs_src_path=str(ROOT / rel)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Each marker replaced by what it names."""
    def part(m: re.Match) -> str:
        kind, arg = m.group(1), m.group(2)
        if kind == "file":
            return (ROOT / arg).read_text()
        return {"metric-cards": metric_cards, "cli": cli_reference, "map": house_map, "results": recorded_runs}[kind]()
    return MARKER.sub(part, markdown)


def recorded_runs() -> str:
    """Every run a benchmark recorded (benchmarks/results/*.md, written by ``benchmarks/record.py SCRIPT``), in
    name order; a line saying there is none yet otherwise."""
    runs = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    return "\n".join(p.read_text() for p in runs) if runs else "No benchmark has recorded a run yet (`python benchmarks/record.py SCRIPT`)."


# ---------------------------------------------------------------- metrics


def _study_changes() -> tuple[dict[str, str], dict[str, str]]:
    """Per metric, the worked study's largest relative change over min_count 2-20 and between its last two token
    budgets (median over runs), as sentences; empty where the study has no such file."""
    mc, bud = {}, {}
    if (STUDY / "min_count.csv").exists():
        df = pd.read_csv(STUDY / "min_count.csv")
        for m, g in df.groupby("metric"):
            mc[m] = (f"In the worked study (`all/min_count.csv`, the latest checkpoint of {len(g)} runs), min_count "
                     f"2 to 20 moved it by up to {100 * g.rel_change.abs().max():.0f}%.")
    if (STUDY / "budget.csv").exists():
        df = pd.read_csv(STUDY / "budget.csv").sort_values("tokens")
        for m in [c for c in df.columns if f"{c}_se" in df.columns]:
            last = df.groupby("run").tail(2).groupby("run")[m].agg(lambda s: s.iloc[-1] / s.iloc[0] - 1)
            lo, hi = df.tokens.unique()[-2:]
            bud[m] = (f"In the worked study (`all/budget.csv`), from {lo:,} to {hi:,} train tokens it moved by "
                      f"{100 * last.median():+.1f}% (median over {len(last)} runs).")
    return mc, bud


def metric_card(r, mc: dict[str, str], bud: dict[str, str]) -> str:
    """One metric's card: formula, direction, scale, budget, min_count, published code, what it reads."""
    module, name = r.function.rsplit(".", 1)
    doc = inspect.getdoc(getattr(importlib.import_module(module), name)) or ""
    scale = r.scale or "scale-free: multiplying every feature by a constant leaves it unchanged"
    budget = " ".join(x for x in (r.budget, bud.get(r.name)) if x) or \
        "not measured across budgets; compare checkpoints at one `--max-train-tokens`"
    lines = [f"### `{r.name}`", "", f"*{r.title}* ({'NC' if r.family == 'nc' else 'geometry'} family; "
             f"`{r.function}`)", "", doc, "",
             f"- **Which way is more collapse:** {r.direction_text}.",
             f"- **Scale:** {scale}.",
             f"- **Token budget:** {budget}",
             f"- **min_count:** {mc.get(r.name, MIN_COUNT)}",
             f"- **Published code:** {r.published}.",
             f"- **Reads:** {', '.join(f'`{v}`' for v in r.needs)}."]
    if r.reading:
        lines.append(f"- **Reading it:** {r.reading}.")
    return "\n".join(lines) + "\n"


def metric_cards() -> str:
    """Every record's card, the NC family first (SPEC order)."""
    from ncanalyze.analyzer.metric_records import RECORDS

    mc, bud = _study_changes()
    return "\n".join(metric_card(r, mc, bud) for r in RECORDS)


# ---------------------------------------------------------------- commands


def cli_reference() -> str:
    """Every command's ``--help``, rendered by click at a fixed width, one section per command."""
    from ncanalyze.cli.main import main

    width = dict(terminal_width=WIDTH, max_content_width=WIDTH)
    root = main.context_class(main, info_name="ncanalyze", **width)
    parts = ["## `ncanalyze`", "", "```text", main.get_help(root), "```", ""]
    for name, cmd in main.commands.items():
        ctx = cmd.context_class(cmd, info_name=name, parent=root, **width)
        parts += [f"## `ncanalyze {name}`", "", "```text", cmd.get_help(ctx), "```", ""]
    return "\n".join(parts)


# ---------------------------------------------------------------- the map of the house


def house_map() -> str:
    """One table row per module of core/, analyzer/, store/ and cli/: its import name and its docstring's first line."""
    rows = ["| module | what it owns |", "|---|---|"]
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            name = ".".join([package, *[p for p in rel.parts if p != "__init__"]])
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            first = " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")
            rows.append(f"| `{name}` | {first} |")
    return "\n".join(rows) + "\n"


lay_out_package()
