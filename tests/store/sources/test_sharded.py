"""Checkpoints of distributed trainings (issue 40): FSDP's sharded state dict (``pytorch_model_fsdp_0/``, written here
as accelerate's ``save_fsdp_model`` writes it under SHARDED_STATE_DICT: ``dist_cp.save({"model": state_dict},
FileSystemWriter(...), DefaultSavePlanner())`` under a gloo process group) reads into the same model as the one
saved whole; DeepSpeed ZeRO's ``global_stepN/`` shards, laid out as the Trainer saves them, are refused in one line
naming the command that consolidates them and the flag."""
from __future__ import annotations

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
from conftest import EXTRACT_OPTS, run_cli

SIDE_FILES = ("config.json", "generation_config.json", "trainer_state.json")

# one rank of accelerate's save_fsdp_model(SHARDED_STATE_DICT): every tensor a DTensor sharded on dim 0 over the
# ranks' CPU mesh (as FSDP shards them), saved by torch.distributed.checkpoint
WRITER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from safetensors.torch import load_file
    src, dest, rank, world, init = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    whole = load_file(src + "/model.safetensors")  # the model's state dict, its tied lm_head under the embedding
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in whole.items()}
    dist_cp.save(state_dict={"model": state}, storage_writer=dist_cp.FileSystemWriter(dest),
                 planner=DefaultSavePlanner())
    dist.destroy_process_group()
""")


def fsdp_checkpoint(src: Path, dest: Path, world: int) -> Path:
    """``src`` (a whole checkpoint) saved again as FSDP's sharded checkpoint by ``world`` gloo ranks: config.json
    and the Trainer's side files, and ``pytorch_model_fsdp_0/`` (no model.safetensors)."""
    dest.mkdir(parents=True)
    for f in SIDE_FILES:
        shutil.copy(src / f, dest / f)
    init = f"file://{dest.parent / ('pg-' + dest.name)}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(src), str(dest / "pytorch_model_fsdp_0"), str(r),
                               str(world), init], env=env, stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    return dest


@pytest.fixture(scope="module")
def fsdp_run(trained_run, tmp_path_factory) -> Path:
    """A run folder ``neo-2x32`` whose checkpoint-60 is the conftest run's, sharded over two gloo ranks."""
    run = tmp_path_factory.mktemp("fsdp") / "neo-2x32"
    fsdp_checkpoint(trained_run / "checkpoint-60", run / "checkpoint-60", world=2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained_run / f, run / f)
    return run


def zero_checkpoint(src: Path, dest: Path, step: int = 60) -> Path:
    """A checkpoint as the Trainer saves it under DeepSpeed ZeRO-3 without stage3_gather_16bit_weights_on_model_save:
    config.json (no weights), ``latest``, the copied ``zero_to_fp32.py`` and ``global_stepN/`` shards (their bytes
    stand in for DeepSpeed's pickles: unreadable, harmless)."""
    dest.mkdir(parents=True)
    for f in SIDE_FILES:
        shutil.copy(src / f, dest / f)
    (dest / "latest").write_text(f"global_step{step}")
    (dest / "zero_to_fp32.py").write_text("# DeepSpeed's consolidation script\n")
    shards = dest / f"global_step{step}"
    shards.mkdir()
    for f in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (shards / f).write_bytes(b"not a pickle anyone may read")
    return dest


