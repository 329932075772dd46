"""What one calibrating min-max quantizer call costs on the path a GPU takes: tensor operations (each a kernel
launch on a GPU) and time, against a float pass (#53 item 2).

On a GPU the W8A8 calibration of the reference MLP (bench/calibrate_overhead.py: 8 x (Linear(1024) + ReLU), 32
batches of 64) is bound by kernel launches: its cost is the number of small tensor operations each activation
quantizer call runs. On a CPU a per-tensor range is worked out as numbers and the fake-quant's offset is read as a
number; by default both are turned off on a CPU too, and the fake-quant takes the GPU's four kernels, so the CPU
runs the GPU's operations one at a time (``--cpu-path`` keeps the CPU's own). A CPU's time per call then follows
the count only with few rows per batch (``--rows 1``), where an operation costs what its dispatch costs, as a
GPU's launch does; its broadcasting kernels are not vectorized, so with 64 rows the GPU's path is slower there. Graph replay is off (the eager pass
is what the count decides; calibration_graph_probe.py measures the replay).

    .venv/bin/python bench/calibration_calls.py            # writes bench/results/calibration_calls.json

Prints, per case: operations per activation call (from a dispatch mode over one calibrating forward), calibration
seconds, the float pass's seconds and their ratio (best of ``--repeats``, alternating); then one call's scale,
offset and fake-quant by the longer forms against the shorter ones, alternating in the same process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from calibrate_overhead import RECIPE, mlp  # noqa: E402

from qtool.calibration import graphs, in_memory  # noqa: E402
from qtool.config import parse_recipe, resolve_plan  # noqa: E402
from qtool.data import Batch, CalibrationData  # noqa: E402
from qtool.model.insert import insert_quantizers  # noqa: E402
from qtool.quant import affine  # noqa: E402
from qtool.quant.quantizer import QuantizeDequantize  # noqa: E402

FREE = {"aten.view.default", "aten.detach.default", "aten._unsafe_view.default", "aten.alias.default",
        "aten.expand.default", "aten.select.int", "aten.t.default", "aten.unsqueeze.default"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += str(func) not in FREE
        return func(*args, **(kwargs or {}))


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def forms(dev: torch.device, rounds: int = 15, calls: int = 200) -> list:
    """One call's scale, offset and fake-quant from a batch's range, the longer forms (``adjust_min_max``, then
    ``min_max_to_scale_offset``, then six passes) against the short ones (``batch_scale_offset``, then
    ``_qdq_clamped``), alternating in one process: median microseconds per call (the same bits, checked)."""
    import statistics

    rows = []
    for n_rows in (1, 64):
        for symmetric in (False, True):
            x = torch.randn(n_rows, 1024, generator=torch.Generator().manual_seed(n_rows)).to(dev)
            mn, mx = torch.aminmax(x)
            qmin, qmax = (-128, 127) if symmetric else (0, 255)

            def longer():
                s, o = affine.min_max_to_scale_offset(*affine.adjust_min_max(mn, mx, 255, symmetric), qmin, qmax,
                                                      symmetric)
                q = affine._quantize_raw(x, s, o, qmin, qmax)
                return q.add_(o).mul_(s)

            def shorter():
                s, o = affine.batch_scale_offset(mn, mx, qmin, qmax, symmetric)
                return affine._qdq_clamped(x, s, o if qmin == 0 else o + qmin, o + qmax)

            assert torch.equal(longer().view(torch.int32), shorter().view(torch.int32))
            times = {"longer": [], "shorter": []}
            for _ in range(rounds):
                for name, fn in (("longer", longer), ("shorter", shorter)):
                    _sync()
                    t = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    _sync()
                    times[name].append((time.perf_counter() - t) / calls * 1e6)
            a, b = statistics.median(times["longer"]), statistics.median(times["shorter"])
            rows.append({"rows": n_rows, "symmetric": symmetric, "longer_us": a, "shorter_us": b, "ratio": b / a})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu-path", action="store_true", help="on a CPU, keep the CPU's numbers paths")
    ap.add_argument("--out", help="the JSON file (bench/results/calibration_calls[_cuda].json)")
    ap.add_argument("--rows", type=int, default=64, help="rows per batch (64: the reference MLP's; a few rows make "
                    "a CPU's operations cost what their dispatch costs, as a GPU's launches do)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cpu" and not args.cpu_path:
        QuantizeDequantize._min_max_numbers = lambda self, x: False
        affine._uniform_offset = lambda offset: None
        affine._launch_bound = lambda device: True
    graphs.ENABLED = False
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(args.rows, 1024, generator=g).to(dev) for _ in range(32)]
    data = CalibrationData([Batch(args=(x,)) for x in xs], [], 32 * args.rows, "random")
    float_model = mlp().to(dev)

    def float_pass():
        with torch.no_grad():
            for x in xs:
                float_model(x)

    rows = []
    for gran in ("per_tensor", "per_channel"):
        def calibrate(count: bool = False):
            model = mlp().to(dev)
            plan = resolve_plan(parse_recipe(RECIPE.format(gran=gran)), model)
            qs = insert_quantizers(model, plan)
            if count:  # the weights' calibration first, then one calibrating forward counted
                one = CalibrationData([data.batches[0]], [], args.rows, "random")
                in_memory.calibrate(model, plan, qs, one, dev)
                acts = [qs[q.name] for q in plan.static_activations]
                with torch.no_grad():
                    for q in acts:
                        q.encoding_analyzer.reset_stats()
                        q._calibrating = True
                    model(xs[0])  # (creates the analyzers' state)
                    with _Count() as c:
                        model(xs[1])
                    for q in acts:
                        q._calibrating = False
                    with _Count() as f:
                        float_model(xs[1])
                return (c.ops - f.ops) / len(acts)  # the quantizer calls' own operations
            _sync()
            t = time.perf_counter()
            in_memory.calibrate(model, plan, qs, data, dev)
            _sync()
            return time.perf_counter() - t

        ops = calibrate(count=True)
        calibrate()
        float_pass()
        best_cal = best_float = float("inf")
        for _ in range(args.repeats):
            best_cal = min(best_cal, calibrate())
            _sync()
            t = time.perf_counter()
            float_pass()
            _sync()
            best_float = min(best_float, time.perf_counter() - t)
        rows.append({"case": f"W8A8 {gran} weights", "ops_per_activation_call": ops, "calibrate_s": best_cal,
                     "float_s": best_float, "ratio": best_cal / best_float})
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    path = "GPU path" if dev.type == "cuda" or not args.cpu_path else "CPU path"
    print(f"W8A8 calibration of 8 x (Linear(1024) + ReLU), 32 x {args.rows}, eager, on {name}, {path}:")
    print(f"  {'case':<26} {'ops/call':>9} {'calibrate s':>12} {'float s':>9} {'ratio':>7}")
    for r in rows:
        print(f"  {r['case']:<26} {r['ops_per_activation_call']:>9.1f} {r['calibrate_s']:>12.4f} "
              f"{r['float_s']:>9.4f} {r['ratio']:>7.2f}")
    form_rows = forms(dev)
    print(f"one call's scale, offset and fake-quant, longer forms against shorter (median us, {name}):")
    for r in form_rows:
        print(f"  {r['rows']:>3} x 1024 {'symmetric ' if r['symmetric'] else 'asymmetric'}  {r['longer_us']:8.1f} "
              f"{r['shorter_us']:8.1f}  {r['ratio']:.2f}x")
    out = Path(args.out) if args.out else ROOT / "bench/results" / (
        "calibration_calls_cuda.json" if dev.type == "cuda" else "calibration_calls.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "calibration_calls", "device": name, "path": path, "rows_per_batch": args.rows,
                               "torch": torch.__version__, "rows": rows, "forms": form_rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
