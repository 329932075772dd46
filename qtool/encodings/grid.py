"""An encodings entry's grid maths: AIMET's scale and offset (or a float element's scales, or a GGUF grid) from
its min/max, and the check that they are finite numbers a file can hold."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..quant.affine import min_max_to_scale_offset
from ..quant.floatgrid import element_of, encoding_scales
from ..quant.ggml import grid_from_range
from .schema import range_fault

_F32_MAX = float(torch.finfo(torch.float32).max)


class EntryGrid:
    """The grid maths of :class:`~qtool.encodings.EncodingEntry` (a mixin: it reads the record's fields)."""

    def ggml_grid(self):
        """A GGUF K-quant / IQ4 entry's grid (``quant.ggml.KGrid``: stored scales and exact steps), from its
        sub-block ranges."""
        lo, hi = self.range()
        return grid_from_range(lo, hi, self._spec.ggml)

    def _scale_offset_of(self, lo: torch.Tensor, hi: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._spec.ggml is not None:  # the effective step, and the minimum in steps (not an integer for Q4_K)
            try:
                return grid_from_range(lo, hi, self._spec.ggml).step_offset(lo.shape)
            except ValueError:  # a scale GGUF cannot store (beyond float16): reads as an infinite one
                return torch.full_like(lo, math.inf), torch.zeros_like(lo)
        if self.is_float:
            eff = encoding_scales(torch.maximum(-lo, hi), element_of(self.element), self.scale_dtype,
                                  self._global_amax())[1]
            return eff, torch.zeros_like(eff)
        qmin, qmax = self.qmin_qmax
        return min_max_to_scale_offset(lo, hi, qmin, qmax, self.symmetric)

    def scale_offset(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """AIMET's ``(scale, offset)`` of an integer grid; for a float element, its effective scales (what
        multiplies an element value) and zero offsets."""
        lo, hi = self.range()
        with torch.no_grad():
            return self._scale_offset_of(lo, hi)

    def float_scales(self) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """A float element's ``(stored, effective, global)`` scales (``quant.floatgrid.encoding_scales``)."""
        if not self.is_float:
            raise ValueError(f"{self.name} is on an integer grid")
        lo, hi = self.range()
        return encoding_scales(torch.maximum(-lo, hi), element_of(self.element), self.scale_dtype,
                               self._global_amax())

    def _global_amax(self) -> Optional[torch.Tensor]:
        return None if self.global_amax is None else torch.tensor(self.global_amax, dtype=torch.float32)

    def finite_problem(self) -> Optional[str]:
        """Why this entry's numbers cannot be written (min/max not finite, or a scale that overflows float32),
        or None."""
        if self.dynamic or self.min.device.type == "meta":
            return None
        lo, hi = self.min.to(torch.float32), self.max.to(torch.float32)
        if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
            return "its calibrated range holds NaN or infinity"
        if bool((torch.maximum(lo.abs(), hi.abs()) >= _F32_MAX).any()):
            # (an infinity observed is clamped to float32's largest value: one-sided after a ReLU, [0, 3.4e38]
            # gave a finite scale of 1.3e36 that rounded every real value of the layer's input to 0)
            return "its range reaches float32's largest value (an infinity clamped there, or a value that large)"
        scale, _ = self.scale_offset()
        if not torch.isfinite(scale).all():
            if self._spec.ggml is not None:
                return (f"its range [{float(lo.min()):.4g}, {float(hi.max()):.4g}] needs {self._spec.ggml.name} "
                        "scales beyond float16's range (65504), which GGUF stores")
            return (f"its range [{float(lo.min()):.4g}, {float(hi.max()):.4g}] overflows float32 when divided into "
                    "steps (an infinite scale)")
        if self.is_float and not torch.isfinite(scale * element_of(self.element).max).all():
            # the block scale rounded up (to FP8 or a power of two) times the element's largest value: a weight
            # within a few steps of float32's largest decodes to infinity
            return (f"its range [{float(lo.min()):.4g}, {float(hi.max()):.4g}] decodes beyond float32's largest "
                    f"value on the {self.element} grid (its scales round up)")
        return None

    def check_finite(self) -> None:
        """Raise ``CheckpointError`` (a weight) or ``DataError`` (an activation) unless min, max and the derived
        scale are finite."""
        from ..errors import CheckpointError

        bad = self.finite_problem()
        if bad is None:
            return
        if self.tensor == "weight" and self._spec.ggml is not None and "float16" in bad:
            raise CheckpointError(f"{self.name}: {bad}; nothing was written")
        raise range_fault(self.name, self.tensor, bad)
