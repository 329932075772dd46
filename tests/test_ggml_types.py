"""llama.cpp's K-quant and IQ4 block types (``qtool.quant.ggml``): the values qtool computes for a grid are the
values gguf-py (and so ggml) reads back from the bytes qtool packs, bit for bit, for every type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.quant import ggml

TYPES = sorted(ggml.GGML_TYPES)


def _wished(w: torch.Tensor, t: ggml.GgmlType):
    """Per-sub-block steps and minima from the sub-block's range (what a min-max analyzer would give)."""
    x = w.reshape(w.shape[0], -1, t.sub)
    qmin, qmax = t.qmin_qmax
    sign = torch.where(x.amax(-1) > -x.amin(-1), -1.0, 1.0)  # the larger end takes the most negative code
    if t.table:
        return sign * x.abs().amax(-1) / 127, None
    if t.symmetric:
        return sign * x.abs().amax(-1) / -qmin, None
    mn = x.amin(-1).clamp(max=0)
    return (x.amax(-1) - mn) / qmax, -mn


def _ggml_values(blocks: torch.Tensor, name: str, shape) -> np.ndarray:
    return gguf.quants.dequantize(blocks.numpy(), getattr(gguf.GGMLQuantizationType, name)).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(TYPES), rows=st.integers(1, 3), nb=st.integers(1, 2), seed=st.integers(0, 2**16),
       log_scale=st.integers(-12, 8), zero_sub=st.booleans())
def test_packed_bytes_dequantize_in_ggml_to_qtools_values(name, rows, nb, seed, log_scale, zero_sub):
    t = ggml.GGML_TYPES[name]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, nb * t.block, generator=g) * 2.0**log_scale
    w[:, :t.sub] *= torch.rand(rows, 1, generator=g) * 8  # sub-blocks of very different ranges
    if zero_sub:
        w[:, t.sub:2 * t.sub] = 0
    grid = ggml.snap(*_wished(w, t), t)
    codes = ggml.quantize_codes(w, grid)
    qmin, qmax = t.qmin_qmax
    assert int(codes.min()) >= qmin and int(codes.max()) <= qmax
    ours = ggml.dequantize(codes, grid)
    blocks = ggml.pack(codes, grid)
    assert blocks.dtype == torch.uint8 and blocks.shape == (rows, nb * t.nbytes)
    assert np.array_equal(_ggml_values(blocks, name, w.shape), ours.numpy())
    if zero_sub:
        assert bool((ours[:, t.sub:2 * t.sub] == 0).all()) or not t.symmetric


@pytest.mark.parametrize("name", TYPES)
def test_every_code_and_scale_survives_packing(name):
    """Extreme stored integers (every code, the largest and smallest sub-block scales) read back as computed."""
    t = ggml.GGML_TYPES[name]
    qmin, qmax = t.qmin_qmax
    n = t.block * 2
    codes = (torch.arange(n) % (qmax - qmin + 1) + qmin).reshape(1, n).to(torch.int32)
    step = torch.linspace(0.0, 3.0, n // t.sub).reshape(1, -1)
    low = None if t.symmetric else torch.linspace(2.0, 0.0, n // t.sub).reshape(1, -1)
    grid = ggml.snap(step, low, t)
    if t.scale_bits:
        lo, hi = int(grid.sc.min()), int(grid.sc.max())
        assert hi - lo >= (1 << t.scale_bits) // 2 - 1  # the scales span their stored range
    assert np.array_equal(_ggml_values(ggml.pack(codes, grid), name, codes.shape),
                          ggml.dequantize(codes, grid).numpy())


@pytest.mark.parametrize("name", TYPES)
def test_snapped_grid_is_close_to_the_wished_one_and_rounds_to_nearest(name):
    t = ggml.GGML_TYPES[name]
    w = torch.randn(4, 2 * t.block, generator=torch.Generator().manual_seed(0))
    step, low = _wished(w, t)
    grid = ggml.snap(step, low, t)
    big = step.abs() >= step.abs().amax() / 4  # small sub-block scales lose relative precision when quantized
    if t.scale_bits is None:
        tol = 1e-3  # one float16 scale (and minimum)
    else:  # half a step of the integer scale, at a quarter of the super-block's largest
        levels = 1 << (t.scale_bits - 1) if t.signed_scales else (1 << t.scale_bits) - 1
        tol = 2 / levels + 1e-3
    assert ((grid.step[big] / step[big] - 1).abs() <= tol).all()  # signs kept too
    codes = ggml.quantize_codes(w, grid)
    values = ggml.dequantize(codes, grid)
    levels = ggml.type_levels(grid).repeat_interleave(t.sub, dim=1)  # [rows, cols, n_codes]
    nearest = (w.unsqueeze(-1) - levels).abs().amin(-1)
    assert torch.allclose((w - values).abs(), nearest, atol=1e-6)


def test_scales_beyond_float16_are_refused():
    t = ggml.GGML_TYPES["Q4_K"]
    with pytest.raises(ValueError, match="float16"):
        ggml.snap(torch.full((1, 8), 1e7), torch.zeros(1, 8), t)
    with pytest.raises(ValueError, match="not finite"):
        ggml.snap(torch.full((1, 8), float("nan")), torch.zeros(1, 8), t)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), outlier=st.floats(4.0, 30.0), name=st.sampled_from(["q4_1", "q4_0", "q2_k"]),
       exact=st.booleans())
