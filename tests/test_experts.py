"""Mixture-of-experts experts are weights like any other: transformers 5's fused 3-D experts become one Linear per
expert and projection (named as the checkpoint names them), computing what the fused module computes, so every
plan, calibration mode, algorithm and exporter handles them."""

import json

import pytest
import torch

import qtool
from safetensors import safe_open
from safetensors.torch import save_file

from qtool.export.qtool_st import read_integer_export
from qtool.model.experts import LinearExperts, fused_layout, linearize_experts
from tests.helpers import error_lines, run_cli

transformers = pytest.importorskip("transformers")

ROLES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _config(family, hidden=64, experts=8, layers=2):
    extra = {"qwen3_moe": {"moe_intermediate_size": 32, "num_experts": experts, "head_dim": 16},
             "mixtral": {"num_local_experts": experts, "head_dim": 16},
             "gpt_oss": {"num_local_experts": experts, "head_dim": 16},
             "granitemoe": {"num_local_experts": experts},
             "llama4_text": {"num_local_experts": experts, "head_dim": 16, "intermediate_size_mlp": 64,
                             "interleave_moe_layer_step": 1}}[family]
    cfg = transformers.AutoConfig.for_model(family, vocab_size=256, hidden_size=hidden, intermediate_size=32,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                            num_experts_per_tok=2, **extra)
    return cfg


def _saved(tmp_path, family):
    """A seeded tiny causal LM of ``family`` saved by transformers (per-expert tensors on disk) and 16 x 32 token
    ids beside it: ``(checkpoint, ids)``."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).eval()
    model.save_pretrained(tmp_path / family)
    ids = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    return tmp_path / family, tmp_path / "ids.safetensors"


def _keys(checkpoint):
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_linear_experts_compute_what_the_fused_module_computes(family):
    """Every layout transformers' experts decorator describes (gpt-oss: transposed, interleaved gate/up, biases,
    its own clamped gate; Qwen3-MoE: concatenated), against the fused module's eager and batched forwards."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, hidden=16, experts=4, layers=1)).eval()
    fused = next(m for m in model.modules() if fused_layout(m) is not None)
    with torch.no_grad():
        for p in fused.parameters():
            p.normal_(std=0.3)
    x = torch.randn(10, 16)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(10)])
    weights = torch.rand(10, 2)
    refs = []
    for impl in ("eager", "batched_mm"):
        fused.config._experts_implementation = impl
        refs.append(fused(x, index, weights))
    assert torch.allclose(refs[0], refs[1], atol=1e-5)
    tensors = {k: p.detach().clone() for k, p in fused.named_parameters(recurse=False)}
    linear = LinearExperts(fused, fused_layout(fused), ROLES)
    linear.load_from(tensors)
    assert linear.expert(3).gate_proj.weight.shape == (32, 16) and linear.expert(3).down_proj.weight.shape == (16, 32)
    out = linear(x, index, weights)
    assert torch.allclose(out, refs[0], atol=1e-5) and out.abs().max() > 1


@pytest.mark.parametrize("family,leaf,stored", [("qwen3_moe", "gate_proj", "mlp"), ("mixtral", "w1", "block_sparse_moe")])
def test_linearized_experts_hold_the_checkpoint_tensors_and_the_model_computes_the_same(tmp_path, family, leaf,
                                                                                         stored):
    checkpoint, _ = _saved(tmp_path, family)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits
    tensors = _keys(checkpoint)
    rng = torch.random.get_rng_state()
    assert linearize_experts(model, tensors) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    # (each expert's Linear was initialized at random first: a user's seeded draws after loading an MoE differed)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert not any(p.dim() == 3 for p in model.parameters())
    names = getattr(model, "_qtool_checkpoint_keys")
    assert len([n for n in names if ".experts." in n]) == 2 * 8 * 3
    # a parameter transformers renames (Mixtral's router) is recorded too, so its weight row takes the stored name
    assert {n: k for n, k in names.items() if ".experts." not in n} == (
        {f"model.layers.{i}.mlp.gate.weight": f"model.layers.{i}.block_sparse_moe.gate.weight" for i in range(2)}
        if family == "mixtral" else {})
    assert names[f"model.layers.1.mlp.experts.5.{leaf}.weight"] == f"model.layers.1.{stored}.experts.5.{leaf}.weight"
    for name, key in names.items():
        assert torch.equal(model.get_parameter(name), tensors[key]), name
    assert torch.allclose(model(ids).logits, ref, atol=1e-5)


def _quantized_in_memory_as_sequential(tmp_path, checkpoint, ids):
    """``quantize -c w4a16-block32`` in memory and with ``--sequential``: the same bytes; the export's weights."""
    runs = {}
    for name, extra in (("memory", []), ("sequential", ["--sequential"])):
        code, _, err = run_cli("quantize", checkpoint, "-c", "w4a16-block32", "--data", ids, "-o", tmp_path / name,
                               "--quiet", *extra)
        assert code == 0, err
        runs[name] = (tmp_path / name / "model.safetensors").read_bytes()
    assert runs["memory"] == runs["sequential"]
    return read_integer_export(tmp_path / "memory" / "model.safetensors")


@pytest.mark.parametrize("family,expert", [("qwen3_moe", "model.layers.1.mlp.experts.7.down_proj.weight"),
                                           ("mixtral", "model.layers.1.block_sparse_moe.experts.7.w2.weight")])
def test_every_expert_is_quantized_exported_as_the_checkpoint_names_it_and_sequential_writes_the_same(
        tmp_path, family, expert):
    checkpoint, ids = _saved(tmp_path, family)
    code, out, err = run_cli("config", "show", "w4a16-block32", "--model", checkpoint, "--json")
    assert code == 0, err
    shown = json.loads(out)
    # all weights but the embedding (recipe: lm_head ignored, embedding int8), routers and norms: 2 x 8 x 3 experts
    assert sum(q["name"].endswith((".w1.weight", ".w2.weight", ".w3.weight", "_proj.weight"))
               and ".experts." in q["name"] for q in shown["quantizers"]) == 48
    assert not [w for w in shown["warnings"] if "have no quantizer" in w]
    assert {u["module_type"] for u in shown["weights_quantized"]["unreachable"]} <= {"Qwen3MoeTopKRouter",
                                                                                     "MixtralTopKRouter"}
    exported = _quantized_in_memory_as_sequential(tmp_path, checkpoint, ids)
    float_weight = _keys(checkpoint)[expert]
    q = exported[expert]
    assert q.shape == float_weight.shape and not torch.equal(q, float_weight)
    assert (q - float_weight).abs().max() < 0.25 * float_weight.abs().max()  # 4-bit steps of its own block
    assert len(torch.unique(q[0, :32])) <= 16


def _saved_fused(tmp_path, family):
    """A tiny ``family`` checkpoint whose file stores each layer's experts fused: gpt-oss and GraniteMoE as
    transformers saves them, Qwen3-MoE as its state_dict (what a plain ``save_file`` of the model writes)."""
    if family != "qwen3_moe":
        return _saved(tmp_path, family)
    checkpoint, ids = _saved(tmp_path, family)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    (checkpoint / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, checkpoint / "model.safetensors")
    return checkpoint, ids


# family -> (the fused module, how expert e's gate rows sit in the file's tensor, the file's fused tensor names)
FUSED_ON_DISK = {
    # [E, H, 2I]: transposed, gate and up columns interleaved, biases
    "gpt_oss": ("model.layers.1.mlp.experts", lambda t, e: t["model.layers.1.mlp.experts.gate_up_proj"][e].t()[0::2],
                ("experts.gate_up_proj", "experts.down_proj")),
    # [E, 2I, H] under another name (input_linear, output_linear), gate rows first
    "granitemoe": ("model.layers.1.block_sparse_moe.experts",
                   lambda t, e: t["model.layers.1.block_sparse_moe.input_linear.weight"][e][:32],
                   ("input_linear", "output_linear")),
    "qwen3_moe": ("model.layers.1.mlp.experts", lambda t, e: t["model.layers.1.mlp.experts.gate_up_proj"][e][:32],
                  ("experts.gate_up_proj", "experts.down_proj")),
    # [E, H, 2I] transposed, gate columns first; its module takes every expert's rows stacked, scaled by routing
    "llama4_text": ("model.layers.1.feed_forward.experts",
                    lambda t, e: t["model.layers.1.feed_forward.experts.gate_up_proj"][e].t()[:32],
                    ("experts.gate_up_proj", "experts.down_proj")),
}


