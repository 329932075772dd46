"""llama.cpp's importance matrix: `qtool imatrix` writes the GGUF file llama-imatrix writes (per decoder matrix,
each input column's sum of x² and the token count), and the reader takes it or a legacy imatrix.dat back."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.errors import EncodingsError
from qtool.imatrix import read_imatrix

from tests.helpers import error_lines, run_cli

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from safetensors.torch import save_file

    from tests.test_gguf import _tiny_llama

    d = tmp_path_factory.mktemp("imatrix")
    ids = torch.randint(1, 300, (8, 24), generator=torch.Generator().manual_seed(2))
    save_file({"input_ids": ids}, d / "ids.safetensors")
    return _tiny_llama(d / "m", False), d / "ids.safetensors", ids


def test_the_file_holds_each_decoder_matrixs_input_sums_as_llama_imatrix_writes_them(llama, tmp_path):
    ckpt, data, ids = llama
    code, out, err = run_cli("imatrix", ckpt, "--data", data, "-o", tmp_path / "imatrix.gguf", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["entries"] == 14 and summary["tokens"] == ids.numel()
    reader = gguf.GGUFReader(tmp_path / "imatrix.gguf")
    assert bytes(reader.fields["general.type"].parts[-1]).decode() == "imatrix"
    assert {"imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"} <= set(reader.fields)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 28
    t = tensors["blk.1.ffn_down.weight.in_sum2"]
    assert list(t.shape) == [128, 1] and t.tensor_type.name == "F32"  # ne = [width, n_mat]
    assert list(tensors["blk.1.ffn_down.weight.counts"].shape) == [1, 1]
    # the same sums measured independently on the float model
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    seen = {}
    down = model.model.layers[1].mlp.down_proj
    hook = down.register_forward_pre_hook(lambda m, a: seen.setdefault("x", []).append(a[0].reshape(-1, 128)))
    with torch.no_grad():
        for i in range(0, len(ids), 8):
            model(ids[i:i + 8])
    hook.remove()
    x = torch.cat(seen["x"]).double()
    mean = read_imatrix(tmp_path / "imatrix.gguf")["blk.1.ffn_down.weight"]
    assert torch.allclose(mean.double(), (x * x).mean(0), rtol=1e-5)


def test_a_legacy_imatrix_dat_reads_as_the_mean_of_x_squared(tmp_path):
    mean = np.array([0.5, 2.0, 0.0, 3.25], dtype=np.float32)
    ncall = 10
    body = struct.pack("<i", 1) + struct.pack("<i", 19) + b"blk.0.attn_q.weight" + struct.pack("<ii", ncall, 4)
    body += (mean * ncall).astype("<f4").tobytes() + struct.pack("<i", 3) + struct.pack("<i", 4) + b"text"
    (tmp_path / "imatrix.dat").write_bytes(body)
    got = read_imatrix(tmp_path / "imatrix.dat")
    assert list(got) == ["blk.0.attn_q.weight"] and np.allclose(got["blk.0.attn_q.weight"].numpy(), mean)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), cut=st.integers(0, 80))
def test_any_bytes_read_as_an_importance_matrix_or_one_clear_error(tmp_path_factory, data, cut):
    good = struct.pack("<i", 1) + struct.pack("<i", 3) + b"abc" + struct.pack("<ii", 1, 2) + b"\0" * 8
    for blob in (data, good[:cut] + data, b"GGUF" + data):
        path = tmp_path_factory.mktemp("fuzz") / "imatrix.dat"
        path.write_bytes(blob)
        try:
            out = read_imatrix(path)
        except EncodingsError as e:
            assert str(e).startswith(str(path)) and "\n" not in str(e)
        else:
            assert all(torch.isfinite(v).all() for v in out.values())


def test_bad_imatrix_runs_are_one_line_and_write_nothing(llama, tmp_path):
    ckpt, data, _ = llama
    (tmp_path / "there.gguf").write_bytes(b"keep")
    for args, needle in (
            (("-o", tmp_path / "there.gguf"), "exists; pass --overwrite"),
            (("-o", tmp_path), "is a directory"),
            (("-o", tmp_path / "no" / "x.gguf"), "no such directory"),
    ):
        code, _, err = run_cli("imatrix", ckpt, "--data", data, *args)
        assert code == 2 and needle in err and len([e for e in error_lines(err) if e.startswith("error")]) == 1
    code, _, err = run_cli("imatrix", ckpt, "-o", tmp_path / "new.gguf")
    assert code == 2 and "pass --data" in err and not (tmp_path / "new.gguf").exists()
    assert (tmp_path / "there.gguf").read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there.gguf"]
