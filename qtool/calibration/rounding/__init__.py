"""Weights chosen from data: each layer's input statistics, and the rounding algorithms that use them.

:class:`InputStatistics` is what one layer's inputs leave behind over the calibration data: the token count, the
per-channel sum of ``x²`` (an activation-weighted search's importance, ``E[x²]``) and, for GPTQ, ``XᵀX``.
Statistics of two data shards merge by addition (float64 sums: exact unless values span ~2^29).

:func:`collect_inputs` gathers them with forward pre-hooks while the caller runs the data (modules in sorted
name order); :func:`round_weights` turns them into GPTQ codes for the rows that ask for it and writes the
dequantized codes back into the layer's weight, so the fake-quant model, its outputs to later layers and
``qtool report`` all see exactly the codes that go to the files.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional

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
from .conv import CONV_TYPES, ConvCall, capture_conv_input, flat_weight, patch_rows
from .adaround import adaround_codes
from .gptq import expand_encoding, gptq_codes

GPTQ_LAYERS_PER_RANK = 4  # layers each rank rounds per window (Group.windows)

__all__ = ["InputStatistics", "collect_inputs", "collect_module_inputs", "round_weights", "importance", "gptq_codes",
           "adaround_codes", "routed_fallbacks"]


@dataclass(frozen=True, eq=False)
class InputStatistics:
    """A layer's inputs over the calibration data: ``count`` input rows (tokens; a convolution's output
    positions), ``sq`` = ``sum x²`` per input column, and ``xtx`` = ``sum x xᵀ`` (or None where no algorithm asked
    for it). A Linear's columns are its input features: ``sq`` ``(in,)``, ``xtx`` ``(in, in)``. A convolution's are
    its patches (qtool.calibration.rounding.conv), per group: ``sq`` ``(groups · in/groups·prod(kernel),)`` and
    ``xtx`` ``(groups, d, d)``. Sums in float64 (each batch's in float32), so shards summed in any grouping give
    the same float32 values."""

    count: int
    sq: torch.Tensor
    xtx: Optional[torch.Tensor] = None
    groups: int = 0  # 0: a Linear layer; else a convolution with this many groups

    @staticmethod
    def merge(a: "InputStatistics", b: "InputStatistics") -> "InputStatistics":
        """The statistics of both shards' inputs (sums add; ``a`` first, so a fixed order gives fixed bytes)."""
        if (a.xtx is None) != (b.xtx is None) or a.sq.shape != b.sq.shape or a.groups != b.groups:
            raise ValueError("input statistics of different layers or kinds cannot be merged")
        return InputStatistics(a.count + b.count, a.sq + b.sq.to(a.sq.device),
                               None if a.xtx is None else a.xtx + b.xtx.to(a.xtx.device), a.groups)

    def mean_square(self) -> torch.Tensor:
        """``E[x²]`` per input column (float32)."""
        return (self.sq / max(self.count, 1)).to(torch.float32)

    def hessian(self) -> torch.Tensor:
        """``sum x xᵀ`` (float32): ``(in, in)``, or ``(groups, d, d)`` for a convolution."""
        return self.xtx.to(torch.float32)

    def importance(self, weight_shape) -> torch.Tensor:
        """``E[x²]`` of the input each weight value multiplies, broadcastable to the weight: ``(1, in)`` for a
        Linear; the weight's own shape for a convolution (each group reads its own channels)."""
        ms = self.mean_square()
        if not self.groups:
            return ms[None, :]
        out = int(weight_shape[0])
        per_group = ms.reshape(self.groups, 1, -1).expand(self.groups, out // self.groups, ms.numel() // self.groups)
        return per_group.reshape(tuple(weight_shape))


def _batch_sums(rows: torch.Tensor, hessian: bool):
    """``(n, sum x² (groups·d,), sum x xᵀ (groups, d, d) or None)`` of one batch's ``rows`` ``(n, groups, d)``,
    in float32."""
    n, g, d = rows.shape
    xtx = None
    if hessian:
        xtx = torch.einsum("ngi,ngj->gij", rows, rows) if g > 1 else _gram(rows[:, 0])[None]
    return n, rows.square().sum(dim=0).reshape(-1), xtx


_PANEL = 192


def _gram(x: torch.Tensor) -> torch.Tensor:
    """``xᵀx`` of ``x`` ``(n, d)``, a panel of columns at a time, each only against the columns from its own on;
    the lower triangle is the mirror (xᵀx is symmetric). Each value is the same dot product over the ``n`` rows as
    in the one whole matmul (measured: the same bits, tokens 1-8192, widths 385-4096), with ~40 % fewer
    multiply-adds where it matters (a 1536-wide input over 2048 tokens: 67 -> 47 ms)."""
    d = x.shape[1]
    if d <= 2 * _PANEL:
        return x.T @ x
    out = torch.empty(d, d, dtype=x.dtype, device=x.device)
    count = -(-d // _PANEL)  # equal panels: no narrow last one (a one-column product is a dot, summed otherwise)
    for i in range(count):
        a, b = d * i // count, d * (i + 1) // count
        panel = x[:, a:b].T @ x[:, a:]
        out[a:b, a:] = panel
        out[b:, a:b] = panel[:, b - a:].T
    return out


class _SharedInput:
    """The last Linear input's batch sums, reused by the next layers that read the very same tensor (q/k/v_proj,
    gate/up_proj): one ``XᵀX`` per input, not one per layer, with the same float32 values."""

    def __init__(self):
        self.x: Optional[torch.Tensor] = None
        self.sums = None

    def sums_of(self, x: torch.Tensor, hessian: bool):
        if self.x is not x or (hessian and self.sums[2] is None):
            rows = x.detach().as_subclass(torch.Tensor).reshape(-1, 1, x.shape[-1]).to(torch.float32)
            self.x, self.sums = x, _batch_sums(rows, hessian)
        n, sq, xtx = self.sums
        return n, sq, xtx if hessian else None


class _Collector:
    def __init__(self, hessian: bool, shared: Optional[_SharedInput] = None):
        self.hessian = hessian
        self.shared = shared or _SharedInput()
        self.count = 0
        self.groups = 0
        self.sq: Optional[torch.Tensor] = None
        self.xtx: Optional[torch.Tensor] = None

    def __call__(self, module: nn.Module, args, kwargs) -> None:
        """A Linear's forward pre-hook."""
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return
        self._add(*self.shared.sums_of(x, self.hessian))

    def conv(self, call: ConvCall) -> None:
        """A convolution op's input (captured inside its module's forward)."""
        if not call.x.is_floating_point():
            return
        self.groups = call.groups
        for rows in patch_rows(call):
            self._add(*_batch_sums(rows, self.hessian))

    def _add(self, n: int, sq: torch.Tensor, xtx: Optional[torch.Tensor]) -> None:
        if self.sq is None:
            self.sq = torch.zeros(sq.shape, dtype=torch.float64, device=sq.device)
            if self.hessian:
                self.xtx = torch.zeros(xtx.shape, dtype=torch.float64, device=sq.device)
        self.count += n
        # each batch's sums in float32, accumulated in float64: adding float32 numbers in float64 is exact unless
        # they span ~2^29 in magnitude, so the total hardly ever depends on how batches are grouped (shards)
        self.sq += sq
        if self.hessian:
            self.xtx += xtx

    def statistics(self) -> Optional[InputStatistics]:
        if self.sq is None:
            return None
        xtx = self.xtx if self.xtx is None or self.groups else self.xtx[0]
        return InputStatistics(self.count, self.sq, xtx, self.groups)


def collect_inputs(rows: Iterable[QuantizerPlan], modules: Dict[str, nn.Module],
                   run: Callable[[], None]) -> Dict[str, InputStatistics]:
    """Input statistics of the layers of ``rows`` that need them (``needs_inputs``), by module name, while
    ``run()`` feeds the data; ``XᵀX`` only where a rounding algorithm asks for it. Empty without running when no
    row needs inputs; a module that never ran is absent from the result."""
    from ...model.experts import same_inputs

    hessian: Dict[str, bool] = {}
    for q in rows:
        if q.needs_inputs:
            hessian[q.module] = hessian.get(q.module, False) or q.rounding != "nearest"
    return collect_module_inputs(hessian, modules, run, same_inputs(modules, hessian))


def collect_module_inputs(hessian: Dict[str, bool], modules: Dict[str, nn.Module],
                          run: Callable[[], None], aliases: Optional[Dict[str, str]] = None
                          ) -> Dict[str, InputStatistics]:
    """Input statistics of the modules named in ``hessian`` (``XᵀX`` too where its value is True), by module
    name, while ``run()`` feeds the data. Empty without running for an empty ``hessian``. ``aliases`` maps a
    module to another that always reads the very same input tensor: it gets that one's statistics (the same
    object), collected once."""
    if not hessian:
        return {}
    aliases = {a: b for a, b in (aliases or {}).items() if b in hessian and a != b}
    hessian = dict(hessian)
    for a, b in aliases.items():
        hessian[b] = hessian[b] or hessian[a]
    shared = _SharedInput()
    collectors = {name: _Collector(hessian[name], shared) for name in sorted(hessian) if name not in aliases}
    with contextlib.ExitStack() as stack:
        for name, c in collectors.items():
            if isinstance(modules[name], CONV_TYPES):
                stack.enter_context(capture_conv_input(modules[name], c.conv))
            else:
                stack.callback(modules[name].register_forward_pre_hook(c, with_kwargs=True).remove)
        with torch.no_grad():
            run()
    out = {name: s for name, c in collectors.items() if (s := c.statistics()) is not None}
    out.update({a: out[b] for a, b in aliases.items() if b in out})
    return out


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
    hessians = {r.module for r in rows if r.rounding != "nearest"}
    seen: Dict[str, int] = {}
    short: List[str] = []
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
        if expert not in short:
            short.append(expert)
    if short and warnings is not None:
        named = ", ".join(short[:4]) + (f" and {len(short) - 4} more" if len(short) > 4 else "")
        warnings.append(f"{len(short)} expert(s) saw fewer calibration tokens than a layer's input width: {named}; "
                        "those layers' weights were chosen without data (round-to-nearest on an unweighted range; "
                        "more or longer calibration samples reach more experts, --all-experts shows every expert "
                        "every token)")


def importance(q: QuantizerPlan, stats: Dict[str, InputStatistics], weight_shape,
               imported: Optional[Dict[str, InputStatistics]] = None) -> Optional[torch.Tensor]:
    """The weight's per-value importance for an activation-weighted search (``E[x²]`` of the input each value
    multiplies, broadcastable to ``weight_shape``), or None where the row's search is unweighted. A row marked
    ``imatrix`` takes it from ``imported`` (an importance matrix file: ``Plan.importances``)."""
    if dict(q.analyzer_args).get("weighting") != "activations":
        return None
    s = (imported or {}).get(q.module) if q.imatrix else stats.get(q.module)
    if s is None:
        raise DataError(f"{q.module} never ran on the calibration data: no input statistics to weight "
                         f"{q.name}'s search")
    imp = s.importance(weight_shape)
    if not bool(torch.isfinite(imp).all()):  # (an imported matrix is checked by its reader)
        raise DataError(f"{q.name}: its layer's inputs hold NaN/Inf or values past float32's range on the "
                        "calibration data (an earlier weight of the checkpoint, or the data, holds NaN/Inf or values "
                        "near float32's limits); nothing was written")
    return imp


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
        if q.rounding == "nearest":
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
    Hessian's factors)."""
    weights = [modules[q.module]._parameters["weight"] for q in unit]
    cols = int(weights[0].shape[-1])
    return 48 * sum(w.numel() for w in weights) + 16 * cols * cols


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
    grid = (lambda qz: (type(qz), qz.qmin, qz.qmax, getattr(qz, "element", None), getattr(qz, "ggml", None)))
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
    element = getattr(quantizer, "element", None) or getattr(quantizer, "ggml", None)
    if element is not None:
        args["element"] = element
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
    if algorithm is gptq_codes:
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
    element = getattr(quantizer, "element", None)
    with torch.no_grad():
        if getattr(quantizer, "ggml", None) is not None:
            w.copy_(ggml.dequantize(codes.to(w.device, torch.int32), quantizer.grid()).to(w.dtype))
            return
        if element is not None:
            w.copy_(float_dequantize(codes.to(w.device), scale.to(w.device), element, q.block_size).to(w.dtype))
            return
        w.copy_(dequantize(codes.to(w.device, torch.float32), scale.to(w.device), offset.to(w.device),
                           block_size=q.block_size).to(w.dtype))


def _wire_dtype(quantizer: QuantizerBase) -> torch.dtype:
    for dt in (torch.int8, torch.uint8, torch.int16, torch.int32):
        info = torch.iinfo(dt)
        if info.min <= quantizer.qmin and quantizer.qmax <= info.max:
            return dt
    return torch.int64
