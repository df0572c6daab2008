"""Measure the checkpoints of a store: the scalar metrics go into each group's attributes (``metrics``, with
``metrics_min_count`` and ``metrics_config_hash``), the per-class views into variables ``class_*`` (vocab).
The maths is ``ncanalyze.analyzer.measure_all``; reading and writing the store is io.py."""
from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from ncanalyze.analyzer.engines import engine_device
from ncanalyze.analyzer.metrics import measure_all
from ncanalyze.analyzer.registry import MEASURE, MeasureSettings
from ncanalyze.analyzer.schema import HEAD, LAYER, SITE
from ncanalyze.analyzer.table import is_measured, metrics_table, same_model_and_step
from ncanalyze.core import threads
from ncanalyze.core.errors import UserError
from ncanalyze.core.names import shown
from ncanalyze.store.bars import progress_bar
from ncanalyze.store.classifier import checkpoint_group
from ncanalyze.store.client import client
from ncanalyze.store.io import CHUNK_ERRORS
from ncanalyze.store.store import Store

WORKER_WAIT_S = 60  # seconds a scheduler without workers is given for a first one to join


VANISHED = "removed while being measured (ncanalyze rm): nothing to measure"


@dataclass
class MeasureResult:
    """What :func:`measure_store` did. A group is a checkpoint group (its last layer) or one of its layer groups
    (``<run>/<checkpoint>/layers/<l>``)."""
    table: pd.DataFrame              # one row per group measured or already measured (run, checkpoint, ..., layer)
    new: pd.DataFrame                # the rows of the groups measured by this call
    measured: list[str]              # the groups measured by this call
    skipped: list[str]               # the groups already measured under these settings (read back, not recomputed)
    failed: dict[str, str] = field(default_factory=dict)  # the groups left out (unreadable, not measurable): why

    @property
    def has_layers(self) -> bool:
        """Whether any group is a layer group (then a checkpoint is several rows)."""
        return any(checkpoint_group(g) != g for g in [*self.measured, *self.skipped, *self.failed])

    @staticmethod
    def checkpoints(groups) -> list[str]:
        """The checkpoints of ``groups``, each once, in order (a damaged array's path counts as its checkpoint)."""
        return list(dict.fromkeys("/".join(checkpoint_group(g).split("/")[:2]) for g in groups))


