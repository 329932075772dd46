"""What data-parallel calibration exchanges, and in which order (``torchrun … qtool calibrate``).

Every rank runs the same calibration mode on its own contiguous slice of the calibration batches
(:func:`shard`); the ranks meet only at the seams below, each a step of :class:`qtool.parallel.Group` (same
collectives, same order on every rank; quantizers and layers always in plan or sorted-name order, never a set):

* **activation statistics** (:func:`calibrate_activations_dp`): rank 0's analyzers fold its own batches as
  they come; the other ranks keep theirs as one mergeable statistics value per quantizer
  (``analyzer.collect`` merged with ``merge_statistics``: min/max, or the raw histogram batches), which rank 0
  folds after its own, in rank order. Shards are contiguous, so that is the global batch order and every
  analyzer (min-max and the histogram ones) gives the bytes of one process fed the same batches;
* **layer input statistics** (:func:`merge_inputs`, GPTQ and activation-weighted search): per-rank sums,
  added in rank order on every rank;
* **SmoothQuant maxima** (:func:`merge_absmax`): elementwise maximum, exact;
* **weights** (:func:`calibrate_weights_split`, and ``rounding.round_weights(group=...)`` for GPTQ): each weight
  row is calibrated (and GPTQ-rounded) by one rank, chosen by size; the results (min/max, codes) go to every rank, or to rank 0 alone
  when nothing else needs them (streaming).

In one process (``Group()``) every function here is the plain calibration step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import QuantizerPlan
from ..data import CalibrationData
from ..parallel import Group, assign, shard_bounds
from ..quant import QuantizerBase
from ..quant.analyzers import merge_statistics
from .base import calibrate_activations, calibrate_weights, encodings_of
from .rounding import InputStatistics

__all__ = ["shard", "samples_per_rank", "calibrate_activations_dp", "merge_inputs", "merge_absmax",
           "calibrate_weights_split", "encoding_numel"]

WEIGHTS_PER_RANK = 8  # weight rows each rank calibrates per window (Group.windows)


def _slice(data: CalibrationData, rank: int, world_size: int) -> CalibrationData:
    start, stop = shard_bounds(len(data), rank, world_size)
    batches = data.batches[start:stop]
    return dataclasses.replace(data, batches=batches, num_samples=sum(b.size for b in batches),
                               first=data.first + start)


def shard(data: Optional[CalibrationData], group: Group) -> Optional[CalibrationData]:
    """This rank's contiguous slice of the batches (all of them in one process)."""
    if data is None or not group.distributed:
        return data
    return _slice(data, group.rank, group.world_size)


def samples_per_rank(data: Optional[CalibrationData], group: Group) -> List[int]:
    """How many calibration samples each rank's shard holds (computed alike on every rank, no exchange)."""
    if data is None:
        return [0] * group.world_size
    return [_slice(data, r, group.world_size).num_samples for r in range(group.world_size)]


def _cpu(value):
    """Statistics values travel through host memory (dataclasses of tensors, dicts, tuples)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_cpu(v) for v in value)
    fields = getattr(value, "__dataclass_fields__", None)
    if fields:
        return type(value)(**{f: _cpu(getattr(value, f)) for f in fields})
    return value


class _Recorder:
    """Stands in for an activation quantizer's analyzer on ranks other than 0: each batch's statistics are merged
    into one value for rank 0, and the quantizer still quantizes the batch with the batch's own range (as the
    analyzer would). It never computes an encoding: rank 0 does, from every rank's statistics."""

    def __init__(self, inner):
        self.inner = inner
        self.value = None

    @torch.no_grad()
    def update_stats(self, x: torch.Tensor):
        stats = self.inner.collect(x)
        self.value = stats if self.value is None else merge_statistics(self.value, stats)
        return self.inner.batch_range(stats)

    def compute_dynamic_encodings(self, stats, num_steps: int, is_symmetric: bool):
        return self.inner.compute_dynamic_encodings(stats, num_steps, is_symmetric)

    def has_stats(self) -> bool:
        return False

    def reset_stats(self) -> None:
        pass


def calibrate_activations_dp(rows: List[QuantizerPlan], quantizers: Dict[str, QuantizerBase],
                             run: Callable[[], None], group: Group) -> None:
    """:func:`~qtool.calibration.base.calibrate_activations` over every rank's shard: one gather step, after
    this rank's ``run()``. Ranges are set on rank 0 only (the others leave these quantizers uncalibrated)."""
    if not group.distributed:
        calibrate_activations(rows, quantizers, run)
        return
    names = sorted(q.name for q in rows)
    with contextlib.ExitStack() as stack, torch.no_grad():
        for q in rows:
            stack.enter_context(encodings_of(q, quantizers[q.name]))
        recorders: Dict[str, _Recorder] = {}
        if not group.is_root:
            for name in names:
                quantizer = quantizers[name]
                recorders[name] = _Recorder(quantizer.encoding_analyzer)
                quantizer.encoding_analyzer = recorders[name]
                stack.callback(setattr, quantizer, "encoding_analyzer", recorders[name].inner)
        run()
        gathered = group.gather({name: _cpu(r.value) for name, r in recorders.items() if r.value is not None})
        if group.is_root:
            for from_rank in gathered[1:]:
                for name in names:
                    if name in from_rank:
                        quantizers[name].encoding_analyzer.fold(from_rank[name])


