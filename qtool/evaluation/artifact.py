"""What an exported artifact is and what it was made from: its format, the file or directory its runtime opens,
and (from the manifest qtool writes beside it) the float checkpoint and the encodings it came from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import UsageError

# the formats a runtime can run, and what runs them
RUNTIMES = {"qtool": "qtool (torch)", "compressed-tensors": "transformers + compressed-tensors",
            "onnx": "onnxruntime", "gguf": "llama.cpp (xllamacpp)"}


@dataclass
class Artifact:
    format: str
    path: Path  # the file (GGUF, ONNX) or directory (qtool, compressed-tensors) the runtime opens
    checkpoint: Optional[str] = None  # the float checkpoint the manifest names
    encodings: Optional[Path] = None  # the encodings.json the manifest names

    @property
    def runtime(self) -> str:
        return RUNTIMES[self.format]


def _manifest(directory: Path) -> Optional[dict]:
    f = directory / "manifest.json"
    if not f.is_file():
        return None
    try:
        m = json.loads(f.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"{f}: not a readable manifest ({type(e).__name__})") from None
    return m if isinstance(m, dict) else None


def _from_manifest(directory: Path, m: dict) -> Artifact:
    fmt = m.get("format")
    if m.get("command") not in ("export", "quantize") or not isinstance(fmt, str):
        raise UsageError(f"{directory}: its manifest is a '{m.get('command')}' run's, not an export's; pass the "
                         f"directory qtool export or qtool quantize wrote")
    if fmt not in RUNTIMES:
        raise UsageError(f"{directory}: format '{fmt}' has no runtime to evaluate in (evaluated formats: "
                         f"{', '.join(RUNTIMES)}); qtool report measures the encodings themselves")
    inputs = m.get("inputs") if isinstance(m.get("inputs"), dict) else {}
    ckpt = (inputs.get("checkpoint") or {}).get("path") if isinstance(inputs.get("checkpoint"), dict) else None
    enc = (inputs.get("encodings") or {}).get("path") if isinstance(inputs.get("encodings"), dict) else None
    enc_path = None
    if isinstance(enc, str):
        enc_path = Path(enc) if Path(enc).is_absolute() else directory / enc
    summary = m.get("summary") if isinstance(m.get("summary"), dict) else {}
    path = directory
    if fmt == "gguf":
        name = (summary.get("gguf") or {}).get("file") if isinstance(summary.get("gguf"), dict) else None
        path = directory / (name if isinstance(name, str) and Path(name).name == name else "model.gguf")
    elif fmt == "onnx":
        path = directory / "model.onnx"
    return Artifact(fmt, path, ckpt if isinstance(ckpt, str) else None, enc_path)


def locate(path: str | Path) -> Artifact:
    """The artifact at ``path``: a directory qtool wrote (its manifest says the format and the inputs), a
    ``.gguf`` or ``.onnx`` file, or a directory of another tool's making recognized by its files."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p}: no such artifact")
    if p.is_file():
        if p.suffix == ".gguf":
            return Artifact("gguf", p, *_beside(p.parent))
        if p.suffix == ".onnx":
            return Artifact("onnx", p, *_beside(p.parent))
        if p.name == "manifest.json":
            p = p.parent
        else:
            raise UsageError(f"{p}: not an artifact qtool can run (a .gguf or .onnx file, or an export directory)")
    m = _manifest(p)
    if m is not None:
        art = _from_manifest(p, m)
    elif (p / "model.gguf").is_file():
        art = Artifact("gguf", p / "model.gguf")
    elif (p / "model.onnx").is_file():
        art = Artifact("onnx", p / "model.onnx")
    elif quantization_config(p) is not None:
        art = Artifact("compressed-tensors", p)
    elif (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file():
        art = Artifact("qtool", p)
    else:
        raise UsageError(f"{p}: no model.gguf, model.onnx, compressed-tensors config.json or qtool "
                         f"model.safetensors here")
    if not art.path.exists():
        raise UsageError(f"{art.path}: the manifest names it, but it is missing")
    return art


def _beside(directory: Path):
    m = _manifest(directory)
    if m is None:
        return None, None
    try:
        art = _from_manifest(directory, m)
    except UsageError:
        return None, None
    return art.checkpoint, art.encodings


def quantization_config(directory: Path) -> Optional[dict]:
    """A Hugging Face directory's ``config.json`` ``quantization_config`` (None where there is none, or no readable
    config): what says a directory is compressed-tensors, and how (``transform_config``, ``config_groups``)."""
    f = Path(directory) / "config.json"
    if not f.is_file():
        return None
    try:
        found = json.loads(f.read_text()).get("quantization_config")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return None
    return found if isinstance(found, dict) else None
