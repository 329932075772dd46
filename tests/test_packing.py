"""Dense sub-byte packing: exact round trips, the ONNX int4 byte layout, and compressed-tensors' pack-quantized
layout checked against compressed-tensors' own packer and a real llm-compressor file."""

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.quant.packing import pack_bytes, pack_int32, packed_numel, unpack_bytes, unpack_int32

SHARED_CT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "compressed-tensors"
BITS = list(range(2, 9))


def _range(bits, signed):
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


@st.composite
def codes_case(draw, max_len=300):
    bits = draw(st.sampled_from(BITS))
    signed = draw(st.booleans())
    lo, hi = _range(bits, signed)
    # mix plain values with the extremes so every run meets the corners of the grid
    vals = draw(st.lists(st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, lo + 1, hi - 1, 0 if signed else lo])),
                         min_size=0, max_size=max_len))
    return bits, signed, vals


@settings(max_examples=200, deadline=None)
@given(codes_case())
def test_bytes_round_trip(case):
    bits, signed, vals = case
    x = torch.tensor(vals, dtype=torch.int64)
    p = pack_bytes(x, bits, signed=signed)
    assert p.dtype == torch.uint8 and p.numel() == packed_numel(len(vals), bits) == (len(vals) * bits + 7) // 8
    back = unpack_bytes(p, bits, len(vals), signed=signed)
    assert torch.equal(back.to(torch.int64), x)


@settings(max_examples=80, deadline=None)
@given(codes_case(max_len=60), st.integers(1, 5))
def test_bytes_round_trip_keeps_shape(case, rows):
    bits, signed, vals = case
    lo, hi = _range(bits, signed)
    x = torch.tensor((vals or [lo]) * rows, dtype=torch.int64).reshape(rows, -1)
    back = unpack_bytes(pack_bytes(x, bits), bits, x.shape, signed=signed)
    assert back.shape == x.shape and torch.equal(back.to(torch.int64), x)


def test_bytes_layout_is_lsb_first():
    # int4: first element in the low nibble (ONNX int4/uint4 layout); signed as 4-bit two's complement
    assert pack_bytes(torch.tensor([1, 2, 3]), 4).tolist() == [0x21, 0x03]
    assert pack_bytes(torch.tensor([-1, -8]), 4).tolist() == [0x8F]
    # 2 bits: four per byte, element 0 in bits 0-1
    assert pack_bytes(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00111001]
    # 3 bits straddle bytes: 7,0,5 -> bits 111 000 101 -> 0b01000111, 0b1
    assert pack_bytes(torch.tensor([7, 0, 5]), 3).tolist() == [0b01000111, 0b1]
    # 8 bits is a byte copy (two's complement for signed)
    assert pack_bytes(torch.tensor([-128, 127, 5]), 8).tolist() == [128, 127, 5]
    assert unpack_bytes(torch.tensor([255, 0], dtype=torch.uint8), 8, 2, signed=False).tolist() == [255, 0]


@pytest.mark.parametrize("signed", [True, False])
def test_bytes_matches_onnx_int4(signed):
    """onnx's own INT4/UINT4 tensor packing gives the same bytes (odd length: the last high nibble is 0)."""
    onnx = pytest.importorskip("onnx")
    vals = [-8, 7, 3, -1, 0, 5, -3] if signed else [15, 0, 7, 8, 1, 14, 9]
    t = onnx.helper.make_tensor("x", onnx.TensorProto.INT4 if signed else onnx.TensorProto.UINT4, [7], vals)
    ref = list(t.int32_data)  # onnx stores packed int4 bytes one per int32_data entry
    assert pack_bytes(torch.tensor(vals), 4, signed=signed).tolist() == ref
    back = unpack_bytes(torch.tensor(ref, dtype=torch.uint8), 4, 7, signed=signed)
    assert back.tolist() == vals


def test_range_errors():
    with pytest.raises(ValueError, match="do not fit"):
        pack_bytes(torch.tensor([8]), 4, signed=True)
    with pytest.raises(ValueError, match="do not fit"):
        pack_bytes(torch.tensor([-1]), 4, signed=False)
    with pytest.raises(ValueError, match="do not fit"):
        pack_int32(torch.tensor([[8]]), 4)
    with pytest.raises(ValueError, match="whole numbers"):
        pack_bytes(torch.tensor([0.5]), 4)
    with pytest.raises(ValueError, match="bitwidth"):
        pack_bytes(torch.tensor([0]), 9)
    with pytest.raises(ValueError, match="need"):
        unpack_bytes(torch.zeros(1, dtype=torch.uint8), 4, 3, signed=True)


@st.composite
def matrix_case(draw):
    bits = draw(st.sampled_from(BITS))
    rows = draw(st.integers(1, 6))
    cols = draw(st.integers(1, 100))
    seed = draw(st.integers(0, 2**31 - 1))
    lo, hi = _range(bits, True)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(lo, hi + 1, (rows, cols), generator=g)
    x[0, 0], x[-1, -1] = lo, hi  # the extremes always appear
    return bits, x


