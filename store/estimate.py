"""The line printed before extraction starts (what is left to do, how long it will take, the disk it needs), and the
memory check of the running state.

The time is measured, not guessed. On the first checkpoint that does work, its model load is timed, and on its first
train batch the extraction's own code is timed on a scratch state: the forward pass, a layer's float64 statistics
and reservoir, a layer's NC4 decisions over as many kept classes as the full train pass will keep (counted from the
train tokens), and the loss; a slice of the head is written the way the store writes. Then, over the checkpoints
to do,

    total = sum of  load + train batches left x (forward + k x statistics)
                    + validation batches left x (forward + k x decisions + loss) + group bytes / write rate

with k the layers of a pass (1 without ``--layers``; the loss only in the pass of the last layer), and the batches
left from each checkpoint's resume state (pass, phase, batches done), so work already done is left out.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from ncanalyze.analyzer.accumulate import DecisionCounts
from ncanalyze.analyzer.errors import UserError
from ncanalyze.store import io
from ncanalyze.store.data import Blocks
from ncanalyze.store.layers import Plan, auto_groups
from ncanalyze.store.load import head
from ncanalyze.store.loss import LogitTransform, NextTokenLoss
from ncanalyze.store.passes import check_ids, features
from ncanalyze.store.resume import UNREADABLE, Phase
from ncanalyze.store.running import LayerState

log = logging.getLogger(__name__)


def state_bytes(vocab: int, dim: int, samples_per_class: int, device: torch.device) -> tuple[int, int]:
    """(bytes per layer, bytes shared by the layers) of an extraction's running state on ``device``: per layer the
    float64 means, the per-class vectors (count, M2, 3 validation counts), the d x d scatter, and in the validation
    pass the kept means' float64 copy; shared, the head's float64 copy. The reservoir (CPU) counts on the CPU only."""
    per_layer = 2 * vocab * dim * 8 + 5 * vocab * 8 + dim * dim * 8
    if device.type == "cpu":
        per_layer += vocab * samples_per_class * (4 * dim + 16)
    return per_layer, vocab * dim * 8


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device``: torch.cuda.mem_get_info on CUDA, psutil's available memory on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
         "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(size: str | None) -> int | None:
    """The bytes of a ``--state-memory`` size.

    Parameters
    ----------
    size
        A number and a unit (B, KB, MB, GB, TB decimal; KiB, MiB, GiB, TiB binary), e.g. ``40GB``, ``512MiB``; None.

    Returns
    -------
    int or None
        The bytes (None for None).
    """
    if size is None:
        return None
    text = str(size).strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in UNITS or not value > 0 or value * UNITS[unit] > 2**62:
        raise UserError(f"--state-memory {size!r} is not a size: pass a number and a unit, like 40GB or 512MiB")
    return int(value * UNITS[unit])


def state_budget(device: torch.device, state_memory: int | None = None) -> int:
    """The bytes ``--layers-per-pass auto`` lets a pass's state take.

    Parameters
    ----------
    device : where the state lives.
    state_memory : ``--state-memory`` in bytes, or None.

    Returns
    -------
    int : ``state_memory`` where given, else the free memory of ``device`` (after the model is loaded) less a margin
    for the forward's activations and the validation's logits: a tenth of it, at least 1 GiB.
    """
    if state_memory is not None:
        return int(state_memory)
    free = available_bytes(device)
    return max(0, free - max(free // 10, 1 << 30))


def fit_plan(plan: Plan, vocab: int, dim: int, samples_per_class: int, device: torch.device,
             state_memory: int | None = None) -> Plan:
    """``plan`` with its passes fitted to the memory under ``--layers-per-pass auto`` (:func:`layers.auto_groups`
    with :func:`state_bytes` and :func:`state_budget`); any other plan as it is.

    Parameters
    ----------
    plan : the extraction's plan.
    vocab, dim : the head's shape.
    samples_per_class : the reservoir's samples per class.
    device : where the state lives.
    state_memory : ``--state-memory`` in bytes (None: the free memory less a margin).

    Returns
    -------
    Plan : the plan to run.
    """
    if not plan.auto:
        return plan
    fitted = auto_groups(plan, *state_bytes(vocab, dim, samples_per_class, device), state_budget(device, state_memory))
    if len(fitted.passes) > 1:
        log.info("--layers-per-pass auto: %d passes of at most %d layers (%s)", len(fitted.passes),
                 fitted.widest_pass, "; ".join(",".join(map(str, p)) for p in fitted.passes))
    return fitted


def check_memory(sizes: tuple[int, int], per_pass: int | None, device: torch.device,
                 available: int | None = None) -> None:
    """A UserError if the state of ``per_pass`` layers (1 without --layers) does not fit in the ``available`` memory
    of ``device`` (default: what is free now), naming how many layers per pass would."""
    per_layer, shared = sizes
    k = per_pass or 1
    free = available_bytes(device) if available is None else available
    if k * per_layer + shared <= free:
        return
    fits = (free - shared) // per_layer
    hint = (f"pass fewer --layers, or --layers-per-pass {fits} (several passes over the data, exact either way)"
            if fits >= 1 else "use a device with more memory, or --device cpu")
    raise UserError(f"the float64 state of {k} layer(s) needs ~{(k * per_layer + shared) / 2**30:.1f} GiB on {device} "
                    f"but {free / 2**30:.1f} GiB is free: {hint}")


def group_bytes(vocab: int, dim: int, samples_per_class: int, layers: int = 1, embeddings: int = 0,
                embeddings_itemsize: int = 4) -> int:
    """A checkpoint's size in the store before compression: per stored layer the float64 means, the float32 head and
    reservoir with its positions, the 7 per-class vectors and the d x d covariance; the saved embeddings (and their
    labels)."""
    per_layer = vocab * dim * (8 + 4 + 4 * samples_per_class) + vocab * 8 * (7 + samples_per_class) + dim * dim * 8
    return layers * (per_layer + embeddings * (dim * embeddings_itemsize + 8))


START = (0, Phase.TRAIN, 0)  # the progress (pass, phase, batches done) of a checkpoint not yet started


@dataclass(frozen=True)
class Costs:
    """Seconds measured on the first checkpoint that does work."""
    load: float     # loading its model and tokenizer
    forward: float  # a batch's forward pass
    train: float    # a layer's part of a train batch: its float64 statistics and reservoir
    decide: float   # a layer's part of a validation batch: NC4's decisions over the kept classes
    loss: float     # the loss's part of a validation batch (measured at the last layer only)
    write_rate: float | None  # bytes per second into the store (None: not measurable, e.g. a full disk)

    def train_batch(self, k: int) -> float:
        """A train batch with ``k`` layers."""
        return self.forward + k * self.train

    def val_batch(self, k: int, last: bool) -> float:
        """A validation batch with ``k`` layers, the last layer among them if ``last``."""
        return self.forward + k * self.decide + (self.loss if last else 0.0)

    def left(self, progress: tuple[int, Phase, int], passes: list[int], n_train: int, n_val: int) -> float:
        """Seconds of passes left for a checkpoint standing at ``progress`` (pass, phase, batches done in it), with
        ``passes`` the layers in each pass ([1] without --layers; the last layer is in the last pass) over
        ``n_train`` and ``n_val`` batches."""
        at, phase, done = progress
        secs = 0.0
        for i, k in enumerate(passes[at:], at):
            train = n_train if i > at or phase == Phase.TRAIN else 0
            val = n_val if i > at or phase <= Phase.VALIDATION else 0
            if i == at and phase == Phase.TRAIN:
                train -= done
            elif i == at and phase == Phase.VALIDATION:
                val -= done
            secs += max(0, train) * self.train_batch(k) + max(0, val) * self.val_batch(k, i == len(passes) - 1)
        return secs


def progress(state: Path) -> tuple[int, Phase, int]:
    """(pass, phase, batches done) of a checkpoint's resume state, read without loading its arrays; the start
    where there is none (or it is unreadable: the extraction then refuses it or starts again)."""
    try:
        with np.load(state, allow_pickle=False) as f:
            return int(f["pass"]) if "pass" in f.files else 0, Phase(int(f["phase"])), int(f["batches"])
    except UNREADABLE:
        return START


def kept_classes(train: Blocks, vocab: int, min_count: int) -> int:
    """How many classes the train pass will keep for NC4 (``count >= min_count``), counted from the labels."""
    counts = np.zeros(vocab, dtype=np.int64)
    for batch in train.batches(4096):
        y = batch[:, 1:].ravel()
        counts += np.bincount(y[(y >= 0) & (y < vocab)], minlength=vocab)
    return int((counts >= min_count).sum())


def _seconds(run, device: torch.device, budget: float = 0.5, at_most: int = 7) -> float:
    """The median seconds of ``run()``, after a warm-up call, over calls made until ``budget`` seconds have passed
    (at least 3, at most ``at_most``): the machine's noise, not one slow call, sets the estimate."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()
    times: list[float] = []
    while len(times) < 3 or (sum(times) < budget and len(times) < at_most):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def batch_seconds(model, ids: torch.Tensor, samples_per_class: int, n_kept: int, seed: int,
                  validation: bool = True) -> tuple[float, float, float, float]:
    """Seconds, for the batch ``ids`` (b x L), of the forward pass, of a layer's part of the train pass (float64
    statistics, reservoir), of a layer's part of the validation pass (NC4's decisions over ``n_kept`` classes) and
    of the loss (the last two 0 without ``validation``); each by the extraction's own code on a scratch state."""
    device = ids.device
    classifier, bias = head(model)
    vocab, dim = classifier.shape
    h = features(model, ids)
    labels = ids[:, 1:].reshape(-1)
    h, y = h.reshape(-1, dim), labels.cpu().numpy()
    ex = LayerState(vocab, dim, samples_per_class, seed, device)
    offset = iter(range(0, 1 << 40, len(y)))  # fresh stream positions for every reservoir call

    def train_step() -> None:
        ex.stats.update(h, labels)
        ex.reservoir.update(h, y, next(offset) + np.arange(len(y)))

    forward = _seconds(lambda: features(model, ids), device)
    train = _seconds(train_step, device)
    if not validation:
        return forward, train, 0.0, 0.0
    kept = torch.arange(max(1, n_kept), device=device)
    counts = DecisionCounts(classifier, bias, ex.stats.mean, kept)
    loss = NextTokenLoss(classifier, bias, LogitTransform.of(model.config))
    decide = _seconds(lambda: counts.update(h, labels), device)
    return forward, train, decide, _seconds(lambda: loss.update(h, labels), device)


