"""GGUF beyond the Llama family: Qwen3 (q/k norms, its own architecture) and the mixture-of-experts families
Qwen3-MoE and Mixtral, whose per-expert tensors llama.cpp holds stacked (``ffn_{gate,up,down}_exps``, one
``[out, in]`` slice per expert) beside the router (``ffn_gate_inp``). The files hold qtool's fake-quant weights
bit for bit and llama.cpp (xllamacpp) runs them."""

import json
import struct
from pathlib import Path
from statistics import median

import numpy as np
import pytest
import torch

from qtool.families import family_of
from tests.helpers import error_lines, run_cli
from tests.test_gguf import VOCAB, _fake_quant_weights, _gguf_values, _tiny_llama

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

# family -> (GGUF architecture, expert leaf names for gate/up/down or None for a dense MLP)
FAMILIES = {"qwen3": ("qwen3", None), "qwen3_moe": ("qwen3moe", ("gate_proj", "up_proj", "down_proj")),
            "mixtral": ("llama", ("w1", "w3", "w2")), "qwen2_moe": ("qwen2moe", ("gate_proj", "up_proj", "down_proj")),
            "gemma3_text": ("gemma3", None), "phi3": ("phi3", None),
            "olmoe": ("olmoe", ("gate_proj", "up_proj", "down_proj")),
            "deepseek_v3": ("deepseek2", ("gate_proj", "up_proj", "down_proj")), "granite": ("granite", None),
            "smollm3": ("smollm3", None), "gpt_oss": ("gpt-oss", ("gate_proj", "up_proj", "down_proj")),
            "granitemoe": ("granitemoe", ("gate_proj", "up_proj", "down_proj"))}


