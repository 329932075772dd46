"""Checkpoint files, read safely and one tensor at a time: kind detection, safetensors discovery (sharded Hugging
Face directories included), header checks that turn a truncated or corrupt file into one error line, weights-only
torch loading, and :class:`CheckpointTensors` (read-only access without building a model)."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import struct
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..errors import CheckpointError
from .jsonfile import loads_strict, read_json_object

__all__ = ["not_found", "check_files_there", "detect_kind", "tensor_files", "files_read", "check_safetensors",
           "read_state_dict", "plain_state_dict", "torch_load_safe", "CheckpointTensors", "ST_DTYPES"]


def not_found(path) -> CheckpointError:
    """A checkpoint path that does not exist (in Python; the CLI resolves a Hub ID before a path is read)."""
    return CheckpointError(f"{path}: checkpoint not found (no such file or directory; for a Hugging Face Hub ID, "
                           "qtool.model.hub.resolve_checkpoint(ID, revision) gives the local path)")


def check_files_there(path: Path, files: List[Path]) -> None:
    """Refuse a checkpoint whose tensor files (``tensor_files``) are not all there, saying which and why: a link to
    nothing (a Hub cache's blob gone), or a shard the index names."""
    for f in files:
        if f.exists():
            continue
        if os.path.islink(f):
            raise CheckpointError(f"{path}: {f.name} is a link to {os.readlink(f)}, which does not exist")
        named = (Path(path) / "model.safetensors.index.json").exists()
        raise CheckpointError(f"{path}: {'shard ' if named else ''}{f.name}"
                              f"{' named in model.safetensors.index.json' if named else ''} is missing")


def detect_kind(path: Path) -> str:
    if not path.exists():
        raise not_found(path)
    if path.is_dir():
        if (path / "config.json").exists():
            return "hf"
        if (path / "config.json").is_symlink():  # (a Hub cache whose blob is gone)
            raise CheckpointError(f"{path}: config.json is a link to {os.readlink(path / 'config.json')}, which does "
                                  "not exist")
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
    """The safetensors files of a checkpoint, in a stable order: a directory's ``model.safetensors``, else the
    shards its index names (transformers' order), else every ``*.safetensors`` in it."""
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if (path / "model.safetensors").is_file():  # what transformers loads: another file beside it (a backup, an
            return [path / "model.safetensors"]     # adapter, an index of an older save) is not the model's
        if index.exists():
            weight_map = read_json_object(index, CheckpointError, "safetensors index", strict=True).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
            if not weight_map:  # (else "no weights in this directory", beside the shards it should name)
                raise CheckpointError(f"{index}: weight_map names no tensor")
            shards = sorted(set(weight_map.values()))
            bad = [f for f in shards if Path(f).name != f or not f.endswith(".safetensors")]
            if bad:
                raise CheckpointError(f"{index}: shard {bad[0][:80]!r} is not a .safetensors file name in this "
                                      "directory")
            return [path / f for f in shards]
        return sorted(path.glob("*.safetensors"))
    return [path]


def files_read(path: Path) -> List[Path]:
    """What a run reads of a checkpoint: its tensor files (:func:`tensor_files`), a directory's ``config.json`` and
    the model code beside it (``*.py``, what ``--trust-remote-code`` runs): what a resumed run's state and the
    ranks of one run compare."""
    code = sorted(f for f in Path(path).glob("*.py") if f.is_file()) if Path(path).is_dir() else []
    return tensor_files(path) + [f for f in (Path(path) / "config.json",) if f.is_file()] + code


def weight_file_hashes(path: Path) -> Optional[List[str]]:
    """The sorted sha256 of a checkpoint's weight files (:func:`tensor_files`), as manifests record them (None: none
    to read)."""
    from .fs import sha256_file

    try:
        return sorted(sha256_file(f) for f in tensor_files(path)) or None
    except (CheckpointError, OSError):
        return None


def load_exported(path: Path):
    """A ``torch.export`` archive (``.pt2``); a damaged one is one line (torch logs its own traceback of a failed
    read as a warning first: kept off the terminal)."""
    import logging

    log = logging.getLogger("torch.export")
    disabled, log.disabled = log.disabled, True
    try:
        return torch.export.load(str(path))
    except Exception as e:  # (the exporter raises many types)
        raise CheckpointError(f"{path}: cannot read torch.export archive: {str(e).splitlines()[0]}") from None
    finally:
        log.disabled = disabled


def _refuse_torchscript(path: Path) -> None:
    """A TorchScript archive (``torch.jit.save``) runs compiled code, not the eager modules qtool puts quantizers on:
    loaded, it quantized nothing and wrote the model float."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            script = any(n == "constants.pkl" or n.endswith("/constants.pkl") for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return  # (torch.load says what is wrong with it)
    if script:
        raise CheckpointError(f"{path}: a TorchScript archive (torch.jit.save), whose compiled modules qtool cannot "
                              "quantize; save the eager model's state_dict() (with --model-class), or a torch.export "
                              "program (.pt2), instead")


@contextlib.contextmanager
def working_directory_importable() -> Iterator[None]:
    """Modules in the working directory importable while it lasts (a user's ``--model-class`` module, the classes
    a pickle names), as ``python`` makes them for a script; ``sys.path`` is left as it was after (a library
    caller's process keeps importing what it imported before)."""
    added = "" not in sys.path and "." not in sys.path
    if added:
        sys.path.insert(0, "")
    try:
        yield
    finally:
        if added and "" in sys.path:
            sys.path.remove("")


def load_pickle(path: Path):
    """A full pickle (``--trust-pickle``): the classes it names are imported from the working directory too, as
    ``--model-class`` imports them; one that cannot be is one line naming it."""
    _refuse_torchscript(path)

    try:
        with working_directory_importable():
            return torch.load(str(path), map_location="cpu", weights_only=False)
    except (ImportError, AttributeError) as e:  # (a class gone, or one defined in the script that saved it)
        raise CheckpointError(f"{path}: the pickle names a class that cannot be imported here ({e}): run where its "
                              "module is importable, or save a state dict and pass --model-class") from None
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: cannot unpickle ({first[:200]})") from None


def safetensors_index(files: List[Path]) -> Dict[str, Tuple[Tuple[int, ...], Path]]:
    """Each tensor's shape and file, from the safetensors headers (each checked first: a damaged header is one
    line). A name in two files is refused: which copy a reader takes depends on the reader (transformers takes the
    later shard's whatever an index says), so calibration and export could read different ones."""
    from safetensors import safe_open

    out: Dict[str, Tuple[Tuple[int, ...], Path]] = {}
    for f in files:
        check_safetensors(f)
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k in out:
                    raise CheckpointError(f"{f}: holds tensor {k!r}, which {out[k][1].name} holds too: which is the "
                                          "model's? (keep one copy: readers differ in which they take)")
                out[k] = (tuple(fh.get_slice(k).get_shape()), f)
    return out


def no_safetensors(path: Path) -> CheckpointError:
    """The error for a model directory without safetensors weights, naming a pickle one where that is what it has
    (a pytorch_model.bin checkpoint: qtool reads no pickle from a directory, --trust-pickle or not)."""
    pickles = sorted(f.name for f in Path(path).glob("pytorch_model*.bin")) if Path(path).is_dir() else []
    if pickles:  # (an optimizer's or training arguments' .bin holds no weights)
        which = pickles[0] if len(pickles) == 1 else f"{len(pickles)} pytorch_model*.bin shards"
        return CheckpointError(f"{path}: no *.safetensors weights in this directory, only {which} (a pickle, "
                               "which qtool does not read from a model directory): save the model as safetensors "
                               "(transformers: model.save_pretrained(DIR), its default)")
    return CheckpointError(f"{path}: no *.safetensors weights in this directory")


def check_index_places(path: Path, headers: Dict[str, Tuple[Tuple[int, ...], Path]]) -> None:
    """Every tensor a directory's ``model.safetensors.index.json`` maps to a shard that does not hold it, while
    another file of the directory does, is refused naming both (``headers``: the indexed shards' own, from
    :func:`safetensors_index`): an index edited or left from another save made the tensor "missing", and the config
    was blamed. An entry no file holds is left to the model's own check (transformers ignores a stale buffer's)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if not path.is_dir() or (path / "model.safetensors").is_file() or not index.is_file():
        return  # (tensor_files reads model.safetensors alone where there is one)
    weight_map = read_json_object(index, CheckpointError, "safetensors index", strict=True).get("weight_map") or {}
    misplaced = {name: file for name, file in weight_map.items()
                 if name not in headers or headers[name][1].name != file}
    if not misplaced:
        return
    named = {f.name for _, f in headers.values()}
    # (each other file's header read once: a shard the index names for nothing may hold what it misplaced)
    others = {f.name: set(safetensors_index([f])) for f in sorted(path.glob("*.safetensors")) if f.name not in named}
    for name, file in misplaced.items():
        found = headers[name][1].name if name in headers else next(
            (other for other, held in others.items() if name in held), None)
        if found is not None:
            raise CheckpointError(f"{index}: maps {name} to {file}, which does not hold it: {found} does (an index "
                                  "edited, or left from another save)")


def unheld_index_entry(path: Path, names) -> Optional[str]:
    """Where a tensor the model needs and no shard holds was promised: "{index}: maps NAME to FILE, which does not
    hold it" for the first of ``names`` (the model's name and its checkpoint spellings) that a directory's
    ``model.safetensors.index.json`` maps, else None. A shard from another save, or one cut short, then reads as
    that, not as a config.json describing more than the weights."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if not path.is_dir() or (path / "model.safetensors").is_file() or not index.is_file():
        return None
    weight_map = read_json_object(index, CheckpointError, "safetensors index", strict=True).get("weight_map") or {}
    name = next((n for n in names if n in weight_map), None)
    if name is None:
        return None
    return (f"{index}: maps {name} to {weight_map[name]}, which does not hold it (a shard of another save, or one "
            "cut short)")


_MAX_HEADER = 100_000_000  # the safetensors reader's own limit


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
            if n > _MAX_HEADER:
                raise CheckpointError(f"{file}: corrupt safetensors file (a header of {n} bytes; the format allows "
                                      f"{_MAX_HEADER})")
            header = loads_strict(f.read(n))  # a name given twice would silently lose a tensor
    except CheckpointError:
        raise
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    end = _check_entries(file, header)
    if _out_of_range(header):
        raise CheckpointError(f"{file}: corrupt safetensors header (a number past float64's range, such as 1e400)")
    if 8 + n + end > size:
        raise CheckpointError(f"{file}: truncated safetensors file (needs {8 + n + end} bytes, has {size})")
    if 8 + n + end < size:
        raise CheckpointError(f"{file}: corrupt safetensors file ({size - 8 - n - end} bytes after the last tensor)")


# bytes per element of the dtypes torch reads from safetensors (safetensors.torch); others are refused up front
_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1, "C64": 8, "U64": 8, "U32": 4,
                "U16": 2}


_FLOAT64_MAX = 1.7976931348623157e308


def _out_of_range(header) -> bool:
    """Whether a parsed header holds a number the safetensors reader refuses: one past float64's range (a float
    such as 1e400, which Python reads as infinity, or an integer of 309 digits). Walked without recursion: the
    header may nest as deep as JSON reading allowed."""
    todo = [header]
    while todo:
        obj = todo.pop()
        if isinstance(obj, float) and not math.isfinite(obj):
            return True
        if isinstance(obj, int) and abs(obj) > _FLOAT64_MAX:  # the reader holds numbers it does not type as float64
            return True
        if isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, list):
            todo.extend(obj)
    return False


