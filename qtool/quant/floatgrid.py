"""Float element grids (FP8 E4M3, FP4 E2M1) under representable scales (float32, E8M0, FP8 under a global scale).

A float grid is a table of representable element values times a per-block scale that is itself representable in
its own type. These are pure tensor functions, like ``quant.affine``; they follow compressed-tensors 0.20's
quantize/dequantize bit for bit (its ``calculate_qparams``, ``generate_gparam``, ``round_to_power_2`` and
``_quantize_dequantize``), which is what vLLM and transformers run on the files.

Elements (``ELEMENTS``):

* ``fp8_e4m3``: PyTorch's cast to ``torch.float8_e4m3fn`` (round half to even) after a clamp to ±448. Its code is
  the float8 byte.
* ``fp4_e2m1``: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to the even index (0.25→0, 0.75→1, 1.25→1, 1.75→2,
  2.5→2, 3.5→4, 5→4). Its code is ``sign << 3 | index`` (0..15).

Scales (``scale_dtype``), from a block's absolute maximum ``amax`` (the stored range is ``[-amax, amax]``):

* ``float32``: ``amax / emax`` (emax = the element's largest value), a zero scale becomes float32's eps;
* ``e8m0`` (MX): ``2 ** (e - 127)`` with the biased exponent ``e = 127 + floor(log2(round_to_power_2(amax))) -
  floor(log2(emax))`` clamped to 0..255, ``round_to_power_2`` rounding up when the mantissa is ≥ 1.75
  (compressed-tensors' rule, FP4's mantissa width for every element type; OCP's plain floor differs);
* ``fp8_e4m3`` (NVFP4): a per-tensor float32 global scale ``G = 448 · emax / amax_tensor`` (a multiplier; 1.0
  where that is not finite) and a block scale ``s = fp8(clamp(G · (amax / emax), ±448))`` (0.125 where it is 0);
  the effective scale is ``s / G``. (``G`` is computed as ``(1 / amax) · 2688``: that is how PyTorch evaluates
  compressed-tensors' ``2688 / amax``, and it can differ from a true division in the last bit.)

The fake-quant value of ``x`` is ``round_elem(clamp(x / eff, ±emax)) · eff``, computed in float32 in exactly
that order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from .affine import to_input_dtype, true_div

__all__ = [
    "ELEMENTS",
    "FLOAT_SCALE_DTYPES",
    "FloatElement",
    "element_of",
    "round_to_e2m1",
    "e2m1_codes",
    "e2m1_values",
    "round_to_e4m3",
    "round_to_power_2",
    "mx_exponent",
    "global_scale",
    "float_scales",
    "encoding_scales",
    "search_amax",
    "float_quantize",
    "float_dequantize",
    "float_quantize_dequantize",
    "dynamic_float_scales",
]

_F32_EPS = float(torch.finfo(torch.float32).eps)
_FP8_MAX = 448.0
_FP8_SCALE_EPS = 0.125  # compressed-tensors' replacement for a zero FP8 block scale
_SEARCH_TABLE = 1 << 21  # candidate scales tabled at once by search_amax (candidates x rows)
_SEARCH_VALUES = 1 << 20  # values it evaluates at once


@dataclass(frozen=True)
class FloatElement:
    """A float element type: its name, bit width and largest magnitude."""

    name: str
    bits: int
    max: float

    @property
    def num_codes(self) -> int:
        return 1 << self.bits

    @property
    def mx_offset(self) -> int:
        """``floor(log2(max))``: what MX subtracts from a block's exponent so its maximum maps to the element's."""
        return int(math.floor(math.log2(self.max)))

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (already clamped to ±max) rounded to the nearest element value (float32)."""
        return round_to_e4m3(x) if self.bits == 8 else round_to_e2m1(x)

    def codes(self, values: torch.Tensor) -> torch.Tensor:
        """The codes (int64, 0..2**bits-1) of element values."""
        if self.bits == 8:
            return values.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
        return e2m1_codes(values)

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """The element values (float32) of codes."""
        if self.bits == 8:
            return codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        return e2m1_values(codes)


ELEMENTS = {"fp8_e4m3": FloatElement("fp8_e4m3", 8, _FP8_MAX), "fp4_e2m1": FloatElement("fp4_e2m1", 4, 6.0)}
FLOAT_SCALE_DTYPES = ("float32", "e8m0", "fp8_e4m3")


