"""AWQ (activation-aware weight quantization; Lin et al., 2023): scales that move weight magnitude onto the input
channels where the activations are large, folded into the float model before the weights calibrate.

A group is a SmoothQuant-style mapping (``config.SmoothGroup``): a smooth module (a norm, or a Linear) whose
output is the one input of its balance Linears. Per input channel ``j`` a scale ``s_j`` multiplies every balance
weight's column ``j`` and divides the smooth module's output channel ``j`` (``smoothing.fold_scales``), so the
float model computes what it did; the quantization grid then lands finer where ``x_j`` is large. The scale of
ratio ``r`` is ``s = m_x^r / (m_w^(1-r) + 1e-4)`` (``duo_scaling``; ``m_x^r`` without it), clamped at 1e-4 and
divided by ``sqrt(max s · min s)``: ``m_x`` is the channel's mean magnitude over the calibration data (``E|x|``,
as AWQ's authors and llm-compressor take it; the RMS, which outliers pull up further, measured worse on
SmolLM2: docs/accuracy.md), ``m_w`` the mean over the balance rows of ``|W| / max |W|`` within each value's
quantization block. ``r`` runs over ``grid`` points spread over [0, 1] (``grid: 19`` is llm-compressor's
``n_grid=20``, whose 20th candidate is no scaling), and no scaling is a candidate too, so the chosen one is never
worse than plain rounding on the objective. Each candidate's weights are ``Q_b(W_b diag(s))
diag(s)⁻¹``: ``Q_b`` is the row's own quantizer (any grid: int, float element, GGUF type) calibrated on the
scaled weight; a search weighted by activations (``weighting: activations`` / ``activations_magnitude``) gets the
importance the scaled layer's inputs will have, ``E[x²] / s²`` from the group input's statistics, as the weights'
calibration after the fold computes it.

``objective: outputs`` (the default) scores the candidates as AWQ's authors and llm-compressor do: the squared
error of the group's parent module's output (the balance layers' lowest common ancestor: the attention for
q/k/v, the MLP for gate/up, the layer itself for a lone balance Linear) over the calibration batches, with the
balance weights quantized and the rest of the parent float. It sees what the linear objective cannot (the
softmax after q and k, the gate after gate_proj); it costs a forward of the parent per candidate and batch. Each
batch's error is a float64 sum, gathered from every rank and added in batch order, so ranks choose what one
process chooses.

``objective: layers`` scores them by the balance layers' own output error,

    sum_b tr(ΔW_b XᵀX ΔW_bᵀ),   ΔW_b = Q_b(W_b diag(s)) diag(s)⁻¹ - W_b,

exact from the group input's statistics (``rounding.statistics``: ``XᵀX`` sums, which merge by addition, so
every rank of a distributed run chooses the same scales).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..choices import weighs_activations
from ..config import AwqPlan, QuantizerPlan, SmoothGroup
from ..hooks import step
from ..model.insert import computing_with, make_quantizer
from .base import encodings_of, first_tensor
from .rounding.statistics import InputStatistics
from .smoothing import fold_scales

__all__ = ["ratio_scales", "weight_magnitude", "search_scales", "scored_inputs", "parent_name", "output_objective",
           "apply_awq"]

Objective = Callable[[Dict[str, torch.Tensor]], float]  # {balance layer: candidate weight} -> error

_EPS = 1e-4


def weight_magnitude(weights: Sequence[torch.Tensor], blocks: Sequence[Optional[int]]) -> torch.Tensor:
    """``m_w``: per input channel, the mean over every balance weight's rows of ``|W| / max |W|`` over the value's
    quantization block (``blocks[i]`` columns of a row; the whole row for ``None``), float32 ``(in,)``."""
    parts = []
    for w, block in zip(weights, blocks):
        w = w.detach().to(torch.float32).abs()
        out, n = w.shape
        b = block if block and n % block == 0 else n
        g = w.reshape(out, n // b, b)
        parts.append((g / g.amax(dim=2, keepdim=True).clamp(min=1e-12)).reshape(out, n))
    return torch.cat(parts).mean(0)


def ratio_scales(m_x: torch.Tensor, m_w: torch.Tensor, ratio: float, duo_scaling: bool = True) -> torch.Tensor:
    """The scales of one ratio ``r``: ``m_x^r / (m_w^(1-r) + 1e-4)`` (or ``m_x^r``), clamped at 1e-4 and divided
    by ``sqrt(max · min)`` so they sit around 1 (float32)."""
    s = m_x.pow(ratio) / (m_w.pow(1 - ratio) + _EPS) if duo_scaling else m_x.pow(ratio)
    s = s.clamp(min=_EPS)
    return s / (s.max() * s.min()).sqrt()


def _fake_quant(row: QuantizerPlan, weight: torch.Tensor, importance: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``weight`` through a fresh quantizer of ``row`` calibrated on it (what the row's weight calibration gives;
    ``importance``: its inputs' ``E[x²]``, broadcastable to the weight, for a search weighted by activations)."""
    quantizer = make_quantizer(row, weight.device)
    with encodings_of(row, quantizer):
        quantizer.observe(weight, importance=importance)
    return quantizer(weight).as_subclass(torch.Tensor)


