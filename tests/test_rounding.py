"""Weights chosen from data: GPTQ codes and the activation-weighted MSE search, from the math to the files."""

import json

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import qtool
from qtool.calibration.rounding import InputStatistics, collect_inputs
from qtool.calibration.rounding.gptq import expand_encoding, gptq_codes, shrunk_hessian
from qtool.config import QuantizerPlan, parse_recipe, resolve_plan
from qtool.export.qtool_st import read_integer_export
from qtool.model.insert import _fake_quant_weight, iter_quantizers
from qtool.quant.affine import adjust_min_max, dequantize, grid, min_max_to_scale_offset, quantize, reduce_to_shape
from qtool.quant.analysis.mse import MseEncodingAnalyzer

from tests.helpers import run_cli
from tests.tinymodels import mlp

MLP = "tests.tinymodels:mlp"


def _layer(seed, out, blocks, block, bits, symmetric, tokens):
    g = torch.Generator().manual_seed(seed)
    inn = blocks * block
    w = torch.randn(out, inn, generator=g)
    # correlated inputs with uneven channel scales and a mean: the case where error feedback matters
    x = (torch.randn(tokens, inn, generator=g) * torch.rand(inn, generator=g) * 3
         + torch.randn(1, inn, generator=g)) @ (torch.eye(inn) + 0.3 * torch.randn(inn, inn, generator=g))
    shape, bs = (out, blocks), (1, block)
    qmin, qmax = grid(bits, symmetric)
    mn, mx = reduce_to_shape(w, shape, bs)
    mn, mx = adjust_min_max(mn, mx, qmax - qmin, symmetric)
    scale, offset = min_max_to_scale_offset(mn, mx, qmin, qmax, symmetric)
    return w, x, scale, offset, qmin, qmax, bs


def _output_error(w, x, codes, scale, offset, bs):
    d = w - dequantize(codes.to(torch.float32), scale, offset, block_size=bs)
    return float((x @ d.T).pow(2).sum())


layers = st.tuples(st.integers(0, 10**6), st.integers(1, 24), st.integers(1, 4), st.sampled_from([4, 8, 16]),
                   st.sampled_from([2, 3, 4, 8]), st.booleans(), st.integers(1, 200))


@settings(max_examples=60, deadline=None)
@given(layers, st.booleans())
def test_gptq_output_error_is_at_most_round_to_nearest(layer, act_order):
    w, x, scale, offset, qmin, qmax, bs = _layer(*layer)
    rtn = quantize(w, scale, offset, qmin=qmin, qmax=qmax, block_size=bs)
    codes = gptq_codes(w, x.T @ x, scale, offset, qmin, qmax, bs, act_order=act_order, block_columns=8)
    assert codes.dtype == torch.int64 and codes.shape == w.shape
    assert int(codes.min()) >= qmin and int(codes.max()) <= qmax  # on the analyzer's grid
    assert _output_error(w, x, codes, scale, offset, bs) <= _output_error(w, x, rtn, scale, offset, bs) * (1 + 1e-5)


@settings(max_examples=40, deadline=None)
@given(layers, st.floats(0.1, 100), st.booleans())
def test_gptq_with_an_identity_hessian_is_round_to_nearest_exactly(layer, diag, act_order):
    w, _, scale, offset, qmin, qmax, bs = _layer(*layer)
    rtn = quantize(w, scale, offset, qmin=qmin, qmax=qmax, block_size=bs)
    codes = gptq_codes(w, torch.eye(w.shape[1]) * diag, scale, offset, qmin, qmax, bs, act_order=act_order)
    assert torch.equal(codes.to(torch.float32), rtn)


def test_gptq_beats_round_to_nearest_clearly_on_correlated_inputs():
    w, x, scale, offset, qmin, qmax, bs = _layer(3, 128, 8, 32, 4, True, 2048)
    rtn = quantize(w, scale, offset, qmin=qmin, qmax=qmax, block_size=bs)
    codes = gptq_codes(w, x.T @ x, scale, offset, qmin, qmax, bs)
    assert _output_error(w, x, codes, scale, offset, bs) < 0.6 * _output_error(w, x, rtn, scale, offset, bs)


@settings(max_examples=40, deadline=None)
@given(layers, st.booleans())
@example((744, 2, 2, 8, 8, False, 1), False)  # 8-bit asymmetric: codes 0..255 overflowed int8 bounds once
def test_bounded_gptq_keeps_every_code_beside_its_weight_and_is_never_above_round_to_nearest(layer, act_order):
    w, x, scale, offset, qmin, qmax, bs = _layer(*layer)
    rtn = quantize(w, scale, offset, qmin=qmin, qmax=qmax, block_size=bs)
    codes = gptq_codes(w, x.T @ x, scale, offset, qmin, qmax, bs, act_order=act_order, block_columns=8,
                       bounded=True)
    position = w / expand_encoding(scale, w.shape, bs) - expand_encoding(offset, w.shape, bs)
    low, high = position.floor().clamp(qmin, qmax), position.ceil().clamp(qmin, qmax)
    assert bool(((codes >= low) & (codes <= high)).all())  # down or up from its own weight, never further
    assert _output_error(w, x, codes, scale, offset, bs) <= _output_error(w, x, rtn, scale, offset, bs) * (1 + 1e-5)


