"""qtool report: per-layer SQNR, end-to-end fidelity, gates, plot, sensitivity and suggested recipes."""

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import qtool
from qtool.data import load_data
from qtool.model.insert import set_quantization
from qtool.report import evaluate, sqnr_db

from tests.helpers import error_lines, run_cli
from tests.tinymodels import mlp

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MLP = "tests.tinymodels:mlp"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("rep")
    save_file(mlp().state_dict(), d / "m.safetensors")
    save_file({"x": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}, d / "data.safetensors")
    code, _, err = run_cli("calibrate", d / "m.safetensors", "-c", CONFIGS / "w4a8-block32.yaml", "--data",
                           d / "data.safetensors", "--model-class", MLP, "-o", d / "run")
    assert code == 0, err
    return d


def test_sqnr_numbers_match_a_hand_computation(world):
    model = qtool.load_calibrated(str(world / "m.safetensors"), str(world / "run/encodings.json"), model_class=MLP)
    data = load_data(world / "data.safetensors", batch_size=16)
    rep = evaluate(model, data, torch.device("cpu"))
    x = torch.cat([b.args[0] for b in data])
    with torch.no_grad():
        set_quantization(model, False)
        ref_h0 = model[0](x)
        ref_out = model(x)
        set_quantization(model, True)
        q_h0 = model[0](x)
        q_out = model(x)
        # layer "2" alone: its quantized forward on the float model's input to it
        set_quantization(model, True, only={"2"})
        iso2 = model[2](torch.relu(ref_h0))
        set_quantization(model, False)
        ref2 = model[2](torch.relu(ref_h0))
        set_quantization(model, True)
    rows = {r.module: r for r in rep.layers}
    assert set(rows) == {"0", "2", "4"}
    expect0 = sqnr_db(float(ref_h0.pow(2).sum()), float((ref_h0 - q_h0).pow(2).sum()))
    assert rows["0"].sqnr_cumulative == pytest.approx(expect0, abs=1e-3)
    assert rows["0"].sqnr_isolated == pytest.approx(expect0, abs=1e-3)  # nothing before layer 0
    assert rows["2"].sqnr_isolated == pytest.approx(
        sqnr_db(float(ref2.pow(2).sum()), float((ref2 - iso2).pow(2).sum())), abs=1e-3)
    assert rows["4"].sqnr_cumulative < rows["4"].sqnr_isolated  # errors accumulate
    cos = torch.nn.functional.cosine_similarity(ref_out, q_out, dim=1)
    assert rep.cosine == pytest.approx(float(cos.mean()), abs=1e-6)
    assert rep.top1_agreement == pytest.approx(float((ref_out.argmax(1) == q_out.argmax(1)).float().mean()))
    assert rep.samples == 64


def test_a_module_run_twice_per_forward_is_compared_call_by_call(tmp_path):
    """Each quantized call was compared with the float pass's last call (ALBERT's shared layers read about 7 dB
    where the truth was 36, and failed --min-sqnr), and the isolated figure covered the last call alone."""
    from tests.tinymodels import shared_twice

    save_file(shared_twice().state_dict(), tmp_path / "m.safetensors")
    save_file({"x": torch.randn(32, 64, generator=torch.Generator().manual_seed(0))}, tmp_path / "d.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "-c", CONFIGS / "w4a8-block32.yaml", "--data",
                           tmp_path / "d.safetensors", "--model-class", "tests.tinymodels:shared_twice", "-o",
                           tmp_path / "r")
    assert code == 0, err
    model = qtool.load_calibrated(str(tmp_path / "m.safetensors"), str(tmp_path / "r/encodings.json"),
                                  model_class="tests.tinymodels:shared_twice")
    data = load_data(tmp_path / "d.safetensors", batch_size=32)
    rep = evaluate(model, data, torch.device("cpu"))
    x = data.batches[0].args[0]
    calls = {True: [], False: []}
    shared = model.shared
    with torch.no_grad():
        for on in (False, True):
            set_quantization(model, on)
            handle = shared.register_forward_hook(lambda m, a, out, on=on: calls[on].append((a[0], out)))
            model(x)
            handle.remove()
        # isolated: the quantized layer alone on each float call's input
        set_quantization(model, True, only={"shared"})
        alone = [shared(inp) for inp, _ in calls[False]]
        set_quantization(model, True)
    assert len(calls[False]) == 2
    ref = [out for _, out in calls[False]]
    cumulative = sqnr_db(sum(float(r.pow(2).sum()) for r in ref),
                         sum(float((r - q).pow(2).sum()) for r, (_, q) in zip(ref, calls[True])))
    isolated = sqnr_db(sum(float(r.pow(2).sum()) for r in ref),
                       sum(float((r - q).pow(2).sum()) for r, q in zip(ref, alone)))
    row = {r.module: r for r in rep.layers}["shared"]
    assert row.sqnr_cumulative == pytest.approx(cumulative, abs=1e-3)
    assert row.sqnr_isolated == pytest.approx(isolated, abs=1e-3)
    assert cumulative > 10


