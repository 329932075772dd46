"""The ONNX graph pass of the QDQ export (see ``qtool.export.onnx_qdq``): every ``qtool::FakeQuant`` placeholder
becomes QuantizeLinear/DequantizeLinear nodes (a weight's integer or FP8 codes replace its float initializer under
the parameter's own name), and every ``qtool::DynamicFakeQuant`` the range computed in the graph from the tensor
itself, in standard ops."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ..quant import quantize
from ..quant.floatgrid import float_quantize


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
             stored: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, Any]:
    """Expand every qtool::FakeQuant node; returns quantizer name -> ONNX tensor name (a list of them for an
    activation quantizer of a module the model calls more than once: the tensor of each call)."""
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

    def quantizer(node) -> Optional[str]:
        if node.op_type not in ("FakeQuant", "DynamicFakeQuant"):
            return None
        name = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "name")
        return name.decode() if isinstance(name, bytes) else name

    # how many consumers read each tensor, a quantizer's calls counting once (a module called twice quantizes its
    # weight twice: it is not shared, as a weight tied to another layer's is)
    consumers: Dict[str, set] = {}
    for k, n in enumerate(graph.node):
        for name in n.input:
            consumers.setdefault(name, set()).add(quantizer(n) or k)
    uses = {name: len(c) for name, c in consumers.items()}
    # tensors two quantizers read (an embedding table quantized by itself and by the output layer tied to it)
    crowded = {name for name, c in consumers.items() if sum(isinstance(q, str) for q in c) > 1}
    names: Dict[str, Any] = {}
    first: Dict[str, Any] = {}  # quantizer -> (input, output, nodes) of its first call
    calls: Dict[str, int] = {}  # quantizer -> its calls met so far
    new_nodes: List[Any] = []
    new_inits: List[Any] = []
    drop_inits = set()
    for node in graph.node:
        qname = quantizer(node)
        if qname is None:
            new_nodes.append(node)
            continue
        if qname in first:  # another call of the same module: the first call's scales and codes, this call's tensors
            calls[qname] += 1
            new_nodes += _again(first[qname], node, calls[qname] - 1)
            seen = names[qname] if isinstance(names[qname], list) else [names[qname]]
            if node.input[0] not in seen:
                names[qname] = seen + [node.input[0]]
            continue
        calls[qname] = 1
        start = len(new_nodes)
        first[qname] = (node.input[0], node.output[0])
        if node.op_type == "DynamicFakeQuant":
            names[qname] = node.input[0]
            new_nodes += _dynamic_qdq(node, opset, new_inits)
            first[qname] += (new_nodes[start:],)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        info = quantizer_info[qname]
        bits, signed = info["bitwidth"], info["qmin"] < 0
        if info.get("element"):
            new_nodes += _float_qdq(node, attrs, qname, info, inits, uses, crowded, value, stored, new_inits,
                                    drop_inits)
            names[qname] = _named(new_nodes, node, info, inits, crowded)
            first[qname] += (new_nodes[start:],)
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
        new_nodes += _qdq_nodes(node, qname, is_weight, scale, axis, block,
                                lambda n: _int_tensor(n, zp, bits, signed),
                                lambda n: _int_tensor(n, codes.numpy(), bits, signed), uses, crowded, new_inits,
                                drop_inits)
        names[qname] = _named(new_nodes, node, info, inits, crowded)
        first[qname] += (new_nodes[start:],)
    used = {i for n in new_nodes for i in n.input}
    keep_nodes = [n for n in new_nodes if not (n.op_type == "Constant" and not (set(n.output) & used))]
    del graph.node[:]
    graph.node.extend(keep_nodes)
    # a weight every reader of which quantized it (a table tied to a quantized output layer) has no float use left
    drop_inits |= {n for n, c in consumers.items() if n in inits and n not in used and all(
        isinstance(q, str) and quantizer_info.get(q, {}).get("tensor") == "weight" for q in c)}
    kept = [i for i in graph.initializer if i.name not in drop_inits]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    del model.opset_import[:]
    model.opset_import.extend([helper.make_opsetid("", opset)])
    if model.ir_version < 10 and opset >= 21:
        model.ir_version = 10
    _reinfer_shapes(model)
    onnx.checker.check_model(model)
    return names


def _reinfer_shapes(model) -> None:
    """Drop the shapes the exporter recorded past the ``qtool::`` nodes (it could not see through them and named
    every dim after the node: ``logits`` read ``[MatMullogits_dim_0, ...]``) and give the outputs the shapes ONNX's
    own inference finds in the rewritten graph (``[batch, sequence, vocab]``); a dim it cannot infer keeps the
    exporter's."""
    import onnx

    del model.graph.value_info[:]
    traced = []
    for o in model.graph.output:
        shape = onnx.TensorShapeProto()
        shape.CopyFrom(o.type.tensor_type.shape)
        traced.append(shape)
        o.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True).graph.output
    except (onnx.shape_inference.InferenceError, ValueError):  # (a graph over 2 GiB is not inferred in memory)
        inferred = model.graph.output
    for out, found, shape in zip(model.graph.output, inferred, traced):
        out.type.tensor_type.shape.CopyFrom(shape)
        better = found.type.tensor_type.shape
        if not found.type.tensor_type.HasField("shape") or len(better.dim) != len(shape.dim):
            continue
        for dim, new in zip(out.type.tensor_type.shape.dim, better.dim):
            # (a size, or a name inference carried from the inputs; its own unknowns, unk__N, say less)
            if new.HasField("dim_value") or (new.HasField("dim_param") and not new.dim_param.startswith("unk__")):
                dim.CopyFrom(new)