def _tiny(dest: Path, family: str, **overrides) -> Path:
    """A seeded tiny ``family`` causal LM (8 experts, 2 routed, for the MoE ones) with test_gguf's byte-level BPE
    tokenizer; large enough initial weights for confident next tokens."""
    _tiny_llama(dest, False)  # the tokenizer (its Llama weights are replaced)
    for f in dest.glob("model*.safetensors"):
        f.unlink()
    kw = dict(vocab_size=VOCAB + 20, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
    extra = {"qwen3": dict(intermediate_size=128, head_dim=16),
             "qwen3_moe": dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                               head_dim=16, norm_topk_prob=True),
             "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
             # a shared expert beside the routed ones (ffn_*_shexp), routed weights not normalized
             "qwen2_moe": dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                               shared_expert_intermediate_size=64),
             # six layers: five with sliding-window attention (a window shorter than the longer prompts) and rotary
             # base 10000, the sixth global with its own base; norms computing x / rms(x) * (1 + w)
             "gemma3_text": dict(intermediate_size=128, head_dim=16, query_pre_attn_scalar=16, num_hidden_layers=6,
                                 sliding_window=12),
             # q/k norms over the whole projection, routed weights not normalized
             "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_key_value_heads=4),
             # latent attention (kv_b_proj split into attn_k_b and attn_v_b), a leading dense layer, sigmoid routing
             # with a correction bias, a shared expert
             "deepseek_v3": dict(intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                                 kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                                 topk_group=1, num_key_value_heads=4),
             # scalar multipliers on the embeddings, the residual branches, the attention scores and the logits
             "granite": dict(intermediate_size=128, embedding_multiplier=4.0, residual_multiplier=0.5,
                             attention_multiplier=0.2, logits_scaling=2.0),
             # no rotary embedding in every fourth layer
             "smollm3": dict(intermediate_size=128, num_hidden_layers=4, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2),
             # fused qkv_proj and gate_up_proj; rotary embedding on half of each head
             "phi3": dict(intermediate_size=128, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2),
             # Granite's multipliers, experts stored fused (input_linear: gate rows, then up rows)
             "granitemoe": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                logits_scaling=2.0),
             # experts stored fused with interleaved gate/up columns and biases, attention biases and sinks,
             # sliding-window attention in every other layer (a window shorter than the longer prompts), YaRN (with
             # the correction range truncated as llama.cpp computes it: gpt-oss's own truncate: false is a warning)
             "gpt_oss": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                             sliding_window=12, rope_parameters={
                                 "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": True})}[family]
    cfg = transformers.AutoConfig.for_model(family, **{**kw, **extra, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def exported(request, tmp_path_factory):
    family = request.param
    d = tmp_path_factory.mktemp(family)
    ckpt = _tiny(d / "m", family)
    code, out, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "-o", d / "q", "--format", "gguf", "--json")
    assert code == 0, err
    return family, ckpt, d / "q", json.loads(out)


def test_the_file_holds_every_weight_as_qtools_fake_quant_model_and_the_experts_stacked(exported):
    import qtool

    family, ckpt, out, summary = exported
    arch, leaves = FAMILIES[family]
    reader = gguf.GGUFReader(out / "model.gguf")
    assert reader.fields["general.architecture"].contents() == arch
    values = _gguf_values(out / "model.gguf")
    fq = _fake_quant_weights(qtool.load_calibrated(str(ckpt), str(out / "calibration/encodings.json")))
    names = summary["names"]
    assert set(names) == {q["name"] for q in json.loads((out / "calibration/encodings.json").read_text())["quantizers"]}
    # every weight has its GGUF type: DeepSeek's attn_k_b, F32 by design, was reported as a fallback
    assert summary["gguf"]["fallback"] == [] and not any("no GGUF type" in w for w in summary["warnings"])
    if leaves is None:
        assert values["blk.1.ffn_down.weight"][0] == "Q8_0"
        from safetensors.torch import load_file

        stored = load_file(ckpt / "model.safetensors")["model.layers.1.input_layernorm.weight"]
        kind, norm = values["blk.1.attn_norm.weight"]
        # Gemma's norms multiply by (1 + w), llama.cpp's by w: the converter's +1 (the family's norm_shift), in
        # float32 (read from the family, so a new family file with a shift passes as it is)
        shift = family_of(family).norm_shift
        assert shift == (family == "gemma3_text")
        assert kind == "F32" and np.array_equal(norm, (stored.float() + shift).numpy())
        if family == "phi3":  # fused projections, as llama.cpp's phi3 reads them
            assert values["blk.1.attn_qkv.weight"][0] == values["blk.1.ffn_up.weight"][0] == "Q8_0"
            assert values["blk.1.ffn_up.weight"][1].shape[0] == 2 * 128
            assert reader.fields["phi3.rope.dimension_count"].contents() == 8  # half of each 16-wide head
        if family == "gemma3_text":
            assert reader.fields["gemma3.attention.sliding_window"].contents() == 12
        return
    assert reader.fields[f"{arch}.expert_count"].contents() == 8
    assert reader.fields[f"{arch}.expert_used_count"].contents() == 2
    assert values["blk.1.ffn_gate_inp.weight"][0] == "F32"  # the router stays float
    if family == "qwen2_moe":
        assert reader.fields[f"{arch}.expert_shared_feed_forward_length"].contents() == 64
        assert values["blk.1.ffn_down_shexp.weight"][0] == "Q8_0"
        assert values["blk.1.ffn_gate_inp_shexp.weight"][0] == "F32"  # the shared expert's gate: a router too
    stored = "block_sparse_moe" if family in ("mixtral", "granitemoe") else "mlp"
    held = "block_sparse_moe" if family == "granitemoe" else "mlp"  # the module's name in memory
    if family == "deepseek_v3":
        _check_latent_attention(reader, values, fq)
    if family == "gpt_oss":
        _check_gpt_oss(reader, values, ckpt)
    for layer in range(1, 2) if family == "deepseek_v3" else range(2):  # (DeepSeek's layer 0 is dense)
        for gguf_name, leaf in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), leaves):
            kind, stacked = values[f"blk.{layer}.{gguf_name}.weight"]
            assert kind == "Q8_0" and stacked.shape[0] == 8
            for e in range(8):
                w = fq[f"model.layers.{layer}.{held}.experts.{e}.{leaf}.weight"]
                assert names[f"model.layers.{layer}.{stored}.experts.{e}.{leaf}.weight"] == \
                    f"blk.{layer}.{gguf_name}.weight"
                assert np.array_equal(stacked[e].reshape(w.shape), w.numpy()), (layer, gguf_name, e)


