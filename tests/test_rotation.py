"""Hadamard rotations (R1, R2) fused into a Llama-family model: exactly orthogonal at the widths used, the float
model's function unchanged by every rotation, outliers spread, the rotated weights in every exported file, and
bad input one line."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

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
    r = rotation_matrix(n, kind, seed)
    assert torch.allclose(hadamard_transform(x, kind, seed), x @ r, atol=1e-12, rtol=0)
    assert torch.allclose(hadamard_transform(x, kind, seed, inverse=True), x @ r.T, atol=1e-12, rtol=0)
    assert torch.allclose(hadamard_transform(hadamard_transform(x, kind, seed), kind, seed, inverse=True), x,
                          atol=1e-12, rtol=0)


@pytest.mark.parametrize("n", [3, 6, 9, 18, 184, 11008])
def test_a_width_with_no_construction_is_refused(n):
    with pytest.raises(HadamardError, match=f"width {n}"):
        hadamard_order(n)


def _llama(dest, hidden=96, heads=4, kv=2, tied=False, model_type="llama", mlp_outliers=False):
    """A random tiny Llama-family model with a few 30x outlier channels in its residual stream (non-power-of-two
    widths: 96 = 12·8, head_dim 24 = 12·2, intermediate 192 = 12·16); ``mlp_outliers``: and in ``down_proj``'s
    input (a few of ``up_proj``'s rows 30x), which only r4 reaches."""
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
        if mlp_outliers:
            for layer in model.model.layers:
                layer.mlp.up_proj.weight[:4] *= 30
    model.eval().save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("rot")
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, d / "ids.safetensors")
    return d, _llama(d / "llama"), ids


ROTATIONS = [["r1"], ["r2"], ["r4"], ["r1", "r2"], ["r1", "r2", "r4"]]


def _rotated(model, rotate_spec: str, vocab: int = 256):
    """``(logits before, logits after, changed tensors)`` of fusing ``rotate: ROTATE_SPEC`` into ``model``, on
    two fixed windows of 12 token ids."""
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    changed = rotate(model, resolve_plan(parse_recipe(f"version: 1\nrotate: {rotate_spec}\n"), model).rotation)
    with torch.no_grad():
        after = model(ids).logits
    return before, after, changed


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("rotations", ROTATIONS)
@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_every_fused_rotation_leaves_the_float_outputs_unchanged(tmp_path, model_type, rotations, kind):
    path = _llama(tmp_path / "m", model_type=model_type)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    before, after, changed = _rotated(model, f"{{rotations: {rotations}, type: {kind}, seed: 3}}")
    assert (after - before).abs().max() <= 1e-5 * before.abs().max()
    if "r1" in rotations:
        assert torch.equal(model.model.norm.weight, torch.ones(96))
        assert "model.embed_tokens.weight" in changed and "lm_head.weight" in changed
    else:
        expected = {f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)} if "r4" in rotations else set()
        if "r2" in rotations:
            expected |= {f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("v_proj", "o_proj")} \
                | ({f"model.layers.{i}.self_attn.v_proj.bias" for i in range(2)} if model_type == "qwen2" else set())
        assert set(changed) == expected


@pytest.mark.parametrize("block", [12, 24, 48])
def test_a_block_diagonal_r1_leaves_the_float_outputs_unchanged(tmp_path, block):
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama(tmp_path / "m", tied=True)).eval()
    before, after, changed = _rotated(model, f"{{block_size: {block}, type: random-hadamard}}")
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
    ("rotate: {rotations: [r3]}", "r3 rotates the keys a quantized KV cache stores"),  # without kv_cache
    ("rotate: {rotations: [r1, r1]}", "listed twice"),
    ("rotate: {type: cayley}", "type"),
    ("rotate: {rotations: []}", "rotations"),
    ("rotate: {block_size: 0}", "block_size"),
    ("rotate: {rotations: [r2, r4], block_size: 16}", "lists no r1"),  # (it was taken, and rotated nothing in blocks)
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
        (_llama(tmp_path / "inner", hidden=184, heads=4), "rotate: {rotations: [r4]}", "intermediate size 368"),
        (_llama(tmp_path / "keys", hidden=72, heads=4), "rotate: {rotations: [r3]}\nkv_cache: {}", "r3 rotates the "
         "head_dim 18"),
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


