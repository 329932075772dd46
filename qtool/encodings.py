"""qtool's encodings JSON (schema ``qtool.encodings``, version 1) and the AIMET 1.0.0 form.

One entry per quantizer::

    {"name": "encoder.layer.0.attention.self.query.weight", "module": "...", "tensor": "weight",
     "bitwidth": 8, "symmetric": true, "granularity": "per_channel", "shape": [384, 1], "block_size": null,
     "analyzer": "minmax", "min": [...], "max": [...], "scale": [...], "offset": [...]}

``min``/``max`` are the quantizer's stored range and ``scale``/``offset`` (AIMET convention,
``real = (q + offset) * scale``) are derived from them; all are nested lists in ``shape`` (a bare number for
per-tensor). Floats are float32 values written with Python's shortest round-trip repr, so reading a file back
gives the same float32 bits.

Large encodings (more than ``INLINE_LIMIT`` numbers per field, e.g. int4 block-32 weights of a multi-billion
parameter model: ~94M blocks at 3B) would make a JSON file of many GB that no one can read back in bounded memory,
and blockwise ranges are bulk data no one reads by eye, whose decimal text costs more time to write than the
calibration that chose them (SmolLM2-135M's int4 block-32 ranges: 22 s of a 140 s GPTQ run). So an entry with
more than ``INLINE_LIMIT`` numbers per field, or a blockwise one with more than ``BLOCK_INLINE_LIMIT``, keeps
its numbers in a sidecar ``encodings.safetensors`` beside the JSON instead (schema version 2), and the entry
names the tensors that hold them::

    {"name": "...", ..., "data": {"file": "encodings.safetensors", "min": "NAME.min", "max": "NAME.max",
                                  "scale": "NAME.scale", "offset": "NAME.offset"}}

``min``/``max``/``scale`` are float32 and ``offset`` int32, each in ``shape``. A file with no sidecar entries is
written as version 1, so readers of version 1 keep working on everything they could read before.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .choices import GGML_SCALE_DTYPES
from .config import OnlineRotation, QuantizerPlan
from .errors import EncodingsError
from .io.jsonfile import NumberArray, dumps_indented, read_json_object
from .quant import QuantizerBase
from .quant.affine import min_max_to_scale_offset, resolve_block_size
from .quant.floatgrid import element_of, encoding_scales
from .quant.ggml import grid_from_range
from .quant.spec import Granularity, QuantSpec

__all__ = ["EncodingEntry", "EncodingsFile", "SidecarStream", "range_fault", "SCHEMA", "SCHEMA_VERSION",
           "INLINE_LIMIT", "BLOCK_INLINE_LIMIT", "SIDECAR"]

SCHEMA = "qtool.encodings"
SCHEMA_VERSION = 4  # the newest version this qtool writes and reads
READS_VERSIONS = (1, 2, 3, 4)
CODES_FILE = "codes.safetensors"  # integer codes chosen by a rounding algorithm (schema version 3, qtool.weights)
INLINE_LIMIT = 1 << 16  # numbers per field above which an entry's data goes to the sidecar
BLOCK_INLINE_LIMIT = 1 << 10  # the same for a blockwise entry (per_block): a tiny model's blocks stay readable
SIDECAR = "encodings.safetensors"


def _inline(numel: int, granularity: Granularity, inline_limit: Optional[int]) -> bool:
    """Whether an entry of ``numel`` numbers per field is written in the JSON itself (None: every entry is)."""
    if inline_limit is None:
        return True
    limit = min(inline_limit, BLOCK_INLINE_LIMIT) if granularity == Granularity.PER_BLOCK else inline_limit
    return numel <= limit


def range_fault(name: str, tensor: str, why: str, limits: str = "near float32's limits") -> Exception:
    """The one-line error for a quantizer whose range cannot be written (``why``): the checkpoint's fault for a
    weight, the calibration data's for an activation (``CheckpointError`` / ``DataError``)."""
    from .errors import CheckpointError, DataError

    if tensor == "weight":
        return CheckpointError(f"{name}: {why}: the checkpoint's weight holds NaN/Inf or values {limits}; nothing "
                               "was written")
    return DataError(f"{name}: {why}: the model produced NaN/Inf or values {limits} on the calibration data; "
                     "nothing was written")


