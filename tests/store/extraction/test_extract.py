"""Extraction against brute force: counts exactly, moments to 1e-9, NC4 counts exactly, for every data form."""
from __future__ import annotations

import json
import shutil

import ncanalyze.store
import numpy as np
import pytest
import torch
import xarray as xr
from conftest import EXTRACT_OPTS, lone_model, run_cli
from transformers import AutoModelForCausalLM, AutoTokenizer

BLOCK = 32  # the fixture model's context


def text_blocks(path, tokenizer, max_tokens: int | None, block: int = BLOCK, cap_mode: str = "spread",
                seed: int = 0) -> np.ndarray:
    """run_clm's recipe written out: tokenize each line, and for each batch of 1,000 lines (its map's batch_size)
    concatenate and cut into blocks, that batch's remainder dropped (group_texts). A cap of m blocks takes, with
    ``cap_mode`` spread (the default, as extract's), one block drawn from each of m equal stretches of the n blocks
    (block k*n//m up to (k+1)*n//m, numpy's generator seeded with ``seed``), with prefix the first m."""
    lines = open(path).read().splitlines(keepends=True)  # run_clm keeps line breaks
    blocks = []
    for s in range(0, len(lines), 1000):
        ids = [t for doc in tokenizer(lines[s:s + 1000])["input_ids"] for t in doc]
        blocks += [ids[i:i + block] for i in range(0, len(ids) // block * block, block)]
    n = len(blocks)
    m = n if max_tokens is None else max_tokens // block
    if m >= n:
        picks = range(n)
    elif cap_mode == "prefix":
        picks = range(m)
    else:
        rng = np.random.default_rng(seed)
        picks = rng.integers([k * n // m for k in range(m)], [(k + 1) * n // m for k in range(m)])
    return np.array([blocks[i] for i in picks], dtype=np.int64).reshape(-1, block)


def hidden(model, blocks: np.ndarray, batch: int = 8) -> np.ndarray:
    """Features from ``output_hidden_states`` (the last entry is after the final norm), float64."""
    out = []
    with torch.no_grad():
        for s in range(0, len(blocks), batch):
            hs = model(torch.from_numpy(blocks[s:s + batch]), output_hidden_states=True).hidden_states[-1]
            out.append(hs[:, :-1].reshape(-1, hs.shape[-1]).double().numpy())
    return np.concatenate(out)


def brute_force(model_dir, train: np.ndarray, val: np.ndarray | None, min_count: int = 1) -> dict:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    W = model.get_output_embeddings().weight.detach().double().numpy()
    V, d = W.shape
    H, y = hidden(model, train), train[:, 1:].ravel()
    count = np.bincount(y, minlength=V)
    mean, var = np.zeros((V, d)), np.full(V, np.nan)
    for c in np.flatnonzero(count):
        Hc = H[y == c]
        mean[c] = Hc.mean(0)
        var[c] = ((Hc - mean[c]) ** 2).sum(1).mean()
    dev = H - mean[y]
    out = {"count": count, "mean": mean, "variance": var, "within_covariance": dev.T @ dev / len(y)}
    if val is not None:
        kept = np.flatnonzero(count >= min_count)
        Hv, yv = hidden(model, val), val[:, 1:].ravel()
        linear = kept[(Hv @ W[kept].T).argmax(1)]
        ncc = kept[(((Hv[:, None, :] - mean[kept][None]) ** 2).sum(-1)).argmin(1)]
        out |= {"val_count": np.bincount(yv, minlength=V),
                "val_correct": np.bincount(yv[linear == yv], minlength=V),
                "val_ncc_agree": np.bincount(yv[linear == ncc], minlength=V)}
    return out


def assert_matches(ds: xr.Dataset, ref: dict) -> None:
    for name, want in ref.items():
        got = ds[name].values
        if name.startswith(("count", "val_")):
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12 * np.nanmax(np.abs(want)), err_msg=name)


@pytest.fixture(scope="module")
def tokenizer(trained_run):
    return AutoTokenizer.from_pretrained(str(trained_run))


@pytest.fixture(scope="module")
def streams(corpus, tokenizer):
    """The train and validation token blocks every data form must reproduce (2048 / 1024 tokens)."""
    return text_blocks(corpus["train"], tokenizer, 2048), text_blocks(corpus["val"], tokenizer, 1024)


@pytest.mark.slow
def test_every_checkpoint_matches_brute_force(extracted_store, trained_run, corpus, tokenizer):
    tree = ncanalyze.store.open(extracted_store)
    groups = sorted(tree["neo-2x32"].children)
    assert groups == ["checkpoint-20", "checkpoint-40", "checkpoint-60"]  # final == checkpoint-60: not repeated
    train = text_blocks(corpus["train"], tokenizer, EXTRACT_OPTS[1])
    val = text_blocks(corpus["val"], tokenizer, EXTRACT_OPTS[3])
    losses = []
    for name in groups:
        ds = tree[f"neo-2x32/{name}"].to_dataset()
        assert_matches(ds, brute_force(trained_run / name, train, val))
        state = json.loads((trained_run / name / "trainer_state.json").read_text())
        assert ds.attrs["global_step"] == state["global_step"] == int(name.split("-")[1])
        assert ds.attrs["eval_loss"] == [e for e in state["log_history"] if "eval_loss" in e][-1]["eval_loss"]
        assert ds.attrs["train_tokens"] == train.shape[0] * (BLOCK - 1) == ds["count"].sum()
        assert ds.attrs["n_params"] == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(
            str(trained_run / name)).parameters())
        assert ds.attrs["n_layers"] == 2 and ds.attrs["hidden_size"] == 32
        assert ds["token"].values[tokenizer.convert_tokens_to_ids("the")] == "the"
        losses.append(ds.attrs["eval_loss"])
    assert losses == sorted(losses, reverse=True)  # training went somewhere


def test_reservoir_is_a_uniform_bottom_k_sample(extracted_store, trained_run, corpus, tokenizer):
    """Each kept sample is the feature at its recorded position, and classes keep min(count, K) samples."""
    ds = ncanalyze.store.open(extracted_store)["neo-2x32/checkpoint-40"].to_dataset()
    train = text_blocks(corpus["train"], tokenizer, EXTRACT_OPTS[1])
    model = AutoModelForCausalLM.from_pretrained(str(trained_run / "checkpoint-40")).eval()
    H = hidden(model, train)
    np.testing.assert_array_equal(ds.n_samples.values, np.minimum(ds["count"].values, 4))
    t = int(np.argmax(ds["count"].values))
    pos = ds.sample_position.sel(vocab=t).values
    assert len(set(pos.tolist())) == 4 and (train.ravel()[pos + 1] == t).all()  # the label is the next token
    rows = (pos // BLOCK) * (BLOCK - 1) + pos % BLOCK
    np.testing.assert_allclose(ds.samples.sel(vocab=t).values, H[rows], rtol=1e-6)


def _write_forms(tmp_path, corpus, streams) -> dict[str, tuple[str, str]]:
    """The same tokens as every data form: {form: (train spec, val spec)}."""
    import datasets

    train, val = streams
    d = tmp_path / "data"
    d.mkdir()
    lines = {s: open(corpus[k]).read().splitlines(keepends=True)
             for s, k in (("train", "train"), ("validation", "val"))}
    for s, blocks in (("train", train), ("val", val)):
        np.save(d / f"{s}.npy", blocks.ravel())
        np.save(d / f"{s}2d.npy", blocks)
        blocks.ravel().astype(np.uint16).tofile(d / f"{s}.bin")
    for s in ("train", "validation"):
        with open(d / f"{s}.jsonl", "w") as f:
            f.writelines(json.dumps({"story": t}) + "\n" for t in lines[s])
    datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": lines[s]}) for s in lines}).save_to_disk(d / "saved")
    (d / "folder").mkdir()
    for s in lines:
        shutil.copy(corpus["train" if s == "train" else "val"], d / "folder" / f"{s}.txt")
    for s in lines:
        datasets.Dataset.from_dict({"text": lines[s]}).to_parquet(d / f"{s}.parquet")
    return {
        "npy-1d": (d / "train.npy", d / "val.npy"),
        "npy-2d": (d / "train2d.npy", d / "val2d.npy"),
        "nanogpt-bin": (d / "train.bin", None),  # val.bin is found beside train.bin
        "jsonl": (d / "train.jsonl", d / "validation.jsonl"),
        "parquet": (d / "train.parquet", None),  # validation.parquet is found beside it
        "saved-dataset": (d / "saved", None),  # load_from_disk, its validation split
        "text-folder": (d / "folder", None),  # load_dataset on a folder: splits from file names
    }


@pytest.mark.slow
def test_every_data_form_gives_the_same_exact_statistics(trained_run, corpus, streams, tmp_path):
    ck = lone_model(trained_run, tmp_path / "model")
    ref = brute_force(ck, *streams)
    for form, (train, val) in _write_forms(tmp_path, corpus, streams).items():
        store = tmp_path / f"{form}.zarr"
        args = ["extract", ck, "--dataset", train, "--store", store, "--block-size", BLOCK,
                "--max-train-tokens", 2048, "--max-val-tokens", 1024, "--samples-per-class", 2]
        if val is not None:
            args += ["--val-dataset", val]
        if form == "jsonl":
            args += ["--text-column", "story"]
        run_cli(*args)
        ds = ncanalyze.store.open(store)["model/final"].to_dataset()
        assert_matches(ds, ref)


@pytest.mark.slow
def test_split_slices_of_one_text_file(trained_run, corpus, tokenizer, tmp_path):
    """--split 'train[:50%]' with --val-split 'train[50%:]' of the same file: the README's recipe for one file."""
    ck = lone_model(trained_run, tmp_path / "model")
    lines = open(corpus["train"]).read().splitlines(keepends=True)
    half = tmp_path / "half.txt"
    half.write_text("".join(lines[: len(lines) // 2]))
    store = tmp_path / "s.zarr"
    run_cli("extract", ck, "--dataset", corpus["train"], "--split", "train[:50%]", "--val-dataset", corpus["train"],
            "--val-split", "train[50%:]", "--store", store, "--max-val-tokens", 512, "--samples-per-class", 0)
    ds = ncanalyze.store.open(store)["model/final"].to_dataset()
    want = text_blocks(half, tokenizer, None)
    np.testing.assert_array_equal(ds["count"].values, np.bincount(want[:, 1:].ravel(), minlength=ds.sizes["vocab"]))
    assert ds.attrs["val_tokens"] == 512 // BLOCK * (BLOCK - 1)
