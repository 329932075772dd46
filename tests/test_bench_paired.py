"""bench/paired.py: the paired bootstrap every GGUF comparison row's lower / higher / tie verdict rests on."""
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from paired import paired_interval, verdict  # noqa: E402


def test_identical_rows_are_a_zero_width_tie():
    a = [310.5, 290.1, 402.7]
    out = paired_interval(a, a, [255, 255, 255])
    assert out == {"pct": 0.0, "low": 0.0, "high": 0.0}
    assert verdict(out) == "tie"


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(1.0, 6.0), min_size=2, max_size=20), st.floats(-0.2, 0.2))
def test_a_constant_per_token_shift_is_a_zero_width_interval_at_the_shift(per_token, shift):
    counts = [255] * len(per_token)
    b = [c * v for c, v in zip(counts, per_token)]
    a = [x + c * shift for x, c in zip(b, counts)]
    out = paired_interval(a, b, counts)
    want = math.expm1(shift) * 100
    for key in ("pct", "low", "high"):
        assert out[key] == pytest.approx(want, abs=1e-9)


def test_the_estimate_is_the_ratio_of_the_two_perplexities():
    a, b, counts = [300.0, 500.0], [310.0, 480.0], [200, 250]
    want = math.exp(sum(a) / sum(counts)) / math.exp(sum(b) / sum(counts)) - 1
    assert paired_interval(a, b, counts)["pct"] == pytest.approx(100 * want, rel=1e-12)


def test_verdicts_follow_the_interval_and_noise_makes_a_tie():
    g = torch.Generator().manual_seed(1)
    counts = [255] * 32
    b = (torch.rand(32, generator=g) * 2 + 3) * 255
    noise = torch.randn(32, generator=g) * 40
    assert verdict(paired_interval((b - 20).tolist(), b.tolist(), counts)) == "lower"
    assert verdict(paired_interval((b + 20).tolist(), b.tolist(), counts)) == "higher"
    mixed = paired_interval((b + noise).tolist(), b.tolist(), counts)
    assert mixed["low"] < 0 < mixed["high"] and verdict(mixed) == "tie"


def test_deterministic_for_a_seed_and_bad_input_is_refused():
    g = torch.Generator().manual_seed(2)
    a, b = (torch.rand(20, generator=g) * 100).tolist(), (torch.rand(20, generator=g) * 100).tolist()
    counts = [50] * 20
    assert paired_interval(a, b, counts) == paired_interval(a, b, counts)
    assert paired_interval(a, b, counts, seed=1) != paired_interval(a, b, counts)  # another draw of windows
    with pytest.raises(ValueError):
        paired_interval(a, b[:2], counts)
    with pytest.raises(ValueError):
        paired_interval([], [], [])
