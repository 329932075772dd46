"""Everything Hugging Face-specific, in one place: loading a model directory with transformers, building a model
on the meta device from its config (no weights read), and mapping checkpoint tensor names to the model's.

transformers is an optional extra (``qtool[hf]``); every entry point here turns its absence into one error line.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..errors import CheckpointError, UsageError
from ..io.checkpoint import (check_files_there, check_index_places, check_safetensors, no_safetensors,
                             safetensors_index, tensor_files, unheld_index_entry)
from ..io.jsonfile import read_json_object
from .experts import linearize_experts

__all__ = ["load_hf", "hf_name_map", "meta_skeleton", "meta_causal_lm", "check_weights_fit"]


def _transformers(path):
    try:
        import transformers
    except ImportError:
        raise UsageError(f"{path}: Hugging Face checkpoints need transformers: pip install 'qtool[hf]'") from None
    return transformers


@contextlib.contextmanager
def never_asks():
    """Around qtool's calls into transformers: where a caller leaves ``trust_remote_code`` out (transformers' own
    classes do: a sequence classifier builds its backbone by ``AutoModel.from_config``), transformers asks on stdin
    whether to run a repository's code, its question landing in stdout (and ``--json``); with its timeout 0 it
    refuses instead. The caller's setting is put back after."""
    from transformers import dynamic_module_utils

    before = dynamic_module_utils.TIME_OUT_REMOTE_CODE
    dynamic_module_utils.TIME_OUT_REMOTE_CODE = 0
    try:
        yield
    finally:
        dynamic_module_utils.TIME_OUT_REMOTE_CODE = before


def _float32(transformers) -> Dict[str, Any]:
    """The keyword that asks transformers for float32 weights: ``dtype`` from 4.56, which deprecates the
    ``torch_dtype`` the declared floor (4.45) still needs."""
    major, minor = (int(re.match(r"\d+", p).group()) for p in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}


def _config(path, trust_remote_code: bool):
    transformers = _transformers(path)
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json in this directory")
    # read it ourselves first: transformers turns some malformed files into tracebacks
    raw = read_json_object(cfg_file, CheckpointError, "Hugging Face config")
    _refuse_non_finite(cfg_file, raw)
    _refuse_quantized(cfg_file, raw)
    _check_layer_count(path, raw)
    archs = raw.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise CheckpointError(f"{cfg_file}: architectures must be a list of class names, like [\"LlamaForCausalLM\"] "
                              f"(got {json.dumps(archs)[:60]})")
    try:
        with never_asks():
            config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except ValueError as e:
        msg = str(e).splitlines()[0][:240] if str(e) else type(e).__name__
        if "trust_remote_code" in str(e):
            msg = "this model needs its own Python code; pass --trust-remote-code if you trust its source"
        raise CheckpointError(f"{path}: {msg}") from None
    except OSError as e:
        fetched = raw["auto_map"].get("AutoConfig") if isinstance(raw.get("auto_map"), dict) else None
        elsewhere = f"AutoConfig: {fetched}" if isinstance(fetched, str) and "--" in fetched else None
        if elsewhere:  # ("org/repo--module.Class": code fetched from another repository, which failed)
            raise CheckpointError(f"{cfg_file}: auto_map names code in another Hugging Face repository "
                                  f"({elsewhere[:100]}), which could not be fetched ({str(e).splitlines()[0][:120]}); "
                                  "where that code is in this directory, drop the 'org/repo--' prefix") from None
        raise CheckpointError(f"{path}: cannot read config.json: {str(e).splitlines()[0]}") from None
    except Exception as e:  # transformers' own validation (wrong field types, ...): the file's fault, not ours
        first = str(e).splitlines()[0][:160] if str(e) else ""
        raise CheckpointError(f"{cfg_file}: transformers cannot read this config ({type(e).__name__}: "
                              f"{first})") from None
    _check_architecture(transformers, cfg_file, config)
    return config


