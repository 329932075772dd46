"""Tensors kept on disk until they are written out: a mapping name -> tensor whose values live in a temporary
directory, so that what calibration accumulates layer by layer (GPTQ's codes) does not stay in memory.

Sequential calibration holds one decoder block at a time; the codes it chooses are part of the output and are
only written (``qtool.weights.write_codes``) once every block is done. Kept in a dict they grow by a byte per
weight (8 as int64) with every block; here each goes to its own raw file as it is chosen and is read back, one
tensor at a time, when the codes file is written. The directory is removed when the mapping is closed or
garbage collected, and at interpreter exit; its name carries the host and pid of its process, so that the next
mapping made removes those a killed run left (a pre-empted --sequential run's codes: gigabytes).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Dict, Iterator, List, MutableMapping, Optional, Tuple

import numpy as np
import torch

from .fs import new_temporary, remove_orphans, writer_tag

__all__ = ["SpilledTensors"]

_PREFIX = "qtool-spill-"
_NAME = re.compile(rf"^{_PREFIX}(?P<host>[A-Za-z0-9._-]+)-(?P<pid>\d+)-[A-Za-z0-9_]+$")


def _remove_all(directories: List[Path]) -> None:
    for d in directories:
        shutil.rmtree(d, ignore_errors=True)


class SpilledTensors(MutableMapping[str, torch.Tensor]):
    """A ``dict`` of CPU tensors (any dtype) whose values are stored in files under ``directory`` (a new temporary
    directory when None)."""

    def __init__(self, directory: Optional[Path] = None):
        parent = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        remove_orphans(parent, f"{_PREFIX}*", _NAME)
        # the cleanup is registered before the directory exists, on the list its name goes into first (with
        # mkdtemp, an interrupt as it returned left it behind until another spilling run)
        named: List[Path] = []
        self._cleanup = weakref.finalize(self, _remove_all, named)
        self.directory = new_temporary(parent, f"{_PREFIX}{writer_tag()}-", named, directory=True, private=True)
        self._index: Dict[str, Tuple[Path, torch.dtype, Tuple[int, ...]]] = {}
        self._count = 0

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu").contiguous()
        path = self.directory / f"{self._count}.bin"
        self._count += 1
        t.reshape(-1).view(torch.uint8).numpy().tofile(path)  # raw bytes: any dtype, bfloat16 and FP8 included
        old = self._index.get(name)
        self._index[name] = (path, t.dtype, tuple(t.shape))
        if old is not None:
            old[0].unlink(missing_ok=True)

    def __getitem__(self, name: str) -> torch.Tensor:
        path, dtype, shape = self._index[name]
        raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        if raw.numel() == 0:  # an empty tensor: nothing to view (its stride would not allow it)
            return torch.empty(shape, dtype=dtype)
        return raw.view(dtype).reshape(shape)

    def __delitem__(self, name: str) -> None:
        path, _, _ = self._index.pop(name)
        path.unlink(missing_ok=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def nbytes(self) -> int:
        """Bytes held on disk."""
        return sum(p.stat().st_size for p, _, _ in self._index.values())

    def close(self) -> None:
        """Remove the files now (the mapping is empty afterwards)."""
        self._index.clear()
        self._cleanup()