def test_report_cli_json_gates_and_plot(world, tmp_path):
    code, out, err = run_cli("report", world / "m.safetensors", "-e", world / "run/encodings.json", "--data",
                             world / "data.safetensors", "--model-class", MLP, "--json", "--plot", tmp_path / "r.png")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["ok"] is True and rep["samples"] == 64 and len(rep["layers"]) == 3
    sqnrs = [layer["sqnr_cumulative_db"] for layer in rep["layers"]]
    assert sqnrs == sorted(sqnrs)  # worst first
    assert not any("not compared" in n for n in rep["notes"]), rep["notes"]  # (its manifest.json lies beside)
    lone = tmp_path / "lone"  # encodings alone: nothing compared, and nothing was said
    lone.mkdir()
    shutil.copy(world / "run/encodings.json", lone)
    code, out, err = run_cli("report", world / "m.safetensors", "-e", lone / "encodings.json", "--data",
                             world / "data.safetensors", "--model-class", MLP, "--json")
    assert code == 0 and any(n.startswith(f"no manifest.json beside {lone / 'encodings.json'}: the weights the "
                                          "encodings were made on are not compared")
                             for n in json.loads(out)["notes"]), out
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # an .svg name gets an SVG (it got PNG bytes), another suffix one line before anything runs
    code, _, err = run_cli("report", world / "m.safetensors", "-e", world / "run/encodings.json", "--data",
                           world / "data.safetensors", "--model-class", MLP, "--plot", tmp_path / "r.svg", "-q")
    assert code == 0, err
    assert (tmp_path / "r.svg").read_text().lstrip().startswith("<?xml")
    code, _, err = run_cli("report", world / "m.safetensors", "-e", world / "run/encodings.json", "--data",
                           world / "data.safetensors", "--model-class", MLP, "--plot", tmp_path / "r2.svg", "-q")
    # the same figure, the same bytes (the SVG held its date and random element ids)
    assert code == 0 and (tmp_path / "r2.svg").read_bytes() == (tmp_path / "r.svg").read_bytes()
    code, _, err = run_cli("report", world / "m.safetensors", "-e", world / "run/encodings.json", "--data",
                           world / "data.safetensors", "--model-class", MLP, "--plot", tmp_path / "r.pdf", "-q")
    assert code == 2 and "--plot" in err and ".png or .svg" in err and not (tmp_path / "r.pdf").exists()
    # gates: a failing one exits 1 and names itself; a passing one exits 0
    worst = sqnrs[0]
    code, out, err = run_cli("report", world / "m.safetensors", "-e", world / "run/encodings.json", "--data",
                             world / "data.safetensors", "--model-class", MLP, "--min-sqnr", worst + 1,
                             "--min-cosine", 0.5, "--quiet")
    assert code == 1
    assert f"gate failed: --min-sqnr {worst + 1}" in err and "min-cosine" not in err
    code, out, err = run_cli("report", world / "m.safetensors", "-e", world / "run/encodings.json", "--data",
                             world / "data.safetensors", "--model-class", MLP, "--min-sqnr", worst - 1,
                             "--min-cosine", 0.5, "--quiet")
    assert code == 0, err
    code, _, err = run_cli("report", world / "m.safetensors", "-e", world / "run/encodings.json", "--data",
                           world / "data.safetensors", "--model-class", MLP, "--max-ppl-increase", 1,
                           "--plot", tmp_path / "p.png")
    assert code == 2 and "needs a causal language model" in err
    assert "measuring" not in err and not (tmp_path / "p.png").exists()  # (refused once loaded: nothing ran)


def test_a_module_never_run_has_no_figure_and_huge_outputs_are_measured(tmp_path):
    """A module the data never runs read an isolated SQNR of "inf" (lossless) where docs/report.md promises none;
    and outputs near 1e21, finite, read NaN and inf (the sums of squares were float32)."""
    from tests.tinymodels import spare

    spec = "tests.tinymodels:spare"
    weights = spare().state_dict()
    weights["body.0.weight"] = weights["body.0.weight"] * 1e20
    save_file(weights, tmp_path / "m.safetensors")
    save_file({"x": torch.randn(32, 64, generator=torch.Generator().manual_seed(0))}, tmp_path / "data.safetensors")
    args = ("--data", tmp_path / "data.safetensors", "--model-class", spec)
    assert run_cli("calibrate", tmp_path / "m.safetensors", "-c", CONFIGS / "w8a8.yaml", *args, "-o",
                   tmp_path / "run")[0] == 0
    code, out, err = run_cli("report", tmp_path / "m.safetensors", "-e", tmp_path / "run/encodings.json", *args,
                             "--json", "-q")
    assert code == 0, err
    rows = {r["module"]: r for r in json.loads(out)["layers"]}
    assert rows["spare"]["sqnr_cumulative_db"] is None and rows["spare"]["sqnr_isolated_db"] is None
    model = qtool.load_calibrated(str(tmp_path / "m.safetensors"), str(tmp_path / "run/encodings.json"),
                                  model_class=spec)
    x = load_file(tmp_path / "data.safetensors")["x"]
    with torch.no_grad():
        set_quantization(model, False)
        ref = model.body[0](x).double()
        set_quantization(model, True)
        q = model.body[0](x).double()
    assert ref.abs().max() > 1e19 and torch.isfinite(ref).all()
    expect = sqnr_db(float(ref.pow(2).sum()), float((ref - q).pow(2).sum()))
    assert 20 < expect < 80 and rows["body.0"]["sqnr_isolated_db"] == pytest.approx(expect, abs=1e-6)


def test_a_failed_gates_value_never_prints_as_its_threshold():
    """cosine 0.99988883734 against --min-cosine 0.99988884 printed "cosine 0.9999", which reads as passing; a
    perplexity that fell printed "+-0.07%"."""
    from qtool.report import LayerError, Report, check_gates

    rep = Report([LayerError("a", "Linear", 28.21, 30.0)], 0.99988883734, 0.9998, perplexity_float=100.0,
                 perplexity_quant=99.93)
    sqnr, cos, ppl = (g.line() for g in check_gates(rep, min_sqnr=28.214, min_cosine=0.99988884,
                                                     max_ppl_increase=-0.08))
    assert cos.endswith("cosine 0.999888837") and sqnr.endswith("a at 28.210 dB"), (cos, sqnr)
    assert ppl.endswith("perplexity -0.07%"), ppl
    assert check_gates(rep, min_cosine=0.5)[0].detail == "cosine 0.9999"  # (the usual precision where it tells)


