"""llama.cpp itself (the ``xllamacpp`` CPU wheel, the ``llamacpp`` extra) running a GGUF file: per-position
log-probabilities, its most likely tokens and greedy continuations of token-id prompts.

Token-id prompts are taken as given (llama.cpp adds no BOS to them), and end-of-generation tokens are scored
and chosen like any other (the next request simply goes on after them). Log-probabilities are llama.cpp's own
(softmax of the model's logits before sampling). To read the true next token's log-probability when it is not
among the most likely, it is forced with a large logit bias: that changes what is sampled, not the reported
probabilities. Each position is one request on top of the cached prefix (the server has no prompt log-probabilities),
so scoring costs about one decoded token per position. Sliding-window layers get a full-size cache
(``swa_full``), without which that reuse goes wrong from the second prompt on.

A token whose text ends inside a UTF-8 character (a byte-level piece of a CJK character or an emoji) comes back
with no log-probabilities at all: the server holds a partial character back, and its probabilities with it. There
a token whose text is whole is forced instead and the whole vocabulary's log-probabilities are read (the
distribution does not depend on the token sampled after it): slower, the same numbers.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import UsageError
from ..quant.affine import inverse_or_zero
from .metrics import Distributions

FORCE = 1.0e6
INSTALL = "pip install 'qtool[llamacpp]' (the xllamacpp wheel)"


def _xllamacpp():
    try:
        import xllamacpp
    except ImportError:
        raise UsageError(f"running a GGUF file needs llama.cpp's Python wheel: {INSTALL}") from None
    return xllamacpp


@contextlib.contextmanager
def _stderr_kept() -> Iterator[Callable[[], str]]:
    """What llama.cpp writes to file descriptor 2 inside the block, held back (a failed load's five log lines
    came before qtool's one); yields a function giving that text so far, and once the block is over all of it."""
    import tempfile

    final: List[str] = []
    sys.stderr.flush()
    with tempfile.TemporaryFile() as log:
        fd = log.fileno()

        def said() -> str:
            if final:
                return final[0]
            return os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8", "replace")

        saved = os.dup(2)
        os.dup2(fd, 2)
        try:
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            final.append(said())


def _await_log(said: Callable[[], str], last: str, seconds: float = 5.0) -> None:
    """Wait (at most ``seconds``) until llama.cpp's log, which a thread of its own writes after the call has
    returned, holds the line ``last``."""
    import time

    end = time.monotonic() + seconds
    while last not in said() and time.monotonic() < end:
        time.sleep(0.02)


def _load_error(log: str) -> Optional[str]:
    """llama.cpp's first 'error loading model' reason in its log (``... E llama_model_load: error loading model:
    <reason>``), or None."""
    for line in log.splitlines():
        if "error loading model:" in line:
            return line.split("error loading model:", 1)[1].strip()[:200] or None
    return None


class LlamaCpp:
    name = "llama.cpp"
    gap_share, gap_floor = 0.1, 0.01  # it quantizes activations to 8 bits in its quantized dot products
    steps_per_position = True  # a request per scored position (progress counts them)

    def __init__(self, path: str, n_ctx: int = 512, threads: int = 2, verbosity: int = 1):
        xlc = _xllamacpp()
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
        # sliding-window layers keep every position's keys: with the window-sized cache the server's prefix reuse
        # scores a second prompt wrongly (Gemma 3, gpt-oss: up to 2.7 nats off at every position)
        p.swa_full = True
        self.n_ctx = n_ctx
        self._whole_token = None  # a token whose text is whole UTF-8 (found when first needed)
        with _stderr_kept() as said:
            try:
                self._server = xlc.Server(p)
            except (RuntimeError, ValueError) as e:
                failed = str(e).splitlines()[0][:160]
                _await_log(said, "exiting due to model loading error")
            else:
                failed = None
        if failed is not None:  # (the server says only "Failed to init server"; llama.cpp's log says why)
            why = _load_error(said())
            raise UsageError(f"{path}: llama.cpp cannot load this file ({why or failed})") from None
        if said().strip():  # (a load that worked: whatever llama.cpp said goes where it always went)
            os.write(2, said().encode("utf-8", "replace"))

    def _one(self, ids: Sequence[int], n_probs: int = 1, **extra) -> dict:
        if len(ids) + 1 > self.n_ctx:
            raise ValueError(f"{len(ids)} tokens do not fit a context of {self.n_ctx}")
        r = self._server.handle_completions({"prompt": [int(t) for t in ids], "max_tokens": 1, "temperature": 0.0,
                                             "top_k": 1, "n_probs": n_probs, "post_sampling_probs": False,
                                             "ignore_eos": False, "cache_prompt": True, **extra})
        if "choices" not in r:
            raise RuntimeError(f"llama.cpp: {r.get('error', r)}")
        logprobs = r["choices"][0]["logprobs"]
        return None if logprobs is None else logprobs["content"][0]  # (None: a token ending inside a character)

    def _whole(self, ids: Sequence[int]) -> List[dict]:
        """Every token's log-probability after ``ids``, most likely first, read under a forced token whose text
        is whole (where the sampled or wanted one ends inside a UTF-8 character)."""
        if self._whole_token is None:
            for t in range(1024):  # (byte-level vocabularies begin with the printable ASCII bytes)
                c = self._one(ids[:1], 1, logit_bias=[[t, FORCE]])
                if c is not None and int(c["id"]) == t:
                    self._whole_token = t
                    break
            else:
                raise RuntimeError("llama.cpp: no token among the first 1024 has whole UTF-8 text")
        c = self._one(ids, 1 << 24, logit_bias=[[self._whole_token, FORCE]])  # (the server takes the vocabulary)
        return c["top_logprobs"]

    def greedy_next(self, ids: Sequence[int]) -> int:
        c = self._one(ids)
        return int(c["id"]) if c is not None else int(self._whole(ids)[0]["id"])

    def top(self, ids: Sequence[int], k: int = 5) -> List[Tuple[int, float]]:
        """The ``k`` most likely next tokens with their log-probabilities, most likely first."""
        c = self._one(ids, k)
        top = c["top_logprobs"] if c is not None else self._whole(ids)[:k]
        return [(int(t["id"]), float(t["logprob"])) for t in top]

    def _forced(self, ids: Sequence[int], i: int, k: int) -> dict:
        c = self._one(ids[:i], k, logit_bias=[[int(ids[i]), FORCE]])
        if c is None:
            every = self._whole(ids[:i])
            want = next((t for t in every if int(t["id"]) == int(ids[i])), None)
            if want is None:
                raise RuntimeError(f"llama.cpp could not score token {ids[i]} at position {i}")
            return {"id": int(ids[i]), "logprob": want["logprob"], "top_logprobs": every[:k]}
        if int(c["id"]) != int(ids[i]):
            raise RuntimeError(f"llama.cpp could not score token {ids[i]} at position {i}")
        return c

    def token_logprobs(self, ids: Sequence[int]) -> List[float]:
        """``log p(ids[i] | ids[:i])`` for i = 1 .. len(ids) - 1 (llama.cpp caches the shared prefix)."""
        return [float(self._forced(ids, i, 1)["logprob"]) for i in range(1, len(ids))]

    def distributions(self, ids: Sequence[int], k: int, start: int = 1) -> Distributions:
        """The true-next-token log-probability and top ``k`` of every token from ``ids[start]`` on (``k`` tokens
        cost no more than one: the server sorts the whole vocabulary anyway)."""
        target, top_ids, top_lp = [], [], []
        for i in range(start, len(ids)):
            c = self._forced(ids, i, k)
            target.append(float(c["logprob"]))
            top = c["top_logprobs"]
            top_ids.append([int(t["id"]) for t in top])
            top_lp.append([float(t["logprob"]) for t in top])
        width = min(len(t) for t in top_ids)
        return Distributions(torch.tensor(target, dtype=torch.float64),
                             torch.tensor([t[:width] for t in top_ids], dtype=torch.long),
                             torch.tensor([t[:width] for t in top_lp], dtype=torch.float64))

    def greedy(self, prompt: Sequence[int], n: int, stop: Sequence[int] = ()) -> List[int]:
        """Up to ``n`` greedy tokens after ``prompt``, ending after the first in ``stop``; one request each on the
        cached prefix (the server's own answer groups tokens that end inside a UTF-8 character, so its token list
        is not one entry per token)."""
        ids = [int(t) for t in prompt]
        for _ in range(n):
            ids.append(self.greedy_next(ids))
            if ids[-1] in stop:
                break
        return ids[len(prompt):]

    def perplexity(self, seqs: Iterable[Sequence[int]]) -> float:
        lps = [lp for s in seqs for lp in self.token_logprobs(s)]
        return math.exp(-sum(lps) / len(lps))

    def close(self) -> None:
        self._server = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# vec_dot_type: the 8-bit blocks llama.cpp rounds a quantized matrix's input to before its dot products (ggml's
# type traits): Q8_K (256 values, a float32 scale) for the K-quants and IQ4_XS, Q8_0 (32, a float16 scale) else
_Q8_K_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")


def _q8(x: torch.Tensor, block: int, half_scale: bool) -> torch.Tensor:
    """``x`` rounded as llama.cpp quantizes a dot product's activations: per ``block`` values of its last dimension,
    codes round(x / d) in ±127 with d = amax / 127 (stored in float16 for Q8_0)."""
    v = x.float().unflatten(-1, (x.shape[-1] // block, block))
    d = v.abs().amax(-1, keepdim=True) / 127
    q = torch.round(v * inverse_or_zero(d)).clamp_(-127, 127)
    return (q * (d.half().float() if half_scale else d)).flatten(-2).to(x.dtype)


@contextlib.contextmanager
def llamacpp_activations(model: torch.nn.Module, quantizers_attr: str):
    """Within the block, each Linear of ``model`` whose weight quantizer is on rounds its input as llama.cpp rounds
    a quantized matrix's input (:func:`_q8`): the fake-quant model computing with llama.cpp's 8-bit activations,
    the main part of the runtime's own arithmetic on a GGUF file."""
    handles = []
    for name, module in model.named_modules():
        if name.endswith("kv_b_proj"):  # (DeepSeek's latent attention: llama.cpp absorbs it, attn_k_b in float32)
            continue
        held = getattr(module, quantizers_attr, None) if isinstance(module, torch.nn.Linear) else None
        q = held["weight"] if held is not None and "weight" in held else None
        if q is None or not getattr(q, "enabled", True):
            continue
        kind = str(getattr(q, "scale_dtype", "")).lower()
        width = module.in_features
        block = 256 if kind in _Q8_K_TYPES and width % 256 == 0 else 32
        if width % block:
            continue

        def round_input(_, args, block=block, half=block == 32):
            return (_q8(args[0], block, half),) + tuple(args[1:]) if args else args

        handles.append(module.register_forward_pre_hook(round_input))
    try:
        yield len(handles)
    finally:
        for h in handles:
            h.remove()
