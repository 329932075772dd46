"""Wording shared by every recipe error: a key path (``layers[0].weights.bitwidth``), a pydantic error in one
line, and a "did you mean" for a misspelt key or value."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Sequence


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (error lines never echo a whole rejected value)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return text[:limit - 5] + "...)" if text.endswith(")") else text[:limit - 3] + "..."


def _key_path(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _describe(err: Dict[str, Any], fields: Sequence[str] = ()) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        word = err["loc"][-1] if err["loc"] else None
        nested = _SYNONYMS.get(word, word) if len(err["loc"]) == 1 else None
        if nested in ("weights", "activations"):  # (a recipe's top level holds defaults and layers, not these)
            return (f"unknown key at the top level (did you mean 'defaults.{nested}'? {nested} sit under defaults, "
                    "or under a layers entry)")
        return "unknown key" + _did_you_mean(word, fields)
    if err["type"] == "literal_error":
        expected = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
        return f"{msg} (got {_short(err.get('input'))}){_did_you_mean(err.get('input'), expected)}"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err["type"] in ("literal_error", "int_parsing", "bool_parsing", "greater_than_equal", "less_than_equal",
                       "int_type", "float_type", "bool_type", "string_type", "list_type", "dict_type", "model_type",
                       "greater_than", "int_from_float"):
        msg = f"{msg} (got {_short(err.get('input'))})"
    return msg


# keys other tools use for ours (a recipe written from memory of llm-compressor, AIMET or torchao)
_SYNONYMS = {"name": "match", "pattern": "match", "regex": "match", "module": "match", "targets": "type",
             "bits": "bitwidth", "num_bits": "bitwidth", "sym": "symmetric", "group_size": "block_size",
             "strategy": "granularity", "observer": "analyzer", "exclude": "ignore", "skip": "ignore",
             "weight": "weights", "activation": "activations", "input_activations": "activations"}


def _did_you_mean(word: Any, choices: Sequence[str]) -> str:
    import difflib

    if not isinstance(word, str) or not choices:
        return ""
    if _SYNONYMS.get(word) in choices:
        return f" (did you mean {_SYNONYMS[word]!r}?)"
    close = difflib.get_close_matches(word, list(choices), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def fields_at(root: Any, loc: Sequence[Any]) -> List[str]:
    """The keys allowed in the mapping that holds the last element of ``loc``, a path from the pydantic model
    ``root`` (for did-you-mean hints)."""
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_of(field.annotation)
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}))


def _model_of(annotation) -> Any:
    """The pydantic model inside ``Optional[...]`` / ``List[...]`` (None for anything else)."""
    import typing

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None