def measure_store(store: str | Path | Store, min_count: int = MEASURE.min_count, scheduler: str | None = None,
                  tile: int | None = MEASURE.tile, force: bool = False, device: str = MEASURE.device,
                  se: bool = MEASURE.se, threads_setting: int | str = MEASURE.threads) -> MeasureResult:
    """Measure every complete checkpoint of ``store`` not yet measured with ``min_count`` (all with ``force``),
    store the results in its group, and return them with the table of one row per checkpoint and stored layer: run,
    checkpoint, global_step, epoch, n_params, n_layers, hidden_size, eval_loss, ..., layer (a checkpoint group is its
    last layer, n_layers; its ``layers/<l>`` groups are the others) and the scalar metrics (nan where not measurable).

    A checkpoint that can't be measured (corrupt or missing data, fewer than 2 kept classes, ...) is left out with a
    warning naming it and the fix; the others go on. The result's ``measured`` lists the groups measured by this
    call, ``skipped`` those already measured, ``failed`` maps each left-out group to why. ``scheduler``: a
    dask.distributed scheduler
    address (default ``$DASK_SCHEDULER_ADDRESS``); without one the local threaded scheduler; a scheduler without
    workers gets ``WORKER_WAIT_S`` seconds for one to join, then a one-line error. ``device``: where the pairwise sums
    and the d x d work run (``auto``: CUDA where torch sees one, in this process; else the numba pass on the CPU, on
    the scheduler's workers where there is one). ``se``: each metric's delete-one-fold jackknife error
    ``<metric>_se`` (analyzer.jackknife; nan for a group extracted without folds).
    ``threads_setting``: ``--threads`` of this process's kernels
    (ncanalyze.core.threads; torch's and the BLAS's).

    A store that cannot be written (a read-only mount, no permission) is found before any work: the checkpoints are
    measured without storing the results, said in one warning (they are measured again next time).
    """
    # a bad value: the command's one line
    MeasureSettings(min_count=min_count, tile=tile, device=device, threads=threads_setting)
    store = Store.at(store)
    store.require()  # the one-line error for a path that is not a store
    on = engine_device(device)  # a device that is not there: one line, before any work
    groups, skipped = store.checkpoint_groups()
    attrs = {g: by_path(g, store.attrs(g)) for g in groups}
    todo = [g for g in groups if force or not is_measured(attrs[g], min_count, errors=se)]
    unwritable = _unwritable(store.path) if todo else None
    if unwritable:
        warnings.warn(f"{store} is not writable ({unwritable}): measuring {len(todo)} checkpoint(s) without storing "
                      "the results, so they are measured again next time; measure a writable copy to keep them",
                      ReadOnlyStore, stacklevel=2)
    raised: dict[tuple[type[Warning], str], list[str]] = {}  # (category, message) -> the groups that raised it
    heads: dict[str, object] = {}  # the head of the checkpoint being measured, read once for all its layer groups
    with client(scheduler, workers=WORKER_WAIT_S if todo else None), threads.policy(threads_setting):
        for g in progress_bar(todo, desc="measuring", unit="group", disable=None):
            threads.tick()  # --threads auto: the load measured again between groups
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    ds = store.statistics(g, heads.get(checkpoint_group(g)))
                    if checkpoint_group(g) == g:
                        heads = {g: ds[[h for h in HEAD if h in ds.variables]]}
                    scalars, per_class = measure_all(ds, min_count, tile, on or "cpu", "torch" if on else "numba",
                                                     se=se)
                except (UserError, *CHUNK_ERRORS) as e:  # a file gone mid-read is an OSError
                    if _vanished(store, g):
                        skipped[g] = VANISHED
                    elif isinstance(e, UserError):
                        skipped[g] = str(e).removeprefix(f"{g} ")
                    else:
                        raise
                    continue
            for w in caught:
                raised.setdefault((w.category, str(w.message)), []).append(g)
            if unwritable:
                attrs[g]["metrics"] = scalars
                continue
            try:
                with store.lock(checkpoint_group(g), doing="measured"):
                    if _vanished(store, g):  # removed (ncanalyze rm) between the read and the write: nothing to write
                        skipped[g] = VANISHED
                        continue
                    unwritable = _keep(store, g, attrs[g], scalars, per_class, min_count, unwritable)
            except OSError as e:  # the lock itself cannot be made (a full disk): measured, not stored
                unwritable = _cannot_store(store, e)
                attrs[g]["metrics"] = scalars
    store.prune()
    for (category, message), where in raised.items():  # once each, naming the checkpoints, in its own category
        warnings.warn(f"{message} ({_some(where)})", category, stacklevel=2)
    twins = same_model_and_step({g: attrs[g] for g in groups if g not in skipped})
    for g, why in (skipped | twins).items():
        warnings.warn(f"{shown(g)}: skipped: {shown(why)}", SkippedCheckpoint, stacklevel=2)
    kept = [g for g in groups if g not in skipped and g not in twins]
    if not kept:
        raise UserError(f"no checkpoint in {store} can be measured ({len(skipped)} skipped, see above)" if skipped else
                        f"no complete checkpoint in {store}: run `ncanalyze extract CHECKPOINTS --store {store}` first")
    for g, why in same_weights({g: attrs[g] for g in kept}).items():
        warnings.warn(f"{shown(g)}: {shown(why)}", SameModel, stacklevel=2)
    failed = skipped | twins
    measured = [g for g in todo if g not in failed]
    return MeasureResult(metrics_table(attrs[g] for g in kept), metrics_table(attrs[g] for g in measured), measured,
                         [g for g in kept if g not in todo], failed)


class SkippedCheckpoint(UserWarning):
    """A checkpoint left out of a measurement or report, with why."""


class SameModel(UserWarning):
    """One model measured twice under two names (a run copied inside the store): both kept, said."""


