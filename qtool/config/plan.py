"""What resolution makes of a recipe for one model: the plan's types (one row per quantizer, SmoothQuant
groups, BatchNorm folds, rotations)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Tuple

from ..choices import weighs_activations
from ..errors import ConfigError
from .schema import WeightSpec

if TYPE_CHECKING:
    from ..quant.spec import Granularity, QuantSpec


KV_CACHE_TENSORS = ("k_cache", "v_cache")


def granularity_word(tensor: str, granularity: str) -> str:
    """The recipe's word for a quantizer's granularity: a KV cache's per-head scales are ``per_channel`` over the
    heads axis in the encodings, ``per_head`` in the recipe (``kv_cache: {granularity: per_head}``)."""
    return "per_head" if tensor in KV_CACHE_TENSORS and granularity == "per_channel" else granularity


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
    def r1_blocks(self) -> Optional[int]:
        """The width of r1's blocks where its rotation is block-diagonal (None: one rotation of the whole width)."""
        return self.block_size if "r1" in self.rotations and 0 < self.block_size < self.hidden else None

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
        from ..quant.spec import QuantSpec

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
        return self.tensor == "weight" and (self.rounds_layerwise or (
            weighs_activations(dict(self.analyzer_args).get("weighting")) and not self.imatrix))

    @property
    def rounds_layerwise(self) -> bool:
        """True when this weight's codes come from its layer's ``XᵀX`` (GPTQ, AdaRound): the statistics keep it."""
        return self.tensor == "weight" and self.rounding in ("gptq", "adaround")

    @property
    def learns_rounding(self) -> bool:
        """True when this weight's codes are learned per decoder block on the block's inputs (signround)."""
        return self.tensor == "weight" and self.rounding == "signround"

    @property
    def analyzer_label(self) -> str:
        if not self.analyzer_args:
            return self.analyzer
        return f"{self.analyzer}(" + ", ".join(f"{k}={v}" for k, v in self.analyzer_args) + ")"

    def describe_granularity(self) -> str:
        said = self._spec.describe()
        word = granularity_word(self.tensor, self.granularity)
        return said.replace(self.granularity, word, 1) if word != self.granularity else said


@dataclass(frozen=True)
class SmoothGroup:
    """One resolved SmoothQuant pairing: ``smooth`` (module name) feeds ``balance`` (Linear module names)."""

    smooth: str
    balance: Tuple[str, ...]
    alpha: float
    mapping: int = 0  # index of the mapping that paired them (errors name it)


@dataclass
class AwqPlan:
    """A recipe's ``awq`` resolved on a model: the groups (``SmoothGroup``; ``alpha`` unused) in the order they are
    searched, the grid of ratios and the scale formula; ``chosen`` is filled as each group is searched (the
    manifest's record: smooth module, ratio, the balance layers' output error before and after)."""

    groups: Tuple[SmoothGroup, ...]
    grid: int  # (the defaults are AwqSpec's, in one place)
    duo_scaling: bool
    objective: str  # "outputs": each group's parent module's output error, or "layers" (qtool.calibration.awq)
    chosen: List[Dict[str, Any]] = field(default_factory=list)


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
    awq: Optional["AwqPlan"] = None  # AWQ's groups and search, applied before the weights calibrate
    folds: List[BatchNormFold] = field(default_factory=list)  # batch norms folded before calibration
    rotation: Optional[RotationPlan] = None  # Hadamard rotations fused before calibration
    # module -> E[x²] per input column from an importance matrix file (rows with ``imatrix`` weight by it)
    importances: Dict[str, Any] = field(default_factory=dict)
    # module -> the resolved recipe spec of its weight (what a ``layers`` entry writes to reproduce that row)
    weight_specs: Dict[str, "WeightSpec"] = field(default_factory=dict)
    # quantizers the export format will write float (set by the job that exports; the plan line counts them apart)
    # quantizer name -> what the format does ("left float by --format compressed-tensors")
    left_float: Dict[str, str] = field(default_factory=dict)
    # weight quantizers on a parameter the model shares with another name (tied embeddings), which a checkpoint
    # stores once, under the first name: quantizer name -> that name (not set where a rotation unties them)
    tied: Dict[str, str] = field(default_factory=dict)
    # with a kv_cache: the attention modules whose keys and values stay float (ignored), in module order
    kv_float: List[str] = field(default_factory=list)
    # mixture-of-experts expert module -> calibration tokens routed to it (where its layers' inputs were measured),
    # in plan (module) order: every mode fills it block by block, a resumed run from its saved blocks first
    expert_tokens: Dict[str, int] = field(default_factory=dict)
    # experts module -> its number of experts (a mixture-of-experts model's; the last ones, ignored, have no row)
    expert_counts: Dict[str, int] = field(default_factory=dict)
    # per decoder block whose rounding was learned (signround), in block order: what it chose and the losses
    learned: List[Dict[str, Any]] = field(default_factory=list)
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
        return (bool(self.static_activations) or bool(self.smoothing) or bool(self.folds) or self.awq is not None
                or any(q.needs_inputs or q.learns_rounding for q in self.weights))
