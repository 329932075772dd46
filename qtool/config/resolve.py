"""Resolution: a recipe and a model make a plan, one row per quantizer with concrete shapes and block sizes
(layer rules in order, GGUF mixes' per-tensor types, super-block fallbacks, KV cache rows, rotations, folds)."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from ..choices import (GGML_SCALE_DTYPES, LEGACY_GGUF_TYPES, SUPER_BLOCK_FALLBACK, drop_activations,
                       weighs_activations, without_activations)
from ..coverage import weight_coverage
from ..errors import ConfigError
from ..families import family_of_model
from ..gguf_mixes import mix_type, tensor_role
from .layout import _fold_candidates, _kv_cache_rows, _rotation_plan, _smooth_groups, attention_modules
from .plan import AwqPlan, Plan, QuantizerPlan
from .schema import (_INPUT_WEIGHTED_TYPES, _INTEGER_INPUT_TYPES, DEFAULT_ACTIVATION_TYPES, DEFAULT_WEIGHT_TYPES,
                     ActivationSpec, AnalyzerSpec, LayerRule, Recipe, RoundingSpec, WeightSpec, _merge, name_matches)

if TYPE_CHECKING:
    from torch import nn


def input_channels_first(module: "nn.Module") -> bool:
    """Whether the module's weight holds its input channels first: a transposed convolution's weight is
    [in, out / groups, kernel...], transformers' Conv1D's (GPT-2) [in, out]. qtool's per-channel and per-block
    weight grids run along the first dimension's channels, so such a weight takes per-tensor encodings only."""
    from torch import nn

    return isinstance(module, nn.modules.conv._ConvTransposeNd) or type(module).__name__ == "Conv1D"