def element_of(name: str) -> FloatElement:
    try:
        return ELEMENTS[name]
    except KeyError:
        raise ValueError(f"element must be one of int, {', '.join(ELEMENTS)} (got {str(name)[:40]!r})") from None


# --------------------------------------------------------------------------------------------------------------
# Elements
# --------------------------------------------------------------------------------------------------------------
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _e2m1_index(mag: torch.Tensor) -> torch.Tensor:
    """Index (0..7) of the nearest E2M1 magnitude; a value halfway between two goes to the even index."""
    bounds = torch.tensor(_E2M1_MIDPOINTS, dtype=mag.dtype, device=mag.device)
    below = torch.bucketize(mag, bounds, right=False)  # a midpoint counts with the lower magnitude
    above = torch.bucketize(mag, bounds, right=True)  # ... with the upper one
    return torch.where((below != above) & (below % 2 == 1), above, below)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to E2M1 values (±0 .. ±6, ties to even); magnitudes above 6 become 6. Float32.

    Each binade of E2M1 is a uniform grid (steps 0.5 below 2, 1 up to 4, 2 up to 6), so rounding half to even on
    the binade's step is rounding to the even table index (twice as fast as a table search; the same values)."""
    x = x.to(torch.float32)
    a = x.abs().clamp(max=6.0)
    q = torch.where(a < 2, torch.round(a * 2) * 0.5, torch.where(a < 4, torch.round(a), torch.round(a * 0.5) * 2))
    return q * torch.sign(x)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes ``sign << 3 | index`` of E2M1 values (int64); the sign is the float's sign bit, so -0 is
    code 8 (as compressed-tensors packs it)."""
    v = values.to(torch.float32)
    idx = _e2m1_index(v.abs())
    return torch.where(torch.signbit(v), idx + 8, idx).to(torch.int64)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The E2M1 values (float32) of 4-bit codes."""
    c = codes.to(torch.int64)
    table = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=c.device)
    mag = table[c & 7]
    return torch.where(c >= 8, -mag, mag)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` clamped to ±448 and rounded to FP8 E4M3 (PyTorch's cast, half to even), back in float32. A -0.0 is
    +0.0 (code 0x00), as compressed-tensors' ``x / scale + zero_point`` makes it."""
    return x.to(torch.float32).add(0.0).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)


# --------------------------------------------------------------------------------------------------------------
# Scales
# --------------------------------------------------------------------------------------------------------------
def round_to_power_2(x: torch.Tensor, elem_mantissa: int = 1) -> torch.Tensor:
    """Float32 ``x`` with its mantissa dropped after adding half of the element's last mantissa step: the power of
    two below ``x``, or the one above when the mantissa is at least ``2 - 2**-elem_mantissa`` (1.75 for E2M1)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    add = 1 << (23 - elem_mantissa - 1)
    keep = ((1 << 9) - 1) << 23  # sign and exponent
    out = torch.bitwise_and(bits + add, keep)
    return out.to(torch.int32).view(torch.float32) if out.numel() else out.to(torch.float32)


def mx_exponent(amax: torch.Tensor, element: FloatElement) -> torch.Tensor:
    """The biased E8M0 exponent (float32 holding an integer 0..255) of blocks whose absolute maximum is ``amax``."""
    p2 = round_to_power_2(amax.to(torch.float32))
    e = 127 + torch.floor(torch.log2(p2)) - element.mx_offset
    return torch.round(torch.clamp(e, 0, 255))


def global_scale(amax: torch.Tensor, element: FloatElement) -> torch.Tensor:
    """NVFP4's per-tensor float32 global scale (a multiplier, shape ``[1]``) for a tensor whose absolute maximum
    is ``amax``: ``448 · emax / amax``, 1.0 where that is not finite."""
    a = amax.to(torch.float32).reshape(-1).amax().clamp(min=torch.finfo(torch.float32).tiny)
    g = torch.reciprocal(a) * (_FP8_MAX * element.max)  # as compressed-tensors' ``2688 / amax`` evaluates it
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def float_scales(amax: torch.Tensor, element: FloatElement, scale_dtype: str,
                 gscale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(stored, effective)`` scales of blocks whose absolute maximum is ``amax`` (float32, ``amax``'s shape).

    ``stored`` is what a file holds: the float32 scale, the biased E8M0 exponent (0..255, as float32), or the FP8
    block scale's value (as float32). ``effective`` is what multiplies an element value. ``fp8_e4m3`` needs the
    tensor's global scale ``gscale`` (:func:`global_scale`)."""
    a = amax.to(torch.float32)
    if scale_dtype == "float32":
        s = true_div(a, element.max)
        s = torch.where(s == 0, torch.tensor(_F32_EPS, dtype=torch.float32, device=s.device), s)
        return s, s
    if scale_dtype == "e8m0":
        e = mx_exponent(a, element)
        return e, torch.pow(2.0, e - 127)
    if scale_dtype == "fp8_e4m3":
        if gscale is None:
            raise ValueError("fp8_e4m3 block scales need the tensor's global scale")
        g = gscale.to(torch.float32).reshape(())
        s = g * true_div(a, element.max)
        s = s.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        s = torch.where(s == 0, torch.tensor(_FP8_SCALE_EPS, dtype=torch.float32, device=s.device), s)
        return s, s / g
    raise ValueError(f"scale_dtype must be one of {', '.join(FLOAT_SCALE_DTYPES)} for a float element "
                     f"(got {str(scale_dtype)[:40]!r})")


def encoding_scales(amax: torch.Tensor, element: FloatElement, scale_dtype: str,
                    global_amax: Optional[torch.Tensor] = None):
    """``(stored, effective, gscale)`` of a calibrated float encoding whose blocks' absolute maxima are ``amax``
    (the stored range's ``max``): the global scale (``[1]``, fp8_e4m3 block scales only, else None) comes from
    the largest of them, i.e. the tensor's absolute maximum, or from ``global_amax`` where layers that a runtime
    fuses (q/k/v, gate/up) share one."""
    if scale_dtype == "fp8_e4m3":
        gscale = global_scale(amax if global_amax is None else global_amax.to(amax.device), element)
    else:
        gscale = None
    stored, eff = float_scales(amax, element, scale_dtype, gscale)
    return stored, eff, gscale


@torch.no_grad()
def search_amax(rows: torch.Tensor, amax: torch.Tensor, element: FloatElement, scale_dtype: str,
                ratios: Sequence[float], weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per encoding (a row of ``rows`` ``(E, M)``: all of its values), the clipped absolute maximum
    ``ratio · amax`` whose *representable* scales give the least (``weights``-weighted) squared error of the
    fake-quantized values; the widest wins ties, and ``ratio = 1`` (min-max) is always a candidate, so the error is
    never above min-max's. With fp8_e4m3 block scales the global scale stays the unclipped tensor's (the rows
    holding the tensor's maximum keep it), so what is stored derives the global scale the search used.

    A representable scale changes in steps (E8M0: powers of two, FP8: 8 per octave), so of a row's candidates only
    those whose scale differs from the previous candidate's can change its error: every candidate's scale is
    computed at once, and only those (a few per row, not ``len(ratios)``) are evaluated, in chunks of rows."""
    rows = rows.to(torch.float32)
    amax = amax.to(torch.float32).reshape(-1)
    if not len(ratios):
        return amax.clone()
    gscale = global_scale(amax, element) if scale_dtype == "fp8_e4m3" else None
    pinned = amax == amax.max() if gscale is not None else torch.zeros_like(amax, dtype=torch.bool)
    ratio = torch.tensor([float(r) for r in ratios], dtype=torch.float32, device=amax.device)[:, None]
    best = amax.clone()
    per = max(1, _SEARCH_VALUES // max(rows.shape[1], 1))  # candidate rows evaluated at once
    step = max(1, _SEARCH_TABLE // len(ratios))  # rows whose candidates' scales are tabled at once
    for lo in range(0, amax.numel(), step):
        hi = min(lo + step, amax.numel())
        a = torch.where(pinned[None, lo:hi], amax[None, lo:hi], amax[None, lo:hi] * ratio)  # (candidates, rows)
        eff = float_scales(a, element, scale_dtype, gscale)[1]
        moved = torch.ones_like(eff, dtype=torch.bool)
        moved[1:] = eff[1:] != eff[:-1]
        cands, idx = torch.nonzero(moved, as_tuple=True)
        err = torch.full_like(eff, math.inf)
        for p in range(0, cands.numel(), per):
            c, i = cands[p:p + per], idx[p:p + per]
            sub = rows[lo + i]
            s = eff[c, i][:, None]
            d = element.round(torch.clamp(sub / s, -element.max, element.max)) * s - sub
            d = d * d if weights is None else d * d * weights[lo + i]
            err[c, i] = d.sum(dim=1)
        # the first candidate's error is the bar (a NaN one is never beaten), a later one wins only below it
        err[0] = torch.nan_to_num(err[0], nan=-math.inf)
        err[1:] = torch.nan_to_num(err[1:], nan=math.inf)
        pick = torch.argmin(err, dim=0)  # the first of equal errors: the widest
        best[lo:hi] = torch.where(pick == 0, amax[lo:hi], a.gather(0, pick[None])[0])
    return best


def _blocked(x: torch.Tensor, scale: torch.Tensor, block_size: Optional[Sequence[int]]):
    """``x`` viewed so that ``scale`` (the encoding) broadcasts over it per block, and the view's shape back."""
    from .affine import blocked_shapes

    if block_size is None:
        return x, scale
    x_view, enc_view, _ = blocked_shapes(x.shape, tuple(scale.shape), block_size)
    return x.reshape(x_view), scale.reshape(enc_view)


def float_quantize(x: torch.Tensor, eff: torch.Tensor, element: FloatElement,
                   block_size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The element codes (int64, ``x``'s shape) of ``x`` under effective scales ``eff``."""
    xv, sv = _blocked(x.to(torch.float32), eff.to(torch.float32), block_size)
    vals = element.round(torch.clamp(xv / sv, -element.max, element.max))
    return element.codes(vals).reshape(x.shape)


def float_dequantize(codes: torch.Tensor, eff: torch.Tensor, element: FloatElement,
                     block_size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Element values of ``codes`` times their effective scales (float32)."""
    vals = element.values(codes)
    vv, sv = _blocked(vals, eff.to(torch.float32), block_size)
    return (vv * sv).reshape(codes.shape)


def float_quantize_dequantize(x: torch.Tensor, eff: torch.Tensor, element: FloatElement,
                              block_size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Fake quantization on the float grid: ``round(clamp(x / eff, ±emax)) · eff`` in float32, returned in
    ``x``'s dtype (saturated to its range: an MX block's power-of-two scale can put the top past float16's).
    Gradients pass straight through inside the clamp (as for the integer grids)."""
    xv, sv = _blocked(x.to(torch.float32), eff.to(torch.float32), block_size)
    y = torch.clamp(xv / sv, -element.max, element.max)
    r = element.round(y.detach())
    if torch.is_grad_enabled() and y.requires_grad:
        r = y + (r - y).detach()
    return to_input_dtype((r * sv).reshape(x.shape), x.dtype)


def dynamic_float_scales(x: torch.Tensor, element: FloatElement, scale_dtype: str, granularity: str,
                         block: Optional[int] = None, gscale: Optional[torch.Tensor] = None):
    """Effective scales of a dynamic float quantizer from ``x`` itself, with the ``block_size`` that applies them:
    one per call (``per_tensor``), per token (``per_token``: every position of all dims but the last), or per
    ``block`` consecutive values of the last dim (``per_block``). Returns ``(eff, block_size)``."""
    xa = x.detach().to(torch.float32).abs()
    if granularity == "per_tensor":
        amax = xa.amax() if xa.numel() else torch.zeros((), device=x.device)
        return float_scales(amax, element, scale_dtype, gscale)[1], None
    if granularity == "per_token":
        amax = xa.amax(dim=-1, keepdim=True)
        return float_scales(amax, element, scale_dtype, gscale)[1], None
    if granularity == "per_block":
        n = x.shape[-1]
        if block is None or n % block:
            raise ValueError(f"block size {block} does not divide the last dimension {n}")
        amax = xa.unflatten(-1, (n // block, block)).amax(dim=-1)
        eff = float_scales(amax, element, scale_dtype, gscale)[1]
        return eff, (1,) * (x.dim() - 1) + (block,)
    raise ValueError(f"a dynamic float quantizer is per_tensor, per_token or per_block (got {granularity!r})")
