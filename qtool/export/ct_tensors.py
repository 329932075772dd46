"""The tensors of the compressed-tensors export (see ``qtool.export.compressed_tensors``): their layout in
``model.safetensors`` (integer codes packed or not, scales, zero points, float elements, KV cache scales, rotation
matrices) and the streamed writing of each one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import __version__
from ..encodings import EncodingEntry
from ..io.finite import storable
from ..io.st_writer import StreamingSafetensorsWriter
from ..quant.floatgrid import element_of, global_scale
from ..quant.packing import pack_bytes, pack_int32
from ..weights import WeightSource
from .ct_config import _FLOAT_LAYOUTS

Layout = List[Tuple[str, torch.dtype, Tuple[int, ...]]]


_SCALE_HINT = "compressed-tensors stores scales in the checkpoint's own dtype; convert the checkpoint to float32"


def _scale_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """Scales are stored in the checkpoint weight's float dtype, as llm-compressor writes them (float32 otherwise)."""
    return weight_dtype if weight_dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16) \
        else torch.float32


def _int_layout(base: str, spec, shape: Tuple[int, ...], scale_dtype: torch.dtype, packed: bool,
                strategy: str) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
    """The tensors of one integer layer (codes, scale, shape, zero point), in the order they are written."""
    b = spec.bitwidth
    sshape = _ct_scale_shape(spec)
    out = [(base + "weight", torch.int8, tuple(shape)) if not packed else
           (base + "weight_packed", torch.int32, (shape[0], (shape[1] * b + 31) // 32)),
           (base + "weight_scale", scale_dtype, sshape)]
    if packed:
        out.append((base + "weight_shape", torch.int64, (2,)))
    if not spec.symmetric:
        if packed and strategy in ("channel", "group"):
            out.append((base + "weight_zero_point", torch.int32, _packed_zp_shape(sshape, b)))
        else:
            out.append((base + "weight_zero_point", torch.int8, sshape))
    return out


def _ct_scale_shape(e) -> Tuple[int, ...]:
    return (1,) if e.granularity == "per_tensor" else tuple(int(d) for d in e.shape)


def _packed_zp_shape(scale_shape: Tuple[int, ...], bits: int) -> Tuple[int, ...]:
    rows, cols = scale_shape
    return ((rows * bits + 31) // 32, cols)


def tensor_layout(keys: List[str], src, by_key: Dict[str, EncodingEntry], dyn_inputs: Dict[str, EncodingEntry],
                  module_fmt: Dict[str, str], module_args: Dict[str, Dict[str, Any]], kv: List[EncodingEntry],
                  transforms: List[Dict[str, Any]]) -> Tuple[Layout, Dict[str, Any]]:
    """``(layout, info)``: every tensor of ``model.safetensors`` in the order it is written (the checkpoint's
    tensors, each quantized one replaced by its parts, then KV cache scales and rotation matrices), and the
    quantized weights' settings for the file's ``qtool`` metadata."""
    layout: List[Tuple[str, torch.dtype, Tuple[int, ...]]] = []
    info: Dict[str, Any] = {}
    for key in keys:
        shape, dtype = src.shape_dtype(key)
        e = by_key.get(key)
        if e is None:
            layout.append((key, dtype, tuple(shape)))
            continue
        base = key[: -len("weight")]
        b = e.bitwidth
        sshape = _ct_scale_shape(e)
        scale_dtype = _scale_dtype(dtype)
        info[key] = {"bitwidth": b, "symmetric": e.symmetric, "granularity": e.granularity,
                     "block_size": None if e.block_size is None else list(e.block_size)}
        if e.is_float:
            layout += _float_layout(e, base, tuple(shape), sshape, dyn_inputs.get(e.module))
            info[key].update(element=e.element, scale_dtype=e.scale_dtype)
            continue
        layout += _int_layout(base, e.spec, tuple(shape), scale_dtype, module_fmt[key] == "pack-quantized",
                              module_args[key]["strategy"])

    kv_dtype = {e.module: src.shape_dtype(k)[1] for e in kv
                if (k := next((c for c in keys if c == f"{e.module}.k_proj.weight"), None)) is not None}
    for e in kv:
        name = f"{e.module}.{e.tensor[0]}_scale"
        layout.append((name, kv_dtype.get(e.module, torch.float32), (1,) if e.granularity == "per_tensor"
                       else tuple(e.shape)))
    layout += [(name, dtype, shape) for t in transforms for name, (dtype, shape) in t["tensors"].items()]
    return layout, info


def write_tensors(path: Path, layout: Layout, info: Dict[str, Any], keys: List[str], src,
                  by_key: Dict[str, EncodingEntry], dyn_inputs: Dict[str, EncodingEntry], kv: List[EncodingEntry],
                  transforms: List[Dict[str, Any]], progress, rename: Callable[[str], str] = str) -> None:
    """Stream ``layout`` into ``path``: float tensors copied, quantized layers packed, then the KV cache scales
    and rotation matrices; each under ``rename`` of its name (``Family.compressed_tensors_name``)."""
    metadata = {"format": "pt", "qtool_version": __version__, "qtool_export": "compressed-tensors",
                "qtool": json.dumps({rename(k): v for k, v in info.items()}, sort_keys=True)}
    declared = {n: (d, s) for n, d, s in layout}
    with StreamingSafetensorsWriter(path, [(rename(n), d, s) for n, d, s in layout], metadata) as file:
        w = _Renamed(file, rename)
        for i, key in enumerate(keys):
            t = src.get(key)
            e = by_key.get(key)
            if e is None:
                w.write(key, t)
            elif e.is_float:
                _write_float_layer(w, key, t, e, dyn_inputs.get(e.module), src)
            else:
                _write_layer(w, key, t, e, declared, src)
            if progress:
                progress(i + 1, len(keys), key)
        for e in kv:  # the static FP8 scales of keys and values (what vLLM reads with kv_cache_dtype="fp8")
            name = f"{e.module}.{e.tensor[0]}_scale"
            dtype, shape = declared[name]
            w.write(name, storable(name, e.scale_offset()[0], dtype, _SCALE_HINT).reshape(shape).contiguous())
        for t in transforms:  # each rotated layer's matrix: what vLLM loads (unnormalized ±1, as llm-compressor)
            for name, (dtype, shape) in t["tensors"].items():
                w.write(name, t["matrix"].to(dtype))


class _Renamed:
    """A writer that stores each tensor under ``rename`` of the name it is written by."""

    def __init__(self, writer: StreamingSafetensorsWriter, rename: Callable[[str], str]):
        self.writer, self.rename = writer, rename

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.writer.write(self.rename(name), tensor)


def _write_layer(w: "_Renamed", key: str, t: torch.Tensor, e: EncodingEntry,
                 declared: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]], weights: WeightSource) -> None:
    base = key[: -len("weight")]
    b = e.bitwidth
    qmin, qmax = e.qmin_qmax
    scale, offset = e.scale_offset()
    codes = weights.codes(e, t).to(torch.int64)  # stored codes, else round-to-nearest in qtool's float32
    # qtool's grid -> compressed-tensors' signed grid: q_ct - zp == q + offset
    shift = qmin + (1 << (b - 1))
    q_ct = codes - shift
    packed = base + "weight_packed" in declared
    if not packed:
        w.write(base + "weight", q_ct.to(torch.int8))
    else:
        w.write(base + "weight_packed", pack_int32(q_ct, b))
    sdtype, sshape = declared[base + "weight_scale"]
    w.write(base + "weight_scale", storable(base + "weight_scale", scale.detach(), sdtype,
                                            _SCALE_HINT).reshape(sshape).contiguous())
    if packed:
        w.write(base + "weight_shape", torch.tensor(list(t.shape), dtype=torch.int64))
    if not e.symmetric:
        zp = (-offset.detach().to(torch.int64) - shift).reshape(sshape)
        zdtype, _ = declared[base + "weight_zero_point"]
        if zdtype == torch.int32:
            w.write(base + "weight_zero_point", pack_int32(zp, b, packed_dim=0))
        else:
            w.write(base + "weight_zero_point", zp.to(torch.int8))


def _float_layout(e, base: str, shape: Tuple[int, ...], sshape: Tuple[int, ...],
                  inp: Optional[EncodingEntry]) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
    """The tensors of one float-element layer, in the order :func:`_write_float_layer` writes them."""
    fmt, _, sdtype = _FLOAT_LAYOUTS[(e.element, e.scale_dtype)]
    out: List[Tuple[str, torch.dtype, Tuple[int, ...]]] = []
    if e.element == "fp4_e2m1":
        out.append((base + "weight_packed", torch.uint8, (shape[0], shape[1] // 2)))
    else:
        out.append((base + "weight", torch.float8_e4m3fn, shape))
    out.append((base + "weight_scale", sdtype, sshape))
    if fmt == "nvfp4-pack-quantized":
        out.append((base + "weight_global_scale", torch.float32, (1,)))
    if inp is not None and not inp.dynamic:
        out.append((base + "input_scale", torch.float32, (1,)))
    if inp is not None and inp.global_amax is not None:
        out.append((base + "input_global_scale", torch.float32, (1,)))
    return out


def _write_float_layer(w: "_Renamed", key: str, t: torch.Tensor, e: EncodingEntry,
                       inp: Optional[EncodingEntry], weights: WeightSource) -> None:
    """Pack one float-element layer: codes from the weight source, scales as the format stores them."""
    base = key[: -len("weight")]
    codes = weights.codes(e, t).to(torch.int64)
    stored, _, gscale = e.float_scales()
    sshape = _ct_scale_shape(e)
    if e.element == "fp4_e2m1":
        w.write(base + "weight_packed", pack_bytes(codes, 4, signed=False).reshape(t.shape[0], t.shape[1] // 2))
    else:
        w.write(base + "weight", codes.to(torch.uint8).view(torch.float8_e4m3fn))
    if e.scale_dtype == "e8m0":
        w.write(base + "weight_scale", stored.to(torch.uint8).reshape(sshape).contiguous())
    elif e.scale_dtype == "fp8_e4m3":
        w.write(base + "weight_scale", stored.to(torch.float8_e4m3fn).reshape(sshape).contiguous())
        w.write(base + "weight_global_scale", gscale.to(torch.float32).reshape(1))
    else:
        w.write(base + "weight_scale", stored.to(torch.float32).reshape(sshape).contiguous())
    if inp is not None and not inp.dynamic:
        w.write(base + "input_scale", inp.scale_offset()[0].to(torch.float32).reshape(1))
    if inp is not None and inp.global_amax is not None:
        w.write(base + "input_global_scale",
                global_scale(torch.tensor(inp.global_amax), element_of(inp.element)).reshape(1))
