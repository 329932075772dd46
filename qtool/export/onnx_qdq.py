"""ONNX export with QuantizeLinear / DequantizeLinear (QDQ), checked by onnxruntime in the tests.

How: the calibrated fake-quant model is traced by torch's TorchScript ONNX exporter while every quantizer emits
one placeholder node (``qtool::FakeQuant``, carrying its scale, zero point, grid, axis and block size). A pass
over the ONNX graph then rewrites each placeholder:

* on a weight (the placeholder's input is an initializer): the integer codes replace the float initializer
  under the parameter's own name (int8/uint8, int4/uint4 packed two per byte, int16/uint16), followed by
  ``DequantizeLinear`` — per-tensor, per-channel (``axis``) or blocked (opset 21 ``block_size``);
* on an activation: ``QuantizeLinear`` + ``DequantizeLinear`` (per-tensor);
* on a dynamic activation (``qtool::DynamicFakeQuant``): the range computed in the graph from the tensor itself
  (``ReduceMin``/``ReduceMax`` over the last axis per token, or over everything per tensor), turned into a scale
  and zero point by qtool's min-max rule written out in standard ops, then ``QuantizeLinear`` +
  ``DequantizeLinear`` with that computed scale (per token: opset 21 blocked, one block per token).

The codes use qtool's division path, which is exactly ONNX QuantizeLinear's ``round_half_even(x / y_scale) +
y_zero_point``, so the graph computes what qtool's fake-quant model computes. The opset is the lowest that the
quantizers need (13 for 8-bit per-tensor and per-channel: 10 would express per-tensor, but onnxruntime's
optimizer rejects QDQ graphs below 11; 21 for blocked or 4/16-bit), raised where the model's own ops need more.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from ..encodings import EncodingsFile
from ..errors import DataError, UsageError
from ..io.finite import check_finite
from ..quant import QuantizeDequantize, quantize, quantize_dequantize
from ..quant.floatgrid import float_quantize, float_quantize_dequantize
from ..quant.spec import axis_and_block
from .base import Exporter, ExportRequest

__all__ = ["export_onnx", "required_opset", "onnx_export_mode"]

_MAX_TORCHSCRIPT_OPSET = 20


# Per-tensor int8 QDQ exists since opset 10, but onnxruntime's graph optimizer rewrites QDQ graphs with ops of
# opset 11+ (it inserts Round when it quantizes Gemm biases) and then rejects an opset-10 model at load time.
_QDQ_FLOOR = 13


def required_opset(enc: EncodingsFile) -> int:
    """The lowest ONNX opset whose QuantizeLinear/DequantizeLinear express every encoding in ``enc`` and that
    onnxruntime loads with its default optimizations (13 for per-tensor and per-channel 8-bit, 21 for blocked
    or 4/16-bit)."""
    need = _QDQ_FLOOR
    for e in enc.entries:
        if e.is_float:
            check_onnx_float(e)
            need = max(need, 21 if e.granularity in ("per_block", "per_token") else 19)
            continue
        if e.bitwidth not in (4, 8, 16):
            raise UsageError(
                f"{e.name}: ONNX QuantizeLinear has no {e.bitwidth}-bit type (4, 8 and 16 bits only); "
                "export this recipe with --format qtool or aimet"
            )
        if e.bitwidth != 8 or e.granularity in ("per_block", "per_token"):
            need = max(need, 21)
        elif e.granularity == "per_channel":
            need = max(need, 13)
    return need


def check_onnx_float(q) -> None:
    """Raise ``UsageError`` unless float quantizer ``q`` (an encodings entry or plan row) has an ONNX QDQ form:
    FP8 E4M3 values under float32 scales (QuantizeLinear/DequantizeLinear with float8e4m3fn, opset 19; blocked
    along one axis, opset 21). FP4 has an ONNX type only from opset 23, and E8M0 or two-level (NVFP4) scales have
    no QuantizeLinear form at all."""
    spec = q.spec
    bs = [b for b in (spec.block_size or ()) if b not in (1, -1)]
    why = None
    if spec.element != "fp8_e4m3" or spec.scale_dtype != "float32":
        why = (f"{spec.element} with {spec.scale_dtype} scales has no ONNX QuantizeLinear form (ONNX QDQ holds FP8 "
               "with float32 scales; FP4 elements, E8M0 and FP8-under-global scales do not fit it)")
    elif spec.dynamic and spec.granularity.value == "per_block":
        why = "dynamic per-block FP8 activations are not written to ONNX (per tensor or per token only)"
    elif len(bs) > 1:
        why = "2-D weight tiles have no ONNX form (DequantizeLinear blocks along one axis)"
    if why:
        raise UsageError(f"{q.name}: {why}; export this recipe with --format compressed-tensors or qtool")


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


@contextlib.contextmanager
def onnx_export_mode(quantizers: Dict[str, QuantizeDequantize]):
    """Make every quantizer call ``_FakeQuantOnnx`` with constant scale/zero point while tracing (a dynamic one:
    ``_DynamicFakeQuantOnnx``)."""
    saved = {}
    for name, q in quantizers.items():
        if getattr(q, "dynamic", False):
            def dyn(x, _q=q, _n=name, _run=q.forward):
                x = x.as_subclass(torch.Tensor)
                kind = "fp8" if hasattr(_q, "element") else "symmetric" if _q.symmetric else "asymmetric"
                mode = kind + " " + ("per_token" if _q.per_token else "per_tensor")
                channels = int(x.shape[-1]) if x.dim() else 1
                return _DynamicFakeQuantOnnx.apply(x, _run, _n, _q.qmin, _q.qmax, mode, channels)

            saved[name] = q.forward
            q.forward = dyn
            continue
        if hasattr(q, "element"):  # a float grid: its effective scales, zero points 0
            scale = q.scales()[1].detach().clone()
            zp = torch.zeros(scale.shape, dtype=torch.int32)
            gran = "per_block" if q.block_size is not None else ("per_channel" if scale.numel() > 1 else "per_tensor")
            axis, block = axis_and_block(gran, tuple(scale.shape), q.block_size)

            def ffwd(x, _q=q, _s=scale, _z=zp, _n=name, _a=axis or 0, _b=block or 0):
                return _FloatFakeQuantOnnx.apply(x.as_subclass(torch.Tensor), _s, _z, _n, 0, 255, _a, _b, _q.element,
                                                 _q.block_size)

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
            return _FakeQuantOnnx.apply(x.as_subclass(torch.Tensor), _s, _z, _n, _q.qmin, _q.qmax, _a, _b)

        saved[name] = q.forward
        q.forward = fwd
    try:
        yield
    finally:
        for name, q in quantizers.items():
            q.forward = saved[name]


# --------------------------------------------------------------------------------------------------------------
# The graph pass
# --------------------------------------------------------------------------------------------------------------
def _onnx_int_type(bits: int, signed: bool):
    from onnx import TensorProto

    return {(4, True): TensorProto.INT4, (4, False): TensorProto.UINT4, (8, True): TensorProto.INT8,
            (8, False): TensorProto.UINT8, (16, True): TensorProto.INT16, (16, False): TensorProto.UINT16}[(bits, signed)]


def _int_tensor(name: str, values, bits: int, signed: bool):
    """An integer initializer stored as raw bytes (4-bit: two per byte, the first value in the low nibble)."""
    from onnx import helper

    values = np.asarray(values)
    dtype = _onnx_int_type(bits, signed)
    if bits == 4:
        from ..quant.packing import pack_bytes

        raw = pack_bytes(torch.from_numpy(values.astype(np.int32).reshape(-1)), 4).numpy().tobytes()
    else:
        np_dtype = {(8, True): np.int8, (8, False): np.uint8, (16, True): np.int16, (16, False): np.uint16}[(bits, signed)]
        raw = values.astype(np_dtype).reshape(-1).astype(np.dtype(np_dtype).newbyteorder("<")).tobytes()
    return helper.make_tensor(name, dtype, list(values.shape), raw, raw=True)


def _rewrite(model, quantizer_info: Dict[str, Dict[str, Any]], opset: int,
             stored: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, str]:
    """Expand every qtool::FakeQuant node; returns quantizer name -> ONNX tensor name."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    # parameters were traced through the wrapper module (`model.`): give them their checkpoint names back
    rename = {i.name: i.name[len("model."):] for i in graph.initializer if i.name.startswith("model.")}
    for i in graph.initializer:
        i.name = rename.get(i.name, i.name)
    for n in graph.node:
        for k, name in enumerate(n.input):
            if name in rename:
                n.input[k] = rename[name]
    inits = {i.name: i for i in graph.initializer}
    consts = {}
    for n in graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    consts[n.output[0]] = numpy_helper.to_array(a.t)

    def value(name):
        if name in inits:
            return numpy_helper.to_array(inits[name])
        return consts[name]

    uses: Dict[str, int] = {}
    for n in graph.node:
        for name in n.input:
            uses[name] = uses.get(name, 0) + 1
    names: Dict[str, str] = {}
    new_nodes: List[Any] = []
    new_inits: List[Any] = []
    drop_inits = set()
    for node in graph.node:
        if node.op_type == "DynamicFakeQuant":
            qname = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "name")
            names[qname.decode() if isinstance(qname, bytes) else qname] = node.input[0]
            new_nodes += _dynamic_qdq(node, opset, new_inits)
            continue
        if node.op_type != "FakeQuant":
            new_nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        qname = attrs["name"].decode() if isinstance(attrs["name"], bytes) else attrs["name"]
        info = quantizer_info[qname]
        bits, signed = info["bitwidth"], info["qmin"] < 0
        if info.get("element"):
            new_nodes += _float_qdq(node, attrs, qname, info, inits, uses, value, stored, new_inits, drop_inits)
            names[qname] = node.input[0]
            continue
        axis, block = int(attrs["axis"]), int(attrs["block"])
        x, s_name, z_name = node.input
        scale = value(s_name).astype(np.float32)
        zp = value(z_name).astype(np.int64)
        is_weight = x in inits and info["tensor"] == "weight"
        codes = None
        if is_weight:
            w, bs = _weight_and_block(inits[x], axis, block)
            s_q = torch.from_numpy(scale)
            if stored and qname in stored:  # codes a rounding algorithm chose (qtool.weights)
                codes = stored[qname].to(torch.float32)
            else:
                codes = quantize(w, s_q, -torch.from_numpy(zp.astype(np.float32)).reshape(s_q.shape),
                                 qmin=info["qmin"], qmax=info["qmax"], block_size=bs)
            if block:  # ONNX blocked scales have the input's rank with every other dim at full size
                target = [w.shape[d] // block if d == axis else w.shape[d] for d in range(w.dim())]
                zp = np.ascontiguousarray(np.broadcast_to(zp.reshape(scale.shape) if zp.size > 1 else zp, target))
                scale = np.ascontiguousarray(np.broadcast_to(scale, target))
        if not block:
            if scale.size > 1:
                scale, zp = scale.reshape(-1), np.broadcast_to(zp, scale.shape).reshape(-1)
            else:
                scale, zp = scale.reshape(()), zp.reshape(())
        base = x if is_weight else qname
        s_init = numpy_helper.from_array(scale, f"{base}_scale")
        z_init = _int_tensor(f"{base}_zero_point", zp, bits, signed)
        new_inits += [s_init, z_init]
        q_attrs = {}
        if scale.size > 1:
            q_attrs["axis"] = axis
        if block:
            q_attrs["block_size"] = block
        if is_weight:
            # the integer codes take the parameter's own name, as AIMET's encodings key parameters by it, unless the
            # float parameter is used elsewhere too (a tied weight), which then keeps it
            shared = uses.get(x, 0) > 1
            q_init = _int_tensor(f"{x}_quantized" if shared else x, codes.numpy(), bits, signed)
            new_inits.append(q_init)
            if not shared:
                drop_inits.add(x)
            new_nodes.append(helper.make_node("DequantizeLinear", [q_init.name, s_init.name, z_init.name],
                                              list(node.output), name=f"{x}_dequantize", **q_attrs))
            names[qname] = x
        else:
            q_out = f"{qname}_q"
            new_nodes.append(helper.make_node("QuantizeLinear", [x, s_init.name, z_init.name], [q_out],
                                              name=f"{qname}_quantize", **q_attrs))
            new_nodes.append(helper.make_node("DequantizeLinear", [q_out, s_init.name, z_init.name],
                                              list(node.output), name=f"{qname}_dequantize", **q_attrs))
            names[qname] = x
    used = {i for n in new_nodes for i in n.input}
    keep_nodes = [n for n in new_nodes if not (n.op_type == "Constant" and not (set(n.output) & used))]
    del graph.node[:]
    graph.node.extend(keep_nodes)
    kept = [i for i in graph.initializer if i.name not in drop_inits]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    del model.opset_import[:]
    model.opset_import.extend([helper.make_opsetid("", opset)])
    if model.ir_version < 10 and opset >= 21:
        model.ir_version = 10
    onnx.checker.check_model(model)
    return names


def _fp8_tensor(name: str, codes: np.ndarray):
    """A float8e4m3fn initializer from FP8 codes (the float8 bytes)."""
    from onnx import TensorProto, helper

    raw = np.asarray(codes).astype(np.uint8).reshape(-1).tobytes()
    return helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, list(np.shape(codes)), raw, raw=True)


