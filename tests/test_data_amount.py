"""Too little calibration data warns (or, with --strict-data, fails with nothing written) below the documented
minimums of qtool.calibration.data_check; an importance matrix that weighs a tensor's inputs all zero likewise."""

import json
import re

import pytest
import torch

from qtool.calibration.data_check import MIN_SAMPLES, MIN_TOKENS
from tests.helpers import error_lines, run_cli

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.test_gguf import _tiny_llama

    return _tiny_llama(tmp_path_factory.mktemp("amount") / "m", False)


def _text(path, words):
    path.write_text(" ".join(f"word{i % 50} {i}." for i in range(words)))
    return path


def test_a_few_tokens_warn_and_strict_data_refuses_them(llama, tmp_path):
    data = _text(tmp_path / "tiny.txt", 3)
    code, out, err = run_cli("calibrate", llama, "-c", "w8a8", "--data", data, "--seq-len", "4", "-o",
                             tmp_path / "run", "--json")
    assert code == 0, err
    warnings = [w for w in json.loads(out)["warnings"] if "calibration data holds" in w]
    assert len(warnings) == 1 and f"at least {MIN_TOKENS['ranges']} " in warnings[0], warnings
    assert "calibration data holds" in err  # said on the terminal too
    code, out, err = run_cli("calibrate", llama, "-c", "w8a8", "--data", data, "--seq-len", "4", "-o",
                             tmp_path / "strict", "--strict-data")
    assert code == 2 and not (tmp_path / "strict").exists()
    errors = [line for line in error_lines(err) if line.startswith("error:")]
    assert len(errors) == 1 and "--strict-data" in errors[0] and "tokens" in errors[0], errors


def test_too_few_samples_chosen_by_num_samples_say_so(llama, tmp_path):
    """--num-samples 2 of a file that gives far more read "calibration data holds 8 tokens ...; pass more --data"."""
    data = _text(tmp_path / "enough.txt", 120)
    code, out, err = run_cli("calibrate", llama, "-c", "w8a8", "--data", data, "--seq-len", "4", "--num-samples", "2",
                             "-o", tmp_path / "run", "--json")
    assert code == 0, err
    [said] = [w for w in json.loads(out)["warnings"] if "calibration data holds" in w]
    assert re.search(r"; --num-samples 2 chose them of the \d{3,} samples the data gives: raise it$", said), said


def test_enough_tokens_say_nothing_and_rounding_asks_for_more(llama, tmp_path):
    data = _text(tmp_path / "enough.txt", 120)  # about 1100 tokens: more than 512, fewer than 2048
    code, out, err = run_cli("calibrate", llama, "-c", "w8a8", "--data", data, "--seq-len", "64", "-o",
                             tmp_path / "a", "--json", "--strict-data")
    assert code == 0, err
    assert not [w for w in json.loads(out)["warnings"] if "calibration data holds" in w]
    code, out, err = run_cli("calibrate", llama, "-c", "w4a16-block32-gptq", "--data", data, "--seq-len", "64",
                             "-o", tmp_path / "b", "--json")
    assert code == 0, err
    warnings = [w for w in json.loads(out)["warnings"] if "calibration data holds" in w]
    assert len(warnings) == 1 and "gptq" in warnings[0] and f"at least {MIN_TOKENS['rounding']} " in warnings[0]


def test_data_whose_attention_masks_keep_no_token_is_refused(llama, tmp_path):
    """Every mask 0 was a warning ("holds 0 tokens") and encodings were written from positions all masked out."""
    from safetensors.torch import save_file

    ids = torch.randint(1, 200, (16, 64), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids, "attention_mask": torch.zeros_like(ids)}, tmp_path / "ids.safetensors")
    code, _, err = run_cli("calibrate", llama, "-c", "w8a8", "--data", tmp_path / "ids.safetensors", "-o",
                           tmp_path / "run")
    assert code == 2 and not (tmp_path / "run").exists()
    assert "holds no token its attention_mask keeps" in error_lines(err)[-1], err


