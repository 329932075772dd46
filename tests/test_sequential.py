"""--sequential: block-by-block calibration of causal LMs gives the encodings of an all-at-once run."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import run_cli

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sequential_equals_all_at_once(tmp_path, tied):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "m", max_shard_size="150KB")
    ids = torch.randint(0, 256, (12, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[3, 10:] = 0  # padding reaches the blocks through the captured attention mask
    save_file({"input_ids": ids, "attention_mask": mask}, tmp_path / "ids.safetensors")
    # everything quantized, inputs and outputs, lm_head included
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  activations: {inputs: true, outputs: true}\n")
    runs = {}
    for seq in (False, True):
        args = ["calibrate", tmp_path / "m", "-c", tmp_path / "r.yaml", "--data", tmp_path / "ids.safetensors",
                "-o", tmp_path / f"run{int(seq)}", "--batch-size", "4"] + (["--sequential"] if seq else [])
        code, _, err = run_cli(*args)
        assert code == 0, err
        runs[seq] = json.loads((tmp_path / f"run{int(seq)}/encodings.json").read_text())["quantizers"]
    assert [q["name"] for q in runs[True]] == [q["name"] for q in runs[False]]
    assert len(runs[True]) == 3 * (3 * 7 + 1) + 2  # 7 Linear per block and lm_head: weight, in, out; embed: w, out
    for a, b in zip(runs[False], runs[True]):
        assert (a["min"], a["max"]) == (b["min"], b["max"]), a["name"]


def test_sequential_needs_a_causal_lm_directory(tmp_path):
    from tests.tinymodels import mlp

    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "-c",
                           Path(__file__).resolve().parents[1] / "configs/w8a16.yaml", "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "r", "--sequential", "--quiet")
    assert code == 2 and "--sequential needs a Hugging Face causal LM directory" in err


def test_sequential_on_an_encoder_decoder_says_so(tmp_path):
    """BART's config also builds a BartForCausalLM (its decoder alone): --sequential said config.json "disagrees
    with the weights" of a checkpoint that calibrates in memory."""
    torch.manual_seed(0)
    transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64)).save_pretrained(tmp_path / "bart")
    save_file({"input_ids": torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "bart", "-c", "w8a16", "--data", tmp_path / "ids.safetensors",
                           "-o", tmp_path / "r", "--sequential", "--quiet")
    assert code == 2 and "is an encoder-decoder (BartForConditionalGeneration): run without --sequential" in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("recipe", ["w8a16.yaml", "w4a16-block32.yaml"])
def test_weight_only_calibration_streams_weights_with_equal_encodings(tmp_path, recipe):
    """A weight-only recipe on an HF directory never builds the model; the encodings equal a full load's."""
    import qtool.pipeline as P
    from qtool.config import load_recipe, resolve_plan
    from qtool.model.insert import insert_quantizers
    from qtool.model.load import load_model
    from qtool.calibration.in_memory import calibrate
    from qtool.encodings import EncodingEntry

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "m")
    configs = Path(__file__).resolve().parents[1] / "configs"
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", configs / recipe, "-o", tmp_path / "run")
    assert code == 0, err
    streamed = json.loads((tmp_path / "run/encodings.json").read_text())["quantizers"]
    loaded = load_model(tmp_path / "m")
    plan = resolve_plan(load_recipe(configs / recipe), loaded.model)
    qs = insert_quantizers(loaded.model, plan)
    calibrate(loaded.model, plan, qs, None, torch.device("cpu"))
    full = [EncodingEntry.from_quantizer(q, qs[q.name]).to_json() for q in plan.quantizers]
    assert [q["name"] for q in streamed] == [q["name"] for q in full]
    for a, b in zip(streamed, full):
        assert (a["min"], a["max"], a["scale"]) == (b["min"], b["max"], b["scale"]), a["name"]


def test_streamed_weight_calibration_writes_large_block_encodings_to_the_sidecar_as_it_goes(tmp_path):
    """int4 blocks of every Linear (32,768 to 73,728 blocks each) go to encodings.safetensors during calibration;
    the file reads back to the encodings of a full load, and the export from it is byte-identical to one from
    the same encodings written inline."""
    from qtool.calibration.in_memory import calibrate
    from qtool.config import load_recipe, resolve_plan
    from qtool.encodings import SIDECAR, EncodingEntry, EncodingsFile
    from qtool.model.insert import insert_quantizers
    from qtool.model.load import load_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=1024, intermediate_size=2304, num_hidden_layers=1,
                                   num_attention_heads=8, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "m")
    recipe = Path(__file__).resolve().parents[1] / "configs" / "w4a16-block32.yaml"
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", recipe, "-o", tmp_path / "run")
    assert code == 0, err
    obj = json.loads((tmp_path / "run/encodings.json").read_text())
    in_sidecar = sorted(q["name"] for q in obj["quantizers"] if "data" in q)
    assert obj["schema_version"] == 2 and in_sidecar == sorted(
        f"model.layers.0.{m}.weight" for m in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                                               "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"))
    assert all(q["granularity"] != "per_block" for q in obj["quantizers"] if "data" not in q)
    streamed = EncodingsFile.read(tmp_path / "run/encodings.json")

    loaded = load_model(tmp_path / "m")
    plan = resolve_plan(load_recipe(recipe), loaded.model)
    qs = insert_quantizers(loaded.model, plan)
    calibrate(loaded.model, plan, qs, None, torch.device("cpu"))
    full = {q.name: EncodingEntry.from_quantizer(q, qs[q.name]) for q in plan.quantizers}
    assert [e.name for e in streamed.entries] == list(full)
    for e in streamed.entries:
        assert torch.equal(e.min, full[e.name].min) and torch.equal(e.max, full[e.name].max), e.name

    (tmp_path / "inline").mkdir()
    streamed.write(tmp_path / "inline/encodings.json", inline_limit=None)
    assert not (tmp_path / "inline" / SIDECAR).exists()
    for src, dst in ((tmp_path / "run", "x1"), (tmp_path / "inline", "x2")):
        code, _, err = run_cli("export", tmp_path / "m", "-e", src / "encodings.json", "-o", tmp_path / dst)
        assert code == 0, err
    assert (tmp_path / "x1/model.safetensors").read_bytes() == (tmp_path / "x2/model.safetensors").read_bytes()


