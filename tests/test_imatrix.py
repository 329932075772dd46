"""llama.cpp's importance matrix: `qtool imatrix` writes the GGUF file llama-imatrix writes (per decoder matrix,
each input column's sum of x² and the token count), and the reader takes it or a legacy imatrix.dat back."""

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
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
    # the chunks are the data's own windows (8 rows of 24 token ids), not --seq-len's
    assert (reader.fields["imatrix.chunk_count"].contents(), reader.fields["imatrix.chunk_size"].contents()) == (8, 24)
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
    (tmp_path / "named.gguf").write_bytes(body)  # (llama-imatrix writes this format under any name it is given)
    assert torch.equal(read_imatrix(tmp_path / "named.gguf")["blk.0.attn_q.weight"], got["blk.0.attn_q.weight"])
    # and its entries' own faults are named as in a .dat (not "nor an imatrix.dat")
    (tmp_path / "zero.gguf").write_bytes(body.replace(struct.pack("<ii", ncall, 4), struct.pack("<ii", 0, 4)))
    with pytest.raises(EncodingsError, match="a token count of 0"):
        read_imatrix(tmp_path / "zero.gguf")


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), cut=st.integers(0, 80))
@example(data=struct.pack("<ii", 1, 3) + b"\0\0\n" + struct.pack("<ii", 1, 0), cut=0)  # a name with a newline
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


def _searches(run_dir):
    return {q["name"]: (q["analyzer"], q["min"], q["max"])
            for q in json.loads((run_dir / "encodings.json").read_text())["quantizers"]}


def test_an_imatrix_weights_the_search_exactly_as_the_same_data_would(llama, tmp_path):
    """``--imatrix`` (no data) gives each decoder matrix the weighted search an activation weighting gives from the
    data the file was measured on (``gguf-q4_k_m`` weights by magnitude, so by importance x magnitude, as llama.cpp
    does); matrices the file does not name (the output layer) keep the recipe's own weighting."""
    ckpt, data, _ = llama
    assert run_cli("imatrix", ckpt, "--data", data, "-o", tmp_path / "im.gguf")[0] == 0
    code, out, err = run_cli("calibrate", ckpt, "-c", "gguf-q4_k_m", "--imatrix", tmp_path / "im.gguf",
                             "-o", tmp_path / "file", "--json")
    assert code == 0, err
    assert json.loads(out)["samples"] == 0  # no data was read
    recipe = tmp_path / "weighted.yaml"
    recipe.write_text("version: 1\ngguf_mix: q4_k_m\ndefaults:\n  weights: {analyzer: {name: mse, weighting: "
                      "activations_magnitude}}\n  activations: null\n")
    assert run_cli("calibrate", ckpt, "-c", recipe, "--data", data, "-o", tmp_path / "data")[0] == 0
    assert run_cli("calibrate", ckpt, "-c", "gguf-q4_k_m", "-o", tmp_path / "plain")[0] == 0
    file, measured, plain = (_searches(tmp_path / d) for d in ("file", "data", "plain"))
    blocks = [n for n in file if n.startswith("model.layers.")]
    assert len(blocks) == 14
    for n in blocks:
        assert file[n] == measured[n] and file[n][0] == "mse(weighting=activations_magnitude)"
        assert file[n][1:] != plain[n][1:]  # the weighting changed the search
    assert file["lm_head.weight"] == plain["lm_head.weight"]
    # every calibration mode weights the same way: streamed (above), block by block, whole model in memory
    for mode in (("--sequential",), ()):
        out_dir = tmp_path / f"mode{len(mode)}"
        assert run_cli("calibrate", ckpt, "-c", "gguf-q4_k_m", "--imatrix", tmp_path / "im.gguf", "--data", data,
                       *mode, "-o", out_dir)[0] == 0
        assert (out_dir / "encodings.json").read_bytes() == (tmp_path / "file" / "encodings.json").read_bytes()
    manifest = json.loads((tmp_path / "file" / "manifest.json").read_text())
    assert manifest["inputs"]["imatrix"]["weights"] == 14 and len(manifest["inputs"]["imatrix"]["sha256"]) == 64
    # and in memory (with GPTQ on data beside it) the file still weights the search of the grid GPTQ rounds on
    code, _, err = run_cli("calibrate", ckpt, "-c", "gguf-q4_k_m-gptq", "--imatrix", tmp_path / "im.gguf",
                           "--data", data, "-o", tmp_path / "gptq")
    assert code == 0, err
    gptq = _searches(tmp_path / "gptq")
    assert all(gptq[n][0] == "mse(weighting=activations)" for n in blocks)


