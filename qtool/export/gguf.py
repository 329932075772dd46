"""``--format gguf``: one ``model.gguf`` that llama.cpp (and Ollama, LM Studio, llama-cpp-python) runs.

qtool's blockwise grids are GGUF's legacy block types when the block is 32 along the input dimension:

* 8-bit symmetric -> ``Q8_0``: per block an fp16 ``d`` and 32 int8 codes; value ``q * d``;
* 4-bit symmetric -> ``Q4_0``: fp16 ``d`` and 16 bytes, byte ``j`` holding element ``j`` in its low nibble and
  element ``j + 16`` in its high one; value ``(nibble - 8) * d``;
* 4-bit asymmetric -> ``Q4_1``: fp16 ``d``, fp16 ``m`` and 16 bytes of nibbles; value ``nibble * d + m``, so
  ``d`` is qtool's scale and ``m = offset * scale``;
* 5-bit -> ``Q5_0`` (symmetric, value ``(q5 - 16) * d``) and ``Q5_1`` (asymmetric, ``q5 * d + m``): the low four
  bits as Q4's nibbles, the fifth bit of element ``j`` at bit ``j`` of a little-endian uint32 ``qh`` after the
  scale(s).

The codes come from the weight source (round-to-nearest, or stored codes of a rounding algorithm). GGUF keeps
``d`` and ``m`` as float16: with ``scale_dtype: float16`` in the recipe (``configs/gguf-*.yaml``) they are float16
values already and every dequantized weight equals qtool's fake-quant weight bit for bit; otherwise they are
rounded and the summary states the largest change to a weight. Tensors the recipe leaves float are written F32
(``--gguf-float f16`` for F16; 1-D tensors stay F32, as llama.cpp needs); a quantized weight with no GGUF type is
refused, naming it, unless ``--gguf-fallback f16|f32`` writes its fake-quant values as floats instead.

Tied embeddings: llama.cpp uses ``token_embd`` as the output matrix when the file has no ``output.weight``; it is
written only when the output layer's numbers differ from the embedding table's (a recipe quantizing one but not
the other), or where the architecture's loader has no such fallback (``Family.gguf_needs_output``: olmoe,
qwen2moe, gpt-oss). Memory: one tensor at a time (two passes over the checkpoint: sizes, then data).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..config import GGUF_STACK_NOTE
from ..config.fused import expert_stacks
from ..encodings import EncodingEntry
from ..errors import EncodingsError
from ..families import Family
from ..families.base import TensorPart
from ..io.finite import check_finite, storable
from ..quant import ggml
from ..quant.spec import Granularity
from .base import Exporter, ExportRequest, match_weight_names, refuse_float_elements
from .gguf_model import EXPERT_KEY, GgufModel, permute_rows, read_gguf_model

__all__ = ["GgufExporter", "EXPORTER", "gguf_type", "pack_blocks", "GGUF_NAME"]

GGUF_NAME = "model.gguf"
BLOCK = 32
# (bitwidth, symmetric) -> GGUF block type name, for blocks of 32 along the input dimension
_FILE_TYPES = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0",
               "Q5_1": "MOSTLY_Q5_1", "Q2_K": "MOSTLY_Q2_K", "Q3_K": "MOSTLY_Q3_K_S", "Q4_K": "MOSTLY_Q4_K_S",
               "Q5_K": "MOSTLY_Q5_K_S", "Q6_K": "MOSTLY_Q6_K", "IQ4_NL": "MOSTLY_IQ4_NL", "IQ4_XS": "MOSTLY_IQ4_XS",
               "F16": "MOSTLY_F16", "F32": "ALL_F32"}
_MAPS = ("8-bit symmetric -> Q8_0, 5-bit -> Q5_0 (symmetric) / Q5_1, 4-bit -> Q4_0 (symmetric) / Q4_1, all "
         "per_block 32 with float16 scales, or a recipe's gguf_type (q4_k, q6_k, iq4_xs, ...)")


def gguf_type(e) -> Optional[str]:
    """The GGUF block type that holds weight quantizer ``e`` (an encodings entry or a plan row) exactly, or
    None."""
    return e.spec.gguf_block_type if e.tensor == "weight" else None


def _describe(e) -> str:
    spec = e.spec
    kind = "symmetric" if spec.symmetric else "asymmetric"
    gran = (f"per_block {spec.axis_and_block()[1]} along dim {spec.axis_and_block()[0]}"
            if spec.granularity is Granularity.PER_BLOCK else str(spec.granularity))
    return f"{spec.bitwidth}-bit {kind} {gran}"


def pack_blocks(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, qtype: str
                ) -> Tuple[np.ndarray, torch.Tensor]:
    """GGUF blocks of ``codes`` (``[rows, cols]`` integers on the grid) with their ``[rows, cols / 32]`` scale and
    offset: a ``uint8`` array ``[rows, cols / 32 * bytes_per_block]``, and the values llama.cpp reads back
    (float32, ``[rows, cols]``) computed as ggml dequantizes them. The block's ``d`` is the scale and a Q4_1/Q5_1
    block's ``m`` is ``offset * scale``, each rounded to float16 (``quant.ggml`` packs the bytes); raises
    ``ValueError`` where float16 cannot hold them."""
    t = ggml.GGML_TYPES[qtype]
    rows, cols = codes.shape
    step = scale.reshape(rows, cols // BLOCK).to(torch.float32)
    low = None if t.symmetric else -(offset.reshape(step.shape).to(torch.float32) * step)
    grid = ggml.snap(step, low, t)
    q = codes.to(torch.int32)
    return ggml.pack(q, grid).numpy(), ggml.dequantize(q, grid)


@dataclass
class _Item:
    """One GGUF tensor: where its numbers come from and how it is stored."""

    name: str  # GGUF tensor name
    key: str  # checkpoint tensor
    kind: str  # "Q8_0" / "Q5_0" / "Q5_1" / "Q4_0" / "Q4_1" / "F32" / "F16"
    entry: Optional[EncodingEntry] = None  # quantized (or fallen back): its encoding
    heads: Optional[int] = None  # rows permuted for llama.cpp's rotary layout
    experts: Tuple["_Item", ...] = ()  # a stacked expert tensor: one item per expert, in expert order
    part: Optional[TensorPart] = None  # made from some rows of the checkpoint tensor (DeepSeek's attn_k_b/attn_v_b)

    def shape(self, src) -> Tuple[int, ...]:
        if self.experts:
            return (len(self.experts),) + tuple(src.shape_dtype(self.experts[0].key)[0])
        if self.part is not None:
            shape = self.part.shape
            return shape[:-2] + (shape[-1], shape[-2]) if self.part.transpose else shape
        return tuple(src.shape_dtype(self.key)[0])


def _media(name: str) -> bool:
    """Whether a weight is a multimodal model's image (or audio) encoder's or projector's, which llama.cpp's
    converter writes to a separate mmproj file, not this one (a rule may still have quantized it)."""
    from ..config.resolve import MEDIA_TOWER

    return MEDIA_TOWER.search(name) is not None


class GgufExporter(Exporter):
    name = "gguf"
    gguf_types = True
    aimet_json = "never"  # GGUF holds its own quantization (block types and scales)
    lazy_encodings = True

    @dataclass
    class Options:
        gguf_float: str = "f32"  # tensors the recipe leaves float (2-D ones; 1-D stay F32)
        gguf_fallback: str = "none"  # quantized weights with no GGUF type: refuse, or write their values as f32/f16

    def check_checkpoint(self, checkpoint: Path) -> None:
        read_gguf_model(checkpoint).check_tokenizer()

    def writes_tied_apart(self, model) -> bool:
        from ..families import family_of_model

        family = family_of_model(model)
        return family is not None and family.gguf_needs_output

    def check_quantizers(self, quantizers, options: "GgufExporter.Options") -> None:
        quantizers = list(quantizers)
        refuse_float_elements(quantizers, "GGUF", "qtool writes llama.cpp's integer block types")
        acts = [e.name for e in quantizers if e.tensor != "weight"]
        if acts:
            raise EncodingsError(f"GGUF holds weights only (llama.cpp quantizes activations itself): "
                                 f"{len(acts)} activation quantizer(s) such as {acts[0]!r}; calibrate with a "
                                 f"weight-only recipe (e.g. the shipped gguf-q4_0)")
        if options.gguf_fallback == "none":
            for e in quantizers:
                if gguf_type(e) is None and not _media(e.name):  # (not in this file: no type needed)
                    raise EncodingsError(f"{e.name}: {_describe(e)} has no GGUF type ({_MAPS}); use a recipe such "
                                         f"as the shipped gguf-q4_0, or --gguf-fallback f16 to write it as floats")
        _check_expert_types(quantizers, options)

    left_float_words = "stored as floats"

    def check_expert_counts(self, quantizers, options: "GgufExporter.Options", counts: Dict[str, int]) -> None:
        _check_expert_types(quantizers, options, counts)

    def left_float(self, quantizers, options: "GgufExporter.Options", tied=()) -> List[str]:
        """With ``--gguf-fallback``: the weights no GGUF type holds, whose fake-quant values the file stores as
        F16/F32 (the file holds them unquantized; the plan's coverage counts them so)."""
        if options.gguf_fallback == "none":
            return []
        return [q.name for q in quantizers if q.tensor == "weight" and gguf_type(q) is None and not _media(q.name)]

    def not_written(self, entries, options: "GgufExporter.Options", tied=()) -> List[str]:
        """None: a fallback weight's floats are its fake-quant values, so the file computes what qtool's model
        does."""
        return []

    def tensor_bytes(self, quantizer, shape, dtype, options: "GgufExporter.Options") -> int:
        """The tensor's data in the file (each tensor's start is aligned to 32 bytes in the file; the padding is
        not counted)."""
        shape = tuple(int(d) for d in shape)
        return _info(_kind(quantizer, shape, options), shape)[2]

    def write(self, request: ExportRequest, options: "GgufExporter.Options") -> Dict[str, Any]:
        import gguf

        model = read_gguf_model(request.checkpoint)
        src = request.weights
        items, names = _plan(model, src, request.encodings.entries, options)
        embed_rows = next((src.shape_dtype(i.key)[0][0] for i in items if i.name == "token_embd.weight"), None)
        if embed_rows is None:
            raise EncodingsError(f"{request.checkpoint}: no embedding table (model.embed_tokens.weight)")

        main, file_type = _file_type(items, request.encodings.meta.get("gguf_mix"), options)
        path = Path(request.out_dir) / GGUF_NAME
        writer = gguf.GGUFWriter(path, model.arch)
        warnings = model.add_metadata(writer, file_type, int(embed_rows))
        for item in items:
            writer.add_tensor_info(item.name, *_info(item.kind, item.shape(src)))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()

        deviation, rounded, fallen, total = 0.0, 0.0, [], len(items)
        for n, item in enumerate(items):
            data, dev = _tensor_data(item, src, model.family)
            if item.kind in ("F32", "F16"):  # (a quantized weight written as floats: --gguf-fallback f16's rounding)
                rounded = max(rounded, dev)
            else:  # (float16 scales)
                deviation = max(deviation, dev)
            # (a transposed part, DeepSeek's attn_k_b, is F32 by design: no blocks left along its rows)
            fallen += [i.entry.name for i in item.experts or (item,) if i.entry is not None
                       and i.kind in ("F32", "F16") and not (i.part is not None and i.part.transpose)]
            writer.write_tensor_data(data)
            if request.progress:
                request.progress(n + 1, total, item.name)
        writer.close()
        if deviation > 0:
            warnings.append(f"scales rounded to float16 (GGUF stores them so) moved quantized weights by up to "
                            f"{deviation:.3g}; calibrate with scale_dtype: float16 (as the shipped gguf-* recipes do) for "
                            "a file that equals qtool's model exactly")
        if fallen:
            values = (f"their fake-quant values rounded to f16, moved by up to {rounded:.3g}" if rounded > 0
                      else "their fake-quant values")
            warnings.append(f"{len(fallen)} weight(s) with no GGUF type written as {options.gguf_fallback} floats "
                            f"({values}): {', '.join(fallen[:5])}" + (" ..." if len(fallen) > 5 else ""))
        left = [e.name for e in request.encodings.entries if e.tensor == "weight" and e.name not in names]
        if left:  # (a recipe's rule that opted an image encoder in: calibrated, and not in this file)
            warnings.append(f"{len(left)} quantized weight(s) are not in the GGUF file, which llama.cpp's converter "
                            f"writes without them (a multimodal model's image encoder goes to a separate mmproj file, "
                            f"which qtool does not write): {', '.join(left[:3])}" + (" ..." if len(left) > 3 else ""))
        return {
            "gguf": {"file": GGUF_NAME, "architecture": model.arch, "file_type": main,
                     "tensor_types": dict(sorted(Counter(i.kind for i in items).items())),
                     "bytes": path.stat().st_size, "max_weight_deviation": max(deviation, rounded),
                     "fallback": fallen},
            "names": names,
            "warnings": warnings,
        }


def _file_type(items: List[_Item], mix: Any, options) -> Tuple[str, int]:
    """The file's type, as its name and ``general.file_type``: a llama-quantize mix's own (Q4_K_M: 15, whatever
    types its fallbacks hold), else the type most weights have."""
    import gguf

    if isinstance(mix, str) and hasattr(gguf.LlamaFileType, f"MOSTLY_{mix.upper()}"):
        return mix.upper(), int(getattr(gguf.LlamaFileType, f"MOSTLY_{mix.upper()}"))
    counts = Counter(i.kind for i in items if i.entry is not None and gguf_type(i.entry) == i.kind)
    main = counts.most_common(1)[0][0] if counts else ("F16" if options.gguf_float == "f16" else "F32")
    return main, int(getattr(gguf.LlamaFileType, _FILE_TYPES[main]))


def _plan(model: GgufModel, src, entries: List[EncodingEntry], options) -> Tuple[List[_Item], Dict[str, str]]:
    """One item per GGUF tensor, in checkpoint order; quantizer name -> GGUF tensor name."""
    keys = src.keys()
    keyset = set(keys)
    # a tied output layer is not stored in the checkpoint: it is the embedding table
    tied_head = {e.name for e in entries if model.tied and e.name.endswith("lm_head.weight")
                 and "lm_head.weight" not in keyset}
    matched = match_weight_names([e for e in entries if e.name not in tied_head], keys, str(src.checkpoint))
    by_key: Dict[str, EncodingEntry] = {matched.get(e.name, "lm_head.weight"): e for e in entries}
    def item(name: str, key: str, source_key: str) -> _Item:
        e = by_key.get(key)
        shape, _ = src.shape_dtype(source_key)
        if e is not None:
            e.check_fits(source_key, shape)
        return _Item(name, source_key, _kind(e, shape, options), e, model.permutation(key))

    items: List[_Item] = []
    names: Dict[str, str] = {}
    embed = None
    stacked: Dict[str, List[Tuple[int, _Item]]] = {}  # GGUF name -> (expert, its item), in checkpoint order
    for key in keys:
        parts = model.parts(key)
        if parts:
            for part in parts:
                it = item(model.tensor_name(part.key), key, key)
                # transposed rows have no quantization blocks left: the fake-quant values, as F32
                kind = "F32" if part.transpose else _kind(it.entry, part.shape, options)
                items.append(_Item(it.name, key, kind, it.entry, None, part=part))
                if it.entry is not None and not part.transpose:
                    names[it.entry.name] = it.name
            continue
        name = model.tensor_name(key)
        if name is None:
            continue
        it = item(name, key, key)
        expert = EXPERT_KEY.match(key)
        if expert is not None:
            if name not in stacked:
                stacked[name] = []
                items.append(_Item(name, key, it.kind))
            stacked[name].append((int(expert["expert"]), it))
        else:
            items.append(it)
        if name == "token_embd.weight":
            embed = it
        if it.entry is not None:
            names[it.entry.name] = name
    items = [_stack(i, stacked[i.name]) if i.name in stacked else i for i in items]
    if model.tied and "lm_head.weight" not in keyset and embed is not None:
        head = item("output.weight", "lm_head.weight", embed.key)
        if model.family.gguf_needs_output or not _same_numbers(head.entry, embed.entry, src):
            items.append(head)
        if head.entry is not None:
            names[head.entry.name] = "output.weight" if head in items else "token_embd.weight"
    return items, names


def _check_expert_types(quantizers, options: "GgufExporter.Options", counts: Optional[Dict[str, int]] = None) -> None:
    """Refuse, before calibration, what :func:`_stack` refuses after it: one projection's experts under more than
    one type, or some of them quantized and others left float (llama.cpp stacks them into one tensor of one type).
    ``counts``: each layer's number of experts, where known (the last experts, ignored, have no row to count)."""
    float_kind = _kind(None, (2, 2), options)  # (a 2-D weight left float: --gguf-float's type)
    for where, members, left in expert_stacks((q for q in quantizers if not _media(q.name)), counts):
        kinds = sorted({_kind(q, (2, 2), options) for q in members.values()})
        if len(kinds) > 1:
            raise EncodingsError(f"{where}: {GGUF_STACK_NOTE}, and the recipe gives them {' and '.join(kinds)} (one "
                                 "rule for every expert of a projection)")
        if left and kinds != [float_kind]:  # (float beside fallback floats of that type: one stack)
            named = ", ".join(map(str, left[:3])) + (" ..." if len(left) > 3 else "")
            same = f", or --gguf-float {kinds[0].lower()} to store the float ones as the others' fallback stores " \
                "them" if kinds in (["F16"], ["F32"]) else ""  # (then one stack of one float type)
            raise EncodingsError(f"{where}: {GGUF_STACK_NOTE}, and the recipe quantizes some and leaves expert(s) "
                                 f"{named} float (ignored, or a rule without weights): one rule for every expert of "
                                 f"a projection{same}")


def _stack(first: _Item, experts: List[Tuple[int, _Item]]) -> _Item:
    """llama.cpp's 3-D expert tensor from its experts' ``(index, item)``: every expert present once, all of one
    type (and, as the checkpoint's config says, one shape)."""
    if sorted(e for e, _ in experts) != list(range(len(experts))):
        raise EncodingsError(f"{first.key}: the checkpoint's experts for {first.name} are not 0..{len(experts) - 1}")
    order = [i for _, i in sorted(experts, key=lambda pair: pair[0])]
    kinds = {i.kind for i in order}
    if len(kinds) > 1:
        raise EncodingsError(f"{first.name}: GGUF stores its {len(order)} experts as one tensor of one type, and the "
                             f"encodings give them {' and '.join(sorted(kinds))} (one rule for every expert of a "
                             "projection)")
    return _Item(first.name, order[0].key, order[0].kind, experts=tuple(order))


def _kind(e, shape, options) -> str:
    """How a tensor is stored: its weight's GGUF type, else the fallback float type for a quantized weight with
    none, else F32/F16 for a float 2-D tensor (``--gguf-float``) and F32 for a 1-D one."""
    if e is not None:
        return gguf_type(e) or ("F16" if options.gguf_fallback == "f16" else "F32")
    return ("F16" if options.gguf_float == "f16" else "F32") if len(shape) >= 2 else "F32"


def _same_numbers(a: Optional[EncodingEntry], b: Optional[EncodingEntry], src) -> bool:
    """Whether two encodings of one tied tensor give it the same values (so one GGUF tensor serves both)."""
    if a is None or b is None:
        return a is None and b is None
    if a.spec != b.spec or src.has_stored_codes(a) or src.has_stored_codes(b):
        return False
    (amin, amax), (bmin, bmax) = a.range(), b.range()
    return bool(torch.equal(amin, bmin) and torch.equal(amax, bmax))


def _info(kind: str, shape: Tuple[int, ...]):
    """``add_tensor_info`` arguments (shape, numpy dtype, bytes, raw type) of a tensor stored as ``kind``."""
    import gguf

    if kind in ("F32", "F16"):
        dt = np.float32 if kind == "F32" else np.float16
        return shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize, None
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    byte_shape = tuple(shape[:-1]) + (shape[-1] // block * size,)
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype


_CHUNK = 1 << 24  # elements per row chunk of a large tensor (64 MB of float32 temporaries)


def _tensor_data(item: _Item, src, family: Family) -> Tuple[np.ndarray, float]:
    """The bytes of one GGUF tensor, and how far its values are from qtool's fake-quant weights (a float tensor
    as ``family``'s converter writes it: Gemma's norms shifted by one)."""
    from ..quant.affine import dequantize

    if item.experts:  # each expert's slice as its own tensor, stacked
        parts = [_tensor_data(i, src, family) for i in item.experts]
        return np.stack([p[0] for p in parts]), max(p[1] for p in parts)

    w = src.get(item.key)
    e = item.entry
    if item.part is not None:
        return _part_data(item, w, src, family)
    if e is None:
        w = family.gguf_tensor(item.key, w)
        if item.heads:
            w = permute_rows(w, item.heads)
        dtype = torch.float16 if item.kind == "F16" else torch.float32
        hint = "write float tensors as F32 (--gguf-float f32)" if item.kind == "F16" else ""
        if w.dtype == dtype:
            check_finite(item.key, w, hint)
            return w.contiguous().numpy(), 0.0
        out = torch.empty(w.shape, dtype=dtype)
        for rows, chunk in _row_chunks(w):  # float32 temporaries of one chunk, not of the whole table
            out[rows] = storable(item.key, chunk.to(torch.float32), dtype, hint)
        return out.numpy(), 0.0
    if (e.spec.ggml is None and item.kind not in ("F32", "F16") and not item.heads and w.dim() == 2
            and e.granularity == Granularity.PER_BLOCK and w.numel() > _CHUNK):
        return _chunked_blocks(item, w, src)
    if e.spec.ggml is not None:  # a K-quant / IQ4 type: the grid comes from the sub-block ranges
        lo, hi = e.range()
        grid = ggml.grid_from_range(lo, hi, e.spec.ggml)
        stored = src.stored_codes(e, tuple(w.shape))  # else round to nearest (int32 throughout)
        codes = ggml.quantize_codes(w, grid) if stored is None else stored.to(torch.int32)
        if item.heads:
            codes, lo, hi = (permute_rows(t, item.heads) for t in (codes, lo, hi))
            grid = ggml.grid_from_range(lo, hi, e.spec.ggml)
        return ggml.pack(codes, grid).numpy(), 0.0
    codes = src.codes(e, w)
    scale, offset = e.scale_offset()
    if item.kind in ("F32", "F16"):  # a fallback: the fake-quant values, as floats
        values = dequantize(codes, scale, offset, block_size=e.block_size)
        if item.heads:
            values = permute_rows(values, item.heads)
        return _as_floats(e.name, values, item.kind, "write them as F32 (--gguf-fallback f32)")
    fake = dequantize(codes, scale, offset, block_size=e.block_size)
    if item.heads:
        codes, scale, offset, fake = (permute_rows(t, item.heads) for t in (codes, scale, offset, fake))
    blocks, values = _pack(e, codes, scale, offset, item.kind)
    return blocks, float((values - fake).abs().max()) if values.numel() else 0.0


def _as_floats(name: str, values: torch.Tensor, kind: str, f16_hint: str = "") -> Tuple[np.ndarray, float]:
    """``values`` as a quantized weight's F16 or F32 tensor (``kind``), and how far that moved them: F16 rounds
    (--gguf-fallback f16), F32 holds them. ``f16_hint``: what the error line of a value F16 cannot hold says."""
    stored = storable(name, values, torch.float16 if kind == "F16" else torch.float32,
                      f16_hint if kind == "F16" else "").contiguous()
    return stored.numpy(), float((stored.to(torch.float32) - values).abs().max()) if values.numel() else 0.0


def _part_data(item: _Item, w: torch.Tensor, src, family: Family) -> Tuple[np.ndarray, float]:
    """:func:`_tensor_data` of a tensor made from some rows of a checkpoint weight: rows of a quantized weight keep
    their blocks and are packed as the weight would be; transposed ones are the fake-quant values as F32."""
    from ..quant.affine import dequantize

    part, e = item.part, item.entry
    rows = torch.tensor(part.rows, dtype=torch.long)
    if part.transpose or e is None or item.kind in ("F32", "F16"):
        if e is None:
            values = family.gguf_tensor(item.key, w).to(torch.float32)
        else:
            values = src.dequantize_codes(e, src.codes(e, w))
        values = values[rows].reshape(part.shape)
        if part.transpose:
            values = values.transpose(-1, -2)
        data, moved = _as_floats(item.key, values, item.kind)
        return data, moved if e is not None else 0.0  # (a float weight's part: no quantized weight moved)
    codes = src.codes(e, w)
    if e.spec.ggml is not None:
        lo, hi = e.range()
        blocks = ggml.pack(codes[rows].to(torch.int32), ggml.grid_from_range(lo[rows], hi[rows], e.spec.ggml))
        return blocks.numpy().reshape(part.shape[:-1] + (-1,)), 0.0
    codes, scale, offset = (t[rows] for t in (codes,) + e.scale_offset())
    fake = dequantize(codes, scale, offset, block_size=e.block_size)
    blocks, values = _pack(e, codes, scale, offset, item.kind)
    deviation = float((values - fake).abs().max()) if values.numel() else 0.0
    return blocks.reshape(part.shape[:-1] + (-1,)), deviation


def _pack(e, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, kind: str):
    """:func:`pack_blocks`, with a scale float16 cannot hold as one error line naming the weight."""
    try:
        return pack_blocks(codes, scale, offset, kind)
    except ValueError:
        raise EncodingsError(f"{e.name}: a scale beyond float16's range (65504) cannot be stored in GGUF") from None


def _row_chunks(t: torch.Tensor):
    """``(rows, t[rows])`` for consecutive slices of ``t``'s first dimension of about ``_CHUNK`` elements each."""
    step = max(1, _CHUNK // max(1, t[0].numel())) if t.dim() > 1 else max(1, t.shape[0])
    for a in range(0, t.shape[0], step):
        rows = slice(a, a + step)
        yield rows, t[rows]


def _chunked_blocks(item: _Item, w: torch.Tensor, src) -> Tuple[np.ndarray, float]:
    """:func:`_tensor_data` of a large integer-grid weight (a vocabulary-sized embedding table) a chunk of rows
    at a time: every step is row by row, so the bytes are the whole tensor's, with temporaries of one chunk
    (an 8B model's 128256 x 4096 table would otherwise need about 10 GB of them)."""
    from ..quant.affine import dequantize

    e = item.entry
    scale, offset = e.scale_offset()
    stored = src.stored_codes(e, tuple(w.shape))  # read once, not per chunk
    out, deviation = None, 0.0
    for rows, chunk in _row_chunks(w):
        s, o = scale[rows], offset[rows]
        # what WeightSource.codes gives the whole tensor, a chunk of rows at a time
        codes = stored[rows].to(torch.float32) if stored is not None else src.nearest_codes(e, chunk, s, o)
        fake = dequantize(codes, s, o, block_size=e.block_size)
        blocks, values = _pack(e, codes, s, o, item.kind)
        if out is None:
            out = np.empty((w.shape[0], blocks.shape[1]), dtype=blocks.dtype)
        out[rows] = blocks
        deviation = max(deviation, float((values - fake).abs().max()))
    return out, deviation


EXPORTER = GgufExporter()
