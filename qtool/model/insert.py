"""Put quantizers on a model's modules as a plan says, keeping every original module and parameter name.

A planned module keeps its place in the tree; its class is swapped for a subclass (``Quantized<Class>``) whose
forward quantizes the first tensor input, runs the original forward with the weight fake-quantized, and quantizes
the output. Quantizers live in ``module.qtool_quantizers`` (a ``ModuleDict`` keyed ``weight``/``input``/
``output``), so ``model.named_parameters()`` still lists the checkpoint's own names first and unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from ..config import Plan, QuantizerPlan
from .online import key_rotation, rotate_keys
from ..quant import (DynamicFloatQuantizeDequantize, DynamicQuantizeDequantize, FloatQuantizeDequantize,
                     GgmlQuantizeDequantize, QuantizeDequantize, QuantizerBase)

__all__ = ["insert_quantizers", "remove_quantizers", "iter_quantizers", "QuantizedModuleMixin", "QUANTIZERS_ATTR"]

_ATTR = QUANTIZERS_ATTR = "qtool_quantizers"  # the ModuleDict a quantized module holds its quantizers in
# the names an attention layer's cache argument goes by (transformers renamed it; the older first)
CACHE_KWARGS = ("past_key_value", "past_key_values")
_CLASS_CACHE: Dict[type, type] = {}
_STORED = "_qtool_stored_weight"


def _plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor else t


class QuantizedModuleMixin:
    """Forward with fake-quantized first input, weight and output."""

    def __reduce_ex__(self, protocol):
        # the class is made at run time, one per wrapped type (_quantized_class): pickle (torch.save of a whole
        # model, multiprocessing) finds it by the type it wraps
        state = self.__getstate__()
        state.pop("_qtool_weight_cache", None)  # (the fake-quant weight, made again on the next call)
        return _new_quantized, (self._qtool_base,), state

    def forward(self, *args, **kwargs):  # type: ignore[override]
        qs = getattr(self, _ATTR)
        if "input" in qs and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            q = qs["input"]
            # while calibrating, a Linear's or convolution's input fake-quant may be shared (see QuantizeDequantize)
            shareable = self._qtool_reads_input_only and isinstance(q, QuantizeDequantize) and q._calibrating
            x = q(args[0], output_read_only=True) if shareable else q(args[0])
            args = (_plain(x),) + tuple(args[1:])
        if "k_cache" in qs:  # an attention layer: keys and values are quantized where they reach the cache
            key = next((k for k in CACHE_KWARGS if k in kwargs), CACHE_KWARGS[-1])
            kwargs[key] = _QuantizedKV(qs, kwargs.get(key), key_rotation(self))
        if "weight" in qs:
            self.__dict__["weight"] = _fake_quant_weight(self, qs["weight"])  # shadows the parameter for this call
            try:
                out = super().forward(*args, **kwargs)
            finally:
                del self.__dict__["weight"]
        else:
            out = super().forward(*args, **kwargs)
        if "output" in qs and isinstance(out, torch.Tensor) and out.is_floating_point():
            out = _plain(qs["output"](out))
        return out


class _QuantizedKV:
    """Stands in for an attention layer's ``past_key_values`` for one call: ``update(keys, values, ...)`` (what
    Llama-family attention calls after RoPE) fake-quantizes keys and values with the layer's ``k_cache`` /
    ``v_cache`` quantizers, then hands them to the real cache (when there is one) or back to the layer; every other
    attribute is the real cache's. With a key rotation (r3, qtool.model.online) the keys are quantized as
    ``k R`` and handed on as ``Q(k R) Rᵀ``."""

    def __init__(self, qs, cache, rotation=None):
        self._qs, self._cache, self._rotation = qs, cache, rotation

    def update(self, key_states, value_states, *args, **kwargs):
        rot, kq = self._rotation, self._qs["k_cache"]
        if rot is None or not kq.enabled:  # (switched off: the float keys as they are, not rotated there and back)
            k = _plain(kq(key_states))
        else:
            k = rotate_keys(rot, _plain(kq(rotate_keys(rot, key_states))), inverse=True)
        v = _plain(self._qs["v_cache"](value_states))
        return (k, v) if self._cache is None else self._cache.update(k, v, *args, **kwargs)

    def __getattr__(self, name):
        cache = self.__dict__.get("_cache")
        if cache is None:
            raise AttributeError(name)
        return getattr(cache, name)


def _fake_quant_weight(module: nn.Module, quantizer: QuantizerBase) -> torch.Tensor:
    """The fake-quant weight; cached while neither the weight nor the quantizer's range changes.

    Without gradients (calibration, evaluation) a weight is quantized once instead of on every call, which keeps
    calibration close to the cost of a float forward pass. The cache costs one float copy of the quantized weights.
    With gradients enabled the weight is quantized on every call so autograd sees it.
    """
    w = module._parameters["weight"]
    if not quantizer.enabled:
        return w
    stored = module.__dict__.get(_STORED)
    if stored is not None:
        return stored
    if torch.is_grad_enabled() or quantizer._calibrating or torch.jit.is_tracing():
        return _plain(quantizer(w))
    key = (id(w), w._version, w.dtype, w.device, id(quantizer.min), quantizer.min._version,
           id(quantizer.max), quantizer.max._version)
    cached = module.__dict__.get("_qtool_weight_cache")
    if cached is not None and cached[0] == key:
        return cached[1]
    out = _plain(quantizer(w))
    module.__dict__["_qtool_weight_cache"] = (key, out)
    return out


def fake_quant_weight(module: nn.Module) -> Optional[torch.Tensor]:
    """The weight ``module`` computes with while quantized (its stored codes' values where a rounding algorithm
    chose them), or None when it has no weight quantizer."""
    qs = getattr(module, _ATTR, None)
    if not isinstance(qs, nn.ModuleDict) or "weight" not in qs:
        return None
    q = qs["weight"]
    enabled, q.enabled = q.enabled, True
    try:
        return _fake_quant_weight(module, q)
    finally:
        q.enabled = enabled


@contextlib.contextmanager
def computing_with(weights: Dict[nn.Module, Optional[torch.Tensor]]):
    """Inside the block each module computes with the given weight (None: its float weight) in place of its own
    (fake-quant or float) one, whether or not it has a weight quantizer and whether or not that is switched on
    (AWQ scores candidates with the quantizers off); all is restored after."""
    saved = []
    try:
        for mod, w in weights.items():
            qs = getattr(mod, _ATTR, None)
            value = mod._parameters["weight"] if w is None else w
            if isinstance(qs, nn.ModuleDict) and "weight" in qs and qs["weight"].enabled:  # the stored slot wins
                saved.append((mod, True, mod.__dict__.get(_STORED)))
                mod.__dict__[_STORED] = value
            else:
                saved.append((mod, False, mod._parameters["weight"].data))
                if w is not None:
                    mod._parameters["weight"].data = w.to(mod._parameters["weight"].dtype)
        yield
    finally:
        for mod, stored_slot, old in reversed(saved):
            if not stored_slot:
                mod._parameters["weight"].data = old
            elif old is None:
                mod.__dict__.pop(_STORED, None)
            else:
                mod.__dict__[_STORED] = old


def set_stored_weight(module: nn.Module, weight: torch.Tensor) -> None:
    """Make ``weight`` (dequantized codes a rounding algorithm chose) the module's fake-quant weight, in place of
    round-to-nearest of its float weight; the float weight itself is left as it is (the reference)."""
    if tuple(weight.shape) != tuple(module._parameters["weight"].shape):
        raise ValueError(f"stored weight of shape {list(weight.shape)} does not fit {list(module.weight.shape)}")
    module.__dict__[_STORED] = weight


def has_stored_weight(module: nn.Module) -> bool:
    return module.__dict__.get(_STORED) is not None


@contextlib.contextmanager
def without_stored_weight(module: nn.Module):
    """Inside the block the module's fake-quant weight is round-to-nearest again (to compare against it)."""
    stored = module.__dict__.pop(_STORED, None)  # the weight cache only ever holds round-to-nearest: still valid
    try:
        yield module
    finally:
        if stored is not None:
            module.__dict__[_STORED] = stored


