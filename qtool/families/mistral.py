"""Mistral: a Llama block (llama.cpp writes it as ``llama``). Its sliding window (transformers' default 4096 where
config.json names none: Mistral-7B-v0.1's) covers every layer, and llama.cpp's llama attends to the whole
context: a warning says so."""

from typing import Any, Dict, Tuple

from .base import Family, windowed


class Mistral(Family):
    model_types = ("mistral",)
    title = "Mistral"
    rms_norms = ("MistralRMSNorm",)
    gguf_arch = "llama"
    permute_qk = True

    def attention_window(self, config: Dict[str, Any]) -> Tuple[int, int]:
        return windowed(config, config.get("sliding_window", 4096))


FAMILY = Mistral()
