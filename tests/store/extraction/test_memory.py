"""The layers a pass holds (store/extraction/memory.py, issue 24): ``--layers-per-pass auto`` groups the layers so
each pass's float64 state fits ``--state-memory``, equal to one pass bit for bit (on a real Trainer checkpoint and a
Llama shape at V = 128,256), resumes with the passes it saved, and ``state_bytes`` is what a validation pass holds."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ncanalyze.store.extraction.layers import plan
from transformers import AutoModelForCausalLM, LlamaConfig

CK = "checkpoint-40"


def indices(passes) -> list[tuple[int, ...]]:
    """A plan's passes as the hidden_states indices of their (residual) sites."""
    return [tuple(s.index for s in p) for p in passes]


def test_auto_groups_fit_the_budget_exactly_and_keep_the_deepest_layers_together():
    from ncanalyze.analyzer import UserError
    from ncanalyze.store.extraction.layers import auto_groups

    nine = plan("all", "auto", 0, "float32", 8)
    assert nine.auto and indices(nine.passes) == [tuple(range(9))]  # not fitted yet: one pass
    per_layer, shared = 1000, 77
    for k, want in [(9, [tuple(range(9))]), (4, [(0,), (1, 2, 3, 4), (5, 6, 7, 8)]), (3, [(0, 1, 2), (3, 4, 5),
                    (6, 7, 8)]), (1, [(l,) for l in range(9)])]:
        assert indices(auto_groups(nine, per_layer, shared, shared + k * per_layer).passes) == want  # k layers fit exactly
        if k > 1:  # a byte less: one layer fewer per pass
            assert auto_groups(nine, per_layer, shared, shared + k * per_layer - 1).widest_pass == k - 1
    with pytest.raises(UserError, match="--state-memory"):
        auto_groups(nine, per_layer, shared, shared + per_layer - 1)
    fixed = plan("all", 4, 0, "float32", 8)  # an explicit integer keeps its meaning: from the first layer
    assert auto_groups(fixed, 1, 0, 1) is fixed and indices(fixed.passes) == [(0, 1, 2, 3), (4, 5, 6, 7), (8,)]


def test_state_memory_sizes():
    from ncanalyze.analyzer import UserError
    from ncanalyze.store.extraction.settings import ExtractConfig, parse_size

    assert parse_size("40GB") == 40 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5 GiB") == 3 * 2**29 and parse_size("100") == 100 and parse_size(None) is None
    for bad in ("", "GB", "-1GB", "12 parsecs", "1e400GB", "0"):
        with pytest.raises(UserError, match="--state-memory"):
            parse_size(bad)
        with pytest.raises(UserError, match=r"^state_memory \(--state-memory\) (is not a size|is not above 0)"):
            ExtractConfig(dataset="d", state_memory=bad)


@pytest.mark.slow
def test_auto_under_a_small_state_memory_equals_one_pass_bit_for_bit(trained_run, corpus, tmp_path):
    from conftest import EXTRACT_OPTS, assert_same_group, run_cli
    from ncanalyze.store.extraction.memory import state_bytes

    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK))
    vocab, dim = model.get_output_embeddings().weight.shape
    per_layer, shared = state_bytes(vocab, dim, 4, torch.device("cpu"))
    args = ["extract", trained_run / CK, "--dataset", corpus["train"], *EXTRACT_OPTS, "--layers", "all",
            "--folds", 1]  # the fold sums take what the passes leave: here none, so none in either store
    one, auto = tmp_path / "one.zarr", tmp_path / "auto.zarr"
    run_cli(*args, "--store", one, "--layers-per-pass", "auto")
    r = run_cli(*args, "--store", auto, "--state-memory", str(shared + per_layer + 1))
    assert "3 passes of at most 1 layers (0; 1; 2)" in r.output
    for g in [f"neo-2x32/{CK}", f"neo-2x32/{CK}/layers/0", f"neo-2x32/{CK}/layers/1"]:
        assert_same_group(one, auto, g)  # the attributes too: the same config record and hash
    r = run_cli(*args, "--store", auto, "--state-memory", "100GB")  # another memory: the same configuration
    assert "0 extracted, 0 resumed, 1 already in" in r.output


