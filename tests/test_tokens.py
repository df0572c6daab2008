"""Tokenize once: text tokenized into <store>.tokens/<key>.npy on first use, reused by every checkpoint, keyed by
what determines the blocks; the statistics are the same as without the cache."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import EXTRACT_OPTS, lone_model, run_cli
from test_extract import text_blocks
from transformers import AutoTokenizer

import ncanalyze.store
from ncanalyze.store import tokens
from ncanalyze.store.data import open_blocks


def test_one_cache_per_text_source_shared_by_every_checkpoint(extracted_store, trained_run, corpus, tmp_path):
    files = sorted(tokens.cache_dir(extracted_store).glob("*.npy"))
    assert len(files) == 2  # train and validation, for the run's three checkpoints
    tok = AutoTokenizer.from_pretrained(str(trained_run))
    want = {len(text_blocks(corpus[k], tok, EXTRACT_OPTS[i])) for k, i in (("train", 1), ("val", 3))}
    got = {np.load(f, mmap_mode="r").shape[0] for f in files}
    assert got == want
    for f in files:
        arr = np.load(f)
        ref = text_blocks(corpus["train"], tok, EXTRACT_OPTS[1]) if len(arr) == max(want) else \
            text_blocks(corpus["val"], tok, EXTRACT_OPTS[3])
        np.testing.assert_array_equal(arr, ref)

    store = tmp_path / "nocache.zarr"  # the same numbers without the cache
    run_cli("extract", trained_run / "checkpoint-40", "--dataset", corpus["train"], "--store", store,
            "--no-token-cache", *EXTRACT_OPTS)
    assert not tokens.cache_dir(store).exists()
    a = ncanalyze.store.open(store)["neo-2x32/checkpoint-40"].to_dataset()
    b = ncanalyze.store.open(extracted_store)["neo-2x32/checkpoint-40"].to_dataset()
    for name in b.data_vars:
        if not name.startswith("class_"):  # per-class metrics, if another test measured the session store
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
    assert a.attrs["config_hash"] == b.attrs["config_hash"] and a.attrs["val_loss"] == b.attrs["val_loss"]


def test_the_key_follows_what_determines_the_blocks(trained_run, corpus, tmp_path):
    ck = lone_model(trained_run, tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(str(ck))
    data = tmp_path / "train.txt"
    data.write_text(corpus["train"].read_text())
    base = dict(spec=str(data), split="train", text_column="text", tokenizer=tok, block_size=32, max_tokens=2048,
                keep_linebreaks=True)
    key = tokens.cache_key(**base)
    assert tokens.cache_key(**base) == key
    for change in ({"block_size": 16}, {"max_tokens": 4096}, {"keep_linebreaks": False}, {"split": "train[:50%]"}):
        assert tokens.cache_key(**base | change) != key, change
    other = AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))
    other.add_tokens(["<extra>"])
    assert tokens.cache_key(**base | {"tokenizer": other}) != key
    os.utime(data, ns=(0, 0))  # the data file changed
    assert tokens.cache_key(**base) != key

    blocks = open_blocks(str(data), "train", 32, 2048, "text", lambda t: tok(t)["input_ids"])
    assert blocks.total == 64 and tokens.cached(tmp_path / "s.zarr", blocks, key).total == 64
    c = tokens.cached(tmp_path / "s.zarr", blocks, key)  # from the file
    assert c.total == 64 and np.array_equal(np.concatenate(list(c.batches(10))), text_blocks(data, tok, 2048))
    no_total = open_blocks(str(data), "train", 32, None, "text", lambda t: tok(t)["input_ids"])
    assert no_total.total is None and tokens.cached(tmp_path / "s.zarr", no_total, "uncapped").total == \
        len(text_blocks(data, tok, None))
    assert not list(tokens.cache_dir(tmp_path / "s.zarr").glob(".*"))  # no temporary files left


@pytest.mark.parametrize("form", ["a.txt", "b.jsonl", "c.parquet", "saved", "folder"])
def test_text_knows_its_rows_for_the_tokenizing_bar(form, tmp_path):
    """Uncapped text has no block count before it is tokenized; the tokenizing bar counts rows, of a total known up
    front for every local form: lines of .txt/.jsonl, parquet's metadata, a saved dataset's length."""
    import datasets
    import pandas as pd

    lines = [f"line {i} " + "word " * (i % 7) for i in range(2345)]
    (tmp_path / "a.txt").write_text("\n".join(lines))  # the last line without its break
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(lines)))
    pd.DataFrame({"text": lines}).to_parquet(tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"text": lines}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "x.txt").write_text("\n".join(lines[:1000]) + "\n")
    (tmp_path / "folder" / "y.txt").write_text("\n".join(lines[1000:]) + "\n")
    blocks = open_blocks(str(tmp_path / form), "train", 16, None, "text", lambda t: [[len(w) for w in s.split()]
                                                                                    for s in t])
    assert blocks.total is None and blocks.text_rows.total == len(lines)
    assert sum(len(b) for b in blocks.batches(64)) > 0 and blocks.text_rows.done == len(lines)


def test_a_corrupt_file_leaves_the_bar_without_a_total_and_a_corrupt_parquet_is_named(tmp_path):
    import pandas as pd

    from ncanalyze.analyzer.errors import UserError

    (tmp_path / "folder").mkdir()
    pd.DataFrame({"text": ["a b c"] * 50}).to_parquet(tmp_path / "folder" / "a.parquet")
    (tmp_path / "folder" / "b.parquet").write_bytes(b"PAR1" + b"\0" * 64 + b"PAR1")
    blocks = open_blocks(str(tmp_path / "folder"), "train", 4, None, "text", lambda t: [[1, 2, 3]] * len(t))
    assert blocks.text_rows.total is None  # no traceback from counting: the bar just has no total
    (tmp_path / "x.parquet").write_bytes(b"PAR1garbagegarbagePAR1")
    with pytest.raises(UserError, match="x.parquet is not a readable parquet file"):
        open_blocks(str(tmp_path / "x.parquet"), "train", 4, None, "text", lambda t: [[1, 2, 3]] * len(t))
