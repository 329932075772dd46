"""What an evaluation measures, as pure functions of next-token distributions (llama-perplexity's conventions).

A runtime's view of one sequence is a :class:`Distributions`: for each position ``i`` (predicting ``ids[i + 1]``)
the log-probability of the true next token and the runtime's most likely tokens with their log-probabilities —
the whole vocabulary where the runtime hands over its logits (torch, onnxruntime), its top ``K`` where it only
reports those (llama.cpp's server). The reference (float or fake-quant) is always a full ``[T, V]`` log-softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

# the KL of a top-K runtime is taken over its K tokens plus one bucket for the rest of the vocabulary: a lower
# bound of the full KL (merging outcomes cannot raise a divergence) that is tight once the rest holds little mass.
# The rest's mass is 1 - (the K probabilities' sum), which a runtime's float32 log-probabilities give to about
# 1e-7: it is taken as at least REST_FLOOR, which can only lower the bucket's term (it falls as the mass grows),
# so the figure stays a lower bound.
_TINY = 1e-30
REST_FLOOR = 1e-6


@dataclass
class Distributions:
    """One sequence's next-token predictions: ``target`` ``[T]`` = log q(ids[i + 1] | ids[:i + 1]); ``top_ids`` /
    ``top_logprobs`` ``[T, K]``, most likely first; ``full`` ``[T, V]`` log-softmax when the runtime gives it."""

    target: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    full: Optional[torch.Tensor] = None

    @classmethod
    def from_logits(cls, logits: torch.Tensor, ids: Sequence[int], k: int = 1, start: int = 1) -> "Distributions":
        """From a model's ``[T, V]`` logits over ``ids`` (``T = len(ids)``; the last position predicts nothing):
        the predictions of ``ids[start:]``."""
        logp = torch.log_softmax(logits[start - 1: len(ids) - 1].double(), dim=-1)
        target = logp.gather(-1, torch.as_tensor(list(ids[start:]), dtype=torch.long).unsqueeze(-1)).squeeze(-1)
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return cls(target, top.indices, top.values, logp)

    @property
    def argmax(self) -> torch.Tensor:
        return self.top_ids[:, 0]


def token_kl(ref_logp: torch.Tensor, cand: Distributions) -> torch.Tensor:
    """Per-position KL(ref ‖ cand) in nats. Exact when ``cand`` has the whole vocabulary; otherwise over the
    candidate's top-K tokens plus one bucket holding the rest of both distributions (a lower bound)."""
    ref_logp = ref_logp.double()
    if cand.full is not None:
        return (ref_logp.exp() * (ref_logp - cand.full.double())).sum(-1).clamp_min(0.0)
    lp = ref_logp.gather(-1, cand.top_ids)
    lq = cand.top_logprobs.double()
    p = lp.exp()
    kl = (p * (lp - lq)).sum(-1)
    p_rest = (1.0 - p.sum(-1)).clamp_min(0.0)
    q_rest = (1.0 - lq.exp().sum(-1)).clamp_min(REST_FLOOR)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(_TINY).log() - q_rest.log()), torch.zeros_like(p_rest))
    return (kl + rest).clamp_min(0.0)


@dataclass
class Agreement:
    """How a candidate's next-token predictions compare with a reference's over every scored position."""

    tokens: int
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1: float  # fraction of positions whose most likely token is the reference's

    def to_json(self) -> Dict[str, float]:
        return {"tokens": self.tokens, "kl_mean": self.kl_mean, "kl_p99": self.kl_p99, "kl_max": self.kl_max,
                "top1_agreement": self.top1}


def agreement(kls: List[torch.Tensor], same_top: List[torch.Tensor]) -> Agreement:
    kl = torch.cat(kls).double() if kls else torch.zeros(0, dtype=torch.float64)
    same = torch.cat(same_top) if same_top else torch.zeros(0, dtype=torch.bool)
    if kl.numel() == 0:
        raise ValueError("no scored tokens")
    return Agreement(int(kl.numel()), float(kl.mean()), float(torch.quantile(kl, 0.99)), float(kl.max()),
                     float(same.double().mean()))


def perplexity(targets: List[torch.Tensor]) -> float:
    """exp of the mean next-token negative log-likelihood over every scored position."""
    t = torch.cat(targets).double()
    return math.exp(float(-t.mean()))


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int:
    """How many generated tokens ``other`` shares with ``reference`` before they first differ. A continuation
    that ends (at an end-of-text token, or the token budget) where the other goes on differs there; two equal
    continuations give their length."""
    n = min(len(reference), len(other))
    for i in range(n):
        if int(reference[i]) != int(other[i]):
            return i
    return n


@dataclass
class Divergence:
    """Greedy continuations against the reference's: where each first leaves it."""

    prompts: int
    tokens: int  # tokens generated per prompt
    mean: float
    worst: int
    identical: int  # continuations equal to the reference's all the way

    def to_json(self) -> Dict[str, float]:
        return {"prompts": self.prompts, "tokens": self.tokens, "first_divergence_mean": self.mean,
                "first_divergence_worst": self.worst, "identical": self.identical}


def divergence(reference: List[List[int]], other: List[List[int]], tokens: int) -> Divergence:
    pos = [first_divergence(r, o) for r, o in zip(reference, other)]
    same = sum(list(map(int, r)) == list(map(int, o)) for r, o in zip(reference, other))
    return Divergence(len(pos), tokens, sum(pos) / max(1, len(pos)), min(pos, default=0), same)
