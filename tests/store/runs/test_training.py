"""NeuralCollapseCallback (SPEC 2b): the store groups it writes while the stock Trainer trains a tiny GPT-Neo equal
``ncanalyze extract`` of the checkpoints saved at the same steps, its metrics reach the Trainer's logs, and training
is bit-identical with and without it."""
from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, train_sweep

STEPS, EVERY = 20, 10
# the one caveat these tiny budgets (a few thousand train tokens) rightly get: the debiased CDNV's fixed class set
# (a share of 2^-12 of the split's labels, 8 expected tokens at 32k) holds classes the sample saw fewer than twice
TINY_BUDGET = "warning: UserWarning: nc1_cdnv_debiased: "
OPTS = {"max_train_tokens": 2048, "max_val_tokens": 1024, "batch_size": 4, "samples_per_class": 2}
CLI_OPTS = ("--max-train-tokens", 2048, "--max-val-tokens", 1024, "--batch-size", 4, "--samples-per-class", 2)


@contextlib.contextmanager
def said(caplog):
    """The callback's log lines within the block (the CLI's handler may have stopped the ``ncanalyze`` logger propagating)."""
    logger = logging.getLogger("ncanalyze")
    logger.addHandler(caplog.handler)
    lines: list[str] = []
    start = len(caplog.records)  # the lines of this block only
    try:
        with caplog.at_level(logging.INFO, logger="ncanalyze"):
            yield lines
    finally:
        logger.removeHandler(caplog.handler)
        once = {id(r): r for r in caplog.records[start:]}.values()  # a record reaches the handler twice where it propagates
        lines += [r.getMessage() for r in once if r.name == "ncanalyze.store.runs.callback"]


def train(corpus, out: Path, callbacks=(), steps: int = STEPS, give_trainer: bool = False, width: int = 32, **args):
    """A tiny GPT-Neo (2 layers of ``width``) trained by the stock Trainer as tests/conftest.py's run is, evaluated and
    saved every ``EVERY`` steps (``args`` override the TrainingArguments), with the tokenizer as its processing class;
    returns the trainer."""
    from transformers import (
        AutoTokenizer,
        GPTNeoForCausalLM,
        Trainer,
        TrainingArguments,
        default_data_collator,
        set_seed,
    )

    set_seed(0)
    tok = AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))
    data = train_sweep.lm_datasets([corpus["train"]], [corpus["val"]], tok, 32)
    model = GPTNeoForCausalLM(train_sweep.neo_config(len(tok), 2, width, 4, 32))
    targs = TrainingArguments(**{**dict(
        output_dir=str(out), per_device_train_batch_size=8, per_device_eval_batch_size=8, max_steps=steps,
        learning_rate=3e-3, eval_strategy="steps", eval_steps=EVERY, save_strategy="steps", save_steps=EVERY,
        logging_steps=EVERY, seed=0, report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True), **args})
    trainer = Trainer(model=model, args=targs, train_dataset=data["train"],
                      eval_dataset=data["validation"].select(range(16)), data_collator=default_data_collator,
                      processing_class=tok)
    for cb in callbacks:
        if give_trainer:
            cb.trainer = trainer
        trainer.add_callback(cb)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def measured(corpus, tmp_path_factory):
    """A run trained with the callback (store ``live.zarr``) and its saved checkpoints extracted (``ckpt.zarr``)."""
    from ncanalyze.training import NeuralCollapseCallback

    d = tmp_path_factory.mktemp("training")
    cb = NeuralCollapseCallback(d / "live.zarr", str(corpus["train"]), str(corpus["val"]), **OPTS)
    trainer = train(corpus, d / "neo", [cb])
    run_cli("extract", d / "neo", "--dataset", corpus["train"], "--val-dataset", corpus["val"], "--store",
            d / "ckpt.zarr", *CLI_OPTS)
    return {"dir": d, "live": d / "live.zarr", "ckpt": d / "ckpt.zarr", "trainer": trainer, "cb": cb}


