"""The store's layout: every path beside a store in one place (store/layout.py), one default store honoured by the
CLI and by ``ncanalyze.store.open()``, one decision of a checkpoint's status, one result type of every extraction,
a light ``import ncanalyze.store``, and no import cycle in the package."""
from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import ncanalyze.store
import numpy as np
import pytest
from conftest import EXTRACT_OPTS, ROOT, run_cli
from ncanalyze.core.errors import UserError
from ncanalyze.store.extraction.checkpoint import Outcome
from ncanalyze.store.extraction.config import config_hash, refusal
from ncanalyze.store.extraction.resume import Phase, save_state
from ncanalyze.store.layout import DEFAULT_STORE, StoreLayout, default_store
from ncanalyze.store.runs.local import ExtractResult
from ncanalyze.store.sources.discover import Checkpoint
from ncanalyze.store.store import Status, decide

PACKAGES = {"analyzer": "ncanalyze.analyzer", "store": "ncanalyze.store", "cli": "ncanalyze.cli"}


def modules(package: str) -> dict[str, Path]:
    """Every module of ``ncanalyze.<package>`` (subpackages included), by dotted name."""
    root = ROOT / package
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        out[".".join((PACKAGES[package], *parts))] = f
    return out


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports, at any depth (function-level imports count)."""
    mods = modules(package)
    graph = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}  # from ncanalyze.store import io
        graph[name] = {d for d in deps if d in mods and d != name and d != PACKAGES[package]}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a path that comes back to its start), or None."""
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> list[str] | None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m, path + [m])):
                return found
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n, [n])):
            return found
    return None


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_module_imports(package):
    for name in modules(package):
        importlib.import_module(name)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle(package):
    graph = import_graph(package)
    assert "ncanalyze.store.extraction.config" in graph or package != "store"
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_check_sees_a_cycle(tmp_path):
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    # and the graph sees a function-level import of a sibling as an edge (today none closes a cycle)
    graph = import_graph("store")
    assert "ncanalyze.store.runs.local" in graph["ncanalyze.store.runs.cluster"]  # imported inside extract_on_cluster
    assert "ncanalyze.store.io" in graph["ncanalyze.store.store"]       # from ncanalyze.store import io


