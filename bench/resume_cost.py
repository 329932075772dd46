"""What resuming costs: SmolLM2-135M ``calibrate --sequential`` with GPTQ (w4a16-block32-gptq), 32 windows of 256
tokens (bench/gptq_vs_llmcompressor.py's calibration ids), on this machine.

Three runs, each in its own process, through the CLI's library call (``run_calibrate``):

1. uninterrupted, timing every ``ResumeState.save`` (the state a sequential run always keeps: each block's results
   and its outputs for the next block);
2. the same run killed with SIGKILL right after block K's state is saved (K = half the blocks by default);
3. ``--resume`` of run 2, which must write the bytes of run 1.

Prints and writes (bench/results/resume_cost.json): run 1's total and the share of it spent keeping the state;
what a stop costs: the time of runs 2 and 3 together minus run 1 (the work done twice: start-up, model skeleton,
data, the embedding pass, reading the state back), with the resumed run's start before its first block and its
reading of the state measured apart; and whether the bytes are equal.

    .venv/bin/python bench/resume_cost.py [--kill-after 15] [--recipe w4a16-block32-gptq]   # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CHILD = r"""
import json, os, signal, sys, time
sys.path.insert(0, {root!r})
from qtool.calibration import resume, sequential
from qtool.pipeline import CalibrateOptions, run_calibrate

kill_after, spent, saving, blocks_at, restoring = {kill_after}, [0.0], [False], [0.0], [0.0]
calibrate_sequential = sequential.calibrate_sequential

def timed_sequential(*args, **kwargs):  # the work before the first block: skeleton, data, opening the checkpoint
    blocks_at[0] = time.perf_counter()
    return calibrate_sequential(*args, **kwargs)

save, wait = resume.ResumeState.save, resume.ResumeState.wait

def timed_wait(self):  # the run waiting for the last block's files (the waits inside save are timed there)
    t = time.perf_counter()
    wait(self)
    if not saving[0]:
        spent[0] += time.perf_counter() - t

def timed_save(self, i, result, hidden):
    t = time.perf_counter()
    saving[0] = True
    save(self, i, result, hidden)
    saving[0] = False
    spent[0] += time.perf_counter() - t
    if i + 1 == kill_after:
        self.wait()
        os.kill(os.getpid(), signal.SIGKILL)

def timed(read):  # reading the saved blocks and the last one's outputs back
    def timed_read(self, *args):
        t = time.perf_counter()
        try:
            return read(self, *args)
        finally:
            restoring[0] += time.perf_counter() - t
    return timed_read

resume.ResumeState.save = timed_save
resume.ResumeState.block = timed(resume.ResumeState.block)
resume.ResumeState.hidden = timed(resume.ResumeState.hidden)
resume.ResumeState.wait = timed_wait
sequential.calibrate_sequential = timed_sequential
t = time.perf_counter()
run_calibrate({ckpt!r}, {recipe!r}, {out!r}, CalibrateOptions(data={data!r}, batch_size=8, sequential=True,
              resume={resume}), overwrite=True)
print(json.dumps({{"seconds": time.perf_counter() - t, "state_seconds": spent[0], "before_blocks": blocks_at[0] - t,
                  "restoring": restoring[0]}}))
"""


def _run(ckpt, recipe, data, out, kill_after=0, resume=False):
    code = CHILD.format(root=str(ROOT), kill_after=kill_after, ckpt=str(ckpt), recipe=recipe, out=str(out),
                        data=str(data), resume=resume)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if kill_after:
        if r.returncode != -9:
            raise SystemExit(f"the run was to be killed after block {kill_after}: exit {r.returncode}\n{r.stderr[-2000:]}")
        return {"process_s": wall}
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return {"process_s": wall, **json.loads(r.stdout.strip().splitlines()[-1])}


def _start_up(run) -> float:
    """Seconds from the process's start to its first block: the interpreter and imports (the process's time
    outside ``run_calibrate``), then the skeleton, data and checkpoint before the blocks."""
    return run["process_s"] - run["seconds"] + run["before_blocks"]


def main(argv=None) -> None:
    from gptq_vs_llmcompressor import IDS, prepare
    from smollm2 import smollm2_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="w4a16-block32-gptq")
    ap.add_argument("--kill-after", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "bench/results/resume_cost.json"))
    args = ap.parse_args(argv)
    ckpt = smollm2_dir()
    if not IDS.exists():
        prepare()
    with tempfile.TemporaryDirectory(dir=ROOT / "bench/results") as d:
        d = Path(d)
        whole = _run(ckpt, args.recipe, IDS, d / "whole")
        print(f"uninterrupted: {whole['process_s']:.1f} s, keeping the state {whole['state_seconds']:.2f} s", flush=True)
        killed = _run(ckpt, args.recipe, IDS, d / "run", kill_after=args.kill_after)
        print(f"killed after block {args.kill_after}: {killed['process_s']:.1f} s", flush=True)
        resumed = _run(ckpt, args.recipe, IDS, d / "run", resume=True)
        print(f"resumed: {resumed['process_s']:.1f} s", flush=True)
        same = all((d / "whole" / f).read_bytes() == (d / "run" / f).read_bytes()
                   for f in os.listdir(d / "whole"))
    t = whole["process_s"]
    result = {"model": "SmolLM2-135M-Instruct", "recipe": args.recipe, "windows": 32, "seq_len": 256,
              "kill_after": args.kill_after, "uninterrupted_s": t, "state_s": whole["state_seconds"],
              "state_share": whole["state_seconds"] / t, "killed_s": killed["process_s"],
              "resumed_s": resumed["process_s"],
              "stop_cost_s": killed["process_s"] + resumed["process_s"] - t,
              "stop_cost_share": (killed["process_s"] + resumed["process_s"] - t) / t, "bytes_equal": same,
              "start_up_s": _start_up(resumed), "start_up_uninterrupted_s": _start_up(whole),
              "restoring_s": resumed["restoring"]}
    print(f"\nSmolLM2-135M --sequential {args.recipe}, 32 x 256 tokens, killed after block {args.kill_after}")
    print(f"keeping the state: {result['state_s']:.2f} s of {t:.1f} s ({100 * result['state_share']:.2f} %)")
    print(f"a stop and --resume: {result['killed_s']:.1f} + {result['resumed_s']:.1f} s against {t:.1f} s "
          f"uninterrupted: {result['stop_cost_s']:+.1f} s ({100 * result['stop_cost_share']:+.1f} %)")
    print(f"  of which the resumed run's start before its first block (interpreter, imports, skeleton, data): "
          f"{result['start_up_s']:.1f} s (the uninterrupted run's: {result['start_up_uninterrupted_s']:.1f} s); "
          f"reading the saved blocks and outputs back: {result['restoring_s']:.2f} s")
    print(f"bytes {'equal' if same else 'DIFFER'} to the uninterrupted run")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