# forwards that only read their input and drop it (their input's fake-quant may be shared, see QuantizeDequantize)
_READS_INPUT_ONLY = (nn.Linear.forward, nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward)


def _quantized_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"Quantized{cls.__name__}", (QuantizedModuleMixin, cls),
                                 {"_qtool_base": cls, "_qtool_reads_input_only": cls.forward in _READS_INPUT_ONLY})
    return _CLASS_CACHE[cls]


def _new_quantized(cls: type):
    quantized = _quantized_class(cls)
    return quantized.__new__(quantized)


def make_analyzer(q: QuantizerPlan):
    from ..quant.analyzers import ANALYZERS, MinMaxEncodingAnalyzer

    cls = ANALYZERS.get(q.analyzer)
    if cls is None:  # encodings made elsewhere (imported) need no analyzer to be applied
        return MinMaxEncodingAnalyzer(q.shape, q.block_size)
    return cls(q.shape, q.block_size, **dict(q.analyzer_args))


def make_quantizer(q: QuantizerPlan, device=None) -> QuantizerBase:
    """The quantizer module of plan row ``q``; it carries ``q.spec`` (``quantizer.spec``), which every consumer
    reads to know its grid (int, float element, GGUF type; dynamic or not)."""
    per_token = q.granularity == "per_token"
    if q.dynamic:
        if q.element != "int":
            block = q.block_size[0] if q.block_size else None
            quantizer = DynamicFloatQuantizeDequantize(q.element, q.granularity.value, q.scale_dtype, block)
        else:
            quantizer = DynamicQuantizeDequantize(q.bitwidth, q.symmetric, per_token=per_token)
        quantizer.spec = q.spec
        return quantizer
    if q.element != "int":
        quantizer = FloatQuantizeDequantize(q.shape, q.element, q.scale_dtype, make_analyzer(q), q.block_size)
    elif q.spec.ggml is not None:
        # codes GPTQ chooses afterwards can make up for clipped extremes: search those too (signround's offsets
        # move a code at most one step, so its start is round-to-nearest's grid, where clipping measured worse)
        quantizer = GgmlQuantizeDequantize(q.shape, q.spec.ggml, make_analyzer(q), q.block_size,
                                           clip=q.rounds_layerwise)
    else:
        quantizer = QuantizeDequantize(q.shape, q.bitwidth, q.symmetric, encoding_analyzer=make_analyzer(q),
                                       block_size=q.block_size, scale_dtype=q.scale_dtype)
    quantizer.spec = q.spec
    return quantizer.to(device) if device is not None else quantizer


