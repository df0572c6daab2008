"""benchmarks/gpu.py, the one command of every CUDA check, run at its --small scale on the CPU so it cannot rot: every
check there, and its figures consistent with the times it recorded."""
from __future__ import annotations

import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _gpu_script():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("gpu_script", BENCH / "gpu.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


@pytest.mark.slow
def test_every_check_runs_small_on_the_cpu(tmp_path):
    before = torch.get_num_threads()
    out = tmp_path / "gpu.json"
    script = _gpu_script()
    result = script.main(["--small", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert re.fullmatch(r"[0-9a-f]{12}", result["source"]) and result["source"] == script.source_digest()
    assert torch.get_num_threads() == before  # the thread policy put the caller's count back
    checks = result["checks"]
    assert set(checks) == {"agree", "extract_bf16", "layers_8b", "folds_1b", "metrics"} and result["small"]
    a = checks["agree"]  # extract + measure twice (here both on the CPU): every stored number equal
    assert a["agree"] and a["compared"] > 100 and a["worst_relative"] == 0 and not a["unequal"] + a["missing"]
    for name, layers in (("extract_bf16", "last"), ("layers_8b", "all")):
        c = checks[name]
        n_pass = 1 if layers == "all" else len(c["passes"])  # every layer: auto's last pass timed alone
        assert c["timed"] == ("auto's last pass alone" if layers == "all" else "every pass")
        ratio = statistics.median(c["forward_s"]) * n_pass / statistics.median(c["extract_s"])
        assert c["ratio_per_pass"] == pytest.approx(ratio) and c["layers"] == layers
        kept = sorted(l for p in c["passes"] for l in p)  # hidden_states indices: 0 (embeddings) .. blocks
        assert kept == (list(range(c["blocks"] + 1)) if layers == "all" else [c["blocks"]])
        assert c["peak_rss_bytes"] > 0
    f = checks["folds_1b"]  # --folds 8 against --folds 1 on the same batches
    assert f["ratio"] == pytest.approx(statistics.median(f["folds8_s"]) / statistics.median(f["folds1_s"]))
    assert len(f["folds8_s"]) == len(f["folds1_s"]) == 2 and f["peak_rss_bytes"] > 0
    m = checks["metrics"]
    assert (m["classes"], m["width"]) == (384, 16) and m["ratio"] > 0 and m["metrics_s"] > 0


@pytest.mark.slow  # gpu.py's imports (transformers' Llama, the benchmarks it reuses): 9 s in a fresh worker
def test_without_cuda_the_full_run_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the full run would start")
    with pytest.raises(SystemExit, match="no CUDA device: run on the GPU machine, or --small on the CPU"):
        _gpu_script().main([])


@pytest.mark.slow  # gpu.py's imports, as above
def test_the_summary_of_recorded_runs_says_on_which_code_they_ran(tmp_path, capsys):
    """``--summary`` prints a recorded JSON's lines with its device and whether its source digest is this code's; a
    JSON recorded before the digest says so, and one of other code names both digests."""
    script = _gpu_script()
    check = {"agree": {"model": "GPT-Neo", "compared": 3, "device": "cuda", "agree": True, "worst_relative": 1e-13,
                       "unequal": [], "missing": []}}
    runs = {"here": script.source_digest(), "other": "0" * 12, "old": None}
    for name, source in runs.items():
        run = {"device": "NVIDIA H200", "small": False, "torch": "2.11", "checks": check}
        (tmp_path / f"{name}.json").write_text(json.dumps(run | ({} if source is None else {"source": source})))
    script.main(["--summary", *(str(tmp_path / f"{n}.json") for n in runs)])
    out = capsys.readouterr().out
    assert f"here.json: agree on NVIDIA H200, torch 2.11, code {runs['here']}, this code" in out
    assert f"other.json: agree on NVIDIA H200, torch 2.11, code {'0' * 12}, not this code ({runs['here']})" in out
    assert "old.json: agree on NVIDIA H200, torch 2.11, code not recorded" in out
    assert out.count("agree: GPT-Neo: 3 arrays and attributes of extract + measure on cuda and the CPU: equal") == 3
