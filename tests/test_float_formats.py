"""Float element grids (FP8 E4M3, NVFP4, MXFP4, MXFP8): exact against compressed-tensors, end to end through
calibration, the compressed-tensors export and a transformers reload, and refused where a format cannot hold them.

compressed-tensors is the oracle: its ``calculate_qparams`` / ``generate_gparam`` give the scales and its
``fake_quantize`` the values; qtool's must equal them bit for bit.
"""

import json
import math
import warnings
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qtool
from qtool.config import load_recipe, parse_recipe
from qtool.errors import ConfigError
from qtool.model.insert import _fake_quant_weight, iter_quantizers
from qtool.pipeline import CalibrateOptions, run_calibrate
from qtool.quant.floatgrid import (ELEMENTS, e2m1_codes, e2m1_values, encoding_scales, float_dequantize,
                                   float_quantize, float_quantize_dequantize, float_scales, global_scale,
                                   round_to_e2m1)
from tests.helpers import run_cli, tiny_llama

ct = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402

FP4, FP8 = ELEMENTS["fp4_e2m1"], ELEMENTS["fp8_e4m3"]

# (element, scale_dtype, block) -> compressed-tensors args of the same format
CT_ARGS = {
    "nvfp4": (FP4, "fp8_e4m3", 16, dict(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                                        symmetric=True, scale_dtype=torch.float8_e4m3fn,
                                        zp_dtype=torch.float8_e4m3fn)),
    "mxfp4": (FP4, "e8m0", 32, dict(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                                     scale_dtype=torch.uint8, zp_dtype=torch.uint8)),
    "mxfp8": (FP8, "e8m0", 32, dict(num_bits=8, type="float", strategy="group", group_size=32, symmetric=True,
                                     scale_dtype=torch.uint8, zp_dtype=torch.uint8)),
    "fp8_group": (FP8, "float32", 32, dict(num_bits=8, type="float", strategy="group", group_size=32,
                                           symmetric=True)),
}


