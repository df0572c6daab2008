"""Validation never on the train tokens by default (issue 20): with no validation data given or found, the first
--val-split-percentage (5) % of the train data is held out as validation, as run_clm's validation_split_percentage,
and the train pass reads the rest. Each test extracts for real and compares the blocks each pass read."""
from __future__ import annotations

import json
import shutil

import ncanalyze.store
import numpy as np
import pytest
import torch
from conftest import lone_model, run_cli
from transformers import AutoTokenizer

BLOCK = 32  # the fixture model's context
LINES = 600  # 5% of 600 rows is 30, with no rounding to argue about


@pytest.fixture(scope="module")
def model(trained_run, tmp_path_factory):
    return lone_model(trained_run, tmp_path_factory.mktemp("heldout") / "model")


@pytest.fixture(scope="module")
def tokenizer(trained_run):
    return AutoTokenizer.from_pretrained(str(trained_run))


def lines_of(corpus) -> list[str]:
    return open(corpus["train"]).read().splitlines(keepends=True)[:LINES]


def text_blocks(lines: list[str], tokenizer) -> np.ndarray:
    """run_clm's recipe written out: tokenize each row; each batch of 1,000 rows (its map's batch_size) concatenated
    and cut into blocks, that batch's remainder dropped (group_texts)."""
    blocks = []
    for s in range(0, len(lines), 1000):
        ids = [t for doc in tokenizer(lines[s:s + 1000])["input_ids"] for t in doc]
        blocks += [ids[i:i + BLOCK] for i in range(0, len(ids) // BLOCK * BLOCK, BLOCK)]
    return np.array(blocks, dtype=np.int64).reshape(-1, BLOCK)


def extract(model, data, store, *extra, group: str = "model/final"):
    out = run_cli("extract", model, "--dataset", data, "--store", store, "--samples-per-class", 0, *extra).output
    return out, ncanalyze.store.open(store)[group].to_dataset()


def labels(blocks: np.ndarray, vocab: int) -> np.ndarray:
    return np.bincount(blocks[:, 1:].ravel(), minlength=vocab)


def assert_read(ds, train: np.ndarray, val: np.ndarray) -> None:
    """The store's train counts are exactly ``train``'s labels and its validation counts ``val``'s: those blocks, and
    only those, were read by each pass."""
    np.testing.assert_array_equal(ds["count"].values, labels(train, ds.sizes["vocab"]))
    np.testing.assert_array_equal(ds["val_count"].values, labels(val, ds.sizes["vocab"]))
    assert ds.attrs["train_tokens"] == train[:, 1:].size and ds.attrs["val_tokens"] == val[:, 1:].size


def cached_blocks(store) -> tuple[np.ndarray, np.ndarray]:
    """The blocks text was tokenized into for this extraction (the token cache beside the store): (train, val)."""
    found = sorted((np.load(f) for f in store.with_name(store.name + ".tokens").glob("*.npy")), key=len)
    assert len(found) == 2, [f.shape for f in found]
    return found[1], found[0]


def assert_disjoint(train: np.ndarray, val: np.ndarray) -> None:
    assert len(train) and len(val)
    assert not {r.tobytes() for r in train} & {r.tobytes() for r in val}, "a block is in both passes"


def assert_held_out(out: str, ds, data, pct: int = 5) -> None:
    assert ds.attrs["val_held_out"] == pct and ds.attrs["val_dataset"] == str(data)
    assert ds.attrs["split"] == f"train[{pct}%:]" and ds.attrs["val_split"] == f"train[:{pct}%]"
    said = [line for line in out.splitlines() if "held out" in line]
    assert len(said) == 1 and f"first {pct}%" in said[0] and str(data) in said[0], out
    assert json.loads(ds.attrs["config"])["val_held_out"] == pct


def assert_first_rows_held_out(out: str, ds, store, data, rows: list[str], tokenizer) -> None:
    """The first 30 of the 600 text rows (5%) were validated on, the rest trained on, as run_clm splits them: the
    blocks read, their statistics, disjoint, and said."""
    train, val = cached_blocks(store)
    np.testing.assert_array_equal(val, text_blocks(rows[:30], tokenizer))
    np.testing.assert_array_equal(train, text_blocks(rows[30:], tokenizer))
    assert_read(ds, train, val)
    assert_disjoint(train, val)
    assert_held_out(out, ds, data)


@pytest.mark.parametrize("name", ["snippet.txt", "validation.txt"])
def test_a_text_file_alone_holds_out_its_first_rows(name, model, corpus, tokenizer, tmp_path):
    """`--dataset data/snippet.txt` (and the issue's `--dataset data/validation.txt --tag heldout`) with nothing
    beside it: rows [:30] validate, rows [30:] train, exactly run_clm's split strings."""
    rows = lines_of(corpus)
    data = tmp_path / "data" / name
    data.parent.mkdir()
    data.write_text("".join(rows))
    store = tmp_path / "s.zarr"
    extra = ("--tag", "heldout") if name == "validation.txt" else ()
    out, ds = extract(model, data, store, *extra, group="model@heldout/final" if extra else "model/final")
    assert_first_rows_held_out(out, ds, store, data, rows, tokenizer)


def planted_blocks(vocab: int, n: int = 40, k: int = 2, seed: int = 0) -> np.ndarray:
    """``n`` blocks, the first ``k`` (5% of 40) drawn from the lower half of the vocabulary, the rest from the upper
    half: a class a pass counts in the other half is a block it should not have read."""
    rng = np.random.default_rng(seed)
    low = rng.integers(0, vocab // 2, (k, BLOCK))
    high = rng.integers(vocab // 2, vocab, (n - k, BLOCK))
    return np.concatenate([low, high]).astype(np.int64)


@pytest.mark.parametrize("form", ["npy-1d", "npy-2d", "bin"])
def test_a_token_file_alone_holds_out_its_first_blocks(form, model, tmp_path):
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    blocks = planted_blocks(vocab)
    data = tmp_path / {"npy-1d": "tokens.npy", "npy-2d": "tokens2d.npy", "bin": "tokens.bin"}[form]
    if form == "bin":
        blocks.ravel().astype(np.uint16).tofile(data)
    else:
        np.save(data, blocks if form == "npy-2d" else blocks.ravel())
    out, ds = extract(model, data, tmp_path / "s.zarr", "--block-size", BLOCK)
    assert_read(ds, blocks[2:], blocks[:2])
    assert ds["count"].values[:vocab // 2].sum() == 0 and ds["val_count"].values[vocab // 2:].sum() == 0
    assert_held_out(out, ds, data)


@pytest.mark.parametrize("kind", ["DatasetDict", "Dataset"])
def test_a_saved_dataset_without_a_validation_split_holds_out_its_first_rows(kind, model, corpus, tokenizer,
                                                                            tmp_path):
    import datasets

    rows = lines_of(corpus)
    data = tmp_path / "saved"
    saved = datasets.Dataset.from_dict({"text": rows})
    (datasets.DatasetDict({"train": saved}) if kind == "DatasetDict" else saved).save_to_disk(data)
    store = tmp_path / "s.zarr"
    out, ds = extract(model, data, store)
    assert_first_rows_held_out(out, ds, store, data, rows, tokenizer)


def test_validation_found_is_used_and_nothing_is_held_out(model, corpus, tokenizer, tmp_path):
    """A sibling validation.txt beside train.txt: the whole train file trains, the sibling validates, the record
    (and so the hash of stores made before this option) is unchanged."""
    d = tmp_path / "data"
    d.mkdir()
    rows = lines_of(corpus)
    (d / "train.txt").write_text("".join(rows[:300]))
    (d / "validation.txt").write_text("".join(rows[300:]))
    out, ds = extract(model, d / "train.txt", tmp_path / "s.zarr")
    assert_read(ds, text_blocks(rows[:300], tokenizer), text_blocks(rows[300:], tokenizer))
    assert ds.attrs["val_held_out"] is None and ds.attrs["split"] == "train"
    assert ds.attrs["val_dataset"] == str(d / "validation.txt") and "held out" not in out
    assert json.loads(ds.attrs["config"])["val_held_out"] is None


def test_percentage_zero_keeps_the_old_behaviour_and_a_changed_default_is_refused(model, corpus, tmp_path):
    rows = lines_of(corpus)
    data = tmp_path / "snippet.txt"
    data.write_text("".join(rows))
    store = tmp_path / "s.zarr"
    _, ds = extract(model, data, store, "--val-split-percentage", 0)
    assert ds.attrs["val_held_out"] is None and ds.attrs["split"] == "train" and ds.attrs["val_dataset"] == str(data)
    np.testing.assert_array_equal(ds["count"].values, ds["val_count"].values)  # the same tokens, as before
    r = run_cli("extract", model, "--dataset", data, "--store", store, "--samples-per-class", 0, ok=False)
    (line,) = [x for x in r.output.splitlines() if "Error:" in x]
    assert "'train' -> 'train[5%:]'" in line and "val_held_out: None -> 5" in line and "--overwrite" in line
    tokens = tmp_path / "t.npy"
    np.save(tokens, np.arange(10 * BLOCK) % 50)
    r = run_cli("extract", model, "--dataset", tokens, "--store", tmp_path / "t.zarr", "--val-split-percentage", 0,
                ok=False)
    assert "no validation tokens found" in r.output and "--val-split-percentage" in r.output
    assert not (tmp_path / "t.zarr").exists()


def test_a_slice_without_validation_is_refused_with_the_fix(model, corpus, tmp_path):
    data = tmp_path / "snippet.txt"
    shutil.copy(corpus["train"], data)
    r = run_cli("extract", model, "--dataset", data, "--split", "train[:50%]", "--store", tmp_path / "s.zarr",
                ok=False)
    assert "--val-split" in r.output and "slice" in r.output and not (tmp_path / "s.zarr").exists()


def test_the_record_names_the_held_out_part(trained_run):
    from ncanalyze.store.extraction.config import (
        config_hash,
        config_record,
        layer_plan,
    )
    from ncanalyze.store.extraction.settings import ExtractConfig
    from ncanalyze.store.sources.discover import discover

    ck = discover(trained_run)[0]
    cfg = ExtractConfig(dataset="d.txt")
    cpu = torch.device("cpu")
    plan = layer_plan(cfg, 2)
    plain = config_record(ck, cfg, cpu, 32, "v.txt", "validation", plan)
    held = config_record(ck, cfg, cpu, 32, "d.txt", "train[:5%]", plan, held_out=5)
    assert plain["val_held_out"] is None and plain["split"] == "train"
    assert held["val_held_out"] == 5 and held["split"] == "train[5%:]" and held["val_split"] == "train[:5%]"
    assert config_hash(plain) != config_hash(held)
    assert config_hash(plain) == config_hash(config_record(ck, ExtractConfig(dataset="d.txt", val_split_percentage=0),
                                                           cpu, 32, "v.txt", "validation", plan))


def test_slices_of_token_blocks_follow_datasets_rounding(tmp_path):
    """A token file's split slices count blocks as datasets counts rows (percentages rounded to the closest)."""
    from datasets import ReadInstruction
    from ncanalyze.store.data.blocks import open_blocks, slice_bounds

    for n in (1, 19, 20, 21, 39, 101, 1000):
        for spec in ("train[:5%]", "train[5%:]", "train[:50%]", "train[3:7]"):
            (want,) = ReadInstruction.from_spec(spec).to_absolute({"train": n})
            assert slice_bounds(spec, n) == (want.from_, want.to), (spec, n)
    ids = np.arange(100 * 4, dtype=np.int64)
    np.save(tmp_path / "t.npy", ids)
    val = np.concatenate(list(open_blocks(str(tmp_path / "t.npy"), "train[:5%]", 4, None, "text", None).batches(8)))
    train = np.concatenate(list(open_blocks(str(tmp_path / "t.npy"), "train[5%:]", 4, None, "text", None).batches(8)))
    np.testing.assert_array_equal(val, ids[:20].reshape(5, 4))
    np.testing.assert_array_equal(train, ids[20:].reshape(95, 4))
