"""The passes over one checkpoint's data, for any plan of layers (the default's, the last layer alone, included),
filling its running state (running.py).

For each pass of the plan (``--layers-per-pass``; one for the default): the train pass, whose features are each
layer's hidden state (the last layer's is the last hidden state after the final norm, the output layer's input) at the
positions ``--labels`` keeps, labelled as it says (labels.py; by default every position but the last of each block,
labelled with the next token), into exact float64 class statistics merged batch by batch (Chan, in
``ncanalyze.analyzer.accumulate``) and a reservoir of raw features; then the validation pass, NC4's decision counts
over the classes kept at extraction (none for classes that are not the vocabulary) and, at the last layer, the model's
own next-token loss. Both skip the batches a resumed state already holds.
"""
from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch
from ncanalyze.analyzer.accumulate import DecisionCounts, float64_head, fold_of
from ncanalyze.analyzer.screen import Leaders
from ncanalyze.core import threads
from ncanalyze.core.errors import CheckpointError, UserError
from ncanalyze.store.bars import progress_bar
from ncanalyze.store.data.blocks import Blocks
from ncanalyze.store.extraction import progress
from ncanalyze.store.extraction.loss import NextTokenLoss, matches_model
from ncanalyze.store.extraction.resume import Phase, Saver
from ncanalyze.store.extraction.running import Extraction
from ncanalyze.store.extraction.workers import Workers
from ncanalyze.store.sources.anatomy import FINAL_NORMS, LogitTransform, features, final_norm, hidden_forward

log = logging.getLogger(__name__)


