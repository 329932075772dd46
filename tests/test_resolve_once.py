"""Resolve once, then flow: a run reads its recipe file once (an audit hook counts every ``open`` of it), hashes
the bytes it parsed, and hands the parsed recipe on; a size-budget search reads each candidate once."""

import hashlib
import json
import os
import sys
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from qtool.config.shipped import shipped_recipes
from tests.helpers import run_cli, tiny_llama

pytest.importorskip("transformers")

_WATCHED = {}  # realpath -> opens, while a test watches (an audit hook cannot be removed: it stays, idle)


def _hook(event, args):
    if event == "open" and _WATCHED and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if path in _WATCHED:
            _WATCHED[path] += 1


sys.addaudithook(_hook)


def _opens(files, *args):
    """Run the CLI with ``args``; ``(exit code, stderr, {file name: times it was opened})``."""
    _WATCHED.clear()
    _WATCHED.update({os.path.realpath(f): 0 for f in files})
    try:
        code, _, err = run_cli(*args)
        return code, err, Counter({os.path.basename(p): n for p, n in _WATCHED.items()})
    finally:
        _WATCHED.clear()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("once")
    ckpt = tiny_llama(d / "llama", num_hidden_layers=2)
    save_file({"input_ids": torch.randint(1, 256, (12, 32), generator=torch.Generator().manual_seed(1))},
              d / "ids.safetensors")
    return ckpt, d / "ids.safetensors"


def _copy(name, dest):
    """A shipped recipe as the user's own file, with Windows line ends (the text parsed is read_text's)."""
    dest.write_bytes(shipped_recipes()[name].read_bytes().replace(b"\n", b"\r\n"))
    return dest


@pytest.mark.parametrize("command", ["quantize", "calibrate"])
def test_a_run_opens_its_recipe_once_and_hashes_what_it_read(llama, tmp_path, command):
    ckpt, ids = llama
    recipe = _copy("w8a8", tmp_path / "r.yaml")
    code, err, opens = _opens([recipe], command, ckpt, "-c", recipe, "--data", ids, "-q", "-o", tmp_path / "out")
    assert code == 0, err
    assert opens["r.yaml"] == 1
    run = tmp_path / "out" / ("calibration" if command == "quantize" else "")
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["inputs"]["recipe"]["sha256"] == hashlib.sha256(recipe.read_bytes()).hexdigest()


def test_a_size_budget_search_opens_each_candidate_once(llama, tmp_path):
    ckpt, ids = llama
    a, b = _copy("w4a16-block32", tmp_path / "a.yaml"), _copy("w8a16", tmp_path / "b.yaml")
    code, err, opens = _opens([a, b], "quantize", ckpt, "--data", ids, "--candidates", f"{a},{b}",
                              "--target-bpw", "12", "--search-samples", "2", "-q", "-o", tmp_path / "mix")
    assert code == 0, err
    assert opens == {"a.yaml": 1, "b.yaml": 1}
    # the written recipe is built on the first candidate's text as read (line ends as read_text gives them)
    written = (tmp_path / "mix" / "recipe.yaml").read_bytes()
    assert b"\r" not in written
    assert b"weights: {bitwidth: 4, symmetric: true, granularity: per_block, block_size: 32" in written


def test_a_bad_recipe_is_still_one_line_before_anything_runs(llama, tmp_path):
    ckpt, ids = llama
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults:\n  weights:\n    bitwidth: 99\n")
    code, err, opens = _opens([bad], "quantize", ckpt, "-c", bad, "--data", ids, "-o", tmp_path / "out")
    assert code == 2 and opens["bad.yaml"] == 1
    assert [line for line in err.splitlines() if line.strip()][0].startswith(f"error: {bad}:3"), err
    assert not (tmp_path / "out").exists()
