"""What a rotation does to each layer's quantization error, seen through the layer's real inputs (docs/accuracy.md).

For a few Linear layers of SmolLM2-135M (its output layer untied, bench/smollm2.py), before and after
``rotate: {rotations: [r1, r2]}``: the relative output error ``‖x (Q(W) − W)ᵀ‖ / ‖x Wᵀ‖`` of NVFP4 and of int4
blocks of 32 (round-to-nearest, absmax scales) on 512 tokens of calibration text, and how peaked the inputs are
(max/rms). Prints a table and writes JSON.

    .venv/bin/python bench/rotation_errors.py [--out bench/results/rotation_errors.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

LAYERS = ("model.layers.5.self_attn.q_proj", "model.layers.5.mlp.gate_proj", "model.layers.5.mlp.down_proj",
          "model.layers.5.self_attn.o_proj", "model.layers.20.mlp.gate_proj", "model.layers.20.mlp.down_proj")


def _nvfp4(w: torch.Tensor) -> torch.Tensor:
    from qtool.quant.floatgrid import element_of, encoding_scales, float_quantize_dequantize

    fp4 = element_of("fp4_e2m1")
    _, eff, _ = encoding_scales(w.abs().reshape(w.shape[0], -1, 16).amax(-1), fp4, "fp8_e4m3")
    return float_quantize_dequantize(w, eff, fp4, (1, 16))


def _int4_block32(w: torch.Tensor) -> torch.Tensor:
    from qtool.quant.affine import quantize_dequantize

    blocks = w.reshape(w.shape[0], -1, 32)
    scale = (blocks.abs().amax(-1) / 7).clamp(min=1e-12)
    return quantize_dequantize(w, scale, torch.zeros_like(scale), qmin=-8, qmax=7, block_size=(1, 32))


def main(argv=None):
    import transformers

    from qtool.calibration.rotation import rotate
    from qtool.config import parse_recipe, resolve_plan
    from qtool.example import text_split
    from smollm2 import smollm2_untied_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench/results/rotation_errors.json"))
    args = ap.parse_args(argv)
    path = smollm2_untied_dir()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    calib, _ = text_split(40, 10)
    ids = tok("\n\n".join(calib), return_tensors="pt").input_ids[:, :512]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()

    def capture():
        modules, seen = dict(model.named_modules()), {}
        hooks = [modules[n].register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, a[0].detach()[0]))
                 for n in LAYERS]
        with torch.no_grad():
            model(ids)
        for h in hooks:
            h.remove()
        return {n: (seen[n], modules[n].weight.detach().clone()) for n in LAYERS}

    before = capture()
    rotate(model, resolve_plan(parse_recipe("version: 1\nrotate: {rotations: [r1, r2]}\n"), model).rotation)
    after = capture()
    rows = []
    print(f"{'layer':36} {'grid':10} {'plain':>8} {'rotated':>8}   inputs max/rms plain -> rotated")
    for n in LAYERS:
        for grid, fake_quant in (("nvfp4", _nvfp4), ("int4 b32", _int4_block32)):
            err = {}
            for tag, (x, w) in (("plain", before[n]), ("rotated", after[n])):
                err[tag] = float((x @ (fake_quant(w) - w).T).norm() / (x @ w.T).norm())
                err[tag + "_peak"] = float(x.abs().max() / x.pow(2).mean().sqrt())
            rows.append({"layer": n, "grid": grid, **err})
            print(f"{n:36} {grid:10} {err['plain']:8.4f} {err['rotated']:8.4f}   "
                  f"{err['plain_peak']:.0f} -> {err['rotated_peak']:.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "SmolLM2-135M-Instruct (untied)", "tokens": int(ids.shape[1]),
                               "metric": "relative output error of the layer, weights fake-quantized",
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
