"""How much of a model's weights a plan quantizes, and which large weights no quantizer can reach.

A weight here is a parameter of two or more dimensions (norms and biases are not), each counted once however
many modules share it (a tied ``lm_head``). qtool quantizes the weights of the module types a recipe can target
(``Linear``, convolutions, ``Embedding``, ...); a parameter held any other way (transformers 5 stores a
mixture-of-experts layer's experts as one module with 3-D ``gate_up_proj``/``down_proj``) has no quantizer, and
on a real MoE model that is most of the weights. The plan says so instead of leaving them float without a word.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

if TYPE_CHECKING:  # (config's layer imports no torch at module level: the CLI checks choices before loading it)
    from torch import nn

__all__ = ["WeightCoverage", "weight_coverage", "WARN_SHARE"]

# weights qtool cannot quantize are named in a warning once together they are this share of the model's weight
# parameters (a mixture-of-experts model's fused experts are most of it; GPT-2's Conv1D layers too)
WARN_SHARE = 0.01


@dataclass(frozen=True)
class WeightCoverage:
    total: int  # weight parameters of the model (tensors of 2+ dimensions, each once)
    # (modules whose quantizer takes the parameter, its size) of each weight parameter the plan quantizes
    quantized_by: Tuple[Tuple[FrozenSet[str], int], ...] = ()
    # (parameter name, shape, owning module's type) of weights no quantizer can reach and the recipe did not
    # exclude, largest first
    unreachable: Tuple[Tuple[str, Tuple[int, ...], str], ...] = ()

    @property
    def quantized(self) -> int:
        """The weight parameters the plan puts a quantizer on."""
        return sum(n for _, n in self.quantized_by)

    def without(self, modules: Set[str]) -> "WeightCoverage":
        """The coverage once ``modules``' weights are written float after all (a format that cannot hold them):
        a parameter still counts where another module's quantizer takes it."""
        kept = ((mods - modules, n) for mods, n in self.quantized_by)
        return replace(self, quantized_by=tuple((mods, n) for mods, n in kept if mods))

    @property
    def share(self) -> float:
        return self.quantized / self.total if self.total else 0.0

    def describe(self) -> str:
        return f"weights quantized: {100 * self.share:.1f} % of {_count(self.total)} parameters"

    def large(self) -> Tuple[Tuple[str, Tuple[int, ...], str], ...]:
        """The unreachable weights a warning names: all of them once they are ``WARN_SHARE`` of the model's weight
        parameters together, leaving out routers (float by design) and tables whose first dimension is 1 (position
        embeddings and class tokens, added to activations rather than multiplied with them)."""
        named = tuple(u for u in self.unreachable if u[1][0] != 1 and "Router" not in u[2])
        return named if sum(_numel(s) for _, s, _ in named) >= WARN_SHARE * self.total else ()

    def warning(self) -> str:
        """One line naming the large unreachable weights ("" when there are none)."""
        big = self.large()
        if not big:
            return ""
        share = sum(_numel(s) for _, s, _ in big) / self.total
        named = ", ".join(f"{n} {list(s)} ({t})" for n, s, t in big[:3])
        more = f" and {len(big) - 3} more" if len(big) > 3 else ""
        # (MultiheadAttention's out_proj: attention reads its weight without calling it, so no rule opts it in)
        layers = sorted({t for n, _, t in big if n.rsplit(".", 1)[-1] == "weight"
                         and t != "NonDynamicallyQuantizableLinear"})
        if len(layers) == len({t for _, _, t in big}):  # (layers holding a weight: a type rule can opt them in)
            # (a transposed convolution's or GPT-2's Conv1D's weight is [in, out, ...]: per_tensor scales only)
            transposed = [t for t in layers if t.startswith("ConvTranspose") or t == "Conv1D"]
            why = (f"a layer type the defaults leave float: a layers rule with type: {layers[0]} opts it in"
                   + (f" ({', '.join(transposed)}: with per_tensor weights)" if transposed else ""))
        else:
            why = "a module type qtool cannot quantize yet"
        # ignore takes a layer's name for its weight (a bare parameter, MultiheadAttention's in_proj_weight, by its
        # own name)
        acks = ", ".join(n.rpartition(".")[0] if n.rpartition(".")[2] in ("weight", "bias") and "." in n else n
                         for n, _, _ in big[:3])
        return (f"{len(big)} weight tensor(s), {100 * share:.1f} % of the model's weight parameters, have no "
                f"quantizer in qtool and stay float: {named}{more} ({why}; list them under ignore to acknowledge "
                f"it: {acks}{more})")

    def to_json(self):
        return {"parameters": self.total, "quantized": self.quantized, "share": round(self.share, 6),
                "unreachable": [{"name": n, "shape": list(s), "module_type": t} for n, s, t in self.unreachable]}


def weight_coverage(model: "nn.Module", quantized: Set[str], candidates: Set[str],
                    ignored: Callable[[str], bool], stored_as: Optional[Dict[str, str]] = None) -> WeightCoverage:
    """``quantized``: modules whose ``weight`` the plan quantizes; ``candidates``: modules whose ``weight`` a
    recipe could quantize (a weight of theirs left float is the recipe's choice); ``ignored(name)``: whether the
    recipe's ignore list names a module or parameter; ``stored_as``: the checkpoint's name of a parameter held
    under another (an unreachable weight is named as the checkpoint and the export name it). Works on meta-device
    models."""
    holders: Dict[int, List[Tuple[str, str, str, "nn.Parameter"]]] = {}  # parameter -> every (module, name)
    # (a torch.export module's submodules are plain holders: their classes are the exported model's, by name)
    exported = getattr(model, "qtool_module_types", None) or {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            if p.dim() >= 2:
                holders.setdefault(id(p), []).append((mod_name, p_name, exported.get(mod_name, type(module).__name__),
                                                      p))
    total = 0
    unreachable = []
    quantized_by = []
    for held in holders.values():
        n = held[0][3].numel()
        total += n
        takers = frozenset(mod for mod, p_name, _, _ in held if p_name == "weight" and mod in quantized)
        if takers:
            quantized_by.append((takers, n))
        elif not any((p_name == "weight" and mod in candidates) or ignored(mod)
                     or ignored(f"{mod}.{p_name}" if mod else p_name) for mod, p_name, _, _ in held):
            mod, p_name, tname, p = held[0]
            name = f"{mod}.{p_name}" if mod else p_name
            unreachable.append(((stored_as or {}).get(name, name), tuple(int(d) for d in p.shape), tname))
    unreachable.sort(key=lambda u: -_numel(u[1]))
    return WeightCoverage(total, tuple(quantized_by), tuple(unreachable))


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