def _refuse_quantized(cfg_file: Path, raw: dict) -> None:
    """A checkpoint quantized already (DeepSeek-V3's block FP8 with its weight_scale_inv, a compressed-tensors or
    GPTQ export): its weights are codes beside scales that qtool would read as float values (a w4a16 run of a
    block-FP8 checkpoint exited 0 with ranges 2000x the real weights')."""
    for cfg in (raw, raw.get("text_config")):
        qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if not isinstance(qc, dict) or not qc:
            continue
        method = str(qc.get("quant_method", qc.get("format", "unknown")))[:40]
        sparsity = qc.get("sparsity_config") if isinstance(qc.get("sparsity_config"), dict) else {}
        if method == "compressed-tensors" and not qc.get("config_groups") and qc.get("format") in (None, "dense") \
                and sparsity.get("format") in (None, "dense"):
            continue  # (no quantization groups, weights stored dense: float weights, llm-compressor's sparsity pass)
        raise CheckpointError(f"{cfg_file}: the checkpoint is quantized already (quantization_config, quant_method "
                              f"{method!r}): qtool calibrates float weights; pass the float checkpoint it was made "
                              "from, or dequantize it first")


def _refuse_scaled_codes(headers: Dict[str, Tuple[Tuple[int, ...], Path]]) -> None:
    """Codes beside their scales (a block-FP8 or int8 checkpoint whose config.json lost its quantization_config):
    read as float weights they are the codes, hundreds of times the weights' values. ``headers``: the checkpoint's
    (``safetensors_index``); only the files holding a weight beside a scale are opened for its dtype."""
    from safetensors import safe_open

    pairs = {k: next(k + s for s in ("_scale_inv", "_scale") if k + s in headers) for k in headers
             if k.endswith(".weight") and (k + "_scale_inv" in headers or k + "_scale" in headers)}
    dtypes = {}
    for f in sorted({headers[k][1] for k in pairs}):
        with safe_open(str(f), "pt") as fh:
            dtypes.update({k: fh.get_slice(k).get_dtype() for k in pairs if headers[k][1] == f})
    for k in sorted(pairs):
        if dtypes[k].startswith("F8") or dtypes[k] == "I8":
            kind = "float8" if dtypes[k].startswith("F8") else "int8"
            raise CheckpointError(f"{headers[k][1]}: {k} holds {kind} codes beside their scales ({pairs[k]}): the "
                                  "checkpoint is quantized already; qtool calibrates float weights: pass the float "
                                  "checkpoint it was made from, or dequantize it first")


def _check_architecture(transformers, cfg_file: Path, config) -> None:
    """``architectures[0]``, when it is one of transformers' own classes, built for ``model_type``'s config.
    transformers' Auto classes follow ``model_type`` and vLLM follows ``architectures``: where they disagree the
    exported file runs one model in one runtime and another in the other, and qtool would calibrate one of them."""
    archs = getattr(config, "architectures", None) or []
    if not archs or not isinstance(archs[0], str) or getattr(config, "auto_map", None):
        return  # (a remote-code config names its own classes: Kimi K2's kimi_k2 runs DeepseekV3ForCausalLM)
    cls = getattr(transformers, archs[0], None)
    wanted = getattr(getattr(cls, "config_class", None), "model_type", "")
    if isinstance(wanted, str) and wanted and wanted != getattr(config, "model_type", wanted) \
            and archs[0] not in _auto_classes(getattr(config, "model_type", None)):
        raise CheckpointError(
            f"{cfg_file}: model_type {config.model_type!r} but architectures[0] {archs[0]} is a {wanted!r} "
            f"model (transformers builds the one, vLLM the other): make them agree")


def _auto_classes(model_type) -> set:
    """The classes transformers' Auto mappings build for ``model_type`` (internlm3's is LlamaForCausalLM)."""
    from transformers.models.auto import modeling_auto

    found = set()
    for name in dir(modeling_auto):
        table = getattr(modeling_auto, name)
        if name.endswith("_MAPPING_NAMES") and isinstance(table, dict):
            value = table.get(model_type)
            found.update(value if isinstance(value, (list, tuple)) else [value] if value else [])
    return found


