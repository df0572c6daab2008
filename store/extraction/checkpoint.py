"""One checkpoint into the store: :func:`extract_checkpoint`, a table of contents of its steps (settle, load, data,
passes and write)."""

from __future__ import annotations

import enum
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from ncanalyze.core import threads
from ncanalyze.core.errors import UserError
from ncanalyze.store.data.blocks import Blocks
from ncanalyze.store.data.split_counts import label_counts
from ncanalyze.store.extraction import layers
from ncanalyze.store.extraction.attributes import group_attributes
from ncanalyze.store.extraction.config import differences, refusal
from ncanalyze.store.extraction.job import Job
from ncanalyze.store.extraction.memory import check_memory, fit_folds, fit_plan, state_bytes
from ncanalyze.store.extraction.passes import run_passes
from ncanalyze.store.extraction.resume import DeferredInterrupt, Phase, Saver, load_state, record_of
from ncanalyze.store.extraction.running import Extraction
from ncanalyze.store.extraction.settings import parse_size
from ncanalyze.store.layout import CheckpointFiles, drop_state
from ncanalyze.store.sources.anatomy import check_sites, final_norm, finite_head, head
from ncanalyze.store.sources.discover import training_metadata
from ncanalyze.store.sources.load import decoded_tokens, find_tokenizer, load_model
from ncanalyze.store.store import Status, Store

log = logging.getLogger(__name__)


class Outcome(str, enum.Enum):
    """What became of one checkpoint (:func:`extract_checkpoint`, and a run's :class:`ExtractResult`)."""
    DONE = "done"          # extracted from the start
    RESUMED = "resumed"    # extracted, continuing a saved state
    SKIPPED = "skipped"    # already in the store under this configuration
    FAILED = "failed"      # bad in itself (a CheckpointError): the run's other checkpoints went on

    def __str__(self) -> str:
        return self.value


class Loaded(NamedTuple):
    """A checkpoint's model, loaded, and what comes with it."""
    model: torch.nn.Module
    tokenizer: object | None
    tokenizer_name: str | None
    seconds: float                # the time the load took (for the estimate)
    classifier: torch.Tensor      # the output layer's weight (vocab x hidden) and bias
    bias: torch.Tensor | None
    plan: layers.Plan             # the run's plan, its passes fitted to the memory under --layers-per-pass auto


def extract_checkpoint(job: Job, store: Store, announce: Callable[..., None] | None = None,
                       interrupt: DeferredInterrupt | None = None, extra_attrs: dict | None = None) -> Outcome:
    """Extract one checkpoint, resolved into ``job`` (:func:`~ncanalyze.store.extraction.job.make_job`), into
    ``<store>/<run>/<checkpoint>``.

    One writer at a time per checkpoint (a lock beside the store; a second one waits, then finds it done). A
    finished checkpoint is skipped without loading its weights.

    Parameters
    ----------
    job
        The checkpoint, its settings resolved, and the run control (``overwrite``: replace a group extracted under
        another configuration; ``restart``: discard a saved resume state).
    store
        The store.
    announce
        ``announce(model, seconds_to_load, train, val, plan)`` (the load's seconds and the data's opening),
        called before the passes start (the estimate is
        logged there, :func:`announcer`).
    interrupt
        A pending Ctrl-C is taken at the next batch boundary, after saving the state.
    extra_attrs
        Go into the group's attributes last (a Hub revision's origin and step).

    Returns
    -------
    Outcome
        DONE, SKIPPED or RESUMED.
    """
    files = store.files(job.ckpt)
    with store.lock(job.group), threads.policy(job.cfg.threads):
        if _settle(job, store) is Status.SKIP:
            return Outcome.SKIPPED
        loaded = load_checkpoint(job)
        job = job.with_plan(loaded.plan)
        started = time.perf_counter()
        train, val = job.inputs(store, loaded.tokenizer)
        if announce:  # before the state is made: the estimate times a few batches on a scratch state of its own
            announce(loaded.model, loaded.seconds + time.perf_counter() - started, train, val, job.plan)
        outcome = _passes_and_write(job, store, files, loaded, train, val, interrupt, extra_attrs)
        drop_state(files.state)
        return outcome


def _settle(job: Job, store: Store) -> Status:
    """The checkpoint's status, after putting back a group an overwrite left aside; a skipped one's leftovers (a
    state or a staged copy left by a run killed after its write) are removed, a refused one raises."""
    files = store.files(job.ckpt)
    store.recover(job.group)
    status = job.resuming().status(store)  # a state to discard is the resume's to drop (_resume)
    if status is Status.SKIP:
        drop_state(files.state)
        for stale in (files.staging, files.old):
            shutil.rmtree(stale, ignore_errors=True)
    if status is Status.REFUSE:
        raise refusal(job.group, store, store.attrs(job.group), job.record, job.cfg.tag)
    return status


