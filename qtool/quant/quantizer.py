"""Quantizer modules: ``QuantizeDequantize`` (fake-quant) and ``Quantize``.

A quantizer stores its range as learnable ``min`` / ``max`` parameters of the encoding ``shape``; scale and
offset are derived from them on every call (so gradients reach min/max). Calibration::

    q = QuantizeDequantize((out, 1), bitwidth=8, symmetric=True)
    with q.compute_encodings():
        for batch in data:
            q(batch)          # statistics go to the analyzer; the batch is quantized with its own range
    q.is_initialized()        # True: min/max were set on exit
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

import torch
from torch import nn

from ..choices import check_scale_dtype, weighs_activations
from .affine import (
    batch_scale_offset,
    dynamic_scale_offset,
    grid,
    min_max_to_scale_offset,
    quantize,
    quantize_dequantize,
    resolve_block_size,
    scale_offset_of_numbers,
    snap_to_float16_scale,
    to_input_dtype,
)
from .analyzers import EncodingAnalyzer, MinMaxEncodingAnalyzer, MinMaxStatistics, MseEncodingAnalyzer
from .floatgrid import (dynamic_float_scales, element_of, encoding_scales, float_quantize_dequantize,
                        global_scale, search_amax)
from .ggml import CLIP_RATIOS, GgmlType, KGrid, grid_from_range, search_range, weighted_steps
from .ggml import quantize_dequantize as ggml_quantize_dequantize
from .tensor import AffineEncoding, DequantizedTensor, QuantizedTensor

if TYPE_CHECKING:
    from .spec import QuantSpec

__all__ = ["QuantizerBase", "QuantizeDequantize", "Quantize", "DynamicQuantizeDequantize",
           "FloatQuantizeDequantize", "DynamicFloatQuantizeDequantize", "GgmlQuantizeDequantize",
           "UninitializedQuantizerError"]


class UninitializedQuantizerError(RuntimeError):
    """A quantizer was used before its range was calibrated or set."""


def _module_grid(bitwidth, symmetric: bool):
    """``(qmin, qmax)`` of a quantizer module's grid, whose bit width is a recipe's (2 to 16): a 1-bit symmetric
    grid has no positive step (its range would divide by zero), and beyond 16 bits float32 no longer holds every
    code and offset sum exactly."""
    from .spec import MAX_BITWIDTH, MIN_BITWIDTH

    if isinstance(bitwidth, bool) or int(bitwidth) != bitwidth or not MIN_BITWIDTH <= bitwidth <= MAX_BITWIDTH:
        raise ValueError(f"bitwidth must be an integer from {MIN_BITWIDTH} to {MAX_BITWIDTH}, got {str(bitwidth)[:40]}")
    return grid(int(bitwidth), signed=bool(symmetric))


class QuantizerBase(nn.Module):
    spec: Optional["QuantSpec"] = None  # what grid it is, as the plan row said (set by model.insert.make_quantizer)

    def __init__(
        self,
        shape: Sequence[int],
        bitwidth: int,
        symmetric: bool,
        encoding_analyzer: Optional[EncodingAnalyzer] = None,
        block_size: Optional[Sequence[int]] = None,
        scale_dtype: str = "float32",
    ):
        super().__init__()
        shape = tuple(int(d) for d in shape)
        self.shape = shape
        self.qmin, self.qmax = _module_grid(bitwidth, symmetric)
        self.bitwidth = int(bitwidth)
        self.symmetric = bool(symmetric)
        if block_size is not None:
            block_size = tuple(int(b) for b in block_size)
            if len(block_size) != len(shape):
                raise ValueError(f"block_size {block_size} must have one entry per encoding dim {shape}")
        self.block_size = block_size
        check_scale_dtype(scale_dtype, self.bitwidth, self.symmetric)
        self.scale_dtype = scale_dtype  # "float16": calibrated ranges are snapped to float16 scales
        self.encoding_analyzer = encoding_analyzer or MinMaxEncodingAnalyzer(shape, block_size)
        with torch.inference_mode(False):  # (built under inference_mode they would have no version to mark)
            self.min = nn.Parameter(torch.zeros(shape, dtype=torch.float32))  # (whatever the default dtype)
            self.max = nn.Parameter(torch.zeros(shape, dtype=torch.float32))
        self._calibrating = False
        self.enabled = True  # False: pass inputs through unchanged (for error analysis)
        self._mark_uninitialized()

    # ---- initialization state: a parameter counts as set once replaced or written in place -------------------
    def _param_marker(self, name: str):
        p = self._parameters[name]
        return None if p is None else (id(p), p._version)

    def _mark_uninitialized(self) -> None:
        self._uninit_markers = {name: self._param_marker(name) for name in ("min", "max")}

    def is_initialized(self) -> bool:
        return all(self._param_marker(n) != m for n, m in self._uninit_markers.items())

    # a copy or an unpickled quantizer holds new parameters (new ids): which were set travels by name instead
    def __getstate__(self):
        state = super().__getstate__()
        state["_uninit_markers"] = [n for n, m in self._uninit_markers.items() if self._param_marker(n) == m]
        return state

    def __setstate__(self, state):
        unset = state.pop("_uninit_markers", [])
        if isinstance(unset, dict):  # (a quantizer pickled before names were kept: it came back initialized)
            unset = []
        super().__setstate__(state)
        self._uninit_markers = {name: self._param_marker(name) for name in unset}

    @torch.no_grad()
    def set_range(self, min: torch.Tensor, max: torch.Tensor) -> None:
        """Set the stored range by hand (same as calibrating to it)."""
        self.min.copy_(torch.as_tensor(min, dtype=self.min.dtype).expand(self.shape))
        self.max.copy_(torch.as_tensor(max, dtype=self.max.dtype).expand(self.shape))

    # ---- derived encoding ---------------------------------------------------------------------------------------
    def _require_initialized(self) -> None:
        if not self.is_initialized():
            raise UninitializedQuantizerError(
                f"{type(self).__name__}(shape={self.shape}, bitwidth={self.bitwidth}) is not initialized: "
                "calibrate it inside compute_encodings() or set min/max first"
            )

    def _scale_offset(self, mn: torch.Tensor, mx: torch.Tensor):
        return min_max_to_scale_offset(mn, mx, self.qmin, self.qmax, self.symmetric)

    def get_scale(self) -> Optional[torch.Tensor]:
        return self._scale_offset(self.min, self.max)[0] if self.is_initialized() else None

    def get_offset(self) -> Optional[torch.Tensor]:
        return self._scale_offset(self.min, self.max)[1] if self.is_initialized() else None

    def get_encodings(self) -> Optional[AffineEncoding]:
        if not self.is_initialized():
            return None
        with torch.no_grad():
            scale, offset = self._scale_offset(self.min, self.max)
        return AffineEncoding(scale, offset, self.qmin, self.qmax, self.symmetric, self.block_size)

    def check_input(self, x: torch.Tensor) -> None:
        """Raise ``ValueError`` if this quantizer's shape/block_size cannot apply to ``x``."""
        resolve_block_size(x.shape, self.shape, self.block_size)

    # ---- calibration --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def compute_encodings(self):
        """Feed every input seen inside the block to the analyzer; set min/max on a clean exit."""
        self.encoding_analyzer.reset_stats()
        self._calibrating = True
        try:
            yield self
        except BaseException:
            self._calibrating = False
            _last_call.clear()
            raise
        self._calibrating = False
        _last_call.clear()
        if self.encoding_analyzer.has_stats():
            mn, mx = self._calibrated_range()
            with torch.no_grad():
                self.min.copy_(mn.to(self.min.device))
                self.max.copy_(mx.to(self.max.device))
        self.encoding_analyzer.reset_stats()

    def _calibrated_range(self):
        """The ``(min, max)`` to store from the analyzer's statistics when calibration ends."""
        mn, mx = self.encoding_analyzer.compute_encodings(self.qmax - self.qmin, self.symmetric)
        if self.scale_dtype == "float16":
            mn, mx = snap_to_float16_scale(mn, mx, self.qmin, self.qmax, self.symmetric)
        return mn, mx

    @torch.no_grad()
    def observe(self, x: torch.Tensor, importance: Optional[torch.Tensor] = None) -> None:
        """Feed ``x`` to the analyzer only (inside ``compute_encodings``): the statistics a forward call would
        collect, without computing its output. ``importance`` (broadcastable to ``x``) goes to analyzers whose
        search is weighted. Raises ``ValueError`` if this quantizer cannot apply to ``x``."""
        if not self._calibrating:
            raise RuntimeError("observe() is only meaningful inside compute_encodings()")
        self.check_input(x)
        if x.numel() == 0:
            return
        if importance is None:
            self.encoding_analyzer.update_stats(x)
        else:
            self.encoding_analyzer.update_stats(x, importance=importance)

    def _range_for_call(self, x: torch.Tensor):
        if self._calibrating:
            stats = self.encoding_analyzer.update_stats(x)
            return self.encoding_analyzer.compute_dynamic_encodings(stats, self.qmax - self.qmin, self.symmetric)
        self._require_initialized()
        return self.min, self.max

    def extra_repr(self) -> str:
        return (
            f"shape={self.shape}, bitwidth={self.bitwidth}, symmetric={self.symmetric}"
            + (f", block_size={self.block_size}" if self.block_size is not None else "")
            + (f", scale_dtype={self.scale_dtype}" if self.scale_dtype != "float32" else "")
        )


