"""Large encodings go to encodings.safetensors beside encodings.json (schema version 2); small ones stay inline."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from qtool.encodings import INLINE_LIMIT, SIDECAR, EncodingEntry, EncodingsFile
from qtool.errors import EncodingsError
from qtool.quant import reduce_to_shape

from tests.helpers import error_lines, run_cli
from tests.test_pipeline import CONFIGS

WIDE = "tests.test_encodings_sidecar:wide"


def wide() -> nn.Module:
    """One Linear whose int4 block-32 encoding (2048 x 64 = 131072 blocks) is above the inline limit."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 16))


def _entries():
    g = torch.Generator().manual_seed(3)
    w1, w2 = torch.randn(64, 128, generator=g), torch.randn(8, 16, generator=g)
    lo, hi = reduce_to_shape(w1, (64, 4), (1, 32))
    big = EncodingEntry("a.weight", "a", "weight", 4, True, "per_block", (64, 4), (1, 32), "minmax", lo, hi)
    lo, hi = reduce_to_shape(w2, (8, 1), None)
    small = EncodingEntry("b.weight", "b", "weight", 8, False, "per_channel", (8, 1), None, "minmax", lo, hi)
    return big, small


def test_large_entries_go_to_the_sidecar_and_read_back_bit_exact(tmp_path):
    big, small = _entries()
    enc = EncodingsFile([big, small], {"recipe": "x.yaml"})
    files = enc.write(tmp_path / "encodings.json", inline_limit=100)
    assert [f.name for f in files] == ["encodings.json", SIDECAR]
    obj = json.loads((tmp_path / "encodings.json").read_text())
    assert obj["schema_version"] == 2
    a, b = obj["quantizers"]
    assert "min" not in a and a["data"]["file"] == SIDECAR and len(b["min"]) == 8
    with safe_open(str(tmp_path / SIDECAR), "pt") as fh:
        scale, offset = big.scale_offset()
        assert torch.equal(fh.get_tensor("a.weight.min"), big.min)
        assert torch.equal(fh.get_tensor("a.weight.scale"), scale)
        assert fh.get_tensor("a.weight.offset").dtype == torch.int32
        assert torch.equal(fh.get_tensor("a.weight.offset"), offset.to(torch.int32))
    back = EncodingsFile.read(tmp_path / "encodings.json")
    for x, y in zip(enc.entries, back.entries):
        assert torch.equal(x.min, y.min) and torch.equal(x.max, y.max) and x.header_json() == y.header_json()
    assert back.data_files == [tmp_path / SIDECAR]


def test_small_files_stay_version_1_without_a_sidecar(tmp_path):
    files = EncodingsFile(list(_entries()), {}).write(tmp_path / "encodings.json")
    assert [f.name for f in files] == ["encodings.json"] and not (tmp_path / SIDECAR).exists()
    assert json.loads((tmp_path / "encodings.json").read_text())["schema_version"] == 1


@pytest.mark.parametrize("damage, message", [
    (lambda d, o: (d / SIDECAR).unlink(), "encodings data file not found"),
    (lambda d, o: (d / SIDECAR).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}"), "not a readable safetensors"),
    (lambda d, o: o["quantizers"][0]["data"].update(min="nope"), "data.min names no tensor"),
    (lambda d, o: o["quantizers"][0]["data"].update(max="a.weight.offset"), "expected F32 [64, 4]"),
    (lambda d, o: o["quantizers"][0]["data"].update(file="../elsewhere.safetensors"), "a file name beside the JSON"),
    (lambda d, o: o["quantizers"][0].update(data=[1]), "'data' must be an object"),
    (lambda d, o: o.update(schema_version=1), "'data' needs schema_version 2"),
])
def test_a_damaged_sidecar_is_one_clear_error(tmp_path, damage, message):
    EncodingsFile(list(_entries()), {}).write(tmp_path / "encodings.json", inline_limit=100)
    obj = json.loads((tmp_path / "encodings.json").read_text())
    damage(tmp_path, obj)
    (tmp_path / "encodings.json").write_text(json.dumps(obj))
    with pytest.raises(EncodingsError, match=message.replace("[", r"\[")) as err:
        EncodingsFile.read(tmp_path / "encodings.json")
    assert "\n" not in str(err.value)


