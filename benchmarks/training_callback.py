"""The callback's time per measurement against the Trainer's own evaluation on the same validation blocks.

    python benchmarks/training_callback.py                       # GPT-Neo width 128, 2 layers, vocab 8,192, CPU
    python benchmarks/training_callback.py --train-tokens 262144 --layers all

Trains a randomly initialised GPT-Neo with the stock Trainer on a token file, evaluating every ``--every`` steps on
the validation blocks, with ``NeuralCollapseCallback`` measuring on the same validation blocks and
``--train-tokens`` train tokens; prints, for each evaluation, the Trainer's ``eval_runtime`` beside the callback's
time (its train pass, validation pass and write), and their ratio; then the callback's overhead on the training: the
measurements' seconds over the training's own (the run's ``train_runtime`` less the measurements), with the line the
callback logs at its first measurement (its cost against the training before it, and the caps within 10%).

    python benchmarks/training_callback.py --width 64 --block-size 256 --steps 400 --every 200 \
        --train-tokens 65536 --val-tokens 16384 --train-threads 1      # the README example's shape and caps
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import (
    GPTNeoConfig,
    GPTNeoForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from ncanalyze.training import NeuralCollapseCallback


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--train-tokens", type=int, default=65536)
    p.add_argument("--val-tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--extract-layers", default="last", help="the callback's layers")
    p.add_argument("--batch-size", type=int, default=8, help="per-device train and eval batch")
    p.add_argument("--train-threads", type=int, default=None, help="torch threads of the training [default: torch's]")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train, val = (rng.integers(0, a.vocab, n, dtype=np.int64) for n in (a.train_tokens * 2, a.val_tokens))
        np.save(tmp / "train.npy", train)
        np.save(tmp / "val.npy", val)
        blocks = {k: v[: len(v) // a.block_size * a.block_size].reshape(-1, a.block_size).tolist()
                  for k, v in (("train", train), ("val", val))}
        data = {k: Dataset.from_dict({"input_ids": v, "labels": v}) for k, v in blocks.items()}
        model = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=a.vocab, max_position_embeddings=a.block_size,
                                               hidden_size=a.width, num_layers=a.layers, num_heads=4,
                                               attention_types=[[["global"], a.layers]], bos_token_id=0,
                                               eos_token_id=0))
        args = TrainingArguments(output_dir=str(tmp / "run"), per_device_train_batch_size=a.batch_size,
                                 per_device_eval_batch_size=a.batch_size, max_steps=a.steps, eval_strategy="steps",
                                 eval_steps=a.every, save_strategy="no", report_to=[], disable_tqdm=True,
                                 use_cpu=not torch.cuda.is_available())
        cb = NeuralCollapseCallback(tmp / "s.zarr", str(tmp / "train.npy"), str(tmp / "val.npy"),
                                    max_train_tokens=a.train_tokens, max_val_tokens=a.val_tokens,
                                    layers=a.extract_layers, block_size=a.block_size)
        trainer = Trainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["val"],
                          data_collator=default_data_collator, callbacks=[cb])
        if a.train_threads:
            torch.set_num_threads(a.train_threads)
        out = trainer.train()
        evals = [e["eval_runtime"] for e in trainer.state.log_history if "eval_runtime" in e]
        print(f"{'eval':>5} {'Trainer eval s':>15} {'callback s':>11} {'ratio':>6}")
        for i, (t, c) in enumerate(zip(evals, cb.seconds)):
            print(f"{i:>5} {t:>15.2f} {c:>11.2f} {c / t:>6.1f}")
        measured = sum(cb.seconds)
        trained = out.metrics["train_runtime"] - measured
        print(f"training {trained:.1f} s (its evaluations included), the callback {measured:.1f} s over "
              f"{len(cb.seconds)} measurements: overhead {measured / trained:.1%} (aim <= 10%); torch threads "
              f"{torch.get_num_threads()} in training; load average {os.getloadavg()[0]:.1f}")
        if cb.cost is not None:
            print("first measurement:", cb.cost.line("step"))


if __name__ == "__main__":
    main()
