"""Data-free GGUF mixes: qtool's time against llama.cpp's own quantizer, same tensors and types (SmolLM2-135M).

For each llama-quantize mix (``gguf-<mix>``, no data):

* **qtool, command**: ``qtool quantize SMOLLM2 -c gguf-<mix> --format gguf`` in a fresh process, wall seconds
  (Python start, checkpoint load, the sub-block scale search, snapping, packing, writing the file);
* **qtool, quantizer**: per weight, with the GGUF type qtool's file holds for it, what calibration and export do
  to that tensor in-process: the least-squares sub-block search (``GgmlQuantizeDequantize`` with the ``mse``
  analyzer weighted by magnitude, as the data-free recipes have it), the stored grid, the codes and the packed
  bytes;
* **llama.cpp**: ``ggml_quantize_chunk`` (what llama-quantize calls; from the ``xllamacpp`` wheel, through
  ctypes) on the same tensor and type without an importance matrix, its rows split over as many threads as torch
  uses here (llama-quantize splits rows over threads the same way).

Beside each type's times, the magnitude-weighted squared error (the data-free search's objective, sub-blocks of
32) of both quantizers' bytes against the float weights, dequantized by gguf-py. Ratios are measured in one run
(absolute times drift on a shared machine). ``--gptq`` adds the ``-gptq`` mixes'
command times (calibration data, ``--sequential``) to the table. Prints a table and writes
bench/results/gguf_speed.json.

    .venv/bin/python bench/gguf_speed.py [--mixes q4_k_m,q2_k] [--gptq]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def _command(args):
    """Wall seconds of one ``qtool`` command in a fresh process, and its ``--json`` summary."""
    t0 = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).parent / "qtool"), *args, "--json"], check=True,
                          capture_output=True, text=True)
    return time.perf_counter() - t0, json.loads(done.stdout)


def _tensor_types(out: Path, summary, state) -> Dict[str, str]:
    """Checkpoint key → GGUF type of every quantized weight in qtool's file."""
    import gguf

    to_key = {v: k for k, v in summary["names"].items() if k in state}  # (a tied output layer is the embedding)
    reader = gguf.GGUFReader(out / "model.gguf")
    types = {}
    for t in reader.tensors:
        name = gguf.GGMLQuantizationType(t.tensor_type).name
        if name not in ("F32", "F16", "BF16") and t.name in to_key:
            types[to_key[t.name]] = name
    return types