def _refuse_non_finite(cfg_file: Path, obj: Any, where: str = "") -> None:
    """NaN or an infinity anywhere in config.json (Hugging Face's reader takes them): no model has a use for one,
    and exporters copy the config into their output."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        at = f"{where}.{key}" if where else str(key)
        if isinstance(value, float) and not math.isfinite(value):
            raise CheckpointError(f"{cfg_file}: {at} is {value}; config values must be finite numbers")
        _refuse_non_finite(cfg_file, value, at)


_INDEX = re.compile(r"\.\d+(?=\.|$)")
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")


def _check_layer_count(path, raw: Dict[str, Any]) -> None:
    """A ``num_hidden_layers`` beyond the layers the weights hold is refused before a model is built: a count of
    a billion would otherwise build a billion modules (memory runs out long before any check of the weights)."""
    counts = [raw.get("num_hidden_layers")]
    if isinstance(raw.get("text_config"), dict):
        counts.append(raw["text_config"].get("num_hidden_layers"))
    counts = [c for c in counts if isinstance(c, int) and not isinstance(c, bool)]
    files = tensor_files(Path(path))
    if not counts or not files or not all(f.exists() for f in files):
        return  # nothing to compare (a missing shard is reported where the weights are read)
    held = -1
    for k in safetensors_index(files):
        m = _LAYER_INDEX.search(k)
        if m:
            held = max(held, int(m.group(1)))
    if held >= 0 and max(counts) > held + 1:
        raise CheckpointError(f"{Path(path) / 'config.json'} disagrees with the weights: num_hidden_layers "
                              f"{max(counts)}, but the checkpoint holds {held + 1} layers")


def check_weights_fit(path, model: nn.Module, files: List[Path],
                      headers: Optional[Dict[str, Tuple[Tuple[int, ...], Path]]] = None) -> None:
    """The checkpoint's own tensors are the truth ``config.json`` is checked against: raise ``CheckpointError``
    (one line) where the model the config describes gives a checkpoint tensor another shape, has no place for
    one (a layer or expert beyond its counts), needs one the checkpoint lacks (transformers would start it from
    random values), or ties two tensors the checkpoint holds as different ones. Headers, and one row of each tied
    tensor, are read. Names the model's loader renames (fused experts, legacy names) are left to it."""
    headers = safetensors_index(files) if headers is None else headers  # (given: ``files``' own, already read)
    ckpt = {k: shape for k, (shape, _) in headers.items()}
    model_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    prefix = getattr(model, "base_model_prefix", "") or ""

    def in_model(k: str):
        for name in (k, f"{prefix}.{k}" if prefix else None,
                     k[len(prefix) + 1:] if prefix and k.startswith(prefix + ".") else None):
            if name is not None and name in model_shapes:
                return name
        return None

    where = f"{Path(path) / 'config.json'} disagrees with the weights"
    placed = set()
    for k in sorted(ckpt, key=natural_key):
        shape, name = ckpt[k], in_model(k)
        if name is not None:
            placed.add(name)
            if model_shapes[name] != shape:
                raise CheckpointError(f"{where}: {k} is {list(shape)} in the checkpoint, {list(model_shapes[name])} "
                                      "in the model it describes (a size such as hidden_size, head_dim or vocab_size)")
    model_kinds = {_INDEX.sub(".*", k) for k in model_shapes}
    ckpt_kinds = {_INDEX.sub(".*", k) for k in ckpt} | {_INDEX.sub(".*", in_model(k) or k) for k in ckpt}
    lists = {name: len(m) for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))}
    for k in sorted(ckpt, key=natural_key):
        if in_model(k) is None and (_INDEX.sub(".*", k) in model_kinds or _beyond_a_list(k, lists, prefix)):
            raise CheckpointError(f"{where}: the checkpoint holds {k}, which the model it describes has no place for "
                                  "(a count such as num_hidden_layers is smaller than the weights')")
    _check_ties(where, model, headers, in_model)
    def spellings(k: str) -> List[str]:  # (the model's name as a checkpoint may hold it)
        return [k, *([f"{prefix}.{k}"] if prefix else []),
                *([k[len(prefix) + 1:]] if prefix and k.startswith(prefix + ".") else [])]

    def refuse_unheld(k: str) -> None:
        promised = unheld_index_entry(path, spellings(k))
        if promised is not None:
            raise CheckpointError(promised)

    for k in sorted(model_shapes, key=natural_key):
        if k not in placed and _INDEX.sub(".*", k) != k and _INDEX.sub(".*", k) in ckpt_kinds:
            refuse_unheld(k)
            raise CheckpointError(f"{where}: the model it describes needs {k}, which the checkpoint does not hold "
                                  "(a count such as num_hidden_layers is larger than the weights')")
    if _renames_weights(model):
        return  # fused experts and the like: the loader builds some parameters from differently named tensors
    tied = {n for names in _tie_groups(model).values() if any(m in placed for m in names) for n in names}
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name not in placed and name not in tied and not any(p.search(name) for p in ignored):
            refuse_unheld(name)
            raise CheckpointError(f"{where}: the model it describes has a parameter {name} that the checkpoint does "
                                  "not hold (it would start from random values; a bias or norm the config adds, or "
                                  "another architecture)")


