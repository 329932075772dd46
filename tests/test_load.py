"""Loading a state dict into a ``--model-class`` model: built on the meta device (no random initialisation, no
second copy of the weights) where the checkpoint gives it every tensor it uses, built as written otherwise; the
loaded model is the same either way."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from qtool.model.load import _empty_model, load_model


def plain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.BatchNorm1d(4))


class _Table(nn.Module):
    """A non-persistent buffer computed from values: the checkpoint does not hold it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.register_buffer("shift", torch.arange(4.0) * 0.5, persistent=False)

    def forward(self, x):
        return self.fc(x) + self.shift


def with_table() -> nn.Module:
    return _Table()


class _Attr(nn.Module):
    """A plain tensor attribute (not registered): on the meta device it would stay without values."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.gain = torch.full((4,), 2.0)

    def forward(self, x):
        return self.fc(x) * self.gain


def with_attr() -> nn.Module:
    return _Attr()


def tied() -> nn.Module:
    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    b.weight = a.weight
    return nn.Sequential(a, nn.ReLU(), b)


class _Item(nn.Module):
    """Computes with a tensor's value while it is built (fails on the meta device)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.width = int(torch.tensor(4).item())

    def forward(self, x):
        return self.fc(x)[:, : self.width]


def with_item() -> nn.Module:
    return _Item()


def half() -> nn.Module:
    return nn.Linear(8, 4)  # float32, for a float16 checkpoint


def _saved(tmp_path, factory, dtype=None):
    model = factory()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # values no initialisation gives, so a load that left one alone shows
        for k, v in state.items():
            if v.is_floating_point():
                state[k] = torch.linspace(0.1, 1, v.numel()).reshape(v.shape)  # (positive: a variance)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous().clone() for k, v in state.items()}, path)  # (a tied pair: one copy per name)
    return path, state


@pytest.mark.parametrize("factory,meta", [("plain", True), ("with_table", False), ("with_attr", False),
                                          ("tied", False), ("with_item", False)])
def test_meta_build_only_where_the_checkpoint_fills_every_tensor(factory, meta):
    assert (_empty_model(f"tests.test_load:{factory}") is not None) is meta


@pytest.mark.parametrize("factory", ["plain", "with_table", "with_attr", "with_item"])
def test_the_loaded_model_holds_the_checkpoint_and_computes_as_built(tmp_path, factory):
    path, state = _saved(tmp_path, globals()[factory])
    model = load_model(path, f"tests.test_load:{factory}").model
    for k, v in model.state_dict().items():
        assert not v.is_meta, k
        if k in state:
            assert torch.equal(v, state[k]), k
    reference = globals()[factory]()
    reference.load_state_dict(state)
    reference.eval()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_meta_build_runs_no_initialisation(tmp_path):
    path, _ = _saved(tmp_path, plain)
    load_model(path, "tests.test_load:plain")
    after = torch.random.get_rng_state()
    # plain() seeds the generator itself and, on the meta device, draws nothing after that; built as written,
    # its layers' random initialisation would have drawn from it
    torch.manual_seed(0)
    assert torch.equal(after, torch.random.get_rng_state())


def test_a_tied_model_stays_tied(tmp_path):
    path, state = _saved(tmp_path, tied)
    model = load_model(path, "tests.test_load:tied").model
    assert model[0].weight is model[2].weight
    assert torch.equal(model[0].weight, state["0.weight"])


def test_a_float16_checkpoint_loads_in_the_model_s_dtype(tmp_path):
    path, state = _saved(tmp_path, half, dtype=torch.float16)
    model = load_model(path, "tests.test_load:half").model
    assert model.weight.dtype == torch.float32
    assert torch.equal(model.weight, state["weight"].float())