def check_ids(batch: np.ndarray, vocab: int, spec: str) -> None:
    """A UserError naming the data if a token id of ``batch`` is outside the model's vocabulary ``0..vocab - 1``.

    Parameters
    ----------
    batch : token ids.
    vocab : the model's vocabulary size.
    spec : the data, as the user named it.
    """
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
                   forward=None, end: int | None = -1
                   ) -> Iterator[tuple[torch.Tensor, np.ndarray, np.ndarray | None]]:
    """(features k x n x d, the batch of blocks, the label file's classes aligned with it or None) for every batch
    not yet done; after each is consumed it counts as done and the state may be saved. ``forward(ids)`` (default:
    :func:`hidden_forward` of the pass's layers at the positions ``[:, :end]``) gives the features (its leading
    dimensions before (b, L-1, d) are kept).

    Parameters
    ----------
    model, blocks, ex, batch_size, saver, desc : as :func:`train_pass`.
    forward : ids -> features, as :func:`hidden_forward` gives.
    end : the positions of each block read (:func:`~ncanalyze.store.sources.anatomy.features`).

    Returns
    -------
    iterator of (Tensor, ndarray, ndarray or None) : features (k x n x d), the batch of blocks and its classes.
    """
    vocab, device = ex.vocab, ex.device
    forward = forward or hidden_forward(model, tuple(ex.layers), ex.plan.last, end)
    total = blocks.total and -(-blocks.total // batch_size)
    digest, seen = hashlib.sha256(), 0
    with progress_bar(total=total, initial=ex.batches, desc=desc, unit="batch", leave=False) as bar:
        for batch, marks in blocks.labelled(batch_size):
            digest.update(batch.tobytes())
            seen += 1
            if seen <= ex.batches:  # done before a resume: read again only to check that the data is the same
                if seen == ex.batches and ex.stream and digest.hexdigest() != ex.stream:
                    _data_changed(blocks, desc)
                continue
            check_ids(batch, vocab, blocks.spec)
            ids = torch.from_numpy(batch).to(device)
            h = forward(ids)
            _check_finite(h, f"{desc}, batch {ex.batches}")
            yield h.reshape(*h.shape[:-3], -1, h.shape[-1]), batch, marks
            ex.batches, ex.stream = ex.batches + 1, digest.hexdigest()
            bar.update()
            progress.batch(ex, bar)  # the run's time left, at its measured rate
            threads.tick()  # --threads auto: the load measured again every few seconds
            saver.maybe()
    if seen < ex.batches:
        _data_changed(blocks, desc)


def _data_changed(blocks: Blocks, desc: str) -> None:
    raise UserError(f"{blocks.spec} is not the data the interrupted extraction of {desc} read (its first blocks "
                    "differ or it is shorter now); restore it, or pass --restart to extract this checkpoint from the "
                    "start")


def train_pass(model, blocks: Blocks, ex: Extraction, batch_size: int, saver: Saver, desc: str) -> None:
    """Class statistics (with folds, the fold sums, from which the totals are made), the reservoir and the staged
    embeddings of every layer of the pass; a sample's position is its token's index in the train stream. Each batch's
    updates (:func:`batch_tasks`) run at once on the cores the thread policy gives (``workers.Workers``).

    Parameters
    ----------
    model : the causal LM.
    blocks : the train blocks.
    ex : the running state (its current pass's layers are filled).
    batch_size : blocks per batch.
    saver : saves the state at batch boundaries.
    desc : the checkpoint, for the progress bar and errors.
    """
    L, labels = blocks.block_size, ex.labels
    with Workers(ex.device) as run:
        for h, batch, marks in batch_features(model, blocks, ex, batch_size, saver, f"{desc} train", end=labels.end):
            first = ex.batches * batch_size
            rows = labels.rows(batch, marks, first)  # the kept positions, their labels and stream positions
            h, y, pos = rows.take(h), torch.from_numpy(rows.y).to(ex.device), rows.pos
            row = first * labels.width(L) if rows.keep is None else ex.first().tokens  # rows so far
            fold = (rows.fold(fold_of(first, len(batch), labels.width(L), ex.n_folds, ex.device))
                    if ex.n_folds > 1 else None)
            run(batch_tasks(ex, h, y, fold, rows.y, pos))
            if ex.embeddings is not None:
                ex.embeddings.write(row, dict(zip(ex.layers, h)), y, pos)
    if ex.first().stats.count.sum() == 0:
        raise UserError(f"{blocks.spec} holds no full block of {L} tokens: the dataset is empty or shorter than "
                        "--block-size")


def batch_tasks(ex: Extraction, h: torch.Tensor, y: torch.Tensor, fold: torch.Tensor | None, labels: np.ndarray,
                pos: np.ndarray) -> list[Callable[[], None]]:
    """A train batch's updates of every layer of the pass, as calls on disjoint arrays (``workers.Workers`` runs
    them): each layer's reservoir first (the longest call, started first so that it ends with the rest), then the
    statistics (with folds, one call per fold, into the fold sums alone: the totals are made from them), the batch
    grouped once for every layer.

    Parameters
    ----------
    ex : the running state.
    h : the kept rows' features of every layer of the pass (k x n x d).
    y : their labels (n) on the state's device; ``labels`` the same on the host.
    fold : each row's fold (n), or None without folds.
    pos : their stream positions (n).

    Returns
    -------
    list of callables : the updates, each to run once.
    """
    groups = ex.first().grouping(y, fold)
    reservoirs = [functools.partial(s.reservoir.update, h[i], labels, pos) for i, s in enumerate(ex.layers.values())]
    return reservoirs + [t for i, s in enumerate(ex.layers.values()) for t in s.tasks(h[i], y, groups, fold)]


def model_loss(model, blocks: Blocks, head: tuple[torch.Tensor, torch.Tensor | None], dtype: torch.dtype,
               state: dict[str, torch.Tensor], desc: str) -> tuple[LogitTransform | None, NextTokenLoss | None]:
    """The model's own full-vocabulary loss, accumulated into ``state`` (a layer's ``lm``) as the validation pass
    feeds it the last layer's features: its logit transform, checked against the model's own logits on a prefix of
    the first block, and the running loss. (None, None) where they differ: no val_loss rather than a wrong one.

    Parameters
    ----------
    model : the causal LM.
    blocks : the validation blocks.
    head : the output layer's float64 weight and bias (or None), as :func:`val_state` shares it.
    dtype : the model's head's own dtype (how close its logits must be to ours).
    state : the loss sums to continue (updated in place).
    desc : the checkpoint, for the warning.

    Returns
    -------
    (transform, loss) : the logit transform and the loss accumulator, or (None, None).
    """
    transform = LogitTransform.of(model.config)
    first = next(blocks.batches(1), None)
    if first is not None:
        ids = torch.from_numpy(first[:1, :64]).to(head[0].device)  # a prefix is enough (causal)
        if not matches_model(model, ids, features(model, ids)[0], *head, transform, dtype):
            log.warning("warning: %s: the model's own logits are not its head's under %s; val_loss and val_accuracy "
                        "are left out (model type %s)", desc, transform.describe(), model.config.model_type)
            return None, None
    return transform, NextTokenLoss(*head, transform, state=state)


def val_state(ex: Extraction, classifier: torch.Tensor, bias: torch.Tensor | None, min_count: int,
              lens: Callable[[torch.Tensor], torch.Tensor] | None
              ) -> tuple[list[DecisionCounts], tuple[torch.Tensor, torch.Tensor | None]]:
    """What a validation pass holds beside the layers' statistics: one float64 head on the state's device, shared by
    the loss and every layer's NC4 decisions, which read the layers' means in place (no per-layer copy).

    Parameters
    ----------
    ex : the running state (its current pass's layers; the classes kept are those of ``min_count`` train tokens).
    classifier, bias : the output layer's weight and bias (or None).
    min_count : the train tokens a class needs to be kept.
    lens : the model's final norm, for the layers below the last (None: no layer below the last in the pass).

    Returns
    -------
    (counts, head) : each layer's :class:`DecisionCounts` (in the pass's order), and the float64 (weight, bias).
    """
    head = float64_head(classifier, bias, ex.device)
    if not ex.labels.vocabulary:  # no classifier for these classes: no NC4 decisions
        return [], head
    kept = torch.nonzero(ex.first().stats.count >= min_count).squeeze(1)
    train_count = ex.first().stats.count  # the kept sets of NC4_MIN_COUNTS too (schema.VAL_AT), in the same pass
    shared: dict = {}  # the layers' float32 screen of the linear decisions, made once (the same head and kept sets)
    counts = [DecisionCounts(classifier, bias, s.stats.mean, kept, counts=s.val, head=head, folds=s.fold_val,
                             lens=None if l == ex.plan.last else lens, train_count=train_count, fold_stats=s.folds,
                             min_count=min_count, shared=shared)
              for l, s in ex.layers.items()]
    return counts, head


def val_pass(model, blocks: Blocks, ex: Extraction, classifier: torch.Tensor, bias: torch.Tensor | None,
             min_count: int, batch_size: int, saver: Saver, desc: str) -> LogitTransform | None:
    """NC4's decision counts of every layer of the pass over the classes kept at extraction (count >= ``min_count``,
    the same at every layer) and over the kept set of each ``schema.NC4_MIN_COUNTS`` (``val_*_at``), the linear decision through the logit lens (the model's final norm) below the last
    layer; at the last layer, the model's own full-vocabulary loss and accuracy (:func:`model_loss`), whatever the
    labels (a label file's classes have no classifier: the loss alone).

    Parameters
    ----------
    model, blocks, ex, batch_size, saver, desc : as :func:`train_pass` (``blocks`` the validation blocks).
    classifier, bias : the output layer's weight and bias (or None).
    min_count : the train tokens a class needs to be kept.

    Returns
    -------
    LogitTransform or None : the transform the loss was measured with; None without the last layer in this pass,
    or where the transform does not reproduce the model's logits (then no loss).
    """
    norm, labels = final_norm(model), ex.labels
    if norm is None and labels.vocabulary and any(l != ex.plan.last for l in ex.layers):
        raise UserError(f"NC4 at layers other than the last needs the model's final norm, and none of "
                        f"{', '.join(FINAL_NORMS)} is on this model; pass --max-val-tokens 0 or --layers last")
    counts, head = val_state(ex, classifier, bias, min_count, norm[1] if norm else None)
    transform, loss, last = None, None, list(ex.layers).index(ex.plan.last) if ex.plan.last in ex.layers else None
    if last is not None:
        transform, loss = model_loss(model, blocks, head, classifier.dtype, ex.main().lm, desc)

    def count_decisions(hc: torch.Tensor, yc: torch.Tensor, logits: torch.Tensor, leaders: Leaders) -> None:
        # the last layer's decisions read the logits the loss forms (and their best per row): formed once
        counts[last].count_logits(hc, yc, logits, leaders)
    end = labels.val_end
    for h, batch, _ in batch_features(model, blocks, ex, batch_size, saver, f"{desc} validation", end=end):
        width = blocks.block_size - (end == -1)
        fold = fold_of(ex.batches * batch_size, len(batch), width, ex.n_folds, ex.device) if ex.n_folds > 1 else None
        nxt = torch.from_numpy(batch[:, 1:].ravel()).to(ex.device)  # the model's own loss: the next tokens
        y = nxt if labels.end == -1 or not counts else torch.from_numpy(labels.rows(batch, None, 0).y).to(ex.device)
        shared = loss is not None and labels.end == -1  # NC4 at the last layer reads the loss's logits (same rows)
        for c in counts:
            c.begin(fold)
        for i, (c, hl) in enumerate(zip(counts, h)):
            if not (shared and i == last):
                c.update(hl, y)
        if loss:
            loss.update(labels.next_token_features(h[last], len(batch), end), nxt,
                        count_decisions if shared and counts else None)
    return transform


def run_passes(model, train: Blocks, val: Blocks | None, ex: Extraction, classifier: torch.Tensor,
               bias: torch.Tensor | None, min_count: int, batch_size: int, saver: Saver, desc: str) -> None:
    """Every pass of ``ex.plan`` not yet done: its train pass, then its validation pass (none without ``val``); a
    finished pass's layers go to the staging folder. ``ex.transform`` ends as the logit transform the loss was
    measured with (the model's declared one where no validation pass ran).

    Parameters
    ----------
    model : the causal LM.
    train, val : the train and validation blocks (``val`` None: no validation pass).
    ex : the running state, fresh or resumed.
    classifier, bias : the output layer's weight and bias (or None).
    min_count : the train tokens a class needs to be kept for NC4.
    batch_size : blocks per batch.
    saver : saves the state at batch boundaries (every --state-every seconds), and between passes.
    desc : the checkpoint, for progress bars and errors.
    """
    ex.transform = LogitTransform.of(model.config)
    while True:
        layers = tuple(ex.layers)
        tag = f"{desc} layers {','.join(str(s.recorded) for s in layers)}" if len(ex.plan.passes) > 1 else desc
        if ex.phase == Phase.TRAIN:
            train_pass(model, train, ex, batch_size, saver, tag)
            count = ex.first().stats.count
            if not (count >= min_count).any():
                raise UserError(f"no class has --min-count {min_count} train tokens in {desc} (the most is "
                                f"{int(count.max())}): " + ("lower --min-count" if min_count > 1 and count.max() else
                                                             "no train token was read: check --dataset and "
                                                             "--max-train-tokens"))
            ex.next_phase(Phase.VALIDATION)
            saver.maybe()  # as at any batch boundary (every --state-every seconds): a forced save here cost a short
            # pass as much as its work (the state's bytes, 2.6x with folds), and a kill loses no more than that
        if ex.phase == Phase.VALIDATION:
            if val is not None and (ex.labels.vocabulary or ex.plan.last in layers):  # file labels: the loss alone
                transform = val_pass(model, val, ex, classifier, bias, min_count, batch_size, saver, tag)
                if ex.plan.last in layers:
                    ex.transform = transform
            ex.next_phase(Phase.DONE)
        if ex.pass_index == len(ex.plan.passes) - 1:
            return
        ex.next_pass()
        saver.maybe(force=True)