def _fake_quant_and_reload(ckpt, run, out, dtype=torch.float32):
    """qtool's fake-quant model from ``run``'s encodings, and the compressed-tensors export ``out`` as transformers
    loads it (its warnings about compressed weights silenced)."""
    fq = qtool.load_calibrated(str(ckpt), str(run / "encodings.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).eval()
    return fq, model


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values (the sign of a zero too: FP8 kept -0.0 where compressed-tensors gives +0.0, byte 0x80 for
    0x00 in the file), NaN where the other has NaN (an absurd 3e38 weight overflows both tools' MX scale; qtool
    refuses such a range when it writes encodings)."""
    nan = torch.isnan(a)
    bits = [t[~nan].to(torch.float32).view(torch.int32) for t in (a, b)]
    return torch.equal(nan, torch.isnan(b)) and torch.equal(*bits)


def _ct_reference(name: str, x: torch.Tensor):
    """compressed-tensors' (scale, fake-quantized x) for a [rows, cols] tensor in format ``name``."""
    _, _, block, kw = CT_ARGS[name]
    args = QuantizationArgs(dynamic=False, **kw)
    groups = x.unflatten(-1, (x.shape[-1] // block, block))
    mn, mx = groups.amin(-1), groups.amax(-1)
    g = generate_gparam(x.min(), x.max()) if name == "nvfp4" else None
    scale, zp = calculate_qparams(mn, mx, args, global_scale=g)
    return scale, g, fake_quantize(x, scale, zp, args, global_scale=g)


def _ours(name: str, x: torch.Tensor):
    element, scale_dtype, block, _ = CT_ARGS[name]
    amax = x.abs().unflatten(-1, (x.shape[-1] // block, block)).amax(-1)
    stored, eff, g = encoding_scales(amax, element, scale_dtype)
    return stored, eff, g, float_quantize_dequantize(x, eff, element, (1, block))


# magnitudes that stress every rounding rule: zeros, ties, powers of two and their neighbours, huge and tiny values
_EDGE = [0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 448.0, 464.0, 1e-30, 1e-8, 2.0 ** -126, 1.75 * 2 ** 10,
         (1.75 - 2 ** -23) * 2 ** 3, 3e38]


@st.composite
def _tensors(draw):
    rows = draw(st.integers(1, 4))
    cols = 32 * draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** draw(st.floats(-6, 6))
    x = torch.randn(rows, cols, generator=g) * scale
    for _ in range(draw(st.integers(0, 6))):
        i, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
        x[i, j] = min(draw(st.sampled_from(_EDGE)) * draw(st.sampled_from([1.0, -1.0, scale])), 3e38)
    if draw(st.booleans()):
        x[0, :32] = 0.0  # an all-zero block
    if draw(st.booleans()):
        x[-1, -1] = -0.0
    return x


@pytest.mark.parametrize("name", sorted(CT_ARGS))
@settings(max_examples=60, deadline=None)
@given(x=_tensors())
def test_scales_and_values_equal_compressed_tensors(name, x):
    ct_scale, ct_g, ct_x = _ct_reference(name, x)
    stored, eff, g, ours = _ours(name, x)
    element, scale_dtype, _, _ = CT_ARGS[name]
    if scale_dtype == "fp8_e4m3":
        assert torch.equal(g, ct_g)
        assert torch.equal(stored, ct_scale)  # the FP8 block scale, before the global scale divides it
    else:
        assert torch.equal(eff, ct_scale)
    assert _same(ours, ct_x)


@pytest.mark.parametrize("per", ["tensor", "channel"])
@settings(max_examples=40, deadline=None)
@given(x=_tensors())
def test_fp8_tensor_and_channel_equal_compressed_tensors(per, x):
    args = QuantizationArgs(num_bits=8, type="float", strategy=per, symmetric=True, dynamic=False)
    dims = dict(dim=-1, keepdim=True) if per == "channel" else {}
    mn, mx = (x.amin(**dims), x.amax(**dims)) if dims else (x.min(), x.max())
    scale, zp = calculate_qparams(mn, mx, args)
    _, eff, _ = encoding_scales(x.abs().amax(**dims) if dims else x.abs().amax(), FP8, "float32")
    assert torch.equal(eff.reshape(scale.shape), scale)
    assert _same(float_quantize_dequantize(x, eff, FP8), fake_quantize(x, scale, zp, args))


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp8"])
@settings(max_examples=30, deadline=None)
@given(x=_tensors())
def test_dynamic_block_activations_equal_compressed_tensors(name, x):
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    from qtool.quant.floatgrid import dynamic_float_scales, global_scale

    element, scale_dtype, block, kw = CT_ARGS[name]
    args = QuantizationArgs(dynamic="local" if name == "nvfp4" else True, **kw)
    x = x.reshape(1, *x.shape)  # (batch, tokens, hidden)
    g_ct = generate_gparam(x.min(), x.max()) if name == "nvfp4" else None
    scale, zp = compute_dynamic_scales_and_zp(x, args, None, global_scale=g_ct)
    g = global_scale(x.abs().amax(), element) if name == "nvfp4" else None
    eff, blocks = dynamic_float_scales(x, element, scale_dtype, "per_block", block, g)
    assert _same(float_quantize_dequantize(x, eff, element, blocks), fake_quantize(x, scale, zp, args, global_scale=g_ct))


def test_e2m1_ties_go_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.24, 0.76, 5.01, 9.0])
    assert round_to_e2m1(x).tolist() == [0, 1, 1, 2, 2, 4, 4, 0, 1, 6, 6]
    assert round_to_e2m1(-x).tolist() == [-v for v in [0, 1, 1, 2, 2, 4, 4, 0, 1, 6, 6]]


def test_e2m1_codes_round_trip_and_pack_like_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    from qtool.quant.packing import pack_bytes

    codes = torch.arange(16)
    values = e2m1_values(codes)
    assert torch.equal(e2m1_codes(values), codes)  # -0 is code 8
    grid = values.reshape(2, 8).repeat(3, 1)
    assert torch.equal(pack_bytes(e2m1_codes(grid), 4, signed=False).reshape(6, 4), pack_fp4_to_uint8(grid))


@pytest.mark.parametrize("element", [FP4, FP8])
def test_codes_dequantize_to_the_fake_quant_values(element):
    x = torch.randn(8, 64) * 3
    _, eff, _ = encoding_scales(x.abs().unflatten(-1, (2, 32)).amax(-1), element, "e8m0")
    codes = float_quantize(x, eff, element, (1, 32))
    assert int(codes.min()) >= 0 and int(codes.max()) < element.num_codes
    assert torch.equal(float_dequantize(codes, eff, element, (1, 32)),
                       float_quantize_dequantize(x, eff, element, (1, 32)))


# ---- recipes ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fp8", "fp8-dynamic", "nvfp4a16", "mxfp4a16", "mxfp8a16"])
def test_shipped_float_recipes(name):
    r = load_recipe(name)
    assert r.defaults.weights.element in ("fp8_e4m3", "fp4_e2m1")
    assert r.defaults.weights.bitwidth == (4 if "fp4" in name else 8) and r.defaults.weights.symmetric


@pytest.mark.parametrize("weights, message", [
    ("{element: fp8_e4m3, symmetric: false}", "element fp8_e4m3 is symmetric"),
    ("{element: fp4_e2m1, bitwidth: 8}", "element fp4_e2m1 has 4 bits (got bitwidth 8)"),
    ("{element: fp4_e2m1, scale_dtype: float16}", "scale_dtype is one of float32, e8m0, fp8_e4m3"),
    ("{element: fp4_e2m1, granularity: per_channel, scale_dtype: e8m0}", "needs granularity per_block"),
    ("{element: fp8_e4m3, analyzer: sqnr}", "analyzer sqnr is not available on float grids"),
    ("{element: fp8_e4m3, rounding: adaround}", "rounding adaround learns up/down choices on integer grids"),
    ("{bitwidth: 4, scale_dtype: e8m0, granularity: per_block, block_size: 32}", "scale_dtype e8m0 is for float"),
    ("{element: fp6_e3m2}", "element"),
    ("{element: fp8_e4m3, granularity: per_block, block_size: [128, 128, 1]}", "or [rows, columns] for a weight"),
    ("{element: fp8_e4m3, granularity: per_block, block_size: [128, 0]}", "Input should be greater than 0"),
])
def test_bad_float_recipes_are_one_line(weights, message):
    with pytest.raises(ConfigError) as e:
        parse_recipe(f"version: 1\ndefaults:\n  weights: {weights}\n  activations: null\n", "r.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_rule_switching_element_takes_its_bit_width():
    r = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\nlayers:\n"
                     "  - match: 'a*'\n    weights: {element: fp4_e2m1, granularity: per_block, block_size: 16}\n")
    from qtool.config.schema import WeightSpec, _merge

    merged = _merge(r.defaults.weights, r.layers[0].weights, WeightSpec, "r")
    assert (merged.element, merged.bitwidth, merged.symmetric) == ("fp4_e2m1", 4, True)


# ---- end to end: calibrate, export compressed-tensors, reload in transformers ------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("fl") / "llama")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def data(tmp_path_factory, ids):
    p = tmp_path_factory.mktemp("fl_data") / "ids.pt"
    torch.save(torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(2)), p)
    return p


# recipe -> (format in config.json, dtype transformers reloads it in, tensors of q_proj in the file)
RELOAD = {
    "fp8-dynamic": ("float-quantized", torch.float32, {"weight": torch.float8_e4m3fn, "weight_scale": torch.float32}),
    "fp8-dynamic-gptq": ("float-quantized", torch.float32, {"weight": torch.float8_e4m3fn,
                                                            "weight_scale": torch.float32}),
    "fp8": ("float-quantized", torch.float32, {"weight": torch.float8_e4m3fn, "weight_scale": torch.float32,
                                               "input_scale": torch.float32}),
    "nvfp4a16": ("nvfp4-pack-quantized", torch.bfloat16, {"weight_packed": torch.uint8,
                                                           "weight_scale": torch.float8_e4m3fn,
                                                           "weight_global_scale": torch.float32}),
    "mxfp4a16-gptq": ("mxfp4-pack-quantized", torch.bfloat16, {"weight_packed": torch.uint8,
                                                                "weight_scale": torch.uint8}),
    "mxfp4a16": ("mxfp4-pack-quantized", torch.bfloat16, {"weight_packed": torch.uint8,
                                                           "weight_scale": torch.uint8}),
    "mxfp8a16": ("mxfp8-quantized", torch.bfloat16, {"weight": torch.float8_e4m3fn, "weight_scale": torch.uint8}),
    "nvfp4": ("nvfp4-pack-quantized", torch.bfloat16, {"weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn,
                                                       "weight_global_scale": torch.float32,
                                                       "input_global_scale": torch.float32}),
    "mxfp4": ("mxfp4-pack-quantized", torch.bfloat16, {"weight_packed": torch.uint8, "weight_scale": torch.uint8}),
    "mxfp8": ("mxfp8-quantized", torch.bfloat16, {"weight": torch.float8_e4m3fn, "weight_scale": torch.uint8}),
}


@pytest.mark.parametrize("recipe", sorted(RELOAD))
def test_compressed_tensors_export_reloads_with_qtools_numbers(recipe, ckpt, data, ids, tmp_path):
    fmt, dtype, tensors = RELOAD[recipe]
    run = tmp_path / "run"
    run_calibrate(str(ckpt), recipe, str(run), CalibrateOptions(data=str(data)))
    out = tmp_path / "ct"
    code, _, err = run_cli("export", ckpt, "-e", run / "encodings.json", "-o", out, "--format",
                           "compressed-tensors", "--quiet")
    assert code == 0, err
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == fmt and qcfg["ignore"] == ["lm_head"]
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        got = {k.rsplit(".", 1)[1]: fh.get_slice(k).get_dtype() for k in fh.keys()
               if k.startswith("model.layers.0.self_attn.q_proj.")}
    assert got == {k: str(v).replace("torch.", "").replace("float8_e4m3fn", "F8_E4M3").replace("float32", "F32")
                   .replace("uint8", "U8") for k, v in tensors.items()}

    code, listing, err = run_cli("inspect", out, "--json")
    assert code == 0, err
    row = next(r for r in json.loads(listing)["tensors"] if r["name"] == "model.layers.0.self_attn.q_proj.weight")
    assert row["dtype"] == ("fp4_e2m1" if "fp4" in recipe else "fp8_e4m3") and row["shape"] == [64, 64], row
    if fmt == "nvfp4-pack-quantized":  # fused layers (q/k/v, gate/up) share one global scale, as vLLM needs
        with safe_open(str(out / "model.safetensors"), "pt") as fh:
            for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
                part = "self_attn" if "q_proj" in names else "mlp"
                gs = [fh.get_tensor(f"model.layers.1.{part}.{n}.weight_global_scale") for n in names]
                assert all(torch.equal(g, gs[0]) for g in gs), names
            assert not torch.equal(fh.get_tensor("model.layers.1.self_attn.o_proj.weight_global_scale"), gs[0])
    fq, model = _fake_quant_and_reload(ckpt, run, out, dtype)
    with torch.no_grad():
        got_logits, want_logits = model(ids).logits.float(), fq(ids).logits
    fq_mods, ct_mods = dict(fq.named_modules()), dict(model.named_modules())
    n = 0
    for name, quantizer in iter_quantizers(fq):
        module, tensor = name.rsplit(".", 1)
        if tensor != "weight" or module == "lm_head":
            continue
        with torch.no_grad():  # the fake-quant weight: GPTQ's stored codes where it chose them
            expect = _fake_quant_weight(fq_mods[module], quantizer)
        # the runtime's dequantized weight is qtool's fake-quant weight (rounded to the reload dtype)
        assert torch.equal(ct_mods[module].weight, expect.to(dtype)), module
        n += 1
    assert n == 14
    assert torch.isfinite(got_logits).all()
    if dtype == torch.float32:  # the same weights and activation numerics: the same logits
        assert torch.allclose(got_logits, want_logits, rtol=0, atol=1e-5), (got_logits - want_logits).abs().max()


@pytest.mark.parametrize("fmt, recipe, message", [
    ("aimet", "fp8", "cannot hold float element grids"),
    ("gguf", "nvfp4a16", "cannot hold float element grids"),
    ("onnx", "nvfp4a16", "fp4_e2m1 with fp8_e4m3 scales has no ONNX QuantizeLinear form"),
    ("onnx", "mxfp8a16", "fp8_e4m3 with e8m0 scales has no ONNX QuantizeLinear form"),
])
def test_formats_that_cannot_hold_a_float_grid_refuse_in_one_line(fmt, recipe, message, ckpt, tmp_path):
    if fmt == "gguf":  # GGUF reads the tokenizer before anything else: give it one it can write (byte-level BPE)
        from tests.test_gguf import _tiny_llama

        ckpt = _tiny_llama(tmp_path / "bpe", False)
    out = tmp_path / "out"
    code, _, err = run_cli("quantize", ckpt, "-c", recipe, "-o", out, "--format", fmt, "--quiet")
    assert code == 2 and err.count("\n") <= 1 and message in err, err
    assert not out.exists()


def test_an_onnx_per_head_kv_cache_quantizes_each_head_on_its_own_axis(ckpt, data, tmp_path):
    """A KV cache's per-head scales ([heads, 1, 1]) on [batch, heads, tokens, head_dim]: the QDQ pairs took axis 0,
    the batch: onnxruntime refused every batch size but the head count, and quantized that one by the wrong
    scales (identical rows gave different logits)."""
    import onnx
    import onnxruntime as ort
    from safetensors.torch import save_file

    recipe = tmp_path / "kv.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: null\n  activations: null\n"
                      "kv_cache: {granularity: per_head}\n")
    run, out = tmp_path / "run", tmp_path / "onnx"
    run_calibrate(str(ckpt), str(recipe), str(run), CalibrateOptions(data=str(data)))
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(3))
    ids[2] = ids[0]
    example = tmp_path / "ids.safetensors"
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, example)
    code, _, err = run_cli("export", ckpt, "-e", run / "encodings.json", "-o", out, "--format", "onnx", "--data",
                           example, "--quiet")
    assert code == 0, err
    axes = {n.name: a.i for n in onnx.load(str(out / "model.onnx")).graph.node if "_cache_" in n.name
            for a in n.attribute if a.name == "axis"}
    assert axes and set(axes.values()) == {1}, axes
    fq = qtool.load_calibrated(str(ckpt), str(run / "encodings.json"))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(out / "model.onnx"), so, providers=["CPUExecutionProvider"])
    feed = {i.name: {"input_ids": ids, "attention_mask": torch.ones_like(ids)}[i.name].numpy()
            for i in sess.get_inputs()}
    got = torch.from_numpy(sess.run(None, feed)[0])
    with torch.no_grad():
        want = fq(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()
    assert torch.equal(got[0], got[2])


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "fp8"])
def test_onnx_fp8_runs_in_onnxruntime_with_qtools_logits(recipe, ckpt, data, tmp_path):
    """FP8 weights as float8e4m3fn initializers + DequantizeLinear, FP8 activations as float8 QuantizeLinear /
    DequantizeLinear (static scale, or one computed per token in the graph); onnxruntime gives the fake-quant
    model's logits."""
    import onnx
    import onnxruntime as ort
    from safetensors.torch import save_file

    run, out = tmp_path / "run", tmp_path / "onnx"
    run_calibrate(str(ckpt), recipe, str(run), CalibrateOptions(data=str(data)))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    example = tmp_path / "ids.safetensors"
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, example)
    code, _, err = run_cli("export", ckpt, "-e", run / "encodings.json", "-o", out, "--format", "onnx", "--data",
                           example, "--quiet")
    assert code == 0, err
    proto = onnx.load(str(out / "model.onnx"))
    types = {i.name: i.data_type for i in proto.graph.initializer}
    assert types["model.layers.0.self_attn.q_proj.weight"] == onnx.TensorProto.FLOAT8E4M3FN
    code, listed, err = run_cli("inspect", out, "--json")  # (no model.encodings beside it: "nothing here")
    assert code == 0 and json.loads(listed)["kind"].startswith("ONNX"), err
    fq = qtool.load_calibrated(str(ckpt), str(run / "encodings.json"))
    with torch.no_grad():
        want = fq(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    # (onnxruntime 1.31's extended optimizations fuse float8 Q/DQ into MatMulIntegerToFloat, which takes integer
    # types only, and refuse the graph: basic optimizations are the highest level that runs FP8 QDQ on CPU)
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        sess = ort.InferenceSession(str(out / "model.onnx"), so, providers=["CPUExecutionProvider"])
        feed = {i.name: {"input_ids": ids, "attention_mask": torch.ones_like(ids)}[i.name].numpy()
                for i in sess.get_inputs()}
        got = torch.from_numpy(sess.run(None, feed)[0])
        assert torch.allclose(got, want, rtol=0, atol=1e-4), (level, (got - want).abs().max())


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "fp8", "nvfp4a16-gptq", "mxfp4a16", "mxfp8a16", "nvfp4"])
@pytest.mark.parametrize("pack", [True, False])
def test_qtool_export_holds_native_float_tensors(recipe, pack, ckpt, data, tmp_path):
    """qtool's own safetensors: float8 weights or packed FP4 codes with the scales as the format stores them;
    dequantized, every weight equals the fake-quant weight bit for bit; no AIMET JSON is written beside it."""
    from qtool.export.qtool_st import read_integer_export

    run, out = tmp_path / "run", tmp_path / "q"
    run_calibrate(str(ckpt), recipe, str(run), CalibrateOptions(data=str(data)))
    code, text, err = run_cli("export", ckpt, "-e", run / "encodings.json", "-o", out, "--json",
                              *([] if pack else ["--no-pack"]))
    assert code == 0, err
    assert not (out / "model.encodings").exists()
    said = next(w for w in json.loads(text)["export_warnings"] if "AIMET JSON) not written" in w)
    static = {"fp8": 14}.get(recipe, 0)  # (static FP8 inputs: their scales in encodings.json; dynamic ones have none)
    assert (f"the {static} activation and KV-cache scales are in" in said) == bool(static), said
    got = read_integer_export(out)
    fq = qtool.load_calibrated(str(ckpt), str(run / "encodings.json"))
    mods = dict(fq.named_modules())
    n = 0
    for name, quantizer in iter_quantizers(fq):
        module, tensor = name.rsplit(".", 1)
        if tensor == "weight":
            assert torch.equal(got[f"{module}.weight"], _fake_quant_weight(mods[module], quantizer)), module
            n += 1
    assert n == 14
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        w = fh.get_slice("model.layers.0.self_attn.q_proj.weight")
        want = {"fp8": "F8_E4M3", "fp4": "U8"}["fp4" if "fp4" in recipe else "fp8"]
        assert w.get_dtype() == want
        if "fp4" in recipe:
            assert list(w.get_shape()) == ([64 * 64 // 2] if pack else [64, 64])


@pytest.mark.parametrize("block, scale_dtype, message", [
    (48, "e8m0", "48 does not divide the input dimension 64"),  # the recipe cannot apply to this model
    # the format cannot hold it: refused before calibrating (these were refused after a whole GPTQ run)
    (16, "e8m0", "mxfp4-pack-quantized stores blocks of 32 (got 16)"),
    (32, "fp8_e4m3", "nvfp4-pack-quantized stores blocks of 16 (got 32)"),
    (32, "float32", "fp4_e2m1 elements with float32 scales have no compressed-tensors format"),
    ("[16, 16]", "fp8_e4m3", "block_size [16, 16] is not supported by the compressed-tensors export"),
])
def test_a_block_the_model_or_format_cannot_take_is_one_line_before_calibrating(block, scale_dtype, message, ckpt,
                                                                                tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\ndefaults:\n  weights: {{element: fp4_e2m1, granularity: per_block, block_size: "
                      f"{block}, scale_dtype: {scale_dtype}}}\n  activations: null\nignore: [lm_head]\n")
    code, _, err = run_cli("quantize", ckpt, "-c", recipe, "-o", tmp_path / "out", "--format", "compressed-tensors")
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "calibrating" not in err and not (tmp_path / "out").exists()


def test_float_encodings_round_trip_through_json(ckpt, data, tmp_path):
    from qtool.encodings import EncodingsFile

    run_calibrate(str(ckpt), "nvfp4a16", str(tmp_path / "run"), CalibrateOptions())
    enc = EncodingsFile.read(tmp_path / "run" / "encodings.json")
    e = enc.entries[0]
    assert (e.element, e.scale_dtype, e.bitwidth) == ("fp4_e2m1", "fp8_e4m3", 4)
    assert torch.equal(-e.min, e.max) and math.isfinite(float(e.max.max()))
    obj = json.loads((tmp_path / "run" / "encodings.json").read_text())
    obj["quantizers"][0]["min"][0][0] = -123.0  # no longer -max
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(obj))
    code, _, err = run_cli("export", ckpt, "-e", bad, "-o", tmp_path / "o", "--format", "compressed-tensors", "--quiet")
    assert code == 2 and "a float element's range is symmetric: min must be -max" in err, err
    # a global_amax below the blocks' own (hand-edited) saturated every block scale and clipped the weight ~80x
    obj = json.loads((tmp_path / "run" / "encodings.json").read_text())
    obj["quantizers"][0]["global_amax"] = 1e-3
    bad.write_text(json.dumps(obj))
    code, _, err = run_cli("export", ckpt, "-e", bad, "-o", tmp_path / "o", "--format", "compressed-tensors", "--quiet")
    assert code == 2 and "quantizers[0]: global_amax 0.001 is below the largest amax of its blocks" in err, err
    assert not (tmp_path / "o").exists()
    # a decimal global_amax that is the largest block amax once read as float32 (the file's numbers) is that amax
    top = float(torch.tensor(obj["quantizers"][0]["max"]).max())
    obj["quantizers"][0]["global_amax"] = top - math.ulp(top) * 2 ** 27  # (a quarter of a float32 ulp below)
    assert float(torch.tensor(obj["quantizers"][0]["global_amax"], dtype=torch.float32)) == top
    bad.write_text(json.dumps(obj))
    code, _, err = run_cli("export", ckpt, "-e", bad, "-o", tmp_path / "o", "--format", "compressed-tensors", "--quiet")
    assert code == 0, err


# ---- GPTQ on float grids -------------------------------------------------------------------------------------------
def _float_gptq_layer(element, scale_dtype, block, seed):
    """A 24 x 64 weight, its blocks' effective scales on ``element``, and correlated inputs (512 x 64)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(24, 64, generator=g)
    amax = W.abs().unflatten(-1, (64 // block, block)).amax(-1)
    _, eff, _ = encoding_scales(amax, element, scale_dtype)
    X = torch.randn(512, 8, generator=g) @ torch.randn(8, 64, generator=g) + 0.1 * torch.randn(512, 64, generator=g)
    return W, eff, X


def _row_output_errors(X, W, codes, eff, element, block):
    """Each output row's squared error on the inputs ``X`` with ``codes`` for ``W``."""
    return ((X @ (W - float_dequantize(codes, eff, element, (1, block))).T) ** 2).sum(0)


@pytest.mark.parametrize("element, scale_dtype, block", [(FP4, "e8m0", 32), (FP4, "fp8_e4m3", 16),
                                                         (FP8, "float32", 32)])
def test_gptq_on_float_grids(element, scale_dtype, block):
    from qtool.calibration.rounding.gptq import gptq_codes

    W, eff, X = _float_gptq_layer(element, scale_dtype, block, seed=0)
    rtn = float_quantize(W, eff, element, (1, block))
    # with H a multiple of the identity no column feeds another: exactly round-to-nearest, codes included
    same = gptq_codes(W, torch.eye(64) * 3.0, eff, torch.zeros_like(eff), 0, element.num_codes - 1, (1, block),
                      element=element)
    assert torch.equal(same, rtn)
    # correlated inputs: GPTQ's output error is below round-to-nearest's on every row (never above)
    codes = gptq_codes(W, X.T @ X, eff, torch.zeros_like(eff), 0, element.num_codes - 1, (1, block), element=element)
    assert int(codes.min()) >= 0 and int(codes.max()) < element.num_codes
    errors, errors_rtn = (_row_output_errors(X, W, c, eff, element, block) for c in (codes, rtn))
    assert (errors <= errors_rtn * (1 + 1e-6)).all()
    assert errors.sum() < 0.8 * errors_rtn.sum()


@pytest.mark.parametrize("element, scale_dtype, block", [(FP4, "e8m0", 32), (FP4, "fp8_e4m3", 16),
                                                         (FP8, "float32", 32)])
def test_bounded_gptq_on_float_grids_rounds_each_value_down_or_up_only(element, scale_dtype, block):
    from qtool.calibration.rounding.gptq import gptq_codes

    W, eff, X = _float_gptq_layer(element, scale_dtype, block, seed=1)
    codes = gptq_codes(W, X.T @ X, eff, torch.zeros_like(eff), 0, element.num_codes - 1, (1, block),
                       element=element, bounded=True)
    # the element's representable values, and each weight's neighbours among them (in units of its block's scale)
    levels = torch.unique(element.values(torch.arange(element.num_codes)))
    levels = levels[torch.isfinite(levels) & (levels.abs() <= element.max)]
    x = (W / eff.repeat_interleave(block, dim=1)).clamp(-element.max, element.max)
    chosen = element.values(codes)
    below = torch.where(levels <= x[..., None], levels, -torch.inf).amax(-1)
    above = torch.where(levels >= x[..., None], levels, torch.inf).amin(-1)
    assert bool(((chosen == below) | (chosen == above)).all())
    # it still chose (values, not codes: +0 and -0 are two codes): its output error is well below nearest's
    rtn = float_quantize(W, eff, element, (1, block))
    errors, errors_rtn = (float(_row_output_errors(X, W, c, eff, element, block).sum()) for c in (codes, rtn))
    assert errors < 0.9 * errors_rtn


@pytest.mark.parametrize("element, scale_dtype, block", [(FP4, "e8m0", 32), (FP4, "fp8_e4m3", 16),
                                                         (FP8, "float32", 32)])
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), weighted=st.booleans())
def test_scale_search_is_never_worse_than_minmax(element, scale_dtype, block, seed, weighted):
    from qtool.quant.floatgrid import search_amax

    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(12, block, generator=g) * torch.rand(12, 1, generator=g) * 4
    rows[0, 0] = 9.0  # an outlier
    w = torch.rand(12, block, generator=g) if weighted else None
    amax = rows.abs().amax(1)
    chosen = search_amax(rows, amax, element, scale_dtype, [1.0, 0.95, 0.9, 0.8, 0.7, 0.6], w)
    assert (chosen <= amax).all()

    def err(a):
        _, eff, _ = encoding_scales(a, element, scale_dtype)
        d = (float_quantize_dequantize(rows, eff[:, None], element) - rows) ** 2
        return (d if w is None else d * w).sum(1)

    if scale_dtype == "fp8_e4m3":  # the stored maxima derive the global scale the search used
        assert torch.equal(chosen.max(), amax.max())
    assert (err(chosen) <= err(amax)).all()


def _search_every_candidate(rows, amax, element, scale_dtype, ratios, weights):
    """search_amax's definition, candidate by candidate over every row: the first ratio (widest) of least error."""
    gscale = global_scale(amax, element) if scale_dtype == "fp8_e4m3" else None
    pinned = amax == amax.max() if gscale is not None else torch.zeros_like(amax, dtype=torch.bool)
    best, best_err = amax.clone(), None
    for r in ratios:
        a = torch.where(pinned, amax, amax * r)
        eff = float_scales(a, element, scale_dtype, gscale)[1][:, None]
        d = (element.round(torch.clamp(rows / eff, -element.max, element.max)) * eff - rows) ** 2
        err = (d if weights is None else d * weights).sum(1)
        if best_err is not None:
            best = torch.where(err < best_err, a, best)
        best_err = err if best_err is None else torch.minimum(err, best_err)
    return best


@pytest.mark.parametrize("element, scale_dtype, width", [(FP4, "e8m0", 32), (FP4, "fp8_e4m3", 16),
                                                         (FP8, "float32", 32), (FP4, "e8m0", 200)])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), weighted=st.booleans(), n=st.integers(1, 1500),
       candidates=st.sampled_from([1, 2, 7, 81]))
