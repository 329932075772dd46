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
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..errors import CheckpointError, UsageError

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


def detect_kind(path: Path) -> str:
    if path.is_dir():
        if (path / "config.json").exists():
            return "hf"
        raise CheckpointError(f"{path}: a directory checkpoint needs config.json (a Hugging Face model directory)")
    suffix = path.suffix.lower()
    if suffix == ".pt2":
        return "pt2"
    if suffix == ".safetensors":
        return "state_dict"
    if suffix in (".pt", ".pth", ".bin"):
        return "torch"
    raise CheckpointError(
        f"{path}: unknown checkpoint type {suffix or '(no suffix)'}; expected a Hugging Face directory, .pt2, "
        ".safetensors, .pt or .pth"
    )


def tensor_files(path: Path) -> List[Path]:
    """The safetensors files of a checkpoint (sharded HF directories included), in a stable order."""
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            return [path / f for f in sorted(set(weight_map.values()))]
        return sorted(path.glob("*.safetensors"))
    return [path]


def _check_safetensors(file: Path) -> None:
    """Fail with one clear line on a truncated or corrupt safetensors file, before anything uses it."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{file}: truncated or corrupt safetensors file (header of {n} bytes, file has {size})")
            header = json.loads(f.read(n))
    except CheckpointError:
        raise
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise CheckpointError(f"{file}: corrupt safetensors header (bad tensor entries)") from None
    if 8 + n + end > size:
        raise CheckpointError(f"{file}: truncated safetensors file (needs {8 + n + end} bytes, has {size})")


def read_state_dict(path: Path) -> Dict[str, torch.Tensor]:
    """All tensors of a single-file state dict (safetensors, or weights-only torch)."""
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file

        _check_safetensors(path)
        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read safetensors file: {e}") from None
    obj = _torch_load_safe(path)
    if isinstance(obj, nn.Module):  # pragma: no cover - weights_only never returns a module
        return obj.state_dict()
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a state dict (name -> tensor), found {type(obj).__name__}")
    if "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: entry {bad[0]!r} is not a tensor; expected a plain state dict")
    return obj


def _torch_load_safe(path: Path):
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError) as e:
        text = str(e)
        if "Weights only load failed" in text or "weights_only" in text or isinstance(e, pickle.UnpicklingError):
            raise CheckpointError(
                f"{path}: this file holds pickled Python objects (a whole module?), which can run code when "
                "loaded; pass --trust-pickle only if you trust its source, or save model.state_dict() instead"
            ) from None
        raise CheckpointError(f"{path}: cannot read torch checkpoint: {text.splitlines()[0]}") from None
    except (EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read torch checkpoint (truncated or corrupt?): {e}") from None


def _import_factory(spec: str):
    if ":" not in spec:
        raise UsageError(f"--model-class must look like 'package.module:callable' (got {spec!r})")
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
    model = _import_factory(spec)()
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model-class {spec}: returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _load_state_into(model: nn.Module, state: Dict[str, torch.Tensor], path: Path) -> None:
    expected = model.state_dict()
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
    model.load_state_dict(state, strict=True)


def _load_hf(path: Path, trust_remote_code: bool):
    try:
        import transformers
    except ImportError:
        raise UsageError(
            f"{path}: Hugging Face checkpoints need transformers: pip install 'qtool[hf]'"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # the library never draws on the user's terminal
    transformers.utils.logging.set_verbosity_error()
    for f in tensor_files(path):
        if not f.exists():
            raise CheckpointError(f"{path}: shard {f.name} named in model.safetensors.index.json is missing")
        _check_safetensors(f)
    if not tensor_files(path):
        raise CheckpointError(f"{path}: no *.safetensors weights in this directory")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except ValueError as e:
        msg = str(e).splitlines()[0]
        if "trust_remote_code" in str(e):
            msg = "this model needs its own Python code; pass --trust-remote-code if you trust its source"
        raise CheckpointError(f"{path}: {msg}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read config.json: {str(e).splitlines()[0]}") from None
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        cls = transformers.AutoModel
    try:
        model = cls.from_pretrained(
            str(path), config=config, trust_remote_code=trust_remote_code, torch_dtype=torch.float32,
            low_cpu_mem_usage=True,
        )
    except Exception as e:  # transformers raises many types for bad weights
        raise CheckpointError(f"{path}: transformers could not load the model: {str(e).splitlines()[0]}") from None
    tokenizer = None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception:  # a model without a tokenizer is fine for tensor data
        tokenizer = None
    return model, tokenizer, config


def hf_name_map(model: nn.Module, files: List[Path]) -> Dict[str, str]:
    """Map checkpoint tensor names to the model's state_dict names where a base-model prefix differs."""
    from safetensors import safe_open

    names = set(model.state_dict())
    prefix = getattr(model, "base_model_prefix", "") or ""
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k in names:
                    continue
                if prefix and f"{prefix}.{k}" in names:
                    out[k] = f"{prefix}.{k}"
                elif prefix and k.startswith(prefix + ".") and k[len(prefix) + 1:] in names:
                    out[k] = k[len(prefix) + 1:]
    return out


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
        model, tokenizer, config = _load_hf(path, trust_remote_code)
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
        model = _build(model_class)
        _load_state_into(model, read_state_dict(path), path)
    else:  # .pt / .pth
        try:
            obj = _torch_load_safe(path)
        except CheckpointError:
            if not trust_pickle:
                raise
            obj = torch.load(str(path), map_location="cpu", weights_only=False)
        if isinstance(obj, nn.Module):
            model, kind = obj, "pickle"
        elif isinstance(obj, dict):
            if model_class is None:
                raise UsageError(f"{path}: a state dict needs --model-class module:callable to build the model")
            model = _build(model_class)
            kind = "state_dict"
            _load_state_into(model, read_state_dict(path) if not trust_pickle else obj, path)
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