def test_bounded_gptq_gives_up_only_part_of_gptqs_gain_and_moves_fewer_codes():
    w, x, scale, offset, qmin, qmax, bs = _layer(3, 128, 8, 32, 4, True, 2048)
    rtn = quantize(w, scale, offset, qmin=qmin, qmax=qmax, block_size=bs)
    free = gptq_codes(w, x.T @ x, scale, offset, qmin, qmax, bs)
    bounded = gptq_codes(w, x.T @ x, scale, offset, qmin, qmax, bs, bounded=True)
    errors = [_output_error(w, x, c, scale, offset, bs) for c in (rtn, free, bounded)]
    assert errors[1] < errors[2] < 0.8 * errors[0]
    far = [int(((c - rtn).abs() > 1).sum()) for c in (free, bounded)]
    assert far[0] > 0 and far[1] == 0


@settings(max_examples=40, deadline=None)
@given(layers, st.booleans(), st.booleans())
def test_gptq_with_the_hessian_shrunk_all_the_way_to_its_diagonal_is_round_to_nearest(layer, act_order, bounded):
    w, x, scale, offset, qmin, qmax, bs = _layer(*layer)
    rtn = quantize(w, scale, offset, qmin=qmin, qmax=qmax, block_size=bs)
    codes = gptq_codes(w, x.T @ x, scale, offset, qmin, qmax, bs, act_order=act_order, bounded=bounded,
                       shrinkage=1.0, block_columns=8)
    assert torch.equal(codes.to(torch.float32), rtn)


@settings(max_examples=40, deadline=None)
@given(layers, st.floats(0, 1), st.booleans())
def test_gptq_with_a_shrunk_hessian_is_never_above_round_to_nearest_on_the_shrunk_objective(layer, shrinkage, bounded):
    w, x, scale, offset, qmin, qmax, bs = _layer(*layer)
    H = x.T @ x
    Hs = shrunk_hessian(H, shrinkage)
    assert torch.equal(torch.diagonal(Hs), torch.diagonal(H))
    assert torch.allclose(Hs - torch.diag(torch.diagonal(Hs)), (1 - shrinkage) * (H - torch.diag(torch.diagonal(H))))
    rtn = quantize(w, scale, offset, qmin=qmin, qmax=qmax, block_size=bs)
    codes = gptq_codes(w, H, scale, offset, qmin, qmax, bs, shrinkage=shrinkage, bounded=bounded, block_columns=8)

    def error(c):  # d Hs dᵀ summed over rows: the objective the shrunk Hessian defines
        d = (w - dequantize(c.to(torch.float32), scale, offset, block_size=bs)).to(torch.float64)
        return float(((d @ Hs.to(torch.float64)) * d).sum())

    assert error(codes) <= error(rtn) * (1 + 1e-5) + 1e-9


def test_shrinking_the_hessian_trades_calibration_fit_for_codes_nearer_round_to_nearest():
    w, x, scale, offset, qmin, qmax, bs = _layer(3, 128, 8, 32, 4, True, 2048)
    rtn = quantize(w, scale, offset, qmin=qmin, qmax=qmax, block_size=bs)
    codes = [gptq_codes(w, x.T @ x, scale, offset, qmin, qmax, bs, shrinkage=s) for s in (0.0, 0.5, 0.9)]
    errors = [_output_error(w, x, c, scale, offset, bs) for c in codes]
    moved = [int((c.to(torch.float32) != rtn).sum()) for c in codes]
    assert errors[0] < errors[1] < errors[2] < _output_error(w, x, rtn, scale, offset, bs)
    assert moved[0] > moved[1] > moved[2] > 0
    assert torch.equal(codes[0], gptq_codes(w, x.T @ x, scale, offset, qmin, qmax, bs))  # 0 is plain GPTQ


def test_gptq_shrinkage_outside_zero_to_one_is_refused():
    w, x, scale, offset, qmin, qmax, bs = _layer(1, 4, 1, 8, 4, True, 16)
    with pytest.raises(ValueError, match="shrinkage must be between 0 and 1"):
        gptq_codes(w, x.T @ x, scale, offset, qmin, qmax, bs, shrinkage=1.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gptq_columns.py on a GPU)")
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_column_loop_replayed_as_a_cuda_graph_gives_the_launched_loops_codes(monkeypatch, act_order):
    from qtool.calibration.rounding import gptq

    w, x, scale, offset, qmin, qmax, bs = (t.cuda() if isinstance(t, torch.Tensor) else t
                                           for t in _layer(7, 96, 5, 32, 4, True, 1024))
    codes = {}
    for graphs in (False, True):  # blocks of 48 columns: a sub-block of 32 replayed, one of 16 launched
        monkeypatch.setattr(gptq, "CUDA_GRAPHS", graphs)
        codes[graphs] = gptq_codes(w, x.T @ x, scale, offset, qmin, qmax, bs, act_order=act_order, block_columns=48)
    assert torch.equal(codes[False], codes[True])
    rtn = quantize(w, scale, offset, qmin=qmin, qmax=qmax, block_size=bs)
    assert not torch.equal(codes[True].to(torch.float32), rtn)  # error feedback reached later columns


