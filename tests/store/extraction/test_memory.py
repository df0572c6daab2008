"""The frontier's extraction side (issue 24): a pass below the last layer runs the model only up to its deepest
layer, bit for bit the hidden states ``output_hidden_states`` gives, on a real Trainer checkpoint (GPT-Neo) and on
random-initialised Llama (at V = 128,256), GPT-NeoX, OPT, Gemma-2, Qwen2, OLMo, Falcon, Phi and BLOOM shapes;
``--layers-per-pass auto`` groups the layers so each pass's float64 state fits ``--state-memory``, equal to one pass
bit for bit; the loss and NC4 share the head's float64 logits."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from ncanalyze.store.extraction.layers import plan
from ncanalyze.store.extraction.passes import blocks_of, hidden_forward
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    Gemma2Config,
    GPTNeoXConfig,
    LlamaConfig,
    OlmoConfig,
    OPTConfig,
    PhiConfig,
    Qwen2Config,
)

CK = "checkpoint-40"


def ran(model) -> tuple[list[int], list[str]]:
    """Hooks that record the blocks that run (their index) and whether the final norm or the head runs."""
    blocks, other = [], []
    for j, b in enumerate(blocks_of(model)):
        b.register_forward_hook(lambda m, a, o, j=j: blocks.append(j))
    model.get_output_embeddings().register_forward_hook(lambda m, a, o: other.append("head"))
    return blocks, other


def check_cut(model, n: int, ids: torch.Tensor) -> None:
    """Every plan of layers below the last: bit for bit ``hidden_states``, and the blocks up to the deepest alone."""
    with torch.no_grad():
        want = model(ids, output_hidden_states=True).hidden_states
    for layers in [(0,), (1,), (0, 1), (1, n - 1), tuple(range(n))]:
        h = hidden_forward(model, layers, n)(ids)
        for i, l in enumerate(layers):
            np.testing.assert_array_equal(h[i].numpy(), want[l][:, :-1].numpy(), err_msg=f"layers {layers}")
    blocks, other = ran(model)
    for layers in [(0,), (1,), (0, n - 1), (n - 1,)]:
        f = hidden_forward(model, layers, n)
        f(ids)  # checked against the whole forward on its first call
        blocks.clear(), other.clear()
        f(ids)
        assert blocks == list(range(layers[-1])) and other == [], (layers, blocks, other)
    blocks.clear()
    hidden_forward(model, (n,), n)(ids)  # the last layer runs every block
    assert blocks == list(range(n))


def test_a_pass_below_the_last_layer_stops_at_its_deepest_block(trained_run):
    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK), dtype=torch.float32).eval()
    ids = torch.arange(3 * 20).reshape(3, 20) * 7 % model.config.vocab_size
    check_cut(model, 2, ids)


@pytest.mark.parametrize("config", [
    LlamaConfig(vocab_size=128_256, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False),
    GPTNeoXConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                  max_position_embeddings=64),
    OPTConfig(vocab_size=512, hidden_size=16, ffn_dim=32, num_hidden_layers=4, num_attention_heads=2,
              max_position_embeddings=64, word_embed_proj_dim=16),
    Gemma2Config(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8, max_position_embeddings=64),
    Qwen2Config(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64),
    OlmoConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
               max_position_embeddings=64),
    FalconConfig(vocab_size=512, hidden_size=16, num_hidden_layers=4, num_attention_heads=2),
    PhiConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
              max_position_embeddings=64),
    BloomConfig(vocab_size=512, hidden_size=16, n_layer=4, n_head=2),
], ids=["llama-128k", "gpt-neox", "opt", "gemma2", "qwen2", "olmo", "falcon", "phi", "bloom"])
def test_the_cut_is_bit_identical_on_modern_architectures(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 24))
    check_cut(model, 4, ids)


def test_auto_groups_fit_the_budget_exactly_and_keep_the_deepest_layers_together():
    from ncanalyze.analyzer import UserError
    from ncanalyze.store.extraction.layers import auto_groups

    nine = plan("all", "auto", 0, "float32", 8)
    assert nine.auto and nine.passes == [tuple(range(9))]  # not fitted yet: one pass
    per_layer, shared = 1000, 77
    for k, want in [(9, [tuple(range(9))]), (4, [(0,), (1, 2, 3, 4), (5, 6, 7, 8)]), (3, [(0, 1, 2), (3, 4, 5),
                    (6, 7, 8)]), (1, [(l,) for l in range(9)])]:
        assert auto_groups(nine, per_layer, shared, shared + k * per_layer).passes == want  # k layers fit exactly
        if k > 1:  # a byte less: one layer fewer per pass
            assert auto_groups(nine, per_layer, shared, shared + k * per_layer - 1).widest_pass == k - 1
    with pytest.raises(UserError, match="--state-memory"):
        auto_groups(nine, per_layer, shared, shared + per_layer - 1)
    fixed = plan("all", 4, 0, "float32", 8)  # an explicit integer keeps its meaning: from the first layer
    assert auto_groups(fixed, 1, 0, 1) is fixed and fixed.passes == [(0, 1, 2, 3), (4, 5, 6, 7), (8,)]


def test_state_memory_sizes():
    from ncanalyze.analyzer import UserError
    from ncanalyze.store.extraction.memory import parse_size

    assert parse_size("40GB") == 40 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5 GiB") == 3 * 2**29 and parse_size("100") == 100 and parse_size(None) is None
    for bad in ("", "GB", "-1GB", "12 parsecs", "1e400GB", "0"):
        with pytest.raises(UserError, match="--state-memory"):
            parse_size(bad)


def test_auto_under_a_small_state_memory_equals_one_pass_bit_for_bit(trained_run, corpus, tmp_path):
    from conftest import EXTRACT_OPTS, assert_same_group, run_cli
    from ncanalyze.store.extraction.memory import state_bytes

    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK))
    vocab, dim = model.get_output_embeddings().weight.shape
    per_layer, shared = state_bytes(vocab, dim, 4, torch.device("cpu"))
    args = ["extract", trained_run / CK, "--dataset", corpus["train"], *EXTRACT_OPTS, "--layers", "all"]
    one, auto = tmp_path / "one.zarr", tmp_path / "auto.zarr"
    run_cli(*args, "--store", one, "--layers-per-pass", "auto")
    r = run_cli(*args, "--store", auto, "--state-memory", str(shared + per_layer + 1))
    assert "3 passes of at most 1 layers (0; 1; 2)" in r.output
    for g in [f"neo-2x32/{CK}", f"neo-2x32/{CK}/layers/0", f"neo-2x32/{CK}/layers/1"]:
        assert_same_group(one, auto, g)  # the attributes too: the same config record and hash
    r = run_cli(*args, "--store", auto, "--state-memory", "100GB")  # another memory: the same configuration
    assert "0 extracted, 0 resumed, 1 already in" in r.output


def test_auto_resumes_with_the_passes_it_saved_under_another_memory(trained_run, corpus, tmp_path):
    """Killed in its second pass of three, then resumed where one pass would fit: the saved groups are kept (the
    finished layer is not thrown away), and the result is one pass's bit for bit."""
    from conftest import assert_same_group, kill_when, run_cli
    from ncanalyze.store.extraction.memory import state_bytes
    from test_extract_reliability import _state

    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK))
    per_layer, shared = state_bytes(*model.get_output_embeddings().weight.shape, 8, torch.device("cpu"))
    args = ["extract", trained_run / CK, "--dataset", corpus["train"], "--max-train-tokens", 4096,
            "--max-val-tokens", 2048, "--batch-size", 1, "--state-every", 0, "--layers", "all"]
    one, store = tmp_path / "one.zarr", tmp_path / "killed.zarr"
    run_cli(*args, "--store", one)
    state = _state(store) / "neo-2x32" / f"{CK}.npz"
    kill_when([*args, "--store", store, "--state-memory", shared + per_layer + 1], state, at={"pass": 1, "phase": 0})
    with np.load(state) as s:
        assert json.loads(str(s["passes"])) == [[0], [1], [2]] and int(s["pass"]) == 1
    r = run_cli(*args, "--store", store)
    assert "1 resumed" in r.output
    for g in [f"neo-2x32/{CK}", f"neo-2x32/{CK}/layers/0", f"neo-2x32/{CK}/layers/1"]:
        assert_same_group(one, store, g)


