"""PEFT adapters (issue 40): a checkpoint holding adapter_config.json is its base model with the adapter applied by
peft, in ``ncanalyze extract`` and in the Trainer callback. A LoRA adapter (on the attention, the MLP and ``lm_head``)
is trained by the stock Trainer on an untied copy of the tiny GPT-Neo of tests/conftest.py; its extraction equals that
of the same model merged by peft and saved plain, and the callback's groups equal extract of the saved adapters."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import ncanalyze.store
import numpy as np
import pytest
import torch
from conftest import run_cli, train_sweep

peft = pytest.importorskip("peft")

OPTS = {"max_train_tokens": 2048, "max_val_tokens": 1024, "batch_size": 4, "samples_per_class": 2}
CLI_OPTS = ("--max-train-tokens", 2048, "--max-val-tokens", 1024, "--batch-size", 4, "--samples-per-class", 2)
TARGETS = ["q_proj", "v_proj", "c_fc", "lm_head"]
STEPS = 20
VARIABLES = ("mean", "variance", "within_covariance", "classifier", "samples")
COUNTS = ("count", "val_count", "val_correct", "val_ncc_agree", "n_samples", "sample_position")


def untied_base(trained_run: Path, dest: Path) -> Path:
    """The conftest run's last model with its own ``lm_head`` (a copy of the embedding), saved plain with the run's
    tokenizer: peft merges an adapter on a tied head into the embedding too, which its forward does not."""
    from transformers import AutoModelForCausalLM

    tied = AutoModelForCausalLM.from_pretrained(str(trained_run / "checkpoint-60"))
    config = tied.config
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tied.state_dict())
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()
    model.save_pretrained(str(dest))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained_run / f, dest / f)
    return dest


def lora(base: Path, init: bool = True):
    """A LoRA PeftModel over ``base`` (its lm_head included); ``init=False``: random nonzero B, no training needed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base))
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=init)
    torch.manual_seed(0)
    return peft.get_peft_model(model, config)


def train_lora(corpus, base: Path, out: Path, callbacks=()):
    """The LoRA PeftModel trained by the stock Trainer for ``STEPS`` steps, evaluated and saved every 10."""
    from transformers import AutoTokenizer, Trainer, TrainingArguments, default_data_collator, set_seed

    set_seed(0)
    tok = AutoTokenizer.from_pretrained(str(base))
    data = train_sweep.lm_datasets([corpus["train"]], [corpus["val"]], tok, 32)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, per_device_eval_batch_size=8,
                             max_steps=STEPS, learning_rate=1e-2, eval_strategy="steps", eval_steps=10,
                             save_strategy="steps", save_steps=10, logging_steps=10, seed=0, report_to=[],
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=lora(base), args=args, train_dataset=data["train"],
                      eval_dataset=data["validation"].select(range(16)), data_collator=default_data_collator,
                      processing_class=tok)
    for cb in callbacks:
        trainer.add_callback(cb)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def base(trained_run, tmp_path_factory) -> Path:
    return untied_base(trained_run, tmp_path_factory.mktemp("peft") / "base")


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> Path:
    """An untrained LoRA adapter with random weights (B nonzero), saved by peft beside the tokenizer."""
    out = tmp_path_factory.mktemp("adapter") / "lora"
    lora(base, init=False).save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / f, out / f)
    return out


@pytest.fixture(scope="module")
def trained(corpus, base, tmp_path_factory):
    """A LoRA run trained with the callback (``live.zarr``), its adapter checkpoints extracted (``ckpt.zarr``)."""
    from ncanalyze.training import NeuralCollapseCallback

    d = tmp_path_factory.mktemp("lora-run")
    cb = NeuralCollapseCallback(d / "live.zarr", str(corpus["train"]), str(corpus["val"]), **OPTS)
    trainer = train_lora(corpus, base, d / "lora", [cb])
    run_cli("extract", d / "lora", "--dataset", corpus["train"], "--val-dataset", corpus["val"], "--store",
            d / "ckpt.zarr", *CLI_OPTS)
    return {"dir": d, "live": d / "live.zarr", "ckpt": d / "ckpt.zarr", "run": d / "lora", "trainer": trainer}


def merged_copy(adapter_dir: Path, dest: Path, dtype=torch.float64) -> Path:
    """The adapted model merged by peft (``merge_and_unload``) in ``dtype`` and saved plain, with the tokenizer."""
    from transformers import AutoModelForCausalLM

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=dtype)
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir)).to(dtype)
    model.merge_and_unload().save_pretrained(str(dest))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(config["base_model_name_or_path"]) / f, dest / f)
    return dest


