"""The activation pass of an in-memory calibration replayed as a CUDA graph (#53 item 2).

On a GPU a calibrating forward is bound by kernel launches, not arithmetic: each min-max quantizer call is about
30 small kernels (the batch's range, the running range, scale and offset, the fake-quant), so W8A8 calibration of
a small model costs 9-14x a float pass. Here the forward is recorded once per batch shape, its quantizers
calibrating, and replayed for the later batches of that shape with each batch copied into the recorded inputs: the
same kernels on the same values, so the same ranges bit for bit (measured on an H200 by
bench/calibration_graph_probe.py before this module: 2.9x and 3.8x a float pass instead of 8.4x and 13.4x).

It is used only where a replay gives the eager pass's bits:

- a CUDA device, one process (a rank's recorder keeps each batch's statistics in Python), a model in eval mode;
- every calibrating quantizer a :class:`~qtool.quant.QuantizeDequantize` with a min-max analyzer: its statistics
  fold in place into tensors that exist after the first batch, with no host sync and nothing kept in Python per
  call, and folding one batch twice leaves them as once (the warm-up before a capture repeats the batch);
- batches whose tensors alone vary (a :class:`~qtool.data.Batch` holds nothing else), keyed by shape and strides.

Which batches are recorded: the pass's batches are counted by shape before it starts, and the :data:`MAX_GRAPHS`
most frequent shapes that repeat are recorded on their first batch; a shape the pass holds once runs eagerly (a
recording costs about two eager forwards). Where the counts are unknown (a Replayer made without them, or a full
mask kept after all) a shape is recorded on its second batch. A batch to record runs on a side stream with host
syncs made errors (a forward that syncs, such as a mask checked on the host or routing by ``nonzero``, is found
there, before any capture starts; this warm-up also creates the analyzers' state and fills the caches the capture
reads), is recorded on that stream and checked: from empty ranges, the warm-up and a first replay must leave the
same bits in every analyzer (a library may take another path while a capture runs: transformers builds explicit
masks then). A refusal leaves the pass eager from that batch on, with the same result (what the refused recording
folded is dropped or put back); only where the refused forward was the pass's first (a first call may fill a
cache), the next batch of its shape is tried once more. ``QTOOL_CUDA_GRAPHS=0`` turns CUDA graphs off in qtool.

A transformers causal LM given an attention mask of all ones (qtool's packed text windows carry one) gets None
instead in this pass (:meth:`Replayer.feed`): transformers (5.23) reads a given mask on the host when deciding
whether sdpa may skip it, a sync the warm-up would refuse, and it reads None as that very mask. That is checked on
the first batch of each shape (run with the mask and without, every analyzer's range bits compared); where they
differ the mask stays for the whole pass (transformers then reads it on the host, so a recording is refused and
the pass goes on eagerly). The sequential mode's block passes are not
replayed.
"""

from __future__ import annotations

import collections
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import QuantizerPlan
from ..data import Batch
from ..model.insert import QUANTIZERS_ATTR, iter_quantizers
from ..parallel import Group
from ..quant import QuantizeDequantize, QuantizerBase
from ..quant.analyzers import MinMaxEncodingAnalyzer
from ..quant.quantizer import _last_call

__all__ = ["ENABLED", "ENV", "MAX_GRAPHS", "Refused", "Replayer", "counts", "full_mask", "in_training",
           "reads_none_as_full_mask", "record", "replayer", "signature"]

ENV = "QTOOL_CUDA_GRAPHS"  # 0 / false / no / off: no CUDA graphs anywhere in qtool (this pass, GPTQ's column loop)


def enabled_by_environment() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


ENABLED = enabled_by_environment()  # False: every batch runs eagerly (calibration_graph_probe.py compares the two)
MAX_GRAPHS = 2  # batch shapes recorded (one forward's activations each)

MASK = "attention_mask"
Signature = Tuple[Tuple[str, Tuple[int, ...], Tuple[int, ...], torch.dtype], ...]