@pytest.mark.parametrize("family", sorted(FUSED_ON_DISK))
def test_experts_a_checkpoint_stores_fused_are_quantized_one_by_one_and_sequential_writes_the_same(tmp_path,
                                                                                                   family):
    """gpt-oss (and GraniteMoE) checkpoints hold the fused 3-D tensors themselves: every expert is still a weight
    like any other, named as llm-compressor names a linearized gpt-oss, and --sequential reads each expert's slice."""
    module, gate_rows, fused_names = FUSED_ON_DISK[family]
    checkpoint, ids = _saved_fused(tmp_path, family)
    code, out, err = run_cli("config", "show", "w4a16-block32", "--model", checkpoint, "--json")
    assert code == 0, err
    shown = json.loads(out)
    planned = {q["name"] for q in shown["quantizers"]}
    for e in range(8):
        for leaf in ROLES.values():
            assert f"{module}.{e}.{leaf}.weight" in planned
    assert not [w for w in shown["warnings"] if "have no quantizer" in w]
    assert all("Router" in u["module_type"] for u in shown["weights_quantized"]["unreachable"])
    assert not [n for n in planned if "router" in n]  # routers stay float (Llama 4's is a Linear)
    exported = _quantized_in_memory_as_sequential(tmp_path, checkpoint, ids)
    assert not [k for k in exported if any(f in k for f in fused_names)]
    floats = _keys(checkpoint)
    for e in (0, 5):
        float_gate = gate_rows(floats, e)
        q = exported[f"{module}.{e}.gate_proj.weight"]
        assert q.shape == float_gate.shape == (32, 64) and not torch.equal(q, float_gate)
        assert (q - float_gate).abs().max() < 0.25 * float_gate.abs().max()  # 4-bit steps of its own block
        assert len(torch.unique(q[0, :32])) <= 16


def _gptq_in_both_formats(tmp_path, checkpoint, ids):
    """``quantize -c w4a16-block32-gptq`` into ``tmp_path/qtool`` and ``tmp_path/compressed-tensors``."""
    for fmt in ("qtool", "compressed-tensors"):
        code, _, err = run_cli("quantize", checkpoint, "-c", "w4a16-block32-gptq", "--data", ids, "-o",
                               tmp_path / fmt, "--format", fmt, "--quiet")
        assert code == 0, err


def test_llama4_experts_split_compute_what_its_stacked_module_computes_on_the_tokens_routed_to_them(tmp_path):
    """Llama 4's experts module takes every expert's rows stacked, each token scaled by its routing weight (0 where
    not routed): split, each expert runs its routed rows only (the only ones its statistics see), and the model's
    logits are transformers'."""
    checkpoint, ids = _saved(tmp_path, "llama4_text")
    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert linearize_experts(model, _keys(checkpoint)) == ["model.layers.0.feed_forward.experts",
                                                           "model.layers.1.feed_forward.experts"]
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref(x).logits, model(x).logits
    assert torch.allclose(got, want, atol=1e-5) and want.abs().max() > 0.1
    experts = model.get_submodule("model.layers.1.feed_forward.experts")
    assert sum(len(t) for t in experts.routed_tokens.values()) == 2 * 12 * 2  # 24 tokens, 2 experts each
    code, out, err = run_cli("calibrate", checkpoint, "-c", "w4a16-block32-gptq", "--data", ids, "-o",
                             tmp_path / "run", "--json", "--quiet")
    assert code == 0, err
    tokens = json.loads(out)["expert_tokens"]
    assert sum(n for k, n in tokens.items() if k.startswith("model.layers.1.")) == 16 * 32 * 2


