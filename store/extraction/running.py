"""The running state of one checkpoint's extraction: every layer's accumulators, where the passes stand, and its
resume state (names, checks, restore).

One :class:`~ncanalyze.store.extraction.layers.Plan` drives it, the default's (the last layer alone) as ``--layers``'s. A layer's
accumulators (:class:`LayerState`) are the float64 class statistics, the reservoir, NC4's decision counts and the
model's loss sums; their states nest under their names (``stats``, ``reservoir``, ``val``, ``lm``) under
``layer<key>`` (Site.key: the index of a residual site, ``attn_1`` for ``attn:1``), and are flattened into the
saved state's names by :func:`~ncanalyze.store.extraction.resume.flatten` alone: ``layer3.stats.mean``. A finished pass's
sites wait in the staging folder (``layer-<key>.npz``), off the device.
"""
from __future__ import annotations

import functools
import json
import logging
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr
from ncanalyze.analyzer.accumulate import ClassStats, DecisionCounts, FoldStats, Groups
from ncanalyze.analyzer.jackknife import fold_variables
from ncanalyze.analyzer.schema import NC4_WITHOUT, stats_dataset
from ncanalyze.core.errors import CheckpointError
from ncanalyze.store.extraction.labels import Labels
from ncanalyze.store.extraction.layers import Embeddings, Plan
from ncanalyze.store.extraction.loss import NextTokenLoss
from ncanalyze.store.extraction.reservoir import Reservoir
from ncanalyze.store.extraction.resume import RESTART, Phase, flatten, load_state, save_state, unflatten
from ncanalyze.store.extraction.sites import Site
from ncanalyze.store.sources.anatomy import LogitTransform

log = logging.getLogger(__name__)


