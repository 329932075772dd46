"""Granite (IBM Granite 3.x dense): a Llama block with four scalar multipliers — the embeddings'
(``embedding_multiplier``), each residual branch's (``residual_multiplier``), the attention scale
(``attention_multiplier``, in place of ``1/sqrt(head_dim)``) and the logits' divisor (``logits_scaling``) — which
llama.cpp's ``granite`` reads from the metadata; its converter permutes q/k rows as for Llama."""

from typing import Any, Dict

from .base import Family


class Granite(Family):
    model_types = ("granite",)
    title = "Granite"
    rms_norms = ("GraniteRMSNorm",)
    gguf_arch = "granite"
    permute_qk = True

    def add_gguf_metadata(self, writer, config: Dict[str, Any], n_layers: int) -> None:
        super().add_gguf_metadata(writer, config, n_layers)
        for key, add in (("attention_multiplier", writer.add_attention_scale),
                         ("embedding_multiplier", writer.add_embedding_scale),
                         ("residual_multiplier", writer.add_residual_scale),
                         ("logits_scaling", writer.add_logit_scale)):
            if config.get(key) is not None:
                add(float(config[key]))


FAMILY = Granite()
