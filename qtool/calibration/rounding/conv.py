"""Convolutions as matrix products, so GPTQ and activation weighting apply to them as to a Linear layer.

A convolution's output at one position is ``W_g · p`` for each group ``g``: ``W_g`` is the group's output rows
(weight ``(out, in/groups, *kernel)`` flattened to ``(out, in/groups·prod(kernel))``) and ``p`` the input patch it
covers (im2col, laid out channel-major like the flattened weight). A layer's input statistics are therefore the
patches' ``sum p²`` and, per group, ``sum p pᵀ``; GPTQ runs once per group on that group's rows.

The patches must be those of the input the convolution *op* receives: modules such as EfficientNet's
``Conv2dStaticSamePadding`` pad in ``forward`` before calling ``F.conv2d``, and ``padding_mode`` other than zeros
pads there too. :func:`capture_conv_input` therefore records the arguments of the ``conv1d``/``conv2d`` call made
inside the module's forward (a ``TorchFunctionMode`` for the duration of that forward only).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["CONV_TYPES", "ConvCall", "capture_conv_input", "patch_rows", "flat_weight"]

CONV_TYPES = (nn.Conv1d, nn.Conv2d)
_CONV_FUNCS = {F.conv1d: 1, F.conv2d: 2, torch.conv1d: 1, torch.conv2d: 2}
_ROWS_PER_CHUNK = 1 << 22  # patch values unfolded at once (memory bound of one step, about 16 MB in float32)


@dataclass(frozen=True)
class ConvCall:
    """What one ``conv1d``/``conv2d`` call computed on: its input and the geometry of the op."""

    x: torch.Tensor
    kernel: Tuple[int, ...]
    stride: Tuple[int, ...]
    padding: Tuple[int, ...]  # per side, as F.pad takes them for the trailing dims (left, right[, top, bottom])
    dilation: Tuple[int, ...]
    groups: int


def _tuple(v, n: int) -> Tuple[int, ...]:
    return tuple(int(a) for a in v) if isinstance(v, (tuple, list)) else (int(v),) * n


def _call_of(func, args, kwargs) -> ConvCall:
    dims = _CONV_FUNCS[func]
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    a = dict(zip(names, args))
    a.update(kwargs)
    w = a["weight"]
    kernel = tuple(int(k) for k in w.shape[2:])
    stride = _tuple(a.get("stride", 1), dims)
    dilation = _tuple(a.get("dilation", 1), dims)
    pad = a.get("padding", 0)
    if isinstance(pad, str):
        if pad == "valid":
            pad = (0,) * dims
        else:  # "same": torch puts the odd extra element on the right / bottom
            total = [d * (k - 1) for d, k in zip(dilation, kernel)]
            sides = [(t // 2, t - t // 2) for t in total]
            return ConvCall(a["input"], kernel, stride, tuple(x for s in reversed(sides) for x in s), dilation,
                            int(a.get("groups", 1)))
    pad = _tuple(pad, dims)
    sides = tuple(x for p in reversed(pad) for x in (p, p))
    return ConvCall(a["input"], kernel, stride, sides, dilation, int(a.get("groups", 1)))


class _Capture(TorchFunctionMode):
    def __init__(self, on_call: Callable[[ConvCall], None]):
        super().__init__()
        self.on_call = on_call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CONV_FUNCS:
            self.on_call(_call_of(func, args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def capture_conv_input(module: nn.Module, on_call: Callable[[ConvCall], None]) -> Iterator[None]:
    """While the block runs, every call of ``module`` reports the convolution op's input to ``on_call``."""
    original = module.forward

    def forward(*args, **kwargs):
        with _Capture(on_call):
            return original(*args, **kwargs)

    module.forward = forward
    try:
        yield
    finally:
        del module.forward  # the instance attribute; the class's forward shows through again


def patch_rows(call: ConvCall) -> Iterator[torch.Tensor]:
    """The op's input patches, ``(positions, groups, in/groups·prod(kernel))`` float32, a chunk at a time."""
    x = call.x.detach().as_subclass(torch.Tensor).to(torch.float32)
    if len(call.kernel) == 1:  # conv1d as conv2d of height 1
        x = x.unsqueeze(-2)
        kernel, stride, dilation = (1,) + call.kernel, (1,) + call.stride, (1,) + call.dilation
        padding = call.padding + (0, 0)
    else:
        kernel, stride, dilation, padding = call.kernel, call.stride, call.dilation, call.padding
    if x.dim() == 3:  # an unbatched input
        x = x.unsqueeze(0)
    if any(padding):
        x = F.pad(x, padding)
    n, c = x.shape[:2]
    cols = c * kernel[0] * kernel[1]
    per = max(1, _ROWS_PER_CHUNK // max(1, cols * _positions(x.shape[2:], kernel, stride, dilation)))
    pointwise = kernel == (1, 1) and stride == (1, 1)
    for i in range(0, n, per):
        if pointwise:  # a 1x1 convolution's patches are its input's pixels
            p = x[i:i + per].flatten(2)
        else:
            p = F.unfold(x[i:i + per], kernel, dilation=dilation, stride=stride)  # (n, cols, L)
        yield p.transpose(1, 2).reshape(-1, call.groups, cols // call.groups)


def _positions(size, kernel, stride, dilation) -> int:
    out = 1
    for s, k, st, d in zip(size, kernel, stride, dilation):
        out *= max(0, (int(s) - d * (k - 1) - 1) // st + 1)
    return max(out, 1)


def flat_weight(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A conv weight ``(out, in/groups, *kernel)`` as ``(groups, out/groups, in/groups·prod(kernel))``."""
    return weight.reshape(groups, weight.shape[0] // groups, -1)
