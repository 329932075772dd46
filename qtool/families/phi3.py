"""Phi-3 (and Phi-3.5-mini, Phi-4-mini): q/k/v fused into one ``qkv_proj`` and gate/up into one ``gate_up_proj``
(llama.cpp's ``attn_qkv`` and ``ffn_up``, which its phi3 graph splits in half), rotary embedding on
``partial_rotary_factor`` of each head. llama.cpp ignores Phi-3's sliding window (it says so when it loads the
file), so, as with its own converter's files, text longer than the window runs with full attention there.
Rotations need separate q/k/v and gate/up layers and refuse Phi-3; SmoothQuant folds the two norms into the fused
projections after them.
"""

from pathlib import Path
from typing import Any, Dict, Tuple

from ..errors import CheckpointError
from .base import Family, windowed

_SMOOTH = (
    {"smooth": "re:.*input_layernorm", "balance": ["re:.*qkv_proj"]},
    {"smooth": "re:.*post_attention_layernorm", "balance": ["re:.*gate_up_proj"]},
)


class Phi3(Family):
    model_types = ("phi3",)
    title = "Phi-3"
    rms_norms = ("Phi3RMSNorm",)
    smooth_mappings = _SMOOTH
    gguf_arch = "phi3"

    def check_gguf(self, config: Dict[str, Any], where: Path) -> Dict[str, Any]:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if isinstance(params, dict) and (params.get("long_factor") or params.get("short_factor")):
            raise CheckpointError(f"{where}: longrope scaling (long_factor / short_factor) has no GGUF export in qtool "
                                  "yet")
        config = super().check_gguf(config, where)
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        if config["head_dim"] is not None and config["head_dim"] * heads != hidden:
            raise CheckpointError(f"{where}: head_dim {config['head_dim']} is not hidden_size / num_attention_heads "
                                  f"({hidden} / {heads}), and llama.cpp's phi3 splits attn_qkv by hidden_size")
        factor = config.get("partial_rotary_factor", (params or {}).get("partial_rotary_factor", 1.0))
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise CheckpointError(f"{where}: partial_rotary_factor must be in (0, 1] (got {str(factor)[:20]!r})")
        config["partial_rotary_factor"] = float(factor)
        return config

    def attention_window(self, config: Dict[str, Any]) -> Tuple[int, int]:
        return windowed(config, config.get("sliding_window"))

    def rope_dimensions(self, config: Dict[str, Any]) -> int:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return int(config.get("partial_rotary_factor", 1.0) * hidden) // heads

    def add_gguf_metadata(self, writer, config: Dict[str, Any], n_layers: int) -> None:
        super().add_gguf_metadata(writer, config, n_layers)
        original = config.get("original_max_position_embeddings") or config["max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(int(original))
        writer.add_sliding_window(int(config.get("sliding_window") or 0))


FAMILY = Phi3()
