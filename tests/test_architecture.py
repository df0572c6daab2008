"""The house rules that keep the code base legible: imports go one way (cli -> store -> analyzer -> core), every
package's docstring names its modules, the names of the store and of the metrics are defined once, no signature
writes a registry setting's default again, and every extraction setting says whether it is hashed."""
from __future__ import annotations

import ast
import dataclasses
import io
import re
import subprocess
import sys
import tokenize
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import ROOT

LAYERS = {"core": 0, "analyzer": 1, "store": 2, "cli": 3}  # a package may import only from its own layer or a lower one


def sources(package: str) -> list[Path]:
    """Every Python file of ``package`` (a top-level folder), in its subpackages too."""
    return sorted((ROOT / package).rglob("*.py"))


def imports(path: Path) -> set[str]:
    """The ncanalyze packages that ``path`` imports, at any depth of the file (function-level imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found |= {n.split(".")[1] for n in names if n.startswith("ncanalyze.") and n.count(".") >= 1}
    return found


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_go_one_way(package):
    backward = {f"{f.relative_to(ROOT)} imports ncanalyze.{dep}"
                for f in sources(package) for dep in imports(f) if LAYERS[dep] > LAYERS[package]}
    assert not backward, sorted(backward)


def test_the_check_reads_every_module_of_the_house():
    """Subpackages are read (a module moved into store/<sub>/ stays checked), and the top-level ncanalyze/ folder
    imports nothing of the store or the commands, only the accessor's registration in the analyzer."""
    found = {f.relative_to(ROOT).as_posix() for pkg in LAYERS for f in sources(pkg)}
    assert {"analyzer/accessor.py", "analyzer/table.py", "cli/options.py", "store/measure.py"} <= found
    assert imports(ROOT / "ncanalyze" / "__init__.py") <= {"analyzer"}


def test_core_imports_no_other_package_of_ours():
    """The ground floor (errors, names, the settings mechanism, the thread policy, sizes) stands on nothing of ours:
    not the analyzer, whose registry builds on it, nor anything above."""
    found = {f"{f.relative_to(ROOT)} imports ncanalyze.{dep}" for f in sources("core") for dep in imports(f)
             if dep != "core"}
    assert not found, sorted(found)
    assert {"errors.py", "names.py", "setting.py", "threads.py", "sizes.py"} <= {f.name for f in sources("core")}


