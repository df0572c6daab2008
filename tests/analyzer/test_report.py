"""The report's files: CSV columns, Markdown tables, LaTeX syntax, PNG panels; the per-token table; the CLI."""
from __future__ import annotations

import itertools
import logging
import logging.handlers
import re
import shutil
import subprocess
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from conftest import run_cli
from ncanalyze.analyzer.report import (
    AVERAGE_TOKEN,
    DYNAMICS,
    FIGURES,
    ID_COLUMNS,
    ReportOptions,
    TokenNote,
    resolve_token,
    token_table,
    write_report,
)
from ncanalyze.analyzer.report.tables import fmt_p
from ncanalyze.analyzer.stats import METRICS
from ncanalyze.core.errors import UserError
from ncanalyze.store.io import ensure_group, read_group
from PIL import Image
from test_stats import study

STATS_COLUMNS = {"metric", "family", "scale", "n", "r", "r2", "p_perm", "p_param_iid", "partial_r", "partial_p_perm",
                 "partial_p_param_iid", "partial_ci_low_iid", "partial_ci_high_iid", "controls", "n_perm", "exact",
                 "note", "note_kinds", "perm_unit", "p_floor",
                 "p_holm", "partial_p_holm", "rho", "rho_p", "rho_p_holm", "perm_scheme", "n_units", "n_distinct_perms",
                 "tag",
                 # issues 39, 47: the null's centre, the intervals over runs, the two questions, leave one run out,
                 # the paired comparisons of R²
                 "r_null", "rho_null", "partial_r_null", "ci_method", "ci_unit", "ci_units", "r_ci_low", "r_ci_high",
                 "r2_ci_low", "r2_ci_high", "rho_ci_low", "rho_ci_high", "partial_r_ci_low", "partial_r_ci_high",
                 "within_r", "within_p", "within_r_null", "within_ci_low", "within_ci_high", "within_n_runs",
                 "within_why", "claims_why", "between_steps", "between_r_min", "between_r_max", "between_step_last",
                 "between_r_last", "between_p_last", "loo_r_min", "loo_r_max", "loo_p_min", "loo_p_max", "robust",
                 "loo_flips", "vs_metric", "d_r2", "d_r2_ci_low", "d_r2_ci_high", "d_r2_p_le0", "d_r2_mc_error",
                 "d_r2_dropped", "d_r2_n_boot"}
SUMMARY_HEADER = ["metric", "n", "rho", "p rho", "R²", "r", "p", "p Holm", "partial r", "p FL", "p FL Holm", "R² (log)", "r (log)",
                  "p (log)", "p Holm (log)", "partial r (log)", "p FL (log)", "p FL Holm (log)"]


# ---------------------------------------------------------------- parsers the tests check the files with

def markdown_tables(text: str) -> list[list[list[str]]]:
    """Every pipe table: a header row, a |:---| separator, body rows all with the header's number of cells."""
    tables, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
        elif block:
            rows = [[c.strip() for c in re.split(r"(?<!\\)\|", ln.strip()[1:-1])] for ln in block]
            assert len(rows) >= 3, block
            assert all(re.fullmatch(r":?-+:?", c) for c in rows[1]), block[1]
            assert {len(r) for r in rows} == {len(rows[0])}, block
            tables.append([rows[0]] + rows[2:])
            block = []
    return tables


def check_latex(tex: str) -> int:
    """Balanced, properly nested environments; every tabular row has as many cells as its column spec.
    Returns the number of tabulars."""
    stack, n_tab = [], 0
    for m in re.finditer(r"\\(begin|end)\{(\w+)\}(\{([^}]*)\})?", tex):
        if m.group(1) == "begin":
            stack.append(m.group(2))
            if m.group(2) == "tabular":
                n_tab += 1
                ncol = len(re.findall(r"[lcrp]", m.group(4)))
                body = tex[m.end():tex.index(r"\end{tabular}", m.end())]
                rows = [r for r in body.split("\\\\") if r.strip() and not re.fullmatch(r"\s*\\\w+rule\s*", r)]
                for row in rows:
                    row = re.sub(r"\\(top|mid|bottom)rule", "", row)
                    if row.strip():
                        assert len(re.findall(r"(?<!\\)&", row)) + 1 == ncol, row
        else:
            assert stack and stack.pop() == m.group(2), f"unbalanced \\end{{{m.group(2)}}}"
    assert not stack, f"unclosed environments {stack}"
    assert tex.count("{") - tex.count(r"\{") == tex.count("}") - tex.count(r"\}")
    return n_tab


