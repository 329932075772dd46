"""MSE analyzer: a direct clipping search over a weight's own values, and its statistics :class:`MseStatistics`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...choices import WEIGHTINGS, weighs_activations
from ..affine import adjust_min_max, min_max_to_scale_offset, quantize_dequantize, resolve_grid, true_div
from .base import _CHUNK_ELEMENTS, EncodingAnalyzer, NoStatisticsError, StatisticsMergeError, _encoding_rows


def magnitude_weights(rows: torch.Tensor) -> torch.Tensor:
    """``rms + |x|`` for each value of ``rows`` ``(E, M)`` (float32), ``rms`` its row's root mean square: the
    data-free weighting of the MSE search (``weighting="magnitude"``)."""
    return rows.abs().add_(rows.pow(2).mean(dim=1, keepdim=True).sqrt_())


@dataclass(frozen=True, eq=False)
class MseStatistics:
    """What the MSE search runs on: a weight's values as ``rows`` ``(E, M)`` float32 (one row per encoding
    element, all of its values) and each row's ``min``/``max`` ``(E,)``. From ``collect``, ``rows`` may share
    memory with the weight; from ``statistics()`` it is a copy."""

    rows: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    weights: Optional[torch.Tensor] = None  # (E, M) each value's weight in the error (activations, magnitude)

    @staticmethod
    def merge(a, b):
        """Always raises :class:`StatisticsMergeError`: MSE calibrates a weight from the weight itself, which every
        process already holds whole; merging two processes' copies would count every value twice, which is not
        the single-process result, so there is nothing to merge. Calibrate a weight in one process (or
        identically in each) instead. (Successive ``fold`` calls still append values, as ``update_stats``
        always did.)"""
        raise StatisticsMergeError(
            "MSE statistics are a weight's own values: merging two of them is meaningless (every process holds "
            "the same weight); calibrate the weight in one process instead"
        )


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

    ``weighting="activations"``: each value's squared error is multiplied by an importance given with the weight
    (``update_stats(w, importance=...)``, broadcastable to ``w``; calibration passes each input channel's mean
    ``x²`` over the calibration data, llama.cpp's importance matrix), so the search minimizes an estimate of the
    layer's output error instead of the weight's own. ``weighting="magnitude"`` (no data): each value's squared
    error is multiplied by ``rms + |w|``, ``rms`` the root mean square of its encoding element's values — llama.cpp's
    weighting of its K-quant searches without an importance matrix (``quantize_row_q4_K_ref``'s ``av_x + |x|``,
    there over a 256-value super-block): a large weight, which carries more of a layer's output, is clipped less.
    ``weighting="activations_magnitude"``: the two multiplied. llama.cpp's searches with an importance matrix
    multiply the importance by a magnitude term too (``quant_weights[j] * sqrt(sigma2 + x[j]²)``, ``sigma2`` a mean
    ``x²`` over the super-block or row); this uses the same ``rms + |w|`` term as ``"magnitude"``, so the weighted
    and data-free searches differ only by the importance.
    Weighted searches are not pruned.

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
        weighting: str = "none",
    ):
        super().__init__(shape, block_size)
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(map(repr, WEIGHTINGS))}, got {weighting!r}")
        self.weighting = weighting
        self._weights: Optional[torch.Tensor] = None
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
    def update_stats(self, x: torch.Tensor, importance: Optional[torch.Tensor] = None):
        """Keep this batch's values (``fold(collect(x, importance))``); returns its own ``(min, max)`` (float32, on
        the device the values are kept on)."""
        stats = self.collect(x, importance)
        self.fold(stats)
        dev = self._rows.device
        return stats.min.to(dev).reshape(self.shape), stats.max.to(dev).reshape(self.shape)

    @torch.no_grad()
    def collect(self, x: torch.Tensor, importance: Optional[torch.Tensor] = None) -> MseStatistics:
        """The weight's values as :class:`MseStatistics` (float32 rows and each row's min and max), with their
        importance laid out the same way when the search is weighted."""
        x = x.detach().as_subclass(torch.Tensor)
        rows = _encoding_rows(x, self.shape, self.block_size).to(torch.float32)
        mn, mx = rows.amin(1), rows.amax(1)  # (several times aminmax's speed over short rows)
        weights = None
        if weighs_activations(self.weighting):
            if importance is None:
                raise ValueError(f"analyzer mse with weighting: {self.weighting} needs each value's importance "
                                 "(the layer's input statistics from calibration data)")
            imp = torch.as_tensor(importance).detach().to(x.device, torch.float32).expand(x.shape)
            weights = _encoding_rows(imp.contiguous(), self.shape, self.block_size)
            if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
                raise ValueError("activation importance must be finite and non-negative")
            if self.weighting == "activations_magnitude":
                weights = weights * magnitude_weights(rows)
        elif self.weighting == "magnitude":
            weights = magnitude_weights(rows)
        return MseStatistics(rows, mn, mx, weights)

    @torch.no_grad()
    def fold(self, stats: MseStatistics) -> None:
        """Keep ``stats``' values: the first are copied, later ones are appended to each row (as ``update_stats``
        always did), with the running min and max."""
        if not isinstance(stats, MseStatistics):
            raise TypeError(f"{type(self).__name__}.fold() takes MseStatistics, got {type(stats).__name__}")
        rows, mn, mx, weights = stats.rows, stats.min, stats.max, stats.weights
        if (weights is None) != (self.weighting == "none"):
            raise ValueError("weighted and unweighted MSE statistics cannot be mixed")
        num_enc = math.prod(self.shape)
        if rows.dim() != 2 or rows.shape[0] != num_enc:
            raise ValueError(f"values of shape {tuple(rows.shape)} do not fit {num_enc} encoding rows "
                             f"(encoding shape {self.shape})")
        if self._rows is None:
            self._rows, self.min, self.max = rows.clone(), mn, mx
            self._weights = None if weights is None else weights.clone()
        else:
            rows, mn, mx = rows.to(self._rows.device), mn.to(self._rows.device), mx.to(self._rows.device)
            self._rows = torch.cat([self._rows, rows], dim=1)
            if weights is not None:
                self._weights = torch.cat([self._weights, weights.to(self._rows.device)], dim=1)
            self.min, self.max = torch.minimum(self.min, mn), torch.maximum(self.max, mx)

    def statistics(self) -> Optional[MseStatistics]:
        """The values kept so far and their running min and max (copies), or None. It cannot be merged."""
        kept = self.kept()
        if kept is None:
            return None
        return MseStatistics(*(None if v is None else v.clone() for v in (kept.rows, kept.min, kept.max, kept.weights)))

    def kept(self) -> Optional[MseStatistics]:
        """The values kept so far, as :meth:`statistics` gives them but not copied: for a search that only reads
        them (a weight's rows are as large as the weight)."""
        if self._rows is None:
            return None
        return MseStatistics(self._rows, self.min, self.max, self._weights)

    def reset_stats(self) -> None:
        self._rows = self.min = self.max = self._weights = None

    def has_stats(self) -> bool:
        return self._rows is not None

    def candidate_ratios(self, device=None) -> torch.Tensor:
        """The shrink factors ``alpha`` searched (float32, widest first)."""
        k = self.num_candidates
        if k == 1:
            return torch.ones(1, device=device)
        i = torch.arange(k, device=device, dtype=torch.float32)
        return 1 - true_div((1 - self.min_ratio) * i, k - 1)

    @torch.no_grad()
    def compute_encodings(self, num_steps: int, is_symmetric: bool):
        if int(num_steps) <= 0:
            raise ValueError("The number of quantization bins cannot be less than or equal to 0.")
        if self._rows is None:
            raise NoStatisticsError("no statistics: call update_stats() with data first")
        n = int(num_steps)
        qmin, qmax = resolve_grid(num_steps=n, signed=is_symmetric)
        rows, weights = self._rows, self._weights
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
            if upper is not None and self.prune and weights is None and (width < (1 << 15) or num_enc == 1):
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
            err = qdq.sub_(sub).pow_(2)
            if weights is not None:  # weighted searches are not pruned: every row, every candidate
                err.mul_(weights)
            err = err.sum(dim=-1)
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
