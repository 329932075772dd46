"""torchao-compatible ``quantize_affine`` / ``dequantize_affine`` (bit-exact with torchao's definitions).

Here ``block_size`` names the extent of one block in every input dim (torchao's convention): per-tensor is the
input shape itself, per-channel on axis 0 of ``(O, I)`` is ``(1, I)``, groups of 32 on the last dim are ``(1, 32)``.
``zero_point`` follows torchao (``real = (q - zero_point) * scale``), the negation of AIMET's offset.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional, Sequence, Union

import torch

__all__ = ["ZeroPointDomain", "quantize_affine", "dequantize_affine", "block_size_to_aimet"]


class ZeroPointDomain(Enum):
    INT = "int"
    FLOAT = "float"
    NONE = "none"


def _domain(value: Union[str, ZeroPointDomain, None]) -> ZeroPointDomain:
    if value is None:
        return ZeroPointDomain.NONE
    if isinstance(value, ZeroPointDomain):
        return value
    name = getattr(value, "name", value)  # accepts torchao's own enum too
    try:
        return ZeroPointDomain(str(name).lower())
    except ValueError:
        raise ValueError(f"zero_point_domain must be 'int', 'float' or 'none', got {value!r}") from None


def _block_views(input_shape: Sequence[int], block_size: Sequence[int]):
    if len(block_size) != len(input_shape):
        raise ValueError(f"block_size {tuple(block_size)} must have one entry per input dim {tuple(input_shape)}")
    x_view, enc_view = [], []
    for d, (n, b) in enumerate(zip(input_shape, block_size)):
        if b <= 0 or n % b:
            raise ValueError(f"block size {b} does not divide input dim {d} of size {n}")
        x_view += [n // b, b]
        enc_view += [n // b, 1]
    return x_view, enc_view


def _blocked(input: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor,
             zero_point: Optional[torch.Tensor]):
    """``input`` viewed as ``[n0 / b0, b0, n1 / b1, b1, ...]`` and its encoding tensors as ``[n0 / b0, 1, ...]``,
    so one broadcast applies each block's scale and zero point."""
    x_view, enc_view = _block_views(input.shape, block_size)
    return (input.reshape(x_view), scale.reshape(enc_view),
            None if zero_point is None else zero_point.reshape(enc_view))


def _dtype_range(dtype: torch.dtype, quant_min, quant_max):
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
    else:
        info = torch.iinfo(dtype)
    qmin = int(info.min) if quant_min is None else quant_min
    qmax = int(info.max) if quant_max is None else quant_max
    return qmin, qmax


def block_size_to_aimet(input_shape: Sequence[int], block_size: Sequence[int]):
    """torchao block extents -> AIMET ``(shape, block_size)`` describing the same blocks."""
    shape = tuple(n // b for n, b in zip(input_shape, block_size))
    return shape, tuple(int(b) for b in block_size)


def quantize_affine(
    input: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    output_dtype: torch.dtype,
    quant_min: Optional[int] = None,
    quant_max: Optional[int] = None,
    zero_point_domain: Union[str, ZeroPointDomain, None] = "int",
) -> torch.Tensor:
    """INT domain: ``clamp(round(x * (1/scale)) + zero_point, qmin, qmax)``; FLOAT domain:
    ``clamp(round((x - (zero_point - scale * mid)) / scale), qmin, qmax)`` with ``mid = (qmin + qmax + 1) / 2``."""
    if input.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"quantize_affine takes float32/float16/bfloat16 input, got {input.dtype}")
    domain = _domain(zero_point_domain)
    qmin, qmax = _dtype_range(output_dtype, quant_min, quant_max)
    x, scale, zero_point = _blocked(input, block_size, scale, zero_point)
    if domain is ZeroPointDomain.INT:
        q = torch.round(x * (1.0 / scale))
        if zero_point is not None:
            q = q + zero_point
        q = torch.clamp(q, qmin, qmax)
    elif domain is ZeroPointDomain.FLOAT:
        if zero_point is None:
            raise ValueError("zero_point_domain='float' needs a zero_point")
        mid = (qmax + qmin + 1) / 2
        min_val = zero_point - scale * mid
        q = torch.clamp(torch.round((x - min_val) / scale), qmin, qmax)
    else:
        if zero_point is not None:
            raise ValueError("zero_point must be None when zero_point_domain is 'none'")
        q = torch.clamp(torch.round(x * (1.0 / scale)), qmin, qmax)
    return q.to(output_dtype).reshape(input.shape)


def dequantize_affine(
    input: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    input_dtype: torch.dtype,
    quant_min: Optional[int] = None,
    quant_max: Optional[int] = None,
    zero_point_domain: Union[str, ZeroPointDomain, None] = "int",
    *,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """INT domain: ``(q - zero_point) * scale``; FLOAT domain: ``(q - mid) * scale + zero_point``."""
    if input.dtype != input_dtype:
        raise ValueError(f"input dtype {input.dtype} does not match input_dtype {input_dtype}")
    domain = _domain(zero_point_domain)
    qmin, qmax = _dtype_range(input_dtype, quant_min, quant_max)
    q, scale, zero_point = _blocked(input, block_size, scale, zero_point)
    if domain is ZeroPointDomain.INT:
        dq = q.to(torch.int32)
        if zero_point is not None:
            dq = dq - zero_point.to(torch.int32)
        dq = dq.to(output_dtype) * scale
    elif domain is ZeroPointDomain.FLOAT:
        if zero_point is None:
            raise ValueError("zero_point_domain='float' needs a zero_point")
        mid = (qmax + qmin + 1) / 2
        dq = (q.to(output_dtype) - mid) * scale + zero_point
    else:
        dq = q.to(output_dtype) * scale
    return dq.to(output_dtype).reshape(input.shape)
