"""``qtool inspect``: what a quantized artifact holds, as data (the CLI draws the table).

Understands qtool's integer safetensors (a file or an export directory), qtool's ``encodings.json``, AIMET
encodings files, compressed-tensors model directories, GGUF files (any, not only qtool's), and plain safetensors
files.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional

from .errors import UsageError
from .io.jsonfile import read_json_object

__all__ = ["inspect_path"]


def _header(path: Path) -> Dict[str, Any]:
    """The safetensors header (no tensor data is read)."""
    from .io.checkpoint import check_safetensors
    from .errors import CheckpointError

    try:
        check_safetensors(path)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _row(name, dtype, bitwidth, granularity, shape, nbytes, quantized, block_size=None):
    return {"name": name, "dtype": dtype, "bitwidth": bitwidth, "granularity": granularity,
            "block_size": [int(b) for b in block_size] if block_size else None,
            "shape": list(shape) if shape is not None else None,  # (None: the file does not say; [] is a scalar)
            "bytes": nbytes, "quantized": quantized}


def _totals(rows: List[Dict[str, Any]], numels: Optional[List[int]]) -> Dict[str, Any]:
    tot: Dict[str, Any] = {"tensors": len(rows), "quantized_tensors": sum(r["quantized"] for r in rows)}
    if numels is not None:
        b = sum(r["bytes"] for r in rows)
        f32, f16 = 4 * sum(numels), 2 * sum(numels)
        tot.update(bytes=b, float32_bytes=f32, float16_bytes=f16, ratio_vs_float32=f32 / max(b, 1),
                   ratio_vs_float16=f16 / max(b, 1), bits_per_weight=8 * b / max(sum(numels), 1))
    return tot


def _qtool_safetensors(path: Path, headers: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One qtool integer file, or every shard of a sharded export (headers in shard order)."""
    meta: Dict[str, Any] = {}
    entries: Dict[str, Any] = {}
    for header in headers:
        meta.update(json.loads(header.get("__metadata__", {}).get("qtool", "{}")))
        entries.update({k: v for k, v in header.items() if k != "__metadata__"})
    size = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in entries.items()}
    rows, numels = [], []
    for name, v in entries.items():
        if any(name.endswith(s) and name[:-len(s)] in meta for s in ("_global_scale", "_scale", "_offset")):
            continue
        if name in meta:
            m = meta[name]
            nbytes = size[name] + sum(size.get(name + s, 0) for s in ("_global_scale", "_scale", "_offset"))
            kind = m["element"] if m.get("element") else ("int" if m["qmin"] < 0 else "uint") + str(m["bitwidth"])
            dtype = ("packed " if m.get("packed") else "") + kind
            shape = m.get("shape", v["shape"])
            _check_bitwidth(path, name, m)
            _check_codes_fit(path, name, shape, m["bitwidth"], v)
            _check_scales(path, name, m, shape, entries)
            rows.append(_row(name, dtype, m["bitwidth"], m["granularity"], shape, nbytes, True, m.get("block_size")))
        else:
            shape = v["shape"]
            rows.append(_row(name, v["dtype"], None, None, shape, size[name], False))
        numels.append(_numel(shape))
    grids = "float" if any(m.get("element") for m in meta.values() if isinstance(m, dict)) else "integer"
    if grids == "float" and any(isinstance(m, dict) and not m.get("element") for m in meta.values()):
        grids = "integer and float"
    kind = f"qtool {grids} safetensors" + (f" ({len(headers)} shards)" if len(headers) > 1 else "")
    return {"kind": kind, "path": str(path), "tensors": rows, "totals": _totals(rows, numels)}


# bytes per element of the safetensors dtypes codes are stored in
_ITEMSIZE = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4,
             "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _check_bitwidth(path: Path, name: str, m: Dict[str, Any]) -> None:
    """A quantized weight's bitwidth is one qtool packs. A header that lies was listed as it said (int0, int-4),
    exit 0, where reading the file refuses it."""
    bits = m.get("bitwidth")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
        raise UsageError(f"{path}: '{name}': its metadata's bitwidth {repr(bits)[:20]} is not one qtool writes "
                         "(an integer from 1 to 16)")


