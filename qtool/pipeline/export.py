"""``qtool export`` and ``qtool import-encodings``: calibrated encodings and the checkpoint's weights written in
a format (plus AIMET's JSON beside it), and an AIMET encodings file brought in as qtool's."""

from __future__ import annotations

import os
import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from .. import __version__
from ..calibration import CalibrateOptions
from ..choices import check_arguments, check_fields
from ..config import CHECKPOINT_KEYS
from ..data import load_data
from ..encodings import CODES_FILE, SIDECAR, EncodingsFile, calibrated_elsewhere
from ..errors import EncodingsError, UsageError
from ..export import check_export_choices, get_exporter
from ..export.base import ExportRequest
from ..export.onnx_trace import takes_keyword
from ..export.qtool_st import DEFAULT_MAX_SHARD_BYTES
from ..hooks import Hooks
from ..io.checkpoint import tensor_files
from ..io.fs import atomic_output_dir, check_output_dir, sha256_file
from ..io.jsonfile import dumps_indented
from ..model.apply import plan_from_encodings
from ..model.load import LoadedModel, check_model_class, load_model
from .common import _inputs, one_at_a_time
from .manifest import checkpoint_input, digests, manifest, write_manifest


@dataclass
class ExportOptions:
    """What ``export`` needs: the format, the AIMET version of ``model.encodings``, how to load the checkpoint, and
    every format's own flags (each exporter picks its own: see its ``Options``)."""

    format: str = "qtool"  # a name in qtool.export.FORMATS
    encoding_version: str = "1.0.0"
    trust_pickle: bool = False
    model_class: Optional[str] = None
    trust_remote_code: bool = False
    data: Optional[str] = None  # example inputs for tracing (onnx)
    seq_len: int = 128
    batch_size: int = 2
    pack: bool = True  # sub-byte codes packed densely in qtool's format
    ct_eight_bit_format: str = "int-quantized"  # or pack-quantized (what vLLM's weight-only path runs)
    max_shard_bytes: Optional[int] = DEFAULT_MAX_SHARD_BYTES  # qtool format; None: one file
    gguf_float: str = "f32"  # gguf: dtype of tensors the recipe leaves float
    gguf_fallback: str = "none"  # gguf: weights with no GGUF type are refused, or written as f32/f16 values
    allow_other_checkpoint: bool = False  # export encodings whose calibration manifest names other weights

    def validate(self):
        """The exporter for ``format``, after checking every option's type and every choice (no work done yet)."""
        check_fields(self, {"seq_len": 1, "batch_size": 1, "max_shard_bytes": 1})
        check_export_choices(self.format, self.encoding_version, self.ct_eight_bit_format, self.gguf_float,
                             self.gguf_fallback)
        return get_exporter(self.format)


# beyond this many encoding numbers, the AIMET JSON beside a non-AIMET export is skipped (~100 bytes per number)
AIMET_JSON_LIMIT = 10_000_000


