"""Adapters measured only as their files say (issue 49): an adapter whose weights do not cover its config (tensors
missing, ``use_dora`` turned on over LoRA weights, a changed rank), a config peft would choke on (nested past the
recursion limit, ``rank_pattern`` a list, a backtracking regex, a forged huge ``r``), or a pickle that does not
unpickle fails alone in one line while the good checkpoint beside it is extracted; a run's adapters name one base;
a relative base is read from the adapter's folder, or ``--base`` names it (issue 51). Every adapter here is written
by peft (and its weight files by safetensors or torch) from the fixtures of test_peft.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import ncanalyze.store
import numpy as np
import pytest
import torch
from conftest import run_cli
from test_peft import CLI_OPTS, OPTS, adapter, base, group, lora  # noqa: F401 -- fixtures

peft = pytest.importorskip("peft")


def edit_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return folder


def drop_tensor(folder: Path) -> Path:
    """The adapter with one of its LoRA tensors left out of its safetensors file (rewritten by safetensors)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "adapter_model.safetensors"))
    gone = next(k for k in weights if "h.1.attn.attention.q_proj.lora_B" in k)
    save_file({k: v for k, v in weights.items() if k != gone}, str(folder / "adapter_model.safetensors"))
    return folder


def bad_pickle(folder: Path) -> Path:
    """The adapter's weights as a torch.save pickle holding an object peft's weights-only load refuses."""
    from datetime import date

    from safetensors.torch import load_file

    weights = load_file(str(folder / "adapter_model.safetensors"))
    (folder / "adapter_model.safetensors").unlink()
    torch.save({**weights, "saved": date(2026, 1, 1)}, folder / "adapter_model.bin")
    return folder


def nested(folder: Path) -> Path:
    config = (folder / "adapter_config.json").read_text()
    (folder / "adapter_config.json").write_text(config[:-1] + ', "deep": ' + "[" * 200_000 + "]" * 200_000 + "}")
    return folder


# each damage, and words its one line must hold
DAMAGES = {
    "missing": (drop_tensor, ["lack 1 of its config's tensors", "q_proj.lora_B"]),
    "dora": (lambda f: edit_config(f, use_dora=True), ["use_dora", "no DoRA magnitudes"]),
    "rank": (lambda f: edit_config(f, r=8), ["rank 8", "rank 4", "does not match its weights"]),
    "huge_rank": (lambda f: edit_config(f, r=1_000_000), ["rank 1000000", "largest dimension"]),
    "nested": (nested, ["adapter_config.json", "nested deeper"]),
    "rank_pattern_list": (lambda f: edit_config(f, rank_pattern=[1, 2]), ["rank_pattern", "list"]),
    "pickle": (bad_pickle, ["UnpicklingError"]),
    "regex": (lambda f: edit_config(f, target_modules="(.|.)*Z"), ["(.|.)*Z", "matches no module"]),
}
FORGED = {**DAMAGES, "module_regex": (lambda f: edit_config(f, modules_to_save=["(.|.)*Z"]),
                                      ["modules_to_save", "not a module name"])}


@pytest.fixture
def damaged_run(adapter, tmp_path) -> Path:
    """A run whose checkpoint-1 is the good adapter and checkpoint-2 ... each damaged one way (DAMAGES, in order)."""
    run = tmp_path / "lora-run"
    shutil.copytree(adapter, run / "checkpoint-1")
    for i, (damage, _) in enumerate(DAMAGES.values(), 2):
        damage(shutil.copytree(adapter, run / f"checkpoint-{i}"))
    return run


@pytest.mark.slow
def test_each_bad_adapter_fails_alone_in_one_line(damaged_run, corpus, tmp_path):
    """The good adapter is extracted; each damaged one fails alone with its own one-line reason, none blaming the
    base for its config's values, nothing hanging (the backtracking regex) and no tensor left as peft initialised it."""
    from ncanalyze.store.extraction.checkpoint import Outcome
    from ncanalyze.store.extraction.settings import ExtractConfig
    from ncanalyze.store.runs.local import extract

    cfg = ExtractConfig(dataset=str(corpus["train"]), val_dataset=str(corpus["val"]), allow_pickle=True, **OPTS)
    result = extract(damaged_run, tmp_path / "s.zarr", cfg)
    assert result.statuses["lora-run/checkpoint-1"] is Outcome.DONE
    for i, (name, (_, words)) in enumerate(DAMAGES.items(), 2):
        why = result.why.get(f"lora-run/checkpoint-{i}", "")
        assert result.statuses[f"lora-run/checkpoint-{i}"] is Outcome.FAILED, (name, result.statuses)
        assert all(w in why for w in words) and "\n" not in why, (name, why)
        assert "trained on" not in why, (name, why)  # the config's own values: never the base's fault
    assert list(ncanalyze.store.open(tmp_path / "s.zarr")["lora-run"].children) == ["checkpoint-1"]


