"""What one layer's inputs leave behind over the calibration data (:class:`InputStatistics`): the token count,
the per-channel sum of ``x²`` (an activation-weighted search's importance, ``E[x²]``) and, for GPTQ, ``XᵀX``.
Statistics of two data shards merge by addition (float64 sums: exact unless values span ~2^29).

:func:`collect_inputs` gathers them with forward pre-hooks while the caller runs the data (modules in sorted
name order); layers that read the very same tensor (q/k/v) share one ``XᵀX``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional

import torch
from torch import nn

from ...choices import weighs_activations
from ...config import QuantizerPlan
from ...errors import DataError
from ...quant.precision import exact
from .conv import CONV_TYPES, ConvCall, capture_conv_input, patch_rows


@dataclass(frozen=True, eq=False)
class InputStatistics:
    """A layer's inputs over the calibration data: ``count`` input rows (tokens; a convolution's output
    positions), ``sq`` = ``sum x²`` and ``absolute`` = ``sum |x|`` per input column, and ``xtx`` = ``sum x xᵀ`` (or
    None where no algorithm asked for it). A Linear's columns are its input features: ``sq`` ``(in,)``, ``xtx`` ``(in, in)``. A convolution's are
    its patches (qtool.calibration.rounding.conv), per group: ``sq`` ``(groups · in/groups·prod(kernel),)`` and
    ``xtx`` ``(groups, d, d)``. Sums in float64 (each batch's in float32), so shards summed in any grouping give
    the same float32 values."""

    count: int
    sq: torch.Tensor
    xtx: Optional[torch.Tensor] = None
    groups: int = 0  # 0: a Linear layer; else a convolution with this many groups
    absolute: Optional[torch.Tensor] = None  # sum |x| per input column (None: statistics made without the data)

    @staticmethod
    def merge(a: "InputStatistics", b: "InputStatistics") -> "InputStatistics":
        """The statistics of both shards' inputs (sums add; ``a`` first, so a fixed order gives fixed bytes)."""
        if ((a.xtx is None) != (b.xtx is None) or (a.absolute is None) != (b.absolute is None)
                or a.sq.shape != b.sq.shape or a.groups != b.groups):
            raise ValueError("input statistics of different layers or kinds cannot be merged")
        return InputStatistics(a.count + b.count, a.sq + b.sq.to(a.sq.device),
                               None if a.xtx is None else a.xtx + b.xtx.to(a.xtx.device), a.groups,
                               None if a.absolute is None else a.absolute + b.absolute.to(a.absolute.device))

    def mean_square(self) -> torch.Tensor:
        """``E[x²]`` per input column (float32)."""
        return (self.sq / max(self.count, 1)).to(torch.float32)

    def mean_absolute(self) -> torch.Tensor:
        """``E[|x|]`` per input column (float32)."""
        return (self.absolute / max(self.count, 1)).to(torch.float32)

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
    """``(n, sum x² (groups·d,), sum x xᵀ (groups, d, d) or None, sum |x| (groups·d,))`` of one batch's ``rows``
    ``(n, groups, d)``, in float32."""
    n, g, d = rows.shape
    xtx = None
    if hessian:
        with exact():  # float32 products even inside a pass whose model runs at a lower --matmul-precision
            xtx = torch.einsum("ngi,ngj->gij", rows, rows) if g > 1 else _gram(rows[:, 0])[None]
    return n, rows.square().sum(dim=0).reshape(-1), xtx, rows.abs().sum(dim=0).reshape(-1)


_PANEL = 192


def _gram(x: torch.Tensor) -> torch.Tensor:
    """``xᵀx`` of ``x`` ``(n, d)``, a panel of columns at a time, each only against the columns from its own on;
    the lower triangle is the mirror (xᵀx is symmetric). Each value is the same dot product over the ``n`` rows as
    in the one whole matmul, with ~40 % fewer multiply-adds where it matters (a 1536-wide input over 2048 tokens:
    67 -> 47 ms). The same bits as the whole matmul where the BLAS sums both in one order (measured on the earlier
    machines: tokens 1-8192, widths 385-4096). oneMKL on a 2-core Xeon with AMX sums some shapes otherwise (on 2
    threads it splits a narrow panel's rows between them; on one, 2048 x 4096 differs too): a float32 step apart,
    and there the bits follow the thread count."""
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
        n, sq, xtx, absolute = self.sums
        return n, sq, xtx if hessian else None, absolute


class _Collector:
    def __init__(self, hessian: bool, shared: Optional[_SharedInput] = None):
        self.hessian = hessian
        self.shared = shared or _SharedInput()
        self.count = 0
        self.groups = 0
        self.sq: Optional[torch.Tensor] = None
        self.xtx: Optional[torch.Tensor] = None
        self.absolute: Optional[torch.Tensor] = None

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

    def _add(self, n: int, sq: torch.Tensor, xtx: Optional[torch.Tensor], absolute: torch.Tensor) -> None:
        if self.sq is None:
            self.sq = torch.zeros(sq.shape, dtype=torch.float64, device=sq.device)
            self.absolute = torch.zeros(sq.shape, dtype=torch.float64, device=sq.device)
            if self.hessian:
                self.xtx = torch.zeros(xtx.shape, dtype=torch.float64, device=sq.device)
        self.count += n
        # each batch's sums in float32, accumulated in float64: adding float32 numbers in float64 is exact unless
        # they span ~2^29 in magnitude, so the total hardly ever depends on how batches are grouped (shards)
        self.sq += sq
        self.absolute += absolute
        if self.hessian:
            self.xtx += xtx

    def statistics(self) -> Optional[InputStatistics]:
        if self.sq is None:
            return None
        xtx = self.xtx if self.xtx is None or self.groups else self.xtx[0]
        return InputStatistics(self.count, self.sq, xtx, self.groups, self.absolute)


def collect_inputs(rows: Iterable[QuantizerPlan], modules: Dict[str, nn.Module],
                   run: Callable[[], None]) -> Dict[str, InputStatistics]:
    """Input statistics of the layers of ``rows`` that need them (``needs_inputs``), by module name, while
    ``run()`` feeds the data; ``XᵀX`` only where a rounding algorithm asks for it. Empty without running when no
    row needs inputs; a module that never ran is absent from the result."""
    from ...model.experts import same_inputs

    hessian: Dict[str, bool] = {}
    for q in rows:
        if q.needs_inputs:
            hessian[q.module] = hessian.get(q.module, False) or q.rounds_layerwise
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


def importance(q: QuantizerPlan, stats: Dict[str, InputStatistics], weight_shape,
               imported: Optional[Dict[str, InputStatistics]] = None) -> Optional[torch.Tensor]:
    """The weight's per-value importance for an activation-weighted search (``E[x²]`` of the input each value
    multiplies, broadcastable to ``weight_shape``), or None where the row's search is unweighted. A row marked
    ``imatrix`` takes it from ``imported`` (an importance matrix file: ``Plan.importances``)."""
    if not weighs_activations(dict(q.analyzer_args).get("weighting")):
        return None
    s = (imported or {}).get(q.module) if q.imatrix else stats.get(q.module)
    if s is None:
        raise DataError(f"{q.module} never ran on the calibration data: no input statistics to weight "
                         f"{q.name}'s search")
    imp = s.importance(weight_shape)
    if not bool(torch.isfinite(imp).all()):  # (an imported matrix is checked by its reader)
        raise DataError(f"{q.name}: its layer's inputs hold NaN/Inf or values past float32's range on the "
                        "calibration data, or values whose squares are (above about 1e19: their mean square, which "
                        "weights the search, overflows); an earlier weight of the checkpoint or the data holds them; "
                        "nothing was written")
    return imp