def test_gptq_dead_input_columns_keep_round_to_nearest_and_per_channel_grids_work():
    w, x, _, _, qmin, qmax, _ = _layer(5, 16, 2, 16, 4, False, 100)
    x[:, 7] = 0  # a channel that never carries signal
    mn, mx = adjust_min_max(w.amin(1, keepdim=True), w.amax(1, keepdim=True), qmax - qmin, False)
    scale, offset = min_max_to_scale_offset(mn, mx, qmin, qmax, False)
    codes = gptq_codes(w, x.T @ x, scale, offset, qmin, qmax, None)
    rtn = quantize(w, scale, offset, qmin=qmin, qmax=qmax)
    assert torch.equal(codes[:, 7].float(), rtn[:, 7])
    assert _output_error(w, x, codes, scale, offset, None) < _output_error(w, x, rtn, scale, offset, None)


def _int4_grid(w):
    mn, mx = adjust_min_max(w.amin(1, keepdim=True), w.amax(1, keepdim=True), 15, True)
    return min_max_to_scale_offset(mn, mx, -8, 7, True)


def test_gptq_on_a_singular_hessian_raises_the_dampening_and_says_so():
    """Four tokens for 32 inputs, two of them the same column, and no dampening asked for: the Hessian is singular.
    GPTQ adds dampening tenfold at a time until it factors, says how much, and its codes still beat rounding."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(16, 32, generator=g), torch.randn(4, 32, generator=g)
    x[:, 1] = x[:, 0]
    scale, offset = _int4_grid(w)
    notes = []
    codes = gptq_codes(w, x.T @ x, scale, offset, -8, 7, None, dampening=0.0, notes=notes)
    assert notes == ["GPTQ dampening raised from 0 to 0.01 of the mean diagonal: the layer-input Hessian was not "
                     "positive definite (few or collinear calibration tokens)"]
    assert codes.dtype == torch.int64 and int(codes.min()) >= -8 and int(codes.max()) <= 7
    rtn = quantize(w, scale, offset, qmin=-8, qmax=7)
    assert _output_error(w, x, codes, scale, offset, None) <= _output_error(w, x, rtn, scale, offset, None)
    notes, fed = [], torch.randn(256, 32, generator=g)  # the default dampening on a well-fed layer: nothing to say
    gptq_codes(w, fed.T @ fed, scale, offset, -8, 7, None, notes=notes)
    assert notes == []


@pytest.mark.parametrize("name", ["GPTQ", "AdaRound"])
def test_rounding_on_a_hessian_that_is_not_finite_rounds_to_nearest_and_says_so(name):
    """(AdaRound kept round-to-nearest through a NaN loss without a word)"""
    from qtool.calibration.rounding import adaround_codes

    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(16, 32, generator=g), torch.randn(64, 32, generator=g)
    scale, offset = _int4_grid(w)
    H = x.T @ x
    H[3, 5] = H[5, 3] = float("inf")  # sums of squares of activations past float32's range
    notes = []
    codes = (gptq_codes if name == "GPTQ" else adaround_codes)(w, H, scale, offset, -8, 7, None, notes=notes)
    assert codes.dtype == torch.int64 and torch.equal(codes.float(), quantize(w, scale, offset, qmin=-8, qmax=7))
    assert notes == ["the layer-input Hessian is not finite (inputs too large for float32 sums): rounded to "
                     f"nearest, not {name}"]


def test_calibrate_reports_a_raised_gptq_dampening(tmp_path):
    """Two samples for a 64-input layer with dampening 0: calibrate finishes, prints the warning and records it in
    the manifest and the --json summary."""
    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    save_file({"x": torch.randn(2, 64, generator=torch.Generator().manual_seed(2))}, tmp_path / "x.safetensors")
    (tmp_path / "r.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_channel, "
                                     "rounding: {name: gptq, dampening: 0}}\n  activations: null\n")
    code, out, err = run_cli("calibrate", tmp_path / "m.safetensors", "-c", tmp_path / "r.yaml", "--model-class",
                             "tests.tinymodels:mlp", "--data", tmp_path / "x.safetensors", "-o", tmp_path / "run",
                             "--json")
    assert code == 0, err
    raised = [w for w in json.loads(out)["warnings"] if "GPTQ dampening raised from 0 to" in w]
    assert raised and raised[0].startswith("0.weight: ")
    assert "GPTQ dampening raised" in err
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["warnings"] == json.loads(out)["warnings"]


def test_a_recipes_gptq_shrinkage_reaches_the_codes(tmp_path):
    """Through calibrate: shrinkage 1 writes round-to-nearest's weights on GPTQ's grid, 0.5 codes between."""
    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    save_file({"x": torch.randn(256, 64, generator=torch.Generator().manual_seed(4)) @
               (torch.eye(64) + 0.5 * torch.randn(64, 64, generator=torch.Generator().manual_seed(5)))},
              tmp_path / "x.safetensors")
    weights = {}
    for label, rounding in (("rtn", "nearest"), ("gptq", "gptq"), ("half", "{name: gptq, shrinkage: 0.5}"),
                            ("one", "{name: gptq, shrinkage: 1}")):
        (tmp_path / f"{label}.yaml").write_text(
            "version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_channel, rounding: "
            f"{rounding}}}\n  activations: null\n")
        code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "-c", tmp_path / f"{label}.yaml",
                               "--model-class", MLP, "--data", tmp_path / "x.safetensors", "-o", tmp_path / label)
        assert code == 0, err
        model = qtool.load_calibrated(str(tmp_path / "m.safetensors"), str(tmp_path / label / "encodings.json"),
                                      model_class=MLP)
        with torch.no_grad():
            weights[label] = _fake_quant_weight(dict(model.named_modules())["0"],
                                                dict(iter_quantizers(model))["0.weight"])
    assert torch.equal(weights["one"], weights["rtn"])
    assert not torch.equal(weights["gptq"], weights["rtn"])
    assert not torch.equal(weights["half"], weights["gptq"]) and not torch.equal(weights["half"], weights["rtn"])


def test_gptq_refuses_shapes_that_do_not_fit():
    with pytest.raises(ValueError, match="2-D"):
        gptq_codes(torch.zeros(2, 3, 4), torch.eye(3), torch.ones(()), torch.zeros(()), -8, 7)
    with pytest.raises(ValueError, match="does not fit"):
        gptq_codes(torch.zeros(2, 3), torch.eye(4), torch.ones(()), torch.zeros(()), -8, 7)


def test_expand_encoding_gives_each_weight_its_blocks_scale():
    s = torch.arange(6.0).reshape(2, 3)
    e = expand_encoding(s, (2, 12), (1, 4))
    assert torch.equal(e[1, 4:8], torch.full((4,), 4.0)) and e.shape == (2, 12)
    assert torch.equal(expand_encoding(torch.tensor([[1.0], [2.0]]), (2, 5), None)[:, 3], torch.tensor([1.0, 2.0]))


def test_input_statistics_are_sums_and_merge_by_addition():
    lin = torch.nn.Linear(6, 3)
    xs = [torch.randn(4, 5, 6), torch.randn(2, 6)]
    gptq = QuantizerPlan("l.weight", "l", "Linear", "weight", 4, True, "per_channel", (3, 1), None, "minmax",
                         rounding="gptq")
    weighted = QuantizerPlan("l.weight", "l", "Linear", "weight", 4, True, "per_channel", (3, 1), None, "mse",
                             analyzer_args=(("weighting", "activations"),))
    plain = QuantizerPlan("l.weight", "l", "Linear", "weight", 4, True, "per_channel", (3, 1), None, "mse")
    assert collect_inputs([plain], {"l": lin}, lambda: pytest.fail("nothing to collect: the data must not run")) == {}
    stats = collect_inputs([gptq], {"l": lin}, lambda: [lin(x) for x in xs])["l"]
    rows = torch.cat([x.reshape(-1, 6) for x in xs])
    assert stats.count == 22
    torch.testing.assert_close(stats.hessian(), rows.T @ rows)
    assert stats.hessian().dtype == stats.mean_square().dtype == torch.float32
    torch.testing.assert_close(stats.mean_square(), rows.pow(2).mean(0))
    torch.testing.assert_close(stats.mean_absolute(), rows.abs().mean(0))
    a = collect_inputs([weighted], {"l": lin}, lambda: lin(xs[0]))["l"]
    b = collect_inputs([weighted], {"l": lin}, lambda: lin(xs[1]))["l"]
    merged = InputStatistics.merge(a, b)
    assert merged.xtx is None and merged.count == 22
    torch.testing.assert_close(merged.sq, stats.sq)
    torch.testing.assert_close(merged.absolute, stats.absolute)


def test_input_statistics_of_shards_merge_to_the_same_bits_in_any_grouping():
    """Batches summed in float32, accumulated in float64: one pass over batches 0..4 and the merge of shards
    (0,1) and (2,3,4) (what two ranks do) give bit-identical float32 Hessians, E[x²] and E|x|."""
    lin = torch.nn.Linear(48, 3)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(7, 48, generator=g) * s for s in (1.0, 30.0, 0.01, 5.0, 1e3)]
    row = QuantizerPlan("l.weight", "l", "Linear", "weight", 4, True, "per_channel", (3, 1), None, "minmax",
                        rounding="gptq")

    def run(batches):
        return collect_inputs([row], {"l": lin}, lambda: [lin(x) for x in batches])["l"]

    whole = run(xs)
    merged = InputStatistics.merge(run(xs[:2]), run(xs[2:]))
    assert torch.equal(merged.hessian(), whole.hessian()) and torch.equal(merged.mean_square(), whole.mean_square())
    assert torch.equal(merged.mean_absolute(), whole.mean_absolute())


# ---- activation-weighted MSE -----------------------------------------------------------------------------------
def test_weighted_mse_with_uniform_importance_equals_the_unweighted_search():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    plain = MseEncodingAnalyzer((16, 2), (1, 32))
    weighted = MseEncodingAnalyzer((16, 2), (1, 32), weighting="activations")
    plain.update_stats(w)
    weighted.update_stats(w, importance=torch.full((1, 64), 2.5))
    for a, b in zip(plain.compute_encodings(15, True), weighted.compute_encodings(15, True)):
        assert torch.equal(a, b)


def test_weighted_mse_lowers_the_weighted_error_and_needs_importance():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=g)
    imp = torch.rand(1, 64, generator=g) ** 4 * 100  # a few channels matter much more
    qmin, qmax = grid(4, True)

    def weighted_error(analyzer):
        mn, mx = analyzer.compute_encodings(qmax - qmin, True)
        s, o = min_max_to_scale_offset(mn, mx, qmin, qmax, True)
        d = w - dequantize(quantize(w, s, o, qmin=qmin, qmax=qmax, block_size=(1, 32)), s, o, block_size=(1, 32))
        return float((d.pow(2) * imp).sum())

    plain, weighted = MseEncodingAnalyzer((32, 2), (1, 32)), MseEncodingAnalyzer((32, 2), (1, 32), weighting="activations")
    plain.update_stats(w)
    weighted.update_stats(w, importance=imp)
    assert weighted_error(weighted) < weighted_error(plain)
    with pytest.raises(ValueError, match="importance"):
        MseEncodingAnalyzer((32, 2), (1, 32), weighting="activations").update_stats(w)


# ---- magnitude-weighted MSE (no data) ---------------------------------------------------------------------------
def test_magnitude_weighting_is_the_weighted_search_with_rms_plus_abs_of_each_block():
    """``weighting: magnitude`` is the weighted search with each value weighted by its block's RMS plus its own
    magnitude, on an integer grid and on a GGUF type's sub-blocks alike."""
    from qtool.quant import ggml
    from qtool.quant.quantizer import GgmlQuantizeDequantize

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    blocks = w.reshape(16, 2, 32)
    weights = (blocks.pow(2).mean(-1, keepdim=True).sqrt() + blocks.abs()).reshape(16, 64)
    magnitude = MseEncodingAnalyzer((16, 2), (1, 32), weighting="magnitude")
    explicit = MseEncodingAnalyzer((16, 2), (1, 32), weighting="activations")
    magnitude.update_stats(w)
    explicit.update_stats(w, importance=weights)
    for a, b in zip(magnitude.compute_encodings(15, True), explicit.compute_encodings(15, True)):
        assert torch.equal(a, b)
    t = ggml.ggml_type("Q4_0")
    q = GgmlQuantizeDequantize((16, 2), t, MseEncodingAnalyzer((16, 2), (1, 32), weighting="magnitude"), (1, 32))
    with q.compute_encodings():
        q(w)
    mn, mx = ggml.search_range(w.reshape(-1, 32), t, weights.reshape(-1, 32))
    assert torch.equal(q.min.reshape(-1), mn) and torch.equal(q.max.reshape(-1), mx)
    plain = ggml.search_range(w.reshape(-1, 32), t)
    assert not torch.equal(plain[1], mx) or not torch.equal(plain[0], mn)  # the weighting changed the search


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bits=st.sampled_from([3, 4, 8]), symmetric=st.booleans(),
       outlier=st.floats(1.0, 20.0))
