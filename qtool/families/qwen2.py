"""Qwen2 (and Qwen2.5): a Llama block with q/k/v biases; llama.cpp's ``qwen2`` keeps q/k unpermuted."""

from .base import Family


class Qwen2(Family):
    model_types = ("qwen2",)
    title = "Qwen2"
    rms_norms = ("Qwen2RMSNorm",)
    gguf_arch = "qwen2"


FAMILY = Qwen2()