def test_a_weight_the_imatrix_does_not_name_keeps_the_magnitude_part_without_data(llama, tmp_path):
    ckpt, data, _ = llama
    assert run_cli("imatrix", ckpt, "--data", data, "-o", tmp_path / "im.gguf")[0] == 0
    recipe = tmp_path / "both.yaml"
    recipe.write_text("version: 1\ngguf_mix: q4_k_m\ndefaults:\n  weights: {analyzer: {name: mse, weighting: "
                      "activations_magnitude}}\n  activations: null\n")
    code, out, err = run_cli("calibrate", ckpt, "-c", recipe, "--imatrix", tmp_path / "im.gguf", "-o",
                             tmp_path / "run", "--json")
    assert code == 0, err
    searches = _searches(tmp_path / "run")
    assert searches["lm_head.weight"][0] == "mse(weighting=magnitude)"  # no entry in the file, no data
    assert searches["model.layers.0.mlp.down_proj.weight"][0] == "mse(weighting=activations_magnitude)"
    assert "activations_magnitude keeps its magnitude part" in " ".join(json.loads(out)["warnings"])


def test_an_imatrix_that_does_not_fit_the_model_is_one_line_and_writes_nothing(llama, tmp_path):
    from qtool.imatrix import write_imatrix

    ckpt, _, _ = llama
    cases = {
        "other.gguf": ({"blk.7.attn_q.weight": [(torch.ones(64), 4)]}, "blk.7.attn_q.weight: no Linear layer of the "
                       "model has that GGUF name"),
        # (the model has an embedding table by that name, which is not a Linear: it read "has no such weight")
        "embd.gguf": ({"token_embd.weight": [(torch.ones(64), 4)]}, "token_embd.weight: no Linear layer"),
        "narrow.gguf": ({"blk.0.attn_q.weight": [(torch.ones(32), 4)]}, "32 columns, but model.layers.0.self_attn"),
    }
    for name, (sums, needle) in cases.items():
        write_imatrix(tmp_path / name, sums, ["x"], 8, 1)
        code, _, err = run_cli("calibrate", ckpt, "-c", "gguf-q4_k_m", "--imatrix", tmp_path / name,
                               "-o", tmp_path / "out")
        assert code == 2 and needle in err and str(tmp_path / name) in err, err
        assert len([e for e in error_lines(err) if e.startswith("error")]) == 1 and not (tmp_path / "out").exists()
    write_imatrix(tmp_path / "ok.gguf", {"blk.0.attn_q.weight": [(torch.ones(64), 4)]}, ["x"], 8, 1)
    for recipe, needle in (("w8a16", "nothing would use it"),):
        code, _, err = run_cli("calibrate", ckpt, "-c", recipe, "--imatrix", tmp_path / "ok.gguf",
                               "-o", tmp_path / "out")
        assert code == 2 and needle in err and not (tmp_path / "out").exists(), err
    code, _, err = run_cli("calibrate", ckpt, "-c", "gguf-q4_k_m", "--imatrix", tmp_path / "none.gguf",
                           "-o", tmp_path / "out")
    assert code == 2 and "no such file" in err and not (tmp_path / "out").exists()
    # an empty file, or a .gguf that is not GGUF, was described as a truncated imatrix.dat
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "text.gguf").write_text("blk.0.attn_q.weight 1 2 3\n")
    for name, needle in (("empty.gguf", "an empty file"), ("text.gguf", "not a GGUF file")):
        code, _, err = run_cli("calibrate", ckpt, "-c", "gguf-q4_k_m", "--imatrix", tmp_path / name,
                               "-o", tmp_path / "out")
        assert code == 2 and needle in err and "a truncated imatrix.dat" not in err, err
        assert not (tmp_path / "out").exists()


