"""Which weights runtimes fuse into one tensor, so that one quantization setting must cover them all: a decoder
layer's q/k/v projections (BERT's query/key/value), its gate/up projections (Mixtral's w1/w3), and one
projection across a mixture-of-experts layer's experts (GGUF stacks them into one tensor of one type; vLLM's MoE
kernels run one scheme for them). The size-budget search chooses per group, and report's suggestions keep a group
together."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["FUSED", "fused_groups", "expert_stacks"]

FUSED = (frozenset({"q_proj", "k_proj", "v_proj"}), frozenset({"gate_proj", "up_proj"}),
         frozenset({"query", "key", "value"}), frozenset({"w1", "w3"}))


_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)$")  # (a module's parent: one expert)


def fused_groups(modules: Sequence[str]) -> List[Tuple[str, ...]]:
    """``modules`` (in model order) grouped: siblings under one parent whose names fall in one ``FUSED`` set form
    one group (at the first member's place), and so do one projection's modules across a mixture-of-experts
    layer's experts (``<...>.experts.<e>.<leaf>``: GGUF stacks them into one tensor of one type, and vLLM's MoE
    kernels run one scheme for all experts); every other module is a group of its own."""
    groups: List[Tuple[str, ...]] = []
    where: Dict[Tuple[str, Any], int] = {}
    for m in modules:
        parent, _, leaf = m.rpartition(".")
        kind: Any = next((i for i, names in enumerate(FUSED) if leaf in names), None)
        expert = _EXPERT.match(parent)
        if expert is not None:
            parent, kind = expert["experts"], leaf if kind is None else kind
        if kind is None:
            groups.append((m,))
        elif (parent, kind) in where:
            groups[where[(parent, kind)]] += (m,)
        else:
            where[(parent, kind)] = len(groups)
            groups.append((m,))
    return groups


def expert_stacks(quantizers, counts: Optional[Dict[str, int]] = None
                  ) -> List[Tuple[str, Dict[int, Any], List[int]]]:
    """The weight quantizers (plan rows or encodings entries) of each mixture-of-experts projection, as llama.cpp
    stacks them into one tensor of one type: ``(pattern, {expert index: quantizer}, indices with none)``, the pattern
    naming the projection across its experts (``model.layers.0.mlp.experts.*.down_proj``). An expert count is
    ``counts``' (the model's, by experts module), else the highest index any of its layer's expert weights has, plus
    one (which cannot see the last experts left out)."""
    stacks: Dict[Tuple[str, str], Dict[int, Any]] = {}
    count: Dict[str, int] = {}
    for q in quantizers:
        parent, _, leaf = q.module.rpartition(".")
        m = _EXPERT.match(parent) if q.tensor == "weight" else None
        if m is None:
            continue
        index = int(m["index"])
        stacks.setdefault((m["experts"], leaf), {})[index] = q
        count[m["experts"]] = max(count.get(m["experts"], 0), index + 1, (counts or {}).get(m["experts"], 0))
    return [(f"{experts}.*.{leaf}", members, [i for i in range(count[experts]) if i not in members])
            for (experts, leaf), members in stacks.items()]
