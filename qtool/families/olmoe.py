"""OLMoE: Llama-style attention with q/k RMSNorms over the whole projection (not per head), routed experts whose
weights are not normalized (llama.cpp's ``olmoe`` never normalizes them: ``norm_topk_prob`` must be false). llama.cpp
sizes the key norm by the hidden width, so its GGUF needs as many key/value heads as query heads (as OLMoE has)."""

from pathlib import Path
from typing import Any, Dict

from ..errors import CheckpointError
from .base import Family


class Olmoe(Family):
    model_types = ("olmoe",)
    title = "OLMoE"
    rms_norms = ("OlmoeRMSNorm",)
    gguf_arch = "olmoe"
    gguf_needs_output = True  # (its loader has no token_embd fallback for a tied output layer)
    normalizes_top_k = False
    gguf_absent = {"attention_bias": "attention biases", "clip_qkv": "clipping of q/k/v (its graph does not clamp)"}

    def check_gguf(self, config: Dict[str, Any], where: Path) -> Dict[str, Any]:
        config = super().check_gguf(config, where)
        if int(config["num_key_value_heads"]) != int(config["num_attention_heads"]):
            raise CheckpointError(f"{where}: grouped-query attention (num_key_value_heads "
                                  f"{config['num_key_value_heads']} of {config['num_attention_heads']}): llama.cpp's "
                                  "olmoe normalizes keys over the hidden width")
        return config


FAMILY = Olmoe()