def test_refusals_name_what_the_model_has():
    """OLMo-2 (norms after attention and the MLP) read "input_layernorm is a NoneType, not an RMSNorm"; a Qwen2-MoE
    whose shared expert is wider than its routed ones, alike in every layer, "width differs between layers"."""
    cfg = transformers.Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    olmo = transformers.Olmo2ForCausalLM(cfg)
    with pytest.raises(ConfigError, match="model.layers.0.input_layernorm does not exist; r1 folds the norms of "
                       "pre-norm Llama-family layers"):
        resolve_plan(parse_recipe("version: 1\nrotate: {rotations: [r1]}\n"), olmo)
    cfg = transformers.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    from qtool.model.experts import linearize_experts

    moe = transformers.Qwen2MoeForCausalLM(cfg)
    linearize_experts(moe, [n for n, _ in moe.named_parameters()])
    with pytest.raises(ConfigError, match=r"r4 rotates every down_proj's input by one Hadamard order, and their "
                       r"widths differ: 16 \(model.layers.0.mlp.experts.0.down_proj\); 32 "
                       r"\(model.layers.0.mlp.shared_expert.down_proj\)"):
        resolve_plan(parse_recipe("version: 1\nrotate: {rotations: [r4]}\n"), moe)


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
    (tmp_path / "r.yaml").write_text(recipe.replace("[r1, r2]", "[r1, r2, r3, r4], type: random-hadamard, seed: 9")
                                     + "kv_cache: {granularity: per_head}\n")
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


def _online_fake_quant_logits(llama, encodings, ids, rotated):
    """The fake-quant model's logits after load_calibrated, which puts the online rotations back on exactly the
    ``rotated`` modules; with quantization off, the rotated model computes the float model's function."""
    from qtool.model.online import online_rotations

    fq = qtool.load_calibrated(str(llama), str(encodings))
    assert sorted(online_rotations(fq)) == rotated
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(llama)).eval()
    with torch.no_grad():
        ref = fq(ids).logits
        set_quantization(fq, False)
        a, b = fq(ids).logits, plain(ids).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()  # rotated float model == float model
    return ref


W4A16_R4 = W4A16_ROT.replace("[r1, r2]", "[r1, r2, r4], type: TYPE, seed: 3")


