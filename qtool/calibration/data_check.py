"""Too little calibration data: the documented minimums (docs/recipes.md, "How much data") for each kind of
quantizer that learns from data, checked once the data is read.

A range, a weighted search or a rounding learned from a handful of tokens fits those tokens: "hello world" as
--data calibrated W8A8 activations on 4 tokens with no word said. Below a minimum the run warns (``--strict-data``
makes it an error: exit 2, nothing written).

Text (and token-id tensors) count tokens, padding aside; other data (images, feature tensors) counts samples.
"""

from __future__ import annotations

from collections import Counter
from typing import List, Tuple

from ..choices import weighs_activations
from ..config import Plan
from ..data import CalibrationData, ids_like
from ..errors import DataError

__all__ = ["MIN_TOKENS", "MIN_SAMPLES", "data_amount", "shortfalls"]

# (static activation ranges, KV cache, SmoothQuant, batch-norm folds, activation-weighted search;
#  codes or scales from each layer's XᵀX: GPTQ, AdaRound and AWQ)
MIN_TOKENS = {"ranges": 512, "rounding": 2048}
MIN_SAMPLES = {"ranges": 8, "rounding": 16}


def data_amount(data: CalibrationData) -> Tuple[int, str]:
    """``(count, "tokens")`` for data holding token ids (``input_ids``, or a file of one integer tensor of one or
    two dimensions; attention-masked padding not counted), else ``(samples, "samples")`` (images are samples,
    uint8 ones too)."""
    tokens, has_tokens = 0, False
    for batch in data.batches:
        ids = batch.kwargs.get("input_ids")
        if ids is None and len(batch.args) == 1 and ids_like(batch.args[0]):
            ids = batch.args[0]  # a file of one integer tensor [batch, seq]: token ids
        if ids is None:
            continue
        has_tokens = True
        mask = batch.kwargs.get("attention_mask")
        tokens += int(mask.sum()) if mask is not None else int(ids.numel())
    return (tokens, "tokens") if has_tokens else (data.num_samples, "samples")


def refuse_no_kept_token(data: CalibrationData, what: str) -> None:
    """Token-id data whose every ``attention_mask`` is 0 holds nothing to measure ``what`` (an importance matrix, a
    report) on: one line naming the data."""
    if data_amount(data) == (0, "tokens"):
        raise DataError(f"{data.source or 'the data'}: holds no token its attention_mask keeps (every mask is 0): "
                        f"nothing to measure {what} on")


def shortfalls(plan: Plan, data: CalibrationData) -> List[str]:
    """One line for each kind of data-driven quantizer in ``plan`` that ``data`` is too small for."""
    count, unit = data_amount(data)
    minimum = MIN_TOKENS if unit == "tokens" else MIN_SAMPLES
    needs = []
    if plan.static_activations:
        needs.append(("ranges", f"{len(plan.static_activations)} activation range(s)"))
    if plan.smoothing or plan.folds:
        needs.append(("ranges", "smoothquant" if plan.smoothing else "fold_batch_norms"))
    weighted = [q for q in plan.weights if weighs_activations(dict(q.analyzer_args).get("weighting"))
                and not q.imatrix]
    if weighted:
        needs.append(("ranges", f"the activation-weighted search of {len(weighted)} weight(s)"))
    rounded = Counter(q.rounding for q in plan.weights if q.rounding != "nearest")
    if rounded:  # (each algorithm by its own count: a recipe may mix them)
        needs.append(("rounding", " and ".join(f"{name} on {n} weight(s)" for name, n in sorted(rounded.items()))))
    if plan.awq is not None:
        needs.append(("rounding", f"awq's scales of {len(plan.awq.groups)} group(s)"))
    more = (f"--num-samples {data.num_samples} chose them of the {data.available} samples the data gives: raise it"
            if data.available > data.num_samples else "pass more --data")
    return [f"calibration data holds {count} {unit}, and {what} should learn from at least {minimum[kind]} "
            f"(docs/recipes.md, 'How much data'): with fewer, the result fits those {unit}; {more}"
            for kind, what in needs if count < minimum[kind]]
