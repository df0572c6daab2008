"""Extraction of the checkpoints under local paths: :func:`extract` (the estimate announced once, then each checkpoint
by :func:`~ncanalyze.store.extraction.checkpoint.extract_checkpoint`), one checkpoint in shards
(:func:`extract_sharded`), and :class:`ExtractResult`, what an extraction did (local, Hub or cluster)."""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar
from pathlib import Path

import numpy as np
from ncanalyze.core.errors import CheckpointError, UserError
from ncanalyze.store.bars import progress_bar
from ncanalyze.store.data.blocks import Blocks
from ncanalyze.store.extraction import layers, progress as time_left
from ncanalyze.store.extraction.checkpoint import Outcome, extract_checkpoint, load_checkpoint
from ncanalyze.store.extraction.config import held_out_line
from ncanalyze.store.extraction.estimate import (
    START,
    Arch,
    announcement,
    architecture,
    checkpoint_architecture,
    per_architecture,
    progress,
    timed_arch,
)
from ncanalyze.store.extraction.job import Job, Jobs
from ncanalyze.store.extraction.resume import DeferredInterrupt
from ncanalyze.store.extraction.settings import ExtractConfig
from ncanalyze.store.runs import shards as sh
from ncanalyze.store.sources.adapters import check_one_base
from ncanalyze.store.sources.discover import Checkpoint, discover, tagged
from ncanalyze.store.store import Status, Store

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ExtractResult:
    """What one extraction did (local, Hub or cluster).

    Parameters
    ----------
    label
        What was extracted: the path, the Hub repository, or the paths sent to a cluster.
    store
        The store, as given.
    statuses
        Each checkpoint group's :class:`Outcome`.
    errors
        One line for each thing that failed before it had a group (a Hub revision that could not be fetched).
    why
        Why each FAILED group failed, one line each.
    """
    label: str
    store: str
    statuses: dict[str, Outcome] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)

    def add(self, group: str, outcome: Outcome, why: str | None = None, at: str = "") -> None:
        """Record a group's outcome (with why, for a failure), and log it (``at``: where in the run, ``(2/5)``)."""
        self.statuses[group] = outcome
        if why is not None:
            self.why[group] = why
        log.info("%s: %s%s", group, outcome if why is None else f"{outcome}: {why}", at and f" {at}")

    def count(self, outcome: Outcome) -> int:
        """How many groups have ``outcome``."""
        return sum(v is outcome for v in self.statuses.values())

    @property
    def failures(self) -> list[str]:
        """One line for each failure: the errors, then each failed group with why."""
        return self.errors + [f"{g} failed: {self.why.get(g, '')}" for g, v in self.statuses.items()
                              if v is Outcome.FAILED]

    def summary(self) -> str:
        """``LABEL: N extracted, N resumed, N already in STORE[, N failed]``, the line the command prints."""
        failed = len(self.failures)
        return (f"{self.label}: {self.count(Outcome.DONE)} extracted, {self.count(Outcome.RESUMED)} resumed, "
                f"{self.count(Outcome.SKIPPED)} already in {self.store}" + (f", {failed} failed" if failed else ""))


def announcer(todo: list[Checkpoint], jobs: Jobs, store: Store, local: bool = False) -> Callable[..., None]:
    """The estimate, logged once, at the first checkpoint that does work: each architecture among ``todo`` is timed
    once, on its first checkpoint (the one at hand; the others loaded for it, their jobs kept for their turn), and one
    line gives the total.

    Parameters
    ----------
    todo
        The checkpoints to do (those of every PATH of a command: :func:`announcer_over`).
    jobs
        The run's jobs (its settings; ``restart``: resume states are to be discarded, else what they hold is left out
        of the estimate).
    store
        The store.
    local
        ``todo`` are local folders, whose configs tell their architectures (Hub revisions: all the first's).

    Returns
    -------
    callable
        ``announce(model, loaded, train, val, plan)`` for :func:`extract_checkpoint`.
    """
    announced, cfg = False, jobs.cfg

    def time_first(ckpt: Checkpoint) -> Arch | None:  # another architecture's first checkpoint, loaded to be timed
        try:
            other = load_checkpoint(job := jobs(ckpt))
            started = time.perf_counter()  # its data opened, as its own turn will (its set-up, with the load)
            inputs = job.inputs(store, other.tokenizer)
            return timed_arch(other.model, other.seconds + time.perf_counter() - started, *inputs, job.plan, cfg,
                              store)
        except CheckpointError:
            return None

    def announce(model, loaded: float, train: Blocks, val: Blocks | None, plan: layers.Plan) -> None:
        nonlocal announced
        if announced:
            return
        announced = True
        archs = per_architecture(todo, architecture(model.config, cfg.dtype, cfg.block_size),
                                 lambda c: checkpoint_architecture(c, cfg) if local else None,
                                 timed_arch(model, loaded, train, val, plan, cfg, store), time_first,
                                 lambda c: START if jobs.restart else progress(store.files(c).state))
        log.info("estimate: %s", announcement(archs, cfg, store, next(model.parameters()).device))

    return announce