class LayerState:
    """One layer's accumulators: ``stats`` (:class:`ClassStats`), ``reservoir`` (:class:`Reservoir`), ``val`` (the
    counts of :class:`DecisionCounts`) and ``lm`` (the sums of :class:`NextTokenLoss`); the last two are the counts
    the validation pass's accumulators are made over, once the kept classes and the head are known. With ``folds``
    > 1, ``folds`` (a :class:`FoldStats`) and ``fold_val`` (the validation counts, folds x vocab): the same sums per
    fold. The train pass then updates the fold sums alone, and the totals are the folds merged in fold order
    (:meth:`FoldStats.totals`, equal to ``folds`` 1's to float64 rounding), made when ``stats`` is next read after
    the folds moved (a state save, the end of the pass): each batch's per-class work is done once."""

    def __init__(self, vocab: int, dim: int, k: int, seed: int, device: torch.device | str, folds: int = 1):
        self._stats = ClassStats(vocab, dim, device)
        self.reservoir = Reservoir(vocab, k, dim, seed)
        self.val = DecisionCounts.zeros(vocab, device)
        self.lm = NextTokenLoss.zeros(device)
        self.folds = FoldStats(folds, vocab, dim, device) if folds > 1 else None
        self.fold_val = None if folds == 1 else DecisionCounts.zeros(vocab, device, folds) | {
            NC4_WITHOUT: torch.zeros(folds, vocab, dtype=torch.int64, device=device)}  # NC4's replicates' agreements
        self._stale = False  # the fold sums moved since the totals were made from them

    @property
    def stats(self) -> ClassStats:
        """The totals (:class:`ClassStats`): with folds, made again from the fold sums if they moved since."""
        if self._stale:
            self.folds.totals(into=self._stats)
            self._stale = False
        return self._stats

    @stats.setter
    def stats(self, stats: ClassStats) -> None:
        self._stats, self._stale = stats, False

    @property
    def tokens(self) -> int:
        """The train tokens counted so far (from the fold sums with folds: the totals are not made for it)."""
        return int((self._stats if self.folds is None else self.folds).count.sum())

    @property
    def totals(self) -> str:
        """How the totals were made (the group's attribute ``totals``): ``folds`` (the fold sums merged in fold
        order) or ``batches`` (Chan's update batch by batch, without folds)."""
        return "batches" if self.folds is None else "folds"

    def grouping(self, y: torch.Tensor, fold: torch.Tensor | None) -> Groups:
        """A train batch's tokens grouped once for every layer that reads it: by class (labels ``y``, n), with folds
        by (fold, class) (each token's ``fold``, n; :meth:`FoldStats.grouping`)."""
        if self.folds is None:
            return Groups(y.to(self._stats.mean.device, torch.int64))
        return self.folds.grouping(y, fold)

    def tasks(self, h: torch.Tensor, y: torch.Tensor, groups: Groups | None,
              fold: torch.Tensor | None) -> list[Callable[[], None]]:
        """A train batch's update of the statistics, features ``h`` (n x d) with labels ``y`` (n, grouped as
        ``groups``, from :meth:`grouping`, or None): into the totals without folds, else into the fold sums alone, each
        token into its ``fold`` (n), one call per fold on the CPU (:meth:`FoldStats.tasks`), one for them all
        elsewhere (:meth:`FoldStats.update_at_once`: the same arithmetic); calls on disjoint arrays, to run once each,
        in any order or at once (``workers.Workers``)."""
        if self.folds is None:
            return [functools.partial(self._stats.update, h, y, groups)]
        self._stale = True
        if self.folds.mean.device.type != "cpu":  # one call for every fold: a GPU's launches, not its arithmetic
            return [functools.partial(self.folds.update_at_once, h, y, fold, groups)]
        return self.folds.tasks(h, y, fold, groups)

    def update(self, h: torch.Tensor, y: torch.Tensor, groups: Groups | None, fold: torch.Tensor | None) -> None:
        """Fold in a train batch (as :meth:`tasks`, run in order)."""
        for task in self.tasks(h, y, groups, fold):
            task()

    def state_dict(self) -> dict[str, dict]:
        """The nested state: each accumulator's ``state_dict`` under its name."""
        folds = {} if self.folds is None else {"folds": self.folds.state_dict(), "fold_val": self.fold_val}
        return {"stats": self.stats.state_dict(), "reservoir": self.reservoir.state_dict(), "val": self.val,
                "lm": self.lm} | folds

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a nested state."""
        self._stats.load_state_dict(state["stats"])
        self.reservoir.load_state_dict(state["reservoir"])
        if self.folds is not None:
            self.folds.load_state_dict(state["folds"])
        # with folds, the totals are made again from the saved folds when next read: the same bits as saved (made
        # from them when saved), and made so too in a state an earlier version saved with totals of its own
        self._stale = self.folds is not None
        for name, counts in (("val", self.val), ("lm", self.lm), ("fold_val", self.fold_val or {})):
            for k, v in counts.items():
                v.copy_(torch.as_tensor(state[name][k]))

    def dataset(self, classifier: np.ndarray | None, bias: np.ndarray | None, tokens: list[str] | None,
                attrs: dict, **embeddings) -> xr.Dataset:
        """The layer's dataset (the store's schema), holding ``classifier`` and ``bias`` as given (no copy: every
        layer's dataset shares them; None: classes with no classifier, and no NC4 counts); ``embeddings``:
        stats_dataset's embedding arguments. Reservoir slots in key order: the same however the stream was read (one
        pass or shards)."""
        s, r = self.stats, self.reservoir.canonical()
        ds = stats_dataset(s.count, s.mean, s.variance, s.within_covariance, classifier=classifier,
                           classifier_bias=bias, val=None if classifier is None else self.val,
                           samples=r.samples, n_samples=r.n_samples, sample_position=r.position, tokens=tokens,
                           attrs=attrs, unit_sum=s.unit_sum, **embeddings)
        ds.attrs["folds"] = 1 if self.folds is None else len(self.folds.parts)
        ds.attrs["totals"] = self.totals
        fold_val = None if classifier is None else self.fold_val
        return ds if self.folds is None else ds.assign(fold_variables(self.folds.state_dict(), fold_val))


class Extraction:
    """The running state of one checkpoint's extraction under ``plan``: a :class:`LayerState` per layer of the
    current pass (``layers``), where the passes stand (``pass_index``, ``phase``, ``batches`` done in that phase,
    ``stream`` the sha256 of the blocks read so far in it), the model's logit transform once the validation pass has
    checked it, and the staged embeddings. ``folder``: the staging folder (finished layers, embeddings). ``labels``:
    what a position's class is (the class axis is ``labels.size(vocab)`` long; ``vocab``, the model's, bounds the
    token ids)."""

    def __init__(self, plan: Plan, vocab: int, dim: int, k: int, seed: int, device: torch.device | str,
                 folder: Path | None = None, folds: int = 1, labels: Labels = Labels()):
        self.plan, self.folder, self.device, self.labels = plan, folder, torch.device(device), labels
        self.args = (labels.size(vocab), dim, k, seed)
        self.n_folds = folds  # disjoint folds of whole blocks (block i -> fold i mod folds); 1: none
        self.vocab = vocab
        self.pass_index, self.phase, self.batches, self.stream = 0, Phase.TRAIN, 0, ""
        self.transform: LogitTransform | None = None
        self.split_count: np.ndarray | None = None  # the train split's label counts (split_counts.label_counts)
        self.layers = self._fresh()
        self.embeddings: Embeddings | None = None

    def _fresh(self) -> dict[Site, LayerState]:
        return {l: LayerState(*self.args, self.device, self.n_folds) for l in self.plan.passes[self.pass_index]}

    def first(self) -> LayerState:
        """A layer of the current pass: every layer sees the same tokens, so its counts are every layer's."""
        return next(iter(self.layers.values()))

    def main(self) -> LayerState:
        """The last layer's state (the checkpoint group's), once its pass has run."""
        return self.layers[self.plan.last]

    def next_phase(self, phase: Phase) -> None:
        self.phase, self.batches, self.stream = phase, 0, ""

    def next_pass(self) -> None:
        """Put the current pass's layers in the staging folder and start the next pass's."""
        self._stage()
        self.layers = {}  # freed before the next pass's are made: auto sized one pass's state, not two
        self.pass_index += 1
        self.next_phase(Phase.TRAIN)
        self.layers = self._fresh()

    def _stage(self) -> None:
        for l, s in self.layers.items():
            save_state(self.folder / f"layer-{l.key}.npz", flatten(s.state_dict()))

    def _nested(self) -> dict[str, Any]:
        return {f"layer{l.key}": s.state_dict() for l, s in self.layers.items()}

    def state(self, record: dict) -> dict[str, np.ndarray]:
        """Everything needed to resume, as flat arrays (with the configuration ``record``)."""
        emb = {}
        if self.embeddings is not None:
            self.embeddings.flush()
            emb = {"embeddings": self.embeddings.state_dict()}
        if self.plan.auto:  # the groups auto fitted to this machine's memory
            emb["passes"] = json.dumps([[s.recorded for s in p] for p in self.plan.passes])
        return flatten(self._nested() | emb | {"pass": self.pass_index, "phase": int(self.phase), "batches": self.batches,
                                         "stream": self.stream, "config": json.dumps(record, sort_keys=True)})

    def start(self) -> None:
        """A fresh start: leftovers of an abandoned run removed, the embeddings staged anew."""
        self.cleanup()
        self._open_embeddings(resume=False)

    def reset(self) -> None:
        """Back to a fresh start (a discarded state)."""
        self.__init__(self.plan, self.vocab, *self.args[1:], self.device, self.folder, self.n_folds, self.labels)
        self.start()

    def load(self, arrays: Mapping[str, np.ndarray], tokens_per_batch: int, where: str, dense: bool = True) -> None:
        """Continue from a saved state (its digest checked by ``load_state``), after checking that it is one this
        extraction could have written: the same arrays with the same shapes and dtypes, a known pass and phase, the
        earlier passes' finished layers there, whole and fitting, and counts that add up to the batches done (a
        state that fails is refused, never continued into wrong numbers); then reopen the staged embeddings, their
        shapes and digests checked. ``dense``: every batch counts at least one token (not so where a label file
        leaves positions out, or the validation pass counts none)."""
        self._saved_groups(arrays)
        self._saved_folds(arrays)
        at = int(arrays["pass"]) if "pass" in arrays and arrays["pass"].shape == () else 0
        if not 0 <= at < len(self.plan.passes):
            raise CheckpointError(f"the resume state {where} is in pass {at} of {len(self.plan.passes)}; {RESTART}")
        self.pass_index = at
        self.layers = self._fresh()
        fresh = self.state({})
        bad = _misfits(arrays, fresh)
        if bad:
            raise CheckpointError(f"the resume state {where} does not fit this checkpoint ({', '.join(bad[:3])}); "
                                  f"{RESTART}")
        self._check_finished(at)
        phase, batches = int(arrays["phase"]), int(arrays["batches"])
        for prefix in {k[:-len("stats.count")] for k in fresh if k.endswith("stats.count")}:
            done = arrays[prefix + ("val.val_count" if phase == Phase.VALIDATION else "stats.count")].sum()
            if phase == Phase.TRAIN or phase == Phase.VALIDATION:
                low, high = max(0, batches - 1) * tokens_per_batch, batches * tokens_per_batch
                consistent = batches >= 0 and (done == 0 if batches == 0 else low < done <= high if dense else
                                               0 <= done <= high)
            else:
                consistent = phase == Phase.DONE
            if prefix + "folds.count" in arrays:  # the fold sums add up to the totals
                consistent = consistent and np.array_equal(arrays[prefix + "folds.count"].sum(0),
                                                           arrays[prefix + "stats.count"])
            consistent = (consistent and bool(np.isfinite(arrays[prefix + "stats.mean"]).all())
                          and (arrays[prefix + "stats.m2"] >= 0).all() and (arrays[prefix + "stats.count"] >= 0).all())
            if not consistent:
                raise CheckpointError(f"the resume state {where} is inconsistent (phase {phase}, {batches} batches, "
                                      f"{done} tokens counted); {RESTART}")
        self.restore(arrays)
        self._open_embeddings(resume=True, saved=unflatten(arrays).get("embeddings"))

    def _saved_folds(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The folds a saved state was made with (fitted to the memory then, or by the shards that saved it): kept,
        so that a resume ends as the uninterrupted run would have."""
        counts = [v for k, v in arrays.items() if k.endswith(".folds.count") and np.ndim(v) == 2]
        folds = len(counts[0]) if counts else 1
        if folds != self.n_folds:
            log.info("resuming with the %d fold(s) of the saved state", folds)
            self.n_folds = folds

    def _saved_groups(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Under ``--layers-per-pass auto``, the passes a saved state was made with (the memory may differ now)."""
        if not self.plan.auto or "passes" not in arrays or arrays["passes"].shape != ():
            return
        try:
            groups = tuple(tuple(Site.of(l) for l in g) for g in json.loads(str(arrays["passes"])))
        except (ValueError, TypeError, AttributeError):
            return
        if tuple(l for g in groups for l in g) == self.plan.layers and all(groups):
            self.plan = replace(self.plan, groups=groups)

    def _finished_layer(self, l: Site) -> dict[str, np.ndarray]:
        """Layer ``l``'s state from an earlier pass, as saved in the staging folder: its digest checked, and every
        array there with the shape and kind a fresh layer has (else the one line naming ``--restart``)."""
        path = self.folder / f"layer-{l.key}.npz"
        if not path.is_file():
            raise CheckpointError(f"the finished site {l} of an interrupted extraction is missing ({path}); {RESTART}")
        arrays = load_state(path, needs=())
        bad = _misfits(arrays, flatten(LayerState(*self.args, "cpu", self.n_folds).state_dict()))
        if bad:
            raise CheckpointError(f"the resume state {path} does not fit this checkpoint ({', '.join(bad[:3])}); "
                                  f"{RESTART}")
        return arrays

    def _check_finished(self, at: int) -> None:
        """Before resuming in pass ``at``: the earlier passes' layers are all there and fit (:meth:`_finished_layer`)."""
        for p in self.plan.passes[:at]:
            for l in p:
                self._finished_layer(l)

    def restore(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Take a saved state's arrays as they are (:meth:`load` checks them first); ``arrays`` maps names to arrays
        and lists them in ``files`` (an npz file) or by iteration (a dict)."""
        nested = unflatten(arrays)
        self.pass_index = int(nested["pass"])
        self.phase, self.batches = Phase(int(nested["phase"])), int(nested["batches"])
        self.stream = str(nested["stream"])
        self.layers = self._fresh()
        for l, s in self.layers.items():
            s.load_state_dict(nested[f"layer{l.key}"])

    def _open_embeddings(self, resume: bool, saved: dict | None = None) -> None:
        if self.plan.save_embeddings:
            self.embeddings = Embeddings(self.folder, self.plan.layers, self.plan.save_embeddings, self.args[1],
                                         self.plan.embeddings_dtype, resume, saved)

    def finished(self) -> Iterator[tuple[Site, LayerState]]:
        """Every layer's finished state, one at a time: the earlier passes' from the staging folder (on the CPU),
        then the last pass's."""
        for p in self.plan.passes[:-1]:
            for l in p:
                s = LayerState(*self.args, "cpu", self.n_folds)
                s.load_state_dict(unflatten(self._finished_layer(l)))
                yield l, s
        yield from self.layers.items()

    def datasets(self, classifier: torch.Tensor, bias: torch.Tensor | None, tokens: list[str] | None, attrs: dict,
                 lens: str | None) -> tuple[xr.Dataset, Iterator[tuple[str, xr.Dataset]]]:
        """The checkpoint group's dataset (the last layer), and the other sites' ``(group, dataset)`` (Site.group:
        ``layers/<l>``, ``sites/attn_1``), made one at a time as they are written (none for the default plan).
        Under a layered plan each records ``layer`` (a sublayer site: ``site`` and ``block`` instead) and
        ``lens``: how NC4's linear decisions were made, "head(h)" at the last layer, "head(ln_f(h))" (``lens``, the
        final norm's path on the base model) at the others. The head is made float32 numpy once, and every layer's
        dataset shares that one array (io.write_checkpoint stores it once, in the checkpoint group). Classes that are
        not the vocabulary (a label file) have no head, no NC4 counts and no token names; a setting other than
        ``next`` is recorded as ``labels``, and a file's classes as ``class_axis`` (Labels.attributes)."""
        written = int(self.main().stats.count.sum())
        if not self.labels.vocabulary:
            classifier, bias, tokens = None, None, None
        classifier, bias = (None if x is None else x.detach().to("cpu", torch.float32).numpy()
                            for x in (classifier, bias))
        labels = self.labels.attributes()

        def make(l: Site, s: LayerState) -> xr.Dataset:
            emb = {} if self.embeddings is None else self.embeddings.variables(l, written)
            at = {"layer": l.index} if l.residual else {"site": str(l), "block": l.index}
            where = {**at, "lens": "head(h)" if l == self.plan.last else f"head({lens}(h))", **labels}
            ds = s.dataset(classifier, bias, tokens, {**attrs, **where}, **emb)
            return ds if self.split_count is None else ds.assign(split_count=("vocab", self.split_count))

        others = ((l.group, make(l, s)) for l, s in self.finished() if l != self.plan.last)
        return make(self.plan.last, self.main()), others

    def cleanup(self) -> None:
        """Remove the staging folder."""
        if self.folder is not None and self.folder.exists():
            shutil.rmtree(self.folder)


def _misfits(arrays: Mapping[str, np.ndarray], fresh: Mapping[str, np.ndarray]) -> list[str]:
    """The names where a saved state differs from a fresh one in shape or kind, or lacks it (a reservoir's pool is
    as long as the samples it holds: its width alone is fixed)."""
    def shape(k: str, v: np.ndarray) -> tuple:
        return v.shape[1:] if k.endswith("reservoir.pool") else v.shape

    bad = [k for k, v in fresh.items() if k != "stream" and k in arrays
           and (shape(k, arrays[k]) != shape(k, v) or arrays[k].dtype.kind != v.dtype.kind)]
    return bad + [f"{k} (missing)" for k in fresh if k not in arrays]
