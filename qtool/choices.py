"""Every choice-valued option and its check, importable without torch so a bad choice fails at once, before any
model or library is loaded. Each check raises ``UsageError`` with the choices in the message."""

from __future__ import annotations

import numbers
import os
import re
from typing import Mapping, Optional, Sequence

from .errors import UsageError

__all__ = ["GGUF_TYPES", "GGML_SCALE_DTYPES", "LEGACY_GGUF_TYPES", "SUPER_BLOCK_FALLBACK", "AIMET_VERSIONS", "CT_EIGHT_BIT_FORMATS", "GGUF_FLOAT_TYPES", "GGUF_FALLBACKS", "DEVICES", "MATMUL_PRECISIONS", "SCALE_DTYPES",
           "ELEMENT_NAMES", "FLOAT_SCALE_DTYPES", "check_choice", "check_fields", "check_device", "check_scale_dtype", "check_element",
           "WEIGHTINGS", "weighs_activations", "without_activations", "drop_activations", "with_activations"]

AIMET_VERSIONS = ("0.6.1", "1.0.0", "2.0.0")  # the AIMET encodings versions qtool writes
CT_EIGHT_BIT_FORMATS = ("int-quantized", "pack-quantized")
GGUF_FLOAT_TYPES = ("f32", "f16")  # --gguf-float: tensors a recipe leaves float
GGUF_FALLBACKS = ("none", "f32", "f16")  # --gguf-fallback: quantized weights with no GGUF block type
DEVICES = ("cpu", "cuda", "auto")  # and cuda:N
MATMUL_PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's (quant.precision)
SEARCH_METRICS = ("kl", "nll")  # --search-metric: what a size-budget search minimizes
# the MSE search's weightings of each value's squared error: by its input channel's E[x²] (activations, from data or
# an importance matrix), by its own size (magnitude: block rms + |w|, no data), or by both multiplied
# (activations_magnitude: importance x (rms + |w|), the kind of product llama.cpp uses with an importance matrix,
# qw·sqrt(σ² + x²))
WEIGHTINGS = ("none", "activations", "magnitude", "activations_magnitude")


def weighs_activations(weighting) -> bool:
    """Whether a search with this ``weighting`` reads each input channel's importance (data or an imatrix)."""
    return weighting in ("activations", "activations_magnitude")


def without_activations(weighting):
    """The weighting left where no importance can be had (no data, a layer that is not a Linear): the magnitude
    part of ``activations_magnitude`` stays, ``activations`` becomes unweighted (None)."""
    return "magnitude" if weighting == "activations_magnitude" else None if weighting == "activations" else weighting


def drop_activations(args: dict) -> dict:
    """A row's analyzer arguments ``args`` with its weighting reduced to what needs no importance
    (:func:`without_activations`; no ``weighting`` key where nothing is left)."""
    out = {k: v for k, v in args.items() if k != "weighting"}
    left = without_activations(args.get("weighting"))
    if left is not None:
        out["weighting"] = left
    return out


def with_activations(weighting) -> str:
    """The weighting once importances are given (``--imatrix``): ``magnitude`` becomes ``activations_magnitude``,
    as llama.cpp multiplies its magnitude term by the importance matrix; anything else becomes ``activations``."""
    return "activations_magnitude" if weighting in ("magnitude", "activations_magnitude") else "activations"


_DEVICE = re.compile(r"(cpu|cuda|auto|cuda:\d{1,3})")


