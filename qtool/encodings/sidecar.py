"""Reading an encodings file's sidecar (``encodings.safetensors``, schema version 2): the numbers of the entries
too large to write in the JSON, read when the file is read or, lazily, when an entry's numbers are asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from ..errors import EncodingsError


def read_lazy_range(source: Tuple[str, str, str]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of an entry read lazily, from the sidecar file and keys its ``source`` names (checked by the
    entry, :meth:`qtool.encodings.EncodingEntry.range`)."""
    from safetensors import safe_open

    file, kmin, kmax = source
    with safe_open(file, framework="pt") as fh:
        return fh.get_tensor(kmin), fh.get_tensor(kmax)


class _Sidecar:
    """Reads the numbers of version-2 entries from the safetensors file beside the JSON."""

    def __init__(self, json_path: Path):
        self.dir = json_path.parent
        self.json_path = json_path
        self._open: Dict[str, Any] = {}

    def _file(self, name: Any, where: str):
        if not isinstance(name, str) or Path(name).name != name:
            raise EncodingsError(f"{where}: data.file must be a file name beside the JSON (got {name!r})")
        if name not in self._open:
            from safetensors import SafetensorError, safe_open

            path = self.dir / name
            if not path.is_file():
                raise EncodingsError(f"{path}: encodings data file not found (named by {self.json_path})")
            try:
                self._open[name] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise EncodingsError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
        return self._open[name]

    def files(self) -> List[Path]:
        return [self.dir / name for name in sorted(self._open)]

    def range(self, data: Any, shape: Tuple[int, ...], where: str, lazy: bool = False):
        """``(min, max, source)``; ``lazy``: meta tensors and the ``source`` to read them from later (the
        dtype and shape are checked from the header now)."""
        if not isinstance(data, dict):
            raise EncodingsError(f"{where}: 'data' must be an object naming a file and its min/max tensors")
        fh = self._file(data.get("file"), where)
        out = []
        for field in ("min", "max"):
            key = data.get(field)
            if not isinstance(key, str) or key not in fh.keys():
                raise EncodingsError(f"{where}: data.{field} names no tensor in {data.get('file')} (got {key!r})")
            piece = fh.get_slice(key)
            dtype, got = piece.get_dtype(), tuple(piece.get_shape())
            if dtype != "F32" or got != shape:
                raise EncodingsError(f"{where}: tensor {key!r} is {dtype} {list(got)}, expected F32 {list(shape)}")
            out.append(torch.empty(shape, device="meta") if lazy else fh.get_tensor(key))
        source = (str(self.dir / data["file"]), data["min"], data["max"]) if lazy else None
        return out[0], out[1], source
