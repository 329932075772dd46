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
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from torch import nn

from ..config.layout import attention_modules
from ..encodings import EncodingsFile
from ..errors import CheckpointError, EncodingsError, UsageError
from ..families import family_of_model
from ..io.checkpoint import detect_kind, not_found
from ..io.jsonfile import read_json_object
from ..model.expert_view import open_checkpoint
from ..model.hf import meta_skeleton
from ..weights import WeightSource
from .base import Exporter, ExportRequest, layout_bytes, weight_names
from .ct_config import (_KEY_ROTATION_NOTE, _ONLINE_NOTE, CT_VERSION_FALLBACK, _compat_notes, _int_format,
                        _online_transforms, check_layout, config_groups, fused_mixes, quantization_config,
                        transformers_expert_limit)
from .ct_modules import _routers, _tied_params, _unwritten_activations, _written_input, select_linear
from .ct_tensors import _ct_scale_shape, _float_layout, _int_layout, _scale_dtype, tensor_layout, write_tensors

__all__ = ["export_compressed_tensors", "CT_VERSION_FALLBACK"]

Progress = Optional[Callable[[int, int, str], None]]

# files of a checkpoint directory that are weights (replaced by model.safetensors) or rewritten (config.json)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pt2", ".ckpt", ".h5", ".msgpack", ".gguf")
_SKIP_NAMES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def _read_config(checkpoint: Path, out_dir: Path, eight_bit_format: str) -> Dict[str, Any]:
    """The checkpoint's ``config.json``, after refusing what this export cannot start from (an unknown 8-bit
    format, a missing checkpoint or one that is not a float Hugging Face directory, the checkpoint as output)."""
    if eight_bit_format not in ("int-quantized", "pack-quantized"):
        raise UsageError(f"eight_bit_format must be int-quantized or pack-quantized, got {eight_bit_format!r}")
    if not checkpoint.exists():
        raise not_found(checkpoint)
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
    return config


def _file_module_names(model: nn.Module, keys: List[str], tensor_name: Callable[[str], str]) -> Callable[[str], str]:
    """A loaded module's name as the config names its layer, then ``tensor_name``'s (the family's runtime's): an
    expert's as the file's tensors name it, the checkpoint's (transformers 5 loads Mixtral's
    ``block_sparse_moe.experts.<e>.w1`` fused as ``mlp.experts``, so qtool's per-expert modules are named by no
    runtime: the targets named 48 expert layers no tensor of the file has, where vLLM's Mixtral reads the
    checkpoint's names); any other layer's as transformers loads it (its reload matches targets to its modules:
    LLaVA's ``model.language_model``, stored as ``language_model.model``)."""
    from ..model.checkpoint_map import checkpoint_names

    stored = {name: key for key, name in checkpoint_names(model, keys).items() if ".experts." in name}

    def rename(module: str) -> str:
        key = stored.get(f"{module}.weight", "")
        return tensor_name(key[: -len(".weight")] if key.endswith(".weight") else module)

    return rename


def _copy_side_files(checkpoint: Path, out_dir: Path) -> List[str]:
    """Copy the checkpoint directory's files other than weights and config.json (tokenizer, generation config,
    ...) into ``out_dir``; returns their names."""
    copied = []
    for f in sorted(checkpoint.iterdir()):
        if not f.is_file() or f.name in _SKIP_NAMES or f.name.lower().endswith(_WEIGHT_SUFFIXES):
            continue
        if f.name.endswith(".index.json"):
            continue
        shutil.copyfile(f, out_dir / f.name)  # (the bytes alone: modes follow the umask, as qtool's own files do;
        copied.append(f.name)                 # copy2 gave a 0600 tokenizer a server's other user cannot read)
    for name in _sentence_transformers_modules(checkpoint):
        for src in sorted((checkpoint / name).rglob("*")):
            dst = out_dir / name / src.relative_to(checkpoint / name)
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
            elif src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
        copied.append(name + "/")
    return copied