def _block(row: QuantizerPlan) -> Optional[int]:
    return int(row.block_size[-1]) if row.block_size else None


@torch.no_grad()
def search_scales(group: SmoothGroup, modules: Dict[str, nn.Module], stats: InputStatistics,
                  rows: Dict[str, QuantizerPlan], grid: int, duo_scaling: bool,
                  quantize: Callable[..., torch.Tensor] = _fake_quant, objective: Optional[Objective] = None
                  ) -> Tuple[Optional[torch.Tensor], Optional[float], float, float]:
    """``(scales or None, ratio or None, error without scaling, error with them)`` of one group: the candidate
    with the least output error of the quantized balance layers (None: no scaling beats every ratio); with
    ``objective`` (:func:`output_objective`), the least error it gives for the candidate's dequantized weights."""
    quantized = [n for n in group.balance if n in rows]
    weights = {n: modules[n]._parameters["weight"].detach() for n in quantized}
    if not quantized:
        return None, None, 0.0, 0.0
    device = weights[quantized[0]].device
    h = stats.hessian().to(device) if objective is None else None
    m_x = (stats.mean_square().sqrt() if stats.absolute is None else stats.mean_absolute()).to(device)
    m_w = weight_magnitude([weights[n] for n in quantized], [_block(rows[n]) for n in quantized])
    weighted = {n for n in quantized if weighs_activations(dict(rows[n].analyzer_args).get("weighting"))}
    mean_square = stats.mean_square().to(device)[None, :] if weighted else None

    def error(s: Optional[torch.Tensor]) -> float:
        total, candidate = 0.0, {}
        for n in quantized:
            w = weights[n]
            scaled = w if s is None else w * s.to(w.dtype)  # (what fold_scales leaves in the weight)
            imp = None
            if n in weighted:  # the scaled layer's inputs are x / s
                imp = mean_square if s is None else mean_square / s.square()
            q = quantize(rows[n], scaled, imp).to(torch.float32)
            if objective is not None:
                candidate[n] = (q if s is None else q / s).to(w.dtype)
                continue
            d = (q if s is None else q / s) - w.to(torch.float32)
            total += float(((d @ h) * d).sum())
        return total if objective is None else objective(candidate)

    plain = error(None)
    best: Tuple[float, Optional[float], Optional[torch.Tensor]] = (plain, None, None)
    for i in range(grid):
        ratio = i / (grid - 1)
        s = ratio_scales(m_x, m_w, ratio, duo_scaling)
        e = error(s)
        if e < best[0]:
            best = (e, ratio, s)
    return best[2], best[1], plain, best[0]


def _feeds_routed_experts(group: SmoothGroup, modules: Dict[str, nn.Module]) -> List[str]:
    """The balance layers of ``group`` that are routed experts fed from outside their expert (a norm before a
    mixture-of-experts layer): each sees only its routed tokens, so no one ``XᵀX`` scores the group."""
    from ..model.experts import routing_of

    if routing_of(modules, group.smooth) is not None:
        return []  # an expert's own up_proj -> down_proj: one expert's tokens throughout
    return [n for n in group.balance if routing_of(modules, n) is not None]


def scored_inputs(groups: Sequence[SmoothGroup], modules: Dict[str, nn.Module],
                  hessian: bool = True) -> Dict[str, bool]:
    """The layers whose input statistics (with ``XᵀX`` where ``hessian``: the linear objective) score ``groups``:
    each searchable group's first balance layer (``rounding.statistics.collect_module_inputs``' argument)."""
    return {g.balance[0]: hessian for g in groups if not _feeds_routed_experts(g, modules)}


