"""Recipes: the YAML schema (pydantic), its loading with line-numbered errors, and its resolution to a plan.

A recipe says *what* to quantize; the plan (``resolve_plan``) says *which quantizer goes where* for one model,
one row per quantizer, with concrete shapes and block sizes. See docs/recipes.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator
from .choices import GGML_SCALE_DTYPES, GGUF_TYPES, LEGACY_GGUF_TYPES, SUPER_BLOCK_FALLBACK
from .coverage import weight_coverage
from .errors import ConfigError
from .families import LLAMA_SMOOTH_MAPPINGS, Family, family_of_model, rms_norm_classes

if TYPE_CHECKING:  # torch is imported where a plan is made, so that recipes validate without it
    from torch import nn

    from .quant.spec import Granularity, QuantSpec

__all__ = [
    "Recipe",
    "WeightSpec",
    "ActivationSpec",
    "LayerRule",
    "QuantizerPlan",
    "Plan",
    "BatchNormFold",
    "RotateSpec",
    "RotationPlan",
    "load_recipe",
    "parse_recipe",
    "recipe_file",
    "shipped_recipes",
    "describe_recipe",
    "spec_label",
    "recipe_description",
    "recipe_needs_data",
    "resolve_plan",
    "DEFAULT_WEIGHT_TYPES",
    "DEFAULT_ACTIVATION_TYPES",
]

# Module types that get quantizers when no rule names a type.
DEFAULT_WEIGHT_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Embedding")
# Embedding takes integer indices, so it has no input quantizer; its output (a float) may be quantized.
DEFAULT_ACTIVATION_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Embedding")
_INTEGER_INPUT_TYPES = ("Embedding",)

ANALYZERS = ("minmax", "percentile", "sqnr", "tf_enhanced", "mse")
# which optional parameters each analyzer takes (see qtool.quant.analyzers)
_ANALYZER_PARAMS = {
    "minmax": (),
    "percentile": ("percentile", "num_bins"),
    "sqnr": ("num_bins", "gamma", "asymmetric_delta_candidates", "symmetric_delta_candidates", "offset_candidates"),
    "tf_enhanced": (),
    "mse": ("num_candidates", "min_ratio", "weighting"),
}
# module types whose weight multiplies the layer input as ``x @ W.T`` (a convolution: its input patches), where
# GPTQ and activation weighting apply
_INPUT_WEIGHTED_TYPES = ("Linear", "Conv1d", "Conv2d")

GranularityName = Literal["per_tensor", "per_channel", "per_block"]
_FLOAT_ELEMENT_BITS = {"fp8_e4m3": 8, "fp4_e2m1": 4}


class AnalyzerSpec(BaseModel):
    """``analyzer: NAME`` or ``analyzer: {name: NAME, <parameter>: value, ...}``."""

    model_config = ConfigDict(extra="forbid")
    name: Literal["minmax", "percentile", "sqnr", "tf_enhanced", "mse"] = "minmax"
    percentile: Optional[float] = Field(None, ge=50, le=100)
    num_bins: Optional[int] = Field(None, ge=8, le=65536)
    gamma: Optional[float] = Field(None, gt=0)
    asymmetric_delta_candidates: Optional[int] = Field(None, ge=2)
    symmetric_delta_candidates: Optional[int] = Field(None, ge=2)
    offset_candidates: Optional[int] = Field(None, ge=3)
    num_candidates: Optional[int] = Field(None, ge=1, le=1000)
    min_ratio: Optional[float] = Field(None, gt=0, le=1)
    # "activations": each weight's squared error counts by its input channel's E[x²] (needs --data)
    weighting: Optional[Literal["none", "activations"]] = None

    @model_validator(mode="after")
    def _params_fit_the_analyzer(self):
        allowed = _ANALYZER_PARAMS[self.name]
        for key in self.kwargs():
            if key not in allowed:
                takes = ", ".join(allowed) or "no parameters"
                raise ValueError(f"analyzer {self.name} does not take {key!r} (it takes {takes})")
        return self

    def kwargs(self) -> Dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if k != "name" and v is not None}

    def label(self) -> str:
        args = self.kwargs()
        return self.name if not args else f"{self.name}(" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")"


def _by_name(value: Any) -> Any:
    """``NAME`` is short for ``{name: NAME}`` (analyzer, rounding)."""
    if isinstance(value, str):
        return {"name": value}
    return value


_ROUNDING_PARAMS = {"nearest": (), "gptq": ("block_columns", "dampening", "act_order"),
                    "adaround": ("iterations", "reg_weight", "warm_start", "learning_rate")}


class RoundingSpec(BaseModel):
    """``rounding: NAME`` or ``rounding: {name: gptq, <parameter>: value, ...}``: how a weight's codes are chosen on
    the grid its analyzer picked. ``nearest`` rounds each value alone; ``gptq`` chooses codes column by column
    from the layer's input statistics (qtool.calibration.rounding.gptq); ``adaround`` learns each value's up/down
    rounding from them (qtool.calibration.rounding.adaround)."""

    model_config = ConfigDict(extra="forbid")
    name: Literal["nearest", "gptq", "adaround"] = "nearest"
    block_columns: Optional[int] = Field(None, ge=1, le=65536)
    dampening: Optional[float] = Field(None, ge=0, le=10)
    act_order: Optional[StrictBool] = None
    iterations: Optional[int] = Field(None, ge=0, le=100000)
    reg_weight: Optional[float] = Field(None, ge=0, le=1000)
    warm_start: Optional[float] = Field(None, ge=0, le=1)
    learning_rate: Optional[float] = Field(None, gt=0, le=10)

    @model_validator(mode="after")
    def _params_fit(self):
        if self.name == "nearest" and self.kwargs():
            raise ValueError(f"rounding nearest takes no parameters (got {', '.join(self.kwargs())})")
        wrong = [k for k in self.kwargs() if k not in _ROUNDING_PARAMS[self.name]]
        if wrong:
            raise ValueError(f"rounding {self.name} does not take {wrong[0]!r} (it takes "
                             f"{', '.join(_ROUNDING_PARAMS[self.name])})")
        return self

    def kwargs(self) -> Dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if k != "name" and v is not None}


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    bitwidth: int = Field(8, ge=2, le=16)
    symmetric: StrictBool = True
    granularity: GranularityName = "per_tensor"
    # one length (blocks along the input dimension), or, for weights, [rows, columns] (2-D tiles, e.g. FP8 128x128)
    block_size: Optional[Union[int, List[int]]] = None
    analyzer: AnalyzerSpec = AnalyzerSpec()
    # float16: scales rounded to float16 values when calibrated (GGUF stores them so; see docs/recipes.md);
    # e8m0 (MX) and fp8_e4m3 (NVFP4, under a float32 global scale): block scales of a float element
    # q8_0 … q4_1, q6_k … q2_k, iq4_nl, iq4_xs: GGUF's block types (set by gguf_type; scales stored as the type does)
    scale_dtype: Literal["float32", "float16", "e8m0", "fp8_e4m3", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1", "q6_k",
                         "q5_k", "q4_k", "q3_k", "q2_k", "iq4_nl", "iq4_xs"] = "float32"
    # the grid's values: integers (bitwidth, symmetric) or a float type (FP8 E4M3, FP4 E2M1; see docs/recipes.md)
    element: Literal["int", "fp8_e4m3", "fp4_e2m1"] = "int"

    _normalize_analyzer = field_validator("analyzer", mode="before")(lambda cls, v: _by_name(v))

    @field_validator("block_size", mode="before")
    @classmethod
    def _one_block_size_error(cls, v):
        """One error line for a bad block_size, whichever of its two forms was meant."""
        if v is None:
            return v
        items = v if isinstance(v, list) and len(v) == 2 else [v]
        for b in items:
            if isinstance(b, bool) or not isinstance(b, int):
                raise ValueError(f"Input should be a valid integer, or [rows, columns] for a weight (got {_short(v)})")
            if b <= 0:
                raise ValueError(f"Input should be greater than 0 (got {_short(v)})")
        return v

    @model_validator(mode="before")
    @classmethod
    def _float_element_implies(cls, data):
        """A float element fixes the bit width and symmetry; they need not be written."""
        element = data.get("element") if isinstance(data, dict) else None
        if isinstance(element, str) and element in _FLOAT_ELEMENT_BITS:
            data = dict(data)
            data.setdefault("bitwidth", _FLOAT_ELEMENT_BITS[element])
            data.setdefault("symmetric", True)
        return data

    @model_validator(mode="after")
    def _block_size_goes_with_per_block(self):
        if self.granularity == "per_block" and self.block_size is None:
            raise ValueError("granularity per_block needs block_size")
        if self.granularity != "per_block" and self.block_size is not None:
            raise ValueError(f"block_size is only used with granularity per_block (got {self.granularity})")
        if isinstance(self.block_size, list) and type(self).__name__ != "WeightSpec":
            raise ValueError("block_size [rows, columns] tiles a weight; activations take one block length")
        from .choices import check_element, check_scale_dtype

        check_element(self.element, self.bitwidth, self.symmetric, self.scale_dtype, self.granularity,
                      bool(getattr(self, "dynamic", False)))
        if self.element == "int":
            check_scale_dtype(self.scale_dtype, self.bitwidth, self.symmetric)
            if self.scale_dtype in GGML_SCALE_DTYPES:
                sub = GGUF_TYPES[self.scale_dtype][2]
                if type(self).__name__ != "WeightSpec" or self.granularity != "per_block" or self.block_size != sub:
                    raise ValueError(f"scale_dtype {self.scale_dtype} is GGUF's {self.scale_dtype.upper()}, a weight "
                                     f"grid of blocks of {sub} (write gguf_type: {self.scale_dtype})")
                if self.analyzer.name not in ("minmax", "mse"):
                    raise ValueError(f"gguf_type {self.scale_dtype}: analyzer {self.analyzer.name} is not available "
                                     "on GGUF's block types (use minmax, or mse)")
        elif self.analyzer.name not in ("minmax", "mse"):
            raise ValueError(f"element {self.element}: analyzer {self.analyzer.name} is not available on float "
                             "grids (use minmax, or mse on weights: it searches the representable scales)")
        return self


class WeightSpec(_Spec):
    symmetric: StrictBool = True
    granularity: GranularityName = "per_channel"
    rounding: RoundingSpec = RoundingSpec()
    # llama.cpp's block type by name (q4_k, q6_k, q8_0, iq4_xs, ...): sets bitwidth, symmetric, granularity,
    # block_size and scale_dtype to that type's (docs/recipes.md)
    gguf_type: Optional[Literal["q8_0", "q5_0", "q5_1", "q4_0", "q4_1", "q6_k", "q5_k", "q4_k", "q3_k", "q2_k",
                                "iq4_nl", "iq4_xs"]] = None

    _normalize_rounding = field_validator("rounding", mode="before")(lambda cls, v: _by_name(v))

    @model_validator(mode="before")
    @classmethod
    def _gguf_type_implies(cls, data):
        """A GGUF type fixes the grid; what the recipe writes beside it must agree."""
        if isinstance(data, dict) and isinstance(data.get("gguf_type"), str) and data["gguf_type"] in GGUF_TYPES:
            bits, sym, block = GGUF_TYPES[data["gguf_type"]]
            implied = {"bitwidth": bits, "symmetric": sym, "granularity": "per_block", "block_size": block,
                       "scale_dtype": data["gguf_type"], "element": "int"}
            wrong = [k for k, v in implied.items() if k in data and data[k] != v]
            if wrong:
                raise ValueError(f"gguf_type {data['gguf_type']} sets {wrong[0]} to {implied[wrong[0]]} (got "
                                 f"{_short(data[wrong[0]])}); remove {wrong[0]}")
            data = {**data, **implied}
        return data

    @model_validator(mode="after")
    def _rounding_fits_the_element(self):
        if self.element != "int" and self.rounding.name == "adaround":
            raise ValueError(f"element {self.element}: rounding adaround learns up/down choices on integer grids; "
                             "use gptq or nearest on float grids")
        if self.scale_dtype in GGML_SCALE_DTYPES and self.rounding.name == "adaround":
            raise ValueError(f"gguf_type {self.scale_dtype}: rounding adaround is not available on GGUF's "
                             "K-quant/IQ4 grids; use gptq or nearest")
        return self


class ActivationSpec(_Spec):
    symmetric: StrictBool = False
    # per_block: float elements only, dynamic (NVFP4 / MX activations: block scales computed per call)
    granularity: Literal["per_tensor", "per_token", "per_block"] = "per_tensor"
    # true: the range is computed from each call's values at run time (no calibration data, nothing stored)
    dynamic: StrictBool = False
    inputs: StrictBool = True
    outputs: StrictBool = False

    @model_validator(mode="after")
    def _mse_is_for_weights(self):
        if self.analyzer.name == "mse":
            raise ValueError("analyzer mse searches a weight tensor directly; for activations use minmax, "
                             "percentile, sqnr or tf_enhanced")
        return self

    @model_validator(mode="after")
    def _dynamic_fits(self):
        if self.granularity == "per_token" and not self.dynamic:
            raise ValueError("per_token ranges change with every token, so they are computed at run time: "
                             "per_token needs dynamic: true")
        if self.granularity == "per_block" and (not self.dynamic or self.element == "int"):
            raise ValueError("per_block activations are float elements whose block scales are computed at run time "
                             "(NVFP4, MX): they need an element (fp4_e2m1, fp8_e4m3) and dynamic: true")
        if self.dynamic:
            if self.analyzer.name != "minmax" or self.analyzer.kwargs():
                raise ValueError(f"a dynamic quantizer takes each call's own min and max; analyzer "
                                 f"{self.analyzer.label()} does not apply (remove it, or set dynamic: false)")
            if self.scale_dtype != "float32" and self.element == "int":
                raise ValueError("a dynamic quantizer computes its scale at run time: scale_dtype does not apply")
        return self


class LayerRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    match: Optional[str] = None
    type: Optional[Union[str, List[str]]] = None
    # an optional rule may match nothing (for recipes meant for many models, e.g. "Embedding tables, if any")
    optional: StrictBool = False
    # a dict merges over the defaults; null disables; absent leaves the defaults alone
    weights: Optional[Dict[str, Any]] = None
    activations: Optional[Dict[str, Any]] = None

    @model_validator(mode="after")
    def _needs_a_selector(self):
        if self.match is None and self.type is None:
            raise ValueError("a layers entry needs 'match' (name pattern) or 'type' (module class)")
        if self.match is not None:
            _compile_pattern(self.match)
        return self

    def types(self) -> Tuple[str, ...]:
        if self.type is None:
            return ()
        return (self.type,) if isinstance(self.type, str) else tuple(self.type)


class Defaults(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights: Optional[WeightSpec] = WeightSpec()
    activations: Optional[ActivationSpec] = ActivationSpec()


class SmoothMapping(BaseModel):
    """One SmoothQuant pairing: the module whose output feeds the ``balance`` layers (a norm, or a Linear whose
    output rows can absorb a per-channel scale) and name patterns of those layers, looked for among the smooth
    module's siblings and their descendants (its parent's subtree)."""

    model_config = ConfigDict(extra="forbid")
    smooth: str
    balance: List[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _patterns_compile(self):
        for p in [self.smooth] + self.balance:
            _compile_pattern(p)
        return self


class SmoothQuantSpec(BaseModel):
    """``smoothquant: {alpha: 0.5}``: before anything is calibrated, per input channel ``j`` of each balance
    layer, ``s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha)`` moves activation range into the weights (the
    smooth module's output divided by ``s``, the balance layers' weight columns multiplied by it); the float
    model's outputs are unchanged. ``mappings`` default to the model family's (``qtool.families``; Llama-style
    decoder blocks for a model of no known family)."""

    model_config = ConfigDict(extra="forbid")
    alpha: float = Field(0.5, ge=0, le=1)
    mappings: Optional[List[SmoothMapping]] = None


class KvCacheSpec(BaseModel):
    """``kv_cache: {granularity: per_tensor | per_head}``: static FP8 E4M3 scales for each attention layer's keys
    (after RoPE) and values, calibrated from the data's absolute maximum; the fake-quant model quantizes them where
    the layer hands them to its cache, and the compressed-tensors export writes ``k_scale`` / ``v_scale`` with
    ``kv_cache_scheme`` (what vLLM reads with ``kv_cache_dtype="fp8"``). Llama-family attention (modules with
    ``k_proj`` and ``v_proj`` that call ``past_key_values.update``)."""

    model_config = ConfigDict(extra="forbid")
    element: Literal["fp8_e4m3"] = "fp8_e4m3"
    granularity: Literal["per_tensor", "per_head"] = "per_tensor"


class RotateSpec(BaseModel):
    """``rotate: {rotations: [r1, r2, r3, r4], type: hadamard | random-hadamard, seed: 0}``: before anything is
    calibrated, orthogonal Hadamard rotations put into a Llama-family model (QuaRot/SpinQuant's R1: the residual
    stream, after folding each RMSNorm's weight into the Linears it feeds; R2: each attention head's values, between
    ``v_proj`` and ``o_proj``; both fused into the weights. R3: each head's queries and keys after RoPE, at run time,
    so the quantized KV cache (``kv_cache``) holds rotated keys. R4: ``down_proj``'s input, rotated at run time
    (online) with the inverse fused into ``down_proj``'s weight). The float model's outputs are unchanged; outlier
    channels are spread over all channels, so low-bit grids fit the rotated weights and activations better."""

    model_config = ConfigDict(extra="forbid")
    rotations: List[Literal["r1", "r2", "r3", "r4"]] = Field(["r1", "r2"], min_length=1)
    type: Literal["hadamard", "random-hadamard"] = "hadamard"
    seed: int = Field(0, ge=0, le=2**63 - 1)
    # r1 block-diagonal with blocks of this many channels (None: one rotation of the whole width). Small blocks
    # suit block-scaled formats (NVFP4, MXFP4), whose block scales already isolate an outlier channel: a rotation
    # of the whole width would spread it into every block
    block_size: Optional[int] = Field(None, ge=1, le=65536)

    @field_validator("rotations")
    @classmethod
    def _known(cls, v):
        if len(set(v)) != len(v):
            raise ValueError("a rotation is listed twice")
        return v


@dataclass(frozen=True)
class OnlineRotation:
    """A rotation applied to activations at run time (``R`` the orthogonal rotation of :mod:`qtool.quant.hadamard`
    of ``kind`` and ``seed``). ``location`` ``input`` (r4): ``modules``' input ``x`` becomes ``x R`` (over the
    input width) before anything else sees it, while ``W R`` is fused into their weights. ``k_cache`` (r3):
    ``modules`` are attention layers whose queries and keys (after RoPE) are rotated per head (width
    ``head_dim``), so their KV cache quantizers see ``k R``; ``q kᵀ`` is unchanged, nothing is fused. Recorded in
    the encodings file (schema version 4), so every reader of a calibrated model rotates where the calibration
    did."""

    name: str  # "r3", "r4"
    kind: str  # hadamard | random-hadamard
    seed: int
    modules: Tuple[str, ...]
    location: str = "input"

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "type": self.kind, "seed": self.seed, "location": self.location,
                "modules": list(self.modules)}

    @property
    def rotated(self) -> str:
        """What it rotates on each of its modules, for messages: ``input`` or ``queries and cached keys``."""
        return "queries and cached keys" if self.location == "k_cache" else "input"


@dataclass(frozen=True)
class RotationPlan:
    """A recipe's ``rotate`` resolved on a Llama-family model: the module names each rotation touches."""

    rotations: Tuple[str, ...]
    kind: str  # hadamard | random-hadamard
    seed: int
    hidden: int
    head_dim: int
    embed: str
    final_norm: str
    head: Optional[str]  # the output Linear (None: none in the model)
    layers: Tuple[str, ...]  # decoder layer prefixes ("model.layers.0", ...)
    block_size: int = 0  # r1's rotation: block-diagonal with blocks of this width (hidden: one rotation)
    untie: bool = False  # r1 on tied embeddings: the output layer gets its own weight (tie_word_embeddings false)
    down: str = "mlp.down_proj"  # the MLP's output Linear in each layer, whose input r4 rotates
    kv_modules: Tuple[str, ...] = ()  # the attention layers whose keys r3 rotates (those with a quantized KV cache)
    # mixture-of-experts layers: (layer, what reads the residual stream, what writes it), names under the layer
    # (every expert's gate/up and down, the router, shared experts); a layer not named has a dense Llama MLP
    moe: Tuple[Tuple[str, Tuple[str, ...], Tuple[str, ...]], ...] = ()

    @property
    def rotates_head(self) -> bool:
        """Whether r1 folds the final norm into an output layer and rotates it."""
        return "r1" in self.rotations and self.head is not None

    def mlp(self, layer: str) -> Tuple[List[str], List[str]]:
        """``(readers, writers)`` of ``layer``'s MLP: the modules whose weight columns read the residual stream
        after the second norm, and the Linears that write it (r4 rotates their input)."""
        for name, readers, writers in self.moe:
            if name == layer:
                return [f"{layer}.{n}" for n in readers], [f"{layer}.{n}" for n in writers]
        return [f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj"], [f"{layer}.{self.down}"]

    def online(self) -> List[OnlineRotation]:
        """The rotations that run on activations (r3: every quantized KV cache's keys, with their queries; r4:
        every ``down_proj``'s input)."""
        out = []
        if "r3" in self.rotations:
            out.append(OnlineRotation("r3", self.kind, self.seed, self.kv_modules, location="k_cache"))
        if "r4" in self.rotations:
            out.append(OnlineRotation("r4", self.kind, self.seed,
                                      tuple(n for layer in self.layers for n in self.mlp(layer)[1])))
        return out


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    defaults: Defaults = Defaults()
    layers: List[LayerRule] = []
    ignore: List[str] = []
    smoothquant: Optional[SmoothQuantSpec] = None
    # fold each BatchNorm into the convolution before it, before anything is calibrated (AIMET's fold_all_batch_norms)
    fold_batch_norms: StrictBool = False
    kv_cache: Optional[KvCacheSpec] = None  # static FP8 scales for attention keys and values
    rotate: Optional[RotateSpec] = None  # Hadamard rotations fused into the weights before calibration
    # llama-quantize's mix (q4_k_m, q3_k_m, ...): each weight's GGUF type as llama.cpp chooses it for a Llama-family
    # model (qtool.gguf_mixes); defaults.weights says how codes are chosen, layers rules still override
    gguf_mix: Optional[Literal["q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
                               "iq4_xs", "iq4_nl", "q4_0", "q5_0", "q8_0"]] = None

    @model_validator(mode="after")
    def _mix_takes_weights(self):
        if self.gguf_mix is not None and self.defaults.weights is None:
            raise ValueError(f"gguf_mix {self.gguf_mix} quantizes weights: defaults.weights cannot be null")
        if self.gguf_mix is not None:  # the mix sets every weight's grid: a grid key beside it would be ignored
            grid = [k for k in _GGUF_IMPLIED + ("gguf_type",) if k in self.defaults.weights.model_fields_set]
            if grid:
                raise ValueError(f"gguf_mix {self.gguf_mix} chooses each weight's GGUF type, and so its grid: "
                                 f"defaults.weights.{grid[0]} would be ignored; remove it (a layers rule's gguf_type "
                                 "sets one weight's type)")
        return self

    @model_validator(mode="after")
    def _r3_needs_a_kv_cache(self):
        if self.rotate is not None and "r3" in self.rotate.rotations and self.kv_cache is None:
            raise ValueError("rotate: r3 rotates the keys a quantized KV cache stores, and changes nothing else; "
                             "add kv_cache (e.g. kv_cache: {granularity: per_head}) or leave r3 out")
        return self

    @field_validator("ignore")
    @classmethod
    def _patterns_compile(cls, v):
        for p in v:
            _compile_pattern(p)
        return v


# --------------------------------------------------------------------------------------------------------------
# Loading with file/key/line in every error
# --------------------------------------------------------------------------------------------------------------
# a repeated group that itself repeats, e.g. (a+)+ or (x*)*: Python's re can backtrack exponentially on it
_NESTED_QUANTIFIER = re.compile(r"\((?:[^()\\]|\\.)*[+*}](?:[^()\\]|\\.)*\)(?:[+*]|\{\d*,)")


@functools.lru_cache(maxsize=1024)
def _compile_pattern(pattern: str):
    """A recipe pattern compiled once (resolution matches every pattern against every module name)."""
    if pattern.startswith("re:"):
        if _NESTED_QUANTIFIER.search(pattern[3:]):
            raise ValueError(f"regular expression {_short(pattern[3:])} repeats a group that itself repeats "
                             "(like (a+)+), which can take minutes to match; write it without the nested repetition")
        try:
            return re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"bad regular expression {_short(pattern[3:])}: {e}") from None
    return re.compile(fnmatch.translate(pattern))


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (error lines never echo a whole rejected value)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return text[:limit - 5] + "...)" if text.endswith(")") else text[:limit - 3] + "..."


