"""Behaviour of the quantization core beyond the AIMET reference cases."""

import pytest
import torch

from qtool.quant import (
    AffineEncoding,
    DequantizedTensor,
    DynamicQuantizeDequantize,
    Quantize,
    QuantizeDequantize,
    QuantizedTensor,
    UninitializedQuantizerError,
    dequantize,
    quantize,
    quantize_dequantize,
)

SEED_CODES = [0, 0, 0, 0, 0, 0, -0, 1, 2, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11, 12, 13, 13, 14, 15, 15, 15, 15, 15, 15]


@pytest.mark.parametrize(
    "kwargs", [dict(bitwidth=4), dict(num_steps=15, signed=False), dict(qmin=0, qmax=15)], ids=["bw", "steps", "q"]
)
def test_seed_example_quantize(kwargs):
    x = torch.arange(-0.3, 1.3, 0.05)
    q = quantize(x, torch.tensor(1 / 15), torch.tensor(0.0), **kwargs)
    assert q.tolist() == SEED_CODES


def test_seed_example_quantize_module():
    q = Quantize(shape=(2, 1), bitwidth=8, symmetric=True)
    x = torch.tensor([[-1.20, 4.1, -0.21, 2.3], [0.2, 5.6, -1.0, -0.1]])
    with q.compute_encodings():
        q(x)
    out = q(x)
    assert isinstance(out, QuantizedTensor)
    codes = out.quantized_repr()
    assert codes.dtype == torch.int8
    assert codes.tolist() == [[-37, 127, -7, 71], [5, 127, -23, -2]]
    expect = torch.tensor([[-1.1945, 4.1000, -0.2260, 2.2921], [0.2205, 5.6000, -1.0142, -0.0882]])
    torch.testing.assert_close(out.dequantize().as_subclass(torch.Tensor), expect, atol=5e-5, rtol=0)


def test_call_forms_need_exactly_one_grid():
    x = torch.ones(4)
    with pytest.raises(ValueError, match="exactly one"):
        quantize(x, torch.tensor(0.1), torch.tensor(0.0))
    with pytest.raises(ValueError, match="exactly one"):
        quantize(x, torch.tensor(0.1), torch.tensor(0.0), 8, num_steps=255)
    with pytest.raises(ValueError, match="qmin must be less"):
        quantize(x, torch.tensor(0.1), torch.tensor(0.0), qmin=3, qmax=3)


def test_signed_num_steps_grid():
    # num_steps=255 signed is -128..127; clamps reveal the grid
    x = torch.tensor([-1000.0, 1000.0])
    q = quantize(x, torch.tensor(1.0), torch.tensor(0.0), num_steps=255, signed=True)
    assert q.tolist() == [-128, 127]


def test_block_size_that_does_not_divide_is_a_clear_error():
    x = torch.randn(4, 30)
    with pytest.raises(ValueError, match="block size 16 does not divide input dim 1 of size 30"):
        quantize(x, torch.ones(4, 2), torch.zeros(4, 2), 8, block_size=(1, 16))
    with pytest.raises(ValueError, match="does not broadcast"):
        quantize(x, torch.ones(4, 3), torch.zeros(4, 3), 8)
    with pytest.raises(ValueError, match="block_size"):
        QuantizeDequantize((4, 2), 8, True, block_size=(1,))
    with pytest.raises(ValueError, match="whole numbers"):  # (was truncated to 15, then "does not divide")
        quantize(x, torch.ones(4, 2), torch.zeros(4, 2), 8, block_size=(1, 15.5))
    assert torch.equal(quantize(x, torch.ones(4, 2), torch.zeros(4, 2), 8, block_size=(1.0, 15.0)),
                       quantize(x, torch.ones(4, 2), torch.zeros(4, 2), 8, block_size=(1, 15)))


