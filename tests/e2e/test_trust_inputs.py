"""Inputs said as they are (issue 30): ``--state-memory`` read by one rule stated in ``--help``, with sizes in sensible
units; a NaN row in a checkpoint's output layer named as such, with its token ids, never blamed on the logit
transform."""
from __future__ import annotations

import pytest
from conftest import lone_model, run_cli


def test_state_memory_has_one_rule_stated_in_help():
    from ncanalyze.analyzer import UserError
    from ncanalyze.store.extraction.settings import parse_size

    assert parse_size("1KB") == parse_size("1kB") == parse_size("1e3") == parse_size("1000") == 1000
    assert parse_size("3MB") == 3 * 10**6 and parse_size("3MiB") == 3 * 2**20 and parse_size("40G") == 40 * 10**9
    for bad, words in [("3Mb", "lowercase b is bits; write 3MB"), ("1kb", "write 1kB"), ("0", "not above 0 bytes"),
                       ("-1GB", "not above 0 bytes"), ("0.4", "not above 0 bytes"), ("12 parsecs", "not a size"),
                       ("GB", "kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)")]:
        with pytest.raises(UserError, match="--state-memory") as e:
            parse_size(bad)
        assert words in str(e.value), (bad, str(e.value))
    assert "pass a number and a unit" not in str(e.value)  # a number alone is bytes: never asked for a unit
    text = " ".join(run_cli("extract", "--help").output.split())
    assert "a number of bytes, or a number and a unit: kB, MB, GB, TB (powers of 1000) or KiB" in text
    assert "a lowercase b (bits: 3Mb is refused)" in text


def test_sizes_in_messages_are_in_sensible_units():
    from ncanalyze.analyzer import UserError
    from ncanalyze.store.extraction.layers import auto_groups, plan
    from ncanalyze.core.sizes import bytes_text

    assert [bytes_text(n) for n in (1000, 1024, 3 * 2**19, 5 * 2**30)] == ["1000 B", "1 KiB", "1.5 MiB", "5 GiB"]
    with pytest.raises(UserError) as e:
        auto_groups(plan("all", "auto", 0, "float32", 8), 5 * 2**20, 77, 1000)  # --state-memory 1KB
    assert "needs ~5 MiB but the state may take 1000 B" in str(e.value) and "0.00" not in str(e.value), e.value


@pytest.mark.slow
def test_state_memory_1kb_is_refused_in_sensible_units(trained_run, corpus, kept_store, tmp_path):
    from conftest import fails_cleanly

    args = ("extract", trained_run / "checkpoint-40", "--dataset", corpus["train"], "--layers", "all",
                   "--max-train-tokens", 1024, "--max-val-tokens", 512)
    error = fails_cleanly([*args, "--state-memory", "1KB"], kept_store, ["may take 1000 B", "--state-memory"])
    assert "0.00 GiB" not in error and ("KiB" in error or "MiB" in error), error  # a small size in small units
    fails_cleanly([*args, "--state-memory", "3Mb"], kept_store, ["bits", "3MB"])


@pytest.mark.slow
def test_a_nan_row_of_the_output_layer_is_named_with_its_token_ids(trained_run, corpus, tmp_path):
    from safetensors.torch import load_file, save_file

    model = lone_model(trained_run, tmp_path / "nanhead")
    weights = load_file(model / "model.safetensors")
    vocab = max(t.shape[0] for t in weights.values() if t.ndim == 2)
    for t in weights.values():  # the output layer (tied: the embedding too), rows of two token ids
        if t.ndim == 2 and t.shape[0] == vocab:
            t[vocab - 1] = float("nan")
            t[vocab - 3, 0] = float("inf")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    r = run_cli("extract", model, "--dataset", corpus["train"], "--store", tmp_path / "s.zarr",
                "--max-train-tokens", 1024, "--max-val-tokens", 512, ok=False)
    assert "Traceback" not in r.output and "under none" not in r.output and "logits are not" not in r.output, r.output
    said = [line for line in r.output.splitlines() if "output layer has NaN/Inf" in line]
    assert len(said) == 1 and f"token ids {vocab - 3}, {vocab - 1} (2 of {vocab} rows)" in said[0], r.output


@pytest.mark.slow
def test_a_token_cap_below_min_count_names_the_fix_that_applies(trained_run, corpus, tmp_path):
    """Issue 37 class 22: `--max-train-tokens 0` (or below --min-count 1) is fixed by raising the cap, not by lowering
    --min-count, already at its minimum; with --min-count 5 over a cap of 3 either fix applies, said with its value."""
    args = ("extract", trained_run / "checkpoint-40", "--dataset", corpus["train"], "--store", tmp_path / "s.zarr")
    for extra, said in [(("--max-train-tokens", 0), "raise --max-train-tokens to at least 1 (--min-count)"),
                        (("--max-train-tokens", 0, "--min-count", 5), "raise --max-train-tokens to at least 5"),
                        (("--max-train-tokens", 3, "--min-count", 5),
                         "lower --min-count to at most 3, or raise --max-train-tokens")]:
        out = run_cli(*args, *extra, ok=False).output
        error = [line for line in out.splitlines() if "Error:" in line]
        assert len(error) == 1 and said in error[0], out
        assert extra[-1] != 0 or "lower --min-count" not in error[0]
    assert not (tmp_path / "s.zarr").exists()
