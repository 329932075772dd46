"""llama.cpp's block types as grids: pure tensor functions for the K-quants (Q2_K … Q6_K) and the IQ4 types.

A GGUF weight row is cut into blocks along its input dimension. A legacy block (Q4_0 … Q8_0, IQ4_NL) is 32
elements with one float16 scale ``d`` (and float16 minimum ``m`` for Q4_1/Q5_1: value ``q·d + m``). A K-quant super-block is 256 elements with float16 ``d`` (and ``dmin`` where
the grid has a minimum) and one small-integer scale (and minimum) per sub-block of 16 or 32 elements, so the
grid a weight sees exists only once the sub-block scales are themselves quantized::

    Q2_K      value = (d·sc)·q − dmin·m      q 0..3,   sc, m 4-bit,     sub-blocks of 16
    Q3_K      value = (d·(sc−32))·q          q −4..3,  sc 6-bit,        sub-blocks of 16
    Q4_K/Q5_K value = (d·sc)·q − dmin·m      q 0..15 / 0..31, sc, m 6-bit, sub-blocks of 32
    Q6_K      value = (d·sc)·q               q −32..31, sc int8,        sub-blocks of 16
    IQ4_NL    value = d·T[q]                 T = the 16-value table below, blocks of 32
    IQ4_XS    value = (d·(sc−32))·T[q]       sc 6-bit,                sub-blocks of 32

Each formula is evaluated in float32 in ggml's own order (``dequantize`` here equals ``ggml_dequantize_row_*``
and gguf-py's ``dequantize`` bit for bit; tests prove it). A quantizer of such a type keeps one float step (and
minimum) per sub-block, as its analyzer chose it; :func:`snap` turns those into the stored integers and the exact
effective steps, and every consumer (fake-quant, GPTQ, the GGUF packer) starts from that one result.
:func:`pack` only lays bytes out as ``ggml-common.h`` declares the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .affine import UnrepresentableScale, true_div

__all__ = ["GgmlType", "GGML_TYPES", "KGrid", "IQ4_TABLE", "ggml_type", "snap", "grid_from_range", "search_range",
           "quantize_codes", "dequantize", "quantize_dequantize", "pack", "type_levels"]

QK_K = 256
IQ4_TABLE = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class GgmlType:
    """One GGUF block type as a grid: codes ``qmin..qmax`` (or indices into ``IQ4_TABLE``), ``sub`` elements per
    scale, ``block`` elements per stored block of ``nbytes`` bytes, and how its sub-block scales are stored
    (``scale_bits``: the integer scale of a K-quant, ``None``: one float16 per block)."""

    name: str
    bits: int
    symmetric: bool  # no minimum: value = step * q
    sub: int
    block: int
    nbytes: int
    scale_bits: Optional[int] = None
    signed_scales: bool = False  # sub-block scales stored with a bias (Q3_K, IQ4_XS) or as int8 (Q6_K)
    table: bool = False  # code q is IQ4_TABLE[q + 8]

    @property
    def qmin_qmax(self) -> Tuple[int, int]:
        if self.symmetric:  # IQ4: code q is index q + 8 into IQ4_TABLE
            return -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1
        return 0, (1 << self.bits) - 1

    @property
    def k_quant(self) -> bool:
        return self.scale_bits is not None

    @property
    def bits_per_weight(self) -> float:
        return self.nbytes * 8 / self.block


GGML_TYPES: Dict[str, GgmlType] = {t.name: t for t in (
    GgmlType("Q8_0", 8, True, 32, 32, 34),
    GgmlType("Q5_0", 5, True, 32, 32, 22),
    GgmlType("Q5_1", 5, False, 32, 32, 24),
    GgmlType("Q4_0", 4, True, 32, 32, 18),
    GgmlType("Q4_1", 4, False, 32, 32, 20),
    GgmlType("Q2_K", 2, False, 16, QK_K, 84, scale_bits=4),
    GgmlType("Q3_K", 3, True, 16, QK_K, 110, scale_bits=6, signed_scales=True),
    GgmlType("Q4_K", 4, False, 32, QK_K, 144, scale_bits=6),
    GgmlType("Q5_K", 5, False, 32, QK_K, 176, scale_bits=6),
    GgmlType("Q6_K", 6, True, 16, QK_K, 210, scale_bits=8, signed_scales=True),
    GgmlType("IQ4_NL", 4, True, 32, 32, 18, table=True),
    GgmlType("IQ4_XS", 4, True, 32, QK_K, 136, scale_bits=6, signed_scales=True, table=True),
)}


def ggml_type(name: str) -> GgmlType:
    try:
        return GGML_TYPES[name.upper()]
    except KeyError:
        raise ValueError(f"unknown GGUF type {name!r} (one of {', '.join(GGML_TYPES)})") from None


@dataclass(frozen=True)
class KGrid:
    """The stored scales of a ``[rows, cols]`` weight in one type, and the exact grid they make.

    ``d`` / ``dmin``: ``[rows, cols / block]`` float32 holding float16 values (a legacy Q4_1/Q5_1 block's ``dmin``
    is its minimum ``m``); ``sc`` / ``m``: ``[rows, cols / sub]`` stored integers (``sc`` as stored, bias included;
    ``None`` for a type with one float scale per block);
    ``step`` / ``low``: ``[rows, cols / sub]`` float32, the effective step ``d·sc`` (``d·(sc−bias)``) and minimum
    ``dmin·m`` as ggml computes them (``low`` is zero for a symmetric type)."""

    type: GgmlType
    d: torch.Tensor
    dmin: Optional[torch.Tensor]
    sc: Optional[torch.Tensor]
    m: Optional[torch.Tensor]
    step: torch.Tensor
    low: torch.Tensor

    def step_offset(self, shape) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(step, offset)`` in ``shape`` (the encoding's): the effective step, and the minimum in steps
        (``-low / step``; not an integer for Q4_K) as AIMET's ``(scale, offset)`` would put them."""
        step = self.step.reshape(shape)
        return step, -self.low.reshape(shape) / torch.where(step == 0, torch.ones_like(step), step)


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _per_sub(x: torch.Tensor, t: GgmlType) -> torch.Tensor:
    """A per-block tensor repeated for each of its sub-blocks."""
    return x.repeat_interleave(t.block // t.sub, dim=-1)


def _quantize_scales(s: torch.Tensor, t: GgmlType, levels: int, negative: bool):
    """Small-integer sub-block scales under one float16 super-block scale: ``d`` and the integers ``l`` with
    ``d·l ≈ s``. ``negative`` (signed scales): ``d`` takes the sign that sends the scale of largest magnitude to
    ``-levels`` (ggml's rule: one more level than the positive side)."""
    rows, nsub = s.shape
    per = t.block // t.sub
    blocks = s.reshape(rows, nsub // per, per)
    if negative:  # the signed scale of largest magnitude takes the integer -levels
        amax = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)
    else:
        amax = blocks.amax(-1)
    d = _f16(true_div(amax, -levels if negative else levels))
    lo, hi = (-levels, levels - 1) if negative else (0, levels)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    lq = torch.round(s / _per_sub(safe, t)).clamp(lo, hi)
    lq = torch.where(_per_sub(d, t) == 0, torch.zeros_like(lq), lq)
    return d, lq.to(torch.int32)


def snap(step: torch.Tensor, low: Optional[torch.Tensor], t: GgmlType) -> KGrid:
    """The grid type ``t`` stores for wished-for sub-block steps ``step`` (``[rows, cols / sub]``; ≥ 0 for a type
    with minima, signed for the others: a negative step mirrors the grid, which matters for IQ4's lopsided table)
    and minima ``low`` (≥ 0, value = step·q − low; ``None`` for a symmetric type).

    Legacy blocks keep their float16 step. K-quant scales become integers under a float16 super-block ``d``
    chosen from the largest step of the super-block (ggml's rule); minima likewise under ``dmin``. Raises
    ``ValueError`` when a step is beyond float16's range (65504)."""
    step = step.to(torch.float32)
    if not bool(torch.isfinite(step).all()) or (low is not None and not bool(torch.isfinite(low).all())):
        raise UnrepresentableScale("a scale is not finite")
    if t.scale_bits is None:  # legacy and IQ4_NL: one float16 scale (and minimum) per block
        d = _f16(step)
        m = None if low is None else _f16(-low.to(torch.float32))
        if bool(torch.isinf(d).any()) or (m is not None and bool(torch.isinf(m).any())):
            raise UnrepresentableScale("a scale is beyond float16's range (65504), which GGUF stores")
        return KGrid(t, d, m, None, None, d, torch.zeros_like(d) if m is None else -m)
    if t.signed_scales:
        levels = 1 << (t.scale_bits - 1)
        d, lq = _quantize_scales(step, t, levels, negative=True)
        bias = 0 if t.name == "Q6_K" else levels
        sc = lq + bias
        eff = _per_sub(d, t) * (sc - bias).to(torch.float32)
        dmin = m = None
        lowq = torch.zeros_like(eff)
    else:
        levels = (1 << t.scale_bits) - 1
        d, sc = _quantize_scales(step, t, levels, negative=False)
        eff = _per_sub(d, t) * sc.to(torch.float32)
        dmin, m = _quantize_scales(low.to(torch.float32).clamp_min(0), t, levels, negative=False)
        lowq = _per_sub(dmin, t) * m.to(torch.float32)
    if bool(torch.isinf(d).any()) or (dmin is not None and bool(torch.isinf(dmin).any())):
        raise UnrepresentableScale("a scale is beyond float16's range (65504), which GGUF stores")
    return KGrid(t, d, dmin, sc, m, eff, lowq)


def grid_from_range(mn: torch.Tensor, mx: torch.Tensor, t: GgmlType) -> KGrid:
    """The grid of a quantizer whose analyzer chose the sub-block ranges ``[mn, mx]`` (``[rows, cols / sub]``):
    the wished-for step covers the range (an asymmetric type's minimum is ``-mn``; a symmetric block's larger end
    takes the most negative code, ``qmin`` or the IQ4 table's ``-127``, through a negative step when that end is
    positive, as llama.cpp does), then :func:`snap` stores it as the type does."""
    mn, mx = mn.to(torch.float32), mx.to(torch.float32)
    qmin, qmax = t.qmin_qmax
    if t.table:
        amax = torch.maximum(-mn, mx).clamp_min(0)
        return snap(true_div(torch.where(mx > -mn, -amax, amax), -IQ4_TABLE[0]), None, t)
    if t.symmetric:  # likewise the larger end takes qmin (a negative step when it is positive): one more level
        amax = torch.maximum(-mn, mx).clamp_min(0)
        return snap(true_div(torch.where(mx > -mn, -amax, amax), -qmin), None, t)
    low = (-mn).clamp_min(0)
    return snap(true_div(mx + low, qmax).clamp_min(0), low, t)


def _nearest_table(x: torch.Tensor) -> torch.Tensor:
    """Per value of ``x`` (in steps), the IQ4 table value nearest it."""
    table = torch.tensor(IQ4_TABLE, dtype=x.dtype, device=x.device)
    return table[torch.bucketize(x, (table[1:] + table[:-1]) / 2)]


CLIP_RATIOS = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # clipped spans search_range can try (before GPTQ)


def search_range(rows: torch.Tensor, t: GgmlType, weights: Optional[torch.Tensor] = None, steps: int = 20,
                 clip_ratios: Tuple[float, ...] = ()) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block (a row of ``rows`` ``(E, sub)``), the range ``(mn, mx)`` (each ``(E,)``, in the convention of
    :func:`grid_from_range`) whose step (and minimum) give the least ``weights``-weighted squared error.

    The search is llama.cpp's kind (``make_qkx2_quants`` / ``make_qx_quants``): ``steps + 1`` candidate steps
    around the one that spans the sub-block, each giving codes by rounding, then the weighted least-squares step
    (and minimum, kept ≤ 0 as the types store it) for those codes; the min-max range is a candidate too, so the
    result is never worse than min-max before the sub-block scales are quantized. Beyond llama.cpp's, spans
    clipped by each of ``clip_ratios`` (e.g. :data:`CLIP_RATIOS`) are candidates too, refitted the same way. That
    is for codes GPTQ chooses afterwards, which make up for a clipped extreme: measured on SmolLM2, Q4_K_M with
    GPTQ +0.70 % against +0.88 % without them, while round-to-nearest got worse with them (Q3_K_M +7.10 % against
    +6.57 %), since a clipped extreme weight then stays clipped.

    Every candidate of a slice of sub-blocks is evaluated at once, slice by slice, so the temporaries stay
    cache-sized; each candidate's error is its grid's exact error (codes rounded again on the refitted grid), and
    the first candidate of least error wins, as if they were tried one after another."""
    x = rows.to(torch.float32)
    w = None if weights is None else weights.to(torch.float32)
    deltas = [0.0] + [d for d in (-1.0 + 2.0 * k / steps for k in range(steps + 1)) if d != 0.0]
    candidates = [(d, 1.0) for d in deltas] + [(0.0, float(r)) for r in clip_ratios]
    qmin, qmax = t.qmin_qmax
    if t.table:
        base = -IQ4_TABLE[0]
        denominators = [base + 8 * d for d, _ in candidates]
    elif t.symmetric:
        denominators = [-qmin + d for d, _ in candidates]
    else:
        denominators = [qmax + d for d, _ in candidates]
    denom = torch.tensor(denominators, dtype=torch.float32, device=x.device)[:, None]
    ratio = torch.tensor([r for _, r in candidates], dtype=torch.float32, device=x.device)[:, None]
    n, width = x.shape
    mn_out, mx_out = torch.empty(n, device=x.device), torch.empty(n, device=x.device)
    per = max(1, _SEARCH_ELEMENTS // (len(candidates) * max(width, 1)))
    # two work buffers for every slice (fresh temporaries per operation cost more in page faults than in maths)
    bufs = [torch.empty(len(candidates) * min(n, per) * width, device=x.device) for _ in range(2)]
    for a in range(0, n, per):
        b = min(n, a + per)
        work = tuple(buf[:len(candidates) * (b - a) * width].view(len(candidates), b - a, width) for buf in bufs)
        mn_out[a:b], mx_out[a:b] = _search_slice(x[a:b], None if w is None else w[a:b], t, denom, ratio, work)
    return mn_out, mx_out


_SEARCH_ELEMENTS = 1 << 19  # candidates x values evaluated at once by search_range (cache-sized temporaries)


def _search_slice(x, w, t: GgmlType, denom, ratio, work):
    """:func:`search_range` on the sub-blocks ``x`` ``(e, sub)`` with candidates ``denom``/``ratio`` ``(C, 1)``;
    ``work``: two ``(C, e, sub)`` buffers it may overwrite."""
    qmin, qmax = t.qmin_qmax
    full_mn, full_mx = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    mn, mx = full_mn * ratio, full_mx * ratio  # (C, e)
    sign = torch.where(full_mx > -full_mn, -1.0, 1.0)  # a symmetric grid's larger end takes its most negative code
    if t.table or t.symmetric:
        step = sign * torch.maximum(-mn, mx) / denom
        low = torch.zeros_like(step)
    else:
        step = (mx - mn) / denom
        low = -mn
    safe = torch.where(step == 0, torch.ones_like(step), step)[..., None]
    v, tmp = work
    if t.table:
        v.copy_(_nearest_table(x / safe))
    elif t.symmetric:
        torch.div(x, safe, out=v).round_().clamp_(qmin, qmax)
    else:
        torch.sub(x, mn[..., None], out=v).div_(safe).round_().clamp_(0, qmax)
    # refit the step (and minimum) to these codes; the min-max candidate (the first) stays as it is
    fit_step, fit_low = _least_squares(x, w, v, t, step, low, tmp)
    fit_step[0], fit_low[0] = step[0], low[0]
    err = _grid_error(x, w, fit_step, fit_low, t, work)
    # the first candidate of least error (torch.min's index is the first; it is several times argmin's speed here)
    best = torch.min(torch.where(torch.isnan(err), torch.inf, err), dim=0, keepdim=True).indices
    best_step, best_low = fit_step.gather(0, best)[0], fit_low.gather(0, best)[0]
    if t.table:
        a = best_step.abs()
        return torch.where(best_step < 0, IQ4_TABLE[-1] * -a, IQ4_TABLE[0] * a), torch.where(
            best_step < 0, -IQ4_TABLE[0] * a, IQ4_TABLE[-1] * a)
    if t.symmetric:
        a = best_step.abs()
        return torch.where(best_step < 0, -qmax * a, qmin * a), torch.where(best_step < 0, -qmin * a, qmax * a)
    return -best_low, qmax * best_step - best_low


def _least_squares(x, w, v, t: GgmlType, step, low, tmp):
    """The weighted least-squares step (and minimum ≥ 0, value = step·v − low) for codes ``v`` (``(C, e, sub)``;
    ``x`` and ``w`` ``(e, sub)``), ``tmp`` a buffer like ``v``; rows where it is degenerate keep ``step``/``low``.
    (Weighted products are formed in one order, ``(w·v)·v`` and ``(w·x)·v``: their float32 rounding is part of
    the result.)"""
    symmetric = t.symmetric or t.table
    if w is None:
        svv, sxv = torch.mul(v, v, out=tmp).sum(-1), torch.mul(x, v, out=tmp).sum(-1)
    else:
        wx = w * x
        wv = torch.mul(w, v, out=tmp)
        sv = None if symmetric else wv.sum(-1)
        svv = wv.mul_(v).sum(-1)
        sxv = torch.mul(wx, v, out=tmp).sum(-1)
    if symmetric:  # the step keeps its sign (codes were rounded with it)
        ok = svv > 0
        new_step = sxv / torch.where(ok, svv, torch.ones_like(svv))
        ok = ok & (new_step * step > 0)
        return torch.where(ok, new_step, step), low
    if w is None:
        sw, sv, sx = torch.full_like(x[..., 0], x.shape[-1]), v.sum(-1), x.sum(-1)
    else:
        sw, sx = w.sum(-1), wx.sum(-1)
    det = sw * svv - sv * sv
    ok = det > 0
    safe = torch.where(ok, det, torch.ones_like(det))
    new_step = (sw * sxv - sx * sv) / safe
    new_low = -(svv * sx - sv * sxv) / safe  # the minimum is -low
    # a minimum above zero is not stored: refit the step alone with low = 0
    pos = new_low < 0
    alone = sxv / torch.where(svv > 0, svv, torch.ones_like(svv))
    new_step = torch.where(pos, alone, new_step)
    new_low = torch.where(pos, torch.zeros_like(new_low), new_low)
    ok = ok & (new_step > 0)
    return torch.where(ok, new_step, step), torch.where(ok, new_low, low)


def _grid_error(x, w, step, low, t: GgmlType, work):
    """Weighted squared error of rounding ``x`` (``(e, sub)``) to the nearest value of each (unquantized) grid
    ``step``/``low`` (``(C, e)``): ``(C, e)``. ``work``: two ``(C, e, sub)`` buffers it may overwrite. A zero
    step leaves every value at ``-low`` (its codes are multiplied by zero), as the grid holds it."""
    qmin, qmax = t.qmin_qmax
    step, low = step[..., None], low[..., None]
    safe = torch.where(step == 0, torch.ones_like(step), step)
    d, tmp = work
    if t.table:
        d.copy_(_nearest_table(x / safe)).mul_(step)
    elif t.symmetric:  # (no minimum: a zero's sign changes no squared error)
        torch.div(x, safe, out=d).round_().clamp_(qmin, qmax).mul_(step)
    else:
        torch.add(x, low, out=d).div_(safe).round_().clamp_(qmin, qmax).mul_(step).sub_(low)
    d.sub_(x)
    return (torch.mul(d, d, out=tmp) if w is None else torch.mul(w, d, out=tmp).mul_(d)).sum(-1)


def quantize_dequantize(w: torch.Tensor, grid: KGrid) -> torch.Tensor:
    """``dequantize(quantize_codes(w))``: the weight llama.cpp computes with, float32."""
    return dequantize(quantize_codes(w, grid), grid)


def _sub_view(x: torch.Tensor, sub: int) -> torch.Tensor:
    rows, cols = x.shape
    return x.reshape(rows, cols // sub, sub)


def _table(device) -> torch.Tensor:
    return torch.tensor(IQ4_TABLE, dtype=torch.float32, device=device)


def type_levels(grid: KGrid) -> torch.Tensor:
    """Every value each sub-block can hold: ``[rows, cols / sub, n_codes]`` float32, in code order."""
    t = grid.type
    qmin, qmax = t.qmin_qmax
    if t.table:
        return grid.step.unsqueeze(-1) * _table(grid.step.device)
    q = torch.arange(qmin, qmax + 1, dtype=torch.float32, device=grid.step.device)
    return grid.step.unsqueeze(-1) * q - grid.low.unsqueeze(-1)


def quantize_codes(w: torch.Tensor, grid: KGrid) -> torch.Tensor:
    """Round-to-nearest codes of ``w`` (``[rows, cols]``) on ``grid``: ``int32``, signed for a symmetric type
    (for the IQ4 types ``q`` stands for ``IQ4_TABLE[q + 8]``)."""
    t = grid.type
    x = _sub_view(w.to(torch.float32), t.sub)
    qmin, qmax = t.qmin_qmax
    if t.table:
        levels = type_levels(grid)
        idx = (x.unsqueeze(-1) - levels.unsqueeze(-2)).abs().argmin(-1)
        return (idx - 8).reshape(w.shape).to(torch.int32)
    step = grid.step.unsqueeze(-1)
    safe = torch.where(step == 0, torch.ones_like(step), step)
    q = torch.round((x + grid.low.unsqueeze(-1)) / safe).clamp(qmin, qmax)
    q = torch.where(step == 0, torch.zeros_like(q), q)
    return q.reshape(w.shape).to(torch.int32)


def dequantize(codes: torch.Tensor, grid: KGrid) -> torch.Tensor:
    """The float32 values llama.cpp reads back from ``codes`` on ``grid``, in ggml's order of operations."""
    t = grid.type
    q = _sub_view(codes, t.sub)
    step = grid.step.unsqueeze(-1)
    if t.table:
        out = step * _table(codes.device)[q.long() + 8]
    elif t.symmetric:
        out = step * q.to(torch.float32)
    else:
        out = step * q.to(torch.float32) - grid.low.unsqueeze(-1)
    return out.reshape(codes.shape)


# --------------------------------------------------------------------------------------------------------------
# bytes (ggml-common.h): the packer only lays out what snap and the codes chose
# --------------------------------------------------------------------------------------------------------------
def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """float16 values ``[..., n]`` as little-endian bytes ``[..., n, 2]``."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (lo | (hi << 4)).to(torch.uint8)


def _bit_planes(u: torch.Tensor, nb: int) -> torch.Tensor:
    """Q2_K/Q3_K low bits: ``u`` ``[.., 256]`` (values 0..3) → 64 bytes, byte ``32h + l`` holding elements
    ``128h + 32j + l`` at bits ``2j``."""
    v = u.reshape(*u.shape[:-1], 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=u.device).reshape(4, 1)
    return (v << shifts).sum(-2).reshape(*u.shape[:-1], 64).to(torch.uint8)


def _k_scales_6bit(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: eight 6-bit scales and eight 6-bit minima in 12 bytes (``get_scale_min_k4``'s layout)."""
    a = ls[..., :4] | ((ls[..., 4:] >> 4) << 6)
    b = lm[..., :4] | ((lm[..., 4:] >> 4) << 6)
    c = (ls[..., 4:] & 0xF) | ((lm[..., 4:] & 0xF) << 4)
    return torch.cat([a, b, c], -1).to(torch.uint8)


def _q3_scales(ls: torch.Tensor) -> torch.Tensor:
    """Q3_K: sixteen 6-bit scales in 12 bytes: low nibbles of ``j`` and ``j + 8`` in byte ``j``, the top two bits of
    scale ``4k + i`` at bits ``2k`` of byte ``8 + i``."""
    low = (ls[..., :8] & 0xF) | ((ls[..., 8:] & 0xF) << 4)
    top = (ls >> 4).reshape(*ls.shape[:-1], 4, 4)  # [k, i]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=ls.device).reshape(4, 1)
    high = (top << shifts).sum(-2)
    return torch.cat([low, high], -1).to(torch.uint8)


def pack(codes: torch.Tensor, grid: KGrid) -> torch.Tensor:
    """The GGUF bytes of ``codes`` (``[rows, cols]``, from :func:`quantize_codes` or an algorithm) on ``grid``:
    ``uint8 [rows, cols / block * nbytes]``."""
    t = grid.type
    rows, cols = codes.shape
    nb = cols // t.block
    qmin, _ = t.qmin_qmax
    u = (codes.to(torch.int32) - qmin).reshape(rows, nb, t.block)
    d = _half_bytes(grid.d.reshape(rows, nb))
    per = t.block // t.sub
    if t.name == "Q8_0":
        parts = [d, codes.to(torch.int8).reshape(rows, nb, 32).view(torch.uint8)]
    elif t.name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        parts = [d] + ([_half_bytes(grid.dmin.reshape(rows, nb))] if t.name.endswith("_1") else [])
        if t.bits == 5:  # the fifth bit of element j at bit j of a little-endian uint32
            bits = ((u >> 4).to(torch.int64) << torch.arange(32, dtype=torch.int64, device=u.device)).sum(-1)
            parts.append(((bits[..., None] >> torch.tensor([0, 8, 16, 24], device=u.device)) & 0xFF)
                         .to(torch.uint8))
        low = u & 0xF
        parts.append(_nibbles(low[..., :16], low[..., 16:]))
    elif t.name == "IQ4_NL":
        parts = [d, _nibbles(u[..., :16], u[..., 16:])]
    elif t.name == "IQ4_XS":
        ls = grid.sc.reshape(rows, nb, per)
        shifts = 2 * torch.arange(per, dtype=torch.int32, device=ls.device)
        sh = ((ls >> 4) << shifts).sum(-1).to(torch.int32)
        scales_h = torch.stack([sh & 0xFF, sh >> 8], -1).to(torch.uint8)
        scales_l = _nibbles(ls[..., 0::2] & 0xF, ls[..., 1::2] & 0xF)
        v = u.reshape(rows, nb, per, 32)
        qs = _nibbles(v[..., :16], v[..., 16:]).reshape(rows, nb, 128)
        parts = [d, scales_h, scales_l, qs]
    elif t.name == "Q2_K":
        scales = _nibbles(grid.sc.reshape(rows, nb, per), grid.m.reshape(rows, nb, per))
        parts = [scales, _bit_planes(u, nb), d, _half_bytes(grid.dmin.reshape(rows, nb))]
    elif t.name == "Q3_K":
        low = _bit_planes(u & 3, nb)
        hi = (u >> 2).reshape(rows, nb, 8, 32)  # bit 4h + j of byte l: element 128h + 32j + l
        shifts = torch.arange(8, dtype=torch.int32, device=u.device).reshape(8, 1)
        hmask = (hi << shifts).sum(-2).to(torch.uint8)
        parts = [hmask, low, _q3_scales(grid.sc.reshape(rows, nb, per)), d]
    elif t.name in ("Q4_K", "Q5_K"):
        scales = _k_scales_6bit(grid.sc.reshape(rows, nb, per), grid.m.reshape(rows, nb, per))
        v = (u & 0xF).reshape(rows, nb, 4, 2, 32)
        qs = _nibbles(v[..., 0, :], v[..., 1, :]).reshape(rows, nb, 128)
        parts = [d, _half_bytes(grid.dmin.reshape(rows, nb)), scales]
        if t.name == "Q5_K":
            hi = (u >> 4).reshape(rows, nb, 8, 32)  # bit k of byte l: element 32k + l
            shifts = torch.arange(8, dtype=torch.int32, device=u.device).reshape(8, 1)
            parts.append((hi << shifts).sum(-2).to(torch.uint8))
        parts.append(qs)
    elif t.name == "Q6_K":
        v = u.reshape(rows, nb, 2, 4, 32)  # [half, k, l]: element 128h + 32k + l
        low = v & 0xF
        ql = torch.cat([_nibbles(low[..., 0, :], low[..., 2, :]), _nibbles(low[..., 1, :], low[..., 3, :])], -1)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=u.device).reshape(4, 1)
        qh = ((v >> 4) << shifts).sum(-2).to(torch.uint8)
        scales = grid.sc.reshape(rows, nb, per).to(torch.int8).view(torch.uint8)
        parts = [ql.reshape(rows, nb, 128), qh.reshape(rows, nb, 64), scales, d]
    else:  # pragma: no cover - GGML_TYPES lists exactly the branches above
        raise ValueError(t.name)
    parts = [p.reshape(rows, nb, -1) for p in parts]
    return torch.cat(parts, -1).reshape(rows, nb * t.nbytes)
