"""The classifier stored once per checkpoint (SPEC 2, issue 24): a ``--layers all`` store holds the head in the
checkpoint group alone, as coordinates its layer groups inherit; every layer reads and measures with it as it would
with its own copy."""
from __future__ import annotations

import shutil

import ncanalyze.store
import numpy as np
import pytest
import torch
import xarray as xr
import zarr
from conftest import EXTRACT_OPTS, run_cli
from ncanalyze.analyzer import class_stats, measure
from ncanalyze.analyzer.schema import HEAD
from ncanalyze.core.errors import UserError
from ncanalyze.store import io
from ncanalyze.store.extraction.layers import plan
from ncanalyze.store.extraction.running import Extraction
from ncanalyze.store.inventory import disk_bytes
from ncanalyze.store.layout import StoreLayout
from ncanalyze.store.measure import measure_store

LAYERS = (0, 1)  # the layer groups of the 2-block model; the checkpoint group is layer 2


def model_head(path) -> np.ndarray:
    from transformers import GPTNeoForCausalLM

    return GPTNeoForCausalLM.from_pretrained(path).lm_head.weight.detach().numpy()


@pytest.fixture(scope="module")
def stores(trained_run, corpus, tmp_path_factory):
    """``--layers all`` of checkpoint-60 (``new``), measured, and the model's own head ``W``."""
    new = tmp_path_factory.mktemp("head") / "new.zarr"
    run_cli("extract", trained_run / "checkpoint-60", "--dataset", corpus["train"], "--store", new, "--layers", "all",
            *EXTRACT_OPTS)
    measure_store(new)
    return {"new": new, "ckpt": io.checkpoint_groups(new)[0][0], "W": model_head(trained_run / "checkpoint-60")}


def stored_metrics(store, group) -> dict:
    return zarr.open_group(store, path=group, mode="r", zarr_format=3).attrs["metrics"]


def assert_same_metrics(a: dict, b: dict) -> None:
    """The same metric values (the stored ones carry their jackknife errors, ``<metric>_se``: test_jackknife.py's)."""
    a, b = ({k: v for k, v in m.items() if not k.endswith("_se")} for m in (a, b))
    assert set(a) == set(b)
    for k in a:
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, k
        else:
            assert a[k] == pytest.approx(b[k], abs=1e-12, rel=0, nan_ok=True), k


@pytest.mark.slow
def test_layer_groups_hold_no_classifier_and_the_checkpoint_group_one(stores):
    new, ckpt, W = stores["new"], stores["ckpt"], stores["W"]
    g = zarr.open_group(new, path=ckpt, mode="r", zarr_format=3)
    np.testing.assert_array_equal(g["classifier"][:], W)  # the model's own head, float32 as it holds it
    assert g["classifier"].dtype == np.float32 and "classifier_bias" not in g  # GPT-Neo's head has no bias
    assert "classifier" in xr.open_zarr(new, group=ckpt, zarr_format=3, consolidated=False).coords
    for l in LAYERS:
        arrays = dict(zarr.open_group(new, path=f"{ckpt}/layers/{l}", mode="r", zarr_format=3).arrays())
        assert "mean" in arrays and not set(HEAD) & set(arrays), l
    held = disk_bytes(new / ckpt / "classifier")
    assert held > W.nbytes // 2  # zstd at level 0 barely compresses float32 weights
    heads = [p for p in new.rglob("zarr.json") if p.parent.name in HEAD]
    assert [p.parent for p in heads] == [new / ckpt / "classifier"]  # one copy in the whole store


@pytest.mark.slow
def test_every_layer_measures_as_with_its_own_copy_of_the_head(stores):
    """Each group's stored metrics equal those of its statistics in memory with the model's head attached as a data
    variable (as every group held it before), and two metrics of the head against brute force in float64."""
    new, ckpt, W = stores["new"], stores["ckpt"], stores["W"]
    W64 = W.astype(np.float64)
    for g in [ckpt, *(f"{ckpt}/layers/{l}" for l in LAYERS)]:
        ds = xr.open_zarr(new, group=g, zarr_format=3, consolidated=False).load()
        ds = ds.drop_vars([h for h in HEAD if h in ds.variables]).assign(classifier=(("vocab", "hidden"), W))
        ours = stored_metrics(new, g)
        assert_same_metrics(ours, {k: (v if np.isfinite(v) else None) for k, v in measure(ds).items()})
        K = np.flatnonzero(ds["count"].values >= 1)
        m = ds["mean"].values[K] - ds["mean"].values[K].mean(0)
        w = W64[K]
        cos = (w * m).sum(1) / np.linalg.norm(w, axis=1) / np.linalg.norm(m, axis=1)
        assert ours["nc3_cos_mean"] == pytest.approx(cos.mean(), abs=1e-10)
        s = np.sqrt(np.clip(np.linalg.eigvalsh(W64.T @ W64), 0, None))
        p = s[s > 0] / s.sum()
        assert ours["head_erank"] == pytest.approx(np.exp(-(p * np.log(p)).sum()), abs=1e-10)
    assert len({stored_metrics(new, f"{ckpt}/layers/{l}")["nc3_cos_mean"] for l in LAYERS}) == len(LAYERS)