def test_block_size_minus_one_means_whole_remaining_dim():
    x = torch.randn(8, 32, 3, 3)
    scale = torch.rand(8, 4, 1, 1) + 0.01
    off = torch.zeros(8, 4, 1, 1)
    a = quantize(x, scale, off, 8, True, block_size=(1, 8, -1, -1))
    b = quantize(x, scale, off, 8, True, block_size=(1, 8, 3, 3))
    # the same as expanding the scale by hand
    full = scale.repeat_interleave(8, dim=1).expand(8, 32, 3, 3)
    c = quantize(x, full.contiguous(), torch.zeros_like(full), 8, True)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_forward_before_initialization_raises():
    q = QuantizeDequantize((), 8, False)
    assert not q.is_initialized()
    assert q.get_encodings() is None and q.get_scale() is None
    with pytest.raises(UninitializedQuantizerError, match="not initialized"):
        q(torch.randn(3))


@pytest.mark.parametrize("how", ["assign", "copy", "set_range", "load_state_dict"])
def test_setting_min_max_by_hand_initializes(how):
    q = QuantizeDequantize((), 8, False)
    if how == "assign":
        q.min = torch.nn.Parameter(torch.tensor(-1.0))
        q.max = torch.nn.Parameter(torch.tensor(3.0))
    elif how == "copy":
        with torch.no_grad():
            q.min.copy_(torch.tensor(-1.0))
            q.max.copy_(torch.tensor(3.0))
    elif how == "set_range":
        q.set_range(-1.0, 3.0)
    else:
        q.load_state_dict({"min": torch.tensor(-1.0), "max": torch.tensor(3.0)})
    assert q.is_initialized()
    assert q.get_offset().item() == -64
    assert q.get_scale().item() == pytest.approx(4 / 255)


def test_partial_assignment_is_not_initialized():
    q = QuantizeDequantize((), 8, False)
    q.min = torch.nn.Parameter(torch.tensor(-1.0))
    assert not q.is_initialized()


def test_initialization_survives_dtype_and_device_moves():
    q = QuantizeDequantize((), 8, False)
    q.set_range(-1.0, 3.0)
    q.to(torch.float64)
    assert q.is_initialized()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_is_initialized_exactly_where_the_original_is(how):
    """A copy of an uncalibrated quantizer said it was initialized (its parameters were new objects) and turned
    every input into 0 or one step above it with min = max = 0."""
    import copy
    import pickle

    def copied(q):
        return copy.deepcopy(q) if how == "deepcopy" else pickle.loads(pickle.dumps(q))

    x = torch.tensor([-1.0, 0.5, 2.0])
    fresh = copied(QuantizeDequantize((), 8, False))
    assert not fresh.is_initialized()
    with pytest.raises(UninitializedQuantizerError):
        fresh(x)
    half = QuantizeDequantize((), 8, False)
    half.min = torch.nn.Parameter(torch.tensor(-1.0))
    assert not copied(half).is_initialized()
    done = QuantizeDequantize((), 8, False)
    done.set_range(-1.0, 3.0)
    again = copied(done)
    assert again.is_initialized() and torch.equal(again(x), done(x))
    fresh.set_range(-1.0, 3.0)
    assert fresh.is_initialized() and torch.equal(fresh(x), done(x))
    old = done.__getstate__()  # as a quantizer pickled before the names were kept held it: it loads initialized
    old["_uninit_markers"] = {"min": (1, 0), "max": (2, 0)}
    back = QuantizeDequantize.__new__(QuantizeDequantize)
    back.__setstate__(old)
    assert back.is_initialized() and torch.equal(back(x), done(x))


def test_quantizers_build_under_inference_mode():
    """("Inference tensors do not track version counter": the uninitialized mark read the parameters' version)"""
    x = torch.tensor([-1.0, 0.5, 2.0])
    with torch.inference_mode():
        q = QuantizeDequantize((), 8, False)
        assert not q.is_initialized()
        with q.compute_encodings():
            q(x)
        assert q.is_initialized()
    assert q.get_offset().item() == -85


