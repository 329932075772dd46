"""Dense packing of 1- to 8-bit integer codes, as pure tensor functions (no I/O, exact round trips).

Two layouts:

* **Byte stream** (``pack_bytes`` / ``unpack_bytes``): the codes, flattened row-major, are written into one bit
  stream least-significant bit first: element ``i`` occupies bits ``i*b .. i*b+b-1`` of the stream and byte ``k``
  holds stream bits ``8k .. 8k+7``. For 4 bits this is two values per byte with the first element in the low
  nibble -- ONNX's int4/uint4 layout and qtool's own sub-byte format. Signed codes are stored as ``b``-bit two's
  complement; the last byte is zero-padded. 8 bits is a plain byte copy.
* **compressed-tensors ``pack-quantized``** (``pack_int32`` / ``unpack_int32``): per row of a 2-D tensor, signed
  codes are shifted to unsigned by ``+2**(b-1)``, element ``i`` of the row goes to bit ``i*b`` of the row's own
  bit stream (least-significant first, rows padded separately) and the stream is cut into int32 words (word
  ``j`` = stream bits ``32j .. 32j+31``, two's complement), giving ``(rows, ceil(cols*b/32))``. This is
  ``compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32`` bit for bit (values never straddle a
  word boundary only when ``b`` divides 32; for 3/5/6/7 bits they do, as there). ``packed_dim=0`` packs columns
  instead (compressed-tensors packs asymmetric zero points that way).

Every function works on any device and never depends on the host's byte order.
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple, Union

import torch

__all__ = ["pack_bytes", "unpack_bytes", "pack_int32", "unpack_int32", "packed_numel"]

ShapeLike = Union[int, Sequence[int], torch.Size]


def _check_bits(bitwidth: int, lo: int = 1, hi: int = 8) -> int:
    if isinstance(bitwidth, bool) or not isinstance(bitwidth, int) or not lo <= bitwidth <= hi:
        raise ValueError(f"bitwidth must be an integer in {lo}..{hi}, got {bitwidth!r}")
    return bitwidth


def _as_int64(codes: torch.Tensor) -> torch.Tensor:
    if not isinstance(codes, torch.Tensor):
        codes = torch.as_tensor(codes)
    if codes.dtype == torch.bool or codes.is_complex():
        raise TypeError(f"codes must be an integer (or integral float) tensor, got {codes.dtype}")
    if codes.is_floating_point():
        if not torch.isfinite(codes).all() or not torch.equal(codes, torch.round(codes)):
            raise ValueError("floating-point codes must hold whole numbers")
    return codes.to(torch.int64)


def _check_range(v: torch.Tensor, bitwidth: int, signed) -> None:
    if v.numel() == 0:
        return
    if signed is None:  # either interpretation is fine for packing; only the union is checked
        lo, hi = -(1 << (bitwidth - 1)), (1 << bitwidth) - 1
    elif signed:
        lo, hi = -(1 << (bitwidth - 1)), (1 << (bitwidth - 1)) - 1
    else:
        lo, hi = 0, (1 << bitwidth) - 1
    mn, mx = int(v.min()), int(v.max())
    if mn < lo or mx > hi:
        kind = {None: "", True: "signed ", False: "unsigned "}[signed]
        raise ValueError(f"codes {mn}..{mx} do not fit the {kind}{bitwidth}-bit range {lo}..{hi}")


def packed_numel(numel: int, bitwidth: int) -> int:
    """Bytes that ``pack_bytes`` produces for ``numel`` codes of ``bitwidth`` bits."""
    return (int(numel) * _check_bits(bitwidth) + 7) // 8


# elements handled per step: bounds the int64 temporaries (about 30 bytes per element) for big weights
_CHUNK = 1 << 20


def _pack_rows_u8(u: torch.Tensor, b: int) -> torch.Tensor:
    """``u``: int64 ``(rows, n)`` holding unsigned ``b``-bit values -> uint8 ``(rows, ceil(n*b/8))``."""
    rows, n = u.shape
    if rows * n > _CHUNK:
        if rows > 1:  # whole rows at a time
            step = max(1, _CHUNK // max(n, 1))
            return torch.cat([_pack_rows_u8(u[i:i + step], b) for i in range(0, rows, step)], dim=0)
        if n > _CHUNK:  # one long row: pieces of a multiple of 8 values pack to whole bytes
            return torch.cat([_pack_rows_u8(u[:, i:i + _CHUNK], b) for i in range(0, n, _CHUNK)], dim=1)
    nbytes = (n * b + 7) // 8
    if b == 8:
        return u.to(torch.uint8)
    # 8 values of b bits make exactly b bytes (8b bits, at most 56 < 63: fits an int64 without sign trouble)
    pad = (-n) % 8
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    g = u.reshape(rows, -1, 8)
    shifts = torch.arange(8, device=u.device, dtype=torch.int64) * b
    word = (g << shifts).sum(dim=-1)  # disjoint bit ranges: sum == bitwise or
    byte_shifts = torch.arange(b, device=u.device, dtype=torch.int64) * 8
    out = ((word.unsqueeze(-1) >> byte_shifts) & 0xFF).reshape(rows, -1)
    return out[:, :nbytes].to(torch.uint8)


def _unpack_rows_u8(p: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Inverse of ``_pack_rows_u8``: uint8 ``(rows, >= ceil(n*b/8))`` -> int64 ``(rows, n)`` unsigned values."""
    rows = p.shape[0]
    if rows * n > _CHUNK:
        if rows > 1:
            step = max(1, _CHUNK // max(n, 1))
            return torch.cat([_unpack_rows_u8(p[i:i + step], b, n) for i in range(0, rows, step)], dim=0)
        if n > _CHUNK:  # _CHUNK values (a multiple of 8) occupy exactly _CHUNK * b / 8 bytes
            per = _CHUNK * b // 8
            parts = [_unpack_rows_u8(p[:, j * per:(j + 1) * per], b, min(_CHUNK, n - i))
                     for j, i in enumerate(range(0, n, _CHUNK))]
            return torch.cat(parts, dim=1)
    p = p.to(torch.int64)
    if b == 8:
        return p[:, :n]
    nbytes = (n * b + 7) // 8
    p = p[:, :nbytes]
    pad = (-nbytes) % b
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    g = p.reshape(rows, -1, b)
    byte_shifts = torch.arange(b, device=p.device, dtype=torch.int64) * 8
    word = (g << byte_shifts).sum(dim=-1)
    shifts = torch.arange(8, device=p.device, dtype=torch.int64) * b
    vals = (word.unsqueeze(-1) >> shifts) & ((1 << b) - 1)
    return vals.reshape(rows, -1)[:, :n]


def _sign_extend(u: torch.Tensor, b: int) -> torch.Tensor:
    half = 1 << (b - 1)
    return torch.where(u >= half, u - (1 << b), u)


# --------------------------------------------------------------------------------------------------------------
# Byte stream (ONNX int4 / qtool sub-byte)
# --------------------------------------------------------------------------------------------------------------
def pack_bytes(codes: torch.Tensor, bitwidth: int, signed: bool | None = None) -> torch.Tensor:
    """Pack integer codes (any shape, flattened row-major) into a flat ``uint8`` stream, LSB first.

    ``signed`` only selects the range check (``None`` accepts ``-2**(b-1) .. 2**b - 1``); negative codes are stored
    as ``b``-bit two's complement. Raises ``ValueError`` for codes outside the range.
    """
    b = _check_bits(bitwidth)
    v = _as_int64(codes).reshape(-1)
    _check_range(v, b, signed)
    u = v & ((1 << b) - 1)
    return _pack_rows_u8(u.reshape(1, -1), b).reshape(-1)


def _shape_of(numel_or_shape: ShapeLike) -> Tuple[int, ...]:
    if isinstance(numel_or_shape, int) and not isinstance(numel_or_shape, bool):
        return (int(numel_or_shape),)
    return tuple(int(d) for d in numel_or_shape)


def unpack_bytes(packed: torch.Tensor, bitwidth: int, numel_or_shape: ShapeLike, signed: bool) -> torch.Tensor:
    """Inverse of ``pack_bytes``: the codes as ``int8`` (signed, or unsigned up to 7 bits), ``uint8`` (unsigned
    8-bit) with the given shape (a number gives a flat tensor)."""
    b = _check_bits(bitwidth)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    shape = _shape_of(numel_or_shape)
    n = math.prod(shape)
    need = (n * b + 7) // 8
    if packed.numel() < need:
        raise ValueError(f"{n} codes of {b} bits need {need} bytes, got {packed.numel()}")
    u = _unpack_rows_u8(packed.reshape(1, -1), b, n).reshape(-1)
    if signed:
        return _sign_extend(u, b).to(torch.int8).reshape(shape)
    return u.to(torch.uint8 if b == 8 else torch.int8).reshape(shape)


# --------------------------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized (int32 words per row)
# --------------------------------------------------------------------------------------------------------------
def _words_from_bytes(by: torch.Tensor) -> torch.Tensor:
    """uint8 ``(rows, 4k)`` -> int32 ``(rows, k)``, little-endian words, independent of the host byte order."""
    rows = by.shape[0]
    g = by.to(torch.int64).reshape(rows, -1, 4)
    word = (g << torch.tensor([0, 8, 16, 24], device=by.device, dtype=torch.int64)).sum(dim=-1)
    word = torch.where(word >= (1 << 31), word - (1 << 32), word)
    return word.to(torch.int32)


def _bytes_from_words(w: torch.Tensor) -> torch.Tensor:
    rows = w.shape[0]
    w = w.to(torch.int64) & 0xFFFFFFFF
    by = (w.unsqueeze(-1) >> torch.tensor([0, 8, 16, 24], device=w.device, dtype=torch.int64)) & 0xFF
    return by.reshape(rows, -1).to(torch.uint8)


def pack_int32(codes: torch.Tensor, bitwidth: int, signed: bool = True, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors ``pack-quantized``: a 2-D tensor of codes -> int32 ``(rows, ceil(cols*b/32))``.

    With ``signed=True`` (compressed-tensors' own convention) the codes must lie in ``-2**(b-1) .. 2**(b-1)-1``
    and are stored shifted by ``+2**(b-1)``; with ``signed=False`` unsigned codes ``0 .. 2**b-1`` are stored as
    they are (the same bits as their signed counterpart ``code - 2**(b-1)`` packed with ``signed=True``).
    ``packed_dim=0`` packs along the first dim instead (result ``(ceil(rows*b/32), cols)``).
    """
    b = _check_bits(bitwidth)
    v = _as_int64(codes)
    if v.dim() != 2:
        raise ValueError(f"pack_int32 packs a 2-D tensor, got shape {tuple(v.shape)}")
    if packed_dim not in (0, 1):
        raise ValueError(f"packed_dim must be 0 or 1, got {packed_dim!r}")
    _check_range(v, b, signed)
    if packed_dim == 0:
        v = v.t()
    u = v + (1 << (b - 1)) if signed else v
    rows, cols = u.shape
    words = (cols * b + 31) // 32
    by = _pack_rows_u8(u, b)
    by = torch.nn.functional.pad(by, (0, 4 * words - by.shape[1]))
    out = _words_from_bytes(by)
    return (out.t() if packed_dim == 0 else out).contiguous()


def unpack_int32(
    packed: torch.Tensor, bitwidth: int, shape: ShapeLike, signed: bool = True, packed_dim: int = 1
) -> torch.Tensor:
    """Inverse of ``pack_int32``: ``shape`` is the original 2-D shape (or, for ``packed_dim=1``, just the number of
    columns). Returns ``int8`` codes (``signed=True``), or ``uint8`` unsigned codes (``signed=False``)."""
    b = _check_bits(bitwidth)
    if packed.dtype != torch.int32:
        raise TypeError(f"packed must be int32, got {packed.dtype}")
    if packed.dim() != 2:
        raise ValueError(f"unpack_int32 takes a 2-D tensor, got shape {tuple(packed.shape)}")
    if packed_dim not in (0, 1):
        raise ValueError(f"packed_dim must be 0 or 1, got {packed_dim!r}")
    shape_t = _shape_of(shape)
    if len(shape_t) == 1:
        if packed_dim != 1:
            raise ValueError("with packed_dim=0 give the full original shape")
        shape_t = (packed.shape[0], shape_t[0])
    if len(shape_t) != 2:
        raise ValueError(f"shape must be 2-D, got {shape_t}")
    p = packed.t() if packed_dim == 0 else packed
    rows, n = (shape_t[1], shape_t[0]) if packed_dim == 0 else shape_t
    words = (n * b + 31) // 32
    if p.shape[0] != rows or p.shape[1] < words:
        raise ValueError(f"packed shape {tuple(packed.shape)} does not hold a {b}-bit tensor of shape {shape_t}")
    u = _unpack_rows_u8(_bytes_from_words(p[:, :words]), b, n)
    out = (u - (1 << (b - 1))).to(torch.int8) if signed else u.to(torch.uint8)
    return (out.t() if packed_dim == 0 else out).contiguous()
