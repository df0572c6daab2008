"""The callback's cost line: its arithmetic on planted times and tokens (the real line is checked in
test_training.py's run)."""
from __future__ import annotations

import numpy as np
import pytest
from ncanalyze.store.runs.cost import BUDGET, Cost, default_caps, over_budget


def test_within_budget_is_said_so():
    c = Cost(measured_s=2.0, train_tokens=8192, val_tokens=2048, trained_s=40.0, steps=20, sequences=160)
    assert c.overhead == pytest.approx(0.05)
    assert c.within() == (8192, 2048)  # already within: never raised
    line = c.line("run/step-20")
    assert line == ("run/step-20 measured 8,192 train + 2,048 val tokens in 2.0 s, against 40.0 s of training (its "
                    "evaluations included) over the 20 step(s) before it (160 sequences): 5% of the training time "
                    "at this interval, within 10%")


def test_above_budget_names_the_caps_that_fit():
    c = Cost(measured_s=30.0, train_tokens=1_000_000, val_tokens=200_000, trained_s=60.0, steps=200,
             sequences=1600, tokens_trained=204_800)
    assert c.overhead == pytest.approx(0.5)
    assert c.within() == (200_000, 40_000)  # a fifth: 10% / 50%
    assert c.within(0.25) == (500_000, 100_000)
    line = c.line("neo/step-200")
    assert "(1,600 sequences, 204,800 tokens): 50% of the training time at this interval, above 10%: " in line
    assert line.endswith("max_train_tokens=200,000, max_val_tokens=40,000 (or every=1,000 (measuring 5.0x less "
                         "often)) would keep it within 10%; larger caps are yours to choose")


def test_no_training_time_is_infinite_overhead():
    c = Cost(1.0, 100, 0, 0.0, 0, 0)
    assert c.overhead == float("inf") and c.within() is None


def _kept(counts: np.ndarray, s: float, min_count: int) -> float:
    """Brute force: the expected classes with >= min_count tokens when each token is kept with chance s."""
    from math import comb

    return sum(sum(comb(int(n), k) * s ** k * (1 - s) ** (int(n) - k) for k in range(min_count, int(n) + 1))
               for n in counts)


@pytest.mark.parametrize("min_count", [1, 3])
def test_caps_keep_the_parts_that_shrink_and_the_write_that_does_not(min_count):
    """A planted measurement of 10 s: 6 s passes (linear in the caps), 3 s metrics (as the kept classes squared),
    1 s write (fixed), against 50 s of training: the advised scale s makes 1 + 6 s + 3 (K(s)/K)^2 = 5 s, K(s) the
    expected kept classes under binomial thinning of the planted counts, computed here by brute force."""
    counts = np.array([0, 1, 2, 3, 5, 8, 13, 21, 34, 55])
    c = Cost(10.0, 100_000, 20_000, 50.0, 20, 160, passes_s=6.0, metrics_s=3.0, counts=counts, min_count=min_count)
    s = c.scale()
    kept_now = int((counts >= min_count).sum())
    assert c.kept_share(s) == pytest.approx(_kept(counts, s, min_count) / kept_now, rel=1e-9)
    assert 1.0 + 6.0 * s + 3.0 * (_kept(counts, s, min_count) / kept_now) ** 2 == pytest.approx(5.0, rel=1e-5)
    assert c.within() == (int(100_000 * s), int(20_000 * s))
    assert s < 4.0 / 9.0  # proportional scaling (0.5 x 10 s of which only 9 shrink) would overshoot


def test_a_write_above_the_share_advises_measuring_less_often():
    """The 6 s that do not shrink with the caps are above 10% of 40 s: no caps help, every= does."""
    c = Cost(8.0, 10_000, 2_000, 40.0, 20, 160, passes_s=1.5, metrics_s=0.5, counts=np.array([4, 4]))
    assert c.within() is None and c.every() == 40  # 20 steps x 20% / 10%
    assert "every=40 (measuring 2.0x less often): its write alone, the same at any cap, is above it" in c.line("r/s")


def test_default_caps_are_a_quarter_of_the_tokens_trained_between_measurements_and_a_quarter_of_that():
    """20 steps x 16 sequences x 128 tokens = 40,960 trained: 10,240 train tokens and 2,560 validation tokens; whole
    blocks (5 x 8 sequences: 10 and 2 of them), at least one each; none where the interval is unknown."""
    assert default_caps(20, 16, 128) == (10_240, 2_560)
    assert default_caps(5, 8, 32) == (320, 64) and default_caps(1, 1, 128) == (128, 128)
    assert default_caps(None, 16, 128) is None and default_caps(0, 16, 128) is None


def test_a_measurement_over_a_max_share_is_skipped():
    """max_share=0.25: 10 s measured and 3 s more due against 50 s trained: 13 > 25% x 50 = 12.5, skipped; 2 s
    more fits (without a max_share nothing is skipped: test_training.py)."""
    assert BUDGET == 0.25
    assert over_budget(10.0, 3.0, 50.0) and not over_budget(10.0, 2.0, 50.0)
