"""The vectorized range search every GGML type shares (llama.cpp's ``make_qkx2_quants`` / ``make_qx_quants``
kind); what differs by type (candidate spans, rounding to the grid, the range a step spans) is the type's own
method (``grids``)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .base import GgmlType

CLIP_RATIOS = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # clipped spans search_range can try (before GPTQ)
_SEARCH_ELEMENTS = 1 << 19  # candidates x values evaluated at once by search_range (cache-sized temporaries)


def search_range(rows: torch.Tensor, t: GgmlType, weights: Optional[torch.Tensor] = None, steps: int = 20,
                 clip_ratios: Tuple[float, ...] = ()) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block (a row of ``rows`` ``(E, sub)``), the range ``(mn, mx)`` (each ``(E,)``, in the convention of
    :func:`grid_from_range`) whose step (and minimum) give the least ``weights``-weighted squared error.

    The search is llama.cpp's kind (``make_qkx2_quants`` / ``make_qx_quants``): ``steps + 1`` candidate steps
    around the one that spans the sub-block, each giving codes by rounding, then the weighted least-squares step
    (and minimum, kept ≤ 0 as the types store it) for those codes; the min-max range is a candidate too, so the
    result is never worse than min-max before the sub-block scales are quantized. Beyond llama.cpp's, spans
    clipped by each of ``clip_ratios`` (e.g. :data:`CLIP_RATIOS`) are candidates too, refitted the same way. That
    is for codes GPTQ chooses afterwards, which make up for a clipped extreme: measured on SmolLM2, Q4_K_M with
    GPTQ +0.70 % against +0.88 % without them, while round-to-nearest got worse with them (Q3_K_M +7.10 % against
    +6.57 %), since a clipped extreme weight then stays clipped.

    Every candidate of a slice of sub-blocks is evaluated at once, slice by slice, so the temporaries stay
    cache-sized; each candidate's error is its grid's exact error (codes rounded again on the refitted grid), and
    the first candidate of least error wins, as if they were tried one after another."""
    x = rows.to(torch.float32)
    w = None if weights is None else weights.to(torch.float32)
    deltas = [0.0] + [d for d in (-1.0 + 2.0 * k / steps for k in range(steps + 1)) if d != 0.0]
    candidates = [(d, 1.0) for d in deltas] + [(0.0, float(r)) for r in clip_ratios]
    denominators = [t.search_denominator(d) for d, _ in candidates]
    denom = torch.tensor(denominators, dtype=torch.float32, device=x.device)[:, None]
    ratio = torch.tensor([r for _, r in candidates], dtype=torch.float32, device=x.device)[:, None]
    n, width = x.shape
    mn_out, mx_out = torch.empty(n, device=x.device), torch.empty(n, device=x.device)
    per = max(1, _SEARCH_ELEMENTS // (len(candidates) * max(width, 1)))
    # two work buffers for every slice (fresh temporaries per operation cost more in page faults than in maths)
    bufs = [torch.empty(len(candidates) * min(n, per) * width, device=x.device) for _ in range(2)]
    for a in range(0, n, per):
        b = min(n, a + per)
        work = tuple(buf[:len(candidates) * (b - a) * width].view(len(candidates), b - a, width) for buf in bufs)
        mn_out[a:b], mx_out[a:b] = _search_slice(x[a:b], None if w is None else w[a:b], t, denom, ratio, work)
    return mn_out, mx_out


def _search_slice(x, w, t: GgmlType, denom, ratio, work):
    """:func:`search_range` on the sub-blocks ``x`` ``(e, sub)`` with candidates ``denom``/``ratio`` ``(C, 1)``;
    ``work``: two ``(C, e, sub)`` buffers it may overwrite."""
    full_mn, full_mx = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    mn, mx = full_mn * ratio, full_mx * ratio  # (C, e)
    step, low = t.candidates(mn, mx, full_mn, full_mx, denom)
    safe = torch.where(step == 0, torch.ones_like(step), step)[..., None]
    v, tmp = work
    t.codes_into(x, low[..., None], safe, v)
    # refit the step (and minimum) to these codes; the min-max candidate (the first) stays as it is
    fit_step, fit_low = _least_squares(x, w, v, t, step, low, tmp)
    fit_step[0], fit_low[0] = step[0], low[0]
    err = _grid_error(x, w, fit_step, fit_low, t, work)
    # the first candidate of least error (torch.min's index is the first; it is several times argmin's speed here)
    best = torch.min(torch.where(torch.isnan(err), torch.inf, err), dim=0, keepdim=True).indices
    return t.range_of(fit_step.gather(0, best)[0], fit_low.gather(0, best)[0])


def _least_squares(x, w, v, t: GgmlType, step, low, tmp):
    """The weighted least-squares step (and minimum ≥ 0, value = step·v − low) for codes ``v`` (``(C, e, sub)``;
    ``x`` and ``w`` ``(e, sub)``), ``tmp`` a buffer like ``v``; rows where it is degenerate keep ``step``/``low``.
    (Weighted products are formed in one order, ``(w·v)·v`` and ``(w·x)·v``: their float32 rounding is part of
    the result.)"""
    if w is None:
        svv, sxv = torch.mul(v, v, out=tmp).sum(-1), torch.mul(x, v, out=tmp).sum(-1)
    else:
        wx = w * x
        wv = torch.mul(w, v, out=tmp)
        sv = None if t.symmetric else wv.sum(-1)
        svv = wv.mul_(v).sum(-1)
        sxv = torch.mul(wx, v, out=tmp).sum(-1)
    if t.symmetric:  # the step keeps its sign (codes were rounded with it)
        ok = svv > 0
        new_step = sxv / torch.where(ok, svv, torch.ones_like(svv))
        ok = ok & (new_step * step > 0)
        return torch.where(ok, new_step, step), low
    if w is None:
        sw, sv, sx = torch.full_like(x[..., 0], x.shape[-1]), v.sum(-1), x.sum(-1)
    else:
        sw, sx = w.sum(-1), wx.sum(-1)
    det = sw * svv - sv * sv
    ok = det > 0
    safe = torch.where(ok, det, torch.ones_like(det))
    new_step = (sw * sxv - sx * sv) / safe
    new_low = -(svv * sx - sv * sxv) / safe  # the minimum is -low
    # a minimum above zero is not stored: refit the step alone with low = 0
    pos = new_low < 0
    alone = sxv / torch.where(svv > 0, svv, torch.ones_like(svv))
    new_step = torch.where(pos, alone, new_step)
    new_low = torch.where(pos, torch.zeros_like(new_low), new_low)
    ok = ok & (new_step > 0)
    return torch.where(ok, new_step, step), torch.where(ok, new_low, low)


def _grid_error(x, w, step, low, t: GgmlType, work):
    """Weighted squared error of rounding ``x`` (``(e, sub)``) to the nearest value of each (unquantized) grid
    ``step``/``low`` (``(C, e)``): ``(C, e)``. ``work``: two ``(C, e, sub)`` buffers it may overwrite. A zero
    step leaves every value at ``-low`` (its codes are multiplied by zero), as the grid holds it."""
    step, low = step[..., None], low[..., None]
    safe = torch.where(step == 0, torch.ones_like(step), step)
    d, tmp = work
    t.values_into(x, step, low, safe, d).sub_(x)
    return (torch.mul(d, d, out=tmp) if w is None else torch.mul(w, d, out=tmp).mul_(d)).sum(-1)
