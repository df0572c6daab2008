"""The callback's cost against the training, and whether the caps it advises keep it within 10%.

    python benchmarks/training_callback.py                       # GPT-Neo width 128, 2 layers, vocab 8,192, CPU
    python benchmarks/training_callback.py --train-tokens 262144 --layers all
    python benchmarks/training_callback.py --defaults --steps 60  # the callback given no caps: its default caps
    python benchmarks/training_callback.py --width 64 --block-size 256 --steps 400 --every 200 \
        --train-tokens 65536 --val-tokens 16384 --train-threads 1      # the README example's shape and caps
    python benchmarks/training_callback.py --suite                # all three below, the ratios in one run

Trains a randomly initialised GPT-Neo with the stock Trainer on a token file, evaluating every ``--every`` steps on
the validation blocks, with ``NeuralCollapseCallback`` measuring ``--train-tokens`` train and ``--val-tokens``
validation tokens (``--defaults``: no caps given, the callback's own, cost.default_caps: a quarter of the tokens trained
between two measurements and a quarter of that; the train file then holds exactly the tokens trained, one epoch);
prints, for each evaluation, the Trainer's ``eval_runtime`` beside the callback's time, then the callback's overhead
on the training: the measurements' seconds, their set-up done once included (and said apart), over the training's own
(the run's ``train_runtime`` less every measurement and the set-up), and the line the callback logs at its second
measurement (its cost against the training between the two, and the caps that keep it within 10%).

``--suite`` runs, in one process (the 60-step runs training under the callback's own thread policy, ``--train-threads
auto``, so that a load from others slows both alike): the README example (aim <= 10%), the defaults on a 60-step run
(aim <= 25%), the
60-step run with the default caps given (every step measured: its second measurement advises caps), and the 60-step
run again under the caps it advised (aim: its overhead within 10% / 1.5 - 10% x 1.5, so the advice is within 1.5x of
the caps that meet 10%).
"""
from __future__ import annotations

import argparse
import contextlib
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
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from ncanalyze.core import threads
from ncanalyze.training import NeuralCollapseCallback


class _Tick(TrainerCallback):
    """The training's thread policy (``--train-threads auto``) measured again between steps."""

    def on_step_end(self, args, state, control, **kwargs):
        threads.tick()


def parser() -> argparse.ArgumentParser:
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
    p.add_argument("--train-threads", default=None, help="torch threads of the training [default: torch's]; auto: "
                   "the callback's own policy (ncanalyze.core.threads: the cores other processes leave idle, "
                   "measured again as it trains), so that a load from others slows the training as it does the "
                   "callback (torch's 2 threads on a shared 2-core machine run 6-10x slower, the callback's 1 not)")
    p.add_argument("--defaults", action="store_true", help="give the callback no caps")
    p.add_argument("--suite", action="store_true", help="the README example, the defaults and their advice")
    return p


