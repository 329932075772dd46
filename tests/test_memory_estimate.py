"""The peak-memory estimate is shown with the plan, and an in-memory run past the machine's memory stops before
loading the model with one line naming --sequential (the bench holds the estimate to measured peaks:
bench/memory_estimate.py)."""

import pytest

from qtool.calibration import memory
from tests.helpers import error_lines, run_cli, tiny_llama_and_ids

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama_and_ids(tmp_path_factory.mktemp("memory"))


def test_the_plan_line_estimates_the_peak_and_the_sequential_one(llama, tmp_path):
    ckpt, ids = llama
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", ids, "-o", tmp_path / "a")
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("plan:"))
    assert "peak memory about" in line and "(in-memory); --sequential: about" in line


def test_gptq_statistics_and_logits_grow_the_in_memory_estimate_not_the_sequential_one(llama):
    from qtool.config import load_recipe, resolve_plan
    from qtool.model.hf import meta_causal_lm

    ckpt, _ = llama
    model, _, _ = meta_causal_lm(str(ckpt), False)
    plain = resolve_plan(load_recipe("w4a16-block32"), model)
    gptq = resolve_plan(load_recipe("w4a16-block32-gptq"), model)
    a = memory.estimate_memory(model, plain, "in_memory", 8, 128, 64, True)
    b = memory.estimate_memory(model, gptq, "in_memory", 8, 128, 64, True)
    width = 2 * 64  # the widest layer (down_proj) takes the intermediate size
    assert b.peak - a.peak >= 8 * width * width  # at least its float64 XᵀX
    longer = memory.estimate_memory(model, plain, "in_memory", 8, 1024, 64, True)
    assert longer.peak - a.peak == 4 * 8 * (1024 - 128) * model.config.vocab_size  # one batch's logits
    more = memory.estimate_memory(model, gptq, "sequential", 8, 128, 640, True)
    assert more.peak - b.sequential == 2 * 4 * (640 - 64) * 128 * model.config.hidden_size  # hidden states


def test_past_the_machines_memory_it_stops_and_names_the_flag(llama, tmp_path, monkeypatch):
    from qtool.config import load_recipe, resolve_plan
    from qtool.model.hf import meta_causal_lm

    ckpt, ids = llama
    model, _, _ = meta_causal_lm(str(ckpt), False)
    est = memory.estimate_memory(model, resolve_plan(load_recipe("w8a8"), model), "in_memory", 8, 128, None, True)
    assert est.sequential < est.peak
    # a machine with memory between the two estimates
    monkeypatch.setattr(memory, "available_memory", lambda: (est.peak + est.sequential) // 2)
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", ids, "-o", tmp_path / "r")
    assert code == 2 and not (tmp_path / "r").exists()
    errors = [line for line in error_lines(err) if line.startswith("error:")]
    assert len(errors) == 1 and "pass --sequential" in errors[0] and "GB available" in errors[0], errors
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", ids, "-o", tmp_path / "s", "--sequential")
    assert code == 0, err  # the bounded mode fits
    monkeypatch.setattr(memory, "available_memory", lambda: None)  # unknown: no refusal
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", ids, "-o", tmp_path / "t")
    assert code == 0, err


def test_config_show_with_a_model_says_the_estimate(llama):
    ckpt, _ = llama
    code, out, err = run_cli("config", "show", "w4a16-block32-gptq", "--model", ckpt)
    assert code == 0, err
    assert "calibrating it: peak memory about" in out and "--sequential: about" in out


def test_config_show_json_gives_the_estimate_in_bytes(llama):
    import json

    ckpt, _ = llama
    code, out, err = run_cli("config", "show", "w4a16-block32-gptq", "--model", ckpt, "--json")
    assert code == 0, err
    memory_json = json.loads(out)["memory"]
    assert memory_json["mode"] == "in_memory" and memory_json["sequential_bytes"] < memory_json["peak_bytes"]
    code, out, err = run_cli("config", "show", "gguf-q4_k_m", "--model", ckpt, "--json")
    assert json.loads(out)["memory"]["mode"] == "streaming"  # weights only, no data: calibrate streams it
