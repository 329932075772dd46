"""AIMET encodings files, versions 0.6.1, 1.0.0 and 2.0.0: writing them from qtool's encodings and reading them
back into qtool's encodings for a checkpoint.

Offsets differ by version (qtool's offset is AIMET's internal one, ``real = (q + offset) * scale``):

* 0.6.1 and 1.0.0 store ``offset + qmin`` (−128 for signed symmetric 8-bit; unchanged on unsigned grids);
  0.6.1 stores one entry per encoding element (row-major) with the effective ``min``/``max`` and
  ``is_symmetric`` as the strings ``"True"``/``"False"``.
* 2.0.0 follows ONNX QuantizeLinear: ``y_zero_point = -offset`` (omitted when all zero), ``output_dtype`` names
  the integer type (``int8``, ``uint4``, ...), ``axis`` the channel or block dimension and ``block_size`` the block.

Parameters are keyed by tensor name; activations by ONNX tensor names when a graph was exported alongside, else
by qtool's ``<module>.input`` / ``<module>.output``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .choices import AIMET_VERSIONS
from .encodings import EncodingEntry, EncodingsFile
from .errors import EncodingsError
from .io.jsonfile import read_json_object
from .quant.affine import grid
from .quant.spec import MAX_BITWIDTH, MIN_BITWIDTH

__all__ = ["VERSIONS", "block_problem", "entry_to_aimet", "to_aimet", "shared_names", "read_aimet", "from_aimet",
           "range_for_scale_offset"]

VERSIONS = AIMET_VERSIONS
READ_VERSIONS = VERSIONS + ("2.1.0",)  # 2.1.0 adds LPBQ/vector types; its int entries read like 2.0.0
_ENC_TYPES = {"per_tensor": "PER_TENSOR", "per_channel": "PER_CHANNEL", "per_block": "PER_BLOCK"}


def _floats(t: torch.Tensor) -> List[float]:
    return [float(v) for v in t.flatten().tolist()]


def _axis(e: EncodingEntry) -> Optional[int]:
    """The channel (per-channel) or blocked (per-block) dimension, as a non-negative index."""
    return e.spec.axis_and_block()[0]


def _block(e: EncodingEntry) -> Optional[int]:
    return e.spec.axis_and_block()[1]


def block_problem(spec) -> Optional[str]:
    """Why AIMET encodings cannot hold a quantizer's blocks (``spec``: a ``QuantSpec``), or None: AIMET's blockwise
    encodings block the input dimension (axis 1) alone, one row of blocks per output channel."""
    if spec.granularity != "per_block" or spec.block_size is None:
        return None
    blocked = [d for d, b in enumerate(spec.block_size) if b not in (1, -1)]
    if blocked == [1] and spec.block_size[0] == 1 and all(s == 1 for s in spec.shape[2:]):
        return None
    return f"blocks of {list(spec.block_size)}"


def entry_to_aimet(e: EncodingEntry, version: str) -> Any:
    """One quantizer's encoding as AIMET writes it in ``version`` (without the name for 0.6.1)."""
    scale, offset = e.scale_offset()
    qmin, qmax = e.qmin_qmax
    if version == "0.6.1":
        enc_min = ((offset + qmin) * scale).flatten()
        enc_max = ((offset + qmax) * scale).flatten()
        return [{"min": float(lo), "max": float(hi), "scale": float(s), "offset": int(o) + qmin,
                 "bitwidth": e.bitwidth, "dtype": "int", "is_symmetric": str(bool(e.symmetric))}
                for lo, hi, s, o in zip(enc_min.tolist(), enc_max.tolist(), scale.flatten().tolist(),
                                        offset.flatten().tolist())]
    if version == "1.0.0":
        item: Dict[str, Any] = {"name": e.name, "dtype": "INT", "bw": e.bitwidth, "is_sym": e.symmetric,
                                "scale": _floats(scale), "offset": [int(o) + qmin for o in offset.flatten().tolist()],
                                "enc_type": _ENC_TYPES[e.granularity]}
        if e.granularity == "per_block":
            item["block_size"] = _block(e)
        return item
    if version == "2.0.0":
        signed = qmin < 0
        item = {"name": e.name, "output_dtype": f"{'int' if signed else 'uint'}{e.bitwidth}"}
        zp = (-offset).to(torch.int64)
        if e.granularity == "per_tensor":
            item["y_scale"] = float(scale.reshape(()))
            if bool((zp != 0).any()):
                item["y_zero_point"] = int(zp.reshape(()))
        elif e.granularity == "per_channel":
            item["y_scale"] = _floats(scale)
            if bool((zp != 0).any()):
                item["y_zero_point"] = [int(v) for v in zp.flatten().tolist()]
            item["axis"] = _axis(e)
        else:
            item["y_scale"] = scale.tolist()
            if bool((zp != 0).any()):
                item["y_zero_point"] = zp.tolist()
            item["axis"] = _axis(e)
            item["block_size"] = _block(e)
        return item
    raise EncodingsError(f"unknown AIMET encoding version {version!r} (choose one of {', '.join(VERSIONS)})")