def name_matches(pattern: str, name: str) -> bool:
    """Glob on the whole module name, or a regex (full match) after ``re:``."""
    return _compile_pattern(pattern).fullmatch(name) is not None


def _key_path(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line_of(node, loc: Sequence[Any]) -> Optional[int]:
    """Line (1-based) of the YAML node at ``loc``, or of the deepest node that exists on the way."""
    best = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        nxt = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == part:
                    nxt = k if part == loc[-1] else v
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            nxt = node.value[part]
        if nxt is None:
            break
        node = nxt
        best = node.start_mark.line + 1
    return best


def _describe(err: Dict[str, Any], fields: Sequence[str] = ()) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return "unknown key" + _did_you_mean(err["loc"][-1] if err["loc"] else None, fields)
    if err["type"] == "literal_error":
        expected = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
        return f"{msg} (got {_short(err.get('input'))}){_did_you_mean(err.get('input'), expected)}"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err["type"] in ("literal_error", "int_parsing", "bool_parsing", "greater_than_equal", "less_than_equal",
                       "int_type", "bool_type", "string_type", "list_type", "dict_type", "model_type",
                       "greater_than", "int_from_float"):
        msg = f"{msg} (got {_short(err.get('input'))})"
    return msg


def _check_node_graph(node, source: str) -> None:
    """Refuse what PyYAML would silently expand or drop, before anything is constructed: a reused node (an alias;
    the graph is walked once per node object) and a key given twice in one mapping (the last would win)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is None:
            continue
        if id(n) in seen:
            raise ConfigError(f"{source}: YAML anchors and aliases (&name / *name) are not allowed in recipes (a "
                              "few lines of them can expand to billions of values); write the values out")
        seen.add(id(n))
        if isinstance(n, yaml.MappingNode):
            keys = set()
            for key, _ in n.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in keys:
                        raise ConfigError(f"{source}:{key.start_mark.line + 1}: key {_short(key.value)} is given "
                                          "twice in the same mapping; keep one")
                    keys.add(key.value)
            stack.extend(x for pair in n.value for x in pair)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    """Parse and validate a recipe; every problem is a ``ConfigError`` naming source, key path and line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        _check_node_graph(node, source)
        data = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{source}: malformed YAML: nested too deep") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{source}{where}: malformed YAML: {_short(problem, 200)[1:-1]}") from None
    if data is None:  # an empty file (or only comments) is a mistake far more often than a wish for defaults
        raise ConfigError(f"{source}:1: empty recipe; write at least `version: 1` and what to quantize "
                          "(`qtool config list` shows the shipped recipes)")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}:1: a recipe is a mapping of keys (version, defaults, layers, ignore)")
    problems: List[str] = []
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc = list(err["loc"])
            line = _line_of(node, loc)
            where = f":{line}" if line else ""
            problems.append(f"{source}{where}: {_key_path(loc) or '(top level)'}: {_describe(err, _fields_at(loc))}")
        recipe = None
    if recipe is not None:
        problems += _rule_problems(recipe, node, source)
    if problems:
        shown = problems[:MAX_PROBLEMS]
        if len(problems) > MAX_PROBLEMS:
            shown.append(f"{source}: ... and {len(problems) - MAX_PROBLEMS} more problems")
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(shown[0] + more, shown)
    return recipe


