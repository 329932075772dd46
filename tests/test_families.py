"""Model families (qtool/families/): one file per architecture, found by the package, and what each says reaching
the paths that read it — SmoothQuant's defaults, rotations, GGUF's checks against what llama.cpp computes."""

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import error_lines, run_cli

transformers = pytest.importorskip("transformers")


def test_every_family_file_is_found_and_claims_its_own_model_types():
    from pathlib import Path

    import qtool.families as families

    files = {p.stem for p in Path(families.__file__).parent.glob("*.py")} - {"__init__", "base"}
    claimed = {f.__class__.__module__.rsplit(".", 1)[1] for f in families.FAMILIES.values()}
    assert claimed == files
    assert families.family_of("gemma3_text").gguf_arch == "gemma3"
    assert families.family_of("phi3").rms_norms == ("Phi3RMSNorm",)
    assert families.family_of("gpt2") is None and families.family_of(None) is None
    assert set(families.gguf_model_types()) >= {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                                                "qwen3_moe", "gemma3_text", "phi3"}


def _saved(tmp_path, family, **extra):
    torch.manual_seed(0)
    kw = {"gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, num_hidden_layers=2),
          "phi3": dict(pad_token_id=0, num_hidden_layers=2),
          "gpt_oss": dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, head_dim=16),
          "qwen2": dict(num_hidden_layers=2)}[family]
    cfg = transformers.AutoConfig.for_model(family, vocab_size=256, hidden_size=64, intermediate_size=64,
                                            num_attention_heads=4, num_key_value_heads=2, **{**kw, **extra})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(tmp_path / "m")
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    return tmp_path / "m", tmp_path / "ids.safetensors"


def test_smoothquant_folds_phi3s_norms_into_its_fused_projections(tmp_path):
    ckpt, ids = _saved(tmp_path, "phi3")
    code, out, err = run_cli("calibrate", ckpt, "-c", "w8a8-smoothquant", "--data", ids, "-o", tmp_path / "c",
                             "--quiet", "--json")
    assert code == 0, err
    groups = json.loads((tmp_path / "c" / "manifest.json").read_text())["smoothquant"]["groups"]
    # each norm folded into the fused projection it feeds (qtool refuses a fold that moves the float output)
    assert sorted((g["smooth"], tuple(g["balance"])) for g in groups) == sorted(
        [(f"model.layers.{i}.input_layernorm", (f"model.layers.{i}.self_attn.qkv_proj",)) for i in range(2)]
        + [(f"model.layers.{i}.post_attention_layernorm", (f"model.layers.{i}.mlp.gate_up_proj",)) for i in range(2)])


def test_gemma3_has_no_smoothquant_defaults_and_no_rotations_each_said_in_one_line(tmp_path):
    ckpt, ids = _saved(tmp_path, "gemma3_text")
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8-smoothquant", "--data", ids, "-o", tmp_path / "c",
                           "--quiet")
    assert code != 0 and len(error_lines(err)) == 1 and "(1 + w)" in err, err
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8-dynamic-rot", "--data", ids, "-o", tmp_path / "r",
                           "--quiet")
    assert code != 0 and len(error_lines(err)) == 1 and "Gemma3RMSNorm" in err, err
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("family,extra,says", [
    ("gemma3_text", dict(query_pre_attn_scalar=32), "query_pre_attn_scalar"),
    ("gemma3_text", dict(hidden_activation="gelu"), "hidden_activation"),
    # (llama.cpp's qwen2, llama, mistral... hard-code SiLU: a GELU model's file ran SiLU, written with exit 0)
    ("qwen2", dict(hidden_act="gelu"), "hidden_act is 'gelu', and llama.cpp's qwen2 computes silu / swish only"),
    ("gemma3_text", dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                           "sliding_attention"]), "layer_types"),
    ("phi3", dict(max_position_embeddings=8192, original_max_position_embeddings=4096,
                  rope_scaling={"rope_type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}),
     "longrope"),
    ("gpt_oss", dict(swiglu_limit=5.0), "swiglu_limit"),
    ("gpt_oss", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
])
def test_a_config_llama_cpp_would_compute_otherwise_is_refused_before_calibration(tmp_path, family, extra, says):
    from tests.test_gguf import _tiny_llama

    ckpt, ids = _saved(tmp_path, family, **extra)
    _tiny_llama(tmp_path / "tok", False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tmp_path / "tok" / f).exists():
            (ckpt / f).write_bytes((tmp_path / "tok" / f).read_bytes())
    code, _, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "-o", tmp_path / "q", "--format", "gguf",
                           "--quiet")
    assert code != 0 and len(error_lines(err)) == 1 and says in err, err
    assert not (tmp_path / "q").exists()


