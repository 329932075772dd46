"""Qwen3: a Llama block with per-head q/k RMSNorms after the projections (rotations leave them alone: they act on
q_proj/k_proj's outputs, which a rotation of the residual stream does not change); its sliding window as Qwen2's."""

from .qwen2 import Qwen2


class Qwen3(Qwen2):
    model_types = ("qwen3",)
    title = "Qwen3"
    rms_norms = ("Qwen3RMSNorm",)
    gguf_arch = "qwen3"
    gguf_absent = {"attention_bias": "attention biases"}
    default_head_dim = 128  # (Qwen3Config's: a config.json without head_dim builds 128-wide heads)


FAMILY = Qwen3()