def announcer_over(paths: list, store: Store, jobs: Jobs) -> Callable[..., None]:
    """:func:`announcer` over the checkpoints to do under every one of ``paths`` (a command's PATHS), for
    :func:`extract`'s ``announce``: one estimate line, one total.

    Parameters
    ----------
    paths
        The PATHS (local).
    store, jobs
        As for :func:`extract`.

    Returns
    -------
    callable
        As :func:`announcer`'s.
    """
    ckpts = [c for p in paths for c in tagged(discover(p), jobs.cfg.tag, jobs.cfg.base)]
    return announcer(todo(store, ckpts, jobs), jobs, store, local=True)


def check_settings(cfg: ExtractConfig, store: Store, shards: int = 1) -> None:
    """Refuse, before any work, settings that can't go together and a store that can't be written.

    Parameters
    ----------
    cfg, store
        The configuration and the store (checked writable, not created: it appears with its first checkpoint).
    shards
        Shards per checkpoint.
    """
    if shards > 1 and cfg.save_embeddings:
        raise UserError("--shards splits the statistics, not the stream of --save-embeddings: drop "
                        "--save-embeddings, or --shards")
    store.prepare()
    if line := held_out_line(cfg):  # the validation data is resolved here, so its refusals come before any work
        log.info("%s", line)


def todo(store: Store, ckpts: list[Checkpoint], jobs: Jobs) -> list[Checkpoint]:
    """The checkpoints left to do.

    Parameters
    ----------
    store, ckpts
        The store and the checkpoints.
    jobs
        The run's jobs (with ``overwrite``: all are to be done again).

    Returns
    -------
    list of Checkpoint
        Those not yet complete in ``store`` (all of them with ``overwrite``).
    """
    return [c for c in ckpts
            if jobs.overwrite or not (store.attrs(c.group, corrupt_ok=True) or {}).get("complete")]


def extract(path: str | Path, store: str | Path | Store, settings: ExtractConfig | Jobs, shards: int = 1,
            announce: Callable[..., None] | None = None) -> ExtractResult:
    """Extract every checkpoint under ``path`` into ``store`` (each status logged as it goes), each resolved once
    into its :class:`~ncanalyze.store.extraction.job.Job`.

    A checkpoint that is bad in itself (a CheckpointError: corrupt weights, NaN features) fails alone, as
    ``Outcome.FAILED`` with why, and the others go on; any other error stops the run.

    Parameters
    ----------
    path
        A Trainer output folder, a model folder, or a folder of runs.
    store
        The store (resolved once: a :class:`Store`, or its path).
    settings
        The configuration, or the run's :class:`~ncanalyze.store.extraction.job.Jobs` (its settings with
        ``overwrite`` and ``restart``).
    shards
        > 1: each checkpoint's train stream cut into that many parts, run one after another and merged exactly
        (:func:`extract_sharded`; the same computation a cluster runs in parallel).
    announce
        The estimate, where it spans more than ``path`` (:func:`announcer_over`); else one for ``path``.

    Returns
    -------
    ExtractResult
        Labelled with ``path``.
    """
    store, jobs = Store.at(store), Jobs.of(settings)
    result = ExtractResult(str(path), str(store))
    ckpts = tagged(discover(path), jobs.cfg.tag, jobs.cfg.base)
    check_settings(jobs.cfg, store, shards)
    check_one_base(ckpts)
    spans = announce is not None  # an estimate over more PATHS: its time left is followed past this one
    announce = announce or announcer(todo(store, ckpts, jobs), jobs, store, local=True)
    return each_checkpoint(store, result, [(c.group, c) for c in ckpts],
                           lambda ckpt, interrupt: _one(jobs(ckpt), store, announce, interrupt, shards),
                           untrack=not spans)


