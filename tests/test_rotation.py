"""Hadamard rotations (R1, R2) fused into a Llama-family model: exactly orthogonal at the widths used, the float
model's function unchanged by every rotation, outliers spread, the rotated weights in every exported file, and
bad input one line."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import qtool
from qtool.calibration.rotation import rotate
from qtool.config import parse_recipe, resolve_plan
from qtool.errors import ConfigError
from qtool.model.insert import set_quantization
from qtool.quant.hadamard import HadamardError, hadamard_order, hadamard_transform, rotation_matrix
from tests.helpers import error_lines, run_cli

transformers = pytest.importorskip("transformers")

# widths of real models (SmolLM2 576/1536, Qwen2.5-0.5B 896/4864, Llama-3 14336) and the tiny models' below
WIDTHS = (12, 16, 24, 36, 48, 96, 576, 896, 1536, 2048, 4864)


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_the_rotation_is_orthogonal_at_every_width_used(n, kind):
    r = rotation_matrix(n, kind, seed=7)
    assert torch.allclose(r @ r.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(r.abs(), torch.full_like(r, n ** -0.5), atol=1e-15, rtol=0)  # a scaled ±1 matrix
    m, k = hadamard_order(n)
    assert m * k == n and (m in (1, 2) or m % 4 == 0)


@settings(max_examples=60, deadline=None)
@given(n=st.sampled_from([4, 12, 20, 28, 40, 60, 72, 96, 144, 240]), rows=st.integers(1, 5),
       seed=st.integers(0, 2**31), kind=st.sampled_from(["hadamard", "random-hadamard"]))
def test_the_fast_transform_is_the_dense_product(n, rows, seed, kind):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    dense = x @ rotation_matrix(n, kind, seed)
    assert torch.allclose(hadamard_transform(x, kind, seed), dense, atol=1e-12, rtol=0)


@pytest.mark.parametrize("n", [3, 6, 9, 18, 184, 11008])
def test_a_width_with_no_construction_is_refused(n):
    with pytest.raises(HadamardError, match=f"width {n}"):
        hadamard_order(n)


def _llama(dest, hidden=96, heads=4, kv=2, tied=False, model_type="llama"):
    """A random tiny Llama-family model with a few 30x outlier channels in its residual stream (non-power-of-two
    widths: 96 = 12·8, head_dim 24 = 12·2)."""
    torch.manual_seed(0)
    kw = dict(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
              num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=128,
              tie_word_embeddings=tied)
    if model_type == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, :3] *= 30
        for layer in model.model.layers:  # norms that are not all ones, so folding them matters
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.eval().save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("rot")
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, d / "ids.safetensors")
    return d, _llama(d / "llama"), ids


ROTATIONS = [["r1"], ["r2"], ["r1", "r2"]]


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("rotations", ROTATIONS)
@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_every_fused_rotation_leaves_the_float_outputs_unchanged(tmp_path, model_type, rotations, kind):
    path = _llama(tmp_path / "m", model_type=model_type)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    recipe = parse_recipe(f"version: 1\nrotate: {{rotations: {rotations}, type: {kind}, seed: 3}}\n")
    plan = resolve_plan(recipe, model)
    changed = rotate(model, plan.rotation)
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max() <= 1e-5 * before.abs().max()
    if "r1" in rotations:
        assert torch.equal(model.model.norm.weight, torch.ones(96))
        assert "model.embed_tokens.weight" in changed and "lm_head.weight" in changed
    else:
        assert set(changed) == {f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("v_proj", "o_proj")} \
            | ({f"model.layers.{i}.self_attn.v_proj.bias" for i in range(2)} if model_type == "qwen2" else set())


@pytest.mark.parametrize("block", [12, 24, 48])
def test_a_block_diagonal_r1_leaves_the_float_outputs_unchanged(tmp_path, block):
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama(tmp_path / "m", tied=True)).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    plan = resolve_plan(parse_recipe(f"version: 1\nrotate: {{block_size: {block}, type: random-hadamard}}\n"), model)
    changed = rotate(model, plan.rotation)
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max() <= 1e-5 * before.abs().max()
    # each block of channels is rotated on its own: the first block of the table mixes only its own columns
    e = changed["model.embed_tokens.weight"]
    assert e.shape == (256, 96) and model.lm_head.weight is not model.model.embed_tokens.weight


def test_r1_spreads_the_outlier_channels_of_the_residual_stream(tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama(tmp_path / "m")).eval()
    plan = resolve_plan(parse_recipe("version: 1\nrotate: {rotations: [r1]}\n"), model)
    seen = {}
    q = model.model.layers[0].self_attn.q_proj
    hook = q.register_forward_pre_hook(lambda m, a: seen.__setitem__(len(seen), a[0].abs().amax((0, 1))))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
        rotate(model, plan.rotation)
        model(ids)
    hook.remove()
    spread = [float(v.max() / v.median()) for v in seen.values()]
    assert spread[1] < spread[0] / 3, spread  # q_proj's input: max over median channel


def _calibrate(world, tmp_path, recipe, *extra, data=True):
    d, llama, _ = world
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "r.yaml").write_text(recipe)
    return run_cli("calibrate", llama, "-c", tmp_path / "r.yaml", "-o", tmp_path / "run",
                   *(("--data", d / "ids.safetensors") if data else ()), "--json", *extra)


W4A16_ROT = ("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 32}\n"
             "  activations: null\nignore: [lm_head]\nlayers:\n  - {type: Embedding, weights: null}\n"
             "rotate: {rotations: [r1, r2]}\n")


def test_a_rotated_model_exports_and_reloads_as_its_fake_quant_model(world, tmp_path):
    d, llama, ids = world
    code, out, err = _calibrate(world, tmp_path, W4A16_ROT, data=False)  # a rotation needs no data
    assert code == 0, err
    fq = qtool.load_calibrated(str(llama), str(tmp_path / "run" / "encodings.json"))
    for fmt in ("compressed-tensors", "qtool"):
        code, _, err = run_cli("export", llama, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / fmt,
                               "--format", fmt)
        assert code == 0, err
    ct = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "compressed-tensors")).eval()
    with torch.no_grad():
        assert torch.equal(ct(ids[:2]).logits, fq(ids[:2]).logits)
        set_quantization(fq, False)  # and the rotated float model is the original float model
        plain = transformers.AutoModelForCausalLM.from_pretrained(str(llama)).eval()
        a, b = fq(ids[:2]).logits, plain(ids[:2]).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    norm = ct.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))  # folded into q/k/v


def test_rotation_makes_low_bit_activations_closer_to_float(world, tmp_path):
    """The point of it: with 30x outlier channels in the residual stream, 4-bit dynamic per-token activations of
    the rotated model are much closer to the float model's outputs than without rotation (same recipe)."""
    d, llama, ids = world
    base = ("version: 1\ndefaults:\n  weights: {bitwidth: 8, granularity: per_channel}\n"
            "  activations: {bitwidth: 4, granularity: per_token, dynamic: true}\n"
            "ignore: [lm_head]\nlayers:\n  - {type: Embedding, weights: null, activations: null}\n")
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(llama)).eval()
    with torch.no_grad():
        ref = plain(ids).logits
    errs = {}
    for name, recipe in (("plain", base), ("rot", base + "rotate: {rotations: [r1, r2]}\n")):
        code, _, err = _calibrate(world, tmp_path / name, recipe, data=False)
        assert code == 0, err
        fq = qtool.load_calibrated(str(llama), str(tmp_path / name / "run" / "encodings.json"))
        with torch.no_grad():
            errs[name] = float((fq(ids).logits - ref).pow(2).mean())
    assert errs["rot"] < errs["plain"] / 2, errs


