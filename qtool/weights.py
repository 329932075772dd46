"""The weight source: where every exporter gets each weight's values and integer codes.

By default a weight's codes are round-to-nearest on its encoding's grid, from the float checkpoint (what every
exporter did by hand before). A rounding algorithm (GPTQ, AdaRound) or a transform that changes float weights
(batch-norm folding, SmoothQuant) stores what it chose in ``codes.safetensors`` beside ``encodings.json``
(schema version 3, see docs/formats.md), and then every exporter writes those instead:

* ``codes/<quantizer name>``: the integer codes of a weight quantizer, in the weight's shape, in the smallest
  integer dtype of its grid (``int8`` for signed 8-bit, ``uint8`` unsigned, ``int16``/``int32`` up to 16 bits),
  every code within ``[qmin, qmax]``; a float element's codes are ``uint8`` (the FP8 byte, or the FP4 code
  ``sign << 3 | index``);
* ``float/<checkpoint tensor name>``: a float tensor that replaces the checkpoint's (a folded weight or bias, a
  smoothed norm weight), same shape and dtype.

:func:`write_codes` writes the file (streamed, one tensor at a time); :class:`WeightSource` reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from .encodings import CODES_FILE, EncodingEntry, EncodingsFile
from .errors import CheckpointError, EncodingsError
from .io.checkpoint import CheckpointTensors, ST_DTYPES
from .io.finite import all_finite, check_finite
from .io.st_writer import StreamingSafetensorsWriter
from .quant.affine import dequantize, quantize
from .quant import ggml
from .quant.floatgrid import element_of, float_dequantize, float_quantize
from .quant.tensor import AffineEncoding

__all__ = ["WeightSource", "write_codes", "CODES_FILE", "CODES_PREFIX", "FLOAT_PREFIX"]

CODES_PREFIX = "codes/"
FLOAT_PREFIX = "float/"


def _code_dtype(e: EncodingEntry) -> torch.dtype:
    if e.is_float:
        return torch.uint8  # a float element's code: the FP8 byte, or the 4-bit FP4 code
    qmin, qmax = e.qmin_qmax
    return AffineEncoding(torch.zeros(()), torch.zeros(()), qmin, qmax, e.symmetric).int_dtype()


def write_codes(path: Path, entries: List[EncodingEntry], codes: Mapping[str, torch.Tensor],
                floats: Optional[Mapping[str, torch.Tensor]] = None) -> Path:
    """Write stored codes (quantizer name -> integer tensor) and replaced float tensors (checkpoint name ->
    tensor) to ``path``; each code tensor is checked against its entry's grid first."""
    by_name = {e.name: e for e in entries}
    floats = floats or {}
    # each tensor is read twice (checked and declared, then written), so a mapping that keeps its tensors on disk
    # (qtool.io.spill) is never held in memory whole
    decl = []
    for name in sorted(codes):
        e = by_name.get(name)
        if e is None or e.tensor != "weight":
            raise ValueError(f"stored codes for {name!r}, which is no weight quantizer of these encodings")
        qmin, qmax = e.qmin_qmax
        c = codes[name]
        if c.is_floating_point() or (c.numel() and (int(c.min()) < qmin or int(c.max()) > qmax)):
            raise ValueError(f"stored codes for {name!r} must be integers within [{qmin}, {qmax}]")
        decl.append((CODES_PREFIX + name, _code_dtype(e), tuple(c.shape)))
    for key in sorted(floats):
        t = floats[key]
        if not t.is_floating_point():
            raise ValueError(f"replaced tensor {key!r} must hold floats")
        check_finite(key, t, "a rotation, fold or smoothing replaced it from a checkpoint weight that holds NaN/Inf "
                     "or values near float32's limits")
        decl.append((FLOAT_PREFIX + key, t.dtype, tuple(t.shape)))
    with StreamingSafetensorsWriter(Path(path), decl, metadata={"format": "qtool.codes"}) as w:
        for key, dtype, _ in decl:
            if key.startswith(CODES_PREFIX):
                w.write(key, codes[key[len(CODES_PREFIX):]].to(dtype).contiguous())
            else:
                w.write(key, floats[key[len(FLOAT_PREFIX):]].contiguous())
    return Path(path)


