"""Models for process-level tests: one that is slow to run (so a signal lands mid-calibration) and one that
fails with an unexpected error (an internal error)."""

import time

import torch
from torch import nn

from tests.tinymodels import mlp


class Slow(nn.Sequential):
    """The tiny MLP (same parameter names), half a second per call."""

    def forward(self, x):
        time.sleep(0.5)
        return super().forward(x)


def slow() -> nn.Module:
    return Slow(*mlp())


def broken() -> nn.Module:
    return {}["deliberately missing key"]
