"""What a quantizer is, as one typed value: :class:`QuantSpec`.

Plan rows (``qtool.config.QuantizerPlan``: where a quantizer goes) and encodings entries
(``qtool.encodings.EncodingEntry``: its calibrated numbers) both describe their quantizer with these fields and
validate them here, once, when they are made. :func:`axis_and_block` is the one translation from granularity to
the (axis, block) pair that ONNX, AIMET 2.0.0, compressed-tensors and GGUF speak.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

from ..choices import (ELEMENT_NAMES, FLOAT_SCALE_DTYPES, GGML_SCALE_DTYPES, LEGACY_GGUF_TYPES, check_element,
                       check_scale_dtype)
from .affine import grid
from .floatgrid import FloatElement, element_of
from .ggml import GGML_TYPES, GgmlType

__all__ = ["Granularity", "QuantSpec", "axis_and_block", "check_element", "ELEMENT_NAMES", "FLOAT_SCALE_DTYPES",
           "MIN_BITWIDTH", "MAX_BITWIDTH"]

MIN_BITWIDTH, MAX_BITWIDTH = 2, 16


class Granularity(str, enum.Enum):
    """How many encodings a tensor has. A ``str`` subclass: it compares, hashes and serializes as its value."""

    PER_TENSOR = "per_tensor"
    PER_CHANNEL = "per_channel"
    PER_BLOCK = "per_block"
    PER_TOKEN = "per_token"  # dynamic only: one range per token, computed at run time

    def __str__(self) -> str:
        return self.value


def axis_and_block(granularity: Granularity, shape: Sequence[int],
                   block_size: Optional[Sequence[int]]) -> Tuple[Optional[int], Optional[int]]:
    """``(axis, block)``: the channel dimension of a per-channel encoding (block None), the blocked dimension and
    its block length of a per-block one, ``(None, None)`` per tensor. ``shape`` is the encoding's shape."""
    granularity = Granularity(granularity)
    if granularity is Granularity.PER_TOKEN:
        raise ValueError("a per_token encoding is computed at run time; it has no stored axis")
    if granularity is Granularity.PER_TENSOR:
        return None, None
    if granularity is Granularity.PER_CHANNEL:
        return (next(i for i, s in enumerate(shape) if s != 1) if any(s != 1 for s in shape) else 0), None
    if block_size is None:
        raise ValueError("a per_block encoding needs block_size")
    axis = next((i for i, b in enumerate(block_size) if b not in (1, -1)), None)
    if axis is None:
        raise ValueError(f"block_size {list(block_size)} blocks no dimension")
    return axis, int(block_size[axis])


