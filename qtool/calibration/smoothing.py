"""SmoothQuant: move activation range into the weights before anything is calibrated.

For a smooth module ``S`` (a norm, or a Linear) whose output is the input of balance layers ``B1..Bk``, each input
channel ``j`` gets ``s_j = max|x_j|^alpha / max_i max|Bi.weight[:, j]|^(1 - alpha)``; ``S``'s output channel ``j``
is divided by ``s_j`` (a norm's weight and bias, a Linear's weight row and bias) and every ``Bi.weight[:, j]`` is
multiplied by it. The float model computes the same function (up to float rounding), but the balance layers'
inputs have flatter channels, so one per-tensor activation range wastes fewer steps on a few outlier channels.

:func:`activation_absmax` gathers ``max|x_j|`` with forward pre-hooks while the caller runs the data;
:func:`smooth` folds the scales in place and returns the changed tensors (stored as ``float/`` replacements in
``codes.safetensors`` so every exporter writes the smoothed weights, see qtool.weights).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List

import torch
from torch import nn

from ..config import SmoothGroup

__all__ = ["activation_absmax", "smoothing_scales", "smooth", "fold_scales"]

_MIN_SCALE = 1e-5


def activation_absmax(groups: Iterable[SmoothGroup], modules: Dict[str, nn.Module],
                      run: Callable[[], None]) -> Dict[str, torch.Tensor]:
    """``{smooth module: max|x_j| per channel}`` of its balance layers' (shared) input, while ``run()`` feeds the
    data through the float model."""
    out: Dict[str, torch.Tensor] = {}
    handles = []

    def hook_for(name: str):
        def hook(module, args):
            x = args[0].detach()
            m = x.abs().reshape(-1, x.shape[-1]).amax(0).to(torch.float32)
            out[name] = m if name not in out else torch.maximum(out[name], m)
        return hook

    try:
        for g in sorted(groups, key=lambda g: g.smooth):
            handles.append(modules[g.balance[0]].register_forward_pre_hook(hook_for(g.smooth)))
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return out


def smoothing_scales(act_absmax: torch.Tensor, weights: List[torch.Tensor], alpha: float) -> torch.Tensor:
    """``s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha)`` over the balance weights (float32, ``(in,)``); channels the
    data never reached, or that no weight reads, keep 1."""
    w_max = torch.stack([w.detach().abs().to(torch.float32).amax(0) for w in weights]).amax(0)
    a = act_absmax.to(w_max.device)
    s = a.pow(alpha) / w_max.pow(1 - alpha)
    s = torch.where((a > 0) & (w_max > 0) & torch.isfinite(s), s, torch.ones_like(s))
    return s.clamp(min=_MIN_SCALE)


@torch.no_grad()
def smooth(group: SmoothGroup, modules: Dict[str, nn.Module], act_absmax: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Fold one group's SmoothQuant scales into its modules in place (:func:`fold_scales`)."""
    balance = [modules[n] for n in group.balance]
    return fold_scales(group, modules, smoothing_scales(act_absmax, [b.weight for b in balance], group.alpha))


@torch.no_grad()
def fold_scales(group: SmoothGroup, modules: Dict[str, nn.Module], s: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per input channel ``j`` of the balance layers: the smooth module's output channel ``j`` divided by ``s_j``
    (a norm's weight and bias, a Linear's weight row and bias), every balance weight's column ``j`` multiplied by
    it, in place; returns ``{parameter name: new value}`` for every changed tensor (SmoothQuant's and AWQ's fold)."""
    balance = [modules[n] for n in group.balance]
    changed: Dict[str, torch.Tensor] = {}
    src = modules[group.smooth]
    if isinstance(src, nn.Linear):
        src.weight.div_(s.to(src.weight).unsqueeze(1))
    else:
        src.weight.div_(s.to(src.weight))
    changed[f"{group.smooth}.weight"] = src.weight
    if getattr(src, "bias", None) is not None:
        src.bias.div_(s.to(src.bias))
        changed[f"{group.smooth}.bias"] = src.bias
    for name, b in zip(group.balance, balance):
        b.weight.mul_(s.to(b.weight))
        changed[f"{name}.weight"] = b.weight
    return {k: v.detach().clone().cpu() for k, v in changed.items()}
