"""The exporter seam: what every output format gets and gives.

An exporter receives an :class:`ExportRequest` (the encodings, the weight source that hands out each weight's
values and integer codes, the output directory, and loaders for the few formats that need the model itself) and
its own typed options, writes its files into the output directory, and returns a summary dict (``names`` maps
quantizer names to the tensor names it wrote, for the AIMET JSON beside it). It never prints and never decides
where outputs go: the pipeline made the (temporary, atomic) directory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Optional, Set

from ..encodings import EncodingEntry, EncodingsFile
from ..errors import EncodingsError
from ..weights import WeightSource

__all__ = ["Exporter", "ExportRequest", "refuse_float_elements", "match_weight_names", "weight_names", "WeightNames"]


@dataclass
class ExportRequest:
    checkpoint: Path
    encodings: EncodingsFile
    weights: WeightSource
    out_dir: Path
    trust_remote_code: bool = False
    progress: Optional[Callable[[int, int, str], None]] = None  # (done, total, tensor name)
    load_model: Optional[Callable[[], Any]] = None  # -> qtool.model.load.LoadedModel (formats that trace)
    example_batch: Optional[Callable[[Any], Any]] = None  # LoadedModel -> qtool.data.Batch (formats that trace)
    example_source: str = ""  # the --data path the example batch is read from ("": a tokenizer's sentence)


class Exporter:
    """Subclass per format: set ``name``, an ``Options`` dataclass of the format's own knobs, and ``write``."""

    name: ClassVar[str] = ""
    # model.encodings (AIMET JSON) beside the format's files: "always", "if_small" (skipped when it would be GBs)
    # or "never" (a format with its own complete quantization metadata)
    aimet_json: ClassVar[str] = "if_small"
    # whether the encodings may be read lazily (block encodings loaded one weight at a time from the sidecar)
    lazy_encodings: ClassVar[bool] = False

    @dataclass
    class Options:
        pass

    def options(self, **flags: Any) -> "Exporter.Options":
        """This format's options from the front end's flags (flags of other formats are ignored)."""
        fields = {f.name for f in dataclasses.fields(self.Options)}
        return self.Options(**{k: v for k, v in flags.items() if k in fields})

    def check_checkpoint(self, checkpoint: Path) -> None:
        """Refuse a checkpoint this format cannot describe (e.g. an architecture it has no layout for), before
        calibration or writing (default: any)."""

    def check_example_inputs(self, checkpoint: Path, data: Optional[str]) -> None:
        """Refuse, before calibration, a run that will have no inputs to trace the model on where the format
        traces it (default: it does not)."""

    # whether the format stores llama.cpp's K-quant / IQ4 block types (only GGUF does)
    gguf_types: ClassVar[bool] = False

    # whether the format can carry a rotation of activations at run time (r4: compressed-tensors' transform_config,
    # qtool's metadata); the others refuse a model that needs one
    online_rotations: ClassVar[bool] = False

    def check(self, encodings: EncodingsFile, options: "Exporter.Options") -> None:
        """Refuse encodings this format cannot express, before any file is written (default: all fit)."""
        self.admit(encodings.entries, options, encodings.online)

    def admit(self, quantizers, options: "Exporter.Options", online=()) -> None:
        """``check_quantizers``, after refusing GGUF's own block types in every format but GGUF and online
        rotations (``config.OnlineRotation``) in every format that cannot run them."""
        quantizers = list(quantizers)
        self.check_online(online)
        if not self.gguf_types:
            ggml = [q for q in quantizers if q.spec.ggml is not None]
            if ggml:
                from ..errors import UsageError

                raise UsageError(f"{ggml[0].name} is {ggml[0].spec.describe()}, one of llama.cpp's block types "
                                 f"({len(ggml)} quantizer(s) in all): export it with --format gguf")
        self.check_quantizers(quantizers, options)

    def writes_tied_apart(self, model) -> bool:
        """Whether the file holds a tied output layer as a tensor of its own even where it has the embedding
        table's numbers (what a size budget counts; default: no)."""
        return False

    def check_expert_counts(self, quantizers, options: "Exporter.Options", counts: Dict[str, int]) -> None:
        """Refuse, before calibration, a plan whose mixture-of-experts layers the format cannot write given how many
        experts each has (``Plan.expert_counts``; default: any)."""

    def check_tied(self, tied: Dict[str, str]) -> None:
        """Refuse weight quantizers on a tied parameter's later name (``Plan.tied``) where the format cannot write
        them (default: it can)."""

    def counts_bytes(self, options: "Exporter.Options") -> bool:
        """Whether a size budget can be counted in this format (:meth:`tensor_bytes` gives its bytes)."""
        import torch

        return self.tensor_bytes(None, (1,), torch.float32, options) is not None

    def check_kv_cache(self, float_attention: List[str]) -> None:
        """Refuse a KV cache quantized in some attention layers only (``Plan.kv_float``: those left float) where
        the format has one KV-cache scheme for the whole model (default: it can write the layers apart)."""

    def check_weight_changes(self, changes: List[str]) -> None:
        """Refuse what calibration changes in the weights (:func:`weight_changes` of a plan) where the format does
        not write weights (default: it writes them, as calibration left them)."""

    def check_online(self, online) -> None:
        """Refuse online rotations (``config.OnlineRotation``) unless the format can run them."""
        if online and not self.online_rotations:
            from ..errors import UsageError

            rot = online[0]
            raise UsageError(f"--format {self.name} cannot hold a rotation of activations at run time: {rot.name} "
                             f"rotates {rot.modules[0]}'s {rot.rotated} (and {len(rot.modules) - 1} more "
                             "module(s)); export with --format compressed-tensors or qtool, or leave "
                             f"{' and '.join(sorted({r.name for r in online}))} out of rotate")

    # how the plan line says what ``left_float`` names ("2 x weight left float by --format compressed-tensors")
    left_float_words: ClassVar[str] = "left float"

    def left_float(self, quantizers, options: "Exporter.Options", tied=()) -> List[str]:
        """The weight quantizers (plan rows) this format writes as float weights though the recipe quantizes
        them (default: none), so the plan can say so before calibrating. ``tied``: the weights the model holds
        under two names, ``{later name: first name}`` (``Plan.tied``, :func:`tied_parameters`)."""
        return []

    def not_written(self, entries, options: "Exporter.Options", tied=()) -> List[str]:
        """Every quantizer (encodings entries with ``module_type``) the written model runs in float: what
        ``left_float`` names, and activation quantizers the format has no place for (default: ``left_float``)."""
        return self.left_float(entries, options, tied)

    def check_quantizers(self, quantizers, options: "Exporter.Options") -> None:
        """Refuse quantizers (encodings entries, or plan rows before calibration: each has ``name``, ``tensor``
        and ``spec``) this format cannot express (default: all fit)."""

    def tensor_bytes(self, quantizer, shape, dtype, options: "Exporter.Options") -> Optional[int]:
        """The bytes this format writes for one checkpoint tensor of ``shape`` and ``dtype``: quantized as
        ``quantizer`` (a weight's plan row or encodings entry), or left float (None). What ``--target-bpw`` and
        ``--target-size`` count. None (the default): the format does not store the weights at their grid's size,
        so a size budget cannot be counted in it."""
        return None

    def write(self, request: ExportRequest, options: "Exporter.Options") -> Dict[str, Any]:
        raise NotImplementedError  # pragma: no cover - interface