def test_a_llama_shape_at_the_real_vocabulary_in_auto_passes_equals_one_pass(tmp_path):
    """A Llama-shaped model at V = 128,256 (width 16, 4 blocks), random-initialised from its config, ``--layers all``
    under a ``--state-memory`` of two layers: three passes, every layer's group one pass's bit for bit."""
    from conftest import assert_same_group, run_cli
    from ncanalyze.store.extraction.memory import state_bytes

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128_256, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    rng = np.random.default_rng(0)
    zipf = np.minimum(rng.zipf(1.2, (64, 33)), config.vocab_size) - 1  # hot classes and a long tail
    np.save(tmp_path / "train.npy", zipf.astype(np.int64))
    np.save(tmp_path / "val.npy", rng.integers(0, config.vocab_size, (8, 33)))
    per_layer, shared = state_bytes(config.vocab_size, 16, 1, torch.device("cpu"))
    args = ["extract", tmp_path / "llama", "--dataset", tmp_path / "train.npy", "--val-dataset", tmp_path / "val.npy",
            "--layers", "all", "--samples-per-class", 1, "--batch-size", 16]
    run_cli(*args, "--store", tmp_path / "one.zarr")
    r = run_cli(*args, "--store", tmp_path / "auto.zarr", "--state-memory", shared + 2 * per_layer + 1)
    assert "3 passes of at most 2 layers (0; 1,2; 3,4)" in r.output
    for g in ["llama/final", *(f"llama/final/layers/{l}" for l in range(4))]:
        assert_same_group(tmp_path / "one.zarr", tmp_path / "auto.zarr", g)


