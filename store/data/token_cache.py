"""Tokenize once: text data tokenized into blocks on first use and kept beside the store, reused by every checkpoint.

``<store>.tokens/<key>.npy`` holds the blocks (int32, blocks x block_size) of one text source; the key is a hash of
what determines them: the dataset spec, split and text column, the content (sha256) of local data files, the
tokenizer's content, the block size, the token cap (none under ``--cap-mode spread``, whose cache holds the whole
split and the cap picks blocks from it) and the line-break setting. The file is written under a
temporary name and renamed when complete, so a killed run or a second writer never leaves half a cache; beside it,
``<key>.npy.sha256`` (written first, also renamed into place) holds the file's sha256. A cache file is verified
against it when a process first reads it: altered ids, a truncated file or a missing checksum are said in one log
line and the cache is tokenized again. Being a memory-mapped 2-D token file, it gives the progress bars and the
estimate their totals. Each file is hashed once per process while its size, times and inode stay the same.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
from ncanalyze.core.errors import UserError
from ncanalyze.store.bars import progress_bar
from ncanalyze.store.data.blocks import Blocks

VERSION = 3  # 3: text grouped per 1,000 rows as run_clm's group_texts; bump when the cache's format or the tokenization recipe changes

log = logging.getLogger("ncanalyze")
_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime, ctime, inode) -> sha256 of the content, for this process


def file_digest(path: Path) -> str:
    """The sha256 of a file's content, streamed once; remembered for this process while its stat is unchanged (an
    edit changes the ctime, which no one can set back)."""
    key = _stat_key(path)
    if key not in _DIGESTS:
        with open(path, "rb") as f:
            _DIGESTS[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _DIGESTS[key]


def _stat_key(path: Path) -> tuple:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def data_fingerprint(spec: str) -> list:
    """Local files: (relative path, sha256 of the content) of each; a Hub dataset: its name only (no revision
    known)."""
    p = Path(spec)
    if p.is_file():
        return [[p.name, file_digest(p)]]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        return [[str(f.relative_to(p)), file_digest(f)] for f in files]
    return [spec]


def tokenizer_fingerprint(tokenizer) -> str | None:
    """A hash of what the tokenizer does: a fast tokenizer's full serialisation (model, normaliser, pre-tokeniser,
    post-processor with any BOS/EOS template), else its class, vocabulary and special tokens; None without one. The
    groups' attribute ``tokenizer_sha256``, the same for the same tokenizer wherever it was loaded from."""
    if tokenizer is None:
        return None
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
        with os.fdopen(fd, "wb") as f, progress_bar(total=rows.total if rows else blocks.total,
                                                    unit="row" if rows else "block",
                                                    desc=f"tokenizing {blocks.spec}", leave=False) as bar:
            for b in blocks.batches(batch):
                f.write(np.ascontiguousarray(b, dtype="<i4").tobytes())
                n += len(b)
                bar.update(min(rows.done, bar.total or rows.done) - bar.n if rows else len(b))
        header = io.BytesIO()
        np.lib.format.write_array_header_2_0(header, {"descr": "<i4", "fortran_order": False,
                                                      "shape": (n, blocks.block_size)})
        sha = hashlib.sha256(header.getvalue())
        with open(tmp, "wb") as out, open(raw, "rb") as f:
            out.write(header.getvalue())
            while chunk := f.read(1 << 24):
                out.write(chunk)
                sha.update(chunk)
        side = tmp.with_name(tmp.name + ".sha256")
        side.write_text(sha.hexdigest())
        os.replace(side, _checksum_path(path))  # first: a kill before the next line leaves a cache that fails it
        os.replace(tmp, path)
        _DIGESTS[_stat_key(path)] = sha.hexdigest()
    except BaseException:
        raw.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # a failed first use leaves no empty cache folder (rmdir: only if empty)
            path.parent.rmdir()
        raise
    finally:
        raw.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
        tmp.with_name(tmp.name + ".sha256").unlink(missing_ok=True)


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _intact(path: Path) -> str | None:
    """None when the cache file at ``path`` has the sha256 its checksum file holds, else what is wrong."""
    try:
        want = _checksum_path(path).read_text().strip().lower()
    except FileNotFoundError:
        return f"it has no checksum ({_checksum_path(path).name})"
    except (OSError, UnicodeDecodeError):
        return f"its checksum ({_checksum_path(path).name}) is unreadable"
    return None if file_digest(path) == want else "its content does not match its sha256 (altered or truncated)"


def cached(folder: Path, blocks: Blocks, key: str) -> Blocks:
    """``blocks`` (tokenized text) from the cache in ``folder`` (a store's ``layout.tokens``), writing it first if it
    is not there yet: the same blocks, with their number known."""
    path = Path(folder) / f"{key}.npy"
    if path.is_dir() or _checksum_path(path).is_dir():
        raise UserError(f"{path} or its .sha256 is a folder where the token cache keeps a file: move it away, or pass "
                        "--no-token-cache")
    if path.is_file() and (wrong := _intact(path)):
        log.warning("token cache %s: %s; tokenizing %s again", path, wrong, blocks.spec)
        path.unlink(missing_ok=True)
    if not path.is_file():
        _write(blocks, path)
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    at = lambda i: np.asarray(arr[i], dtype=np.int64)  # noqa: E731
    return Blocks(blocks.spec, blocks.block_size, None, arr.shape[0], lambda: map(at, range(arr.shape[0])), at=at,
                  source=path)
