"""The command line's conventions: --store everywhere (positional too), one-line user errors, tracebacks for bugs
and under --debug, and messages through logging with -v/-q."""
from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from conftest import run_cli

from ncanalyze.analyzer.errors import UserError
from ncanalyze.cli.main import main


@pytest.fixture
def measured(extracted_store, tmp_path):
    """A copy of the extracted store, measured once."""
    import shutil

    store = tmp_path / "s.zarr"
    shutil.copytree(extracted_store, store)
    run_cli("measure", store)
    return store


def test_every_store_command_takes_store_as_option_or_positional(measured, tmp_path, monkeypatch):
    for args in (["--store", measured], [measured]):
        assert "already measured" in run_cli("measure", *args).output
        out = tmp_path / f"r{len(args)}"
        assert "report.md" in run_cli("report", *args, "--out", out, "--permutations", 0).output
        assert (out / "metrics.csv").is_file()
    monkeypatch.setenv("NCANALYZE_STORE", str(measured))
    assert "already measured" in run_cli("measure").output
    r = run_cli("measure", measured, "--store", tmp_path / "other.zarr", ok=False)
    assert r.exit_code == 2 and "two stores given" in r.output


def test_user_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
    missing = tmp_path / "missing.zarr"
    r = run_cli("measure", "--store", missing, ok=False)
    assert r.output.startswith("Error: no ncanalyze store") and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(main, ["--debug", "measure", "--store", str(missing)])
    assert r.exit_code == 1 and isinstance(r.exception, UserError)  # raised through: Python prints its traceback


def test_a_bug_is_never_dressed_as_a_user_error():
    @click.command()
    def broken():
        raise ZeroDivisionError("a bug")

    main.add_command(broken)
    try:
        r = CliRunner().invoke(main, ["broken"])
    finally:
        main.commands.pop("broken")
    assert isinstance(r.exception, ZeroDivisionError) and "Error:" not in r.output


def test_quiet_and_verbose(extracted_store, trained_run, corpus, tmp_path):
    from conftest import EXTRACT_OPTS

    store = tmp_path / "q.zarr"
    args = ["extract", trained_run / "checkpoint-20", "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS]
    loud = run_cli(*args).output
    assert "estimate:" in loud and "checkpoint-20: done" in loud
    quiet = run_cli("-q", *args).output
    assert "checkpoint-20" in quiet and "skipped" not in quiet  # the summary line stays, the log lines go
