"""The user-level jobs: plan, calibrate, export, and a calibrated model for Python use.

Each job returns data (a summary dict) and reports progress through callbacks; it never prints.
"""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import __version__
from .calibrate import calibrate
from .config import Plan, QuantizerPlan, load_recipe, resolve_plan
from .data import CalibrationData, load_data
from .encodings import SIDECAR, EncodingEntry, EncodingsFile
from .errors import EncodingsError, UsageError
from .export.integer import DEFAULT_MAX_SHARD_BYTES, export_integer
from .fsutil import atomic_output_dir, check_output_dir, sha256_file
from .model.insert import insert_quantizers
from .model.load import LoadedModel, load_model, tensor_files

__all__ = ["CalibrateOptions", "plan_for", "run_calibrate", "run_export", "load_calibrated", "versions"]


@dataclass
class CalibrateOptions:
    data: Optional[str] = None
    device: str = "cpu"
    batch_size: int = 8
    num_samples: Optional[int] = None
    seq_len: int = 128
    seed: int = 0
    model_class: Optional[str] = None
    trust_pickle: bool = False
    trust_remote_code: bool = False
    allow_unmatched: bool = False
    sequential: bool = False


class Hooks:
    """Callbacks a front end may set: ``on_plan(plan)``, ``on_batch(done, total, samples)``,
    ``on_tensor(done, total, name)``, ``on_stage(text)``."""

    def __init__(self, on_plan=None, on_batch=None, on_tensor=None, on_stage=None, on_block=None):
        self.on_block = on_block
        self.on_plan = on_plan or (lambda plan: None)
        self.on_batch = on_batch
        self.on_tensor = on_tensor
        self.on_stage = on_stage or (lambda text: None)