class _CalibrationCall(NamedTuple):
    """One calibration call of a min-max ``QuantizeDequantize``: what it read and what it made of it."""

    input: "weakref.ref[torch.Tensor]"
    input_version: int
    key: tuple
    stats: MinMaxStatistics
    out: torch.Tensor
    out_version: int
    encoding: AffineEncoding


class _LastCalibrationCall:
    """The last shareable calibration call of a min-max ``QuantizeDequantize``, for the next quantizer of the same
    settings that reads the very same tensor (a transformer's q, k and v projections, and gate and up, read one
    hidden state; AIMET gives each its own quantizer). The statistics and the output of such a call are a function
    of the tensor and the settings alone, so the next quantizer folds the same statistics and returns the same
    output (the same storage: callers ask for sharing only where the output is read and dropped, as a Linear's or
    a convolution's input is) instead of computing them again: the same bits, one range and one fake-quant pass
    instead of three.

    The tensor must be unchanged since (its version counter: writes through ``.data`` or by foreign kernels do not
    count, and no qtool path makes them between two layers' reads), and so must the output. The tensor is held
    weakly, and the call is dropped when the tensor dies, when a quantizer leaves ``compute_encodings``, or at the
    next shareable call."""

    def __init__(self):
        self.call: Optional[_CalibrationCall] = None

    def matching(self, x: torch.Tensor, key: tuple) -> Optional[_CalibrationCall]:
        c = self.call
        if (c is None or c.input() is not x or c.key != key or c.input_version != x._version
                or c.out_version != c.out._version):
            return None
        return c

    def keep(self, x: torch.Tensor, key: tuple, stats: MinMaxStatistics, out: torch.Tensor,
             encoding: AffineEncoding) -> None:
        def dropped(ref):
            c = self.call
            if c is not None and c.input is ref:
                self.call = None

        self.call = _CalibrationCall(weakref.ref(x, dropped), x._version, key, stats, out, out._version, encoding)

    def clear(self) -> None:
        self.call = None


