"""Loading a state dict into a ``--model-class`` model: the factory runs with its parameters on the meta device
(no random initialisation, no second copy of the weights) and takes the checkpoint's tensors; where that cannot
work (a tensor derived from a parameter's values, a tied parameter) it runs as written. The loaded model is the
same either way."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from qtool.model.load import _holds_meta, _meta_parameters, load_model


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
    """Computes with a (non-parameter) tensor's value while it is built."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.width = int(torch.tensor(4).item())

    def forward(self, x):
        return self.fc(x)[:, : self.width]


def with_item() -> nn.Module:
    return _Item()


class _FromWeight(nn.Module):
    """A non-persistent buffer copied from a parameter's initial values: only the factory as written has it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)
        self.register_buffer("start", self.fc.weight.detach().clone(), persistent=False)

    def forward(self, x):
        return self.fc(x) + x @ self.start.t()


def from_weight() -> nn.Module:
    return _FromWeight()


class _Norm(nn.Module):
    """Reads a parameter's value as a number while it is built (impossible on the meta device)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)
        self.norm = float(self.fc.weight.detach().norm())

    def forward(self, x):
        return self.fc(x) / self.norm


def reads_weight() -> nn.Module:
    return _Norm()


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


@pytest.mark.parametrize("factory,meta", [("plain", True), ("with_table", True), ("with_attr", True),
                                          ("with_item", True), ("tied", False), ("reads_weight", False)])
def test_parameters_on_the_meta_device_unless_the_factory_needs_their_values(factory, meta):
    model = _meta_parameters(f"tests.test_load:{factory}")
    assert (model is not None) is meta
    if model is not None:
        assert all(p.is_meta for p in model.parameters())
        assert not any(b.is_meta for b in model.buffers())  # buffers are made as the factory makes them


def test_a_tensor_derived_from_a_parameter_sends_the_factory_round_again(tmp_path):
    model = _meta_parameters("tests.test_load:from_weight")
    assert model is not None and _holds_meta(model)  # its buffer came from a meta weight
    path, state = _saved(tmp_path, from_weight)
    loaded = load_model(path, "tests.test_load:from_weight").model
    assert not _holds_meta(loaded)
    assert torch.equal(loaded.start, from_weight().start)  # the factory's own values, as written
    assert torch.equal(loaded.fc.weight, state["fc.weight"])


@pytest.mark.parametrize("factory", ["plain", "with_table", "with_attr", "with_item", "from_weight", "reads_weight"])
def test_the_loaded_model_holds_the_checkpoint_and_computes_as_built(tmp_path, factory):
    path, state = _saved(tmp_path, globals()[factory])
    model = load_model(path, f"tests.test_load:{factory}").model
    assert not _holds_meta(model)
    for k, v in model.state_dict().items():
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
