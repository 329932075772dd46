"""AWQ (``awq:`` in a recipe; qtool.calibration.awq): activation-aware per-channel scales folded into the float
model before the weights calibrate. The fold leaves the float function alone, the search never ends above plain
rounding on its objective, the files hold the folded weights, and what cannot be folded is one line."""

import json

import pytest
import torch

from tests.helpers import error_lines, run_cli
from tests.test_eval import model  # noqa: F401  (the tiny Llama with text: calibration, held out)

transformers = pytest.importorskip("transformers")

AWQ = """version: 1
defaults:
  weights: {bitwidth: 4, symmetric: true, granularity: per_block, block_size: 32%s}
  activations: null
ignore: ["re:.*lm_head", "re:.*embed_tokens"]
awq: {grid: 10%s}
"""


def _recipe(tmp_path, rounding="", extra=""):
    path = tmp_path / "awq.yaml"
    path.write_text(AWQ % (rounding, extra))
    return path


def _quantize(model, tmp_path, recipe, name="out", *flags):
    ckpt, calib, _ = model
    return run_cli("quantize", ckpt, "-c", recipe, "--data", calib, "--seq-len", "48", "-o", tmp_path / name, "-q",
                   *flags)


def test_the_fold_keeps_the_float_function_and_the_search_never_ends_above_plain_rounding(model, tmp_path):
    from qtool.calibration.awq import apply_awq
    from qtool.calibration.rounding.statistics import collect_module_inputs
    from qtool.config import load_recipe, resolve_plan

    ckpt = model[0]
    net = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    plan = resolve_plan(load_recipe(_recipe(tmp_path)), net, "awq.yaml")
    assert [g.smooth.split(".")[-1] for g in plan.awq.groups] == ["input_layernorm"] * 2 + [
        "post_attention_layernorm"] * 2 + ["up_proj"] * 2  # (the family's mappings, each over every layer)
    ids = torch.randint(0, 300, (4, 40), generator=torch.Generator().manual_seed(0))
    modules = dict(net.named_modules())
    with torch.no_grad():
        before = net(ids).logits
        stats = collect_module_inputs({g.balance[0]: True for g in plan.awq.groups}, modules, lambda: net(ids))
        norm = modules["model.layers.0.input_layernorm"].weight.clone()
        replaced = apply_awq(plan.awq, modules, stats, {q.module: q for q in plan.weights}, plan.warnings)
        after = net(ids).logits
    assert float((after - before).abs().max() / before.abs().max()) < 1e-5
    chosen = plan.awq.chosen
    assert len(chosen) == 6 and all(c["error"] <= c["error_unscaled"] for c in chosen)
    scaled = [c for c in chosen if c["ratio"] is not None]
    assert scaled and all(c["error"] < c["error_unscaled"] for c in scaled)
    if chosen[0]["ratio"] is not None:
        assert not torch.equal(norm, modules["model.layers.0.input_layernorm"].weight)
        assert torch.equal(replaced["model.layers.0.input_layernorm.weight"],
                           modules["model.layers.0.input_layernorm"].weight)