def check_choice(flag: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        import difflib

        near = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else ""
        raise UsageError(f"{flag} must be one of {', '.join(choices)} (got {str(value)[:40]!r}{hint})")
    return value


def check_device(value: str, what: str = "--device") -> str:
    if not isinstance(value, str) or not _DEVICE.fullmatch(value):
        raise UsageError(f"{what} must be cpu, cuda or auto (or cuda:N; got {str(value)[:40]!r})")
    return value


SCALE_DTYPES = ("float32", "float16")
ONNX_OPTIMIZATIONS = ("all", "basic", "off")  # qtool eval: onnxruntime's graph optimization levels
# llama.cpp's block types by recipe name (``gguf_type``): (bitwidth, symmetric, block length). Each names its own
# scale_dtype: the grid is what the type stores (float16 block scales, signed, and minima; K-quant sub-block scales
# quantized under float16 super-block scales; ``qtool.quant.ggml``).
GGUF_TYPES = {
    "q8_0": (8, True, 32), "q5_0": (5, True, 32), "q5_1": (5, False, 32), "q4_0": (4, True, 32),
    "q4_1": (4, False, 32), "q6_k": (6, True, 16), "q5_k": (5, False, 32), "q4_k": (4, False, 32),
    "q3_k": (3, True, 16), "q2_k": (2, False, 16), "iq4_nl": (4, True, 32), "iq4_xs": (4, True, 32),
}
GGML_SCALE_DTYPES = tuple(GGUF_TYPES)
# the GGUF block type an integer grid of blocks of 32 along the input is, by (bitwidth, symmetric)
LEGACY_GGUF_TYPES = {(8, True): "Q8_0", (4, True): "Q4_0", (4, False): "Q4_1", (5, True): "Q5_0", (5, False): "Q5_1"}
# llama-quantize's fallback for a row that is not a whole number of 256-element super-blocks (llama.cpp's
# tensor_type_fallback; builds before 2026 sent Q2_K/Q3_K to IQ4_NL)
SUPER_BLOCK_FALLBACK = {"q6_k": "q8_0", "q5_k": "q5_1", "q4_k": "q5_0", "q3_k": "q4_0", "q2_k": "q4_0",
                        "iq4_xs": "iq4_nl"}


def check_scale_dtype(scale_dtype: str, bitwidth: int, symmetric: bool) -> None:
    """Raise ``ValueError`` unless ``scale_dtype`` can be honoured exactly on this grid.

    float16 scales keep every code's value ``(q + offset) * scale`` exact in float32 for a symmetric grid up to
    8 bits; an asymmetric one also needs ``offset * scale`` (the grid's minimum) to be a float16 value, which a
    search of 16 float16 steps either side always finds for 5 bits or fewer (GGUF's Q5_1).
    """
    if scale_dtype in GGML_SCALE_DTYPES:
        bits, sym, block = GGUF_TYPES[scale_dtype]
        if (bitwidth, symmetric) != (bits, sym):
            raise ValueError(f"scale_dtype {scale_dtype} is GGUF's {scale_dtype.upper()}: {bits}-bit "
                             f"{'symmetric' if sym else 'asymmetric'} blocks of {block} (write gguf_type: {scale_dtype})")
        return
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {', '.join(SCALE_DTYPES + GGML_SCALE_DTYPES)} "
                         f"(got {str(scale_dtype)[:40]!r})")
    if scale_dtype == "float16":
        limit = 8 if symmetric else 5
        if bitwidth > limit:
            kind = "symmetric" if symmetric else "asymmetric"
            raise ValueError(f"scale_dtype float16 supports {kind} grids up to {limit} bits (got {bitwidth})")


ELEMENT_NAMES = ("int", "fp8_e4m3", "fp4_e2m1")
_ELEMENT_BITS = {"fp8_e4m3": 8, "fp4_e2m1": 4}
FLOAT_SCALE_DTYPES = ("float32", "e8m0", "fp8_e4m3")


def check_element(element: str, bitwidth: int, symmetric: bool, scale_dtype: str, granularity: str,
                  dynamic: bool) -> None:
    """Raise ``ValueError`` unless a float ``element`` fits the rest of the spec (an ``int`` one always does)."""
    if element not in ELEMENT_NAMES:
        raise ValueError(f"element must be one of {', '.join(ELEMENT_NAMES)} (got {str(element)[:40]!r})")
    if element != "int" and scale_dtype in GGML_SCALE_DTYPES:
        raise ValueError(f"scale_dtype {scale_dtype} is a GGUF type on an integer grid (element int)")
    if element == "int":
        if scale_dtype in ("e8m0", "fp8_e4m3"):
            raise ValueError(f"scale_dtype {scale_dtype} is for float elements (fp8_e4m3, fp4_e2m1); an integer "
                             "grid takes float32 or float16")
        return
    if bitwidth != _ELEMENT_BITS[element]:
        raise ValueError(f"element {element} has {_ELEMENT_BITS[element]} bits (got bitwidth {bitwidth})")
    if not symmetric:
        raise ValueError(f"element {element} is symmetric (its values are signed around zero): symmetric must be true")
    if scale_dtype not in FLOAT_SCALE_DTYPES:
        raise ValueError(f"a float element's scale_dtype is one of {', '.join(FLOAT_SCALE_DTYPES)} "
                         f"(got {str(scale_dtype)[:40]!r})")
    if scale_dtype != "float32" and granularity != "per_block":
        raise ValueError(f"scale_dtype {scale_dtype} scales blocks (MX: e8m0 with block 32, NVFP4: fp8_e4m3 with "
                         f"block 16): it needs granularity per_block (got {granularity})")
    if dynamic and scale_dtype != "float32" and granularity != "per_block":
        raise ValueError(f"dynamic float activations with {scale_dtype} scales compute them per block at run time: "
                         "they need granularity per_block")