@pytest.mark.slow
def test_each_evaluation_equals_extract_of_the_checkpoint_saved_then(measured):
    import ncanalyze.store

    live, ckpt = ncanalyze.store.open(measured["live"]), ncanalyze.store.open(measured["ckpt"])
    assert sorted(live["neo"].children) == ["step-10", "step-20"]
    for step in (10, 20):
        a, b = live[f"neo/step-{step}"].to_dataset(), ckpt[f"neo/checkpoint-{step}"].to_dataset()
        assert set(b.data_vars) <= set(a.data_vars)  # and the per-class metrics, measured as it wrote
        for name in ("count", "val_count", "val_correct", "val_ncc_agree", "n_samples", "sample_position",
                     "fold_count", "fold_val_count", "fold_val_ncc_agree"):
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
        for name in ("mean", "variance", "within_covariance", "classifier", "samples", "fold_mean", "fold_scatter"):
            np.testing.assert_allclose(a[name].values, b[name].values, rtol=0, atol=1e-12, err_msg=name)
        assert a.attrs["global_step"] == step and a.attrs["epoch"] == b.attrs["epoch"]
        assert a.attrs["eval_loss"] == b.attrs["eval_loss"]  # that evaluation's, as trainer_state.json logged it
        assert a.attrs["val_loss"] == pytest.approx(b.attrs["val_loss"], abs=1e-12)
        assert a.attrs["train_tokens"] == b.attrs["train_tokens"] > 0 and a.attrs["val_tokens"] == b.attrs["val_tokens"]
        assert a["count"].values.sum() == 2048 - 2048 // 32  # every position but each block's last


