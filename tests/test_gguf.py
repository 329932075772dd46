"""GGUF export: the gguf package reads qtool's file back to qtool's fake-quant weights bit for bit, llama.cpp
itself (xllamacpp) runs it and agrees with qtool's model, and what GGUF cannot hold is refused before any work."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.quant.affine import grid, min_max_to_scale_offset, snap_to_float16_scale

from tests.helpers import error_lines, run_cli

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
VOCAB = 300


def _tiny_llama(dest: Path, tied: bool, model_type: str = "llama", hidden: int = 64,
                init_range: float = 0.02, every_byte: bool = False) -> Path:
    """A random tiny Llama (grouped-query attention) with a byte-level BPE tokenizer trained on ASCII text (every
    token decodes to whole characters; ``every_byte``: the 256 bytes are tokens too, so other text becomes pieces
    of characters). A larger ``init_range`` gives confident next-token distributions, as a trained model's are."""
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB + 20, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied,
              initializer_range=init_range)
    if model_type == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    model.eval().save_pretrained(dest)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [v.encode("ascii", "ignore").decode() for v in list(pydoc_data.topics.topics.values())[:100]]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if every_byte else []))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                         eos_token="<|endoftext|>").save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return {"untied": _tiny_llama(d / "untied", False), "tied": _tiny_llama(d / "tied", True)}


def _fake_quant_weights(model) -> dict:
    out = {}
    for name, mod in model.named_modules():
        qs = getattr(mod, "qtool_quantizers", None)
        if qs is not None and "weight" in qs:
            out[f"{name}.weight"] = qs["weight"](mod.weight).as_subclass(torch.Tensor).detach()
    return out


def _gguf_values(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors}


def _permute(w, heads):
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("recipe,main", [("gguf-q4_0", "Q4_0"), ("gguf-q4_1", "Q4_1"), ("gguf-q8_0", "Q8_0"),
                                         ("gguf-q5_0", "Q5_0"), ("gguf-q5_1", "Q5_1")])
@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_gguf_dequantizes_to_qtools_fake_quant_weights_bit_for_bit(llamas, tmp_path, recipe, main, kind):
    import qtool

    ckpt = llamas[kind]
    code, out, err = run_cli("quantize", ckpt, "-c", CONFIGS / f"{recipe}.yaml", "-o", tmp_path / "q", "--format",
                             "gguf", "--json")
    assert code == 0, err
    summary = json.loads(out)["gguf"]
    assert summary["file_type"] == main and summary["max_weight_deviation"] == 0.0
    values = _gguf_values(tmp_path / "q" / "model.gguf")
    model = qtool.load_calibrated(str(ckpt), str(tmp_path / "q/calibration/encodings.json"))
    fq = _fake_quant_weights(model)
    cfg = model.config
    names = json.loads(out)["names"]
    assert len(fq) == 16 and set(names) == set(fq)
    for hf_name, w in fq.items():
        if hf_name.endswith("q_proj.weight"):
            w = _permute(w, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = _permute(w, cfg.num_key_value_heads)
        kind_, deq = values[names[hf_name]]
        assert kind_ == ("Q8_0" if "embed" in hf_name or "lm_head" in hf_name else main)
        assert np.array_equal(deq.reshape(w.shape), w.numpy()), hf_name
    # a tied model's output layer is its embedding table: one tensor serves both
    assert ("output.weight" in values) == (kind == "untied")
    assert values["output_norm.weight"][0] == "F32"


def _agreement_with_llama_cpp(ckpt: Path, out: Path, n: int):
    """On ``n`` random prompts: how often llama.cpp's next token on ``out/model.gguf`` is qtool's fake-quant
    model's, and the largest log-probability difference over llama.cpp's top 3."""
    import qtool

    from tests.llamacpp import LlamaCpp

    model = qtool.load_calibrated(str(ckpt), str(out / "calibration/encodings.json")).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (int(k),), generator=g).tolist()
               for k in torch.randint(4, 40, (n,), generator=g)]
    agree, worst = 0, 0.0
    with LlamaCpp(str(out / "model.gguf")) as llama:
        for p in prompts:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([p])).logits[0, -1].double(), -1)
            agree += int(logp.argmax()) == llama.greedy_next(p)
            worst = max(worst, max(abs(float(logp[t]) - lp) for t, lp in llama.top(p, 3)))
    return agree, worst