def _sentence_transformers_modules(checkpoint: Path) -> List[str]:
    """The folders of the modules a sentence-transformers model runs after the transformer (``modules.json``:
    ``1_Pooling``, ``2_Normalize``, ...): copied with ``modules.json``, which names them, or the directory would no
    longer load in sentence-transformers."""
    try:
        modules = json.loads((checkpoint / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(modules, list):
        return []
    paths = [m.get("path") for m in modules if isinstance(m, dict)]
    return [p for p in paths if isinstance(p, str) and p and Path(p).name == p and p not in (".", "..")
            and (checkpoint / p).is_dir() and not (checkpoint / p).is_symlink()]


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
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    config = _read_config(checkpoint, out_dir, eight_bit_format)

    model = meta_skeleton(checkpoint, trust_remote_code)
    modules = dict(model.named_modules())
    src = weights or WeightSource(checkpoint, encodings,
                                  tensors=open_checkpoint(checkpoint, trust_pickle, model=model))
    untied = set(src.untied())  # an output layer a transform (rotation) untied from the embedding table
    tied_names = {k: v for k, v in _tied_params(model).items() if k not in untied}
    if untied:
        config["tie_word_embeddings"] = False

    warnings: List[str] = []
    # dynamic input quantizers become the config group's input_activations (W8A8 with dynamic activations), and
    # so do static FP8 ones (with their input_scale); static integer activations are not written: they run in float
    dyn_inputs = {e.module: e for e in encodings.entries if _written_input(e)}
    kv = [e for e in encodings.entries if e.tensor in ("k_cache", "v_cache")]
    if kv:
        with_kv = {e.module for e in kv}
        refuse_partial_kv_cache([n for n in attention_modules(modules.items()) if n not in with_kv], EncodingsError)
    acts = _unwritten_activations(encodings.entries)
    if acts:
        warnings.append(
            f"{len(acts)} activation quantizer(s) not exported: the compressed-tensors export writes dynamic and FP8 "
            "input quantizers only (static integer and output ones run in float in the exported model)"
        )
    linear, float_embeddings, skipped = select_linear(encodings.entries, model, modules, tied_names, warnings)

    if not linear:
        raise EncodingsError(
            "the encodings quantize no Linear weight, and qtool's compressed-tensors files are quantized Linear "
            "weights (their input and KV-cache schemes beside them): export with --format qtool"
            + (f" ({'; '.join(warnings)})" if warnings else "")
        )
    matched = weight_names(src, linear, str(checkpoint))
    keys, names, by_key = matched.keys, matched.names, matched.by_key
    for e in linear:
        key = names[e.name]
        if key != "weight" and not key.endswith(".weight"):
            raise EncodingsError(f"{e.name}: checkpoint tensor {key!r} is not a layer's weight")
    settings, module_args, module_fmt = config_groups(by_key, src, dyn_inputs, eight_bit_format, warnings)
    warnings += _compat_notes(list(settings.values()))

    quantized_modules = {e.module for e in by_key.values()}
    family = family_of_model(model)
    # (the names vLLM's loader for the family reads: GraniteMoE's experts are Mixtral's w1/w3/w2 there)
    tensor_name = family.compressed_tensors_name if family is not None else str
    rename = _file_module_names(model, keys, tensor_name)
    experts = [m for m in quantized_modules if ".experts." in m]
    if experts and family is not None and not family.transformers_reads_split_experts:
        warnings.append(f"transformers' {family.title} model reads its experts fused only: from_pretrained loads "
                        f"this directory's {len(experts)} per-expert layers as randomly initialized experts (its "
                        "load report lists them MISSING), so run the file in a runtime that reads per-expert tensors, "
                        "as vLLM does (qtool eval refuses the transformers reload in one line)")
    elif any(module_fmt[k] == "nvfp4-pack-quantized" for k, e in by_key.items() if ".experts." in e.module):
        warnings.append("transformers reloads NVFP4 experts wrongly (their values multiplied by the global scale "
                        "instead of divided; dense layers reload right): the bfloat16 reload of this file is not "
                        "the model it holds (vLLM reads it; qtool eval says so in one line)")
    orphans = sorted(set(dyn_inputs) - quantized_modules)
    if orphans:
        acts += [dyn_inputs[m] for m in orphans]
        warnings.append(f"{len(orphans)} dynamic input quantizer(s) on layers whose weight is not exported "
                        f"quantized, so they run in float: {', '.join(rename(m) for m in orphans)}")
    linear_names = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    float_linear = [n for n in linear_names if n not in quantized_modules] + _routers(model, modules, keys)
    warnings += fused_mixes(settings, linear_names, rename)
    qconfig, groups, top_format = quantization_config(settings, modules, quantized_modules, float_linear, kv, rename)
    split = [n for n in linear_names if ".experts." in n]  # (quantized or left float)
    limit = transformers_expert_limit(qconfig) if split and family is not None and \
        family.transformers_reads_split_experts else None
    if limit:
        warnings.append(f"transformers cannot reload this directory's {len(split)} per-expert layers into its fused "
                        f"experts: {limit}; qtool eval refuses the transformers reload in one line")
    transforms = _online_transforms(encodings, modules, src, keys, model)
    if transforms:
        qconfig["transform_config"] = {"config_groups": {t["scheme"]: t["config"] for t in transforms}}
        warnings += [_ONLINE_NOTE if loc == "input" else _KEY_ROTATION_NOTE
                     for loc in dict.fromkeys(t["location"] for t in transforms)]
    layout, info = tensor_layout(keys, src, by_key, dyn_inputs, module_fmt, module_args, kv, transforms)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.safetensors"
    write_tensors(path, layout, info, keys, src, by_key, dyn_inputs, kv, transforms, progress, tensor_name)

    config["quantization_config"] = qconfig
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n",
                                         encoding="utf-8")
    copied = _copy_side_files(checkpoint, out_dir)
    return {
        "ct_format": top_format,
        "tensors": len(layout),
        "source_tensors": len(keys),
        "quantized": len(by_key),
        "quantized_layers": sorted(rename(m) for m in quantized_modules),
        "config_groups": len(groups),
        "ignore": qconfig["ignore"],
        "float_embeddings": float_embeddings,
        "skipped": skipped,
        "activation_quantizers_skipped": len(acts),
        "bytes_written": path.stat().st_size,
        "files_copied": copied,
        "warnings": warnings,
        "names": {e.name: tensor_name(names[e.name]) for e in linear},
    }


def refuse_partial_kv_cache(float_attention: List[str], error) -> None:
    """compressed-tensors has one ``kv_cache_scheme`` for the model, which transformers and vLLM apply to every
    attention layer: a layer whose keys and values the recipe keeps float would run quantized with no scales."""
    if float_attention:
        raise error(f"{float_attention[0]}: its KV cache is kept float ({len(float_attention)} attention layer(s) in "
                    "all: ignored), but compressed-tensors' kv_cache_scheme quantizes every attention layer's cache, "
                    "as transformers and vLLM run it (this one with no scales): quantize them all, or export with "
                    "--format qtool")


class CompressedTensorsExporter(Exporter):
    """``--format compressed-tensors`` (see the module docs)."""

    name = "compressed-tensors"
    aimet_json = "never"
    online_rotations = True  # transform_config (r4), as llm-compressor writes it

    @dataclass
    class Options:
        ct_eight_bit_format: str = "int-quantized"  # or pack-quantized (what vLLM's weight-only path runs)

    def check_quantizers(self, quantizers, options: "CompressedTensorsExporter.Options") -> None:
        """What no layout holds, known from a plan's rows before calibrating (the layout quantizes Linear weights
        only; an encodings file's entries, which do not name their module's type, are checked as they are
        written)."""
        for q in quantizers:
            if q.tensor == "weight" and getattr(q, "module_type", None) == "Linear":
                check_layout(q)

    def left_float(self, quantizers, options: "CompressedTensorsExporter.Options", tied=()) -> List[str]:
        """Weights of modules other than Linear (embedding tables): the layout quantizes Linear weights only; and
        a Linear's weight shared with another module (a tied ``lm_head``, under either of its names), which
        compressing would untie."""
        shared = {*tied, *tied.values()} if isinstance(tied, dict) else set(tied)
        return [q.name for q in quantizers if q.tensor == "weight" and (q.module_type != "Linear" or q.name in shared)]

    def not_written(self, entries, options: "CompressedTensorsExporter.Options", tied=()) -> List[str]:
        return self.left_float(entries, options, tied) + [e.name for e in _unwritten_activations(entries)]

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

    def check_kv_cache(self, float_attention: List[str]) -> None:
        refuse_partial_kv_cache(float_attention, UsageError)

    def write(self, request: ExportRequest, options: "CompressedTensorsExporter.Options") -> Dict[str, object]:
        return export_compressed_tensors(request.checkpoint, request.encodings, request.out_dir,
                                         progress=request.progress, eight_bit_format=options.ct_eight_bit_format,
                                         trust_remote_code=request.trust_remote_code, weights=request.weights)


EXPORTER = CompressedTensorsExporter()
