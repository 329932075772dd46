"""Mixtral: Mistral's attention with a mixture-of-experts MLP (checkpoint: ``block_sparse_moe.experts.<e>.w1/w3/w2``
and the router ``block_sparse_moe.gate``). llama.cpp writes it as ``llama`` with stacked expert tensors and
always normalizes the routed weights, as Mixtral does."""

from typing import Any, Dict, Tuple

from .base import LLAMA_SMOOTH_MAPPINGS, Family, windowed


class Mixtral(Family):
    model_types = ("mixtral",)
    title = "Mixtral"
    rms_norms = ("MixtralRMSNorm",)
    gguf_arch = "llama"
    permute_qk = True
    # its experts' gate/up/down are w1/w3/w2: the Llama mappings with those names (AWQ searched the attention
    # groups only and left every expert out without a word)
    smooth_mappings = (LLAMA_SMOOTH_MAPPINGS[0],
                       {"smooth": "re:.*post_attention_layernorm", "balance": ["re:.*w1", "re:.*w3"]},
                       {"smooth": "re:.*w3", "balance": ["re:.*w2"]})

    def attention_window(self, config: Dict[str, Any]) -> Tuple[int, int]:
        # (a sliding_window, every layer, as Mistral's; llama.cpp's llama attends to the whole context)
        return windowed(config, config.get("sliding_window"))


FAMILY = Mixtral()
