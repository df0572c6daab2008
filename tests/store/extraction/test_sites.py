"""--sites (SPEC section 2, issue 50): the attention and MLP sublayers' outputs (before their residual add) and the
residual stream, each a group of the checkpoint, against features captured in the test with plain
``register_forward_hook`` on the model's own modules (not ncanalyze's anatomy) and measured with ``class_stats`` +
``measure``: a Trainer checkpoint (GPT-Neo) and a Llama-shaped model at float64 to 1e-9; the residual groups
bit for bit those of ``--layers``; bad sites one line each before any work; several passes and kill/resume."""
from __future__ import annotations

import ncanalyze.store
import numpy as np
import pytest
import torch
from conftest import EXTRACT_OPTS, fails_cleanly, kill_when, run_cli
from ncanalyze.analyzer import class_stats, measure
from ncanalyze.analyzer.schema import GEOMETRY_METRICS
from ncanalyze.store.io import read_group
from test_extract import text_blocks
from test_kill_resume import _state
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, OPTConfig

CK = "checkpoint-40"
COMPARED = ("nc1_cdnv", "nc1_cdnv_p2", "nc1_trace", "nc2_norm_cv", "nc2_lognorm_std", "nc2_cos_mean", "nc2_cos_std",
            "nc3_cos_mean", "nc3_dual_error", *GEOMETRY_METRICS)


def hooked(model, modules: dict[str, torch.nn.Module], blocks: np.ndarray, batch: int = 8) -> dict[str, np.ndarray]:
    """Each named module's output (its first element where it returns a tuple) and every ``hidden_states[l]``
    (``resid:l``), float64, at every position but the last of each block, from plain forward hooks."""
    got: dict[str, list] = {}
    outs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda m, a, o, k=k: outs.__setitem__(k, o[0] if isinstance(o, tuple) else o))
               for k, m in modules.items()]
    try:
        with torch.no_grad():
            for s in range(0, len(blocks), batch):
                hs = model(torch.from_numpy(blocks[s:s + batch]), output_hidden_states=True).hidden_states
                for k, h in [*outs.items(), *((f"resid:{l}", h) for l, h in enumerate(hs))]:
                    got.setdefault(k, []).append(h[:, :-1].reshape(-1, h.shape[-1]).double().numpy())
    finally:
        for h in handles:
            h.remove()
    return {k: np.concatenate(v) for k, v in got.items()}


def assert_same_metrics(store, group: str, H: np.ndarray, y: np.ndarray, site: str, model) -> None:
    """The group's NC1/NC2/NC3/geometry metrics equal (1e-9) class_stats + measure of the features ``H`` with the
    model's head (as the store keeps it, float32); its attributes name the site."""
    ds = read_group(store, group)
    assert ds.attrs.get("site", f"resid:{ds.attrs.get('layer')}") == site
    W = model.get_output_embeddings().weight.detach().float().double().numpy()
    want = measure(class_stats(H, y, num_classes=ds.sizes["vocab"], classifier=W))
    got = measure(ds)
    for m in COMPARED:
        assert got[m] == pytest.approx(want[m], rel=1e-9, nan_ok=True), (group, m)
    np.testing.assert_array_equal(ds["count"].values, np.bincount(y, minlength=ds.sizes["vocab"]))


def test_one_parser_orders_sites_as_the_forward_reaches_them():
    """--layers is the residual sites' short form; sites sort in forward order (resid:B, attn:B, mlp:B, resid:B+1);
    the record lists residual sites as the indices --layers always recorded, so a store without sublayer sites keeps
    its config hash; the passes saved for a resume read back as the same sites."""
    import json

    from ncanalyze.store.extraction.layers import plan
    from ncanalyze.store.extraction.sites import Site

    p = plan("0,2", "auto", 0, "float32", 3, "mlp:-1, ATTN:1,resid:2")
    assert [str(s) for s in p.layers] == ["resid:0", "attn:1", "resid:2", "mlp:2", "resid:3"]
    assert [s.recorded for s in p.layers] == [0, "attn:1", 2, "mlp:2", 3]
    assert plan("0,2", n=3).layers == plan("last", n=3, sites="resid:0,resid:2").layers
    assert [s.group for s in p.layers] == ["layers/0", "sites/attn_1", "layers/2", "sites/mlp_2", "layers/3"]
    saved = json.loads(json.dumps([[s.recorded for s in g] for g in p.passes]))
    assert [tuple(Site.of(x) for x in g) for g in saved] == p.passes


