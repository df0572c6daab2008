"""Tokenize once: text data tokenized into blocks on first use and kept beside the store, reused by every checkpoint.

``<store>.tokens/<key>.npy`` holds the blocks (int32, blocks x block_size) of one text source; the key is a hash of
what determines them: the dataset spec, split and text column, a fingerprint of local data files (paths, sizes,
modification times), the tokenizer's content, the block size, the token cap and the line-break setting. The file
is written under a temporary name and renamed when complete, so a killed run or a second writer never leaves half
a cache; being a memory-mapped 2-D token file, it gives the progress bars and the estimate their totals.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ncanalyze.store.data import Blocks
from ncanalyze.store.layout import StoreLayout

VERSION = 1  # bump when the cache's format or the tokenization recipe changes


def cache_dir(store: Path) -> Path:
    """The token cache's folder beside ``store`` (layout.py)."""
    return StoreLayout(store).tokens


def data_fingerprint(spec: str) -> list:
    """Local files: (relative path, size, mtime_ns) of each; a Hub dataset: its name only (no revision known)."""
    p = Path(spec)
    if p.is_file():
        st = p.stat()
        return [[str(p.resolve()), st.st_size, st.st_mtime_ns]]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        return [str(p.resolve())] + [[str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    return [spec]


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what the tokenizer does: a fast tokenizer's full serialisation (model, normaliser, pre-tokeniser,
    post-processor with any BOS/EOS template), else its class, vocabulary and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items()),
                           str(tokenizer.all_special_tokens)])
    return hashlib.sha256(text.encode()).hexdigest()


def cache_key(spec: str, split: str, text_column: str, tokenizer, block_size: int, max_tokens: int | None,
              keep_linebreaks: bool) -> str:
    record = {"version": VERSION, "spec": spec, "split": split, "text_column": text_column,
              "data": data_fingerprint(spec), "tokenizer": tokenizer_fingerprint(tokenizer), "block_size": block_size,
              "max_tokens": max_tokens, "keep_linebreaks": keep_linebreaks}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]


def _write(blocks: Blocks, path: Path, batch: int = 256) -> None:
    """The blocks as a 2-D int32 .npy at ``path``, streamed through a raw temporary file, renamed when complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, raw_name = tempfile.mkstemp(dir=path.parent, prefix=".raw-")
    raw = Path(raw_name)
    tmp = raw.with_name(raw.name.replace(".raw-", ".npy-"))
    try:
        n = 0
        rows = blocks.text_rows if blocks.total is None and blocks.text_rows else None  # no block count: count rows
        with os.fdopen(fd, "wb") as f, tqdm(total=rows.total if rows else blocks.total, unit="row" if rows else "block",
                                             desc=f"tokenizing {blocks.spec}", leave=False) as bar:
            for b in blocks.batches(batch):
                f.write(np.ascontiguousarray(b, dtype="<i4").tobytes())
                n += len(b)
                bar.update(min(rows.done, bar.total or rows.done) - bar.n if rows else len(b))
        with open(tmp, "wb") as out, open(raw, "rb") as f:
            np.lib.format.write_array_header_2_0(out, {"descr": "<i4", "fortran_order": False,
                                                       "shape": (n, blocks.block_size)})
            shutil.copyfileobj(f, out, 1 << 24)
        os.replace(tmp, path)
    finally:
        raw.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def cached(store: Path, blocks: Blocks, key: str) -> Blocks:
    """``blocks`` (tokenized text) from the cache, writing it first if it is not there yet: the same blocks, with
    their number known."""
    path = cache_dir(store) / f"{key}.npy"
    if not path.is_file():
        _write(blocks, path)
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    rows = lambda: (np.asarray(r, dtype=np.int64) for r in arr)  # noqa: E731
    return Blocks(blocks.spec, blocks.block_size, None, arr.shape[0], rows)
