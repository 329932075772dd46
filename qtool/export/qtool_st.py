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

A weight on a **float element grid** (FP8, NVFP4, MX; ``element`` in its encoding) is stored natively instead:

* ``<name>``: ``float8_e4m3fn`` for FP8 elements; FP4 E2M1 codes (``sign << 3 | index``) two per byte, the first
  in the low nibble, as a flat ``uint8`` tensor (one code per byte with ``pack=False``);
* ``<name>_scale``: the block scale as the format stores it: ``float32`` (``scale_dtype: float32``), ``uint8``
  biased E8M0 exponents (``2 ** (e - 127)``, MX) or ``float8_e4m3fn`` (NVFP4), in the encoding shape;
* ``<name>_global_scale`` (NVFP4): ``float32 [1]``, the global scale ``G``; the value is ``element · (s / G)``
  (in that order).

No ``_offset`` is written for them, and their metadata entry adds ``element`` and ``scale_dtype``.

Every other tensor is copied unchanged. ``__metadata__["qtool"]`` is a JSON object describing each quantized
tensor (bitwidth, symmetric, granularity, block_size). A model that rotates activations at run time (``rotate``'s
r3, r4) lists those rotations in ``__metadata__["qtool_online_rotations"]`` (the encodings file's
``online_rotations``: at ``input``, the modules whose input ``x`` becomes ``x R``, whose stored weights already
hold ``W R``; at ``k_cache``, the attention layers whose cached keys are rotated per head, whose KV cache scales
are in the run's encodings file, not in this one).
Dequantizing gives the calibrated model's fake-quant weights bit for bit.

Sharding: when the tensors' bytes exceed ``max_shard_bytes`` (default 5 GB, as Hugging Face's ``save_pretrained``)
the output is ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``); otherwise it is one ``model.safetensors``.
Shards are cut by size only, in tensor-name order (a sharded input does not impose its own shard boundaries: the
integer output is 2 to 4 times smaller than the float input, so following them would give many small files). A
quantized tensor's ``_scale`` and ``_offset`` always sit in the same shard as its codes; a tensor larger than
``max_shard_bytes`` gets a shard of its own. Every shard carries the ``__metadata__`` above, its ``qtool`` JSON
listing only that shard's quantized tensors.

Memory: one input tensor at a time; a large tensor is quantized in row chunks straight into its (1-byte or packed)
output, so the peak is about the input tensor plus its integer codes plus a bounded scratch space, whatever the
model's size.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from .. import __version__
from ..encodings import EncodingEntry, EncodingsFile
from ..errors import EncodingsError
from ..model.expert_view import open_checkpoint
from ..quant.affine import blocked_shapes, resolve_block_size
from ..quant.packing import pack_bytes
from ..quant.tensor import AffineEncoding
from ..weights import WeightSource
from .base import Exporter, ExportRequest, layout_bytes, match_weight_names, refuse_tied, weight_names
from ..io.jsonfile import read_json_object
from ..io.st_writer import StreamingSafetensorsWriter

__all__ = ["export_integer", "export_files", "match_weight_names", "read_integer_export", "DEFAULT_MAX_SHARD_BYTES",
           "INDEX_NAME"]

Progress = Optional[Callable[[int, int, str], None]]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default max_shard_size ("5GB")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# elements quantized per step: bounds the float32 scratch buffer (32 MiB), reused for every chunk of a tensor
_CHUNK_ELEMS = 1 << 23
# torch intra-op threads while exporting (restored afterwards); 0 leaves torch's own setting (the default). The work
# is a few memory-bound passes per tensor: on an idle 2-core machine torch's two threads are ~25% faster than one,
# but when other processes compete for the cores every operation waits milliseconds for a thread to wake, and one
# thread is 2-10x faster (docs/performance.md, "Scale and export"). QTOOL_EXPORT_THREADS=1 (or OMP_NUM_THREADS=1)
# picks one thread.
THREADS = int(os.environ.get("QTOOL_EXPORT_THREADS", "0") or 0)


