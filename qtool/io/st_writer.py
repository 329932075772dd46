"""A streaming safetensors writer: header first, then one tensor at a time, never the whole model in memory.

The layout is exactly the safetensors format (8-byte little-endian header length, JSON header padded with spaces
to a multiple of 8, then the tensors' bytes back to back), so ``safetensors.safe_open`` reads the result.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO, Dict, List, Optional, Sequence, Tuple

import torch

from .checkpoint import ST_DTYPES
from .finite import check_finite

__all__ = ["StreamingSafetensorsWriter", "DTYPE_NAMES"]

DTYPE_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}  # (the reader's table, turned round)


class StreamingSafetensorsWriter:
    """Declare every tensor's (name, dtype, shape) up front, then ``write`` them in the declared order."""

    def __init__(self, path: Path, entries: Sequence[Tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Optional[Dict[str, str]] = None):
        self.path = Path(path)
        self._order: List[str] = []
        self._expect: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int]] = {}
        header: Dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name, dtype, shape in entries:
            if name in self._expect:
                raise ValueError(f"tensor {name!r} declared twice")
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
            shape = tuple(int(d) for d in shape)
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expect[name] = (dtype, shape, nbytes)
            self._order.append(name)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._fh: Optional[BinaryIO] = open(self.path, "wb")
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._fh is None:
            raise RuntimeError("writer is closed")
        if self._next >= len(self._order) or self._order[self._next] != name:
            want = self._order[self._next] if self._next < len(self._order) else "(nothing)"
            raise ValueError(f"tensors must be written in declared order: expected {want!r}, got {name!r}")
        dtype, shape, nbytes = self._expect[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r}: declared {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}")
        data = tensor.detach().contiguous().cpu()
        check_finite(name, data)  # never NaN/Inf in a file: the input's fault, named, before a byte of it is written
        if nbytes:
            # safetensors stores little-endian; view the bytes without a copy of the values
            self._fh.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._fh is None:
            return
        fh, self._fh = self._fh, None
        fh.close()
        if self._next != len(self._order):
            raise ValueError(f"only {self._next} of {len(self._order)} declared tensors were written")

    def abort(self) -> None:
        """Close without the every-tensor-written check (the caller failed; its output is discarded)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
