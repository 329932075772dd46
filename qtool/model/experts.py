"""Mixture-of-experts layers as one ``nn.Linear`` per expert and projection, so experts are weights like any other.

transformers 5 keeps a MoE layer's experts as one module with 3-D parameters (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, the layout its ``use_experts_implementation`` decorator describes with ``has_gate``,
``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_post_expert_norm``), built at load time from the
checkpoint's per-expert tensors (``experts.<e>.gate_proj.weight``, Mixtral's ``w1``/``w3``/``w2``). A recipe
targets ``nn.Linear``: :func:`linearize_experts` replaces each such module by :class:`LinearExperts`, whose
expert ``e`` holds ``nn.Linear`` modules named as the checkpoint names its tensors, and whose forward computes
what the fused module's does (tokens routed to each expert, its gate applied by the fused class's own
``_apply_gate``, weighted by the router). Every plan, calibration mode, algorithm (GPTQ sees the tokens routed to
each expert) and exporter then handles the experts through the machinery it has for any Linear, and an exported
file names them as the checkpoint (and llm-compressor, for vLLM's fused-MoE loader) does.

A checkpoint that stores the fused tensors themselves (gpt-oss's ``experts.gate_up_proj``, GraniteMoE's
``input_linear.weight``) is split the same way, its experts named as llm-compressor names a linearized gpt-oss
(``experts.<e>.gate_proj``/``up_proj``/``down_proj``); :mod:`.expert_view` shows such a checkpoint to every reader
(exporters, ``--sequential``, streaming) under those per-expert names, one expert's slice read at a time.
Llama 4's experts module (``STACKED``: called with every expert's rows stacked, scaled by their routing weights)
is split too; each expert runs the rows routed to it.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..config import CHECKPOINT_KEYS

__all__ = ["LinearExperts", "linearize_experts", "fused_layout", "checkpoint_key", "routing_of", "same_inputs",
           "all_tokens_routed", "linear_part", "FUSED_SLICES", "CHECKPOINT_KEYS"]

# where linearize_experts records, on a model whose checkpoint stores fused expert tensors, which slice of which
# checkpoint tensor each per-expert parameter is: {parameter name: (checkpoint key, expert, role, layout)}
FUSED_SLICES = "_qtool_fused_slices"
# the per-expert names of experts a checkpoint stores fused (llm-compressor's for a linearized gpt-oss)
FUSED_LEAVES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


# fused-experts classes without transformers' experts decorator whose module is called with one tensor, every
# expert's rows stacked ([E * T, H], each token already scaled by its routing weight, 0 where not routed), and
# computes act(gate) * up: their layout
STACKED = {"Llama4TextExperts": {"has_gate": True, "is_transposed": True, "is_concatenated": True,
                                 "has_bias": False, "has_post_expert_norm": False}}


def fused_layout(module: nn.Module) -> Optional[Dict[str, bool]]:
    """The layout flags of a transformers fused-experts module (None for any other module)."""
    stacked = STACKED.get(type(module).__name__)
    if stacked is not None and all(isinstance(getattr(module, p, None), nn.Parameter) and getattr(module, p).dim() == 3
                                   for p in ("gate_up_proj", "down_proj")):
        return dict(stacked, stacked=True)
    if not hasattr(module, "is_transposed") or not isinstance(getattr(module, "down_proj", None), nn.Parameter):
        return None
    has_gate = bool(getattr(module, "has_gate", True))
    first = getattr(module, "gate_up_proj" if has_gate else "up_proj", None)
    if not isinstance(first, nn.Parameter) or first.dim() != 3 or module.down_proj.dim() != 3:
        return None
    return {"has_gate": has_gate, "is_transposed": bool(module.is_transposed),
            "is_concatenated": bool(getattr(module, "is_concatenated", True)),
            "has_bias": bool(getattr(module, "has_bias", False)),
            "has_post_expert_norm": bool(getattr(module, "has_post_expert_norm", False))}


def _source_param(role: str, layout: Dict[str, bool], bias: bool = False) -> str:
    """The fused parameter that holds ``role``'s weight (or bias)."""
    name = "down_proj" if role == "down" else "gate_up_proj" if layout["has_gate"] else "up_proj"
    return name + "_bias" if bias else name


