"""The command line's conventions: --store everywhere (positional too), one-line user errors, tracebacks for bugs
and under --debug, and messages through logging with -v/-q."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from importlib.metadata import version

import click
import pytest
from click.testing import CliRunner
from conftest import ROOT, run_cli
from ncanalyze.cli.main import main
from ncanalyze.cli.options import OPTIONS
from ncanalyze.core.errors import UserError
from ncanalyze.store.extraction.settings import ExtractConfig

SETTINGS = {f.name: f for f in dataclasses.fields(ExtractConfig)}

import ncanalyze


@pytest.fixture
def measured(extracted_store, tmp_path):
    """A copy of the extracted store, measured once."""
    import shutil

    store = tmp_path / "s.zarr"
    shutil.copytree(extracted_store, store)
    run_cli("measure", store)
    return store


@pytest.mark.slow
def test_every_store_command_takes_store_as_option_or_positional(measured, tmp_path, monkeypatch):
    for args in (["--store", measured], [measured]):
        assert "already measured" in run_cli("measure", *args).output
        out = tmp_path / f"r{len(args)}"
        r = run_cli("report", *args, "--out", out, "--permutations", 0, "--metrics", "nc1_cdnv")  # the CLI, not maths
        assert "report.md" in r.output
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


HEAVY = ("zarr", "xarray", "torch", "transformers", "plotly", "matplotlib", "pandas", "scipy")


@pytest.mark.slow
def test_help_and_version_import_no_heavy_library(tmp_path):
    """``ncanalyze --help``, each command's ``--help`` and ``--version`` in a fresh interpreter: none of them loads
    zarr, xarray, torch, transformers, plotly or matplotlib (the version comes from the package's metadata)."""
    code = ("import sys\nfrom ncanalyze.cli.main import main\n"
            "for args in (['--help'], ['--version'], *([c, '--help'] for c in main.commands)):\n"
            "    try:\n        main(args, prog_name='ncanalyze')\n"
            "    except SystemExit as e:\n        assert not e.code, (args, e.code)\n"
            f"print('loaded:', sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "loaded: []" in r.stdout, r.stdout.splitlines()[-1]
    assert f"ncanalyze, version {version('ncanalyze')}" in r.stdout and version("ncanalyze") == ncanalyze.__version__
    assert all(f"Usage: ncanalyze {c} [OPTIONS]" in r.stdout for c in ("extract", "measure", "report"))


@pytest.mark.slow
def test_the_check_sees_a_heavy_import(tmp_path):
    """The same probe, once a command's module pulls xarray in, reports it (the check above can fail)."""
    code = ("import sys, ncanalyze.cli.main, ncanalyze.store.io\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert "'xarray'" in r.stdout and "'zarr'" in r.stdout, r.stderr


def test_shared_options_are_defined_once_with_each_commands_help():
    """--store and --scheduler are the commands' own, in OPTIONS; --min-count, --device, --seed and --tile are
    settings, generated from a registry whose shared fields say flag, default and rule once (SHARED)."""
    from ncanalyze.core.setting import SHARED

    for flag in ("--store", "--scheduler", "--min-count", "--device", "--tile", "--seed", "--permutations"):
        where = [f.name for f in (ROOT / "cli").rglob("*.py") if re.search(rf'option\(\s*"{flag}"', f.read_text())]
        assert not where, (flag, where)
    assert all(f'("{flag}",)' in (ROOT / "cli" / "options.py").read_text() for flag in ("--store", "--scheduler"))
    seen = set()
    for name, command in main.commands.items():
        for p in command.params:
            if p.name in OPTIONS:
                shared = OPTIONS[p.name]
                assert p.opts == list(shared.decls) and p.help == shared.helps.get(name, shared.help)
                seen.add((name, p.name))
            if p.name in SHARED:
                assert p.opts == ["--" + p.name.replace("_", "-")] and p.default == SHARED[p.name]["default"]
                seen.add((name, p.name))
    assert {("extract", n) for n in ("store", "scheduler", "min_count", "device", "seed")} <= seen
    assert {("measure", n) for n in ("store", "scheduler", "min_count", "device")} <= seen
    assert {("report", n) for n in ("store", "scheduler", "min_count", "seed")} <= seen
    for n in ("min_count", "device", "seed"):  # extract's are settings, generated from ExtractConfig's fields
        p = next(p for p in main.commands["extract"].params if p.name == n)
        assert p.help == SETTINGS[n].metadata["help"], n
    helps = {c: p.help for c in main.commands for p in main.commands[c].params if p.name == "min_count"}
    assert set(helps) == {"extract", "measure", "report"}
    assert "NC4" in helps["extract"] and len(set(helps.values())) == 3  # one flag, each command's meaning
    assert "checkpoint as a task" in next(p.help for p in main.commands["extract"].params if p.name == "scheduler")


def test_module_loggers_speak_through_the_cli_and_obey_q_and_v():
    """Every module logs to ``logging.getLogger(__name__)``; the CLI configures the ``ncanalyze`` logger they
    propagate to, so -q and -v reach them."""
    import logging

    @click.command()
    def talk():
        child = logging.getLogger("ncanalyze.store.somewhere")
        child.debug("a debug detail")
        child.info("an info line")
        child.warning("a warning")

    main.add_command(talk)
    try:
        outputs = {flags: CliRunner().invoke(main, [*flags, "talk"]).output for flags in ((), ("-q",), ("-v",))}
    finally:
        main.commands.pop("talk")
    assert "an info line" in outputs[()] and "a warning" in outputs[()] and "a debug detail" not in outputs[()]
    assert "an info line" not in outputs[("-q",)] and "a warning" in outputs[("-q",)]
    assert "a debug detail" in outputs[("-v",)]
