"""GPTQ calibration speed on a GPU: qtool ``--sequential`` against llm-compressor's sequential pipeline, on the same
Llama-3-8B-shaped decoder blocks, the same token ids and the same GPU.

Made to run once on a lent machine with no network (llm-compressor travels as wheels in ``.whl``, never a
dependency of qtool). The wheels (4.3 MB; the machine has torch 2.11, transformers 5.17, accelerate, safetensors,
numpy, pyarrow but not these), fetched here into a git-ignored ``.whl`` with ``python3 -m pip download --no-deps
--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl NAME==V``:
llmcompressor 0.14.0.1, compressed-tensors 0.19.0, datasets 4.8.5, dill 0.4.1, multiprocess 0.70.19, loguru
0.7.3, pydantic 2.14.3, pydantic-core 2.50.4, annotated-types 0.8.0, typing-inspection 0.4.5,
typing-extensions 4.16.0 (pydantic and its three are what qtool itself needs there). Then, on the machine::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site
    PYTHONUNBUFFERED=1 python3 bench/gptq_gpu_blocks.py                        # 3 blocks, 64 x 2048 tokens
    python3 bench/gptq_gpu_blocks.py --device cpu --shape tiny --layers 2 --samples 2 --seq-len 64   # a CPU check

Model: a random fp16 checkpoint written on the spot (bench/scale.py's ``write_checkpoint``) with Llama-3-8B's block
shape (hidden 4096, MLP 14336, 32 heads, 8 KV heads), ``--layers`` blocks (default 3) and a reduced vocabulary
(``--vocab``, default 32000; lm_head is quantized by neither side). ``--shape tiny`` (hidden 256, MLP 512, 4 heads,
2 KV heads) is for checking the script on a CPU. Data: ``--samples`` x ``--seq-len`` random token ids (default
64 x 2048, seed 0) with an all-ones attention mask, one safetensors file that both sides read, in batches of
``--batch-size`` (default 8) on both sides.

Grid (both sides): int4 symmetric, groups of 32 along the input, min-max ranges, every Linear but lm_head; GPTQ
with blocks of 128 columns, dampening 0.01, static activation order, each block's inputs the quantized earlier
blocks' outputs.

- qtool: ``qtool.pipeline.run_calibrate`` with ``CalibrateOptions(sequential=True, device=...)`` and the explicit
  recipe of bench/gptq_vs_llmcompressor.py (blocks run in float32, one at a time, on the device).
- llm-compressor (0.14.x): ``oneshot(..., pipeline="sequential")`` with ``GPTQModifier`` (the same grid as
  bench/gptq_vs_llmcompressor.py). Placement, as its documentation recommends for a model larger than the GPU
  ("Model Loading" and "Sequential Onloading" guides, and the big-model example that loads Llama-3.3-70B with
  ``device_map=None``): the model is loaded on the CPU (``from_pretrained`` without ``device_map``), and its
  sequential pipeline onloads one decoder layer at a time to the main device (``get_main_device()``: the first
  CUDA device when there is one) through compressed-tensors' offloading, keeping the intermediate activations on
  the CPU between layers (``sequential_offload_device="cpu"``, its default). Loaded in float32 by default
  (``--llmc-dtype``) so both sides run the blocks in the same precision (``float16``: the checkpoint's own).
  With ``--device cpu`` its child runs with ``CUDA_VISIBLE_DEVICES=""`` so it calibrates on the CPU.

``--matmul-precision high`` (TF32 on a GPU; ``medium``: bfloat16 products on a CPU with AMX) runs both sides'
float32 products lower: qtool's model passes through its ``--matmul-precision`` (its statistics' sums and GPTQ
solve stay float32), llm-compressor's whole run through ``torch.set_float32_matmul_precision`` (it has no finer
switch, so its Hessian sums run lower too). The default ``highest`` compares float32 with float32.

Each side runs in its own child process (a fresh CUDA context, its own peak GPU memory) with its libraries
imported before the clock starts. Seconds per block come from one time stamp per finished block, leaving out the
first block (warm-up): ``(t_last - t_first) / (n - 1)``. qtool's stamps come from its ``on_block`` hook.
llm-compressor's pipeline runs subgraphs (the first holds the embedding, each later one a decoder layer, the last
one with the final norm); a wrapper of ``llmcompressor.pipelines.sequential.pipeline._get_batches`` stamps the start
of each, one of ``LifecycleCallbacks.calibration_end`` the end, and a subgraph whose GPTQ solve had modules is a
block, ending where the next starts (its calibration pass, GPTQ solve and propagation pass included). With fewer
than 2 stamps a side's s/block is calibrate seconds / blocks (the JSON's ``per_block_from`` says which). The time
in ``GPTQModifier.compress_modules`` is recorded too (on CUDA llm-compressor's GPTQ update is a Triton kernel,
compiled in the first block). GPU memory: ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``) of
each child.

Prints a table (side, s/block, calibrate s, load + calibrate s, GPU peak GB, qtool / llm-compressor) with the GPU's
name, an extrapolation to 32 blocks (Llama-3-8B: the measured fixed part plus 32 x s/block), and writes ``--out``
(default bench/results/gptq_gpu_blocks.json) after each side, so a side that fails or times out
(``--side-timeout``) leaves the other's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

GB = 1e9
LLAMA3_8B_BLOCKS = 32
SHAPES = {
    "llama3-8b": {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8},
    "tiny": {"hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2},
    "tinyllama": {"hidden": 2048, "intermediate": 5632, "heads": 32, "kv_heads": 4},  # 1.1B's, for a CPU
}
SIDES = ("qtool", "llmcompressor")
QTOOL_RECIPE = ("version: 1\ndefaults:\n  weights: {bitwidth: 4, symmetric: true, granularity: per_block, "
                "block_size: 32, analyzer: minmax, rounding: {name: gptq, block_columns: 128, dampening: 0.01, "
                "act_order: true}}\n  activations: null\nignore: [\"lm_head\"]\n")


# ----------------------------------------------------------------------------------------------------------------
# Children: one side each, one JSON object on the last line of stdout
# ----------------------------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _gpu(device: str) -> Dict[str, object]:
    import torch

    if not device.startswith("cuda"):
        return {"gpu": None, "peak_allocated_bytes": None, "peak_reserved_bytes": None}
    return {"gpu": torch.cuda.get_device_name(0), "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def _per_block(stamps: List[float], calibrate_s: float, blocks: int) -> Dict[str, object]:
    if len(stamps) >= 2:
        return {"seconds_per_block": (stamps[-1] - stamps[0]) / (len(stamps) - 1),
                "per_block_from": "block time stamps, first block left out"}
    return {"seconds_per_block": calibrate_s / max(1, blocks), "per_block_from": "calibrate seconds / blocks"}


def child_qtool(ckpt: str, ids: str, device: str, batch_size: int, workdir: str,
                precision: str) -> Dict[str, object]:
    import torch
    from transformers import AutoModelForCausalLM  # noqa: F401 - imported before the clock, as the other side does

    from qtool.hooks import Hooks
    from qtool.pipeline import CalibrateOptions, run_calibrate

    if device.startswith("cuda"):
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    recipe = Path(workdir) / "qtool-recipe.yaml"
    recipe.write_text(QTOOL_RECIPE)
    t_cal: List[Optional[float]] = [None]
    stamps: List[float] = []

    def stage(text: str) -> None:
        if text == "calibrating" and t_cal[0] is None:
            _sync(device)
            t_cal[0] = time.perf_counter()

    def block(done: int, total: int) -> None:
        _sync(device)
        stamps.append(time.perf_counter())
        print(f"  qtool: block {done}/{total}  {stamps[-1] - t0:.1f} s", flush=True)

    saves = _time_state_saves(device)
    t0 = time.perf_counter()
    run_calibrate(ckpt, str(recipe), str(Path(workdir) / "qtool-run"),
                  CalibrateOptions(data=ids, sequential=True, device=device, batch_size=batch_size,
                                   matmul_precision=precision),
                  overwrite=True, hooks=Hooks(on_block=block, on_stage=stage))
    _sync(device)
    t1 = time.perf_counter()
    calibrate_s = t1 - (t_cal[0] if t_cal[0] is not None else t0)
    import qtool

    return {"side": "qtool", "version": qtool.__version__, "block_stamps_s": [s - t0 for s in stamps],
            "blocks": len(stamps), "calibrate_s": calibrate_s, "load_and_calibrate_s": t1 - t0,
            **_per_block(stamps, calibrate_s, len(stamps)), **_gpu(device),
            "state_save_s": saves}


def _time_state_saves(device: str) -> Optional[List[float]]:
    """Where qtool keeps a resumable state of a sequential run (``qtool.calibration.resume``, each block's results
    and outputs written as the block finishes), the seconds of each save, which are part of its s/block; None
    where this qtool has no such state."""
    try:
        from qtool.calibration import resume
    except ImportError:
        return None
    save = getattr(getattr(resume, "ResumeState", None), "save", None)
    if save is None:
        return None
    seconds: List[float] = []

    def timed_save(self, *args, **kwargs):
        _sync(device)
        a = time.perf_counter()
        out = save(self, *args, **kwargs)
        seconds.append(time.perf_counter() - a)
        return out

    resume.ResumeState.save = timed_save
    return seconds


def child_llmcompressor(ckpt: str, ids: str, device: str, batch_size: int, dtype: str,
                        precision: str) -> Dict[str, object]:
    import importlib.metadata

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.core import LifecycleCallbacks
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.pipelines.sequential import pipeline as seq_pipeline
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    if device.startswith("cuda"):
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    torch.set_float32_matmul_precision(precision)  # every product of the run, its Hessians' too (no finer switch)
    torch.manual_seed(0)
    data = load_file(ids)
    samples, seq_len = data["input_ids"].shape
    ds = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    processor = _stub_tokenizer()

    stamps: List[float] = []  # the start of each subgraph's calibration pass, then the end of calibration
    solve: List[Dict[str, float]] = []  # each GPTQModifier.compress_modules call: subgraph, modules, seconds
    get_batches = seq_pipeline._get_batches

    def timed_batches(activations, num_batches, input_names, desc, *args, **kwargs):
        if str(desc).endswith("Calibrating"):
            _sync(device)
            stamps.append(time.perf_counter())
            print(f"  llmcompressor: subgraph {len(stamps)} starts  {stamps[-1] - t0:.1f} s", flush=True)
        return get_batches(activations, num_batches, input_names, desc, *args, **kwargs)

    seq_pipeline._get_batches = timed_batches
    compress = GPTQModifier.compress_modules

    def timed_compress(self, *args, **kwargs):
        n = len(self._num_samples)  # the modules calibrated since the last solve
        _sync(device)
        a = time.perf_counter()
        out = compress(self, *args, **kwargs)
        _sync(device)
        solve.append({"subgraph": len(stamps) - 1, "modules": n, "s": time.perf_counter() - a})
        return out

    GPTQModifier.compress_modules = timed_compress
    calibration_end = LifecycleCallbacks.calibration_end  # bound to the class

    def timed_end(cls, **kwargs):
        if not ends_at:  # the pipeline's own call, before anything later calls it again
            _sync(device)
            ends_at.append(time.perf_counter())
        return calibration_end(**kwargs)

    ends_at: List[float] = []
    LifecycleCallbacks.calibration_end = classmethod(timed_end)

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype))  # on the CPU: no device_map
    t_load = time.perf_counter()
    recipe = GPTQModifier(
        config_groups={"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
            "observer": "minmax", "actorder": "static"}}},
        ignore=["lm_head"], block_size=128, dampening_frac=0.01)
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=samples, max_seq_length=seq_len,
            batch_size=batch_size, shuffle_calibration_samples=False, pipeline="sequential", processor=processor)
    _sync(device)
    t1 = time.perf_counter()
    layers = model.config.num_hidden_layers
    # a block is a subgraph whose GPTQ solve had modules (the first subgraph holds only the embedding); it ends
    # where the next subgraph starts, the last one where calibration ends
    bounds = stamps + ends_at[:1]
    quantized = [c["subgraph"] for c in solve if c["modules"] > 0]
    ends = [bounds[k + 1] for k in quantized if k + 1 < len(bounds)]
    calibrate_s = t1 - t_load
    versions = {}
    for name in ("llmcompressor", "compressed-tensors", "datasets", "transformers", "accelerate"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"side": "llmcompressor", "version": versions["llmcompressor"], "versions": versions, "dtype": dtype,
            "placement": "model on the CPU; sequential pipeline onloads each layer to get_main_device()",
            "onload_device": str(_llmc_main_device()), "subgraph_stamps_s": [s - t0 for s in bounds],
            "block_stamps_s": [s - t0 for s in ends], "blocks": layers, "quantized_subgraphs": len(quantized),
            "gptq_solves": solve, "gptq_solve_s": sum(c["s"] for c in solve),
            "load_s": t_load - t0, "calibrate_s": calibrate_s, "load_and_calibrate_s": t1 - t0,
            **_per_block(ends, calibrate_s, layers), **_gpu(device)}


def _stub_tokenizer():
    """oneshot wants a processor whenever it is given a dataset, and the random checkpoint has none: a word-level
    tokenizer of three tokens stands in (the dataset is already token ids, so it never tokenizes anything)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def _llmc_main_device():
    try:
        from llmcompressor.utils.dev import get_main_device

        return get_main_device()
    except Exception as e:  # noqa: BLE001 - only a label
        return f"unknown ({e})"


