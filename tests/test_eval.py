"""``qtool eval``: exported files run in their runtimes (llama.cpp, transformers + compressed-tensors, onnxruntime,
qtool) against float and against qtool's fake-quant model. A correct export passes; one broken on purpose (a GGUF
tensor's block scales doubled, a compressed-tensors scale transposed, an ONNX zero point shifted, a qtool scale
doubled) is an export fault: exit 1."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.evaluation.metrics import Distributions, first_divergence, token_kl
from tests.helpers import error_lines, run_cli
from tests.test_gguf import _tiny_llama

EVAL = ("--seq-len", "48", "--num-samples", "4", "--generate", "6", "--prompts", "2", "--threads", "1")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama with confident predictions and held-out text it was not calibrated on."""
    import pydoc_data.topics

    d = tmp_path_factory.mktemp("eval")
    ckpt = _tiny_llama(d / "m", False, init_range=0.2)
    topics = [v.encode("ascii", "ignore").decode() for v in pydoc_data.topics.topics.values()]
    (d / "calib.txt").write_text("\n\n".join(topics[:20]))
    (d / "held.txt").write_text("\n\n".join(topics[40:60]))
    return ckpt, d / "calib.txt", d / "held.txt"


def _quantize(model, tmp_path, recipe, fmt, name="out"):
    ckpt, calib, _ = model
    out = tmp_path / name
    code, _, err = run_cli("quantize", ckpt, "-c", recipe, "--format", fmt, "-o", out, "--data", calib,
                           "--seq-len", "32", "-q")
    assert code == 0, err
    return out


def _eval(model, artifact, *extra):
    _, _, held = model
    code, out, err = run_cli("eval", artifact, "--data", held, *EVAL, "--json", *extra)
    return code, (json.loads(out) if out.strip() else None), err


def _healthy(res):
    assert res["export_fault"] is None
    assert res["export_gap"]["kl_mean"] < 0.1 * res["vs_float"]["fake_quant"]["kl_mean"] + 0.01
    vs = res["vs_float"]
    assert abs(vs["artifact"]["top1_agreement"] - vs["fake_quant"]["top1_agreement"]) < 0.1
    assert res["tokens"] == 4 * 47


def test_gguf_runs_in_llama_cpp_and_a_doubled_scale_is_an_export_fault(model, tmp_path):
    out = _quantize(model, tmp_path, "gguf-q8_0", "gguf")
    code, res, err = _eval(model, out)
    assert code == 0, err
    from tests.test_json_contract import _documented_keys

    assert set(res) == _documented_keys()["eval (causal LM)"] - {"tasks"}
    assert res["runtime"] == "llama.cpp" and res["format"] == "gguf"
    _healthy(res)
    p = res["perplexity"]
    assert abs(p["artifact"] / p["fake_quant"] - 1) < 0.02  # llama.cpp runs what calibration chose
    assert res["generations"]["artifact"]["prompts"] == 2 and res["generations"]["artifact"]["tokens"] == 6
    assert not any("most likely tokens" in n for n in res["notes"])  # 1000 of a smaller vocabulary: the full KL
    code, res, err = _eval(model, out, "--top-k", "50")
    assert code == 0 and any("its 50 most likely tokens per position" in n for n in res["notes"]), err

    from gguf import GGUFReader

    reader = GGUFReader(out / "model.gguf", "r+")
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    blocks = t.data.reshape(t.data.shape[0], -1, 34)  # Q8_0: a float16 scale, then 32 int8 codes
    scales = blocks[:, :, :2].copy().view(np.float16)
    blocks[:, :, :2] = (scales * 2).view(np.uint8)
    del reader
    code, res, err = _eval(model, out)
    assert code == 1
    assert res["export_fault"] and res["ok"] is False
    assert "export fault" in err
    assert res["export_gap"]["kl_mean"] > 10 * res["vs_float"]["fake_quant"]["kl_mean"]


def test_gguf_scores_tokens_that_end_inside_a_utf8_character(model, tmp_path):
    """Byte pieces of CJK characters and emoji (the llama.cpp server withholds their log-probabilities, holding the
    partial character back) were an internal error (exit 3); now scored from the whole vocabulary's."""
    ckpt = _tiny_llama(tmp_path / "m", False, init_range=0.2, every_byte=True)
    held = tmp_path / "utf8.txt"
    held.write_text("Hello 日本語 😀 world. The quick brown fox, ünïcödé. " * 30)
    world = (ckpt, model[1], held)
    out = _quantize(world, tmp_path, "gguf-q8_0", "gguf")
    code, res, err = _eval(world, out)
    assert code == 0, err
    _healthy(res)
    assert abs(res["perplexity"]["artifact"] / res["perplexity"]["fake_quant"] - 1) < 0.02


def test_compressed_tensors_in_transformers_and_a_transposed_scale_is_an_export_fault(model, tmp_path):
    out = _quantize(model, tmp_path, "w4a16-block32", "compressed-tensors")
    code, res, err = _eval(model, out)
    assert code == 0, err
    assert res["runtime"].startswith("transformers")
    _healthy(res)
    assert res["export_gap"]["kl_mean"] < 1e-5  # the same arithmetic as qtool's
    assert any("runs 1 quantizer(s) in float" in n for n in res["notes"])  # the embedding table, as the format writes it

    from safetensors.torch import load_file, save_file

    f = out / "model.safetensors"
    tensors = load_file(f)
    key = "model.layers.1.mlp.down_proj.weight_scale"
    s = tensors[key]
    tensors[key] = s.t().contiguous().reshape(s.shape)  # the values in the other order, the shape kept
    save_file(tensors, f, metadata={"format": "pt"})
    code, res, err = _eval(model, out)
    assert code == 1 and res["export_fault"], (res["export_gap"], res["vs_float"])
    # tensors the file lacks were "a limit of the runtime, not the file"
    del tensors["model.layers.0.self_attn.q_proj.weight_packed"], tensors["model.norm.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    code, _, err = run_cli("eval", out, "--data", model[2], *EVAL, "-q")
    assert code == 2 and error_lines(err) == [f"error: {out}: the file holds no 'model.layers.0.self_attn.q_proj."
                                              "weight_packed' and 1 more of the model: not a whole export of it"], err


def test_a_runtime_that_drops_transform_config_is_named_and_a_bad_weight_is_still_a_fault(model, tmp_path):
    """transformers loads a compressed-tensors directory's weights but not its transform_config (r4's online
    rotation of down_proj's input): the gap that leaves is checked again with the rotations applied to the same
    reload, and named the runtime's limit where that closes it; a damaged weight stays an export fault."""
    out = _quantize(model, tmp_path, "w8a8-dynamic-rot", "compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["transform_config"]
    code, res, err = _eval(model, out)
    assert code == 0, err
    assert res["export_fault"] is None
    note = next(n for n in res["notes"] if "transform_config" in n)
    assert "r4" in note and "vLLM" in note
    assert res["export_gap"]["kl_mean"] > 0.1  # transformers alone: rotated weights on unrotated activations

    from safetensors.torch import load_file, save_file

    f = out / "model.safetensors"
    tensors = load_file(f)
    key = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[key] = tensors[key] * 2
    save_file(tensors, f, metadata={"format": "pt"})
    config["edited"] = True  # (config.json holds the scheme the runtime reads: an edit there is named too)
    (out / "config.json").write_text(json.dumps(config))
    code, res, err = _eval(model, out)
    assert code == 1 and "with its online rotations (r4) applied too" in res["export_fault"], res["export_fault"]
    # (a file edited after the export is named as such: the swapped graph of another recipe passed as the export)
    assert any("config.json, model.safetensors in " in n and "not the bytes the export's manifest records" in n
               for n in res["notes"]), res["notes"]


def test_a_mixture_of_experts_r4_directory_exports_and_its_rotations_are_applied_to_the_reload(model, tmp_path):
    """Mixtral with r4 calibrated, then failed at export ("experts.0.w2 has no weight ... in the checkpoint": the
    checkpoint names the experts under block_sparse_moe, qtool's model under mlp). transform_config now names the
    checkpoint's modules, and eval applies the rotations to transformers' reload, whose experts are fused 3-D
    tensors, as qtool's loader splits them: the file holds what calibration chose."""
    from tests.test_gguf_families import _tiny

    _, calib, held = model
    ckpt = _tiny(tmp_path / "mixtral", "mixtral")
    recipe = tmp_path / "w4r4.yaml"  # (pack-quantized: transformers' conversion refuses int8 experts beside scales)
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 32}\n"
                      "  activations: null\nlayers:\n  - {type: Embedding, weights: null}\nignore: [lm_head]\n"
                      "rotate: {rotations: [r1, r2, r4]}\n")
    out = tmp_path / "ct"
    code, _, err = run_cli("quantize", ckpt, "-c", recipe, "--format", "compressed-tensors", "-o", out,
                           "--data", calib, "--seq-len", "32", "-q")
    assert code == 0, err
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["transform_config"]["config_groups"]
    targets = groups["R4"]["apply"][0]["targets"]
    assert "model.layers.0.block_sparse_moe.experts.0.w2" in targets and len(targets) == 2 * (8 + 0)
    code, out_json, err = run_cli("eval", out, "--data", held, *EVAL, "--json")
    assert code == 0, err
    res = json.loads(out_json)
    assert res["export_fault"] is None
    assert any("transform_config" in n and "vLLM" in n for n in res["notes"]), res["notes"]
    # experts left float have no encodings entry to name their checkpoint module: the model's own map does
    recipe.write_text(recipe.read_text().replace("layers:\n", "layers:\n  - {match: '*.experts.*', weights: null}\n"))
    code, _, err = run_cli("quantize", ckpt, "-c", recipe, "--format", "compressed-tensors", "-o", tmp_path / "ct2",
                           "--data", calib, "--seq-len", "32", "-q")
    assert code == 0, err
    groups = json.loads((tmp_path / "ct2" / "config.json").read_text())["quantization_config"]["transform_config"]
    assert "model.layers.1.block_sparse_moe.experts.7.w2" in groups["config_groups"]["R4"]["apply"][0]["targets"]


