"""The formats through the CLI: AIMET versions, import-encodings round trips, packing, compressed-tensors, inspect."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qtool.export.qtool_st import read_integer_export

from tests.helpers import run_cli
from tests.tinymodels import mlp

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MLP = "tests.tinymodels:mlp"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("fmt")
    save_file(mlp().state_dict(), d / "m.safetensors")
    save_file({"x": torch.randn(32, 64, generator=torch.Generator().manual_seed(0))}, d / "data.safetensors")
    for recipe in ("w8a8", "w4a8-block32"):
        code, _, err = run_cli("calibrate", d / "m.safetensors", "-c", CONFIGS / f"{recipe}.yaml", "--data",
                               d / "data.safetensors", "--model-class", MLP, "-o", d / recipe)
        assert code == 0, err
    return d


@pytest.mark.parametrize("version", ["0.6.1", "1.0.0", "2.0.0"])
@pytest.mark.parametrize("recipe", ["w8a8", "w4a8-block32"])
def test_aimet_round_trip_through_the_cli_is_exact(world, tmp_path, recipe, version):
    enc = world / recipe / "encodings.json"
    code, _, err = run_cli("export", world / "m.safetensors", "-e", enc, "-o", tmp_path / "a", "--format", "aimet",
                           "--encoding-version", version)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["manifest.json", "model.encodings"]
    aimet = json.loads((tmp_path / "a" / "model.encodings").read_text())
    assert aimet["version"] == version
    code, out, err = run_cli("import-encodings", world / "m.safetensors", tmp_path / "a" / "model.encodings",
                             "-o", tmp_path / "imp", "--model-class", MLP, "--json")
    assert code == 0, err
    assert json.loads(out)["warnings"] == []
    orig = {q["name"]: q for q in json.loads(enc.read_text())["quantizers"]}
    back = {q["name"]: q for q in json.loads((tmp_path / "imp" / "encodings.json").read_text())["quantizers"]}
    assert set(orig) == set(back)
    for name, q in orig.items():
        for key in ("scale", "offset", "bitwidth", "symmetric", "shape", "block_size", "tensor", "module"):
            assert back[name][key] == q[key], (name, key)
    # and the integer export from the imported encodings is byte-identical
    for src, dst in ((enc, "x1"), (tmp_path / "imp" / "encodings.json", "x2")):
        assert run_cli("export", world / "m.safetensors", "-e", src, "-o", tmp_path / dst)[0] == 0
    assert (tmp_path / "x1/model.safetensors").read_bytes() == (tmp_path / "x2/model.safetensors").read_bytes()


def test_aimet_encodings_alone_refuse_a_calibration_that_changed_the_weights(world, tmp_path):
    """model.encodings applies to the checkpoint's own weights: codes a rounding algorithm chose (or weights a
    rotation, SmoothQuant, AWQ or a batch-norm fold changed) would be lost, so --format aimet refuses them in one
    line, before calibrating (quantize) and from a calibration's codes file (export); nothing is written."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, symmetric: true, granularity: per_channel, "
                      "rounding: gptq}\n  activations: null\n")
    args = (world / "m.safetensors", "--data", world / "data.safetensors", "--model-class", MLP)
    code, _, err = run_cli("quantize", *args, "-c", recipe, "-o", tmp_path / "q", "--format", "aimet")
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and len(lines) == 1 and "this calibration changes them (gptq codes)" in lines[0], err
    assert not (tmp_path / "q").exists() and "calibrating" not in err
    code, _, err = run_cli("calibrate", *args, "-c", recipe, "-o", tmp_path / "c")
    assert code == 0, err
    code, _, err = run_cli("export", world / "m.safetensors", "-e", tmp_path / "c/encodings.json", "-o",
                           tmp_path / "a", "--format", "aimet", "--model-class", MLP)
    assert code == 2 and "weights or codes stored in codes.safetensors" in err and not (tmp_path / "a").exists()
    code, _, err = run_cli("export", world / "m.safetensors", "-e", tmp_path / "c/encodings.json", "-o",
                           tmp_path / "x", "--model-class", MLP)  # a format that writes the codes takes them
    assert code == 0, err


