"""Fuzzing the readers of untrusted input: recipes, encodings files, safetensors checkpoints and data.

Whatever the bytes, they either parse or raise qtool's own error (one clear message), never anything else.
"""

import json
import re
import string

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from qtool.config import parse_recipe, resolve_plan
from qtool.data import load_data
from qtool.encodings import EncodingsFile
from qtool.errors import EncodingsError, QtoolError
from qtool.io.checkpoint import read_state_dict

from tests.tinymodels import mlp

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])

KEYS = ["version", "defaults", "weights", "activations", "layers", "ignore", "match", "type", "bitwidth",
        "symmetric", "granularity", "block_size", "analyzer", "inputs", "outputs", "name", "optional", "bogus",
        "element", "scale_dtype", "dynamic", "kv_cache", "rounding"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-40, 40), st.floats(allow_nan=True),
                    st.sampled_from(["per_tensor", "per_channel", "per_block", "minmax", "re:.*", "*", "re:(",
                                     "Linear", "0", "", "eight", "fp8_e4m3", "fp4_e2m1", "e8m0", "per_token",
                                     "per_head", "gptq", "mse", 16, 32, [128, 128]]),
                    st.text(string.printable, max_size=8))
yamlish = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)), max_leaves=25)


def _only_qtool_errors(fn):
    try:
        fn()
    except QtoolError as e:
        assert str(e) and "\n" not in str(e)


@FUZZ
@given(yamlish)
def test_recipe_structures_parse_or_raise_config_error(obj):
    text = yaml.safe_dump(obj)

    def go():
        recipe = parse_recipe(text, "fuzz.yaml")
        resolve_plan(recipe, mlp(), "fuzz.yaml", allow_unmatched=True)

    _only_qtool_errors(go)


@FUZZ
@given(st.text(max_size=200))
def test_recipe_raw_text_parses_or_raises_config_error(text):
    _only_qtool_errors(lambda: parse_recipe(text, "fuzz.yaml"))


def _good_encodings():
    return {"schema": "qtool.encodings", "schema_version": 1, "quantizers": [
        {"name": "0.weight", "module": "0", "tensor": "weight", "bitwidth": 8, "symmetric": True,
         "granularity": "per_tensor", "shape": [], "block_size": None, "analyzer": "minmax", "min": -1.0, "max": 1.0,
         "scale": 0.0078, "offset": 0}]}


json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=20)


@FUZZ
@given(st.sampled_from(["schema", "schema_version", "quantizers", "name", "module", "tensor", "bitwidth",
                        "symmetric", "shape", "block_size", "min", "max"]), json_values)
def test_encodings_with_a_mutated_field_parse_or_raise(tmp_path_factory, key, value):
    obj = _good_encodings()
    if key in obj:
        obj[key] = value
    else:
        obj["quantizers"][0][key] = value
    path = tmp_path_factory.mktemp("enc") / "e.json"
    path.write_text(json.dumps(obj, allow_nan=True))
    _only_qtool_errors(lambda: EncodingsFile.read(path))


def _good_float_encodings():
    """An NVFP4 weight (fused global scale) and a dynamic NVFP4 activation, as calibrate writes them."""
    return {"schema": "qtool.encodings", "schema_version": 1, "quantizers": [
        {"name": "0.weight", "module": "0", "tensor": "weight", "bitwidth": 4, "symmetric": True,
         "granularity": "per_block", "shape": [2, 1], "block_size": [1, 16], "analyzer": "minmax",
         "element": "fp4_e2m1", "scale_dtype": "fp8_e4m3", "global_amax": 2.0, "min": [[-1.0], [-2.0]],
         "max": [[1.0], [2.0]]},
        {"name": "0.input", "module": "0", "tensor": "input", "bitwidth": 4, "symmetric": True,
         "granularity": "per_block", "shape": [], "block_size": [16], "analyzer": "dynamic", "dynamic": True,
         "element": "fp4_e2m1", "scale_dtype": "fp8_e4m3", "global_amax": 3.0}]}


@FUZZ
@given(st.integers(0, 1), st.sampled_from(["element", "scale_dtype", "global_amax", "bitwidth", "symmetric",
                                           "granularity", "shape", "block_size", "min", "max", "dynamic", "tensor"]),
       json_values)
def test_float_encodings_with_a_mutated_field_parse_or_raise(tmp_path_factory, which, key, value):
    obj = _good_float_encodings()
    obj["quantizers"][which][key] = value
    path = tmp_path_factory.mktemp("enc") / "e.json"
    path.write_text(json.dumps(obj, allow_nan=True))
    _only_qtool_errors(lambda: EncodingsFile.read(path))


def test_the_float_seed_is_valid(tmp_path):
    (tmp_path / "e.json").write_text(json.dumps(_good_float_encodings()))
    assert [e.global_amax for e in EncodingsFile.read(tmp_path / "e.json").entries] == [2.0, 3.0]


@pytest.mark.parametrize("block_size", [[], [1], [1, 1, 1]])
def test_a_block_size_of_another_rank_than_the_shape_is_refused_where_read(tmp_path, block_size):
    """(read accepted [] on a per-channel entry; applying it raised a bare ValueError)"""
    obj = _good_encodings()
    entry = obj["quantizers"][0]
    del entry["scale"], entry["offset"]
    entry.update(granularity="per_channel", shape=[4, 1], block_size=block_size, min=[[-1.0]] * 4, max=[[1.0]] * 4)
    (tmp_path / "e.json").write_text(json.dumps(obj))
    with pytest.raises(EncodingsError, match=re.escape(f"quantizers[0]: block_size {block_size} needs one entry per "
                                                       "dimension of [4, 1]")):
        EncodingsFile.read(tmp_path / "e.json")


@FUZZ
@given(st.binary(max_size=300))
def test_encodings_random_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("enc") / "e.json"
    path.write_bytes(data)
    _only_qtool_errors(lambda: EncodingsFile.read(path))


GOOD_ST = save({"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.int8)})


@FUZZ
@given(st.integers(0, len(GOOD_ST)), st.binary(min_size=1, max_size=16), st.booleans())
def test_safetensors_mutations_read_or_raise(tmp_path_factory, pos, patch, truncate):
    data = GOOD_ST[:pos] if truncate else GOOD_ST[:pos] + patch + GOOD_ST[pos + len(patch):]
    path = tmp_path_factory.mktemp("st") / "m.safetensors"
    path.write_bytes(data)
    _only_qtool_errors(lambda: read_state_dict(path))
    _only_qtool_errors(lambda: load_data(path))