def _example_batch(eopts: ExportOptions):
    """Example inputs for exporters that trace the model: the first batch of --data, else a sentence through the
    checkpoint's tokenizer."""
    def make(loaded: LoadedModel):
        from ..data import Batch

        if eopts.data:
            data = load_data(eopts.data, batch_size=eopts.batch_size, num_samples=eopts.batch_size, seed=0,
                             seq_len=eopts.seq_len, tokenizer=loaded.tokenizer, at_most=True)  # (1 sample is enough)
            # float inputs in the model's own type: NumPy's float64 images traced a graph that takes float64 alone
            own = next((p.dtype for p in loaded.model.parameters() if p.is_floating_point()), torch.float32)
            b = data.batches[0]
            args, kwargs = tuple(_as(a, own) for a in b.args), {k: _as(v, own) for k, v in b.kwargs.items()}
            causal = loaded.kind == "hf" and loaded.is_causal_lm  # (an encoder's graph keeps the inputs it was given)
            if len(args) == 1 and not kwargs and not args[0].is_floating_point() and causal:
                args, kwargs = (), {"input_ids": args[0]}  # (a file of token ids alone)
            if causal and "input_ids" in kwargs and "attention_mask" not in kwargs and \
                    takes_keyword(loaded.model, "attention_mask"):
                # token ids alone: transformers then builds its mask from position ids (torch.diff) or takes SDPA's
                # grouped-query form (enable_gqa), neither of which torch.onnx exports; the graph takes a mask, as
                # it does traced on a tokenizer's sentence
                kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
            return Batch(args, kwargs)
        from ..model.hf import UnreadableTokenizer

        if isinstance(loaded.tokenizer, UnreadableTokenizer):
            raise UsageError(f"ONNX export traces the model: pass --data with a few example inputs (no sentence "
                             f"through the tokenizer: {loaded.tokenizer.reason})")
        if loaded.tokenizer is not None:
            pad = "max_length" if loaded.tokenizer.pad_token is not None else False  # (equal sentences: equal lengths)
            enc = loaded.tokenizer(["qtool exports this model to ONNX."] * eopts.batch_size, padding=pad,
                                   truncation=True, max_length=eopts.seq_len, return_tensors="pt")
            return Batch(kwargs={k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc})
        raise UsageError("ONNX export traces the model: pass --data with a few example inputs")
    return make


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _check_same_checkpoint(enc_path: Path, checkpoint: str, digest: Dict[str, str], enc: EncodingsFile,
                           allow_other: bool) -> Optional[str]:
    """Refuse encodings calibrated on other weights (``encodings.calibrated_elsewhere``: other file bytes, which a re-saved
    copy of the same tensors has too) unless ``allow_other``. Returns the warning an allowed one gets, which says
    so loudly where they carry tensors made from those weights (codes a rounding algorithm chose, smoothed or
    rotated tensors), written as they are, or the warning that nothing was compared where no manifest.json lies
    beside the encodings (None: the same weights, or no weights recorded)."""
    other, unchecked = calibrated_elsewhere(enc_path, digest.values(), checkpoint, unreadable_ok=allow_other)
    if other is None:
        return unchecked
    if not allow_other:
        raise EncodingsError(f"{enc_path}: calibrated on other weights than {checkpoint} (its manifest.json records "
                             f"{other} with other file hashes); export from that checkpoint, or pass "
                             "--allow-other-checkpoint if the weights changed on purpose")
    warning = (f"--allow-other-checkpoint: the ranges were calibrated on other weights ({other}) than "
               f"{checkpoint}'s, and are applied to these as they are")
    if enc.codes_file is not None:
        warning += (f"; {enc.codes_file} holds tensors made from those weights (codes a rounding algorithm chose, or "
                    "smoothed or rotated weights), written as they are: where these weights differ, the file holds "
                    "the other model's there (calibrate this checkpoint for its own)")
    return warning


def _refuse_unsplit_experts(checkpoint: str, tensors, enc: EncodingsFile, enc_path: Path) -> None:
    """A state dict holding a transformers MoE's fused experts, whose encodings name them one by one (its
    ``--model-class`` split them): without the factory no name matches, and the line blamed the encodings."""
    from ..encodings.file import calibration_manifest
    from ..model.expert_view import fused_candidates

    held = set(tensors.keys())
    split = next((e.name for e in enc.entries if e.tensor == "weight" and ".experts." in e.name
                  and e.name not in held), None)
    if split is None or Path(checkpoint).is_dir():
        return
    fused = fused_candidates(tensors)
    if not fused:
        return
    options = (calibration_manifest(enc_path)[0] or {}).get("options")
    used = options.get("model_class") if isinstance(options, dict) else None
    raise UsageError(f"{checkpoint}: holds its experts fused ({fused[0]}), and the encodings name them one by one "
                     f"({split}): pass the --model-class that builds the model"
                     + (f" (the calibration's was {used})" if isinstance(used, str) else "") + ", which splits them")


