"""Encoding analyzers: they watch calibration data and choose a quantizer's ``(min, max)``.

This module is the public face; the code lives in :mod:`qtool.quant.analysis`, one module per family. Every
analyzer has the same interface::

    analyzer = MinMaxEncodingAnalyzer(shape, block_size=None)
    analyzer.update_stats(x)              # once per batch; returns the batch's own statistics
    mn, mx = analyzer.compute_encodings(num_steps, is_symmetric)
    analyzer.reset_stats()

and statistics as values, for calibration spread over processes::

    stats = analyzer.collect(x)           # this batch's statistics; no state change
    analyzer.fold(stats)                  # update_stats(x) is exactly fold(collect(x))
    analyzer.statistics()                 # the running state as a value, or None
    merge_statistics(a, b)                # exact merge, or StatisticsMergeError where there is none

Analyzers (:data:`ANALYZERS` maps the recipe names to them): :class:`MinMaxEncodingAnalyzer` (running min/max),
:class:`PercentileEncodingAnalyzer`, :class:`SqnrEncodingAnalyzer` and :class:`TfEnhancedEncodingAnalyzer`
(AIMET's histogram analyzers, bit-exact with AIMET's outputs), :class:`MseEncodingAnalyzer` (direct clipping
search for weights). Every encoding element (per-tensor, per-channel, per-block) is handled in the same batched
tensor ops, never one at a time.

Statistics values and their merges: :class:`MinMaxStatistics` (elementwise min/max: exact, commutative,
associative); :class:`HistogramBatches` (an ordered sequence of raw batches: concatenation, exact, associative,
not commutative: fold in global batch order); :class:`HistogramState` (folded histograms: no exact merge,
raises); :class:`MseStatistics` (a weight's values: merging is meaningless, raises).
"""

from __future__ import annotations

from typing import Dict, Type

from .analysis.base import EncodingAnalyzer, NoStatisticsError, StatisticsMergeError, merge_statistics
from .analysis.histogram import HistogramBatch, HistogramBatches, HistogramState, PercentileEncodingAnalyzer
from .analysis.histogram import _scatter_dense  # noqa: F401  (private; tests reach for it)
from .analysis.minmax import MinMaxEncodingAnalyzer, MinMaxStatistics
from .analysis.mse import MseEncodingAnalyzer, MseStatistics
from .analysis.sqnr import SqnrEncodingAnalyzer, TfEnhancedEncodingAnalyzer
from .analysis.sqnr import _ClipBound  # noqa: F401  (private; the SQNR benchmark reaches for it)

ANALYZERS: Dict[str, Type[EncodingAnalyzer]] = {
    "minmax": MinMaxEncodingAnalyzer,
    "percentile": PercentileEncodingAnalyzer,
    "sqnr": SqnrEncodingAnalyzer,
    "tf_enhanced": TfEnhancedEncodingAnalyzer,
    "mse": MseEncodingAnalyzer,
}
"""The analyzers by their recipe name (``analyzer: {name: ...}``)."""

__all__ = [
    "ANALYZERS",
    "EncodingAnalyzer",
    "MinMaxEncodingAnalyzer",
    "PercentileEncodingAnalyzer",
    "SqnrEncodingAnalyzer",
    "TfEnhancedEncodingAnalyzer",
    "MseEncodingAnalyzer",
    "NoStatisticsError",
    "StatisticsMergeError",
    "MinMaxStatistics",
    "HistogramBatch",
    "HistogramBatches",
    "HistogramState",
    "MseStatistics",
    "merge_statistics",
]

