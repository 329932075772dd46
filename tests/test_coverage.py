"""Nothing is left float without a word: the plan counts the weight parameters it quantizes, and names the large
weights no quantizer reaches (transformers 5's fused mixture-of-experts tensors)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from qtool.config import load_recipe, parse_recipe, recipe_file, resolve_plan
from qtool.coverage import weight_coverage
from tests.helpers import run_cli

transformers = pytest.importorskip("transformers")


def _qwen3_moe():
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        head_dim=16)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def test_fused_experts_are_named_and_counted_not_silently_left_float():
    model = _qwen3_moe()
    plan = resolve_plan(load_recipe(recipe_file("w4a16-block32")), model)
    cov = plan.coverage
    weights = {n: p for n, p in model.named_parameters() if p.dim() >= 2}
    assert cov.total == sum(p.numel() for p in weights.values())
    # every Linear of this model (the recipe quantizes lm_head too, not the embedding)
    linear = sum(p.numel() for n, p in weights.items() if "self_attn" in n or n == "lm_head.weight")
    assert cov.quantized == linear and 0.2 < cov.share < 0.3
    fused = {f"model.layers.{i}.mlp.experts.{k}" for i in range(2) for k in ("gate_up_proj", "down_proj")}
    routers = {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
    unreachable = {n for n, _, _ in cov.unreachable}
    # the embedding and lm_head are the recipe's choice (their types can be quantized): not unreachable
    assert unreachable == fused | routers
    assert {n for n, _, _ in cov.large()} == fused  # routers are small: counted, not warned about
    [warning] = [w for w in plan.warnings if "have no quantizer" in w]
    assert "4 weight tensor(s)" in warning and "Qwen3MoeExperts" in warning
    assert f"{100 * sum(weights[n].numel() for n in fused) / cov.total:.1f} %" in warning


def test_ignoring_the_experts_acknowledges_them():
    model = _qwen3_moe()
    recipe = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n"
                          "ignore: ['lm_head', 're:.*mlp.experts']\n")
    plan = resolve_plan(recipe, model)
    assert not [w for w in plan.warnings if "have no quantizer" in w]
    assert {n for n, _, _ in plan.coverage.unreachable} == {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}


def test_a_dense_model_is_covered_and_tied_weights_count_once():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    plan = resolve_plan(load_recipe(recipe_file("w8a8")), model)
    embed = 256 * 64
    total = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2)  # (named_parameters: tied once)
    assert plan.coverage.total == total and plan.coverage.unreachable == ()
    assert plan.coverage.quantized == total  # w8a8 quantizes the embedding, which lm_head shares
    assert not [w for w in plan.warnings if "have no quantizer" in w]
    recipe = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n"
                          "ignore: ['lm_head', 'model.embed_tokens']\n")
    plan = resolve_plan(recipe, model)
    assert plan.coverage.quantized == total - embed and plan.coverage.unreachable == ()


def test_coverage_counts_a_parameter_shared_by_two_modules_once():
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.weight = a.weight
    model = torch.nn.Sequential(a, b)
    cov = weight_coverage(model, {"0"}, {"0", "1"}, lambda name: False)
    assert (cov.total, cov.quantized, cov.unreachable) == (16, 16, ())


def test_the_plan_line_config_show_and_calibrate_json_say_what_is_quantized(tmp_path):
    """Experts qtool cannot split (JetMoE's ParallelExperts, with attention experts beside the MLP's) stay fused
    and float, and qtool names them; experts it can split are quantized one by one whether the checkpoint stores
    them per expert or fused (tests/test_experts.py)."""
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        "jetmoe", vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, kv_channels=16, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(tmp_path / "m")
    fused = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 3)
    weights = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    code, out, err = run_cli("config", "show", "w4a16-block32", "--model", tmp_path / "m", "--json")
    assert code == 0, err
    shown = json.loads(out)["weights_quantized"]
    assert shown["parameters"] == weights and shown["quantized"] <= weights - fused
    assert {u["module_type"] for u in shown["unreachable"]} == {"JetMoeParallelExperts"}
    assert any("have no quantizer" in w for w in json.loads(out)["warnings"])
    code, out, err = run_cli("config", "show", "w4a16-block32", "--model", tmp_path / "m")
    assert code == 0 and "weights quantized: " in out and "have no quantizer" in err
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    code, out, err = run_cli("calibrate", tmp_path / "m", "-c", "w8a16", "--data", tmp_path / "ids.safetensors",
                             "-o", tmp_path / "run", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["weights_quantized"]["quantized"] <= weights - fused
    assert "plan: " in err and "weights quantized: " in err
    manifest = json.loads((tmp_path / "run/manifest.json").read_text())
    assert any("mlp.input_linear.weight" in w for w in manifest["warnings"])


def test_a_tied_weight_counts_as_quantized_through_any_module_that_holds_it():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    recipe = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n"
                          "layers:\n  - type: Embedding\n    weights: null\n")
    plan = resolve_plan(recipe, model)
    assert "lm_head" in {q.module for q in plan.weights}  # the embedding's table, quantized as lm_head
    assert plan.coverage.quantized == plan.coverage.total and plan.coverage.share == 1.0


def test_gpt2_conv1d_layers_are_named_and_a_position_table_is_not():
    """transformers' GPT-2 keeps its projections in its own Conv1D class (not torch's Conv1d), which no recipe
    type reaches: a true warning. Its position table wpe is an Embedding; a table held as a bare parameter with a
    leading 1 (a ViT's position embeddings) is added to activations, and is not named."""
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                                                n_positions=64))
    plan = resolve_plan(load_recipe(recipe_file("w8a8")), gpt2)
    [warning] = [w for w in plan.warnings if "have no quantizer" in w]
    assert "(Conv1D)" in warning and "8 weight tensor(s)" in warning
    vit_like = torch.nn.Module()
    vit_like.proj = torch.nn.Linear(64, 64)
    vit_like.position_embeddings = torch.nn.Parameter(torch.zeros(1, 197, 64))  # 75 % of this model's weights
    plan = resolve_plan(load_recipe(recipe_file("w8a16")), vit_like)
    assert [n for n, _, _ in plan.coverage.unreachable] == ["position_embeddings"]
    assert not [w for w in plan.warnings if "have no quantizer" in w]