@pytest.mark.slow
def test_the_metrics_are_in_the_trainers_logs_and_measure_reads_the_groups(measured):
    import ncanalyze.store
    from ncanalyze.analyzer.metrics import measure

    history = measured["trainer"].state.log_history
    for step in (10, 20):
        logged = [e for e in history if e.get("step") == step and "nc/nc1_cdnv" in e]
        assert len(logged) == 1, history
        ds = ncanalyze.store.open(measured["ckpt"])[f"neo/checkpoint-{step}"].to_dataset()
        expected = measure(ds, se=False)  # the same metrics from the checkpoint's extraction (the live ones have no errors)
        for k, v in expected.items():
            assert logged[0][f"nc/{k}"] == pytest.approx(v, rel=1e-9, abs=1e-12, nan_ok=True), k
        assert logged[0]["nc/val_loss"] == pytest.approx(ds.attrs["val_loss"], abs=1e-12)
    run_cli("measure", "--store", measured["ckpt"])
    live, ckpt = ncanalyze.store.open(measured["live"]), ncanalyze.store.open(measured["ckpt"])
    table = live.nc.table()  # the live store was measured as it was written, without the errors (F + 1 times the work)
    assert sorted(table["checkpoint"]) == ["step-10", "step-20"] and table["nc1_cdnv"].notna().all()
    for step in (10, 20):
        a, b = live[f"neo/step-{step}"], ckpt[f"neo/checkpoint-{step}"]
        assert {k for k in b.attrs["metrics"] if not k.endswith("_se")} == a.attrs["metrics"].keys()
        assert "metrics_se_method" not in a.attrs and "metrics_se_method" in b.attrs
        for k, v in a.attrs["metrics"].items():
            assert v == pytest.approx(b.attrs["metrics"][k], rel=1e-9, abs=1e-12), k
    store = shutil.copytree(measured["live"], measured["dir"] / "live-measured.zarr")
    assert "measured 2 of 2 checkpoints" in run_cli("measure", "--store", store).output  # the errors from the folds
    live = ncanalyze.store.open(store)
    for step in (10, 20):
        a, b = live[f"neo/step-{step}"], ckpt[f"neo/checkpoint-{step}"]
        assert a.attrs["metrics"].keys() == b.attrs["metrics"].keys()
        assert a.attrs["metrics_se_method"] == b.attrs["metrics_se_method"]
        for k, v in b.attrs["metrics"].items():
            assert a.attrs["metrics"][k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
        for name in (n for n in b.to_dataset().data_vars if n.startswith("class_")):
            np.testing.assert_allclose(a[name].values, b[name].values, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.slow
def test_measure_on_the_callbacks_store_says_nothing_is_wrong(measured, tmp_path):
    """Issue 51: ``measure`` on a store of callback groups printed four warnings and "4 left out" though nothing was
    wrong (the groups are measured where they were written)."""
    import shutil

    store = shutil.copytree(measured["live"], tmp_path / "live.zarr")
    for force in ((), ("--force",)):
        out = run_cli("measure", store, *force).output
        rest = "\n".join(line for line in out.splitlines() if not line.startswith(TINY_BUDGET))
        assert "warning" not in rest.lower() and "left out" not in rest and "skipped" not in rest, out
    assert "measured 2 of 2 checkpoints" in out, out


@pytest.mark.slow
def test_a_measurement_leaves_the_model_and_every_generator_as_it_was(measured, corpus, tmp_path):
    """Planted: train mode, dropout on, every RNG advanced to a known state; after a measurement all are the same."""
    from ncanalyze.training import NeuralCollapseCallback

    trainer = measured["trainer"]
    cb = NeuralCollapseCallback(tmp_path / "p.zarr", str(corpus["train"]), str(corpus["val"]), **OPTS)
    model = trainer.model
    model.train()
    model.transformer.h[0].eval()  # a mixed state, restored module by module
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())
    modes = [m.training for m in model.modules()]
    grads = [p.grad for p in model.parameters()]
    assert cb._ready(model, trainer.processing_class, "planted/step-1")
    cb.write(model, "planted/step-1", {"global_step": 1, "epoch": 0.0, "eval_loss": None})
    assert [m.training for m in model.modules()] == modes
    assert random.getstate() == before[0]
    np.testing.assert_array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


@pytest.mark.slow
def test_training_with_the_callback_is_bit_identical(measured, corpus, tmp_path):
    """The final weights with the callback (the fixture's run) equal those of the same training without it."""
    plain = train(corpus, tmp_path / "neo")
    a, b = measured["trainer"].model.state_dict(), plain.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_vocabulary_mismatch_is_one_line_and_training_goes_on(corpus, tmp_path, caplog):
    from ncanalyze.training import NeuralCollapseCallback

    tokens = tmp_path / "big.npy"
    np.save(tokens, np.arange(4096, dtype=np.int64) % 5000)  # ids past the 300-token vocabulary
    cb = NeuralCollapseCallback(tmp_path / "s.zarr", str(tokens), str(tokens), **OPTS)
    with said(caplog) as lines:
        trainer = train(corpus, tmp_path / "neo", [cb], steps=EVERY)
    assert trainer.state.global_step == EVERY
    assert len(lines) == 1 and "outside the model's vocabulary" in lines[0] and "training goes on" in lines[0], lines


@pytest.mark.slow
def test_a_run_under_other_settings_is_refused_and_kept(measured, corpus, tmp_path, caplog):
    """The store holds run ``neo`` at max_train_tokens 2048; the same run name at 1024 is refused and the store's
    groups stay as they were."""
    import ncanalyze.store

    from ncanalyze.training import NeuralCollapseCallback

    before = ncanalyze.store.open(measured["live"]).to_dict()
    cb = NeuralCollapseCallback(measured["live"], str(corpus["train"]), str(corpus["val"]),
                                **{**OPTS, "max_train_tokens": 1024})
    with said(caplog) as lines:
        trainer = train(corpus, tmp_path / "neo", [cb], steps=EVERY)
    assert trainer.state.global_step == EVERY
    assert len(lines) == 1 and "run_name" in lines[0] and "max_train_tokens: 2048 -> 1024" in lines[0], lines
    after = ncanalyze.store.open(measured["live"]).to_dict()
    assert list(after) == list(before)
    for g, node in before.items():
        assert node.identical(after[g]), g


def test_importing_the_module_is_light(tmp_path):
    code = ("import sys, ncanalyze.training; heavy = {'torch', 'transformers', 'xarray', 'zarr'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


class Recorder:
    """An integration's view (TensorBoard, W&B...): every dict the Trainer's ``on_log`` hands the callbacks."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Recorder(TrainerCallback):
            def __init__(self):
                self.logs = []

            def on_log(self, args, state, control, logs=None, **kwargs):
                self.logs.append((state.global_step, dict(logs)))
        return _Recorder()


@pytest.mark.slow
def test_every_n_steps_through_the_trainers_log_and_the_time_is_said(corpus, tmp_path, caplog):
    """``every=5`` with evaluations every 10: groups at 5, 10, 15, 20, the ones at evaluations with their eval_loss;
    ``layers="all"``: the layers below the last equal extract --layers all of the saved checkpoint; with the Trainer
    given, the metrics of every layer reach the integrations' ``on_log``; one line per measurement gives its time."""
    import ncanalyze.store

    from ncanalyze.training import NeuralCollapseCallback

    rec = Recorder()
    small = ("--max-train-tokens", 512, "--max-val-tokens", 256, "--batch-size", 4, "--samples-per-class", 2)
    cb = NeuralCollapseCallback(tmp_path / "s.zarr", str(corpus["train"]), str(corpus["val"]), every=5, layers="all",
                                **{**OPTS, "max_train_tokens": 512, "max_val_tokens": 256})
    before = torch.get_num_threads()
    with said(caplog) as lines:
        trainer = train(corpus, tmp_path / "neo", [rec, cb], give_trainer=True)
    assert torch.get_num_threads() == before  # the measurements' thread policy put training's count back
    tree = ncanalyze.store.open(tmp_path / "s.zarr")
    assert list(tree["neo"].children) == ["step-5", "step-10", "step-15", "step-20"]
    run_cli("extract", tmp_path / "neo", "--dataset", corpus["train"], "--val-dataset", corpus["val"], "--store",
            tmp_path / "ckpt.zarr", "--layers", "all", *small)
    ckpt = ncanalyze.store.open(tmp_path / "ckpt.zarr")
    for l in (0, 1):  # the layers below the last, equal to the checkpoint's
        a, b = tree[f"neo/step-10/layers/{l}"], ckpt[f"neo/checkpoint-10/layers/{l}"]
        np.testing.assert_array_equal(a["count"].values, b["count"].values)
        np.testing.assert_array_equal(a["val_ncc_agree"].values, b["val_ncc_agree"].values)
        for name in ("mean", "variance", "within_covariance"):
            np.testing.assert_allclose(a[name].values, b[name].values, rtol=0, atol=1e-12, err_msg=name)
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    for step in (5, 10, 15, 20):
        assert tree[f"neo/step-{step}"].attrs["eval_loss"] == evals.get(step), step
    seen = {step for step, logs in rec.logs if {"nc/nc1_cdnv", "nc/val_loss", "nc/layer_0/nc1_cdnv",
                                                 "nc/layer_1/nc4_agreement"} <= set(logs)}
    assert seen == {5, 10, 15, 20}, rec.logs
    timed = [line for line in lines if "measured in" in line]
    assert len(timed) == 4 and all(" s" in line for line in timed), lines
    (costs,) = [line for line in lines if "of the training time at this interval" in line]  # said once, the second
    c, blocks = cb.cost, cb.setup.train
    assert (c.measured_s, c.steps, c.train_tokens) == (cb.seconds[1], 5, blocks.total * blocks.block_size)
    assert c.sequences == 5 * trainer.args.train_batch_size * trainer.args.gradient_accumulation_steps
    assert costs.startswith(f"ncanalyze: neo/step-10 measured {c.train_tokens:,} train + {c.val_tokens:,} val tokens "
                            f"in {c.measured_s:,.1f} s; the set-up done once before the first took "
                            f"{c.setup_s:,.1f} s more, against {c.trained_s:,.1f} s of training"), costs
    for force in ((), ("--force",)):  # issue 51: four warnings and "4 left out" though nothing was wrong
        out = run_cli("measure", tmp_path / "s.zarr", *force).output
        rest = "\n".join(line for line in out.splitlines() if not line.startswith(TINY_BUDGET))
        assert "warning" not in rest.lower() and "left out" not in rest and "skipped" not in rest, out
    assert f": {c.measured_s / c.trained_s:.0%} of the training time" in costs


@pytest.mark.slow
def test_the_cost_counts_the_work_that_recurs_and_the_default_caps(corpus, tmp_path, caplog):
    """Text data (tokenized once, at the first measurement) and no caps: the caps are a quarter of the tokens trained
    between two measurements (5 steps x 8 sequences x 32 tokens with every=5, 10 steps' at evaluations every 10
    steps) and a quarter of that, recorded as a cap given so; the set-up
    (the job resolved, the text tokenized) lies outside every measurement's counted work; the cost, said at the
    second measurement, counts that one's work alone against the training between the first's end and its start;
    its parts lie within it, and its class counts are the stored ones."""
    import ncanalyze.store
    from ncanalyze.store.runs.cost import BUDGET, over_budget

    from ncanalyze.training import NeuralCollapseCallback

    class Watched(NeuralCollapseCallback):
        resolves = 0

        def _resolve(self, *a):
            self.resolves += 1
            self.resolving = time.perf_counter()
            try:
                return super()._resolve(*a)
            finally:
                self.resolved = time.perf_counter()

    settings = {"batch_size": 4, "samples_per_class": 2, "block_size": 32}
    cb = Watched(tmp_path / "s.zarr", str(corpus["train"]), str(corpus["val"]), every=5, **settings)
    at_evaluations = NeuralCollapseCallback(tmp_path / "e.zarr", str(corpus["train"]), str(corpus["val"]),
                                            max_share=BUDGET, **settings)
    assert not NeuralCollapseCallback(tmp_path / "d.zarr", str(corpus["train"]), **settings).budgeted  # the default
    with said(caplog) as lines:
        trainer = train(corpus, tmp_path / "neo", [cb, at_evaluations])
    assert (cb.cfg.max_train_tokens, cb.cfg.max_val_tokens) == (10 * 32, 2 * 32)  # 40 sequences: 10 and 2
    caps = (at_evaluations.cfg.max_train_tokens, at_evaluations.cfg.max_val_tokens)
    assert caps == (EVERY * 8 // 4 * 32, EVERY * 8 // 16 * 32)  # evaluations every 10 steps
    tree = ncanalyze.store.open(tmp_path / "s.zarr")
    group = tree["neo/step-10"]
    config = json.loads(group.attrs["config"])
    assert (config["max_train_tokens"], config["max_val_tokens"]) == (320, 64)
    assert group.attrs["train_tokens"] <= 320
    first, second = cb.spans[:2]
    assert first[0] <= cb.resolving < cb.resolved <= first[1]  # the set-up before the first's counted work
    assert cb.resolves == 1 and len(cb.spans) == 4  # resolved once: no set-up in the later measurements
    assert cb.setup_s == first[1] - first[0] and cb.seconds[0] == first[2] - first[1]
    c = cb.cost
    assert c.measured_s == cb.seconds[1] == second[2] - second[1]
    assert c.trained_s == second[1] - first[2] and c.steps == 5
    assert 0 < c.passes_s and 0 < c.metrics_s and c.passes_s + c.metrics_s <= c.measured_s
    np.testing.assert_array_equal(c.counts, group["count"].values)
    costs = [line for line in lines if "of the training time at this interval" in line]
    assert costs[0].startswith("ncanalyze: neo/step-10 measured 320 train + 64 val tokens"), costs
    # given max_share, a step is measured only while the time spent measuring stays within it: each decision
    # follows from the numbers it was made on, and every evaluation is either a group or a skip (by default none is)
    measured = [int(g.removeprefix("step-")) for g in ncanalyze.store.open(tmp_path / "e.zarr")["neo"].children]
    assert not cb.skips and cb.budgeted is False  # no max_share: every step measured
    assert at_evaluations.budgeted and sorted(measured + [k[0] for k in at_evaluations.skips]) == [10, 20]
    assert all(over_budget(*k[1:]) for k in at_evaluations.skips)
    assert not any(over_budget(*k[1:]) for k in at_evaluations.checks if k[2] > 0)
    assert [k[0] for k in at_evaluations.checks] == measured[1:]  # the first is always measured
    assert trainer.state.global_step == STEPS



@pytest.mark.slow
def test_the_advice_holds_for_the_measurements_that_follow_it(corpus, tmp_path):
    """The caps advised at the second measurement, from the work that recurs, cost what the advice predicted (10% of
    the training between the first two measurements) within 1.5x: the measurements of a training under them after
    its first (which carries the one-off work), their median. Training and callback on one thread each, so that a
    load from others slows both alike."""
    from ncanalyze.training import NeuralCollapseCallback

    settings = {"batch_size": 8, "samples_per_class": 2, "block_size": 32, "threads": 1}
    first = NeuralCollapseCallback(tmp_path / "a.zarr", str(corpus["train"]), str(corpus["val"]), every=160,
                                   max_train_tokens=32768, max_val_tokens=8192, **settings)
    long = {"per_device_train_batch_size": 64, "save_strategy": "no", "eval_strategy": "no"}  # 10,240 sequences a
    before = torch.get_num_threads()  # measurement: the training a larger model would take between two
    torch.set_num_threads(1)
    try:
        train(corpus, tmp_path / "a", [first], steps=320, **long)
        cost = first.cost
        caps = cost.within()
        assert caps is not None and caps < (32768, 8192), cost.line("a")  # caps advised, smaller
        second = NeuralCollapseCallback(tmp_path / "b.zarr", str(corpus["train"]), str(corpus["val"]), every=10,
                                        max_train_tokens=caps[0], max_val_tokens=caps[1], **settings)
        train(corpus, tmp_path / "b", [second], steps=50, save_strategy="no", eval_strategy="no")
    finally:
        torch.set_num_threads(before)
    predicted, took = cost.seconds_at(cost.scale()), float(np.median(second.seconds[1:]))
    assert predicted == pytest.approx(0.1 * cost.trained_s, rel=1e-3)
    assert 1 / 1.5 <= took / predicted <= 1.5, (took, predicted, cost.line("a"))

@pytest.mark.slow
def test_a_full_disk_is_one_line_training_goes_on_and_the_store_is_kept(corpus, tmp_path, caplog):
    import os

    import ncanalyze.store
    from conftest import tmpfs

    from ncanalyze.training import NeuralCollapseCallback

    small = {**OPTS, "max_train_tokens": 512, "max_val_tokens": 256}
    with tmpfs(tmp_path / "disk", "size=4m") as disk:
        store = disk / "s.zarr"
        train(corpus, tmp_path / "neo", [NeuralCollapseCallback(store, str(corpus["train"]), str(corpus["val"]),
                                                                **small)], steps=EVERY)
        before = ncanalyze.store.open(store).to_dict()
        free = os.statvfs(disk)
        (disk / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 4096))
        cb = NeuralCollapseCallback(store, str(corpus["train"]), str(corpus["val"]), **small)
        with said(caplog) as lines:
            trainer = train(corpus, tmp_path / "neo2", [cb])
        assert trainer.state.global_step == STEPS
        full = [line for line in lines if "free space" in line]
        assert len(full) == 2 and "training goes on" in full[0], lines  # each step tried, neither lost the store
        after = ncanalyze.store.open(store).to_dict()
        assert list(after) == list(before)
        for g, node in before.items():
            assert node.identical(after[g]), g


def test_sharded_parameters_are_refused_in_one_line(corpus, tmp_path, caplog):
    from types import SimpleNamespace

    from ncanalyze.training import NeuralCollapseCallback

    cb = NeuralCollapseCallback(tmp_path / "s.zarr", str(corpus["train"]), str(corpus["val"]), **OPTS)
    state = SimpleNamespace(global_step=10, epoch=0.1, is_world_process_zero=True, log_history=[])
    with said(caplog) as lines:
        for how in ({"fsdp": "full_shard", "deepspeed": None}, {"fsdp": None, "deepspeed": "ds.json"}):
            cb.off = None
            cb.done.clear()
            cb.on_evaluate(SimpleNamespace(output_dir=str(tmp_path / "neo"), run_name=None, **how), state, None,
                           metrics={"eval_loss": 1.0})
    assert len(lines) == 2 and "FSDP" in lines[0] and "DeepSpeed" in lines[1], lines
    assert all("ncanalyze extract" in line for line in lines) and not (tmp_path / "s.zarr").exists()


DDP_SCRIPT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/../.."]  # this folder and tests/ (conftest)
from conftest import train_sweep
from test_training import OPTS, train
from ncanalyze.training import NeuralCollapseCallback
corpus = {"train": sys.argv[2], "val": sys.argv[3], "tokenizer": sys.argv[4]}
cb = NeuralCollapseCallback(sys.argv[6], corpus["train"], corpus["val"], **{**OPTS, "batch_size": 3})
train(corpus, sys.argv[5], [cb], ddp_backend="gloo")
"""


@pytest.mark.slow
def test_ddp_ranks_share_the_blocks_and_equal_one_process(corpus, tmp_path):
    """torchrun, 2 processes on CPU (gloo): the groups written equal ``ncanalyze extract`` (one process) of the
    checkpoints the DDP run saved at the same steps, to 1e-12 (batch size 3: the ranks' shares are uneven)."""
    import ncanalyze.store

    script = tmp_path / "ddp_train.py"
    script.write_text(DDP_SCRIPT)
    tests = Path(__file__).resolve().parent
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          "29533", str(script), str(tests), str(corpus["train"]), str(corpus["val"]),
                          str(corpus["tokenizer"]), str(tmp_path / "neo"), str(tmp_path / "live.zarr")],
                         capture_output=True, text=True, timeout=600, cwd=tests)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "neo/step-10 [0:11] train" in run.stderr and "neo/step-10 [11:22] train" in run.stderr  # both shares
    run_cli("extract", tmp_path / "neo", "--dataset", corpus["train"], "--val-dataset", corpus["val"], "--store",
            tmp_path / "ckpt.zarr", *CLI_OPTS[:4], "--batch-size", 3, "--samples-per-class", 2)
    live, ckpt = ncanalyze.store.open(tmp_path / "live.zarr"), ncanalyze.store.open(tmp_path / "ckpt.zarr")
    assert list(live["neo"].children) == ["step-10", "step-20"]
    for step in (10, 20):
        a, b = live[f"neo/step-{step}"].to_dataset(), ckpt[f"neo/checkpoint-{step}"].to_dataset()
        for name in ("count", "val_count", "val_correct", "val_ncc_agree", "n_samples", "sample_position",
                     "fold_count", "fold_val_count", "fold_val_ncc_agree"):
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
        for name in ("mean", "variance", "within_covariance", "classifier", "samples", "fold_mean", "fold_scatter"):
            np.testing.assert_allclose(a[name].values, b[name].values, rtol=0, atol=1e-12, err_msg=name)
        assert a.attrs["val_loss"] == pytest.approx(b.attrs["val_loss"], abs=1e-12)


def test_bad_settings_are_one_line_before_training(corpus, tmp_path):
    from ncanalyze.core.errors import UserError

    from ncanalyze.training import NeuralCollapseCallback

    with pytest.raises(UserError, match="takes no setting batchsize: the settings are .*batch_size"):
        NeuralCollapseCallback(tmp_path / "s.zarr", str(corpus["train"]), batchsize=4)
    with pytest.raises(UserError, match="every=0"):
        NeuralCollapseCallback(tmp_path / "s.zarr", str(corpus["train"]), every=0)
    with pytest.raises(UserError, match="needs train_data"):
        NeuralCollapseCallback(tmp_path / "s.zarr")
    for bad, message in ({"batch_size": 0}, "batch_size (--batch-size) must be between 1 and 65536, got 0"), (
            {"layers": ""}, "layers (--layers) names no layer: pass last, all, or indices like 0,-1, got ''"):
        with pytest.raises(UserError) as e:  # the library's one line, the same as the command's (test_settings.py)
            NeuralCollapseCallback(tmp_path / "s.zarr", str(corpus["train"]), **bad)
        assert str(e.value) == message


def test_the_tokenizer_is_recorded_as_extract_records_it(measured, tmp_path):
    """The Trainer's tokenizer and extract's (the checkpoint's own, the same one): equal tokenizer records, content
    hashes and config hashes once the weights (a checkpoint's own) are set aside, so `ls` finds no setting differing."""
    import json
    import shutil

    import ncanalyze.store
    from ncanalyze.store.extraction.config import config_hash
    from ncanalyze.store.inventory import inventory

    live, ckpt = ncanalyze.store.open(measured["live"]), ncanalyze.store.open(measured["ckpt"])
    a, b = live["neo/step-10"].attrs, ckpt["neo/checkpoint-10"].attrs
    ra, rb = json.loads(a["config"]), json.loads(b["config"])
    assert ra["tokenizer"] is None and rb["tokenizer"] is None  # the model's own tokenizer, both ways
    assert a["tokenizer_sha256"] == b["tokenizer_sha256"] and len(a["tokenizer_sha256"]) == 64
    assert ra["weights"] == "live" and {**ra, "weights": rb["weights"]} == rb
    assert config_hash({**ra, "weights": rb["weights"]}) == b["config_hash"]
    both = tmp_path / "both.zarr"  # one store holding the callback's group and extract's
    shutil.copytree(measured["live"], both)
    shutil.copytree(measured["ckpt"] / "neo" / "checkpoint-10", both / "neo" / "checkpoint-10")
    assert "tokenizer" not in inventory(both)["settings"], inventory(both)["settings"]


@pytest.mark.slow
def test_the_measured_line_shows_once_under_run_clms_logging(corpus, tmp_path):
    """run_clm's set-up: ``logging.basicConfig(format=..., handlers=[StreamHandler(sys.stdout)])`` on the root, left
    at WARNING, in a process where nothing configured the ``ncanalyze`` logger: each measurement's line shows once."""
    import io

    import transformers
    from ncanalyze.store.runs.callback import _OwnHandler
    from ncanalyze.training import NeuralCollapseCallback

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(name)s - %(message)s"))
    root, package, ours = (logging.getLogger(n) for n in ("", "ncanalyze", "ncanalyze.store.runs.callback"))
    saved = (root.level, package.level, package.propagate, list(package.handlers), ours.level, list(ours.handlers))
    try:
        for h in package.handlers + ours.handlers:  # as in a fresh process: the CLI's handler is not there
            h.close(), package.removeHandler(h), ours.removeHandler(h)
        package.setLevel(logging.NOTSET), ours.setLevel(logging.NOTSET)
        package.propagate = True
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
        transformers.utils.logging.set_verbosity_warning()
        cb = NeuralCollapseCallback(tmp_path / "live.zarr", str(corpus["train"]), str(corpus["val"]),
                                    **{**OPTS, "max_train_tokens": 512, "max_val_tokens": 256})
        train(corpus, tmp_path / "neo", [cb])
        assert not any(isinstance(h, _OwnHandler) for h in ours.handlers)  # the root's handler shows it
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0]), package.setLevel(saved[1]), ours.setLevel(saved[4])
        package.propagate = saved[2]
        for h in saved[3]:
            package.addHandler(h)
        for h in ours.handlers:
            ours.removeHandler(h)
        for h in saved[5]:
            ours.addHandler(h)
    timed = [line for line in out.getvalue().splitlines() if "measured in" in line]
    assert len(timed) == 2 and all("INFO - ncanalyze.store.runs.callback - ncanalyze: neo/step-" in line
                                   for line in timed), out.getvalue()


