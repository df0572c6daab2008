"""Trust in what a resume continues from (issue 21): a digest over every saved state's arrays (the checkpoint's and a
finished pass's layers), staged embeddings checked against their shape before they are reopened, a state that does
not fit refused in one line that --restart or --overwrite clears, the block length of 2-D token arrays as recorded,
and --save-embeddings on a full disk (a real tmpfs) or larger than the data. Real checkpoints, real kills (SIGKILL),
real files; every resume that goes on ends bit for bit equal to an uninterrupted run."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import ncanalyze.store
import numpy as np
import pytest
from conftest import assert_same_group, cli_run, kill_when, run_cli, tmpfs
from ncanalyze.core.sizes import bytes_text
from ncanalyze.store.data.blocks import Blocks
from ncanalyze.store.extraction.estimate import START, Arch, estimate
from ncanalyze.store.extraction.resume import DIGEST, digest, save_state

CK = "checkpoint-20"
SMALL = ("--max-train-tokens", 1024, "--max-val-tokens", 512, "--samples-per-class", 2, "--batch-size", 2)
# 2048 / 32 = 64 blocks, 64 x 31 = 1984 train positions; passes (0, 1) then (2)
LAYERED = ("--max-train-tokens", 2048, "--max-val-tokens", 1024, "--samples-per-class", 2, "--batch-size", 2,
           "--layers", "all", "--layers-per-pass", 2, "--save-embeddings", 500)
POSITIONS = 64 * 31


def partial(store: Path) -> Path:
    return store.with_name(store.name + ".partial")


def state_of(store: Path) -> Path:
    return partial(store) / "neo-2x32" / f"{CK}.npz"


def layers_of(store: Path) -> Path:
    return partial(store) / "neo-2x32" / f"{CK}.layers"


def one_line_error(r) -> str:
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    return errors[0]


def read(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def groups(layered: bool) -> list[str]:
    g = f"neo-2x32/{CK}"
    return [g, f"{g}/layers/0", f"{g}/layers/1"] if layered else [g]


# ---------------------------------------------------------------- the digest itself

def test_the_digest_changes_with_any_name_dtype_shape_or_byte():
    base = {"a": np.arange(6.0).reshape(2, 3), "b": np.array(3), "config": np.array('{"x": 1}')}
    d = digest(base)
    assert d == digest(dict(reversed(base.items())))  # order of the names does not matter
    assert d == digest({**base, DIGEST: np.array("anything")})  # the digest itself is left out
    changed = [{"a2": base["a"], "b": base["b"], "config": base["config"]},
               {**base, "a": base["a"].astype(np.float32)}, {**base, "a": base["a"].reshape(3, 2)},
               {**base, "a": np.where(np.arange(6).reshape(2, 3) == 5, np.nextafter(5.0, 6), base["a"])},
               {**base, "b": np.array(4)}, {**base, "config": np.array('{"x": 2}')},
               {**base, "extra": np.zeros(0)}]
    assert len({d, *(digest(c) for c in changed)}) == len(changed) + 1


def test_a_saved_state_round_trips_and_one_flipped_value_is_refused(tmp_path):
    from ncanalyze.core.errors import CheckpointError
    from ncanalyze.store.extraction.resume import load_state

    arrays = {"stats.mean": np.random.default_rng(0).normal(size=(5, 4)), "phase": np.array(0),
              "batches": np.array(2), "config": np.array(json.dumps({"a": 1}))}
    path = tmp_path / "s.npz"
    save_state(path, arrays)
    got = load_state(path)
    assert set(got) == set(arrays) and all(np.array_equal(got[k], arrays[k]) for k in arrays)
    saved = read(path)
    saved["stats.mean"][2, 1] = np.nextafter(saved["stats.mean"][2, 1], 1)  # one ulp, the digest kept
    np.savez(path, **saved)
    with pytest.raises(CheckpointError, match="fails its integrity check.*--restart"):
        load_state(path)


# ---------------------------------------------------------------- the default extraction's state

@pytest.fixture(scope="module")
def plain(trained_run, corpus, tmp_path_factory) -> dict:
    """A reference store, and the bytes of a real state killed (SIGKILL) after 4 batches of the train pass."""
    d = tmp_path_factory.mktemp("plain")
    args = ("extract", trained_run / CK, "--dataset", corpus["train"], *SMALL)
    run_cli(*args, "--store", d / "ref.zarr")
    kill_when((*args, "--store", d / "killed.zarr", "--state-every", 0), state_of(d / "killed.zarr"), batches=4)
    return {"args": args, "ref": d / "ref.zarr", "state": state_of(d / "killed.zarr").read_bytes()}


def _forge_counts(a):  # two classes' counts swapped: the total still adds up to the batches done
    c = a[COUNT]
    i, j = np.flatnonzero(c != c.max())[0], int(np.argmax(c))
    c[[i, j]] = c[[j, i]]


MEAN, COUNT = "layer2.stats.mean", "layer2.stats.count"  # the 2-block model's last layer
PLAIN_DAMAGE = {
    "a mean changed by one ulp": (lambda a: a[MEAN].flat.__setitem__(7, np.nextafter(a[MEAN].flat[7], 1)),
                                  "integrity check"),
    "counts that still add up": (_forge_counts, "integrity check"),
    "a state without its digest": (lambda a: a.pop(DIGEST), "integrity check"),
    # forged with the digest recomputed (the digest is no signature): the plausibility checks still stand behind it
    "counts doubled, digest recomputed": ("forge", "inconsistent"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", PLAIN_DAMAGE)
def test_an_altered_state_is_refused_and_restart_equals_an_uninterrupted_run(damage, plain, tmp_path):
    store = tmp_path / "s.zarr"
    state = state_of(store)
    state.parent.mkdir(parents=True)
    state.write_bytes(plain["state"])
    arrays = read(state)
    edit, words = PLAIN_DAMAGE[damage]
    if edit == "forge":
        arrays.pop(DIGEST)
        arrays[COUNT] = arrays[COUNT] * 2
        save_state(state, arrays)
    else:
        edit(arrays)
        np.savez(state, **arrays)
    line = one_line_error(run_cli(*plain["args"], "--store", store, ok=False))
    assert words in line and str(state) in line and "pass --restart" in line
    assert not (store / "neo-2x32" / CK).exists()
    run_cli(*plain["args"], "--store", store, "--restart")
    assert_same_group(plain["ref"], store, f"neo-2x32/{CK}")


@pytest.mark.slow
def test_the_untouched_state_still_resumes_bit_identical(plain, tmp_path):
    store = tmp_path / "s.zarr"
    state_of(store).parent.mkdir(parents=True)
    state_of(store).write_bytes(plain["state"])
    assert "1 resumed" in run_cli(*plain["args"], "--store", store).output
    assert_same_group(plain["ref"], store, f"neo-2x32/{CK}")


# ---------------------------------------------------------------- a layered state, its finished layers, embeddings

@pytest.fixture(scope="module")
def layered(trained_run, corpus, tmp_path_factory) -> dict:
    """A reference store of --layers all in two passes with embeddings, and the resume folder of the same run killed
    (SIGKILL) in the second pass's train pass (layers 0 and 1 finished in the layers folder)."""
    d = tmp_path_factory.mktemp("layered")
    args = ("extract", trained_run / CK, "--dataset", corpus["train"], *LAYERED)
    run_cli(*args, "--store", d / "ref.zarr")
    killed = d / "killed.zarr"
    kill_when((*args, "--store", killed, "--state-every", 0), state_of(killed), batches=3, at={"pass": 1, "phase": 0})
    assert (layers_of(killed) / "layer-0.npz").is_file() and (layers_of(killed) / "embeddings-0.npy").is_file()
    return {"args": args, "ref": d / "ref.zarr", "partial": partial(killed)}


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _tamper(path: Path) -> None:  # a value changed, the saved digest kept
    a = read(path)
    a["stats.mean"][0, 0] += 1.0
    np.savez(path, **a)


