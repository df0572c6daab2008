"""Train a depth x width grid of GPT-Neo language models with the stock Hugging Face Trainer.

The defaults follow Wu & Papyan, "Linguistic Collapse" (NeurIPS 2024), who trained GPT-Neo on TinyStories
with Hugging Face's ``run_clm.py``: the GPT-Neo tokenizer, 1,024-token blocks (``run_clm``'s default for
it), batch 16, AdamW at the Trainer's default learning rate, 1 epoch, alternating global/local attention
(window 256), 16 heads, weight decay 0, 0.0005 or 0.1, and seed replicas of one architecture. Every flag
can scale this down, e.g. for CPU (see examples/recipe_cpu.sh).

Each model becomes an ordinary Trainer output folder ``<out>/<run>/`` (``checkpoint-N/`` subfolders with
``trainer_state.json`` logging the eval loss at every checkpoint, the final model and tokenizer at its
root), named ``neo-L<depth>-d<width>-s<seed>`` (plus ``-wd<decay>`` when the decay is not 0), so
``ncanalyze extract <out>`` sees a folder of runs. A run that already finished is skipped.

    python examples/train_sweep.py --out runs/ --depths 1 2 4 --widths 64 128 --seeds 0   # TinyStories, Hub
    python examples/train_sweep.py --out runs/ --train-file train.txt --val-file val.txt \\
        --train-tokenizer 1024 --block-size 128 --max-steps 300 --save-steps 100 --lr 3e-3   # offline
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from itertools import chain
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PAPER_TOKENIZER = "EleutherAI/gpt-neo-125M"
PAPER_DATASET = "roneneldan/TinyStories"


def train_tokenizer(files: list[str | Path], vocab_size: int, out_dir: str | Path):
    """A byte-level BPE tokenizer (GPT-2 style) trained with ``tokenizers`` on local text files."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train([str(f) for f in files], vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>",
                                  eos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok.save_pretrained(str(out_dir))
    return tok


def _group_texts(block_size: int):
    def group(batch):
        joined = {k: list(chain(*batch[k])) for k in batch}
        n = len(joined["input_ids"]) // block_size * block_size
        out = {k: [v[i:i + block_size] for i in range(0, n, block_size)] for k, v in joined.items()}
        out["labels"] = [list(x) for x in out["input_ids"]]
        return out
    return group


def _tokenize_and_group(raw, tokenizer, block_size: int, text_column: str):
    def tokenize(batch):
        return tokenizer(batch[text_column])

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
    tokenized = tokenized.remove_columns([c for c in tokenized["train"].column_names if c != "input_ids"])
    return tokenized.map(_group_texts(block_size), batched=True)


def lm_datasets(train_files, val_files, tokenizer, block_size: int, text_column: str = "text"):
    """Tokenize text files (line breaks kept, as ``run_clm`` does) and cut them into ``block_size`` blocks
    (``run_clm``'s ``group_texts``: the stream of a map batch is cut, its remainder dropped)."""
    from datasets import load_dataset

    raw = load_dataset("text", data_files={"train": [str(f) for f in train_files],
                                           "validation": [str(f) for f in val_files]}, keep_linebreaks=True)
    return _tokenize_and_group(raw, tokenizer, block_size, text_column)


def hub_datasets(name: str, tokenizer, block_size: int, text_column: str = "text", max_train_samples=None):
    """A Hub dataset (or a local dataset folder) with train and validation splits, as ``run_clm`` reads it."""
    from datasets import load_dataset

    raw = load_dataset(name)
    if "validation" not in raw:
        raise SystemExit(f"error: dataset {name!r} has no 'validation' split (splits: {list(raw)})")
    if max_train_samples:
        raw["train"] = raw["train"].select(range(min(max_train_samples, len(raw["train"]))))
    return _tokenize_and_group(raw, tokenizer, block_size, text_column)


def _read_tokens(path: str | Path, block_size: int):
    import numpy as np

    path = Path(path)
    if path.suffix == ".bin":  # nanoGPT: a uint16 stream
        arr = np.memmap(path, dtype=np.uint16, mode="r")
    elif path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r")
    else:
        raise SystemExit(f"error: {path}: token files must be .npy (1-D stream or 2-D blocks) or nanoGPT .bin")
    if arr.ndim == 1:
        n = len(arr) // block_size * block_size
        arr = arr[:n].reshape(-1, block_size)
    return np.asarray(arr, dtype=np.int64)