def test_import_real_aimet_sample_for_a_matching_model(tmp_path):
    """AIMET's own blockwise export of a Linear(64,32)-ReLU-Linear(32,16) model imports onto that model."""
    sample = Path(__file__).resolve().parents[2] / "shared/data/aimet/encodings-samples/blockwise_v1.0.0.encodings"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    save_file(model.state_dict(), tmp_path / "b.safetensors")
    (tmp_path / "factory.py").write_text(
        "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), "
        "torch.nn.Linear(32, 16))\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        code, out, err = run_cli("import-encodings", tmp_path / "b.safetensors", sample, "-o", tmp_path / "r",
                                 "--model-class", "factory:make", "--json")
    finally:
        sys.path.remove(str(tmp_path))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["quantizers"] == 2  # the two weights; activations carry ONNX names and are reported
    assert len(summary["warnings"]) == 3 and all("ONNX activation name" in w for w in summary["warnings"])
    q = {e["name"]: e for e in json.loads((tmp_path / "r/encodings.json").read_text())["quantizers"]}
    ref = json.loads(sample.read_text())["param_encodings"][0]
    assert q["0.weight"]["block_size"] == [1, 16] and q["0.weight"]["shape"] == [32, 4]
    flat = [s for row in q["0.weight"]["scale"] for s in row]
    assert flat == ref["scale"]


