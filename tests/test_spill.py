"""qtool.io.spill: tensors kept on disk read back exactly, and the directory goes away."""

import gc

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.io.spill import SpilledTensors

_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
           torch.bfloat16]


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1, max_size=5),
       dtype=st.sampled_from(_DTYPES), seed=st.integers(0, 2**16))
def test_tensors_read_back_bit_for_bit(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    store, want = SpilledTensors(), {}
    for i, shape in enumerate(shapes):
        t = torch.randint(-100, 100, shape, generator=g) if not dtype.is_floating_point else torch.randn(shape, generator=g)
        want[f"t{i}"] = t.to(dtype)
        store[f"t{i}"] = want[f"t{i}"].t() if len(shape) == 2 else want[f"t{i}"]  # a non-contiguous view too
    for name, t in want.items():
        got = store[name]
        expect = t.t() if t.dim() == 2 else t
        assert got.dtype == expect.dtype and got.shape == expect.shape and torch.equal(got, expect)
    assert sorted(store) == sorted(want) and len(store) == len(want)
    store.close()
    assert not store.directory.exists() and len(store) == 0


def test_replacing_and_deleting_remove_the_old_file_and_collection_removes_the_directory():
    store = SpilledTensors()
    store["a"] = torch.arange(10, dtype=torch.int8)
    store["a"] = torch.arange(4, dtype=torch.int16)
    assert torch.equal(store["a"], torch.arange(4, dtype=torch.int16))
    assert len(list(store.directory.iterdir())) == 1 and store.nbytes() == 8
    del store["a"]
    assert list(store.directory.iterdir()) == [] and "a" not in store
    directory = store.directory
    del store
    gc.collect()
    assert not directory.exists()


def test_a_killed_runs_directory_is_removed_by_the_next_one_and_no_other(tmp_path):
    """A SIGKILLed --sequential run's codes (gigabytes for a large model) stayed in /tmp for good: nothing could tell
    whose they were. Names now carry the host and pid; the next mapping removes those whose process is gone."""
    import os
    import subprocess
    import sys

    from qtool.io.fs import _HOST

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"qtool-spill-{_HOST}-{int(dead.stdout)}-abc_123"
    alive = tmp_path / f"qtool-spill-{_HOST}-{os.getpid()}-def456"  # (this process: still running)
    other = tmp_path / f"qtool-spill-another.host-{int(dead.stdout)}-ghi789"  # (a shared disk: not ours to judge)
    unnamed = tmp_path / "qtool-spill-jkl012"  # (an older qtool's)
    for d in (stale, alive, other, unnamed):
        d.mkdir()
        (d / "0.bin").write_bytes(b"\0" * 64)
    s = SpilledTensors(tmp_path)
    assert s.directory.name.startswith(f"qtool-spill-{_HOST}-{os.getpid()}-")
    assert not stale.exists() and alive.exists() and other.exists() and unnamed.exists()
    s.close()


def test_an_interrupt_as_the_spill_directory_is_made_leaves_nothing(tmp_path, monkeypatch):
    """mkdtemp made the directory, and an interrupt as it returned came before the cleanup was registered: the
    directory stayed until another spilling run."""
    import gc
    import os

    import pytest

    import qtool.io.spill as spill

    made = os.mkdir

    def mkdir(path, *args, **kwargs):
        made(path, *args, **kwargs)
        raise KeyboardInterrupt()

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(KeyboardInterrupt):
        spill.SpilledTensors(tmp_path)
    gc.collect()
    assert list(tmp_path.iterdir()) == []