def _forge(path: Path, edit) -> None:  # re-saved through our own save_state: a valid digest over a state that misfits
    a = read(path)
    a.pop(DIGEST)
    edit(a)
    save_state(path, a)


LAYERED_DAMAGE = {  # file in the resume folder -> (damage, words of the one line)
    "a finished layer altered": ("layer-0", _tamper, "integrity check"),
    "a finished layer missing": ("layer-1", lambda p: p.unlink(), "missing"),
    "a finished layer of a wrong shape": ("layer-0", lambda p: _forge(p, lambda a: a.__setitem__(
        "stats.mean", a["stats.mean"][:, :-1])), "does not fit"),
    "a finished layer missing an array": ("layer-1", lambda p: _forge(p, lambda a: a.pop("stats.m2")),
                                          "stats.m2 (missing)"),
    "the state missing an array": ("state", lambda p: _forge(p, lambda a: a.pop("layer2.reservoir.pool")),
                                   "layer2.reservoir.pool (missing)"),
    "the state of a wrong shape": ("state", lambda p: _forge(p, lambda a: a.__setitem__(
        "layer2.stats.count", a["layer2.stats.count"][:-1])), "layer2.stats.count"),
    "the state without its phase": ("state", lambda p: _forge(p, lambda a: a.pop("phase")), "lacks phase"),
    "the state altered": ("state", lambda p: _tamper_layer2(p), "integrity check"),
    "truncated staged embeddings": ("embeddings-0", _truncate, "staged embeddings"),
    "a staged embedding altered in place": ("embeddings-0", lambda p: _bump(p, (10, 3)), "fail the digest"),
    "a staged label altered in place": ("label", lambda p: _bump(p, (499,)), "fail the digest"),
    "staged embeddings of another shape": ("label", lambda p: np.save(p, np.zeros(499, np.int64)),
                                           "staged embeddings"),
}


