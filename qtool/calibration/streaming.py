"""Weight-only calibration that streams: each weight is read from the checkpoint, calibrated and dropped; no model
is built (a meta-device skeleton names the modules). Peak memory is about the largest weight in float32."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from ..config import Plan
from ..encodings import EncodingEntry
from ..errors import CheckpointError
from ..model.expert_view import open_checkpoint
from ..model.experts import checkpoint_key
from ..model.insert import make_quantizer
from ..parallel import Group
from .collective import calibrate_weights_split, encoding_numel
from .rounding import importance

__all__ = ["calibrate_weights_streaming"]


def calibrate_weights_streaming(path, plan: Plan, model: nn.Module, sink=None,
                                group: Optional[Group] = None) -> List[EncodingEntry]:
    """Weight-only plans: each weight is read from the checkpoint, calibrated and dropped; no model is built.

    The encodings equal a normal run's (weight quantizers only ever see their weight). Peak memory is about
    the largest weight in float32. ``sink`` (e.g. :meth:`qtool.encodings.SidecarStream.put`) receives each entry
    as soon as it is calibrated and returns what to keep. With a distributed ``group`` the weights are split
    over the ranks by size, a window at a time, and rank 0 alone receives the entries (in plan order); the other
    ranks return none.
    """
    group = group or Group()
    src = open_checkpoint(path, model=model)
    keys = set(src.keys())
    prefix = getattr(model, "base_model_prefix", "") or ""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    params = dict(model.named_parameters(remove_duplicate=False))
    shared = {}
    seen = {}
    for n, p in params.items():
        shared.setdefault(id(p), []).append(n)
        seen[n] = id(p)

    def key_of(name: str) -> Optional[str]:
        candidates = [name, checkpoint_key(model, name)]
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1:])
        elif prefix:
            candidates.append(f"{prefix}.{name}")
        if tied and name in seen:  # stored once under the other name (itself maybe stored renamed)
            others = [n for n in shared[seen[name]] if n != name]
            candidates += others + [checkpoint_key(model, n) for n in others]
        return next((c for c in candidates if c in keys), None)

    def weight_for(q):
        key = key_of(f"{q.module}.weight")
        if key is None:
            raise CheckpointError(f"{src.path}: checkpoint has no tensor for {q.module}.weight")
        return src.get(key).to(torch.float32)

    entries = []

    def done(q, quantizer):
        entry = EncodingEntry.from_quantizer(q, quantizer)
        entries.append(entry if sink is None else sink(entry))

    sizes = {q.name: p.numel() if (p := params.get(f"{q.module}.weight")) is not None else encoding_numel(q)
             for q in plan.weights}
    calibrate_weights_split(plan.weights, sizes, make_quantizer, weight_for, group, done=done, everywhere=False,
                            importance_for=lambda q: importance(q, {}, q.shape, plan.importances))
    return entries
