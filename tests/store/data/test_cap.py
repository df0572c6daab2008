"""A token cap reads whole blocks spread over the whole split (--cap-mode spread, the default), the same blocks in
every data form, for every checkpoint, in shards and across runs, recorded; --cap-mode prefix reads the first ones."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import datasets
import ncanalyze.store
import numpy as np
import pytest
from conftest import lone_model, run_cli
from ncanalyze.store.data.blocks import open_blocks, spread_picks
from ncanalyze.store.extraction.config import ExtractConfig, open_data
from ncanalyze.store.store import Store
from test_extract import text_blocks
from transformers import AutoTokenizer


def test_spread_picks_one_block_from_each_equal_stretch():
    n, m = 1000, 64
    picks = spread_picks(n, m, seed=0)
    assert len(picks) == m and (np.diff(picks) > 0).all()
    for k, i in enumerate(picks):  # stretch k is blocks [k n // m, (k + 1) n // m)
        assert k * n // m <= i < (k + 1) * n // m
    assert picks[0] < n // m and picks[-1] >= n - n // m - 1  # from the first pages to the last
    np.testing.assert_array_equal(spread_picks(n, m, seed=0), picks)  # deterministic
    assert not np.array_equal(spread_picks(n, m, seed=1), picks)  # the seed draws them
    np.testing.assert_array_equal(spread_picks(50, 64, seed=0), np.arange(50))  # a cap above the data: all of it
    # uniform within each stretch: over many seeds each offset of a stretch of 16 comes up about equally
    offsets = np.concatenate([spread_picks(1024, 64, s) % 16 for s in range(200)])
    counts = np.bincount(offsets, minlength=16)
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean(), counts


@pytest.fixture(scope="module")
def text(corpus, trained_run, tmp_path_factory):
    """2,500 lines of the train text (three of run_clm's 1,000-row batches) and the run's tokenizer."""
    d = tmp_path_factory.mktemp("cap")
    data = d / "train.txt"
    data.write_text("".join(open(corpus["train"]).read().splitlines(keepends=True)[:2500]))
    return data, AutoTokenizer.from_pretrained(str(trained_run))


def read(blocks) -> np.ndarray:
    return np.concatenate(list(blocks.batches(7)))


@pytest.mark.slow
def test_every_data_form_reads_the_same_spread_blocks(text, tmp_path):
    data, tok = text
    whole = text_blocks(data, tok, None)
    want = text_blocks(data, tok, 2048)  # 64 of the whole split's blocks, one from each of 64 stretches
    assert len(whole) > 4 * len(want) and not np.array_equal(want, whole[:64])
    np.save(tmp_path / "a.npy", whole.ravel())
    np.save(tmp_path / "b.npy", whole)
    whole.ravel().astype(np.uint16).tofile(tmp_path / "c.bin")
    lines = open(data).read().splitlines(keepends=True)
    datasets.Dataset.from_dict({"text": lines}).save_to_disk(tmp_path / "saved")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    tokenize = lambda t: tok(t)["input_ids"]  # noqa: E731
    for spec in ("a.npy", "b.npy", "c.bin", "saved", "d.jsonl"):
        blocks = open_blocks(str(tmp_path / spec), "train", 32, 2048, "text", tokenize)
        assert blocks.total == 64, spec
        np.testing.assert_array_equal(read(blocks), want, err_msg=spec)
        np.testing.assert_array_equal(read(blocks), want, err_msg=spec)  # read again: the same blocks
        prefix = open_blocks(str(tmp_path / spec), "train", 32, 2048, "text", tokenize, cap_mode="prefix")
        np.testing.assert_array_equal(read(prefix), whole[:64], err_msg=spec)
    np.testing.assert_array_equal(read(open_blocks(str(data), "train", 32, 2048, "text", tokenize, seed=5)),
                                  text_blocks(data, tok, 2048, seed=5))
    # text through the token cache: the whole split tokenized once, the cap's blocks drawn from it
    cfg = ExtractConfig(dataset=str(data), max_train_tokens=2048)
    config = SimpleNamespace(n_positions=32)
    cached = open_data(str(data), "train", 2048, "--max-train-tokens", cfg, 32, config, tok, Store.at(tmp_path / "s.zarr"))
    np.testing.assert_array_equal(read(cached), want)
    (cache,) = (tmp_path / "s.zarr.tokens").glob("*.npy")
    np.testing.assert_array_equal(np.load(cache), whole)
    cfg = dataclasses.replace(cfg, cap_mode="prefix")
    prefix = open_data(str(data), "train", 2048, "--max-train-tokens", cfg, 32, config, tok, Store.at(tmp_path / "s.zarr"))
    np.testing.assert_array_equal(read(prefix), whole[:64])
    with pytest.raises(Exception, match=r"^cap_mode \(--cap-mode\) must be one of spread, prefix, got 'first'$"):
        dataclasses.replace(cfg, cap_mode="first")  # checked as it is made (the settings), not when the data is opened


@pytest.mark.slow
def test_extract_records_the_cap_mode_and_reads_the_same_blocks_in_shards(text, trained_run, tmp_path):
    data, tok = text
    ck = lone_model(trained_run, tmp_path / "model")
    opts = ("--dataset", data, "--max-train-tokens", 2048, "--max-val-tokens", 0, "--samples-per-class", 2,
            "--batch-size", 4)
    run_cli("extract", ck, "--store", tmp_path / "a.zarr", *opts)
    run_cli("extract", ck, "--store", tmp_path / "b.zarr", *opts, "--shards", 3)
    run_cli("extract", ck, "--store", tmp_path / "c.zarr", *opts, "--cap-mode", "prefix")
    run_cli("extract", ck, "--store", tmp_path / "d.zarr", "--dataset", data, "--max-val-tokens", 0,
            "--samples-per-class", 2)
    a, b, c, d = (ncanalyze.store.open(tmp_path / f"{s}.zarr")["model/final"] for s in "abcd")
    whole = text_blocks(data, tok, None)  # --max-val-tokens 0: nothing held out, the train split is all of it
    assert a.attrs["cap_mode"] == "spread" and a.attrs["seed"] == 0 and c.attrs["cap_mode"] == "prefix"
    assert json.loads(a.attrs["config"])["cap_mode"] == "spread" and d.attrs["cap_mode"] is None
    assert json.loads(c.attrs["config"])["cap_mode"] == "prefix"
    assert json.loads(d.attrs["config"])["cap_mode"] is None  # no cap: the mode reads nothing, so it is not a setting
    assert a.attrs["config_hash"] != c.attrs["config_hash"]
    vocab = a.sizes["vocab"]
    np.testing.assert_array_equal(a["count"].values, np.bincount(text_blocks(data, tok, 2048)[:, 1:].ravel(),
                                                                 minlength=vocab))
    np.testing.assert_array_equal(c["count"].values, np.bincount(whole[:64, 1:].ravel(), minlength=vocab))
    np.testing.assert_array_equal(a["count"].values, b["count"].values)  # the shards read the same blocks
    np.testing.assert_allclose(a["mean"].values, b["mean"].values, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(a["sample_position"].values, b["sample_position"].values)
    r = run_cli("extract", ck, "--store", tmp_path / "a.zarr", *opts[:-4], "--cap-mode", "prefix", ok=False)
    assert "cap_mode: 'spread' -> 'prefix'" in r.output
