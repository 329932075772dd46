"""The --json contract: each command prints exactly the keys docs/ci.md documents."""

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.helpers import run_cli
from tests.tinymodels import mlp


def _documented_keys():
    text = (Path(__file__).resolve().parents[1] / "docs" / "ci.md").read_text()
    section = text[text.index("## `--json` output"):text.index("## Example nightly workflow")]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+)`[^|]*\| (.*) \|$", line)
        if m:  # a row's top-level keys: the backticked names outside parentheses (those hold nested keys)
            depth, flat = 0, ""
            for ch in m.group(2):
                depth += ch == "("
                flat += ch if depth == 0 else ""
                depth -= ch == ")"
            rows.setdefault(m.group(1), set()).update(re.findall(r"`([a-z_0-9]+)`", flat))
    return rows


def test_json_keys_are_the_documented_ones(tmp_path):
    doc = _documented_keys()
    ckpt, data = tmp_path / "m.safetensors", tmp_path / "x.safetensors"
    save_file(mlp().state_dict(), ckpt)
    save_file({"x": torch.randn(16, 64, generator=torch.Generator().manual_seed(0))}, data)
    mc = ("--model-class", "tests.tinymodels:mlp")

    def keys(*args):
        code, out, err = run_cli(*args, "--json")
        assert code == 0, err
        return set(json.loads(out))

    assert keys("calibrate", ckpt, "-c", "w8a8", "--data", data, *mc, "-o", tmp_path / "c") == doc["calibrate"]
    enc = tmp_path / "c" / "encodings.json"
    for fmt in ("qtool", "aimet", "onnx"):
        got = keys("export", ckpt, "-e", enc, *mc, "-o", tmp_path / fmt, "--format", fmt, "--data", data)
        assert got == doc["export"] | doc[fmt], fmt
    assert keys("quantize", ckpt, "-c", "w8a8", "--data", data, *mc, "-o", tmp_path / "q") == \
        doc["calibrate"] | doc["export"] | doc["qtool"]
    assert keys("report", ckpt, "-e", enc, "--data", data, *mc) == doc["report"]
    assert keys("inspect", tmp_path / "qtool") == doc["inspect"]
    for fmt in ("qtool", "onnx"):  # not a causal LM: output cosine (the manifest names the checkpoint)
        assert keys("eval", tmp_path / fmt, "--data", data, *mc) == doc["eval (other models)"], fmt
    code, out, err = run_cli("eval", tmp_path / "qtool", "--data", data, *mc, "--json")
    assert code == 0 and json.loads(out)["tokens"] is None, err  # feature inputs have no tokens (it said 16)
    assert keys("import-encodings", ckpt, tmp_path / "qtool" / "model.encodings", *mc, "-o", tmp_path / "i") == \
        doc["import-encodings"]
    assert keys("config", "list") == doc["config list"]
    assert keys("config", "show", "w8a8") == doc["config show NAME"]
    assert keys("config", "show", "w8a8", "--model", ckpt, *mc) == doc["config show --model"]
    assert keys("config", "validate", "w8a8") == doc["config validate"]


def test_export_says_what_was_gained(tmp_path):
    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    code, out, err = run_cli("quantize", tmp_path / "m.safetensors", "-c", "w4a16-block32", "--model-class",
                             "tests.tinymodels:mlp", "-o", tmp_path / "q")
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("size: "))
    ckpt = (tmp_path / "m.safetensors").stat().st_size
    model = (tmp_path / "q" / "model.safetensors").stat().st_size
    assert f"({ckpt / model:.2f}x smaller)" in line and "quantized weights" in line
    assert 3 < ckpt / model < 8  # int4 blocks of 32 with float32 scales and offsets, biases in float


def test_indented_dumps_are_json_dumps_text():
    """dumps_indented (the encodings file's and AIMET export's writer) gives json.dumps(indent=...)'s exact text on
    any JSON value: numbers of every kind, strings holding the list separator, nesting, empty containers, keys
    that are not strings. (NaN and infinities are not JSON values: it refuses them, test_nonfinite.py.)"""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from qtool.io.jsonfile import NumberArray, dumps_indented

    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | \
        st.text(max_size=6) | st.sampled_from(["a, b", ", ", "\n", "]"])
    keys = st.text(max_size=4) | st.integers(-3, 3) | st.booleans()
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(keys, inner, max_size=4),
                          max_leaves=40)

    @settings(max_examples=400, deadline=None)
    @given(values, st.integers(1, 3))
    def check(obj, indent):
        assert dumps_indented(obj, indent) == json.dumps(obj, indent=indent)

    check()

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(0, 3), max_size=4), st.integers(0, 3), st.data())
    def arrays(shape, level, data):
        """A tensor's numbers given flat with their shape (NumberArray): the text of its nested lists."""
        t = torch.tensor(data.draw(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=math.prod(shape),
                                            max_size=math.prod(shape))), dtype=torch.float32).reshape(shape)
        nested = t.tolist()
        array = NumberArray(t.reshape(-1).tolist(), tuple(shape))
        assert array.tolist() == nested
        assert dumps_indented({"min": array}, 1, level) == json.dumps({"min": nested}, indent=1).replace(
            "\n", "\n" + " " * level)

    arrays()


def test_a_file_larger_than_what_it_is_compared_with_is_said_to_be_larger(tmp_path):
    """inspect of a float32 file read "float16 3,856 (0.50x smaller)"; an export larger than its checkpoint
    "0.44x smaller"."""
    from qtool.cli.output import ratio_words

    assert ratio_words(400, 100) == "4.00x smaller" and ratio_words(100, 250) == "2.50x larger"
    assert ratio_words(1000, 1000) == "the same size" and ratio_words(1000, 1004) == "about the same size"
    assert ratio_words(1000, 1006) == "1.01x larger"  # (an equal size read "1.00x smaller" or "1.00x larger")
    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    code, out, err = run_cli("inspect", tmp_path / "m.safetensors")
    assert code == 0, err
    text = " ".join((out + err).split())  # (the console wraps the line)
    assert "float32 68,904 (the same size); float16 34,452 (2.00x larger)" in text, text


def test_a_failing_config_validate_object_carries_its_exit_code(tmp_path):
    """Every other failure object has exit_code (docs/ci.md); config validate's had only ok and errors."""
    (tmp_path / "bad.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 40}\n")
    code, out, _ = run_cli("config", "validate", tmp_path / "bad.yaml", "--json")
    obj = json.loads(out)
    assert code == 2 and obj["ok"] is False and obj["exit_code"] == 2 and obj["errors"][0]["recipe"]
