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


class _Broken(nn.Sequential):
    """Built fine (a factory that fails is the user's error, exit 2), then fails where qtool does not expect it."""

    def state_dict(self, *args, **kwargs):
        return {}["deliberately missing key"]


def broken() -> nn.Module:
    return _Broken(*mlp())
