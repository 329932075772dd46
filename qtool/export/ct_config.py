"""compressed-tensors' ``quantization_config`` for the compressed-tensors export (see
``qtool.export.compressed_tensors``): each weight's and input's ``QuantizationArgs``, one config group per distinct
setting, the KV cache scheme, the ``transform_config`` of online rotations, and the loader notes worth a warning."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..config import CHECKPOINT_KEYS
from ..encodings import EncodingEntry, EncodingsFile
from ..errors import EncodingsError
from ..model.online import rotated_width

# the compressed-tensors version that wrote the reference files in shared/data/compressed-tensors
CT_VERSION_FALLBACK = "0.19.0"


def _ct_version() -> str:
    try:
        from importlib.metadata import version

        return version("compressed-tensors")
    except Exception:  # not installed: write the version of the reference output
        return CT_VERSION_FALLBACK


def _not_along_inputs(e) -> EncodingsError:
    bs = None if e.block_size is None else list(e.block_size)
    return EncodingsError(f"{e.name}: block_size {bs or None} is not supported by the compressed-tensors export; it "
                          "writes groups along the input dimension only (block_size [1, G])")


def _other_block_size(e, fmt: str, got) -> EncodingsError:
    return EncodingsError(f"{e.name}: {fmt} stores blocks of {_BLOCKS[fmt]} (got {got}); vLLM and compressed-tensors "
                          "read no other size")


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
            raise _not_along_inputs(e)
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


_BLOCKS = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32, "mxfp8-quantized": 32}  # the one size each holds


def check_layout(e) -> None:
    """Refuse a Linear weight's encoding, or its plan row before calibration (``name``, ``element``,
    ``scale_dtype``, ``granularity``, ``block_size``), that no compressed-tensors layout holds, whatever the
    weight's shape: a float element without a format, 2-D blocks other than FP8's tiles, a float format's other
    block size. (What depends on the shape is checked as each weight is written.)"""
    layout = None
    if e.element != "int":
        layout = _FLOAT_LAYOUTS.get((e.element, e.scale_dtype))
        if layout is None:
            raise EncodingsError(f"{e.name}: {e.element} elements with {e.scale_dtype} scales have no "
                                 "compressed-tensors format (FP8 with float32 or e8m0 scales, FP4 with e8m0 (MXFP4) or "
                                 "fp8_e4m3 (NVFP4))")
    bs = tuple(e.block_size or ())
    if e.granularity == "per_block" and (len(bs) != 2 or bs[0] not in (1, -1)):
        if not (layout is not None and layout[1] is None and len(bs) == 2):  # (FP8's tiles: strategy block)
            raise _not_along_inputs(e)
    if layout is not None and layout[1] is not None:
        if e.granularity != "per_block":
            got = {"per_tensor": "tensor", "per_channel": "channel"}.get(e.granularity, e.granularity)
            raise EncodingsError(f"{e.name}: {layout[0]} needs blocks along the input dimension (got {got})")
        if bs[1] != -1 and bs[1] != _BLOCKS[layout[0]]:
            raise _other_block_size(e, layout[0], bs[1])


def _float_weight_args(e: EncodingEntry, shape: Tuple[int, ...], key: str) -> Tuple[Dict[str, Any], str]:
    """compressed-tensors weight ``QuantizationArgs`` and format for a float element encoding."""
    check_layout(e)
    fmt, strategy, sdtype = _FLOAT_LAYOUTS[(e.element, e.scale_dtype)]
    bs = tuple(e.block_size or ())
    if strategy is None and len(bs) == 2 and bs[0] not in (1, -1):  # 2-D tiles: FP8_BLOCK's 128x128
        e.check_fits(key, shape)
        args = {"actorder": None, "block_structure": [int(bs[0]), int(bs[1])], "dynamic": False, "group_size": None,
                "num_bits": 8, "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": None,
                "strategy": "block", "symmetric": True, "type": "float", "zp_dtype": None}
        return args, fmt
    args = _weight_args(e, shape, key)
    if strategy is not None:
        args["strategy"] = strategy
    want = _BLOCKS.get(fmt)
    if want is not None and args["group_size"] != want:  # (block_size [1, -1]: the group size the shape gives)
        raise _other_block_size(e, fmt, args["group_size"])
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
                         "scheme); export with --ct-8bit-format pack-quantized for vLLM")
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


FUSED_MIX_NOTE = "run fused, with one scheme for all of them"  # (eval finds an export's warning by it)


def fused_mixes(settings: Dict[str, Dict[str, Any]], linear: Sequence[str],
                rename: Callable[[str], str] = str) -> List[str]:
    """A warning for each group of Linears (``linear``, in model order) that runtimes fuse into one layer (q/k/v,
    gate/up, one projection across a mixture-of-experts layer's experts: ``config.fused``) and that this file
    quantizes with more than one scheme, or partly float: vLLM refuses such a layer, and transformers, which holds a
    mixture-of-experts layer's experts fused, cannot load those. ``rename``: a module's name in the file."""
    from ..config.fused import fused_groups

    scheme = {m: sig for sig, setting in settings.items() for m in setting["modules"]}
    short = {sig: f"{st['args']['num_bits']}-bit {st['args']['type']} {st['args']['strategy']}"
             for sig, st in settings.items()}
    mixed = []
    for group in fused_groups(list(linear)):
        first = scheme.get(group[0])
        odd = next((m for m in group if scheme.get(m) != first), None)
        if odd is not None:
            mixed.append((group[0], first, odd, scheme.get(odd)))
    notes = []
    for a, sa, b, sb in mixed[:3]:
        experts = ".experts." in a
        notes.append(f"vLLM{' and transformers' if experts else ''}: {rename(a)} ({short.get(sa, 'float')}) and "
                     f"{rename(b)} "
                     f"({short.get(sb, 'float')}) {FUSED_MIX_NOTE}, and this file "
                     f"quantizes them differently: {'neither loads' if experts else 'vLLM refuses'} it; quantize "
                     "them alike (one rule)")
    if len(mixed) > 3:
        notes.append(f"... and {len(mixed) - 3} more such fused groups quantized differently")
    return notes


def _int_format(bitwidth: int, eight_bit_format: str) -> str:
    """The compressed-tensors format of an integer weight: 8-bit ones as asked, narrower ones always packed."""
    return eight_bit_format if bitwidth == 8 else "pack-quantized"


def config_groups(by_key: Dict[str, EncodingEntry], src, dyn_inputs: Dict[str, EncodingEntry], eight_bit_format: str,
                  warnings: List[str]):
    """Each quantized Linear's weight (and input) args and format, and one setting per distinct pair:
    ``(settings, module_args, module_fmt)``, with ``settings`` json(args) -> {"args", "inputs", "format",
    "modules"} in first-seen order. Appends the low-precision scale warning to ``warnings``."""
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
        # (an integer grid's scales take a 16-bit checkpoint's dtype; a float grid's have their own, ct_tensors)
        if not e.is_float and dtype in (torch.float16, torch.bfloat16) and not low_precision_warned:
            low_precision_warned = True
            warnings.append(
                f"scale_dtype: weights are {str(dtype).replace('torch.', '')}, so integer weights' scales are stored "
                "(and loaded) in that dtype as llm-compressor does; dequantized weights may differ from qtool's "
                "fake-quant weights by the scale's rounding"
            )
    return settings, module_args, module_fmt


_ROUTED = re.compile(r"(?<![A-Za-z0-9_])experts\\?\.\d")


def transformers_expert_limit(qconfig: Dict[str, Any]) -> Optional[str]:
    """Why transformers (5.23, compressed-tensors 0.20) does not reload the model a compressed-tensors directory
    holds where its mixture-of-experts experts are stored one by one and transformers' model holds them fused
    (stacking them as it loads); None where it does. Measured on tiny Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE and
    DeepSeek-V3: it stacks int4/int8 pack-quantized, FP8 and MXFP4 experts exactly, under one config group or
    several (attention and experts apart, gate/up and down of one width in other granularities); it does not stack
    int-quantized (8-bit) or MXFP8 experts, experts of two bit widths, or experts left float in an integer file.
    NVFP4 experts, which it reloads with wrong values, are said apart."""
    groups = [g for g in (qconfig.get("config_groups") or {}).values() if isinstance(g, dict)]
    # (a routed expert's target names experts.<e>: DeepSeek's shared_experts is a plain MLP transformers loads)
    experts = [g for g in groups if any(isinstance(t, str) and (t == "Linear" or _ROUTED.search(t))
                                        for t in g.get("targets") or ())]
    formats = {g.get("format") for g in experts}
    if any(isinstance(n, str) and ".experts." in n for n in qconfig.get("ignore") or ()) and \
            {g.get("format") for g in groups} & {"int-quantized", "pack-quantized"}:
        return ("its experts are left float in an integer file, where its expert stacking looks for quantized "
                "expert tensors and finds none (torch.cat of nothing)")
    if "int-quantized" in formats:
        return ("its expert stacking finds no int-quantized (8-bit) gate/up tensors to stack (llm-compressor's W8A8 "
                "MoE output fails alike; --ct-8bit-format pack-quantized writes 8-bit weights it reads)")
    if "mxfp8-quantized" in formats:
        return "its dequantization of stacked MXFP8 experts fails (a scale shape mismatch)"
    widths = sorted({w.get("num_bits") for g in experts if isinstance(w := g.get("weights"), dict)
                     and isinstance(w.get("num_bits"), int)})
    if len(widths) > 1:
        return (f"its experts are quantized to {' and '.join(f'{b}-bit' for b in widths)} weights, which its "
                "expert stacking gives back wrong (quantize the experts to one width)")
    return None


def quantization_config(settings: Dict[str, Dict[str, Any]], modules: Dict[str, nn.Module], quantized_modules,
                        float_linear: List[str], kv: List[EncodingEntry],
                        rename: Callable[[str], str] = str) -> Tuple[Dict[str, Any], Dict[str, Any], str]:
    """``(quantization_config, config groups, top-level format)``: with one setting on plain Linears the group
    targets ``"Linear"`` (as llm-compressor writes it), otherwise each group names its modules. ``rename``: a
    module's name in the file (``Family.compressed_tensors_name``)."""
    all_plain_linear = all(type(modules[m]) is nn.Linear for m in quantized_modules)
    single = len(settings) == 1 and all_plain_linear
    groups: Dict[str, Any] = {}
    for i, s in enumerate(settings.values()):
        targets = ["Linear"] if single else [f"re:^{re.escape(rename(m))}$" for m in s["modules"]]
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
        "ignore": [rename(m) for m in float_linear],
        "kv_cache_scheme": _kv_cache_scheme(kv),
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": _ct_version(),
    }
    return qconfig, groups, top_format


