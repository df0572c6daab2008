"""A checkpoint is resolved once into a Job, which every run consumes: one resolution per checkpoint whatever
``--shards``, the Job frozen and picklable, and every site (``--layers``, ``--sites``) taken under ``--shards``."""
from __future__ import annotations

import ast
import dataclasses
import json
import pickle

import pytest
from conftest import ROOT, run_cli

from ncanalyze.core.errors import UserError
from ncanalyze.store.extraction import config
from ncanalyze.store.extraction.job import Jobs, make_job
from ncanalyze.store.extraction.settings import ExtractConfig
from ncanalyze.store.runs.local import check_settings
from ncanalyze.store.sources.discover import discover
from ncanalyze.store.store import Status, Store

OPTS = ("--max-train-tokens", 1024, "--max-val-tokens", 512, "--batch-size", 8, "--samples-per-class", 2)


@pytest.fixture
def resolutions(monkeypatch) -> list[str]:
    """The groups of every resolution made (config.resolve wrapped, not replaced: the extraction is real)."""
    made, real = [], config.resolve

    def counted(ckpt, *args, **kwargs):
        made.append(ckpt.group if ckpt is not None else None)
        return real(ckpt, *args, **kwargs)

    monkeypatch.setattr(config, "resolve", counted)
    return made


@pytest.mark.slow
def test_one_resolution_per_checkpoint_whatever_the_shards(trained_run, corpus, tmp_path, resolutions):
    """``--layers -1 --shards 2`` (refused before as "not the last layer") extracts with one resolution, and its
    record is the one of ``--layers last``: ``--layers LAST --shards 3`` finds it done (one resolution more), and so
    does the default ``--layers last`` without shards."""
    store = tmp_path / "s.zarr"
    ckpt = trained_run / "checkpoint-20"
    out = run_cli("extract", ckpt, "--dataset", corpus["train"], "--store", store, "--layers", "-1", "--shards", 2,
                  *OPTS).output
    assert "1 extracted" in out and resolutions == ["neo-2x32/checkpoint-20"]
    for layers, shards in (("LAST", 3), ("last", 1)):
        out = run_cli("extract", ckpt, "--dataset", corpus["train"], "--store", store, "--layers", layers,
                      "--shards", shards, *OPTS).output
        assert "1 already in" in out, out
    assert resolutions == ["neo-2x32/checkpoint-20"] * 3
    attrs = Store.at(store).attrs("neo-2x32/checkpoint-20")
    assert json.loads(attrs["config"])["layers"] == [2]  # the last of 2 blocks: hidden_states[2]


def test_nothing_but_the_job_resolves():
    """``config.resolve`` is named in production code by its definition and by make_job alone (nothing downstream
    resolves again or builds a record by hand)."""
    users = set()
    for path in [*ROOT.joinpath("store").rglob("*.py"), *ROOT.joinpath("cli").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            named = (isinstance(node, ast.ImportFrom) and any(a.name in ("resolve", "config_record")
                                                              for a in node.names)) or \
                    (isinstance(node, ast.Attribute) and node.attr in ("resolve", "config_record")
                     and isinstance(node.value, ast.Name) and node.value.id == "config")
            if named:
                users.add(path.relative_to(ROOT).as_posix())
    assert users == {"store/extraction/job.py"}


def test_a_job_is_frozen_picklable_and_carries_the_run_control(trained_run, corpus, resolutions):
    ckpt = next(c for c in discover(trained_run) if c.name == "checkpoint-20")
    cfg = ExtractConfig(dataset=str(corpus["train"]), max_train_tokens=1024, max_val_tokens=512)
    jobs = Jobs(cfg, overwrite=True)
    job = jobs(ckpt)
    assert jobs(ckpt) is job and resolutions == [ckpt.group]  # asked twice, resolved once
    assert job.overwrite and not job.restart and job.hash == config.config_hash(job.record)
    back = pickle.loads(pickle.dumps(job))
    assert (back.record, back.hash, back.plan, back.group, back.overwrite) == (job.record, job.hash, job.plan,
                                                                             job.group, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.overwrite = False
    assert not job.resuming().restart and job.with_plan(job.plan).record == job.record
    assert make_job(ckpt, cfg).hash == job.hash  # the run control is not part of the record


def test_the_job_decides_what_to_do_with_a_group(extracted_store, trained_run, corpus):
    """SKIP under the settings it was made with (EXTRACT_OPTS), REFUSE under others, FRESH with overwrite."""
    ckpt = next(c for c in discover(trained_run) if c.name == "checkpoint-20")
    store = Store.at(extracted_store)
    same = ExtractConfig(dataset=str(corpus["train"]), max_train_tokens=8192, max_val_tokens=4096, batch_size=8,
                         samples_per_class=4)
    assert make_job(ckpt, same).status(store) is Status.SKIP
    other = dataclasses.replace(same, seed=1)
    assert make_job(ckpt, other).status(store) is Status.REFUSE
    assert make_job(ckpt, other, overwrite=True).status(store) is Status.FRESH


def test_shards_take_layers_and_sites_but_refuse_saved_embeddings(tmp_path):
    """Every site is split across shards (issue 50); the staged embeddings, a stream of positions, are not."""
    store = Store.at(tmp_path / "s.zarr")
    for spec in ("-1", "LAST", "all"):
        check_settings(ExtractConfig(dataset="d.bin", layers=spec, max_val_tokens=0), store, shards=2)
    check_settings(ExtractConfig(dataset="d.bin", sites="attn:0", max_val_tokens=0), store, shards=2)
    with pytest.raises(UserError, match="--shards splits the statistics, not the stream of --save-embeddings"):
        check_settings(ExtractConfig(dataset="d.bin", save_embeddings=4, max_val_tokens=0), store, shards=2)