def child(side: str, ckpt: str, ids: str, device: str, batch_size: str, dtype: str, workdir: str,
          precision: str) -> None:
    import torch

    if side == "qtool":
        r = child_qtool(ckpt, ids, device, int(batch_size), workdir, precision)
    else:
        r = child_llmcompressor(ckpt, ids, device, int(batch_size), dtype, precision)
    r.update({"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "device": device})
    print("RESULT " + json.dumps(r), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# The parent: checkpoint, data, both children, table, JSON
# ----------------------------------------------------------------------------------------------------------------
def run_side(side: str, ckpt: Path, ids: Path, args, work: Path) -> Dict[str, object]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if not args.device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = ""  # llm-compressor onloads to the GPU whenever it sees one
    cmd = [sys.executable, __file__, "--child", side, str(ckpt), str(ids), args.device, str(args.batch_size),
           args.llmc_dtype, str(work), args.matmul_precision]
    t = time.perf_counter()
    log = work / f"{side}.log"
    with open(log, "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if args.verbose else err,
                             text=True, cwd=ROOT, env=env)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            p.kill()

        timer = threading.Timer(args.side_timeout, kill)
        timer.start()
        result = None
        try:
            for line in p.stdout:
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT "):])
                elif args.verbose or line.startswith("  "):
                    print(line, end="", flush=True)
            p.wait()
        finally:
            timer.cancel()
    wall = time.perf_counter() - t
    if p.returncode != 0 or result is None:
        tail = log.read_text()[-3000:] if log.exists() else ""
        why = f"killed after {args.side_timeout:.0f} s (--side-timeout)" if killed.is_set() else f"exit {p.returncode}"
        print(f"  {side}: FAILED ({why}, {wall:.0f} s)\n{tail}", flush=True)
        return {"side": side, "error": why, "log_tail": tail, "process_s": wall}
    # stderr lines that matter (warnings from either library) go into the JSON's tail for the record
    result["process_s"] = wall
    result["log_tail"] = log.read_text()[-1500:] if log.exists() else ""
    return result


def extrapolate(r: Dict[str, object], layers: int) -> Dict[str, float]:
    """32 blocks: the measured run's fixed part (load, data, first-block warm-up, writing) plus 32 x s/block."""
    per = r["seconds_per_block"]
    fixed = max(0.0, r["load_and_calibrate_s"] - layers * per)
    return {"blocks": LLAMA3_8B_BLOCKS, "fixed_s": fixed, "est_load_and_calibrate_s": fixed + LLAMA3_8B_BLOCKS * per,
            "est_minutes": (fixed + LLAMA3_8B_BLOCKS * per) / 60}


def report(result: Dict[str, object], out: Path) -> None:
    runs = {r["side"]: r for r in result["runs"]}
    ok = {s: r for s, r in runs.items() if "error" not in r}
    if "qtool" in ok and "llmcompressor" in ok:
        q, l = ok["qtool"], ok["llmcompressor"]
        result["ratio_qtool_over_llmcompressor"] = {
            "seconds_per_block": q["seconds_per_block"] / l["seconds_per_block"],
            "calibrate_s": q["calibrate_s"] / l["calibrate_s"],
            "load_and_calibrate_s": q["load_and_calibrate_s"] / l["load_and_calibrate_s"],
            "peak_gpu": (q["peak_allocated_bytes"] / l["peak_allocated_bytes"]
                         if q.get("peak_allocated_bytes") and l.get("peak_allocated_bytes") else None)}
    for r in ok.values():
        r["extrapolation_32_blocks"] = extrapolate(r, result["shape"]["layers"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def table(result: Dict[str, object]) -> None:
    s = result["shape"]
    gpu = result.get("gpu") or "-"
    print(f"\nGPTQ W4A16 group 32, {result['shape_name']} blocks (hidden {s['hidden']}, MLP {s['intermediate']}), "
          f"{s['layers']} blocks, {result['samples']} x {result['seq_len']} tokens, batch {result['batch_size']}, "
          f"matmul precision {result.get('matmul_precision', 'highest')}, "
          f"device {result['device']} ({gpu}), torch {result['torch']}")
    ratio = result.get("ratio_qtool_over_llmcompressor", {})
    print(f"{'side':<15}{'s/block':>9}{'calibrate s':>13}{'load+calib s':>14}{'GPU peak GB':>13}"
          f"{'32 blocks min':>15}{'qtool/llmc (s/block)':>22}")
    for r in result["runs"]:
        if "error" in r:
            print(f"{r['side']:<15}  failed: {r['error']}")
            continue
        peak = f"{r['peak_allocated_bytes'] / GB:>13.2f}" if r.get("peak_allocated_bytes") else f"{'-':>13}"
        rat = f"{ratio['seconds_per_block']:>22.2f}" if ratio and r["side"] == "qtool" else f"{'':>22}"
        print(f"{r['side']:<15}{r['seconds_per_block']:>9.2f}{r['calibrate_s']:>13.1f}"
              f"{r['load_and_calibrate_s']:>14.1f}{peak}{r['extrapolation_32_blocks']['est_minutes']:>15.1f}{rat}")
    for r in result["runs"]:
        if r.get("state_save_s"):
            saves = r["state_save_s"]
            print(f"qtool kept a resumable state: {sum(saves):.1f} s in {len(saves)} saves "
                  f"({sum(saves[1:]) / max(1, len(saves) - 1):.2f} s a block after the first), inside its s/block")
        if r.get("gptq_solve_s") is not None:
            print(f"llm-compressor: {r['gptq_solve_s']:.1f} s in GPTQModifier.compress_modules "
                  f"(model {r['dtype']}, onload device {r['onload_device']})")
    if ratio:
        print(f"qtool / llm-compressor: {ratio['seconds_per_block']:.2f}x per block, {ratio['calibrate_s']:.2f}x "
              f"calibrate, {ratio['load_and_calibrate_s']:.2f}x load + calibrate"
              + (f", {ratio['peak_gpu']:.2f}x GPU peak" if ratio.get("peak_gpu") else ""))


def main(argv=None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="usage example: python3 bench/gptq_gpu_blocks.py --layers 3 --samples 64 "
                                        "--seq-len 2048")
    ap.add_argument("--device", default="cuda", help="where both sides calibrate (cuda, cpu)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="block shape (tiny: a CPU check)")
    ap.add_argument("--layers", type=int, default=3, help="decoder blocks in the checkpoint (default 3)")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000; Llama-3's is 128256)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8, help="calibration batch, both sides (default 8)")
    ap.add_argument("--sides", default="qtool,llmcompressor", help="comma-separated, run in this order")
    ap.add_argument("--llmc-dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="llm-compressor's model dtype (qtool runs blocks in float32)")
    ap.add_argument("--side-timeout", type=float, default=270.0, help="seconds before a side's child is killed")
    ap.add_argument("--workdir", default=None, help="where the checkpoint goes (default: $TMPDIR)")
    ap.add_argument("--out", default=str(HERE / "results" / "gptq_gpu_blocks.json"))
    ap.add_argument("--verbose", action="store_true", help="show the children's whole output")
    ap.add_argument("--matmul-precision", default="highest", choices=["highest", "high", "medium"],
                    help="float32 products on both sides: qtool's --matmul-precision (its model passes; its own "
                    "sums stay float32), torch.set_float32_matmul_precision for llm-compressor's whole run "
                    "(default highest; high = TF32 on a GPU)")
    ap.add_argument("--child", nargs=8, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return {}
    import torch
    from safetensors.torch import save_file

    from scale import count_params, write_checkpoint

    sides = [s for s in args.sides.split(",") if s]
    for s in sides:
        if s not in SIDES:
            ap.error(f"--sides: {s!r} is not one of {', '.join(SIDES)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    shape = {**SHAPES[args.shape], "vocab": args.vocab, "layers": args.layers}
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    result: Dict[str, object] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "gpu": gpu, "device": args.device, "torch": torch.__version__, "shape_name": args.shape, "shape": shape,
        "samples": args.samples, "seq_len": args.seq_len, "batch_size": args.batch_size,
        "llmc_dtype": args.llmc_dtype, "matmul_precision": args.matmul_precision,
        "grid": "int4 symmetric, group 32, minmax; GPTQ block 128, dampening 0.01, static act order; lm_head ignored",
        "runs": []}
    out = Path(args.out)
    print(f"device {args.device}" + (f" ({gpu})" if gpu else "") + f", torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        info = write_checkpoint(work / "ckpt", shape)
        ids = torch.randint(0, shape["vocab"], (args.samples, args.seq_len),
                            generator=torch.Generator().manual_seed(0))
        save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, str(work / "ids.safetensors"))
        result["params"] = info["params"]
        result["checkpoint_write_s"] = time.perf_counter() - t
        print(f"checkpoint: {shape['layers']} blocks, {count_params(shape) / 1e9:.2f}B parameters (fp16), written in "
              f"{result['checkpoint_write_s']:.1f} s; data {args.samples} x {args.seq_len} tokens", flush=True)
        for side in sides:
            print(f"== {side}", flush=True)
            result["runs"].append(run_side(side, work / "ckpt", work / "ids.safetensors", args, work))
            report(result, out)  # after each side: a later failure keeps this one's figures
    table(result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
