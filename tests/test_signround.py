"""Learned rounding and ranges (``rounding: signround``, qtool.calibration.rounding.signround): per decoder block,
on the block's own inputs, never worse than round-to-nearest, deterministic, the same bytes resumed and on two
ranks, refused where it cannot run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import error_lines, run_cli, tiny_llama

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]

RECIPE = """version: 1
defaults:
  weights: {{bitwidth: 3, symmetric: {symmetric}, granularity: per_block, block_size: 16,
             rounding: {rounding}}}
  activations: null
ignore: ["lm_head", "re:.*embed_tokens"]
"""
LEARNED = "{name: signround, iterations: 20}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("signround")
    tiny_llama(d / "m", num_hidden_layers=2)
    ids = torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(5))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, d / "ids.safetensors")
    for name, rounding, symmetric in (("learned", LEARNED, "true"), ("nearest", "nearest", "true"),
                                      ("fixed", "{name: signround, iterations: 20, ranges: false}", "true"),
                                      ("asym", LEARNED, "false"), ("asym-nearest", "nearest", "false")):
        (d / f"{name}.yaml").write_text(RECIPE.format(rounding=rounding, symmetric=symmetric))
    runs = {}
    for name in ("learned", "nearest", "fixed", "asym", "asym-nearest"):
        code, _, err = run_cli(*_args(d, name), "-o", d / name)
        assert code == 0, err
        runs[name] = d / name
    return d, runs


def _args(d: Path, recipe: str):
    return ["calibrate", d / "m", "-c", d / f"{recipe}.yaml", "--data", d / "ids.safetensors", "--batch-size", "4",
            "--sequential", "--quiet"]


def _files(run: Path):
    return {p.name: p.read_bytes() for p in sorted(run.iterdir())}


def _entries(run: Path):
    return {e["name"]: e for e in json.loads((run / "encodings.json").read_text())["quantizers"]}


def _logit_error(d: Path, run: Path) -> float:
    """Mean squared logit error of the calibrated model against the float one, on the calibration ids."""
    import transformers

    import qtool

    ids = load_file(str(d / "ids.safetensors"))["input_ids"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(d / "m")).eval()
    model = qtool.load_calibrated(str(d / "m"), str(run / "encodings.json"))
    with torch.no_grad():
        return float((model(input_ids=ids).logits - ref(input_ids=ids).logits).pow(2).mean())


def test_every_block_ends_at_most_at_nearest_and_the_model_is_closer_to_float(llama):
    d, runs = llama
    for name in ("learned", "asym"):
        blocks = json.loads((runs[name] / "manifest.json").read_text())["signround"]["blocks"]
        assert [b["block"] for b in blocks] == ["model.layers.0", "model.layers.1"]
        for b in blocks:
            assert b["losses"][b["chosen"]] <= b["losses"]["nearest"]
            assert b["losses"][b["chosen"]] < 0.8 * b["losses"]["nearest"], b  # 3 bits: learning pays
    # measured from outside: the whole model's logits, float beside each calibrated one
    assert _logit_error(d, runs["learned"]) < 0.8 * _logit_error(d, runs["nearest"])
    assert _logit_error(d, runs["asym"]) < 0.8 * _logit_error(d, runs["asym-nearest"])


def test_learned_codes_move_at_most_one_step_and_ranges_only_shrink(llama):
    d, runs = llama
    codes = load_file(str(runs["fixed"] / "codes.safetensors"))
    learned, nearest, fixed = _entries(runs["learned"]), _entries(runs["nearest"]), _entries(runs["fixed"])
    weights = load_file(str(d / "m" / "model.safetensors"))
    moved = 0
    for key, c in codes.items():
        name = key.removeprefix("codes/")
        # ranges: false keeps the analyzer's grid; the codes are nearest's, give or take one step
        assert fixed[name]["min"] == nearest[name]["min"] and fixed[name]["max"] == nearest[name]["max"]
        mx = torch.tensor(nearest[name]["max"])
        step = (mx / 3).repeat_interleave(16, dim=1)  # int3 symmetric: max = 3 steps
        rtn = torch.clamp(torch.round(weights[name] / step), -4, 3)
        delta = c.to(torch.float32) - rtn
        assert delta.abs().max() <= 1
        moved += int((delta != 0).sum())
        # learned ranges: each block's range is the analyzer's times a factor in [MIN_RANGE, 1]
        ratio = torch.tensor(learned[name]["max"]) / mx
        assert float(ratio.min()) >= 0.5 - 1e-6 and float(ratio.max()) <= 1 + 1e-6
    assert moved > 0
    assert any(learned[n]["max"] != nearest[n]["max"] for n in learned)


def test_the_same_inputs_give_the_same_bytes(llama, tmp_path):
    d, runs = llama
    code, _, err = run_cli(*_args(d, "learned"), "-o", tmp_path / "again")
    assert code == 0, err
    assert _files(tmp_path / "again") == _files(runs["learned"])  # manifest.json included


def test_a_run_killed_after_a_block_resumes_to_the_bytes_of_an_uninterrupted_one(llama, tmp_path):
    d, runs = llama
    out = tmp_path / "run"
    args = [str(a) for a in _args(d, "learned")]
    r = subprocess.run([sys.executable, str(ROOT / "tests/stop_after_block.py"), "1", "--", *args, "-o", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == -9, r.stderr[-2000:]
    code, _, err = run_cli(*args, "--resume", "-o", out)
    assert code == 0, err
    assert _files(out) == _files(runs["learned"])


def test_two_ranks_write_the_bytes_of_one_process(llama, tmp_path):
    d, runs = llama
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "qtool",
           *[str(a) for a in _args(d, "learned")], "-o", str(tmp_path / "many")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    many, one = _files(tmp_path / "many"), _files(runs["learned"])
    for name in ("encodings.json", "codes.safetensors"):
        assert many[name] == one[name]
    assert json.loads(many["manifest.json"])["signround"] == json.loads(one["manifest.json"])["signround"]


def test_without_sequential_it_is_refused_in_one_line(llama, tmp_path):
    d, _ = llama
    args = [a for a in _args(d, "learned") if a != "--sequential"]
    code, _, err = run_cli(*args, "-o", tmp_path / "out")
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1 and "signround" in lines[0] and "--sequential" in lines[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("grid, why", [("bitwidth: 4, granularity: per_channel, scale_dtype: float16", "integer grids"),
                                       ("gguf_type: iq4_nl", "table")])
def test_a_grid_it_does_not_learn_on_is_refused_in_one_line(llama, tmp_path, grid, why):
    d, _ = llama
    (tmp_path / "r.yaml").write_text(f"""version: 1