@pytest.fixture(scope="module")
def neo_store(trained_run, corpus, tmp_path_factory):
    store = tmp_path_factory.mktemp("sites") / "sites.zarr"
    run_cli("extract", trained_run / CK, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS,
            "--dtype", "float64", "--sites", "attn:0,mlp:-1,resid:1")
    return store


@pytest.mark.slow
def test_gpt_neo_sites_equal_plain_forward_hooks(neo_store, trained_run, corpus):
    tok = AutoTokenizer.from_pretrained(str(trained_run))
    train = text_blocks(corpus["train"], tok, EXTRACT_OPTS[1])
    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK), dtype=torch.float64).eval()
    h = model.transformer.h
    feats = hooked(model, {"attn:0": h[0].attn, "mlp:1": h[1].mlp}, train)
    y = train[:, 1:].ravel()
    g = f"neo-2x32/{CK}"
    tree = ncanalyze.store.open(neo_store)
    assert sorted(tree[g]["sites"].children) == ["attn_0", "mlp_1"] and sorted(tree[g]["layers"].children) == ["1"]
    for group, site in ((f"{g}/sites/attn_0", "attn:0"), (f"{g}/sites/mlp_1", "mlp:1"), (f"{g}/layers/1", "resid:1"),
                        (g, "resid:2")):
        assert_same_metrics(neo_store, group, feats[site], y, site, model)
    # the check can tell: the attention output is not the residual stream around it
    assert not np.allclose(feats["attn:0"], feats["resid:1"] - feats["resid:0"])
    from ncanalyze.store.measure import measure_store

    df = measure_store(neo_store).table
    assert list(df.site) == ["attn:0", "resid:1", "mlp:1", "resid:2"] and list(df.layer) == [0.5, 1, 1.5, 2]
    out = run_cli("measure", neo_store, "--force").output
    assert all(s in out for s in ("attn:0", "mlp:1", "resid:1")), out
    assert "1,2,attn:0,mlp:1" in run_cli("ls", neo_store).output


@pytest.mark.slow
def test_residual_groups_are_bit_for_bit_those_of_layers(trained_run, corpus, tmp_path):
    """The same extraction with a sublayer site beside --layers 0: the checkpoint group and layers/0 bit for bit
    those of --layers 0 alone (attributes too, but the record naming the sites), several passes or one."""
    from conftest import assert_same_group

    args = ["extract", trained_run / CK, "--dataset", corpus["train"], "--max-train-tokens", 2048,
            "--max-val-tokens", 1024, "--samples-per-class", 2, "--layers", "0"]
    plain, sited = tmp_path / "plain.zarr", tmp_path / "sites.zarr"
    run_cli(*args, "--store", plain)
    run_cli(*args, "--sites", "mlp:0", "--layers-per-pass", "1", "--store", sited)
    g = f"neo-2x32/{CK}"
    for group in (g, f"{g}/layers/0"):
        a, b = read_group(plain, group), read_group(sited, group)
        assert set(a.variables) == set(b.variables)
        for name in a.variables:
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=f"{group} {name}")
        for k in ("config", "config_hash"):
            a.attrs.pop(k), b.attrs.pop(k)
        assert a.attrs == b.attrs
    assert read_group(sited, f"{g}/sites/mlp_0").attrs["site"] == "mlp:0"