def linear_part(t: torch.Tensor, layout: Dict[str, bool], role: str) -> torch.Tensor:
    """One expert's slice of a fused parameter (``param[e]``: a weight ``[a, b]`` or a bias ``[n]``) as role
    ``role``'s ``nn.Linear`` holds it: ``[out, in]`` (or ``[out]``); gate and up rows concatenated or interleaved."""
    if layout["is_transposed"] and t.dim() == 2:
        t = t.t()
    if role == "down" or not layout["has_gate"]:
        return t
    gate, up = t.chunk(2, 0) if layout["is_concatenated"] else (t[0::2], t[1::2])
    return gate if role == "gate" else up


class _Expert(nn.Module):
    """One expert's projections, as named attributes (``gate``/``up``/``down`` roles → the checkpoint's names)."""

    def __init__(self, roles: Dict[str, str], shapes: Dict[str, Tuple[int, int]], bias: bool,
                 device, dtype):
        super().__init__()
        self.roles = dict(roles)
        for role, leaf in roles.items():
            out_f, in_f = shapes[role]
            # uninitialized: every value is the fused tensor's (LinearExperts.load_from) or the checkpoint's, and
            # Linear's random init would draw from the user's generator (and take seconds on a large MoE)
            self.add_module(leaf, torch.nn.utils.skip_init(nn.Linear, in_f, out_f, bias=bias, device=device,
                                                           dtype=dtype))

    def proj(self, role: str) -> nn.Linear:
        return getattr(self, self.roles[role])