@pytest.mark.slow
def test_plain_xarray_reaches_the_head_from_a_layer_node(stores):
    new, ckpt, W = stores["new"], stores["ckpt"], stores["W"]
    tree = xr.open_datatree(new, engine="zarr", consolidated=False)
    node = tree[f"{ckpt}/layers/1"]
    assert "classifier" not in node.to_dataset()  # xarray inherits only indexed coordinates by default
    np.testing.assert_array_equal(node.to_dataset(inherit="all_coords")["classifier"].values, W)


@pytest.mark.slow
def test_store_open_gives_every_layer_node_the_checkpoints_head_lazily(stores):
    new, ckpt, W = stores["new"], stores["ckpt"], stores["W"]
    tree = ncanalyze.store.open(new)
    head = tree[ckpt].to_dataset()["classifier"]
    for l in LAYERS:
        ds = tree[f"{ckpt}/layers/{l}"].to_dataset()
        assert ds["classifier"].chunks is not None and ds["classifier"].data is head.data  # the same lazy array
        ours = {k: (v if np.isfinite(v) else None) for k, v in ds.nc.measure().items()}
        assert_same_metrics(ours, stored_metrics(new, f"{ckpt}/layers/{l}"))
        np.testing.assert_array_equal(ds["classifier"].values, W)
        np.testing.assert_array_equal(io.read_group(new, f"{ckpt}/layers/{l}")["classifier"].values, W)
    assert tree.nc.table()["nc3_cos_mean"].notna().sum() == len(LAYERS) + 1


