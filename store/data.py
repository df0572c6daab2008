"""Token blocks from any data form of SPEC section 2: Hub or local datasets, text/json/parquet, .npy, nanoGPT .bin."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ncanalyze.analyzer.errors import UserError

TEXT_SUFFIXES = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
                 ".csv": "csv"}
TOKEN_SUFFIXES = (".npy", ".bin")
_VAL_NAMES = ("validation", "valid", "val", "test")


@dataclass
class Blocks:
    """A deterministic stream of token blocks (each ``block_size`` long, int64), at most ``max_blocks``."""
    spec: str
    block_size: int
    max_blocks: int | None
    n_blocks: int | None  # known length (token files), else None
    _iter: Callable[[], Iterator[np.ndarray]]

    def batches(self, batch_size: int, skip: int = 0) -> Iterator[np.ndarray]:
        """Batches of blocks (b x block_size), skipping the first ``skip`` batches."""
        buf, done = [], 0
        for i, block in enumerate(self._iter()):
            if self.max_blocks is not None and i >= self.max_blocks:
                break
            buf.append(block)
            if len(buf) == batch_size:
                if done >= skip:
                    yield np.stack(buf)
                buf, done = [], done + 1
        if buf and done >= skip:
            yield np.stack(buf)

    @property
    def total(self) -> int | None:
        known = [n for n in (self.n_blocks, self.max_blocks) if n is not None]
        return min(known) if known else None


def is_token_file(spec: str) -> bool:
    return spec.endswith(TOKEN_SUFFIXES)


def default_val_spec(spec: str, val_split: str) -> tuple[str, str]:
    """The validation data of ``spec``: a sibling file such as ``val.bin`` beside ``train.bin``, else a split."""
    p = Path(spec)
    if p.is_file():
        stem = p.name
        for a in ("train", "training"):
            if a in stem:
                for v in _VAL_NAMES:
                    cand = p.with_name(stem.replace(a, v, 1))
                    if cand.is_file():
                        return str(cand), val_split
        if is_token_file(spec):
            raise UserError(f"no validation tokens found beside {spec} (looked for val/validation/valid/test "
                            "files named like it); pass --val-dataset FILE, or --max-val-tokens 0 to skip NC4")
    return spec, val_split


def open_blocks(spec: str, split: str, block_size: int, max_tokens: int | None, text_column: str,
                tokenize: Callable[[list[str]], list[list[int]]] | None, keep_linebreaks: bool = True) -> Blocks:
    """Open ``spec`` as a stream of blocks; text is tokenized with ``tokenize`` and grouped like ``run_clm``; plain
    text files keep their line breaks unless ``keep_linebreaks`` is false."""
    max_blocks = None if max_tokens is None else max_tokens // block_size
    if is_token_file(spec):
        arr = _token_array(spec)
        if arr.ndim == 1:
            n = len(arr) // block_size
            rows = lambda: (np.asarray(arr[i * block_size:(i + 1) * block_size], dtype=np.int64) for i in range(n))
        else:
            n = arr.shape[0]
            rows = lambda: (np.asarray(r, dtype=np.int64) for r in arr)
            block_size = arr.shape[1]
            max_blocks = None if max_tokens is None else max_tokens // block_size
        return Blocks(spec, block_size, max_blocks, n, rows)
    if tokenize is None:
        raise UserError(f"{spec} is text and needs a tokenizer: none was found beside the checkpoint or its run; "
                        "pass --tokenizer PATH_OR_NAME")
    texts = _text_rows(spec, split, text_column, keep_linebreaks=keep_linebreaks)

    def grouped() -> Iterator[np.ndarray]:
        pending = np.zeros(0, dtype=np.int64)
        for chunk in texts():
            ids = tokenize(chunk)
            pending = np.concatenate([pending, np.fromiter((t for doc in ids for t in doc), dtype=np.int64)])
            n = len(pending) // block_size
            yield from pending[:n * block_size].reshape(n, block_size)
            pending = pending[n * block_size:]

    return Blocks(spec, block_size, max_blocks, None, grouped)


def _token_array(spec: str) -> np.ndarray:
    p = Path(spec)
    if not p.is_file():
        raise UserError(f"token file {spec} does not exist")
    if p.suffix == ".bin":  # nanoGPT: a flat uint16 stream
        return np.memmap(p, dtype=np.uint16, mode="r")
    arr = np.load(p, mmap_mode="r", allow_pickle=False)
    if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"{spec} must hold integer token ids, 1-D (a stream) or 2-D (blocks x length); "
                        f"it has dtype {arr.dtype} and shape {arr.shape}")
    return arr


def _text_rows(spec: str, split: str, column: str, chunk: int = 1000,
               keep_linebreaks: bool = True) -> Callable[[], Iterator[list[str]]]:
    """A re-iterable source of text chunks from a Hub dataset, a local dataset folder or text-like files."""
    import datasets

    p = Path(spec)
    stream = "[" not in split  # streamed (nothing cached on disk), except slices like 'train[:95%]'
    try:
        if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                ds = _split(ds, split, spec)
        elif p.is_file():
            builder = TEXT_SUFFIXES.get(p.suffix.lower())
            if builder is None:
                raise UserError(f"{spec}: unknown file type {p.suffix!r}; use .txt, .json, .jsonl, .parquet, .csv, "
                                ".npy or .bin")
            name = split.split("[")[0]  # a single file is whichever split is asked for (slices apply)
            ds = datasets.load_dataset(builder, data_files={name: str(p)}, split=split, streaming=stream,
                                       **_text_options(builder, keep_linebreaks))
        elif p.exists() or "/" in spec and spec.startswith((".", "/")):
            if not p.exists():
                raise UserError(f"dataset {spec} does not exist")
            suffixes = {f.suffix.lower() for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")}
            text = suffixes and all(TEXT_SUFFIXES.get(x) == "text" for x in suffixes)
            ds = datasets.load_dataset(str(p), split=split, streaming=stream,
                                       **_text_options("text" if text else "", keep_linebreaks))
        else:  # a Hub name
            ds = datasets.load_dataset(spec, split=split, streaming=stream)
    except UserError:
        raise
    except ValueError as e:
        if "split" in str(e).lower() or "Unknown split" in str(e):
            raise UserError(f"dataset {spec} has no split {split!r}: pass --split/--val-split (slices like "
                            "'train[:95%]' work for local data) or --val-dataset FILE") from None
        raise UserError(f"cannot read dataset {spec}: {e}") from None
    except Exception as e:  # connection errors, missing files, malformed json ...
        raise UserError(f"cannot read dataset {spec} (split {split!r}): {type(e).__name__}: {e}".splitlines()[0]) \
            from None
    if ds.column_names is not None and column not in ds.column_names:  # a stream may not know its columns
        raise UserError(f"dataset {spec} has no column {column!r} (columns: {ds.column_names}); "
                        "pass --text-column")

    def rows() -> Iterator[list[str]]:
        yield from (b[column] for b in ds.select_columns([column]).iter(batch_size=chunk))

    return rows


def _text_options(builder: str, keep_linebreaks: bool = True) -> dict:
    """Plain text keeps its line breaks by default, as ``run_clm`` reads it (``keep_linebreaks=True``)."""
    return {"keep_linebreaks": keep_linebreaks} if builder == "text" else {}


def _split(dd, split: str, spec: str):
    if split not in dd:
        raise UserError(f"dataset {spec} has no split {split!r} (it has {list(dd)}); pass --split/--val-split "
                        "or --val-dataset")
    return dd[split]