def _check_gpt_oss(reader, values, ckpt):
    """The float parts llama.cpp's gpt-oss reads as its converter writes them: each head's sink, the router's and
    the experts' biases (the interleaved gate/up bias split), the window and YaRN."""
    from safetensors.torch import load_file

    stored = load_file(ckpt / "model.safetensors")
    assert reader.fields["gpt-oss.attention.sliding_window"].contents() == 12
    assert reader.fields["gpt-oss.rope.scaling.type"].contents() == "yarn"
    assert reader.fields["gpt-oss.expert_feed_forward_length"].contents() == 32
    kind, sinks = values["blk.1.attn_sinks.weight"]
    assert kind == "F32" and np.array_equal(sinks, stored["model.layers.1.self_attn.sinks"].numpy())
    assert np.array_equal(values["blk.1.ffn_gate_inp.bias"][1], stored["model.layers.1.mlp.router.bias"].numpy())
    bias = stored["model.layers.1.mlp.experts.gate_up_proj_bias"]
    for gguf_name, part in (("ffn_gate_exps", bias[:, 0::2]), ("ffn_up_exps", bias[:, 1::2])):
        kind, stacked = values[f"blk.1.{gguf_name}.bias"]
        assert kind == "F32" and np.array_equal(stacked.reshape(part.shape), part.numpy())
    assert values["blk.1.attn_q.bias"][0] == values["blk.1.attn_output.bias"][0] == "F32"


def _check_latent_attention(reader, values, fq):
    """DeepSeek's kv_b_proj as llama.cpp's converter splits it per head: attn_v_b the values' rows in Q8_0,
    attn_k_b the keys' rows transposed, as F32 fake-quant values."""
    assert reader.fields["deepseek2.leading_dense_block_count"].contents() == 1
    assert reader.fields["deepseek2.expert_gating_func"].contents() == 2  # sigmoid
    assert values["blk.1.exp_probs_b.bias"][0] == "F32"
    kv_b = fq["model.layers.1.self_attn.kv_b_proj.weight"].reshape(4, 8 + 16, 32)
    kind, v_b = values["blk.1.attn_v_b.weight"]
    assert kind == "Q8_0" and np.array_equal(v_b.reshape(4, 16, 32), kv_b[:, 8:].numpy())
    kind, k_b = values["blk.1.attn_k_b.weight"]
    assert kind == "F32" and np.array_equal(k_b.reshape(4, 32, 8), kv_b[:, :8].transpose(1, 2).numpy())
    assert "blk.1.attn_kv_b.weight" not in values


def test_llama_cpp_runs_the_file_and_its_next_tokens_are_the_float_models(exported):
    """Greedy next tokens of llama.cpp on the Q8_0 file against transformers' float model on 40 random prompts, and
    log-probabilities against qtool's fake-quant model. llama.cpp multiplies with 8-bit activations, so a router
    whose top experts are nearly tied can route a token otherwise (one Mixtral prompt moves 0.7): the median
    shows the arithmetic, the agreement that routing holds."""
    pytest.importorskip("xllamacpp")
    family, ckpt, out, _ = exported
    agree, diffs = _agreement(ckpt, out)
    assert agree >= 34, (family, agree)
    assert median(diffs) < 0.03, (family, sorted(diffs))


def _agreement(ckpt, out, longest: int = 40):
    """(prompts of 40 where llama.cpp's greedy next token is transformers' float model's, per prompt the largest
    log-probability difference of llama.cpp's top 3 tokens from qtool's fake-quant model)."""
    import qtool

    from tests.llamacpp import LlamaCpp

    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    fq = qtool.load_calibrated(str(ckpt), str(out / "calibration/encodings.json")).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (int(k),), generator=g).tolist()
               for k in torch.randint(4, longest, (40,), generator=g)]
    agree, diffs = 0, []
    with LlamaCpp(str(out / "model.gguf")) as llama:
        for p in prompts:
            with torch.no_grad():
                top = int(ref(torch.tensor([p])).logits[0, -1].argmax())
                logp = torch.log_softmax(fq(torch.tensor([p])).logits[0, -1].double(), -1)
            agree += top == llama.greedy_next(p)
            diffs.append(max(abs(float(logp[t]) - lp) for t, lp in llama.top(p, 3)))
    return agree, diffs


