"""SmoothQuant: scales folded into norms and projections leave the float model's function unchanged, flatten the
activations the quantizers see, and reach every exported file."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import qtool
from qtool.calibration.smoothing import smoothing_scales
from qtool.config import parse_recipe, resolve_plan
from qtool.errors import ConfigError
from qtool.model.insert import set_quantization
from tests.helpers import error_lines, run_cli, tiny_llama
from tests.tinymodels import mlp

transformers = pytest.importorskip("transformers")

STATIC = ("version: 1\ndefaults:\n  weights: {bitwidth: 8, granularity: per_channel}\n"
          "  activations: {bitwidth: 8, symmetric: false}\nignore: [lm_head]\n")
DYNAMIC = ("version: 1\ndefaults:\n  weights: {bitwidth: 8, granularity: per_channel}\n"
           "  activations: {bitwidth: 8, granularity: per_token, dynamic: true}\n"
           "layers:\n  - type: Embedding\n    weights: null\n    activations: null\nignore: [lm_head]\n")


def test_scales_follow_the_formula():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w1 = torch.tensor([[1.0, -4.0, 2.0, 0.0], [0.5, 1.0, 1.0, 0.0]])
    w2 = torch.tensor([[-2.0, 1.0, 1.0, 0.0]])
    s = smoothing_scales(act, [w1, w2], 0.5)
    # max|W[:, j]| over both layers: 2, 4, 2, 0 -> s = sqrt(a) / sqrt(w); a channel with no data or no weight keeps 1
    assert torch.allclose(s, torch.tensor([2.0 / 2.0 ** 0.5, 1.0 / 2.0, 1.0, 1.0]))
    assert torch.equal(smoothing_scales(act, [w1], 0.0), 1 / w1.abs().amax(0).where(w1.abs().amax(0) > 0,
                                                                                      torch.tensor(1.0)) * (act > 0)
                       + (act == 0).float())


@pytest.mark.parametrize("text, message", [
    ("smoothquant: {alpha: 1.5}", "alpha"),
    ("smoothquant: {mappings: [{smooth: norm}]}", "balance"),
    ("smoothquant: {mappings: [{smooth: 're:(', balance: [x]}]}", "bad regular expression"),
])
def test_recipe_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_recipe(STATIC + text, "r.yaml")


def test_a_model_without_the_default_pairs_is_told_to_give_mappings():
    with pytest.raises(ConfigError, match="give smoothquant.mappings"):
        resolve_plan(parse_recipe(STATIC + "smoothquant: {}\n"), mlp())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("sq")
    llama = tiny_llama(d / "llama")
    # one channel of the embeddings made 40x larger: the outlier SmoothQuant exists for
    from safetensors.torch import load_file

    tensors = load_file(str(llama / "model.safetensors"))
    tensors["model.embed_tokens.weight"][:, 5] *= 40
    save_file(tensors, str(llama / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, d / "ids.safetensors")
    return d, llama


def _calibrate(world, tmp_path, recipe, *extra):
    d, llama = world
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "r.yaml").write_text(recipe)
    code, out, err = run_cli("calibrate", llama, "-c", tmp_path / "r.yaml", "-o", tmp_path / "run", "--data",
                             d / "ids.safetensors", "--json", *extra)
    return code, out, err


def test_float_function_is_unchanged_and_activations_get_flatter(world, tmp_path):
    d, llama = world
    code, _, err = _calibrate(world, tmp_path, STATIC + "smoothquant: {alpha: 0.5}\n")
    assert code == 0, err
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert len(manifest["smoothquant"]["groups"]) == 6  # 2 blocks x (attention norm, MLP norm, up -> down)
    smoothed = qtool.load_calibrated(str(llama), str(tmp_path / "run" / "encodings.json"))
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(llama)).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    set_quantization(smoothed, False)
    seen = {}
    q_proj = smoothed.model.layers[0].self_attn.q_proj
    q_plain = plain.model.layers[0].self_attn.q_proj
    hooks = [q_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("smoothed", a[0])),
             q_plain.register_forward_pre_hook(lambda m, a: seen.__setitem__("plain", a[0]))]
    with torch.no_grad():
        a, b = smoothed(ids).logits, plain(ids).logits
    for h in hooks:
        h.remove()
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()  # the same function
    spread = {k: float(v.abs().amax((0, 1)).max() / v.abs().amax((0, 1)).median()) for k, v in seen.items()}
    assert spread["smoothed"] < spread["plain"] / 1.5, spread  # the outlier channel is tamed (measured: 1.9x)


def test_a_mapping_that_changes_the_function_is_refused(world, tmp_path):
    # down_proj's input is silu(gate) * up: scaling gate_proj's rows is not exact
    mapping = "smoothquant: {mappings: [{smooth: 're:.*gate_proj', balance: ['re:.*down_proj']}]}\n"
    code, _, err = _calibrate(world, tmp_path, STATIC + mapping)
    assert code == 2
    errors = [line for line in error_lines(err) if line.startswith("error:")]
    assert len(errors) == 1 and "changes the float model's outputs" in errors[0]
    # (the recipe gave this mapping: "give smoothquant.mappings" alone sent the user back to what they wrote)
    assert errors[0].endswith("or a layer between them is not linear: give smoothquant.mappings pairing a module "
                              "with every layer that reads its output"), errors
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["smoothquant", "awq"])
def test_a_balance_layer_tied_to_another_weight_is_refused_before_calibrating(tmp_path, key):
    """lm_head tied to the embedding table: a scale folded into its input columns rescales the table too. It was
    refused by the fold check after a calibration pass (AWQ's search too), with the advice to give the mappings
    the recipe gave."""
    llama = tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    mapping = "{mappings: [{smooth: model.norm, balance: [lm_head]}]}"
    plan_text = STATIC.replace("ignore: [lm_head]\n", "") + f"{key}: {mapping}\n"
    with pytest.raises(ConfigError, match=f"{key}: lm_head's weight is tied to model.embed_tokens's, so the scale "
                                          "folded into lm_head's input channels would rescale model.embed_tokens"):
        resolve_plan(parse_recipe(plan_text), transformers.AutoModelForCausalLM.from_pretrained(str(llama)))
    untied = tiny_llama(tmp_path / "untied")
    resolve_plan(parse_recipe(plan_text), transformers.AutoModelForCausalLM.from_pretrained(str(untied)))


def test_sequential_is_refused(world, tmp_path):
    code, _, err = _calibrate(world, tmp_path, STATIC + "smoothquant: {}\n", "--sequential")
    assert code == 2 and "without --sequential" in err


def test_compressed_tensors_carries_the_smoothed_weights(world, tmp_path):
    d, llama = world
    code, _, err = _calibrate(world, tmp_path, DYNAMIC + "smoothquant: {alpha: 0.5}\n")
    assert code == 0, err
    code, _, err = run_cli("export", llama, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / "ct",
                           "--format", "compressed-tensors")
    assert code == 0, err
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as fh, \
            safe_open(str(llama / "model.safetensors"), "pt") as src:
        key = "model.layers.0.input_layernorm.weight"
        assert not torch.equal(fh.get_tensor(key), src.get_tensor(key))  # the norm absorbed the scales
    fq = qtool.load_calibrated(str(llama), str(tmp_path / "run" / "encodings.json"))
    ct = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct")).eval()
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ct(ids).logits, fq(ids).logits)


def test_onnx_carries_the_smoothed_weights(world, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    import numpy as np

    d, llama = world
    code, _, err = _calibrate(world, tmp_path, STATIC + "smoothquant: {alpha: 0.8}\n")
    assert code == 0, err
    code, _, err = run_cli("export", llama, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / "onnx",
                           "--format", "onnx", "--data", d / "ids.safetensors")
    assert code == 0, err
    fq = qtool.load_calibrated(str(llama), str(tmp_path / "run" / "encodings.json"))
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = fq(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.numpy()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    feed = {i.name: (ids.numpy() if i.name == "input_ids" else np.ones_like(ids.numpy())) for i in sess.get_inputs()}
    got = sess.run(None, feed)[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()  # measured: 1.2e-7 absolute
