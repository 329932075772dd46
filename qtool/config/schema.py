"""The recipe's schema (pydantic): what a recipe may say, validated once at the edge, and how a rule's partial
spec lays over the one before it (``_merge``). See docs/recipes.md."""

from __future__ import annotations

import fnmatch
import functools
import re
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, field_validator, model_validator

from ..choices import GGML_SCALE_DTYPES, GGUF_TYPES
from ..errors import ConfigError
from .messages import _describe, _key_path, _short, fields_at


# Module types that get quantizers when no rule names a type.
DEFAULT_WEIGHT_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Embedding")


# Embedding takes integer indices, so it has no input quantizer; its output (a float) may be quantized.
DEFAULT_ACTIVATION_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Embedding")


_INTEGER_INPUT_TYPES = ("Embedding",)
NEEDS_SELECTOR = "a layers entry needs 'match' (name pattern) or 'type' (module class)"


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
    percentile: Optional[StrictFloat] = Field(None, ge=50, le=100)
    num_bins: Optional[StrictInt] = Field(None, ge=8, le=65536)
    gamma: Optional[StrictFloat] = Field(None, gt=0, le=1e30)  # (past it, float32 products overflow)
    asymmetric_delta_candidates: Optional[StrictInt] = Field(None, ge=2)
    symmetric_delta_candidates: Optional[StrictInt] = Field(None, ge=2)
    offset_candidates: Optional[StrictInt] = Field(None, ge=3)
    num_candidates: Optional[StrictInt] = Field(None, ge=1, le=1000)
    min_ratio: Optional[StrictFloat] = Field(None, gt=0, le=1)
    # "activations": each weight's squared error counts by its input channel's E[x²] (needs --data);
    # "magnitude": by rms + |w| of its block (llama.cpp's K-quant weighting without an importance matrix; no data)
    # "activations_magnitude": by both multiplied (the kind of product llama.cpp weights by with an importance
    # matrix; needs --data or --imatrix)
    weighting: Optional[Literal["none", "activations", "magnitude", "activations_magnitude"]] = None

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


_ROUNDING_PARAMS = {"nearest": (), "gptq": ("block_columns", "dampening", "act_order", "bounded", "shrinkage"),
                    "adaround": ("iterations", "reg_weight", "warm_start", "learning_rate"),
                    "signround": ("iterations", "learning_rate", "ranges", "seed")}


class RoundingSpec(BaseModel):
    """``rounding: NAME`` or ``rounding: {name: gptq, <parameter>: value, ...}``: how a weight's codes are chosen on
    the grid its analyzer picked. ``nearest`` rounds each value alone; ``gptq`` chooses codes column by column
    from the layer's input statistics (qtool.calibration.rounding.gptq); ``adaround`` learns each value's up/down
    rounding from them (qtool.calibration.rounding.adaround); ``signround`` learns each value's rounding and each
    block's range per decoder block, on the block's own inputs and output (qtool.calibration.rounding.signround;
    ``--sequential``)."""

    model_config = ConfigDict(extra="forbid")
    name: Literal["nearest", "gptq", "adaround", "signround"] = "nearest"
    block_columns: Optional[StrictInt] = Field(None, ge=1, le=65536)
    dampening: Optional[StrictFloat] = Field(None, ge=0, le=10)
    act_order: Optional[StrictBool] = None
    bounded: Optional[StrictBool] = None
    shrinkage: Optional[StrictFloat] = Field(None, ge=0, le=1)
    iterations: Optional[StrictInt] = Field(None, ge=0, le=100000)
    reg_weight: Optional[StrictFloat] = Field(None, ge=0, le=1000)
    warm_start: Optional[StrictFloat] = Field(None, ge=0, le=1)
    learning_rate: Optional[StrictFloat] = Field(None, gt=0, le=10)
    ranges: Optional[StrictBool] = None
    seed: Optional[StrictInt] = Field(None, ge=0, le=2**31 - 1)

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

    bitwidth: StrictInt = Field(8, ge=2, le=16)
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
        from ..choices import check_element, check_scale_dtype

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
        if self.rounding.name == "signround" and self.scale_dtype in ("iq4_nl", "iq4_xs"):
            raise ValueError(f"gguf_type {self.scale_dtype}: rounding signround learns on evenly spaced grids, and "
                             "IQ4's 16 levels are a table; use gptq or nearest there")
        if self.rounding.name == "signround" and self.element == "int" and self.scale_dtype not in (
                "float32", *GGML_SCALE_DTYPES):
            raise ValueError(f"scale_dtype {self.scale_dtype}: rounding signround learns on integer grids with "
                             "float32 scales, GGUF's block types and float elements (fp8, fp4) so far; use gptq or "
                             "nearest there")
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

    @field_validator("type", mode="before")
    @classmethod
    def _class_names(cls, value):
        # (one line, not one per branch of the union: "type.str: ..." and "type.list[str][1]: ...")
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"a module class name or a list of them (got {str(value)[:60]})")
        odd = next((i for i, t in enumerate(value) if not isinstance(t, str)), None)
        if odd is not None:
            raise ValueError(f"a list of module class names, and [{odd}] is {repr(value[odd])[:40]}, not one")
        return value

    @model_validator(mode="after")
    def _needs_a_selector(self):
        if self.match is None and self.type is None:
            raise ValueError(NEEDS_SELECTOR)
        if self.type is not None and not self.types():  # ([] selected every module: no type to filter by)
            raise ValueError("type: [] names no module class; give one or more, or leave type out")
        if isinstance(self.type, str) and not self.type.strip() or any(not t.strip() for t in self.types()):
            raise ValueError("type: an empty class name")
        if self.match is not None and not self.match:
            raise ValueError("match: '' is an empty pattern (a module's name, a glob such as '*.q_proj', or 're:...')")
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
    alpha: StrictFloat = Field(0.5, ge=0, le=1)
    mappings: Optional[List[SmoothMapping]] = None