def test_sensitivity_ranks_layers_and_the_suggestion_helps(world, tmp_path):
    code, out, err = run_cli("report", world / "m.safetensors", "-e", world / "run/encodings.json", "--data",
                             world / "data.safetensors", "--model-class", MLP, "--sensitivity", "--json",
                             "--suggest", f"1 {tmp_path / 'keep.yaml'}", "--recipe", CONFIGS / "w4a8-block32.yaml")
    assert code == 0, err
    sens = json.loads(out)["sensitivity"]
    assert [r["damage"] for r in sens] == sorted((r["damage"] for r in sens), reverse=True)
    most = sens[0]["module"]
    code, out, err = run_cli("report", world / "m.safetensors", "-e", world / "run/encodings.json", "--data",
                             world / "data.safetensors", "--model-class", MLP, "--sensitivity")
    assert code == 0 and "damage (1 - cosine)" in out, out  # (the table named no unit: a perplexity % for LMs)
    code, _, err = run_cli("config", "validate", tmp_path / "keep.yaml")
    assert code == 0, err
    code, _, err = run_cli("calibrate", world / "m.safetensors", "-c", tmp_path / "keep.yaml", "--data",
                           world / "data.safetensors", "--model-class", MLP, "-o", tmp_path / "run2")
    assert code == 0, err
    enc = {q["name"]: q for q in json.loads((tmp_path / "run2/encodings.json").read_text())["quantizers"]}
    assert enc[f"{most}.weight"]["bitwidth"] == 8 and enc[f"{most}.input"]["bitwidth"] == 16
    reps = []
    for run in (world / "run", tmp_path / "run2"):
        model = qtool.load_calibrated(str(world / "m.safetensors"), str(run / "encodings.json"), model_class=MLP)
        reps.append(evaluate(model, load_data(world / "data.safetensors", batch_size=32), torch.device("cpu")))
    assert reps[1].cosine > reps[0].cosine


def test_causal_lm_perplexity(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "m")
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "ids.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", CONFIGS / "w8a8.yaml", "--data",
                           tmp_path / "ids.safetensors", "-o", tmp_path / "run")
    assert code == 0, err
    code, out, err = run_cli("report", tmp_path / "m", "-e", tmp_path / "run/encodings.json", "--data",
                             tmp_path / "ids.safetensors", "--json", "--max-ppl-increase", 50)
    assert code == 0, err
    e2e = json.loads(out)["end_to_end"]
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert e2e["perplexity_float"] == pytest.approx(math.exp(float(loss)), rel=1e-4)
    assert e2e["perplexity_quant"] > 0 and e2e["perplexity_increase_pct"] is not None


def test_a_tied_table_quantized_for_one_module_says_the_other_runs_it_in_float(tmp_path):
    """SmolLM2's lm_head is its embedding table; a recipe quantizing the table (lm_head ignored) was reported
    without a word that the figures run lm_head on the float table (a qtool file holds one quantized table)."""
    from tests.helpers import tiny_llama

    ckpt = tiny_llama(tmp_path / "m", tie_word_embeddings=True)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "ids.safetensors")
    code, _, err = run_cli("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "run", "-q")
    assert code == 0, err
    code, out, err = run_cli("report", ckpt, "-e", tmp_path / "run/encodings.json", "--data",
                             tmp_path / "ids.safetensors", "--json")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert len(notes) == 1 and "qtool file" in notes[0]
    assert notes[0].startswith("lm_head computes with model.embed_tokens.weight (tied), which the encodings quantize "
                               "for model.embed_tokens only")
    code, out, _ = run_cli("report", ckpt, "-e", tmp_path / "run/encodings.json", "--data",
                           tmp_path / "ids.safetensors")
    assert code == 0 and "note: lm_head computes with model.embed_tokens.weight (tied)" in " ".join(out.split())


def test_report_refuses_data_the_model_cannot_run_in_one_line(tmp_path):
    """Token ids beyond the vocabulary (a tokenizer that does not match the model) used to end in an IndexError
    traceback; now one line naming the batch, exit 2."""
    from safetensors.torch import save_file

    from tests.helpers import error_lines, run_cli, tiny_llama

    tiny_llama(tmp_path / "m")
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ok.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", "w8a8", "--data", tmp_path / "ok.safetensors",
                           "-o", tmp_path / "run", "--quiet")
    assert code == 0, err
    # a single-array tensor file reaches the model as its positional input_ids: perplexity is measured from them
    code, out, err = run_cli("report", tmp_path / "m", "-e", tmp_path / "run/encodings.json", "--data",
                             tmp_path / "ok.safetensors", "--json")
    assert code == 0, err
    assert json.loads(out)["end_to_end"]["perplexity_float"] > 1
    ids[3, 2] = 5000
    save_file({"input_ids": ids}, tmp_path / "bad.safetensors")
    code, _, err = run_cli("report", tmp_path / "m", "-e", tmp_path / "run/encodings.json", "--data",
                           tmp_path / "bad.safetensors", "--batch-size", "2")
    assert code == 2
    assert error_lines(err)[-1] == (f"error: {tmp_path / 'bad.safetensors'}: evaluation batch 2: the model rejected "
                                    "the data: token id 5000 is past the "
                                   "model's vocabulary (256 embeddings): the tokenizer (or the id file) belongs to another model")