def _bump(path: Path, at: tuple[int, ...]) -> None:  # one value changed in place, the file's size kept
    m = np.load(path, mmap_mode="r+")
    m[at] += 1
    m.flush()
    del m


def _tamper_layer2(path: Path) -> None:
    a = read(path)
    a["layer2.stats.mean"][1, 1] += 1.0
    np.savez(path, **a)


def _file(store: Path, which: str) -> Path:
    if which == "state":
        return state_of(store)
    return layers_of(store) / (f"{which}.npz" if which.startswith("layer-") else f"{which}.npy")


# --restart and --overwrite discard the whole resume folder whatever its damage (checkpoint.py): the run after them
# is shown equal to the uninterrupted one for one damage of each file, with each flag; every damage is refused
DISCARDED = {"a finished layer altered": "--restart", "a finished layer missing": "--overwrite",
             "the state altered": "--overwrite", "truncated staged embeddings": "--restart",
             "staged embeddings of another shape": "--overwrite"}


@pytest.mark.slow
@pytest.mark.parametrize("damage", LAYERED_DAMAGE)
def test_a_damaged_layered_resume_is_one_line_and_restart_or_overwrite_discards_it(damage, layered, tmp_path):
    assert set(DISCARDED) <= set(LAYERED_DAMAGE) and set(DISCARDED.values()) == {"--restart", "--overwrite"}
    store = tmp_path / "s.zarr"
    shutil.copytree(layered["partial"], partial(store))
    which, edit, words = LAYERED_DAMAGE[damage]
    path = _file(store, which)
    edit(path)
    size = path.stat().st_size if path.exists() else None
    line = one_line_error(run_cli(*layered["args"], "--store", store, ok=False))
    assert words in line and "pass --restart" in line, line
    assert (path.stat().st_size if path.exists() else None) == size  # nothing zero-filled or extended
    assert not (store / "neo-2x32" / CK).exists()
    if damage not in DISCARDED:
        return
    run_cli(*layered["args"], "--store", store, DISCARDED[damage])
    for g in groups(True):
        assert_same_group(layered["ref"], store, g)
    assert not partial(store).exists() or not any(partial(store).rglob("*.np[yz]"))


