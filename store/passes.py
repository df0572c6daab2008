"""The two passes over one checkpoint's data, and the running state they fill.

Train pass: features are the last hidden state after the final norm (the output layer's input) at every position
but the last of each block, labels the next tokens; exact float64 class statistics merged batch by batch (Chan, in
``ncanalyze.analyzer.accumulate``) and a reservoir of raw features. Validation pass: NC4's decision counts over the
classes kept at extraction. Both skip the batches a resumed state already holds.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from ncanalyze.analyzer.accumulate import ClassStats, DecisionCounts
from ncanalyze.analyzer.errors import CheckpointError, UserError
from ncanalyze.analyzer.schema import VAL_COUNTS, stats_dataset
from ncanalyze.store.data import Blocks
from ncanalyze.store.loss import LogitTransform, NextTokenLoss, matches_model
from ncanalyze.store.reservoir import Reservoir
from ncanalyze.store.resume import Phase, Saver

log = logging.getLogger("ncanalyze")


class Extraction:
    """The running state of one checkpoint's extraction: statistics, reservoir, validation counts, and where it
    stands (``phase``, ``batches`` done in that phase)."""

    def __init__(self, vocab: int, dim: int, k: int, seed: int, device: torch.device):
        self.stats = ClassStats(vocab, dim, device)
        self.reservoir = Reservoir(vocab, k, dim, seed)
        self.val = {n: torch.zeros(vocab, dtype=torch.int64, device=device) for n in VAL_COUNTS}
        self.lm = NextTokenLoss.zeros(device)  # the validation pass's running loss sums (val_loss, val_accuracy)
        self.phase, self.batches = Phase.TRAIN, 0
        self.stream = ""  # sha256 of the token blocks read so far in this phase (checked on resume)

    def next_phase(self, phase: Phase) -> None:
        self.phase, self.batches, self.stream = phase, 0, ""

    def state(self, record: dict) -> dict[str, np.ndarray]:
        """Everything needed to resume, as arrays (with the configuration ``record``)."""
        arrays = {f"stats.{k}": v.cpu().numpy() for k, v in self.stats.state_dict().items()}
        arrays |= {f"reservoir.{k}": v for k, v in self.reservoir.state_dict().items()}
        arrays |= {f"val.{k}": v.cpu().numpy() for k, v in self.val.items()}
        arrays |= {f"lm.{k}": v.cpu().numpy() for k, v in self.lm.items()}
        return arrays | {"phase": np.array(int(self.phase)), "batches": np.array(self.batches),
                         "stream": np.array(self.stream), "config": np.array(json.dumps(record, sort_keys=True))}

    def load(self, arrays: dict[str, np.ndarray], tokens_per_batch: int, where: str) -> None:
        """Continue from a saved state, after checking that it is one this extraction could have written: the same
        arrays with the same shapes and dtypes, a known phase, and counts that add up to the batches done (a state
        that fails is refused, never continued into wrong numbers)."""
        fresh = self.state({})
        bad = [k for k, v in fresh.items() if k != "stream" and k in arrays
               and (arrays[k].shape != v.shape or arrays[k].dtype.kind != v.dtype.kind)]
        optional = ("stream", "lm.")  # written since: a state from before lacks them
        bad += [f"{k} (missing)" for k in fresh if k not in arrays and not k.startswith(optional)]
        fix = "pass --restart to discard it and extract this checkpoint from the start"
        if bad:
            raise CheckpointError(f"the resume state {where} does not fit this checkpoint ({', '.join(bad[:3])}); {fix}")
        phase, batches = int(arrays["phase"]), int(arrays["batches"])
        done = arrays["val.val_count" if phase == Phase.VALIDATION else "stats.count"].sum()
        if phase == Phase.TRAIN or phase == Phase.VALIDATION:
            low, high = max(0, batches - 1) * tokens_per_batch, batches * tokens_per_batch
            consistent = batches >= 0 and (done == 0 if batches == 0 else low < done <= high)
        else:
            consistent = phase == Phase.DONE
        consistent = consistent and bool(np.isfinite(arrays["stats.mean"]).all()) and (arrays["stats.m2"] >= 0).all()
        if not consistent or (arrays["stats.count"] < 0).any():
            raise CheckpointError(f"the resume state {where} is inconsistent (phase {phase}, {batches} batches, {done} "
                            f"tokens counted); {fix}")
        self.restore(arrays)

    def restore(self, arrays) -> None:
        """Take a saved state's arrays as they are (:meth:`load` checks them first); ``arrays`` maps names to arrays
        and lists them in ``files`` (an npz file) or by iteration (a dict)."""
        keys = set(getattr(arrays, "files", arrays))
        self.stats.load_state_dict({k: arrays[f"stats.{k}"] for k in self.stats.state_dict()})
        self.reservoir.load_state_dict({k: arrays[f"reservoir.{k}"] for k in self.reservoir.state_dict()})
        for k in self.val:
            self.val[k].copy_(torch.as_tensor(arrays[f"val.{k}"]))
        self.phase, self.batches = Phase(int(arrays["phase"])), int(arrays["batches"])
        self.stream = str(arrays["stream"]) if "stream" in keys else ""
        if all(f"lm.{k}" in keys for k in self.lm):
            for k in self.lm:
                self.lm[k].copy_(torch.as_tensor(arrays[f"lm.{k}"]))
        elif self.phase == Phase.VALIDATION:  # a state from before val_loss: its validation pass starts again
            for v in self.val.values():
                v.zero_()
            self.batches, self.stream = 0, ""

    def reset(self) -> None:
        """Back to a fresh start (a discarded state)."""
        self.__init__(self.stats.count.shape[0], self.stats.mean.shape[1], self.reservoir.k, self.reservoir.seed,
                      self.stats.mean.device)

    def dataset(self, classifier: torch.Tensor, bias: torch.Tensor | None, tokens: list[str] | None,
                attrs: dict, **embeddings) -> xr.Dataset:
        """The finished checkpoint's dataset (the store's schema); ``embeddings``: stats_dataset's embedding
        arguments. Reservoir slots in key order: the same however the stream was read (one pass or shards)."""
        s, r = self.stats, self.reservoir.canonical()
        return stats_dataset(s.count, s.mean, s.variance, s.within_covariance, classifier=classifier.float(),
                             classifier_bias=None if bias is None else bias.float(), val=self.val,
                             samples=r.samples, n_samples=r.n_samples, sample_position=r.position, tokens=tokens,
                             attrs=attrs, unit_sum=s.unit_sum, **embeddings)


@torch.inference_mode()
def features(model, ids: torch.Tensor) -> torch.Tensor:
    """Last hidden state after the final norm, at every position but the last: (b, L-1, d)."""
    return model.base_model(input_ids=ids).last_hidden_state[:, :-1]


def check_ids(batch: np.ndarray, vocab: int, spec: str) -> None:
    lo, hi = int(batch.min()), int(batch.max())
    if lo < 0 or hi >= vocab:
        raise UserError(f"token id {hi if hi >= vocab else lo} in {spec} is outside the model's vocabulary "
                        f"(0..{vocab - 1}): the data was tokenized with another tokenizer? pass the right "
                        "--tokenizer or token files")


def _check_finite(h: torch.Tensor, where: str) -> None:
    if not torch.isfinite(h).all():
        raise CheckpointError(f"NaN/Inf features in {where}: the checkpoint has diverged or the dtype overflows; "
                        "try --dtype float32, or exclude this checkpoint")


def batch_features(model, blocks: Blocks, ex: Extraction, batch_size: int, saver: Saver, desc: str,
                   forward=None) -> Iterator[tuple[torch.Tensor, torch.Tensor, np.ndarray]]:
    """(features n x d, labels n, the batch of blocks) for every batch not yet done; after each is consumed it
    counts as done and the state may be saved. ``forward(ids)`` replaces :func:`features` (its leading dimensions
    before (b, L-1, d) are kept: k x n x d for stacked layers)."""
    vocab, device = ex.stats.count.shape[0], ex.stats.mean.device
    total = blocks.total and -(-blocks.total // batch_size)
    digest, seen = hashlib.sha256(), 0
    with tqdm(total=total, initial=ex.batches, desc=desc, unit="batch", leave=False) as bar:
        for batch in blocks.batches(batch_size):
            digest.update(batch.tobytes())
            seen += 1
            if seen <= ex.batches:  # done before a resume: read again only to check that the data is the same
                if seen == ex.batches and ex.stream and digest.hexdigest() != ex.stream:
                    _data_changed(blocks, desc)
                continue
            check_ids(batch, vocab, blocks.spec)
            ids = torch.from_numpy(batch).to(device)
            h = features(model, ids) if forward is None else forward(ids)
            _check_finite(h, f"{desc}, batch {ex.batches}")
            yield h.reshape(*h.shape[:-3], -1, h.shape[-1]), ids[:, 1:].reshape(-1), batch
            ex.batches, ex.stream = ex.batches + 1, digest.hexdigest()
            bar.update()
            saver.maybe()
    if seen < ex.batches:
        _data_changed(blocks, desc)


def _data_changed(blocks: Blocks, desc: str) -> None:
    raise UserError(f"{blocks.spec} is not the data the interrupted extraction of {desc} read (its first blocks "
                    "differ or it is shorter now); restore it, or pass --restart to extract this checkpoint from the "
                    "start")


def train_pass(model, blocks: Blocks, ex: Extraction, batch_size: int, saver: Saver, desc: str) -> None:
    """Class statistics and the reservoir; a sample's position is its token's index in the train stream."""
    L = blocks.block_size
    for h, y, batch in batch_features(model, blocks, ex, batch_size, saver, f"{desc} train"):
        ex.stats.update(h, y)
        first = ex.batches * batch_size
        ex.reservoir.update(h, batch[:, 1:].ravel(), ((first + np.arange(len(batch)))[:, None] * L
                                                      + np.arange(L - 1)).ravel())
    if ex.stats.count.sum() == 0:
        raise UserError(f"{blocks.spec} holds no full block of {L} tokens: the dataset is empty or shorter than "
                        "--block-size")


def model_loss(model, blocks: Blocks, classifier: torch.Tensor, bias: torch.Tensor | None, ex: Extraction,
               desc: str) -> tuple[LogitTransform | None, NextTokenLoss | None]:
    """The model's own full-vocabulary loss, accumulated into ``ex.lm`` as the validation pass feeds it the last
    layer's features: its logit transform, checked against the model's own logits on a prefix of the first block,
    and the running loss. (None, None) where they differ: no val_loss rather than a wrong one."""
    transform = LogitTransform.of(model.config)
    first = next(blocks.batches(1), None)
    if first is not None:
        ids = torch.from_numpy(first[:1, :64]).to(classifier.device)  # a prefix is enough (causal)
        if not matches_model(model, ids, features(model, ids)[0], classifier, bias, transform):
            log.warning("warning: %s: the model's own logits are not its head's under %s; val_loss and val_accuracy "
                        "are left out (model type %s)", desc, transform.describe(), model.config.model_type)
            return None, None
    return transform, NextTokenLoss(classifier, bias, transform, state=ex.lm)


def val_pass(model, blocks: Blocks, ex: Extraction, classifier: torch.Tensor, bias: torch.Tensor | None,
             min_count: int, batch_size: int, saver: Saver, desc: str) -> LogitTransform | None:
    """NC4's decision counts over the classes kept at extraction (count >= ``min_count``), and the model's own
    full-vocabulary loss and accuracy (its logit transform applied) into ``ex.lm`` (:func:`model_loss`). Returns
    the transform, or None (and no loss) where it does not reproduce the model's logits."""
    kept = torch.nonzero(ex.stats.count >= min_count).squeeze(1)
    counts = DecisionCounts(classifier, bias, ex.stats.mean, kept, counts=ex.val)
    transform, loss = model_loss(model, blocks, classifier, bias, ex, desc)
    for h, y, _ in batch_features(model, blocks, ex, batch_size, saver, f"{desc} validation"):
        counts.update(h, y)
        if loss:
            loss.update(h, y)
    return transform