def _live_cpu_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage Python can reach (each storage counted once)."""
    import gc

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":  # type(): no lazy module hooks
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # sparse, fake or functional tensors other tests left
                continue
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


@pytest.mark.parametrize("recipe", ["w4a16-block32-gptq", "w8a8"])
def test_what_sequential_calibration_holds_does_not_grow_with_the_blocks(tmp_path, recipe):
    """After block k only the encodings chosen so far are held (a few % of a block's weights for block-32 scales):
    no finished block's weights, fake-quant copies or GPTQ codes (those go to disk as they are chosen)."""
    from qtool.hooks import Hooks
    from qtool.pipeline import CalibrateOptions, run_calibrate
    from tests.helpers import tiny_llama

    ckpt = tiny_llama(tmp_path / "m", num_hidden_layers=6)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    held = []
    run_calibrate(str(ckpt), recipe, str(tmp_path / "run"),
                  CalibrateOptions(data=str(tmp_path / "ids.safetensors"), sequential=True),
                  hooks=Hooks(on_block=lambda done, total: held.append(_live_cpu_tensor_bytes())))
    block_weights = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # q, o; k, v; gate, up, down in float32
    assert len(held) == 6
    growth = (held[-1] - held[1]) / 4
    assert growth < 0.1 * block_weights, (held, block_weights)
    codes = tmp_path / "run" / "codes.safetensors"
    assert codes.is_file() == (recipe == "w4a16-block32-gptq")


def _w8a8_in_memory_and_sequential(tmp_path):
    """W8A8 calibration of ``tmp_path/m`` on ``tmp_path/ids.safetensors`` in memory and with --sequential:
    ``{sequential: run directory}``."""
    runs = {}
    for seq in (False, True):
        out = runs[seq] = tmp_path / f"run{int(seq)}"
        code, _, err = run_cli("calibrate", tmp_path / "m", "-c", "w8a8", "--data", tmp_path / "ids.safetensors",
                               "-o", out, "--batch-size", "4", "--quiet", *(["--sequential"] if seq else []))
        assert code == 0, err
    return runs


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_sequential_reads_fused_experts_from_per_expert_checkpoint_keys(tmp_path, family):
    """qtool makes one Linear per expert from the checkpoint's per-expert tensors (Mixtral's under block_sparse_moe,
    which transformers renames mlp); --sequential reads each block's experts from those keys and writes the
    in-memory bytes, every expert quantized."""
    torch.manual_seed(0)
    extra = {"moe_intermediate_size": 32, "num_experts": 4, "head_dim": 16} if family == "qwen3_moe" else \
        {"num_local_experts": 4}
    cfg = transformers.AutoConfig.for_model(family, vocab_size=256, hidden_size=64, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_experts_per_tok=2, **extra)
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(tmp_path / "m")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m/model.safetensors"), "pt") as f:
        assert not any(k.endswith("experts.gate_up_proj") for k in f.keys())  # per-expert keys on disk
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    files = {}
    for seq, out in _w8a8_in_memory_and_sequential(tmp_path).items():
        files[seq] = (out / "encodings.json").read_bytes()
        warnings = json.loads((out / "manifest.json").read_text())["warnings"]
        assert not any("have no quantizer" in w for w in warnings)
        names = {e["name"] for e in json.loads(files[seq])["quantizers"]}
        assert sum(".experts." in n and n.endswith(".weight") for n in names) == 2 * 4 * 3  # every expert's weights
    assert files[True] == files[False]


@pytest.mark.parametrize("family", ["gemma3_text", "phi3"])
def test_sequential_gives_each_block_the_inputs_the_model_gives_it(tmp_path, family):
    """Gemma 3 passes its sliding-window layers other rotary embeddings (base 10000) and another attention mask
    than its sixth, global layer: --sequential gives every block the keywords the model passes that block, not
    the first block's, and writes the in-memory encodings (w8a8: every activation range depends on it)."""
    torch.manual_seed(0)
    extra = {"gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=6),
             "phi3": dict(pad_token_id=0, num_hidden_layers=2)}[family]
    cfg = transformers.AutoConfig.for_model(family, vocab_size=256, hidden_size=64, intermediate_size=64,
                                            num_attention_heads=4, num_key_value_heads=2, **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(tmp_path / "m")
    ids = torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    files = {seq: json.loads((out / "encodings.json").read_text())["quantizers"]
             for seq, out in _w8a8_in_memory_and_sequential(tmp_path).items()}
    assert files[True] == files[False]
