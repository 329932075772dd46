"""GraniteMoE (IBM Granite 3.x MoE: 1B-A400M, 3B-A800M): :mod:`.granite`'s block with its four multipliers, and
routed experts the checkpoint stores fused (``block_sparse_moe.input_linear.weight [E, 2I, H]``, gate rows first,
and ``output_linear.weight [E, H, I]``). qtool quantizes them per expert (``qtool.model.expert_view``); llama.cpp's
``granitemoe`` holds them as ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, which its converter makes by
splitting ``input_linear`` in two, as qtool's per-expert gate and up are. The router (``router.layer``) is
``ffn_gate_inp``, float."""

from .granite import Granite


class GraniteMoe(Granite):
    model_types = ("granitemoe",)
    title = "GraniteMoE"
    rms_norms = ("GraniteMoeRMSNorm",)
    gguf_arch = "granitemoe"
    transformers_reads_split_experts = False

    def gguf_key(self, key: str) -> str:
        # qtool's per-expert names, stacked, as gguf-py's table knows expert tensors
        return key.replace(".block_sparse_moe.experts.", ".mlp.experts.")


FAMILY = GraniteMoe()