@pytest.mark.slow
def test_the_untouched_layered_state_resumes_bit_identical(layered, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(layered["partial"], partial(store))
    assert "1 resumed" in run_cli(*layered["args"], "--store", store).output
    for g in groups(True):
        assert_same_group(layered["ref"], store, g)


# ---------------------------------------------------------------- --block-size and 2-D token arrays

@pytest.mark.slow
def test_two_d_token_arrays_record_their_width_and_refuse_another_block_size(trained_run, corpus, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained_run)
    ids = np.array(tok(corpus["train"].read_text()[:20000])["input_ids"][: 40 * 24], dtype=np.int64).reshape(40, 24)
    rows = tmp_path / "train.npy"
    np.save(rows, ids)
    args = ("extract", trained_run / CK, "--dataset", rows, "--max-val-tokens", 0, "--samples-per-class", 1)
    line = one_line_error(run_cli(*args, "--store", tmp_path / "bad.zarr", "--block-size", 16, ok=False))
    assert "--block-size 16" in line and "24 tokens" in line and "drop --block-size" in line
    attrs = []
    for i, extra in enumerate([(), ("--block-size", 24)]):
        store = tmp_path / f"s{i}.zarr"
        run_cli(*args, "--store", store, *extra)
        attrs.append(dict(ncanalyze.store.open(store)[f"neo-2x32/{CK}"].attrs))
    for a in attrs:  # the block length used, not the model's default (32 positions here, which --block-size took)
        assert a["block_size"] == 24 and json.loads(a["config"])["block_size"] == 24
        assert a["train_tokens"] == 40 * 23
    assert attrs[0]["config_hash"] == attrs[1]["config_hash"]


# ---------------------------------------------------------------- --save-embeddings: a full disk, N beyond the data

@pytest.mark.slow
def test_save_embeddings_on_a_full_disk_is_the_full_disk_line_and_releases_the_lock(trained_run, corpus, tmp_path):
    with tmpfs(tmp_path / "disk", "size=6m") as disk:
        store = disk / "s.zarr"
        args = ["extract", trained_run / CK, "--dataset", corpus["train"], "--max-train-tokens", 2048,
                "--max-val-tokens", 512, "--samples-per-class", 1, "--layers", "all", "--save-embeddings", POSITIONS,
                "--embeddings-dtype", "float64", "--folds", 1,  # no fold sums: the 6 MB disk holds the rest
                "--store", store]  # 3 x 1984 x 32 x 8 bytes = 1.5 MB staged
        free = os.statvfs(disk)
        (disk / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 600_000))
        r = cli_run(args, timeout=300)
        assert r.returncode == 1, (r.returncode, r.stderr[-2000:])  # not 135 (SIGBUS)
        assert "disk full" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
        lock = state_of(store).with_suffix(".lock")
        if lock.exists():  # released: another writer takes it at once
            with open(lock, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        (disk / "filler").unlink()
        run_cli(*args)
        ds = ncanalyze.store.open(store)[f"neo-2x32/{CK}/layers/0"].to_dataset()
        assert ds.sizes["position"] == POSITIONS and np.isfinite(ds["embeddings"].values).all()


@pytest.mark.slow
def test_save_embeddings_beyond_the_train_positions_stages_what_there_is(trained_run, corpus, tmp_path):
    args = ["extract", trained_run / CK, "--dataset", corpus["train"], "--max-train-tokens", 2048,
            "--max-val-tokens", 512, "--samples-per-class", 1, "--save-embeddings"]
    run_cli(*args, 10**12, "--store", tmp_path / "huge.zarr")
    run_cli(*args, POSITIONS, "--store", tmp_path / "all.zarr")
    a, b = (ncanalyze.store.open(tmp_path / s)[f"neo-2x32/{CK}"].to_dataset() for s in ("huge.zarr", "all.zarr"))
    assert a.sizes["position"] == POSITIONS
    for name in ("embeddings", "label", "position"):
        np.testing.assert_array_equal(a[name].values, b[name].values)


def test_the_estimate_counts_only_the_embeddings_staged(tmp_path):
    from ncanalyze.store.extraction.memory import group_bytes

    train = Blocks("train.npy", 32, None, 64, lambda: iter(()))  # 64 x 31 = 1984 positions
    staged = group_bytes(300, 1024, 2, 3, POSITIONS, 4)  # 3 layers' groups with 1984 positions' float32 features
    def line(n: int) -> str:
        arch = Arch("neo", None, train, None, 300, 1024, passes=[3], embeddings=n, at=[START])
        return estimate([arch], 8, 2, tmp_path)

    for n in (10**12, POSITIONS, POSITIONS + 1):
        est = line(n)
        assert f"~{bytes_text(staged)} (before compression)" in est, est
    fewer = line(POSITIONS // 2)
    assert f"~{bytes_text(staged)}" not in fewer
