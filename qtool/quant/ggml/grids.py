"""The two halves a GGML type's maths is made of, as mixins of :class:`~.base.GgmlType`.

Element grids (what a code is worth, in steps):

* :class:`SignedGrid`: ``value = step·q``, ``q`` in ``qmin..qmax`` (Q4_0, Q5_0, Q8_0, Q3_K, Q6_K);
* :class:`MinGrid`: ``value = step·q − low``, ``q`` in ``0..qmax`` (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K);
* :class:`TableGrid`: ``value = step·IQ4_TABLE[q + 8]`` (IQ4_NL, IQ4_XS).

A symmetric grid's larger end takes its most negative level (``qmin``, or the table's ``-127``), through a
negative step when that end is positive, as llama.cpp does: one more level.

Scale storage (how the sub-block steps are kept):

* :class:`BlockScale`: one float16 step (and minimum) per block (the legacy types, IQ4_NL);
* :class:`SignedScales`: signed integer sub-block scales under one float16 ``d`` (Q3_K, Q6_K, IQ4_XS);
* :class:`ScalesAndMins`: unsigned integer scales and minima under float16 ``d`` and ``dmin`` (Q2_K, Q4_K, Q5_K).

Every expression is written as ggml evaluates it (float32, same order): results are compared bit for bit.
"""

from __future__ import annotations

import torch

from ..affine import true_div
from .base import IQ4_TABLE, GgmlType, KGrid, f16, per_sub


def _table(device) -> torch.Tensor:
    return torch.tensor(IQ4_TABLE, dtype=torch.float32, device=device)


def _nearest_table(x: torch.Tensor) -> torch.Tensor:
    """Per value of ``x`` (in steps), the IQ4 table value nearest it."""
    table = torch.tensor(IQ4_TABLE, dtype=x.dtype, device=x.device)
    return table[torch.bucketize(x, (table[1:] + table[:-1]) / 2)]


# --------------------------------------------------------------------------------------------------------------
# element grids
# --------------------------------------------------------------------------------------------------------------
class _Symmetric(GgmlType):
    """No minimum; ``lowest``: the grid's most negative level, in steps."""

    __slots__ = ()
    symmetric = True
    lowest: int

    def wished_step(self, mn, mx):
        amax = torch.maximum(-mn, mx).clamp_min(0)
        return true_div(torch.where(mx > -mn, -amax, amax), -self.lowest), None

    def candidates(self, mn, mx, full_mn, full_mx, denom):
        sign = torch.where(full_mx > -full_mn, -1.0, 1.0)  # the larger end takes the most negative code
        step = sign * torch.maximum(-mn, mx) / denom
        return step, torch.zeros_like(step)

    def values_into(self, x, step, low, safe, out):  # (no minimum: a zero's sign changes no squared error)
        return self.codes_into(x, low, safe, out).mul_(step)


class _Integer(GgmlType):
    """Integer codes ``qmin..qmax``: ``value = step·q − low``."""

    __slots__ = ()

    def levels(self, grid):
        qmin, qmax = self.qmin_qmax
        q = torch.arange(qmin, qmax + 1, dtype=torch.float32, device=grid.step.device)
        return grid.step.unsqueeze(-1) * q - grid.low.unsqueeze(-1)

    def codes(self, x, grid):
        qmin, qmax = self.qmin_qmax
        step = grid.step.unsqueeze(-1)
        safe = torch.where(step == 0, torch.ones_like(step), step)
        q = torch.round((x + grid.low.unsqueeze(-1)) / safe).clamp(qmin, qmax)
        return torch.where(step == 0, torch.zeros_like(q), q).to(torch.int32)


class SignedGrid(_Symmetric, _Integer):
    """``value = step·q``, ``q`` in ``qmin..qmax``."""

    __slots__ = ()

    @property
    def lowest(self) -> int:
        return self.qmin_qmax[0]

    def search_denominator(self, delta):
        return -self.qmin_qmax[0] + delta

    def codes_into(self, x, low, safe, out):
        qmin, qmax = self.qmin_qmax
        return torch.div(x, safe, out=out).round_().clamp_(qmin, qmax)

    def range_of(self, step, low):
        qmin, qmax = self.qmin_qmax
        a = step.abs()
        return torch.where(step < 0, -qmax * a, qmin * a), torch.where(step < 0, -qmin * a, qmax * a)

    def values(self, q, grid):
        return grid.step.unsqueeze(-1) * q.to(torch.float32)


