"""Multimodal language models (Gemma 3 4B/12B/27B's ``Gemma3ForConditionalGeneration``): the text model is
quantized like any causal LM in every format and mode, its checkpoint's names (``language_model.model.*``) kept;
the image encoder and projector stay float unless a recipe names them; GGUF holds the text model, as llama.cpp's
converter writes it (the image encoder goes to a separate mmproj file)."""

import json
from statistics import median

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qtool.config import load_recipe, parse_recipe, recipe_file, resolve_plan
from tests.helpers import run_cli

transformers = pytest.importorskip("transformers")


def _saved_multimodal(dest, config_class, model_class, text, vision, **extra):
    """A seeded tiny ``model_class`` (text settings ``text`` over test_gguf's vocabulary, a small image encoder
    ``vision``) saved by transformers in ``dest`` with test_gguf's byte-level BPE tokenizer."""
    from tests.test_gguf import VOCAB, _tiny_llama

    _tiny_llama(dest, False)
    for f in dest.glob("model*.safetensors"):
        f.unlink()
    vision = dict(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       image_size=28, patch_size=14), **vision)
    torch.manual_seed(0)
    model = model_class(config_class(text_config=dict(vocab_size=VOCAB + 20, hidden_size=64, num_attention_heads=4,
                                                      num_key_value_heads=2, head_dim=16, **text),
                                     vision_config=vision, **extra)).eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A seeded tiny Gemma 3 with a SigLIP image encoder, saved by transformers (the checkpoint names its text
    model language_model.model.*), test_gguf's byte-level BPE tokenizer, and 8 x 32 token ids."""
    from tests.test_gguf import VOCAB

    d = tmp_path_factory.mktemp("gemma3")
    _saved_multimodal(d / "m", transformers.Gemma3Config, transformers.Gemma3ForConditionalGeneration,
                      dict(num_hidden_layers=6, intermediate_size=128, query_pre_attn_scalar=16, sliding_window=12,
                           max_position_embeddings=256, initializer_range=0.1), {},
                      mm_tokens_per_image=4, image_token_index=VOCAB + 5, boi_token_index=VOCAB + 6,
                      eoi_token_index=VOCAB + 7)
    ids = torch.randint(1, VOCAB, (8, 32), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, d / "ids.safetensors")
    return d / "m", d / "ids.safetensors"


def test_the_image_encoder_stays_float_unless_a_rule_names_it(gemma3):
    checkpoint, _ = gemma3
    code, out, err = run_cli("config", "show", "w4a16-block32", "--model", checkpoint, "--json")
    assert code == 0, err  # (the encoder's 3-channel patch convolution has no block of 32 to quantize)
    shown = json.loads(out)
    names = {q["name"] for q in shown["quantizers"]}
    assert "language_model.model.layers.5.mlp.down_proj.weight" in names  # named as the checkpoint names it
    assert not [n for n in names if "vision" in n or "projector" in n]
    [note] = [w for w in shown["warnings"] if "media encoders" in w]
    assert "model.vision_tower" in note
    assert shown["weights_quantized"]["unreachable"] == []
    recipe = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\nignore: [lm_head]\n"
                          "layers:\n  - match: 're:.*vision_tower.*mlp.*'\n    weights: {bitwidth: 4}\n")
    from qtool.model.hf import meta_skeleton

    plan = resolve_plan(recipe, meta_skeleton(checkpoint))
    assert {q.module for q in plan.weights if "vision" in q.module} == {
        f"model.vision_tower.{part}.mlp.{fc}" for part in ("encoder.layers.0", "head") for fc in ("fc1", "fc2")}


def test_a_vision_models_own_towers_are_quantized():
    """CLIP has no output layer: its vision_model is half of what the user quantizes, not a media encoder."""
    cfg = transformers.CLIPConfig(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                   num_attention_heads=2, vocab_size=100),
                                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=28, patch_size=14))
    plan = resolve_plan(load_recipe(recipe_file("w8a16")), transformers.CLIPModel(cfg))
    assert any(q.module.startswith("vision_model.") for q in plan.weights)
    assert not [w for w in plan.warnings if "media encoders" in w]


def test_idefics3s_connector_stays_float_as_a_projector():
    """Idefics3's (and SmolVLM's) projector is model.connector: it was quantized by default, unlike every other
    family's projector, and with activations its input never ran on text ("saw no data")."""
    cfg = transformers.Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), image_token_id=120, scale_factor=2)
    with torch.device("meta"):
        model = transformers.Idefics3ForConditionalGeneration(cfg)
    plan = resolve_plan(load_recipe(recipe_file("w8a8")), model)
    assert not [q.module for q in plan.quantizers if "connector" in q.module or "vision" in q.module]
    assert any(q.module.startswith("model.text_model.") for q in plan.weights)
    [note] = [w for w in plan.warnings if "media encoders" in w]
    assert "model.connector" in note, note