@pytest.mark.parametrize("kind", ["fake-quant", "quantize", "fp8"])
@pytest.mark.parametrize("shape", [(), (8,)], ids=["per_tensor", "per_channel"])
def test_an_empty_batch_while_calibrating_learns_nothing(shape, kind):
    """(torch's "cannot compute aminmax over an empty dimension": a user's expert that no token reached)"""
    from qtool.quant.quantizer import FloatQuantizeDequantize

    def make():
        return {"fake-quant": lambda: QuantizeDequantize(shape, 8, False), "quantize": lambda: Quantize(shape, 8, False),
                "fp8": lambda: FloatQuantizeDequantize(shape, "fp8_e4m3")}[kind]()

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    ref, q = make(), make()
    with ref.compute_encodings():
        ref(x)
    with q.compute_encodings():
        assert q(torch.empty(0, 8)).shape == (0, 8)
        q.observe(torch.empty(0, 8))
        q(x)
        q(torch.empty(0, 8))
    assert torch.equal(q.min, ref.min) and torch.equal(q.max, ref.max)
    empty = make()
    with empty.compute_encodings():
        empty(torch.empty(0, 8))
    assert not empty.is_initialized()


def test_compute_encodings_with_no_data_leaves_uninitialized():
    q = QuantizeDequantize((), 8, False)
    with q.compute_encodings():
        pass
    assert not q.is_initialized()


def test_compute_encodings_aborted_by_error_sets_nothing():
    q = QuantizeDequantize((), 8, False)
    with pytest.raises(KeyError):
        with q.compute_encodings():
            q(torch.randn(10))
            raise KeyError("boom")
    assert not q.is_initialized()


def test_gradients_reach_input_and_range():
    q = QuantizeDequantize((), 8, False)
    q.set_range(-1.0, 1.0)
    x = torch.tensor([-2.0, -0.5, 0.0, 0.3, 0.9, 5.0], requires_grad=True)
    out = q(x)
    out.sum().backward()
    # straight-through inside the range, zero outside
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert q.min.grad is not None and q.max.grad is not None
    # clipped values pull the range outward: d(out)/d(max) > 0 from the element clipped at the top
    assert q.max.grad.item() > 0


def test_gradient_to_min_max_is_exact_for_clipped_values():
    q = QuantizeDequantize((), 8, True)
    q.set_range(-1.0, 1.0)
    x = torch.tensor([10.0])
    q(x).sum().backward()
    # symmetric 8-bit: out = qmax * scale, scale = (max - min) / 255 -> d/dmax = 127/255, d/dmin = -127/255
    assert q.max.grad.item() == pytest.approx(127 / 255)
    assert q.min.grad.item() == pytest.approx(-127 / 255)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    torch.manual_seed(0)
    x32 = torch.randn(16, 64)
    x = x32.to(dtype)
    q = QuantizeDequantize((16, 1), 8, True)
    with q.compute_encodings():
        q(x)
    assert q.min.dtype == torch.float32
    out = q(x)
    assert out.dtype == dtype
    # codes are computed in float32 from the (already rounded) half input
    ref = quantize_dequantize(x.float(), q.get_scale(), q.get_offset(), 8, True)
    assert torch.equal(out.as_subclass(torch.Tensor), ref.to(dtype))


