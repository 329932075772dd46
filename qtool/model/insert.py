"""Put quantizers on a model's modules as a plan says, keeping every original module and parameter name.

A planned module keeps its place in the tree; its class is swapped for a subclass (``Quantized<Class>``) whose
forward quantizes the first tensor input, runs the original forward with the weight fake-quantized, and quantizes
the output. Quantizers live in ``module.qtool_quantizers`` (a ``ModuleDict`` keyed ``weight``/``input``/
``output``), so ``model.named_parameters()`` still lists the checkpoint's own names first and unchanged.
"""

from __future__ import annotations

from typing import Dict, Iterator, Tuple

import torch
from torch import nn

from ..config import Plan, QuantizerPlan
from ..quant import QuantizeDequantize, QuantizerBase

__all__ = ["insert_quantizers", "remove_quantizers", "iter_quantizers", "QuantizedModuleMixin"]

_ATTR = "qtool_quantizers"
_CLASS_CACHE: Dict[type, type] = {}


def _plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor else t


class QuantizedModuleMixin:
    """Forward with fake-quantized first input, weight and output."""

    def forward(self, *args, **kwargs):  # type: ignore[override]
        qs = getattr(self, _ATTR)
        if "input" in qs and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            args = (_plain(qs["input"](args[0])),) + tuple(args[1:])
        if "weight" in qs:
            w = self._parameters["weight"]
            self.__dict__["weight"] = _plain(qs["weight"](w))  # shadows the parameter for this call only
            try:
                out = super().forward(*args, **kwargs)
            finally:
                del self.__dict__["weight"]
        else:
            out = super().forward(*args, **kwargs)
        if "output" in qs and isinstance(out, torch.Tensor) and out.is_floating_point():
            out = _plain(qs["output"](out))
        return out


def _quantized_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"Quantized{cls.__name__}", (QuantizedModuleMixin, cls), {"_qtool_base": cls})
    return _CLASS_CACHE[cls]


def make_quantizer(q: QuantizerPlan, device=None) -> QuantizerBase:
    quantizer = QuantizeDequantize(q.shape, q.bitwidth, q.symmetric, block_size=q.block_size)
    return quantizer.to(device) if device is not None else quantizer


def insert_quantizers(model: nn.Module, plan: Plan) -> Dict[str, QuantizerBase]:
    """Attach one quantizer per plan row; returns them keyed by the plan's quantizer name."""
    modules = dict(model.named_modules())
    out: Dict[str, QuantizerBase] = {}
    for q in plan.quantizers:
        module = modules[q.module]
        if not hasattr(module, _ATTR):
            module.__class__ = _quantized_class(type(module))
            module.add_module(_ATTR, nn.ModuleDict())
        param = next(iter(module.parameters(recurse=False)), None)
        device = param.device if param is not None else None
        quantizer = make_quantizer(q, device)
        getattr(module, _ATTR)[q.tensor] = quantizer
        out[q.name] = quantizer
    return out


def remove_quantizers(model: nn.Module) -> None:
    """Undo ``insert_quantizers``: original classes, no quantizer submodules."""
    for module in model.modules():
        if hasattr(module, _ATTR):
            del module._modules[_ATTR]
            module.__class__ = module._qtool_base


def iter_quantizers(model: nn.Module) -> Iterator[Tuple[str, QuantizerBase]]:
    """``(name, quantizer)`` for every inserted quantizer, named like the plan (``<module>.<tensor>``)."""
    for name, module in model.named_modules():
        qs = getattr(module, _ATTR, None)
        if isinstance(qs, nn.ModuleDict):
            for tensor, quantizer in qs.items():
                yield f"{name}.{tensor}", quantizer