def load_checkpoint(job: Job) -> Loaded:
    """The model and tokenizer, timed, and the head; the running state checked against the free memory."""
    ckpt, cfg, run = job.ckpt, job.cfg, job.run
    started = time.perf_counter()
    model = load_model(ckpt, cfg.dtype, run.device, cfg.allow_pickle, cfg.trust_remote_code)
    tokenizer, tok_name = find_tokenizer(ckpt, cfg.tokenizer, cfg.trust_remote_code)
    loaded = time.perf_counter() - started
    classifier, bias = head(model)
    finite_head(classifier, bias, ckpt.group)
    check_sites(model, run.plan.layers)  # a sublayer the architecture lacks: before any work
    plan = fit_plan(run.plan, *classifier.shape, cfg.samples_per_class, run.device, parse_size(cfg.state_memory))
    check_memory(state_bytes(*classifier.shape, cfg.samples_per_class, run.device), plan.widest_pass, run.device)
    return Loaded(model, tokenizer, tok_name, loaded, classifier, bias, plan)


def _passes_and_write(job: Job, store: Store, files: CheckpointFiles, loaded: Loaded, train: Blocks,
                      val: Blocks | None, interrupt: DeferredInterrupt | None, extra_attrs: dict | None) -> Outcome:
    """The running state (resumed where saved), the train and validation passes, the group's attributes and its write;
    DONE or RESUMED."""
    ckpt, cfg, run = job.ckpt, job.cfg, job.run
    model, classifier, bias, record = loaded.model, loaded.classifier, loaded.bias, run.record
    positions = None if train.total is None else train.total * run.labels.width(train.block_size)
    folds = fit_folds(cfg.folds, *classifier.shape, cfg.samples_per_class, loaded.plan.widest_pass, run.device,
                      parse_size(cfg.state_memory))
    ex = Extraction(layers.fit_embeddings(run.plan, positions), *classifier.shape, cfg.samples_per_class, cfg.seed,
                    run.device, files.layers, folds=folds, labels=run.labels)
    outcome = _resume(ex, files.state, job, train, val)
    ex.split_count = label_counts(train, ex.args[0], run.labels)
    saver = Saver(files.state, lambda: ex.state(record), cfg.state_every, interrupt)
    store.ensure()  # the store appears now, its inputs all opened: a command that fails before leaves none
    run_passes(model, train, val, ex, classifier, bias, cfg.min_count, cfg.batch_size, saver, ckpt.group)
    attrs = group_attributes(ckpt.group, training_metadata(ckpt), model, ex, classifier, cfg, run, loaded.tokenizer,
                             loaded.tokenizer_name, dtype=cfg.dtype, device=run.device, source=str(ckpt.path.resolve()),
                             extra=extra_attrs)
    norm = final_norm(model)
    ds, others = ex.datasets(classifier, bias, decoded_tokens(loaded.tokenizer, classifier.shape[0]), attrs, norm and norm[0])
    store.write_checkpoint(ckpt.group, ds, layers=others)
    ex.cleanup()
    return outcome


def _resume(ex: Extraction, spath: Path, job: Job, train: Blocks, val: Blocks | None) -> Outcome:
    """Load the saved state into ``ex`` if there is one for this configuration: RESUMED, else DONE (a fresh
    start). A state under another configuration, or unreadable, or inconsistent, is refused unless the job's
    ``overwrite`` (or ``restart``) discards it."""
    record, batch_size, group = job.record, job.cfg.batch_size, job.group
    if job.restart or not spath.exists():
        drop_state(spath)
        ex.start()
        return Outcome.DONE
    try:
        arrays = load_state(spath)
        old = record_of(arrays)
        if old != record:
            raise UserError(f"an interrupted extraction of {group} used another configuration "
                            f"({differences(old, record)}); rerun with the same options to resume it, "
                            "or pass --overwrite to start again")
        blocks = val if int(arrays["phase"]) == Phase.VALIDATION and val is not None else train
        labels = job.run.labels  # a label file may leave a batch's every position out, and has no NC4 counts
        ex.load(arrays, batch_size * labels.width(blocks.block_size), str(spath), dense=labels.vocabulary)
    except UserError as e:
        if not job.overwrite:
            raise
        log.info("%s: discarding its resume state (%s)", group, e)
        drop_state(spath)
        ex.reset()
        return Outcome.DONE
    return Outcome.RESUMED