def test_cli_writes_a_sidecar_for_big_block_encodings_and_exports_from_it(tmp_path):
    ckpt = tmp_path / "wide.safetensors"
    save_file(wide().state_dict(), ckpt)
    code, out, err = run_cli("calibrate", ckpt, "-c", CONFIGS / "w4a16-block32.yaml", "-o", tmp_path / "run",
                             "--model-class", WIDE, "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert sorted(summary["files"]) == sorted(str(tmp_path / "run" / n)
                                              for n in ("encodings.json", SIDECAR, "manifest.json"))
    obj = json.loads((tmp_path / "run" / "encodings.json").read_text())
    assert obj["schema_version"] == 2
    first, second = obj["quantizers"]
    assert 2048 * 64 > INLINE_LIMIT and "data" in first  # 131072 blocks: sidecar
    assert "min" in second  # 16 x 64 blocks: inline
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert set(manifest["outputs"]) == {"encodings.json", SIDECAR}

    code, out, err = run_cli("export", ckpt, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / "x",
                             "--json")
    assert code == 0, err
    emanifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert emanifest["inputs"]["encodings_data"] == [{"path": SIDECAR, "sha256": manifest["outputs"][SIDECAR]}]

    # the same encodings written inline export to the same bytes
    enc = EncodingsFile.read(tmp_path / "run" / "encodings.json")
    (tmp_path / "inline").mkdir()
    enc.write(tmp_path / "inline" / "encodings.json", inline_limit=None)
    assert run_cli("export", ckpt, "-e", tmp_path / "inline" / "encodings.json", "-o", tmp_path / "y")[0] == 0
    assert (tmp_path / "x" / "model.safetensors").read_bytes() == (tmp_path / "y" / "model.safetensors").read_bytes()


def test_export_with_a_missing_sidecar_fails_with_one_line(tmp_path):
    ckpt = tmp_path / "wide.safetensors"
    save_file(wide().state_dict(), ckpt)
    assert run_cli("calibrate", ckpt, "-c", CONFIGS / "w4a16-block32.yaml", "-o", tmp_path / "run",
                   "--model-class", WIDE)[0] == 0
    (tmp_path / "run" / SIDECAR).unlink()
    code, out, err = run_cli("export", ckpt, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / "x")
    assert code == 2 and len(error_lines(err)) == 1 and "encodings data file not found" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("inline_limit", [None, 100])
def test_streamed_json_is_byte_identical_to_json_dumps(tmp_path, inline_limit):
    """encodings.json is written entry by entry; the bytes are those of json.dumps(indent=1) of the whole file."""
    big, small = _entries()
    scalar = EncodingEntry("c.input", "c", "input", 8, False, "per_tensor", (), None, "minmax",
                           torch.tensor(-1.5), torch.tensor(2.25))
    for entries in ([], [small], [big, small, scalar]):
        enc = EncodingsFile(entries, {"qtool_version": "x", "recipe": "r.yaml", "nested": {"a": [1, 2]}})
        want = json.dumps(enc.to_json(inline_limit), indent=1) + "\n"
        assert enc.dumps(inline_limit) == want
        enc.write(tmp_path / "encodings.json", inline_limit=inline_limit)
        assert (tmp_path / "encodings.json").read_text() == want


def test_lazy_read_keeps_sidecar_numbers_on_disk_until_asked(tmp_path):
    big, small = _entries()
    EncodingsFile([big, small], {}).write(tmp_path / "encodings.json", inline_limit=100)
    lazy = EncodingsFile.read(tmp_path / "encodings.json", lazy=True)
    a, b = lazy.entries
    assert a.min.device.type == "meta" and a.source is not None  # the sidecar entry is not loaded
    assert b.min.device.type == "cpu"  # inline entries are
    lo, hi = a.range()
    assert torch.equal(lo, big.min) and torch.equal(hi, big.max)
    s1, o1 = a.scale_offset()
    s2, o2 = big.scale_offset()
    assert torch.equal(s1, s2) and torch.equal(o1, o2)
    eager = lazy.materialized()
    assert torch.equal(eager.entries[0].min, big.min) and eager.entries[0].source is None
    # written again (sidecar included) from the lazy entries: the same bytes
    (tmp_path / "again").mkdir()
    lazy.write(tmp_path / "again" / "encodings.json", inline_limit=100)
    for name in ("encodings.json", SIDECAR):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / name).read_bytes()
    # a wrong dtype is caught from the header, before any number is read
    obj = json.loads((tmp_path / "encodings.json").read_text())
    obj["quantizers"][0]["data"]["min"] = "a.weight.offset"
    (tmp_path / "encodings.json").write_text(json.dumps(obj))
    with pytest.raises(EncodingsError, match="expected F32"):
        EncodingsFile.read(tmp_path / "encodings.json", lazy=True)