defaults:
  weights: {{{grid}, rounding: signround}}
  activations: null
ignore: ["lm_head", "re:.*embed_tokens"]
""")
    code, _, err = run_cli("calibrate", d / "m", "-c", tmp_path / "r.yaml", "--data", d / "ids.safetensors",
                           "--sequential", "-o", tmp_path / "out")
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1 and "signround" in lines[0] and why in lines[0], err
    assert not (tmp_path / "out").exists()


def test_gguf_types_learn_rounding_on_the_grid_the_file_stores(tmp_path):
    """A GGUF mix (Q2_K: Q2_K with minima, Q3_K signed, sub-block scales under float16 super-block scales) learns
    codes on the grid the file stores: the ranges stay the search's, every block ends below nearest's loss, the
    model ends closer to float, and the file llama.cpp reads holds exactly the fake-quant weights."""
    from tests.test_gguf import _tiny_llama

    _tiny_llama(tmp_path / "m", False, hidden=256)  # K-quants need rows of 256
    ids = torch.randint(1, 300, (16, 32), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    summaries = {}
    for name, rounding in (("learned", LEARNED), ("nearest", "nearest")):
        (tmp_path / f"{name}.yaml").write_text(f"""version: 1
gguf_mix: q2_k
defaults:
  weights: {{analyzer: mse, rounding: {rounding}}}
  activations: null
""")
        code, out, err = run_cli("quantize", tmp_path / "m", "-c", tmp_path / f"{name}.yaml", "--data",
                                 tmp_path / "ids.safetensors", "--batch-size", "4", "--sequential", "--format", "gguf",
                                 "--json", "-o", tmp_path / name)
        assert code == 0, err
        summaries[name] = json.loads(out)["gguf"]
    learned, nearest = (tmp_path / "learned" / "calibration", tmp_path / "nearest" / "calibration")
    assert summaries["learned"]["tensor_types"] == summaries["nearest"]["tensor_types"]
    assert {"Q2_K", "Q3_K"} <= set(summaries["learned"]["tensor_types"])
    assert summaries["learned"]["max_weight_deviation"] == 0.0  # the file's weights are the fake-quant model's
    # the grid is the search's: ranges, scales and offsets as round-to-nearest stores them
    assert (learned / "encodings.safetensors").read_bytes() == (nearest / "encodings.safetensors").read_bytes()
    blocks = json.loads((learned / "manifest.json").read_text())["signround"]["blocks"]
    assert len(blocks) == 2 and all(b["losses"][b["chosen"]] < 0.8 * b["losses"]["nearest"] for b in blocks), blocks
    import transformers

    import qtool

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
    errors = {}
    for name, run in (("learned", learned), ("nearest", nearest)):
        model = qtool.load_calibrated(str(tmp_path / "m"), str(run / "encodings.json"))
        with torch.no_grad():
            errors[name] = float((model(input_ids=ids).logits - ref(input_ids=ids).logits).pow(2).mean())
    assert errors["learned"] < 0.8 * errors["nearest"], errors


@pytest.mark.parametrize("grid", ["element: fp4_e2m1, granularity: per_block, block_size: 16, scale_dtype: fp8_e4m3",
                                  "element: fp4_e2m1, granularity: per_block, block_size: 32, scale_dtype: e8m0"],
                         ids=["nvfp4", "mxfp4"])
def test_float_element_grids_learn_rounding_on_the_analyzers_scales(llama, tmp_path, grid):
    """On NVFP4 and MXFP4 the offsets move codes on the element grid; the scales (FP8, E8M0) stay the analyzer's,
    and the model ends closer to float than round-to-nearest's."""
    d, _ = llama
    for name, rounding in (("learned", LEARNED), ("nearest", "nearest")):
        (tmp_path / f"{name}.yaml").write_text(f"""version: 1
defaults:
  weights: {{{grid}, rounding: {rounding}}}
  activations: null
ignore: ["lm_head", "re:.*embed_tokens"]
""")
        code, _, err = run_cli("calibrate", d / "m", "-c", tmp_path / f"{name}.yaml", "--data", d / "ids.safetensors",
                               "--batch-size", "4", "--sequential", "--quiet", "-o", tmp_path / name)
        assert code == 0, err
    learned, nearest = _entries(tmp_path / "learned"), _entries(tmp_path / "nearest")
    def ranges(entries):
        return {n: (e["min"], e["max"]) for n, e in entries.items()}

    assert ranges(learned) == ranges(nearest)
    blocks = json.loads((tmp_path / "learned" / "manifest.json").read_text())["signround"]["blocks"]
    assert all(b["losses"][b["chosen"]] < b["losses"]["nearest"] for b in blocks), blocks
    assert _logit_error(d, tmp_path / "learned") < _logit_error(d, tmp_path / "nearest")


