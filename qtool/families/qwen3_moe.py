"""Qwen3-MoE: Qwen3 attention with routed experts; llama.cpp's ``qwen3moe`` always normalizes the routed weights."""

from .base import Family


class Qwen3Moe(Family):
    model_types = ("qwen3_moe",)
    title = "Qwen3-MoE"
    rms_norms = ("Qwen3MoeRMSNorm",)
    gguf_arch = "qwen3moe"
    normalizes_top_k = True


FAMILY = Qwen3Moe()
