"""Measure the checkpoints of a store: the scalar metrics go into each group's attributes (``metrics``, with
``metrics_min_count`` and ``metrics_config_hash``), the per-class views into variables ``class_*`` (vocab).
The maths is ``ncanalyze.analyzer.measure_all``; reading and writing the store is io.py."""
from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from ncanalyze.analyzer.errors import UserError
from ncanalyze.analyzer.geometry import engine_device
from ncanalyze.analyzer.metrics import DEFINITIONS, measure_all
from ncanalyze.analyzer.schema import HEAD
from ncanalyze.analyzer.table import metrics_table
from ncanalyze.store.classifier import checkpoint_group
from ncanalyze.store.client import client
from ncanalyze.store.io import (
    checkpoint_groups,
    group_attrs,
    open_tree,
    read_statistics,
    write_metrics,
)
from tqdm.auto import tqdm

WORKER_WAIT_S = 60  # seconds a scheduler without workers is given for a first one to join


ALWAYS = tuple(k for k, f in DEFINITIONS.items() if not hasattr(f, "needs"))  # recorded for every measured group


def is_measured(attrs: dict, min_count: int) -> bool:
    """Measured with this min_count, since the group's statistics were last written, and with every metric that
    any checkpoint has (a group measured before the geometry metrics existed is measured again)."""
    return ("metrics" in attrs and set(ALWAYS) <= set(attrs["metrics"]) and attrs.get("metrics_min_count") == min_count
            and attrs.get("metrics_config_hash") == attrs.get("config_hash"))


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
        """The checkpoints of ``groups``, each once, in order."""
        return list(dict.fromkeys(checkpoint_group(g) for g in groups))


def measure_store(store: str | Path, min_count: int = 1, scheduler: str | None = None, tile: int | None = None,
                  force: bool = False, device: str = "auto") -> MeasureResult:
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
    the scheduler's workers where there is one).

    A store that cannot be written (a read-only mount, no permission) is found before any work: the checkpoints are
    measured without storing the results, said in one warning (they are measured again next time).
    """
    if not (Path(store) / "zarr.json").is_file():
        open_tree(store)  # the one-line error for a path that is not a store
    on = engine_device(device)  # a device that is not there: one line, before any work
    groups, skipped = checkpoint_groups(store)
    attrs = {g: group_attrs(store, g) for g in groups}
    todo = [g for g in groups if force or not is_measured(attrs[g], min_count)]
    unwritable = _unwritable(Path(store)) if todo else None
    if unwritable:
        warnings.warn(f"{store} is not writable ({unwritable}): measuring {len(todo)} checkpoint(s) without storing "
                      "the results, so they are measured again next time; measure a writable copy to keep them",
                      ReadOnlyStore, stacklevel=2)
    raised: dict[tuple[type[Warning], str], list[str]] = {}  # (category, message) -> the groups that raised it
    heads: dict[str, object] = {}  # the head of the checkpoint being measured, read once for all its layer groups
    with client(scheduler, workers=WORKER_WAIT_S if todo else None):
        for g in tqdm(todo, desc="measuring", unit="group", disable=None):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    ds = read_statistics(store, g, heads.get(checkpoint_group(g)))
                    if checkpoint_group(g) == g:
                        heads = {g: ds[[h for h in HEAD if h in ds.variables]]}
                    scalars, per_class = measure_all(ds, min_count, tile, on or "cpu", "torch" if on else "numba")
                except UserError as e:
                    skipped[g] = str(e).removeprefix(f"{g} ")
                    continue
            for w in caught:
                raised.setdefault((w.category, str(w.message)), []).append(g)
            unwritable = _keep(store, g, attrs[g], scalars, per_class, min_count, unwritable)
    for (category, message), where in raised.items():  # once each, naming the checkpoints, in its own category
        warnings.warn(f"{message} ({_some(where)})", category, stacklevel=2)
    for g, why in skipped.items():
        warnings.warn(f"{g}: skipped: {why}", SkippedCheckpoint, stacklevel=2)
    kept = [g for g in groups if g not in skipped]
    if not kept:
        raise UserError(f"no checkpoint in {store} can be measured ({len(skipped)} skipped, see above)" if skipped else
                        f"no complete checkpoint in {store}: run `ncanalyze extract CHECKPOINTS --store {store}` first")
    measured = [g for g in todo if g not in skipped]
    return MeasureResult(metrics_table(attrs[g] for g in kept), metrics_table(attrs[g] for g in measured), measured,
                         [g for g in kept if g not in todo], skipped)


class SkippedCheckpoint(UserWarning):
    """A checkpoint left out of a measurement or report, with why."""


class ReadOnlyStore(UserWarning):
    """Checkpoints measured without storing the results: the store cannot be written."""


def _keep(store, g: str, attrs: dict, scalars: dict, per_class, min_count: int, unwritable: str | None) -> str | None:
    """Store ``g``'s metrics and put them into ``attrs``; only into ``attrs`` when the store is ``unwritable`` (why),
    or when writing fails (a full disk, said once: the record is written last, so ``g`` is measured again). Returns
    why the store is unwritable, or None."""
    if not unwritable:
        try:
            attrs |= write_metrics(store, g, scalars, per_class, min_count, attrs.get("config_hash"))
            return None
        except OSError as e:
            unwritable = e.strerror or type(e).__name__
            warnings.warn(f"cannot store the metrics in {store} ({unwritable}): measuring the rest without storing "
                          "the results", ReadOnlyStore, stacklevel=3)
    attrs["metrics"] = scalars
    return unwritable


def _unwritable(store: Path) -> str | None:
    """Why nothing can be written into ``store`` (a file created and removed to find out), or None."""
    try:
        with tempfile.TemporaryFile(dir=store):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def _some(groups: list[str], shown: int = 3) -> str:
    """'N checkpoint(s): a, b, c and M more'."""
    groups = sorted(groups)
    more = f" and {len(groups) - shown} more" if len(groups) > shown else ""
    return f"{len(groups)} checkpoint{'s' * (len(groups) > 1)}: " + ", ".join(groups[:shown]) + more