def test_llama_cpp_runs_the_file_and_agrees_with_qtool(llamas, tmp_path):
    pytest.importorskip("xllamacpp")
    ckpt = llamas["tied"]
    code, _, err = run_cli("quantize", ckpt, "-c", CONFIGS / "gguf-q4_0.yaml", "-o", tmp_path / "q", "--format",
                           "gguf")
    assert code == 0, err
    agree, worst = _agreement_with_llama_cpp(ckpt, tmp_path / "q", 40)
    # llama.cpp multiplies in int8 (activations quantized per 32 values): close to, not equal to, float math
    assert agree >= 38, agree
    assert worst < 0.05, worst


def test_without_float16_scales_the_export_states_its_deviation(llamas, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text((CONFIGS / "gguf-q4_0.yaml").read_text().replace(", scale_dtype: float16", ""))
    code, out, err = run_cli("quantize", llamas["untied"], "-c", recipe, "-o", tmp_path / "q", "--format", "gguf",
                             "--json")
    assert code == 0, err
    dev = json.loads(out)["gguf"]["max_weight_deviation"]
    assert 0 < dev < 1e-3
    assert "float16" in err and f"{dev:.3g}" in err


def test_fallback_writes_unmappable_weights_as_floats_and_says_so(llamas, tmp_path):
    code, out, err = run_cli("quantize", llamas["untied"], "-c", CONFIGS / "w4a16-block32.yaml", "-o",
                             tmp_path / "q", "--format", "gguf", "--gguf-fallback", "f16", "--gguf-float", "f16",
                             "--json")
    assert code == 0, err
    s = json.loads(out)["gguf"]
    assert s["fallback"] == ["model.embed_tokens.weight"] and "model.embed_tokens.weight" in err
    types = {n: k for n, (k, _) in _gguf_values(tmp_path / "q/model.gguf").items()}
    assert types["token_embd.weight"] == "F16" and types["output.weight"] == "F16"  # lm_head: ignored -> float
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.0.attn_norm.weight"] == "F32"
    # f16 rounds the fake-quant values: the summary said max_weight_deviation 0 where only scales were counted
    import qtool

    enc = tmp_path / "q/calibration/encodings.json"
    fq = _fake_quant_weights(qtool.load_calibrated(str(llamas["untied"]), str(enc)))
    written = torch.from_numpy(_gguf_values(tmp_path / "q/model.gguf")["token_embd.weight"][1].copy())
    moved = float((written - fq["model.embed_tokens.weight"]).abs().max())
    assert 0 < moved <= s["max_weight_deviation"], (moved, s)
    assert f"their fake-quant values rounded to f16, moved by up to {moved:.3g}" in " ".join(err.split()), err


def test_qwen2_writes_its_own_architecture_unpermuted(tmp_path):
    import qtool

    ckpt = _tiny_llama(tmp_path / "qwen", True, "qwen2")
    code, _, err = run_cli("quantize", ckpt, "-c", CONFIGS / "gguf-q8_0.yaml", "-o", tmp_path / "q", "--format",
                           "gguf")
    assert code == 0, err
    reader = gguf.GGUFReader(tmp_path / "q/model.gguf")
    assert reader.fields["general.architecture"].contents() == "qwen2"
    values = _gguf_values(tmp_path / "q/model.gguf")
    fq = _fake_quant_weights(qtool.load_calibrated(str(ckpt), str(tmp_path / "q/calibration/encodings.json")))
    q = fq["model.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(values["blk.0.attn_q.weight"][1].reshape(q.shape), q.numpy())
    assert values["blk.0.attn_q.bias"][0] == "F32"


def test_inspect_reads_gguf(llamas, tmp_path):
    code, _, err = run_cli("quantize", llamas["tied"], "-c", CONFIGS / "gguf-q4_1.yaml", "-o", tmp_path / "q",
                           "--format", "gguf")
    assert code == 0, err
    code, out, err = run_cli("inspect", tmp_path / "q", "--json")
    assert code == 0, err
    rep = json.loads(out)
    rows = {r["name"]: r for r in rep["tensors"]}
    assert rows["blk.1.ffn_up.weight"]["dtype"] == "Q4_1" and rows["blk.1.ffn_up.weight"]["shape"] == [128, 64]
    assert rows["blk.1.ffn_up.weight"]["bytes"] == 128 * 64 // 32 * 20
    # a Q4_1 block of 32 weights is 20 bytes: 4-bit codes plus a float16 scale and minimum, 5 bits per weight
    assert rows["blk.1.ffn_up.weight"]["bitwidth"] == 4
    assert rows["blk.1.ffn_up.weight"]["granularity"] == "per_block 32, 5 bits/weight"
    assert rows["blk.1.attn_norm.weight"]["dtype"] == "F32" and rows["blk.1.attn_norm.weight"]["bitwidth"] == 32
    numel = sum(math.prod(r["shape"]) for r in rep["tensors"])
    assert rep["totals"]["bits_per_weight"] == pytest.approx(8 * rep["totals"]["bytes"] / numel)
    assert rep["metadata"]["general.architecture"] == "llama" and rep["metadata"]["tokenizer.ggml.pre"] == "gpt-2"
    assert rep["totals"]["quantized_tensors"] == 15
    bad = tmp_path / "bad.gguf"
    bad.write_bytes((tmp_path / "q/model.gguf").read_bytes()[:700])
    code, _, err = run_cli("inspect", bad)
    assert code == 2 and len(error_lines(err)) == 1 and "bad.gguf" in err


# ---- refusals: one line, exit 2, nothing written ------------------------------------------------------------
def _recipe(tmp_path, weights: str, activations: str = "null") -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(f"version: 1\ndefaults:\n  weights: {weights}\n  activations: {activations}\n")
    return p


@pytest.mark.parametrize("weights,activations,needle", [
    ("{bitwidth: 4, granularity: per_block, block_size: 64}", "null", "per_block 64"),
    ("{bitwidth: 6, granularity: per_block, block_size: 32}", "null", "6-bit"),
    ("{bitwidth: 8, symmetric: false, granularity: per_block, block_size: 32}", "null", "8-bit asymmetric"),
    ("{bitwidth: 8, granularity: per_channel}", "null", "per_channel"),
    ("{bitwidth: 8, granularity: per_block, block_size: 32}", "{bitwidth: 8}", "activation"),
])
def test_what_gguf_cannot_hold_is_refused_before_calibration(llamas, tmp_path, weights, activations, needle):
    recipe = _recipe(tmp_path, weights, activations)
    code, _, err = run_cli("quantize", llamas["untied"], "-c", recipe, "-o", tmp_path / "q", "--format", "gguf")
    assert code == 2 and needle in err
    assert len(error_lines([line for line in err.splitlines() if line.startswith("error")][0])) == 1
    assert "calibrating" not in err and not (tmp_path / "q").exists()


def test_non_llama_models_are_refused(tmp_path):
    from safetensors.torch import save_file

    from tests.tinymodels import mlp

    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    code, _, err = run_cli("quantize", tmp_path / "m.safetensors", "-c", CONFIGS / "gguf-q8_0.yaml", "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "q", "--format", "gguf", "--allow-unmatched")
    assert code == 2 and "Hugging Face model directory" in err and not (tmp_path / "q").exists()
    assert "calibrating" not in err
    bert = tmp_path / "bert"
    transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=64)).save_pretrained(bert)
    code, _, err = run_cli("quantize", bert, "-c", CONFIGS / "gguf-q8_0.yaml", "-o", tmp_path / "q2", "--format",
                           "gguf")
    assert code == 2 and "model_type 'bert'" in err and not (tmp_path / "q2").exists()
    assert "calibrating" not in err
    assert len(error_lines(err.split("error:", 1)[1])) == 1


def _set_key(name, key, value):
    def edit(d):
        obj = json.loads((d / name).read_text())
        obj[key] = value
        (d / name).write_text(json.dumps(obj))
    return edit


def _set_vocab_list(d):
    obj = json.loads((d / "tokenizer.json").read_text())
    obj["model"]["vocab"] = list(obj["model"]["vocab"])
    (d / "tokenizer.json").write_text(json.dumps(obj))


@pytest.mark.parametrize("damage,needle", [
    (lambda d: (d / "tokenizer.json").write_bytes((d / "tokenizer.json").read_bytes()[:200]), "tokenizer.json"),
    (_set_vocab_list, "tokenizer.json: tokenizer not usable for GGUF"),
    (lambda d: (d / "tokenizer_config.json").write_text("[1, 2]"), "tokenizer_config.json"),
    (lambda d: (d / "special_tokens_map.json").write_bytes(b"\xff\xfe{"), "special_tokens_map.json"),
    (_set_key("config.json", "max_position_embeddings", "2048"), "max_position_embeddings must be a positive integer"),
    (_set_key("config.json", "num_key_value_heads", 0), "num_key_value_heads must be a positive integer"),
    (_set_key("config.json", "rms_norm_eps", "nan"), "rms_norm_eps must be a finite number"),
    (_set_key("config.json", "rope_theta", [1]), "rope_theta / rope_scaling must be finite numbers"),
    (_set_key("config.json", "model_type", ["llama"]), "has no GGUF export"),
])
def test_a_damaged_model_directory_is_one_line_before_calibration(llamas, tmp_path, damage, needle):
    """config.json and the tokenizer files are read as the GGUF export will read them before any calibration: a
    fault in one is a single error line naming the file, and nothing is written."""
    import shutil

    src = tmp_path / "m"
    shutil.copytree(llamas["untied"], src)
    damage(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    code, _, err = run_cli("quantize", src, "-c", CONFIGS / "gguf-q8_0.yaml", "-o", tmp_path / "q", "--format",
                           "gguf")
    errors = [line for line in error_lines(err) if line.startswith("error")]
    assert code == 2 and len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err and "calibrating" not in err and not (tmp_path / "q").exists()
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_bad_gguf_choices_fail_before_loading(tmp_path):
    code, _, err = run_cli("export", tmp_path / "nothing", "-e", tmp_path / "e.json", "-o", tmp_path / "o",
                           "--format", "gguf", "--gguf-fallback", "bf16")
    assert code == 2 and "--gguf-fallback must be one of none, f32, f16" in err


def test_scale_dtype_float16_is_refused_where_it_cannot_be_exact(tmp_path):
    code, _, err = run_cli("config", "validate", _recipe(
        tmp_path, "{bitwidth: 8, symmetric: false, granularity: per_block, block_size: 32, scale_dtype: float16}"))
    assert code == 2 and "asymmetric grids up to 5 bits" in err


# ---- the numbers ------------------------------------------------------------------------------------------------
_finite = st.floats(2.0**-4, 2.0**10, allow_nan=False, width=32)  # scales in float16's normal range


@settings(max_examples=60, deadline=None)
@given(lo=st.lists(_finite, min_size=1, max_size=16), hi=st.lists(_finite, min_size=1, max_size=16),
       bits=st.sampled_from([(4, True), (8, True), (4, False), (2, False), (3, True), (5, True), (5, False)]))
def test_snapped_ranges_give_float16_scales_and_integer_offsets(lo, hi, bits):
    n = min(len(lo), len(hi))
    lo, hi = -torch.tensor(lo[:n]), torch.tensor(hi[:n])
    qmin, qmax = grid(*bits)
    mn, mx = snap_to_float16_scale(lo, hi, qmin, qmax, bits[1])
    scale, offset = min_max_to_scale_offset(mn, mx, qmin, qmax, bits[1])
    scale0, _ = min_max_to_scale_offset(lo, hi, qmin, qmax, bits[1])
    assert torch.equal(scale.half().float(), scale)
    assert torch.equal(offset, offset.round())
    origin = offset * scale
    assert torch.equal(origin.half().float(), origin)  # Q4_1's m
    tol = 0.02 if bits == (5, False) else 0.01  # 5 bits may need up to 16 float16 steps, 4 bits at most 8
    assert ((scale / scale0 - 1).abs() <= tol).all()  # within a few float16 steps of the calibrated scale


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), nb=st.integers(1, 3), qtype=st.sampled_from(["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]),
       seed=st.integers(0, 2**16))
def test_pack_blocks_is_what_ggml_dequantizes(rows, nb, qtype, seed):
    from qtool.export.gguf import pack_blocks

    g = torch.Generator().manual_seed(seed)
    bits, sym = {"Q8_0": (8, True), "Q4_0": (4, True), "Q4_1": (4, False), "Q5_0": (5, True), "Q5_1": (5, False)}[qtype]
    qmin, qmax = grid(bits, sym)
    codes = torch.randint(qmin, qmax + 1, (rows, nb * 32), generator=g).float()
    scale = (torch.rand(rows, nb, generator=g) + 0.01).half().float()
    offset = torch.zeros(rows, nb) if sym else -torch.randint(0, qmax + 1, (rows, nb), generator=g).float()
    blocks, values = pack_blocks(codes, scale, offset, qtype)
    deq = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, qtype))
    assert np.array_equal(deq.reshape(values.shape), values.numpy())
    exact = torch.repeat_interleave((offset * scale).half().float(), 32, 1) == torch.repeat_interleave(
        offset * scale, 32, 1)
    fake = (codes + torch.repeat_interleave(offset, 32, 1)) * torch.repeat_interleave(scale, 32, 1)
    assert torch.equal(values[exact], fake[exact])