class CheckpointTensors:
    """Read-only, one-tensor-at-a-time access to a checkpoint's tensors (no model is built)."""

    def __init__(self, path: Path, trust_pickle: bool = False):
        self.path = Path(path)
        kind = detect_kind(self.path)
        self._files: Dict[str, Path] = {}
        self._memory: Dict[str, torch.Tensor] = {}
        if kind == "hf" or (kind == "state_dict" and self.path.suffix.lower() == ".safetensors"):
            from safetensors import safe_open

            files = tensor_files(self.path)
            if not files:
                raise CheckpointError(f"{self.path}: no *.safetensors weights in this directory")
            for f in files:
                if not f.exists():
                    raise CheckpointError(f"{self.path}: shard {f.name} is missing")
                _check_safetensors(f)
                with safe_open(str(f), "pt") as fh:
                    for k in fh.keys():
                        self._files[k] = f
            self.files = files
        elif kind == "pt2":
            try:
                ep = torch.export.load(str(self.path))
            except Exception as e:
                raise CheckpointError(f"{self.path}: cannot read torch.export archive: {str(e).splitlines()[0]}") from None
            self._memory = {k: v.detach() for k, v in ep.module().state_dict().items()}
            self.files = [self.path]
        else:
            try:
                self._memory = read_state_dict(self.path)
            except CheckpointError:
                if not trust_pickle:
                    raise
                obj = torch.load(str(self.path), map_location="cpu", weights_only=False)
                state = obj.state_dict() if isinstance(obj, nn.Module) else obj
                self._memory = {k: v.detach() for k, v in state.items() if isinstance(v, torch.Tensor)}
            self.files = [self.path]

    def keys(self) -> List[str]:
        return sorted(self._files) if self._files else sorted(self._memory)

    def get(self, name: str) -> torch.Tensor:
        if self._files:
            from safetensors import safe_open

            with safe_open(str(self._files[name]), "pt") as fh:
                return fh.get_tensor(name)
        return self._memory[name]

    def shape_dtype(self, name: str):
        if self._files:
            from safetensors import safe_open

            with safe_open(str(self._files[name]), "pt") as fh:
                sl = fh.get_slice(name)
                return tuple(sl.get_shape()), _ST_DTYPES[sl.get_dtype()]
        t = self._memory[name]
        return tuple(t.shape), t.dtype


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
