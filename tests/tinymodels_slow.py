"""Models for process-level tests: ones that are slow to run (so a signal lands mid-calibration) and one that
fails with an unexpected error (an internal error)."""

import time

from torch import nn

from tests.tinymodels import mlp


class Slow(nn.Sequential):
    """The tiny MLP (same parameter names), half a second per call."""

    def forward(self, x):
        time.sleep(0.5)
        return super().forward(x)


def slow() -> nn.Module:
    return Slow(*mlp())


class SlowFromAString(nn.Sequential):
    """The tiny MLP, its half-second wait run from a string, as a dataclass's generated methods are: an interrupt
    that lands there leaves CPython's "KeyboardInterrupt unhandled" mark set."""

    def forward(self, x):  # (QTOOL_TEST_MARK: a file touched as the wait begins, for a test to aim its signal)
        exec("import os, pathlib, time\nif os.environ.get('QTOOL_TEST_MARK'):\n"
             "    pathlib.Path(os.environ['QTOOL_TEST_MARK']).touch()\ntime.sleep(0.5)")
        return super().forward(x)


def slow_from_a_string() -> nn.Module:
    return SlowFromAString(*mlp())


class _Broken(nn.Sequential):
    """Built fine (a factory that fails is the user's error, exit 2), then fails where qtool does not expect it."""

    def state_dict(self, *args, **kwargs):
        return {}["deliberately missing key"]


def broken() -> nn.Module:
    return _Broken(*mlp())
