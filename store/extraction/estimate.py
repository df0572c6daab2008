"""The line printed before extraction starts (what is left to do, how long it will take, the disk it needs); the
running state's size and the memory budget are memory.py.

The time is measured, not guessed, once per architecture (:func:`architecture`: what sets the cost, the model type,
depth, width, vocabulary, heads, MLP width, dtype and block size). For the first checkpoint to do of each, its model
load and set-up (the data opened, the split's labels counted, the running state made: every checkpoint's own) are
timed, and on its first train batch the extraction's own code is timed on a scratch state: the forward pass,
a layer's float64 statistics and reservoir, a layer's NC4 decisions over as many kept classes as the full train pass
will keep (counted from the train tokens), and the loss; a slice of the head is written the way the store writes.
Parts that grow with the vocabulary are timed on a slice of the batch's positions and scaled (:func:`_per_rows`), so
the timing stays under 2 s at any vocabulary. Then, over the checkpoints to do, each with its architecture's
costs,

    total = sum of  load and set-up + train batches left x (f x forward + k x statistics)
                    + validation batches left x (f x forward + k x decisions + loss) + group bytes / write rate

with k the layers of a pass (1 without ``--layers``; the loss only in the pass of the last layer), f the fraction
of the blocks the pass runs (its deepest layer / the number of blocks, for a pass below the last layer, which
anatomy.cut_forward stops early; 1 for the pass of the last layer), and the batches left from each checkpoint's
resume state (pass, phase, batches done), so work already done is left out.

That first figure is a snapshot (it says so, with the load average and threads it was timed under); from then on
the run's own rate refreshes it (:func:`tracker`, progress.py): each batch done counts its predicted seconds, the
wall seconds per predicted second over the last half-minute scale what is left, shown on each pass's progress bar.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from ncanalyze.analyzer.accumulate import DecisionCounts, float64_head, fold_of
from ncanalyze.core.errors import CheckpointError
from ncanalyze.core.sizes import bytes_text
from ncanalyze.store.data.blocks import Blocks
from ncanalyze.store.data.split_counts import label_bincount
from ncanalyze.store.extraction.layers import Plan
from ncanalyze.store.extraction.loss import NextTokenLoss
from ncanalyze.store.extraction.memory import fit_folds, group_bytes, state_bytes
from ncanalyze.store.extraction.passes import check_ids
from ncanalyze.store.extraction.progress import Tracker, duration, pass_depth, track
from ncanalyze.store.extraction.resume import UNREADABLE, Phase
from ncanalyze.store.extraction.running import LayerState
from ncanalyze.store.extraction.workers import Workers
from ncanalyze.store.extraction.settings import ExtractConfig, parse_size
from ncanalyze.store.sources.anatomy import LogitTransform, default_block_size, features, head, n_layers
from ncanalyze.store.sources.discover import Checkpoint
from ncanalyze.store.sources.load import load_config
from ncanalyze.store.store import Store

log = logging.getLogger(__name__)


START = (0, Phase.TRAIN, 0)  # the progress (pass, phase, batches done) of a checkpoint not yet started


@dataclass(frozen=True)
class Costs:
    """Seconds measured on the first checkpoint that does work."""
    load: float     # a checkpoint's load and set-up: its model and tokenizer, its data opened, the split's labels
                    # counted and its running state made (each checkpoint's own, counted per checkpoint)
    forward: float  # a batch's forward pass
    train: float    # a layer's part of a train batch: its float64 statistics and reservoir
    decide: float   # a layer's part of a validation batch below the last: NC4's decisions over the kept classes
    loss: float     # the last layer's part of a validation batch: the loss, NC4's decisions read from its logits
    write_rate: float | None  # bytes per second into the store (None: not measurable, e.g. a full disk)

    def train_batch(self, k: int, depth: float = 1.0) -> float:
        """A train batch with ``k`` layers, its forward running the fraction ``depth`` of the blocks."""
        return depth * self.forward + k * self.train

    def val_batch(self, k: int, last: bool, depth: float = 1.0) -> float:
        """A validation batch with ``k`` layers, the last layer among them if ``last``, its forward running the
        fraction ``depth`` of the blocks."""
        return depth * self.forward + (k - last) * self.decide + (self.loss if last else 0.0)

    def left(self, progress: tuple[int, Phase, int], passes: list[int], n_train: int, n_val: int,
             depths: list[float] | None = None) -> float:
        """Seconds of passes left for a checkpoint standing at ``progress`` (pass, phase, batches done in it), with
        ``passes`` the layers in each pass ([1] without --layers; the last layer is in the last pass) over
        ``n_train`` and ``n_val`` batches; ``depths`` the fraction of the blocks each pass runs (:func:`depths`;
        None: every pass the whole forward)."""
        at, phase, done = progress
        depths = depths or [1.0] * len(passes)
        secs = 0.0
        for i, k in enumerate(passes[at:], at):
            train = n_train if i > at or phase == Phase.TRAIN else 0
            val = n_val if i > at or phase <= Phase.VALIDATION else 0
            if i == at and phase == Phase.TRAIN:
                train -= done
            elif i == at and phase == Phase.VALIDATION:
                val -= done
            last = i == len(passes) - 1
            secs += max(0, train) * self.train_batch(k, depths[i]) + max(0, val) * self.val_batch(k, last, depths[i])
        return secs


def depths(plan: Plan) -> list[float]:
    """The fraction of the model's blocks each pass of ``plan`` runs (:func:`~.progress.pass_depth`): a pass below
    the last layer stops before the block of its deepest layer l (anatomy.cut_forward), so it runs l of the
    ``plan.last`` blocks; the pass of the last layer runs them all. (Where a model cannot be cut, its passes run the
    whole forward: the estimate is then low.)

    Parameters
    ----------
    plan
        The layer plan (its passes and last layer).

    Returns
    -------
    list of float
        One fraction in [0, 1] per pass.
    """
    return [pass_depth(plan, i) for i in range(len(plan.passes))]


def progress(state: Path) -> tuple[int, Phase, int]:
    """(pass, phase, batches done) of a checkpoint's resume state, read without loading its arrays; the start
    where there is none (or it is unreadable: the extraction then refuses it or starts again)."""
    try:
        with np.load(state, allow_pickle=False) as f:
            return int(f["pass"]) if "pass" in f.files else 0, Phase(int(f["phase"])), int(f["batches"])
    except UNREADABLE:
        return START


def train_counts(train: Blocks, vocab: int) -> np.ndarray:
    """Each class's train tokens as labels (the counts the train pass will make), from the labels alone."""
    return label_bincount(train, None, vocab)


