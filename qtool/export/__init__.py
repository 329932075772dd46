"""Exporters: one module per output format, each with one :class:`qtool.export.base.Exporter` subclass.

``FORMATS`` is the registry: format name -> (module, one-line help). The CLI's ``--format`` choices, ``inspect``
and the pipeline all read it; an exporter module is imported only when its format is used (``qtool --help`` stays
fast). Adding a format: one new module here with its ``EXPORTER`` plus its tests, and one line below.
"""

from __future__ import annotations

import importlib
from typing import Dict, Optional, Tuple

__all__ = ["FORMATS", "get_exporter", "format_names", "check_export_choices"]

FORMATS: Dict[str, Tuple[str, str]] = {
    "qtool": ("qtool_st", "integer safetensors with scales and offsets"),
    "aimet": ("aimet", "AIMET encodings only (model.encodings)"),
    "onnx": ("onnx_qdq", "ONNX graph with QuantizeLinear/DequantizeLinear"),
    "compressed-tensors": ("compressed_tensors", "Hugging Face directory that transformers and vLLM load"),
    "gguf": ("gguf", "one model.gguf that llama.cpp runs (Q8_0, Q5_0/1, Q4_0/1, K-quants Q2_K-Q6_K, IQ4_NL/XS and "
                     "llama-quantize's mixes)"),
}


def format_names() -> Tuple[str, ...]:
    return tuple(FORMATS)


def check_export_choices(format: Optional[str] = None, encoding_version: Optional[str] = None,
                         ct_eight_bit_format: Optional[str] = None, gguf_float: Optional[str] = None,
                         gguf_fallback: Optional[str] = None) -> None:
    """Every choice-valued export option that is given, checked against its choices (the error names the flag).
    The CLI's early check and ``ExportOptions.validate`` both run this one; torch is not imported."""
    from ..choices import AIMET_VERSIONS, CT_EIGHT_BIT_FORMATS, GGUF_FALLBACKS, GGUF_FLOAT_TYPES, check_choice

    for flag, value, choices in (("--format", format, format_names()),
                                 ("--encoding-version", encoding_version, AIMET_VERSIONS),
                                 ("--ct-8bit-format", ct_eight_bit_format, CT_EIGHT_BIT_FORMATS),
                                 ("--gguf-float", gguf_float, GGUF_FLOAT_TYPES),
                                 ("--gguf-fallback", gguf_fallback, GGUF_FALLBACKS)):
        if value is not None:
            check_choice(flag, value, choices)


def get_exporter(name: str):
    """The exporter of format ``name``; raises ``UsageError`` naming the choices for an unknown one."""
    from ..errors import UsageError

    if name not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)} (got {str(name)[:40]!r})")
    module = importlib.import_module(f"{__name__}.{FORMATS[name][0]}")
    return module.EXPORTER