def test_a_float16_result_past_float16s_range_saturates():
    """An asymmetric grid's rounded offset put its top point at 65609.9, past float16's 65504: the float16 result
    was inf (a 4-bit per-channel grid made every value but the minimum inf)."""
    x = torch.tensor([-887.0, 0.0, 65504.0], dtype=torch.float16)
    q = QuantizeDequantize((), 8, False)
    with q.compute_encodings():
        q(x)
    with torch.no_grad():
        assert float(q(x.float()).as_subclass(torch.Tensor)[2]) > 65504  # the grid's top point, in float32
        out = q(x).as_subclass(torch.Tensor)
    assert out.dtype == torch.float16 and torch.isfinite(out).all() and float(out[2]) == 65504.0
    w = torch.full((2, 4), 65504.0, dtype=torch.float16)
    w[:, 0] = -100
    qs = QuantizeDequantize((2, 1), 4, False)
    with qs.compute_encodings():
        qs(w)
    with torch.no_grad():
        assert torch.isfinite(qs(w).as_subclass(torch.Tensor)).all()
    from qtool.quant.floatgrid import dynamic_float_scales, element_of, float_quantize_dequantize

    block = torch.tensor([[65504.0, 60000.0, 1000.0, -65504.0] * 8], dtype=torch.float16)
    for element in ("fp4_e2m1", "fp8_e4m3"):  # (an MX block's power-of-two scale puts the top past 65504 too)
        eff, bs = dynamic_float_scales(block, element_of(element), "e8m0", "per_block", 32)
        out = float_quantize_dequantize(block, eff, element_of(element), bs)
        assert torch.isfinite(out).all() and float(out.abs().max()) == 65504.0, (element, out)
    half = quantize_dequantize(x, q.get_scale(), q.get_offset(), 8, False)
    assert torch.equal(half, quantize_dequantize(x.float(), q.get_scale(), q.get_offset(), 8, False).clamp(
        -65504, 65504).half())


def test_tensor_subclasses_keep_encoding_only_where_meaning_is_kept():
    q = QuantizeDequantize((), 8, False)
    q.set_range(-1.0, 3.0)
    with torch.no_grad():
        d = q(torch.linspace(-1, 3, 9))
    assert isinstance(d, DequantizedTensor)
    assert d.dequantize() is d
    qt = d.quantize()
    assert isinstance(qt, QuantizedTensor) and qt.quantize() is qt
    assert torch.equal(qt.dequantize().as_subclass(torch.Tensor), d.as_subclass(torch.Tensor))
    for same in (d.clone(), d.detach(), torch.clone(d), d.to(torch.float32), d.float(), d.double()):
        assert isinstance(same, DequantizedTensor) and same.encoding is not None
    # (a move by name as by .to: .double() dropped what .to(torch.float64) kept; a narrowing one drops it alike)
    assert isinstance(qt.double(), QuantizedTensor) and qt.double().encoding is not None
    assert type(d.half()) is type(d.to(torch.float16))
    assert type(d + 1) is torch.Tensor
    assert type(d * 2) is torch.Tensor
    assert qt.quantized_repr().dtype == torch.uint8
    scale = torch.tensor(4 / 255, dtype=torch.float32)
    expect = torch.clamp(torch.round(torch.linspace(-1, 3, 9) / scale) + 64, 0, 255)
    assert qt.quantized_repr().tolist() == expect.to(torch.uint8).tolist()
    assert qt.quantized_repr().tolist()[:5] == [0, 32, 64, 96, 128]


def test_quantized_repr_uses_wider_dtype_above_8_bits():
    q = Quantize((), 12, True)
    q.set_range(-1.0, 1.0)
    with torch.no_grad():
        r = q(torch.tensor([-5.0, 5.0])).quantized_repr()  # clipped to the grid ends
    assert r.dtype == torch.int16
    assert r.tolist() == [-2048, 2047]
    assert AffineEncoding(torch.tensor(1.0), torch.tensor(0.0), 0, 65535, False).int_dtype() == torch.int32


def test_scale_is_never_expanded_for_blocks():
    """Blockwise math must run on a view; the encoding tensors stay (out, in/B)."""
    x = torch.randn(64, 256)
    scale = torch.rand(64, 8) + 0.1
    out = quantize_dequantize(x, scale, torch.zeros(64, 8), 4, True, block_size=(1, 32))
    assert out.shape == x.shape
    blocks = x.reshape(64, 8, 32)
    manual = (torch.clamp(torch.round(blocks / scale[..., None]), -8, 7) * scale[..., None]).reshape(64, 256)
    assert torch.equal(out, manual)


def test_dequantize_accepts_integer_codes():
    q = torch.tensor([0, 128, 255], dtype=torch.uint8)
    out = dequantize(q, torch.tensor(0.5), torch.tensor(-128.0))
    assert out.dtype == torch.float32
    assert out.tolist() == [-64.0, 0.0, 63.5]