def test_the_outputs_objective_is_the_parent_modules_squared_output_error(model, tmp_path):
    """``objective: outputs``: q/k/v are scored through the attention, gate/up through the MLP, a lone balance
    layer by its own output; a group's unscaled error is the summed squared change of that module's output with
    the balance weights rounded to nearest, measured here on the whole model's forward, and the search never
    ends above it."""
    from qtool.calibration.awq import _fake_quant, apply_awq, output_objective, parent_name
    from qtool.calibration.rounding.statistics import collect_module_inputs
    from qtool.config import load_recipe, resolve_plan
    from qtool.parallel import Group

    net = transformers.AutoModelForCausalLM.from_pretrained(model[0]).eval()
    plan = resolve_plan(load_recipe(_recipe(tmp_path, extra=", objective: outputs")), net, "awq.yaml")
    assert plan.awq.objective == "outputs"
    assert [parent_name(g) for g in plan.awq.groups[::2]] == [
        "model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.0.mlp.down_proj"]
    modules = dict(net.named_modules())
    rows = {q.module: q for q in plan.weights}
    batches = [torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    attention = modules["model.layers.1.self_attn"]
    group = next(g for g in plan.awq.groups if parent_name(g) == "model.layers.1.self_attn")

    def attention_outputs():
        seen = []
        handle = attention.register_forward_hook(lambda m, a, out: seen.append(out[0].detach()))
        with torch.no_grad():
            for ids in batches:
                net(ids)
        handle.remove()
        return seen

    floats = attention_outputs()
    saved = {n: modules[n].weight.data.clone() for n in group.balance}
    for n in group.balance:
        modules[n].weight.data = _fake_quant(rows[n], saved[n])
    rounded = attention_outputs()
    for n in group.balance:
        modules[n].weight.data = saved[n]
    expected = sum(float((r - f).double().square().sum()) for r, f in zip(rounded, floats))

    with torch.no_grad():
        stats = collect_module_inputs({g.balance[0]: False for g in plan.awq.groups}, modules,
                                      lambda: [net(ids) for ids in batches])
        objective = output_objective(group, modules, [lambda ids=ids: net(ids) for ids in batches], Group())
        assert objective({n: modules[n].weight for n in group.balance}) == 0.0  # the float weights: no error
        plan.awq.groups = (group,)
        apply_awq(plan.awq, modules, stats, rows, plan.warnings, lambda g: objective)
    chosen = plan.awq.chosen[0]
    assert chosen["error_unscaled"] == pytest.approx(expected, rel=1e-6)
    assert chosen["error"] <= chosen["error_unscaled"]


@pytest.mark.parametrize("flags", [(), ("--sequential",)])
def test_the_outputs_objective_in_memory_and_block_by_block(model, tmp_path, flags):
    code, _, err = _quantize(model, tmp_path, _recipe(tmp_path, extra=", objective: outputs"), "out", *flags)
    assert code == 0, err
    awq = json.loads((tmp_path / "out" / "calibration" / "manifest.json").read_text())["awq"]
    assert awq["objective"] == "outputs" and len(awq["groups"]) == 6
    assert all(g["error"] <= g["error_unscaled"] for g in awq["groups"])
    assert any(g["ratio"] is not None for g in awq["groups"])


def test_quantize_writes_the_folded_weights_and_records_the_search(model, tmp_path):
    code, _, err = _quantize(model, tmp_path, _recipe(tmp_path), "out", "-f", "compressed-tensors")
    assert code == 0, err
    manifest = json.loads((tmp_path / "out" / "calibration" / "manifest.json").read_text())
    awq = manifest["awq"]
    assert awq["grid"] == 10 and awq["duo_scaling"] is True and awq["objective"] == "outputs"
    assert len(awq["groups"]) == 6
    assert "model.layers.0.input_layernorm.weight" in awq["replaced"] or awq["groups"][0]["ratio"] is None
    # the directory transformers loads holds the folded floats and their codes: it computes the fake-quant model
    code, out, err = run_cli("eval", tmp_path / "out", "--data", model[2], "--seq-len", "48", "--num-samples", "2",
                             "--generate", "0", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["export_fault"] is None and res["export_gap"]["kl_mean"] < 1e-5
    # same inputs, same bytes
    code, _, err = _quantize(model, tmp_path, _recipe(tmp_path), "again", "-f", "compressed-tensors")
    assert code == 0, err
    for f in ("model.safetensors", "calibration/encodings.json", "calibration/codes.safetensors"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f


def test_awq_scales_then_gptq_chooses_the_codes(model, tmp_path):
    code, _, err = _quantize(model, tmp_path, _recipe(tmp_path, rounding=", rounding: gptq"))
    assert code == 0, err
    manifest = json.loads((tmp_path / "out" / "calibration" / "manifest.json").read_text())
    assert manifest["awq"]["groups"] and set(manifest["rounding"].values()) == {"gptq"}
    assert (tmp_path / "out" / "calibration" / "codes.safetensors").is_file()


@pytest.mark.parametrize("extra,flags,message", [
    (", mappings: [{smooth: 're:.*o_proj', balance: ['re:.*no_such_proj']}]", (), "awq.mappings[0]: smooth"),
    # paired through the block (the nearest enclosing module holding a gate_proj), refused by the fold check
    (", mappings: [{smooth: 're:.*o_proj', balance: ['re:.*gate_proj']}]", (),
     "awq: folding the scales changes the float model's outputs"),
    (", mappings: [{smooth: 're:.*input_layernorm', balance: ['re:.*o_proj']}]", (),
     "awq: folding the scales changes the float model's outputs"),
])
def test_what_cannot_be_folded_is_one_line_and_writes_nothing(model, tmp_path, extra, flags, message):
    code, _, err = _quantize(model, tmp_path, _recipe(tmp_path, extra=extra), "out", *flags)
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "out").exists()


def test_awq_beside_smoothquant_is_refused_when_the_recipe_is_read(model, tmp_path):
    recipe = tmp_path / "both.yaml"
    recipe.write_text(AWQ % ("", "") + "smoothquant: {alpha: 0.5}\n")
    code, _, err = _quantize(model, tmp_path, recipe)
    assert code == 2 and "awq and smoothquant both fold" in err


def test_sequential_awq_scales_each_block_on_its_quantized_inputs(model, tmp_path):
    """--sequential: each block's groups are searched on the float block's inputs (the quantized blocks' outputs
    before it) and folded before its quantizers go in; the block's output is checked, the folded floats written."""
    code, _, err = _quantize(model, tmp_path, _recipe(tmp_path, rounding=", rounding: gptq"), "seq", "--sequential")
    assert code == 0, err
    manifest = json.loads((tmp_path / "seq" / "calibration" / "manifest.json").read_text())
    groups = manifest["awq"]["groups"]
    assert [g["smooth"].split(".")[2] for g in groups] == ["0"] * 3 + ["1"] * 3  # block by block
    assert all(g["error"] <= g["error_unscaled"] for g in groups)
    scaled = {t for g in groups if g["ratio"] is not None for t in [g["smooth"] + ".weight"]}
    assert scaled and scaled <= set(manifest["awq"]["replaced"])


def test_a_sequential_awq_run_killed_after_a_block_resumes_to_the_bytes_of_an_uninterrupted_one(model, tmp_path):
    """The finished block's search record is kept with its state (its folded floats already were): a resumed run
    writes the manifest, encodings and codes of a run never stopped."""
    import subprocess
    import sys
    from pathlib import Path

    ckpt, calib, _ = model
    recipe = _recipe(tmp_path, rounding=", rounding: gptq")
    args = ["calibrate", str(ckpt), "-c", str(recipe), "--data", str(calib), "--seq-len", "48", "--sequential",
            "--quiet"]
    code, _, err = run_cli(*args, "-o", tmp_path / "whole")
    assert code == 0, err
    root = Path(__file__).resolve().parents[1]
    killed = subprocess.run([sys.executable, str(root / "tests/stop_after_block.py"), "1", "--", *args, "-o",
                             str(tmp_path / "run")], capture_output=True, text=True, timeout=300, cwd=root)
    assert killed.returncode == -9, killed.stderr[-2000:]
    code, _, err = run_cli(*args, "--resume", "-o", tmp_path / "run")
    assert code == 0, err
    for name in ("manifest.json", "encodings.json", "codes.safetensors"):
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    groups = json.loads((tmp_path / "run" / "manifest.json").read_text())["awq"]["groups"]
    assert [g["smooth"].split(".")[2] for g in groups] == ["0"] * 3 + ["1"] * 3


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_norm_feeding_routed_experts_is_not_scaled_and_each_experts_own_group_is(tmp_path, family):
    """A mixture-of-experts layer: the norm before the experts feeds each expert only its routed tokens, so no one
    XᵀX scores that group: it is left unscaled with a warning; each expert's up_proj -> down_proj group is searched
    on that expert's tokens. (Mixtral's experts are w1/w3/w2: its groups were the attention's only, without a
    word.)"""
    from tests.test_gguf_families import _tiny

    ckpt = _tiny(tmp_path / "moe", family)
    save = tmp_path / "ids.safetensors"
    from safetensors.torch import save_file

    save_file({"input_ids": torch.randint(0, 250, (8, 32), generator=torch.Generator().manual_seed(0))}, save)
    code, _, err = run_cli("quantize", ckpt, "-c", _recipe(tmp_path), "--data", save, "-o", tmp_path / "out", "-q")
    assert code == 0, err
    manifest = json.loads((tmp_path / "out" / "calibration" / "manifest.json").read_text())
    groups = manifest["awq"]["groups"]
    skipped = [g for g in groups if g.get("skipped") == "routed experts"]
    assert skipped and all(g["smooth"].endswith("post_attention_layernorm") for g in skipped)
    own = [g for g in groups if ".experts." in g["smooth"]]
    assert len(own) == 2 * 8 and all(g["error"] <= g["error_unscaled"] for g in own)  # 2 layers of 8 experts
    assert any("feeds the experts of a mixture-of-experts layer" in w for w in manifest["warnings"])


@pytest.mark.parametrize("weights,fmt,packed", [
    ("{element: fp4_e2m1, granularity: per_block, block_size: 16, scale_dtype: fp8_e4m3}", "compressed-tensors",
     "weight_global_scale"),  # NVFP4
    ("{element: fp4_e2m1, granularity: per_block, block_size: 32, scale_dtype: e8m0}", "compressed-tensors",
     "weight_scale"),  # MXFP4
    ("{gguf_type: q4_0}", "gguf", None),
    # searches weighted by activations: each candidate's quantizer weighted by its scaled inputs' E[x²] / s²
    ("{gguf_type: q4_0, analyzer: {name: mse, weighting: activations_magnitude}}", "gguf", None),
    ("{element: fp4_e2m1, granularity: per_block, block_size: 32, scale_dtype: e8m0, analyzer: {name: mse, "
     "weighting: activations}}", "compressed-tensors", "weight_scale"),
])
def test_awq_searches_on_every_grid_and_never_ends_above_plain_rounding(model, tmp_path, weights, fmt, packed):
    """The search quantizes each candidate with the row's own quantizer, so float elements with their scale types
    and GGUF block types are searched as int grids are; the export needs nothing new (the scales are folded)."""
    ckpt = model[0]
    recipe = tmp_path / "awq.yaml"
    recipe.write_text(f"version: 1\ndefaults:\n  weights: {weights}\n  activations: null\n"
                      "ignore: ['re:.*lm_head', 're:.*embed_tokens']\nawq: {grid: 10}\n")
    code, out, err = _quantize(model, tmp_path, recipe, "out", "--format", fmt, "--json")
    assert code == 0, err
    record = json.loads((tmp_path / "out" / "calibration" / "manifest.json").read_text())["awq"]
    chosen = record["groups"]
    assert len(chosen) == 6 and all(c["error"] <= c["error_unscaled"] for c in chosen)
    assert any(c["ratio"] is not None and c["error"] < c["error_unscaled"] for c in chosen)
    if packed is not None:
        from safetensors import safe_open

        with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
            assert f"model.layers.0.mlp.down_proj.{packed}" in set(f.keys())
    else:
        assert (tmp_path / "out" / "model.gguf").stat().st_size > 0


def test_a_search_weighted_by_activations_scores_each_candidate_with_its_scaled_inputs_importance(model, tmp_path):
    """A candidate's quantizer sees the importance the weights' calibration will see after the fold: the inputs
    of ``W diag(s)`` are ``x / s``, so ``E[x²] / s²``; unweighted rows get none."""
    from qtool.calibration.awq import _fake_quant, ratio_scales, search_scales, weight_magnitude
    from qtool.calibration.rounding.statistics import collect_module_inputs
    from qtool.config import load_recipe, resolve_plan

    recipe = _recipe(tmp_path, rounding=", analyzer: {name: mse, weighting: activations}")
    net = transformers.AutoModelForCausalLM.from_pretrained(model[0]).eval()
    plan = resolve_plan(load_recipe(recipe), net, "awq.yaml")
    group = plan.awq.groups[0]  # input_layernorm -> q, k, v
    modules = dict(net.named_modules())
    ids = torch.randint(0, 300, (4, 40), generator=torch.Generator().manual_seed(0))
    stats = collect_module_inputs({group.balance[0]: True}, modules, lambda: net(ids))[group.balance[0]]
    rows = {q.module: q for q in plan.weights}
    seen = []

    def spy(row, weight, importance=None):
        seen.append(importance)
        return _fake_quant(row, weight, importance)

    search_scales(group, modules, stats, rows, 4, True, quantize=spy)
    ms = stats.mean_square()[None, :]
    assert len(seen) == 3 * 5  # q, k, v: unscaled, then 4 ratios
    assert all(torch.equal(imp, ms) for imp in seen[:3])
    m_w = weight_magnitude([modules[n].weight for n in group.balance], [32] * 3)
    # the third ratio of 4 (0, 1/3, 2/3, 1), from each channel's mean magnitude E|x| (AWQ's m_x)
    s = ratio_scales(stats.mean_absolute(), m_w, 2 / 3)
    torch.testing.assert_close(seen[3 * 3], ms / s.square(), rtol=1e-6, atol=0)
    unweighted = resolve_plan(load_recipe(_recipe(tmp_path)), net, "awq.yaml")
    seen.clear()
    search_scales(group, modules, stats, {q.module: q for q in unweighted.weights}, 2, True, quantize=spy)
    assert seen and all(imp is None for imp in seen)


def test_awq_on_a_family_without_default_mappings_asks_for_awq_mappings():
    """gpt-oss's norms feed its router too: no default groups, and the one line names the key to give."""
    from qtool.config import parse_recipe, resolve_plan
    from qtool.errors import ConfigError

    cfg = transformers.AutoConfig.for_model("gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_experts_per_tok=2, num_local_experts=4, head_dim=16)
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ConfigError, match=r"awq: gpt-oss's norms feed its routers .* give awq\.mappings"):
        resolve_plan(parse_recipe(AWQ % ("", "")), net, "awq.yaml")


def test_the_defaults_are_llm_compressors_candidates_scored_on_the_parent_modules_output():
    """``awq: {}``: 19 ratios over [0, 1] plus no scaling (llm-compressor's ``n_grid=20``), ``objective: outputs``."""
    from qtool.config.schema import AwqSpec

    spec = AwqSpec()
    assert (spec.grid, spec.duo_scaling, spec.objective) == (19, True, "outputs")
