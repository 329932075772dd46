"""Integer export at scale: sharded output (index + shards), sharded input, chunked quantization of big tensors."""

import json

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qtool.encodings import EncodingEntry, EncodingsFile
from qtool.export import qtool_st as integer
from qtool.export.qtool_st import export_integer, read_integer_export
from qtool.quant import reduce_to_shape


def _tensors():
    g = torch.Generator().manual_seed(0)
    t = {
        "embed.weight": torch.randn(96, 64, generator=g).to(torch.float16),
        "norm.weight": torch.rand(64, generator=g).to(torch.float16),
    }
    for i in range(3):
        t[f"layers.{i}.fc1.weight"] = torch.randn(128, 64, generator=g).to(torch.float16)
        t[f"layers.{i}.fc1.bias"] = torch.randn(128, generator=g).to(torch.float16)
        t[f"layers.{i}.fc2.weight"] = torch.randn(64, 128, generator=g).to(torch.float16)
    return t


def _entry(name, w, bitwidth, block):
    if block is None:
        shape, bs, gran = (w.shape[0], 1), None, "per_channel"
    else:
        shape, bs, gran = (w.shape[0], w.shape[1] // block), (1, block), "per_block"
    mn, mx = reduce_to_shape(w.float(), shape, bs)
    return EncodingEntry(name, name.rsplit(".", 1)[0], "weight", bitwidth, True, gran, shape, bs, "minmax", mn, mx)


def _encodings(tensors):
    entries = [_entry("embed.weight", tensors["embed.weight"], 8, None)]
    for i in range(3):
        entries.append(_entry(f"layers.{i}.fc1.weight", tensors[f"layers.{i}.fc1.weight"], 4, 32))
        entries.append(_entry(f"layers.{i}.fc2.weight", tensors[f"layers.{i}.fc2.weight"], 8, None))
    return EncodingsFile(entries, {})


@pytest.fixture
def ckpt(tmp_path):
    tensors = _tensors()
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    return path, tensors


def _export(src, enc, out, **kw):
    out.mkdir()
    return export_integer(src, enc, out, **kw)


def test_sharded_export_round_trips_like_the_single_file(tmp_path, ckpt):
    path, tensors = ckpt
    enc = _encodings(tensors)
    one = _export(path, enc, tmp_path / "one")
    assert one["files"] == ["model.safetensors"] and not (tmp_path / "one" / "model.safetensors.index.json").exists()

    many = _export(path, enc, tmp_path / "many", max_shard_bytes=20_000)
    out = tmp_path / "many"
    n = many["shards"]
    assert n >= 3
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] == many["files"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    total = 0
    seen = {}
    for name in names:
        with safe_open(str(out / name), "pt") as fh:
            meta = fh.metadata()
            info = json.loads(meta["qtool"])
            assert meta["format"] == "qtool.int"
            keys = list(fh.keys())
            assert set(info) <= set(keys)  # the shard's metadata lists only its own quantized tensors
            for k in keys:
                seen[k] = name
                t = fh.get_tensor(k)
                total += t.numel() * t.element_size()
            for q in info:  # companions live with their codes
                assert q + "_scale" in keys and q + "_offset" in keys
        assert (out / name).stat().st_size <= 20_000 + 4096 or len(keys) <= 3  # oversize unit: a shard of its own
    assert index["weight_map"] == seen
    assert index["metadata"]["total_size"] == total
    with safe_open(str(tmp_path / "one" / "model.safetensors"), "pt") as fh:
        assert set(fh.keys()) == set(seen)

    ref = read_integer_export(tmp_path / "one" / "model.safetensors")
    for given in (out, out / "model.safetensors.index.json"):
        got = read_integer_export(given)
        assert set(got) == set(ref) == set(tensors)
        for k in ref:
            assert torch.equal(got[k], ref[k]), k
    assert torch.equal(ref["norm.weight"], tensors["norm.weight"])  # unquantized tensors copied unchanged


def test_sharded_input_checkpoint(tmp_path, ckpt):
    path, tensors = ckpt
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    keys = sorted(tensors)
    parts = [keys[:4], keys[4:]]
    weight_map = {}
    for i, part in enumerate(parts, 1):
        name = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, hf / name)
        weight_map.update({k: name for k in part})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    enc = _encodings(tensors)
    _export(path, enc, tmp_path / "ref")
    s = _export(hf, enc, tmp_path / "sh", max_shard_bytes=30_000)
    assert s["shards"] >= 2
    ref, got = read_integer_export(tmp_path / "ref"), read_integer_export(tmp_path / "sh")
    assert set(ref) == set(got) and all(torch.equal(ref[k], got[k]) for k in ref)