class WeightSource:
    """A checkpoint's tensors plus whatever the encodings' codes file stored for them.

    ``keys()``/``shape_dtype()``/``get()`` read the checkpoint one tensor at a time (``get`` returns a stored
    replacement where there is one); :meth:`stored_codes` gives a quantizer's stored codes or None, and
    :meth:`codes` the codes an exporter writes: stored ones, else round-to-nearest of the float weight."""

    def __init__(self, checkpoint: Path, encodings: EncodingsFile, encodings_dir: Optional[Path] = None,
                 trust_pickle: bool = False, tensors: Optional[CheckpointTensors] = None):
        self.checkpoint = Path(checkpoint)
        self.tensors = tensors or CheckpointTensors(self.checkpoint, trust_pickle=trust_pickle)
        self.encodings = encodings
        self._codes: Dict[str, str] = {}
        self._floats: Dict[str, str] = {}
        self._untied: Optional[List[str]] = None
        self._file = None
        if encodings.codes_file is not None:
            self._open(Path(encodings_dir or ".") / encodings.codes_file)

    def _open(self, path: Path) -> None:
        from safetensors import SafetensorError, safe_open

        from .io.checkpoint import check_safetensors

        try:
            check_safetensors(path)
            self._file = safe_open(str(path), framework="pt")
        except (CheckpointError, SafetensorError, OSError) as e:
            raise EncodingsError(f"{path}: not a readable codes file ({str(e).splitlines()[0]})") from None
        self.path = path
        weights = {e.name: e for e in self.encodings.entries if e.tensor == "weight"}
        for key in self._file.keys():
            if key.startswith(CODES_PREFIX) and key[len(CODES_PREFIX):] in weights:
                e = weights[key[len(CODES_PREFIX):]]
                dtype = ST_DTYPES.get(self._file.get_slice(key).get_dtype())
                if dtype != _code_dtype(e):
                    raise EncodingsError(f"{path}: {key} is {dtype}, expected {_code_dtype(e)} for a "
                                         f"{e.bitwidth}-bit {'signed' if e.symmetric else 'unsigned'} grid")
                self._codes[e.name] = key
            elif key.startswith(FLOAT_PREFIX):
                self._floats[key[len(FLOAT_PREFIX):]] = key
            else:
                raise EncodingsError(f"{path}: tensor {key!r} is neither codes/<weight quantizer> nor float/<tensor>")

    # ---- the checkpoint, with stored replacements ----------------------------------------------------------
    def keys(self) -> List[str]:
        """The checkpoint's tensor names, then those a transform added (:meth:`untied`)."""
        return self.tensors.keys() + self.untied()

    def untied(self) -> List[str]:
        """Replaced tensors the checkpoint does not store: a tied parameter (an output layer tied to the embedding
        table) that a transform gave values of its own, so the model written has it as a tensor of its own."""
        if self._untied is None:
            stored = set(self.tensors.keys())
            self._untied = [k for k in sorted(self._floats) if k not in stored]
        return list(self._untied)

    def shape_dtype(self, key: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        if key in self._floats and key in self.untied():  # no checkpoint tensor: the stored one's shape and dtype
            view = self._file.get_slice(self._floats[key])
            return tuple(view.get_shape()), ST_DTYPES[view.get_dtype()]
        return self.tensors.shape_dtype(key)

    def get(self, key: str) -> torch.Tensor:
        if key in self._floats:
            t = self._file.get_tensor(self._floats[key])
            shape, dtype = self.shape_dtype(key)
            if tuple(t.shape) != tuple(shape):
                raise EncodingsError(f"{self.path}: {self._floats[key]} has shape {list(t.shape)}, the checkpoint's "
                                     f"{key} {list(shape)}")
            return t.to(dtype)
        t = self.tensors.get(key)
        if not all_finite(t):
            raise CheckpointError(f"{self.checkpoint}: tensor {key!r} holds NaN/Inf values; an export would "
                                  "write them, so nothing was written")
        return t

    def replaced(self) -> List[str]:
        """Checkpoint tensors whose values come from the codes file."""
        return sorted(self._floats)

    # ---- codes ------------------------------------------------------------------------------------------------
    def has_stored_codes(self, e: EncodingEntry) -> bool:
        return e.name in self._codes

    def stored_codes(self, e: EncodingEntry, shape) -> Optional[torch.Tensor]:
        """``e``'s stored codes (int64, checked against ``shape`` and the grid), or None where none are stored."""
        key = self._codes.get(e.name)
        if key is None:
            return None
        c = self._file.get_tensor(key).to(torch.int64)
        if tuple(c.shape) != tuple(shape):
            raise EncodingsError(f"{self.path}: {key} has shape {list(c.shape)}, the weight {list(shape)}")
        qmin, qmax = e.qmin_qmax
        if c.numel() and (int(c.min()) < qmin or int(c.max()) > qmax):
            raise EncodingsError(f"{self.path}: {key} holds codes outside the grid [{qmin}, {qmax}]")
        return c

    def codes(self, e: EncodingEntry, weight: torch.Tensor) -> torch.Tensor:
        """The integer codes (as quantize() returns them: floats holding integers) to export for weight quantizer
        ``e`` whose float values are ``weight``: stored codes, else round-to-nearest on ``e``'s grid."""
        stored = self.stored_codes(e, tuple(weight.shape))
        if stored is not None:
            return stored.to(torch.float32)
        if e.spec.ggml is not None:
            return ggml.quantize_codes(weight.to(torch.float32), e.ggml_grid()).to(torch.float32)
        scale, offset = e.scale_offset()
        if e.is_float:
            return float_quantize(weight, scale, element_of(e.element), e.block_size).to(torch.float32)
        return self.nearest_codes(e, weight, scale, offset)

    @staticmethod
    def nearest_codes(e: EncodingEntry, weight: torch.Tensor, scale: torch.Tensor,
                      offset: torch.Tensor) -> torch.Tensor:
        """Round-to-nearest codes of integer-grid quantizer ``e`` for ``weight`` under ``scale``/``offset`` (all of
        ``e``'s, or the matching rows of them for a slice of rows: the grid is per row block)."""
        qmin, qmax = e.qmin_qmax
        x = weight if weight.dtype == torch.float64 else weight.to(torch.float32)
        return quantize(x, scale, offset, qmin=qmin, qmax=qmax, block_size=e.block_size)

    @staticmethod
    def dequantize_codes(e: EncodingEntry, codes: torch.Tensor) -> torch.Tensor:
        """The real values (float32) of weight quantizer ``e``'s codes."""
        if e.spec.ggml is not None:
            return ggml.dequantize(codes.to(torch.int32), e.ggml_grid())
        scale, offset = e.scale_offset()
        if e.is_float:
            return float_dequantize(codes.to(torch.int64), scale, element_of(e.element), e.block_size)
        return dequantize(codes.to(torch.float32), scale, offset, block_size=e.block_size)
