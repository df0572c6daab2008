"""A checkpoint resolved once: :func:`make_job` turns a checkpoint and the settings into a frozen, picklable
:class:`Job` (the settings resolved for it, the configuration record and its hash, the layer plan, the data to read,
and the run control: ``overwrite``, ``restart``), which every run consumes (local, Hub, shards, a cluster's tasks, the
Trainer callback). :class:`Jobs` resolves each checkpoint of a run once, on first asking.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ncanalyze.store.data.blocks import Blocks
from ncanalyze.store.extraction import config, layers
from ncanalyze.store.extraction.settings import ExtractConfig
from ncanalyze.store.sources.discover import Checkpoint
from ncanalyze.store.store import Status, Store


@dataclass(frozen=True)
class Job:
    """One checkpoint's extraction, resolved: what every step of it reads, and nothing resolved again.

    Parameters
    ----------
    ckpt
        The checkpoint (None: the model a Trainer is training, or a Hub revision not fetched yet).
    cfg
        The settings.
    run
        What they resolved to for it (:func:`~ncanalyze.store.extraction.config.resolve`): device, model config,
        block size, the train and validation data to read, the record and the layer plan.
    hash
        The record's hash.
    overwrite
        Replace a group extracted (or interrupted) under another configuration.
    restart
        Discard a saved resume state.
    """
    ckpt: Checkpoint | None
    cfg: ExtractConfig
    run: config.Resolved
    hash: str
    overwrite: bool = False
    restart: bool = False

    @property
    def group(self) -> str:
        """The checkpoint's group."""
        return self.ckpt.group

    @property
    def record(self) -> dict:
        """The configuration record (:func:`~ncanalyze.store.extraction.config.config_record`)."""
        return self.run.record

    @property
    def plan(self) -> layers.Plan:
        """The layer plan."""
        return self.run.plan

    def status(self, store: Store, group: str | None = None) -> Status:
        """What to do with the group already in ``store`` (SKIP, REFUSE, RESUME or FRESH: :func:`store.decide` on
        this job's hash, ``overwrite`` and ``restart``); ``group`` [default: the checkpoint's]."""
        return store.status(group or self.group, self.hash, self.overwrite, self.restart)

    def with_plan(self, plan: layers.Plan) -> Job:
        """This job with its layer plan fitted to the memory (its record unchanged)."""
        return dataclasses.replace(self, run=self.run._replace(plan=plan))

    def resuming(self) -> Job:
        """This job continuing what is saved (``restart`` spent: a state saved since is this run's own)."""
        return dataclasses.replace(self, restart=False)

    def inputs(self, store: Store | None, tokenizer, flags: tuple[str, str] = ("--max-train-tokens",
                                                                               "--max-val-tokens"),
               validation: bool = True) -> tuple[Blocks, Blocks | None]:
        """The train and validation blocks to read (:func:`~ncanalyze.store.extraction.config.open_inputs`)."""
        return config.open_inputs(store, self.cfg, self.run, tokenizer, flags, validation)


def make_job(ckpt: Checkpoint | None, cfg: ExtractConfig, overwrite: bool = False, restart: bool = False, *,
             model_config=None, device=None, weights: str | None = None,
             known: tuple[int | None, int | None] | None = None) -> Job:
    """The one resolution of a checkpoint under ``cfg`` (:func:`~ncanalyze.store.extraction.config.resolve`, called
    here only): reads its model config, fingerprints its weights, resolves the device, the data and the layer plan.

    Parameters
    ----------
    ckpt, cfg
        The checkpoint (None: a live model, or a Hub revision not fetched) and the settings.
    overwrite, restart
        The run control the job carries.
    model_config, device, weights
        A live model's config, device and the record's ``weights`` (as for ``resolve``).
    known
        (blocks, block size) of a model known from the store without its files (a Hub revision not fetched yet).

    Returns
    -------
    Job
        Frozen and picklable.
    """
    run = config.resolve(ckpt, cfg, model_config, device, weights, known=known)
    return Job(ckpt, cfg, run, config.config_hash(run.record), overwrite, restart)


class Jobs:
    """The jobs of one run: its settings and run control, each checkpoint resolved once on first asking (the
    estimate's timing of another architecture and that checkpoint's own turn share one resolution).

    Parameters
    ----------
    cfg
        The settings.
    overwrite, restart
        The run control every job carries.
    """

    def __init__(self, cfg: ExtractConfig, overwrite: bool = False, restart: bool = False):
        self.cfg, self.overwrite, self.restart = cfg, overwrite, restart
        self._jobs: dict[tuple[str, str], Job] = {}

    @classmethod
    def of(cls, settings: ExtractConfig | Jobs) -> Jobs:
        """``settings`` as the jobs of a run (an ExtractConfig: without overwrite or restart)."""
        return settings if isinstance(settings, Jobs) else cls(settings)

    def __call__(self, ckpt: Checkpoint) -> Job:
        """The checkpoint's job, resolved the first time it is asked for."""
        key = (ckpt.group, str(ckpt.path))
        if key not in self._jobs:
            self._jobs[key] = make_job(ckpt, self.cfg, self.overwrite, self.restart)
        return self._jobs[key]
