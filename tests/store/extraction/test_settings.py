"""Every extraction setting defined once (store/extraction/settings.py): the library, the training callback and the
command refuse a bad value with the same one line; ``ncanalyze extract``'s options are generated from the fields, one
flag each, with the dataclass's defaults, in the sections of ``--help``."""
from __future__ import annotations

import dataclasses
import re

import click
import pytest
from click.testing import CliRunner
from conftest import run_cli
from ncanalyze.cli.main import main
from ncanalyze.core.errors import UserError
from ncanalyze.store.extraction.settings import SECTIONS, ExtractConfig, extract_flag as flag_of

FIELDS = {f.name: f for f in dataclasses.fields(ExtractConfig)}
BAD = [  # (setting, value as the library takes it, as the command line gives it, the refusal)
    ("batch_size", 0, "0", "batch_size (--batch-size) must be between 1 and 65536, got 0"),
    ("samples_per_class", -1, "-1", "samples_per_class (--samples-per-class) must be between 0 and 65536, got -1"),
    ("val_split_percentage", 100, "100", "val_split_percentage (--val-split-percentage) must be between 0 and 99, "
                                         "got 100"),
    ("dtype", "int8", "int8", "dtype (--dtype) must be one of float32, bfloat16, float16, float64, got 'int8'"),
    ("layers", ",", ",", "layers (--layers) names no layer: pass last, all, or indices like 0,-1, got ','"),
    ("layers_per_pass", "0", "0",
     "layers_per_pass (--layers-per-pass) must be auto or an integer from 1 to 4096, got '0'"),
    ("state_memory", "12 parsecs", "12 parsecs", "state_memory (--state-memory) is not a size: pass a number of bytes, "
                                                 "or a number and a unit: kB, MB, GB, TB (powers of 1000) or KiB, MiB, "
                                                 "GiB, TiB (powers of 1024), in any case but a lowercase b (bits: 3Mb is "
                                                 "refused), e.g. 40GB, 512MiB, 1e9, got '12 parsecs'"),
    ("block_size", 1, "1", "block_size (--block-size) must be between 2 and 1048576, got 1"),
    ("min_count", 0, "0", f"min_count (--min-count) must be between 1 and {2**53}, got 0"),
]


@pytest.mark.parametrize("name, value, text, message", BAD)
def test_the_library_and_the_command_refuse_alike(name, value, text, message, tmp_path):
    with pytest.raises(UserError) as e:
        ExtractConfig(dataset="d.txt", **{name: value})
    assert str(e.value) == message
    r = run_cli("extract", tmp_path, "--dataset", "d.txt", flag_of(name), text, "--store", tmp_path / "s.zarr",
                ok=False)
    assert r.exit_code == 1 and r.output.strip() == f"Error: {message}", r.output
    assert not (tmp_path / "s.zarr").exists()


def test_types_are_checked_and_values_kept():
    with pytest.raises(UserError, match=r"^batch_size \(--batch-size\) must be an int, got '8'$"):
        ExtractConfig(dataset="d", batch_size="8")
    with pytest.raises(UserError, match=r"^allow_pickle \(--allow-pickle\) must be a bool, got 1$"):
        ExtractConfig(dataset="d", allow_pickle=1)
    cfg = ExtractConfig(dataset="d", layers_per_pass="3", state_memory="40GB", max_val_tokens=0)
    assert cfg.layers_per_pass == 3 and cfg.state_memory == "40GB" and cfg.max_val_tokens == 0
    assert ExtractConfig(dataset="d", layers_per_pass=None).layers_per_pass == "auto"  # None is auto, as before
    assert ExtractConfig(dataset="d") == ExtractConfig(**{n: f.default for n, f in FIELDS.items() if n != "dataset"},
                                                       dataset="d")


def _extract() -> click.Command:
    return main.commands["extract"]


def test_every_setting_has_exactly_one_flag_with_the_dataclass_default():
    command, ctx = _extract(), click.Context(_extract())
    by_name = {}
    for p in command.params:
        by_name.setdefault(p.name, []).append(p)
    for name, f in FIELDS.items():
        assert len(by_name.get(name, [])) == 1, name
        p = by_name[name][0]
        assert p.opts[0] == flag_of(name) and p.help == f.metadata["help"], name
        default = None if f.default is dataclasses.MISSING else f.default
        assert p.default == default, name
        shown = p.get_help_record(ctx)[1]
        if isinstance(default, bool):
            assert (f"[default: {flag_of(name)[2:]}" in shown) == default, (name, shown)
        elif default is not None:
            assert re.search(rf"\[default: {re.escape(str(default))}[;\]]", shown), (name, shown)
        else:
            assert "[default: " not in shown.split(f.metadata["help"])[-1], (name, shown)
    # the other options are the command's own (where it goes, what it starts from), none a setting
    others = {p.name for p in command.params} - set(FIELDS)
    assert others - {"help"} == {"paths", "store", "overwrite", "restart", "revisions", "revision_ranges",
                                 "delete_downloads", "scheduler", "shards"}


def test_help_prints_sections_with_every_setting_in_its_own():
    out = CliRunner().invoke(main, ["extract", "--help"], terminal_width=200).output
    titles = [line[:-1] for line in out.splitlines() if re.fullmatch(r"[A-Z][a-z ]+:", line)]
    assert titles[:len(SECTIONS)] == list(SECTIONS), titles
    section, where = None, {}
    for line in out.splitlines():
        if re.fullmatch(r"[A-Z][a-z ]+:", line):
            section = line[:-1]
        for flag in re.findall(r"^\s+(--[a-z-]+)", line):
            where[flag] = section
    for name, f in FIELDS.items():
        assert where[flag_of(name)] == f.metadata["section"], name
    assert where["--revision"] == "Hub" and where["--scheduler"] == where["--shards"] == "Cluster"
    assert where["--store"] == where["--overwrite"] == where["--restart"] == "Run control"