def _check_entries(file: Path, header) -> int:
    """Each tensor entry well formed (a known dtype, a shape of non-negative ints, offsets that hold exactly
    its bytes) and no two entries overlapping; returns the end of the data section."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    spans = []
    for key, v in header.items():
        if key == "__metadata__":
            if v is not None and not (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())):
                raise CheckpointError(f"{file}: corrupt safetensors header (__metadata__ must map names to strings)")
            continue
        where = f"{file}: tensor {key[:80]!r}"
        if not isinstance(v, dict):
            raise CheckpointError(f"{where}: corrupt header entry (not a JSON object)")
        dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPE_SIZES:
            raise CheckpointError(f"{where}: unsupported dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**64 for d in shape):
            raise CheckpointError(f"{where}: corrupt header entry (shape must be a list of non-negative integers)")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] < 2**64):
            raise CheckpointError(f"{where}: corrupt header entry (data_offsets must be [begin, end])")
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * _DTYPE_SIZES[dtype]:
            raise CheckpointError(f"{where}: its data_offsets hold {offsets[1] - offsets[0]} bytes, its shape and "
                                  f"dtype need {numel * _DTYPE_SIZES[dtype]}")
        spans.append((offsets[0], offsets[1], key))
    spans.sort()
    for (b0, e0, k0), (b1, e1, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{file}: tensors {k0[:80]!r} and {k1[:80]!r} overlap in the data section")
    # the safetensors format (and its reader) wants the data section covered exactly: no gap before or between
    gaps = [(k, b) for (_, e0, _), (b, _, k) in zip([(0, 0, "")] + spans, spans) if b != e0]
    if gaps:
        raise CheckpointError(f"{file}: corrupt safetensors header (tensor {gaps[0][0][:80]!r} does not start "
                              f"where the previous one ends, at byte {gaps[0][1]})")
    return max((e for _, e, _ in spans), default=0)


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
    return plain_state_dict(obj, path)


def plain_state_dict(obj: Any, path: Path) -> Dict[str, torch.Tensor]:
    """A loaded torch file's state dict: the object itself, or its ``state_dict`` entry (a training checkpoint's
    ``{"state_dict": ..., "epoch": 3}``), name -> tensor throughout."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a state dict (name -> tensor), found {type(obj).__name__}")
    if "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: entry {bad[0]!r} is not a tensor; expected a plain state dict")
    return obj