class _Attention(torch.nn.Module):
    """q, k and v read one tensor (as a transformer's projections do); o reads another."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        return self.o(self.q(x) * self.k(x) + self.v(x))


def _calibrated_attention(batches, share: bool, monkeypatch):
    import qtool.quant.quantizer as quantizer_module
    from qtool.calibration.in_memory import calibrate
    from qtool.config import parse_recipe, resolve_plan
    from qtool.data import Batch, CalibrationData
    from qtool.model.insert import insert_quantizers

    if not share:
        monkeypatch.setattr(quantizer_module._LastCalibrationCall, "matching", lambda self, x, key: None)
    model = _Attention().eval()
    recipe = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 8, symmetric: true}\n"
                          "  activations: {bitwidth: 8, symmetric: false, inputs: true, outputs: false}\n")
    plan = resolve_plan(recipe, model)
    qs = insert_quantizers(model, plan)
    data = CalibrationData([Batch(args=(b,)) for b in batches], [], sum(len(b) for b in batches), "random")
    calibrate(model, plan, qs, data, torch.device("cpu"))
    monkeypatch.undo()
    return model, qs


def test_quantizers_reading_one_tensor_share_a_calibration_call_with_the_same_bits(monkeypatch):
    """k and v take q's statistics and fake-quant output for the tensor all three read (one range and one QDQ
    pass instead of three): the ranges, and what the calibrated model computes, are bit-equal to each quantizer
    computing its own; o, reading another tensor, still computes its own."""
    import qtool.quant.quantizer as quantizer_module

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 16, generator=g) * (i + 1) - i for i in range(4)]  # each batch a different range
    taken = []
    matching = quantizer_module._LastCalibrationCall.matching

    def counted(self, x, key):
        call = matching(self, x, key)
        taken.append(call is not None)
        return call

    monkeypatch.setattr(quantizer_module._LastCalibrationCall, "matching", counted)
    shared, shared_qs = _calibrated_attention(batches, True, monkeypatch)
    assert sum(taken) == 2 * len(batches) and len(taken) == 4 * len(batches)  # k and v took q's call each batch
    alone, alone_qs = _calibrated_attention(batches, False, monkeypatch)
    for name, q in alone_qs.items():
        assert torch.equal(q.min, shared_qs[name].min) and torch.equal(q.max, shared_qs[name].max), name
    x = torch.randn(5, 16, generator=g)
    with torch.no_grad():
        assert torch.equal(shared(x), alone(x))
    assert quantizer_module._last_call.call is None  # nothing held once calibration is over


def test_a_shared_calibration_call_is_taken_only_for_the_same_unchanged_tensor_and_settings():
    from qtool.quant.quantizer import _last_call

    def q(bits=8, symmetric=False, shape=()):
        return QuantizeDequantize(shape, bits, symmetric)

    a, b, c, d, e, f = q(), q(), q(bits=4), q(symmetric=True), q(), q()
    x = torch.linspace(-1, 1, 64)
    with torch.no_grad(), a.compute_encodings(), b.compute_encodings(), c.compute_encodings(), \
            d.compute_encodings(), e.compute_encodings(), f.compute_encodings():
        a(x, output_read_only=True)
        x.mul_(3)  # in place after a read it: b must see the new values
        b(x, output_read_only=True)
        assert c(x, output_read_only=True) is not None and _last_call.call.key[0] == 4  # other settings: its own
        d(x, output_read_only=True)  # symmetric: its own range
        out = e(x, output_read_only=True)
        out.add_(1)  # its output written in place: f computes its own
        f(x, output_read_only=True)
        del x, out  # the slot lets go of the call once the tensor it read is gone
        assert _last_call.call is None
    assert a.max.item() == pytest.approx(1.0) and b.max.item() == pytest.approx(3.0)
    assert c.max.item() == pytest.approx(3.0) and d.min.item() == pytest.approx(-3.0 * 128 / 127)
    assert e.max.item() == pytest.approx(3.0) and f.max.item() == pytest.approx(3.0)


def test_a_calibration_call_is_shared_only_when_asked_and_not_under_inference_mode():
    from qtool.quant.quantizer import _last_call

    x = torch.randn(32, generator=torch.Generator().manual_seed(0))
    a, b = QuantizeDequantize((), 8, False), QuantizeDequantize((), 8, False)
    with torch.no_grad(), a.compute_encodings(), b.compute_encodings():
        wa, wb = a(x), b(x)  # not asked: each its own output
        assert _last_call.call is None and wa.data_ptr() != wb.data_ptr()
        wa, wb = a(x, output_read_only=True), b(x, output_read_only=True)
        assert wa.data_ptr() == wb.data_ptr() and torch.equal(wa.encoding.scale, wb.encoding.scale)
    with torch.inference_mode():
        y = torch.randn(32)
    for context in (torch.inference_mode, torch.no_grad):  # inference tensors have no version counter
        with context(), a.compute_encodings(), b.compute_encodings():
            wa, wb = a(y, output_read_only=True), b(y, output_read_only=True)
            assert _last_call.call is None and wa.data_ptr() != wb.data_ptr()
        assert torch.equal(a.max, b.max) and a.max.item() == y.max().item()


def test_a_narrowing_cast_drops_the_encoding_its_codes_no_longer_fit():
    q = Quantize((), 16, False)
    q.set_range(torch.tensor(0.0), torch.tensor(65535.0))
    codes = q(torch.tensor([257.0, 1001.0, 65535.0, 40000.0]))
    assert codes.quantized_repr().tolist() == [257, 1001, 65535, 40000]
    for dtype in (torch.bfloat16, torch.float16):
        # bfloat16 holds 257 as 256 and 65535 as 65536: a kept encoding would give codes off the grid
        assert type(codes.to(dtype)) is torch.Tensor
    wide = codes.to(torch.float64)
    assert isinstance(wide, QuantizedTensor) and wide.quantized_repr().tolist() == [257, 1001, 65535, 40000]
    # 8-bit codes fit bfloat16; a widening cast of fake-quant values keeps them exact
    q8 = Quantize((), 8, False)
    q8.set_range(torch.tensor(0.0), torch.tensor(255.0))
    small = q8(torch.tensor([0.0, 17.0, 255.0])).to(torch.bfloat16)
    assert isinstance(small, QuantizedTensor) and small.quantized_repr().tolist() == [0, 17, 255]
    qdq = QuantizeDequantize((), 8, True)
    qdq.set_range(-1.0, 1.0)
    with torch.no_grad():
        half = qdq(torch.linspace(-1, 1, 9, dtype=torch.float16))
    assert isinstance(half.to(torch.float32), DequantizedTensor)
    assert type(qdq(torch.linspace(-1, 1, 9)).to(torch.bfloat16)) is torch.Tensor


@pytest.mark.parametrize("bitwidth", [1, 17, 64, 8.5, True])
def test_quantizer_modules_take_the_recipe_bitwidths_only(bitwidth):
    # 1-bit symmetric calibrated to a NaN range (no positive step); 64-bit asymmetric overflowed
    with pytest.raises(ValueError, match="bitwidth must be an integer from 2 to 16"):
        QuantizeDequantize((), bitwidth, True)
    with pytest.raises(ValueError, match="bitwidth must be an integer from 2 to 16"):
        DynamicQuantizeDequantize(bitwidth, False, True)


def test_a_float16_grid_whose_minimum_float16_cannot_hold_is_an_unrepresentable_scale():
    from qtool.quant.affine import UnrepresentableScale

    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -66265.0, 5.0
    q = QuantizeDequantize((1, 1), 2, False, block_size=(1, 32), scale_dtype="float16")
    # (calibration turns this class into the "range too large for this grid" error naming the weight)
    with pytest.raises(UnrepresentableScale, match="no float16 scale"), torch.no_grad(), q.compute_encodings():
        q.encoding_analyzer.update_stats(w)