def test_sequential_on_a_model_it_cannot_walk_is_refused_before_the_plan_line(tmp_path):
    """GPT-2 under --sequential printed "plan: ... peak memory about 0 MB (sequential)", then the refusal."""
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=2,
                                                         n_positions=64)).save_pretrained(tmp_path / "gpt2")
    save_file({"input_ids": torch.randint(0, 256, (4, 16))}, tmp_path / "ids.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "gpt2", "-c", "w8a16", "--data", tmp_path / "ids.safetensors",
                           "--sequential", "-o", tmp_path / "o")
    assert code == 2 and "GPT2LMHeadModel is not one" in err and "plan:" not in err, err
    assert not (tmp_path / "o").exists()


def test_gpt2_is_a_causal_lm(tmp_path):
    """GPT2LMHeadModel is not named ...ForCausalLM: report and eval gave it an output cosine instead of perplexity
    and KL, refused --max-ppl-increase, and its text was cut into paragraphs instead of windows."""
    from qtool.model.load import causal_lm_class

    cfg = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    assert causal_lm_class(transformers.GPT2LMHeadModel(cfg)) and not causal_lm_class(transformers.GPT2Model(cfg))
    # a masked LM transformers' causal mapping lists is not one (XLM's MLM checkpoints), nor BERT's head unless a decoder
    xlm = transformers.XLMConfig(vocab_size=64, emb_dim=32, n_layers=1, n_heads=2)
    bert = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    assert not causal_lm_class(transformers.XLMWithLMHeadModel(xlm))
    assert not causal_lm_class(transformers.BertLMHeadModel(transformers.BertConfig(**bert)))
    assert causal_lm_class(transformers.BertLMHeadModel(transformers.BertConfig(**bert, is_decoder=True)))
    roberta = dict(bert, pad_token_id=1)
    assert not causal_lm_class(transformers.RobertaForCausalLM(transformers.RobertaConfig(**roberta)))
    assert causal_lm_class(transformers.RobertaForCausalLM(transformers.RobertaConfig(**roberta, is_decoder=True)))
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    save_file({"input_ids": torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids.safetensors")
    assert run_cli("calibrate", tmp_path / "gpt2", "-c", "w8a16", "-o", tmp_path / "o", "--quiet")[0] == 0
    code, out, err = run_cli("report", tmp_path / "gpt2", "-e", tmp_path / "o" / "encodings.json", "--data",
                             tmp_path / "ids.safetensors", "--max-ppl-increase", "50", "--json")
    assert code == 0 and json.loads(out)["end_to_end"]["perplexity_float"] > 1, err


def test_a_tied_table_warning_names_gguf_only_for_a_family_it_writes(tmp_path):
    """GPT-2's warning advised --format gguf, which then refused: model_type 'gpt2' has no GGUF export."""
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    assert run_cli("calibrate", tmp_path / "gpt2", "-c", "w8a16", "-o", tmp_path / "o", "--quiet")[0] == 0
    code, _, err = run_cli("export", tmp_path / "gpt2", "-e", tmp_path / "o/encodings.json", "-o", tmp_path / "x")
    assert code == 0 and "export with --format onnx, which stores the layer apart" in err and "gguf" not in err, err
