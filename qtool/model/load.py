"""Checkpoint loading, safe by default.

Kinds of checkpoint (``detect_kind``):

* ``hf``: a Hugging Face model directory (``config.json`` + ``*.safetensors``), through ``transformers``
  (optional extra ``qtool[hf]``); remote code only with ``trust_remote_code=True``.
* ``pt2``: a ``torch.export`` archive.
* ``state_dict``: ``.safetensors`` or ``.pt``/``.pth`` (read with ``weights_only=True``) plus a
  ``model_class="module:callable"`` that builds the model.
* ``pickle``: a fully pickled module in ``.pt``/``.pth``; loaded only with ``trust_pickle=True``.
"""

from __future__ import annotations

import functools
import importlib
import json
import pickle
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..errors import CheckpointError, UsageError
from .hf import hf_name_map, load_hf
from ..io.checkpoint import (CheckpointTensors, check_safetensors, detect_kind, load_exported, load_pickle,
                             not_found, plain_state_dict, read_state_dict, tensor_files, torch_load_safe,
                             working_directory_importable)

__all__ = ["LoadedModel", "load_model", "detect_kind", "resolve_device", "tensor_files", "read_state_dict",
           "refuse_non_finite_reference"]


@dataclass
class LoadedModel:
    model: nn.Module
    kind: str
    path: Path
    files: List[Path] = field(default_factory=list)  # the files whose bytes define the weights
    tokenizer: Any = None
    config: Any = None
    # checkpoint tensor name -> model state_dict name, where they differ (HF prefixes)
    name_map: Dict[str, str] = field(default_factory=dict)

    @property
    def is_causal_lm(self) -> bool:
        """The one rule every job uses (calibration packs text for it, report and eval score next tokens, the
        search ranks by text loss): a Hugging Face directory whose class is a causal LM."""
        return self.kind == "hf" and causal_lm_class(self.model)


def causal_lm_class(model) -> bool:
    """Whether ``model`` is a Hugging Face causal LM class (``...ForCausalLM``, or a multimodal decoder such as
    Gemma 3's ``...ForConditionalGeneration``, which scores text alone as one; an encoder-decoder such as T5 or
    Whisper is not): for a model with no checkpoint kind yet (a meta-device skeleton, which is always a Hugging
    Face one); a loaded model asks :attr:`LoadedModel.is_causal_lm`."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if name.endswith("ForCausalLM") and getattr(config, "model_type", None) in _ENCODER_TYPES:
        return bool(getattr(config, "is_decoder", False))  # (RobertaForCausalLM attends both ways unless a decoder)
    if name.endswith("ForCausalLM") or name in _CAUSAL_LM_HEADS:
        return True
    if name in _causal_lm_names() and getattr(config, "is_decoder", False):  # (BertLMHeadModel as a decoder)
        return True
    return (name.endswith("ForConditionalGeneration") and config is not None
            and not getattr(config, "is_encoder_decoder", False) and hasattr(config, "text_config"))


# causal LMs whose class is not named ...ForCausalLM (GPT-2's was read as another kind of model: eval and report gave
# it an output cosine instead of perplexity and refused its gates)
_CAUSAL_LM_HEADS = frozenset({"GPT2LMHeadModel", "OpenAIGPTLMHeadModel", "CTRLLMHeadModel"})
# encoders whose ...ForCausalLM attends to later tokens too unless built as a decoder (config.is_decoder)
_ENCODER_TYPES = frozenset({"bert", "roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl", "camembert",
                            "electra", "big_bird", "ernie", "data2vec-text", "rembert", "roc_bert", "megatron-bert",
                            "xmod", "roformer", "bert-generation"})


@functools.lru_cache(maxsize=1)
def _causal_lm_names() -> frozenset:
    """The other classes transformers' causal LM mapping lists, which are causal only as decoders (``is_decoder``:
    BERT's ``BertLMHeadModel``); XLM's and XLNet's masked or permuted LMs never are."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return frozenset()
    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(value if isinstance(value, (tuple, list)) else (value,))
    return frozenset(names) - {"XLMWithLMHeadModel", "XLNetLMHeadModel"}  # (masked and permuted LMs)


def decoder_stack(model) -> Optional[Tuple[str, nn.Module]]:
    """``(name, module)`` of the text decoder whose ``layers`` (a non-empty ``ModuleList``) and ``norm`` a causal
    LM runs: ``model.model``, or a multimodal model's ``model.model.language_model``; None for other models."""
    inner = getattr(model, "model", None)
    for name, stack in (("model", inner), ("model.language_model", getattr(inner, "language_model", None))):
        layers = getattr(stack, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return name, stack
    return None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"device must be cpu, cuda, cuda:N or auto (got {str(device)[:40]!r})")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA device is available to this torch build")
    if device.startswith("cuda:") and device[5:].isdigit() and int(device[5:]) >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise UsageError(f"--device {device}: this machine has {n} CUDA device(s) (cuda:0 to cuda:{n - 1})")
    return torch.device(device)


_FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _import_factory(spec: str):
    if not _FACTORY.fullmatch(spec):
        raise UsageError(f"--model-class must look like 'package.module:callable' (got {spec[:200]!r})")
    mod_name, attr = spec.split(":", 1)
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"--model-class {spec}: cannot import {mod_name!r}: {e}") from None
    except (Exception, SystemExit) as e:  # the user's module failed (or exited) while importing: its fault, named
        raise UsageError(f"--model-class {spec}: importing {mod_name!r} {_failure(e)}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"--model-class {spec}: {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise UsageError(f"--model-class {spec}: {attr!r} is not callable")
    return obj


def _failure(e: BaseException) -> str:
    """How user code under --model-class failed, in words (a sys.exit is a failure too: nothing was built)."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return f"failed: {type(e).__name__}" + (f": {first}" if first else "")


def _build(spec: str) -> nn.Module:
    with working_directory_importable():  # (users point at a module in the working directory)
        return _checked_module(spec, _import_factory(spec))


def _called(factory):
    """``factory()`` with what it prints sent to stderr: stdout holds the command's one JSON object (--json)."""
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):
        return factory()


def _checked_module(spec: str, factory) -> nn.Module:
    try:
        model = _called(factory)
    except TypeError as e:  # a class or function that needs arguments
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise UsageError(f"--model-class {spec}: calling it with no arguments failed ({type(e).__name__}: {first}); "
                         "point it at a function that builds the model") from None
    except (Exception, SystemExit) as e:  # user code failing, or exiting, is its fault: one line naming the flag
        raise UsageError(f"--model-class {spec}: building the model {_failure(e)}"
                         + (" instead of returning a module" if isinstance(e, SystemExit) else "")) from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model-class {spec}: returned {type(model).__name__}, not a torch.nn.Module")
    wrapped = getattr(model, "_orig_mod", None) if type(model).__name__ == "OptimizedModule" else (
        getattr(model, "module", None) if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel))
        else None)
    if isinstance(wrapped, nn.Module):  # (its state dict's keys gain _orig_mod. / module.: "checkpoint is missing")
        raise UsageError(f"--model-class {spec}: returned a wrapper ({type(model).__name__}) around the model; "
                         "return the model itself (qtool inserts its quantizers into the module's own layers)")
    meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None:  # (load_state_dict into meta tensors does nothing, and .to() then fails inside torch)
        raise UsageError(f"--model-class {spec}: the model it built holds {meta!r} on the meta device, which no "
                         "weight can be loaded into; build it with real tensors (on the CPU)")
    return model


def _inputs_by_name(model: nn.Module, program) -> None:
    """An archive exported with positional example inputs (``torch.export.export(m, (x, y))``, torch's usual way)
    takes no keywords, while a data file's arrays come as keywords (named as saved, or ``arr_0``, ``arr_1`` by
    NumPy): every batch was "the model rejected the data: kwarg keyword mismatch". Keywords named as its inputs (or
    numbered as NumPy names unnamed arrays) are passed in their place."""
    from torch.export.graph_signature import InputKind

    args_spec, kwargs_spec = program.call_spec.in_spec.children()
    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if kwargs_spec.num_children or args_spec.num_children != len(names) or len(names) < 2:
        return  # (keyword inputs, nested inputs, or one input, which a one-tensor file passes by position)
    numbered = [f"arr_{i}" for i in range(len(names))]

    def by_name(module, args, kwargs):
        if args or not kwargs:
            return None
        for order in (names, numbered):
            if set(kwargs) == set(order):
                return tuple(kwargs[n] for n in order), {}
        return None

    model.register_forward_pre_hook(by_name, with_kwargs=True, prepend=True)  # (before its own input check)


def factory_skeleton(spec: str) -> nn.Module:
    """The model ``--model-class`` builds, built on the meta device where the factory allows (names, types and shapes,
    no memory), else as it builds it."""
    with working_directory_importable():
        factory = _import_factory(spec)
        try:
            with torch.device("meta"):
                model = _called(factory)
            if isinstance(model, nn.Module):
                return model
        except (Exception, SystemExit):  # (a factory that cannot build on meta: built as the load builds it)
            pass
        return _checked_module(spec, factory)


def _split_fused_experts(model: nn.Module, keys) -> None:
    """transformers' fused experts (3-D parameters) of a model a factory built, split into one ``nn.Linear`` per
    expert and projection as :func:`load_hf` splits a directory's: left fused, they stayed float (a recipe targets
    Linear layers) and ``ignore`` could not name them."""
    from .experts import fused_layout, linearize_experts

    if any(fused_layout(m) is not None for m in model.modules()):
        linearize_experts(model, keys)