@pytest.mark.parametrize("command", ["report", "calibrate", "calibrate-sequential"])
def test_token_ids_past_the_vocabulary_are_one_line(tmp_path, command):
    """A tokenizer that belongs to another model (ids past the embedding table) is named as that, exit 2 (#34)."""
    from tests.helpers import run_cli, tiny_llama

    ckpt = tiny_llama(tmp_path / "llama")  # vocabulary 256, MiniLM's tokenizer (ids up to 30521)
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    if command == "report":
        code, _, err = run_cli("calibrate", ckpt, "-c", "w8a16", "-o", tmp_path / "run", "--quiet")
        assert code == 0, err
        code, _, err = run_cli("report", ckpt, "-e", tmp_path / "run" / "encodings.json", "--data", text)
    else:
        code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", text, "-o", tmp_path / "out", "--quiet",
                               *(["--sequential"] if command.endswith("sequential") else []))
        assert not (tmp_path / "out").exists()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert "past the model's vocabulary (256 embeddings)" in lines[0], lines[0]


def test_negative_token_ids_are_one_line_naming_them(tmp_path):
    """Labels' -100 padding as ids read "index out of range in self"."""
    from safetensors.torch import save_file

    from tests.helpers import run_cli, tiny_llama

    ckpt = tiny_llama(tmp_path / "llama")
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    ids[:, -3:] = -100
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", tmp_path / "ids.safetensors", "-o",
                           tmp_path / "out", "--quiet")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "token id -100 is negative" in lines[0], err


def test_a_layer_whose_sqnr_is_nan_fails_the_gate_and_the_json_stays_json(capsys):
    """NaN sorted anywhere (it compares false both ways), so the --min-sqnr gate read a finite layer and passed
    over NaN ones; and --json wrote bare NaN tokens, which strict parsers refuse."""
    from qtool.cli.core import _emit_json
    from qtool.report import LayerError, Report, check_gates

    nan = float("nan")
    rep = Report([LayerError("a", "Linear", 30.0, 31.0), LayerError("b", "Linear", nan, nan),
                  LayerError("c", "Linear", 25.0, 40.0), LayerError("d", "Linear", None, 12.0)], nan, nan)
    assert [r.module for r in rep.worst_first()] == ["b", "c", "a", "d"]
    (gate,) = check_gates(rep, min_sqnr=20.0)
    assert not gate.passed and math.isnan(gate.value)
    assert not check_gates(rep, min_cosine=0.5)[0].passed
    _emit_json({"report": rep.to_json(), "value": gate.value, "inf": [float("inf"), -math.inf]})
    out = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert out["report"]["end_to_end"]["cosine_mean"] == "nan" and out["value"] == "nan"
    assert out["report"]["layers"][0]["sqnr_cumulative_db"] == "nan" and out["inf"] == ["inf", "-inf"]


def test_a_suggestion_keeps_fused_layers_together_and_says_what_it_keeps():
    """Runtimes fuse q/k/v and gate/up (one tensor, one setting): keeping only the most sensitive of them at 8 bits
    wrote a mix no fused kernel runs; and a recipe without activations was told of 16-bit ones."""
    import yaml

    from qtool.report import suggest_recipe

    rows = [{"module": "model.layers.1.self_attn.v_proj"}, {"module": "model.layers.0.mlp.up_proj"},
            {"module": "model.layers.0.mlp.gate_proj"}, {"module": "model.layers.1.self_attn.q_proj"},
            {"module": "model.layers.1.self_attn.k_proj"}, {"module": "model.layers.1.self_attn.o_proj"}]
    text = suggest_recipe(rows, 2)
    kept = [r["match"] for r in yaml.safe_load(text)["layers"]]
    assert kept == ["model.layers.1.self_attn.v_proj", "model.layers.1.self_attn.q_proj",
                    "model.layers.1.self_attn.k_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_proj"]
    assert "the 2 most sensitive layers, with 3 layers fused with them" in text and "activations" not in text
    from qtool.report import _Grid

    grids = {"fc": (_Grid("int", 4, "per_channel"), _Grid("int", 8, "per_tensor"))}
    assert "16-bit activations" in suggest_recipe([{"module": "fc", "has_activations": True}], 1, grids=grids)


def test_without_a_recipe_a_suggestion_keeps_each_layer_above_its_own_calibrated_grid(world, tmp_path):
    """Without --recipe every kept layer got 8-bit per-channel weights whatever the run used: over a Q8_0 run a
    lower precision (and a grid GGUF cannot hold), over a w8a8 run the same grid, under "kept at higher
    precision"."""
    import yaml

    args = ["report", world / "m.safetensors", "--data", world / "data.safetensors", "--model-class", MLP,
            "--sensitivity", "-q"]
    code, _, err = run_cli(*args, "-e", world / "run/encodings.json", "--suggest", f"2 {tmp_path / 'w4.yaml'}")
    assert code == 0, err  # (the world's run is w4a8-block32: 4-bit blocks, static 8-bit activations)
    rules = yaml.safe_load((tmp_path / "w4.yaml").read_text())["layers"]
    assert [r["weights"] for r in rules] == [{"bitwidth": 8, "symmetric": True}] * 2
    assert all(r["activations"] == {"bitwidth": 16} for r in rules)
    assert "8-bit symmetric per_block weights" in (tmp_path / "w4.yaml").read_text()
    code, _, err = run_cli("calibrate", world / "m.safetensors", "-c", "gguf-q8_0", "--model-class", MLP, "-o",
                           tmp_path / "q8")
    assert code == 0, err
    code, _, err = run_cli(*args, "-e", tmp_path / "q8/encodings.json", "--suggest", f"1 {tmp_path / 'q8.yaml'}")
    assert code == 0, err
    (rule,) = yaml.safe_load((tmp_path / "q8.yaml").read_text())["layers"]
    assert rule["weights"] is None and "(float weights)" in (tmp_path / "q8.yaml").read_text()


