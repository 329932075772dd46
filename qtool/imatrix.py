"""llama.cpp's importance matrix, both ways: ``qtool imatrix`` writes the file ``llama-imatrix`` writes (for
``llama-quantize --imatrix``), and ``--imatrix FILE`` takes one as the activation weighting of qtool's scale search.

The file (GGUF, ``general.type = imatrix``): per weight, by its GGUF name (``blk.0.attn_q.weight``),
``<name>.in_sum2`` float32 ``[n_mat, width]`` (the sum over tokens of each input column's x²) and ``<name>.counts``
float32 ``[n_mat, 1]`` (the tokens); keys ``imatrix.datasets``, ``imatrix.chunk_count``, ``imatrix.chunk_size``.
The importance llama-quantize uses is ``in_sum2 / counts``: ``E[x²]`` per column, what qtool's
``weighting: activations`` uses from calibration data. A mixture-of-experts tensor (``ffn_down_exps``) has one row
per expert (``n_mat`` = the experts), each with the tokens routed to that expert. The older binary ``imatrix.dat`` (int32 count; per entry
name length, name, ncall, nval, nval float32 values that are ``E[x²] · ncall``; a trailer) is read too.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch

from .errors import EncodingsError, cut
from .io.finite import storable

__all__ = ["write_imatrix", "read_imatrix"]


def write_imatrix(path: Path, sums: Dict[str, List[Tuple[torch.Tensor, int]]], datasets: List[str],
                  chunk_size: int, chunk_count: int) -> None:
    """``sums`` (GGUF tensor name -> one (sum x² per column, tokens) per matrix: one for a dense weight, one per
    expert in expert order for a stacked expert tensor) as llama-imatrix's GGUF file."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="imatrix")
    writer.add_type(gguf.GGUFType.IMATRIX)
    writer.add_array(gguf.Keys.IMatrix.DATASETS, list(datasets))
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(chunk_count))
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(chunk_size))
    for name in sorted(sums):
        total = torch.stack([t.to(torch.float64) for t, _ in sums[name]])
        total = storable(f"{name}.in_sum2", total, torch.float32,
                         "the model's weights or the data hold NaN/Inf or values near float32's limits")
        writer.add_tensor(f"{name}.in_sum2", total.numpy())
        writer.add_tensor(f"{name}.counts", np.array([[float(c)] for _, c in sums[name]], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_imatrix(path: Path) -> Dict[str, torch.Tensor]:
    """GGUF tensor name -> ``E[x²]`` per input column (float32; ``[experts, columns]`` for a stacked expert
    tensor, all zeros for an expert that saw no token), from a GGUF imatrix or a legacy ``imatrix.dat``.
    Raises ``EncodingsError`` (one line, naming the file) for anything else."""
    path = Path(path)
    try:
        head = path.read_bytes()[:4]
    except OSError as e:
        raise EncodingsError(f"{path}: cannot read the importance matrix: {e.strerror or e}") from None
    if not head:
        raise EncodingsError(f"{path}: an empty file, not a llama.cpp importance matrix (GGUF or imatrix.dat)")
    try:
        if head != b"GGUF" and path.suffix.lower() == ".gguf" and not _dat_count(head):
            # (llama-imatrix writes imatrix.dat under any name it is given: one starting with an entry count is read)
            raise EncodingsError(f"{path}: not a GGUF file (it does not start with GGUF's magic) nor an imatrix.dat "
                                 "(an entry count first), so not an importance matrix llama-imatrix or qtool imatrix "
                                 "writes")
        else:
            out = _read_gguf(path) if head == b"GGUF" else _read_dat(path)
    except (EncodingsError, ImportError):  # (gguf not installed: the CLI names the extra, not the file)
        raise
    except Exception as e:  # noqa: BLE001 - gguf-py's reader raises many kinds on a damaged file: one line each
        said = cut(str(e).splitlines()[0], 100) if str(e) else ""
        raise EncodingsError(f"{path}: not a readable llama.cpp importance matrix (damaged or cut short? "
                             f"{type(e).__name__}: {said})") from None
    for name, v in out.items():
        if not bool(torch.isfinite(v).all()) or bool((v < 0).any()):
            raise EncodingsError(f"{path}: {name}: importances must be finite and non-negative")
    return out


def _dat_count(head: bytes) -> bool:
    """Whether a file's first 4 bytes are an imatrix.dat's entry count."""
    return len(head) == 4 and 0 < struct.unpack("<i", head)[0] <= 1_000_000


def _check_count(path: Path, name: str, count: float) -> None:
    """An entry's token count divides its sums: one that is not a positive number would make its importances
    up (llama.cpp reads a count of 0 as "all ones"), so it is refused, naming the entry."""
    if not (math.isfinite(count) and count > 0):
        why = "this tensor saw no tokens" if count == 0 else "not a positive number"
        raise EncodingsError(f"{path}: {name}: a token count of {count:g} ({why}); measure the importance matrix on "
                             "data that reaches every tensor it names")


def _entry_name(path: Path, name: str) -> str:
    """An entry's tensor name as read from the file, refused unless printable (errors name it on one line)."""
    if not name.isprintable():
        raise EncodingsError(f"{path}: an entry name that is not printable text ({name[:40]!r})")
    return name


def _read_gguf(path: Path) -> Dict[str, torch.Tensor]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {_entry_name(path, t.name): np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    sums = {n[:-len(".in_sum2")]: v for n, v in tensors.items() if n.endswith(".in_sum2")}
    counts = {n[:-len(".counts")]: v for n, v in tensors.items() if n.endswith(".counts")}
    if set(sums) != set(counts):
        odd = sorted(set(sums) ^ set(counts))[0]
        raise EncodingsError(f"{path}: {odd}: an in_sum2 without counts or counts without in_sum2")
    if not sums:
        raise EncodingsError(f"{path}: no importance entries (<weight>.in_sum2 / <weight>.counts tensors)")
    out = {}
    for name, s in sums.items():
        s, c = s.reshape(-1), counts[name].reshape(-1)
        if c.size == 0 or s.size == 0 or s.size % c.size:
            raise EncodingsError(f"{path}: {name}: {s.size} sums for {c.size} counts (one row per matrix)")
        if c.size == 1:
            _check_count(path, name, float(c[0]))
            out[name] = torch.from_numpy((s / c[0]).copy())
            continue
        rows = s.reshape(c.size, -1)  # one row per expert; an expert no token reached keeps zeros
        if not (np.isfinite(c).all() and (c >= 0).all()) or not (c > 0).any():
            raise EncodingsError(f"{path}: {name}: per-expert token counts must be non-negative and not all zero")
        out[name] = torch.from_numpy(np.where(c[:, None] > 0, rows / np.maximum(c[:, None], 1), 0).astype(np.float32))
    return out


def _read_dat(path: Path) -> Dict[str, torch.Tensor]:
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise EncodingsError(f"{path}: ends inside an entry (a truncated imatrix.dat, or not one)")
        vals = struct.unpack_from(fmt, data, pos)
        pos += size
        return vals

    (n,) = take("<i")
    if not _dat_count(data[:4]):
        raise EncodingsError(f"{path}: not a llama.cpp importance matrix (GGUF, or imatrix.dat starting with an "
                             f"entry count; got {n})")
    out = {}
    for _ in range(n):
        (length,) = take("<i")
        if not 0 < length <= 4096:
            raise EncodingsError(f"{path}: an entry name of length {length}")
        name = _entry_name(path, data[pos:pos + length].decode("utf-8"))
        pos += length
        ncall, nval = take("<ii")
        if not 0 < nval <= 1 << 26:
            raise EncodingsError(f"{path}: {name}: {nval} values")
        values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos) if pos + 4 * nval <= len(data) else None
        if values is None:
            raise EncodingsError(f"{path}: ends inside {name}'s values")
        pos += 4 * nval
        _check_count(path, name, float(ncall))
        v = values.astype(np.float32) / ncall
        out[name] = torch.from_numpy(v.copy())
    return out