def test_an_imatrix_that_names_only_some_decoder_layers_is_said_or_refused_with_strict_data(llama, tmp_path):
    """A file measured on a model with fewer layers covered the first ones and the rest were searched without it,
    without a word."""
    from qtool.imatrix import write_imatrix

    ckpt, data, _ = llama
    assert run_cli("imatrix", ckpt, "--data", data, "-o", tmp_path / "im.gguf")[0] == 0
    full = read_imatrix(tmp_path / "im.gguf")
    first = {n: [(v * 8, 8)] for n, v in full.items() if n.startswith("blk.0.")}
    later = sorted(n for n in full if not n.startswith("blk.0."))
    assert first and later
    write_imatrix(tmp_path / "part.gguf", first, ["x"], 8, 1)
    args = ("calibrate", ckpt, "-c", "gguf-q4_k_m", "--imatrix", tmp_path / "part.gguf")
    code, out, err = run_cli(*args, "-o", tmp_path / "run", "--json")
    assert code == 0, err
    [said] = [w for w in json.loads(out)["warnings"] if "has no entry for" in w]
    assert f"has no entry for {len(later)} decoder matrices the recipe searches ({later[0]}" in said, said
    code, _, err = run_cli(*args, "-o", tmp_path / "strict", "--strict-data")
    assert code == 2 and "has no entry for" in err and not (tmp_path / "strict").exists(), err


def test_data_the_model_rejects_is_one_line(llama, tmp_path):
    """imatrix ran the model without calibration's check: ids past the vocabulary were an internal error (exit 3)."""
    from safetensors.torch import save_file

    ckpt, _, ids = llama
    bad = ids.clone()
    bad[1, 3] = 60000
    save_file({"input_ids": bad}, tmp_path / "bad.safetensors")
    code, _, err = run_cli("imatrix", ckpt, "--data", tmp_path / "bad.safetensors", "-o", tmp_path / "m.gguf")
    assert code == 2 and not (tmp_path / "m.gguf").exists()
    assert error_lines(err)[-1].startswith(f"error: {tmp_path / 'bad.safetensors'}: importance batch 1: the model "
                                           "rejected the data: token id 60000 "
                                           "is past the model's vocabulary"), err


