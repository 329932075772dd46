"""Atomic outputs and file hashing."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence, Tuple

from ..errors import UsageError

__all__ = ["atomic_output_dir", "sha256_file", "check_output_dir", "parse_size", "write_text_atomic"]


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str, what: str) -> Optional[int]:
    """'5GB', '500MB', '2GiB', '123' (bytes) -> bytes; '0' or 'none' -> None (no limit). Units as Hugging Face's
    ``max_shard_size``: KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2."""
    t = text.strip().upper().replace(" ", "")
    if t in ("0", "NONE"):
        return None
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not value >= 0 or value == float("inf"):
        raise UsageError(f"{what}: {text!r} is not a size like 5GB, 500MB or 2GiB (0 or none: no limit)")
    if value == 0:
        return None
    return max(1, int(value * _UNITS[unit]))


def check_output_dir(out: Path, overwrite: bool, inputs: Sequence[Tuple[str, Optional[str]]] = ()) -> None:
    """Refuse an --out that is a file, or an existing directory without --overwrite, before any work; and an --out
    that is, holds or lies inside one of ``inputs`` (``(what, path)`` pairs: the checkpoint, the recipe, the data,
    the encodings), which replacing --out would delete or writing into it would change."""
    target = Path(os.path.realpath(out))
    for what, path in inputs:
        if path is None or not Path(path).exists():
            continue
        src = Path(os.path.realpath(path))
        if target == src or target in src.parents:
            raise UsageError(f"{out}: --out {'is' if target == src else 'contains'} the {what} {path}; replacing it "
                             "would delete an input: choose another --out")
        if src.is_dir() and src in target.parents:
            raise UsageError(f"{out}: --out is inside the {what} directory {path}; write outputs elsewhere")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: --out is an existing file, not a directory")
    if out.exists() and not overwrite:
        raise UsageError(f"{out}: already exists; pass --overwrite to replace it")
    parent = out.parent if str(out.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"{parent}: parent of --out is not a directory")


@contextlib.contextmanager
def atomic_output_dir(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``out``; on success it replaces ``out`` in one rename.

    On any failure (or interrupt) the temporary directory is removed and ``out`` is left as it was.
    """
    out = Path(out)
    check_output_dir(out, overwrite)
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as e:
        raise UsageError(f"{out}: cannot create output directory: {e.strerror or e}") from None
    try:
        yield tmp
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.replace(out, trash / out.name)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write a small text file whole or not at all (a temporary file beside it, then a rename)."""
    import os
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=str(path.parent.resolve()))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()
