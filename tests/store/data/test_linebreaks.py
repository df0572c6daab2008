"""--keep-linebreaks (default, as run_clm) / --no-keep-linebreaks on plain text; hashed only when not the default."""
from __future__ import annotations

import json

import ncanalyze.store
import numpy as np
import pytest
from conftest import lone_model, run_cli
from ncanalyze.store.extraction.config import config_hash, config_record
from ncanalyze.store.extraction.settings import ExtractConfig
from transformers import AutoTokenizer

BLOCK = 32


def blocks(path, tokenizer, keep: bool, max_tokens: int) -> np.ndarray:
    """run_clm's blocks (each batch of 1,000 lines grouped alone, its remainder dropped), the first that fit the cap."""
    lines, out = open(path).read().splitlines(keepends=keep), []
    for s in range(0, len(lines), 1000):
        ids = [t for doc in tokenizer(lines[s:s + 1000])["input_ids"] for t in doc]
        out += [ids[i:i + BLOCK] for i in range(0, len(ids) // BLOCK * BLOCK, BLOCK)]
    return np.array(out[:max_tokens // BLOCK], dtype=np.int64).reshape(-1, BLOCK)


@pytest.mark.slow
def test_linebreaks_kept_by_default_and_stripped_on_request(trained_run, corpus, tmp_path):
    ck = lone_model(trained_run, tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(str(ck))
    opts = ("--max-train-tokens", 2048, "--max-val-tokens", 512, "--samples-per-class", 0, "--cap-mode", "prefix")
    configs = {}
    for flag, keep in (("--keep-linebreaks", True), ("--no-keep-linebreaks", False)):
        store = tmp_path / f"{keep}.zarr"
        run_cli("extract", ck, "--dataset", corpus["train"], "--store", store, flag, *opts)
        ds = ncanalyze.store.open(store)["model/final"].to_dataset()
        want = blocks(corpus["train"], tok, keep, 2048)[:, 1:].ravel()
        np.testing.assert_array_equal(ds["count"].values, np.bincount(want, minlength=ds.sizes["vocab"]))
        configs[keep] = json.loads(ds.attrs["config"])
    assert configs[True]["keep_linebreaks"] is True and configs[False]["keep_linebreaks"] is False
    assert not np.array_equal(blocks(corpus["train"], tok, True, 2048), blocks(corpus["train"], tok, False, 2048))


def test_line_breaks_enter_the_config_hash(trained_run, tmp_path):
    """The record holds the setting either way; only it differs between the two, and so do the hashes."""
    import torch
    from ncanalyze.store.extraction.config import layer_plan
    from ncanalyze.store.sources.discover import discover

    ck = discover(trained_run)[0]

    def record(**kw):
        cfg = ExtractConfig(dataset="x.txt", **kw)
        return config_record(ck, cfg, torch.device("cpu"), 32, "v.txt", "validation", layer_plan(cfg, 2))

    rec, off = record(), record(keep_linebreaks=False)
    assert rec["keep_linebreaks"] is True and off["keep_linebreaks"] is False
    assert {k: v for k, v in off.items() if k != "keep_linebreaks"} == {k: v for k, v in rec.items()
                                                                        if k != "keep_linebreaks"}
    assert config_hash(rec) != config_hash(off)
