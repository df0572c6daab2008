"""--labels (SPEC section 2): the current token and a label file's classes, extracted at float64, equal class_stats +
measure on features captured here with output_hidden_states and labels built here; file classes have no classifier
(NC3, UNC3, NC4 and the head metrics nan, with the note); the default stays the next token, its record unchanged;
shards, a kill and the resume's configuration check carry the setting; bad label files are one line before any
work."""
from __future__ import annotations

import json
import warnings

import ncanalyze.store
import numpy as np
import pytest
import torch
from conftest import assert_same_group, fails_cleanly, kill_when, run_cli
from ncanalyze.analyzer.arrays import class_stats
from ncanalyze.analyzer.metrics import measure
from ncanalyze.analyzer.schema import NO_CLASSIFIER
from ncanalyze.store.extraction.labels import Labels
from test_extract import text_blocks
from transformers import AutoModelForCausalLM, AutoTokenizer

BLOCKS, VAL_BLOCKS = 48, 24
OPTS = ("--dtype", "float64", "--batch-size", 8, "--samples-per-class", 2)


def planted(ids: np.ndarray) -> np.ndarray:
    """Classes 0..4 from each token and its position, a third of the positions left out (-1)."""
    pos = np.arange(ids.size).reshape(ids.shape)
    return np.where((ids + pos) % 3 == 0, -1, (7 * ids + pos) % 5).astype(np.int64)


@pytest.fixture(scope="module")
def data(corpus, tmp_path_factory) -> dict:
    """Token blocks of the corpus (train and validation .npy, 2-D) and a planted label file aligned with the train's."""
    d = tmp_path_factory.mktemp("labels")
    tok = AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))
    train, val = text_blocks(corpus["train"], tok, None)[:BLOCKS], text_blocks(corpus["val"], tok, None)[:VAL_BLOCKS]
    np.save(d / "train.npy", train)
    np.save(d / "val.npy", val)
    np.save(d / "classes.npy", planted(train))
    return {"dir": d, "train": train, "val": val, "marks": planted(train), "file": d / "classes.npy",
            "args": ("--dataset", d / "train.npy", "--val-dataset", d / "val.npy", *OPTS)}


@pytest.fixture(scope="module")
def study(trained_run, data) -> dict:
    """One store: the default (next), --labels current and --labels file:PATH, each under its own --tag."""
    store = data["dir"] / "study.zarr"
    ck = trained_run / "checkpoint-60"
    run_cli("extract", ck, *data["args"], "--store", store)
    run_cli("extract", ck, *data["args"], "--labels", "current", "--tag", "current", "--store", store)
    run_cli("extract", ck, *data["args"], "--labels", f"file:{data['file']}", "--tag", "file", "--store", store)
    tree = ncanalyze.store.open(store)
    run = trained_run.name
    groups = {k: tree[f"{run}{'@' + k if k != 'next' else ''}/checkpoint-60"].to_dataset()
              for k in ("next", "current", "file")}
    return {"store": store, "ck": ck, "groups": groups, "group": f"{run}@file/checkpoint-60"}


def features(ck, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every position's last hidden state (after the final norm) from output_hidden_states, float64, and the head."""
    model = AutoModelForCausalLM.from_pretrained(str(ck), dtype=torch.float64).eval()
    with torch.no_grad():
        hs = model(torch.from_numpy(blocks), output_hidden_states=True).hidden_states[-1]
    return hs.reshape(-1, hs.shape[-1]).numpy(), model.get_output_embeddings().weight.detach().double().numpy()


def reference(H, y, classes, **head) -> tuple:
    """class_stats of the features and labels built here, with the split's counts (no cap: the sample's)."""
    ref = class_stats(H, y, classes, **head)
    return ref.assign(split_count=("vocab", np.bincount(y, minlength=classes)))


def assert_same_stats(ds, ref) -> None:
    np.testing.assert_array_equal(ds["count"].values, ref["count"].values)
    for name in ("mean", "variance", "within_covariance"):
        np.testing.assert_allclose(ds[name].values, ref[name].values, rtol=1e-9, atol=1e-12, err_msg=name)


def assert_same_metrics(ds, ref) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = measure(ds, se=False), measure(ref, se=False)  # the reference has no folds, so no errors
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12, nan_ok=True), k


