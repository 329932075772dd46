"""Encoding analyzers: they watch calibration data and choose a quantizer's ``(min, max)``.

Every analyzer has the same interface::

    analyzer = MinMaxEncodingAnalyzer(shape, block_size=None)
    analyzer.update_stats(x)              # once per batch; returns the batch's own statistics
    mn, mx = analyzer.compute_encodings(num_steps, is_symmetric)
    analyzer.reset_stats()

Analyzers: :class:`MinMaxEncodingAnalyzer` (running min/max), :class:`PercentileEncodingAnalyzer`,
:class:`SqnrEncodingAnalyzer` and :class:`TfEnhancedEncodingAnalyzer` (AIMET's histogram analyzers, bit-exact
with AIMET's outputs), :class:`MseEncodingAnalyzer` (direct clipping search for weights). Every encoding element
(per-tensor, per-channel, per-block) is handled in the same batched tensor ops, never one at a time.

Statistics are float32 tensors on the device of the data; nothing is copied from a GPU to the host while
statistics are collected (on CPU a few shortcuts read CPU tensors, e.g. whether a batch is all finite). The
searches in ``compute_encodings`` read a few sizes on the host to size their chunks (once per SQNR search, once
per candidate chunk in MSE).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Tuple

import torch

from .affine import (
    _min_scale,
    adjust_min_max,
    blocked_shapes,
    min_max_to_scale_offset,
    quantize_dequantize,
    reduce_to_shape,
    resolve_grid,
)

__all__ = [
    "EncodingAnalyzer",
    "MinMaxEncodingAnalyzer",
    "PercentileEncodingAnalyzer",
    "SqnrEncodingAnalyzer",
    "TfEnhancedEncodingAnalyzer",
    "MseEncodingAnalyzer",
    "NoStatisticsError",
]


class NoStatisticsError(RuntimeError):
    """compute_encodings() was called before any data was seen."""


class EncodingAnalyzer:
    """Base class: holds the encoding ``shape`` and optional ``block_size``."""

    def __init__(self, shape: Sequence[int] = (), block_size: Optional[Sequence[int]] = None):
        self.shape = tuple(int(d) for d in shape)
        self.block_size = None if block_size is None else tuple(int(b) for b in block_size)

    def update_stats(self, x: torch.Tensor):  # pragma: no cover - interface
        raise NotImplementedError

    def reset_stats(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def compute_encodings(self, num_steps: int, is_symmetric: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError  # pragma: no cover - interface

    def compute_dynamic_encodings(self, stats, num_steps: int, is_symmetric: bool):
        """Encodings from one batch's statistics alone (used while calibrating, as AIMET does)."""
        raise NotImplementedError  # pragma: no cover - interface

    def has_stats(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class MinMaxEncodingAnalyzer(EncodingAnalyzer):
    """Running elementwise min and max over all batches, reduced to the encoding shape (blocks included)."""

    def __init__(self, shape: Sequence[int] = (), block_size: Optional[Sequence[int]] = None):
        super().__init__(shape, block_size)
        self.min: Optional[torch.Tensor] = None
        self.max: Optional[torch.Tensor] = None

    @torch.no_grad()
    def update_stats(self, x: torch.Tensor):
        x = x.detach().as_subclass(torch.Tensor)
        mn, mx = reduce_to_shape(x, self.shape, self.block_size)
        mn, mx = mn.to(torch.float32), mx.to(torch.float32)
        if self.min is None:
            self.min, self.max = mn.clone(), mx.clone()
        else:
            torch.minimum(self.min, mn.to(self.min.device), out=self.min)
            torch.maximum(self.max, mx.to(self.max.device), out=self.max)
        return mn, mx

    def reset_stats(self) -> None:
        self.min = self.max = None

    def has_stats(self) -> bool:
        return self.min is not None

    def compute_encodings(self, num_steps: int, is_symmetric: bool):
        if self.min is None:
            raise NoStatisticsError("no statistics: call update_stats() with data first")
        return adjust_min_max(self.min, self.max, num_steps, is_symmetric)

    def compute_dynamic_encodings(self, stats, num_steps: int, is_symmetric: bool):
        mn, mx = stats
        return adjust_min_max(mn, mx, num_steps, is_symmetric)


# ==============================================================================================================
# Histogram analyzers (AIMET's v2 histogram observer, batched over all encodings)
# ==============================================================================================================
#
# How a histogram is kept (per encoding element; AIMET keeps a Python list of these, we keep them stacked):
#
# * ``lo``/``hi`` are the running min and max of the finite values seen (AIMET's ``stats.min``/``stats.max``).
#   The bin edges are ``edge[i] = i * step + lo_e`` (float32, that order) with ``lo_e = lo``,
#   ``step = (hi - lo) / N``; a degenerate range ``lo == hi`` uses ``[lo - 0.5, hi + 0.5]``.
# * First batch: bins as ``torch.histc(x, N, edge[0], edge[N])``, i.e. ``trunc((x - lo) * N / (edge[N] - lo))``
#   in float32, the last bin closed; values above ``edge[N]`` (it may round below the true max) and ``+inf`` go
#   to the last bin, ``-inf`` to the first, NaN is not counted.
# * Later batches: the range becomes ``[min(lo, batch_min), max(hi, batch_max)]``. If it changed, every old bin
#   is re-binned as AIMET does: bin ``i`` starts at ``s = lo_e + step * i``; it goes to new bin
#   ``d = min(trunc((s - new_lo) / new_step), N - 1)``, except that ``round((end(d) - s) / step * count)`` (at
#   most ``count``) stays there and the rest goes to the bin of ``s + new_step``. The batch itself is binned
#   as ``histc(x, N, new_lo, new_hi)`` (here the true max is the right edge).
#
# Where we differ from AIMET (never on finite data with a non-degenerate first range): re-binning out of a
# degenerate range uses its widened edges (AIMET divides by zero there), and a row without any finite value
# gets the range [0, 0] (AIMET raises).
#
# Storage: counts are float32 (exact integers below 2**24 per encoding, as in AIMET). Encodings that see few
# values per batch (``<= N / 2``, e.g. 32-wide weight blocks against 2048 bins) keep a sparse list of
# ``(bin, count)`` entries instead of N dense bins; the first batch is even kept as its raw values until it is
# needed. Both forms hold exactly the same counts; the only observable difference is the order of the float
# sum in the SQNR noise estimate (see SqnrEncodingAnalyzer).

_PRUNE_MAX_STEPS = 4095  # SQNR searches on wider grids evaluate every candidate (see _ClipBound)
_CHUNK_ELEMENTS = 1 << 18  # search temporaries are cut to about this many elements (cache-sized chunks)


def _encoding_rows(x: torch.Tensor, shape: Tuple[int, ...], block_size) -> torch.Tensor:
    """``x`` as ``(E, M)``: one row per encoding element (row-major over ``shape``), all of its values."""
    x_view, _, _ = blocked_shapes(x.shape, shape, block_size)
    nlead = len(x_view) - 2 * len(shape)
    perm = (
        [nlead + 2 * i for i in range(len(shape))]
        + list(range(nlead))
        + [nlead + 2 * i + 1 for i in range(len(shape))]
    )
    num_enc = math.prod(shape)
    return x.reshape(x_view).permute(perm).reshape(num_enc, -1)


def _maybe_nonfinite(lo: torch.Tensor, hi: torch.Tensor) -> bool:
    """Whether per-row min/max ``lo``/``hi`` may come from rows holding inf/NaN (then they are inf/NaN).

    On CPU this is one cheap reduction read on the host; on other devices we answer yes without reading, so
    nothing waits for the device (the callers then take the always-correct path).
    """
    if lo.device.type != "cpu":
        return True
    return not math.isfinite(float((hi - lo).sum()))  # finite overflow only costs the slow path


def _finite_min_max(rows: torch.Tensor):
    """Per-row min and max over finite values (AIMET ignores inf/NaN here); a row with none gives 0, 0.

    Returns ``(lo, hi, clean)``; ``clean`` is True only when every value is known to be finite.
    """
    if rows.shape[1] == 0:
        raise ValueError("update_stats() got an empty tensor")
    lo, hi = rows.amin(dim=1), rows.amax(dim=1)  # (two passes beat aminmax(dim=...) on CPU)
    if not _maybe_nonfinite(lo, hi):
        return lo, hi, True
    finite = torch.isfinite(rows)
    inf = torch.tensor(float("inf"), dtype=rows.dtype, device=rows.device)
    lo = torch.where(finite, rows, inf).amin(dim=1)
    hi = torch.where(finite, rows, -inf).amax(dim=1)
    some = finite.any(dim=1)
    lo = torch.where(some, lo, torch.zeros_like(lo))
    hi = torch.where(some, hi, torch.zeros_like(hi))
    return lo, hi, False


def _edges(lo: torch.Tensor, hi: torch.Tensor, num_bins: int):
    """AIMET's bin edges as ``(lo_e, step)``: ``edge[i] = i * step + lo_e``; ``lo == hi`` widens by 0.5 each way."""
    degenerate = lo == hi
    lo_e = torch.where(degenerate, lo - 0.5, lo)
    hi_e = torch.where(degenerate, hi + 0.5, hi)
    return lo_e, (hi_e - lo_e) / num_bins


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


class _Histograms:
    """Stacked per-encoding histograms with AIMET's binning and re-binning (see the comment above).

    State, one row per encoding: ``lo``/``hi`` (running finite min/max, float32) and one of
      * ``raw``: the first batch's values, still unbinned (sparse regime, until they are needed);
      * ``bins``/``counts``: ``(E, K)`` sparse entries (a bin may appear more than once);
      * ``counts`` alone: ``(E, N)`` dense counts.
    ``limit_lo``/``limit_hi``, when set, cap how far the range may grow (values beyond land in the end bins).
    """

    def __init__(self, num_bins: int):
        if int(num_bins) <= 0:
            raise ValueError("Number of bins cannot be less than or equal to 0.")
        self.num_bins = int(num_bins)
        self.sparse_limit = self.num_bins // 2  # most entries per encoding kept sparse (0: always dense)
        self.reset()

    def reset(self) -> None:
        self.lo: Optional[torch.Tensor] = None
        self.hi: Optional[torch.Tensor] = None
        self.raw: Optional[torch.Tensor] = None
        self.raw_clean = True
        self.bins: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None
        self.limit_lo: Optional[torch.Tensor] = None
        self.limit_hi: Optional[torch.Tensor] = None

    def empty(self) -> bool:
        return self.lo is None

    # -- first batch ---------------------------------------------------------------------------------------
    def first_edges(self):
        """``(lo_e, step, right)``: the first batch's edges and the right edge ``edge[N]`` its histc used."""
        lo_e, step = _edges(self.lo, self.hi, self.num_bins)
        return lo_e, step, step * self.num_bins + lo_e

    def _raw_entries(self, as_float: bool = False):
        """The first batch (kept raw) as ``(bins, counts)``; counts is None when every value counts once."""
        lo_e, _, right = self.first_edges()
        bins = _bin_index(self.raw, lo_e, right, self.num_bins, self.raw_clean, as_float)
        counts = None if self.raw_clean else (~torch.isnan(self.raw)).to(torch.float32)
        return bins, counts

    # -- update ----------------------------------------------------------------------------------------------
    def add(self, rows: torch.Tensor):
        """Fold one batch ``(E, M)`` in; returns the batch's own finite ``(min, max)``."""
        rows = rows.to(torch.float32)
        b_lo, b_hi, clean = _finite_min_max(rows)
        if self.lo is None:
            self._first(rows, b_lo, b_hi, clean)
        else:
            self._merge(rows.to(self.lo.device), b_lo.to(self.lo.device), b_hi.to(self.lo.device), clean)
        return b_lo, b_hi

    def _first(self, rows, lo, hi, clean):
        self.lo, self.hi = lo, hi
        self.on_first(lo, hi)
        if rows.shape[1] <= self.sparse_limit:
            self.raw, self.raw_clean = rows.clone(), clean
        else:
            lo_e, _, right = self.first_edges()
            bins = _bin_index(rows, lo_e, right, self.num_bins, clean)
            counts = None if clean else (~torch.isnan(rows)).to(torch.float32)
            self.counts = _scatter_dense(bins, counts, self.num_bins)

    def on_first(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Hook run once with the first batch's range (TF-enhanced sets its growth limit here)."""

    def _current_entries(self):
        """Current counts as ``(bins, counts)`` with each bin's count in one place (what re-binning needs)."""
        n = self.num_bins
        if self.raw is not None:
            bins, counts = self._raw_entries()
            if counts is None:
                counts = torch.ones_like(bins, dtype=torch.float32)
            return _aggregate(bins, counts)
        if self.bins is not None:
            return _aggregate(self.bins, self.counts)
        return torch.arange(n, device=self.counts.device).expand_as(self.counts), self.counts

    def _merge(self, rows, b_lo, b_hi, clean):
        n = self.num_bins
        lo, hi = self.lo, self.hi
        new_lo, new_hi = torch.minimum(lo, b_lo), torch.maximum(hi, b_hi)
        if self.limit_lo is not None:
            new_lo = torch.maximum(new_lo, torch.minimum(self.limit_lo, lo))
            new_hi = torch.minimum(new_hi, torch.maximum(self.limit_hi, hi))
            clean = False  # values beyond the limit are clamped into the end bins
        changed = (new_lo != lo) | (new_hi != hi)

        # re-bin the current histogram into [new_lo, new_hi] (rows whose range did not change keep their bins)
        src_bins, src_counts = self._current_entries()
        lo_e, step = _edges(lo, hi, n)
        start = lo_e[:, None] + step[:, None] * src_bins.to(torch.float32)
        dst_step = torch.where(changed, (new_hi - new_lo) / n, torch.ones_like(new_lo))[:, None]
        dst = ((start - new_lo[:, None]) / dst_step).to(torch.int64).clamp_(0, n - 1)
        dst_end = new_lo[:, None] + dst_step * (dst + 1).to(torch.float32)
        stay = torch.minimum(torch.round((dst_end - start) / step[:, None] * src_counts), src_counts)
        nxt = ((start + dst_step - new_lo[:, None]) / dst_step).to(torch.int64).clamp_(0, n - 1)
        ch = changed[:, None]
        moved_bins = torch.cat([torch.where(ch, dst, src_bins), torch.where(ch, nxt, src_bins)], dim=1)
        moved_counts = torch.cat(
            [torch.where(ch, stay, src_counts), torch.where(ch, src_counts - stay, torch.zeros_like(stay))], dim=1
        )

        # the batch itself, binned on the new range (a degenerate range bins like AIMET's histc: middle bin)
        deg = new_lo == new_hi
        b_lo_e = torch.where(deg, new_lo - 0.5, new_lo)
        b_hi_e = torch.where(deg, new_hi + 0.5, new_hi)
        bins = _bin_index(rows, b_lo_e, b_hi_e, n, clean)
        counts = None if clean else (~torch.isnan(rows)).to(torch.float32)

        self.lo, self.hi, self.raw = new_lo, new_hi, None
        width = moved_bins.shape[1] + bins.shape[1]
        if self.bins is None and self.counts is not None or width > self.sparse_limit:  # dense
            dense = _scatter_dense(moved_bins, moved_counts, n)
            self.counts = dense + _scatter_dense(bins, counts, n)
            self.bins = None
        else:
            if counts is None:
                counts = torch.ones_like(bins, dtype=torch.float32)
            self.bins = torch.cat([moved_bins, bins], dim=1)
            self.counts = torch.cat([moved_counts, counts], dim=1)

    # -- queries ---------------------------------------------------------------------------------------------
    def entries(self, as_float: bool = False):
        """``(bins, counts)``: ``bins=None`` means dense counts over all N bins, ``counts=None`` one per entry.
        ``as_float``: the bins of a raw first batch as float32 numbers (saves a cast where floats are wanted)."""
        if self.raw is not None:
            return self._raw_entries(as_float)
        return self.bins, self.counts

    def percentile_bins(self, percentile: float):
        """Bin indices ``(i_lo, i_hi)`` of AIMET's percentile rule: with ``total`` counted values, the first bin
        whose cumulative count reaches ``t_hi = (total * p) / 100`` (float32; ``searchsorted`` on the cumulative
        histogram, left side), and likewise for ``t_lo = total * (1 - p / 100)``."""
        n = self.num_bins
        if self.raw is not None and self.raw_clean:
            # First batch, all finite: one count per value and the same total M in every row, so the targets are
            # host numbers and the answer is the bin of the k-th smallest value (bins are monotone in x), with
            # k = ceil(t) - 1 the same for all rows: the row's min or max (known already) when p >= 100 - 100 / M,
            # the common case for narrow blocks, else one kthvalue.
            width = self.raw.shape[1]
            m = torch.tensor(float(width), dtype=torch.float32)
            lo_e, _, right = self.first_edges()
            out = []
            for t in (float(m * (1 - percentile / 100)), float(m * percentile / 100)):
                k = min(max(math.ceil(t) - 1, 0), width - 1)
                if t <= 0 or k == 0:
                    out.append(torch.zeros_like(self.lo, dtype=torch.int64))
                    continue
                v = self.hi if k == width - 1 else torch.kthvalue(self.raw, k + 1, dim=1).values
                out.append(_bin_index(v[:, None], lo_e, right, n, clean=True)[:, 0])
            return out
        total = self.total()
        targets = (total * (1 - percentile / 100), total * percentile / 100)
        if self.bins is None and self.raw is None:
            cum = self.counts.cumsum(dim=1)
            return [(cum < t[:, None]).sum(dim=1) for t in targets]
        bins, counts = self.entries()
        return [_first_bin_reaching(bins, counts, t, n) for t in targets]

    def total(self) -> torch.Tensor:
        if self.raw is not None:
            if self.raw_clean:
                return torch.full_like(self.lo, float(self.raw.shape[1]))
            return (~torch.isnan(self.raw)).sum(dim=1).to(torch.float32)
        return self.counts.sum(dim=1)


def _aimet_adjust_min_max(mn: torch.Tensor, mx: torch.Tensor, num_steps: int, symmetric: bool):
    """AIMET's ``adjust_min_max`` used by the percentile analyzer (no 2-bit special case; constants formed in
    Python double precision before they meet the float32 tensors, as there)."""
    n = int(num_steps)
    ms = _min_scale(n)
    f32 = torch.finfo(torch.float32)
    mn = torch.clamp(torch.minimum(mn, torch.zeros_like(mn)), min=f32.min, max=0)
    mx = torch.clamp(torch.maximum(mx, torch.zeros_like(mx)), min=0, max=f32.max)
    tight = (mx - mn) / n < ms
    if symmetric:
        mn = torch.where(tight, mn - ms * math.ceil(n / 2), mn)
        mx = torch.where(tight, mx + ms * math.floor(n / 2), mx)
        pos, neg = n // 2, math.ceil(n / 2)
        delta = torch.maximum(mx / pos, -mn / neg)
        return -neg * delta, pos * delta
    return mn, torch.where(tight, mx + ms * n, mx)


class _HistogramAnalyzer(EncodingAnalyzer):
    """Shared plumbing of the histogram analyzers: one histogram per encoding element, batched."""

    def __init__(self, shape: Sequence[int] = (), block_size: Optional[Sequence[int]] = None, num_bins: int = 2048):
        super().__init__(shape, block_size)
        self._hist = self._make_histograms(int(num_bins))

    def _make_histograms(self, num_bins: int) -> _Histograms:
        return _Histograms(num_bins)

    @property
    def num_bins(self) -> int:
        return self._hist.num_bins

    @torch.no_grad()
    def update_stats(self, x: torch.Tensor):
        """Add one batch to the histograms; returns the batch's own ``(min, max)`` (finite values, float32)."""
        x = x.detach().as_subclass(torch.Tensor)
        lo, hi = self._hist.add(_encoding_rows(x, self.shape, self.block_size))
        return lo.reshape(self.shape), hi.reshape(self.shape)

    def reset_stats(self) -> None:
        self._hist.reset()

    def has_stats(self) -> bool:
        return not self._hist.empty()

    def _check(self, num_steps: int) -> int:
        if int(num_steps) <= 0:
            raise ValueError("The number of quantization bins cannot be less than or equal to 0.")
        if self._hist.empty():
            raise NoStatisticsError("no statistics: call update_stats() with data first")
        return int(num_steps)

    def compute_dynamic_encodings(self, stats, num_steps: int, is_symmetric: bool):
        """Encodings from one batch's ``(min, max)`` alone (as MinMax would give; no histogram is built)."""
        mn, mx = stats
        return adjust_min_max(mn, mx, num_steps, is_symmetric)


class PercentileEncodingAnalyzer(_HistogramAnalyzer):
    """Percentile calibration on AIMET's histograms (``num_bins`` per encoding element).

    With ``total`` values counted, the max is ``edge[i]`` for the first bin ``i`` whose cumulative count
    reaches ``total * p / 100`` (float32, computed as ``(total * p) / 100``), the min likewise for
    ``total * (1 - p / 100)``; both are left bin edges. ``p == 100`` gives ``edge[0]`` and ``edge[N]``. The
    result then gets AIMET's adjustment: zero included, minimum scale, symmetric grid (no 2-bit special case).
    """

    def __init__(
        self,
        shape: Sequence[int] = (),
        block_size: Optional[Sequence[int]] = None,
        num_bins: int = 2048,
        percentile: float = 100,
    ):
        super().__init__(shape, block_size, num_bins)
        self.set_percentile(percentile)

    def set_percentile(self, percentile: float) -> None:
        if not 50 <= percentile <= 100:
            raise ValueError("Percentile value must be within 50-100 range")
        self.percentile = percentile

    @torch.no_grad()
    def compute_encodings(self, num_steps: int, is_symmetric: bool):
        n = self._check(num_steps)
        h = self._hist
        lo_e, step, right = h.first_edges() if h.raw is not None else (*_edges(h.lo, h.hi, h.num_bins), None)
        if self.percentile == 100:
            mn, mx = lo_e, (right if right is not None else _edge(torch.full_like(lo_e, h.num_bins), lo_e, step))
        else:
            i_lo, i_hi = h.percentile_bins(self.percentile)
            mn, mx = _edge(i_lo, lo_e, step), _edge(i_hi, lo_e, step)
        mn, mx = _aimet_adjust_min_max(mn, mx, n, is_symmetric)
        return mn.reshape(self.shape), mx.reshape(self.shape)


class SqnrEncodingAnalyzer(_HistogramAnalyzer):
    """SQNR calibration (AIMET's "TF-enhanced" search) on per-encoding histograms of ``num_bins`` bins.

    Every value in a bin is taken to sit at the bin's midpoint ``(edge0 + d / 2) + d * i`` with
    ``d = edge[1] - edge[0]``. For each candidate ``(scale, offset)`` the noise is
    ``sum_i count_i * (qdq(mid_i) - mid_i) ** 2``, times ``gamma`` where ``mid_i`` is clipped; the candidate with
    the least noise wins (first one on ties) and ``min = offset * scale``, ``max = min + num_steps * scale``.

    Candidates, with ``min``/``max`` the running range widened to contain 0 and ``max >= min + s0 * n``
    (``s0`` the minimum scale):

    * asymmetric: ``scale = (max - min) / n * i / (A - 1)``, ``i = 1..A``; offsets
      ``round(arange(-n, s, s))`` with ``s = n / (min(n + 2, O) - 2)`` plus the observed ``round(min / scale0)``;
      each pair's range is clamped to the observed (grid-aligned) range and turned back into (scale, offset);
    * symmetric: ``scale = max(2 * max(|min|, max) / n * i / (S - 1), s0)``, ``i = 1..S``, offset ``(-n) // 2``.

    The search runs for all encodings at once, in chunks that bound the temporaries, and first drops the
    candidates that provably lose (see ``_search``): same pick, ~8x less work on int4 weight blocks. Dense
    histograms sum the noise over the N bins in the same order as AIMET (bit-exact results); encodings stored
    sparsely (few values per batch) sum over their entries instead. That changes the noise only in its last bits, which can only
    change the pick among candidates whose noise agrees to rounding, and such candidates are near-identical
    encodings (seen in random tests: a 1-ulp difference in min/max at 2 bits; AIMET's reference cases agree).
    """

    def __init__(
        self,
        shape: Sequence[int] = (),
        block_size: Optional[Sequence[int]] = None,
        num_bins: int = 2048,
        asymmetric_delta_candidates: int = 17,
        symmetric_delta_candidates: int = 101,
        offset_candidates: int = 21,
        gamma: float = 3.0,
    ):
        super().__init__(shape, block_size, num_bins)
        self.asym_delta_candidates = int(asymmetric_delta_candidates)
        self.sym_delta_candidates = int(symmetric_delta_candidates)
        self.num_offset_candidates = int(offset_candidates)
        self.gamma = float(gamma)

    # -- candidates ------------------------------------------------------------------------------------------
    def _candidates(self, lo: torch.Tensor, hi: torch.Tensor, n: int, symmetric: bool):
        """``(deltas, offsets)`` broadcastable to ``(E, D, O)``."""
        ms = _min_scale(n)
        f32 = dict(device=lo.device, dtype=torch.float32)
        mn = torch.minimum(lo, torch.zeros_like(lo))
        mx = torch.maximum(hi, torch.zeros_like(hi))
        mx = torch.maximum(mx, mn + ms * n)
        if symmetric:
            cands = _SymmetricCandidates(2 * torch.maximum(mx, -mn) / n, self.sym_delta_candidates, n)
            return cands.deltas(slice(None), torch.arange(cands.num, device=lo.device)[None, :])[:, :, None], \
                torch.full((1, 1, 1), cands.offset, **f32)
        max_delta = (mx - mn) / n
        obs_offset = torch.round(mn / max_delta)
        obs_min = max_delta * obs_offset
        obs_max = obs_min + max_delta * n
        k = self.asym_delta_candidates
        deltas = max_delta[:, None] * torch.arange(1, k + 1, **f32)[None, :] / (k - 1)
        num_offsets = min(n + 2, self.num_offset_candidates)
        s = n / (num_offsets - 2)
        offsets = torch.round(torch.arange(-n, s, s, **f32))
        offsets = torch.cat([offsets[None, :].expand(lo.shape[0], -1), obs_offset[:, None]], dim=1)
        # clamp each candidate range to the observed one and recompute (delta, offset)
        t_min = deltas[:, :, None] * offsets[:, None, :]
        t_max = t_min + deltas[:, :, None] * n
        t_min = torch.maximum(obs_min[:, None, None], t_min)
        t_max = torch.minimum(obs_max[:, None, None], t_max)
        deltas = torch.maximum((t_max - t_min) / n, torch.tensor(ms, **f32))
        return deltas, torch.round(t_min / deltas)

    @staticmethod
    def _noise(mid, counts, deltas, offsets, n: int, gamma: float) -> torch.Tensor:
        """Expected (gamma-weighted) squared error ``(E, D, O)`` of each candidate over the histogram entries.

        Per entry, in AIMET's float32 order: ``q = round(mid / d - o)``, ``e = ((clamp(q, 0, n) + o) * d - mid)``,
        ``e ** 2 * count``, times ``gamma`` where ``q`` was clipped; summed over the last dim. ``counts=None``
        means one each (multiplying by 1 is exact, so it is skipped).
        """
        d = deltas[..., None]
        o = offsets if isinstance(offsets, float) else offsets[..., None]  # a float: one offset for all
        m = mid[:, None, None, :]
        q = m.div(d).sub_(o).round_()
        qc = q.clamp(0, n)
        weight = None
        if gamma != 1.0:
            # weight 1 or gamma exactly, from float math only (bool masks and where() are slow on CPU):
            # |q - clamp(q)| is 0, or >= 1 where clipped (both integers), so ``hit`` is exactly 0 or 1
            hit = q.sub_(qc).abs_().clamp_(max=1)
            if _exact_shift(gamma):
                weight = hit.mul_(gamma - 1).add_(1)  # 1 or (gamma - 1) + 1 == gamma exactly in float32
            else:
                weight = hit.mul(gamma).add_(hit.neg_().add_(1))  # hit * gamma + (1 - hit)
        del q
        err = qc.add_(o).mul_(d).sub_(m).pow_(2)
        if counts is not None:
            err.mul_(counts[:, None, None, :])
        if weight is not None:
            err.mul_(weight)
        return err.sum(dim=-1)

    @torch.no_grad()
    def compute_encodings(self, num_steps: int, is_symmetric: bool):
        n = self._check(num_steps)
        mid, counts, cands = self._search_inputs(n, is_symmetric)
        delta, offset = self._search(mid, counts, cands, n, is_symmetric, prune=True)
        mn = offset * delta
        mx = mn + n * delta
        return mn.reshape(self.shape), mx.reshape(self.shape)

    def _search_inputs(self, n: int, is_symmetric: bool):
        """Bin midpoints ``mid`` ``(E, W)``, their ``counts`` (None: one each) and the candidates (flat, in
        AIMET's delta-major order), made a chunk of rows at a time when they are needed."""
        h = self._hist
        bins, counts = h.entries(as_float=True)
        lo_e, step = _edges(h.lo, h.hi, h.num_bins)
        d = (step + lo_e) - lo_e  # edge[1] - edge[0]
        first = lo_e + d / 2
        if bins is None:
            mid = d[:, None] * torch.arange(h.num_bins, device=d.device, dtype=torch.float32)[None, :]
        else:  # a fresh tensor either way (raw bins are made here, stored bins are int64 and get copied)
            mid = bins.to(torch.float32).mul_(d[:, None])
        mid.add_(first[:, None])  # first + d * idx, in place
        if is_symmetric:
            ms = _min_scale(n)
            mn = torch.minimum(h.lo, torch.zeros_like(h.lo))
            mx = torch.maximum(torch.maximum(h.hi, torch.zeros_like(h.hi)), mn + ms * n)
            return mid, counts, _SymmetricCandidates(2 * torch.maximum(mx, -mn) / n, self.sym_delta_candidates, n)
        return mid, counts, _AsymmetricCandidates(self, h.lo, h.hi, n)

    def _search(self, mid, counts, cands, n: int, is_symmetric: bool, prune: bool):
        """The candidate with the least noise per encoding (the first on ties) as ``(delta, offset)``.

        ``prune=False`` evaluates every candidate. ``prune=True`` first rules out candidates that provably lose:
        a candidate's noise is at least the gamma-weighted error of the largest (or smallest) value alone when
        that value is clipped, so wherever that bound exceeds the noise of a reference candidate (the min-max
        grid), the candidate cannot be the minimum. Only the others are evaluated, each exactly as in the full
        search (same float32 operations on the same values), so the pick is the same, ties included: a pruned
        candidate's noise is strictly above the minimum. For int4 weight blocks this leaves about an eighth of
        the candidates, for 8-bit channels about a twentieth (the ones that clip the extremes by less than about
        a step). Grids wider than 12 bits are not pruned (see :class:`_ClipBound`).

        "Same float32 operations" holds on CPU, where a row's sum over its (at most 2048) entries does not depend
        on the other rows of the chunk. On CUDA the reduction strategy may depend on the chunk's shape, so the
        last bits of a noise, and with them a near-tie, could differ from an unchunked search (not checked: no
        GPU was available).
        """
        num_enc, num_cand = mid.shape[0], cands.num
        dev = mid.device
        if not prune or num_cand <= 4 or n > _PRUNE_MAX_STEPS:
            return self._evaluate(mid, counts, cands, n, start=torch.zeros(num_enc, dtype=torch.int64, device=dev))
        ref = torch.tensor(self._reference_candidates(num_cand, is_symmetric), device=dev)
        rd, ro = cands.columns(slice(None), ref[None, :].expand(num_enc, -1))
        upper = self._noise(mid, counts, rd[:, :, None], ro[:, :, None], n, self.gamma)[:, :, 0].amin(dim=1)
        upper = upper.to(torch.float64)
        ends = _ClipBound(mid, counts, n, self.gamma)
        if is_symmetric:
            # deltas grow with the index, so the bound shrinks: the survivors are a suffix
            start = ends.first_symmetric_survivor(cands, upper).clamp_(max=num_cand - 2)  # the reference survives
            return self._evaluate(mid, counts, cands, n, start=start)
        # asymmetric: survivors anywhere in the table; bounded temporaries, a chunk of rows at a time
        best_d = torch.empty(num_enc, dtype=torch.float32, device=dev)
        best_o = torch.empty_like(best_d)
        step = max(1, _CHUNK_ELEMENTS // num_cand)
        for r0 in range(0, num_enc, step):
            rows = slice(r0, min(num_enc, r0 + step))
            d_all, o_all = cands.table(rows)
            keep = ~ends.exceeds(d_all, o_all, upper[rows, None], rows)
            keep[:, ref] = True
            keep[:, -1] = True  # it pads the rows below
            # survivors first, in their (AIMET) order; the padding repeats the last candidate, which survives
            num_keep = keep.sum(dim=1)
            width = int(num_keep.max())
            pos = torch.where(keep, keep.cumsum(dim=1) - 1, width)
            cols = torch.full((keep.shape[0], width + 1), num_cand - 1, dtype=torch.int64, device=dev)
            cols.scatter_(1, pos, torch.arange(num_cand, device=dev).expand(keep.shape[0], -1))
            cols = cols[:, :width]
            kept = _TableCandidates(d_all.gather(1, cols), o_all.gather(1, cols))
            del d_all, o_all, keep, pos
            best_d[rows], best_o[rows] = self._evaluate(mid[rows], None if counts is None else counts[rows], kept, n,
                                                        widths=num_keep)
        return best_d, best_o

    def _evaluate(self, mid, counts, cands, n: int, start=None, widths=None):
        """Exact noise of the candidates ``start[e]:`` (or ``:widths[e]``) of every encoding ``e``; returns the
        first least-noise ``(delta, offset)``. Encodings with similar widths share a chunk, so a chunk evaluates
        about the candidates it needs."""
        num_enc, num_cand = mid.shape[0], cands.num
        width = mid.shape[1]
        dev = mid.device
        right_aligned = widths is None
        need = (num_cand - start) if right_aligned else widths.clamp(min=1)
        order = torch.argsort(need, descending=True, stable=True)
        sizes = need[order].tolist()  # one host read per search (it sizes the chunks)
        # rows in that order once, so every chunk below is a view
        mid = mid[order]
        counts = None if counts is None else counts[order]
        start = None if start is None else start[order]
        best_d = torch.empty(num_enc, dtype=torch.float32, device=dev)
        best_o = torch.empty_like(best_d)
        i = 0
        while i < num_enc:
            cw = max(1, sizes[i])  # the widest row of the chunk comes first
            j = min(num_enc, i + max(1, _CHUNK_ELEMENTS // (cw * width)))
            cols = torch.arange(num_cand - cw if right_aligned else 0, num_cand if right_aligned else cw, device=dev)
            dl, ol = cands.columns(order[i:j], cols[None, :].expand(j - i, -1))
            o_arg = cands.offset if isinstance(cands, _SymmetricCandidates) else ol[:, :, None]
            noise = self._noise(mid[i:j], None if counts is None else counts[i:j], dl[:, :, None], o_arg,
                                n, self.gamma)[:, :, 0]
            if right_aligned and sizes[j - 1] < cw:  # columns before a row's own start were pruned: never pick them
                first = (start[i:j] - (num_cand - cw))[:, None]
                noise = torch.where(torch.arange(cw, device=dev)[None, :] < first, float("inf"), noise)
            arg = torch.min(noise, dim=1).indices[:, None]
            best_d[i:j] = dl.gather(1, arg)[:, 0]
            best_o[i:j] = ol.gather(1, arg)[:, 0]
            i = j
        out_d, out_o = torch.empty_like(best_d), torch.empty_like(best_o)
        out_d[order], out_o[order] = best_d, best_o
        return out_d, out_o

    def _reference_candidates(self, num_cand: int, is_symmetric: bool):
        """Flat index of the candidate whose noise bounds the minimum: the min-max grid. (A tighter reference
        barely helps: most survivors are the candidates wider than the winner, which clip nothing.)"""
        if is_symmetric:
            return [num_cand - 2]
        per_delta = num_cand // self.asym_delta_candidates
        # delta index A - 2 is the observed range's delta; the last offset column is the observed offset
        return [(self.asym_delta_candidates - 2) * per_delta + per_delta - 1]


class _SymmetricCandidates:
    """AIMET's symmetric SQNR candidates, computed when needed instead of held as an ``(E, K)`` table: delta
    ``k`` (0-based) of encoding ``e`` is ``max(max_delta[e] * (k + 1) / (K - 1), min_scale)``, the same float32
    operations as building the whole table; the offset is ``(-n) // 2`` for all."""

    def __init__(self, max_delta: torch.Tensor, num: int, n: int):
        self.max_delta, self.num = max_delta, int(num)
        self.offset = float((-n) // 2)
        self.min_scale = torch.tensor(_min_scale(n), dtype=torch.float32, device=max_delta.device)

    def deltas(self, rows, cols: torch.Tensor) -> torch.Tensor:
        k = (cols + 1).to(torch.float32)
        return torch.maximum(self.max_delta[rows][:, None] * k / (self.num - 1), self.min_scale)

    def columns(self, rows, cols: torch.Tensor):
        d = self.deltas(rows, cols)
        return d, torch.full_like(d, self.offset)


class _AsymmetricCandidates:
    """AIMET's asymmetric SQNR candidates (``(delta, offset)`` pairs, each clamped to the observed range), made
    for the rows asked for: the whole ``(E, P)`` table of a large weight would be ~50x the weight's size."""

    def __init__(self, analyzer: "SqnrEncodingAnalyzer", lo: torch.Tensor, hi: torch.Tensor, n: int):
        self.analyzer, self.lo, self.hi, self.n = analyzer, lo, hi, n
        self.num = self.table(slice(0, 1))[0].shape[1]

    def table(self, rows):
        """``(R, P)`` deltas and offsets of ``rows`` (a slice or an index tensor)."""
        lo, hi = self.lo[rows], self.hi[rows]
        deltas, offsets = self.analyzer._candidates(lo, hi, self.n, False)
        shape = torch.broadcast_shapes(deltas.shape, offsets.shape)
        num = lo.shape[0]
        return deltas.expand(num, *shape[1:]).reshape(num, -1), offsets.expand(num, *shape[1:]).reshape(num, -1)

    def columns(self, rows, cols: torch.Tensor):
        if isinstance(rows, slice) and rows == slice(None):  # every row: build the table in pieces
            num = self.lo.shape[0]
            step = max(1, _CHUNK_ELEMENTS // self.num)
            parts = [self.columns(torch.arange(r, min(num, r + step), device=self.lo.device), cols[r:r + step])
                     for r in range(0, num, step)]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        d, o = self.table(rows)
        return d.gather(1, cols), o.gather(1, cols)


class _TableCandidates:
    """Candidates held as ``(E, P)`` tables of deltas and offsets."""

    def __init__(self, deltas: torch.Tensor, offsets: torch.Tensor):
        self.d, self.o, self.num = deltas, offsets, deltas.shape[1]

    def columns(self, rows, cols: torch.Tensor):
        d, o = self.d[rows], self.o[rows]
        return d.gather(1, cols), o.gather(1, cols)


class _ClipBound:
    """A lower bound on a candidate's SQNR noise: the gamma-weighted squared error of the largest (smallest)
    histogram value alone, where the candidate's grid clips it (float64, with a 1e-3 margin for the float32
    rounding of the noise). The closed form of :meth:`first_symmetric_survivor` takes the grid's end as exact;
    its float32 rounding stays within the margin up to 4095 steps (12 bits), so wider grids are not pruned."""

    def __init__(self, mid: torch.Tensor, counts: Optional[torch.Tensor], n: int, gamma: float):
        f64 = torch.float64
        if counts is None:  # every entry is a value
            top_i, bot_i = mid.argmax(dim=1, keepdim=True), mid.argmin(dim=1, keepdim=True)
        else:
            present = counts > 0
            top_i = torch.where(present, mid, float("-inf")).argmax(dim=1, keepdim=True)
            bot_i = torch.where(present, mid, float("inf")).argmin(dim=1, keepdim=True)
        self.top, self.bot = mid.gather(1, top_i).to(f64)[:, 0], mid.gather(1, bot_i).to(f64)[:, 0]
        if counts is None:
            self.c_top = self.c_bot = torch.ones_like(self.top)
        else:
            self.c_top = counts.gather(1, top_i).to(f64)[:, 0]
            self.c_bot = counts.gather(1, bot_i).to(f64)[:, 0]
        self.n, self.gamma = n, gamma

    def first_symmetric_survivor(self, cands: "_SymmetricCandidates", upper: torch.Tensor) -> torch.Tensor:
        """Per encoding, how many of the leading symmetric candidates :meth:`exceeds` ``upper`` (they are a
        prefix: the deltas grow with the index). Solved for the delta in closed form, then shrunk by 1e-6 so
        float rounding can only keep a candidate, never drop one the bound does not rule out."""
        f64 = torch.float64
        o, n, k = cands.offset, self.n, cands.num
        jmax, jmin = o + n, o  # the grid's ends in steps (jmin < 0 <= jmax)
        scale = self.gamma * (1 - 1e-3)
        inf = torch.full_like(self.top, float("inf"))
        # top value: clipped iff top > (jmax + 0.5)(1 + 1e-5) d; its bound exceeds iff top - jmax d > r
        r_hi = torch.sqrt(upper / (scale * self.c_top))
        d_hi = self.top / ((jmax + 0.5) * (1 + 1e-5))
        if jmax > 0:
            d_hi = torch.minimum(d_hi, (self.top - r_hi) / jmax)
        else:
            d_hi = torch.where(self.top > r_hi, d_hi, -inf)
        d_hi = torch.where((self.top > 0) & (self.c_top > 0), d_hi, -inf)
        # bottom value: clipped iff bot < (jmin - 0.5)(1 + 1e-5) d; its bound exceeds iff jmin d - bot > r
        r_lo = torch.sqrt(upper / (scale * self.c_bot))
        d_lo = torch.minimum(self.bot / ((jmin - 0.5) * (1 + 1e-5)), (self.bot + r_lo) / jmin)
        d_lo = torch.where((self.bot < 0) & (self.c_bot > 0), d_lo, -inf)
        limit = torch.maximum(d_hi, d_lo).nan_to_num_(nan=float("-inf")) * (1 - 1e-6)
        # candidate i (0-based) has delta max(max_delta * (i + 1) / (K - 1), min_scale): count those below limit
        x = limit * (k - 1) / cands.max_delta.to(f64)
        count = (torch.ceil(x) - 1).clamp_(0, k).nan_to_num_(0.0)
        count = torch.where(limit > float(cands.min_scale) * (1 + 1e-6), count, torch.zeros_like(count))
        return count.to(torch.int64)

    def exceeds(self, deltas: torch.Tensor, offsets: torch.Tensor, upper: torch.Tensor, rows=slice(None)):
        """Whether the bound of each candidate ``(deltas, offsets)`` of encodings ``rows`` is above ``upper``
        (shapes broadcast with ``(E,)`` or ``(E, P)``): such a candidate cannot have the least noise."""
        extra = deltas.dim() - self.top.dim()
        top, bot, c_top, c_bot = (t[rows].reshape(t[rows].shape + (1,) * extra)
                                  for t in (self.top, self.bot, self.c_top, self.c_bot))
        # the grid's ends exactly as the noise computes them, (q + o) * d in float32
        end_hi = (offsets + self.n).mul_(deltas).to(torch.float64)
        end_lo = (offsets * deltas).to(torch.float64)
        d, o = deltas.to(torch.float64), offsets.to(torch.float64)
        thr_hi = (o + self.n + 0.5) * d  # values beyond half a step past the grid's ends are clipped
        thr_lo = (o - 0.5) * d
        err_hi = torch.where(top > thr_hi + 1e-5 * thr_hi.abs(), top - end_hi, 0.0)
        err_lo = torch.where(bot < thr_lo - 1e-5 * thr_lo.abs(), end_lo - bot, 0.0)
        bound = self.gamma * torch.maximum(c_top * err_hi * err_hi, c_bot * err_lo * err_lo)
        return bound * (1 - 1e-3) > upper


@functools.lru_cache(maxsize=None)  # asked once per noise evaluation, i.e. per chunk
def _exact_shift(gamma: float) -> bool:
    """Whether ``(gamma - 1) + 1`` gives ``gamma`` exactly in torch's float32 tensor arithmetic."""
    one = torch.ones(1)
    return bool(torch.equal(one.mul(gamma - 1).add_(1), torch.full((1,), gamma)))


class _GrowthLimitedHistograms(_Histograms):
    """Histograms whose range may grow past the first batch's ``[lo, hi]`` by at most ``growth * (hi - lo)`` on
    each side (a degenerate first range counts as ``[lo - 0.5, hi + 0.5]``); later values beyond that land in
    the end bins, and the capped range is also what the SQNR search sees as the observed min/max."""

    growth = 1.5

    def on_first(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        degenerate = lo == hi
        lo_e = torch.where(degenerate, lo - 0.5, lo)
        hi_e = torch.where(degenerate, hi + 0.5, hi)
        width = hi_e - lo_e
        self.limit_lo = lo_e - self.growth * width
        self.limit_hi = hi_e + self.growth * width


class TfEnhancedEncodingAnalyzer(SqnrEncodingAnalyzer):
    """AIMET's v1-style TF-enhanced scheme: the SQNR search of :class:`SqnrEncodingAnalyzer` on 512-bin
    histograms whose range may grow at most 1.5x the first batch's range on each side.

    AIMET's reference outputs (``analyzers_seed0``) match this bit for bit, but none of them reaches the limit,
    so its exact form is inferred: ``[lo - 1.5 R, hi + 1.5 R]`` with the first batch's ``R = hi - lo``; the
    capped range is also the observed range of the search and values beyond it count in the end bins. A window
    of ``3 R`` centred on the first batch (the wording of AIMET's change) is ruled out by those outputs: in
    ``gauss_outlier`` the second batch reaches 14.0, beyond such a window (12.3), and AIMET's encodings still
    cover it exactly as an uncapped histogram does.
    """

    def __init__(self, shape: Sequence[int] = (), block_size: Optional[Sequence[int]] = None):
        super().__init__(shape, block_size, num_bins=512)

    def _make_histograms(self, num_bins: int) -> _Histograms:
        return _GrowthLimitedHistograms(num_bins)


class MseEncodingAnalyzer(EncodingAnalyzer):
    """Weight calibration by direct search for the least squared quantization error (no histogram).

    Candidate grid, the same for every encoding element: the running ``[min, max]`` scaled by
    ``alpha_i = 1 - (1 - min_ratio) * i / (num_candidates - 1)``, ``i = 0..num_candidates - 1`` (defaults:
    ``alpha = 1.00, 0.99, ..., 0.20``), i.e. ``(alpha * min, alpha * max)`` (for symmetric encodings this
    shrinks the absmax). Each candidate goes through :func:`~qtool.quant.affine.adjust_min_max` and
    :func:`~qtool.quant.affine.min_max_to_scale_offset` on the grid a quantizer would use (signed when
    symmetric), the tensor is quantize-dequantized with :func:`~qtool.quant.affine.quantize_dequantize`, and each
    encoding keeps the candidate with the least ``sum((qdq(x) - x) ** 2)`` over its values (the first, i.e. the
    widest, on ties). ``alpha = 1`` is exactly the min-max encoding, so the result is never worse than min-max.

    All encodings (channels, blocks) are searched at once; candidates go in chunks that bound the temporaries.
    A row skips a chunk when no candidate in it can win: a candidate's error is at least the squared error of
    the row's largest (smallest) value where the candidate's grid clips it, and where that bound exceeds the
    min-max candidate's error for every candidate of the chunk, none of them is the minimum. The rows that are
    evaluated are evaluated exactly as in a full search, so the result is the same (``prune = False`` runs the
    full search). Rows of 32768 values or more are not pruned: torch sums a single row that long in parallel
    pieces, so its error would not be bit-identical to the same row summed in a batch. The values themselves are kept (batches are concatenated), so this is meant for weights, not
    activations.
    """

    prune = True

    def __init__(
        self,
        shape: Sequence[int] = (),
        block_size: Optional[Sequence[int]] = None,
        num_candidates: int = 81,
        min_ratio: float = 0.2,
    ):
        super().__init__(shape, block_size)
        if int(num_candidates) < 1:
            raise ValueError(f"num_candidates must be at least 1, got {num_candidates}")
        if not 0 < min_ratio <= 1:
            raise ValueError(f"min_ratio must be in (0, 1], got {min_ratio}")
        self.num_candidates = int(num_candidates)
        self.min_ratio = float(min_ratio)
        self._rows: Optional[torch.Tensor] = None
        self.min: Optional[torch.Tensor] = None
        self.max: Optional[torch.Tensor] = None

    @torch.no_grad()
    def update_stats(self, x: torch.Tensor):
        x = x.detach().as_subclass(torch.Tensor)
        rows = _encoding_rows(x, self.shape, self.block_size).to(torch.float32)
        mn, mx = torch.aminmax(rows, dim=1)
        if self._rows is None:
            self._rows, self.min, self.max = rows.clone(), mn, mx
        else:
            rows, mn, mx = rows.to(self._rows.device), mn.to(self._rows.device), mx.to(self._rows.device)
            self._rows = torch.cat([self._rows, rows], dim=1)
            self.min, self.max = torch.minimum(self.min, mn), torch.maximum(self.max, mx)
        return mn.reshape(self.shape), mx.reshape(self.shape)

    def reset_stats(self) -> None:
        self._rows = self.min = self.max = None

    def has_stats(self) -> bool:
        return self._rows is not None

    def candidate_ratios(self, device=None) -> torch.Tensor:
        """The shrink factors ``alpha`` searched (float32, widest first)."""
        k = self.num_candidates
        if k == 1:
            return torch.ones(1, device=device)
        i = torch.arange(k, device=device, dtype=torch.float32)
        return 1 - (1 - self.min_ratio) * i / (k - 1)

    @torch.no_grad()
    def compute_encodings(self, num_steps: int, is_symmetric: bool):
        if int(num_steps) <= 0:
            raise ValueError("The number of quantization bins cannot be less than or equal to 0.")
        if self._rows is None:
            raise NoStatisticsError("no statistics: call update_stats() with data first")
        n = int(num_steps)
        qmin, qmax = resolve_grid(num_steps=n, signed=is_symmetric)
        rows = self._rows
        num_enc, width = rows.shape
        alphas = self.candidate_ratios(rows.device)[:, None]
        best_err = best_mn = best_mx = upper = None
        # a candidate's error is at least that of the largest (smallest) value alone where its grid clips that
        # value; rows whose bound exceeds the min-max candidate's error for a whole chunk skip it (see above)
        slack = 1 - 1e-3 - 4 * width * 2.0**-24  # float32 rounding of the error sums, with room to spare
        table = None
        if alphas.shape[0] * num_enc <= (1 << 22):  # every candidate's grid at once (small tensors: fewer steps)
            table = self._grids(alphas, n, qmin, qmax, is_symmetric)

        def grids(lo: int, hi: int):
            if table is not None:
                return tuple(t[lo:hi] for t in table)
            return self._grids(alphas[lo:hi], n, qmin, qmax, is_symmetric)

        i = 0
        while i < alphas.shape[0]:
            chunk = max(1, _CHUNK_ELEMENTS // max(1, num_enc * width))
            idx = None
            if upper is not None and self.prune and (width < (1 << 15) or num_enc == 1):
                bound = grids(i, i + 1)[4]
                idx = (bound * slack <= upper).any(dim=0).nonzero()[:, 0]
                if idx.shape[0] == 0:
                    i += 1
                    continue
                # as many candidates as fit for the rows that still need them
                chunk = max(1, _CHUNK_ELEMENTS // max(1, idx.shape[0] * width))
            mn, mx, scale, offset, bound = grids(i, i + chunk)
            num = mn.shape[0]
            if idx is not None:
                if num > 1:
                    idx = (bound * slack <= upper).any(dim=0).nonzero()[:, 0]
                sub = rows.index_select(0, idx)
                mn, mx, scale, offset = (t.index_select(1, idx) for t in (mn, mx, scale, offset))
            else:
                sub = rows
            xs = sub.expand(num, *sub.shape)
            qdq = quantize_dequantize(xs, scale[..., None], offset[..., None], qmin=qmin, qmax=qmax)
            err = qdq.sub_(sub).pow_(2).sum(dim=-1)
            if upper is None:
                upper = err[0].to(torch.float64)  # alpha = 1: the min-max encoding
            err, arg = torch.min(err, dim=0)  # first minimum: the widest candidate of this chunk
            mn, mx = mn.gather(0, arg[None])[0], mx.gather(0, arg[None])[0]
            if best_err is None:
                best_err, best_mn, best_mx = err, mn, mx
            else:
                cur = best_err if idx is None else best_err[idx]
                better = err < cur  # strict: earlier (wider) candidates win ties
                new_err = torch.where(better, err, cur)
                new_mn = torch.where(better, mn, best_mn if idx is None else best_mn[idx])
                new_mx = torch.where(better, mx, best_mx if idx is None else best_mx[idx])
                if idx is None:
                    best_err, best_mn, best_mx = new_err, new_mn, new_mx
                else:
                    best_err[idx], best_mn[idx], best_mx[idx] = new_err, new_mn, new_mx
            i += num
        return best_mn.reshape(self.shape), best_mx.reshape(self.shape)

    def _grids(self, alphas: torch.Tensor, n: int, qmin: int, qmax: int, is_symmetric: bool):
        """``(min, max, scale, offset, bound)`` of candidates ``alphas`` ``(C, 1)``, each ``(C, E)``."""
        mn, mx = adjust_min_max(alphas * self.min, alphas * self.max, n, is_symmetric)
        scale, offset = min_max_to_scale_offset(mn, mx, qmin, qmax, is_symmetric)
        return mn, mx, scale, offset, self._clip_bound(scale, offset, qmin, qmax)

    def _clip_bound(self, scale: torch.Tensor, offset: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
        """``(C, E)`` lower bound on each candidate's squared error: the error of the row's max (min) alone
        where the candidate's grid clips it by more than half a step (with a margin). In float32, with the
        grid's ends computed as quantize-dequantize computes them, ``(q + offset) * scale``: the bound is then
        that value's own float32 error term, and the search's ``slack`` covers the rounding of the sum."""
        s, o = scale.to(torch.float32), offset.to(torch.float32)
        hi, lo = self.max.to(torch.float32), self.min.to(torch.float32)
        top, bot = (o + qmax).mul_(s), (o + qmin).mul_(s)
        # clipped: beyond the grid's end by more than half a step (plus 1e-5 of the end, for rounding)
        err_hi = hi - top
        err_lo = bot - lo
        half = s * 0.5
        err_hi = torch.where(err_hi > half + 1e-5 * (top.abs() + half), err_hi, 0.0)
        err_lo = torch.where(err_lo > half + 1e-5 * (bot.abs() + half), err_lo, 0.0)
        return torch.maximum(err_hi.mul_(err_hi), err_lo.mul_(err_lo)).to(torch.float64)

    def compute_dynamic_encodings(self, stats, num_steps: int, is_symmetric: bool):
        """Encodings from one batch's ``(min, max)`` alone (min-max; the search needs the values)."""
        mn, mx = stats
        return adjust_min_max(mn, mx, num_steps, is_symmetric)