def _weight_and_block(init, axis: int, block: int):
    """A weight initializer as a float32 tensor, and the ``block_size`` of its ``qtool::FakeQuant`` (None unless
    blocked: ``block`` along ``axis``, full length elsewhere)."""
    from onnx import numpy_helper

    w = torch.from_numpy(numpy_helper.to_array(init).astype(np.float32))
    if not block:
        return w, None
    return w, tuple(block if d == axis else (1 if d == 0 else -1) for d in range(w.dim()))


def _float_qdq(node, attrs, qname, info, inits, uses, value, stored, new_inits, drop_inits) -> List[Any]:
    """The nodes replacing one float-grid ``qtool::FakeQuant`` (FP8 under float32 scales): a weight's FP8 codes as
    a float8e4m3fn initializer + DequantizeLinear, an activation's QuantizeLinear + DequantizeLinear, each with a
    float8 zero point 0 (QuantizeLinear saturates, as qtool clamps to ±448 before rounding)."""
    from onnx import helper, numpy_helper

    from ..quant.floatgrid import element_of

    axis, block = int(attrs["axis"]), int(attrs["block"])
    x, s_name, _ = node.input
    scale = value(s_name).astype(np.float32)
    element = element_of(info["element"])
    is_weight = x in inits and info["tensor"] == "weight"
    codes = None
    if is_weight:
        w, bs = _weight_and_block(inits[x], axis, block)
        codes = (stored[qname] if stored and qname in stored
                 else float_quantize(w, torch.from_numpy(scale), element, bs)).numpy()
        if block:
            target = [w.shape[d] // block if d == axis else w.shape[d] for d in range(w.dim())]
            scale = np.ascontiguousarray(np.broadcast_to(scale, target))
    if not block:
        scale = scale.reshape(-1) if scale.size > 1 else scale.reshape(())
    base = x if is_weight else qname
    s_init = numpy_helper.from_array(scale, f"{base}_scale")
    z_init = _fp8_tensor(f"{base}_zero_point", np.zeros(scale.shape, dtype=np.uint8))
    new_inits += [s_init, z_init]
    q_attrs: Dict[str, Any] = {}
    if scale.size > 1:
        q_attrs["axis"] = axis
    if block:
        q_attrs["block_size"] = block
    if is_weight:
        shared = uses.get(x, 0) > 1
        q_init = _fp8_tensor(f"{x}_quantized" if shared else x, codes)
        new_inits.append(q_init)
        if not shared:
            drop_inits.add(x)
        return [helper.make_node("DequantizeLinear", [q_init.name, s_init.name, z_init.name], list(node.output),
                                 name=f"{x}_dequantize", **q_attrs)]
    q_out = f"{qname}_q"
    return [helper.make_node("QuantizeLinear", [x, s_init.name, z_init.name], [q_out], name=f"{qname}_quantize",
                             **q_attrs),
            helper.make_node("DequantizeLinear", [q_out, s_init.name, z_init.name], list(node.output),
                             name=f"{qname}_dequantize", **q_attrs)]


def _dynamic_qdq(node, opset: int, inits: List[Any]) -> List[Any]:
    """The nodes that replace one ``qtool::DynamicFakeQuant``: ``qtool.quant.affine.dynamic_scale_offset`` on the
    tensor's own range (docs/numerics.md), in float32 like the torch code,
    then QuantizeLinear + DequantizeLinear with the computed scale (and zero point, asymmetric)."""
    from onnx import TensorProto, helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    name = attrs["name"].decode() if isinstance(attrs["name"], bytes) else attrs["name"]
    mode = attrs["mode"].decode() if isinstance(attrs["mode"], bytes) else attrs["mode"]
    qmin, qmax = int(attrs["qmin"]), int(attrs["qmax"])
    symmetric, per_token = mode.split()[0] == "symmetric", mode.split()[1] == "per_token"
    if mode.split()[0] == "fp8":
        return _dynamic_fp8_qdq(node, name, per_token, opset, inits)
    n = qmax - qmin
    ms = float(np.float32(min(float(np.finfo(np.float32).eps), 0.01 / n)))
    x = node.input[0]
    nodes: List[Any] = []

    def const(key: str, value, dtype=np.float32) -> str:
        cname = f"{name}_{key}"
        inits.append(helper.make_tensor(cname, TensorProto.FLOAT if dtype == np.float32 else TensorProto.INT64,
                                        list(np.shape(value)), np.asarray(value, dtype=dtype).reshape(-1).tolist()))
        return cname

    def op(kind: str, inputs: List[str], key: str, **kw) -> str:
        out = f"{name}_{key}"
        nodes.append(helper.make_node(kind, inputs, [out], name=out, **kw))
        return out

    zero, n_c, ms_c = const("zero", 0.0), const("n", float(n)), const("min_scale", ms)
    f32max = const("f32max", float(np.finfo(np.float32).max))
    reduce_kw: Dict[str, Any] = {"keepdims": 1 if per_token else 0}
    axes: List[str] = []
    if per_token:
        if opset >= 18:
            axes = [const("axes", [-1], np.int64)]
        else:
            reduce_kw["axes"] = [-1]
    if symmetric:  # scale = max|x| / (n / 2)
        absmax = op("ReduceMax", [op("Abs", [x], "abs")] + axes, "absmax", **reduce_kw)
        scale = op("Min", [op("Max", [op("Div", [absmax, const("half_n", n / 2)], "raw_scale"), ms_c], "scale_min"),
                           f32max], "scale")
    else:  # the static min-max rule (qtool.quant.affine.adjust_min_max, min_max_to_scale_offset)
        mn = op("Min", [op("ReduceMin", [x] + axes, "stat_min", **reduce_kw), zero], "min0")
        mx = op("Max", [op("ReduceMax", [x] + axes, "stat_max", **reduce_kw), zero], "max0")
        # a degenerate range is widened to the minimum scale
        small = op("Less", [op("Div", [op("Sub", [mx, mn], "span"), n_c], "step"), ms_c], "degenerate")
        adj = op("Where", [small, ms_c, zero], "widen")
        lo = op("Max", [mn, op("Neg", [f32max], "neg_f32max")], "lo")
        hi = op("Min", [op("Add", [mx, op("Mul", [adj, n_c], "widen_n")], "hi_raw"), f32max], "hi")
        scale = op("Max", [op("Abs", [op("Div", [op("Sub", [hi, lo], "range"), n_c], "raw_scale")], "abs_scale"),
                           ms_c], "scale")
    out_type = _onnx_int_type(n.bit_length(), qmin < 0)
    qdq_kw: Dict[str, Any] = {}
    if per_token:
        qdq_kw = {"axis": -1, "block_size": int(attrs["channels"])}
    if symmetric:
        q_in, dq_in = [x, scale], [scale]
        qdq_q = dict(qdq_kw, output_dtype=out_type) if opset >= 21 else dict(qdq_kw)
        if opset < 21:  # below 21 QuantizeLinear picks its type from a zero point: a constant 0 of the type
            inits.append(_int_tensor(f"{name}_zero_point", np.zeros(()), n.bit_length(), qmin < 0))
            q_in, dq_in = [x, scale, f"{name}_zero_point"], [scale, f"{name}_zero_point"]
    else:
        # zero point = -offset = clamp(qmin - round(lo / scale), qmin, qmax), in the grid's integer type
        qmin_c, qmax_c = const("qmin", float(qmin)), const("qmax", float(qmax))
        zp_f = op("Clip", [op("Sub", [qmin_c, op("Round", [op("Div", [lo, scale], "lo_steps")], "lo_steps_rounded")],
                              "zp_raw"), qmin_c, qmax_c], "zp_float")
        if per_token:
            # the same QuantizeLinear/DequantizeLinear arithmetic written out: onnxruntime (1.31) fuses a dequantized
            # activation into MatMulIntegerToFloat, which refuses a zero point per token
            q = op("Clip", [op("Add", [op("Round", [op("Div", [x, scale], "steps")], "steps_rounded"), zp_f],
                               "q_raw"), qmin_c, qmax_c], "q")
            nodes.append(helper.make_node("Mul", [op("Sub", [q, zp_f], "q_centered"), scale], list(node.output),
                                          name=f"{name}_dequantize"))
            return nodes
        zp = op("Cast", [zp_f], "zero_point", to=out_type)
        q_in, dq_in, qdq_q = [x, scale, zp], [scale, zp], dict(qdq_kw)
    q = op("QuantizeLinear", q_in, "q", **qdq_q)
    nodes.append(helper.make_node("DequantizeLinear", [q] + dq_in, list(node.output), name=f"{name}_dequantize",
                                  **qdq_kw))
    return nodes


def _dynamic_fp8_qdq(node, name: str, per_token: bool, opset: int, inits: List[Any]) -> List[Any]:
    """Dynamic FP8 (compressed-tensors' rule, ``quant.floatgrid.dynamic_float_scales``): ``scale = max|x| / 448``
    over each token (or the whole tensor), float32's eps where that is 0, then float8 QuantizeLinear +
    DequantizeLinear with it."""
    from onnx import TensorProto, helper

    x, nodes = node.input[0], []

    def const(key: str, value) -> str:
        cname = f"{name}_{key}"
        inits.append(helper.make_tensor(cname, TensorProto.FLOAT, list(np.shape(value)),
                                        np.asarray(value, dtype=np.float32).reshape(-1).tolist()))
        return cname

    def op(kind: str, inputs: List[str], key: str, **kw) -> str:
        out = f"{name}_{key}"
        nodes.append(helper.make_node(kind, inputs, [out], name=out, **kw))
        return out

    reduce_kw: Dict[str, Any] = {"keepdims": 1 if per_token else 0}
    axes = [op("Constant", [], "axes", value=helper.make_tensor(f"{name}_axes_v", TensorProto.INT64, [1], [-1]))] \
        if per_token else []
    absmax = op("ReduceMax", [op("Abs", [x], "abs")] + axes, "absmax", **reduce_kw)
    raw = op("Div", [absmax, const("fp8_max", 448.0)], "raw_scale")
    zero = const("zero", 0.0)
    scale = op("Where", [op("Equal", [raw, zero], "scale_is_zero"), const("eps", float(np.finfo(np.float32).eps)),
                         raw], "scale")
    kw = {"axis": -1, "block_size": int(helper.get_attribute_value(
        next(a for a in node.attribute if a.name == "channels")))} if per_token else {}
    q = op("QuantizeLinear", [x, scale], "q", output_dtype=TensorProto.FLOAT8E4M3FN, **kw)
    nodes.append(helper.make_node("DequantizeLinear", [q, scale], list(node.output), name=f"{name}_dequantize", **kw))
    return nodes


# --------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _captured_fds():
    """Send what the exporter's C++ side writes to stdout/stderr into a temporary file (the library never prints)."""
    import os
    import sys
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile("w+b") as sink:
        try:
            for fd in (1, 2):
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


def export_onnx(loaded, batch, enc: EncodingsFile, out_dir: Path, weights=None) -> Dict[str, Any]:
    """Trace ``loaded`` (a ``qtool.model.load.LoadedModel``) on ``batch`` (a ``qtool.data.Batch`` of example inputs)
    with ``enc``'s quantizers and write ``out_dir/model.onnx``; returns a summary with ``names`` (quantizer -> ONNX
    tensor name). ``weights`` (a ``qtool.weights.WeightSource``) supplies stored codes where there are any."""
    import onnx

    from ..model.apply import apply_encodings, apply_stored_weights

    opset_q = required_opset(enc)
    if loaded.kind == "pt2":
        raise UsageError("ONNX export of a torch.export archive is not supported; export the eager model "
                         "(a state dict with --model-class, or a Hugging Face directory)")
    quantizers = apply_encodings(loaded.model, enc, "encodings")
    stored = {}
    if weights is not None:
        # transformed floats (SmoothQuant) go into the traced graph; stored codes replace initializers below
        apply_stored_weights(loaded.model, weights, codes=False)
        modules = dict(loaded.model.named_modules())
        for e in enc.entries:
            if e.tensor == "weight":
                c = weights.stored_codes(e, tuple(modules[e.module]._parameters["weight"].shape))
                if c is not None:
                    stored[e.name] = c
    model = loaded.model
    if hasattr(model, "config") and hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    args, kwargs, input_names, dynamic_axes = _signature(batch)
    info = {e.name: {"bitwidth": e.bitwidth, "qmin": e.qmin_qmax[0], "qmax": e.qmin_qmax[1], "tensor": e.tensor,
                     "element": e.element if e.is_float else None} for e in enc.entries}
    path = out_dir / "model.onnx"
    with torch.no_grad():
        try:
            out = model(*args, **kwargs)
        except (TypeError, RuntimeError, ValueError, IndexError, AssertionError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"--data: the model rejected the sample batch ONNX export traces with: {first[:200]}") \
                from None
        output_names, _ = _flatten(out)
    # eval() on the wrapper: the exporter restores the top module's mode afterwards, and a fresh module would be
    # in training mode, turning dropout on in the caller's model
    wrapper = _Positional(model, ["input"] if args else [], list(kwargs)).eval()
    flat_inputs = tuple(args) + tuple(kwargs.values())
    last_error: Optional[Exception] = None
    for opset in sorted({min(max(opset_q, 10), _MAX_TORCHSCRIPT_OPSET), 14, 17}):
        if opset < min(opset_q, _MAX_TORCHSCRIPT_OPSET):
            continue
        try:
            with onnx_export_mode(quantizers), torch.no_grad(), warnings.catch_warnings(), _captured_fds():
                warnings.simplefilter("ignore")
                torch.onnx.export(wrapper, flat_inputs, str(path), input_names=input_names,
                                  output_names=output_names, dynamic_axes=dynamic_axes, opset_version=opset,
                                  dynamo=False, custom_opsets={"qtool": 1}, do_constant_folding=True)
            break
        except Exception as e:  # the exporter raises many types; try the next opset
            last_error = e
    else:
        raise UsageError(f"torch.onnx could not export this model: {str(last_error).splitlines()[0]}")
    proto = onnx.load(str(path))
    final_opset = max(opset, opset_q)
    names = _rewrite(proto, info, final_opset, stored)
    _check_initializers(proto)
    onnx.save(proto, str(path))
    return {"onnx_opset": final_opset, "qdq_opset_needed": opset_q, "quantizers": len(names), "names": names,
            "onnx_inputs": input_names, "onnx_outputs": output_names}


def _check_initializers(proto) -> None:
    """No NaN/Inf in the file: every float initializer (weights, constants the tracer folded, scales) is checked
    last, naming the tensor (a layer the recipe leaves float is copied from the model as it is)."""
    from onnx import TensorProto, numpy_helper

    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)
    for init in proto.graph.initializer:
        if init.data_type in floats:
            check_finite(init.name, torch.from_numpy(np.array(numpy_helper.to_array(init), dtype=np.float32)))


