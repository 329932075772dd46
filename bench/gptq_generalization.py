"""Where GPTQ's codes lose on text of another kind (#52, item 0), on SmolLM2-135M-Instruct.

Same calibration text (Python documentation, 32 windows of 256 tokens), held-out texts and GGUF grid as
``bench/gguf_kquants.py`` (held-out Python docs; texts of other kinds, bench/texts.py). Two diagnostics:

* ``layers``: per Linear layer, the grid the weighted search chooses (``activations_magnitude``, importances from
  the calibration inputs), then round-to-nearest, llama.cpp's quantizer with the same importances and GPTQ at each
  ``--dampening`` (optionally with the clipped spans GPTQ's search tries, ``--clip``, and bounded to the two levels
  around each weight, ``--bounded``); each scored by its relative output error ``tr(D H Dᵀ) / tr(W H Wᵀ)`` under
  the Hessian of the float model's inputs on each text, with the share of GPTQ's codes two or more levels away
  from round-to-nearest's.
* ``swap``: the whole model through qtool (``--sequential``, exported to GGUF) with GPTQ and with round-to-nearest
  on the same weighted grid, then GPTQ's weights with one layer type, or one range of blocks, taken from the
  nearest file instead; perplexity increase on both texts (the file's weights, dequantized by gguf-py).

Prints what it measures (it is a diagnosis, not a table of record; docs/accuracy.md quotes it).

    .venv/bin/python bench/gptq_generalization.py layers --blocks 3,15,27 --type Q4_0 --dampening 0.01,0.3,1
    .venv/bin/python bench/gptq_generalization.py swap --mix q4_0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

TYPES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")
GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


def _texts(tmp: Path, tok):
    """Calibration batches (``cal``) and each held-out text's, by its short name, as bench/gguf_kquants.py makes
    them."""
    from gguf_kquants import scoring_texts
    from texts import SHORT

    calib, texts = scoring_texts(tmp, tok)
    return {"cal": calib, **{SHORT[name]: b for name, b in texts.items()}}


def layers(args, model, sets):
    from gguf_kquants import _ggml, llama_cpp_values

    from qtool.calibration.rounding.gptq import gptq_codes
    from qtool.quant import ggml
    from qtool.quant.analysis.mse import magnitude_weights

    names = [f"model.layers.{b}.{m}" for b in map(int, args.blocks.split(",")) for m in args.modules.split(",")]
    mods = dict(model.named_modules())
    hessians, sums = {}, {}
    hooks = [mods[n].register_forward_pre_hook(
        lambda m, a, n=n: sums.__setitem__(n, sums.get(n, 0) + (lambda x: x.T @ x)(
            a[0].reshape(-1, a[0].shape[-1]).double()))) for n in names]
    with torch.no_grad():
        for label, batches in sets.items():
            sums.clear()
            for b in batches:
                model(**b.kwargs)
            hessians[label] = dict(sums)
    for h in hooks:
        h.remove()
    lib = _ggml()
    t = ggml.ggml_type(args.type)
    qmin, qmax = t.qmin_qmax
    totals, moved = {}, {}

    def error(d, h, w):
        return float(torch.einsum("oi,ij,oj->", d.double(), h, d.double())
                     / torch.einsum("oi,ij,oj->", w.double(), h, w.double()))

    for n in names:
        w = mods[n].weight.detach().float()
        if w.shape[1] % t.block:
            continue
        h_cal = hessians["cal"][n]
        imp = (torch.diagonal(h_cal) / h_cal.shape[0]).float()
        rows = w.reshape(-1, t.sub)
        weights = imp.reshape(1, -1, t.sub).expand(w.shape[0], -1, -1).reshape(-1, t.sub) * magnitude_weights(rows)
        found = {"llama.cpp+imatrix": llama_cpp_values(lib, w, t.name, imp)}
        for clip in ((False, True) if args.clip else (False,)):
            mn, mx = ggml.search_range(rows, t, weights, clip_ratios=ggml.CLIP_RATIOS if clip else ())
            grid = ggml.grid_from_range(mn.reshape(w.shape[0], -1), mx.reshape(w.shape[0], -1), t)
            scale, offset = grid.step_offset((w.shape[0], w.shape[1] // t.sub))
            tag = " clipped" if clip else ""
            rtn = ggml.quantize_codes(w, grid)
            found[f"nearest{tag}"] = ggml.dequantize(rtn, grid)
            for damp in map(float, args.dampening.split(",")):
                for bounded in ((False, True) if args.bounded else (False,)):
                    codes = gptq_codes(w, h_cal.float(), scale, offset, qmin, qmax, (1, t.sub), dampening=damp,
                                       element=t, bounded=bounded)
                    key = f"gptq {damp:g}{' bounded' if bounded else ''}{tag}"
                    found[key] = ggml.dequantize(codes.to(torch.int32), grid)
                    far = (codes - rtn).abs() > 1  # codes two or more levels from round-to-nearest's
                    moved.setdefault(key, []).append(float(far.float().mean()))
        cells = []
        for key, q in found.items():
            errs = [error(w - q, hessians[s][n], w) for s in sets]
            acc = totals.setdefault(key, [0.0] * len(sets) + [0])
            acc[:-1] = [a + e for a, e in zip(acc[:-1], errs)]
            acc[-1] += 1
            cells.append(f"{key} " + "/".join(f"{e:.4f}" for e in errs[1:]))
        print(f"{n}: " + ", ".join(cells), flush=True)
    print(f"\n{args.type}: mean relative output error, inputs of {' / '.join(sets)}")
    for key, acc in totals.items():
        far = f"   codes 2+ levels from nearest: {100 * sum(moved[key]) / len(moved[key]):.2f} %" if key in moved else ""
        print(f"{key:24s} " + " ".join(f"{v / acc[-1]:.5f}" for v in acc[:-1]) + far)


def swap(args, model, sets, tmp: Path):
    import gguf

    from gguf_kquants import perplexities
    from qtool.pipeline import CalibrateOptions, ExportOptions, run_quantize
    from smollm2 import smollm2_dir

    texts = {k: v for k, v in sets.items() if k != "cal"}
    ppl_float = perplexities(model, texts)

    def file_weights(rounding: str):
        out = tmp / f"{args.mix}-{rounding}"
        recipe = tmp / f"{args.mix}-{rounding}.yaml"
        recipe.write_text(f"version: 1\ngguf_mix: {args.mix}\ndefaults:\n  weights: {{analyzer: {{name: mse, "
                          f"weighting: activations_magnitude}}, rounding: {rounding}}}\n  activations: null\n")
        run_quantize(str(smollm2_dir()), str(recipe), str(out),
                     CalibrateOptions(data=str(tmp / "calib.txt"), seq_len=256, num_samples=32, sequential=True),
                     eopts=ExportOptions(format="gguf"))
        found = {}
        for t in gguf.GGUFReader(out / "model.gguf").tensors:
            parts = t.name.split(".")
            if parts[0] == "blk" and parts[2] in GGUF_NAMES and parts[3] == "weight":
                values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
                found[(int(parts[1]), GGUF_NAMES[parts[2]])] = torch.from_numpy(values.copy())
        return found

    gptq, nearest = file_weights("gptq"), file_weights("nearest")
    cfg = model.config
    heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}

    def hf_layout(x, module):  # llama.cpp's converter permutes q/k rows for its RoPE; undo it
        n = heads.get(module)
        return x if n is None else x.reshape(n, x.shape[0] // n // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    mods = dict(model.named_modules())
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def row(label, from_gptq):
        model.load_state_dict(state)
        with torch.no_grad():
            for (block, module), w in gptq.items():
                target = mods[f"model.layers.{block}.{module}"].weight
                src = w if from_gptq(block, module) else nearest[(block, module)]
                target.copy_(hf_layout(src.reshape(target.shape), module))
        p = perplexities(model, texts)
        print(f"{label:34s} " + " / ".join(f"{100 * (p[k] / ppl_float[k] - 1):+6.2f}%" for k in p), flush=True)

    print(f"{args.mix}: perplexity increase over float, held-out {' / '.join(texts)}")
    row("GPTQ everywhere", lambda b, m: True)
    row("nearest everywhere", lambda b, m: False)
    for t in TYPES:
        row(f"GPTQ, {t.split('.')[1]} nearest", lambda b, m, t=t: m != t)
    n = cfg.num_hidden_layers
    for a, z in ((0, 5), (5, 10), (10, 20), (20, n)):
        row(f"GPTQ, blocks {a}-{z - 1} nearest", lambda b, m, a=a, z=z: not a <= b < z)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("layers", "swap"))
    ap.add_argument("--blocks", default="3,15,27", help="layers: decoder blocks")
    ap.add_argument("--modules", default="self_attn.q_proj,self_attn.o_proj,mlp.gate_proj,mlp.down_proj")
    ap.add_argument("--type", default="Q4_0", help="layers: the GGUF type")
    ap.add_argument("--dampening", default="0.01,0.1,0.3,1,3", help="layers: GPTQ dampenings")
    ap.add_argument("--clip", action="store_true", help="layers: also with the clipped spans")
    ap.add_argument("--bounded", action="store_true",
                    help="layers: also GPTQ with each code kept at one of the two levels around its weight")
    ap.add_argument("--mix", default="q4_0", help="swap: the GGUF mix")
    args = ap.parse_args(argv)

    import transformers

    from smollm2 import smollm2_dir

    ckpt = smollm2_dir()
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        sets = _texts(Path(tmp), tok)
        if args.what == "layers":
            layers(args, model, sets)
        else:
            swap(args, model, sets, Path(tmp))


if __name__ == "__main__":
    main()