def insert_quantizers(model: nn.Module, plan: Plan) -> Dict[str, QuantizerBase]:
    """Attach one quantizer per plan row; returns them keyed by the plan's quantizer name.

    Eager modules get the class swap described above; a ``torch.export`` module (an FX graph whose submodules
    only hold parameters) gets ``call_module`` nodes for the quantizers wired into its graph instead.
    """
    modules = dict(model.named_modules())
    graph_mode = is_exported_graph(model)
    out: Dict[str, QuantizerBase] = {}
    for q in plan.quantizers:
        module = modules[q.module]
        if not hasattr(module, _ATTR):
            if not graph_mode:
                module.__class__ = _quantized_class(type(module))
            module.add_module(_ATTR, nn.ModuleDict())
        param = next(iter(module.parameters(recurse=False)), None)
        device = param.device if param is not None else None
        quantizer = make_quantizer(q, device)
        getattr(module, _ATTR)[q.tensor] = quantizer
        out[q.name] = quantizer
    if graph_mode:
        _wire_graph(model, plan)
    elif out:
        _mark_quantized(model)
    return out


_MARKED = "_qtool_marked_configs"  # the configs insert_quantizers marked quantized (remove_quantizers unmarks)


def _mark_quantized(model: nn.Module) -> None:
    """Mark the model's Hugging Face configs quantized, as transformers marks a model it loads quantized: its
    model code then calls a layer it would otherwise read the weight of (Jamba's and Falcon-Mamba's ``dt_proj``:
    ``self.dt_proj.weight @ x``, or ``self.dt_proj(x)`` "in case the model has been quantized"), so the fake-quant
    model runs the branch the quantized file runs where it is served, with the layer's quantizers in it."""
    marked = []
    for module in model.modules():
        config = getattr(module, "config", None)
        # (a config many modules share is marked once: the mark itself says it is done)
        if hasattr(config, "to_json_string") and not hasattr(config, "_is_quantized"):
            config._is_quantized = True  # (transformers never writes it to config.json)
            marked.append(config)
    if marked:
        model.__dict__.setdefault(_MARKED, []).extend(marked)