def test_gpt_oss_experts_export_with_llm_compressors_names_and_eval_says_what_transformers_cannot_read(tmp_path):
    checkpoint, ids = _saved(tmp_path, "gpt_oss")
    _gptq_in_both_formats(tmp_path, checkpoint, ids)
    with safe_open(str(tmp_path / "compressed-tensors" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        bias = f.get_tensor("model.layers.0.mlp.experts.3.up_proj.bias")
    for leaf in ROLES.values():
        assert {f"model.layers.0.mlp.experts.3.{leaf}.{k}" for k in ("weight_packed", "weight_scale", "bias")} <= keys
    assert not [k for k in keys if "gate_up_proj" in k or k.endswith("experts.down_proj")]
    assert torch.equal(bias, _keys(checkpoint)["model.layers.0.mlp.experts.gate_up_proj_bias"][3][1::2])
    config = json.loads((tmp_path / "compressed-tensors" / "config.json").read_text())["quantization_config"]
    assert sorted(config["ignore"]) == ["lm_head", "model.layers.0.mlp.router", "model.layers.1.mlp.router"]
    held = tmp_path / "held.safetensors"
    save_file({"input_ids": torch.randint(0, 256, (4, 40), generator=torch.Generator().manual_seed(3))}, held)
    evaluate = ("--data", held, "--seq-len", 32, "--num-samples", 4, "--generate", 0, "--json")
    code, out, err = run_cli("eval", tmp_path / "qtool", *evaluate)
    assert code == 0, err
    assert json.loads(out)["export_gap"]["kl_mean"] < 1e-6
    # transformers holds gpt-oss's experts fused and would run them at their initial values: refused, not blamed
    code, out, err = run_cli("eval", tmp_path / "compressed-tensors", *evaluate)
    assert code == 2 and "transformers leaves" in err and "stored one by one" in err and "export fault" not in err


def test_eval_reads_a_qtool_export_whose_experts_transformers_renames(tmp_path):
    """Mixtral's checkpoint names (block_sparse_moe.experts.<e>.w1) are not its model's (mlp.experts)."""
    checkpoint, ids = _saved(tmp_path, "mixtral")
    code, _, err = run_cli("quantize", checkpoint, "-c", "w4a16-block32", "-o", tmp_path / "q", "--quiet")
    assert code == 0, err
    code, out, err = run_cli("eval", tmp_path / "q", "--data", ids, "--seq-len", 32, "--num-samples", 4,
                             "--generate", 0, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["export_gap"]["kl_mean"] < 1e-6 and result["vs_float"]["artifact"]["kl_mean"] > 1e-5


def test_compressed_tensors_experts_reload_in_transformers_as_qtool_chose_them(tmp_path):
    """llm-compressor's per-expert names (what vLLM's fused-MoE loader reads); transformers stacks them back into
    its fused experts with exactly the values of qtool's own export (GPTQ codes, per expert on its routed tokens)."""
    checkpoint, ids = _saved(tmp_path, "mixtral")
    _gptq_in_both_formats(tmp_path, checkpoint, ids)
    with safe_open(str(tmp_path / "compressed-tensors" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight_packed" in keys
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight_scale" in keys
    # the routers stay float and are listed as llm-compressor lists them (by the checkpoint's names)
    config = json.loads((tmp_path / "compressed-tensors" / "config.json").read_text())["quantization_config"]
    assert sorted(config["ignore"]) == ["lm_head", "model.layers.0.block_sparse_moe.gate",
                                        "model.layers.1.block_sparse_moe.gate"]
    with safe_open(str(tmp_path / "qtool" / "calibration" / "codes.safetensors"), "pt") as f:
        assert sum(".experts." in k for k in f.keys()) == 48  # GPTQ chose every expert's codes
    # the tokens each expert was routed, named as the encodings name its weights (they said mlp.experts.3)
    tokens = json.loads((tmp_path / "qtool" / "calibration" / "manifest.json").read_text())["expert_tokens"]
    assert list(tokens) == [f"model.layers.{i}.block_sparse_moe.experts.{e}" for i in range(2) for e in range(8)]
    ours = read_integer_export(tmp_path / "qtool" / "model.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "compressed-tensors", dtype=torch.float32)
    for layer in range(2):
        fused = model.model.layers[layer].mlp.experts
        for e in range(8):
            p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
            assert torch.equal(fused.gate_up_proj[e], torch.cat([ours[p + "w1.weight"], ours[p + "w3.weight"]]))
            assert torch.equal(fused.down_proj[e], ours[p + "w2.weight"])


def test_eval_of_nvfp4_experts_names_transformers_reload_as_the_limit(tmp_path):
    """transformers stacks NVFP4 experts into its fused ones multiplied by the global scale instead of divided
    (docs/formats.md): eval called the file an export fault (KL 0.49, exit 1) though it decodes to qtool's weights."""
    checkpoint, ids = _saved(tmp_path, "qwen3_moe")
    code, _, err = run_cli("quantize", checkpoint, "-c", "nvfp4a16", "--format", "compressed-tensors", "-o",
                           tmp_path / "ct", "--quiet")
    assert code == 0, err
    code, out, err = run_cli("eval", tmp_path / "ct", "--data", ids, "--seq-len", "32", "--num-samples", "4",
                             "--generate", "0", "--json")
    assert code == 2 and "reloads NVFP4 experts wrongly" in err and "not the file" in err, err


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_eval_of_dynamic_activations_on_experts_compares_what_transformers_runs(tmp_path, family):
    """transformers runs a compressed-tensors MoE's experts fused, without quantizing their inputs (compressed-
    tensors quantizes a Linear's input; vLLM's MoE kernels quantize the experts'), so eval's fake-quant model runs
    those quantizers in float too and says so: FP8 dynamic activations were a false export fault (KL 6e-4)."""
    checkpoint, ids = _saved(tmp_path, family)
    code, _, err = run_cli("quantize", checkpoint, "-c", "fp8-dynamic", "--format", "compressed-tensors", "-o",
                           tmp_path / "ct", "--data", ids, "--quiet")
    assert code == 0, err
    code, out, err = run_cli("eval", tmp_path / "ct", "--data", ids, "--seq-len", "32", "--num-samples", "4",
                             "--generate", "0", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["export_fault"] is None and res["export_gap"]["kl_mean"] < 1e-6, res["export_gap"]
    assert any("routed experts' 48 activation quantizer(s) in float" in n for n in res["notes"]), res["notes"]


def test_an_expert_routed_too_few_tokens_is_chosen_without_data_and_named(tmp_path):
    checkpoint, _ = _saved(tmp_path, "qwen3_moe")
    save_file({"input_ids": torch.randint(0, 256, (1, 3), generator=torch.Generator().manual_seed(0))},
              tmp_path / "few.safetensors")
    code, _, err = run_cli("calibrate", checkpoint, "-c", "w4a16-block32-gptq", "--data", tmp_path / "few.safetensors",
                           "-o", tmp_path / "run", "--quiet")
    assert code == 0, err
    [warning] = [w for w in json.loads((tmp_path / "run" / "manifest.json").read_text())["warnings"]
                 if "expert(s) saw fewer" in w]
    assert warning.startswith("16 expert(s)") and "model.layers.0.mlp.experts.0 (" in warning
    with safe_open(str(tmp_path / "run" / "codes.safetensors"), "pt") as f:
        codes = {k: f.get_tensor(k) for k in f.keys()}
    enc = {e["name"]: e for e in json.loads((tmp_path / "run" / "encodings.json").read_text())["quantizers"]}
    # no data: GPTQ on XᵀX = I is round-to-nearest on the unweighted range
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    w = _keys(checkpoint)[name]
    lo, hi = torch.tensor(enc[name]["min"]), torch.tensor(enc[name]["max"])
    scale = (hi - lo) / 15
    nearest = torch.clamp(torch.round(w.reshape(32, 2, 32) / scale[..., None]), -8, 7).reshape(32, 64)
    assert torch.equal(codes["codes/" + name].to(torch.float32), nearest)


def test_under_signround_an_expert_routed_a_few_tokens_is_said_to_learn_from_them(tmp_path):
    """The warning said such experts were "chosen without data (round-to-nearest on an unweighted range)", while
    signround, which learns on the block's outputs, moved their codes; an expert no token reached is rounded to
    nearest, as said."""
    checkpoint, _ = _saved(tmp_path, "qwen3_moe")
    save_file({"input_ids": torch.randint(0, 256, (1, 3), generator=torch.Generator().manual_seed(0))},
              tmp_path / "few.safetensors")
    code, out, err = run_cli("calibrate", checkpoint, "-c", "w4a16-block32-signround", "--data",
                             tmp_path / "few.safetensors", "--sequential", "-o", tmp_path / "run", "--json")
    assert code == 0, err
    tokens = json.loads(out)["expert_tokens"]
    warnings = json.loads((tmp_path / "run" / "manifest.json").read_text())["warnings"]
    learned = [w for w in warnings if "signround learned their rounding" in w]
    nearest = [w for w in warnings if "chosen without data" in w]
    some = sum(1 for n in tokens.values() if 0 < n)
    none = sum(1 for n in tokens.values() if n == 0)
    assert some and none, tokens
    # (one warning per block of the --sequential run)
    assert sum(int(w.split(" ", 1)[0]) for w in learned) == some, learned
    assert sum(int(w.split(" ", 1)[0]) for w in nearest) == none and all(" (0 tokens)" in w for w in nearest), nearest
    assert not any(" (0 tokens)" in w for w in learned)


def test_the_manifest_and_json_give_the_tokens_each_expert_was_routed_and_a_resume_keeps_them(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    checkpoint, ids = _saved(tmp_path, "qwen3_moe")
    args = ["calibrate", checkpoint, "-c", "w4a16-block32-gptq", "--data", ids, "--sequential"]
    code, out, err = run_cli(*args, "-o", tmp_path / "whole", "--json")
    assert code == 0, err
    tokens = json.loads(out)["expert_tokens"]
    manifest = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    assert manifest["expert_tokens"] == tokens
    assert list(tokens) == [f"model.layers.{i}.mlp.experts.{e}" for i in range(2) for e in range(8)]
    for layer in range(2):  # 16 x 32 tokens, each routed to 2 of 8 experts
        assert sum(n for k, n in tokens.items() if k.startswith(f"model.layers.{layer}.")) == 16 * 32 * 2
    root = Path(__file__).resolve().parents[1]
    killed = subprocess.run([sys.executable, str(root / "tests/stop_after_block.py"), "1", "--",
                             *[str(a) for a in args], "--quiet", "-o", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=300, cwd=root)
    assert killed.returncode == -9, killed.stderr[-2000:]
    code, _, err = run_cli(*args, "--resume", "--quiet", "-o", tmp_path / "run")
    assert code == 0, err
    for name in ("manifest.json", "encodings.json", "codes.safetensors"):
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_an_experts_gate_and_up_projections_share_one_set_of_input_statistics():
    """They read the very same tensor: one XᵀX for both (a Qwen3-30B-A3B block's 128 experts would otherwise hold
    4.3 GB of float64 sums twice), equal to what each would have collected alone."""
    from qtool.calibration.rounding import collect_module_inputs
    from qtool.model.experts import same_inputs

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("qwen3_moe")).eval()
    keys = [f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in range(2) for e in range(8)
            for p in ("gate_proj", "up_proj", "down_proj")]
    linearize_experts(model, keys)
    modules = dict(model.named_modules())
    names = [n for n in modules if n.startswith("model.layers.0.mlp.experts.") and n.endswith("_proj")]
    aliases = same_inputs(modules, names)
    assert aliases == {f"model.layers.0.mlp.experts.{e}.up_proj": f"model.layers.0.mlp.experts.{e}.gate_proj"
                       for e in range(8)}
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))

    def run():
        model(ids)

    shared = collect_module_inputs({n: True for n in names}, modules, run, aliases)
    alone = collect_module_inputs({n: True for n in names}, modules, run)
    up, gate = "model.layers.0.mlp.experts.3.up_proj", "model.layers.0.mlp.experts.3.gate_proj"
    assert shared[up] is shared[gate] and alone[up] is not alone[gate]
    assert shared[up].count == alone[up].count > 0 and torch.equal(shared[up].xtx, alone[up].xtx)


def test_all_experts_mode_shows_every_expert_every_token_and_keeps_the_output_routed(tmp_path):
    from qtool.model.experts import all_tokens_routed

    checkpoint, ids = _saved(tmp_path, "qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    linearize_experts(model, _keys(checkpoint))
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    routed = model(x).logits
    with all_tokens_routed(model, True):
        assert sum(m.all_tokens for m in model.modules() if hasattr(m, "all_tokens")) == 2
        assert torch.allclose(model(x).logits, routed, atol=1e-5)
    assert not any(getattr(m, "all_tokens", False) for m in model.modules())
    code, out, err = run_cli("calibrate", checkpoint, "-c", "w4a16-block32-gptq", "--data", ids, "-o",
                             tmp_path / "run", "--all-experts", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert set(summary["expert_tokens"].values()) == {16 * 32}
    assert not [w for w in summary["warnings"] if "saw fewer" in w]
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["options"]["all_experts"] is True
    code, out, err = run_cli("calibrate", checkpoint, "-c", "w4a16-block32-gptq", "--data", ids, "-o",
                             tmp_path / "routed", "--json")
    assert code == 0, err
    assert "all_experts" not in json.loads((tmp_path / "routed" / "manifest.json").read_text())["options"]
    assert sum(json.loads(out)["expert_tokens"].values()) == 2 * 16 * 32 * 2


def test_nvfp4_experts_share_one_global_scale_per_gate_up_pair_and_decode_to_qtools_weights(tmp_path):
    """vLLM fuses an expert's gate and up projections (Mixtral's w1/w3: its w13) under one global scale. The
    per-expert tensors decode, by compressed-tensors' convention (FP4 value x block scale / global scale), to
    qtool's fake-quant weights exactly. (transformers 5.23 reloads NVFP4 experts wrongly, multiplying by the global
    scale: values up to 448 x 6; vLLM is the runtime for these files.)"""
    import qtool

    checkpoint, ids = _saved(tmp_path, "mixtral")
    code, _, err = run_cli("quantize", checkpoint, "-c", "nvfp4a16", "--data", ids, "-o", tmp_path / "ct",
                           "--format", "compressed-tensors", "--quiet")
    assert code == 0, err
    model = qtool.load_calibrated(str(checkpoint), str(tmp_path / "ct/calibration/encodings.json"))
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        for e in (0, 5):
            p = f"model.layers.1.block_sparse_moe.experts.{e}."
            assert torch.equal(f.get_tensor(p + "w1.weight_global_scale"), f.get_tensor(p + "w3.weight_global_scale"))
            packed = f.get_tensor(p + "w3.weight_packed")
            codes = torch.stack([packed & 15, packed >> 4], -1).reshape(32, 64).long()
            scale = f.get_tensor(p + "w3.weight_scale").float() / f.get_tensor(p + "w3.weight_global_scale")
            decoded = (lut[codes].reshape(32, 4, 16) * scale[..., None]).reshape(32, 64)
            layer = model.model.layers[1].mlp.experts.expert(e).w3
            ours = layer.qtool_quantizers["weight"](layer.weight).as_subclass(torch.Tensor).detach()
            assert torch.equal(decoded, ours)


def test_onnx_export_refuses_a_mixture_of_experts_model_before_calibrating(tmp_path):
    checkpoint, ids = _saved(tmp_path, "qwen3_moe")
    code, _, err = run_cli("quantize", checkpoint, "-c", "w8a8", "--data", ids, "-o", tmp_path / "o", "--format",
                           "onnx")
    assert code == 2 and "mixture-of-experts" in err and "calibrating" not in err
    assert not (tmp_path / "o").exists()


MORE_FAMILIES = {
    # MLA attention, one shared expert, a leading dense layer
    "deepseek_v3": dict(intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
    "qwen2_moe": dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      shared_expert_intermediate_size=64),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "phi3": dict(intermediate_size=128, pad_token_id=0),  # fused qkv_proj and gate_up_proj: Linears
}


@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_every_weight_but_routers_and_the_ignored_output_layer_is_planned_in_more_families(tmp_path, family):
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(family, vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, **MORE_FAMILIES[family])
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(tmp_path / "m")
    code, out, err = run_cli("config", "show", "w8a8", "--model", tmp_path / "m", "--json")
    assert code == 0, err
    cov = json.loads(out)["weights_quantized"]
    routers = [u for u in cov["unreachable"] if "Router" in u["module_type"]]
    assert routers == cov["unreachable"]
    assert len(routers) == sum(1 for i in range(2) if family != "phi3" and not (family == "deepseek_v3" and i == 0))
    head = 256 * 64  # w8a8 ignores lm_head
    gates = 2 * 64 if family == "qwen2_moe" else 0  # the shared experts' one-output gates: float, as routers
    assert cov["quantized"] + head + gates + sum(u["shape"][0] * u["shape"][1] for u in routers) == cov["parameters"]


def test_report_measures_each_expert_on_the_tokens_both_models_routed_to_it(tmp_path):
    """Quantization can route a token to other experts: an expert's cumulative error compares its float and
    quantized outputs row by row only for tokens both models sent it (the rest have no counterpart)."""
    from qtool.report import _common_rows

    before, now = torch.tensor([7, 2, 9, 4]), torch.tensor([4, 11, 7])
    rows_b, rows_n = _common_rows(before, now)
    assert before[rows_b].tolist() == now[rows_n].tolist() == [4, 7]
    assert _common_rows(torch.tensor([1]), torch.tensor([2])) is None
    checkpoint, ids = _saved(tmp_path, "qwen3_moe")
    code, _, err = run_cli("calibrate", checkpoint, "-c", "w4a16-block32", "--data", ids, "-o", tmp_path / "run",
                           "--quiet")
    assert code == 0, err
    code, out, err = run_cli("report", checkpoint, "-e", tmp_path / "run" / "encodings.json", "--data", ids, "--json")
    assert code == 0, err
    layers = {r["module"]: r for r in json.loads(out)["layers"]}
    experts = [r for n, r in layers.items() if ".experts." in n]
    assert len(experts) == 48
    for r in experts:  # 4-bit weights: tens of dB, below the isolated figure once earlier layers are quantized too
        assert 5 < r["sqnr_cumulative_db"] < 40 and 10 < r["sqnr_isolated_db"] < 40


@pytest.mark.parametrize("family,router", [("hunyuan_v1_moe", "model.layers.1.mlp.gate.wg"),
                                           ("llama4_text", "model.layers.1.feed_forward.router"),
                                           ("qwen3_moe", "model.layers.1.mlp.gate"),
                                           ("mixtral", "model.layers.1.mlp.gate"),
                                           # the shared expert's one-output gate (compressed-tensors wrote it
                                           # quantized, where vLLM builds a plain Linear; llama.cpp keeps it F32)
                                           ("qwen2_moe", "model.layers.1.mlp.shared_expert_gate"),
                                           # (its expert count lives in a sub-config, ffn_config: it was quantized)
                                           ("dbrx", "transformer.blocks.1.ffn.router.layer")])
def test_a_router_stays_float_unless_a_rule_names_it(family, router):
    """Hunyuan scores its experts with a plain Linear under mlp.gate, Llama 4 with a Linear subclass, Qwen3-MoE and
    Mixtral with a *TopKRouter holding a bare weight: float by default; a rule whose match names it quantizes it
    (a TopKRouter's name alone was "matches no module", naming the module as the nearest)."""
    from qtool.config import load_recipe, parse_recipe, recipe_file, resolve_plan

    extra = {"hunyuan_v1_moe": dict(num_experts=8, moe_intermediate_size=32, head_dim=16),
             "llama4_text": dict(num_local_experts=8, head_dim=16, intermediate_size_mlp=64,
                                 interleave_moe_layer_step=1),
             "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, head_dim=16),
             "mixtral": dict(num_local_experts=8, head_dim=16),
             "qwen2_moe": dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=64),
             "dbrx": {}}[family]
    if family == "dbrx":
        cfg = transformers.DbrxConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, max_seq_len=64,
                                      attn_config=dict(kv_n_heads=2, rope_theta=10000.0),
                                      ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2))
    else:
        cfg = transformers.AutoConfig.for_model(family, vocab_size=256, hidden_size=64, intermediate_size=32,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                num_experts_per_tok=2, **extra)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    plan = resolve_plan(load_recipe(recipe_file("w8a16")), model)
    assert not [q for q in plan.weights if q.module == router]
    attention = "norm_attn_norm.attn.Wqkv" if family == "dbrx" else "self_attn.q_proj"
    assert len([q for q in plan.weights if attention in q.module]) == 2  # the rest is quantized
    named = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n"
                         f"layers:\n  - match: '{router}'\n    weights: {{bitwidth: 8}}\n")
    assert [q.module for q in resolve_plan(named, model).weights if q.module == router] == [router]
    # a pattern that reaches it by wildcards alone leaves it float (a 4-bit router would be a silent change)
    wide = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n"
                        "layers:\n  - match: '*'\n    weights: {bitwidth: 4}\n")
    assert not [q for q in resolve_plan(wide, model).weights if q.module == router]
    # a type rule naming the router's own class opts it in; one naming Linear does not reach it; one naming no
    # class of the model matches nothing (every type rule counted as used once a router was met: no error)
    own = type(dict(model.named_modules())[router]).__name__
    typed = "version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\nlayers:\n  - type: %s\n"
    routers = [q.module for q in resolve_plan(parse_recipe(typed % own), model).weights if q.module == router]
    assert routers == ([] if own == "Linear" else [router]), own
    assert not [q for q in resolve_plan(parse_recipe(typed % "Linear"), model).weights if q.module == router]
    from qtool.errors import ConfigError

    with pytest.raises(ConfigError, match=r"layers\[0\].*NoSuchRouter.* matches no module"):
        resolve_plan(parse_recipe(typed % "NoSuchRouter"), model)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_eval_of_per_token_activations_compares_what_compressed_tensors_runs(tmp_path, family):
    """compressed-tensors' dynamic "token" strategy takes one range per index of an input's first two dimensions:
    Qwen2-MoE's shared expert reads a 2-D input (its tokens flattened), one range in all; DeepSeek's kv_b_proj a 4-D
    one (batch x 1 x tokens x rank), one range per sequence (vLLM: per token). eval's fake-quant model does the
    same there: FP8 dynamic was a false export fault (KL 6e-4, 9e-3)."""
    from tests.test_gguf_families import _tiny

    checkpoint = _tiny(tmp_path / "m", family)
    ids = torch.randint(1, 200, (8, 32), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    code, _, err = run_cli("quantize", checkpoint, "-c", "fp8-dynamic", "--format", "compressed-tensors", "-o",
                           tmp_path / "ct", "--quiet")
    assert code == 0, err
    code, out, err = run_cli("eval", tmp_path / "ct", "--data", tmp_path / "ids.safetensors", "--seq-len", "32",
                             "--num-samples", "4", "--generate", "0", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["export_fault"] is None and res["export_gap"]["kl_mean"] < 1e-6, res["export_gap"]
    assert any("one for a 2-D input" in n for n in res["notes"]), res["notes"]


def test_experts_quantized_apart_are_named_in_the_export_and_by_eval(tmp_path):
    """One expert left float beside its quantized siblings: transformers (and vLLM) hold a layer's experts fused
    with one scheme. The export warned of nothing, and eval's error was transformers' "For details look at the
    above report!" with no report shown."""
    checkpoint, ids = _saved(tmp_path, "qwen3_moe")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 32}\n"
                      "  activations: null\nlayers:\n  - match: 're:model\\.layers\\.1\\.mlp\\.experts\\.2\\..*'\n"
                      "    weights: null\nignore: [lm_head]\n")
    code, out, err = run_cli("quantize", checkpoint, "-c", recipe, "-o", tmp_path / "ct", "--format",
                             "compressed-tensors", "--json", "--quiet")
    assert code == 0, err
    fused = [w for w in json.loads(out)["export_warnings"] if "run fused" in w]
    assert fused and all("model.layers.1.mlp.experts.2." in w and "(float)" in w for w in fused), fused
    code, _, err = run_cli("eval", tmp_path / "ct", "--data", ids, "--seq-len", 32, "--num-samples", 4,
                           "--generate", 0)
    assert code == 2 and "transformers cannot load its experts" in err and "above report" not in err, err


def test_eval_of_int8_experts_names_the_runtimes_limit(tmp_path):
    """An int-quantized (8-bit) MoE directory: transformers' expert fusion finds no tensor to concatenate, and eval
    said "cannot load it (... look at the `CONVERSION` entries of the above report!)", a report it had hidden,
    for the README's own W8A8 example on every MoE family (docs/formats.md names the limit)."""
    checkpoint, ids = _saved(tmp_path, "qwen3_moe")
    code, out, err = run_cli("quantize", checkpoint, "-c", "w8a8-dynamic", "-o", tmp_path / "ct", "--format",
                             "compressed-tensors", "--quiet", "--json")
    assert code == 0, err
    assert [w for w in json.loads(out)["export_warnings"] if "transformers cannot reload" in w] == [
        "transformers cannot reload this directory's 48 per-expert layers into its fused experts: " + _INT8_LIMIT +
        "; qtool eval refuses the transformers reload in one line"]
    code, _, err = run_cli("eval", tmp_path / "ct", "--data", ids, "--seq-len", 32, "--num-samples", 4,
                           "--generate", 0)
    assert code == 2 and "above report" not in err, err
    assert f"transformers cannot reload its experts as the file holds them: {_INT8_LIMIT}" in err
    assert "measuring the float model" not in err  # (said before any model runs)


_INT8_LIMIT = ("its expert stacking finds no int-quantized (8-bit) gate/up tensors to stack (llm-compressor's W8A8 "
               "MoE output fails alike; --ct-8bit-format pack-quantized writes 8-bit weights it reads)")


@pytest.mark.parametrize("rule,fmt,said", [
    # gate/up (w1/w3) in 4-bit blocks, down (w2) in 8 bits per channel: it loaded them wrongly (top-1 agreement
    # 0.37) with exit 0, and eval blamed the file ("not a whole export", or an export fault of KL 0.1)
    ("'*.w2'\n    weights: {bitwidth: 8, granularity: per_channel}", "pack-quantized", "quantized to 4-bit and 8-bit"),
    ("'*.w2'\n    weights: {bitwidth: 8, granularity: per_channel}", "int-quantized", "no int-quantized (8-bit)"),
    # experts left float in an integer file: torch.cat of nothing, said by nobody
    ("'*.experts.*'\n    weights: null", "pack-quantized", "left float in an integer file"),
    # two groups it stacks exactly (attention and experts apart; down and gate/up of one width): nothing to say
    ("'*.self_attn.*'\n    weights: {bitwidth: 8, granularity: per_channel}", "pack-quantized", None),
    ("'*.w2'\n    weights: {bitwidth: 4, granularity: per_channel}", "pack-quantized", None),
])
def test_experts_transformers_cannot_stack_are_said_by_the_export_and_by_eval_before_any_model_runs(
        tmp_path, rule, fmt, said):
    checkpoint, ids = _saved(tmp_path, "mixtral")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 16}\n"
                      f"  activations: null\nlayers:\n  - type: Embedding\n    weights: null\n  - match: {rule}\n"
                      "ignore: [lm_head]\n")
    code, out, err = run_cli("quantize", checkpoint, "-c", recipe, "-o", tmp_path / "ct", "--format",
                             "compressed-tensors", "--ct-8bit-format", fmt, "--json", "--quiet")
    assert code == 0, err
    warned = [w for w in json.loads(out)["export_warnings"] if "transformers cannot reload" in w]
    assert len(warned) == (said is not None) and all(said in w for w in warned), out
    if said is None:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct").eval()
        fake_quant = qtool.load_calibrated(str(checkpoint), str(tmp_path / "ct" / "calibration" / "encodings.json"))
        x = torch.randint(1, 200, (1, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.allclose(reloaded(x).logits, fake_quant(x).logits, atol=1e-4)
        return
    code, _, err = run_cli("eval", tmp_path / "ct", "--data", ids, "--seq-len", 32, "--num-samples", 4,
                           "--generate", 0)
    assert code == 2 and "transformers cannot reload its experts as the file holds them: its " in err and said in err
    assert "measuring the float model" not in err and "not a whole export" not in err


def test_patterns_may_name_experts_by_the_checkpoints_names(tmp_path):
    """Mixtral's experts are mlp.experts.<e>.w1 in memory, block_sparse_moe.experts.<e>.w1 in the checkpoint, the
    encodings and the export: an ignore written with the names qtool itself writes matched nothing, silently, and
    a layers rule with them was "matches no module"."""
    from qtool.config import parse_recipe, resolve_plan
    from qtool.model.hf import meta_skeleton

    checkpoint, _ = _saved(tmp_path, "mixtral")
    model = meta_skeleton(checkpoint)
    text = ("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n"
            "layers:\n  - match: 're:model\\.layers\\.0\\.block_sparse_moe\\.experts\\.\\d+\\.w2'\n"
            "    weights: {bitwidth: 4}\n"
            "ignore: [lm_head, 're:model\\.layers\\.1\\.block_sparse_moe\\.experts\\..*']\n")
    plan = resolve_plan(parse_recipe(text), model)
    rows = {q.module: q for q in plan.weights}
    assert not [m for m in rows if m.startswith("model.layers.1.mlp.experts.")]
    # the routers a plan lists as unreachable go by those names too (they read model.layers.0.mlp.gate.weight)
    assert [u[0] for u in plan.coverage.unreachable] == [f"model.layers.{i}.block_sparse_moe.gate.weight"
                                                         for i in range(2)]
    # and an ignore naming them so, as the warning asks, acknowledges them
    acknowledged = text.replace("ignore: [lm_head, ", "ignore: [lm_head, 'model.layers.*.block_sparse_moe.gate', ")
    assert not resolve_plan(parse_recipe(acknowledged), model).coverage.unreachable
    assert sorted(m for m in rows if m.startswith("model.layers.0.mlp.experts.")) == sorted(
        f"model.layers.0.mlp.experts.{e}.{w}" for e in range(8) for w in ("w1", "w2", "w3"))
    assert {m: q.bitwidth for m, q in rows.items() if ".experts.0." in m} == {
        "model.layers.0.mlp.experts.0.w1": 8, "model.layers.0.mlp.experts.0.w2": 4,
        "model.layers.0.mlp.experts.0.w3": 8}


@pytest.mark.parametrize("family,warned", [("granitemoe", True), ("gpt_oss", True), ("qwen3_moe", False)])
def test_the_export_says_where_transformers_cannot_read_per_expert_tensors(tmp_path, family, warned):
    """transformers' gpt-oss and GraniteMoE models read their experts fused only: from_pretrained loaded the
    per-expert file with random experts (logits off, top-1 agreement 0.08-0.7) and the export said nothing."""
    checkpoint, _ = _saved(tmp_path, family)
    code, out, err = run_cli("quantize", checkpoint, "-c", "w4a16-block32", "-o", tmp_path / "ct", "--format",
                             "compressed-tensors", "--json")
    assert code == 0, err
    said = [w for w in json.loads(out)["export_warnings"] if "reads its experts fused only" in w]
    assert bool(said) is warned, out
    assert not said or said[0].startswith(f"transformers' {'GraniteMoE' if family == 'granitemoe' else 'gpt-oss'} "
                                          "model reads its experts fused only: from_pretrained loads this "
                                          "directory's 48 per-expert layers as randomly initialized experts")


def test_a_granitemoe_compressed_tensors_file_names_its_experts_as_vllm_reads_them(tmp_path):
    """vLLM's GraniteMoE loader splits input_linear into Mixtral's per-expert w1 (gate rows) and w3 (up rows),
    output_linear into w2, and reads a per-expert file under those names only: the file named them gate_proj /
    up_proj / down_proj (gpt-oss's), which neither vLLM nor transformers read."""
    import re

    unpack_from_int32 = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers").unpack_from_int32
    checkpoint, _ = _saved(tmp_path, "granitemoe")
    recipe = tmp_path / "two.yaml"  # (two settings: the config groups name their modules, not "Linear")
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 32}\n"
                      "  activations: null\nlayers:\n  - match: '*.self_attn.*'\n    weights: {bitwidth: 8}\n"
                      "  - match: '*.experts.0.gate_proj'\n    weights: {bitwidth: 8}\nignore: [lm_head]\n")
    code, out, err = run_cli("quantize", checkpoint, "-c", recipe, "-o", tmp_path / "ct", "--format",
                             "compressed-tensors", "--json")
    assert code == 0, err
    summary = json.loads(out)
    said = " ".join(summary["export_warnings"])
    assert "experts.0.w1" in said and "gate_proj" not in said, said  # (the fused-mix warning names the file's)
    for name in summary["quantized_layers"] + list(summary["names"].values()):
        assert not re.search(r"experts\.\d+\.(gate|up|down)_proj", name), name
    t = _keys(tmp_path / "ct")
    experts = {k for k in t if ".experts." in k}
    assert experts and all(re.fullmatch(r"model\.layers\.\d\.block_sparse_moe\.experts\.\d\.w[123]\.weight(_packed|"
                                        r"_scale|_shape)?", k) for k in experts), sorted(experts)[:6]
    fused = _keys(checkpoint)
    halves = {"w1": lambda e, w: w[e, :32], "w3": lambda e, w: w[e, 32:]}  # (input_linear: [E, 2I, H], gate first)
    for e in (1, 5):  # (expert 0's gate is 8-bit here)
        for leaf, part in halves.items():
            base = f"model.layers.1.block_sparse_moe.experts.{e}.{leaf}."
            codes = unpack_from_int32(t[base + "weight_packed"], 4, torch.Size(t[base + "weight_shape"].tolist()))
            weight = codes.float() * t[base + "weight_scale"].repeat_interleave(32, dim=1).float()
            source = part(e, fused["model.layers.1.block_sparse_moe.input_linear.weight"])
            other = halves["w3" if leaf == "w1" else "w1"](
                e, fused["model.layers.1.block_sparse_moe.input_linear.weight"])
            err_own, err_other = (weight - source).abs().max(), (weight - other).abs().max()
            assert err_own <= t[base + "weight_scale"].max() / 2 + 1e-6 < err_other, (leaf, e, err_own, err_other)
        down = f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight_shape"
        assert t[down].tolist() == list(fused["model.layers.1.block_sparse_moe.output_linear.weight"][e].shape)
    config = json.loads((tmp_path / "ct/config.json").read_text())["quantization_config"]
    targets = [t for g in config["config_groups"].values() for t in g["targets"]]
    assert any("experts\\.0\\.w1" in t for t in targets) and not any("_proj$" in t and "experts" in t
                                                                     for t in targets), targets


def test_an_nvfp4_moe_export_says_transformers_reloads_its_experts_wrongly(tmp_path):
    """The export's only transformers note said to load NVFP4 in bfloat16, which on a mixture of experts gives a
    wrong model (top-1 agreement 0.000): transformers multiplies the experts' global scale instead of dividing."""
    checkpoint, _ = _saved(tmp_path, "qwen3_moe")
    code, out, err = run_cli("quantize", checkpoint, "-c", "nvfp4a16", "-o", tmp_path / "ct", "--format",
                             "compressed-tensors", "--json")
    assert code == 0, err
    assert any(w.startswith("transformers reloads NVFP4 experts wrongly") for w in json.loads(out)["export_warnings"])


def test_smoothquants_default_mappings_leave_a_norm_feeding_a_router_alone(tmp_path):
    """w8a8-smoothquant on a mixture of experts folded the post-attention norm's scale into the experts, which the
    router reads too: the plan passed, calibration ran, then stopped with a line naming every expert (836
    characters for 8 experts). The attention and each expert's up -> down are smoothed; the norm is left, said."""
    checkpoint, ids = _saved(tmp_path, "qwen3_moe")
    code, out, err = run_cli("calibrate", checkpoint, "-c", "w8a8-smoothquant", "--data", ids, "-o", tmp_path / "sq",
                             "--json")
    assert code == 0, err
    said = [w for w in json.loads(out)["warnings"] if "feeding mixture-of-experts layers left unsmoothed" in w]
    assert len(said) == 1 and "2 norm(s)" in said[0] and "post_attention_layernorm" in said[0], said
    groups = json.loads((tmp_path / "sq" / "manifest.json").read_text())["smoothquant"]["groups"]
    assert not any("post_attention_layernorm" in g["smooth"] for g in groups)
    assert sum("input_layernorm" in g["smooth"] for g in groups) == 2
    assert sum(g["smooth"].endswith(".up_proj") and ".experts." in g["smooth"] for g in groups) == 16


def test_another_fused_model_saved_in_the_same_directory_is_read_as_itself(tmp_path):
    """In one process, a second job on a directory where another GraniteMoE (4 experts, not 2) was saved read the
    first model's expert slices: 'has no tensor ...experts.2.gate_proj.weight', or an IndexError."""
    import shutil

    from qtool.pipeline import CalibrateOptions, run_quantize

    for experts in (2, 4):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config("granitemoe", experts=experts)).eval()
        shutil.rmtree(tmp_path / "m", ignore_errors=True)
        model.save_pretrained(tmp_path / "m")
        run_quantize(str(tmp_path / "m"), "w8a16", str(tmp_path / f"q{experts}"), CalibrateOptions())
        names = json.loads((tmp_path / f"q{experts}/calibration/encodings.json").read_text())["quantizers"]
        assert sum(".experts." in q["name"] and q["name"].endswith("gate_proj.weight") for q in names) == 2 * experts


