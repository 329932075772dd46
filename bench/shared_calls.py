"""What one shared calibration call saves where several quantizers read the same tensor.

A Llama-shaped model's q, k and v projections read one hidden state, gate and up read another: with a W8A8 recipe
each of the five has its own input quantizer (as in AIMET), and each would compute the same batch range and the
same fake-quant output. ``QuantizeDequantize`` shares them (``qtool.quant.quantizer._LastCalibrationCall``). This
bench calibrates a random-weight checkpoint of SmolLM2-135M's shape (``--layers`` blocks, float32, 16 x 256
random tokens, ``--samples``) with ``configs/w8a8.yaml`` in one process three ways, alternating, best of
``--repeats``: as shipped (sharing, and on a GPU the pass replayed as a CUDA graph: qtool.calibration.graphs), with
the replay switched off, and with the sharing switched off; checks that every range is bit-equal every way, and
reports the float forward over the same batches beside them. Prints a table, writes
bench/results/shared_calls.json.

    .venv/bin/python bench/shared_calls.py                 # CPU, 8 blocks
    python bench/shared_calls.py --device cuda --layers 30
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from scale import write_checkpoint  # noqa: E402
from sequential_memory import SMOLLM2  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(layers: int, device: str, repeats: int, samples: int = 16, seq_len: int = 256, mask: bool = False) -> dict:
    import qtool.quant.quantizer as quantizer_module
    from qtool.calibration import graphs
    from qtool.calibration.in_memory import calibrate
    from qtool.config import load_recipe, resolve_plan
    from qtool.data import Batch, CalibrationData
    from qtool.model.insert import insert_quantizers, remove_quantizers
    from qtool.model.load import load_model

    dev = torch.device(device)
    with tempfile.TemporaryDirectory() as d:
        write_checkpoint(Path(d) / "m", {**SMOLLM2, "layers": layers})
        model = load_model(Path(d) / "m", device=device).model.float()
    ids = torch.randint(0, SMOLLM2["vocab"], (samples, seq_len), generator=torch.Generator().manual_seed(0))
    # mask: the all-ones attention mask qtool's packed text windows carry (graphs.Replayer.feed leaves it out)
    batches = [Batch(kwargs={"input_ids": ids[i:i + 4], **({"attention_mask": torch.ones_like(ids[i:i + 4])}
                                                          if mask else {})}) for i in range(0, samples, 4)]
    data = CalibrationData(batches, [], samples, "random")
    recipe = load_recipe(HERE.parent / "configs" / "w8a8.yaml")
    sharing = quantizer_module._LastCalibrationCall.matching
    taken = []

    def counted(self, x, key):
        call = sharing(self, x, key)
        taken.append(call is not None)
        return call

    def float_pass() -> float:
        _sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            for b in batches:
                model(**b.to(dev).kwargs)
        _sync(dev)
        return time.perf_counter() - t0

    replayers = []

    def calib(shared: bool, replay: bool = True):
        quantizer_module._LastCalibrationCall.matching = counted if shared else (lambda self, x, key: None)
        graphs.ENABLED = replay
        try:
            plan = resolve_plan(recipe, model)
            qs = insert_quantizers(model, plan)
            _sync(dev)
            t0 = time.perf_counter()
            replayers.append(calibrate(model, plan, qs, data, dev).replay)
            _sync(dev)
            t = time.perf_counter() - t0
            ranges = {n: (q.min.detach().cpu().clone(), q.max.detach().cpu().clone()) for n, q in qs.items()}
            remove_quantizers(model)
            return t, ranges
        finally:
            quantizer_module._LastCalibrationCall.matching = sharing
            graphs.ENABLED = True

    float_pass()
    calib(True)  # warm-up
    times = {"float": [], "shared": [], "eager": [], "alone": []}
    ranges = {}
    for _ in range(repeats):
        times["float"].append(float_pass())
        for mode in ("shared", "eager", "alone"):
            taken.clear()
            replayers.clear()
            t, ranges[mode] = calib(mode != "alone", replay=mode != "eager")
            times[mode].append(t)
            if mode == "eager":  # (a replayed batch's calls are the recorded ones: not seen from Python)
                calls, shared_calls = len(taken), sum(taken)
            if mode == "shared":
                replayed = sum(r.replays for r in replayers if r is not None)
    equal = all(torch.equal(a, b) for m in ("shared", "eager") for n in ranges["alone"]
                for a, b in zip(ranges["alone"][n], ranges[m][n]))
    best = {k: min(v) for k, v in times.items()}
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    refused = next((r.refused for r in replayers if r is not None and r.refused), None)
    return {"bench": "shared_calls", "model": f"SmolLM2-135M shape, {layers} blocks, random weights, float32",
            "attention_mask": mask, "replay_refused": refused,
            "recipe": "configs/w8a8.yaml", "batches": f"{samples} x {seq_len} tokens, batches of 4",
            "device": name, "torch": torch.__version__, "repeats": repeats,
            "activation_calls": calls, "shared_calls": shared_calls, "ranges_equal": equal,
            "batches_replayed": replayed, "float_s": best["float"], "calibrate_shared_s": best["shared"],
            "calibrate_eager_s": best["eager"], "calibrate_alone_s": best["alone"],
            "ratio_shared": best["shared"] / best["float"], "ratio_eager": best["eager"] / best["float"],
            "ratio_alone": best["alone"] / best["float"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16, help="calibration samples of 256 tokens, in batches of 4")
    ap.add_argument("--attention-mask", action="store_true",
                    help="batches carry an all-ones attention mask, as qtool's packed text windows do")
    ap.add_argument("--out", default=str(HERE / "results" / "shared_calls.json"))
    args = ap.parse_args(argv)
    r = run(args.layers, args.device, args.repeats, samples=args.samples, mask=args.attention_mask)
    print(f"{r['model']}, {r['recipe']}, {r['batches']} ({r['device']})")
    print(f"activation quantizer calls {r['activation_calls']}, of which shared {r['shared_calls']}; "
          f"batches replayed as a CUDA graph {r['batches_replayed']} of {len(range(0, args.samples, 4))}; "
          f"ranges bit-equal every way: {r['ranges_equal']}"
          + (f"; attention mask given; replay refused: {r['replay_refused']}" if r["attention_mask"] else ""))
    print(f"{'':<28}{'best s':>9}{'x float':>9}")
    print(f"{'float forward':<28}{r['float_s']:>9.3f}{1.0:>9.2f}")
    print(f"{'calibrate (as shipped)':<28}{r['calibrate_shared_s']:>9.3f}{r['ratio_shared']:>9.2f}")
    print(f"{'calibrate, no graph replay':<28}{r['calibrate_eager_s']:>9.3f}{r['ratio_eager']:>9.2f}")
    print(f"{'calibrate, each its own':<28}{r['calibrate_alone_s']:>9.3f}{r['ratio_alone']:>9.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(r, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if r["ranges_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