MAX_PROBLEMS = 20  # recipe problems listed at once (the rest are counted)


def _fields_at(loc: Sequence[Any]) -> List[str]:
    """The keys allowed in the mapping that holds the last element of ``loc`` (for did-you-mean hints)."""
    model: Any = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_of(field.annotation)
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}))


def _model_of(annotation) -> Any:
    """The pydantic model inside ``Optional[...]`` / ``List[...]`` (None for anything else)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _rule_problems(recipe: Recipe, node, source: str) -> List[str]:
    """Each ``layers`` entry's partial weights/activations merged as resolution will merge them (over the defaults,
    and over every earlier entry's): a value that no merge accepts is a problem now, not on the first model."""
    problems = []
    chain = {"weights": recipe.defaults.weights, "activations": recipe.defaults.activations}
    defaults = dict(chain)
    cls = {"weights": WeightSpec, "activations": ActivationSpec}
    for i, rule in enumerate(recipe.layers):
        for kind in ("weights", "activations"):
            part = getattr(rule, kind)
            if not part:
                continue
            error = None
            for base in (defaults[kind], chain[kind]):
                try:
                    chain[kind] = _merge(base, part, cls[kind], "")
                    break
                except ConfigError as e:
                    error = error or e
            else:
                key = str(error).lstrip(".: ")  # "<key>: <problem>", from _merge with an empty location
                field = key.split(":", 1)[0].strip()
                line = _line_of(node, ["layers", i, kind] + ([field] if field in part else []))
                problems.append(f"{source}{f':{line}' if line else ''}: layers[{i}].{kind}.{key}")
    return problems