def test_clipped_candidates_never_raise_the_search_error_and_clip_an_outlier(seed, outlier, name, exact):
    """search_range(clip_ratios=...) only adds candidates, either way of scoring them: the error it scores (before
    scales are quantized) is never above the plain search's, that score is never below the returned grid's own
    error with its nearest codes, and on Q4_1 a sub-block with one far outlier gets a span narrower than its
    min-max."""
    t = ggml.ggml_type(name)
    qmin, qmax = t.qmin_qmax
    x = torch.randn(64, t.sub, generator=torch.Generator().manual_seed(seed))
    x[:, 7] = outlier * x[:, 7].sign()
    x[32:, 7] = 0.0  # half the rows without the outlier

    def error(mn, mx):  # the grid for the range, unquantized step
        step, low = t.wished_step(mn, mx)
        step, low = step[:, None], (torch.zeros_like(step) if low is None else low)[:, None]
        safe = torch.where(step == 0, torch.ones_like(step), step)
        return ((torch.round((x + low) / safe).clamp(qmin, qmax) * step - low - x) ** 2).sum(1).double()

    plain = ggml.search_range(x, t, with_error=True, exact=exact)
    clipped = ggml.search_range(x, t, clip_ratios=ggml.CLIP_RATIOS, with_error=True, exact=exact)
    assert bool((clipped[2] <= plain[2] * (1 + 1e-9) + 1e-12).all())
    for mn, mx, scored in (plain, clipped):
        assert bool((error(mn, mx) <= scored * (1 + 1e-4) + 1e-6).all())  # (the range is float32)
    if name == "q4_1":  # (at 2 bits, or with the outlier on the grid's extra level, keeping it can be best)
        reach, full = clipped[1] - clipped[0], x.amax(1) - x.amin(1).clamp(max=0)
        assert bool((reach[:32] < full[:32] - 1e-6).any())


def _candidate_scores(x, w, t, rounding=torch.round, steps=20):
    """Every candidate of search_range scored the slow way, in float64: each candidate step's codes by rounding
    every value (``rounding``), their least-squares step (and minimum ≥ 0) refitted, the weighted squared error;
    the min-max grid unrefitted. ``(rows, candidates)``."""
    x, w = x.double(), w.double()
    qmin, qmax = t.qmin_qmax
    mn, mx = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    if t.symmetric:
        amax = torch.maximum(-mn, mx)
        span, low = torch.where(mx > -mn, -amax, amax), torch.zeros_like(mn)
    else:
        span, low = mx - mn, -mn
    d0 = t.search_denominator(0.0)
    # each value's place in its span, z = (x + low) / span, as the search forms it (float32); codes round z·D
    inverse = torch.where(span == 0, 0.0, 1.0 / torch.where(span == 0, 1.0, span.float()))
    z = ((x.float() + low.float()[:, None]) * inverse[:, None]).double()
    scores = []
    for k, d in enumerate([None] + [t.search_denominator(-1.0 + 2.0 * k / steps) for k in range(steps + 1)]):
        step = span / (d0 if d is None else d)
        q = rounding(z * (d0 if d is None else d)).clamp(qmin, qmax)
        if d is not None:  # refit: s (and l ≥ 0) minimizing Σw(x - s·q + l)²
            sw, sx, sq = w.sum(1), (w * x).sum(1), (w * q).sum(1)
            qq, xq = (w * q * q).sum(1), (w * x * q).sum(1)
            alone = xq / qq.clamp(min=1e-300)
            if t.symmetric:
                ok = (xq * torch.sign(span) > 0)
                step, low_k = torch.where(ok, alone, torch.nan), torch.zeros_like(alone)
            else:
                det = sw * qq - sq * sq
                s2, l2 = (sw * xq - sx * sq) / det, (sq * xq - qq * sx) / det
                both = (det > 0) & (l2 >= 0) & (s2 > 0)
                step = torch.where(both, s2, torch.where(xq > 0, alone, torch.nan))
                low_k = torch.where(both, l2, torch.zeros_like(l2))
        else:
            low_k = low
        err = (w * (x - (step[:, None] * q - low_k[:, None])) ** 2).sum(1)
        scores.append(torch.where(torch.isnan(err), torch.inf, err))
    return torch.stack(scores, 1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), name=st.sampled_from(["q4_0", "q8_0", "q3_k", "q6_k", "q4_1", "q4_k", "q2_k"]),
       weighted=st.booleans(), spread=st.floats(0.1, 10.0))
