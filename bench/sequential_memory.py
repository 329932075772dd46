"""Memory and time per decoder block of ``qtool calibrate --sequential`` on a Llama-shaped checkpoint (TinyLlama's
shape by default: 1.1B parameters, hidden 2048, MLP 5632, 22 layers, 32 heads, 4 KV heads; random fp16 weights),
with GPTQ W4A16 and W8A8, then a written extrapolation to 8B and 70B shapes.

Not part of ``make bench`` (minutes per block on 2 cores). Run it by hand::

    .venv/bin/python bench/sequential_memory.py                       # 1.1B, both recipes (~30 min on 2 cores)
    .venv/bin/python bench/sequential_memory.py --layers 4 --recipes w8a8   # a quick look
    .venv/bin/python bench/sequential_memory.py --recipes w8a8,gguf-q4_0 --export qtool,compressed-tensors,gguf

Each recipe runs in a child process (so its peak RSS, ``ru_maxrss``, is its own) that records, as each block
finishes, the seconds since calibration started, VmRSS and RssAnon (``/proc/self/status``). What a finished
block leaves behind shows as RSS growing from block to block; flat RSS means memory is bounded by one block.
With ``--export``, each finished run is then exported (``qtool export``, a child process each) to the formats
that hold its grid, recording wall time, peak RSS and bytes written. Prints a table and writes
``bench/results/sequential_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from scale import count_params, write_checkpoint  # noqa: E402

GB = 1e9
TINYLLAMA = {"hidden": 2048, "intermediate": 5632, "heads": 32, "kv_heads": 4, "vocab": 32000, "layers": 22}
# the shapes the extrapolation is for (public configurations)
LLAMA3_8B = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256, "layers": 32}
LLAMA3_70B = {"hidden": 8192, "intermediate": 28672, "heads": 64, "kv_heads": 8, "vocab": 128256, "layers": 80}
# SmolLM2-135M's shape (bench/gptq_vs_llmcompressor.py's model; random weights here, so no download is needed)
SMOLLM2 = {"hidden": 576, "intermediate": 1536, "heads": 9, "kv_heads": 3, "vocab": 49152, "layers": 30}
SHAPES = {"tinyllama": TINYLLAMA, "smollm2": SMOLLM2}


def _status(device: str = "cpu") -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":", 1)[0]
            if k in ("VmRSS", "RssAnon"):
                out[k] = int(line.split()[1]) * 1024
    if device.startswith("cuda"):
        import torch

        out["cuda_allocated"] = torch.cuda.memory_allocated()
        out["cuda_peak"] = torch.cuda.max_memory_allocated()
    return out


def child(ckpt: str, recipe: str, data: str, out: str, device: str = "cpu") -> None:
    """Calibrate in this process, printing one JSON line per finished block."""
    from qtool.hooks import Hooks
    from qtool.pipeline import CalibrateOptions, run_calibrate

    t0 = [None]

    def stage(text: str) -> None:
        if text == "calibrating":
            t0[0] = time.perf_counter()

    def block(done: int, total: int) -> None:
        print(json.dumps({"block": done, "of": total, "s": time.perf_counter() - t0[0], **_status(device)}),
              flush=True)

    t_start = time.perf_counter()
    run_calibrate(ckpt, recipe, out, CalibrateOptions(data=data, sequential=True, device=device),
                  hooks=Hooks(on_block=block, on_stage=stage))
    print(json.dumps({"done": True, "s": time.perf_counter() - t0[0], "process_s": time.perf_counter() - t_start,
                      **_status(device)}), flush=True)


def run_recipe(ckpt: Path, recipe: str, data: Path, out: Path, device: str = "cpu") -> Dict[str, object]:
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, __file__, "--child", str(ckpt), recipe, str(data), str(out), device],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    blocks: List[Dict[str, float]] = []
    total = None
    for line in p.stdout:
        row = json.loads(line)
        if row.get("done"):
            total = row
        else:
            blocks.append(row)
            gpu = f"  GPU peak {row['cuda_peak'] / GB:.2f} GB" if "cuda_peak" in row else ""
            print(f"  {recipe}: block {row['block']}/{row['of']}  {row['s']:.0f} s  RSS {row['VmRSS'] / GB:.2f} GB"
                  f"{gpu}", flush=True)
    _, status, usage = os.wait4(p.pid, 0)
    err = p.stderr.read()
    if status != 0:
        raise SystemExit(f"{recipe}: calibrate failed:\n{err[-2000:]}")
    rss = [b["VmRSS"] for b in blocks]
    times = [b["s"] for b in blocks]
    per_block_s = (times[-1] - times[0]) / max(1, len(times) - 1)
    growth = (rss[-1] - rss[1]) / max(1, len(rss) - 2) if len(rss) > 2 else 0.0
    return {"recipe": recipe, "device": device, "blocks": blocks, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "peak_cuda_bytes": total.get("cuda_peak"), "wall_s": time.perf_counter() - t,
            "calibrate_s": total["s"], "load_and_calibrate_s": total["process_s"], "seconds_per_block": per_block_s,
            "rss_growth_per_block_bytes": growth, "rss_after_first_block": rss[0], "rss_after_last_block": rss[-1]}


def compatible(recipe: str, fmt: str) -> bool:
    """GGUF holds llama.cpp's block types (the gguf-* recipes) and only those formats hold them."""
    return (fmt == "gguf") == recipe.startswith("gguf-")