def each_checkpoint(store: Store, result: ExtractResult, todo: Iterable[tuple[str, T]],
                    one: Callable[[T, DeferredInterrupt | None], Outcome | None], *, total: int | None = None,
                    desc: str = "checkpoints", unit: str = "ckpt", defer: bool = True,
                    untrack: bool = True) -> ExtractResult:
    """The per-checkpoint loop of every run (local folders, Hub revisions, a cluster's tasks as they complete): each
    ``one(item, interrupt)`` in turn, with a progress bar, each outcome recorded and logged with where it is in the
    run; the folders of work in progress pruned at the end, however it ends.

    A checkpoint bad in itself (a CheckpointError: corrupt weights, NaN features) fails alone, as
    ``Outcome.FAILED`` with why, when it is one of several; any other error stops the run.

    Parameters
    ----------
    store, result
        The store and the run's result (filled in).
    todo
        (group, item) for each checkpoint (a list, or an iterator of ``total`` items).
    one
        Does one item: its outcome, or None where nothing is to be recorded (it said why in ``result.errors``).
    total
        The number of items [default: ``len(todo)``].
    desc, unit
        The progress bar's label and unit.
    defer
        Run under one Ctrl-C guard whose pending Ctrl-C ``one`` takes at a batch boundary (this process's work);
        False: Ctrl-C stops the loop at once (a cluster's tasks, waited for here).
    untrack
        Follow the run's time left no further at the end (False: the estimate spans more PATHS, whose caller ends
        it, :func:`extract_paths`).

    Returns
    -------
    ExtractResult
        ``result``.
    """
    total = len(todo) if total is None else total
    try:
        with DeferredInterrupt() if defer else contextlib.nullcontext() as interrupt:
            bars = progress_bar(todo, total=total, desc=desc, unit=unit, disable=total < 2)
            for i, (group, item) in enumerate(bars, 1):
                at = f"({i}/{total})"
                try:
                    outcome = one(item, interrupt)
                except CheckpointError as e:  # bad in itself: it fails alone when it is one of several
                    if total == 1:
                        raise
                    result.add(group, Outcome.FAILED, str(e), at)
                    continue
                if outcome is not None:
                    result.add(group, outcome, at=at)
    finally:
        store.prune()
        if untrack:
            time_left.track(None)  # the run's time left is followed no further
    return result


def _one(job: Job, store: Store, announce, interrupt: DeferredInterrupt, shards: int = 1) -> Outcome:
    """One checkpoint's outcome, in shards or whole."""
    if shards > 1:
        return extract_sharded(job, store, shards, interrupt)
    return extract_checkpoint(job, store, announce, interrupt)


def finish_sharded(job: Job, store: Store, merged: dict[str, np.ndarray],
                   interrupt: DeferredInterrupt | None = None) -> Outcome:
    """The merged train state saved as the checkpoint's resume state (:func:`~ncanalyze.store.runs.shards.save_merged`),
    then :func:`extract_checkpoint` resumes from it: the validation pass and the write.

    Parameters
    ----------
    job
        The checkpoint's job (its ``restart`` is not applied here: the state saved is this run's own).
    store
        The store.
    merged
        The shards' states, merged.
    interrupt
        As for :func:`extract_checkpoint`.

    Returns
    -------
    Outcome
        DONE (RESUMED when run again after its worker died in the validation pass, SKIPPED if another writer
        finished it meanwhile).
    """
    job = job.resuming()
    saved = sh.save_merged(job, store, merged)
    if saved is Status.SKIP:
        return Outcome.SKIPPED
    outcome = extract_checkpoint(job, store, interrupt=interrupt)
    return Outcome.DONE if outcome is Outcome.RESUMED and saved is Status.FRESH else outcome


def extract_sharded(job: Job, store: Store, shards: int, interrupt: DeferredInterrupt | None = None) -> Outcome:
    """The sharded extraction of one checkpoint in this process: the shards one after another, the same merge tree
    as on a cluster, then the validation pass.

    Parameters
    ----------
    job, store
        The checkpoint's job and the store.
    shards
        How many parts to cut the train stream into.
    interrupt
        As for :func:`extract_checkpoint`; a Ctrl-C stops a shard at its next batch boundary (its work is not
        kept), the validation pass with its state saved.

    Returns
    -------
    Outcome
        DONE, SKIPPED or RESUMED.
    """
    plan = sh.shard_plan(job, store, shards)
    if plan.route is sh.Route.SKIP:
        return Outcome.SKIPPED
    if plan.route is sh.Route.WHOLE:
        return extract_checkpoint(job.resuming(), store, interrupt=interrupt)
    states = [sh.train_shard(job, a, b, interrupt) for a, b in plan.ranges]
    for level in sh.merge_order(len(states)):
        states = [states[i] if j < 0 else sh.merge_states(states[i], states[j], job.cfg.samples_per_class,
                                                          job.cfg.seed)
                  for i, j in level]
    return finish_sharded(job, store, states[0], interrupt)
