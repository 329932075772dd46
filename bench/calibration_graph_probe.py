"""A probe, not a feature: could static W8A8 calibration on a GPU replay each batch's forward as one CUDA graph?

On a GPU, calibrating the reference MLP (bench/calibrate_overhead.py: 8 x (Linear(1024, 1024) + ReLU), 32 batches
of 64, W8A8 per tensor) takes 12-13x a float pass: each of the 264 quantizer calls launches ~33 small kernels.
Here the activation pass runs three ways on the same model and batches: (a) as qtool runs it, (b) the first two
batches as usual, then the forward recorded once as a CUDA graph (quantizers calibrating) and replayed for every
later batch with the batch copied into the recorded input. It prints the time of each beside a plain float pass,
and whether every activation range of (b) is bit-equal to (a)'s. Run on a GPU:

    python3 bench/calibration_graph_probe.py        # writes bench/results/calibration_graph_probe.json

Exit code 1 if (b) fails to record or any range differs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from calibrate_overhead import RECIPE, mlp  # noqa: E402

from qtool.calibration import collective, in_memory  # noqa: E402
from qtool.config import parse_recipe, resolve_plan  # noqa: E402
from qtool.data import Batch, CalibrationData  # noqa: E402
from qtool.model.insert import insert_quantizers  # noqa: E402


def _graphed_run(model, xs):
    """The activation pass: batches 0 and 1 eagerly, then one recorded forward replayed for batches 2.."""
    def run():
        with torch.no_grad():
            for x in xs[:2]:
                model(x)
            static = xs[2].clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream; batch 1 again: min/max are idempotent
                model(xs[1])
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(static)
            for x in xs[2:]:
                static.copy_(x)
                graph.replay()
    return run


def main() -> int:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, 1024, generator=g).to(dev) for _ in range(32)]
    data = CalibrationData([Batch(args=(x,)) for x in xs], [], 32 * 64, "random")
    float_model = mlp().to(dev)

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def float_pass():
        with torch.no_grad():
            for x in xs:
                float_model(x)

    float_pass()
    t_float = min(timed(float_pass) for _ in range(5))
    rows, bad = [], 0
    for gran in ("per_tensor", "per_channel"):
        ranges, times = {}, {}
        for way in ("as today", "graph replay"):
            best = None
            for _ in range(4):
                model = mlp().to(dev)
                plan = resolve_plan(parse_recipe(RECIPE.format(gran=gran)), model)
                qs = insert_quantizers(model, plan)
                original = collective.calibrate_activations
                if way == "graph replay":
                    collective.calibrate_activations = lambda rows, quantizers, run, m=model: original(
                        rows, quantizers, _graphed_run(m, xs))
                try:
                    t = timed(lambda: in_memory.calibrate(model, plan, qs, data, dev))
                except Exception as e:  # a probe: say what failed
                    print(f"{gran} {way}: {type(e).__name__}: {e}")
                    bad += 1
                    t = float("nan")
                finally:
                    collective.calibrate_activations = original
                best = t if best is None or t < best else best
            times[way] = best
            ranges[way] = {n: (q.min.detach().cpu(), q.max.detach().cpu()) for n, q in qs.items()
                           if q.is_initialized()}
        same = ranges["as today"].keys() == ranges["graph replay"].keys() and all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            for a, b in zip(ranges["as today"].values(), (ranges["graph replay"][k] for k in ranges["as today"])))
        bad += not same
        rows.append({"case": f"W8A8 {gran}", "float_s": t_float, "today_s": times["as today"],
                     "graph_s": times["graph replay"], "today_ratio": times["as today"] / t_float,
                     "graph_ratio": times["graph replay"] / t_float, "ranges_equal": same,
                     "quantizers": len(ranges["as today"])})
    name = torch.cuda.get_device_name(dev)
    print(f"calibration of the reference MLP on {name}: float pass {t_float * 1e3:.1f} ms")
    for r in rows:
        print(f"  {r['case']:<18} as today {r['today_s'] * 1e3:7.1f} ms ({r['today_ratio']:.1f}x)  graph replay "
              f"{r['graph_s'] * 1e3:7.1f} ms ({r['graph_ratio']:.1f}x)  ranges {'equal' if r['ranges_equal'] else 'DIFFER'}"
              f" ({r['quantizers']} quantizers)")
    out = ROOT / "bench/results/calibration_graph_probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
