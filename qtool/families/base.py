"""The one class a model family file fills in (:class:`Family`), and what most families share.

A family answers, for one Hugging Face architecture, every question qtool asks that depends on the architecture:
which norms a rotation or SmoothQuant may fold into, which norm feeds which projections, and how llama.cpp's
converter writes the model (its GGUF architecture, the checks that the file computes what transformers computes,
the hyperparameters, any tensor transform). Everything else (every ``nn.Linear``, every fused expert tensor) is
quantized without a family; only the paths that need one refuse a model that has none.
No torch here: recipes are checked before torch loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import CheckpointError

__all__ = ["Family", "TensorPart", "LLAMA_SMOOTH_MAPPINGS", "positive_int", "finite", "rope", "yarn", "check_yarn",
           "windowed"]


@dataclass(frozen=True)
class TensorPart:
    """One GGUF tensor llama.cpp's converter makes from part of a checkpoint tensor: the rows ``rows`` of the
    ``[out, in]`` weight, reshaped to ``shape`` and, with ``transpose``, its last two dimensions swapped (a
    transposed quantized weight has no blocks left along its rows: it is written as float values)."""

    key: str  # the name gguf-py's TensorNameMap knows it by (DeepSeek's k_b_proj)
    rows: Tuple[int, ...]
    shape: Tuple[int, ...]  # before the transpose
    transpose: bool = False

# Llama-style decoder blocks: each norm feeds the projections after it, and up_proj's output rows scale
# down_proj's input channels exactly (act(gate) * up is linear in up)
LLAMA_SMOOTH_MAPPINGS: Tuple[Dict[str, Any], ...] = (
    {"smooth": "re:.*input_layernorm", "balance": ["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"]},
    {"smooth": "re:.*post_attention_layernorm", "balance": ["re:.*gate_proj", "re:.*up_proj"]},
    {"smooth": "re:.*up_proj", "balance": ["re:.*down_proj"]},
)


class Family:
    """One architecture. A family file makes one subclass (or instance) and names it ``FAMILY``."""

    #: Hugging Face ``model_type`` values (config.json) this family describes
    model_types: Tuple[str, ...] = ()
    #: its name in messages and docs
    title: str = ""
    #: norm classes that compute ``x / rms(x) · w`` and nothing else: rotations fold into them
    rms_norms: Tuple[str, ...] = ()
    #: SmoothQuant's default mappings (``()``: none; ``no_smoothing`` says why)
    smooth_mappings: Tuple[Dict[str, Any], ...] = LLAMA_SMOOTH_MAPPINGS
    no_smoothing: str = ""
    #: llama.cpp's architecture (``None``: no GGUF export)
    gguf_arch: Optional[str] = None
    #: llama.cpp's loader for the architecture needs ``output.weight`` (it does not fall back to ``token_embd`` for a
    #: tied output layer): a tied model's GGUF then stores the embedding table twice
    gguf_needs_output: bool = False
    #: q/k projection rows permuted into llama.cpp's rotary layout (its converter's ``LlamaModel``)
    permute_qk: bool = False
    #: whether llama.cpp's architecture normalizes the routed experts' weights (Hugging Face: norm_topk_prob)
    normalizes_top_k: Optional[bool] = None
    #: added to every float ``*norm.weight`` tensor in GGUF (Gemma's norms compute ``x / rms(x) · (1 + w)``)
    norm_shift: float = 0.0
    #: the context length the converter writes when config.json gives no ``max_position_embeddings``
    context_length: int = 2048
    #: each head's width where config.json gives no ``head_dim``, as transformers' config class defaults it
    #: (Qwen3's 128, whatever the hidden size); None: ``hidden_size / num_attention_heads``
    default_head_dim: Optional[int] = None
    #: transformers' model of the family reads experts stored one by one (its loader stacks them into its fused
    #: module, as Qwen3-MoE's does); False where its checkpoints store them fused and its loader reads only that
    #: (gpt-oss, GraniteMoE): a compressed-tensors file's per-expert tensors then load as random experts
    transformers_reads_split_experts: bool = True
    #: config.json keys for what llama.cpp's architecture has no tensor or step for (key -> what): set (true, a
    #: number), its GGUF would not load (a bias tensor it does not expect) or would compute another function
    gguf_absent: Dict[str, str] = {}
    #: the MLP activations llama.cpp's architecture hard-codes (transformers' ``hidden_act`` names; the first is the
    #: config class's default): another one there writes a file that computes another function
    gguf_activations: Tuple[str, ...] = ("silu", "swish")

    # ---- GGUF -----------------------------------------------------------------------------------------------
    def check_gguf(self, config: Dict[str, Any], where: Path) -> Dict[str, Any]:
        """``config`` (config.json) checked for what llama.cpp's architecture computes, with checked values in
        place of absent or null ones; raises ``CheckpointError`` (one line) where the GGUF file would compute
        another function than transformers does."""
        positive_int(config, "num_hidden_layers", where)
        heads = positive_int(config, "num_attention_heads", where)
        for key, what in self.gguf_absent.items():
            if config.get(key) not in (None, False, 0):
                raise CheckpointError(f"{where}: {key} is {str(config[key])[:20]}, and llama.cpp's {self.gguf_arch} "
                                      f"has no {what}: its GGUF would not load or would compute another function")
        key = "hidden_activation" if config.get("hidden_activation") is not None else "hidden_act"
        act = config.get(key) or self.gguf_activations[0]
        if act not in self.gguf_activations:
            raise CheckpointError(f"{where}: {key} is {str(act)[:40]!r}, and llama.cpp's {self.gguf_arch} computes "
                                  f"{' / '.join(self.gguf_activations)} only: its GGUF would compute another function")
        config = dict(config)
        config["num_key_value_heads"] = positive_int(config, "num_key_value_heads", where, default=heads)
        for key in ("hidden_size", "intermediate_size"):
            positive_int(config, key, where)
        if config.get("num_experts") or config.get("num_local_experts"):
            positive_int(config, "num_experts_per_tok", where)
            normalizes = self.normalizes_top_k
            if normalizes is not None and bool(config.get("norm_topk_prob", False)) != normalizes:
                raise CheckpointError(f"{where}: norm_topk_prob is {str(not normalizes).lower()}, and llama.cpp's "
                                      f"{self.gguf_arch} {'always' if normalizes else 'never'} normalizes the routed "
                                      "experts' weights: its GGUF would compute another function")
            if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
                raise CheckpointError(f"{where}: dense MLP layers among the MoE ones (mlp_only_layers, "
                                      "decoder_sparse_step) have no GGUF export in qtool")
        for key, default in (("max_position_embeddings", self.context_length), ("head_dim", self.default_head_dim)):
            config[key] = positive_int(config, key, where, default)
        config["rms_norm_eps"] = finite(config, "rms_norm_eps", where, 1e-6)
        try:
            theta, factor = self.rope(config)
            for value in (theta, factor):
                if value is not None and (isinstance(value, bool) or not math.isfinite(float(value))):
                    raise ValueError(value)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
            raise CheckpointError(f"{where}: rope_theta / rope_scaling must be finite numbers ({type(e).__name__}: "
                                  f"{str(e)[:60]})") from None
        try:
            self.attention_window(config)
        except (TypeError, ValueError):  # (max_window_layers null: transformers cannot build the model either)
            raise CheckpointError(f"{where}: sliding_window / max_window_layers must be integers") from None
        return config

    def rope(self, config: Dict[str, Any]) -> Tuple[float, Optional[float]]:
        """(rope theta, linear scaling factor or None) of the attention llama.cpp's ``rope_freq_base`` is for."""
        return rope(config)

    def add_gguf_metadata(self, writer, config: Dict[str, Any], n_layers: int) -> None:
        """The hyperparameters llama.cpp's converter writes for this family (``config`` as :meth:`check_gguf`
        returned it)."""
        import gguf

        c = config
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or hidden // heads)
        writer.add_context_length(int(c["max_position_embeddings"]))
        writer.add_embedding_length(hidden)
        writer.add_block_count(n_layers)
        writer.add_feed_forward_length(int(c["intermediate_size"]))
        experts = c.get("num_experts") or c.get("num_local_experts")
        if experts:
            writer.add_expert_count(int(experts))
            writer.add_expert_used_count(int(c["num_experts_per_tok"]))
            if c.get("moe_intermediate_size"):
                writer.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))
            if c.get("shared_expert_intermediate_size"):
                writer.add_expert_shared_feed_forward_length(int(c["shared_expert_intermediate_size"]))
        writer.add_head_count(heads)
        writer.add_head_count_kv(int(c["num_key_value_heads"]))
        writer.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
        theta, factor = self.rope(c)
        writer.add_rope_freq_base(float(theta))
        writer.add_rope_dimension_count(self.rope_dimensions(c))
        if head_dim != hidden // heads:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        if factor is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(factor))

    def gguf_warnings(self, config: Dict[str, Any]) -> List[str]:
        """What the file computes otherwise than transformers by llama.cpp's own rule, which its converter's file
        shares (written, not refused)."""
        window, layers = self.attention_window(config)
        if not layers or window >= int(config["max_position_embeddings"]):
            return []
        default = " (transformers' default: config.json names none)" if "sliding_window" not in config else ""
        return [f"sliding_window {window}{default}: transformers attends to the last {window} tokens in {layers} of "
                f"{config['num_hidden_layers']} layers, llama.cpp's {self.gguf_arch} to the whole context (as in "
                f"the file of its own converter): outputs differ on text longer than {window} tokens"]

    def attention_window(self, config: Dict[str, Any]) -> Tuple[int, int]:
        """(window, layers using it) of a sliding-window attention transformers runs and llama.cpp's architecture
        does not ((0, 0): none)."""
        return 0, 0

    def rope_dimensions(self, config: Dict[str, Any]) -> int:
        """How many of each head's dimensions rotate (all of them unless the family says otherwise)."""
        return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))

    def gguf_skip(self, key: str) -> bool:
        """Whether llama.cpp's converter leaves checkpoint tensor ``key`` out of the model file (a multimodal
        model's image encoder goes to a separate mmproj file)."""
        return False

    # ---- compressed-tensors ----------------------------------------------------------------------------------
    def compressed_tensors_name(self, name: str) -> str:
        """A tensor's or module's ``name`` as a compressed-tensors file of the family holds it: the per-expert
        names vLLM's loader for the family reads (by default the names qtool quantizes, the checkpoint's or
        llm-compressor's ``experts.<e>.gate_proj``)."""
        return name

    def gguf_key(self, key: str) -> str:
        """``key`` as gguf-py's TensorNameMap knows it (the converter's renames before its lookup)."""
        return key

    def gguf_parts(self, key: str, config: Dict[str, Any]) -> Optional[List[TensorPart]]:
        """The GGUF tensors the converter splits checkpoint tensor ``key`` into (None: it is written whole)."""
        return None

    def gguf_tensor(self, key: str, tensor):
        """A float (unquantized) checkpoint tensor as llama.cpp's converter writes it."""
        if self.norm_shift and key.endswith("norm.weight"):
            return tensor.float() + self.norm_shift  # in float32, as transformers adds it
        return tensor


