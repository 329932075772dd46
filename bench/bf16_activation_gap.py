"""How far bfloat16 arithmetic alone moves a model whose activations are quantized: SmolLM2-135M with a recipe
(default mxfp8: W8A8 with dynamic MX activations) exported to compressed-tensors, which transformers runs in
bfloat16 only. Mean per-token KL over 4 x 256 held-out Python-documentation tokens between qtool's fake-quant
model in float32, the same model cast to bfloat16, and the artifact as transformers loads it. Where the two
fake-quant runs differ by about as much as the artifact differs from either, the export gap is the runtime's
arithmetic, not the file (docs/accuracy.md, "MX activations in bfloat16").

    .venv/bin/python bench/bf16_activation_gap.py [--recipe mxfp8]      # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def main(argv=None) -> None:
    from smollm2 import smollm2_dir

    from qtool.evaluation.runtimes import transformers_reload
    from qtool.example import text_split
    from qtool.pipeline import load_calibrated

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="mxfp8")
    args = ap.parse_args(argv)
    ckpt = str(smollm2_dir())
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "q"
        subprocess.run([sys.executable, "-m", "qtool", "quantize", ckpt, "-c", args.recipe, "--format",
                        "compressed-tensors", "-o", str(out), "--quiet"], check=True, cwd=REPO)
        _, held = text_split(300, 300)
        fq = load_calibrated(ckpt, str(out / "calibration/encodings.json")).eval()
        ids = fq.qtool_tokenizer("\n\n".join(held), return_tensors="pt")["input_ids"][0][:1024].reshape(4, 256)

        def log_probs(model):
            with torch.no_grad():
                return torch.log_softmax(model(input_ids=ids).logits.float(), -1)

        fq32 = log_probs(fq)
        fq16 = log_probs(fq.to(torch.bfloat16))
        art = log_probs(transformers_reload(out, True).model)

    def kl(p, q):
        return float((p.exp() * (p - q)).sum(-1).mean())

    result = {"recipe": args.recipe, "tokens": int(ids.numel()), "fake_quant_float32_to_bfloat16": kl(fq32, fq16),
              "fake_quant_float32_to_artifact": kl(fq32, art), "fake_quant_bfloat16_to_artifact": kl(fq16, art)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
