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

This module holds the checks (which opset the encodings need, which float grids ONNX can hold, finite
initializers) and the entry point; the tracing placeholders are in ``onnx_trace`` and the graph pass that emits
the QDQ nodes in ``onnx_graph``.
"""

from __future__ import annotations

import contextlib
import errno
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch
from torch import nn

from ..data import batch_where, model_rejected, rejection
from ..encodings import EncodingsFile
from ..errors import DataError, UsageError
from ..io.finite import check_finite
from .base import Exporter, ExportRequest
from .onnx_graph import _rewrite
from .onnx_trace import _captured_fds, _flatten, _Positional, _signature, onnx_export_mode, takes_keyword

__all__ = ["export_onnx", "required_opset", "onnx_export_mode"]

_MAX_TORCHSCRIPT_OPSET = 20


# Per-tensor int8 QDQ exists since opset 10, but onnxruntime's graph optimizer rewrites QDQ graphs with ops of
# opset 11+ (it inserts Round when it quantizes Gemm biases) and then rejects an opset-10 model at load time.
_QDQ_FLOOR = 13


@contextlib.contextmanager
def _attention_fast_path_off():
    """torch's nn.MultiheadAttention and TransformerEncoderLayer take a fused kernel in eval mode under no_grad
    (``aten::_native_multi_head_attention``), which the ONNX exporter has no symbolic for: traced through their
    composite form instead, as a float export with gradients on would be."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


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
        _check_onnx_bits(e)
        if e.bitwidth != 8 or e.granularity in ("per_block", "per_token"):
            need = max(need, 21)
        elif e.granularity == "per_channel":
            need = max(need, 13)
    return need


_TILES = "2-D weight tiles have no ONNX form (DequantizeLinear blocks along one axis)"


def _tiled(spec) -> bool:
    """Whether ``spec`` blocks along more than one axis (2-D tiles)."""
    return len([b for b in (spec.block_size or ()) if b not in (1, -1)]) > 1


def check_onnx_float(q) -> None:
    """Raise ``UsageError`` unless float quantizer ``q`` (an encodings entry or plan row) has an ONNX QDQ form:
    FP8 E4M3 values under float32 scales (QuantizeLinear/DequantizeLinear with float8e4m3fn, opset 19; blocked
    along one axis, opset 21). FP4 has an ONNX type only from opset 23, and E8M0 or two-level (NVFP4) scales have
    no QuantizeLinear form at all."""
    spec = q.spec
    why = None
    if spec.element != "fp8_e4m3" or spec.scale_dtype != "float32":
        why = (f"{spec.element} with {spec.scale_dtype} scales has no ONNX QuantizeLinear form (ONNX QDQ holds FP8 "
               "with float32 scales; FP4 elements, E8M0 and FP8-under-global scales do not fit it)")
    elif spec.dynamic and spec.granularity.value == "per_block":
        why = "dynamic per-block FP8 activations are not written to ONNX (per tensor or per token only)"
    elif _tiled(spec):
        why = _TILES
    if why:
        raise UsageError(f"{q.name}: {why}; export this recipe with --format compressed-tensors or qtool")

