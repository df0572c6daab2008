"""Token blocks from any data form of SPEC section 2: Hub or local datasets, text/json/parquet, .npy, nanoGPT .bin.

A token cap (``--max-train-tokens``/``--max-val-tokens``) reads whole blocks spread over the whole split
(:func:`spread`, ``--cap-mode spread``, the default) or its first blocks (``--cap-mode prefix``).
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ncanalyze.core.errors import UserError
from ncanalyze.core.setting import CAP_MODES, default
from ncanalyze.store.sources.discover import looks_local

TEXT_SUFFIXES = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
                 ".csv": "csv"}
TOKEN_SUFFIXES = (".npy", ".bin")
VAL_NAMES = ("validation", "valid", "val", "test")
GROUP_ROWS = 1000  # run_clm groups each batch of this many rows of text (datasets.map's default batch_size) apart

log = logging.getLogger(__name__)


@dataclass
class Rows:
    """How many rows of a text source have been read (``done``), of how many (``total``, None where it can't be known
    up front; counted on first use, since that may read the files): the tokenizing progress bar's count."""
    count: Callable[[], int | None]
    done: int = 0

    @functools.cached_property
    def total(self) -> int | None:
        try:
            return self.count()
        except (OSError, ValueError):  # a file gone or malformed (pyarrow's errors are both): the read will say
            return None


