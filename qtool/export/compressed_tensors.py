"""Export to a Hugging Face model directory in the compressed-tensors layout (what transformers and vLLM load).

``export_compressed_tensors(checkpoint, encodings, out_dir)`` writes

* ``config.json``: the checkpoint's own, plus ``quantization_config`` shaped like llm-compressor 0.14's output
  (``quant_method: compressed-tensors``, ``quantization_status: compressed``, one config group per distinct
  weight setting, per-group ``format``, ``ignore`` = the ``Linear`` modules left in float, e.g. ``lm_head``);
* ``model.safetensors``, streamed one tensor at a time. For each quantized ``Linear`` ``<layer>``:

  - ``int-quantized`` (8 bits, by default): ``<layer>.weight`` int8 and ``<layer>.weight_scale``;
  - ``pack-quantized`` (1..7 bits, and 8 on request): ``<layer>.weight_packed`` int32 ``(out, ceil(in*b/32))``,
    ``<layer>.weight_shape`` int64 ``[out, in]`` and ``<layer>.weight_scale``;
  - asymmetric grids also ``<layer>.weight_zero_point`` (int8 in the scale's shape; for ``pack-quantized``
    channel/group scales it is packed along dim 0 into int32, as compressed-tensors does);

  every other tensor is copied unchanged;
* the checkpoint directory's other files (tokenizer, generation config, vocab, ...) copied as they are.

Numerics
--------
compressed-tensors dequantizes ``(q - zero_point) * scale`` on the signed grid ``-2**(b-1) .. 2**(b-1)-1``
(whatever ``symmetric`` says); qtool/AIMET use ``(q + offset) * scale`` on ``grid(b, signed=symmetric)``. The
export converts exactly, in integers: with ``shift = qmin + 2**(b-1)`` (0 for qtool's symmetric grids,
``2**(b-1)`` for its unsigned asymmetric ones), ``q_ct = q - shift`` and ``zero_point = -offset - shift``, so
``q_ct - zero_point == q + offset``. The scale is qtool's calibrated scale (not compressed-tensors' absmax/7.5);
the file carries it. Codes come from ``qtool.quant.quantize`` exactly as the fake-quant model computes them, so
for a float32 checkpoint the weights compressed-tensors dequantizes equal qtool's fake-quant weights bit for bit.

The scale is stored in the checkpoint weight's dtype, as llm-compressor writes it (float32 for a float32 model,
as in ``shared/data/compressed-tensors``); compressed-tensors also creates the ``weight_scale`` parameter in the
model dtype on load, so a bfloat16/float16 model rounds the scale there anyway. For such checkpoints the summary
warns that dequantized weights can differ from qtool's (float32-scale) fake-quant weights by that rounding.

8-bit format
------------
8-bit weights are written ``int-quantized`` by default (one int8 per weight, like ``w8a16_ch_int``);
``eight_bit_format="pack-quantized"`` packs four codes per int32 instead (like ``w8a16_ch``, llm-compressor's own
default for W8A16). vLLM runs weight-only int layers only from ``pack-quantized`` (its ``CompressedTensorsWNA16``
scheme: 4 or 8 bits, channel or group strategy), so use ``pack-quantized`` for vLLM; the summary's ``warnings``
list every setting vLLM's weight-only path would refuse (int-quantized weight-only, tensor strategy, bit widths
other than 4 and 8). transformers loads both.

Scope
-----
Weight quantization of ``torch.nn.Linear`` modules only (weight-only W8A16 / W4A16 formats): per_channel ->
strategy ``channel``, per_block along the input dim -> ``group`` (``group_size`` = the block), per_tensor ->
``tensor``. Activation quantizers are not exported (the summary's ``warnings`` says so); embedding (and any
other non-Linear) weights stay in float and are listed in the summary, as does a Linear whose weight is shared
with another module (a tied ``lm_head``). A group size that does not divide a layer's input size raises
``EncodingsError`` (llm-compressor refuses such layers too). Sharded checkpoints are read shard by shard and
written as one ``model.safetensors``. Module types come from the checkpoint's model class built on the meta
device (no weights are read for that).

Loading
-------
``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads the directory with nothing extra but the
``compressed-tensors`` package installed. By default (transformers 5.x, ``CompressedTensorsConfig(dequantize=
False)``) the modules keep ``weight_packed``/``weight_scale`` after loading and compressed-tensors decompresses
every module on the first forward pass (a forward pre-hook), after which ``module.weight`` holds the dequantized
float weight. ``from_pretrained(out_dir, quantization_config=CompressedTensorsConfig(dequantize=True))`` (the
former ``run_compressed=False``) dequantizes while loading instead, but transformers 5.23 decompresses every
dense module there with the *first* config group's scheme, so use it only for exports with one config group
(one weight setting for all quantized layers); the default route handles any number of groups.

Asymmetric ``pack-quantized`` channel/group weights (any bit width) are the exception: compressed-tensors stores their
zero points packed into int32 along dim 0 (what vLLM and compressed-tensors' decompressor read), but transformers
5.23 builds the empty model's ``weight_zero_point`` unpacked (compressed-tensors' ``compress`` skips packing on the
meta device), so the default route fails with a size mismatch; ``CompressedTensorsConfig(dequantize=True)`` loads
them exactly (single config group only, see above). Asymmetric int-quantized (8-bit) and per-tensor weights load
on both routes. The summary warns about these cases.

With one weight setting the config targets ``"Linear"`` and ignores the float Linear modules, exactly like
llm-compressor; with several, each group targets its modules by name (``re:^<name>$``).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import __version__
from ..encodings import EncodingEntry, EncodingsFile
from ..errors import CheckpointError, EncodingsError, UsageError
from ..io.checkpoint import detect_kind
from ..io.finite import storable
from ..io.jsonfile import read_json_object
from ..io.st_writer import StreamingSafetensorsWriter
from ..model.hf import meta_skeleton
from ..model.online import rotated_width
from ..quant.floatgrid import element_of, global_scale
from ..quant.packing import pack_bytes, pack_int32
from ..weights import WeightSource
from .base import Exporter, ExportRequest, layout_bytes
from .qtool_st import match_weight_names

__all__ = ["export_compressed_tensors", "CT_VERSION_FALLBACK"]

Progress = Optional[Callable[[int, int, str], None]]

# the compressed-tensors version that wrote the reference files in shared/data/compressed-tensors
CT_VERSION_FALLBACK = "0.19.0"

# files of a checkpoint directory that are weights (replaced by model.safetensors) or rewritten (config.json)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pt2", ".ckpt", ".h5", ".msgpack", ".gguf")
_SKIP_NAMES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def _ct_version() -> str:
    try:
        from importlib.metadata import version

        return version("compressed-tensors")
    except Exception:  # not installed: write the version of the reference output
        return CT_VERSION_FALLBACK


def _routers(model: nn.Module, modules: Dict[str, nn.Module], keys: List[str]) -> List[str]:
    """Mixture-of-experts routers (transformers' ``*Router`` modules: a float 2-D weight, not an ``nn.Linear``) by
    the checkpoint's module names (Mixtral's ``block_sparse_moe.gate``): runtimes build them as Linear layers, so
    ``ignore`` lists them as llm-compressor does."""
    from ..model.checkpoint_map import CheckpointMap

    routers = [n for n, m in modules.items() if type(m).__name__.endswith("Router")
               and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2]
    if not routers:
        return []
    stored = {name: key for key, name in CheckpointMap(model, keys).renamed().items()}
    return [stored.get(f"{name}.weight", f"{name}.weight")[: -len(".weight")] for name in routers]


def _tied_params(model: nn.Module) -> Dict[str, set]:
    """For every parameter shared between modules: its name -> all names of that tensor."""
    groups: Dict[int, set] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), set()).add(name)
    return {n: g for g in groups.values() if len(g) > 1 for n in g}


def _weight_args(e: EncodingEntry, shape: Tuple[int, ...], key: str) -> Dict[str, Any]:
    """compressed-tensors weight ``QuantizationArgs`` for one encoding, checking the layout fits a Linear."""
    out_f, in_f = shape
    if e.granularity == "per_tensor":
        strategy, group_size = "tensor", None
    elif e.granularity == "per_channel":
        if tuple(e.shape) != (out_f, 1):
            raise EncodingsError(
                f"{e.name}: per_channel encodings of shape {list(e.shape)} on {key} {list(shape)}; compressed-tensors "
                f"channel quantization needs one scale per output row, shape [{out_f}, 1]"
            )
        strategy, group_size = "channel", None
    elif e.granularity == "per_block":
        bs = tuple(e.block_size) if e.block_size is not None else None
        if bs is None or len(bs) != 2 or bs[0] not in (1, -1) or (bs[0] == -1 and e.shape[0] != out_f):
            raise EncodingsError(
                f"{e.name}: block_size {None if bs is None else list(bs)} is not supported by the compressed-tensors "
                "export; it writes groups along the input dimension only (block_size [1, G])"
            )
        g = bs[1] if bs[1] != -1 else (in_f // e.shape[1] if e.shape[1] else 0)
        if g <= 0 or in_f % g:
            raise EncodingsError(
                f"{e.name}: group size {g} does not divide the input size {in_f} of {key} (shape {list(shape)}); "
                "compressed-tensors group quantization (and llm-compressor) needs a group size that divides every "
                "quantized layer's input size"
            )
        strategy, group_size = "group", int(g)
    else:  # pragma: no cover - EncodingsFile validates granularity by construction
        raise EncodingsError(f"{e.name}: unknown granularity {e.granularity!r}")
    e.check_fits(key, shape)
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": group_size,
        "num_bits": int(e.bitwidth),
        "observer": "memoryless_minmax",  # qtool's minmax over the whole weight is this (static weights)
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": strategy,
        "symmetric": bool(e.symmetric),
        "type": "int",
        "zp_dtype": None,
    }


def _input_args(e: EncodingEntry) -> Dict[str, Any]:
    """compressed-tensors ``input_activations`` for an input quantizer: dynamic (no scale stored: the runtime
    computes one per token, per call or per block), a static FP8 one (its ``input_scale`` is stored), or NVFP4's
    block scales computed per call under a stored global scale (``dynamic: local``, ``input_global_scale``)."""
    if e.is_float and e.granularity == "per_block":
        nvfp4 = e.scale_dtype == "fp8_e4m3"
        return {
            "actorder": None,
            "block_structure": None,
            "dynamic": "local" if nvfp4 else True,
            "group_size": int(e.block_size[0]),
            "num_bits": int(e.bitwidth),
            "observer": "static_minmax" if nvfp4 else None,
            "observer_kwargs": {},
            "scale_dtype": "torch.float8_e4m3fn" if nvfp4 else "torch.uint8" if e.scale_dtype == "e8m0" else None,
            "strategy": "tensor_group" if nvfp4 else "group",
            "symmetric": True,
            "type": "float",
            "zp_dtype": None,
        }
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": bool(e.dynamic),
        "group_size": None,
        "num_bits": int(e.bitwidth),
        "observer": None if e.dynamic else "static_minmax",
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": "token" if e.granularity == "per_token" else "tensor",
        "symmetric": bool(e.symmetric),
        "type": "float" if e.is_float else "int",
        "zp_dtype": None,
    }


# (element, scale_dtype) -> (compressed-tensors format, strategy, scale dtype in the file); the FP8 row's format
# becomes float-quantized when the layer's inputs are quantized too (llm-compressor's choice)
_FLOAT_LAYOUTS = {
    ("fp8_e4m3", "float32"): ("naive-quantized", None, torch.float32),
    ("fp8_e4m3", "e8m0"): ("mxfp8-quantized", "group", torch.uint8),
    ("fp4_e2m1", "e8m0"): ("mxfp4-pack-quantized", "group", torch.uint8),
    ("fp4_e2m1", "fp8_e4m3"): ("nvfp4-pack-quantized", "tensor_group", torch.float8_e4m3fn),
}
_SCALE_DTYPE_NAMES = {torch.uint8: "torch.uint8", torch.float8_e4m3fn: "torch.float8_e4m3fn"}


def _kv_cache_scheme(kv: List[EncodingEntry]) -> Optional[Dict[str, Any]]:
    """``kv_cache_scheme`` for static FP8 key/value scales (None without any); one strategy for the model."""
    if not kv:
        return None
    grans = {e.granularity for e in kv}
    if len(grans) > 1:
        raise EncodingsError("compressed-tensors has one kv_cache_scheme per model: the k_cache/v_cache quantizers "
                             "must all be per tensor or all per head")
    return {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
            "observer": "minmax", "observer_kwargs": {}, "scale_dtype": None,
            "strategy": "tensor" if grans == {"per_tensor"} else "attn_head", "symmetric": True, "type": "float",
            "zp_dtype": None}


def _float_weight_args(e: EncodingEntry, shape: Tuple[int, ...], key: str) -> Tuple[Dict[str, Any], str]:
    """compressed-tensors weight ``QuantizationArgs`` and format for a float element encoding."""
    layout = _FLOAT_LAYOUTS.get((e.element, e.scale_dtype))
    if layout is None:
        raise EncodingsError(f"{e.name}: {e.element} elements with {e.scale_dtype} scales have no compressed-tensors "
                             "format (FP8 with float32 or e8m0 scales, FP4 with e8m0 (MXFP4) or fp8_e4m3 (NVFP4))")
    fmt, strategy, sdtype = layout
    bs = tuple(e.block_size or ())
    if strategy is None and len(bs) == 2 and bs[0] not in (1, -1):  # 2-D tiles: FP8_BLOCK's 128x128
        e.check_fits(key, shape)
        args = {"actorder": None, "block_structure": [int(bs[0]), int(bs[1])], "dynamic": False, "group_size": None,
                "num_bits": 8, "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": None,
                "strategy": "block", "symmetric": True, "type": "float", "zp_dtype": None}
        return args, fmt
    args = _weight_args(e, shape, key)
    if strategy is not None:
        if args["strategy"] != "group":
            raise EncodingsError(f"{e.name}: {fmt} needs blocks along the input dimension (got {args['strategy']})")
        args["strategy"] = strategy
    want = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32, "mxfp8-quantized": 32}.get(fmt)
    if want is not None and args["group_size"] != want:
        raise EncodingsError(f"{e.name}: {fmt} stores blocks of {want} (got {args['group_size']}); vLLM and "
                             "compressed-tensors read no other size")
    args.update(type="float", scale_dtype=_SCALE_DTYPE_NAMES.get(sdtype), observer="memoryless_minmax")
    return args, fmt


def _compat_notes(settings) -> List[str]:
    """Loader limits worth a warning (read from transformers 5.23 / compressed-tensors 0.20 / vLLM sources)."""
    notes = []
    for s in settings:
        a, fmt, inputs = s["args"], s["format"], s.get("inputs")
        what = f"{a['num_bits']}-bit {a['strategy']} ({fmt})"
        if a["type"] == "float":
            if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
                notes.append(f"transformers: {what}: compressed-tensors decompresses FP4 weights in bfloat16; load "
                             "with from_pretrained(..., dtype=torch.bfloat16)")
            continue
        if inputs is not None:  # W8A8 int: vLLM's CompressedTensorsW8A8Int8 scheme
            if not (a["num_bits"] == 8 and inputs["num_bits"] == 8 and a["symmetric"]
                    and a["strategy"] in ("channel", "tensor") and fmt == "int-quantized"):
                notes.append(f"vLLM: {what} weights with {inputs['num_bits']}-bit dynamic activations: vLLM's W8A8 "
                             "int scheme takes symmetric 8-bit channel/tensor int-quantized weights with 8-bit "
                             "activations")
            continue
        if fmt == "int-quantized":
            notes.append(f"vLLM: {what}: vLLM runs weight-only int layers only from pack-quantized (its WNA16 "
                         "scheme); export with eight_bit_format='pack-quantized' for vLLM")
        if a["strategy"] == "tensor":
            notes.append(f"vLLM: {what}: vLLM's weight-only int scheme takes channel or group strategies, not tensor")
        if a["num_bits"] not in (4, 8):
            notes.append(f"vLLM: {what}: vLLM's weight-only int kernels take 4 or 8 bits")
        if fmt == "pack-quantized" and not a["symmetric"] and a["strategy"] in ("channel", "group"):
            notes.append(f"transformers: {what} asymmetric: the packed weight_zero_point loads only with "
                         "from_pretrained(..., quantization_config=CompressedTensorsConfig(dequantize=True)) "
                         "(transformers 5.23 / compressed-tensors 0.20)"
                         + ("" if len(settings) == 1 else ", which handles a single config group only"))
    return notes


_SCALE_HINT = "compressed-tensors stores scales in the checkpoint's own dtype; convert the checkpoint to float32"


def _scale_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """Scales are stored in the checkpoint weight's float dtype, as llm-compressor writes them (float32 otherwise)."""
    return weight_dtype if weight_dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16) \
        else torch.float32