def test_an_asymmetric_pack_quantized_directory_transformers_cannot_load_names_the_runtime(model, tmp_path):
    """compressed-tensors 0.20 makes transformers' empty model with unpacked zero points, so an asymmetric int4
    directory (zero points packed, as the format says) does not load there: one line that says it is the runtime's
    known limit, not the file's."""
    recipe = tmp_path / "asym.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, symmetric: false, granularity: per_block, "
                      "block_size: 32}\n  activations: null\nignore: ['re:.*lm_head', 're:.*embed_tokens']\n")
    out = _quantize(model, tmp_path, recipe, "compressed-tensors")
    code, res, err = _eval(model, out)
    assert code == 2
    line = [x for x in err.splitlines() if x.startswith("error:")][-1]
    assert "transformers cannot load it" in line and "issue #1618" in line and "not the file" in line


def test_onnx_in_onnxruntime_and_a_shifted_zero_point_is_an_export_fault(model, tmp_path):
    out = _quantize(model, tmp_path, "w8a16", "onnx")
    code, res, err = _eval(model, out, "--onnx-optimization", "off")
    assert code == 0, err
    assert res["runtime"].startswith("onnxruntime")
    _healthy(res)

    import onnx
    from onnx import numpy_helper

    m = onnx.load(out / "model.onnx")
    inits = {i.name: i for i in m.graph.initializer}
    zp_names = [n.input[2] for n in m.graph.node if n.op_type == "DequantizeLinear" and len(n.input) > 2
                and "down_proj" in n.input[0] and n.input[0] in inits]
    assert zp_names
    for name in zp_names:
        zp = numpy_helper.to_array(inits[name])
        inits[name].CopyFrom(numpy_helper.from_array((zp.astype(np.int32) + 3).astype(zp.dtype), name))
    onnx.save(m, out / "model.onnx")
    code, res, err = _eval(model, out, "--onnx-optimization", "off")
    assert code == 1 and res["export_fault"], (res["export_gap"], res["vs_float"])
    code, res, err = _eval(model, out)  # optimized kernels: the graph as written is run too, and is at fault
    assert code == 1 and "the graph run as written (optimizations off) too" in res["export_fault"]


def test_an_fp8_onnx_file_at_the_default_optimizations_names_the_level_that_runs_it(model, tmp_path):
    """onnxruntime's level-all fusions refuse float8 Q/DQ: eval of qtool's own FP8 ONNX file ended in a cut-off
    'This is an invalid model...' line with no hint."""
    out = _quantize(model, tmp_path, "fp8-dynamic", "onnx")
    code, _, err = _eval(model, out)
    assert code == 2 and error_lines(err)[-1] == (f"error: {out / 'model.onnx'}: onnxruntime's graph optimizations "
                                                  "at level all refuse its float8 Q/DQ nodes: run it with "
                                                  "--onnx-optimization basic (or off)"), err
    code, res, err = _eval(model, out, "--onnx-optimization", "basic")
    assert code == 0 and res["export_fault"] is None, err


