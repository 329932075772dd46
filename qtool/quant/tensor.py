"""An encoding as a value, and tensors that carry one.

``AffineEncoding`` is (scale, offset, qmin, qmax, symmetric, block_size); min/max are derived from it.
``QuantizedTensor`` holds integer codes (as floats, like AIMET) and ``DequantizedTensor`` real values; both carry
their encoding. Ordinary torch ops on them return plain tensors, except the ones that cannot change the values'
meaning (clone, detach, device moves), which keep the encoding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
from torch._C import DisableTorchFunctionSubclass

from .affine import dequantize, quantize

__all__ = ["AffineEncoding", "QuantizedTensor", "DequantizedTensor"]


@dataclass(frozen=True)
class AffineEncoding:
    scale: torch.Tensor
    offset: torch.Tensor
    qmin: int
    qmax: int
    symmetric: bool
    block_size: Optional[Tuple[int, ...]] = None

    @property
    def bitwidth(self) -> int:
        return (self.qmax - self.qmin).bit_length()

    @property
    def num_steps(self) -> int:
        return self.qmax - self.qmin

    @property
    def signed(self) -> bool:
        return self.qmin < 0

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.scale.shape)

    @property
    def min(self) -> torch.Tensor:
        """Effective lower end of the range: ``(offset + qmin) * scale``."""
        return (self.offset + self.qmin) * self.scale

    @property
    def max(self) -> torch.Tensor:
        """Effective upper end of the range: ``(offset + qmax) * scale``."""
        return (self.offset + self.qmax) * self.scale

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return quantize(x, self.scale, self.offset, qmin=self.qmin, qmax=self.qmax, block_size=self.block_size)

    def dequantize(self, q: torch.Tensor) -> torch.Tensor:
        return dequantize(q, self.scale, self.offset, block_size=self.block_size)

    def int_dtype(self) -> torch.dtype:
        """The smallest integer dtype that holds every code of the grid."""
        for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
            info = torch.iinfo(dtype)
            if info.min <= self.qmin and self.qmax <= info.max:
                return dtype
        return torch.int64

    def to(self, *args, **kwargs) -> "AffineEncoding":
        return replace(self, scale=self.scale.to(*args, **kwargs), offset=self.offset.to(*args, **kwargs))

    def detach(self) -> "AffineEncoding":
        return replace(self, scale=self.scale.detach(), offset=self.offset.detach())


_KEEP_ENCODING = {
    torch.Tensor.clone,
    torch.clone,
    torch.Tensor.detach,
    torch.detach,
    torch.Tensor.cpu,
    torch.Tensor.cuda,
    torch.Tensor.to,
    torch.Tensor.float,  # (dtype moves by name: .double() dropped what .to(torch.float64) kept)
    torch.Tensor.double,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.contiguous,
    torch.Tensor.requires_grad_,
}
_DEVICE_MOVES = {torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.to}


class _EncodedTensor(torch.Tensor):
    encoding: Optional[AffineEncoding]

    @classmethod
    def wrap(cls, data: torch.Tensor, encoding: AffineEncoding):
        out = data.as_subclass(cls)
        out.encoding = encoding
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func in _KEEP_ENCODING and args and isinstance(args[0], _EncodedTensor) and isinstance(result, torch.Tensor):
            enc = args[0].encoding
            if enc is not None and func in _DEVICE_MOVES:
                enc = enc.to(result.device)
            if enc is not None and func in (torch.Tensor.detach, torch.detach):
                enc = enc.detach()
            if result.is_floating_point() and (enc is None or args[0]._holds(enc, args[0].dtype, result.dtype)):
                return type(args[0]).wrap(result, enc)
        return _strip(result)

    @staticmethod
    def _holds(enc: AffineEncoding, src: torch.dtype, dst: torch.dtype) -> bool:
        """Whether values of ``src`` cast to ``dst`` keep the meaning ``enc`` gives them: every ``src`` value exact
        in ``dst`` (the same dtype, or a wider float)."""
        a, b = torch.finfo(src), torch.finfo(dst)
        return src == dst or (b.eps <= a.eps and b.max >= a.max and b.smallest_normal <= a.smallest_normal)

    def quantized_repr(self) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover - abstract

    def __repr__(self, *, tensor_contents=None):
        with DisableTorchFunctionSubclass():
            body = torch.Tensor.__repr__(self.as_subclass(torch.Tensor))
        return f"{type(self).__name__}({body}, bitwidth={self.encoding.bitwidth if self.encoding else None})"


def _strip(obj):
    if isinstance(obj, _EncodedTensor):
        return obj.as_subclass(torch.Tensor)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_strip(o) for o in obj)
    return obj


class QuantizedTensor(_EncodedTensor):
    """Integer codes of ``encoding`` stored as floats (AIMET's representation)."""

    @staticmethod
    def _holds(enc: AffineEncoding, src: torch.dtype, dst: torch.dtype) -> bool:
        """Integer codes survive any float that holds every integer of the grid (bfloat16: 8-bit grids)."""
        return max(abs(enc.qmin), abs(enc.qmax)) <= 2 / torch.finfo(dst).eps

    def quantize(self) -> "QuantizedTensor":
        return self

    def dequantize(self) -> "DequantizedTensor":
        codes = self.as_subclass(torch.Tensor)
        return DequantizedTensor.wrap(self.encoding.dequantize(codes), self.encoding)

    def quantized_repr(self) -> torch.Tensor:
        """The codes as integers in the smallest fitting dtype (int8/uint8 up to 8 bits)."""
        return self.as_subclass(torch.Tensor).to(self.encoding.int_dtype())


class DequantizedTensor(_EncodedTensor):
    """Real values that lie on the grid of ``encoding``."""

    def quantize(self) -> QuantizedTensor:
        return QuantizedTensor.wrap(self.encoding.quantize(self.as_subclass(torch.Tensor)), self.encoding)

    def dequantize(self) -> "DequantizedTensor":
        return self

    def quantized_repr(self) -> torch.Tensor:
        return self.quantize().quantized_repr()
