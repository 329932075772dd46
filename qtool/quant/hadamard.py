"""Hadamard matrices: orthogonal rotations that spread a few large channels over all of them.

A Hadamard matrix of order ``n`` has entries ±1 and ``H Hᵀ = n I``; ``H / √n`` is orthogonal, so rotating a
model's hidden stream by it leaves the float outputs unchanged while an outlier channel's energy is shared by
every channel (QuaRot, SpinQuant). Orders other than powers of two come from a Paley construction of a small
order ``m`` times a power of two (Kronecker product with Sylvester's matrix), the way compressed-tensors and
QuaRot ship theirs: SmolLM2's 576 = 36 · 16 (Paley II, q = 17), 1536 = 12 · 128 (Paley I, q = 11), Llama-3's
14336 = 28 · 512 (Paley II, q = 13). Orders with no such factorization (e.g. 11008 = 172 · 64: 172 has a
Hadamard matrix, but not a Paley one) raise :class:`HadamardError`.

The small factor is built in exact integer arithmetic and checked (``B Bᵀ = m I``); the Kronecker product with
Sylvester's matrix is applied as butterflies in float64, so the rotation is orthogonal to float64 rounding.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple

import torch

from .affine import true_div
from .precision import exact

__all__ = ["HadamardError", "MAX_BASE_ORDER", "hadamard_order", "hadamard_transform", "rotation_matrix"]

MAX_BASE_ORDER = 256  # the largest Paley order built (its integer matrix is checked; larger ones are not needed)


class HadamardError(ValueError):
    """No Hadamard matrix of the asked order can be built here."""


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    f = 2
    while f * f <= q:
        if q % f == 0:
            return False
        f += 1
    return True


def _paley(m: int) -> Optional[Tuple[str, int]]:
    """``("I", q)`` or ``("II", q)`` where a Paley construction over the prime ``q`` gives order ``m``."""
    if m % 4:
        return None
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return "I", m - 1
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return "II", m // 2 - 1
    return None


def hadamard_order(n: int) -> Tuple[int, int]:
    """``(m, 2^k)`` with ``m · 2^k = n`` and ``m`` 1, 2 or a Paley order (the smallest such ``m``); raises
    :class:`HadamardError` for an ``n`` with none."""
    if n < 1:
        raise HadamardError(f"no Hadamard matrix of order {n}")
    k = (n & -n)  # the largest power of two dividing n
    while k >= 1:
        m = n // k
        if m in (1, 2) or (m <= MAX_BASE_ORDER and _paley(m) is not None):
            return m, k
        k //= 2
    raise HadamardError(f"no Hadamard construction for width {n} (qtool builds m·2^k with m ≤ {MAX_BASE_ORDER} a "
                        f"Paley order: q+1 for a prime q ≡ 3 mod 4, or 2(q+1) for a prime q ≡ 1 mod 4)")


def _legendre(a: int, q: int) -> int:
    a %= q
    if a == 0:
        return 0
    return 1 if pow(a, (q - 1) // 2, q) == 1 else -1


def _paley_matrix(kind: str, q: int) -> torch.Tensor:
    chi = torch.tensor([_legendre(a, q) for a in range(q)], dtype=torch.int64)
    idx = torch.arange(q)
    jacobsthal = chi[(idx[None, :] - idx[:, None]) % q]  # Q[i, j] = χ(j − i)
    ones = torch.ones(q, dtype=torch.int64)
    if kind == "I":  # I + S, S = [[0, 1ᵀ], [−1, Q]] skew-symmetric with S Sᵀ = q I
        s = torch.zeros(q + 1, q + 1, dtype=torch.int64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = ones, -ones, jacobsthal
        return torch.eye(q + 1, dtype=torch.int64) + s
    # II: the symmetric conference matrix C = [[0, 1ᵀ], [1, Q]], each entry replaced by a 2×2 block
    c = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = ones, ones, jacobsthal
    zero = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int64)
    unit = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    blocks = torch.where((c == 0)[:, :, None, None], zero, c[:, :, None, None] * unit)
    return blocks.permute(0, 2, 1, 3).reshape(2 * (q + 1), 2 * (q + 1))


@lru_cache(maxsize=32)
def _base(m: int) -> torch.Tensor:
    """The integer Hadamard matrix of the small order ``m`` (1, 2 or Paley), checked: ``B Bᵀ = m I``."""
    if m == 1:
        b = torch.ones(1, 1, dtype=torch.int64)
    elif m == 2:
        b = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    else:
        b = _paley_matrix(*_paley(m))
    if not torch.equal(b @ b.T, m * torch.eye(m, dtype=torch.int64)):  # a construction bug, never a user's input
        raise AssertionError(f"Hadamard construction of order {m} is not orthogonal")
    return b


@lru_cache(maxsize=32)
def _signs(n: int, seed: int) -> torch.Tensor:  # cached: an online rotation asks on every call (never mutated)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).mul(2).sub(1).to(torch.float64)


def hadamard_transform(x: torch.Tensor, kind: str = "hadamard", seed: int = 0,
                       compute: torch.dtype = torch.float64, inverse: bool = False) -> torch.Tensor:
    """``x @ R`` over the last dimension (width ``n``) for the orthogonal rotation ``R`` of :func:`rotation_matrix`,
    without forming ``R``: ``H = S ⊗ B`` (Sylvester's ``S`` of order ``2^k``, ``B`` of order ``m``), so ``x`` is
    viewed as ``(…, 2^k, m)``, multiplied by ``B`` and then butterflied over the ``2^k`` axis (a fast
    Walsh-Hadamard transform): ``O(n (m + log n))`` per row. Computed in ``compute`` (float64 for weights fused
    once; an online rotation of activations uses float32, as compressed-tensors does); returns ``x``'s dtype.
    ``inverse``: ``x @ Rᵀ`` (undoes the rotation: ``Bᵀ`` for ``B``, the random signs applied last)."""
    n = int(x.shape[-1])
    m, k = hadamard_order(n)
    y = x.to(compute)
    if kind not in ("hadamard", "random-hadamard"):
        raise ValueError(f"unknown rotation type {kind!r}")
    signs = _signs(n, seed).to(y.device, compute) if kind == "random-hadamard" else None
    if signs is not None and not inverse:
        y = y * signs
    lead = y.shape[:-1]
    if m > 1:  # the small factor (an identity for powers of two)
        base = _base(m).to(y.device, compute)
        with exact():  # float32 products even inside a data pass at a lower --matmul-precision
            y = y.reshape(-1, k, m) @ (base.T if inverse else base)
    h = 1
    while h < k:  # butterflies: pairs (i, i + h) within each block of 2h rows
        y = y.reshape(-1, k // (2 * h), 2, h, m)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = true_div(y.reshape(*lead, n), n ** 0.5)
    if signs is not None and inverse:
        y = y * signs
    return y.to(x.dtype)


def rotation_matrix(n: int, kind: str = "hadamard", seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthogonal rotation of order ``n`` as a dense matrix: ``hadamard`` is ``H / √n``; ``random-hadamard`` is
    ``diag(s) · H / √n`` with ``s`` random signs from ``seed`` (QuaRot's randomized Hadamard: still orthogonal,
    with no fixed channel pattern). For tests and small orders; rotate data with :func:`hadamard_transform`."""
    return hadamard_transform(torch.eye(n, dtype=torch.float64), kind, seed).to(dtype)
