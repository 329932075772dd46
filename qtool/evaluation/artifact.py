"""What an exported artifact is and what it was made from: its format, the file or directory its runtime opens,
and (from the manifest qtool writes beside it) the float checkpoint and the encodings it came from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from ..errors import UsageError
from ..io.fs import sha256_file

# the formats a runtime can run, and what runs them
RUNTIMES = {"qtool": "qtool (torch)", "compressed-tensors": "transformers + compressed-tensors",
            "onnx": "onnxruntime", "gguf": "llama.cpp (xllamacpp)"}


@dataclass
class Artifact:
    format: str
    path: Path  # the file (GGUF, ONNX) or directory (qtool, compressed-tensors) the runtime opens
    checkpoint: Optional[str] = None  # the float checkpoint the manifest names, as given where the job ran
    encodings: Optional[Path] = None  # the encodings.json the manifest names, where it was found with its sha256
    checkpoint_sha256: Optional[List[str]] = None  # the manifest's hashes of the checkpoint's weight files
    encodings_missing: Optional[str] = None  # the encodings the manifest names, where no file has its sha256
    directory: Optional[Path] = None  # where the manifest is
    encodings_sha256: Optional[str] = None  # the manifest's hash of the encodings the file was exported from

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
    ckpt_in = inputs.get("checkpoint") if isinstance(inputs.get("checkpoint"), dict) else {}
    enc_in = inputs.get("encodings") if isinstance(inputs.get("encodings"), dict) else {}
    ckpt, enc = ckpt_in.get("path"), enc_in.get("path")
    hashes = ckpt_in.get("sha256")
    hashes = sorted(str(h) for h in hashes.values()) if isinstance(hashes, dict) and hashes else None
    enc_path = enc_missing = None
    if isinstance(enc, str):
        enc_path = _found(enc, directory, enc_in.get("sha256"))
        enc_missing = None if enc_path is not None else enc
    summary = m.get("summary") if isinstance(m.get("summary"), dict) else {}
    path = directory
    if fmt == "gguf":
        name = (summary.get("gguf") or {}).get("file") if isinstance(summary.get("gguf"), dict) else None
        path = directory / (name if isinstance(name, str) and Path(name).name == name else "model.gguf")
    elif fmt == "onnx":
        path = directory / "model.onnx"
    enc_sha = enc_in.get("sha256") if isinstance(enc_in.get("sha256"), str) else None
    return Artifact(fmt, path, ckpt if isinstance(ckpt, str) else None, enc_path, hashes, enc_missing, directory,
                    enc_sha)


_MODEL_FILES = (".onnx", ".gguf", ".safetensors")
_DIRECTORY_FILES = ("config.json",)  # what a directory's runtime also reads (compressed-tensors' scheme is there)


def changed_files(art: Artifact) -> Tuple[str, ...]:
    """The model files of ``art`` that run (the file itself, or a directory's weight files and config.json) whose
    bytes are not those its export's manifest records (replaced or edited since: what runs is then not what qtool
    wrote, whatever the verdict says of it). Read whole, so asked for only where a verdict is made."""
    if art.directory is None:
        return ()
    outputs = (_manifest(art.directory) or {}).get("outputs")
    if not isinstance(outputs, dict):
        return ()
    runs = {art.path.name} if art.path.is_file() else None
    out = []
    for name, sha in sorted(outputs.items()):
        if not (isinstance(name, str) and isinstance(sha, str) and Path(name).name == name
                and (name in runs if runs is not None else name.endswith(_MODEL_FILES) or name in _DIRECTORY_FILES)):
            continue
        try:
            if sha256_file(art.directory / name) != sha:
                out.append(name)
        except OSError:  # (gone or unreadable: the runtime's own error says so)
            continue
    return tuple(out)


def places(recorded: str, directory: Path) -> List[Path]:
    """Where a path a manifest records may be now: it is as it was given where the job ran, so (unless absolute)
    it reads from here, from the manifest's directory, or from that directory's parent (a job run beside its
    output directory)."""
    p = Path(recorded)
    if p.is_absolute():
        return [p]
    out: List[Path] = []
    for c in (p, directory / p, directory.resolve().parent / p):  # (the parent of "." is ".")
        if not any(c.resolve() == o.resolve() for o in out):
            out.append(c)
    return out


def _found(recorded: str, directory: Path, sha256) -> Optional[Path]:
    """The first of :func:`places` that is a file with the recorded ``sha256`` (any file where none is recorded)."""
    for c in places(recorded, directory):
        if c.is_file() and (not isinstance(sha256, str) or sha256_file(c) == sha256):
            return c
    return None


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
        _check_qtool_export(p)
    else:
        raise UsageError(f"{p}: no model.gguf, model.onnx, compressed-tensors config.json or qtool "
                         f"model.safetensors here")
    if not art.path.exists():
        raise UsageError(f"{art.path}: the manifest names it, but it is missing")
    return art


def _check_qtool_export(directory: Path) -> None:
    """A directory of safetensors with neither a manifest nor a quantization config is qtool's format only where its
    first file's header says so: a float checkpoint is refused here, before any model runs (it was refused once the
    float reference had been scored, as 'not a readable qtool export (KeyError)')."""
    from safetensors import safe_open

    from ..errors import CheckpointError
    from ..io.checkpoint import tensor_files

    try:
        first = tensor_files(directory)[0]
        with safe_open(str(first), "pt") as fh:
            metadata = fh.metadata() or {}
    except (CheckpointError, IndexError, OSError, ValueError, RuntimeError):
        return  # (the runtime's own open names what is wrong with the files)
    if "qtool" not in metadata:
        raise UsageError(f"{directory}: a checkpoint with no quantization (no manifest, no compressed-tensors "
                         f"config, no qtool metadata in {first.name}), not an export qtool can evaluate; pass the "
                         f"directory `qtool export` wrote")


def _beside(directory: Path):
    """What the manifest beside a .gguf or .onnx file says it came from (Artifact's fields after ``path``)."""
    m = _manifest(directory)
    if m is None:
        return ()
    try:
        art = _from_manifest(directory, m)
    except UsageError:
        return ()
    return art.checkpoint, art.encodings, art.checkpoint_sha256, art.encodings_missing, art.directory


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
