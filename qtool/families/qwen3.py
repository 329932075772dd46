"""Qwen3: a Llama block with per-head q/k RMSNorms after the projections (rotations leave them alone: they act on
q_proj/k_proj's outputs, which a rotation of the residual stream does not change)."""

from .base import Family


class Qwen3(Family):
    model_types = ("qwen3",)
    title = "Qwen3"
    rms_norms = ("Qwen3RMSNorm",)
    gguf_arch = "qwen3"


FAMILY = Qwen3()
