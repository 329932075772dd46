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
    with pytest.raises(EncodingsError, match="malformed AIMET 1.0.0"):
        from_aimet({"version": "1.0.0", "param_encodings": [{"name": "x"}]}, {}, "f", lambda n: n)


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