def merge_inputs(stats: Dict[str, InputStatistics], group: Group) -> Dict[str, InputStatistics]:
    """Every rank's layer input statistics summed in rank order, on every rank (on this rank's devices)."""
    if not group.distributed:
        return stats
    gathered = group.all_gather({name: _cpu(stats[name]) for name in sorted(stats)})
    out: Dict[str, InputStatistics] = {}
    for name in sorted(set().union(*gathered)):
        total = None
        for from_rank in gathered:
            if name in from_rank:
                total = from_rank[name] if total is None else InputStatistics.merge(total, from_rank[name])
        device = stats[name].sq.device if name in stats else total.sq.device
        out[name] = InputStatistics(total.count, total.sq.to(device),
                                    None if total.xtx is None else total.xtx.to(device), total.groups,
                                    None if total.absolute is None else total.absolute.to(device))
    return out


def merge_absmax(absmax: Dict[str, torch.Tensor], group: Group) -> Dict[str, torch.Tensor]:
    """SmoothQuant's per-channel activation maxima, elementwise maximum over the ranks (exact), on every rank."""
    if not group.distributed:
        return absmax
    gathered = group.all_gather({name: _cpu(absmax[name]) for name in sorted(absmax)})
    out: Dict[str, torch.Tensor] = {}
    for name in sorted(set().union(*gathered)):
        values = [g[name] for g in gathered if name in g]
        m = values[0]
        for v in values[1:]:
            m = torch.maximum(m, v)
        out[name] = m.to(absmax[name].device) if name in absmax else m
    return out


def calibrate_weights_split(rows: Sequence[QuantizerPlan], sizes: Dict[str, int],
                            quantizer_for: Callable[[QuantizerPlan], QuantizerBase],
                            weight_for: Callable[[QuantizerPlan], torch.Tensor], group: Group,
                            importance_for=None, done=None, everywhere: bool = True) -> None:
    """:func:`~qtool.calibration.base.calibrate_weights` with the rows split over the ranks by weight size
    (``sizes``: row name -> elements), a window at a time. A row calibrated elsewhere gets its range with
    ``set_range`` on every rank (``everywhere``) or on rank 0 only; ``done(q, quantizer)`` runs on the ranks that
    hold the range, in plan order."""
    done = share_fused_global_scales(rows, done)
    if not group.distributed:
        calibrate_weights(rows, quantizer_for, weight_for, done, importance_for)
        return
    for window in group.windows(rows, WEIGHTS_PER_RANK):
        owners = assign([sizes[q.name] for q in window], group.world_size)
        mine = [window[i] for i in group.owned(owners)]
        ranges: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        held: Dict[str, QuantizerBase] = {}

        def keep(q, quantizer):
            held[q.name] = quantizer
            ranges[q.name] = (quantizer.min.detach().cpu(), quantizer.max.detach().cpu())

        calibrate_weights(mine, quantizer_for, weight_for, keep, importance_for)
        ranges = {name: ranges[name] for name in sorted(ranges)}
        gathered = group.all_gather(ranges) if everywhere else group.gather(ranges)
        if gathered is None:
            continue
        for q, owner in zip(window, owners):
            quantizer = held.get(q.name)
            if quantizer is None:
                quantizer = quantizer_for(q)
                mn, mx = gathered[owner][q.name]
                quantizer.set_range(mn, mx)
            if done is not None:
                done(q, quantizer)


# sibling layers that runtimes fuse into one matmul (vLLM: q/k/v, gate/up; a MoE expert's gate/up, Mixtral's
# w1/w3, are vLLM's w13), keyed by the module's last name
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "query": "qkv", "key": "qkv", "value": "qkv",
          "gate_proj": "gate_up", "up_proj": "gate_up", "w1": "gate_up", "w3": "gate_up"}


def fused_group(q: QuantizerPlan) -> Optional[str]:
    """The fused-layer group of an NVFP4 weight row (``parent/qkv`` or ``parent/gate_up``), or None."""
    if q.tensor != "weight" or q.element == "int" or q.scale_dtype != "fp8_e4m3":
        return None
    parent, _, last = q.module.rpartition(".")
    kind = _FUSED.get(last)
    return None if kind is None else f"{parent}/{kind}"


def share_fused_global_scales(rows: Sequence[QuantizerPlan], done=None):
    """A ``done`` callback for :func:`calibrate_weights_split` that gives NVFP4 weights of layers a runtime fuses
    (q/k/v, gate/up of one block) one global scale: vLLM takes one for the fused matmul without re-quantizing the
    block scales, so each layer must already use it. Rows of a group are held back until the whole group is
    calibrated, then each quantizer's ``global_amax`` is the group's largest absolute maximum and ``done`` runs
    for them in plan order. Returns ``done`` itself when no row is in a group of two or more."""
    members: Dict[str, List[str]] = {}
    for q in rows:
        g = fused_group(q)
        if g is not None:
            members.setdefault(g, []).append(q.name)
    members = {g: names for g, names in members.items() if len(names) > 1}
    if not members:
        return done
    group_of = {name: g for g, names in members.items() for name in names}
    waiting: Dict[str, List[Tuple[QuantizerPlan, QuantizerBase]]] = {}

    def hold(q: QuantizerPlan, quantizer: QuantizerBase) -> None:
        g = group_of.get(q.name)
        if g is None:
            if done is not None:
                done(q, quantizer)
            return
        waiting.setdefault(g, []).append((q, quantizer))
        if len(waiting[g]) < len(members[g]):
            return
        amax = max(float(qz.max.detach().abs().max()) for _, qz in waiting[g])
        for q2, qz in sorted(waiting.pop(g), key=lambda item: members[g].index(item[0].name)):
            qz.global_amax = torch.tensor(amax, dtype=torch.float32)
            if done is not None:
                done(q2, qz)

    return hold


def encoding_numel(q: QuantizerPlan) -> int:
    """A weight row's element count from its encoding (exact for blocks; the encoding's size otherwise)."""
    return math.prod(q.shape) * (math.prod(q.block_size) if q.block_size else 1)