def export_onnx(loaded, batch, enc: EncodingsFile, out_dir: Path, weights=None, source: str = "") -> Dict[str, Any]:
    """Trace ``loaded`` (a ``qtool.model.load.LoadedModel``) on ``batch`` (a ``qtool.data.Batch`` of example inputs)
    with ``enc``'s quantizers and write ``out_dir/model.onnx``; returns a summary with ``names`` (quantizer -> ONNX
    tensor name). ``weights`` (a ``qtool.weights.WeightSource``) supplies stored codes where there are any.
    ``source``: the --data path the batch was read from, which a rejection names."""
    import onnx

    from ..model.apply import apply_encodings, apply_stored_weights

    opset_q = required_opset(enc)
    if loaded.kind == "pt2":
        raise UsageError(_NO_PT2)
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
        except Exception as e:
            if not model_rejected(e):
                raise
            where = batch_where(source, "ONNX export's sample", 1) if source else \
                "the sentence ONNX export traces with (no --data)"
            raise DataError(f"{where}: the model rejected the data: {rejection(model, batch, e)}") from None
        output_names, _ = _flatten(out)
    # eval() on the wrapper: the exporter restores the top module's mode afterwards, and a fresh module would be
    # in training mode, turning dropout on in the caller's model
    wrapper = _Positional(model, ["input"] if args else [], list(kwargs)).eval()
    flat_inputs = tuple(args) + tuple(kwargs.values())
    opset, last_error = _trace(wrapper, flat_inputs, path, input_names, output_names, dynamic_axes, opset_q,
                               quantizers)
    masked = _with_a_mask(model, batch) if opset is None else None
    if masked is not None:
        # token ids alone, which a decoder turns into a mask from position ids (torch.diff) or SDPA's grouped-query
        # form, neither of which torch.onnx exports: traced again with a mask of ones, the graph then takes one
        m_args, m_kwargs, m_names, m_axes = _signature(masked)
        m_wrapper = _Positional(model, [], list(m_kwargs)).eval()
        m_inputs = tuple(m_kwargs.values())
        opset, _ = _trace(m_wrapper, m_inputs, path, m_names, output_names, m_axes, opset_q, quantizers)
        if opset is not None:
            wrapper, flat_inputs, input_names, dynamic_axes = m_wrapper, m_inputs, m_names, m_axes
    if opset is None:
        raise UsageError(f"torch.onnx could not export this model: {str(last_error).splitlines()[0]}")
    proto = onnx.load(str(path))
    final_opset = max(opset, opset_q)
    names = _rewrite(proto, info, final_opset, stored)
    _check_initializers(proto)
    onnx.save(proto, str(path))
    left = [e.name for e in enc.entries if e.name not in names]
    warnings_ = [] if not left else [  # (a recipe's rule that opted an image encoder in, traced on text)
        f"{len(left)} quantizer(s) are not in the ONNX graph, which holds what the example batch ran (a multimodal "
        f"model's image encoder, say, does not run on text): {', '.join(left[:3])}" + (" ..." if len(left) > 3 else "")]
    del proto  # (not held beside onnxruntime's copy)
    fixed = _fixed_lengths(path, wrapper, flat_inputs, input_names, dynamic_axes)
    if fixed is not None:
        proto = onnx.load(str(path))
        _fix_sequence_dims(proto, fixed)
        onnx.save(proto, str(path))
        lengths = ", ".join(f"{label} {n}" for label, n in fixed.items())
        warnings_.append(f"the written graph does not follow its inputs' length as the model does (a loop over the "
                         "positions that the trace unrolled, as Mamba's scan, or a fixed number of fields): its inputs "
                         f"are declared of the example's length ({lengths}); pad or cut inputs to it, or export with "
                         "--data of the length you serve")
    return {"onnx_opset": final_opset, "qdq_opset_needed": opset_q, "quantizers": len(names), "names": names,
            "onnx_inputs": input_names, "onnx_outputs": output_names, "warnings": warnings_}


_SEQUENCE_AXES = ("sequence", "decoder_sequence")