class LinearExperts(nn.Module):
    """A fused experts module's computation over one ``nn.Linear`` per expert and projection (children ``0``,
    ``1``, ... each holding its projections under the checkpoint's names)."""

    def __init__(self, fused: nn.Module, layout: Dict[str, bool], roles: Dict[str, str]):
        super().__init__()
        self.num_experts = int(fused.down_proj.shape[0])
        # calibration's all-experts mode: every expert runs on every token (its statistics see them all), and only
        # the routed tokens' outputs reach the layer's output
        self.all_tokens = False
        # expert -> the token rows the last forward routed to it (qtool report compares an expert's outputs
        # between the float and the quantized model on the tokens both routed to it)
        self.routed_tokens: Dict[int, torch.Tensor] = {}
        self.layout = dict(layout)
        first = fused.gate_up_proj if layout["has_gate"] else fused.up_proj
        device, dtype = first.device, first.dtype

        def out_in(p: torch.Tensor) -> Tuple[int, int]:  # one expert's (out, in) as a Linear stores it
            a, b = p.shape[1:]
            return (b, a) if layout["is_transposed"] else (a, b)

        o, i = out_in(first)
        up_shape = (o // 2, i) if layout["has_gate"] else (o, i)
        shapes = {"up": up_shape, "gate": up_shape, "down": out_in(fused.down_proj)}
        for e in range(self.num_experts):
            self.add_module(str(e), _Expert(roles, shapes, layout["has_bias"], device, dtype))
        if layout["has_post_expert_norm"]:
            self.post_expert_norm = fused.post_expert_norm
        # the fused module, parameters dropped, keeps its gate function and activation (not a child: no weights)
        for name in ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias"):
            if name in fused._parameters:
                del fused._parameters[name]
        self.__dict__["_fused"] = fused
        self.__dict__["_signature"] = inspect.signature(fused.forward)

    def expert(self, e: int) -> _Expert:
        return self._modules[str(e)]

    @torch.no_grad()
    def load_from(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Copy the fused parameters (``gate_up_proj``, ``down_proj``, biases) into the per-expert Linears."""
        for e in range(self.num_experts):
            ex = self.expert(e)
            for role in ex.roles:
                lin = ex.proj(role)
                lin.weight.copy_(linear_part(tensors[_source_param(role, self.layout)][e], self.layout, role))
                bias = tensors.get(_source_param(role, self.layout, bias=True))
                if bias is not None:
                    lin.bias.copy_(linear_part(bias[e], self.layout, role))

    def _gate_up(self, ex: _Expert, x: torch.Tensor) -> torch.Tensor:
        lay, fused = self.layout, self._fused
        if lay.get("stacked"):
            return fused.act_fn(ex.proj("gate")(x)) * ex.proj("up")(x)
        if not lay["has_gate"]:
            return fused.act_fn(ex.proj("up")(x))
        g, u = ex.proj("gate")(x), ex.proj("up")(x)
        both = torch.cat([g, u], dim=-1) if lay["is_concatenated"] else torch.stack([g, u], dim=-1).flatten(-2)
        return type(fused)._apply_gate(fused, both)

    def _forward_stacked(self, hidden: torch.Tensor) -> torch.Tensor:
        """Llama 4's convention: ``[E * T, H]``, expert ``e``'s rows ``e*T .. e*T + T - 1`` scaled by its routing
        weight (0 where it is not routed: such a row's output is 0, so only routed rows run, and only they reach
        the statistics)."""
        stacked = hidden.view(self.num_experts, -1, hidden.shape[-1])
        out = torch.zeros_like(stacked)
        self.routed_tokens = {}
        for e in range(self.num_experts):
            token = (stacked[e] != 0).any(dim=-1).nonzero()[:, 0]
            if not len(token):
                continue
            self.routed_tokens[e] = token
            ex = self.expert(e)
            out[e, token] = ex.proj("down")(self._gate_up(ex, stacked[e, token])).to(out.dtype)
        return out.view(-1, hidden.shape[-1])

    def forward(self, *args, **kwargs) -> torch.Tensor:
        if self.layout.get("stacked"):
            return self._forward_stacked(*args, **kwargs)
        bound = self._signature.bind(*args, **kwargs)
        hidden, index, weights = list(bound.arguments.values())[:3]
        out = torch.zeros_like(hidden)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        experts = range(self.num_experts) if self.all_tokens else hit[:, 0].tolist()
        self.routed_tokens = {}
        for e in experts:
            if e >= self.num_experts:
                continue
            ex = self.expert(e)
            pos, token = torch.where(mask[e])
            self.routed_tokens[e] = token
            if self.all_tokens:
                y = ex.proj("down")(self._gate_up(ex, hidden))[token]
            else:
                y = ex.proj("down")(self._gate_up(ex, hidden[token]))
            if self.layout["has_post_expert_norm"]:
                y = self.post_expert_norm(y)
            y = y * weights[token, pos, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _roles(name: str, fused: nn.Module, layout: Dict[str, bool], sources) -> Optional[Tuple[Dict[str, str],
                                                                                           Dict[str, List[str]]]]:
    """``(role -> the checkpoint's leaf name, role -> the E checkpoint keys in expert order)`` of fused module
    ``name`` from ``sources(param name)`` (the checkpoint keys per source pattern), None where the checkpoint
    does not hold them per expert."""
    n = int(fused.down_proj.shape[0])
    plan = {"gate_up_proj": ("gate", "up")} if layout["has_gate"] else {"up_proj": ("up",)}
    plan["down_proj"] = ("down",)
    leaves: Dict[str, str] = {}
    keys: Dict[str, List[str]] = {}
    for param, roles in plan.items():
        groups = sources(f"{name}.{param}")
        if groups is None or len(groups) != len(roles):
            return None
        for role, group in zip(roles, groups):
            if len(group) != n:
                return None
            parts = [k.split(".") for k in group]
            if any(len(p) < 3 or p[-1] != "weight" or p[-3] != str(e) for e, p in enumerate(parts)):
                return None
            leaf = {p[-2] for p in parts}
            if len(leaf) != 1:
                return None
            leaves[role] = leaf.pop()
            keys[role] = group
    if len(set(leaves.values())) != len(leaves):
        return None
    return leaves, keys


def _stored_fused(name: str, layout: Dict[str, bool], keys, renamed: Dict[str, str]) -> Optional[Dict[str, str]]:
    """``{fused parameter: the checkpoint key that holds it whole}`` of fused module ``name`` (a key of the same
    name, or one transformers renames to it: GraniteMoE's ``input_linear.weight``), None where one is missing."""
    params = {_source_param(role, layout, bias) for role in ("up", "down")
              for bias in ((False, True) if layout["has_bias"] else (False,))}
    found = {p: f"{name}.{p}" if f"{name}.{p}" in keys else renamed.get(f"{name}.{p}") for p in sorted(params)}
    return None if None in found.values() else found


def linearize_experts(model: nn.Module, keys: Iterable[str]) -> List[str]:
    """Replace every fused experts module of ``model`` with :class:`LinearExperts` (parameters copied; on the meta
    device, shapes only), given the checkpoint's tensor names ``keys``. Where the checkpoint stores the experts one
    by one, records on the model which checkpoint tensor each new weight is (:func:`checkpoint_key`); where it
    stores the fused tensors, which slice of which (``FUSED_SLICES``, read by :mod:`.expert_view`). Every other
    parameter the checkpoint stores under another name (transformers' one-to-one renames) goes into
    ``CHECKPOINT_KEYS`` too, so every loader records them, fused experts or not. Returns the replaced modules'
    names."""
    from .checkpoint_map import CheckpointMap

    keys = set(keys)
    cmap = CheckpointMap(model, keys)
    renamed = {param: key for key, param in cmap.renamed().items()}
    # a parameter the checkpoint stores under another name (a multimodal model's language_model.model.* for
    # model.language_model.*): its weight row is named as the checkpoint names it, like a linearized expert's
    table: Dict[str, str] = {**renamed, **getattr(model, CHECKPOINT_KEYS, {})}
    model.__dict__[CHECKPOINT_KEYS] = table
    fused = [(n, m, lay) for n, m in model.named_modules() if (lay := fused_layout(m)) is not None]
    if not fused:
        return []
    done: List[str] = []
    slices: Dict[str, Tuple[str, int, str, Dict[str, bool]]] = dict(getattr(model, FUSED_SLICES, {}))
    for name, module, layout in fused:
        found = _roles(name, module, layout, cmap.sources)
        whole = None if found is not None else _stored_fused(name, layout, keys, renamed)
        if found is None and whole is None:
            continue
        if found is not None:
            leaves, ckpt = found
        else:
            leaves = {r: leaf for r, leaf in FUSED_LEAVES.items() if layout["has_gate"] or r != "gate"}
        tensors = {k: p for k, p in module.named_parameters(recurse=False)}
        linear = LinearExperts(module, layout, leaves)
        if not any(t.is_meta for t in tensors.values()):
            linear.load_from(tensors)
        del tensors
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, linear)
        for role, leaf in leaves.items():
            for e in range(linear.num_experts):
                own = f"{name}.{e}.{leaf}"
                if whole is not None:
                    slices[own + ".weight"] = (whole[_source_param(role, layout)], e, role, layout)
                    if layout["has_bias"]:
                        slices[own + ".bias"] = (whole[_source_param(role, layout, bias=True)], e, role, layout)
                    continue
                key = ckpt[role][e]
                table[own + ".weight"] = key
                if layout["has_bias"]:
                    table[own + ".bias"] = key[: -len("weight")] + "bias"
        done.append(name)
    model.__dict__[FUSED_SLICES] = slices
    return done


def checkpoint_key(model: nn.Module, name: str) -> Optional[str]:
    """The checkpoint tensor that holds linearized expert parameter ``name`` of ``model`` (None for others)."""
    return getattr(model, CHECKPOINT_KEYS, {}).get(name)


def same_inputs(modules: Dict[str, nn.Module], names: Iterable[str]) -> Dict[str, str]:
    """Among module ``names``: each expert's up projection -> its gate projection, which always reads the very
    same tensor (:meth:`LinearExperts._gate_up`), so their input statistics are one (half the memory of a block's
    expert statistics: 128 experts of width 2048 hold 4.3 GB of float64 ``XᵀX`` per projection)."""
    wanted = set(names)
    out: Dict[str, str] = {}
    for name in wanted:
        routed = routing_of(modules, name)
        if routed is None:
            continue
        roles = routed[0].expert(routed[1]).roles
        gate = f"{name.rpartition('.')[0]}.{roles.get('gate')}"
        if "gate" in roles and name.endswith("." + roles["up"]) and gate in wanted:
            out[name] = gate
    return out


@contextlib.contextmanager
def all_tokens_routed(model: nn.Module, on: bool):
    """Calibration's all-experts mode (``on``) for every :class:`LinearExperts` of ``model`` for the duration of
    the block, off again after it."""
    layers = [m for m in model.modules() if isinstance(m, LinearExperts)]
    for m in layers:
        m.all_tokens = bool(on)
    try:
        yield
    finally:
        for m in layers:
            m.all_tokens = False


def routing_of(modules: Dict[str, nn.Module], name: str) -> Optional[Tuple[LinearExperts, int]]:
    """``(its LinearExperts, expert index)`` of an expert's projection ``name``, else None."""
    parts = name.rsplit(".", 2)
    owner = modules.get(parts[0]) if len(parts) == 3 else None
    return (owner, int(parts[1])) if isinstance(owner, LinearExperts) else None