def test_qtool_format_and_a_doubled_scale_is_an_export_fault(model, tmp_path):
    out = _quantize(model, tmp_path, "w4a16-block32", "qtool")
    code, res, err = _eval(model, out)
    assert code == 0, err
    assert res["export_gap"]["kl_mean"] < 1e-6 and res["export_gap"]["top1_agreement"] == 1.0  # float32 rounding
    assert res["perplexity"]["artifact"] == pytest.approx(res["perplexity"]["fake_quant"], rel=1e-6)

    from safetensors import safe_open
    from safetensors.torch import save_file

    f = out / "model.safetensors"
    with safe_open(str(f), "pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    tensors["model.layers.1.mlp.down_proj.weight_scale"] *= 2
    save_file(tensors, f, metadata=meta)
    code, res, err = _eval(model, out)
    assert code == 1 and res["export_fault"], err
    # a file that lacks a tensor ran with the reference's value there and read as healthy (exit 0)
    del tensors["model.norm.weight"]
    save_file(tensors, f, metadata=meta)
    code, _, err = run_cli("eval", out, "--data", model[2], *EVAL, "-q")
    assert code == 2 and error_lines(err) == [f"error: {out}: the file holds no 'model.norm.weight' of the model: not "
                                              "a whole export of it"], err


def test_gates_human_output_and_explicit_paths(model, tmp_path):
    ckpt, _, held = model
    out = _quantize(model, tmp_path, "gguf-q8_0", "gguf")
    moved = tmp_path / "alone.gguf"
    shutil.copy(out / "model.gguf", moved)  # no manifest beside it: the reference and encodings are given
    code, _, err = run_cli("eval", moved, "-r", ckpt, "-e", out / "calibration/encodings.json", "--data", held, *EVAL,
                           "--max-kl", "0", "--min-agreement", "0.1", "--max-ppl-increase", "1000")
    assert code == 1
    assert "gate failed: --max-kl 0" in err and "--min-agreement" not in err and "--max-ppl-increase" not in err
    assert "perplexity on 188 held-out tokens" in err and "export gap" in err
    code, _, err = run_cli("eval", moved, "-r", ckpt, "--data", held, *EVAL)  # no encodings: float only
    assert code == 0, err
    assert "export gap (artifact vs fake-quant)" not in err and "no encodings" in err


def test_bad_input_is_one_line(model, tmp_path):
    ckpt, _, held = model
    out = _quantize(model, tmp_path, "gguf-q8_0", "gguf")
    other = _tiny_llama(tmp_path / "other", False, hidden=96)
    alone = tmp_path / "alone.gguf"  # no manifest beside it, so no encodings
    shutil.copy(out / "model.gguf", alone)
    short = tmp_path / "short.txt"
    short.write_text("a b")
    cases = [
        (("eval", out, "-r", other, "--data", held), "not an export of the reference model"),
        (("eval", alone, "-r", other, "--data", held), "not an export of the reference model: hidden_size 64"),
        # a Qwen2 of the Llama's very shape: the file was run as if it were that model's
        (("eval", alone, "-r", _tiny_llama(tmp_path / "qwen2", False, "qwen2"), "--data", held),
         "not an export of the reference model: general.architecture llama (the reference's: qwen2)"),
        (("eval", out, "--data", short), "no full sequence"),
        (("eval", tmp_path / "nothing", "--data", held), "no such artifact"),
        (("eval", out, "--data", held, "--min-cosine", "0.9"), "--min-cosine"),
        (("eval", out), "--data"),
        (("eval", out, "--data", held, "--min-agreement", "1.5"), "--min-agreement must be from 0 to 1"),
        (("eval", out, "--data", held, "--min-agreement", "-5"), "--min-agreement must be from 0 to 1"),
        (("eval", out, "--data", held, "--max-kl", "-1"), "--max-kl must be >= 0"),
        (("eval", out, "--data", held, "--max-export-gap", "-0.1"), "--max-export-gap must be >= 0"),
    ]
    # token ids calibrate refuses crashed eval (exit 3) inside the float model or the window cutting
    import numpy as np

    np.save(tmp_path / "past.npy", np.full((2, 64), 100000, dtype=np.int64))
    np.save(tmp_path / "flat.npy", np.arange(1000, dtype=np.int64) % 200)
    # padding the attention mask leaves out is not checked (it is dropped); a negative id it keeps is said as such
    from safetensors.torch import save_file

    ids = torch.randint(1, 200, (4, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[:, 56:], mask[:, 56:] = -100, 0
    save_file({"input_ids": ids, "attention_mask": mask}, tmp_path / "padded.safetensors")
    code, _, err = run_cli("eval", out, "--data", tmp_path / "padded.safetensors", *EVAL, "-q")
    assert code == 0, err
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "unmasked.safetensors")
    cases += [(("eval", out, "--data", tmp_path / "unmasked.safetensors"), "token id -100 is negative (a padding "
                                                                            "marker such as -100?")]
    cases += [(("eval", out, "--data", tmp_path / "past.npy"), "token id 100000 is outside the model's vocabulary"),
              (("eval", out, "--data", tmp_path / "flat.npy"), "token ids must be integers of shape [sequences, "
                                                                 "tokens] (got int64 samples of shape [])")]
    ct = _quantize(model, tmp_path, "w8a16", "compressed-tensors", name="ct")  # truncated: transformers' own error,
    with open(ct / "model.safetensors", "r+b") as f:                          # exit 3, once both models had run
        f.truncate(f.seek(0, 2) // 2)
    cases.append((("eval", ct, "--data", held), "model.safetensors: truncated safetensors file"))
    for args, needle in cases:
        code, _, err = run_cli(*args, *EVAL, "-q")
        lines = error_lines(err)
        assert code == 2, (args, err)
        assert len(lines) == 1 and needle in lines[0], (args, err)
    # a gate that cannot apply to this model is refused once the reference is loaded, before any model runs
    code, _, err = run_cli("eval", out, "--data", held, *EVAL, "--min-cosine", "0.9")
    assert code == 2 and "--min-cosine is for models that are not causal LMs" in err
    assert "loading the float checkpoint" in err and "measuring" not in err, err


def test_a_runtime_that_is_not_installed_names_its_extra(model, tmp_path, monkeypatch):
    import builtins

    out = _quantize(model, tmp_path, "gguf-q8_0", "gguf")
    real = builtins.__import__

    def no_llamacpp(name, *args, **kwargs):
        if name == "xllamacpp":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llamacpp)
    code, _, err = run_cli("eval", out, "--data", model[2], *EVAL)
    assert code == 2 and error_lines(err)[-1].endswith("pip install 'qtool[llamacpp]' (the xllamacpp wheel)"), err


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 40), st.integers(1, 40), st.integers(0, 2 ** 31), st.floats(0.1, 8.0))
def test_top_k_kl_is_a_lower_bound_that_is_exact_over_the_whole_vocabulary(vocab, k, seed, temperature):
    g = torch.Generator().manual_seed(seed)
    ref = torch.log_softmax(torch.randn(5, vocab, generator=g, dtype=torch.float64) * temperature, -1)
    logits = torch.randn(5, vocab, generator=g, dtype=torch.float64) * temperature
    ids = torch.randint(0, vocab, (6,), generator=g).tolist()
    full = Distributions.from_logits(logits, ids, vocab)
    exact = (ref.exp() * (ref - full.full)).sum(-1)
    assert torch.allclose(token_kl(ref, full), exact.clamp_min(0))
    top = Distributions(full.target, full.top_ids[:, :min(k, vocab)], full.top_logprobs[:, :min(k, vocab)])
    bound = token_kl(ref, top)
    assert bool((bound <= exact * (1 + 1e-6) + 1e-9).all())  # (the rest's mass is 1 - sum: rounding)
    if k >= vocab:
        assert torch.allclose(bound, exact.clamp_min(0), atol=1e-9)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([4], [5]) == 0


TASK = """task: qtool_tiny_{kind}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "{{{{question}}}}"
{extra}
"""


