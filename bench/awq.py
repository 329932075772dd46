"""AWQ and learned rounding on SmolLM2-135M-Instruct: RTN, AWQ, GPTQ, AWQ + GPTQ, SignRound and AWQ + SignRound
for int4 weights (asymmetric, blocks of 64: AWQ's
usual scheme at a block size that divides SmolLM2's 576-wide rows; 128 does not), perplexity float beside
fake-quant on held-out Python documentation (the calibration text's kind) and on CPython's LICENSE (another
kind), with calibration time and peak RSS per method. Calibration: 32 windows of 256 tokens of Python docs.
SignRound rows (``rounding: signround``, ``--iterations`` steps per block) run ``--sequential``, as they must.

    .venv/bin/python bench/awq.py [--methods rtn,awq,gptq,awq+gptq,signround,awq+signround] [--bits 4]
        [--block 64] [--symmetric] [--weighted] [--iterations 200] [--out bench/results/awq.json]

Each method calibrates in a child process (its peak RSS is its own). Rows go to the JSON as they finish.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

METHODS = {"rtn": ("nearest", False), "awq": ("nearest", True), "gptq": ("gptq", False),
           "awq+gptq": ("gptq", True), "signround": ("signround", False), "awq+signround": ("signround", True)}


def _recipe(tmp: Path, method: str, bits: int, block: int, symmetric: bool, iterations: int,
            weighted: bool = False) -> Path:
    rounding, awq = METHODS[method]
    analyzer = "{name: mse, weighting: activations}" if weighted else "minmax"
    if rounding == "signround":
        rounding = f"{{name: signround, iterations: {iterations}}}"
    path = tmp / f"{method.replace('+', '-')}.yaml"
    path.write_text(f"""version: 1
defaults:
  weights: {{bitwidth: {bits}, symmetric: {str(symmetric).lower()}, granularity: per_block, block_size: {block},
             analyzer: {analyzer}, rounding: {rounding}}}
  activations: null
ignore: ["lm_head", "re:.*embed_tokens"]
""" + ("awq: {grid: 20}\n" if awq else ""))
    return path


def _child(ckpt: str, recipe: str, data: str, out: str) -> None:
    """Calibrate in this process; print the seconds and the peak RSS as one JSON line."""
    from qtool.pipeline import CalibrateOptions, run_calibrate

    t0 = time.perf_counter()
    sequential = "signround" in Path(recipe).read_text()
    run_calibrate(ckpt, recipe, out, CalibrateOptions(data=data, seq_len=256, num_samples=32, batch_size=8,
                                                      sequential=sequential), overwrite=True)
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss_gb": _peak_rss() / 1e9}))


def _peak_rss() -> int:
    """This process's peak resident set size in bytes: VmHWM, which starts afresh at exec (``ru_maxrss`` keeps the
    peak of the forked parent's pages from before it, here the parent's loaded float model)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="rtn,awq,gptq,awq+gptq")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--symmetric", action="store_true")
    ap.add_argument("--weighted", action="store_true",
                    help="ranges from the activation-weighted MSE search (the shipped -gptq recipes' analyzer)")
    ap.add_argument("--iterations", type=int, default=200, help="signround's steps per block")
    ap.add_argument("--out", default=str(REPO / "bench/results/awq.json"))
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(*args.child)

    import qtool
    from accuracy import _perplexity
    from qtool.data import load_data
    from qtool.example import text_split
    from qtool.model.load import load_model
    from smollm2 import smollm2_dir

    tmp = Path(tempfile.mkdtemp(prefix="qtool-awq-"))
    ckpt = smollm2_dir()
    calib, held = text_split(300, 300)
    (tmp / "calib.txt").write_text("\n\n".join(calib))
    (tmp / "docs.txt").write_text("\n\n".join(held))
    licence = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "LICENSE.txt"
    (tmp / "licence.txt").write_text(licence.read_text())
    loaded = load_model(ckpt)
    texts = {name: list(load_data(tmp / f, batch_size=8, seq_len=256, tokenizer=loaded.tokenizer, pack_text=True,
                                  num_samples=12, seed=0))
             for name, f in (("python docs (held out)", "docs.txt"), ("CPython LICENSE (another kind)", "licence.txt"))}
    floats = {name: _perplexity(loaded.model, b)[0] for name, b in texts.items()}
    del loaded
    kind = "symmetric" if args.symmetric else "asymmetric"
    grid = ", weighted MSE ranges" if args.weighted else ", min-max ranges"
    result = {"model": "SmolLM2-135M-Instruct", "scheme": f"int{args.bits} {kind}, blocks of {args.block}{grid}",
              "signround_iterations": args.iterations,
              "calibration": "32 windows of 256 tokens of pydoc_data.topics", "float": floats, "rows": []}
    print(f"{'method':<10} {'text':<32} {'ppl float':>9} {'quant':>9} {'increase':>9} {'calib s':>8} {'peak GB':>8}")
    for method in args.methods.split(","):
        recipe = _recipe(tmp, method, args.bits, args.block, args.symmetric, args.iterations, args.weighted)
        out = tmp / f"run-{method.replace('+', '-')}"
        r = subprocess.run([sys.executable, __file__, "--child", str(ckpt), str(recipe), str(tmp / "calib.txt"),
                            str(out)], capture_output=True, text=True)
        if r.returncode:
            print(f"{method}: failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
            continue
        cost = json.loads(r.stdout.strip().splitlines()[-1])
        model = qtool.load_calibrated(str(ckpt), str(out / "encodings.json"))
        row = {"method": method, **cost, "perplexity": {}}
        manifest = json.loads((out / "manifest.json").read_text())
        if "awq" in manifest:
            groups = manifest["awq"]["groups"]
            row["awq_scaled_groups"] = sum(g["ratio"] is not None for g in groups)
            row["awq_groups"] = len(groups)
        for name, batches in texts.items():
            ppl = _perplexity(model, batches)[0]
            row["perplexity"][name] = ppl
            print(f"{method:<10} {name:<32} {floats[name]:>9.3f} {ppl:>9.3f} {100 * (ppl / floats[name] - 1):>+8.2f}% "
                  f"{cost['seconds']:>8.1f} {cost['peak_rss_gb']:>8.2f}", flush=True)
        result["rows"].append(row)
        del model
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
