"""The store trusted with hostile names and folders (issue 37, the fourth sweep): names from any source checked and
shown escaped, links in the store and in its work folders never followed, a nested store or a copied run never read
as the outer store's groups, data identified by content, a store on a bind mount. Real stores from the conftest's
Trainer run, real links, a real bind mount."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import EXTRACT_OPTS, run_cli
from ncanalyze.core.errors import UserError
from ncanalyze.core.names import check_name, name_problem, shown

RUN = "neo-2x32"
SMALL = ("--max-train-tokens", 1024, "--max-val-tokens", 512, "--samples-per-class", 1)


def ls(store: Path) -> dict[str, str]:
    """``ncanalyze ls --json``: group -> status."""
    return {c["group"]: c["status"] for c in json.loads(run_cli("ls", store, "--json").output)["checkpoints"]}


def one_error(r) -> str:
    errors = [line for line in r.output.splitlines() if "Error:" in line]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    return errors[0]


@pytest.fixture
def store(extracted_store, tmp_path) -> Path:
    """A private copy of ``extracted_store`` (checkpoint-20/40/60 of ``neo-2x32``)."""
    shutil.copytree(extracted_store, tmp_path / "s.zarr")
    return tmp_path / "s.zarr"


# ---------------------------------------------------------------- 7, 14, 16: names checked wherever they come from

@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "a\\b", "x\x1b]0;t\x07", ".hidden", "a\u202eb"])
def test_a_name_that_is_not_one_plain_folder_is_refused_in_one_line(name):
    assert name_problem(name)
    with pytest.raises(UserError) as e:
        check_name(name, "the run name", "pass a plain name")
    assert not {"\n", "\x1b", "\u202e"} & set(str(e.value)) and "pass a plain name" in str(e.value)
    for fine in ("neo-2x32", "neo@kjv", "step-10", "a.b", "é-ü"):
        assert name_problem(fine) is None
    assert name_problem("a\u202eb", controls=False) is None  # read from the store's folders: shown escaped


def test_the_callbacks_run_name_dotdot_stays_inside_the_store(corpus, tmp_path, caplog):
    """7: ``run_name=".."`` would stage ``<store>.partial/../step-10.zarr``, beside the store, and delete it after: a
    user's folder of that name. Refused in one log line; nothing beside the store touched; training goes on."""
    from ncanalyze.store.runs.callback import run_name
    from ncanalyze.training import NeuralCollapseCallback
    from test_training import OPTS, said

    for bad in ("..", "a\\b", "run\x1b[2J"):
        with pytest.raises(UserError, match="the run name"):
            run_name(SimpleNamespace(run_name=bad, output_dir=str(tmp_path / "out")))
    mine = tmp_path / "step-10.zarr"
    (mine / "x").mkdir(parents=True)
    (mine / "x" / "data").write_text("the user's")
    cb = NeuralCollapseCallback(tmp_path / "s.zarr", str(corpus["train"]), str(corpus["val"]), **OPTS)
    state = SimpleNamespace(global_step=10, epoch=0.1, is_world_process_zero=True, log_history=[])
    with said(caplog) as lines:
        cb.on_evaluate(SimpleNamespace(output_dir=str(tmp_path / "out"), run_name="..", fsdp=None, deepspeed=None),
                       state, None, metrics={"eval_loss": 1.0})
    assert len(lines) == 1 and "'..'" in lines[0] and "run_name" in lines[0], lines
    assert (mine / "x" / "data").read_text() == "the user's" and not (tmp_path / "s.zarr").exists()