def _check_scales(path: Path, name: str, m: Dict[str, Any], shape, entries: Dict[str, Any]) -> None:
    """What qtool's reader checks of a quantized weight's scales, from the headers alone: the scale (and offset)
    tensors beside the codes, and a scale whose shape the granularity, block size and weight shape give (blocks of
    16 over scales of blocks of 32 were listed as they said, exit 0)."""
    from .quant.affine import resolve_block_size

    needed = ("_scale",) if m.get("element") else ("_scale", "_offset")
    missing = next((s for s in needed if name + s not in entries), None)
    if missing is not None:
        raise UsageError(f"{path}: '{name}': no '{name}{missing}' beside its codes")
    if m.get("element"):
        return  # (a float grid's scales: their own layout, per block or tensor)
    try:
        block = m.get("block_size") if m.get("granularity") == "per_block" else None
        resolve_block_size(shape, entries[name + "_scale"]["shape"], block)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{path}: '{name}': its metadata ({m.get('granularity')}, block size {block}, shape "
                         f"{list(shape)}) does not give its stored scales' shape: "
                         f"{str(e).split('; pass block_size')[0]}") from None


def _check_codes_fit(path: Path, name: str, shape, bits: int, stored: Dict[str, Any]) -> None:
    """The weight shape the metadata gives must be one the stored codes can hold: at least ``bits`` per weight
    (packed), at most one stored element per weight (one code a byte). A header that lies was listed as it said:
    4e12 weights in 8 bytes, 0.00 bits per weight."""
    n = _numel(shape)
    nbytes = stored["data_offsets"][1] - stored["data_offsets"][0]
    most = n * _ITEMSIZE.get(stored.get("dtype"), 8)
    if not (n * int(bits) + 7) // 8 <= nbytes <= most:
        raise UsageError(f"{path}: '{name}': its metadata's shape {list(shape)} ({n:,} weights of {bits} bits) does "
                         f"not fit the {nbytes:,} bytes stored")


def _headers(files: List[Path]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for f in files:
        out.update({k: v for k, v in _header(f).items() if k != "__metadata__"})
    return out


def _plain_safetensors(files: List[Path], kind: str, path: Path) -> Dict[str, Any]:
    headers = _headers(files)
    rows = [_row(k, v["dtype"], None, None, v["shape"], v["data_offsets"][1] - v["data_offsets"][0], False)
            for k, v in headers.items()]
    return {"kind": kind, "path": str(path), "tensors": rows,
            "totals": _totals(rows, [_numel(v["shape"]) for v in headers.values()])}


_CT_PARTS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
             "weight_global_scale", "input_scale", "input_global_scale")
_FLOAT_ELEMENTS = {8: "fp8_e4m3", 4: "fp4_e2m1"}


def _config_groups(where: Path, qc: Dict[str, Any]) -> List[Dict[str, Any]]:
    """compressed-tensors' ``config_groups`` checked as far as the listing reads them (targets, weights.num_bits):
    one error naming the file and the key otherwise."""
    import re

    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise UsageError(f"{where}: quantization_config.config_groups must be a JSON object of groups")
    for name, group in groups.items():
        key = f"{where}: quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise UsageError(f"{key} must be a JSON object")
        targets = group.get("targets", [])
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise UsageError(f"{key}.targets must be a list of strings")
        for t in targets:
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except (re.error, RecursionError, OverflowError) as e:
                    raise UsageError(f"{key}.targets: bad regular expression {t[:40]!r} ({e})") from None
        weights = group.get("weights") or {}
        if not isinstance(weights, dict):
            raise UsageError(f"{key}.weights must be a JSON object")
        bits = weights.get("num_bits")
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 64):
            raise UsageError(f"{key}.weights.num_bits must be an integer from 1 to 64 (got {str(bits)[:20]!r})")
    return list(groups.values())


