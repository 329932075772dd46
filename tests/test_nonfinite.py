"""No NaN or infinity ever reaches a file: a weight that holds them, or whose range overflows float32's scale, is
refused in every calibration mode with one line naming the weight, and nothing is written."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import error_lines, run_cli, tiny_llama
from tests.tinymodels import mlp


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("nonfinite")
    src = tiny_llama(d / "clean")
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, d / "ids.safetensors")
    return d, src


def _poisoned(d, src, name, values):
    import shutil

    dest = d / name
    if not dest.exists():
        shutil.copytree(src, dest)
        t = load_file(str(dest / "model.safetensors"))
        w = t["model.layers.1.mlp.up_proj.weight"]
        for i, v in enumerate(values):
            w[0, i] = v
        save_file(t, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("poison, message", [
    ((float("nan"),), "the checkpoint's weight holds NaN or infinity"),
    ((float("inf"),), "the checkpoint's weight holds NaN or infinity"),  # (said so before any search runs)
    ((3e38, -3e38), "overflows float32"),
])
@pytest.mark.parametrize("mode", ["streaming", "in_memory", "sequential"])
def test_a_poisoned_weight_is_refused_in_every_mode(llama, tmp_path, poison, message, mode):
    d, src = llama
    ckpt = _poisoned(d, src, f"poison-{len(poison)}-{poison[0]}", poison)
    extra = {"streaming": (), "in_memory": ("--data", d / "ids.safetensors"),
             "sequential": ("--data", d / "ids.safetensors", "--sequential")}[mode]
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a16", "-o", tmp_path / "run", *extra)
    assert code == 2, err
    errors = [line for line in error_lines(err) if line.startswith("error:")]
    assert len(errors) == 1 and "model.layers.1.mlp.up_proj.weight" in errors[0] and message in errors[0], errors
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", ["nvfp4a16", "mxfp4a16"])
def test_a_float_grid_weight_at_float32s_largest_value_is_refused(llama, tmp_path, recipe):
    """A block scale rounded up to its stored type (FP8 for NVFP4, a power of two for MX) times the element's
    largest value decodes a weight of float32's largest magnitude to infinity: NVFP4 wrote it, with exit 0."""
    d, src = llama
    big = float(torch.finfo(torch.float32).max)
    ckpt = _poisoned(d, src, "poison-max", (big, -big))
    code, _, err = run_cli("quantize", ckpt, "-c", recipe, "-o", tmp_path / "q", "--quiet")
    assert code == 2, err
    errors = [line for line in error_lines(err) if line.startswith("error:")]
    assert len(errors) == 1 and "model.layers.1.mlp.up_proj.weight" in errors[0], errors
    assert not (tmp_path / "q").exists()