def test_a_backslash_in_a_run_folder_is_refused_before_any_work(trained_run, corpus, tmp_path):
    """14: zarr reads ``\\`` as a separator, so ``a\\b/checkpoint-20`` became the groups ``a/b/...``: refused up
    front, in one line naming the folder, nothing written."""
    run = tmp_path / "a\\b"
    shutil.copytree(trained_run / "checkpoint-20", run / "checkpoint-20")
    shutil.copytree(trained_run / "checkpoint-40", run / "checkpoint-40")
    r = run_cli("extract", run, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", *SMALL, ok=False)
    assert "path separator" in one_error(r) and "rename the folder" in r.output
    assert not (tmp_path / "s.zarr").exists() and not (tmp_path / "s.zarr.partial").exists()


def test_a_stray_dotdot_npz_in_the_work_folder_names_no_checkpoint(store):
    """16: ``<store>.partial/<run>/...npz`` read as the checkpoint ``..`` (the store's root): ls listed it, rm
    offered it. Names read from disk are checked: it is no checkpoint."""
    partial = store.with_name(store.name + ".partial") / RUN
    partial.mkdir(parents=True)
    (partial / "...npz").write_bytes(b"junk")
    (partial / ".npz").write_bytes(b"junk")
    assert sorted(ls(store)) == [f"{RUN}/checkpoint-{s}" for s in (20, 40, 60)]
    r = run_cli("rm", store, f"{RUN}/..", "--yes", ok=False)
    assert "nothing in" in one_error(r)
    assert all((store / RUN / f"checkpoint-{s}" / "zarr.json").is_file() for s in (20, 40, 60))


# ---------------------------------------------------------------- 21, 23: names shown escaped, as given

@pytest.mark.slow
def test_terminal_escapes_and_bidi_controls_are_shown_escaped(store):
    """21: a run folder named with an OSC sequence (sets the terminal's title) and U+202E (reverses what follows):
    ls prints them escaped, in the table and in --json; rm's lines and measure's table too."""
    name = "neo\x1b]0;owned\x07\u202ekcatta"
    os.rename(store / RUN, store / name)
    assert shown(name) == "neo\\x1b]0;owned\\x07\\u202ekcatta"
    for args in (("ls", store), ("ls", store, "--json"), ("rm", store, name, "--dry-run", "--yes"),
                 ("measure", store, "--no-se")):
        out = run_cli(*args).output
        assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out, out
        assert "\\x1b]0;owned\\x07" in out or "\\u001b]0;owned\\u0007" in out, out
    assert shown("plain-name_1.2") == "plain-name_1.2" and shown("a\u2028b\x00") == "a\\u2028b\\x00"


def test_rm_reports_a_name_as_given(store):
    """23: ``rm S /etc`` said ``'etc'``, ``rm S /`` said ``''``."""
    assert "'/etc'" in one_error(run_cli("rm", store, "/etc", "--yes", ok=False))
    assert "'/'" in one_error(run_cli("rm", store, "/", "--yes", ok=False))


# ---------------------------------------------------------------- 2, 13: a nested store, a copied run

def test_a_nested_store_is_named_and_not_read_as_groups(store, extracted_store):
    """13, 2: a store copied into the store: its groups (``inner.zarr/<run>/<checkpoint>``, three levels) were
    read as checkpoints of the outer one. Named once, by ls and by the store's listing of groups, and left out."""
    from ncanalyze.store import io

    shutil.copytree(extracted_store, store / "inner.zarr")
    status = ls(store)
    assert status["inner.zarr/-"].startswith("a store nested in this store") and "move it out" in status["inner.zarr/-"]
    good, bad = io.checkpoint_groups(store)
    assert good == [f"{RUN}/checkpoint-{s}" for s in (20, 40, 60)] and list(bad) == ["inner.zarr"]


@pytest.mark.slow
def test_a_nested_store_and_a_copied_run_are_not_counted_twice(store, extracted_store):
    """13: a store copied into the store crashed measure (``too many values to unpack``); 2: its groups and those
    of a run copied inside the store were read as the original run's rows, each step twice. A nested store is
    named (ls, measure) and left out; a copied run is its own rows, said to be the same model measured twice."""
    from ncanalyze.store.measure import SameModel, SkippedCheckpoint, measure_store

    shutil.copytree(extracted_store, store / "inner.zarr")
    shutil.copytree(store / RUN, store / "copy")
    status = ls(store)
    assert [g for g in status if g != "inner.zarr/-"] == [f"{r}/checkpoint-{s}" for r in ("copy", RUN)
                                                          for s in (20, 40, 60)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = measure_store(store)
    assert list(result.failed) == ["inner.zarr"] and "nested" in result.failed["inner.zarr"]
    table = result.table
    assert len(table) == 6 and sorted(set(table.run)) == ["copy", RUN]  # by path: each run's steps once
    assert all(sorted(table[table.run == r].global_step) == [20, 40, 60] for r in ("copy", RUN))
    said = [str(w.message) for w in caught if w.category is SameModel]
    assert len(said) == 3 and all("same model, data and settings as copy/" in m for m in said), said
    assert any(w.category is SkippedCheckpoint and "inner.zarr" in str(w.message) for w in caught)


# ---------------------------------------------------------------- 8, 9, 15: links never followed

def test_a_linked_run_is_shown_as_linked_and_rm_removes_the_link_only(store, tmp_path):
    """9: rm of a run folder that is a symbolic link deleted the groups of its target; ls said "incomplete"."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(store / RUN, elsewhere)
    before = sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*"))
    os.symlink(elsewhere, store / "linked")
    os.symlink(elsewhere / "checkpoint-20", store / RUN / "checkpoint-99")
    status = ls(store)
    assert status["linked/-"].startswith("linked: a symbolic link to") and "link only" in status["linked/-"]
    assert status[f"{RUN}/checkpoint-99"].startswith("linked:")
    run_cli("rm", store, "linked", f"{RUN}/checkpoint-99", "--yes")
    assert not (store / "linked").is_symlink() and not (store / RUN / "checkpoint-99").is_symlink()
    assert sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*")) == before
    assert sorted(ls(store)) == [f"{RUN}/checkpoint-{s}" for s in (20, 40, 60)]


def test_links_in_the_work_folders_are_refused_and_never_followed(store, tmp_path):
    """8: ``<store>.partial/<run>`` linked elsewhere: the staged and old groups were made and deleted inside the
    target; a linked lock file was truncated. Refused in one line; the targets untouched."""
    target = tmp_path / "target"
    (target / "checkpoint-20.zarr").mkdir(parents=True)
    (target / "checkpoint-20.zarr" / "keep").write_text("mine")
    partial = store.with_name(store.name + ".partial")
    partial.mkdir()
    os.symlink(target, partial / RUN)
    error = one_error(run_cli("rm", store, f"{RUN}/checkpoint-20", "--yes", ok=False))
    assert "symbolic link" in error and "remove the link" in error
    assert (target / "checkpoint-20.zarr" / "keep").read_text() == "mine"
    assert (store / RUN / "checkpoint-20" / "zarr.json").is_file()
    (partial / RUN).unlink()
    (partial / RUN).mkdir()
    (tmp_path / "notes.txt").write_text("my notes")
    os.symlink(tmp_path / "notes.txt", partial / RUN / "checkpoint-20.lock")
    assert "symbolic link" in one_error(run_cli("rm", store, f"{RUN}/checkpoint-20", "--yes", ok=False))
    assert (tmp_path / "notes.txt").read_text() == "my notes"
    shutil.rmtree(partial)
    os.symlink(target, partial)  # the work folder itself
    assert "symbolic link" in one_error(run_cli("rm", store, f"{RUN}/checkpoint-20", "--yes", ok=False))
    assert (target / "checkpoint-20.zarr" / "keep").read_text() == "mine"


@pytest.mark.parametrize("how", ["dangling", "loop"])
def test_a_store_path_that_is_a_broken_link_is_refused_up_front(trained_run, corpus, tmp_path, how):
    """15: ``--store`` a dangling link or a link loop: a traceback after both passes, with --overwrite too."""
    store = tmp_path / "s.zarr"
    os.symlink(tmp_path / "nowhere" if how == "dangling" else store, store)
    for more in ((), ("--overwrite",)):
        r = run_cli("extract", trained_run / "checkpoint-20", "--dataset", corpus["train"], "--store", store,
                    *SMALL, *more, ok=False)
        assert "symbolic link" in one_error(r) and "does not lead to a folder" in r.output
    assert store.is_symlink() and not (tmp_path / "nowhere").exists()


# ---------------------------------------------------------------- 4: data identified by content

def test_the_record_identifies_data_by_content_not_by_path(tmp_path, monkeypatch):
    import torch
    from ncanalyze.store.extraction.config import config_hash, config_record, layer_plan
    from ncanalyze.store.extraction.settings import ExtractConfig

    (tmp_path / "d").mkdir()
    data = tmp_path / "d" / "train.txt"
    data.write_text("one text\n")
    monkeypatch.chdir(tmp_path)

    def hashed(spec: str) -> str:
        cfg = ExtractConfig(dataset=spec)
        return config_hash(config_record(None, cfg, torch.device("cpu"), 32, None, None, layer_plan(cfg, 2),
                                         weights="w"))

    same = {hashed(s) for s in ("d/train.txt", str(data), "./d/../d/train.txt")}
    assert len(same) == 1
    data.write_text("another text\n")  # edited in place, same path, same size class
    assert hashed("d/train.txt") not in same
    assert hashed("org/hub-set") != hashed("org/other-set")  # a Hub dataset: its id


@pytest.mark.slow
def test_an_edited_dataset_is_not_skipped_and_the_same_file_by_absolute_path_is(trained_run, corpus, tmp_path,
                                                                                  monkeypatch):
    """4: the configuration hash covered the --dataset string: other text under the same path was skipped as
    "already in store", the same file by its absolute path refused as another configuration."""
    (tmp_path / "data").mkdir()
    shutil.copy(corpus["train"], tmp_path / "data" / "train.txt")
    shutil.copy(corpus["val"], tmp_path / "data" / "validation.txt")
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "s.zarr"
    ckpt = trained_run / "checkpoint-20"
    run_cli("extract", ckpt, "--dataset", "data/train.txt", "--store", store, *SMALL)
    r = run_cli("extract", ckpt, "--dataset", tmp_path / "data" / "train.txt", "--store", store, *SMALL)
    assert "already" in r.output.lower() or "skip" in r.output.lower(), r.output
    text = (tmp_path / "data" / "train.txt").read_text()
    (tmp_path / "data" / "train.txt").write_text(text.replace("the", "a"))  # edited in place
    error = one_error(run_cli("extract", ckpt, "--dataset", "data/train.txt", "--store", store, *SMALL, ok=False))
    assert "data_sha256" in error, error


# ---------------------------------------------------------------- 11: a store on a bind mount

@pytest.mark.slow
def test_a_store_on_a_bind_mount_is_written_and_removed(trained_run, corpus, tmp_path):
    """11: a container volume at the store's path (a bind mount: the same device, another mount) died with EXDEV on
    the rename after all the work. The mount table names it: staged inside the store."""
    volume, store = tmp_path / "volume", tmp_path / "s.zarr"
    volume.mkdir()
    store.mkdir()
    if subprocess.run(["mount", "--bind", str(volume), str(store)], capture_output=True).returncode:
        pytest.skip("a bind mount needs root")
    try:
        assert store.stat().st_dev == tmp_path.stat().st_dev  # the same device: only the mount table tells
        args = ("extract", trained_run / "checkpoint-20", "--dataset", corpus["train"], *SMALL, "--store", store)
        run_cli(*args)
        run_cli(*args, "--overwrite")
        group = f"{trained_run.name}/checkpoint-20"
        assert ls(store) == {group: "ok"} and not (store / ".ncanalyze.partial").exists()
        assert (volume / group / "zarr.json").is_file()
        run_cli("rm", store, group, "--yes")
        assert ls(store) == {}
    finally:
        subprocess.run(["umount", "-l", str(store)])


def test_a_nested_store_is_not_read_as_groups_by_open(store, extracted_store):
    """2: ``ncanalyze.store.open`` of a store holding another: the inner store's groups are not the outer's."""
    import ncanalyze.store

    shutil.copytree(extracted_store, store / "inner.zarr")
    with pytest.warns(UserWarning, match="inner.zarr: a store nested in"):
        tree = ncanalyze.store.open(store)
    assert list(tree.children) == [RUN] and sum("mean" in n.data_vars for n in tree.subtree) == 3


def test_the_checkpoints_a_measure_warning_names_are_shown_escaped():
    """A warning that measure gathers over checkpoints ('3 checkpoints: a, b, c') names them escaped, as every other
    line does (a debiased-CDNV caveat once printed a run's terminal escape raw)."""
    from ncanalyze.store.measure import _some
    text = _some(["neo\x1b]0;owned\x07\u202ekcatta/checkpoint-20", "ok/checkpoint-1"])
    assert "\x1b" not in text and "\u202e" not in text and "\\x1b" in text and "\\u202e" in text