def test_the_loss_and_nc4_share_the_heads_logits_with_the_same_counts(trained_run):
    """The last layer's NC4 decisions read the kept columns of the float64 logits the loss forms: the counts equal
    those of the decisions' own scores and of a numpy brute force, the loss is bit for bit the loss alone."""
    from ncanalyze.analyzer.accumulate import DecisionCounts
    from ncanalyze.store.extraction.loss import LogitTransform, NextTokenLoss
    from ncanalyze.store.extraction.passes import features
    from ncanalyze.store.sources.load import head

    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK), dtype=torch.float32).eval()
    W, b = head(model)
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, W.shape[0], (6, 32)))
    h, y = features(model, ids).reshape(-1, W.shape[1]), ids[:, 1:].reshape(-1)
    V = W.shape[0]
    mean = torch.zeros(V, W.shape[1], dtype=torch.float64).index_add_(0, y, h.double())
    count = torch.bincount(y, minlength=V)
    mean[count > 0] /= count[count > 0, None]
    kept = torch.nonzero(count > 0).squeeze(1)
    own, shared = DecisionCounts(W, b, mean, kept), DecisionCounts(W, b, mean, kept)
    alone, both = (NextTokenLoss(W, b, LogitTransform.of(model.config), budget=V * 50) for _ in range(2))
    own.update(h, y)
    alone.update(h, y)
    both.update(h, y, lambda hc, yc, logits: shared.count(hc, yc, shared.decide(logits)))
    for n in DecisionCounts.NAMES:
        assert torch.equal(own.counts[n], shared.counts[n]), n
    for n in NextTokenLoss.NAMES:
        assert torch.equal(alone.state[n], both.state[n]), n
    H, Wn, M = h.double().numpy(), W.double().numpy(), mean.numpy()
    bn = np.zeros(V) if b is None else b.double().numpy()
    k, yn = kept.numpy(), y.numpy()
    linear = k[(H @ Wn[k].T + bn[k]).argmax(1)]
    ncc = k[((H[:, None] - M[k][None]) ** 2).sum(-1).argmin(1)]
    assert shared.counts["val_count"].sum() == len(yn)
    np.testing.assert_array_equal(shared.counts["val_correct"].numpy(), np.bincount(yn[linear == yn], minlength=V))
    np.testing.assert_array_equal(shared.counts["val_ncc_agree"].numpy(), np.bincount(yn[linear == ncc], minlength=V))


def test_a_model_that_cannot_be_cut_runs_the_whole_forward_with_a_note(trained_run, caplog):
    """A steering hook that changes block 1's input inside the block call (so ``hidden_states[1]`` is not block 1's
    input as it runs): the first batch's check finds the cut differs, and the pass runs the whole forward."""
    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK), dtype=torch.float32).eval()
    blocks_of(model)[1].register_forward_pre_hook(lambda m, args: (args[0] * 2, *args[1:]))
    ids = torch.arange(2 * 16).reshape(2, 16) % model.config.vocab_size
    with torch.no_grad():
        want = model(ids, output_hidden_states=True).hidden_states
    blocks, other = ran(model)
    logger = logging.getLogger("ncanalyze.store.extraction.passes")  # the CLI's logging setup may stop propagation to root
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="ncanalyze.store.extraction.passes"):
            h = hidden_forward(model, (1,), 2)(ids)
    finally:
        logger.removeHandler(caplog.handler)
    assert "cannot be cut" in caplog.text
    np.testing.assert_array_equal(h[0].numpy(), want[1][:, :-1].numpy())
    blocks.clear()
    f = hidden_forward(model, (0,), 2)
    f(ids)
    blocks.clear()
    f(ids)  # block 0's input is untouched by the hook: that cut holds
    assert blocks == []