_ONLINE_NOTE = ("the model rotates down_proj's input at run time (r4, transform_config): vLLM applies it; "
                "transformers 5.23 loads the weights but ignores transform_config, so its outputs are wrong there "
                "unless compressed-tensors' apply_transform_config adds the online part (see docs/formats.md)")
_KEY_ROTATION_NOTE = ("the model rotates each head's queries and keys at run time (r3, transform_config R3 at q_attn "
                      "and k_cache), and k_scale was calibrated on rotated keys: compressed-tensors' "
                      "apply_transform_config runs it; vLLM applies transforms to Linear layers only and ignores "
                      "R3, so there the FP8 KV cache gets unrotated keys, whose outlier channels can pass the range "
                      "of k_scale and clip; serve with vLLM without r3 (see docs/formats.md)")


def _online_transforms(encodings: EncodingsFile, modules, src, keys, model=None) -> List[Dict[str, Any]]:
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
    # a module's checkpoint name, which a reader's module carries (Mixtral's experts live under block_sparse_moe
    # in the checkpoint and under mlp in memory)
    renamed = getattr(model, CHECKPOINT_KEYS, None) or {}  # (a float expert's too: it has no entry)
    stored = {p[:-len(".weight")]: k[:-len(".weight")] for p, k in renamed.items()
              if p.endswith(".weight") and k.endswith(".weight")}
    stored.update({e.module: e.name[:-len(".weight")] for e in encodings.entries
                   if e.tensor == "weight" and e.name.endswith(".weight")})
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
        tensors, targets = {}, []
        for m in rot.modules:
            target = stored.get(m, m) if rot.location == "input" else m
            key = f"{target}.weight" if rot.location == "input" else f"{m}.k_proj.weight"
            if key not in key_set:
                raise EncodingsError(f"online rotation {rot.name}: {m} has no weight {key!r} in the checkpoint")
            for loc in locations:
                tensors[f"{target}.{scheme}_{loc}.weight"] = (src.shape_dtype(key)[1], (n, n))
            targets.append(target)
        apply = [{"targets": targets, "location": loc, "inverse": False, "ignore": []} for loc in locations]
        if rot.location == "input":
            apply.append({"targets": targets, "location": "weight_input", "inverse": True, "ignore": []})
        out.append({"scheme": scheme, "matrix": matrix, "tensors": tensors, "location": rot.location, "config": {
            "type": "hadamard" if sylvester else "random-hadamard", "apply": apply,
            "randomize": False, "requires_grad": False, "head_dim": None if rot.location == "input" else n,
            "precision": "float32"}})
    return out