def test_sequential_on_a_multimodal_model_automodel_cannot_build_says_so(tmp_path):
    """Idefics3 --sequential read "not a causal language model transformers can build", of a model calibrate runs
    as one in memory."""
    cfg = transformers.Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), image_token_id=120, scale_factor=2)
    transformers.Idefics3ForConditionalGeneration(cfg).save_pretrained(tmp_path / "m")
    save_file({"input_ids": torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", "w8a16", "--sequential", "--data",
                           tmp_path / "ids.safetensors", "-o", tmp_path / "c")
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        "--sequential builds a multimodal model's text decoder through transformers' AutoModelForCausalLM, which has "
        "no class for this one (Idefics3ForConditionalGeneration): run without --sequential"), err


def test_sequential_writes_the_in_memory_bytes_and_the_exports_run_where_they_are_served(gemma3, tmp_path):
    from tests.test_experts import _quantized_in_memory_as_sequential

    checkpoint, ids = gemma3
    exported = _quantized_in_memory_as_sequential(tmp_path, checkpoint, ids)
    assert "language_model.model.layers.5.mlp.up_proj.weight" in exported
    code, _, err = run_cli("quantize", checkpoint, "-c", "w4a16-block32-gptq", "--data", ids, "-o", tmp_path / "ct",
                           "--format", "compressed-tensors", "--quiet")
    assert code == 0, err
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "language_model.model.layers.2.self_attn.q_proj.weight_packed" in keys
    assert not [k for k in keys if "vision_tower" in k and k.endswith("weight_packed")]
    # transformers reloads it (Gemma 3 with its image encoder) with qtool's weights
    code, out, err = run_cli("eval", tmp_path / "ct", "--data", ids, "--seq-len", 32, "--num-samples", 4,
                             "--generate", 0, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["causal_lm"] and result["export_gap"]["kl_mean"] < 1e-6


def test_gguf_holds_the_text_model_and_llama_cpp_runs_it(gemma3, tmp_path):
    pytest.importorskip("xllamacpp")
    gguf = pytest.importorskip("gguf")
    from tests.test_gguf_families import _agreement

    checkpoint, _ = gemma3
    code, _, err = run_cli("quantize", checkpoint, "-c", "gguf-q8_0", "-o", tmp_path / "q", "--format", "gguf",
                           "--quiet")
    assert code == 0, err
    reader = gguf.GGUFReader(tmp_path / "q" / "model.gguf")
    assert reader.fields["general.architecture"].contents() == "gemma3"
    assert reader.fields["gemma3.block_count"].contents() == 6
    assert reader.fields["gemma3.attention.sliding_window"].contents() == 12
    names = {t.name for t in reader.tensors}
    assert "blk.5.ffn_down.weight" in names and not [n for n in names if "v." in n[:2] or "mm" in n]
    agree, diffs = _agreement(checkpoint, tmp_path / "q")
    assert agree >= 34 and median(diffs) < 0.03, (agree, sorted(diffs))
    # a rule that opts the image encoder in: calibrated, not in the file, and said (it was dropped without a word)
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  weights: {gguf_type: q8_0}\n  activations: null\n"
                                     "layers:\n  - match: 're:.*vision_tower.*mlp.*'\n    weights: {gguf_type: q8_0}\n")
    code, out, err = run_cli("quantize", checkpoint, "-c", tmp_path / "r.yaml", "-o", tmp_path / "t", "--format",
                             "gguf", "--json")
    assert code == 0, err
    said = [w for w in json.loads(out)["export_warnings"] if "not in the GGUF file" in w]
    assert len(said) == 1 and said[0].startswith("4 quantized weight(s)") and "vision_tower" in said[0], said
    # ... and one on a grid GGUF has no type for is not refused over tensors the file leaves out
    (tmp_path / "r8.yaml").write_text("version: 1\ndefaults:\n  weights: {gguf_type: q8_0}\n  activations: null\n"
                                      "layers:\n  - match: 're:.*vision_tower.*mlp.*'\n    weights: {bitwidth: 8, "
                                      "granularity: per_channel}\n")
    code, out, err = run_cli("quantize", checkpoint, "-c", tmp_path / "r8.yaml", "-o", tmp_path / "t8", "--format",
                             "gguf", "--json")
    assert code == 0, err
    warned = json.loads(out)["export_warnings"]
    assert any(w.startswith("4 quantized weight(s) are not in the GGUF file") for w in warned), warned
    assert not any("stored as floats" in w or "no GGUF type" in w for w in warned), warned