def _weight_layout(module: "nn.Module", spec: WeightSpec, where: str, name: str):
    from torch import nn

    w = getattr(module, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() == 0:
        return None
    shp = tuple(w.shape)
    if w.numel() == 0:
        raise ConfigError(f"{where}: {name}.weight has shape {list(shp)}, no values to quantize: add '{name}' to "
                          "ignore")
    if spec.granularity == "per_tensor":
        return (), None
    if input_channels_first(module):
        raise ConfigError(f"{where}.granularity: {name} is a {type(module).__name__}, whose weight's first dimension "
                          f"is its input channels: {spec.granularity} there would share scales across input, not "
                          "output, channels; use per_tensor")
    if spec.granularity == "per_channel":
        return (shp[0],) + (1,) * (len(shp) - 1), None
    b = spec.block_size
    if len(shp) < 2:
        raise ConfigError(f"{where}.block_size: {name}.weight has shape {list(shp)}; per_block needs 2+ dims")
    if isinstance(b, list):  # 2-D tiles of a Linear weight
        rows, cols = b
        if len(shp) != 2:
            raise ConfigError(f"{where}.block_size: {rows}x{cols} tiles are for a 2-D weight (a Linear's); "
                              f"{name}.weight has shape {list(shp)}: give it one block length")
        if shp[0] % rows or shp[1] % cols:
            raise ConfigError(f"{where}.block_size: {rows}x{cols} tiles do not divide {name}.weight of shape "
                              f"{list(shp)}")
        return (shp[0] // rows, shp[1] // cols), (rows, cols)
    if shp[1] % b and spec.scale_dtype in GGML_SCALE_DTYPES:  # (a GGUF type's block: the recipe may name no size)
        raise ConfigError(
            f"{where}: {name}.weight's input dimension {shp[1]} is no multiple of GGUF type {spec.scale_dtype}'s "
            f"block of {b}, and no fallback type's block divides it either (llama.cpp writes such a weight F16): "
            f"leave it float (ignore: ['{name}'])")
    if shp[1] % b:
        raise ConfigError(
            f"{where}.block_size: {b} does not divide the input dimension {shp[1]} of {name}.weight "
            f"(shape {list(shp)})"
        )
    shape = (shp[0], shp[1] // b) + (1,) * (len(shp) - 2)
    return shape, (1, b) + (-1,) * (len(shp) - 2)


def _last_dimension(module: "nn.Module", tensor: str) -> Optional[int]:
    """How wide the last dimension of a module's input or output is, where the module says so: a Linear's
    features, GPT-2's Conv1D's weight ([in, out]), an Embedding's width, a LayerNorm's or RMSNorm's (hidden states
    last); None elsewhere (a BatchNorm's channels are not the last dimension of an image)."""
    from torch import nn

    if isinstance(module, nn.Linear):
        return module.in_features if tensor == "input" else module.out_features
    if type(module).__name__ == "Conv1D":
        return int(module.weight.shape[0 if tensor == "input" else 1])
    if isinstance(module, nn.Embedding):
        return module.embedding_dim if tensor == "output" else None
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return int(module.normalized_shape[-1])
    w = getattr(module, "weight", None)
    if type(module).__name__.endswith("RMSNorm") and w is not None and w.dim() == 1:  # (transformers' own)
        return int(w.shape[0])
    return None


def _check_activation_blocks(module: "nn.Module", spec: ActivationSpec, tensor: str, where: str, name: str) -> None:
    """Per-block activations take blocks along their last dimension: refuse a block length that does not divide
    it where the module says how wide that is (:func:`_last_dimension`), and refuse them on a convolution, an
    image's BatchNorm, a GroupNorm or an InstanceNorm (the last dimension is an image's width or a sequence's
    length: their channels are dim 1)."""
    from torch import nn

    if spec.granularity == "per_block" and isinstance(module, (nn.modules.conv._ConvNd, nn.BatchNorm2d,
                                                               nn.BatchNorm3d, nn.GroupNorm,
                                                               nn.modules.instancenorm._InstanceNorm)):
        raise ConfigError(f"{where}.granularity: per_block activations take blocks along the last dimension, which "
                          f"for {name} ({type(module).__name__}) is not its channels (an image's width, a "
                          "sequence's length): give it per_tensor activations (a layers entry matching it), or none")
    width = _last_dimension(module, tensor) if spec.granularity == "per_block" else None
    if width is not None and width % spec.block_size:
        raise ConfigError(f"{where}.block_size: {spec.block_size} does not divide the last dimension {width} of "
                          f"{name}'s {tensor}s")


class _Mix:
    """A recipe's ``gguf_mix`` on one model: the GGUF type of each weight, as llama-quantize chooses it."""

    def __init__(self, recipe: Recipe, model: "nn.Module", source: str, importance_matrix: bool = False):
        from torch import nn

        family = family_of_model(model)
        # a module's name as the family's GGUF table knows it (GraniteMoE's block_sparse_moe experts are mlp's)
        self._gguf_name = family.gguf_key if family is not None else (lambda n: n)
        self.name = recipe.gguf_mix
        modules = dict(model.named_modules())
        layers = {layer for n in modules for role, layer in [self.role(n)] if role in ("attn_v", "attn_qkv")}
        if not layers:
            raise ConfigError(f"{source}: gguf_mix {self.name}: the model has no Llama-family decoder layers "
                              "(model.layers.N.self_attn.v_proj); llama-quantize's mixes are defined for those")
        self.n_layers = max(layers) + 1
        q = next((m for n, m in modules.items() if self.role(n) == ("attn_q", min(layers))), None)
        k = next((m for n, m in modules.items() if self.role(n) == ("attn_k", min(layers))), None)
        config = getattr(model, "config", None)  # llama-quantize has rules of its own for 8-expert models
        # (attn_v's rules read it, and Phi-3's fused attn_qkv's, which take them: its heads from the config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = [getattr(text, k, None) for k in ("num_attention_heads", "num_key_value_heads")]
        self.n_gqa = q.out_features // max(1, k.out_features) if isinstance(q, nn.Linear) and k is not None else \
            heads[0] // heads[1] if all(isinstance(h, int) and h > 0 for h in heads) else 1
        embed = next((m for n, m in modules.items() if self.role(n)[0] == "token_embd"), None)
        head = next((m for n, m in modules.items() if self.role(n)[0] == "output"), None)
        # (a family whose GGUF file always holds output.weight is untied to llama-quantize: token_embd's own rule)
        self.tied = embed is not None and (head is None or head.weight is embed.weight) and \
            not (family is not None and family.gguf_needs_output)
        self.n_expert = int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)
        w = recipe.defaults.weights
        self.has_imatrix = (importance_matrix or w.rounding.name == "gptq"
                            or weighs_activations(w.analyzer.kwargs().get("weighting")))
        self.embed_spec: Optional[WeightSpec] = None

    def role(self, name: str) -> Tuple[Optional[str], int]:
        """``(role, layer)`` of module ``name`` in llama-quantize's rules (:func:`gguf_mixes.tensor_role`)."""
        return tensor_role(self._gguf_name(name))

    def spec(self, name: str, module: "nn.Module", base: WeightSpec) -> WeightSpec:
        role, layer = self.role(name)
        if self.tied and role == "output" and self.embed_spec is not None:
            # the embedding table is the output layer: quantized once, so the file holds one tensor for both
            return self.embed_spec
        tied_table = self.tied and role == "token_embd"
        w = getattr(module, "weight", None)
        width = int(w.shape[1]) if w is not None and w.dim() == 2 else 0
        gguf_type = mix_type(self.name, "output" if tied_table else role, layer, self.n_layers, self.n_gqa, width,
                             self.has_imatrix, self.n_expert)
        spec = _merge(base, {"gguf_type": gguf_type}, WeightSpec, f"gguf_mix {self.name}")
        if tied_table:
            self.embed_spec = spec.model_copy(update={"rounding": RoundingSpec()})
            if weighs_activations(spec.analyzer.kwargs().get("weighting")):
                args = drop_activations(spec.analyzer.kwargs())
                self.embed_spec = self.embed_spec.model_copy(
                    update={"analyzer": AnalyzerSpec(name=spec.analyzer.name, **args)})
        return spec


def _super_block_fallback(module: "nn.Module", spec: WeightSpec, counts: Dict[Tuple[str, str], int]) -> WeightSpec:
    """``spec``, or the type llama-quantize falls back to when ``module``'s rows are not whole 256-element
    super-blocks of its K-quant type (Q4_K -> Q5_0, Q6_K -> Q8_0, ...; counted in ``counts``)."""
    w = getattr(module, "weight", None)
    if spec.scale_dtype not in SUPER_BLOCK_FALLBACK or w is None or w.dim() != 2 or w.shape[1] % 256 == 0:
        return spec
    was, now = spec.scale_dtype, SUPER_BLOCK_FALLBACK[spec.scale_dtype]
    counts[(was.upper(), now.upper())] = counts.get((was.upper(), now.upper()), 0) + 1
    return _merge(spec, {"gguf_type": now}, WeightSpec, f"gguf_type {now}")


# what reading a layer's weight as a tensor looks like, as opposed to asking its dtype or device
_NOT_A_READ = r"(?!\.(?:dtype|device|shape|size|ndim|numel|requires_grad_?|is_meta)\b)"


@functools.lru_cache(maxsize=None)
def _class_source(cls: type) -> str:
    """The source of ``cls`` and of its module bases, once per class (finding a class's source parses its whole
    file): torch's own classes and transformers' ``PreTrainedModel`` (thousands of lines, no layer of a model's own)
    left out; a class without source reads as none."""
    import inspect

    from torch import nn

    parts = []
    for c in cls.__mro__:
        if not (isinstance(c, type) and issubclass(c, nn.Module)) or c.__module__.startswith(
                ("torch.", "transformers.modeling_utils")):
            continue
        try:
            parts.append(inspect.getsource(c))
        except (OSError, TypeError):
            pass
    return "\n".join(parts)


def _weights_read_directly(named) -> Dict[str, str]:
    """``{module: its parent's class}`` of layers whose parent's code reads their ``weight`` and does nothing else
    with them (Mamba's and Qwen3-Next's ``conv1d``, which transformers' reference kernels take as a tensor; Mamba's
    ``dt_proj``): a weight quantizer applies when its layer is called, so on these it would never run while the
    file stored the weight quantized. From the sources of the parent's classes (its bases' too): a layer that the
    code calls, takes by ``getattr``, or hands on bare (``proj = self.proj``, ``for m in (self.q, self.k)``)
    anywhere is not one; a class without source reads as none."""
    from torch import nn

    out: Dict[str, str] = {}
    for name, module in named:
        if isinstance(module, nn.MultiheadAttention):  # (torch's own code, whose source is not read: it hands
            out[f"{name}.out_proj" if name else "out_proj"] = type(module).__name__  # out_proj.weight to F.*)
            continue
        children = [c for c, m in module.named_children() if isinstance(getattr(m, "weight", None), nn.Parameter)]
        if not children:
            continue
        for child in children:
            if _reads_only(type(module), child):
                out[f"{name}.{child}" if name else child] = type(module).__name__
    return out


@functools.lru_cache(maxsize=None)
def _reads_only(cls: type, child: str) -> bool:
    """Whether ``cls``'s code reads ``self.<child>.weight`` and does nothing with ``self.<child>`` but read its
    attributes or assign it (see :func:`_weights_read_directly`)."""
    src, attr = _class_source(cls), re.escape(child)
    uses = re.findall(rf"(?<![\w.])self\.{attr}\b(\.\w+|\s*=(?!=))?", src)
    return bool(re.search(rf"(?<![\w.])self\.{attr}\.weight\b{_NOT_A_READ}", src)
                and all(u and u not in (".forward", ".__call__") for u in uses)
                and not re.search(rf"getattr\(\s*self\s*,\s*[\"']{attr}[\"']", src))


def _both_names(name: str, stored_as: Dict[str, str]) -> Tuple[str, ...]:
    """A module's (or parameter's) name, and the checkpoint's where the model holds it under another (Mixtral's
    experts: mlp.experts.3.w1 in memory, block_sparse_moe.experts.3.w1 in the checkpoint, the encodings and the
    export): a pattern may name it either way."""
    stored = stored_as.get(name) or stored_as.get(f"{name}.weight", "")[:-len(".weight")] or name
    return (name,) if stored == name else (name, stored)


def takes_token_ids(module: "nn.Module", type_names: Optional[Tuple[str, ...]] = None) -> bool:
    """Whether ``module``'s input is integers (token ids: an Embedding's), which no activation quantizer takes
    (``type_names``: its :func:`_type_names`, where already known)."""
    return any(t in _INTEGER_INPUT_TYPES for t in (type_names or _type_names(module)))


def _type_names(module: "nn.Module") -> Tuple[str, ...]:
    """The module's class name and its base classes' (so ``type: Conv2d`` and the default types match subclasses
    such as EfficientNet's ``Conv2dStaticSamePadding``). MultiheadAttention's ``out_proj`` subclass of Linear is
    not a Linear here: attention reads its weight without calling it, so a quantizer on it would never run."""
    from torch import nn

    cls = type(module)
    if cls.__name__ == "NonDynamicallyQuantizableLinear":
        return (cls.__name__,)
    return tuple(c.__name__ for c in cls.__mro__ if isinstance(c, type) and issubclass(c, nn.Module)
                 and c is not nn.Module and "_qtool_base" not in c.__dict__)


# where qtool.model.experts records, on a model, the checkpoint tensor that holds each parameter it made under
# another name (Mixtral's experts: model.layers.0.block_sparse_moe.experts.0.w1.weight in the checkpoint): a weight
# row is named after its checkpoint tensor, which is what every exporter reads and writes
CHECKPOINT_KEYS = "_qtool_checkpoint_keys"

# the image/audio encoders and projectors of a multimodal language model: float unless a layers rule names them (as
# llm-compressor's recipes ignore them and llama.cpp keeps them in a separate float mmproj file)
MEDIA_TOWER = re.compile(r"(^|\.)(vision_tower|vision_model|visual|multi_modal_projector|audio_tower|mm_projector|"
                         r"connector|embed_vision|embed_audio)(\.|$)")  # (connector: Idefics3's and SmolVLM's)


def _expert_count(model: "nn.Module") -> int:
    """The routed experts per MoE layer the model's config names (0 for a dense model)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    # (DBRX keeps its count in a sub-config, ffn_config; a plain model's config may be a dict)
    fields = config if isinstance(config, dict) else getattr(config, "__dict__", {})
    nested = [v for v in fields.values() if hasattr(v, "to_dict") or isinstance(v, dict)]
    for cfg in [config, *nested]:
        for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
            value = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return value
    return 0


def _is_router(name: str, module: "nn.Module", tname: str, experts: int) -> bool:
    """A mixture-of-experts router: a ``*Router`` class (Llama 4's is a Linear), a Linear scoring the model's
    experts under a ``gate``/``router`` module name (Hunyuan's ``mlp.gate.wg``, JetMoE's ``router.layer``), or the
    one-output gate of a shared expert (Qwen2-MoE's ``shared_expert_gate``: float in llm-compressor's recipes, a
    plain Linear in vLLM, F32 in llama.cpp)."""
    if tname.endswith("Router"):
        return True
    parts = name.split(".")[-2:]
    out = getattr(module, "out_features", None)
    if experts and out == 1 and parts[-1] == "shared_expert_gate":
        return True
    return bool(experts) and out == experts and any(p in ("gate", "router") for p in parts)


def _names_leaf(pattern: str, name: str) -> bool:
    """Whether ``pattern`` spells ``name``'s last component as a word of its own (``*.mlp.gate``,
    ``re:.*\\.gate$``), rather than reaching it by wildcards alone."""
    leaf = re.escape(name.rpartition(".")[2])
    return re.search(rf"(?<![A-Za-z0-9_]){leaf}(?![A-Za-z0-9_])", pattern) is not None


def _output_layer(model: "nn.Module"):
    """The model's output layer (transformers' ``get_output_embeddings``), else None."""
    out = getattr(model, "get_output_embeddings", None)
    try:
        return out() if callable(out) else None
    except (NotImplementedError, AttributeError):
        return None


def _refuse_tied_balance(groups, named, untied: set, source: str, key: str) -> None:
    """A balance layer whose weight is another module's too (an output layer tied to the embedding table): the
    scale folded into its input columns would rescale the other module's weight, and the float model would
    change; found at the fold check only after a calibration pass. ``untied``: modules r1 unties first."""
    import torch

    owners: Dict[int, List[str]] = {}
    for name, module in named:  # (registered Parameters only: a parametrized weight is a new tensor each read)
        weight = module._parameters.get("weight")
        if isinstance(weight, torch.Tensor):
            owners.setdefault(id(weight), []).append(name)
    modules = dict(named)
    for g in groups:
        for b in g.balance:
            weight = modules[b]._parameters.get("weight")
            others = [n for n in owners.get(id(weight), []) if n != b] if b not in untied else []
            if others:
                raise ConfigError(f"{source}: {key}: {b}'s weight is tied to {others[0]}'s, so the scale folded "
                                  f"into {b}'s input channels would rescale {others[0]} too (the float model would "
                                  f"change); leave {b} out of {key}.mappings' balance")


def resolve_plan(recipe: Recipe, model: "nn.Module", source: str = "<recipe>", allow_unmatched: bool = False,
                 importance_matrix: bool = False) -> Plan:
    """One ``QuantizerPlan`` per quantizer, in module order. Later ``layers`` entries win. ``importance_matrix``:
    an importance matrix file will weight the searches (a ``gguf_mix`` then picks types as llama-quantize does
    with ``--imatrix``)."""
    from torch import nn

    plan = Plan()
    used = [False] * len(recipe.layers)
    weighted = [False] * len(recipe.layers)  # the rule reached a module with a weight
    activated = [False] * len(recipe.layers)  # its activations reached a tensor a quantizer can take
    token_inputs = [False] * len(recipe.layers)  # it asked for the inputs of a module that takes token ids
    ignore_named: List[Optional[str]] = [None] * len(recipe.ignore)  # the first module each ignore pattern names
    ignore_removed = [False] * len(recipe.ignore)  # it kept a module that could be quantized float
    fallbacks: Dict[Tuple[str, str], int] = {}  # (K-quant type, its fallback) -> weights
    mix = _Mix(recipe, model, source, importance_matrix) if recipe.gguf_mix is not None else None
    named = [(n, m) for n, m in model.named_modules() if n]
    # torch.export modules keep only parameters in plain submodules; their classes come from graph metadata
    exported_types = getattr(model, "qtool_module_types", None) or {}
    candidates = set()  # modules whose weight the recipe could quantize
    stored_as = getattr(model, CHECKPOINT_KEYS, None) or {}
    head = _output_layer(model)
    # media towers are float by default only in a model that generates text (CLIP's vision_model is half of what a
    # user quantizes)
    towers = head is not None
    experts = _expert_count(model)
    plan.expert_counts = _expert_counts(named)
    towered: List[str] = []  # media-tower modules left float by default
    effective: set = set()  # (rule, "weights" / "activations") that survive on some module
    shadowed_by: Dict[Tuple[int, str], int] = {}  # (rule, field) -> a later rule that set again what it set
    read_directly = _weights_read_directly([("", model), *named])
    read_float: List[Tuple[str, str]] = []  # (module, its parent's class) of weights left float for that
    kept: set = set()  # rules that reach a module ignore leaves in
    only_ignored: set = set()  # rules that reach an ignored module (those not in kept reach nothing else)
    for name, module in named:
        tname = exported_types.get(name, type(module).__name__)
        tnames = (tname,) if name in exported_types else _type_names(module)
        # ignore patterns are a safety net (recipes list lm_head for every model), so no-match is silent
        # the output layer answers to "lm_head" wherever a wrapper puts it (Llama 4's language_model.lm_head)
        names = _both_names(name, stored_as)
        aliases = names + (("lm_head",) if module is head and name != "lm_head" else ())
        hits = [j for j, pat in enumerate(recipe.ignore) if any(name_matches(pat, n) for n in aliases)]
        ignored = bool(hits)
        for j in hits:
            ignore_named[j] = ignore_named[j] or name
        w_cand = any(t in DEFAULT_WEIGHT_TYPES for t in tnames)
        a_cand = any(t in DEFAULT_ACTIVATION_TYPES for t in tnames)
        def _mixed(spec):
            return mix.spec(name, module, spec) if spec is not None and mix is not None else spec

        w_spec = _mixed(recipe.defaults.weights) if w_cand else None
        a_spec = recipe.defaults.activations if a_cand else None
        rule_w = rule_a = None
        tower = towers and MEDIA_TOWER.search(name) is not None
        # a mixture-of-experts router that is a Linear (Llama 4's): float by default, as every other family's
        router = _is_router(name, module, tname, experts)
        applied: List[Tuple[int, str]] = []  # (rule, "weights" / "activations") in rule order
        reached: List[int] = []  # the rules that reach this module
        opted_in = False  # a type rule that set neither field took the defaults for it
        for i, rule in enumerate(recipe.layers):
            if rule.match is not None and not any(name_matches(rule.match, n) for n in names):
                continue
            # a type rule alone does not reach into a media tower or a router (type: Linear is not meant for them),
            # unless it names the router's own class (type: Qwen3MoeTopKRouter)
            if (tower or router) and rule.match is None and not (
                    router and tname in rule.types() and tname not in DEFAULT_WEIGHT_TYPES):
                if any(t in rule.types() for t in tnames):  # (so it matched something: the plan's warning says
                    used[i] = weighted[i] = True  # why the tower is skipped)
                continue
            if router and not rule.types():
                if not _names_leaf(rule.match, name):
                    continue  # a pattern reaches a router only where it names it: not "*" or "re:.*mlp.*"
                w_cand = a_cand = True  # (transformers' *TopKRouter holds a bare weight, not a Linear)
            if rule.types():
                if not any(t in rule.types() for t in tnames):
                    continue
                # naming a type opts modules of that type in; a rule that sets neither field takes the defaults for
                # them (it said nothing else), one that sets a field sets that field alone
                if not rule.model_fields_set & {"weights", "activations"} and not applied:
                    w_spec = w_spec if w_cand else _mixed(recipe.defaults.weights)
                    a_spec = a_spec if a_cand else recipe.defaults.activations
                    opted_in = True
                w_cand = a_cand = True
            if not (w_cand or a_cand):
                continue  # a name pattern only refines modules that can be quantized
            used[i] = True
            reached.append(i)
            weighted[i] = weighted[i] or isinstance(getattr(module, "weight", None), nn.Parameter)
            if tower and rule.match is not None and not rule.model_fields_set & {"weights", "activations"}:
                opted_in = True  # (a pattern naming a media tower's layers quantizes them with the defaults)
            where = f"{source}: layers[{i}]"
            if "weights" in rule.model_fields_set and w_cand:
                w_spec = None if rule.weights is None else _merge(
                    w_spec or recipe.defaults.weights, rule.weights, WeightSpec, f"{where}.weights")
                rule_w = i
                applied.append((i, "weights"))
            if "activations" in rule.model_fields_set and a_cand:
                a_spec = None if rule.activations is None else _merge(
                    a_spec or recipe.defaults.activations, rule.activations, ActivationSpec, f"{where}.activations")
                rule_a = i
                applied.append((i, "activations"))
                if a_spec is not None:
                    takes_ids = takes_token_ids(module, tnames)
                    activated[i] = activated[i] or (a_spec.inputs and not takes_ids) or a_spec.outputs
                    token_inputs[i] = token_inputs[i] or (a_spec.inputs and takes_ids)
        if w_cand:
            candidates.add(name)
        for i in reached:
            (only_ignored if ignored else kept).add(i)
        if not ignored:  # (under a mix a weight starts from its mix type, which a null resets as well)
            _note_shadows(recipe.layers, applied, effective, shadowed_by, mix is not None and w_cand)
        if (tower or router) and rule_w is None and rule_a is None and not opted_in and not ignored:
            if tower and (w_cand or a_cand):
                towered.append(name)
            continue
        if ignored:
            for j in hits:
                ignore_removed[j] = ignore_removed[j] or w_cand or a_cand
            continue
        if (w_spec is not None or a_spec is not None) and name in read_directly:
            read_float.append((name, read_directly[name]))
            w_spec = a_spec = None  # (its input quantizer would never run either)
        if w_spec is not None:
            where = f"{source}: layers[{rule_w}].weights" if rule_w is not None else f"{source}: defaults.weights"
            w_spec = _super_block_fallback(module, w_spec, fallbacks)
            layout = _weight_layout(module, w_spec, where, name)
            if layout is not None:
                shape, block = layout
                plan.weight_specs[name] = w_spec
                analyzer_args = w_spec.analyzer.kwargs()
                rounding = w_spec.rounding
                if not any(t in _INPUT_WEIGHTED_TYPES for t in tnames):
                    # GPTQ and activation weighting need a weight that multiplies the input as x @ W.T
                    not_one = (" (transformers' Conv1D, GPT-2's Linear stored transposed, is not one)"
                               if tname == "Conv1D" else "")
                    if rounding.name != "nearest":
                        plan.warnings.append(f"{name} ({tname}): rounding {rounding.name} applies to Linear "
                                             f"and Conv1d/Conv2d layers{not_one}; this weight is rounded to nearest")
                        rounding = RoundingSpec()
                    weighting = analyzer_args.get("weighting")
                    if weighs_activations(weighting):
                        left = without_activations(weighting)
                        plan.warnings.append(f"{name} ({tname}): weighting by activations applies to "
                                             f"Linear and Conv1d/Conv2d layers{not_one}; this weight's search is "
                                             + ("unweighted" if left is None else f"weighted by {left} only"))
                        analyzer_args = drop_activations(analyzer_args)
                plan.quantizers.append(QuantizerPlan(
                    stored_as.get(f"{name}.weight", f"{name}.weight"), name, tname, "weight", w_spec.bitwidth, w_spec.symmetric,
                    w_spec.granularity, shape, block, w_spec.analyzer.name, rule_w,
                    tuple(analyzer_args.items()), w_spec.scale_dtype, rounding.name,
                    tuple(rounding.kwargs().items()), element=w_spec.element))
        if a_spec is not None:
            for tensor, on in (("input", a_spec.inputs and not any(t in _INTEGER_INPUT_TYPES for t in tnames)),
                               ("output", a_spec.outputs)):
                if on:
                    _check_activation_blocks(module, a_spec, tensor, f"{source}: layers[{rule_a}].activations"
                                             if rule_a is not None else f"{source}: defaults.activations", name)
                    plan.quantizers.append(QuantizerPlan(
                        f"{name}.{tensor}", name, tname, tensor, a_spec.bitwidth, a_spec.symmetric,
                        a_spec.granularity, (), (a_spec.block_size,) if a_spec.block_size else None,
                        "dynamic" if a_spec.dynamic else a_spec.analyzer.name,
                        rule_a, tuple(a_spec.analyzer.kwargs().items()), a_spec.scale_dtype,
                        dynamic=a_spec.dynamic, element=a_spec.element))
    if _aims_at_gguf(recipe):
        plan.warnings += (_grids_outside_gguf(plan.quantizers, source)
                          + _experts_apart(plan.quantizers, source, plan.expert_counts))
    for (was, now), n in sorted(fallbacks.items()):
        plan.warnings.append(f"{n} weight(s) of {was}: rows not a whole number of 256-element super-blocks, so "
                             f"{now} as llama-quantize falls back")
    for i, (rule, ok) in enumerate(zip(recipe.layers, used)):
        if rule.optional:
            continue
        if not ok:
            reached = "matches no module of the model" + _nearest_modules(rule, named, exported_types)
        elif not weighted[i] and rule.weights is not None and "weights" in rule.model_fields_set \
                and rule.activations is None:  # (LlamaRotaryEmbedding: nothing to quantize)
            reached = "matches only modules with no weight, so its weights quantize nothing"
        elif not activated[i] and token_inputs[i] and not (
                (rule.activations or {}).get("outputs") is False and recipe.defaults.activations is not None
                and recipe.defaults.activations.outputs):  # (outputs: false turning the defaults' off: an effect)
            reached = ("matches only modules whose inputs are integers (token ids), so its activations quantize "
                       "nothing (outputs: true quantizes their outputs)")
        else:
            continue
        msg = f"{source}: layers[{i}]: {_selector(rule)} {reached}"
        if not allow_unmatched:
            raise ConfigError(msg + " (pass --allow-unmatched to make this a warning)")
        plan.warnings.append(msg)
    for (i, field), j in sorted(shadowed_by.items()):
        if (i, field) not in effective:
            plan.warnings.append(f"{source}: layers[{i}] ({_selector(recipe.layers[i])}): its {field} change nothing: "
                                 f"layers[{j}] (later rules win) sets them again on every module it reaches; put the "
                                 "narrower rule after the broader one")
    for i in sorted(only_ignored - kept):
        plan.warnings.append(f"{source}: layers[{i}] ({_selector(recipe.layers[i])}): every module it reaches is in "
                             "ignore (which removes modules after every rule), so it changes nothing")
    kv_layers = set(attention_modules(named)) if recipe.kv_cache is not None else set()  # (ignore keeps a cache float)
    fused = _fused_expert_names(named, stored_as) if recipe.ignore else {}
    for j, pat in enumerate(recipe.ignore):
        problem = _ignore_problem(pat, ignore_named[j], ignore_removed[j], named, exported_types,
                                  {q.module for q in plan.quantizers}, kv_layers, fused)
        if problem is None:
            continue
        msg = f"{source}: ignore[{j}]: {pat!r} {problem}"
        if not allow_unmatched:
            raise ConfigError(msg + " (pass --allow-unmatched to make this a warning)")
        plan.warnings.append(msg)
    if recipe.kv_cache is not None:
        plan.quantizers += _kv_cache_rows(recipe, named, source)
        kv = {q.module for q in plan.quantizers if q.tensor in ("k_cache", "v_cache")}
        plan.kv_float = [n for n in attention_modules(named) if n not in kv]
    if read_float:
        named_here = ", ".join(f"{n} (in a {parent})" for n, parent in read_float[:3])
        more = f" and {len(read_float) - 3} more" if len(read_float) > 3 else ""
        plan.warnings.append(f"{named_here}{more}: the model's code reads the weight without calling the layer, so a "
                             "quantizer there would never run while the file stored the weight quantized: left "
                             "float")
    if towered:
        roots = sorted({n[:MEDIA_TOWER.search(n).end(2)] for n in towered})
        plan.warnings.append(f"{len(towered)} module(s) of the model's media encoders stay float "
                             f"({', '.join(roots[:4])}{' ...' if len(roots) > 4 else ''}), as llm-compressor's recipes "
                             "and llama.cpp's mmproj keep them: a layers rule whose match names them quantizes them")
    plan.coverage = weight_coverage(model, {q.module for q in plan.weights}, candidates,
                                    lambda n: (towers and MEDIA_TOWER.search(n) is not None)
                                    or any(name_matches(pat, m) for pat in recipe.ignore
                                           for m in _both_names(n, stored_as)), stored_as)
    unreached = plan.coverage.warning()
    if unreached:
        plan.warnings.append(unreached)
    if not plan.quantizers:
        plan.warnings.append(f"{source}: the recipe puts no quantizer on this model")
    if recipe.rotate is not None:
        plan.rotation = _rotation_plan(recipe.rotate, model, source)
        if "r3" in plan.rotation.rotations:
            kv = tuple(q.module for q in plan.quantizers if q.tensor == "k_cache")
            plan.rotation = dataclasses.replace(plan.rotation, kv_modules=kv)
    if recipe.smoothquant is not None:
        plan.smoothing = _smooth_groups(recipe.smoothquant, named, source, family_of_model(model))
        # (an expert's up_proj scaling its own down_proj is inside the routing, and fine)
        routed = [g for g in plan.smoothing if ".experts." not in g.smooth and any(".experts." in b for b in g.balance)]
        if routed and not recipe.smoothquant.mappings:  # (a scaled norm changes what the router reads)
            kept = [g for g in plan.smoothing if g not in routed]
            if not kept:
                raise ConfigError(f"{source}: smoothquant: every default mapping scales a norm that feeds a "
                                  f"mixture-of-experts router ({routed[0].smooth}), which a folded scale would "
                                  "reroute; give smoothquant.mappings")
            plan.smoothing = kept
            said = routed[0].smooth + (", ..." if len(routed) > 1 else "")
            plan.warnings.append(
                f"{source}: smoothquant: {len(routed)} norm(s) feeding mixture-of-experts layers left unsmoothed "
                f"({said}): the norm feeds the router too, and a scale folded into it reroutes tokens; the default "
                "mappings smooth the rest (give smoothquant.mappings to choose)")
        rotated = {m for r in (plan.rotation.online() if plan.rotation else []) for m in r.modules}
        clash = next((g for g in plan.smoothing if rotated & set(g.balance)), None)
        if clash is not None:
            raise ConfigError(f"{source}: smoothquant scales {sorted(rotated & set(clash.balance))[0]}'s input "
                              "channels, which r4 rotates at run time; leave that mapping out (smoothquant.mappings) "
                              "or r4 out of rotate")
    if recipe.awq is not None:
        groups = _smooth_groups(recipe.awq, named, source, family_of_model(model), key="awq")
        rotated = {m for r in (plan.rotation.online() if plan.rotation else []) for m in r.modules}
        clash = next((g for g in groups if rotated & set(g.balance)), None)
        if clash is not None:
            raise ConfigError(f"{source}: awq scales {sorted(rotated & set(clash.balance))[0]}'s input channels, "
                              "which r4 rotates at run time; leave that mapping out (awq.mappings) or r4 out of "
                              "rotate")
        plan.awq = AwqPlan(tuple(groups), recipe.awq.grid, recipe.awq.duo_scaling, recipe.awq.objective)
    untied = {plan.rotation.head} if plan.rotation is not None and plan.rotation.untie else set()
    for key, groups in (("smoothquant", plan.smoothing), ("awq", plan.awq.groups if plan.awq else ())):
        _refuse_tied_balance(groups, named, untied, source, key)
    if recipe.fold_batch_norms:
        transposed: List[Tuple[str, str]] = []
        plan.folds = _fold_candidates(named, transposed)
        if transposed:
            (conv, norm), more = transposed[0], len(transposed) - 1
            plan.warnings.append(f"{source}: fold_batch_norms: {norm} follows the transposed convolution {conv}"
                                 + (f" (and {more} more such pair(s))" if more else "")
                                 + ", which qtool does not fold into: it stays a norm of its own")
        if not plan.folds and not transposed:
            plan.warnings.append(f"{source}: fold_batch_norms: no BatchNorm follows a convolution in this model")
    if plan.rotation is None or not plan.rotation.untie:
        plan.tied = _tied_weights(model, plan.weights, stored_as)
    return plan


def _selector(rule: LayerRule) -> str:
    return " ".join(filter(None, [f"match {rule.match!r}" if rule.match else "",
                                  f"type {rule.type!r}" if rule.type else ""]))


def _note_shadows(rules: List[LayerRule], applied: List[Tuple[int, str]], effective: set,
                  shadowed_by: Dict[Tuple[int, str], int], weights_start_set: bool = False) -> None:
    """Which of the rules that shaped one module left something on it, field by field: a rule's weights (or
    activations) are set again by a later rule that gives every key it gave, or null. A null is undone by any later
    rule (a partial rule merges over the defaults, not over a null) only where no earlier rule had set that field:
    otherwise the null is what resets it to the defaults (``weights_start_set``: the weights start from a spec of
    their own, a GGUF mix's type, which a null resets too). ``effective`` gets each (rule, field) that left
    something; ``shadowed_by`` a later rule that undid one."""
    for k, (i, field) in enumerate(applied):
        mine = getattr(rules[i], field)
        resets = mine is None and (any(f == field for _, f in applied[:k])
                                   or (field == "weights" and weights_start_set))
        later = next((j for j, f in applied[k + 1:] if f == field and (
            getattr(rules[j], field) is None or (mine is None and not resets)
            or (mine is not None and set(mine) <= set(getattr(rules[j], field))))), None)
        if later is None:
            effective.add((i, field))
        else:
            shadowed_by.setdefault((i, field), later)


GGUF_GRID_NOTE = "a grid no GGUF type holds"  # (in the warning a job writing another format leaves out)
GGUF_STACK_NOTE = "GGUF stores a projection's experts as one tensor of one type"  # (likewise)
GGUF_GRID_REFUSED = "export --format gguf refuses them (--gguf-fallback writes them as floats)"
GGUF_GRID_STORED = "this run's --gguf-fallback stores them as floats"  # (what a GGUF job with the fallback says)


def _aims_at_gguf(recipe: Recipe) -> bool:
    """True for a recipe written for GGUF: a ``gguf_mix``, a default ``gguf_type``, or default weights on a legacy
    GGUF grid with the float16 scales only GGUF recipes ask for."""
    w = recipe.defaults.weights
    if recipe.gguf_mix is not None or (w is not None and w.scale_dtype in GGML_SCALE_DTYPES):
        return True
    return (w is not None and w.scale_dtype == "float16" and w.element == "int" and w.granularity == "per_block"
            and w.block_size == 32 and (w.bitwidth, w.symmetric) in LEGACY_GGUF_TYPES)


def _grids_outside_gguf(quantizers: List[QuantizerPlan], source: str) -> List[str]:
    """One warning per layers rule of a GGUF recipe that gives weights a grid no GGUF type holds (a rule's own
    ``bitwidth`` leaves the GGUF type, as the merge rule says), which ``export --format gguf`` refuses at the end."""
    off: Dict[int, List[QuantizerPlan]] = {}
    for q in quantizers:
        if q.tensor == "weight" and q.rule is not None and q.spec.gguf_block_type is None:
            off.setdefault(q.rule, []).append(q)
    return [f"{source}: layers[{i}] gives {len(qs)} weight(s) such as {qs[0].module} {GGUF_GRID_NOTE} "
            f"({_grid_words(qs[0].spec)}): {GGUF_GRID_REFUSED}; "
            "a gguf_type in the rule (gguf_type: q8_0) keeps them GGUF blocks" for i, qs in sorted(off.items())]


def _expert_counts(named) -> Dict[str, int]:
    """``{experts module: its number of experts}`` (children named 0, 1, ...) of a mixture-of-experts model."""
    out: Dict[str, int] = {}
    for n, m in named:
        if n.endswith(".experts"):
            children = [c for c, _ in m.named_children()]
            if children and all(c.isdigit() for c in children):
                out[n] = len(children)
    return out


def _experts_apart(quantizers: List[QuantizerPlan], source: str, counts: Dict[str, int]) -> List[str]:
    """A GGUF recipe's warning where one mixture-of-experts projection's experts get more than one grid, or some
    none (llama.cpp stacks them into one tensor of one type: ``export --format gguf`` refuses them); ``counts``:
    the model's experts per layer (:func:`_expert_counts`: the last experts, ignored, have no row to count by)."""
    from .fused import expert_stacks

    for where, members, left in expert_stacks(quantizers, counts):
        types = {q.spec.gguf_block_type or _grid_words(q.spec) for q in members.values()}
        if len(types) > 1 or left:
            what = (f"{' and '.join(sorted(types))}" if len(types) > 1 else
                    f"some quantized and expert(s) {', '.join(map(str, left[:3]))}{' ...' if len(left) > 3 else ''} "
                    "float")
            return [f"{source}: {where}: its experts get {what}; {GGUF_STACK_NOTE}, and export --format gguf "
                    "refuses them (one rule for every expert of a projection)"]
    return []


def _grid_words(spec) -> str:
    axis, block = spec.axis_and_block()
    layout = f"blocks of {block} along dim {axis}" if block is not None else str(spec.granularity)
    kind = "symmetric" if spec.symmetric else "asymmetric"
    return f"{spec.bitwidth}-bit {kind} {spec.element if spec.is_float else ''} {layout}".replace("  ", " ")


def tied_parameters(model: "nn.Module") -> Dict[str, str]:
    """``{parameter name: its first name}`` of every parameter the model also holds under an earlier name (a tied
    output layer's weight -> the embedding table, the name a checkpoint stores it under)."""
    first: Dict[int, str] = {}
    later: Dict[str, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        stored = first.setdefault(id(p), n)
        if stored != n:
            later[n] = stored
    return later


def _tied_weights(model: "nn.Module", weights, stored_as: Dict[str, str]) -> Dict[str, str]:
    """``{quantizer name: the parameter's first name}`` of weight rows on a tied parameter (:func:`tied_parameters`),
    the first name as the checkpoint stores it (``stored_as``: a multimodal model's language_model.model.*)."""
    later = tied_parameters(model)
    return {q.name: stored_as.get(later[f"{q.module}.weight"], later[f"{q.module}.weight"]) for q in weights
            if f"{q.module}.weight" in later}


def _fused_expert_names(named, stored_as: Dict[str, str]) -> Dict[str, Tuple[str, Tuple[str, ...], bool]]:
    """``{name: (experts module, its per-expert projections, whether only a pattern saying "experts" means it)}`` of
    each fused expert tensor qtool splits into one Linear per expert, by the names a user sees it by: the
    checkpoint's (GraniteMoE's ``block_sparse_moe.input_linear.weight``, and without ``.weight``), and transformers'
    own (``experts.gate_up_proj``: gpt-oss's file too). Where the experts' projections have other names (Mixtral's
    w1/w3/w2), a Llama recipe's ``*.down_proj`` safety net matches transformers' ``experts.down_proj`` without
    meaning it: only a pattern that says "experts" counts there."""
    out: Dict[str, Tuple[str, Tuple[str, ...], bool]] = {}
    for n, m in named:
        if type(m).__name__ != "LinearExperts" or not m.num_experts:
            continue
        roles = m.expert(0).roles  # (role -> the projection's name)
        gate = m.layout["has_gate"]
        for key, projections in (("gate_up_proj" if gate else "up_proj", ("gate", "up") if gate else ("up",)),
                                 ("down_proj", ("down",))):
            leaves = tuple(roles[r] for r in projections)
            aliases = set()
            stored = stored_as.get(f"{n}.{key}")
            if stored is not None:
                aliases |= {stored, stored[:-len(".weight")] if stored.endswith(".weight") else stored}
            out.update((a, (n, leaves, False)) for a in aliases)
            own = all(roles[r] == f"{r}_proj" for r in projections)
            out.setdefault(f"{n}.{key}", (n, leaves, not own))
    return out


def _ignore_problem(pattern: str, first: Optional[str], removed: bool, named, exported_types,
                    quantized, kv_layers=(), fused=None) -> Optional[str]:
    """Why an ``ignore`` pattern keeps nothing float that it looks meant to, or None. A pattern that names no module
    is the documented safety net (``lm_head`` on a model without one) unless it is a type's name or close to a
    module's; one that names only modules holding quantized layers (a decoder block, ``*.mlp``) left those layers
    quantized. (Naming a module no quantizer takes, a norm or fused experts, is fine: the coverage counts them.)"""
    import difflib

    # the checkpoint's fused expert tensors (what a user sees on disk): no module of that name, so the pattern was
    # silently no match (or matched other modules alone), and every expert stayed quantized
    hit = next((f for f in sorted(fused or {}) if name_matches(pattern, f)
                and (not fused[f][2] or "experts" in pattern)), None)
    if hit is not None and any(m.startswith(fused[hit][0] + ".") and m.rpartition(".")[2] in fused[hit][1]
                               for m in quantized):  # (its projections still quantized)
        experts, projections, _ = fused[hit]
        base = "*.experts" if pattern.startswith("re:") or any(c in pattern for c in "*?[") else experts
        return (f"names {hit}, fused experts qtool splits into one layer per expert and projection, so it keeps "
                f"nothing float: {', '.join(repr(f'{base}.*.{p}') for p in projections)} name them")
    if first is not None:
        inside = next((m for m in sorted(quantized) if m.startswith(first + ".")), None)
        if removed or inside is None or first in kv_layers:  # (an attention layer whose KV cache it keeps float)
            return None
        hint = f"{pattern}.*" if not pattern.startswith("re:") else f"{first}.*"
        return (f"names {first}, a {type(dict(named)[first]).__name__} that no quantizer takes, and the layers "
                f"inside it ({inside} ...) stay quantized: '{hint}' names them")
    kinds = {(exported_types or {}).get(n, type(m).__name__) for n, m in named}
    if pattern in kinds:
        return (f"is a module type, and ignore takes module names: a layers rule {{type: {pattern}, weights: null, "
                "activations: null} keeps that type float")
    if pattern.startswith("re:") or any(c in pattern for c in "*?["):
        return None
    names = [n for n, _ in named]
    owner, _, leaf = pattern.rpartition(".")
    if leaf in ("weight", "bias") and owner in names:
        return f"is a parameter's name, and ignore takes module names: '{owner}'"
    # whole names only (what a pattern matches): one ending in the pattern's last part (a wrapper's
    # model.language_model.embed_tokens for model.embed_tokens), else one a letter or two off
    near = [n for n in names if n.rpartition(".")[2] == leaf] or difflib.get_close_matches(pattern, names, n=1,
                                                                                           cutoff=0.8)
    if near and near[0] != pattern:
        return f"matches no module (did you mean '{near[0]}'?)"
    return None


def _nearest_modules(rule: LayerRule, named, exported_types=None) -> str:
    """A hint for a rule that matched nothing: the module names (or types) closest to what it asked for
    (``exported_types``: a torch.export module's types, by name)."""
    import difflib

    if rule.match is not None:
        from torch import nn

        hit = next(((n, m) for n, m in named if name_matches(rule.match, n)), None)
        if hit is not None and rule.types():  # the names match: the types do not
            kinds = sorted({(exported_types or {}).get(n, type(m).__name__) for n, m in named
                            if name_matches(rule.match, n)})
            return (f" (the modules match '{rule.match}' names are {', '.join(kinds[:4])}"
                    f"{' ...' if len(kinds) > 4 else ''}, none of type {' or '.join(rule.types())})")
        if hit is not None:
            n, m = hit
            kind = type(m).__name__
            held = [d for _, d in m.named_modules() if d is not m]
            if any(t in DEFAULT_WEIGHT_TYPES for d in held for t in _type_names(d)):  # (a container: the rule most
                inside = f"{rule.match}.*" if not rule.match.startswith("re:") else f"{n}.*"  # likely means those)
                return f" that a quantizer can take ({n} is a {kind}; match '{inside}' names the layers inside it)"
            if held:  # (DBRX's experts: modules holding bare 3-D parameters; the plan's coverage names them)
                return (f" that a quantizer can take ({n} is a {kind}, and no module inside it is a layer type a "
                        "quantizer takes)")
            w = getattr(m, "weight", None)
            if kind == "NonDynamicallyQuantizableLinear":  # (a type rule's quantizer there would never run)
                return (f" that a quantizer can take ({n} is a MultiheadAttention's out_proj, whose weight attention "
                        "reads without calling the layer)")
            if isinstance(w, nn.Parameter) and w.dim() >= 2:  # (a matrix: a router; not a norm's scale vector)
                return (f" that a quantizer can take ({n} is a {kind}, which a name alone does not opt in: add "
                        f"type: {kind} to the rule)")
            return f" that a quantizer can take ({n} is a {kind})"
        want = re.sub(r"[\^$*?\[\]().+\\]", "", rule.match[3:] if rule.match.startswith("re:") else rule.match)
        names = [n for n, _ in named]
        close = difflib.get_close_matches(want, names, n=3, cutoff=0.4)
        if not close:  # try one more level: compare against name prefixes of the same depth
            depth = rule.match.count(".") + 1
            prefixes = sorted({".".join(n.split(".")[:depth]) for n in names})
            close = difflib.get_close_matches(want, prefixes, n=3, cutoff=0.4)
        return f" (nearest module names: {', '.join(close)})" if close else ""
    types = sorted({type(m).__name__ for _, m in named})
    close = [c for t in rule.types() for c in difflib.get_close_matches(t, types, n=2, cutoff=0.5)]
    return f" (module types nearby: {', '.join(close)})" if close else ""