def test_chunked_quantization_is_bit_identical(tmp_path, ckpt, monkeypatch):
    path, tensors = ckpt
    enc = _encodings(tensors)
    _export(path, enc, tmp_path / "whole")
    monkeypatch.setattr(integer, "_CHUNK_ELEMS", 200)  # forces row chunks on every weight
    assert integer._chunk_rows((128, 64), (128, 2), (1, 32), True) is not None
    _export(path, enc, tmp_path / "chunked")
    assert (tmp_path / "whole" / "model.safetensors").read_bytes() == \
        (tmp_path / "chunked" / "model.safetensors").read_bytes()


def test_chunked_quantization_other_granularities(tmp_path, ckpt, monkeypatch):
    path, tensors = ckpt
    w1, w2 = tensors["layers.0.fc1.weight"].float(), tensors["layers.0.fc2.weight"].float()
    mn, mx = reduce_to_shape(w1, (), None)  # per-tensor
    e1 = EncodingEntry("layers.0.fc1.weight", "layers.0.fc1", "weight", 4, True, "per_tensor", (), None, "minmax",
                       mn, mx)
    mn, mx = reduce_to_shape(w2, (1, 4), (64, 32))  # blocks spanning every row
    e2 = EncodingEntry("layers.0.fc2.weight", "layers.0.fc2", "weight", 3, False, "per_block", (1, 4), (64, 32),
                       "minmax", mn, mx)
    mn, mx = reduce_to_shape(tensors["embed.weight"].float(), (24, 1), (4, 64))  # blocks of 4 rows
    e3 = EncodingEntry("embed.weight", "embed", "weight", 8, True, "per_block", (24, 1), (4, 64), "minmax", mn, mx)
    enc = EncodingsFile([e1, e2, e3], {})
    _export(path, enc, tmp_path / "whole")
    monkeypatch.setattr(integer, "_CHUNK_ELEMS", 300)
    _export(path, enc, tmp_path / "chunked")
    assert (tmp_path / "whole" / "model.safetensors").read_bytes() == \
        (tmp_path / "chunked" / "model.safetensors").read_bytes()


def test_chunk_rows_respects_blocks_and_packing(monkeypatch):
    monkeypatch.setattr(integer, "_CHUNK_ELEMS", 100)
    # blocks of 4 rows: chunks are whole blocks
    r = integer._chunk_rows((64, 10), (16, 1), (4, -1), False)
    assert r is not None and r % 4 == 0
    # 5 codes a row, packed: a chunk must hold a multiple of 8 codes
    r = integer._chunk_rows((64, 5), (64, 1), None, True)
    assert r is not None and (r * 5) % 8 == 0
    assert integer._chunk_rows((4, 10), (4, 1), None, False) is None  # small: one piece


def test_oversize_tensor_gets_its_own_shard(tmp_path, ckpt):
    path, tensors = ckpt
    s = _export(path, _encodings(tensors), tmp_path / "o", max_shard_bytes=1)
    # every unit (a tensor, or codes + scale + offset) is alone
    assert s["shards"] == len(tensors)
    got = read_integer_export(tmp_path / "o")
    assert set(got) == set(tensors)


@pytest.mark.parametrize("bits,symmetric,shape,block", [
    (8, True, (40, 1), None), (8, False, (40, 1), None), (4, True, (40, 3), (1, 32)), (4, False, (40, 3), (1, 32)),
    (3, False, (10, 3), (4, 32)), (2, True, (), None), (1, False, (40, 1), None), (6, True, (1, 3), (40, 32)),
    (12, False, (40, 1), None),
])
def test_storage_matches_quantize_and_pack_bytes(monkeypatch, bits, symmetric, shape, block):
    from qtool.quant import min_max_to_scale_offset, quantize
    from qtool.quant.affine import grid
    from qtool.quant.packing import pack_bytes

    g = torch.Generator().manual_seed(bits)
    x = torch.randn(40, 96, generator=g).to(torch.float16)
    mn, mx = reduce_to_shape(x.float(), shape, block)
    mn, mx = mn * 0.7, mx * 0.7  # some values clamp
    # what _quantize_to_storage reads of an entry (a plain object: 1-bit grids exist only at this level)
    e = SimpleNamespace(bitwidth=bits, block_size=block, qmin_qmax=grid(bits, symmetric))
    qmin, qmax = grid(bits, symmetric)
    scale, offset = min_max_to_scale_offset(mn, mx, qmin, qmax, symmetric)
    x[0, :8] = (torch.arange(8) + 0.5).to(torch.float16) * scale.reshape(-1)[0].to(torch.float16)  # ties
    ref = quantize(x.float(), scale, offset, qmin=qmin, qmax=qmax, block_size=block)
    packed = bits < 8
    int_dtype = torch.int8 if bits <= 8 and qmin < 0 else (torch.uint8 if bits <= 8 else torch.int16)
    want = pack_bytes(ref.to(torch.int32).reshape(-1), bits) if packed else ref.to(int_dtype)
    for chunk in (1 << 20, 8 * 96):  # one piece, then chunks of rows
        monkeypatch.setattr(integer, "_CHUNK_ELEMS", chunk)
        got = integer._quantize_to_storage(x, scale, offset, e, packed, int_dtype)
        assert got.dtype == want.dtype and torch.equal(got, want), chunk


