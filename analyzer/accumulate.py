"""Exact streaming per-class statistics (float64), merged batch by batch with Chan's parallel formula, NC4's decision
counts, and the contract every running summary of the extraction keeps (:class:`Accumulator`)."""
from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ncanalyze.analyzer.chan_numba import NORM_FLOOR, chan_rows
from ncanalyze.analyzer.schema import NC4_MIN_COUNTS, NC4_WITHOUT, VAL_AT
from ncanalyze.analyzer.screen import Leaders, LinearScreen, Screen
from ncanalyze.core.setting import default

log = logging.getLogger(__name__)


@runtime_checkable
class Accumulator(Protocol):
    """A running summary of a stream, exact under any split: ``update`` folds in a batch, ``merge`` folds in the
    summary of another part of the stream (disjoint tokens), and ``state_dict`` / ``load_state_dict`` give and take
    its arrays by name (flat names; nested summaries are flattened once, by ``ncanalyze.store.extraction.resume.flatten``).

    Merging the parts of a split stream, in any order, equals one pass over it (float64 sums to rounding, counts and
    samples exactly): ``tests/analyzer/test_accumulate.py`` holds every implementation to it."""

    def update(self, *batch: Any) -> None:
        """Fold in one batch."""

    def merge(self, other: Any) -> Any:
        """Fold in ``other``'s summary of another part of the stream; returns self."""

    def state_dict(self) -> dict[str, Any]:
        """The arrays that make up the summary, by name (the live arrays, not copies)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the arrays of a :meth:`state_dict` (copied in place)."""