def rope(c: Dict[str, Any]) -> Tuple[float, Optional[float]]:
    """(rope theta, linear scaling factor or None); transformers 5 keeps both in ``rope_parameters``."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or params
    theta = c.get("rope_theta")
    if theta is None:  # absent or null: transformers' default
        theta = params.get("rope_theta")
    theta = 10000.0 if theta is None else theta
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, float(scaling["factor"])
    raise CheckpointError(f"rope scaling {kind!r} is not supported by qtool's GGUF export (only none or linear)")


def yarn(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The YaRN rope parameters (transformers 5's ``rope_parameters`` or the older ``rope_scaling``), else None."""
    for params in (config.get("rope_parameters"), config.get("rope_scaling")):
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) == "yarn":
            return params
    return None


def check_yarn(config: Dict[str, Any], where: Path) -> Optional[Dict[str, Any]]:
    """:func:`yarn`'s parameters, checked for what llama.cpp reads of them (a factor >= 1 and the original
    context length); raises ``CheckpointError`` in one line."""
    params = yarn(config)
    try:
        if params is not None and not (float(params["factor"]) >= 1
                                       and int(params["original_max_position_embeddings"]) > 0):
            raise ValueError
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{where}: YaRN rope scaling needs a factor >= 1 and a positive "
                              "original_max_position_embeddings") from None
    return params