def _export_into(checkpoint: str, enc: EncodingsFile, enc_path: Path, out_dir: Path, eopts: ExportOptions,
                 hooks: Hooks, enc_display: Optional[str] = None,
                 same_weights: bool = False, checkpoint_checked: bool = False,
                 allow_other: bool = False) -> Dict[str, Any]:
    """Export ``enc`` of ``checkpoint`` into ``out_dir``; with ``same_weights``, refuse a checkpoint whose bytes differ
    from those the calibration's manifest records (checked once the checkpoint is known to be readable), unless
    ``allow_other`` (then a warning).
    ``checkpoint_checked``: the format's checkpoint check already ran in this job (``quantize`` runs it before
    calibrating)."""
    from ..aimet_format import block_problem, shared_names, to_aimet
    from ..model.expert_view import open_checkpoint
    from ..weights import WeightSource

    exporter = eopts.validate()
    options = exporter.options(**asdict(eopts))
    exporter.check_online(enc.online)  # what the model computes comes before what the checkpoint holds
    if not checkpoint_checked:
        exporter.check_checkpoint(Path(checkpoint))
    exporter.check(enc, options)
    hooks.on_stage(f"exporting ({eopts.format})")
    summary: Dict[str, Any] = {"format": eopts.format}
    tensors = open_checkpoint(checkpoint, eopts.trust_pickle, eopts.trust_remote_code, model_class=eopts.model_class)
    if eopts.model_class is None:
        _refuse_unsplit_experts(checkpoint, tensors, enc, Path(enc_path))
    weights = WeightSource(Path(checkpoint), enc, Path(enc_path).parent, tensors=tensors)
    digest = digests(tensor_files(Path(checkpoint)))
    other = _check_same_checkpoint(Path(enc_path), checkpoint, digest, enc, allow_other) if same_weights else None
    request = ExportRequest(
        Path(checkpoint), enc, weights, out_dir, trust_remote_code=eopts.trust_remote_code, progress=hooks.on_tensor,
        load_model=lambda: load_model(checkpoint, eopts.model_class, "cpu", eopts.trust_pickle,
                                      eopts.trust_remote_code),
        example_batch=_example_batch(eopts), example_source=eopts.data or "")
    summary.update(exporter.write(request, options))
    # the tensor names go into model.encodings; a format without it keeps them in its summary (and manifest)
    names = summary.pop("names", {}) if exporter.aimet_json != "never" else summary.get("names", {})
    summary["export_warnings"] = ([other] if other else []) + summary.pop("warnings", [])
    if exporter.name != "qtool" and eopts.max_shard_bytes != DEFAULT_MAX_SHARD_BYTES:  # (the CLI's --max-shard-size)
        summary["export_warnings"].append(f"--max-shard-size shards the qtool format only: --format "
                                          f"{eopts.format} writes its own files, unsharded by it")
    if exporter.name == "qtool":
        summary["export_warnings"] += _tied_to_a_quantized_table(Path(checkpoint), enc, eopts.trust_remote_code)
    numbers = sum(e.numel() for e in enc.entries)
    floats = [e for e in enc.entries if e.is_float]
    if enc.online and exporter.aimet_json != "never":  # AIMET JSON has no place for a rotation at run time
        summary["export_warnings"].append(
            f"model.encodings (AIMET JSON) not written: the model rotates activations of "
            f"{sum(len(r.modules) for r in enc.online)} modules at run time "
            f"({', '.join(sorted({r.name for r in enc.online}))}, online), which AIMET encodings cannot describe")
    elif floats and exporter.aimet_json != "never":  # AIMET JSON holds integer grids only
        # (the qtool format stores weights: a float activation's or KV cache's scale lives in the encodings alone)
        unheld = 0 if exporter.name == "onnx" else sum(e.tensor != "weight" and not e.dynamic for e in floats)
        held = ("the exported tensors hold their scales" if not unheld else
                f"the exported tensors hold the weights' scales; the {unheld} activation and KV-cache scales are in "
                f"{enc_display or enc_path} only (--format compressed-tensors writes FP8 input and KV-cache scales)")
        summary["export_warnings"].append(
            f"model.encodings (AIMET JSON) not written: {len(floats)} quantizer(s) are on float element grids "
            f"(FP8/FP4), which AIMET encodings cannot describe; {held}")
    elif exporter.aimet_json == "always" or (exporter.aimet_json == "if_small" and numbers <= AIMET_JSON_LIMIT):
        # (an ONNX graph holds what its example batch ran: the AIMET JSON beside it names the graph's tensors)
        static = [e for e in enc.entries if not e.dynamic and (exporter.name != "onnx" or e.name in names)]
        dynamic = sum(e.dynamic for e in enc.entries)
        if dynamic:  # (the aimet format itself refuses them in its check)
            summary["export_warnings"].append(
                f"model.encodings (AIMET JSON) leaves out {dynamic} dynamic activation "
                "quantizer(s): AIMET encodings are static; the exported model computes their ranges at run time")
        tiles = [e for e in static if block_problem(e.spec)]
        if tiles:  # (as are they: AIMET blocks the input dimension alone)
            static = [e for e in static if not block_problem(e.spec)]
            summary["export_warnings"].append(
                f"model.encodings (AIMET JSON) leaves out {len(tiles)} weight(s) in blocks of "
                f"{list(tiles[0].spec.block_size)} ({tiles[0].name} ...): AIMET encodings block the input "
                "dimension alone; the exported tensors hold their scales")
        static_enc = EncodingsFile(static, enc.meta, enc.data_files, enc.codes_file, enc.online).materialized()
        shared = shared_names(static_enc, eopts.encoding_version, names)
        if shared:
            tensor, readers = shared[0]
            summary["export_warnings"].append(
                f"model.encodings (AIMET JSON) holds one encoding per tensor, and {len(shared)} tensor(s) are read "
                f"by quantizers with different encodings ({tensor}: {', '.join(readers)}): it holds the first's; "
                f"the exported model quantizes each reader its own way")
        aimet = to_aimet(static_enc, eopts.encoding_version, __version__, names=names)
        (out_dir / "model.encodings").write_text(dumps_indented(aimet) + "\n")
    elif exporter.aimet_json == "if_small":
        summary["export_warnings"].append(
            f"model.encodings (AIMET JSON) not written: {numbers:,} encodings would make a JSON file of several GB; "
            f"the scales and offsets are in the exported tensors (qtool export --format aimet writes it anyway)")
    outputs = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
    # what was gained: the checkpoint's weight files against the model files written (not the encodings, manifests
    # or the files copied beside the weights: a tokenizer, a README, .gitattributes)
    model_files = [n for n in outputs if "/" not in n and n.endswith(_MODEL_SUFFIXES)]  # (not a copied module's)
    model_bytes = sum((out_dir / n).stat().st_size for n in model_files)
    missed = _budget_missed(Path(enc_path), eopts.format, options, [out_dir / n for n in model_files])
    if missed:
        summary["export_warnings"].append(missed)
    inputs = {
        "checkpoint": checkpoint_input(checkpoint, digest),
        "encodings": {"path": enc_display or str(enc_path), "sha256": sha256_file(enc_path)},
        **({"encodings_data": [{"path": f.name, "sha256": sha256_file(f)} for f in enc.data_files]}
           if enc.data_files else {}),
    }
    write_manifest(out_dir, manifest("export", inputs, {n: sha256_file(out_dir / n) for n in outputs},
                                     head={"format": eopts.format, "encoding_version": eopts.encoding_version},
                                     device="cpu", options=asdict(options), tail={"summary": summary}))
    summary["outputs"] = outputs + ["manifest.json"]
    summary["size"] = {"checkpoint_bytes": sum(f.stat().st_size for f in tensor_files(Path(checkpoint))),
                       "model_bytes": model_bytes, "model_files": model_files}
    return summary


