"""Affine quantization as pure tensor functions (AIMET semantics, see docs/numerics.md).

Conventions
-----------
* ``real = (q + offset) * scale``: AIMET's offset, i.e. ``offset = -zero_point`` in ONNX/torchao terms.
* ``quantize(x) = clamp(round(x / scale) - offset, qmin, qmax)``, round half to even, division (not a
  multiply by the reciprocal).
* Granularity is ``scale.shape`` plus an optional ``block_size`` of the same length: input element ``j`` uses
  encoding ``i`` with ``i_d = j_d // B_d``; a ``-1`` entry means ``input_dim // shape_dim``. Without
  ``block_size`` the scale must broadcast against the input (per-tensor, per-channel).

Nothing here holds state, prints or touches the host: every function works unchanged on CPU and CUDA tensors.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = [
    "FLOAT32_EPS",
    "inverse_or_zero",
    "grid",
    "resolve_grid",
    "resolve_block_size",
    "blocked_shapes",
    "reduce_to_shape",
    "quantize",
    "dequantize",
    "quantize_dequantize",
    "to_input_dtype",
    "min_max_to_scale_offset",
    "batch_scale_offset",
    "adjust_min_max",
    "snap_to_float16_scale",
    "UnrepresentableScale",
]

FLOAT32_EPS = float(torch.finfo(torch.float32).eps)  # 1.1920929e-07
_F32_MAX = float(torch.finfo(torch.float32).max)

BlockSize = Optional[Sequence[int]]


# --------------------------------------------------------------------------------------------------------------
# Integer grids
# --------------------------------------------------------------------------------------------------------------
def grid(bitwidth: int, signed: bool) -> Tuple[int, int]:
    """``(qmin, qmax)`` of the ``bitwidth``-bit grid: ``-2**(b-1)..2**(b-1)-1`` signed, ``0..2**b-1`` unsigned."""
    if not isinstance(bitwidth, int) or isinstance(bitwidth, bool) or not 1 <= bitwidth <= 64:
        raise ValueError(f"bitwidth must be an integer from 1 to 64, got {str(bitwidth)[:40]}")
    return _grid_from_steps(2**bitwidth - 1, signed)


def _grid_from_steps(num_steps: int, signed: bool) -> Tuple[int, int]:
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
    if signed:
        return -math.ceil(num_steps / 2), num_steps // 2
    return 0, num_steps


def resolve_grid(
    bitwidth: Optional[int] = None,
    signed: bool = False,
    *,
    num_steps: Optional[int] = None,
    qmin: Optional[int] = None,
    qmax: Optional[int] = None,
) -> Tuple[int, int]:
    """Turn one of AIMET's three call forms into ``(qmin, qmax)``.

    Exactly one of ``bitwidth``, ``num_steps`` or the pair ``qmin, qmax`` must be given.
    """
    given = [bitwidth is not None, num_steps is not None, qmin is not None or qmax is not None]
    if sum(given) != 1:
        raise ValueError("give exactly one of: bitwidth (with signed), num_steps (with signed), or qmin and qmax")
    if bitwidth is not None:
        return grid(bitwidth, signed)
    if num_steps is not None:
        return _grid_from_steps(num_steps, signed)
    if qmin is None or qmax is None:
        raise ValueError("qmin and qmax must be given together")
    qmin, qmax = int(qmin), int(qmax)
    if qmin >= qmax:
        raise ValueError(f"qmin must be less than qmax, got qmin={qmin}, qmax={qmax}")
    return qmin, qmax


# --------------------------------------------------------------------------------------------------------------
# Granularity: shape + block_size
# --------------------------------------------------------------------------------------------------------------
def resolve_block_size(input_shape: Sequence[int], shape: Sequence[int], block_size: BlockSize) -> Tuple[int, ...]:
    """Concrete block extent per dimension of the last ``len(shape)`` input dims (``-1`` resolved).

    With ``block_size=None`` each encoding dim must be 1 (whole dim shares it) or equal the input dim.
    Raises ``ValueError`` with the offending dimension when the shapes do not fit.
    """
    input_shape, shape = tuple(int(d) for d in input_shape), tuple(int(d) for d in shape)
    if len(shape) > len(input_shape):
        raise ValueError(f"encoding shape {shape} has more dims than the input {input_shape}")
    tail = input_shape[len(input_shape) - len(shape):]
    if block_size is None:
        out = []
        for d, (n, s) in enumerate(zip(tail, shape)):
            if s not in (1, n):
                raise ValueError(
                    f"encoding shape {shape} does not broadcast to input shape {input_shape} (dim {d}: {s} vs {n}); "
                    "pass block_size for blockwise encodings"
                )
            out.append(n if s == 1 else 1)
        return tuple(out)
    if any(isinstance(b, bool) or int(b) != b for b in block_size):  # (int() would truncate 2.5 to 2)
        raise ValueError(f"block_size entries must be whole numbers, got {tuple(block_size)}")
    block_size = tuple(int(b) for b in block_size)
    if len(block_size) != len(shape):
        raise ValueError(f"block_size {block_size} must have one entry per encoding dim {shape}")
    out = []
    for d, (n, s, b) in enumerate(zip(tail, shape, block_size)):
        if b == -1:
            if s <= 0 or n % s:
                raise ValueError(f"input dim {d} of size {n} cannot be split into {s} blocks (block_size -1)")
            b = n // s
        if b <= 0:
            raise ValueError(f"block_size entries must be positive or -1, got {block_size}")
        if n % b:
            raise ValueError(f"block size {b} does not divide input dim {d} of size {n} (input shape {input_shape})")
        if n // b != s:
            raise ValueError(
                f"block size {b} on input dim {d} of size {n} gives {n // b} blocks, but the encoding shape has {s}"
            )
        out.append(b)
    return tuple(out)


def blocked_shapes(input_shape: Sequence[int], shape: Sequence[int], block_size: BlockSize):
    """Shapes that expose blocks as their own dims without copying.

    Returns ``(x_view_shape, enc_view_shape, reduce_dims)``: the input reshaped to
    ``(*lead, s0, B0, s1, B1, ...)``, the encoding reshaped to ``(s0, 1, s1, 1, ...)`` (broadcastable, never
    expanded), and the dims to reduce to go from the input view to the encoding view (leading dims included).
    """
    blocks = resolve_block_size(input_shape, shape, block_size)
    shape = tuple(int(d) for d in shape)
    lead = tuple(int(d) for d in input_shape[: len(input_shape) - len(shape)])
    x_view, enc_view = list(lead), []
    for s, b in zip(shape, blocks):
        x_view += [s, b]
        enc_view += [s, 1]
    reduce_dims = tuple(range(len(lead))) + tuple(len(lead) + 2 * i + 1 for i in range(len(shape)))
    return tuple(x_view), tuple(enc_view), reduce_dims


def reduce_to_shape(x: torch.Tensor, shape: Sequence[int], block_size: BlockSize = None):
    """Elementwise ``(min, max)`` of ``x`` reduced to the encoding ``shape`` (blocks and leading dims folded)."""
    x_view, _, reduce_dims = blocked_shapes(x.shape, shape, block_size)
    xv = x.reshape(x_view)
    if not reduce_dims:
        return xv.reshape(tuple(shape)).clone(), xv.reshape(tuple(shape)).clone()
    if len(reduce_dims) == xv.dim():
        mn, mx = torch.aminmax(xv)
        return mn.reshape(tuple(shape)), mx.reshape(tuple(shape))
    return xv.amin(dim=reduce_dims).reshape(tuple(shape)), xv.amax(dim=reduce_dims).reshape(tuple(shape))


def _apply_blocked(fn, x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, block_size: BlockSize):
    """Run ``fn(x, scale, offset)`` with scale/offset broadcast per block; the result has ``x``'s shape."""
    if block_size is None:
        return fn(x, scale, offset)
    shape = tuple(scale.shape)
    x_view, enc_view, _ = blocked_shapes(x.shape, shape, block_size)
    offset = offset.expand(shape) if offset.dim() < len(shape) else offset
    out = fn(x.reshape(x_view), scale.reshape(enc_view), offset.reshape(enc_view))
    return out.reshape(x.shape)


