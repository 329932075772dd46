"""``--format aimet``: AIMET encodings alone (``model.encodings``, written by the pipeline for every format that
wants it, in the ``--encoding-version`` asked for; see ``qtool.aimet_format``). Parameters are keyed by the
checkpoint's tensor names."""

from __future__ import annotations

from typing import Any, Dict

from .base import Exporter, ExportRequest
from .qtool_st import match_weight_names

__all__ = ["AimetExporter", "EXPORTER"]


class AimetExporter(Exporter):
    name = "aimet"
    aimet_json = "always"

    def write(self, request: ExportRequest, options: Exporter.Options) -> Dict[str, Any]:
        weights = [e for e in request.encodings.entries if e.tensor == "weight"]
        return {"names": match_weight_names(weights, request.weights.keys(), str(request.checkpoint))}


EXPORTER = AimetExporter()