@dataclass
class EncodingEntry:
    name: str
    module: str
    tensor: str
    bitwidth: int
    symmetric: bool
    granularity: Granularity
    shape: Tuple[int, ...]
    block_size: Optional[Tuple[int, ...]]
    analyzer: str
    min: Optional[torch.Tensor]  # None for a dynamic quantizer (its range is computed at run time)
    max: Optional[torch.Tensor]
    # (sidecar file, min key, max key) of an entry read lazily: min/max are then meta tensors until asked for
    source: Optional[Tuple[str, str, str]] = None
    dynamic: bool = False
    element: str = "int"  # int, or a float element (fp8_e4m3, fp4_e2m1): min/max are then -amax/amax
    scale_dtype: str = "float32"  # a float element's block scale type (float32, e8m0, fp8_e4m3)
    global_amax: Optional[float] = None  # NVFP4: the absolute maximum fused layers share their global scale from

    def __post_init__(self):
        spec = QuantSpec(self.bitwidth, self.symmetric, self.granularity, self.shape, self.block_size, self.analyzer,
                         self.scale_dtype, dynamic=self.dynamic, element=self.element)
        if self.dynamic != (self.min is None) or (self.min is None) != (self.max is None):
            raise ValueError(f"{self.name}: a dynamic entry has no min/max and a static one has both")
        self.granularity, self.shape, self.block_size = spec.granularity, spec.shape, spec.block_size
        self._spec = spec

    @property
    def spec(self) -> QuantSpec:
        """What this quantizer is (validated when the entry was made; raises ``ValueError`` otherwise)."""
        return self._spec

    @property
    def qmin_qmax(self) -> Tuple[int, int]:
        return self._spec.qmin_qmax

    def range(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(min, max)``, read from the sidecar now if this entry was read lazily (not kept)."""
        if self.dynamic:
            raise ValueError(f"{self.name} is dynamic: its range is computed from each call's values at run time")
        if self.source is None or self.min.device.type != "meta":
            return self.min, self.max
        from safetensors import safe_open

        file, kmin, kmax = self.source
        with safe_open(file, framework="pt") as fh:
            lo, hi = fh.get_tensor(kmin), fh.get_tensor(kmax)
        if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
            raise EncodingsError(f"{file}: {kmin}/{kmax}: min/max must be finite numbers")
        with torch.no_grad():
            scale, _ = self._scale_offset_of(lo.to(torch.float32), hi.to(torch.float32))
        if not torch.isfinite(scale).all():
            raise EncodingsError(f"{file}: {kmin}/{kmax}: the range overflows float32 when divided into steps (an "
                                 "infinite scale)")
        return lo, hi

    def materialized(self) -> "EncodingEntry":
        """This entry with its numbers in memory."""
        if self.source is None or self.min.device.type != "meta":
            return self
        lo, hi = self.range()
        return EncodingEntry(self.name, self.module, self.tensor, self.bitwidth, self.symmetric, self.granularity,
                             self.shape, self.block_size, self.analyzer, lo, hi, element=self.element,
                             scale_dtype=self.scale_dtype, global_amax=self.global_amax)

    @property
    def is_float(self) -> bool:
        return self.element != "int"

    def ggml_grid(self):
        """A GGUF K-quant / IQ4 entry's grid (``quant.ggml.KGrid``: stored scales and exact steps), from its
        sub-block ranges."""
        lo, hi = self.range()
        return grid_from_range(lo, hi, self._spec.ggml)

    def _scale_offset_of(self, lo: torch.Tensor, hi: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._spec.ggml is not None:  # the effective step, and the minimum in steps (not an integer for Q4_K)
            try:
                return grid_from_range(lo, hi, self._spec.ggml).step_offset(lo.shape)
            except ValueError:  # a scale GGUF cannot store (beyond float16): reads as an infinite one
                return torch.full_like(lo, math.inf), torch.zeros_like(lo)
        if self.is_float:
            eff = encoding_scales(torch.maximum(-lo, hi), element_of(self.element), self.scale_dtype,
                                  self._global_amax())[1]
            return eff, torch.zeros_like(eff)
        qmin, qmax = self.qmin_qmax
        return min_max_to_scale_offset(lo, hi, qmin, qmax, self.symmetric)

    def scale_offset(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """AIMET's ``(scale, offset)`` of an integer grid; for a float element, its effective scales (what
        multiplies an element value) and zero offsets."""
        lo, hi = self.range()
        with torch.no_grad():
            return self._scale_offset_of(lo, hi)

    def float_scales(self) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """A float element's ``(stored, effective, global)`` scales (``quant.floatgrid.encoding_scales``)."""
        if not self.is_float:
            raise ValueError(f"{self.name} is on an integer grid")
        lo, hi = self.range()
        return encoding_scales(torch.maximum(-lo, hi), element_of(self.element), self.scale_dtype,
                               self._global_amax())

    def _global_amax(self) -> Optional[torch.Tensor]:
        return None if self.global_amax is None else torch.tensor(self.global_amax, dtype=torch.float32)

    @classmethod
    def from_quantizer(cls, plan: QuantizerPlan, quantizer: QuantizerBase) -> "EncodingEntry":
        """The entry of a calibrated quantizer. Every calibration mode makes its entries here, so this is where a
        range that is not finite, or whose scale overflows float32, is refused (it would write NaN/Infinity)."""
        floating = {} if plan.element == "int" else {"element": plan.element, "scale_dtype": plan.scale_dtype}
        if plan.spec.ggml is not None:
            floating = {"scale_dtype": plan.scale_dtype}
        shared = getattr(quantizer, "global_amax", None)
        if shared is not None:
            floating["global_amax"] = float(shared) + 0.0  # (-0.0 -> 0.0: all-zero inputs have no sign)
            if not math.isfinite(floating["global_amax"]):
                raise range_fault(plan.name, plan.tensor, f"its largest absolute value {floating['global_amax']:.4g} "
                                  "is not a finite number a global scale can hold")
        if plan.dynamic:
            if plan.spec.calibrates and "global_amax" not in floating:
                from .errors import DataError

                raise DataError(f"{plan.name}: NVFP4 activations need a global scale from the calibration data, and "
                                "this layer never ran on it")
            return cls(plan.name, plan.module, plan.tensor, plan.bitwidth, plan.symmetric, plan.granularity, (),
                       plan.block_size, plan.analyzer_label, None, None, dynamic=True, **floating)
        entry = cls(plan.name, plan.module, plan.tensor, plan.bitwidth, plan.symmetric, plan.granularity,
                    tuple(plan.shape), plan.block_size, plan.analyzer_label,
                    quantizer.min.detach().cpu().clone(), quantizer.max.detach().cpu().clone(), **floating)
        entry.check_finite()
        return entry

    def finite_problem(self) -> Optional[str]:
        """Why this entry's numbers cannot be written (min/max not finite, or a scale that overflows float32),
        or None."""
        if self.dynamic or self.min.device.type == "meta":
            return None
        lo, hi = self.min.to(torch.float32), self.max.to(torch.float32)
        if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
            return "its calibrated range holds NaN or infinity"
        scale, _ = self.scale_offset()
        if not torch.isfinite(scale).all():
            if self._spec.ggml is not None:
                return (f"its range [{float(lo.min()):.4g}, {float(hi.max()):.4g}] needs {self._spec.ggml.name} "
                        "scales beyond float16's range (65504), which GGUF stores")
            return (f"its range [{float(lo.min()):.4g}, {float(hi.max()):.4g}] overflows float32 when divided into "
                    "steps (an infinite scale)")
        return None

    def check_finite(self) -> None:
        """Raise ``CheckpointError`` (a weight) or ``DataError`` (an activation) unless min, max and the derived
        scale are finite."""
        from .errors import CheckpointError

        bad = self.finite_problem()
        if bad is None:
            return
        if self.tensor == "weight" and self._spec.ggml is not None and "float16" in bad:
            raise CheckpointError(f"{self.name}: {bad}; nothing was written")
        raise range_fault(self.name, self.tensor, bad)

    def check_fits(self, key: str, shape) -> None:
        """Raise ``EncodingsError`` unless this encoding's shape/block_size applies to tensor ``key`` of ``shape``."""
        try:
            resolve_block_size(shape, self.shape, self.block_size)
        except ValueError as err:
            raise EncodingsError(
                f"encodings entry {self.name!r} (shape {list(self.shape)}) does not fit tensor {key!r} of shape "
                f"{list(shape)}: {err}; were they made for another model?"
            ) from None

    def numel(self) -> int:
        return 0 if self.dynamic else int(self.min.numel())

    def header_json(self) -> Dict[str, Any]:
        """Every field except the numbers."""
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
            **({"dynamic": True} if self.dynamic else {}),
            **({"element": self.element, "scale_dtype": self.scale_dtype} if self.is_float else {}),
            **({"scale_dtype": self.scale_dtype} if self._spec.ggml is not None else {}),
            **({"global_amax": self.global_amax} if self.global_amax is not None else {}),
        }

    def to_json(self, arrays: bool = False) -> Dict[str, Any]:
        """The entry's JSON object; ``arrays``: its numbers as :class:`NumberArray` (flat values and a shape, for
        :func:`dumps_indented`) instead of nested lists."""
        if self.dynamic:
            return self.header_json()
        e = self.materialized()
        scale, offset = e.scale_offset()
        numbers = {"min": e.min.to(torch.float32), "max": e.max.to(torch.float32), "scale": scale.to(torch.float32),
                   "offset": offset.round().to(torch.int64)}
        if arrays:
            return {**self.header_json(), **{k: NumberArray(t.detach().cpu().reshape(-1).tolist(), tuple(t.shape))
                                              for k, t in numbers.items()}}
        return {**self.header_json(), **{k: t.detach().cpu().tolist() for k, t in numbers.items()}}

    def sidecar_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        """(key, tensor) for this entry's numbers in the sidecar file, in the order they are stored."""
        e = self.materialized()
        scale, offset = e.scale_offset()
        shape = tuple(self.shape)
        return [(f"{self.name}.min", e.min.to(torch.float32).reshape(shape)),
                (f"{self.name}.max", e.max.to(torch.float32).reshape(shape)),
                (f"{self.name}.scale", scale.to(torch.float32).reshape(shape)),
                (f"{self.name}.offset", offset.round().to(torch.int32).reshape(shape))]

    @classmethod
    def from_json(cls, obj: Dict[str, Any], where: str, sidecar: Optional["_Sidecar"] = None,
                  lazy: bool = False) -> "EncodingEntry":
        source = None
        dynamic = obj.get("dynamic", False)
        if not isinstance(dynamic, bool):
            raise EncodingsError(f"{where}: dynamic must be true or false (got {str(dynamic)[:40]!r})")
        for key in ("shape", "block_size"):
            if key in obj and not (isinstance(obj[key], list) or (key == "block_size" and obj[key] is None)):
                raise EncodingsError(f"{where}: {key} must be a list of integers{' or null' if key == 'block_size' else ''}"
                                     f" (got {str(obj[key])[:40]!r})")
        floating = {"element": obj.get("element", "int"), "scale_dtype": obj.get("scale_dtype", "float32")}
        if "scale_dtype" in obj and floating["element"] == "int" and obj["scale_dtype"] not in GGML_SCALE_DTYPES:
            raise EncodingsError(f"{where}: scale_dtype is stored for float elements and GGUF types only (an integer "
                                 "entry's min/max already hold its scales)")
        if not all(isinstance(v, str) for v in floating.values()):
            raise EncodingsError(f"{where}: element and scale_dtype must be strings")
        if "global_amax" in obj:
            g = obj["global_amax"]
            if floating["scale_dtype"] != "fp8_e4m3" or isinstance(g, bool) or not isinstance(g, (int, float)) \
                    or not math.isfinite(g) or g < 0 or g > 3.4e38:
                raise EncodingsError(f"{where}: global_amax must be a finite number >= 0, and only NVFP4 "
                                     f"(scale_dtype fp8_e4m3) entries have one (got {str(g)[:40]!r})")
            floating["global_amax"] = float(g)
        try:
            shape = tuple(int(d) for d in obj["shape"])
            bits = obj["bitwidth"]
            spec = QuantSpec(int(bits) if isinstance(bits, float) and bits.is_integer() else bits, obj["symmetric"],
                             obj["granularity"], shape,
                             None if obj.get("block_size") is None else tuple(int(b) for b in obj["block_size"]),
                             str(obj.get("analyzer", "minmax")), floating["scale_dtype"], dynamic=dynamic,
                             element=floating["element"])
        except KeyError as e:
            raise EncodingsError(f"{where}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError, OverflowError) as e:
            raise EncodingsError(f"{where}: {str(e).splitlines()[0]}") from None
        if obj.get("tensor") not in ("weight", "input", "output", "k_cache", "v_cache"):
            raise EncodingsError(f"{where}: tensor must be weight, input, output, k_cache or v_cache (got "
                                 f"{str(obj.get('tensor'))[:40]!r})")
        if obj["tensor"] in ("k_cache", "v_cache") and floating["element"] == "int":
            raise EncodingsError(f"{where}: {obj['tensor']} quantizers are FP8 (element fp8_e4m3)")
        if dynamic:
            if obj["tensor"] == "weight":
                raise EncodingsError(f"{where}: a weight cannot be dynamic (only activations are)")
            stored = [k for k in ("min", "max", "scale", "offset", "data") if k in obj]
            if stored:
                raise EncodingsError(f"{where}: a dynamic entry stores no range (it has {stored[0]!r})")
            try:
                return cls(name=str(obj["name"]), module=str(obj["module"]), tensor=obj["tensor"],
                           bitwidth=spec.bitwidth, symmetric=spec.symmetric, granularity=spec.granularity,
                           shape=spec.shape, block_size=spec.block_size, analyzer=spec.analyzer, min=None, max=None,
                           dynamic=True, **floating)
            except KeyError as e:
                raise EncodingsError(f"{where}: missing field {e.args[0]!r}") from None
            except ValueError as e:
                raise EncodingsError(f"{where}: {str(e).splitlines()[0]}") from None
        try:
            if "data" in obj:
                if sidecar is None:
                    raise EncodingsError(f"{where}: 'data' needs schema_version 2")
                lo, hi, source = sidecar.range(obj["data"], shape, where, lazy)
            else:
                lo = torch.tensor(obj["min"], dtype=torch.float32).reshape(shape)
                hi = torch.tensor(obj["max"], dtype=torch.float32).reshape(shape)
            entry = cls(
                name=str(obj["name"]), module=str(obj["module"]), tensor=obj["tensor"], bitwidth=spec.bitwidth,
                symmetric=spec.symmetric, granularity=spec.granularity, shape=spec.shape, block_size=spec.block_size,
                analyzer=spec.analyzer, min=lo, max=hi, source=source, **floating,
            )
        except KeyError as e:
            raise EncodingsError(f"{where}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise EncodingsError(f"{where}: malformed entry ({str(e).splitlines()[0]})") from None
        if source is None and not (torch.isfinite(entry.min).all() and torch.isfinite(entry.max).all()):
            raise EncodingsError(f"{where}: min/max must be finite numbers")
        if source is None and bool((entry.min > entry.max).any()):
            raise EncodingsError(f"{where}: min is above max")
        if source is None and entry.is_float and not torch.equal(-entry.min, entry.max):
            raise EncodingsError(f"{where}: a float element's range is symmetric: min must be -max")
        problem = entry.finite_problem() if source is None else None
        if problem is not None:
            raise EncodingsError(f"{where}: {problem}")
        if source is None and ("scale" in obj or "offset" in obj):
            _check_stored_scale_offset(entry, obj, where)
        return entry


def _check_stored_scale_offset(entry: EncodingEntry, obj: Dict[str, Any], where: str) -> None:
    """The scale and offset a file stores beside min/max are derived from them; a file where they disagree was
    edited by hand or by another tool, and reading either one would silently ignore the other."""
    scale, offset = entry.scale_offset()
    for key, derived, dtype in (("scale", scale, torch.float32), ("offset", offset.round(), torch.int64)):
        if key not in obj:
            continue
        try:
            stored = torch.tensor(obj[key], dtype=torch.float64).reshape(derived.shape)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise EncodingsError(f"{where}: malformed {key} ({str(e).splitlines()[0][:80]})") from None
        if not torch.equal(stored.to(dtype), derived.to(dtype)):
            raise EncodingsError(f"{where}: the stored {key} disagrees with the one min/max give (qtool derives "
                                 f"scale and offset from min/max: edit those, or drop {key})")


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


class SidecarStream:
    """Writes the sidecar while calibrating: the large entries are declared up front (their shapes are known
    from the plan) and each one's numbers go to disk as soon as it is calibrated, so the block min/max of a
    whole model are never all in memory. ``put`` returns the entry with its numbers replaced by meta tensors
    of the same shape; :meth:`EncodingsFile.write` then only writes the JSON for those."""

    def __init__(self, path: Path, shapes: List[Tuple[str, Tuple[int, ...], Granularity]],
                 inline_limit: int = INLINE_LIMIT):
        """``shapes``: (name, encoding shape, granularity) of every entry that may be put, in the order they come."""
        from .io.st_writer import StreamingSafetensorsWriter

        self.inline_limit = inline_limit
        self.big = {name for name, shape, gran in shapes
                    if not _inline(math.prod(int(d) for d in shape), gran, inline_limit)}
        decl = [(f"{name}.{f}", dt, tuple(shape)) for name, shape, _ in shapes if name in self.big
                for f, dt in (("min", torch.float32), ("max", torch.float32), ("scale", torch.float32),
                              ("offset", torch.int32))]
        self.path = Path(path)
        self._writer = StreamingSafetensorsWriter(self.path, decl, metadata={"format": "pt", "schema": SCHEMA}) \
            if decl else None

    def put(self, entry: EncodingEntry) -> EncodingEntry:
        if entry.name not in self.big:
            return entry
        for key, t in entry.sidecar_tensors():
            self._writer.write(key, t)
        meta = torch.empty(tuple(entry.shape), device="meta")
        return dataclasses.replace(entry, min=meta, max=meta, source=None)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def abort(self) -> None:
        """Close without the every-tensor-written check (the run failed; its output directory is discarded)."""
        if self._writer is not None:
            self._writer.abort()



@dataclass
class EncodingsFile:
    entries: List[EncodingEntry]
    meta: Dict[str, Any]
    data_files: List[Path] = field(default_factory=list)  # sidecar files this was read from
    # file beside the JSON holding stored integer codes / updated float weights (qtool.weights), or None
    codes_file: Optional[str] = None
    # rotations of activations at run time (r4) the model must apply to compute what the encodings describe;
    # written as "online_rotations" (schema version 4: a reader that does not know them must refuse the file)
    online: List[OnlineRotation] = field(default_factory=list)

    def by_name(self) -> Dict[str, EncodingEntry]:
        return {e.name: e for e in self.entries}

    def _inline(self, e: EncodingEntry, inline_limit: Optional[int]) -> bool:
        return _inline(e.numel(), e.granularity, inline_limit)

    def _entry_json(self, e: EncodingEntry, inline_limit: Optional[int], arrays: bool = False) -> Dict[str, Any]:
        if self._inline(e, inline_limit):
            return e.to_json(arrays)
        return {**e.header_json(), "data": {
            "file": SIDECAR, **{f: f"{e.name}.{f}" for f in ("min", "max", "scale", "offset")}}}

    def _head(self, inline_limit: Optional[int]) -> Dict[str, Any]:
        version = 1 if all(self._inline(e, inline_limit) for e in self.entries) else 2
        meta = {k: v for k, v in self.meta.items() if k not in _RESERVED}
        if self.online:
            return {"schema": SCHEMA, "schema_version": 4, **meta,
                    **({"codes": {"file": self.codes_file}} if self.codes_file is not None else {}),
                    "online_rotations": [r.to_json() for r in self.online]}
        if self.codes_file is not None:
            return {"schema": SCHEMA, "schema_version": 3, **meta, "codes": {"file": self.codes_file}}
        return {"schema": SCHEMA, "schema_version": version, **meta}

    def to_json(self, inline_limit: Optional[int] = None) -> Dict[str, Any]:
        """The JSON object; entries above ``inline_limit`` numbers refer to the sidecar (None: all inline)."""
        return {**self._head(inline_limit), "quantizers": [self._entry_json(e, inline_limit) for e in self.entries]}

    def iter_dumps(self, inline_limit: Optional[int] = None) -> Iterator[str]:
        """The text of :meth:`dumps` piece by piece, one entry at a time: the same bytes as
        ``json.dumps(to_json(), indent=1) + "\\n"`` without holding every entry's numbers as Python objects at
        once (per-channel encodings of a multi-billion-parameter model are millions of them)."""
        head = json.dumps(self._head(inline_limit), indent=1, allow_nan=False)
        if not self.entries:
            yield head[:-2] + ',\n "quantizers": []\n}\n'
            return
        yield head[:-2] + ',\n "quantizers": [\n'  # head ends with "\n}"
        for i, e in enumerate(self.entries):
            try:
                text = dumps_indented(self._entry_json(e, inline_limit, arrays=True), 1, 2)
            except ValueError:  # NaN or an infinity: JSON cannot hold it, and qtool's reader would refuse it
                raise EncodingsError(f"{e.name}: its encoding holds NaN or infinity; nothing was written") from None
            yield ("" if i == 0 else ",\n") + "  " + text
        yield "\n ]\n}\n"

    def dumps(self, inline_limit: Optional[int] = None) -> str:
        return "".join(self.iter_dumps(inline_limit))

    def write(self, path: str | Path, inline_limit: Optional[int] = INLINE_LIMIT) -> List[Path]:
        """Write ``path`` (the JSON) and, when some entry is larger than ``inline_limit`` numbers, the sidecar
        ``encodings.safetensors`` beside it (streamed, one tensor at a time). Returns the files written."""
        from .io.st_writer import StreamingSafetensorsWriter

        path = Path(path)
        big = [e for e in self.entries if not self._inline(e, inline_limit)]
        written = []
        streamed = [e for e in big if e.min.device.type == "meta" and e.source is None]
        if streamed:  # a SidecarStream wrote them while calibrating (and nothing else may be big)
            if len(streamed) != len(big):
                raise ValueError("some large entries were streamed to the sidecar and some were not")
            big = []
            written.append(path.parent / SIDECAR)
        if big:
            decl = [(f"{e.name}.{f}", dt, e.shape) for e in big
                    for f, dt in (("min", torch.float32), ("max", torch.float32), ("scale", torch.float32),
                                  ("offset", torch.int32))]
            with StreamingSafetensorsWriter(path.parent / SIDECAR, decl,
                                            metadata={"format": "pt", "schema": SCHEMA}) as w:
                for e in big:
                    for key, t in e.sidecar_tensors():
                        w.write(key, t)
            written.append(path.parent / SIDECAR)
        with open(path, "w", encoding="utf-8") as fh:
            for piece in self.iter_dumps(inline_limit):
                fh.write(piece)
        if self.codes_file is not None:
            written.append(path.parent / self.codes_file)
        return [path] + written

    def materialized(self) -> "EncodingsFile":
        """Every entry's numbers in memory (after a lazy :meth:`read`)."""
        return EncodingsFile([e.materialized() for e in self.entries], self.meta, self.data_files, self.codes_file,
                             self.online)

    @classmethod
    def read(cls, path: str | Path, lazy: bool = False) -> "EncodingsFile":
        """Read an encodings file. ``lazy``: entries kept in the sidecar are read when their numbers are asked
        for (``scale_offset``, ``range``, ``materialized``), one at a time, instead of all now."""
        path = Path(path)
        obj = read_json_object(path, EncodingsError, "encodings file", strict=True)
        if obj.get("schema") != SCHEMA:
            raise EncodingsError(f"{path}: not a qtool encodings file (expected \"schema\": \"{SCHEMA}\")")
        version = obj.get("schema_version")
        if version not in READS_VERSIONS or isinstance(version, bool):
            raise EncodingsError(
                f"{path}: schema_version {version!r} is not supported (this qtool reads "
                f"{', '.join(map(str, READS_VERSIONS))})"
            )
        raw = obj.get("quantizers")
        if not isinstance(raw, list):
            raise EncodingsError(f"{path}: 'quantizers' must be a list")
        sidecar = _Sidecar(path) if version >= 2 else None
        entries = [EncodingEntry.from_json(e, f"{path}: quantizers[{i}]", sidecar, lazy) if isinstance(e, dict)
                   else _bad_entry(path, i) for i, e in enumerate(raw)]
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            seen = set()
            dup = next(n for n in names if n in seen or seen.add(n))
            raise EncodingsError(f"{path}: quantizer {dup!r} appears twice")
        meta = {k: v for k, v in obj.items() if k not in _RESERVED}
        if version < 4 and "online_rotations" in obj:
            raise EncodingsError(f"{path}: 'online_rotations' needs schema_version 4 (this file says {version})")
        online = _read_online(obj.get("online_rotations"), path) if version >= 4 else []
        kv = {e.module for e in entries if e.tensor == "k_cache"}
        for i, rot in enumerate(online):
            bare = next((m for m in rot.modules if m not in kv), None) if rot.location == "k_cache" else None
            if bare is not None:  # r3 rotates what a KV cache quantizer sees: without one it means nothing
                raise EncodingsError(f"{path}: online_rotations[{i}]: {bare!r} has no quantized KV cache (no "
                                     "k_cache quantizer in this file) for its key rotation")
        codes_file = None
        data_files = [] if sidecar is None else sidecar.files()
        if version >= 3 and obj.get("codes") is not None:
            codes = obj["codes"]
            name = codes.get("file") if isinstance(codes, dict) else None
            if not isinstance(name, str) or not name or Path(name).name != name:
                raise EncodingsError(f"{path}: 'codes' must be {{\"file\": NAME}} naming a file beside the JSON")
            if not (path.parent / name).is_file():
                raise EncodingsError(f"{path.parent / name}: codes file not found (named by {path})")
            codes_file = name
            data_files.append(path.parent / name)
        return cls(entries, meta, data_files, codes_file, online)


_RESERVED = ("schema", "schema_version", "quantizers", "codes", "online_rotations")


def _read_online(raw: Any, path: Path) -> List[OnlineRotation]:
    """The ``online_rotations`` list of a version-4 file, each checked (the modules they name are checked against
    the model when the encodings are applied)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise EncodingsError(f"{path}: 'online_rotations' must be a list")
    out, seen = [], set()
    for i, r in enumerate(raw):
        where = f"{path}: online_rotations[{i}]"
        if not isinstance(r, dict) or set(r) != {"name", "type", "seed", "location", "modules"}:
            raise EncodingsError(f"{where}: must be an object with name, type, seed, location and modules")
        mods = r["modules"]
        if r["type"] not in ("hadamard", "random-hadamard"):
            raise EncodingsError(f"{where}: type {r['type']!r} is not hadamard or random-hadamard")
        if r["location"] not in ("input", "k_cache"):
            raise EncodingsError(f"{where}: location {r['location']!r} is not supported (input, k_cache)")
        if not isinstance(r["seed"], int) or isinstance(r["seed"], bool) or not 0 <= r["seed"] < 2**63:
            raise EncodingsError(f"{where}: seed must be an integer from 0 to 2^63-1")
        if not isinstance(r["name"], str) or not r["name"]:
            raise EncodingsError(f"{where}: name must be a non-empty string")
        if not isinstance(mods, list) or not mods or not all(isinstance(m, str) and m for m in mods):
            raise EncodingsError(f"{where}: modules must be a non-empty list of module names")
        twice = next((m for m in mods if m in seen or seen.add(m)), None)
        if twice is not None:
            raise EncodingsError(f"{where}: module {twice!r} is rotated twice")
        if any(o.name == r["name"] for o in out):  # exporters name a transform after it (compressed-tensors' R4)
            raise EncodingsError(f"{where}: name {r['name']!r} is used twice")
        out.append(OnlineRotation(r["name"], r["type"], r["seed"], tuple(mods), r["location"]))
    return out


def _bad_entry(path, i):
    raise EncodingsError(f"{path}: quantizers[{i}] must be an object")