def test_the_callbacks_own_handler_only_for_what_no_handler_on_the_way_shows(capsys):
    import io

    from ncanalyze.store.runs.callback import show_info

    def path(name: str, level: int | None = None):
        """A logger ``name.cb`` whose way up ends at ``name`` (not propagating), with a handler at ``level``."""
        top, child, seen = logging.getLogger(name), logging.getLogger(f"{name}.cb"), io.StringIO()
        top.propagate = False
        if level is not None:
            h = logging.StreamHandler(seen)
            h.setLevel(level)
            top.addHandler(h)
        return child, seen

    nothing, _ = path("nc_none")  # no handler on the way: one of its own, on stderr
    show_info(nothing)
    show_info(nothing)  # a second Trainer adds nothing
    nothing.info("one")
    nothing.warning("two")
    assert capsys.readouterr().err.splitlines() == ["one", "two"]
    high, seen = path("nc_high", logging.WARNING)  # a handler for warnings: ours takes only what it drops
    show_info(high)
    high.info("three")
    high.warning("four")
    assert capsys.readouterr().err.splitlines() == ["three"] and seen.getvalue().splitlines() == ["four"]
    shown, seen = path("nc_shown", logging.NOTSET)  # a handler that shows INFO: nothing added, the line once
    show_info(shown)
    shown.info("five")
    assert not shown.handlers and seen.getvalue().splitlines() == ["five"] and not capsys.readouterr().err
    chosen, seen = path("nc_chosen", logging.NOTSET)
    logging.getLogger("nc_chosen").setLevel(logging.WARNING)  # someone chose what it shows: kept
    show_info(chosen)
    chosen.info("six")
    assert chosen.level == logging.NOTSET and not seen.getvalue()