@dataclass(frozen=True)
class QuantSpec:
    """One quantizer: its integer grid (``bitwidth``, ``symmetric``), its granularity and encoding ``shape``
    (``()`` per tensor, ``(out, 1, ...)`` per channel, ``(out, in/B, ...)`` per block) with the per-dimension
    ``block_size`` of a blocked one, the analyzer that chose (or will choose) its range, and the dtype its scales
    are rounded to (``float16`` for formats that store them so, e.g. GGUF). ``dynamic``: the range is computed
    from each call's values at run time (per tensor or per token) and nothing is stored; its shape is ``()``.
    Raises ``ValueError`` on any inconsistency."""

    bitwidth: int
    symmetric: bool
    granularity: Granularity
    shape: Tuple[int, ...]
    block_size: Optional[Tuple[int, ...]] = None
    analyzer: str = "minmax"
    scale_dtype: str = "float32"
    dynamic: bool = False
    element: str = "int"

    def __post_init__(self):
        if isinstance(self.bitwidth, bool) or not isinstance(self.bitwidth, int):
            raise ValueError(f"bitwidth must be an integer (got {self.bitwidth!r})")
        if not MIN_BITWIDTH <= self.bitwidth <= MAX_BITWIDTH:
            raise ValueError(f"bitwidth {self.bitwidth} is outside {MIN_BITWIDTH}..{MAX_BITWIDTH}")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be true or false (got {self.symmetric!r})")
        try:
            object.__setattr__(self, "granularity", Granularity(self.granularity))
        except ValueError:
            raise ValueError(f"granularity must be one of {', '.join(g.value for g in Granularity)} "
                             f"(got {str(self.granularity)[:40]!r})") from None
        check_element(self.element, self.bitwidth, self.symmetric, self.scale_dtype, self.granularity.value,
                      self.dynamic)
        if self.element == "int":
            check_scale_dtype(self.scale_dtype, self.bitwidth, self.symmetric)
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"dynamic must be true or false (got {str(self.dynamic)[:40]!r})")
        if self.granularity is Granularity.PER_TOKEN and not self.dynamic:
            raise ValueError("per_token ranges change with every token, so they are computed at run time: "
                             "per_token needs dynamic: true")
        blocks_at_run_time = self.dynamic and self.granularity is Granularity.PER_BLOCK and self.element != "int"
        if self.dynamic:
            if self.granularity not in (Granularity.PER_TENSOR, Granularity.PER_TOKEN) and not blocks_at_run_time:
                raise ValueError(f"a dynamic quantizer is per_tensor or per_token, or per_block on a float element "
                                 f"(got {self.granularity.value})")
            if tuple(self.shape) or (self.block_size is not None and not blocks_at_run_time):
                raise ValueError(f"a dynamic quantizer stores no range: its shape is [] (got {list(self.shape)})")
            if blocks_at_run_time and (self.block_size is None or len(self.block_size) != 1):
                raise ValueError("a dynamic per_block quantizer takes one block length, along the last dimension")
            if self.scale_dtype != "float32" and self.element == "int":
                raise ValueError("a dynamic quantizer computes its scale at run time: scale_dtype does not apply")
        shape = tuple(int(d) for d in self.shape)
        if any(d < 1 for d in shape):
            raise ValueError(f"shape {list(shape)} has a dimension below 1")
        object.__setattr__(self, "shape", shape)
        if self.block_size is not None:
            object.__setattr__(self, "block_size", tuple(int(b) for b in self.block_size))
            if not blocks_at_run_time and len(self.block_size) != len(shape):
                raise ValueError(f"block_size {list(self.block_size)} needs one entry per dimension of {list(shape)}")
        if self.granularity is Granularity.PER_BLOCK and not blocks_at_run_time:
            if self.block_size is None or len(self.block_size) != len(shape):
                raise ValueError(f"a per_block encoding needs one block_size entry per dimension of {list(shape)}")
            axis_and_block(self.granularity, shape, self.block_size)
        elif self.granularity is Granularity.PER_TENSOR and shape and any(d != 1 for d in shape):
            raise ValueError(f"a per_tensor encoding has one element (got shape {list(shape)})")
        t = self.ggml
        if t is not None:
            if self.dynamic or self.granularity is not Granularity.PER_BLOCK or len(shape) != 2 \
                    or self.block_size != (1, t.sub):
                raise ValueError(f"GGUF's {t.name} is a weight grid of blocks of {t.sub} along the input dimension "
                                 f"(block_size {t.sub}, per_block, 2-D weights)")
            if (shape[1] * t.sub) % t.block:
                raise ValueError(f"GGUF's {t.name} needs rows of whole {t.block}-element super-blocks (got "
                                 f"{shape[1] * t.sub} columns)")

    @property
    def is_float(self) -> bool:
        """True for a float element grid (FP8, FP4; see ``quant.floatgrid``)."""
        return self.element != "int"

    @property
    def ggml(self) -> Optional[GgmlType]:
        """The GGUF K-quant or IQ4 type whose grid this is (``quant.ggml``), or None."""
        return GGML_TYPES[self.scale_dtype.upper()] if self.scale_dtype in GGML_SCALE_DTYPES else None

    @property
    def element_grid(self) -> Optional[Union[FloatElement, GgmlType]]:
        """The grid codes are chosen on when it is not a plain integer one: the float element
        (``quant.floatgrid``) or the GGUF type; None for an integer grid."""
        if self.ggml is not None:
            return self.ggml
        return element_of(self.element) if self.is_float else None

    @property
    def qmin_qmax(self) -> Tuple[int, int]:
        """The integer grid; for a float element, the range of its codes (``0 .. 2**bits - 1``)."""
        if self.is_float:
            return 0, (1 << self.bitwidth) - 1
        return grid(self.bitwidth, signed=self.symmetric)

    def axis_and_block(self) -> Tuple[Optional[int], Optional[int]]:
        return axis_and_block(self.granularity, self.shape, self.block_size)

    @property
    def gguf_block_type(self) -> Optional[str]:
        """The GGUF block type that holds a weight of this grid exactly, or None: its K-quant or IQ4 type, or
        the legacy type of its bit width and symmetry for integer blocks of 32 along the input dimension (the
        float16 rounding of the scales is the exporter's to report)."""
        if self.granularity is not Granularity.PER_BLOCK or len(self.shape) != 2 or self.is_float:
            return None
        if self.ggml is not None:
            return self.ggml.name
        if self.axis_and_block() != (1, 32):
            return None
        return LEGACY_GGUF_TYPES.get((self.bitwidth, self.symmetric))

    @property
    def calibrates(self) -> bool:
        """True when calibration sets something: a static range, or the global scale of NVFP4 activations whose
        block scales are computed at run time."""
        return not self.dynamic or self.scale_dtype == "fp8_e4m3"

    def describe(self) -> str:
        if self.ggml is not None:
            return f"GGUF {self.ggml.name} {_describe_layout(self)}"
        if self.is_float:
            scale = "" if self.scale_dtype == "float32" else f", {self.scale_dtype} scales"
            return f"{self.element} {_describe_layout(self)}{scale}"
        return _describe_layout(self)


def _describe_layout(spec: QuantSpec) -> str:
    if spec.dynamic:
        block = f" {spec.block_size[0]}" if spec.block_size else ""
        return f"{spec.granularity.value}{block}, dynamic"
    if spec.granularity is Granularity.PER_BLOCK:
        return f"per_block {spec.block_size} -> {spec.shape}"
    if spec.granularity is Granularity.PER_CHANNEL:
        return f"per_channel {spec.shape}"
    return "per_tensor"

