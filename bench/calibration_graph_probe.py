"""W8A8 calibration on a GPU: the eager activation pass against the one qtool replays as a CUDA graph.

On a GPU, calibrating the reference MLP (bench/calibrate_overhead.py: 8 x (Linear(1024, 1024) + ReLU), 32 batches
of 64, W8A8 per tensor) took 8-14x a float pass eagerly: each of the 264 quantizer calls launches ~30 small
kernels. qtool.calibration.graphs records the calibrating forward once per batch shape and replays it (this file
was its probe: 2.9x and 3.8x on an H200). Here the pass runs both ways on the same model and batches
(``graphs.ENABLED`` off and on), timed beside a plain float pass, and every activation range of the replayed run
must be bit-equal to the eager run's. Run on a GPU:

    python3 bench/calibration_graph_probe.py        # writes bench/results/calibration_graph_probe.json

Exit code 1 if the replay was refused or any range differs.
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

from qtool.calibration import graphs, in_memory  # noqa: E402
from qtool.config import parse_recipe, resolve_plan  # noqa: E402
from qtool.data import Batch, CalibrationData  # noqa: E402
from qtool.model.insert import insert_quantizers  # noqa: E402


def main() -> int:
    if len(sys.argv) > 1:  # (no options: --help ran the benchmark)
        print(__doc__.strip(), file=sys.stderr if sys.argv[1:] not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if sys.argv[1:] in (["-h"], ["--help"]) else 2
    if not torch.cuda.is_available():
        print("no CUDA device: this probe measures CUDA graphs on a GPU", file=sys.stderr)
        return 2
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
        for way in ("eager", "graph replay"):
            best = None
            for _ in range(4):
                model = mlp().to(dev)
                plan = resolve_plan(parse_recipe(RECIPE.format(gran=gran)), model)
                qs = insert_quantizers(model, plan)
                graphs.ENABLED = way == "graph replay"
                results = []
                try:
                    t = timed(lambda: results.append(in_memory.calibrate(model, plan, qs, data, dev)))
                finally:
                    graphs.ENABLED = True
                replay = results[0].replay
                if way == "graph replay" and (replay is None or replay.refused):
                    print(f"{gran}: the replay was not used or the capture was refused")
                    bad += 1
                best = t if best is None or t < best else best
            times[way] = best
            ranges[way] = {n: (q.min.detach().cpu(), q.max.detach().cpu()) for n, q in qs.items()
                           if q.is_initialized()}
        same = ranges["eager"].keys() == ranges["graph replay"].keys() and all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            for a, b in zip(ranges["eager"].values(), (ranges["graph replay"][k] for k in ranges["eager"])))
        bad += not same
        rows.append({"case": f"W8A8 {gran}", "float_s": t_float, "eager_s": times["eager"],
                     "graph_s": times["graph replay"], "eager_ratio": times["eager"] / t_float,
                     "graph_ratio": times["graph replay"] / t_float, "ranges_equal": same,
                     "quantizers": len(ranges["eager"])})
    name = torch.cuda.get_device_name(dev)
    print(f"calibration of the reference MLP on {name}: float pass {t_float * 1e3:.1f} ms")
    for r in rows:
        print(f"  {r['case']:<18} eager {r['eager_s'] * 1e3:7.1f} ms ({r['eager_ratio']:.1f}x)  graph replay "
              f"{r['graph_s'] * 1e3:7.1f} ms ({r['graph_ratio']:.1f}x)  ranges {'equal' if r['ranges_equal'] else 'DIFFER'}"
              f" ({r['quantizers']} quantizers)")
    out = ROOT / "bench/results/calibration_graph_probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