def test_gpt_oss_yarn_without_truncation_is_written_as_llama_cpps_converter_writes_it_and_said(tmp_path):
    """gpt-oss's own config (truncate: false) is a YaRN llama.cpp rounds otherwise: the file is written (as
    llama.cpp's converter's is) and the export says so."""
    from tests.test_gguf_families import _tiny

    ckpt = _tiny(tmp_path / "m", "gpt_oss", rope_parameters={
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64, "truncate": False})
    code, out, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "-o", tmp_path / "q", "--format", "gguf", "--json")
    assert code == 0, err
    [warning] = [w for w in json.loads(out)["export_warnings"] if "truncate" in w]
    assert "llama.cpp rounds the correction range" in warning
    import gguf

    fields = gguf.GGUFReader(tmp_path / "q" / "model.gguf").fields
    assert fields["gpt-oss.rope.scaling.factor"].contents() == 4.0
    assert fields["gpt-oss.rope.scaling.original_context_length"].contents() == 64
    assert fields["gpt-oss.rope.scaling.yarn_beta_fast"].contents() == 32.0


def test_a_config_without_a_context_length_gets_the_one_llama_cpps_converter_writes():
    """Gemma 3's converter writes 131072 where config.json names none; the others 2048."""
    from pathlib import Path

    from qtool.families import family_of

    config = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128, head_dim=16,
                  query_pre_attn_scalar=16)
    assert family_of("gemma3_text").check_gguf(config, Path("config.json"))["max_position_embeddings"] == 131072
    assert family_of("llama").check_gguf(config, Path("config.json"))["max_position_embeddings"] == 2048


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_an_encoders_value_projection_folds_into_its_attention_output_and_its_post_norms_are_refused(tmp_path, kind):
    """BERT's post-norm LayerNorm output is also the residual: the default AWQ / SmoothQuant mapping is the value
    projection into attention.output.dense (found through its grandparent), the fold keeps the float function,
    and a mapping from a LayerNorm is refused by the fold check: one line, exit 2, nothing written."""
    from qtool.calibration.awq import apply_awq
    from qtool.calibration.rounding.statistics import collect_module_inputs
    from qtool.config import parse_recipe, resolve_plan

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(kind, vocab_size=128, hidden_size=48, intermediate_size=96,
                                            num_hidden_layers=2, num_attention_heads=4)
    net = transformers.AutoModel.from_config(cfg).eval()
    net.save_pretrained(tmp_path / "m")
    ids = torch.randint(3, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    recipe = ("version: 1\ndefaults:\n  weights: {bitwidth: 3, symmetric: false, granularity: per_block, "
              "block_size: 16}\n  activations: null\nawq: {grid: 10%s}\n")
    plan = resolve_plan(parse_recipe(recipe % ""), net, "awq.yaml")
    prefix = "encoder.layer"
    assert [(g.smooth, g.balance) for g in plan.awq.groups] == [
        (f"{prefix}.{i}.attention.self.value", (f"{prefix}.{i}.attention.output.dense",)) for i in range(2)]
    modules = dict(net.named_modules())
    with torch.no_grad():
        before = net(ids).last_hidden_state
        stats = collect_module_inputs({g.balance[0]: True for g in plan.awq.groups}, modules, lambda: net(ids))
        apply_awq(plan.awq, modules, stats, {q.module: q for q in plan.weights}, plan.warnings)
        after = net(ids).last_hidden_state
    assert any(c["ratio"] is not None for c in plan.awq.chosen)  # a scale moved the weights...
    assert float((after - before).abs().max() / before.abs().max()) < 1e-5  # ...and the function stayed
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", "w8a8-smoothquant", "--data",
                           tmp_path / "ids.safetensors", "-o", tmp_path / "s", "--quiet")
    assert code == 0, err
    groups = json.loads((tmp_path / "s" / "manifest.json").read_text())["smoothquant"]["groups"]
    assert [g["smooth"].split(".", 3)[-1] for g in groups] == ["attention.self.value"] * 2
    # the norm whose output feeds the MLP (found through its block) is also the residual the block adds back
    (tmp_path / "ln.yaml").write_text(recipe % ", mappings: [{smooth: 're:.*attention.output.LayerNorm', balance: "
                                                "['re:.*intermediate.dense']}]")
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", tmp_path / "ln.yaml", "--data",
                           tmp_path / "ids.safetensors", "-o", tmp_path / "ln", "--quiet")
    assert code == 2 and len(error_lines(err)) == 1 and "folding the scales changes" in err, err
    assert not (tmp_path / "ln").exists()
    # block by block is for causal LMs: an encoder is told so, not that its weights lack an LM head
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", "w4a16-block32-gptq", "--data",
                           tmp_path / "ids.safetensors", "-o", tmp_path / "seq", "--quiet", "--sequential")
    assert code == 2 and len(error_lines(err)) == 1 and "run without --sequential" in err, err
    assert not (tmp_path / "seq").exists()
