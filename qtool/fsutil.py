"""Atomic outputs and file hashing."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import UsageError

__all__ = ["atomic_output_dir", "sha256_file", "check_output_dir"]


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse an --out that is a file, or an existing directory without --overwrite, before any work."""
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


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()
