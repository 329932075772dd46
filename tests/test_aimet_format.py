"""AIMET encodings files: qtool writes AIMET's numbers in every version, reads every version back exactly."""

import json
from pathlib import Path

import pytest
import torch

from qtool.aimet_format import entry_to_aimet, from_aimet, range_for_scale_offset, to_aimet
from qtool.encodings import EncodingEntry, EncodingsFile
from qtool.errors import EncodingsError
from qtool.quant import QuantizeDequantize

from tests.test_quant_golden import CASE_NAMES, _case

SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "data" / "aimet" / "encodings-samples"


def _calibrated_entry(golden, name):
    c, ref, batches = _case(golden, name)
    q = QuantizeDequantize(c["shape"], c["bitwidth"], c["symmetric"], block_size=c["block_size"])
    with q.compute_encodings():
        for b in batches:
            q(b)
    gran = "per_tensor" if not c["shape"] else ("per_block" if c["block_size"] else "per_channel")
    if gran == "per_channel" and all(s == 1 for s in c["shape"]):
        gran = "per_tensor"
    return c, EncodingEntry(name, "m", "weight", c["bitwidth"], c["symmetric"], gran, tuple(c["shape"]),
                            None if c["block_size"] is None else tuple(c["block_size"]), "minmax",
                            q.min.detach().clone(), q.max.detach().clone())


@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_version_carries_aimets_numbers(golden, name):
    c, e = _calibrated_entry(golden, name)
    ref = c["encodings"]
    assert entry_to_aimet(e, "0.6.1") == ref["0.6.1"]
    v1 = entry_to_aimet(e, "1.0.0")
    v1.pop("name")
    assert v1 == ref["1.0.0"]
    v2 = entry_to_aimet(e, "2.0.0")
    v2.pop("name")
    expect = dict(ref["2.0.0"])
    if "axis" in expect:  # AIMET's functional path writes negative axes, its model export positive ones
        expect["axis"] = int(expect["axis"]) % len(c["input_shape"])
    assert v2 == expect