def _tie_groups(model: nn.Module) -> Dict[int, List[str]]:
    """Parameter names by the parameter object they name (tied parameters share one)."""
    groups: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return groups


def _renames_weights(model: nn.Module) -> bool:
    """Whether transformers builds some of this model's parameters from tensors of other names (beyond its legacy
    renames): then a parameter with no tensor of its own name is not missing."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        return bool(get_model_conversion_mapping(model, add_legacy=False))
    except Exception:  # noqa: BLE001 - an older or newer transformers without it: assume renames
        return True


def _check_ties(where: str, model: nn.Module, headers: Dict[str, Tuple[Tuple[int, ...], Path]], in_model) -> None:
    """A config that ties parameters (``tie_word_embeddings``) over a checkpoint holding them as different tensors
    would silently drop one of them. One row of each is read: tied weights saved twice hold equal values."""
    from safetensors import safe_open

    groups = _tie_groups(model)
    held = {in_model(k): k for k in headers if in_model(k) is not None}
    for names in groups.values():
        keys = [held[n] for n in names if n in held]
        if len(keys) < 2:
            continue
        rows = []
        for k in keys[:2]:
            with safe_open(str(headers[k][1]), "pt") as fh:
                sl = fh.get_slice(k)
                rows.append(sl[0:1] if len(sl.get_shape()) else fh.get_tensor(k))
        if not torch.equal(rows[0], rows[1]):
            raise CheckpointError(f"{where}: it ties {keys[1]} to {keys[0]} (tie_word_embeddings), but the checkpoint "
                                  "holds them as different tensors: one would be dropped")


def _beyond_a_list(key: str, lists: Dict[str, int], prefix: str) -> bool:
    """Whether ``key`` sits at an index past the end of one of the model's module lists (``model.layers.3.*`` where
    the model has 2 layers, or none)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and i:
            owner = ".".join(parts[:i])
            for name in (owner, f"{prefix}.{owner}" if prefix else None,
                         owner[len(prefix) + 1:] if prefix and owner.startswith(prefix + ".") else None):
                if name in lists and int(part) >= lists[name]:
                    return True
    return False


def natural_key(name: str):
    """A dotted name's sort key with its numbers as numbers (layers.2 before layers.10)."""
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def meta_skeleton(path, trust_remote_code: bool = False) -> nn.Module:
    """The model class of a Hugging Face directory (``config.architectures``, else ``AutoModel``) built on the meta
    device: module names, types and tied parameters, no memory and no weights read."""
    model = _checked_skeleton(path, trust_remote_code)
    _linearize(path, model)
    return model


