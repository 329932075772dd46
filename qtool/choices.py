"""Every choice-valued option and its check, importable without torch so a bad choice fails at once, before any
model or library is loaded. Each check raises ``UsageError`` with the choices in the message."""

from __future__ import annotations

import re
from typing import Sequence

from .errors import UsageError

__all__ = ["AIMET_VERSIONS", "CT_EIGHT_BIT_FORMATS", "DEVICES", "check_choice", "check_device"]

AIMET_VERSIONS = ("0.6.1", "1.0.0", "2.0.0")  # the AIMET encodings versions qtool writes
CT_EIGHT_BIT_FORMATS = ("int-quantized", "pack-quantized")
DEVICES = ("cpu", "cuda", "auto")  # and cuda:N
_DEVICE = re.compile(r"(cpu|cuda|auto|cuda:\d{1,3})")


def check_choice(flag: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise UsageError(f"{flag} must be one of {', '.join(choices)} (got {str(value)[:40]!r})")
    return value


def check_device(value: str) -> str:
    if not isinstance(value, str) or not _DEVICE.fullmatch(value):
        raise UsageError(f"--device must be cpu, cuda or auto (or cuda:N; got {str(value)[:40]!r})")
    return value
