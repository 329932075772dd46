"""THE calibration loop, shared by every mode (in memory, streamed weights, block by block).

AIMET's order and semantics: each weight quantizer sees its weight once; then every activation quantizer of the
rows at hand calibrates together over all batches (``run`` feeds them). A quantizer's statistics are collected
by its analyzer and turned into a range on leaving ``compute_encodings``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterable, List, Optional

import torch

from ..config import QuantizerPlan
from ..encodings import range_fault
from ..errors import CheckpointError
from ..hooks import step
from ..quant import QuantizerBase
from ..quant.affine import UnrepresentableScale

__all__ = ["calibrate_weights", "calibrate_activations", "encodings_of", "first_tensor"]


def first_tensor(out) -> torch.Tensor:
    """A module's (first) output tensor: the tensor itself, or the first one of a tuple, list or dict output."""
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out
    return next(v for v in values if isinstance(v, torch.Tensor))


@contextlib.contextmanager
def encodings_of(q: QuantizerPlan, quantizer: QuantizerBase):
    """``quantizer.compute_encodings()``, with a range its grid's scale type cannot hold (a float16 scale past
    65504, a NaN range) reported as the checkpoint's fault (a weight) or the data's (an activation), naming ``q``."""
    try:
        with quantizer.compute_encodings():
            yield quantizer
    except UnrepresentableScale as e:
        raise range_fault(q.name, q.tensor, str(e), "too large for this grid") from None


def calibrate_weights(rows: Iterable[QuantizerPlan], quantizer_for: Callable[[QuantizerPlan], QuantizerBase],
                      weight_for: Callable[[QuantizerPlan], torch.Tensor],
                      done: Optional[Callable[[QuantizerPlan, QuantizerBase], None]] = None,
                      importance_for: Optional[Callable[[QuantizerPlan], Optional[torch.Tensor]]] = None) -> None:
    """Each weight row's quantizer observes its weight (statistics only: no fake-quant copy is made); ``done`` is
    called right after, so a streaming caller can write the encoding and drop the weight. ``importance_for``
    gives an activation-weighted search its per-value importance (None: unweighted)."""
    rows = list(rows)
    with torch.no_grad():
        for i, q in enumerate(rows):
            step("calibrating weights", i, len(rows), q.name)
            quantizer = quantizer_for(q)
            weight = weight_for(q)
            # (a search over a NaN reached torch's scatter with index -2^63: an internal error, not this line)
            if weight.is_floating_point() and not bool(torch.isfinite(weight).all()):
                fault = CheckpointError(f"{q.name}: the checkpoint's weight holds NaN or infinity, which no grid "
                                        "holds; nothing was written")
                fault.outcome = "nothing was written"  # (a --sequential run's line names what OUT.resume keeps)
                raise fault
            imp = importance_for(q) if importance_for is not None else None
            with encodings_of(q, quantizer):
                quantizer.observe(weight, importance=imp)
            del weight
            if done is not None:
                done(q, quantizer)
    if rows:
        step("calibrating weights", len(rows), len(rows), rows[-1].name)


def calibrate_activations(rows: List[QuantizerPlan], quantizers: Dict[str, QuantizerBase],
                          run: Callable[[], None]) -> None:
    """Every activation row's quantizer collects statistics while ``run()`` feeds the data through the model."""
    with contextlib.ExitStack() as stack, torch.no_grad():
        for q in rows:
            stack.enter_context(encodings_of(q, quantizers[q.name]))
        run()

