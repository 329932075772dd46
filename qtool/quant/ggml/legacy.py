"""llama.cpp's legacy block types and IQ4_NL, one class each: blocks of 32 elements with one float16 scale ``d``
(and float16 minimum ``m`` for Q4_1/Q5_1: value ``q·d + m``). ``block_parts`` lays the fields out as
``ggml-common.h``'s ``block_q4_0`` … ``block_q8_0`` / ``block_iq4_nl`` declare them."""

from __future__ import annotations

import torch

from .base import nibbles
from .grids import BlockScale, MinGrid, SignedGrid, TableGrid


def _low_nibbles(u: torch.Tensor) -> torch.Tensor:
    """The low four bits of a 32-element block's codes ``u`` in 16 bytes: element ``j`` and ``j + 16`` in byte
    ``j``."""
    low = u & 0xF
    return nibbles(low[..., :16], low[..., 16:])


def _fifth_bits(u: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's ``qh``: the fifth bit of element ``j`` at bit ``j`` of a little-endian uint32, i.e. bit
    ``j % 8`` of byte ``j // 8``."""
    bits = (u >> 4).reshape(*u.shape[:-1], 4, 8)
    return (bits << torch.arange(8, dtype=u.dtype, device=u.device)).sum(-1).to(torch.uint8)


class Q8_0(SignedGrid, BlockScale):
    __slots__ = ()
    bits, sub, block, nbytes = 8, 32, 32, 34

    def block_parts(self, b):
        rows, nb = b.u.shape[:2]
        return [b.d, b.codes.to(torch.int8).reshape(rows, nb, 32).view(torch.uint8)]


class Q5_0(SignedGrid, BlockScale):
    __slots__ = ()
    bits, sub, block, nbytes = 5, 32, 32, 22

    def block_parts(self, b):
        return [b.d, _fifth_bits(b.u), _low_nibbles(b.u)]


class Q5_1(MinGrid, BlockScale):
    __slots__ = ()
    bits, sub, block, nbytes = 5, 32, 32, 24

    def block_parts(self, b):
        return [b.d, b.dmin, _fifth_bits(b.u), _low_nibbles(b.u)]


class Q4_0(SignedGrid, BlockScale):
    __slots__ = ()
    bits, sub, block, nbytes = 4, 32, 32, 18

    def block_parts(self, b):
        return [b.d, _low_nibbles(b.u)]


class Q4_1(MinGrid, BlockScale):
    __slots__ = ()
    bits, sub, block, nbytes = 4, 32, 32, 20

    def block_parts(self, b):
        return [b.d, b.dmin, _low_nibbles(b.u)]


class IQ4_NL(TableGrid, BlockScale):
    """``value = d·IQ4_TABLE[q]``."""

    __slots__ = ()
    bits, sub, block, nbytes = 4, 32, 32, 18

    def block_parts(self, b):
        return [b.d, nibbles(b.u[..., :16], b.u[..., 16:])]