def _budget_missed(enc_path: Path, fmt: str, options, model_files: List[Path]) -> Optional[str]:
    """The warning for encodings a size-budget search chose (its ``search.json`` beside them) exported in another
    format, or with other options, than it counted (a format that keeps the embedding float, ONNX's float weights,
    --no-pack's byte a code), into more tensor bytes than the budget; None otherwise."""
    exporter = get_exporter(fmt)
    try:
        search = json.loads((enc_path.parent / "search.json").read_text(encoding="utf-8"))
        counted, budget, flag = search["format"], int(search["budget"]["bytes"]), str(search["budget"]["flag"])
        # (a record from before format_options was written counted the format's default options)
        counted_options = search.get("format_options") or asdict(get_exporter(counted).Options())
    except (OSError, ValueError, KeyError, TypeError, UsageError):
        return None
    if counted == fmt and _byte_options(counted_options) == _byte_options(asdict(options)):
        return None
    model_bytes = sum(_tensor_bytes(f) for f in model_files)
    if model_bytes <= budget:
        return None
    if counted == fmt:
        return (f"the size budget ({flag}: {budget} bytes, in {enc_path.parent / 'search.json'}) was met in the "
                f"{counted} format written with {_as_flags(counted_options)}; this export's tensors hold "
                f"{model_bytes} bytes, {model_bytes / budget:.2f}x the budget (export with those options)")
    instead = (f"or run the search as quantize --format {fmt}, which counts that format's bytes"
               if exporter.counts_bytes(exporter.Options()) else
               f"the search does not count --format {fmt}'s bytes, so it cannot hold a budget")
    return (f"the size budget ({flag}: {budget} bytes, in {enc_path.parent / 'search.json'}) was met in the "
            f"{counted} format; this {fmt} export's model files hold {model_bytes} bytes, "
            f"{model_bytes / budget:.2f}x the budget (export with --format {counted}; {instead})")