def test_deepseeks_yarn_long_context_runs_in_llama_cpp_as_in_transformers(tmp_path):
    """DeepSeek-V3's YaRN rope scaling (factor 4 beyond 64 positions here; its attention scaled by mscale²) is
    computed by llama.cpp from the metadata as transformers computes it, on prompts longer than the original
    context too."""
    pytest.importorskip("xllamacpp")
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    ckpt = _tiny(tmp_path / "m", "deepseek_v3", rope_parameters=yarn, max_position_embeddings=128)
    code, _, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "-o", tmp_path / "q", "--format", "gguf", "--quiet")
    assert code == 0, err
    reader = gguf.GGUFReader(tmp_path / "q" / "model.gguf")
    assert reader.fields["deepseek2.rope.scaling.type"].contents() == "yarn"
    agree, diffs = _agreement(ckpt, tmp_path / "q", longest=80)
    assert agree >= 34, agree
    assert median(diffs) < 0.03, sorted(diffs)


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_eval_scores_a_sliding_window_model_in_llama_cpp_as_qtools_fake_quant_model(tmp_path, family):
    """Window after window on one llama.cpp server: its prefix reuse over a window-sized cache scored every window
    after the first wrongly (a false export fault, KL 0.07 at Q8_0)."""
    pytest.importorskip("xllamacpp")
    from safetensors.torch import save_file

    ckpt = _tiny(tmp_path / "m", family)
    code, _, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "-o", tmp_path / "q", "--format", "gguf", "--quiet")
    assert code == 0, err
    held = tmp_path / "held.safetensors"
    save_file({"input_ids": torch.randint(1, VOCAB, (4, 40), generator=torch.Generator().manual_seed(4))}, held)
    code, out, err = run_cli("eval", tmp_path / "q" / "model.gguf", "--data", held, "--seq-len", 32,
                             "--num-samples", 4, "--generate", 0, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["export_fault"] is None and result["export_gap"]["kl_mean"] < 0.005, result["export_gap"]


@pytest.mark.parametrize("family,normalized", [("qwen3_moe", False), ("qwen2_moe", True)])
def test_a_router_normalized_otherwise_than_llama_cpp_normalizes_is_refused_before_calibration(tmp_path, family,
                                                                                                 normalized):
    ckpt = _tiny(tmp_path / "m", family, norm_topk_prob=normalized)
    code, _, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "-o", tmp_path / "q", "--format", "gguf")
    assert code != 0 and "norm_topk_prob" in err and len(error_lines(err)) == 1
    assert not (tmp_path / "q").exists()


