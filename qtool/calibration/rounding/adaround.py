"""AdaRound (Nagel et al., 2020): each weight rounds up or down, as learned per layer to minimize the layer's output
error, on a grid that is already fixed.

Input: the weight ``W`` ``(out, in)`` (or a batch ``(groups, out, in)``: a grouped convolution's rows), the
layer-input Hessian ``H = sum(x xᵀ)`` over the calibration inputs, and the encoding the analyzer chose
(per-element ``scale``/``offset`` expanded from any granularity, as for GPTQ). Output: codes in ``[qmin, qmax]``
that differ from ``floor(W / scale) - offset`` by 0 or 1 only, so the scales in every file are the analyzer's.

The layer is linear in its weight, so its squared output error over the calibration inputs is ``d H dᵀ`` per output
row (``d`` the row's weight error): the optimization needs the Hessian qtool already collects, never the data
again. Per weight a continuous ``V`` gives the rounding ``h(V) = clip(sigmoid(V)·(ζ-γ) + γ, 0, 1)`` (ζ = 1.1,
γ = -0.1; ``V`` starts where ``h`` equals the weight's fractional part). Adam minimizes
``sum_rows d H dᵀ / (the same for round-to-nearest) + reg_weight · mean(1 - |2h - 1|^β)``: both terms are about 1
whatever the layer's scale and size, so one ``reg_weight`` (3) serves every layer. (AIMET and the paper add
``0.01 · sum(...)`` to an unnormalized output MSE instead, which weighs the two differently from layer to layer.)
The regularizer is off for the first ``warm_start`` of the iterations, then ``β`` falls linearly from 20 to 2,
which drives every ``h`` to 0 or 1.
Last, codes are ``floor + (h >= 0.5)``, and each row keeps them or round-to-nearest, whichever has the smaller
``d H dᵀ``, so a layer is never worse than round-to-nearest on the calibration inputs.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ...quant.affine import quantize
from .gptq import as_problems, keep_better_rows

__all__ = ["adaround_codes"]

_ZETA, _GAMMA = 1.1, -0.1


def _soft(v: torch.Tensor) -> torch.Tensor:
    return (torch.sigmoid(v) * (_ZETA - _GAMMA) + _GAMMA).clamp(0, 1)


def adaround_codes(weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                   qmin: int, qmax: int, block_size: Optional[Sequence[int]] = None, *,
                   iterations: int = 1000, reg_weight: float = 3.0, warm_start: float = 0.2,
                   learning_rate: float = 0.01, notes: Optional[List[str]] = None) -> torch.Tensor:
    """AdaRound codes (int64, the weight's shape) for ``weight`` on the grid ``scale``/``offset`` (see the module
    docstring); ``hessian`` is ``sum(x xᵀ)`` over the calibration inputs (any positive multiple gives the same
    codes up to float rounding). Deterministic for fixed inputs: a full-batch loss, no sampling, float32 on the
    weight's device. ``notes`` gets a line where the rounding could not be learned (a Hessian that is not
    finite: round-to-nearest codes)."""
    if iterations < 0 or reg_weight < 0 or not 0 <= warm_start <= 1 or learning_rate <= 0:
        raise ValueError("iterations and reg_weight must be >= 0, warm_start in [0, 1], learning_rate > 0")
    W0, H, S, O = as_problems(weight, hessian, scale, offset, block_size, "AdaRound")
    if not bool(torch.isfinite(H).all()):  # (a NaN loss would keep round-to-nearest without a word)
        if notes is not None:
            notes.append("the layer-input Hessian is not finite (inputs too large for float32 sums): rounded to "
                         "nearest, not AdaRound")
        rtn = quantize(W0, S, O, qmin=qmin, qmax=qmax)
        ties = torch.eye(H.shape[-1], dtype=W0.dtype, device=W0.device).expand(H.shape)  # (finite: RTN stays)
        return keep_better_rows(weight, ties, rtn, scale, offset, qmin, qmax, block_size)
    base = torch.floor(W0 / S)
    rest = (W0 / S - base).clamp(0, 1)
    v = torch.logit(((rest - _GAMMA) / (_ZETA - _GAMMA)).clamp(1e-4, 1 - 1e-4)).requires_grad_(True)
    # both terms on a scale of one: the output error relative to round-to-nearest's, the regularizer per weight
    d_rtn = W0 - (quantize(W0, S, O, qmin=qmin, qmax=qmax) + O) * S
    rtn_error = float(((d_rtn @ H) * d_rtn).sum().clamp(min=1e-30))
    opt = torch.optim.Adam([v], lr=learning_rate)
    warm = int(warm_start * iterations)
    with torch.enable_grad():
        for it in range(iterations):
            opt.zero_grad(set_to_none=True)
            h = _soft(v)
            codes = (base + h - O).clamp(qmin, qmax)
            d = W0 - (codes + O) * S
            loss = ((d @ H) * d).sum() / rtn_error
            if it >= warm:
                beta = 20 + (2 - 20) * (it - warm) / max(iterations - warm, 1)
                loss = loss + reg_weight * (1 - (2 * h - 1).abs().pow(beta)).mean()
            loss.backward()
            opt.step()
    with torch.no_grad():
        up = (_soft(v) >= 0.5).to(torch.float32)
        codes = (base + up - O).clamp(qmin, qmax)
    return keep_better_rows(weight, H, codes, scale, offset, qmin, qmax, block_size)