def test_compressed_tensors_targets_name_the_layers_its_tensors_name(tmp_path):
    """transformers 5 loads Mixtral's block_sparse_moe.experts.<e>.w1 as mlp.experts: a file of two settings named
    its expert layers mlp.experts.* in config_groups' targets and block_sparse_moe.experts.* in its tensors, so 48 of
    56 targets matched no tensor (a runtime reading the file by its config found no scheme for them; inspect read
    them as '?')."""
    import re

    checkpoint, _ = _saved(tmp_path, "mixtral")
    recipe = tmp_path / "two.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 16}\n"
                      "  activations: null\nlayers:\n  - match: 're:.*self_attn.*'\n"
                      "    weights: {bitwidth: 8, granularity: per_channel}\nignore: [lm_head, "
                      "'re:.*layers\\.1\\.block_sparse_moe\\.experts\\.2\\..*']\n")
    code, _, err = run_cli("quantize", checkpoint, "-c", recipe, "-o", tmp_path / "ct", "--format",
                           "compressed-tensors", "--quiet")
    assert code == 0, err
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        layers = {k.rsplit(".", 1)[0] for k in f.keys()}
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    targets = [t[3:] for g in config["config_groups"].values() for t in g["targets"]]
    assert len(targets) == 8 + 2 * 8 * 3 - 3 and all(any(re.fullmatch(t, n) for n in layers) for t in targets)
    assert "model.layers.1.block_sparse_moe.experts.2.w1" in config["ignore"]
    assert all(n in layers for n in config["ignore"] if n != "lm_head")