def torch_load_safe(path: Path):
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] != b"PK" and magic[:1] != b"\x80":  # torch.save writes a zip file; the legacy format is a pickle
        raise CheckpointError(f"{path}: not a torch checkpoint (torch.save writes a zip archive); for weights use "
                              ".safetensors, .pt/.pth from torch.save, or a Hugging Face directory")
    _refuse_torchscript(path)
    try:  # (mmap reads the zip archive only: torch refuses it for the legacy format)
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=magic[:2] == b"PK")
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
            files = tensor_files(self.path)
            if not files:
                raise no_safetensors(self.path)
            check_files_there(self.path, files)
            self._files = {k: f for k, (_, f) in safetensors_index(files).items()}
            self.files = files
        elif kind == "pt2":
            self._memory = {k: v.detach() for k, v in load_exported(self.path).module().state_dict().items()}
            self.files = [self.path]
        else:
            try:
                self._memory = read_state_dict(self.path)
            except CheckpointError:
                if not trust_pickle:
                    raise
                obj = load_pickle(self.path)
                # (a module's state dict may hold a non-tensor extra state, get_extra_state's: no weight)
                state = {k: v for k, v in obj.state_dict().items() if isinstance(v, torch.Tensor)} \
                    if isinstance(obj, nn.Module) else plain_state_dict(obj, self.path)
                self._memory = {k: v.detach() for k, v in state.items()}
            self.files = [self.path]

    def keys(self) -> List[str]:
        return sorted(self._files) if self._files else sorted(self._memory)

    def get(self, name: str) -> torch.Tensor:
        if self._files:
            from safetensors import safe_open

            with safe_open(str(self._files[name]), "pt") as fh:
                return fh.get_tensor(name)
        return self._memory[name]

    def get_index(self, name: str, index: int) -> torch.Tensor:
        """``get(name)[index]``, reading only that part of a safetensors file (one expert of a fused 3-D tensor)."""
        if self._files:
            from safetensors import safe_open

            with safe_open(str(self._files[name]), "pt") as fh:
                return fh.get_slice(name)[index]
        return self._memory[name][index]

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
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
}
assert set(ST_DTYPES) == set(_DTYPE_SIZES)  # every dtype the header check admits has a torch dtype