def test_byte_fallback_tokenizers_write_the_llama_vocabulary_and_load(tmp_path):
    """Mistral / Llama 2 style: byte-fallback BPE becomes GGUF's ``llama`` tokenizer with byte tokens typed BYTE."""
    pytest.importorskip("xllamacpp")
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    from tests.llamacpp import LlamaCpp

    ckpt = tmp_path / "mistral"
    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128)).save_pretrained(ckpt)
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    text = [v.encode("ascii", "ignore").decode() for v in list(pydoc_data.topics.topics.values())[:50]]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    transformers.LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                    unk_token="<unk>").save_pretrained(ckpt)
    code, _, err = run_cli("quantize", ckpt, "-c", CONFIGS / "gguf-q8_0.yaml", "-o", tmp_path / "q", "--format",
                           "gguf")
    assert code == 0, err
    reader = gguf.GGUFReader(tmp_path / "q/model.gguf")
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["tokenizer.ggml.model"].contents() == "llama"
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert types.count(int(gguf.TokenType.BYTE)) == 256 and len(types) == 400
    with LlamaCpp(str(tmp_path / "q/model.gguf")) as llama:
        assert len(llama.top([1, 300, 301, 302], 3)) == 3  # llama.cpp loads the vocabulary and runs the model


# ---- llama.cpp's K-quant and IQ4 types --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """Rows of 256 and 512: whole K-quant super-blocks."""
    return _tiny_llama(tmp_path_factory.mktemp("gguf-wide") / "m", False, hidden=256)