@pytest.mark.parametrize("damage", ["missing", "dora", "rank", "rank_pattern_list", "nested"])
def test_a_damaged_adapter_is_a_checkpoint_error(adapter, tmp_path, damage):
    """Loading the damaged adapter raises a one-line CheckpointError (what makes a checkpoint fail alone), never
    a traceback nor a model holding peft's fresh layers."""
    from ncanalyze.core.errors import CheckpointError
    from ncanalyze.store.sources.discover import discover
    from ncanalyze.store.sources.load import load_model

    fn, words = DAMAGES[damage]
    [ckpt] = discover(fn(shutil.copytree(adapter, tmp_path / "bad")))
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, "float32", torch.device("cpu"))
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("how", ["dora_off", "module_to_save"])
def test_weights_beyond_or_short_of_the_config_are_refused(base, tmp_path, how):
    """A DoRA adapter saved by peft whose config turns use_dora off (its magnitudes would go unused), and a LoRA
    whose module to save (lm_head) is left out of its file (it would be the base's head): one line each."""
    from ncanalyze.core.errors import CheckpointError
    from ncanalyze.store.sources.discover import discover
    from ncanalyze.store.sources.load import load_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    extra = {"use_dora": True} if how == "dora_off" else {"modules_to_save": ["lm_head"]}
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **extra)
    torch.manual_seed(0)
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)), config).save_pretrained(str(tmp_path / "a"))
    if how == "dora_off":
        edit_config(tmp_path / "a", use_dora=False)
    else:
        file = str(tmp_path / "a" / "adapter_model.safetensors")
        save_file({k: v for k, v in load_file(file).items() if k != "base_model.model.lm_head.weight"}, file)
    with pytest.raises(CheckpointError) as e:
        load_model(discover(tmp_path / "a")[0], "float32", torch.device("cpu"))
    words = ["use_dora off", "DoRA's"] if how == "dora_off" else ["lm_head.weight"]
    assert all(w in str(e.value) for w in words), str(e.value)


BOUNDED = textwrap.dedent("""
    import resource, sys, peft, torch
    from ncanalyze.core.errors import CheckpointError
    from ncanalyze.store.sources.discover import discover
    from ncanalyze.store.sources.load import load_model
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(sys.argv[1])  # the base once: its memory is in the baseline
    for folder in sys.argv[2:]:  # each adapter: its message, then the peak memory it added
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            load_model(discover(folder)[0], "float32", torch.device("cpu"))
            print("loaded")
        except CheckpointError as e:
            print(str(e).replace(chr(10), " "))
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024, "MiB", flush=True)
""")


@pytest.mark.slow
def test_a_forged_config_neither_hangs_nor_allocates(adapter, base, tmp_path):
    """A backtracking target_modules regex is matched in linear time (RE2) and refused as matching nothing, one in
    modules_to_save (which peft puts inside a regex) is refused as no module name, and r = 1,000,000 on the width-32
    model is refused before peft builds a layer (peak memory grows < 200 MiB each, imports included; peft allocated
    1.5 GB for it): all three within 60 s, in one process of their own (one torch import)."""
    cases = ("regex", "module_regex", "huge_rank")
    bad = [FORGED[d][0](shutil.copytree(adapter, tmp_path / d)) for d in cases]
    out = subprocess.run([sys.executable, "-c", BOUNDED, str(base), *map(str, bad)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.splitlines()
    assert len(out) == 2 * len(cases), out
    for damage, said, grown in zip(cases, out[::2], out[1::2]):
        words = FORGED[damage][1]
        assert all(w in said for w in words), (damage, said)
        assert int(grown.split()[0]) < 200, (damage, grown)


def test_a_regex_config_gives_peft_s_own_model(base, tmp_path):
    """An adapter saved by peft with a regex target_modules and regex rank_pattern / alpha_pattern keys: the model
    apply() builds (its regexes matched on RE2) equals peft's own load of it (Python's re), tensor for tensor."""
    from ncanalyze.store.sources.adapters import apply
    from transformers import AutoModelForCausalLM

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*\.(q_proj|c_fc)|lm_head", init_lora_weights=False,
                             rank_pattern={r"h\.0\..*q_proj": 2, "c_fc": 3}, alpha_pattern={r".*\.1\.mlp\..*": 5})
    torch.manual_seed(0)
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)), config).save_pretrained(str(tmp_path / "a"))
    ours = apply(AutoModelForCausalLM.from_pretrained(str(base)), tmp_path / "a", torch.float32, False)
    theirs = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(tmp_path / "a"))
    a, b = ours.state_dict(), theirs.get_base_model().state_dict()
    assert a.keys() == b.keys() and any("lora_A" in k for k in a)
    for k in b:
        assert torch.equal(a[k], b[k]), k
    q0 = ours.transformer.h[0].attn.attention.q_proj
    assert q0.r["default"] == 2 and ours.transformer.h[1].mlp.c_fc.scaling["default"] == 5 / 3
    for name, m in ours.named_modules():  # the same layers adapted, each with peft's scaling
        if hasattr(m, "scaling"):
            assert m.scaling == theirs.get_base_model().get_submodule(name).scaling, name


