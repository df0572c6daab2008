"""One settings registry for every command (ncanalyze.analyzer.registry): measure's and report's options and their
``--help`` sections are generated from it, a bad value is refused when the settings are made (the library, the
training callback and the command alike, in the same line), and each default is written once."""
from __future__ import annotations

import dataclasses
import re

import pytest
from click.testing import CliRunner
from conftest import ROOT, run_cli
from ncanalyze.analyzer.registry import MEASURE_SECTIONS, N_PERM, REPORT_SECTIONS, MeasureSettings, ReportSettings
from ncanalyze.analyzer.report import ReportOptions
from ncanalyze.cli.main import main
from ncanalyze.core.errors import UserError
from ncanalyze.core.setting import flag_of
from ncanalyze.store.extraction.settings import ExtractConfig

REFUSED = [  # (command, the library's settings, a value as the library takes it, as the command line gives it, line)
    ("measure", MeasureSettings, dict(device="tpu"), ["--device", "tpu"],
     "device (--device) must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    ("measure", MeasureSettings, dict(min_count=0), ["--min-count", "0"],
     f"min_count (--min-count) must be between 1 and {2**53}, got 0"),
    ("measure", MeasureSettings, dict(tile=0), ["--tile", "0"], "tile (--tile) must be between 1 and 65536, got 0"),
    ("report", ReportOptions, dict(n_perm=-1), ["--permutations", "-1"],
     "n_perm (--permutations) must be between 0 and 10000000, got -1"),
    ("report", ReportOptions, dict(per_run="first"), ["--per-run", "first"],
     "per_run (--per-run) must be one of all, last, got 'first'"),
    ("report", ReportOptions, dict(seed=-1), ["--seed", "-1"],
     "seed (--seed) must be between 0 and 9223372036854775807, got -1"),
    ("report", MeasureSettings, dict(min_count=0), ["--min-count", "0"],
     f"min_count (--min-count) must be between 1 and {2**53}, got 0"),
    # issue 49: a maximum for every number (a 36 TiB bootstrap, a MemoryError, an int64 overflow), the rule said
    ("report", ReportOptions, dict(n_boot=10**12), ["--bootstrap", str(10**12)],
     "n_boot (--bootstrap) must be between 0 and 1000000, got 1000000000000"),
    ("measure", MeasureSettings, dict(threads="100000"), ["--threads", "100000"],
     "threads (--threads) must be auto or an integer from 1 to 1024, got '100000'"),
    ("measure", MeasureSettings, dict(threads="²"), ["--threads", "²"],
     "threads (--threads) must be auto or an integer from 1 to 1024, got '²'"),
    ("measure", MeasureSettings, dict(threads="9" * 20), ["--threads", "9" * 20],
     f"threads (--threads) must be auto or an integer from 1 to 1024, got '{'9' * 20}'"),
    ("measure", MeasureSettings, dict(min_count=10**20), ["--min-count", str(10**20)],
     f"min_count (--min-count) must be between 1 and {2**53}, got {10**20}"),
]
EXTRACT_REFUSED = [  # ExtractConfig, as the training callback makes it, and ``ncanalyze extract``
    (dict(layers="foo"), ["--layers", "foo"],
     "layers (--layers) is not last, all or comma-separated integers like 0,6,12, got 'foo'"),
    (dict(device="tpu"), ["--device", "tpu"], "device (--device) must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (dict(min_count=5, max_train_tokens=3), ["--min-count", "5", "--max-train-tokens", "3"],
     "--min-count 5 is above --max-train-tokens 3, so no class could be kept: lower --min-count to at most 3, or raise --max-train-tokens"),
    (dict(cap_mode="middle"), ["--cap-mode", "middle"],
     "cap_mode (--cap-mode) must be one of spread, prefix, got 'middle'"),
]


@pytest.mark.parametrize("command, cls, value, args, line", REFUSED)
def test_measure_and_report_refuse_as_their_settings_do(command, cls, value, args, line, tmp_path):
    with pytest.raises(UserError) as e:
        cls(**value)
    assert str(e.value) == line
    r = run_cli(command, tmp_path / "nowhere.zarr", *args, ok=False)  # refused before the store is looked at
    assert r.exit_code == 1 and r.output.strip() == f"Error: {line}", r.output


