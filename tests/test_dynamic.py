"""Dynamic activations (per token / per tensor): the math, recipes, encodings, and every export reproducing them.

A dynamic quantizer computes its range from each call's own values, so it needs no data and stores no range; the
fake-quant model, compressed-tensors (reloaded by transformers) and ONNX (run by onnxruntime) must all compute the
same thing.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import qtool
from qtool.config import parse_recipe, resolve_plan
from qtool.encodings import EncodingsFile
from qtool.errors import ConfigError, EncodingsError
from qtool.model.insert import iter_quantizers
from qtool.quant import DynamicQuantizeDequantize, dynamic_scale_offset, quantize_dequantize
from qtool.quant.affine import adjust_min_max, min_max_to_scale_offset
from tests.helpers import error_lines, run_cli, tiny_llama
from tests.tinymodels import mlp

DYNAMIC = ("version: 1\ndefaults:\n  weights: {bitwidth: 8, granularity: per_channel}\n"
           "  activations: {bitwidth: 8, symmetric: %s, granularity: %s, dynamic: true}\n")


# ---- the math ------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(2, 40), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1),
       st.sampled_from([4, 8, 16]))
def test_symmetric_per_token_is_absmax_over_half_the_grid(b, t, c, mag, seed, bits):
    x = torch.randn(b, t, c, generator=torch.Generator().manual_seed(seed)) * mag
    q = DynamicQuantizeDequantize(bits, symmetric=True, per_token=True)
    scale, offset = dynamic_scale_offset(x, True, q.qmin, q.qmax, True)
    absmax = x.abs().amax(-1, keepdim=True)
    assert scale.shape == (b, t, 1) and torch.equal(offset, torch.zeros_like(offset))
    # compressed-tensors' and torchao's rule (never below the minimum scale: float32's eps)
    assert torch.equal(scale, torch.clamp(absmax / ((q.qmax - q.qmin) / 2), min=torch.finfo(torch.float32).eps))
    y = q(x)
    # every token uses its own scale: the error of each value is at most half its token's step
    assert ((y - x).abs() <= scale / 2 + x.abs() * 2**-20).all()  # the clipped top value too: 127.5 -> 127
    # and a token's range does not depend on the other tokens
    assert torch.equal(q(x[:1, :1]), y[:1, :1])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(2, 40), st.floats(-10, 10), st.floats(1e-3, 1e2), st.integers(0, 2**31 - 1))
def test_asymmetric_dynamic_equals_the_static_min_max_rule_per_token(t, c, shift, mag, seed):
    x = torch.randn(t, c, generator=torch.Generator().manual_seed(seed)) * mag + shift
    q = DynamicQuantizeDequantize(8, symmetric=False, per_token=True)
    y = q(x)
    for i in range(t):  # a static min-max quantizer calibrated on that token alone gives the same values
        lo, hi = adjust_min_max(x[i].min(), x[i].max(), 255, False)
        s, o = min_max_to_scale_offset(lo, hi, 0, 255, False)
        assert torch.equal(y[i], quantize_dequantize(x[i], s, o, qmin=0, qmax=255))


def test_per_tensor_dynamic_uses_one_range_for_the_call():
    x = torch.tensor([[0.5, -1.0], [3.0, 0.25]])
    q = DynamicQuantizeDequantize(8, symmetric=True, per_token=False)
    scale, _ = dynamic_scale_offset(x, False, q.qmin, q.qmax, True)
    assert scale.shape == () and float(scale) == pytest.approx(3.0 / 127.5)
    assert torch.equal(q(torch.zeros(3, 2)), torch.zeros(3, 2))  # an all-zero input stays zero (minimum scale)


# ---- recipes and plans --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("granularity: per_token", "per_token needs dynamic: true"),
    ("granularity: per_token, dynamic: true, analyzer: percentile", "analyzer percentile does not apply"),
    ("symmetric: true, dynamic: true, scale_dtype: float16", "scale_dtype does not apply"),
    ("granularity: per_channel, dynamic: true", "per_channel"),
    ("dynamic: [true]", "dynamic"),
])
def test_recipe_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_recipe(f"version: 1\ndefaults:\n  activations: {{{text}}}\n", "r.yaml")


def test_dynamic_rows_need_no_data():
    plan = resolve_plan(parse_recipe(DYNAMIC % ("true", "per_token")), mlp())
    acts = plan.activations
    assert acts and all(q.dynamic and q.granularity == "per_token" and q.analyzer == "dynamic" for q in acts)
    assert not plan.needs_data() and plan.static_activations == []
    assert acts[0].describe_granularity() == "per_token, dynamic"


# ---- calibrate, encodings, load -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlp_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("dyn")
    save_file(mlp().state_dict(), d / "m.safetensors")
    return d / "m.safetensors"


def _calibrate(ckpt, tmp_path, symmetric="true", granularity="per_token", *extra):
    (tmp_path / "r.yaml").write_text(DYNAMIC % (symmetric, granularity))
    code, out, err = run_cli("calibrate", ckpt, "-c", tmp_path / "r.yaml", "--model-class", "tests.tinymodels:mlp",
                             "-o", tmp_path / "run", "--json", *extra)
    assert code == 0, err
    return tmp_path / "run" / "encodings.json", json.loads(out)


def test_calibrate_without_data_writes_dynamic_entries_without_ranges(mlp_ckpt, tmp_path):
    path, summary = _calibrate(mlp_ckpt, tmp_path)
    raw = json.loads(path.read_text())["quantizers"]
    acts = [q for q in raw if q["tensor"] == "input"]
    assert len(acts) == 3 and all(q["dynamic"] is True for q in acts)
    assert all(not ({"min", "max", "scale", "offset", "data"} & set(q)) for q in acts)
    assert all("dynamic" not in q for q in raw if q["tensor"] == "weight")  # static entries are as before
    enc = EncodingsFile.read(path)
    assert [e.dynamic for e in enc.entries].count(True) == 3
    assert enc.dumps() == path.read_text()  # read back, written again: the same bytes


def test_load_calibrated_runs_dynamic_quantizers(mlp_ckpt, tmp_path):
    from safetensors.torch import load_file

    path, _ = _calibrate(mlp_ckpt, tmp_path)
    model = qtool.load_calibrated(str(mlp_ckpt), str(path), model_class="tests.tinymodels:mlp")
    ref = mlp()
    ref.load_state_dict(load_file(str(mlp_ckpt)))
    qs = dict(iter_quantizers(model))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        h = x  # by hand: each Linear's input quantized per row, its weight by its calibrated quantizer
        for i in (0, 2, 4):
            layer = ref[i]
            h = DynamicQuantizeDequantize(8, True, True)(h)
            h = torch.nn.functional.linear(h, qs[f"{i}.weight"](layer.weight).as_subclass(torch.Tensor), layer.bias)
            if i < 4:
                h = torch.relu(h)
        assert torch.equal(model(x), h)
        assert not torch.equal(ref(x), h)


@pytest.mark.parametrize("field, value, message", [
    ("dynamic", "true", "dynamic must be true or false"),
    ("min", 0.0, "stores no range"),
    ("granularity", "per_channel", "per_tensor or per_token"),
])
def test_hostile_dynamic_entries_are_refused(mlp_ckpt, tmp_path, field, value, message):
    path, _ = _calibrate(mlp_ckpt, tmp_path)
    obj = json.loads(path.read_text())
    entry = next(q for q in obj["quantizers"] if q.get("dynamic"))
    entry[field] = value
    path.write_text(json.dumps(obj))
    with pytest.raises(EncodingsError, match=message):
        EncodingsFile.read(path)


def test_a_weight_cannot_be_dynamic(mlp_ckpt, tmp_path):
    path, _ = _calibrate(mlp_ckpt, tmp_path)
    obj = json.loads(path.read_text())
    w = next(q for q in obj["quantizers"] if q["tensor"] == "weight")
    for k in ("min", "max", "scale", "offset"):
        w.pop(k)
    w.update(dynamic=True, shape=[], granularity="per_token")
    path.write_text(json.dumps(obj))
    with pytest.raises(EncodingsError, match="weight cannot be dynamic"):
        EncodingsFile.read(path)


# ---- exports --------------------------------------------------------------------------------------------------
def test_aimet_export_refuses_dynamic_with_one_line(mlp_ckpt, tmp_path):
    path, _ = _calibrate(mlp_ckpt, tmp_path)
    code, _, err = run_cli("export", mlp_ckpt, "-e", path, "-o", tmp_path / "out", "--format", "aimet",
                           "--model-class", "tests.tinymodels:mlp")
    assert code == 2
    assert len(error_lines(err)) == 1 and "AIMET encodings are static" in err and "0.input" in err
    assert not (tmp_path / "out").exists()


def test_qtool_export_leaves_dynamic_out_of_model_encodings(mlp_ckpt, tmp_path):
    path, _ = _calibrate(mlp_ckpt, tmp_path)
    code, out, err = run_cli("export", mlp_ckpt, "-e", path, "-o", tmp_path / "out", "--model-class",
                             "tests.tinymodels:mlp", "--json")
    assert code == 0, err
    assert any("3 dynamic activation quantizer(s)" in w for w in json.loads(out)["export_warnings"])
    aimet = json.loads((tmp_path / "out" / "model.encodings").read_text())
    assert {e["name"] for e in aimet["activation_encodings"]} == set()
    assert len(aimet["param_encodings"]) == 3


@pytest.mark.parametrize("symmetric, granularity", [("true", "per_token"), ("false", "per_token"),
                                                    ("true", "per_tensor"), ("false", "per_tensor")])
def test_onnx_export_computes_the_same_dynamic_ranges(mlp_ckpt, tmp_path, symmetric, granularity):
    ort = pytest.importorskip("onnxruntime")
    path, _ = _calibrate(mlp_ckpt, tmp_path, symmetric, granularity)
    data = tmp_path / "x.safetensors"
    save_file({"x": torch.randn(8, 64, generator=torch.Generator().manual_seed(0))}, data)
    code, out, err = run_cli("export", mlp_ckpt, "-e", path, "-o", tmp_path / "out", "--format", "onnx",
                             "--model-class", "tests.tinymodels:mlp", "--data", data, "--json")
    assert code == 0, err
    assert json.loads(out)["onnx_opset"] == (21 if granularity == "per_token" else 13)
    model = qtool.load_calibrated(str(mlp_ckpt), str(path), model_class="tests.tinymodels:mlp")
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(4)) * 3  # another batch size than traced
    with torch.no_grad():
        ref = model(x).numpy()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input": x.numpy()})[0]
    assert np.abs(got - ref).max() <= 1e-6 * max(1.0, np.abs(ref).max())
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp_path / "out" / "model.onnx")).graph.node}
    assert "ReduceMax" in ops and "DequantizeLinear" in ops


# ---- compressed-tensors: transformers reloads the directory and reproduces qtool's logits -------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    return tiny_llama(tmp_path_factory.mktemp("dyn-llama") / "llama")


@pytest.mark.parametrize("symmetric", ["true", "false"])
def test_compressed_tensors_w8a8_dynamic_reloads_with_the_same_logits(llama, tmp_path, symmetric):
    import transformers

    recipe = (DYNAMIC % (symmetric, "per_token")
              + "layers:\n  - type: Embedding\n    weights: null\n    activations: null\nignore: [lm_head]\n")
    (tmp_path / "r.yaml").write_text(recipe)
    code, _, err = run_cli("calibrate", llama, "-c", tmp_path / "r.yaml", "-o", tmp_path / "run")
    assert code == 0, err
    code, out, err = run_cli("export", llama, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / "ct",
                             "--format", "compressed-tensors", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["activation_quantizers_skipped"] == 0
    group = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["config_groups"]
    inputs = group["group_0"]["input_activations"]
    assert inputs["dynamic"] is True and inputs["strategy"] == "token" and inputs["symmetric"] == (symmetric == "true")
    fq = qtool.load_calibrated(str(llama), str(tmp_path / "run" / "encodings.json"))
    ct = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct")).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(llama)).eval()
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got, float_logits = fq(ids).logits, ct(ids).logits, plain(ids).logits
    assert torch.equal(got, want)  # measured: exactly equal
    assert (want - float_logits).abs().max() > 1e-3  # the activations really were quantized


def test_every_calibration_mode_writes_the_same_dynamic_encodings(llama, tmp_path):
    """Streamed (no data), in memory (with data) and --sequential give the same encodings.json quantizers."""
    data = tmp_path / "ids.safetensors"
    save_file({"input_ids": torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))}, data)
    recipe = Path(__file__).resolve().parents[1] / "configs" / "w8a8-dynamic.yaml"
    got = {}
    for mode, extra in (("streaming", ()), ("in_memory", ("--data", data)),
                        ("sequential", ("--data", data, "--sequential"))):
        code, _, err = run_cli("calibrate", llama, "-c", recipe, "-o", tmp_path / mode, *extra)
        assert code == 0, err
        got[mode] = json.loads((tmp_path / mode / "encodings.json").read_text())["quantizers"]
    assert got["streaming"] == got["in_memory"] == got["sequential"]
    assert sum(q.get("dynamic", False) for q in got["streaming"]) == 14  # every Linear input but lm_head's


def test_report_runs_the_dynamic_model(mlp_ckpt, tmp_path):
    path, _ = _calibrate(mlp_ckpt, tmp_path)
    data = tmp_path / "x.safetensors"
    save_file({"x": torch.randn(16, 64, generator=torch.Generator().manual_seed(0))}, data)
    code, out, err = run_cli("report", mlp_ckpt, "-e", path, "--data", data, "--model-class",
                             "tests.tinymodels:mlp", "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert 0.999 < rep["end_to_end"]["cosine_mean"] < 1.0
    # 8-bit weights and per-row 8-bit inputs: each layer between 30 and 60 dB, every layer measured
    assert len(rep["layers"]) == 3 and all(30 < r["sqnr_isolated_db"] < 60 for r in rep["layers"])
