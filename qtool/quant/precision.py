"""How precisely float32 matrix products run: the model's in calibration's data passes (``--matmul-precision``),
qtool's own always at float32.

A calibration pass is mostly the model's forward: on a long run its matrix products are most of the time (on a
GPU, two float32 passes per block decide a sequential GPTQ run's speed). torch can run them with fewer mantissa
bits where the hardware has units for it (the precisions of ``torch.set_float32_matmul_precision``):

* ``highest`` (the default): float32 products; the bytes qtool writes are those it always wrote;
* ``high``: TF32 inputs (10 mantissa bits, float32 sums) on CUDA GPUs from Ampere on and CPUs with AMX-FP16;
* ``medium``: as ``high`` on a GPU; bfloat16 inputs (8 bits, float32 sums) on CPUs with AMX.

The calibration modes wrap their data passes in :func:`model_matmuls` (the activations the ranges and input
statistics come from, and the outputs the next block of a sequential run reads) and the whole run in
:func:`exact`; what qtool computes inside a pass puts float32 back with :func:`exact` (the input statistics'
``XᵀX``, an online Hadamard rotation's small factor). Tensors stay float32 throughout, so memory is unchanged.

torch's per-backend settings (``torch.backends.{cuda,mkldnn}.matmul.fp32_precision``, torch >= 2.9) are set and
restored directly: its one-word getter refuses to answer once a program has mixed its old and new switches.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator, Optional, TypeVar

import torch

__all__ = ["model_matmuls", "exact", "unsupported", "one_at_a_time"]

_ONE_AT_A_TIME = threading.RLock()
_JOB = TypeVar("_JOB", bound=Callable)


def one_at_a_time(job: _JOB) -> _JOB:
    """``job`` as a library call: calls from several threads run one after another, each with torch's default
    dtype float32 and outside ``torch.inference_mode`` (whose tensors keep no version for the weight cache), and
    the caller's settings back after. A job sets process-wide torch state for its passes (this module's
    switches); two at once would read each other's, and a caller's float64 or bfloat16 default dtype would make
    the scales and ranges of a float64 (or bfloat16) computation, which an encodings file of float32 numbers then
    refuses. (The default dtype is the process's: another thread of the caller's sees float32 meanwhile.)"""
    @functools.wraps(job)
    def call(*args, **kwargs):
        with _ONE_AT_A_TIME, torch.inference_mode(False):
            before = torch.get_default_dtype()
            torch.set_default_dtype(torch.float32)
            try:
                return job(*args, **kwargs)
            finally:
                torch.set_default_dtype(before)
    return call  # type: ignore[return-value]

# torch >= 2.9 keeps a precision per backend and op (and raises from its one-word getter once a program mixed the
# two kinds of switch); earlier releases have only the one-word setting
_PER_OP = hasattr(torch._C, "_get_fp32_precision_getter")
# (backend, op) switches qtool sets: the two matmul ones the precisions change (as torch.set_float32_matmul_precision
# maps them), and oneDNN's convolutions and RNNs, kept at float32 (cuDNN's keep torch's TF32 default)
_OPS = (("cuda", "matmul"), ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"))
_SETTINGS = {"highest": ("ieee", "ieee", "ieee", "ieee"), "high": ("tf32", "tf32", "ieee", "ieee"),
             "medium": ("tf32", "bf16", "ieee", "ieee")}


@contextlib.contextmanager
def model_matmuls(precision: str) -> Iterator[None]:
    """float32 matrix products at ``precision`` inside the block, torch's settings restored after (a switch that
    inherited its value from its backend's inherits again)."""
    if not _PER_OP:
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)
        return
    get, put = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter
    before = [(backend, op, get(backend, op), get(backend, "all")) for backend, op in _OPS]
    for (backend, op), value in zip(_OPS, _SETTINGS[precision]):
        put(backend, op, value)
    try:
        yield
    finally:
        for backend, op, value, inherited in before:
            put(backend, op, "none" if value == inherited else value)


def exact() -> contextlib.AbstractContextManager:
    """float32 products inside the block, whatever the model's passes (or a library caller, through torch's
    precision switches) set: qtool's own arithmetic."""
    return model_matmuls("highest")


def unsupported(precision: str, device: torch.device) -> Optional[str]:
    """Why ``precision`` would not run lower products on ``device`` (the passes then run at ``highest``), or None
    where it applies. On a CPU, oneDNN's bfloat16 products are taken only with AMX: on other AVX512 CPUs it runs
    float32-accurate products in another order (other bytes, no gain)."""
    if precision == "highest":
        return None
    if device.type == "cuda":
        if torch.version.hip is not None:
            return "ROCm GPUs are not covered (their TF32 needs HIPBLASLT_ALLOW_TF32)"
        major, _ = torch.cuda.get_device_capability(device)
        return None if major >= 8 else f"{torch.cuda.get_device_name(device)} has no TF32 (Ampere or later)"
    if device.type != "cpu":
        return f"{device.type} devices are not covered"
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return "oneDNN is not available or turned off in this torch"
    if precision == "medium":
        return None if _cpu_has("amx_tile") else "this CPU has no AMX (bfloat16 matrix units)"
    return None if _cpu_has("amx_fp16") else "this CPU has no AMX-FP16 (TF32 matrix units)"


def _cpu_has(feature: str) -> bool:
    """torch's own CPU feature check (absent from some releases of the declared range: then no)."""
    return bool(getattr(torch.cpu, f"_is_{feature}_supported", lambda: False)())