@pytest.mark.parametrize("value, args, line", EXTRACT_REFUSED)
def test_extract_settings_are_refused_when_made(value, args, line, tmp_path):
    with pytest.raises(UserError) as e:
        ExtractConfig(dataset="d.txt", **value)
    assert str(e.value) == line
    r = run_cli("extract", tmp_path, "--dataset", "d.txt", *args, "--store", tmp_path / "s.zarr", ok=False)
    assert r.exit_code == 1 and r.output.strip() == f"Error: {line}", r.output
    assert not (tmp_path / "s.zarr").exists()


NUMBERS = [(cls, f) for cls in (MeasureSettings, ReportSettings, ExtractConfig) for f in dataclasses.fields(cls)
           if f.metadata.get("kind") in (int, float) or f.name in ("threads", "layers_per_pass")]


@pytest.mark.parametrize("cls, f", NUMBERS, ids=[f.name for _, f in NUMBERS])
def test_every_number_has_a_maximum_said_in_one_line(cls, f):
    """Issue 49: every numeric setting has a maximum; one above it is refused in the setting's line, never an
    allocation, a MemoryError or an int64 overflow."""
    high = f.metadata["maximum"]
    assert high is not None and high <= 2**63 - 1, f.name
    made = (lambda **v: cls(dataset="d.txt", **v)) if cls is ExtractConfig else cls
    made(**{f.name: high})  # the maximum itself is a value
    with pytest.raises(UserError, match=rf"^{f.name} \({flag_of(f)}\) must be .*, got "):
        made(**{f.name: high + 1 if isinstance(high, int) else high * 2})


@pytest.mark.parametrize("command, args", [
    ("report", ["--bootstrap", "²"]), ("report", ["--permutations", "1e3"]), ("measure", ["--tile", "٣"]),
    ("extract", ["--batch-size", "²", "--dataset", "d.txt"]), ("extract", ["--state-every", "½", "--dataset", "d"])])
def test_a_number_that_does_not_parse_gets_the_settings_rule(command, args, tmp_path):
    """``²`` (a Unicode digit, which Python's int() half-takes), ``1e3`` for an integer: the setting's rule in its
    one line, not int()'s or click's message."""
    r = run_cli(command, tmp_path / "nowhere.zarr", *args, ok=False)
    flag, value = args[0], args[1]
    assert re.fullmatch(rf"Error: \w+ \({flag}\) must be (an integer|a number) from [0-9.]+ to [0-9.]+, got "
                        rf"'{re.escape(value)}'", r.output.strip()), r.output
    assert not (tmp_path / "nowhere.zarr").exists()


@pytest.mark.slow  # its first import of transformers
@pytest.mark.parametrize("value, args, line", EXTRACT_REFUSED)
def test_the_training_callback_refuses_as_it_is_made(value, args, line, tmp_path):
    from ncanalyze.store.runs.callback import NeuralCollapseCallback

    with pytest.raises(UserError) as e:
        NeuralCollapseCallback(tmp_path / "s.zarr", "d.txt", **value)
    assert str(e.value) == line
    assert not (tmp_path / "s.zarr").exists()


def test_values_are_converted_once_and_the_library_matches_the_command():
    """A comma-separated string and a list make the same options; per_run None is the default, all; the
    command's defaults are the library's."""
    assert ReportOptions(metrics="nc1_cdnv,,nc4_agreement", controls="") == ReportOptions(
        metrics=["nc1_cdnv", "nc4_agreement"], controls=[])
    assert ReportOptions(per_run=None).per_run == ReportOptions().per_run == "all"
    assert ReportOptions(tokens=" Anna,Tim").tokens == (" Anna", "Tim")  # a token's leading space is kept
    assert ExtractConfig(dataset="d", layers=" LAST ").layers == "last"
    assert MeasureSettings(device="CUDA:1").device == "cuda:1"
    for command, registries in (("measure", [MeasureSettings]), ("report", [ReportSettings])):
        params = {p.name: p for p in main.commands[command].params}
        for f in (f for cls in registries for f in dataclasses.fields(cls)):
            p, default = params[f.name], f.default
            assert p.opts[0] == flag_of(f), f.name
            joined = ",".join(default) if isinstance(default, tuple) and not p.multiple else default
            assert p.default == joined, f.name
            assert p.help == f.metadata["help"], f.name


