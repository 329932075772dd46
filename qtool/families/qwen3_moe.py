"""Qwen3-MoE: Qwen3 attention with routed experts; llama.cpp's ``qwen3moe`` always normalizes the routed weights."""

from typing import Any, Dict, Tuple

from .base import Family, windowed


class Qwen3Moe(Family):
    model_types = ("qwen3_moe",)
    title = "Qwen3-MoE"
    rms_norms = ("Qwen3MoeRMSNorm",)
    gguf_arch = "qwen3moe"
    normalizes_top_k = True
    gguf_absent = {"attention_bias": "attention biases"}

    def attention_window(self, config: Dict[str, Any]) -> Tuple[int, int]:
        if not config.get("use_sliding_window"):
            return 0, 0
        return windowed({**config, "layer_types": None}, config.get("sliding_window", 4096), lambda i: True)


FAMILY = Qwen3Moe()
