"""The passes' forward (store/extraction/passes.py, issue 24): a pass below the last layer runs the model only up to
its deepest layer, bit for bit the hidden states ``output_hidden_states`` gives, on a real Trainer checkpoint
(GPT-Neo) and on random-initialised Llama (at V = 128,256), GPT-NeoX, OPT, Gemma-2, Qwen2, OLMo, Falcon, Phi and BLOOM shapes; the loss and
NC4 share the head's float64 logits."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from ncanalyze.store.sources.anatomy import blocks_of, hidden_forward
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


@pytest.mark.slow
def test_a_pass_below_the_last_layer_stops_at_its_deepest_block(trained_run):
    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK), dtype=torch.float32).eval()
    ids = torch.arange(3 * 20).reshape(3, 20) * 7 % model.config.vocab_size
    check_cut(model, 2, ids)


@pytest.mark.slow
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


def test_the_loss_and_nc4_share_the_heads_logits_with_the_same_counts(trained_run):
    """The last layer's NC4 decisions read the kept columns of the float64 logits the loss forms: the counts equal
    those of the decisions' own scores and of a numpy brute force, the loss is bit for bit the loss alone."""
    from ncanalyze.analyzer.accumulate import DecisionCounts
    from ncanalyze.store.extraction.loss import NextTokenLoss
    from ncanalyze.store.sources.anatomy import LogitTransform
    from ncanalyze.store.sources.anatomy import features
    from ncanalyze.store.sources.anatomy import head

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
    both.update(h, y, lambda hc, yc, logits, top: shared.count(hc, yc, shared.linear_decisions(logits)))
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
    from conftest import listening

    with listening(caplog, "ncanalyze.store.sources.anatomy"):
        h = hidden_forward(model, (1,), 2)(ids)
    assert "cannot be cut" in caplog.text
    np.testing.assert_array_equal(h[0].numpy(), want[1][:, :-1].numpy())
    blocks.clear()
    f = hidden_forward(model, (0,), 2)
    f(ids)
    blocks.clear()
    f(ids)  # block 0's input is untouched by the hook: that cut holds
    assert blocks == []


@pytest.mark.slow
def test_the_validation_pass_counts_nc4_at_each_report_min_count(kept_store, trained_run, corpus, tmp_path):
    """An extraction at --min-count 1 holds the decisions over the kept sets of 1, 2, 5 and 20 (val_*_at): its row
    at 5 is, count for count, what an extraction at --min-count 5 of the same tokens counts as its own; `measure
    --min-count 5` of the first has NC4, equal to the second's; the fold counts stay at the extraction's min_count."""
    from conftest import run_cli
    from ncanalyze.analyzer import measure
    from ncanalyze.store.io import read_group

    five = tmp_path / "five.zarr"
    run_cli("extract", trained_run / "checkpoint-20", "--dataset", corpus["train"], "--store", five,
            "--max-train-tokens", 1024, "--max-val-tokens", 512, "--samples-per-class", 1, "--min-count", 5)
    one, other = read_group(kept_store, "neo-2x32/checkpoint-20"), read_group(five, "neo-2x32/checkpoint-20")
    assert one.attrs["min_count"] == 1 and list(one["nc4_min_count"].values) == [1, 2, 5, 20]
    np.testing.assert_array_equal(one["count"].values, other["count"].values)
    row = list(one["nc4_min_count"].values).index(5)
    for name in ("val_correct", "val_ncc_agree"):
        np.testing.assert_array_equal(one[f"{name}_at"].values[row], other[name].values)
        np.testing.assert_array_equal(one[f"{name}_at"].values[0], one[name].values)  # 1: the extraction's own
    assert measure(one, min_count=5)["nc4_agreement"] == measure(other, min_count=5)["nc4_agreement"]
    assert not any(v.startswith("fold_") and "nc4_min_count" in one[v].dims for v in one.data_vars)