def _check_scale_offset(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, block_size: BlockSize):
    if not isinstance(scale, torch.Tensor):
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if not isinstance(offset, torch.Tensor):
        offset = torch.as_tensor(offset, dtype=torch.float32, device=x.device)
    if offset.numel() != 1 and tuple(offset.shape) != tuple(scale.shape):
        raise ValueError(f"offset shape {tuple(offset.shape)} must equal scale shape {tuple(scale.shape)}")
    if block_size is None:
        resolve_block_size(x.shape, scale.shape, None)  # raises on a shape that does not broadcast
    return scale, offset


# --------------------------------------------------------------------------------------------------------------
# quantize / dequantize / quantize_dequantize
# --------------------------------------------------------------------------------------------------------------
def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _quantize_raw(x, scale, offset, qmin, qmax):
    dt = _compute_dtype(x)
    q = torch.round(x.to(dt) / scale.to(dt))
    return q.sub_(offset.to(dt)).clamp_(qmin, qmax)


def _dequantize_raw(q, scale, offset):
    dt = _compute_dtype(q) if q.is_floating_point() else torch.float32
    return (q.to(dt) + offset.to(dt)) * scale.to(dt)


class _RoundSTE(torch.autograd.Function):
    """Round half to even forward, identity backward (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def round_ste(x: torch.Tensor) -> torch.Tensor:
    if not (torch.is_grad_enabled() and x.requires_grad):
        return torch.round(x)  # the same values; no autograd node (and nothing for a tracer to step into)
    return _RoundSTE.apply(x)


def _quantize_ste(x, scale, offset, qmin, qmax):
    """Differentiable quantize: STE through round; clamp passes gradient only inside the grid."""
    dt = _compute_dtype(x)
    return torch.clamp(round_ste(x.to(dt) / scale.to(dt)) - offset.to(dt), qmin, qmax)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def quantize(
    tensor: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bitwidth: Optional[int] = None,
    signed: bool = False,
    block_size: BlockSize = None,
    *,
    num_steps: Optional[int] = None,
    qmin: Optional[int] = None,
    qmax: Optional[int] = None,
) -> torch.Tensor:
    """Integer codes ``clamp(round(x / scale) - offset, qmin, qmax)`` as a float tensor (float32 math).

    Call forms (as in AIMET): ``quantize(x, scale, offset, bitwidth, signed=False)``,
    ``quantize(x, scale, offset, num_steps=N, signed=False)``, ``quantize(x, scale, offset, qmin=A, qmax=B)``.
    ``block_size`` selects blockwise granularity (see module docs).
    """
    qmin, qmax = resolve_grid(bitwidth, signed, num_steps=num_steps, qmin=qmin, qmax=qmax)
    scale, offset = _check_scale_offset(tensor, scale, offset, block_size)
    fn = _quantize_ste if _needs_grad(tensor, scale, offset) else _quantize_raw
    return _apply_blocked(lambda x, s, o: fn(x, s, o, qmin, qmax), tensor, scale, offset, block_size)


def dequantize(
    tensor: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, block_size: BlockSize = None
) -> torch.Tensor:
    """Real values ``(q + offset) * scale`` (float32 unless the codes are float64)."""
    scale, offset = _check_scale_offset(tensor, scale, offset, block_size)
    return _apply_blocked(_dequantize_raw, tensor, scale, offset, block_size)


def quantize_dequantize(
    tensor: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bitwidth: Optional[int] = None,
    signed: bool = False,
    block_size: BlockSize = None,
    *,
    num_steps: Optional[int] = None,
    qmin: Optional[int] = None,
    qmax: Optional[int] = None,
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in one pass, returned in the input's dtype (saturated to its finite range).

    Differentiable: straight-through for the input inside the grid, and exact autograd through scale and
    offset (and so through a quantizer's min/max). Without gradients the bits are those of
    ``(clamp(round(x / scale) - offset, qmin, qmax) + offset) * scale`` for integer offsets and positive scales
    (AIMET's, and all qtool makes), in fewer passes; a fractional offset may come out one float32 step apart from
    that form where one offset serves the whole tensor on the CPU, or on a GPU.
    """
    qmin, qmax = resolve_grid(bitwidth, signed, num_steps=num_steps, qmin=qmin, qmax=qmax)
    scale, offset = _check_scale_offset(tensor, scale, offset, block_size)
    out_dtype = tensor.dtype if tensor.is_floating_point() else torch.float32

    if _needs_grad(tensor, scale, offset):
        def fn(x, s, o):
            return (_quantize_ste(x, s, o, qmin, qmax) + o) * s
    else:
        def fn(x, s, o):
            lo = _uniform_offset(o)
            if lo is not None:  # one offset for the tensor, on the CPU: a number
                return _qdq_clamped(x, s, qmin + lo, qmax + lo)
            if not _launch_bound(x.device) or torch.jit.is_tracing():  # (an exported graph holds these six passes)
                q = _quantize_raw(x, s, o, qmin, qmax)
                return q.add_(o.to(q.dtype)).mul_(s.to(q.dtype))
            o = o.to(_compute_dtype(x))  # the clamp's ends as tensors: exact sums (integer offsets)
            return _qdq_clamped(x, s, o if qmin == 0 else o + qmin, o + qmax)

    return to_input_dtype(_apply_blocked(fn, tensor, scale, offset, block_size), out_dtype)