def test_importing_the_package_is_light(tmp_path):
    """``import ncanalyze.store`` (and the CLI's default store) load no zarr, xarray, torch or transformers;
    ``ncanalyze.store.open`` is resolved on first use."""
    code = ("import sys, ncanalyze.store, ncanalyze.store.layout\n"
            "heavy = [m for m in ('zarr', 'xarray', 'torch', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "ncanalyze.store.open\n"
            "assert 'xarray' in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_every_path_beside_the_store(tmp_path):
    layout = StoreLayout(tmp_path / "s.zarr")
    files = layout.checkpoint(Checkpoint("run@kjv", "v1.0", tmp_path, tmp_path))
    partial = tmp_path / "s.zarr.partial"
    assert layout.partial == partial and layout.tokens == tmp_path / "s.zarr.tokens"
    assert files.state == partial / "run@kjv" / "v1.0.npz"  # a dotted checkpoint name keeps its dot
    assert files.lock == partial / "run@kjv" / "v1.0.lock"
    assert files.staging == partial / "run@kjv" / "v1.0.zarr"
    assert files.old == partial / "run@kjv" / "v1.0.zarr.old"
    assert files.layers == partial / "run@kjv" / "v1.0.layers"
    assert StoreLayout(str(tmp_path / "s.zarr")) == layout


SUFFIXES = (".partial", ".tokens", ".lock", ".npz", ".zarr", ".zarr.old", ".old", ".layers")


def spellings(path: Path) -> list[str]:
    """The strings in ``path`` that spell a path beside a store: a suffix of the layout (``with_suffix(".lock")``,
    ``name + ".partial"``) or a checkpoint's file named after it (``f"{ckpt.name}.npz"``)."""
    found, tree = [], ast.parse(path.read_text())
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            if any(text == "{}" + s for s in SUFFIXES):
                found.append(text)
        elif isinstance(node, ast.Constant) and node.value in SUFFIXES and id(node) not in parts:
            found.append(node.value)
    return found


def test_paths_are_spelled_only_in_the_layout(tmp_path):
    spelled = {f.name: spellings(f) for f in (ROOT / "store").glob("*.py") if f.name != "layout.py" and spellings(f)}
    assert not spelled, spelled
    f = tmp_path / "old.py"  # the spellings of before the layout are seen
    f.write_text('p = s.with_name(s.name + ".partial") / run / f"{name}.npz"\nq = p.with_suffix(".lock")\n'
                 'ok = folder / f"layer-{l}.npz"\n')
    assert sorted(spellings(f)) == [".lock", ".partial", "{}.npz"]
    assert len(spellings(ROOT / "store" / "layout.py")) >= 5


def test_one_default_store(tmp_path, monkeypatch, extracted_store):
    monkeypatch.delenv("NCANALYZE_STORE", raising=False)
    assert default_store() == DEFAULT_STORE == "ncanalyze.zarr"
    monkeypatch.chdir(tmp_path)  # no store here: open() names the default it looked for
    with pytest.raises(UserError, match="no ncanalyze store at ncanalyze.zarr"):
        ncanalyze.store.open()
    monkeypatch.setenv("NCANALYZE_STORE", str(extracted_store))
    assert default_store() == str(extracted_store)
    tree, direct = ncanalyze.store.open(), ncanalyze.store.open(extracted_store)
    assert sorted(tree.groups) == sorted(direct.groups) and len(tree.groups) > 2
    run, ckpt = next((r, c) for r in direct.children for c in direct[r].children)
    np.testing.assert_array_equal(tree[f"{run}/{ckpt}"]["count"].values, direct[f"{run}/{ckpt}"]["count"].values)


def test_one_decision_of_a_checkpoint_status(tmp_path):
    """store.decide on a configuration record's hash: skip, refuse, resume or start fresh."""
    record = {"dataset": "d.txt", "seed": 0}
    checkpoint_status = lambda existing, record, state, **kw: decide(existing, config_hash(record), state, **kw)  # noqa
    same = {"complete": True, "config_hash": config_hash(record), "config": json.dumps(record)}
    other_record = {"dataset": "e.txt", "seed": 0}
    other = {"complete": True, "config_hash": config_hash(other_record), "config": json.dumps(other_record)}
    unfinished = {"complete": False, "config_hash": config_hash(record)}
    state = tmp_path / "p" / "ck.npz"
    for has_state in (False, True):
        if has_state:
            save_state(state, {"phase": np.array(int(Phase.TRAIN))})
        expect_none = Status.RESUME if has_state else Status.FRESH
        assert checkpoint_status(None, record, state) is expect_none
        assert checkpoint_status(unfinished, record, state) is expect_none
        assert checkpoint_status(same, record, state) is Status.SKIP
        assert checkpoint_status(other, record, state) is Status.REFUSE
        assert checkpoint_status(other, record, state, overwrite=True) is expect_none
        assert checkpoint_status(same, record, state, overwrite=True) is expect_none
        assert checkpoint_status(None, record, state, restart=True) is Status.FRESH
    e = refusal("run/ck", tmp_path / "s.zarr", other, record, tag=None)
    assert "under another configuration (dataset: 'e.txt' -> 'd.txt')" in str(e) and "--tag NAME" in str(e)
    assert "--tag" not in str(refusal("run@t/ck", tmp_path / "s.zarr", other, record, tag="t"))


def test_one_result_type():
    r = ExtractResult("runs/a", "s.zarr", {"a/c1": Outcome.DONE, "a/c2": Outcome.RESUMED, "a/c3": Outcome.SKIPPED,
                                           "a/c4": Outcome.SKIPPED}, ["org/m@step9: no such revision"])
    r.add("a/c5", Outcome.FAILED, "NaN features")
    assert (r.count(Outcome.DONE), r.count(Outcome.RESUMED), r.count(Outcome.SKIPPED)) == (1, 1, 2)
    assert r.count(Outcome.FAILED) == 1 and r.why == {"a/c5": "NaN features"}
    assert r.failures == ["org/m@step9: no such revision", "a/c5 failed: NaN features"]
    assert r.summary() == "runs/a: 1 extracted, 1 resumed, 2 already in s.zarr, 2 failed"
    assert ExtractResult("x", "s.zarr", {"x/c": Outcome.DONE}).summary() == \
        "x: 1 extracted, 0 resumed, 0 already in s.zarr"
    assert str(Outcome.DONE) == "done" and f"{Outcome.SKIPPED}" == "skipped"  # as the log lines read


def test_extract_returns_the_result(trained_run, corpus, extracted_store, tmp_path):
    """The library's extract() returns the same result the command prints: a re-run over a finished store skips all."""
    from ncanalyze.store.extraction.settings import ExtractConfig
    from ncanalyze.store.runs.local import extract

    groups = sorted(g for g in ncanalyze.store.open(extracted_store).groups if g.count("/") == 2)
    cfg = ExtractConfig(dataset=str(corpus["train"]), max_train_tokens=8192, max_val_tokens=4096, batch_size=8,
                        samples_per_class=4)  # EXTRACT_OPTS
    result = extract(trained_run, extracted_store, cfg)
    assert isinstance(result, ExtractResult) and result.label == str(trained_run)
    assert sorted("/" + g for g in result.statuses) == groups and set(result.statuses.values()) == {Outcome.SKIPPED}
    r = run_cli("extract", trained_run, "--dataset", corpus["train"], "--store", extracted_store, *EXTRACT_OPTS)
    assert result.summary() in r.output