def signature(args: tuple, kwargs: dict) -> Optional[Signature]:
    """What a recorded forward is keyed by: each tensor's place, shape, strides and dtype. None where an argument
    is not a tensor (its value could steer the forward in ways a replay would not follow)."""
    items = [(str(i), a) for i, a in enumerate(args)] + sorted(kwargs.items())
    if not all(isinstance(v, torch.Tensor) for _, v in items):
        return None
    return tuple((k, tuple(v.shape), v.stride(), v.dtype) for k, v in items)  # (one pass runs on one device)


def replayable(rows: List[QuantizerPlan], quantizers: Dict[str, QuantizerBase], device: torch.device,
               group: Optional[Group] = None) -> bool:
    """Whether the activation pass of ``rows`` may be replayed (see the module's list)."""
    if not ENABLED or torch.device(device).type != "cuda" or not rows or (group is not None and group.distributed):
        return False
    return all(type(quantizers[q.name]) is QuantizeDequantize
               and type(quantizers[q.name].encoding_analyzer) is MinMaxEncodingAnalyzer for q in rows)


class Refused(RuntimeError):
    """A forward that cannot be recorded: a host sync in its warm-up, a capture the driver refused, or a replay
    that leaves other ranges than the eager forward."""


def record(step: Callable[[], None], device: torch.device, find_syncs: bool = True) -> torch.cuda.CUDAGraph:
    """``step()`` run once on a side stream, then recorded as a CUDA graph on that same stream. Raises
    :class:`Refused` if the driver refuses the capture or, with ``find_syncs``, the warm-up syncs with the host.

    ``find_syncs`` runs the warm-up with torch's sync debug mode set to "error", so a host sync is found before
    any capture starts: a capture that fails leaves the allocator and the current stream in states some torch
    releases do not restore (the stream is restored here in any case). That mode is the whole process's: leave it
    off where another thread may sync meanwhile (a state writer's copies to the host). Warm-up and capture share
    one stream, so what CUDA creates per stream (cuBLAS workspaces) exists before the capture."""
    device = torch.device(device)
    before = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(before)
    mode = torch.cuda.get_sync_debug_mode()
    try:
        try:
            with torch.cuda.stream(side):
                if find_syncs:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    step()
                finally:
                    torch.cuda.set_sync_debug_mode(mode)
        finally:  # also after a failed warm-up: its kernels may still be reading what the caller frees next
            before.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA calls (a state writer's copies to the host) are not this capture's
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            step()
    except Exception as e:
        torch.cuda.set_stream(before)  # torch.cuda.graph leaves its stream current when its capture_end raises
        raise Refused(f"{type(e).__name__}: {e}") from e
    return graph


# The calibrating analyzers' running ranges, as the recording check and the mask check handle them: kept and put
# back, emptied (+inf, -inf) so one forward's ranges show alone, and read as bits. Only analyzers with state take
# part: one the first batch never reached has none.
def _kept(analyzers: Sequence[MinMaxEncodingAnalyzer]) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    return {id(a): (a.min.clone(), a.max.clone()) for a in analyzers if a.min is not None}


def _put_back(analyzers: Sequence[MinMaxEncodingAnalyzer], kept: Dict[int, Tuple[torch.Tensor, torch.Tensor]],
              drop_new: bool) -> None:
    """The ranges ``kept`` into their analyzers' own tensors (a recorded graph folds into those); with
    ``drop_new``, an analyzer that had none then loses the state it gained since."""
    for a in analyzers:
        if id(a) in kept:
            a.min.copy_(kept[id(a)][0])
            a.max.copy_(kept[id(a)][1])
        elif drop_new:
            a.reset_stats()


def _read_here(analyzers: Sequence[MinMaxEncodingAnalyzer], kept: Dict[int, Tuple[torch.Tensor, torch.Tensor]]):
    """State a recording's warm-up made (on its side stream) is read on the current stream from now on: told to
    the caching allocator, so its memory is not handed to the side stream's next allocation while this stream
    may still read it."""
    for a in analyzers:
        if id(a) not in kept and a.min is not None and a.min.is_cuda:
            stream = torch.cuda.current_stream(a.min.device)
            a.min.record_stream(stream)
            a.max.record_stream(stream)


def _empty(analyzers: Sequence[MinMaxEncodingAnalyzer]) -> None:
    for a in analyzers:
        if a.min is not None:
            a.min.fill_(float("inf"))
            a.max.fill_(float("-inf"))


def _range_bits(analyzers: Sequence[MinMaxEncodingAnalyzer]) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    return {id(a): (a.min.view(torch.int32).clone(), a.max.view(torch.int32).clone())
            for a in analyzers if a.min is not None}


def _same_bits(a: Dict[int, Tuple[torch.Tensor, torch.Tensor]], b: Dict[int, Tuple[torch.Tensor, torch.Tensor]]):
    return a.keys() == b.keys() and all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))