@pytest.mark.slow
def test_auto_resumes_with_the_passes_it_saved_under_another_memory(trained_run, corpus, tmp_path):
    """Killed in its second pass of three, then resumed where one pass would fit: the saved groups are kept (the
    finished layer is not thrown away), and the result is one pass's bit for bit."""
    from conftest import assert_same_group, kill_when, run_cli
    from ncanalyze.store.extraction.memory import state_bytes
    from test_kill_resume import _state

    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK))
    shape = model.get_output_embeddings().weight.shape
    per_layer, shared = state_bytes(*shape, 8, torch.device("cpu"))
    args = ["extract", trained_run / CK, "--dataset", corpus["train"], "--max-train-tokens", 2048,
            "--max-val-tokens", 1024, "--batch-size", 1, "--layers", "all", "--folds", 1]
    one, store = tmp_path / "one.zarr", tmp_path / "killed.zarr"
    run_cli(*args, "--store", one)
    state = _state(store) / "neo-2x32" / f"{CK}.npz"
    kill_when([*args, "--store", store, "--state-memory", shared + per_layer + 1, "--state-every", 0], state,
              at={"pass": 1, "phase": 0})
    with np.load(state) as s:
        assert json.loads(str(s["passes"])) == [[0], [1], [2]] and int(s["pass"]) == 1
    r = run_cli(*args, "--store", store)
    assert "1 resumed" in r.output
    for g in [f"neo-2x32/{CK}", f"neo-2x32/{CK}/layers/0", f"neo-2x32/{CK}/layers/1"]:
        assert_same_group(one, store, g)


@pytest.mark.slow
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
            "--layers", "all", "--samples-per-class", 1, "--batch-size", 16, "--folds", 1]
    run_cli(*args, "--store", tmp_path / "one.zarr")
    r = run_cli(*args, "--store", tmp_path / "auto.zarr", "--state-memory", shared + 2 * per_layer + 1)
    assert "3 passes of at most 2 layers (0; 1,2; 3,4)" in r.output
    for g in ["llama/final", *(f"llama/final/layers/{l}" for l in range(4))]:
        assert_same_group(tmp_path / "one.zarr", tmp_path / "auto.zarr", g)


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
    """An extraction's running state of 3 layers in its validation pass (every class kept, every reservoir slot
    filled, a float32 head with a bias, the float32 screen of the linear decisions made): the
    buffers it holds, measured, are state_bytes' per layer x 3 + shared within 0.1% (no hidden copy of the means or
    of the head: the loss and the layers share one float64 head)."""
    from ncanalyze.store.extraction.loss import NextTokenLoss
    from ncanalyze.store.sources.anatomy import LogitTransform
    from ncanalyze.store.extraction.memory import state_bytes
    from ncanalyze.store.extraction.passes import val_state
    from ncanalyze.store.extraction.running import Extraction

    V, d, k = 3000, 48, 2
    plan3 = plan("all", "auto", 0, "float32", 2)
    ex = Extraction(plan3, V, d, k, 0, torch.device("cpu"), None)
    for s in ex.layers.values():
        h, y = torch.randn(20 * V, d), torch.arange(20 * V) % V
        s.stats.update(h, y)  # every class kept, at every NC4 min_count
        s.reservoir.update(h, y.numpy(), np.arange(20 * V))  # every slot filled: the reservoir at its most
    W, bias = torch.randn(V, d), torch.randn(V)
    counts, head = val_state(ex, W, bias, 1, torch.nn.LayerNorm(d))
    loss = NextTokenLoss(*head, LogitTransform(), state=ex.main().lm)
    assert loss.w is head[0] and all(c.w is head[0] and c.mean is s.stats.mean
                                     for c, s in zip(counts, ex.layers.values()))
    assert counts[0]._linear() is counts[1]._linear()  # the layers below the last share one float32 linear screen
    held = _held_bytes(ex.layers, counts, loss)
    per_layer, shared = state_bytes(V, d, k, torch.device("cpu"))
    # within 0.1% (the loss's 0-d sums are not counted): one more V x d float64 copy would be 13% more
    assert abs(held - (3 * per_layer + shared)) <= 1e-3 * held, (held, 3 * per_layer + shared)


