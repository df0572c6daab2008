"""Session fixtures: a synthetic corpus, a BPE tokenizer and real GPT-Neo checkpoints trained by the Trainer."""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The test models are tiny: one thread per process beats two spinning ones, and keeps the suite steady when the
# two cores are shared (subprocesses and dask workers inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite starts Python over a hundred times (the commands, the recipe, cluster workers, DDP ranks): each compiles
# ncanalyze's modules again under PYTHONDONTWRITEBYTECODE (~1 s a process), and pytest rewrites every test module's
# asserts again. So the suite writes its bytecode (into the gitignored __pycache__ folders) whatever the shell says.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The CLI in a process (cli_process.py: forked from a server that imported its libraries, or a new Python), for the
# tests; imported after the settings above, which the server's environment then holds.
from cli_process import NEW_PYTHON as CLI  # noqa: F401
from cli_process import cli_process, cli_run, forked_workers  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


SLOW_SECONDS = 2.0  # a test whose own call takes longer belongs out of the inner loop: @pytest.mark.slow on it


def pytest_collection_finish(session) -> None:
    """Load the libraries the tests use, collect once and freeze what lives (gc.freeze): their ~800,000 objects leave
    the collector's full passes, which walked them some 60 times a worker (about 25 s a worker, 0.4 s a pass); and
    collect the youngest generation every 10,000 allocations, not 700 (Python 3.12's default is 2,000), so the
    passes come less often over the tests' churn of small objects."""
    for name in ("torch", "transformers", "matplotlib.pyplot", "xarray", "dask.array", "zarr", "pandas"):
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])


# the modules whose tests take longest, each with its own processes (the recipe, Ctrl-C, DDP, SIGKILL): run first,
# so that the two workers end together on short tests instead of one waiting on a long one
FIRST = ("e2e/test_examples.py", "e2e/test_trust_hub.py", "e2e/test_trust_training.py", "e2e/test_kill_resume.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    """Move :data:`FIRST`'s modules to the front, whole (their module fixtures set up once), in their order."""
    rank = {name: i for i, name in enumerate(FIRST)}
    key = lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(FIRST))  # noqa: E731
    items[:] = sorted(items, key=key)  # stable: every other test keeps its place


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Name the tests that ran over :data:`SLOW_SECONDS` (their call alone: a shared session fixture is paid once,
    by whichever test asks first) without the ``slow`` marker, so the inner loop ``pytest -m "not slow"`` stays fast.
    A note, not a failure: times on shared cores vary."""
    slow = sorted((r.duration, r.nodeid) for r in terminalreporter.stats.get("passed", [])
                  if r.when == "call" and r.duration > SLOW_SECONDS and "slow" not in r.keywords)
    if slow:
        terminalreporter.section("tests over 2 s not marked slow")
        for duration, nodeid in reversed(slow):
            terminalreporter.write_line(f"{duration:6.1f} s  {nodeid}")


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


train_sweep = _load_example("train_sweep")

NOUNS = "cat dog bird girl boy king queen tree house river ship star sun moon horse fox".split()
ADJS = "small big red old young happy dark bright quiet swift".split()
VERBS = "sees likes finds follows helps calls watches meets loves hears".split()


def make_corpus(path: Path, n_lines: int, seed: int) -> Path:
    """A toy language with structure a small model can learn: 'the ADJ NOUN VERB the ADJ NOUN .'"""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n_lines):
            words = ["the", rng.choice(ADJS), rng.choice(NOUNS), rng.choice(VERBS), "the", rng.choice(ADJS),
                     rng.choice(NOUNS)]
            if rng.random() < 0.3:
                words += ["and", rng.choice(VERBS), "a", rng.choice(NOUNS)]
            f.write(" ".join(words) + " .\n")
    return path


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder ``name`` that ``build(folder)`` fills, built once per test session: under xdist the workers share
    it (the first to ask builds it into a folder of its own, renamed into place under a file lock; the others wait
    for it, then read it), so read-only fixtures are not built again by every worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent  # this session's, shared by its workers
    folder = root / f"shared-{name}"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not folder.is_dir():
            partial = root / f"shared-{name}.{worker}"
            shutil.rmtree(partial, ignore_errors=True)
            build(partial)
            partial.rename(folder)
    return folder


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    """A train and a validation text and a 300-token BPE trained on the train text (read-only: shared by the
    workers)."""
    def build(d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        make_corpus(d / "train.txt", 6000, seed=1)
        make_corpus(d / "validation.txt", 600, seed=2)
        train_sweep.train_tokenizer([d / "train.txt"], vocab_size=300, out_dir=d / "tokenizer")

    d = built_once(tmp_path_factory, "corpus", build)
    return {"dir": d, "train": d / "train.txt", "val": d / "validation.txt", "tokenizer": d / "tokenizer"}


@pytest.fixture(scope="session")
def trained_run(corpus, tmp_path_factory) -> Path:
    """A Trainer output folder with checkpoint-20, checkpoint-40, checkpoint-60 and the final model (read-only:
    shared by the workers)."""
    def build(runs: Path) -> None:
        train_sweep.train([corpus["train"]], [corpus["val"]], corpus["tokenizer"], runs / "neo-2x32", n_layer=2,
                          width=32, n_head=4, block_size=32, batch_size=8, max_steps=60, save_steps=20, seed=0)

    return built_once(tmp_path_factory, "runs", build) / "neo-2x32"


def run_cli(*args: str, ok: bool = True):
    """Run the ``ncanalyze`` CLI in-process; with ``ok`` assert it succeeded, else that it failed cleanly. A report
    draws its figures as PNG only unless the test passes ``--formats``: the PDF and SVG are matplotlib's savefig of
    the same figure (test_figures.py tests them), and they were a fifth of the suite's report time."""
    from click.testing import CliRunner
    from ncanalyze.cli.main import main

    if args[:1] == ("report",) and "--formats" not in args and "--help" not in args:
        args = ("report", "--formats", "png", *args[1:])
    result = CliRunner().invoke(main, [str(a) for a in args])
    if ok:
        assert result.exit_code == 0, result.output + repr(result.exception)
    else:
        assert result.exit_code != 0, result.output
        assert isinstance(result.exception, SystemExit), f"traceback instead of a clean error: {result.exception!r}"
        assert "Traceback" not in result.output
    return result