# ---------------------------------------------------------------------------------------------------------------
# The CLI: --max-shard-size, inspect on a sharded export, the AIMET JSON skipped for huge encodings
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wide_run(tmp_path_factory):
    from tests.helpers import run_cli
    from tests.test_encodings_sidecar import WIDE, wide
    from tests.test_pipeline import CONFIGS

    d = tmp_path_factory.mktemp("wide")
    save_file(wide().state_dict(), d / "wide.safetensors")
    code, _, err = run_cli("calibrate", d / "wide.safetensors", "-c", CONFIGS / "w4a16-block32.yaml", "-o", d / "run",
                           "--model-class", WIDE)
    assert code == 0, err
    return d


def test_cli_max_shard_size_shards_the_export_and_inspect_reads_it(wide_run, tmp_path):
    from qtool.inspect import inspect_path
    from tests.helpers import run_cli

    ckpt, enc = wide_run / "wide.safetensors", wide_run / "run" / "encodings.json"
    code, out, err = run_cli("export", ckpt, "-e", enc, "-o", tmp_path / "sharded", "--max-shard-size", "1MB",
                             "--json")
    assert code == 0, err
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 3  # 0.bias | 0.weight with its scales and offsets (3.1 MB: a weight is never split) | 2.*
    assert run_cli("export", ckpt, "-e", enc, "-o", tmp_path / "one", "--max-shard-size", "none")[0] == 0
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    a, b = read_integer_export(tmp_path / "sharded"), read_integer_export(tmp_path / "one")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    sharded, single = inspect_path(tmp_path / "sharded"), inspect_path(tmp_path / "one")
    assert sharded["kind"] == f"qtool integer safetensors ({len(shards)} shards)"
    assert sharded["tensors"] == single["tensors"] and sharded["totals"] == single["totals"]
    assert [t["name"] for t in sharded["tensors"] if t["quantized"]] == ["0.weight", "2.weight"]


@pytest.mark.parametrize("size", ["5 parsecs", "-1GB", "GB", "nanGB"])
def test_cli_bad_max_shard_size_is_one_line(wide_run, tmp_path, size):
    from tests.helpers import error_lines, run_cli

    code, _, err = run_cli("export", wide_run / "wide.safetensors", "-e", wide_run / "run" / "encodings.json",
                           "-o", tmp_path / "x", "--max-shard-size", size)
    assert code == 2 and len(error_lines(err)) == 1 and "--max-shard-size" in err and not (tmp_path / "x").exists()


def test_parse_size_units():
    from qtool.io.fs import parse_size

    assert parse_size("5GB", "x") == 5 * 10**9 and parse_size("2GiB", "x") == 2 << 30
    assert parse_size("1.5 mb", "x") == 1_500_000 and parse_size("123", "x") == 123
    assert parse_size("0", "x") is None and parse_size("None", "x") is None and parse_size("0GB", "x") is None
    assert parse_size("0.03207424GB", "x") == 32_074_240  # (float arithmetic: one byte short)
    from qtool.errors import UsageError

    for huge in ("1e308GB", "1e300TB", "inf", "1e1000000GB", "1e-1000000GB"):  # (OverflowError, decimal.Overflow:
        # internal errors, exit 3)
        with pytest.raises(UsageError, match="is not a size like 5GB"):
            parse_size(huge, "--max-shard-size")


def test_huge_encodings_skip_the_aimet_json_beside_a_qtool_export(wide_run, tmp_path, monkeypatch):
    from qtool.pipeline import export as pipeline
    from tests.helpers import run_cli

    monkeypatch.setattr(pipeline, "AIMET_JSON_LIMIT", 1000)
    code, out, err = run_cli("export", wide_run / "wide.safetensors", "-e", wide_run / "run" / "encodings.json",
                             "-o", tmp_path / "x", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert not (tmp_path / "x" / "model.encodings").exists()
    assert any("model.encodings (AIMET JSON) not written" in w for w in summary["export_warnings"])
    # asked for explicitly, it is written
    assert run_cli("export", wide_run / "wide.safetensors", "-e", wide_run / "run" / "encodings.json",
                   "-o", tmp_path / "y", "--format", "aimet")[0] == 0
    assert (tmp_path / "y" / "model.encodings").exists()


@pytest.mark.parametrize("index", ['[1, 2]', '{"weight_map": [1]}', '{"weight_map": {"a": 3}}',
                                   '{"weight_map": {"a": "../x.safetensors"}}', '{"nope": 1}', 'not json'])
def test_inspect_a_malformed_index_is_one_clear_error(tmp_path, index):
    from tests.helpers import error_lines, run_cli

    (tmp_path / "model.safetensors.index.json").write_text(index)
    code, _, err = run_cli("inspect", tmp_path)
    assert code == 2 and len(error_lines(err)) == 1 and "safetensors index" in err, err
