"""Small real models the tests build (importable as --model-class tests.tinymodels:NAME)."""

import torch
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def mlp_bf16() -> nn.Module:
    """:func:`mlp` in bfloat16."""
    return mlp().to(torch.bfloat16)


def regressor() -> nn.Module:
    """One number per sample (a regression or reranker head)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))


class NeedsTwo(nn.Module):
    """A model with a second input the data may not give (as CLIP's pixel_values beside text)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(64, 8)

    def forward(self, x, scale=None):
        return self.fc(x) * scale.shape[-1]


def needs_two() -> nn.Module:
    return NeedsTwo()


class SharedTwice(nn.Module):
    """One Linear run twice per forward, on inputs of different scales (as ALBERT's shared layers run)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(64, 64)
        self.shared = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        h = torch.relu(self.shared(self.inp(x)))
        return self.head(torch.tanh(self.shared(3 * h)))


def shared_twice() -> nn.Module:
    return SharedTwice()

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


def raises() -> nn.Module:
    """A factory whose own code fails (a missing file, a bad argument...)."""
    raise RuntimeError("weights.bin not found")


class TiedLM(nn.Module):
    """Token ids -> logits through an embedding table the output layer shares (a torch state dict keeps the shared
    tensor under both names)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 100, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.emb(ids))))


def tied_lm() -> nn.Module:
    torch.manual_seed(3)
    return TiedLM()


def on_meta() -> nn.Module:
    """A factory that builds the model on the meta device (to save memory, as a big model's code does)."""
    with torch.device("meta"):
        return mlp()


def compiled() -> nn.Module:
    """A factory that returns the model wrapped by torch.compile (its state dict's keys gain ``_orig_mod.``)."""
    return torch.compile(mlp())


def exits() -> nn.Module:
    """A factory that ends the process instead of returning a model (a script's main() called by mistake)."""
    import sys

    sys.exit(0)


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


