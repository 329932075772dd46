"""``qtool calibrate --sequential`` with GPTQ W4A16 on Qwen3-30B-A3B-shaped mixture-of-experts blocks (hidden 2048,
128 experts, 8 routed per token, expert width 768, 32 query heads, 4 KV heads, head_dim 128; random fp16 weights,
a small vocabulary: the blocks are what is measured): seconds and memory per block, the tokens each expert was
routed, and an extrapolation to the whole 48-block model.

Not part of ``make bench`` (minutes per block on 2 cores). Run it by hand::

    .venv/bin/python bench/moe_blocks.py                          # 3 blocks, 64 x 512 tokens
    .venv/bin/python bench/moe_blocks.py --layers 2 --samples 16  # a quick look
    .venv/bin/python bench/moe_blocks.py --device cuda

The calibration runs in a child process (bench/sequential_memory.py's: one JSON line per finished block with
VmRSS, so its peak RSS is its own). Flat RSS across blocks means memory is bounded by one block. Prints a table
and writes ``bench/results/moe_blocks.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from sequential_memory import run_recipe  # noqa: E402

GB = 1e9
# Qwen3-30B-A3B's public configuration (blocks only: a 1024-token vocabulary keeps the checkpoint small)
QWEN3_30B_A3B = {"hidden": 2048, "experts": 128, "active": 8, "expert_width": 768, "heads": 32, "kv_heads": 4,
                 "head_dim": 128, "vocab": 151936, "layers": 48}


def tensor_specs(s: Dict[str, int], vocab: int) -> List[tuple]:
    """(name, shape) of every tensor as a Qwen3-MoE checkpoint names them (experts one by one)."""
    h, d, w = s["hidden"], s["head_dim"], s["expert_width"]
    out = [("model.embed_tokens.weight", (vocab, h))]
    for n in range(s["layers"]):
        p = f"model.layers.{n}."
        out += [(p + "self_attn.q_proj.weight", (s["heads"] * d, h)),
                (p + "self_attn.k_proj.weight", (s["kv_heads"] * d, h)),
                (p + "self_attn.v_proj.weight", (s["kv_heads"] * d, h)),
                (p + "self_attn.o_proj.weight", (h, s["heads"] * d)),
                (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                (p + "mlp.gate.weight", (s["experts"], h))]
        for e in range(s["experts"]):
            out += [(p + f"mlp.experts.{e}.gate_proj.weight", (w, h)), (p + f"mlp.experts.{e}.up_proj.weight", (w, h)),
                    (p + f"mlp.experts.{e}.down_proj.weight", (h, w))]
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def write_checkpoint(out: Path, s: Dict[str, int], vocab: int, seed: int = 0) -> int:
    """A Hugging Face Qwen3-MoE directory with random fp16 weights (one shard); returns its parameter count."""
    import torch

    from qtool.io.st_writer import StreamingSafetensorsWriter

    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": s["hidden"],
              "intermediate_size": 6144, "moe_intermediate_size": s["expert_width"], "num_experts": s["experts"],
              "num_experts_per_tok": s["active"], "num_hidden_layers": s["layers"],
              "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
              "vocab_size": vocab, "max_position_embeddings": 4096, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    specs = tensor_specs(s, vocab)
    g = torch.Generator().manual_seed(seed)
    total = 0
    with StreamingSafetensorsWriter(out / "model.safetensors", [(n, torch.float16, sh) for n, sh in specs],
                                    {"format": "pt"}) as w:
        for name, shape in specs:
            if len(shape) == 1:  # RMSNorm weights: around 1
                t = (1.0 + 0.05 * torch.randn(shape, generator=g)).to(torch.float16)
            else:
                t = (torch.randn(shape, generator=g) * 0.02).to(torch.float16)
            total += t.numel()
            w.write(name, t)
    return total


def expert_tokens(run: Path) -> List[int]:
    """Tokens routed to each expert over the run (every block, from the calibration manifest)."""
    manifest = json.loads((run / "manifest.json").read_text())
    return sorted(manifest.get("expert_tokens", {}).values())


def main(argv=None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--recipe", default="w4a16-block32-gptq")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", default=None, help="where the checkpoint and run go (default: $TMPDIR)")
    ap.add_argument("--out", default=str(HERE / "results" / "moe_blocks.json"))
    args = ap.parse_args(argv)
    import torch
    from safetensors.torch import save_file

    shape = {**QWEN3_30B_A3B, "layers": args.layers}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        params = write_checkpoint(work / "ckpt", shape, args.vocab)
        ids = torch.randint(0, args.vocab, (args.samples, args.seq_len), generator=torch.Generator().manual_seed(0))
        save_file({"input_ids": ids}, work / "ids.safetensors")
        print(f"checkpoint: {params / 1e9:.2f}B parameters ({args.layers} blocks), {args.samples} x {args.seq_len} "
              "tokens", flush=True)
        run = run_recipe(work / "ckpt", args.recipe, work / "ids.safetensors", work / "run", args.device)
        tokens = expert_tokens(work / "run")
        warnings = json.loads((work / "run" / "manifest.json").read_text())["warnings"]
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    per_block = run["seconds_per_block"]
    rss = [b["VmRSS"] for b in run["blocks"]]
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "torch": torch.__version__, "gpu": gpu},
              "device": args.device, "shape": shape, "vocab": args.vocab, "params": params,
              "samples": args.samples, "seq_len": args.seq_len, "run": run,
              "expert_tokens": {"experts": len(tokens), "min": tokens[0] if tokens else None,
                                "median": tokens[len(tokens) // 2] if tokens else None,
                                "max": tokens[-1] if tokens else None,
                                "expected": args.samples * args.seq_len * shape["active"] // shape["experts"]},
              "warnings": warnings,
              "extrapolation": {"model": "Qwen3-30B-A3B", "blocks": QWEN3_30B_A3B["layers"],
                                "est_hours": per_block * QWEN3_30B_A3B["layers"] / 3600,
                                "note": "seconds per block (from the second block on) times 48; the embedding and "
                                        "lm_head of the real 151936-token vocabulary add one pass each"}}
    print(f"\nQwen3-30B-A3B-shaped blocks, {args.recipe}, {args.layers} blocks, device {args.device}"
          + (f" ({gpu})" if gpu else ""))
    print(f"{'block':>6} {'s since start':>14} {'VmRSS GB':>9}")
    for b in run["blocks"]:
        print(f"{b['block']:>6} {b['s']:>14.1f} {b['VmRSS'] / GB:>9.2f}")
    print(f"seconds per block {per_block:.1f}; RSS growth per block {run['rss_growth_per_block_bytes'] / 1e6:.1f} MB "
          f"(first {rss[0] / GB:.2f} GB, last {rss[-1] / GB:.2f} GB); peak RSS {run['peak_rss_bytes'] / GB:.2f} GB")
    t = result["expert_tokens"]
    print(f"tokens per expert: min {t['min']}, median {t['median']}, max {t['max']} (uniform routing: "
          f"{t['expected']}) over {t['experts']} experts")
    print(f"extrapolation to 48 blocks: {result['extrapolation']['est_hours']:.2f} h")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
