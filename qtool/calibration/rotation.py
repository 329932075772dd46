"""Hadamard rotations fused into a Llama-family model's weights (QuaRot/SpinQuant's R1 and R2), before calibration.

``R`` is orthogonal (``R Rᵀ = I``, :mod:`qtool.quant.hadamard`), so inserting ``R Rᵀ`` anywhere leaves the float
model unchanged; fusing each factor into the weight beside it leaves a plain model whose weights and activations
have their outlier channels spread out.

* **R1**, the residual stream (width ``hidden``): every RMSNorm's weight is first folded into the Linears that
  read its output (the norm keeps weight 1: ``x/rms(x)`` commutes with a rotation, ``·γ`` does not). Then the
  embedding table becomes ``E R``, every Linear reading the stream (q/k/v, gate/up, the output layer) ``W R``, and
  every Linear writing it (o_proj, down_proj) ``Rᵀ W`` (its bias ``b R``).
* **R2**, each attention head's values (width ``head_dim``): ``v_proj``'s rows of each key/value head become
  ``Rᵀ W_h`` (bias ``b_h R``) and ``o_proj``'s columns of each head ``W_h R``. Attention mixes tokens, never
  channels, so each head's output carries the same ``R`` into ``o_proj``.

All products are taken in float64 and stored in the parameter's dtype. :func:`rotate` changes the model in
place and returns every changed tensor (stored as ``float/`` replacements in ``codes.safetensors``, so every
exporter writes the rotated weights, see qtool.weights).
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from ..config import RotationPlan
from ..quant.hadamard import hadamard_transform

__all__ = ["rotate"]


@torch.no_grad()
def rotate(model: nn.Module, plan: RotationPlan) -> Dict[str, torch.Tensor]:
    """Fuse ``plan``'s rotations into ``model`` in place; returns ``{parameter name: new value}`` (CPU)."""
    modules = dict(model.named_modules())
    changed: Dict[str, nn.Parameter] = {}

    def mod(name: str) -> nn.Module:
        return modules[name]

    def rot(x: torch.Tensor, width_first: bool = False) -> torch.Tensor:
        """``x @ R`` over the last dimension (or ``Rᵀ x`` over the first when ``width_first``)."""
        if width_first:
            return hadamard_transform(x.T.to(torch.float64), plan.kind, plan.seed).T
        return hadamard_transform(x.to(torch.float64), plan.kind, plan.seed)

    def store(name: str, value: torch.Tensor) -> None:
        p = _param(modules, name)
        p.copy_(value.to(p.dtype))
        changed[name] = p

    if "r1" in plan.rotations:
        readers = {layer: ([f"{layer}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
                           [f"{layer}.mlp.{p}" for p in ("gate_proj", "up_proj")]) for layer in plan.layers}
        for layer in plan.layers:
            attn, mlp = readers[layer]
            _fold_norm(modules, f"{layer}.input_layernorm", attn, store)
            _fold_norm(modules, f"{layer}.post_attention_layernorm", mlp, store)
        if plan.head is not None:
            _fold_norm(modules, plan.final_norm, [plan.head], store)
        store(f"{plan.embed}.weight", rot(mod(plan.embed).weight))
        for layer in plan.layers:
            attn, mlp = readers[layer]
            for name in attn + mlp:
                store(f"{name}.weight", rot(mod(name).weight))
            for name in (f"{layer}.self_attn.o_proj", f"{layer}.mlp.down_proj"):
                store(f"{name}.weight", rot(mod(name).weight, width_first=True))
                if mod(name).bias is not None:
                    store(f"{name}.bias", rot(mod(name).bias))
        if plan.head is not None:
            store(f"{plan.head}.weight", rot(mod(plan.head).weight))
    if "r2" in plan.rotations:
        d = plan.head_dim
        for layer in plan.layers:
            v, o = mod(f"{layer}.self_attn.v_proj"), mod(f"{layer}.self_attn.o_proj")
            w = v.weight.to(torch.float64).reshape(-1, d, v.in_features)  # (kv heads, d, in)
            store(f"{layer}.self_attn.v_proj.weight",
                  rot(w.transpose(1, 2)).transpose(1, 2).reshape(v.weight.shape))  # Rᵀ W_h per head
            if v.bias is not None:
                store(f"{layer}.self_attn.v_proj.bias", rot(v.bias.reshape(-1, d)).reshape(-1))
            wo = o.weight.to(torch.float64).reshape(o.out_features, -1, d)  # (out, heads, d)
            store(f"{layer}.self_attn.o_proj.weight", rot(wo).reshape(o.weight.shape))
    return {k: v.detach().clone().cpu() for k, v in changed.items()}


def _param(modules: Dict[str, nn.Module], name: str) -> nn.Parameter:
    module, _, attr = name.rpartition(".")
    return modules[module]._parameters[attr]


def _fold_norm(modules: Dict[str, nn.Module], norm: str, readers, store) -> None:
    """``norm``'s weight multiplied into the input columns of each Linear in ``readers``; the norm's weight
    becomes 1 (its ``x/rms(x)`` stays)."""
    gamma = modules[norm].weight.to(torch.float64)
    for name in readers:
        store(f"{name}.weight", modules[name].weight.to(torch.float64) * gamma[None, :])
    store(f"{norm}.weight", torch.ones_like(gamma))
