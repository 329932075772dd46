"""Learned rounding and ranges for one decoder block (SignRound: Cheng et al., 2023, the algorithm of Intel's
AutoRound), on integer grids, float element grids (FP8, NVFP4, MXFP4) and GGUF's block types.

Input: a decoder block whose weight quantizers the analyzer has calibrated, its real inputs (the quantized
blocks' outputs before it, one entry per calibration batch) and the rows to learn. Output: codes for each row,
and each row's range shrunk where that helped; the stored scales are then those of the shrunk range, exactly as
the quantizer computes them (the files hold nothing new). On a float element grid the offset is added to the
scaled weight before it rounds to the element (``round(clamp(W / s + V, ±max))``, ``V`` in ``[-0.5, 0.5]``) and
the scales stay the analyzer's: they are themselves quantized (FP8, E8M0), so a range factor has no gradient.
On a GGUF type (Q4_0 … Q8_0, Q2_K … Q6_K) the grid is the one the file stores (sub-block steps and minima already
quantized under the float16 super-block scales), for the same reason, and the offset is added before rounding
``(W + low) / step`` to its code; IQ4's table grids are refused by the recipe.

Per weight a rounding offset ``V`` in ``[-0.5, 0.5]`` (in steps) and, with ``ranges``, a factor in
``[MIN_RANGE, 1]`` on each encoding's minimum and maximum (one factor for a symmetric grid) give the fake-quant
weight ``(clamp(round(W / s + V) - o, qmin, qmax) + o) · s`` with ``(s, o)`` the quantizer's own
``min_max_to_scale_offset`` of the scaled range; rounding passes gradients straight through. The objective is
the block's output error against the float block on the same inputs (mean squared error, activation quantizers
off). Each step takes one calibration batch (a seeded permutation, one per pass over the batches) and moves every
parameter by ``learning_rate · sign(gradient)``, the rate falling linearly to zero (AutoRound's schedule; its
defaults: 200 steps, rate 1 / steps).

Three candidates are scored on every batch at the end: the analyzer's grid rounded to nearest (the start), the
parameters of the step with the lowest batch loss, and the last ones; the first of least total error wins, so a
block is never worse than round-to-nearest on its calibration inputs.

Under torchrun each batch lives on one rank: the rank holding a step's batch computes its gradient signs and
loss and every rank applies them, so every rank holds the same parameters and the codes are one process's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...parallel import Group
from ...quant.affine import min_max_to_scale_offset, round_ste
from ...quant.floatgrid import FloatElement
from ...quant.ggml import GgmlType
from ...hooks import step
from .gptq import expand_encoding

__all__ = ["signround_block", "MIN_RANGE"]

MIN_RANGE = 0.5  # the smallest factor a learned range may apply to the analyzer's minimum or maximum


@dataclass
class LearnedLayer:
    """One row's learning state: its float weight, the analyzer's range and the learned parameters."""

    module: nn.Module
    qmin: int
    qmax: int
    symmetric: bool
    block_size: Optional[Tuple[int, ...]]
    weight: torch.Tensor  # float32, detached
    mn: torch.Tensor
    mx: torch.Tensor
    v: torch.Tensor
    lo: Optional[torch.Tensor]  # factor on mn (symmetric: on both ends)
    hi: Optional[torch.Tensor]  # factor on mx (None for a symmetric grid)
    element: Optional[FloatElement] = None  # a float element grid (its effective scales fixed: ``scale``)
    scale: Optional[torch.Tensor] = None  # a fixed grid's effective scales (float, GGUF steps), one per weight
    ggml: Optional[GgmlType] = None  # a GGUF type: the stored grid ``scale``/``low`` is fixed
    low: Optional[torch.Tensor] = None  # the GGUF grid's minima (value = step·q − low), one per weight

    def params(self) -> List[torch.Tensor]:
        return [p for p in (self.v, self.lo, self.hi) if p is not None]

    def range(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.lo is None:
            return self.mn, self.mx
        return self.mn * self.lo, self.mx * (self.lo if self.hi is None else self.hi)

    def grid(self) -> Tuple[torch.Tensor, torch.Tensor]:
        mn, mx = self.range()
        scale, offset = min_max_to_scale_offset(mn, mx, self.qmin, self.qmax, self.symmetric)
        shape = self.weight.shape
        return expand_encoding(scale, shape, self.block_size), expand_encoding(offset, shape, self.block_size)

    def fake_quant(self) -> torch.Tensor:
        if self.element is not None:
            y = torch.clamp(self.weight / self.scale + self.v, -self.element.max, self.element.max)
            r = self.element.round(y.detach())
            return (y + (r - y).detach()) * self.scale  # straight through the element rounding
        if self.ggml is not None:
            return self._ggml_codes(round_ste) * self.scale - self.low
        s, o = self.grid()
        q = torch.clamp(round_ste(self.weight / s + self.v) - o, self.qmin, self.qmax)
        return (q + o) * s

    @torch.no_grad()
    def codes(self) -> torch.Tensor:
        if self.element is not None:
            y = torch.clamp(self.weight / self.scale + self.v, -self.element.max, self.element.max)
            return self.element.codes(self.element.round(y))
        if self.ggml is not None:
            return torch.where(self.scale == 0, 0.0, self._ggml_codes(torch.round))
        s, o = self.grid()
        return torch.clamp(torch.round(self.weight / s + self.v) - o, self.qmin, self.qmax)

    def _ggml_codes(self, rounding: Callable) -> torch.Tensor:
        """A GGUF grid's codes as ``ggml.quantize_codes`` rounds them (a zero step: any code, worth ``-low``)."""
        safe = torch.where(self.scale == 0, 1.0, self.scale)
        return torch.clamp(rounding((self.weight + self.low) / safe + self.v), self.qmin, self.qmax)

    @torch.no_grad()
    def clamp_(self) -> None:
        self.v.clamp_(-0.5, 0.5)
        for p in (self.lo, self.hi):
            if p is not None:
                p.clamp_(MIN_RANGE, 1.0)

    def snapshot(self) -> List[torch.Tensor]:
        return [p.detach().clone() for p in self.params()]

    @torch.no_grad()
    def restore(self, saved: Sequence[torch.Tensor]) -> None:
        for p, s in zip(self.params(), saved):
            p.copy_(s)