def check_fields(options, minimums: Optional[Mapping[str, int]] = None) -> None:
    """Raise ``UsageError`` naming the first field of the dataclass ``options`` (``ExportOptions.batch_size``)
    whose value is not of its declared type (an int for an ``int``, not a bool; a number for a ``float``; a list or
    tuple of strings for a ``Tuple[str, ...]``; None only where ``Optional``) or lies below its ``minimums``.

    The CLI has checked its flags before it builds an options object; a library caller's mistake (``batch_size="8"``,
    ``max_shard_bytes="5GB"``) fails here, at the job's edge, instead of as a TypeError deep inside the run."""
    import dataclasses
    import typing

    try:
        hints = typing.get_type_hints(type(options))
    except (NameError, TypeError):  # (a subclass's annotation that does not resolve: its bases' fields are checked)
        base = next((c for c in type(options).__mro__[1:] if dataclasses.is_dataclass(c)), None)
        hints = typing.get_type_hints(base) if base is not None else {}
    for f in dataclasses.fields(options):
        value, hint = getattr(options, f.name), hints.get(f.name)
        what = f"{type(options).__name__}.{f.name}"
        args = typing.get_args(hint)
        optional = typing.get_origin(hint) is typing.Union and type(None) in args
        if optional:
            if value is None:
                continue
            rest = [a for a in args if a is not type(None)]
            hint = rest[0] if len(rest) == 1 else hint
        expected = _expected(hint)
        if expected is None:
            continue
        ok, words = expected
        if not ok(value):
            raise UsageError(f"{what} must be {words}{' or None' if optional else ''} (got "
                             f"{type(value).__name__} {repr(value)[:40]})")
        if minimums and f.name in minimums and value < minimums[f.name]:
            raise UsageError(f"{what} must be {minimums[f.name]} or more (got {value})")
        if hint is str and isinstance(value, os.PathLike):  # (str() of a PathLike other than Path is its repr)
            setattr(options, f.name, os.fspath(value))
        elif hint in (int, float, bool) and type(value) is not hint:  # (a NumPy integer or bool: torch's seeding and
            setattr(options, f.name, hint(value))                  # the manifest's JSON take Python's own)


def is_flag(value) -> bool:
    """True or False, NumPy's included (a JSON "false" or a config file's string is not one)."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def check_flag(name: str, value) -> None:
    """Raise ``UsageError`` where a library caller's flag ``name`` is not True or False (``overwrite="false"`` is a
    true string)."""
    if not is_flag(value):
        raise UsageError(f"{name} must be True or False (got {type(value).__name__} {str(value)[:40]!r})")


def check_arguments(checkpoint, opts=None, opts_type=None, path_is: str = "checkpoint", paths=None, flags=None,
                    **optional) -> None:
    """Raise ``UsageError`` naming a library job's argument of the wrong kind: ``checkpoint`` a path (a model in
    memory is not one; ``path_is`` names it), ``opts`` an ``opts_type`` (where given), each of ``paths``
    (``{name: value}``) a path, each of ``flags`` True or False (``trust_pickle="no"`` is a true string), and each
    of ``optional`` (``name=(value, type)``) None (the job's default) or its type. Before any work: a dict for
    ``opts`` or ``hooks`` failed deep inside."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        memory = ": save_pretrained (or save) it to a directory first" if hasattr(checkpoint, "state_dict") else ""
        raise UsageError(f"{path_is} is a path (a file, a directory or a Hugging Face id), not a "
                         f"{type(checkpoint).__name__}{memory}")
    for name, value in (paths or {}).items():
        if not isinstance(value, (str, os.PathLike)):
            raise UsageError(f"{name} is a path, not a {type(value).__name__}")
    for name, value in (flags or {}).items():
        check_flag(name, value)
    typed = {"opts": (opts, opts_type)} if opts_type is not None else {}
    for name, (value, kind) in {**typed, **optional}.items():
        if (value is not None or name in typed) and not isinstance(value, kind):
            raise UsageError(f"{name} must be of type {kind.__name__} (got {type(value).__name__})")


def _expected(hint):
    """(a test, its words) for the field types options declare; None for any other (not checked here)."""
    import typing

    if hint is bool:
        return is_flag, "True or False"
    if hint is int:  # (NumPy's integers too: a sweep's np.arange)
        return (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)), "an integer"
    if hint is float:
        return (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)), "a number"
    if hint is str:  # (a path may be a Path)
        return (lambda v: isinstance(v, (str, os.PathLike))), "a string"
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[:1] == (str,):
        return (lambda v: isinstance(v, (tuple, list)) and all(isinstance(x, str) for x in v)), "a list of strings"
    return None
