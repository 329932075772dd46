"""Hadamard rotations put into a Llama-family model (QuaRot/SpinQuant's R1 to R4), before calibration.

``R`` is orthogonal (``R Rᵀ = I``, :mod:`qtool.quant.hadamard`), so inserting ``R Rᵀ`` anywhere leaves the float
model unchanged; fusing each factor into the weight beside it leaves a plain model whose weights and activations
have their outlier channels spread out.

* **R1**, the residual stream (width ``hidden``): every RMSNorm's weight is first folded into the Linears that
  read its output (the norm keeps weight 1: ``x/rms(x)`` commutes with a rotation, ``·γ`` does not). Then the
  embedding table becomes ``E R``, every Linear reading the stream (q/k/v, gate/up, the output layer) ``W R``, and
  every Linear writing it (o_proj, down_proj) ``Rᵀ W`` (its bias ``b R``). An output layer tied to the embedding
  table is untied first (the final norm folds into it alone): it becomes a tensor of its own, ``lm_head.weight``,
  which the checkpoint does not store (qtool.weights serves it; exports write ``tie_word_embeddings: false``).
* **R2**, each attention head's values (width ``head_dim``): ``v_proj``'s rows of each key/value head become
  ``Rᵀ W_h`` (bias ``b_h R``) and ``o_proj``'s columns of each head ``W_h R``. Attention mixes tokens, never
  channels, so each head's output carries the same ``R`` into ``o_proj``.
* **R4**, ``down_proj``'s input (width ``intermediate``; each expert's): ``down_proj``'s weight becomes ``W R`` and its input
  ``x R`` at run time, by a hook (qtool.model.online), since SwiGLU's product before it is not linear in a
  rotation. The hook stays on the model; the encodings file records it for every later reader.
* **R3**, each attention head's queries and keys after RoPE (width ``head_dim``), at run time: nothing is
  fused (``(q R)(k R)ᵀ = q kᵀ``); the layer's KV cache quantizer sees ``k R`` (qtool.model.online). Only with a
  quantized KV cache (``kv_cache``), where it spreads the keys' outlier channels (RoPE's slow dimensions).

All products are taken in float64 and stored in the parameter's dtype. :func:`rotate` changes the model in
place and returns every changed tensor (stored as ``float/`` replacements in ``codes.safetensors``, so every
exporter writes the rotated weights, see qtool.weights).
"""

from __future__ import annotations

import functools
from typing import Dict

import torch
from torch import nn

from ..config import RotationPlan
from ..model.apply import untie
from ..model.online import install_online
from ..quant.hadamard import hadamard_transform

__all__ = ["rotate", "Rotator"]


@torch.no_grad()
def rotate(model: nn.Module, plan: RotationPlan) -> Dict[str, torch.Tensor]:
    """Fuse ``plan``'s rotations into ``model`` in place; returns ``{parameter name: new value}`` (CPU)."""
    rotator = Rotator(model, plan)
    changed = rotator.embedding()
    for layer in plan.layers:
        changed.update(rotator.layer(layer))
    changed.update(rotator.head())
    return changed


