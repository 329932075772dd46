"""gpt-oss: attention with biases and a learned sink logit per head, sliding-window attention on every other layer
(the first sliding), YaRN rope, and routed experts with biases whose gate is a clamped SwiGLU variant
(``(clamp(up) + 1) · g · sigmoid(1.702 g)``, ``g = clamp(gate, max=7)``) over the softmax of the top-k router
logits.

llama.cpp's ``gpt-oss`` hard-codes part of this (the every-other-layer window, the gate's 1.702 and 7.0, the
top-k softmax), so a config that says otherwise is refused instead of written as a file that computes another
function. The checkpoint stores the experts fused (``experts.gate_up_proj [E, H, 2I]``, gate and up columns
interleaved): qtool quantizes them per expert (``qtool.model.expert_view``), and its converter's split into
``ffn_gate_exps`` / ``ffn_up_exps`` is the stacking of those per-expert tensors. The sinks are written as
``attn_sinks.weight``, as the converter names them. SmoothQuant's norms feed the router too: none by default.
"""

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import CheckpointError
from .base import Family, check_yarn, finite, yarn as _yarn

_ALPHA, _LIMIT = 1.702, 7.0  # llama.cpp: ggml_swiglu_oai(..., 1.702f, 7.0f)


class GptOss(Family):
    model_types = ("gpt_oss",)
    title = "gpt-oss"
    transformers_reads_split_experts = False
    rms_norms = ("GptOssRMSNorm",)
    smooth_mappings = ()
    no_smoothing = ("gpt-oss's norms feed its routers too (a scaled norm reroutes tokens); give smoothquant.mappings "
                    "between Linear layers")
    gguf_arch = "gpt-oss"
    gguf_needs_output = True  # (its loader has no token_embd fallback for a tied output layer)
    context_length = 131072
    default_head_dim = 64  # (GptOssConfig's)

    def check_gguf(self, config: Dict[str, Any], where: Path) -> Dict[str, Any]:
        config = super().check_gguf(config, where)
        for key, want in (("swiglu_alpha", _ALPHA), ("swiglu_limit", _LIMIT)):
            value = finite(config, key, where, want)
            if not math.isclose(value, want, rel_tol=1e-6):
                raise CheckpointError(f"{where}: {key} is {value:g}, and llama.cpp's gpt-oss computes its experts' "
                                      f"gate with {want:g}")
        if config.get("attention_bias") is False:
            raise CheckpointError(f"{where}: attention_bias is false, and llama.cpp's gpt-oss reads the attention "
                                  "projections' biases")
        n = int(config["num_hidden_layers"])
        types = config.get("layer_types")
        want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        if types is not None and list(types) != want:
            raise CheckpointError(f"{where}: layer_types differ from llama.cpp's gpt-oss (sliding attention in every "
                                  f"other layer, the first sliding): {str(types)[:80]}")
        config["sliding_window"] = int(config.get("sliding_window") or 0)
        if config["sliding_window"] <= 0:
            raise CheckpointError(f"{where}: sliding_window must be a positive integer for llama.cpp's gpt-oss")
        check_yarn(config, where)
        return config

    def rope(self, config: Dict[str, Any]) -> Tuple[float, Optional[float]]:
        params = config.get("rope_parameters") or {}
        theta = config.get("rope_theta") or params.get("rope_theta") or 150000.0
        if _yarn(config) is None and params.get("rope_type", "default") not in (None, "default"):
            raise CheckpointError(f"rope scaling {params.get('rope_type')!r} is not supported by qtool's GGUF export "
                                  "of gpt-oss (none or yarn)")
        return theta, None  # YaRN's parameters are written by add_gguf_metadata

    def add_gguf_metadata(self, writer, config: Dict[str, Any], n_layers: int) -> None:
        import gguf

        super().add_gguf_metadata(writer, config, n_layers)
        writer.add_sliding_window(int(config["sliding_window"]))
        writer.add_expert_feed_forward_length(int(config["intermediate_size"]))
        yarn = _yarn(config)
        if yarn is not None:  # as llama.cpp's converter writes YaRN
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(yarn["factor"]))
            writer.add_rope_scaling_orig_ctx_len(int(yarn["original_max_position_embeddings"]))
            for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                             ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                             ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                             ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
                if yarn.get(key) is not None:
                    add(float(yarn[key]))

    def gguf_warnings(self, config: Dict[str, Any]) -> List[str]:
        yarn = _yarn(config)
        if yarn is None or yarn.get("truncate", True):
            return []
        return ["YaRN with truncate: false (gpt-oss's own config): llama.cpp rounds the correction range to whole "
                "dimensions as truncate: true does, so it runs this file (as the file of its own converter) with "
                "rotary frequencies slightly off transformers' (vLLM and SGLang follow the config)"]

    def gguf_key(self, key: str) -> str:
        return key + ".weight" if key.endswith("self_attn.sinks") else key


FAMILY = GptOss()