def _held_bytes(*roots) -> int:
    """The bytes of every distinct torch storage and numpy buffer reachable from ``roots`` (through lists, tuples,
    dicts and ncanalyze objects): what the running state holds in fact, each buffer once."""
    buffers: dict[int, int] = {}
    seen: set[int] = set()

    def walk(o) -> None:
        if id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            buffers[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, np.ndarray):
            base = o if o.base is None else o.base
            buffers[base.ctypes.data] = base.nbytes
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif type(o).__module__.startswith("ncanalyze"):
            walk(vars(o))
    for r in roots:
        walk(r)
    return sum(buffers.values())


def test_state_bytes_is_what_a_validation_pass_holds():
    """An extraction's running state of 3 layers in its validation pass (every class kept, a float32 head with a
    bias): the
    buffers it holds, measured, are state_bytes' per layer x 3 + shared within 0.1% (no hidden copy of the means or
    of the head: the loss and the layers share one float64 head)."""
    from ncanalyze.store.extraction.loss import LogitTransform, NextTokenLoss
    from ncanalyze.store.extraction.memory import state_bytes
    from ncanalyze.store.extraction.passes import val_state
    from ncanalyze.store.extraction.running import Extraction

    V, d, k = 3000, 48, 2
    plan3 = plan("all", "auto", 0, "float32", 2)
    ex = Extraction(plan3, V, d, k, 0, torch.device("cpu"), None)
    for s in ex.layers.values():
        s.stats.update(torch.randn(2 * V, d), torch.arange(2 * V) % V)  # every class seen: every class kept
    W, bias = torch.randn(V, d), torch.randn(V)
    counts, head = val_state(ex, W, bias, 1, torch.nn.LayerNorm(d))
    loss = NextTokenLoss(*head, LogitTransform(), state=ex.main().lm)
    assert loss.w is head[0] and all(c.w is head[0] and c.mean is s.stats.mean
                                     for c, s in zip(counts, ex.layers.values()))
    held = _held_bytes(ex.layers, counts, loss)
    per_layer, shared = state_bytes(V, d, k, torch.device("cpu"))
    # within 0.1% (the loss's 0-d sums are not counted): one more V x d float64 copy would be 13% more
    assert abs(held - (3 * per_layer + shared)) <= 1e-3 * held, (held, 3 * per_layer + shared)


def test_the_8b_shape_fits_in_three_passes_on_one_80gb_gpu():
    """Llama-3.1-8B: 33 hidden states, V = 128,256, d = 4,096, samples on the CPU. An 80 GiB H100 holding the bf16
    weights (8.03e9 parameters x 2 bytes = 16.1 GB) has 85.90e9 - 16.1e9 = 69.80e9 bytes free; state_budget's margin
    takes a tenth (6.98e9), leaving 62.82e9. A layer's state is 128,256 x 4,096 x 8 (4.20e9, the float64 means) +
    4,096^2 x 8 (0.13e9, the scatter) + 6 x 128,256 x 8 (per-class vectors) + 4,096 x 8 = 4.343e9; shared, the float64
    head 4.20e9 + 2 x 128,256 x 8. (62.82e9 - 4.205e9) / 4.343e9 = 13.5: 13 layers a pass, 3 passes (the formula that
    counted two V x d float64 copies a layer gave 6)."""
    from ncanalyze.store.extraction.memory import budget_of, fit_plan, state_bytes

    V, d = 128_256, 4_096
    budget = budget_of(80 * 2**30 - 16_100_000_000)
    assert budget == 69_799_345_920 - 6_979_934_592
    per_layer, shared = state_bytes(V, d, 8, torch.device("cuda"))
    assert per_layer == 4_343_099_392 and shared == 4_204_744_704
    fitted = fit_plan(plan("all", "auto", 0, "float32", 32), V, d, 8, torch.device("cuda"), budget, 2**50)
    assert len(fitted.passes) == 3 and fitted.widest_pass == 13
    assert [l for p in fitted.passes for l in p] == list(range(33))
    assert fitted.passes[-1] == tuple(range(20, 33))