def test_a_state_dict_with_nan_is_refused(tmp_path):
    state = mlp().state_dict()
    state["2.weight"][1, 1] = float("nan")
    save_file(state, tmp_path / "m.safetensors")
    code, _, err = run_cli("quantize", tmp_path / "m.safetensors", "-c", "w8a16", "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "q")
    assert code == 2 and "2.weight: the checkpoint's weight holds NaN or infinity" in err
    assert not (tmp_path / "q").exists()


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("nf-mlp")
    save_file(mlp().state_dict(), d / "m.safetensors")
    code, _, err = run_cli("quantize", d / "m.safetensors", "-c", "w8a16", "--model-class", "tests.tinymodels:mlp",
                           "-o", d / "q", "--format", "aimet")
    assert code == 0, err
    return d


@pytest.mark.parametrize("field, value, message", [
    ("scale", float("nan"), "NaN is not a JSON number"),  # refused by the reader, before any scale check
    ("scale", 1e300, "its range overflows float32 (scale up to 1e+300)"),
    ("scale", 0.0, "finite number above 0"),
    ("scale", -0.5, "finite number above 0"),
    ("offset", 1000, "outside the 8-bit grid"),
    ("offset", 0.5, "offsets must be integers"),
])
def test_aimet_import_refuses_scales_and_offsets_no_runtime_could_use(mlp_run, tmp_path, field, value, message):
    import json

    obj = json.loads((mlp_run / "q" / "model.encodings").read_text())
    entry = obj["param_encodings"][0]
    entry[field] = [value] * len(entry[field])
    bad = tmp_path / "bad.encodings"
    bad.write_text(json.dumps(obj))  # NaN is written as the (non-standard) NaN token Python's json accepts
    code, _, err = run_cli("import-encodings", mlp_run / "m.safetensors", bad, "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "imported")
    assert code == 2, err
    errors = [line for line in error_lines(err) if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "imported").exists()


def test_encodings_whose_scale_overflows_are_refused_on_read(mlp_run, tmp_path):
    import json

    from qtool.encodings import EncodingsFile
    from qtool.errors import EncodingsError

    path = tmp_path / "encodings.json"
    obj = json.loads((mlp_run / "q" / "calibration" / "encodings.json").read_text())
    w = obj["quantizers"][0]
    w["min"] = [[-3.4e38]] * len(w["min"])
    w["max"] = [[3.4e38]] * len(w["max"])
    path.write_text(json.dumps(obj))
    with pytest.raises(EncodingsError, match="overflows float32"):
        EncodingsFile.read(path)


@pytest.mark.parametrize("change, message", [
    (lambda e: e.update(is_sym="false"), "is_sym must be true or false"),
    (lambda e: e.update(bw=64), "bitwidth 64 is outside 2..16"),
    (lambda e: e.update(bw=True), "must be an integer"),
])
def test_aimet_import_refuses_values_it_would_misread(mlp_run, tmp_path, change, message):
    import json

    obj = json.loads((mlp_run / "q" / "model.encodings").read_text())
    change(obj["param_encodings"][0])
    bad = tmp_path / "bad.encodings"
    bad.write_text(json.dumps(obj))
    code, _, err = run_cli("import-encodings", mlp_run / "m.safetensors", bad, "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "imported")
    assert code == 2 and message in err, err
    assert not (tmp_path / "imported").exists()


def test_aimet_import_refuses_a_name_encoded_twice(mlp_run, tmp_path):
    import json

    obj = json.loads((mlp_run / "q" / "model.encodings").read_text())
    obj["param_encodings"].append(dict(obj["param_encodings"][0]))
    bad = tmp_path / "bad.encodings"
    bad.write_text(json.dumps(obj))
    code, _, err = run_cli("import-encodings", mlp_run / "m.safetensors", bad, "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "imported")
    assert code == 2 and "has two encodings" in err, err


# ---- the writers' own last check: whatever reaches them, a file never holds NaN/Inf ---------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_streaming_safetensors_writer_refuses_a_non_finite_tensor_by_name(tmp_path, dtype, bad):
    from qtool.io.finite import UnstorableValues
    from qtool.io.st_writer import StreamingSafetensorsWriter

    t = torch.arange(12, dtype=dtype).reshape(3, 4)
    t[2, 1] = bad
    w = StreamingSafetensorsWriter(tmp_path / "x.safetensors", [("ok", dtype, (3, 4)), ("layer.weight", dtype, (3, 4))])
    w.write("ok", torch.zeros(3, 4, dtype=dtype))
    with pytest.raises(UnstorableValues, match=r"^layer\.weight: holds NaN or infinite values"):
        w.write("layer.weight", t)
    assert UnstorableValues.exit_code == 2


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_the_writer_check_reads_float8_nan_and_inf_patterns(dtype):
    from qtool.io.finite import check_finite, UnstorableValues

    dt = getattr(torch, dtype)
    fine = torch.tensor([0.0, -448.0 if dtype == "float8_e4m3fn" else -57344.0, 1.5]).to(dt)
    check_finite("w", fine)  # the largest finite values are not NaN patterns
    with pytest.raises(UnstorableValues):
        check_finite("w", torch.tensor([1.0, float("nan")]).to(dt))


def test_storable_names_values_beyond_the_stored_type():
    from qtool.io.finite import UnstorableValues, storable

    assert storable("w", torch.tensor([65504.0, -65519.0]), torch.float16).tolist() == [65504.0, -65504.0]
    with pytest.raises(UnstorableValues, match=r"^w: holds values beyond float16's range \(±65504\).*hint here"):
        storable("w", torch.tensor([1.0, 65520.0]), torch.float16, "hint here")
    with pytest.raises(UnstorableValues, match="NaN or infinite"):
        storable("w", torch.tensor([1.0, float("nan")]), torch.float16)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_json_files_qtool_writes_refuse_nan_and_infinity(value):
    from qtool.io.jsonfile import dumps_indented

    for obj in ([1.0, value], {"a": value}, {"a": [[1.0], [value]]}):
        with pytest.raises(ValueError):
            dumps_indented(obj)


def test_a_float16_scale_grid_reports_an_unrepresentable_range_as_its_weights_fault():
    from qtool.quant.affine import UnrepresentableScale, snap_to_float16_scale

    with pytest.raises(UnrepresentableScale, match=r"needs a scale of 7\.8\d+e\+35, beyond float16's largest"):
        snap_to_float16_scale(torch.tensor([-1e38]), torch.tensor([1e38]), -128, 127, True)
    with pytest.raises(UnrepresentableScale, match="holds NaN or infinity"):
        snap_to_float16_scale(torch.tensor([float("nan")]), torch.tensor([1.0]), -8, 7, True)
    lo, hi = snap_to_float16_scale(torch.tensor([-1.0]), torch.tensor([1.0]), -128, 127, True)  # still snaps
    assert torch.isfinite(lo).all() and torch.isfinite(hi).all()


def test_nvfp4_activations_that_are_all_zero_calibrate_and_read_back(tmp_path):
    """A global amax of 0 (an input that is all zeros, or -0.0 from a subnormal weight) is a valid NVFP4 entry:
    the file qtool writes is one its reader takes back (it was refused on the read-back of quantize)."""
    from qtool.encodings import EncodingsFile

    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    save_file({"x": torch.zeros(8, 64)}, tmp_path / "zeros.safetensors")
    code, _, err = run_cli("quantize", tmp_path / "m.safetensors", "-c", "nvfp4", "--model-class", "tests.tinymodels:mlp",
                           "--data", tmp_path / "zeros.safetensors", "-o", tmp_path / "q", "--quiet")
    assert code == 0, err
    amax = {e.name: e.global_amax for e in EncodingsFile.read(tmp_path / "q" / "calibration" / "encodings.json").entries}
    assert amax["0.input"] == 0.0 and str(amax["0.input"]) == "0.0"


def _with_extras(d, src, name, extras):
    import shutil

    dest = d / name
    if not dest.exists():
        shutil.copytree(src, dest)
        t = load_file(str(dest / "model.safetensors"))
        t.update(extras)
        save_file(t, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
def test_float8_and_complex_tensors_a_checkpoint_keeps_are_copied_as_they_are(llama, tmp_path, fmt):
    """An FP8 checkpoint's scales, or any float8/complex tensor the model does not quantize, reach the file with
    their dtype and bytes: export stopped with an internal error (exit 3) after calibrating."""
    d, src = llama
    extras = {"extra.e4m3": torch.tensor([1.0, -2.0, 448.0, 0.0]).to(torch.float8_e4m3fn),
              "extra.e5m2": torch.tensor([1.0, 57344.0]).to(torch.float8_e5m2),
              "extra.c64": torch.tensor([1 + 2j, -3j], dtype=torch.complex64)}
    ckpt = _with_extras(d, src, "extras", extras)
    code, _, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "out", "--format", fmt)
    assert code == 0, err
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    for k, v in extras.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), k


def test_a_float8_tensor_holding_nan_is_refused_naming_it(llama, tmp_path):
    d, src = llama
    bad = torch.tensor([1.0, float("inf")]).to(torch.float8_e5m2)  # (E5M2 has infinities)
    ckpt = _with_extras(d, src, "extras-inf", {"extra.e5m2": bad})
    code, _, err = run_cli("quantize", ckpt, "-c", "w8a16", "-o", tmp_path / "out")
    assert code == 2, err
    assert "'extra.e5m2' holds NaN/Inf values" in err and not (tmp_path / "out").exists()


def test_an_activation_that_overflows_to_infinity_after_a_relu_is_refused(tmp_path):
    """One activation overflowing to +inf after a ReLU was clamped to float32's largest value: a one-sided range
    [0, 3.4e38] had a finite scale (1.3e36), every real value of that layer's input rounded to 0, exit 0."""
    import numpy as np

    state = mlp().state_dict()
    state["0.weight"] = state["0.weight"] * 1e37  # (its own range and scale stay finite)
    save_file(state, tmp_path / "mlp.safetensors")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32) * 30)
    code, _, err = run_cli("calibrate", tmp_path / "mlp.safetensors", "--model-class", "tests.tinymodels:mlp", "-c",
                           "w8a8", "--data", tmp_path / "x.npy", "-o", tmp_path / "run")
    assert code == 2, err
    assert error_lines(err)[-1].startswith("error: 2.input: its range reaches float32's largest value"), err
    assert not (tmp_path / "run").exists()
