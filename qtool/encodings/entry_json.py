"""One encodings entry as JSON: the object written (numbers inline, or named in the sidecar), and the entry read
back from one, every field checked."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..choices import GGML_SCALE_DTYPES
from ..errors import EncodingsError
from ..io.jsonfile import NumberArray
from ..quant.spec import QuantSpec
from .sidecar import _Sidecar


class EntryJson:
    """The JSON of :class:`~qtool.encodings.EncodingEntry` (a mixin: it reads the record's fields)."""

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
                  lazy: bool = False) -> "EntryJson":
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
        problem = range_problem(entry) if source is None else None  # a lazy entry is checked when it is read
        if problem is not None:
            raise EncodingsError(f"{where}: {problem}")
        if source is None and ("scale" in obj or "offset" in obj):
            _check_stored_scale_offset(entry, obj, where)
        return entry


def range_problem(entry) -> Optional[str]:
    """Why the range a file gives ``entry`` (its numbers in memory) cannot be used, or None."""
    if not (torch.isfinite(entry.min).all() and torch.isfinite(entry.max).all()):
        return "min/max must be finite numbers"
    if bool((entry.min > entry.max).any()):
        return "min is above max"
    if entry.is_float and not torch.equal(-entry.min, entry.max):
        return "a float element's range is symmetric: min must be -max"
    problem = entry.finite_problem()
    if problem is not None:
        return problem
    # NVFP4's global scale puts the largest block's scale at FP8's largest value: a global_amax below a block's
    # amax saturates those scales and clips the weights (vLLM fuses q/k/v on the largest of their global scales)
    if entry.global_amax is not None and \
            float(entry.max.max()) > float(torch.tensor(entry.global_amax, dtype=torch.float32)):
        return (f"global_amax {entry.global_amax:.6g} is below the largest amax of its blocks "
                f"({float(entry.max.max()):.6g}); it is the absolute maximum of the weight (and of the weights fused "
                "with it)")
    return None


def _check_stored_scale_offset(entry, obj: Dict[str, Any], where: str) -> None:
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