@pytest.mark.parametrize("text, needle", [
    ("rotate: {rotations: [r4]}", "online"),
    ("rotate: {rotations: [r1, r1]}", "listed twice"),
    ("rotate: {type: cayley}", "type"),
    ("rotate: {rotations: []}", "rotations"),
    ("rotate: {block_size: 0}", "block_size"),
])
def test_recipe_errors(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_recipe("version: 1\n" + text + "\n")


def test_models_it_cannot_rotate_are_one_line_and_write_nothing(tmp_path):
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    cases = [
        (_llama(tmp_path / "wide", hidden=184, heads=4), "rotate: {rotations: [r1]}", "hidden size 184"),
        (_llama(tmp_path / "heads", hidden=184, heads=4), "rotate: {rotations: [r2]}", "head_dim 46"),
        (_llama(tmp_path / "block", hidden=96, heads=4), "rotate: {block_size: 36}", "does not divide the hidden"),
        (_llama(tmp_path / "block2", hidden=96, heads=4), "rotate: {block_size: 6}", "block_size 6"),
    ]
    for i, (model, text, needle) in enumerate(cases):
        recipe = W4A16_ROT.replace("rotate: {rotations: [r1, r2]}", text).replace("block_size: 32", "block_size: 8")
        (tmp_path / "r.yaml").write_text(recipe)
        code, _, err = run_cli("calibrate", model, "-c", tmp_path / "r.yaml", "-o", tmp_path / f"out{i}")
        errors = [e for e in error_lines(err) if e.startswith("error")]
        assert code == 2 and len(errors) == 1 and needle in errors[0], err
        assert not (tmp_path / f"out{i}").exists()


def test_a_model_that_is_not_llama_family_is_refused():
    from tests.tinymodels import mlp

    with pytest.raises(ConfigError, match="no Llama-family decoder layers"):
        resolve_plan(parse_recipe("version: 1\nrotate: {}\n"), mlp())


def test_r1_unties_a_tied_output_layer_and_every_format_writes_it(tmp_path):
    """Tied embeddings (SmolLM2's case): the final norm folds into the output layer alone, so r1 gives it a weight
    of its own; the fake-quant model, compressed-tensors (tie_word_embeddings false) and GGUF (output.weight) all
    carry it, and the float function is unchanged."""
    gguf = pytest.importorskip("gguf")
    from tests.test_gguf import _tiny_llama

    llama = _tiny_llama(tmp_path / "tied", True)
    with torch.no_grad():  # norms that are not all ones, so the untie matters
        model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
        model.model.norm.weight.uniform_(0.5, 1.5)
        model.save_pretrained(llama)
    ids = torch.randint(1, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    (tmp_path / "r.yaml").write_text(W4A16_ROT.replace("ignore: [lm_head]\n", ""))
    code, out, err = run_cli("calibrate", llama, "-c", tmp_path / "r.yaml", "-o", tmp_path / "run")
    assert code == 0, err
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["rotation"]["untied"] == ["lm_head"]
    fq = qtool.load_calibrated(str(llama), str(tmp_path / "run" / "encodings.json"))
    assert fq.lm_head.weight is not fq.model.embed_tokens.weight
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(llama)).eval()
    with torch.no_grad():
        quantized = fq(ids).logits
        set_quantization(fq, False)
        a, b = fq(ids).logits, plain(ids).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    for fmt in ("compressed-tensors", "gguf"):
        code, _, err = run_cli("export", llama, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / fmt,
                               "--format", fmt, *(("--gguf-fallback", "f32") if fmt == "gguf" else ()))
        assert code == 0, err
    assert json.loads((tmp_path / "compressed-tensors" / "config.json").read_text())["tie_word_embeddings"] is False
    ct = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "compressed-tensors")).eval()
    with torch.no_grad():
        assert torch.equal(ct(ids).logits, quantized)
    reader = gguf.GGUFReader(str(next((tmp_path / "gguf").glob("*.gguf"))))
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight"} <= names


