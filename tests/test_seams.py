"""The seams of 0.2: stored codes reach every exporter through the weight source, bad choices fail before any
work, and the exporter registry is what the CLI offers."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qtool.encodings import EncodingsFile
from qtool.errors import EncodingsError
from qtool.export import FORMATS, get_exporter
from qtool.pipeline import CalibrateOptions, ExportOptions, run_calibrate, run_export
from qtool.quant import quantize
from qtool.quant.packing import unpack_bytes
from qtool.weights import write_codes

from tests.tinymodels import mlp

REPO = Path(__file__).resolve().parents[1]
MLP = "tests.tinymodels:mlp"


@pytest.fixture
def calibrated(tmp_path):
    ckpt = tmp_path / "mlp.safetensors"
    save_file(mlp().state_dict(), ckpt)
    data = tmp_path / "x.safetensors"
    save_file({"x": torch.randn(16, 64, generator=torch.Generator().manual_seed(0))}, data)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 16}\n"
                      "layers:\n  - match: '2'\n    weights: {bitwidth: 8, granularity: per_channel}\n")
    run_calibrate(str(ckpt), str(recipe), str(tmp_path / "run"), CalibrateOptions(data=str(data), model_class=MLP))
    return ckpt, data, tmp_path / "run" / "encodings.json"


def _rtn(enc, state):
    out = {}
    for e in enc.entries:
        if e.tensor == "weight":
            scale, offset = e.scale_offset()
            qmin, qmax = e.qmin_qmax
            out[e.name] = quantize(state[e.name], scale, offset, qmin=qmin, qmax=qmax,
                                   block_size=e.block_size).to(torch.int64)
    return out


def _store_codes(enc_path: Path, enc: EncodingsFile, codes):
    write_codes(enc_path.parent / "codes.safetensors", enc.entries, codes)
    enc.codes_file = "codes.safetensors"
    enc.write(enc_path)


def test_every_exporter_writes_stored_codes_instead_of_rtn(calibrated, tmp_path):
    import onnx
    from onnx import numpy_helper

    ckpt, data, enc_path = calibrated
    enc = EncodingsFile.read(enc_path)
    rtn = _rtn(enc, mlp().state_dict())
    g = torch.Generator().manual_seed(5)
    chosen = {}
    for e in enc.entries:
        if e.tensor == "weight":
            qmin, qmax = e.qmin_qmax
            step = torch.randint(-1, 2, rtn[e.name].shape, generator=g)  # what a rounding algorithm might pick
            chosen[e.name] = (rtn[e.name] + step).clamp(qmin, qmax)
            assert not torch.equal(chosen[e.name], rtn[e.name])
    _store_codes(enc_path, enc, chosen)
    back = EncodingsFile.read(enc_path)
    assert back.codes_file == "codes.safetensors"
    assert json.loads(enc_path.read_text())["schema_version"] == 3

    run_export(str(ckpt), str(enc_path), str(tmp_path / "q"), ExportOptions(model_class=MLP))
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["qtool"])
        for name, want in chosen.items():
            t = f.get_tensor(name)
            m = meta[name]
            got = unpack_bytes(t, m["bitwidth"], m["shape"], signed=m["qmin"] < 0) if m["packed"] else t
            assert torch.equal(got.to(torch.int64), want), name
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert [d["path"] for d in manifest["inputs"]["encodings_data"]] == ["codes.safetensors"]

    run_export(str(ckpt), str(enc_path), str(tmp_path / "o"),
               ExportOptions(format="onnx", model_class=MLP, data=str(data)))
    inits = {i.name: i for i in onnx.load(str(tmp_path / "o" / "model.onnx")).graph.initializer}
    for name, want in chosen.items():
        got = numpy_helper.to_array(inits[name])
        if got.dtype == np.uint8 and inits[name].data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
            pytest.skip("numpy_helper returned packed int4")  # pragma: no cover - onnx versions differ
        assert torch.equal(torch.from_numpy(np.asarray(got).astype(np.int64)).reshape(want.shape), want), name


def test_codes_outside_the_grid_are_refused(calibrated):
    _, _, enc_path = calibrated
    enc = EncodingsFile.read(enc_path)
    e = next(e for e in enc.entries if e.tensor == "weight")
    bad = torch.full((128, 64), e.qmin_qmax[1] + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="within"):
        write_codes(enc_path.parent / "codes.safetensors", enc.entries, {e.name: bad})


def test_codes_file_of_the_wrong_dtype_is_one_error(calibrated, tmp_path):
    ckpt, _, enc_path = calibrated
    enc = EncodingsFile.read(enc_path)
    save_file({"codes/0.weight": torch.zeros(128, 64, dtype=torch.int32)}, enc_path.parent / "codes.safetensors")
    enc.codes_file = "codes.safetensors"
    enc.write(enc_path)
    with pytest.raises(EncodingsError, match="codes/0.weight is torch.int32, expected torch.int8"):
        run_export(str(ckpt), str(enc_path), str(tmp_path / "q"), ExportOptions(model_class=MLP))
    assert not (tmp_path / "q").exists()


def test_registry_is_what_the_cli_offers():
    from typer.testing import CliRunner

    from qtool.cli import app

    out = CliRunner().invoke(app, ["export", "--help"]).stdout
    for name in FORMATS:
        assert get_exporter(name).name == name
        assert name in " ".join(out.split())


@pytest.mark.parametrize("args,message", [
    (["quantize", "nope", "-c", "configs/w8a8.yaml", "-o", "OUT", "--format", "typo"], "--format must be one of"),
    (["quantize", "nope", "-c", "configs/w8a8.yaml", "-o", "OUT", "--encoding-version", "9"],
     "--encoding-version must be one of"),
    (["quantize", "nope", "-c", "configs/w8a8.yaml", "-o", "OUT", "--ct-8bit-format", "x"],
     "--ct-8bit-format must be one of"),
    (["calibrate", "nope", "-c", "configs/w8a8.yaml", "-o", "OUT", "--device", "tpu"], "--device must be"),
    (["quantize", "nope", "-c", "missing.yaml", "-o", "OUT"], "missing.yaml: recipe file not found"),
    (["export", "nope", "-e", "e.json", "-o", "OUT", "-f", "gguff"], "--format must be one of"),
    (["export", "nope", "-e", "e.json", "-o", "OUT", "-f", "ggfu"], "(got 'ggfu'; did you mean gguf?)"),
])
def test_bad_choices_fail_before_torch_is_imported(args, message, tmp_path):
    """The check runs before any model, data or even torch is loaded (so it takes a fraction of a second)."""
    code = ("import sys\nfrom qtool.cli import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'torch' in sys.modules)\n")
    args = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "exit 2 False", (r.stdout, r.stderr)
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_gates_are_library_code_raising_gate_failed():
    from qtool.errors import GateFailed, UsageError
    from qtool.report import LayerError, Report, check_gates, enforce_gates

    rep = Report(layers=[LayerError("fc", "Linear", 18.0, 30.0)], samples=4, cosine=0.97, cosine_min=0.9)
    gates = check_gates(rep, min_sqnr=20.0, min_cosine=0.95)
    assert [(g.gate, g.passed) for g in gates] == [("min-sqnr", False), ("min-cosine", True)]
    with pytest.raises(GateFailed) as info:
        enforce_gates(gates)
    assert info.value.exit_code == 1 and str(info.value) == "gate failed: --min-sqnr 20.0: fc at 18.0 dB"
    enforce_gates(check_gates(rep, min_cosine=0.9))  # passes: no error
    with pytest.raises(UsageError, match="causal language model"):
        check_gates(rep, max_ppl_increase=5)


def _mlp_run(tmp_path):
    ckpt, data = tmp_path / "mlp.safetensors", tmp_path / "x.safetensors"
    if not ckpt.exists():
        save_file(mlp().state_dict(), ckpt)
        save_file({"x": torch.randn(16, 64, generator=torch.Generator().manual_seed(0))}, data)
    return str(ckpt), CalibrateOptions(data=str(data), model_class=MLP)


def test_a_library_call_computes_in_float32_whatever_the_callers_default_dtype(tmp_path):
    """A caller's torch.set_default_dtype(float64) made calibration compute its ranges in float64: encodings
    that differed from the CLI's and that export then refused ("the stored scale disagrees...")."""
    ckpt, opts = _mlp_run(tmp_path)
    run_calibrate(ckpt, "w8a8", str(tmp_path / "f32"), opts)
    for dtype in (torch.float64, torch.bfloat16):
        torch.set_default_dtype(dtype)
        try:
            run_calibrate(ckpt, "w8a8", str(tmp_path / str(dtype)), opts)
            assert torch.get_default_dtype() == dtype  # the caller's setting is back
        finally:
            torch.set_default_dtype(torch.float32)
        assert (tmp_path / str(dtype) / "encodings.json").read_bytes() == (tmp_path / "f32/encodings.json").read_bytes()
    run_export(ckpt, str(tmp_path / "torch.float64/encodings.json"), str(tmp_path / "x"),
               ExportOptions(model_class=MLP))


