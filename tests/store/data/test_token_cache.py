"""Tokenize once: text tokenized into <store>.tokens/<key>.npy on first use, reused by every checkpoint, keyed by
what determines the blocks; the statistics are the same as without the cache."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import ncanalyze.store
import numpy as np
import pytest
from conftest import EXTRACT_OPTS, lone_model, run_cli
from ncanalyze.store.data import token_cache
from ncanalyze.store.data.blocks import open_blocks
from ncanalyze.store.store import Store
from test_extract import text_blocks
from transformers import AutoTokenizer


def cache_of(store) -> Path:
    """The token cache's folder beside ``store``, as the extraction's Store has it."""
    return Store.at(store).layout.tokens


@pytest.mark.slow
def test_one_cache_per_text_source_shared_by_every_checkpoint(extracted_store, trained_run, corpus, tmp_path):
    files = sorted(cache_of(extracted_store).glob("*.npy"))
    assert len(files) == 2  # train and validation, for the run's three checkpoints
    tok = AutoTokenizer.from_pretrained(str(trained_run))
    # under the default --cap-mode spread the cache holds the whole split, the caps draw their blocks from it
    want = {len(text_blocks(corpus[k], tok, None)) for k in ("train", "val")}
    got = {np.load(f, mmap_mode="r").shape[0] for f in files}
    assert got == want and min(want) > EXTRACT_OPTS[3] // 32
    for f in files:
        arr = np.load(f)
        ref = text_blocks(corpus["train"], tok, None) if len(arr) == max(want) else text_blocks(corpus["val"], tok, None)
        np.testing.assert_array_equal(arr, ref)

    store = tmp_path / "nocache.zarr"  # the same numbers without the cache
    run_cli("extract", trained_run / "checkpoint-40", "--dataset", corpus["train"], "--store", store,
            "--no-token-cache", *EXTRACT_OPTS)
    assert not cache_of(store).exists()
    a = ncanalyze.store.open(store)["neo-2x32/checkpoint-40"].to_dataset()
    b = ncanalyze.store.open(extracted_store)["neo-2x32/checkpoint-40"].to_dataset()
    for name in b.data_vars:
        if not name.startswith("class_"):  # per-class metrics, if another test measured the session store
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
    assert a.attrs["config_hash"] == b.attrs["config_hash"] and a.attrs["val_loss"] == b.attrs["val_loss"]


@pytest.mark.slow
def test_the_key_follows_what_determines_the_blocks(trained_run, corpus, tmp_path):
    ck = lone_model(trained_run, tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(str(ck))
    data = tmp_path / "train.txt"
    data.write_text(corpus["train"].read_text())
    base = dict(spec=str(data), split="train", text_column="text", tokenizer=tok, block_size=32, max_tokens=2048,
                keep_linebreaks=True)
    key = token_cache.cache_key(**base)
    assert token_cache.cache_key(**base) == key
    for change in ({"block_size": 16}, {"max_tokens": 4096}, {"keep_linebreaks": False}, {"split": "train[:50%]"}):
        assert token_cache.cache_key(**base | change) != key, change
    other = AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))
    other.add_tokens(["<extra>"])
    assert token_cache.cache_key(**base | {"tokenizer": other}) != key
    os.utime(data, ns=(0, 0))  # only the times changed: the content, and so the tokens, are the same
    assert token_cache.cache_key(**base) == key

    blocks = open_blocks(str(data), "train", 32, 2048, "text", lambda t: tok(t)["input_ids"])
    assert blocks.total == 64 and token_cache.cached(cache_of(tmp_path / "s.zarr"), blocks, key).total == 64
    c = token_cache.cached(cache_of(tmp_path / "s.zarr"), blocks, key)  # from the file
    assert c.total == 64 and np.array_equal(np.concatenate(list(c.batches(10))), text_blocks(data, tok, 2048))
    no_total = open_blocks(str(data), "train", 32, None, "text", lambda t: tok(t)["input_ids"])
    assert no_total.total is None and token_cache.cached(cache_of(tmp_path / "s.zarr"), no_total, "uncapped").total == \
        len(text_blocks(data, tok, None))
    assert not list(cache_of(tmp_path / "s.zarr").glob(".*"))  # no temporary files left


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
    from ncanalyze.core.errors import UserError

    (tmp_path / "folder").mkdir()
    pd.DataFrame({"text": ["a b c"] * 50}).to_parquet(tmp_path / "folder" / "a.parquet")
    (tmp_path / "folder" / "b.parquet").write_bytes(b"PAR1" + b"\0" * 64 + b"PAR1")
    blocks = open_blocks(str(tmp_path / "folder"), "train", 4, None, "text", lambda t: [[1, 2, 3]] * len(t))
    assert blocks.text_rows.total is None  # no traceback from counting: the bar just has no total
    (tmp_path / "x.parquet").write_bytes(b"PAR1garbagegarbagePAR1")
    with pytest.raises(UserError, match="x.parquet is not a readable parquet file"):
        open_blocks(str(tmp_path / "x.parquet"), "train", 4, None, "text", lambda t: [[1, 2, 3]] * len(t))


def _edit_keeping_size_and_mtime(path, old: str, new: str) -> None:
    st = path.stat()
    text = path.read_text()
    assert len(old) == len(new) and old in text
    path.write_text(text.replace(old, new, 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


@pytest.mark.slow
def test_an_edit_of_the_same_size_with_the_mtime_restored_is_tokenized_again(trained_run, corpus, tmp_path):
    tok = AutoTokenizer.from_pretrained(str(trained_run))
    folder = tmp_path / "texts"
    folder.mkdir()
    data = folder / "train.txt"
    data.write_text(corpus["train"].read_text())
    for spec in (data, folder):  # a file, and a folder of files
        opts = dict(split="train", text_column="text", tokenizer=tok, block_size=32, max_tokens=2048,
                    keep_linebreaks=True)
        key = token_cache.cache_key(str(spec), **opts)
        first = token_cache.cached(cache_of(tmp_path / "s.zarr"), open_blocks(str(spec), "train", 32, 2048, "text",
                                                               lambda t: tok(t)["input_ids"]), key)
        np.testing.assert_array_equal(np.concatenate(list(first.batches(64))), text_blocks(data, tok, 2048))
        word = next(w for w in data.read_text().split() if len(w) > 3 and w.isalpha())
        _edit_keeping_size_and_mtime(data, word, word[::-1] if word[::-1] != word else word.upper())
        new_key = token_cache.cache_key(str(spec), **opts)
        assert new_key != key
        again = token_cache.cached(cache_of(tmp_path / "s.zarr"), open_blocks(str(spec), "train", 32, 2048, "text",
                                                               lambda t: tok(t)["input_ids"]), new_key)
        got = np.concatenate(list(again.batches(64)))
        np.testing.assert_array_equal(got, text_blocks(data, tok, 2048))
        assert not np.array_equal(got, np.concatenate(list(first.batches(64))))


def _damage(path, how: str) -> None:
    side = path.with_name(path.name + ".sha256")
    if how == "altered id":  # another id still inside the vocabulary, the file's size unchanged
        arr = np.load(path, mmap_mode="r+")
        arr[3, 5] = (arr[3, 5] + 1) % 50
        arr.flush()
        del arr
    elif how == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "header only":
        os.truncate(path, 40)
    elif how == "no checksum":
        side.unlink()
    elif how == "garbage checksum":
        side.write_bytes(b"\xff\xfe" + os.urandom(30))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["altered id", "truncated", "header only", "no checksum", "garbage checksum"])
def test_a_damaged_cache_is_said_in_one_line_and_tokenized_again(trained_run, corpus, tmp_path, caplog, how):
    tok = AutoTokenizer.from_pretrained(str(trained_run))
    data = tmp_path / "train.txt"
    data.write_text(corpus["train"].read_text())
    want = text_blocks(data, tok, 2048)

    def read():
        blocks = open_blocks(str(data), "train", 32, 2048, "text", lambda t: tok(t)["input_ids"])
        return np.concatenate(list(token_cache.cached(cache_of(tmp_path / "s.zarr"), blocks, "k").batches(64)))

    np.testing.assert_array_equal(read(), want)
    path = cache_of(tmp_path / "s.zarr") / "k.npy"
    assert path.with_name("k.npy.sha256").read_text() == hashlib.sha256(path.read_bytes()).hexdigest()
    _damage(path, how)
    log = logging.getLogger("ncanalyze")  # the CLI's handler may have stopped it propagating to caplog's
    log.addHandler(caplog.handler)
    try:
        np.testing.assert_array_equal(read(), want)  # the cache tokenized again, never the damaged ids
    finally:
        log.removeHandler(caplog.handler)
    once = {id(r): r for r in caplog.records}.values()  # a record reaches the handler twice where it propagates
    said = [r.getMessage() for r in once if "token cache" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and "tokenizing" in said[0] and "again" in said[0], said
    assert ("no checksum" in said[0]) == (how == "no checksum")
    caplog.clear()
    np.testing.assert_array_equal(read(), want)  # rebuilt: read from the cache without a word
    assert not [r for r in caplog.records if "token cache" in r.getMessage()]
    assert sorted(p.name for p in path.parent.iterdir()) == ["k.npy", "k.npy.sha256"]


@pytest.mark.slow
def test_extract_over_a_truncated_cache_rebuilds_it_and_gets_the_same_numbers(trained_run, corpus, tmp_path):
    """The CLI end to end: a truncated cache file (a full disk, a bad copy) is one line and the same statistics."""
    ck = lone_model(trained_run, tmp_path / "model")
    store = tmp_path / "s.zarr"
    run_cli("extract", ck, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS)
    before = _statistics(store)
    for f in cache_of(store).glob("*.npy"):
        os.truncate(f, f.stat().st_size - 100)
    from click.testing import CliRunner
    from ncanalyze.cli.main import main

    r = CliRunner().invoke(main, [str(a) for a in ("extract", ck, "--dataset", corpus["train"], "--store", store,
                                                    "--overwrite", *EXTRACT_OPTS)])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    said = [ln for ln in r.output.splitlines() if "token cache" in ln]
    assert len(said) == 2 and all("tokenizing" in ln for ln in said), r.output  # train and validation
    after = _statistics(store)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


def _statistics(store) -> dict[str, np.ndarray]:
    """Every array of every checkpoint group in ``store``, by group/name."""
    from ncanalyze.store.io import checkpoint_groups

    groups, _ = checkpoint_groups(store)
    assert groups
    tree = ncanalyze.store.open(store)
    return {f"{g}/{k}": v.values for g in groups for k, v in tree[g].to_dataset().data_vars.items()}


def test_a_folder_where_the_cache_file_belongs_is_one_line(trained_run, corpus, tmp_path):
    from ncanalyze.core.errors import UserError

    tok = AutoTokenizer.from_pretrained(str(trained_run))
    blocks = open_blocks(str(corpus["train"]), "train", 32, 2048, "text", lambda t: tok(t)["input_ids"])
    for name in ("k.npy", "k.npy.sha256"):
        folder = cache_of(tmp_path / "s.zarr") / name
        folder.mkdir(parents=True)
        (folder / "mine.txt").write_text("someone's file")
        with pytest.raises(UserError, match="is a folder where the token cache keeps a file") as e:
            token_cache.cached(cache_of(tmp_path / "s.zarr"), blocks, "k")
        assert "\n" not in str(e.value) and (folder / "mine.txt").read_text() == "someone's file"
        shutil.rmtree(folder)
