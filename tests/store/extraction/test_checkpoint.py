"""One checkpoint's extraction (store/extraction/checkpoint.py) on every bad input of SPEC section 7: one clean line
that loses nothing; trusted pickle weights on request; the device resolved or refused in one line."""
from __future__ import annotations

import ncanalyze.store
import numpy as np
import pytest
import torch
from conftest import fails_cleanly, lone_model, run_cli
from safetensors.torch import load_file, save_file


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


def test_device_auto_is_the_cpu_here_and_cuda_without_a_gpu_is_a_clean_error(trained_run, corpus, tmp_path):
    from ncanalyze.store.sources.load import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert resolve_device("auto") == torch.device("cpu")
    r = run_cli("extract", trained_run, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr",
                "--device", "cuda", ok=False)
    assert "no CUDA device" in r.output and "--device cpu" in r.output