def _compressed_tensors_dir(path: Path, config: Dict[str, Any]) -> Dict[str, Any]:
    import re

    qc = config["quantization_config"]
    groups = _config_groups(path / "config.json", qc)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{path}: a compressed-tensors config.json, and no *.safetensors beside it")
    headers = _headers(files)
    size = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in headers.items()}
    layers = sorted({k.rsplit(".", 1)[0] for k in headers if k.endswith((".weight_packed", ".weight_scale"))})
    shapes: Dict[str, List[int]] = {}
    if any(k.endswith(".weight_shape") for k in headers):
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():
                    if k.endswith(".weight_shape"):
                        shapes[k.rsplit(".", 1)[0]] = [int(x) for x in fh.get_tensor(k).tolist()]

    def args_for(layer: str) -> Dict[str, Any]:
        found: Dict[str, Any] = {}
        for g in groups:
            for t in g.get("targets", []):
                if t == "Linear" or t == layer or (t.startswith("re:") and re.fullmatch(t[3:], layer)):
                    found = dict(g.get("weights") or {})
        return found

    rows, numels, used = [], [], set()
    for layer in layers:
        parts = [f"{layer}.{p}" for p in _CT_PARTS if f"{layer}.{p}" in headers]
        used.update(parts)
        a = args_for(layer)
        shape = shapes.get(layer) or headers.get(f"{layer}.weight", {}).get("shape", [])
        bits = a.get("num_bits")
        dtype = f"{'int' if a.get('symmetric', True) else 'uint'}{bits}" if bits else "?"
        if a.get("type") == "float":
            dtype = _FLOAT_ELEMENTS.get(bits, f"float{bits}")
            packed = headers.get(f"{layer}.weight_packed", {}).get("shape")
            if not shape and packed and len(packed) == 2 and bits == 4:  # two FP4 codes a byte
                shape = [packed[0], packed[1] * 2]
        if not shape:  # (pack-quantized int codes: 32 // bits a column of int32, the true width in weight_shape)
            raise UsageError(f"{path}: '{layer}' has no weight_shape beside its packed codes: the weight's shape "
                             "is not in the file")
        group = a.get("group_size")
        block = a.get("block_structure") or ([1, group] if isinstance(group, int) and group > 0 else None)
        rows.append(_row(f"{layer}.weight", dtype, bits, a.get("strategy"), shape, sum(size[p] for p in parts), True,
                         block))
        numels.append(_numel(shape))
    for k, v in headers.items():
        if k not in used:
            rows.append(_row(k, v["dtype"], None, None, v["shape"], size[k], False))
            numels.append(_numel(v["shape"]))
    return {"kind": f"compressed-tensors ({qc.get('format')})", "path": str(path), "tensors": rows,
            "totals": _totals(rows, numels)}


def _encodings_listing(path: Path, obj: Dict[str, Any]) -> Dict[str, Any]:
    rows = []
    if obj.get("schema") == "qtool.encodings":
        from .choices import GGML_SCALE_DTYPES
        from .config import granularity_word
        from .encodings import EncodingsFile

        for e in EncodingsFile.read(path, lazy=True).entries:  # the checks export makes: what lists, exports
            dtype = e.element if e.is_float else ("int" if e.symmetric else "uint") + str(e.bitwidth)
            if e.scale_dtype in GGML_SCALE_DTYPES:  # (IQ4_NL's grid is not int4, nor Q4_K's a uint4 one)
                dtype = f"GGUF {e.scale_dtype.upper()}"
            scales = f", {e.scale_dtype} scales" if e.is_float and e.scale_dtype != "float32" else ""
            gran = granularity_word(e.tensor, str(e.granularity)) + scales + (", dynamic" if e.dynamic else "")
            rows.append(_row(e.name, dtype, e.bitwidth, gran, list(e.shape), None, True, e.block_size))
        kind = "qtool encodings"
    else:
        version = str(obj.get("version"))
        if version.startswith("2."):
            for e in obj.get("encodings", []):
                dt = str(e.get("output_dtype"))
                bits = int("".join(c for c in dt if c.isdigit()) or 0) or None
                gran = "per_block" if "block_size" in e else ("per_channel" if "axis" in e else "per_tensor")
                rows.append(_row(e.get("name"), dt, bits, gran, None, None, True))
        else:
            for key in ("param_encodings", "activation_encodings"):
                section = obj.get(key) or ({} if version == "0.6.1" else [])
                items = section.items() if isinstance(section, dict) else ((i.get("name"), i) for i in section)
                for name, e in items:
                    if isinstance(e, list):
                        bits, n = e[0].get("bitwidth"), len(e)
                        gran = "per_tensor" if n == 1 else "per_channel/block"
                        sym = str(e[0].get("is_symmetric")).lower() == "true"
                    else:  # (LPBQ: the codes' bits are compressed_bw, bw the per-block scales')
                        bits, gran = e.get("compressed_bw", e.get("bw")), str(e.get("enc_type", "")).lower()
                        sym = e.get("is_sym") is True
                    rows.append(_row(name, f"{'int' if sym else 'uint'}{bits}", bits, gran, None, None, True))
        kind = f"AIMET encodings {version}"
    return {"kind": kind, "path": str(path), "tensors": rows, "totals": _totals(rows, None)}


