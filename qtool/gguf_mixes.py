"""llama-quantize's mixes (Q4_K_M, Q3_K_M, …): which GGUF type each tensor of a Llama-family model gets.

``llama_tensor_get_type`` in llama.cpp's ``src/llama-quant.cpp``, for dense models of the architectures qtool
writes (Llama, Qwen2, Qwen3, Mistral, Gemma 3, Phi-3 with its fused ``attn_qkv``; the experts of Qwen2/3-MoE and
Mixtral take their projection's rules, and
models of exactly 8 experts get llama-quantize's extra attention bits: ``attn_v``/``attn_k`` Q8_0, ``attn_output``
Q5_K in the low mixes; not Falcon, not 70B), restated as data: a mix has a default type, and the output matrix, ``attn_v``, ``attn_output`` and ``ffn_down``
get more bits by the rules below. The row-width
fallback for K-quants (Q4_K → Q5_0, …) is applied afterwards by the plan (``config._super_block_fallback``),
as llama-quantize applies it last. No torch here: the recipe checks run before torch loads.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

__all__ = ["MIXES", "tensor_role", "mix_type", "mix_types"]

# mix -> the type every tensor starts from
MIXES: Dict[str, str] = {
    "q2_k": "q2_k", "q3_k_s": "q3_k", "q3_k_m": "q3_k", "q3_k_l": "q3_k", "q4_k_s": "q4_k", "q4_k_m": "q4_k",
    "q5_k_s": "q5_k", "q5_k_m": "q5_k", "q6_k": "q6_k", "iq4_xs": "iq4_xs", "iq4_nl": "iq4_nl", "q4_0": "q4_0",
    "q5_0": "q5_0", "q8_0": "q8_0",
}
_BLOCK = {"q4_0": 32, "q5_0": 32, "q8_0": 32, "iq4_nl": 32}  # others: 256-element super-blocks

# a mixture-of-experts layer's experts (mlp.experts.<e>.down_proj, Mixtral's w1/w3/w2) and its shared experts
# (Qwen2-MoE's mlp.shared_expert, DeepSeek's mlp.shared_experts) take their projection's rules, as llama-quantize's
# name matching gives ffn_down_exps and ffn_down_shexp ffn_down's
# (Phi-3's fused qkv_proj and gate_up_proj are llama.cpp's attn_qkv and ffn_up)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp(?:\.experts\.\d+|\.shared_experts?)?)\."
                    r"(q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_proj|up_proj|gate_up_proj|down_proj|w1|w3|w2)$")
_ROLES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
          "qkv_proj": "attn_qkv", "gate_proj": "ffn_gate", "up_proj": "ffn_up", "gate_up_proj": "ffn_up",
          "down_proj": "ffn_down", "w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}


def tensor_role(module: str) -> Tuple[Optional[str], int]:
    """``(role, layer)`` of a Hugging Face Llama-family module name: ``attn_v`` and 3 for
    ``model.layers.3.self_attn.v_proj``; ``token_embd`` / ``output`` (layer -1) for the embedding table and the
    output layer; ``(None, -1)`` for anything else."""
    m = _LAYER.search(module)
    if m:
        return _ROLES[m.group(2)], int(m.group(1))
    if module.endswith("embed_tokens"):
        return "token_embd", -1
    if module == "lm_head" or module.endswith(".lm_head"):
        return "output", -1
    return None, -1


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighths of the layers, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# llama-quantize's mixes that give an 8-expert model's attn_output Q5_K
_EIGHT_EXPERT_OUTPUT = ("q2_k", "q3_k_s", "q3_k_m", "iq4_nl", "q4_k_s", "q4_k_m", "iq4_xs")


def mix_type(mix: str, role: Optional[str], layer: int, n_layers: int, n_gqa: int, width: int,
             has_imatrix: bool, n_expert: int = 0) -> str:
    """The GGUF type (``gguf_type`` name) of one tensor in ``mix``, before the row-width fallback.

    ``role``: from :func:`tensor_role` (a tied embedding table is ``output``); ``width``: its row length;
    ``has_imatrix``: the codes are chosen from calibration data (llama-quantize's ``--imatrix``); ``n_expert``:
    the model's experts per MoE layer (0 for a dense model)."""
    base = MIXES[mix]
    if role == "attn_qkv":  # (Phi-3's q, k and v in one matrix: llama-quant.cpp's category_is_attn_v takes it,
        role = "attn_v"  # before its own attn_qkv rule, since the tensor categories of 2025; older releases
        # matched "attn_v.weight" by name and gave attn_qkv that rule, Q5_K under Q4_K_M)
    if n_expert == 8 and role in ("attn_v", "attn_k"):  # "trades just ~128MB" (llama-quant.cpp)
        return "q8_0"
    if n_expert == 8 and role == "attn_output":
        return "q5_k" if mix in _EIGHT_EXPERT_OUTPUT else base
    if role == "output":  # the output matrix, or the embedding table that serves as it
        if width % _BLOCK.get(base, 256):
            return "q8_0"
        return "q8_0" if base == "q8_0" else "q6_k"
    if role == "attn_v":
        if mix == "q2_k":
            return "q4_k" if n_gqa >= 4 else "q3_k"
        if mix == "q3_k_m":
            return "q5_k" if layer < 2 else "q4_k"
        if mix == "q3_k_l":
            return "q5_k"
        if mix in ("iq4_nl", "iq4_xs") and n_gqa >= 4:
            return "q5_k"
        if mix in ("q4_k_m", "q5_k_m") and _more_bits(layer, n_layers):
            return "q6_k"
        if mix == "q4_k_s" and layer < 4:
            return "q5_k"
        return base
    if role == "attn_output":
        return {"q2_k": "q3_k", "q3_k_m": "q4_k", "q3_k_l": "q5_k"}.get(mix, base)
    if role == "ffn_down":
        if mix == "q2_k":
            return "q3_k"
        if mix == "q3_k_m":
            return "q5_k" if layer < n_layers // 16 else "q4_k"
        if mix == "q3_k_l":
            return "q5_k"
        if mix == "q4_k_m":
            return "q6_k" if _more_bits(layer, n_layers) else base
        if mix in ("iq4_nl", "iq4_xs") and layer < n_layers // 8 and not has_imatrix:
            return "q5_k"
        if mix == "q5_k_m" and _more_bits(layer, n_layers):
            return "q6_k"
        if mix == "q4_k_s" and layer < n_layers // 8:
            return "q5_k"
        if mix in ("q4_0", "q5_0") and has_imatrix and layer < n_layers // 8:
            return {"q4_0": "q4_1", "q5_0": "q5_1"}[mix]
        return base
    return base


def mix_types(mix: str, has_imatrix: bool = False) -> Tuple[str, ...]:
    """The GGUF types ``mix`` gives a Llama-family model whose rows are whole super-blocks (any layer count and
    grouped-query ratio), the mix's own type first, then by bits per weight (before the row-width fallback)."""
    roles = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd", "output")
    found = {mix_type(mix, role, layer, n, n_gqa, 4096, has_imatrix)
             for role in roles for n in (2, 16, 32, 80) for layer in range(n) for n_gqa in (1, 4, 8)}
    rank = ("q2_k", "q3_k", "iq4_xs", "iq4_nl", "q4_0", "q4_1", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k", "q8_0")
    return (MIXES[mix],) + tuple(sorted(found - {MIXES[mix]}, key=rank.index))
