"""``--matmul-precision``: calibration with the model's products at torch's lower precisions, time and accuracy
beside float32 products (qtool.quant.precision), on this machine or a GPU.

1. **One decoder block's forward** (random weights, 4 x 512 tokens) at each precision, for SmolLM2-135M's,
   TinyLlama 1.1B's and Llama-3-8B's shapes: what a calibration pass can gain (the fastest of 5 runs, the
   precisions taking turns).
2. **SmolLM2-135M-Instruct calibrated** at each precision (32 windows of 256 tokens of Python's docs, batches of
   8): ``--sequential`` GPTQ W4A16 groups of 32 (``w4a16-block32-gptq``) and in-memory static W8A8 (``w8a8``).
   Per run: calibration seconds (in this process, model load included), perplexity on the held-out texts of
   bench/texts.py (32 windows of the docs' kind, 12 of each of two others) with the float model beside, the
   share of GPTQ codes equal to those of ``highest``, and the largest move of an activation range's end (as a
   share of that range's width).

The precisions run are ``highest`` and those the device has units for (``medium`` on a CPU with AMX or
AVX512-BF16, ``high`` = TF32 on a CUDA GPU from Ampere on). Perplexity is always scored at ``highest``.

    .venv/bin/python bench/matmul_precision.py [--device cuda] [--skip-blocks] [--skip-calibration]
        [--out bench/results/matmul_precision.json]          # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SHAPES = {  # hidden, MLP, heads, KV heads
    "SmolLM2-135M": (576, 1536, 9, 3),
    "TinyLlama-1.1B": (2048, 5632, 32, 4),
    "Llama-3-8B": (4096, 14336, 32, 8),
}
RECIPES = {"w4a16-block32-gptq --sequential": ("w4a16-block32-gptq", True), "w8a8 (in memory)": ("w8a8", False)}


def _precisions(device: torch.device):
    from qtool.quant.precision import unsupported

    return ["highest"] + [p for p in ("high", "medium") if unsupported(p, device) is None
                          and not (device.type == "cuda" and p == "medium")]  # (on CUDA medium is TF32 too)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def block_forward(device, precisions):
    import transformers

    from qtool.quant.precision import model_matmuls

    rows = []
    for name, (h, mlp, heads, kv) in SHAPES.items():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=mlp, num_attention_heads=heads,
                                       num_key_value_heads=kv, num_hidden_layers=1, vocab_size=128)
        model = transformers.LlamaForCausalLM(cfg).eval().to(device)
        layer = model.model.layers[0]
        x = torch.randn(4, 512, h, device=device)
        pe = model.model.rotary_emb(x, torch.arange(512, device=device)[None].expand(4, -1))
        row = {"shape": name, **{p: math.inf for p in precisions}}
        with torch.no_grad():
            for p in precisions:  # warm-up (oneDNN's and cuBLAS's first calls)
                with model_matmuls(p):
                    layer(x, position_embeddings=pe)
            for _ in range(5):  # the precisions alternate, so a slow spell of a shared machine hits both
                for p in precisions:
                    with model_matmuls(p):
                        _sync(device)
                        t = time.perf_counter()
                        layer(x, position_embeddings=pe)
                        _sync(device)
                        row[p] = min(row[p], time.perf_counter() - t)
        row.update({f"{p}_speedup": row["highest"] / row[p] for p in precisions[1:]})
        rows.append(row)
        print(f"{name:<16} block forward, 2048 tokens: " + "  ".join(f"{p} {row[p] * 1e3:.1f} ms" for p in precisions)
              + "".join(f"  ({row['highest'] / row[p]:.2f}x)" for p in precisions[1:]), flush=True)
        del model, layer
    return rows


def _perplexity(model, batches, device):
    from qtool.report import _token_nll

    nll, n = 0.0, 0
    with torch.no_grad():
        for b in batches:
            b = b.to(device)
            a, c = _token_nll(model(**b.kwargs).logits, b)
            nll, n = nll + a, n + c
    return math.exp(nll / n)


def _ranges(run: Path):
    doc = json.loads((run / "encodings.json").read_text())
    return {q["name"]: (q["min"], q["max"]) for q in doc["quantizers"] if q["tensor"] != "weight" and "min" in q}


def _range_change(a, b) -> float:
    """The largest move of an activation range's end between two runs, as a share of that range's width."""
    worst = 0.0
    for name, (lo, hi) in a.items():
        lo, hi = torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64)
        lo2, hi2 = (torch.tensor(v, dtype=torch.float64) for v in b[name])
        width = (hi - lo).clamp_min(1e-12)
        worst = max(worst, float((torch.maximum((lo - lo2).abs(), (hi - hi2).abs()) / width).max()))
    return worst


def calibration(device, precisions, tmp: Path):
    from safetensors.torch import load_file

    import qtool
    from qtool.model.load import load_model
    from qtool.pipeline import CalibrateOptions, run_calibrate
    from smollm2 import smollm2_dir
    from texts import batches, header, held_out_texts

    ckpt = smollm2_dir()
    calib, texts = held_out_texts(tmp)
    loaded = load_model(ckpt)
    # 32 windows of the docs' kind, 12 of each other kind (CPython's LICENSE holds about 13 windows of 256 tokens)
    scored = {name: batches(path, loaded.tokenizer, 32 if i == 0 else 12)
              for i, (name, path) in enumerate(texts.items())}
    model = loaded.model.to(device)
    float_ppl = {name: _perplexity(model, bs, device) for name, bs in scored.items()}
    del model, loaded
    print(f"\nSmolLM2-135M perplexity ({header(texts)}): float " + " / ".join(f"{v:.3f}" for v in float_ppl.values()),
          flush=True)
    rows = []
    for label, (recipe, sequential) in RECIPES.items():
        runs = {}
        for p in precisions:
            out = tmp / f"{recipe}-{p}"
            t = time.perf_counter()
            run_calibrate(str(ckpt), recipe, str(out), CalibrateOptions(
                data=str(calib), batch_size=8, seq_len=256, num_samples=32, sequential=sequential,
                device=str(device), matmul_precision=p), overwrite=True)
            secs = time.perf_counter() - t
            q = qtool.load_calibrated(str(ckpt), str(out / "encodings.json"), device=str(device))
            ppl = {name: _perplexity(q, bs, device) for name, bs in scored.items()}
            del q
            row = {"recipe": label, "precision": p, "calibrate_s": secs, "perplexity": ppl}
            if p != "highest":
                base = tmp / f"{recipe}-highest"
                row["calibrate_vs_highest"] = secs / runs["highest"]["calibrate_s"]
                if (base / "codes.safetensors").exists():
                    a, b = load_file(base / "codes.safetensors"), load_file(out / "codes.safetensors")
                    row["codes_equal_share"] = (sum(int((a[k] == b[k]).sum()) for k in a)
                                                / sum(t.numel() for t in a.values()))
                row["max_range_change"] = _range_change(_ranges(base), _ranges(out))
            runs[p] = row
            rows.append(row)
            extra = ""
            if p != "highest":
                extra = (f"  ({row['calibrate_vs_highest']:.2f}x highest's time"
                         + (f", codes equal {100 * row['codes_equal_share']:.2f} %" if "codes_equal_share" in row
                            else "") + f", ranges within {100 * row['max_range_change']:.2f} %)")
            print(f"{label:<34} {p:<8} calibrate {secs:6.1f} s  perplexity "
                  + " / ".join(f"{v:.3f}" for v in ppl.values()) + extra, flush=True)
    return {"float_perplexity": float_ppl, "texts": list(texts), "rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-blocks", action="store_true")
    ap.add_argument("--skip-calibration", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench/results/matmul_precision.json"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    precisions = _precisions(device)
    if len(precisions) == 1:
        raise SystemExit(f"{device}: no lower precision has units here (qtool.quant.precision.unsupported)")
    result = {"device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
              "threads": torch.get_num_threads(), "precisions": precisions}
    if not args.skip_blocks:
        result["block_forward"] = block_forward(device, precisions)
    if not args.skip_calibration:
        with tempfile.TemporaryDirectory() as d:
            result["smollm2"] = calibration(device, precisions, Path(d))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
