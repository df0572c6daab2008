"""The callback's cost line: its arithmetic on planted times and tokens (the real line is checked in
test_training.py's run)."""
from __future__ import annotations

import pytest
from ncanalyze.store.runs.cost import Cost


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
    assert line.endswith("max_train_tokens=200,000, max_val_tokens=40,000 (or measuring 5.0x less often) would keep "
                         "it within 10%; larger caps are yours to choose, knowing this")


def test_no_training_time_is_infinite_overhead():
    c = Cost(1.0, 100, 0, 0.0, 0, 0)
    assert c.overhead == float("inf") and c.within() == (0, 0)
