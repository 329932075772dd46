"""qtool's integer safetensors export, streamed one tensor at a time.

For every quantized weight ``<name>`` the output holds

* ``<name>``: the integer codes, in the smallest fitting dtype (``int8`` for signed 8-bit, ``uint8`` for
  unsigned 8-bit, ``int16``/``int32`` up to 16 bits). Codes of 2 to 7 bits are packed densely by default
  (``pack=True``): a flat ``uint8`` tensor of ``ceil(numel * bits / 8)`` bytes, values LSB-first in row-major
  order, two's complement within ``bits`` for signed grids (for 4 bits: two codes per byte, the first in the low
  nibble, as in ONNX); the original shape is in the metadata. With ``pack=False`` they stay one per byte;
* ``<name>_scale``: float32, the encoding shape (``[]`` per-tensor, ``[out, 1]`` per-channel,
  ``[out, in/B]`` blockwise);
* ``<name>_offset``: int32, AIMET's offset in the same shape, so that ``real = (q + offset) * scale``
  (the ONNX/torchao zero point is ``-offset``).

Every other tensor is copied unchanged. ``__metadata__["qtool"]`` is a JSON object describing each quantized
tensor (bitwidth, symmetric, granularity, block_size). Dequantizing gives the calibrated model's fake-quant
weights bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from .. import __version__
from ..encodings import EncodingEntry, EncodingsFile
from ..errors import EncodingsError
from ..model.load import CheckpointTensors
from ..quant import quantize
from ..quant.affine import resolve_block_size
from ..quant.tensor import AffineEncoding
from .st_writer import StreamingSafetensorsWriter

__all__ = ["export_integer", "match_weight_names", "read_integer_export"]

Progress = Optional[Callable[[int, int, str], None]]


def match_weight_names(entries: List[EncodingEntry], keys: List[str], source: str) -> Dict[str, str]:
    """Map each weight encoding to a checkpoint tensor name (exact, else a unique prefix difference)."""
    keyset = set(keys)
    out = {}
    for e in entries:
        if e.name in keyset:
            out[e.name] = e.name
            continue
        cands = [k for k in keys if k.endswith("." + e.name) or e.name.endswith("." + k)]
        if len(cands) != 1:
            raise EncodingsError(
                f"{source}: has no tensor {e.name!r} named in the encodings; were they made for another model?"
            )
        out[e.name] = cands[0]
    return out


def export_integer(
    checkpoint: Path,
    encodings: EncodingsFile,
    out_dir: Path,
    trust_pickle: bool = False,
    progress: Progress = None,
    pack: bool = True,
) -> Dict[str, object]:
    """Write ``out_dir/model.safetensors``; returns a summary (tensor counts, bytes)."""
    src = CheckpointTensors(checkpoint, trust_pickle=trust_pickle)
    keys = src.keys()
    weights = [e for e in encodings.entries if e.tensor == "weight"]
    names = match_weight_names(weights, keys, str(checkpoint))
    by_key = {names[e.name]: e for e in weights}

    layout = []
    info = {}
    for key in keys:
        shape, dtype = src.shape_dtype(key)
        e = by_key.get(key)
        if e is None:
            layout.append((key, dtype, shape))
            continue
        try:
            resolve_block_size(shape, e.shape, e.block_size)
        except ValueError as err:
            raise EncodingsError(
                f"encodings entry {e.name!r} (shape {list(e.shape)}) does not fit tensor {key!r} of shape "
                f"{list(shape)}: {err}; were they made for another model?"
            ) from None
        qmin, qmax = e.qmin_qmax
        packed = pack and e.bitwidth < 8
        if packed:
            numel = int(torch.Size(shape).numel())
            layout.append((key, torch.uint8, ((numel * e.bitwidth + 7) // 8,)))
        else:
            int_dtype = AffineEncoding(torch.zeros(()), torch.zeros(()), qmin, qmax, e.symmetric).int_dtype()
            layout.append((key, int_dtype, shape))
        layout += [(key + "_scale", torch.float32, e.shape), (key + "_offset", torch.int32, e.shape)]
        info[key] = {"bitwidth": e.bitwidth, "symmetric": e.symmetric, "granularity": e.granularity,
                     "block_size": None if e.block_size is None else list(e.block_size),
                     "qmin": qmin, "qmax": qmax, "dtype": str(dtype).replace("torch.", ""),
                     "shape": list(shape), "packed": packed}
    metadata = {"format": "qtool.int", "qtool_version": __version__, "qtool": json.dumps(info, sort_keys=True)}
    path = out_dir / "model.safetensors"
    int_bytes = float_bytes = 0
    with StreamingSafetensorsWriter(path, layout, metadata) as w:
        for i, key in enumerate(keys):
            t = src.get(key)
            e = by_key.get(key)
            if e is None:
                w.write(key, t)
            else:
                scale, offset = e.scale_offset()
                qmin, qmax = e.qmin_qmax
                codes = quantize(t.to(torch.float32), scale, offset, qmin=qmin, qmax=qmax, block_size=e.block_size)
                if info[key]["packed"]:
                    from ..quant.packing import pack_bytes

                    stored = pack_bytes(codes.to(torch.int32).reshape(-1), e.bitwidth)
                else:
                    int_dtype = layout[[n for n, _, _ in layout].index(key)][1]
                    stored = codes.to(int_dtype)
                w.write(key, stored)
                w.write(key + "_scale", scale.to(torch.float32).contiguous())
                w.write(key + "_offset", offset.to(torch.int32).contiguous())
                int_bytes += stored.numel() * stored.element_size()
                float_bytes += t.numel() * t.element_size()
            if progress:
                progress(i + 1, len(keys), key)
    return {"tensors": len(keys), "quantized": len(by_key), "quantized_bytes": int_bytes,
            "original_bytes_of_quantized": float_bytes, "names": {e.name: names[e.name] for e in weights}}


def read_integer_export(path: Path) -> Dict[str, torch.Tensor]:
    """Dequantized weights of a qtool integer export, keyed by the original tensor names (for checks)."""
    from safetensors import safe_open

    from ..quant import dequantize

    with safe_open(str(path), "pt") as fh:
        meta = json.loads(fh.metadata()["qtool"])
        out = {}
        for key in fh.keys():
            if key.endswith("_scale") or key.endswith("_offset"):
                if key.rsplit("_", 1)[0] in meta:
                    continue
            t = fh.get_tensor(key)
            if key in meta:
                m = meta[key]
                if m.get("packed"):
                    from ..quant.packing import unpack_bytes

                    t = unpack_bytes(t, m["bitwidth"], m["shape"], signed=m["qmin"] < 0)
                bs = None if m["block_size"] is None else tuple(m["block_size"])
                t = dequantize(t, fh.get_tensor(key + "_scale"), fh.get_tensor(key + "_offset").to(torch.float32),
                               block_size=bs)
            out[key] = t
    return out