def learned_layer(module: nn.Module, quantizer, ranges: bool) -> LearnedLayer:
    """The learning state of ``module``'s weight on ``quantizer``'s calibrated grid (start: nearest): an integer
    grid (``QuantizeDequantize``), a float element one (``FloatQuantizeDequantize``) or a GGUF type's
    (``GgmlQuantizeDequantize``); ranges are learned on the first only."""
    w = module._parameters["weight"].detach().to(torch.float32).clone()  # (the weight is overwritten later)
    mn, mx = quantizer.min.detach().to(w.device).clone(), quantizer.max.detach().to(w.device).clone()
    element, gtype = getattr(quantizer, "element", None), getattr(quantizer, "ggml", None)
    scale = low = None
    if element is not None:
        ranges = False
        scale = expand_encoding(quantizer.get_scale().detach().to(w.device, torch.float32), w.shape,
                                quantizer.block_size)
    if gtype is not None:
        if gtype.table:
            raise ValueError(f"GGUF type {gtype.name}: signround learns on evenly spaced grids, not IQ4's table")
        ranges = False
        grid = quantizer.grid()
        scale, low = (expand_encoding(t.to(w.device, torch.float32), w.shape, quantizer.block_size)
                      for t in (grid.step, grid.low))
    lo = torch.ones_like(mn, requires_grad=True) if ranges else None
    hi = torch.ones_like(mx, requires_grad=True) if ranges and not quantizer.symmetric else None
    return LearnedLayer(module, quantizer.qmin, quantizer.qmax, quantizer.symmetric, quantizer.block_size,
                        w, mn, mx, torch.zeros_like(w, requires_grad=True), lo, hi, element, scale, gtype, low)