@pytest.mark.parametrize("kind, hidden", [("random-hadamard", 96), ("hadamard", 64)])
def test_r4_runs_online_through_reload_and_compressed_tensors(tmp_path, kind, hidden):
    """R4: down_proj's weight holds W R and its input is rotated at run time. The encodings file records it
    (schema version 4), load_calibrated puts the rotation back, the float function is unchanged, and the
    compressed-tensors export carries it as transform_config plus each layer's matrix: compressed-tensors' own
    transform applied to the reloaded model gives the fake-quant model's outputs. With a power-of-two width and
    ``hadamard``, compressed-tensors' own Sylvester matrix is qtool's (its ``hadamard`` type, no matrix needed)."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from safetensors import safe_open

    llama = _llama(tmp_path / "m", hidden=hidden, mlp_outliers=True)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    (tmp_path / "r.yaml").write_text(W4A16_R4.replace("TYPE", kind))
    code, _, err = run_cli("calibrate", llama, "-c", tmp_path / "r.yaml", "-o", tmp_path / "run")
    assert code == 0, err
    enc = json.loads((tmp_path / "run" / "encodings.json").read_text())
    assert enc["schema_version"] == 4
    assert enc["online_rotations"] == [{"name": "r4", "type": kind, "seed": 3, "location": "input",
                                        "modules": [f"model.layers.{i}.mlp.down_proj" for i in range(2)]}]
    ref = _online_fake_quant_logits(llama, tmp_path / "run" / "encodings.json", ids,
                                    [f"model.layers.{i}.mlp.down_proj" for i in range(2)])

    code, out, err = run_cli("export", llama, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / "ct",
                             "--format", "compressed-tensors", "--json")
    assert code == 0, err
    assert any("transform_config" in w for w in json.loads(out)["export_warnings"])
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["transform_config"]
    scheme = TransformConfig.model_validate(cfg).config_groups["R4"]
    assert scheme.type == ("hadamard" if hidden == 64 else "random-hadamard")
    assert [(a.location, a.inverse) for a in scheme.apply] == [("input", False), ("weight_input", True)]
    ct = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct")).eval()
    with torch.no_grad():
        without = ct(ids).logits  # what transformers alone computes: the online part is missing
    assert (without - ref).abs().max() > 1e-2 * ref.abs().max()
    online = scheme.model_copy(update={"apply": [a for a in scheme.apply if a.location == "input"]})
    apply_transform_config(ct, TransformConfig(config_groups={"R4": online}))
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as fh:
        mats = {k: fh.get_tensor(k) for k in fh.keys() if ".R4_input." in k}
    assert sorted(mats) == [f"model.layers.{i}.mlp.down_proj.R4_input.weight" for i in range(2)]
    assert all(set(m.unique().tolist()) == {-1.0, 1.0} for m in mats.values())
    if kind == "random-hadamard":  # compressed-tensors' own random matrix is not qtool's: the file's is loaded
        ct.load_state_dict(mats, strict=False)
    else:
        assert torch.equal(ct.model.layers[0].mlp.down_proj.R4_input.weight, mats["model.layers.0.mlp.down_proj.R4_input.weight"])
    with torch.no_grad():
        got = ct(ids).logits
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()

    code, _, err = run_cli("export", llama, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / "q",
                           "--format", "qtool")
    assert code == 0, err
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as fh:
        assert json.loads(fh.metadata()["qtool_online_rotations"]) == enc["online_rotations"]


def test_formats_that_cannot_run_r4_refuse_it_in_one_line(world, r4_run, tmp_path):
    d, llama, _ = world
    (tmp_path / "r.yaml").write_text(W4A16_R4.replace("TYPE", "hadamard"))
    for fmt in ("aimet", "gguf", "onnx"):
        code, _, err = run_cli("export", llama, "-e", r4_run / "encodings.json", "-o", tmp_path / fmt,
                               "--format", fmt, "--data", d / "ids.safetensors")
        errors = [e for e in error_lines(err) if e.startswith("error")]
        assert code == 2 and len(errors) == 1 and "rotation of activations at run time" in errors[0], err
        assert not (tmp_path / fmt).exists()
    # quantize refuses before calibrating
    code, _, err = run_cli("quantize", llama, "-c", tmp_path / "r.yaml", "-o", tmp_path / "qz", "--format", "aimet")
    assert code == 2 and "rotation of activations at run time" in err and not (tmp_path / "qz").exists()


def test_r4_makes_4bit_activations_of_down_proj_closer_to_float(tmp_path):
    """What R4 is for: with outlier channels in down_proj's input (SwiGLU's product), 4-bit dynamic activations
    there are much closer to the float model after r1 r2 r4 than after r1 r2, which do not reach that input."""
    llama = _llama(tmp_path / "m", mlp_outliers=True)
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    base = ("version: 1\ndefaults:\n  weights: null\n  activations: null\nlayers:\n"
            "  - {match: '*down_proj', activations: {bitwidth: 4, granularity: per_token, dynamic: true}}\n")
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(llama)).eval()
    with torch.no_grad():
        ref = plain(ids).logits
    errs = {}
    for name, rot in (("r1r2", "[r1, r2]"), ("r1r2r4", "[r1, r2, r4]")):
        (tmp_path / f"{name}.yaml").write_text(base + f"rotate: {{rotations: {rot}}}\n")
        code, _, err = run_cli("calibrate", llama, "-c", tmp_path / f"{name}.yaml", "-o", tmp_path / name)
        assert code == 0, err
        fq = qtool.load_calibrated(str(llama), str(tmp_path / name / "encodings.json"))
        with torch.no_grad():
            errs[name] = float((fq(ids).logits - ref).pow(2).mean())
    assert errs["r1r2r4"] < errs["r1r2"] / 4, errs


def test_smoothquant_on_a_layer_r4_rotates_is_refused():
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2))
    recipe = parse_recipe("version: 1\nsmoothquant: {alpha: 0.5}\nrotate: {rotations: [r1, r4]}\n")
    with pytest.raises(ConfigError, match="r4 rotates at run time"):
        resolve_plan(recipe, model)


@pytest.fixture(scope="module")
def r4_run(world, tmp_path_factory):
    """The world's model calibrated W4A16 with r1 r2 r4: its run directory."""
    d = tmp_path_factory.mktemp("r4run")
    (d / "r.yaml").write_text(W4A16_R4.replace("TYPE", "hadamard"))
    code, _, err = run_cli("calibrate", world[1], "-c", d / "r.yaml", "-o", d / "run")
    assert code == 0, err
    return d / "run"


