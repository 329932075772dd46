"""The bad-input corpus (tests/bad_inputs/cases.yaml): exit code, one clear line, nothing written."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from tests.helpers import run_cli
from tests.tinymodels import convnet, mlp

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "bad_inputs"
CONFIGS = HERE.parent / "configs"
CASES = yaml.safe_load((CORPUS / "cases.yaml").read_text())


def _save(d: Path, name: str, tensors) -> Path:
    save_file(tensors, d / name)
    return d / name


SETUPS = {
    "truncated_checkpoint": lambda d, ckpt: (d / "t.safetensors").write_bytes(ckpt.read_bytes()[:-64]) and d / "t.safetensors",
    "garbage_checkpoint": lambda d, ckpt: (d / "g.safetensors").write_bytes(b"\xff" * 64) and d / "g.safetensors",
    "checkpoint_missing_tensor": lambda d, ckpt: _save(d, "m.safetensors", {k: v for k, v in mlp().state_dict().items() if k != "4.bias"}),
    "checkpoint_wrong_shape": lambda d, ckpt: _save(d, "s.safetensors", {**mlp().state_dict(), "2.weight": torch.zeros(64, 100)}),
    "pickled_module": lambda d, ckpt: torch.save(mlp(), d / "whole.pt") or d / "whole.pt",
    "onnx_file": lambda d, ckpt: (d / "m.onnx").write_bytes(b"onnx") and d / "m.onnx",
    "empty_dir": lambda d, ckpt: (d / "empty").mkdir() or d / "empty",
    "nan_data": lambda d, ckpt: _save(d, "nan.safetensors", {"x": torch.tensor([[float("nan")] * 3 + [0.0] * 61])}),
    "inf_data": lambda d, ckpt: np.save(d / "inf.npy", np.full((2, 64), np.inf, dtype=np.float32)) or d / "inf.npy",
    "wrong_shape_data": lambda d, ckpt: np.save(d / "w.npy", np.zeros((4, 65), dtype=np.float32)) or d / "w.npy",
    "complex_data": lambda d, ckpt: np.save(d / "c.npy", np.zeros((4, 64), dtype=np.complex64)) or d / "c.npy",
    "zero_sample_data": lambda d, ckpt: np.save(d / "z.npy", np.zeros((0, 64), dtype=np.float32)) or d / "z.npy",
    "jsonl_without_text": lambda d, ckpt: (d / "t.jsonl").write_text('{"body": "x"}\n') and d / "t.jsonl",
    "text_file": lambda d, ckpt: (d / "t.txt").write_text("some text\n") and d / "t.txt",
    "broken_symlink": lambda d, ckpt: os.symlink(d / "gone.npy", d / "link.npy") or d / "link.npy",
    "plain_file": lambda d, ckpt: (d / "file.txt").write_text("not json {") and d / "file.txt",
    "existing_dir": lambda d, ckpt: (d / "exists").mkdir() or (d / "exists" / "keep.txt").write_text("mine") and d / "exists",
    "conv_checkpoint": lambda d, ckpt: _save(d, "conv.safetensors", convnet().state_dict()),
    "unknown_dtype_checkpoint": lambda d, ckpt: _edit_header(d, ckpt, lambda h, k: h[k].update(dtype="Q7")),
    "overlapping_checkpoint": lambda d, ckpt: _edit_header(
        d, ckpt, lambda h, k: h[k].update(data_offsets=[0, h[k]["data_offsets"][1] - h[k]["data_offsets"][0]])),
    "short_offsets_checkpoint": lambda d, ckpt: _edit_header(
        d, ckpt, lambda h, k: h[k].update(data_offsets=[h[k]["data_offsets"][0], h[k]["data_offsets"][1] - 4])),
    "negative_shape_checkpoint": lambda d, ckpt: _edit_header(d, ckpt, lambda h, k: h[k].update(shape=[-1, 64])),
    "hf_config_list": lambda d, ckpt: _hf_dir(d, "[1, 2]"),
    "hf_config_deep": lambda d, ckpt: _hf_dir(d, "[" * 100000 + "]" * 100000),
    "hf_weight_map_list": lambda d, ckpt: _hf_dir(d, None, index='{"weight_map": [1, 2]}'),
    "hf_weight_map_empty": lambda d, ckpt: _hf_dir(d, None, index='{"weight_map": {}}'),
    "hf_weight_map_escapes": lambda d, ckpt: _hf_dir(d, None, index='{"weight_map": {"a": "../../etc/x.safetensors"}}'),
    "encodings_deep": lambda d, ckpt: (d / "deep.json").write_text("[" * 100000 + "]" * 100000) and d / "deep.json",
    "data_65_channels": lambda d, ckpt: _save(d, "x65.safetensors", {"x": torch.randn(4, 65)}),
    "malformed_base_recipe": lambda d, ckpt: (d / "base.yaml").write_text("version: 1\ndefaults: [1, 2]\n") and d / "base.yaml",
    "good_base_recipe": lambda d, ckpt: (d / "base.yaml").write_text((CONFIGS / "w8a8.yaml").read_text()) and d / "base.yaml",
    "nan_weight_checkpoint": lambda d, ckpt: _save(d, "w.safetensors", _poisoned("2.weight", float("nan"))),
    "inf_weight_checkpoint": lambda d, ckpt: _save(d, "w.safetensors", _poisoned("0.weight", float("-inf"))),
    "huge_weight_checkpoint": lambda d, ckpt: _save(d, "w.safetensors", _poisoned("0.weight", 3.0e38, -3.0e38)),
    "int_weight_checkpoint": lambda d, ckpt: _save(d, "w.safetensors", {
        **mlp().state_dict(), "2.weight": torch.ones(64, 128, dtype=torch.int32)}),
    "pt_with_strings": lambda d, ckpt: torch.save({**mlp().state_dict(), "note": "hello"}, d / "sd.pt") or d / "sd.pt",
    "hf_config_garbage": lambda d, ckpt: _hf_dir(d, "model_type = llama"),
    "hf_config_unknown_type": lambda d, ckpt: _hf_dir(d, '{"model_type": "no-such-architecture"}'),
    "hf_config_remote_code": lambda d, ckpt: _hf_dir(
        d, '{"model_type": "custom_thing", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig", '
           '"AutoModel": "modeling_custom.CustomModel"}}'),
    "hf_config_architectures_a_string": lambda d, ckpt: _hf_dir(
        d, '{"model_type": "llama", "architectures": "LlamaForCausalLM"}'),
    "hf_config_dangling_link": lambda d, ckpt: (_hf_dir(d, None) / "config.json").unlink() or (
        d / "hf" / "config.json").symlink_to(d / "gone.json") or d / "hf",
    "hf_config_string_sizes": lambda d, ckpt: _hf_dir(
        d, '{"model_type": "llama", "hidden_size": "sixty-four", "num_hidden_layers": 2, "vocab_size": 256}'),
    "hf_index_missing_shard": lambda d, ckpt: _hf_dir(
        d, None, index='{"weight_map": {"0.weight": "model-00002-of-00002.safetensors"}}'),
    "huge_data": lambda d, ckpt: _save(d, "huge.safetensors", {"x": torch.full((4, 64), 3.0e38)}),
    "int_data": lambda d, ckpt: _save(d, "ints.safetensors", {"x": torch.ones(4, 64, dtype=torch.int64)}),
    "object_npy": lambda d, ckpt: np.save(d / "o.npy", np.array([{"a": 1}, None], dtype=object)) or d / "o.npy",
    "truncated_data": lambda d, ckpt: _save(d, "x.safetensors", {"x": torch.randn(4, 64)}).write_bytes(
        (d / "x.safetensors").read_bytes()[:-100]) and d / "x.safetensors",
    "ragged_data": lambda d, ckpt: _save(d, "r.safetensors", {"x": torch.randn(4, 64), "y": torch.randn(3, 64)}),
    "pt_dict_with_a_string": lambda d, ckpt: torch.save({"x": torch.randn(4, 64), "name": "run 3"}, d / "s.pt")
    or d / "s.pt",
    "dangling_link_in_data_dir": lambda d, ckpt: (d / "data").mkdir() or _save(d / "data", "a.safetensors", {
        "x": torch.randn(16, 64)}) and (d / "data" / "b.safetensors").symlink_to(d / "gone.safetensors") or d / "data",
    "scaled_checkpoint": lambda d, ckpt: _scaled_checkpoint(d),
    "latin1_json": lambda d, ckpt: (d / "l.json").write_bytes('{"schema": "caf\u00e9"}'.encode("latin-1")) and d / "l.json",
}


def _scaled_checkpoint(d: Path) -> Path:
    """The MLP with every weight 1.7 times larger: the same shapes, other weights than the encodings were made on."""
    return _save(d, "scaled.safetensors", {k: v * 1.7 for k, v in mlp().state_dict().items()})


def _llama_copy(d: Path, llama: Path, weights=None, config=None, drop=()) -> Path:
    """A copy of the tiny Llama (and its token ids, as ``{dir}/ids.safetensors``) inside the case's directory, so
    that the snapshot covers it; ``weights(sd)`` edits its tensors in place, ``config(cfg)`` its config.json."""
    import shutil

    from safetensors.torch import load_file

    m = d / "m"
    shutil.copytree(llama["dir"], m)
    shutil.copy(llama["ids"], d / "ids.safetensors")
    if weights is not None or drop:
        sd = load_file(m / "model.safetensors")
        for k in drop:
            sd.pop(k)
        if weights is not None:
            weights(sd)
        save_file(sd, m / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((m / "config.json").read_text())
        config(cfg)
        (m / "config.json").write_text(json.dumps(cfg))
    return m


def _set_value(key: str, value: float, whole_row: bool = False):
    def edit(sd):
        if whole_row:
            sd[key][0] = value
        else:
            sd[key].view(-1)[0] = value
    return edit


def _imatrix_with_count(d: Path, count: float) -> Path:
    """A GGUF importance matrix whose one entry has the given token count."""
    import gguf

    path = d / "counts.imatrix.gguf"
    w = gguf.GGUFWriter(str(path), arch="imatrix")
    w.add_type(gguf.GGUFType.IMATRIX)
    w.add_tensor("blk.0.attn_q.weight.in_sum2", np.ones((1, 64), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight.counts", np.array([[count]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_DOWN0 = "model.layers.0.mlp.down_proj.weight"
SETUPS_WITH_LLAMA = {  # (case directory, the tiny Llama world) -> the path {made} stands for
    "llama_copy": lambda d, ll: _llama_copy(d, ll),
    "llama_huge_down_proj": lambda d, ll: _llama_copy(d, ll, _set_value(_DOWN0, 1e38, whole_row=True)),
    "llama_nan_o_proj": lambda d, ll: _llama_copy(d, ll, _set_value("model.layers.0.self_attn.o_proj.weight",
                                                                    float("nan"))),
    "llama_tied_nan_embedding": lambda d, ll: _llama_copy(
        d, ll, _set_value("model.embed_tokens.weight", float("nan")), lambda c: c.update(tie_word_embeddings=True),
        drop=("lm_head.weight",)),
    "llama_nan_norm": lambda d, ll: _llama_copy(d, ll, _set_value("model.layers.0.input_layernorm.weight",
                                                                  float("nan"))),
    "llama_nan_embedding": lambda d, ll: _llama_copy(d, ll, _set_value("model.embed_tokens.weight", float("nan"),
                                                                       whole_row=True)),
    "llama_config_ties_distinct_tensors": lambda d, ll: _llama_copy(
        d, ll, config=lambda c: c.update(tie_word_embeddings=True)),
    "llama_config_a_billion_layers": lambda d, ll: _llama_copy(d, ll, config=lambda c: c.update(
        num_hidden_layers=10**9)),
    "llama_without_its_final_norm": lambda d, ll: _llama_copy(d, ll, drop=("model.norm.weight",)),
    "llama_config_infinite_eps": lambda d, ll: _llama_copy(d, ll, config=lambda c: c.update(rms_norm_eps=float("inf"))),
    "llama_config_nan_rope": lambda d, ll: _llama_copy(d, ll, config=lambda c: c.update(
        rope_parameters={**(c.get("rope_parameters") or {"rope_type": "default"}), "rope_theta": float("nan")})),
    "llama_config_no_layers": lambda d, ll: _llama_copy(d, ll, config=lambda c: c.update(num_hidden_layers=0)),
    "llama_config_hidden_size": lambda d, ll: _llama_copy(d, ll, config=lambda c: c.update(hidden_size=128)),
    "llama_config_head_dim": lambda d, ll: _llama_copy(d, ll, config=lambda c: c.update(head_dim=32)),
    "llama_config_vocab_size": lambda d, ll: _llama_copy(d, ll, config=lambda c: c.update(vocab_size=300)),
    "llama_config_fewer_layers": lambda d, ll: _llama_copy(d, ll, config=lambda c: c.update(num_hidden_layers=1)),
    "llama_config_more_layers": lambda d, ll: _llama_copy(d, ll, config=lambda c: c.update(num_hidden_layers=3)),
    "imatrix_count_nan": lambda d, ll: _imatrix_with_count(d, float("nan")),
    "imatrix_count_zero": lambda d, ll: _imatrix_with_count(d, 0.0),
    "imatrix_count_negative": lambda d, ll: _imatrix_with_count(d, -4.0),
}


def _poisoned(name: str, value: float, second: float = None):
    """The MLP's state dict with ``name``'s first element (and last, with ``second``) set."""
    sd = mlp().state_dict()
    w = sd[name].clone()
    w.view(-1)[0] = value
    if second is not None:
        w.view(-1)[-1] = second
    return {**sd, name: w}


def _edit_header(d: Path, ckpt: Path, change) -> Path:
    """``ckpt`` with one tensor entry of its safetensors header changed (the data section kept as it is)."""
    import struct

    raw = ckpt.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    key = sorted(k for k in header if k != "__metadata__")[1]  # a tensor that does not start the data section
    change(header, key)
    text = json.dumps(header).encode()
    (d / "edited.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return d / "edited.safetensors"


def _hf_dir(d: Path, config, index=None) -> Path:
    """A Hugging Face-style directory (a tiny MLP's weights) with the given config.json text and index (then the
    weights are a shard of it: a model.safetensors beside an index is what transformers, and qtool, read)."""
    hf = d / "hf"
    hf.mkdir()
    _save(hf, "model.safetensors" if index is None else "model-00001-of-00002.safetensors", mlp().state_dict())
    (hf / "config.json").write_text(config if config is not None else '{"model_type": "llama"}')
    if index is not None:
        (hf / "model.safetensors.index.json").write_text(index)
    return hf


def _encodings_variant(d: Path, enc: Path, mutate) -> Path:
    obj = json.loads(enc.read_text())
    mutate(obj)
    path = d / "variant.json"
    path.write_text(json.dumps(obj))
    return path


def _aimet_short_offsets(d: Path, enc: Path) -> Path:
    """An AIMET 1.0.0 file of ``enc`` (written by qtool) whose first weight has fewer offsets than scales."""
    code, _, err = run_cli("export", enc.parent.parent / "mlp.safetensors", "-e", enc, "--model-class",
                           "tests.tinymodels:mlp", "-o", d / "aimet_src", "--format", "aimet", "--quiet")
    assert code == 0, err
    obj = json.loads((d / "aimet_src" / "model.encodings").read_text())
    obj["param_encodings"][0]["offset"] = obj["param_encodings"][0]["offset"][:5]
    import shutil

    shutil.rmtree(d / "aimet_src")
    (d / "short.encodings").write_text(json.dumps(obj))
    return d / "short.encodings"


SETUPS_WITH_ENC = {
    "aimet_short_offsets": _aimet_short_offsets,
    "encodings_v99": lambda d, enc: _encodings_variant(d, enc, lambda o: o.update(schema_version=99)),
    "encodings_missing_field": lambda d, enc: _encodings_variant(d, enc, lambda o: o["quantizers"][0].pop("max")),
    "encodings_wrong_shape": lambda d, enc: _encodings_variant(d, enc, lambda o: [o["quantizers"][0].update(
        shape=[64, 1], min=[[-1.0]] * 64, max=[[1.0]] * 64), o["quantizers"][0].pop("scale"),
        o["quantizers"][0].pop("offset")]),
}


def _set(obj, path: str, value) -> None:
    """``obj`` with the item at ``path`` ('quantizers/0/symmetric'; '-' deletes it) set to ``value``."""
    *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
    for p in parents:
        obj = obj[p]
    if value == "-":
        del obj[last]
    else:
        obj[last] = value


def _edited(d: Path, world, edit) -> Path:
    """A copy of one of the world's files (``of``: enc, aimet, header = the checkpoint's safetensors header, with
    ``$t`` standing for its second tensor) with ``set`` items changed and then ``replace`` [old, new] applied to
    the text; written as ``as`` (default: edited + the source's suffix)."""
    import struct

    source = {"enc": world["enc"], "aimet": world["aimet"], "header": world["ckpt"]}[edit["of"]]
    raw = source.read_bytes()
    if edit["of"] == "header":
        (n,) = struct.unpack("<Q", raw[:8])
        text, tail = raw[8:8 + n].decode(), raw[8 + n:]
        tensor = sorted(k for k in json.loads(text) if k != "__metadata__")[1]
    else:
        text, tail, tensor = raw.decode(), b"", None
    if edit.get("set"):
        obj = json.loads(text)
        for path, value in edit["set"].items():
            _set(obj, path.replace("$t", str(tensor)), value)
        text = json.dumps(obj)
    if edit.get("replace"):
        old, new = edit["replace"]
        assert old in text, (old, text[:200])
        text = text.replace(old, new, 1)
    target = d / edit.get("as", "edited" + source.suffix)
    body = text.encode()
    target.write_bytes((struct.pack("<Q", len(body)) + body + tail) if edit["of"] == "header" else body)
    return target


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("world")
    ckpt = _save(d, "mlp.safetensors", mlp().state_dict())
    data = _save(d, "data.safetensors", {"x": torch.randn(16, 64, generator=torch.Generator().manual_seed(0))})
    code, _, err = run_cli("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "--model-class", "tests.tinymodels:mlp",
                           "-o", d / "run")
    assert code == 0, err
    code, _, err = run_cli("export", ckpt, "-e", d / "run" / "encodings.json", "--model-class",
                           "tests.tinymodels:mlp", "-o", d / "aimet", "--format", "aimet", "--quiet")
    assert code == 0, err
    return {"ckpt": ckpt, "data": data, "enc": d / "run" / "encodings.json", "aimet": d / "aimet" / "model.encodings"}


@pytest.fixture(scope="module")
def llama_world(tmp_path_factory):
    """A tiny Llama with a byte-level BPE tokenizer (GGUF exports it) and token ids for it; built on first use."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from tests.test_gguf import _tiny_llama

    d = tmp_path_factory.mktemp("llama_world")
    ids = torch.randint(1, 250, (8, 24), generator=torch.Generator().manual_seed(2))
    save_file({"input_ids": ids}, d / "ids.safetensors")
    return {"dir": _tiny_llama(d / "llama", False), "ids": d / "ids.safetensors"}


def test_corpus_is_large_enough():
    assert len(CASES) >= 150
    commands = {case["args"][0] for case in CASES.values()}
    assert commands >= {"calibrate", "export", "quantize", "report", "inspect", "import-encodings", "config"}
    for name, case in CASES.items():
        assert set(case) <= {"setup", "files", "edit", "args", "exit", "message", "out_is_made"}, name
        assert case.get("setup") is None or case["setup"] in SETUPS or case["setup"] in SETUPS_WITH_ENC or \
            case["setup"] in SETUPS_WITH_LLAMA, name


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, world, tmp_path, request):
    case = CASES[name]
    made = None
    llama = {}
    if case.get("setup") in SETUPS_WITH_LLAMA or any("{llama" in str(a) for a in case["args"]):
        llama = request.getfixturevalue("llama_world")
    if case.get("setup") in SETUPS_WITH_LLAMA:
        made = SETUPS_WITH_LLAMA[case["setup"]](tmp_path, llama)
    elif case.get("setup") in SETUPS:
        made = SETUPS[case["setup"]](tmp_path, world["ckpt"])
    elif case.get("setup") in SETUPS_WITH_ENC:
        made = SETUPS_WITH_ENC[case["setup"]](tmp_path, world["enc"])
    for name_, text in (case.get("files") or {}).items():
        (tmp_path / name_).write_text(text)
    if case.get("edit"):
        made = _edited(tmp_path, world, case["edit"])
    out = made if case.get("out_is_made") else tmp_path / "out"
    subs = {"ckpt": world["ckpt"], "data": world["data"], "enc": world["enc"], "aimet": world["aimet"],
            "mlp": "tests.tinymodels:mlp", "llama": llama.get("dir"),
            "recipes": CORPUS / "recipes", "configs": CONFIGS, "made": made, "out": out, "dir": tmp_path}
    args = [str(a).format(**subs) for a in case["args"]]
    before = sorted(p.name for p in tmp_path.iterdir())
    snapshot = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    code, stdout, stderr = run_cli(*args, "--quiet") if args[0] in ("calibrate", "export", "quantize") else run_cli(*args)
    assert code == case.get("exit", 2), stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), lines[0]
    assert case["message"] in lines[0], lines[0]
    assert "Traceback" not in stderr
    # nothing written: no --out (unless it existed before, then unchanged) and no temporary litter
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == snapshot
