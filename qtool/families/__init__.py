"""Model families: one file per Hugging Face architecture says everything qtool knows of it.

Each module of this package that defines ``FAMILY`` (a :class:`~qtool.families.base.Family`) is one family; adding
a family is adding such a file (and a tiny-model test: docs/architecture.md, "Adding a model family"). A model
whose ``model_type`` no family claims is still quantized (every ``nn.Linear``, every recognizable fused expert
tensor); the paths that need the architecture (GGUF export, rotations) refuse it in one line.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Dict, Optional, Tuple

from .base import LLAMA_SMOOTH_MAPPINGS, Family

__all__ = ["Family", "FAMILIES", "family_of", "family_of_model", "rms_norm_classes", "gguf_model_types",
           "LLAMA_SMOOTH_MAPPINGS"]


def _discover() -> Dict[str, Family]:
    found: Dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name == "base":
            continue
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            for model_type in family.model_types:
                if model_type in found:
                    raise RuntimeError(f"model_type {model_type!r} claimed by two family files")
                found[model_type] = family
    return found


#: Hugging Face model_type -> its family
FAMILIES: Dict[str, Family] = _discover()


def family_of(model_type) -> Optional[Family]:
    """The family of a config.json ``model_type`` (None for one qtool has no file for)."""
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def family_of_model(model) -> Optional[Family]:
    """The family of a loaded model (by its ``config.model_type``)."""
    return family_of(getattr(getattr(model, "config", None), "model_type", None))


def rms_norm_classes() -> Tuple[str, ...]:
    """Every family's plain RMSNorm classes (``x / rms(x) · w``), in family order."""
    out: Dict[str, None] = {}
    for family in FAMILIES.values():
        out.update(dict.fromkeys(family.rms_norms))
    return tuple(out)


def gguf_model_types() -> Tuple[str, ...]:
    """The model_types qtool writes GGUF for."""
    return tuple(t for t, f in FAMILIES.items() if f.gguf_arch is not None)
