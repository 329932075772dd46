"""GPTQ calibration time: qtool against llm-compressor, same model, data, grid and machine (docs/performance.md).

llm-compressor is a reference, never a dependency: it runs from its own virtual environment.

    python3 -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    .venv/bin/python bench/gptq_vs_llmcompressor.py --prepare           # token windows -> bench/results/gptq-ids
    .venv/bin/python bench/gptq_vs_llmcompressor.py --llmc-python /tmp/llmc/bin/python   # both, back to back

(`--side llmcompressor` / `--side qtool` run one side in the current interpreter.) The run of both writes
bench/results/gptq_vs_llmcompressor.json with each side's seconds and qtool's ratio to llm-compressor.

Model: SmolLM2-135M-Instruct fp32 (bench/smollm2.py). Data: the 32 calibration windows of 256 tokens that
bench/accuracy.py uses. Grid: int4 symmetric, groups (blocks) of 32 along the input, min-max ranges, every Linear
but lm_head. GPTQ: blocks of 128 columns, dampening 0.01, static activation order, layer by layer with the
quantized earlier layers' outputs as inputs (llm-compressor's sequential pipeline; qtool --sequential). Each side
prints and writes (bench/results/gptq-<side>.json) the wall time from loading the model to having every code,
with its libraries (transformers, and llm-compressor or qtool) imported before the clock starts on both sides;
the run of both also times each side's whole process (interpreter, imports, writing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IDS = REPO / "bench/results/gptq-ids.safetensors"
SEQ_LEN, WINDOWS = 256, 32


def prepare() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    import tempfile

    from safetensors.torch import save_file

    from qtool.data import load_data
    from qtool.example import text_split
    from qtool.model.load import load_model
    from smollm2 import smollm2_dir

    ckpt = smollm2_dir()
    calib, _ = text_split(300, 300)
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "calib.txt"
        f.write_text("\n\n".join(calib))
        tok = load_model(ckpt).tokenizer
        batches = list(load_data(f, batch_size=WINDOWS, seq_len=SEQ_LEN, tokenizer=tok, pack_text=True,
                                 num_samples=WINDOWS, seed=0))
    ids = batches[0].kwargs["input_ids"]
    IDS.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": ids.contiguous(), "attention_mask": batches[0].kwargs["attention_mask"].contiguous()},
              str(IDS))
    print(f"wrote {IDS} {list(ids.shape)} (model {ckpt})")


def _model_dir() -> Path:
    sys.path.insert(0, str(REPO / "bench"))
    from smollm2 import CACHE

    return CACHE


def run_llmcompressor() -> float:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    data = load_file(str(IDS))
    ds = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(_model_dir()), dtype=torch.float32)
    recipe = GPTQModifier(
        config_groups={"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
            "observer": "minmax", "actorder": "static"}}},
        ignore=["lm_head"], block_size=128, dampening_frac=0.01)
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(ds), max_seq_length=SEQ_LEN)
    return time.perf_counter() - t0


def run_qtool() -> float:
    import tempfile

    from transformers import AutoModelForCausalLM  # noqa: F401 - imported before the clock, as the other side does

    from qtool.pipeline import CalibrateOptions, run_calibrate

    recipe = ("version: 1\ndefaults:\n  weights: {bitwidth: 4, symmetric: true, granularity: per_block, "
              "block_size: 32, analyzer: minmax, rounding: {name: gptq, block_columns: 128, dampening: 0.01, "
              "act_order: true}}\n  activations: null\nignore: [\"lm_head\"]\n")
    with tempfile.TemporaryDirectory() as d:
        r = Path(d) / "r.yaml"
        r.write_text(recipe)
        t0 = time.perf_counter()
        run_calibrate(str(_model_dir()), str(r), str(Path(d) / "out"),
                      CalibrateOptions(data=str(IDS), batch_size=8, sequential=True), overwrite=True)
        return time.perf_counter() - t0


def both(llmc_python: str, repeats: int) -> None:
    """Each side in its own process (its own interpreter and venv), alternating, ``repeats`` times each."""
    import subprocess

    runs = {"llmcompressor": [], "qtool": []}
    process = {"llmcompressor": [], "qtool": []}  # the whole command: interpreter, every import, writing
    for _ in range(repeats):
        for side, python in (("llmcompressor", llmc_python), ("qtool", sys.executable)):
            t0 = time.perf_counter()
            subprocess.run([python, __file__, "--side", side], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            process[side].append(time.perf_counter() - t0)
            runs[side].append(json.loads((REPO / f"bench/results/gptq-{side}.json").read_text())["seconds"])
    best = {side: min(t) for side, t in runs.items()}
    best_process = {side: min(t) for side, t in process.items()}
    ratio = best["qtool"] / best["llmcompressor"]
    ratio_process = best_process["qtool"] / best_process["llmcompressor"]
    out = REPO / "bench/results/gptq_vs_llmcompressor.json"
    out.write_text(json.dumps({"runs": runs, "best": best, "ratio": ratio, "process_runs": process,
                               "best_process": best_process, "ratio_process": ratio_process, "windows": WINDOWS,
                               "seq_len": SEQ_LEN}, indent=2) + "\n")
    print(f"GPTQ W4 group 32, SmolLM2-135M, {WINDOWS} x {SEQ_LEN} tokens, best of {repeats} (seconds)")
    print(f"{'side':<16}{'runs':>24}{'best':>8}{'whole process':>32}{'best':>8}")
    for side, t in runs.items():
        print(f"{side:<16}{' '.join(f'{x:.1f}' for x in t):>24}{best[side]:>8.1f}"
              f"{' '.join(f'{x:.1f}' for x in process[side]):>32}{best_process[side]:>8.1f}")
    print(f"qtool / llm-compressor: {ratio:.2f}x from libraries loaded to codes chosen, {ratio_process:.2f}x whole "
          f"process  ({out})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--side", choices=["qtool", "llmcompressor"])
    ap.add_argument("--llmc-python", default="/tmp/llmc/bin/python",
                    help="the interpreter of llm-compressor's own venv (runs of both sides)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    if args.prepare:
        prepare()
        return
    if args.side is None:
        if not IDS.exists():
            prepare()
        both(args.llmc_python, args.repeats)
        return
    import torch

    secs = run_qtool() if args.side == "qtool" else run_llmcompressor()
    out = REPO / f"bench/results/gptq-{args.side}.json"
    out.write_text(json.dumps({"side": args.side, "seconds": secs, "threads": torch.get_num_threads(),
                               "torch": torch.__version__, "windows": WINDOWS, "seq_len": SEQ_LEN}, indent=2) + "\n")
    print(f"{args.side}: GPTQ W4 group 32 on SmolLM2-135M, {WINDOWS} x {SEQ_LEN} tokens: {secs:.1f} s  ({out})")


if __name__ == "__main__":
    main()