def test_an_importance_matrix_holds_one_row_per_expert_and_each_expert_takes_its_own(exported, tmp_path):
    """llama-imatrix's layout for a stacked expert tensor: ``in_sum2`` [experts, width] and ``counts`` [experts, 1],
    each row the tokens routed to that expert (not one expert's sums under the shared name)."""
    from qtool.calibration.importance import apply_imatrix
    from qtool.config import load_recipe, recipe_file, resolve_plan
    from qtool.model.hf import meta_skeleton

    family, ckpt, _, _ = exported
    if FAMILIES[family][1] is None or family == "deepseek_v3":
        pytest.skip("a dense model" if FAMILIES[family][1] is None else "no llama-quantize mix for deepseek2 in qtool")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the value of a list is returned by the function"] * 200))
    code, _, err = run_cli("imatrix", ckpt, "--data", text, "-o", tmp_path / "im.gguf", "--quiet")
    assert code == 0, err
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(tmp_path / "im.gguf").tensors}
    sums, counts = tensors["blk.1.ffn_down_exps.weight.in_sum2"], tensors["blk.1.ffn_down_exps.weight.counts"]
    assert sums.shape[0] == counts.shape[0] == 8 and counts.shape[1] == 1
    dense_tokens = float(tensors["blk.1.attn_q.weight.counts"][0, 0])
    assert counts.sum() == 2 * dense_tokens  # every token is routed to 2 of the 8 experts
    assert len({tuple(r[:4]) for r in sums}) > 1  # the experts' own sums, not one copied
    skeleton = meta_skeleton(ckpt)
    plan = apply_imatrix(resolve_plan(load_recipe(recipe_file("gguf-q4_k_m")), skeleton), skeleton, str(ckpt),
                         str(tmp_path / "im.gguf"), have_data=False)
    leaf = FAMILIES[family][1][2]
    held = "block_sparse_moe" if family == "granitemoe" else "mlp"  # the experts module's name in memory
    for e in range(8):
        got = plan.importances[f"model.layers.1.{held}.experts.{e}.{leaf}"].mean_square()
        want = torch.from_numpy(sums[e] / counts[e, 0]) if counts[e, 0] else torch.zeros(sums.shape[1])
        assert torch.allclose(got, want.to(torch.float32)), e
    # the older imatrix.dat holds the experts' rows one after another in one entry of experts x width values
    # (llama-imatrix's legacy writer: E[x²] x ncall, and 1.0 for an expert no token reached)
    dat = tmp_path / "imatrix.dat"
    ncall = 7
    body = struct.pack("<i", 1) + struct.pack("<i", len(b"blk.1.ffn_down_exps.weight")) + b"blk.1.ffn_down_exps.weight"
    values = np.where(counts > 0, sums / np.maximum(counts, 1) * ncall, 1.0).astype(np.float32).reshape(-1)
    dat.write_bytes(body + struct.pack("<ii", ncall, values.size) + values.tobytes())
    plan = apply_imatrix(resolve_plan(load_recipe(recipe_file("gguf-q4_k_m")), skeleton), skeleton, str(ckpt),
                         str(dat), have_data=False)
    for e in range(8):
        got = plan.importances[f"model.layers.1.{held}.experts.{e}.{leaf}"].mean_square()
        want = torch.from_numpy(sums[e] / counts[e, 0]) if counts[e, 0] else torch.full((sums.shape[1],), 1 / ncall)
        assert torch.allclose(got, want.to(torch.float32)), e


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "gpt_oss", "qwen3"])
def test_a_tied_models_file_loads_in_llama_cpp(tmp_path, family):
    """Tied embeddings leave lm_head out of the checkpoint. llama.cpp's qwen2moe, olmoe and gpt-oss loaders need an
    ``output.weight`` (they fail with "tensor 'output.weight' not found", where qwen3 and the others fall back to
    ``token_embd``): their files store the embedding table again as the output layer."""
    pytest.importorskip("xllamacpp")
    from qtool.families import FAMILIES as BY_TYPE

    ckpt = _tiny(tmp_path / "m", family, tie_word_embeddings=True)
    code, _, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "-o", tmp_path / "q", "--format", "gguf", "--quiet")
    assert code == 0, err
    names = {t.name for t in gguf.GGUFReader(tmp_path / "q" / "model.gguf").tensors}
    assert ("output.weight" in names) == BY_TYPE[family].gguf_needs_output
    agree, diffs = _agreement(ckpt, tmp_path / "q")
    assert agree >= 34, agree
    assert median(diffs) < 0.03, sorted(diffs)


_CONFIG = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, hidden_size=64,
               intermediate_size=128, max_position_embeddings=8192)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
_DEEPSEEK = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, q_lora_rank=32,
                 n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("model_type,extra,needle", [
    ("qwen3", {"attention_bias": True}, "attention_bias is True, and llama.cpp's qwen3 has no attention biases"),
    ("qwen3_moe", {**_MOE, "norm_topk_prob": True, "attention_bias": True}, "qwen3moe has no attention biases"),
    ("olmoe", {**_MOE, "attention_bias": True}, "olmoe has no attention biases"),
    ("olmoe", {**_MOE, "clip_qkv": 8.0}, "clip_qkv is 8.0, and llama.cpp's olmoe has no clipping of q/k/v"),
    ("smollm3", {"mlp_bias": True}, "mlp_bias is True, and llama.cpp's smollm3 has no MLP biases"),
    ("gemma3_text", {"attention_bias": True}, "gemma3 has no attention biases"),
    ("deepseek_v3", {**_DEEPSEEK, "attention_bias": True}, "deepseek2 has no attention biases"),
    ("phi3", {"head_dim": 32}, "head_dim 32 is not hidden_size / num_attention_heads (64 / 4)"),
    # the older keys transformers turns into the lists (the checks read only the lists)
    ("gemma3_text", {"sliding_window": 8, "sliding_window_pattern": 2}, "layer_types differ from llama.cpp's gemma3"),
    ("smollm3", {"no_rope_layer_interval": 2}, "no_rope_layers differ from llama.cpp's smollm3"),
    # no mscale: transformers scales the rotary part by 0.1 ln(factor) + 1, llama.cpp nothing
    ("deepseek_v3", {**_DEEPSEEK, "rope_scaling": {"rope_type": "yarn", "factor": 40.0,
                                                   "original_max_position_embeddings": 32}},
     "YaRN mscale None and mscale_all_dim None"),
    ("deepseek_v3", {**_DEEPSEEK, "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "mscale": 0.0,
                                                   "mscale_all_dim": 0.0, "original_max_position_embeddings": 32}},
     "YaRN mscale 0.0 and mscale_all_dim 0.0"),
])
def test_a_config_whose_gguf_llama_cpp_would_not_load_or_would_compute_otherwise_is_refused(model_type, extra,
                                                                                           needle):
    """Each exported with exit 0: llama.cpp refused the biases ("wrong number of tensors") and Phi-3's wider heads
    ("wrong shape"), and ran the others with another function (agreement with transformers 1-8 of 20 prompts)."""
    import re

    from qtool.errors import CheckpointError
    from qtool.families import family_of

    with pytest.raises(CheckpointError, match=re.escape(needle)):
        family_of(model_type).check_gguf({**_CONFIG, **extra}, Path("config.json"))


