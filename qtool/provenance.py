"""What a run records about where it ran: the versions of the software that computed it and the device's name.
The manifest writes them, and a resumable state compares them before it is trusted (calibration.resume)."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Dict

import torch

from . import __version__

__all__ = ["versions", "device_label"]


def versions() -> Dict[str, str]:
    out = {"qtool": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:  # the installed distribution's version: importing transformers for it would cost a second per command
        out["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:  # optional extra
        pass
    return out


def device_label(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H200)``: a GPU's model decides its arithmetic as much as its index."""
    return str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
