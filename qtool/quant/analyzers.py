"""Encoding analyzers: they watch calibration data and choose a quantizer's ``(min, max)``.

Every analyzer has the same interface::

    analyzer = MinMaxEncodingAnalyzer(shape, block_size=None)
    analyzer.update_stats(x)              # once per batch; returns the batch's own statistics
    mn, mx = analyzer.compute_encodings(num_steps, is_symmetric)
    analyzer.reset_stats()

Statistics are float32 tensors on the device of the data; nothing is copied to the host.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .affine import adjust_min_max, reduce_to_shape

__all__ = ["EncodingAnalyzer", "MinMaxEncodingAnalyzer", "NoStatisticsError"]


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
