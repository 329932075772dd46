"""llama-quantize's mixes (``gguf_mix``): each tensor's GGUF type as llama.cpp's ``llama_tensor_get_type`` gives
it, fallbacks included, and every shipped mix runs in llama.cpp."""

import json
from pathlib import Path

import pytest
import torch

from qtool.gguf_mixes import MIXES, mix_type, tensor_role

from tests.helpers import error_lines, run_cli

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = sorted(p.stem for p in CONFIGS.glob("gguf-*.yaml") if "gguf_mix:" in p.read_text())


def test_roles_of_hugging_face_llama_names():
    assert tensor_role("model.layers.7.self_attn.v_proj") == ("attn_v", 7)
    assert tensor_role("model.layers.12.mlp.down_proj") == ("ffn_down", 12)
    assert tensor_role("model.embed_tokens") == ("token_embd", -1)
    assert tensor_role("lm_head") == ("output", -1)
    assert tensor_role("model.layers.0.input_layernorm") == (None, -1)
    # experts, routed or shared, take their projection's rules: llama-quantize matches "ffn_down" in
    # ffn_down_exps and ffn_down_shexp (a Q4_K_M shared expert's down projection was Q4_K in every layer)
    assert tensor_role("model.layers.3.mlp.experts.5.down_proj") == ("ffn_down", 3)
    assert tensor_role("model.layers.3.mlp.shared_expert.down_proj") == ("ffn_down", 3)
    assert tensor_role("model.layers.6.mlp.shared_experts.gate_proj") == ("ffn_gate", 6)
    assert tensor_role("model.layers.6.mlp.shared_expert_gate") == (None, -1)


def _layers_with(mix: str, role: str, n: int, n_gqa: int = 3, imatrix: bool = False) -> dict:
    out = {}
    for i in range(n):
        out.setdefault(mix_type(mix, role, i, n, n_gqa, 4096, imatrix), []).append(i)
    return out


def test_q4_k_m_gives_half_of_a_32_layer_models_attn_v_and_ffn_down_q6_k():
    """use_more_bits on 32 layers: the first 4, the last 4, and every third between (6, 9, ..., 27)."""
    more = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    for role in ("attn_v", "ffn_down"):
        got = _layers_with("q4_k_m", role, 32)
        assert got["q6_k"] == more and len(got["q4_k"]) == 16
    assert _layers_with("q4_k_m", "attn_q", 32) == {"q4_k": list(range(32))}
    # SmolLM2's 30 layers: 30 // 8 = 3, 7 * 30 // 8 = 26
    assert _layers_with("q5_k_m", "ffn_down", 30)["q6_k"] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


@pytest.mark.parametrize("mix,role,n_gqa,expected", [
    ("q2_k", "attn_v", 4, {"q4_k": list(range(8))}),
    ("q2_k", "attn_v", 3, {"q3_k": list(range(8))}),
    ("q2_k", "attn_output", 3, {"q3_k": list(range(8))}),
    ("q2_k", "ffn_down", 3, {"q3_k": list(range(8))}),
    ("q2_k", "ffn_up", 3, {"q2_k": list(range(8))}),
    ("q3_k_m", "attn_v", 3, {"q5_k": [0, 1], "q4_k": [2, 3, 4, 5, 6, 7]}),
    ("q3_k_m", "attn_output", 3, {"q4_k": list(range(8))}),
    ("q3_k_m", "ffn_down", 3, {"q4_k": list(range(8))}),  # 8 // 16 = 0: no layer in the first sixteenth
    ("q3_k_l", "ffn_down", 3, {"q5_k": list(range(8))}),
    ("q4_k_s", "attn_v", 3, {"q5_k": [0, 1, 2, 3], "q4_k": [4, 5, 6, 7]}),
    ("q4_k_s", "ffn_down", 3, {"q5_k": [0], "q4_k": list(range(1, 8))}),
    ("iq4_xs", "attn_v", 4, {"q5_k": list(range(8))}),
    ("iq4_xs", "attn_v", 2, {"iq4_xs": list(range(8))}),
    ("iq4_xs", "ffn_down", 2, {"q5_k": [0], "iq4_xs": list(range(1, 8))}),
    ("q6_k", "attn_v", 4, {"q6_k": list(range(8))}),
    # Phi-3's fused attn_qkv: llama-quant.cpp's category_is_attn_v takes it (its own rule, Q5_K under Q4_K_M, is
    # never reached)
    ("q4_k_m", "attn_qkv", 3, {"q6_k": [0, 3, 6, 7], "q4_k": [1, 2, 4, 5]}),
    ("q3_k_m", "attn_qkv", 3, {"q5_k": [0, 1], "q4_k": [2, 3, 4, 5, 6, 7]}),
    ("q2_k", "attn_qkv", 4, {"q4_k": list(range(8))}),
    ("q8_0", "ffn_down", 4, {"q8_0": list(range(8))}),
])
def test_llama_quantize_rules_table(mix, role, n_gqa, expected):
    assert _layers_with(mix, role, 8, n_gqa) == expected