def signround_block(block: nn.Module, layers: List[LearnedLayer], inputs: List[Tuple[tuple, dict]],
                    computing_with: Callable, others: Sequence[nn.Module] = (), *, iterations: int = 200,
                    learning_rate: Optional[float] = None, seed: int = 0, group: Optional[Group] = None,
                    what: str = "learning rounding") -> Dict[str, object]:
    """Learn ``layers``' rounding (and ranges) on ``block`` over ``inputs`` (this rank's batches, ``(args,
    kwargs)`` each); leaves each layer's parameters at the chosen candidate. ``computing_with`` is
    :func:`qtool.model.insert.computing_with`; the block's other quantizers must be as the objective wants them
    (activation quantizers off); ``others``: the block's other weight-quantized modules, float in the target
    (the float block's output) and quantized as they are while learning. Returns a record: the three
    candidates' total losses, the one chosen, the steps, the learning rate and seed in effect and the seconds taken
    (the last step's progress report says them too)."""
    group = group or Group()
    if iterations < 0 or (learning_rate is not None and learning_rate <= 0):
        raise ValueError("iterations must be >= 0 and learning_rate > 0")
    lr0 = learning_rate if learning_rate is not None else 1.0 / max(iterations, 1)
    t0 = time.perf_counter()
    frozen = [p for p in block.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        counts = group.all_gather(len(inputs))
        starts = [sum(counts[:r]) for r in range(len(counts))]
        total = sum(counts)
        mine = range(starts[group.rank], starts[group.rank] + counts[group.rank])

        def output(args, kwargs) -> torch.Tensor:
            out = block(*args, **kwargs)
            return out[0] if isinstance(out, (tuple, list)) else out

        with torch.no_grad(), computing_with({m: None for m in [*others, *(l.module for l in layers)]}):
            targets = [output(a, k).detach() for a, k in inputs]

        def loss_on(j: int) -> torch.Tensor:
            args, kwargs = inputs[j - starts[group.rank]]
            with computing_with({layer.module: layer.fake_quant() for layer in layers}):
                out = output(args, kwargs)
            return (out.to(torch.float32) - targets[j - starts[group.rank]].to(torch.float32)).pow(2).mean()

        def total_loss() -> float:
            with torch.no_grad():
                local = [(j, float(loss_on(j))) for j in mine]
            losses = dict(x for part in group.all_gather(local) for x in part)
            return sum(losses[j] for j in range(total))  # in batch order: the same sum on every rank

        start = [layer.snapshot() for layer in layers]
        best, best_loss = start, float("inf")
        generator = torch.Generator().manual_seed(seed)
        order: List[int] = []
        params = [p for layer in layers for p in layer.params()]
        for it in range(iterations):
            if not order:
                order = torch.randperm(total, generator=generator).tolist()
            j = order.pop(0)
            payload = None
            if j in mine:
                with torch.enable_grad():
                    loss = loss_on(j)
                    grads = torch.autograd.grad(loss, params, allow_unused=True)
                signs = [torch.zeros_like(p, dtype=torch.int8) if g is None else g.sign().to(torch.int8)
                         for p, g in zip(params, grads)]  # (None: a layer this batch never reached, an expert)
                payload = (float(loss.detach()), signs)
            loss_value, signs = next(p for p in group.all_gather(payload) if p is not None)
            if loss_value < best_loss:  # the loss of the parameters as they were for this step
                best, best_loss = [layer.snapshot() for layer in layers], loss_value
            rate = lr0 * (1.0 - it / iterations)
            with torch.no_grad():
                for p, s in zip(params, signs):
                    p.sub_(rate * s.to(p.device, p.dtype))
                for layer in layers:
                    layer.clamp_()
            if it + 1 < iterations:
                step(what, it + 1, iterations, f"loss {loss_value:.3g}")
        last = [layer.snapshot() for layer in layers]
        scores = []
        for candidate in (start, best, last):
            for layer, saved in zip(layers, candidate):
                layer.restore(saved)
            scores.append(total_loss())
        chosen = min(range(3), key=lambda i: (scores[i], i))
        for layer, saved in zip(layers, (start, best, last)[chosen]):
            layer.restore(saved)
        if iterations:
            step(what, iterations, iterations, f"loss {scores[chosen]:.3g} over {total} batches (nearest "
                 f"{scores[0]:.3g}), {time.perf_counter() - t0:.1f} s")
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return {"losses": {"nearest": scores[0], "best_step": scores[1], "last": scores[2]},
            "chosen": ("nearest", "best_step", "last")[chosen], "iterations": iterations, "learning_rate": lr0,
            "seed": seed, "seconds": time.perf_counter() - t0}