def windowed(config: Dict[str, Any], window: Any, sliding=None) -> Tuple[int, int]:
    """``(window, layers)`` for :meth:`Family.attention_window`: ``window`` (config.json's, as the family's
    transformers config reads it) on the layers config.json's ``layer_types`` name sliding, else on those layer
    indices ``sliding(i)`` holds for; ``sliding`` None: on every layer (the family's attention reads no
    ``layer_types``)."""
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return 0, 0
    types = config.get("layer_types") if sliding is not None else None
    n = int(config["num_hidden_layers"])
    layers = sum(t == "sliding_attention" for t in types) if isinstance(types, list) else \
        n if sliding is None else sum(bool(sliding(i)) for i in range(n))
    return (window, layers) if layers else (0, 0)


def positive_int(config: Dict[str, Any], key: str, where: Path, default: Any = ...) -> Optional[int]:
    """``config[key]`` as a positive integer (``default`` when absent or null; required when no default)."""
    value = config.get(key)
    if value is None:
        if default is ...:
            raise CheckpointError(f"{where}: missing {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
        raise CheckpointError(f"{where}: {key} must be a positive integer (got {str(value)[:40]!r})")
    return value


def finite(config: Dict[str, Any], key: str, where: Path, default: float) -> float:
    """``config[key]`` as a finite float (``default`` when absent or null)."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < 1e308:
        raise CheckpointError(f"{where}: {key} must be a finite number (got {str(value)[:40]!r})")
    return float(value)
