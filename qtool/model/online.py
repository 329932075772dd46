"""Rotations of activations at run time (online), put on a model's modules.

An input rotation (``config.OnlineRotation`` at ``input``; R4: ``down_proj``'s input) is a forward pre-hook that
replaces a module's first input ``x`` by ``x R`` before anything else sees it: its input quantizer, the
statistics GPTQ collects, SmoothQuant's maxima. ``R``'s inverse is fused into the module's weight (``W R``,
qtool.calibration.rotation), so the float function is unchanged.

A key rotation (at ``k_cache``; R3) marks an attention layer whose KV cache quantizer sees each head's keys
rotated: the quantized cache holds ``Q(k R)``, and attention computes ``(q R) Q(k R)ᵀ``, which is what
compressed-tensors runs (queries and keys rotated after RoPE). The fake-quant model computes the same product as
``q (Q(k R) Rᵀ)ᵀ``: the rotation is undone on the quantized keys instead of applied to the queries
(qtool.model.insert), so the layer's own attention code runs unchanged.

Rotations are computed in float32 with the fast transform (``O(n log n)`` per token). Installing is idempotent; a
module's rotation is found again by its attribute, so calibration, ``load_calibrated``, the report and the
exporters that load the model all run the same code.
"""

from __future__ import annotations

import functools
from typing import Dict, Iterable, Optional

import torch
from torch import nn

from ..config import OnlineRotation
from ..quant.hadamard import hadamard_transform

__all__ = ["install_online", "online_rotations", "key_rotation", "rotate_keys", "rotated_width"]

_ATTR = "_qtool_online"


def _rotate_input(kind: str, seed: int, module: nn.Module, args):
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
        return None
    return (hadamard_transform(args[0], kind, seed, compute=torch.float32),) + tuple(args[1:])


def install_online(modules: Dict[str, nn.Module], rotations: Iterable[OnlineRotation],
                   only: Optional[str] = None) -> None:
    """Every module each rotation names (or only the one named ``only``) rotates its input from now on (once,
    however often this is called). ``modules``: the model's ``dict(named_modules())``."""
    for rot in rotations:
        if rot.location not in ("input", "k_cache"):
            raise ValueError(f"online rotation {rot.name}: location {rot.location!r} is not supported")
        for name in rot.modules:
            if only is not None and name != only:
                continue
            module = modules[name]
            if _ATTR in module.__dict__:
                if module.__dict__[_ATTR][0] != rot:
                    raise ValueError(f"{name} already rotates its {rot.location} by another rotation")
                continue
            hook = None
            if rot.location == "input":
                hook = module.register_forward_pre_hook(functools.partial(_rotate_input, rot.kind, rot.seed),
                                                        prepend=True)
            module.__dict__[_ATTR] = (rot, hook)


def online_rotations(model: nn.Module) -> dict:
    """``{module name: OnlineRotation}`` of every module that rotates its input or its cached keys."""
    return {name: m.__dict__[_ATTR][0] for name, m in model.named_modules() if _ATTR in m.__dict__}


def key_rotation(module: nn.Module) -> Optional[OnlineRotation]:
    """The rotation of ``module``'s cached keys (r3), or None."""
    found = module.__dict__.get(_ATTR)
    return found[0] if found is not None and found[0].location == "k_cache" else None


def rotate_keys(rot: OnlineRotation, keys: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``keys R`` per head (the last dimension, ``head_dim``), or ``keys Rᵀ`` with ``inverse``; float32."""
    return hadamard_transform(keys, rot.kind, rot.seed, compute=torch.float32, inverse=inverse)


def rotated_width(module: nn.Module, rot: OnlineRotation) -> int:
    """The width ``rot`` rotates on ``module``: a Linear's input width (``input``), an attention layer's
    ``head_dim`` (``k_cache``). Raises ``ValueError`` where the module has none."""
    if rot.location == "k_cache":
        d = getattr(module, "head_dim", None)
        if not isinstance(d, int) or d <= 0:
            raise ValueError(f"{type(module).__name__} has no head_dim to rotate the keys of")
        return d
    if not isinstance(module, nn.Linear):
        raise ValueError(f"{type(module).__name__} is not a Linear layer")
    return module.in_features