def test_samples_count_where_there_are_no_tokens(tmp_path):
    from safetensors.torch import save_file

    from tests.tinymodels import mlp

    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    for n, warned in ((MIN_SAMPLES["ranges"] - 1, True), (MIN_SAMPLES["ranges"], False)):
        save_file({"x": torch.randn(n, 64)}, tmp_path / f"x{n}.safetensors")
        code, out, err = run_cli("calibrate", tmp_path / "m.safetensors", "--model-class", "tests.tinymodels:mlp",
                                 "-c", "w8a8", "--data", tmp_path / f"x{n}.safetensors", "-o", tmp_path / f"r{n}",
                                 "--json")
        assert code == 0, err
        said = [w for w in json.loads(out)["warnings"] if "calibration data holds" in w]
        assert bool(said) is warned and (not said or f"{n} samples" in said[0])


def test_an_importance_matrix_of_zeros_for_a_tensor_is_said_and_searched_unweighted(llama, tmp_path):
    from safetensors.torch import save_file

    ids = torch.randint(1, 300, (8, 24), generator=torch.Generator().manual_seed(2))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    code, _, err = run_cli("imatrix", llama, "--data", tmp_path / "ids.safetensors", "-o", tmp_path / "im.gguf")
    assert code == 0, err
    import gguf

    reader = gguf.GGUFReader(tmp_path / "im.gguf")
    writer = gguf.GGUFWriter(tmp_path / "zero.gguf", "imatrix")
    for name, field in reader.fields.items():
        if name.startswith("imatrix.") and not name.startswith("imatrix.datasets"):
            value = field.contents()
            if isinstance(value, int):
                writer.add_uint32(name, value)
    writer.add_array("imatrix.datasets", ["x"])
    writer.add_string("general.type", "imatrix")
    for t in reader.tensors:
        data = t.data.copy()
        if t.name == "blk.0.attn_q.weight.in_sum2":
            data[:] = 0
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code, out, err = run_cli("quantize", llama, "-c", "gguf-q4_k_m", "--imatrix", tmp_path / "zero.gguf", "-o",
                             tmp_path / "q", "--format", "gguf", "--json")
    assert code == 0, err
    said = [w for w in json.loads(out)["warnings"] if "is zero" in w]
    assert len(said) == 1 and "blk.0.attn_q.weight" in said[0], json.loads(out)["warnings"]
    code, _, err = run_cli("quantize", llama, "-c", "gguf-q4_k_m", "--imatrix", tmp_path / "zero.gguf", "-o",
                           tmp_path / "q2", "--format", "gguf", "--strict-data")
    assert code == 2 and "--strict-data" in err and not (tmp_path / "q2").exists()


def test_a_recipe_mixing_algorithms_counts_each_in_the_shortfall():
    """AdaRound on two layers, GPTQ on one: the line said "adaround on 3 weight(s)"."""
    from torch import nn

    from qtool.calibration.data_check import shortfalls
    from qtool.config import parse_recipe, resolve_plan
    from qtool.data import Batch, CalibrationData

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    recipe = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 4, rounding: adaround}\n  activations: null\n"
                          "layers:\n  - match: '2'\n    weights: {rounding: gptq}\n")
    data = CalibrationData([Batch(kwargs={"input_ids": torch.zeros(2, 16, dtype=torch.long)})], [], 2, "ids")
    (line,) = shortfalls(resolve_plan(recipe, model), data)
    assert line.startswith("calibration data holds 32 tokens, and adaround on 2 weight(s) and gptq on 1 weight(s) "
                           f"should learn from at least {MIN_TOKENS['rounding']}"), line


@pytest.mark.parametrize("images", [torch.zeros(3, 3, 16, 16, dtype=torch.uint8),
                                    torch.zeros(3, 3, 16, 16, dtype=torch.int32),
                                    torch.zeros(3, 16, 16, dtype=torch.uint8)])
