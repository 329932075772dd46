"""Is one quantized model's held-out perplexity really below another's? A paired bootstrap over the scoring windows.

Two rows of a benchmark are scored on the same windows, so their difference is measured window by window: a
window of hard text raises both. Resampling the windows (with replacement, the same draw for both models) gives
an interval for the ratio of the two perplexities that counts how much the result depends on which windows the
text happened to have. Used by bench/gguf_kquants.py to say whether a qtool row beats llama.cpp's on a text or
only ties it.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch


@torch.no_grad()
def window_nlls(model, batches) -> Tuple[List[float], List[int]]:
    """Each window's summed next-token negative log-likelihood and its scored-token count (padding excluded), in
    the order of ``batches``; their totals give the perplexity bench/gguf_kquants.py reports."""
    from qtool.report import next_token_nll_grid

    sums, counts = [], []
    for b in batches:
        nll, scored = next_token_nll_grid(model(**b.kwargs).logits, b)
        sums += (nll * scored).double().sum(-1).tolist()
        counts += scored.sum(-1).tolist()
    return sums, counts


def paired_interval(a: Sequence[float], b: Sequence[float], counts: Sequence[int], draws: int = 4000,
                    seed: int = 0, level: float = 0.95) -> Dict[str, float]:
    """Perplexity of A over perplexity of B, minus one, in percent: the estimate on all windows and its
    ``level`` percentile interval over ``draws`` paired resamplings of the windows.

    ``a`` and ``b`` are the two models' summed NLL per window, ``counts`` the windows' scored tokens (the same
    windows for both). Deterministic for a seed. Below zero: A's perplexity is lower."""
    if not (len(a) == len(b) == len(counts)) or not counts:
        raise ValueError("paired_interval needs the same non-empty list of windows for both models")
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    n = torch.tensor(counts, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(len(counts), (draws, len(counts)), generator=g)
    ratios = torch.expm1(d[pick].sum(-1) / n[pick].sum(-1)) * 100
    lo, hi = torch.quantile(ratios, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return {"pct": float(torch.expm1(d.sum() / n.sum()) * 100), "low": float(lo), "high": float(hi)}


def verdict(interval: Dict[str, float]) -> str:
    """``lower`` / ``higher`` where the whole interval is on one side of zero, else ``tie``."""
    return "lower" if interval["high"] < 0 else "higher" if interval["low"] > 0 else "tie"