def versions() -> Dict[str, str]:
    out = {"qtool": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:  # optional extra
        pass
    return out


def _files_digest(files: List[Path]) -> Dict[str, str]:
    return {str(f): sha256_file(f) for f in files}


def plan_for(checkpoint: str, recipe_path: str, opts: CalibrateOptions) -> Tuple[LoadedModel, Plan]:
    recipe = load_recipe(recipe_path)  # validate the recipe before the (slow) model load
    loaded = load_model(checkpoint, opts.model_class, opts.device, opts.trust_pickle, opts.trust_remote_code)
    plan = resolve_plan(recipe, loaded.model, source=str(recipe_path), allow_unmatched=opts.allow_unmatched)
    return loaded, plan


def _calibrate_into(checkpoint: str, recipe_path: str, opts: CalibrateOptions, run_dir: Path, hooks: Hooks):
    hooks.on_stage("loading checkpoint")
    streaming = None
    if opts.sequential:
        from .config import load_recipe
        from .model.load import detect_kind, resolve_device
        from .sequential import meta_model

        recipe = load_recipe(recipe_path)
        if detect_kind(Path(checkpoint)) != "hf":
            raise UsageError("--sequential needs a Hugging Face causal LM directory")
        device = resolve_device(opts.device)
        model, _, tokenizer = meta_model(checkpoint, opts.trust_remote_code)
        plan = resolve_plan(recipe, model, source=str(recipe_path), allow_unmatched=opts.allow_unmatched)
        files, kind = tensor_files(Path(checkpoint)), "hf"
    else:
        from .model.load import detect_kind, resolve_device

        streaming = None
        if opts.data is None and detect_kind(Path(checkpoint)) == "hf":
            # a weight-only recipe on a Hugging Face directory needs no model: stream the weights
            from .config import load_recipe
            from .sequential import meta_skeleton

            recipe = load_recipe(recipe_path)
            skeleton = meta_skeleton(checkpoint, opts.trust_remote_code)
            sk_plan = resolve_plan(recipe, skeleton, source=str(recipe_path), allow_unmatched=opts.allow_unmatched)
            if not sk_plan.needs_data():
                streaming, plan, model = sk_plan, sk_plan, skeleton
                tokenizer, files, kind = None, tensor_files(Path(checkpoint)), "hf"
                device = resolve_device(opts.device)
        if streaming is None:
            loaded, plan = plan_for(checkpoint, recipe_path, opts)
            model, tokenizer, files, kind = loaded.model, loaded.tokenizer, loaded.files, loaded.kind
            device = next(iter(model.parameters())).device
    causal = opts.sequential or type(model).__name__.endswith("ForCausalLM")
    hooks.on_plan(plan)
    data: Optional[CalibrationData] = None
    if plan.needs_data() or opts.data or opts.sequential:
        if opts.data is None:
            from .errors import DataError

            why = "--sequential runs the model block by block" if opts.sequential else \
                "the recipe quantizes activations"
            raise DataError(f"{why}, which needs calibration data: pass --data PATH")
        hooks.on_stage("reading calibration data")
        data = load_data(opts.data, opts.batch_size, opts.num_samples, opts.seed, opts.seq_len, tokenizer,
                         pack_text=causal)
    hooks.on_stage("calibrating")
    if not opts.sequential and streaming is not None:
        from .sequential import calibrate_weights_streaming

        from .encodings import SidecarStream

        stream = SidecarStream(run_dir / SIDECAR, [(q.name, tuple(q.shape)) for q in plan.weights])
        try:
            entries = calibrate_weights_streaming(checkpoint, plan, model, sink=stream.put)
        except BaseException:
            stream.abort()
            raise
        stream.close()
        unused = []
    elif opts.sequential:
        from .sequential import calibrate_sequential

        entries = calibrate_sequential(checkpoint, plan, data, device, model, on_block=hooks.on_block)
        done = {e.name for e in entries}
        unused = [q.name for q in plan.activations if q.name not in done]
    else:
        quantizers = insert_quantizers(model, plan)
        result = calibrate(model, plan, quantizers, data if plan.needs_data() else None, device, hooks.on_batch)
        entries = [EncodingEntry.from_quantizer(q, quantizers[q.name]) for q in plan.quantizers
                   if quantizers[q.name].is_initialized()]
        unused = result.unused
    enc = EncodingsFile(entries, {"qtool_version": __version__, "recipe": Path(recipe_path).name})
    enc_path = run_dir / "encodings.json"
    enc_files = enc.write(enc_path)
    manifest = {
        "command": "calibrate",
        "versions": versions(),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "options": {k: v for k, v in asdict(opts).items()},
        "inputs": {
            "checkpoint": {"path": str(checkpoint), "kind": kind, "sha256": _files_digest(files)},
            "recipe": {"path": str(recipe_path), "sha256": sha256_file(Path(recipe_path))},
            "data": None if data is None else {"path": str(opts.data), "samples": data.num_samples,
                                               "sha256": _files_digest(data.files)},
        },
        "outputs": {f.name: sha256_file(f) for f in enc_files},
        "quantizers": len(entries),
        "uncalibrated": unused,
        "warnings": plan.warnings,
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    summary = {"encodings": str(enc_path), "quantizers": len(entries), "weights": len(plan.weights),
               "activations": len(plan.activations), "uncalibrated": unused,
               "samples": 0 if data is None else data.num_samples, "device": str(device),
               "warnings": plan.warnings, "outputs": [f.name for f in enc_files] + ["manifest.json"]}
    return summary


def run_calibrate(checkpoint: str, recipe_path: str, out: str, opts: CalibrateOptions, overwrite: bool = False,
                  hooks: Optional[Hooks] = None) -> Dict[str, Any]:
    """``qtool calibrate``: write ``out/encodings.json`` and ``out/manifest.json`` atomically."""
    hooks = hooks or Hooks()
    check_output_dir(Path(out), overwrite)
    with atomic_output_dir(Path(out), overwrite) as tmp:
        summary = _calibrate_into(checkpoint, recipe_path, opts, tmp, hooks)
    summary["encodings"] = str(Path(out) / "encodings.json")
    summary["files"] = [str(Path(out) / n) for n in summary.pop("outputs")]
    return summary


@dataclass
class ExportOptions:
    format: str = "qtool"  # qtool | aimet | onnx | compressed-tensors
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


FORMATS = ("qtool", "aimet", "onnx", "compressed-tensors")
# beyond this many encoding numbers, the AIMET JSON beside a non-AIMET export is skipped (~100 bytes per number)
AIMET_JSON_LIMIT = 10_000_000


def _weight_names(checkpoint: str, enc: EncodingsFile, trust_pickle: bool) -> Dict[str, str]:
    from .export.integer import match_weight_names
    from .model.load import CheckpointTensors

    src = CheckpointTensors(Path(checkpoint), trust_pickle=trust_pickle)
    return match_weight_names([e for e in enc.entries if e.tensor == "weight"], src.keys(), str(checkpoint))


def _export_into(checkpoint: str, enc: EncodingsFile, enc_path: Path, out_dir: Path, eopts: ExportOptions,
                 hooks: Hooks, enc_display: Optional[str] = None) -> Dict[str, Any]:
    from .aimet_format import VERSIONS, to_aimet

    if eopts.format not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)} (got {eopts.format!r})")
    if eopts.encoding_version not in VERSIONS:
        raise UsageError(f"--encoding-version must be one of {', '.join(VERSIONS)} (got {eopts.encoding_version!r})")
    hooks.on_stage(f"exporting ({eopts.format})")
    summary: Dict[str, Any] = {"format": eopts.format}
    names: Dict[str, str] = {}
    if eopts.format == "qtool":
        summary.update(export_integer(Path(checkpoint), enc, out_dir, trust_pickle=eopts.trust_pickle,
                                      progress=hooks.on_tensor, pack=eopts.pack, max_shard_bytes=eopts.max_shard_bytes))
        names = summary.pop("names")
    elif eopts.format == "aimet":
        names = _weight_names(checkpoint, enc, eopts.trust_pickle)
    elif eopts.format == "onnx":
        from .export.onnx_qdq import export_onnx

        summary.update(export_onnx(checkpoint, enc, out_dir, eopts))
        names = summary.pop("names")
    else:
        from .export.compressed_tensors import export_compressed_tensors

        summary.update(export_compressed_tensors(Path(checkpoint), enc, out_dir, trust_pickle=eopts.trust_pickle,
                                                 progress=hooks.on_tensor, eight_bit_format=eopts.ct_eight_bit_format,
                                                 trust_remote_code=eopts.trust_remote_code))
    summary["export_warnings"] = summary.pop("warnings", [])
    numbers = sum(e.numel() for e in enc.entries)
    if eopts.format == "aimet" or (eopts.format != "compressed-tensors" and numbers <= AIMET_JSON_LIMIT):
        aimet = to_aimet(enc.materialized(), eopts.encoding_version, __version__, names=names)
        (out_dir / "model.encodings").write_text(json.dumps(aimet, indent=1) + "\n")
    elif eopts.format != "compressed-tensors":
        summary["export_warnings"].append(
            f"model.encodings (AIMET JSON) not written: {numbers:,} encodings would make a JSON file of several GB; "
            f"the scales and offsets are in the exported tensors (qtool export --format aimet writes it anyway)")
    outputs = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
    manifest = {
        "command": "export",
        "format": eopts.format,
        "encoding_version": eopts.encoding_version,
        "versions": versions(),
        "device": "cpu",
        "inputs": {
            "checkpoint": {"path": str(checkpoint), "sha256": _files_digest(tensor_files(Path(checkpoint)))},
            "encodings": {"path": enc_display or str(enc_path), "sha256": sha256_file(enc_path)},
            **({"encodings_data": [{"path": f.name, "sha256": sha256_file(f)} for f in enc.data_files]}
               if enc.data_files else {}),
        },
        "outputs": {n: sha256_file(out_dir / n) for n in outputs},
        "summary": summary,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    summary["outputs"] = outputs + ["manifest.json"]
    return summary


def run_export(checkpoint: str, encodings_path: str, out: str, eopts: Optional[ExportOptions] = None,
               overwrite: bool = False, hooks: Optional[Hooks] = None) -> Dict[str, Any]:
    """``qtool export``: the chosen format plus AIMET encodings, written atomically."""
    hooks = hooks or Hooks()
    eopts = eopts or ExportOptions()
    check_output_dir(Path(out), overwrite)
    # the integer export reads each weight's block encodings from the sidecar when it gets to that weight
    enc = EncodingsFile.read(encodings_path, lazy=eopts.format == "qtool")
    with atomic_output_dir(Path(out), overwrite) as tmp:
        summary = _export_into(checkpoint, enc, Path(encodings_path), tmp, eopts, hooks)
    summary["files"] = [str(Path(out) / n) for n in summary.pop("outputs")]
    return summary


def run_import_encodings(checkpoint: str, aimet_path: str, out: str, opts: CalibrateOptions,
                         overwrite: bool = False) -> Dict[str, Any]:
    """``qtool import-encodings``: an AIMET encodings file (any version) -> qtool's encodings.json."""
    from .aimet_format import from_aimet, read_aimet

    check_output_dir(Path(out), overwrite)
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
    for e in enc.entries:  # entries were keyed by checkpoint names; qtool keys by module names
        if e.tensor == "weight":
            e.name = f"{e.module}.weight"
    plan_from_encodings(enc, loaded.model, str(aimet_path))
    enc.meta["qtool_version"] = __version__
    with atomic_output_dir(Path(out), overwrite) as tmp:
        enc_files = enc.write(tmp / "encodings.json")
        manifest = {"command": "import-encodings", "versions": versions(),
                    "inputs": {"checkpoint": {"path": str(checkpoint), "sha256": _files_digest(loaded.files)},
                               "aimet_encodings": {"path": str(aimet_path), "version": str(obj["version"]),
                                                   "sha256": sha256_file(Path(aimet_path))}},
                    "outputs": {f.name: sha256_file(f) for f in enc_files}, "warnings": warnings}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return {"quantizers": len(enc.entries), "warnings": warnings,
            "files": [str(Path(out) / f.name) for f in enc_files] + [str(Path(out) / "manifest.json")]}


def run_quantize(checkpoint: str, recipe_path: str, out: str, opts: CalibrateOptions, overwrite: bool = False,
                 hooks: Optional[Hooks] = None, eopts: Optional[ExportOptions] = None) -> Dict[str, Any]:
    """``qtool quantize``: calibrate and export into one directory (encodings.json included)."""
    hooks = hooks or Hooks()
    check_output_dir(Path(out), overwrite)
    with atomic_output_dir(Path(out), overwrite) as tmp:
        calib_dir = tmp / "calibration"
        calib_dir.mkdir()
        csum = _calibrate_into(checkpoint, recipe_path, opts, calib_dir, hooks)
        enc_path = calib_dir / "encodings.json"
        eopts = eopts or ExportOptions()
        eopts.trust_pickle, eopts.model_class = opts.trust_pickle, opts.model_class
        eopts.trust_remote_code = opts.trust_remote_code
        eopts.data = eopts.data or opts.data
        eopts.seq_len = opts.seq_len
        esum = _export_into(checkpoint, EncodingsFile.read(enc_path, lazy=eopts.format == "qtool"), enc_path, tmp,
                            eopts, hooks,
                            enc_display="calibration/encodings.json")  # relative: the temp dir name is random
    out_p = Path(out)
    files = [str(out_p / n) for n in esum.pop("outputs") if not n.startswith("calibration/")]
    calib_files = [str(out_p / "calibration" / n) for n in csum.pop("outputs")]
    return {**csum, **esum, "encodings": str(out_p / "calibration" / "encodings.json"), "files": files + calib_files}


def plan_from_encodings(enc: EncodingsFile, model: nn.Module, source: str) -> Plan:
    modules = dict(model.named_modules())
    rows = []
    for e in enc.entries:
        if e.module not in modules:
            raise EncodingsError(f"{source}: module {e.module!r} is not in this model; were the encodings made "
                                 "for another model?")
        rows.append(QuantizerPlan(e.name, e.module, type(modules[e.module]).__name__, e.tensor, e.bitwidth,
                                  e.symmetric, e.granularity, e.shape, e.block_size, e.analyzer))
    return Plan(rows)


def load_calibrated(checkpoint: str, encodings: str, model_class: Optional[str] = None, device: str = "cpu",
                    trust_pickle: bool = False, trust_remote_code: bool = False) -> nn.Module:
    """The checkpoint's model with fake-quant modules set from ``encodings`` (qtool's encodings.json)."""
    loaded = load_model(checkpoint, model_class, device, trust_pickle, trust_remote_code)
    apply_encodings(loaded.model, EncodingsFile.read(encodings), str(encodings))
    loaded.model.qtool_tokenizer = loaded.tokenizer  # handy for evaluation code
    return loaded.model


def apply_encodings(model: nn.Module, enc: EncodingsFile, source: str):
    """Insert quantizers as ``enc`` describes and set their ranges; returns them by quantizer name."""
    plan = plan_from_encodings(enc, model, source)
    quantizers = insert_quantizers(model, plan)
    modules = dict(model.named_modules())
    for e in enc.entries:
        if e.tensor == "weight":
            w = modules[e.module]._parameters.get("weight")
            try:
                quantizers[e.name].check_input(w)
            except (ValueError, AttributeError) as err:
                raise EncodingsError(f"{source}: {e.name}: does not fit the model's weight ({err})") from None
        quantizers[e.name].set_range(e.min.to(quantizers[e.name].min.device), e.max.to(quantizers[e.name].max.device))
    return quantizers


def run_report(checkpoint: str, encodings: str, opts: CalibrateOptions, sensitivity_analysis: bool = False,
               hooks: Optional[Hooks] = None) -> Dict[str, Any]:
    """``qtool report``: per-layer SQNR, end-to-end fidelity and (optionally) layer sensitivity."""
    from .report import evaluate, sensitivity

    hooks = hooks or Hooks()
    hooks.on_stage("loading checkpoint")
    loaded = load_model(checkpoint, opts.model_class, opts.device, opts.trust_pickle, opts.trust_remote_code)
    enc = EncodingsFile.read(encodings)
    apply_encodings(loaded.model, enc, str(encodings))
    if opts.data is None:
        from .errors import DataError

        raise DataError("qtool report runs the model: pass --data PATH (text or tensors)")
    data = load_data(opts.data, opts.batch_size, opts.num_samples, opts.seed, opts.seq_len, loaded.tokenizer,
                     pack_text=loaded.is_causal_lm)
    device = next(iter(loaded.model.parameters())).device
    hooks.on_stage("measuring")
    rep = evaluate(loaded.model, data, device, loaded.is_causal_lm, hooks.on_batch)
    out = {"report": rep, "json": rep.to_json(), "causal_lm": loaded.is_causal_lm}
    if sensitivity_analysis:
        hooks.on_stage("ranking layer sensitivity")
        out["sensitivity"] = sensitivity(loaded.model, data, device, loaded.is_causal_lm, hooks.on_tensor)
        out["json"]["sensitivity"] = out["sensitivity"]
    return out
