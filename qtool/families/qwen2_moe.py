"""Qwen2-MoE: Qwen2 attention, routed experts beside a gated shared expert (GGUF ``ffn_*_shexp``); llama.cpp's
``qwen2moe`` never normalizes the routed weights."""

from .base import Family


class Qwen2Moe(Family):
    model_types = ("qwen2_moe",)
    title = "Qwen2-MoE"
    rms_norms = ("Qwen2MoeRMSNorm",)
    gguf_arch = "qwen2moe"
    gguf_needs_output = True  # (its loader has no token_embd fallback for a tied output layer)
    normalizes_top_k = False


FAMILY = Qwen2Moe()