def test_search_scores_every_candidate_as_rounding_each_value_would(seed, name, weighted, spread):
    """The integer grids' search gets every candidate's codes from where each value's code moves on, not by
    rounding every value per candidate: the least error it reports is, sub-block by sub-block, the least of the
    candidates scored the slow way (a value exactly halfway between two codes, as a block's largest is at every
    fifth candidate, takes the one farther from zero), and the range it returns is the winner's."""
    t = ggml.ggml_type(name)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200, t.sub, generator=g) * torch.rand(200, 1, generator=g).mul(spread)
    x[::9, 3] *= 8.0  # outliers
    x[5] = 0.0  # an all-zero sub-block
    x[6] = 0.25  # a constant one
    w = torch.rand(200, t.sub, generator=g) + 0.05 if weighted else torch.ones_like(x)
    mn, mx, least = ggml.search_range(x, t, w if weighted else None, with_error=True)
    slow = _candidate_scores(x, w, t, rounding=lambda v: torch.sign(v) * torch.floor(v.abs() + 0.5)).amin(1)
    # (float32 products summed in float64 agree to about 1e-7 of Σw·x², and the two-parameter refit of a grid with
    # a minimum magnifies that to 2.3e-6 at worst over 720 such cases; one code one level off moves the score by
    # about 1e-3 of it at 4 bits)
    scale = (w.double() * x.double() ** 2).sum(1) + 1e-30
    assert torch.allclose(least / scale, slow / scale, rtol=0, atol=2e-5), ((least - slow) / scale).abs().max()
    # the range is that grid's: its own error (nearest codes, unquantized step) is at most the score
    qmin, qmax = t.qmin_qmax
    step, low = t.wished_step(mn, mx)
    low = torch.zeros_like(step) if low is None else low
    safe = torch.where(step == 0, torch.ones_like(step), step)[:, None]
    values = torch.round((x + low[:, None]) / safe).clamp(qmin, qmax) * step[:, None] - low[:, None]
    own = (w * (values - x) ** 2).sum(1).double()
    assert bool((own <= least * (1 + 1e-4) + 1e-6 * scale).all())


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("sub_block", [[1e-40] + [0.0] * 15, [1e-39] * 15 + [-1e-39], [1e-40] * 16])
def test_a_sub_block_of_denormals_searches_to_what_min_max_gives(name, sub_block):
    """A span so small its inverse overflows float32 made 0 · inf = NaN codes, and the search's bins an index of
    -2^63 (a RuntimeError: calibrate's "internal error", gguf-q4_k_m on a weight row of 1e-40s). Such a sub-block
    has no better candidate than its own range: the searched quantizer gives the min-max one's values."""
    from qtool.quant import GgmlQuantizeDequantize, MinMaxEncodingAnalyzer, MseEncodingAnalyzer

    t = ggml.ggml_type(name)
    width = 256 if name.endswith("_k") else 32
    x = torch.tensor([(sub_block * 16)[:width]])
    shape, block = (1, width // t.sub), (1, t.sub)
    values = []
    for analyzer in (MseEncodingAnalyzer, MinMaxEncodingAnalyzer):
        q = GgmlQuantizeDequantize(shape, t, analyzer(shape, block), block)
        with q.compute_encodings():
            q(x)
        values.append(q(x))
    assert torch.isfinite(values[0]).all() and torch.equal(values[0], values[1])


def test_a_gptq_row_searches_clipped_spans_and_a_nearest_row_does_not():
    from qtool.config import parse_recipe, resolve_plan
    from qtool.model.insert import make_quantizer

    model = torch.nn.Sequential(torch.nn.Linear(64, 8))
    for rounding, clip in (("gptq", True), ("nearest", False)):
        recipe = parse_recipe(f"version: 1\ndefaults:\n  weights: {{gguf_type: q4_0, analyzer: mse, rounding: {rounding}}}"
                              "\n  activations: null\n")
        row = resolve_plan(recipe, model).weights[0]
        assert make_quantizer(row).clip is clip


@pytest.mark.parametrize("gguf_type", ["q4_k", "q3_k", "q5_0", "iq4_xs"])
def test_bounded_gptq_on_gguf_grids_rounds_each_value_down_or_up_only(gguf_type):
    from qtool.calibration.rounding.gptq import _levels, _value, expand_encoding, gptq_codes
    from qtool.config import parse_recipe, resolve_plan
    from qtool.model.insert import make_quantizer
    from qtool.quant.ggml import IQ4_TABLE

    g = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(256, 16)
    w = torch.randn(16, 256, generator=g)
    layer.weight.data = w.clone()
    recipe = parse_recipe(f"version: 1\ndefaults:\n  weights: {{gguf_type: {gguf_type}, rounding: gptq}}\n"
                          "  activations: null\n")
    row = resolve_plan(recipe, torch.nn.Sequential(layer)).weights[0]
    quantizer = make_quantizer(row)
    with quantizer.compute_encodings():
        quantizer.observe(w)
    s, o = (expand_encoding(t.detach(), w.shape, row.block_size) for t in (quantizer.get_scale(), quantizer.get_offset()))
    x = torch.randn(1024, 16, generator=g) @ torch.randn(16, 256, generator=g) + 0.1 * torch.randn(1024, 256, generator=g)
    codes = gptq_codes(w, x.T @ x, s, o, quantizer.qmin, quantizer.qmax, bounded=True,
                       element=quantizer.spec.element_grid).to(torch.float32)
    if gguf_type == "iq4_xs":  # codes index the sorted table: the value just below or just above w / s
        table = torch.tensor(IQ4_TABLE, dtype=torch.float32)
        position = w / s
        below = (torch.bucketize(position, table, right=True) - 1).clamp(0, 15) - 8
        above = torch.bucketize(position, table).clamp(0, 15) - 8
    else:
        position = w / s - o
        below = position.floor().clamp(quantizer.qmin, quantizer.qmax)
        above = position.ceil().clamp(quantizer.qmin, quantizer.qmax)
    assert bool(((codes == below) | (codes == above)).all())
    free = gptq_codes(w, x.T @ x, s, o, quantizer.qmin, quantizer.qmax, element=quantizer.spec.element_grid)
    assert not bool(((free == below) | (free == above)).all())  # unbounded GPTQ moves some codes further
    # and within its bounds it still feeds the errors forward: well below round-to-nearest's output error
    element = quantizer.spec.element_grid
    rtn = _levels(w, s, o, quantizer.qmin, quantizer.qmax, element)
    errors = [float((x @ (w - _value(c.to(torch.float32), s, o, element)).T).pow(2).sum()) for c in (rtn, codes)]
    assert errors[1] < 0.9 * errors[0], errors


# ---- the importance-weighted super-block scale (ggml.weighted_steps) ---------------------------------------------
def _value_error(w, imp, grid, t):
    """Per super-block, the ``imp``-weighted squared error of ``w`` rounded to its nearest values on ``grid``."""
    err = (imp * (ggml.quantize_dequantize(w, grid) - w).pow(2)).reshape(w.shape[0], -1, t.block).sum(-1)
    return err.double()


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(TYPES), seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), nb=st.integers(1, 3),
       log_scale=st.integers(-10, 6), spread=st.floats(0.0, 3.0), zero_weights=st.booleans())