def _checked_skeleton(path, trust_remote_code: bool) -> nn.Module:
    """:func:`meta_skeleton` before its experts are linearized: ``config.json`` checked against the weights."""
    transformers = _transformers(path)
    config = _config(path, trust_remote_code)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    try:
        with torch.device("meta"), never_asks():
            model = cls._from_config(config) if cls is not None else \
                _auto_class(transformers, config).from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types for configs it cannot build
        if trust_remote_code and "trust_remote_code" in str(e):  # (never_asks' refusal, the flag given)
            raise CheckpointError(f"{path}: transformers cannot build this model's modules: its own code for "
                                  f"{(archs or ['this class'])[0][:60]} builds a part of the model without "
                                  "trust_remote_code (a sequence classifier's backbone, by AutoModel), which "
                                  "--trust-remote-code does not reach: a limit of transformers") from None
        raise CheckpointError(
            f"{path}: transformers cannot build this model's modules ({str(e).splitlines()[0]})") from None
    headers = _check_fit_if_weights(path, model)
    if cls is None and headers is not None:  # (no architectures, or one this transformers lacks: the bare model)
        _check_no_head_left_out(path, config, model, headers, archs[0] if archs else None)
    return model


def _auto_class(transformers, config):
    """The Auto class that builds ``architectures[0]`` where it is not one of transformers' own classes
    (:func:`auto_class_for`)."""
    return auto_class_for(transformers, getattr(config, "architectures", None), getattr(config, "auto_map", None))


def auto_class_for(transformers, archs, auto_map):
    """The Auto class whose ``auto_map`` entry names ``archs[0]`` (remote code's ``"AutoModelForCausalLM":
    "modeling_x.XForCausalLM"``), else ``AutoModel``, the bare model (which :func:`_check_no_head_left_out` then
    checks against the weights)."""
    if isinstance(archs, list) and archs and isinstance(archs[0], str) and isinstance(auto_map, dict):
        # a head's Auto class before the bare model's, where both name the class (InternLM2 maps AutoModel and
        # AutoModelForCausalLM to it): the class is built by what it is, not by the order of the keys
        named = sorted((auto == "AutoModel", auto != "AutoModelForCausalLM", auto) for auto, ref in auto_map.items()
                       if isinstance(ref, str) and ref.rpartition(".")[2] == archs[0] and auto.startswith("AutoModel")
                       and isinstance(getattr(transformers, auto, None), type))
        if named:
            return getattr(transformers, named[0][2])
    return transformers.AutoModel


def _check_no_head_left_out(path, config, model: nn.Module, headers, arch=None) -> None:
    """A config.json naming no ``architectures`` builds transformers' bare ``AutoModel`` (LlamaModel), which drops a
    head the weights hold (``lm_head.weight``) without a word: the plan, the text windows and the export then
    follow an encoder's rules. Refused, naming the class to add (``headers``: the checkpoint's, as read)."""
    names, prefix = set(model.state_dict()), getattr(model, "base_model_prefix", "") or ""
    # a head: a weight outside the backbone (not a buffer a checkpoint may carry, such as position_ids)
    left = [k for k in headers if k.endswith((".weight", ".bias")) and k not in names
            and f"{prefix}.{k}" not in names and not (prefix and k.startswith(prefix + "."))]
    if left:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
        guess = f'"architectures": ["{causal}"]' if causal and left[0].startswith("lm_head.") else \
            '"architectures" with the class the weights are for'
        why = "names no architectures," if arch is None else \
            f"names architectures[0] {str(arch)[:60]}, which this transformers does not have,"
        raise CheckpointError(f"{Path(path) / 'config.json'}: {why} so transformers builds a "
                              f"{type(model).__name__}, which has no place for the checkpoint's {left[0]}"
                              f"{f' (and {len(left) - 1} more)' if len(left) > 1 else ''}: add {guess}")


def _linearize(path, model: nn.Module) -> None:
    """Fused mixture-of-experts modules as one Linear per expert (``qtool.model.experts``), named as the
    checkpoint names the experts' tensors (headers only are read)."""
    files = [f for f in tensor_files(Path(path)) if f.exists()]
    if files:
        linearize_experts(model, safetensors_index(files))