_last_call = _LastCalibrationCall()


class QuantizeDequantize(QuantizerBase):
    """Fake quantization: returns ``dequantize(quantize(x))`` as a ``DequantizedTensor`` in ``x``'s dtype."""

    def forward(self, x: torch.Tensor, output_read_only: bool = False) -> DequantizedTensor:
        """``output_read_only``: the caller only reads the output and drops it (it feeds a Linear or a
        convolution), so while calibrating the output may be the one an earlier quantizer of the same settings made
        from the very same tensor (``_LastCalibrationCall``)."""
        if not self.enabled or (self._calibrating and x.numel() == 0):
            return x  # (an empty batch, such as a mixture-of-experts expert no token reached, has no range to learn)
        key = self._shared_call_key(x) if output_read_only else None
        if key is not None:
            call = _last_call.matching(x, key)
            if call is not None:
                self.encoding_analyzer.fold(call.stats)
                return DequantizedTensor.wrap(call.out, call.encoding)
        given, x = x, x.as_subclass(torch.Tensor)
        if key is None and not self._min_max_numbers(x) and not self._min_max_batches():
            mn, mx = self._range_for_call(x)
            return self._fake_quant(x, *self._scale_offset(mn, mx))[0]
        stats = self.encoding_analyzer.collect(x)  # update_stats(x) is fold(collect(x)), and returns batch_range
        self.encoding_analyzer.fold(stats)
        wrapped, out, enc = self._fake_quant(x, *self._scale_offset_of_batch(x, stats))
        if key is not None:
            _last_call.keep(given, key, stats, out, enc)
        return wrapped

    def _min_max_numbers(self, x: torch.Tensor) -> bool:
        """Whether this calibration call's one range can be worked out as numbers (``scale_offset_of_numbers``,
        the same bits as the tensor functions): a min-max analyzer with one encoding, on the CPU, without
        gradients, a grid of 2 to 16 bits."""
        analyzer = self.encoding_analyzer
        return (self._calibrating and self.shape == () and self.block_size is None and x.device.type == "cpu"
                and 2 <= self.bitwidth <= 16 and not torch.is_grad_enabled()
                and type(analyzer) is MinMaxEncodingAnalyzer and analyzer.shape == () and analyzer.block_size is None)

    def _min_max_batches(self) -> bool:
        """Whether this calibration call's range is a min-max analyzer's batch range, without gradients, and its
        scale and offset AIMET's: they come from ``batch_scale_offset`` (fewer GPU kernel launches, the same
        bits)."""
        return (self._calibrating and not torch.is_grad_enabled()
                and type(self.encoding_analyzer) is MinMaxEncodingAnalyzer
                and type(self)._scale_offset is QuantizerBase._scale_offset
                and type(self)._range_for_call is QuantizerBase._range_for_call)

    def _scale_offset_of_batch(self, x: torch.Tensor, stats: MinMaxStatistics):
        """``(scale, offset)`` of one batch's min-max statistics of ``x``: as numbers where ``_min_max_numbers``
        allows and the range is not NaN, else by the tensor functions."""
        if self._min_max_numbers(x):
            lo, hi = stats.min.item(), stats.max.item()
            if lo == lo and hi == hi:  # scale_offset_of_numbers takes no NaN
                scale, offset = scale_offset_of_numbers(lo, hi, self.qmin, self.qmax, self.symmetric)
                return (torch.scalar_tensor(float(scale), dtype=torch.float32),
                        torch.scalar_tensor(float(offset), dtype=torch.float32))
        analyzer = self.encoding_analyzer
        if self._min_max_batches():  # the bits of the two steps below in fewer tensor operations
            return batch_scale_offset(stats.min, stats.max, self.qmin, self.qmax, self.symmetric)
        return self._scale_offset(*analyzer.compute_dynamic_encodings(analyzer.batch_range(stats),
                                                                      self.qmax - self.qmin, self.symmetric))

    def _fake_quant(self, x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor):
        out = quantize_dequantize(x, scale, offset, qmin=self.qmin, qmax=self.qmax, block_size=self.block_size)
        enc = AffineEncoding(scale.detach(), offset.detach(), self.qmin, self.qmax, self.symmetric, self.block_size)
        return DequantizedTensor.wrap(out, enc), out, enc

    def _shared_call_key(self, x: torch.Tensor) -> Optional[tuple]:
        """The settings a calibration call's result depends on besides its input, where that result may be shared
        with the next quantizer of the same settings (``_LastCalibrationCall``); None where it may not: outside
        calibration, with gradients or inference tensors (no version counter), a weight, another analyzer (a
        rank's recorder too) or a subclass."""
        if (not self._calibrating or torch.is_grad_enabled() or torch.is_inference_mode_enabled()
                or x.is_inference() or isinstance(x, nn.Parameter) or type(self) is not QuantizeDequantize
                or type(self.encoding_analyzer) is not MinMaxEncodingAnalyzer):
            return None
        analyzer = self.encoding_analyzer
        return (self.bitwidth, self.symmetric, self.shape, self.block_size, analyzer.shape, analyzer.block_size)