def test_eval_of_experts_the_export_quantized_apart_names_the_file_not_the_runtime(tmp_path):
    """One expert ignored: the export warned that no runtime loads the file, then eval called it "a limit of the
    runtime, not the file"."""
    checkpoint, ids = _saved(tmp_path, "mixtral")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 16}\n"
                      "  activations: null\nignore: [lm_head, 're:.*\\.experts\\.3\\..*']\n")
    code, _, err = run_cli("quantize", checkpoint, "-c", recipe, "-o", tmp_path / "ct", "--format",
                           "compressed-tensors")
    assert code == 0 and "neither loads it" in err, err
    code, _, err = run_cli("eval", tmp_path / "ct", "--data", ids, "--seq-len", 32, "--num-samples", 4, "--generate",
                           0)
    assert code == 2 and "transformers cannot load its experts, which the export quantized apart (model.layers.0." \
        "block_sparse_moe.experts.0.w1 (4-bit int group) and model.layers.0.block_sparse_moe.experts.3.w1 (float)); " \
        "calibrate a projection's experts alike" in err and "limit of the runtime" not in err, err


@pytest.mark.parametrize("family,pattern,named,hint", [
    ("granitemoe", "*.input_linear", "model.layers.0.block_sparse_moe.input_linear",
     "'*.experts.*.gate_proj', '*.experts.*.up_proj'"),
    ("granitemoe", "model.layers.1.block_sparse_moe.output_linear.weight",
     "model.layers.1.block_sparse_moe.output_linear.weight", "'model.layers.1.block_sparse_moe.experts.*.down_proj'"),
    ("gpt_oss", "*.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj",
     "'*.experts.*.gate_proj', '*.experts.*.up_proj'"),
    # (a pattern that also names other modules: those left the plan, the experts did not)
    ("granitemoe", r"re:.*\.(input_linear|o_proj)$", "model.layers.0.block_sparse_moe.input_linear",
     "'*.experts.*.gate_proj', '*.experts.*.up_proj'"),
    # (transformers' own fused name, Mixtral's experts being w1/w3/w2)
    ("mixtral", "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.down_proj",
     "'model.layers.0.mlp.experts.*.w2'")])
