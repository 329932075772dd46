"""``--matmul-precision``: the model's float32 products in calibration's data passes at torch's lower precisions,
qtool's own sums kept float32, recorded where used, refused when misspelt (qtool.quant.precision)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.quant.precision import exact, model_matmuls, unsupported
from qtool.calibration.rounding.statistics import _batch_sums
from tests.helpers import error_lines, run_cli

BF16 = unsupported("medium", torch.device("cpu")) is None  # this CPU runs bfloat16 products (AMX)

RECIPE = """version: 1
defaults:
  weights: {bitwidth: 4, symmetric: true, granularity: per_block, block_size: 16, rounding: gptq}
  activations: {inputs: true, outputs: false, analyzer: minmax}
ignore: ["lm_head"]
"""


def _backends():
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision


def test_the_setting_is_torch_s_per_backend_inside_and_restored_after():
    before = _backends()
    with model_matmuls("medium"):
        assert _backends() == ("tf32", "bf16")  # as torch.set_float32_matmul_precision("medium") sets them
        with exact():
            assert _backends() == ("ieee", "ieee")
        assert _backends() == ("tf32", "bf16")
    assert _backends() == before
    with pytest.raises(ZeroDivisionError):
        with model_matmuls("high"):
            assert _backends() == ("tf32", "tf32")
            1 / 0
    assert _backends() == before


def _statistics_stay_float32(x: torch.Tensor, precision: str, bites: bool, factor: float) -> None:
    """``_batch_sums`` of ``x`` inside a pass at ``precision`` gives the bits it gives outside one; where the
    setting ``bites``, the pass's own ``xᵀx`` is over ``factor`` times further from float64's."""
    want = _batch_sums(x, True)
    with model_matmuls(precision):
        got = _batch_sums(x, True)
        plain = x[:, 0].T @ x[:, 0]
    for a, b in zip(want[1:], got[1:]):
        assert torch.equal(a, b)
    if bites:
        ref = x[:, 0].double().T @ x[:, 0].double()
        assert (plain - ref).abs().max() > factor * (got[2][0] - ref).abs().max()


def test_input_statistics_are_float32_products_inside_a_lower_precision_pass():
    """XᵀX (GPTQ's Hessian) is taken inside the model's forward, so it must put float32 back: the same bits as
    outside any pass, where the pass's own products (on a CPU with AMX) are bfloat16's, errors ~1000x larger."""
    _statistics_stay_float32(torch.randn(512, 1, 448, generator=torch.Generator().manual_seed(0)), "medium", BF16,
                             100)


def test_exact_keeps_onednn_convolutions_float32_too():
    """A CNN's calibration computes nothing of qtool's in convolutions, but the whole run is exact(): a caller's
    bfloat16 setting for oneDNN's convolutions must not change a default run's activations either."""
    conv = torch.nn.Conv2d(16, 32, 3)
    x = torch.randn(2, 16, 24, 24, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = conv(x)
        before = torch.backends.mkldnn.conv.fp32_precision
        try:
            torch.backends.mkldnn.conv.fp32_precision = "bf16"
            with exact():
                got = conv(x)
            lowered = conv(x)
        finally:
            torch.backends.mkldnn.conv.fp32_precision = before
    assert torch.equal(got, want)
    if BF16:
        assert not torch.equal(lowered, want)  # (the caller's setting does bite outside)


def test_torch_releases_before_per_backend_switches_use_the_one_word_setting():
    """torch 2.4-2.8 (the declared range starts at 2.4) has only torch.set_float32_matmul_precision: the same
    contexts go through it there (checked in a fresh process, as such a torch would start)."""
    code = ("import torch\nfrom qtool.quant import precision as p\np._PER_OP = False\n"
            "with p.model_matmuls('medium'):\n    assert torch.get_float32_matmul_precision() == 'medium'\n"
            "    with p.exact():\n        assert torch.get_float32_matmul_precision() == 'highest'\n"
            "    assert torch.get_float32_matmul_precision() == 'medium'\n"
            "assert torch.get_float32_matmul_precision() == 'highest'\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("precision")
    torch.manual_seed(0)  # tests.helpers.tiny_llama's model, without the tokenizer it copies (the data is token ids)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d / "m")
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


def test_a_library_caller_s_lower_setting_changes_no_byte_of_a_default_run(llama, tmp_path):
    """qtool's calibration runs its products at float32 whatever a program around it set (here bfloat16 on the
    CPU and TF32 on CUDA, through torch's new switch and its old one mixed, which makes torch's one-word getter
    raise)."""
    from qtool.pipeline import CalibrateOptions, run_calibrate

    d, args = llama
    code, _, err = run_cli(*args, "-o", tmp_path / "plain")
    assert code == 0, err
    before, legacy = _backends(), torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        torch.backends.cuda.matmul.allow_tf32 = True
        run_calibrate(str(d / "m"), str(d / "r.yaml"), str(tmp_path / "lib"),
                      CalibrateOptions(data=str(d / "ids.safetensors"), batch_size=4))
        assert _backends() == ("tf32", "bf16")  # the caller's settings are left as they were
    finally:  # the old switch first: the new ones then leave torch as unmixed as it was
        torch.backends.cuda.matmul.allow_tf32 = legacy
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = before
    assert torch.get_float32_matmul_precision() == "highest"
    for f in ("encodings.json", "codes.safetensors"):
        assert (tmp_path / "lib" / f).read_bytes() == (tmp_path / "plain" / f).read_bytes()


def test_a_misspelt_precision_is_one_line_before_anything_runs(llama, tmp_path):
    d, args = llama
    code, _, err = run_cli(*args, "--matmul-precision", "bf16", "-o", tmp_path / "r")
    assert code == 2
    assert error_lines(err) == ["error: --matmul-precision must be one of highest, high, medium (got 'bf16')"]
    assert not (tmp_path / "r").exists()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu.sh runs it)")


@needs_cuda
def test_cuda_input_statistics_stay_float32_inside_a_tf32_pass():
    x = torch.randn(4096, 1, 1024, generator=torch.Generator().manual_seed(0)).cuda()
    _statistics_stay_float32(x, "high", unsupported("high", x.device) is None, 10)  # TF32: errors far above float32's


@needs_cuda
def test_cuda_tf32_passes_replayed_as_graphs_keep_the_eager_ranges(llama, tmp_path, monkeypatch):
    """At TF32 the activation pass is still recorded and replayed as a CUDA graph (qtool.calibration.graphs),
    and it leaves the ranges of the eager pass at TF32, bit for bit; both near float32's."""
    from qtool.calibration import graphs, in_memory
    from qtool.pipeline import CalibrateOptions, run_calibrate

    d, _ = llama
    made = []

    def recorded(*args, **kwargs):
        made.append(graphs.replayer(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(in_memory, "replayer", recorded)
    runs = {}
    for name, precision, replay in (("highest", "highest", True), ("replayed", "high", True),
                                    ("eager", "high", False)):
        monkeypatch.setattr(graphs, "ENABLED", replay)
        run_calibrate(str(d / "m"), str(d / "r.yaml"), str(tmp_path / name), CalibrateOptions(
            data=str(d / "ids.safetensors"), batch_size=2, device="cuda", matmul_precision=precision))
        runs[name] = _ranges(tmp_path / name)
    assert made[1] is not None and made[1].refused is None and made[1].replays > 0  # the TF32 pass was replayed
    assert made[2] is None  # and the other one was not
    assert runs["replayed"] == runs["eager"]
    for name, (lo, hi) in runs["highest"].items():
        for x, y in zip((lo, hi), runs["replayed"][name]):
            assert abs(x - y) <= 0.05 * max(abs(x), abs(y), 1e-3), name
