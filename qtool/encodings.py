"""qtool's encodings JSON (schema ``qtool.encodings``, version 1) and the AIMET 1.0.0 form.

One entry per quantizer::

    {"name": "encoder.layer.0.attention.self.query.weight", "module": "...", "tensor": "weight",
     "bitwidth": 8, "symmetric": true, "granularity": "per_channel", "shape": [384, 1], "block_size": null,
     "analyzer": "minmax", "min": [...], "max": [...], "scale": [...], "offset": [...]}

``min``/``max`` are the quantizer's stored range and ``scale``/``offset`` (AIMET convention,
``real = (q + offset) * scale``) are derived from them; all are nested lists in ``shape`` (a bare number for
per-tensor). Floats are float32 values written with Python's shortest round-trip repr, so reading a file back
gives the same float32 bits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from .config import QuantizerPlan
from .errors import EncodingsError
from .quant import QuantizerBase
from .quant.affine import grid, min_max_to_scale_offset, resolve_block_size

__all__ = ["EncodingEntry", "EncodingsFile", "SCHEMA", "SCHEMA_VERSION"]

SCHEMA = "qtool.encodings"
SCHEMA_VERSION = 1


def _tolist(t: torch.Tensor):
    return t.detach().to(torch.float32).cpu().tolist()


@dataclass
class EncodingEntry:
    name: str
    module: str
    tensor: str
    bitwidth: int
    symmetric: bool
    granularity: str
    shape: Tuple[int, ...]
    block_size: Optional[Tuple[int, ...]]
    analyzer: str
    min: torch.Tensor
    max: torch.Tensor

    @property
    def qmin_qmax(self) -> Tuple[int, int]:
        return grid(self.bitwidth, signed=self.symmetric)

    def scale_offset(self) -> Tuple[torch.Tensor, torch.Tensor]:
        qmin, qmax = self.qmin_qmax
        with torch.no_grad():
            return min_max_to_scale_offset(self.min, self.max, qmin, qmax, self.symmetric)

    @classmethod
    def from_quantizer(cls, plan: QuantizerPlan, quantizer: QuantizerBase) -> "EncodingEntry":
        return cls(plan.name, plan.module, plan.tensor, plan.bitwidth, plan.symmetric, plan.granularity,
                   tuple(plan.shape), plan.block_size, plan.analyzer_label,
                   quantizer.min.detach().cpu().clone(), quantizer.max.detach().cpu().clone())

    def check_fits(self, key: str, shape) -> None:
        """Raise ``EncodingsError`` unless this encoding's shape/block_size applies to tensor ``key`` of ``shape``."""
        try:
            resolve_block_size(shape, self.shape, self.block_size)
        except ValueError as err:
            raise EncodingsError(
                f"encodings entry {self.name!r} (shape {list(self.shape)}) does not fit tensor {key!r} of shape "
                f"{list(shape)}: {err}; were they made for another model?"
            ) from None

    def to_json(self) -> Dict[str, Any]:
        scale, offset = self.scale_offset()
        return {
            "name": self.name,
            "module": self.module,
            "tensor": self.tensor,
            "bitwidth": self.bitwidth,
            "symmetric": self.symmetric,
            "granularity": self.granularity,
            "shape": list(self.shape),
            "block_size": None if self.block_size is None else list(self.block_size),
            "analyzer": self.analyzer,
            "min": _tolist(self.min),
            "max": _tolist(self.max),
            "scale": _tolist(scale),
            "offset": offset.to(torch.int64).tolist(),
        }

    @classmethod
    def from_json(cls, obj: Dict[str, Any], where: str) -> "EncodingEntry":
        try:
            shape = tuple(int(d) for d in obj["shape"])
            entry = cls(
                name=str(obj["name"]), module=str(obj["module"]), tensor=str(obj["tensor"]),
                bitwidth=int(obj["bitwidth"]), symmetric=bool(obj["symmetric"]),
                granularity=str(obj["granularity"]), shape=shape,
                block_size=None if obj.get("block_size") is None else tuple(int(b) for b in obj["block_size"]),
                analyzer=str(obj.get("analyzer", "minmax")),
                min=torch.tensor(obj["min"], dtype=torch.float32).reshape(shape),
                max=torch.tensor(obj["max"], dtype=torch.float32).reshape(shape),
            )
        except KeyError as e:
            raise EncodingsError(f"{where}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise EncodingsError(f"{where}: malformed entry ({str(e).splitlines()[0]})") from None
        if entry.tensor not in ("weight", "input", "output"):
            raise EncodingsError(f"{where}: tensor must be weight, input or output (got {entry.tensor!r})")
        if not 2 <= entry.bitwidth <= 16:
            raise EncodingsError(f"{where}: bitwidth {entry.bitwidth} is outside 2..16")
        if not (torch.isfinite(entry.min).all() and torch.isfinite(entry.max).all()):
            raise EncodingsError(f"{where}: min/max must be finite numbers")
        return entry


@dataclass
class EncodingsFile:
    entries: List[EncodingEntry]
    meta: Dict[str, Any]

    def by_name(self) -> Dict[str, EncodingEntry]:
        return {e.name: e for e in self.entries}

    def to_json(self) -> Dict[str, Any]:
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **self.meta,
                "quantizers": [e.to_json() for e in self.entries]}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1) + "\n"

    @classmethod
    def read(cls, path: str | Path) -> "EncodingsFile":
        path = Path(path)
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise EncodingsError(f"{path}: encodings file not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise EncodingsError(f"{path}: cannot read encodings: {e}") from None
        except ValueError as e:
            raise EncodingsError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
            raise EncodingsError(f"{path}: not a qtool encodings file (expected \"schema\": \"{SCHEMA}\")")
        if obj.get("schema_version") != SCHEMA_VERSION:
            raise EncodingsError(
                f"{path}: schema_version {obj.get('schema_version')!r} is not supported (this qtool reads "
                f"{SCHEMA_VERSION})"
            )
        raw = obj.get("quantizers")
        if not isinstance(raw, list):
            raise EncodingsError(f"{path}: 'quantizers' must be a list")
        entries = [EncodingEntry.from_json(e, f"{path}: quantizers[{i}]") if isinstance(e, dict)
                   else _bad_entry(path, i) for i, e in enumerate(raw)]
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise EncodingsError(f"{path}: quantizer {dup!r} appears twice")
        meta = {k: v for k, v in obj.items() if k not in ("schema", "schema_version", "quantizers")}
        return cls(entries, meta)


def _bad_entry(path, i):
    raise EncodingsError(f"{path}: quantizers[{i}] must be an object")