def test_a_pass_state_is_freed_before_the_next_pass_state_is_made(tmp_path, monkeypatch):
    """auto sizes one pass's state to the free memory, so the next pass's must not be made while the last one's is
    held: on an H200 the 8B shape's second pass ran out of memory at twice the state (the last pass still held)."""
    import gc
    import weakref

    from ncanalyze.store.extraction.running import Extraction, LayerState

    ex = Extraction(plan("all", 1, 0, "float32", 2), 50, 4, 2, 0, torch.device("cpu"), tmp_path)
    held = [weakref.ref(s) for s in ex.layers.values()]
    alive_at_make = []
    make = LayerState.__init__

    def noting(self, *args, **kwargs):
        gc.collect()
        alive_at_make.append(sum(r() is not None for r in held))
        make(self, *args, **kwargs)

    monkeypatch.setattr(LayerState, "__init__", noting)
    ex.next_pass()
    assert alive_at_make == [0] and ex.pass_index == 1 and (tmp_path / "layer-0.npz").exists()


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
    assert per_layer == 4_343_099_392 + 129 * V + 8 * d and shared == 4_204_744_704  # + NC4 at 4 min_counts, its screen
    fitted = fit_plan(plan("all", "auto", 0, "float32", 32), V, d, 8, torch.device("cuda"), budget, 2**50)
    assert len(fitted.passes) == 3 and fitted.widest_pass == 13
    assert [l for p in indices(fitted.passes) for l in p] == list(range(33))
    assert indices(fitted.passes)[-1] == tuple(range(20, 33))


def test_beside_a_gpu_the_hosts_memory_for_the_reservoirs_bounds_the_layers_a_pass():
    """The reservoir lives on the host whatever the device: at most V x samples x (4d + 24) bytes a layer. On the H100
    machine's 128 GiB host (budget_of: 137.44e9 less a tenth, 123.69e9), the 8B shape with 2 samples per class takes
    128,256 x 2 x 16,408 = 4.209e9 a layer: 29 layers, so the GPU's 13 bind (3 passes); with the default 8, 16.84e9 a
    layer: 7 layers a pass, 5 passes, said in the log; a host that cannot hold one layer's reservoir is one line."""
    from ncanalyze.core.errors import UserError
    from ncanalyze.store.extraction.memory import budget_of, fit_plan, host_bytes

    V, d, cuda = 128_256, 4_096, torch.device("cuda")
    gpu, host = budget_of(80 * 2**30 - 16_100_000_000), budget_of(128 * 2**30)
    assert host == 123_695_058_125 and host_bytes(V, d, 8, cuda) == 128_256 * 8 * 16_408 == 16_835_395_584
    assert host_bytes(V, d, 8, torch.device("cpu")) == 0  # on the CPU state_bytes counts it
    layered = plan("all", "auto", 0, "float32", 32)
    two = fit_plan(layered, V, d, 2, cuda, gpu, host)
    assert len(two.passes) == 3 and two.widest_pass == 13
    eight = fit_plan(layered, V, d, 8, cuda, gpu, host)
    assert eight.widest_pass == 7 and len(eight.passes) == 5 and [l for p in indices(eight.passes) for l in p] == list(range(33))
    assert indices(eight.passes)[-1] == tuple(range(26, 33))
    with pytest.raises(UserError, match="reservoir of one layer .*--samples-per-class 8.* lower --samples-per-class"):
        fit_plan(layered, V, d, 8, cuda, gpu, 10 * 2**30)
    assert fit_plan(layered, V, d, 0, cuda, gpu, 0).widest_pass == 13  # no samples: nothing on the host