def layout_bytes(layout) -> int:
    """The bytes of a safetensors layout: ``(name, dtype, shape)`` rows."""
    import torch

    total = 0
    for _, dtype, shape in layout:
        n = 1
        for d in shape:
            n *= int(d)
        total += n * torch.empty((), dtype=dtype).element_size()
    return total


class TypedEntry:
    """An encodings entry with its module's type: what :meth:`Exporter.not_written` and ``left_float`` read."""

    def __init__(self, entry, module_type: str):
        self._entry, self.module_type = entry, module_type

    def __getattr__(self, name):
        return getattr(self._entry, name)


def with_module_types(entries, modules) -> List[TypedEntry]:
    """``entries`` whose module ``modules`` (name -> module) holds, each with that module's type (a quantized
    module's, the type it wraps)."""
    return [TypedEntry(e, getattr(modules[e.module], "_qtool_base", type(modules[e.module])).__name__)
            for e in entries if e.module in modules]


def written_float(exporter: "Exporter", options, entries, model, modules) -> Set[str]:
    """The names of ``entries``' quantizers that ``exporter`` writes float for ``model`` (``modules``: its
    ``named_modules()``): :meth:`Exporter.not_written` given each entry's module type and the model's tied
    weights, what a fake-quant model switches off to run as the file does (eval, the size search)."""
    from ..config.resolve import tied_parameters

    return set(exporter.not_written(with_module_types(entries, modules), options, tied_parameters(model)))