# GGUF block types qtool's grids do not cover: bits per weight code
_GGUF_BITS = {"Q8_1": 8, "F32": 32, "F64": 64, "MXFP4": 4, "I8": 8, "I16": 16, "I32": 32, "I64": 64}
_GGUF_META = ("general.architecture", "general.name", "general.file_type", "general.quantization_version")


def _gguf_file(path: Path) -> Dict[str, Any]:
    from .choices import GGUF_TYPES

    """Tensor types, shapes and sizes plus the model metadata of a GGUF file (memory-mapped; no data is read)."""
    try:
        import gguf
    except ImportError:
        raise UsageError(f"{path}: reading GGUF needs the gguf package (pip install 'qtool[gguf]')") from None
    try:
        reader = gguf.GGUFReader(path)
        rows, numels = [], []
        for t in reader.tensors:
            kind = t.tensor_type.name
            shape = [int(d) for d in reversed(t.shape.tolist())]  # ggml lists the contiguous dimension first
            quantized = kind not in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")
            block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
            known = GGUF_TYPES.get(kind.lower())
            bits = known[0] if known is not None else _GGUF_BITS.get(kind, 16 if kind in ("F16", "BF16") else None)
            # a block's bytes over its weights: codes, scales and minima, what the type costs in the file
            gran = f"per_block {block}, {8 * block_bytes / block:g} bits/weight" if quantized else None
            rows.append(_row(t.name, kind, bits, gran, shape, int(t.n_bytes), quantized))
            numels.append(_numel(shape))
        meta: Dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key in _GGUF_META or (key.startswith(str(meta.get("general.architecture", "?")) + ".")) or key in (
                    "tokenizer.ggml.model", "tokenizer.ggml.pre"):
                value = field.contents()
                meta[key] = value if not isinstance(value, list) else f"[{len(value)} values]"
        if "tokenizer.ggml.tokens" in reader.fields:
            meta["tokenizer.ggml.tokens"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    except (ValueError, KeyError, IndexError, OSError, TypeError) as e:
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise UsageError(f"{path}: not a readable GGUF file ({why})") from None
    return {"kind": f"GGUF v{int(reader.fields['GGUF.version'].contents())}", "path": str(path), "tensors": rows,
            "totals": _totals(rows, numels), "metadata": meta}


# bits per element of the ONNX initializer types an export holds
_ONNX_BITS = {"INT4": 4, "UINT4": 4, "INT8": 8, "UINT8": 8, "INT16": 16, "UINT16": 16, "FLOAT16": 16, "BFLOAT16": 16,
              "FLOAT": 32, "INT32": 32, "UINT32": 32, "FLOAT8E4M3FN": 8, "INT64": 64, "DOUBLE": 64}


def _onnx_file(path: Path) -> Dict[str, Any]:
    """An ONNX graph's initializers: each one's type, shape and stored bytes; the integer ones a DequantizeLinear
    reads are the quantized weights (external data is not read)."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends: not an ONNX model
        raise UsageError(f"{path}: not a readable ONNX model ({type(e).__name__})") from None
    if not model.ir_version or not model.graph.node:  # (protobuf reads most bytes as some message)
        raise UsageError(f"{path}: not a readable ONNX model (no graph)")
    dequantized = {n.input[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input}
    scales = {t.name: [int(d) for d in t.dims] for t in model.graph.initializer}
    # a (De)QuantizeLinear's scale and zero point: their bytes are the file's, but no float model holds them (the
    # float sizes and bits per weight count the model's own tensors, as a qtool file's listing does)
    params = {name for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
              for name in n.input[1:3]}
    rows, numels = [], []
    for t in model.graph.initializer:
        kind = onnx.TensorProto.DataType.Name(t.data_type)
        bits = _ONNX_BITS.get(kind)
        shape = [int(d) for d in t.dims]
        external = {e.key: e.value for e in t.external_data}
        nbytes = (int(external["length"]) if "length" in external else len(t.raw_data) if t.raw_data
                  else (_numel(shape) * bits + 7) // 8 if bits else 0)
        quantized = t.name in dequantized and kind.startswith(("INT", "UINT", "FLOAT8"))
        granularity, block = _dequantized_layout(dequantized[t.name], scales, len(shape)) if quantized else (None, None)
        rows.append(_row(t.name, kind.lower(), bits, granularity, shape, nbytes, quantized, block))
        numels.append(0 if t.name in params else _numel(shape))
    return {"kind": f"ONNX (opset {max((o.version for o in model.opset_import), default=0)})", "path": str(path),
            "tensors": rows, "totals": _totals(rows, numels)}


def _dequantized_layout(node, scales: Dict[str, List[int]], rank: int):
    """``(granularity, block_size)`` of the codes a DequantizeLinear ``node`` reads, from its ``block_size`` and
    ``axis`` and its scale initializer's shape (``scales``): one scale is per_tensor, a vector per_channel."""
    import onnx

    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    block, axis = int(attrs.get("block_size", 0) or 0), int(attrs.get("axis", 1))
    if block > 0 and rank:
        sizes = [1] * rank
        sizes[axis % rank] = block
        return "per_block", sizes
    scale = scales.get(node.input[1]) if len(node.input) > 1 else None
    if scale is None:
        return None, None
    return ("per_tensor" if _numel(scale) == 1 else "per_channel"), None


def inspect_path(path: str | Path) -> Dict[str, Any]:
    """What ``path`` holds (a listing of tensors or encodings). Files whose structure is not what their kind
    promises (missing keys, wrong types, nesting too deep) are one error naming the file."""
    try:
        return _inspect(Path(path))
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, RecursionError) as e:
        raise UsageError(f"{path}: malformed file ({type(e).__name__}: {str(e)[:120]})") from None