def test_library_calls_from_two_threads_run_one_after_the_other(tmp_path):
    """Each job sets torch's process-wide precision switches for its passes; two threads at once read each other's
    (a 'highest' run's bytes changed beside a 'medium' one). The second call now waits for the first."""
    import threading

    from qtool.hooks import Hooks

    ckpt, opts = _mlp_run(tmp_path)
    first_running, release, second_started = threading.Event(), threading.Event(), threading.Event()

    def hold(text):
        first_running.set()
        release.wait(30)

    a = threading.Thread(target=run_calibrate, args=(ckpt, "w8a8", str(tmp_path / "a"), opts),
                         kwargs={"hooks": Hooks(on_stage=hold)})
    b = threading.Thread(target=run_calibrate, args=(ckpt, "w8a8", str(tmp_path / "b"), opts),
                         kwargs={"hooks": Hooks(on_stage=lambda text: second_started.set())})
    a.start()
    assert first_running.wait(30)
    b.start()
    started_meanwhile = second_started.wait(8)  # (without the lock: within a fraction of a second)
    release.set()
    a.join(60)
    b.join(60)
    assert not started_meanwhile and second_started.is_set()
    assert (tmp_path / "a/encodings.json").read_bytes() == (tmp_path / "b/encodings.json").read_bytes()


