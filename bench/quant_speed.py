"""QDQ speed of qtool's quantize_dequantize against torch.fake_quantize_per_channel_affine on one tensor.

Prints a table and writes bench/results/quant_speed.json. Every figure is a ratio to torch's fused per-channel
fake-quant measured in the same run (absolute times drift on shared machines).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from qtool.quant import quantize_dequantize


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def run(size: int = 4096, repeats: int = 7, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    x = torch.randn(size, size, device=device)
    out_ch = torch.rand(size, device=device) * 0.01 + 0.001
    zp = torch.zeros(size, dtype=torch.int32, device=device)
    cases = {
        "torch.fake_quantize_per_channel_affine": lambda: torch.fake_quantize_per_channel_affine(
            x, out_ch, zp, 0, -128, 127),
        "qtool per-tensor": lambda: quantize_dequantize(
            x, torch.tensor(0.01, device=device), torch.tensor(0.0, device=device), 8, True),
        "qtool per-channel": lambda: quantize_dequantize(
            x, out_ch[:, None], torch.zeros(size, 1, device=device), 8, True),
        "qtool blockwise (block 32)": lambda: quantize_dequantize(
            x, torch.rand(size, size // 32, device=device) * 0.01 + 0.001,
            torch.zeros(size, size // 32, device=device), 4, True, block_size=(1, 32)),
    }
    with torch.no_grad():
        times = {name: _time(fn, repeats) for name, fn in cases.items()}
    base = times["torch.fake_quantize_per_channel_affine"]
    return {
        "bench": "quant_speed",
        "tensor": [size, size],
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "rows": [{"case": k, "seconds": v, "ratio_to_torch_per_channel": v / base} for k, v in times.items()],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "quant_speed.json"))
    args = ap.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch sees no CUDA device (a CPU build, or no GPU here)")
    result = run(args.size, args.repeats, args.device)
    print(f"QDQ on a {args.size}x{args.size} float32 tensor ({result['device']}, {result['threads']} threads)")
    print(f"{'case':<42}{'best s':>10}{'ratio':>8}")
    for r in result["rows"]:
        print(f"{r['case']:<42}{r['seconds']:>10.4f}{r['ratio_to_torch_per_channel']:>8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
