"""Extraction on a Dask distributed cluster (the connection: store/client.py) with checkpoints as
tasks (and, with shards, the parts of one checkpoint's train pass as tasks merged on the workers).

Every task writes into the same store, which must be a path every worker sees (a shared file system). Concurrent
writers are safe: each checkpoint has its lock and its staged swap (extraction/checkpoint.py, io.py), and creating the root and run
groups tolerates racing writers (``io.ensure_group``). A task whose worker dies is run again by dask and resumes from
the checkpoint's saved state (the lock dies with the process that held it).
"""
from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from ncanalyze.core.errors import CheckpointError, UserError
from ncanalyze.store.client import ENV, check_address, client
from ncanalyze.store.layout import drop_state
from ncanalyze.store.sources.discover import discover, tagged
from ncanalyze.store.store import Store

log = logging.getLogger(__name__)

def _resources(c) -> dict | None:
    """{"GPU": 1} when the workers declare GPU resources (``dask worker --resources GPU=1``): one checkpoint per GPU
    at a time. Waits for the first worker (a batch queue may take a while to start them)."""
    if not c.scheduler_info()["workers"]:
        log.info("waiting for a dask worker to join the scheduler at %s", c.scheduler.address)
        c.wait_for_workers(1)
    workers = c.scheduler_info()["workers"].values()
    return {"GPU": 1} if any("GPU" in (w.get("resources") or {}) for w in workers) else None


def extract_on_cluster(paths: list[str | Path], store: str | Path | Store, settings, address: str | None,
                       shards: int = 1):
    """Extract every checkpoint under ``paths`` into ``store`` on a cluster: per checkpoint a task that resolves its
    job (on a worker: its device is the workers'), then one task that extracts it (``shards`` > 1: a plan task, the
    shards, a merge tree and a final task), each given that job. Progress is shown as checkpoints complete.

    A checkpoint bad in itself (CheckpointError) fails alone; any other error cancels the rest and is raised.

    Parameters
    ----------
    paths
        Trainer output folders, model folders or folders of runs (seen by the workers at the same paths).
    store
        The store (made absolute: the workers may run elsewhere).
    settings
        The :class:`~ncanalyze.store.extraction.settings.ExtractConfig`, or the run's
        :class:`~ncanalyze.store.extraction.job.Jobs` (with ``overwrite`` and ``restart``).
    address
        The scheduler (else ``$DASK_SCHEDULER_ADDRESS``).
    shards
        Parts of each checkpoint's train pass, run as tasks and merged exactly.

    Returns
    -------
    ExtractResult
        Labelled with the paths; each group's Outcome (a failure with why).
    """
    # here, not at the top: `ncanalyze extract --help` and the CLI's import stay light (no torch)
    from ncanalyze.store.extraction.job import Jobs
    from ncanalyze.store.runs import local as ex
    jobs = Jobs.of(settings)
    address = address or os.environ.get(ENV)
    if not address:
        raise UserError(f"no dask scheduler given: pass --scheduler ADDRESS or set ${ENV}")
    check_address(address)  # before anything is created
    result = ex.ExtractResult(", ".join(map(str, paths)), str(store))
    store = Store.at(store).absolute()
    ckpts = [c for p in paths for c in tagged(discover(p), jobs.cfg.tag, jobs.cfg.base)]
    ex.check_settings(jobs.cfg, store, shards)
    ex.check_one_base(ckpts)
    if jobs.restart:  # here, once: a task run again after its worker died must resume, not restart
        for ckpt in ckpts:
            with store.lock(ckpt.group):
                drop_state(store.files(ckpt).state)
    with client(address) as c:
        tasks = _Tasks(c, store, jobs)
        log.info("%d checkpoint(s) as tasks on %s (%d workers%s)%s", len(ckpts), c.scheduler.address,
                 len(c.scheduler_info()["workers"]), ", one GPU each" if tasks.opts["resources"] else "",
                 f", {shards} shards each" if shards > 1 else "")
        try:
            return ex.each_checkpoint(store, result, tasks.completed(ckpts, shards), tasks.outcome, total=len(ckpts),
                                      defer=False)
        finally:
            tasks.cancel()