def test_each_kind_keeps_the_positions_it_names_with_their_labels():
    ids = np.array([[5, 6, 7], [8, 9, 10]])
    marks = np.array([[-1, 1, 0], [2, -1, -1]])
    nxt, cur, fil = Labels("next").rows(ids, None, 3), Labels("current").rows(ids, None, 3), \
        Labels("file:x.npy", 3).rows(ids, marks, 3)
    assert nxt.y.tolist() == [6, 7, 9, 10] and nxt.pos.tolist() == [9, 10, 12, 13] and nxt.keep is None
    assert cur.y.tolist() == [5, 6, 7, 8, 9, 10] and cur.pos.tolist() == [9, 10, 11, 12, 13, 14]
    assert fil.y.tolist() == [1, 0, 2] and fil.pos.tolist() == [10, 11, 12]
    h = torch.arange(6.0)[:, None].expand(6, 2)
    assert fil.take(h)[:, 0].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.slow
def test_current_token_classes_equal_class_stats_and_measure(study, data):
    ds = study["groups"]["current"]
    H, W = features(study["ck"], data["train"])
    Hv, _ = features(study["ck"], data["val"])
    ref = reference(H, data["train"].ravel(), W.shape[0], classifier=W, val_embeddings=Hv,
                    val_labels=data["val"].ravel())
    assert int(ds["count"].sum()) == data["train"].size  # every position, the last of each block included
    assert_same_stats(ds, ref)
    for name in ("val_count", "val_correct", "val_ncc_agree"):
        np.testing.assert_array_equal(ds[name].values, ref[name].values, err_msg=name)
    assert_same_metrics(ds, ref)
    assert ds.attrs["labels"] == "current" and np.isfinite(measure(ds)["nc4_agreement"])
    assert ds.attrs["val_loss"] == pytest.approx(study["groups"]["next"].attrs["val_loss"], rel=1e-12)  # the model's


@pytest.mark.slow
def test_file_classes_equal_class_stats_and_leave_the_head_metrics_nan_with_a_note(study, data):
    ds = study["groups"]["file"]
    H, _ = features(study["ck"], data["train"])
    marks = data["marks"].ravel()
    keep = marks >= 0
    ref = reference(H[keep], marks[keep], 5)
    assert ds.sizes["vocab"] == 5 and "classifier" not in ds.variables and "val_count" not in ds
    assert "token" not in ds.coords  # classes, not tokens
    assert_same_stats(ds, ref)
    assert_same_metrics(ds, ref)
    with pytest.warns(UserWarning, match=NO_CLASSIFIER):
        got = measure(ds)
    for k in ("nc3_cos_mean", "unc3_cos_cv", "nc3_dual_error", "nc4_agreement"):
        assert np.isnan(got[k]), k
    assert np.isfinite(got["nc1_cdnv"]) and np.isfinite(got["nc2_etf_error"])
    assert ds.attrs["labels"] == f"file:{data['file']}"
    assert ds.attrs["val_loss"] == pytest.approx(study["groups"]["next"].attrs["val_loss"], rel=1e-12)


@pytest.mark.slow
def test_rows_carry_the_labels_and_the_default_record_is_unchanged(study):
    from ncanalyze.store.measure import measure_store

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = measure_store(study["store"]).table
    assert sorted(table["labels"]) == sorted(["next", "current", f"file:{study['groups']['file'].attrs['labels'][5:]}"])
    # the class axis (its dimension keeps the fixed name vocab) named for what it holds: a file's classes, else tokens
    axis = dict(zip(table["labels"].str[:4], table["class_axis"]))
    assert axis == {"next": "tokens", "curr": "tokens", "file": "file classes 0..4 of classes.npy"}
    assert study["groups"]["file"].attrs["class_axis"] == "file classes 0..4 of classes.npy"
    assert all("class_axis" not in study["groups"][k].attrs for k in ("next", "current"))
    default = study["groups"]["next"]
    assert "labels" not in default.attrs and "labels" not in json.loads(default.attrs["config"])
    assert default.sizes["vocab"] == study["groups"]["current"].sizes["vocab"]
    record = json.loads(study["groups"]["file"].attrs["config"])
    assert record["labels"] == "file:classes.npy" and len(record["labels_sha256"]) == 16