def test_llama4_with_its_image_encoder_quantizes_its_experts_and_ignores_its_output_layer_by_name(tmp_path):
    """Llama 4's wrapper holds the text model as language_model (its output layer language_model.lm_head, which the
    recipes' ignore: [lm_head] names as it names any model's); --sequential runs the text model alone and writes the
    in-memory bytes."""
    from tests.test_experts import _quantized_in_memory_as_sequential
    from tests.test_gguf import VOCAB

    _saved_multimodal(tmp_path / "m", transformers.Llama4Config, transformers.Llama4ForConditionalGeneration,
                      dict(num_hidden_layers=2, intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
                           num_experts_per_tok=1, interleave_moe_layer_step=1),
                      dict(vision_output_dim=32, projector_input_dim=32, projector_output_dim=32))
    ids = tmp_path / "ids.safetensors"
    save_file({"input_ids": torch.randint(1, VOCAB, (8, 32), generator=torch.Generator().manual_seed(0))}, ids)
    exported = _quantized_in_memory_as_sequential(tmp_path, tmp_path / "m", ids)
    with safe_open(str(tmp_path / "memory" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "language_model.model.layers.1.feed_forward.experts.3.down_proj.weight_scale" in keys
    assert "language_model.lm_head.weight_scale" not in keys and "language_model.lm_head.weight" in exported
    assert not [k for k in keys if k.startswith(("vision_model.", "multi_modal_projector.")) and "scale" in k]


def test_a_llava_compressed_tensors_directory_is_evaluated_in_transformers(tmp_path):
    """AutoModelForCausalLM builds no LLaVA (nor Qwen2-VL, Idefics3): eval said "transformers cannot load it" of a
    directory transformers loads by its architectures class."""
    from tests.test_gguf import VOCAB

    m = _saved_multimodal(tmp_path / "m", transformers.LlavaConfig, transformers.LlavaForConditionalGeneration,
                          dict(model_type="llama", num_hidden_layers=2, intermediate_size=128),
                          dict(model_type="clip_vision_model", projection_dim=32), image_token_index=VOCAB + 5)
    ids = tmp_path / "ids.safetensors"
    save_file({"input_ids": torch.randint(1, VOCAB, (8, 32), generator=torch.Generator().manual_seed(0))}, ids)
    code, _, err = run_cli("quantize", m, "-c", "w8a8-dynamic", "-o", tmp_path / "ct", "--format",
                           "compressed-tensors", "-q")
    assert code == 0, err
    code, out, err = run_cli("eval", tmp_path / "ct", "--data", ids, "--seq-len", 32, "--num-samples", 4,
                             "--generate", 0, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["runtime"] == "transformers + compressed-tensors" and result["export_gap"]["kl_mean"] < 1e-6


def test_a_tied_output_layer_over_the_quantized_table_is_warned_of_under_the_checkpoints_names(gemma3, tmp_path):
    """The warning compared the loaded model's names (model.language_model.embed_tokens.weight) with the encodings'
    (the checkpoint's language_model.model.embed_tokens.weight): a multimodal model never got it."""
    checkpoint, _ = gemma3
    code, out, err = run_cli("quantize", checkpoint, "-c", "w8a16", "-o", tmp_path / "q", "--json")
    assert code == 0, err
    said = [w for w in json.loads(out)["export_warnings"] if "shares its weight" in w]
    assert len(said) == 1 and said[0].startswith("lm_head is left float but shares its weight with "
                                                 "language_model.model.embed_tokens.weight, which this file stores "
                                                 "quantized (once)"), said


def test_onnx_names_the_quantizers_its_text_trace_leaves_out(gemma3, tmp_path):
    """A rule that opts the image encoder in, exported to ONNX (traced on text): the graph has no image encoder,
    and export said nothing while model.encodings listed its weights under names no graph tensor has."""
    checkpoint, ids = gemma3
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  activations: null\nignore: [lm_head]\n"
                                     "layers:\n  - match: 're:.*vision_tower.*mlp.*'\n")
    code, out, err = run_cli("quantize", checkpoint, "-c", tmp_path / "r.yaml", "-o", tmp_path / "q", "--format",
                             "onnx", "--data", ids, "--json")
    assert code == 0, err
    summary = json.loads(out)
    said = [w for w in summary["export_warnings"] if "not in the ONNX graph" in w]
    assert len(said) == 1 and said[0].startswith("4 quantizer(s) are not in the ONNX graph") and "vision_tower" in \
        said[0], summary["export_warnings"]
    import onnx

    graph = {i.name for i in onnx.load(str(tmp_path / "q/model.onnx")).graph.initializer}
    listed = [p["name"] for p in json.loads((tmp_path / "q/model.encodings").read_text())["param_encodings"]]
    assert listed and all(n in graph for n in listed) and not any("vision_tower" in n for n in listed)


def test_a_quantized_tied_output_layer_is_refused_under_the_checkpoints_name(gemma3, tmp_path):
    """The refusal named the loaded model's model.language_model.embed_tokens.weight, a name the checkpoint lacks."""
    checkpoint, _ = gemma3
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  activations: null\nlayers:\n  - match: lm_head\n"
                                     "    weights: {bitwidth: 4}\n")
    code, _, err = run_cli("quantize", checkpoint, "-c", tmp_path / "r.yaml", "-o", tmp_path / "q")
    assert code == 2 and "lm_head.weight is the tensor language_model.model.embed_tokens.weight (tied embeddings)" \
        in err, err