class MinGrid(_Integer):
    """``value = step·q − low``, ``q`` in ``0..qmax``, ``low`` ≥ 0 (the minimum is ``-low``)."""

    __slots__ = ()
    symmetric = False

    def wished_step(self, mn, mx):
        low = (-mn).clamp_min(0)
        return true_div(mx + low, self.qmin_qmax[1]).clamp_min(0), low

    def search_denominator(self, delta):
        return self.qmin_qmax[1] + delta

    def candidates(self, mn, mx, full_mn, full_mx, denom):
        return (mx - mn) / denom, -mn

    def codes_into(self, x, low, safe, out):
        qmin, qmax = self.qmin_qmax
        return torch.add(x, low, out=out).div_(safe).round_().clamp_(qmin, qmax)

    def values_into(self, x, step, low, safe, out):
        return self.codes_into(x, low, safe, out).mul_(step).sub_(low)

    def range_of(self, step, low):
        return -low, self.qmin_qmax[1] * step - low

    def values(self, q, grid):
        return grid.step.unsqueeze(-1) * q.to(torch.float32) - grid.low.unsqueeze(-1)


class TableGrid(_Symmetric):
    """``value = step·IQ4_TABLE[q + 8]``: 4-bit codes ``-8..7`` index the non-uniform table."""

    __slots__ = ()
    table = True
    lowest = IQ4_TABLE[0]

    def search_denominator(self, delta):
        return -IQ4_TABLE[0] + 8 * delta

    def codes_into(self, x, low, safe, out):
        return out.copy_(_nearest_table(x / safe))

    def range_of(self, step, low):
        a = step.abs()
        return torch.where(step < 0, IQ4_TABLE[-1] * -a, IQ4_TABLE[0] * a), torch.where(
            step < 0, -IQ4_TABLE[0] * a, IQ4_TABLE[-1] * a)

    def levels(self, grid):
        return grid.step.unsqueeze(-1) * _table(grid.step.device)

    def codes(self, x, grid):
        idx = (x.unsqueeze(-1) - self.levels(grid).unsqueeze(-2)).abs().argmin(-1)
        return (idx - 8).to(torch.int32)

    def values(self, q, grid):
        return grid.step.unsqueeze(-1) * _table(q.device)[q.long() + 8]


# --------------------------------------------------------------------------------------------------------------
# scale storage
# --------------------------------------------------------------------------------------------------------------
class BlockScale(GgmlType):
    """One float16 step (and float16 minimum ``m``, kept as ``dmin``) per block."""

    __slots__ = ()

    def store(self, step, low):
        d = f16(step)
        m = None if low is None else f16(-low.to(torch.float32))
        return KGrid(self, d, m, None, None, d, torch.zeros_like(d) if m is None else -m)


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
    d = f16(true_div(amax, -levels if negative else levels))
    lo, hi = (-levels, levels - 1) if negative else (0, levels)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    lq = torch.round(s / per_sub(safe, t)).clamp(lo, hi)
    lq = torch.where(per_sub(d, t) == 0, torch.zeros_like(lq), lq)
    return d, lq.to(torch.int32)


class SignedScales(GgmlType):
    """Signed ``scale_bits``-bit sub-block scales under one float16 ``d``, stored plus ``scale_bias``."""

    __slots__ = ()
    signed_scales = True
    scale_bias: int

    def store(self, step, low):
        d, lq = _quantize_scales(step, self, 1 << (self.scale_bits - 1), negative=True)
        sc = lq + self.scale_bias
        eff = per_sub(d, self) * (sc - self.scale_bias).to(torch.float32)
        return KGrid(self, d, None, sc, None, eff, torch.zeros_like(eff))


class ScalesAndMins(GgmlType):
    """Unsigned ``scale_bits``-bit sub-block scales and minima under float16 ``d`` and ``dmin``."""

    __slots__ = ()

    def store(self, step, low):
        levels = (1 << self.scale_bits) - 1
        d, sc = _quantize_scales(step, self, levels, negative=False)
        eff = per_sub(d, self) * sc.to(torch.float32)
        dmin, m = _quantize_scales(low.to(torch.float32).clamp_min(0), self, levels, negative=False)
        lowq = per_sub(dmin, self) * m.to(torch.float32)
        return KGrid(self, d, dmin, sc, m, eff, lowq)
