"""How precisely the model's own float32 matrix products run in calibration's data passes (``--matmul-precision``).

A calibration pass is mostly the model's forward: on a long run its matrix products are most of the time (on a
GPU, two float32 passes per block decide a sequential GPTQ run's speed). torch can run them with fewer mantissa
bits where the hardware has units for it (``torch.set_float32_matmul_precision``):

* ``highest`` (the default): float32 products; the bytes qtool writes are those it always wrote;
* ``high``: TF32 inputs (10 mantissa bits, float32 sums) on CUDA GPUs from Ampere on and CPUs with AMX-FP16;
* ``medium``: as ``high`` on a GPU; bfloat16 inputs (8 bits, float32 sums) on CPUs, fast with AMX or AVX512-BF16
  (oneDNN emulates them on other AVX512 CPUs, which can be slower than float32).

Only the passes that feed the model data change (the activations the ranges and input statistics come from, and
the outputs the next block of a sequential run reads). What qtool computes from them stays float32:
:func:`exact` puts the highest precision back for the input statistics' ``XᵀX`` (taken inside the forward), and
the range searches, GPTQ's and the rotations' solves and the float-equivalence checks never run under the reduced
setting. Tensors stay float32 throughout, so memory is unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..choices import MATMUL_PRECISIONS

__all__ = ["MATMUL_PRECISIONS", "model_matmuls", "exact", "unsupported", "emulated"]

@contextlib.contextmanager
def model_matmuls(precision: str) -> Iterator[None]:
    """The model's float32 matrix products at ``precision`` inside the block, torch's setting restored after."""
    before = torch.get_float32_matmul_precision()
    if precision == before:
        yield
        return
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def exact() -> contextlib.AbstractContextManager:
    """float32 products inside the block, whatever the model's passes use: qtool's own arithmetic."""
    return model_matmuls("highest")


def unsupported(precision: str, device: torch.device) -> Optional[str]:
    """Why ``precision`` changes nothing on ``device`` (its matrix products stay float32), or None where it
    applies."""
    if precision == "highest":
        return None
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return None if major >= 8 else f"{torch.cuda.get_device_name(device)} has no TF32 (Ampere or later)"
    if device.type != "cpu":
        return f"{device.type} devices are not covered"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if precision == "medium":  # (oneDNN takes AVX512BW/VL/DQ or AVX-NE-CONVERT, emulating where it must)
        return None if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "this CPU has no bfloat16 products"
    return None if torch.cpu._is_amx_fp16_supported() else "this CPU has no TF32 units (AMX-FP16)"


def emulated(precision: str, device: torch.device) -> bool:
    """Whether oneDNN runs ``precision``'s bfloat16 products on ``device`` without bfloat16 units (AMX or
    AVX512-BF16): the bytes of ``medium``, at a speed that may be below float32's."""
    return (precision == "medium" and device.type == "cpu" and unsupported(precision, device) is None
            and not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()))
