"""One reader for every JSON file qtool reads (encodings, AIMET files, configs, indexes, tokenizers).

Every failure is one line naming the file, raised as the caller's error type: missing, unreadable, not UTF-8, not
JSON, nested too deep, not an object. ``strict`` (qtool's and AIMET's encodings) also refuses what Python's ``json``
would accept silently: a key given twice in one object (the last would win) and the non-standard ``NaN`` and
``Infinity`` (no runtime reads them back).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple, Type

__all__ = ["read_json_object", "loads_strict"]


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
