"""Neural collapse measured while a model trains (SPEC section 2b): a ``transformers.TrainerCallback`` that runs the
extraction's own passes (passes.py, over the running state of running.py) through the live model on the Trainer's
evaluation schedule, or every ``every`` steps, and writes ``<run>/step-<global_step>`` through io.py, with the store's
schema and attributes, so that ``measure``, ``report`` and xarray read it like any checkpoint.

The model is measured in eval mode under ``torch.inference_mode``, with autocast off and every RNG (torch, CUDA,
numpy, ``random``) put back after, so training goes on exactly as without the callback. A measurement that fails on
bad input (data outside the model's vocabulary, a store holding the run under other settings, a full disk) is one
log line naming the fix; training goes on and nothing in the store is lost.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from ncanalyze.analyzer.metrics import measure_all
from ncanalyze.core import threads
from ncanalyze.core.errors import UserError
from ncanalyze.core.names import check_name
from ncanalyze.store.data.blocks import Blocks
from ncanalyze.store.data.split_counts import label_counts
from ncanalyze.store.extraction.attributes import group_attributes
from ncanalyze.store.extraction.config import differences
from ncanalyze.store.extraction.job import Job, make_job
from ncanalyze.store.extraction.memory import fit_folds
from ncanalyze.store.extraction.passes import run_passes
from ncanalyze.store.extraction.running import Extraction
from ncanalyze.store.extraction.settings import ExtractConfig, parse_size
from ncanalyze.store.runs import callback_ddp as ddp, cost
from ncanalyze.store.sources import adapters
from ncanalyze.store.sources.anatomy import check_sites, default_block_size, final_norm, finite_head, head, n_layers
from ncanalyze.store.sources.load import decoded_tokens
from ncanalyze.store.store import Store
from transformers import TrainerCallback

log = logging.getLogger(__name__)

LIVE = "live"  # the configuration record's ``weights``: the model being trained, not a file


class _NoSaver:
    """The passes' saver for a live model: nothing to resume (the weights change at the next step)."""

    def maybe(self, force: bool = False) -> None:
        """Save nothing."""