class Quantize(QuantizerBase):
    """Quantization: returns the integer codes (as floats) in a ``QuantizedTensor``."""

    def forward(self, x: torch.Tensor) -> QuantizedTensor:
        if self._calibrating and x.numel() == 0:
            return x  # (an empty batch has no range to learn)
        x = x.as_subclass(torch.Tensor)
        mn, mx = self._range_for_call(x)
        scale, offset = self._scale_offset(mn, mx)
        out = quantize(x, scale, offset, qmin=self.qmin, qmax=self.qmax, block_size=self.block_size)
        enc = AffineEncoding(scale.detach(), offset.detach(), self.qmin, self.qmax, self.symmetric, self.block_size)
        return QuantizedTensor.wrap(out, enc)


class DynamicQuantizeDequantize(nn.Module):
    """Fake quantization with a range computed from each call's own values (``per_token``: one range per token,
    i.e. per position of every dimension but the last; else one per call). Nothing is calibrated and nothing is
    stored: it is always initialized, and ``compute_encodings`` leaves it as it is. Returns a plain tensor in
    ``x``'s dtype (the encoding differs per token, so there is no one ``AffineEncoding`` to attach)."""

    dynamic = True
    spec: Optional["QuantSpec"] = None  # what grid it is, as the plan row said (set by model.insert.make_quantizer)

    def __init__(self, bitwidth: int, symmetric: bool, per_token: bool):
        super().__init__()
        self.qmin, self.qmax = _module_grid(bitwidth, symmetric)
        self.bitwidth = int(bitwidth)
        self.symmetric = bool(symmetric)
        self.per_token = bool(per_token)
        self.shape = ()
        self.block_size = None
        self.scale_dtype = "float32"
        self.enabled = True
        self._calibrating = False

    def is_initialized(self) -> bool:
        return True

    @contextlib.contextmanager
    def compute_encodings(self):
        yield self

    def check_input(self, x: torch.Tensor) -> None:
        if self.per_token and x.dim() < 1:
            raise ValueError("a per-token quantizer needs a tensor with a last (channel) dimension")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        x = x.as_subclass(torch.Tensor)
        scale, offset = dynamic_scale_offset(x, self.per_token, self.qmin, self.qmax, self.symmetric)
        return quantize_dequantize(x, scale, offset, qmin=self.qmin, qmax=self.qmax)

    def extra_repr(self) -> str:
        return (f"bitwidth={self.bitwidth}, symmetric={self.symmetric}, "
                f"{'per_token' if self.per_token else 'per_tensor'}, dynamic")


