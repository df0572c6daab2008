import json


def test_trained_run_has_checkpoints(trained_run):
    names = sorted(p.name for p in trained_run.glob("checkpoint-*"))
    assert names == ["checkpoint-20", "checkpoint-40", "checkpoint-60"]
    state = json.loads((trained_run / "checkpoint-60" / "trainer_state.json").read_text())
    assert any("eval_loss" in e for e in state["log_history"])
    assert (trained_run / "model.safetensors").exists()
