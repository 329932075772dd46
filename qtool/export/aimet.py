"""``--format aimet``: AIMET encodings alone (``model.encodings``, written by the pipeline for every format that
wants it, in the ``--encoding-version`` asked for; see ``qtool.aimet_format``). Parameters are keyed by the
checkpoint's tensor names, and the encodings apply to the checkpoint's own weights: a calibration that changed
them (rotations, SmoothQuant, AWQ, folded batch norms, codes chosen by GPTQ / AdaRound / SignRound) is refused,
since the file alone would quantize the unchanged weights with ranges and codes made for the changed ones."""

from __future__ import annotations

from typing import Any, Dict

from ..errors import UsageError
from .base import Exporter, ExportRequest, refuse_float_elements, refuse_tied, weight_names

__all__ = ["AimetExporter", "EXPORTER"]


class AimetExporter(Exporter):
    name = "aimet"
    aimet_json = "always"

    def check_quantizers(self, quantizers, options: Exporter.Options) -> None:
        quantizers = list(quantizers)
        refuse_float_elements(quantizers, "AIMET encodings", "they describe integer grids: bitwidth, scale, offset")
        dynamic = [q for q in quantizers if q.spec.dynamic]
        if dynamic:
            raise UsageError(
                f"AIMET encodings are static, and {dynamic[0].name} ({len(dynamic)} quantizer(s) in all) is dynamic "
                f"({dynamic[0].spec.granularity.value}): export with --format qtool, onnx or compressed-tensors, or "
                "use a recipe with static activations")
        from ..aimet_format import block_problem

        tiles = [(q, block_problem(q.spec)) for q in quantizers]
        tiles = [(q, why) for q, why in tiles if why]
        if tiles:
            raise UsageError(f"AIMET encodings block the input dimension alone (block_size [1, B]), and "
                             f"{tiles[0][0].name} has {tiles[0][1]} ({len(tiles)} quantizer(s) in all): export with "
                             "--format qtool, or use a recipe with an integer block_size")

    def check(self, encodings, options: Exporter.Options) -> None:
        super().check(encodings, options)
        if encodings.codes_file is not None:
            self.check_weight_changes([f"weights or codes stored in {encodings.codes_file}"])

    def check_tied(self, tied) -> None:
        refuse_tied(self.name, tied)

    def check_weight_changes(self, changes) -> None:
        if changes:
            raise UsageError(f"--format aimet writes encodings alone, for the checkpoint's own weights, and this "
                             f"calibration changes them ({', '.join(changes)}): export with --format qtool, onnx or "
                             "compressed-tensors, which write the weights too")

    def write(self, request: ExportRequest, options: Exporter.Options) -> Dict[str, Any]:
        matched = weight_names(request.weights, request.encodings.entries, str(request.checkpoint))
        for e in matched.entries:  # (the file holds no weights, but its encodings are for these tensors' shapes)
            key = matched.names[e.name]
            e.check_fits(key, request.weights.shape_dtype(key)[0])
        return {"names": matched.names}


EXPORTER = AimetExporter()