def token_datasets(train_path, val_path, block_size: int):
    """Pre-tokenized data: 1-D streams are cut into ``block_size`` blocks, 2-D arrays used as given."""
    from datasets import Dataset, DatasetDict

    out = {}
    for split, path in (("train", train_path), ("validation", val_path)):
        blocks = _read_tokens(path, block_size).tolist()
        out[split] = Dataset.from_dict({"input_ids": blocks, "labels": blocks})
    return DatasetDict(out)


def neo_config(vocab_size: int, n_layer: int, width: int, n_head: int, block_size: int, *,
               attention: str = "global", tie_word_embeddings: bool = True, bos_token_id=None, eos_token_id=None):
    """GPT-Neo config. ``attention="alternating"`` is the paper's (and TinyStories') global/local pattern."""
    from transformers import GPTNeoConfig

    if attention == "alternating":
        types = [[["global", "local"], n_layer // 2]] + ([[["global"], 1]] if n_layer % 2 else [])
    else:
        types = [[["global"], n_layer]]
    return GPTNeoConfig(vocab_size=vocab_size, max_position_embeddings=block_size, hidden_size=width,
                        num_layers=n_layer, num_heads=n_head, attention_types=types, window_size=256,
                        intermediate_size=4 * width, tie_word_embeddings=tie_word_embeddings,
                        bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def train(train_files, val_files, tokenizer_dir, out_dir, *, n_layer: int = 2, width: int = 64, n_head: int = 4,
          block_size: int = 128, batch_size: int = 16, max_steps: int = 240, epochs: float = 1.0,
          learning_rate: float = 3e-3, weight_decay: float = 0.0, save_steps: int = 80, seed: int = 0,
          tie_word_embeddings: bool = True, data=None, vocab_size: int | None = None, attention: str = "global",
          lr_scheduler: str = "cosine", warmup_steps: int | None = None, save_only_model: bool = False,
          max_eval_blocks: int | None = None, quiet: bool = True, callbacks: list | None = None) -> Path:
    """Train one GPT-Neo with ``transformers.Trainer``; returns its output folder.

    ``data`` (a DatasetDict with train/validation blocks) replaces the text files, so a sweep tokenizes once;
    ``tokenizer_dir`` may then be None (token files), with ``vocab_size`` given. ``callbacks``: more Trainer callbacks
    (e.g. ``ncanalyze.training.NeuralCollapseCallback``).
    """
    from transformers import (
        AutoTokenizer,
        GPTNeoForCausalLM,
        Trainer,
        TrainingArguments,
        default_data_collator,
        set_seed,
    )

    set_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir is not None else None
    if data is None:
        data = lm_datasets(train_files, val_files, tokenizer, block_size)
    eval_data = data["validation"]
    if max_eval_blocks is not None and len(eval_data) > max_eval_blocks:
        eval_data = eval_data.select(range(max_eval_blocks))
    config = neo_config(vocab_size or len(tokenizer), n_layer, width, n_head, block_size, attention=attention,
                        tie_word_embeddings=tie_word_embeddings,
                        bos_token_id=tokenizer.bos_token_id if tokenizer else None,
                        eos_token_id=tokenizer.eos_token_id if tokenizer else None)
    model = GPTNeoForCausalLM(config)
    if warmup_steps is None:
        warmup_steps = max(1, max_steps // 20) if max_steps > 0 else 0
    args = TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size,
        max_steps=max_steps, num_train_epochs=epochs, learning_rate=learning_rate, weight_decay=weight_decay,
        warmup_steps=warmup_steps, lr_scheduler_type=lr_scheduler,
        eval_strategy="steps", eval_steps=save_steps, save_strategy="steps", save_steps=save_steps,
        logging_steps=save_steps, save_only_model=save_only_model, seed=seed, report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=quiet, log_level="warning" if quiet else "passive",
    )
    # Blocks are full length and carry their labels, so the default collator suffices (the LM collator with
    # pad = eos would hide every end-of-text label from the loss).
    trainer = Trainer(model=model, args=args, train_dataset=data["train"], eval_dataset=eval_data,
                      data_collator=default_data_collator, callbacks=callbacks)
    if quiet:  # no per-log prints or save progress bars; the losses are in trainer_state.json
        from transformers.trainer_callback import PrinterCallback
        from transformers.utils import logging as hf_logging

        trainer.remove_callback(PrinterCallback)
        hf_logging.disable_progress_bar()
    trainer.train()
    trainer.save_model()
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    metrics = trainer.evaluate()
    trainer.save_metrics("eval", metrics)
    return Path(out_dir)


def run_name(depth: int, width: int, seed: int, weight_decay: float = 0.0) -> str:
    """``neo-L2-d64-s0``; ``-wd0.1`` is appended when the weight decay is not 0."""
    name = f"neo-L{depth}-d{width}-s{seed}"
    return name + (f"-wd{weight_decay:g}" if weight_decay else "")


def _finished(run_dir: Path) -> bool:
    return (run_dir / "eval_results.json").exists() and (run_dir / "model.safetensors").exists()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Defaults are the paper's conventions (TinyStories, GPT-Neo "
        "tokenizer, block 1024, 1 epoch); every run becomes <out>/neo-L<depth>-d<width>-s<seed>/.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder receiving one Trainer output folder per run")
    d = p.add_argument_group("data (one of: a Hub dataset, local text files, token files)")
    d.add_argument("--dataset", default=PAPER_DATASET, help="Hub name or local dataset folder with train/validation")
    d.add_argument("--text-column", default="text")
    d.add_argument("--max-train-samples", type=int, help="use only the first N training documents")
    d.add_argument("--train-file", nargs="+", type=Path, help="local text file(s) for training")
    d.add_argument("--val-file", nargs="+", type=Path, help="local text file(s) for validation")
    d.add_argument("--train-tokens", type=Path, help=".npy (1-D stream or 2-D blocks) or nanoGPT .bin (uint16)")
    d.add_argument("--val-tokens", type=Path, help="validation token file, same formats")
    d.add_argument("--vocab-size", type=int, help="model vocabulary for token files without --tokenizer")
    t = p.add_argument_group("tokenizer")
    t.add_argument("--tokenizer", default=None,
                   help=f"Hub name or local folder (default: {PAPER_TOKENIZER}, or <out>/tokenizer if it exists)")
    t.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                   help="train a byte-level BPE of this size on --train-file, saved to <out>/tokenizer")
    m = p.add_argument_group("grid")
    m.add_argument("--depths", nargs="+", type=int, default=[2], help="numbers of layers")
    m.add_argument("--widths", nargs="+", type=int, default=[64], help="embedding dimensions")
    m.add_argument("--seeds", nargs="+", type=int, default=[0], help="seed replicas of every architecture")
    m.add_argument("--replicas", metavar="DEPTHxWIDTH", help="also train this architecture (e.g. 2x64) with "
                   "every --replica-seeds seed: seed replicas beside the grid, as in the paper's Table 1")
    m.add_argument("--replica-seeds", nargs="+", type=int, default=list(range(10)), help="seeds of --replicas")
    m.add_argument("--weight-decay", nargs="+", type=float, default=[0.0], help="paper: 0.0005 or 0.1")
    m.add_argument("--heads", type=int, default=16, help="attention heads (the paper: 16)")
    m.add_argument("--attention", choices=["alternating", "global"], default="alternating",
                   help="GPT-Neo attention layers: global/local alternating (paper) or all global")
    m.add_argument("--untied", action="store_true", help="separate output layer instead of tied embeddings")
    o = p.add_argument_group("training")
    o.add_argument("--block-size", type=int, default=1024)
    o.add_argument("--batch-size", type=int, default=16)
    o.add_argument("--epochs", type=float, default=1.0)
    o.add_argument("--max-steps", type=int, default=-1, help="overrides --epochs when > 0")
    o.add_argument("--save-steps", type=int, default=500, help="a checkpoint (and an eval loss) every N steps")
    o.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (AdamW)")
    o.add_argument("--lr-scheduler", default="linear", help="Trainer lr_scheduler_type")
    o.add_argument("--warmup-steps", type=int, default=0)
    o.add_argument("--max-eval-blocks", type=int, help="evaluate on the first N validation blocks only")
    o.add_argument("--save-optimizer", action="store_true",
                   help="keep optimizer state in checkpoints (needed only to resume training)")
    o.add_argument("--jobs", type=int, default=1,
                   help="train this many runs at once, in processes sharing the CPU cores (small models on "
                        "CPU: one per core is faster than one run using all cores)")
    o.add_argument("--verbose", action="store_true", help="Trainer progress bars and logs")
    return p


def _load_tokenizer(args):
    from transformers import AutoTokenizer

    tok_dir = args.out / "tokenizer"
    if args.train_tokenizer:
        if not args.train_file:
            raise SystemExit("error: --train-tokenizer needs --train-file (the text to train it on)")
        if not (tok_dir / "tokenizer.json").exists():
            print(f"training a {args.train_tokenizer}-token BPE on {len(args.train_file)} file(s) -> {tok_dir}")
            train_tokenizer(args.train_file, args.train_tokenizer, tok_dir)
        return tok_dir, AutoTokenizer.from_pretrained(str(tok_dir))
    name = args.tokenizer or (str(tok_dir) if (tok_dir / "tokenizer.json").exists() else None)
    if name is None and args.train_tokens:
        return None, None
    name = name or PAPER_TOKENIZER
    try:
        return name, AutoTokenizer.from_pretrained(name)
    except OSError as e:
        raise SystemExit(f"error: cannot load tokenizer {name!r} ({str(e).splitlines()[0]}); offline, pass "
                         "--tokenizer FOLDER or --train-tokenizer VOCAB with --train-file")


def _load_data(args, tokenizer):
    if args.train_tokens:
        if not args.val_tokens:
            raise SystemExit("error: --train-tokens needs --val-tokens")
        return token_datasets(args.train_tokens, args.val_tokens, args.block_size)
    if args.train_file:
        if not args.val_file:
            raise SystemExit("error: --train-file needs --val-file")
        for f in [*args.train_file, *args.val_file]:
            if not f.is_file():
                raise SystemExit(f"error: {f} is not a file")
        return lm_datasets(args.train_file, args.val_file, tokenizer, args.block_size, args.text_column)
    try:
        return hub_datasets(args.dataset, tokenizer, args.block_size, args.text_column, args.max_train_samples)
    except (OSError, ConnectionError, ValueError) as e:
        raise SystemExit(f"error: cannot load dataset {args.dataset!r} ({str(e).splitlines()[0]}); offline, "
                         "pass --train-file/--val-file or --train-tokens/--val-tokens")


_WORKER: dict = {}


def _setup(args, threads: int | None = None) -> None:
    """Load tokenizer and data (once per process); ``threads`` caps torch's threads in a worker process."""
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)
    tok_name, tokenizer = _load_tokenizer(args)
    vocab = args.vocab_size or (len(tokenizer) if tokenizer is not None else None)
    if vocab is None:
        raise SystemExit("error: token files without a tokenizer need --vocab-size")
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    _WORKER.update(args=args, tok_name=tok_name, vocab=vocab, data=_load_data(args, tokenizer))