def test_with_weighted_ranges_and_no_steps_the_codes_are_round_to_nearest_on_the_searched_grid(llama, tmp_path):
    """``weighting: activations`` gives a signround row its layer's input statistics for the range search, and
    nothing else: no layer-wise algorithm touches its codes, so with no steps they are nearest's on that grid."""
    d, _ = llama
    (tmp_path / "r.yaml").write_text("""version: 1
defaults:
  weights: {bitwidth: 3, granularity: per_block, block_size: 16, analyzer: {name: mse, weighting: activations},
            rounding: {name: signround, iterations: 0}}
  activations: null
ignore: ["lm_head", "re:.*embed_tokens"]
""")
    code, _, err = run_cli("calibrate", d / "m", "-c", tmp_path / "r.yaml", "--data", d / "ids.safetensors",
                           "--batch-size", "4", "--sequential", "--quiet", "-o", tmp_path / "out")
    assert code == 0, err
    weights = load_file(str(d / "m" / "model.safetensors"))
    entries = _entries(tmp_path / "out")
    for key, c in load_file(str(tmp_path / "out" / "codes.safetensors")).items():
        name = key.removeprefix("codes/")
        step = (torch.tensor(entries[name]["max"]) / 3).repeat_interleave(16, dim=1)
        assert torch.equal(c.to(torch.float32), torch.clamp(torch.round(weights[name] / step), -4, 3)), name
    blocks = json.loads((tmp_path / "out" / "manifest.json").read_text())["signround"]["blocks"]
    assert all(b["chosen"] == "nearest" and b["iterations"] == 0 for b in blocks)


def test_rows_with_their_own_arguments_learn_as_a_problem_of_their_own(llama, tmp_path):
    """A ``layers:`` entry that changes signround's arguments for some of a block's layers makes those layers a
    learning problem of their own (the manifest names its rows); none is left with the first row's arguments."""
    d, _ = llama
    (tmp_path / "r.yaml").write_text("""version: 1
defaults:
  weights: {bitwidth: 3, granularity: per_block, block_size: 16, rounding: {name: signround, iterations: 20}}
  activations: null
layers:
  - match: "re:.*mlp.*"
    weights: {bitwidth: 3, granularity: per_block, block_size: 16,
            rounding: {name: signround, iterations: 5, seed: 7, ranges: false}}
ignore: ["lm_head", "re:.*embed_tokens"]
""")
    code, _, err = run_cli("calibrate", d / "m", "-c", tmp_path / "r.yaml", "--data", d / "ids.safetensors",
                           "--batch-size", "4", "--sequential", "--quiet", "-o", tmp_path / "out")
    assert code == 0, err
    blocks = json.loads((tmp_path / "out" / "manifest.json").read_text())["signround"]["blocks"]
    assert [(b["block"], b["iterations"]) for b in blocks] == [
        ("model.layers.0", 20), ("model.layers.0", 5), ("model.layers.1", 20), ("model.layers.1", 5)]
    assert all(r.split(".")[3] == "mlp" for b in blocks if b["iterations"] == 5 for r in b["rows"])
    # the settings in effect, defaults resolved (the learning rate 1 / iterations unless given)
    assert [(b["learning_rate"], b["seed"], b["ranges"]) for b in blocks] == [(1 / 20, 0, True), (1 / 5, 7, False)] * 2
    assert all(b["losses"][b["chosen"]] <= b["losses"]["nearest"] for b in blocks)