def is_exported_graph(model: nn.Module) -> bool:
    return isinstance(model, torch.fx.GraphModule) and any(
        "nn_module_stack" in n.meta for n in model.graph.nodes if n.op == "call_function")


def exported_module_types(model: nn.Module) -> Dict[str, str]:
    """Original class names of a torch.export module's submodules (from the graph's nn_module_stack)."""
    types: Dict[str, str] = {}
    for node in model.graph.nodes:
        stack = node.meta.get("nn_module_stack") if node.op == "call_function" else None
        if stack:
            path, qualname = list(stack.values())[-1]
            types.setdefault(_graph_path(path), qualname.rsplit(".", 1)[-1])
    return types


def _graph_path(path: str) -> str:
    # nn_module_stack paths look like "layers.0.fc" or "L['self'].layers[0].fc" depending on the tracer
    return path.replace("L['self'].", "").replace("[", ".").replace("]", "")


def _wire_graph(gm: torch.fx.GraphModule, plan: Plan) -> None:
    graph = gm.graph
    planned = {}
    for q in plan.quantizers:
        planned.setdefault(q.module, set()).add(q.tensor)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        module = _graph_path(list(stack.values())[-1][0])
        tensors = planned.get(module)
        if not tensors:
            continue
        weight_name = f"{module}.weight"
        w_idx = next((i for i, a in enumerate(node.args)
                      if isinstance(a, torch.fx.Node) and a.op == "get_attr" and a.target == weight_name), None)
        if w_idx is None:
            continue  # an op of this module that does not use its weight (e.g. a reshape)
        args = list(node.args)
        if "weight" in tensors:
            with graph.inserting_before(node):
                args[w_idx] = graph.call_module(f"{module}.{_ATTR}.weight", (args[w_idx],))
        if "input" in tensors:
            i_idx = next((i for i, a in enumerate(args) if i != w_idx and isinstance(a, torch.fx.Node)
                          and a.op != "get_attr"), None)
            if i_idx is not None:
                with graph.inserting_before(node):
                    args[i_idx] = graph.call_module(f"{module}.{_ATTR}.input", (args[i_idx],))
        node.args = tuple(args)
        if "output" in tensors:
            with graph.inserting_after(node):
                qout = graph.call_module(f"{module}.{_ATTR}.output", (node,))
            node.replace_all_uses_with(qout, delete_user_cb=lambda user: user is not qout)
    graph.lint()
    gm.recompile()


def set_quantization(model: nn.Module, enabled: bool, only: "Optional[set]" = None) -> None:
    """Switch fake-quant on or off: every quantized module, or only the modules named in ``only`` (the others
    then get the opposite), e.g. ``set_quantization(model, True, only={"fc1"})`` quantizes fc1 alone."""
    for name, module in model.named_modules():
        qs = getattr(module, _ATTR, None)
        if isinstance(qs, nn.ModuleDict):
            on = enabled if only is None else (enabled if name in only else not enabled)
            for q in qs.values():
                q.enabled = on


def quantized_modules(model: nn.Module) -> Dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if hasattr(m, _ATTR)}


def drop_weight_caches(model: nn.Module) -> None:
    """Forget every module's cached fake-quant weight and stored replacement (plain attributes, which moving the
    module to another device leaves behind): sequential calibration does this as it releases a finished block."""
    for module in model.modules():
        _forget_weights(module)


def _forget_weights(module: nn.Module) -> None:
    module.__dict__.pop("_qtool_weight_cache", None)
    module.__dict__.pop(_STORED, None)


def remove_quantizers(model: nn.Module) -> None:
    """Undo ``insert_quantizers`` on an eager model: original classes, no quantizer submodules."""
    for module in model.modules():
        if hasattr(module, _ATTR):
            del module._modules[_ATTR]
            _forget_weights(module)
            module.__class__ = module._qtool_base
    for config in model.__dict__.pop(_MARKED, []):
        config.__dict__.pop("_is_quantized", None)


def iter_quantizers(model: nn.Module) -> Iterator[Tuple[str, QuantizerBase]]:
    """``(name, quantizer)`` for every inserted quantizer, named like the plan (``<module>.<tensor>``)."""
    for name, module in model.named_modules():
        qs = getattr(module, _ATTR, None)
        if isinstance(qs, nn.ModuleDict):
            for tensor, quantizer in qs.items():
                yield f"{name}.{tensor}", quantizer
