"""Turn one plain-text file into a small language-modelling corpus: train/validation split, BPE, token streams.

    python examples/prepare_text.py kjv.txt data/ --vocab 1024

writes ``data/train.txt`` and ``data/validation.txt`` (every ``--val-every``-th chunk of ``--chunk-lines``
lines goes to validation, so both splits span the whole text), ``data/tokenizer/`` (a byte-level BPE trained
on the train split with ``tokenizers``), and ``data/train.npy`` / ``data/validation.npy``: the token id
streams of the two splits (line breaks kept, as ``run_clm`` keeps them). Training
(``train_sweep.py --train-tokens``) and ``ncanalyze extract --dataset`` then read exactly the same tokens.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def split_text(text_file: Path, out: Path, chunk_lines: int = 100, val_every: int = 20) -> tuple[Path, Path]:
    lines = text_file.read_text(encoding="utf-8").splitlines(keepends=True)
    chunks = [lines[i:i + chunk_lines] for i in range(0, len(lines), chunk_lines)]
    train, val = out / "train.txt", out / "validation.txt"
    train.write_text("".join(l for i, c in enumerate(chunks) if i % val_every != val_every - 1 for l in c))
    val.write_text("".join(l for i, c in enumerate(chunks) if i % val_every == val_every - 1 for l in c))
    return train, val


def token_stream(tokenizer, text_file: Path) -> np.ndarray:
    """The file's token ids as one stream, tokenized line by line with the line breaks kept."""
    lines = text_file.read_text(encoding="utf-8").splitlines(keepends=True)
    ids = [t for batch in range(0, len(lines), 10_000) for row in tokenizer(lines[batch:batch + 10_000])["input_ids"]
           for t in row]
    return np.asarray(ids, dtype=np.uint16 if len(tokenizer) <= 65_536 else np.int32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("text", type=Path, help="a UTF-8 text file")
    p.add_argument("out", type=Path, help="output folder")
    p.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size")
    p.add_argument("--chunk-lines", type=int, default=100, help="lines per split unit")
    p.add_argument("--val-every", type=int, default=20, help="every N-th chunk is validation (1/N of the text)")
    args = p.parse_args(argv)
    if not args.text.is_file() or args.text.stat().st_size == 0:
        raise SystemExit(f"error: {args.text} is not a non-empty file")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_sweep import train_tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    train, val = split_text(args.text, args.out, args.chunk_lines, args.val_every)
    tokenizer = train_tokenizer([train], args.vocab, args.out / "tokenizer")
    for f in (train, val):
        ids = token_stream(tokenizer, f)
        np.save(f.with_suffix(".npy"), ids)
        print(f"{f.with_suffix('.npy')}: {len(ids):,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