class AwqSpec(BaseModel):
    """``awq: {grid: 19}``: AWQ (activation-aware weight quantization) before the weights calibrate. Per mapping
    (the same pairings as SmoothQuant's: a norm or Linear feeding balance Linears), a per-input-channel scale
    ``s = m_x^r / m_w^(1 - r)`` (``duo_scaling``; ``m_x^r`` without it) moves weight magnitude where the
    activations are large; ``r`` is searched over ``grid`` points spread over [0, 1], and no scaling, for the
    least output error of the module that holds the balance layers quantized as the recipe says (``objective:
    outputs``, the default: the attention for q/k/v, the MLP for gate/up, run on the data for every candidate, as
    AWQ's authors and llm-compressor score them) or of the balance layers alone (``layers``: from their inputs'
    ``XᵀX``). The smooth module absorbs ``1/s``: the float model is unchanged and the exported files need nothing
    new (qtool.calibration.awq). ``mappings`` default to the model family's."""

    model_config = ConfigDict(extra="forbid")
    grid: StrictInt = Field(19, ge=2, le=100)  # llm-compressor's n_grid=20 candidates: a comparison gets its choices
    duo_scaling: StrictBool = True
    objective: Literal["layers", "outputs"] = "outputs"
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
    seed: StrictInt = Field(0, ge=0, le=2**63 - 1)
    # r1 block-diagonal with blocks of this many channels (None: one rotation of the whole width). Small blocks
    # suit block-scaled formats (NVFP4, MXFP4), whose block scales already isolate an outlier channel: a rotation
    # of the whole width would spread it into every block
    block_size: Optional[StrictInt] = Field(None, ge=1, le=65536)

    @field_validator("rotations")
    @classmethod
    def _known(cls, v):
        if len(set(v)) != len(v):
            raise ValueError("a rotation is listed twice")
        return v

    @model_validator(mode="after")
    def _block_for_r1(self):
        if self.block_size is not None and "r1" not in self.rotations:  # (r2, r3, r4 rotate whole widths)
            raise ValueError("block_size makes r1's rotation of the residual stream block-diagonal, and rotations "
                             "lists no r1 (r2, r3 and r4 always rotate their whole width): remove block_size, or "
                             "add r1")
        return self


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    defaults: Defaults = Defaults()
    layers: List[LayerRule] = []
    ignore: List[str] = []
    smoothquant: Optional[SmoothQuantSpec] = None
    awq: Optional[AwqSpec] = None  # activation-aware scales folded into the float weights before they calibrate
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
            # (gguf_type first: it sets the implied keys itself, which the user did not write)
            grid = [k for k in ("gguf_type",) + _GGUF_IMPLIED if k in self.defaults.weights.model_fields_set]
            if grid:
                raise ValueError(f"gguf_mix {self.gguf_mix} chooses each weight's GGUF type, and so its grid: "
                                 f"defaults.weights.{grid[0]} would be ignored; remove it (a layers rule's gguf_type "
                                 "sets one weight's type)")
        return self

    @model_validator(mode="after")
    def _one_scale_transform(self):
        if self.awq is not None and self.smoothquant is not None:
            raise ValueError("awq and smoothquant both fold per-channel scales into the same layers; use one")
        if self.awq is not None and self.defaults.weights is None and \
                not any(r.weights is not None for r in self.layers):
            raise ValueError("awq chooses scales for quantized weights: the recipe quantizes none")
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


