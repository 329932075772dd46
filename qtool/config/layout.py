"""What a model's layout says to a recipe's whole-model transforms: which modules a rotation touches (dense and
mixture-of-experts decoders, encoders' r4), which attention layers hold a KV cache, which BatchNorms fold, and
SmoothQuant's groups. Per-family facts come from :mod:`qtool.families`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

from ..errors import ConfigError
from ..families import LLAMA_SMOOTH_MAPPINGS, Family, rms_norm_classes
from .plan import BatchNormFold, QuantizerPlan, RotationPlan, SmoothGroup
from .schema import AwqSpec, Recipe, RotateSpec, SmoothMapping, SmoothQuantSpec, name_matches

if TYPE_CHECKING:
    from torch import nn


_ATTENTION_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


_LAYER_LINEARS = _ATTENTION_LINEARS + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _moe_parts(modules, layer: str, hidden: int) -> Optional[Tuple[Tuple[str, ...], Tuple[str, ...]]]:
    """``(readers, writers)`` under ``layer`` of a mixture-of-experts MLP qtool can rotate: linearized experts
    (``mlp.experts``, each with gate/up/down roles), a router reading the hidden width (``mlp.gate``), and
    optionally shared experts (``mlp.shared_expert(s)``, gate/up/down) and a shared expert's gate
    (``mlp.shared_expert_gate``); None for any other MLP."""
    from torch import nn

    experts = modules.get(f"{layer}.mlp.experts")
    router = modules.get(f"{layer}.mlp.gate")
    if not (hasattr(experts, "num_experts") and hasattr(experts, "expert")):
        return None
    w = getattr(router, "weight", None)
    if w is None or w.dim() != 2 or int(w.shape[1]) != hidden:
        return None
    readers, writers = ["mlp.gate"], []
    for e in range(experts.num_experts):
        roles = experts.expert(e).roles
        if "down" not in roles:
            return None
        readers += [f"mlp.experts.{e}.{roles[r]}" for r in ("gate", "up") if r in roles]
        writers.append(f"mlp.experts.{e}.{roles['down']}")
    for shared in ("mlp.shared_expert", "mlp.shared_experts"):
        parts = [f"{shared}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        if all(isinstance(modules.get(f"{layer}.{p}"), nn.Linear) for p in parts):
            readers += parts[:2]
            writers.append(parts[2])
    if isinstance(modules.get(f"{layer}.mlp.shared_expert_gate"), nn.Linear):
        readers.append("mlp.shared_expert_gate")
    return tuple(readers), tuple(writers)


def _rotation_plan(spec: RotateSpec, model: "nn.Module", source: str) -> RotationPlan:
    """``rotate`` on ``model``: every decoder layer must be Llama-family (RMSNorms, q/k/v/o and gate/up/down
    Linears and nothing else that reads or writes the residual stream), and each rotated width must have a
    Hadamard construction (qtool.quant.hadamard)."""
    from torch import nn

    from ..quant.hadamard import HadamardError, hadamard_order

    where = f"{source}: rotate"
    rms_norms = rms_norm_classes()  # x/rms(x)·w, nothing else
    modules = dict(model.named_modules())
    layers = sorted({n[:-len(".self_attn.v_proj")] for n in modules if n.endswith(".self_attn.v_proj")},
                    key=lambda n: (len(n), n))
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    config = getattr(model, "config", None)
    if not layers and list(spec.rotations) == ["r4"]:
        return _encoder_r4_plan(spec, modules, where)
    if not layers or embed is None or config is None:
        raise ConfigError(f"{where}: the model has no Llama-family decoder layers (model.layers.N.self_attn.v_proj) "
                          "to rotate (r4 alone also rotates a BERT-style encoder's MLP output layer)")
    hidden = int(embed.weight.shape[1])
    moe = []
    for layer in layers:
        parts = _moe_parts(modules, layer, hidden)
        known = _LAYER_LINEARS
        if parts is not None:
            moe.append((layer,) + parts)
            known = _ATTENTION_LINEARS + parts[0] + parts[1]
        for part in _LAYER_LINEARS if parts is None else _ATTENTION_LINEARS:
            found = modules.get(f"{layer}.{part}")
            if not isinstance(found, nn.Linear):  # (gpt-oss's and GraniteMoE's fused experts have no such module)
                what = "does not exist" if found is None else f"is a {type(found).__name__}, not a Linear layer"
                raise ConfigError(f"{where}: {layer}.{part} {what}; qtool rotates Llama-family decoder layers "
                                  "(Llama, Mistral, Qwen2, Qwen3 and their mixture-of-experts variants)")
        for norm in ("input_layernorm", "post_attention_layernorm") if "r1" in spec.rotations else ():
            found = modules.get(f"{layer}.{norm}")  # (only r1 folds norms; r2-r4 rotate between two Linears)
            if found is None:  # (OLMo-2 normalizes after attention and the MLP, not before)
                raise ConfigError(f"{where}: {layer}.{norm} does not exist; r1 folds the norms of pre-norm "
                                  "Llama-family layers (an RMSNorm before attention and one before the MLP); r2, r3 "
                                  "and r4 alone fold none")
            if type(found).__name__ not in rms_norms:
                raise ConfigError(f"{where}: {layer}.{norm} is a {type(found).__name__}, not an RMSNorm r1 can "
                                  f"fold ({', '.join(rms_norms)}); r2, r3 and r4 alone fold none")
        known = set(known)
        extra = sorted(n for n, m in modules.items() if n.startswith(layer + ".") and isinstance(m, nn.Linear)
                       and n[len(layer) + 1:] not in known)
        if extra:
            raise ConfigError(f"{where}: {extra[0]} is a Linear layer qtool does not know how to rotate "
                              "(Llama-family layers have q/k/v/o and gate/up/down only, or experts, a router and "
                              "shared experts)")
    embed_name = next(n for n, m in modules.items() if m is embed)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((n for n, m in modules.items() if m is head), None) if isinstance(head, nn.Linear) else None
    final_norm = next((n for n, m in modules.items() if n.endswith("norm") and n.count(".") <= 1
                       and type(m).__name__ in rms_norms and not n.startswith(layers[0])), None)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(config, "head_dim", None) or (hidden // heads if heads else 0))
    v = modules[f"{layers[0]}.self_attn.v_proj"]
    if "r1" in spec.rotations:
        if final_norm is None:
            raise ConfigError(f"{where}: r1 folds the final RMSNorm into the output layer; the model has none qtool "
                              "can fold")
    if "r2" in spec.rotations and (not head_dim or v.out_features % head_dim):
        raise ConfigError(f"{where}: r2 rotates each attention head, but v_proj's {v.out_features} outputs are not "
                          f"whole heads of {head_dim}")
    block = spec.block_size or hidden
    if "r1" in spec.rotations and hidden % block:
        raise ConfigError(f"{where}: block_size {block} does not divide the hidden size {hidden}")
    if "r4" in spec.rotations:
        moe_writers = {layer: writers for layer, _, writers in moe}
        widths: Dict[int, str] = {}
        for layer in layers:
            for n in moe_writers.get(layer, ("mlp.down_proj",)):
                widths.setdefault(modules[f"{layer}.{n}"].in_features, f"{layer}.{n}")
        _check_r4_width(widths, "down_proj", where)
    if "r3" in spec.rotations and not head_dim:
        raise ConfigError(f"{where}: r3 rotates each attention head's queries and keys, but the model's config "
                          "gives no head_dim (nor num_attention_heads)")
    for r, width, what in (("r1", block, "hidden size" if block == hidden else "block_size"),
                           ("r2", head_dim, "head_dim"), ("r3", head_dim, "head_dim")):
        if r in spec.rotations:
            try:
                hadamard_order(width)
            except HadamardError as e:
                raise ConfigError(f"{where}: {r} rotates the {what} {width}: {e}") from None
    # r1 folds the final norm into the output layer alone: a tied output layer gets its own copy first
    untie = "r1" in spec.rotations and head_name is not None and head.weight is embed.weight
    return RotationPlan(tuple(spec.rotations), spec.type, spec.seed, hidden, head_dim, embed_name,
                        final_norm or "", head_name, tuple(layers), block, untie, moe=tuple(moe))


def _encoder_r4_plan(spec: RotateSpec, modules, where: str) -> RotationPlan:
    """r4 alone on a BERT-style encoder (``encoder.layer.N.intermediate.dense`` → activation →
    ``encoder.layer.N.output.dense``): the MLP's output Linear gets its input rotated online, as ``down_proj`` does
    in a Llama. Nothing else changes, so nothing else about the architecture matters."""
    from torch import nn

    layers = sorted({n[:-len(".intermediate.dense")] for n, m in modules.items()
                     if n.endswith(".intermediate.dense") and isinstance(m, nn.Linear)
                     and isinstance(modules.get(n[:-len("intermediate.dense")] + "output.dense"), nn.Linear)},
                    key=lambda n: (len(n), n))
    if not layers:
        raise ConfigError(f"{where}: the model has neither Llama-family decoder layers (model.layers.N.self_attn."
                          "v_proj) nor BERT-style MLPs (encoder.layer.N.intermediate.dense, output.dense) to rotate")
    widths: Dict[int, str] = {}
    for layer in layers:
        widths.setdefault(modules[f"{layer}.output.dense"].in_features, f"{layer}.output.dense")
    _check_r4_width(widths, "output.dense", where)
    return RotationPlan(("r4",), spec.type, spec.seed, 0, 0, "", "", None, tuple(layers), down="output.dense")


def _check_r4_width(widths: Dict[int, str], part: str, where: str) -> None:
    """r4 rotates the input of every ``part`` (each layer's, each expert's and shared expert's) by one Hadamard
    order: one width, with a Hadamard construction. ``widths``: each width found, with a module that has it."""
    from ..quant.hadamard import HadamardError, hadamard_order

    if len(widths) != 1:  # (a Qwen2-MoE's shared expert wider than its routed ones, in every layer alike)
        found = "; ".join(f"{w} ({name})" for w, name in sorted(widths.items()))
        raise ConfigError(f"{where}: r4 rotates every {part}'s input by one Hadamard order, and their widths "
                          f"differ: {found}")
    try:
        hadamard_order(min(widths))
    except HadamardError as e:
        raise ConfigError(f"{where}: r4 rotates the intermediate size {min(widths)}: {e}") from None


def attention_modules(named) -> List[str]:
    """The modules whose keys and values a ``kv_cache`` quantizes: those with ``k_proj`` and ``v_proj`` Linear
    children (Llama-family attention)."""
    from torch import nn

    return [name for name, module in named if isinstance(getattr(module, "k_proj", None), nn.Linear)
            and isinstance(getattr(module, "v_proj", None), nn.Linear)]


def _kv_cache_rows(recipe: Recipe, named, source: str) -> List[QuantizerPlan]:
    """A ``k_cache`` and a ``v_cache`` row for every attention module with ``k_proj``/``v_proj`` children (not
    ignored): per tensor, or per KV head (encoding shape ``(heads, 1, 1)`` over ``(batch, heads, tokens, dim)``)."""
    spec = recipe.kv_cache
    rows: List[QuantizerPlan] = []
    modules = dict(named)
    for name in attention_modules(named):
        if any(name_matches(p, name) for p in recipe.ignore):
            continue
        module = modules[name]
        k = module.k_proj
        head_dim = getattr(module, "head_dim", None)
        if spec.granularity == "per_head":
            if not isinstance(head_dim, int) or k.out_features % head_dim:
                raise ConfigError(f"{source}: kv_cache.granularity: per_head needs the attention module's head_dim "
                                  f"({name} has none that divides its k_proj width)")
            shape, gran = (k.out_features // head_dim, 1, 1), "per_channel"
        else:
            shape, gran = (), "per_tensor"
        for tensor in ("k_cache", "v_cache"):
            rows.append(QuantizerPlan(f"{name}.{tensor}", name, type(module).__name__, tensor, 8, True, gran, shape,
                                      None, "minmax", element=spec.element))
    if not rows:
        raise ConfigError(f"{source}: kv_cache: the model has no attention module with k_proj and v_proj "
                          "(Llama-family attention) to quantize the keys and values of")
    return rows


def _fold_candidates(named, transposed: Optional[List[Tuple[str, str]]] = None) -> List[BatchNormFold]:
    """Each BatchNorm1d/2d/3d with running statistics and affine parameters whose nearest preceding convolution
    in module order (not transposed, not already paired) has as many output channels. ``transposed`` collects
    ``(conv, norm)`` where the nearest is a transposed convolution (not folded: said, not passed over)."""
    from torch import nn

    out: List[BatchNormFold] = []
    conv = None
    for name, module in named:
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.modules.conv._ConvTransposeNd)):
            conv = (name, module)
        elif isinstance(module, nn.modules.batchnorm._BatchNorm) and conv is not None and \
                isinstance(conv[1], nn.modules.conv._ConvTransposeNd):
            if transposed is not None:
                transposed.append((conv[0], name))
            conv = None
        elif isinstance(module, nn.modules.batchnorm._BatchNorm) and conv is not None:
            if module.affine and module.track_running_stats and module.running_var is not None \
                    and module.num_features == conv[1].out_channels:
                out.append(BatchNormFold(conv[0], name))
            conv = None
    return out


def _smooth_groups(spec: Union[SmoothQuantSpec, AwqSpec], named, source: str, family: Optional[Family],
                   key: str = "smoothquant") -> List[SmoothGroup]:
    """Resolve SmoothQuant mappings on the model: every module matching ``smooth`` with the Linear modules that
    match ``balance`` in the nearest enclosing module that holds any: its parent, else its grandparent (a BERT
    value projection's ``attention.self`` beside the ``attention.output.dense`` it feeds), and so on up to its
    block (an element of a module list, whose parent holds every other block too), in module order. A mapping
    that pairs nothing is an error when the recipe gave it, and skipped when it is a default (a model without
    up_proj, say). The defaults are the model family's (Llama-style blocks for a model of no known family).
    ``spec``: the recipe's ``smoothquant`` or ``awq`` (``key``, which errors name)."""
    from torch import nn

    defaults = LLAMA_SMOOTH_MAPPINGS if family is None else family.smooth_mappings
    if not spec.mappings and not defaults:
        raise ConfigError(f"{source}: {key}: {family.no_smoothing.replace('smoothquant.mappings', key + '.mappings')}")
    mappings = spec.mappings or [SmoothMapping(**m) for m in defaults]
    modules = dict(named)
    groups: List[SmoothGroup] = []
    for i, m in enumerate(mappings):
        found = 0
        for name, module in named:
            if not name_matches(m.smooth, name):
                continue
            balance = ()
            for parent in _ancestors(name):
                balance = tuple(n for n, mod in named if n.startswith(parent) and n != name
                                and isinstance(mod, nn.Linear) and any(name_matches(p, n) for p in m.balance))
                if balance:
                    break
            else:
                continue
            width = _output_width(module)
            bad = [n for n in balance if modules[n].in_features != width]
            if width is None or bad:
                raise ConfigError(f"{source}: {key}: {name} ({type(module).__name__}) cannot scale the inputs "
                                  f"of {', '.join(bad or balance)} (its output has no per-channel weight of their "
                                  "input width)")
            groups.append(SmoothGroup(name, balance, getattr(spec, "alpha", 0.0), i))
            found += 1
        if not found and spec.mappings:
            raise ConfigError(f"{source}: {key}.mappings[{i}]: smooth {m.smooth!r} with balance {m.balance} "
                              "pairs no modules of this model")
    if not groups:
        raise ConfigError(f"{source}: {key}: none of the default mappings "
                          f"({family.title if family is not None else 'Llama-style'} norms and projections) pairs "
                          f"modules of this model; give {key}.mappings")
    return groups


def _ancestors(name: str) -> List[str]:
    """The prefixes of ``name``'s parent, grandparent, ... up to the root or to the first element of a module list
    (``layers.3.``: a block), nearest first."""
    parts = name.split(".")[:-1]
    out = []
    while True:
        out.append(".".join(parts) + "." if parts else "")
        if not parts or parts[-1].isdigit():
            return out
        parts = parts[:-1]


def _output_width(module: "nn.Module") -> Optional[int]:
    """The number of output channels a per-channel scale can be folded into: a norm's weight length, or a
    Linear's output rows."""
    from torch import nn

    if isinstance(module, nn.Linear):
        return module.out_features
    w = getattr(module, "weight", None)
    if isinstance(w, nn.Parameter) and w.dim() == 1 and "norm" in type(module).__name__.lower():
        return int(w.shape[0])
    return None
