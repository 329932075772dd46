"""In-memory calibration: the whole model is loaded, quantizers are inserted, and the data runs through it."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from ..config import Plan
from ..data import CalibrationData
from ..errors import DataError
from ..quant import QuantizerBase
from .base import calibrate_activations, calibrate_weights, check_finite

__all__ = ["calibrate", "CalibrationResult"]

# progress(batches_done, batches_total, samples_in_this_batch)
Progress = Optional[Callable[[int, int, int], None]]


class CalibrationResult:
    def __init__(self, unused: List[str]):
        self.unused = unused  # activation quantizers whose module never ran


def calibrate(
    model: nn.Module,
    plan: Plan,
    quantizers: Dict[str, QuantizerBase],
    data: Optional[CalibrationData],
    device: torch.device,
    progress: Progress = None,
) -> CalibrationResult:
    """Weights from the weights themselves, then activations from the data (AIMET's order and semantics)."""
    modules = dict(model.named_modules())
    calibrate_weights(plan.weights, lambda q: quantizers[q.name], lambda q: modules[q.module]._parameters["weight"])
    acts = plan.activations
    if not acts:
        return CalibrationResult([])
    if data is None or len(data) == 0:
        raise DataError("the recipe quantizes activations, which needs calibration data: pass --data")

    def run():
        for i, batch in enumerate(data):
            b = batch.to(device)
            try:
                model(*b.args, **b.kwargs)
            except (TypeError, RuntimeError, ValueError, IndexError, AssertionError) as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise DataError(f"calibration batch {i}: the model rejected the data: {first}") from None
            if progress:
                progress(i + 1, len(data), b.size)

    calibrate_activations(acts, quantizers, run)
    unused = [q.name for q in acts if not quantizers[q.name].is_initialized()]
    check_finite(plan.quantizers, quantizers)
    return CalibrationResult(unused)