def _named(new_nodes, node, info, inits, crowded) -> str:
    """The ONNX tensor an encoding is keyed by: the quantized tensor, or for a weight two quantizers read (a table
    tied to a quantized output layer) each one's codes (``new_nodes[-1]``: its DequantizeLinear)."""
    x = node.input[0]
    return new_nodes[-1].input[0] if x in crowded and x in inits and info["tensor"] == "weight" else x


def _again(first, node, call: int) -> List[Any]:
    """The nodes of a quantizer's ``first`` call (its input, output and nodes) made again for ``node``, its call
    number ``call`` (from 1): the same scales, zero points and codes, this call's input and output, and the
    intermediate tensors and nodes named apart (``_<call>``)."""
    import copy

    x0, y0, nodes = first
    inner = {t for n in nodes for t in n.output} - {y0}

    def renamed(t: str) -> str:
        return node.input[0] if t == x0 else node.output[0] if t == y0 else f"{t}_{call}" if t in inner else t

    out = []
    for n in nodes:
        c = copy.deepcopy(n)
        c.input[:] = [renamed(t) for t in n.input]
        c.output[:] = [renamed(t) for t in n.output]
        c.name = f"{n.name}_{call}"
        out.append(c)
    return out


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


def _float_qdq(node, attrs, qname, info, inits, uses, crowded, value, stored, new_inits, drop_inits) -> List[Any]:
    """The nodes replacing one float-grid ``qtool::FakeQuant`` (FP8 under float32 scales): a weight's FP8 codes as
    a float8e4m3fn initializer + DequantizeLinear, an activation's QuantizeLinear + DequantizeLinear, each with a
    float8 zero point 0 (QuantizeLinear saturates, as qtool clamps to ±448 before rounding)."""
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
    return _qdq_nodes(node, qname, is_weight, scale, axis, block,
                      lambda n: _fp8_tensor(n, np.zeros(scale.shape, dtype=np.uint8)),
                      lambda n: _fp8_tensor(n, codes), uses, crowded, new_inits, drop_inits)


def _qdq_nodes(node, qname: str, is_weight: bool, scale: np.ndarray, axis: int, block: int, zero_point_init,
               codes_init, uses: Dict[str, int], crowded: set, new_inits: List[Any], drop_inits: set) -> List[Any]:
    """The nodes replacing one ``qtool::FakeQuant`` once its scale is laid out: the scale and zero point
    (``zero_point_init(name)``) as initializers, then a weight's codes (``codes_init(name)``) + DequantizeLinear,
    or an activation's QuantizeLinear + DequantizeLinear (``axis`` where the scale has several values,
    ``block_size`` where blocked)."""
    from onnx import helper, numpy_helper

    x = node.input[0]
    # a weight read elsewhere too (tied to another layer's) keeps its float initializer and its codes are
    # <name>_quantized; one two quantizers read has each one's codes and scales named by the quantizer
    shared = is_weight and uses.get(x, 0) > 1
    base = qname if not is_weight or x in crowded else x
    s_init = numpy_helper.from_array(scale, f"{base}_scale")
    z_init = zero_point_init(f"{base}_zero_point")
    new_inits += [s_init, z_init]
    q_attrs: Dict[str, Any] = {}
    if scale.size > 1:
        q_attrs["axis"] = axis
    if block:
        q_attrs["block_size"] = block
    if is_weight:
        # the codes take the parameter's own name, as AIMET's encodings key parameters by it, unless the float
        # parameter is used elsewhere too (a tied weight), which then keeps it
        q_init = codes_init(f"{qname if x in crowded else x}_quantized" if shared else x)
        new_inits.append(q_init)
        if not shared:
            drop_inits.add(x)
        return [helper.make_node("DequantizeLinear", [q_init.name, s_init.name, z_init.name], list(node.output),
                                 name=f"{base}_dequantize", **q_attrs)]
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

    ms_c = const("min_scale", ms)
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
        # (constants made here alone: an initializer no node reads is a warning each time onnxruntime loads it)
        zero, n_c = const("zero", 0.0), const("n", float(n))
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