def test_ignoring_the_checkpoints_fused_expert_tensors_says_how_to_name_them(tmp_path, family, pattern, named, hint):
    """The names a user sees on disk (GraniteMoE's input_linear, gpt-oss's experts.gate_up_proj) name no module of
    the split experts: the pattern was silently no match and every expert stayed 4-bit (the exact name was told
    "did you mean ...router?")."""
    checkpoint, _ = _saved(tmp_path, family)
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, "
                                     f"block_size: 32}}\n  activations: null\nignore: [lm_head, '{pattern}']\n")
    code, _, err = run_cli("config", "show", tmp_path / "r.yaml", "--model", checkpoint)
    assert code == 2 and error_lines(err) == [
        f"error: {tmp_path / 'r.yaml'}: ignore[1]: {pattern!r} names {named}, fused experts qtool splits into one "
        f"layer per expert and projection, so it keeps nothing float: {hint} name them (pass --allow-unmatched to "
        "make this a warning)"], err


def test_a_dense_recipes_ignore_patterns_stay_allowed_on_mixtrals_w1_w2_w3_experts(tmp_path):
    """Mixtral's experts are w1/w3/w2: '*.up_proj' and '*.down_proj' (a Llama recipe's) name nothing there, as
    always; a first version of the fused-name check took them for the experts' fused tensors and refused them."""
    checkpoint, _ = _saved(tmp_path, "mixtral")
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, "
                                     "block_size: 32}\n  activations: null\nignore: [lm_head, '*.up_proj', "
                                     "'*.down_proj']\n")
    code, _, err = run_cli("config", "show", tmp_path / "r.yaml", "--model", checkpoint)
    assert code == 0, err


