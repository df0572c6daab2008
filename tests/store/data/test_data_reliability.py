"""Bad data files (SPEC section 7): one line naming the file and the fix, never a traceback or wrong numbers.

Each case writes a real file and opens it with ``open_blocks`` (iterating its batches: text is read lazily), then
runs ``ncanalyze extract`` on it with a real trained checkpoint, against a store that must come out unchanged.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import fails_cleanly
from ncanalyze.core.errors import UserError
from ncanalyze.store.data.blocks import check_block_size, open_blocks
from ncanalyze.store.sources.anatomy import model_positions


def _tokenize(texts):
    return [[ord(c) % 97 for c in t] for t in texts]


def _zero_columns(d):
    np.save(d / "ids.npy", np.zeros((40, 0), dtype=np.int64))
    return d / "ids.npy"


def _one_column(d):
    np.save(d / "ids.npy", np.zeros((40, 1), dtype=np.int64))
    return d / "ids.npy"


def _object_npy(d):
    np.save(d / "ids.npy", np.array([1, "two", None], dtype=object), allow_pickle=True)
    return d / "ids.npy"


def _not_npy(d):
    (d / "ids.npy").write_bytes(b"these bytes are not a numpy file at all\n" * 4)
    return d / "ids.npy"


def _truncated_npy(d):
    np.save(d / "ids.npy", np.arange(4096, dtype=np.int64) % 300)
    (d / "ids.npy").write_bytes((d / "ids.npy").read_bytes()[:1000])
    return d / "ids.npy"


def _npz_as_npy(d):
    with open(d / "ids.npy", "wb") as f:
        np.savez(f, ids=np.arange(100))
    return d / "ids.npy"


def _odd_bin(d):
    (d / "train.bin").write_bytes(np.arange(4096, dtype=np.uint16).tobytes() + b"\x01")
    return d / "train.bin"


def _empty_bin(d):
    (d / "train.bin").write_bytes(b"")
    return d / "train.bin"


def _latin1_txt(d):
    (d / "train.txt").write_bytes("the café sees the dog .\n".encode("latin-1") * 200)
    return d / "train.txt"


def _bad_jsonl(d):
    lines = [json.dumps({"text": "the big dog sees the cat ."})] * 50 + ['{"text": "the cat', '{"text": "x"}']
    (d / "train.jsonl").write_text("\n".join(lines) + "\n")
    return d / "train.jsonl"


def _int_column(d):
    (d / "train.jsonl").write_text("".join(json.dumps({"text": i}) + "\n" for i in range(200)))
    return d / "train.jsonl"


def _null_text(d):
    rows = [{"text": None}] + [{"text": "the big dog sees the cat ."}] * 20
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "train.jsonl"


def _empty_json(d):
    (d / "train.json").write_text("")
    return d / "train.json"


def _blank_jsonl(d):
    (d / "train.jsonl").write_text("\n  \n")
    return d / "train.jsonl"


def _empty_npy(d):
    np.save(d / "ids.npy", np.zeros(0, dtype=np.int64))
    return d / "ids.npy"


BAD_FILES = {  # case: (write the file in a folder -> its path, words its one-line error must hold)
    "2-D .npy with zero columns": (_zero_columns, ["rows of 0 tokens", "at least 2"]),
    "2-D .npy with one column": (_one_column, ["rows of 1 tokens", "at least 2"]),
    "object .npy": (_object_npy, ["not a readable .npy", "np.save"]),
    "bytes that are not .npy": (_not_npy, ["not a readable .npy", "np.save"]),
    "truncated .npy": (_truncated_npy, ["not a readable .npy", "np.save"]),
    ".npz named .npy": (_npz_as_npy, [".npz archive", "np.save"]),
    "empty .npy": (_empty_npy, ["no full block", "empty"]),
    "odd-length .bin": (_odd_bin, ["odd number", "uint16", "tofile"]),
    "empty .bin": (_empty_bin, ["is empty", "uint16"]),
    "latin-1 .txt": (_latin1_txt, ["not UTF-8", "re-encode"]),
    "malformed jsonl line": (_bad_jsonl, ["not valid JSON", "one JSON object per line"]),
    "text column of ints": (_int_column, ["is not text", "int", "--text-column"]),
    "a null text": (_null_text, ["is not text", "NoneType", "--text-column"]),
    "empty .json": (_empty_json, ["is empty"]),
    "whitespace .jsonl": (_blank_jsonl, ["is empty"]),
}


def _one_line(e: UserError) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("case", list(BAD_FILES))
@pytest.mark.parametrize("split", ["train", "train[:50%]"])  # streamed, and built (a slice) by datasets
def test_bad_file_is_one_line_naming_it(case, split, tmp_path):
    write, words = BAD_FILES[case]
    path = write(tmp_path)
    with pytest.raises(UserError) as e:
        blocks = open_blocks(str(path), split, 8, None, "text", _tokenize)
        list(blocks.batches(4))
    msg = _one_line(e.value)
    assert str(path) in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("cap", [0, 1, 31])
@pytest.mark.parametrize("form", ["1-D .npy", "2-D .npy", ".bin", ".txt"])
def test_a_cap_below_one_block_is_blamed_on_the_cap(form, cap, tmp_path):
    if form == "1-D .npy":
        np.save(path := tmp_path / "ids.npy", np.arange(4096) % 300)
    elif form == "2-D .npy":
        np.save(path := tmp_path / "ids.npy", (np.arange(4096) % 300).reshape(128, 32))
    elif form == ".bin":
        (np.arange(4096, dtype=np.uint16) % 300).tofile(path := tmp_path / "train.bin")
    else:
        (path := tmp_path / "train.txt").write_text("the big dog sees the cat .\n" * 500)
    with pytest.raises(UserError) as e:
        list(open_blocks(str(path), "train", 32, cap, "text", _tokenize, cap_flag="--max-train-tokens").batches(4))
    msg = _one_line(e.value)
    assert f"--max-train-tokens {cap} is below one block of 32 tokens" in msg and str(path) in msg, msg
    assert "raise --max-train-tokens to at least 32" in msg and "empty" not in msg, msg
    # exactly one block is fine
    blocks = open_blocks(str(path), "train", 32, 32, "text", _tokenize)
    assert [b.shape for b in blocks.batches(4)] == [(1, 32)]


def test_good_files_still_read(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(100, dtype=np.int32))
    np.save(tmp_path / "b.npy", np.arange(100).reshape(10, 10))
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "c.bin")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": "abcdefghij"}) + "\n" for _ in range(10)))
    (tmp_path / "e.txt").write_text("abcdefghi\n" * 10)
    for name, total in (("a.npy", 10), ("b.npy", 10), ("c.bin", 10), ("d.jsonl", 10), ("e.txt", 10)):
        blocks = open_blocks(str(tmp_path / name), "train", 10, None, "text", _tokenize)
        got = np.concatenate(list(blocks.batches(3)))
        assert got.shape == (total, 10) and got.dtype == np.int64, name


def test_a_block_longer_than_the_model_positions_is_refused(trained_run, tmp_path):
    from transformers import AutoConfig

    n = model_positions(AutoConfig.from_pretrained(trained_run / "checkpoint-20"))
    assert n == 32
    stream = tmp_path / "ids.npy"
    np.save(stream, np.arange(4096) % 300)
    blocks = open_blocks(str(stream), "train", 64, None, "text", None)
    with pytest.raises(UserError) as e:
        check_block_size(blocks.block_size, n, blocks.spec, blocks.rows_from_file)
    msg = _one_line(e.value)
    assert "--block-size 64 is longer than the model's 32 positions" in msg and "--block-size 32 or less" in msg

    wide = tmp_path / "wide.npy"
    np.save(wide, (np.arange(4096) % 300).reshape(64, 64))
    blocks = open_blocks(str(wide), "train", 32, None, "text", None)
    with pytest.raises(UserError) as e:
        check_block_size(blocks.block_size, n, blocks.spec, blocks.rows_from_file)
    msg = _one_line(e.value)
    assert str(wide) in msg and "rows" in msg and "64 tokens" in msg and "at most 32" in msg, msg

    for ok in (open_blocks(str(stream), "train", 32, None, "text", None),
               open_blocks(str(tmp_path / "ids.npy"), "train", 2, None, "text", None)):
        check_block_size(ok.block_size, n, ok.spec, ok.rows_from_file)  # no error
    check_block_size(10 ** 6, None, "x", False)  # a model without a position limit


# ---------------------------------------------------------------- the same files through the CLI


CLI_CASES = ["2-D .npy with zero columns", "object .npy", "odd-length .bin", "empty .bin", "latin-1 .txt",
             "malformed jsonl line", "text column of ints", "empty .json"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_bad_file_through_the_cli(case, kept_store, trained_run, tmp_path):
    write, words = BAD_FILES[case]
    path = write(tmp_path)
    fails_cleanly(["extract", trained_run / "checkpoint-40", "--dataset", path, "--max-val-tokens", 0],
                  kept_store, [str(path), *words])


def test_a_train_cap_below_one_block_through_the_cli(kept_store, trained_run, corpus):
    # the model's context is 32 tokens, so the default block is 32
    fails_cleanly(["extract", trained_run / "checkpoint-40", "--dataset", corpus["train"],
                   "--max-train-tokens", 20, "--max-val-tokens", 0], kept_store,
                  ["20 is below one block of 32 tokens", "at least 32"])


def test_a_block_longer_than_the_model_through_the_cli(kept_store, trained_run, tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(8192) % 300)
    fails_cleanly(["extract", trained_run / "checkpoint-40", "--dataset", tmp_path / "ids.npy",
                   "--block-size", 64, "--max-val-tokens", 0], kept_store,
                  ["--block-size 64", "32 positions"])