def _fixed_lengths(path: Path, model: nn.Module, inputs, names, dynamic_axes) -> Optional[Dict[str, int]]:
    """``{axis label: the example's length}`` where the written graph does not follow a length one position shorter
    or longer that ``model`` (the traced wrapper) itself takes: it fails there, or its outputs' shapes are not the
    model's (a loop over the positions the trace unrolled; slices that clamp give outputs of the traced length).
    None where it follows, where the model takes neither length (no evidence), where no input has a sequence axis,
    or where onnxruntime (an optional package) is not installed to ask."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    axes = {n: {ax: label for ax, label in a.items() if label in _SEQUENCE_AXES} for n, a in dynamic_axes.items()}
    axes = {n: a for n, a in axes.items() if a}
    sized = [(label, int(t.shape[ax])) for n, t in zip(names, inputs) for ax, label in axes.get(n, {}).items()]
    if not sized:
        return None
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception:  # (a graph onnxruntime does not load at all is eval's to report)
        return None

    def resized(delta: int):
        out = []
        for n, t in zip(names, inputs):
            for ax in axes.get(n, {}):
                size = int(t.shape[ax])
                t = t.narrow(ax, 0, size + delta) if delta < 0 else torch.cat([t, t.narrow(ax, size - 1, 1)], ax)
            out.append(t)
        return out

    def shapes(feed):
        try:
            with _captured_fds():
                return [tuple(o.shape) for o in session.run(None, {n: t.detach().cpu().contiguous().numpy()
                                                                   for n, t in zip(names, feed)})]
        except Exception:
            return None

    if shapes(list(inputs)) is None:  # (failing at the example's own length: not a length's doing)
        return None
    for delta in (-1, 1) if min(n for _, n in sized) > 1 else (1,):
        feed = resized(delta)
        try:
            with torch.no_grad():
                want = [tuple(o.shape) for o in model(*feed)]
        except Exception:  # (the model itself does not take that length: no evidence either way)
            continue
        if shapes(feed) != want:
            return dict(sized)
    return None


def _fix_sequence_dims(proto, lengths: Dict[str, int]) -> None:
    """Every graph input's and output's dimension named by a label of ``lengths`` declared as that length."""
    for value in list(proto.graph.input) + list(proto.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in lengths:
                dim.dim_value = lengths[dim.dim_param]


def _check_initializers(proto) -> None:
    """No NaN/Inf in the file: every float initializer (weights, constants the tracer folded, scales) is checked
    last, naming the tensor (a layer the recipe leaves float is copied from the model as it is)."""
    from onnx import TensorProto, numpy_helper

    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)
    for init in proto.graph.initializer:
        if init.data_type in floats:
            check_finite(init.name, torch.from_numpy(np.array(numpy_helper.to_array(init), dtype=np.float32)))


def _check_onnx_bits(q) -> None:
    """ONNX's integer QuantizeLinear types: 4, 8 and 16 bits, blocked along one axis at most."""
    if _tiled(q.spec):  # (the rewrite met them after the trace, as an internal error)
        raise UsageError(f"{q.name}: {_TILES}; export this recipe with --format qtool")
    if q.spec.bitwidth not in (4, 8, 16):
        gguf = q.tensor == "weight" and q.spec.gguf_block_type is not None  # (a llama.cpp grid: Q5_0, Q6_K, ...)
        raise UsageError(f"{q.name}: ONNX QuantizeLinear has no {q.spec.bitwidth}-bit type (4, 8 and 16 bits only); "
                         "export this recipe with --format qtool or aimet"
                         + (" (or gguf, for a Hugging Face model of a family llama.cpp runs)" if gguf else ""))