def to_aimet(enc: EncodingsFile, version: str, producer_version: str,
             names: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A whole AIMET encodings file. ``names`` renames quantizers (e.g. to checkpoint or ONNX tensor names); a
    list of names writes the encoding once under each (an activation quantizer of a module called twice)."""
    names = names or {}
    producer = {"package": "qtool", "version": producer_version}
    params = [e for e in enc.entries if e.tensor == "weight"]
    acts = [e for e in enc.entries if e.tensor != "weight"]

    def named(entries):
        seen = set()
        for e in entries:
            item, name = entry_to_aimet(e, version), names.get(e.name, e.name)
            for n in name if isinstance(name, list) else [name]:
                if n not in seen:  # (one tensor read by several quantizers: the first's, see shared_names)
                    seen.add(n)
                    yield n, item

    if version == "2.0.0":
        return {"producer": producer, "version": "2.0.0",
                "encodings": [dict(item, name=n) for n, item in named(params + acts)]}
    if version == "0.6.1":
        p: Any = {n: item for n, item in named(params)}
        a: Any = {n: item for n, item in named(acts)}
    else:
        p = [dict(item, name=n) for n, item in named(params)]
        a = [dict(item, name=n) for n, item in named(acts)]
    return {"producer": producer, "version": version, "activation_encodings": a, "param_encodings": p,
            "excluded_layers": [], "quantizer_args": {}}


def shared_names(enc: EncodingsFile, version: str,
                 names: Optional[Dict[str, Any]] = None) -> List[Tuple[str, List[str]]]:
    """The tensor names :func:`to_aimet` writes for several quantizers whose encodings differ, each with those
    quantizers (first the one written): an AIMET file holds one encoding per tensor name, and a tensor several
    modules read (a BERT's LayerNorm output, the input of its query, key and value) can have one per reader."""
    names = names or {}
    by_name: Dict[str, List[EncodingEntry]] = {}
    for e in enc.entries:
        name = names.get(e.name, e.name)
        for n in name if isinstance(name, list) else [name]:
            by_name.setdefault(n, []).append(e)
    shared = []
    for n, found in by_name.items():  # (only a name several quantizers share is converted to compare)
        # (without the quantizer's own name, which 1.0.0 and 2.0.0 items carry and every reader's differs in)
        items = [_unnamed(entry_to_aimet(e, version)) for e in found] if len(found) > 1 else []
        if any(item != items[0] for item in items[1:]):
            shared.append((n, [e.name for e in found]))
    return shared


def _unnamed(item: Any) -> Any:
    """An AIMET encoding (a dict, or 0.6.1's list of dicts) without its ``name`` keys."""
    if isinstance(item, list):
        return [_unnamed(i) for i in item]
    return {k: v for k, v in item.items() if k != "name"} if isinstance(item, dict) else item


# --------------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------------
def range_for_scale_offset(scale: torch.Tensor, offset: torch.Tensor, qmin: int, qmax: int, symmetric: bool):
    """A stored ``(min, max)`` from which qtool recomputes exactly ``(scale, offset)`` where any range can.

    Starts from the effective range ``((offset + qmin) * scale, (offset + qmax) * scale)``. Where
    ``(max - min) / n`` rounds to a neighbour of ``scale``, ``max`` is nudged by float32 ulps; where no ``max`` hits
    it (the quotient's steps can straddle ``scale``), ``min`` is moved by an ulp or a few and the search repeats.
    The offset only depends on ``min / scale`` rounded, which such tiny moves leave alone.
    """
    from .quant.affine import min_max_to_scale_offset

    scale = scale.to(torch.float32)
    offset = offset.to(torch.float32)
    mn0 = (offset + qmin) * scale
    mx0 = (offset + qmax) * scale
    out_mn, out_mx = mn0.clone(), mx0.clone()
    done = torch.zeros(scale.shape, dtype=torch.bool)
    inf = torch.full_like(mx0, float("inf"))
    for shift in (0, 1, -1, 2, -2, 3, -3, 4, -4):
        mn = mn0
        for _ in range(abs(shift)):
            mn = torch.nextafter(mn, inf if shift > 0 else -inf)
        mx = mx0
        for _ in range(24):
            s2, o2 = min_max_to_scale_offset(mn, mx, qmin, qmax, symmetric)
            ok = (s2 == scale) & (o2 == offset) & ~done
            out_mn = torch.where(ok, mn, out_mn)
            out_mx = torch.where(ok, mx, out_mx)
            done |= ok
            if bool(done.all()):
                return out_mn, out_mx
            mx = torch.where(s2 < scale, torch.nextafter(mx, inf), torch.where(s2 > scale, torch.nextafter(mx, -inf), mx))
    # Left: scales that no float32 (max - min) / n produces (possible in hand-written files, never in files that
    # qtool or AIMET computed from a range). They keep the effective range, one ulp of scale away.
    return out_mn, out_mx


def read_aimet(path: Path) -> Dict[str, Any]:
    obj = read_json_object(path, EncodingsError, "AIMET encodings file", strict=True)
    if str(obj.get("version")) not in READ_VERSIONS:
        raise EncodingsError(f"{path}: not an AIMET encodings file of version {', '.join(READ_VERSIONS)} "
                             f"(version {str(obj.get('version'))[:40]!r})")
    return obj


def _granularity_from_count(count: int, wshape: Tuple[int, ...], block: Optional[int], axis: Optional[int],
                            per_channel: bool = False):
    """(granularity, shape, block_size) for ``count`` encodings of a weight of shape ``wshape``; ``per_channel``:
    the file says so (1.0.0's enc_type, 2.0.0's axis without a block), which decides a weight of one output
    channel (0.6.1 cannot tell it from per-tensor)."""
    nd = len(wshape)
    if block is not None and (type(block) is not int or block < 1):
        raise EncodingsError(f"block_size must be a positive integer (got {str(block)[:40]!r})")
    if count == 1 and block is None and not (per_channel and wshape[0] == 1):
        return "per_tensor", (), None
    if block is None and count == wshape[0]:
        return "per_channel", (wshape[0],) + (1,) * (nd - 1), None
    if per_channel and block is None:
        if nd >= 3 and count == wshape[1]:  # (AIMET's channels of a transposed convolution: its weight's dim 1)
            raise EncodingsError(f"{count} per-channel encodings for a weight of shape {list(wshape)}: qtool's run "
                                 f"along axis 0 (one per output channel, {wshape[0]}); {count} is its dim 1, where "
                                 "AIMET counts a transposed convolution's output channels: such a layer takes "
                                 "per_tensor encodings only")
        raise EncodingsError(f"{count} per-channel encodings for a weight of shape {list(wshape)} (one per output "
                             "channel, along axis 0)")
    ax = 1 if axis is None else axis
    if block is None and count % wshape[0] == 0 and nd >= 2:
        per_row = count // wshape[0]
        if wshape[ax] % per_row == 0:
            block = wshape[ax] // per_row
    if block is None or nd < 2 or wshape[ax] % block:
        raise EncodingsError(f"{count} encodings do not fit a weight of shape {list(wshape)}")
    shape = tuple(wshape[d] // block if d == ax else (wshape[d] if d == 0 else 1) for d in range(nd))
    block_size = tuple(block if d == ax else (1 if d == 0 else -1) for d in range(nd))
    if int(torch.Size(shape).numel()) != count:
        raise EncodingsError(f"{count} encodings do not fit a weight of shape {list(wshape)} in blocks of {block}")
    return "per_block", shape, block_size


def _int(value: Any, what: str) -> int:
    """An integer field of an AIMET file (a bool or a fractional number is not one)."""
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise ValueError(f"{what} must be an integer (got {str(value)[:40]!r})")
    return int(value)


def _numbers(value: Any, what: str) -> torch.Tensor:
    """A scale's or offset's numbers (a JSON number, or lists of them nested as the file nests them) in float64, so
    the checks see what the file says before float32 rounds it (1e300 to inf, 1e-50 to 0). A JSON ``true`` is not
    a number, nor is a string. ``what``: ``file: entry: field``, for the one line."""
    def check(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                check(x)
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise EncodingsError(f"{what} must be numbers (got {str(v)[:40]!r})")

    check(value)
    numbers = torch.tensor(value, dtype=torch.float64)
    if numbers.numel() == 0:
        raise EncodingsError(f"{what} holds no numbers")
    return numbers


_MALFORMED = (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError)


def _a_mapping(item: Any) -> Dict[str, Any]:
    if not isinstance(item, dict):
        raise TypeError(f"an encoding is a mapping of its fields (got {str(item)[:40]!r})")
    return item


def _missing(e: Exception) -> str:
    """A malformed entry's problem in words: the key it lacks, or the error's own line."""
    if isinstance(e, KeyError):
        return f"no {e.args[0]!r} key" if e.args else "a key is missing"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def _row_0_6_1(source: str, name: str, item: Any) -> Tuple[int, bool, torch.Tensor, torch.Tensor]:
    """(bitwidth, symmetric, scales, offsets) of a 0.6.1 entry: a list of one encoding per channel, which share
    one bitwidth, symmetry and dtype (one quantizer); a float one (``dtype: float``) is refused."""
    if not isinstance(item, list) or not item or not all(isinstance(i, dict) for i in item):
        raise EncodingsError(f"{source}: {name}: a 0.6.1 entry is a list of encodings, one per channel (got "
                             f"{str(item)[:40]!r})")
    dtypes = [str(i.get("dtype", "int")).lower() for i in item]
    if any(d != "int" for d in dtypes):
        other = next(d for d in dtypes if d != "int")
        raise EncodingsError(f"{source}: {name}: dtype {other[:20]!r}: only integer encodings can be imported")
    for key in ("bitwidth", "is_symmetric"):
        other = next((k for k, i in enumerate(item) if str(i.get(key)) != str(item[0].get(key))), None)
        if other is not None:
            raise EncodingsError(f"{source}: {name}: channel {other}'s {key} {str(item[other].get(key))[:20]} "
                                 f"differs from channel 0's {str(item[0].get(key))[:20]} (one quantizer has one)")
    bits = _int(item[0]["bitwidth"], f"{name}.bitwidth")
    if str(item[0]["is_symmetric"]) not in ("True", "False"):
        raise EncodingsError(f"{source}: {name}: is_symmetric must be \"True\" or \"False\" "
                             f"(got {str(item[0]['is_symmetric'])[:40]!r})")
    scale = _numbers([i["scale"] for i in item], f"{source}: {name}: scale")
    off = _numbers([i["offset"] for i in item], f"{source}: {name}: offset")
    return bits, str(item[0]["is_symmetric"]) == "True", scale, off


def _range_disagrees(item: List[Dict[str, Any]], bits: int, scale: torch.Tensor, off: torch.Tensor) -> Optional[str]:
    """Where a 0.6.1 entry's ``min`` / ``max`` (the effective range, ``offset·scale`` and ``(offset + 2^bw - 1)·scale``)
    are not those of its ``scale`` / ``offset`` by more than a hundredth of a step: what qtool imports (the scale
    and offset) then differs from what the file's range says."""
    if not 1 <= bits <= 64 or not all(isinstance(i.get(k), (int, float)) and not isinstance(i.get(k), bool)
                                      for i in item for k in ("min", "max")):
        return None  # (no range written, or a bitwidth refused below)
    lo = torch.tensor([float(i["min"]) for i in item], dtype=torch.float64)
    hi = torch.tensor([float(i["max"]) for i in item], dtype=torch.float64)
    want_lo, want_hi = off * scale, (off + 2 ** bits - 1) * scale
    far = ((lo - want_lo).abs() > 0.01 * scale) | ((hi - want_hi).abs() > 0.01 * scale)
    if not bool(far.any()):
        return None
    k = int(far.nonzero()[0])
    return (f"min/max [{float(lo[k]):.6g}, {float(hi[k]):.6g}] (channel {k}) are not the range its scale and offset "
            f"give, [{float(want_lo[k]):.6g}, {float(want_hi[k]):.6g}]; imported by its scale and offset")


def from_aimet(obj: Dict[str, Any], weight_shapes: Dict[str, Tuple[int, ...]], source: str,
               module_of: Callable[[str], Optional[str]]) -> Tuple[EncodingsFile, List[str]]:
    """qtool encodings from an AIMET file. ``weight_shapes`` maps checkpoint tensor names to shapes;
    ``module_of(tensor_name)`` gives the module that owns a parameter. Returns the encodings and warnings
    (entries skipped, e.g. activations keyed by ONNX tensor names, or biases)."""
    version = str(obj["version"])
    rows: List[Tuple[str, str, Dict[str, Any]]] = []  # (kind, name, normalized)
    current = None  # the entry being read, for a malformed one's line
    try:
        if version in ("2.0.0", "2.1.0"):
            for k, item in enumerate(obj["encodings"]):
                current = f"encodings[{k}]"
                _a_mapping(item)
                current = str(item["name"])
                if "per_block_int_scale" in item or isinstance(item.get("y_scale"), dict):
                    raise EncodingsError(f"{source}: {item['name']}: LPBQ and vector encodings are not supported "
                                         "(only integer per-tensor, per-channel and blockwise ones import)")
                dt = str(item["output_dtype"])
                dtype = re.fullmatch(r"(u?)int([0-9]{1,4})", dt)
                if dtype is None:
                    raise EncodingsError(f"{source}: {item['name']}: output_dtype {dt[:40]!r} is not supported "
                                         "(integer types import: int8, uint8, int4, ...)")
                signed, bits = not dtype.group(1), int(dtype.group(2))
                scale = _numbers(item["y_scale"], f"{source}: {item['name']}: y_scale")
                zp = _numbers(item.get("y_zero_point", 0), f"{source}: {item['name']}: y_zero_point")
                if zp.numel() != 1 and zp.numel() != scale.numel():
                    raise EncodingsError(f"{source}: {item['name']}: {zp.numel()} offsets for {scale.numel()} "
                                         "scales (give one y_zero_point per y_scale, or one for all)")
                if zp.numel() != 1 and zp.dim() > 1 and _squeezed(zp.shape) != _squeezed(scale.shape):
                    raise EncodingsError(f"{source}: {item['name']}: y_zero_point is nested as {list(zp.shape)}, "
                                         f"y_scale as {list(scale.shape)} (give them the same shape)")
                zp = zp.reshape(-1)[0].expand(scale.shape) if zp.numel() == 1 else zp.reshape(scale.shape)
                rows.append(("any", str(item["name"]), {"bits": bits, "signed": signed, "scale": scale,
                                                         "offset": -zp, "declared_sym": False,
                                                         "axis": item.get("axis"),
                                                         "block": item.get("block_size"),
                                                         "per_channel": "axis" in item and "block_size" not in item}))
        else:
            for kind, key in (("param", "param_encodings"), ("act", "activation_encodings")):
                section = obj.get(key, [] if version == "1.0.0" else {})
                if not isinstance(section, list if version == "1.0.0" else dict):
                    raise EncodingsError(f"{source}: {key} must be a {'list' if version == '1.0.0' else 'mapping'} "
                                         f"of encodings in AIMET {version} (got {type(section).__name__})")
                for k, entry in enumerate(section.items() if version == "0.6.1" else section):
                    current = f"{key}[{k}]"
                    name, item = entry if version == "0.6.1" else (_a_mapping(entry)["name"], entry)
                    current = str(name)
                    note = None
                    if version == "0.6.1":
                        bits, sym, scale, off = _row_0_6_1(source, name, item)
                        block, note = None, _range_disagrees(item, bits, scale, off)
                    else:
                        if str(item.get("dtype", "INT")).upper() != "INT":
                            raise EncodingsError(f"{source}: {name}: only integer encodings can be imported")
                        bits = _int(item["bw"], f"{name}.bw")
                        if not isinstance(item["is_sym"], bool):
                            raise EncodingsError(f"{source}: {name}: is_sym must be true or false (got "
                                                 f"{str(item['is_sym'])[:40]!r})")
                        sym = item["is_sym"]
                        scale = _numbers(item["scale"], f"{source}: {name}: scale")
                        off = _numbers(item["offset"], f"{source}: {name}: offset")
                        block = item.get("block_size")
                        if item.get("enc_type") not in (None, "PER_TENSOR", "PER_CHANNEL", "PER_BLOCK"):
                            raise EncodingsError(f"{source}: {name}: enc_type {item.get('enc_type')} is not supported")
                        if item.get("enc_type") == "PER_TENSOR" and scale.numel() != 1:
                            raise EncodingsError(f"{source}: {name}: enc_type PER_TENSOR with {scale.numel()} "
                                                 "scales (a per-tensor encoding has one)")
                    if not 1 <= bits <= 64:  # (checked against 2..16 once skips are known; grid() needs sanity)
                        raise EncodingsError(f"{source}: {name}: bitwidth {str(bits)[:20]} is outside "
                                             f"{MIN_BITWIDTH}..{MAX_BITWIDTH}")
                    qmin, _ = grid(bits, signed=sym)
                    per_channel = version == "1.0.0" and item.get("enc_type") == "PER_CHANNEL"
                    rows.append((kind, str(name), {"bits": bits, "signed": sym, "declared_sym": sym, "scale": scale,
                                                   "offset": off - qmin, "axis": None, "block": block,
                                                   "per_channel": per_channel, "note": note}))
    except EncodingsError:
        raise
    except _MALFORMED as e:
        where = f"{current}: malformed AIMET {version} entry" if current else f"malformed AIMET {version} encodings"
        raise EncodingsError(f"{source}: {where} ({_missing(e)})") from None

    entries: List[EncodingEntry] = []
    warnings: List[str] = []
    names = [name for _, name, _ in rows]
    if len(set(names)) != len(names):
        seen: set = set()
        dup = next(n for n in names if n in seen or seen.add(n))
        raise EncodingsError(f"{source}: {dup!r} has two encodings")
    for kind, name, r in rows:
        try:
            entry = _entry_from_row(name, r, weight_shapes, module_of, source, warnings, kind)
        except (TypeError, ValueError, ZeroDivisionError, OverflowError, RuntimeError) as e:
            raise EncodingsError(f"{source}: {name}: malformed encoding ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
        if entry is not None:
            entries.append(entry)
            if r.get("note"):
                warnings.append(f"{name}: {r['note']}")
    if not entries:
        where = "encodings" if version in ("2.0.0", "2.1.0") else "param_encodings / activation_encodings"
        what = (f"none of its {len(rows)} entries (e.g. {rows[0][1][:80]!r}) names a weight of this checkpoint or "
                "a <module>.input / .output; were they made for another model?" if rows else
                f"the file holds no encodings (AIMET {version} keeps them in {where})")
        if rows and all(w.endswith(_NOT_A_WEIGHT) for w in warnings) and len(warnings) == len(rows):
            what = (f"its {len(rows)} entries (e.g. {rows[0][1][:80]!r}) name biases or buffers, which qtool does "
                    "not quantize (it imports weights and <module>.input / .output)")
        fused = next((w for w in warnings if _FUSED_EXPERTS in w), None)
        raise EncodingsError(f"{source}: nothing to import: {what}" + (f" ({fused})" if fused else ""))
    return EncodingsFile(entries, {"imported_from": f"AIMET {version}"}), warnings


_NOT_A_WEIGHT = ": not a module weight (bias or buffer); skipped"


def _squeezed(shape) -> Tuple[int, ...]:
    """A shape without its size-1 dimensions (which leave the row-major order of the numbers alone)."""
    return tuple(d for d in shape if d != 1)


def _file_axis(axis: Any, nd: int, per_channel: bool) -> Optional[int]:
    """2.0.0's ``axis`` as a non-negative dimension, or a one-line reason it cannot be imported (ValueError)."""
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ValueError(f"axis must be an integer (got {str(axis)[:40]!r})")
    if not -nd <= axis < nd:
        raise ValueError(f"axis {axis} is outside a {nd}-D weight")
    axis %= nd
    if per_channel and axis != 0:
        raise ValueError(f"per-channel encodings along axis {axis} are not supported: qtool's per-channel "
                         "weights are along axis 0 (a Linear's or a convolution's output channels; a transposed "
                         "convolution's weight takes per-tensor encodings only)")
    if not per_channel and axis != 1:
        raise ValueError(f"blockwise encodings along axis {axis} are not supported: qtool imports blocks "
                         "along axis 1 (input channels) only")
    return axis


_FUSED_EXPERTS = "a mixture-of-experts layer's experts as one fused tensor: qtool names its experts one by one"


def _entry_from_row(name: str, r: Dict[str, Any], weight_shapes: Dict[str, Tuple[int, ...]],
                    module_of: Callable[[str], Optional[str]], source: str,
                    warnings: List[str], kind: str = "any") -> Optional[EncodingEntry]:
    """One checked qtool entry from a normalized AIMET row, or None (with a warning) for what is skipped."""
    from .quant.affine import _min_scale, min_max_to_scale_offset

    if name in weight_shapes:
        module = module_of(name)
        wshape = tuple(weight_shapes[name])
        if module is None or not name.endswith(".weight"):
            warnings.append(f"{name}{_NOT_A_WEIGHT}")
            return None
        count = r["scale"].numel()
        try:
            axis = _file_axis(r["axis"], len(wshape), r["per_channel"])
            gran, shape, block_size = _granularity_from_count(count, wshape, r["block"], axis, r["per_channel"])
        except (EncodingsError, ValueError) as e:
            raise EncodingsError(f"{source}: {name}: {e}") from None
        if r["scale"].dim() > 1 and _squeezed(r["scale"].shape) != _squeezed(shape):
            raise EncodingsError(f"{source}: {name}: y_scale is nested as {list(r['scale'].shape)}; a weight of "
                                 f"shape {list(wshape)} needs {list(shape)}")
        tensor = "weight"
        qname = f"{module}.weight"
    elif name.endswith(".input") or name.endswith(".output"):
        module, tensor = name.rsplit(".", 1)
        if not module:  # (the root model would get a quantizer: no forward of its own to watch)
            raise EncodingsError(f"{source}: {name}: an activation entry is <module>.{tensor}, and this one names no "
                                 "module")
        gran, shape, block_size, qname = "per_tensor", (), None, name
        if r["scale"].numel() != 1:
            raise EncodingsError(f"{source}: {name}: activation encodings must be per-tensor")
    else:
        experts = name.rsplit(".", 1)[0]
        if experts.endswith(".experts") and any(k.startswith(f"{experts}.0.") for k in weight_shapes):
            warnings.append(f"{name}: {_FUSED_EXPERTS} ({experts}.<e>.<projection>.weight, as its own AIMET export "
                            "writes them); skipped")
            return None
        why = {"param": "", "act": " (an ONNX activation name?)"}.get(kind, " (an ONNX activation name, or "
                                                                              "another model's tensor?)")
        warnings.append(f"{name}: no tensor of that name in the checkpoint{why}; skipped")
        return None
    bits = r["bits"]
    if not MIN_BITWIDTH <= bits <= MAX_BITWIDTH:  # (a skipped bias may be 32-bit)
        raise EncodingsError(f"{source}: {name}: bitwidth {bits} is outside {MIN_BITWIDTH}..{MAX_BITWIDTH}")
    qmin, qmax = grid(bits, signed=r["signed"])  # (after the check: 2**bits of a hostile bits never ends)
    if r["offset"].numel() != r["scale"].numel():
        raise EncodingsError(f"{source}: {name}: {r['offset'].numel()} offsets for {r['scale'].numel()} scales "
                             "(give one offset per scale)")
    scale = r["scale"].reshape(shape)  # (float64: as the file says)
    offset = r["offset"].reshape(shape)  # on the file's grid (signed or not): real = (q + offset) * scale
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        bad = scale[~(torch.isfinite(scale) & (scale > 0))].flatten()[0]
        raise EncodingsError(f"{source}: {name}: every scale must be a finite number above 0 (got {float(bad)})")
    if not (torch.isfinite(offset).all() and (offset == offset.round()).all()):
        raise EncodingsError(f"{source}: {name}: offsets must be integers")
    if ((offset < -qmax) | (offset > -qmin)).any():
        bad = offset[(offset < -qmax) | (offset > -qmin)].flatten()[0]
        raise EncodingsError(f"{source}: {name}: its offset puts zero at code {-float(bad):.6g}, outside the "
                             f"{bits}-bit grid [{qmin}, {qmax}]")
    said, scale, offset = scale, scale.to(torch.float32), offset.to(torch.float32)
    if torch.isinf(scale).any():
        raise EncodingsError(f"{source}: {name}: its range overflows float32 (scale up to "
                             f"{float(said.max()):.4g}); the range cannot be represented")
    smallest = torch.tensor(_min_scale(qmax - qmin), dtype=torch.float32)  # (what qtool clamps a scale to)
    if (scale < smallest).any():
        raise EncodingsError(f"{source}: {name}: scale {float(said[scale < smallest].flatten()[0]):.4g} is below "
                             f"the smallest qtool's {bits}-bit grids have ({float(smallest):.4g}); the range cannot "
                             "be represented")
    # qtool's symmetric grid is the signed one with offset 0; an encoding the file calls symmetric with other
    # offsets (AIMET's unsigned symmetric after a ReLU: [0, 255 * scale]) is the same grid as an asymmetric one
    symmetric = r["signed"] and bool((offset == 0).all())
    if r["declared_sym"] and not symmetric:
        warnings.append(f"{name}: symmetric, but its offsets are not those of the signed symmetric grid; imported "
                        "as asymmetric with the file's scales and offsets")
    if not symmetric and r["signed"]:  # the same grid on qtool's unsigned one
        offset, qmin, qmax = offset + qmin, 0, qmax - qmin
    mn, mx = range_for_scale_offset(scale, offset, qmin, qmax, symmetric)
    if not (torch.isfinite(mn).all() and torch.isfinite(mx).all()):
        raise EncodingsError(f"{source}: {name}: its range overflows float32 (scale up to "
                             f"{float(scale.max()):.4g}); the range cannot be represented")
    s2, o2 = min_max_to_scale_offset(mn, mx, qmin, qmax, symmetric)
    if not torch.isfinite(s2).all():  # (a finite range whose width overflows: blamed on NaN/Inf when written)
        raise EncodingsError(f"{source}: {name}: its range overflows float32 (scale up to "
                             f"{float(said.max()):.4g}); the range cannot be represented")
    if not torch.equal(o2, offset):
        raise EncodingsError(f"{source}: {name}: no float32 range gives its scales and offsets; the range cannot "
                             "be represented")
    if not torch.equal(s2, scale):
        warnings.append(f"{name}: {int((s2 != scale).sum())} scale(s) cannot come from any float32 range and "
                        "are one ulp off after import")
    return EncodingEntry(qname, module, tensor, bits, symmetric, gran, shape, block_size, "imported", mn, mx)
