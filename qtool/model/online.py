"""Rotations of activations at run time (online), put on a model's modules as forward pre-hooks.

An online rotation (``config.OnlineRotation``; R4: ``down_proj``'s input) replaces a module's first input ``x``
by ``x R`` before anything else sees it: its input quantizer, the statistics GPTQ collects, SmoothQuant's
maxima. ``R``'s inverse is fused into the module's weight (``W R``, qtool.calibration.rotation), so the float
function is unchanged. The rotation is computed in float32 with the fast transform (``O(n log n)`` per token).
Installing is idempotent; a module's hook is found again by its attribute, so calibration, ``load_calibrated``,
the report and the exporters that load the model all run the same code.
"""

from __future__ import annotations

import functools
from typing import Dict, Iterable, Optional

import torch
from torch import nn

from ..config import OnlineRotation
from ..quant.hadamard import hadamard_transform

__all__ = ["install_online", "online_rotations"]

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
        if rot.location != "input":
            raise ValueError(f"online rotation {rot.name}: location {rot.location!r} is not supported")
        for name in rot.modules:
            if only is not None and name != only:
                continue
            module = modules[name]
            if _ATTR in module.__dict__:
                if module.__dict__[_ATTR][0] != rot:
                    raise ValueError(f"{name} already rotates its input by another rotation")
                continue
            hook = module.register_forward_pre_hook(functools.partial(_rotate_input, rot.kind, rot.seed),
                                                    prepend=True)
            module.__dict__[_ATTR] = (rot, hook)


def online_rotations(model: nn.Module) -> dict:
    """``{module name: OnlineRotation}`` of every module that rotates its input."""
    return {name: m.__dict__[_ATTR][0] for name, m in model.named_modules() if _ATTR in m.__dict__}
