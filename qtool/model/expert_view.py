"""A checkpoint that stores fused expert tensors, shown under the per-expert names qtool quantizes.

gpt-oss stores each MoE layer's experts as ``experts.gate_up_proj [E, H, 2I]`` (gate and up columns interleaved),
``experts.down_proj [E, I, H]`` and their biases; GraniteMoE as ``input_linear.weight [E, 2I, H]``. In memory
qtool splits them into one ``nn.Linear`` per expert and projection (:func:`.experts.linearize_experts`), so every
plan, algorithm and quantizer sees ``experts.<e>.gate_proj.weight``. The exporters, ``--sequential`` and the
streaming weight pass read the checkpoint by tensor name; :class:`ExpertSlices` gives them the same names: each
fused tensor is replaced by its per-expert slices (weights ``[out, in]`` as the Linear holds them, biases
``[out]``), and reading one reads only that expert's part of the file. The files written then name the experts
as llm-compressor does for a linearized gpt-oss (what vLLM's MoE loaders read).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..io.checkpoint import CheckpointTensors, detect_kind
from .experts import FUSED_SLICES, linear_part

__all__ = ["ExpertSlices", "open_checkpoint", "fused_candidates"]

Slices = Dict[str, Tuple[str, int, str, Dict[str, bool]]]


class ExpertSlices:
    """``tensors`` (a :class:`CheckpointTensors`) with each fused expert tensor named in ``slices`` (``{per-expert
    name: (checkpoint key, expert, role, layout)}``) replaced by its per-expert slices. Same reading interface."""

    def __init__(self, tensors: CheckpointTensors, slices: Slices):
        self.tensors = tensors
        self.path, self.files = tensors.path, tensors.files
        self.slices = dict(slices)
        sources = {s[0] for s in self.slices.values()}
        self._keys = sorted([k for k in tensors.keys() if k not in sources] + list(self.slices))

    def keys(self) -> List[str]:
        return list(self._keys)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.slices:
            return self.tensors.get(name)
        key, expert, role, layout = self.slices[name]
        return linear_part(self.tensors.get_index(key, expert), layout, role).contiguous()

    def shape_dtype(self, name: str):
        if name not in self.slices:
            return self.tensors.shape_dtype(name)
        key, _, role, layout = self.slices[name]
        shape, dtype = self.tensors.shape_dtype(key)
        return tuple(linear_part(torch.empty(shape[1:], device="meta"), layout, role).shape), dtype


def open_checkpoint(path, trust_pickle: bool = False, trust_remote_code: bool = False,
                    model: Optional[nn.Module] = None, model_class: Optional[str] = None):
    """The checkpoint's tensors as qtool's model names them: a :class:`CheckpointTensors`, or :class:`ExpertSlices`
    over it where the checkpoint stores fused experts. ``model``: its linearized model or meta skeleton, if one is
    at hand (else the skeleton is built from ``config.json``, or by ``model_class`` for a state dict, only when the
    checkpoint holds 3-D tensors and, for a directory, its config counts experts)."""
    tensors = CheckpointTensors(Path(path), trust_pickle=trust_pickle)
    if model is not None:
        slices = dict(getattr(model, FUSED_SLICES, {}))
    elif model_class is not None and detect_kind(tensors.path) != "hf":
        slices = _factory_slices(str(Path(path).resolve()), model_class, _stamp(path, tensors),
                                 tuple(tensors.keys())) if fused_candidates(tensors) else {}
    else:
        slices = _slices_of(str(Path(path).resolve()), trust_remote_code, _stamp(path, tensors)) \
            if _may_fuse(tensors) else {}
    return ExpertSlices(tensors, slices) if slices else tensors


# the last part of a fused experts module's 3-D tensor's name as a state dict of the module holds it
# (transformers' experts decorator's names; GraniteMoE's parallel experts)
_FUSED_NAMES = ("gate_up_proj", "up_proj", "down_proj", "input_linear.weight", "output_linear.weight")


def fused_candidates(tensors: CheckpointTensors) -> List[str]:
    """The names of a state dict's 3-D tensors named as a fused experts module's (the names first: a header is read
    for those few only)."""
    return [k for k in tensors.keys() if k.endswith(_FUSED_NAMES) and len(tensors.shape_dtype(k)[0]) == 3]


def _may_fuse(tensors: CheckpointTensors) -> bool:
    """Whether the checkpoint could store fused experts: a Hugging Face directory whose config names experts and
    whose weights hold a 3-D tensor (headers only)."""
    if detect_kind(tensors.path) != "hf":  # (its CheckpointTensors has found every shard)
        return False
    try:
        config = json.loads((tensors.path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if "expert" not in json.dumps(config):
        return False
    from safetensors import safe_open

    for f in tensors.files:  # one open per file (shape_dtype opens the file for every tensor)
        with safe_open(str(f), "pt") as fh:
            if any(len(fh.get_slice(k).get_shape()) == 3 for k in fh.keys()):
                return True
    return False


def _stamp(path, tensors) -> tuple:
    """What a cached answer for ``path`` holds good for: its config's and weight files' sizes and modification
    times (another model saved in the same directory by the same process gets its own)."""
    files = [Path(path) / "config.json", *tensors.files]
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


@lru_cache(maxsize=4)
def _factory_slices(path: str, model_class: str, stamp: tuple, keys: Tuple[str, ...]) -> Slices:
    """The fused-expert slices of a state dict (tensor names ``keys``) whose model ``model_class`` builds, as the
    load splits them."""
    from .experts import fused_layout, linearize_experts
    from .load import factory_skeleton

    model = factory_skeleton(model_class)
    if not any(fused_layout(m) is not None for m in model.modules()):
        return {}
    linearize_experts(model, keys)
    return dict(getattr(model, FUSED_SLICES, {}))


@lru_cache(maxsize=4)
def _slices_of(path: str, trust_remote_code: bool, stamp: tuple) -> Slices:
    from .hf import meta_skeleton

    return dict(getattr(meta_skeleton(path, trust_remote_code), FUSED_SLICES, {}))
