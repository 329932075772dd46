"""DeepSeek-V3 (and R1, Kimi K2, which share its architecture): multi-head latent attention (queries through a
low-rank ``q_a_proj``/``q_b_proj`` pair, keys and values from one compressed ``kv_a_proj_with_mqa`` latent and
``kv_b_proj``), leading dense layers (``first_k_dense_replace``), then routed experts chosen by sigmoid scores
with a correction bias, beside shared experts.

llama.cpp's ``deepseek2`` runs the attention in its absorbed form: its converter splits ``kv_b_proj`` per head
into ``attn_k_b`` (the keys' rows, transposed) and ``attn_v_b`` (the values' rows). The values' rows keep
``kv_b_proj``'s quantization blocks and are written in its type; the transposed key rows run across those blocks,
so ``attn_k_b`` holds qtool's fake-quant values as F32 (exactly what calibration chose). GGUF's llama-quantize
mixes have no rules for these tensors in qtool: use a ``gguf_type`` recipe (``gguf-q8_0``, ``gguf-q4_0``).
Rotations need separate q/k/v projections and refuse it.
"""

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import CheckpointError
from .base import Family, TensorPart, check_yarn, positive_int, rope, yarn as _yarn


class DeepseekV3(Family):
    model_types = ("deepseek_v3",)
    title = "DeepSeek-V3"
    rms_norms = ("DeepseekV3RMSNorm",)
    smooth_mappings = ()
    no_smoothing = ("DeepSeek-V3's attention reads its norm through low-rank projections qtool has no default "
                    "mappings for; give smoothquant.mappings")
    gguf_arch = "deepseek2"
    gguf_absent = {"attention_bias": "attention biases"}

    def check_gguf(self, config: Dict[str, Any], where: Path) -> Dict[str, Any]:
        config = super().check_gguf(config, where)
        for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            positive_int(config, key, where)
        if config.get("q_lora_rank") is None:
            raise CheckpointError(f"{where}: q_lora_rank is null (DeepSeek-V2-Lite's full-rank queries): llama.cpp "
                                  "reads that only from 27-layer files")
        positive_int(config, "q_lora_rank", where)
        if config.get("n_routed_experts"):
            for key in ("num_experts_per_tok", "moe_intermediate_size"):
                positive_int(config, key, where)
        yarn = check_yarn(config, where)
        try:
            # transformers scales the rotary part by mscale / mscale_all_dim's terms where both are set, else by
            # 0.1 ln(factor) + 1; llama.cpp's deepseek2 cancels its own such term and scales the whole attention by
            # mscale_all_dim's: the same function only where the two are set and equal
            if yarn is not None and yarn.get("attention_factor") is not None:
                raise CheckpointError(f"{where}: YaRN attention_factor is set, and llama.cpp's deepseek2 has none")
            if yarn is not None and float(yarn["factor"]) > 1 and (
                    not yarn.get("mscale") or not yarn.get("mscale_all_dim")
                    or float(yarn["mscale"]) != float(yarn["mscale_all_dim"])):
                raise CheckpointError(f"{where}: YaRN mscale {yarn.get('mscale')} and mscale_all_dim "
                                      f"{yarn.get('mscale_all_dim')}: llama.cpp's deepseek2 computes transformers' "
                                      "attention scale only where both are set and equal (DeepSeek-V3's: 1.0)")
        except (TypeError, ValueError):
            raise CheckpointError(f"{where}: YaRN mscale and mscale_all_dim must be numbers") from None
        if config.get("rope_interleave") is False:
            raise CheckpointError(f"{where}: rope_interleave is false; llama.cpp's deepseek2 rotates consecutive "
                                  "pairs (rope_interleave: true)")
        if config.get("topk_method") not in (None, "noaux_tc") or config.get("scoring_func") not in (None, "sigmoid"):
            raise CheckpointError(f"{where}: expert scoring other than DeepSeek-V3's (sigmoid, noaux_tc) is not "
                                  "exported by qtool's deepseek_v3 family")
        return config

    def rope(self, config: Dict[str, Any]) -> Tuple[float, Optional[float]]:
        yarn = _yarn(config)
        if yarn is None:
            return rope(config)
        theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return theta, None  # its YaRN parameters are written by add_gguf_metadata

    def rope_dimensions(self, config: Dict[str, Any]) -> int:
        return int(config["qk_rope_head_dim"])

    def add_gguf_metadata(self, writer, config: Dict[str, Any], n_layers: int) -> None:
        import gguf

        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        # the absorbed attention is one latent "head" shared by every query head; its widths are written below
        c = {**config, "num_key_value_heads": 1, "head_dim": hidden // heads}
        super().add_gguf_metadata(writer, c, n_layers)
        yarn = _yarn(config)
        if yarn is not None:  # DeepSeek-V3's long context: llama.cpp computes YaRN from these, as transformers does
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(yarn["factor"]))
            writer.add_rope_scaling_orig_ctx_len(int(yarn["original_max_position_embeddings"]))
            # llama.cpp's deepseek2 reads 0.1 * mscale_all_dim here (its converter's convention)
            writer.add_rope_scaling_yarn_log_mul(0.1 * float(yarn.get("mscale_all_dim") or 0.0))
            for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                             ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
                if yarn.get(key) is not None:
                    add(float(yarn[key]))
        rank, rope_dim = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"])
        writer.add_leading_dense_block_count(int(c.get("first_k_dense_replace") or 0))
        writer.add_q_lora_rank(int(c["q_lora_rank"]))
        writer.add_kv_lora_rank(rank)
        writer.add_key_length(rank + rope_dim)
        writer.add_value_length(rank)
        writer.add_key_length_mla(int(c["qk_nope_head_dim"]) + rope_dim)
        writer.add_value_length_mla(int(c["v_head_dim"]))
        writer.add_expert_feed_forward_length(int(c.get("moe_intermediate_size") or c["intermediate_size"]))
        if c.get("n_routed_experts"):
            writer.add_expert_count(int(c["n_routed_experts"]))
            writer.add_expert_used_count(int(c["num_experts_per_tok"]))
        writer.add_expert_shared_count(int(c.get("n_shared_experts") or 0))
        writer.add_expert_weights_scale(float(c.get("routed_scaling_factor") or 1.0))
        if c.get("norm_topk_prob"):
            writer.add_expert_weights_norm(True)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if int(c.get("n_group") or 1) > 1:
            writer.add_expert_group_count(int(c["n_group"]))
            writer.add_expert_group_used_count(int(c["topk_group"]))

    def gguf_key(self, key: str) -> str:
        return key.replace("e_score_correction_bias", "e_score_correction.bias")

    def gguf_parts(self, key: str, config: Dict[str, Any]) -> Optional[List[TensorPart]]:
        if not key.endswith("self_attn.kv_b_proj.weight"):
            return None
        heads, rank = int(config["num_attention_heads"]), int(config["kv_lora_rank"])
        nope, v = int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
        per = nope + v  # kv_b_proj's rows: per head, its keys' rows then its values'
        stem = key[: -len("kv_b_proj.weight")]
        return [TensorPart(stem + "k_b_proj.weight", tuple(h * per + j for h in range(heads) for j in range(nope)),
                           (heads, nope, rank), transpose=True),
                TensorPart(stem + "v_b_proj.weight", tuple(h * per + nope + j for h in range(heads) for j in range(v)),
                           (heads, v, rank))]


FAMILY = DeepseekV3()