def test_sub_byte_codes_are_packed_by_default(world, tmp_path):
    enc = world / "w4a8-block32" / "encodings.json"
    assert run_cli("export", world / "m.safetensors", "-e", enc, "-o", tmp_path / "p")[0] == 0
    assert run_cli("export", world / "m.safetensors", "-e", enc, "-o", tmp_path / "u", "--no-pack")[0] == 0
    with safe_open(str(tmp_path / "p/model.safetensors"), "pt") as f:
        packed = f.get_tensor("0.weight")
        meta = json.loads(f.metadata()["qtool"])["0.weight"]
    with safe_open(str(tmp_path / "u/model.safetensors"), "pt") as f:
        unpacked = f.get_tensor("0.weight")
    assert packed.dtype == torch.uint8 and packed.shape == (128 * 64 // 2,)
    assert meta["packed"] is True and meta["shape"] == [128, 64]
    assert unpacked.dtype == torch.int8 and unpacked.shape == (128, 64)
    # low nibble first, two's complement
    low, high = (packed[0] & 0xF).item(), (packed[0] >> 4).item()
    assert [low - 16 * (low > 7), high - 16 * (high > 7)] == unpacked.reshape(-1)[:2].tolist()
    a = read_integer_export(tmp_path / "p/model.safetensors")
    b = read_integer_export(tmp_path / "u/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # each export's manifest records the options its bytes came from (the same encodings, two files)
    options = {d: json.loads((tmp_path / d / "manifest.json").read_text())["options"] for d in "pu"}
    assert options["p"] == {"pack": True, "max_shard_bytes": 5 * 10 ** 9} and options["u"]["pack"] is False


def test_inspect_reports_sizes(world, tmp_path):
    enc = world / "w4a8-block32" / "encodings.json"
    assert run_cli("export", world / "m.safetensors", "-e", enc, "-o", tmp_path / "p")[0] == 0
    code, out, err = run_cli("inspect", tmp_path / "p", "--json")
    assert code == 0, err
    rep = json.loads(out)
    rows = {r["name"]: r for r in rep["tensors"]}
    assert rows["0.weight"]["bitwidth"] == 4 and rows["0.weight"]["granularity"] == "per_block"
    assert rows["0.weight"]["block_size"] == [1, 32] and rows["0.bias"]["block_size"] is None  # (it was never shown)
    assert rows["0.weight"]["bytes"] == 128 * 64 // 2 + 128 * 2 * 4 + 128 * 2 * 4  # codes + scale + offset
    assert rows["0.bias"]["quantized"] is False
    tot = rep["totals"]
    assert tot["quantized_tensors"] == 3 and tot["tensors"] == 6
    numel = sum(t.numel() for t in mlp().state_dict().values())
    assert tot["float32_bytes"] == 4 * numel
    assert tot["ratio_vs_float32"] == pytest.approx(4 * numel / tot["bytes"])
    # the human table too
    code, out, err = run_cli("inspect", tmp_path / "p")
    assert code == 0 and "0.weight" in out and "smaller" in out and "per_block [1, 32]" in out
    for path, kind in ((enc, "qtool encodings"), (tmp_path / "p/model.encodings", "AIMET encodings 1.0.0")):
        code, out, err = run_cli("inspect", path, "--json")
        assert code == 0 and json.loads(out)["kind"] == kind
    code, _, err = run_cli("inspect", tmp_path / "nothing")
    assert code == 2 and "not found" in err


def test_a_renamed_models_aimet_round_trip_exports_the_same_bytes(tmp_path):
    """transformers 5 names a ViT's modules otherwise than its checkpoint (layers.0.attention.q_proj for
    encoder.layer.0.attention.attention.query): import-encodings named weights by module, calibrate by checkpoint
    tensor, and export of the imported file said "has no tensor ... were they made for another model?"."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 image_size=16, patch_size=8)
    transformers.ViTModel(cfg).save_pretrained(tmp_path / "vit")
    vit = tmp_path / "vit"
    assert run_cli("calibrate", vit, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "c")[0] == 0
    for args in (("-e", tmp_path / "c/encodings.json", "-o", tmp_path / "a", "--format", "aimet"),
                 ("-e", tmp_path / "c/encodings.json", "-o", tmp_path / "direct")):
        code, _, err = run_cli("export", vit, *args)
        assert code == 0, err
    code, _, err = run_cli("import-encodings", vit, tmp_path / "a/model.encodings", "-o", tmp_path / "i")
    assert code == 0, err
    names = {e["name"] for e in json.loads((tmp_path / "i/encodings.json").read_text())["quantizers"]}
    assert "encoder.layer.0.attention.attention.query.weight" in names, names
    code, _, err = run_cli("export", vit, "-e", tmp_path / "i/encodings.json", "-o", tmp_path / "x")
    assert code == 0, err
    assert (tmp_path / "x/model.safetensors").read_bytes() == (tmp_path / "direct/model.safetensors").read_bytes()


def test_names_and_paths_are_printed_as_they_are_not_as_markup(tmp_path):
    """Tensor names and paths went to rich as markup: '[/b]' in one was a MarkupError traceback (exit 1, the gate
    failure's code), '[bold]' vanished from the listing; `config validate` of 'r[/x].yaml' was an internal error."""
    d = tmp_path / "d[/x]"
    d.mkdir(parents=True)
    save_file({"layer[/b].weight": torch.zeros(2, 2), "model.layers[bold].0.weight": torch.zeros(2)},
              d / "close.safetensors", metadata={"name": "my [red]model"})
    code, out, err = run_cli("inspect", d / "close.safetensors")
    assert code == 0, err
    assert "layer[/b].weight" in out and "model.layers[bold].0.weight" in out and "d[/x]" in out, out
    recipe = tmp_path / "r[/x].yaml"
    recipe.parent.mkdir()
    recipe.write_text((CONFIGS / "w8a16.yaml").read_text())
    code, _, err = run_cli("config", "validate", recipe)
    assert code == 0 and err.strip() == f"ok: {recipe}", err


def test_inspect_checks_a_sharded_exports_index_against_its_shards(world, tmp_path):
    """An index that left out a shard (or mapped a tensor to a shard without it) was listed without those tensors,
    exit 0."""
    from tests.helpers import error_lines

    enc = world / "w8a8" / "encodings.json"
    assert run_cli("export", world / "m.safetensors", "-e", enc, "-o", tmp_path / "s", "--max-shard-size",
                   "6KB")[0] == 0
    index = tmp_path / "s" / "model.safetensors.index.json"
    whole = json.loads(index.read_text())
    shards = sorted(set(whole["weight_map"].values()))
    assert len(shards) >= 3 and run_cli("inspect", tmp_path / "s")[0] == 0
    last = {k: v for k, v in whole["weight_map"].items() if v != shards[-1]}
    index.write_text(json.dumps({**whole, "weight_map": last}))
    code, _, err = run_cli("inspect", tmp_path / "s")
    assert code == 2 and error_lines(err) == [
        f"error: {index}: its weight_map names {len(shards) - 1} of the {len(shards)} shards; it leaves out "
        f"{shards[-1]} beside it"], err
    moved = dict(whole["weight_map"], **{"0.weight": shards[-1]})
    index.write_text(json.dumps({**whole, "weight_map": moved}))
    code, _, err = run_cli("inspect", tmp_path / "s")
    assert code == 2 and "which its weight_map maps to" in err, err


def test_inspect_refuses_what_a_file_cannot_hold_and_names_gguf_grids(world, tmp_path):
    """A qtool file whose metadata gave a weight 1e12 elements over 8 stored bytes listed "0.00 bits per weight";
    a compressed-tensors config with no weight files was "ok: true", 0 tensors; a GGUF recipe's encodings listed
    IQ4_NL as int4."""
    from tests.helpers import error_lines

    enc = world / "w4a8-block32" / "encodings.json"
    assert run_cli("export", world / "m.safetensors", "-e", enc, "-o", tmp_path / "p")[0] == 0
    f = tmp_path / "p" / "model.safetensors"
    with safe_open(str(f), "pt") as fh:
        meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    qmeta = json.loads(meta["qtool"])
    for shape, said in (([1000000, 1000000], "1,000,000,000,000 weights of 4 bits"), ([2, 2], "4 weights of 4 bits")):
        qmeta["0.weight"]["shape"] = shape
        save_file(tensors, f, metadata={**meta, "qtool": json.dumps(qmeta)})
        code, _, err = run_cli("inspect", f)
        assert code == 2 and error_lines(err) == [
            f"error: {f}: '0.weight': its metadata's shape {shape} ({said}) does not fit the 4,096 bytes stored"], err
    # metadata that lies in what the reader checks, and inspect listed as said (exit 0): int0, a string bitwidth,
    # blocks of 16 over scales of blocks of 32, per_channel over blocked scales, no scale tensor
    good = json.loads(meta["qtool"])
    for edit, said in ((lambda m, t: m["0.weight"].update(bitwidth=0), "its metadata's bitwidth 0 is not one"),
                       (lambda m, t: m["0.weight"].update(bitwidth="4"), "its metadata's bitwidth '4' is not one"),
                       (lambda m, t: m["0.weight"].update(block_size=[1, 16]), "does not give its stored scales"),
                       (lambda m, t: m["0.weight"].update(granularity="per_channel"), "does not give its stored scal"),
                       (lambda m, t: t.pop("0.weight_scale"), "no '0.weight_scale' beside its codes")):
        qmeta, kept = json.loads(json.dumps(good)), dict(tensors)
        edit(qmeta, kept)
        save_file(kept, f, metadata={**meta, "qtool": json.dumps(qmeta)})
        code, _, err = run_cli("inspect", f)
        assert code == 2 and len(error_lines(err)) == 1 and said in err, err
    (tmp_path / "ct").mkdir()
    (tmp_path / "ct" / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}}))
    code, _, err = run_cli("inspect", tmp_path / "ct")
    assert code == 2 and "no *.safetensors" in err, err
    save_file({"l.weight_packed": torch.zeros(4, 1, dtype=torch.int32), "l.weight_scale": torch.ones(4, 1)},
              tmp_path / "ct" / "model.safetensors")
    code, _, err = run_cli("inspect", tmp_path / "ct")  # (its shape was [], at 13,772 bits per weight)
    assert code == 2 and "'l' has no weight_shape beside its packed codes" in err, err