def export_integer(
    checkpoint: Path,
    encodings: EncodingsFile,
    out_dir: Path,
    trust_pickle: bool = False,
    progress: Progress = None,
    pack: bool = True,
    max_shard_bytes: Optional[int] = DEFAULT_MAX_SHARD_BYTES,
    weights: Optional[WeightSource] = None,
) -> Dict[str, object]:
    """Write ``out_dir/model.safetensors`` (or shards plus an index, see the module docs); returns a summary
    (tensor counts, bytes, shard files). ``max_shard_bytes=None`` never shards. ``weights``: where values and
    codes come from (default: the checkpoint, round-to-nearest)."""
    src = weights or WeightSource(checkpoint, encodings, tensors=open_checkpoint(checkpoint, trust_pickle))
    matched = weight_names(src, encodings.entries, str(checkpoint))
    keys, weights, names, by_key = matched.keys, matched.entries, matched.names, matched.by_key

    layout = []
    info = {}
    for key in keys:
        shape, dtype = src.shape_dtype(key)
        e = by_key.get(key)
        if e is None:
            layout.append((key, dtype, shape))
            continue
        e.check_fits(key, shape)
        layout += weight_layout(key, e.spec, tuple(shape), pack)
        if e.is_float:
            info[key] = {"bitwidth": e.bitwidth, "symmetric": True, "granularity": e.granularity,
                         "block_size": None if e.block_size is None else list(e.block_size),
                         "element": e.element, "scale_dtype": e.scale_dtype, "dtype": str(dtype).replace("torch.", ""),
                         "shape": list(shape), "packed": pack and e.bitwidth == 4}
            continue
        qmin, qmax = e.qmin_qmax
        packed = pack and e.bitwidth < 8
        info[key] = {"bitwidth": e.bitwidth, "symmetric": e.symmetric, "granularity": e.granularity,
                     "block_size": None if e.block_size is None else list(e.block_size),
                     "qmin": qmin, "qmax": qmax, "dtype": str(dtype).replace("torch.", ""),
                     "shape": list(shape), "packed": packed}
    threads = torch.get_num_threads()
    if THREADS:
        torch.set_num_threads(THREADS)
    try:
        online = json.dumps([r.to_json() for r in encodings.online]) if encodings.online else None
        return _write(src, keys, layout, info, by_key, names, weights, out_dir, progress, max_shard_bytes, online)
    finally:
        torch.set_num_threads(threads)


def _write(src, keys, layout, info, by_key, names, weights, out_dir, progress, max_shard_bytes, online=None):
    nbytes = {name: _nbytes(dtype, shape) for name, dtype, shape in layout}
    shards = _plan_shards(layout, info, nbytes, max_shard_bytes)
    int_dtypes = {name: dtype for name, dtype, _ in layout}
    files = _shard_names(len(shards))
    weight_map: Dict[str, str] = {}
    int_bytes = float_bytes = 0
    done = 0
    companions = {k + sfx for k in info for sfx in _COMPANIONS}
    order = [name for shard in shards for name, _, _ in shard if name not in companions]
    # (reading the next tensor in a thread while quantizing this one gained nothing measurable: see
    # docs/performance.md, "Scale and export")
    reader = ((k, src.get(k)) for k in order)
    for file, shard in zip(files, shards):
        names_in = [name for name, _, _ in shard]
        shard_info = info if len(shards) == 1 else {k: info[k] for k in names_in if k in info}
        metadata = {"format": "qtool.int", "qtool_version": __version__,
                    "qtool": json.dumps(shard_info, sort_keys=True),
                    **({"qtool_online_rotations": online} if online else {})}
        with StreamingSafetensorsWriter(out_dir / file, shard, metadata) as w:
            for key in names_in:
                if key in companions:
                    continue  # written with its codes
                got, t = next(reader)
                assert got == key
                e = by_key.get(key)
                if e is None:
                    w.write(key, t)
                elif e.is_float:
                    stored = _write_float(w, key, t, e, src, info[key]["packed"])
                    int_bytes += stored
                    float_bytes += t.numel() * t.element_size()
                else:
                    scale, offset = e.scale_offset()
                    scale = scale.to(torch.float32).contiguous()
                    chosen = src.stored_codes(e, tuple(t.shape))
                    if chosen is None:
                        stored = _quantize_to_storage(t, scale, offset, e, info[key]["packed"], int_dtypes[key])
                    elif info[key]["packed"]:
                        stored = pack_bytes(chosen.to(torch.int32).reshape(-1), e.bitwidth)
                    else:
                        stored = chosen.to(int_dtypes[key])
                    w.write(key, stored)
                    w.write(key + "_scale", scale)
                    w.write(key + "_offset", offset.to(torch.int32).contiguous())
                    int_bytes += stored.numel() * stored.element_size()
                    float_bytes += t.numel() * t.element_size()
                    del stored
                del t
                done += 1
                if progress:
                    progress(done, len(keys), key)
        weight_map.update({name: file for name in names_in})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes.values()), "format": "qtool.int",
                              "qtool_version": __version__},
                 "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return {"tensors": len(keys), "quantized": len(by_key), "quantized_bytes": int_bytes,
            "original_bytes_of_quantized": float_bytes, "shards": len(shards), "files": files,
            "names": {e.name: names[e.name] for e in weights}}