def _tied_to_a_quantized_table(checkpoint: Path, enc: EncodingsFile, trust_remote_code: bool) -> List[str]:
    """Where a Hugging Face model's layer shares a weight that the encodings quantize and leave this one float (a
    tied output layer in ignore, its embedding table quantized): the file holds the table once, quantized, and a
    runtime that ties them computes that layer with the quantized table, not the float one calibration measured."""
    from ..config.resolve import tied_parameters
    from ..families import family_of_model
    from ..io.checkpoint import detect_kind
    from ..model.hf import hf_name_map, meta_skeleton

    if detect_kind(checkpoint) != "hf":
        return []
    quantized = {e.name for e in enc.entries if e.tensor == "weight"}
    skeleton = meta_skeleton(checkpoint, trust_remote_code)
    # the encodings name weights as the checkpoint does (a multimodal Gemma 3's language_model.model.embed_tokens
    # is model.language_model.embed_tokens once loaded)
    stored_as = {name: key for key, name in hf_name_map(skeleton, tensor_files(checkpoint)).items()}
    tied = {stored_as.get(later, later): stored_as.get(stored, stored)  # (later name -> the stored one)
            for later, stored in tied_parameters(skeleton).items()}
    pairs = [(later, stored) for later, stored in tied.items() if stored in quantized and later not in quantized]
    if not pairs:
        return []
    family = family_of_model(skeleton)
    config = getattr(skeleton, "config", None)
    moe = any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    formats = (["gguf"] if family is not None and family.gguf_arch else []) + ([] if moe else ["onnx"])  # (ONNX
    if not formats:                                                                   # refuses MoE models)
        return []  # (no format stores it apart for this model: the calibration's own warning stands)
    apart = f"{' or '.join(formats)}, which store{'s' if len(formats) == 1 else ''}"
    return [f"{later.rsplit('.', 1)[0]} is left float but shares its weight with {stored}, which this file stores "
            f"quantized (once): a runtime that ties them computes {later.rsplit('.', 1)[0]} with the quantized table, "
            f"not the float one calibration measured; keep the table float too (ignore it), or export with --format "
            f"{apart} the layer apart" for later, stored in pairs]