def test_inspect_names_a_gguf_recipes_grids_by_their_gguf_type(tiny_llama, tmp_path):
    recipe = tmp_path / "iq.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {gguf_type: iq4_nl}\n  activations: null\n")
    assert run_cli("calibrate", tiny_llama / "m", "-c", recipe, "-o", tmp_path / "c")[0] == 0
    code, out, err = run_cli("inspect", tmp_path / "c" / "encodings.json", "--json")
    assert code == 0 and {t["dtype"] for t in json.loads(out)["tensors"]} == {"GGUF IQ4_NL"}, out


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d / "m")
    save_file({"input_ids": torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))},
              d / "ids.safetensors")
    return d


def test_compressed_tensors_through_the_cli_loads_in_transformers(tiny_llama, tmp_path):
    import transformers

    import qtool

    code, out, err = run_cli("quantize", tiny_llama / "m", "-c", CONFIGS / "w4a16-block32.yaml", "-o",
                             tmp_path / "ct0", "--format", "compressed-tensors", "--json")
    assert code == 0, err
    listed = json.loads(run_cli("inspect", tmp_path / "ct0", "--json")[1])
    assert {r["block_size"] and tuple(r["block_size"]) for r in listed["tensors"] if r["quantized"]} == {(1, 32)}
    # compressed-tensors has no quantized embeddings: the recipe's int8 embedding table is reported, left in float
    assert any("model.embed_tokens" in w for w in json.loads(out)["export_warnings"])
    assert "model.embed_tokens" in err
    recipe = tmp_path / "w4.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 32}\n"
                      "  activations: null\nlayers:\n  - type: Embedding\n    weights: null\nignore: [lm_head]\n")
    code, out, err = run_cli("quantize", tiny_llama / "m", "-c", recipe, "-o", tmp_path / "ct", "--format",
                             "compressed-tensors", "--json")
    assert code == 0, err
    cfg = json.loads((tmp_path / "ct/config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct").eval()
    fq = qtool.load_calibrated(str(tiny_llama / "m"), str(tmp_path / "ct/calibration/encodings.json"))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, fq(ids).logits)
    code, out, _ = run_cli("inspect", tmp_path / "ct", "--json")
    rep = json.loads(out)
    assert rep["kind"].startswith("compressed-tensors")
    rows = {r["name"]: r for r in rep["tensors"]}
    assert rows["model.layers.0.mlp.down_proj.weight"]["bitwidth"] == 4
    assert rows["model.layers.0.mlp.down_proj.weight"]["shape"] == [64, 128]