@pytest.mark.parametrize("tied", [False, True])
def test_sequential_fuses_the_same_rotations_block_by_block(tmp_path, tied):
    """--sequential rotates each part as it loads it (table, each block, the output layer) and writes the bytes of
    the whole-model run: the same encodings, the same rotated tensors (an untied output layer included)."""
    llama = _llama(tmp_path / "m", tied=tied)
    ids = torch.randint(0, 256, (6, 12), generator=torch.Generator().manual_seed(4))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    recipe = W4A16_ROT.replace("ignore: [lm_head]\n", "").replace("block_size: 32", "block_size: 16")
    (tmp_path / "r.yaml").write_text(recipe.replace("[r1, r2]", "[r1, r2], type: random-hadamard, seed: 9"))
    runs = {}
    for mode in ("memory", "sequential"):
        code, _, err = run_cli("calibrate", llama, "-c", tmp_path / "r.yaml", "--data", tmp_path / "ids.safetensors",
                               "-o", tmp_path / mode, *(("--sequential",) if mode == "sequential" else ()))
        assert code == 0, err
        runs[mode] = {f.name: f.read_bytes() for f in (tmp_path / mode).iterdir() if f.name != "manifest.json"}
    assert set(runs["memory"]) == {"encodings.json", "encodings.safetensors", "codes.safetensors"}
    assert runs["sequential"] == runs["memory"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "sequential" / "codes.safetensors"), "pt") as fh:
        assert ("float/lm_head.weight" in fh.keys()) and ("float/model.embed_tokens.weight" in fh.keys())
