"""llama.cpp's block types as grids: pure tensor functions for the K-quants (Q2_K … Q6_K) and the IQ4 types.

A GGUF weight row is cut into blocks along its input dimension. A legacy block (Q4_0 … Q8_0, IQ4_NL) is 32
elements with one float16 scale ``d`` (and float16 minimum ``m`` for Q4_1/Q5_1: value ``q·d + m``). A K-quant
super-block is 256 elements with float16 ``d`` (and ``dmin`` where the grid has a minimum) and one small-integer
scale (and minimum) per sub-block of 16 or 32 elements, so the grid a weight sees exists only once the sub-block
scales are themselves quantized::

    Q2_K      value = (d·sc)·q − dmin·m      q 0..3,   sc, m 4-bit,     sub-blocks of 16
    Q3_K      value = (d·(sc−32))·q          q −4..3,  sc 6-bit,        sub-blocks of 16
    Q4_K/Q5_K value = (d·sc)·q − dmin·m      q 0..15 / 0..31, sc, m 6-bit, sub-blocks of 32
    Q6_K      value = (d·sc)·q               q −32..31, sc int8,        sub-blocks of 16
    IQ4_NL    value = d·T[q]                 T = ``IQ4_TABLE``'s 16 values, blocks of 32
    IQ4_XS    value = (d·(sc−32))·T[q]       sc 6-bit,                sub-blocks of 32

Each formula is evaluated in float32 in ggml's own order (``dequantize`` here equals ``ggml_dequantize_row_*``
and gguf-py's ``dequantize`` bit for bit; tests prove it). A quantizer of such a type keeps one float step (and
minimum) per sub-block, as its analyzer chose it; :func:`snap` turns those into the stored integers and the exact
effective steps, and every consumer (fake-quant, GPTQ, the GGUF packer) starts from that one result.
:func:`pack` only lays bytes out as ``ggml-common.h`` declares the blocks.

Each type is one class (gguf-py's ``quants.py`` style) holding its facts, its grid maths and its byte layout:
``legacy`` (Q4_0 … Q8_0, IQ4_NL) and ``kquants`` (Q2_K … Q6_K, IQ4_XS), built from the element grids and
scale storage in ``grids`` on the base record in ``base``; ``search`` is the range search they share. Adding a
type is adding its class and its entry in :data:`GGML_TYPES`. The functions here are the public interface;
they hold no state.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ..affine import UnrepresentableScale
from .base import IQ4_TABLE, QK_K, Blocks, GgmlType, KGrid
from .kquants import IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from .legacy import IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
from .search import CLIP_RATIOS, search_range
from .superblock import weighted_steps

__all__ = ["GgmlType", "GGML_TYPES", "KGrid", "IQ4_TABLE", "QK_K", "CLIP_RATIOS", "ggml_type", "snap",
           "grid_from_range", "search_range", "weighted_steps", "quantize_codes", "dequantize", "quantize_dequantize",
           "pack", "type_levels"]

GGML_TYPES: Dict[str, GgmlType] = {t.name: t for t in (
    Q8_0(), Q5_0(), Q5_1(), Q4_0(), Q4_1(), Q2_K(), Q3_K(), Q4_K(), Q5_K(), Q6_K(), IQ4_NL(), IQ4_XS(),
)}


def ggml_type(name: str) -> GgmlType:
    try:
        return GGML_TYPES[name.upper()]
    except KeyError:
        raise ValueError(f"unknown GGUF type {name!r} (one of {', '.join(GGML_TYPES)})") from None


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
    grid = t.store(step, low)
    if bool(torch.isinf(grid.d).any()) or (grid.dmin is not None and bool(torch.isinf(grid.dmin).any())):
        raise UnrepresentableScale("a scale is beyond float16's range (65504), which GGUF stores")
    return grid


def grid_from_range(mn: torch.Tensor, mx: torch.Tensor, t: GgmlType) -> KGrid:
    """The grid of a quantizer whose analyzer chose the sub-block ranges ``[mn, mx]`` (``[rows, cols / sub]``):
    the wished-for step covers the range (an asymmetric type's minimum is ``-mn``; a symmetric block's larger end
    takes the most negative code, ``qmin`` or the IQ4 table's ``-127``, through a negative step when that end is
    positive, as llama.cpp does), then :func:`snap` stores it as the type does."""
    step, low = t.wished_step(mn.to(torch.float32), mx.to(torch.float32))
    return snap(step, low, t)


def quantize_dequantize(w: torch.Tensor, grid: KGrid) -> torch.Tensor:
    """``dequantize(quantize_codes(w))``: the weight llama.cpp computes with, float32."""
    return dequantize(quantize_codes(w, grid), grid)


def _sub_view(x: torch.Tensor, sub: int) -> torch.Tensor:
    rows, cols = x.shape
    return x.reshape(rows, cols // sub, sub)


def type_levels(grid: KGrid) -> torch.Tensor:
    """Every value each sub-block can hold: ``[rows, cols / sub, n_codes]`` float32, in code order."""
    return grid.type.levels(grid)


_ROW_CHUNK_VALUES = 1 << 20  # values per slice of rows in quantize_codes / pack (cache-sized temporaries)


def _row_chunks(shape):
    """Row ranges of a ``[rows, cols]`` weight, about :data:`_ROW_CHUNK_VALUES` values each."""
    rows, cols = shape
    per = max(1, _ROW_CHUNK_VALUES // max(cols, 1))
    return [(a, min(rows, a + per)) for a in range(0, rows, per)]


def quantize_codes(w: torch.Tensor, grid: KGrid) -> torch.Tensor:
    """Round-to-nearest codes of ``w`` (``[rows, cols]``) on ``grid``: ``int32``, signed for a symmetric type
    (for the IQ4 types ``q`` stands for ``IQ4_TABLE[q + 8]``). Slice by slice of rows (each row's codes depend on
    that row alone)."""
    out = torch.empty(w.shape, dtype=torch.int32, device=w.device)
    for a, b in _row_chunks(w.shape):
        part = w[a:b].to(torch.float32)
        out[a:b] = grid.type.codes(_sub_view(part, grid.type.sub), grid.rows(a, b)).reshape(part.shape)
    return out


def dequantize(codes: torch.Tensor, grid: KGrid) -> torch.Tensor:
    """The float32 values llama.cpp reads back from ``codes`` on ``grid``, in ggml's order of operations."""
    return grid.type.values(_sub_view(codes, grid.type.sub), grid).reshape(codes.shape)


def pack(codes: torch.Tensor, grid: KGrid) -> torch.Tensor:
    """The GGUF bytes of ``codes`` (``[rows, cols]``, from :func:`quantize_codes` or an algorithm) on ``grid``:
    ``uint8 [rows, cols / block * nbytes]``, each block's fields as the type's ``block_parts`` lays them out."""
    t = grid.type
    rows, cols = codes.shape
    nb = cols // t.block
    out = torch.empty(rows, nb * t.nbytes, dtype=torch.uint8, device=codes.device)
    for a, b in _row_chunks(codes.shape):
        parts = [p.reshape(b - a, nb, -1) for p in t.block_parts(Blocks.of(codes[a:b], grid.rows(a, b)))]
        torch.cat(parts, -1, out=out[a:b].view(b - a, nb, t.nbytes))
    return out
