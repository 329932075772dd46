"""One reader for every JSON file qtool reads (encodings, AIMET files, configs, indexes, tokenizers).

Every failure is one line naming the file, raised as the caller's error type: missing, unreadable, not UTF-8, not
JSON, nested too deep, not an object. ``strict`` (qtool's and AIMET's encodings) also refuses what Python's ``json``
would accept silently: a key given twice in one object (the last would win) and the non-standard ``NaN`` and
``Infinity`` (no runtime reads them back).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple, Type

__all__ = ["read_json_object", "loads_strict", "dumps_indented", "NumberArray"]


def _no_duplicate_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    obj: Dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key[:60]!r} appears twice in one object")
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads_strict(text: str | bytes) -> Any:
    """``json.loads`` that refuses a key given twice in one object and the NaN/Infinity constants (ValueError)."""
    return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)


def read_json_object(path: str | Path, error: Type[Exception], what: str, strict: bool = False) -> Dict[str, Any]:
    """The JSON object in ``path`` (``what`` names the kind of file in messages), or ``error`` with one line."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory; expected the {what}") from None
    except OSError as e:
        raise error(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a readable {what}: not UTF-8 text (byte {e.start})") from None
    try:
        obj = loads_strict(text) if strict else json.loads(text)
    except RecursionError:
        raise error(f"{path}: not a readable {what}: nested too deep") from None
    except ValueError as e:
        raise error(f"{path}: not a readable {what}: not valid JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: {what} must be a JSON object (found {type(obj).__name__})")
    return obj


_SCALAR_TYPES = frozenset((int, float, bool, type(None)))


def _scalars_only(values: list) -> bool:
    """Whether ``values`` holds only numbers, booleans and nulls (exact types: a subclass takes the general path)."""
    return set(map(type, values)) <= _SCALAR_TYPES


@dataclass(frozen=True)
class NumberArray:
    """A JSON array of numbers of any nesting, given flat (row-major ``values``) with its ``shape``: what
    ``tensor.tolist()`` gives, for :func:`dumps_indented` to write without building the nested lists."""

    values: List[Any]
    shape: Tuple[int, ...]

    def tolist(self) -> Any:
        def nest(values: List[Any], shape: Tuple[int, ...]) -> Any:
            if not shape:
                return values[0]
            step = math.prod(shape[1:])
            return [nest(values[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]

        return nest(list(self.values), tuple(self.shape))


def _array_text(values: List[Any], shape: Tuple[int, ...], indent: int, level: int) -> str:
    pad, inner = " " * (indent * level), " " * (indent * (level + 1))
    if not shape or 0 in shape:  # a scalar, or an array with no numbers (nested empty lists): json itself
        return dumps_indented(NumberArray(values, shape).tolist(), indent, level)
    if len(shape) == 1:
        return "[\n" + inner + json.dumps(values, allow_nan=False)[1:-1].replace(", ", ",\n" + inner) + "\n" + pad + "]"
    if len(shape) == 2 and shape[1] == 1:  # (out, 1): a per-channel range, one C call for every row
        inner2 = inner + " " * indent
        body = json.dumps(values, allow_nan=False)[1:-1].replace(", ", "\n" + inner + "],\n" + inner + "[\n" + inner2)
        return "[\n" + inner + "[\n" + inner2 + body + "\n" + inner + "]\n" + pad + "]"
    step = math.prod(shape[1:])
    rows = (_array_text(values[i * step:(i + 1) * step], shape[1:], indent, level + 1) for i in range(shape[0]))
    return "[\n" + inner + (",\n" + inner).join(rows) + "\n" + pad + "]"


def dumps_indented(obj: Any, indent: int = 1, level: int = 0) -> str:
    """``json.dumps(obj, indent=indent)``, the same text, at the C encoder's speed for long lists of numbers.

    With an indent, Python's ``json`` encodes in pure Python, element by element (an encodings file's per-channel
    ranges are hundreds of thousands of floats: seconds). A list of numbers, booleans and nulls is encoded here by
    the C encoder on one line, and its ``", "`` separators (which none of those values contains) become the
    indented line breaks; a :class:`NumberArray` (a tensor's numbers, flat, with its shape) is written the same
    way a row at a time, and a per-channel ``(out, 1)`` array in one C call. ``level`` is the nesting depth ``obj``
    sits at. NaN and infinities raise ``ValueError``: a file qtool writes holds numbers JSON can read back."""
    if isinstance(obj, NumberArray):
        return _array_text(list(obj.values), tuple(obj.shape), indent, level)
    pad, inner = " " * (indent * level), " " * (indent * (level + 1))
    if isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj):
        items = (f"{json.dumps(k)}: {dumps_indented(v, indent, level + 1)}" for k, v in obj.items())
        return "{\n" + inner + (",\n" + inner).join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)) and obj:
        if _scalars_only(obj):
            return "[\n" + inner + json.dumps(obj, allow_nan=False)[1:-1].replace(", ", ",\n" + inner) + "\n" + pad + "]"
        return "[\n" + inner + (",\n" + inner).join(dumps_indented(v, indent, level + 1) for v in obj) + \
            "\n" + pad + "]"
    # anything else (scalars, empty containers, dicts with non-string keys): json itself, re-indented to ``level``
    return json.dumps(obj, indent=indent, allow_nan=False).replace("\n", "\n" + pad)
