"""The recipes qtool ships (package data), found by name, and the words that describe any recipe: its first
comment line, whether it needs data, and its grid in a table cell."""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from ..choices import GGML_SCALE_DTYPES, LEGACY_GGUF_TYPES, SUPER_BLOCK_FALLBACK, weighs_activations
from ..errors import ConfigError
from .schema import (_INTEGER_INPUT_TYPES, DEFAULT_ACTIVATION_TYPES, DEFAULT_WEIGHT_TYPES, ActivationSpec, Recipe,
                     _Spec, rule_specs)


RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"  # the shipped recipes (package data)


def shipped_recipes() -> Dict[str, Path]:
    """``{name: path}`` of the recipes that ship with qtool (``w8a8``, ``w4a16-block32``, ...)."""
    return {p.stem: p for p in sorted(RECIPES_DIR.glob("*.yaml"), key=lambda p: p.stem)}  # (fp8 before fp8-block)


def recipe_file(arg: Union[str, Path]) -> Path:
    """The file a recipe argument names: a path to a YAML file, or the name of a shipped recipe (``w8a8`` or
    ``w8a8.yaml``; a file of that name in the working directory wins). Raises ``ConfigError`` with the shipped
    names, and the nearest ones, when it is neither."""
    import difflib
    import os

    if not isinstance(arg, (str, os.PathLike)):  # (a library caller's parsed YAML, say)
        raise ConfigError(f"a recipe is a shipped recipe's name, a path to a YAML file or a RecipeFile (got "
                          f"{type(arg).__name__})")
    arg = os.fspath(arg)  # (str() of another PathLike is its repr)
    path = Path(arg)
    if _is(path.is_file):
        return path
    if "\n" in arg.strip() or (arg.lstrip().startswith("{") and ":" in arg) or re.match(r"\s*[\w-]+:\s", arg):
        raise ConfigError(f"a recipe is a shipped recipe's name or a path to a YAML file, not its text (got text "
                          f"beginning {arg.strip().splitlines()[0][:60]!r}): write it to a file")
    shipped = shipped_recipes()
    name = path.name[:-len(".yaml")] if path.name.endswith(".yaml") else path.name
    if str(arg) in (name, path.name) and name in shipped:
        return shipped[name]
    if _is(path.is_dir):
        raise ConfigError(f"{arg}: is a directory, not a recipe file")
    # names that begin with what was typed first (w4a16 -> w4a16-block32), then the closest spellings
    starts = sorted((n for n in shipped if n.startswith(name + "-")), key=len)[:2] if name else []
    close = (starts + [n for n in difflib.get_close_matches(name, list(shipped), n=3, cutoff=0.5)
                       if n not in starts])[:3]
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    families = sorted({n.split("-")[0] for n in shipped})  # the names' stems: w4a16, gguf, fp8 ... (one short line)
    raise ConfigError(f"{str(arg)[:200]}: recipe file not found, and none of the {len(shipped)} shipped recipes "
                      f"({', '.join(f'{f}*' if sum(n.split('-')[0] == f for n in shipped) > 1 else f for f in families)}"
                      f"; `qtool config list` shows them) has that name{hint}")


def _is(test) -> bool:
    """``test()`` (a Path's is_file or is_dir), False where the name cannot be a file's (too long, say)."""
    try:
        return test()
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG:
            raise
        return False