def test_a_quantized_tied_output_layer_is_refused_before_calibrating_where_the_format_cannot_write_it(tmp_path):
    """A tied lm_head is the embedding table, which the checkpoint stores once: the qtool and AIMET formats write
    tensors by the checkpoint's names and have no place for it. They failed after calibrating ("has no tensor
    'lm_head.weight'... another model?"); now one line before, naming the tie and what to do. GGUF writes it."""
    from tests.helpers import tiny_llama

    ckpt = tiny_llama(tmp_path / "m", tie_word_embeddings=True)
    recipe = tmp_path / "all.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n")
    for fmt in ("qtool", "aimet"):
        code, _, err = run_cli("quantize", ckpt, "-c", recipe, "-o", tmp_path / fmt, "--format", fmt)
        lines = [line for line in err.splitlines() if line.startswith("error")]
        assert code == 2 and len(lines) == 1 and "lm_head.weight is the tensor model.embed_tokens.weight" in lines[0]
        assert "calibrating" not in err and not (tmp_path / fmt).exists()
    code, _, err = run_cli("quantize", ckpt, "-c", recipe, "-o", tmp_path / "ct", "--format", "compressed-tensors",
                           "-q")
    assert code == 0, err
    code, _, err = run_cli("calibrate", ckpt, "-c", recipe, "-o", tmp_path / "cal", "-q")
    assert code == 0, err
    code, _, err = run_cli("export", ckpt, "-e", tmp_path / "cal/encodings.json", "-o", tmp_path / "x")
    assert code == 2 and "is stored only under that tensor's name" in err
    assert "were they made for another model?" not in err  # (the line opened by blaming the encodings)


