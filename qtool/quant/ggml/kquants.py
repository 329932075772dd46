"""llama.cpp's K-quants and IQ4_XS, one class each: super-blocks of ``QK_K`` = 256 elements with float16 ``d``
(and ``dmin`` where the grid has a minimum) and one small-integer scale (and minimum) per sub-block of 16 or 32
elements. ``block_parts`` lays the fields out as ``ggml-common.h``'s ``block_q2_K`` … ``block_q6_K`` /
``block_iq4_xs`` declare them."""

from __future__ import annotations

import torch

from .base import QK_K, nibbles
from .grids import MinGrid, ScalesAndMins, SignedGrid, SignedScales, TableGrid


def _bit_planes(u: torch.Tensor) -> torch.Tensor:
    """Two bits per element: ``u`` ``[.., 256]`` (values 0..3) → 64 bytes, byte ``32h + l`` holding elements
    ``128h + 32j + l`` at bits ``2j`` (Q2_K/Q3_K's ``qs``, Q6_K's ``qh``)."""
    v = u.reshape(*u.shape[:-1], 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=u.device).reshape(4, 1)
    return (v << shifts).sum(-2).reshape(*u.shape[:-1], 64).to(torch.uint8)


def _high_bits(h: torch.Tensor) -> torch.Tensor:
    """One bit per element: ``h`` ``[rows, nb, 256]`` (values 0..1) → 32 bytes, bit ``k`` of byte ``l`` holding
    element ``32k + l`` (Q3_K's ``hmask``, Q5_K's ``qh``)."""
    hi = h.reshape(*h.shape[:-1], 8, 32)
    shifts = torch.arange(8, dtype=torch.int32, device=h.device).reshape(8, 1)
    return (hi << shifts).sum(-2).to(torch.uint8)


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


def _q45_k_parts(b, high):
    """Q4_K/Q5_K: ``d``, ``dmin``, the 12 scale bytes, ``high`` (Q5_K's fifth bits), then the low nibbles, elements
    ``64j + l`` and ``64j + 32 + l`` in byte ``32j + l``."""
    rows, nb = b.u.shape[:2]
    scales = _k_scales_6bit(b.per_block(b.grid.sc), b.per_block(b.grid.m))
    v = (b.u & 0xF).reshape(rows, nb, 4, 2, 32)
    qs = nibbles(v[..., 0, :], v[..., 1, :]).reshape(rows, nb, 128)
    return [b.d, b.dmin, scales] + high + [qs]


class Q2_K(MinGrid, ScalesAndMins):
    """``value = (d·sc)·q − dmin·m``, ``q`` 0..3, ``sc``, ``m`` 4-bit, sub-blocks of 16."""

    __slots__ = ()
    bits, sub, block, nbytes, scale_bits = 2, 16, QK_K, 84, 4
    weighted_scales = True

    def block_parts(self, b):
        scales = nibbles(b.per_block(b.grid.sc), b.per_block(b.grid.m))
        return [scales, _bit_planes(b.u), b.d, b.dmin]


class Q3_K(SignedGrid, SignedScales):
    """``value = (d·(sc−32))·q``, ``q`` −4..3, ``sc`` 6-bit, sub-blocks of 16."""

    __slots__ = ()
    bits, sub, block, nbytes, scale_bits, scale_bias = 3, 16, QK_K, 110, 6, 32
    weighted_scales = True

    def block_parts(self, b):
        return [_high_bits(b.u >> 2), _bit_planes(b.u & 3), _q3_scales(b.per_block(b.grid.sc)), b.d]


class Q4_K(MinGrid, ScalesAndMins):
    """``value = (d·sc)·q − dmin·m``, ``q`` 0..15, ``sc``, ``m`` 6-bit, sub-blocks of 32."""

    __slots__ = ()
    bits, sub, block, nbytes, scale_bits = 4, 32, QK_K, 144, 6
    weighted_scales = True

    def block_parts(self, b):
        return _q45_k_parts(b, [])


class Q5_K(MinGrid, ScalesAndMins):
    """``value = (d·sc)·q − dmin·m``, ``q`` 0..31, ``sc``, ``m`` 6-bit, sub-blocks of 32."""

    __slots__ = ()
    bits, sub, block, nbytes, scale_bits = 5, 32, QK_K, 176, 6
    weighted_scales = True

    def block_parts(self, b):
        return _q45_k_parts(b, [_high_bits(b.u >> 4)])


class Q6_K(SignedGrid, SignedScales):
    """``value = (d·sc)·q``, ``q`` −32..31, ``sc`` int8, sub-blocks of 16."""

    __slots__ = ()
    bits, sub, block, nbytes, scale_bits, scale_bias = 6, 16, QK_K, 210, 8, 0

    def block_parts(self, b):
        rows, nb = b.u.shape[:2]
        low = (b.u & 0xF).reshape(rows, nb, 2, 4, 32)  # [half, k, l]: element 128h + 32k + l
        ql = torch.cat([nibbles(low[..., 0, :], low[..., 2, :]), nibbles(low[..., 1, :], low[..., 3, :])], -1)
        scales = b.per_block(b.grid.sc).to(torch.int8).view(torch.uint8)
        return [ql.reshape(rows, nb, 128), _bit_planes(b.u >> 4), scales, b.d]


class IQ4_XS(TableGrid, SignedScales):
    """``value = (d·(sc−32))·T[q]``, ``sc`` 6-bit, sub-blocks of 32."""

    __slots__ = ()
    bits, sub, block, nbytes, scale_bits, scale_bias = 4, 32, QK_K, 136, 6, 32

    def block_parts(self, b):
        rows, nb = b.u.shape[:2]
        per = self.block // self.sub
        ls = b.per_block(b.grid.sc)
        shifts = 2 * torch.arange(per, dtype=torch.int32, device=ls.device)
        sh = ((ls >> 4) << shifts).sum(-1).to(torch.int32)
        scales_h = torch.stack([sh & 0xFF, sh >> 8], -1).to(torch.uint8)
        scales_l = nibbles(ls[..., 0::2] & 0xF, ls[..., 1::2] & 0xF)
        v = b.u.reshape(rows, nb, per, 32)
        qs = nibbles(v[..., :16], v[..., 16:]).reshape(rows, nb, 128)
        return [b.d, scales_h, scales_l, qs]