def test_integer_images_count_as_samples_not_tokens(images):
    """Three uint8 images (3·3·16·16 values) read as 2304 tokens: past the 2048 GPTQ asks for, so --strict-data
    let 3 images through."""
    from torch import nn

    from qtool.calibration.data_check import data_amount, shortfalls
    from qtool.config import parse_recipe, resolve_plan
    from qtool.data import Batch, CalibrationData

    data = CalibrationData([Batch((images,))], [], 3, "images")
    assert data_amount(data) == (3, "samples")
    recipe = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 4, rounding: gptq}\n  activations: null\n")
    (line,) = shortfalls(resolve_plan(recipe, nn.Sequential(nn.Linear(8, 8))), data)
    assert line.startswith("calibration data holds 3 samples"), line
    ids = CalibrationData([Batch((torch.zeros(2, 16, dtype=torch.long),))], [], 2, "ids")
    assert data_amount(ids) == (32, "tokens")


def test_a_mask_that_does_not_say_one_value_per_token_is_refused(tmp_path):
    """A mask of 2s, or wider than the ids, counted tokens the model never saw: too little data passed
    --strict-data. A FIFO was read for the batches, then its hash waited forever for a second writer; an .npz of
    unnamed tensors was an IndexError in eval (exit 3)."""
    import os

    import numpy as np
    from safetensors.torch import save_file

    from qtool.data import load_data
    from qtool.errors import DataError

    ids = torch.randint(1, 100, (8, 32), generator=torch.Generator().manual_seed(0))
    for mask, said in ((torch.full_like(ids, 2), "attention_mask holds values other than 0 and 1 (e.g. 2)"),
                       (torch.ones(8, 64, dtype=torch.long), "attention_mask of shape [8, 64] beside input_ids of "
                                                            "shape [8, 32]: one mask value per token")):
        save_file({"input_ids": ids, "attention_mask": mask}, tmp_path / "d.safetensors")
        with pytest.raises(DataError, match=re.escape(said)):
            load_data(str(tmp_path / "d.safetensors"), 4)
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "d.safetensors")
    assert len(list(load_data(str(tmp_path / "d.safetensors"), 4))) == 2
    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(DataError, match="not a regular file or a directory"):
        load_data(str(tmp_path / "pipe.txt"), 4)
    np.savez(tmp_path / "unnamed.npz", ids.numpy(), np.ones_like(ids.numpy()))
    from qtool.evaluation import EvalOptions, _windows

    with pytest.raises(DataError, match="named arr_0, arr_1, and none is input_ids"):
        _windows(EvalOptions(data=str(tmp_path / "unnamed.npz"), seq_len=32), None, True, 100)


def test_a_jsonl_line_holding_a_raw_carriage_return_is_one_line(tmp_path):
    """A raw \\r is JSON whitespace; read with universal newlines it broke the line in two: "not valid JSON"."""
    from pathlib import Path

    from qtool.data import text_samples

    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text":\r"hello there"}\r\n{"text": "second"}\n')
    assert text_samples(Path(f)) == ["hello there", "second"]


def test_a_line_of_spaces_or_tabs_splits_txt_paragraphs(tmp_path):
    """An editor's blank line often keeps its indentation: a paragraph break to a reader, which joined two
    paragraphs into one sample before (the file had 2 samples, not 3)."""
    from qtool.data import text_samples

    f = tmp_path / "d.txt"
    f.write_text("first  para\ncontinued\n   \nsecond\n\t\n\nthird\r\n \t \r\nfourth\n", encoding="utf-8")
    assert text_samples(f) == ["first para continued", "second", "third", "fourth"]