_MODEL_SUFFIXES = (".safetensors", ".onnx", ".gguf")  # what every format writes its weights as


def _as_flags(options: Dict[str, Any]) -> str:
    """A format's byte-changing options as the export flags that give them."""
    words = {"pack": lambda v: "packed codes (no --no-pack)" if v else "--no-pack",
             "ct_eight_bit_format": lambda v: f"--ct-8bit-format {v}", "gguf_float": lambda v: f"--gguf-float {v}",
             "gguf_fallback": lambda v: f"--gguf-fallback {v}"}
    return ", ".join(words.get(k, lambda v, k=k: f"{k} {v}")(v) for k, v in sorted(_byte_options(options).items()))


def _byte_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """A format's options that change how many bytes its tensors take (how a file is sharded does not)."""
    return {k: v for k, v in options.items() if k != "max_shard_bytes"}


def _tensor_bytes(path: Path) -> int:
    """The bytes a model file's tensors take, what a size budget counts: a safetensors file's data, a GGUF file's
    tensors (not its metadata, a tokenizer's vocabulary among it); an ONNX file whole."""
    if path.suffix == ".safetensors":
        with open(path, "rb") as f:
            return path.stat().st_size - 8 - struct.unpack("<Q", f.read(8))[0]
    if path.suffix == ".gguf":
        import gguf

        return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    return path.stat().st_size


def _identities(encodings: Path) -> Dict[str, Any]:
    """Each file of the calibration an export reads its numbers from (the encodings, their sidecar, the codes): its
    size and time (None where there is none). Not its inode, which some network filesystems do not keep."""
    out: Dict[str, Any] = {}
    for path in [encodings] + [encodings.parent / n for n in (SIDECAR, CODES_FILE) if n != encodings.name]:
        try:
            st = path.stat()
            out[str(path)] = (st.st_size, st.st_mtime_ns)
        except OSError:
            out[str(path)] = None
    return out


def _check_unchanged(before: Dict[str, Any], after: Dict[str, Any]) -> None:
    """Refuse an export whose calibration files were replaced while it read them (another run's ``--overwrite``
    into that directory): its codes could be one calibration's and its scales another's, under a manifest naming
    the second."""
    changed = [p for p in before if before[p] != after.get(p)]
    if changed:
        raise UsageError(f"{changed[0]}: replaced while the export read it (another run wrote that directory?), so "
                         "the file could mix two calibrations: export again once that run is done")


@one_at_a_time
def run_export(checkpoint: str, encodings_path: str, out: str, eopts: Optional[ExportOptions] = None,
               overwrite: bool = False, hooks: Optional[Hooks] = None) -> Dict[str, Any]:
    """``qtool export``: the chosen format plus AIMET encodings, written atomically."""
    check_arguments(checkpoint, paths={"encodings_path": encodings_path, "out": out}, eopts=(eopts, ExportOptions),
                    hooks=(hooks, Hooks))
    checkpoint, encodings_path, out = os.fspath(checkpoint), os.fspath(encodings_path), os.fspath(out)
    hooks = hooks or Hooks()
    eopts = eopts or ExportOptions()
    exporter = eopts.validate()
    check_model_class(Path(checkpoint), eopts.model_class)
    check_output_dir(Path(out), overwrite, _inputs(checkpoint, encodings=encodings_path, data=eopts.data))
    # the integer export reads each weight's block encodings from the sidecar when it gets to that weight
    before = _identities(Path(encodings_path))
    enc = EncodingsFile.read(encodings_path, lazy=exporter.lazy_encodings)
    with atomic_output_dir(Path(out), overwrite) as tmp:
        summary = _export_into(checkpoint, enc, Path(encodings_path), tmp, eopts, hooks,
                               same_weights=True, allow_other=eopts.allow_other_checkpoint)
        _check_unchanged(before, _identities(Path(encodings_path)))
    summary["files"] = [str(Path(out) / n) for n in summary.pop("outputs")]
    return summary


