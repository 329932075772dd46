"""Histogram analyzers (AIMET's v2 histogram observer, batched over all encodings): the ``_Histograms``
machinery, the shared ``_HistogramAnalyzer``, :class:`PercentileEncodingAnalyzer`, and the statistics values
:class:`HistogramBatch` / :class:`HistogramBatches` (raw batches, merged exactly by concatenation in order) and
:class:`HistogramState` (a folded histogram, which has no exact merge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch

from ..affine import _min_scale, adjust_min_max, true_div
from ..histogram_bins import _aggregate, _bin_index, _edge, _edges, _first_bin_reaching, _scatter_dense
from .base import EncodingAnalyzer, NoStatisticsError, StatisticsMergeError, _check_same_type, _encoding_rows

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


# ==============================================================================================================
# Statistics values
# ==============================================================================================================
#
# A histogram is not a sufficient statistic of its batches: each new batch's RAW values are binned on the range
# combined so far, and the old bins are re-binned with rounding (see above), so neither two histograms nor a
# histogram and a batch's histogram can be combined into what one observer fed everything would hold. What can
# be combined exactly is the batches themselves, in order: the first batch sets the initial range (and, for
# TF-enhanced, the growth limit), so the result depends on the order in which batches are folded.


@dataclass(frozen=True, eq=False)
class HistogramBatch:
    """One batch as a histogram analyzer folds it.

    ``rows``: ``(E, M)`` float32, one row per encoding element with all of its values (the raw values: folding
    bins them on the range combined up to then, so no per-batch histogram would do); ``lo``/``hi``: ``(E,)``
    per-row min and max of the finite values (0 and 0 for a row without any); ``clean``: True only when every
    value is known to be finite. Made by ``collect``; ``rows`` may share memory with the tensor collected
    (do not change it in place while the value is held). The same batch folds into any histogram analyzer of
    the same encoding shape (percentile, SQNR, TF-enhanced; any ``num_bins``).
    """

    rows: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    clean: bool


@dataclass(frozen=True, eq=False)
class HistogramBatches:
    """Histogram statistics as a value: an ordered sequence of not yet folded batches (``collect`` gives one).

    Folding it folds its batches in sequence order, exactly as ``update_stats`` on each batch in that order.
    """

    batches: Tuple[HistogramBatch, ...]

    @staticmethod
    def merge(a: "HistogramBatches", b: "HistogramBatches") -> "HistogramBatches":
        """Concatenation in order: ``a``'s batches, then ``b``'s.

        Exact: folding ``merge(a, b)`` equals one analyzer folding ``a``'s batches and then ``b``'s, bit for bit,
        into any starting state. Associative (``HistogramBatches(())`` is its identity), NOT commutative:
        AIMET's histograms depend on batch order (the first batch sets the range, and every later one is binned
        on the range combined so far). So a multi-process run must fold in one global batch order, the same on
        every rank: rank 0's batches, then rank 1's, ... (merge the per-rank values in rank order, or let rank 0
        fold its own batches first and then the others' in rank order). Its encodings then equal one process
        fed the batches in that order, which is not the order of a single-process run whose data loader
        interleaved them. The value holds every batch's raw values until they are folded (memory).

        A folded :class:`HistogramState` has no exact merge: it raises :class:`StatisticsMergeError`.
        """
        if isinstance(a, HistogramState) or isinstance(b, HistogramState):
            _folded_merge_error()
        _check_same_type(a, b, HistogramBatches)
        return HistogramBatches(tuple(a.batches) + tuple(b.batches))


@dataclass(frozen=True, eq=False)
class HistogramState:
    """A histogram analyzer's folded running state (what ``statistics()`` gives), copied out of the analyzer.

    ``kind``/``num_bins`` name the histograms it came from; the other fields are their state (see
    ``_Histograms``). It folds exactly only into an analyzer without statistics of the same kind and bin
    count (it restores that state); it cannot be merged.
    """

    kind: str
    num_bins: int
    lo: torch.Tensor
    hi: torch.Tensor
    raw: Optional[torch.Tensor]
    raw_clean: bool
    bins: Optional[torch.Tensor]
    counts: Optional[torch.Tensor]
    limit_lo: Optional[torch.Tensor]
    limit_hi: Optional[torch.Tensor]

    @staticmethod
    def merge(a, b):
        """Always raises :class:`StatisticsMergeError`: combining binned histograms would re-bin one onto the
        other's range, which is not what folding the same batches in one process gives (not exact). Merge the
        :class:`HistogramBatches` from ``collect`` instead, before folding."""
        _folded_merge_error()


def _folded_merge_error():
    raise StatisticsMergeError(
        "folded histogram statistics (HistogramState) cannot be merged exactly: AIMET bins each batch's raw "
        "values on the combined range, so binned counts cannot be combined; merge the HistogramBatches from "
        "collect() before folding, in global batch order"
    )


def _histogram_batch(rows: torch.Tensor) -> HistogramBatch:
    """A batch ``(E, M)`` as float32 rows with each row's finite ``(min, max)``."""
    rows = rows.to(torch.float32)
    lo, hi, clean = _finite_min_max(rows)
    return HistogramBatch(rows, lo, hi, clean)


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
    def fold(self, batch: HistogramBatch) -> None:
        """Fold one batch in (binned on the range combined with what came before)."""
        if self.lo is None:
            self._first(batch.rows, batch.lo, batch.hi, batch.clean)
        else:
            dev = self.lo.device
            self._merge(batch.rows.to(dev), batch.lo.to(dev), batch.hi.to(dev), batch.clean)

    # -- state as a value ------------------------------------------------------------------------------------
    def snapshot(self) -> HistogramState:
        """The state, copied (None fields stay None)."""

        def copy(t):
            return None if t is None else t.clone()

        return HistogramState(type(self).__name__, self.num_bins, copy(self.lo), copy(self.hi), copy(self.raw),
                              self.raw_clean, copy(self.bins), copy(self.counts), copy(self.limit_lo),
                              copy(self.limit_hi))

    def restore(self, state: HistogramState) -> None:
        """Take over ``state`` (copied) as it was when it was snapshot; only into empty histograms of its kind."""
        if not self.empty():
            raise StatisticsMergeError(
                "a folded histogram state folds only into an analyzer without statistics (it restores that "
                "state); folding it into another state is a merge of histograms, which is not exact"
            )
        if state.kind != type(self).__name__ or state.num_bins != self.num_bins:
            raise ValueError(f"histogram state of {state.kind} with {state.num_bins} bins does not fit "
                             f"{type(self).__name__} with {self.num_bins} bins")

        def copy(t):
            return None if t is None else t.clone()

        self.lo, self.hi, self.raw, self.raw_clean = copy(state.lo), copy(state.hi), copy(state.raw), state.raw_clean
        self.bins, self.counts = copy(state.bins), copy(state.counts)
        self.limit_lo, self.limit_hi = copy(state.limit_lo), copy(state.limit_hi)

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
        dst_step = torch.where(changed, true_div(new_hi - new_lo, n), torch.ones_like(new_lo))[:, None]
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
                if t <= 0:
                    out.append(torch.zeros_like(self.lo, dtype=torch.int64))
                    continue
                # (the smallest value is in bin 0 unless the row is constant: its edges are widened by 0.5 each
                # way, and its values sit in the middle bin)
                v = self.lo if k == 0 else self.hi if k == width - 1 else torch.kthvalue(self.raw, k + 1, dim=1).values
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
    tight = true_div(mx - mn, n) < ms
    if symmetric:
        mn = torch.where(tight, mn - ms * math.ceil(n / 2), mn)
        mx = torch.where(tight, mx + ms * math.floor(n / 2), mx)
        pos, neg = n // 2, math.ceil(n / 2)
        delta = torch.maximum(true_div(mx, pos), true_div(-mn, neg))
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
        """Add one batch to the histograms (``fold(collect(x))``); returns the batch's own ``(min, max)`` (finite
        values, float32)."""
        stats = self.collect(x)
        self.fold(stats)
        return self.batch_range(stats)

    def batch_range(self, stats: HistogramBatches):
        """The ``(min, max)`` of the finite values of a one-batch value from :meth:`collect` (what
        ``update_stats`` returns for that batch)."""
        batch = stats.batches[0]
        return batch.lo.reshape(self.shape), batch.hi.reshape(self.shape)

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> HistogramBatches:
        """This batch as a one-batch :class:`HistogramBatches` (its raw values as ``(E, M)`` float32 rows)."""
        x = x.detach().as_subclass(torch.Tensor)
        return HistogramBatches((_histogram_batch(_encoding_rows(x, self.shape, self.block_size)),))

    @torch.no_grad()
    def fold(self, stats: Union[HistogramBatches, HistogramBatch, HistogramState]) -> None:
        """Fold ``stats`` into the histograms.

        * :class:`HistogramBatches` (or one :class:`HistogramBatch`): each batch in sequence order, exactly as
          ``update_stats`` on those batches in that order would (every batch is checked first);
        * :class:`HistogramState` (from ``statistics()``): restores that state, only into an analyzer without
          statistics, of the same histogram kind and bin count (into another state it would be a merge of
          folded histograms, which is not exact: :class:`StatisticsMergeError`).
        """
        if isinstance(stats, HistogramState):
            self._hist.restore(stats)
            return
        if isinstance(stats, HistogramBatch):
            stats = HistogramBatches((stats,))
        if not isinstance(stats, HistogramBatches):
            raise TypeError(f"{type(self).__name__}.fold() takes HistogramBatches, HistogramBatch or HistogramState, "
                            f"got {type(stats).__name__}")
        num_enc = math.prod(self.shape)
        for b in stats.batches:
            if b.rows.dim() != 2 or b.rows.shape[0] != num_enc:
                raise ValueError(f"a batch of shape {tuple(b.rows.shape)} does not fit {num_enc} encoding rows "
                                 f"(encoding shape {self.shape})")
        for b in stats.batches:
            self._hist.fold(b)

    def statistics(self) -> Optional[HistogramState]:
        """The folded histograms as a :class:`HistogramState` (copied), or None. It cannot be merged (see there);
        for a mergeable value keep the :class:`HistogramBatches` from ``collect`` and fold them later."""
        if self._hist.empty():
            return None
        return self._hist.snapshot()

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