class SamePadConv2d(nn.Conv2d):
    """A Conv2d that pads in ``forward`` (as EfficientNet's ``Conv2dStaticSamePadding`` does): the op never sees
    the module's input as is."""

    def forward(self, x):
        k = self.kernel_size[0]
        return nn.functional.conv2d(nn.functional.pad(x, (k // 2, (k - 1) // 2, k // 2, (k - 1) // 2)),
                                    self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class BNNet(nn.Module):
    """A small MobileNet-style CNN: stem, depthwise and pointwise convolutions, each followed by a BatchNorm with
    trained-looking statistics, and one norm (``decoy``) that follows a convolution in module order but takes the
    convolution's output plus a skip, so it must not be folded."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = SamePadConv2d(3, 16, 3, stride=2, bias=False)
        self.bn0 = nn.BatchNorm2d(16, eps=1e-3)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.pw = nn.Conv2d(16, 24, 1, bias=True)
        self.bn2 = nn.BatchNorm2d(24)
        self.skip = nn.Conv2d(24, 24, 1)
        self.decoy = nn.BatchNorm2d(24)
        self.head = nn.Linear(24, 10)
        g = torch.Generator().manual_seed(1)
        for bn in (self.bn0, self.bn1, self.bn2, self.decoy):
            n = bn.num_features
            bn.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
            bn.running_var.copy_(torch.rand(n, generator=g) * 2 + 0.05)
            bn.weight.data.copy_(torch.rand(n, generator=g) * 1.5 + 0.25)
            bn.bias.data.copy_(torch.randn(n, generator=g) * 0.2)

    def forward(self, x):
        x = nn.functional.relu6(self.bn0(self.stem(x)))
        x = nn.functional.relu6(self.bn1(self.dw(x)))
        x = self.bn2(self.pw(x))
        x = nn.functional.relu6(self.decoy(self.skip(x) + x))
        return self.head(x.mean(dim=(2, 3)))


def bnnet() -> nn.Module:
    return BNNet()


class Reused(nn.Module):
    """One Linear called three times in forward (a shared block; twice on one tensor), beside an embedding tied to
    the output layer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        g = torch.relu(self.fc(self.emb(ids)))
        return self.head(self.fc(g) + self.fc(g))


def reused() -> nn.Module:
    torch.manual_seed(0)
    return Reused()


class Attends(nn.Module):
    """A Linear into torch's own MultiheadAttention (batch first), whose eval-mode fast path under no_grad is a
    fused operator the ONNX exporter has no symbolic for."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        x = self.inp(x)
        a, _ = self.mha(x, x, x, need_weights=False)
        return self.out(x + a)


def attends() -> nn.Module:
    torch.manual_seed(0)
    return Attends()


class UpNet(nn.Module):
    """A convolution, then a transposed one (weight [in, out, kh, kw]: its first dim is the input channels)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)

    def forward(self, x):
        return self.up(torch.relu(self.conv(x)))


def upnet() -> nn.Module:
    torch.manual_seed(0)
    return UpNet()


class Spare(nn.Module):
    """An MLP beside a Linear its forward never calls (as T5's ``shared`` table, which only its encoder's and
    decoder's copies run, or an expert routed no token)."""

    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.spare = nn.Linear(64, 64)

    def forward(self, x):
        return self.body(x)


def spare() -> nn.Module:
    torch.manual_seed(0)
    return Spare()


class ReadsItsConv(nn.Module):
    """A mixer that passes its depthwise convolution's weight to a function instead of calling the layer (as
    transformers' Mamba kernels take ``self.conv1d.weight``), beside a Linear it calls."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(8, 8)
        self.conv1d = nn.Conv1d(8, 8, 4, groups=8, padding=3)

    def forward(self, x):
        h = self.in_proj(x).transpose(1, 2)
        dtype = self.conv1d.weight.dtype  # (reading its dtype is not reading the weight)
        out = torch.nn.functional.conv1d(h, self.conv1d.weight.to(dtype), self.conv1d.bias, padding=3, groups=8)
        return out[..., :x.shape[1]].transpose(1, 2)


class CallsItsLayerAnotherWay(nn.Module):
    """Reads its layers' weights (to initialize them) and calls them by an alias, in a loop, or from a base class's
    forward: they run, so they are quantized (the first source check left them float)."""

    def __init__(self):
        super().__init__()
        self.proj, self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        torch.nn.init.xavier_uniform_(self.proj.weight)
        torch.nn.init.xavier_uniform_(self.q.weight)

    def forward(self, x):
        proj = self.proj
        return sum(m(proj(x)) for m in (self.q, self.k))


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


class Derived(_Base):
    def reset(self):
        torch.nn.init.normal_(self.fc.weight)


class _RunsOutOfMemory(nn.Sequential):
    def forward(self, x):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 201326592 bytes. Error code 12 (Cannot allocate memory)")


def out_of_memory() -> nn.Module:
    """mlp()'s weights in a model whose forward meets torch's CPU allocator failing (a memory limit mid-run)."""
    torch.manual_seed(0)
    return _RunsOutOfMemory(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


class _SliceScan(nn.Module):
    """Token ids -> a recurrence over the positions, each read by a slice (which clamps where a traced loop runs past
    a shorter input): a graph traced at one length gives outputs of that length at any other."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.step = nn.Linear(16, 16)

    def forward(self, ids):
        h = self.emb(ids)
        state, outs = torch.zeros_like(h[:, :1]), []
        for t in range(h.shape[1]):
            state = torch.tanh(self.step(h[:, t:t + 1]) + state)
            outs.append(state)
        return torch.cat(outs, 1)


def slice_scan() -> nn.Module:
    torch.manual_seed(0)
    return _SliceScan()


class _Pairs(nn.Module):
    """Token ids -> each pair of neighbouring positions merged (as funnel pooling does): any even length runs."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.merge = nn.Linear(32, 16)

    def forward(self, ids):
        h = self.emb(ids)
        return self.merge(h.reshape(h.shape[0], h.shape[1] // 2, 2 * h.shape[2]))


def pairs() -> nn.Module:
    torch.manual_seed(0)
    return _Pairs()


class WithExtraState(nn.Module):
    """A Linear model whose state dict carries a non-tensor extra state (``get_extra_state``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(64, 16)

    def forward(self, x):
        return self.fc(x)

    def get_extra_state(self):
        return {"version": 2}

    def set_extra_state(self, state):
        pass