def test_a_head_with_a_bias_is_written_once_and_every_layer_reads_it(tmp_path):
    """Planted statistics (two layers of different features, one head with a bias) through io.write_checkpoint."""
    rng = np.random.default_rng(0)
    V, d, n = 12, 5, 600
    W, b = rng.standard_normal((V, d)).astype(np.float32), rng.standard_normal(V).astype(np.float32)
    y, yv = rng.integers(0, V, n), rng.integers(0, V, 200)
    made = {}
    for layer, scale in ((0, 0.5), (1, 2.0)):
        h = scale * W[y] + rng.standard_normal((n, d))
        hv = scale * W[yv] + rng.standard_normal((200, d))
        made[layer] = class_stats(h, y, V, classifier=W, classifier_bias=b, val_embeddings=hv, val_labels=yv)
    store, group = tmp_path / "s.zarr", "run/checkpoint-1"
    io.write_checkpoint(store, group, made[1].copy(), StoreLayout(store).checkpoint(_Named("run", "checkpoint-1")),
                        layers=[("layers/0", made[0].copy())])
    arrays = dict(zarr.open_group(store, path=f"{group}/layers/0", mode="r").arrays())
    assert "mean" in arrays and not set(HEAD) & set(arrays)
    for g, layer in ((group, 1), (f"{group}/layers/0", 0)):
        read = io.read_statistics(store, g)
        np.testing.assert_array_equal(read["classifier"].values, W)
        np.testing.assert_array_equal(read["classifier_bias"].values, b)
        assert_same_metrics(measure(read), measure(made[layer]))
    assert measure(made[0])["nc3_cos_mean"] != measure(made[1])["nc3_cos_mean"]
    chunk = next(p for p in (store / group / "classifier").rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.unlink()  # the one copy of the head loses a chunk: every layer that refers to it says so, in one line
    with pytest.raises(UserError, match=f"{group}/layers/0 lacks data chunks \\({group}'s classifier"):
        io.read_statistics(store, f"{group}/layers/0")


class _Named:
    def __init__(self, run: str, name: str):
        self.run, self.name, self.group = run, name, f"{run}/{name}"


def test_every_layers_dataset_in_memory_shares_one_float32_head():
    """Extraction.datasets converts the (bf16) head once: every layer's dataset holds that one array."""
    V, d = 20, 6
    W = torch.randn(V, d).to(torch.bfloat16)
    ex = Extraction(plan("all", n=3), V, d, 2, 0, "cpu")
    ds, others = ex.datasets(W, None, None, {}, "ln_f")
    layers = [lds for _, lds in others]
    assert len(layers) == 3
    np.testing.assert_array_equal(ds["classifier"].values, W.float().numpy())
    assert ds["classifier"].dtype == np.float32
    assert all(np.shares_memory(ds["classifier"].values, lds["classifier"].values) for lds in layers)


@pytest.mark.slow
def test_the_training_callbacks_layer_groups_refer_to_the_checkpoints_head(corpus, tmp_path):
    """The callback measures each layer's dataset in memory (the head attached) before writing it without the head:
    its stored metrics equal `measure` of the store as written (the head inherited), and the head is the model's at
    that step, stored once."""
    from test_training import train

    from ncanalyze.training import NeuralCollapseCallback

    store = tmp_path / "live.zarr"
    cb = NeuralCollapseCallback(store, str(corpus["train"]), str(corpus["val"]), layers="all", max_train_tokens=512,
                                max_val_tokens=256, batch_size=4, samples_per_class=2)
    train(corpus, tmp_path / "neo", [cb], steps=10)
    group = "neo/step-10"
    np.testing.assert_array_equal(zarr.open_group(store, path=group, mode="r")["classifier"][:],
                                  model_head(tmp_path / "neo" / "checkpoint-10"))
    live = {g: stored_metrics(store, g) for g in [group, *(f"{group}/layers/{l}" for l in LAYERS)]}
    for l in LAYERS:
        arrays = dict(zarr.open_group(store, path=f"{group}/layers/{l}", mode="r").arrays())
        assert "mean" in arrays and not set(HEAD) & set(arrays), l
    measure_store(store, force=True)
    for g, ours in live.items():
        assert_same_metrics(stored_metrics(store, g), ours)
        assert np.isfinite(ours["nc3_cos_mean"]), g


def test_the_estimate_counts_the_head_once(stores):
    """The estimate's size of a ``--layers all`` checkpoint (:func:`group_bytes`) is the bytes its groups hold, the
    head counted once; counting it per layer (as before) would be off by (layers - 1) x the head's bytes."""
    from ncanalyze.store.extraction.memory import group_bytes

    new, ckpt = stores["new"], stores["ckpt"]
    groups = [ckpt, *(f"{ckpt}/layers/{l}" for l in LAYERS)]
    opened = [xr.open_zarr(new, group=g, zarr_format=3, consolidated=False) for g in groups]
    held = sum(ds[v].nbytes for ds in opened for v in [*ds.data_vars, *HEAD]  # as extracted (no class_* metrics)
               if v in ds.variables and not v.startswith("class_"))
    ds = xr.open_zarr(new, group=ckpt, zarr_format=3, consolidated=False)
    V, d, S = ds.sizes["vocab"], ds.sizes["hidden"], ds.sizes["slot"]
    est = group_bytes(V, d, S, layers=len(groups), folds=ds.attrs["folds"])
    assert est == pytest.approx(held, rel=0.01)
    assert est + len(LAYERS) * V * d * 4 != pytest.approx(held, rel=0.01)  # the head per layer would miss it


def test_a_corrupt_head_skips_its_checkpoint_with_every_layer_and_names_the_fix(stores, tmp_path):
    """A flipped bit in the one stored head (zstd's checksum catches it): `measure` leaves out the checkpoint group
    and every layer group that refers to it, each naming the checkpoint to extract again or remove, never the layer
    group alone (removing it would not mend the head); a copy of the run beside it is measured as before."""
    store, ckpt = tmp_path / "s.zarr", stores["ckpt"]
    run = ckpt.split("/")[0]
    shutil.copytree(stores["new"], store)
    shutil.copytree(store / run, store / "other-run")
    chunk = next(p for p in sorted((store / ckpt / "classifier").rglob("*")) if p.is_file() and p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    chunk.write_bytes(bytes(raw))
    with pytest.warns(UserWarning) as caught:
        result = measure_store(store, force=True)
    skipped = result.failed
    assert set(skipped) == {ckpt, *(f"{ckpt}/layers/{l}" for l in LAYERS)}
    for g, why in skipped.items():
        assert "corrupt data" in why and why.endswith(f"or remove {store / ckpt}"), why
    other = [g for g in result.measured if g.startswith("other-run/")]
    assert len(other) == 1 + len(LAYERS)
    for g in other:  # the other run, untouched, measures as the original (other-run/<ckpt> is <run>/<ckpt>)
        assert_same_metrics(stored_metrics(store, g), stored_metrics(stores["new"], f"{run}/{g.split('/', 1)[1]}"))
    assert any("skipped" in str(w.message) for w in caught)


def test_a_checkpoints_head_is_read_once_for_all_its_layer_groups(stores, tmp_path):
    """read_statistics of a layer group given its checkpoint's loaded head uses it and reads none of the head's files
    (their chunks are removed here after the first read: a second read would give fill values); the statistics are the same as read
    in full; without it, the missing files are named as before."""
    store = tmp_path / "s.zarr"
    shutil.copytree(stores["new"], store)
    ckpt = stores["ckpt"]
    read = io.read_statistics(store, ckpt)
    head = read[[h for h in HEAD if h in read.variables]]  # as measure_store keeps it
    full = {l: io.read_statistics(store, f"{ckpt}/layers/{l}") for l in LAYERS}
    shutil.rmtree(store / ckpt / "classifier" / "c")  # its chunks: read now, the head would be fill values
    for l in LAYERS:
        given = io.read_statistics(store, f"{ckpt}/layers/{l}", head)
        assert given.identical(full[l])
        np.testing.assert_array_equal(given["classifier"].values, stores["W"])
    with pytest.raises(UserError, match=f"lacks data chunks \\({ckpt}'s classifier"):
        io.read_statistics(store, f"{ckpt}/layers/{LAYERS[0]}")