def _edit_sidecar(run, edit) -> None:
    """Change the sidecar's tensors in place by ``edit`` (a hand edit, metadata kept)."""
    with safe_open(run / SIDECAR, "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    edit(tensors)
    save_file(tensors, str(run / SIDECAR), metadata=meta)


def test_qtools_own_writer_refuses_non_finite_sidecar_numbers(tmp_path):
    from qtool.io.finite import UnstorableValues

    big, small = _entries()
    big.min = big.min.clone()
    big.min[3, 1] = float("nan")
    with pytest.raises(UnstorableValues, match=r"^a\.weight\.min: holds NaN"):  # naming the tensor
        EncodingsFile([big, small], {}).write(tmp_path / "encodings.json", inline_limit=100)


def _overflow(t):  # finite, but /7 steps overflows
    t["a.weight.min"][0, 0], t["a.weight.max"][0, 0] = -3e38, 3e38


@pytest.mark.parametrize("edit, whole, lazy, ask", [
    (lambda t: t["a.weight.min"].__setitem__((3, 1), float("nan")), "finite",
     "a.weight.min/a.weight.max: min/max must be finite", "scale_offset"),
    (_overflow, "overflows float32", r"a.weight.min/a.weight.max: its range \[.*\] overflows float32", "scale_offset"),
    # entries kept in the sidecar are read when their numbers are asked for (export --format qtool of a large model):
    # they are refused for what refuses an entry read whole
    (lambda t: t["a.weight.min"].__setitem__((5, 2), float(t["a.weight.max"][5, 2]) + 1), "min is above max",
     "a.weight.min/a.weight.max: min is above max", "range"),
], ids=["nan", "overflow", "min_above_max"])
def test_a_hand_edited_sidecar_is_an_encodings_error_read_whole_or_lazily(tmp_path, edit, whole, lazy, ask):
    big, small = _entries()
    EncodingsFile([big, small], {}).write(tmp_path / "encodings.json", inline_limit=100)
    _edit_sidecar(tmp_path, edit)
    with pytest.raises(EncodingsError, match=whole):
        EncodingsFile.read(tmp_path / "encodings.json")
    entry = EncodingsFile.read(tmp_path / "encodings.json", lazy=True).entries[0]
    with pytest.raises(EncodingsError, match=lazy):
        getattr(entry, ask)()


def test_an_nvfp4_global_amax_below_its_blocks_is_refused_from_the_sidecar_too(tmp_path):
    """The qtool format reads a large entry lazily; a hand-edited global_amax below its blocks' amax (every block
    scale saturated, the weight clipped) was exported there without a word, where the other formats refuse it."""
    ckpt = tmp_path / "wide.safetensors"
    save_file(wide().state_dict(), ckpt)
    assert run_cli("calibrate", ckpt, "-c", "nvfp4a16", "-o", tmp_path / "run", "--model-class", WIDE)[0] == 0
    obj = json.loads((tmp_path / "run" / "encodings.json").read_text())
    assert "data" in obj["quantizers"][0]  # in the sidecar
    obj["quantizers"][0]["global_amax"] = 1e-3  # (recorded where a runtime fuses layers, e.g. q/k/v)
    (tmp_path / "run" / "encodings.json").write_text(json.dumps(obj))
    for fmt in ("qtool", "compressed-tensors"):
        code, _, err = run_cli("export", ckpt, "-e", tmp_path / "run" / "encodings.json", "-o", tmp_path / fmt,
                               "--format", fmt, "--model-class", WIDE)
        lines = [line for line in error_lines(err) if line.startswith("error")]
        assert code == 2 and len(lines) == 1 and "global_amax 0.001 is below the largest amax of its blocks" in \
            lines[0], (fmt, err)
        assert not (tmp_path / fmt).exists()


def test_sidecar_stream_abort_leaves_the_real_error_alone(tmp_path):
    """A run that fails mid-calibration aborts the stream quietly; closing a half-written one is an error."""
    from qtool.encodings import SidecarStream

    big, _ = _entries()
    shapes = [("a.weight", big.shape, big.granularity), ("b.weight", big.shape, big.granularity)]
    stream = SidecarStream(tmp_path / SIDECAR, shapes, inline_limit=100)
    stream.put(big)
    stream.abort()  # no exception about the missing second entry
    stream = SidecarStream(tmp_path / "other.safetensors", shapes, inline_limit=100)
    stream.put(big)
    with pytest.raises(ValueError, match="only 4 of 8 declared tensors"):
        stream.close()


@pytest.mark.parametrize("recipe, element, scale_dtype", [("nvfp4a16", "fp4_e2m1", "fp8_e4m3"),
                                                          ("gguf-q4_k_m", "int", "q4_k")])
def test_streamed_sidecar_entries_keep_their_grid(tmp_path, recipe, element, scale_dtype):
    """A weight-only run on a Hugging Face directory streams its block entries to the sidecar as each weight is
    done; the JSON must still say which grid they are on (element, scale type), not fall back to integers."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "m")
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", recipe, "-o", tmp_path / "run", "--quiet")
    assert code == 0, err
    obj = json.loads((tmp_path / "run/encodings.json").read_text())
    up = next(q for q in obj["quantizers"] if q["name"] == "model.layers.0.mlp.up_proj.weight")
    assert "data" in up and up.get("element", "int") == element and up["scale_dtype"] == scale_dtype, up
    entry = {e.name: e for e in EncodingsFile.read(tmp_path / "run/encodings.json").entries}[up["name"]]
    assert (entry.element, entry.scale_dtype) == (element, scale_dtype)


def test_inspect_of_the_sidecar_alone_names_its_encodings_json(tmp_path):
    """inspect encodings.safetensors read the ranges and scales as a float model: '0 of 840 quantized, 32 bits per
    weight'."""
    from tests.helpers import error_lines, run_cli

    (tmp_path / "encodings.json").write_text("{}")
    save_file({"a.min": torch.zeros(3)}, tmp_path / SIDECAR)
    code, _, err = run_cli("inspect", tmp_path / SIDECAR)
    assert code == 2 and error_lines(err) == [f"error: {tmp_path / SIDECAR}: the numbers of "
                                              f"{tmp_path / 'encodings.json'}, which names them: inspect that"], err