@pytest.mark.parametrize("model_type,extra,layers", [
    ("mistral", {}, 4),  # no sliding_window key: transformers' MistralConfig default, 4096 (Mistral-7B-v0.1's)
    ("mistral", {"sliding_window": None}, 0),
    ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 1024}, 4),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 1024, "max_window_layers": 1}, 3),
    ("qwen2", {"sliding_window": 1024}, 0),  # (use_sliding_window false: transformers ignores the window)
    ("qwen3", {"use_sliding_window": True, "sliding_window": 1024,
               "layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, 1),
    ("qwen2_moe", {**_MOE, "use_sliding_window": True, "sliding_window": 1024, "max_window_layers": 4}, 2),
    ("qwen3_moe", {**_MOE, "norm_topk_prob": True, "use_sliding_window": True, "sliding_window": 1024}, 4),
    ("phi3", {"sliding_window": 2047}, 4),
    ("phi3", {"sliding_window": 262144}, 0),  # (no text is longer than the context)
])
def test_a_sliding_window_llama_cpp_does_not_run_is_a_warning(model_type, extra, layers):
    """The file computes what llama.cpp's converter's does, full attention; transformers windows those layers."""
    from qtool.families import family_of

    family = family_of(model_type)
    warnings = family.gguf_warnings(family.check_gguf({**_CONFIG, **extra}, Path("config.json")))
    if not layers:
        assert warnings == []
        return
    [warning] = warnings
    window = extra.get("sliding_window", 4096)
    default = "" if "sliding_window" in extra else " (transformers' default: config.json names none)"
    assert warning.startswith(f"sliding_window {window}{default}: transformers attends to the last {window} tokens in "
                              f"{layers} of 4 layers, llama.cpp's {family.gguf_arch} to the whole context")


def test_a_sliding_window_warning_reaches_the_export_summary_and_a_refusal_writes_nothing(tmp_path):
    ckpt = _tiny(tmp_path / "w", "qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    code, out, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "-o", tmp_path / "q", "--format", "gguf", "--json")
    assert code == 0, err
    assert [w for w in json.loads(out)["export_warnings"] if w.startswith("sliding_window 8: ")]
    ckpt = _tiny(tmp_path / "b", "qwen3", attention_bias=True)
    code, _, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "-o", tmp_path / "r", "--format", "gguf")
    assert code == 2 and "attention_bias is True" in err and len(error_lines(err)) == 1, err
    assert not (tmp_path / "r").exists()


def test_the_window_warning_says_when_the_window_is_transformers_default_and_bad_window_keys_are_one_line():
    from qtool.errors import CheckpointError
    from qtool.families import family_of

    mistral = family_of("mistral")
    [warning] = mistral.gguf_warnings(mistral.check_gguf(dict(_CONFIG), Path("config.json")))
    assert warning.startswith("sliding_window 4096 (transformers' default: config.json names none): ")
    with pytest.raises(CheckpointError, match="sliding_window / max_window_layers must be integers"):
        family_of("qwen2").check_gguf({**_CONFIG, "use_sliding_window": True, "sliding_window": 8,
                                       "max_window_layers": None}, Path("config.json"))
    yarn = {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 32}
    family_of("deepseek_v3").check_gguf({**_CONFIG, **_DEEPSEEK, "rope_scaling": yarn}, Path("config.json"))
    with pytest.raises(CheckpointError, match="attention_factor is set"):
        family_of("deepseek_v3").check_gguf({**_CONFIG, **_DEEPSEEK, "rope_scaling": {
            **yarn, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "attention_factor": 1.2}},
            Path("config.json"))