@pytest.mark.parametrize("command, titles, registry", [("measure", MEASURE_SECTIONS, MeasureSettings),
                                                       ("report", REPORT_SECTIONS, ReportSettings)])
def test_help_has_every_setting_in_its_section(command, titles, registry):
    out = CliRunner().invoke(main, [command, "--help"], terminal_width=200).output
    found = [line[:-1] for line in out.splitlines() if re.fullmatch(r"[A-Z][a-z -]+:", line)]
    assert found == [*titles, "Other options"], found
    section, where = None, {}
    for line in out.splitlines():
        if re.fullmatch(r"[A-Z][a-z -]+:", line):
            section = line[:-1]
        for flag in re.findall(r"^\s+(--[a-z-]+)", line):
            where[flag] = section
    for f in dataclasses.fields(registry):
        assert where[flag_of(f)] == f.metadata["section"], f.name
    assert where["--store"] == where["--scheduler"] == ("Run control" if command == "measure" else "Measuring")
    assert where["--min-count"] == "Measuring"
    if command == "report":
        assert where["--out"] == where["--html"] == "Output"
        assert "[default: 10000; 0<=x<=10000000]" in re.sub(r"\s+", " ", out)
        assert "--help" not in where or where["--help"] == "Other options"


def test_each_default_is_written_once():
    """The permutation and bootstrap counts are written in the registry only, once each (the statistics' defaults
    read N_PERM and N_BOOT)."""
    from ncanalyze.analyzer.registry import N_BOOT
    written = {f.relative_to(ROOT).as_posix(): n for pkg in ("core", "analyzer", "store", "cli")
               for f in (ROOT / pkg).rglob("*.py") if (n := len(re.findall(r"\b10_?000\b", f.read_text())))}
    assert written == {"analyzer/registry.py": 2} and N_PERM == 10_000 and N_BOOT == 10_000, written
    assert ReportOptions().n_perm == N_PERM and ReportOptions().n_boot == N_BOOT
    from ncanalyze.analyzer.permute import perm_test
    from ncanalyze.analyzer.stats import correlations, correlations_by_tag
    import inspect
    for f in (perm_test, correlations, correlations_by_tag):
        assert inspect.signature(f).parameters["n_perm"].default == N_PERM, f.__name__
    for f in (correlations, correlations_by_tag):
        assert inspect.signature(f).parameters["n_boot"].default == N_BOOT, f.__name__
    from ncanalyze.analyzer.accessor import DatasetAccessor
    from ncanalyze.analyzer.metrics import measure, measure_all
    from ncanalyze.store.measure import measure_store
    for f in (measure, measure_all, DatasetAccessor.measure, measure_store):  # se: the same everywhere, the CLI's
        assert inspect.signature(f).parameters["se"].default is MeasureSettings().se is True, f.__qualname__
        assert inspect.signature(f).parameters["min_count"].default == MeasureSettings().min_count == 1
    lists = {f.relative_to(ROOT).as_posix() for pkg in ("core", "analyzer", "store", "cli")
             for f in (ROOT / pkg).rglob("*.py") if re.search(r'"float16",\s*"float64"', f.read_text())}
    assert lists == {"core/setting.py"}, lists  # one list of dtypes (the store's a part of it, load's mapped)


def test_one_device_parser_and_one_message_everywhere():
    """The settings, the metrics' engine choice and the model loader read --device with one parser: one line."""
    from ncanalyze.analyzer.engines import engine_device
    from ncanalyze.core.errors import UserError
    from ncanalyze.store.extraction.settings import ExtractConfig
    from ncanalyze.store.sources.load import resolve_device

    want = "device (--device) must be auto, cpu, cuda or cuda:N, got 'tpu'"
    for call in (lambda: engine_device("tpu"), lambda: resolve_device("tpu"),
                 lambda: ExtractConfig(dataset="x.txt", device="tpu")):
        with pytest.raises(UserError) as e:
            call()
        assert str(e.value) == want
    assert engine_device(" CPU ") is None and str(resolve_device("Cpu")) == "cpu"