def compile_latex(tex_file: Path, tmp: Path) -> None:
    """With pdflatex on the machine (apt texlive-latex-base + -recommended), the tables must compile."""
    if shutil.which("pdflatex") is None:
        return
    doc = tmp / "doc.tex"
    doc.write_text("\\documentclass{article}\n\\usepackage[T1]{fontenc}\n\\usepackage{booktabs}\n\\usepackage{graphicx}\n"
                   f"\\begin{{document}}\n\\input{{{tex_file.resolve()}}}\n\\end{{document}}\n")
    res = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name], cwd=tmp,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:]


def spine_runs(png: Path, least: int = int(150 * 2.3)) -> int:
    """Long dark vertical lines (at least ``least`` pixels, 2.3 in at 150 dpi): two per panel (left and right
    spines), on whichever row of the grid it sits, and two for a colour bar's outline."""
    dark = np.asarray(Image.open(png).convert("L"), float) < 80
    found = []  # (x, top) of each long run; a line a pixel or two wide is one line
    for x in range(dark.shape[1]):
        edges = np.diff(np.r_[0, dark[:, x].astype(int), 0])
        for top, end in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):
            if end - top >= least and not any(abs(x - fx) <= 3 and abs(top - ft) <= 5 for fx, ft in found):
                found.append((x, top))
    return len(found)


def check_png(png: Path, panels: int, colour_bar: bool = True) -> None:
    """Panels of 3.9 in and at least 2.3 in tall, wrapped onto rows within 2000 px; the title not clipped."""
    from ncanalyze.analyzer.report.figures import MAX_WIDTH, grid

    img = Image.open(png)
    w, h = img.size
    rows, cols = grid(panels, 3.9, 0.15, colour_bar)
    assert 150 * 3.9 * cols <= w <= 150 * MAX_WIDTH == 2000 and h >= 150 * 2.65 * rows
    gray = np.asarray(img.convert("L"), float)
    assert gray.std() > 20 and (gray < 250).mean() > 0.05, "blank figure"
    assert spine_runs(png) == 2 * panels + 2 * colour_bar
    for ext in ("pdf", "svg"):
        assert png.with_suffix(f".{ext}").stat().st_size > 1000


# ---------------------------------------------------------------- the report on a synthetic study

@pytest.fixture(scope="module")
def synthetic_report(tmp_path_factory):
    df = study(n_runs=5, per_run=6, seed=11)
    out = tmp_path_factory.mktemp("report")
    return df, write_report(df, out, ReportOptions(n_perm=500, seed=3)).files


@pytest.mark.slow
def test_csv_files(synthetic_report):
    df, files = synthetic_report
    metrics = pd.read_csv(files["metrics"])
    present = [c for c in ID_COLUMNS if c in df.columns]
    assert list(metrics.columns[:len(present)]) == present
    assert set(METRICS) <= set(metrics.columns) and len(metrics) == len(df)
    stats = pd.read_csv(files["stats"])
    assert set(stats.columns) == STATS_COLUMNS
    assert len(stats) == 2 * len(METRICS)
    tested = stats[stats.n_perm > 0]  # 5 runs of 6 checkpoints permuted whole: all 5! = 120 < 500, exact
    assert len(tested) > len(METRICS) and (tested.n_perm == 120).all() and tested.exact.all()
    assert (tested.perm_scheme == "whole runs").all() and (tested.n_units == 5).all()


@pytest.mark.slow
def test_markdown_tables_and_links(synthetic_report):
    df, files = synthetic_report
    text = files["report"].read_text()
    table = markdown_tables(text)[0]  # the summary; then the two questions, the intervals, the controls
    assert table[0] == SUMMARY_HEADER
    assert [row[0] for row in table[1:]] == list(METRICS)
    stats = pd.read_csv(files["stats"]).set_index(["metric", "scale"])
    r2 = {row[0]: row[table[0].index("R²")] for row in table[1:]}
    assert r2["unc3_cos_cv"] == f"{stats.loc[('unc3_cos_cv', 'raw'), 'r2']:.3f}"
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert sorted(links) == sorted(f"{k}.png" for k in [*FIGURES, DYNAMICS[0], "fig5_r_by_step"])
    assert all((files["report"].parent / name).is_file() for name in links)
    assert "no log scale: nc2_cos_mean (log)" in text