def _tied_filled(model: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``state`` with a parameter the model holds under several names (a tied output layer) under each of them,
    where it is stored under one (safetensors' save_model keeps one)."""
    names: Dict[int, List[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    filled = dict(state)
    for group in names.values():
        stored = next((n for n in group if n in state), None)
        if stored is None:
            continue
        for n in group:
            filled.setdefault(n, state[stored])
    return filled


def _load_state_into(model: nn.Module, state: Dict[str, torch.Tensor], path: Path) -> None:
    expected = model.state_dict()
    state = _tied_filled(model, state)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: checkpoint is missing tensor {missing[0]!r} that the model needs{more}")
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{path}: checkpoint has tensor {unexpected[0]!r} that the model does not{more}")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"{path}: tensor {k!r} has shape {list(state[k].shape)}, the model expects {list(v.shape)}"
            )
        if v.is_floating_point() and not state[k].is_floating_point():
            raise CheckpointError(  # (an already-quantized checkpoint's packed integers, most likely)
                f"{path}: tensor {k!r} is {str(state[k].dtype).replace('torch.', '')}, the model expects floats "
                f"({str(v.dtype).replace('torch.', '')}); qtool quantizes float checkpoints")
    model.load_state_dict(state, strict=True)


def load_model(
    checkpoint: str | Path,
    model_class: Optional[str] = None,
    device: str = "cpu",
    trust_pickle: bool = False,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load any supported checkpoint into an eval-mode float module on ``device``."""
    path = Path(checkpoint)
    if not path.exists():
        raise not_found(path)
    dev = resolve_device(device)
    kind = detect_kind(path)
    tokenizer = config = None
    name_map: Dict[str, str] = {}
    files = [path]
    check_model_class(path, model_class, kind)
    if kind == "hf":
        model, tokenizer, config = load_hf(path, trust_remote_code)
        files = tensor_files(path)
        name_map = hf_name_map(model, files)
    elif kind == "pt2":
        program = load_exported(path)
        model = program.module()
        _inputs_by_name(model, program)
        from .insert import exported_module_types

        model.qtool_module_types = exported_module_types(model)
    elif kind == "state_dict":
        if model_class is None:
            raise UsageError(f"{path}: a state dict needs --model-class module:callable to build the model")
        model = _build(model_class)
        state = read_state_dict(path)
        _load_state_into(model, state, path)
        _split_fused_experts(model, state)
    else:  # .pt / .pth
        try:
            obj = torch_load_safe(path)
        except CheckpointError:
            if not trust_pickle:
                raise
            obj = load_pickle(path)
        if isinstance(obj, nn.Module):
            check_model_class(path, model_class, "pickle")
            model, kind = obj, "pickle"
        elif isinstance(obj, dict):
            if model_class is None:
                raise UsageError(f"{path}: a state dict needs --model-class module:callable to build the model")
            model = _build(model_class)
            kind = "state_dict"
            state = plain_state_dict(obj, path)
            _load_state_into(model, state, path)
            _split_fused_experts(model, state)
        else:
            raise CheckpointError(f"{path}: expected a state dict or a module, found {type(obj).__name__}")
    model = model.to(dev)
    try:
        model.eval()
    except NotImplementedError:  # torch.export modules fix train/eval behaviour at export time
        pass
    for p in model.parameters():
        p.requires_grad_(False)
    return LoadedModel(model, kind, path, files, tokenizer, config, name_map)


def check_model_class(path: Path, model_class: Optional[str], kind: Optional[str] = None) -> None:
    """Refuse ``model_class`` (--model-class builds a state dict's model) on a checkpoint that names its own model,
    where it did nothing, silently (the manifest recorded it as if it had). ``kind``: the checkpoint's, if known."""
    kind = kind or (detect_kind(path) if model_class is not None and path.exists() else None)
    if model_class is None or kind not in ("hf", "pt2", "pickle"):
        return
    own = {"hf": "a Hugging Face directory (its config.json names the model's class)",
           "pt2": "a torch.export archive (it holds its own module)", "pickle": "a pickled module (it is the model)"}
    raise UsageError(f"{path}: --model-class builds the model of a state dict; this is {own[kind]}: leave "
                     "--model-class out")


def refuse_non_finite_reference(model: nn.Module, checkpoint: str) -> None:
    """``CheckpointError`` where a parameter of the float model holds NaN or infinity: its outputs would be NaN, so
    every figure measured against it (and so every gate) is meaningless (report's and eval's reference)."""
    from ..io.finite import all_finite

    bad = next((n for n, p in model.named_parameters() if not all_finite(p.detach())), None)
    if bad is not None:
        raise CheckpointError(f"{checkpoint}: {bad} holds NaN or infinity, so the float model is no reference to "
                              "measure against")
