"""GraniteMoE (IBM Granite 3.x MoE: 1B-A400M, 3B-A800M): :mod:`.granite`'s block with its four multipliers, and
routed experts the checkpoint stores fused (``block_sparse_moe.input_linear.weight [E, 2I, H]``, gate rows first,
and ``output_linear.weight [E, H, I]``). qtool quantizes them per expert (``qtool.model.expert_view``); llama.cpp's
``granitemoe`` holds them as ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, which its converter makes by
splitting ``input_linear`` in two, as qtool's per-expert gate and up are. The router (``router.layer``) is
``ffn_gate_inp``, float. vLLM's loader splits ``input_linear`` into Mixtral's per-expert ``w1`` (gate) and ``w3``
(up), ``output_linear`` into ``w2``, and reads a per-expert file under those names only: a compressed-tensors
file names its experts so."""

import re

from .granite import Granite

_VLLM_EXPERT = re.compile(r"(\.block_sparse_moe\.experts\.\d+\.)(gate|up|down)_proj(?=\.|$)")
_VLLM_LEAF = {"gate": "w1", "up": "w3", "down": "w2"}


class GraniteMoe(Granite):
    model_types = ("granitemoe",)
    title = "GraniteMoE"
    rms_norms = ("GraniteMoeRMSNorm",)
    gguf_arch = "granitemoe"
    transformers_reads_split_experts = False

    def compressed_tensors_name(self, name: str) -> str:
        return _VLLM_EXPERT.sub(lambda m: m.group(1) + _VLLM_LEAF[m.group(2)], name)

    def gguf_key(self, key: str) -> str:
        # qtool's per-expert names, stacked, as gguf-py's table knows expert tensors
        return key.replace(".block_sparse_moe.experts.", ".mlp.experts.")


FAMILY = GraniteMoe()
