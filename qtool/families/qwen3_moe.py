"""Qwen3-MoE: Qwen3 attention with routed experts; llama.cpp's ``qwen3moe`` always normalizes the routed weights."""

from typing import Any, Dict, Tuple

from .base import Family
from .qwen2 import qwen_window


class Qwen3Moe(Family):
    model_types = ("qwen3_moe",)
    title = "Qwen3-MoE"
    rms_norms = ("Qwen3MoeRMSNorm",)
    gguf_arch = "qwen3moe"
    normalizes_top_k = True
    gguf_absent = {"attention_bias": "attention biases"}

    def attention_window(self, config: Dict[str, Any]) -> Tuple[int, int]:
        return qwen_window(config)  # (every layer: its attention reads no layer_types)


FAMILY = Qwen3Moe()