def test_inspect_refuses_a_pipe_and_names_a_link_loop(tmp_path):
    """A named pipe waited forever for a writer (open blocks); a link that loops read 'not found'."""
    import os

    os.mkfifo(tmp_path / "p.safetensors")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    code, _, err = run_cli("inspect", tmp_path / "p.safetensors")
    assert code == 2 and "p.safetensors: not a regular file or a directory" in err, err
    code, _, err = run_cli("inspect", tmp_path / "loop")
    assert code == 2 and "loop: a link to nothing (its target is missing, or the links loop)" in err, err


def test_inspect_lists_an_aimet_files_dtypes_alike_in_every_version():
    """0.6.1 and 1.0.0 files' asymmetric activations were listed as int8 (2.0.0's output_dtype says uint8), and a
    1.0.0 LPBQ weight as 8-bit (its codes are compressed_bw, 4)."""
    samples = Path(__file__).resolve().parents[2] / "shared" / "data" / "aimet" / "encodings-samples"
    listed = {}
    for version in ("0.6.1", "1.0.0", "2.0.0"):
        code, out, err = run_cli("inspect", samples / f"pertensor_v{version}.encodings", "--json")
        assert code == 0, err
        listed[version] = {t["name"]: t["dtype"] for t in json.loads(out)["tensors"]}
    assert listed["0.6.1"]["/relu0/Relu_output_0"] == listed["1.0.0"]["/relu0/Relu_output_0"] == \
        listed["2.0.0"]["/relu0/Relu_output_0"] == "uint8"
    assert listed["0.6.1"]["conv.weight"] == listed["1.0.0"]["conv.weight"] == "int8"
    code, out, _ = run_cli("inspect", samples / "lpbq_v1.0.0.encodings", "--json")
    assert {t["name"]: (t["dtype"], t["bitwidth"]) for t in json.loads(out)["tensors"]}["0.weight"] == ("int4", 4)


def test_t5s_shared_embedding_is_named_as_tied_when_exported_by_name(tmp_path):
    """T5's encoder and decoder embed_tokens are its shared table: export blamed the user ('were they made for
    another model?') for encodings calibrated on this very model."""
    import transformers

    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)).save_pretrained(tmp_path / "t5")
    code, _, err = run_cli("calibrate", tmp_path / "t5", "-c", "w8a16", "-o", tmp_path / "cal", "-q")
    assert code == 0, err
    code, _, err = run_cli("export", tmp_path / "t5", "-e", tmp_path / "cal/encodings.json", "-o", tmp_path / "x")
    assert code == 2 and "embed_tokens.weight" in err and "is stored only under that tensor's name" in err, err
    # quantize refuses before calibrating, and its advice names every alias (it named the encoder's alone, and
    # taking it sent the user back for the decoder's)
    code, _, err = run_cli("quantize", tmp_path / "t5", "-c", "w8a16", "-o", tmp_path / "q")
    assert code == 2 and "add 'encoder.embed_tokens', 'decoder.embed_tokens' to ignore" in err, err


def test_model_encodings_beside_an_export_leaves_out_tiles_of_blocks(tmp_path):
    """The AIMET JSON written beside a qtool export held weights in 2-D tiles as one-dimensional blocks, which no
    reader (qtool's import included) could take; they are left out with a warning, as dynamic activations are."""
    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, "
                                     "block_size: [8, 16]}\n  activations: null\nlayers:\n  - match: '4'\n"
                                     "    weights: {bitwidth: 8, granularity: per_channel}\n")
    code, out, err = run_cli("quantize", tmp_path / "m.safetensors", "-c", tmp_path / "r.yaml", "--model-class", MLP,
                             "-o", tmp_path / "q", "--json")
    assert code == 0, err
    assert any("leaves out 2 weight(s) in blocks of [8, 16]" in w for w in json.loads(out)["export_warnings"]), out
    aimet = json.loads((tmp_path / "q/model.encodings").read_text())
    assert sorted(aimet["param_encodings"] if isinstance(aimet["param_encodings"], dict) else
                  [e["name"] for e in aimet["param_encodings"]]) == ["4.weight"]


