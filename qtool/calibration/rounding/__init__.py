"""Weights chosen from data: the rounding algorithms (GPTQ, AdaRound) scheduled over a model's layers.

The layers' input statistics come from :mod:`.statistics` (:func:`collect_inputs`); :func:`round_weights` turns
them into codes for the rows that ask for it (a shared ``XᵀX`` solved once, layers spread over ranks, memory
bounded) and writes the dequantized codes back into the layer's weight, so the fake-quant model, its outputs to
later layers and ``qtool report`` all see exactly the codes that go to the files.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch
from torch import nn

from ...config import QuantizerPlan
from ...errors import CheckpointError, DataError
from ...hooks import step
from ...quant import QuantizerBase
from ...parallel import Group, assign
from ...quant.affine import dequantize
from ...quant import ggml
from ...quant.floatgrid import float_dequantize
from ..heap import return_freed_memory
from .conv import flat_weight
from .adaround import adaround_codes
from .gptq import expand_encoding, gptq_codes
from .signround import learned_layer, signround_block
from .statistics import InputStatistics, collect_inputs, collect_module_inputs, importance

GPTQ_LAYERS_PER_RANK = 4  # layers each rank rounds per window (Group.windows)

__all__ = ["InputStatistics", "collect_inputs", "collect_module_inputs", "round_weights", "importance", "gptq_codes",
           "adaround_codes", "routed_fallbacks", "learn_rounding"]


def routed_fallbacks(rows: Iterable[QuantizerPlan], modules: Dict[str, nn.Module],
                     stats: Dict[str, InputStatistics], warnings: Optional[List[str]] = None,
                     tokens: Optional[Dict[str, int]] = None) -> None:
    """Give every mixture-of-experts expert layer (``qtool.model.experts``) among ``rows`` that needs inputs and
    was routed fewer calibration tokens than its input width data-free statistics instead (``E[x²]`` = 1 and
    ``XᵀX`` = I: the unweighted search, and GPTQ that reduces to round-to-nearest), with one warning naming
    them. Fewer tokens than columns leave ``XᵀX`` singular: GPTQ would fit those few tokens, not the expert's
    inputs. ``stats`` is changed in place (after the ranks' statistics are merged). ``tokens`` receives the tokens
    each expert was routed, by expert module name."""
    from ...model.experts import routing_of

    rows = list(rows)
    hessians = {r.module for r in rows if r.rounds_layerwise}
    seen: Dict[str, int] = {}
    short: List[str] = []
    learned: List[str] = []  # signround learns on the block's outputs: an expert's few tokens still move its codes
    for q in rows:
        if not q.needs_inputs or q.module in seen or routing_of(modules, q.module) is None:
            continue
        s = stats.get(q.module)
        seen[q.module] = count = 0 if s is None else s.count
        if tokens is not None:
            tokens[q.module.rsplit(".", 1)[0]] = count
        width = int(modules[q.module].weight.shape[1])
        if count >= width:
            continue
        device = modules[q.module].weight.device
        stats[q.module] = InputStatistics(0, torch.ones(width, dtype=torch.float64, device=device),
                                          torch.eye(width, dtype=torch.float64, device=device)
                                          if q.module in hessians else None)
        expert = f"{q.module.rsplit('.', 1)[0]} ({count} token{'' if count == 1 else 's'})"
        into = learned if q.rounding == "signround" and count > 0 else short
        if expert not in into:
            into.append(expert)
    for experts, what in (
            (learned, "those layers' ranges were searched without their inputs' importances, and signround learned "
                      "their rounding from those few tokens alone ("),
            (short, "those layers' weights were chosen without data (round-to-nearest on their analyzer's range, "
                    "without their inputs' importances; ")):
        if experts and warnings is not None:
            named = ", ".join(experts[:4]) + (f" and {len(experts) - 4} more" if len(experts) > 4 else "")
            warnings.append(f"{len(experts)} expert(s) saw fewer calibration tokens than a layer's input width: "
                            f"{named}; {what}more or longer calibration samples reach more experts, --all-experts "
                            "shows every expert every token)")


def round_weights(rows: List[QuantizerPlan], modules: Dict[str, nn.Module], quantizers: Dict[str, QuantizerBase],
                  stats: Dict[str, InputStatistics], warnings: Optional[List[str]] = None,
                  tied: Iterable[str] = (), group: Optional[Group] = None) -> Dict[str, torch.Tensor]:
    """Codes for every row whose ``rounding`` is not nearest (GPTQ, AdaRound), on the grid its quantizer was
    calibrated to.

    Each layer's weight is overwritten with its dequantized codes (which round to exactly those codes again), so
    anything that runs the model afterwards (activation calibration, later blocks, reports) sees the chosen
    weights. A weight shared with another module (tied embeddings) keeps round-to-nearest, with a warning:
    changing it would change the other module too; ``tied`` names modules whose weight is tied in the checkpoint
    though the caller loaded a separate copy. With a distributed ``group`` each layer is rounded by one rank
    (chosen by size) and its codes go to every rank. Returns quantizer name -> integer codes (CPU, in the
    smallest type that holds them). ``stats`` is consumed: a rounded layer's entry is removed when its Hessian
    is taken, so its float64 sums are gone before the algorithm's temporaries are made."""
    group = group or Group()
    tied = set(tied)
    shared: Dict[int, int] = {}
    for m in modules.values():
        for p in m.parameters(recurse=False):
            shared[id(p)] = shared.get(id(p), 0) + 1
    todo: List[QuantizerPlan] = []
    for q in rows:
        if not q.rounds_layerwise:  # nearest; signround learns per block (learn_rounding)
            continue
        w = modules[q.module]._parameters["weight"]
        if shared.get(id(w), 0) > 1 or q.module in tied:
            if warnings is not None:
                warnings.append(f"{q.name}: shared with another module (tied weights); rounded to nearest, "
                                f"not {q.rounding}")
            continue
        s = stats.get(q.module)
        if s is None or s.xtx is None:
            raise DataError(f"{q.module} never ran on the calibration data: {q.rounding} has no inputs for it")
        todo.append(q)
    out: Dict[str, torch.Tensor] = {}
    units = _shared_problems(todo, modules, quantizers, stats)
    for window in group.windows(units, GPTQ_LAYERS_PER_RANK):
        owners = assign([sum(modules[q.module]._parameters["weight"].numel() for q in unit) for unit in window],
                        group.world_size)
        mine = {}
        owned = [window[j] for j in group.owned(owners)]
        for unit, (codes, notes) in zip(owned, _round_units(owned, modules, quantizers, stats)):
            mine.update((q.name, c) for q, c in zip(unit, codes))
            if warnings is not None:
                warnings.extend(notes)
        if group.distributed:  # codes travel in the smallest integer type that holds the grid
            sent = group.all_gather(dict(sorted(mine.items())))
            mine = {q.name: sent[o][q.name] for unit, o in zip(window, owners) for q in unit}
        for q in (q for unit in window for q in unit):
            _write_back(q, modules, quantizers[q.name], mine[q.name])
            out[q.name] = mine[q.name].cpu()
    return out


CONCURRENT_BYTES = 256 << 20  # a GPTQ problem whose temporaries stay below this may run beside another one
# layers that read one input stack into one problem while its temporaries stay below this: stacking saves
# per-column overhead, which matters for small layers, and must not raise the peak a large model's block sets
# (measured at 1.1B: gate/up stacked, 2 x 11.5M weights, raised the peak from 2.75 to 3.45 GB)
STACK_BYTES = 512 << 20


def _round_units(units: List[List[QuantizerPlan]], modules, quantizers, stats):
    """Each unit's codes (one tensor per row, in the grid's smallest integer type: not int64's 8 B per weight)
    and warnings, in order. On the CPU, small problems run two (or the thread budget) at a time, one thread
    each: their column loops are chains of small steps that leave a second core idle (SmolLM2's block: 0.74 ->
    0.54 s); large ones (their temporaries above ``CONCURRENT_BYTES``) run alone with every thread, so peak
    memory stays one problem's."""

    def one(unit):
        notes: List[str] = []
        codes = [_codes(unit[0], modules, quantizers, stats, notes)] if len(unit) == 1 else \
            _shared_codes(unit, modules, quantizers, stats, notes)
        return [c.to(_wire_dtype(quantizers[q.name])) for q, c in zip(unit, codes)], notes

    results: List = [None] * len(units)
    small = [i for i, u in enumerate(units) if _runs_beside(u, modules)]
    what = f"choosing codes ({'/'.join(sorted({q.rounding for unit in units for q in unit}))})"
    total, done = sum(len(u) for u in units), 0

    def finished(i: int) -> None:
        nonlocal done
        done += len(units[i])
        step(what, done, total, units[i][-1].name)

    if units:
        step(what, 0, total, units[0][0].name)
    for i, unit in enumerate(units):
        if i not in small:
            results[i] = one(unit)
            finished(i)
            return_freed_memory(collect=False)  # a layer's GPTQ temporaries: hundreds of MB at 8B widths
    threads = torch.get_num_threads()
    if len(small) > 1 and threads > 1:
        from concurrent.futures import ThreadPoolExecutor

        torch.set_num_threads(1)  # each problem one thread: the same bits (the steps are one-thread sized)
        try:
            with ThreadPoolExecutor(min(threads, len(small))) as pool:
                for i, r in zip(small, pool.map(lambda i: one(units[i]), small)):
                    results[i] = r
                    finished(i)
        finally:
            torch.set_num_threads(threads)
    else:
        for i in small:
            results[i] = one(units[i])
            finished(i)
    return results


def _runs_beside(unit: List[QuantizerPlan], modules) -> bool:
    """Whether ``unit`` may run beside another problem: GPTQ on the CPU with small temporaries."""
    weight = modules[unit[0].module]._parameters["weight"]
    return weight.device.type == "cpu" and unit[0].rounding == "gptq" and \
        _temporary_bytes(unit, modules) <= CONCURRENT_BYTES


def _temporary_bytes(unit: List[QuantizerPlan], modules) -> int:
    """About what GPTQ allocates for ``unit`` (float32 weight copies, grids, codes, float64 row errors, the
    Hessian's factors; ``bounded``'s two-byte limits)."""
    weights = [modules[q.module]._parameters["weight"] for q in unit]
    cols = int(weights[0].shape[-1])
    per_value = 52 if dict(unit[0].rounding_args).get("bounded") else 48
    return per_value * sum(w.numel() for w in weights) + 16 * cols * cols


def _shared_problems(rows: List[QuantizerPlan], modules, quantizers, stats) -> List[List[QuantizerPlan]]:
    """``rows`` as GPTQ problems: layers that read the same input (q/k/v_proj, gate/up_proj: equal ``XᵀX``) on the
    same kind of grid are one problem with their weights' rows stacked (up to ``STACK_BYTES`` of temporaries).
    GPTQ treats rows independently given the Hessian, so each layer's codes are bit for bit its own run's, and
    the column loop runs once, not per layer."""
    units: List[List[QuantizerPlan]] = []
    for q in rows:
        for unit in units:
            if _same_problem(unit[0], q, modules, quantizers, stats) and \
                    _temporary_bytes(unit + [q], modules) <= STACK_BYTES:
                unit.append(q)
                break
        else:
            units.append([q])
    return units


def _same_problem(a: QuantizerPlan, b: QuantizerPlan, modules, quantizers, stats) -> bool:
    if a.rounding != "gptq" or b.rounding != "gptq" or a.rounding_args != b.rounding_args:
        return False
    sa, sb = stats[a.module], stats[b.module]
    if sa.groups or sb.groups or sa.xtx.shape != sb.xtx.shape:
        return False
    qa, qb = quantizers[a.name], quantizers[b.name]
    wa, wb = modules[a.module]._parameters["weight"], modules[b.module]._parameters["weight"]
    grid = (lambda qz: (type(qz), qz.qmin, qz.qmax, qz.spec.element, qz.spec.ggml))
    return (grid(qa) == grid(qb) and wa.device == wb.device and wa.dim() == wb.dim() == 2
            and (sa is sb or torch.equal(sa.xtx, sb.xtx)))


def _shared_codes(unit: List[QuantizerPlan], modules, quantizers, stats, warnings: List[str]) -> List[torch.Tensor]:
    """The codes of each layer of ``unit`` (see :func:`_shared_problems`), from one GPTQ run on their stacked rows
    with each row's own scale and offset; what GPTQ had to change goes to ``warnings`` for each layer."""
    weights, scales, offsets = [], [], []
    for q in unit:
        weight = modules[q.module]._parameters["weight"].detach()
        scale, offset = _grid(q, quantizers[q.name])
        weights.append(weight)
        scales.append(expand_encoding(scale.to(weight.device, torch.float32), weight.shape, q.block_size))
        offsets.append(expand_encoding(offset.to(weight.device, torch.float32), weight.shape, q.block_size))
    quantizer = quantizers[unit[0].name]
    notes: List[str] = []
    hessian = _take_hessian(stats, unit)
    try:
        codes = gptq_codes(torch.cat(weights)[None], hessian[None], torch.cat(scales)[None],
                           torch.cat(offsets)[None], quantizer.qmin, quantizer.qmax, notes=notes,
                           **_algorithm_args(unit[0], quantizer))[0].cpu()
    except ValueError as e:
        raise DataError(f"{', '.join(q.name for q in unit)}: {e}") from None
    warnings.extend(f"{q.name}: {note}" for note in notes for q in unit)
    return list(codes.split([w.shape[0] for w in weights]))


def _take_hessian(stats: Dict[str, InputStatistics], unit: List[QuantizerPlan]) -> torch.Tensor:
    """The float32 Hessian of ``unit``'s layers (they share one input), their statistics removed from ``stats``:
    each layer is rounded once, and its float64 sums (0.25 GB for a 5632-wide input) would otherwise stay beside
    the algorithm's own temporaries at the peak."""
    hessian = stats[unit[0].module].hessian()
    for q in unit:
        stats.pop(q.module, None)
    return hessian


def _grid(q: QuantizerPlan, quantizer: QuantizerBase):
    try:
        return quantizer.get_scale().detach(), quantizer.get_offset().detach()
    except ValueError as e:  # a GGUF grid whose scales float16 cannot hold
        raise CheckpointError(f"{q.name}: {e}; nothing was written") from None


def _algorithm_args(q: QuantizerPlan, quantizer: QuantizerBase) -> Dict:
    """The recipe's rounding arguments, and the grid's element when it is a float or GGUF one (GPTQ only: the
    recipe refuses AdaRound there)."""
    args = dict(q.rounding_args)
    if quantizer.spec.element_grid is not None:
        args["element"] = quantizer.spec.element_grid
    return args


def _codes(q: QuantizerPlan, modules, quantizers, stats, warnings: List[str]) -> torch.Tensor:
    """``q``'s codes; what the algorithm had to change to find them (GPTQ's dampening) goes to ``warnings``."""
    quantizer = quantizers[q.name]
    weight = modules[q.module]._parameters["weight"].detach()
    scale, offset = _grid(q, quantizer)
    groups = stats[q.module].groups
    hessian = _take_hessian(stats, [q])
    args = _algorithm_args(q, quantizer)
    algorithm = adaround_codes if q.rounding == "adaround" else gptq_codes
    notes: List[str] = []
    args["notes"] = notes
    try:
        if not groups:
            codes = algorithm(weight, hessian, scale, offset, quantizer.qmin, quantizer.qmax, q.block_size,
                              **args).cpu()
        else:  # a convolution: one problem per group, on the group's rows (flattened kernels) and its patch Hessian
            rows = flat_weight(weight, groups)
            grid = [flat_weight(expand_encoding(t.to(weight.device), weight.shape, q.block_size), groups)
                    for t in (scale, offset)]
            codes = algorithm(rows, hessian, grid[0], grid[1], quantizer.qmin, quantizer.qmax, **args)
            codes = codes.reshape(weight.shape).cpu()
    except ValueError as e:
        raise DataError(f"{q.name}: {e}") from None
    warnings.extend(f"{q.name}: {note}" for note in notes)
    return codes


def _write_back(q: QuantizerPlan, modules, quantizer: QuantizerBase, codes: torch.Tensor) -> None:
    codes = codes.long()  # held in the grid's smallest type (_wire_dtype); the dequantizers index with int64
    w = modules[q.module]._parameters["weight"]
    scale, offset = quantizer.get_scale().detach(), quantizer.get_offset().detach()
    spec = quantizer.spec
    with torch.no_grad():
        if spec.ggml is not None:
            w.copy_(ggml.dequantize(codes.to(w.device, torch.int32), quantizer.grid()).to(w.dtype))
            return
        if spec.is_float:
            w.copy_(float_dequantize(codes.to(w.device), scale.to(w.device), spec.element_grid,
                                     q.block_size).to(w.dtype))
            return
        w.copy_(dequantize(codes.to(w.device, torch.float32), scale.to(w.device), offset.to(w.device),
                           block_size=q.block_size).to(w.dtype))


def _wire_dtype(quantizer: QuantizerBase) -> torch.dtype:
    for dt in (torch.int8, torch.uint8, torch.int16, torch.int32):
        info = torch.iinfo(dt)
        if info.min <= quantizer.qmin and quantizer.qmax <= info.max:
            return dt
    return torch.int64


def learn_rounding(rows: List[QuantizerPlan], block: Optional[nn.Module], block_name: str,
                   inputs: List, modules: Dict[str, nn.Module], quantizers: Dict[str, QuantizerBase],
                   group: Optional[Group] = None, warnings: Optional[List[str]] = None,
                   records: Optional[List[Dict]] = None) -> Dict[str, torch.Tensor]:
    """Codes for ``rows`` (rounding signround) learned on decoder ``block`` over its calibration ``inputs``
    (``(args, kwargs)`` per batch, this rank's), their quantizers' ranges set to the learned ones and each
    layer's weight overwritten with its dequantized codes (as :func:`round_weights` does). Rows outside a
    decoder block (``block`` None: an embedding, ``lm_head``) stay round-to-nearest, with a warning. The block's
    record (the candidates' losses, the one chosen) goes to ``records``."""
    if not rows:
        return {}
    if block is None:
        if warnings is not None:
            warnings.append(f"{', '.join(q.name for q in rows)}: outside the decoder blocks, where signround "
                            "learns; rounded to nearest")
        return {}
    # rows of the block with other arguments (a layers: override) are a learning problem of their own, in plan
    # order; while one learns, the others compute as they stand (nearest, or what their problem chose)
    problems: Dict[tuple, List[QuantizerPlan]] = {}
    for q in rows:
        problems.setdefault(q.rounding_args, []).append(q)
    switched = [q for m in block.modules() for key, q in getattr(m, "qtool_quantizers", {}).items()
                if key != "weight" and q.enabled]
    for q in switched:  # the objective is the weights' error: activation quantizers stay off while learning
        q.enabled = False
    out: Dict[str, torch.Tensor] = {}
    try:
        for problem in problems.values():
            out.update(_learn_problem(problem, block, block_name, inputs, modules, quantizers, group,
                                      records, len(problems) > 1))
    finally:
        for q in switched:
            q.enabled = True
    return out


def _learn_problem(rows: List[QuantizerPlan], block: nn.Module, block_name: str, inputs: List,
                   modules: Dict[str, nn.Module], quantizers: Dict[str, QuantizerBase], group: Optional[Group],
                   records: Optional[List[Dict]], named: bool) -> Dict[str, torch.Tensor]:
    """:func:`learn_rounding` for rows that share their arguments; ``named``: the record lists the rows."""
    from ...model.insert import computing_with

    args = dict(rows[0].rounding_args)
    ranges = args.get("ranges", True)
    layers = [learned_layer(modules[q.module], quantizers[q.name], ranges) for q in rows]
    learned = {id(layer.module) for layer in layers}
    others = [m for m in block.modules() if "weight" in getattr(m, "qtool_quantizers", {}) and id(m) not in learned]
    try:
        record = signround_block(block, layers, inputs, computing_with, others, iterations=args.get("iterations", 200),
                                 learning_rate=args.get("learning_rate"), seed=args.get("seed", 0), group=group,
                                 what=f"learning rounding (signround, {block_name})")
    except ValueError as e:
        raise DataError(f"{block_name}: {e}") from None
    out: Dict[str, torch.Tensor] = {}
    for q, layer in zip(rows, layers):
        quantizer = quantizers[q.name]
        if layer.lo is not None:
            mn, mx = layer.range()
            quantizer.set_range(mn.detach(), mx.detach())
        out[q.name] = layer.codes().to(_wire_dtype(quantizer)).cpu()
        _write_back(q, modules, quantizer, out[q.name])
    if records is not None:
        records.append({"block": block_name, **({"rows": [q.name for q in rows]} if named else {}),
                        "chosen": record["chosen"], "losses": record["losses"], "iterations": record["iterations"],
                        "learning_rate": record["learning_rate"], "seed": record["seed"], "ranges": ranges})
    return out