def test_a_gguf_recipe_leaving_the_last_expert_float_is_refused_before_calibration(tmp_path):
    """llama.cpp stacks a projection's experts into one tensor of one type. The plan-time check counted a layer's
    experts by the highest index with a row, so ignoring the last expert passed it, and the export refused the
    stack only after the whole calibration (hours on a real model)."""
    from tests.test_gguf_families import _tiny

    checkpoint = _tiny(tmp_path / "m", "mixtral")
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults: {weights: {gguf_type: q4_0}, activations: null}\n"
                                     "layers: [{type: Embedding, weights: {gguf_type: q8_0}}]\n"
                                     "ignore: [lm_head, 're:.*\\.experts\\.7\\..*']\n")
    code, _, err = run_cli("quantize", checkpoint, "-c", tmp_path / "r.yaml", "-f", "gguf", "-o", tmp_path / "q")
    assert code == 2 and "calibrating" not in err and not (tmp_path / "q").exists(), err
    assert error_lines(err)[-1] == (
        "error: model.layers.0.mlp.experts.*.w1: GGUF stores a projection's experts as one tensor of one type, "
        "and the recipe quantizes some and leaves expert(s) 7 float (ignored, or a rule without weights): one rule "
        "for every expert of a projection"), err


@pytest.mark.parametrize("model_type,refused", [("qwen3_moe", True), ("my_remote_moe", False), ("gpt_oss", False)])
def test_eval_refuses_the_transformers_reload_only_where_the_export_warned(tmp_path, model_type, refused):
    """The export warns for families whose transformers model stacks per-expert tensors; a family qtool does not
    know (remote code with real per-expert Linears) was refused by eval though its export said nothing."""
    from qtool.errors import UsageError
    from qtool.evaluation.runtimes import refuse_known_expert_limit

    save_file({"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(4, 4)}, tmp_path / "model.safetensors")
    def group(bits, target):
        return {"format": "pack-quantized", "weights": {"num_bits": bits}, "targets": [target]}

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "quantization_config": {
        "format": "pack-quantized", "config_groups": {"group_0": group(4, r"re:^m\.experts\.0\.up_proj$"),
                                                      "group_1": group(8, r"re:^m\.experts\.0\.down_proj$")}}}))
    if refused:
        with pytest.raises(UsageError, match="quantized to 4-bit and 8-bit"):
            refuse_known_expert_limit(tmp_path)
    else:
        refuse_known_expert_limit(tmp_path)


