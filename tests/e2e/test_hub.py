"""Hub models by revision, without network: a Hugging Face cache built on disk in huggingface_hub's layout
(refs/<revision> -> commit, snapshots/<commit>/<file> -> ../../blobs/<sha256>) holding the Trainer run's checkpoints
at revisions step20, step40, step60; the CLI runs offline on it: in a subprocess with HF_HUB_OFFLINE=1 and
HF_HUB_CACHE pointing at it (huggingface_hub reads both at import), or in this process with huggingface_hub's
constants set as those variables set them (:func:`cli`)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import traceback
from pathlib import Path

import ncanalyze.store
import numpy as np
import pytest
from conftest import CLI, EXTRACT_OPTS
from ncanalyze.core.errors import UserError
from ncanalyze.store.sources.hub_fetch import Snapshot
from ncanalyze.store.sources.revisions import parse_revisions, step_of

REPO = "test-org/neo-2x32"
FILES = ("config.json", "generation_config.json", "model.safetensors")  # what a Hub repo of the model holds
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def add_revision(cache: Path, repo: str, revision: str, files: dict[str, Path]) -> Path:
    """One revision in the cache: content-addressed blobs, a snapshot folder of symlinks, and its ref."""
    root = cache / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for name, src in files.items():
        data = src.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    (root / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)  # a branch like feature/x nests
    (root / "refs" / revision).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def hub_cache(trained_run, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    for step in (20, 40, 60):
        files = {f: trained_run / f"checkpoint-{step}" / f for f in FILES} | {f: trained_run / f for f in TOKENIZER}
        add_revision(cache, REPO, f"step{step}", files)
    return cache


def cli(*args, cache: Path, home: Path, process: bool = False) -> subprocess.CompletedProcess:
    """The CLI offline on the cache ``cache`` (HF_HUB_OFFLINE=1, HF_HUB_CACHE, HF_HOME): with ``process``, in a
    subprocess given those variables, as a user runs it; else in this process, huggingface_hub's constants set to
    what those variables give at its import (a process and its torch import, ~3 s, saved a call), and an exception other
    than the CLI's own exit written to stderr as its traceback, as a process would."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    argv = [str(a) for a in args]
    if process:
        return subprocess.run(CLI + argv, env=os.environ | env, capture_output=True, text=True, timeout=600)
    from click.testing import CliRunner
    from huggingface_hub import constants
    from ncanalyze.cli.main import main

    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        for name, value in {"HF_HUB_OFFLINE": True, "HF_HUB_CACHE": str(cache), "HF_HOME": str(home),
                            "HF_TOKEN_PATH": str(home / "token"),
                            "HF_STORED_TOKENS_PATH": str(home / "stored_tokens")}.items():
            mp.setattr(constants, name, value)
        r = CliRunner().invoke(main, argv)
    stderr = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        stderr += "Traceback (most recent call last):\n" + "".join(traceback.format_exception(r.exception))
    return subprocess.CompletedProcess(argv, r.exit_code, r.stdout, stderr)


@pytest.mark.slow
def test_revisions_from_the_cache_equal_the_local_checkpoints(hub_cache, extracted_store, corpus, tmp_path):
    store = tmp_path / "hub.zarr"
    before = sorted(p.name for p in hub_cache.rglob("*"))
    r = cli("extract", REPO, "--revisions", "step20:60:20", "--revision", "step80", "--delete-downloads",
            "--dataset", corpus["train"], "--val-dataset", corpus["val"], "--store", store, *EXTRACT_OPTS,
            cache=hub_cache, home=tmp_path / "home", process=True)  # the variables themselves, read at import
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    missing = [line for line in r.stderr.splitlines() if "step80" in line]
    assert len(missing) == 2 and "not in the Hugging Face cache" in missing[0], r.stderr  # its line + the summary
    assert "1 checkpoint(s) or revision(s) failed" in missing[1] and "3 extracted" in r.stdout
    # the cached snapshots were not downloaded by this run: --delete-downloads leaves them
    assert sorted(p.name for p in hub_cache.rglob("*")) == before

    tree = ncanalyze.store.open(store)
    assert sorted(tree["neo-2x32"].children) == ["step20", "step40", "step60"]
    local = ncanalyze.store.open(extracted_store)
    for step in (20, 40, 60):
        ds, ref = tree[f"neo-2x32/step{step}"].to_dataset(), local[f"neo-2x32/checkpoint-{step}"].to_dataset()
        assert ds.attrs["global_step"] == step and ds.attrs["hub_revision"] == f"step{step}"
        assert ds.attrs["hub_repo"] == REPO and ds.attrs["tokenizer"].startswith(str(hub_cache))
        assert set(ds.data_vars) == set(ref.data_vars)
        for name in ref.data_vars:
            np.testing.assert_array_equal(ds[name].values, ref[name].values, err_msg=name)
        assert (ds["token"].values == ref["token"].values).all()
        assert ds.attrs["val_loss"] == ref.attrs["val_loss"]

    # a re-run skips what is done; a revision file works as well
    revs = tmp_path / "revs.txt"
    revs.write_text("# the suite\nstep20\n\nstep60\n")
    r = cli("extract", REPO, "--revisions", f"@{revs}", "--dataset", corpus["train"], "--val-dataset", corpus["val"],
            "--store", store, *EXTRACT_OPTS, cache=hub_cache, home=tmp_path / "home")
    assert r.returncode == 0 and "2 already in" in r.stdout, r.stdout + r.stderr

    # a snapshot deleted since (as --delete-downloads does): still skipped, offline, without fetching it
    root = hub_cache / "models--test-org--neo-2x32"
    commit = (root / "refs" / "step20").read_text()
    shutil.copytree(root / "snapshots" / commit, tmp_path / "backup", symlinks=True)
    shutil.rmtree(root / "snapshots" / commit)
    try:
        args = ("extract", REPO, "--revision", "step20", "--dataset", corpus["train"], "--val-dataset", corpus["val"],
                "--store", store)
        r = cli(*args, *EXTRACT_OPTS, cache=hub_cache, home=tmp_path / "home")
        assert r.returncode == 0 and "1 already in" in r.stdout, r.stdout + r.stderr
        r = cli(*args, *EXTRACT_OPTS[:-1], 3, cache=hub_cache, home=tmp_path / "home")  # other settings: fetched
        assert r.returncode == 1 and "neo-2x32@step20: not in the Hugging Face cache" in r.stderr, r.stderr
    finally:  # the module's cache as it was
        shutil.copytree(tmp_path / "backup", root / "snapshots" / commit, symlinks=True)