def qtool_quantizer(w: torch.Tensor, type_name: str) -> np.ndarray:
    from qtool.quant import ggml
    from qtool.quant.analysis.mse import MseEncodingAnalyzer
    from qtool.quant.quantizer import GgmlQuantizeDequantize

    t = ggml.ggml_type(type_name)
    shape = (w.shape[0], w.shape[1] // t.sub)
    # the data-free mixes' analyzer (gguf-q4_k_m.yaml, gguf-q2_k.yaml): mse weighted by magnitude
    q = GgmlQuantizeDequantize(shape, t, MseEncodingAnalyzer(shape, (1, t.sub), weighting="magnitude"), (1, t.sub))
    with q.compute_encodings():
        q.observe(w)  # as calibration feeds a weight: statistics only
    grid = q.grid()
    return ggml.pack(ggml.quantize_codes(w, grid), grid).numpy()


def weighted_error(w: torch.Tensor, packed: np.ndarray, type_name: str) -> float:
    """``Σ (rms + |w|)·(dequantized − w)²`` over every sub-block of 32 (``rms`` the sub-block's): the data-free
    search's own objective, for bytes of either quantizer, dequantized by gguf-py."""
    import gguf

    from qtool.quant.analysis.mse import magnitude_weights

    values = torch.from_numpy(gguf.quants.dequantize(packed, getattr(gguf.GGMLQuantizationType, type_name)))
    rows = w.reshape(-1, 32)
    return float((magnitude_weights(rows) * (values.reshape(-1, 32) - rows) ** 2).sum(dtype=torch.float64))


def llama_cpp_quantizer(lib, w: torch.Tensor, type_name: str, pool: ThreadPoolExecutor, threads: int) -> np.ndarray:
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = w.shape
    src = np.ascontiguousarray(w.numpy())
    dst = np.zeros(rows * cols // block * size, dtype=np.uint8)
    row_bytes = cols // block * size
    per = -(-rows // threads)

    def part(start: int):  # ctypes releases the GIL: the threads run side by side
        n = min(per, rows - start)
        lib.ggml_quantize_chunk(int(qtype), src.ctypes.data, dst.ctypes.data, start * cols, n, cols, None)
        return n * row_bytes

    list(pool.map(part, range(0, rows, per)))
    return dst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixes", default="q4_k_m,q2_k")
    ap.add_argument("--gptq", action="store_true", help="also time the -gptq mixes (with data, --sequential)")
    ap.add_argument("--out", default=str(REPO / "bench/results/gguf_speed.json"))
    args = ap.parse_args(argv)

    from safetensors.torch import load_file

    from gguf_kquants import _ggml
    from qtool.example import text_split
    from smollm2 import smollm2_dir

    ckpt = smollm2_dir()
    lib = _ggml()
    state = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state.update(load_file(str(f)))
    threads = torch.get_num_threads()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(threads) as pool:
        tmp = Path(tmp)
        for mix in args.mixes.split(","):
            out = tmp / mix
            cmd = ["quantize", str(ckpt), "-c", f"gguf-{mix}", "--format", "gguf", "-o", str(out),
                   "--quiet"]
            command, summary = _command(cmd)
            types = _tensor_types(out, summary, state)
            mine = theirs = 0.0
            by_type: Dict[str, list] = {}
            for key, type_name in types.items():
                w = state[key].to(torch.float32).contiguous()
                t0 = time.perf_counter()
                ours = qtool_quantizer(w, type_name)
                t1 = time.perf_counter()
                llamas = llama_cpp_quantizer(lib, w, type_name, pool, threads)
                t2 = time.perf_counter()
                mine, theirs = mine + (t1 - t0), theirs + (t2 - t1)
                acc = by_type.setdefault(type_name, [0, 0, 0.0, 0.0, 0.0, 0.0])
                acc[0], acc[1], acc[2], acc[3] = acc[0] + 1, acc[1] + w.numel(), acc[2] + t1 - t0, acc[3] + t2 - t1
                acc[4] += weighted_error(w, ours, type_name)
                acc[5] += weighted_error(w, llamas, type_name)
            per_type = {k: {"tensors": a[0], "weights": a[1], "qtool_s": a[2], "llama_cpp_s": a[3],
                            "ratio": a[2] / a[3], "qtool_error": a[4], "llama_cpp_error": a[5],
                            "error_ratio": a[4] / a[5] if a[5] else float("nan")} for k, a in sorted(by_type.items())}
            row = {"mix": mix, "per_type": per_type, "llama_cpp_s": theirs, "qtool_quantizer_s": mine,
                   "qtool_command_s": command, "quantizer_ratio": mine / theirs, "command_ratio": command / theirs}
            if args.gptq:
                calib, _ = text_split(300, 300)
                (tmp / "calib.txt").write_text("\n\n".join(calib))
                row["qtool_gptq_command_s"] = _command(
                    ["quantize", str(ckpt), "-c", f"gguf-{mix}-gptq", "--format", "gguf", "-o", str(tmp / f"{mix}-g"),
                     "--data", str(tmp / "calib.txt"), "--seq-len", "256", "--num-samples", "32", "--sequential",
                     "--quiet"])[0]
            rows.append(row)
            for k, a in per_type.items():
                print(f"  {k:7s} {a['tensors']:4d} tensors {a['weights'] / 1e6:6.1f} M weights: llama.cpp "
                      f"{a['llama_cpp_s']:.2f} s, qtool {a['qtool_s']:.2f} s ({a['ratio']:.1f}x); weighted error "
                      f"qtool / llama.cpp {a['qtool_error']:.4g} / {a['llama_cpp_error']:.4g} = {a['error_ratio']:.3f}")
            print(f"{mix}: llama.cpp {theirs:.2f} s, qtool quantizer {mine:.2f} s ({mine / theirs:.2f}x), "
                  f"qtool command {command:.1f} s ({command / theirs:.1f}x)", flush=True)

    print(f"\nData-free GGUF mixes on SmolLM2-135M, same tensors and types ({threads} threads each)")
    print(f"{'mix':8s} {'llama.cpp s':>11s} {'qtool quant s':>13s} {'ratio':>6s} {'qtool cmd s':>11s} "
          f"{'ratio':>6s}" + (f" {'-gptq cmd s':>11s}" if args.gptq else ""))
    for r in rows:
        print(f"{r['mix']:8s} {r['llama_cpp_s']:11.2f} {r['qtool_quantizer_s']:13.2f} {r['quantizer_ratio']:6.2f} "
              f"{r['qtool_command_s']:11.1f} {r['command_ratio']:6.1f}"
              + (f" {r['qtool_gptq_command_s']:11.1f}" if args.gptq else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": threads, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