@pytest.mark.slow
@pytest.mark.parametrize("every, saved", [(10 ** 6, False), (0, True)], ids=["not-due", "every-batch"])
def test_the_state_is_saved_between_the_passes_only_when_a_save_is_due(trained_run, corpus, tmp_path, monkeypatch,
                                                                        every, saved):
    """Between the train and validation passes the resume state is saved as at any batch boundary, when
    ``--state-every`` seconds have passed: a forced save there cost a short checkpoint as much as its train pass (the
    state, 2.6x larger with folds); the extraction is the same either way."""
    from conftest import EXTRACT_OPTS, assert_same_group, run_cli
    from ncanalyze.store.extraction import resume

    phases, save = [], resume.save_state
    monkeypatch.setattr(resume, "save_state", lambda path, arrays: (phases.append(int(arrays["phase"])),
                                                                    save(path, arrays))[-1])
    store = tmp_path / f"s{every}.zarr"
    run_cli("extract", trained_run / CK, "--dataset", corpus["train"], "--store", store, "--state-every", every,
            *EXTRACT_OPTS)
    assert bool(phases) is saved and (resume.Phase.VALIDATION in phases) is saved, phases
    if saved:
        monkeypatch.setattr(resume, "save_state", save)
        run_cli("extract", trained_run / CK, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr",
                "--state-every", 10 ** 6, *EXTRACT_OPTS)
        assert_same_group(store, tmp_path / "s.zarr", f"{trained_run.name}/{CK}")


@pytest.mark.slow
def test_a_kill_between_the_passes_resumes_from_the_last_train_save_bit_for_bit(trained_run, corpus, tmp_path,
                                                                                monkeypatch):
    """No save is forced between the passes, so a run killed there resumes from the state saved at its last train
    batch (train phase, every batch done): the validation pass runs then, and the group is bit for bit the
    uninterrupted run's."""
    from conftest import assert_same_group
    from ncanalyze.store.extraction import running
    from ncanalyze.store.extraction.settings import ExtractConfig
    from ncanalyze.store.extraction.resume import Phase, load_state
    from ncanalyze.store.runs.local import extract

    def cfg(every: float) -> ExtractConfig:
        return ExtractConfig(dataset=str(corpus["train"]), max_train_tokens=8192, max_val_tokens=4096, batch_size=8,
                             samples_per_class=4, state_every=every, device="cpu")

    ckpt, group = trained_run / CK, f"{trained_run.name}/{CK}"
    extract(ckpt, tmp_path / "a.zarr", cfg(10 ** 6))
    start = running.Extraction.next_phase

    def killed(self, phase):
        if phase == Phase.VALIDATION:
            raise KeyboardInterrupt("killed between the passes")
        start(self, phase)

    monkeypatch.setattr(running.Extraction, "next_phase", killed)
    with pytest.raises(KeyboardInterrupt):
        extract(ckpt, tmp_path / "b.zarr", cfg(0))  # a save at every train batch
    monkeypatch.setattr(running.Extraction, "next_phase", start)
    state = load_state(next(tmp_path.rglob("*.npz")), needs=())
    assert int(state["phase"]) == Phase.TRAIN and int(state["batches"]) > 0
    assert extract(ckpt, tmp_path / "b.zarr", cfg(10 ** 6)).summary().endswith("0 extracted, 1 resumed, 0 already in "
                                                                               f"{tmp_path / 'b.zarr'}")
    assert_same_group(tmp_path / "a.zarr", tmp_path / "b.zarr", group)


def _brute_nc4(H: np.ndarray, y: np.ndarray, W: np.ndarray, b: np.ndarray, M: np.ndarray, kept: np.ndarray,
               V: int) -> dict[str, np.ndarray]:
    """NC4's counts per class over ``kept`` by numpy float64: the linear argmax, the nearest mean (squared distances)."""
    linear = kept[(H @ W[kept].T + b[kept]).argmax(1)]
    ncc = kept[np.concatenate([((H[s:s + 256, None] - M[kept][None]) ** 2).sum(-1).argmin(1)
                               for s in range(0, len(H), 256)])]
    return {"val_count": np.bincount(y, minlength=V), "val_correct": np.bincount(y[linear == y], minlength=V),
            "val_ncc_agree": np.bincount(y[linear == ncc], minlength=V)}


