"""Local paths first (issue 20): a PATH, --dataset, --val-dataset or --tokenizer that looks local and is not there is
one line, "no such file or folder: X", at once and before any Hub call (offline or not); no failed command leaves a
store or its folder of work in progress behind."""
from __future__ import annotations

import time

import pytest
from conftest import lone_model, run_cli
from ncanalyze.store.sources.discover import looks_local


@pytest.fixture(scope="module")
def model(trained_run, tmp_path_factory):
    return lone_model(trained_run, tmp_path_factory.mktemp("local") / "runs" / "model")


def assert_nothing_made(tmp_path) -> None:
    assert not (tmp_path / "s.zarr").exists() and not (tmp_path / "s.zarr.partial").exists()
    assert not (tmp_path / "s.zarr.tokens").exists()


def refused(args, missing: str, tmp_path) -> None:
    """The command fails in one line naming ``missing``, in under 5 s, and makes nothing."""
    start = time.monotonic()
    r = run_cli(*args, "--store", tmp_path / "s.zarr", ok=False)
    took = time.monotonic() - start
    lines = [x for x in r.output.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and f"no such file or folder: {missing}" in lines[0], r.output
    assert "cache" not in lines[0] and "reachable" not in lines[0], lines[0]  # never the Hub-cache message
    assert took < 5, f"{took:.1f} s: it went somewhere before refusing"
    assert_nothing_made(tmp_path)


@pytest.fixture(params=["offline", "online"])
def hub_mode(request, monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1, and unset (a Hub call would then retry over the network for many seconds); the Hugging Face
    cache in the test's own folder, so no cached answer can hide a call."""
    if request.param == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.chdir(tmp_path)
    return request.param


def test_a_missing_run_folder_is_one_line(hub_mode, model, corpus, tmp_path):
    (tmp_path / "runs").mkdir()  # `runs/nope` beside a runs/ folder: a typo, not the Hub model runs/nope
    refused(("extract", "runs/nope", "--dataset", corpus["train"]), "runs/nope", tmp_path)
    refused(("extract", "./nope", "--dataset", corpus["train"]), "./nope", tmp_path)


@pytest.mark.parametrize("flag, value", [("--dataset", "data/nonexist.txt"), ("--val-dataset", "data/val.bin"),
                                         ("--tokenizer", "./tok"), ("--dataset", "data/a/b")])
def test_a_missing_data_or_tokenizer_is_one_line(hub_mode, flag, value, model, corpus, tmp_path):
    args = ["extract", model, "--dataset", corpus["train"]]
    args = [*args[:2], flag, value] if flag == "--dataset" else [*args, flag, value]
    refused(args, value, tmp_path)


def test_a_failure_after_the_lock_leaves_no_store(model, corpus, tmp_path):
    """A command that fails once a checkpoint's lock is taken (here: no such text column) creates no store: it is
    made with its first checkpoint."""
    r = run_cli("extract", model, "--dataset", corpus["train"], "--text-column", "story", "--store",
                tmp_path / "s.zarr", ok=False)
    assert "no column 'story'" in r.output
    assert_nothing_made(tmp_path)
    run_cli("extract", model, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", "--max-train-tokens", 512,
            "--max-val-tokens", 256, "--samples-per-class", 0)
    assert (tmp_path / "s.zarr" / "zarr.json").is_file() and (tmp_path / "s.zarr" / "model" / "final").is_dir()
    assert not (tmp_path / "s.zarr.partial").exists()


def test_what_looks_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    local = ["runs/nope", "./x", "../x", "/abs/x", "~/x", "a/b/c", "data/x.txt", "x.npy", "x.bin", "y.parquet"]
    hub = ["gpt2", "EleutherAI/pythia-70m", "Qwen/Qwen2.5-0.5B", "roneneldan/TinyStories", "nope", "org/nope"]
    assert [s for s in local if not looks_local(s)] == [] and [s for s in hub if looks_local(s)] == []


def test_the_data_code_says_it_without_the_cli(tmp_path, monkeypatch):
    """open_blocks itself never sends a local-looking path to the Hub."""
    from ncanalyze.core.errors import UserError
    from ncanalyze.store.data.blocks import open_blocks

    monkeypatch.chdir(tmp_path)
    for spec in ("data/nonexist.txt", "data/nope.npy", "./folder"):
        start = time.monotonic()
        with pytest.raises(UserError, match=f"no such file or folder: {spec}"):
            list(open_blocks(spec, "train", 8, None, "text", lambda t: [[1] * 9 for _ in t]).batches(1))
        assert time.monotonic() - start < 5
