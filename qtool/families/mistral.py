"""Mistral: a Llama block (llama.cpp writes it as ``llama``)."""

from .base import Family


class Mistral(Family):
    model_types = ("mistral",)
    title = "Mistral"
    rms_norms = ("MistralRMSNorm",)
    gguf_arch = "llama"
    permute_qk = True


FAMILY = Mistral()