def test_the_manifest_hashes_the_data_as_the_run_read_it(llama, tmp_path):
    """A data file rewritten while the run calibrates: the manifest gave the new file's sha256 (hashed at the end),
    which no one could match to the encodings."""
    import hashlib

    from qtool.calibration import CalibrateOptions
    from qtool.hooks import Hooks
    from qtool.pipeline import run_calibrate

    data = _text(tmp_path / "calib.txt", 400)
    read = hashlib.sha256(data.read_bytes()).hexdigest()

    def rewrite(*_):
        data.write_text("something else entirely")

    run_calibrate(str(llama), "w8a8", str(tmp_path / "r"), CalibrateOptions(data=str(data), seq_len=32),
                  hooks=Hooks(on_batch=rewrite))
    recorded = json.loads((tmp_path / "r" / "manifest.json").read_text())["inputs"]["data"]["sha256"]
    assert recorded == {str(data): read}


def test_samples_of_no_values_are_refused_naming_the_file(tmp_path):
    """Token ids of shape [2, 0] reached the model, whose error was torch's "cannot reshape tensor of 0 elements
    into shape [2, 0, -1, 16]"."""
    import numpy as np

    from qtool.data import load_data
    from qtool.errors import DataError

    np.save(tmp_path / "empty.npy", np.zeros((2, 0), dtype=np.int64))
    with pytest.raises(DataError) as e:
        load_data(tmp_path / "empty.npy", batch_size=2)
    assert str(e.value) == (f"{tmp_path / 'empty.npy'}: tensor 'input' has samples of shape [0], which hold no "
                            "values (token ids of 0 tokens per sample?)")


def test_data_files_of_unusable_kinds_are_one_line_each(tmp_path):
    """A .pt dict keyed by integers and a sparse tensor were internal errors (exit 3); files of one directory with
    different dtypes were promoted by torch.cat (a bool file became 16 samples of token id 1, exit 0)."""
    import numpy as np

    from qtool.data import load_data
    from qtool.errors import DataError

    x = torch.randn(8, 4)
    torch.save({0: x}, tmp_path / "intkey.pt")
    torch.save(x.to_sparse(), tmp_path / "sparse.pt")
    (tmp_path / "mixed").mkdir()
    np.save(tmp_path / "mixed" / "a.npy", np.arange(32).reshape(4, 8))
    np.save(tmp_path / "mixed" / "b.npy", np.ones((4, 8), bool))
    said = {"intkey.pt": "the dict's keys name the model's inputs, and key 0 is of type int, not a string",
            "sparse.pt": "tensor 'input' is sparse_coo: save it dense (x.to_dense())",
            "mixed": "tensor 'input' is bool, and earlier files' is int64: save every file's tensors alike"}
    for name, words in said.items():
        with pytest.raises(DataError) as e:
            load_data(tmp_path / name, batch_size=2)
        assert str(e.value).endswith(words), str(e.value)


def test_eval_refuses_bool_ids_and_skips_a_row_its_mask_keeps_nothing_of(llama, tmp_path):
    """eval read a bool file as token ids 0 and 1 (calibration refuses it); a row whose attention_mask is all 0
    became an empty window: IndexError, exit 3."""
    import numpy as np

    code, _, err = run_cli("quantize", llama, "-c", "w8a16", "-o", tmp_path / "q", "-q")
    assert code == 0, err
    ids = np.random.default_rng(0).integers(0, 250, (8, 64))
    np.save(tmp_path / "bool.npy", ids.astype(bool))
    code, _, err = run_cli("eval", tmp_path / "q", "--data", tmp_path / "bool.npy", "--generate", "0", "-q")
    assert code == 2 and "token ids must be integers of shape [sequences, tokens] (got bool" in err, err
    mask = np.ones((8, 64), "int64")
    mask[0] = 0
    np.savez(tmp_path / "mask.npz", input_ids=ids, attention_mask=mask)
    code, out, err = run_cli("eval", tmp_path / "q", "--data", tmp_path / "mask.npz", "--num-samples", "8",
                             "--generate", "0", "--json", "-q")
    assert code == 0 and json.loads(out)["sequences"] == 7, err