class FloatQuantizeDequantize(QuantizerBase):
    """Fake quantization on a float element grid (FP8 E4M3, FP4 E2M1; ``quant.floatgrid``) with representable
    block scales (``scale_dtype``: float32, e8m0 for MX, fp8_e4m3 under a float32 global scale for NVFP4).

    The stored range is ``[-amax, amax]`` per encoding (block, channel or tensor): calibration keeps the absolute
    maximum of what the analyzer saw, and the scales are derived from it on every call as compressed-tensors
    derives them. Returns a plain tensor in ``x``'s dtype."""

    def __init__(self, shape: Sequence[int], element: str, scale_dtype: str = "float32",
                 encoding_analyzer: Optional[EncodingAnalyzer] = None,
                 block_size: Optional[Sequence[int]] = None):
        self.element = element_of(element)
        super().__init__(shape, self.element.bits, True, encoding_analyzer, block_size)
        self.scale_dtype = scale_dtype
        self.qmin, self.qmax = 0, self.element.num_codes - 1
        # NVFP4: the absolute maximum the global scale comes from when fused layers share one (None: this tensor's)
        self.global_amax: Optional[torch.Tensor] = None

    def scales(self, amax: Optional[torch.Tensor] = None):
        """``(stored, effective, global)`` scales of the stored range (or of ``amax``), see
        ``floatgrid.encoding_scales``."""
        if amax is None:
            self._require_initialized()
            amax = self.max.detach()
        return encoding_scales(amax, self.element, self.scale_dtype, None if self._calibrating else self.global_amax)

    def _scale_offset(self, mn: torch.Tensor, mx: torch.Tensor):
        eff = self.scales(torch.maximum(-mn, mx).detach())[1]
        return eff, torch.zeros_like(eff)

    def _calibrated_range(self):
        """``[-amax, amax]``: the absolute maximum of what the analyzer saw, or, with the MSE analyzer, the clipped
        one whose representable scales give the least (activation-weighted) error (``floatgrid.search_amax``)."""
        stats = self.encoding_analyzer.statistics()
        amax = torch.maximum(-stats.min, stats.max).clamp(min=0).to(torch.float32)
        if isinstance(self.encoding_analyzer, MseEncodingAnalyzer):
            ratios = self.encoding_analyzer.candidate_ratios().tolist()
            amax = search_amax(stats.rows, amax, self.element, self.scale_dtype, ratios, stats.weights)
        amax = amax.reshape(self.shape)
        return -amax, amax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or (self._calibrating and x.numel() == 0):
            return x
        x = x.as_subclass(torch.Tensor)
        if self._calibrating:
            mn, mx = self.encoding_analyzer.update_stats(x)
            amax = torch.maximum(-mn, mx).clamp(min=0)
        else:
            self._require_initialized()
            amax = self.max.detach()
        eff = self.scales(amax)[1]
        return float_quantize_dequantize(x, eff, self.element, self.block_size)

    def extra_repr(self) -> str:
        return (f"shape={self.shape}, element={self.element.name}, scale_dtype={self.scale_dtype}"
                + (f", block_size={self.block_size}" if self.block_size is not None else ""))