def group(store: Path, name: str):
    return ncanalyze.store.open(store)[name].to_dataset()


def peft_counts(adapter_dir: Path) -> tuple[int, int]:
    """(trainable, total) parameters as peft counts them for the adapter on its base."""
    from transformers import AutoModelForCausalLM

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]),
                                           str(adapter_dir), is_trainable=True)
    return model.get_nb_trainable_parameters()


@pytest.mark.slow
def test_an_adapter_equals_its_merge_saved_plain(adapter, corpus, tmp_path):
    """float64: extract of the adapter folder equals extract of peft's merge of it saved plain, to 1e-12; the
    classifier is the adapted head (the adapter on lm_head moved it off the base's)."""
    from ncanalyze.store.sources.load import weights_fingerprint

    plain = merged_copy(adapter, tmp_path / "merged")
    for where, name in ((adapter, "a.zarr"), (plain, "m.zarr")):
        run_cli("extract", where, "--dataset", corpus["train"], "--val-dataset", corpus["val"], "--store",
                tmp_path / name, "--dtype", "float64", *CLI_OPTS)
    a, m = group(tmp_path / "a.zarr", "lora/final"), group(tmp_path / "m.zarr", "merged/final")
    for name in COUNTS:
        np.testing.assert_array_equal(a[name].values, m[name].values, err_msg=name)
    for name in VARIABLES:
        np.testing.assert_allclose(a[name].values, m[name].values, rtol=0, atol=1e-12, err_msg=name)
    assert a.attrs["val_loss"] == pytest.approx(m.attrs["val_loss"], abs=1e-12)
    base_head = group_head(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
    assert np.abs(a["classifier"].values - base_head).max() > 1e-3  # the adapter on lm_head is in the classifier
    trainable, total = peft_counts(adapter)
    base_dir = Path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
    assert a.attrs["n_params"] == total and a.attrs["n_trainable_params"] == trainable > 0
    assert a.attrs["adapter_type"] == "LORA" and a.attrs["base_model"] == str(base_dir)
    assert a.attrs["base_revision"] is None and a.attrs["base_weights"] == weights_fingerprint(base_dir)
    assert a.attrs["adapter_weights"] not in (None, "live") and "adapter_type" not in m.attrs


def group_head(base: str) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64).lm_head.weight.detach().numpy()


@pytest.mark.slow
def test_the_callback_on_a_peft_model_equals_extract_of_its_adapters(trained, base):
    """Training a PeftModel with the Trainer: each measurement equals extract of the adapter saved at that step, bit
    for bit, with the same identity; the checkpoints are adapters of one base, one run."""
    live, ckpt = trained["live"], trained["ckpt"]
    assert sorted(ncanalyze.store.open(ckpt)["lora"].children) == ["checkpoint-10", "checkpoint-20"]
    trainable, total = peft_counts(trained["run"] / "checkpoint-20")
    for step in (10, 20):
        a, b = group(live, f"lora/step-{step}"), group(ckpt, f"lora/checkpoint-{step}")
        for name in COUNTS + VARIABLES:
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)  # bit for bit
        assert a.attrs["val_loss"] == b.attrs["val_loss"]
        for k in ("adapter_type", "base_model", "base_revision", "base_weights", "n_params", "n_trainable_params",
                  "adapter_names"):
            assert a.attrs[k] == b.attrs[k], k
        assert a.attrs["n_params"] == total and a.attrs["n_trainable_params"] == trainable
        assert a.attrs["adapter_weights"] == "live" and b.attrs["adapter_weights"] not in (None, "live")
    c10, c20 = group(ckpt, "lora/checkpoint-10"), group(ckpt, "lora/checkpoint-20")
    assert c10.attrs["adapter_weights"] != c20.attrs["adapter_weights"]
    assert not np.array_equal(c10["classifier"].values, c20["classifier"].values)  # the head's adapter trained


