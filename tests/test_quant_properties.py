"""Property tests of the affine math (hypothesis)."""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qtool.quant import (
    adjust_min_max,
    dequantize,
    dequantize_affine,
    min_max_to_scale_offset,
    quantize,
    quantize_affine,
    quantize_dequantize,
    reduce_to_shape,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def tensors_and_encoding(draw):
    n = draw(st.integers(1, 64))
    values = draw(st.lists(finite, min_size=n, max_size=n))
    x = torch.tensor(values, dtype=torch.float32)
    bitwidth = draw(st.integers(2, 16))
    symmetric = draw(st.booleans())
    qmin, qmax = (-(2 ** (bitwidth - 1)), 2 ** (bitwidth - 1) - 1) if symmetric else (0, 2**bitwidth - 1)
    mn, mx = adjust_min_max(x.min(), x.max(), qmax - qmin, symmetric)
    scale, offset = min_max_to_scale_offset(mn, mx, qmin, qmax, symmetric)
    return x, scale, offset, qmin, qmax


@SETTINGS
@given(tensors_and_encoding())
def test_round_trip_error_is_at_most_half_a_step_inside_the_range(case):
    x, scale, offset, qmin, qmax = case
    lo, hi = (offset + qmin) * scale, (offset + qmax) * scale
    inside = (x >= lo) & (x <= hi)
    err = (dequantize(quantize(x, scale, offset, qmin=qmin, qmax=qmax), scale, offset) - x).abs()
    # half a step, plus float32 rounding of the two products
    tol = scale / 2 + 4 * torch.finfo(torch.float32).eps * torch.maximum(x.abs(), hi.abs())
    assert bool((err <= tol)[inside].all())


@SETTINGS
@given(tensors_and_encoding())
def test_codes_stay_on_the_grid_and_qdq_is_idempotent(case):
    x, scale, offset, qmin, qmax = case
    q = quantize(x, scale, offset, qmin=qmin, qmax=qmax)
    assert bool((q >= qmin).all() and (q <= qmax).all())
    assert torch.equal(q, torch.round(q))
    once = quantize_dequantize(x, scale, offset, qmin=qmin, qmax=qmax)
    twice = quantize_dequantize(once, scale, offset, qmin=qmin, qmax=qmax)
    assert torch.equal(quantize(once, scale, offset, qmin=qmin, qmax=qmax), q)
    assert torch.allclose(twice, once, rtol=0, atol=float(scale) * 1e-3)


@SETTINGS
@given(tensors_and_encoding())
def test_quantize_is_monotonic(case):
    x, scale, offset, qmin, qmax = case
    xs, _ = torch.sort(x)
    q = quantize(xs, scale, offset, qmin=qmin, qmax=qmax)
    assert bool((q[1:] >= q[:-1]).all())


@SETTINGS
@given(tensors_and_encoding())
def test_range_contains_zero_and_zero_is_exact(case):
    x, scale, offset, qmin, qmax = case
    assert float((offset + qmin) * scale) <= 0.0 <= float((offset + qmax) * scale)
    zero = torch.zeros(1)
    assert float(quantize_dequantize(zero, scale, offset, qmin=qmin, qmax=qmax)) == 0.0


@st.composite
def blocked_case(draw):
    rows = draw(st.integers(1, 6))
    nblocks = draw(st.integers(1, 5))
    block = draw(st.sampled_from([1, 2, 4, 8, 16]))
    x = torch.tensor(
        draw(st.lists(finite, min_size=rows * nblocks * block, max_size=rows * nblocks * block)), dtype=torch.float32
    ).reshape(rows, nblocks * block)
    bitwidth = draw(st.sampled_from([4, 8]))
    symmetric = draw(st.booleans())
    return x, block, bitwidth, symmetric


@SETTINGS
@given(blocked_case())
def test_aimet_block_form_equals_torchao_block_form(case):
    x, block, bitwidth, symmetric = case
    rows, cols = x.shape
    qmin, qmax = (-(2 ** (bitwidth - 1)), 2 ** (bitwidth - 1) - 1) if symmetric else (0, 2**bitwidth - 1)
    shape = (rows, cols // block)
    smin, smax = reduce_to_shape(x, shape, (1, block))
    mn, mx = adjust_min_max(smin, smax, qmax - qmin, symmetric)
    scale, offset = min_max_to_scale_offset(mn, mx, qmin, qmax, symmetric)
    aimet = quantize(x, scale, offset, qmin=qmin, qmax=qmax, block_size=(1, block))
    # torchao's INT domain multiplies by the reciprocal; feed it a power-of-two-free comparison via its own
    # formula on the same blocks and compare with the reciprocal-path AIMET form computed by hand
    ao = quantize_affine(x, (1, block), scale, -offset, torch.int32, qmin, qmax)
    blocks = x.reshape(rows, cols // block, block)
    by_hand = torch.clamp(torch.round(blocks * (1.0 / scale[..., None])) - offset[..., None], qmin, qmax)
    assert torch.equal(ao, by_hand.reshape(rows, cols).to(torch.int32))
    # the two forms differ exactly where division and reciprocal-multiply round differently (near ties), by one
    by_div = torch.clamp(torch.round(blocks / scale[..., None]) - offset[..., None], qmin, qmax)
    assert torch.equal(aimet, by_div.reshape(rows, cols))
    differ = aimet.to(torch.int32) != ao
    rounding_differs = (by_div != by_hand).reshape(rows, cols)
    assert torch.equal(differ, rounding_differs)
    assert bool(((aimet.to(torch.int32) - ao).abs() <= 1).all())
    # and dequantization is identical block for block
    assert torch.equal(
        dequantize(ao.float(), scale, offset, block_size=(1, block)),
        dequantize_affine(ao, (1, block), scale, -offset, torch.int32, qmin, qmax),
    )


@SETTINGS
@given(blocked_case())
def test_blockwise_equals_per_channel_on_each_block(case):
    x, block, bitwidth, symmetric = case
    rows, cols = x.shape
    qmin, qmax = (-(2 ** (bitwidth - 1)), 2 ** (bitwidth - 1) - 1) if symmetric else (0, 2**bitwidth - 1)
    shape = (rows, cols // block)
    scale, offset = min_max_to_scale_offset(
        *adjust_min_max(*reduce_to_shape(x, shape, (1, block)), qmax - qmin, symmetric), qmin, qmax, symmetric
    )
    whole = quantize(x, scale, offset, qmin=qmin, qmax=qmax, block_size=(1, block))
    for j in range(cols // block):
        part = x[:, j * block:(j + 1) * block]
        per_ch = quantize(part, scale[:, j:j + 1], offset[:, j:j + 1], qmin=qmin, qmax=qmax)
        assert torch.equal(whole[:, j * block:(j + 1) * block], per_ch)


def test_torchao_float_domain_formula():
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    scale = torch.rand(4, 2) + 0.05
    zp = torch.randn(4, 2)
    q = quantize_affine(x, (1, 32), scale, zp, torch.int32, 0, 15, zero_point_domain="float")
    mid = (15 + 0 + 1) / 2
    s, z = scale.repeat_interleave(32, 1), zp.repeat_interleave(32, 1)
    expect = torch.clamp(torch.round((x - (z - s * mid)) / s), 0, 15).to(torch.int32)
    assert torch.equal(q, expect)
    dq = dequantize_affine(q, (1, 32), scale, zp, torch.int32, 0, 15, zero_point_domain="float")
    assert torch.equal(dq, (q.float() - mid) * s + z)


def test_torchao_defaults_to_dtype_range_and_per_tensor_block():
    x = torch.tensor([[-300.0, 0.4, 300.0]])
    q = quantize_affine(x, x.shape, torch.tensor([1.0]), torch.tensor([0]), torch.int8)
    assert q.dtype == torch.int8 and q.tolist() == [[-128, 0, 127]]
    assert math.isclose(float(dequantize_affine(q, x.shape, torch.tensor([1.0]), torch.tensor([0]), torch.int8)[0, 0]),
                        -128.0)


# --------------------------------------------------------------------------------------------------------------
# scale_offset_of_numbers: the per-tensor calibration range as numbers, bit for bit the tensor functions
# --------------------------------------------------------------------------------------------------------------
_F32 = torch.finfo(torch.float32)
_SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, -1e-45, _F32.tiny, -_F32.tiny, _F32.eps, -_F32.eps,
            1e-7, 3.3e-6, 1e-5, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0, 7.7e-3, 123.456, -65504.0, 1e38, -1e38,
            _F32.max, -_F32.max]


def _bits(v) -> bytes:
    import struct

    return struct.pack("<f", float(v))


def _tensor_scale_offset(lo: float, hi: float, qmin: int, qmax: int, symmetric: bool):
    mn, mx = adjust_min_max(torch.tensor(lo, dtype=torch.float32), torch.tensor(hi, dtype=torch.float32),
                            qmax - qmin, symmetric)
    return min_max_to_scale_offset(mn, mx, qmin, qmax, symmetric)


def _grid(bitwidth: int, symmetric: bool):
    return (-(2 ** (bitwidth - 1)), 2 ** (bitwidth - 1) - 1) if symmetric else (0, 2**bitwidth - 1)


def _assert_same_bits(lo, hi, bitwidth, symmetric):
    from qtool.quant.affine import scale_offset_of_numbers

    qmin, qmax = _grid(bitwidth, symmetric)
    scale, offset = _tensor_scale_offset(lo, hi, qmin, qmax, symmetric)
    s, o = scale_offset_of_numbers(lo, hi, qmin, qmax, symmetric)
    assert (_bits(s), _bits(o)) == (_bits(scale.item()), _bits(offset.item())), (lo, hi, bitwidth, symmetric)


def test_range_as_numbers_equals_the_tensor_functions_on_every_class_of_value():
    """Every pair of special float32 values (signed zeros, subnormals, the smallest normal and epsilon, around
    the minimum scale, infinities, NaN, float32's largest) as a batch's min and max, on 2-, 3- (the symmetric grid
    that divides by pos + 1), 4-, 8- and 16-bit grids, both symmetries: the same bits."""
    for bitwidth in (2, 3, 4, 8, 16):
        for symmetric in (False, True):
            for lo in _SPECIAL:
                for hi in _SPECIAL:
                    if lo == lo and hi == hi:
                        _assert_same_bits(lo, hi, bitwidth, symmetric)


def test_range_as_numbers_equals_the_tensor_functions_at_the_minimum_scale():
    """Where a range just reaches n steps of the minimum scale (FLOAT32_EPS), the degenerate-range widening starts
    or stops: ranges a few float32 steps either side of it, from zero and from just below, on every grid."""
    import numpy as np

    from qtool.quant.affine import FLOAT32_EPS

    for bitwidth in range(2, 17):
        for symmetric in (False, True):
            qmin, qmax = _grid(bitwidth, symmetric)
            edge = np.float32(qmax - qmin) * np.float32(FLOAT32_EPS)
            for lo in (np.float32(0.0), np.float32(-0.0), -edge / np.float32(3), -edge):
                for k in range(-4, 5):
                    hi = edge + lo + np.float32(k) * np.spacing(edge)
                    _assert_same_bits(float(lo), float(hi), bitwidth, symmetric)


@settings(max_examples=400, deadline=None)
@given(st.floats(width=32, allow_nan=False), st.floats(width=32, allow_nan=False), st.integers(2, 16),
       st.booleans())
def test_range_as_numbers_equals_the_tensor_functions(lo, hi, bitwidth, symmetric):
    _assert_same_bits(lo, hi, bitwidth, symmetric)


def test_range_as_numbers_refuses_what_it_does_not_reproduce():
    import pytest

    from qtool.quant.affine import scale_offset_of_numbers

    with pytest.raises(ValueError, match="65536 steps"):
        scale_offset_of_numbers(-1.0, 1.0, 0, 65536, False)
    with pytest.raises(ValueError, match="1 steps"):  # a 1-bit grid
        scale_offset_of_numbers(-1.0, 1.0, -1, 0, True)
    with pytest.raises(ValueError, match="NaN"):
        scale_offset_of_numbers(math.nan, 1.0, 0, 255, False)


@SETTINGS
@given(st.lists(st.sampled_from(_SPECIAL) | finite, min_size=1, max_size=24),
       st.integers(2, 16), st.booleans())
def test_per_tensor_calibration_calls_give_the_bits_of_the_tensor_path(values, bitwidth, symmetric):
    """A per-tensor quantizer calibrating on the CPU works its range out as numbers; its outputs and calibrated
    range equal those of the same calls through the tensor functions, bit for bit (NaN and infinities included,
    which the pipeline refuses before calibration but a library user may feed)."""
    from qtool.quant import QuantizeDequantize

    batches = [torch.tensor(values, dtype=torch.float32), torch.tensor(values[::-1], dtype=torch.float32) * 0.5]
    results = []
    for numbers in (True, False):
        q = QuantizeDequantize((), bitwidth, symmetric)
        if not numbers:
            q._min_max_numbers = lambda x: False
        with torch.no_grad(), q.compute_encodings():
            outs = [q(b).as_subclass(torch.Tensor) for b in batches]
        results.append((outs, q.min.detach().clone(), q.max.detach().clone()))
    (a_outs, a_min, a_max), (b_outs, b_min, b_max) = results
    for a, b in zip(a_outs, b_outs):
        assert a.view(torch.int32).equal(b.view(torch.int32))
    assert a_min.view(torch.int32).equal(b_min.view(torch.int32)) and a_max.view(torch.int32).equal(
        b_max.view(torch.int32))


# --------------------------------------------------------------------------------------------------------------
# the per-batch encoding and the fake-quant in fewer tensor operations (GPU kernel launches, #53)
# --------------------------------------------------------------------------------------------------------------
def _same_bits_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _assert_batch_encoding_is_the_two_steps(lo: torch.Tensor, hi: torch.Tensor, bitwidth: int, symmetric: bool):
    from qtool.quant.affine import batch_scale_offset

    qmin, qmax = _grid(bitwidth, symmetric)
    want = min_max_to_scale_offset(*adjust_min_max(lo, hi, qmax - qmin, symmetric), qmin, qmax, symmetric)
    got = batch_scale_offset(lo, hi, qmin, qmax, symmetric)
    for w, g in zip(want, got):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert _same_bits_or_both_nan(w, g), (bitwidth, symmetric, lo[(w != g) & ~torch.isnan(w)][:4],
                                              hi[(w != g) & ~torch.isnan(w)][:4])


def test_batch_encoding_is_the_two_steps_on_every_class_of_value():
    """Every pair of special float32 values (NaN included) as one encoding each of a per-channel range, on every
    grid from 2 to 16 bits, both symmetries: ``batch_scale_offset`` gives the bits of ``adjust_min_max`` then
    ``min_max_to_scale_offset``, NaN where they give NaN."""
    lo = torch.tensor([a for a in _SPECIAL for _ in _SPECIAL], dtype=torch.float32)
    hi = torch.tensor([b for _ in _SPECIAL for b in _SPECIAL], dtype=torch.float32)
    for bitwidth in range(2, 17):
        for symmetric in (False, True):
            _assert_batch_encoding_is_the_two_steps(lo, hi, bitwidth, symmetric)
            _assert_batch_encoding_is_the_two_steps(lo[17], hi[17], bitwidth, symmetric)  # 0-dim: per tensor


def test_batch_encoding_is_the_two_steps_at_the_minimum_scale():
    """Around the degenerate-range widening's edge (n steps of FLOAT32_EPS), where its ``add(alpha=)`` acts."""
    import numpy as np

    from qtool.quant.affine import FLOAT32_EPS

    for bitwidth in range(2, 17):
        for symmetric in (False, True):
            qmin, qmax = _grid(bitwidth, symmetric)
            edge = np.float32(qmax - qmin) * np.float32(FLOAT32_EPS)
            pairs = [(lo, edge + lo + np.float32(k) * np.spacing(edge))
                     for lo in (np.float32(0.0), np.float32(-0.0), -edge / np.float32(3), -edge) for k in range(-4, 5)]
            _assert_batch_encoding_is_the_two_steps(torch.tensor([float(a) for a, _ in pairs]),
                                                    torch.tensor([float(b) for _, b in pairs]), bitwidth, symmetric)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(width=32), st.floats(width=32)), min_size=1, max_size=16), st.integers(2, 16),
       st.booleans())
def test_batch_encoding_is_the_two_steps(pairs, bitwidth, symmetric):
    _assert_batch_encoding_is_the_two_steps(torch.tensor([a for a, _ in pairs], dtype=torch.float32),
                                            torch.tensor([b for _, b in pairs], dtype=torch.float32),
                                            bitwidth, symmetric)


def _six_pass_qdq(x, scale, offset, qmin, qmax):
    q = torch.clamp(torch.round(x / scale) - offset, qmin, qmax)
    return (q + offset) * scale


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_SPECIAL) | st.floats(width=32), min_size=1, max_size=32),
       st.lists(st.floats(0.0, exclude_min=True, allow_infinity=False, width=32)
                | st.sampled_from([_F32.eps, _F32.tiny, 1e-40, 0.01, 0.5]),
                min_size=3, max_size=3),
       st.integers(2, 16), st.booleans(), st.data())