def test_weighted_super_block_scales_snap_back_and_never_raise_the_weighted_error(name, seed, rows, nb, log_scale,
                                                                                spread, zero_weights):
    """The steps ``weighted_steps`` returns are a grid the type stores (its range snaps back to exactly those steps
    and minima), and per super-block the weighted squared error of the values rounded to it is at most that of
    today's ``max / levels`` scales; a type whose llama.cpp search does not weigh the super-block scale gets its
    steps back unchanged."""
    t = ggml.GGML_TYPES[name]
    g = torch.Generator().manual_seed(seed)
    cols = nb * t.block
    w = torch.randn(rows, cols, generator=g) * 2.0 ** log_scale
    w = w * torch.exp(spread * torch.randn(rows, cols // t.sub, 1, generator=g)).repeat_interleave(t.sub, -1).reshape(
        rows, cols)
    imp = (torch.rand(cols, generator=g) ** 3 * 10).expand(rows, cols).contiguous()
    if zero_weights:
        imp[0] = 0
    step, low = _wished(w, t)
    new_step, new_low = ggml.weighted_steps(w, imp, step, low, t)
    if not t.weighted_scales:
        assert new_step is step and new_low is low
        return
    mn, mx = t.range_of(new_step, torch.zeros_like(new_step) if new_low is None else new_low)
    grid = ggml.grid_from_range(mn, mx, t)
    assert torch.equal(grid.step, new_step)
    if new_low is not None:
        assert torch.equal(grid.low, new_low)
    today = ggml.snap(step, low, t)
    ours, theirs = _value_error(w, imp, grid, t), _value_error(w, imp, today, t)
    assert bool((ours <= theirs * (1 + 1e-6) + 1e-30).all()), (ours - theirs).max()


def test_weighted_super_block_scales_lower_the_weighted_error_of_importance_weighted_rows():
    """On rows whose sub-blocks differ in importance, the weighted search of the super-block scales lowers the
    importance-weighted squared error of the dequantized weights (Q2_K's 4-bit scales most), and a quantizer weighted
    by activations stores that grid while one weighted by magnitude alone (no data) keeps today's."""
    from qtool.quant.analysis.mse import MseEncodingAnalyzer, magnitude_weights
    from qtool.quant.quantizer import GgmlQuantizeDequantize

    g = torch.Generator().manual_seed(3)
    for name in ("q2_k", "q3_k", "q4_k", "q5_k"):
        t = ggml.ggml_type(name)
        rows, cols = 32, 1024
        spread = torch.rand(rows, cols // t.sub, 1, generator=g).repeat_interleave(t.sub, -1).reshape(rows, cols)
        w = torch.randn(rows, cols, generator=g) * spread * 3
        imp = torch.rand(cols, generator=g) ** 4 * 10
        shape = (rows, cols // t.sub)
        errors = {}
        for weighting in ("activations", "magnitude"):
            q = GgmlQuantizeDequantize(shape, t, MseEncodingAnalyzer(shape, (1, t.sub), weighting=weighting),
                                       (1, t.sub))
            with q.compute_encodings():
                q.observe(w, importance=imp if weighting == "activations" else None)
            sub = w.reshape(-1, t.sub)
            weights = (imp.expand(rows, cols).reshape(-1, t.sub) if weighting == "activations"
                       else magnitude_weights(sub))
            searched = ggml.search_range(sub, t, weights)
            plain = ggml.grid_from_range(searched[0].reshape(shape), searched[1].reshape(shape), t)
            errors[weighting] = [float((imp * (ggml.quantize_dequantize(w, grid) - w).pow(2)).sum())
                                 for grid in (q.grid(), plain)]
            if weighting == "magnitude":
                assert torch.equal(q.grid().step, plain.step) and torch.equal(q.grid().low, plain.low)
        ours, today = errors["activations"]
        assert ours < today * 0.999, (name, ours, today)


@pytest.mark.parametrize("name", ["q2_k", "q3_k"])
def test_weighted_super_block_scales_are_the_same_searched_row_slice_by_row_slice(name, monkeypatch):
    """The search runs over slices of rows (bounded temporaries); each super-block's choice is its own, so one row
    at a time gives the same steps as all at once."""
    from qtool.quant.ggml import superblock

    t = ggml.ggml_type(name)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(6, 2 * t.block, generator=g) * torch.rand(6, 1, generator=g)
    imp = (torch.rand(2 * t.block, generator=g) ** 3).expand(6, -1).contiguous()
    step, low = _wished(w, t)
    whole = ggml.weighted_steps(w, imp, step, low, t)
    monkeypatch.setattr(superblock, "_SLICE_VALUES", 1)
    sliced = ggml.weighted_steps(w, imp, step, low, t)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced) if a is not None)
