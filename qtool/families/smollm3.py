"""SmolLM3: a Llama block whose every fourth layer has no rotary embedding (``no_rope_layers``), which llama.cpp's
``smollm3`` hard-codes (so another pattern is refused); its converter permutes q/k rows as for Llama."""

from pathlib import Path
from typing import Any, Dict

from ..errors import CheckpointError
from .base import Family, positive_int

_STEP = 4  # llama.cpp: n_no_rope_layer_step


class SmolLM3(Family):
    model_types = ("smollm3",)
    title = "SmolLM3"
    rms_norms = ("SmolLM3RMSNorm",)
    gguf_arch = "smollm3"
    permute_qk = True
    gguf_absent = {"attention_bias": "attention biases", "mlp_bias": "MLP biases"}

    def check_gguf(self, config: Dict[str, Any], where: Path) -> Dict[str, Any]:
        config = super().check_gguf(config, where)
        n = int(config["num_hidden_layers"])
        want = [int((i + 1) % _STEP != 0) for i in range(n)]
        got = config.get("no_rope_layers")
        if got is None:  # (transformers makes the list from no_rope_layer_interval, 4 by default)
            interval = positive_int(config, "no_rope_layer_interval", where, _STEP)
            got = [int((i + 1) % interval != 0) for i in range(n)]
        if [int(bool(x)) for x in got] != want:
            raise CheckpointError(f"{where}: no_rope_layers differ from llama.cpp's smollm3 (no rotary embedding in "
                                  f"every {_STEP}th layer only): {str(got)[:80]}")
        if config.get("use_sliding_window"):
            raise CheckpointError(f"{where}: sliding-window attention has no GGUF export for smollm3 in qtool")
        return config


FAMILY = SmolLM3()
