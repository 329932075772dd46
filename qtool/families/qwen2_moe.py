"""Qwen2-MoE: Qwen2 attention, routed experts beside a gated shared expert (GGUF ``ffn_*_shexp``); llama.cpp's
``qwen2moe`` never normalizes the routed weights."""

from typing import Any, Dict, Tuple

from .base import Family
from .qwen2 import qwen_window


class Qwen2Moe(Family):
    model_types = ("qwen2_moe",)
    title = "Qwen2-MoE"
    rms_norms = ("Qwen2MoeRMSNorm",)
    gguf_arch = "qwen2moe"
    gguf_needs_output = True  # (its loader has no token_embd fallback for a tied output layer)
    normalizes_top_k = False

    def attention_window(self, config: Dict[str, Any]) -> Tuple[int, int]:
        # (transformers' Qwen2-MoE windows every other layer below max_window_layers)
        return qwen_window(config, lambda i: (i + 1) % 2 and i < config.get("max_window_layers", 28))


FAMILY = Qwen2Moe()
