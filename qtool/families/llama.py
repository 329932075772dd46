"""Llama (and SmolLM, TinyLlama and the other checkpoints saved as ``llama``): the reference decoder block, as
llama.cpp's converter writes it (q/k rows permuted into its rotary layout)."""

from .base import Family


class Llama(Family):
    model_types = ("llama",)
    title = "Llama"
    rms_norms = ("LlamaRMSNorm",)
    gguf_arch = "llama"
    permute_qk = True


FAMILY = Llama()
