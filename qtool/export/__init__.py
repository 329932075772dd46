"""Exporters: one module per output format, each with one :class:`qtool.export.base.Exporter` subclass.

``FORMATS`` is the registry: format name -> (module, one-line help). The CLI's ``--format`` choices, ``inspect``
and the pipeline all read it; an exporter module is imported only when its format is used (``qtool --help`` stays
fast). Adding a format: one new module here with its ``EXPORTER`` plus its tests, and one line below.
"""

from __future__ import annotations

import importlib
from typing import Dict, Tuple

__all__ = ["FORMATS", "get_exporter", "format_names"]

FORMATS: Dict[str, Tuple[str, str]] = {
    "qtool": ("qtool_st", "integer safetensors with scales and offsets"),
    "aimet": ("aimet", "AIMET encodings only (model.encodings)"),
    "onnx": ("onnx_qdq", "ONNX graph with QuantizeLinear/DequantizeLinear"),
    "compressed-tensors": ("compressed_tensors", "Hugging Face directory that transformers and vLLM load"),
    "gguf": ("gguf", "one model.gguf that llama.cpp runs (Q8_0, Q5_0/1, Q4_0/1, K-quants Q2_K-Q6_K, IQ4_NL/XS and llama-quantize's mixes; Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE)"),
}


def format_names() -> Tuple[str, ...]:
    return tuple(FORMATS)


def get_exporter(name: str):
    """The exporter of format ``name``; raises ``UsageError`` naming the choices for an unknown one."""
    from ..errors import UsageError

    if name not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)} (got {str(name)[:40]!r})")
    module = importlib.import_module(f"{__name__}.{FORMATS[name][0]}")
    return module.EXPORTER
