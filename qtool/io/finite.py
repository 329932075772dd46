"""The last check before numbers reach a file: every value finite, and within the range of the type it is stored
as. Writers call these on each tensor; a failure names the tensor and is the input's fault (exit 2), so nothing is
written. One pass over the values (``aminmax`` propagates NaN), no copy of the tensor."""

from __future__ import annotations

import torch

from ..errors import UsageError

__all__ = ["UnstorableValues", "all_finite", "check_finite", "storable"]

_FP8_NAN_BITS = {}  # float8 dtype -> (mask, pattern) of its NaN/Inf encodings (aminmax has no float8 kernels)
if hasattr(torch, "float8_e4m3fn"):
    _FP8_NAN_BITS[torch.float8_e4m3fn] = (0x7F, 0x7F)  # E4M3FN: no infinities, S.1111.111 is NaN
    _FP8_NAN_BITS[torch.float8_e5m2] = (0x7C, 0x7C)  # E5M2: an all-ones exponent is Inf or NaN
    _FP8_NAN_BITS[torch.float8_e4m3fnuz] = (0xFF, 0x80)  # the FNUZ types: no infinities, "negative zero" is NaN
    _FP8_NAN_BITS[torch.float8_e5m2fnuz] = (0xFF, 0x80)


class UnstorableValues(UsageError):
    """A tensor about to be written holds NaN/Inf, or values its stored type cannot hold."""


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite (integer tensors always are; float8 and complex ones included)."""
    if t.numel() == 0:
        return True
    if t.is_complex():
        return bool(torch.isfinite(t).all())
    if not t.is_floating_point():
        return True
    if t.dtype in _FP8_NAN_BITS:
        mask, pattern = _FP8_NAN_BITS[t.dtype]
        return not bool(((t.view(torch.uint8) & mask) == pattern).any())
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def check_finite(name: str, t: torch.Tensor, hint: str = "") -> None:
    """Raise :class:`UnstorableValues` naming ``name`` unless every value of ``t`` is finite."""
    if not all_finite(t):
        raise UnstorableValues(f"{name}: holds NaN or infinite values, which the file would store; "
                               f"{hint + '; ' if hint else ''}nothing was written")


def storable(name: str, t: torch.Tensor, dtype: torch.dtype, hint: str = "") -> torch.Tensor:
    """``t`` converted to ``dtype``; raises :class:`UnstorableValues` naming ``name`` where a value is NaN/Inf or
    beyond ``dtype``'s range (float16 tops out at 65504: a float32 weight of 1e38 would become Inf)."""
    out = t if t.dtype == dtype else t.to(dtype)
    if all_finite(out):
        return out
    check_finite(name, t, hint)  # NaN/Inf already in the source
    biggest = float(torch.finfo(dtype).max) if dtype.is_floating_point else float("nan")
    raise UnstorableValues(f"{name}: holds values beyond {str(dtype).replace('torch.', '')}'s range "
                           f"(±{biggest:.6g}), as which the file stores it; {hint + '; ' if hint else ''}"
                           "nothing was written")
