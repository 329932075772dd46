"""qtool's peak-memory estimate (qtool.calibration.memory) against the measured peak, tiny and SmolLM2-sized runs.

Each case runs ``qtool calibrate`` in a fresh process and reads its peak resident set size from the kernel
(``wait4``'s ``ru_maxrss``), beside the estimate the library makes for the same checkpoint, recipe, mode and data
options before calibrating. Cases: a tiny Llama (hidden 64, 2 layers; as tests/test_gguf.py builds it), SmolLM2-135M
itself (bench/smollm2.py), and a 4-layer model of SmolLM2's shape (random weights) for the GPTQ modes. Prints a
table and writes bench/results/memory_estimate.json.

    .venv/bin/python bench/memory_estimate.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def measured_peak(args) -> tuple:
    """``(peak bytes, seconds)`` of one ``qtool`` command in a fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "qtool"), *args, "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode()
    if status != 0:
        raise SystemExit(f"qtool {' '.join(args)} failed: {err[-400:]}")
    return usage.ru_maxrss * 1024, time.perf_counter() - t0


def estimated_peak(ckpt: Path, recipe: str, mode: str, batch_size: int, seq_len: int, num_samples) -> int:
    from qtool.calibration.memory import estimate_memory
    from qtool.config import load_recipe, resolve_plan
    from qtool.model.hf import meta_causal_lm

    model, _, _ = meta_causal_lm(str(ckpt), False)
    plan = resolve_plan(load_recipe(recipe), model, source=recipe)
    return estimate_memory(model, plan, mode, batch_size, seq_len, num_samples, causal=True).peak


def _smollm2_shaped(dest: Path, src: Path, layers: int) -> Path:
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(src)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, dest / name)
    return dest


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench/results/memory_estimate.json"))
    args = ap.parse_args(argv)

    import pydoc_data.topics

    from smollm2 import smollm2_dir
    from tests.test_gguf import _tiny_llama

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "calib.txt").write_text("\n\n".join(list(pydoc_data.topics.topics.values())[:300]))
        tiny = _tiny_llama(tmp / "tiny", False)
        smol = smollm2_dir()
        shaped = _smollm2_shaped(tmp / "smol4", smol, 4)
        data = ["--data", str(tmp / "calib.txt"), "--seq-len", "256", "--batch-size", "8"]
        cases = [
            ("tiny", tiny, "gguf-q4_k_m", "streaming", [], None),
            ("tiny", tiny, "w8a8", "in_memory", data + ["--num-samples", "16"], 16),
            ("tiny", tiny, "w4a16-block32-gptq", "in_memory", data + ["--num-samples", "16"], 16),
            ("tiny", tiny, "w4a16-block32-gptq", "sequential", data + ["--num-samples", "16", "--sequential"], 16),
            ("SmolLM2-135M", smol, "gguf-q4_k_m", "streaming", [], None),
            ("SmolLM2-135M", smol, "w8a8", "in_memory", data + ["--num-samples", "32"], 32),
            ("SmolLM2 shape, 4 layers", shaped, "w4a16-block32-gptq", "in_memory", data + ["--num-samples", "16"], 16),
            ("SmolLM2 shape, 4 layers", shaped, "w4a16-block32-gptq", "sequential",
             data + ["--num-samples", "64", "--sequential"], 64),
        ]
        for name, ckpt, recipe, mode, extra, samples in cases:
            est = estimated_peak(ckpt, recipe, mode, 8, 256, samples)
            peak, secs = measured_peak(["calibrate", str(ckpt), "-c", recipe, "-o", str(tmp / "run"), "--overwrite",
                                        *extra])
            rows.append({"model": name, "recipe": recipe, "mode": mode, "estimate_bytes": est,
                         "measured_bytes": peak, "error_pct": 100 * (est / peak - 1), "seconds": secs})
            print(f"{name:24s} {recipe:20s} {mode:10s} estimate {est / 1e9:5.2f} GB, measured {peak / 1e9:5.2f} GB "
                  f"({rows[-1]['error_pct']:+5.1f} %)", flush=True)
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"\nworst error {worst:.1f} % over {len(rows)} runs (the target: within 30 %)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "worst_error_pct": worst}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