def test_lm_eval_tasks_run_on_the_artifact_in_its_runtime(model, tmp_path, capfd, monkeypatch):
    """A multiple-choice and a generation task in lm-eval's own YAML over a local JSONL file (nothing downloaded),
    scored on the float model and on the GGUF file in llama.cpp; lm-eval's own chatter stays off the terminal."""
    pytest.importorskip("lm_eval")
    monkeypatch.chdir(tmp_path)  # (not a git repository: lm-eval's `git describe` said so on stderr)
    out = _quantize(model, tmp_path, "gguf-q8_0", "gguf")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    docs = [{"question": f"The number {i} is", "choices": [" even", " odd"], "answer": i % 2} for i in range(6)]
    (tasks / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "mc.yaml").write_text(TASK.format(kind="multiple_choice", data=tasks / "docs.jsonl", extra=(
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc')))
    (tasks / "gen.yaml").write_text(TASK.format(kind="generate_until", data=tasks / "docs.jsonl", extra=(
        'doc_to_target: "{{choices[answer]}}"\ngeneration_kwargs:\n  until: ["."]\n  max_gen_toks: 4\n'
        'metric_list:\n  - metric: exact_match')))
    code, res, err = _eval(model, out, "--tasks", "qtool_tiny_multiple_choice,qtool_tiny_generate_until",
                           "--tasks-path", tasks, "--task-limit", "4")
    assert code == 0, err
    acc = res["tasks"]["qtool_tiny_multiple_choice"]["acc"]
    assert set(acc) == {"float", "artifact"} and all(0 <= v <= 1 for v in acc.values())
    assert set(res["tasks"]["qtool_tiny_generate_until"]["exact_match"]) == {"float", "artifact"}
    # metrics only: lm-eval's count of documents (sample_len) read as one
    assert {m for t in res["tasks"].values() for m in t} == {"acc", "exact_match"}
    terminal = err + capfd.readouterr().err  # (what the command wrote, and what reached the process's stderr)
    for chatter in ("not a git repository", "Generating test split", "is defined, but aggregation is not", "it/s]"):
        assert chatter not in terminal, terminal


def test_quantize_evaluates_what_it_wrote(model, tmp_path):
    ckpt, calib, held = model
    code, out, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "--format", "gguf", "-o", tmp_path / "q",
                             "--data", calib, "--seq-len", "32", "--eval", held, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["ok"] and res["eval"]["format"] == "gguf" and res["eval"]["export_fault"] is None
    assert res["eval"]["perplexity"]["artifact"] > 1 and res["gguf"]["file_type"] == "Q8_0"


def test_held_out_data_quantize_cannot_evaluate_is_refused_before_calibrating(model, tmp_path):
    """`quantize --eval` of two tokens calibrated and wrote the whole output, then exited 2 ("bad input, nothing
    written"), its summary lost and a retry refused for the output that now existed."""
    ckpt, calib, _ = model
    (tmp_path / "tiny.txt").write_text("hi")
    code, out, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "q", "--data", calib, "--seq-len",
                             "32", "--eval", tmp_path / "tiny.txt", "--json")
    assert code == 2 and "make no full sequence" in json.loads(out)["error"], out
    assert not (tmp_path / "q").exists()


def test_gate_values_are_checked_before_anything_runs(tmp_path):
    (tmp_path / "x.txt").write_text("some text")
    for args, needle in ((("--max-ppl-increase", "-100"), "--max-ppl-increase must be a percentage above -100"),
                         (("--min-cosine", "2"), "--min-cosine must be from -1 to 1"),
                         (("--max-kl", "nan"), "--max-kl must be a finite number"),
                         (("--onnx-optimization", "most"), "--onnx-optimization must be one of all, basic, off")):
        code, _, err = run_cli("eval", tmp_path / "nothing", "--data", tmp_path / "x.txt", *args)
        assert code == 2 and len(error_lines(err)) == 1 and needle in err, (args, err)


def test_a_bfloat16_transformers_run_is_allowed_the_quantizations_kl_where_activations_are_quantized(model, tmp_path):
    """transformers runs MX checkpoints in bfloat16 only, where activations round to the grid from other inputs
    than qtool's float32 ones (docs/accuracy.md, "MX activations in bfloat16"): the export-gap allowance is then the
    quantization's own KL plus 0.01, as for onnxruntime; weight-only files keep a quarter of it."""
    from types import SimpleNamespace

    from qtool.evaluation import EvalOptions, _open_runtime

    for recipe, activations, share in (("mxfp8a16", False, 0.25), ("mxfp8", True, 1.0)):
        out = _quantize(model, tmp_path, recipe, "compressed-tensors", name=recipe)
        runtime = _open_runtime(SimpleNamespace(format="compressed-tensors", path=out), EvalOptions(data="-"), True,
                                0, None, activations)
        assert "bfloat16" in runtime.name and (runtime.gap_share, runtime.gap_floor) == (share, 0.01)


def test_the_manifests_paths_are_found_by_their_hashes_from_any_directory(model, tmp_path, monkeypatch):
    """A manifest records the checkpoint and encodings paths as given where the job ran: eval run from another
    directory finds them beside the output's directory, and takes a file only if it has the recorded sha256, so a
    different model at the same relative path is refused in one line instead of being measured as the float."""
    from safetensors.torch import load_file, save_file

    ckpt, calib, held = model
    shutil.copytree(ckpt, tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli("quantize", "m", "-c", "w8a16", "-o", "out", "--data", calib, "--seq-len", "32", "-q")
    assert code == 0, err
    code, _, err = run_cli("export", "m", "-e", "out/calibration/encodings.json", "-o", "exp", "-q")
    assert code == 0, err
    other = tmp_path / "elsewhere"
    shutil.copytree(ckpt, other / "m")  # the same shapes, one weight changed
    weights = load_file(other / "m/model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"] *= 1.5
    save_file(weights, other / "m/model.safetensors", metadata={"format": "pt"})
    monkeypatch.chdir(other)
    for artifact in ("../out", "../exp"):  # exp's manifest: "out/calibration/encodings.json", from tmp_path
        code, res, err = _eval(model, artifact)
        assert code == 0, err
        assert Path(res["reference"]).resolve() == (tmp_path / "m").resolve()
        assert res["export_gap"] is not None and res["export_fault"] is None
    monkeypatch.chdir(tmp_path / "out")  # from inside the output: its parent is the job's directory
    code, res, err = _eval(model, ".")
    assert code == 0 and res["export_gap"] is not None, err
    monkeypatch.chdir(other)
    code, res, err = _eval(model, "../out", "-r", "m")  # given: used as it is, with a note
    assert code in (0, 1) and any("holds other weights" in n for n in res["notes"]), err
    shutil.rmtree(tmp_path / "m")
    code, _, err = run_cli("eval", "../out", "--data", held, *EVAL, "-q")
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and "not the float checkpoint ../out was made from" in lines[0], err


def test_tokens_of_a_model_that_is_not_a_causal_lm_are_the_ones_its_masks_keep():
    """(eval's `tokens` for an encoder counted samples: 8 BERT windows of hundreds of tokens said 8)"""
    from qtool.data import Batch
    from qtool.evaluation import _text_tokens

    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert _text_tokens([Batch(kwargs={"input_ids": ids, "attention_mask": mask})] * 2) == 16
    assert _text_tokens([Batch(kwargs={"input_ids": ids})]) == 10
    assert _text_tokens([Batch(args=(torch.randn(4, 3, 8, 8),))]) is None


def test_a_4bit_gguf_with_a_doubled_scale_is_still_an_export_fault(model, tmp_path):
    """llama.cpp's allowance was half the quantization's own KL: at 4 bits that hid a tensor with doubled block
    scales (SmolLM2 Q4_0: gap 0.165 nats against a healthy 0.004, exit 0)."""
    out = _quantize(model, tmp_path, "gguf-q4_0", "gguf")
    code, res, err = _eval(model, out)
    assert code == 0, err
    healthy = res["export_gap"]["kl_mean"]
    from gguf import GGUFReader

    reader = GGUFReader(out / "model.gguf", "r+")
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    blocks = t.data.reshape(t.data.shape[0], -1, 18)  # Q4_0: a float16 scale, then 16 bytes of 4-bit codes
    scales = blocks[:, :, :2].copy().view(np.float16)
    blocks[:, :, :2] = (scales * 2).view(np.uint8)
    del reader
    code, res, err = _eval(model, out)
    assert code == 1 and res["export_fault"], (healthy, res["export_gap"], res["vs_float"]["fake_quant"])


def test_a_gap_past_llama_cpps_share_is_weighed_against_its_own_8bit_activations(model, tmp_path, monkeypatch):
    """A router turns llama.cpp's 8-bit activations into other experts' outputs: an 8-expert Mixtral's correct Q8_0
    file moved KL 0.026 from the fake-quant model, past 0.1 x the quantization's 0.0286 + 0.01, and read as an export
    fault (exit 1). A gap past that allowance is now weighed against the fake-quant model run with its matrices'
    inputs rounded as llama.cpp rounds them (on the dense models measured, that is the gap itself: 1.00-1.01 of it).
    Here the share and floor are set to (nearly) nothing, so every gap is past them: the healthy file's is what the
    rounding explains, with a note; a doubled scale's is not."""
    from qtool.evaluation import llamacpp

    monkeypatch.setattr(llamacpp.LlamaCpp, "gap_share", 0.0)
    monkeypatch.setattr(llamacpp.LlamaCpp, "gap_floor", 1e-6)
    out = _quantize(model, tmp_path, "gguf-q4_0", "gguf")
    code, res, err = _eval(model, out)
    assert code == 0 and res["export_fault"] is None, err
    note = next(n for n in res["notes"] if "within what llama.cpp's arithmetic explains" in n)
    assert note.startswith(f"the export gap (KL {res['export_gap']['kl_mean']:.4g}) is past 0 x the quantization's KL")
    from gguf import GGUFReader

    reader = GGUFReader(out / "model.gguf", "r+")
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    blocks = t.data.reshape(t.data.shape[0], -1, 18)  # Q4_0: a float16 scale, then 16 bytes of 4-bit codes
    blocks[:, :, :2] = (blocks[:, :, :2].copy().view(np.float16) * 2).view(np.uint8)
    del reader
    code, res, err = _eval(model, out)
    assert code == 1 and "which its 8-bit activations move the fake-quant model by" in res["export_fault"], err


def test_a_reference_with_other_weights_is_named_in_the_export_fault(model, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = model[0]
    out = _quantize(model, tmp_path, "w8a16", "qtool")
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    t = load_file(str(other / "model.safetensors"))
    t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"].flip(0)
    save_file(t, str(other / "model.safetensors"), metadata={"format": "pt"})
    code, res, err = _eval(model, out, "-r", other)
    assert code == 1 and "holds other weights than the checkpoint the artifact's manifest records" in \
        res["export_fault"], err


def test_a_qtool_file_of_a_tied_model_is_run_as_its_one_table_makes_it(tmp_path):
    """The file holds one quantized table for the embedding and the output layer tied to it, and a runtime ties
    the dequantized table: the artifact ran the output layer on the float table instead (SmolLM2 w8a16:
    +0.65 % perplexity measured where the file gives +1.02 %)."""
    import pydoc_data.topics

    from qtool.evaluation import artifact_model
    from qtool.export.qtool_st import read_integer_export

    ckpt = _tiny_llama(tmp_path / "m", True, init_range=0.2)
    (tmp_path / "calib.txt").write_text("\n\n".join(list(pydoc_data.topics.topics.values())[:5]))
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, "
                                     "block_size: 32}\n  activations: null\nlayers:\n  - type: Embedding\n"
                                     "    weights: {bitwidth: 4}\nignore: [lm_head]\n")
    code, _, err = run_cli("quantize", ckpt, "-c", tmp_path / "r.yaml", "-o", tmp_path / "q", "-q")
    assert code == 0, err
    table = read_integer_export(tmp_path / "q")["model.embed_tokens.weight"]
    model = artifact_model(str(tmp_path / "q"))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # (still tied)
    assert torch.equal(model.lm_head.weight.detach(), table)
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        out = model(input_ids=ids).logits
        hidden = model.model(input_ids=ids).last_hidden_state
    assert torch.allclose(out, hidden @ table.T, atol=1e-5)
    # and the fake-quant model eval compares it with is the file's too: a healthy export, no fault
    (tmp_path / "held.txt").write_text("\n\n".join(list(pydoc_data.topics.topics.values())[40:50]))
    code, out, err = run_cli("eval", tmp_path / "q", "--data", tmp_path / "held.txt", *EVAL, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["export_fault"] is None and res["export_gap"]["kl_mean"] < 1e-6, res


def test_a_tied_output_layer_compressed_tensors_keeps_float_is_run_float_by_the_fake_quant_model(tmp_path):
    """compressed-tensors writes a tied lm_head float (compressing it would untie it on load), and the recipe
    quantizes it: the fake-quant model ran it quantized, so eval called the healthy file an export fault (gap KL
    1e-4, exit 1). The plan line counts it left float before calibrating."""
    import pydoc_data.topics

    ckpt = _tiny_llama(tmp_path / "m", True, init_range=0.2)
    (tmp_path / "calib.txt").write_text("\n\n".join(list(pydoc_data.topics.topics.values())[:5]))
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, symmetric: true, "
                                     "granularity: per_block, block_size: 32}\n  activations: null\n")
    code, _, err = run_cli("quantize", ckpt, "-c", tmp_path / "r.yaml", "--data", tmp_path / "calib.txt",
                           "-o", tmp_path / "ct", "--format", "compressed-tensors")
    assert code == 0, err
    assert "2 x weight left float by --format compressed-tensors" in err, err
    (tmp_path / "held.txt").write_text("\n\n".join(list(pydoc_data.topics.topics.values())[40:50]))
    code, out, err = run_cli("eval", tmp_path / "ct", "--data", tmp_path / "held.txt", *EVAL, "--json")
    res = json.loads(out)
    assert code == 0 and res["export_fault"] is None, (err, res)
    assert res["export_gap"]["kl_mean"] < 1e-6, res
    assert any("lm_head.weight" in n for n in res["notes"]), res["notes"]


def test_progress_counts_each_runtimes_own_steps(model, tmp_path):
    """A window and a 32-token continuation were one step each: the time left read 14 s where 3 minutes were
    left; then a window and a generated token were: 3-6x too long. Windows are forward passes (in llama.cpp scored
    positions), and the continuations a step of their own in tokens."""
    from qtool.evaluation import EvalOptions, evaluate_artifact
    from qtool.hooks import Hooks

    out = _quantize(model, tmp_path, "gguf-q8_0", "gguf")
    _, _, held = model
    steps = []
    opts = EvalOptions(data=str(held), seq_len=48, num_samples=2, generate=5, prompts=2, threads=1)
    evaluate_artifact(str(out), None, None, opts, Hooks(on_step=lambda *a: steps.append(a)))
    last = {}
    for name, done, total, item in steps:
        last[name] = (done, total, item)
    assert last["scoring (float)"] == (2, 2, "window 2/2")  # 2 passes
    assert last["continuing (float)"] == (2 * 5, 2 * 5, "continuation 2/2")  # then 2 x 5 tokens
    assert last["scoring (llama.cpp)"] == (2 * 48, 2 * 48, "window 2/2")  # a request per position
    assert ("scoring (float)", 1, 2, "window 1/2") in steps and ("continuing (float)", 5, 10, "continuation 1/2") \
        in steps


def test_encodings_given_that_were_calibrated_on_other_weights_are_said(model, tmp_path):
    """``-e`` with another model's encodings (same shapes): the fake-quant model was of other ranges, and a healthy
    file was blamed in an export fault without a word of why."""
    from safetensors.torch import load_file, save_file

    ckpt, calib, _ = model
    out = _quantize(model, tmp_path, "w8a16", "qtool")
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    t = load_file(str(other / "model.safetensors"))
    t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"].flip(0) * 3
    save_file(t, str(other / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli("calibrate", other, "-c", "w8a16", "-o", tmp_path / "other_run", "--data", calib,
                           "--seq-len", "32", "-q")
    assert code == 0, err
    code, res, err = _eval(model, out, "-e", tmp_path / "other_run/encodings.json")
    assert any("were calibrated on other weights" in n for n in res["notes"]), (code, res["notes"], err)
    assert code == 0 or "were calibrated on other weights than" in res["export_fault"], res["export_fault"]
    # another recipe's encodings of the same weights: an export fault blamed the file, with no note
    code, _, err = run_cli("calibrate", ckpt, "-c", "w4a16-block32", "-o", tmp_path / "w4_run", "--data", calib,
                           "--seq-len", "32", "-q")
    assert code == 0, err
    code, res, err = _eval(model, out, "-e", tmp_path / "w4_run/encodings.json")
    assert code == 1 and "are not the ones the file was exported from, so the fake-quant model is not what the file " \
        "was made from" in res["export_fault"], (code, res)
    assert any("are not the ones the file was exported from (its manifest records sha256" in n for n in res["notes"])
    # encodings with no calibration manifest beside them: nothing compared, and nothing was said
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(tmp_path / "other_run/encodings.json", lone)
    code, res, err = _eval(model, out, "-e", lone / "encodings.json")
    assert any(n.startswith(f"no manifest.json beside {lone / 'encodings.json'}: the weights the encodings were "
                            "made on are not compared") for n in res["notes"]), res["notes"]
    assert not any("were calibrated on other weights" in n for n in res["notes"])


def test_windows_past_a_gguf_files_context_are_one_line_before_any_model_runs(model, tmp_path):
    """llama.cpp refused them once the float and fake-quant models had run: internal error, exit 3."""
    _, _, held = model
    out = _quantize(model, tmp_path, "gguf-q8_0", "gguf")
    code, _, err = run_cli("eval", out, "--data", held, "--seq-len", "400", "--num-samples", "1", "--generate", "0",
                           "-q")
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and "its context is 256 tokens, and scoring needs 400" in lines[0], err


def _tiny_classifier(tmp_path):
    """A BERT classifier of 3 labels in ``tmp_path/cls`` and 4 token samples in ``tmp_path/d.safetensors``."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, num_labels=3)
    transformers.BertForSequenceClassification(cfg).eval().save_pretrained(tmp_path / "cls")
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, 100, (4, 16), generator=g), "attention_mask": torch.ones(4, 16,
               dtype=torch.long)}, tmp_path / "d.safetensors")


def test_a_compressed_tensors_classifier_is_reloaded_with_its_head(tmp_path):
    """transformers reloaded every non-causal-LM directory as AutoModel: a classifier lost its head ('outputs of
    another shape: an export of another model?'), T5 its decoder, and a smoke call with input_ids broke CLIP."""
    _tiny_classifier(tmp_path)
    code, _, err = run_cli("quantize", tmp_path / "cls", "-c", "w8a16", "-o", tmp_path / "ct", "--format",
                           "compressed-tensors", "-q")
    assert code == 0, err
    code, out, err = run_cli("eval", tmp_path / "ct", "--data", tmp_path / "d.safetensors", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["export_fault"] is None and res["cosine"]["export_gap"]["mean"] > 0.9999, res


def test_a_classifier_whose_logits_are_scaled_as_a_whole_is_an_export_fault(tmp_path):
    """Models that are not causal LMs were compared by cosine alone: a file whose classifier scale was tripled
    (every logit 3x the fake-quant model's, cosine 0.99999999) read as healthy, exit 0. The relative error sees it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    _tiny_classifier(tmp_path)
    out = tmp_path / "q"
    code, _, err = run_cli("quantize", tmp_path / "cls", "-c", "w8a16", "-o", out, "-q")
    assert code == 0, err
    code, text, err = run_cli("eval", out, "--data", tmp_path / "d.safetensors", "--json")
    res = json.loads(text)
    assert code == 0 and res["export_fault"] is None, res
    assert res["relative_error"]["export_gap"]["max"] < 1e-5 and res["relative_error"]["fake_quant"]["mean"] > 0

    f = out / "model.safetensors"
    with safe_open(str(f), "pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    tensors["classifier.weight_scale"] *= 3
    tensors["classifier.bias"] *= 3
    save_file(tensors, f, metadata=meta)
    code, text, err = run_cli("eval", out, "--data", tmp_path / "d.safetensors", "--json")
    res = json.loads(text)
    assert res["cosine"]["export_gap"]["min"] > 0.9999  # what the cosine alone saw
    assert res["relative_error"]["export_gap"]["mean"] == pytest.approx(2.0, rel=1e-3)
    assert code == 1 and "relative error 2" in res["export_fault"], res
    code, text, err = run_cli("eval", out, "--data", tmp_path / "d.safetensors", "--max-export-gap", "0.5")
    assert code == 1 and "export gap 2" in text + err, text + err


def test_windows_past_a_models_positions_are_one_line_naming_them(tmp_path):
    """A BERT of 8 positions given 16-token samples: eval was an internal error (RuntimeError: the size of tensor a
    (16) must match the size of tensor b (8), exit 3); calibrate named only torch's words."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=8)
    transformers.BertModel(cfg).eval().save_pretrained(tmp_path / "bert")
    g = torch.Generator().manual_seed(0)
    for n in (8, 16):
        save_file({"input_ids": torch.randint(0, 100, (4, n), generator=g)}, tmp_path / f"d{n}.safetensors")
    code, _, err = run_cli("quantize", tmp_path / "bert", "-c", "w8a8", "-o", tmp_path / "q", "--data",
                           tmp_path / "d8.safetensors", "-q")
    assert code == 0, err
    said = ("16 tokens per sample are past the model's 8 positions: pass --seq-len 8 or less for text, or save token "
            "samples of at most 8")
    code, _, err = run_cli("eval", tmp_path / "q", "--data", tmp_path / "d16.safetensors", "-q")
    assert code == 2 and error_lines(err) == [
        f"error: {tmp_path / 'd16.safetensors'}: evaluation batch 1: the model rejected the data: {said}"], err
    code, _, err = run_cli("calibrate", tmp_path / "bert", "-c", "w8a8", "-o", tmp_path / "c", "--data",
                           tmp_path / "d16.safetensors", "-q")
    assert code == 2 and said in err and not (tmp_path / "c").exists(), err
    # OPT's table holds 2 rows more than its max_position_embeddings (review: it read "index out of range in self")
    transformers.OPTModel(transformers.OPTConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, ffn_dim=64,
                                                 num_attention_heads=2, max_position_embeddings=8,
                                                 word_embed_proj_dim=32)).save_pretrained(tmp_path / "opt")
    code, _, err = run_cli("calibrate", tmp_path / "opt", "-c", "w8a8", "-o", tmp_path / "o", "--data",
                           tmp_path / "d16.safetensors", "-q")
    assert code == 2 and "16 tokens per sample are past the model's 8 positions" in err, err


def test_the_relative_error_of_outputs_near_or_at_zero():
    """Review: one sample whose reference output was all zeros made every figure NaN (and the scale check silent);
    one near zero (an ambiguous two-class logit pair) made the mean of squared relative errors 1.25 where the
    cosine's gap was 0.0024, a false fault where a runtime's allowance is a floor."""
    from qtool.evaluation import _relative_error
    from qtool.report import output_errors

    refs = [torch.tensor([[2.0, -1.0]] * 15 + [[0.002, -0.001]])]
    outs = [refs[0] + 0.01]
    rel = _relative_error(*output_errors(refs, outs, [None]))
    assert rel["pooled"] == pytest.approx((16 * 2e-4 / (15 * 5 + 5e-6)) ** 0.5, rel=1e-4)  # not the one sample's
    assert rel["max"] == pytest.approx(0.01 * 2 ** 0.5 / 5e-6 ** 0.5, rel=1e-3)  # (its own figure is still shown)
    tripled = [torch.cat([refs[0][:15] * 3, torch.zeros(1, 2)])]
    rel = _relative_error(*output_errors([torch.cat([refs[0][:15], torch.zeros(1, 2)])], tripled, [None]))
    assert rel["mean"] == pytest.approx(2.0) and rel["max"] == pytest.approx(2.0)
    assert rel["pooled"] == pytest.approx(2.0)


def test_a_t5_that_transformers_cannot_reload_packed_is_a_runtime_limit_in_one_line(tmp_path):
    """T5's own weight initialization reads a Linear's weight, which a pack-quantized Linear replaced by
    weight_packed: eval was an internal error (AttributeError, exit 3) on a file quantize wrote with exit 0."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=1, num_heads=2, d_kv=32)
    transformers.T5ForConditionalGeneration(cfg).eval().save_pretrained(tmp_path / "t5")
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, 128, (4, 16), generator=g),
               "decoder_input_ids": torch.randint(0, 128, (4, 8), generator=g)}, tmp_path / "d.safetensors")
    code, _, err = run_cli("quantize", tmp_path / "t5", "-c", "w4a16-block32", "-o", tmp_path / "ct", "--format",
                           "compressed-tensors", "-q")
    assert code == 0, err
    code, out, err = run_cli("eval", tmp_path / "ct", "--data", tmp_path / "d.safetensors", "-q")
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and "transformers cannot load it" in lines[0], err
    assert "reads a Linear's weight while loading" in lines[0] and "a limit of the runtime" in lines[0]


def test_a_float_checkpoint_is_refused_before_any_model_runs(model, tmp_path, monkeypatch):
    """A plain float directory given as the artifact ran the float reference's scoring (a minute on a real model),
    then said "not a readable qtool export (KeyError: 'qtool')"."""
    import qtool.evaluation as evaluation

    ckpt, _, held = model
    monkeypatch.setattr(evaluation, "_load", lambda *a: pytest.fail("a model was loaded"))
    code, _, err = run_cli("eval", ckpt, "--reference", ckpt, "--data", held, *EVAL, "-q")
    assert code == 2 and error_lines(err) == [
        f"error: {ckpt}: a checkpoint with no quantization (no manifest, no compressed-tensors config, no qtool "
        "metadata in model.safetensors), not an export qtool can evaluate; pass the directory `qtool export` "
        "wrote"], err


def test_too_few_tokens_to_score_says_what_was_counted(model, tmp_path):
    """The line counted every token (18) against the next tokens needed (17) and blamed the file for what was the
    window size."""
    _, _, held = model
    out = _quantize(model, tmp_path, "w8a16", "qtool")
    code, _, err = run_cli("eval", out, "--data", held, "--seq-len", "2", "--num-samples", "9", "--generate", "0",
                           "-q")
    assert code == 2 and "9 window(s) of up to --seq-len 2 predict 9 next tokens, and at least 16" in err, err
    # token ids are scored row by row as given: the line told the user to try a longer --seq-len, which cuts text
    from safetensors.torch import save_file

    save_file({"input_ids": torch.arange(10).reshape(2, 5)}, tmp_path / "short.safetensors")
    code, _, err = run_cli("eval", out, "--data", tmp_path / "short.safetensors", "--generate", "0", "-q")
    assert code == 2 and "2 token-id row(s), scored as given (--seq-len cuts text only), predict 8 next tokens" in err
    assert "give more or longer rows of token ids, or text" in err and "a longer --seq-len" not in err, err
    assert "--num-samples" not in err, err  # (every row was read)
    save_file({"input_ids": torch.arange(40).reshape(20, 2)}, tmp_path / "many.safetensors")
    code, _, err = run_cli("eval", out, "--data", tmp_path / "many.safetensors", "--generate", "0", "-q")
    assert code == 2 and "or text, or more --num-samples (8 rows were read)" in err, err


def test_the_json_keeps_every_models_key_without_encodings(model, tmp_path):
    """docs/ci.md lists perplexity (float, fake_quant, artifact) and vs_float (fake_quant, artifact): without
    encodings the fake_quant keys were missing, and a script reading them met a KeyError."""
    ckpt, _, held = model
    out = _quantize(model, tmp_path, "gguf-q8_0", "gguf")
    moved = tmp_path / "alone.gguf"
    shutil.copy(out / "model.gguf", moved)
    code, res, err = _eval(model, moved, "-r", ckpt)
    assert code == 0, err
    assert list(res["perplexity"]) == ["float", "fake_quant", "artifact"] and res["perplexity"]["fake_quant"] is None
    assert res["vs_float"]["fake_quant"] is None and res["vs_float"]["artifact"]["kl_mean"] >= 0
    assert res["generations"]["fake_quant"] is None and res["generations"]["artifact"]["prompts"] == 2


@pytest.mark.parametrize("damage", ["inf_norm", "nan_scale", "inf_scale"])
def test_a_gguf_whose_tensors_decode_to_nan_or_inf_is_one_line_before_any_model_runs(model, tmp_path, damage):
    """An Inf norm was 'llama.cpp could not score token ...' (exit 3); a NaN Q8_0 block scale an export fault beside
    a made-up perplexity below float's."""
    from gguf import GGUFReader

    out = _quantize(model, tmp_path, "gguf-q8_0", "gguf")
    reader = GGUFReader(out / "model.gguf", "r+")
    if damage == "inf_norm":
        t = next(t for t in reader.tensors if t.name == "output_norm.weight")
        t.data[3] = np.inf
    else:
        t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
        blocks = t.data.reshape(t.data.shape[0], -1, 34)  # Q8_0: a float16 scale, then 32 int8 codes
        bad = np.nan if damage == "nan_scale" else np.inf
        blocks[0, 0, :2] = np.array([bad], dtype=np.float16).view(np.uint8)
        blocks[0, 0, 2:] = 0  # (inf * 0: numpy's warning was a line of its own before the refusal)
    del reader
    _, _, held = model
    code, _, err = run_cli("eval", out, "--data", held, *EVAL, "-q")
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and f"tensor {t.name}" in lines[0] and "NaN or infinity" in lines[0], err


def test_an_onnx_graph_that_fails_on_a_batch_is_one_line_naming_the_file(tmp_path):
    """A graph onnxruntime loads but cannot run on the evaluation's batch (a per-head KV cache quantized along the
    batch took only batches of the head count) ended eval with an internal error, exit 3."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    from qtool.data import Batch
    from qtool.errors import UsageError
    from qtool.evaluation.runtimes import OnnxRuntime

    cast = helper.make_node("Cast", ["input_ids"], ["f"], to=TensorProto.FLOAT)
    add = helper.make_node("Add", ["f", "two_rows"], ["logits"])
    graph = helper.make_graph(
        [cast, add], "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "t"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t"])],
        [helper.make_tensor("two_rows", TensorProto.FLOAT, [2, 1], [0.0, 1.0])])
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    runtime = OnnxRuntime(path)
    assert runtime.outputs(Batch((), {"input_ids": torch.zeros(2, 4, dtype=torch.long)})).shape == (2, 4)
    with pytest.raises(UsageError, match=rf"^{re.escape(str(path))}: onnxruntime fails to run it on a batch of "
                                         r"shape \[\[3, 4\]\]: "):
        runtime.outputs(Batch((), {"input_ids": torch.zeros(3, 4, dtype=torch.long)}))


def test_a_reference_holding_nan_is_refused_as_report_refuses_it(model, tmp_path):
    """eval against a float checkpoint holding a NaN exited 0: NaN perplexities and KL, top-1 agreement 1.0."""
    from safetensors.torch import load_file, save_file

    ckpt, _, held = model
    out = _quantize(model, tmp_path, "w8a16", "qtool")
    nan = tmp_path / "nan"
    shutil.copytree(ckpt, nan)
    (weights,) = nan.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    for args in (("eval", out, "-r", nan, "--data", held, *EVAL),
                 ("report", nan, "-e", out / "calibration/encodings.json", "--data", held, "--seq-len", "48",
                  "--allow-other-checkpoint")):
        code, _, err = run_cli(*args)
        assert code == 2 and error_lines(err)[-1] == (f"error: {nan}: model.layers.0.mlp.down_proj.weight holds NaN or "
                                                      "infinity, so the float model is no reference to measure "
                                                      "against"), (args[0], err)


def test_quantize_eval_fits_its_windows_to_the_models_positions(model, tmp_path):
    """A model of 128 positions: quantize --eval wrote the GGUF file, then exited 2 ("its context is 128 tokens,
    and scoring needs 256 ...: give a shorter --seq-len", which is quantize's calibration flag, not eval's)."""
    ckpt, calib, held = model
    short = tmp_path / "short"
    shutil.copytree(ckpt, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    code, out, err = run_cli("quantize", short, "-c", "gguf-q8_0", "--format", "gguf", "-o", tmp_path / "q",
                             "--data", calib, "--seq-len", "32", "--eval", held, "--json")
    assert code == 0, err
    res = json.loads(out)["eval"]
    assert res["export_fault"] is None and res["tokens"] % 127 == 0, res["tokens"]  # (windows of 128: 127 scored)


def test_a_gguf_file_without_a_bias_the_reference_holds_is_refused(tmp_path):
    """llama.cpp runs a file that lacks a bias without it (optional to its graph): a Llama-with-biases file whose
    ffn_down bias was dropped passed eval at exit 0 (gap within the allowance), where the torch formats refuse a
    file missing any parameter."""
    from qtool.errors import UsageError
    from qtool.evaluation import _check_gguf_biases

    biased = _tiny_llama(tmp_path / "qwen2", False, "qwen2")  # (q, k and v biases)
    plain = _tiny_llama(tmp_path / "llama", False)  # (the same shapes, no biases)
    for ckpt, out in ((biased, tmp_path / "qb"), (plain, tmp_path / "qp")):
        assert run_cli("quantize", ckpt, "-c", "gguf-q8_0", "--format", "gguf", "-o", out, "-q")[0] == 0
    _check_gguf_biases(tmp_path / "qb/model.gguf", str(biased))  # (whole: nothing said)
    with pytest.raises(UsageError, match=r"the file holds no blk\.0\.attn_[qkv]\.bias \(the reference's "
                                         r"model\.layers\.0\.self_attn\.[qkv]_proj\.bias\): not a whole export"):
        _check_gguf_biases(tmp_path / "qp/model.gguf", str(biased))


def test_a_compressed_tensors_config_that_disagrees_with_its_tensors_names_the_tensor(model, tmp_path):
    """group_size edited in config.json: 'transformers cannot load it (... For details look at the above report!)',
    a report qtool keeps off the terminal."""
    ckpt, _, held = model
    out = _quantize(model, tmp_path, "w4a16-block32", "compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64
    (out / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli("eval", out, "--data", held, *EVAL)
    assert code == 2 and re.search(r"weight_scale is \[\d+, \d+\] in the file, and the model its config\.json "
                                   r"describes takes \[\d+, \d+\]", error_lines(err)[-1]), err
    assert "above report" not in err
    # q_proj added to the ignore list: its packed tensors go unread, which read as "a limit of the runtime"
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    config["quantization_config"]["ignore"] = config["quantization_config"].get("ignore", []) + [
        "model.layers.0.self_attn.q_proj"]
    (out / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli("eval", out, "--data", held, *EVAL)
    assert code == 2 and error_lines(err)[-1].endswith(
        "the file holds model.layers.0.self_attn.q_proj quantized (weight_packed), and config.json's "
        "quantization_config leaves it float (its ignore list?): the tensors and config.json disagree (one edited "
        "since export?)"), err


def test_llama_cpps_activation_rounding_is_its_q8_0_bit_for_bit():
    """The 8-bit rounding eval weighs a GGUF gap against is llama.cpp's own: Q8_0 (per 32 values, a float16 scale)
    as gguf-py's reference quantizes and dequantizes it; Q8_K per 256 with a float32 scale."""
    import gguf

    from qtool.evaluation.llamacpp import _q8

    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 16)[:, None]
    x[3, :32] = 0.0  # (a block of zeros)
    ref = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0),
                                 gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(_q8(x, 32, True), torch.from_numpy(ref))
    k = _q8(x, 256, False)
    codes = k / (x.abs().amax(-1, keepdim=True) / 127)
    assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.abs().max() <= 127 + 1e-3


def test_data_every_mask_drops_is_one_line_before_any_model_runs(model, tmp_path):
    """Token ids whose attention_mask is all 0 hold no text to score: an encoder's run ended in exit 3 (the min of
    no cosines), a causal LM's in a figure of nothing."""
    from safetensors.torch import save_file

    ckpt, _, _ = model
    assert run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "q", "-q")[0] == 0
    ids = torch.randint(1, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids, "attention_mask": torch.zeros_like(ids)}, tmp_path / "none.safetensors")
    code, _, err = run_cli("eval", tmp_path / "q", "--data", tmp_path / "none.safetensors")
    assert code == 2 and f"error: {tmp_path / 'none.safetensors'}: holds no token its attention_mask keeps (every " \
        "mask is 0): nothing to measure an evaluation on" in err, err
    assert "measuring the float model" not in err


def test_a_gguf_llama_cpp_cannot_load_says_llama_cpps_reason(tmp_path, capfd):
    """The server's own error read 'Failed to init server, please check the input params.', llama.cpp's five log
    lines with the reason printed before it."""
    pytest.importorskip("xllamacpp")
    gguf = pytest.importorskip("gguf")
    from qtool.errors import UsageError
    from qtool.evaluation.llamacpp import LlamaCpp

    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")  # (no tokenizer: llama.cpp refuses the vocabulary)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    capfd.readouterr()
    with pytest.raises(UsageError, match=r"bare.gguf: llama.cpp cannot load this file \(error loading model "
                                         r"vocabulary: key not found in model: tokenizer.ggml.model\)$"):
        LlamaCpp(str(tmp_path / "bare.gguf"))
    assert "error loading model" not in capfd.readouterr().err  # (said once, in the error)


def test_a_missing_artifact_is_said_before_the_reference_is_fetched_and_bad_text_before_a_model_loads(tmp_path):
    """eval -r ORG/NAME looked the reference up (a download, online) before saying the artifact was missing; text
    data that cannot be read was named after the float checkpoint had loaded."""
    (tmp_path / "bad.jsonl").write_text('{"txt": "no text field"}\n')
    code, _, err = run_cli("eval", tmp_path / "no-such-artifact", "-r", "org/some-model", "--data",
                           tmp_path / "bad.jsonl")
    assert code == 2 and "no-such-artifact" in error_lines(err)[-1] and "Hugging Face" not in err, err
    checkpoint = _tiny_llama(tmp_path / "m", False)
    code, _, err = run_cli("quantize", checkpoint, "-c", "w8a16", "-o", tmp_path / "q", "--quiet")
    assert code == 0, err
    code, _, err = run_cli("eval", tmp_path / "q", "--data", tmp_path / "bad.jsonl")
    assert code == 2 and "needs a string field 'text'" in error_lines(err)[-1], err
    assert "loading" not in err, err
