"""What the training callback costs against the training between two measurements: said once, at its first
measurement, with the token budget that keeps it within :data:`OVERHEAD` of the training time.

A measurement's time grows with the tokens it reads (its forward passes and float64 statistics, batch by batch), so
the budget that keeps it within a fraction f of the training between two measurements is

    tokens within f = tokens measured x f x training seconds between measurements / seconds of the measurement

(the write and the model-independent parts make it a little generous: a figure to set ``max_train_tokens`` and
``max_val_tokens`` by, not a promise). The caps stay the user's: raising them is a choice the line makes visible.
"""
from __future__ import annotations

from dataclasses import dataclass

OVERHEAD = 0.10  # the share of training time a measurement should stay within


@dataclass(frozen=True)
class Cost:
    """One measurement against the training before it: ``measured_s`` seconds over ``train_tokens`` +
    ``val_tokens`` tokens, against ``trained_s`` seconds of training over ``steps`` steps of ``sequences``
    sequences (``tokens_trained`` where the Trainer counts them, else None)."""
    measured_s: float
    train_tokens: int
    val_tokens: int
    trained_s: float
    steps: int
    sequences: int
    tokens_trained: int | None = None

    @property
    def overhead(self) -> float:
        """The measurement's seconds over the training's (inf with no training time)."""
        return self.measured_s / self.trained_s if self.trained_s > 0 else float("inf")

    def within(self, share: float = OVERHEAD) -> tuple[int, int]:
        """(train, validation) tokens that would take ``share`` of the training time, in today's proportion."""
        scale = min(1.0, share / self.overhead) if self.overhead > 0 else 1.0
        return int(self.train_tokens * scale), int(self.val_tokens * scale)

    def line(self, group: str, share: float = OVERHEAD) -> str:
        """The log line: the cost, what it is against, and the budget that keeps it within ``share``."""
        trained = f"{self.sequences:,} sequences" + (f", {self.tokens_trained:,} tokens"
                                                     if self.tokens_trained else "")
        said = (f"{group} measured {self.train_tokens:,} train + {self.val_tokens:,} val tokens in "
                f"{self.measured_s:,.1f} s, against {self.trained_s:,.1f} s of training (its evaluations included) "
                f"over the {self.steps} step(s) before it ({trained}): {self.overhead:.0%} of the training time at "
                "this interval")
        if self.overhead <= share:
            return f"{said}, within {share:.0%}"
        train, val = self.within(share)
        return (f"{said}, above {share:.0%}: max_train_tokens={train:,}, max_val_tokens={val:,} (or measuring "
                f"{self.overhead / share:.1f}x less often) would keep it within {share:.0%}; larger caps are yours "
                "to choose, knowing this")


def against(measured_s: float, train, val, began: tuple[float, int], started: float, step: int, args,
            tokens_seen: int | None) -> Cost:
    """The :class:`Cost` of a first measurement at ``step`` that took ``measured_s`` and began at ``started``
    (perf_counter), the training having begun at ``began`` (perf_counter, global step); ``train``, ``val`` the
    blocks measured, ``args`` the TrainingArguments (sequences a step: batch x accumulation x processes)."""
    tokens = [0 if b is None or b.total is None else b.total * b.block_size for b in (train, val)]
    steps = step - began[1]
    sequences = steps * args.train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
    return Cost(measured_s, *tokens, started - began[0], steps, sequences, tokens_seen or None)
