"""Checkpoint files, read safely and one tensor at a time: kind detection, safetensors discovery (sharded Hugging
Face directories included), header checks that turn a truncated or corrupt file into one error line, weights-only
torch loading, and :class:`CheckpointTensors` (read-only access without building a model)."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Dict, List

import torch
from torch import nn

from ..errors import CheckpointError

__all__ = ["detect_kind", "tensor_files", "check_safetensors", "read_state_dict", "torch_load_safe",
           "CheckpointTensors", "ST_DTYPES"]


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


def check_safetensors(file: Path) -> None:
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

        check_safetensors(path)
        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read safetensors file: {e}") from None
    obj = torch_load_safe(path)
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


def torch_load_safe(path: Path):
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
                check_safetensors(f)
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
                return tuple(sl.get_shape()), ST_DTYPES[sl.get_dtype()]
        t = self._memory[name]
        return tuple(t.shape), t.dtype


ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