@pytest.mark.slow
def test_sites_under_shards_equal_the_unsharded_run(trained_run, corpus, tmp_path):
    """``--shards 3`` with sublayer and residual sites: every site's group holds the unsharded run's counts, validation
    counts and reservoir bit for bit and its float64 statistics to 1e-12 (Chan's merge tree rounds otherwise than batch
    by batch), the same attributes; an explicit --layers-per-pass that splits the sites is one line before any work."""
    from conftest import EXACT

    sharded, whole = tmp_path / "sharded.zarr", tmp_path / "whole.zarr"
    args = ["extract", trained_run / CK, "--dataset", corpus["train"], *EXTRACT_OPTS, "--dtype", "float64", "--sites",
            "attn:0,mlp:-1,resid:1"]
    run_cli(*args, "--store", whole)
    run_cli(*args, "--store", sharded, "--shards", 3)
    g = f"neo-2x32/{CK}"
    for group in (g, f"{g}/sites/attn_0", f"{g}/sites/mlp_1", f"{g}/layers/1"):
        ref, got = read_group(whole, group), read_group(sharded, group)
        assert set(ref.variables) == set(got.variables), group
        for v in ref.variables:
            if v in EXACT or ref[v].dtype.kind not in "fc":  # the counts, the reservoir, the token names
                np.testing.assert_array_equal(got[v].values, ref[v].values, err_msg=f"{group} {v}")
            else:
                np.testing.assert_allclose(got[v].values, ref[v].values, rtol=1e-12, atol=1e-12 * float(
                    np.nanmax(np.abs(ref[v].values))), err_msg=f"{group} {v}")
        assert got.attrs == ref.attrs, group
    fails_cleanly([*args, "--layers-per-pass", 1, "--shards", 2], sharded, ["--layers-per-pass 1", "--shards"])


@pytest.mark.slow
def test_a_new_hook_point_is_one_entry_in_the_anatomy(trained_run, corpus, tmp_path, monkeypatch):
    """A newcomer's site kind, the MLP's input norm (GPT-Neo's ``ln_2``), added as one entry of anatomy.SUBLAYERS
    (in forward order: after the attention, before the MLP) and nothing else: ``--sites norm:1`` parses, orders,
    extracts and measures as plain forward hooks on ``ln_2`` with class_stats + measure give (1e-9)."""
    from ncanalyze.store.sources import anatomy

    mlp = anatomy.SUBLAYERS["mlp"]
    monkeypatch.setitem(anatomy.SUBLAYERS, "norm", ("ln_2", "post_attention_layernorm"))
    monkeypatch.delitem(anatomy.SUBLAYERS, "mlp")
    monkeypatch.setitem(anatomy.SUBLAYERS, "mlp", mlp)  # after the norm: the forward's order
    store = tmp_path / "norm.zarr"
    run_cli("extract", trained_run / CK, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS, "--dtype",
            "float64", "--sites", "mlp:1,norm:1,attn:1")
    tok = AutoTokenizer.from_pretrained(str(trained_run))
    train = text_blocks(corpus["train"], tok, EXTRACT_OPTS[1])
    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK), dtype=torch.float64).eval()
    feats = hooked(model, {"norm:1": model.transformer.h[1].ln_2}, train)
    g = f"neo-2x32/{CK}"
    assert_same_metrics(store, f"{g}/sites/norm_1", feats["norm:1"], train[:, 1:].ravel(), "norm:1", model)
    from ncanalyze.store.measure import measure_store

    table = measure_store(store).table.set_index("site")
    assert sorted(table.index) == ["attn:1", "mlp:1", "norm:1", "resid:2"] and table.layer["norm:1"] == 1.5
    from ncanalyze.store.extraction.layers import plan

    assert [str(s) for s in plan("last", n=2, sites="mlp:1,norm:1,attn:1").layers] == ["attn:1", "norm:1", "mlp:1",
                                                                                       "resid:2"]


