"""Qwen3: a Llama block with per-head q/k RMSNorms after the projections (rotations leave them alone: they act on
q_proj/k_proj's outputs, which a rotation of the residual stream does not change)."""

from typing import Any, Dict, Tuple

from .base import Family, windowed


class Qwen3(Family):
    model_types = ("qwen3",)
    title = "Qwen3"
    rms_norms = ("Qwen3RMSNorm",)
    gguf_arch = "qwen3"
    gguf_absent = {"attention_bias": "attention biases"}


    def attention_window(self, config: Dict[str, Any]) -> Tuple[int, int]:
        if not config.get("use_sliding_window"):
            return 0, 0  # (transformers ignores sliding_window then)
        return windowed(config, config.get("sliding_window", 4096), lambda i: i >= config.get("max_window_layers", 28))


FAMILY = Qwen3()