def test_an_import_of_the_analyzer_from_core_is_caught(tmp_path, monkeypatch):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "setting.py").write_text("def f():\n    from ncanalyze.analyzer.schema import SCALARS\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="core/setting.py imports ncanalyze.analyzer"):
        test_core_imports_no_other_package_of_ours()


def packages(root: Path) -> list[Path]:
    """Every package folder of the house (one with an ``__init__.py``): ncanalyze/ and the layers' folders."""
    return sorted(d for top in ("ncanalyze", *LAYERS) for d in [root / top, *(root / top).rglob("*")]
                  if (d / "__init__.py").is_file())


def unnamed_modules(root: Path) -> list[str]:
    """The modules (and subpackages) of each package that its ``__init__`` docstring does not name (as a word:
    ``errors`` or ``errors.py``)."""
    found = []
    for d in packages(root):
        doc = ast.get_docstring(ast.parse((d / "__init__.py").read_text())) or ""
        members = [f.stem for f in d.glob("*.py") if f.name != "__init__.py"] + \
            [s.name for s in d.iterdir() if (s / "__init__.py").is_file()]
        found += [f"{(d / m).relative_to(root).as_posix()} is not named in its package's docstring"
                  for m in sorted(members) if not re.search(rf"(?<!\w){re.escape(m)}\b", doc)]
    return found


def test_every_package_docstring_names_its_modules():
    """A package's ``__init__`` docstring is its table of contents: every module and subpackage in it is named, so a
    module added or moved without saying where it belongs fails here."""
    assert len(packages(ROOT)) >= 10
    assert not unnamed_modules(ROOT), unnamed_modules(ROOT)


def test_the_docstring_check_sees_an_unnamed_module(tmp_path):
    """A module the docstring leaves out is named; a word that only contains its name (``resumed``,
    ``resume_point``) does not count as naming it."""
    (tmp_path / "store" / "extraction").mkdir(parents=True)
    (tmp_path / "store" / "__init__.py").write_text('"""The store (io) and the extraction above it."""\n')
    for f in ("io.py", "lock.py", "extraction/resume.py", "extraction/passes.py"):
        (tmp_path / "store" / f).write_text('"""A module."""\n')
    (tmp_path / "store" / "extraction" / "__init__.py").write_text(
        '"""The passes (.passes); work is resumed from its resume_point."""\n')
    assert unnamed_modules(tmp_path) == ["store/lock is not named in its package's docstring",
                                         "store/extraction/resume is not named in its package's docstring"]


def test_a_backward_import_in_a_subpackage_is_caught(tmp_path, monkeypatch):
    """The layering check reads store/<sub>/ too: a module there importing the commands is a backward import."""
    fake = tmp_path / "store" / "extraction"
    fake.mkdir(parents=True)
    (fake / "plan.py").write_text("from ncanalyze.cli.options import option\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="store/extraction/plan.py imports ncanalyze.cli"):
        test_imports_go_one_way("store")


def test_the_new_modules_import_down_the_layers():
    """cli -> store -> analyzer -> core, for the modules of the second floor: the commands' options import nothing below
    click, the table and the accessor only the analyzer, and the store builds its table from the analyzer's."""
    assert imports(ROOT / "cli" / "options.py") <= {"core", "analyzer"}  # the light settings registry only
    assert imports(ROOT / "analyzer" / "table.py") <= {"core", "analyzer"}
    assert imports(ROOT / "analyzer" / "accessor.py") <= {"core", "analyzer"}
    assert "analyzer" in imports(ROOT / "store" / "measure.py")


STORE_FLOORS = {"": 0, "sources": 1, "data": 2, "extraction": 3, "runs": 4}  # store/ itself, then the pipeline


def store_floor(module: str) -> int:
    """The floor of a module of ``ncanalyze.store`` (its subpackage; store/ itself is the ground floor)."""
    parts = module.split(".")
    return STORE_FLOORS.get(parts[2], 0) if len(parts) > 3 else 0


def store_imports(path: Path) -> set[str]:
    """The ``ncanalyze.store`` modules that ``path`` imports (``from ncanalyze.store.x import m`` names x.m's floor)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ncanalyze.store.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ncanalyze.store"):
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_store_floors_import_only_downwards():
    """Inside store/, each floor imports only the floors below it: store/ itself (the Zarr store and what lies beside
    it) <- sources <- data <- extraction <- runs; and every subpackage's __init__ states its rule in one docstring."""
    upward = set()
    for f in sources("store"):
        rel = f.relative_to(ROOT / "store").parts
        here = STORE_FLOORS[rel[0]] if len(rel) > 1 else 0
        for dep in store_imports(f):
            if store_floor(dep) > here:
                upward.add(f"{f.relative_to(ROOT)} imports {dep}")
    assert not upward, sorted(upward)
    for sub in STORE_FLOORS:
        if sub:
            doc = " ".join((ast.get_docstring(ast.parse((ROOT / "store" / sub / "__init__.py").read_text())) or "").split())
            assert "Imports only" in doc or "may import everything below" in doc, sub
    assert {d.name for d in (ROOT / "store").iterdir() if d.is_dir() and (d / "__init__.py").exists()} == \
        {s for s in STORE_FLOORS if s}


def test_the_floor_check_sees_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "store"
    for sub in STORE_FLOORS:
        (fake / sub).mkdir(parents=True, exist_ok=True)
        if sub:
            (fake / sub / "__init__.py").write_text('"""Imports only what is below."""\n')
    (fake / "io.py").write_text("from ncanalyze.store.runs import local\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="store/io.py imports ncanalyze.store.runs.local"):
        test_store_floors_import_only_downwards()


def test_the_import_check_sees_a_backward_import(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("def f():\n    from ncanalyze.cli.main import main\n    import ncanalyze.store.io\n")
    assert imports(f) == {"cli", "store"}


def test_zarr_is_read_and_written_only_in_store_io():
    users = sorted(str(f.relative_to(ROOT)) for pkg in LAYERS for f in sources(pkg)
                   if "import zarr" in f.read_text() or "to_zarr(" in f.read_text() or "open_zarr(" in f.read_text()
                   or "open_datatree(" in f.read_text())
    assert users == ["store/io.py"]


def test_names_are_defined_once():
    from ncanalyze.analyzer import metrics, report, schema, stats, table

    assert stats.METRICS is schema.SCALARS and report.ID_COLUMNS is schema.INFO
    assert table.COLUMNS == (*schema.INFO, schema.LAYER, schema.SITE, schema.LABELS, schema.CLASS_AXIS,
                             *schema.CLASS_COUNTS,
                             *schema.SCALARS,
                             *schema.ERRORS)
    assert list(metrics.DEFINITIONS) == list(schema.SCALARS)
    assert list(metrics.PER_CLASS_DEFINITIONS) == list(schema.PER_CLASS)
    for name, f in {**metrics.DEFINITIONS, **metrics.PER_CLASS_DEFINITIONS}.items():
        assert f.__name__ == name and f.__doc__, name


def carried_settings() -> set[str]:
    """The settings the library's functions carry: the shared ones (``SHARED``: min_count, seed, device, threads),
    measuring's (tile, se) and the report's statistics (n_perm, n_boot, estimates)."""
    from ncanalyze.analyzer.registry import MeasureSettings, ReportSettings
    from ncanalyze.core.setting import SHARED

    report = {f.name for f in dataclasses.fields(ReportSettings)} & {"n_perm", "n_boot", "estimates", "seed"}
    return set(SHARED) | {f.name for f in dataclasses.fields(MeasureSettings)} | report


def literal_defaults(root: Path, names: set[str]) -> list[str]:
    """Parameters named as a setting (``names``) whose default a signature writes as a literal (``min_count=1``,
    ``se=False``, ``device="auto"``): the registry's default written again, free to drift from it. None (not given:
    the function decides) and a name read from the registry (``se=MEASURE.se``) are not literals."""
    found = []
    for pkg in (*LAYERS, "ncanalyze"):
        for f in sorted((root / pkg).rglob("*.py")):
            for n in ast.walk(ast.parse(f.read_text())):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    a = n.args
                    positional = a.posonlyargs + a.args
                    pairs = [(x.arg, d) for x, d in zip(positional[len(positional) - len(a.defaults):], a.defaults)]
                    pairs += [(x.arg, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                elif isinstance(n, ast.ClassDef):  # a dataclass's fields are its __init__'s signature
                    pairs = [(x.target.id, x.value) for x in n.body if isinstance(x, ast.AnnAssign)
                             and isinstance(x.target, ast.Name) and x.value is not None]
                else:
                    continue
                for arg, d in pairs:
                    if arg in names and not (isinstance(d, ast.Constant) and d.value is None):
                        try:
                            ast.literal_eval(d)
                        except ValueError:
                            continue
                        found.append(f"{f.relative_to(root).as_posix()}:{n.lineno} "
                                     f"{getattr(n, 'name', 'lambda')}({arg}={ast.unparse(d)})")
    return found


def test_no_signature_writes_a_settings_default_again():
    """A library function takes a setting's default from the registry (``min_count=MEASURE.min_count``,
    ``seed=default("seed")``), never as a literal: one default per setting, the same in ``ds.nc.measure``, the
    library and the command line (``se`` was False in the library, True on the command line)."""
    assert {"min_count", "se", "seed", "device", "tile", "threads", "n_perm", "n_boot", "estimates"} <= \
        carried_settings()
    assert not literal_defaults(ROOT, carried_settings()), literal_defaults(ROOT, carried_settings())


def test_the_default_check_sees_a_literal(tmp_path):
    """The old signatures, planted: literals are named, in positional and keyword-only parameters, lambdas and a
    dataclass's fields; None and a default read from the registry pass."""
    (tmp_path / "analyzer").mkdir()
    (tmp_path / "analyzer" / "metrics.py").write_text(
        "def measure(ds, min_count=1, tile=None, device=MEASURE.device, *, se=False, seed=-1):\n    pass\n\n\n"
        "f = lambda d, n_perm=10_000: d\n\n\n@dataclass\nclass Sampled:\n    K: list\n    min_count: int = 1\n"
        "    tile: int | None = None\n")
    assert literal_defaults(tmp_path, carried_settings()) == [
        "analyzer/metrics.py:1 measure(min_count=1)", "analyzer/metrics.py:1 measure(se=False)",
        "analyzer/metrics.py:1 measure(seed=-1)", "analyzer/metrics.py:9 Sampled(min_count=1)",
        "analyzer/metrics.py:5 lambda(n_perm=10000)"]


def test_every_extraction_setting_says_whether_it_is_hashed():
    from ncanalyze.store.extraction.settings import ExtractConfig

    for f in dataclasses.fields(ExtractConfig):
        assert isinstance(f.metadata.get("hashed"), bool), f"ExtractConfig.{f.name} must declare hashed=True/False"


def test_the_record_holds_every_hashed_setting_and_its_keys_move_with_the_format():
    """The configuration record is every hashed setting plus what they resolve to, none left out at its default.
    Its keys are pinned with the store format: a new key makes every stored group's hash foreign to a resume, so it
    cannot land without a new io.FORMAT, which refuses the old stores in one line saying to extract again."""
    import torch
    from ncanalyze.store import io as store_io
    from ncanalyze.store.extraction.config import config_record, layer_plan
    from ncanalyze.store.extraction.settings import ExtractConfig

    cfg = ExtractConfig(dataset="d.txt")
    record = config_record(None, cfg, torch.device("cpu"), 32, "v.txt", "validation", layer_plan(cfg, 2),
                           weights="w")
    hashed = {f.name for f in dataclasses.fields(ExtractConfig) if f.metadata["hashed"]}
    # --labels is recorded only where it is not its default (next): the stored groups' hashes stay as they were
    assert set(record) == hashed - {"labels"} | {"val_held_out", "block_size", "device_type", "weights", "data_sha256"}
    current = config_record(None, ExtractConfig(dataset="d.txt", labels="current"), torch.device("cpu"), 32, "v.txt",
                            "validation", layer_plan(cfg, 2), weights="w")
    assert current == record | {"labels": "current"}
    assert (record["layers"], record["cap_mode"], record["val_held_out"]) == ([2], None, None)  # resolved
    assert (store_io.FORMAT, sorted(record)) == (3, [
        "batch_size", "block_size", "cap_mode", "data_sha256", "dataset", "device_type", "dtype", "embeddings_dtype",
        "folds",
        "keep_linebreaks", "layers", "layers_per_pass", "max_train_tokens", "max_val_tokens", "min_count",
        "samples_per_class", "save_embeddings", "seed", "split", "text_column", "tokenizer", "val_dataset",
        "val_held_out", "val_split", "weights"])


def slow_marks(tree: ast.Module) -> tuple[bool, dict[str, bool]]:
    """Whether a module is marked ``slow`` as a whole (``pytestmark``), and each top-level test function's mark."""
    def is_slow(node) -> bool:
        return "pytest.mark.slow" in ast.unparse(node)

    whole = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                and is_slow(n.value) for n in tree.body)
    tests = {n.name: any(is_slow(d) for d in n.decorator_list) for n in tree.body
             if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    return whole, tests


def test_slow_is_marked_on_the_tests_themselves():
    """`pytest -m "not slow"` leaves out what is marked on the tests (a decorator, or ``pytestmark`` for a whole
    file): no list of names in a conftest, no mark on anything but a test, the marker registered; a test that kills
    a process (``kill_when``) is marked. conftest's terminal summary names any unmarked test whose call took over
    2 s (times on shared cores vary, so that is a note, not this test's business)."""
    import configparser

    conftests = sorted((ROOT / "tests").rglob("conftest.py"))
    assert conftests == [ROOT / "tests" / "conftest.py"], conftests
    conftest = ast.parse(conftests[0].read_text())
    hooks = {n.name: ast.unparse(n) for n in conftest.body if isinstance(n, ast.FunctionDef)}
    assert "pytest_itemcollected" not in hooks, "mark slow tests on the tests, not in a hook"
    order = hooks.get("pytest_collection_modifyitems", "")  # it only puts the longest modules first
    assert "add_marker" not in order and "slow" not in order, "mark slow tests on the tests, not in a hook"
    marked = 0
    for f in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(f.read_text())
        whole, tests = slow_marks(tree)
        marked += whole * len(tests) + sum(tests.values())
        for node in ast.walk(tree):  # a slow mark anywhere else (a helper, a class) would mark nothing
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("test_"):
                assert not any("pytest.mark.slow" in ast.unparse(d) for d in node.decorator_list), (f, node.name)
        for node in tree.body:
            kills = any(isinstance(c, ast.Call) and getattr(c.func, "id", "") == "kill_when" for c in ast.walk(node))
            if isinstance(node, ast.FunctionDef) and node.name in tests and kills:
                assert whole or tests[node.name], f"{f.relative_to(ROOT)}::{node.name} kills a process: mark it slow"
    assert marked > 0
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert any(line.startswith("slow:") for line in cfg["tool:pytest"]["markers"].strip().splitlines())


def house_modules(root: Path) -> list[Path]:
    """Every module of the four layers (core/, analyzer/, store/, cli/), their subpackages too, but not the __init__
    files."""
    return sorted(f for pkg in LAYERS for f in (root / pkg).rglob("*.py") if f.name != "__init__.py")


def is_command(f: Path, name: str) -> bool:
    """``name`` (a module's stem or a function's name) is a click command in its own module, named as the command
    (``cli/ls.py``'s ``ls``): the commands' convention, the one place a module or function may share its name with
    one in store/ or analyzer/."""
    return (f.parent.name == "cli" and name == f.stem
            and any(d.name == f.stem and any("command" in ast.unparse(x) for x in d.decorator_list)
                    for d in ast.parse(f.read_text()).body if isinstance(d, ast.FunctionDef)))


def name_collisions(root: Path) -> list[str]:
    """Modules that share a basename, and public top-level functions or classes that share a name, across the
    house (a click command in cli/<command>.py excepted): two ``tokens.py``, two ``Plan``, two ``decide``."""
    modules, names = {}, {}
    for f in house_modules(root):
        if not is_command(f, f.stem):
            modules.setdefault(f.name, []).append(f.relative_to(root).as_posix())
        for n in ast.parse(f.read_text()).body:
            if (isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")
                    and not is_command(f, n.name)):
                names.setdefault(n.name, []).append(f.relative_to(root).as_posix())
    return ([f"modules {' and '.join(v)} share a name" for v in modules.values() if len(v) > 1]
            + [f"{k} is defined in {' and '.join(v)}" for k, v in names.items() if len(v) > 1])


def test_names_do_not_collide():
    """One name, one thing: no two modules of the house share a basename, no two public functions or classes share
    a name (the byte formatter is core/sizes.bytes_text, the only one)."""
    assert not name_collisions(ROOT), name_collisions(ROOT)


ENGINES = {"numba": "analyzer/engine_numba.py", "torch": "analyzer/engine_torch.py"}
CHOOSER = "analyzer/engines.py"
TORCH_OUTSIDE_THE_SUMS = {"analyzer/accumulate.py", "analyzer/arrays.py", CHOOSER,  # extraction, tensor input, devices
                          "analyzer/screen.py"}  # extraction's NC4 decisions (the accumulators' float32 screen)
NUMBA_OUTSIDE_THE_SUMS = {"analyzer/chan_numba.py"}  # the accumulators' CPU pass (numpy in, no torch)


def engine_breaches(root: Path) -> list[str]:
    """The engines' rooms, broken: an engine module imported by any module but the chooser (engines.py), or, in
    analyzer/, numba or torch imported outside its engine and the modules that are not the sums (torch: the
    extraction's accumulators, tensor input, the chooser's look at the devices; numba: the accumulators' CPU pass)."""
    found = []
    for f in house_modules(root) + sorted((root / "ncanalyze").rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                top, module = name.split(".")[0], name.removeprefix("ncanalyze.analyzer.").split(".")[0]
                if name.startswith("ncanalyze.analyzer.engine_") and rel != CHOOSER:
                    found.append(f"{rel} imports {name}: engines are reached through {CHOOSER}")
                elif rel.startswith("analyzer/") and top in ENGINES and rel != ENGINES[top] and rel not in (
                        TORCH_OUTSIDE_THE_SUMS if top == "torch" else NUMBA_OUTSIDE_THE_SUMS):
                    found.append(f"{rel} imports {top}: only {ENGINES[top]} does")
    return sorted(set(found))


def test_engines_live_in_their_rooms():
    """One module per engine of the pairwise and spectral sums (engine_numba.py, engine_torch.py) and one chooser
    (engines.py), as flox has: nothing else imports an engine or its library."""
    assert (ROOT / CHOOSER).exists() and all((ROOT / e).exists() for e in ENGINES.values())
    assert not engine_breaches(ROOT), engine_breaches(ROOT)


def test_the_room_rules_fail_on_the_old_layout(tmp_path):
    """The old layout, planted: two tokens.py, two Plan classes, numba beside the definitions (pairs.py), torch
    in the d x d end (moments.py), the device path imported by geometry.py. The commands' modules named as their
    command (cli/measure.py beside store/measure.py) are not collisions."""
    files = {"analyzer/report/tokens.py": "", "store/data/tokens.py": "",
             "store/extraction/layers.py": "class Plan:\n    pass\n", "store/runs/shards.py": "class Plan:\n    pass\n",
             "analyzer/pairs.py": "import numba\n", "analyzer/moments.py": "def f():\n    import torch\n",
             "analyzer/geometry.py": "from ncanalyze.analyzer.engine_torch import device_parts\n",
             "analyzer/engines.py": "from ncanalyze.analyzer.engine_numba import host_parts\n",
             "analyzer/accumulate.py": "import torch\n", "store/measure.py": "def measure_store():\n    pass\n",
             "cli/measure.py": "import click\n\n\n@click.command()\ndef measure():\n    pass\n",
             "analyzer/metrics.py": "def measure():\n    pass\n", "ncanalyze/__init__.py": ""}
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert name_collisions(tmp_path) == ["modules analyzer/report/tokens.py and store/data/tokens.py share a name",
                                         "Plan is defined in store/extraction/layers.py and store/runs/shards.py"]
    assert engine_breaches(tmp_path) == [
        "analyzer/geometry.py imports ncanalyze.analyzer.engine_torch: engines are reached through analyzer/engines.py",
        "analyzer/moments.py imports torch: only analyzer/engine_torch.py does",
        "analyzer/pairs.py imports numba: only analyzer/engine_numba.py does"]


MAX_FUNCTION_LINES = 80  # lines of code: docstrings, comments and blank lines are prose, not counted


def code_line_numbers(source: str) -> set[int]:
    """The lines of ``source`` that hold a token of code (not a comment, not blank), tokenized once per file."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    code = set()
    for t in tokenize.generate_tokens(io.StringIO(source).readline):
        if t.type not in skip:
            code.update(range(t.start[0], t.end[0] + 1))
    return code


def code_lines(code: set[int], node: ast.AST) -> int:
    """The lines of ``node`` (a function) that hold code (``code``: :func:`code_line_numbers` of its file): not its
    docstrings' (nor those of what it defines), not comments, not blank."""
    prose = set()
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            prose.update(range(body[0].lineno, body[0].end_lineno + 1))
    return len({line for line in code if node.lineno <= line <= node.end_lineno} - prose)


def concern_breaches(root: Path) -> list[str]:
    """The house's size rule, broken: a module without a first docstring line naming its concern, or a function of
    more than :data:`MAX_FUNCTION_LINES` lines of code."""
    found = []
    for pkg in (*LAYERS, "ncanalyze"):
        for f in sorted((root / pkg).rglob("*.py")):
            source = f.read_text()
            tree, code = ast.parse(source), code_line_numbers(source)
            doc = ast.get_docstring(tree) or ""
            if not doc.strip() or not doc.strip().splitlines()[0].strip():
                found.append(f"{f.relative_to(root)}: no first docstring line naming its concern")
            for n in ast.walk(tree):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = code_lines(code, n)
                    if lines > MAX_FUNCTION_LINES:
                        found.append(f"{f.relative_to(root)}:{n.lineno} {n.name}: {lines} lines of code")
    return found


def test_a_module_is_one_concern_and_functions_stay_short():
    """The rule that replaced the old line cap on modules: a module is one concern its first docstring line names;
    functions under 80 lines; count code, not prose."""
    assert not concern_breaches(ROOT), concern_breaches(ROOT)


def test_the_concern_rule_can_fail(tmp_path):
    """At the cap is allowed (the def line and 79 statements, with a docstring and comments that do not count); one
    more is named; so is a module with no docstring."""
    (tmp_path / "store").mkdir()
    prose = '    """A docstring\n\n    of several lines, not counted."""\n'
    body = "".join(f"    x{i} = {i}  # a comment\n" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "store" / "ok.py").write_text('"""At the cap."""\n\n\ndef f():\n' + prose + body)
    (tmp_path / "store" / "long.py").write_text('"""Over it."""\n\n\ndef g():\n' + prose + body + "    return 1\n")
    (tmp_path / "store" / "bare.py").write_text("x = 1\n")
    assert concern_breaches(tmp_path) == ["store/bare.py: no first docstring line naming its concern",
                                          f"store/long.py:4 g: {MAX_FUNCTION_LINES + 1} lines of code"]


def test_a_clone_named_ncanalyze_does_not_shadow_the_package(tmp_path):
    """From the folder above a clone named ``ncanalyze`` (the obvious name), Python finds the clone as a namespace
    package ``ncanalyze`` that would half-work (no accessor, no version): importing any of its subpackages (the
    Quickstart's ``import ncanalyze.store, ncanalyze.analyzer``, the CLI) is one line saying where to run from. From
    the clone itself the package is found."""
    (tmp_path / "ncanalyze").symlink_to(ROOT, target_is_directory=True)
    for code in ("import ncanalyze.store, ncanalyze.analyzer", "from ncanalyze.cli.main import main"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
            f"ImportError: 'import ncanalyze' found the source folder {tmp_path / 'ncanalyze'} (a clone named "
            "ncanalyze), not the package, because Python runs from the folder above it: run Python from another "
            "folder (the clone itself, or anywhere else)"), r.stderr
    ok = subprocess.run([sys.executable, "-c", "import ncanalyze.analyzer, ncanalyze; print(ncanalyze.__version__)"],
                        capture_output=True, text=True, cwd=tmp_path / "ncanalyze")
    assert ok.returncode == 0 and ok.stdout.strip() == version("ncanalyze"), ok.stderr
