"""val_loss and val_accuracy of the validation pass against the model's own loss (float64), with each logit
transform: none (GPT-Neo), Gemma2's final_logit_softcapping, Cohere's logit_scale."""
from __future__ import annotations

from dataclasses import replace
from itertools import chain

import ncanalyze.store
import numpy as np
import pytest
import torch
from conftest import EXTRACT_OPTS, run_cli
from ncanalyze.store.extraction.loss import matches_model
from ncanalyze.store.sources.anatomy import LogitTransform, features
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


def run_clm_blocks(files: dict[str, str], tokenizer, block: int):
    """run_clm's preprocessing written out: the text builder (line breaks kept), ``tokenize_function`` and
    ``group_texts`` as batched maps of 1,000 rows (datasets' default batch_size), each batch's remainder dropped."""
    import datasets

    raw = datasets.load_dataset("text", data_files=files, keep_linebreaks=True)
    tokenized = raw.map(lambda ex: tokenizer(ex["text"]), batched=True, remove_columns=["text"])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated[list(examples.keys())[0]]) // block * block
        result = {k: [t[i:i + block] for i in range(0, total_length, block)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    return tokenized.map(group_texts, batched=True, batch_size=1000)


@pytest.mark.slow
def test_val_loss_is_the_trainers_eval_loss_on_run_clm_blocks(corpus, tmp_path):
    """A model trained by the stock Trainer on run_clm's blocks; its eval_loss over 2,500 validation lines (three of
    run_clm's 1,000-row batches, each cut apart) equals extract's val_loss on the same text to 1e-6."""
    from conftest import make_corpus, train_sweep
    from transformers import GPTNeoForCausalLM, Trainer, TrainingArguments, default_data_collator, set_seed

    val_text = make_corpus(tmp_path / "valid.txt", 2500, seed=3)
    tok = AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))
    lm = run_clm_blocks({"train": str(corpus["train"]), "validation": str(val_text)}, tok, 32)
    set_seed(0)
    model = GPTNeoForCausalLM(train_sweep.neo_config(len(tok), 2, 32, 4, 32))
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8,
                             per_device_eval_batch_size=8, max_steps=30, learning_rate=3e-3, seed=0, report_to=[],
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=lm["train"], eval_dataset=lm["validation"],
                      data_collator=default_data_collator, processing_class=tok)
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(tmp_path / "neo"))
    store = tmp_path / "s.zarr"
    run_cli("extract", tmp_path / "neo", "--dataset", corpus["train"], "--val-dataset", val_text, "--store", store,
            "--max-train-tokens", 1024, "--samples-per-class", 0, "--block-size", 32)
    attrs = ncanalyze.store.open(store)["neo/final"].attrs
    assert attrs["val_tokens"] == len(lm["validation"]) * 31  # the Trainer's own evaluation blocks, all of them
    assert attrs["val_loss"] == pytest.approx(eval_loss, abs=1e-6)
    # the check can tell: the whole text concatenated and cut once gives other blocks, and a loss off by more than
    # ten times the tolerance (2.6e-5 nats for this barely trained model; 0.03-0.09 for the trained ones)
    ids = [t for doc in tok(open(val_text).read().splitlines(keepends=True))["input_ids"] for t in doc]
    whole = np.array(ids[:len(ids) // 32 * 32]).reshape(-1, 32)
    assert len(whole) > len(lm["validation"])
    assert abs(model_loss(tmp_path / "neo", whole)[0] - eval_loss) > 1e-5


@pytest.mark.slow
def test_gpt2_val_loss_is_its_own_loss_where_the_trainer_reports_l_minus_1_over_l_of_it(tmp_path):
    """A second family: a tiny GPT-2 trained by the stock Trainer for a few steps on full blocks of L = 16. val_loss is
    the model's own mean over the L - 1 scored positions of each block (a float64 hand computation); the Trainer's
    eval_loss is exactly (L - 1) / L of it under transformers 5: GPT2LMHeadModel takes loss kwargs but has no
    ForCausalLM loss_type, so the Trainer's num_items_in_batch counts all L labels of a block while the loss sums
    over L - 1 (GPT-Neo, a ...ForCausalLM, is counted over L - 1: its eval_loss is val_loss, as tested above)."""
    import datasets
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator, set_seed

    L, V = 16, 64
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, V, (64, L)), rng.integers(0, V, (24, L))
    np.save(tmp_path / "train.npy", train)
    np.save(tmp_path / "val.npy", val)
    blocks = lambda a: datasets.Dataset.from_dict({"input_ids": a.tolist(), "labels": a.tolist()})  # noqa: E731
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=L,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8,
                             per_device_eval_batch_size=8, max_steps=3, learning_rate=3e-3, seed=0, report_to=[],
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=blocks(train), eval_dataset=blocks(val),
                      data_collator=default_data_collator)
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(tmp_path / "gpt2"))
    store = tmp_path / "s.zarr"
    run_cli("extract", tmp_path / "gpt2", "--dataset", tmp_path / "train.npy", "--val-dataset", tmp_path / "val.npy",
            "--batch-size", 8, "--samples-per-class", 0, "--store", store)
    attrs = ncanalyze.store.open(store)["gpt2/final"].attrs
    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gpt2"), dtype=torch.float64).eval()
    with torch.no_grad():  # by hand: the mean cross-entropy over the L - 1 scored positions of every block
        logits = m(torch.from_numpy(val)).logits[:, :-1]
        hand = -torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(val[:, 1:, None])).mean().item()
    assert attrs["val_tokens"] == val[:, 1:].size and attrs["val_loss"] == pytest.approx(hand, rel=1e-9)
    assert eval_loss == pytest.approx(hand * (L - 1) / L, rel=1e-6)  # the Trainer's: (L - 1) / L of it
    assert abs(eval_loss - attrs["val_loss"]) > 1e-2  # so they differ by far more than the tolerance
