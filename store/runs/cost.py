"""What the training callback costs against the training between two measurements: said once, at the first
measurement that repeats the work (the second: the first also carries the set-up done once, the blocks read or
tokenized and the job resolved, and the first calls' warm-up), with the caps or the interval that keep it within
:data:`OVERHEAD` of the training time.

A measurement's recurring seconds are timed in three parts: its passes' batches, which grow with the tokens read; its
metrics, which grow as the square of the kept classes (the pairwise Gram of the class means); and the rest (the
passes' set-up, the validation state and the loss's check, and the group's attributes and write), the same at any
cap. With both caps scaled by s, the kept classes are
expected to be K(s) = sum over classes c of P(Binomial(n_c, s) >= min_count), n_c the class's train tokens, so

    cost(s) = rest + passes x s + metrics x (K(s) / K(1))^2

and the caps that keep a measurement within a share f of the training between two measurements are the current caps
x s, s solving cost(s) = f x training seconds (where even cost(0), the write, exceeds it, only measuring less often
helps: ``every`` = steps x cost(1) / (f x training seconds)). The caps stay the user's: raising them is a choice the
line makes visible.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.stats import binom

from ncanalyze.core.setting import default

OVERHEAD = 0.10  # the share of training time a measurement should stay within
TRAIN_SHARE = 4  # the default train cap is this many times smaller than the tokens trained between two measurements
VAL_SHARE = 4    # the default validation cap is this many times smaller than the train cap
BUDGET = 0.25    # a share of training a callback may be held to (its max_share; by default none: every step measured)


@dataclass(frozen=True)
class Cost:
    """One measurement against the training before it: ``measured_s`` seconds of recurring work over
    ``train_tokens`` + ``val_tokens`` tokens (``passes_s`` of them in the passes, ``metrics_s`` in the metrics; None:
    all in the passes), against ``trained_s`` seconds of training over ``steps`` steps of ``sequences`` sequences
    (``tokens_trained`` where the Trainer counts them, else None); ``counts`` the classes' train tokens and
    ``min_count`` the tokens a class needs to be kept (for the kept classes at smaller caps); ``setup_s`` the set-up
    done once, before the first measurement, said apart."""
    measured_s: float
    train_tokens: int
    val_tokens: int
    trained_s: float
    steps: int
    sequences: int
    tokens_trained: int | None = None
    passes_s: float | None = None
    metrics_s: float = 0.0
    counts: np.ndarray | None = None
    min_count: int = default("min_count")
    setup_s: float = 0.0

    @property
    def overhead(self) -> float:
        """The measurement's seconds over the training's (inf with no training time)."""
        return self.measured_s / self.trained_s if self.trained_s > 0 else float("inf")

    def seconds_at(self, scale: float) -> float:
        """The expected recurring seconds of a measurement with both caps scaled by ``scale`` (in [0, 1])."""
        if self.passes_s is None:
            return self.measured_s * scale
        rest = max(0.0, self.measured_s - self.passes_s - self.metrics_s)
        return rest + self.passes_s * scale + self.metrics_s * self.kept_share(scale) ** 2

    def kept_share(self, scale: float) -> float:
        """The expected kept classes with both caps scaled by ``scale``, over those kept now (1 without counts)."""
        if self.counts is None:
            return 1.0
        n = np.asarray(self.counts, dtype=np.int64)
        now = int((n >= self.min_count).sum())
        return float(binom.sf(self.min_count - 1, n, scale).sum()) / now if now else 0.0

    def scale(self, share: float = OVERHEAD) -> float | None:
        """The factor on both caps that keeps a measurement within ``share`` of the training time (1: already
        within; None: no cap does, the part that does not shrink with the caps being above it)."""
        target = share * self.trained_s
        if self.seconds_at(1.0) <= target:
            return 1.0
        if self.seconds_at(0.0) >= target:
            return None
        return brentq(lambda s: self.seconds_at(s) - target, 0.0, 1.0, xtol=1e-6)

    def within(self, share: float = OVERHEAD) -> tuple[int, int] | None:
        """(train, validation) tokens that would take ``share`` of the training time, in today's proportion (None:
        no caps would)."""
        s = self.scale(share)
        return None if s is None else (int(self.train_tokens * s), int(self.val_tokens * s))

    def every(self, share: float = OVERHEAD) -> int:
        """The steps between measurements that keep the measurement at today's caps within ``share``."""
        return max(self.steps, math.ceil(self.steps * self.overhead / share)) if self.trained_s > 0 else 0

    def line(self, group: str, share: float = OVERHEAD) -> str:
        """The log line: the cost, what it is against, and the caps or interval that keep it within ``share``."""
        trained = f"{self.sequences:,} sequences" + (f", {self.tokens_trained:,} tokens"
                                                     if self.tokens_trained else "")
        setup = f"; the set-up done once before the first took {self.setup_s:,.1f} s more" if self.setup_s else ""
        said = (f"{group} measured {self.train_tokens:,} train + {self.val_tokens:,} val tokens in "
                f"{self.measured_s:,.1f} s{setup}, against {self.trained_s:,.1f} s of training (its evaluations "
                f"included) over the {self.steps} step(s) before it ({trained}): {self.overhead:.0%} of the training "
                "time at this interval")
        if self.overhead <= share:
            return f"{said}, within {share:.0%}"
        caps, less = self.within(share), f"every={self.every(share):,} (measuring {self.overhead / share:.1f}x less often)"
        advice = (f"max_train_tokens={caps[0]:,}, max_val_tokens={caps[1]:,} (or {less})" if caps else
                  f"{less}: its write alone, the same at any cap, is above it")
        return f"{said}, above {share:.0%}: {advice} would keep it within {share:.0%}; larger caps are yours to choose"


def default_caps(interval: int | None, sequences: int, block_size: int) -> tuple[int, int] | None:
    """The caps a callback given none reads: :data:`TRAIN_SHARE` times fewer train tokens than the training reads
    between two measurements (``interval`` steps of ``sequences`` sequences of ``block_size`` tokens), and
    :data:`VAL_SHARE` times fewer validation tokens than that (a validation token costs the most: the full-vocabulary
    loss and NC4's distances); whole blocks, at least one each; None where the interval is unknown (every block is then
    read).

    Why a quarter: reading a token costs about a third of training on it (a forward against a forward and a backward),
    so reading every token trained would cost a third of the training before the validation pass, the metrics and
    the write; a quarter of them keeps a measurement within :data:`BUDGET` on the 60-step run of
    ``benchmarks/training_callback.py --suite`` (its figures in benchmarks/RESULTS.md)."""
    if not interval or interval <= 0:
        return None
    train = max(1, int(interval * sequences) // TRAIN_SHARE)  # in sequences of block_size tokens
    return train * block_size, max(1, train // VAL_SHARE) * block_size


def over_budget(spent: float, next_s: float, trained: float, share: float = BUDGET) -> bool:
    """Whether one more measurement of ``next_s`` seconds, after ``spent`` seconds of measuring, would take the
    callback above ``share`` of the ``trained`` seconds of training so far (a callback given that max_share then skips
    it)."""
    return spent + next_s > share * trained
