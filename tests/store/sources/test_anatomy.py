"""Every supported architecture through ``store/sources/anatomy.py``: its layers and positions, its blocks, its final
norm, its head and the logit transform after it give, together, exactly what the model's own forward gives. A new
architecture is supported when it passes here (random-initialised, tiny, no download)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from ncanalyze.store.sources.anatomy import (
    LogitTransform,
    blocks_of,
    default_block_size,
    features,
    final_norm,
    head,
    hidden_forward,
    model_positions,
    n_layers,
)
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    CohereConfig,
    FalconConfig,
    Gemma2Config,
    GPT2Config,
    GPTNeoConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    OlmoConfig,
    OPTConfig,
    PhiConfig,
    Qwen2Config,
)

LAYERS = 3
COMMON = dict(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
              max_position_embeddings=64)
ARCHITECTURES = {  # name -> (config, the transform it declares)
    "gpt2": (GPT2Config(vocab_size=97, n_embd=16, n_layer=LAYERS, n_head=2, n_positions=64), "none"),
    "gpt-neo": (GPTNeoConfig(vocab_size=97, hidden_size=16, num_layers=LAYERS, num_heads=2, attention_types=[
        [["global", "local"], 1], [["global"], 1]], window_size=8, max_position_embeddings=64), "none"),
    "llama": (LlamaConfig(**COMMON, num_key_value_heads=1, tie_word_embeddings=False), "none"),
    "mistral": (MistralConfig(**COMMON, num_key_value_heads=1, sliding_window=8), "none"),
    "gpt-neox": (GPTNeoXConfig(**COMMON), "none"),
    "opt": (OPTConfig(vocab_size=97, hidden_size=16, ffn_dim=32, num_hidden_layers=LAYERS, num_attention_heads=2,
                      max_position_embeddings=64, word_embed_proj_dim=16), "none"),
    "gemma2": (Gemma2Config(**COMMON, num_key_value_heads=1, head_dim=8, final_logit_softcapping=2.0,
                            initializer_range=0.5), "2.0 * tanh(logits / 2.0)"),
    "cohere": (CohereConfig(**COMMON, num_key_value_heads=1, logit_scale=0.25), "logits * 0.25"),
    "qwen2": (Qwen2Config(**COMMON, num_key_value_heads=1), "none"),
    "olmo": (OlmoConfig(**COMMON), "none"),
    "falcon": (FalconConfig(vocab_size=97, hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2), "none"),
    "phi": (PhiConfig(**COMMON), "none"),
    "bloom": (BloomConfig(vocab_size=97, hidden_size=16, n_layer=LAYERS, n_head=2), "none"),
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def model(request):
    config, want = ARCHITECTURES[request.param]
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    m.expected_transform = want
    return m


@pytest.fixture(scope="module")
def ids(model):
    return torch.from_numpy(np.random.default_rng(1).integers(0, 97, (2, 12)))


def test_layers_and_blocks(model):
    assert n_layers(model.config) == LAYERS
    blocks = blocks_of(model)
    assert blocks is not None and len(blocks) == LAYERS


def test_positions(model):
    n = model_positions(model.config)
    assert n is None or n > 0
    assert default_block_size(model.config) == min(n or 1024, 1024)


def test_last_layer_features_are_the_output_layers_input(model, ids):
    """features() is the base model's last hidden state, after the final norm: the head applied to it, then the
    declared transform, is the model's own logits."""
    with torch.no_grad():
        own = model(input_ids=ids).logits[:, :-1]
        h = features(model, ids)
    W, b = head(model)
    assert W.shape == (97, 16) and W.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    transform = LogitTransform.of(model.config)
    assert transform.describe() == model.expected_transform
    ours = transform(h @ W.T + (0 if b is None else b))
    np.testing.assert_allclose(ours.numpy(), own.numpy(), rtol=0, atol=1e-10 * float(own.abs().max()))