def _without_token_inputs(entries, modules: Dict[str, torch.nn.Module], warnings: List[str], source: str):
    """``entries`` less the input encodings of modules that take token ids (an Embedding's): no quantizer takes
    integers, so such an encoding would be carried into every export and change nothing (a recipe's rule for them
    is refused)."""
    from ..config import takes_token_ids

    kept = []
    for e in entries:
        module = modules.get(e.module)
        if e.tensor == "input" and module is not None and takes_token_ids(module):
            warnings.append(f"{e.name}: token ids (integers, the input of its {type(module).__name__}), which no "
                            "activation quantizer takes; skipped")
            continue
        kept.append(e)
    if entries and not kept:
        raise EncodingsError(f"{source}: nothing to import: its only encodings are of token ids ("
                             f"{entries[0].name!r}), which no activation quantizer takes")
    return kept


@one_at_a_time
def run_import_encodings(checkpoint: str, aimet_path: str, out: str, opts: CalibrateOptions,
                         overwrite: bool = False) -> Dict[str, Any]:
    """``qtool import-encodings``: an AIMET encodings file (any version) -> qtool's encodings.json."""
    from ..aimet_format import from_aimet, read_aimet

    check_arguments(checkpoint, opts, CalibrateOptions, paths={"aimet_path": aimet_path, "out": out})
    checkpoint, aimet_path, out = os.fspath(checkpoint), os.fspath(aimet_path), os.fspath(out)
    opts.check()
    check_output_dir(Path(out), overwrite, _inputs(checkpoint, **{"AIMET encodings": aimet_path}))
    obj = read_aimet(Path(aimet_path))
    loaded = load_model(checkpoint, opts.model_class, "cpu", opts.trust_pickle, opts.trust_remote_code)
    params = dict(loaded.model.named_parameters())
    modules = dict(loaded.model.named_modules())
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    for ckpt_name, model_name in loaded.name_map.items():  # AIMET files name checkpoint tensors
        if model_name in shapes:
            shapes[ckpt_name] = shapes[model_name]

    def module_of(tensor_name: str) -> Optional[str]:
        name = loaded.name_map.get(tensor_name, tensor_name)
        mod = name.rsplit(".", 1)[0] if "." in name else ""
        return mod if mod in modules and name.endswith(".weight") else None

    enc, warnings = from_aimet(obj, shapes, str(aimet_path), module_of)
    enc.entries = _without_token_inputs(enc.entries, modules, warnings, str(aimet_path))
    stored_as = getattr(loaded.model, CHECKPOINT_KEYS, None) or {}
    for e in enc.entries:  # a weight's entry is named as calibrate names it: by its checkpoint tensor (a ViT's
        if e.tensor == "weight":  # vit.encoder.layer.0.attention.attention.query.weight, not the module's name)
            e.name = stored_as.get(f"{e.module}.weight", f"{e.module}.weight")
    plan_from_encodings(enc, loaded.model, str(aimet_path))
    enc.meta["qtool_version"] = __version__
    with atomic_output_dir(Path(out), overwrite) as tmp:
        enc_files = enc.write(tmp / "encodings.json")
        inputs = {"checkpoint": checkpoint_input(checkpoint, digests(loaded.files), hub=False),
                  "aimet_encodings": {"path": str(aimet_path), "version": str(obj["version"]),
                                      "sha256": sha256_file(Path(aimet_path))}}
        write_manifest(tmp, manifest("import-encodings", inputs, digests(enc_files, key=lambda f: f.name),
                                     tail={"warnings": warnings}))
    return {"quantizers": len(enc.entries), "warnings": warnings,
            "files": [str(Path(out) / f.name) for f in enc_files] + [str(Path(out) / "manifest.json")]}
