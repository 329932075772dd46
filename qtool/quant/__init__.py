"""qtool's quantization core: pure affine math, quantizer modules, encoding analyzers (no I/O, no printing)."""

from .affine import (
    adjust_min_max,
    dequantize,
    dynamic_scale_offset,
    grid,
    min_max_to_scale_offset,
    quantize,
    quantize_dequantize,
    reduce_to_shape,
    resolve_block_size,
)
from .analyzers import (
    EncodingAnalyzer,
    MinMaxEncodingAnalyzer,
    MseEncodingAnalyzer,
    PercentileEncodingAnalyzer,
    SqnrEncodingAnalyzer,
    TfEnhancedEncodingAnalyzer,
)
from .quantizer import (
    DynamicFloatQuantizeDequantize,
    DynamicQuantizeDequantize,
    FloatQuantizeDequantize,
    GgmlQuantizeDequantize,
    Quantize,
    QuantizeDequantize,
    QuantizerBase,
    UninitializedQuantizerError,
)
from .tensor import AffineEncoding, DequantizedTensor, QuantizedTensor
from .torchao_api import ZeroPointDomain, dequantize_affine, quantize_affine

__all__ = [
    "quantize",
    "dequantize",
    "quantize_dequantize",
    "dynamic_scale_offset",
    "quantize_affine",
    "dequantize_affine",
    "ZeroPointDomain",
    "grid",
    "adjust_min_max",
    "min_max_to_scale_offset",
    "reduce_to_shape",
    "resolve_block_size",
    "EncodingAnalyzer",
    "MinMaxEncodingAnalyzer",
    "PercentileEncodingAnalyzer",
    "SqnrEncodingAnalyzer",
    "TfEnhancedEncodingAnalyzer",
    "MseEncodingAnalyzer",
    "QuantizerBase",
    "QuantizeDequantize",
    "Quantize",
    "DynamicQuantizeDequantize",
    "FloatQuantizeDequantize",
    "GgmlQuantizeDequantize",
    "DynamicFloatQuantizeDequantize",
    "UninitializedQuantizerError",
    "AffineEncoding",
    "QuantizedTensor",
    "DequantizedTensor",
]
