"""--layers, --layers-per-pass and --save-embeddings against brute force from ``output_hidden_states`` on a real
Trainer checkpoint: every layer's statistics to 1e-9, the logit lens's NC4 counts exactly, the last layer unchanged,
the embeddings through xarray/flox, kill-and-resume bit for bit, the config hash, the memory check."""
from __future__ import annotations

import dask.array as da
import ncanalyze.store
import numpy as np
import pytest
import torch
import xarray as xr
from conftest import EXTRACT_OPTS, kill_when, run_cli
from ncanalyze.analyzer import UserError, class_stats, measure
from ncanalyze.store.io import read_group
from test_extract import assert_matches, text_blocks
from test_kill_resume import _state
from transformers import AutoModelForCausalLM, AutoTokenizer

CK = "checkpoint-40"
N_EMB = 1000  # saved embeddings: the first 1000 of the 8192 / 32 * 31 = 7936 train positions


def all_hidden(model, blocks: np.ndarray, batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Every layer's features from ``output_hidden_states`` (layers x n x d, float64) and the same after the model's
    final norm, ln_f (the logit lens), at every position but the last of each block."""
    raw, lens = [], []
    with torch.no_grad():
        for s in range(0, len(blocks), batch):
            hs = torch.stack(model(torch.from_numpy(blocks[s:s + batch]), output_hidden_states=True).hidden_states)
            hs = hs[:, :, :-1]
            raw.append(hs.reshape(hs.shape[0], -1, hs.shape[-1]).double().numpy())
            z = model.transformer.ln_f(hs)
            lens.append(z.reshape(hs.shape[0], -1, hs.shape[-1]).double().numpy())
    return np.concatenate(raw, 1), np.concatenate(lens, 1)


def brute_force_layer(H: np.ndarray, y: np.ndarray, Hv: np.ndarray, Zv: np.ndarray, yv: np.ndarray, W: np.ndarray,
                      V: int) -> dict:
    """One layer's statistics of its raw features H, and NC4's counts with the linear decision on the lens features
    Zv and the nearest class mean on the raw Hv."""
    count = np.bincount(y, minlength=V)
    mean, var = np.zeros((V, H.shape[1])), np.full(V, np.nan)
    for c in np.flatnonzero(count):
        mean[c] = H[y == c].mean(0)
        var[c] = ((H[y == c] - mean[c]) ** 2).sum(1).mean()
    dev = H - mean[y]
    kept = np.flatnonzero(count >= 1)
    linear = kept[(Zv @ W[kept].T).argmax(1)]
    ncc = kept[((Hv[:, None, :] - mean[kept][None]) ** 2).sum(-1).argmin(1)]
    return {"count": count, "mean": mean, "variance": var, "within_covariance": dev.T @ dev / len(y),
            "val_count": np.bincount(yv, minlength=V), "val_correct": np.bincount(yv[linear == yv], minlength=V),
            "val_ncc_agree": np.bincount(yv[linear == ncc], minlength=V)}


@pytest.fixture(scope="module")
def layered_store(trained_run, corpus, tmp_path_factory):
    """checkpoint-40 with --layers all --save-embeddings, the options of ``extracted_store`` otherwise."""
    store = tmp_path_factory.mktemp("layers") / "layers.zarr"
    run_cli("extract", trained_run / CK, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS,
            "--layers", "all", "--save-embeddings", N_EMB)
    return store


@pytest.fixture(scope="module")
def reference(trained_run, corpus):
    """Brute-force features of checkpoint-40: the train and validation streams of EXTRACT_OPTS, every layer."""
    tok = AutoTokenizer.from_pretrained(str(trained_run))
    train = text_blocks(corpus["train"], tok, EXTRACT_OPTS[1])
    val = text_blocks(corpus["val"], tok, EXTRACT_OPTS[3])
    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK), dtype=torch.float32).eval()
    H, _ = all_hidden(model, train)
    Hv, Zv = all_hidden(model, val)
    return {"train": train, "val": val, "model": model, "H": H, "Hv": Hv, "Zv": Zv,
            "W": model.get_output_embeddings().weight.detach().double().numpy()}


@pytest.mark.slow
def test_every_layer_matches_brute_force(layered_store, reference):
    tree = ncanalyze.store.open(layered_store)
    g = f"neo-2x32/{CK}"
    assert sorted(tree[g]["layers"].children) == ["0", "1"]  # the last layer (2) is the checkpoint group itself
    y, yv = reference["train"][:, 1:].ravel(), reference["val"][:, 1:].ravel()
    H, Hv, Zv, W = reference["H"], reference["Hv"], reference["Zv"], reference["W"]
    assert H.shape[0] == 3  # embedding output, block 1, block 2 after ln_f
    with torch.no_grad():  # GPT-Neo's hidden_states[-1] is after ln_f: the output layer's input
        ids = torch.from_numpy(reference["train"][:4])
        model = reference["model"]
        np.testing.assert_array_equal(model(ids, output_hidden_states=True).hidden_states[-1].numpy(),
                                      model.transformer(ids).last_hidden_state.numpy())
    for layer in (0, 1, 2):
        ds = tree[g if layer == 2 else f"{g}/layers/{layer}"].to_dataset()
        assert ds.attrs["layer"] == layer
        assert ds.attrs["lens"] == ("head(h)" if layer == 2 else "head(ln_f(h))")
        # the last layer's NC4 is the plain head on its features; the others' the head after the final norm
        lens = Hv[layer] if layer == 2 else Zv[layer]
        assert_matches(ds, brute_force_layer(H[layer], y, Hv[layer], lens, yv, W, ds.sizes["vocab"]))
        np.testing.assert_array_equal(ds["classifier"].values, W.astype(np.float32))
        # the reservoir holds this layer's raw feature at each recorded position
        t = int(np.argmax(ds["count"].values))
        pos = ds.sample_position.sel(vocab=t).values
        rows = (pos // 32) * 31 + pos % 32
        np.testing.assert_allclose(ds.samples.sel(vocab=t).values, H[layer][rows], rtol=1e-6)
    # the check can tell: the head on the raw h_1 (no lens) decides otherwise
    raw = brute_force_layer(H[1], y, Hv[1], Hv[1], yv, W, ds.sizes["vocab"])
    assert not np.array_equal(raw["val_correct"], tree[f"{g}/layers/1"]["val_correct"].values)


def test_the_last_layer_group_is_unchanged_by_layers_all(layered_store, extracted_store):
    g = f"neo-2x32/{CK}"
    a, b = read_group(extracted_store, g), read_group(layered_store, g)
    assert set(b.data_vars) - set(a.data_vars) == {"embeddings", "label"}
    for name in a.data_vars:
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)  # bit for bit
    assert a.attrs["layer"] == b.attrs["layer"] == 2 and a.attrs["lens"] == b.attrs["lens"] == "head(h)"
    for k in ("config", "config_hash"):
        a.attrs.pop(k, None), b.attrs.pop(k, None)
    assert a.attrs | {"complete": True} == b.attrs | {"complete": True}


@pytest.mark.slow
def test_saved_embeddings_through_xarray_and_flox(layered_store, reference):
    y = reference["train"][:, 1:].ravel()[:N_EMB]
    stream = reference["train"].ravel()
    for layer, group in ((2, f"neo-2x32/{CK}"), (0, f"neo-2x32/{CK}/layers/0")):
        ds = read_group(layered_store, group)
        emb = ds["embeddings"]
        assert emb.dims == ("position", "hidden") and emb.dtype == np.float32 and emb.shape == (N_EMB, 32)
        assert isinstance(emb.data, da.Array)  # lazy
        assert emb.encoding["chunks"][1] == 32 and emb.encoding["chunks"][0] >= 1
        pos = ds["position"].values
        np.testing.assert_array_equal(stream[pos + 1], ds["label"].values)  # label: the next token
        np.testing.assert_array_equal(ds["label"].values, y)
        np.testing.assert_array_equal(pos, (np.arange(N_EMB) // 31) * 32 + np.arange(N_EMB) % 31)
        H = reference["H"][layer][:N_EMB]
        np.testing.assert_array_equal(emb.values, H.astype(np.float32))
        # the independent recomputation, from the brute-force features (float32, as stored)
        Hs = H.astype(np.float32).astype(np.float64)
        classes = np.unique(y)
        want_count = np.array([(y == c).sum() for c in classes])
        want_mean = np.stack([Hs[y == c].mean(0) for c in classes])
        with xr.set_options(use_flox=True):
            grouped = emb.astype(np.float64).groupby(ds["label"].load())
            mean, count = grouped.mean(), grouped.count()
            assert isinstance(mean.data, da.Array)  # still lazy until computed
            mean, count = mean.compute(), count.compute()
        np.testing.assert_array_equal(mean["label"].values, classes)
        np.testing.assert_array_equal(count.values[:, 0], want_count)
        np.testing.assert_allclose(mean.values, want_mean, rtol=1e-12, atol=1e-12)
        stats = class_stats(emb.data, ds["label"].values, num_classes=ds.sizes["vocab"])
        np.testing.assert_array_equal(stats["count"].values[classes], want_count)
        np.testing.assert_allclose(stats["mean"].values[classes], want_mean, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_measure_store_and_metrics_at_every_layer(layered_store):
    from ncanalyze.store.measure import measure_store

    df = measure_store(layered_store).table
    assert list(df.layer) == [0, 1, 2] and (df.checkpoint == CK).all()
    for row in df.itertuples():
        g = f"neo-2x32/{CK}" + ("" if row.layer == 2 else f"/layers/{row.layer}")
        got = measure(read_group(layered_store, g))
        assert got["nc1_cdnv"] == pytest.approx(row.nc1_cdnv, rel=1e-12)
        assert got["nc4_agreement"] == pytest.approx(row.nc4_agreement, rel=1e-12)
        assert np.isfinite(row.nc4_agreement) and np.isfinite(row.unc3_cos_cv)


@pytest.mark.slow
def test_layers_per_pass_equals_one_pass_and_kill_and_resume_is_bit_identical(trained_run, corpus, tmp_path):
    from conftest import assert_same_group

    args = ["extract", trained_run / CK, "--dataset", corpus["train"], "--max-train-tokens", 2048,
            "--max-val-tokens", 2048, "--batch-size", 1, "--layers", "all",
            "--save-embeddings", 1000]  # 64 batches a phase: room to kill after 5, half the time of 4096
    one = tmp_path / "one.zarr"
    run_cli(*args, "--store", one)
    args += ["--layers-per-pass", 2]  # passes: layers (0, 1), then (2)
    ref = tmp_path / "ref.zarr"
    run_cli(*args, "--store", ref)
    groups = [f"neo-2x32/{CK}", f"neo-2x32/{CK}/layers/0", f"neo-2x32/{CK}/layers/1"]
    for g in groups:  # exact either way: the same batches in the same order at every layer
        a, b = read_group(one, g), read_group(ref, g)
        for name in a.data_vars:
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=f"{g} {name}")

    store = tmp_path / "killed.zarr"
    state = _state(store) / "neo-2x32" / f"{CK}.npz"
    args += ["--state-every", 0]  # the state saved at every batch, where the kills are: a run control, not recorded
    for pass_, phase in ((0, 0), (1, 1)):  # in the first pass's train pass, in the second pass's validation pass
        kill_when([*args, "--store", store], state, at={"pass": pass_, "phase": phase})
        with np.load(state) as s:
            assert (int(s["pass"]), int(s["phase"])) == (pass_, phase)
        assert f"neo-2x32/{CK}" not in ncanalyze.store.open(store).to_dict()
    r = run_cli(*args, "--store", store)
    assert "1 resumed" in r.output
    for g in groups:
        assert_same_group(ref, store, g)
    assert not _state(store).exists()


def test_the_record_names_the_layers_resolved(trained_run):
    from ncanalyze.store.extraction.config import config_record, layer_plan
    from ncanalyze.store.extraction.settings import ExtractConfig
    from ncanalyze.store.sources.discover import discover

    ck = discover(trained_run / CK)[0]

    def record(**kw):
        cfg = ExtractConfig(dataset="d", **kw)
        return config_record(ck, cfg, torch.device("cpu"), 32, "v", "validation", layer_plan(cfg, 2))

    assert record()["layers"] == [2]
    assert record(layers="-1") == record() == record(layers="2")  # the last layer alone is the default
    assert record(layers="all")["layers"] == [0, 1, 2] == record(layers="0,1,-1")["layers"]
    assert record(layers="1")["layers"] == [1, 2]  # the last layer is always stored
    assert record(save_embeddings=10)["save_embeddings"] == 10
    assert record(layers="all", layers_per_pass=1)["layers_per_pass"] == 1


@pytest.mark.parametrize("spec", ["3", "-4", "one", ""])
def test_layers_outside_the_model_are_a_clean_error(spec, trained_run, corpus, tmp_path):
    r = run_cli("extract", trained_run / CK, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr",
                "--layers", spec, ok=False)
    assert "--layers" in r.output


def test_memory_check_names_the_layers_per_pass_that_fit():
    from ncanalyze.store.extraction.memory import check_memory, state_bytes

    sizes = state_bytes(50257, 768, 8, torch.device("cuda"))
    per_layer, shared = sizes
    # one float64 copy: the means; NC4's counts at 4 min_counts (memory.nc4_at_bytes) and its screen (screen_bytes)
    assert per_layer == 50257 * 768 * 8 + 6 * 50257 * 8 + 768 * 768 * 8 + 768 * 8 + 129 * 50257 + 768 * 8
    assert shared == 50257 * 768 * 8 + 2 * 50257 * 8  # the float64 head and bias, the kept indices
    check_memory(sizes, 13, torch.device("cuda"), available=13 * per_layer + shared)  # fits exactly
    with pytest.raises(UserError, match="--layers-per-pass 4 "):
        check_memory(sizes, 13, torch.device("cuda"), available=4 * per_layer + shared + 1)
    with pytest.raises(UserError, match="more memory"):
        check_memory(sizes, 1, torch.device("cuda"), available=shared)


@pytest.mark.slow
def test_report_with_layers_keeps_the_last_layers_statistics_and_adds_depth(tmp_path):
    """A table with rows at three layers: stats.csv equals the report of its last-layer rows alone (the numbers of a
    store without --layers), metrics.csv keeps every row, and the depth figure and table appear only with layers."""
    import pandas as pd
    from ncanalyze.analyzer.report import ReportOptions, write_report
    from ncanalyze.analyzer.stats import METRICS
    from PIL import Image
    from test_stats import study

    last = study(n_runs=3, per_run=4, seed=5).assign(n_layers=2)
    rng = np.random.default_rng(0)
    shallow = [last.assign(layer=l, **{m: last[m] * rng.uniform(0.5, 2, len(last)) for m in METRICS})
               for l in (0, 1)]
    table = pd.concat([*shallow, last.assign(layer=2)], ignore_index=True)
    plain = write_report(last.assign(layer=2), tmp_path / "plain", ReportOptions(formats="png",
                                                                                 n_perm=200, seed=1)).files
    deep = write_report(table, tmp_path / "deep", ReportOptions(formats="png", n_perm=200, seed=1)).files
    pd.testing.assert_frame_equal(pd.read_csv(plain["stats"]), pd.read_csv(deep["stats"]))
    assert len(pd.read_csv(deep["metrics"])) == 3 * len(last)
    assert "depth" not in plain and "layers" not in plain
    layers = pd.read_csv(deep["layers"])
    assert len(layers) == len(table) and list(layers.columns[:4]) == ["run", "checkpoint", "global_step", "layer"]
    assert set(layers.groupby(["run", "checkpoint"]).layer.apply(tuple)) == {(0, 1, 2)}
    gray = np.asarray(Image.open(deep["depth"]).convert("L"), float)
    assert gray.std() > 20, "blank figure"
    text = deep["report"].read_text()
    assert "## Across depth" in text and "depth.png" in text and "## Across depth" not in plain["report"].read_text()


def test_the_default_plan_forms_no_hidden_states(trained_run):
    """The default extraction is the one-layer plan through the same passes, and its forward is the base model's
    alone: ``output_hidden_states`` is never asked (no memory or time for the other layers)."""
    from ncanalyze.store.extraction.layers import plan
    from ncanalyze.store.extraction.sites import Site
    from ncanalyze.store.sources.anatomy import hidden_forward

    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK), dtype=torch.float32).eval()
    default = plan("last", None, 0, "float32", 2)
    assert default.single and default.passes == [(Site("resid", 2),)] and not plan("last", None, 5, "float32", 2).single
    asked = []
    model.base_model.register_forward_pre_hook(lambda m, args, kwargs: asked.append(kwargs.get(
        "output_hidden_states")), with_kwargs=True)
    ids = torch.arange(2 * 16).reshape(2, 16) % model.config.vocab_size
    with torch.no_grad():
        want = model(ids, output_hidden_states=True).hidden_states
    asked.clear()
    h = hidden_forward(model, default.layers, default.last)(ids)
    assert asked == [None] and h.shape == (1, 2, 15, 32)
    np.testing.assert_array_equal(h[0].numpy(), want[2][:, :-1].numpy())
    both = hidden_forward(model, (0, 2), 2)(ids)
    assert asked[-1] is True
    np.testing.assert_array_equal(both[0].numpy(), want[0][:, :-1].numpy())
    np.testing.assert_array_equal(both[1].numpy(), want[2][:, :-1].numpy())
