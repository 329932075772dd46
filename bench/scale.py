"""qtool at scale: weight-only calibrate + export of a synthetic Llama-shaped checkpoint, with wall time, GB/s and
peak RSS, against a plain safetensors read + write of the same checkpoint (the I/O floor).

Not part of ``make bench`` (it writes many GB and takes minutes). Run it by hand::

    .venv/bin/python bench/scale.py                    # ~3B parameters (fp16: ~6 GB on disk), several minutes
    .venv/bin/python bench/scale.py --params 2e8       # a quick run (~0.4 GB)
    .venv/bin/python bench/scale.py --params 7e9 --workdir /big/disk --keep

Steps (each a subprocess, so peak RSS is the real one, from ``wait4``'s ``ru_maxrss``):

1. write a synthetic HF checkpoint (``config.json`` of a ``LlamaForCausalLM``, fp16 safetensors shards with
   ``model.safetensors.index.json``), tensor by tensor from a seeded generator, never the whole model in memory;
2. ``floor``: safetensors ``load_file`` + ``save_file`` of every shard (plain read + write), and a tensor-at-a-time
   copy (``safe_open().get_tensor`` + a streaming writer) -- the faster one is the floor;
3. for ``configs/w8a16.yaml`` (int8 per-channel) and ``configs/w4a16-block32.yaml`` (int4 block 32):
   ``qtool calibrate`` then ``qtool export``, through the real CLI (``python -m qtool``).

A watchdog kills a child whose RSS passes ``--rss-cap`` (default: the machine's available memory less 2 GiB) so a
run that would exhaust memory is reported as such instead of taking the machine down. ``--breakdown`` also runs
weight-only calibration step by step in a child and reports the RSS after each step (where the memory goes).
Prints a table and writes ``bench/results/scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GB = 1e9
GIB = 1 << 30
MIN_AVAILABLE = int(1.5 * GIB)


# ----------------------------------------------------------------------------------------------------------------
# The synthetic checkpoint
# ----------------------------------------------------------------------------------------------------------------
def llama_shape(params: float, vocab: int = 32000) -> Dict[str, int]:
    """A Llama-family shape close to ``params`` parameters (untied embeddings, grouped-query attention).

    Width and MLP size follow the public Llama configurations (3072/8192 as Llama 3.2 3B, 4096/14336 as Llama 3 8B,
    8192/28672 as Llama 2/3 70B); the layer count is chosen to land nearest to ``params``."""
    if params < 1e9:
        hidden, inter = 1024, 2816
    elif params < 5e9:
        hidden, inter = 3072, 8192
    elif params < 2.5e10:
        hidden, inter = 4096, 14336
    else:
        hidden, inter = 8192, 28672
    heads = hidden // 128
    kv = min(8, heads)
    shape = {"hidden": hidden, "intermediate": inter, "heads": heads, "kv_heads": kv, "vocab": vocab, "layers": 1}
    per_layer = count_params({**shape, "layers": 2}) - count_params(shape)
    base = count_params({**shape, "layers": 0})
    shape["layers"] = max(1, round((params - base) / per_layer))
    return shape


def tensor_specs(s: Dict[str, int]) -> List[tuple]:
    """(name, shape) of every tensor, in the order HF's LlamaForCausalLM names them."""
    h, i, v = s["hidden"], s["intermediate"], s["vocab"]
    kv_dim = s["kv_heads"] * (h // s["heads"])
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(s["layers"]):
        p = f"model.layers.{n}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv_dim, h)),
                (p + "self_attn.v_proj.weight", (kv_dim, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def count_params(s: Dict[str, int]) -> int:
    total = 0
    for _, shape in tensor_specs(s):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def write_checkpoint(out: Path, s: Dict[str, int], shard_bytes: float = 5e9, seed: int = 0) -> Dict[str, object]:
    """A HF directory: config.json, fp16 shards of at most ``shard_bytes`` and model.safetensors.index.json."""
    import torch

    from qtool.io.st_writer import StreamingSafetensorsWriter

    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(s)
    shards: List[list] = [[]]
    size = 0
    for name, shape in specs:
        nb = 2 * _numel(shape)
        if shards[-1] and size + nb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nb
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    g = torch.Generator().manual_seed(seed)
    chunk = 1 << 22
    weight_map = {}
    for file, shard in zip(files, shards):
        layout = [(name, torch.float16, shape) for name, shape in shard]
        with StreamingSafetensorsWriter(out / file, layout, {"format": "pt"}) as w:
            for name, shape in shard:
                t = torch.empty(shape, dtype=torch.float16)
                flat = t.view(-1)
                if len(shape) == 1:  # RMSNorm weights: around 1
                    flat.copy_(1.0 + 0.05 * torch.randn(flat.numel(), generator=g))
                else:
                    std = 0.02
                    for a in range(0, flat.numel(), chunk):
                        b = min(flat.numel(), a + chunk)
                        flat[a:b] = torch.randn(b - a, generator=g) * std
                w.write(name, t)
                del t, flat
                weight_map[name] = file
    total = sum(2 * _numel(shape) for _, shape in specs)
    if n > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"], "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "vocab_size": s["vocab"],
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    largest = max(specs, key=lambda x: _numel(x[1]))
    return {"files": files, "float_bytes": total, "params": count_params(s),
            "largest_tensor": {"name": largest[0], "shape": list(largest[1]), "bytes_fp16": 2 * _numel(largest[1]),
                               "bytes_fp32": 4 * _numel(largest[1])}}


# ----------------------------------------------------------------------------------------------------------------
# Measured subprocesses
# ----------------------------------------------------------------------------------------------------------------
def _rss(pid: int) -> Dict[str, int]:
    """VmRSS, RssAnon (the process's own memory) and RssFile (file pages it maps, e.g. safetensors mmaps: page
    cache the kernel can drop) in bytes."""
    out = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k = line.split(":", 1)[0]
                if k in out:
                    out[k] = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return out


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(cmd: List[str], cap: Optional[int] = None, env: Optional[dict] = None) -> Dict[str, object]:
    """Run ``cmd``; wall time, peak RSS (``ru_maxrss`` from wait4), polled peaks of anonymous and file-backed RSS,
    stderr lines stamped with time and the peaks seen since the previous line, and whether the watchdog killed it
    (RSS above ``cap`` bytes, or the machine's available memory below MIN_AVAILABLE)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env, text=True)
    zero = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    state = {"since": dict(zero), "all": dict(zero), "killed": None, "stages": [], "done": False}
    lock = threading.Lock()

    def poll():
        while not state["done"]:
            r = _rss(p.pid)
            with lock:
                for k, v in r.items():
                    state["since"][k] = max(state["since"][k], v)
                    state["all"][k] = max(state["all"][k], v)
            low = mem_available() < MIN_AVAILABLE  # the machine is shared: never push it into the OOM killer
            if ((cap is not None and r["VmRSS"] > cap) or low) and state["killed"] is None:
                state["killed"] = r["VmRSS"]
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.05)

    def read_err():
        for line in p.stderr:
            line = line.rstrip()
            if not line:
                continue
            with lock:
                peak, state["since"] = state["since"], _rss(p.pid)
            state["stages"].append({"t": round(time.perf_counter() - t0, 2), "line": line[:300],
                                    "peak_rss_before": peak["VmRSS"], "peak_anon_before": peak["RssAnon"],
                                    "peak_file_before": peak["RssFile"]})

    out_lines: List[str] = []

    def read_out():
        out_lines.append(p.stdout.read())

    threads = [threading.Thread(target=f, daemon=True) for f in (poll, read_err, read_out)]
    for t in threads:
        t.start()
    try:
        _, status, ru = os.wait4(p.pid, 0)
    except BaseException:
        p.kill()
        p.wait()
        raise
    wall = time.perf_counter() - t0
    state["done"] = True
    for t in threads[1:]:
        t.join(timeout=10)
    p.returncode = os.waitstatus_to_exitcode(status)
    stages = state["stages"]
    stages.append({"t": round(wall, 2), "line": "(exit)", "peak_rss_before": state["since"]["VmRSS"],
                   "peak_anon_before": state["since"]["RssAnon"], "peak_file_before": state["since"]["RssFile"]})
    return {"cmd": " ".join(str(c) for c in cmd), "rc": p.returncode, "wall_s": wall,
            "peak_rss": ru.ru_maxrss * 1024, "peak_anon": state["all"]["RssAnon"],
            "peak_file": state["all"]["RssFile"], "killed_at_rss": state["killed"], "stages": stages,
            "stdout": "".join(out_lines)}


def _py() -> str:
    return sys.executable


# ----------------------------------------------------------------------------------------------------------------
# Child-process jobs (python bench/scale.py _job ...)
# ----------------------------------------------------------------------------------------------------------------
def _job_floor(src: Path, dst: Path, mode: str) -> None:
    """Plain safetensors read + write of every shard (``file``: load_file/save_file per shard; ``tensor``: one
    tensor at a time through safe_open and a streaming writer)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    files = sorted(p.name for p in src.glob("*.safetensors"))
    t0 = time.perf_counter()
    for f in files:
        if mode == "file":
            save_file(load_file(str(src / f)), str(dst / f), metadata={"format": "pt"})
        else:
            from qtool.io.st_writer import StreamingSafetensorsWriter
            from qtool.io.checkpoint import ST_DTYPES as _ST_DTYPES

            with safe_open(str(src / f), "pt") as fh:
                keys = list(fh.keys())
                layout = []
                for k in keys:
                    sl = fh.get_slice(k)
                    layout.append((k, _ST_DTYPES[sl.get_dtype()], sl.get_shape()))
                with StreamingSafetensorsWriter(dst / f, layout, {"format": "pt"}) as w:
                    for k in keys:
                        w.write(k, fh.get_tensor(k))
    print(json.dumps({"seconds": time.perf_counter() - t0}))


def evict(path: Path) -> None:
    """Drop ``path``'s files (ours) from the page cache, written back first, so the next read of them is cold."""
    for f in Path(path).rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages would stay cached
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _job_engine(ckpt: str, recipe: str, out: Path) -> None:
    """Weight-only encodings computed tensor by tensor (no model: the plan comes from a meta-device model, each weight
    is read alone and calibrated with qtool's own quantizer), kept in memory, then ``export_integer`` into ``out``.
    Measures the export engine without encodings.json, and what a streaming weight-only calibration would cost."""
    import torch
    import transformers

    from qtool.config import load_recipe, resolve_plan
    from qtool.encodings import EncodingEntry, EncodingsFile
    from qtool.export.qtool_st import export_integer
    from qtool.model.insert import make_quantizer
    from qtool.io.checkpoint import CheckpointTensors

    t0 = time.perf_counter()
    config = transformers.AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    plan = resolve_plan(load_recipe(recipe), model, source=recipe)
    src = CheckpointTensors(Path(ckpt))
    entries = []
    with torch.no_grad():
        for q in plan.weights:
            w = src.get(f"{q.module}.weight").to(torch.float32)
            quantizer = make_quantizer(q)
            with quantizer.compute_encodings():
                quantizer(w)
            entries.append(EncodingEntry.from_quantizer(q, quantizer))
            del w, quantizer
    enc = EncodingsFile(entries, {})
    t1 = time.perf_counter()
    rss_cal = _vm("VmHWM")
    summary = export_integer(Path(ckpt), enc, out)
    t2 = time.perf_counter()
    print(json.dumps({"calibrate_s": t1 - t0, "export_s": t2 - t1, "peak_after_calibrate": rss_cal,
                      "encodings": sum(e.min.numel() for e in entries), "shards": summary["shards"],
                      "files": summary["files"]}))


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _job_breakdown(ckpt: str, recipe: str, out: Path) -> None:
    """Weight-only calibration the way qtool.pipeline._calibrate_into does it, step by step, with the RSS after each
    step and the peak within it (VmHWM, reset between steps)."""
    steps = []
    t = [time.perf_counter()]

    def reset():
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass

    def step(name, **extra):
        now = time.perf_counter()
        steps.append({"step": name, "seconds": round(now - t[0], 2), "rss_after": _vm("VmRSS"),
                      "anon_after": _vm("RssAnon"), "file_after": _vm("RssFile"), "peak_within": _vm("VmHWM"),
                      **extra})
        print(json.dumps(steps[-1]), file=sys.stderr, flush=True)
        reset()
        t[0] = time.perf_counter()

    reset()
    import torch  # noqa: F401

    import qtool.pipeline  # noqa: F401
    import transformers  # noqa: F401

    step("import torch, transformers, qtool")
    from qtool.config import load_recipe, resolve_plan
    from qtool.model.load import load_model

    recipe_obj = load_recipe(recipe)
    loaded = load_model(ckpt, None, "cpu")
    nparams = sum(p.numel() for p in loaded.model.parameters())
    pbytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    step("load_model (transformers from_pretrained, float32)", params=nparams, param_bytes=pbytes)
    plan = resolve_plan(recipe_obj, loaded.model, source=recipe)
    step("resolve_plan", quantizers=len(plan.quantizers))
    from qtool.model.insert import insert_quantizers

    qs = insert_quantizers(loaded.model, plan)
    step("insert_quantizers")
    from qtool.calibration.in_memory import calibrate

    calibrate(loaded.model, plan, qs, None, torch.device("cpu"))
    step("calibrate (weight min/max)")
    from qtool.encodings import EncodingEntry, EncodingsFile

    entries = [EncodingEntry.from_quantizer(q, qs[q.name]) for q in plan.quantizers if qs[q.name].is_initialized()]
    enc = EncodingsFile(entries, {})
    numbers = sum(e.min.numel() for e in entries)
    step("EncodingEntry.from_quantizer (min/max copies)", encodings=numbers)
    obj = enc.to_json()
    step("EncodingsFile.to_json (nested Python lists)", numbers_in_json=4 * numbers)
    text = json.dumps(obj, indent=1) + "\n"
    step("json.dumps(indent=1)", json_bytes=len(text))
    del obj
    (out / "encodings.json").write_text(text)
    del text
    step("write encodings.json (after freeing the text)")
    del enc, entries, qs, plan, loaded
    import gc

    gc.collect()
    step("model freed")
    from qtool.io.fs import sha256_file
    from qtool.io.checkpoint import tensor_files

    for f in tensor_files(Path(ckpt)):
        sha256_file(f)
    step("sha256 of the checkpoint (manifest)")
    from qtool.encodings import EncodingsFile as EF

    EF.read(out / "encodings.json")
    step("EncodingsFile.read (what qtool export does first)")
    print(json.dumps(steps))


# ----------------------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------------------
RECIPES = [("int8 per-channel", "configs/w8a16.yaml"), ("int4 block 32", "configs/w4a16-block32.yaml")]


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _rm(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def run(params: float, workdir: Path, keep: bool, cap: Optional[int], breakdown: Optional[List[str]],
        shard_bytes: float,
        only: Optional[List[str]] = None, calibrate: str = "auto",
        steps: tuple = ("floor", "engine", "cli")) -> Dict[str, object]:
    shape = llama_shape(params)
    exact = count_params(shape)
    work = Path(tempfile.mkdtemp(prefix="qtool-scale-", dir=workdir))
    ckpt = work / "ckpt"
    rows: List[Dict[str, object]] = []
    result: Dict[str, object] = {"bench": "scale", "requested_params": params, "params": exact, "shape": shape,
                                 "machine": platform.machine(), "cpus": os.cpu_count(),
                                 "mem_total": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                                 "rss_cap": cap, "rows": rows,
                                 "notes": "every step starts with the checkpoint evicted from the page cache (cold "
                                          "reads); writes are not fsynced; wall time includes process start"}
    me = str(Path(__file__).resolve())
    try:
        print(f"synthetic LlamaForCausalLM: {exact:,} parameters ({exact / 1e9:.2f}B) "
              f"hidden {shape['hidden']}, intermediate {shape['intermediate']}, {shape['layers']} layers, "
              f"{shape['heads']} heads / {shape['kv_heads']} kv heads, vocab {shape['vocab']}", flush=True)
        t0 = time.perf_counter()
        info = write_checkpoint(ckpt, shape, shard_bytes)
        gen_s = time.perf_counter() - t0
        fb = info["float_bytes"]
        largest = info["largest_tensor"]
        result.update({"checkpoint": {**info, "generate_s": gen_s, "dir_bytes": _du(ckpt)}})
        print(f"checkpoint: {fb / GB:.2f} GB fp16 in {len(info['files'])} shard(s), written in {gen_s:.1f} s; "
              f"largest tensor {largest['name']} {largest['shape']}: {largest['bytes_fp16'] / GB:.3f} GB fp16",
              flush=True)

        def measured(cmd):
            evict(ckpt)
            return measure(cmd, cap)

        def add(case, step, m, extra=None):
            row = {"case": case, "step": step, "wall_s": m["wall_s"], "gb_per_s": fb / GB / m["wall_s"],
                   "peak_rss": m["peak_rss"], "peak_anon": m["peak_anon"], "peak_file": m["peak_file"],
                   "rss_over_largest": m["peak_rss"] - largest["bytes_fp16"],
                   "rc": m["rc"], "killed_at_rss": m["killed_at_rss"], "stages": m["stages"], **(extra or {})}
            if m["rc"] != 0:
                row["error"] = [s["line"] for s in m["stages"]][-4:]
            rows.append(row)
            status = "ok" if m["rc"] == 0 else (f"KILLED at {m['killed_at_rss'] / GB:.1f} GB" if m["killed_at_rss"]
                                                else f"rc {m['rc']}")
            print(f"  {case:<18}{step:<28}{m['wall_s']:>8.1f} s {fb / GB / m['wall_s']:>7.3f} GB/s "
                  f"peak RSS {m['peak_rss'] / GB:>6.2f} GB (anon {m['peak_anon'] / GB:.2f}, file-backed "
                  f"{m['peak_file'] / GB:.2f})  {status}", flush=True)
            return row

        for mode in ("file", "tensor") if "floor" in steps else ():
            dst = work / f"floor-{mode}"
            m = measured([_py(), me, "_floor", str(ckpt), str(dst), mode])
            try:
                copy_s = json.loads(m["stdout"])["seconds"]
            except (ValueError, KeyError):
                copy_s = None
            add("floor", f"safetensors copy ({mode})", m, {"out_bytes": _du(dst), "copy_s": copy_s})
            _rm(dst)
        floor = min((r for r in rows if r["case"] == "floor"), key=lambda r: r["wall_s"], default={"wall_s": None})
        result["floor_s"] = floor["wall_s"]

        for case, recipe in RECIPES:
            if only and not any(o in recipe for o in only):
                continue
            stem = Path(recipe).stem
            run_dir, out_dir = work / f"run-{stem}", work / f"out-{stem}"
            # the engine: streaming weight-only encodings in memory + export_integer, one child process
            out_dir.mkdir()
            m = measured([_py(), me, "_engine", str(ckpt), recipe, str(out_dir)]) if "engine" in steps else None
            extra = {"out_bytes": _du(out_dir)}
            if m and m["rc"] == 0:
                extra.update(json.loads(m["stdout"]))
            r = add(case, "engine (in memory)", m, extra) if m else None
            if m and m["rc"] == 0 and floor["wall_s"]:
                r["export_gb_per_s"] = fb / GB / extra["export_s"]
                r["floor_ratio_export_only"] = extra["export_s"] / (floor.get("copy_s") or floor["wall_s"])
                print(f"  {'':<18}{'':<28}streaming min/max {extra['calibrate_s']:.1f} s (peak RSS "
                      f"{extra['peak_after_calibrate'] / GB:.2f} GB), export_integer {extra['export_s']:.1f} s "
                      f"({fb / GB / extra['export_s']:.3f} GB/s)", flush=True)
            _rm(out_dir)
            # weight-only recipes stream the weights (qtool.sequential.calibrate_weights_streaming): no float32
            # model is built, so "auto" runs calibration at every size
            skip = calibrate == "never"
            if "cli" in steps and skip:
                rows.append({"case": case, "step": "qtool calibrate", "skipped":
                             f"the float32 model alone needs {4 * exact / GB:.1f} GB (cap {cap / GB:.1f} GB)"})
                print(f"  {case:<18}qtool calibrate: skipped (float32 model {4 * exact / GB:.1f} GB)", flush=True)
            elif "cli" in steps:
                m = measured([_py(), "-m", "qtool", "calibrate", str(ckpt), "-c", recipe, "-o", str(run_dir)])
                enc = run_dir / "encodings.json"
                enc_bytes = enc.stat().st_size if enc.exists() else None
                side = run_dir / "encodings.safetensors"
                add(case, "qtool calibrate", m, {"encodings_json_bytes": enc_bytes,
                                                 "encodings_sidecar_bytes": side.stat().st_size if side.exists()
                                                 else None})
                if m["rc"] == 0:
                    m = measured([_py(), "-m", "qtool", "export", str(ckpt), "-e", str(run_dir / "encodings.json"),
                                  "-o", str(out_dir), "--json"])
                    extra = {"out_bytes": _du(out_dir) if out_dir.exists() else None}
                    if m["rc"] == 0:
                        sm = json.loads(m["stdout"])
                        extra.update({"shards": sm.get("shards"), "files": len(sm.get("files", []))})
                    r = add(case, "qtool export", m, extra)
                    r["ratio_to_floor"] = r["wall_s"] / floor["wall_s"] if floor["wall_s"] else None
                    _rm(out_dir)
                _rm(run_dir)
            if breakdown is not None and any(b in recipe for b in breakdown):
                bd_dir = work / f"bd-{stem}"
                bd_dir.mkdir()
                m = measured([_py(), me, "_breakdown", str(ckpt), recipe, str(bd_dir)])
                bd_steps = []
                for st in m["stages"]:
                    try:
                        bd_steps.append({**json.loads(st["line"]), "peak_anon_polled": st["peak_anon_before"],
                                         "peak_file_polled": st["peak_file_before"]})
                    except ValueError:
                        if st["line"] != "(exit)":
                            bd_steps.append({"step": "(output) " + st["line"]})
                        elif m["rc"] != 0:
                            bd_steps.append({"step": f"(next step: ended, rc {m['rc']}, after {st['t']} s; peak anon "
                                                     f"{st['peak_anon_before'] / GB:.2f} GB)"})
                result.setdefault("breakdown", {})[case] = {"rc": m["rc"], "peak_rss": m["peak_rss"],
                                                            "killed_at_rss": m["killed_at_rss"], "steps": bd_steps,
                                                            "wall_s": m["wall_s"]}
                _print_breakdown(case, result["breakdown"][case])
                _rm(bd_dir)
    finally:
        if keep:
            print(f"kept {work}")
            result["workdir"] = str(work)
        else:
            _rm(work)
    return result


def _print_breakdown(case: str, bd: Dict[str, object]) -> None:
    print(f"  weight-only calibrate, step by step ({case}); GB; anon = the process's own memory, file = mapped "
          "checkpoint pages")
    print(f"    {'step':<50}{'s':>7}{'peak RSS':>10}{'peak anon':>11}{'RSS after':>11}{'anon after':>12}")
    for s in bd["steps"]:
        if "seconds" not in s:
            print(f"    {s['step'][:110]}")
            continue
        print(f"    {s['step']:<50}{s['seconds']:>7.1f}{s['peak_within'] / GB:>10.2f}"
              f"{s.get('peak_anon_polled', 0) / GB:>11.2f}{s['rss_after'] / GB:>11.2f}{s['anon_after'] / GB:>12.2f}")
    if bd["rc"] != 0:
        what = f"killed at {bd['killed_at_rss'] / GB:.1f} GB RSS" if bd["killed_at_rss"] else f"rc {bd['rc']}"
        print(f"    (then {what})")


def print_table(result: Dict[str, object]) -> None:
    c = result["checkpoint"]
    big = c["largest_tensor"]
    print()
    print(f"{result['params'] / 1e9:.2f}B parameters, {c['float_bytes'] / GB:.2f} GB fp16, largest tensor "
          f"{big['bytes_fp16'] / GB:.3f} GB (fp16); {result['cpus']} CPUs; floor {result['floor_s'] or 0:.1f} s")
    print(f"{'case':<18}{'step':<26}{'wall s':>8}{'GB/s':>8}{'x floor':>9}{'peak RSS GB':>13}{'anon GB':>9}"
          f"{'RSS - largest':>15}")
    for r in result["rows"]:
        if "skipped" in r:
            print(f"{r['case']:<18}{r['step']:<26}  skipped: {r['skipped']}")
            continue
        ratio = r["wall_s"] / result["floor_s"] if result["floor_s"] else float("nan")
        flag = "" if r["rc"] == 0 else ("  KILLED (rss cap)" if r["killed_at_rss"] else f"  failed rc {r['rc']}")
        print(f"{r['case']:<18}{r['step']:<26}{r['wall_s']:>8.1f}{r['gb_per_s']:>8.3f}{ratio:>9.2f}"
              f"{r['peak_rss'] / GB:>13.2f}{r['peak_anon'] / GB:>9.2f}{r['rss_over_largest'] / GB:>15.2f}{flag}")
    eng = [r for r in result["rows"] if r.get("step") == "engine (in memory)" and r["rc"] == 0]
    if eng:
        print("engine rows split: streaming weight-only min/max (no model built), then export_integer alone")
        print(f"{'case':<18}{'min/max s':>10}{'RSS GB':>8}{'export s':>10}{'GB/s':>8}{'x floor':>9}{'peak RSS GB':>13}")
        for r in eng:
            print(f"{r['case']:<18}{r['calibrate_s']:>10.1f}{r['peak_after_calibrate'] / GB:>8.2f}"
                  f"{r['export_s']:>10.1f}{r['export_gb_per_s']:>8.3f}{r['floor_ratio_export_only']:>9.2f}"
                  f"{r['peak_rss'] / GB:>13.2f}")


def main(argv=None) -> Dict[str, object]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_floor":
        return _job_floor(Path(argv[1]), Path(argv[2]), argv[3])
    if argv and argv[0] == "_engine":
        return _job_engine(argv[1], argv[2], Path(argv[3]))
    if argv and argv[0] == "_breakdown":
        return _job_breakdown(argv[1], argv[2], Path(argv[3]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=3e9, help="model size in parameters (default 3e9)")
    ap.add_argument("--workdir", default=None, help="where to write the checkpoint and outputs (default: $TMPDIR)")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--rss-cap", type=float, default=None,
                    help="kill a child above this RSS in GB (default: available memory - 2 GiB)")
    ap.add_argument("--breakdown", action="append", nargs="?", const="", metavar="RECIPE",
                    help="also run weight-only calibration step by step (RSS per step); with a value, only for "
                         "recipes whose path contains it (repeatable)")
    ap.add_argument("--shard-gb", type=float, default=5.0, help="input shard size in GB (default 5, as HF)")
    ap.add_argument("--calibrate", choices=("auto", "always", "never"), default="auto",
                    help="run qtool calibrate (auto = always: weight-only calibration streams the weights)")
    ap.add_argument("--steps", default="floor,engine,cli",
                    help="comma list of: floor, engine, cli (qtool calibrate + export); default all")
    ap.add_argument("--only", action="append", help="only recipes whose path contains this (repeatable)")
    ap.add_argument("--out", default=str(HERE / "results" / "scale.json"))
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: kill the running child, remove the files
    cap = int(args.rss_cap * GB) if args.rss_cap else mem_available() - 2 * GIB
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    need = 2 * 2 * args.params  # checkpoint + one floor copy, fp16
    free = shutil.disk_usage(workdir).free
    if free < need * 1.2:
        sys.exit(f"{workdir}: {free / GB:.1f} GB free, this run needs about {need * 1.2 / GB:.1f} GB")
    result = run(args.params, workdir, args.keep, cap, args.breakdown, args.shard_gb * GB, args.only, args.calibrate,
                 tuple(args.steps.split(",")))
    result["torch_threads"] = _torch_threads()
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return result


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
