"""Small real models the tests build (importable as --model-class tests.tinymodels:NAME)."""

import torch
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def convnet() -> nn.Module:
    return ConvNet()


def not_a_module():
    return 42


class _DiesOnRank(nn.Module):
    """``mlp`` that kills its own process (SIGKILL, as the out-of-memory killer would) on its second forward call
    when ``RANK`` equals ``QTOOL_TEST_DIE_ON_RANK``: a rank lost in the middle of distributed calibration."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.calls = 0

    def forward(self, x):
        import os
        import signal

        self.calls += 1
        if self.calls == 2 and os.environ.get("RANK") == os.environ.get("QTOOL_TEST_DIE_ON_RANK"):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)


def dies_on_rank() -> nn.Module:
    return _DiesOnRank()