def _edited(run, tmp_path, edit):
    """A copy of ``run`` whose first online rotation ``edit`` changed; returns its encodings.json."""
    import shutil

    shutil.copytree(run, tmp_path / "run")
    path = tmp_path / "run" / "encodings.json"
    obj = json.loads(path.read_text())
    edit(obj["online_rotations"][0])
    path.write_text(json.dumps(obj))
    return path


@pytest.mark.parametrize("edit, needle", [
    (lambda r: r.update(type="cayley"), "type"),
    (lambda r: r.update(location="output"), "location"),
    (lambda r: r.update(seed=-1), "seed"),
    (lambda r: r.update(modules=[]), "modules"),
    (lambda r: r.update(modules=["a", "a"]), "twice"),
    (lambda r: r.pop("name"), "name"),
])
def test_a_bad_online_rotation_in_an_encodings_file_is_one_line(world, r4_run, tmp_path, edit, needle):
    llama = world[1]
    path = _edited(r4_run, tmp_path, edit)
    code, _, err = run_cli("export", llama, "-e", path, "-o", tmp_path / "out", "--format", "qtool")
    errors = [e for e in error_lines(err) if e.startswith("error")]
    assert code == 2 and len(errors) == 1 and "online_rotations[0]" in errors[0] and needle in errors[0], err
    assert not (tmp_path / "out").exists()


def test_an_online_rotation_of_a_module_the_model_lacks_is_one_line(world, r4_run, tmp_path):
    llama = world[1]
    path = _edited(r4_run, tmp_path, lambda r: r["modules"].__setitem__(0, "model.layers.9.mlp.down_proj"))
    with pytest.raises(qtool.errors.EncodingsError, match="model.layers.9.mlp.down_proj"):
        qtool.load_calibrated(str(llama), str(path))


@settings(max_examples=40, deadline=None)
@given(rots=st.lists(st.tuples(st.sampled_from(["r4", "rx"]), st.sampled_from(["hadamard", "random-hadamard"]),
                               st.integers(0, 2**63 - 1), st.lists(st.from_regex(r"[a-z]{1,3}(\.[0-9]{1,2}){0,2}",
                                                                                 fullmatch=True),
                                                                   min_size=1, max_size=4, unique=True)),
                     max_size=3))
def test_online_rotations_round_trip_through_the_encodings_file(tmp_path_factory, rots):
    """Whatever online rotations a file lists come back as written (modules unique across the list), and a file
    with none keeps its old version."""
    from qtool.config import OnlineRotation
    from qtool.encodings import EncodingsFile

    seen, online = set(), []
    for name, kind, seed, mods in rots:
        mods = [m for m in mods if m not in seen]
        seen.update(mods)
        if mods and all(o.name != name for o in online):
            online.append(OnlineRotation(name, kind, seed, tuple(mods)))
    path = tmp_path_factory.mktemp("enc") / "encodings.json"
    EncodingsFile([], {"recipe": "r.yaml"}, online=online).write(path)
    back = EncodingsFile.read(path)
    assert back.online == online and back.meta == {"recipe": "r.yaml"}
    assert json.loads(path.read_text())["schema_version"] == (4 if online else 1)


def test_two_online_rotations_of_one_name_are_refused(tmp_path):
    """Exporters name a transform after its rotation (compressed-tensors' R3, R4): a second of the same name would
    silently replace the first there."""
    from qtool.config import OnlineRotation
    from qtool.encodings import EncodingsFile

    path = tmp_path / "encodings.json"
    EncodingsFile([], {}, online=[OnlineRotation("r4", "hadamard", 0, ("a",)),
                                  OnlineRotation("r4", "hadamard", 0, ("b",))]).write(path)
    with pytest.raises(qtool.errors.EncodingsError, match=r"online_rotations\[1\]: name 'r4' is used twice"):
        EncodingsFile.read(path)


