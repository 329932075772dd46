"""The encodings file's names, versions and size limits, and the error for a range that cannot be written."""

from __future__ import annotations

from typing import Optional

from ..quant.spec import Granularity

SCHEMA = "qtool.encodings"
SCHEMA_VERSION = 4  # the newest version this qtool writes and reads
READS_VERSIONS = (1, 2, 3, 4)
CODES_FILE = "codes.safetensors"  # integer codes chosen by a rounding algorithm (schema version 3, qtool.weights)
INLINE_LIMIT = 1 << 16  # numbers per field above which an entry's data goes to the sidecar
BLOCK_INLINE_LIMIT = 1 << 10  # the same for a blockwise entry (per_block): a tiny model's blocks stay readable
SIDECAR = "encodings.safetensors"


def _inline(numel: int, granularity: Granularity, inline_limit: Optional[int]) -> bool:
    """Whether an entry of ``numel`` numbers per field is written in the JSON itself (None: every entry is)."""
    if inline_limit is None:
        return True
    limit = min(inline_limit, BLOCK_INLINE_LIMIT) if granularity == Granularity.PER_BLOCK else inline_limit
    return numel <= limit


def range_fault(name: str, tensor: str, why: str, limits: str = "near float32's limits") -> Exception:
    """The one-line error for a quantizer whose range cannot be written (``why``): the checkpoint's fault for a
    weight, the calibration data's for an activation (``CheckpointError`` / ``DataError``)."""
    from ..errors import CheckpointError, DataError

    if tensor == "weight":
        return CheckpointError(f"{name}: {why}: the checkpoint's weight holds NaN/Inf or values {limits}; nothing "
                               "was written")
    return DataError(f"{name}: {why}: the model produced NaN/Inf or values {limits} on the calibration data; "
                     "nothing was written")


_RESERVED = ("schema", "schema_version", "quantizers", "codes", "online_rotations")