@pytest.mark.slow
def test_sites_in_shards_resume_bit_for_bit_after_a_kill_in_the_validation_pass(trained_run, corpus, tmp_path):
    """The shards' merged state of every site, saved at the start of the validation pass: a run killed there resumes
    from it and ends bit for bit as the uninterrupted sharded run, every site's group."""
    from conftest import assert_same_group

    args = ["extract", trained_run / CK, "--dataset", corpus["train"], "--max-train-tokens", 2048,
            "--max-val-tokens", 1024, "--samples-per-class", 2, "--batch-size", 1, "--sites", "attn:0,mlp:1",
            "--layers", "0", "--shards", 2]
    ref, store = tmp_path / "ref.zarr", tmp_path / "killed.zarr"
    run_cli(*args, "--store", ref)
    kill_when([*args, "--state-every", 0, "--store", store], _state(store) / "neo-2x32" / f"{CK}.npz", batches=5,
              at={"phase": 1})
    assert "1 resumed" in run_cli(*args, "--store", store).output
    g = f"neo-2x32/{CK}"
    for group in (g, f"{g}/layers/0", f"{g}/sites/attn_0", f"{g}/sites/mlp_1"):
        assert_same_group(ref, store, group)


def checkpoint(store) -> str:
    """The store's one checkpoint group."""
    from ncanalyze.store.classifier import checkpoint_group
    from ncanalyze.store.io import checkpoint_groups

    return {checkpoint_group(g) for g in checkpoint_groups(store)[0]}.pop()


def _tiny(config, path, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    rng = np.random.default_rng(3)
    np.save(d / "train.npy", rng.integers(0, 61, (48, 16)).astype(np.int64))
    np.save(d / "val.npy", rng.integers(0, 61, (8, 16)).astype(np.int64))
    return {"model": _tiny(config, d / "llama-3x16"), "train": d / "train.npy", "val": d / "val.npy", "dir": d}


@pytest.mark.slow
def test_llama_sites_equal_plain_forward_hooks(llama, tmp_path):
    store = tmp_path / "llama.zarr"
    run_cli("extract", llama["model"], "--dataset", llama["train"], "--val-dataset", llama["val"], "--store", store,
            "--dtype", "float64", "--sites", "attn:1,mlp:2,resid:1", "--samples-per-class", 2, "--batch-size", 4)
    model = AutoModelForCausalLM.from_pretrained(str(llama["model"]), dtype=torch.float64).eval()
    layers = model.model.layers
    train = np.load(llama["train"])
    feats = hooked(model, {"attn:1": layers[1].self_attn, "mlp:2": layers[2].mlp}, train)
    y = train[:, 1:].ravel()
    g = checkpoint(store)
    for group, site in ((f"{g}/sites/attn_1", "attn:1"), (f"{g}/sites/mlp_2", "mlp:2"), (f"{g}/layers/1", "resid:1")):
        assert_same_metrics(store, group, feats[site], y, site, model)


@pytest.mark.parametrize("sites, words", [("ffn:0", ["ffn:0", "resid, attn, mlp"]),
                                          ("attn:2", ["attn:2", "0..1"]),
                                          ("mlp:-3", ["mlp:-3", "0..1"]),
                                          ("resid:3", ["resid:3", "0..2"]),
                                          ("attn", ["--sites", "kind:index"]),
                                          ("attn:one", ["--sites", "kind:index"])])
def test_bad_sites_are_one_line(sites, words):
    """An unknown kind, an index outside a 2-block model, a site that is not kind:index: one line naming it and
    the fix (the syntax as the setting is made, the rest where the model's depth is known)."""
    from ncanalyze.core.errors import UserError
    from ncanalyze.store.extraction.config import layer_plan
    from ncanalyze.store.extraction.settings import ExtractConfig

    with pytest.raises(UserError) as e:
        layer_plan(ExtractConfig(dataset="d", sites=sites), 2)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), e.value


def test_a_bad_site_stops_extract_before_any_work(kept_store, trained_run, corpus):
    fails_cleanly(["extract", trained_run / CK, "--dataset", corpus["train"], "--sites", "attn:0,mlp:2"], kept_store,
                  ["mlp:2", "0..1"])


