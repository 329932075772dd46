"""GPTQ's column loop on a GPU: replayed as one CUDA graph per sub-block against launched step by step.

For each Llama-3-8B layer shape (q/o 4096 -> 4096, k/v 4096 -> 1024, gate/up 4096 -> 14336, down 14336 -> 4096)
and three grids (int4 symmetric in blocks of 32 along the input with act-order, int8 per channel, FP4 E2M1 in
blocks of 16), ``gptq_codes`` runs on the device twice: with ``gptq.CUDA_GRAPHS`` on (the default) and off. Prints
the seconds of each, microseconds per input column, and whether the codes are equal (they must be, bit for bit:
the graph replays the loop's own kernels). Random weights; the Hessian from 4096 correlated random tokens.

    python3 bench/gptq_columns.py                 # on cuda (~1 min on an H200)
    python3 bench/gptq_columns.py --device cpu --scale 8   # the script itself, shapes divided by 8

Exit code 1 if any codes differ. Writes bench/results/gptq_columns.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qtool.calibration.rounding import gptq  # noqa: E402
from qtool.quant.affine import adjust_min_max, grid, min_max_to_scale_offset, reduce_to_shape  # noqa: E402
from qtool.quant.floatgrid import ELEMENTS  # noqa: E402

SHAPES = {"q_proj / o_proj": (4096, 4096), "k_proj / v_proj": (1024, 4096), "gate / up": (14336, 4096),
          "down_proj": (4096, 14336)}


def _problem(out: int, inn: int, dev: torch.device, tokens: int = 4096):
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(out, inn, generator=g, device=dev) * 0.02
    x = torch.randn(tokens, inn, generator=g, device=dev) * (torch.rand(inn, generator=g, device=dev) * 3 + 0.1)
    x = x + 0.3 * x.roll(1, dims=1)  # correlated neighbours: error feedback matters
    return w, x.T @ x


def _grid(name: str, w: torch.Tensor):
    out, inn = w.shape
    if name == "int4 block 32":
        qmin, qmax = grid(4, True)
        mn, mx = reduce_to_shape(w, (out, inn // 32), (1, 32))
        mn, mx = adjust_min_max(mn, mx, qmax - qmin, True)
        s, o = min_max_to_scale_offset(mn, mx, qmin, qmax, True)
        return dict(scale=s, offset=o, qmin=qmin, qmax=qmax, block_size=(1, 32), act_order=True)
    if name == "int8 per channel":
        qmin, qmax = grid(8, True)
        mn, mx = reduce_to_shape(w, (out, 1), None)
        mn, mx = adjust_min_max(mn, mx, qmax - qmin, True)
        s, o = min_max_to_scale_offset(mn, mx, qmin, qmax, True)
        return dict(scale=s, offset=o, qmin=qmin, qmax=qmax, block_size=None, act_order=False)
    element = ELEMENTS["fp4_e2m1"]
    amax = w.abs().reshape(out, inn // 16, 16).amax(-1)
    s = (amax / element.max).clamp(min=1e-12)
    return dict(scale=s, offset=torch.zeros_like(s), qmin=0, qmax=0, block_size=(1, 16), act_order=True,
                element=element)


def _run(w, h, g, graphs: bool, dev) -> tuple:
    gptq.CUDA_GRAPHS = graphs
    args = dict(g)
    scale, offset, qmin, qmax, bs = (args.pop(k) for k in ("scale", "offset", "qmin", "qmax", "block_size"))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    codes = gptq.gptq_codes(w, h, scale, offset, qmin, qmax, bs, **args)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return codes, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=int, default=1, help="divide every layer dimension by this (a quick look)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gptq_columns.json"))
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or with --device cpu (--scale 8 keeps it short)", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    # warm-up: cuBLAS/cuSOLVER handles and the first graph capture are not the loop's cost
    w, h = _problem(256, 256, dev)
    for graphs in (False, True):
        _run(w, h, _grid("int4 block 32", w), graphs, dev)
    rows, bad = [], 0
    print(f"GPTQ column loop on {name} (torch {torch.__version__})")
    print(f"{'layer':<18}{'grid':<18}{'launched s':>11}{'graph s':>9}{'µs/col launched':>17}{'µs/col graph':>14}"
          f"{'speed-up':>10}{'codes':>9}")
    for layer, (out, inn) in SHAPES.items():
        out, inn = out // args.scale, inn // args.scale
        w, h = _problem(out, inn, dev)
        for gname in ("int4 block 32", "int8 per channel", "fp4 e2m1 block 16"):
            g = _grid(gname, w)
            eager, t_eager = _run(w, h, g, False, dev)
            replayed, t_graph = _run(w, h, g, True, dev)
            same = bool(torch.equal(eager, replayed))
            differ = int((eager != replayed).sum())
            bad += not same
            rows.append({"layer": layer, "out": out, "in": inn, "grid": gname, "launched_s": t_eager,
                         "graph_s": t_graph, "us_per_column_launched": 1e6 * t_eager / inn,
                         "us_per_column_graph": 1e6 * t_graph / inn, "codes_equal": same, "codes_differing": differ})
            print(f"{layer:<18}{gname:<18}{t_eager:>11.3f}{t_graph:>9.3f}{1e6 * t_eager / inn:>17.1f}"
                  f"{1e6 * t_graph / inn:>14.1f}{t_eager / t_graph:>9.1f}x{'equal' if same else f'{differ} differ':>9}")
    gptq.CUDA_GRAPHS = True
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}" + (f"; {bad} case(s) with different codes" if bad else "; codes equal in every case"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
