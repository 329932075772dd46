"""The vectorized range search every GGML type shares (llama.cpp's ``make_qkx2_quants`` / ``make_qx_quants``
kind); what differs by type (candidate spans, rounding to the grid, the range a step spans) is the type's own
method (``grids``)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..affine import inverse_or_zero
from .base import GgmlType

CLIP_RATIOS = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # clipped spans search_range can try (before GPTQ)
_SEARCH_ELEMENTS = 1 << 19  # candidates x values evaluated at once by search_range (cache-sized temporaries)


def search_range(rows: torch.Tensor, t: GgmlType, weights: Optional[torch.Tensor] = None, steps: int = 20,
                 clip_ratios: Tuple[float, ...] = (), with_error: bool = False, exact: Optional[bool] = None):
    """Per sub-block (a row of ``rows`` ``(E, sub)``), the range ``(mn, mx)`` (each ``(E,)``, in the convention of
    :func:`grid_from_range`) whose step (and minimum) give the least ``weights``-weighted squared error; with
    ``with_error``, also that least error as the search scored it (``(E,)`` float64, below).

    The search is llama.cpp's kind (``make_qkx2_quants`` / ``make_qx_quants``): ``steps + 1`` candidate steps
    around the one that spans the sub-block, each giving codes by rounding, then the weighted least-squares step
    (and minimum, kept ≤ 0 as the types store it) for those codes; the min-max range is a candidate too, so the
    result is never worse than min-max before the sub-block scales are quantized. Beyond llama.cpp's, spans
    clipped by each of ``clip_ratios`` (e.g. :data:`CLIP_RATIOS`) are candidates too, refitted the same way. That
    is for codes GPTQ chooses afterwards, which make up for a clipped extreme: measured on SmolLM2, Q4_K_M with
    GPTQ +0.70 % against +0.88 % without them, Q3_K_M with bounded GPTQ on the weighted grid +1.68 % against +2.94 %
    (worse without them on the other kinds of text too, docs/accuracy.md), while round-to-nearest got worse with
    them (Q3_K_M +7.10 % against +6.57 %), since a clipped extreme weight then stays clipped.

    The first candidate of least error wins, as if they were tried one after another. A candidate is scored one
    of two ways:

    * ``exact=False``: as llama.cpp scores it, the error of the candidate's codes on the grid refitted to them (an
      upper bound on that grid's error with its nearest codes, which export then writes). Those sums follow for
      every candidate from where each value's code moves on (:func:`_integer_slice`), at about the cost of
      rounding once instead of once per candidate. Integer grids only;
    * ``exact=True``: the refitted grid's exact error (codes rounded again on it), every candidate of a slice of
      sub-blocks at once.

    By default (``exact=None``) the search is exact for the IQ4 table and with ``clip_ratios`` (for GPTQ), and
    llama.cpp's otherwise. Measured on SmolLM2 (``gguf-q4_0-gptq``, held-out docs / LICENSE perplexity): scoring
    the clipped candidates llama.cpp's way gave +2.15 / +10.75 %, exactly +2.30 / +8.09 %; for the data-free
    mixes the two agree within 0.1 point (docs/accuracy.md)."""
    x = rows.to(torch.float32)
    w = None if weights is None else weights.to(torch.float32)
    if exact is None:
        exact = t.table or bool(clip_ratios)
    if not exact:
        if t.table:
            raise ValueError(f"{t.name}: only the exact search runs on the IQ4 table")
        return _search_integer(x, w, t, steps, clip_ratios, with_error)
    deltas = [0.0] + [d for d in (-1.0 + 2.0 * k / steps for k in range(steps + 1)) if d != 0.0]
    candidates = [(d, 1.0) for d in deltas] + [(0.0, float(r)) for r in clip_ratios]
    denominators = [t.search_denominator(d) for d, _ in candidates]
    denom = torch.tensor(denominators, dtype=torch.float32, device=x.device)[:, None]
    ratio = torch.tensor([r for _, r in candidates], dtype=torch.float32, device=x.device)[:, None]
    n, width = x.shape
    mn_out, mx_out = torch.empty(n, device=x.device), torch.empty(n, device=x.device)
    err_out = torch.empty(n, dtype=torch.float64, device=x.device)
    per = max(1, _SEARCH_ELEMENTS // (len(candidates) * max(width, 1)))
    # two work buffers for every slice (fresh temporaries per operation cost more in page faults than in maths)
    bufs = [torch.empty(len(candidates) * min(n, per) * width, device=x.device) for _ in range(2)]
    for a in range(0, n, per):
        b = min(n, a + per)
        work = tuple(buf[:len(candidates) * (b - a) * width].view(len(candidates), b - a, width) for buf in bufs)
        mn_out[a:b], mx_out[a:b], err_out[a:b] = _search_slice(x[a:b], None if w is None else w[a:b], t, denom,
                                                               ratio, work)
    return (mn_out, mx_out, err_out) if with_error else (mn_out, mx_out)


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
    least, best = torch.min(torch.where(torch.isnan(err), torch.inf, err), dim=0, keepdim=True)
    return (*t.range_of(fit_step.gather(0, best)[0], fit_low.gather(0, best)[0]), least[0].to(torch.float64))


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


# --------------------------------------------------------------------------------------------------------------
# integer grids: every candidate step at the cost of about one, from where each value's code changes
# --------------------------------------------------------------------------------------------------------------
_EVENT_VALUES = 1 << 17  # values of x per slice of _search_integer (its temporaries stay cache-sized)


def _search_integer(x, w, t: GgmlType, steps: int, clip_ratios, with_error: bool):
    """:func:`search_range` on an integer grid (``SignedGrid`` / ``MinGrid``), slice by slice of sub-blocks, every
    slice in the same work buffers (fresh temporaries of this size cost more in page faults than in maths)."""
    if steps < 2 or steps % 2:
        raise ValueError(f"steps must be even and at least 2 (the min-max step is the middle one), got {steps}")
    n, width = x.shape
    mn_out, mx_out = torch.empty(n, device=x.device), torch.empty(n, device=x.device)
    err_out = torch.empty(n, dtype=torch.float64, device=x.device) if with_error else None
    per = min(n, max(1, _EVENT_VALUES // max(width, 1)))
    work = _Work(per, width, steps + 2, len(clip_ratios), x.device, w is None)
    for a in range(0, n, per):
        b = min(n, a + per)
        mn_out[a:b], mx_out[a:b], least = _integer_slice(x[a:b], None if w is None else w[a:b], t, steps,
                                                         clip_ratios, work.rows(b - a))
        if with_error:  # the error less Σw·x², plus Σw·x²
            xb = x[a:b].to(torch.float64)
            err_out[a:b] = least + (xb * xb * (1.0 if w is None else w[a:b].to(torch.float64))).sum(1)
    return (mn_out, mx_out, err_out) if with_error else (mn_out, mx_out)


class _Work:
    """The work buffers of :func:`_integer_slice` for up to ``per`` sub-blocks of ``width`` values; ``rows(e)``:
    views of the first ``e``."""

    def __init__(self, per, width, bins, clips, device, ones):
        f32 = dict(dtype=torch.float32, device=device)
        f64 = dict(dtype=torch.float64, device=device)
        self.b = [torch.empty(per, width, **f32) for _ in range(6)]
        self.ones = torch.ones(per, width, **f32) if ones else None
        self.index = [torch.empty(per, width, dtype=torch.int64, device=device) for _ in range(2)]
        self.f64 = [torch.empty(per, width, **f64) for _ in range(2)]
        self.bins = torch.empty(per, bins, **f32)
        self.sums = [torch.empty(per, clips + bins, **f64) for _ in range(3)]
        self.err = torch.empty(per, 1 + clips + bins - 1, **f64)
        self.e = [torch.empty(per, clips + bins - 1, **f64) for _ in range(4)]

    def rows(self, e):
        view = _Work.__new__(_Work)
        for k, v in vars(self).items():
            setattr(view, k, None if v is None else [t[:e] for t in v] if isinstance(v, list) else v[:e])
        return view


def _integer_slice(x, w, t: GgmlType, steps: int, clip_ratios, work: _Work):
    """One slice of :func:`_search_integer`: ``x`` ``(e, sub)``.

    Each candidate step is ``span / D`` for ``D`` in ``D0 - 1 … D0 + 1`` (``steps + 1`` of them, ``D0`` the min-max
    candidate's levels across), so a value's code is ``round(z·D)`` for a fixed ``z`` (its place in the span).
    Over that range a code moves at most two levels, always the same way: the codes of every candidate follow from
    the codes at the lowest ``D`` and the (at most two) candidates at which each value's code moves on. The sums
    the least-squares step needs are then the lowest candidate's plus a running total of those moves (a
    scatter-add and a cumulative sum), instead of rounding every value once per candidate. Each candidate is scored
    as llama.cpp's ``make_qx_quants`` scores it: the weighted squared error of its codes on the step (and minimum)
    refitted to them; a candidate whose refit is degenerate is dropped (the min-max candidate, never refitted, is
    always there and first, so it wins ties)."""
    e, sub = x.shape
    qmin, qmax = t.qmin_qmax
    full_mn, full_mx = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    d0, d_lo = float(t.search_denominator(0.0)), float(t.search_denominator(-1.0))
    b0, b1, b2, b3, b4, b5 = work.b
    if t.symmetric:  # the larger end takes the most negative code: step = sign·amax / D
        amax = torch.maximum(-full_mn, full_mx)
        span = torch.where(full_mx > -full_mn, -amax, amax)
        low = torch.zeros_like(span)
        z = torch.mul(x, inverse_or_zero(span)[:, None], out=b0)
    else:  # step = (max - min) / D, minimum kept: value = step·q - low
        span = full_mx - full_mn
        low = -full_mn
        z = torch.add(x, low[:, None], out=b0).mul_(inverse_or_zero(span)[:, None])
    # (elementwise arithmetic only: torch's where and masked_fill cost ten times a multiplication here)
    # |code| = round(a·D), a halfway value away from zero; its moves in float64, where a·D is exact for float32
    # a and the candidates' D, so each candidate's codes are exactly the rounded values
    sgn = torch.sign(z, out=b1)
    a = z.abs_()
    first, second = work.f64
    first.copy_(a).mul_(d_lo).add_(0.5).floor_()  # |code| at the lowest candidate
    if t.symmetric:  # the largest |code|: -qmin below zero, qmax above
        cap = torch.mul(sgn, -0.5, out=b3).add_(qmax + 0.5)
        torch.minimum(first, cap, out=first)
        m0 = b2.copy_(first)
        room = cap.sub_(m0)
    else:
        m0 = b2.copy_(first.clamp_(max=qmax))
        room = torch.neg(m0, out=b3).add_(qmax)
    # the candidates at which each code moves one and two levels on; steps + 1: never (a bin nobody reads)
    kmax = float(steps + 1)
    second.copy_(a)
    first.add_(0.5).div_(second)  # the D at which |code| reaches m0 + 1 (inf where z = 0: never)
    second.reciprocal_().add_(first)  # … m0 + 2
    per_d = steps / 2  # candidates per unit of D
    second.sub_(d_lo).mul_(per_d).add_(torch.neg(room, out=b4).add_(2).clamp_(0, 1).mul_(kmax))  # not past cap
    first.sub_(d_lo).mul_(per_d).add_(room.neg_().add_(1).clamp_(min=0).mul_(kmax))
    i1, i2 = work.index
    i1.copy_(first.ceil_().clamp_(1.0, kmax))
    i2.copy_(second.ceil_().clamp_(1.0, kmax))
    wt = work.ones if w is None else w
    ws = torch.mul(wt, sgn, out=b0)  # what one level's move adds to Σw·q
    wsx = torch.mul(ws, x, out=b3)  # … to Σw·x·q
    wq = torch.mul(wt, m0, out=b4)
    base_qq = torch.mul(wq, m0, out=b5).sum(1, dtype=torch.float64)  # Σw·q² at the lowest candidate
    wq.mul_(sgn)  # w·q there
    base_xq = torch.mul(wq, x, out=b5).sum(1, dtype=torch.float64)
    base_q = None if t.symmetric else wq.sum(1, dtype=torch.float64)
    f64 = torch.float64  # (sums over a sub-block's values in float64: at 8 bits candidates differ by ~1e-6)
    sw, sx = wt.sum(1, keepdim=True, dtype=f64), torch.mul(wt, x, out=b1).sum(1, keepdim=True, dtype=f64)
    move_qq = m0.mul_(2).add_(1).mul_(wt)  # what the first move (m0 → m0 + 1) adds to Σw·q²; the second 2w more
    move_qq2 = torch.add(move_qq, wt, alpha=2, out=b5)
    clips = len(clip_ratios)

    def running(out, base, move1, move2):  # Σ at each candidate: the lowest's plus the moves up to it
        work.bins.zero_().scatter_add_(1, i1, move1).scatter_add_(1, i2, move2)
        region = out[:, clips:]
        return region.copy_(work.bins).cumsum_(1).add_(base[:, None])

    xq_all, qq_all, sq_all = work.sums  # (e, clips | steps + 1 candidates | 1 never read)
    running(xq_all, base_xq, wsx, wsx)
    running(qq_all, base_qq, move_qq, move_qq2)
    if not t.symmetric:  # Σw·q: only a grid with a minimum needs it
        running(sq_all, base_q, ws, ws)
    for j, r in enumerate(clip_ratios):  # spans clipped by r: codes at D0, refitted the same way
        _clipped_sums(x, wt, t, span * r, low * r, d0, [v[:, j:j + 1] for v in work.sums], work.b[:2])
    n = clips + steps + 1
    xq, qq = xq_all[:, :n], qq_all[:, :n]
    sq = None if t.symmetric else sq_all[:, :n]
    mid = clips + steps // 2
    mm = (xq[:, mid:mid + 1], qq[:, mid:mid + 1], None if sq is None else sq[:, mid:mid + 1])
    mm_step, mm_low = (span / d0)[:, None], low[:, None]  # the min-max grid, not refitted, first: it wins ties
    sign = torch.sign(span).double()[:, None]
    err = work.err
    err[:, :1] = _error(mm, sw, sx, mm_step, mm_low)
    _refit_error(xq, qq, sq, sw, sx, sign, err[:, 1:], work.e)
    least, best = torch.min(err, dim=1, keepdim=True)  # the first of least error
    pick = lambda v: None if v is None else v.gather(1, (best - 1).clamp_(min=0))
    step, fit_low = _refit(pick(xq), pick(qq), pick(sq), sw, sx, sign)
    use_mm = best == 0
    step = torch.where(use_mm, mm_step.double(), step)[:, 0].to(torch.float32)
    fit_low = torch.where(use_mm, mm_low.double(), fit_low)[:, 0].to(torch.float32)
    return (*t.range_of(step, fit_low), least[:, 0])


def _clipped_sums(x, wt, t: GgmlType, span, low, d0, out, bufs):
    """``out`` := ``(Σw·x·q, Σw·q², Σw·q)`` ``(e, 1)`` of the codes nearest ``x`` on the grid ``span / d0``, ``low``
    (``bufs``: two ``x``-sized work buffers)."""
    qmin, qmax = t.qmin_qmax
    q, wq = bufs
    (torch.mul(x, inverse_or_zero(span)[:, None], out=q) if t.symmetric
     else torch.add(x, low[:, None], out=q).mul_(inverse_or_zero(span)[:, None])).mul_(d0).round_()
    q.clamp_(qmin, qmax) if t.symmetric else q.clamp_(0, qmax)
    torch.mul(wt, q, out=wq)
    f64 = torch.float64
    out[1].copy_(q.mul_(wq).sum(1, keepdim=True, dtype=f64))
    if not t.symmetric:
        out[2].copy_(wq.sum(1, keepdim=True, dtype=f64))
    out[0].copy_(wq.mul_(x).sum(1, keepdim=True, dtype=f64))


def _refit(xq, qq, sq, sw, sx, sign):
    """The weighted least-squares step and minimum (``low`` ≥ 0; value = step·q - low) for codes with sums ``xq`` =
    Σw·x·q, ``qq`` = Σw·q², ``sq`` = Σw·q (float64; ``sq`` None: no minimum). Where the two-parameter fit is
    degenerate, would store a minimum above zero or a negative step, the step alone (``low`` = 0); ``sign``: the
    sign the codes were rounded with, which the step keeps (zero where it cannot)."""
    alone = (xq * sign).clamp_(min=0).mul_(sign).div_(qq.clamp(min=1e-300))
    if sq is None:
        return alone, torch.zeros_like(alone)
    det, low_num, step_num, both = _two_parameter(xq, qq, sq, sw, sx, [torch.empty_like(xq) for _ in range(4)])
    safe = det.clamp(min=1e-300)
    return torch.where(both, step_num / safe, alone), torch.where(both, low_num / safe, torch.zeros_like(alone))


def _two_parameter(xq, qq, sq, sw, sx, bufs):
    """The two-parameter least-squares fit's determinant and the numerators of its minimum and step (written into
    the first three of ``bufs``, four buffers like ``xq``), and where that fit stands: a positive determinant, a
    minimum not above zero, a positive step. :func:`_refit` and :func:`_refit_error` share it, so that the grid
    a candidate is scored on is the one it gets."""
    e1, e2, e3, e4 = bufs
    det = torch.mul(sw, qq, out=e1).sub_(torch.mul(sq, sq, out=e2))
    low_num = torch.mul(sq, xq, out=e2).sub_(torch.mul(qq, sx, out=e3))
    step_num = torch.mul(sw, xq, out=e3).sub_(torch.mul(sx, sq, out=e4))
    return det, low_num, step_num, (det > 0) & (low_num >= 0) & (step_num > 0)


def _refit_error(xq, qq, sq, sw, sx, sign, out, bufs):
    """``out`` := Σw·(x - value)² less Σw·x² (the same for every candidate of a sub-block) for codes with these sums
    on the grid :func:`_refit` fits to them; zero (the error of no grid at all, never below the min-max grid's)
    where no step keeps ``sign``. ``bufs``: four work buffers like ``out``."""
    e1, e2, e3, e4 = bufs
    torch.mul(xq, sign, out=out).clamp_(min=0)
    out.mul_(out).div_(torch.clamp(qq, min=1e-300, out=e1)).neg_()  # the step alone
    if sq is None:
        return out
    det, _, _, both = _two_parameter(xq, qq, sq, sw, sx, bufs)
    # −(Σw·(Σwxq)² − 2Σwx·Σwq·Σwxq + Σwq²·(Σwx)²) / det, the error of the two-parameter fit
    two = torch.mul(sx, sq, out=e2).mul_(xq).mul_(-2).add_(torch.mul(xq, xq, out=e3).mul_(sw))
    two.add_(torch.mul(qq, sx * sx, out=e3)).div_(det.clamp_(min=1e-300)).neg_()
    return torch.where(both, two, out, out=out)


def _error(sums, sw, sx, step, low):
    """Σw·(x - (step·q - low))² less Σw·x² for codes with ``sums`` ``(xq, qq, sq)`` on the grid ``step``/``low``."""
    xq, qq, sq = sums
    step, low = step.to(torch.float64), low.to(torch.float64)
    err = -2 * step * xq + step * step * qq
    if sq is not None:
        err = err + 2 * low * sx - 2 * step * low * sq + low * low * sw
    return err
