"""The activation pass of an in-memory calibration replayed as a CUDA graph (#53 item 2).

On a GPU a calibrating forward is bound by kernel launches, not arithmetic: each min-max quantizer call is about
30 small kernels (the batch's range, the running range, scale and offset, the fake-quant), so W8A8 calibration of
a small model costs 9-14x a float pass. Here the forward is recorded once per batch shape, its quantizers
calibrating, and replayed for the later batches of that shape with each batch copied into the recorded inputs: the
same kernels on the same values, so the same ranges bit for bit (measured on an H200 by
bench/calibration_graph_probe.py before this module: 2.9x and 3.8x a float pass instead of 8.4x and 13.4x).

It is used only where a replay gives the eager pass's bits:

- a CUDA device and one process (a rank's recorder keeps each batch's statistics in Python);
- every calibrating quantizer a :class:`~qtool.quant.QuantizeDequantize` with a min-max analyzer: its statistics
  fold in place into tensors that exist after the first batch, with no host sync and nothing kept in Python per
  call, and folding one batch twice leaves them as once (the warm-up before a capture repeats the batch);
- batches whose tensors alone vary (a :class:`~qtool.data.Batch` holds nothing else).

The first batch of each shape runs eagerly (analyzers create their state, caches fill); the second is run once on
a side stream (CUDA graphs' rule before a capture), recorded and replayed. A forward the driver refuses to record
(a host sync inside it: a mask checked on the host, routing by ``nonzero``) runs eagerly from that batch on, with
the same result. At most :data:`MAX_GRAPHS` shapes are recorded (one forward's activations each); others run
eagerly.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..config import QuantizerPlan
from ..parallel import Group
from ..quant import QuantizeDequantize, QuantizerBase
from ..quant.analyzers import MinMaxEncodingAnalyzer

__all__ = ["ENABLED", "MAX_GRAPHS", "Replayer", "replayer", "signature"]

ENABLED = True  # False: every batch runs eagerly (bench/calibration_graph_probe.py compares the two)
MAX_GRAPHS = 2  # batch shapes recorded (a last, shorter batch is the usual second one)

Signature = Tuple[Tuple[str, Tuple[int, ...], torch.dtype, torch.device], ...]


def signature(args: tuple, kwargs: dict) -> Optional[Signature]:
    """What a recorded forward is keyed by: each tensor's place, shape, dtype and device. None where an argument
    is not a tensor (its value could steer the forward in ways a replay would not follow)."""
    items = [(str(i), a) for i, a in enumerate(args)] + sorted(kwargs.items())
    if not all(isinstance(v, torch.Tensor) for _, v in items):
        return None
    return tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in items)


def replayable(rows: List[QuantizerPlan], quantizers: Dict[str, QuantizerBase], device: torch.device,
               group: Optional[Group] = None) -> bool:
    """Whether the activation pass of ``rows`` may be replayed (see the module's list)."""
    if not ENABLED or torch.device(device).type != "cuda" or not rows or (group is not None and group.distributed):
        return False
    return all(type(quantizers[q.name]) is QuantizeDequantize
               and type(quantizers[q.name].encoding_analyzer) is MinMaxEncodingAnalyzer for q in rows)


class _Recorded:
    """One batch shape's forward, recorded: the inputs it reads and the graph that replays it."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict):
        self.args = tuple(a.clone() for a in args)
        self.kwargs = {k: v.clone() for k, v in kwargs.items()}
        device = self.args[0].device if self.args else next(iter(self.kwargs.values())).device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # the warm-up: this batch once more (min-max folds are idempotent)
            forward(*self.args, **self.kwargs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # a private memory pool per shape: two graphs sharing one may reuse each other's memory, which is safe only
        # when they are replayed in their capture's order; thread_local: other threads' CUDA calls are not this
        # capture's
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            forward(*self.args, **self.kwargs)

    def replay(self, args: tuple, kwargs: dict) -> None:
        for mine, given in zip(self.args, args):
            mine.copy_(given)
        for k, v in kwargs.items():
            self.kwargs[k].copy_(v)
        self.graph.replay()


class Replayer:
    """``forward(*args, **kwargs)`` for each batch of a calibration pass, replayed where recorded; returns nothing
    (the pass reads the quantizers' statistics, not the outputs)."""

    def __init__(self, forward: Callable):
        self.forward = forward
        self.recorded: Dict[Signature, _Recorded] = {}
        self.seen: Dict[Signature, int] = {}
        self.refused = False  # the driver refused a capture: eager from then on
        self.replays = 0

    def __call__(self, *args, **kwargs) -> None:
        key = None if self.refused else signature(args, kwargs)
        if key is None:
            self.forward(*args, **kwargs)
            return
        recorded = self.recorded.get(key)
        if recorded is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] == 1 or len(self.recorded) >= MAX_GRAPHS:
                self.forward(*args, **kwargs)
                return
            recorded = self._record(key, args, kwargs)
            if recorded is None:
                self.forward(*args, **kwargs)
                return
        recorded.replay(args, kwargs)
        self.replays += 1

    def _record(self, key: Signature, args: tuple, kwargs: dict) -> Optional[_Recorded]:
        try:
            recorded = _Recorded(self.forward, args, kwargs)
        except RuntimeError:  # a host sync in the forward (or a driver without graphs): the eager pass
            self.refused = True
            return None
        self.recorded[key] = recorded
        return recorded


def replayer(forward: Callable, rows: List[QuantizerPlan], quantizers: Dict[str, QuantizerBase],
             device: torch.device, group: Optional[Group] = None) -> Optional[Replayer]:
    """A :class:`Replayer` of ``forward`` where the activation pass of ``rows`` may be replayed, else None."""
    return Replayer(forward) if replayable(rows, quantizers, device, group) else None
