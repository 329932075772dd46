"""Tracing for the ONNX export (see ``qtool.export.onnx_qdq``): while torch's TorchScript exporter traces the
fake-quant model, every quantizer emits one placeholder node (``qtool::FakeQuant`` with its scale, zero point,
grid, axis and block size, or ``qtool::DynamicFakeQuant``) that the graph pass (``onnx_graph``) expands; plus the
wrapper that feeds the model an example batch positionally and flattens what it returns."""

from __future__ import annotations

import contextlib
from typing import Dict, List, Tuple

import torch
from torch import nn

from ..errors import UsageError
from ..quant import QuantizeDequantize, quantize_dequantize
from ..quant.floatgrid import float_quantize_dequantize
from ..quant.spec import axis_and_block


class _FakeQuantOnnx(torch.autograd.Function):
    """Fake-quant forward; exported as one ``qtool::FakeQuant`` node that the graph pass expands."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, name, qmin, qmax, axis, block):
        offset = -zero_point.to(torch.float32)
        bs = None
        if block:
            bs = tuple(block if d == axis else (1 if d == 0 else -1) for d in range(x.dim()))
        return quantize_dequantize(x, scale, offset, qmin=qmin, qmax=qmax, block_size=bs)

    @staticmethod
    def symbolic(g, x, scale, zero_point, name, qmin, qmax, axis, block):
        out = g.op("qtool::FakeQuant", x, scale, zero_point, name_s=name, qmin_i=qmin, qmax_i=qmax,
                   axis_i=axis, block_i=block)
        out.setType(x.type())  # same shape and dtype as the input (keeps the exporter's shape inference quiet)
        return out


class _FloatFakeQuantOnnx(torch.autograd.Function):
    """Float-grid fake-quant forward (FP8 under float32 scales); exported as the same ``qtool::FakeQuant`` node,
    which the graph pass turns into float8 QuantizeLinear/DequantizeLinear."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, name, qmin, qmax, axis, block, element, block_size):
        return float_quantize_dequantize(x, scale, element, block_size)

    @staticmethod
    def symbolic(g, x, scale, zero_point, name, qmin, qmax, axis, block, element, block_size):
        out = g.op("qtool::FakeQuant", x, scale, zero_point, name_s=name, qmin_i=qmin, qmax_i=qmax,
                   axis_i=axis, block_i=block)
        out.setType(x.type())
        return out


class _DynamicFakeQuantOnnx(torch.autograd.Function):
    """Dynamic fake-quant forward; exported as one ``qtool::DynamicFakeQuant`` node that the graph pass expands."""

    @staticmethod
    def forward(ctx, x, run, name, qmin, qmax, mode, channels):
        # ``run`` is the quantizer's own forward. The graph pass writes this node's computation, so the tracer need
        # not follow it (and cannot: its peephole pass drops the identity `t - 0` of an asymmetric 8-bit grid
        # inside a Function and then loses the value)
        state = torch._C._get_tracing_state()
        torch._C._set_tracing_state(None)
        try:
            return run(x)
        finally:
            torch._C._set_tracing_state(state)

    @staticmethod
    def symbolic(g, x, run, name, qmin, qmax, mode, channels):
        out = g.op("qtool::DynamicFakeQuant", x, name_s=name, qmin_i=qmin, qmax_i=qmax, mode_s=mode,
                   channels_i=channels)
        out.setType(x.type())
        return out


def _on(x: torch.Tensor, scale: torch.Tensor, axis: int) -> int:
    """``axis`` of an encoding of ``scale``'s shape as an axis of ``x``: the encoding lines up with the tensor's
    last dimensions (a KV cache's per-head ``[heads, 1, 1]`` scales on ``[batch, heads, tokens, head_dim]``: its
    axis 0 is the tensor's axis 1, where axis 0 quantized across the batch)."""
    return axis + max(x.dim() - scale.dim(), 0)


