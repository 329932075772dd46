"""qtool's numerics against aimet-torch 2.42 reference outputs: exact equality, not closeness."""

import pytest
import torch

from qtool.quant import (
    MinMaxEncodingAnalyzer,
    Quantize,
    QuantizeDequantize,
    adjust_min_max,
    dequantize,
    min_max_to_scale_offset,
    quantize,
    quantize_dequantize,
)

CASE_NAMES = [
    # kept literal so a missing or renamed case fails loudly instead of silently shrinking the suite
    f"{kind}_b{b}_{sym}"
    for b in (4, 8)
    for sym in ("sym", "asym")
    for kind in (
        "pertensor",
        "perchannel_axis0",
        "blockwise_bs16",
        "conv_perchannel_axis0",
        "conv_blockwise_bs8",
        "act_pertensor_multibatch",
    )
] + [
    f"edge_{kind}_b8_{sym}"
    for sym in ("sym", "asym")
    for kind in ("zeros", "const_pos", "const_neg", "all_pos", "all_neg", "tiny", "ties",
                 "halfstep_probes_pertensor", "halfstep_probes_perchannel")
]


def test_every_golden_case_is_covered(golden):
    meta, _ = golden
    assert sorted(meta["cases"]) == sorted(CASE_NAMES)
    assert len(CASE_NAMES) == 42


def _calib_batches(name, tensors):
    keys = sorted((k for k in tensors if k.startswith(f"{name}/calib_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    return [tensors[k] for k in keys] or [tensors[f"{name}/x"]]


def _case(golden, name):
    meta, tensors = golden
    c = meta["cases"][name]
    ref = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(name + "/")}
    return c, ref, _calib_batches(name, tensors)


@pytest.fixture(params=["float32", "float64"])
def default_dtype(request):
    """torch's default dtype as a user may have set it: the quantizer's ranges, scales and outputs stay AIMET's
    (under float64 its min/max were float64, and 21 of the 42 cases' scales differed)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, request.param))
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_quantizer_module_matches_aimet_exactly(golden, name, default_dtype):
    c, ref, batches = _case(golden, name)
    qdq = QuantizeDequantize(c["shape"], c["bitwidth"], c["symmetric"], block_size=c["block_size"])
    with qdq.compute_encodings():
        for b in batches:
            qdq(b)
    assert qdq.is_initialized()
    assert (qdq.qmin, qdq.qmax) == (c["qmin"], c["qmax"])
    with torch.no_grad():
        assert torch.equal(qdq.min, ref["min"])
        assert torch.equal(qdq.max, ref["max"])
        assert torch.equal(qdq.get_scale(), ref["scale"])
        assert torch.equal(qdq.get_offset(), ref["offset"])
        out = qdq(ref["x"])
        assert torch.equal(out.as_subclass(torch.Tensor), ref["qdq_grad"])
        assert torch.equal(out.quantized_repr().to(torch.int32), ref["q"])
        enc = qdq.get_encodings()
        assert torch.allclose(enc.min, ref["enc_min"], rtol=0, atol=0)
        assert torch.allclose(enc.max, ref["enc_max"], rtol=0, atol=0)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_quantize_module_integer_codes_and_dtype(golden, name):
    c, ref, batches = _case(golden, name)
    q = Quantize(c["shape"], c["bitwidth"], c["symmetric"], block_size=c["block_size"])
    with q.compute_encodings():
        for b in batches:
            q(b)
    with torch.no_grad():
        out = q(ref["x"])
    codes = out.quantized_repr()
    assert str(codes.dtype) == c["quantized_repr_dtype"]
    assert torch.equal(codes.to(torch.int32), ref["q"])
    assert torch.equal(out.dequantize().as_subclass(torch.Tensor), ref["dq"])


@pytest.mark.parametrize("name", CASE_NAMES)
def test_functional_path_matches_aimet_exactly(golden, name):
    c, ref, batches = _case(golden, name)
    analyzer = MinMaxEncodingAnalyzer(c["shape"], c["block_size"])
    for b in batches:
        analyzer.update_stats(b)
    mn, mx = analyzer.compute_encodings(c["qmax"] - c["qmin"], c["symmetric"])
    assert torch.equal(mn, ref["min"]) and torch.equal(mx, ref["max"])
    scale, offset = min_max_to_scale_offset(mn, mx, c["qmin"], c["qmax"], c["symmetric"])
    assert torch.equal(scale, ref["scale"]) and torch.equal(offset, ref["offset"])
    bs = c["block_size"]
    q = quantize(ref["x"], scale, offset, qmin=c["qmin"], qmax=c["qmax"], block_size=bs)
    assert torch.equal(q.to(torch.int32), ref["q"])
    # the bitwidth + signed and num_steps + signed call forms reach the same grid
    signed = c["qmin"] < 0
    assert torch.equal(quantize(ref["x"], scale, offset, c["bitwidth"], signed, bs), q)
    assert torch.equal(
        quantize(ref["x"], scale, offset, num_steps=c["qmax"] - c["qmin"], signed=signed, block_size=bs), q
    )
    assert torch.equal(dequantize(q, scale, offset, block_size=bs), ref["dq"])
    assert torch.equal(
        quantize_dequantize(ref["x"], scale, offset, qmin=c["qmin"], qmax=c["qmax"], block_size=bs), ref["qdq_grad"]
    )


def test_multiply_by_reciprocal_path_is_not_ours(golden):
    """AIMET's no-grad path multiplies by 1/scale; ours divides. The reference shows both; we equal division."""
    meta, tensors = golden
    differs = 0
    for name in CASE_NAMES:
        differs += int(not torch.equal(tensors[f"{name}/qdq_grad"], tensors[f"{name}/qdq_nograd"]))
    # the data set was made so that at least the half-step probes separate the two paths
    assert differs >= 1


def _analyzer_cases(meta):
    return [c for c in meta["cases"] if c["analyzer"] == "minmax"]


def test_minmax_analyzer_multibatch_matches_aimet(analyzer_ref):
    meta, tensors = analyzer_ref
    cases = _analyzer_cases(meta)
    assert len(cases) == 16
    for c in cases:
        x = tensors[f"{c['input']}/x"]
        analyzer = MinMaxEncodingAnalyzer(c["shape"])
        for lo, hi in c["batches"]:
            analyzer.update_stats(x[..., lo:hi])
        n = 2 ** c["bitwidth"] - 1
        mn, mx = analyzer.compute_encodings(n, c["symmetric"])
        key = f"{c['input']}/minmax/bw{c['bitwidth']}/{'sym' if c['symmetric'] else 'asym'}"
        assert torch.equal(mn, tensors[key + "/min"].reshape(mn.shape)), key
        assert torch.equal(mx, tensors[key + "/max"].reshape(mx.shape)), key


def test_range_documented_example():
    """Input range [-1, 3], asymmetric 8-bit: scale 4/255, offset -64, effective range [-1.00392, 2.99608]."""
    mn, mx = adjust_min_max(torch.tensor(-1.0), torch.tensor(3.0), 255, False)
    scale, offset = min_max_to_scale_offset(mn, mx, 0, 255, False)
    assert scale.item() == pytest.approx(4 / 255, rel=1e-7)
    assert offset.item() == -64
    assert ((offset + 0) * scale).item() == pytest.approx(-1.00392, abs=1e-5)
    assert ((offset + 255) * scale).item() == pytest.approx(2.99608, abs=1e-5)