@pytest.mark.slow
def test_a_validation_pass_counts_as_a_float64_brute_force_at_every_kept_set_and_fold(trained_run, corpus, tmp_path,
                                                                                       monkeypatch):
    """The validation pass of a Trainer checkpoint (its NC4 decisions screened in float32, rechecked in float64)
    stores, count for count, what a numpy float64 brute force of the same features counts: val_*, each
    NC4_MIN_COUNTS row of val_*_at, each fold's fold_val_* and, per fold f, the agreements outside f under the means
    of the train features outside f (fold_val_ncc_agree_without); the screen decided most tokens."""
    from ncanalyze.analyzer.schema import NC4_MIN_COUNTS
    from ncanalyze.store.data.blocks import open_blocks
    from ncanalyze.store.extraction import passes
    from ncanalyze.store.extraction.layers import plan
    from ncanalyze.store.extraction.running import Extraction
    from ncanalyze.store.extraction.resume import Phase, Saver
    from ncanalyze.store.sources.anatomy import features, head
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(trained_run / CK), dtype=torch.float32).eval()
    W, b = head(model)
    V, d, L, F = W.shape[0], W.shape[1], 32, 4
    tok = AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))
    for split in ("train", "val"):
        np.save(tmp_path / f"{split}.npy", np.array(tok(corpus[split].read_text())["input_ids"], dtype=np.int64))
    train = open_blocks(str(tmp_path / "train.npy"), "train", L, 4096, "text", None, cap_mode="prefix")
    val = open_blocks(str(tmp_path / "val.npy"), "validation", L, 2048, "text", None, cap_mode="prefix")
    ex, saver = Extraction(plan(), V, d, 1, 0, "cpu", folds=F), Saver(tmp_path / "s.npz", dict, every=float("inf"))
    seen = []

    class Seen(passes.DecisionCounts):  # the same counter, kept to read its screen's tallies
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append(self)
    monkeypatch.setattr(passes, "DecisionCounts", Seen)
    passes.train_pass(model, train, ex, 8, saver, "t")
    ex.next_phase(Phase.VALIDATION)
    passes.val_pass(model, val, ex, W, b, 1, 8, saver, "t")
    ids = np.concatenate(list(val.batches(8)))
    with torch.inference_mode():
        H = features(model, torch.from_numpy(ids)).double().numpy()
    y, fold = ids[:, 1:], np.arange(len(ids)) % F
    s = ex.main()
    count, M = s.stats.count.numpy(), s.stats.mean.numpy()
    Wn, bn = W.double().numpy(), (np.zeros(V) if b is None else b.double().numpy())
    flat = H.reshape(-1, d)
    whole = _brute_nc4(flat, y.ravel(), Wn, bn, M, np.nonzero(count >= 1)[0], V)
    for n, want in whole.items():
        np.testing.assert_array_equal(s.val[n].numpy(), want, err_msg=n)
    for i, m in enumerate(NC4_MIN_COUNTS):
        at = _brute_nc4(flat, y.ravel(), Wn, bn, M, np.nonzero(count >= m)[0], V)
        for n in ("val_correct", "val_ncc_agree"):
            np.testing.assert_array_equal(s.val[f"{n}_at"][i].numpy(), at[n], err_msg=f"{n}_at {m}")
    for f in range(F):
        part = _brute_nc4(H[fold == f].reshape(-1, d), y[fold == f].ravel(), Wn, bn, M, np.nonzero(count >= 1)[0], V)
        for n, want in part.items():
            np.testing.assert_array_equal(s.fold_val[n][f].numpy(), want, err_msg=f"fold {f} {n}")
    assert int(s.val["val_ncc_agree"].sum()) > 0 and int(s.val["val_count"].sum()) == y.size
    ncc = seen[0].ncc
    assert ncc.screened > 0.8 * (ncc.screened + ncc.rechecked)
    train_ids = np.concatenate(list(train.batches(8)))
    with torch.inference_mode():
        Ht = features(model, torch.from_numpy(train_ids)).double().numpy().reshape(-1, d)
    yt, ft = train_ids[:, 1:].ravel(), np.repeat(np.arange(len(train_ids)) % F, L - 1)
    np.testing.assert_array_equal(np.bincount(yt, minlength=V), count)
    for f in range(F):
        n = np.bincount(yt[ft != f], minlength=V)
        kept = np.nonzero(n >= 1)[0]
        Mf = np.zeros((V, d))
        np.add.at(Mf, yt[ft != f], Ht[ft != f])
        Mf[kept] /= n[kept, None]
        out = fold != f
        want = _brute_nc4(H[out].reshape(-1, d), y[out].ravel(), Wn, bn, Mf, kept, V)["val_ncc_agree"]
        np.testing.assert_array_equal(s.fold_val["val_ncc_agree_without"][f].numpy(), want, err_msg=f"without {f}")