def run_export(ckpt: Path, run: Path, fmt: str, out: Path) -> Dict[str, object]:
    """``qtool export`` of a finished run in a child process: its wall time, peak RSS and the bytes written."""
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "qtool", "export", str(ckpt), "-e", str(run / "encodings.json"),
                          "-o", str(out), "--format", fmt, "--quiet"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _, status, usage = os.wait4(p.pid, 0)
    err = p.stderr.read()
    if status != 0:
        raise SystemExit(f"export --format {fmt}: failed:\n{err[-2000:]}")
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"format": fmt, "wall_s": time.perf_counter() - t, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "bytes": written}


def _add_tokenizer(ckpt: Path) -> None:
    """GGUF needs a tokenizer beside the weights: a byte-level BPE trained on Python's own documentation (as
    tests/test_gguf.py makes one; only the file layout matters here, the bench never runs the GGUF)."""
    import pydoc_data.topics
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [v.encode("ascii", "ignore").decode() for v in list(pydoc_data.topics.topics.values())[:100]]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                         eos_token="<|endoftext|>").save_pretrained(ckpt)


def block_bytes(s: Dict[str, int], samples: int, seq_len: int) -> Dict[str, float]:
    """What one block needs while it calibrates (float32): its weights, the layer-input Hessians GPTQ keeps (one
    per distinct input: hidden x hidden for q/k/v and gate/up, hidden x hidden for o, MLP x MLP for down) and the
    captured hidden states, twice (inputs and outputs)."""
    h, i = s["hidden"], s["intermediate"]
    kv = s["kv_heads"] * (h // s["heads"])
    weights = 4 * (2 * h * h + 2 * kv * h + 3 * h * i)
    hessians = 4 * (3 * h * h + i * i)
    activations = 2 * 4 * samples * seq_len * h
    return {"weights": weights, "hessians": hessians, "activations": activations}


def extrapolate(result: Dict[str, object], samples: int, seq_len: int) -> List[Dict[str, object]]:
    """Per recipe and shape, an estimate (not a measurement): the runtime's own memory (RSS after the first block
    less that block's needs) stays; everything above it at the peak (weights, Hessians, activations and the
    algorithm's temporaries, all sized by the block) scales with the block's needs (block_bytes). Time per block
    scales with ``_work`` (GPTQ: out x in x in over the block's layers) from the measured seconds per block."""
    rows = []
    base_shape = result["shape"]
    base_need = sum(block_bytes(base_shape, samples, seq_len).values())
    for r in result["runs"]:
        gptq = "gptq" in r["recipe"]
        runtime = max(0.0, r["rss_after_first_block"] - base_need)
        for name, shape in (("Llama-3-8B", LLAMA3_8B), ("Llama-3-70B", LLAMA3_70B)):
            need = block_bytes(shape, samples, seq_len)
            per_block = r["seconds_per_block"] * _work(shape, gptq) / _work(base_shape, gptq)
            peak = runtime + (r["peak_rss_bytes"] - runtime) * sum(need.values()) / base_need
            gpu = r.get("peak_cuda_bytes")  # one block's weights, statistics and activations on the GPU
            rows.append({"recipe": r["recipe"], "model": name, "params": count_params(shape),
                         "est_peak_rss_gb": peak / GB, "est_seconds_per_block": per_block,
                         "est_peak_gpu_gb": None if gpu is None else gpu * sum(need.values()) / base_need / GB,
                         "est_hours": per_block * shape["layers"] / 3600,
                         "block_needs_gb": {k: v / GB for k, v in need.items()}})
    return rows


def _work(s: Dict[str, int], gptq: bool) -> float:
    """A block's cost up to a constant: GPTQ's out x in x in over its layers, else its weight count (a forward
    pass over the same tokens)."""
    h, i = s["hidden"], s["intermediate"]
    kv = s["kv_heads"] * (h // s["heads"])
    if not gptq:
        return 2 * h * h + 2 * kv * h + 3 * h * i
    return (2 * h * h + 2 * kv * h + 2 * h * i) * h + h * i * i


def main(argv=None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama",
                    help="tinyllama (1.1B, the default) or smollm2 (135M)")
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the shape's, 22 or 30)")
    ap.add_argument("--device", default="cpu", help="where calibration runs (cpu, cuda)")
    ap.add_argument("--recipes", default="w4a16-block32-gptq,w8a8", help="comma-separated recipes")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--workdir", default=None, help="where the checkpoint and runs go (default: $TMPDIR)")
    ap.add_argument("--out", default=str(HERE / "results" / "sequential_memory.json"))
    ap.add_argument("--export", default="", help="comma-separated formats each finished run is exported to "
                    "(qtool, compressed-tensors, gguf: each run to the formats that hold its grid)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return {}
    import torch
    from safetensors.torch import save_file

    base = SHAPES[args.shape]
    shape = {**base, "layers": args.layers or base["layers"]}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        info = write_checkpoint(work / "ckpt", shape)
        ids = torch.randint(0, shape["vocab"], (args.samples, args.seq_len), generator=torch.Generator().manual_seed(0))
        save_file({"input_ids": ids}, work / "ids.safetensors")
        print(f"checkpoint: {info['params'] / 1e9:.2f}B parameters, {args.samples} x {args.seq_len} tokens")
        formats = [f for f in args.export.split(",") if f]
        if "gguf" in formats:
            _add_tokenizer(work / "ckpt")
        runs = []
        for r in args.recipes.split(","):
            runs.append(run_recipe(work / "ckpt", r, work / "ids.safetensors", work / f"run-{r}", args.device))
            runs[-1]["exports"] = [run_export(work / "ckpt", work / f"run-{r}", f, work / f"export-{r}-{f}")
                                   for f in formats if compatible(r, f)]
            for e in runs[-1]["exports"]:
                print(f"  {r}: export --format {e['format']}: {e['wall_s']:.1f} s, peak RSS "
                      f"{e['peak_rss_bytes'] / GB:.2f} GB, {e['bytes'] / GB:.2f} GB written", flush=True)
                shutil.rmtree(work / f"export-{r}-{e['format']}")
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "gpu": gpu},
              "device": args.device,
              "shape": shape, "params": info["params"], "samples": args.samples, "seq_len": args.seq_len,
              "runs": runs}
    result["extrapolation"] = extrapolate(result, args.samples, args.seq_len)
    print(f"\n{args.shape} shape, {shape['layers']} blocks, device {args.device}" + (f" ({gpu})" if gpu else ""))
    print(f"{'recipe':<22} {'s/block':>8} {'calib s':>8} {'RSS blk1 GB':>12} {'RSS last GB':>12} "
          f"{'growth MB/blk':>14} {'peak GB':>8} {'GPU peak GB':>12}")
    for r in runs:
        cuda = f"{r['peak_cuda_bytes'] / GB:>12.2f}" if r["peak_cuda_bytes"] is not None else f"{'-':>12}"
        print(f"{r['recipe']:<22} {r['seconds_per_block']:>8.2f} {r['load_and_calibrate_s']:>8.1f} "
              f"{r['rss_after_first_block'] / GB:>12.2f} {r['rss_after_last_block'] / GB:>12.2f} "
              f"{r['rss_growth_per_block_bytes'] / 1e6:>14.1f} {r['peak_rss_bytes'] / GB:>8.2f} {cuda}")
    exports = [(r["recipe"], e) for r in runs for e in r.get("exports", [])]
    if exports:
        print(f"\n{'export':<22} {'format':<20} {'s':>8} {'peak RSS GB':>12} {'written GB':>11}")
        for recipe, e in exports:
            print(f"{recipe:<22} {e['format']:<20} {e['wall_s']:>8.1f} {e['peak_rss_bytes'] / GB:>12.2f} "
                  f"{e['bytes'] / GB:>11.2f}")
    print(f"\n{'extrapolation':<22} {'model':<12} {'est. peak GB':>13} {'est. GPU GB':>12} {'est. s/block':>13} "
          f"{'est. hours':>11}")
    for e in result["extrapolation"]:
        gpu = f"{e['est_peak_gpu_gb']:>12.1f}" if e["est_peak_gpu_gb"] is not None else f"{'-':>12}"
        print(f"{e['recipe']:<22} {e['model']:<12} {e['est_peak_rss_gb']:>13.1f} {gpu} "
              f"{e['est_seconds_per_block']:>13.1f} {e['est_hours']:>11.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