def test_magnitude_weighted_search_is_never_worse_than_min_max_on_its_objective(seed, bits, symmetric, outlier):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 64, generator=g)
    w[:, 5] *= outlier
    a = MseEncodingAnalyzer((8, 2), (1, 32), weighting="magnitude")
    a.update_stats(w)
    qmin, qmax = grid(bits, symmetric)
    blocks = w.reshape(8, 2, 32)
    weights = (blocks.pow(2).mean(-1, keepdim=True).sqrt() + blocks.abs()).reshape(8, 64)

    def objective(mn, mx):
        mn, mx = adjust_min_max(mn, mx, qmax - qmin, symmetric)
        s, o = min_max_to_scale_offset(mn, mx, qmin, qmax, symmetric)
        d = w - dequantize(quantize(w, s, o, qmin=qmin, qmax=qmax, block_size=(1, 32)), s, o, block_size=(1, 32))
        return float((d.pow(2) * weights).sum())

    mn, mx = a.compute_encodings(qmax - qmin, symmetric)
    assert objective(mn, mx) <= objective(a.min.reshape(8, 2), a.max.reshape(8, 2)) * (1 + 1e-5)


def test_activations_magnitude_weights_each_value_by_importance_times_magnitude():
    """``weighting: activations_magnitude`` is the weighted search with each value weighted by its input's
    importance times (its block's RMS plus its own magnitude), on an int grid and on a GGUF type; it needs the
    importances."""
    from qtool.quant import ggml
    from qtool.quant.quantizer import GgmlQuantizeDequantize

    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 64, generator=g)
    imp = torch.rand(64, generator=g) * 4
    blocks = w.reshape(16, 2, 32)
    weights = (blocks.pow(2).mean(-1, keepdim=True).sqrt() + blocks.abs()).reshape(16, 64) * imp
    both = MseEncodingAnalyzer((16, 2), (1, 32), weighting="activations_magnitude")
    explicit = MseEncodingAnalyzer((16, 2), (1, 32), weighting="activations")
    both.update_stats(w, importance=imp)
    explicit.update_stats(w, importance=weights)
    for a, b in zip(both.compute_encodings(15, False), explicit.compute_encodings(15, False)):
        assert torch.equal(a, b)
    alone = MseEncodingAnalyzer((16, 2), (1, 32), weighting="activations")
    alone.update_stats(w, importance=imp)
    assert not all(torch.equal(a, b) for a, b in zip(both.compute_encodings(15, False),
                                                     alone.compute_encodings(15, False)))
    t = ggml.ggml_type("Q4_1")
    q = GgmlQuantizeDequantize((16, 2), t, MseEncodingAnalyzer((16, 2), (1, 32), weighting="activations_magnitude"),
                               (1, 32))
    with q.compute_encodings():
        q.observe(w, importance=imp)
    mn, mx = ggml.search_range(w.reshape(-1, 32), t, weights.reshape(-1, 32))
    assert torch.equal(q.min.reshape(-1), mn) and torch.equal(q.max.reshape(-1), mx)
    with pytest.raises(ValueError, match="activations_magnitude needs each value's importance"):
        MseEncodingAnalyzer((16, 2), (1, 32), weighting="activations_magnitude").update_stats(w)


