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
    ((float("nan"),), "holds NaN or infinity"),
    ((float("inf"),), "overflows float32"),  # min-max clamps infinity to float32's limits: the scale overflows
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


def test_a_state_dict_with_nan_is_refused(tmp_path):
    state = mlp().state_dict()
    state["2.weight"][1, 1] = float("nan")
    save_file(state, tmp_path / "m.safetensors")
    code, _, err = run_cli("quantize", tmp_path / "m.safetensors", "-c", "w8a16", "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "q")
    assert code == 2 and "2.weight: its calibrated range holds NaN" in err
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
    ("scale", 1e300, "finite number above 0"),
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
