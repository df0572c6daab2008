"""Issue 21, Hub revisions and Ctrl-C under --shards, each with the failure injected for real: a Hugging Face cache
laid out on disk in huggingface_hub's format (test_hub.add_revision), the CLI in a subprocess offline (or online with
no network: HF_ENDPOINT on a closed local port), a blob removed under its symlink, and a real SIGINT."""
from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import ncanalyze.store
import numpy as np
import pytest
from conftest import EXTRACT_OPTS, cli_process, run_cli
from ncanalyze.core.errors import UserError
from ncanalyze.store.sources.hub_fetch import Snapshot
from ncanalyze.store.sources.revisions import MAX_REVISIONS, check_revision, parse_revisions, revision_range
from test_hub import CLI, FILES, REPO, TOKENIZER, add_revision, cli


def files(trained_run: Path, step: int) -> dict[str, Path]:
    return {f: trained_run / f"checkpoint-{step}" / f for f in FILES} | {f: trained_run / f for f in TOKENIZER}


def tree(cache: Path) -> list[tuple[str, bool]]:
    return sorted((str(p.relative_to(cache)), p.is_symlink()) for p in cache.rglob("*"))


def data_args(corpus, store):
    return ("--dataset", corpus["train"], "--val-dataset", corpus["val"], "--store", store, *EXTRACT_OPTS)


@pytest.mark.parametrize("bad", ["", ".", "..", "../x", "a/../b", "./a", "a//b", "/abs", "a\\b", " ", "a\nb"])
def test_revision_strings_that_lead_through_the_cache_are_refused(bad):
    with pytest.raises(UserError, match="is not a branch, tag or commit name") as e:
        parse_revisions([bad])
    assert "\n" not in str(e.value).replace(repr(bad), "")
    assert check_revision("feature/x") == "feature/x"  # a real branch name with a slash is fine


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["", ".", "..", "../step20"])
def test_a_bad_revision_is_one_line_and_the_cache_is_untouched(trained_run, corpus, tmp_path, bad):
    cache = tmp_path / "hub"
    add_revision(cache, REPO, "step20", files(trained_run, 20))
    before = tree(cache)
    r = cli("extract", REPO, "--revision", bad, *data_args(corpus, tmp_path / "s.zarr"), cache=cache,
            home=tmp_path / "home")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "is not a branch, tag or commit name" in r.stderr and "corrupt" not in r.stderr, r.stderr
    assert tree(cache) == before and not (tmp_path / "s.zarr").exists()


def test_ranges_are_lazy_bounded_and_keep_zero_padding(tmp_path):
    t = time.monotonic()
    with pytest.raises(UserError, match=r"names 1,000,000,000,001 revisions, more than"):
        parse_revisions([], ["step0:1000000000000:1"])
    assert time.monotonic() - t < 1.0  # refused before building anything
    gen = revision_range("step0:1000000000000:100000000")  # 10,001 revisions, made one at a time
    assert iter(gen) is gen and next(gen) == "step0" and next(gen) == "step100000000"
    assert len(parse_revisions([], [f"step1:{MAX_REVISIONS}"])) == MAX_REVISIONS
    with pytest.raises(UserError, match="more than"):
        parse_revisions(["main"], [f"step1:{MAX_REVISIONS}"])
    assert parse_revisions([], ["iter_0001000:0003000:1000"]) == ["iter_0001000", "iter_0002000", "iter_0003000"]
    assert parse_revisions([], ["iter_0001000:iter_0001002"]) == ["iter_0001000", "iter_0001001", "iter_0001002"]
    assert parse_revisions([], ["step0:2"]) == ["step0", "step1", "step2"]  # a lone 0 is no padding
    for text in ("", "\n\n", "# only a comment\n"):
        (tmp_path / "r.txt").write_text(text)
        with pytest.raises(UserError, match="names no revision"):
            parse_revisions([], [f"@{tmp_path / 'r.txt'}"])
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(UserError, match="cannot read"):
        parse_revisions([], [f"@{tmp_path / 'bin.txt'}"])


