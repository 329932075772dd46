"""The peak memory a calibration run reaches, estimated before it starts, for the mode it will run in and for
``--sequential`` (docs/performance.md, "Memory estimate"; ``bench/memory_estimate.py`` holds it to measured
peaks).

The estimate is a sum of what dominates each mode, as measured (peak resident set size):

* every mode: the qtool process with torch and transformers loaded (``BASE``);
* ``streaming`` (weights only): the largest tensor as float32 and its search's work (``STREAM_WORK`` times);
* ``in_memory``: the float32 model; a causal LM's logits of one batch (and their fake-quantized copy when
  activations are quantized); every rounded
  layer's ``XᵀX`` (float64, ``in²``) and every weighted layer's ``E[x²]``, all held until the weights calibrate;
  GPTQ's work on the widest layer;
* ``sequential``: the embedding table, one decoder block (and its copy in flight), its layers' statistics, and
  the hidden states of every calibration sample (the block's inputs and outputs); with ``rounding: signround``
  also the float block's outputs (the target), the learned parameters with their copies and gradients
  (``LEARNED_BYTES`` per learned weight) and one batch's forward-and-backward activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from torch import nn

from ..config import Plan
from ..model.load import decoder_stack

__all__ = ["MemoryEstimate", "estimate_memory", "available_memory"]

BASE = 0.70e9  # the qtool process before any model: Python, torch, transformers, tokenizers (measured)
STREAM_WORK = 1.5  # the largest weight's float32 copy and its search buffers, in units of that copy
GPTQ_WORK = 4  # GPTQ's temporaries on one layer, in units of its float64 XᵀX
# signround, per learned weight: its float copy, the offsets, three saved candidates, the gradient and its sign,
# and the fake-quant steps autograd keeps (float32 each)
LEARNED_BYTES = 41


@dataclass(frozen=True)
class MemoryEstimate:
    mode: str  # the mode the run takes: streaming, in_memory, sequential
    peak: int  # bytes
    sequential: Optional[int] = None  # the --sequential peak, where the model can run block by block

    def describe(self) -> str:
        text = f"peak memory about {_gb(self.peak)} ({self.mode.replace('_', '-')})"
        if self.sequential is not None and self.mode == "in_memory":
            text += f"; --sequential: about {_gb(self.sequential)}"
        return text


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


def _layer_stats(plan: Plan, model: nn.Module, within: Optional[str] = None):
    """``(stored, work)``: the bytes of the input statistics the plan's rows keep (float64 ``XᵀX`` for rounded
    layers, ``E[x²]`` for weighted ones), under module prefix ``within`` when given, and GPTQ's work on the widest."""
    stored, widest = 0, 0
    for q in plan.weights:
        if not q.needs_inputs or (within is not None and not q.module.startswith(within)):
            continue
        weight = getattr(model.get_submodule(q.module), "weight", None)
        if weight is None or weight.dim() < 2:
            continue
        width = int(weight[0].numel())  # a convolution's patch: in / groups · kernel
        stored += 8 * width + (8 * width * width if q.rounds_layerwise else 0)
        if q.rounds_layerwise:
            widest = max(widest, 8 * width * width)
    return stored, GPTQ_WORK * widest


def estimate_memory(model: nn.Module, plan: Plan, mode: str, batch_size: int, seq_len: int,
                    num_samples: Optional[int], causal: bool) -> MemoryEstimate:
    """The estimate for ``plan`` on ``model`` (a meta-device skeleton will do: only shapes are read) calibrated
    in ``mode`` on ``num_samples`` (None: one batch's worth is assumed) of ``seq_len`` tokens."""
    params = list(model.parameters())
    floats = 4 * sum(p.numel() for p in params)
    largest = 4 * max((p.numel() for p in params), default=0)
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0) if causal else 0
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    tokens = batch_size * seq_len
    samples = num_samples if num_samples is not None else batch_size
    stack = decoder_stack(model) if causal else None
    blocks = stack[1].layers if stack is not None else None

    def sequential() -> Optional[int]:
        if blocks is None:
            return None
        block = max(4 * sum(p.numel() for p in b.parameters()) for b in blocks)
        embed = model.get_input_embeddings()
        table = 4 * sum(p.numel() for p in embed.parameters()) if embed is not None else 0
        stats = max(sum(_layer_stats(plan, model, f"{stack[0]}.layers.{i}.")) for i in range(len(blocks)))
        states = 2 * 4 * samples * seq_len * hidden
        return int(BASE + table + 2 * block + stats + states + learning())

    def learning() -> int:
        """signround's state on the block with the most learned weights (0 without signround)."""
        learned = [q.module for q in plan.weights if q.learns_rounding]
        if not learned:
            return 0
        most = max(sum(model.get_submodule(m).weight.numel() for m in learned
                       if m.startswith(f"{stack[0]}.layers.{i}.")) for i in range(len(blocks)))
        inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
        heads = int(getattr(config, "num_attention_heads", 0) or 1)
        # what autograd keeps of one batch's pass through the block (read off SmolLM2, 8 x 256 tokens)
        activations = 4 * tokens * (8 * hidden + 4 * inter) + 4 * batch_size * heads * seq_len * seq_len
        return LEARNED_BYTES * most + 4 * samples * seq_len * hidden + activations

    if mode == "streaming":
        peak = int(BASE + STREAM_WORK * largest)
    elif mode == "sequential":
        peak = sequential() or 0
    else:
        stored, work = _layer_stats(plan, model)
        # a batch's logits; static activation quantizers keep a fake-quantized copy of each output beside it
        logits = (2 if plan.static_activations else 1) * 4 * tokens * vocab
        peak = int(BASE + floats + logits + stored + work)
    return MemoryEstimate(mode, peak, sequential())


def available_memory() -> Optional[int]:
    """The memory the system can give this process now (Linux's MemAvailable), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