def parent_name(group: SmoothGroup) -> str:
    """The balance layers' lowest common ancestor (the layer itself when there is one): the module whose output
    ``objective: outputs`` compares."""
    if len(group.balance) == 1:
        return group.balance[0]
    common = []
    for level in zip(*(n.split(".") for n in group.balance)):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


_CACHES = ("past_key_values", "past_key_value", "layer_past")  # transformers' names of the KV cache argument


class _Captured(Exception):
    """Raised once the parent's inputs are recorded: the rest of the batch's forward is not needed."""


def output_objective(group: SmoothGroup, modules: Dict[str, nn.Module], batches: Sequence[Callable[[], object]],
                     ranks) -> Objective:
    """The objective of ``objective: outputs`` for ``group``: the parent module's inputs are recorded on each of
    this rank's ``batches`` (each a call that runs one batch forward, the block's or the model's, up to the
    parent's first call) and its float outputs kept; a candidate's error is ``sum (parent(x) - float)²`` over every
    rank's batches (``ranks``, a :class:`qtool.parallel.Group`), with the balance weights replaced."""
    parent = modules[parent_name(group)]
    calls = []  # (this rank's batch index, args, kwargs) of the batches that reach the parent (a routed expert's
    batch = [0]  # may not)

    def capture(module, args, kwargs):
        # a KV cache would grow with every candidate's call: the parent runs on the batch alone, as it did
        kwargs = {k: None if k in _CACHES else v for k, v in kwargs.items()}
        calls.append((batch[0], args, kwargs))
        raise _Captured

    handle = parent.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        for j, run in enumerate(batches):
            batch[0] = j
            try:
                run()
            except _Captured:
                pass
    finally:
        handle.remove()
    floats = [first_tensor(parent(*a, **k)).detach().to(torch.float32) for _, a, k in calls]

    def error(weights: Dict[str, torch.Tensor]) -> float:
        with computing_with({modules[n]: w for n, w in weights.items()}):
            local = [((ranks.rank, j), float((first_tensor(parent(*a, **k)).to(torch.float32) - ref).double()
                                             .square().sum())) for (j, a, k), ref in zip(calls, floats)]
        errors = dict(e for part in ranks.all_gather(local) for e in part)
        return sum(errors[key] for key in sorted(errors))  # in batch order: the same sum on every rank

    return error


@torch.no_grad()
def apply_awq(awq: AwqPlan, modules: Dict[str, nn.Module], stats: Dict[str, InputStatistics],
              rows: Dict[str, QuantizerPlan], warnings: List[str],
              objective_of: Optional[Callable[[SmoothGroup], Objective]] = None) -> Dict[str, torch.Tensor]:
    """Search and fold every group of ``awq`` in order (``stats`` keyed by each group's first balance layer;
    ``objective_of``: each group's :func:`output_objective` for ``objective: outputs``); returns ``{parameter
    name: new value}`` of the changed tensors and records each group in ``awq.chosen``."""
    replaced: Dict[str, torch.Tensor] = {}
    for i, g in enumerate(awq.groups):
        step("choosing scales (awq)", i, len(awq.groups), g.smooth)
        routed = _feeds_routed_experts(g, modules)
        if routed:
            warnings.append(f"awq: {g.smooth} feeds the experts of a mixture-of-experts layer ({routed[0]} ...), "
                            "each of which sees only its routed tokens; that group is not scaled")
            awq.chosen.append({"smooth": g.smooth, "balance": list(g.balance), "ratio": None,
                               "skipped": "routed experts"})
            continue
        found = stats.get(g.balance[0])
        if found is None:
            warnings.append(f"awq: the calibration data never reached {g.balance[0]}; {g.smooth}'s group is not "
                            "scaled")
            continue
        s, ratio, plain, err = search_scales(g, modules, found, rows, awq.grid, awq.duo_scaling,
                                                objective=None if objective_of is None else objective_of(g))
        awq.chosen.append({"smooth": g.smooth, "balance": list(g.balance), "ratio": ratio,
                           "error_unscaled": plain, "error": err})
        if s is not None:
            replaced.update(fold_scales(g, modules, s))
    if awq.groups:
        step("choosing scales (awq)", len(awq.groups), len(awq.groups), awq.groups[-1].smooth)
    return replaced