class Groups:
    """A batch's tokens grouped by label, once for every layer that reads the batch: ``order`` (a stable argsort of
    the labels), ``classes`` (the labels present, ascending), ``lengths`` (their tokens, int64) and ``row`` (each
    sorted token's group). Sums over a group are reductions over its contiguous sorted rows (:meth:`sum`): no
    atomics, so hot classes do not serialise and float64 sums are the same on every run; nothing of size
    n x num_classes is formed.

    Parameters
    ----------
    y : the labels (n), int64, on the device of the sums.
    """

    def __init__(self, y: torch.Tensor):
        self.order = torch.argsort(y, stable=True)
        self.classes, self.lengths = torch.unique_consecutive(y[self.order], return_counts=True)
        self.row = torch.repeat_interleave(torch.arange(len(self.classes), device=y.device), self.lengths)

    def sort(self, h: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rows of ``h`` (n x ...) in group order, as ``dtype``, on the groups' device (gathered first: only the
        grouped rows are converted and moved)."""
        return h.index_select(0, self.order.to(h.device)).to(self.order.device, dtype or h.dtype)

    def sum(self, x: torch.Tensor, segmented: bool | None = None) -> torch.Tensor:
        """Each group's sum of the rows of ``x`` (sorted by :meth:`sort`), in row order.

        Parameters
        ----------
        x : sorted rows (n x ...).
        segmented : ``torch.segment_reduce`` (a sequential loop per segment and column, or CUB's segmented
            reduction, on CUDA: no atomics, deterministic), else ``index_add_`` (sequential on the CPU: the same sums,
            3x faster there; on CUDA it would use atomics). Default: on CUDA.

        Returns
        -------
        Tensor : the sums (groups x ...).
        """
        if x.is_cuda if segmented is None else segmented:
            return torch.segment_reduce(x, "sum", lengths=self.lengths, axis=0, unsafe=True)
        return torch.zeros(len(self.classes), *x.shape[1:], dtype=x.dtype).index_add_(0, self.row, x)

    def split(self, parts: int, size: int) -> list[Groups | None]:
        """The groups of each part of the label range, part p holding the labels ``p * size`` to ``(p + 1) * size -
        1`` (a fold's (fold, class) cells, ``fold * size + class``): each part's groups over its own labels
        (``label - p * size``), its rows still indexing the batch (None: a part with no token in the batch)."""
        part = torch.div(self.classes, size, rounding_mode="floor")
        cells = torch.bincount(part, minlength=parts).tolist()
        tokens = torch.zeros(parts, dtype=torch.int64, device=part.device).index_add_(0, part, self.lengths).tolist()
        out, c, t = [], 0, 0
        for p, (nc, nt) in enumerate(zip(cells, tokens)):
            g = None
            if nt:
                g = Groups.__new__(Groups)
                g.order, g.classes, g.lengths = self.order[t:t + nt], self.classes[c:c + nc] - p * size, \
                    self.lengths[c:c + nc]
                g.row = self.row[t:t + nt] - c
            out.append(g)
            c, t = c + nc, t + nt
        return out


def unit_rows(h: torch.Tensor) -> torch.Tensor:
    """h_i / ||h_i|| at any scale: each row divided by its largest magnitude first, so the norm's squares neither
    overflow nor underflow (an absolute floor such as normalize's 1e-12 would shrink rows of norm below it); a zero
    row stays zero."""
    top = h.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(h.dtype).tiny)
    return torch.nn.functional.normalize(h / top, dim=1)


def unit_sums(h: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each segment's sum of h_i / ||h_i|| over the consecutive float64 rows of ``lengths`` (segments x d): the rows
    weighed by 1 / ||h_i||, one matrix-vector product a segment; where a norm's squares could overflow or underflow (a
    norm not finite or below NORM_FLOOR, ~1e-140, zero rows included; never for the features of a float32, bfloat16 or
    float16 model), the rows of :func:`unit_rows` summed instead."""
    norm = torch.linalg.vector_norm(h, dim=1)
    if bool((torch.isfinite(norm) & (norm > NORM_FLOOR)).all()):
        rows, weight = h, norm.reciprocal_()
    else:
        rows, weight = unit_rows(h), torch.ones_like(norm)
    out = h.new_zeros(len(lengths), h.shape[1])
    for i, (a, n) in enumerate(zip(itertools.accumulate([0, *lengths]), lengths)):
        if n:
            out[i] = torch.mv(rows[a:a + n].T, weight[a:a + n])
    return out


def _squares(x: torch.Tensor) -> torch.Tensor:
    """Each row's squared norm (the norm's reduction squared: 2.5x faster than a row-wise dot product on the CPU)."""
    return torch.linalg.vector_norm(x, dim=1).square_()


def chan_update(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, g: Groups,
                hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chan's update, in place, of the running ``mean`` and ``m2`` of the groups of ``g`` (their rows of ``count``,
    ``mean``, ``m2``, read before ``count`` moves) with the float64 rows ``hs`` in group order (:meth:`Groups.sort`),
    in torch's kernels (a GPU's; the CPU runs :func:`chan_update_cpu`, the same arithmetic in one numba pass).

    Returns the rows whose Gram is the batch's increment of the scatter, sum dev dev^T over the tokens plus sum w delta
    delta^T over the groups: each token's deviation from its group's batch mean, then sqrt(w) delta for each group the
    running statistics hold already (delta = batch - running mean, w = n_a n_b / n). The rows that add exactly 0 are
    left out: a token alone in its group (its deviation is 0) and a group new to the running statistics (w = 0), whose
    running mean becomes its batch mean (0 + mean_b) without its row being read. Returned beside them, each row's
    group (an index into ``g.classes``)."""
    n_b = g.lengths.to(torch.float64)
    mean_b = g.sum(hs).div_(n_b[:, None])
    tok = torch.nonzero(g.lengths.index_select(0, g.row) > 1).squeeze(1)
    row = g.row.index_select(0, tok)
    n_a = count.index_select(0, g.classes)
    old = torch.nonzero(n_a).squeeze(1)
    rows = hs.new_empty(len(tok) + len(old), hs.shape[1])
    dev = torch.index_select(hs, 0, tok, out=rows[:len(tok)]).sub_(mean_b.index_select(0, row))
    m2_b = torch.zeros_like(n_b).index_add_(0, row, _squares(dev))
    n_a, nb = n_a.index_select(0, old).to(torch.float64), n_b.index_select(0, old)
    n = n_a + nb
    delta = mean_b.index_select(0, old).sub_(mean.index_select(0, g.classes.index_select(0, old)))
    w = n_a * nb / n
    torch.mul(delta, w.sqrt()[:, None], out=rows[len(tok):])
    mean.index_add_(0, g.classes, mean_b.index_copy_(0, old, delta * (nb / n)[:, None]))  # the cells are distinct
    m2.index_add_(0, g.classes, m2_b.index_add_(0, old, w * _squares(delta)))
    return rows, torch.cat([row, old])


def chan_update_cpu(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, unit_sum: torch.Tensor, g: Groups,
                    h: torch.Tensor) -> torch.Tensor:
    """Chan's update, in place, of the CPU statistics ``count``, ``mean``, ``m2`` and ``unit_sum`` (contiguous) with
    the tokens of the groups ``g`` (:class:`Groups`) among the rows of ``h`` (n x d, the whole batch: the groups
    index it); returns the rows whose Gram is the batch's increment of the scatter (float64), as
    :func:`chan_update` does (the rows that add exactly 0 left out)."""
    order = g.order
    if h.device.type != "cpu" or h.dtype not in (torch.float32, torch.float64):  # the groups' rows alone, here
        h, order = g.sort(h, torch.float64 if h.dtype == torch.float64 else torch.float32), torch.arange(len(order))
    x = h.detach().contiguous().numpy()
    rows = np.empty((len(order) + len(g.classes), x.shape[1]))
    unit = np.zeros(x.shape[1])
    n = chan_rows(x, order.numpy(), g.classes.numpy(), g.lengths.numpy(), count.numpy(), mean.numpy(), m2.numpy(),
                  unit, rows)
    unit_sum += torch.from_numpy(unit)
    return torch.from_numpy(rows[:n])


def add_gram(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out += x^T x`` (d x d), in place: the two diagonal blocks of half the columns and the lower-left block by
    three products, the upper-right block the lower-left's transpose (a quarter of the multiply-adds saved; those two
    blocks exactly symmetric)."""
    h = x.shape[1] // 2
    a, b = x[:, :h], x[:, h:]
    out[:h, :h].addmm_(a.T, a)
    out[h:, h:].addmm_(b.T, b)
    lower = b.T @ a
    out[h:, :h] += lower
    out[:h, h:] += lower.T


class ClassStats(Accumulator):
    """Running per-class count, mean, squared deviation (M2) and pooled within-class scatter.

    ``update(h, y)`` folds in a batch of features ``h`` (n x d) with labels ``y`` (n); only the classes
    present in the batch are touched, and nothing of size n x num_classes is ever formed.
    """

    def __init__(self, num_classes: int, dim: int, device: str | torch.device | None = None, scatter: bool = True):
        kw = dict(device=device, dtype=torch.float64)
        self.count = torch.zeros(num_classes, dtype=torch.int64, device=device)
        self.mean = torch.zeros(num_classes, dim, **kw)
        self.m2 = torch.zeros(num_classes, **kw)  # sum over a class's tokens of ||h - mu_c||^2
        self.scatter = torch.zeros(dim, dim, **kw) if scatter else None  # sum (h - mu_c)(h - mu_c)^T
        self.unit_sum = torch.zeros(dim, **kw)  # sum h / ||h|| over every token (anisotropy)

    def update(self, h: torch.Tensor, y: torch.Tensor | None, groups: Groups | None = None) -> None:
        """Fold in features ``h`` (n x d) with labels ``y`` (n); ``groups`` (:class:`Groups` of ``y`` on the
        statistics' device) may be given to share one grouping of a batch between the layers that read it (``y`` is
        then not read): the rows of ``h`` its groups index are the tokens folded in (a fold's, of a batch's). On the
        CPU one numba pass (:func:`chan_update_cpu`), elsewhere torch's kernels (:func:`chan_update`)."""
        g = groups if groups is not None else Groups(y.to(self.mean.device, torch.int64))
        if len(g.order) == 0:
            return
        if self.mean.device.type == "cpu":  # one numba pass over the rows (the same arithmetic)
            rows = chan_update_cpu(self.count, self.mean, self.m2, self.unit_sum, g, h)
        else:
            hs = g.sort(h, torch.float64)
            self.unit_sum += unit_sums(hs, [len(hs)])[0]
            rows, _ = chan_update(self.count, self.mean, self.m2, g, hs)
            self.count.index_add_(0, g.classes, g.lengths)
        if self.scatter is not None and len(rows):
            add_gram(self.scatter, rows)

    def merge(self, other: "ClassStats") -> "ClassStats":
        """Fold in the statistics of another stream (disjoint tokens) with Chan's parallel formula, exactly as
        :meth:`update` folds in a batch: counts add, means move by the count-weighted difference, M2 and the
        scatter gain ``delta^2 n_a n_b / n``. Classes empty on either side are copied, not recomputed. Returns self."""
        n_a, n_b = self.count.to(torch.float64), other.count.to(torch.float64).to(self.mean.device)
        both = torch.nonzero((n_a > 0) & (n_b > 0)).squeeze(1)
        only_b = torch.nonzero((n_a == 0) & (n_b > 0)).squeeze(1)
        mean_b, m2_b = other.mean.to(self.mean.device), other.m2.to(self.mean.device)
        if len(both):
            na, nb = n_a[both], n_b[both]
            n = na + nb
            delta = mean_b[both] - self.mean[both]
            w = na * nb / n
            self.mean[both] += delta * (nb / n)[:, None]
            self.m2[both] += m2_b[both] + w * (delta * delta).sum(1)
            if self.scatter is not None:
                self.scatter += (delta * w[:, None]).T @ delta
        self.mean[only_b] = mean_b[only_b]
        self.m2[only_b] = m2_b[only_b]
        if self.scatter is not None and other.scatter is not None:
            self.scatter += other.scatter.to(self.mean.device)
        self.unit_sum += other.unit_sum.to(self.mean.device)
        self.count += other.count.to(self.count.device)
        return self

    @property
    def variance(self) -> torch.Tensor:
        """Population variance per class: mean squared distance to the class mean (nan for empty classes)."""
        return self.m2 / self.count.to(torch.float64)

    @property
    def within_covariance(self) -> torch.Tensor:
        """Pooled, token-weighted within-class covariance (1/N) sum_c sum_i (h_i - mu_c)(h_i - mu_c)^T."""
        return self.scatter / self.count.sum().to(torch.float64)

    def state_dict(self) -> dict[str, torch.Tensor]:
        s = {"count": self.count, "mean": self.mean, "m2": self.m2, "unit_sum": self.unit_sum}
        if self.scatter is not None:
            s["scatter"] = self.scatter
        return s

    def load_state_dict(self, state: dict) -> None:
        """Take the arrays of a :meth:`state_dict` (copied in place; a missing one is a KeyError)."""
        for k in self.state_dict():
            getattr(self, k).copy_(torch.as_tensor(state[k]))


class FoldStats(Accumulator):
    """:class:`ClassStats` of ``folds`` disjoint folds of the stream side by side, held as stacked arrays with a
    leading fold dimension (``count`` folds x vocab, ``mean`` folds x vocab x d, ``m2``, ``scatter`` folds x d x d,
    ``unit_sum`` folds x d); each fold is a :class:`ClassStats` over views of them (:attr:`parts`), so a fold's
    numbers are exactly what one ClassStats over its tokens alone gives. ``update(h, y, fold)`` deals each token to
    its fold (``fold``: n fold indices); :meth:`totals` merges the folds into the statistics of the whole stream, so
    that each batch's per-class work is done once (the extraction's totals with folds, attribute ``totals``)."""

    def __init__(self, folds: int, num_classes: int, dim: int, device: str | torch.device | None = None,
                 scatter: bool = True):
        kw = dict(device=device, dtype=torch.float64)
        self.count = torch.zeros(folds, num_classes, dtype=torch.int64, device=device)
        self.mean = torch.zeros(folds, num_classes, dim, **kw)
        self.m2 = torch.zeros(folds, num_classes, **kw)
        self.scatter = torch.zeros(folds, dim, dim, **kw) if scatter else None
        self.unit_sum = torch.zeros(folds, dim, **kw)
        self.parts = [self._part(f) for f in range(folds)]

    def _part(self, f: int) -> ClassStats:
        part = ClassStats.__new__(ClassStats)
        part.count, part.mean, part.m2, part.unit_sum = self.count[f], self.mean[f], self.m2[f], self.unit_sum[f]
        part.scatter = None if self.scatter is None else self.scatter[f]
        return part

    def update(self, h: torch.Tensor, y: torch.Tensor, fold: torch.Tensor, groups: Groups | None = None) -> None:
        """Fold in features ``h`` (n x d) with labels ``y`` (n), each token into its fold ``fold`` (n): each fold's
        tokens into its :class:`ClassStats` (:meth:`tasks`, run one after another)."""
        for task in self.tasks(h, y, fold, groups):
            task()

    def update_at_once(self, h: torch.Tensor, y: torch.Tensor, fold: torch.Tensor,
                       groups: Groups | None = None) -> None:
        """Fold in a batch as :meth:`update` does, every fold at once: Chan's update of every (fold, class) cell over
        the stacked arrays seen as one class axis of folds x vocab cells, then each fold's scatter and unit-vector sum
        from its own rows, in the order its own update takes them (on a GPU the numbers of :meth:`update`, each cell's
        and each fold's arithmetic the one torch's :func:`chan_update` does there; on the CPU, whose update is one
        numba pass, equal to it to float64 rounding). A few kernels and synchronisations a batch rather than a few a
        fold: the update on a GPU, where the per-fold calls' launches cost more than their arithmetic."""
        g = groups if groups is not None else self.grouping(y, fold)
        if len(g.order) == 0:
            return
        folds, vocab, dim = self.mean.shape
        hs = g.sort(h, torch.float64)
        fold_of = torch.div(g.classes, vocab, rounding_mode="floor")  # each group's fold
        tokens = torch.zeros(folds, dtype=torch.int64, device=fold_of.device).index_add_(0, fold_of, g.lengths)
        self.unit_sum += unit_sums(hs, tokens.tolist())  # hs in (fold, class) order: each fold's rows contiguous
        rows, group = chan_update(self.count.view(-1), self.mean.view(-1, dim), self.m2.view(-1), g, hs)
        if self.scatter is not None and len(rows):
            row_fold = fold_of.index_select(0, group)
            by_fold = torch.argsort(row_fold, stable=True)  # each fold's rows in chan_update's order for that fold
            rows = rows.index_select(0, by_fold)
            start = 0
            for f, n in enumerate(torch.bincount(row_fold, minlength=folds).tolist()):
                if n:
                    add_gram(self.scatter[f], rows[start:start + n])
                start += n
        self.count.view(-1).index_add_(0, g.classes, g.lengths)

    def grouping(self, y: torch.Tensor, fold: torch.Tensor) -> Groups:
        """A batch's tokens grouped by (fold, class) once, for every layer that reads the batch (``y``, ``fold``: each
        token's label and fold, n)."""
        vocab = self.count.shape[1]
        return Groups(fold.to(self.mean.device, torch.int64) * vocab + y.to(self.mean.device, torch.int64))

    def tasks(self, h: torch.Tensor, y: torch.Tensor, fold: torch.Tensor,
              groups: Groups | None = None) -> list[Callable[[], None]]:
        """The update of each fold the batch reaches, as calls that touch that fold's arrays alone (so that they may
        run at once): the fold's tokens, found by one grouping of the batch by (fold, class) (``groups``, from
        :meth:`grouping`, or made here), into the fold's :class:`ClassStats` (:meth:`ClassStats.update`, over the
        fold's contiguous sorted rows)."""
        g = groups if groups is not None else self.grouping(y, fold)
        if len(g.order) == 0:
            return []
        folds, vocab = self.count.shape
        return [functools.partial(part.update, h, None, sub) for part, sub in zip(self.parts, g.split(folds, vocab))
                if sub is not None]

    def totals(self, into: ClassStats | None = None) -> ClassStats:
        """The statistics of every fold's tokens together: the folds merged in fold order 0, 1, ..., F - 1 with Chan's
        formula (:meth:`ClassStats.merge`; equal to one pass over the stream to float64 rounding, counts exactly),
        into ``into`` (its arrays overwritten in place, so views of them stay live) or a new ClassStats."""
        folds, vocab, dim = self.mean.shape
        acc = into if into is not None else ClassStats(vocab, dim, self.mean.device, scatter=self.scatter is not None)
        for x in acc.state_dict().values():
            x.zero_()
        for part in self.parts:
            acc.merge(part)
        return acc

    def merge(self, other: "FoldStats") -> "FoldStats":
        """Fold in another stream's fold statistics, fold by fold (Chan, :meth:`ClassStats.merge`). Returns self."""
        if len(other.parts) != len(self.parts):
            raise ValueError(f"cannot merge {len(other.parts)} folds into {len(self.parts)}")
        for mine, theirs in zip(self.parts, other.parts):
            mine.merge(theirs)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        s = {"count": self.count, "mean": self.mean, "m2": self.m2, "unit_sum": self.unit_sum}
        if self.scatter is not None:
            s["scatter"] = self.scatter
        return s

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k in self.state_dict():
            getattr(self, k).copy_(torch.as_tensor(state[k]))


def fold_of(first_block: int, blocks: int, tokens_per_block: int, folds: int,
            device: str | torch.device | None = None) -> torch.Tensor:
    """The fold of each token of ``blocks`` consecutive whole blocks starting at block ``first_block`` of the stream
    (block i -> fold i mod ``folds``: interleaved, so every fold spans the split), ``tokens_per_block`` each."""
    block = torch.arange(first_block, first_block + blocks, device=device) % folds
    return block.repeat_interleave(tokens_per_block)


def float64_head(classifier: torch.Tensor, bias: torch.Tensor | None,
                 device: str | torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output layer in float64 on ``device`` (default: the classifier's): one copy for a whole validation pass,
    shared by the loss and every layer's NC4 decisions (none where the head is float64 there already).

    Parameters
    ----------
    classifier, bias : the output layer's weight (vocab x d) and bias (vocab) or None.
    device : where the validation pass runs.

    Returns
    -------
    (w, b) : the weight (vocab x d) and bias (vocab, or None), float64.
    """
    device = classifier.device if device is None else device
    return (classifier.to(device, torch.float64),
            None if bias is None else bias.to(device, torch.float64))


class Sums(Accumulator):
    """An accumulator whose state is named tensors summed over the stream (``NAMES``, held by :meth:`sums`): parts
    merge by adding them, and the state is the tensors themselves."""
    NAMES: tuple[str, ...] = ()

    def sums(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def merge(self, other: "Sums") -> "Sums":
        """Add the sums of another part of the stream. Returns self."""
        mine, theirs = self.sums(), other.sums()
        for n in self.NAMES:
            mine[n] += theirs[n].to(mine[n].device)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.sums()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for n in self.NAMES:
            self.sums()[n].copy_(torch.as_tensor(state[n]))


# classes scored at a time by NC4's float64 linear decisions (their head rows gathered for the tile)
TILE = 1 << 14


class DecisionCounts(Sums):
    """NC4's counts per true class, over the kept classes ``kept`` (float64): ``val_count`` tokens,
    ``val_correct`` hits of the linear argmax_c (w_c . z + b_c), and ``val_ncc_agree`` tokens where that
    argmax equals the nearest-class-mean decision argmin_c ||h - mu_c||^2 = argmax_c (mu_c . h - ||mu_c||^2 / 2);
    with ``train_count``, the same over each NC4_MIN_COUNTS kept set (count >= m) into the ``VAL_AT`` rows.

    ``z`` is ``h`` itself, or ``lens(h)`` with a ``lens`` (the logit lens at an earlier layer: the model's final norm);
    the nearest class mean always reads the raw ``h`` and ``mean``. The nearest-mean decisions of every kept set come
    from one float32 screen with a float64 recheck (:class:`~ncanalyze.analyzer.screen.Screen`: exactly the float64
    argmax); the linear ones from each token's best scores over the union of the kept sets (:class:`Leaders`: on the
    CPU a float32 screen with its leaders scored again in float64, :class:`~ncanalyze.analyzer.screen.LinearScreen`,
    one for the layers of a pass, ``shared``; elsewhere one float64 product), or from the head's logits
    (:meth:`count_logits`), each set's argmax read from them (the first of equal scores, as one argmax over the set),
    a token they leave open scored over the set in float64.
    ``head`` (:func:`float64_head`) may be given to share one float64 head between the loss and the layers; tokens
    are scored in chunks of at most ``budget`` (token, class) cells. ``counts`` may be given to continue from earlier
    counts (updated in place), ``folds`` the per-fold counts (:meth:`begin`).
    """

    NAMES = ("val_count", "val_correct", "val_ncc_agree")

    def __init__(self, classifier: torch.Tensor, bias: torch.Tensor | None, mean: torch.Tensor, kept: torch.Tensor,
                 counts: dict[str, torch.Tensor] | None = None, budget: int = 1 << 25,
                 lens: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 head: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                 folds: dict[str, torch.Tensor] | None = None, train_count: torch.Tensor | None = None,
                 fold_stats: FoldStats | None = None, min_count: int = default("min_count"),
                 shared: dict | None = None, screen32: bool | None = None):
        device = mean.device
        # the pass's float32 screen of the linear decisions, made at the first update and shared by its layers (the
        # same head and kept sets), on the CPU (where float32 is twice float64's speed) unless ``screen32`` says
        self.shared, self.budget = {} if shared is None else shared, budget
        self.screen32 = device.type == "cpu" if screen32 is None else screen32
        self.folds, self._fold, self._at = folds, None, 0  # per fold counts (folds x vocab), updated in place
        self.kept = kept.to(device)
        self.w, self.b = head if head is not None else float64_head(classifier, bias, device)
        self.mean = mean.to(torch.float64)  # the layer's own float64 means: no copy
        self.counts = counts or self.zeros(classifier.shape[0], device, at=train_count is not None)
        self.lens = lens
        self.tile = max(1, min(TILE, budget // max(1, self.mean.shape[1])))
        self.sets = [(self.kept, self.counts)] + (self._at_min_counts(train_count) if VAL_AT[1] in self.counts else [])
        self.union = union = torch.unique(torch.cat([k for k, _ in self.sets]))
        self.ncc = Screen(self.mean, [k for k, _ in self.sets], budget)
        self.without = self._leave_outs(fold_stats, min_count, budget) \
            if fold_stats is not None and folds is not None and NC4_WITHOUT in folds else []
        self.chunk = max(1, budget // max(1, min(len(union), self.tile)))

    def _at_min_counts(self, train_count: torch.Tensor | None) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Each NC4_MIN_COUNTS kept set (count >= m) with the rows of the ``VAL_AT`` counts it counts into (none for
        a kept set without a class: its row stays 0 and NC4 is not measured there)."""
        if train_count is None:
            raise ValueError("DecisionCounts: counts at each NC4 min_count (val_*_at) need the train counts")
        scratch = torch.zeros_like(self.counts["val_count"])  # val_count is the same for every kept set
        out = []
        for i, m in enumerate(NC4_MIN_COUNTS):
            kept = torch.nonzero(train_count.to(self.mean.device) >= m).squeeze(1)
            if len(kept):
                out.append((kept, {"val_count": scratch, "val_correct": self.counts[VAL_AT[0]][i],
                                   "val_ncc_agree": self.counts[VAL_AT[1]][i]}))
        return out

    def _leave_outs(self, fold_stats: FoldStats, min_count: int, budget: int) -> list[WithoutFold]:
        """Per fold f, NC4's nearest-mean decisions over the classes of ``min_count`` train tokens outside it, their
        means without it (:class:`WithoutFold`), for ``folds[NC4_WITHOUT]``."""
        return [WithoutFold(fold_stats, self.ncc, f, min_count, budget) for f in range(len(fold_stats.parts))]

    @classmethod
    def zeros(cls, vocab: int, device: str | torch.device | None = None, folds: int | None = None,
              at: bool | None = None) -> dict[str, torch.Tensor]:
        """Fresh counts: each of :attr:`NAMES` a zero int64 vector of ``vocab`` (folds x vocab with ``folds``), and
        with ``at`` (default: without folds) each of ``schema.VAL_AT`` a zero len(NC4_MIN_COUNTS) x vocab matrix."""
        shape = (vocab,) if folds is None else (folds, vocab)
        out = {n: torch.zeros(shape, dtype=torch.int64, device=device) for n in cls.NAMES}
        if (folds is None) if at is None else at:
            out |= {n: torch.zeros((len(NC4_MIN_COUNTS), vocab), dtype=torch.int64, device=device) for n in VAL_AT}
        return out

    def begin(self, fold: torch.Tensor | None) -> None:
        """The fold of each token of the next batch (n), which :meth:`count` reads chunk by chunk, in order."""
        self._fold, self._at = (None if fold is None else fold.to(self.mean.device)), 0

    def _count_folds(self, y: torch.Tensor, linear: torch.Tensor, ncc: torch.Tensor) -> None:
        """The chunk's counts into its tokens' folds (the next ``len(y)`` of :meth:`begin`'s folds)."""
        if self.folds is None or self._fold is None:
            return
        vocab = self.folds["val_count"].shape[1]
        key = self._fold[self._at:self._at + len(y)] * vocab + y
        self._at += len(y)
        _tally(self.folds, key, linear == y, linear == ncc)

    def _argmax(self, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """The class of ``kept`` of the largest ``x . w_c + b_c`` for each row of ``x`` (ties: the first kept)."""
        best = torch.full((len(x),), -torch.inf, dtype=torch.float64, device=x.device)
        arg = torch.zeros(len(x), dtype=torch.int64, device=x.device)
        for s, sc in self._scores(x, kept):
            v, j = sc.max(1)
            better = v > best
            best, arg = torch.where(better, v, best), torch.where(better, j + s, arg)
        return kept[arg]

    def _scores(self, x: torch.Tensor, kept: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """``x . w_c + b_c`` (float64) at the classes ``kept[s:s + tile]``, a tile at a time: (s, rows x tile)."""
        for s in range(0, len(kept), self.tile):
            c = kept[s:s + self.tile]
            sc = x @ self.w[c.to(self.w.device)].to(x.device, torch.float64).T
            if self.b is not None:
                sc += self.b[c.to(self.b.device)].to(x.device, torch.float64)
            yield s, sc

    def _leaders(self, x: torch.Tensor, kept: torch.Tensor) -> Leaders:
        """Each row's best scores ``x . w_c + b_c`` over the classes ``kept`` (float64), a tile at a time."""
        return Leaders.over(((sc, kept[s:s + sc.shape[1]]) for s, sc in self._scores(x, kept)), len(x), x.device)

    def _linear(self) -> LinearScreen:
        """The pass's float32 screen of the linear decisions over the union of the kept sets (``shared``)."""
        if "linear" not in self.shared:
            self.shared["linear"] = LinearScreen(self.w, self.b, self.union.to(self.w.device), self.budget)
        return self.shared["linear"]

    def _per_set(self, leaders: Leaders, rescore: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                 ) -> list[torch.Tensor]:
        """The linear decisions of each kept set, then of each leave-one-fold-out kept set, read from ``leaders``
        (each row's best scores over a superset of them, :meth:`Leaders.first`); a row the list does not decide for a
        set (a tie at its end, no member in it) by ``rescore(rows, kept)`` over the set; -1 for an empty set (a
        leave-one-fold-out set of a tiny sample: no label is in it)."""
        out = []
        for kept, inside in [(k, m) for (k, _), m in zip(self.sets, self.ncc.member)] + \
                [(w.kept, w.member) for w in self.without]:
            out.append(leaders.decide(lambda rows, kept=kept: rescore(rows, kept) if len(kept) else -1, inside))
        return out

    def update(self, h: torch.Tensor, y: torch.Tensor) -> None:
        z = None
        if self.lens is not None:
            with torch.inference_mode():
                z = self.lens(h).to(self.mean.device, torch.float64)
        h, y = h.to(self.mean.device, torch.float64), y.to(self.mean.device, torch.int64)
        z = h if z is None else z
        for s in range(0, len(y), self.chunk):
            hc, zc, yc = h[s:s + self.chunk], z[s:s + self.chunk], y[s:s + self.chunk]
            leaders = self._linear().leaders(zc) if self.screen32 else self._leaders(zc, self.union)
            linear = self._per_set(leaders, lambda r, kept: self._argmax(zc[r], kept))
            self.count_sets(hc, yc, linear)

    def count_logits(self, h: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, leaders: Leaders | None = None
                     ) -> None:
        """Count a chunk from its head logits over the whole vocabulary (n x vocab), at the kept set and at each
        NC4_MIN_COUNTS kept set (each set's argmax of its columns, the first of equal logits); ``leaders``: the
        logits' best (:meth:`Leaders.of`) where the caller has them."""
        leaders = Leaders.of(logits) if leaders is None else leaders
        self.count_sets(h, y, self._per_set(leaders, lambda r, kept: kept[logits[r[:, None], kept].argmax(1)]))

    def count(self, h: torch.Tensor, y: torch.Tensor, linear: torch.Tensor) -> None:
        """Count a chunk at the kept set ``kept`` alone (not the NC4_MIN_COUNTS sets), its linear decisions given:
        ``linear`` (n, the kept class of the largest w_c . z + b_c).

        Parameters
        ----------
        h : the chunk's raw features (n x d), float64 on the counts' device.
        y : their labels (n), int64.
        linear : the linear decision of each token (n), int64 class ids.
        """
        ncc = self.ncc.argmax(h)[0]
        _tally(self.counts, y, linear == y, linear == ncc)
        self._count_folds(y, linear, ncc)

    def count_sets(self, h: torch.Tensor, y: torch.Tensor, linear: list[torch.Tensor]) -> None:
        """Count a chunk at every kept set, ``linear`` its linear decisions per set (in ``sets``' order); the
        nearest-mean decisions from the screen."""
        replicates = bool(self.without) and self._fold is not None
        ncc = self.ncc.argmax(h, WithoutFold.FIRST if replicates else 0)
        for (_, counts), lin, near in zip(self.sets, linear, ncc):
            _tally(counts, y, lin == y, lin == near)
        if replicates:
            self._count_without(h, y, linear[len(self.sets):], ncc[len(self.sets):])
        self._count_folds(y, linear[0], ncc[0])

    def _count_without(self, h: torch.Tensor, y: torch.Tensor, linear: list[torch.Tensor],
                       top: list[torch.Tensor]) -> None:
        """Each replicate's agreements (``folds[NC4_WITHOUT]``): the means and validation tokens without fold f,
        ``linear`` the decisions per leave-one-fold-out set, ``top`` the full screen's best scores, their classes and
        bounds (:class:`WithoutFold`); the tokens some fold leaves unclear are screened once for all folds."""
        fold, agree = self._fold[self._at:self._at + len(y)], self.folds[NC4_WITHOUT]
        parts = []
        for f, without in enumerate(self.without):
            t = torch.nonzero(fold != f).squeeze(1)
            parts.append((t, *without.fast(h[t], *(v[t] for v in top))))
        pending = torch.unique(torch.cat([t[again] for t, _, again, _ in parts]))
        row = torch.full((len(y),), -1, dtype=torch.int64, device=y.device)
        row[pending] = torch.arange(len(pending), device=y.device)
        sc = self.ncc.scores((h[pending] - self.ncc.shift).float())[:, :self.ncc.size[0]] if len(pending) else None
        for f, ((t, d, again, bound), without, lin) in enumerate(zip(parts, self.without, linear)):
            if len(again):
                d[again] = without.exact(h[t[again]], sc[row[t[again]]], bound[again])
            at = y[t][lin[t] == d]
            agree[f].index_add_(0, at, torch.ones_like(at))

    def linear_decisions(self, logits: torch.Tensor) -> torch.Tensor:
        """The linear decisions from a chunk's head logits over the whole vocabulary (n x vocab): the kept class of
        each row's largest logit among the kept (ties: the first kept)."""
        return self.kept[logits[:, self.kept].argmax(1)]

    def sums(self) -> dict[str, torch.Tensor]:
        """The counts (merged across parts counted with the same head, means and kept classes)."""
        return self.counts


class LeaveOut:
    """The float64 class means without fold f, rows made on demand (``means[classes]``, as a Screen reads them):
    (n_c mu_c - n_c^f mu_c^f) / (n_c - n_c^f), from the totals' means and the fold sums, mu_c itself where fold f
    holds no token of c (not finite where every train token of c is in fold f; such classes are not kept)."""

    def __init__(self, fold_stats: FoldStats, mean: torch.Tensor, f: int):
        self.n, self.mean = fold_stats.count.sum(0).to(mean.device), mean
        self.nf, self.mf = fold_stats.count[f].to(mean.device), fold_stats.mean[f]
        self.shape, self.device = mean.shape, mean.device

    def __getitem__(self, c: torch.Tensor) -> torch.Tensor:
        n, nf = self.n[c].to(torch.float64)[:, None], self.nf[c].to(torch.float64)[:, None]
        return torch.where(nf == 0, self.mean[c], (n * self.mean[c] - nf * self.mf[c].to(self.device)) / (n - nf))


class WithoutFold:
    """NC4's nearest-mean decisions over fold f's leave-one-out kept set (the classes of ``min_count`` train tokens
    outside it), with their means without it (:class:`LeaveOut`), exactly the float64 argmax over the set.

    A class with no train token in fold f keeps its mean, so its screened score is the full screen's (``main``); only
    the classes with one ("moved") are screened again, one GEMM over them. A token is decided where the best of its
    full list (the kept set's :attr:`FIRST` best screened scores, unmoved members of the set alone) and of the moved
    classes beats every other (the rest of the list, the list's last score for every class past it, the moved classes'
    next) by more than twice the larger error bound (screen.py). Every other token is rechecked as a screen rechecks:
    its screened scores at every class of the set (the full screen's where unmoved), the candidates within that bound of
    its best scored in float64, the first of the largest. ``decided`` and ``rechecked`` count the two kinds; ``hold``
    as :class:`Screen`'s (the moved classes' float32 rows held, by default on the CPU).
    """

    FIRST = 8  # the full screen's best scores per token that the replicates read

    def __init__(self, fold_stats: FoldStats, main: Screen, f: int, min_count: int, budget: int,
                 hold: bool | None = None):
        mean = main.means
        n, nf = fold_stats.count.sum(0).to(mean.device), fold_stats.count[f].to(mean.device)
        self.kept = torch.nonzero(n - nf >= min_count).squeeze(1)
        self.member = torch.zeros(len(n), dtype=torch.bool, device=mean.device)
        self.member[self.kept] = True
        self.still = self.member & (nf == 0)  # kept, and its mean the full one
        self.rows, self.main = LeaveOut(fold_stats, mean, f), main
        self.moved = Screen(self.rows, [torch.nonzero(self.member & (nf > 0)).squeeze(1)], budget, hold, main.shift)
        at = torch.full((len(n),), -1, dtype=torch.int64, device=mean.device)  # a moved class's column in its screen
        at[self.moved.union] = torch.arange(len(self.moved.union), device=mean.device)
        cols = main.union[:main.size[0]]  # the kept set's columns of the full screen
        self.cols_still, self.cols_moved, self.moved_at = self.still[cols], at[cols] >= 0, at[cols][at[cols] >= 0]
        self.decided = self.rechecked = 0

    def argmax(self, x: torch.Tensor, top: torch.Tensor, cls: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The decisions for tokens ``x`` (n x d, float64), given the full screen's best scores ``top`` (n x FIRST,
        descending), their classes ``cls`` and its bound ``e`` (:meth:`Screen.argmax` with ``first``)."""
        out, again, bound = self.fast(x, top, cls, e)
        if len(again):
            out[again] = self.exact(x[again], self.main.scores((x[again] - self.main.shift).float()), bound[again])
        return out

    def fast(self, x: torch.Tensor, top: torch.Tensor, cls: torch.Tensor, e: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(decisions, the tokens left unclear, the larger bound per token) as :meth:`argmax` takes them: the
        unclear tokens' decisions are to be made by :meth:`exact`; an empty set decides -1 for every token."""
        if len(self.kept) == 0:
            none = torch.zeros(0, dtype=torch.int64, device=x.device)
            return torch.full((len(x),), -1, dtype=torch.int64, device=x.device), none, e
        v2, c2, e2 = self.moved.leaders(x - self.main.shift)
        vals = torch.cat([top.masked_fill(~self.still[cls], -torch.inf), v2], 1)
        best, at = vals.max(1)
        rest = torch.maximum(vals.scatter(1, at[:, None], -torch.inf).amax(1), top[:, -1])
        bound = torch.maximum(e, e2)
        clear = best.double() - rest.double() > 2 * bound  # nan (no class) or an infinite bound: unclear
        again = torch.nonzero(~clear).squeeze(1)
        self.decided, self.rechecked = self.decided + len(x) - len(again), self.rechecked + len(again)
        return torch.cat([cls, c2], 1).gather(1, at[:, None]).squeeze(1), again, bound

    def exact(self, x: torch.Tensor, sc: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The float64 decisions of tokens ``x`` from the full screen's scores ``sc`` (tokens x its columns, the kept
        set's first): the set's members within 2 ``e`` of each token's best screened score (the moved classes screened
        again), scored in float64 (:meth:`Screen.rescore`); -1 for an empty set."""
        if len(self.kept) == 0:
            return torch.full((len(x),), -1, dtype=torch.int64, device=x.device)
        sc = sc[:, :self.main.size[0]].clone()
        if self.cols_moved.any():
            sc[:, self.cols_moved] = self.moved.scores((x - self.main.shift).float())[:, self.moved_at]
        return Screen.rescore(x, sc, self.cols_still | self.cols_moved, self.main.union[:self.main.size[0]], e,
                              self.rows)


def _tally(counts: dict[str, torch.Tensor], key: torch.Tensor, correct: torch.Tensor, agree: torch.Tensor) -> None:
    """Add one to ``val_count`` at each ``key`` (flat indices into the counts), to ``val_correct`` where
    ``correct``, to ``val_ncc_agree`` where ``agree`` (index_add_: no vocabulary-sized temporary per chunk)."""
    for name, at in (("val_count", key), ("val_correct", key[correct]), ("val_ncc_agree", key[agree])):
        counts[name].view(-1).index_add_(0, at, torch.ones_like(at))