# the variables a store holds exactly whatever the order its statistics were merged in (shards, a cluster)
EXACT = ("count", "val_count", "val_correct", "val_ncc_agree", "samples", "n_samples", "sample_position",
         "classifier", "classifier_bias")
EXTRACT_OPTS = ("--max-train-tokens", 8192, "--max-val-tokens", 4096, "--batch-size", 8, "--samples-per-class", 4)


@pytest.fixture(scope="session")
def extracted_store(trained_run, corpus, tmp_path_factory) -> Path:
    """The store of ``ncanalyze extract`` over every checkpoint of ``trained_run`` (validation.txt found beside)."""
    store = tmp_path_factory.mktemp("stores") / "study.zarr"
    run_cli("extract", trained_run, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS)
    return store


@pytest.fixture(scope="session")
def kept_store(trained_run, corpus, tmp_path_factory) -> Path:
    """A store with one finished checkpoint, which no failing command may change (see :func:`fails_cleanly`)."""
    store = tmp_path_factory.mktemp("kept") / "kept.zarr"
    run_cli("extract", trained_run / "checkpoint-20", "--dataset", corpus["train"], "--store", store,
            "--max-train-tokens", 1024, "--max-val-tokens", 512, "--samples-per-class", 1)
    return store


def fails_cleanly(args, store: Path, words) -> str:
    """Run the CLI with ``args --store store``: it must fail with one ``Error:`` line holding every one of ``words``,
    leave every group of ``store`` identical and no resume state beside it. Returns the error line."""
    import ncanalyze.store

    before = ncanalyze.store.open(store).to_dict()
    r = run_cli(*args, "--store", store, ok=False)
    error = [line.split("Error:", 1)[1] for line in r.output.splitlines() if "Error:" in line]
    assert len(error) == 1 and all(str(w) in error[0] for w in words), r.output
    after = ncanalyze.store.open(store).to_dict()
    assert list(after) == list(before)
    for g, node in before.items():
        assert node.identical(after[g]), g
    assert not store.with_name(store.name + ".partial").exists()
    return error[0]


def assert_same_group(a: Path, b: Path, group: str) -> None:
    """``group`` of stores ``a`` and ``b`` (a layer group with its checkpoint's classifier): the same variables, bit
    for bit, and the same attributes."""
    import numpy as np
    from ncanalyze.store.io import read_group

    da, db = (read_group(s, group) for s in (a, b))
    assert set(da.variables) == set(db.variables)
    for name in da.variables:  # the classifier, stored once per checkpoint, is a coordinate
        np.testing.assert_array_equal(da[name].values, db[name].values, err_msg=name)  # bit for bit
    assert dict(da.attrs) == dict(db.attrs)


def lone_model(trained_run: Path, dest: Path) -> Path:
    """A copy of ``trained_run``'s last checkpoint at ``dest``, with the run's tokenizer beside its weights."""
    shutil.copytree(trained_run / "checkpoint-60", dest)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained_run / f, dest / f)
    return dest




@contextlib.contextmanager
def listening(caplog, name: str, level: str = "INFO"):
    """caplog hears the logger ``name`` at ``level`` whatever ran before in this process (the CLI's logging set-up
    may have stopped the ``ncanalyze`` logger's propagation to the root, where caplog listens)."""
    import logging

    logger = logging.getLogger(name)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(level, logger=name):
            yield
    finally:
        logger.removeHandler(caplog.handler)


@contextlib.contextmanager
def lock_held(store: Path, group: str, doing: str = "extracted", seconds: float = 120):
    """``group``'s checkpoint lock held for the block by a thread of this process, as another process's extraction
    (or measure, ``doing="measured"``) holds it; released when the block ends, or after ``seconds`` at the latest so
    that a failing test never hangs the suite."""
    import threading

    from ncanalyze.store.inventory import files_of
    from ncanalyze.store.lock import checkpoint_lock

    held, release = threading.Event(), threading.Event()

    def hold():
        with checkpoint_lock(files_of(store, group).lock, group, doing=doing):
            held.set()
            release.wait(seconds)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(10), f"the test could not take the lock of {group}"
        yield
    finally:
        release.set()
        t.join()


def kill_when(args, state: Path, batches: int = 5, at: dict[str, int] | None = None) -> None:
    """Run the CLI with ``args`` in a process and SIGKILL it once its resume state ``state`` holds ``batches`` batches
    and the values ``at`` (e.g. {"phase": 1}): a real crash at a known point."""
    import numpy as np

    proc = cli_process(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with np.load(state) as s:
                if int(s["batches"]) >= batches and all(int(s[k]) == v for k, v in (at or {}).items()):
                    break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.kill()
    proc.wait()


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A real small (or read-only) file system mounted at ``path`` for the test; skips where mounting needs root."""
    path.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)])


CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000")


def headless_chromium(profile: Path):
    """Headless Chromium (Debian's, as .ci/run installs it) with its console and network logs, a profile of its own;
    the test skips, saying how to install it, where it is missing."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("headless Chromium is not installed (/usr/bin/chromium, /usr/bin/chromedriver): "
                    "apt-get install -y chromium chromium-driver, as .ci/run does")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
