"""Kill-and-resume identity, config guards, re-runs, and every bad input of SPEC section 7."""
from __future__ import annotations

import os

import ncanalyze.store
import numpy as np
import pytest
import torch
from conftest import (
    assert_same_group,
    fails_cleanly,
    kill_when,
    lone_model,
    run_cli,
    tmpfs,
)
from safetensors.torch import load_file, save_file


def _state(store):
    return store.with_name(store.name + ".partial")


def test_kill_and_resume_is_bit_identical(trained_run, corpus, tmp_path):
    ck = trained_run / "checkpoint-40"
    args = ["extract", ck, "--dataset", corpus["train"], "--max-train-tokens", 4096, "--max-val-tokens", 4096,
            "--batch-size", 1, "--state-every", 0]
    ref = tmp_path / "ref.zarr"
    run_cli(*args, "--store", ref)

    store = tmp_path / "killed.zarr"
    for phase in (0, 1):  # kill once in the train pass and once in the validation pass
        state = _state(store) / trained_run.name / "checkpoint-40.npz"
        kill_when([*args, "--store", store], state, at={"phase": phase})
        with np.load(state) as s:
            assert int(s["phase"]) == phase
        # the killed store still opens, and holds no half-finished group
        tree = ncanalyze.store.open(store)
        assert f"{trained_run.name}/checkpoint-40" not in tree.to_dict()

    # a resume under another configuration is refused, and loses nothing
    r = run_cli(*args[:-4], "--batch-size", 4, "--state-every", 0, "--store", store, ok=False)
    assert "another configuration" in r.output and "batch_size: 1 -> 4" in r.output and "--overwrite" in r.output
    r = run_cli(*args, "--store", store)
    assert "1 resumed" in r.output
    assert_same_group(ref, store, f"{trained_run.name}/checkpoint-40")
    assert not _state(store).exists()

    # finished: a re-run is a no-op, another config is refused unless --overwrite
    r = run_cli(*args, "--store", store)
    assert "1 already in" in r.output
    r = run_cli(*args[:-4], "--batch-size", 4, "--store", store, ok=False)
    assert "already in" in r.output and "--overwrite" in r.output
    assert_same_group(ref, store, f"{trained_run.name}/checkpoint-40")


def _nan_model(ck, tmp):
    w = load_file(ck / "model.safetensors")
    w["transformer.ln_f.weight"] = torch.full_like(w["transformer.ln_f.weight"], float("nan"))
    save_file(w, ck / "model.safetensors", metadata={"format": "pt"})
    return ck, []


def _pickle_only(ck, tmp=None):
    torch.save(load_file(ck / "model.safetensors"), ck / "pytorch_model.bin")
    (ck / "model.safetensors").unlink()
    return ck, []


def _corrupt(ck, tmp):
    (ck / "model.safetensors").write_bytes(b"\x10\x00garbage")
    return ck, []


def _no_tokenizer(ck, tmp):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ck / f).unlink()
    return ck, []


def _empty_folder(ck, tmp):
    (tmp / "empty").mkdir()
    return tmp / "empty", []


def _ids_outside_vocab(ck, tmp):
    np.save(tmp / "ids.npy", np.arange(6400) % 400)  # the model has 300 tokens
    return ck, ["--dataset", tmp / "ids.npy", "--max-val-tokens", 0]


def _empty_dataset(ck, tmp):
    (tmp / "empty.txt").write_text("")
    return ck, ["--dataset", tmp / "empty.txt", "--max-val-tokens", 0]


BAD = {  # case: (prepare(checkpoint copy, tmp) -> (path, extra args), words of the one-line error)
    "missing folder": (lambda ck, tmp: (tmp / "nope", []), ["no such file or folder"]),
    "empty folder": (_empty_folder, ["no checkpoints found"]),
    "corrupt weights": (_corrupt, ["cannot load the model", "complete"]),
    "pickle-only weights": (_pickle_only, ["pickle", "--allow-pickle"]),
    "no tokenizer": (_no_tokenizer, ["needs a tokenizer", "--tokenizer"]),
    "ids outside the vocabulary": (_ids_outside_vocab, ["outside the model's vocabulary"]),
    "empty dataset": (_empty_dataset, ["empty"]),
    "NaN features": (_nan_model, ["NaN/Inf features"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_clean_line_and_loses_nothing(case, kept_store, trained_run, corpus, tmp_path):
    prepare, words = BAD[case]
    ck = lone_model(trained_run, tmp_path / "checkpoint-60")
    path, extra = prepare(ck, tmp_path)
    if "--dataset" not in extra:
        extra = ["--dataset", corpus["train"], *extra]
    fails_cleanly(["extract", path, "--max-train-tokens", 512, *extra], kept_store, words)


def test_allow_pickle_loads_trusted_pickle_weights(trained_run, corpus, tmp_path):
    ck, _ = _pickle_only(lone_model(trained_run, tmp_path / "checkpoint-60"))
    run_cli("extract", ck, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", "--max-train-tokens", 512,
            "--max-val-tokens", 256, "--allow-pickle")
    assert ncanalyze.store.open(tmp_path / "s.zarr")[f"{tmp_path.name}/checkpoint-60"]["count"].sum() == 16 * 31


def test_full_disk_is_a_clean_error_and_resumes(trained_run, corpus, tmp_path):
    with tmpfs(tmp_path / "disk", "size=4m") as disk:
        store = disk / "s.zarr"
        opts = ["--dataset", corpus["train"], "--store", store, "--max-train-tokens", 1024, "--max-val-tokens", 512,
                "--samples-per-class", 1]
        run_cli("extract", trained_run / "checkpoint-20", *opts)
        before = ncanalyze.store.open(store).to_dict()
        free = os.statvfs(disk)
        (disk / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 16384))
        r = run_cli("extract", trained_run, *opts, ok=False)
        assert "disk full" in r.output and "resume" in r.output
        tree = ncanalyze.store.open(store)
        g = f"{trained_run.name}/checkpoint-20"
        assert tree[g].to_dataset().identical(before[f"/{g}"])
        (disk / "filler").unlink()
        r = run_cli("extract", trained_run, *opts)
        assert sorted(ncanalyze.store.open(store)[trained_run.name].children) == [
            "checkpoint-20", "checkpoint-40", "checkpoint-60"]


def test_device_auto_is_the_cpu_here_and_cuda_without_a_gpu_is_a_clean_error(trained_run, corpus, tmp_path):
    from ncanalyze.store.sources.load import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert resolve_device("auto") == torch.device("cpu")
    r = run_cli("extract", trained_run, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr",
                "--device", "cuda", ok=False)
    assert "no CUDA device" in r.output and "--device cpu" in r.output