def test_imatrix_changes_what_llama_quantize_gives_ffn_down():
    assert _layers_with("q4_0", "ffn_down", 16, imatrix=True) == {"q4_1": [0, 1], "q4_0": list(range(2, 16))}
    assert _layers_with("q4_0", "ffn_down", 16) == {"q4_0": list(range(16))}
    assert _layers_with("iq4_xs", "ffn_down", 16, imatrix=True) == {"iq4_xs": list(range(16))}


def test_the_output_matrix_is_q6_k_or_q8_0_by_its_width():
    assert {m: mix_type(m, "output", -1, 30, 3, 576, False) for m in ("q4_k_m", "q4_0", "q8_0")} == \
        {"q4_k_m": "q8_0", "q4_0": "q6_k", "q8_0": "q8_0"}  # 576 is 18 blocks of 32, not whole super-blocks
    assert all(mix_type(m, "output", -1, 30, 3, 4096, False) == ("q8_0" if m == "q8_0" else "q6_k") for m in MIXES)


# ---- on a model --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.test_gguf import _tiny_llama

    d = tmp_path_factory.mktemp("mixes")
    return {"wide": _tiny_llama(d / "wide", False, hidden=256), "tied": _tiny_llama(d / "tied", True, hidden=256),
            "narrow": _tiny_llama(d / "narrow", True)}


def _types(path: Path) -> dict:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors if not t.name.endswith("norm.weight")}


