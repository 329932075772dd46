"""Encodings onto a model: the plan they imply, and quantizers inserted with their ranges set."""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from ..config import Plan, QuantizerPlan, input_channels_first
from ..encodings import EncodingsFile
from ..errors import EncodingsError
from ..quant import QuantizerBase
from ..quant.hadamard import HadamardError, hadamard_order
from ..weights import WeightSource
from .checkpoint_map import checkpoint_names
from .expert_view import open_checkpoint
from .insert import insert_quantizers, make_quantizer, set_stored_weight
from .online import install_online, rotated_width

__all__ = ["plan_from_encodings", "apply_encodings", "apply_stored_weights", "untie"]


def plan_from_encodings(enc: EncodingsFile, model: nn.Module, source: str) -> Plan:
    modules = dict(model.named_modules())
    rows = []
    for e in enc.entries:
        if e.module not in modules:
            raise EncodingsError(f"{source}: module {e.module!r} is not in this model; were the encodings made "
                                 "for another model?")
        module = modules[e.module]
        if e.tensor == "weight" and e.granularity != "per_tensor" and input_channels_first(module):
            raise EncodingsError(f"{source}: {e.name}: {e.granularity} encodings on a {type(module).__name__}, whose "
                                 "weight holds its input channels first: qtool's channels and blocks run along that "
                                 "dimension, so they would share scales across output channels; this layer takes "
                                 "per_tensor encodings only")
        rows.append(QuantizerPlan(e.name, e.module, type(module).__name__, e.tensor, e.bitwidth,
                                  e.symmetric, e.granularity, e.shape, e.block_size, e.analyzer,
                                  scale_dtype=e.scale_dtype, dynamic=e.dynamic, element=e.element))
    return Plan(rows)


def apply_encodings(model: nn.Module, enc: EncodingsFile, source: str) -> Dict[str, QuantizerBase]:
    """Insert quantizers as ``enc`` describes and set their ranges, and put its online rotations on the modules
    they rotate; returns the quantizers by quantizer name."""
    plan = plan_from_encodings(enc, model, source)
    modules = dict(model.named_modules())
    for rot in enc.online:  # (an r3 module has a k_cache quantizer: checked when the file was read)
        if rot.location == "input":
            missing = next((m for m in rot.modules if not isinstance(modules.get(m), nn.Linear)), None)
            if missing is not None:
                raise EncodingsError(f"{source}: online rotation {rot.name}: {missing!r} is not a Linear layer of "
                                     "this model; were the encodings made for another model?")
        try:
            for n in {rotated_width(modules[m], rot) for m in rot.modules}:
                hadamard_order(n)
        except (HadamardError, ValueError) as e:
            raise EncodingsError(f"{source}: online rotation {rot.name}: {e}") from None
    for row in plan.quantizers:  # (before anything is inserted: a refused call leaves the caller's model as it was)
        if row.tensor == "weight":
            w = modules[row.module]._parameters.get("weight")
            try:
                make_quantizer(row).check_input(w)
            except (ValueError, AttributeError) as err:
                raise EncodingsError(f"{source}: {row.name}: does not fit the model's weight ({err})") from None
    quantizers = insert_quantizers(model, plan)
    install_online(modules, enc.online)  # the rotations run first: before the input quantizers they feed
    for e in enc.entries:
        if e.global_amax is not None:
            quantizers[e.name].global_amax = torch.tensor(e.global_amax, dtype=torch.float32)
        if e.dynamic:
            continue  # computes its range at run time
        lo, hi = e.range()
        quantizers[e.name].set_range(lo.to(quantizers[e.name].min.device), hi.to(quantizers[e.name].max.device))
    return quantizers


def make_fake_quant(model: nn.Module, checkpoint, encodings, trust_pickle: bool = False) -> EncodingsFile:
    """Turn ``model`` (the float model of ``checkpoint``) into the fake-quant model ``encodings`` (qtool's
    encodings.json) describes: its quantizers, online rotations and stored codes or replaced tensors. Returns the
    encodings read."""
    from pathlib import Path

    enc = EncodingsFile.read(encodings)
    apply_encodings(model, enc, str(encodings))
    if enc.codes_file is not None:
        apply_stored_weights(model, WeightSource(Path(checkpoint), enc, Path(encodings).parent,
                                                 tensors=open_checkpoint(checkpoint, trust_pickle, model=model)))
    return enc


def apply_stored_weights(model: nn.Module, weights: WeightSource, codes: bool = True) -> None:
    """Put what the encodings' codes file stored into ``model``: a stored-codes weight's fake-quant value becomes its
    dequantized codes (the float weight stays, so the float reference is unchanged; ``codes=False`` leaves them to
    the caller), and each replaced tensor takes its stored value."""
    modules = dict(model.named_modules())
    for e in weights.encodings.entries if codes else ():
        if e.tensor != "weight" or not weights.has_stored_codes(e):
            continue
        w = modules[e.module]._parameters["weight"]
        stored = weights.stored_codes(e, tuple(w.shape))
        fixed = weights.dequantize_codes(e, stored).to(w.device)
        set_stored_weight(modules[e.module], fixed.to(w.dtype))
    for key in weights.untied():  # a tied parameter a transform gave its own values: untie it first
        module, _, attr = key.rpartition(".")
        owner = modules.get(module)
        if owner is None or owner._parameters.get(attr) is None:
            raise EncodingsError(f"{weights.path}: replaced tensor {key!r} is not a parameter of this model")
        untie(model, owner, attr)
    if weights.replaced():
        state = dict(model.named_parameters())
        state.update(dict(model.named_buffers()))
        missing = [k for k in weights.replaced() if k not in state]  # stored under their checkpoint names
        named = checkpoint_names(model, missing) if missing else {}
        for key in weights.replaced():
            target = state.get(named.get(key, key))
            if target is None:
                raise EncodingsError(f"{weights.path}: replaced tensor {key!r} is not a parameter of this model")
            with torch.no_grad():
                target.copy_(weights.get(key).to(target.dtype))


def untie(model: nn.Module, owner: nn.Module, attr: str = "weight") -> None:
    """Give ``owner``'s parameter ``attr`` a copy of its own (it stops sharing a tensor with another module, e.g.
    an output layer tied to the embedding table), and say so in a Hugging Face config."""
    p = owner._parameters[attr]
    owner._parameters[attr] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
    if hasattr(getattr(model, "config", None), "tie_word_embeddings"):
        model.config.tie_word_embeddings = False
