"""llama.cpp itself (the ``xllamacpp`` CPU wheel) running a GGUF file: greedy next tokens and per-token
log-probabilities of token-id prompts. Used by tests/test_gguf.py and bench/gguf_llamacpp.py to prove qtool's GGUF
files run where users run them.

Token-id prompts are taken as given (llama.cpp adds no BOS to them). Log-probabilities are llama.cpp's own
(softmax of the model's logits before sampling): the true next token is forced with a large logit bias, which
changes what is sampled but not the reported probability.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Sequence, Tuple

FORCE = 1.0e6


class LlamaCpp:
    def __init__(self, path: str, n_ctx: int = 512, threads: int = 2, verbosity: int = 1):
        import xllamacpp as xlc

        p = xlc.CommonParams()
        p.model.path = str(path)
        p.n_parallel = 1
        p.n_ctx = n_ctx
        p.n_batch = p.n_ubatch = 512
        p.n_gpu_layers = 0
        p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
        p.sampling.temp = 0.0
        p.sampling.top_k = 1
        p.sampling.seed = 0
        p.verbosity = verbosity  # 1: errors only (llama.cpp logs to stderr)
        p.fit_params = False
        self.n_ctx = n_ctx
        self._server = xlc.Server(p)  # raises RuntimeError when the file does not load

    def _one(self, ids: Sequence[int], **extra) -> dict:
        if len(ids) + 1 > self.n_ctx:
            raise ValueError(f"{len(ids)} tokens do not fit a context of {self.n_ctx}")
        r = self._server.handle_completions({"prompt": [int(t) for t in ids], "max_tokens": 1, "temperature": 0.0,
                                             "top_k": 1, "n_probs": 1, "ignore_eos": True, **extra})
        if "choices" not in r:
            raise RuntimeError(f"llama.cpp: {r.get('error', r)}")
        return r["choices"][0]["logprobs"]["content"][0]

    def greedy_next(self, ids: Sequence[int]) -> int:
        return int(self._one(ids)["id"])

    def top(self, ids: Sequence[int], k: int = 5) -> List[Tuple[int, float]]:
        """The ``k`` most likely next tokens with their log-probabilities."""
        r = self._server.handle_completions({"prompt": [int(t) for t in ids], "max_tokens": 1, "temperature": 0.0,
                                             "top_k": 1, "n_probs": k, "ignore_eos": True})
        return [(int(t["id"]), float(t["logprob"])) for t in r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]]

    def token_logprobs(self, ids: Sequence[int]) -> List[float]:
        """``log p(ids[i] | ids[:i])`` for i = 1 .. len(ids) - 1 (llama.cpp caches the shared prefix)."""
        out = []
        for i in range(1, len(ids)):
            c = self._one(ids[:i], logit_bias=[[int(ids[i]), FORCE]], cache_prompt=True)
            if int(c["id"]) != int(ids[i]):
                raise RuntimeError(f"could not force token {ids[i]} at position {i}")
            out.append(float(c["logprob"]))
        return out

    def perplexity(self, seqs: Iterable[Sequence[int]]) -> float:
        lps = [lp for s in seqs for lp in self.token_logprobs(s)]
        return math.exp(-sum(lps) / len(lps))

    def close(self) -> None:
        self._server = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