def test_shared_experts_and_malformed_groups_are_no_routed_experts_of_two_widths():
    """DeepSeek's shared_experts is a plain MLP transformers loads as written: 8-bit shared experts beside 4-bit
    routed ones were said not to reload (they reload exactly); a group whose weights are not an object was exit 3."""
    from qtool.export.ct_config import transformers_expert_limit

    def group(bits, target, weights=None):
        return {"format": "pack-quantized", "weights": weights or {"num_bits": bits}, "targets": [target]}

    shared = {"config_groups": {"a": group(4, r"re:^model\.layers\.1\.mlp\.experts\.0\.up_proj$"),
                                "b": group(8, r"re:^model\.layers\.1\.mlp\.shared_experts\.up_proj$")}}
    assert transformers_expert_limit(shared) is None
    routed = {"config_groups": {"a": group(4, r"re:^model\.layers\.1\.mlp\.experts\.0\.up_proj$"),
                                "b": group(8, r"re:^model\.layers\.1\.mlp\.experts\.0\.down_proj$")}}
    assert "quantized to 4-bit and 8-bit" in transformers_expert_limit(routed)
    odd = {**group(8, r"re:^m\.experts\.1\.up$"), "weights": 8}
    malformed = {"config_groups": {"a": group(4, r"re:^m\.experts\.0\.up$"), "b": odd}}
    assert transformers_expert_limit(malformed) is None


def qwen3_moe_from_config():
    """A --model-class factory: the tiny Qwen3-MoE of :func:`_config`, its experts fused (transformers 5's)."""
    return transformers.AutoModelForCausalLM.from_config(_config("qwen3_moe"))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", "pickled.pt"])
def test_a_state_dicts_fused_experts_are_quantized_one_by_one_as_a_directorys_are(tmp_path, suffix):
    """A state dict of a fused-experts model (the module's own 3-D ``experts.gate_up_proj``) built by --model-class
    left its experts fused: 45.9 % of the weights stayed float, and the warning's advice (list them under ignore)
    was refused as matching no module. The experts are now split as a Hugging Face directory's are, and the export
    holds what the directory's export holds."""
    import argparse

    checkpoint, _ = _saved(tmp_path, "qwen3_moe")
    state = {k: v.contiguous() for k, v in qwen3_moe_state(checkpoint).items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    sd = tmp_path / f"moe{suffix}"
    if suffix == ".safetensors":
        save_file(state, sd)
    else:  # (a training checkpoint's objects beside it need --trust-pickle, which every read must honour: review)
        torch.save(state if suffix == ".pt" else {"state_dict": state, "args": argparse.Namespace(lr=1)}, sd)
    trust = ["--trust-pickle"] if suffix == "pickled.pt" else []
    factory = "tests.test_experts:qwen3_moe_from_config"
    code, out, err = run_cli("quantize", sd, "--model-class", factory, "-c", "w4a16-block32", "-o", tmp_path / "q",
                             "--json", "-q", *trust)
    assert code == 0, err
    assert not [w for w in json.loads(out)["warnings"] if "have no quantizer" in w]
    code, _, err = run_cli("quantize", checkpoint, "-c", "w4a16-block32", "-o", tmp_path / "hf", "-q")
    assert code == 0, err
    ours, theirs = read_integer_export(tmp_path / "q"), read_integer_export(tmp_path / "hf")
    experts = [k for k in theirs if ".experts." in k]
    assert len(experts) == 2 * 8 * 3
    for k in experts:
        assert torch.equal(ours[k], theirs[k]), k
    if suffix != ".safetensors":
        return
    # qtool export of those encodings without the factory: no name matched, and the line blamed the encodings
    code, _, err = run_cli("export", sd, "-e", tmp_path / "q/calibration/encodings.json", "-o", tmp_path / "e", "-q")
    assert code == 2 and error_lines(err) == [
        f"error: {sd}: holds its experts fused (model.layers.0.mlp.experts.down_proj), and the encodings name them "
        "one by one (model.layers.0.mlp.experts.0.gate_proj.weight): pass the --model-class that builds the model "
        f"(the calibration's was {factory}), which splits them"], err
    # a factory that prints keeps stdout to the one JSON object
    code, out, err = run_cli("export", sd, "-e", tmp_path / "q/calibration/encodings.json", "-o", tmp_path / "e",
                             "--model-class", "tests.test_experts:qwen3_moe_that_prints", "--json")
    assert code == 0 and json.loads(out)["ok"] and "building the MoE" in err, err


def qwen3_moe_that_prints():
    print("building the MoE")
    return qwen3_moe_from_config()


def qwen3_moe_state(checkpoint):
    """The state dict of ``checkpoint``'s model as transformers holds it in memory (experts fused)."""
    return dict(transformers.AutoModelForCausalLM.from_pretrained(checkpoint).state_dict())


def test_onnx_export_refuses_a_state_dicts_experts_before_calibrating_and_from_its_encodings(tmp_path):
    """No config.json counts the experts of a state dict --model-class builds: quantize traced the model, which
    failed on the routing's ops or kept one batch's routing in the graph."""
    checkpoint, ids = _saved(tmp_path, "qwen3_moe")
    sd = tmp_path / "moe.safetensors"
    save_file({k: v.contiguous() for k, v in qwen3_moe_state(checkpoint).items()}, sd)
    factory = "tests.test_experts:qwen3_moe_from_config"
    code, _, err = run_cli("quantize", sd, "--model-class", factory, "-c", "w8a16", "--data", ids, "-o",
                           tmp_path / "o", "--format", "onnx")
    assert code == 2 and "calibrating" not in err and error_lines(err)[-1] == (
        "error: ONNX export of mixture-of-experts layers (model.layers.0.mlp.experts and 1 more) is not supported (a "
        "traced graph would keep one batch's routing); use --format qtool or aimet"), err
    code, _, err = run_cli("calibrate", sd, "--model-class", factory, "-c", "w8a16", "-o", tmp_path / "c", "-q")
    assert code == 0, err
    code, _, err = run_cli("export", sd, "-e", tmp_path / "c/encodings.json", "--model-class", factory, "--format",
                           "onnx", "--data", ids, "-o", tmp_path / "o", "-q")
    assert code == 2 and "ONNX export of mixture-of-experts layers" in err, err
    assert not (tmp_path / "o").exists()