@contextlib.contextmanager
def onnx_export_mode(quantizers: Dict[str, QuantizeDequantize]):
    """Make every quantizer call ``_FakeQuantOnnx`` with constant scale/zero point while tracing (a dynamic one:
    ``_DynamicFakeQuantOnnx``)."""
    saved = {}
    for name, q in quantizers.items():
        if q.spec.dynamic:
            def dyn(x, _q=q, _n=name, _run=q.forward):
                x = x.as_subclass(torch.Tensor)
                kind = "fp8" if _q.spec.is_float else "symmetric" if _q.symmetric else "asymmetric"
                mode = kind + " " + ("per_token" if _q.per_token else "per_tensor")
                channels = int(x.shape[-1]) if x.dim() else 1
                return _DynamicFakeQuantOnnx.apply(x, _run, _n, _q.qmin, _q.qmax, mode, channels)

            saved[name] = q.forward
            q.forward = dyn
            continue
        if q.spec.is_float:  # a float grid: its effective scales, zero points 0
            scale = q.scales()[1].detach().clone()
            zp = torch.zeros(scale.shape, dtype=torch.int32)
            gran = "per_block" if q.block_size is not None else ("per_channel" if scale.numel() > 1 else "per_tensor")
            axis, block = axis_and_block(gran, tuple(scale.shape), q.block_size)

            def ffwd(x, _q=q, _s=scale, _z=zp, _n=name, _a=axis or 0, _b=block or 0):
                return _FloatFakeQuantOnnx.apply(x.as_subclass(torch.Tensor), _s, _z, _n, 0, 255, _on(x, _s, _a), _b,
                                                 _q.element, _q.block_size)

            saved[name] = q.forward
            q.forward = ffwd
            continue
        enc = q.get_encodings()
        scale = enc.scale.detach().clone()
        zp = (-enc.offset.detach()).to(torch.int32)
        gran = "per_block" if q.block_size is not None else ("per_channel" if scale.numel() > 1 else "per_tensor")
        axis, block = axis_and_block(gran, tuple(scale.shape), q.block_size)
        axis, block = axis or 0, block or 0

        def fwd(x, _q=q, _s=scale, _z=zp, _n=name, _a=axis, _b=block):
            return _FakeQuantOnnx.apply(x.as_subclass(torch.Tensor), _s, _z, _n, _q.qmin, _q.qmax, _on(x, _s, _a), _b)

        saved[name] = q.forward
        q.forward = fwd
    try:
        yield
    finally:
        for name, q in quantizers.items():
            q.forward = saved[name]


@contextlib.contextmanager
def _captured_fds():
    """Send what the exporter's C++ side writes to stdout/stderr into a temporary file (the library never prints)."""
    import os
    import sys
    import tempfile

    # a process started with stdout or stderr closed has None there, and its descriptor may since be another file
    # (the first one opened takes the lowest number): that one is left alone
    streams = {fd: stream for fd, stream in ((1, sys.stdout), (2, sys.stderr)) if stream is not None}
    for stream in streams.values():
        stream.flush()
    saved = {fd: os.dup(fd) for fd in streams}
    with tempfile.TemporaryFile("w+b") as sink:
        try:
            for fd in saved:
                os.dup2(sink.fileno(), fd)
            yield
        finally:
            for fd, dup in saved.items():
                os.dup2(dup, fd)
                os.close(dup)


class _Positional(nn.Module):
    """Calls the model with keyword inputs given positionally, and returns a flat tuple of tensors."""

    def __init__(self, model: nn.Module, arg_names: List[str], kw_names: List[str]):
        super().__init__()
        self.model, self.arg_names, self.kw_names = model, arg_names, kw_names

    def forward(self, *tensors):
        args = tensors[: len(self.arg_names)]
        kwargs = dict(zip(self.kw_names, tensors[len(self.arg_names):]))
        return _flatten(self.model(*args, **kwargs))[1]


def _flatten(out) -> Tuple[List[str], Tuple[torch.Tensor, ...]]:
    if isinstance(out, torch.Tensor):
        return ["output"], (out,)
    if isinstance(out, dict):  # transformers' ModelOutput is a dict
        items = [(k, v) for k, v in out.items() if isinstance(v, torch.Tensor)]
        return [k for k, _ in items], tuple(v for _, v in items)
    if isinstance(out, (tuple, list)):
        tensors = tuple(v for v in out if isinstance(v, torch.Tensor))
        return [f"output_{i}" for i in range(len(tensors))], tensors
    raise UsageError(f"ONNX export: the model returns {type(out).__name__}, not tensors")


def takes_keyword(model: nn.Module, name: str) -> bool:
    """Whether ``model``'s forward names the keyword ``name`` (a ``**kwargs`` may pass it on to a function that
    rejects it: not taken as taking it)."""
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _signature(batch) -> Tuple[Tuple, Dict[str, torch.Tensor], List[str], Dict[str, Dict[int, str]]]:
    """(args, kwargs, input names, dynamic axes) of an example batch."""
    if batch.args:  # (a one-tensor data file: token ids keep their dynamic length, as input_ids do)
        return batch.args, batch.kwargs, ["input"], {"input": _dynamic_axes("input", batch.args[0])}
    names = list(batch.kwargs)
    dyn = {k: _dynamic_axes(k, v) for k, v in batch.kwargs.items()}
    return batch.args, batch.kwargs, names, dyn


def _dynamic_axes(name: str, value: torch.Tensor) -> Dict[int, str]:
    """The batch, and the sequence of a token tensor (integer ``[batch, tokens]``), a waveform (``input_values``) or
    ``inputs_embeds``, whose length is its own for a decoder's inputs (T5's ``decoder_input_ids`` run at another
    length than the encoder's). Other float inputs (an image's channels and pixels, a spectrogram's bins, a table's
    features) keep their sizes."""
    if value.dim() < 2 or (value.is_floating_point() and name != "input_values" and not name.endswith("inputs_embeds")):
        return {0: "batch"}
    return {0: "batch", 1: "decoder_sequence" if name.startswith("decoder_") else "sequence"}