class DynamicFloatQuantizeDequantize(DynamicQuantizeDequantize):
    """Fake quantization on a float element grid with scales computed from each call's own values: one per call,
    one per token, or one per ``block`` values of the last dimension (NVFP4 / MX activations), as
    compressed-tensors' dynamic activations compute them. NVFP4's block scales (``scale_dtype`` fp8_e4m3) sit under
    a static global scale: calibration records the largest absolute value it sees as ``global_amax`` (what
    compressed-tensors' ``input_global_scale`` comes from); everything else is computed per call."""

    def __init__(self, element: str, granularity: str = "per_tensor", scale_dtype: str = "float32",
                 block: Optional[int] = None):
        self.element = element_of(element)
        super().__init__(self.element.bits, True, granularity == "per_token")
        self.granularity = granularity
        self.block = block
        self.block_size = None if block is None else (int(block),)
        self.qmin, self.qmax = 0, self.element.num_codes - 1
        self.scale_dtype = scale_dtype
        self.global_amax: Optional[torch.Tensor] = None
        # the global scale's statistics (min-max over whole calls): mergeable across ranks like any analyzer's
        self.encoding_analyzer = MinMaxEncodingAnalyzer((), None) if self.needs_global else None

    @property
    def needs_global(self) -> bool:
        return self.scale_dtype == "fp8_e4m3"

    def is_initialized(self) -> bool:
        return not self.needs_global or self.global_amax is not None

    @contextlib.contextmanager
    def compute_encodings(self):
        if not self.needs_global:
            yield self
            return
        self.encoding_analyzer.reset_stats()
        self._calibrating = True
        try:
            yield self
        finally:
            self._calibrating = False
        if self.encoding_analyzer.has_stats():
            stats = self.encoding_analyzer.statistics()
            self.global_amax = torch.maximum(-stats.min, stats.max).clamp(min=0).to(torch.float32)
        self.encoding_analyzer.reset_stats()

    def check_input(self, x: torch.Tensor) -> None:
        super().check_input(x)
        if self.block is not None and (x.dim() < 1 or x.shape[-1] % self.block):
            raise ValueError(f"block size {self.block} does not divide the last dimension "
                             f"{x.shape[-1] if x.dim() else 0}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or (self._calibrating and x.numel() == 0):
            return x
        x = x.as_subclass(torch.Tensor)
        gscale = None
        if self.needs_global:
            if self._calibrating:  # this call's own global scale (as int quantizers use each batch's own range)
                mn, mx = self.encoding_analyzer.update_stats(x)
                gscale = global_scale(torch.maximum(-mn, mx), self.element)
            elif self.global_amax is None:
                raise UninitializedQuantizerError(f"{type(self).__name__}: NVFP4 activations need their global "
                                                  "scale calibrated first")
            else:
                gscale = global_scale(self.global_amax.to(x.device), self.element)
        eff, block = dynamic_float_scales(x, self.element, self.scale_dtype, self.granularity, self.block, gscale)
        return float_quantize_dequantize(x, eff, self.element, block)

    def extra_repr(self) -> str:
        block = f" {self.block}" if self.block else ""
        return f"element={self.element.name}, {self.granularity}{block}, scale_dtype={self.scale_dtype}, dynamic"


class GgmlQuantizeDequantize(QuantizerBase):
    """Fake quantization on one of llama.cpp's K-quant or IQ4 block types (``quant.ggml``): the stored range is
    each sub-block's ``[min, max]`` as the analyzer chose it, and the grid is what the type stores for it (sub-block
    scales quantized under float16 super-block scales), derived on every call. Returns a plain tensor in ``x``'s
    dtype equal to what llama.cpp dequantizes from the file."""

    def __init__(self, shape: Sequence[int], gtype: GgmlType, encoding_analyzer: Optional[EncodingAnalyzer] = None,
                 block_size: Optional[Sequence[int]] = None, clip: bool = False):
        super().__init__(shape, gtype.bits, gtype.symmetric, encoding_analyzer, block_size)
        self.ggml = gtype
        self.clip = clip  # the MSE search also tries clipped spans (ggml.CLIP_RATIOS): for codes GPTQ chooses
        self.scale_dtype = gtype.name.lower()

    def grid(self, mn: Optional[torch.Tensor] = None, mx: Optional[torch.Tensor] = None) -> KGrid:
        if mn is None:
            self._require_initialized()
            mn, mx = self.min.detach(), self.max.detach()
        return grid_from_range(mn.detach(), mx.detach(), self.ggml)

    def _scale_offset(self, mn: torch.Tensor, mx: torch.Tensor):
        return self.grid(mn, mx).step_offset(self.shape)

    def _calibrated_range(self):
        """Each sub-block's range as seen (minmax), or with the MSE analyzer its least-error step (and minimum)
        from ``ggml.search_range`` (llama.cpp's kind of search, weighted by activations when the analyzer is)."""
        if isinstance(self.encoding_analyzer, MinMaxEncodingAnalyzer):  # the sub-blocks' own ranges
            stats = self.encoding_analyzer.statistics()
            return stats.min.clamp(max=0), stats.max.clamp(min=0)
        if not isinstance(self.encoding_analyzer, MseEncodingAnalyzer):
            return super()._calibrated_range()
        stats = self.encoding_analyzer.kept()
        mn, mx = search_range(stats.rows, self.ggml, stats.weights, clip_ratios=CLIP_RATIOS if self.clip else ())
        mn, mx = mn.reshape(self.shape), mx.reshape(self.shape)
        if (self.ggml.weighted_scales and stats.weights is not None
                and weighs_activations(self.encoding_analyzer.weighting)):
            # with importances the K-quants' super-block scales are searched too (ggml.weighted_steps)
            step, low = self.ggml.wished_step(mn, mx)
            step, low = weighted_steps(stats.rows, stats.weights, step, low, self.ggml)
            mn, mx = self.ggml.range_of(step, torch.zeros_like(step) if low is None else low)
        return mn, mx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or (self._calibrating and x.numel() == 0):
            return x
        x = x.as_subclass(torch.Tensor)
        mn, mx = self._range_for_call(x)
        return to_input_dtype(ggml_quantize_dequantize(x.to(torch.float32), self.grid(mn, mx)), x.dtype)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, gguf_type={self.ggml.name}, block_size={self.block_size}"