@dataclass
class Blocks:
    """A deterministic stream of token blocks (each ``block_size`` long, int64), at most ``max_blocks``."""
    spec: str
    block_size: int
    max_blocks: int | None
    n_blocks: int | None  # known length (token files), else None
    _iter: Callable[[], Iterator[np.ndarray]]
    rows_from_file: bool = False  # the block length is the width of a 2-D token array, not --block-size
    text_rows: Rows | None = None  # text: its rows read so far, of how many
    at: Callable[[int], np.ndarray] | None = None  # block i (of n_blocks) read directly, where the data allows
    whole: Blocks | None = None  # the whole split the cap draws from, where at hand (split_counts.label_counts)
    source: Path | None = None  # the token cache file these blocks are read from, if any
    labels: Blocks | None = None  # --labels file:PATH, read as these blocks are, block for block (labels.labelled)

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """Batches of blocks (b x block_size); a resume reads the batches it holds again, to check them."""
        buf = []
        for i, block in enumerate(self._iter()):
            if self.max_blocks is not None and i >= self.max_blocks:
                break
            buf.append(block)
            if len(buf) == batch_size:
                yield np.stack(buf)
                buf = []
        if buf:
            yield np.stack(buf)

    def labelled(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """(token ids, the label file's classes or None) of each batch, read block for block."""
        if self.labels is None:
            yield from ((b, None) for b in self.batches(batch_size))
            return
        yield from zip(self.batches(batch_size), self.labels.batches(batch_size))

    @property
    def total(self) -> int | None:
        known = [n for n in (self.n_blocks, self.max_blocks) if n is not None]
        return min(known) if known else None


def is_token_file(spec: str) -> bool:
    return spec.endswith(TOKEN_SUFFIXES)


def base_split(split: str) -> str:
    """The split's name without its slice.

    Parameters
    ----------
    split
        A split, e.g. ``train[:5%]``.

    Returns
    -------
    str
        Its name, e.g. ``train``.
    """
    return split.split("[")[0]


def slice_bounds(split: str, n: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of ``n`` that ``split`` selects, by ``datasets``' own reading of a split string
    (``train[:5%]``, ``train[5%:]``, ``train[10:200]``; percentages rounded as ``datasets`` rounds them).

    Parameters
    ----------
    split
        A split, with or without a slice.
    n
        The rows (or blocks) of the whole split.

    Returns
    -------
    tuple of int
        Start and stop.
    """
    if "[" not in split:
        return 0, n
    from datasets import ReadInstruction

    try:
        (bounds,) = ReadInstruction.from_spec(split).to_absolute({base_split(split): n})
    except (ValueError, AssertionError) as e:
        raise UserError(f"split {split!r} is not a slice of one split ({_first_line(e)}); write it like "
                        "'train[:5%]' or 'train[100:200]'") from None
    return bounds.from_, bounds.to


def open_blocks(spec: str, split: str, block_size: int, max_tokens: int | None, text_column: str,
                tokenize: Callable[[list[str]], list[list[int]]] | None, cap_flag: str | None = None,
                keep_linebreaks: bool = True, cap_mode: str = "spread", seed: int = default("seed")) -> Blocks:
    """Open ``spec`` as a stream of blocks; text is tokenized with ``tokenize`` and grouped exactly as ``run_clm``'s
    ``group_texts`` (each batch of 1,000 rows concatenated and cut, its remainder dropped); plain text files keep
    their line breaks unless ``keep_linebreaks`` is false. 1-D token streams are cut whole (remainder dropped).

    ``max_tokens`` caps the blocks read: ``cap_mode`` ``spread`` reads whole blocks spread over the whole split
    (:func:`spread`, drawn with ``seed``), ``prefix`` its first blocks. Bad data is a :class:`UserError` naming the
    file, here or (for text, read lazily) while iterating. ``cap_flag`` is the option ``max_tokens`` came from
    (``--max-train-tokens`` or ``--max-val-tokens``), named when the cap is below one block; a cap below one block is
    refused rather than read as an empty dataset.
    """
    if cap_mode not in CAP_MODES:
        raise UserError(f"cap mode {cap_mode!r} is not one of {', '.join(CAP_MODES)}")
    blocks = _open(spec, split, block_size, max_tokens, text_column, tokenize, cap_flag, keep_linebreaks)
    return spread(blocks, seed) if cap_mode == "spread" else blocks


def _open(spec: str, split: str, block_size: int, max_tokens: int | None, text_column: str,
          tokenize: Callable[[list[str]], list[list[int]]] | None, cap_flag: str | None,
          keep_linebreaks: bool) -> Blocks:
    """:func:`open_blocks` with the cap read as a prefix (``max_blocks``)."""
    if is_token_file(spec):
        return _token_blocks(spec, split, block_size, max_tokens, cap_flag)
    _check_cap(max_tokens, block_size, spec, cap_flag, False)
    if tokenize is None:
        raise UserError(f"{spec} is text and needs a tokenizer: none was found beside the checkpoint or its run; "
                        "pass --tokenizer PATH_OR_NAME")
    texts, text_rows = _text_rows(spec, split, text_column, chunk=GROUP_ROWS, keep_linebreaks=keep_linebreaks)

    def grouped() -> Iterator[np.ndarray]:
        """run_clm's group_texts: each batch of GROUP_ROWS rows concatenated and cut, its remainder dropped."""
        n_blocks = 0
        for chunk in texts():
            ids = np.fromiter(itertools.chain.from_iterable(tokenize(chunk)), dtype=np.int64)
            n = len(ids) // block_size
            n_blocks += n
            yield from ids[:n * block_size].reshape(n, block_size)
        if n_blocks == 0:
            raise UserError(f"{spec} (split {split!r}) holds no full block of {block_size} tokens: it is empty or "
                            "shorter than one block; pass more text or a smaller --block-size")

    return Blocks(spec, block_size, _max_blocks(max_tokens, block_size), None, grouped, text_rows=text_rows)


def _token_blocks(spec: str, split: str, block_size: int, max_tokens: int | None, cap_flag: str | None) -> Blocks:
    """A token file's blocks (1-D ids cut whole, or the rows of a 2-D array), capped as a prefix; ``whole`` the
    uncapped split."""
    arr = _token_array(spec)
    if arr.ndim == 2:
        block_size = arr.shape[1]
    start, stop = slice_bounds(split, len(arr) // block_size if arr.ndim == 1 else arr.shape[0])
    n = stop - start  # the blocks of the split's slice (all of them without one), in order
    if arr.ndim == 1:
        at = lambda i: np.asarray(arr[(start + i) * block_size:(start + i + 1) * block_size], dtype=np.int64)
        what = f"{len(arr)} tokens"
    else:
        at = lambda i: np.asarray(arr[start + i], dtype=np.int64)
        what = f"{arr.shape[0]} rows"
    rows = lambda: (at(i) for i in range(n))
    _check_cap(max_tokens, block_size, spec, cap_flag, arr.ndim == 2)
    if n == 0:
        sliced = f" (split {split!r}, blocks {start}:{stop})" if "[" in split else ""
        raise UserError(f"{spec}{sliced} holds no full block of {block_size} tokens (it has {what}): it is empty "
                        f"or shorter than the block; pass more tokens"
                        f"{'' if arr.ndim == 2 else ' or a smaller --block-size'}"
                        f"{' or a larger --val-split-percentage' if sliced else ''}")
    whole = Blocks(spec, block_size, None, n, rows, rows_from_file=arr.ndim == 2, at=at)
    return dataclasses.replace(whole, max_blocks=_max_blocks(max_tokens, block_size), whole=whole)


def spread_picks(n: int, m: int, seed: int) -> np.ndarray:
    """The indices of ``m`` of ``n`` blocks spread over all of them: the ``n`` blocks cut into ``m`` equal strata
    ``[k n // m, (k + 1) n // m)``, one block drawn uniformly from each by numpy's generator seeded with ``seed``
    (sorted, so files are read front to back); all ``n``, in order, where ``m >= n``.

    Parameters
    ----------
    n
        The blocks of the split.
    m
        The blocks the cap allows.
    seed
        The seed (the ``seed`` setting).

    Returns
    -------
    numpy.ndarray
        The chosen indices, ascending.
    """
    if m >= n:
        return np.arange(n)
    edges = np.arange(m + 1, dtype=np.int64) * n // m
    return np.random.default_rng(seed).integers(edges[:-1], edges[1:])


def spread(blocks: Blocks, seed: int) -> Blocks:
    """``blocks`` with their cap (``max_blocks``, a prefix) read instead as whole blocks spread over the whole split
    (:func:`spread_picks`): the same blocks at every call with the same seed, so the same for every checkpoint, across
    a resume, in every shard and in the training callback. Where the number of blocks is not known up front (text
    read without the token cache), the split is read (and tokenized) once to count them, said in one log line,
    before the chosen blocks are read.

    Parameters
    ----------
    blocks
        The blocks, capped as a prefix (``max_blocks`` None: no cap, returned as they are, their own ``whole``).
    seed
        The seed.

    Returns
    -------
    Blocks
        The chosen blocks, ``whole`` the split they are drawn from.
    """
    m = blocks.max_blocks
    if m is None:  # the whole split: it is its own whole (split_counts.label_counts)
        return dataclasses.replace(blocks, whole=blocks.whole or blocks)

    def chosen(picks: np.ndarray) -> Iterator[np.ndarray]:
        if blocks.at is not None:
            yield from (blocks.at(int(i)) for i in picks)
            return
        want = iter(picks.tolist())
        nxt = next(want, None)
        for i, block in enumerate(blocks._iter() if nxt is not None else ()):
            if i == nxt:
                yield block
                nxt = next(want, None)
                if nxt is None:
                    return

    whole = dataclasses.replace(blocks, max_blocks=None)
    if blocks.n_blocks is not None:
        picks = spread_picks(blocks.n_blocks, m, seed)
        at = None if blocks.at is None else (lambda i: blocks.at(int(picks[i])))
        return dataclasses.replace(whole, n_blocks=len(picks), _iter=lambda: chosen(picks), at=at)

    @functools.cache
    def counted() -> np.ndarray:
        log.info("%s: text read as a stream, whose blocks are not known before it is tokenized: it is read once to "
                 "count them, then again for the %d spread over it that the cap allows", blocks.spec, m)
        return spread_picks(sum(1 for _ in blocks._iter()), m, seed)

    return dataclasses.replace(whole, max_blocks=m, _iter=lambda: chosen(counted()), at=None, whole=whole)


def _max_blocks(max_tokens: int | None, block_size: int) -> int | None:
    return None if max_tokens is None else max_tokens // block_size


def _check_cap(max_tokens: int | None, block_size: int, spec: str, cap_flag: str | None, rows_from_file: bool) -> None:
    """A token cap below one block reads nothing: say so, rather than blame the dataset for being empty."""
    if max_tokens is not None and max_tokens < block_size:
        flag = cap_flag or "--max-train-tokens/--max-val-tokens"
        lower = f" (the width of the rows of {spec})" if rows_from_file else " (or lower --block-size)"
        raise UserError(f"{flag} {max_tokens} is below one block of {block_size} tokens, so nothing of {spec} "
                        f"would be read; raise {flag} to at least {block_size}{lower}")


def check_block_size(block_size: int, n_positions: int | None, spec: str, rows_from_file: bool = False) -> None:
    """Refuse blocks longer than the model's positions (``n_positions`` None: the model has no such limit).

    A longer block either fails deep inside the model or, with relative/rotary positions, runs on positions the
    model never learnt: features of another model. Extraction must call this once per data source, after
    :func:`open_blocks`, as ``check_block_size(blocks.block_size, model_positions(config), blocks.spec,
    blocks.rows_from_file)``.
    """
    if n_positions is None or block_size <= n_positions:
        return
    if rows_from_file:
        raise UserError(f"the rows of {spec} are {block_size} tokens long, longer than the model's {n_positions} "
                        f"positions; cut them to at most {n_positions} tokens (e.g. save arr[:, :{n_positions}]) "
                        "or save a 1-D stream and pass --block-size")
    raise UserError(f"--block-size {block_size} is longer than the model's {n_positions} positions ({spec}); "
                    f"pass --block-size {n_positions} or less")


def _token_array(spec: str) -> np.ndarray:
    p = Path(spec)
    if not p.is_file():
        raise UserError(f"no such file or folder: {spec}" if not p.exists() else f"{spec} is a folder, not a token "
                        "file; pass a .npy or .bin file")
    if p.suffix == ".bin":  # nanoGPT: a flat uint16 stream
        size = p.stat().st_size
        if size == 0:
            raise UserError(f"{spec} is empty: a nanoGPT .bin is a stream of uint16 token ids; pass a non-empty file")
        if size % 2:
            raise UserError(f"{spec} has {size} bytes, an odd number: a nanoGPT .bin is a stream of uint16 token ids "
                            "(2 bytes each), so it is truncated or not a token file; write it again with "
                            "np.array(ids, dtype=np.uint16).tofile(path)")
        return np.memmap(p, dtype=np.uint16, mode="r")
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError) as e:  # object arrays (pickles), truncated headers, bytes that are not .npy
        why = ("it holds Python objects, or is not .npy at all" if "pickle" in str(e) or "Python objects" in str(e)
               else _first_line(e))
        raise UserError(f"{spec} is not a readable .npy of integer token ids ({why}); save the ids with "
                        "np.save(path, np.asarray(ids, dtype=np.int64))") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive named .npy
        arr.close()
        raise UserError(f"{spec} is an .npz archive, not a .npy array; save the token ids with np.save(path, ids)")
    if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"{spec} must hold integer token ids, 1-D (a stream) or 2-D (blocks x length); "
                        f"it has dtype {arr.dtype} and shape {arr.shape}")
    if arr.ndim == 2 and arr.shape[1] < 2:
        raise UserError(f"{spec} has rows of {arr.shape[1]} tokens (shape {arr.shape}): each row of a 2-D token "
                        "array is a block and needs at least 2 tokens (features predict the next token); "
                        "save blocks x length, or a 1-D stream")
    return arr


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _malformed_types() -> tuple[type[BaseException], ...]:
    """The exceptions that mean a data file's content is malformed, as ``datasets`` raises them on load or while
    streaming: bytes that are not UTF-8, JSON (lines) that do not parse (pyarrow, or the json module's fallback),
    CSV that does not parse (pandas), and datasets' own wrapper when it builds a split (non-streamed slices)."""
    import pyarrow as pa
    from datasets.exceptions import DatasetGenerationError
    from pandas.errors import ParserError

    return UnicodeDecodeError, pa.ArrowInvalid, json.JSONDecodeError, ParserError, DatasetGenerationError


def _malformed(spec: str, e: BaseException) -> UserError:
    """One line for a malformed file: the first specific cause in ``e``'s chain (datasets wraps the real error)."""
    import pyarrow as pa
    from pandas.errors import ParserError

    chain, c = [], e
    while c is not None and c not in chain:
        chain.append(c)
        c = c.__cause__ or c.__context__
    real = next((c for c in chain if isinstance(c, (UnicodeDecodeError, pa.ArrowInvalid, json.JSONDecodeError,
                                                     ParserError))), chain[-1])
    if isinstance(real, UnicodeDecodeError):
        return UserError(f"{spec} is not UTF-8 text ({real.reason} at byte {real.start}); re-encode it as UTF-8, "
                         "e.g. iconv -f latin1 -t utf-8")
    if isinstance(real, pa.ArrowInvalid) and spec.lower().endswith(".parquet"):
        return UserError(f"{spec} is not a readable parquet file ({_first_line(real)}); write it again, e.g. with "
                         "pandas.DataFrame.to_parquet")
    if isinstance(real, (pa.ArrowInvalid, json.JSONDecodeError)):
        return UserError(f"{spec} is not valid JSON ({_first_line(real)}); fix the file: .jsonl is one JSON object "
                         "per line, .json one list of objects")
    if isinstance(real, ParserError):
        return UserError(f"{spec} is not valid CSV ({_first_line(real)}); fix the file")
    return UserError(f"cannot read {spec}: {_first_line(real)}")


def _text_rows(spec: str, split: str, column: str, chunk: int = 1000,
               keep_linebreaks: bool = True) -> tuple[Callable[[], Iterator[list[str]]], Rows]:
    """A re-iterable source of text chunks from a Hub dataset, a local dataset folder or text-like files, and the
    count of its rows read (of :func:`_row_total`)."""
    import datasets

    p = Path(spec)
    stream = "[" not in split  # streamed (nothing cached on disk), except slices like 'train[:95%]'
    malformed = _malformed_types()
    try:
        if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
            ds = datasets.load_from_disk(str(p))  # a saved Dataset is the one split asked for (slices apply)
            ds = _split(ds, split, spec) if isinstance(ds, datasets.DatasetDict) else ds.select(range(
                *slice_bounds(split, len(ds))))
        elif p.is_file():
            builder = TEXT_SUFFIXES.get(p.suffix.lower())
            if builder is None:
                raise UserError(f"{spec}: unknown file type {p.suffix!r}; use .txt, .json, .jsonl, .parquet, .csv, "
                                ".npy or .bin")
            if _blank(p):
                raise UserError(f"{spec} is empty: it holds no text; pass a file with data")
            name = split.split("[")[0]  # a single file is whichever split is asked for (slices apply)
            ds = datasets.load_dataset(builder, data_files={name: str(p)}, split=split, streaming=stream,
                                       **_text_options(builder, keep_linebreaks))
        elif p.exists() or looks_local(spec):
            if not p.exists():
                raise UserError(f"no such file or folder: {spec}; check the path (a Hub name has no extension and "
                                "at most one /)")
            suffixes = {f.suffix.lower() for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")}
            text = suffixes and all(TEXT_SUFFIXES.get(x) == "text" for x in suffixes)
            ds = datasets.load_dataset(str(p), split=split, streaming=stream,
                                       **_text_options("text" if text else "", keep_linebreaks))
        else:  # a Hub name
            ds = datasets.load_dataset(spec, split=split, streaming=stream)
    except UserError:
        raise
    except StopIteration:  # datasets' json builder finds no first row to infer the columns from
        raise UserError(f"{spec} holds no rows: it is empty or whitespace; pass a file with data") from None
    except malformed as e:
        raise _malformed(spec, e) from None
    except ValueError as e:
        if "split" in str(e).lower() or "Unknown split" in str(e):
            raise UserError(f"dataset {spec} has no split {split!r}: pass --split/--val-split (slices like "
                            "'train[:95%]' work for local data) or --val-dataset FILE") from None
        raise UserError(f"cannot read dataset {spec}: {_first_line(e)}") from None
    except OSError as e:  # not found locally or on the Hub, no connection, no permission
        if e.errno == errno.ENOSPC:
            raise  # the CLI says how to free space and resume
        raise UserError(f"cannot read dataset {spec} (split {split!r}): {_first_line(e)}; pass a local file or "
                        "folder, or a Hub name that exists (the Hub needs a connection)") from None
    except datasets.exceptions.DatasetsError as e:  # datasets' other refusals (checksums, defunct datasets ...)
        raise UserError(f"cannot read dataset {spec} (split {split!r}): {_first_line(e)}") from None
    if ds.column_names is not None and column not in ds.column_names:  # a stream may not know its columns
        raise UserError(f"dataset {spec} has no column {column!r} (columns: {ds.column_names}); "
                        "pass --text-column")

    read = Rows(lambda: _row_total(ds, p, split))

    def rows() -> Iterator[list[str]]:
        """Chunks of text; a stream reads lazily, so malformed content surfaces here, named as a UserError."""
        read.done = 0
        try:
            for b in ds.select_columns([column]).iter(batch_size=chunk):
                texts = b[column]
                bad = next((t for t in texts if not isinstance(t, str)), texts)
                if bad is not texts:
                    raise UserError(f"column {column!r} of {spec} is not text (it holds {type(bad).__name__} "
                                    f"{str(bad)[:40]!r}); pass --text-column with a text column, or token ids as "
                                    ".npy/.bin")
                read.done += len(texts)
                yield texts
        except malformed as e:
            raise _malformed(spec, e) from None
        except KeyError as e:  # a stream that did not know its columns up front lacks the one asked for
            if e.args != (column,):
                raise
            raise UserError(f"dataset {spec} has no column {column!r}; pass --text-column") from None

    return rows, read


def _row_total(ds, p: Path, split: str) -> int | None:
    """The rows of a text source, where known without reading it: a dataset's length or its split's recorded size,
    else the lines of local .txt/.jsonl files (one row per line) and parquet's metadata; None otherwise."""
    import pyarrow.parquet as pq

    if hasattr(ds, "__len__"):
        return len(ds)
    info = (getattr(ds, "info", None) and ds.info.splits or {}).get(split.split("[")[0])
    if info is not None and info.num_examples:
        return int(info.num_examples)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
    if not files or any(f.suffix.lower() not in (".txt", ".text", ".jsonl", ".parquet") for f in files):
        return None
    return sum(pq.ParquetFile(f).metadata.num_rows if f.suffix.lower() == ".parquet" else _lines(f) for f in files)


def _lines(path: Path) -> int:
    """Lines of a text file (a last line without its break counts)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            n, last = n + block.count(b"\n"), block[-1:]
    return n + (last != b"\n")


def _blank(p: Path) -> bool:
    """An empty file, or a small one holding only whitespace."""
    size = p.stat().st_size
    return size == 0 or size < (1 << 16) and not p.read_bytes().strip()


def _text_options(builder: str, keep_linebreaks: bool = True) -> dict:
    """Plain text keeps its line breaks by default, as ``run_clm`` reads it (``keep_linebreaks=True``)."""
    return {"keep_linebreaks": keep_linebreaks} if builder == "text" else {}


def _split(dd, split: str, spec: str):
    """A split of a saved ``DatasetDict``, sliced as ``datasets`` slices (``train[:5%]``)."""
    if base_split(split) not in dd:
        raise UserError(f"dataset {spec} has no split {base_split(split)!r} (it has {list(dd)}); pass --split/--val-split "
                        "or --val-dataset")
    ds = dd[base_split(split)]
    return ds if "[" not in split else ds.select(range(*slice_bounds(split, len(ds))))