# keys other tools use for ours (a recipe written from memory of llm-compressor, AIMET or torchao)
_SYNONYMS = {"name": "match", "pattern": "match", "regex": "match", "module": "match", "targets": "type",
             "bits": "bitwidth", "num_bits": "bitwidth", "sym": "symmetric", "group_size": "block_size",
             "strategy": "granularity", "observer": "analyzer", "exclude": "ignore", "skip": "ignore",
             "weight": "weights", "activation": "activations", "input_activations": "activations"}


def _did_you_mean(word: Any, choices: Sequence[str]) -> str:
    import difflib

    if not isinstance(word, str) or not choices:
        return ""
    if _SYNONYMS.get(word) in choices:
        return f" (did you mean {_SYNONYMS[word]!r}?)"
    close = difflib.get_close_matches(word, list(choices), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


RECIPES_DIR = Path(__file__).resolve().parent / "recipes"  # the shipped recipes (package data)


def shipped_recipes() -> Dict[str, Path]:
    """``{name: path}`` of the recipes that ship with qtool (``w8a8``, ``w4a16-block32``, ...)."""
    return {p.stem: p for p in sorted(RECIPES_DIR.glob("*.yaml"))}


def recipe_file(arg: Union[str, Path]) -> Path:
    """The file a recipe argument names: a path to a YAML file, or the name of a shipped recipe (``w8a8`` or
    ``w8a8.yaml``; a file of that name in the working directory wins). Raises ``ConfigError`` with the shipped
    names, and the nearest ones, when it is neither."""
    import difflib

    path = Path(arg)
    if path.is_file():
        return path
    shipped = shipped_recipes()
    name = path.name[:-len(".yaml")] if path.name.endswith(".yaml") else path.name
    if str(arg) in (name, path.name) and name in shipped:
        return shipped[name]
    if path.is_dir():
        raise ConfigError(f"{arg}: is a directory, not a recipe file")
    close = difflib.get_close_matches(name, list(shipped), n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    families = sorted({n.split("-")[0] for n in shipped})  # the names' stems: w4a16, gguf, fp8 ... (one short line)
    raise ConfigError(f"{str(arg)[:200]}: recipe file not found, and none of the {len(shipped)} shipped recipes "
                      f"({', '.join(f'{f}*' if sum(n.split('-')[0] == f for n in shipped) > 1 else f for f in families)}"
                      f"; `qtool config list` shows them) has that name{hint}")


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
    if recipe.smoothquant is not None or recipe.fold_batch_norms:
        return True
    weights = [recipe.defaults.weights] if recipe.defaults.weights is not None else []
    acts = [recipe.defaults.activations] if recipe.defaults.activations is not None else []
    for i, rule in enumerate(recipe.layers):
        if rule.weights:
            weights.append(_merge(recipe.defaults.weights, rule.weights, WeightSpec, f"layers[{i}].weights"))
        if rule.activations:
            acts.append(_merge(recipe.defaults.activations, rule.activations, ActivationSpec,
                               f"layers[{i}].activations"))
    return (recipe.kv_cache is not None or any(not a.dynamic or a.scale_dtype == "fp8_e4m3" for a in acts)
            or any(w.rounding.name != "nearest" or w.analyzer.kwargs().get("weighting") == "activations"
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
    from .gguf_mixes import mix_types

    return [t.upper() for t in mix_types(recipe.gguf_mix, recipe_needs_data(recipe))]


def weights_label(recipe: Recipe) -> str:
    """:func:`spec_label` of the recipe's default weights, or for a ``gguf_mix`` the types the mix writes
    (``GGUF Q4_K_M: Q4_K, Q6_K``): the defaults' grid keys do not apply to it."""
    if recipe.gguf_mix is None:
        return spec_label(recipe.defaults.weights)
    rounding = recipe.defaults.weights.rounding.name
    return (f"GGUF {recipe.gguf_mix.upper()}: {', '.join(_mix_types(recipe))}"
            + (f" {rounding}" if rounding != "nearest" else ""))


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
                          "activations": list(DEFAULT_ACTIVATION_TYPES) if recipe.defaults.activations else []},
        "layers": [rule.model_dump(mode="json", exclude_unset=True) for rule in recipe.layers],
        "ignore": list(recipe.ignore),
        "smoothquant": None if recipe.smoothquant is None else recipe.smoothquant.model_dump(mode="json"),
        "fold_batch_norms": recipe.fold_batch_norms,
        "kv_cache": None if recipe.kv_cache is None else recipe.kv_cache.model_dump(mode="json"),
        "rotate": None if recipe.rotate is None else recipe.rotate.model_dump(mode="json"),
        "gguf_mix": recipe.gguf_mix,
        "needs_data": recipe_needs_data(recipe),
    }


def load_recipe(path: Union[str, Path]) -> Recipe:
    """Load and validate a recipe file, or a shipped recipe by name (see :func:`recipe_file`)."""
    path = recipe_file(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read recipe: {e}") from None
    return parse_recipe(text, str(path))


# --------------------------------------------------------------------------------------------------------------
# Resolution: recipe + model -> plan
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantizerPlan:
    """One quantizer: where it goes and what it is."""

    name: str  # "<module>.weight", "<module>.input", "<module>.output"
    module: str
    module_type: str
    tensor: Literal["weight", "input", "output", "k_cache", "v_cache"]
    bitwidth: int
    symmetric: bool
    granularity: "Granularity"
    shape: Tuple[int, ...]
    block_size: Optional[Tuple[int, ...]]
    analyzer: str
    rule: Optional[int] = None  # index of the last layers entry that shaped it (None: defaults)
    analyzer_args: Tuple[Tuple[str, Any], ...] = ()
    scale_dtype: str = "float32"
    rounding: str = "nearest"  # weights: how codes are chosen on the grid (RoundingSpec.name)
    rounding_args: Tuple[Tuple[str, Any], ...] = ()
    dynamic: bool = False  # activations: range computed at run time from each call's values (nothing calibrated)
    element: str = "int"  # the grid's values: int, fp8_e4m3, fp4_e2m1
    imatrix: bool = False  # weights: the activation weighting comes from an importance matrix file, not the data

    def __post_init__(self):
        from .quant.spec import QuantSpec

        try:
            spec = QuantSpec(self.bitwidth, self.symmetric, self.granularity, self.shape, self.block_size,
                             self.analyzer_label, self.scale_dtype, self.dynamic, self.element)
        except ValueError as e:
            raise ConfigError(f"{self.name}: {e}") from None
        object.__setattr__(self, "granularity", spec.granularity)
        object.__setattr__(self, "_spec", spec)

    @property
    def spec(self) -> "QuantSpec":
        """What this quantizer is (validated when the row was made)."""
        return self._spec

    @property
    def needs_inputs(self) -> bool:
        """True when calibrating this weight needs its layer's input statistics (so calibration data)."""
        return self.tensor == "weight" and (self.rounding != "nearest" or (
            dict(self.analyzer_args).get("weighting") == "activations" and not self.imatrix))

    @property
    def analyzer_label(self) -> str:
        if not self.analyzer_args:
            return self.analyzer
        return f"{self.analyzer}(" + ", ".join(f"{k}={v}" for k, v in self.analyzer_args) + ")"

    def describe_granularity(self) -> str:
        return self._spec.describe()


@dataclass(frozen=True)
class SmoothGroup:
    """One resolved SmoothQuant pairing: ``smooth`` (module name) feeds ``balance`` (Linear module names)."""

    smooth: str
    balance: Tuple[str, ...]
    alpha: float
    mapping: int = 0  # index of the mapping that paired them (errors name it)


@dataclass(frozen=True)
class BatchNormFold:
    """A BatchNorm (``bn``) that follows a convolution (``conv``) in module order with as many channels: a fold
    candidate. Calibration folds it only after checking on data that the norm's input *is* the convolution's
    output (qtool.calibration.folding)."""

    conv: str
    bn: str


@dataclass
class Plan:
    quantizers: List[QuantizerPlan] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    smoothing: List[SmoothGroup] = field(default_factory=list)  # SmoothQuant, applied before calibration
    folds: List[BatchNormFold] = field(default_factory=list)  # batch norms folded before calibration
    rotation: Optional[RotationPlan] = None  # Hadamard rotations fused before calibration
    # module -> E[x²] per input column from an importance matrix file (rows with ``imatrix`` weight by it)
    importances: Dict[str, Any] = field(default_factory=dict)
    # module -> the resolved recipe spec of its weight (what a ``layers`` entry writes to reproduce that row)
    weight_specs: Dict[str, "WeightSpec"] = field(default_factory=dict)
    # quantizers the export format will write float (set by the job that exports; the plan line counts them apart)
    left_float: Dict[str, str] = field(default_factory=dict)  # quantizer name -> the format
    # mixture-of-experts expert module -> calibration tokens routed to it (where its layers' inputs were measured),
    # in plan (module) order: every mode fills it block by block, a resumed run from its saved blocks first
    expert_tokens: Dict[str, int] = field(default_factory=dict)
    memory: Any = None  # calibration.memory.MemoryEstimate of the run about to calibrate it (shown with the plan)
    coverage: Any = None  # coverage.WeightCoverage: how much of the model's weights the plan quantizes

    @property
    def weights(self) -> List[QuantizerPlan]:
        return [q for q in self.quantizers if q.tensor == "weight"]

    @property
    def activations(self) -> List[QuantizerPlan]:
        return [q for q in self.quantizers if q.tensor != "weight"]

    @property
    def static_activations(self) -> List[QuantizerPlan]:
        """The activation rows calibration sets: static ranges, and the global scale of NVFP4 activations (other
        dynamic ones compute everything at run time)."""
        return [q for q in self.activations if q.spec.calibrates]

    def needs_data(self) -> bool:
        return (bool(self.static_activations) or bool(self.smoothing) or bool(self.folds)
                or any(q.needs_inputs for q in self.weights))


_GGUF_IMPLIED = ("bitwidth", "symmetric", "granularity", "block_size", "scale_dtype", "element")


def _merge(base: Optional[_Spec], override: Dict[str, Any], cls, where: str):
    """Apply one rule's partial spec on top of the current one (or the schema defaults when there is none)."""
    start = base.model_dump() if base is not None else cls().model_dump()
    if "element" in override:  # bit width, symmetry and scale type follow the new element unless the rule gives them
        for key in ("bitwidth", "symmetric", "scale_dtype"):
            if key not in override:
                start.pop(key, None)
    if "gguf_type" in override:  # the grid follows the new GGUF type
        for key in _GGUF_IMPLIED:
            start.pop(key, None)
    elif start.get("gguf_type") and any(k in override for k in _GGUF_IMPLIED):
        start.pop("gguf_type")  # a rule that writes its own grid leaves the GGUF type (and its scale type)
        if start.get("scale_dtype") in GGML_SCALE_DTYPES and "scale_dtype" not in override:
            start.pop("scale_dtype")
    start.update(override)
    if "granularity" in override and override["granularity"] != "per_block" and "block_size" not in override:
        start["block_size"] = None
    for key in ("analyzer", "rounding"):
        if key in override:
            start[key] = _by_name(override[key])
    try:
        return cls.model_validate(start)
    except ValidationError as e:
        err = e.errors()[0]
        key = _key_path(err["loc"])
        desc = _describe(err, list(cls.model_fields))
        raise ConfigError(f"{where}.{key}: {desc}" if key else f"{where}: {desc}") from None


def _weight_layout(module: "nn.Module", spec: WeightSpec, where: str, name: str):
    from torch import nn

    w = getattr(module, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() == 0:
        return None
    shp = tuple(w.shape)
    if spec.granularity == "per_tensor":
        return (), None
    if spec.granularity == "per_channel":
        return (shp[0],) + (1,) * (len(shp) - 1), None
    b = spec.block_size
    if len(shp) < 2:
        raise ConfigError(f"{where}.block_size: {name}.weight has shape {list(shp)}; per_block needs 2+ dims")
    if isinstance(b, list):  # 2-D tiles of a Linear weight
        rows, cols = b
        if len(shp) != 2 or shp[0] % rows or shp[1] % cols:
            raise ConfigError(f"{where}.block_size: {rows}x{cols} tiles do not divide {name}.weight of shape "
                              f"{list(shp)}")
        return (shp[0] // rows, shp[1] // cols), (rows, cols)
    if shp[1] % b:
        raise ConfigError(
            f"{where}.block_size: {b} does not divide the input dimension {shp[1]} of {name}.weight "
            f"(shape {list(shp)})"
        )
    shape = (shp[0], shp[1] // b) + (1,) * (len(shp) - 2)
    return shape, (1, b) + (-1,) * (len(shp) - 2)


class _Mix:
    """A recipe's ``gguf_mix`` on one model: the GGUF type of each weight, as llama-quantize chooses it."""

    def __init__(self, recipe: Recipe, model: "nn.Module", source: str, importance_matrix: bool = False):
        from torch import nn

        from .gguf_mixes import tensor_role

        self.name = recipe.gguf_mix
        modules = dict(model.named_modules())
        layers = {layer for n in modules for role, layer in [tensor_role(n)] if role in ("attn_v", "attn_qkv")}
        if not layers:
            raise ConfigError(f"{source}: gguf_mix {self.name}: the model has no Llama-family decoder layers "
                              "(model.layers.N.self_attn.v_proj); llama-quantize's mixes are defined for those")
        self.n_layers = max(layers) + 1
        q = next((m for n, m in modules.items() if tensor_role(n) == ("attn_q", min(layers))), None)
        k = next((m for n, m in modules.items() if tensor_role(n) == ("attn_k", min(layers))), None)
        # (only attn_v's rules read it, and a model with fused q/k/v has no attn_v)
        self.n_gqa = q.out_features // max(1, k.out_features) if isinstance(q, nn.Linear) and k is not None else 1
        embed = next((m for n, m in modules.items() if tensor_role(n)[0] == "token_embd"), None)
        head = next((m for n, m in modules.items() if tensor_role(n)[0] == "output"), None)
        self.tied = embed is not None and (head is None or head.weight is embed.weight)
        config = getattr(model, "config", None)  # llama-quantize has rules of its own for 8-expert models
        self.n_expert = int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)
        w = recipe.defaults.weights
        self.has_imatrix = (importance_matrix or w.rounding.name == "gptq"
                            or w.analyzer.kwargs().get("weighting") == "activations")
        self.embed_spec: Optional[WeightSpec] = None

    def spec(self, name: str, module: "nn.Module", base: WeightSpec) -> WeightSpec:
        from .gguf_mixes import mix_type, tensor_role

        role, layer = tensor_role(name)
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
            if spec.analyzer.kwargs().get("weighting") == "activations":
                args = {k: v for k, v in spec.analyzer.kwargs().items() if k != "weighting"}
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


def resolve_plan(recipe: Recipe, model: "nn.Module", source: str = "<recipe>", allow_unmatched: bool = False,
                 importance_matrix: bool = False) -> Plan:
    """One ``QuantizerPlan`` per quantizer, in module order. Later ``layers`` entries win. ``importance_matrix``:
    an importance matrix file will weight the searches (a ``gguf_mix`` then picks types as llama-quantize does
    with ``--imatrix``)."""
    plan = Plan()
    used = [False] * len(recipe.layers)
    fallbacks: Dict[Tuple[str, str], int] = {}  # (K-quant type, its fallback) -> weights
    mix = _Mix(recipe, model, source, importance_matrix) if recipe.gguf_mix is not None else None
    named = [(n, m) for n, m in model.named_modules() if n]
    # torch.export modules keep only parameters in plain submodules; their classes come from graph metadata
    exported_types = getattr(model, "qtool_module_types", None) or {}
    candidates = set()  # modules whose weight the recipe could quantize
    stored_as = getattr(model, CHECKPOINT_KEYS, None) or {}
    for name, module in named:
        tname = exported_types.get(name, type(module).__name__)
        tnames = (tname,) if name in exported_types else _type_names(module)
        # ignore patterns are a safety net (recipes list lm_head for every model), so no-match is silent
        ignored = any(name_matches(pat, name) for pat in recipe.ignore)
        w_cand = any(t in DEFAULT_WEIGHT_TYPES for t in tnames)
        a_cand = any(t in DEFAULT_ACTIVATION_TYPES for t in tnames)
        w_spec = recipe.defaults.weights if w_cand else None
        if w_spec is not None and mix is not None:
            w_spec = mix.spec(name, module, w_spec)
        a_spec = recipe.defaults.activations if a_cand else None
        rule_w = rule_a = None
        for i, rule in enumerate(recipe.layers):
            if rule.match is not None and not name_matches(rule.match, name):
                continue
            if rule.types():
                if not any(t in rule.types() for t in tnames):
                    continue
                w_cand = a_cand = True  # naming a type opts modules of that type in
            if not (w_cand or a_cand):
                continue  # a name pattern only refines modules that can be quantized
            used[i] = True
            where = f"{source}: layers[{i}]"
            if "weights" in rule.model_fields_set and w_cand:
                w_spec = None if rule.weights is None else _merge(
                    w_spec or recipe.defaults.weights, rule.weights, WeightSpec, f"{where}.weights")
                rule_w = i
            if "activations" in rule.model_fields_set and a_cand:
                a_spec = None if rule.activations is None else _merge(
                    a_spec or recipe.defaults.activations, rule.activations, ActivationSpec, f"{where}.activations")
                rule_a = i
        if w_cand:
            candidates.add(name)
        if ignored:
            continue
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
                    if rounding.name != "nearest":
                        plan.warnings.append(f"{name} ({tname}): rounding {rounding.name} applies to Linear "
                                             "and Conv1d/Conv2d layers; this weight is rounded to nearest")
                        rounding = RoundingSpec()
                    if analyzer_args.get("weighting") == "activations":
                        plan.warnings.append(f"{name} ({tname}): weighting by activations applies to "
                                             "Linear and Conv1d/Conv2d layers; this weight's search is unweighted")
                        analyzer_args.pop("weighting")
                plan.quantizers.append(QuantizerPlan(
                    stored_as.get(f"{name}.weight", f"{name}.weight"), name, tname, "weight", w_spec.bitwidth, w_spec.symmetric,
                    w_spec.granularity, shape, block, w_spec.analyzer.name, rule_w,
                    tuple(analyzer_args.items()), w_spec.scale_dtype, rounding.name,
                    tuple(rounding.kwargs().items()), element=w_spec.element))
        if a_spec is not None:
            for tensor, on in (("input", a_spec.inputs and tname not in _INTEGER_INPUT_TYPES),
                               ("output", a_spec.outputs)):
                if on:
                    plan.quantizers.append(QuantizerPlan(
                        f"{name}.{tensor}", name, tname, tensor, a_spec.bitwidth, a_spec.symmetric,
                        a_spec.granularity, (), (a_spec.block_size,) if a_spec.block_size else None,
                        "dynamic" if a_spec.dynamic else a_spec.analyzer.name,
                        rule_a, tuple(a_spec.analyzer.kwargs().items()), a_spec.scale_dtype,
                        dynamic=a_spec.dynamic, element=a_spec.element))
    for (was, now), n in sorted(fallbacks.items()):
        plan.warnings.append(f"{n} weight(s) of {was}: rows not a whole number of 256-element super-blocks, so "
                             f"{now} as llama-quantize falls back")
    for i, ok in enumerate(used):
        if not ok and not recipe.layers[i].optional:
            rule = recipe.layers[i]
            sel = " ".join(filter(None, [f"match {rule.match!r}" if rule.match else "",
                                         f"type {rule.type!r}" if rule.type else ""]))
            msg = f"{source}: layers[{i}]: {sel} matches no module of the model" + _nearest_modules(rule, named)
            if not allow_unmatched:
                raise ConfigError(msg + " (pass --allow-unmatched to make this a warning)")
            plan.warnings.append(msg)
    if recipe.kv_cache is not None:
        plan.quantizers += _kv_cache_rows(recipe, named, source)
    plan.coverage = weight_coverage(model, {q.module for q in plan.weights}, candidates,
                                    lambda n: any(name_matches(pat, n) for pat in recipe.ignore))
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
        rotated = {m for r in (plan.rotation.online() if plan.rotation else []) for m in r.modules}
        clash = next((g for g in plan.smoothing if rotated & set(g.balance)), None)
        if clash is not None:
            raise ConfigError(f"{source}: smoothquant scales {sorted(rotated & set(clash.balance))[0]}'s input "
                              "channels, which r4 rotates at run time; leave that mapping out (smoothquant.mappings) "
                              "or r4 out of rotate")
    if recipe.fold_batch_norms:
        plan.folds = _fold_candidates(named)
        if not plan.folds:
            plan.warnings.append(f"{source}: fold_batch_norms: no BatchNorm follows a convolution in this model")
    return plan


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

    from .quant.hadamard import HadamardError, hadamard_order

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
            if not isinstance(modules.get(f"{layer}.{part}"), nn.Linear):
                raise ConfigError(f"{where}: {layer}.{part} is not a Linear layer; qtool rotates Llama-family "
                                  "decoder layers (Llama, Mistral, Qwen2, Qwen3 and their mixture-of-experts "
                                  "variants)")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            got = type(modules.get(f"{layer}.{norm}")).__name__
            if got not in rms_norms:
                raise ConfigError(f"{where}: {layer}.{norm} is a {got}, not an RMSNorm qtool can fold "
                                  f"({', '.join(rms_norms)})")
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
        widths = {modules[f"{layer}.{n}"].in_features for layer in layers
                  for n in moe_writers.get(layer, ("mlp.down_proj",))}
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
    _check_r4_width({modules[f"{layer}.output.dense"].in_features for layer in layers}, "output.dense", where)
    return RotationPlan(("r4",), spec.type, spec.seed, 0, 0, "", "", None, tuple(layers), down="output.dense")


def _check_r4_width(widths, part: str, where: str) -> None:
    """r4 rotates ``part``'s input in every layer: one width, with a Hadamard construction."""
    from .quant.hadamard import HadamardError, hadamard_order

    if len(widths) != 1:
        raise ConfigError(f"{where}: r4 rotates {part}'s input, whose width differs between layers "
                          f"({', '.join(map(str, sorted(widths)))})")
    try:
        hadamard_order(min(widths))
    except HadamardError as e:
        raise ConfigError(f"{where}: r4 rotates the intermediate size {min(widths)}: {e}") from None


def _kv_cache_rows(recipe: Recipe, named, source: str) -> List[QuantizerPlan]:
    """A ``k_cache`` and a ``v_cache`` row for every attention module with ``k_proj``/``v_proj`` children (not
    ignored): per tensor, or per KV head (encoding shape ``(heads, 1, 1)`` over ``(batch, heads, tokens, dim)``)."""
    from torch import nn

    spec = recipe.kv_cache
    rows: List[QuantizerPlan] = []
    for name, module in named:
        k, v = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        if not (isinstance(k, nn.Linear) and isinstance(v, nn.Linear)) or any(name_matches(p, name)
                                                                                for p in recipe.ignore):
            continue
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


def _fold_candidates(named) -> List[BatchNormFold]:
    """Each BatchNorm1d/2d/3d with running statistics and affine parameters whose nearest preceding convolution
    in module order (not transposed, not already paired) has as many output channels."""
    from torch import nn

    out: List[BatchNormFold] = []
    conv = None
    for name, module in named:
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            conv = (name, module)
        elif isinstance(module, nn.modules.batchnorm._BatchNorm) and conv is not None:
            if module.affine and module.track_running_stats and module.running_var is not None \
                    and module.num_features == conv[1].out_channels:
                out.append(BatchNormFold(conv[0], name))
            conv = None
    return out


def _nearest_modules(rule: LayerRule, named) -> str:
    """A hint for a rule that matched nothing: the module names (or types) closest to what it asked for."""
    import difflib

    if rule.match is not None:
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


def _smooth_groups(spec: SmoothQuantSpec, named, source: str, family: Optional[Family]) -> List[SmoothGroup]:
    """Resolve SmoothQuant mappings on the model: every module matching ``smooth`` with the Linear modules of its
    parent's subtree that match ``balance``, in module order. A mapping that pairs nothing is an error when the
    recipe gave it, and skipped when it is a default (a model without up_proj, say). The defaults are the model
    family's (Llama-style blocks for a model of no known family)."""
    from torch import nn

    defaults = LLAMA_SMOOTH_MAPPINGS if family is None else family.smooth_mappings
    if not spec.mappings and not defaults:
        raise ConfigError(f"{source}: smoothquant: {family.no_smoothing}")
    mappings = spec.mappings or [SmoothMapping(**m) for m in defaults]
    modules = dict(named)
    groups: List[SmoothGroup] = []
    for i, m in enumerate(mappings):
        found = 0
        for name, module in named:
            if not name_matches(m.smooth, name):
                continue
            parent = name.rsplit(".", 1)[0] + "." if "." in name else ""
            balance = tuple(n for n, mod in named if n.startswith(parent) and n != name and isinstance(mod, nn.Linear)
                            and any(name_matches(p, n) for p in m.balance))
            if not balance:
                continue
            width = _output_width(module)
            bad = [n for n in balance if modules[n].in_features != width]
            if width is None or bad:
                raise ConfigError(f"{source}: smoothquant: {name} ({type(module).__name__}) cannot scale the inputs "
                                  f"of {', '.join(bad or balance)} (its output has no per-channel weight of their "
                                  "input width)")
            groups.append(SmoothGroup(name, balance, spec.alpha, i))
            found += 1
        if not found and spec.mappings:
            raise ConfigError(f"{source}: smoothquant.mappings[{i}]: smooth {m.smooth!r} with balance {m.balance} "
                              "pairs no modules of this model")
    if not groups:
        raise ConfigError(f"{source}: smoothquant: none of the default mappings "
                          f"({family.title if family is not None else 'Llama-style'} norms and projections) pairs "
                          "modules of this model; give smoothquant.mappings")
    return groups


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
