"""``--matmul-precision``: the model's float32 products in calibration's data passes at torch's lower precisions,
qtool's own sums kept float32, recorded where used, refused when misspelt (qtool.calibration.precision)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.calibration.precision import exact, model_matmuls, unsupported
from qtool.calibration.rounding.statistics import _batch_sums
from tests.helpers import error_lines, run_cli, tiny_llama

BF16 = unsupported("medium", torch.device("cpu")) is None  # this CPU runs bfloat16 products (AMX, AVX512-BF16)

RECIPE = """version: 1
defaults:
  weights: {bitwidth: 4, symmetric: true, granularity: per_block, block_size: 16, rounding: gptq}
  activations: {inputs: true, outputs: false, analyzer: minmax}
ignore: ["lm_head"]
"""


def test_the_setting_is_torch_s_inside_and_restored_after():
    assert torch.get_float32_matmul_precision() == "highest"
    with model_matmuls("medium"):
        assert torch.get_float32_matmul_precision() == "medium"
        with exact():
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "medium"
    assert torch.get_float32_matmul_precision() == "highest"
    with pytest.raises(ZeroDivisionError):
        with model_matmuls("high"):
            1 / 0
    assert torch.get_float32_matmul_precision() == "highest"


def test_input_statistics_are_float32_products_inside_a_lower_precision_pass():
    """XᵀX (GPTQ's Hessian) is taken inside the model's forward, so it must put the highest precision back: the
    same bits as outside any pass, though the same product under the pass's own setting differs where the CPU has
    bfloat16 units."""
    x = torch.randn(512, 1, 448, generator=torch.Generator().manual_seed(0))
    want = _batch_sums(x, True)
    with model_matmuls("medium"):
        got = _batch_sums(x, True)
        plain = x[:, 0].T @ x[:, 0]
    for a, b in zip(want[1:], got[1:]):
        assert torch.equal(a, b)
    assert torch.equal(plain, x[:, 0].T @ x[:, 0]) != BF16  # the setting bites where the CPU has the units


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("precision")
    tiny_llama(d / "m", num_hidden_layers=2)
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, d / "ids.safetensors")
    (d / "r.yaml").write_text(RECIPE)
    return d, ["calibrate", d / "m", "-c", d / "r.yaml", "--data", d / "ids.safetensors", "--batch-size", "4",
               "--quiet"]


def _ranges(run):
    return {e["name"]: (e["min"], e["max"]) for e in json.loads((run / "encodings.json").read_text())["quantizers"]
            if e["tensor"] != "weight"}


@pytest.mark.parametrize("mode", [[], ["--sequential"]], ids=["in-memory", "sequential"])
def test_a_lower_precision_calibrates_close_to_float32_records_itself_and_repeats_its_bytes(llama, tmp_path, mode):
    d, args = llama
    runs = {}
    for name, extra in (("highest", []), ("medium", ["--matmul-precision", "medium"]),
                        ("again", ["--matmul-precision", "medium"])):
        code, out, err = run_cli(*args, *mode, *extra, "-o", tmp_path / name, "--json")
        assert code == 0, err
        runs[name] = (tmp_path / name, json.loads(out))
    high, low = runs["highest"][0], runs["medium"][0]
    manifest = json.loads((low / "manifest.json").read_text())
    assert manifest["options"]["matmul_precision"] == "medium" and runs["medium"][1]["matmul_precision"] == "medium"
    assert "matmul_precision" not in json.loads((high / "manifest.json").read_text())["options"]
    assert "matmul_precision" not in runs["highest"][1]
    for f in ("encodings.json", "codes.safetensors"):
        assert (low / f).read_bytes() == (runs["again"][0] / f).read_bytes()
    a, b = _ranges(high), _ranges(low)
    assert a.keys() == b.keys() and len(a) > 4
    for name in a:  # bfloat16 products round the activations by ~2^-9: the ranges move by that order, not more
        for x, y in zip(a[name], b[name]):
            assert abs(x - y) <= 0.05 * max(abs(x), abs(y), 1e-3), name
    codes_high, codes_low = load_file(high / "codes.safetensors"), load_file(low / "codes.safetensors")
    same = sum(int((codes_high[k] == codes_low[k]).sum()) for k in codes_high)
    total = sum(t.numel() for t in codes_high.values())
    assert same / total > 0.9  # GPTQ from slightly other Hessians: most codes the same
    warned = any("--matmul-precision medium" in w for w in manifest["warnings"])
    if BF16:
        assert (high / "encodings.json").read_bytes() != (low / "encodings.json").read_bytes() and not warned
    else:  # nothing to run it on: float32 products, the bytes of highest, and a warning saying so
        assert warned and _ranges(high) == _ranges(low) and same == total


def test_a_misspelt_precision_is_one_line_before_anything_runs(llama, tmp_path):
    d, args = llama
    code, _, err = run_cli(*args, "--matmul-precision", "bf16", "-o", tmp_path / "r")
    assert code == 2
    assert error_lines(err) == ["error: --matmul-precision must be one of highest, high, medium (got 'bf16')"]
    assert not (tmp_path / "r").exists()