@pytest.mark.slow
def test_a_pickle_only_revision_is_refused_unless_allowed(trained_run, corpus, tmp_path):
    import torch
    from safetensors.torch import load_file

    cache = tmp_path / "hub"
    ck = trained_run / "checkpoint-20"
    torch.save(load_file(ck / "model.safetensors"), tmp_path / "pytorch_model.bin")
    files = {"config.json": ck / "config.json", "pytorch_model.bin": tmp_path / "pytorch_model.bin"}
    add_revision(cache, REPO, "step20", files | {f: trained_run / f for f in TOKENIZER})
    args = ("extract", REPO, "--revision", "step20", "--dataset", corpus["train"], "--val-dataset", corpus["val"],
            "--store", tmp_path / "s.zarr", "--max-train-tokens", 512, "--max-val-tokens", 256)
    r = cli(*args, cache=cache, home=tmp_path / "home")
    assert r.returncode == 1 and "--allow-pickle" in r.stderr and "Traceback" not in r.stderr
    r = cli(*args, "--allow-pickle", cache=cache, home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    assert ncanalyze.store.open(tmp_path / "s.zarr")["neo-2x32/step20"]["count"].sum() == 16 * 31


def test_deleting_a_downloaded_snapshot_keeps_the_other_revisions(trained_run, tmp_path):
    """What --delete-downloads does to a snapshot this run downloaded: gone, with its blobs, while the blobs other
    revisions share stay."""
    cache = tmp_path / "hub"
    snaps = {s: add_revision(cache, REPO, f"step{s}", {f: trained_run / f"checkpoint-{s}" / f for f in FILES}
                             | {f: trained_run / f for f in TOKENIZER}) for s in (20, 40)}
    Snapshot(REPO, "step20", snaps[20], downloaded=True).delete()
    assert not snaps[20].exists()
    for f in FILES + TOKENIZER:  # tokenizer blobs are shared with step40: it still reads
        assert (snaps[40] / f).read_bytes() == ((trained_run / "checkpoint-40" / f) if f in FILES
                                                else trained_run / f).read_bytes()


def test_revision_lists_and_steps(tmp_path):
    assert parse_revisions(["main"], ["step1000:3000:1000"]) == ["main", "step1000", "step2000", "step3000"]
    assert parse_revisions([], ["step0:step4:2", "step2:2"]) == ["step0", "step2", "step4"]
    assert parse_revisions([], []) == ["main"]
    (tmp_path / "r.txt").write_text("a\n b \n#c\nstep5 # five\n")
    assert parse_revisions([], [f"@{tmp_path / 'r.txt'}"]) == ["a", "b", "step5"]
    for bad in ("step5:1", "1:2:0", "nonsense", f"@{tmp_path / 'none.txt'}"):
        with pytest.raises(UserError, match="--revisions"):
            parse_revisions([], [bad])
    assert [step_of(r) for r in ("step1000", "step1000-tokens4B", "checkpoint-500", "main", "v1.2", "a" * 40)] == \
        [1000, 1000, 500, None, None, None]


@pytest.mark.slow
def test_a_missing_relative_path_that_is_no_hub_model_says_so(corpus, tmp_path):
    r = cli("extract", "no-such-run", "--dataset", corpus["train"], "--store", tmp_path / "s.zarr",
            cache=tmp_path / "hub", home=tmp_path / "home")
    assert r.returncode == 1 and "no-such-run@main" in r.stderr and "Traceback" not in r.stderr
    shutil.rmtree(tmp_path / "home", ignore_errors=True)