def test_a_runs_adapters_on_two_bases_are_refused_in_one_line(adapter, base, corpus, tmp_path):
    """checkpoint-2 names a copy of the base (same shapes, another model): one line naming both, before any work."""
    other = shutil.copytree(base, tmp_path / "other-base")
    run = tmp_path / "run"
    shutil.copytree(adapter, run / "checkpoint-1")
    edit_config(shutil.copytree(adapter, run / "checkpoint-2"), base_model_name_or_path=str(other))
    r = run_cli("extract", run, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", *CLI_OPTS, ok=False)
    assert "different base models" in r.output and str(other) in r.output and str(base) in r.output, r.output
    assert "--base" in r.output and not (tmp_path / "s.zarr").exists()


def test_a_relative_base_is_read_from_the_adapters_folder(adapter, base, tmp_path, monkeypatch, caplog):
    """base_model_name_or_path ``../base`` is the folder beside the adapter's, whatever the current folder, and the
    log says so; the model equals the adapter on its base named absolutely."""
    from ncanalyze.store.sources.discover import discover
    from ncanalyze.store.sources.load import find_tokenizer, load_model, weights_fingerprint

    shutil.copytree(base, tmp_path / "study" / "base")
    moved = edit_config(shutil.copytree(adapter, tmp_path / "study" / "lora", ignore=shutil.ignore_patterns("tok*")),
                        base_model_name_or_path="../base")
    monkeypatch.chdir((tmp_path / "elsewhere").mkdir() or tmp_path / "elsewhere")
    [ckpt], [whole] = discover(moved), discover(adapter)
    with caplog.at_level("INFO"):
        a = load_model(ckpt, "float32", torch.device("cpu")).state_dict()
    b = load_model(whole, "float32", torch.device("cpu")).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    said = [r.getMessage() for r in caplog.records if "resolved against the adapter's folder" in r.getMessage()]
    assert len(said) == 1 and str((tmp_path / "study" / "base").resolve()) in said[0], caplog.text
    assert find_tokenizer(ckpt)[1] == str((tmp_path / "study" / "base").resolve())
    assert weights_fingerprint(moved).split("+")[1] == weights_fingerprint(whole.path).split("+")[1]


@pytest.mark.parametrize("name, download", [("../nowhere", False), ("runs/base/model", False), ("nobody/none", True)])
def test_a_missing_base_offers_a_download_only_for_a_hub_id(adapter, corpus, tmp_path, name, download):
    moved = edit_config(shutil.copytree(adapter, tmp_path / "orphan"), base_model_name_or_path=name)
    r = run_cli("extract", moved, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", ok=False)
    assert "--base" in r.output and ("hf download" in r.output) == download, r.output
    assert name in r.output


@pytest.mark.slow
def test_base_names_the_base_model(adapter, base, corpus, tmp_path):
    """--base measures an adapter whose config names a base that is nowhere; the group records the base used."""
    from ncanalyze.store.sources.load import weights_fingerprint

    moved = edit_config(shutil.copytree(adapter, tmp_path / "lora"), base_model_name_or_path="nobody/none")
    run_cli("extract", moved, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", "--base", base, *CLI_OPTS)
    g = group(tmp_path / "s.zarr", "lora/final")
    assert g.attrs["base_model"] == str(base) and g.attrs["base_weights"] == weights_fingerprint(base)
    assert np.isfinite(g["mean"].values).all()