def test_report_measures_an_r4_layer_on_its_input_rotated_once(world, tmp_path):
    """qtool report runs each layer alone on the input the model gave it: with r4, down_proj's isolated SQNR is that
    of its own quantization (close to the unrotated model's), not of an input rotated twice."""
    d, llama, _ = world
    base = ("version: 1\ndefaults:\n  weights: {bitwidth: 8, granularity: per_channel}\n  activations: null\n"
            "ignore: [lm_head]\nlayers:\n  - {type: Embedding, weights: null}\n")
    sqnr = {}
    for name, rot in (("plain", ""), ("r4", "rotate: {rotations: [r4]}\n")):
        (tmp_path / f"{name}.yaml").write_text(base + rot)
        code, _, err = run_cli("calibrate", llama, "-c", tmp_path / f"{name}.yaml", "-o", tmp_path / name)
        assert code == 0, err
        code, out, err = run_cli("report", llama, "-e", tmp_path / name / "encodings.json", "--data",
                                 d / "ids.safetensors", "--json")
        assert code == 0, err
        layers = json.loads(out)["layers"]
        sqnr[name] = next(r["sqnr_isolated_db"] for r in layers if r["module"] == "model.layers.0.mlp.down_proj")
    assert sqnr["r4"] > 30 and abs(sqnr["r4"] - sqnr["plain"]) < 6, sqnr


def test_a_version_3_file_with_online_rotations_is_refused(r4_run, tmp_path):
    import shutil

    from qtool.encodings import EncodingsFile

    shutil.copytree(r4_run, tmp_path / "run")
    path = tmp_path / "run" / "encodings.json"
    obj = json.loads(path.read_text())
    obj["schema_version"] = 3
    path.write_text(json.dumps(obj))
    with pytest.raises(qtool.errors.EncodingsError, match="needs schema_version 4"):
        EncodingsFile.read(path)


def test_an_importance_matrix_with_a_rotation_is_one_line(world, tmp_path):
    """An importance matrix measured the unrotated inputs; with rotate they are other columns: refused."""
    d, llama, _ = world
    (tmp_path / "r.yaml").write_text(W4A16_R4.replace("TYPE", "hadamard").replace(
        "block_size: 32}", "block_size: 32, analyzer: {name: mse, weighting: activations}}"))
    (tmp_path / "imatrix.gguf").write_bytes(b"GGUF")
    code, _, err = run_cli("calibrate", llama, "-c", tmp_path / "r.yaml", "-o", tmp_path / "run", "--imatrix",
                           tmp_path / "imatrix.gguf")
    errors = [e for e in error_lines(err) if e.startswith("error")]
    assert code == 2 and len(errors) == 1 and "rotate" in errors[0], err
    assert not (tmp_path / "run").exists()


def test_r4_alone_rotates_a_bert_encoders_mlp_output_online(tmp_path):
    """R4 needs nothing of the architecture but a Linear after the MLP's activation: on a BERT-style encoder
    (post-LayerNorm, where r1/r2 do not apply) it rotates each output.dense's input, the float outputs stay the
    same, and the fake-quant model reloads with it."""
    from qtool.model.online import online_rotations

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    transformers.BertModel(cfg).eval().save_pretrained(tmp_path / "bert")
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(2))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 8, granularity: per_channel}\n"
                                     "  activations: {bitwidth: 8, granularity: per_token, dynamic: true}\n"
                                     "layers:\n  - {type: Embedding, weights: null, activations: null}\n"
                                     "rotate: {rotations: [r4], type: random-hadamard, seed: 4}\n")
    code, _, err = run_cli("calibrate", tmp_path / "bert", "-c", tmp_path / "r.yaml", "--data",
                           tmp_path / "ids.safetensors", "-o", tmp_path / "run")
    assert code == 0, err
    enc = json.loads((tmp_path / "run" / "encodings.json").read_text())
    assert enc["online_rotations"][0]["modules"] == [f"encoder.layer.{i}.output.dense" for i in range(2)]
    fq = qtool.load_calibrated(str(tmp_path / "bert"), str(tmp_path / "run" / "encodings.json"))
    assert sorted(online_rotations(fq)) == [f"encoder.layer.{i}.output.dense" for i in range(2)]
    plain = transformers.AutoModel.from_pretrained(str(tmp_path / "bert")).eval()
    with torch.no_grad():
        set_quantization(fq, False)
        a, b = fq(ids).last_hidden_state, plain(ids).last_hidden_state
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    with pytest.raises(ConfigError, match="Llama-family"):  # r1 still needs a Llama
        resolve_plan(parse_recipe("version: 1\nrotate: {rotations: [r1, r4]}\n"), plain)


KV_R3 = ("version: 1\ndefaults:\n  weights: {element: fp8_e4m3, granularity: per_channel}\n  activations: null\n"
         "layers:\n  - {type: Embedding, weights: null}\nignore: [lm_head]\nkv_cache: {granularity: GRAN}\n")