def test_q4_k_m_on_a_model_and_its_fallbacks(models, tmp_path):
    code, out, err = run_cli("quantize", models["wide"], "-c", CONFIGS / "gguf-q4_k_m.yaml", "-o", tmp_path / "w",
                             "--format", "gguf", "--json")
    assert code == 0, err
    types = _types(tmp_path / "w/model.gguf")
    # 2 layers: use_more_bits is true for layer 1 only (2 // 8 = 0, 7 * 2 // 8 = 1)
    assert types == {"token_embd.weight": "Q4_K", "output.weight": "Q6_K",
                     **{f"blk.{i}.{r}.weight": "Q4_K" for i in (0, 1) for r in
                        ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")},
                     "blk.0.attn_v.weight": "Q4_K", "blk.0.ffn_down.weight": "Q4_K",
                     "blk.1.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K"}
    # width 64, tied: the embedding table is the output matrix (Q8_0: 64 is not whole super-blocks), one tensor;
    # everything else falls back from Q4_K/Q6_K to Q5_0/Q8_0
    code, out, err = run_cli("quantize", models["narrow"], "-c", CONFIGS / "gguf-q4_k_m.yaml", "-o", tmp_path / "n",
                             "--format", "gguf", "--json")
    assert code == 0, err
    types = _types(tmp_path / "n/model.gguf")
    assert "output.weight" not in types and types["token_embd.weight"] == "Q8_0"
    assert types["blk.1.attn_v.weight"] == "Q8_0" and types["blk.0.attn_v.weight"] == "Q5_0"
    assert any("weight(s) of Q4_K" in w and "Q5_0" in w for w in json.loads(out)["warnings"])


def test_a_tied_model_writes_one_table_for_embedding_and_output(models, tmp_path):
    code, _, err = run_cli("quantize", models["tied"], "-c", CONFIGS / "gguf-q4_k_m.yaml", "-o", tmp_path / "t",
                           "--format", "gguf")
    assert code == 0, err
    types = _types(tmp_path / "t/model.gguf")
    assert "output.weight" not in types and types["token_embd.weight"] == "Q6_K"


def test_a_users_rule_overrides_the_mix(models, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ngguf_mix: q4_k_m\ndefaults:\n  weights: {analyzer: mse}\n  activations: null\n"
                      "layers:\n  - match: '*.mlp.up_proj'\n    weights: {gguf_type: q8_0}\n")
    code, _, err = run_cli("quantize", models["wide"], "-c", recipe, "-o", tmp_path / "o", "--format", "gguf")
    assert code == 0, err
    types = _types(tmp_path / "o/model.gguf")
    assert types["blk.0.ffn_up.weight"] == "Q8_0" and types["blk.0.ffn_gate.weight"] == "Q4_K"


@pytest.mark.parametrize("defaults, rule, grid", [
    ("gguf_mix: q4_k_m\ndefaults:\n  weights: {analyzer: minmax}", "{bitwidth: 8}", "8-bit asymmetric blocks of 32"),
    ("defaults:\n  weights: {bitwidth: 4, symmetric: true, granularity: per_block, block_size: 32, "
     "scale_dtype: float16}", "{bitwidth: 6}", "6-bit symmetric blocks of 32"),
    ("defaults:\n  weights: {gguf_type: q4_k}", "{granularity: per_channel}", "per_channel"),
])
def test_a_rule_that_leaves_ggufs_grids_is_a_warning_before_calibration(models, tmp_path, defaults, rule, grid):
    # a rule's own grid keys leave the GGUF type (the merge rule); export --format gguf refused it only at the end
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\n{defaults}\n  activations: null\nlayers:\n  - match: '*.mlp.up_proj'\n"
                      f"    weights: {rule}\n  - match: '*.mlp.gate_proj'\n    weights: {{gguf_type: q8_0}}\n")
    code, out, err = run_cli("config", "show", recipe, "-m", models["wide"], "--json")
    assert code == 0, err
    off = [w for w in json.loads(out)["warnings"] if "no GGUF type" in w]
    assert len(off) == 1, off
    assert "layers[0] gives 2 weight(s) such as model.layers.0.mlp.up_proj" in off[0] and grid in off[0]


