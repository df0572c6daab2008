"""A train batch's updates on worker threads (store/extraction/workers.py): each fold's statistics and the reservoir,
run at once, equal numpy's float64 brute force of each fold's tokens, and are bit for bit those of one thread in the
caller, whatever torch's thread count."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from ncanalyze.analyzer.accumulate import fold_of
from ncanalyze.store.extraction.passes import batch_tasks
from ncanalyze.store.extraction.reservoir import position_keys
from ncanalyze.store.extraction.resume import flatten
from ncanalyze.store.extraction.layers import plan
from ncanalyze.store.extraction.running import Extraction
from ncanalyze.store.extraction.workers import Workers

V, D, F, K, SEED = 300, 7, 4, 3, 5  # an odd width: the Gram's two halves of 3 and 4 columns
BLOCKS, WIDTH = 8, 31  # a batch: 8 blocks of 31 kept positions, block i in fold i mod F


def _stream(rng: np.random.Generator, batches: int) -> list[tuple[torch.Tensor, torch.Tensor, np.ndarray]]:
    """Batches of float32 features around a large common offset (the scatter's cancellation) with Zipf labels: hot
    classes, classes alone in their fold of a batch, classes new to a fold and classes it holds already."""
    offset = rng.normal(size=D) * 50
    out = []
    for b in range(batches):
        y = np.minimum(rng.zipf(1.3, BLOCKS * WIDTH) - 1, V - 1)
        h = rng.normal(size=(BLOCKS * WIDTH, D)) * rng.uniform(0.5, 3, size=D) + offset
        pos = ((b * BLOCKS + np.arange(BLOCKS))[:, None] * (WIDTH + 1) + np.arange(WIDTH)).ravel()
        out.append((torch.from_numpy(h).float(), torch.from_numpy(y), pos))
    return out


def _brute(h: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """count, mean, m2, within-class scatter and unit-vector sum of float64 rows, by numpy's two-pass sums."""
    count = np.bincount(y, minlength=V)
    mean = np.zeros((V, D))
    np.add.at(mean, y, h)
    mean[count > 0] /= count[count > 0, None]
    dev = h - mean[y]
    return {"count": count, "mean": mean, "m2": np.bincount(y, (dev * dev).sum(1), minlength=V),
            "scatter": dev.T @ dev, "unit_sum": (h / np.linalg.norm(h, axis=1, keepdims=True)).sum(0)}


def _close(got: torch.Tensor, want: np.ndarray, name: str) -> None:
    if name == "count":
        np.testing.assert_array_equal(got.numpy(), want)
    else:
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12 * np.abs(want).max(), err_msg=name)


@pytest.mark.parametrize("threads", [1, 2])
def test_fold_updates_on_workers_equal_brute_force_and_one_threads_bits(threads):
    """Every fold's statistics and the reservoir, updated by ``batch_tasks`` on ``Workers`` at ``threads`` torch
    threads (2: two workers at once), equal each fold's float64 brute force (counts exactly, sums to 1e-12 of each
    variable's largest value) and the totals made from the folds that of every token; the state is bit for bit the one
    the same updates give run one after another in the caller at one thread."""
    stream = _stream(np.random.default_rng(13), 6)
    serial, spread = (Extraction(plan(), V, D, K, SEED, "cpu", folds=F) for _ in range(2))
    before = torch.get_num_threads()
    try:
        with Workers("cpu") as run:
            for b, (h, y, pos) in enumerate(stream):
                fold = fold_of(b * BLOCKS, BLOCKS, WIDTH, F)
                torch.set_num_threads(1)
                for task in batch_tasks(serial, h[None], y, fold, y.numpy(), pos):
                    task()
                torch.set_num_threads(threads)
                run(batch_tasks(spread, h[None], y, fold, y.numpy(), pos))
    finally:
        torch.set_num_threads(before)
    one, many = flatten(serial.first().state_dict()), flatten(spread.first().state_dict())
    assert one.keys() == many.keys()
    for name, v in one.items():
        np.testing.assert_array_equal(np.asarray(many[name]), np.asarray(v), err_msg=name)  # bit for bit

    h = np.concatenate([h.double().numpy() for h, _, _ in stream])
    y = np.concatenate([y.numpy() for _, y, _ in stream])
    fold = np.concatenate([fold_of(b * BLOCKS, BLOCKS, WIDTH, F).numpy() for b in range(len(stream))])
    state = spread.first()
    singles = 0
    for f, part in enumerate(state.folds.parts):
        want = _brute(h[fold == f], y[fold == f])
        singles += int((want["count"] == 1).sum())
        for name, value in want.items():
            _close(part.state_dict()[name], value, f"fold {f} {name}")
    for name, value in _brute(h, y).items():
        _close(state.stats.state_dict()[name], value, f"totals {name}")
    assert singles > 20 and state.stats.count.max() > 100  # tokens alone in their class and hot classes
    samples = state.reservoir.canonical()
    pos = np.concatenate([p for _, _, p in stream])
    for c in np.flatnonzero(np.bincount(y, minlength=V)):  # the reservoir: each class's first K positions by key
        idx = np.flatnonzero(y == c)
        best = idx[np.argsort(position_keys(pos[idx], SEED))[:K]]
        np.testing.assert_array_equal(samples.position[c, :len(best)], pos[best])
        np.testing.assert_array_equal(samples.samples[c, :len(best)], h[best].astype(np.float32))


def test_an_error_in_one_update_is_raised_after_the_others_ran():
    """A failing update does not leave the batch half done behind the caller's back: the others run, then the error
    is raised to the caller."""
    ran = []

    def fail():
        raise ValueError("planted")

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with Workers("cpu") as run, pytest.raises(ValueError, match="planted"):
            run([fail] + [lambda i=i: ran.append(i) for i in range(5)])
    finally:
        torch.set_num_threads(before)
    assert sorted(ran) == list(range(5))


def test_the_updates_run_in_the_callers_inference_mode():
    """Inference mode is a thread's own: state made under it (as a benchmark makes it) is updated in place on the
    workers as in the caller, and the workers leave it off where the caller has it off."""
    seen = []
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with Workers("cpu") as run:
            with torch.inference_mode():
                state = torch.zeros(3)
                run([lambda: state.add_(1), lambda: seen.append(torch.is_inference_mode_enabled())])
            run([lambda: seen.append(torch.is_inference_mode_enabled())])
    finally:
        torch.set_num_threads(before)
    assert state.tolist() == [1.0, 1.0, 1.0] and seen == [True, False]
