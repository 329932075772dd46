"""What every GGML type is made of: the type record a class per type fills in (:class:`GgmlType`), the grid a
weight's stored scales make (:class:`KGrid`), a weight cut into stored blocks for packing (:class:`Blocks`), and
the small float16 and byte helpers the types share. Pure functions; a type instance holds no state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

QK_K = 256  # elements of a K-quant super-block
IQ4_TABLE = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class GgmlType:
    """One GGUF block type as a grid. A concrete type is one class (its name is the type's name) that sets its
    facts as class attributes and inherits its maths from one element grid (``grids.SignedGrid``, ``MinGrid``,
    ``TableGrid``) and one way of storing scales (``grids.BlockScale``, ``SignedScales``, ``ScalesAndMins``);
    it adds its byte layout, :meth:`block_parts`.

    Facts: codes ``qmin..qmax`` (or indices into ``IQ4_TABLE``), ``sub`` elements per scale, ``block`` elements
    per stored block of ``nbytes`` bytes, and how its sub-block scales are stored (``scale_bits``: the integer
    scale of a K-quant, ``None``: one float16 per block). Instances are stateless and immutable; two are equal
    when they are of the same class."""

    __slots__ = ()
    bits: int
    symmetric: bool  # no minimum: value = step * q
    sub: int
    block: int
    nbytes: int
    scale_bits: Optional[int] = None
    signed_scales: bool = False  # sub-block scales stored with a bias (Q3_K, IQ4_XS) or as int8 (Q6_K)
    table: bool = False  # code q is IQ4_TABLE[q + 8]
    weighted_scales: bool = False  # with importances, the super-block scale is searched (superblock.py)

    @property
    def name(self) -> str:
        return type(self).__name__

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

    def __eq__(self, other) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{self.name}()"

    # --- what a class per type provides (through its grid and scale mixins, then its own layout) -------------
    def store(self, step: torch.Tensor, low: Optional[torch.Tensor]) -> "KGrid":
        """The stored scales for wished-for sub-block steps (float32) and minima: ``snap`` without its checks."""
        raise NotImplementedError

    def wished_step(self, mn: torch.Tensor, mx: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(step, low)`` whose grid covers the sub-block ranges ``[mn, mx]`` (float32), before storing."""
        raise NotImplementedError

    def search_denominator(self, delta: float) -> float:
        """The span in steps of ``search_range``'s candidate ``delta`` (a fraction of one level)."""
        raise NotImplementedError

    def candidates(self, mn, mx, full_mn, full_mx, denom) -> Tuple[torch.Tensor, torch.Tensor]:
        """``search_range``'s candidate ``(step, low)`` ``(C, e)`` for the spans ``[mn, mx]`` ``(C, e)`` of sub-blocks
        whose whole ranges are ``[full_mn, full_mx]`` ``(e,)``, with ``denom`` ``(C, 1)`` steps across."""
        raise NotImplementedError

    def codes_into(self, x, low, safe, out) -> torch.Tensor:
        """``out`` := the codes (IQ4: table values) nearest ``x`` on the unquantized grid of step ``safe`` (not zero)
        and minimum ``low``, in steps; returns ``out``."""
        raise NotImplementedError

    def values_into(self, x, step, low, safe, out) -> torch.Tensor:
        """``out`` := the values nearest ``x`` on the unquantized grid ``step``/``low`` (``safe``: ``step`` with
        zeros replaced by one); returns ``out``."""
        raise NotImplementedError

    def range_of(self, step: torch.Tensor, low: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The range ``(mn, mx)`` (``grid_from_range``'s convention) a grid ``step``/``low`` spans."""
        raise NotImplementedError

    def levels(self, grid: "KGrid") -> torch.Tensor:
        """``type_levels``: every value each sub-block can hold, in code order."""
        raise NotImplementedError

    def codes(self, x: torch.Tensor, grid: "KGrid") -> torch.Tensor:
        """``quantize_codes`` on sub-blocks ``x`` ``[rows, cols / sub, sub]``: int32 codes, same shape."""
        raise NotImplementedError

    def values(self, q: torch.Tensor, grid: "KGrid") -> torch.Tensor:
        """``dequantize`` of sub-blocks of codes ``q`` ``[rows, cols / sub, sub]`` in ggml's order: float32."""
        raise NotImplementedError

    def block_parts(self, b: "Blocks") -> List[torch.Tensor]:
        """The fields of each stored block in ``ggml-common.h``'s order, each ``[rows, nb, ...]`` uint8."""
        raise NotImplementedError


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

    def rows(self, start: int, stop: int) -> "KGrid":
        """The grid of rows ``start:stop`` of the weight."""
        part = lambda v: None if v is None else v[start:stop]
        return KGrid(self.type, part(self.d), part(self.dmin), part(self.sc), part(self.m), part(self.step),
                     part(self.low))

    def step_offset(self, shape) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(step, offset)`` in ``shape`` (the encoding's): the effective step, and the minimum in steps
        (``-low / step``; not an integer for Q4_K) as AIMET's ``(scale, offset)`` would put them."""
        step = self.step.reshape(shape)
        return step, -self.low.reshape(shape) / torch.where(step == 0, torch.ones_like(step), step)


@dataclass(frozen=True)
class Blocks:
    """A ``[rows, cols]`` weight's codes on ``grid`` cut into its ``nb`` stored blocks per row: what every byte
    layout starts from. ``u``: ``[rows, nb, block]`` int32, the codes less ``qmin`` (IQ4: the table index)."""

    codes: torch.Tensor
    grid: KGrid
    u: torch.Tensor

    @classmethod
    def of(cls, codes: torch.Tensor, grid: KGrid) -> "Blocks":
        t = grid.type
        rows, cols = codes.shape
        qmin, _ = t.qmin_qmax
        return cls(codes, grid, (codes.to(torch.int32) - qmin).reshape(rows, cols // t.block, t.block))

    @property
    def d(self) -> torch.Tensor:
        """Each block's float16 ``d`` as bytes ``[rows, nb, 2]``."""
        return _half_bytes(self.grid.d.reshape(self.u.shape[:2]))

    @property
    def dmin(self) -> torch.Tensor:
        """Each block's float16 ``dmin`` (legacy: ``m``) as bytes ``[rows, nb, 2]``."""
        return _half_bytes(self.grid.dmin.reshape(self.u.shape[:2]))

    def per_block(self, x: torch.Tensor) -> torch.Tensor:
        """Sub-block integers ``[rows, cols / sub]`` (``grid.sc``, ``grid.m``) as ``[rows, nb, block / sub]``."""
        t = self.grid.type
        return x.reshape(*self.u.shape[:2], t.block // t.sub)


def f16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to float16, as float32."""
    return x.to(torch.float16).to(torch.float32)


def per_sub(x: torch.Tensor, t: GgmlType) -> torch.Tensor:
    """A per-block tensor repeated for each of its sub-blocks."""
    return x.repeat_interleave(t.block // t.sub, dim=-1)


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """float16 values ``[..., n]`` as little-endian bytes ``[..., n, 2]``."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Two 4-bit tensors in one byte tensor: ``lo`` in the low nibble."""
    return (lo | (hi << 4)).to(torch.uint8)
