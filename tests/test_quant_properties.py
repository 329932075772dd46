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