def test_without_the_gguf_package_commands_name_the_extra(llama, tmp_path, monkeypatch):
    """gguf missing read as an internal error (imatrix, a GGUF export) or as a damaged importance matrix."""
    ckpt, data, _ = llama
    code, _, err = run_cli("imatrix", ckpt, "--data", data, "-o", tmp_path / "m.gguf")
    assert code == 0, err
    monkeypatch.setitem(sys.modules, "gguf", None)  # (as if not installed)
    for args in (("imatrix", ckpt, "--data", data, "-o", tmp_path / "m2.gguf"),
                 ("quantize", ckpt, "-c", "gguf-q8_0", "-o", tmp_path / "q", "--format", "gguf"),
                 ("calibrate", ckpt, "-c", "gguf-q4_k_m", "--imatrix", tmp_path / "m.gguf", "-o", tmp_path / "c")):
        code, _, err = run_cli(*args)
        assert code == 2, err
        assert [e for e in error_lines(err) if e.startswith("error")] == [
            "error: this needs the optional package gguf: pip install 'qtool[gguf]' (nothing was written)"], err
        assert "measuring" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_padding_is_no_text_the_imatrix_counts(llama, tmp_path):
    """Token ids at positions attention_mask drops change nothing in the file, and the token count is the mask's
    (llama-imatrix never pads); data every mask drops whole is one line, nothing written."""
    from safetensors.torch import save_file

    ckpt, _, ids = llama
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # right padding
    mask[2, :7] = 0  # left padding
    mask[3] = 0  # a row of nothing
    other = torch.where(mask > 0, ids, (ids * 7 + 3) % 300)
    summaries, files = [], []
    for name, x in (("a", ids), ("b", other)):  # (one file name: the file records it)
        (tmp_path / name).mkdir()
        save_file({"input_ids": x, "attention_mask": mask}, tmp_path / name / "ids.safetensors")
        code, out, err = run_cli("imatrix", ckpt, "--data", tmp_path / name / "ids.safetensors", "-o",
                                 tmp_path / f"{name}.gguf", "--json")
        assert code == 0, err
        summaries.append(json.loads(out))
        files.append((tmp_path / f"{name}.gguf").read_bytes())
    assert files[0] == files[1]
    assert summaries[0]["tokens"] == int(mask.sum()) == ids.numel() - 14 - 7 - 24
    # the chunks llama-imatrix counts: the rows that hold text (row 3 is padding alone)
    assert gguf.GGUFReader(tmp_path / "a.gguf").fields["imatrix.chunk_count"].contents() == len(ids) - 1
    # each row's text alone: the sums of the rows run one by one without their padding
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    seen = []
    down = model.model.layers[0].mlp.down_proj
    hook = down.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, 128)))
    with torch.no_grad():
        for r in range(len(ids)):
            if mask[r].any():
                model(ids[r:r + 1, mask[r] > 0])
    hook.remove()
    x = torch.cat(seen).double()
    mean = read_imatrix(tmp_path / "a.gguf")["blk.0.ffn_down.weight"]
    assert torch.allclose(mean.double(), (x * x).mean(0), rtol=1e-5)
    save_file({"input_ids": ids, "attention_mask": torch.zeros_like(ids)}, tmp_path / "none.safetensors")
    code, _, err = run_cli("imatrix", ckpt, "--data", tmp_path / "none.safetensors", "-o", tmp_path / "n.gguf")
    assert code == 2 and not (tmp_path / "n.gguf").exists()
    assert [line for line in error_lines(err) if "error" in line] == [f"error: {tmp_path / 'none.safetensors'}: holds no token its attention_mask keeps "
                                "(every mask is 0): nothing to measure an importance matrix on"], err


def test_unpadded_rows_cut_what_is_per_token_and_keep_the_rest():
    """Each row without its padding: ids, positions and embeddings cut as the mask is; an image whose channels
    happen to number the sequence length keeps its row whole (it was cut along its channels)."""
    from qtool.data import Batch, unpadded_rows

    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    batch = Batch(kwargs={"input_ids": torch.tensor([[5, 6, 0], [0, 7, 8]]), "attention_mask": mask,
                          "position_ids": torch.tensor([[0, 1, 2], [0, 1, 2]]),
                          "inputs_embeds": torch.arange(18.0).reshape(2, 3, 3),
                          "pixel_values": torch.zeros(2, 3, 4, 4)})
    rows = unpadded_rows(batch)
    assert [r.kwargs["input_ids"].tolist() for r in rows] == [[[5, 6]], [[7, 8]]]
    assert [r.kwargs["position_ids"].tolist() for r in rows] == [[[0, 1]], [[1, 2]]]
    assert rows[1].kwargs["inputs_embeds"].tolist() == [[[12.0, 13.0, 14.0], [15.0, 16.0, 17.0]]]
    assert [tuple(r.kwargs["pixel_values"].shape) for r in rows] == [(1, 3, 4, 4)] * 2
    assert unpadded_rows(Batch(kwargs={"input_ids": mask, "attention_mask": torch.ones_like(mask)}))[0].size == 2
    assert unpadded_rows(Batch(kwargs={"input_ids": mask, "attention_mask": torch.zeros_like(mask)})) == []