def _backtracks(regex: str) -> Optional[str]:
    """How Python's ``re`` can backtrack exponentially on ``regex`` (a compiled one), or None: a repetition of
    more than a few rounds around a repetition of varying count (``(a+)+``, ``(x{1,3})*``, ``(a+){1,30}``:
    "nested") or around alternatives its parser could not merge into one character class (``(.|.)*``,
    ``(a|ab)+``: "alternatives"; ``(a|b)*`` is ``[ab]*``). Read from the parsed pattern, so groups inside groups
    are seen; lookarounds, atomic groups and possessive repeats do not backtrack into their insides."""
    try:
        from re import _parser as parser  # (Python 3.11+)
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as parser

    def walk(items, repeated: bool) -> Optional[str]:
        for op, av in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT"):
                if repeated and av[0] != av[1]:
                    return "nested"
                found = walk(av[2], repeated or av[1] > _FEW_ROUNDS)
            elif name == "BRANCH":
                found = "alternatives" if repeated else next(
                    (f for f in (walk(b, repeated) for b in av[1]) if f), None)
            elif name == "SUBPATTERN":
                found = walk(av[3], repeated)
            elif name in ("ASSERT", "ASSERT_NOT"):  # (atomic: entered afresh at each position)
                found = walk(av[1], False)
            elif name in ("ATOMIC_GROUP", "POSSESSIVE_REPEAT"):
                found = walk(av if name == "ATOMIC_GROUP" else av[2], False)
            elif name == "GROUPREF_EXISTS":
                found = next((f for f in (walk(b, repeated) for b in av[1:] if b) if f), None)
            else:
                found = None
            if found:
                return found
        return None

    return walk(parser.parse(regex), False)


# a repetition of at most this many rounds around alternatives or a varying count backtracks a bounded amount
_FEW_ROUNDS = 4


_BACKTRACKING = {
    "nested": "repeats a group that itself repeats (like (a+)+), which can take minutes to match; write it without "
              "the nested repetition",
    "alternatives": "repeats a group of alternatives (like (a|ab)*), which can take minutes to match where they "
                    "overlap; use a character class ([ab]*) or write it without the repetition"}


@functools.lru_cache(maxsize=1024)
def _compile_pattern(pattern: str):
    """A recipe pattern compiled once (resolution matches every pattern against every module name)."""
    if pattern.startswith("re:"):
        try:
            compiled = re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"bad regular expression {_short(pattern[3:])}: {e}") from None
        how = _backtracks(pattern[3:])
        if how:
            raise ValueError(f"regular expression {_short(pattern[3:])} {_BACKTRACKING[how]}")
        return compiled
    return re.compile(fnmatch.translate(pattern))


def name_matches(pattern: str, name: str) -> bool:
    """Glob on the whole module name, or a regex (full match) after ``re:``. A module's name written out in full
    matches it whatever glob characters it holds (``x[0]``, which as a glob would be ``x0``)."""
    return (pattern == name and not pattern.startswith("re:")) or _compile_pattern(pattern).fullmatch(name) is not None


def exact_pattern(name: str) -> str:
    """A recipe pattern that matches module ``name`` and nothing else (what written recipes name a module by)."""
    return "re:" + re.escape(name) if any(c in name for c in "*?[") or name.startswith("re:") else name


_GGUF_IMPLIED = ("bitwidth", "symmetric", "granularity", "block_size", "scale_dtype", "element")


def rule_specs(recipe: "Recipe"):
    """Each ``layers`` entry's partial weights/activations merged as resolution may merge them, without a model:
    over the defaults, else over every earlier entry's (a rule may need what an earlier one set).
    Yields ``(index, "weights" | "activations", spec or None, the first merge's ConfigError or None)``."""
    chain = {"weights": recipe.defaults.weights, "activations": recipe.defaults.activations}
    defaults = dict(chain)
    cls = {"weights": WeightSpec, "activations": ActivationSpec}
    for i, rule in enumerate(recipe.layers):
        for kind in ("weights", "activations"):
            part = getattr(rule, kind)
            if not part:
                continue
            spec, error = None, None
            for base in (defaults[kind], chain[kind]):
                try:
                    spec = chain[kind] = _merge(base, part, cls[kind], "")
                    break
                except ConfigError as e:
                    error = error or e
            yield i, kind, spec, None if spec is not None else error


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
            if isinstance(start[key], dict) and start[key] and "name" not in start[key]:
                # (merged over its default name, the error named an algorithm the entry never wrote)
                raise ConfigError(f"{where}.{key}: an entry's {key} replaces the one before whole, so it names its "
                                  f"algorithm ({key}: {{name: ..., {', '.join(start[key])}: ...}})")
    try:
        return cls.model_validate(start)
    except ValidationError as e:
        lines = []  # (every problem of the entry: the first is the message)
        for err in e.errors():
            key = _key_path(err["loc"])
            desc = _describe(err, fields_at(cls, err["loc"]))
            lines.append(f"{where}.{key}: {desc}" if key else f"{where}: {desc}")
        raise ConfigError(lines[0], lines) from None