def test_a_null_under_a_mix_resets_the_mix_type_and_is_no_shadow(models, tmp_path):
    """Under a gguf_mix a weight starts from its mix type: a null then a partial rule leaves the defaults plus that
    rule, which is not what the mix gave: the null changed something."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ngguf_mix: q4_k_m\ndefaults:\n  weights: {analyzer: minmax}\n  activations: null\n"
                      "layers:\n  - match: '*.mlp.up_proj'\n    weights: null\n  - match: '*.mlp.up_proj'\n"
                      "    weights: {analyzer: mse}\n")
    code, out, err = run_cli("config", "show", recipe, "-m", models["wide"], "--json")
    assert code == 0, err
    assert not [w for w in json.loads(out)["warnings"] if "change nothing" in w], out


def test_a_job_writing_another_format_leaves_the_gguf_grid_warning_out(models, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, symmetric: true, granularity: per_block, "
                      "block_size: 32, scale_dtype: float16}\n  activations: null\nlayers:\n"
                      "  - match: '*.mlp.up_proj'\n    weights: {granularity: per_channel}\n")
    for fmt, warned in (("qtool", False), ("gguf", True)):
        code, out, err = run_cli("quantize", models["wide"], "-c", recipe, "-o", tmp_path / fmt, "--format", fmt,
                                 "--json", "--gguf-fallback", "f16")
        assert code == 0, err
        summary = json.loads(out)
        assert any("no GGUF type" in w for w in summary["warnings"] + summary["export_warnings"]) == warned, err
        # the fallback's weights are stored as floats: the plan line counts them apart, the coverage leaves them
        # out, and the recipe warning's "export --format gguf refuses them" is not said of a run that writes them
        assert ("2 x weight stored as floats by --format gguf (model.layers.0.mlp.up_proj.weight ...)" in err) == warned
        assert ("export --format gguf refuses them" in err) is False, err
        assert ("this run's --gguf-fallback stores them as floats" in err) == warned, err
        share = json.loads(out)["weights_quantized"]["share"]
        assert (share < 0.95) == warned, share


@pytest.mark.parametrize("recipe", ["gguf-q4_0", "gguf-q4_k_m", "gguf-q6_k", "w4a16-block32"])
def test_shipped_recipes_give_no_grid_outside_gguf_warning(models, recipe):
    code, out, err = run_cli("config", "show", recipe, "-m", models["wide"], "--json")
    assert code == 0, err
    assert not [w for w in json.loads(out)["warnings"] if "no GGUF type" in w]


def test_a_mix_on_a_model_without_llama_layers_is_one_line(tmp_path):
    from safetensors.torch import save_file

    from tests.tinymodels import mlp

    save_file(mlp().state_dict(), tmp_path / "mlp.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "mlp.safetensors", "-c", CONFIGS / "gguf-q4_k_m.yaml",
                           "--model-class", "tests.tinymodels:mlp", "-o", tmp_path / "o")
    assert code == 2 and not (tmp_path / "o").exists()
    errors = [line for line in error_lines(err) if line.startswith("error")]
    assert len(errors) == 1 and "gguf_mix q4_k_m: the model has no Llama-family decoder layers" in errors[0]


@pytest.mark.parametrize("recipe", SHIPPED)
def test_llama_cpp_loads_and_runs_every_shipped_mix(models, tmp_path, recipe):
    pytest.importorskip("xllamacpp")
    from safetensors.torch import save_file

    from tests.llamacpp import LlamaCpp

    extra = []
    if recipe.endswith("-gptq"):
        ids = torch.randint(1, 300, (8, 32), generator=torch.Generator().manual_seed(1))
        save_file({"input_ids": ids}, tmp_path / "d.safetensors")
        extra = ["--data", tmp_path / "d.safetensors", "--sequential"]
    code, out, err = run_cli("quantize", models["wide"], "-c", CONFIGS / f"{recipe}.yaml", "-o", tmp_path / "q",
                             "--format", "gguf", "--json", *extra)
    assert code == 0, err
    with LlamaCpp(str(tmp_path / "q/model.gguf")) as llama:
        assert 0 <= llama.greedy_next([5, 17, 42, 9]) < 320


@pytest.mark.parametrize("mix,file_type", [("q4_k_m", 15), ("q2_k", 10), ("q3_k_m", 12)])
def test_a_mixs_file_says_the_mix_as_llama_quantize_writes_it(tmp_path, mix, file_type):
    """general.file_type is the mix's own (LLAMA_FTYPE_MOSTLY_Q4_K_M = 15, ...), not the type most tensors hold
    (a 64-wide model's Q4_K_M falls back to Q5_0 everywhere, and the file used to say Q5_0)."""
    import gguf

    from tests.test_gguf import _tiny_llama

    ckpt = _tiny_llama(tmp_path / "m", False)
    code, out, err = run_cli("quantize", ckpt, "-c", f"gguf-{mix}", "-o", tmp_path / "q", "--format", "gguf",
                             "--json")
    assert code == 0, err
    assert json.loads(out)["gguf"]["file_type"] == mix.upper()
    reader = gguf.GGUFReader(tmp_path / "q/model.gguf")
    assert reader.fields["general.file_type"].contents() == file_type
    assert file_type == int(getattr(gguf.LlamaFileType, f"MOSTLY_{mix.upper()}"))


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Rows of 256 and 512 (whole K-quant super-blocks) and token ids to calibrate the -gptq recipes with."""
    from safetensors.torch import save_file

    from tests.test_gguf import _tiny_llama

    d = tmp_path_factory.mktemp("agree")
    save_file({"input_ids": torch.randint(1, 300, (4, 32), generator=torch.Generator().manual_seed(0))},
              d / "ids.safetensors")
    return _tiny_llama(d / "m", False, hidden=256), d / "ids.safetensors"


@pytest.mark.parametrize("recipe", sorted(p.stem for p in CONFIGS.glob("gguf-*.yaml")))
def test_list_show_and_the_written_file_agree_on_every_weights_type(wide, tmp_path, recipe):
    """What `config list` says a shipped GGUF recipe writes, what `config show --model` plans and what `inspect`
    finds in the exported file name the same types (the list used to say "int8 per_channel" for every mix, the
    plan line "int4 per_block" for Q4_K)."""
    ckpt, ids = wide
    code, out, err = run_cli("config", "list", "--json")
    row = next(r for r in json.loads(out)["recipes"] if r["name"] == recipe)
    code, out, err = run_cli("config", "show", recipe, "--model", ckpt, "--json")
    assert code == 0, err
    legacy = {(8, True): "Q8_0", (5, True): "Q5_0", (5, False): "Q5_1", (4, True): "Q4_0", (4, False): "Q4_1"}
    planned = {q["module"]: q["scale_dtype"].upper() if q["scale_dtype"].startswith(("q", "iq"))
               else legacy[(q["bitwidth"], q["symmetric"])]
               for q in json.loads(out)["quantizers"] if q["tensor"] == "weight"}
    data = ["--data", ids] if row["needs_data"] else []
    code, out, err = run_cli("quantize", ckpt, "-c", recipe, "-o", tmp_path / "q", "--format", "gguf", *data, "--json")
    assert code == 0, err
    summary = json.loads(out)
    code, out, err = run_cli("inspect", tmp_path / "q/model.gguf", "--json")
    written = {t["name"]: t["dtype"] for t in json.loads(out)["tensors"] if t["quantized"]}
    names = summary["names"]
    assert {names[m + ".weight"]: t for m, t in planned.items() if m + ".weight" in names} == written
    label, kinds = row["weights"], set(written.values())
    if label.startswith("GGUF "):  # a mix: every type it writes
        assert all(t in label for t in kinds), (label, kinds)
    else:  # a grid (its layers rules aside): the type most weights get
        assert max(kinds, key=list(written.values()).count) in label, (label, kinds)
    if label.startswith("GGUF "):  # the plan line names the types too (it said int4 / int5 for Q4_K / Q5_0)
        code, _, err = run_cli("quantize", ckpt, "-c", recipe, "-o", tmp_path / "q2", "--format", "gguf", *data)
        line = next(x for x in err.splitlines() if x.startswith("plan:"))
        assert all(f"GGUF {t}" in line for t in kinds) and " int" not in line, line


def test_eight_expert_models_get_llama_quantizes_extra_attention_bits():
    """llama-quantize gives a model of exactly 8 experts (Mixtral) Q8_0 attn_v/attn_k and, in the low mixes,
    Q5_K attn_output; other expert counts and dense models keep the mix's own rules."""
    from qtool.gguf_mixes import mix_type

    for mix in ("q4_k_m", "q2_k", "q6_k", "q4_0"):
        assert mix_type(mix, "attn_v", 5, 32, 4, 4096, False, n_expert=8) == "q8_0"
        assert mix_type(mix, "attn_k", 5, 32, 4, 4096, False, n_expert=8) == "q8_0"
    assert mix_type("q4_k_m", "attn_output", 5, 32, 4, 4096, False, n_expert=8) == "q5_k"
    assert mix_type("q5_k_m", "attn_output", 5, 32, 4, 4096, False, n_expert=8) == "q5_k"  # its own type
    assert mix_type("q2_k", "attn_output", 5, 32, 4, 4096, False, n_expert=8) == "q5_k"  # not q3_k
    for n_expert in (0, 128):
        assert mix_type("q4_k_m", "attn_k", 5, 32, 4, 4096, False, n_expert=n_expert) == "q4_k"
        assert mix_type("q2_k", "attn_output", 5, 32, 4, 4096, False, n_expert=n_expert) == "q3_k"
    # experts take their projection's rules: ffn_down_exps is ffn_down
    assert mix_type("q4_k_m", "ffn_down", 0, 32, 4, 4096, False, n_expert=8) == "q6_k"


@pytest.mark.parametrize("family", ["granitemoe", "mixtral", "qwen3_moe"])
def test_every_moe_familys_expert_down_projections_take_ffn_downs_rules(family, tmp_path):
    """GraniteMoE's split experts live under block_sparse_moe (not mlp): the mix gave them its base type (Q4_K where
    llama-quantize gives the last layer's ffn_down_exps Q6_K), under llama-quantize's Q4_K_M label. (These tiny
    rows are no whole 256-element super-blocks: Q6_K falls back to Q8_0, Q4_K to Q5_0, as llama-quantize's do.)"""
    from qtool.config import load_recipe, recipe_file, resolve_plan
    from qtool.model.hf import meta_skeleton
    from tests.test_gguf_families import _tiny

    skeleton = meta_skeleton(_tiny(tmp_path / "m", family))
    plan = resolve_plan(load_recipe(recipe_file("gguf-q4_k_m")), skeleton)
    down = {q.module: q.scale_dtype for q in plan.weights
            if q.module.endswith(("down_proj", ".w2")) and ".experts." in q.module}
    assert len(down) == 16, sorted(down)
    for module, kind in down.items():  # use_more_bits: the last layer of two
        assert kind == ("q8_0" if ".layers.1." in module else "q5_0"), (module, kind)


@pytest.mark.parametrize("mix, qkv", [("q2_k", "q4_k"), ("iq4_xs", "q5_k")])
def test_a_fused_qkv_takes_attn_vs_rules_with_the_models_own_head_ratio(tmp_path, mix, qkv):
    """Phi-3's fused attn_qkv takes attn_v's rules, some of which read n_gqa: qtool counted it 1 for a fused q/k/v
    (Q3_K and IQ4_XS where llama-quantize gives Phi-3-medium's and Phi-4's, with 4 query heads a KV head, Q4_K and
    Q5_K)."""
    from qtool.config import load_recipe, recipe_file, resolve_plan
    from qtool.model.hf import meta_skeleton
    from tests.test_gguf_families import _tiny

    skeleton = meta_skeleton(_tiny(tmp_path / "m", "phi3", hidden_size=256, num_attention_heads=8,
                                   num_key_value_heads=2))
    plan = resolve_plan(load_recipe(recipe_file(f"gguf-{mix}")), skeleton)
    kinds = {q.module: q.scale_dtype for q in plan.weights if q.module.endswith("qkv_proj")}
    assert kinds == {f"model.layers.{i}.self_attn.qkv_proj": qkv for i in range(2)}


def test_a_tied_table_of_a_family_whose_file_holds_the_output_takes_the_embeddings_rule(tmp_path):
    """Qwen2-MoE's (and OLMoE's, gpt-oss's) GGUF file always holds output.weight, so llama-quantize reads it as
    untied and gives token_embd the mix's base type: qtool gave it the output layer's Q6_K (a bigger file)."""
    from qtool.config import load_recipe, recipe_file, resolve_plan
    from qtool.model.hf import meta_skeleton
    from tests.test_gguf_families import _tiny

    skeleton = meta_skeleton(_tiny(tmp_path / "m", "qwen2_moe", hidden_size=256, tie_word_embeddings=True))
    plan = resolve_plan(load_recipe(recipe_file("gguf-q4_k_m")), skeleton)
    kinds = {q.module: q.scale_dtype for q in plan.weights if q.module in ("model.embed_tokens", "lm_head")}
    assert kinds == {"model.embed_tokens": "q4_k", "lm_head": "q6_k"}