# ---- recipes --------------------------------------------------------------------------------------------------
def test_recipe_rounding_and_weighting_reach_the_plan_and_non_linear_layers_fall_back():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 32)
            self.fc = torch.nn.Linear(32, 32)

    r = parse_recipe("defaults:\n  weights: {bitwidth: 4, rounding: {name: gptq, dampening: 0.05, act_order: false},"
                     " analyzer: {name: mse, weighting: activations}}\n  activations: null\n")
    plan = resolve_plan(r, Net())
    rows = {q.module: q for q in plan.quantizers}
    fc, emb = rows["fc"], rows["emb"]
    assert (fc.rounding, dict(fc.rounding_args)) == ("gptq", {"dampening": 0.05, "act_order": False})
    assert dict(fc.analyzer_args) == {"weighting": "activations"} and fc.needs_inputs
    assert emb.rounding == "nearest" and not emb.needs_inputs and dict(emb.analyzer_args) == {}
    assert any("emb (Embedding): rounding gptq applies to Linear" in w for w in plan.warnings)
    assert plan.needs_data()


def test_a_layer_without_importances_keeps_the_magnitude_part_of_its_weighting():
    net = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 32), "fc": torch.nn.Linear(32, 32)})
    r = parse_recipe("defaults:\n  weights: {bitwidth: 4, analyzer: {name: mse, weighting: activations_magnitude}}\n"
                     "  activations: null\n")
    plan = resolve_plan(r, net)
    rows = {q.module: q for q in plan.quantizers}
    assert dict(rows["fc"].analyzer_args) == {"weighting": "activations_magnitude"} and rows["fc"].needs_inputs
    assert dict(rows["emb"].analyzer_args) == {"weighting": "magnitude"} and not rows["emb"].needs_inputs
    assert any("emb (Embedding): weighting by activations" in w and "weighted by magnitude only" in w
               for w in plan.warnings)
    assert plan.needs_data()