@pytest.mark.slow
def test_shards_and_a_kill_carry_the_label_file(study, data, tmp_path):
    sharded = tmp_path / "sharded.zarr"
    args = ["extract", study["ck"], *data["args"], "--labels", f"file:{data['file']}", "--tag", "file"]
    run_cli(*args, "--store", sharded, "--shards", 3)
    a, b = ncanalyze.store.open(sharded)[study["group"]].to_dataset(), study["groups"]["file"]
    np.testing.assert_array_equal(a["count"].values, b["count"].values)
    for name in ("mean", "variance", "within_covariance"):
        np.testing.assert_allclose(a[name].values, b[name].values, rtol=0, atol=1e-12, err_msg=name)
    killed = tmp_path / "killed.zarr"
    state = killed.with_name(killed.name + ".partial") / f"{study['ck'].parent.name}@file" / "checkpoint-60.npz"
    for phase in (0, 1):  # killed in the train pass, then in the validation pass (which counts no NC4 decisions)
        kill_when([*args[:-2], "--batch-size", 1, "--state-every", 0, "--tag", "file", "--store", killed], state,
                  batches=10, at={"phase": phase})
    r = run_cli(*args[:-2], "--labels", "current", "--batch-size", 1, "--state-every", 0, "--tag", "file", "--store",
                killed, ok=False)
    assert "another configuration" in r.output and "labels" in r.output
    r = run_cli(*args[:-2], "--batch-size", 1, "--state-every", 0, "--tag", "file", "--store", killed)
    assert "1 resumed" in r.output
    whole = tmp_path / "whole.zarr"
    run_cli(*args[:-2], "--batch-size", 1, "--tag", "file", "--store", whole)
    assert_same_group(whole, killed, study["group"])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["float", "shape", "below", "text", "missing"])
def test_a_bad_label_file_is_one_line_before_any_work(case, kept_store, trained_run, corpus, data, tmp_path):
    bad = tmp_path / "bad.npy"
    marks, dataset = data["marks"], data["dir"] / "train.npy"
    words = {"float": ["float64", "integers"], "shape": ["shape", "(48, 31)", "(48, 32)"], "below": ["-2", "below -1"],
             "text": ["is text", "--dataset"], "missing": ["names no file", "--labels"]}[case]
    if case == "float":
        np.save(bad, marks.astype(np.float64))
    elif case == "shape":
        np.save(bad, marks[:, :-1])
    elif case == "below":
        np.save(bad, np.where(marks == 4, -2, marks))
    else:
        np.save(bad, marks)
    if case == "text":
        dataset = corpus["train"]
    spec = f"file:{tmp_path / 'none.npy'}" if case == "missing" else f"file:{bad}"
    fails_cleanly(["extract", trained_run / "checkpoint-20", "--dataset", dataset, "--labels", spec], kept_store, words)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["current", "file"])
