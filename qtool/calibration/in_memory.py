"""In-memory calibration: the whole model is loaded, quantizers are inserted, and the data runs through it."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from ..config import Plan
from ..data import Batch, CalibrationData, batch_where, model_takes
from ..errors import DataError, UsageError
from ..model.insert import set_quantization
from ..parallel import Group
from ..quant import QuantizerBase
from ..quant.precision import model_matmuls
from .base import first_tensor
from .collective import calibrate_activations_dp, calibrate_weights_split, merge_absmax, merge_inputs, shard
from .folding import adjacent_pairs, fold_batch_norm
from .graphs import Replayer, replayer
from .rotation import rotate
from .rounding import collect_inputs, importance, round_weights, routed_fallbacks
from .rounding.statistics import collect_module_inputs
from .smoothing import activation_absmax, smooth

# SmoothQuant and batch-norm folding must leave the float model's function alone: largest output change allowed,
# relative to the output's largest magnitude (float32 rounding of the rescaled weights stays near 1e-6)
SMOOTH_TOLERANCE = 1e-3
# why a folded scale changed the float model, and what to do (the mappings may be the recipe's own)
MISFIT = ("something besides the balance layers reads the smoothed module's output (a mixture-of-experts router?), "
          "or a layer between them is not linear: give {key}.mappings pairing a module with every layer that reads "
          "its output")

__all__ = ["calibrate", "CalibrationResult"]

# progress(batches_done, batches_total, samples_in_this_batch)
Progress = Optional[Callable[[int, int, int], None]]


class CalibrationResult:
    def __init__(self, unused: List[str], codes: Optional[Dict[str, torch.Tensor]] = None,
                 replaced: Optional[Dict[str, torch.Tensor]] = None, replay: Optional[Replayer] = None):
        self.unused = unused  # activation quantizers whose module never ran
        self.codes = codes or {}  # weight quantizer name -> codes chosen by a rounding algorithm (GPTQ)
        self.replaced = replaced or {}  # tensor name -> float value a transform (fold, SmoothQuant) gave it
        self.replay = replay  # how the activation pass was replayed as CUDA graphs (.graphs), None where it was not


def calibrate(
    model: nn.Module,
    plan: Plan,
    quantizers: Dict[str, QuantizerBase],
    data: Optional[CalibrationData],
    device: torch.device,
    progress: Progress = None,
    group: Optional[Group] = None,
    precision: str = "highest",
) -> CalibrationResult:
    """Weights from the weights themselves, then activations from the data (AIMET's order and semantics).

    Weight rows that need their layer's inputs (GPTQ, activation-weighted search) first get them from one pass of
    the float model (every quantizer off); GPTQ then writes its codes into the weights before the activations
    calibrate, so activation ranges are those of the model that will be exported. A range that is not finite is
    refused where its entry is made (``EncodingEntry.from_quantizer``), as in every mode.

    With a distributed ``group`` this rank runs its shard of the batches and the ranks combine their statistics
    (:mod:`.collective`); activation ranges are then set on rank 0 only. ``precision``: the model's float32
    products in the data passes (:mod:`qtool.quant.precision`)."""
    group = group or Group()
    modules = dict(model.named_modules())
    acts = plan.static_activations  # dynamic ones compute their range at run time
    inputs = [q for q in plan.weights if q.needs_inputs]
    if (acts or inputs or plan.folds or plan.smoothing or plan.awq) and (data is None or len(data) == 0):
        raise DataError("the recipe quantizes activations, chooses weights from data or changes the float model "
                        "from data, which needs calibration data: pass --data")

    local = shard(data, group)

    def run(feed: Optional[Callable[[Batch], None]] = None):
        for i, batch in enumerate(local):
            b = batch.to(device) if feed is None else batch
            where = batch_where(local.source, "calibration", local.first + i + 1)
            with model_matmuls(precision), model_takes(model, b, where):
                if feed is None:
                    model(*b.args, **b.kwargs)
                else:
                    feed(batch)
            if progress:
                progress(i + 1, len(local), b.size)

    replaced = {}
    if plan.rotation is not None:
        set_quantization(model, False)
        try:
            replaced.update(_rotate(model, plan, data, device))
        finally:
            set_quantization(model, True)
    if plan.folds:
        set_quantization(model, False)
        try:
            replaced.update(_fold(model, plan, modules, data, device))
        finally:
            set_quantization(model, True)
    if plan.smoothing:
        set_quantization(model, False)
        try:
            replaced.update(_smooth(model, plan, modules, data, device, run, group))
        finally:
            set_quantization(model, True)
    if plan.awq is not None:
        set_quantization(model, False)
        try:
            replaced.update(_awq(model, plan, modules, data, device, run, group))
        finally:
            set_quantization(model, True)
    stats = {}
    if inputs:
        set_quantization(model, False)
        try:
            stats = merge_inputs(collect_inputs(inputs, modules, run), group)
            routed_fallbacks(inputs, modules, stats, plan.warnings, plan.expert_tokens)
        finally:
            set_quantization(model, True)
    def weight_of(q):
        return modules[q.module]._parameters["weight"]

    sizes = {q.name: weight_of(q).numel() for q in plan.weights}
    calibrate_weights_split(plan.weights, sizes, lambda q: quantizers[q.name], weight_of, group,
                            importance_for=lambda q: importance(q, stats, weight_of(q).shape, plan.importances))
    codes = round_weights(inputs, modules, quantizers, stats, plan.warnings, group=group)
    unused, replay = [], None
    if acts:
        replay = replayer(model, acts, quantizers, device, group, list(local))  # a GPU's pass as a CUDA graph
        calibrate_activations_dp(acts, quantizers, run if replay is None else lambda: run(replay.feed), group)
        unused = [q.name for q in acts if not quantizers[q.name].is_initialized()]
    return CalibrationResult(unused, codes, replaced, replay)


def _output(model: nn.Module, batch) -> torch.Tensor:
    """The model's (first) output on ``batch``, detached: what the float-equivalence checks compare."""
    return first_tensor(model(*batch.args, **batch.kwargs)).detach()


def _relative_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """The largest change of a float output, relative to its largest magnitude (compared to SMOOTH_TOLERANCE)."""
    return float((after - before).abs().max() / before.abs().max().clamp(min=1e-12))


@torch.no_grad()
def _fold(model: nn.Module, plan: Plan, modules, data: CalibrationData, device) -> Dict[str, torch.Tensor]:
    """Batch-norm folding on the float model: the plan's candidates checked on the first batch (a norm that does
    not take its convolution's output as is stays, with a plan warning), folded, and the float outputs on that
    batch compared with what they were."""
    first = data.batches[0].to(device)
    outputs = []  # the pairs are checked on the same call that gives the outputs before folding
    confirmed, refused = adjacent_pairs(plan.folds, modules,
                                        lambda: outputs.append(model(*first.args, **first.kwargs)))
    before = first_tensor(outputs[0]).detach()
    for f in refused:
        plan.warnings.append(f"fold_batch_norms: {f.bn} does not take {f.conv}'s output as its input; not folded")
    plan.folds = confirmed
    replaced: Dict[str, torch.Tensor] = {}
    for f in confirmed:
        try:
            replaced.update(fold_batch_norm(modules[f.conv], modules[f.bn], f.conv, f.bn))
        except ValueError as e:
            raise UsageError(f"fold_batch_norms: {e}") from None
    err = _relative_change(before, _output(model, first))
    if not err <= SMOOTH_TOLERANCE:
        raise UsageError(f"fold_batch_norms: folding changed the float model's outputs (relative error {err:.2g}); "
                         "leave fold_batch_norms off for this model")
    return replaced


@torch.no_grad()
def _rotate(model: nn.Module, plan: Plan, data: Optional[CalibrationData], device) -> Dict[str, torch.Tensor]:
    """Hadamard rotations fused into the float model (qtool.calibration.rotation); with data, the float outputs on
    the first batch must stay what they were."""
    first = data.batches[0].to(device) if data is not None and len(data) else None
    before = None if first is None else _output(model, first)
    replaced = rotate(model, plan.rotation)
    if first is not None:
        err = _relative_change(before, _output(model, first))
        if not err <= SMOOTH_TOLERANCE:
            raise UsageError(f"rotate: the rotations changed the float model's outputs (relative error {err:.2g}); "
                             "this model is not one qtool can rotate exactly")
    return replaced


@torch.no_grad()
def _awq(model: nn.Module, plan: Plan, modules, data: CalibrationData, device, run,
         group: Group) -> Dict[str, torch.Tensor]:
    """AWQ on the float model (qtool.calibration.awq): each group's input statistics over the data (every rank's
    summed), its scales searched against the balance layers' quantized outputs and folded in; the float model's
    outputs on the first batch must stay what they were."""
    from .awq import apply_awq, output_objective, scored_inputs

    outputs = plan.awq.objective == "outputs"
    stats = merge_inputs(collect_module_inputs(scored_inputs(plan.awq.groups, modules, hessian=not outputs),
                                               modules, run), group)
    first = data.batches[0].to(device)
    before = _output(model, first)
    rows = {q.module: q for q in plan.weights}
    batches = [lambda b=b: _output(model, b.to(device)) for b in shard(data, group)]
    replaced = apply_awq(plan.awq, modules, stats, rows, plan.warnings,
                         (lambda g: output_objective(g, modules, batches, group)) if outputs else None)
    err = _relative_change(before, _output(model, first))
    if not err <= SMOOTH_TOLERANCE:
        raise UsageError(f"awq: folding the scales changes the float model's outputs (relative error {err:.2g}); "
                         f"a mapping does not fit this model: {MISFIT.format(key='awq')}")
    return replaced


@torch.no_grad()
def _smooth(model: nn.Module, plan: Plan, modules, data: CalibrationData, device, run,
            group: Group) -> Dict[str, torch.Tensor]:
    """SmoothQuant on the float model: activation maxima over the data, then each mapping's groups folded in; the
    float model's outputs on the first batch must stay what they were (a mapping that is not exact for this
    architecture, e.g. a nonlinearity between up_proj and down_proj, is refused)."""
    amax = merge_absmax(activation_absmax(plan.smoothing, modules, run), group)
    missing = [g.smooth for g in plan.smoothing if g.smooth not in amax]
    if missing:
        raise DataError(f"smoothquant: the calibration data never reached the layers after {missing[0]}")
    first = data.batches[0].to(device)
    before = _output(model, first)
    replaced: Dict[str, torch.Tensor] = {}
    for mapping in sorted({g.mapping for g in plan.smoothing}):
        for g in (g for g in plan.smoothing if g.mapping == mapping):
            replaced.update(smooth(g, modules, amax[g.smooth]))
        after = _output(model, first)
        err = _relative_change(before, after)
        if not err <= SMOOTH_TOLERANCE:
            g = next(g for g in plan.smoothing if g.mapping == mapping)
            named = ", ".join(g.balance[:4]) + (f" and {len(g.balance) - 4} more" if len(g.balance) > 4 else "")
            raise UsageError(f"smoothquant: folding scales from {g.smooth} into {named} changes the "
                             f"float model's outputs (relative error {err:.2g}); this mapping does not fit this "
                             f"model: {MISFIT.format(key='smoothquant')}")
        before = after
    return replaced