def test_without_peft_an_adapter_is_one_line_naming_the_extra(adapter, corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # not installed: its import fails
    r = run_cli("extract", adapter, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", ok=False)
    assert "ncanalyze[peft]" in r.output and len([x for x in r.output.splitlines() if "Error" in x]) == 1


def test_a_pickled_adapter_needs_the_opt_in(adapter, corpus, tmp_path):
    bad = shutil.copytree(adapter, tmp_path / "pickled")
    (bad / "adapter_model.safetensors").rename(bad / "adapter_model.bin")  # never read: refused by its name
    r = run_cli("extract", bad, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", ok=False)
    assert "--allow-pickle" in r.output and "adapter_model.bin" in r.output


def test_a_missing_base_is_one_line(adapter, corpus, tmp_path):
    moved = shutil.copytree(adapter, tmp_path / "orphan")
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "nobody/none"}))
    r = run_cli("extract", moved, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", ok=False)
    assert "nobody/none" in r.output and "local Hub cache" in r.output


@pytest.mark.slow
def test_a_hub_base_is_read_from_the_local_cache(adapter, base, corpus, tmp_path, monkeypatch):
    """An adapter naming a Hub id: its base comes from the local Hub cache (offline), its commit recorded; the
    numbers equal those of the adapter on the local base."""
    from huggingface_hub import constants
    from test_hub import add_revision

    cache = tmp_path / "hub"
    snap = add_revision(cache, "test-org/base", "main",
                        {f: base / f for f in ("config.json", "generation_config.json", "model.safetensors")})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub = shutil.copytree(adapter, tmp_path / "lora")
    config = json.loads((hub / "adapter_config.json").read_text())
    (hub / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "test-org/base"}))
    for where, name in ((adapter, "a.zarr"), (hub, "h.zarr")):
        run_cli("extract", where, "--dataset", corpus["train"], "--store", tmp_path / name, *CLI_OPTS)
    a, h = group(tmp_path / "a.zarr", "lora/final"), group(tmp_path / "h.zarr", "lora/final")
    for name in COUNTS + VARIABLES:
        np.testing.assert_array_equal(a[name].values, h[name].values, err_msg=name)
    assert h.attrs["base_model"] == "test-org/base" and h.attrs["base_revision"] == snap.name
    assert h.attrs["base_weights"] == a.attrs["base_weights"]


def test_a_prompt_learning_adapter_is_refused_in_one_line(base, corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)), config).save_pretrained(str(tmp_path / "pt"))
    r = run_cli("extract", tmp_path / "pt", "--dataset", corpus["train"], "--store", tmp_path / "s.zarr",
                "--tokenizer", base, ok=False)
    assert "prompt learning" in r.output and "PROMPT_TUNING" in r.output, r.output
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("config", ["not json", "[]", '{"peft_type": "LORA"}', '{"base_model_name_or_path": 3}'])
def test_an_adapter_config_without_its_base_is_one_line(adapter, corpus, tmp_path, config):
    bad = shutil.copytree(adapter, tmp_path / "bad")
    (bad / "adapter_config.json").write_text(config)
    r = run_cli("extract", bad, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", ok=False)
    assert "base_model_name_or_path" in r.output, r.output


@pytest.mark.parametrize("how", ["lora", "modules_to_save"])
def test_the_head_is_the_one_the_forward_uses(base, how):
    """The classifier of an adapted model: applied to the identity, the output layer's own forward gives it back
    (an adapter on lm_head, or lm_head trained whole as a module to save), and the base model is left unmerged."""
    from ncanalyze.store.sources.adapters import unwrap
    from ncanalyze.store.sources.anatomy import head
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float64)
    if how == "lora":
        config = peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False)
    else:
        config = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    torch.manual_seed(1)
    adapted = peft.get_peft_model(model, config)
    if how == "modules_to_save":
        with torch.no_grad():
            adapted.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    inner = unwrap(adapted).eval()
    before = {k: v.clone() for k, v in inner.state_dict().items()}
    classifier, bias = head(inner)
    width = classifier.shape[1]
    with torch.no_grad():
        forward = inner.lm_head(torch.eye(width, dtype=torch.float64)).T  # row v: the logit of token v per unit
    np.testing.assert_allclose(classifier.numpy(), forward.numpy(), rtol=0, atol=1e-12)
    assert bias is None and not np.allclose(classifier.numpy(), group_head(str(base)), atol=1e-3)
    after = inner.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing merged into the model itself


def test_an_adapter_without_a_tokenizer_uses_its_bases(adapter, base, tmp_path):
    from ncanalyze.store.sources.discover import discover
    from ncanalyze.store.sources.load import find_tokenizer

    bare = shutil.copytree(adapter, tmp_path / "run" / "checkpoint-5",
                           ignore=shutil.ignore_patterns("tokenizer*"))
    [ckpt] = discover(bare.parent)
    tokenizer, where = find_tokenizer(ckpt)
    assert where == str(base) and len(tokenizer) == len(find_tokenizer(discover(base)[0])[0]) > 0
    with_own = find_tokenizer(discover(adapter)[0])[1]
    assert with_own == str(adapter)  # the adapter's own comes first