@pytest.mark.slow
def test_revisions_sharing_a_group_are_refused_naming_both(trained_run, corpus, tmp_path):
    cache, store, home = tmp_path / "hub", tmp_path / "s.zarr", tmp_path / "home"
    add_revision(cache, REPO, "feature/x", files(trained_run, 20))
    add_revision(cache, REPO, "feature-x", files(trained_run, 40))
    r = cli("extract", REPO, "--revision", "feature/x", "--revision", "feature-x", *data_args(corpus, store),
            cache=cache, home=home)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "'feature/x' and 'feature-x'" in r.stderr and "--tag" in r.stderr and "--overwrite" not in r.stderr
    assert not store.exists()  # refused before anything was extracted

    assert cli("extract", REPO, "--revision", "feature/x", *data_args(corpus, store), cache=cache,
               home=home).returncode == 0
    before = ncanalyze.store.open(store)["neo-2x32/feature-x"].to_dataset().load()
    for extra in ((), ("--overwrite",)):  # not even --overwrite replaces the other revision's group
        r = cli("extract", REPO, "--revision", "feature-x", *data_args(corpus, store), *extra, cache=cache, home=home)
        assert r.returncode == 1 and "holds test-org/neo-2x32@feature/x" in r.stderr, r.stderr
        assert "--overwrite" not in r.stderr and "Traceback" not in r.stderr
    after = ncanalyze.store.open(store)["neo-2x32/feature-x"].to_dataset().load()
    assert after.identical(before) and after.attrs["hub_revision"] == "feature/x"
    r = cli("extract", REPO, "--revision", "feature-x", "--tag", "dash", *data_args(corpus, store), cache=cache,
            home=home)
    assert r.returncode == 0, r.stderr
    assert ncanalyze.store.open(store)["neo-2x32@dash/feature-x"].to_dataset().attrs["hub_revision"] == "feature-x"


@pytest.mark.slow
def test_a_dangling_weights_symlink_fails_its_revision_alone(trained_run, extracted_store, corpus, tmp_path):
    cache, store = tmp_path / "hub", tmp_path / "s.zarr"
    snaps = {s: add_revision(cache, REPO, f"step{s}", files(trained_run, s)) for s in (20, 40, 60)}
    (snaps[40] / "model.safetensors").resolve().unlink()  # the blob gone, its symlink left
    r = cli("extract", REPO, "--revisions", "step20:60:20", *data_args(corpus, store), cache=cache,
            home=tmp_path / "home")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    line = [x for x in r.stderr.splitlines() if "@step40:" in x][0]
    assert "lacks the file(s) model.safetensors" in line and str(snaps[40]) in line, r.stderr
    assert "2 extracted" in r.stdout and "1 checkpoint(s) or revision(s) failed" in r.stderr
    hub, local = ncanalyze.store.open(store), ncanalyze.store.open(extracted_store)
    assert sorted(hub["neo-2x32"].children) == ["step20", "step60"]
    np.testing.assert_array_equal(hub["neo-2x32/step60"]["mean"].values, local["neo-2x32/checkpoint-60"]["mean"].values)