class _Timed:
    """``blocks`` whose batch loops are timed: each loop's seconds, from its first batch asked for to its end (the
    batches' work), are added to ``spent[0]``; all else is the blocks' own."""

    def __init__(self, blocks: Blocks, spent: list[float]):
        self.blocks, self.spent = blocks, spent

    def __getattr__(self, name: str):
        return getattr(self.blocks, name)

    def labelled(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """The blocks' :meth:`~Blocks.labelled`, timed."""
        started = time.perf_counter()
        try:
            yield from self.blocks.labelled(batch_size)
        finally:
            self.spent[0] += time.perf_counter() - started


@dataclass
class _Setup:
    """What the first measurement resolves once (the callback's set-up, said apart from the work that recurs): the
    job (the configuration, what it resolved to: its record and layer plan), the blocks, the split's label counts and
    the decoded vocabulary."""
    job: Job
    train: Blocks
    val: Blocks | None
    tokenizer: object | None
    tokenizer_name: str | None  # where it came from (the group's attribute ``tokenizer``)
    decoded: list[str] | None = None  # each token's string, decoded once (the group's vocabulary coordinate)
    split_count: np.ndarray | None = None  # the whole train split's label counts, counted once

    def counted(self, classes: int) -> np.ndarray:
        """The whole train split's label counts over its ``classes`` (the running state's), counted once (again if
        the vocabulary was resized)."""
        if self.split_count is None or len(self.split_count) != classes:
            self.split_count = label_counts(self.train, classes, self.job.run.labels)
        return self.split_count

    def tokens(self, vocab: int) -> list[str]:
        """Each token's string, decoded once (again if the vocabulary was resized)."""
        if self.decoded is None or len(self.decoded) != vocab:
            self.decoded = decoded_tokens(self.tokenizer, vocab)
        return self.decoded


@contextlib.contextmanager
def untouched(model: torch.nn.Module) -> Iterator[None]:
    """Measure ``model`` without changing its training: eval mode, no autocast, no autograd, and afterwards every
    module's mode and the torch, CUDA, numpy and ``random`` generators as they were.

    Parameters
    ----------
    model
        The model being trained.
    """
    modes = [(m, m.training) for m in model.modules()]
    py, npy = random.getstate(), np.random.get_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if cuda:
            stack.enter_context(torch.autocast("cuda", enabled=False))
        stack.enter_context(torch.inference_mode())
        model.eval()
        try:
            yield
        finally:
            for m, mode in modes:
                m.training = mode
            random.setstate(py)
            np.random.set_state(npy)


def run_name(args) -> str:
    """The run's name in the store: the Trainer's ``run_name`` when set (and not its output folder, the default some
    versions give it), else the output folder's name.

    Parameters
    ----------
    args
        The ``TrainingArguments``.

    Returns
    -------
    str
        The run name.
    """
    name = getattr(args, "run_name", None)
    if name and name != args.output_dir:
        name = str(name).replace("/", "-")  # one group level: <run>/step-<N>
    else:
        name = Path(args.output_dir).resolve().name
    return check_name(name, "the run name", "set TrainingArguments(run_name=...) to a plain name")


def refuse_sharded(args) -> str | None:
    """Why this training can't be measured: FSDP and DeepSpeed shard the parameters across ranks (the head and the
    blocks are not whole on any one), None otherwise."""
    if getattr(args, "fsdp", None):
        return "FSDP shards the parameters"
    if getattr(args, "deepspeed", None):
        return "DeepSpeed shards the parameters"
    return None


class NeuralCollapseCallback(TrainerCallback):
    """Neural collapse statistics of the model being trained, at every evaluation (or every ``every`` steps), into
    the store as ``<run>/step-<global_step>``, equal to ``ncanalyze extract`` of a checkpoint saved at that step on
    the same data and settings.

    Parameters
    ----------
    store
        The store, its path or a ``Store`` [default: ``$NCANALYZE_STORE``, else ``./ncanalyze.zarr``].
    train_data
        The train data, any form ``--dataset`` takes (text needs the Trainer's tokenizer, its ``processing_class``).
    val_data
        The validation data (None: as ``--val-dataset``'s default, the validation split beside ``train_data``).
    max_train_tokens, max_val_tokens
        Caps on the tokens read: whole blocks spread over the whole split (``cap_mode="prefix"``: its first blocks),
        the same blocks at every measurement and as ``ncanalyze extract`` reads them with the same settings. With
        neither given: a quarter of the tokens the training reads between two measurements (``every`` or the
        evaluation interval, x the sequences of a step x ``block_size``) and a quarter as many validation tokens
        (cost.default_caps), said in the log; every block where the interval is unknown (pass a cap above the data's
        size to read it all).
    layers
        ``last``, ``all`` or comma-separated indices, as ``--layers``.
    every
        Measure every this many steps instead of at each evaluation.
    max_share
        Skip a step where measuring it would take the callback above this share of the training time so far (e.g.
        :data:`~.cost.BUDGET`, 0.25; said at the first skip). None (the default): every step of the schedule is
        measured, as the SPEC's schedule says; the default caps above bound the cost instead.
    trainer
        The Trainer, when known: the scalar metrics then go through ``trainer.log`` to every integration (TensorBoard,
        W&B, ...); without it they are appended to ``state.log_history`` (``trainer_state.json``). They are stored with
        the group without their jackknife errors (``ncanalyze measure`` adds those afterwards, from the stored folds).
    **settings
        Any other field of :class:`~ncanalyze.store.extraction.settings.ExtractConfig` (``batch_size``, ``samples_per_class``,
        ``block_size``, ``split``, ``val_split``, ``text_column``, ``min_count``, ``seed``, ``cap_mode``, ...).
    """

    def __init__(self, store: str | Path | Store | None = None, train_data: str | None = None,
                 val_data: str | None = None, max_train_tokens: int | None = None, layers: str = "last",
                 every: int | None = None, *,
                 max_val_tokens: int | None = None, trainer=None, max_share: float | None = None, **settings):
        if train_data is None:
            raise UserError("NeuralCollapseCallback needs train_data (any form --dataset takes)")
        known = {f.name for f in fields(ExtractConfig)} - {"dataset", "val_dataset", "max_train_tokens",
                                                          "max_val_tokens", "layers", "tag"}
        if set(settings) - known:
            raise UserError(f"NeuralCollapseCallback takes no setting {', '.join(sorted(set(settings) - known))}: "
                            f"the settings are {', '.join(sorted(known))}")
        if every is not None and (not isinstance(every, int) or every < 1):
            raise UserError(f"every={every!r}: pass a number of steps (1 or more), or None to measure at evaluations")
        self.store = Store.at(store)  # resolved once: the default store when none
        self.cfg = ExtractConfig(dataset=str(train_data), val_dataset=None if val_data is None else str(val_data),
                                 max_train_tokens=max_train_tokens, max_val_tokens=max_val_tokens, layers=layers,
                                 **settings)
        self.every, self.trainer = every, trainer
        if max_share is not None and not (isinstance(max_share, (int, float)) and 0 < max_share < 1):
            raise UserError(f"max_share={max_share!r}: pass a share of the training time between 0 and 1 (e.g. 0.25), "
                            "or None to measure at every step of the schedule")
        self.max_share = max_share
        self.budgeted = max_share is not None  # asked for: a step may be skipped to keep the callback's share
        self.skips: list[tuple[int, float, float, float]] = []  # (step, spent, next, trained) of each step skipped
        self.checks: list[tuple[int, float, float, float]] = []  # the same of each measurement the budget let through
        self.t0: float | None = None  # perf_counter when training began
        self.setup: _Setup | None = None
        self.off: str | None = None  # why measuring stopped (bad input that every later step would meet again)
        self.done: set[int] = set()
        self.pending = False
        self.seconds: list[float] = []  # each measurement's recurring work
        self.spans: list[tuple[float, float, float]] = []  # perf_counter at each one's call, its work's start, its end
        self.last: tuple[float, int, int] | None = None  # (perf_counter, step, tokens seen) at the last measurement's end
        self.setup_s = 0.0  # the set-up done once, at the first measurement
        self.parts: dict = {}  # the last measurement's passes and metrics seconds, and its classes' train tokens
        self.cost: cost.Cost | None = None  # the second measurement against the training since the first
        self.n_train: int | None = None  # train batches in all (DDP shares them out)
        self.output_dir: str | None = None  # the run's output folder, resolved: which run a group is of

    # --- the Trainer's events ---

    def on_train_begin(self, args, state, control, **kwargs):
        """The callback's lines (the time of each measurement, a refusal) are shown under any logging set-up
        (:func:`show_info`), run_clm's included."""
        show_info(log)
        self.t0 = time.perf_counter()
        threads.remember()  # a measurement within threads.INTERVAL of it measures the load since (no sample waited)
        if self.cfg.max_train_tokens is None and self.cfg.max_val_tokens is None and not self.setup:
            self._default_caps(args, state, kwargs.get("model"))

    def on_step_end(self, args, state, control, **kwargs):
        """Every ``every`` steps: measure now, or at this step's evaluation if one comes (to record its loss)."""
        if self.every and state.global_step % self.every == 0:
            if control.should_evaluate:
                self.pending = True
            else:
                self._measure(args, state, kwargs, None)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """At each evaluation (without ``every``), with that evaluation's ``eval_loss``."""
        if not self.every or self.pending:
            self.pending = False
            self._measure(args, state, kwargs, (metrics or {}).get("eval_loss"))

    def _default_caps(self, args, state, model) -> None:
        """Caps for a callback given none (:func:`~.cost.default_caps`): a quarter of the tokens the training reads
        between two measurements (``every``, else the evaluation interval), said once; every block where that is
        unknown."""
        strategy = getattr(args.eval_strategy, "value", args.eval_strategy)  # an IntervalStrategy, or its value
        interval = self.every or (state.eval_steps if strategy == "steps" else
                                  state.max_steps // max(1, math.ceil(args.num_train_epochs))
                                  if strategy == "epoch" else None)
        block = self.cfg.block_size or (default_block_size(model.config) if model is not None else None)
        sequences = args.train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
        caps = cost.default_caps(int(interval or 0), sequences, block or 0)
        if caps is None:
            return
        self.cfg = dataclasses.replace(self.cfg, max_train_tokens=caps[0], max_val_tokens=caps[1])
        if ddp.rank_world()[0] == 0:
            log.info("ncanalyze: no caps given: max_train_tokens=%s, max_val_tokens=%s, 1/%d of the tokens trained "
                     "between two measurements (%s steps of %s sequences of %s tokens) and 1/%d of that (pass the caps "
                     "to choose; `ncanalyze extract` given the same caps reads the same blocks)", f"{caps[0]:,}",
                     f"{caps[1]:,}", cost.TRAIN_SHARE, interval, sequences, block, cost.VAL_SHARE)

    # --- one measurement ---

    def _measure(self, args, state, kwargs: dict, eval_loss: float | None) -> None:
        """Measure at ``state.global_step``, once per step (every rank under DDP, rank 0 writing); bad input is one
        log line."""
        step, (rank, _) = state.global_step, ddp.rank_world()
        if self.off or step in self.done:
            return
        self.done.add(step)
        if self._skip(step):
            return
        refused = refuse_sharded(args)
        if refused:
            self._stop(f"{refused}: train with DDP (torchrun) or on one device to measure neural collapse while "
                       "training, or extract the saved checkpoints with `ncanalyze extract`")
            return
        try:
            group = f"{run_name(args)}/step-{step}"
        except UserError as e:  # a run name that is not one plain folder name: never a path beside the store
            self._stop(str(e))
            return
        self.output_dir = str(Path(args.output_dir).resolve())
        files = self.store.group_files(group)
        began = time.perf_counter()
        if not self._ready(kwargs["model"], self._tokenizer(kwargs), group):
            return
        started = time.perf_counter()  # the set-up done once (the blocks read or tokenized, the job) is said apart
        try:
            scalars = self.write(kwargs["model"], group,
                                 {"global_step": step, "epoch": state.epoch, "eval_loss": eval_loss})
        except UserError as e:
            self._stop(str(e))
            return
        except OSError as e:  # a full disk: this step is lost, the store is whole; the next one tries again
            self.store.recover(group)
            log.warning("ncanalyze: cannot write %s into %s (%s): free space on its disk or pass another store; "
                        "training goes on", group, self.store, e.strerror or e)
            return
        finally:
            if rank == 0:
                shutil.rmtree(files.staging, ignore_errors=True)
                shutil.rmtree(files.layers, ignore_errors=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if scalars is None:  # a rank other than the first: its share is in rank 0's group
            return
        self._said(group, step, args, state, (began, started, time.perf_counter()))
        self._log(state, step, scalars)

    def _skip(self, step: int) -> bool:
        """With ``max_share`` given, whether to skip this step: measuring again, as long as the last measurement took,
        would take the callback above that share of the training time so far (said at the first skip; the ranks
        follow rank 0). Without it (the default), every step of the schedule is measured."""
        if not (self.budgeted and self.setup is not None and self.t0 is not None):
            return False
        rank, world = ddp.rank_world()
        spent = sum(end - called for called, _, end in self.spans)
        numbers = (step, spent, self.seconds[-1] if self.seconds else 0.0, time.perf_counter() - self.t0 - spent)
        why = (f"step-{step}" if rank == 0 and self.seconds and cost.over_budget(*numbers[1:], self.max_share)
               else None)
        if world > 1:
            why = ddp.agree(why)
        (self.skips if why else self.checks).append(numbers)
        if why and len(self.skips) == 1 and rank == 0:
            log.info("ncanalyze: %s not measured, nor any later step while measuring would take the callback above "
                     "%.0f%% of the training time (%.1f s measured, %.1f s trained): max_share=None measures at "
                     "every one", why, 100 * self.max_share, spent, numbers[3])
        return why is not None

    def _said(self, group: str, step: int, args, state, span: tuple[float, float, float]) -> None:
        """A measurement's time logged, its ``span`` (called, work started, ended) kept; the first also says its
        set-up, the second its cost against the training since the first (:class:`~.cost.Cost`)."""
        self.spans.append(span)
        self.seconds.append(span[2] - span[1])
        if len(self.seconds) == 1:
            self.setup_s = span[1] - span[0]
            log.info("ncanalyze: %s measured in %.2f s, after %.2f s of set-up done once (the blocks read, the "
                     "split's labels counted, the vocabulary decoded, the job resolved); its cost against the "
                     "training is said at the next measurement, which repeats only the work that recurs", group,
                     self.seconds[-1], self.setup_s)
        else:
            log.info("ncanalyze: %s measured in %.2f s", group, self.seconds[-1])
        if len(self.seconds) == 2 and self.last is not None:  # its cost against the training, said once
            self.cost = self._cost(span[1], step, args, state)
            log.info("ncanalyze: %s", self.cost.line(group))
        self.last = (span[2], step, state.num_input_tokens_seen or 0)

    def _cost(self, started: float, step: int, args, state) -> cost.Cost:
        """This measurement (the second) against the training since the first ended."""
        (ended, before, seen), parts = self.last, self.parts
        train, val = self.setup.train, self.setup.val
        tokens = [0 if b is None or b.total is None else b.total * b.block_size for b in (train, val)]
        steps = step - before
        sequences = steps * args.train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
        return cost.Cost(self.seconds[-1], *tokens, started - ended, steps, sequences,
                         (state.num_input_tokens_seen or 0) - seen or None, parts["passes"], parts["metrics"],
                         parts["counts"], self.cfg.min_count, self.setup_s)

    def _ready(self, model, tokenizer, group: str) -> bool:
        """The configuration and data resolved (rank 0 first, so that text is tokenized into the cache once, then the
        others); an error on any rank stops every rank."""
        if self.setup is not None:
            return True
        rank, _ = ddp.rank_world()
        error = None
        for turn in (0, 1):
            if (rank == 0) == (turn == 0):
                try:
                    self._resolve(model, tokenizer, group)
                except UserError as e:
                    error = str(e)
            error = ddp.agree(error)
            if error:
                self._stop(error)
                return False
        return True

    def _stop(self, why: str) -> None:
        self.off = why
        if ddp.rank_world()[0] == 0:
                log.warning("ncanalyze: neural collapse is no longer measured in this run: %s; training goes on", why)

    @staticmethod
    def _tokenizer(kwargs: dict):
        tok = kwargs.get("processing_class") or kwargs.get("tokenizer")
        return getattr(tok, "tokenizer", tok)  # a processor holds its tokenizer

    def write(self, model, group: str, when: dict) -> dict[str, float] | None:
        """Run the passes through ``model`` and write ``group`` (after :meth:`_ready`).

        Parameters
        ----------
        model
            The live model (a transformers causal LM).
        group
            The group ``<run>/step-<N>``.
        when
            ``global_step``, ``epoch`` and ``eval_loss``.

        Returns
        -------
        dict or None
            The scalar metrics, ``nc/<metric>`` for the last layer and ``nc/layer_<l>/<metric>`` for the others; None
            on a rank other than the first under DDP.
        """
        setup, scalars, files = self.setup, {}, self.store.group_files(group)
        cfg, model = setup.job.cfg, adapters.unwrap(model)  # a PeftModel: its base with the adapter's layers in it
        rank, world = ddp.rank_world()
        with untouched(model), threads.policy(cfg.threads):  # training's own thread count comes back after
            classifier, bias = head(model)
            finite_head(classifier, bias, group)
            check_sites(model, setup.job.plan.layers)
            device = classifier.device
            folds = ddp.agreed_folds(fit_folds(cfg.folds, *classifier.shape, cfg.samples_per_class,
                                               setup.job.plan.widest_pass, device, parse_size(cfg.state_memory)))
            ex = Extraction(setup.job.plan, *classifier.shape, cfg.samples_per_class, cfg.seed, device,
                            files.layers if rank == 0 else None, folds=folds, labels=setup.job.run.labels)
            if rank == 0:
                ex.start()
                ex.split_count = setup.counted(ex.args[0])
            timer = time.perf_counter()  # the passes' seconds (a rank's share of the train pass under DDP among them)
            if world > 1 and not self._shared(model, setup, ex, rank, group):
                return None
            loops, began = [0.0], time.perf_counter()
            val = None if setup.val is None else _Timed(setup.val, loops)
            run_passes(model, _Timed(setup.train, loops), val, ex, classifier, bias, cfg.min_count, cfg.batch_size,
                       _NoSaver(), group)
            # the passes' batches (and a rank's share under DDP) grow with the tokens; their set-up (the validation
            # state, the loss's check) is left with the rest, which does not (cost.py)
            self.parts = {"passes": began - timer + loops[0], "metrics": 0.0,
                          "counts": ex.first().stats.count.cpu().numpy()}
            attrs = group_attributes(group, when, model, ex, classifier, cfg, setup.job.run, setup.tokenizer,
                                     setup.tokenizer_name, dtype=str(classifier.dtype).removeprefix("torch."),
                                     device=device, source="training", extra={"output_dir": self.output_dir})
            norm = final_norm(model)
            ds, others = ex.datasets(classifier, bias, setup.tokens(classifier.shape[0]), attrs, norm and norm[0])
            done = [("nc/", group, self._timed_metrics(ds, cfg.min_count, group))]

            def measured() -> Iterator[tuple[str, object]]:
                for sub, lds in others:  # measured as each is made: one layer's dataset in memory at a time
                    where, (kind, name) = f"{group}/{sub}", sub.split("/", 1)  # layers/1: nc/layer_1/; sites/attn_0
                    prefix = f"nc/layer_{name}/" if kind == "layers" else f"nc/{name}/"
                    done.append((prefix, where, self._timed_metrics(lds, cfg.min_count, where)))
                    yield sub, lds
            self.store.write_checkpoint(group, ds, layers=measured())
            ex.cleanup()
        for prefix, where, result in done:  # stored as `ncanalyze measure` stores them, once the group is in place
            if result is not None:
                self.store.write_metrics(where, *result, cfg.min_count, attrs["config_hash"])
                scalars.update(_named(result[0], prefix))
        for k in ("val_loss", "val_accuracy"):
            if attrs.get(k) is not None:
                scalars[f"nc/{k}"] = attrs[k]
        return scalars

    def _timed_metrics(self, ds, min_count: int, where: str):
        """:func:`_metrics`, its seconds added to this measurement's ``parts`` (they grow with the kept classes)."""
        timer = time.perf_counter()
        try:
            return _metrics(ds, min_count, where)
        finally:
            self.parts["metrics"] += time.perf_counter() - timer

    def _shared(self, model, setup: _Setup, ex: Extraction, rank: int, group: str) -> bool:
        """Under DDP: this rank's share of the train pass, merged into rank 0's ``ex`` (the default plan; a plan of
        several layers is run by rank 0 alone). Whether this rank goes on to the validation pass and the write."""
        if not setup.job.plan.single:
            return rank == 0
        if self.n_train is None:  # the ranks' data checked equal once (a content hash), then shared out
            self.n_train = ddp.agreed_batches(setup.train, setup.job.cfg.batch_size)
        return ddp.share_train(model, setup.train, ex, setup.job.cfg.batch_size, self.n_train, group)

    def _resolve(self, model, tokenizer, group: str) -> _Setup:
        """The job of this model (make_job with the live model's config, device and weights: its record and plan),
        and the blocks; a store holding the run under other settings is refused."""
        model = adapters.unwrap(model)  # a PeftModel: its base with the adapter's layers in it
        # cfg.tokenizer stays None for the Trainer's own tokenizer, as extract records the model's own
        cfg = self.cfg = dataclasses.replace(self.cfg, dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
        if cfg.tokenizer is not None:
            tokenizer = _load_tokenizer(cfg.tokenizer, cfg.trust_remote_code)
        self.store.prepare()
        job = make_job(None, cfg, model_config=model.config, device=next(model.parameters()).device, weights=LIVE)
        self._check_run(group.split("/")[0], job, identity(model, self.output_dir))
        train, val = job.inputs(self.store, tokenizer, flags=("max_train_tokens", "max_val_tokens"))
        where = cfg.tokenizer or (tokenizer is not None and getattr(tokenizer, "name_or_path", None)) or None
        self.setup = _Setup(job, train, val, tokenizer, where)
        vocab = head(model)[0].shape[0]  # the one-off work of a measurement, done here to be said apart from the rest
        self.setup.tokens(vocab)
        if ddp.rank_world()[0] == 0:
            self.setup.counted(job.run.labels.size(vocab))  # its classes: the vocabulary's, or a label file's
        return self.setup

    def _check_run(self, run: str, job: Job, model: dict) -> None:
        """A UserError if the store holds ``run`` measured under other settings (its steps would not compare), or from
        another model (another training's output folder, architecture or parameter count: its groups would be replaced
        step by step)."""
        groups, _ = self.store.checkpoint_groups()
        for g in groups:
            if g.count("/") != 1 or not g.startswith(f"{run}/"):
                continue
            attrs = self.store.attrs(g) or {}
            if attrs.get("config_hash") != job.hash:
                old = json.loads(attrs.get("config", "{}"))
                raise UserError(f"{self.store} already holds run {run} under other settings "
                                f"({differences(old, job.record)}): set TrainingArguments(run_name=...) to another name, "
                                f"pass another store, or remove it with `ncanalyze rm {run} --store {self.store}`")
            theirs = {k: attrs.get(k) for k in model}
            if attrs.get("source") == "training" and theirs != model:
                raise UserError(f"{self.store} already holds run {run} of another model ({describe(theirs)}; this "
                                f"training: {describe(model)}): set TrainingArguments(run_name=...) to another name, "
                                f"pass another store, or remove it with `ncanalyze rm {run} --store {self.store}`")

    def _log(self, state, step: int, scalars: dict[str, float]) -> None:
        """The scalars into the Trainer's logs: through ``trainer.log`` (every integration sees them) when the
        Trainer is known, else appended to ``state.log_history``."""
        if self.trainer is not None:
            self.trainer.log(dict(scalars))
        else:
            state.log_history.append({**scalars, "step": step})


def identity(model, output_dir: str | None) -> dict:
    """What tells one trained model from another in the store's attributes: its architecture, parameter count and the
    training's output folder (resolved); an adapted model's base and adapter type."""
    model = adapters.unwrap(model)
    config = model.config
    return {"model_type": config.model_type, "n_params": sum(p.numel() for p in model.parameters()),
            "n_layers": n_layers(config), "hidden_size": int(model.get_output_embeddings().weight.shape[1]),
            "output_dir": output_dir, **adapters.base_identity(model)}


def describe(model: dict) -> str:
    """'gpt_neo, 2 layers of width 32, 28,704 parameters, from /runs/a/out'."""
    return (f"{model.get('model_type')}, {model.get('n_layers')} layers of width {model.get('hidden_size')}, "
            f"{model.get('n_params') or 0:,} parameters" + (f", from {model['output_dir']}" if model.get("output_dir")
                                                            else ""))


def _load_tokenizer(name: str, trust_remote_code: bool):
    """The tokenizer given as the ``tokenizer`` setting (used instead of the Trainer's, as ``--tokenizer`` is)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load tokenizer {name!r} ({type(e).__name__}); pass tokenizer= a local folder or a "
                        "Hub name, or leave it out to use the Trainer's") from None


def show_info(logger: logging.Logger) -> None:
    """Make ``logger``'s INFO lines shown, each once, whatever the logging set-up.

    Its level becomes INFO unless a level was set on it or a parent below the root (run_clm's ``basicConfig`` leaves
    the root at WARNING, which would drop them). Where no handler on its way to the root shows INFO (none at all, or
    only handlers set above it), it gets a stderr handler of its own for just the records those handlers drop, so
    no line is shown twice; set up again (a second Trainer), it adds nothing.

    Parameters
    ----------
    logger
        The callback's logger.
    """
    if not _level_set(logger):
        logger.setLevel(logging.INFO)
    floor = _handler_floor(logger)
    if (floor is not None and floor <= logging.INFO) or any(isinstance(h, _OwnHandler) for h in logger.handlers):
        return
    logger.addHandler(_OwnHandler(floor))


class _OwnHandler(logging.StreamHandler):
    """stderr, the bare message, for the records below ``floor`` (those the handlers on the way up don't show)."""

    def __init__(self, floor: int | None):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        if floor is not None:
            self.addFilter(lambda record: record.levelno < floor)


def _level_set(logger: logging.Logger) -> bool:
    """Whether a level was set on ``logger`` or a parent below the root (someone chose what it shows)."""
    while logger is not None and logger is not logging.getLogger():
        if logger.level != logging.NOTSET:
            return True
        logger = logger.parent
    return False


def _handler_floor(logger: logging.Logger) -> int | None:
    """The lowest level a handler on ``logger``'s way to the root shows (None: no handler there)."""
    levels = []
    while logger is not None:
        levels += [h.level for h in logger.handlers if not isinstance(h, _OwnHandler)]
        logger = logger.parent if logger.propagate else None
    return min(levels, default=None)


def _metrics(ds, min_count: int, where: str):
    """(scalars, per-class) of ``measure_all``, or None with a warning where the group can't be measured (fewer than
    two kept classes early in training): its statistics are written all the same. Without the jackknife errors (F + 1
    measurements' work where the metrics are one): the stored folds give them to ``ncanalyze measure`` afterwards,
    which measures a group again whose record lacks them (table.is_measured)."""
    try:
        return measure_all(ds, min_count, se=False)
    except UserError as e:
        log.warning("ncanalyze: %s: no metrics (%s)", where, e)
        return None


def _named(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}{k}": float(v) for k, v in metrics.items()}