def count_kept_classes(train: Blocks, vocab: int, min_count: int) -> int:
    """How many classes the train pass will keep for NC4 (``count >= min_count``), counted from the labels."""
    return int((train_counts(train, vocab) >= min_count).sum())


def _seconds(run, device: torch.device, budget: float = 0.25, at_most: int = 7) -> float:
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


CELLS = 1 << 22  # a timed slice's (positions x classes) scores, float64: 32 MiB, past the caches as a batch's are
WORK = 1 << 29   # at most this many (position, class, hidden) multiply-adds in a timed slice
CHEAP = 0.05     # a call under this many seconds is timed again (median of a few), a longer one once


def _per_rows(run, rows: int, cols: int, dim: int, device: torch.device) -> float:
    """The seconds of ``run(rows)``, a step whose cost grows with its ``rows`` positions x ``cols`` classes x ``dim``,
    timed on the first m rows and scaled by rows / m. m is all the rows, or enough for ``CELLS`` scores (so the slice
    meets memory as the whole does, not from the caches) but at most ``WORK`` multiply-adds: the timing costs well
    under a second whatever the vocabulary, where a whole batch against 50,257 classes takes seconds."""
    m = min(rows, max(1, -(-CELLS // cols)), max(1, WORK // (cols * dim)))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    run(m)  # cold, as each chunk of the real pass is (fresh scores, fresh pages)
    sync()
    once = time.perf_counter() - t0
    return (once if once >= CHEAP else _seconds(lambda: run(m), device, budget=4 * CHEAP)) * rows / m


def batch_seconds(model, ids: torch.Tensor, samples_per_class: int, counts: np.ndarray, min_count: int, seed: int,
                  validation: bool = True, folds: int = 1) -> tuple[float, float, float, float]:
    """Seconds, for the batch ``ids`` (b x L), of the forward pass, of a layer's part of the train pass (float64
    statistics and, with ``folds`` > 1, the fold sums beside them; the reservoir), of a layer's part of the validation
    pass below the last layer (NC4's decisions over the classes of ``counts`` >= ``min_count``, and over each
    NC4_MIN_COUNTS kept set, into the fold counts too, and under the means without each fold) and of the last
    layer's part (the loss, its decisions read from
    the loss's logits; the last two 0 without ``validation``); each by the extraction's own code on a scratch state,
    the last three on a slice of the positions, scaled (:func:`_per_rows`)."""
    device = ids.device
    classifier, bias = head(model)
    vocab, dim = classifier.shape
    h = features(model, ids)
    labels = ids[:, 1:].reshape(-1)
    h, y = h.reshape(-1, dim), labels.cpu().numpy()
    ex = LayerState(vocab, dim, samples_per_class, seed, device, folds)
    fold = fold_of(0, ids.shape[0], ids.shape[1] - 1, folds, device) if folds > 1 else None
    offset = iter(range(0, 1 << 40, len(y)))  # fresh stream positions for every reservoir call

    def train_step(m: int) -> None:  # the batch's updates as the train pass runs them (passes.train_pass)
        f = None if fold is None else fold[:m]
        run([functools.partial(ex.reservoir.update, h[:m], y[:m], next(offset) + np.arange(m)),
             *ex.tasks(h[:m], labels[:m], ex.grouping(labels[:m], f), f)])

    forward = _seconds(lambda: features(model, ids), device)
    with Workers(device) as run:
        train_step(len(y))  # the state's pages touched (the fold sums: F x vocab x d), as the real pass does once
        train = _per_rows(train_step, len(y), 1, dim, device)
    if not validation:
        return forward, train, 0.0, 0.0
    count = torch.from_numpy(counts).to(device)
    kept = torch.nonzero(count >= min_count).squeeze(1)
    if ex.folds is not None:  # the folds as the full pass leaves them: a class's tokens dealt evenly over the folds,
        # so that each leave-one-fold-out screen is timed over the classes its fold holds (accumulate.WithoutFold)
        f = torch.arange(ex.folds.count.shape[0], device=count.device)[:, None]
        ex.folds.count.copy_(count // len(f) + (f < count % len(f)).to(count.dtype))
    shared = float64_head(classifier, bias, device)  # one float64 head for both, as the validation pass has it
    decisions = DecisionCounts(classifier, bias, ex.stats.mean, kept, counts=ex.val, head=shared, folds=ex.fold_val,
                               train_count=count, fold_stats=ex.folds, min_count=min_count)
    loss = NextTokenLoss(*shared, LogitTransform.of(model.config))

    def step(run, m: int) -> None:
        decisions.begin(None if fold is None else fold[:m])
        run(m)
    decide = _per_rows(lambda m: step(lambda m: decisions.update(h[:m], labels[:m]), m), len(y), max(1, len(kept)),
                       dim, device)
    last = _per_rows(lambda m: step(lambda m: loss.update(h[:m], labels[:m], decisions.count_logits), m), len(y),
                     vocab, dim, device)
    return forward, train, decide, last


def measure_costs(model, loaded: float, train: Blocks, val: Blocks | None, batch_size: int, samples_per_class: int,
                  min_count: int, seed: int, store: Store, folds: int = 1) -> Costs | None:
    """The :class:`Costs` of a checkpoint like ``model`` (loaded and its data opened in ``loaded`` seconds; the rest
    of a checkpoint's set-up, its split's labels counted and its running state made, timed here and added),
    timed on the first train batch (None without one: the train pass then says the data is empty) with ``folds``
    folds; the write rate is timed in a scratch folder beside ``store`` (:meth:`Store.write_rate`)."""
    weight, _ = head(model)
    batch = next(train.batches(batch_size), None)
    if batch is None:
        return None
    started = time.perf_counter()  # the set-up each checkpoint repeats: its split's labels counted, its state made
    counts = train_counts(train, weight.shape[0])
    LayerState(*weight.shape, samples_per_class, seed, weight.device, folds)
    setup = time.perf_counter() - started
    check_ids(batch, weight.shape[0], train.spec)
    ids = torch.from_numpy(batch).to(weight.device)
    timed = batch_seconds(model, ids, samples_per_class, counts, min_count, seed, validation=val is not None,
                          folds=folds)
    sample = weight[: max(1, (4 << 20) // weight.shape[1])].float().cpu().numpy()
    return Costs(loaded + setup, *timed, store.write_rate(sample))


def architecture(config, dtype: str, block_size: int | None = None) -> tuple:
    """What sets a checkpoint's cost: checkpoints with equal keys share one timing.

    Parameters
    ----------
    config
        The checkpoint's model config (transformers).
    dtype
        ``--dtype``.
    block_size
        ``--block-size`` (None: the model's default).

    Returns
    -------
    tuple
        (model type, layers, hidden size, vocabulary, heads, MLP width, dtype, block size).
    """
    mlp = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    return (config.model_type, n_layers(config), getattr(config, "hidden_size", None),
            getattr(config, "vocab_size", None), getattr(config, "num_attention_heads", None), mlp, dtype,
            block_size or default_block_size(config))


def checkpoint_architecture(ckpt: Checkpoint, cfg: ExtractConfig) -> tuple | None:
    """The :func:`architecture` of ``ckpt`` under ``cfg``, from its config alone; None where that can't be read
    (a Hub revision not yet downloaded)."""
    try:
        return architecture(load_config(ckpt, cfg.trust_remote_code), cfg.dtype, cfg.block_size)
    except CheckpointError:
        return None


def architecture_name(key: tuple) -> str:
    """How the line names an architecture.

    Parameters
    ----------
    key
        An :func:`architecture`.

    Returns
    -------
    str
        ``gpt_neo L2 d64 V8192 h4 ff256 float32 block 256`` (heads and MLP width where the config has them).
    """
    kind, layers, width, vocab, heads, mlp, dtype, block = key
    return " ".join([f"{kind} L{layers} d{width} V{vocab}", *([f"h{heads}"] if heads else []),
                     *([f"ff{mlp}"] if mlp else []), dtype, f"block {block}"])


@dataclass
class Arch:
    """One architecture's checkpoints to do and what the estimate needs of them: ``costs`` timed on the first (None
    where the data's length is unknown), its data, head shape (``vocab`` x ``dim``), ``passes`` (the layers in each
    pass) and ``embeddings`` saved positions; ``at`` each checkpoint's :func:`progress`."""
    name: str
    costs: Costs | None
    train: Blocks
    val: Blocks | None
    vocab: int
    dim: int
    passes: list[int] = field(default_factory=lambda: [1])
    embeddings: int = 0
    embeddings_dtype: str = "float32"
    folds: int = 1  # the folds asked for (--folds; fewer where they do not fit the state's memory)
    at: list[tuple[int, Phase, int]] = field(default_factory=list)
    depths: list[float] = field(default_factory=list)  # the fraction of the blocks each pass runs (empty: all)

    def disk(self, samples_per_class: int) -> int:
        """A checkpoint's bytes in the store, before compression (:func:`group_bytes`); no more embedding positions
        are staged than the train data has (layers.fit_embeddings)."""
        embeddings = self.embeddings
        if self.train.total is not None:
            embeddings = min(embeddings, self.train.total * (self.train.block_size - 1))
        return group_bytes(self.vocab, self.dim, samples_per_class, sum(self.passes), embeddings,
                           np.dtype(self.embeddings_dtype).itemsize, self.folds)

    def batches(self, batch_size: int) -> tuple[int, int]:
        """(train, validation) batches of a checkpoint."""
        return -(-self.train.total // batch_size), 0 if self.val is None else -(-self.val.total // batch_size)

    def seconds(self, batch_size: int, samples_per_class: int) -> float:
        """Seconds of its checkpoints' loads, passes left and writes."""
        c, (n_train, n_val) = self.costs, self.batches(batch_size)
        write = self.disk(samples_per_class) / c.write_rate if c.write_rate else 0.0
        return len(self.at) * (c.load + write) + sum(c.left(p, self.passes, n_train, n_val, self.depths) for p in self.at)

    def parts(self, batch_size: int, samples_per_class: int) -> str:
        """``load and set-up 1.0 s, train pass 3.0 s, validation 2.0 s, write 0.1 s``: a checkpoint's parts from the
        start (each checkpoint loads and sets up its own)."""
        c, (n_train, n_val) = self.costs, self.batches(batch_size)
        depth = self.depths or [1.0] * len(self.passes)
        train_s = sum(c.train_batch(k, f) for k, f in zip(self.passes, depth))
        val_s = sum(c.val_batch(k, i == len(self.passes) - 1, f) for i, (k, f) in enumerate(zip(self.passes, depth)))
        wrote = f"{self.disk(samples_per_class) / c.write_rate:.1f} s" if c.write_rate else "not timed"
        return (f"load and set-up {c.load:.{1 if c.load >= 1 else 2}f} s, train pass {n_train * train_s:,.1f} s, "
                f"validation {n_val * val_s:,.1f} s, write {wrote}")

    def tokens(self) -> str:
        """``8,192 train tokens + 4,096 val tokens`` of a checkpoint."""
        val = "no validation" if self.val is None else f"{self.val.total * self.val.block_size:,} val tokens"
        return f"{self.train.total * self.train.block_size:,} train tokens + {val}"


def per_architecture(todo: list, first: tuple, key_of: Callable[[object], tuple | None], timed_first: Arch,
                     time: Callable[[object], Arch | None], progress_of: Callable[[object], tuple]) -> list[Arch]:
    """The checkpoints to do grouped by :func:`architecture`, each group timed once.

    Parameters
    ----------
    todo
        The checkpoints to do.
    first, timed_first
        The architecture of the checkpoint at hand (loaded), and its :class:`Arch`, timed.
    key_of
        A checkpoint's architecture (None where its config can't be read yet, e.g. a Hub revision not downloaded:
        counted as ``first``).
    time
        The :class:`Arch` of a checkpoint, loaded and timed (None where it does not load: its group then takes
        ``first``'s costs, and says so).
    progress_of
        A checkpoint's :func:`progress`.

    Returns
    -------
    list of Arch
        One per architecture, ``first``'s first, each with its checkpoints' progress.
    """
    groups: dict[tuple, list] = {first: []}
    for c in todo:
        groups.setdefault(key_of(c) or first, []).append(c)
    archs = []
    for key, ckpts in groups.items():
        if not ckpts:
            continue
        arch = timed_first if key == first else time(ckpts[0])
        name = architecture_name(key)
        if arch is None:
            arch, name = timed_first, f"{name} (not timed: {ckpts[0].group} did not load; the first's costs)"
        archs.append(replace(arch, name=name, at=[progress_of(c) for c in ckpts]))
    return archs


def timed_arch(model, loaded: float, train: Blocks, val: Blocks | None, plan: Plan, cfg: ExtractConfig,
               store: Store) -> Arch:
    """The :class:`Arch` of a loaded checkpoint (``model``, loaded in ``loaded`` seconds), its costs timed
    (:func:`measure_costs`, only where the data's length is known), its checkpoints still to be added.

    Parameters
    ----------
    model, loaded
        The model and the seconds its load took.
    train, val, plan
        Its data and layer plan.
    cfg
        The configuration.
    store
        The store (the write is timed beside it).

    Returns
    -------
    Arch
        Unnamed, without checkpoints (:func:`per_architecture` adds them).
    """
    known = train.total is not None and (val is None or val.total is not None)
    vocab, dim = head(model)[0].shape
    device = next(model.parameters()).device
    folds = fit_folds(cfg.folds, vocab, dim, cfg.samples_per_class, plan.widest_pass, device,
                      parse_size(cfg.state_memory))
    costs = measure_costs(model, loaded, train, val, cfg.batch_size, cfg.samples_per_class, cfg.min_count, cfg.seed,
                          store, folds) if known else None
    return Arch("", costs, train, val, *head(model)[0].shape, [len(p) for p in plan.passes], plan.save_embeddings,
                plan.embeddings_dtype, folds=cfg.folds, depths=depths(plan))


def announcement(archs: list[Arch], cfg: ExtractConfig, store: Store | Path, device: torch.device) -> str:
    """The line after ``estimate:`` (:func:`estimate`), with the running state's size on ``device`` (that of the
    largest architecture's widest pass); from here the run's own rate refreshes it (:func:`tracker`, followed by the
    passes' progress bars)."""
    k = max(max(a.passes) for a in archs)
    state = max(k * a + s for a, s in (state_bytes(x.vocab, x.dim, cfg.samples_per_class, device) for x in archs))
    track(tracker(archs, cfg.batch_size, cfg.samples_per_class))
    return estimate(archs, cfg.batch_size, cfg.samples_per_class, store,
                    f"; state ~{bytes_text(state)} on {device} ({k} layer(s); the fold sums take what is left of "
                    "--state-memory)")


def tracker(archs: list[Arch], batch_size: int, samples_per_class: int) -> Tracker | None:
    """The :class:`~.progress.Tracker` of a run of ``archs``: a batch's predicted seconds are its architecture's
    (told by its head's shape) for its pass and phase; None where a length is unknown (no prediction to scale)."""
    if any(a.costs is None or a.train.total is None or (a.val is not None and a.val.total is None) for a in archs):
        return None
    by_head: dict[tuple[int, int], Arch] = {}
    for a in archs:
        by_head.setdefault((a.vocab, a.dim), a)

    def arch(ex) -> Arch:
        return by_head.get((ex.vocab, ex.args[1]), archs[0])

    def cost(ex) -> float:
        c, k, depth = arch(ex).costs, len(ex.layers), pass_depth(ex.plan, ex.pass_index)
        if ex.phase == Phase.TRAIN:
            return c.train_batch(k, depth)
        return c.val_batch(k, ex.pass_index == len(ex.plan.passes) - 1, depth)

    def fixed(ex) -> float:
        a = arch(ex)
        return a.costs.load + (a.disk(samples_per_class) / a.costs.write_rate if a.costs.write_rate else 0.0)
    return Tracker(sum(a.seconds(batch_size, samples_per_class) for a in archs), cost, fixed)


def snapshot() -> str:
    """What the first figure rests on: one timed batch, the load and threads at the time, and what refreshes it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"a snapshot, timed on one batch (median of a few calls) at a load average of {os.getloadavg()[0]:.1f} "
            f"on {cores} core(s), {torch.get_num_threads()} thread(s): each pass's progress bar shows the run's time "
            "left at the rate measured on the run itself, refreshed every batch")


_duration = duration


def estimate(archs: list[Arch], batch_size: int, samples_per_class: int, store: Store | Path, state: str = "") -> str:
    """The estimate for the checkpoints to do, one line over every architecture in ``archs``: the count (and how
    many are partly done), tokens, the time in all, each architecture's parts per checkpoint (timed on its first
    checkpoint), the disk and ``state`` (the running state's size, appended as given); it says it is a snapshot of one timed batch, which the passes' progress bars (their
    rate and time left, measured as the work runs) correct."""
    n = sum(len(a.at) for a in archs)
    disk = sum(len(a.at) * a.disk(samples_per_class) for a in archs)
    where = f"~{bytes_text(disk)} (before compression) in {store}{state}"
    if any(a.costs is None or a.train.total is None or (a.val is not None and a.val.total is None) for a in archs):
        return (f"{n} checkpoint(s) to do; the data's length is unknown (text without the token cache: drop "
                f"--no-token-cache, or cap it with --max-train-tokens/--max-val-tokens, for a time); {where}")
    total = sum(a.seconds(batch_size, samples_per_class) for a in archs)
    started = sum(p != START for a in archs for p in a.at)
    partly = f" ({started} partly done)" if started else ""
    tokens = {a.tokens() for a in archs}
    common = f" x {tokens.pop()}" if len(tokens) == 1 else ""
    if len(archs) == 1:
        return (f"{n} checkpoint(s) to do{partly}{common}; ~{_duration(total)} in all. Per checkpoint: "
                f"{archs[0].parts(batch_size, samples_per_class)} (timed on the first); {where}; {snapshot()}")
    each = "; ".join(f"{a.name} ({len(a.at)}{'' if common else ', ' + a.tokens()}): "
                     f"{a.parts(batch_size, samples_per_class)}" for a in archs)
    return (f"{n} checkpoint(s) to do{partly} in {len(archs)} architectures{common}; ~{_duration(total)} in all. "
            f"Per checkpoint, timed on the first of each architecture: {each}; {where}; {snapshot()}")