def test_a_float_output_layer_tied_to_a_quantized_table_is_said_in_export_and_eval(tmp_path):
    """lm_head in ignore, its tied embedding table quantized: the qtool file holds the table once, quantized, so a
    runtime that ties them computes the logits with it, not the float table calibration measured; export said
    nothing and eval matched its reference to the file without a note (export gap 6e-9)."""
    from tests.helpers import tiny_llama

    ckpt = tiny_llama(tmp_path / "m", tie_word_embeddings=True)
    code, out, err = run_cli("quantize", ckpt, "-c", "w4a16-block32", "-o", tmp_path / "q", "--json")
    assert code == 0, err
    said = [w for w in json.loads(out)["export_warnings"] if w.startswith("lm_head is left float but shares")]
    assert len(said) == 1 and "model.embed_tokens.weight, which this file stores quantized" in said[0], out
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    code, out, err = run_cli("eval", tmp_path / "q", "--data", tmp_path / "ids.safetensors", "--seq-len", "32",
                             "--generate", "0", "--json")
    assert code == 0, err
    assert any(n.startswith("the fake-quant model computes every layer that shares model.embed_tokens's weight")
               for n in json.loads(out)["notes"]), out


def test_max_shard_size_with_another_format_is_said_to_do_nothing(tmp_path):
    """--max-shard-size 60KB with compressed-tensors wrote one file and said nothing."""
    from tests.helpers import tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    code, out, err = run_cli("quantize", ckpt, "-c", "w8a16", "-f", "compressed-tensors", "--max-shard-size", "60KB",
                             "-o", tmp_path / "q", "--json")
    assert code == 0, err
    assert "--max-shard-size shards the qtool format only: --format compressed-tensors writes its own files, " \
           "unsharded by it" in json.loads(out)["export_warnings"]
    code, out, err = run_cli("quantize", ckpt, "-c", "w8a16", "-f", "compressed-tensors", "-o", tmp_path / "d",
                             "--json")
    assert code == 0 and not [w for w in json.loads(out)["export_warnings"] if "max-shard-size" in w], out


def test_an_imported_encoding_of_token_ids_is_skipped_with_a_warning(tmp_path):
    """An Embedding's input is token ids, which no quantizer takes: the entry was imported with exit 0, carried into
    every export, and changed nothing (a recipe rule for it is refused)."""
    from tests.tinymodels import tied_lm

    save_file({k: v.clone() for k, v in tied_lm().state_dict().items()}, tmp_path / "t.safetensors")
    entry = {"dtype": "INT", "bw": 8, "is_sym": False, "scale": [8.0], "offset": [0], "enc_type": "PER_TENSOR"}
    aimet = {"version": "1.0.0", "param_encodings": [{**entry, "name": "mid.weight", "is_sym": True,
                                                      "scale": [0.001], "offset": [-128]}],
             "activation_encodings": [{**entry, "name": "emb.input"}, {**entry, "name": "mid.input"}]}
    (tmp_path / "a.encodings").write_text(json.dumps(aimet))
    code, out, err = run_cli("import-encodings", tmp_path / "t.safetensors", tmp_path / "a.encodings", "-o",
                             tmp_path / "i", "--model-class", "tests.tinymodels:tied_lm", "--json")
    assert code == 0, err
    assert json.loads(out)["warnings"] == ["emb.input: token ids (integers, the input of its Embedding), which no "
                                           "activation quantizer takes; skipped"]
    names = [q["name"] for q in json.loads((tmp_path / "i/encodings.json").read_text())["quantizers"]]
    assert sorted(names) == ["mid.input", "mid.weight"]
    aimet["param_encodings"], aimet["activation_encodings"] = [], aimet["activation_encodings"][:1]
    (tmp_path / "a.encodings").write_text(json.dumps(aimet))
    code, _, err = run_cli("import-encodings", tmp_path / "t.safetensors", tmp_path / "a.encodings", "-o",
                           tmp_path / "j", "--model-class", "tests.tinymodels:tied_lm")
    assert code == 2 and "nothing to import: its only encodings are of token ids ('emb.input')" in err, err
    assert not (tmp_path / "j").exists()