def _run_alone(forward: Callable, args: tuple, kwargs: dict) -> None:
    """One forward whose calibration calls share nothing with another forward's (``_LastCalibrationCall``: a call
    shared across two forwards would be recorded as a constant)."""
    _last_call.clear()
    forward(*args, **kwargs)
    _last_call.clear()


class _Recorded:
    """One batch shape's forward, recorded: the inputs it reads and the graph that replays it.

    Recording checks the replay against the eager forward quantizer by quantizer: each analyzer's running range is
    set empty (+inf, -inf) before the warm-up and again before a first replay of the same batch, and both must
    leave the same bits in every analyzer (a library may take another path while a capture runs: transformers
    builds explicit attention masks then). The ranges kept before are then put back (on a failure too, when an
    analyzer that had none loses what the warm-up and the replay left) and the batch is replayed once more into
    them, folded call by call as the eager pass folds it."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict, analyzers: List[MinMaxEncodingAnalyzer],
                 device: torch.device):
        self.args = tuple(a.clone() for a in args)
        self.kwargs = {k: v.clone() for k, v in kwargs.items()}
        kept = _kept(analyzers)
        checked = False
        try:
            _empty(analyzers)
            self.graph = record(lambda: _run_alone(forward, self.args, self.kwargs), device)
            eager = _range_bits(analyzers)
            _empty(analyzers)
            self.graph.replay()
            if not _same_bits(eager, _range_bits(analyzers)):
                raise Refused("a replayed forward's ranges are not the eager forward's")
            checked = True
        finally:  # (an analyzer this batch gave its first state keeps it only if the graph folds into it)
            _read_here(analyzers, kept)
            _put_back(analyzers, kept, drop_new=not checked)
        self.graph.replay()  # the batch folded into the kept ranges call by call, as the eager pass folds it

    def replay(self, args: tuple, kwargs: dict) -> None:
        for mine, given in zip(self.args, args):
            mine.copy_(given)
        for k, v in kwargs.items():
            self.kwargs[k].copy_(v)
        self.graph.replay()


class Replayer:
    """``forward(*args, **kwargs)`` for each batch of a calibration pass, replayed where recorded; returns nothing
    (the pass reads the quantizers' statistics, not the outputs). ``analyzers``: the calibrating quantizers'
    min-max analyzers, restored if a recorded forward's check fails."""

    def __init__(self, forward: Callable, analyzers: Sequence[MinMaxEncodingAnalyzer] = (),
                 device: Optional[torch.device] = None, drop_full_masks: bool = False,
                 counts: Optional[Dict[Signature, int]] = None):
        self.forward = forward
        self.analyzers = list(analyzers)
        self.device = device
        self.drop_full_masks = drop_full_masks
        self.masks_agree: Optional[bool] = None  # None: not tried yet; False: the mask stays for the whole pass
        self.mask_shapes: set = set()
        self.recorded: Dict[Signature, _Recorded] = {}
        self.seen: Dict[Signature, int] = {}
        self.refused: Optional[str] = None  # why a recording failed: eager from then on
        self.first_refused: Optional[str] = None  # why the recording of the pass's first forward failed (retried)
        self.replays = 0
        # how many batches of each signature the pass holds (:func:`counts`), where known: the MAX_GRAPHS most
        # frequent of those that repeat are recorded on sight, the rest never; an uncounted one on its second batch
        self.counts = dict(counts) if counts is not None else None
        repeated = sorted((k for k, n in (counts or {}).items() if n >= 2), key=lambda k: -counts[k])
        self.preferred = set(repeated[:MAX_GRAPHS])

    def feed(self, batch: Batch) -> None:
        """One batch (on the CPU) of the pass: moved to the device and run, replayed where recorded. With
        ``drop_full_masks``, a full attention mask (:func:`full_mask`) is left out, once the first batch of each
        shape has shown that leaving it out gives every analyzer the same range bits (:meth:`_masks_agree`)."""
        if self.drop_full_masks and self.masks_agree is not False and full_mask(batch):
            without = _without_mask(batch)
            shape = tuple(batch.kwargs[MASK].shape)
            if shape not in self.mask_shapes:
                self.mask_shapes.add(shape)
                moved = without.to(self.device)
                self.masks_agree = self._masks_agree(batch.to(self.device), moved)
                kept = moved.kwargs if self.masks_agree else batch.kwargs  # this batch ran eagerly, as it goes on
                key = signature(moved.args, kept)
                self.seen[key] = max(self.seen.get(key, 0), 1)
                return
            if self.masks_agree:
                batch = without
        b = batch.to(self.device)
        self(*b.args, **b.kwargs)

    def _records(self, key: Signature) -> bool:
        """Whether a batch of signature ``key``, not recorded yet, is recorded now: on sight if it is one of the
        pass's most frequent repeating signatures, never if the pass holds it once or it lost to those, on its
        second batch if the pass's counts are unknown or do not hold it (a full mask kept after all)."""
        if self.counts is not None and key in self.counts:
            return key in self.preferred
        return self.seen[key] >= 2

    def _masks_agree(self, with_mask: Batch, without: Batch) -> bool:
        """Whether ``without`` (the batch with its full mask left out) leaves the same bits in every analyzer as
        ``with_mask``, each run from empty ranges; either way the batch is then folded as the eager pass folds it
        (with its mask, into the ranges as they were). On the pass's first batch, where no analyzer had a range,
        agreeing runs have left just that: the batch is not run a third time."""
        kept = _kept(self.analyzers)
        agree = first = False
        try:
            _empty(self.analyzers)
            _run_alone(self.forward, with_mask.args, with_mask.kwargs)
            masked = _range_bits(self.analyzers)
            _empty(self.analyzers)
            try:
                _run_alone(self.forward, without.args, without.kwargs)
            except Exception:  # the model needs its mask: keep it
                pass
            else:
                agree = _same_bits(masked, _range_bits(self.analyzers))
                first = agree and not kept
        finally:
            if not first:
                _put_back(self.analyzers, kept, drop_new=True)
        if not first:
            _run_alone(self.forward, with_mask.args, with_mask.kwargs)
        return agree

    def __call__(self, *args, **kwargs) -> None:
        key = None if self.refused else signature(args, kwargs)
        if key is None:
            self.forward(*args, **kwargs)
            return
        recorded = self.recorded.get(key)
        if recorded is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if len(self.recorded) >= MAX_GRAPHS or not self._records(key):
                self.forward(*args, **kwargs)
                return
            device = next(v.device for v in list(args) + list(kwargs.values()))
            try:  # the recording runs this batch (warm-up and a first replay)
                with torch.cuda.device(device):  # (a refusal restores the stream, and so the device, it began on)
                    self.recorded[key] = _Recorded(self.forward, args, kwargs, self.analyzers, device)
            except Exception as e:  # refused, or no memory for it: this batch eagerly, and the rest
                why = f"{type(e).__name__}: {e}" if not isinstance(e, Refused) else str(e)
                if self.first_refused is None and len(self.seen) == 1 and self.seen[key] == 1:
                    self.first_refused = why  # the model's first forward (a cache it fills?): once more, next batch
                else:
                    self.refused = why
                self.forward(*args, **kwargs)  # (what the recording folded is dropped or put back: once, as eager)
                return
            self.replays += 1
            return
        recorded.replay(args, kwargs)
        self.replays += 1


def counts(batches: Sequence[Batch], drop_full_masks: bool) -> Dict[Signature, int]:
    """How many of ``batches`` (on the CPU) reach a replayed pass's recording under each signature: with
    ``drop_full_masks``, a full mask left out, and the first batch of each mask shape not counted (the mask check
    runs it, :meth:`Replayer.feed`). Signatures are taken of the tensors as ``Batch.to`` makes them (a tensor that
    is not dense arrives contiguous)."""
    keys, checked = [], set()
    for b in batches:
        if drop_full_masks and full_mask(b):
            shape = tuple(b.kwargs[MASK].shape)
            if shape not in checked:
                checked.add(shape)
                continue
            b = _without_mask(b)
        keys.append(signature(tuple(_moved(a) for a in b.args), {k: _moved(v) for k, v in b.kwargs.items()}))
    return dict(collections.Counter(k for k in keys if k is not None))


def _without_mask(batch: Batch) -> Batch:
    return Batch(batch.args, {k: v for k, v in batch.kwargs.items() if k != MASK})


def _moved(v):
    """What ``v.to(another device)`` gives, as a layout without memory (the same rule: strides kept where the tensor
    is dense and does not overlap, else contiguous); a non-tensor as it is."""
    return torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v


def replayer(forward: Callable, rows: List[QuantizerPlan], quantizers: Dict[str, QuantizerBase],
             device: torch.device, group: Optional[Group] = None,
             batches: Optional[Sequence[Batch]] = None) -> Optional[Replayer]:
    """A :class:`Replayer` of ``forward`` (a module in eval mode) where the activation pass of ``rows`` may be
    replayed, else None. ``batches``: the pass's batches (on the CPU), whose most frequent repeating shapes are
    then recorded on sight (without them, a shape on its second batch)."""
    if in_training(forward) or not replayable(rows, quantizers, device, group):
        return None  # (training: dropout draws other numbers on a replay, batch norms count the warm-up)
    drop = reads_none_as_full_mask(forward)
    return Replayer(forward, [quantizers[q.name].encoding_analyzer for q in rows], torch.device(device), drop,
                    counts(batches, drop) if batches is not None else None)


def in_training(model) -> bool:
    """Whether any module of ``model`` but qtool's own (its quantizers and the dicts holding them, made in training
    mode and indifferent to it) is in training mode."""
    if not isinstance(model, torch.nn.Module):
        return False
    own = {id(m) for _, q in iter_quantizers(model) for m in q.modules()}
    own.update(id(getattr(m, QUANTIZERS_ATTR)) for m in model.modules() if hasattr(m, QUANTIZERS_ATTR))
    return any(m.training for m in model.modules() if id(m) not in own)


def reads_none_as_full_mask(model) -> bool:
    """Whether ``model`` is one of transformers' own decoder-only models (no remote code) with a cache, whose
    forward reads ``attention_mask=None`` as a mask of all ones (without a cache, transformers looks for packed
    sequences when given None, which is a host sync and other masks). :meth:`Replayer._masks_agree` checks it on
    the data all the same."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    config = getattr(model, "config", None)
    return (isinstance(model, PreTrainedModel) and type(model).__module__.startswith("transformers.models.")
            and not getattr(config, "is_encoder_decoder", False) and getattr(config, "use_cache", True) is not False
            and bool(getattr(config, "is_decoder", False) or type(model).__name__.endswith("ForCausalLM")))


def full_mask(batch: Batch) -> bool:
    """Whether ``batch`` is token ids and a 2-D attention mask of ones of their shape, and nothing else (a 4-D mask
    of ones means no causal mask; values other than 1 build positions in some models; given positions change what
    None means)."""
    mask, ids = batch.kwargs.get(MASK), batch.kwargs.get("input_ids")
    return (not batch.args and set(batch.kwargs) == {"input_ids", MASK} and isinstance(mask, torch.Tensor)
            and isinstance(ids, torch.Tensor) and mask.device.type == "cpu" and mask.dim() == 2
            and mask.shape == ids.shape and bool((mask == 1).all()))
