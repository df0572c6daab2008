"""NC4's nearest-class-mean decision, argmax_c (x . mu_c - ||mu_c||^2 / 2) over each of several class sets, at
float32 speed and exactly the float64 decision: a float32 GEMM screen whose error is bounded rigorously, and a
float64 recheck of every token whose screened margin is within that bound.

The screen. Shifting the features and the means by one vector g (the sets' means averaged) moves every class's score
by the same amount per token, (x - g) . (mu_c - g) - ||mu_c - g||^2 / 2 = score_c - x . g + ||g||^2 / 2, so the
decisions are those of r_c = mu_c - g, o_c = -||r_c||^2 / 2 and x - g, whose norms lack the features' common part.
The screen forms s~_c = fl32(o_c + (x - g) . r_c) from float32 copies, one GEMM (``addmm``) in any summation order.
With u = 2^-24 (float32 rounding) and d the width, each score is within

    E(x) = (1.02 d + 4) u (||x - g|| R + O) + (d + 1) 2^-100,    R = max_c ||r_c||,  O = max_c |o_c| = R^2 / 2,

of the exact one: the conversions cost (2u + u^2) sum_i |x_i r_i| + u |o_c|, the accumulation of d + 1 terms
gamma_{d+1} (|o_c| + sum_i |x_i r_i|) (Higham, Accuracy and Stability, 3.1; gamma_n = nu / (1 - nu) <= 1.0101 nu for
nu <= 0.01, with or without FMA), and 4u beyond 1.02d + 3.03 covers float64's own error in the reference scores and the
norms; the last term covers float32 underflow, given |x_i|, |r_i| <= 2^40 and |o_c| <= 2^80 (checked: outside
them, or at d >= 167,000, a token is rechecked rather than screened). TF32 and bfloat16 GEMMs are switched off for the
screen (``torch.set_float32_matmul_precision("highest")``), on the CPU and on CUDA alike.

A token is decided by the screen in a set S where its best screened score in S beats the next by more than 2 E(x):
then no other class of S can reach it in exact arithmetic, nor in float64. The sets are nested (NC4's kept sets,
count >= m): the union's classes are ordered so that each set is a prefix, and one GEMM serves them all. Every other
token is
rechecked: its candidates (the members of S within 2 E(x) of its best screened score in S) are scored in float64,
o_c + sum_i x_i r_ic, and the first (smallest) class of the largest score wins, as one float64 argmax over S gives.
Two classes whose float64 scores differ by a few float64 roundings (an exact tie in real arithmetic, unless the rows
are equal) may be ordered otherwise than another float64 evaluation order would order them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch

U32 = 2.0 ** -24  # float32's unit roundoff
LIMIT = 2.0 ** 40  # the largest |x_i|, |r_i| (and LIMIT^2 for |o_c|) the bound covers
LEADERS = 16  # the best scores per token that the linear decisions over several class sets read (Leaders)
NONE = torch.iinfo(torch.int64).max  # no class
CACHE32 = 1 << 21  # on the CPU, a screen's float32 scores formed at a time (8 MB, a few thousand classes): malloc
# reuses the buffer and the scores are read back from cache, where a 130 MB block cost its page faults and, with the
# screen's topk, twice the time on a 2-core CPU
FEWEST = 256  # the fewest classes a CPU step screens (below it the GEMM loses its efficiency)
CACHE, PAIRS = 1 << 18, 1024  # a recheck's (pair, width) cells at a time (2 MB of float64: 3-6x faster than 256 MB
# on a 2-core CPU, the same bits), and its fewest pairs at a time (the loop's own cost at a large width)


def cache_step(n: int, tile: int, device: torch.device) -> int:
    """The classes screened at a time for ``n`` tokens: ``tile``, and on the CPU at most :data:`CACHE32` cells
    (at least :data:`FEWEST` classes: the GEMM's efficiency)."""
    return tile if device.type != "cpu" else max(1, min(tile, max(FEWEST, CACHE32 // max(1, n))))


def bound_coef(d: int, top: float, offsets: float) -> float:
    """(1.02 d + 4) u, the bound's coefficient at width ``d``, where it holds: the rows' largest element ``top`` at
    most LIMIT, the largest offset at most LIMIT^2 and (d + 1) u <= 0.01; else inf (every token rechecked)."""
    sound = top <= LIMIT and offsets <= LIMIT ** 2 and (d + 1) * U32 <= 0.01
    return (1.02 * d + 4) * U32 if sound else torch.inf


def error_bound(x: torch.Tensor, coef: float, R: float, O: float) -> torch.Tensor:
    """E(x) = coef (||x|| R + O) + (d + 1) 2^-100 per row of ``x`` (n x d, float64), inf where an element of x is
    beyond LIMIT (the module docstring's bound)."""
    e = coef * (torch.linalg.vector_norm(x, dim=1) * R + O) + (x.shape[1] + 1) * 2.0 ** -100
    return torch.where(x.abs().amax(1) <= LIMIT, e, torch.inf)


@contextmanager
def ieee_float32() -> Iterator[None]:
    """float32 GEMMs in IEEE float32 (no TF32, no bfloat16 passes) while inside, the setting restored after."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def first_argmax(score: torch.Tensor, token: torch.Tensor, cls: torch.Tensor, n: int) -> torch.Tensor:
    """Per token of ``n``, the smallest ``cls`` among its pairs of the largest ``score`` (pairs: ``token``, ``cls``,
    ``score``, each m)."""
    best = torch.full((n,), -torch.inf, dtype=score.dtype, device=score.device)
    best = best.scatter_reduce(0, token, score, "amax")
    top = score == best[token]
    out = torch.full((n,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=score.device)
    return out.scatter_reduce(0, token[top], cls[top], "amin")


def _merge(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], k: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of two lists of (scores, columns) per token (descending)."""
    v, c = torch.cat([a[0], b[0]], 1), torch.cat([a[1], b[1]], 1)
    if v.shape[1] <= k:
        v, at = v.sort(dim=1, descending=True)
    else:
        v, at = v.topk(k, dim=1)
    return v, c.gather(1, at)


class Leaders(NamedTuple):
    """Each token's best scores (n x k; float64 where exact decisions are read from them) and their classes, over a
    set of classes that the list holds whole where ``complete``; every class outside the list scores at most
    ``floor`` (n; default the list's last score). The argmax over any subset S of the classes in one read
    (:meth:`first`), exact where S's best score in the list is above the floor (every class of that score is then in
    it) or the list is complete."""

    vals: torch.Tensor
    cls: torch.Tensor
    complete: bool
    floor: torch.Tensor | None = None

    @classmethod
    def of(cls, scores: torch.Tensor, classes: torch.Tensor | None = None, k: int = LEADERS) -> Leaders:
        """The best ``k`` of ``scores`` (n x columns); the columns' classes (default: the columns themselves)."""
        v, c = scores.topk(min(k, scores.shape[1]), dim=1)
        return cls(v, c if classes is None else classes[c], scores.shape[1] <= k)

    @classmethod
    def over(cls, tiles: Iterable[tuple[torch.Tensor, torch.Tensor]], n: int, device: torch.device) -> Leaders:
        """The best :data:`LEADERS` over tiles of scores (n x columns) and their columns' classes (disjoint tiles);
        an empty, complete list where there is no tile."""
        out = None
        for scores, classes in tiles:
            part = cls.of(scores, classes)
            out = part if out is None else out.merge(part)
        if out is None:
            return cls(torch.empty(n, 0, dtype=torch.float64, device=device),
                       torch.empty(n, 0, dtype=torch.int64, device=device), True)
        return out

    def merge(self, other: Leaders, k: int = LEADERS) -> Leaders:
        """The best ``k`` of two lists over disjoint classes (tiles of classes)."""
        v, c = _merge((self.vals, self.cls), (other.vals, other.cls), k)
        return Leaders(v, c, self.complete and other.complete and v.shape[1] == self.vals.shape[1] + other.vals.shape[1])

    def first(self, member: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token, the smallest class of the largest score among the classes of ``member`` (a mask over the class
        ids; None: all), and whether the list decides it; where it does not (a tie at the list's end, no member in
        the list, NaN) the class is :data:`NONE` and the caller decides."""
        n = len(self.vals)
        if self.vals.shape[1] == 0:
            return (torch.full((n,), NONE, dtype=torch.int64, device=self.vals.device),
                    torch.zeros(n, dtype=torch.bool, device=self.vals.device))
        inside = torch.ones_like(self.cls, dtype=torch.bool) if member is None else member[self.cls]
        v = self.vals.masked_fill(~inside, -torch.inf)
        best = v.amax(1)
        pick = torch.where(inside & (v == best[:, None]), self.cls, NONE).amin(1)
        sure = (best > (self.vals[:, -1] if self.floor is None else self.floor)) | (self.complete & (pick != NONE))
        return torch.where(sure, pick, NONE), sure

    def decide(self, rescore: Callable[[torch.Tensor], torch.Tensor | int], member: torch.Tensor | None = None
               ) -> torch.Tensor:
        """:meth:`first`'s class per token, those the list leaves open decided by ``rescore(rows)``."""
        d, sure = self.first(member)
        again = torch.nonzero(~sure).squeeze(1)
        if len(again):
            d[again] = rescore(again)
        return d


class LinearScreen:
    """The linear decision's :class:`Leaders`, argmax_c (z . w_c + b_c) over the classes ``cls`` (ascending), at
    float32 speed on the CPU: a float32 GEMM screen whose error is within E(z) = (1.02 d + 4) u (||z|| R + O) +
    (d + 1) 2^-100, R = max_c ||w_c||, O = max_c |b_c| (the bound above, the offsets o_c = b_c unshifted), each token's
    :data:`LEADERS` best screened classes scored again in float64, and every other class at most the list's last
    screened score plus E(z) (the leaders' floor). ``w``, ``b``: the float64 head (vocab x d, vocab or None), read in
    place, its float32 rows made a tile at a time per call (no state beyond the head: their conversion is a few percent
    of the GEMM); ``budget``: (token, class) cells screened at a time."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, cls: torch.Tensor, budget: int = 1 << 25):
        d = w.shape[1]
        self.w, self.b, self.cls = w, b, cls
        self.tile = max(1, budget // max(1, d))
        self.R = self.O = top = 0.0
        for s in range(0, len(cls), self.tile):
            rows = w[cls[s:s + self.tile]]
            self.R = max(self.R, float(torch.linalg.vector_norm(rows, dim=1).max()))
            top = max(top, float(rows.abs().max()))
            if b is not None:
                self.O = max(self.O, float(b[cls[s:s + self.tile]].abs().max()))
        self.coef = bound_coef(d, top, self.O)

    def bound(self, z: torch.Tensor) -> torch.Tensor:
        """E(z) per token (inf where it does not hold)."""
        return error_bound(z, self.coef, self.R, self.O)

    def leaders(self, z: torch.Tensor) -> Leaders:
        """Each row of ``z`` (n x d, float64)'s best classes, their float64 scores exact, the floor the screen's."""
        lead = Leaders.over(self._screened(z), len(z), z.device)
        e = self.bound(z)
        exact = torch.empty(lead.cls.shape, dtype=torch.float64, device=z.device)
        step = max(1, CACHE // max(1, lead.cls.shape[1] * z.shape[1]))
        for s in range(0, len(z), step):  # a cache's worth of (token, leader, width) cells at a time
            c = lead.cls[s:s + step]
            exact[s:s + step] = (self.w[c] * z[s:s + step, None, :]).sum(-1)
        if self.b is not None:
            exact += self.b[lead.cls]
        floor = lead.vals[:, -1].double() + e if lead.vals.shape[1] else e
        return Leaders(exact, lead.cls, lead.complete, floor)

    def _screened(self, z: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The float32 scores of ``z``'s rows at the classes, a cache's worth of classes at a time, with those classes."""
        z32, step = z.float(), cache_step(len(z), self.tile, z.device)
        for s in range(0, len(self.cls), step):
            c = self.cls[s:s + step]
            with ieee_float32():
                sc = z32 @ self.w[c].float().T
            if self.b is not None:
                sc += self.b[c].float()
            yield sc, c


class Screen:
    """argmax_{c in S} (x . mu_c - ||mu_c||^2 / 2) for each set S of ``sets``, a chunk of tokens at a time
    (:meth:`argmax`); the tokens screened and rechecked are counted (``screened``, ``rechecked``: tokens x sets).

    Parameters
    ----------
    means : mu (vocab x d), float64, read in place (on the CPU the sets' classes are copied, shifted, to float32).
    sets : each set's classes (ascending class ids).
    budget : (token, class) cells formed at a time.
    hold : hold the float32 rows (default: on the CPU), else make them per call (CUDA's way, testable on the CPU).
    shift : g (d), default the sets' means averaged (any g gives the same decisions; it tightens the bound).
    """

    def __init__(self, means: torch.Tensor, sets: Sequence[torch.Tensor], budget: int = 1 << 25,
                 hold: bool | None = None, shift: torch.Tensor | None = None):
        self.means, d, dev = means, means.shape[1], means.device
        self.member = torch.zeros(len(sets), means.shape[0], dtype=torch.bool, device=dev)
        for j, s in enumerate(sets):
            self.member[j, s] = True
        depth = self.member.sum(0)  # the union's classes, those in the most sets first (nested sets: prefixes)
        self.union = torch.sort(depth, descending=True, stable=True).indices[:int((depth > 0).sum())]
        self.size = [len(s) for s in sets]
        if not all(bool(self.member[j][self.union[:k]].all()) for j, k in enumerate(self.size)):
            raise ValueError("Screen: the class sets must be nested")
        self.tile = max(1, min(len(self.union), budget // max(1, d)))
        self.half_sq = torch.zeros(means.shape[0], dtype=torch.float64, device=dev)  # today's ||mu_c||^2 / 2
        if shift is None:
            shift = torch.zeros(d, dtype=torch.float64, device=dev)
            for _, m in self._tiles():
                shift += m.sum(0)
            shift /= max(1, len(self.union))
        self.shift, keep = shift, (dev.type == "cpu" if hold is None else hold)
        o, r32, top = [torch.zeros(0, dtype=torch.float64, device=dev)], [torch.zeros(0, d, device=dev)], 0.0
        for s, m in self._tiles():  # the shifted rows, their offsets and (held) float32 copy, a tile at a time
            self.half_sq[self.union[s:s + len(m)]] = 0.5 * (m * m).sum(1)
            r = m - self.shift
            o.append(-0.5 * (r * r).sum(1))
            top = max(top, float(r.abs().max()))
            if keep:
                r32.append(r.float())
        o = torch.cat(o)
        self.o32, self.O = o.float(), (float(o.abs().max()) if len(o) else 0.0)
        # the shifted rows in float32 held on the CPU (made again per call they cost more than the GEMM there); on
        # CUDA made per call, a tile at a time (the state stays lean; the copy is fast there)
        self.r32 = torch.cat(r32) if keep and len(self.union) else None
        self.R = (2 * self.O) ** 0.5
        self.coef = bound_coef(d, top, self.O)
        self.chunk = max(1, budget // max(1, min(len(self.union), self.tile)))  # tokens screened at a time
        self.budget = budget
        self.screened = self.rechecked = 0

    def _tiles(self) -> Iterator[tuple[int, torch.Tensor]]:
        for s in range(0, len(self.union), self.tile):
            yield s, self.means[self.union[s:s + self.tile]]

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """E(x) per token of the shifted ``x`` (inf where the bound does not hold: an element beyond :data:`LIMIT`)."""
        return error_bound(x, self.coef, self.R, self.O)

    def scores(self, x32: torch.Tensor) -> torch.Tensor:
        """The screened scores of shifted tokens ``x32`` (float32) at every class of the union (few tokens)."""
        step = cache_step(len(x32), self.tile, x32.device)
        return torch.cat([self._scores(x32, s, step) for s in range(0, len(self.union), step)], 1)

    def _rows32(self, s: int, step: int) -> torch.Tensor:
        """The shifted rows of the union's columns s:s + step, float32."""
        if self.r32 is not None:
            return self.r32[s:s + step]
        return (self.means[self.union[s:s + step]] - self.shift).float()

    def _scores(self, x32: torch.Tensor, s: int, step: int) -> torch.Tensor:
        with ieee_float32():
            return torch.addmm(self.o32[s:s + step], x32, self._rows32(s, step).T)

    def top(self, x32: torch.Tensor, first: int = 2, held: list[torch.Tensor] | None = None
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per set, the best screened scores of each token (n x 2, the first set's n x ``first``; descending, -inf
        where the set has fewer classes) and their columns in the union: one ``topk`` per segment of the union
        between two sets' ends (the sets are prefixes), merged per set. Where one tile holds the union, its scores
        (n x union) are appended to ``held`` (a recheck reads them rather than forming them again)."""
        n, dev, k = len(x32), x32.device, max(2, first)
        ends = sorted(set(self.size))
        seg = {e: (torch.full((n, 0), -torch.inf, device=dev), torch.zeros(n, 0, dtype=torch.int64, device=dev))
               for e in ends}
        step = cache_step(n, self.tile, x32.device)
        for s in range(0, len(self.union), step):
            sc = self._scores(x32, s, step)
            if held is not None and sc.shape[1] == len(self.union):
                held.append(sc)
            for lo, hi in zip([0] + ends, ends):
                a, b = max(lo, s), min(hi, s + sc.shape[1])
                if a < b:
                    v, c = sc[:, a - s:b - s].topk(min(k, b - a), dim=1)
                    seg[hi] = _merge(seg[hi], (v, c + a), k)
        out = []
        for j, size in enumerate(self.size):
            best = (torch.full((n, 0), -torch.inf, device=dev), torch.zeros(n, 0, dtype=torch.int64, device=dev))
            for e in ends:
                if e <= size:
                    best = _merge(best, seg[e], k)
            v, c = best
            want = k if j == 0 else 2
            if v.shape[1] < want:  # fewer classes than asked: -inf past them
                pad = want - v.shape[1]
                v = torch.cat([v, torch.full((n, pad), -torch.inf, device=dev)], 1)
                c = torch.cat([c, torch.zeros(n, pad, dtype=torch.int64, device=dev)], 1)
            out.append((v[:, :want], c[:, :want]))
        return out

    def leaders(self, xs: torch.Tensor, first: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first set's ``first`` best screened scores of shifted tokens ``xs`` (float64, n x d): (scores n x
        first, descending, -inf past the set's size; their class ids; E(x) per token), nothing rechecked."""
        if len(self.union) == 0:
            n = len(xs)
            return (torch.full((n, first), -torch.inf, device=xs.device),
                    torch.zeros(n, first, dtype=torch.int64, device=xs.device), self.bound(xs))
        v, c = self.top(xs.float(), first)[0]
        return v, self.union[c], self.bound(xs)

    def argmax(self, x: torch.Tensor, first: int = 0) -> list[torch.Tensor]:
        """Each set's decision for each token of ``x`` (n x d, float64): n class ids per set, in ``sets``' order; -1
        for every token where the sets are empty (no class kept: no token's label is in them, so none counts). With
        ``first`` > 0, three more: the first set's ``first`` best screened scores per token (n x first, float32,
        descending), their class ids and E(x) (:meth:`leaders`'s), for decisions over sets near the first."""
        if len(self.union) == 0:
            none = [torch.full((len(x),), -1, dtype=torch.int64, device=x.device) for _ in self.size]
            return none + (list(self.leaders(x - self.shift, first)) if first else [])
        out = []
        for s in range(0, len(x), self.chunk):
            xc = x[s:s + self.chunk]
            xs = xc - self.shift
            e = self.bound(xs)
            held: list[torch.Tensor] = []
            best = self.top(xs.float(), first, held)
            d = [self.union[c[:, 0]] for _, c in best]
            unclear = torch.stack([~(v[:, 0].double() - v[:, 1].double() > 2 * e) for v, _ in best])
            self.recheck(xc, xs, e, d, unclear, held[0] if held else None)
            out.append(d + ([best[0][0][:, :first], self.union[best[0][1][:, :first]], e] if first else []))
        return [torch.cat(d) for d in zip(*out)]

    def recheck(self, x: torch.Tensor, xs: torch.Tensor, e: torch.Tensor, out: list[torch.Tensor],
                unclear: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        """The float64 decisions of the ``unclear`` (sets x n) tokens into ``out``: per set, its members within
        2 E(x) of the token's best screened score in it (every member where E is inf), scored in float64, the first
        of the largest; ``budget`` // the union's size tokens at a time. ``scores``: the tokens' screened scores
        where the screen kept them (n x union), else they are formed again."""
        again = torch.nonzero(unclear.any(0)).squeeze(1)
        self.screened += int(unclear.numel() - unclear.sum())
        self.rechecked += int(unclear.sum())
        step = max(1, self.budget // max(1, len(self.union)))
        for s in range(0, len(again), step):
            t = again[s:s + step]
            sc = self.scores(xs[t].float()) if scores is None else scores[t]
            for j, d in enumerate(out):
                sub = torch.nonzero(unclear[j, t]).squeeze(1)
                if len(sub):
                    d[t[sub]] = self._exact(x[t[sub]], sc[sub], j, e[t[sub]])

    def _exact(self, x: torch.Tensor, sc: torch.Tensor, j: int, e: torch.Tensor) -> torch.Tensor:
        """Set ``j``'s float64 decision for tokens ``x`` from their screened scores ``sc`` (tokens x union)."""
        return self.rescore(x, sc, self.member[j][self.union], self.union, e, self.means, self.half_sq, self.budget)

    @staticmethod
    def rescore(x: torch.Tensor, sc: torch.Tensor, keep: torch.Tensor, cols: torch.Tensor, e: torch.Tensor, means,
                half_sq: torch.Tensor | None = None, budget: int = 1 << 25) -> torch.Tensor:
        """The float64 decision of each token of ``x`` over the set ``keep`` (a mask of ``cols``' classes) from its
        screened scores ``sc`` (tokens x ``cols``): the members within 2 ``e`` of its best (every member where ``e``
        is inf), scored o_c + x . mu_c with mu_c = ``means[c]`` and o_c = -``half_sq[c]`` (default: -||mu_c||^2 / 2
        of those rows), the first (smallest) class of the largest score."""
        best = sc.masked_fill(~keep, -torch.inf).amax(1).double()
        # the candidates' threshold, lowered past float32's rounding of it (more candidates, never fewer)
        low = (best - 2 * e - best.abs() * 2.0 ** -22).float()
        near = keep & ((sc >= low[:, None]) | torch.isinf(e)[:, None])
        token, col = torch.nonzero(near, as_tuple=True)
        cls = cols[col]
        exact = torch.empty(len(token), dtype=torch.float64, device=x.device)
        step = max(PAIRS, min(budget, CACHE) // max(1, x.shape[1]))
        for s in range(0, len(token), step):  # pairs a cache's worth of (pair, width) cells at a time
            t, c = token[s:s + step], cls[s:s + step]
            m = means[c]
            sq = half_sq[c] if half_sq is not None else 0.5 * (m * m).sum(1)
            exact[s:s + step] = m.mul_(x.index_select(0, t)).sum(1) - sq
        return first_argmax(exact, token, cls, len(x))