@pytest.mark.parametrize("rule", [
    "layers:\n  - match: 're:.*\\.experts\\.0\\.down_proj'\n    weights: {gguf_type: q8_0}\n",
    "ignore: ['re:.*\\.experts\\.1\\..*']\n"])
def test_experts_of_one_projection_apart_are_refused_before_calibrating(tmp_path, rule):
    """GGUF stacks a projection's experts into one tensor of one type: a recipe giving one expert its own type, or
    leaving one float, calibrated in full (hours on a real MoE) and was refused at the write; config show and
    calibrate said nothing."""
    model = _tiny(tmp_path / "moe", "qwen3_moe")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ngguf_mix: q4_k_m\ndefaults: {weights: {analyzer: minmax}, activations: null}\n"
                      + rule)
    code, _, err = run_cli("config", "show", recipe, "--model", model)
    assert code == 0 and "model.layers.0.mlp.experts.*." in err and "export --format gguf refuses them" in err, err
    code, _, err = run_cli("quantize", model, "-c", recipe, "-o", tmp_path / "q", "--format", "gguf")
    kind = "gives them Q5_0 and Q8_0" if "q8_0" in rule else "quantizes some and leaves expert(s) 1 float"  # (Q4_K's
    # fallback: rows of 32)
    assert code == 2 and "calibrating" not in err and "GGUF stores a projection's experts as one tensor of one " \
        f"type, and the recipe {kind}" in err, err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("gguf_float, refused", [("f16", False), ("f32", True)])
def test_experts_left_float_beside_fallback_floats_of_their_type_are_one_stack(tmp_path, gguf_float, refused):
    """With --gguf-fallback f16, experts off every GGUF grid are written F16: an expert left float (--gguf-float) is
    F16 too and the stack is one type; under --gguf-float f32 it is not, which is refused before calibrating."""
    model = _tiny(tmp_path / "moe", "qwen3_moe")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ndefaults: {weights: {bitwidth: 8, granularity: per_channel}, activations: null}\n"
                      "ignore: ['re:.*\\.experts\\.1\\..*']\n")
    code, _, err = run_cli("quantize", model, "-c", recipe, "-o", tmp_path / "q", "--format", "gguf",
                           "--gguf-fallback", "f16", "--gguf-float", gguf_float, "--quiet")
    if refused:  # (and told the flag that makes one stack)
        assert code == 2 and "GGUF stores a projection's experts as one tensor of one type" in err, err
        assert err.rstrip().endswith("one rule for every expert of a projection, or --gguf-float f16 to store the "
                                     "float ones as the others' fallback stores them"), err
    else:
        assert code == 0, err


@pytest.mark.parametrize("family,width", [("qwen3", 128), ("gpt_oss", 64)])
def test_a_config_without_head_dim_gets_the_heads_transformers_builds(tmp_path, family, width):
    """Qwen3's and gpt-oss's configs default head_dim to a number (128, 64), not hidden / heads: without the key
    transformers builds those heads, and the file says so (it said hidden / heads, and llama.cpp refused its
    tensors' shapes while quantize exited 0)."""
    pytest.importorskip("xllamacpp")
    ckpt = _tiny(tmp_path / "m", family, head_dim=width)
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("head_dim")
    (ckpt / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "-o", tmp_path / "q", "--format", "gguf", "--quiet")
    assert code == 0, err
    fields = gguf.GGUFReader(tmp_path / "q" / "model.gguf").fields
    arch = {"qwen3": "qwen3", "gpt_oss": "gpt-oss"}[family]
    assert fields[f"{arch}.attention.key_length"].contents() == width
    agree, diffs = _agreement(ckpt, tmp_path / "q")
    assert agree >= 34, agree
    assert median(diffs) < 0.03, sorted(diffs)
