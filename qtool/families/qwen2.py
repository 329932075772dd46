"""Qwen2 (and Qwen2.5): a Llama block with q/k/v biases; llama.cpp's ``qwen2`` keeps q/k unpermuted."""

from typing import Any, Dict, Tuple

from .base import Family, windowed


def qwen_window(config: Dict[str, Any], sliding=None) -> Tuple[int, int]:
    """The Qwen families' window (:func:`windowed`): transformers' Qwen configs apply ``sliding_window`` (4096 where
    config.json names none) only with ``use_sliding_window``, on the layers ``sliding`` says (None: every one)."""
    if not config.get("use_sliding_window"):
        return 0, 0  # (transformers ignores sliding_window then)
    return windowed(config, config.get("sliding_window", 4096), sliding)


class Qwen2(Family):
    model_types = ("qwen2",)
    title = "Qwen2"
    rms_norms = ("Qwen2RMSNorm",)
    gguf_arch = "qwen2"

    def attention_window(self, config: Dict[str, Any]) -> Tuple[int, int]:
        return qwen_window(config, lambda i: i >= config.get("max_window_layers", 28))


FAMILY = Qwen2()