class OnnxExporter(Exporter):
    """``--format onnx``: traces the calibrated fake-quant model (so it needs the model and example inputs)."""

    name = "onnx"

    @dataclass
    class Options:
        pass

    def check_example_inputs(self, checkpoint: Path, data: Optional[str]) -> None:
        """Tracing runs the model on --data, else on a sentence through the checkpoint's tokenizer: a checkpoint
        with neither (a ViT, a CNN's state dict under a data-free recipe) was refused once calibrated."""
        from ..model.hf import TOKENIZER_FILES

        if data is None and not (checkpoint.is_dir() and any((checkpoint / f).is_file() for f in TOKENIZER_FILES)):
            raise UsageError("ONNX export traces the model: pass --data with a few example inputs (the checkpoint "
                             "has no tokenizer to make one)")

    def check_checkpoint(self, checkpoint: Path) -> None:
        """A mixture-of-experts model is refused: tracing would fix which experts run to the example batch's
        routing (a graph that is wrong for any other input). So is a torch.export archive (before calibrating,
        which it had run first)."""
        if Path(checkpoint).suffix.lower() == ".pt2":
            raise UsageError(f"{checkpoint}: {_NO_PT2}")
        config = Path(checkpoint) / "config.json"
        if not config.is_file():
            return
        from ..errors import CheckpointError
        from ..io.jsonfile import read_json_object

        c = read_json_object(config, CheckpointError, "Hugging Face config")
        c = c.get("text_config") if isinstance(c.get("text_config"), dict) else c
        if any(c.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise UsageError(f"{checkpoint}: {_no_experts()}")

    def check_expert_counts(self, quantizers, options: "OnnxExporter.Options", counts: Dict[str, int]) -> None:
        """The same refusal where no config.json says so (a state dict whose --model-class builds the model)."""
        if counts:
            raise UsageError(_no_experts(sorted(counts)))

    def check_quantizers(self, quantizers, options: "OnnxExporter.Options") -> None:
        for q in quantizers:  # (a plan's, before calibration, or an encodings file's)
            if q.spec.is_float:
                check_onnx_float(q)
            else:
                _check_onnx_bits(q)

    def check(self, encodings: EncodingsFile, options: "OnnxExporter.Options") -> None:
        self.admit(encodings.entries, options, encodings.online)
        required_opset(encodings)

    def write(self, request: ExportRequest, options: "OnnxExporter.Options") -> Dict[str, Any]:
        from ..model.experts import LinearExperts

        loaded = request.load_model()
        experts = [n for n, m in loaded.model.named_modules() if isinstance(m, LinearExperts)]
        if experts:  # (qtool export of a state dict's encodings: no plan was checked)
            raise UsageError(_no_experts(experts))
        return export_onnx(loaded, request.example_batch(loaded), request.encodings, request.out_dir, request.weights,
                           request.example_source)


def _trace(wrapper, flat_inputs, path: Path, input_names, output_names, dynamic_axes, opset_q: int, quantizers):
    """``torch.onnx.export`` of ``wrapper`` into ``path`` at the first opset that works: (that opset, None), or
    (None, the last error)."""
    last_error: Optional[Exception] = None
    for opset in sorted({min(max(opset_q, 10), _MAX_TORCHSCRIPT_OPSET), 14, 17}):
        if opset < min(opset_q, _MAX_TORCHSCRIPT_OPSET):
            continue
        try:
            with onnx_export_mode(quantizers), torch.no_grad(), _attention_fast_path_off(), \
                    warnings.catch_warnings(), _captured_fds():
                warnings.simplefilter("ignore")
                torch.onnx.export(wrapper, flat_inputs, str(path), input_names=input_names,
                                  output_names=output_names, dynamic_axes=dynamic_axes, opset_version=opset,
                                  dynamo=False, custom_opsets={"qtool": 1}, do_constant_folding=True)
            return opset, None
        except OSError as e:  # (a full disk, a file-size limit: the output, not the model; the CLI names the path)
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES):
                raise
            last_error = e
        except Exception as e:  # the exporter raises many types; try the next opset
            last_error = e
    return None, last_error


def _with_a_mask(model, batch):
    """``batch``'s token ids (named, or a file's one integer tensor) with an ``attention_mask`` of ones, where the
    model's forward names one and the batch has none; else None."""
    from ..data import Batch

    ids = batch.kwargs.get("input_ids") if not batch.args else (
        batch.args[0] if len(batch.args) == 1 and not batch.kwargs else None)
    if ids is None or ids.is_floating_point() or ids.dim() != 2 or "attention_mask" in batch.kwargs or \
            not takes_keyword(model, "attention_mask"):
        return None
    return Batch((), {**batch.kwargs, "input_ids": ids, "attention_mask": torch.ones_like(ids)})


_NO_PT2 = ("ONNX export of a torch.export archive is not supported; export the eager model (a state dict with "
           "--model-class, or a Hugging Face directory)")


def _no_experts(layers=()) -> str:
    """Why ONNX refuses experts; ``layers``: a state dict's (compressed-tensors and gguf read directories only)."""
    named = f" ({layers[0]}{f' and {len(layers) - 1} more' if len(layers) > 1 else ''})" if layers else ""
    formats = "qtool or aimet" if layers else "compressed-tensors, gguf or qtool"
    return (f"ONNX export of mixture-of-experts layers{named} is not supported (a traced graph would keep one "
            f"batch's routing); use --format {formats}")

EXPORTER = OnnxExporter()