@pytest.mark.parametrize("text, needle", [
    ("weights: {rounding: gptq2}", "rounding.name"),
    ("weights: {rounding: {name: nearest, dampening: 0.1}}", "rounding nearest takes no parameters"),
    ("weights: {rounding: {name: gptq, block_columns: 0}}", "block_columns"),
    ("weights: {analyzer: {name: minmax, weighting: activations}}", "does not take 'weighting'"),
    ("weights: {rounding: {name: adaround, dampening: 0.1}}", "rounding adaround does not take 'dampening'"),
    ("weights: {rounding: {name: gptq, iterations: 10}}", "rounding gptq does not take 'iterations'"),
    ("weights: {rounding: {name: adaround, warm_start: 2}}", "warm_start"),
    ("weights: {rounding: {name: gptq, shrinkage: 1.5}}", "shrinkage"),
    ("weights: {rounding: {name: signround, shrinkage: 0.5}}", "rounding signround does not take 'shrinkage'"),
    # (an infinite gamma calibrated ranges that clipped every positive value; 1e39 overflowed float32: exit 3)
    ("activations: {analyzer: {name: sqnr, gamma: .inf}}", "gamma"),
    ("activations: {analyzer: {name: sqnr, gamma: 1e39}}", "gamma"),
])
def test_bad_rounding_recipes_are_one_clear_error(text, needle):
    from qtool.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        parse_recipe("defaults:\n  " + text + "\n")