def weight_layout(key: str, spec, shape, pack: bool):
    """The tensors (name, dtype, shape) that hold one quantized weight on grid ``spec``, in the order they are
    written; what ``--target-bpw`` counts for this format too."""
    if spec.is_float:
        return _float_layout(key, spec, tuple(shape), pack)
    if pack and spec.bitwidth < 8:
        numel = int(torch.Size(shape).numel())
        codes = (key, torch.uint8, ((numel * spec.bitwidth + 7) // 8,))
    else:
        qmin, qmax = spec.qmin_qmax
        codes = (key, AffineEncoding(torch.zeros(()), torch.zeros(()), qmin, qmax, spec.symmetric).int_dtype(),
                 tuple(shape))
    return [codes, (key + "_scale", torch.float32, tuple(spec.shape)), (key + "_offset", torch.int32, tuple(spec.shape))]


_COMPANIONS = ("_global_scale", "_scale", "_offset")  # tensors written with (and sharded beside) their codes
_FLOAT_SCALE_STORAGE = {"float32": torch.float32, "e8m0": torch.uint8, "fp8_e4m3": torch.float8_e4m3fn}


def _float_layout(key: str, e, shape, pack: bool):
    """The tensors of one float-element weight, in the order :func:`_write_float` writes them."""
    numel = int(torch.Size(shape).numel())
    if e.bitwidth == 8:
        out = [(key, torch.float8_e4m3fn, shape)]
    else:
        out = [(key, torch.uint8, ((numel + 1) // 2,) if pack else shape)]
    out.append((key + "_scale", _FLOAT_SCALE_STORAGE[e.scale_dtype], tuple(e.shape)))
    if e.scale_dtype == "fp8_e4m3":
        out.append((key + "_global_scale", torch.float32, (1,)))
    return out


def _write_float(w, key: str, t: torch.Tensor, e: EncodingEntry, src: WeightSource, packed: bool) -> int:
    """Write one float-element weight's codes and scales; returns the bytes of its codes."""
    codes = src.codes(e, t).to(torch.int64)
    if e.bitwidth == 8:
        stored = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    else:
        stored = pack_bytes(codes.reshape(-1), 4, signed=False) if packed else codes.to(torch.uint8)
    w.write(key, stored)
    scale, _, gscale = e.float_scales()
    w.write(key + "_scale", scale.to(_FLOAT_SCALE_STORAGE[e.scale_dtype]).reshape(tuple(e.shape)).contiguous())
    if gscale is not None:
        w.write(key + "_global_scale", gscale.to(torch.float32).reshape(1))
    return stored.numel() * stored.element_size()


def _nbytes(dtype: torch.dtype, shape) -> int:
    return int(torch.Size(tuple(int(d) for d in shape)).numel()) * torch.empty((), dtype=dtype).element_size()


def _plan_shards(layout, info, nbytes, max_shard_bytes: Optional[int]):
    """Cut ``layout`` (in order) into shards of at most ``max_shard_bytes`` tensor bytes; codes, scale and offset
    of one quantized tensor form one unit, and a unit bigger than the limit is a shard of its own."""
    units: List[list] = []
    for entry in layout:
        name = entry[0]
        base = next((name[:-len(s)] for s in _COMPANIONS if name.endswith(s) and name[:-len(s)] in info), None)
        if base is not None and base in info and units and units[-1][0][0] == base:
            units[-1].append(entry)
        else:
            units.append([entry])
    if max_shard_bytes is None or max_shard_bytes <= 0:
        return [layout]
    shards: List[list] = []
    size = 0
    for unit in units:
        usize = sum(nbytes[n] for n, _, _ in unit)
        if shards and size + usize <= max_shard_bytes:
            shards[-1] += unit
            size += usize
        else:
            shards.append(list(unit))
            size = usize
    return shards or [[]]


def _shard_names(n: int) -> List[str]:
    if n <= 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _chunk_rows(shape, enc_shape, block_size, multiple_of_8: bool) -> Optional[int]:
    """Rows of dim 0 per chunk (a valid split for the encoding and for byte packing), or None: no chunking."""
    shape = tuple(int(d) for d in shape)
    numel = int(torch.Size(shape).numel())
    if len(shape) < 1 or numel <= _CHUNK_ELEMS or shape[0] <= 1:
        return None
    row = numel // shape[0]
    step = 1
    if len(enc_shape) == len(shape) and int(enc_shape[0]) > 1:
        step = resolve_block_size(shape, enc_shape, block_size)[0]  # rows sharing one encoding row
    if multiple_of_8:  # a chunk of a multiple of 8 codes packs to whole bytes
        need = 8 // math.gcd(row, 8)
        step = step * need // math.gcd(step, need)
    rows = max(step, (_CHUNK_ELEMS // max(row, 1)) // step * step)
    return rows if rows < shape[0] else None


def _quantize_to_storage(t: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, e: EncodingEntry,
                         packed: bool, int_dtype: torch.dtype) -> torch.Tensor:
    """The stored codes of ``t`` (packed ``uint8`` or ``int_dtype``), bit-identical to
    ``quantize(t.to(float32), scale, offset, qmin=, qmax=, block_size=)`` then ``.to(int_dtype)`` / ``pack_bytes``.

    Big tensors go in row chunks through one float32 buffer of at most ``_CHUNK_ELEMS`` elements, reused chunk after
    chunk, so the scratch space is bounded; the operations are ``quantize``'s own (``affine._quantize_raw``: true
    division, round half to even, ``- offset``, clamp), done in place. 1, 2 and 4-bit codes are packed here with byte
    operations (the layout of ``pack_bytes``, which packs the other widths)."""
    qmin, qmax = e.qmin_qmax
    enc_shape = tuple(scale.shape)
    scale = scale.to(torch.float32)
    offset = offset.to(torch.float32)
    subtract = bool(offset.any())  # x - 0.0 == x bit for bit: skip the pass for symmetric encodings
    numel = t.numel()
    rows = _chunk_rows(t.shape, enc_shape, e.block_size, packed)
    if packed:
        out = torch.empty(((numel * e.bitwidth + 7) // 8,), dtype=torch.uint8)
    else:
        out = torch.empty(tuple(t.shape), dtype=int_dtype)
    if rows is None:  # one piece
        chunks = [(t, scale, offset, e.block_size, 0, None)]
        cap = numel
    else:
        n0 = int(t.shape[0])
        per_enc_row = len(enc_shape) == t.dim() and int(enc_shape[0]) > 1
        b0 = resolve_block_size(tuple(t.shape), enc_shape, e.block_size)[0] if per_enc_row else None
        bs = e.block_size
        if bs is not None and len(enc_shape) == t.dim() and not per_enc_row:
            bs = (-1, *tuple(bs)[1:])  # one encoding row spans dim 0: it spans each chunk's rows instead
        chunks = []
        for r0 in range(0, n0, rows):
            r1 = min(n0, r0 + rows)
            s, o = scale, offset
            if per_enc_row:
                s = scale[r0 // b0:r1 // b0]
                o = offset[r0 // b0:r1 // b0]
            chunks.append((t[r0:r1], s, o, bs, r0, r1))
        cap = rows * (numel // n0)
    buf = torch.empty((cap,), dtype=torch.float32)
    codes8 = torch.empty((cap,), dtype=torch.int8) if packed else None
    done = 0
    for x, s, o, bs, r0, r1 in chunks:
        n = x.numel()
        b = buf[:n].view(x.shape)
        if bs is not None:
            x_view, enc_view, _ = blocked_shapes(tuple(x.shape), tuple(s.shape), bs)
            b, x = b.view(x_view), x.reshape(x_view)
            s, o = s.reshape(enc_view), o.reshape(enc_view)  # offset has the scale's shape
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            b.copy_(x)  # float64 rounds to float32 first, as t.to(float32) does
            x = b
        torch.div(x, s, out=b)  # half/bfloat16 widen exactly to float32 inside the kernel
        torch.round(b, out=b)
        if subtract:
            b.sub_(o)
        b.clamp_(qmin, qmax)
        if not packed:
            if r1 is None:
                out.copy_(b.view(out.shape))
            else:
                out[r0:r1].copy_(b.view(out[r0:r1].shape))
            continue
        c = codes8[:n]
        c.copy_(b.reshape(-1))
        byte0 = done * e.bitwidth // 8
        nbytes = (n * e.bitwidth + 7) // 8
        _pack_into(out[byte0:byte0 + nbytes], c, e.bitwidth)
        done += n
    return out


def _pack_into(dst: torch.Tensor, codes: torch.Tensor, bits: int) -> None:
    """``dst[:] = pack_bytes(codes, bits)`` for int8 ``codes`` that fit ``bits``; byte operations for 1/2/4 bits."""
    per = 8 // bits if 8 % bits == 0 else 0
    if not per or codes.numel() % per:
        from ..quant.packing import pack_bytes

        dst.copy_(pack_bytes(codes, bits))
        return
    u = codes.view(torch.uint8).view(-1, per)  # two's complement bits; the mask keeps the low ``bits``
    mask = (1 << bits) - 1
    torch.bitwise_left_shift(u[:, per - 1], (per - 1) * bits, out=dst)  # uint8: the shift drops the high bits
    for j in range(per - 1):
        part = torch.bitwise_and(u[:, j], mask)
        dst.bitwise_or_(part.bitwise_left_shift_(j * bits) if j else part)


def export_files(path: Path) -> List[Path]:
    """The safetensors files of a qtool integer export: ``path`` is a directory (single file or sharded), its
    ``model.safetensors.index.json``, or one ``.safetensors`` file."""
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_NAME).exists():
            path = path / INDEX_NAME
        elif (path / SINGLE_NAME).exists():
            return [path / SINGLE_NAME]
        else:
            raise EncodingsError(f"{path}: no {SINGLE_NAME} or {INDEX_NAME} here")
    if path.name.endswith(".index.json"):
        weight_map = read_json_object(path, EncodingsError, "safetensors index", strict=True).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and f and Path(f).name == f for f in weight_map.values()):
            raise EncodingsError(f"{path}: not a valid safetensors index ('weight_map' must map tensor names to "
                                 f"file names beside it)")
        if not weight_map:
            raise EncodingsError(f"{path}: weight_map names no tensor")
        return [path.parent / f for f in sorted(set(weight_map.values()))]
    return [path]


def read_integer_export(path: Path) -> Dict[str, torch.Tensor]:
    """Dequantized weights of a qtool integer export, keyed by the original tensor names (for checks).

    ``path``: the output directory, its index, or a ``.safetensors`` file (a shard gives that shard's tensors).
    A file that is not a well-formed qtool export raises ``EncodingsError`` naming it."""
    from safetensors import SafetensorError

    out = {}
    for file in export_files(path):
        try:
            out.update(_read_export_file(file))
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError, SafetensorError) as e:
            first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise EncodingsError(f"{file}: not a readable qtool export ({type(e).__name__}: {first})") from None
    return out


def _read_export_file(file: Path) -> Dict[str, torch.Tensor]:
    from safetensors import safe_open

    from ..quant import dequantize

    out = {}
    with safe_open(str(file), "pt") as fh:
        meta = json.loads((fh.metadata() or {})["qtool"])
        if not isinstance(meta, dict) or not all(isinstance(m, dict) for m in meta.values()):
            raise ValueError("its qtool metadata is not an object of objects")
        for key in fh.keys():
            if any(key.endswith(s) and key[:-len(s)] in meta for s in _COMPANIONS):
                continue
            t = fh.get_tensor(key)
            if key in meta and meta[key].get("element"):
                t = _dequantize_float(fh, key, t, meta[key])
            elif key in meta:
                m = meta[key]
                if m.get("packed"):
                    from ..quant.packing import unpack_bytes

                    t = unpack_bytes(t, m["bitwidth"], m["shape"], signed=m["qmin"] < 0)
                bs = None if m["block_size"] is None else tuple(m["block_size"])
                t = dequantize(t, fh.get_tensor(key + "_scale"), fh.get_tensor(key + "_offset").to(torch.float32),
                               block_size=bs)
            out[key] = t
    return out


def _dequantize_float(fh, key: str, t: torch.Tensor, m: Dict) -> torch.Tensor:
    """A float-element weight of a qtool export back to its real values (float32)."""
    from ..quant.floatgrid import element_of, float_dequantize
    from ..quant.packing import unpack_bytes

    element = element_of(m["element"])
    if element.bits == 8:
        codes = t.view(torch.uint8).to(torch.int64)
    else:
        codes = (unpack_bytes(t, 4, m["shape"], signed=False) if m.get("packed") else t).to(torch.int64)
    scale = fh.get_tensor(key + "_scale")
    if m["scale_dtype"] == "e8m0":
        eff = torch.pow(2.0, scale.to(torch.float32) - 127)
    elif m["scale_dtype"] == "fp8_e4m3":
        eff = scale.to(torch.float32) / fh.get_tensor(key + "_global_scale").reshape(())
    else:
        eff = scale.to(torch.float32)
    bs = None if m["block_size"] is None else tuple(m["block_size"])
    return float_dequantize(codes.reshape(m["shape"]), eff, element, bs)


class QtoolExporter(Exporter):
    """``--format qtool``: integer safetensors (see the module docs)."""

    name = "qtool"
    lazy_encodings = True
    online_rotations = True  # listed in the metadata (qtool_online_rotations), as the encodings file has them

    @dataclass
    class Options:
        pack: bool = True  # sub-byte codes packed densely
        max_shard_bytes: Optional[int] = DEFAULT_MAX_SHARD_BYTES  # None: one file

    def check_tied(self, tied) -> None:
        refuse_tied(self.name, tied)

    def tensor_bytes(self, quantizer, shape, dtype, options: "QtoolExporter.Options") -> int:
        layout = [("", dtype, tuple(shape))] if quantizer is None else weight_layout("", quantizer.spec, shape,
                                                                                     options.pack)
        return layout_bytes(layout)

    def write(self, request: ExportRequest, options: "QtoolExporter.Options") -> Dict[str, object]:
        return export_integer(request.checkpoint, request.encodings, request.out_dir, progress=request.progress,
                              pack=options.pack, max_shard_bytes=options.max_shard_bytes, weights=request.weights)


EXPORTER = QtoolExporter()
