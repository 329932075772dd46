"""Encodings onto a model: the plan they imply, and quantizers inserted with their ranges set."""

from __future__ import annotations

from typing import Dict

from torch import nn

from ..config import Plan, QuantizerPlan
from ..encodings import EncodingsFile
from ..errors import EncodingsError
from ..quant import QuantizerBase
from .insert import insert_quantizers

__all__ = ["plan_from_encodings", "apply_encodings"]


def plan_from_encodings(enc: EncodingsFile, model: nn.Module, source: str) -> Plan:
    modules = dict(model.named_modules())
    rows = []
    for e in enc.entries:
        if e.module not in modules:
            raise EncodingsError(f"{source}: module {e.module!r} is not in this model; were the encodings made "
                                 "for another model?")
        rows.append(QuantizerPlan(e.name, e.module, type(modules[e.module]).__name__, e.tensor, e.bitwidth,
                                  e.symmetric, e.granularity, e.shape, e.block_size, e.analyzer))
    return Plan(rows)


def apply_encodings(model: nn.Module, enc: EncodingsFile, source: str) -> Dict[str, QuantizerBase]:
    """Insert quantizers as ``enc`` describes and set their ranges; returns them by quantizer name."""
    plan = plan_from_encodings(enc, model, source)
    quantizers = insert_quantizers(model, plan)
    modules = dict(model.named_modules())
    for e in enc.entries:
        if e.tensor == "weight":
            w = modules[e.module]._parameters.get("weight")
            try:
                quantizers[e.name].check_input(w)
            except (ValueError, AttributeError) as err:
                raise EncodingsError(f"{source}: {e.name}: does not fit the model's weight ({err})") from None
        lo, hi = e.range()
        quantizers[e.name].set_range(lo.to(quantizers[e.name].min.device), hi.to(quantizers[e.name].max.device))
    return quantizers