def _refuse_a_part(p: Path) -> None:
    """A safetensors file that is one part of what qtool wrote, read alone as a float model's tensors: a
    compressed-tensors export's weights (their layout is in config.json; packed int32 words read as 32-bit
    weights) or an encodings sidecar (ranges and scales, no weights)."""
    from .encodings import SIDECAR

    config = p.parent / "config.json"
    if config.is_file():
        try:
            cfg = read_json_object(config, UsageError, "Hugging Face config")
        except UsageError:
            return
        qc = cfg.get("quantization_config")
        if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
            raise UsageError(f"{p}: a compressed-tensors export's weights, whose layout its config.json holds: "
                             f"inspect the directory {p.parent}")
    if p.name == SIDECAR and (p.parent / "encodings.json").is_file():
        raise UsageError(f"{p}: the numbers of {p.parent / 'encodings.json'}, which names them: inspect that")


def _check_index(index: Path, files: List[Path], headers: List[Dict[str, Any]]) -> None:
    """The index's weight_map and the shards agree: every tensor a shard holds is mapped to it, every mapped name is
    in its shard, and no shard beside it of the same series is left out. An index that left out a shard was
    listed without it (three tensors fewer, exit 0)."""
    import re

    weight_map = read_json_object(index, UsageError, "safetensors index", strict=True)["weight_map"]
    for f, header in zip(files, headers):
        held = {k for k in header if k != "__metadata__"}
        odd = next((k for k in sorted(held) if weight_map.get(k) != f.name), None)
        if odd is not None:
            raise UsageError(f"{index}: {f.name} holds '{odd}', which its weight_map "
                             f"{'maps to ' + repr(weight_map[odd]) if odd in weight_map else 'does not name'}")
        lost = next((k for k, v in sorted(weight_map.items()) if v == f.name and k not in held), None)
        if lost is not None:
            raise UsageError(f"{index}: its weight_map puts '{lost}' in {f.name}, which does not hold it")
    series = re.compile(r"(.+)-\d{5}-of-(\d{5})\.safetensors")
    named = {f.name for f in files}
    for f in files:
        m = series.fullmatch(f.name)
        if m is None:
            continue
        beside = sorted(g.name for g in index.parent.glob(f"{m[1]}-*-of-{m[2]}.safetensors") if g.name not in named)
        if beside:
            raise UsageError(f"{index}: its weight_map names {len(named)} of the {int(m[2])} shards; it leaves out "
                             f"{beside[0]} beside it")
        break


