"""Batch-norm folding (AIMET's ``fold_all_batch_norms``): a convolution followed by a BatchNorm computes
``γ (W x + b - μ) / σ + β`` with ``σ = sqrt(var + eps)``; folded, the convolution's weight rows are ``W γ/σ`` (and
its bias ``b γ/σ``), and the norm only adds ``β - γ μ / σ``. Quantizing the folded weight quantizes the weight an
integer runtime runs once it has folded the norm itself, and a per-tensor grid then sees the channels at the scale
they have at the norm's output.

Every tensor keeps its shape, so the checkpoint's layout (and every exporter) is unchanged: the norm stays, with
``running_mean = 0``, ``running_var = 1 - eps`` (so ``sqrt(var + eps)`` is exactly 1 in float32), ``weight = 1``
and ``bias = β - γ μ / σ``. The changed tensors are stored as ``float/`` replacements (qtool.weights), like
SmoothQuant's.

A pair from the plan (:class:`qtool.config.BatchNormFold`: a norm after a convolution in module order) is folded
only if, on one batch, the norm's input is the very tensor the convolution returned.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from ..config import BatchNormFold

__all__ = ["adjacent_pairs", "fold_batch_norm"]


def adjacent_pairs(folds: List[BatchNormFold], modules: Dict[str, nn.Module],
                   run_one: Callable[[], None]) -> Tuple[List[BatchNormFold], List[BatchNormFold]]:
    """``(confirmed, refused)``: the candidates whose norm received exactly its convolution's output while
    ``run_one()`` ran a batch, and the others (a norm fed by something else, or that never ran)."""
    outputs: Dict[str, int] = {}
    inputs: Dict[str, List[int]] = {}
    handles = []

    def conv_hook(name):
        def hook(module, args, out):
            outputs[name] = id(out)
        return hook

    def bn_hook(name):
        def hook(module, args):
            inputs.setdefault(name, []).append(id(args[0]) if args else -1)
        return hook

    try:
        for f in folds:
            handles.append(modules[f.conv].register_forward_hook(conv_hook(f.conv)))
            handles.append(modules[f.bn].register_forward_pre_hook(bn_hook(f.bn)))
        with torch.no_grad():
            run_one()
    finally:
        for h in handles:
            h.remove()
    confirmed, refused = [], []
    for f in folds:
        ok = f.conv in outputs and inputs.get(f.bn) == [outputs[f.conv]]
        (confirmed if ok else refused).append(f)
    return confirmed, refused


@torch.no_grad()
def fold_batch_norm(conv: nn.Module, bn: nn.modules.batchnorm._BatchNorm, conv_name: str,
                    bn_name: str) -> Dict[str, torch.Tensor]:
    """Fold ``bn`` into ``conv`` in place; returns ``{tensor name: new value}`` for every changed tensor."""
    eps = float(bn.eps)
    if not 0 < eps < 1:
        raise ValueError(f"{bn_name}: eps {eps} must be in (0, 1) to fold")
    if bn.weight is None or bn.bias is None:
        raise ValueError(f"{bn_name}: a norm without affine weight and bias has nowhere to keep the folded shift")
    var = bn.running_var.to(torch.float32)
    sigma = torch.sqrt(var + eps)
    gamma, beta = bn.weight.to(torch.float32), bn.bias.to(torch.float32)
    ratio = gamma / sigma
    shape = (-1,) + (1,) * (conv.weight.dim() - 1)
    conv.weight.mul_(ratio.reshape(shape).to(conv.weight.dtype))
    changed = {f"{conv_name}.weight": conv.weight}
    if conv.bias is not None:
        conv.bias.mul_(ratio.to(conv.bias.dtype))
        changed[f"{conv_name}.bias"] = conv.bias
    shift = beta - ratio * bn.running_mean.to(torch.float32)
    one_minus = torch.tensor(1.0 - eps, dtype=torch.float32)
    while float(torch.sqrt(one_minus + torch.tensor(eps, dtype=torch.float32))) != 1.0:
        one_minus = torch.nextafter(one_minus, torch.tensor(0.0))  # sqrt(var + eps) must be exactly 1
    bn.running_mean.zero_()
    bn.running_var.fill_(float(one_minus))
    changed[f"{bn_name}.running_mean"] = bn.running_mean
    changed[f"{bn_name}.running_var"] = bn.running_var
    bn.weight.fill_(1.0)
    bn.bias.copy_(shift.to(bn.bias.dtype))
    changed[f"{bn_name}.weight"] = bn.weight
    changed[f"{bn_name}.bias"] = bn.bias
    return changed
