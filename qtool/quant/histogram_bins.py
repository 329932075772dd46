"""Histogram bin arithmetic shared by the histogram analyzers (``quant/analysis/histogram.py``, ``sqnr.py``):
AIMET's bin edges, ``torch.histc``'s bin of each value, and the sparse-entry helpers (merge equal bins, find the
first bin reaching a cumulative count, scatter entries into dense counts). Pure tensor maths, no analyzer state.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .affine import true_div


def _edges(lo: torch.Tensor, hi: torch.Tensor, num_bins: int):
    """AIMET's bin edges as ``(lo_e, step)``: ``edge[i] = i * step + lo_e``; ``lo == hi`` widens by 0.5 each way."""
    degenerate = lo == hi
    lo_e = torch.where(degenerate, lo - 0.5, lo)
    hi_e = torch.where(degenerate, hi + 0.5, hi)
    return lo_e, true_div(hi_e - lo_e, num_bins)


def _edge(index: torch.Tensor, lo_e: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``edge[index]`` exactly as AIMET computes it (``arange * step + lo_e`` in float32)."""
    return index.to(torch.float32) * step + lo_e


def _bin_index(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, num_bins: int, clean: bool,
               as_float: bool = False) -> torch.Tensor:
    """``torch.histc``'s bin of each value of row ``e`` for the range ``[lo[e], hi[e]]`` (int64).

    histc computes ``trunc((x - lo) * N / (hi - lo))`` in float32 and puts ``x == hi`` in the last bin. Values
    outside the range are clamped into the end bins (what AIMET's fix-up after histc does); NaN gets bin 0 (the
    caller gives it no weight). ``clean`` promises finite values inside ``[lo, hi + a few ulps]``.
    """
    d = x - lo[:, None]
    if num_bins & (num_bins - 1) == 0:
        # N is a power of two, so (d * N) and (w / N) are exact and d / (w / N) rounds like (d * N) / w.
        d.div_(((hi - lo) / num_bins)[:, None])
    else:
        d.mul_(num_bins).div_((hi - lo)[:, None])
    if as_float:  # the same bins as float32 numbers (truncation is what the int64 cast does)
        if clean:
            return d.trunc_().clamp_(max=num_bins - 1)
        return d.clamp_(0, num_bins - 1).nan_to_num_(0.0).trunc_()
    if clean:
        return d.to(torch.int64).clamp_(max=num_bins - 1)
    return d.clamp_(0, num_bins - 1).nan_to_num_(0.0).to(torch.int64)


def _aggregate(bins: torch.Tensor, counts: torch.Tensor):
    """Sort entries by bin and merge equal bins: returns ``(bins, counts)`` with each bin's total count on the
    last entry of its run and 0 on the others (same width; no host sync)."""
    sb, order = torch.sort(bins, dim=1)
    sc = counts.gather(1, order)
    num_enc, width = sb.shape
    start = torch.ones_like(sb, dtype=torch.bool)
    start[:, 1:] = sb[:, 1:] != sb[:, :-1]
    end = torch.ones_like(start)
    end[:, :-1] = start[:, 1:]
    cum = sc.cumsum(dim=1)
    before = torch.zeros_like(cum)
    before[:, 1:] = cum[:, :-1]
    pos = torch.arange(width, device=sb.device).expand(num_enc, width)
    run_start = torch.where(start, pos, torch.zeros_like(pos)).cummax(dim=1).values
    total = torch.where(end, cum - before.gather(1, run_start), torch.zeros_like(cum))
    return sb, total


def _first_bin_reaching(
    bins: torch.Tensor, counts: Optional[torch.Tensor], target: torch.Tensor, num_bins: int
) -> torch.Tensor:
    """Per row, the least bin ``b`` whose cumulative count ``sum(counts[bins <= b])`` reaches ``target``, i.e.
    ``searchsorted(cumsum(dense histogram), target)``, found by bisection over the bin index (ceil(log2 N)
    fixed steps over the entries: no sort, no host sync). ``counts=None`` means one per entry."""
    num_enc = bins.shape[0]
    bins = bins.to(torch.int32)  # (int32 compares vectorize far better than int64 on CPU)
    lo = torch.zeros(num_enc, dtype=torch.int32, device=bins.device)
    hi = torch.full_like(lo, num_bins - 1)
    for _ in range(max(0, math.ceil(math.log2(num_bins)))):
        mid = (lo + hi) // 2
        below = bins <= mid[:, None]
        reached = (below.sum(dim=1) if counts is None else torch.where(below, counts, 0.0).sum(dim=1)) >= target
        hi = torch.where(reached, mid, hi)
        lo = torch.where(reached, lo, mid + 1)
    return lo.to(torch.int64)


def _scatter_dense(bins: torch.Tensor, counts: Optional[torch.Tensor], num_bins: int) -> torch.Tensor:
    """Dense ``(E, N)`` float32 counts from ``(E, K)`` entries (``counts=None``: one each)."""
    num_enc = bins.shape[0]
    flat = (bins + (torch.arange(num_enc, device=bins.device) * num_bins)[:, None]).reshape(-1)
    if counts is None:
        dense = torch.bincount(flat, minlength=num_enc * num_bins).to(torch.float32)
    else:
        dense = torch.zeros(num_enc * num_bins, dtype=torch.float32, device=bins.device)
        dense.index_add_(0, flat, counts.reshape(-1).to(torch.float32))
    return dense.view(num_enc, num_bins)