def run(a) -> tuple[float, NeuralCollapseCallback]:
    """One training with the callback: prints its measurements and overhead; returns (overhead, callback)."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n_train = a.steps * a.batch_size * a.block_size if a.defaults else a.train_tokens * 2
        train, val = (np.minimum(rng.zipf(1.2, n) - 1, a.vocab - 1).astype(np.int64) for n in (n_train, a.val_tokens))
        np.save(tmp / "train.npy", train)
        np.save(tmp / "val.npy", val)
        blocks = {k: v[: len(v) // a.block_size * a.block_size].reshape(-1, a.block_size).tolist()
                  for k, v in (("train", train), ("val", val))}
        data = {k: Dataset.from_dict({"input_ids": v, "labels": v}) for k, v in blocks.items()}
        torch.manual_seed(0)
        model = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=a.vocab, max_position_embeddings=a.block_size,
                                               hidden_size=a.width, num_layers=a.layers, num_heads=4,
                                               attention_types=[[["global"], a.layers]], bos_token_id=0,
                                               eos_token_id=0))
        args = TrainingArguments(output_dir=str(tmp / "run"), per_device_train_batch_size=a.batch_size,
                                 per_device_eval_batch_size=a.batch_size, max_steps=a.steps, eval_strategy="steps",
                                 eval_steps=a.every, save_strategy="no", report_to=[], disable_tqdm=True,
                                 use_cpu=not torch.cuda.is_available())
        caps = {} if a.defaults else {"max_train_tokens": a.train_tokens, "max_val_tokens": a.val_tokens}
        cb = NeuralCollapseCallback(tmp / "s.zarr", str(tmp / "train.npy"), str(tmp / "val.npy"),
                                    layers=a.extract_layers, block_size=a.block_size, **caps)
        trainer = Trainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["val"],
                          data_collator=default_data_collator, callbacks=[cb])
        before = torch.get_num_threads()
        if a.train_threads not in (None, "auto"):
            torch.set_num_threads(int(a.train_threads))
        with threads.policy("auto") if a.train_threads == "auto" else contextlib.nullcontext():
            trainer.add_callback(_Tick())
            out = trainer.train()
        torch.set_num_threads(before)
    evals = [e["eval_runtime"] for e in trainer.state.log_history if "eval_runtime" in e]
    print(f"{'eval':>5} {'Trainer eval s':>15} {'callback s':>11} {'ratio':>6}")
    for i, (t, c) in enumerate(zip(evals, cb.seconds)):
        print(f"{i:>5} {t:>15.2f} {c:>11.2f} {c / t:>6.1f}")
    measured = sum(cb.seconds)
    trained = out.metrics["train_runtime"] - measured - cb.setup_s
    overhead = (measured + cb.setup_s) / trained
    skipped = f", {len(cb.skips)} skipped by its budget" if cb.skips else ""
    print(f"training {trained:.1f} s (its evaluations included), the callback {measured:.1f} s over "
          f"{len(cb.seconds)} measurements{skipped} of {cb.cfg.max_train_tokens:,} + {cb.cfg.max_val_tokens:,} tokens "
          f"+ {cb.setup_s:.2f} s set-up done once: overhead {overhead:.1%} (the work that recurs alone "
          f"{measured / trained:.1%}); load average {os.getloadavg()[0]:.1f}", flush=True)
    if cb.cost is not None:
        print("second measurement:", cb.cost.line("step"), flush=True)
    return overhead, cb


def suite(p: argparse.ArgumentParser) -> None:
    """The README example, the defaults on 60 steps, and the 60 steps under the caps the defaults advised."""
    readme = p.parse_args("--width 64 --block-size 256 --steps 400 --every 200 --train-tokens 65536 "
                          "--val-tokens 16384 --train-threads 1".split())
    defaults = p.parse_args("--defaults --steps 60 --every 20 --train-threads auto".split())
    results = [("README example", 0.10, run(readme)[0]), ("defaults, 60 steps", 0.25, run(defaults)[0])]
    capped = p.parse_args("--steps 60 --every 20 --train-tokens 20480 --val-tokens 5120 --train-threads auto".split())
    over, cb = run(capped)  # the defaults' caps given: every step measured, and the advice said
    results.append(("caps 20,480 + 5,120 given, 60 steps", None, over))
    advised = cb.cost.within() if cb.cost is not None else None
    if advised and advised != (capped.train_tokens, capped.val_tokens):
        again = p.parse_args(f"--steps 60 --every 20 --train-tokens {advised[0]} --val-tokens {advised[1]} "
                             "--train-threads auto".split())
        over, mine = run(again)
        results.append((f"its advised caps {advised[0]:,} + {advised[1]:,}", 0.10, over))
        predicted, took = cb.cost.seconds_at(cb.cost.scale()), float(np.median(mine.seconds[1:] or mine.seconds))
        print(f"at the advised caps a measurement took {took:.2f} s (median after the first), predicted "
              f"{predicted:.2f} s (10% of the training between the capped run's measurements): {took / predicted:.2f}x "
              "(the advice's error, free of the two runs' different training speeds under a changing load)")
    elif cb.cost is not None:
        print("no caps advised: " + ("within 10% already" if advised else cb.cost.line("step")))
    print(f"{'run':<40} {'overhead':>9} {'aim':>6}")
    for name, aim, o in results:
        print(f"{name:<40} {o:>9.1%} {'' if aim is None else f'{aim:.0%}':>6}" + (
            "" if "advised" not in name else f"  (what meets 10% / the advice: ~{0.10 / o:.2f}x)"))
    print(f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} (a shared machine)")


def main() -> None:
    p = parser()
    a = p.parse_args()
    suite(p) if a.suite else run(a)


if __name__ == "__main__":
    main()