def measure_costs(model, loaded: float, train: Blocks, val: Blocks | None, batch_size: int, samples_per_class: int,
                  min_count: int, seed: int, partial: Path) -> Costs | None:
    """The :class:`Costs` of a checkpoint like ``model`` (loaded in ``loaded`` seconds), timed on the first train
    batch (None without one: the train pass then says the data is empty); the write rate is timed in a scratch
    folder under ``partial``."""
    weight, _ = head(model)
    batch = next(train.batches(batch_size), None)
    if batch is None:
        return None
    n_kept = kept_classes(train, weight.shape[0], min_count)
    check_ids(batch, weight.shape[0], train.spec)
    ids = torch.from_numpy(batch).to(weight.device)
    timed = batch_seconds(model, ids, samples_per_class, n_kept, seed, validation=val is not None)
    sample = weight[: max(1, (4 << 20) // weight.shape[1])].float().cpu().numpy()
    return Costs(loaded, *timed, io.write_rate(sample, partial))


def _duration(secs: float) -> str:
    return f"{secs:,.0f} s" if secs < 120 else f"{secs / 60:,.1f} min" if secs < 7200 else f"{secs / 3600:,.1f} h"


def estimate(at: list[tuple[int, Phase, int]], costs: Costs | None, train: Blocks, val: Blocks | None,
             batch_size: int, vocab: int, dim: int, samples_per_class: int, store: Path,
             passes: list[int] | None = None, embeddings: int = 0, embeddings_dtype: str = "float32") -> str:
    """The estimate for the checkpoints to do, standing at ``at`` (their :func:`progress`): ``costs`` measured on
    the first (None where the data's length is unknown), ``passes`` the layers in each pass (None: the last layer
    only), ``embeddings`` saved positions."""
    passes = passes or [1]
    n = len(at)
    if train.total is not None:  # no more positions are staged than the train data has (layers.fit_embeddings)
        embeddings = min(embeddings, train.total * (train.block_size - 1))
    disk = group_bytes(vocab, dim, samples_per_class, sum(passes), embeddings, np.dtype(embeddings_dtype).itemsize)
    where = f"~{n * disk / 1e6:,.0f} MB (before compression) in {store}"
    if costs is None or train.total is None or (val is not None and val.total is None):
        return (f"{n} checkpoint(s) to do; the data's length is unknown (text without the token cache: drop "
                f"--no-token-cache, or cap it with --max-train-tokens/--max-val-tokens, for a time); {where}")
    n_train = -(-train.total // batch_size)
    n_val = 0 if val is None else -(-val.total // batch_size)
    write = disk / costs.write_rate if costs.write_rate else 0.0
    wrote = f"{write:.1f} s" if costs.write_rate else "not timed"
    total = n * (costs.load + write) + sum(costs.left(p, passes, n_train, n_val) for p in at)
    started = sum(p != START for p in at)
    partly = f" ({started} partly done)" if started else ""
    val_tokens = "no validation" if val is None else f"{val.total * val.block_size:,} val tokens"
    train_s = sum(costs.train_batch(k) for k in passes)
    val_s = sum(costs.val_batch(k, i == len(passes) - 1) for i, k in enumerate(passes))
    return (f"{n} checkpoint(s) to do{partly} x {train.total * train.block_size:,} train tokens + {val_tokens}; "
            f"~{_duration(total)} in all. Per checkpoint: load {costs.load:.1f} s, train pass {n_train * train_s:,.1f} "
            f"s, validation {n_val * val_s:,.1f} s, write {wrote} (timed on the first); {where}")
