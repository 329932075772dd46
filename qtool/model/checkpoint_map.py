"""Which checkpoint tensors make each parameter of a transformers model, for loading it part by part.

transformers 5 does not always keep a checkpoint's names in memory: a mixture-of-experts layer's experts are one
module with 3-D ``gate_up_proj``/``down_proj`` parameters, made at load time by stacking the checkpoint's
per-expert ``experts.<e>.gate_proj.weight`` (and ``up_proj``) tensors, and some families rename parts
(Mixtral's ``block_sparse_moe`` is ``mlp``). ``from_pretrained`` applies these conversions to the whole checkpoint
at once; ``--sequential`` loads one decoder block at a time, so it asks :class:`CheckpointMap` for one parameter
at a time. The conversions are transformers' own (its conversion mapping and converters), not restated here.
"""

from __future__ import annotations

from copy import deepcopy
from functools import partial
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..config import CHECKPOINT_KEYS
from ..errors import CheckpointError

__all__ = ["CheckpointMap", "checkpoint_names"]


def checkpoint_names(model: nn.Module, keys: Iterable[str]) -> Dict[str, str]:
    """``{checkpoint key: the model's parameter name}`` where the two differ: a linearized expert's tensor
    (``config.CHECKPOINT_KEYS``) and one transformers renames at load time (Mixtral's router). ``keys``: the
    checkpoint tensors to look at for renames."""
    out = {ckpt: name for name, ckpt in getattr(model, CHECKPOINT_KEYS, {}).items() if ckpt != name}
    for key, name in CheckpointMap(model, keys).renamed().items():
        out.setdefault(key, name)
    return out


class CheckpointMap:
    """For a transformers ``model`` (a meta-device skeleton will do) and its checkpoint's tensor ``keys``: the
    parameters whose value is not one checkpoint tensor of the same name, and how to make them."""

    def __init__(self, model: nn.Module, keys: Iterable[str]):
        # parameter name -> (the converter, {source pattern: checkpoint keys in order}) or (None, {None: [key]})
        self._sources: Dict[str, Tuple[object, Dict[Optional[str], List[str]]]] = {}
        self._model = model
        try:
            self._map(model, list(keys))
        except Exception:  # transformers' loading internals changed, or a model they do not map: names as they are
            self._sources = {}

    def _map(self, model: nn.Module, keys: List[str]) -> None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                         rename_source_key)
        except ImportError:  # a transformers without load-time conversions: names are the checkpoint's
            return
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        # a converter that splits one tensor into several parameters is not followed here (one parameter at a time)
        converters = [t for t in transforms if isinstance(t, WeightConverter) and len(t.target_patterns) == 1]
        if not (renamings or converters):
            return
        names = dict(model.state_dict(keep_vars=True))
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        for key in sorted(keys, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None),
                                                names)
            if target not in names and key in names:
                target, pattern = key, None
            if target == key or target not in names:
                continue
            converter, groups = self._sources.setdefault(
                target, (by_pattern.get(pattern) if pattern is not None else None, {}))
            groups.setdefault(pattern, []).append(key)

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    def renamed(self) -> Dict[str, str]:
        """``{checkpoint key: parameter name}`` of the parameters that are one checkpoint tensor under another
        name (Mixtral's ``block_sparse_moe.gate.weight`` is the model's ``mlp.gate.weight``)."""
        return {groups[None][0]: name for name, (converter, groups) in self._sources.items()
                if converter is None and list(groups) == [None] and len(groups[None]) == 1}

    def sources(self, name: str) -> Optional[List[List[str]]]:
        """The checkpoint keys that make parameter ``name``, one list per source pattern of its converter (in the
        converter's order; keys in natural order), or None where it is not built from other tensors."""
        if name not in self._sources:
            return None
        converter, groups = self._sources[name]
        order = list(getattr(converter, "source_patterns", None) or groups)
        return [list(groups[p]) for p in order if p in groups]

    def get(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Parameter ``name`` made from the checkpoint tensors ``read(key)`` gives, as transformers loads it."""
        converter, groups = self._sources[name]
        keys = [k for ks in groups.values() for k in ks]
        try:
            if converter is None:
                if len(keys) != 1:
                    raise ValueError(f"{len(keys)} checkpoint tensors are renamed to it")
                return read(keys[0])
            converter = deepcopy(converter)
            for pattern, ks in groups.items():
                for key in ks:
                    converter.add_tensor(name, key, pattern, partial(read, key))
            made = converter.convert(name, model=self._model, config=getattr(self._model, "config", None))
            return made[name]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{name}: cannot build it from the checkpoint's {', '.join(keys[:3])}"
                                  f"{' ...' if len(keys) > 3 else ''} as transformers does ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