@pytest.mark.slow
def test_latex_tables(synthetic_report, tmp_path):
    _, files = synthetic_report
    tex = files["tex"].read_text()
    assert check_latex(tex) == 3  # the raw and the log10 scale, the intervals over runs
    assert "nc1\\_cdnv" in tex and "$R^2$" in tex
    compile_latex(files["tex"], tmp_path)
    fit = r"\resizebox{\ifdim\width>\linewidth\linewidth\else\width\fi}{!}{%" + "\n\\begin{tabular}"
    specs = re.findall(r"\\begin\{tabular\}\{(\w+)\}", tex)
    assert [len(c) for c in specs] == [11, 9, 10] and tex.count(fit) == 3  # shrunk to the line where wider
    assert tex.count("\\end{tabular}}") == 3
    captions = re.findall(r"\\caption\{(.*)\}", tex)
    # 5 runs of 6 checkpoints: whole runs permuted, 5! = 120, all of them (500 asked for)
    assert all("whole runs permuted (5 runs; all enumerated, exact), so p $\\geq$ 2/120 = 0.0167" in c
               for c in captions), captions
    body = tex[tex.index("\\midrule"):tex.index("\\end{tabular}")]
    rule = body.index("\\midrule\nwithin\\_erank &")  # the Holm families apart: NC above, geometry below
    assert "nc4\\_agreement &" in body[:rule] and "lidar &" in body[rule:]


@pytest.mark.slow
def test_figures_have_their_panels(synthetic_report):
    _, files = synthetic_report
    for stem, (_, metrics) in FIGURES.items():
        check_png(files[stem], len(metrics))


def test_unknown_metric_and_bad_query_are_user_errors(tmp_path):
    df = study(n_runs=2, per_run=3)
    with pytest.raises(UserError, match="unknown metric"):
        write_report(df, tmp_path, ReportOptions(formats="png", metrics=["nc9"], n_perm=0))
    with pytest.raises(UserError, match="syntax error"):
        write_report(df, tmp_path, ReportOptions(formats="png", where="n_params >", n_perm=0))
    with pytest.raises(UserError, match="no checkpoint matches"):
        write_report(df, tmp_path, ReportOptions(formats="png", where="n_params < 0", n_perm=0))


@pytest.mark.slow
def test_cli_on_a_metrics_csv_with_where_and_target(tmp_path):
    df = study(n_runs=4, per_run=5, seed=2)
    csv = tmp_path / "m.csv"
    df.to_csv(csv, index=False)
    run_cli("report", csv, "--out", tmp_path / "r", "--where", "run != 'r0'", "--metrics", "nc1_cdnv,nc4_agreement",
            "--target", "eval_loss", "--permutations", 300, "--seed", 4, "--formats", "png,pdf,svg")
    metrics = pd.read_csv(tmp_path / "r" / "metrics.csv")
    assert len(metrics) == 15 and "r0" not in set(metrics.run)
    stats = pd.read_csv(tmp_path / "r" / "stats.csv")
    assert list(stats.metric.unique()) == ["nc1_cdnv", "nc4_agreement"] and (stats.n == 15).all()
    check_png(tmp_path / "r" / "fig1_nc_vs_loss.png", 2)  # only the chosen metrics of Figure 1
    assert not (tmp_path / "r" / "fig2_nc2_vs_gnc2.png").exists()
    few = run_cli("report", csv, "--out", tmp_path / "few", "--where", "run == 'r1' and global_step <= 200")
    assert "only 2 checkpoint(s) selected; correlations need at least 3" in few.output
    assert "Only 2 checkpoint(s)" in (tmp_path / "few" / "report.md").read_text()
    err = run_cli("report", csv, "--out", tmp_path / "bad", "--where", "nope == 1", ok=False)
    assert "unknown name 'nope'" in err.output and len(err.output.strip().splitlines()) == 1


