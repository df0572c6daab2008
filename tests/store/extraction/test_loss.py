"""val_loss and val_accuracy of the validation pass against the model's own loss (float64), with each logit
transform: none (GPT-Neo), Gemma2's final_logit_softcapping, Cohere's logit_scale."""
from __future__ import annotations

from dataclasses import replace

import ncanalyze.store
import numpy as np
import pytest
import torch
from conftest import EXTRACT_OPTS, run_cli
from ncanalyze.store.extraction.loss import LogitTransform, matches_model
from ncanalyze.store.extraction.passes import features
from test_extract import text_blocks
from transformers import AutoModelForCausalLM, AutoTokenizer, CohereConfig, Gemma2Config


def model_loss(model_dir, blocks: np.ndarray, batch: int = 16) -> tuple[float, float]:
    """The model's own ``model(ids, labels=ids).loss`` in float64, averaged over every label position of every block,
    and its argmax accuracy."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
    total, hits, n = 0.0, 0, 0
    with torch.no_grad():
        for s in range(0, len(blocks), batch):
            ids = torch.from_numpy(blocks[s:s + batch])
            out = model(ids, labels=ids)
            m = ids[:, 1:].numel()
            total += float(out.loss) * m
            hits += int((out.logits[:, :-1].argmax(-1) == ids[:, 1:]).sum())
            n += m
    return total / n, hits / n


def test_val_loss_is_the_models_own_loss_on_a_trainer_checkpoint(extracted_store, trained_run, corpus):
    tok = AutoTokenizer.from_pretrained(str(trained_run))
    val = text_blocks(corpus["val"], tok, EXTRACT_OPTS[3])
    for name in ("checkpoint-20", "checkpoint-60"):
        attrs = ncanalyze.store.open(extracted_store)[f"neo-2x32/{name}"].attrs
        loss, acc = model_loss(trained_run / name, val)
        assert attrs["val_loss"] == pytest.approx(loss, rel=1e-6)
        assert attrs["val_accuracy"] == pytest.approx(acc, abs=1.5 / val[:, 1:].size)  # at most one argmax tie
        assert attrs["logit_transform"] == "none"


def _tiny(kind: str, dest) -> tuple[str, float]:
    """A tiny randomly initialised model saved with save_pretrained (safetensors); large weights so the transform
    matters. Returns the expected transform description and the relevant config value."""
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64, initializer_range=0.5)
    if kind == "gemma2":
        config, want = Gemma2Config(**common, final_logit_softcapping=2.0, attn_logit_softcapping=50.0,
                                    sliding_window=8), "2.0 * tanh(logits / 2.0)"
    else:
        config, want = CohereConfig(**common, logit_scale=0.25), "logits * 0.25"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dest)
    assert (dest / "model.safetensors").is_file()
    return want


@pytest.mark.parametrize("kind", ["gemma2", "cohere"])
def test_val_loss_applies_the_models_logit_transform(kind, tmp_path):
    want = _tiny(kind, tmp_path / kind)
    rng = np.random.default_rng(0)
    np.save(tmp_path / "train.npy", rng.integers(0, 96, 16 * 40))
    np.save(tmp_path / "val.npy", rng.integers(0, 96, 16 * 24))
    store = tmp_path / "s.zarr"
    run_cli("extract", tmp_path / kind, "--dataset", tmp_path / "train.npy", "--val-dataset", tmp_path / "val.npy",
            "--block-size", 16, "--batch-size", 5, "--samples-per-class", 0, "--store", store)
    attrs = ncanalyze.store.open(store)[f"{kind}/final"].attrs
    val = np.load(tmp_path / "val.npy").reshape(-1, 16)
    loss, acc = model_loss(tmp_path / kind, val)
    assert attrs["logit_transform"] == want
    assert attrs["val_loss"] == pytest.approx(loss, rel=1e-6)
    assert attrs["val_accuracy"] == pytest.approx(acc, abs=1.5 / val[:, 1:].size)
    # the transform matters here: the untransformed head's loss is far from it
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / kind), dtype=torch.float64).eval()
    with torch.no_grad():
        ids = torch.from_numpy(val)
        h = model.base_model(input_ids=ids).last_hidden_state[:, :-1]
        raw = torch.nn.functional.cross_entropy(model.get_output_embeddings()(h).flatten(0, 1), ids[:, 1:].flatten())
    assert abs(float(raw) - loss) > 1e-2 * loss
    # the check against the model's own logits tells the right transform from a wrong one
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / kind), dtype=torch.float32).eval()
    ids = torch.from_numpy(val[:1])
    h = features(model, ids)[0]
    W = model.get_output_embeddings().weight
    right = LogitTransform.of(model.config)
    assert right.describe() == want and matches_model(model, ids, h, W, None, right)
    assert not matches_model(model, ids, h, W, None, LogitTransform())
    assert not matches_model(model, ids, h, W, None, replace(right, multiply=right.multiply * 1.5))
