"""Issue 49 (the report's files and messages) and issue 51's first-hour friction, on a real store from the conftest's
Trainer run through the real CLI: a second report into the same --out leaves none of the first one's files it did
not write (and every file of the user's), warnings where statistics are undefined become notes naming the metric,
and the minor ones."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import run_cli


@pytest.fixture(scope="module")
def measured(extracted_store, tmp_path_factory) -> Path:
    """A private copy of ``extracted_store``, measured."""
    store = tmp_path_factory.mktemp("reports") / "s.zarr"
    shutil.copytree(extracted_store, store)
    run_cli("measure", store)
    return store


def names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.mark.slow
def test_a_second_report_removes_the_files_of_the_first_it_does_not_write(measured, tmp_path):
    """report.html, min_count.csv, budget.*, tokens.csv and fig4_dynamics.* of a first report survived a second one
    that wrote none of them; now --out holds what a fresh report writes, and the user's own files."""
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    run_cli("report", measured, "--out", out, "--tokens", "the", "--permutations", 0, "--formats", "png,pdf")
    assert {"report.html", "min_count.csv", "budget.csv", "budget.png", "tokens.csv", "fig4_dynamics.png",
            "fig4_dynamics.pdf"} <= names(out)
    (out / "notes.txt").write_text("mine")
    (out / "fig9_mine.png").write_bytes(b"mine")
    table = shutil.copy(out / "metrics.csv", tmp_path / "metrics.csv")
    second = ("report", table, "--permutations", 0, "--per-run", "last", "--no-html", "--formats", "png")
    run_cli(*second, "--out", out)
    run_cli(*second, "--out", fresh)
    assert names(out) == names(fresh) | {"notes.txt", "fig9_mine.png"}
    assert not {"report.html", "min_count.csv", "budget.csv", "fig4_dynamics.png", "fig1_nc_vs_loss.pdf"} & names(out)
    assert (out / "notes.txt").read_text() == "mine" and (out / "fig9_mine.png").read_bytes() == b"mine"


EXTRACT_SMALL = ("--max-train-tokens", 1024, "--max-val-tokens", 512, "--samples-per-class", 1)


@pytest.mark.slow
def test_quiet_draws_no_progress_bar(trained_run, corpus, tmp_path):
    """Issue 51: ``-q`` prints only warnings and errors, as the docs say; it drew the progress bars (a 20 KB log)."""
    args = ("extract", trained_run / "checkpoint-20", "--dataset", corpus["train"], *EXTRACT_SMALL)
    loud = run_cli(*args, "--store", tmp_path / "loud.zarr").output
    assert "%|" in loud and "batch" in loud  # tqdm's bars: the tokenizing pass and the extraction pass
    quiet = run_cli("-q", *args, "--store", tmp_path / "quiet.zarr").output
    assert "%|" not in quiet and "it/s" not in quiet and "batch/s" not in quiet, quiet
    assert (tmp_path / "quiet.zarr").is_dir()


@pytest.mark.slow
def test_a_run_folder_named_with_white_space_alone_is_refused(trained_run, corpus, tmp_path):
    run = tmp_path / " "
    shutil.copytree(trained_run / "checkpoint-20", run / "checkpoint-20")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained_run / f, run / f)
    r = run_cli("extract", run, "--dataset", corpus["train"], *EXTRACT_SMALL, "--store", tmp_path / "s.zarr",
                ok=False)
    assert "is only white space (invisible wherever it is shown)" in r.output and "rename the folder" in r.output
    assert not (tmp_path / "s.zarr").exists()