@pytest.mark.slow
def test_a_site_the_architecture_lacks_is_one_line_before_any_work(kept_store, llama, tmp_path):
    """OPT's MLP is two linear layers inline in its block, not a module: mlp:0 is refused, attn:0 is not."""
    opt = _tiny(OPTConfig(vocab_size=61, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
                          max_position_embeddings=64, word_embed_proj_dim=16), tmp_path / "opt-2x16")
    args = ["extract", opt, "--dataset", llama["train"], "--val-dataset", llama["val"]]
    fails_cleanly([*args, "--sites", "mlp:0"], kept_store, ["mlp:0", "opt", "no mlp sublayer"])
    fails_cleanly([*args, "--sites", "mlp:0", "--shards", 2], kept_store, ["mlp:0", "opt", "no mlp sublayer"])
    run_cli(*args, "--sites", "attn:0", "--store", tmp_path / "ok.zarr", "--samples-per-class", 1)


@pytest.mark.slow
def test_a_sublayer_site_resumes_bit_for_bit_after_a_kill(llama, tmp_path):
    """Killed in the first pass (attn:1 alone) and in the second's validation pass: the resumed store equals the
    uninterrupted one bit for bit."""
    from conftest import assert_same_group

    args = ["extract", llama["model"], "--dataset", llama["train"], "--val-dataset", llama["val"],
            "--samples-per-class", 2, "--batch-size", 1, "--sites", "attn:1", "--layers-per-pass", 1]
    ref = tmp_path / "ref.zarr"
    run_cli(*args, "--store", ref)
    store = tmp_path / "killed.zarr"
    state = _state(store) / "llama-3x16" / "final.npz"
    args += ["--state-every", 0]
    for pass_, phase in ((0, 0), (1, 1)):
        kill_when([*args, "--store", store], state, batches=3, at={"pass": pass_, "phase": phase})
    r = run_cli(*args, "--store", store)
    assert "1 resumed" in r.output
    g = checkpoint(store)
    for group in (g, f"{g}/sites/attn_1"):
        assert_same_group(ref, store, group)


@pytest.mark.slow
def test_report_with_sites_keeps_the_last_layers_statistics_and_draws_each_kind(tmp_path):
    """A table with residual and sublayer rows (as measure_store gives them: attn:B, mlp:B at layer B + 0.5):
    stats.csv equals the report of the last-layer rows alone, layers.csv and report.html carry the site, the depth
    figure draws the sublayer kinds as lines of their own (dotted, dash-dotted)."""
    import json

    import pandas as pd
    from ncanalyze.analyzer.report import ReportOptions, write_report
    from ncanalyze.analyzer.report.depth import depth_figure
    from ncanalyze.analyzer.stats import METRICS
    from test_stats import study

    last = study(n_runs=3, per_run=4, seed=5).assign(n_layers=2)
    rng = np.random.default_rng(0)
    rows = [last.assign(layer=l, site=s, **{m: last[m] * rng.uniform(0.5, 2, len(last)) for m in METRICS})
            for l, s in ((0, "resid:0"), (0.5, "attn:0"), (1.5, "mlp:1"))]
    table = pd.concat([*rows, last.assign(layer=2, site="resid:2")], ignore_index=True)
    opts = ReportOptions(formats="png", n_perm=200, seed=1)
    plain = write_report(last.assign(layer=2, site="resid:2"), tmp_path / "plain", opts).files
    deep = write_report(table, tmp_path / "deep", opts).files
    pd.testing.assert_frame_equal(pd.read_csv(plain["stats"]), pd.read_csv(deep["stats"]))
    layers = pd.read_csv(deep["layers"])
    assert list(layers.columns[:5]) == ["run", "checkpoint", "global_step", "layer", "site"]
    assert set(layers.groupby(["run", "checkpoint"]).site.apply(tuple)) == {("resid:0", "attn:0", "mlp:1", "resid:2")}
    page = deep["html"].read_text(encoding="utf-8")
    data = json.loads(page.split('<script id="ncanalyze-data" type="application/json">')[1].split("</script>")[0])
    assert data["layers"] == [0, 0.5, 1.5, 2] and data["rows"]["site"] == list(table.site)  # the page's depth plot
    fig = depth_figure(table, metrics=["nc1_cdnv"])
    styles = sorted({(line.get_linestyle(), len(line.get_xdata())) for line in fig.axes[0].lines})
    assert styles == [("-", 2), ("-.", 1), (":", 1)]  # per checkpoint: resid 0 and 2; mlp:1; attn:0
    assert "attn/mlp" in fig.axes[0].get_xlabel()