class _Tasks:
    """The tasks of an extraction on the cluster ``c``: submitted, followed as they complete, and the next stage of a
    sharded checkpoint submitted when its plan is known."""

    def __init__(self, c, store: Store, jobs):
        from ncanalyze.store.extraction import (
            checkpoint,  # torch: see extract_on_cluster
            job,
        )
        from ncanalyze.store.runs import local, shards

        self.c, self.store, self.cfg, self.overwrite = c, store, jobs.cfg, jobs.overwrite
        self.one, self.local, self.sh, self.make_job = checkpoint, local, shards, job.make_job
        self.tag = uuid.uuid4().hex[:8]
        self.opts = dict(pure=False, resources=_resources(c))
        self.what: dict = {}  # future -> (checkpoint, stage)
        self.jobs: dict = {}  # group -> the future of its job, resolved once on a worker

    def job(self, ckpt):
        """The future of the checkpoint's job, resolved once on a worker (restart is done: extract_on_cluster dropped
        the states, and a task run again after its worker died resumes)."""
        if ckpt.group not in self.jobs:
            self.jobs[ckpt.group] = self.c.submit(self.make_job, ckpt, self.cfg, self.overwrite, False,
                                                  key=f"job {ckpt.group} {self.tag}", **self.opts)
        return self.jobs[ckpt.group]

    def submit(self, stage: str, ckpt, f, *args):
        future = self.c.submit(f, *args, key=f"{stage} {ckpt.group} {self.tag}", **self.opts)
        self.what[future] = (ckpt, stage)
        return future

    def whole(self, ckpt):
        return self.submit("extract", ckpt, self.one.extract_checkpoint, self.job(ckpt), self.store)

    def sharded(self, ckpt, parts: list[tuple[int, int]]):
        """The shards of one checkpoint, their merge tree (on any worker: no GPU needed) and the final task, whose
        future is returned (a shard's error reaches it)."""
        c, sh, cfg, opts, job = self.c, self.sh, self.cfg, self.opts, self.job(ckpt)
        states = [c.submit(sh.train_shard, job, a, b, key=f"shard {ckpt.group} [{a}:{b}] {self.tag}", **opts)
                  for a, b in parts]
        for depth, level in enumerate(sh.merge_order(len(states))):
            states = [states[i] if j < 0 else
                      c.submit(sh.merge_states, states[i], states[j], cfg.samples_per_class, cfg.seed, pure=False,
                               key=f"merge {ckpt.group} {depth}.{n} {self.tag}")
                      for n, (i, j) in enumerate(level)]
        return self.submit("finish", ckpt, self.local.finish_sharded, job, self.store, states[0])

    def completed(self, ckpts: list, shards: int) -> Iterator[tuple[str, object]]:
        """Every checkpoint's tasks submitted, then (group, its last future) as each completes: a plan's shards and
        merge are submitted when it completes, and a plan that skips its checkpoint (or fails) is its last."""
        from distributed import as_completed

        for ckpt in ckpts:
            if shards > 1:
                self.submit("plan", ckpt, self.sh.shard_plan, self.job(ckpt), self.store, shards)
            else:
                self.whole(ckpt)
        done = as_completed(list(self.what))
        for f in done:
            ckpt, stage = self.what.pop(f)
            plan = f.result() if stage == "plan" and f.status == "finished" else None
            if plan is not None and plan.route is not self.sh.Route.SKIP:  # on to its tasks
                done.add(self.whole(ckpt) if plan.route is self.sh.Route.WHOLE else self.sharded(ckpt, plan.ranges))
            else:
                yield ckpt.group, f

    def outcome(self, f, interrupt=None):
        """A completed task's Outcome (a plan's: SKIPPED); a checkpoint's own failure (a CheckpointError, a worker
        that kept dying) raised as a CheckpointError, which ``each_checkpoint`` records as FAILED with why."""
        from distributed import KilledWorker

        try:
            out = f.result()
        except KilledWorker:
            raise CheckpointError("its worker died every time it ran it (out of memory? see the worker logs); run "
                                  "the same command again to resume it") from None
        return self.one.Outcome.SKIPPED if isinstance(out, self.sh.ShardPlan) else out

    def cancel(self) -> None:
        """Cancel the tasks not yet completed (an error, or Ctrl-C)."""
        for f in [*self.what, *self.jobs.values()]:
            f.cancel()