@pytest.mark.parametrize("flag", ["--suggest", "--pareto"])
def test_an_output_onto_the_calibrations_manifest_is_refused(world, tmp_path, flag):
    """--suggest 'N run/manifest.json' overwrote the calibration's manifest (which report reads to check the
    weights) with a YAML recipe, exit 0; export and report of those encodings then failed for good."""
    import shutil

    shutil.copytree(world / "run", tmp_path / "run")
    from tests.test_mixed import _SEARCH

    (tmp_path / "run/search.json").write_text(json.dumps(_SEARCH))  # (a valid record: read before the outputs')
    manifest = (tmp_path / "run/manifest.json").read_bytes()
    out = {"--suggest": ["--sensitivity", "--suggest", f"1 {tmp_path / 'run/manifest.json'}"],
           "--pareto": ["--pareto", tmp_path / "run/manifest.svg"]}[flag]
    code, _, err = run_cli("report", world / "m.safetensors", "--data", world / "data.safetensors", "--model-class",
                           MLP, "-e", tmp_path / "run/encodings.json", *out, "-q")
    assert code == 2 and "writing it would replace an input" in err and "calibration manifest" in err, err
    assert (tmp_path / "run/manifest.json").read_bytes() == manifest
    assert not (tmp_path / "run/manifest.svg").exists()


def test_a_run_that_quantizes_nothing_keeps_its_gate_and_suggests_nothing(world, tmp_path):
    """--min-sqnr vanished from the gates and --suggest wrote an empty recipe of "the 0 most sensitive layers"."""
    (tmp_path / "float.yaml").write_text("version: 1\ndefaults:\n  weights: null\n  activations: null\n")
    code, _, err = run_cli("calibrate", world / "m.safetensors", "-c", tmp_path / "float.yaml", "--model-class",
                           MLP, "-o", tmp_path / "f")
    assert code == 0, err
    args = ["report", world / "m.safetensors", "-e", tmp_path / "f/encodings.json", "--data",
            world / "data.safetensors", "--model-class", MLP, "--min-sqnr", "30"]
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["gates"] == [{"gate": "min-sqnr", "threshold": 30.0, "value": None, "passed": True}]
    assert any(n.startswith("no module is quantized") for n in got["notes"]), got["notes"]
    code, _, err = run_cli(*args, "--sensitivity", "--suggest", f"1 {tmp_path / 's.yaml'}", "--plot",
                           tmp_path / "p.svg")
    assert code == 2 and "--suggest: the encodings quantize no module" in err, err
    assert not (tmp_path / "s.yaml").exists() and not (tmp_path / "p.svg").exists()


def test_a_checkpoint_holding_nan_is_refused_before_it_is_measured(world, tmp_path):
    """Its float outputs are NaN, and so is every figure: report exited 0 with cosine nan (calibrate refuses such
    a checkpoint); one line naming the tensor, exit 2."""
    sd = mlp().state_dict()
    name = next(iter(sd))
    sd[name].view(-1)[3] = float("nan")
    save_file(sd, tmp_path / "nan.safetensors")
    code, out, err = run_cli("report", tmp_path / "nan.safetensors", "-e", world / "run/encodings.json", "--data",
                             world / "data.safetensors", "--model-class", MLP, "--json", "-q")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and f"{name} holds NaN or infinity" in lines[0], err
    assert json.loads(out)["ok"] is False


def test_the_kl_of_nearly_equal_outputs_is_never_below_zero():
    """float32 rounding made a report's KL -8e-9 for outputs the quantization left unchanged; KL is >= 0 (eval's
    own clamps each position at 0 too)."""
    from qtool.data import Batch
    from qtool.report import _token_kl

    g = torch.Generator().manual_seed(1)
    ref = torch.randn(2, 8, 1000, generator=g) * 3
    out = ref + 1e-6 * torch.randn(2, 8, 1000, generator=g)
    logp, logq = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    assert float((logp.exp() * (logp - logq)).sum()) < 0  # what the positions' sum was
    total, n = _token_kl(ref, out, Batch(kwargs={"input_ids": torch.zeros(2, 8, dtype=torch.long)}))
    assert n == 16 and 0.0 <= total < 1e-6


def test_the_cosine_of_a_language_models_logits_is_exact_to_1e_6():
    """float32 over one sample's 128 x 49,152 logits read 1.0004 for identical outputs (and passed a --min-cosine
    0.9999 gate that the exact 0.9998 fails)."""
    from qtool.report import _per_sample_cosine

    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 128, 49152, generator=g) * 4
    b = a + 0.1 * torch.randn(2, 128, 49152, generator=g)
    exact = torch.nn.functional.cosine_similarity(a.double().reshape(2, -1), b.double().reshape(2, -1), dim=1)
    assert (_per_sample_cosine(a, a) - 1).abs().max() < 1e-6
    assert (_per_sample_cosine(a, b).double() - exact).abs().max() < 1e-6


@pytest.mark.parametrize("value,needle", [("0 k.yaml", "--suggest 0: N is how many of the most damaging layers"),
                                          ("-1 k.yaml", "--suggest -1: N is how many"),
                                          ("k.yaml", "--suggest takes 'N OUT.yaml'"),
                                          ("--3 k.yaml", "--suggest takes 'N OUT.yaml'")])
