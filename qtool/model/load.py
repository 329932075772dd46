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

import importlib
import json
import pickle
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..errors import CheckpointError, UsageError
from .hf import hf_name_map, load_hf
from ..io.checkpoint import (CheckpointTensors, check_safetensors, detect_kind, read_state_dict, tensor_files,
                             torch_load_safe)

__all__ = ["LoadedModel", "load_model", "detect_kind", "resolve_device", "tensor_files", "read_state_dict"]


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
        return self.kind == "hf" and type(self.model).__name__.endswith("ForCausalLM")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"--device must be cpu, cuda or auto (got {device!r})")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to this torch build")
    return torch.device(device)


_FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _import_factory(spec: str):
    if not _FACTORY.fullmatch(spec):
        raise UsageError(f"--model-class must look like 'package.module:callable' (got {spec[:200]!r})")
    mod_name, attr = spec.split(":", 1)
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # let users point at a module in the working directory
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"--model-class {spec}: cannot import {mod_name!r}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"--model-class {spec}: {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise UsageError(f"--model-class {spec}: {attr!r} is not callable")
    return obj


def _build(spec: str) -> nn.Module:
    factory = _import_factory(spec)
    try:
        model = factory()
    except TypeError as e:  # a class or function that needs arguments (other failures keep their traceback)
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise UsageError(f"--model-class {spec}: calling it with no arguments failed ({type(e).__name__}: {first}); "
                         "point it at a function that builds the model") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model-class {spec}: returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _build_loaded(spec: str, state: Dict[str, torch.Tensor], path: Path) -> nn.Module:
    """``spec``'s model holding ``state``. The factory runs with its parameters made on the meta device
    (:func:`_meta_parameters`), so no random initialisation is run and no memory kept for weights the
    checkpoint replaces (seconds and a second copy of a large model); where a tensor is still on the meta device
    after loading (the factory derived one from a parameter's values), or two names share one parameter (loading by
    assignment would untie them), the factory runs again as written and the checkpoint is copied in."""
    model = _meta_parameters(spec)
    if model is not None:
        expected = model.state_dict()
        _check_state(expected, state, path)
        # load_state_dict copies into the model's own dtype; assign=True takes the tensor as it is, so cast first
        model.load_state_dict({k: state[k].to(v.dtype) for k, v in expected.items()}, strict=True, assign=True)
        if not _holds_meta(model):
            return model
    model = _build(spec)
    _load_state_into(model, state, path)
    return model


def _meta_parameters(spec: str) -> Optional[nn.Module]:
    """The factory's model with every parameter it registers moved to the meta device as it is registered (so
    initialising it computes nothing), buffers and every other tensor made as the factory makes them (accelerate's
    ``init_empty_weights`` does the same); None when that fails or leaves a parameter real or shared."""
    factory = _import_factory(spec)
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if isinstance(param, nn.Parameter) and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        model = factory()
    except Exception:  # (the factory runs again as written, and fails there with its own error)
        return None
    finally:
        nn.Module.register_parameter = register
    if not isinstance(model, nn.Module):
        return None
    named = list(model.named_parameters(remove_duplicate=False))
    if len({id(p) for _, p in named}) != len(named) or not all(p.is_meta for _, p in named):
        return None
    return model


def _holds_meta(model: nn.Module) -> bool:
    """Whether any parameter, buffer or tensor attribute of ``model``'s modules is on the meta device."""
    for module in model.modules():
        for name, value in vars(module).items():
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in values):
                return True
    return False


def _check_state(expected: Dict[str, torch.Tensor], state: Dict[str, torch.Tensor], path: Path) -> None:
    """One clear error for a checkpoint whose tensors do not fit the model (names, shapes, float-ness)."""
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


def _load_state_into(model: nn.Module, state: Dict[str, torch.Tensor], path: Path) -> None:
    _check_state(model.state_dict(), state, path)
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
        raise CheckpointError(f"{path}: checkpoint not found")
    dev = resolve_device(device)
    kind = detect_kind(path)
    tokenizer = config = None
    name_map: Dict[str, str] = {}
    files = [path]
    if kind == "hf":
        model, tokenizer, config = load_hf(path, trust_remote_code)
        files = tensor_files(path)
        name_map = hf_name_map(model, files)
    elif kind == "pt2":
        try:
            model = torch.export.load(str(path)).module()
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read torch.export archive: {str(e).splitlines()[0]}") from None
        from .insert import exported_module_types

        model.qtool_module_types = exported_module_types(model)
    elif kind == "state_dict":
        if model_class is None:
            raise UsageError(f"{path}: a state dict needs --model-class module:callable to build the model")
        model = _build_loaded(model_class, read_state_dict(path), path)
    else:  # .pt / .pth
        try:
            obj = torch_load_safe(path)
        except CheckpointError:
            if not trust_pickle:
                raise
            obj = torch.load(str(path), map_location="cpu", weights_only=False)
        if isinstance(obj, nn.Module):
            model, kind = obj, "pickle"
        elif isinstance(obj, dict):
            if model_class is None:
                raise UsageError(f"{path}: a state dict needs --model-class module:callable to build the model")
            model = _build_loaded(model_class, read_state_dict(path) if not trust_pickle else obj, path)
            kind = "state_dict"
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