def _type_recipe(tmp_path: Path, gguf_type: str, rounding: str = "") -> Path:
    recipe = tmp_path / f"{gguf_type}.yaml"
    recipe.write_text(f"version: 1\ndefaults:\n  weights: {{gguf_type: {gguf_type}{rounding}}}\n  activations: null\n")
    return recipe


@pytest.mark.parametrize("gguf_type", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"])
def test_k_quant_files_read_back_as_qtools_fake_quant_weights(wide_llama, tmp_path, gguf_type):
    import qtool

    code, out, err = run_cli("quantize", wide_llama, "-c", _type_recipe(tmp_path, gguf_type), "-o", tmp_path / "q",
                             "--format", "gguf", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["gguf"]["tensor_types"][gguf_type.upper()] == 16
    values = _gguf_values(tmp_path / "q" / "model.gguf")
    model = qtool.load_calibrated(str(wide_llama), str(tmp_path / "q/calibration/encodings.json"))
    cfg = model.config
    fq = _fake_quant_weights(model)
    assert len(fq) == 16
    for hf_name, w in fq.items():
        if hf_name.endswith("q_proj.weight"):
            w = _permute(w, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = _permute(w, cfg.num_key_value_heads)
        kind, deq = values[summary["names"][hf_name]]
        assert kind == gguf_type.upper()
        assert np.array_equal(deq.reshape(w.shape), w.numpy()), hf_name
    # qtool inspect names the type, its code bits and what it costs per weight (ggml's block sizes)
    code, out, err = run_cli("inspect", tmp_path / "q", "--json")
    assert code == 0, err
    row = {r["name"]: r for r in json.loads(out)["tensors"]}["blk.0.ffn_down.weight"]
    cost = {"q2_k": 2.625, "q3_k": 3.4375, "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625, "iq4_nl": 4.5, "iq4_xs": 4.25}
    assert row["dtype"] == gguf_type.upper() and row["bitwidth"] == int(gguf_type[2 if gguf_type[0] == "i" else 1])
    assert row["granularity"].endswith(f", {cost[gguf_type]:g} bits/weight")


def test_llama_cpp_runs_a_q4_k_file_and_agrees_with_qtool(wide_llama, tmp_path):
    pytest.importorskip("xllamacpp")
    code, _, err = run_cli("quantize", wide_llama, "-c", _type_recipe(tmp_path, "q4_k"), "-o", tmp_path / "q",
                           "--format", "gguf")
    assert code == 0, err
    agree, worst = _agreement_with_llama_cpp(wide_llama, tmp_path / "q", 30)
    assert agree >= 28, agree  # llama.cpp multiplies K-quants against 8-bit activations (Q8_K)
    assert worst < 0.05, worst


def test_rows_that_are_not_whole_super_blocks_fall_back_as_llama_quantize_does(llamas, tmp_path):
    """Width 64: Q4_K -> Q5_0, Q6_K -> Q8_0, Q3_K -> Q4_0, as llama-quantize falls back, said once in the plan."""
    for gguf_type, fallback in (("q4_k", "Q5_0"), ("q6_k", "Q8_0"), ("q3_k", "Q4_0"), ("q5_k", "Q5_1"),
                                ("iq4_xs", "IQ4_NL")):
        out_dir = tmp_path / gguf_type
        code, out, err = run_cli("quantize", llamas["untied"], "-c", _type_recipe(tmp_path, gguf_type), "-o",
                                 out_dir, "--format", "gguf", "--json")
        assert code == 0, err
        summary = json.loads(out)
        assert summary["gguf"]["tensor_types"] == {fallback: 16, "F32": 5}, summary["gguf"]
        assert any(f"16 weight(s) of {gguf_type.upper()}" in w and fallback in w for w in summary["warnings"])


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors", "aimet", "onnx"])
def test_other_formats_refuse_gguf_types_before_calibrating(wide_llama, tmp_path, fmt):
    code, _, err = run_cli("quantize", wide_llama, "-c", _type_recipe(tmp_path, "q4_k"), "-o", tmp_path / "q",
                           "--format", fmt)
    assert code == 2 and [line for line in error_lines(err) if line.startswith("error")] == [
        "error: model.embed_tokens.weight is GGUF Q4_K per_block (1, 32) -> (320, 8), one of llama.cpp's block "
        "types (16 quantizer(s) in all): export it with --format gguf"]
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("body,needle", [
    ("{gguf_type: q4_k, bitwidth: 8}", "gguf_type q4_k sets bitwidth to 4 (got 8); remove bitwidth"),
    ("{gguf_type: q7_k}", "gguf_type"),
    ("{scale_dtype: q4_k, bitwidth: 4, symmetric: true, granularity: per_block, block_size: 32}",
     "scale_dtype q4_k is GGUF's Q4_K: 4-bit asymmetric blocks of 32 (write gguf_type: q4_k)"),
    ("{gguf_type: q4_k, analyzer: percentile}", "analyzer percentile is not available on GGUF's block types"),
])
def test_bad_gguf_types_in_a_recipe_are_one_line(tmp_path, body, needle):
    code, _, err = run_cli("config", "validate", _recipe(tmp_path, body))
    assert code == 2 and needle in err and len(error_lines(err)) == 1, err


@pytest.mark.parametrize("gguf_type", ["q4_k", "q3_k", "iq4_xs"])
def test_gptq_on_gguf_types_beats_round_to_nearest_and_the_file_holds_its_codes(wide_llama, tmp_path, gguf_type):
    """GPTQ rounds each column onto the sub-block grid the type stores; the file reads back as qtool's model, and
    the layers' output error on the calibration text is below round-to-nearest's."""
    import qtool

    ids = torch.randint(1, VOCAB, (16, 32), generator=torch.Generator().manual_seed(3))
    from safetensors.torch import save_file

    save_file({"input_ids": ids}, tmp_path / "data.safetensors")
    logits = {}
    for name, rounding in (("rtn", ""), ("gptq", ", rounding: gptq")):
        out_dir = tmp_path / name
        code, out, err = run_cli("quantize", wide_llama, "-c", _type_recipe(tmp_path, gguf_type, rounding), "-o",
                                 out_dir, "--format", "gguf", "--data", tmp_path / "data.safetensors", "--json")
        assert code == 0, err
        model = qtool.load_calibrated(str(wide_llama), str(out_dir / "calibration/encodings.json")).eval()
        if name == "gptq":
            values = _gguf_values(out_dir / "model.gguf")
            names = json.loads(out)["names"]
            from qtool.model.insert import _STORED

            modules = dict(model.named_modules())
            for hf_name in _fake_quant_weights(model):
                if "proj" in hf_name and not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                    w = modules[hf_name[:-len(".weight")]].__dict__[_STORED]  # GPTQ's codes, dequantized
                    assert np.array_equal(values[names[hf_name]][1].reshape(w.shape), w.numpy()), hf_name
        with torch.no_grad():
            logits[name] = model(ids).logits
    float_model = transformers.AutoModelForCausalLM.from_pretrained(wide_llama).eval()
    with torch.no_grad():
        ref = float_model(ids).logits
    err_rtn, err_gptq = (float((logits[n] - ref).pow(2).mean()) for n in ("rtn", "gptq"))
    assert err_gptq < err_rtn, (err_gptq, err_rtn)


@pytest.mark.parametrize("rounding", ["", ", rounding: gptq"])
def test_a_weight_whose_gguf_scales_float16_cannot_hold_is_one_line(tmp_path, rounding):
    """A value of 1e9 needs a Q5_0 block scale above float16's 65504 (64-wide rows: Q4_K falls back to Q5_0)."""
    from safetensors.torch import save_file

    from tests.tinymodels import mlp

    sd = mlp().state_dict()
    sd["0.weight"][0, 0] = 1e9
    save_file(sd, tmp_path / "m.safetensors")
    save_file({"x": torch.randn(16, 64, generator=torch.Generator().manual_seed(0))}, tmp_path / "x.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "-c", _type_recipe(tmp_path, "q4_k", rounding),
                           "--model-class", "tests.tinymodels:mlp", "--data", tmp_path / "x.safetensors",
                           "-o", tmp_path / "o")
    errors = [line for line in error_lines(err) if line.startswith("error")]
    assert code == 2 and len(errors) == 1 and "0.weight" in errors[0] and "float16's range (65504)" in errors[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("recipe", ["gguf-q4_1", "gguf-q8_0"])
def test_large_tensors_are_packed_in_row_chunks_with_the_same_bytes(llamas, tmp_path, monkeypatch, recipe):
    """A vocabulary-sized table is written a chunk of rows at a time (bounded temporaries): forcing one-row chunks
    on every tensor gives the bytes of the whole-tensor path."""
    import qtool.export.gguf as gguf_export

    model = llamas["untied"]
    code, _, err = run_cli("calibrate", model, "-c", recipe, "-o", tmp_path / "run")
    assert code == 0, err
    files = []
    for chunk in (1 << 24, 64):
        monkeypatch.setattr(gguf_export, "_CHUNK", chunk)
        out = tmp_path / f"out{chunk}"
        code, _, err = run_cli("export", model, "-e", tmp_path / "run" / "encodings.json", "-o", out,
                               "--format", "gguf", "--gguf-fallback", "f32")
        assert code == 0, err
        files.append(next(out.glob("*.gguf")).read_bytes())
    assert files[0] == files[1]


def test_added_tokens_are_typed_as_llama_cpps_converter_types_them(tmp_path):
    """Special added tokens are CONTROL even where the base vocabulary holds them too (SmolLM2's <|im_start|> ...:
    gguf-py's reader left them NORMAL and llama.cpp warned 'control-looking token ... was not control-type');
    an unmarked one that looks like a control token is CONTROL, any other added token USER_DEFINED."""
    ckpt = _tiny_llama(tmp_path / "m", False)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.add_tokens(["<|fake|>", "qtoolword"])
    tok.save_pretrained(ckpt)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|fake|>", "qtoolword")}
    code, out, err = run_cli("quantize", ckpt, "-c", "gguf-q8_0", "-o", tmp_path / "q", "--format", "gguf")
    assert code == 0, err
    types = gguf.GGUFReader(tmp_path / "q/model.gguf").fields["tokenizer.ggml.token_type"].contents()
    control, user = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
    assert [types[ids[t]] for t in ids] == [control, control, control, user]
    others = [t for i, t in enumerate(types) if i not in ids.values()]
    assert set(others) <= {int(gguf.TokenType.NORMAL), int(gguf.TokenType.UNUSED)}


def test_general_name_does_not_depend_on_how_the_path_is_spelled(llamas, tmp_path):
    """general.name was the path's last part: "link" through a symlink, absent for ".", a Hub snapshot's commit
    hash; the same weights gave other bytes."""
    from qtool.export.gguf_model import model_name

    (tmp_path / "link").symlink_to(llamas["untied"])
    names = set()
    for given in (llamas["untied"], tmp_path / "link"):
        out = tmp_path / f"q{len(names)}-{given.name}"
        code, _, err = run_cli("quantize", given, "-c", "gguf-q8_0", "-o", out, "--format", "gguf", "--quiet")
        assert code == 0, err
        names.add(gguf.GGUFReader(out / "model.gguf").fields["general.name"].contents())
    assert names == {Path(llamas["untied"]).resolve().name}
    snapshot = tmp_path / "hub/models--org--TinyLlama-x/snapshots/0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    assert model_name(snapshot) == "TinyLlama-x"


def test_a_nan_in_a_weight_is_one_line_before_a_k_quant_search(tmp_path):
    """The K-quant mixes search each weight's range: a NaN reached torch's scatter with index -2^63, an internal
    error (exit 3) where the other grids said the checkpoint holds NaN (the writer fuzz found it)."""
    from safetensors.torch import load_file, save_file

    ckpt = _tiny_llama(tmp_path / "m", False)
    weights = load_file(ckpt / "model.safetensors")
    weights["lm_head.weight"][3, 5] = float("nan")
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_cli("quantize", ckpt, "-c", "gguf-q4_k_m", "-f", "gguf", "-o", tmp_path / "q")
    assert code == 2 and not (tmp_path / "q").exists()
    assert error_lines(err)[-1] == ("error: lm_head.weight: the checkpoint's weight holds NaN or infinity, which no "
                                    "grid holds; nothing was written"), err


def test_a_width_no_gguf_block_divides_is_said_as_gguf_types_not_as_a_recipe_key(tmp_path):
    """Hidden 80 under gguf-q4_k_m: no K-quant and no 32-wide fallback divides it. The refusal named
    'defaults.weights.block_size: 32', a key the shipped recipe does not hold."""
    ckpt = _tiny_llama(tmp_path / "m", False, hidden=80)
    code, _, err = run_cli("config", "show", "gguf-q4_k_m", "--model", ckpt)
    assert code == 2 and "block_size" not in err, err
    assert "model.embed_tokens.weight's input dimension 80 is no multiple of GGUF type q5_0's block of 32, and no " \
        "fallback type's block divides it either (llama.cpp writes such a weight F16): leave it float (ignore: " \
        "['model.embed_tokens'])" in err, err