def test_a_suggest_count_below_one_says_what_n_is(value, needle):
    from qtool.cli.measure import _suggest_flag
    from qtool.errors import UsageError

    with pytest.raises(UsageError, match=re.escape(needle)):
        _suggest_flag([value], True)
    assert _suggest_flag(["2 k.yaml"], True) == (2, "k.yaml")


def test_a_model_giving_one_number_per_sample_is_compared_over_the_samples(tmp_path):
    """One number's cosine is its sign: a regression head's report read cosine 1.0 and top-1 1.0 whatever the
    error, and --min-cosine always passed. The column of every sample's number is compared instead."""
    from qtool.mixed import _Scorer
    from tests.tinymodels import regressor

    spec = "tests.tinymodels:regressor"
    save_file(regressor().state_dict(), tmp_path / "m.safetensors")
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    save_file({"x": x}, tmp_path / "data.safetensors")
    recipe = tmp_path / "w2.yaml"  # crude enough that the outputs move
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 2, symmetric: false, granularity: per_tensor}\n"
                      "  activations: {bitwidth: 4, symmetric: false}\n")
    assert run_cli("calibrate", tmp_path / "m.safetensors", "-c", recipe, "--data", tmp_path / "data.safetensors",
                   "--model-class", spec, "-o", tmp_path / "run")[0] == 0
    code, out, err = run_cli("report", tmp_path / "m.safetensors", "-e", tmp_path / "run/encodings.json", "--data",
                             tmp_path / "data.safetensors", "--model-class", spec, "--json", "-q")
    assert code == 0, err
    rep = json.loads(out)
    end = rep["end_to_end"]
    model = qtool.load_calibrated(str(tmp_path / "m.safetensors"), str(tmp_path / "run/encodings.json"),
                                  model_class=spec)
    with torch.no_grad():
        set_quantization(model, False)
        ref = model(x)
        set_quantization(model, True)
        got = model(x)
    assert torch.nn.functional.cosine_similarity(ref, got, dim=1).abs().eq(1).all()  # each sample's: its sign
    a, b = ref.reshape(-1).double(), got.reshape(-1).double()
    want = float(torch.nn.functional.cosine_similarity(a - a.mean(), b - b.mean(), dim=0))  # their correlation
    assert want < 0.999
    assert end["cosine_mean"] == pytest.approx(want, abs=1e-6) and end["cosine_min"] == end["cosine_mean"]
    assert end["top1_agreement"] is None
    assert rep["samples"] == 64 and any("one number per sample" in n for n in rep["notes"])
    code, _, err = run_cli("report", tmp_path / "m.safetensors", "-e", tmp_path / "run/encodings.json", "--data",
                           tmp_path / "data.safetensors", "--model-class", spec, "--min-cosine", 0.999, "-q")
    assert code == 1 and "gate failed: --min-cosine" in err, err
    # the size-budget search's damage: the squared error over the float outputs' mean square, not 1 - cosine
    batch = next(iter(load_data(tmp_path / "data.safetensors", batch_size=64)))
    scorer = _Scorer(ref, batch, causal_lm=False)
    damage, n, _ = scorer.score(got)
    assert n == 64 and damage == pytest.approx(float((ref - got).pow(2).sum() / ref.pow(2).mean()), rel=1e-6)
    assert damage > 0 and scorer.score(ref)[0] == 0.0


def test_encodings_calibrated_on_other_weights_are_refused(world, tmp_path):
    """Encodings of one model measured on another of the same shapes: every figure was of ranges (and codes) chosen
    for other numbers, exit 0 without a word. The calibration's manifest records its weights, as export checks."""
    other = {k: v * 1.5 for k, v in mlp().state_dict().items()}
    save_file(other, tmp_path / "other.safetensors")
    code, out, err = run_cli("report", tmp_path / "other.safetensors", "-e", world / "run/encodings.json", "--data",
                             world / "data.safetensors", "--model-class", MLP, "--json")
    assert code == 2 and "calibrated on other weights than" in json.loads(out)["error"], out
    assert "m.safetensors" in json.loads(out)["error"]
    code, out, err = run_cli("report", tmp_path / "other.safetensors", "-e", world / "run/encodings.json", "--data",
                             world / "data.safetensors", "--model-class", MLP, "--json", "--allow-other-checkpoint")
    assert code == 0 and any(n.startswith("--allow-other-checkpoint: the encodings were calibrated on other weights")
                             for n in json.loads(out)["notes"]), out
    # a byte-identical copy elsewhere is the same checkpoint
    (tmp_path / "copy.safetensors").write_bytes((world / "m.safetensors").read_bytes())
    code, _, err = run_cli("report", tmp_path / "copy.safetensors", "-e", world / "run/encodings.json", "--data",
                           world / "data.safetensors", "--model-class", MLP, "-q")
    assert code == 0, err


@pytest.mark.parametrize("base, weights, activations", [
    ("nvfp4a16", None, None),  # 8-bit over an FP4 element was an invalid recipe, written after the whole run
    ("fp8-dynamic", None, None),
    ("w8a16", None, None),  # 8-bit per-channel over 8-bit per-channel kept nothing
    ("w8a8", None, {"bitwidth": 16}),
    ("gguf-q4_k_m", {"gguf_type": "q8_0"}, None),  # 8-bit per-channel has no GGUF type
    ("gguf-q4_0", {"bitwidth": 8, "symmetric": True}, None),  # its blocks of 32, float16 scales: Q8_0
    ("w4a8-block32", {"bitwidth": 8, "symmetric": True}, {"bitwidth": 16}),
])
def test_a_suggestion_is_above_the_base_recipe_in_its_own_format(base, weights, activations):
    from qtool.config import parse_recipe, resolve_plan
    from qtool.config.shipped import recipe_file
    from qtool.report import suggest_recipe

    text = suggest_recipe([{"module": "2", "has_activations": True}], 1, Path(recipe_file(base)).read_text())
    rule = parse_recipe(text, "s.yaml").layers[-1]
    assert (rule.match, rule.weights, rule.activations) == ("2", weights, activations)
    if base == "gguf-q4_0":
        row = next(q for q in resolve_plan(parse_recipe(text, "s.yaml"), mlp()).weights if q.module == "2")
        assert (row.bitwidth, row.block_size, row.scale_dtype) == (8, (1, 32), "float16")