# ---------------------------------------------------------------- per-token table on a hand-made store

TOKENS = np.array(["<eos>", " Anna", "Anna", " Tim", "the", " Bob", "Bob ", "x", " |", "&%$_\\{"], dtype=object)


def write_store(path: Path, tokenizer: str | None = None, vocab: int | None = None) -> dict[str, xr.Dataset]:
    """Two checkpoints whose names sort against their steps, with the per-class arrays ``measure`` writes; decoded
    tokens TOKENS, or with ``vocab`` no token coordinate (then tokens are resolved by the tokenizer)."""
    rng = np.random.default_rng(0)
    groups = {}
    with_tokens = vocab is None
    for name, step in (("checkpoint-100", 100), ("checkpoint-20", 20)):
        v = vocab or len(TOKENS)
        count = rng.integers(1, 50, v)
        count[7] = 0  # a class outside the kept set
        kept = count > 0
        per_class = {k: np.where(kept, rng.uniform(0.1, 2, v), np.nan) for k in
                     ("class_norm", "class_cdnv", "class_interference", "class_duality", "class_nc4")}
        ds = xr.Dataset({"count": ("vocab", count), "variance": ("vocab", np.where(kept, rng.uniform(0, 1, v), np.nan)),
                         **{k: ("vocab", a) for k, a in per_class.items()}},
                        coords={"vocab": np.arange(v), **({"token": ("vocab", TOKENS)} if with_tokens else {})},
                        attrs={"run": "runA", "checkpoint": name, "global_step": step,
                               **({"tokenizer": tokenizer} if tokenizer else {})})
        ensure_group(path)  # a store of this version's format
        ds.to_zarr(path, group=f"runA/{name}", mode="w", consolidated=False, zarr_format=3)
        groups[f"runA/{name}"] = ds
    return groups


def test_token_table_values_and_average_row(tmp_path):
    store = tmp_path / "s.zarr"
    groups = write_store(store)
    with pytest.warns(UserWarning, match="'Tim' read as ' Tim' \\(id 3\\), the word after a space"):
        table = token_table(partial(read_group, store), ["runA/checkpoint-20"], [" Anna", "Tim", "7", "2", "the"])
    ds = groups["runA/checkpoint-20"]
    # exact string, a bare word as its space-prefixed token, an id, the line-initial 'Anna' by id, an exact string
    assert list(table.id[:5]) == [1, 3, 7, 2, 4]
    assert list(table.token) == [" Anna", " Tim", "x", "Anna", "the", AVERAGE_TOKEN]
    for j, i in enumerate([1, 3, 7, 2, 4]):
        row = table.iloc[j]
        assert row["count"] == ds["count"][i] and row["variance"] == pytest.approx(float(ds.variance[i]), nan_ok=True)
        for var, col in (("class_norm", "norm"), ("class_cdnv", "mean CDNV"), ("class_interference",
                         "mean interference"), ("class_duality", "duality cos"), ("class_nc4", "NC4 rate")):
            assert row[col] == pytest.approx(float(ds[var][i]), nan_ok=True)
    avg = table.iloc[-1]
    kept = ds["count"].values > 0
    assert avg["mean CDNV"] == pytest.approx(ds.class_cdnv.values[kept].mean())
    assert avg["mean interference"] == pytest.approx(ds.class_interference.values[kept].mean())
    assert avg["count"] == round(ds["count"].values[kept].mean())  # counts are integers: the mean, rounded
    assert str(table["count"].dtype) == "Int64"
    assert avg["variance"] == pytest.approx(ds.variance.values[kept].mean())
    assert np.isnan(table.iloc[2]["mean CDNV"])  # token 7 is not kept


@pytest.mark.parametrize("tok, match", [(" Bob  ", "ambiguous"), ("99", "outside the vocabulary"),
                                        ("Zed", "not found")])
def test_bad_tokens_are_user_errors(tmp_path, tok, match):
    store = tmp_path / "s.zarr"
    write_store(store)
    with pytest.raises(UserError, match=match):
        token_table(partial(read_group, store), ["runA/checkpoint-20"], [tok])