@pytest.mark.slow
def test_the_callback_measures_sites_as_extract_does(corpus, tmp_path):
    """``NeuralCollapseCallback(..., sites=...)``: the sublayer groups of step 10 equal extract --sites of the
    checkpoint saved then (1e-12), and their metrics reach the Trainer's logs as ``nc/<kind>_<B>/<metric>``."""
    from test_training import train

    from ncanalyze.training import NeuralCollapseCallback

    small = {"max_train_tokens": 512, "max_val_tokens": 256, "batch_size": 4, "samples_per_class": 2}
    cb = NeuralCollapseCallback(tmp_path / "live.zarr", str(corpus["train"]), str(corpus["val"]),
                                sites="attn:0,mlp:1", **small)
    trainer = train(corpus, tmp_path / "neo", [cb], steps=10, give_trainer=True)
    run_cli("extract", tmp_path / "neo" / "checkpoint-10", "--dataset", corpus["train"], "--val-dataset",
            corpus["val"], "--store", tmp_path / "ckpt.zarr", "--sites", "attn:0,mlp:1",
            *(x for k, v in small.items() for x in (f"--{k.replace('_', '-')}", v)))
    for site in ("attn_0", "mlp_1"):
        a = read_group(tmp_path / "live.zarr", f"neo/step-10/sites/{site}")
        b = read_group(tmp_path / "ckpt.zarr", f"neo/checkpoint-10/sites/{site}")
        assert a.attrs["site"] == b.attrs["site"] == site.replace("_", ":")
        np.testing.assert_array_equal(a["count"].values, b["count"].values)
        np.testing.assert_array_equal(a["val_ncc_agree"].values, b["val_ncc_agree"].values)
        for name in ("mean", "variance", "within_covariance"):
            np.testing.assert_allclose(a[name].values, b[name].values, rtol=0, atol=1e-12, err_msg=name)
    logged = {k for e in trainer.state.log_history for k in e}
    assert {"nc/attn_0/nc1_cdnv", "nc/mlp_1/nc1_cdnv"} <= logged, logged


@pytest.mark.slow
def test_a_sublayer_site_with_the_current_token_as_label(trained_run, corpus, tmp_path):
    """--sites with --labels current: every position of a block (the last included), its own token the class, at the
    attention output of block 1, equal to the hooked features' class_stats + measure (1e-9)."""
    store = tmp_path / "current.zarr"
    run_cli("extract", trained_run / CK, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS,
            "--dtype", "float64", "--sites", "attn:1", "--labels", "current")
    tok = AutoTokenizer.from_pretrained(str(trained_run))
    train = text_blocks(corpus["train"], tok, EXTRACT_OPTS[1])
    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK), dtype=torch.float64).eval()
    got = {}
    hook = model.transformer.h[1].attn.register_forward_hook(lambda m, a, o: got.setdefault("h", []).append(o[0]))
    with torch.no_grad():
        for s in range(0, len(train), 8):
            model(torch.from_numpy(train[s:s + 8]))
    hook.remove()
    H = torch.cat(got["h"]).reshape(-1, 32).double().numpy()
    assert read_group(store, f"neo-2x32/{CK}/sites/attn_1").attrs["labels"] == "current"
    assert_same_metrics(store, f"neo-2x32/{CK}/sites/attn_1", H, train.ravel(), "attn:1", model)