def _check_fit_if_weights(path, model: nn.Module) -> Optional[Dict[str, Tuple[Tuple[int, ...], Path]]]:
    """:func:`check_weights_fit` where there are weights (a missing file is refused here, before any plan); returns
    the headers it read (None where it read none)."""
    files = tensor_files(Path(path))
    if not files:
        return None
    check_files_there(path, files)
    headers = safetensors_index(files)
    check_index_places(path, headers)
    _refuse_scaled_codes(headers)
    check_weights_fit(path, model, files, headers)
    return headers


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside have their parameters on the meta device (no memory, no initialization: a parameter
    goes there as it is registered, before ``__init__`` initializes it) and their buffers for real: the values
    ``__init__`` computes from the config and no checkpoint holds (rotary frequencies, Gemma's embedding scale)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def meta_causal_lm(path, trust_remote_code: bool = False) -> Tuple[nn.Module, Any, Any]:
    """``(causal LM with its parameters on the meta device, config, tokenizer)``; its buffers are real (they come
    from the config, not from the checkpoint)."""
    transformers = _transformers(path)
    config = _config(path, trust_remote_code)
    config.use_cache = False
    archs = getattr(config, "architectures", None) or []
    if archs and _bare_backbone(transformers, archs[0]):
        # an encoder such as BertModel: AutoModelForCausalLM would add a head its checkpoint does not hold
        raise CheckpointError(f"{path}: --sequential runs a causal language model block by block, and config.json "
                              f"says this is a {archs[0][:60]} (no language-model head): run without --sequential")
    if getattr(config, "is_encoder_decoder", False):
        # (BART's config also builds a BartForCausalLM: its decoder alone, which the checkpoint's names do not fit)
        raise CheckpointError(f"{path}: --sequential runs a causal language model block by block, and config.json "
                              f"says this is an encoder-decoder ({(archs or [config.model_type])[0][:60]}): run "
                              "without --sequential")
    # architectures[0] one of transformers' own causal LMs beside an auto_map naming it (Kimi K2's, Phi-3's
    # repositories): its own class, as the whole-model loaders build it, not the repository's code that
    # AutoModelForCausalLM would run under --trust-remote-code (the two runs gave other encodings)
    own = getattr(transformers, archs[0], None) if archs and getattr(config, "auto_map", None) else None
    own = own if isinstance(own, type) and archs[0] in _causal_lm_classes() else None
    try:
        with _parameters_on_meta(), never_asks():
            model = own._from_config(config, **_float32(transformers)) if own is not None else \
                transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code,
                                                              **_float32(transformers))
    except Exception as e:
        if "Unrecognized configuration class" in str(e) and (hasattr(config, "text_config")
                                                                or hasattr(config, "vision_config")):  # (Idefics3)
            raise CheckpointError(f"{path}: --sequential builds a multimodal model's text decoder through "
                                  f"transformers' AutoModelForCausalLM, which has no class for this one "
                                  f"({(archs or [config.model_type])[0][:60]}): run without --sequential") from None
        raise CheckpointError(f"{path}: not a causal language model transformers can build "
                              f"({str(e).splitlines()[0]})") from None
    _check_fit_if_weights(path, model)
    _linearize(path, model)
    tokenizer = _tokenizer(transformers, path, trust_remote_code)
    model.eval()
    return model, config, tokenizer