def test_tokens_resolved_with_the_checkpoints_tokenizer(tmp_path, corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    store = tmp_path / "s.zarr"
    ds = write_store(store, tokenizer=str(corpus["tokenizer"]), vocab=len(tok))["runA/checkpoint-20"]
    (the,) = tok.encode("the", add_special_tokens=False)
    table = token_table(partial(read_group, store), ["runA/checkpoint-20"], ["the"])
    assert table.id[0] == the and table["count"][0] == ds["count"][the]
    assert len(tok.encode("the big dog", add_special_tokens=False)) > 1
    with pytest.raises(UserError, match="tokens .* not one"):
        resolve_token("the big dog", None, str(corpus["tokenizer"]), len(tok))
    with pytest.warns(TokenNote, match=r"'the big dog' is \d+ tokens .* not one.*left out of runA/checkpoint-20"):
        table = token_table(partial(read_group, store), ["runA/checkpoint-20"], ["the big dog", "the"])
    assert table.id[0] == the and len(table) == 2  # the report goes on without it (and the average token)


@pytest.mark.slow
def test_report_with_tokens_uses_each_runs_latest_checkpoint(tmp_path):
    store = tmp_path / "s.zarr"
    write_store(store)
    df = pd.DataFrame({"run": ["runA"] * 2, "checkpoint": ["checkpoint-100", "checkpoint-20"], "global_step": [100, 20],
                       "n_params": [1e6, 1e6], "eval_loss": [2.0, 3.0], "nc1_cdnv": [0.5, 0.9]})
    files = write_report(df, tmp_path / "out", ReportOptions(formats="png", metrics=["nc1_cdnv"], n_perm=0, store=store,
                                                             tokens=[" Anna", "3", "8", "9"]),
                         read_group=partial(read_group, store)).files
    tokens = pd.read_csv(files["tokens"], keep_default_na=False)
    assert set(tokens.checkpoint) == {"runA/checkpoint-100"}  # by step, not by name
    text = files["report"].read_text()
    tables = markdown_tables(text)
    assert tables[1][0][:3] == ["token", "id", "count"]
    want = ["' Anna'", "' Tim'", "' \\|'", "'&amp;%$_\\\\{'", AVERAGE_TOKEN]  # & < > as entities in Markdown
    assert [r[0] for r in tables[1][1:]] == want
    assert "too few for a correlation" in text
    assert check_latex(files["tex"].read_text()) == 3  # raw, log10 and the tokens
    compile_latex(files["tex"], tmp_path)


@pytest.mark.slow
def test_tokens_resolved_otherwise_or_given_twice_are_said_and_listed_once(tmp_path):
    store = tmp_path / "s.zarr"
    write_store(store)
    df = pd.DataFrame({"run": ["runA"] * 2, "checkpoint": ["checkpoint-100", "checkpoint-20"], "global_step": [100, 20],
                       "n_params": [1e6, 1e6], "eval_loss": [2.0, 3.0], "nc1_cdnv": [0.5, 0.9]})
    options = ReportOptions(formats="png",
                            metrics=["nc1_cdnv"], n_perm=0, store=store, tokens=["Tim", " Anna", "Tim", " Tim", "3"])
    logger, heard = logging.getLogger("ncanalyze.analyzer.report.write"), logging.handlers.BufferingHandler(100)
    level = logger.level
    logger.setLevel(logging.WARNING)  # whatever level an earlier CLI run left on "ncanalyze"
    logger.addHandler(heard)
    try:
        result = write_report(df, tmp_path / "out", options, read_group=partial(read_group, store))
    finally:
        logger.removeHandler(heard)
        logger.setLevel(level)
    files = result.files
    tokens = pd.read_csv(files["tokens"], keep_default_na=False)
    assert list(tokens.token) == [" Tim", " Anna", AVERAGE_TOKEN]
    pd.testing.assert_frame_equal(pd.read_csv(files["tokens"]), result.tokens.astype({"id": float, "count": int}))
    said = result.notes
    assert [r.getMessage() for r in heard.buffer] == [f"note: {s}" for s in said]  # logged as they are found
    assert said == ["token 'Tim' given more than once: listed once",
                    "token 'Tim' read as ' Tim' (id 3), the word after a space",
                    "token ' Tim' given more than once (in different spellings): listed once"]
    text = files["report"].read_text()
    assert all(f"**Note:** {s}." in text for s in said)


# ---------------------------------------------------------------- the whole command on a real extracted store

@pytest.mark.slow
def test_report_on_a_real_store(extracted_store, corpus, tmp_path):
    from ncanalyze.store.measure import measure_store
    from transformers import AutoTokenizer

    store = tmp_path / "study.zarr"
    shutil.copytree(extracted_store, store)  # report measures into the store: leave the session's one as it is
    out = tmp_path / "report"
    res = run_cli("report", store, "--out", out, "--tokens", "the, red,quiet,5", "--permutations", 1000, "--seed", 1,
                  "--formats", "png,pdf,svg")
    assert "report.md" in res.output
    assert "note: token 'quiet' read as ' quiet'" in res.output

    measured = measure_store(store).table  # already measured by the report: the same table
    metrics = pd.read_csv(out / "metrics.csv")
    assert len(metrics) == len(measured) >= 3
    support = ["n_kept", "n_singletons", "n_thin", "train_tokens", "val_tokens"]  # after the descriptive columns
    first = [c for c in ID_COLUMNS if c in measured.columns]
    assert list(metrics.columns) == first + support + [c for c in measured.columns if c not in first]
    pd.testing.assert_frame_equal(metrics.drop(columns=support), measured.reset_index(drop=True), check_dtype=False)
    for _, row in metrics.iterrows():  # brute force from the store's count vectors (min_count 1)
        ds = read_group(store, f"{row.run}/{row.checkpoint}")
        count = ds["count"].values
        assert row.n_kept == (count >= 1).sum() and row.n_singletons == (count == 1).sum()
        assert row.n_thin == ((count >= 1) & (count < 5)).sum() and row.train_tokens == count.sum()
        assert row.val_tokens == ds["val_count"].values.sum() > 0

    stats = pd.read_csv(out / "stats.csv")
    assert set(stats.columns) == STATS_COLUMNS and len(stats) == 2 * len(METRICS)
    raw = stats[stats.scale == "raw"].set_index("metric")
    ok = measured[["nc1_cdnv", "val_loss"]].dropna()  # the default target: every checkpoint has val_loss
    assert raw.loc["nc1_cdnv", "r"] == pytest.approx(np.corrcoef(ok.nc1_cdnv, ok.val_loss)[0, 1], abs=1e-12)

    text = (out / "report.md").read_text()
    tables = markdown_tables(text)
    assert tables[0][0] == SUMMARY_HEADER and len(tables[0]) == 1 + len(METRICS)
    tok = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    ids = [tok.encode(t, add_special_tokens=False) for t in (" the", " red", " quiet")]
    assert all(len(i) == 1 for i in ids)  # single tokens of this vocabulary; 'the' and 'quiet' are read as ' the' ...
    assert "note: token 'the' read as ' the'" in res.output  # ... the word after a space, as explore_store reads it
    ids = [i[0] for i in ids] + [5]
    tokens = pd.read_csv(out / "tokens.csv")
    last = measured.sort_values("global_step").iloc[-1]
    assert set(tokens.checkpoint) == {f"{last.run}/{last.checkpoint}"}
    assert list(tokens.id[:4].astype(int)) == ids and tokens.token.iloc[-1] == AVERAGE_TOKEN
    ds = xr.open_zarr(store, group=f"{last.run}/{last.checkpoint}", consolidated=False)
    assert list(tokens["count"][:4]) == [int(ds["count"][i]) for i in ids]
    assert tokens["mean CDNV"][0] == pytest.approx(float(ds.class_cdnv[ids[0]]))
    token_tables = [t for t in tables if t[0][:3] == ["token", "id", "count"]]  # after the claims' tables (issue 39)
    assert len(token_tables) == 1 and token_tables[0][-1][0] == AVERAGE_TOKEN
    min_count = [t for t in tables if t[0][3:7] == ["min_count 1 (kept)", "min_count 2 (kept)", "min_count 5 (kept)",
                                                    "min_count 20 (kept)"]]
    assert len(min_count) == 1  # test_report_mincount.py
    assert tables[-1][0][:3] == ["run", "checkpoint", "`nc1_cdnv`"] and " ± " in tables[-1][1][2]  # the final errors

    assert check_latex((out / "tables.tex").read_text()) == 4  # raw, log10, the tokens and the final errors
    compile_latex(out / "tables.tex", tmp_path)
    for stem, (_, fig_metrics) in FIGURES.items():
        check_png(out / f"{stem}.png", len(fig_metrics), colour_bar=False)  # one run, one size


@pytest.mark.slow
def test_a_metric_without_values_keeps_its_panel_and_is_explained(tmp_path):
    df = study(n_runs=3, per_run=4).assign(nc4_agreement=np.nan)  # extracted without validation tokens
    files = write_report(df, tmp_path, ReportOptions(n_perm=0)).files
    check_png(files["fig1_nc_vs_loss"], 4)
    assert "no values (not measurable here): nc4_agreement" in files["report"].read_text()


@pytest.mark.slow
def test_tokens_of_chosen_checkpoints(tmp_path):
    store = tmp_path / "s.zarr"
    groups = write_store(store)
    df = pd.DataFrame({"run": ["runA"] * 2, "checkpoint": ["checkpoint-100", "checkpoint-20"], "global_step": [100, 20],
                       "n_params": [1e6, 1e6], "eval_loss": [2.0, 3.0], "nc1_cdnv": [0.5, 0.9]})
    options = ReportOptions(formats="png", metrics=["nc1_cdnv"], n_perm=0, store=store, tokens=["the"],
                            checkpoints=["runA/checkpoint-20", "runA/checkpoint-100"])
    files = write_report(df, tmp_path / "out", options, read_group=partial(read_group, store)).files
    tokens = pd.read_csv(files["tokens"])
    assert list(tokens.checkpoint) == ["runA/checkpoint-20"] * 2 + ["runA/checkpoint-100"] * 2
    assert list(tokens["count"][::2]) == [int(groups[g]["count"][4]) for g in ("runA/checkpoint-20",
                                                                                 "runA/checkpoint-100")]
    with pytest.raises(UserError, match="no checkpoint group 'runA/checkpoint-7'"):
        write_report(df, tmp_path / "out", replace(options, checkpoints=["runA/checkpoint-7"]),
                     read_group=partial(read_group, store))


# ---------------------------------------------------------------- Holm in report.md; text without controls

@pytest.mark.slow
def test_report_md_gives_holm_p_and_how_many_survive(synthetic_report):
    _, files = synthetic_report
    text = files["report"].read_text()
    stats = pd.read_csv(files["stats"])
    table = markdown_tables(text)[0]  # the summary (the claims' tables follow)
    col = table[0].index("p Holm")
    raw = stats[stats.scale == "raw"].set_index("metric")
    for row in table[1:]:
        p = raw.loc[row[0], "p_holm"]
        assert row[col] == fmt_p(p) and (float(row[col]) < 0.05) == (p < 0.05)
    for scale, (fam, name) in itertools.product(("raw", "log"), (("NC", "NC"), ("geometry", "geometry"))):
        s = stats[(stats.scale == scale) & (stats.family == fam) & stats.p_holm.notna()]
        assert f"r, {scale} scale, {name} metrics: {(s.p_holm < 0.05).sum()} of {len(s)} metric(s) survive at 0.05" \
            in text


@pytest.mark.slow
def test_no_controls_reads_well(tmp_path):
    df = study(n_runs=3, per_run=4)
    files = write_report(df, tmp_path, ReportOptions(formats="png", controls=[], metrics=["nc1_cdnv"], n_perm=50)).files
    text = files["report"].read_text() + files["tex"].read_text()
    assert "controlling for" not in text and "with no controls, equal to r" in text
    assert "  (" not in text and " ." not in text
    res = run_cli("report", tmp_path / "metrics.csv", "--out", tmp_path / "cli", "--controls", "", "--metrics",
                  "nc1_cdnv", "--permutations", 50)
    assert "controlling for" not in (tmp_path / "cli" / "report.md").read_text()
    assert "Traceback" not in res.output


@pytest.mark.slow
def test_where_with_a_backticked_column_stays_inline_code(tmp_path):
    df = study(n_runs=3, per_run=4).rename(columns={"n_params": "n params"})
    options = ReportOptions(where="`n params` > 0", metrics=["nc1_cdnv"], controls=[], n_perm=0)
    files = write_report(df, tmp_path, options).files
    text = files["report"].read_text()
    assert "(`` `n params` > 0 ``)" in text
    assert "`fig1_nc_vs_loss`, `fig2_nc2_vs_gnc2`" not in text  # only the figures drawn are listed
    assert "`fig1_nc_vs_loss`" in text and ".pdf` (fonts embedded)" in text


# ---------------------------------------------------------------- the result: the tables it computed, the files

@pytest.mark.slow
def test_the_result_holds_the_tables_it_wrote(tmp_path):
    """What write_report returns is what it wrote (the CLI reads no file back): every layer's rows in metrics.csv,
    the last layer's statistics in stats.csv, the per-layer table in layers.csv, each file once."""
    last = study(n_runs=3, per_run=4, seed=5).assign(n_layers=2, layer=2)
    shallow = last.assign(layer=1, nc1_cdnv=last.nc1_cdnv * 3)
    table = pd.concat([shallow, last], ignore_index=True)
    r = write_report(table, tmp_path, ReportOptions(formats="png", n_perm=20, seed=2, where="run != 'r0'"))
    kept = table[table.run != "r0"]
    assert r.target == "eval_loss" and len(r.selected) == (kept.layer == 2).sum() == 8
    assert (r.selected.layer == 2).all() and len(r.metrics) == len(kept)
    assert r.stats.loc[(r.stats.metric == "nc1_cdnv") & (r.stats.scale == "raw"), "r"].item() == pytest.approx(
        np.corrcoef(kept[kept.layer == 2].nc1_cdnv, kept[kept.layer == 2].eval_loss)[0, 1], abs=1e-12)
    for name, frame in (("metrics", r.metrics), ("stats", r.stats), ("layers", r.depth)):
        assert r.files[name].read_text() == frame.to_csv(index=False), name
    assert r.tokens is None and r.notes == [] and "tokens" not in r.files
    assert list(r.figures) == [*FIGURES, DYNAMICS[0]] and r.figures.items() <= r.files.items()
    assert sorted(p.name for p in r.files.values()) == sorted(p.name for p in tmp_path.iterdir() if p.suffix in
                                                              (".csv", ".md", ".tex", ".html") or
                                                              p.name.endswith(".png"))
    assert r.files["html"] == tmp_path / "report.html"


@pytest.mark.slow
def test_no_control_varies_said_and_the_repeated_partial_columns_left_out(tmp_path):
    """Seed replicas: one size and one step, so no control varies: report.md says so (never "controls for nan"),
    its table and tables.tex leave out the partial r's columns (they would repeat r's); stats.csv keeps them."""
    df = study(n_runs=8, per_run=1, seed=3).assign(n_params=10 ** 6, n_layers=2, hidden_size=64)
    options = ReportOptions(formats="png", n_perm=200, html=False,
                            metrics=["nc1_cdnv", "gnc2_log_std", "unc3_cos_cv", "nc4_agreement"])
    r = write_report(df, tmp_path / "out", options)
    text = r.files["report"].read_text()
    assert "controls for nan" not in text and "controlling for nan" not in text
    assert ("partial r: none of the controls (`log1p(global_step)`) varies among these checkpoints, so it "
            "equals r; its columns (partial r, p FL, p FL Holm) are left out.") in text
    table = next(t for t in markdown_tables(text) if t[0][:2] == ["metric", "n"])
    assert not any(h.startswith(("partial r", "p FL")) for h in table[0]) and "r" in table[0]
    stats = pd.read_csv(r.files["stats"])
    np.testing.assert_allclose(stats.partial_r, stats.r, rtol=1e-12)  # what was left out is r indeed
    tex = r.files["tex"].read_text()
    assert "no control varies, so partial $r$ equals $r$ (left out)" in tex and "p FL" not in tex

    controlled = write_report(study(n_runs=6, per_run=2), tmp_path / "c", ReportOptions(formats="png",
                                                                                        n_perm=0, html=False))
    assert "are left out." not in controlled.files["report"].read_text()
    assert any("partial r" in h for h in markdown_tables(controlled.files["report"].read_text())[0][0])