def test_two_outputs_of_one_name_are_refused_before_anything_runs(world, tmp_path):
    """--pareto cc.svg with --suggest '2 cc.json' (the curve's points) or --plot x.svg with --pareto x.svg: one file
    overwrote the other, exit 0."""
    same = tmp_path / "same.svg"
    code, _, err = run_cli("report", world / "m.safetensors", "-e", world / "run/encodings.json", "--data",
                           world / "data.safetensors", "--model-class", MLP, "--plot", same, "--sensitivity",
                           "--suggest", f"1 {same}")
    assert code == 2 and f"--suggest {same}: --plot writes that file too" in err, err
    assert "measuring" not in err and not same.exists()


@pytest.mark.parametrize("command", ["calibrate", "report"])
def test_data_missing_an_input_the_model_needs_is_bad_data_not_an_internal_error(tmp_path, command):
    """CLIP given text (no pixel_values), Whisper given text (no input_features): the model's None.shape was
    'internal error', exit 3."""
    from tests.tinymodels import needs_two

    spec = "tests.tinymodels:needs_two"
    save_file(needs_two().state_dict(), tmp_path / "m.safetensors")
    save_file({"x": torch.randn(4, 64)}, tmp_path / "d.safetensors")
    args = ("calibrate", tmp_path / "m.safetensors", "-c", "w8a8", "-o", tmp_path / "run")
    if command == "report":
        assert run_cli("calibrate", tmp_path / "m.safetensors", "-c", "w8a16", "-o", tmp_path / "r2",
                       "--model-class", spec)[0] == 0
        args = ("report", tmp_path / "m.safetensors", "-e", tmp_path / "r2/encodings.json")
    code, _, err = run_cli(*args, "--data", tmp_path / "d.safetensors", "--model-class", spec, "-q")
    assert code == 2 and "it needs an input the data does not give" in err, err