def test_the_scale_search_picks_what_trying_every_candidate_on_every_row_picks(element, scale_dtype, width, seed,
                                                                               weighted, n, candidates):
    """search_amax evaluates only the candidates whose representable scale moved, in chunks of rows
    (``_SEARCH_TABLE``, ``_SEARCH_VALUES`` made small here so that several chunks run): the same bits."""
    from qtool.quant import floatgrid

    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, width, generator=g) * torch.rand(n, 1, generator=g).pow(3) * 10
    rows[torch.rand(n, width, generator=g) < 0.2] = 0
    rows[torch.rand(n, generator=g) < 0.05] = 0  # whole zero rows
    w = torch.rand(n, width, generator=g) if weighted else None
    amax = rows.abs().amax(1)
    ratios = (1 - 0.8 * torch.arange(candidates, dtype=torch.float32) / max(candidates - 1, 1)).tolist()
    expected = _search_every_candidate(rows, amax, element, scale_dtype, ratios, w)
    with patch.object(floatgrid, "_SEARCH_TABLE", 1000), patch.object(floatgrid, "_SEARCH_VALUES", 3000):
        chunked = floatgrid.search_amax(rows, amax, element, scale_dtype, ratios, w)
    assert torch.equal(chunked.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(floatgrid.search_amax(rows, amax, element, scale_dtype, ratios, w).view(torch.int32),
                       expected.view(torch.int32))
    assert torch.equal(floatgrid.search_amax(rows, amax, element, scale_dtype, [], w), amax)  # nothing to try


def test_fp8_block_tiles_reload_with_qtools_logits(tmp_path, ids):
    """fp8-block: 128x128 weight tiles (strategy block) and per-128 dynamic input groups, on a model whose widths
    are multiples of 128; transformers reloads it in float32 with qtool's weights and logits."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ckpt = tmp_path / "llama256"
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(ckpt)
    run, out = tmp_path / "run", tmp_path / "ct"
    run_calibrate(str(ckpt), "fp8-block", str(run), CalibrateOptions())
    code, _, err = run_cli("export", ckpt, "-e", run / "encodings.json", "-o", out, "--format", "compressed-tensors",
                           "--quiet")
    assert code == 0, err
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "block" and group["weights"]["block_structure"] == [128, 128]
    assert group["input_activations"]["strategy"] == "group" and group["input_activations"]["group_size"] == 128
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert list(fh.get_slice("model.layers.0.mlp.down_proj.weight_scale").get_shape()) == [2, 4]
    fq, model = _fake_quant_and_reload(ckpt, run, out)
    with torch.no_grad():
        got, want = model(ids).logits, fq(ids).logits
    mods = dict(model.named_modules())
    for name, quantizer in iter_quantizers(fq):
        module, tensor = name.rsplit(".", 1)
        if tensor == "weight":
            assert torch.equal(mods[module].weight, _fake_quant_weight(dict(fq.named_modules())[module], quantizer))
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()


def test_fp8_block_on_widths_that_are_not_multiples_of_128_is_one_line(ckpt, tmp_path):
    code, _, err = run_cli("quantize", ckpt, "-c", "fp8-block", "-o", tmp_path / "out", "--format",
                           "compressed-tensors", "--quiet")
    assert code == 2 and "128x128 tiles do not divide model.layers.0.self_attn.q_proj.weight" in err, err
    assert not (tmp_path / "out").exists()


def test_report_names_the_grids(ckpt, data, tmp_path):
    run_calibrate(str(ckpt), "nvfp4", str(tmp_path / "run"), CalibrateOptions(data=str(data)))
    code, out, err = run_cli("report", ckpt, "-e", tmp_path / "run" / "encodings.json", "--data", data, "--json")
    assert code == 0, err
    assert json.loads(out)["grids"] == [
        {"tensor": "activation", "grid": "fp4_e2m1 per_block 16, fp8_e4m3 scales, dynamic", "quantizers": 14},
        {"tensor": "weight", "grid": "fp4_e2m1 per_block 16, fp8_e4m3 scales", "quantizers": 14}]


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head"])
def test_fp8_kv_cache_scales_reload_with_qtools_logits(granularity, ckpt, data, ids, tmp_path):
    """kv_cache: static FP8 scales for keys (after RoPE) and values, quantized in the fake-quant model, written as
    k_scale / v_scale with kv_cache_scheme; transformers (compressed-tensors' hooked cache) reproduces the logits."""
    recipe = tmp_path / "kv.yaml"
    recipe.write_text((Path(__file__).resolve().parents[1] / "configs" / "fp8-dynamic.yaml").read_text()
                      + f"kv_cache: {{granularity: {granularity}}}\n")
    run, out = tmp_path / "run", tmp_path / "ct"
    run_calibrate(str(ckpt), str(recipe), str(run), CalibrateOptions(data=str(data)))
    code, _, err = run_cli("export", ckpt, "-e", run / "encodings.json", "-o", out, "--format", "compressed-tensors",
                           "--quiet")
    assert code == 0, err
    scheme = json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert scheme["strategy"] == ("tensor" if granularity == "per_tensor" else "attn_head") and scheme["type"] == "float"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        shape = fh.get_slice("model.layers.0.self_attn.k_scale").get_shape()
        assert list(shape) == ([1] if granularity == "per_tensor" else [2, 1, 1])
        assert (fh.get_tensor("model.layers.1.self_attn.v_scale") > 0).all()
    fq, model = _fake_quant_and_reload(ckpt, run, out)
    with torch.no_grad():
        got, want = model(ids).logits, fq(ids).logits
        # the keys and values are really quantized: without the kv quantizers the logits move
        for n, q in iter_quantizers(fq):
            q.enabled = not n.endswith("_cache")
        without = fq(ids).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
    assert not torch.allclose(without, want, rtol=0, atol=1e-5)


def test_a_kv_cache_kept_float_in_some_attention_layers_is_refused_for_compressed_tensors(ckpt, data, tmp_path):
    """compressed-tensors' one kv_cache_scheme quantizes every attention layer's cache where transformers and vLLM
    load it: a recipe ignoring one attention layer wrote a file whose runtime quantized that layer with no scales
    (exit 0). Refused before calibrating (quantize) and from encodings (export); qtool's own format writes it."""
    recipe = tmp_path / "kv.yaml"
    recipe.write_text((Path(__file__).resolve().parents[1] / "configs" / "fp8-dynamic.yaml").read_text()
                      .replace('ignore: ["lm_head"]', "ignore: [lm_head, model.layers.0.self_attn]")
                      + "kv_cache: {granularity: per_tensor}\n")
    assert "model.layers.0.self_attn]" in recipe.read_text()
    needle = "model.layers.0.self_attn: its KV cache is kept float (1 attention layer(s) in all"
    code, out, err = run_cli("quantize", ckpt, "-c", recipe, "--data", data, "-o", tmp_path / "q", "--format",
                             "compressed-tensors", "--quiet")
    assert code == 2 and needle in err and "calibrat" not in out, err
    run = tmp_path / "run"
    run_calibrate(str(ckpt), str(recipe), str(run), CalibrateOptions(data=str(data)))
    kv = {e["name"] for e in json.loads((run / "encodings.json").read_text())["quantizers"] if "_cache" in e["name"]}
    assert kv == {"model.layers.1.self_attn.k_cache", "model.layers.1.self_attn.v_cache"}
    code, _, err = run_cli("export", ckpt, "-e", run / "encodings.json", "-o", tmp_path / "ct", "--format",
                           "compressed-tensors", "--quiet")
    assert code == 2 and needle in err and not (tmp_path / "ct").exists(), err
    code, _, err = run_cli("export", ckpt, "-e", run / "encodings.json", "-o", tmp_path / "qt", "--quiet")
    assert code == 0, err
    code, listing, err = run_cli("inspect", tmp_path / "qt", "--json")  # (an FP8 file was "qtool integer ...")
    assert code == 0 and json.loads(listing)["kind"] == "qtool float safetensors", listing


def test_a_kv_cache_alone_says_per_head_and_where_it_can_be_written(ckpt, data, tmp_path):
    """A recipe of a per-head KV cache alone: the plan line said "per_channel", and the compressed-tensors refusal
    called the format weight-only (it carries input and KV-cache schemes)."""
    recipe = tmp_path / "kv.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: null\n  activations: null\n"
                      "kv_cache: {granularity: per_head}\n")
    code, _, err = run_cli("calibrate", ckpt, "-c", recipe, "--data", data, "-o", tmp_path / "run")
    plan = next(line for line in err.splitlines() if line.startswith("plan:"))
    assert code == 0 and "x k_cache fp8_e4m3 per_head" in plan and "per_channel" not in plan, err
    code, out, err = run_cli("config", "show", recipe, "-m", ckpt)  # (the plan's table, and report's grids)
    assert code == 0 and "fp8_e4m3 per_head (" in out and "per_channel" not in out, out
    code, out, err = run_cli("report", ckpt, "-e", tmp_path / "run/encodings.json", "--data", data, "--json")
    assert code == 0 and [g["grid"] for g in json.loads(out)["grids"]] == ["fp8_e4m3 per_head"], out
    code, out, err = run_cli("inspect", tmp_path / "run/encodings.json", "--json")  # (read "per_channel")
    assert code == 0 and {t["granularity"] for t in json.loads(out)["tensors"]} == {"per_head"}, out
    code, _, err = run_cli("export", ckpt, "-e", tmp_path / "run/encodings.json", "-o", tmp_path / "ct", "--format",
                           "compressed-tensors")
    assert code == 2 and not (tmp_path / "ct").exists()
    assert "quantize no Linear weight" in err and "export with --format qtool" in err and "weight-only" not in err
    code, out, err = run_cli("export", ckpt, "-e", tmp_path / "run/encodings.json", "-o", tmp_path / "qt", "--json")
    assert code == 0, err  # (the warning said "the exported tensors hold their scales": the file holds weights)
    said = [w for w in json.loads(out)["export_warnings"] if w.startswith("model.encodings (AIMET JSON) not written")]
    assert len(said) == 1 and "the 4 activation and KV-cache scales are in " in said[0], said