def _train_one(job) -> tuple[str, float, float]:
    L, d, s, wd = job
    args, name = _WORKER["args"], run_name(*job)
    t0 = time.time()
    train(None, None, _WORKER["tok_name"], args.out / name, n_layer=L, width=d, n_head=args.heads,
          block_size=args.block_size, batch_size=args.batch_size, max_steps=args.max_steps, epochs=args.epochs,
          learning_rate=args.lr, weight_decay=wd, save_steps=args.save_steps, seed=s,
          tie_word_embeddings=not args.untied, data=_WORKER["data"], vocab_size=_WORKER["vocab"],
          attention=args.attention, lr_scheduler=args.lr_scheduler, warmup_steps=args.warmup_steps,
          save_only_model=not args.save_optimizer, max_eval_blocks=args.max_eval_blocks, quiet=not args.verbose)
    loss = json.loads((args.out / name / "eval_results.json").read_text())["eval_loss"]
    return name, loss, time.time() - t0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replicas and not re.fullmatch(r"\d+x\d+", args.replicas.lower()):
        raise SystemExit(f"error: --replicas {args.replicas!r} must be DEPTHxWIDTH, e.g. 2x64")
    for d in args.widths + ([int(args.replicas.lower().split("x")[1])] if args.replicas else []):
        if d % args.heads:
            raise SystemExit(f"error: width {d} is not divisible by --heads {args.heads}")
    _setup(args)  # trains the tokenizer if asked, and tokenizes the data once (the workers reuse the cache)
    data = _WORKER["data"]
    print(f"data: {len(data['train'])} train / {len(data['validation'])} validation blocks of {args.block_size} "
          f"tokens; vocabulary {_WORKER['vocab']}", flush=True)
    grid = [(L, d, s, wd) for wd in args.weight_decay for L in args.depths for d in args.widths for s in args.seeds]
    if args.replicas:
        L, d = map(int, args.replicas.lower().split("x"))
        grid += [job for job in ((L, d, s, wd) for wd in args.weight_decay for s in args.replica_seeds)
                 if job not in grid]
    todo = [job for job in grid if not _finished(args.out / run_name(*job))]
    if len(todo) < len(grid):
        print(f"{len(grid) - len(todo)} of {len(grid)} runs finished already, skipped")
    todo.sort(key=lambda j: -j[0] * j[1] * (j[1] + 32))  # biggest first, so parallel workers end together
    if args.jobs <= 1:
        results = map(_train_one, todo)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        threads = max(1, (os.cpu_count() or 1) // args.jobs)
        pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_setup, initargs=(args, threads))
        results = (f.result() for f in as_completed([pool.submit(_train_one, job) for job in todo]))
    for i, (name, loss, seconds) in enumerate(results, 1):
        print(f"[{i}/{len(todo)}] {name}: eval loss {loss:.3f} ({seconds:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