@pytest.mark.parametrize("kind, hidden, gran", [("hadamard", 64, "per_head"), ("random-hadamard", 96, "per_tensor")])
def test_r3_rotates_the_cached_keys_through_reload_and_compressed_tensors(tmp_path, monkeypatch, kind, hidden, gran):
    """R3: each attention layer's KV cache quantizer sees its keys rotated per head (k R); q kᵀ is unchanged, so
    the float function is too. The encodings file records it (location k_cache), load_calibrated puts it back,
    and the compressed-tensors export writes transform_config R3 (q_attn and k_cache, head_dim) plus the
    matrices: compressed-tensors' own transforms on the reloaded model give the fake-quant model's logits, and
    without them the logits move (what a runtime that ignores R3 computes)."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from safetensors import safe_open

    llama = _llama(tmp_path / "m", hidden=hidden)
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    head_dim, attn = hidden // 4, [f"model.layers.{i}.self_attn" for i in range(2)]
    scales = {}
    for name, extra in (("plain", ""), ("r3", f"rotate: {{rotations: [r3], type: {kind}, seed: 2}}\n")):
        (tmp_path / f"{name}.yaml").write_text(KV_R3.replace("GRAN", gran) + extra)
        code, _, err = run_cli("calibrate", llama, "-c", tmp_path / f"{name}.yaml", "--data",
                               tmp_path / "ids.safetensors", "-o", tmp_path / name)
        assert code == 0, err
        enc = json.loads((tmp_path / name / "encodings.json").read_text())
        scales[name] = [q["max"] for q in enc["quantizers"] if q["tensor"] == "k_cache"]
    assert enc["schema_version"] == 4
    assert enc["online_rotations"] == [{"name": "r3", "type": kind, "seed": 2, "location": "k_cache",
                                        "modules": attn}]
    assert scales["r3"] != scales["plain"]  # the key ranges were measured on rotated keys
    ref = _online_fake_quant_logits(llama, tmp_path / "r3" / "encodings.json", ids, attn)

    code, out, err = run_cli("export", llama, "-e", tmp_path / "r3" / "encodings.json", "-o", tmp_path / "ct",
                             "--format", "compressed-tensors", "--json")
    assert code == 0, err
    assert any("r3" in w and "vLLM" in w for w in json.loads(out)["export_warnings"])
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    scheme = TransformConfig.model_validate(cfg["transform_config"]).config_groups["R3"]
    assert scheme.type == ("hadamard" if kind == "hadamard" else "random-hadamard") and scheme.head_dim == head_dim
    assert [(a.location, a.inverse, a.targets) for a in scheme.apply] == [("q_attn", False, attn),
                                                                         ("k_cache", False, attn)]
    ct = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct")).eval()
    with torch.no_grad():
        without = ct(ids).logits
    assert (without - ref).abs().max() > 1e-4 * ref.abs().max()
    # compressed-tensors 0.20's hooked attention (which q_attn installs) also quantizes the queries with the KV
    # cache's scheme and a q_scale; qtool quantizes keys and values only (kv_cache), so that step is left out
    import compressed_tensors.modeling.attention as ct_attention

    real = ct_attention.forward_quantize
    monkeypatch.setattr(ct_attention, "forward_quantize",
                        lambda module, value, base, args: value if base == "q" else real(module, value, base, args))
    apply_transform_config(ct, TransformConfig(config_groups={"R3": scheme}))
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as fh:
        mats = {k: fh.get_tensor(k) for k in fh.keys() if ".R3_" in k}
    assert sorted(mats) == sorted(f"{a}.R3_{loc}.weight" for a in attn for loc in ("k_cache", "q_attn"))
    assert all(m.shape == (head_dim, head_dim) and set(m.unique().tolist()) == {-1.0, 1.0} for m in mats.values())
    if kind == "random-hadamard":  # compressed-tensors' own random matrix is not qtool's: the file's is loaded
        assert not ct.load_state_dict(mats, strict=False).unexpected_keys
    else:  # a power-of-two head_dim: compressed-tensors' Sylvester matrix is qtool's
        assert torch.equal(ct.model.layers[0].self_attn.R3_k_cache.weight, mats[f"{attn[0]}.R3_k_cache.weight"])
    with torch.no_grad():
        got = ct(ids).logits
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()

    code, _, err = run_cli("export", llama, "-e", tmp_path / "r3" / "encodings.json", "-o", tmp_path / "g.gguf",
                           "--format", "gguf")
    assert code == 2 and "r3" in err and not (tmp_path / "g.gguf").exists(), err


def test_an_r3_rotation_of_a_layer_without_a_quantized_kv_cache_is_refused(tmp_path):
    llama = _llama(tmp_path / "m", hidden=64)
    save_file({"input_ids": torch.randint(0, 256, (2, 8))}, tmp_path / "ids.safetensors")
    (tmp_path / "r.yaml").write_text(KV_R3.replace("GRAN", "per_tensor") + "rotate: {rotations: [r3]}\n")
    code, _, err = run_cli("calibrate", llama, "-c", tmp_path / "r.yaml", "--data", tmp_path / "ids.safetensors",
                           "-o", tmp_path / "run")
    assert code == 0, err
    path = tmp_path / "run" / "encodings.json"
    # the report measures an attention layer's KV cache quantizers alone on a fresh cache (it once reused the float
    # pass's cache, which already held the keys, and printed an isolated SQNR of inf)
    code, out, err = run_cli("report", llama, "-e", path, "--data", tmp_path / "ids.safetensors", "--json")
    assert code == 0, err
    attn = [r for r in json.loads(out)["layers"] if r["module"].endswith("self_attn")]
    assert len(attn) == 2 and all(isinstance(r["sqnr_isolated_db"], float) and 10 < r["sqnr_isolated_db"] < 80
                                  for r in attn), attn
    enc = json.loads(path.read_text())
    enc["quantizers"] = [q for q in enc["quantizers"] if q["module"] != "model.layers.1.self_attn"]
    path.write_text(json.dumps(enc))
    code, _, err = run_cli("export", llama, "-e", path, "-o", tmp_path / "q", "--format", "qtool")
    errors = [e for e in error_lines(err) if e.startswith("error")]
    assert code == 2 and len(errors) == 1 and "model.layers.1.self_attn" in errors[0], err
    assert "no quantized KV cache" in errors[0] and not (tmp_path / "q").exists()


def test_config_show_names_the_rotations_and_where_each_online_one_runs(tmp_path):
    llama = _llama(tmp_path / "m", hidden=64)
    (tmp_path / "r.yaml").write_text(KV_R3.replace("GRAN", "per_head")
                                     + "rotate: {rotations: [r1, r2, r3, r4], type: random-hadamard, seed: 5}\n")
    code, out, err = run_cli("config", "show", tmp_path / "r.yaml", "-m", llama, "--json")
    assert code == 0, err
    rot = json.loads(out)["rotation"]
    assert rot["rotations"] == ["r1", "r2", "r3", "r4"] and rot["type"] == "random-hadamard" and rot["seed"] == 5
    assert [(o["name"], o["location"], o["modules"][0], len(o["modules"])) for o in rot["online"]] == [
        ("r3", "k_cache", "model.layers.0.self_attn", 2), ("r4", "input", "model.layers.0.mlp.down_proj", 2)]
    code, out, err = run_cli("config", "show", tmp_path / "r.yaml", "-m", llama)
    text = " ".join(out.split())
    assert code == 0 and "r1 r2 fused into the weights" in text and "r3 online (queries and cached keys) on 2" in text
    code, out, err = run_cli("config", "show", tmp_path / "r.yaml")  # without a model: the recipe's rotate key
    assert code == 0 and "rotate:" in out and "- r3" in out, out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_mixture_of_experts_model_rotates_through_its_router_and_every_expert(tmp_path, family):
    """r1 reads the residual stream in every expert's gate/up and in the router (the norm folded into all of
    them) and writes it in every expert's down; r4 rotates each expert's down input online. The float model
    computes what it did (the same routing), --sequential writes the in-memory bytes, and the fake-quant model
    reloads from the qtool export (Mixtral's router is block_sparse_moe.gate in the checkpoint)."""
    from tests.test_experts import _saved

    ckpt, ids = _saved(tmp_path, family)
    recipe = W4A16_ROT.replace("[r1, r2]", "[r1, r2, r4]")
    (tmp_path / "r.yaml").write_text(recipe)
    runs = {}
    for mode in ("memory", "sequential"):
        code, _, err = run_cli("calibrate", ckpt, "-c", tmp_path / "r.yaml", "--data", ids, "-o", tmp_path / mode,
                               "--quiet", *(("--sequential",) if mode == "sequential" else ()))
        assert code == 0, err
        runs[mode] = {f.name: f.read_bytes() for f in (tmp_path / mode).iterdir() if f.name != "manifest.json"}
    assert runs["sequential"] == runs["memory"]
    online = json.loads(runs["memory"]["encodings.json"])["online_rotations"][0]["modules"]
    leaf = "w2" if family == "mixtral" else "down_proj"
    assert f"model.layers.1.mlp.experts.7.{leaf}" in online and len(online) == 2 * 8
    x = load_file(ids)["input_ids"][:2]
    fq = qtool.load_calibrated(str(ckpt), str(tmp_path / "memory" / "encodings.json")).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    with torch.no_grad():
        want = fq(x).logits
        set_quantization(fq, False)
        a, b = fq(x).logits, plain(x).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()  # rotated float model = the float model
    code, _, err = run_cli("export", ckpt, "-e", tmp_path / "memory" / "encodings.json", "-o", tmp_path / "q",
                           "--format", "qtool", "--quiet")
    assert code == 0, err
    from qtool.export.qtool_st import read_integer_export

    written = read_integer_export(tmp_path / "q")
    stored = "block_sparse_moe" if family == "mixtral" else "mlp"
    fq_params = dict(fq.named_parameters())
    router = written[f"model.layers.1.{stored}.gate.weight"]  # the rotated router, under its checkpoint name
    assert torch.equal(router, fq_params["model.layers.1.mlp.gate.weight"])
    assert not torch.equal(router, plain.state_dict()["model.layers.1.mlp.gate.weight"])
    del want


def test_a_rotation_of_a_layer_without_the_mlp_it_needs_says_the_module_does_not_exist(tmp_path):
    """gpt-oss's experts are fused, with no mlp.gate_proj: the refusal called that module 'not a Linear layer'."""
    from tests.helpers import run_cli
    from tests.test_gguf_families import _tiny

    ckpt = _tiny(tmp_path / "m", "gpt_oss")
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8-dynamic-rot", "-o", tmp_path / "run")
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and len(lines) == 1, err
    assert "model.layers.0.mlp.gate_proj does not exist; qtool rotates" in lines[0], err


@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
@pytest.mark.parametrize("rotations", [["r2"], ["r4"], ["r2", "r4"]])
def test_rotations_that_fold_no_norm_run_on_families_whose_norms_r1_cannot_fold(family, rotations):
    """Gemma 3's ``1 + w`` norms and OLMo-2's post-norms stop r1 alone: r2 and r4 rotate between two Linears (an
    r4-only Gemma 3 recipe was refused as "not an RMSNorm qtool can fold")."""
    torch.manual_seed(0)
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    if family == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **kw, num_key_value_heads=1, head_dim=16, sliding_window=8)).eval()
    else:
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**kw, num_key_value_heads=2)).eval()
    before, after, changed = _rotated(model, f"{{rotations: {rotations}}}", vocab=64)
    assert changed and (after - before).abs().max() <= 1e-5 * before.abs().max()
    with pytest.raises(ConfigError, match="r2, r3 and r4 alone fold none"):
        resolve_plan(parse_recipe("version: 1\nrotate: {rotations: [r1, r4]}\n"), model)