def by_path(group: str, attrs: dict) -> dict:
    """A group's attributes with its run and checkpoint named by its path in the store (``<run>/<checkpoint>``), not
    by the attributes written with it: a run copied inside the store is its own rows, never the original's twice."""
    run, checkpoint = group.split("/")[:2]
    return {**attrs, "run": run, "checkpoint": checkpoint}


def same_weights(groups: dict[str, dict]) -> dict[str, str]:
    """The groups that are another group's measurement under another name (the same configuration hash: the same
    weights, data and settings; and the same layer), with why, naming the first. The training callback's groups
    are left alone: their hash names the run's settings, not its weights (the model being trained has no file)."""
    first: dict[tuple, str] = {}
    out = {}
    for g, a in groups.items():
        key = (a.get("config_hash"), a.get(SITE) or a.get(LAYER, a.get("n_layers")))
        if key[0] is None or a.get("source") == "training":
            continue
        if key in first:
            out[g] = (f"the same model, data and settings as {first[key]}, measured twice under two names: both are "
                      "kept; remove one (ncanalyze rm) unless you meant it")
        else:
            first[key] = g
    return out


class ReadOnlyStore(UserWarning):
    """Checkpoints measured without storing the results: the store cannot be written."""


def _keep(store: Store, g: str, attrs: dict, scalars: dict, per_class, min_count: int, unwritable: str | None) -> str | None:
    """Store ``g``'s metrics and put them into ``attrs``; only into ``attrs`` when the store is ``unwritable`` (why),
    or when writing fails (a full disk, said once: the record is written last, so ``g`` is measured again). Returns
    why the store is unwritable, or None."""
    if not unwritable:
        try:
            attrs |= store.write_metrics(g, scalars, per_class, min_count, attrs.get("config_hash"))
            return None
        except OSError as e:
            unwritable = _cannot_store(store, e)
    attrs["metrics"] = scalars
    return unwritable


def _cannot_store(store, e: OSError) -> str:
    """Why the metrics cannot be stored (a full disk), said once in a warning; the checkpoints are measured all the
    same and measured again next time."""
    why = e.strerror or type(e).__name__
    warnings.warn(f"cannot store the metrics in {store} ({why}): measuring the rest without storing the results",
                  ReadOnlyStore, stacklevel=4)
    return why


def _vanished(store: Store, g: str) -> bool:
    """Whether group ``g`` (or its checkpoint) is no longer in ``store``: what ``rm`` leaves, which measure and report
    skip with one line (rm moves a checkpoint out in one rename, under the lock measure takes to write)."""
    return not (store.path / g / "zarr.json").is_file()


def _unwritable(store: Path) -> str | None:
    """Why nothing can be written into ``store`` (a file created and removed to find out), or None."""
    try:
        with tempfile.TemporaryFile(dir=store):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def _some(groups: list[str], most: int = 3) -> str:
    """'N checkpoint(s): a, b, c and M more', each name safe to print (:func:`~ncanalyze.core.names.shown`)."""
    groups = sorted(groups)
    more = f" and {len(groups) - most} more" if len(groups) > most else ""
    return f"{len(groups)} checkpoint{'s' * (len(groups) > 1)}: " + ", ".join(map(shown, groups[:most])) + more


def load_table(source: str, min_count: int, scheduler: str | None
               ) -> tuple[pd.DataFrame, str | None, dict[str, str]]:
    """The metrics table from a store (measuring what is not yet measured) or from a metrics CSV.

    Parameters
    ----------
    source
        A store's path, or a ``.csv`` metrics table (an earlier report's metrics.csv).
    min_count
        Keep classes with at least this many train tokens (when measuring).
    scheduler
        A Dask scheduler address for measuring, or None.

    Returns
    -------
    table, store, failed
        The metrics table, the store's path (None for a CSV), and the groups left out of it with why.
    """
    path = Path(source)
    if path.suffix == ".csv":
        if not path.is_file():
            raise UserError(f"no metrics table at {path}")
        return pd.read_csv(path), None, {}
    if not path.exists():
        raise UserError(f"no store at {path}: run `ncanalyze extract CHECKPOINTS --store {path}` first, pass the "
                        "store's path, or set NCANALYZE_STORE")
    result = measure_store(str(path), min_count=min_count, scheduler=scheduler)
    return result.table, str(path), result.failed