def test_fake_quant_in_fewer_passes_is_the_six_pass_form(values, scales, bitwidth, symmetric, data):
    """``quantize_dequantize`` without gradients clamps to ``[qmin + offset, qmax + offset]``: the bits of
    ``(clamp(round(x / s) - o, qmin, qmax) + o) * s`` for any float32 input (NaN where that is NaN), any positive
    scale and any integer offset on the grid, with the offset as a number (one offset for the tensor on the CPU:
    five passes), as a tensor on the CPU (per channel: the six passes) and as a GPU takes it (a tensor, and four
    kernels that end in one ``addcmul``)."""
    from qtool.quant import affine

    qmin, qmax = _grid(bitwidth, symmetric)
    offsets = [float(data.draw(st.integers(-qmax, -qmin))) for _ in scales]
    x = torch.tensor(values, dtype=torch.float32).repeat(3, 1)
    s = torch.tensor(scales, dtype=torch.float32)[:, None]
    o = torch.tensor(offsets, dtype=torch.float32)[:, None]
    for i in range(3):  # one offset for the tensor: the numbers path on the CPU
        assert _same_bits_or_both_nan(_six_pass_qdq(x[i], s[i], o[i], qmin, qmax),
                                      quantize_dequantize(x[i], s[i, 0], o[i, 0], qmin=qmin, qmax=qmax))
    want = _six_pass_qdq(x, s, o, qmin, qmax)
    assert _same_bits_or_both_nan(want, quantize_dequantize(x, s, o, qmin=qmin, qmax=qmax))  # per channel
    originals = affine._uniform_offset, affine._launch_bound
    affine._uniform_offset = lambda offset: None  # as on a GPU: an offset stays a tensor, and a kernel saved counts
    affine._launch_bound = lambda device: True
    try:
        assert _same_bits_or_both_nan(want, quantize_dequantize(x, s, o, qmin=qmin, qmax=qmax))
        assert _same_bits_or_both_nan(want[0], quantize_dequantize(x[0], s[0, 0], o[0, 0], qmin=qmin, qmax=qmax))
    finally:
        affine._uniform_offset, affine._launch_bound = originals
