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

The package, one unit per job: ``schema`` (names, versions, size limits), ``entry`` (the :class:`EncodingEntry`
record), ``grid`` (an entry's scales and offsets, and the checks that they are finite), ``sidecar`` (reading
numbers from ``encodings.safetensors``), ``entry_json`` (one entry to and from JSON) and ``file``
(:class:`EncodingsFile`: the whole file, written and read, and :class:`SidecarStream`).
"""

from .entry import EncodingEntry
from .file import EncodingsFile, SidecarStream, calibrated_elsewhere
from .schema import (BLOCK_INLINE_LIMIT, CODES_FILE, INLINE_LIMIT, READS_VERSIONS, SCHEMA, SCHEMA_VERSION, SIDECAR,
                     range_fault)

__all__ = ["EncodingEntry", "EncodingsFile", "SidecarStream", "calibrated_elsewhere", "range_fault", "SCHEMA",
           "SCHEMA_VERSION", "INLINE_LIMIT", "BLOCK_INLINE_LIMIT", "SIDECAR", "CODES_FILE", "READS_VERSIONS"]