def test_default_layer_types_match_subclasses_but_not_attention_out_proj():
    class SamePadConv(torch.nn.Conv2d):
        pass

    net = torch.nn.ModuleDict({"conv": SamePadConv(3, 8, 3), "mha": torch.nn.MultiheadAttention(8, 2)})
    plan = resolve_plan(parse_recipe("version: 1\n"), net)
    names = {q.name for q in plan.quantizers}
    assert {"conv.weight", "conv.input"} <= names
    assert not any(n.startswith("mha.out_proj") for n in names)
    typed = resolve_plan(parse_recipe("layers:\n  - {type: Conv2d, weights: {bitwidth: 4}}\n"), net)
    assert {q.name: q.bitwidth for q in typed.quantizers}["conv.weight"] == 4
    # opted in by its own type (as the hints said): planned, stored quantized, never run. Now float, and said so
    own = resolve_plan(parse_recipe("layers:\n  - {type: NonDynamicallyQuantizableLinear}\n"), net)
    assert not any(q.module == "mha.out_proj" for q in own.quantizers)
    assert any(w.startswith("mha.out_proj (in a MultiheadAttention): the model's code reads the weight without "
                            "calling the layer") for w in own.warnings), own.warnings
    from qtool.errors import ConfigError

    with pytest.raises(ConfigError, match=r"mha.out_proj is a MultiheadAttention's out_proj, whose weight attention "
                                          r"reads without calling the layer\)"):
        resolve_plan(parse_recipe("layers:\n  - {match: mha.out_proj, weights: {bitwidth: 4}}\n"), net)
    # the coverage line names what ignore takes (the layer, not its weight) and no type rule for out_proj
    lone = torch.nn.ModuleDict({"mha": torch.nn.MultiheadAttention(64, 2)})
    line = resolve_plan(parse_recipe("version: 1\nignore: [mha.in_proj_weight]\n"), lone).coverage.warning()
    assert line.endswith("(a module type qtool cannot quantize yet; list them under ignore to acknowledge it: "
                         "mha.out_proj)"), line
    assert not resolve_plan(parse_recipe("version: 1\nignore: [mha.in_proj_weight, mha.out_proj]\n"),
                            lone).coverage.warning()


# ---- end to end -------------------------------------------------------------------------------------------------
@pytest.fixture
def mlp_files(tmp_path):
    save_file(mlp().state_dict(), tmp_path / "mlp.safetensors")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 64, generator=g) * torch.linspace(0.1, 3, 64)  # well above the widest layer (128)
    save_file({"x": x}, tmp_path / "calib.safetensors")
    save_file({"x": torch.randn(64, 64, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 3, 64)},
              tmp_path / "held.safetensors")
    return tmp_path


GPTQ = ("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, block_size: 16, "
        "rounding: gptq}\n  activations: null\n")


def test_gptq_codes_reach_the_files_and_the_fake_quant_model_bit_for_bit(mlp_files):
    t = mlp_files
    (t / "g.yaml").write_text(GPTQ)
    (t / "r.yaml").write_text(GPTQ.replace(", rounding: gptq", ""))
    code, _, err = run_cli("calibrate", t / "mlp.safetensors", "-c", t / "g.yaml", "--model-class", MLP,
                           "--data", t / "calib.safetensors", "-o", t / "run", "--quiet")
    assert code == 0, err
    enc = json.loads((t / "run/encodings.json").read_text())
    assert enc["schema_version"] == 3 and enc["codes"] == {"file": "codes.safetensors"}
    assert json.loads((t / "run/manifest.json").read_text())["rounding"] == {
        "0.weight": "gptq", "2.weight": "gptq", "4.weight": "gptq"}
    code, _, err = run_cli("export", t / "mlp.safetensors", "-e", t / "run/encodings.json", "-o", t / "exp",
                           "--quiet")
    assert code == 0, err
    model = qtool.load_calibrated(str(t / "mlp.safetensors"), str(t / "run/encodings.json"), model_class=MLP)
    deq = read_integer_export(t / "exp/model.safetensors")
    quantizers = dict(iter_quantizers(model))
    modules = dict(model.named_modules())
    float_w = mlp().state_dict()
    differs = 0
    for name in ("0", "2", "4"):
        with torch.no_grad():
            fq = _fake_quant_weight(modules[name], quantizers[f"{name}.weight"])
            rtn = quantizers[f"{name}.weight"](modules[name].weight).as_subclass(torch.Tensor)
        assert torch.equal(deq[f"{name}.weight"], fq)  # the file is what the fake-quant model computes
        assert torch.equal(modules[name].weight, float_w[f"{name}.weight"])  # the float reference is untouched
        differs += int((fq != rtn).sum())
    assert differs > 100  # GPTQ moved codes away from round-to-nearest
    # and it paid: report's end-to-end cosine on held-out data beats round-to-nearest
    code, _, err = run_cli("calibrate", t / "mlp.safetensors", "-c", t / "r.yaml", "--model-class", MLP,
                           "-o", t / "rtn", "--quiet")
    assert code == 0, err
    cos = {}
    for run in ("run", "rtn"):
        code, out, err = run_cli("report", t / "mlp.safetensors", "-e", t / run / "encodings.json", "--model-class",
                                 MLP, "--data", t / "held.safetensors", "--json", "--quiet")
        assert code == 0, err
        rep = json.loads(out)
        cos[run] = rep["end_to_end"]["cosine_mean"]
        layers = {r["module"]: r for r in rep["layers"]}
        if run == "run":  # beside each GPTQ layer, what round-to-nearest would have given it alone (held-out data:
            # the first layer's inputs are independent channels, where GPTQ has little to feed forward)
            gain = [r["sqnr_isolated_db"] - r["sqnr_isolated_rtn_db"] for r in layers.values()]
            assert min(gain) > -0.5 and sum(gain) / len(gain) > 2, layers
        else:
            assert all("sqnr_isolated_rtn_db" not in r for r in layers.values())
    assert 1 - cos["run"] < 0.7 * (1 - cos["rtn"]), cos
    code, out, err = run_cli("report", t / "mlp.safetensors", "-e", t / "run/encodings.json", "--model-class", MLP,
                             "--data", t / "held.safetensors")
    assert code == 0 and "RTN" in out, err