def _inspect(p: Path) -> Dict[str, Any]:
    if not p.exists():
        if p.is_symlink():
            raise UsageError(f"{p}: a link to nothing (its target is missing, or the links loop)")
        raise UsageError(f"{p}: not found")
    if not (p.is_dir() or p.is_file()):  # (a named pipe's open waited for a writer forever)
        raise UsageError(f"{p}: not a regular file or a directory (a pipe, a socket or a device)")
    if p.is_dir():
        if (p / "config.json").exists():
            cfg = read_json_object(p / "config.json", UsageError, "Hugging Face config")
            if (cfg.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
                return _compressed_tensors_dir(p, cfg)
        if (p / "model.safetensors").exists():
            return _inspect(p / "model.safetensors")
        if (p / "model.gguf").exists():
            return _inspect(p / "model.gguf")
        if (p / "model.safetensors.index.json").exists():
            return _inspect(p / "model.safetensors.index.json")
        if (p / "encodings.json").exists():
            return _inspect(p / "encodings.json")
        if (p / "model.encodings").exists():  # an ONNX or AIMET export: its encodings are what it quantized
            return _inspect(p / "model.encodings")
        if (p / "model.onnx").exists():  # (an ONNX export of float grids writes no AIMET encodings)
            return _inspect(p / "model.onnx")
        raise UsageError(f"{p}: no model.safetensors, model.gguf, encodings.json, model.encodings, model.onnx or "
                         "compressed-tensors config.json here")
    if p.suffix == ".gguf":
        return _gguf_file(p)
    if p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json"):
        _refuse_a_part(p)
    if p.suffix == ".safetensors":
        header = _header(p)
        if header.get("__metadata__", {}).get("format") == "qtool.int":
            return _qtool_safetensors(p, [header])
        return _plain_safetensors([p], "safetensors", p)
    if p.name.endswith(".safetensors.index.json"):
        from .export.qtool_st import export_files

        files = export_files(p)
        headers = [_header(f) for f in files]
        if all(h.get("__metadata__", {}).get("format") == "qtool.int" for h in headers):
            _check_index(p, files, headers)  # (qtool's own exports: a float checkpoint's index is transformers' to judge)
            return _qtool_safetensors(p, headers)
        return _plain_safetensors(files, "sharded safetensors", p)
    if p.suffix == ".onnx":
        return _onnx_file(p)
    if p.suffix not in (".json", ".encodings"):
        raise UsageError(f"{p}: not a safetensors, GGUF, ONNX, encodings (.json, .encodings) file or a model "
                         "directory")
    obj = read_json_object(p, UsageError, "encodings file", strict=True)
    if not (obj.get("schema") == "qtool.encodings" or "version" in obj):
        raise UsageError(f"{p}: JSON, but neither qtool encodings nor an AIMET encodings file")
    return _encodings_listing(p, obj)