class Rotator:
    """The rotations of ``plan`` part by part (the embedding table, one decoder layer, the output layer), so a
    caller holding one part in memory at a time (``--sequential``) fuses exactly what :func:`rotate` fuses. Each
    call returns ``{parameter name: new value}`` (CPU) of the part it changed."""

    def __init__(self, model: nn.Module, plan: RotationPlan):
        self.model, self.plan = model, plan
        self.modules = dict(model.named_modules())

    def _rot(self, x: torch.Tensor, width_first: bool = False, block: int = 0) -> torch.Tensor:
        """``x @ R`` over the last dimension (or ``Rᵀ x`` over the first when ``width_first``), in float64; with
        ``block``, ``R`` is block-diagonal: the same rotation of each ``block`` consecutive channels."""
        y = x.T if width_first else x
        shape = y.shape
        if block and block != shape[-1]:
            y = y.reshape(*shape[:-1], shape[-1] // block, block)
        y = hadamard_transform(y.to(torch.float64), self.plan.kind, self.plan.seed).reshape(shape)
        return y.T if width_first else y

    def _store(self, changed: Dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
        p = _param(self.modules, name)
        p.copy_(value.to(p.dtype))
        changed[name] = p.detach().clone().cpu()

    def _untie(self) -> None:
        """A tied output layer gets its own copy of the (not yet rotated) table: the final norm folds into it
        alone."""
        if not self.plan.untie:
            return
        head, embed = self.modules.get(self.plan.head), self.modules[self.plan.embed]
        if head.weight is embed.weight:
            untie(self.model, head)

    @torch.no_grad()
    def embedding(self) -> Dict[str, torch.Tensor]:
        changed: Dict[str, torch.Tensor] = {}
        self._untie()
        if "r1" in self.plan.rotations:
            name = f"{self.plan.embed}.weight"
            self._store(changed, name, self._rot(_param(self.modules, name), block=self.plan.block_size))
        return changed

    @torch.no_grad()
    def layer(self, layer: str) -> Dict[str, torch.Tensor]:
        changed: Dict[str, torch.Tensor] = {}
        store = functools.partial(self._store, changed)
        mod = self.modules.__getitem__
        mlp, writers = self.plan.mlp(layer)
        if "r1" in self.plan.rotations:
            attn = [f"{layer}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
            _fold_norm(self.modules, f"{layer}.input_layernorm", attn, store)
            _fold_norm(self.modules, f"{layer}.post_attention_layernorm", mlp, store)
            b = self.plan.block_size
            for name in attn + mlp:
                store(f"{name}.weight", self._rot(mod(name).weight, block=b))
            for name in [f"{layer}.self_attn.o_proj"] + writers:
                store(f"{name}.weight", self._rot(mod(name).weight, width_first=True, block=b))
                if mod(name).bias is not None:
                    store(f"{name}.bias", self._rot(mod(name).bias, block=b))
        if "r2" in self.plan.rotations:  # commutes with r1: rows of v_proj and columns of o_proj
            d = self.plan.head_dim
            v, o = mod(f"{layer}.self_attn.v_proj"), mod(f"{layer}.self_attn.o_proj")
            w = v.weight.to(torch.float64).reshape(-1, d, v.in_features)  # (kv heads, d, in)
            store(f"{layer}.self_attn.v_proj.weight",
                  self._rot(w.transpose(1, 2)).transpose(1, 2).reshape(v.weight.shape))  # Rᵀ W_h per head
            if v.bias is not None:
                store(f"{layer}.self_attn.v_proj.bias", self._rot(v.bias.reshape(-1, d)).reshape(-1))
            wo = o.weight.to(torch.float64).reshape(o.out_features, -1, d)  # (out, heads, d)
            store(f"{layer}.self_attn.o_proj.weight", self._rot(wo).reshape(o.weight.shape))
        if "r4" in self.plan.rotations:  # down_proj's input (each expert's): x R at run time, W R fused
            for name in writers:
                store(f"{name}.weight", self._rot(mod(name).weight))
                install_online(self.modules, self.plan.online(), only=name)
        if "r3" in self.plan.rotations:  # the keys the layer's KV cache quantizer sees: k R (nothing fused)
            for name in self.plan.kv_modules:
                if name.startswith(layer + "."):
                    install_online(self.modules, self.plan.online(), only=name)
        return changed

    @torch.no_grad()
    def head(self) -> Dict[str, torch.Tensor]:
        """The final norm folded into the output layer and the output layer rotated (r1); a tied output layer is
        first given a weight of its own."""
        changed: Dict[str, torch.Tensor] = {}
        plan = self.plan
        if not plan.rotates_head:
            return changed
        self._untie()
        head = self.modules[plan.head]
        store = functools.partial(self._store, changed)
        _fold_norm(self.modules, plan.final_norm, [plan.head], store)
        store(f"{plan.head}.weight", self._rot(head.weight, block=plan.block_size))
        return changed


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
