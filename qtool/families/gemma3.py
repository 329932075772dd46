"""Gemma 3 (text; ``model_type: gemma3_text``): four norms per block (before and after attention and MLP) that
compute ``x / rms(x) · (1 + w)``, per-head q/k norms, GELU (tanh) MLPs, embeddings scaled by ``sqrt(hidden)``, and
sliding-window attention on five layers of every six, whose rotary base is 10000 while the full-attention layers
have their own (``rope_parameters``).

llama.cpp's ``gemma3`` hard-codes part of this (every sixth layer global, the local layers' rotary base 10000, the
attention scale ``1/sqrt(head_dim)``, ``1/sqrt(hidden/heads)`` for the 62-layer 27B), so a config that says
otherwise is refused instead of written as a file that computes another function. Its converter adds 1 to every
norm weight (llama.cpp multiplies by ``w``). Rotations and SmoothQuant have nothing to fold into: the ``(1 + w)``
norms are not plain RMSNorms.
"""

import math
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..errors import CheckpointError
from .base import Family, positive_int, rope

_LOCAL_THETA = 10000.0  # llama.cpp: rope_freq_base_train_swa
_PATTERN = 6  # llama.cpp: set_swa_pattern(6), every sixth layer full attention


def _split_rope(c: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(full-attention, sliding-attention) rope parameters, from transformers 5's per-layer-type
    ``rope_parameters`` or the older top-level ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        local = params.get("sliding_attention")
        return params["full_attention"], local if isinstance(local, dict) else {"rope_theta": _LOCAL_THETA}
    full = {"rope_theta": c.get("rope_theta") if c.get("rope_theta") is not None else 1_000_000.0}
    if isinstance(c.get("rope_scaling"), dict):
        full.update(c["rope_scaling"])
    local = c.get("rope_local_base_freq")
    return full, {"rope_theta": _LOCAL_THETA if local is None else local}


class Gemma3(Family):
    model_types = ("gemma3_text",)
    title = "Gemma 3"
    rms_norms = ()  # Gemma3RMSNorm is x / rms(x) · (1 + w)
    smooth_mappings = ()
    no_smoothing = ("Gemma 3's norms compute x / rms(x) · (1 + w), which a SmoothQuant scale does not fold into; "
                    "give smoothquant.mappings between Linear layers")
    gguf_arch = "gemma3"
    norm_shift = 1.0
    gguf_absent = {"attention_bias": "attention biases"}
    gguf_activations = ("gelu_pytorch_tanh",)  # (GELU with the tanh approximation)
    context_length = 131072

    def rope(self, config: Dict[str, Any]) -> Tuple[float, Optional[float]]:
        full, _ = _split_rope(config)
        return rope({"rope_parameters": full})

    def check_gguf(self, config: Dict[str, Any], where: Path) -> Dict[str, Any]:
        config = super().check_gguf(config, where)
        if config.get("attn_logit_softcapping") is not None:
            raise CheckpointError(f"{where}: attn_logit_softcapping is set, and llama.cpp's gemma3 has none")
        if config.get("use_bidirectional_attention"):
            raise CheckpointError(f"{where}: bidirectional attention (an embedding model) has no GGUF export in qtool")
        n = int(config["num_hidden_layers"])
        types = config.get("layer_types")
        if types is None:  # (older configs: transformers makes the list from sliding_window_pattern, 6 by default)
            pattern = positive_int(config, "sliding_window_pattern", where, 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        if config.get("sliding_window"):
            want = ["full_attention" if (i + 1) % _PATTERN == 0 else "sliding_attention" for i in range(n)]
            if list(types) != want:
                raise CheckpointError(f"{where}: layer_types differ from llama.cpp's gemma3 (sliding attention in "
                                      f"five layers of every six, the sixth full): {str(types)[:80]}")
        _, local = _split_rope(config)
        kind = local.get("rope_type", local.get("type", "default"))
        if kind not in (None, "default") or float(local.get("rope_theta") or 0) != _LOCAL_THETA:
            raise CheckpointError(f"{where}: the sliding-attention layers' rope must be the default with base "
                                  f"{_LOCAL_THETA:g}, as llama.cpp's gemma3 computes it")
        head_dim = int(config.get("head_dim") or 256)
        config["head_dim"] = head_dim
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        scalar = config.get("query_pre_attn_scalar")
        scalar = 256 if scalar is None else scalar
        llama_cpp = hidden / heads if n == 62 else head_dim  # its 27B rule, by layer count
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not math.isclose(float(scalar),
                                                                                                llama_cpp):
            raise CheckpointError(f"{where}: query_pre_attn_scalar {str(scalar)[:20]} scales attention otherwise "
                                  f"than llama.cpp's gemma3 (1/sqrt({llama_cpp:g}) for this model)")
        return config

    def add_gguf_metadata(self, writer, config: Dict[str, Any], n_layers: int) -> None:
        super().add_gguf_metadata(writer, config, n_layers)
        head_dim = int(config["head_dim"])
        if head_dim == int(config["hidden_size"]) // int(config["num_attention_heads"]):  # else written above
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
        if config.get("sliding_window"):
            writer.add_sliding_window(int(config["sliding_window"]))
        writer.add_add_space_prefix(False)


FAMILY = Gemma3()