def test_gptq_without_data_says_why_data_is_needed(mlp_files):
    t = mlp_files
    (t / "g.yaml").write_text(GPTQ)
    code, _, err = run_cli("calibrate", t / "mlp.safetensors", "-c", t / "g.yaml", "--model-class", MLP,
                           "-o", t / "run", "--quiet")
    assert code == 2 and "chooses weights from data" in err and not (t / "run").exists()


transformers = pytest.importorskip("transformers")


def test_gptq_sequential_on_a_tiny_llama_stores_valid_codes_that_beat_rtn(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "m")
    for name, seed in (("ids", 1), ("held", 2)):
        ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(seed))
        save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / f"{name}.safetensors")
    # lm_head is tied to the embedding: GPTQ must leave it (and so the embedding) alone
    (tmp_path / "g.yaml").write_text(GPTQ.replace("block_size: 16", "block_size: 32"))
    (tmp_path / "r.yaml").write_text(GPTQ.replace("block_size: 16", "block_size: 32").replace(", rounding: gptq", ""))
    cos = {}
    for recipe, extra in (("g", ["--sequential"]), ("g", []), ("r", [])):
        out = tmp_path / f"{recipe}{len(extra)}"
        code, _, err = run_cli("calibrate", tmp_path / "m", "-c", tmp_path / f"{recipe}.yaml", "--data",
                               tmp_path / "ids.safetensors", "-o", out, "--quiet", *extra)
        assert code == 0, err
        code, rep, err = run_cli("report", tmp_path / "m", "-e", out / "encodings.json", "--data",
                                 tmp_path / "held.safetensors", "--json", "--quiet")
        assert code == 0, err
        cos[out.name] = json.loads(rep)["end_to_end"]["cosine_mean"]
    with safe_open(str(tmp_path / "g1/codes.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "codes/model.layers.0.self_attn.q_proj.weight" in keys and "codes/lm_head.weight" not in keys
    manifest = json.loads((tmp_path / "g1/manifest.json").read_text())
    assert any("tied weights" in w for w in manifest["warnings"])
    assert cos["g1"] > cos["r0"] and cos["g0"] > cos["r0"], cos


def test_layers_reading_one_input_share_one_gptq_run_with_each_layers_own_codes(tmp_path, monkeypatch):
    """q/k/v_proj and gate/up_proj read the same tensor: their rows are stacked into one GPTQ problem (one column
    loop), and every code equals the one a run per layer chooses (rows are independent given the Hessian)."""
    import qtool.calibration.rounding as rounding

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "m")
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "ids.safetensors")
    # q/k/v on int4 block 32 asymmetric-free grids of two widths: k_proj int8 cannot join q/v
    (tmp_path / "g.yaml").write_text(GPTQ.replace("block_size: 16", "block_size: 32") + (
        "layers:\n  - match: '*k_proj'\n    weights: {bitwidth: 8}\n"))
    units = []
    real = rounding._shared_problems
    monkeypatch.setattr(rounding, "_shared_problems",
                        lambda rows, *a: units.append([[q.module.split(".")[-1] for q in u] for u in real(rows, *a)])
                        or real(rows, *a))
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", tmp_path / "g.yaml", "--data",
                           tmp_path / "ids.safetensors", "-o", tmp_path / "stacked", "--quiet", "--sequential")
    assert code == 0, err
    units = [u for u in units if u]
    block = [["q_proj", "v_proj"], ["k_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
    assert units == [block, block, [["lm_head"]]]
    monkeypatch.setattr(rounding, "_shared_problems", lambda rows, *a: [[q] for q in rows])
    code, _, err = run_cli("calibrate", tmp_path / "m", "-c", tmp_path / "g.yaml", "--data",
                           tmp_path / "ids.safetensors", "-o", tmp_path / "single", "--quiet", "--sequential")
    assert code == 0, err
    assert (tmp_path / "stacked/codes.safetensors").read_bytes() == (tmp_path / "single/codes.safetensors").read_bytes()


@pytest.mark.parametrize("tokens, width", [(1, 385), (7, 400), (300, 577), (2048, 1536), (33, 1153)])
def test_panelled_gram_matrix_is_xtx_to_float32_rounding_and_exactly_symmetric(tokens, width):
    """Each value is one float32 dot product over the rows, in whatever order the BLAS sums it: within the bound of
    any summation order of those products (n · 2^-24 · sum |x_i x_j|) of the float64 product. Bit equality with the
    whole ``x.T @ x`` is not asserted: a BLAS may split the rows between threads for one product and not the other
    (seen with oneMKL on 2 threads of a Xeon with AMX, 2048 x 1536: one float32 step apart)."""
    from qtool.calibration.rounding.statistics import _gram

    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(tokens)) * 3
    g = _gram(x)
    x64 = x.double()
    bound = tokens * 2.0 ** -24 * (x64.abs().T @ x64.abs()) + 1e-30
    assert torch.equal(g, g.T)
    assert bool(((g.double() - x64.T @ x64).abs() <= bound).all())
    assert torch.equal(g, _gram(x))