def refuse_float_elements(quantizers, fmt: str, why: str) -> None:
    """Raise ``UsageError`` (one line) when a quantizer is on a float element grid (FP8, FP4) that format ``fmt``
    cannot hold; ``why`` says what the format stores instead."""
    from ..errors import UsageError

    floats = [q for q in quantizers if q.spec.is_float]
    if floats:
        q = floats[0]
        raise UsageError(f"{fmt} cannot hold float element grids ({why}): {q.name} is {q.spec.describe()} "
                         f"({len(floats)} quantizer(s) in all); export FP8/NVFP4/MX recipes with --format "
                         "compressed-tensors or qtool")


def match_weight_names(entries: List[EncodingEntry], keys: List[str], source: str) -> Dict[str, str]:
    """Map each weight encoding to a checkpoint tensor name (exact, else a unique prefix difference)."""
    keyset = set(keys)
    out = {}
    for e in entries:
        if e.name in keyset:
            out[e.name] = e.name
            continue
        cands = [k for k in keys if k.endswith("." + e.name) or e.name.endswith("." + k)]
        if len(cands) != 1:
            # (T5's encoder/decoder embed_tokens are its shared table; an output layer tied to the embedding table)
            if not cands and ("lm_head" in e.name or "embed_tokens" in e.name):  # (the likelier cause first)
                raise EncodingsError(
                    f"{source}: has no tensor {e.name!r}, which the encodings name: a weight tied to another tensor "
                    "(an output layer or an embedding table shared with it) is stored only under that tensor's name, "
                    "and this format writes tensors by name: calibrate with it in ignore, or export with --format "
                    "compressed-tensors, or gguf for a family llama.cpp runs (if it is not tied, the encodings were "
                    "made for another model)")
            if cands:
                raise EncodingsError(f"{source}: the encodings' {e.name!r} could be any of {len(cands)} tensors "
                                     f"({', '.join(sorted(cands)[:3])}); were they made for another model?")
            raise EncodingsError(
                f"{source}: has no tensor {e.name!r} named in the encodings; were they made for another model?")
        out[e.name] = cands[0]
    return out


@dataclass
class WeightNames:
    """What the exporters that write the checkpoint's tensors start from (:func:`weight_names`)."""

    keys: List[str]  # the checkpoint's tensor names (WeightSource.keys: then those a transform untied)
    entries: List[EncodingEntry]  # the weight encodings matched
    names: Dict[str, str]  # quantizer name -> checkpoint tensor name
    by_key: Dict[str, EncodingEntry]  # checkpoint tensor name -> its weight encoding


def refuse_tied(fmt: str, tied: Dict[str, str]) -> None:
    """``UsageError`` for the first of ``tied`` (``Plan.tied``): a format that writes the checkpoint's tensors by
    name has no tensor for a weight the checkpoint stores under another name."""
    if tied:
        from ..errors import UsageError

        name, stored = next(iter(tied.items()))
        # (every quantized alias: T5's encoder and decoder tables are both its shared one)
        modules = ", ".join(f"'{n.rsplit('.', 1)[0]}'" for n in tied)
        raise UsageError(f"{name} is the tensor {stored} (tied embeddings), which the checkpoint stores once: --format "
                         f"{fmt} writes the checkpoint's tensors by name and has no place for it; add {modules} to "
                         "ignore, or export a Hugging Face model with --format gguf or compressed-tensors, or save a "
                         "state dict that holds it under both names (torch.save(model.state_dict()) does)")


def weight_changes(plan) -> List[str]:
    """What calibrating ``plan`` changes in the model's weights besides choosing ranges: fused rotations, SmoothQuant,
    AWQ, folded batch norms, codes chosen by a rounding algorithm (empty: the checkpoint's weights stay as they are)."""
    changes = []
    if plan.rotation is not None:
        changes.append(f"rotation {'/'.join(plan.rotation.rotations)}")
    if plan.smoothing:
        changes.append("SmoothQuant")
    if plan.awq is not None:
        changes.append("AWQ")
    if plan.folds:
        changes.append("batch norms folded")
    rounding = sorted({q.rounding for q in plan.weights if q.rounding != "nearest"})
    if rounding:
        changes.append(f"{'/'.join(rounding)} codes")
    return changes


def weight_names(src: WeightSource, entries, source: str) -> WeightNames:
    """The exporters' shared preamble: the weight encodings among ``entries`` matched to the tensors of ``src``
    (:func:`match_weight_names`; ``source`` names the checkpoint in its error), both ways."""
    weights = [e for e in entries if e.tensor == "weight"]
    keys = src.keys()
    names = match_weight_names(weights, keys, source)
    return WeightNames(keys, weights, names, {names[e.name]: e for e in weights})
