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
from transformers import (AutoModelForCausalLM, BloomConfig, FalconConfig, Gemma2Config, GPTNeoXConfig, LlamaConfig,
                          OlmoConfig, OPTConfig, PhiConfig, Qwen2Config)

from ncanalyze.store.layers import plan
from ncanalyze.store.passes import blocks_of, hidden_forward

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
    from ncanalyze.store.layers import auto_groups

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
    from ncanalyze.store.memory import parse_size

    assert parse_size("40GB") == 40 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5 GiB") == 3 * 2**29 and parse_size("100") == 100 and parse_size(None) is None
    for bad in ("", "GB", "-1GB", "12 parsecs", "1e400GB", "0"):
        with pytest.raises(UserError, match="--state-memory"):
            parse_size(bad)


def test_auto_under_a_small_state_memory_equals_one_pass_bit_for_bit(trained_run, corpus, tmp_path):
    from conftest import EXTRACT_OPTS, assert_same_group, run_cli

    from ncanalyze.store.memory import state_bytes

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
    from test_extract_reliability import _state

    from ncanalyze.store.memory import state_bytes

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

    from ncanalyze.store.memory import state_bytes

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
    from ncanalyze.store.load import head
    from ncanalyze.store.loss import LogitTransform, NextTokenLoss
    from ncanalyze.store.passes import features

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
    both.update(h, y, lambda hc, yc, logits: shared.count(hc, yc, logits[:, shared.kept]))
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
    logger = logging.getLogger("ncanalyze.store.passes")  # the CLI's logging setup may stop propagation to root
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="ncanalyze.store.passes"):
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