def test_the_callback_takes_the_labels_and_equals_extract(kind, trained_run, corpus, data, tmp_path):
    """The stock Trainer trains the fixture's last checkpoint 2 more steps with the callback under ``labels``: its
    group equals ``ncanalyze extract`` of the checkpoint saved at that step, under the same labels."""
    from conftest import train_sweep
    from ncanalyze.training import NeuralCollapseCallback
    from transformers import Trainer, TrainingArguments, default_data_collator

    labels = "current" if kind == "current" else f"file:{data['file']}"
    tok = AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))
    lm = train_sweep.lm_datasets([corpus["train"]], [corpus["val"]], tok, 32)
    opts = {"batch_size": 8, "samples_per_class": 2, "labels": labels, "max_train_tokens": 1024, "max_val_tokens": 512}
    cb = NeuralCollapseCallback(tmp_path / "live.zarr", str(data["dir"] / "train.npy"), str(data["dir"] / "val.npy"),
                                **opts)
    args = TrainingArguments(output_dir=str(tmp_path / "neo"), per_device_train_batch_size=8, max_steps=2,
                             eval_strategy="steps", eval_steps=2, save_steps=2, seed=0, report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(str(trained_run / "checkpoint-60"))
    Trainer(model=model, args=args, train_dataset=lm["train"], eval_dataset=lm["validation"].select(range(8)),
            data_collator=default_data_collator, processing_class=tok, callbacks=[cb]).train()
    run_cli("extract", tmp_path / "neo" / "checkpoint-2", *data["args"][:4], "--batch-size", 8, "--samples-per-class",
            2, "--labels", labels, "--max-train-tokens", 1024, "--max-val-tokens", 512, "--store", tmp_path / "ckpt.zarr")
    a = ncanalyze.store.open(tmp_path / "live.zarr")["neo/step-2"].to_dataset()
    b = ncanalyze.store.open(tmp_path / "ckpt.zarr")["neo/checkpoint-2"].to_dataset()
    assert a.attrs["labels"] == b.attrs["labels"] == labels and a.sizes["vocab"] == b.sizes["vocab"]
    np.testing.assert_array_equal(a["count"].values, b["count"].values)
    for name in ("mean", "variance", "within_covariance"):
        np.testing.assert_allclose(a[name].values, b[name].values, rtol=0, atol=1e-12, err_msg=name)
    assert a.attrs["val_loss"] == pytest.approx(b.attrs["val_loss"], abs=1e-12)
    assert ("val_count" in a) == ("val_count" in b) == (kind == "current")


@pytest.mark.slow
def test_a_capped_read_takes_each_blocks_own_classes(study, data, tmp_path):
    """Under a spread cap the label file is read block for block with the token ids: the counts are those of the
    planted classes of the blocks the cap draws (spread_picks, seed 0), and a prefix cap's those of the first."""
    from ncanalyze.store.data.blocks import spread_picks

    for mode, picks in (("spread", spread_picks(BLOCKS, 16, 0)), ("prefix", np.arange(16))):
        store = tmp_path / f"{mode}.zarr"
        run_cli("extract", study["ck"], *data["args"], "--labels", f"file:{data['file']}", "--max-train-tokens", 512,
                "--cap-mode", mode, "--store", store)
        ds = ncanalyze.store.open(store)[f"{study['ck'].parent.name}/checkpoint-60"].to_dataset()
        marks = data["marks"][picks].ravel()
        np.testing.assert_array_equal(ds["count"].values, np.bincount(marks[marks >= 0], minlength=5), err_msg=mode)
        assert not np.array_equal(picks, np.arange(16)) or mode == "prefix"


@pytest.mark.slow
def test_the_split_counts_of_text_are_counted_per_label_kind(trained_run, corpus, tmp_path):
    """Text under a spread cap: the whole split's counts (split_count, cached beside the token cache) are each kind's
    own, the next tokens' and the current tokens' kept apart, both counted from the cached ids here."""
    store = tmp_path / "s.zarr"
    args = ("extract", trained_run / "checkpoint-60", "--dataset", corpus["train"], "--max-train-tokens", 1024,
            "--max-val-tokens", 512, "--store", store)
    run_cli(*args)
    run_cli(*args, "--labels", "current", "--tag", "current")
    tokens = store.parent / f"{store.name}.tokens"
    (cache,) = {c.name.split(".")[0] for c in tokens.glob("*.current.counts")}  # the train split's, counted apart
    cache = tokens / f"{cache}.npy"  # the whole train split, tokenized once
    ids = np.load(cache)
    tree = ncanalyze.store.open(store)
    nxt, cur = (tree[f"{trained_run.name}{t}/checkpoint-60"].to_dataset() for t in ("", "@current"))
    V = nxt.sizes["vocab"]
    np.testing.assert_array_equal(nxt["split_count"].values, np.bincount(ids[:, 1:].ravel(), minlength=V))
    np.testing.assert_array_equal(cur["split_count"].values, np.bincount(ids.ravel(), minlength=V))
