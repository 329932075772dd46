"""Super-block scales chosen for the values that matter: the importance-matrix path of K-quants.

A K-quant stores each sub-block's step (and minimum) as a small integer times one float16 super-block scale.
Without importances both ggml and :func:`~.grids._quantize_scales` take that scale from the largest step
(``d = max / levels``), so every sub-block's step is rounded to a multiple of it with the same care. With an
importance matrix llama.cpp instead searches ``d`` (``make_qp_quants`` for Q2_K/Q4_K/Q5_K's scales and minima,
``make_qx_quants`` for Q3_K's signed scales) for the least ``Σ sw·(s − d·l)²``, ``sw`` each sub-block's summed
importance: an important sub-block's step is kept closer, a negligible one's rounded more.

:func:`weighted_steps` searches the same candidates — ``max / D`` for ``D`` within 0.4 of ``levels`` (the largest
step keeps the extreme integer), each refitted by ``sw``-weighted least squares with its integers fixed, rounded to
float16, the integers rounded again to the nearest on it — but keeps, per super-block, the candidate whose grid
gives the least weighted squared error of the *values* (each value rounded to its nearest level), the objective the
sub-block search itself minimizes. Scales first (minima as today), then minima. Today's ``max / levels`` is a
candidate and wins ties, so that error is never above today's. It returns the steps the type stores, which snap
back to the same ``d`` and integers (:func:`~.grid_from_range` of their range is that grid).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .base import GgmlType, f16, per_sub
from .grids import _quantize_scales

_OFFSETS = tuple(0.1 * k for k in range(-4, 5) if k)  # candidate D − levels (make_qp_quants' nine, less today's)
_SLICE_VALUES = 1 << 20


def weighted_steps(x: torch.Tensor, w: torch.Tensor, step: torch.Tensor, low: Optional[torch.Tensor],
                   t: GgmlType) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The sub-block steps (and minima) type ``t`` stores for the values ``x`` and their weights ``w`` (both
    ``[rows, cols]``) when each super-block's scale (and minimum scale) is searched as the module docstring says,
    starting from the wished-for ``step``/``low`` (``[rows, cols / sub]``, as the grids' ``wished_step`` gives
    them). Types whose llama.cpp search does not weigh the super-block scale (legacy types, Q6_K, the IQ4 types)
    get ``step``/``low`` back unchanged."""
    if not t.weighted_scales:
        return step, low
    rows, nsub = step.shape
    xs = x.reshape(rows, nsub, t.sub)
    ws = w.reshape(rows, nsub, t.sub)
    per = max(1, _SLICE_VALUES // (nsub * t.sub))  # rows at a time: each candidate's temporaries stay bounded
    parts = [_weighted_rows(xs[a:a + per], ws[a:a + per], step[a:a + per], None if low is None else low[a:a + per],
                            t) for a in range(0, rows, per)]
    return torch.cat([p[0] for p in parts]), None if low is None else torch.cat([p[1] for p in parts])


def _weighted_rows(xs, ws, step, low, t: GgmlType):
    """:func:`weighted_steps` on a slice of rows (``xs``, ``ws``: ``[rows, nsub, sub]``)."""
    levels = (1 << (t.scale_bits - 1)) if t.signed_scales else (1 << t.scale_bits) - 1
    xs, ws = xs.to(torch.float32), ws.to(torch.float32)
    sw = ws.sum(-1)
    step = step.to(torch.float32)
    low = None if low is None else low.to(torch.float32).clamp_min(0)
    today_low = None if low is None else _today(low, t, levels, negative=False)

    buf = torch.empty_like(xs)
    stored = _best([_today(step, t, levels, t.signed_scales)] + _candidates(step, sw, t, levels, t.signed_scales),
                   lambda s: _error(xs, ws, s, today_low, t, buf), t)
    if low is None:
        return stored, None
    return stored, _best([today_low] + _candidates(low, sw, t, levels, negative=False),
                         lambda m: _error(xs, ws, stored, m, t, buf), t)


def _today(s: torch.Tensor, t: GgmlType, levels: int, negative: bool) -> torch.Tensor:
    """``d·l`` per sub-block with ``d`` from the largest step: what the type's ``store`` keeps today."""
    d, l = _quantize_scales(s, t, levels, negative)
    return per_sub(d, t) * l.to(torch.float32)


def _candidates(s: torch.Tensor, sw: torch.Tensor, t: GgmlType, levels: int, negative: bool):
    """``d·l`` per sub-block (``[rows, nsub]``) for each candidate of the module docstring; ``negative``: signed scales, ``d`` sending the step of largest magnitude to ``-levels`` (ggml's
    rule), else unsigned ``0..levels``."""
    rows, nsub = s.shape
    per = t.block // t.sub
    bs, bw = s.reshape(rows, nsub // per, per), sw.reshape(rows, nsub // per, per)
    idx = (bs.abs() if negative else bs).argmax(-1, keepdim=True)
    amax = bs.gather(-1, idx)  # (rows, nb, 1), signed
    lo, hi = (-levels, levels - 1) if negative else (0, levels)
    extreme = float(-levels if negative else levels)

    def integers(d):
        safe = torch.where(d == 0, torch.ones_like(d), d)
        return torch.where(d == 0, 0.0, torch.round(bs / safe).clamp(lo, hi))

    out = []
    for offset in _OFFSETS:
        d = amax / (extreme + (-offset if negative else offset))
        l = integers(d).scatter_(-1, idx, extreme)
        den = (bw * l * l).sum(-1, keepdim=True)
        fit = (bw * bs * l).sum(-1, keepdim=True) / torch.where(den > 0, den, torch.ones_like(den))
        d = f16(torch.where((den > 0) & (fit * d > 0), fit, d))
        l = integers(d).scatter_(-1, idx, extreme)  # the largest step keeps the extreme: d snaps back
        out.append(torch.where(amax == 0, 0.0, d * l).reshape(rows, nsub))
    return out


def _error(xs, ws, step, low, t: GgmlType, buf) -> torch.Tensor:
    """Per super-block ``[rows, nb]``, the weighted squared error of the values ``xs`` ``[rows, nsub, sub]``
    rounded to their nearest level of the grid ``step``/``low`` (``[rows, nsub]``); ``buf``: a work buffer like
    ``xs``."""
    st = step.unsqueeze(-1)
    safe = torch.where(st == 0, torch.ones_like(st), st)
    d = t.values_into(xs, st, None if low is None else low.unsqueeze(-1), safe, buf)
    err = d.sub_(xs).mul_(d).mul_(ws).sum(-1)
    per = t.block // t.sub
    return err.reshape(err.shape[0], -1, per).sum(-1)


def _best(candidates, error, t: GgmlType) -> torch.Tensor:
    """Per super-block, the first candidate (``[rows, nsub]`` steps) of least ``error``."""
    per = t.block // t.sub
    best = candidates[0]
    best_err = error(best)
    for c in candidates[1:]:
        err = error(c)
        better = (err < best_err).repeat_interleave(per, dim=-1)
        best = torch.where(better, c, best)
        best_err = torch.minimum(err, best_err)
    return best
