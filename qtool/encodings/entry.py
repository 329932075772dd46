"""The encodings record: one quantizer's :class:`EncodingEntry` (its fields, the spec they make, its range
wherever it is kept). The grid maths and the JSON are the mixins ``grid.EntryGrid`` and ``entry_json.EntryJson``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..config import QuantizerPlan
from ..errors import EncodingsError
from ..quant import QuantizerBase
from ..quant.affine import resolve_block_size
from ..quant.spec import Granularity, QuantSpec
from .entry_json import EntryJson, range_problem
from .grid import EntryGrid
from .schema import range_fault
from .sidecar import read_lazy_range


@dataclass
class EncodingEntry(EntryGrid, EntryJson):
    name: str
    module: str
    tensor: str
    bitwidth: int
    symmetric: bool
    granularity: Granularity
    shape: Tuple[int, ...]
    block_size: Optional[Tuple[int, ...]]
    analyzer: str
    min: Optional[torch.Tensor]  # None for a dynamic quantizer (its range is computed at run time)
    max: Optional[torch.Tensor]
    # (sidecar file, min key, max key) of an entry read lazily: min/max are then meta tensors until asked for
    source: Optional[Tuple[str, str, str]] = None
    dynamic: bool = False
    element: str = "int"  # int, or a float element (fp8_e4m3, fp4_e2m1): min/max are then -amax/amax
    scale_dtype: str = "float32"  # a float element's block scale type (float32, e8m0, fp8_e4m3)
    global_amax: Optional[float] = None  # NVFP4: the absolute maximum fused layers share their global scale from

    def __post_init__(self):
        spec = QuantSpec(self.bitwidth, self.symmetric, self.granularity, self.shape, self.block_size, self.analyzer,
                         self.scale_dtype, dynamic=self.dynamic, element=self.element)
        if self.dynamic != (self.min is None) or (self.min is None) != (self.max is None):
            raise ValueError(f"{self.name}: a dynamic entry has no min/max and a static one has both")
        self.granularity, self.shape, self.block_size = spec.granularity, spec.shape, spec.block_size
        self._spec = spec

    @property
    def spec(self) -> QuantSpec:
        """What this quantizer is (validated when the entry was made; raises ``ValueError`` otherwise)."""
        return self._spec

    @property
    def qmin_qmax(self) -> Tuple[int, int]:
        return self._spec.qmin_qmax

    def range(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(min, max)``, read from the sidecar now if this entry was read lazily (not kept)."""
        if self.dynamic:
            raise ValueError(f"{self.name} is dynamic: its range is computed from each call's values at run time")
        if self.source is None or self.min.device.type != "meta":
            return self.min, self.max
        lo, hi = read_lazy_range(self.source)
        problem = range_problem(self._with_range(lo, hi))  # the checks an entry read whole gets when it is read
        if problem is not None:
            file, kmin, kmax = self.source
            raise EncodingsError(f"{file}: {kmin}/{kmax}: {problem}")
        return lo, hi

    def materialized(self) -> "EncodingEntry":
        """This entry with its numbers in memory."""
        if self.source is None or self.min.device.type != "meta":
            return self
        return self._with_range(*self.range())

    def _with_range(self, lo: torch.Tensor, hi: torch.Tensor) -> "EncodingEntry":
        return EncodingEntry(self.name, self.module, self.tensor, self.bitwidth, self.symmetric, self.granularity,
                             self.shape, self.block_size, self.analyzer, lo, hi, element=self.element,
                             scale_dtype=self.scale_dtype, global_amax=self.global_amax)

    @property
    def is_float(self) -> bool:
        return self.element != "int"

    @classmethod
    def from_quantizer(cls, plan: QuantizerPlan, quantizer: QuantizerBase) -> "EncodingEntry":
        """The entry of a calibrated quantizer. Every calibration mode makes its entries here, so this is where a
        range that is not finite, or whose scale overflows float32, is refused (it would write NaN/Infinity)."""
        floating = {} if plan.element == "int" else {"element": plan.element, "scale_dtype": plan.scale_dtype}
        if plan.spec.ggml is not None:
            floating = {"scale_dtype": plan.scale_dtype}
        shared = getattr(quantizer, "global_amax", None)
        if shared is not None:
            floating["global_amax"] = float(shared) + 0.0  # (-0.0 -> 0.0: all-zero inputs have no sign)
            if not math.isfinite(floating["global_amax"]):
                raise range_fault(plan.name, plan.tensor, f"its largest absolute value {floating['global_amax']:.4g} "
                                  "is not a finite number a global scale can hold")
        if plan.dynamic:
            if plan.spec.calibrates and "global_amax" not in floating:
                from ..errors import DataError

                raise DataError(f"{plan.name}: NVFP4 activations need a global scale from the calibration data, and "
                                "this layer never ran on it")
            return cls(plan.name, plan.module, plan.tensor, plan.bitwidth, plan.symmetric, plan.granularity, (),
                       plan.block_size, plan.analyzer_label, None, None, dynamic=True, **floating)
        entry = cls(plan.name, plan.module, plan.tensor, plan.bitwidth, plan.symmetric, plan.granularity,
                    tuple(plan.shape), plan.block_size, plan.analyzer_label,
                    quantizer.min.detach().cpu().clone(), quantizer.max.detach().cpu().clone(), **floating)
        entry.check_finite()
        return entry

    def check_fits(self, key: str, shape) -> None:
        """Raise ``EncodingsError`` unless this encoding's shape/block_size applies to tensor ``key`` of ``shape``."""
        try:
            resolve_block_size(shape, self.shape, self.block_size)
        except ValueError as err:
            raise EncodingsError(
                f"encodings entry {self.name!r} (shape {list(self.shape)}) does not fit tensor {key!r} of shape "
                f"{list(shape)}: {err}; were they made for another model?"
            ) from None

    def numel(self) -> int:
        return 0 if self.dynamic else int(self.min.numel())