@settings(max_examples=200, deadline=None)
@given(matrix_case())
def test_int32_round_trip_and_shape(case):
    bits, x = case
    rows, cols = x.shape
    p = pack_int32(x, bits)
    assert p.dtype == torch.int32 and tuple(p.shape) == (rows, (cols * bits + 31) // 32)
    assert torch.equal(unpack_int32(p, bits, x.shape).to(torch.int64), x)
    assert torch.equal(unpack_int32(p, bits, cols).to(torch.int64), x)
    p0 = pack_int32(x, bits, packed_dim=0)
    assert tuple(p0.shape) == ((rows * bits + 31) // 32, cols)
    assert torch.equal(unpack_int32(p0, bits, x.shape, packed_dim=0).to(torch.int64), x)
    # unsigned codes pack to the same words as their signed counterpart
    u = x + (1 << (bits - 1))
    assert torch.equal(pack_int32(u, bits, signed=False), p)
    assert torch.equal(unpack_int32(p, bits, x.shape, signed=False).to(torch.int64), u)


@settings(max_examples=100, deadline=None)
@given(matrix_case())
def test_int32_matches_compressed_tensors(case):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    bits, x = case
    x8 = x.to(torch.int8)
    assert torch.equal(pack_int32(x, bits), helpers.pack_to_int32(x8, bits))
    assert torch.equal(pack_int32(x, bits, packed_dim=0), helpers.pack_to_int32(x8, bits, packed_dim=0))
    p = helpers.pack_to_int32(x8, bits)
    assert torch.equal(unpack_int32(p, bits, x.shape), helpers.unpack_from_int32(p, bits, x.shape))


def test_int32_layout_by_hand():
    # 4 bits: +8 shift, element i at bit 4i of the row, least-significant first
    x = torch.tensor([[-8, -7, 0, 7, 1, 2, 3, 4, 5]])
    p = pack_int32(x, 4)
    words = [sum(((v + 8) & 0xF) << (4 * i) for i, v in enumerate(x[0, :8].tolist())), (5 + 8)]
    words = [w - (1 << 32) if w >= (1 << 31) else w for w in words]
    assert p.tolist() == [words]
    # 8 bits: four codes per word
    assert pack_int32(torch.tensor([[-128, 0, 127, -1]]), 8).tolist() == [[(0 | 128 << 8 | 255 << 16 | 127 << 24)]]


def _real_file(name):
    path = SHARED_CT / name
    if not path.exists():
        pytest.fail(f"reference data missing: {path}")
    return path


@pytest.mark.parametrize("name,bits", [("w4a16_g64.layer0.safetensors", 4), ("w8a16_ch.layer0.safetensors", 8)])
def test_real_llm_compressor_file(name, bits):
    from safetensors import safe_open

    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    with safe_open(str(_real_file(name)), "pt") as fh:
        keys = [k for k in fh.keys() if k.endswith(".weight_packed")]
        assert len(keys) == 7
        for k in keys:
            packed = fh.get_tensor(k)
            shape = tuple(fh.get_tensor(k.replace("_packed", "_shape")).tolist())
            scale = fh.get_tensor(k.replace("_packed", "_scale"))
            assert packed.dtype == torch.int32 and packed.shape == (shape[0], shape[1] * bits // 32)
            q = unpack_int32(packed, bits, shape)
            assert q.shape == shape
            assert torch.equal(q, helpers.unpack_from_int32(packed, bits, torch.Size(shape)))
            lo, hi = _range(bits, True)
            # llm-compressor's symmetric scale is absmax / ((qmax - qmin) / 2): the codes use the whole grid,
            # up to the extremes, and no row is all zero
            assert lo <= int(q.min()) and int(q.max()) <= hi
            assert int(q.min()) == lo or int(q.max()) == hi
            assert (q != 0).any(dim=1).all()
            assert scale.shape[0] == shape[0] and (scale > 0).all()
            # repacking gives the same int32 words
            assert torch.equal(pack_int32(q, bits), packed)


def test_real_8bit_pack_and_int_agree():
    """The same llm-compressor run saved as pack-quantized and as int-quantized holds the same codes."""
    from safetensors import safe_open

    with safe_open(str(_real_file("w8a16_ch.layer0.safetensors")), "pt") as fp, \
            safe_open(str(_real_file("w8a16_ch_int.layer0.safetensors")), "pt") as fi:
        for k in [k for k in fp.keys() if k.endswith(".weight_packed")]:
            shape = tuple(fp.get_tensor(k.replace("_packed", "_shape")).tolist())
            q = unpack_int32(fp.get_tensor(k), 8, shape)
            assert torch.equal(q, fi.get_tensor(k.replace("_packed", "")))