def to_input_dtype(result: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 fake-quant result in the input's ``dtype``, saturated to its finite range: a grid's top point may
    lie past the input's largest value (an asymmetric grid's rounded offset moves it up), which float16 cannot
    hold past 65504 (it became inf)."""
    if result.dtype == dtype:
        return result
    if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(result.dtype).max:
        info = torch.finfo(dtype)
        result = result.clamp(info.min, info.max)
    return result.to(dtype)


def _uniform_offset(offset: torch.Tensor) -> Optional[float]:
    """The offset as a number when it is one value for the whole tensor on the CPU (per-tensor, or per-channel
    symmetric), else None (a number from a GPU tensor would cost a host sync per call)."""
    if offset.device.type != "cpu":
        return None
    flat = offset.reshape(-1)
    first = flat[0]
    if flat.numel() > 1 and not bool((flat == first).all()):
        return None
    return float(first)


def _launch_bound(device: torch.device) -> bool:
    """Whether each tensor operation on ``device`` costs a kernel launch worth saving (a GPU), rather than a pass
    that only pays when vectorized (a CPU: its kernels vectorize one broadcast operand at most, so a clamp between
    two 0-dim tensors or an ``addcmul`` of two takes 5-13x the time of the plain passes it replaces)."""
    return device.type != "cpu"


def _qdq_clamped(x: torch.Tensor, s: torch.Tensor, lo, hi) -> torch.Tensor:
    """``(clamp(round(x / s) - o, qmin, qmax) + o) * s`` given ``lo = qmin + o`` and ``hi = qmax + o`` (numbers, or
    on a GPU tensors that broadcast against ``x``), bit for bit (tests/test_quant_properties.py):

    * ``clamp(r - o, qmin, qmax) + o == clamp(r, qmin + o, qmax + o)``: offsets are integers (AIMET's; every
      qtool path rounds them) and codes are integers far below 2^24, so no sum rounds; an ``r`` beyond that clamps
      to the same end either way;
    * the six-pass form never ends in ``-0.0`` (``q + o`` is ``+0.0`` whenever it is zero), and neither does
      ``q * s + 0.0``; on a GPU that is one ``addcmul`` with zero (one rounding of the product either way), four
      kernels instead of six (#53: each pass a launch and a trip through memory); on a CPU a multiply and an add,
      five vectorized passes."""
    dt = _compute_dtype(x)
    s = s.to(dt)
    q = torch.div(x.to(dt), s).round_().clamp_(lo, hi)
    if _launch_bound(q.device):
        return torch.addcmul(device_scalar(0.0, dt, q.device), q, s, out=q)
    return q.mul_(s).add_(0.0)


# --------------------------------------------------------------------------------------------------------------
# min/max <-> scale/offset
# --------------------------------------------------------------------------------------------------------------
def inverse_or_zero(v: torch.Tensor) -> torch.Tensor:
    """``1 / v``, zero where that is not finite: ``v`` zero, or a denormal whose inverse overflows float32 (a
    scale's inverse times a zero value is then 0, not ``0 · inf`` = NaN)."""
    inverse = 1.0 / v
    return torch.where(torch.isfinite(inverse), inverse, 0.0)


def true_div(x: torch.Tensor, d) -> torch.Tensor:
    """``x / d`` for a number ``d``, the correctly rounded quotient on every device.

    On CUDA, torch divides by a Python number (or a CPU scalar tensor) by multiplying with its reciprocal, which
    is one bit off the true quotient for about a third of float32 values; CPU (and AIMET) divide. A divisor on
    ``x``'s own device gets CUDA's true division, so CPU and CUDA encodings are the same bits."""
    if x.device.type == "cpu":
        return x / d
    return x / device_scalar(float(d), x.dtype, x.device)


def device_scalar(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor holding ``value`` on ``device``, made once per value, dtype and device (a fill kernel per
    use costs a GPU launch). Inside a CUDA graph's capture a fresh one is made: its fill is recorded, not run, so
    a cached one made there would hold nothing until the graph replays. Read it, never write it."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.full((), value, dtype=dtype, device=device)
    return _cached_scalar(value, dtype, device)


@functools.lru_cache(maxsize=256)
def _cached_scalar(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(:func:`device_scalar`) A normal tensor even when first asked for under ``inference_mode``, so autograd
    can later save it."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.full((), value, dtype=dtype, device=device)


def _min_scale(num_steps: int) -> float:
    return min(FLOAT32_EPS, 0.01 / num_steps)


def adjust_min_max(stat_min: torch.Tensor, stat_max: torch.Tensor, num_steps: int, symmetric: bool):
    """Turn raw statistics into a quantizer's stored ``(min, max)`` (float32).

    The range is widened to contain zero, a degenerate range is widened to the minimum scale, a symmetric range
    is made symmetric on the signed grid, and infinities are clamped to float32 limits.
    """
    n = int(num_steps)
    ms = _min_scale(n)
    mn = torch.clamp(stat_min.to(torch.float32), max=0.0)
    mx = torch.clamp(stat_max.to(torch.float32), min=0.0)
    # a degenerate range widens by the minimum scale: the comparison times ms, 0.0 or float32(ms) exactly as a where()
    # of two fills gives them, in two kernels instead of four (a GPU's calibration call is bound by its launches)
    adj = (true_div(mx - mn, n) < ms) * ms
    if adj.dtype != torch.float32:  # (a default dtype other than float32)
        adj = adj.to(torch.float32)
    if symmetric:
        pos, neg = n // 2, math.ceil(n / 2)
        mx = mx + pos * adj
        mn = mn - neg * adj
        d = torch.maximum(true_div(mx, pos + (1 if n == 3 else 0)), true_div(-mn, neg))
        mn = -neg * d
        mx = pos * d
    else:
        mx = mx + n * adj
    return torch.clamp(mn, min=-_F32_MAX), torch.clamp(mx, max=_F32_MAX)


def min_max_to_scale_offset(
    min: torch.Tensor, max: torch.Tensor, qmin: int, qmax: int, symmetric: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """AIMET's ``(scale, offset)`` from a stored ``(min, max)``; differentiable in both.

    ``scale = max(|(max - min) / n|, min_scale)``; symmetric offset ``-round((qmin + qmax) / 2)``; asymmetric
    offset ``clamp(round(min / scale) - qmin, -qmax, -qmin)`` (straight-through round).
    """
    n = qmax - qmin
    scale = torch.clamp(torch.abs(true_div(max - min, n)), min=_min_scale(n))
    if symmetric:
        offset = torch.full_like(scale, float(-round((qmin + qmax) / 2)))
    else:
        offset = torch.clamp(round_ste(min / scale) - qmin, -qmax, -qmin)
    return scale, offset


def batch_scale_offset(stat_min: torch.Tensor, stat_max: torch.Tensor, qmin: int, qmax: int, symmetric: bool):
    """``min_max_to_scale_offset(*adjust_min_max(stat_min, stat_max, qmax - qmin, symmetric), qmin, qmax,
    symmetric)`` without gradients, in 12 tensor operations instead of 18 (asymmetric) and 18 instead of 23
    (symmetric): a calibrating min-max quantizer's per-batch encoding on a GPU, where each of them is a kernel
    launch (#53). The same bits wherever the result is not NaN (tests/test_quant_properties.py, every class of
    float32 value), and NaN where it is:

    * the widening of a degenerate range adds ``k * adj`` with ``adj`` either 0 or the minimum scale, i.e. adds
      the float32 product ``k * min_scale`` or ``+0.0``: one ``add(..., alpha=)`` of the comparison;
    * asymmetric: the clamps to zero and to float32's largest value are one clamp each (an infinite end only
      moves to float32's largest value before, not after, a comparison that is false either way), and ``- qmin``
      is left out where qmin is 0 (``v - 0`` is ``v``, its zero's sign included);
    * the scale's ``abs`` is left out: ``max >= 0 >= min`` after the clamps, so ``max - min`` is ``+0.0`` or more
      (or NaN, whose sign bit ``abs`` would clear);
    * symmetric: ``-mn / neg`` is ``mn / -neg``.
    """
    n = qmax - qmin
    ms = _min_scale(n)
    f32 = np.float32
    with torch.no_grad():
        if not symmetric:
            mn = torch.clamp(stat_min.to(torch.float32), -_F32_MAX, 0.0)
            mx = torch.clamp(stat_max.to(torch.float32), 0.0, _F32_MAX)
            mx = torch.add(mx, true_div(mx - mn, n) < ms, alpha=float(f32(n) * f32(ms)))
            scale = torch.clamp(true_div(mx - mn, n), min=ms)
            code = torch.round(mn / scale)
            return scale, torch.clamp(code - qmin if qmin else code, -qmax, -qmin)
        pos, neg = n // 2, math.ceil(n / 2)
        mn = torch.clamp(stat_min.to(torch.float32), max=0.0)
        mx = torch.clamp(stat_max.to(torch.float32), min=0.0)
        degenerate = true_div(mx - mn, n) < ms
        mx = torch.add(mx, degenerate, alpha=float(f32(pos) * f32(ms)))
        mn = torch.add(mn, degenerate, alpha=-float(f32(neg) * f32(ms)))  # (a bool cannot be subtracted)
        d = torch.maximum(true_div(mx, pos + (1 if n == 3 else 0)), true_div(mn, -neg))
        mn = torch.clamp(d * -neg, min=-_F32_MAX)
        mx = torch.clamp(d * pos, max=_F32_MAX)
        scale = torch.clamp(true_div(mx - mn, n), min=ms)
        return scale, torch.full_like(scale, float(-round((qmin + qmax) / 2)))


# One range as numbers: the arithmetic of adjust_min_max and min_max_to_scale_offset on 0-dim float32 CPU tensors,
# done on numpy float32 scalars (IEEE binary32, the same roundings) with torch's rules for the rest: clamp(v, lo)
# keeps v unless v < lo (so -0.0 and NaN stay), maximum propagates NaN and keeps its first argument on a tie (the
# zeros' signs), round is half to even, a Python number meets a float32 tensor as a float32 value. About a tenth of
# the time of ~20 tensor operations of a few microseconds each, which a per-tensor activation quantizer paid on
# every calibration call. tests/test_quant_properties.py compares the two on every float32 class of value.
_NUMBERS_MAX_STEPS = 65535  # up to 16 bits: the minimum scale is FLOAT32_EPS itself, no float32 rounding of it


def _clamp_number(v, lo=None, hi=None):
    if lo is not None and v < lo:
        v = lo
    if hi is not None and v > hi:
        v = hi
    return v


def _maximum_number(a, b):
    if a != a or b != b:
        return np.float32("nan")
    return b if b > a else a


def scale_offset_of_numbers(stat_min: float, stat_max: float, qmin: int, qmax: int, symmetric: bool):
    """``min_max_to_scale_offset(*adjust_min_max(min, max, qmax - qmin, symmetric), qmin, qmax, symmetric)`` of a
    one-value range given as numbers, as ``(scale, offset)`` numpy float32 scalars, bit for bit what the tensor
    functions give on 0-dim float32 CPU tensors (signs of zero, infinities and subnormals included). Grids of 2 to
    16 bits (3 to 65535 steps) and a min and max that are not NaN (which NaN two NaNs give is the compiler's
    choice); raises ``ValueError`` otherwise."""
    n = qmax - qmin
    if not 3 <= n <= _NUMBERS_MAX_STEPS:
        raise ValueError(f"scale_offset_of_numbers: {n} steps; 3 to {_NUMBERS_MAX_STEPS}")
    if stat_min != stat_min or stat_max != stat_max:
        raise ValueError("scale_offset_of_numbers: a NaN min or max")
    f32 = np.float32
    zero, ms, big = f32(0.0), f32(FLOAT32_EPS), f32(_F32_MAX)
    with np.errstate(over="ignore", invalid="ignore"):
        mn = _clamp_number(f32(stat_min), hi=zero)
        mx = _clamp_number(f32(stat_max), lo=zero)
        adj = ms if (mx - mn) / f32(n) < ms else zero
        if symmetric:
            pos, neg = n // 2, math.ceil(n / 2)
            mx = mx + f32(pos) * adj
            mn = mn - f32(neg) * adj
            d = _maximum_number(mx / f32(pos + (1 if n == 3 else 0)), -mn / f32(neg))
            mn = f32(-neg) * d
            mx = f32(pos) * d
        else:
            mx = mx + f32(n) * adj
        mn, mx = _clamp_number(mn, lo=-big), _clamp_number(mx, hi=big)
        scale = _clamp_number(abs((mx - mn) / f32(n)), lo=ms)
        if symmetric:
            return scale, f32(-round((qmin + qmax) / 2))
        offset = _clamp_number(np.rint(mn / scale) - f32(qmin), lo=f32(-qmax), hi=f32(-qmin))
        return scale, offset


def dynamic_scale_offset(
    x: torch.Tensor, per_token: bool, qmin: int, qmax: int, symmetric: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(scale, offset)`` of a dynamic quantizer, from ``x`` itself: one range per token (``per_token``: per
    position of every dimension but the last, shape ``(..., 1)``) or one for the whole tensor (shape ``()``).

    AIMET has no dynamic quantizers, so the rule is the one of the runtimes that execute them (compressed-tensors
    as transformers loads it, torchao), which a reloaded model then reproduces exactly on every token whose range
    is above the minimum scale (below, see the last paragraph):

    * symmetric: ``scale = max|x| / ((qmax - qmin) / 2)`` (127.5 for 8 bits; the largest value may clip by half a
      step), offset 0 on the signed grid;
    * asymmetric: the min-max rule of static quantizers (range widened to contain zero, ``scale = (max - min) /
      (qmax - qmin)``, offset ``round(min / scale) - qmin``).

    A scale is never below the minimum scale of :func:`min_max_to_scale_offset` (float32's eps for 8 bits), as
    torchao floors it. compressed-tensors puts eps only where a scale is exactly 0, so on a token of all-tiny
    values (8-bit symmetric: max|x| under 127.5 x eps, about 1.5e-5) it keeps the smaller scale and the two
    differ there, by less than eps per value. The statistics carry no gradient: a dynamic range has
    nothing to learn."""
    n = qmax - qmin
    with torch.no_grad():
        if symmetric:
            absmax = (x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax()).to(torch.float32)
            scale = torch.clamp(true_div(absmax, n / 2), min=_min_scale(n), max=_F32_MAX)
            return scale, torch.full_like(scale, float(-round((qmin + qmax) / 2)))
        # (amin/amax rather than aminmax: the ONNX tracer cannot follow aminmax's tuple inside a custom Function)
        if per_token:
            stat_min, stat_max = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
        else:
            stat_min, stat_max = x.amin(), x.amax()
        mn, mx = adjust_min_max(stat_min, stat_max, n, symmetric)
        return min_max_to_scale_offset(mn, mx, qmin, qmax, symmetric)


# --------------------------------------------------------------------------------------------------------------
# float16 scales (GGUF stores its block scales, and Q4_1 its block minimum, as float16)
# --------------------------------------------------------------------------------------------------------------
class UnrepresentableScale(ValueError):
    """A calibrated range whose scale the grid's stored scale type cannot hold (beyond float16's 65504, or NaN).
    The calibration loop reports it as the data's or checkpoint's fault, naming the quantizer."""


_F16_WINDOW = 16  # float16 steps searched each side for an asymmetric grid whose origin is a float16 value


def snap_to_float16_scale(min: torch.Tensor, max: torch.Tensor, qmin: int, qmax: int, symmetric: bool):
    """A stored ``(min, max)`` whose derived scale is a float16 value (and, asymmetric, whose ``offset * scale``
    is one too), close to the given range. Round-trip exact: ``min_max_to_scale_offset`` of the result gives
    that float16 scale and an integer offset. Raises :class:`UnrepresentableScale` where a scale exceeds
    float16's range or is NaN.

    Symmetric: the scale is rounded to the nearest float16 value. Asymmetric: the nearest float16 scale within
    16 float16 steps for which ``round(min / scale) * scale`` is a float16 value.
    """
    n = qmax - qmin
    lo, hi = min.detach().to(torch.float32), max.detach().to(torch.float32)
    scale, offset = min_max_to_scale_offset(lo, hi, qmin, qmax, symmetric)
    floor = _min_scale(n)
    d = scale.to(torch.float16).to(torch.float32)
    if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
        raise UnrepresentableScale("its calibrated range holds NaN or infinity")
    if not torch.isfinite(d).all():
        raise UnrepresentableScale(f"its range [{float(lo.min()):.4g}, {float(hi.max()):.4g}] needs a scale of "
                                   f"{float(scale.max()):.4g}, beyond float16's largest value (65504), which this "
                                   "grid stores")
    d = torch.where(d < floor, torch.full_like(d, floor), d)
    if symmetric:
        pos, neg = n // 2, math.ceil(n / 2)
        return -neg * d, pos * d
    bits = d.to(torch.float16).view(torch.int16).to(torch.int32)
    steps = torch.arange(-_F16_WINDOW, _F16_WINDOW + 1, dtype=torch.int32)
    steps = steps[torch.argsort(steps.abs() * 2 - (steps > 0).to(torch.int32), stable=True)]  # 0, 1, -1, 2, ...
    cand = (bits.unsqueeze(-1) + steps).clamp(1, 0x7BFF).to(torch.int16).view(torch.float16).to(torch.float32)
    cand = torch.where(cand < floor, torch.full_like(cand, floor), cand)
    off = torch.clamp(torch.round(lo.unsqueeze(-1) / cand) - qmin, -qmax, -qmin)
    origin = off * cand
    ok = origin.to(torch.float16).to(torch.float32) == origin
    if not ok.any(-1).all():
        # one of 33 consecutive float16 values ends in 5 zero bits, so for <= 5 bits this happens only where the
        # grid's minimum itself is beyond float16 (a 2-bit grid's three steps below -65504)
        raise UnrepresentableScale(f"its range [{float(lo.min()):.4g}, {float(hi.max()):.4g}] has no float16 scale "
                                   "whose grid minimum is a float16 value, which this grid stores")
    pick = ok.to(torch.int8).argmax(-1, keepdim=True)
    d = cand.gather(-1, pick).squeeze(-1)
    o = off.gather(-1, pick).squeeze(-1)
    return (o + qmin) * d, (o + qmax) * d