def test_beside_a_gpu_the_hosts_memory_for_the_reservoirs_bounds_the_layers_a_pass():
    """The reservoir lives on the host whatever the device: V x samples x (4d + 16) bytes a layer. On the H100
    machine's 128 GiB host (budget_of: 137.44e9 less a tenth, 123.69e9), the 8B shape with 2 samples per class takes
    128,256 x 2 x 16,400 = 4.207e9 a layer: 29 layers, so the GPU's 13 bind (3 passes); with the default 8, 16.83e9 a
    layer: 7 layers a pass, 5 passes, said in the log; a host that cannot hold one layer's reservoir is one line."""
    from ncanalyze.analyzer.errors import UserError
    from ncanalyze.store.extraction.memory import budget_of, fit_plan, host_bytes

    V, d, cuda = 128_256, 4_096, torch.device("cuda")
    gpu, host = budget_of(80 * 2**30 - 16_100_000_000), budget_of(128 * 2**30)
    assert host == 123_695_058_125 and host_bytes(V, d, 8, cuda) == 16_827_187_200
    assert host_bytes(V, d, 8, torch.device("cpu")) == 0  # on the CPU state_bytes counts it
    layered = plan("all", "auto", 0, "float32", 32)
    two = fit_plan(layered, V, d, 2, cuda, gpu, host)
    assert len(two.passes) == 3 and two.widest_pass == 13
    eight = fit_plan(layered, V, d, 8, cuda, gpu, host)
    assert eight.widest_pass == 7 and len(eight.passes) == 5 and [l for p in eight.passes for l in p] == list(range(33))
    assert eight.passes[-1] == tuple(range(26, 33))
    with pytest.raises(UserError, match="reservoir of one layer .*--samples-per-class 8.* lower --samples-per-class"):
        fit_plan(layered, V, d, 8, cuda, gpu, 10 * 2**30)
    assert fit_plan(layered, V, d, 0, cuda, gpu, 0).widest_pass == 13  # no samples: nothing on the host


def _nc4_numpy(W, b, M, kept, H, Z, y):
    """NC4's three counts by brute force in numpy float64: argmax over the kept classes of W z + b, and the nearest
    kept class mean to h by squared distance."""
    V = W.shape[0]
    linear = kept[(Z @ W[kept].T + b[kept]).argmax(1)]
    ncc = kept[((H[:, None] - M[kept][None]) ** 2).sum(-1).argmin(1)]
    return {"val_count": np.bincount(y, minlength=V), "val_correct": np.bincount(y[linear == y], minlength=V),
            "val_ncc_agree": np.bincount(y[linear == ncc], minlength=V)}


def _nc4_previous(W, b, M, kept, H, Z, y):
    """The previous path (before the tiles): the kept head rows and the kept means copied, one argmax over all."""
    V = W.shape[0]
    w, mu = W[kept], M[kept]
    linear = kept[(Z @ w.T + b[kept]).argmax(1)]
    ncc = kept[(H @ mu.T - 0.5 * (mu * mu).sum(1)).argmax(1)]
    return {"val_count": torch.bincount(y, minlength=V), "val_correct": torch.bincount(y[linear == y], minlength=V),
            "val_ncc_agree": torch.bincount(y[linear == ncc], minlength=V)}


@pytest.mark.parametrize("budget", [1 << 25, 7 * 24, 24], ids=["one-tile", "tiles-of-7", "tiles-of-1"])
def test_nc4_over_tiles_of_classes_equals_brute_force_and_the_previous_path(budget):
    """NC4's counts with the classes scored a tile at a time (and through a lens) equal a numpy float64 brute force
    and the previous path (the kept rows copied, one argmax), on well-separated and on near-collapsed classes."""
    from ncanalyze.analyzer.accumulate import DecisionCounts

    rng = np.random.default_rng(5)
    V, d, n = 40, 24, 300
    kept = torch.from_numpy(np.sort(rng.choice(V, 29, replace=False)))
    lens = torch.nn.LayerNorm(d).double()
    for spread in (1.0, 1e-3):
        W = torch.from_numpy(rng.normal(size=(V, d)))
        b = torch.from_numpy(rng.normal(size=V))
        M = torch.from_numpy(rng.normal(size=(V, d)) * spread)
        y = torch.from_numpy(rng.integers(0, V, n))
        H = M[y] + torch.from_numpy(rng.normal(size=(n, d))) * spread
        c = DecisionCounts(W, b, M, kept, budget=budget, lens=lens)
        assert c.tile == max(1, budget // d) if budget < 1 << 25 else c.tile >= len(kept)
        c.update(H, y)
        with torch.no_grad():
            Z = lens(H)
        want = _nc4_numpy(W.numpy(), b.numpy(), M.numpy(), kept.numpy(), H.numpy(), Z.numpy(), y.numpy())
        previous = _nc4_previous(W, b, M, kept, H, Z, y)
        for name in DecisionCounts.NAMES:
            np.testing.assert_array_equal(c.counts[name].numpy(), want[name], err_msg=f"{name} at spread {spread}")
            assert torch.equal(c.counts[name], previous[name]), name
        assert 0 < int(c.counts["val_ncc_agree"].sum()) and 0 < int(c.counts["val_correct"].sum())