def test_final_norm_is_what_the_last_hidden_state_went_through(model, ids):
    """The final norm (the logit lens below the last layer) is found, and the output of the last block through it is
    the last hidden state."""
    path, norm = final_norm(model)
    with torch.no_grad():
        out = model.base_model(input_ids=ids, output_hidden_states=True)
        got = {}
        hook = blocks_of(model)[-1].register_forward_hook(lambda m, a, o: got.update(h=o[0] if isinstance(o, tuple)
                                                                                     else o))
        model.base_model(input_ids=ids)
        hook.remove()
        np.testing.assert_allclose(norm(got["h"]).numpy(), out.last_hidden_state.numpy(), rtol=0, atol=1e-12)
    assert path in ("ln_f", "norm", "final_layer_norm", "decoder.final_layer_norm", "final_layernorm", "norm_f")


def test_the_forward_cut_at_a_block_is_bit_identical_and_runs_no_later_block(model, ids):
    with torch.no_grad():
        want = model(input_ids=ids, output_hidden_states=True).hidden_states
    ran = []
    hooks = [b.register_forward_hook(lambda m, a, o, j=j: ran.append(j)) for j, b in enumerate(blocks_of(model))]
    try:
        for layers in [(0,), (1,), (0, 2), (2,)]:
            f = hidden_forward(model, layers, LAYERS)
            f(ids)  # the first call is checked against the whole forward
            ran.clear()
            h = f(ids)
            assert ran == list(range(max(layers))), (layers, ran)
            for i, l in enumerate(layers):
                np.testing.assert_array_equal(h[i].numpy(), want[l][:, :-1].numpy())
    finally:
        for hook in hooks:
            hook.remove()


LACKS = {"opt": {"mlp"}, "bloom": {"attn", "mlp"}}  # OPT's MLP is inline in its block; BLOOM's add the residual inside


def test_sublayer_sites_are_what_the_block_adds_to_its_input(model, ids):
    """attn:B and mlp:B (hooked by hidden_forward, cut at the deepest or not) add up with the block's input to its
    output, as a block computes it (Gemma-2 through its post-sublayer norms): the sublayers' outputs before their
    residual add; cut after mlp:B, no later block runs. An architecture without such a module is one line
    (check_sites)."""
    from ncanalyze.core.errors import UserError
    from ncanalyze.store.extraction.sites import Site, parse_sites
    from ncanalyze.store.sources.anatomy import check_sites

    kind = model.config.model_type
    if kind in LACKS:
        for k in LACKS[kind]:
            with pytest.raises(UserError, match=f"{kind} has no {k} sublayer"):
                check_sites(model, [Site(k, 0)])
        return
    blocks = blocks_of(model)
    outs = {}
    hooks = [b.register_forward_hook(lambda m, a, o, j=j: outs.__setitem__(j, o[0] if isinstance(o, tuple) else o))
             for j, b in enumerate(blocks)]
    with torch.no_grad():
        model.base_model(input_ids=ids)
    for h in hooks:
        h.remove()
    last = Site("resid", LAYERS)
    for b in range(LAYERS):
        sites = tuple(parse_sites(f"resid:{b},attn:{b},mlp:{b}", LAYERS))
        check_sites(model, sites)
        for plan in (sites, (*sites, last)):  # cut after mlp:B, and the whole forward
            f = hidden_forward(model, plan, last)
            f(ids)  # the first call checks the cut against the whole forward
            ran = []
            hooks = [k.register_forward_pre_hook(lambda m, a, j=j: ran.append(j)) for j, k in enumerate(blocks)]
            x, attn, mlp = f(ids)[:3]
            for h in hooks:
                h.remove()
            assert ran == list(range(b + 1 if plan == sites else LAYERS)), (plan, ran)
            if kind == "gemma2":
                norms = blocks[b].post_attention_layernorm, blocks[b].post_feedforward_layernorm
                with torch.no_grad():
                    attn, mlp = norms[0](attn), norms[1](mlp)
            np.testing.assert_allclose((x + attn + mlp).numpy(), outs[b][:, :-1].numpy(), rtol=0, atol=1e-12)