def _int_format(bitwidth: int, eight_bit_format: str) -> str:
    """The compressed-tensors format of an integer weight: 8-bit ones as asked, narrower ones always packed."""
    return eight_bit_format if bitwidth == 8 else "pack-quantized"


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


def _written_input(e) -> bool:
    """A dynamic or FP8 input quantizer: the config group's ``input_activations`` hold it."""
    return e.tensor == "input" and (e.dynamic or e.is_float)


def _unwritten_activations(entries) -> list:
    """Static integer input and every output quantizer: the layout has no place for them (they run in float)."""
    written = {e.module for e in entries if _written_input(e)}
    return [e for e in entries if e.tensor in ("input", "output") and e.module not in written]


def export_compressed_tensors(
    checkpoint: Path,
    encodings: EncodingsFile,
    out_dir: Path,
    trust_pickle: bool = False,
    progress: Progress = None,
    *,
    eight_bit_format: str = "int-quantized",
    trust_remote_code: bool = False,
    weights: Optional[WeightSource] = None,
) -> Dict[str, object]:
    """Write a compressed-tensors model directory into ``out_dir``; returns a summary (see module docs).

    ``eight_bit_format``: ``"int-quantized"`` (one int8 per weight) or ``"pack-quantized"`` (four codes per int32,
    llm-compressor's default for W8A16 and the only weight-only format vLLM loads). Sub-8-bit weights are always
    ``pack-quantized``. ``trust_pickle`` is accepted for symmetry with ``export_integer``; the checkpoint must be
    a Hugging Face directory (``config.json`` + safetensors), which never needs it.
    """
    if eight_bit_format not in ("int-quantized", "pack-quantized"):
        raise UsageError(f"eight_bit_format must be int-quantized or pack-quantized, got {eight_bit_format!r}")
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not checkpoint.exists():
        raise CheckpointError(f"{checkpoint}: checkpoint not found")
    if out_dir.exists() and checkpoint.is_dir() and out_dir.resolve() == checkpoint.resolve():
        raise UsageError(f"{out_dir}: the output directory must not be the checkpoint directory")
    if detect_kind(checkpoint) != "hf":
        raise UsageError(
            f"{checkpoint}: the compressed-tensors export needs a Hugging Face model directory (config.json + "
            "safetensors weights)"
        )
    config = read_json_object(checkpoint / "config.json", CheckpointError, "Hugging Face config")
    if "quantization_config" in config:
        raise CheckpointError(
            f"{checkpoint}: config.json already has a quantization_config "
            f"({config['quantization_config'].get('quant_method', '?')}); export from the float checkpoint"
        )

    model = meta_skeleton(checkpoint, trust_remote_code)
    modules = dict(model.named_modules())
    src = weights or WeightSource(checkpoint, encodings, trust_pickle=trust_pickle)
    keys = src.keys()
    untied = set(src.untied())  # an output layer a transform (rotation) untied from the embedding table
    tied_names = {k: v for k, v in _tied_params(model).items() if k not in untied}
    if untied:
        config["tie_word_embeddings"] = False

    warnings: List[str] = []
    # dynamic input quantizers become the config group's input_activations (W8A8 with dynamic activations), and
    # so do static FP8 ones (with their input_scale); static integer activations are not written: they run in float
    dyn_inputs = {e.module: e for e in encodings.entries if _written_input(e)}
    kv = [e for e in encodings.entries if e.tensor in ("k_cache", "v_cache")]
    acts = _unwritten_activations(encodings.entries)
    if acts:
        warnings.append(
            f"{len(acts)} activation quantizer(s) not exported: the compressed-tensors export writes dynamic and FP8 "
            "input quantizers only (static integer and output ones run in float in the exported model)"
        )

    linear: List[EncodingEntry] = []
    float_embeddings: List[str] = []
    skipped: List[str] = []
    for e in encodings.entries:
        if e.tensor != "weight":
            continue
        mod = modules.get(e.module)
        if mod is None:
            raise EncodingsError(
                f"encodings quantize {e.module!r}, which this model ({type(model).__name__}) does not have; were "
                "they made for another model?"
            )
        if isinstance(mod, nn.Embedding):
            float_embeddings.append(e.module)
            continue
        if not isinstance(mod, nn.Linear):
            skipped.append(e.module)
            continue
        if f"{e.module}.weight" in tied_names:
            # compressing one side of a shared tensor would break the tie on load (llm-compressor unties first)
            others = sorted(tied_names[f"{e.module}.weight"] - {f"{e.module}.weight"})
            warnings.append(f"{e.module}: its weight is shared with {', '.join(others)}; left in float")
            skipped.append(e.module)
            continue
        linear.append(e)
    if float_embeddings:
        warnings.append(f"{len(float_embeddings)} embedding weight(s) left in float: {', '.join(float_embeddings)}")
    if skipped:
        warnings.append(f"{len(skipped)} non-Linear or tied weight(s) left in float: {', '.join(skipped)}")

    if not linear:
        raise EncodingsError(
            "the encodings quantize no Linear weight, so there is nothing to write in a compressed-tensors "
            "(weight-only) format" + (f" ({'; '.join(warnings)})" if warnings else "")
        )
    names = match_weight_names(linear, keys, str(checkpoint))
    by_key: Dict[str, EncodingEntry] = {}
    for e in linear:
        key = names[e.name]
        if key != "weight" and not key.endswith(".weight"):
            raise EncodingsError(f"{e.name}: checkpoint tensor {key!r} is not a layer's weight")
        by_key[key] = e

    # ---- config groups: one per distinct weight setting ------------------------------------------------------
    settings: Dict[str, Dict[str, Any]] = {}  # json(args) -> {"args", "format", "modules"}
    module_args: Dict[str, Dict[str, Any]] = {}
    module_fmt: Dict[str, str] = {}
    low_precision_warned = False
    for key, e in by_key.items():
        shape, dtype = src.shape_dtype(key)
        if len(shape) != 2:
            raise EncodingsError(f"{e.name}: Linear weight {key!r} has shape {list(shape)}, expected 2-D")
        if e.bitwidth > 8:
            raise EncodingsError(
                f"{e.name}: {e.bitwidth}-bit weights have no compressed-tensors integer format (1..8 bits)"
            )
        inputs = _input_args(dyn_inputs[e.module]) if e.module in dyn_inputs else None
        if e.is_float:
            args, fmt = _float_weight_args(e, tuple(shape), key)
            if fmt == "naive-quantized" and inputs is not None:
                fmt = "float-quantized"
        else:
            args = _weight_args(e, tuple(shape), key)
            fmt = _int_format(e.bitwidth, eight_bit_format)
        if inputs is not None and dyn_inputs[e.module].is_float != e.is_float:
            raise EncodingsError(f"{e.name}: compressed-tensors has no scheme mixing float and integer grids in one "
                                 f"layer (its input is {dyn_inputs[e.module].spec.describe()})")
        sig = json.dumps([args, inputs], sort_keys=True)
        settings.setdefault(sig, {"args": args, "inputs": inputs, "format": fmt, "modules": []})["modules"].append(
            e.module)
        module_args[key] = args
        module_fmt[key] = fmt
        if dtype not in (torch.float32, torch.float64) and not low_precision_warned:
            low_precision_warned = True
            warnings.append(
                f"scale_dtype: weights are {str(dtype).replace('torch.', '')}, so scales are stored (and loaded) in "
                "that dtype as llm-compressor does; dequantized weights may differ from qtool's fake-quant "
                "weights by the scale's rounding"
            )

    warnings += _compat_notes(list(settings.values()))

    quantized_modules = {e.module for e in by_key.values()}
    orphans = sorted(set(dyn_inputs) - quantized_modules)
    if orphans:
        acts += [dyn_inputs[m] for m in orphans]
        warnings.append(f"{len(orphans)} dynamic input quantizer(s) on layers whose weight is not exported "
                        f"quantized, so they run in float: {', '.join(orphans)}")
    float_linear = [n for n, m in modules.items() if isinstance(m, nn.Linear) and n not in quantized_modules]
    float_linear += _routers(model, modules, keys)
    all_plain_linear = all(type(modules[m]) is nn.Linear for m in quantized_modules)
    single = len(settings) == 1 and all_plain_linear
    groups: Dict[str, Any] = {}
    for i, s in enumerate(settings.values()):
        targets = ["Linear"] if single else [f"re:^{re.escape(m)}$" for m in s["modules"]]
        groups[f"group_{i}"] = {
            "format": s["format"],
            "input_activations": s["inputs"],
            "output_activations": None,
            "targets": targets,
            "weights": s["args"],
        }
    formats = sorted({s["format"] for s in settings.values()})
    top_format = formats[0] if len(formats) == 1 else "mixed-precision"
    qconfig = {
        "config_groups": groups,
        "format": top_format,
        "global_compression_ratio": None,
        "ignore": float_linear,
        "kv_cache_scheme": _kv_cache_scheme(kv),
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": _ct_version(),
    }
    transforms = _online_transforms(encodings, modules, src, keys)
    if transforms:
        qconfig["transform_config"] = {"config_groups": {t["scheme"]: t["config"] for t in transforms}}
        warnings += [_ONLINE_NOTE if loc == "input" else _KEY_ROTATION_NOTE
                     for loc in dict.fromkeys(t["location"] for t in transforms)]

    # ---- tensor layout ---------------------------------------------------------------------------------------
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
    out_dir.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "qtool_version": __version__, "qtool_export": "compressed-tensors",
                "qtool": json.dumps(info, sort_keys=True)}
    path = out_dir / "model.safetensors"
    declared = {n: (d, s) for n, d, s in layout}
    with StreamingSafetensorsWriter(path, layout, metadata) as w:
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

    config["quantization_config"] = qconfig
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n",
                                         encoding="utf-8")
    copied = []
    for f in sorted(checkpoint.iterdir()):
        if not f.is_file() or f.name in _SKIP_NAMES or f.name.lower().endswith(_WEIGHT_SUFFIXES):
            continue
        if f.name.endswith(".index.json"):
            continue
        shutil.copy2(f, out_dir / f.name)
        copied.append(f.name)

    return {
        "format": top_format,
        "tensors": len(layout),
        "source_tensors": len(keys),
        "quantized": len(by_key),
        "quantized_layers": sorted(quantized_modules),
        "config_groups": len(groups),
        "ignore": float_linear,
        "float_embeddings": float_embeddings,
        "skipped": skipped,
        "activation_quantizers_skipped": len(acts),
        "bytes_written": path.stat().st_size,
        "files_copied": copied,
        "warnings": warnings,
        "names": {e.name: names[e.name] for e in linear},
    }