def test_library_jobs_run_outside_the_callers_inference_mode_and_eval_in_float32(tmp_path):
    """A --sequential calibration inside torch.inference_mode() read 'the model rejected the data: Inference tensors
    do not track version counter'; evaluate_artifact under a float64 default dtype measured other figures."""
    import dataclasses

    from qtool.evaluation import EvalOptions, evaluate_artifact
    from qtool.pipeline import run_quantize
    from tests.helpers import tiny_llama_and_ids

    ckpt, ids = tiny_llama_and_ids(tmp_path)
    opts = CalibrateOptions(data=str(ids), seq_len=32, sequential=True)
    run_quantize(str(ckpt), "w8a16", str(tmp_path / "a"), opts)
    with torch.inference_mode():
        run_quantize(str(ckpt), "w8a16", str(tmp_path / "b"), opts)
    assert (tmp_path / "b/model.safetensors").read_bytes() == (tmp_path / "a/model.safetensors").read_bytes()
    eopts = EvalOptions(data=str(ids), seq_len=32, num_samples=4, generate=0)
    figures = []
    for dtype in (torch.float32, torch.float64):
        torch.set_default_dtype(dtype)
        try:
            ev = evaluate_artifact(str(tmp_path / "a"), str(ckpt), None, eopts)
        finally:
            torch.set_default_dtype(torch.float32)
        figures.append(json.dumps(dataclasses.asdict(ev) if dataclasses.is_dataclass(ev) else ev.to_json(),
                                  default=str, sort_keys=True))
    assert figures[0] == figures[1]
