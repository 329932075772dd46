"""Min-max analyzer: running elementwise min and max, and its statistics value :class:`MinMaxStatistics`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..affine import adjust_min_max, reduce_to_shape
from .base import EncodingAnalyzer, NoStatisticsError, _check_same_type


@dataclass(frozen=True, eq=False)
class MinMaxStatistics:
    """Elementwise ``min`` and ``max`` (float32 tensors of the encoding shape) of the values seen.

    A sufficient statistic: the min-max encoding depends on nothing else, and ``min``/``max`` are exact
    operations, so nothing is lost when batches are split up, reordered or regrouped.
    """

    min: torch.Tensor
    max: torch.Tensor

    @staticmethod
    def merge(a: "MinMaxStatistics", b: "MinMaxStatistics") -> "MinMaxStatistics":
        """Elementwise ``torch.minimum`` / ``torch.maximum`` (on ``a``'s device); a new value, inputs untouched.

        Exact, commutative and associative: folding the merge of any split of the data, merged in any order and
        grouping, equals one analyzer fed all of it (``torch.equal``). NaN propagates, as in ``update_stats``.
        The one thing order may decide is which zero a tie of ``0.0`` and ``-0.0`` keeps (equal values; the same
        holds inside one batch's reduction).
        """
        _check_same_type(a, b, MinMaxStatistics)
        if a.min.shape != b.min.shape:
            raise ValueError(f"MinMaxStatistics.merge(): shapes differ: {tuple(a.min.shape)} and {tuple(b.min.shape)}")
        return MinMaxStatistics(torch.minimum(a.min, b.min.to(a.min.device)),
                                torch.maximum(a.max, b.max.to(a.max.device)))


class MinMaxEncodingAnalyzer(EncodingAnalyzer):
    """Running elementwise min and max over all batches, reduced to the encoding shape (blocks included)."""

    def __init__(self, shape: Sequence[int] = (), block_size: Optional[Sequence[int]] = None):
        super().__init__(shape, block_size)
        self.min: Optional[torch.Tensor] = None
        self.max: Optional[torch.Tensor] = None

    @torch.no_grad()
    def update_stats(self, x: torch.Tensor):
        """Fold one batch in (``fold(collect(x))``); returns the batch's own ``(min, max)`` (float32)."""
        stats = self.collect(x)
        self.fold(stats)
        return self.batch_range(stats)

    @staticmethod
    def batch_range(stats: MinMaxStatistics):
        """A batch's ``(min, max)`` from its :meth:`collect` value (what ``update_stats`` returns for it)."""
        return stats.min, stats.max

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> MinMaxStatistics:
        """This batch's elementwise min and max, reduced to the encoding shape (float32, on ``x``'s device)."""
        x = x.detach().as_subclass(torch.Tensor)
        mn, mx = reduce_to_shape(x, self.shape, self.block_size)
        return MinMaxStatistics(mn.to(torch.float32), mx.to(torch.float32))

    @torch.no_grad()
    def fold(self, stats: MinMaxStatistics) -> None:
        """Running elementwise min/max with ``stats`` (the first value is copied; the state lives on its device)."""
        if not isinstance(stats, MinMaxStatistics):
            raise TypeError(f"{type(self).__name__}.fold() takes MinMaxStatistics, got {type(stats).__name__}")
        mn, mx = stats.min, stats.max
        if tuple(mn.shape) != self.shape or tuple(mx.shape) != self.shape:
            raise ValueError(f"statistics of shape {tuple(mn.shape)} do not fit encoding shape {self.shape}")
        if self.min is None:
            self.min, self.max = mn.clone(), mx.clone()
        else:
            torch.minimum(self.min, mn.to(self.min.device), out=self.min)
            torch.maximum(self.max, mx.to(self.max.device), out=self.max)

    def statistics(self) -> Optional[MinMaxStatistics]:
        """The running min/max as a value (copies: later folds update the state in place), or None."""
        if self.min is None:
            return None
        return MinMaxStatistics(self.min.clone(), self.max.clone())

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