def _write_layer(w: StreamingSafetensorsWriter, key: str, t: torch.Tensor, e: EncodingEntry,
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


def _write_float_layer(w: StreamingSafetensorsWriter, key: str, t: torch.Tensor, e: EncodingEntry,
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


_ONLINE_NOTE = ("the model rotates down_proj's input at run time (r4, transform_config): vLLM applies it; "
                "transformers 5.23 loads the weights but ignores transform_config, so its outputs are wrong there "
                "unless compressed-tensors' apply_transform_config adds the online part (see docs/formats.md)")
_KEY_ROTATION_NOTE = ("the model rotates each head's queries and keys at run time (r3, transform_config R3 at q_attn "
                      "and k_cache), and k_scale was calibrated on rotated keys: compressed-tensors' "
                      "apply_transform_config runs it; vLLM applies transforms to Linear layers only and ignores "
                      "R3, so there the FP8 KV cache gets unrotated keys, whose outlier channels can pass the range "
                      "of k_scale and clip; serve with vLLM without r3 (see docs/formats.md)")


def _online_transforms(encodings: EncodingsFile, modules, src, keys) -> List[Dict[str, Any]]:
    """compressed-tensors' description of each online rotation (``encodings.online``; r4): a ``transform_config``
    scheme named like llm-compressor's (``R4``) applied at the module's ``input`` (online) with its inverse at
    ``weight_input`` (already fused into the stored weights, which vLLM skips), and the matrix each rotated
    module loads (``<module>.R4_input.weight``, ``R·√n``: entries ±1, normalized by the reader). The type is
    ``hadamard`` only where qtool's matrix is Sylvester's (a power-of-two width, not randomized), which vLLM
    computes with its own fast kernel; otherwise ``random-hadamard``, which vLLM applies from the stored
    matrix."""
    from ..quant.hadamard import hadamard_order, rotation_matrix

    out = []
    key_set = set(keys)
    for rot in encodings.online:
        widths = {rotated_width(modules[m], rot) for m in rot.modules}
        if len(widths) != 1:
            raise EncodingsError(f"online rotation {rot.name}: the rotated widths differ ({sorted(widths)})")
        n = widths.pop()
        scheme = rot.name.upper()
        sylvester = rot.kind == "hadamard" and hadamard_order(n)[0] == 1
        matrix = (rotation_matrix(n, rot.kind, rot.seed) * n ** 0.5).round()
        # r4: the Linear's input online, its inverse already fused (weight_input); r3: each head's queries and the
        # keys the cache stores, both online (q_attn, k_cache), nothing fused
        locations = ("input",) if rot.location == "input" else ("q_attn", "k_cache")
        tensors = {}
        for m in rot.modules:
            key = f"{m}.weight" if rot.location == "input" else f"{m}.k_proj.weight"
            if key not in key_set:
                raise EncodingsError(f"online rotation {rot.name}: {m} has no weight {key!r} in the checkpoint")
            for loc in locations:
                tensors[f"{m}.{scheme}_{loc}.weight"] = (src.shape_dtype(key)[1], (n, n))
        targets = list(rot.modules)
        apply = [{"targets": targets, "location": loc, "inverse": False, "ignore": []} for loc in locations]
        if rot.location == "input":
            apply.append({"targets": targets, "location": "weight_input", "inverse": True, "ignore": []})
        out.append({"scheme": scheme, "matrix": matrix, "tensors": tensors, "location": rot.location, "config": {
            "type": "hadamard" if sylvester else "random-hadamard", "apply": apply,
            "randomize": False, "requires_grad": False, "head_dim": None if rot.location == "input" else n,
            "precision": "float32"}})
    return out


class CompressedTensorsExporter(Exporter):
    """``--format compressed-tensors`` (see the module docs)."""

    name = "compressed-tensors"
    aimet_json = "never"
    online_rotations = True  # transform_config (r4), as llm-compressor writes it

    @dataclass
    class Options:
        ct_eight_bit_format: str = "int-quantized"  # or pack-quantized (what vLLM's weight-only path runs)

    def left_float(self, quantizers, options: "CompressedTensorsExporter.Options") -> List[str]:
        """Weights of modules other than Linear (embedding tables): the layout quantizes Linear weights only."""
        return [q.name for q in quantizers if q.tensor == "weight" and q.module_type != "Linear"]

    def not_written(self, entries, options: "CompressedTensorsExporter.Options") -> List[str]:
        return self.left_float(entries, options) + [e.name for e in _unwritten_activations(entries)]

    def tensor_bytes(self, quantizer, shape, dtype, options: "CompressedTensorsExporter.Options") -> int:
        """As :func:`export_compressed_tensors` lays the tensor out: a quantized layer's input scales (static
        FP8 / NVFP4 inputs, 4 bytes each) are not counted."""
        shape = tuple(shape)
        if quantizer is None or getattr(quantizer, "module_type", "Linear") != "Linear":
            return layout_bytes([("", dtype, shape)])  # only Linear weights are written quantized
        spec = quantizer.spec
        if spec.is_float:
            return layout_bytes(_float_layout(spec, "", shape, _ct_scale_shape(spec), None))
        strategy = {"per_tensor": "tensor", "per_channel": "channel"}.get(spec.granularity.value, "group")
        packed = _int_format(spec.bitwidth, options.ct_eight_bit_format) == "pack-quantized"
        return layout_bytes(_int_layout("", spec, shape, _scale_dtype(dtype), packed, strategy))

    def write(self, request: ExportRequest, options: "CompressedTensorsExporter.Options") -> Dict[str, object]:
        return export_compressed_tensors(request.checkpoint, request.encodings, request.out_dir,
                                         progress=request.progress, eight_bit_format=options.ct_eight_bit_format,
                                         trust_remote_code=request.trust_remote_code, weights=request.weights)


EXPORTER = CompressedTensorsExporter()