@pytest.mark.parametrize("version", ["0.6.1", "1.0.0", "2.0.0"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_round_trip_qtool_aimet_qtool_is_exact(golden, name, version):
    c, e = _calibrated_entry(golden, name)
    if c["block_size"] is None and len(c["input_shape"]) != len(c["shape"]) and c["shape"]:
        pytest.skip("per-channel over a different rank")
    obj = json.loads(json.dumps(to_aimet(EncodingsFile([e], {}), version, "t", names={name: "m.weight"})))
    back, warnings = from_aimet(obj, {"m.weight": tuple(c["input_shape"])}, "f", lambda n: n.rsplit(".", 1)[0])
    assert not warnings
    (b,) = back.entries
    s1, o1 = e.scale_offset()
    s2, o2 = b.scale_offset()
    assert torch.equal(s1, s2) and torch.equal(o1, o2)
    assert (b.bitwidth, b.symmetric, b.shape) == (e.bitwidth, e.symmetric, e.shape)
    if e.granularity != "per_tensor":
        assert b.granularity == e.granularity
    if e.block_size is not None:
        assert b.block_size == e.block_size


@pytest.mark.parametrize("sample", sorted(p.name for p in SAMPLES.glob("*.encodings")
                                          if not p.name.startswith("lpbq")))
def test_reads_real_aimet_exports(sample):
    obj = json.loads((SAMPLES / sample).read_text())
    kind = sample.split("_v")[0]
    shapes = {"pertensor": {"conv.weight": (8, 3, 3, 3), "fc1.weight": (32, 128), "fc2.weight": (16, 32),
                            "fc3.weight": (10, 16)},
              "blockwise": {"0.weight": (32, 64), "2.weight": (16, 32)}}
    shapes["perchannel"] = shapes["pertensor"]
    enc, warnings = from_aimet(obj, shapes[kind], sample, lambda n: n.rsplit(".", 1)[0])
    weights = {e.name: e for e in enc.entries}
    assert set(weights) == set(shapes[kind])
    expect = {"pertensor": "per_tensor", "perchannel": "per_channel", "blockwise": "per_block"}[kind]
    assert {e.granularity for e in weights.values()} == {expect}
    if kind == "blockwise":
        assert weights["0.weight"].shape == (32, 4) and weights["0.weight"].block_size == (1, 16)
    # activations are keyed by ONNX tensor names here, which no checkpoint has: they are reported, not guessed
    assert warnings and all("skipped" in w for w in warnings)
    # the same numbers come out again in the same version
    if obj["version"] in ("0.6.1", "1.0.0"):
        again = to_aimet(enc, obj["version"], "t")
        key = "param_encodings"
        if obj["version"] == "0.6.1":
            assert again[key] == {k: v for k, v in obj[key].items()}
        else:
            assert again[key] == obj[key]


def test_range_for_scale_offset_handles_awkward_scales():
    g = torch.Generator().manual_seed(0)
    from qtool.quant.affine import adjust_min_max, min_max_to_scale_offset as to_so

    # ranges over nine decades; every scale that a calibrated range produces must map back exactly
    lo = -(torch.rand(1000, generator=g) * 10 ** (torch.rand(1000, generator=g) * 9 - 5))
    hi = torch.rand(1000, generator=g) * 10 ** (torch.rand(1000, generator=g) * 9 - 5)
    for qmin, qmax, sym in ((-128, 127, True), (0, 255, False), (-8, 7, True), (0, 15, False)):
        scale, offset = to_so(*adjust_min_max(lo, hi, qmax - qmin, sym), qmin, qmax, sym)
        mn, mx = range_for_scale_offset(scale, offset, qmin, qmax, sym)
        s2, o2 = __import__("qtool.quant.affine", fromlist=["x"]).min_max_to_scale_offset(mn, mx, qmin, qmax, sym)
        assert torch.equal(s2, scale) and torch.equal(o2, offset)


def test_malformed_aimet_file_is_a_clear_error():
    with pytest.raises(EncodingsError, match=r"^f: x: malformed AIMET 1.0.0 entry \(no 'bw' key\)$"):
        from_aimet({"version": "1.0.0", "param_encodings": [{"name": "x"}]}, {}, "f", lambda n: n)


@pytest.mark.parametrize("low, high, said", [(-1.28, 1.27, False), (-1.2800001, 1.2699999, False), (-5.0, 5.0, True)])
def test_a_0_6_1_range_other_than_its_scale_and_offsets_is_said(low, high, said):
    """0.6.1's min/max are the effective range (offset·scale, (offset + 255)·scale): a file whose range says
    another one was imported by its scale and offset without a word."""
    entry = [{"bitwidth": 8, "is_symmetric": "True", "scale": 0.01, "offset": -128, "min": low, "max": high}]
    enc, warnings = from_aimet({"version": "0.6.1", "param_encodings": {"0.weight": entry}}, {"0.weight": (3, 4)}, "f",
                               lambda n: n.rsplit(".", 1)[0])
    assert enc.entries[0].min.flatten().tolist() == pytest.approx([-1.28])
    assert warnings == ([f"0.weight: min/max [{low:.6g}, {high:.6g}] (channel 0) are not the range its scale and "
                         "offset give, [-1.28, 1.27]; imported by its scale and offset"] if said else [])


@pytest.mark.parametrize("entry, message", [
    # an empty list, a channel without its offset: raw IndexError / KeyError naming no entry
    ([], "0.weight: a 0.6.1 entry is a list of encodings, one per channel"),
    ([{"bitwidth": 8, "is_symmetric": "True", "scale": 0.1}], r"0.weight: malformed AIMET 0.6.1 entry \(no 'offset' key\)"),
    # AIMET 0.6.1's float encoding: an int16 grid when it held the integer keys too, else KeyError 'is_symmetric'
    ([{"bitwidth": 16, "dtype": "float"}], "0.weight: dtype 'float': only integer encodings can be imported"),
    ([{"bitwidth": 16, "dtype": "float", "is_symmetric": "False", "scale": 0.1, "offset": -3}],
     "0.weight: dtype 'float': only integer encodings"),
    # channels that disagree imported as channel 0 said
    ([{"bitwidth": 8, "is_symmetric": "True", "scale": 0.1, "offset": -128}] * 2
     + [{"bitwidth": 4, "is_symmetric": "True", "scale": 0.1, "offset": -8}],
     r"0.weight: channel 2's bitwidth 4 differs from channel 0's 8 \(one quantizer has one\)"),
])
def test_a_malformed_0_6_1_entry_is_named(entry, message):
    with pytest.raises(EncodingsError, match="^f: " + message):
        from_aimet({"version": "0.6.1", "param_encodings": {"0.weight": entry}}, {"0.weight": (3, 4)}, "f",
                   lambda n: n.rsplit(".", 1)[0])


@pytest.mark.parametrize("version, kept", [("0.6.1", "per_tensor"), ("1.0.0", "per_channel"),
                                           ("2.0.0", "per_channel")])
def test_a_weight_of_one_output_channel_keeps_its_granularity(version, kept):
    """Linear(4, 1) per channel is one encoding, as per-tensor is: 1.0.0's enc_type and 2.0.0's axis say which
    (0.6.1 writes the two alike); per-tensor stays per-tensor in every version."""
    shapes = {"m.weight": (1, 4)}
    for gran, shape, expect in (("per_channel", (1, 1), kept), ("per_tensor", (), "per_tensor")):
        e = EncodingEntry("m.weight", "m", "weight", 8, False, gran, shape, None, "minmax",
                          torch.full(shape, -0.5), torch.full(shape, 1.5))
        obj = json.loads(json.dumps(to_aimet(EncodingsFile([e], {}), version, "t")))
        back, warnings = from_aimet(obj, shapes, "f", lambda n: n.rsplit(".", 1)[0])
        (b,) = back.entries
        assert not warnings and b.granularity == expect and b.shape == ((1, 1) if expect == "per_channel" else ())
        assert torch.equal(b.scale_offset()[0].reshape(-1), e.scale_offset()[0].reshape(-1))


# ---- files whose numbers qtool must not change on import, and files it must refuse ---------------------------
def _mod(n):
    return n.rsplit(".", 1)[0]


def _v1(params=(), acts=()):
    return {"version": "1.0.0", "param_encodings": list(params), "activation_encodings": list(acts)}


def _v1_entry(name, scale, offset, is_sym, enc_type="PER_CHANNEL", bw=8):
    return {"name": name, "dtype": "INT", "bw": bw, "is_sym": is_sym, "scale": scale, "offset": offset,
            "enc_type": enc_type}


@pytest.mark.parametrize("version", ["0.6.1", "1.0.0"])
def test_unsigned_symmetric_encodings_keep_their_range(version):
    """AIMET's unsigned symmetric activations (after a ReLU: is_sym true, offset 0) cover [0, 255 * scale]: they
    import as that asymmetric grid, with a warning, not as the signed [-128, 127] * scale."""
    if version == "0.6.1":
        obj = {"version": "0.6.1", "param_encodings": {}, "activation_encodings": {"fc1.input": [
            {"min": 0.0, "max": 2.55, "scale": 0.01, "offset": 0, "bitwidth": 8, "dtype": "int",
             "is_symmetric": "True"}]}}
    else:
        obj = _v1(acts=[_v1_entry("fc1.input", [0.01], [0], True, "PER_TENSOR")])
    enc, warnings = from_aimet(obj, {}, "f", _mod)
    (e,) = enc.entries
    assert not e.symmetric and e.qmin_qmax == (0, 255)
    scale, offset = e.scale_offset()
    assert float(scale) == float(torch.tensor(0.01)) and float(offset) == 0
    assert float(e.min) == 0 and abs(float(e.max) - 2.55) < 1e-6
    assert any(w.startswith("fc1.input: symmetric, but its offsets") for w in warnings)
    again = to_aimet(enc, version, "t")["activation_encodings"]
    back = again["fc1.input"][0] if version == "0.6.1" else again[0]
    assert back["offset"] in (0, [0]) and back["scale"] in (float(torch.tensor(0.01)), [float(torch.tensor(0.01))])


def test_symmetric_per_channel_with_another_offset_keeps_every_offset():
    scale = [0.01 * (i + 1) for i in range(4)]
    offset = [-128, -128, -100, -128]
    enc, warnings = from_aimet(_v1([_v1_entry("m.weight", scale, offset, True)]), {"m.weight": (4, 8)}, "f", _mod)
    (e,) = enc.entries
    assert not e.symmetric and e.granularity == "per_channel" and any("m.weight: symmetric" in w for w in warnings)
    back = to_aimet(enc, "1.0.0", "t")["param_encodings"][0]
    assert back["offset"] == offset and back["scale"] == [float(torch.tensor(s)) for s in scale]


def _v2(entry):
    return {"version": "2.0.0", "encodings": [dict({"name": "a.weight", "output_dtype": "int8"}, **entry)]}


@pytest.mark.parametrize("shape, entry, message", [
    ((16, 16), {"y_scale": [0.01] * 16, "axis": 1}, "f: a.weight: per-channel encodings along axis 1 are not"),
    ((16, 32), {"y_scale": [0.01] * 16, "axis": 1}, "f: a.weight: per-channel encodings along axis 1 are not"),
    ((16, 16), {"y_scale": [0.01] * 16, "axis": 5}, "f: a.weight: axis 5 is outside a 2-D weight"),
    ((16, 16), {"y_scale": [0.01] * 16, "axis": "0"}, "f: a.weight: axis must be an integer"),
    ((8, 64), {"y_scale": [[0.01] * 8] * 4, "axis": 0, "block_size": 2}, "blockwise encodings along axis 0"),
])
def test_an_axis_qtool_cannot_hold_is_refused(shape, entry, message):
    with pytest.raises(EncodingsError, match=message):
        from_aimet(_v2(entry), {"a.weight": shape}, "f", _mod)


@pytest.mark.parametrize("axis", [0, -2])
def test_per_channel_along_axis_0_imports(axis):
    enc, _ = from_aimet(_v2({"y_scale": [0.01] * 16, "axis": axis}), {"a.weight": (16, 16)}, "f", _mod)
    (e,) = enc.entries
    assert e.granularity == "per_channel" and e.shape == (16, 1)


def test_a_transposed_blocked_y_scale_is_refused():
    scales = [[0.01 * (i + 1)] * 32 for i in range(4)]  # 4 x 32 where a (32, 64) weight in blocks of 16 has 32 x 4
    with pytest.raises(EncodingsError, match=r"f: a.weight: y_scale is nested as \[4, 32\]; a weight of shape "
                                             r"\[32, 64\] needs \[32, 4\]"):
        from_aimet(_v2({"output_dtype": "int4", "y_scale": scales, "axis": 1, "block_size": 16}),
                   {"a.weight": (32, 64)}, "f", _mod)


def test_aimet_export_refuses_tiles_of_blocks():
    from qtool.aimet_format import block_problem
    from qtool.errors import UsageError
    from qtool.export.aimet import EXPORTER

    def entry(shape, block):
        return EncodingEntry("m.weight", "m", "weight", 4, True, "per_block", shape, block, "minmax",
                             -torch.ones(shape), torch.ones(shape))

    assert block_problem(entry((16, 2), (1, 16)).spec) is None
    assert block_problem(entry((8, 4, 1, 1), (1, 8, -1, -1)).spec) is None
    with pytest.raises(UsageError, match=r"AIMET encodings block the input dimension alone .* m.weight has blocks "
                                         r"of \[8, 16\]"):
        EXPORTER.check_quantizers([entry((4, 2), (8, 16))], EXPORTER.options())


@pytest.mark.parametrize("obj, message", [
    (_v1([_v1_entry("fc9.weight", [0.01], [-128], True, "PER_TENSOR")]),
     r"f: nothing to import: none of its 1 entries \(e.g. 'fc9.weight'\) names a weight of this checkpoint"),
    (_v1(), "f: nothing to import: the file holds no encodings"),
    ({"version": "2.0.0", "encodings": {}}, "f: nothing to import: the file holds no encodings"),
    ({"version": "1.0.0", "encodings": [{"name": "a.weight", "output_dtype": "int8", "y_scale": 0.01}]},
     "f: nothing to import: the file holds no encodings .AIMET 1.0.0 keeps them in param_encodings"),
    # this model's bias alone: it was "were they made for another model?"
    (_v1([_v1_entry("a.bias", [0.01], [-128], True, "PER_TENSOR")]),
     r"f: nothing to import: its 1 entries \(e.g. 'a.bias'\) name biases or buffers, which qtool does not quantize"),
    # the root model's input: imported as a quantizer on no module, which report then ran as the model's forward
    ({"version": "1.0.0", "activation_encodings": [_v1_entry(".input", [0.01], [0], False, "PER_TENSOR")]},
     r"^f: .input: an activation entry is <module>.input, and this one names no module$"),
])
def test_a_file_with_nothing_for_this_model_is_refused(obj, message):
    with pytest.raises(EncodingsError, match=message):
        from_aimet(obj, {"a.weight": (4, 8), "a.bias": (4,)}, "f", _mod)


def test_an_unmatched_param_entry_is_not_called_an_activation():
    obj = _v1([_v1_entry("fc9.weight", [0.01], [-128], True, "PER_TENSOR"),
               _v1_entry("a.weight", [0.01], [-128], True, "PER_TENSOR")])
    _, warnings = from_aimet(obj, {"a.weight": (4, 8)}, "f", _mod)
    assert warnings == ["fc9.weight: no tensor of that name in the checkpoint; skipped"]


@pytest.mark.parametrize("tiny", [1e-45, 1e-40, 1e-8])
def test_a_scale_below_qtools_smallest_is_refused(tiny):
    obj = _v1([_v1_entry("a.weight", [0.01, tiny, 0.01, 0.01], [-128] * 4, True)])
    with pytest.raises(EncodingsError, match="f: a.weight: scale .* is below the smallest .* cannot be represented"):
        from_aimet(obj, {"a.weight": (4, 8)}, "f", _mod)


@pytest.mark.parametrize("sample", ["lpbq_v2.0.0.encodings", "lpbq_v2.1.0.encodings"])
def test_lpbq_files_say_lpbq(sample):
    obj = json.loads((SAMPLES / sample).read_text())
    with pytest.raises(EncodingsError, match=f"{sample}: 0.weight: LPBQ and vector encodings are not supported"):
        from_aimet(obj, {"0.weight": (32, 64), "2.weight": (16, 32)}, sample, _mod)


def test_a_float_output_dtype_is_named():
    with pytest.raises(EncodingsError, match="f: a.weight: output_dtype 'float16' is not supported"):
        from_aimet(_v2({"output_dtype": "float16", "y_scale": 0.01}), {"a.weight": (4, 8)}, "f", _mod)


@pytest.mark.parametrize("version", ["0.6.1", "1.0.0", "2.0.0"])
def test_quantizers_reading_one_tensor_alike_are_not_said_to_differ(version):
    """A BERT's query, key and value read one LayerNorm output with bit-identical encodings: 1.0.0 and 2.0.0 said
    "read by quantizers with different encodings", comparing items that carry each quantizer's own name."""
    from qtool.aimet_format import shared_names

    acts = [_v1_entry(f"{m}.input", [0.0322], [-129], False, "PER_TENSOR") for m in ("q", "k", "v")]
    enc, _ = from_aimet(_v1(acts=acts), {}, "f", _mod)
    names = {f"{m}.input": "ln_out" for m in ("q", "k", "v")}
    assert shared_names(enc, version, names) == []
    acts[2] = _v1_entry("v.input", [0.0323], [-129], False, "PER_TENSOR")
    enc, _ = from_aimet(_v1(acts=acts), {}, "f", _mod)
    assert shared_names(enc, version, names) == [("ln_out", ["q.input", "k.input", "v.input"])]


@pytest.mark.parametrize("obj, message", [
    (_v1([_v1_entry("a.weight", [True], [-128], True, "PER_TENSOR")]),
     r"^f: a.weight: scale must be numbers \(got 'True'\)"),
    (_v1([_v1_entry("a.weight", ["0.01"], [-128], True, "PER_TENSOR")]), r"scale must be numbers \(got '0.01'\)"),
    (_v2({"y_scale": [0.01], "y_zero_point": True}), r"y_zero_point must be numbers \(got 'True'\)"),
    ({"version": "0.6.1", "param_encodings": {"a.weight": [{"bitwidth": 8, "is_symmetric": "True", "scale": True,
                                                            "offset": -128}]}}, "scale must be numbers"),
    (_v1([_v1_entry("a.weight", [], [], True, "PER_TENSOR")]), "scale holds no numbers"),
])
def test_a_scale_or_offset_that_is_not_numbers_is_refused(obj, message):
    """A JSON true read as 1.0 (a scale of 1, a zero point of -1) and a string read as its number: imported with
    exit 0; an empty list ended in "ZeroDivisionError: integer modulo by zero"."""
    with pytest.raises(EncodingsError, match=message):
        from_aimet(obj, {"a.weight": (4, 8)}, "f", _mod)


@pytest.mark.parametrize("scale, offset, message", [
    (1e300, -128, r"its range overflows float32 \(scale up to 1e\+300\)"),
    (3.5e38, -128, r"its range overflows float32 \(scale up to 3.5e\+38\)"),
    # (a finite range whose width overflows: "its encoding holds NaN or infinity", naming no file, when written)
    (1.4e36, -128, r"^f: a.weight: its range overflows float32 \(scale up to 1.4e\+36\)"),
    (1e-50, -128, r"scale 1e-50 is below the smallest qtool's 8-bit grids have"),
    (0.01, -1e300, r"its offset puts zero at code 1e\+300, outside the 8-bit grid \[0, 255\]$"),
])
def test_a_scale_or_offset_out_of_float32_is_named_as_the_file_says_it(scale, offset, message):
    """float32 rounded them first: "every scale must be a finite number above 0 (got inf)" for a finite scale, "(got
    0.0)" for 1e-50, and a 300-digit code."""
    obj = _v1([_v1_entry("a.weight", [scale], [offset], False, "PER_TENSOR")])
    with pytest.raises(EncodingsError, match=message):
        from_aimet(obj, {"a.weight": (4, 8)}, "f", _mod)


def test_per_tensor_with_a_scale_per_channel_is_refused():
    obj = _v1([_v1_entry("a.weight", [0.01] * 4, [-128] * 4, True, "PER_TENSOR")])
    with pytest.raises(EncodingsError, match="f: a.weight: enc_type PER_TENSOR with 4 scales"):
        from_aimet(obj, {"a.weight": (4, 8)}, "f", _mod)


def test_aimets_per_channel_transposed_convolution_is_named_as_such():
    """AIMET writes a ConvTranspose2d's per-channel scales along its weight's dim 1: the line said the count was
    wrong ("one per output channel, along axis 0"), which is false for that layer."""
    obj = _v1([_v1_entry("up.weight", [0.01] * 16, [-128] * 16, True)])
    with pytest.raises(EncodingsError, match="f: up.weight: 16 per-channel encodings for a weight of shape "
                                             r"\[32, 16, 2, 2\]: qtool's run along axis 0 \(one per output channel, "
                                             r"32\); 16 is its dim 1, where AIMET counts a transposed convolution's "
                                             "output channels: such a layer takes per_tensor encodings only"):
        from_aimet(obj, {"up.weight": (32, 16, 2, 2)}, "f", _mod)


def test_a_fused_expert_tensor_says_experts_are_named_one_by_one():
    """gpt-oss stores a layer's experts fused (mlp.experts.gate_up_proj); qtool names them one by one. The line said
    the file was another model's."""
    shapes = {f"m.experts.{e}.gate_proj.weight": (8, 4) for e in range(2)}
    obj = _v1([_v1_entry("m.experts.gate_up_proj", [0.01], [-128], True, "PER_TENSOR")])
    with pytest.raises(EncodingsError, match=r"nothing to import: .*\(m.experts.gate_up_proj: a mixture-of-experts "
                                             r"layer's experts as one fused tensor: qtool names its experts one by "
                                             r"one \(m.experts.<e>.<projection>.weight"):
        from_aimet(obj, shapes, "f", _mod)