@pytest.mark.slow
def test_fsdp_shards_read_into_the_model_saved_whole(fsdp_run, trained_run):
    from ncanalyze.store.sources.discover import discover, layout
    from ncanalyze.store.sources.load import load_model

    [ckpt] = discover(fsdp_run)
    assert layout(ckpt.path) == "fsdp" and not (ckpt.path / "model.safetensors").exists()
    assert len(list((ckpt.path / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2  # one file per rank
    [whole] = [c for c in discover(trained_run) if c.name == "checkpoint-60"]
    a = load_model(ckpt, "float32", torch.device("cpu"), allow_pickle=True)
    b = load_model(whole, "float32", torch.device("cpu"))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sb:
        assert torch.equal(sa[k], sb[k]), k
    assert a.lm_head.weight.data_ptr() == a.transformer.wte.weight.data_ptr()  # tied as the config says


def test_fsdp_without_the_opt_in_is_one_line_naming_the_flag(trained_run, corpus, tmp_path):
    ckpt = tmp_path / "run" / "checkpoint-60"  # laid out as accelerate lays it out; its files are never read
    ckpt.mkdir(parents=True)
    shutil.copy(trained_run / "checkpoint-60" / "config.json", ckpt)
    (ckpt / "pytorch_model_fsdp_0").mkdir()
    for f in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (ckpt / "pytorch_model_fsdp_0" / f).write_bytes(b"not a pickle anyone may read")
    r = run_cli("extract", ckpt.parent, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", ok=False)
    assert len([x for x in r.output.splitlines() if "Error:" in x]) == 1
    assert "--allow-pickle" in r.output and "pytorch_model_fsdp_0" in r.output, r.output
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.slow
def test_fsdp_extraction_equals_the_whole_models(fsdp_run, extracted_store, corpus, tmp_path):
    store = tmp_path / "fsdp.zarr"
    run_cli("extract", fsdp_run, "--dataset", corpus["train"], "--store", store, "--allow-pickle", *EXTRACT_OPTS)
    a = ncanalyze.store.open(store)["neo-2x32/checkpoint-60"].to_dataset()
    b = ncanalyze.store.open(extracted_store)["neo-2x32/checkpoint-60"].to_dataset()
    for name in b.variables:
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)  # bit for bit
    assert a.attrs["val_loss"] == b.attrs["val_loss"] and a.attrs["global_step"] == 60


@pytest.mark.parametrize("opt_in, deepspeed, words", [
    (False, True, ["python -m deepspeed.utils.zero_to_fp32", "--allow-pickle", "global_step60"]),
    (True, False, ["python -m deepspeed.utils.zero_to_fp32", "deepspeed is not installed"]),
    (True, True, ["cannot consolidate", "python -m deepspeed.utils.zero_to_fp32"]),
])
def test_zero_shards_are_one_line_naming_the_command_and_the_flag(trained_run, corpus, tmp_path, monkeypatch,
                                                                   opt_in, deepspeed, words):
    if deepspeed:
        pytest.importorskip("deepspeed") if opt_in else None
    else:
        for name in ("deepspeed", "deepspeed.utils", "deepspeed.utils.zero_to_fp32"):  # not installed: imports fail
            monkeypatch.setitem(sys.modules, name, None)
    run = tmp_path / "run"
    zero_checkpoint(trained_run / "checkpoint-60", run / "checkpoint-60")
    r = run_cli("extract", run, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr",
                *(["--allow-pickle"] if opt_in else []), ok=False)
    assert all(w in r.output for w in words), r.output
    assert "Traceback" not in r.output and not (tmp_path / "s.zarr").exists()
    assert "zero_to_fp32.py" not in r.output  # never a script from the untrusted folder


@pytest.mark.parametrize("name", ["my run", "$(touch PWNED)", "a'b; touch PWNED"])
def test_the_zero_command_pastes_safely_into_a_shell(trained_run, corpus, tmp_path, name):
    """The consolidation command in the refusal, pasted into bash, gives DeepSpeed's installed module the folder as
    one argument each time (a space, ``$(...)`` or a quote in its name runs nothing)."""
    run = tmp_path / name
    zero_checkpoint(trained_run / "checkpoint-60", run / "checkpoint-60")
    r = run_cli("extract", run, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr", ok=False)
    command = r.output.split("`")[1]
    assert command.startswith("python -m deepspeed.utils.zero_to_fp32 "), r.output
    echoed = subprocess.run(["bash", "-c", f"printf '%s\\n' {command.removeprefix('python ')}"], cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    folder = str(run / "checkpoint-60")
    assert echoed == ["-m", "deepspeed.utils.zero_to_fp32", folder, folder, "--safe_serialization"]
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


# what the Trainer does under DeepSpeed ZeRO-3 without gathering: engine.save_checkpoint(checkpoint folder) beside
# config.json; here one DeepSpeed step of lr 0 (the weights stay the checkpoint's) on one CPU rank over gloo
ZERO_WRITER = textwrap.dedent("""
    import os, sys, torch, deepspeed
    from transformers import AutoModelForCausalLM
    src, dest, port = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    model = AutoModelForCausalLM.from_pretrained(src)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    ids = torch.arange(8)[None]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(dest)
""")


@pytest.mark.slow
def test_zero_shards_consolidate_with_deepspeeds_own_function(trained_run, tmp_path):
    pytest.importorskip("deepspeed")
    import socket

    from ncanalyze.store.sources.discover import discover, layout
    from ncanalyze.store.sources.load import load_model

    src, ckpt = trained_run / "checkpoint-60", tmp_path / "run" / "checkpoint-60"
    ckpt.mkdir(parents=True)
    for f in SIDE_FILES:
        shutil.copy(src / f, ckpt / f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", ZERO_WRITER, str(src), str(ckpt), str(port)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert layout(ckpt) == "zero" and (ckpt / "zero_to_fp32.py").is_file()
    [c] = discover(ckpt)
    a = load_model(c, "float32", torch.device("cpu"), allow_pickle=True).state_dict()
    b = load_model(next(x for x in discover(trained_run) if x.name == "checkpoint-60"), "float32",
                   torch.device("cpu")).state_dict()
    assert a.keys() == b.keys()
    for k in b:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_a_corrupt_fsdp_shard_fails_alone(fsdp_run, trained_run, corpus, tmp_path):
    """One rank's .distcp file cut short: torch.distributed.checkpoint raises CheckpointException (a BaseException);
    that checkpoint fails in one line and the whole checkpoint beside it is extracted."""
    from ncanalyze.store.extraction.checkpoint import Outcome
    from ncanalyze.store.extraction.settings import ExtractConfig
    from ncanalyze.store.runs.local import extract

    run = tmp_path / "neo-2x32"
    shutil.copytree(trained_run / "checkpoint-40", run / "checkpoint-40")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained_run / f, run / f)
    bad = shutil.copytree(fsdp_run / "checkpoint-60", run / "checkpoint-60")
    shard = sorted((bad / "pytorch_model_fsdp_0").glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cfg = ExtractConfig(dataset=str(corpus["train"]), allow_pickle=True, max_train_tokens=2048, max_val_tokens=1024)
    result = extract(run, tmp_path / "s.zarr", cfg)
    assert result.statuses == {"neo-2x32/checkpoint-40": Outcome.DONE, "neo-2x32/checkpoint-60": Outcome.FAILED}
    why = result.why["neo-2x32/checkpoint-60"]
    assert "pytorch_model_fsdp_0" in why or "FSDP" in why, why
    assert "\n" not in why and list(ncanalyze.store.open(tmp_path / "s.zarr")["neo-2x32"].children) == ["checkpoint-40"]