def test_an_encoder_decoder_given_only_encoder_inputs_is_told_what_is_missing(tmp_path):
    """T5 given text: "You must specify exactly one of input_ids or inputs_embeds", where the data gave input_ids
    and the decoder's were missing."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    transformers.T5ForConditionalGeneration(cfg).eval().save_pretrained(tmp_path / "t5")
    save_file({"input_ids": torch.randint(0, 128, (4, 16))}, tmp_path / "d.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "t5", "-c", "w8a8", "--data", tmp_path / "d.safetensors", "-o",
                           tmp_path / "run", "-q")
    assert code == 2 and "an encoder-decoder model (T5ForConditionalGeneration) runs its decoder on " \
        "decoder_input_ids, which the data does not give (it gives one tensor)" in err, err


def test_flags_that_would_do_nothing_or_mislead_are_one_line(tmp_path):
    """--recipe without --suggest was ignored without a word; --max-ppl-increase on windows of one token said the
    checkpoint was no causal LM."""
    from tests.helpers import tiny_llama_and_ids

    ckpt, ids = tiny_llama_and_ids(tmp_path)
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a16", "-o", tmp_path / "run", "-q")
    assert code == 0, err
    base = ("report", ckpt, "-e", tmp_path / "run/encodings.json", "--data", ids, "-q")
    code, _, err = run_cli(*base, "--recipe", "w8a16")
    assert code == 2 and "--recipe is the recipe --suggest extends" in err, err
    (tmp_path / "t.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    code, _, err = run_cli("report", ckpt, "-e", tmp_path / "run/encodings.json", "--data", tmp_path / "t.txt",
                           "--seq-len", "1", "--num-samples", "4", "--max-ppl-increase", "5", "-q")
    assert code == 2 and "no next token was scored" in err, err


def test_the_cosine_of_equal_outputs_is_never_above_one():
    """float32 rounding gave 1.0000001 for identical outputs (a 16-bit run's report read cosine above 1)."""
    from qtool.report import _per_sample_cosine, output_cosines

    a = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    assert (torch.nn.functional.cosine_similarity(a, a.clone(), dim=1) > 1).any()  # what torch gives
    assert _per_sample_cosine(a, a.clone()).max() == 1.0
    assert output_cosines([a[:, :1]], [a[:, :1].clone()], [None]).max() <= 1.0


@pytest.mark.parametrize("base", [None, "w8a8", "w4a16-block32", "gguf-q4_0"])
def test_a_suggestion_of_several_layers_is_a_recipe_qtool_reads(base):
    """One spec dict shared by every kept layer was written as YAML anchors, which recipes refuse: the report's
    suggestion failed after the whole measurement (review)."""
    from qtool.config import parse_recipe
    from qtool.config.shipped import recipe_file
    from qtool.report import suggest_recipe

    rows = [{"module": m, "has_activations": True} for m in ("0", "2", "4")]
    text = suggest_recipe(rows, 3, Path(recipe_file(base)).read_text() if base else None)
    assert "&id" not in text and [r.match for r in parse_recipe(text, "s.yaml").layers][-3:] == ["0", "2", "4"]


def test_scores_near_a_common_mean_compare_by_how_they_vary():
    """Review: the raw columns' cosine of reranker scores 5 +- 0.1 against uncorrelated ones read 0.9995."""
    from qtool.report import output_cosines

    g = torch.Generator().manual_seed(0)
    ref = 5 + 0.1 * torch.randn(64, 1, generator=g)
    noise = 5 + 0.1 * torch.randn(64, 1, generator=g)
    assert torch.nn.functional.cosine_similarity(ref.reshape(-1), noise.reshape(-1), dim=0) > 0.999
    assert abs(float(output_cosines([ref], [noise], [None])[0])) < 0.3
    assert float(output_cosines([ref], [ref * 2 + 1], [None])[0]) == pytest.approx(1.0)
    assert math.isnan(float(output_cosines([ref[:1]], [ref[:1]], [None])[0]))  # one sample: nothing to compare


def test_a_none_dereference_in_qtools_own_code_stays_an_internal_error():
    """Review: model_rejected took every None.attr for data missing an input, a bug in qtool's hooks included."""
    from qtool.data import model_rejected

    def inside_qtool():
        exec(compile("None.shape", str(Path(qtool.__file__).parent / "model" / "insert.py"), "exec"))

    try:
        inside_qtool()
    except AttributeError as e:
        assert not model_rejected(e)
    try:
        exec(compile("None.shape", "/site-packages/transformers/models/clip/modeling_clip.py", "exec"))
    except AttributeError as e:
        assert model_rejected(e)


def test_a_suggestion_from_damage_that_is_nan_is_refused(tmp_path):
    """Second review: one sample of a one-number model gives every layer NaN damage; --suggest wrote 'the 1 most
    sensitive layers' in an arbitrary order, exit 0."""
    from tests.tinymodels import regressor

    spec = "tests.tinymodels:regressor"
    save_file(regressor().state_dict(), tmp_path / "m.safetensors")
    save_file({"x": torch.randn(1, 64, generator=torch.Generator().manual_seed(0))}, tmp_path / "d.safetensors")
    assert run_cli("calibrate", tmp_path / "m.safetensors", "-c", "w8a16", "-o", tmp_path / "run",
                   "--model-class", spec)[0] == 0
    code, _, err = run_cli("report", tmp_path / "m.safetensors", "-e", tmp_path / "run/encodings.json", "--data",
                           tmp_path / "d.safetensors", "--model-class", spec, "--sensitivity", "--suggest",
                           f"1 {tmp_path / 'k.yaml'}", "-q")
    assert code == 2 and "the layers' damage is NaN" in err and not (tmp_path / "k.yaml").exists(), err


def test_a_plot_without_matplotlib_is_one_line_before_measuring_and_written_files_are_named(world, tmp_path,
                                                                                            monkeypatch):
    """--plot without matplotlib measured the whole report, then failed as an internal error (exit 3); and
    --suggest's recipe was written without a word."""
    args = ["report", world / "m.safetensors", "-e", world / "run/encodings.json", "--data",
            world / "data.safetensors", "--model-class", MLP]
    code, _, err = run_cli(*args, "--plot", tmp_path / "r.svg", "--sensitivity", "--suggest",
                           f"1 {tmp_path / 's.yaml'}")
    assert code == 0, err
    assert f"wrote: {tmp_path / 'r.svg'}" in err and f"wrote: {tmp_path / 's.yaml'}" in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (as if not installed)
    code, _, err = run_cli(*args, "--plot", tmp_path / "p.png")
    assert code == 2 and error_lines(err) == ["error: --plot draws with matplotlib, which is not installed: pip "
                                              "install 'qtool[report]'"], err
    assert "measuring" not in err and not (tmp_path / "p.png").exists()


def test_a_sample_its_mask_drops_whole_is_no_sample_and_all_dropped_is_one_line(tmp_path):
    """A row whose attention_mask is all 0 holds no output to compare: it is left out of the cosines (it read 0,
    failing --min-cosine on nothing); data every mask drops whole is refused in one line, nothing printed."""
    from tests.test_gguf import _tiny_llama

    ckpt = _tiny_llama(tmp_path / "m", False)
    assert run_cli("calibrate", ckpt, "-c", "w8a16", "-o", tmp_path / "run")[0] == 0
    ids = torch.randint(1, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    save_file({"input_ids": ids[:3], "attention_mask": mask[:3]}, tmp_path / "three.safetensors")
    mask[3] = 0
    save_file({"input_ids": ids, "attention_mask": mask}, tmp_path / "four.safetensors")
    save_file({"input_ids": ids, "attention_mask": torch.zeros_like(ids)}, tmp_path / "none.safetensors")
    figures = []
    for data in ("three", "four"):
        code, out, err = run_cli("report", ckpt, "-e", tmp_path / "run" / "encodings.json", "--data",
                                 tmp_path / f"{data}.safetensors", "--batch-size", "4", "--json",
                                 "--min-cosine", "0.9")
        assert code == 0, err
        figures.append(json.loads(out)["end_to_end"])
    assert figures[0]["cosine_min"] > 0.9 and figures[0]["cosine_min"] == figures[1]["cosine_min"]
    assert figures[0]["cosine_mean"] == pytest.approx(figures[1]["cosine_mean"], abs=1e-7)
    code, out, err = run_cli("report", ckpt, "-e", tmp_path / "run" / "encodings.json", "--data",
                             tmp_path / "none.safetensors", "--json")
    assert code == 2 and json.loads(out)["error"] == (
        f"{tmp_path / 'none.safetensors'}: holds no token its attention_mask keeps (every mask is 0): nothing to "
        "measure a report on")