def _signature(batch) -> Tuple[Tuple, Dict[str, torch.Tensor], List[str], Dict[str, Dict[int, str]]]:
    """(args, kwargs, input names, dynamic axes) of an example batch."""
    if batch.args:
        return batch.args, batch.kwargs, ["input"], {"input": {0: "batch"}}
    names = list(batch.kwargs)
    dyn = {k: ({0: "batch", 1: "sequence"} if v.dim() >= 2 else {0: "batch"}) for k, v in batch.kwargs.items()}
    return batch.args, batch.kwargs, names, dyn


class OnnxExporter(Exporter):
    """``--format onnx``: traces the calibrated fake-quant model (so it needs the model and example inputs)."""

    name = "onnx"

    @dataclass
    class Options:
        pass

    def check_checkpoint(self, checkpoint: Path) -> None:
        """A mixture-of-experts model is refused: tracing would fix which experts run to the example batch's
        routing (a graph that is wrong for any other input)."""
        config = Path(checkpoint) / "config.json"
        if not config.is_file():
            return
        from ..errors import CheckpointError
        from ..io.jsonfile import read_json_object

        c = read_json_object(config, CheckpointError, "Hugging Face config")
        c = c.get("text_config") if isinstance(c.get("text_config"), dict) else c
        if any(c.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise UsageError(f"{checkpoint}: ONNX export of mixture-of-experts layers is not supported (a traced graph "
                             "would keep one batch's routing); use --format compressed-tensors, gguf or qtool")

    def check_quantizers(self, quantizers, options: "OnnxExporter.Options") -> None:
        for q in quantizers:
            if q.spec.is_float:
                check_onnx_float(q)

    def check(self, encodings: EncodingsFile, options: "OnnxExporter.Options") -> None:
        self.admit(encodings.entries, options, encodings.online)
        required_opset(encodings)

    def write(self, request: ExportRequest, options: "OnnxExporter.Options") -> Dict[str, Any]:
        loaded = request.load_model()
        return export_onnx(loaded, request.example_batch(loaded), request.encodings, request.out_dir, request.weights)


EXPORTER = OnnxExporter()