def test_r1_in_blocks_is_said_in_the_plan_and_recorded_in_the_manifest(tmp_path):
    """block_size changes what r1 computes: the plan line, config show's JSON and the manifest say it (a whole-width
    r1 records none, as before)."""
    llama = _llama(tmp_path / "m")
    recipe = W4A16_ROT.replace("rotate: {rotations: [r1, r2]}", "rotate: {rotations: [r1, r2], block_size: 24}")
    (tmp_path / "r.yaml").write_text(recipe)
    code, out, err = run_cli("config", "show", tmp_path / "r.yaml", "--model", llama)
    assert code == 0 and "r1 r2 fused into the weights (r1 in blocks of 24)" in out, out + err
    code, out, err = run_cli("config", "show", tmp_path / "r.yaml", "--model", llama, "--json")
    assert code == 0 and json.loads(out)["rotation"]["block_size"] == 24, out
    code, _, err = run_cli("calibrate", llama, "-c", tmp_path / "r.yaml", "-o", tmp_path / "run")
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["rotation"]["block_size"] == 24
    (tmp_path / "whole.yaml").write_text(W4A16_ROT)
    code, out, err = run_cli("config", "show", tmp_path / "whole.yaml", "--model", llama, "--json")
    assert code == 0 and "block_size" not in json.loads(out)["rotation"]
