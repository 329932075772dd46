"""The analyzers' shared base: the interface, the statistics protocol, and helpers every family uses.

Every analyzer has the same interface::

    analyzer = MinMaxEncodingAnalyzer(shape, block_size=None)
    analyzer.update_stats(x)              # once per batch; returns the batch's own statistics
    mn, mx = analyzer.compute_encodings(num_steps, is_symmetric)
    analyzer.reset_stats()

Statistics are also values, so calibration can be spread over processes and combined (data-parallel
calibration all-reduces them)::

    stats = analyzer.collect(x)           # this batch's statistics; the analyzer does not change
    analyzer.fold(stats)                  # add them to the running state: update_stats(x) is fold(collect(x))
    analyzer.statistics()                 # the running state as a value (None before any data)
    merge_statistics(a, b)                # type(a).merge(a, b): what each merge preserves is on its type

The statistics types and their merges: :class:`~qtool.quant.analysis.minmax.MinMaxStatistics` (elementwise
min/max: exact, commutative, associative), :class:`~qtool.quant.analysis.histogram.HistogramBatches` (an
ordered sequence of raw batches: merge is concatenation, exact, associative, not commutative),
:class:`~qtool.quant.analysis.histogram.HistogramState` (a folded histogram: no exact merge, raises) and
:class:`~qtool.quant.analysis.mse.MseStatistics` (a weight's values: merging two is meaningless, raises).

Statistics are float32 tensors on the device of the data; nothing is copied from a GPU to the host while
statistics are collected (on CPU a few shortcuts read CPU tensors, e.g. whether a batch is all finite). The
searches in ``compute_encodings`` read a few sizes on the host to size their chunks (once per SQNR search, once
per candidate chunk in MSE).

Imports inside :mod:`qtool.quant.analysis` run one way: ``base`` <- ``minmax`` / ``histogram`` <- ``sqnr``;
``mse`` uses ``base`` and :mod:`qtool.quant.affine` only.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from ..affine import blocked_shapes

_CHUNK_ELEMENTS = 1 << 18  # search temporaries are cut to about this many elements (cache-sized chunks)


class NoStatisticsError(RuntimeError):
    """compute_encodings() was called before any data was seen."""


class StatisticsMergeError(ValueError):
    """Two statistics values have no exact merge (e.g. folded histograms, or two weights for MSE)."""


def merge_statistics(a, b):
    """Merge two statistics values of the same type: ``type(a).merge(a, b)``.

    What a merge preserves is stated on each type's ``merge``; a type without an exact merge raises
    :class:`StatisticsMergeError` instead of approximating.
    """
    merge = getattr(type(a), "merge", None)
    if merge is None:
        raise TypeError(f"{type(a).__name__} is not an analyzer statistics value (no merge)")
    return merge(a, b)


def _check_same_type(a, b, cls) -> None:
    """``merge`` helper: both operands must be ``cls`` (a clear error instead of a wrong merge)."""
    if not isinstance(a, cls) or not isinstance(b, cls):
        raise TypeError(f"{cls.__name__}.merge() takes two {cls.__name__} values, got "
                        f"{type(a).__name__} and {type(b).__name__}")


class EncodingAnalyzer:
    """Base class: holds the encoding ``shape`` and optional ``block_size``.

    Besides ``update_stats`` / ``compute_encodings`` / ``reset_stats`` / ``compute_dynamic_encodings``, every
    analyzer has ``collect`` / ``fold`` / ``statistics`` (see the module docstring), with
    ``update_stats(x)`` exactly ``fold(collect(x))``.
    """

    def __init__(self, shape: Sequence[int] = (), block_size: Optional[Sequence[int]] = None):
        self.shape = tuple(int(d) for d in shape)
        self.block_size = None if block_size is None else tuple(int(b) for b in block_size)

    def update_stats(self, x: torch.Tensor):  # pragma: no cover - interface
        raise NotImplementedError

    def collect(self, x: torch.Tensor):  # pragma: no cover - interface
        """This batch's statistics as a value (the analyzer does not change)."""
        raise NotImplementedError

    def fold(self, stats) -> None:  # pragma: no cover - interface
        """Fold a statistics value (from :meth:`collect`, a merge of them, ...) into the running state."""
        raise NotImplementedError

    def batch_range(self, stats):  # pragma: no cover - interface
        """What ``update_stats`` returns for the batch whose :meth:`collect` value is ``stats`` (the input of
        :meth:`compute_dynamic_encodings`)."""
        raise NotImplementedError

    def statistics(self):  # pragma: no cover - interface
        """The running state as a value (later folds do not change it), or None before any data."""
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