def recipe_description(text: str) -> str:
    """The comment block at the top of a recipe file, as one paragraph (what the shipped recipes say of
    themselves)."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(part for part in lines if part)


def recipe_needs_data(recipe: Recipe) -> bool:
    """Whether calibrating ``recipe`` needs calibration data on any model: a static activation quantizer, a
    weight chosen from data (GPTQ, activation weighting) or SmoothQuant, in the defaults or any ``layers`` entry."""
    if recipe.smoothquant is not None or recipe.awq is not None or recipe.fold_batch_norms:
        return True
    weights = [recipe.defaults.weights] if recipe.defaults.weights is not None else []
    acts = [recipe.defaults.activations] if recipe.defaults.activations is not None else []
    for _, kind, spec, _ in rule_specs(recipe):  # (a recipe read by parse_recipe: every entry merges somewhere)
        if spec is not None:
            (weights if kind == "weights" else acts).append(spec)
    acts = [a for a in acts if a.inputs or a.outputs]  # (inputs: false, outputs: false quantizes nothing)
    return (recipe.kv_cache is not None or any(not a.dynamic or a.scale_dtype == "fp8_e4m3" for a in acts)
            or any(w.rounding.name != "nearest" or weighs_activations(w.analyzer.kwargs().get("weighting"))
                   for w in weights))


def _spec_summary(spec: Optional[_Spec]) -> Optional[Dict[str, Any]]:
    """A spec with every key resolved, analyzer and rounding as their labels and unset options left out."""
    if spec is None:
        return None
    out = {k: v for k, v in spec.model_dump(mode="json").items() if v is not None}
    out["analyzer"] = spec.analyzer.label()
    rounding = getattr(spec, "rounding", None)
    if rounding is not None:
        args = rounding.kwargs()
        out["rounding"] = rounding.name + ("(" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")" if args else "")
    if getattr(spec, "dynamic", False):
        out.pop("analyzer")  # a dynamic quantizer has none
    if out.get("element") == "int":
        out.pop("element")  # the default: integer recipes read as they always have
    return out


def spec_label(spec: Optional[_Spec]) -> str:
    """One line for a spec: ``int4 sym per_block 32``, ``uint8 per_tensor``, ``int8 per_token dynamic``, ``float``."""
    if spec is None:
        return "float"
    kind = ("int" if spec.symmetric else "uint") + str(spec.bitwidth) if spec.element == "int" else spec.element
    if spec.scale_dtype in GGML_SCALE_DTYPES:  # a gguf_type sets its own scale_dtype
        kind = f"GGUF {spec.scale_dtype.upper()}"
    gran = spec.granularity + (f" {spec.block_size}" if spec.block_size else "")
    legacy = LEGACY_GGUF_TYPES.get((spec.bitwidth, spec.symmetric))
    if (spec.element == "int" and legacy and spec.granularity == "per_block" and spec.block_size in (32, [1, 32])
            and spec.scale_dtype == "float16"):  # what llama.cpp calls this grid
        gran += f" (GGUF {legacy})"
    extra = [" dynamic" if getattr(spec, "dynamic", False) else "",
             f" {spec.scale_dtype} scales" if spec.element != "int" and spec.scale_dtype != "float32" else ""]
    rounding = getattr(spec, "rounding", None)
    if rounding is not None and rounding.name != "nearest":
        extra.append(f" {rounding.name}")
    return f"{kind} {gran}" + "".join(extra)


_GRID_KEYS = ("bitwidth", "symmetric", "granularity", "block_size", "scale_dtype", "element", "gguf_type")


def _mix_types(recipe: Recipe) -> List[str]:
    """The GGUF types a recipe's ``gguf_mix`` gives (upper case; with data-chosen codes, llama-quantize's
    ``--imatrix`` rules)."""
    from ..gguf_mixes import mix_types

    return [t.upper() for t in mix_types(recipe.gguf_mix, recipe_needs_data(recipe))]


def weights_label(recipe: Recipe) -> str:
    """:func:`spec_label` of the recipe's default weights, or for a ``gguf_mix`` the types the mix writes
    (``GGUF Q4_K_M: Q4_K, Q6_K``): the defaults' grid keys do not apply to it."""
    if recipe.gguf_mix is None:
        return spec_label(recipe.defaults.weights)
    rounding = recipe.defaults.weights.rounding.name
    return (f"GGUF {recipe.gguf_mix.upper()}: {', '.join(_mix_types(recipe))}"
            + (f" {rounding}" if rounding != "nearest" else ""))


def _activation_types(spec: Optional[ActivationSpec]) -> List[str]:
    """The module types whose activations ``spec`` (the defaults') quantizes: a module taking token ids
    (Embedding) has only its output to quantize."""
    if spec is None or not (spec.inputs or spec.outputs):
        return []
    return [t for t in DEFAULT_ACTIVATION_TYPES if spec.outputs or t not in _INTEGER_INPUT_TYPES]


def describe_recipe(recipe: Recipe) -> Dict[str, Any]:
    """What a recipe means without a model: its defaults with every key resolved, its rules, what it ignores,
    which module types it quantizes by default, and whether it needs calibration data."""
    defaults = {kind: _spec_summary(spec) for kind, spec in (("weights", recipe.defaults.weights),
                                                             ("activations", recipe.defaults.activations))}
    if recipe.gguf_mix is not None:  # the mix sets each weight's grid: the defaults' grid keys do not apply
        weights = {k: v for k, v in defaults["weights"].items() if k not in _GRID_KEYS}
        types = _mix_types(recipe)
        fallbacks = sorted({SUPER_BLOCK_FALLBACK[t.lower()].upper() for t in types if t.lower() in SUPER_BLOCK_FALLBACK})
        defaults["weights"] = {"gguf_types": types, "row_fallbacks": fallbacks, **weights}
    return {
        "defaults": defaults,
        "default_types": {"weights": list(DEFAULT_WEIGHT_TYPES) if recipe.defaults.weights else [],
                          "activations": _activation_types(recipe.defaults.activations)},
        "layers": [rule.model_dump(mode="json", exclude_unset=True) for rule in recipe.layers],
        "ignore": list(recipe.ignore),
        "smoothquant": None if recipe.smoothquant is None else recipe.smoothquant.model_dump(mode="json"),
        **({"awq": recipe.awq.model_dump(mode="json")} if recipe.awq is not None else {}),
        "fold_batch_norms": recipe.fold_batch_norms,
        "kv_cache": None if recipe.kv_cache is None else recipe.kv_cache.model_dump(mode="json"),
        "rotate": None if recipe.rotate is None else recipe.rotate.model_dump(mode="json"),
        "gguf_mix": recipe.gguf_mix,
        "needs_data": recipe_needs_data(recipe),
    }