def _causal_lm_classes() -> set:
    """transformers' own causal LM class names (its AutoModelForCausalLM mapping's)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


_OTHER_HEADS = ("Model", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMaskedLM")


def _bare_backbone(transformers, arch: str) -> bool:
    """Whether ``arch`` (config.json's ``architectures[0]``) is one of transformers' own classes without a
    language-model head (``BertModel``, ``LlamaForSequenceClassification``); remote-code classes (ChatGLM names its
    causal LM ``ChatGLMModel``) are not judged by their name."""
    return (arch.endswith(_OTHER_HEADS) and getattr(transformers, arch, None) is not None
            and arch not in _causal_lm_classes())


def load_hf(path: Path, trust_remote_code: bool):
    """``(model, tokenizer or None, config)`` of a Hugging Face directory, float32 on the CPU."""
    transformers = _transformers(path)
    check_files_there(path, tensor_files(path))
    for f in tensor_files(path):
        check_safetensors(f)
    if not tensor_files(path):
        raise no_safetensors(path)
    _checked_skeleton(path, trust_remote_code)  # config.json checked against the weights' headers before any is read
    config = _config(path, trust_remote_code)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        cls = _auto_class(transformers, config)
    bars = transformers.utils.logging
    shown = bars.is_progress_bar_enabled()
    bars.disable_progress_bar()  # (its "Loading weights" bar: the library never prints; the caller's setting after)
    try:
        with never_asks():
            model = cls.from_pretrained(str(path), config=config, trust_remote_code=trust_remote_code,
                                        low_cpu_mem_usage=True, **_float32(transformers))
    except Exception as e:  # transformers raises many types for bad weights
        raise CheckpointError(f"{path}: transformers could not load the model: {str(e).splitlines()[0]}") from None
    finally:
        if shown:
            with warnings.catch_warnings():  # (the Hub's "cannot enable" where its variable says no: no print)
                warnings.simplefilter("ignore")
                bars.enable_progress_bar()
    _linearize(path, model)
    return model, _tokenizer(transformers, path, trust_remote_code), config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")


class TokenizerError(CheckpointError, AttributeError):
    """A checkpoint's tokenizer that transformers could not load, met where it is used (an AttributeError too, so
    that ``getattr(tokenizer, name, default)`` still answers the default)."""


class UnreadableTokenizer:
    """Stands for a tokenizer whose files are there but do not load: tensor data needs none, so nothing fails
    until it is used, and then with why (text data said "this checkpoint has none")."""

    def __init__(self, reason: str):
        self.reason = reason

    def __getattr__(self, name):
        if name.startswith("__") or name == "reason":  # (copy and pickle probe these on a bare instance)
            raise AttributeError(name)
        raise TokenizerError(self.reason)

    def __call__(self, *args, **kwargs):
        raise TokenizerError(self.reason)


def tokenizer_of(path, trust_remote_code: bool = False) -> Any:
    """A Hugging Face directory's tokenizer, without its model (:func:`_tokenizer`)."""
    return _tokenizer(_transformers(path), Path(path), trust_remote_code)


def _tokenizer(transformers, path: Path, trust_remote_code: bool = False):
    """The checkpoint's tokenizer; None where it has none; an :class:`UnreadableTokenizer` where its files do not
    load. ``trust_remote_code`` always given: left out, transformers asks on stdin whether to run a remote-code
    model's code (reading its config), and its question lands in stdout's JSON."""
    try:
        with never_asks():
            return transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:
        files = [f for f in TOKENIZER_FILES if (Path(path) / f).is_file()]
        if not files:
            return None
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not trust_remote_code and "trust_remote_code" in str(e):  # (tokenizer_config.json's auto_map)
            return UnreadableTokenizer(f"{Path(path) / 'tokenizer_config.json'}: the tokenizer needs its own Python "
                                       "code; pass --trust-remote-code if you trust its source")
        return UnreadableTokenizer(f"{Path(path) / files[0]}: the checkpoint's tokenizer cannot be loaded "
                                   f"({reason[:200]})")


def hf_name_map(model: nn.Module, files: List[Path]) -> Dict[str, str]:
    """Map checkpoint tensor names to the model's state_dict names where they differ: a base-model prefix, a
    linearized expert's checkpoint tensor, a tensor transformers renames at load time."""
    from safetensors import safe_open

    from .checkpoint_map import checkpoint_names

    names = set(model.state_dict())
    prefix = getattr(model, "base_model_prefix", "") or ""
    keys: List[str] = []
    for f in files:
        with safe_open(str(f), "pt") as fh:
            keys += list(fh.keys())
    out = {k: n for k, n in checkpoint_names(model, keys).items() if k not in names and n in names}
    for k in keys:
        if k in names or k in out:
            continue
        if prefix and f"{prefix}.{k}" in names:
            out[k] = f"{prefix}.{k}"
        elif prefix and k.startswith(prefix + ".") and k[len(prefix) + 1:] in names:
            out[k] = k[len(prefix) + 1:]
    return out