@pytest.mark.slow
def test_online_without_network_skips_what_the_store_holds(trained_run, corpus, tmp_path):
    cache, store, home = tmp_path / "hub", tmp_path / "s.zarr", tmp_path / "home"
    add_revision(cache, REPO, "step20", files(trained_run, 20))
    assert cli("extract", REPO, "--revision", "step20", *data_args(corpus, store), cache=cache,
               home=home).returncode == 0
    shutil.rmtree(cache)  # as --delete-downloads leaves it: neither the snapshot nor its ref
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_HUB_CACHE": str(cache), "HF_HOME": str(home), "HF_ENDPOINT": "http://127.0.0.1:9",
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    t = time.monotonic()
    r = subprocess.run(CLI + ["extract", REPO, "--revision", "step20", *map(str, data_args(corpus, store))], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "1 already in" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert time.monotonic() - t < 120


def test_deleting_a_snapshot_that_is_gone_says_nothing_was_deleted(trained_run, tmp_path):
    cache = tmp_path / "hub"
    snap = add_revision(cache, REPO, "step20", files(trained_run, 20))
    keep = add_revision(cache, REPO, "step40", files(trained_run, 40))
    assert Snapshot(REPO, "step20", snap, downloaded=True).delete() is True and not snap.exists()
    assert Snapshot(REPO, "step20", snap, downloaded=True).delete() is False
    weights = trained_run / "checkpoint-40" / "model.safetensors"
    assert (keep / "model.safetensors").read_bytes() == weights.read_bytes()


@pytest.mark.slow
def test_ctrl_c_under_shards_stops_at_a_batch_boundary(trained_run, corpus, tmp_path):
    store = tmp_path / "s.zarr"
    args = [trained_run, "--dataset", corpus["train"], "--val-dataset", corpus["val"], "--store", store,
            "--max-train-tokens", 24576, "--max-val-tokens", 256, "--batch-size", 1, "--samples-per-class", 2,
            "--shards", 3]  # 768 batches of one block a checkpoint (of the corpus's ~1,800): ~3 s each, room for 1 s
    proc = cli_process(["extract", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = store / trained_run.name
    while proc.poll() is None and not (first.is_dir() and any(first.iterdir())):
        time.sleep(0.05)  # the first checkpoint written: the next one is in its shards
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=300)[0]
    if proc.returncode == 0:
        pytest.skip("the extraction finished before the interrupt arrived")
    assert proc.returncode == 130 and "Traceback" not in out, out
    assert "interrupted:" in out and "run the same command" in out, out
    assert time.monotonic() - sent < 20  # at its next batch, not after every checkpoint
    done = sorted(ncanalyze.store.open(store)[trained_run.name].children)
    assert 1 <= len(done) < 3, done  # of checkpoint-20, -40, -60
    assert f"{len(done)} already in" in run_cli("extract", *args).output  # the resume, in this process


@pytest.mark.slow
def test_an_empty_snapshot_is_not_called_pickle_only(trained_run, corpus, tmp_path):
    cache = tmp_path / "hub"
    add_revision(cache, REPO, "step20", {f: trained_run / f for f in TOKENIZER}
                 | {"config.json": trained_run / "checkpoint-20" / "config.json"})
    r = cli("extract", REPO, "--revision", "step20", *data_args(corpus, tmp_path / "s.zarr"), cache=cache,
            home=tmp_path / "home")
    assert r.returncode == 1 and "holds no weights (no .safetensors, no .bin)" in r.stderr, r.stderr
    assert "pickle" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_empty_layers_is_named(trained_run, corpus, tmp_path):
    for spec in ("", ","):
        r = cli("extract", trained_run, "--layers", spec, *data_args(corpus, tmp_path / "s.zarr"), cache=tmp_path,
                home=tmp_path / "home")
        assert r.returncode != 0 and "names no layer" in r.stderr and "outside" not in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "s.zarr").exists()


class _Hub(http.server.BaseHTTPRequestHandler):
    """The two Hub API answers snapshot_download and model_info need, from a cache's own snapshots: a revision's
    commit (``refs`` served as the Hub's branches) and its file tree."""
    root: Path
    refs: dict[str, str]

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = urllib.parse.urlparse(self.path).path
        m = re.match(r"^/api/models/[^/]+/[^/]+/(revision|tree)/(.+?)(/)?$", path)
        rev = urllib.parse.unquote(m[2]) if m else ""
        commit = self.refs.get(rev, rev)
        snap = self.root / "snapshots" / commit
        if not m or not snap.is_dir():
            self.send_response(404), self.send_header("X-Error-Code", "RevisionNotFound"), self.end_headers()
            return
        files = [{"type": "file", "path": p.name, "size": p.stat().st_size, "oid": p.resolve().name}
                 for p in sorted(snap.iterdir())]
        body = files if m[1] == "tree" else {"id": REPO, "modelId": REPO, "sha": commit, "private": False,
                                            "siblings": [{"rfilename": f["path"]} for f in files]}
        data = json.dumps(body).encode()
        self.send_response(200), self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))), self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_delete_downloads_keeps_a_snapshot_cached_under_another_ref(trained_run, corpus, tmp_path):
    """A new ref (v1) resolving to the commit main has in the cache: the snapshot was not this run's download, so
    --delete-downloads leaves it, with main's ref."""
    cache, store = tmp_path / "hub", tmp_path / "s.zarr"
    snap = add_revision(cache, REPO, "main", files(trained_run, 20))
    root = cache / "models--test-org--neo-2x32"
    handler = type("Hub", (_Hub,), {"root": root, "refs": {"main": snap.name, "v1": snap.name}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    before = tree(cache)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home"), "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}"}
    try:
        r = subprocess.run(CLI + ["extract", REPO, "--revision", "v1", "--delete-downloads",
                                  *map(str, data_args(corpus, store))], env=env, capture_output=True, text=True,
                           timeout=600)
    finally:
        server.shutdown()
    assert r.returncode == 0 and "1 extracted" in r.stdout, r.stdout + r.stderr
    assert "deleted" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert set(before) <= set(tree(cache)) and (root / "refs" / "main").read_text() == snap.name
    weights = trained_run / "checkpoint-20" / "model.safetensors"
    assert (snap / "model.safetensors").read_bytes() == weights.read_bytes()
    assert ncanalyze.store.open(store)["neo-2x32/v1"].to_dataset().attrs["hub_commit"] == snap.name
