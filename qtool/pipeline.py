"""The user-level jobs: plan, calibrate, export, and a calibrated model for Python use.

Each job returns data (a summary dict) and reports progress through callbacks; it never prints.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from . import __version__
from .calibration import CalibrateOptions, calibrate_checkpoint
from .choices import AIMET_VERSIONS, CT_EIGHT_BIT_FORMATS, GGUF_FALLBACKS, GGUF_FLOAT_TYPES, check_choice
from .config import Plan, RecipeFile, load_recipe, read_recipe, recipe_file, resolve_plan
from .data import load_data
from .encodings import CODES_FILE, SIDECAR, EncodingsFile
from .errors import DataError, EncodingsError, UsageError
from .export import format_names, get_exporter
from .export.base import ExportRequest
from .export.qtool_st import DEFAULT_MAX_SHARD_BYTES
from .hooks import Hooks
from .io.checkpoint import tensor_files
from .io.fs import atomic_output_dir, check_output_dir, check_output_file, sha256_file
from .io.jsonfile import dumps_indented
from .model.apply import apply_encodings, make_fake_quant, plan_from_encodings
from .model.load import LoadedModel, load_model
from .parallel import Group, from_environment
from .provenance import device_label, versions
from .weights import write_codes

__all__ = ["CalibrateOptions", "ExportOptions", "Hooks", "plan_for", "run_calibrate", "run_export", "run_quantize",
           "run_import_encodings", "run_report", "load_calibrated", "versions", "apply_encodings"]


def _inputs(checkpoint: str, **others: Optional[str]) -> List[Tuple[str, Optional[str]]]:
    """The inputs an --out must not be, hold or lie inside (for check_output_dir); a shipped recipe's name is its
    file."""
    if isinstance(others.get("recipe"), RecipeFile):
        others["recipe"] = others["recipe"].path
    elif others.get("recipe") is not None:
        try:
            others["recipe"] = str(recipe_file(others["recipe"]))
        except UsageError:
            others["recipe"] = None  # reported where the recipe is read
    return [("checkpoint", checkpoint)] + [(what.replace("_", " "), path) for what, path in others.items()]


def _search_inputs(target: Optional["TargetOptions"]) -> List[Tuple[str, Optional[str]]]:
    """A size-budget search's own inputs for check_output_dir: its --search-data and the candidates' recipe files."""
    if target is None:
        return []
    return [("search data", target.data)] + [("candidate recipe", r.path) for r in _target_candidates(target)]


def _hub(checkpoint) -> Dict[str, Any]:
    """``{"hub": {repo_id, revision, commit}}`` for a checkpoint resolved from a Hugging Face Hub ID, else {}."""
    from .model.hub import origin

    found = origin(checkpoint)
    return {"hub": found} if found else {}


def _files_digest(files: List[Path]) -> Dict[str, str]:
    return {str(f): sha256_file(f) for f in files}


def plan_for(checkpoint: str, recipe_path: str, opts: CalibrateOptions) -> Tuple[LoadedModel, Plan]:
    """The checkpoint's model and the plan the recipe resolves to on it."""
    recipe = load_recipe(recipe_path)  # validate the recipe before the (slow) model load
    loaded = load_model(checkpoint, opts.model_class, opts.device, opts.trust_pickle, opts.trust_remote_code)
    plan = resolve_plan(recipe, loaded.model, source=str(recipe_path), allow_unmatched=opts.allow_unmatched)
    return loaded, plan


@contextlib.contextmanager
def _ranks(device: str):
    """The process group a launcher (torchrun) describes, or one process. A failure on any rank reaches every
    rank (:meth:`qtool.parallel.Group.abort`): the failing rank raises its own error, marked with ``dist_rank``
    (the CLI prefixes its line), the others a quiet ``PeerFailed`` with the same exit code."""
    group = from_environment(device)
    try:
        yield group
        group.finish()
    except BaseException as e:
        raise group.abort(e)
    finally:
        group.close()


def _check_resume(opts: CalibrateOptions, target: Optional["TargetOptions"]) -> None:
    if opts.resume and not opts.sequential:
        raise UsageError("--resume continues a --sequential run (the one mode that keeps a state): add --sequential")
    if opts.resume and target is not None:
        raise UsageError("--resume does not cover a size-budget search (--target-bpw/--target-size): its "
                         "calibrations are short; run it again without --resume")


def _state_dir(out: str, opts: CalibrateOptions, target: Optional["TargetOptions"]) -> Optional[Path]:
    """Where a run writing ``out`` keeps its resumable state: ``OUT.resume`` for --sequential runs (each block's
    results; removed once the output is written), none for the others."""
    from .calibration.resume import state_dir

    return state_dir(Path(out)) if opts.sequential and target is None else None


def _drop_state(out: str, opts: CalibrateOptions, target: Optional["TargetOptions"], group: Group) -> None:
    """The run's output is written (rank 0) or its calibration is done (the others): its state goes."""
    from .calibration.resume import remove_state

    directory = _state_dir(out, opts, target)
    if directory is not None:
        remove_state(directory, group.rank, group.is_root)


def _calibrate_into(checkpoint: str, recipe_path: Union[str, RecipeFile], opts: CalibrateOptions, run_dir: Optional[Path],
                    hooks: Hooks, group: Optional[Group] = None, search: Optional[Dict[str, Any]] = None,
                    last: bool = True, state: Optional[Path] = None):
    """Calibrate and write the run's files into ``run_dir``. In a distributed run every rank calibrates; rank 0
    alone writes (``run_dir`` is None on the others, which return None). ``search``: the record of a size-budget
    search that wrote this recipe (``recipe.yaml`` in the output directory). ``last``: no collective step follows
    but the run's end (a search's intermediate calibrations pass False: :meth:`Group.calibrated`). ``state``: where
    a sequential run keeps what it has finished (:func:`_state_dir`)."""
    group = group or Group()
    read = read_recipe(recipe_path)  # a shipped recipe's name -> its file (hashed in the manifest)
    recipe, recipe_path = read.recipe, read.path
    run = calibrate_checkpoint(checkpoint, recipe, str(recipe_path), opts,
                               run_dir / SIDECAR if run_dir is not None else None, hooks, group, state)
    group.calibrated(last)
    if not group.is_root:
        return None
    entries, plan, data, device, files, kind, unused = (run.entries, run.plan, run.data, run.device, run.files,
                                                         run.kind, run.unused)
    meta = {"qtool_version": __version__, "recipe": Path(recipe_path).name,
            **({"gguf_mix": recipe.gguf_mix} if recipe.gguf_mix is not None else {})}  # (the GGUF file's type)
    enc = EncodingsFile(entries, meta,
                        online=_online_rotations(plan, entries))
    if run.codes or run.floats:  # chosen codes and transformed floats: every exporter writes these (qtool.weights)
        write_codes(run_dir / CODES_FILE, entries, run.codes, run.floats)
        enc.codes_file = CODES_FILE
    enc_path = run_dir / "encodings.json"
    enc_files = enc.write(enc_path)
    manifest = {
        "command": "calibrate",
        "versions": versions(),
        "device": device_label(device),
        # an option added later is recorded only where it is used, so older runs' manifests keep their bytes
        "options": {k: v for k, v in asdict(opts).items()  # (a resumed run writes the bytes of an uninterrupted one)
                    if not (k == "imatrix" and v is None) and not (k in ("strict_data", "all_experts") and not v)
                    and k != "resume"},
        "inputs": {
            "checkpoint": {"path": str(checkpoint), "kind": kind, "sha256": _files_digest(files),
                           **_hub(checkpoint)},
            "recipe": {"path": "recipe.yaml" if search else str(recipe_path),
                       "sha256": read.sha256},
            "data": None if data is None else {"path": str(opts.data), "samples": data.num_samples,
                                               "sha256": _files_digest(data.files)},
            **({"imatrix": {"path": str(opts.imatrix), "sha256": sha256_file(Path(opts.imatrix)),
                            "weights": sum(q.imatrix for q in plan.weights)}} if opts.imatrix else {}),
        },
        "outputs": {f.name: sha256_file(f) for f in enc_files},
        "quantizers": len(entries),
        **({"rounding": {q.name: q.rounding for q in plan.weights if q.name in run.codes}} if run.codes else {}),
        **({"batch_norm_folds": [{"conv": f.conv, "bn": f.bn} for f in plan.folds]} if plan.folds else {}),
        **({"rotation": {"rotations": list(plan.rotation.rotations), "type": plan.rotation.kind,
                         "seed": plan.rotation.seed, "untied": [plan.rotation.head] if plan.rotation.untie else [],
                         "replaced": len(run.floats)}} if plan.rotation else {}),
        **({"smoothquant": {"alpha": plan.smoothing[0].alpha,
                            "groups": [{"smooth": g.smooth, "balance": list(g.balance)} for g in plan.smoothing],
                            "replaced": sorted(run.floats)}} if plan.smoothing else {}),
        **({"target": {"budget": search["budget"], "format": search["format"], "candidates": search["candidates"],
                       "chosen": search["chosen"]}} if search else {}),
        "uncalibrated": unused,
        **({"expert_tokens": plan.expert_tokens} if plan.expert_tokens else {}),
        "warnings": plan.warnings,
        **({"distributed": {"world_size": group.world_size, "backend": group.backend,
                            "samples_per_rank": run.samples_per_rank}} if group.distributed else {}),
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    summary = {"encodings": str(enc_path), "quantizers": len(entries), "weights": len(plan.weights),
               "activations": len(plan.activations), "uncalibrated": unused,
               "weights_quantized": plan.coverage.to_json() if plan.coverage is not None else None,
               "expert_tokens": plan.expert_tokens,
               "samples": 0 if data is None else data.num_samples, "device": str(device),
               "warnings": plan.warnings, "outputs": [f.name for f in enc_files] + ["manifest.json"],
               **({"world_size": group.world_size, "samples_per_rank": run.samples_per_rank}
                  if group.distributed else {})}
    return summary


def _online_rotations(plan: Plan, entries) -> list:
    """The plan's online rotations as the encodings file records them: r3 only on the attention layers whose KV
    cache quantizer was calibrated (one that saw no data is left out of the file, and so is its rotation)."""
    kv = {e.module for e in entries if e.tensor == "k_cache"}
    out = []
    for rot in plan.rotation.online() if plan.rotation else []:
        if rot.location == "k_cache":
            rot = replace(rot, modules=tuple(m for m in rot.modules if m in kv))
        if rot.modules:
            out.append(rot)
    return out


def _other_rank(checkpoint: str, recipe_path: Optional[RecipeFile], opts: CalibrateOptions, out: str, hooks: Hooks,
                group: Group, target: Optional[TargetOptions], exporter, options) -> Dict[str, Any]:
    """What a rank other than 0 does in ``calibrate`` and ``quantize``: calibrate its shard, and, searching
    (``target``), measure its share of the search samples, in its own scratch directory (the chosen recipe and the
    calibrations it measures, copied from rank 0: ranks need not share a filesystem) beside the output directory
    (where the model's files must fit anyway; the system's temporary directory is often small). Rank 0 writes."""
    if target is None:
        _calibrate_into(checkpoint, recipe_path, opts, None, hooks, group, state=_state_dir(out, opts, target))
        _drop_state(out, opts, target, group)  # (this rank's block outputs: its calibration is done)
    else:
        import tempfile

        parent = Path(out).resolve().parent
        with tempfile.TemporaryDirectory(prefix=".qtool-rank-", dir=parent if parent.is_dir() else None) as d:
            recipe_path, record = _searched(checkpoint, target, opts, exporter, options, Path(d), hooks, group)
            _calibrate_searched(checkpoint, recipe_path, record, target, opts, Path(d) / "run", hooks, group)
    return {"rank": group.rank, "world_size": group.world_size}


def _share_run(group: Group, run_dir: Path) -> None:
    """Rank 0's calibration files in ``run_dir`` copied into every other rank's ``run_dir``, so each rank can load
    the calibrated model (one broadcast from rank 0; nothing in one process)."""
    if not group.distributed:
        return
    files = group.broadcast({f.name: f.read_bytes() for f in sorted(run_dir.iterdir()) if f.is_file()}
                            if group.is_root else None)
    if not group.is_root:
        run_dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (run_dir / name).write_bytes(data)


def _searched(checkpoint: str, target: TargetOptions, opts: CalibrateOptions, exporter, options, tmp: Path,
              hooks: Hooks, group: Optional[Group] = None) -> Tuple[str, Dict[str, Any]]:
    """Run the size-budget search into ``tmp/recipe.yaml``: (its path, the search record). Under torchrun every
    rank runs it (each calibrates its shard and measures its share of the search samples) and gets the same
    choice; ``tmp`` is each rank's own directory."""
    import shutil

    work = tmp / ".search"
    state = measure_candidates(checkpoint, target, opts, exporter, options, work, hooks, group=group)
    shutil.rmtree(work, ignore_errors=True)
    text, record = choose_recipe(state, target)
    del state
    path = tmp / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path), record


def _calibrate_searched(checkpoint: str, recipe_path: str, record: Dict[str, Any], target: TargetOptions,
                        opts: CalibrateOptions, run_dir: Path, hooks: Hooks, group: Group) -> Dict[str, Any]:
    """Calibrate the searched recipe into ``run_dir`` and measure the chosen model as deployed. Where a uniform
    candidate that fits the budget measured less damage (the per-layer changes did not add up), that candidate is
    calibrated instead and ``recipe.yaml`` becomes it: the search never hands back a model it measured worse than
    one it could have picked whole. Returns the calibration summary with ``target`` (None on ranks other than 0,
    whose ``run_dir`` is their own scratch copy of rank 0's files)."""
    root = group.is_root
    summary = _calibrate_into(checkpoint, recipe_path, opts, run_dir if root else None, hooks, group, search=record,
                              last=False)
    _share_run(group, run_dir)
    chosen = record["chosen"]
    chosen["damage"], perplexity = _measured_damage(checkpoint, run_dir / "encodings.json", record, target, opts,
                                                    hooks, group)
    if perplexity is not None:
        chosen["perplexity"] = perplexity
    # the measure the choice minimized: KL (or 1 - cosine) from the float model, or the search text's perplexity
    key = "perplexity" if target.metric == "nll" else "damage"
    fits = [u for u in record["uniform"] if u["bytes"] <= record["budget"]["bytes"]]
    best = min(fits, key=lambda u: u[key], default=None)
    if best is not None and best[key] < chosen[key]:
        hooks.on_stage(f"the mix measured {key} {chosen[key]:.4g}, above uniform {best['candidate']}'s "
                       f"{best[key]:.4g}: calibrating {best['candidate']} instead")
        record["fallback"] = {"candidate": best["candidate"], "mix_bytes": chosen["bytes"],
                              "mix_damage": chosen["damage"], "mix_predicted_damage": chosen["predicted_damage"],
                              **({"mix_predicted_nll_change": chosen["predicted_nll_change"]}
                                 if "predicted_nll_change" in chosen else {}),
                              **({"mix_perplexity": chosen["perplexity"]} if "perplexity" in chosen else {})}
        c = record["candidates"].index(best["candidate"])
        text = _target_candidates(target)[c].text
        what = "perplexity on the search text" if key == "perplexity" else "damage"
        Path(recipe_path).write_text(
            f"# qtool {target.flag()} --candidates {','.join(target.candidates)}: the searched mix measured more "
            f"{what} ({chosen[key]:.4g})\n# than this candidate whole ({best[key]:.4g}), which fits the "
            f"budget, so it is this candidate.\n" + text, encoding="utf-8")
        for name in ("encodings.json", SIDECAR, CODES_FILE, "manifest.json"):
            (run_dir / name).unlink(missing_ok=True)
        record["chosen"] = {"bytes": best["bytes"], "bits_per_weight": best["bits_per_weight"],
                            "predicted_damage": best["predicted_damage"], "damage": best["damage"],
                            **({"perplexity": best["perplexity"]} if "perplexity" in best else {}),
                            "groups": {n: (len(record["groups"]) if n == best["candidate"] else 0)
                                       for n in record["candidates"]}}
        summary = _calibrate_into(checkpoint, recipe_path, opts, run_dir if root else None, hooks, group,
                                  search=record)
    else:
        group.calibrated()  # rank 0 writes the search record next: a failure there reaches the others at the end
    if not root:
        return None
    _write_search(run_dir, record)
    summary["target"] = {k: record[k] for k in ("budget", "format", "candidates", "damage", "ranked_by",
                                                "float_perplexity", "chosen", "uniform") if k in record}
    if "fallback" in record:
        summary["target"]["fallback"] = record["fallback"]
    return summary


def _budget_exporter(target: TargetOptions):
    """The format a ``calibrate`` budget counts in: GGUF when a candidate uses llama.cpp's types, else qtool's."""
    def uses_gguf(recipe) -> bool:
        weights = recipe.defaults.weights
        return (recipe.gguf_mix is not None or (weights is not None and weights.gguf_type is not None)
                or any("gguf_type" in (rule.weights or {}) for rule in recipe.layers))

    gguf = any(uses_gguf(r.recipe) for r in _target_candidates(target))
    exporter = get_exporter("gguf" if gguf else "qtool")
    return exporter, exporter.options()


def run_calibrate(checkpoint: str, recipe_path: Union[None, str, RecipeFile], out: str, opts: CalibrateOptions,
                  overwrite: bool = False, hooks: Optional[Hooks] = None,
                  target: Optional[TargetOptions] = None) -> Dict[str, Any]:
    """``qtool calibrate``: write ``out/encodings.json`` and ``out/manifest.json`` atomically. With ``target``,
    the recipe is the one a size-budget search chooses among the candidates (written as ``out/recipe.yaml``)."""
    hooks = hooks or Hooks()
    _check_resume(opts, target)
    recipe_path, target = _prepared(recipe_path, target)
    budget_format = _budget_exporter(target) if target else None
    check_output_dir(Path(out), overwrite, _inputs(checkpoint, recipe=recipe_path, data=opts.data,
                                                   imatrix=opts.imatrix) + _search_inputs(target))
    with _ranks(opts.device) as group:
        if not group.is_root:  # calibrates its shard (and, searching, measures its share); rank 0 writes
            return _other_rank(checkpoint, recipe_path, opts, out, hooks, group, target,
                               *(budget_format or (None, None)))
        with atomic_output_dir(Path(out), overwrite) as tmp:
            record = None
            if target:
                recipe_path, record = _searched(checkpoint, target, opts, *budget_format, tmp, hooks, group)
            if target:
                summary = _calibrate_searched(checkpoint, recipe_path, record, target, opts, tmp, hooks, group)
                summary["outputs"] += ["recipe.yaml", SEARCH_FILE]
            else:
                summary = _calibrate_into(checkpoint, recipe_path, opts, tmp, hooks, group,
                                          state=_state_dir(out, opts, target))
        _drop_state(out, opts, target, group)
    summary["encodings"] = str(Path(out) / "encodings.json")
    summary["files"] = [str(Path(out) / n) for n in summary.pop("outputs")]
    return summary


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
        """The exporter for ``format``, after checking every choice-valued option (no work done yet)."""
        check_choice("--format", self.format, format_names())
        check_choice("--encoding-version", self.encoding_version, AIMET_VERSIONS)
        check_choice("--ct-8bit-format", self.ct_eight_bit_format, CT_EIGHT_BIT_FORMATS)
        check_choice("--gguf-float", self.gguf_float, GGUF_FLOAT_TYPES)
        check_choice("--gguf-fallback", self.gguf_fallback, GGUF_FALLBACKS)
        return get_exporter(self.format)


# beyond this many encoding numbers, the AIMET JSON beside a non-AIMET export is skipped (~100 bytes per number)
AIMET_JSON_LIMIT = 10_000_000


def _example_batch(eopts: ExportOptions):
    """Example inputs for exporters that trace the model: the first batch of --data, else a sentence through the
    checkpoint's tokenizer."""
    def make(loaded: LoadedModel):
        from .data import Batch

        if eopts.data:
            data = load_data(eopts.data, batch_size=eopts.batch_size, num_samples=eopts.batch_size, seed=0,
                             seq_len=eopts.seq_len, tokenizer=loaded.tokenizer)
            return data.batches[0]
        if loaded.tokenizer is not None:
            pad = "max_length" if loaded.tokenizer.pad_token is not None else False  # (equal sentences: equal lengths)
            enc = loaded.tokenizer(["qtool exports this model to ONNX."] * eopts.batch_size, padding=pad,
                                   truncation=True, max_length=eopts.seq_len, return_tensors="pt")
            return Batch(kwargs={k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc})
        raise UsageError("ONNX export traces the model: pass --data with a few example inputs")
    return make


def _check_same_checkpoint(enc_path: Path, checkpoint: str, digest: Dict[str, str]) -> None:
    """Encodings are applied to the weights they were calibrated on: where the calibration's manifest.json beside
    ``enc_path`` records its checkpoint's file hashes, the checkpoint given now must hold the same bytes (its path
    may differ). Ranges from another model of the same shape would clip or waste this one's grid silently."""
    try:
        recorded = json.loads((enc_path.parent / "manifest.json").read_text(encoding="utf-8"))
        hashes = recorded["inputs"]["checkpoint"]["sha256"]
        then = sorted(str(h) for h in hashes.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # no calibration manifest (or not one of qtool's): nothing recorded to compare with
    if then and then != sorted(digest.values()):
        raise EncodingsError(f"{enc_path}: calibrated on other weights than {checkpoint} (its manifest.json records "
                             f"{recorded['inputs']['checkpoint'].get('path', 'another checkpoint')} with other file "
                             "hashes); export from that checkpoint, or pass --allow-other-checkpoint if the weights "
                             "changed on purpose")


def _export_into(checkpoint: str, enc: EncodingsFile, enc_path: Path, out_dir: Path, eopts: ExportOptions,
                 hooks: Hooks, enc_display: Optional[str] = None,
                 same_weights: bool = False, checkpoint_checked: bool = False) -> Dict[str, Any]:
    """Export ``enc`` of ``checkpoint`` into ``out_dir``; with ``same_weights``, refuse a checkpoint whose bytes differ
    from those the calibration's manifest records (checked once the checkpoint is known to be readable).
    ``checkpoint_checked``: the format's checkpoint check already ran in this job (``quantize`` runs it before
    calibrating)."""
    from .aimet_format import to_aimet
    from .weights import WeightSource

    exporter = eopts.validate()
    options = exporter.options(**asdict(eopts))
    exporter.check_online(enc.online)  # what the model computes comes before what the checkpoint holds
    if not checkpoint_checked:
        exporter.check_checkpoint(Path(checkpoint))
    exporter.check(enc, options)
    hooks.on_stage(f"exporting ({eopts.format})")
    summary: Dict[str, Any] = {"format": eopts.format}
    weights = WeightSource(Path(checkpoint), enc, Path(enc_path).parent, trust_pickle=eopts.trust_pickle)
    digest = _files_digest(tensor_files(Path(checkpoint)))
    if same_weights:
        _check_same_checkpoint(Path(enc_path), checkpoint, digest)
    request = ExportRequest(
        Path(checkpoint), enc, weights, out_dir, trust_remote_code=eopts.trust_remote_code, progress=hooks.on_tensor,
        load_model=lambda: load_model(checkpoint, eopts.model_class, "cpu", eopts.trust_pickle,
                                      eopts.trust_remote_code),
        example_batch=_example_batch(eopts))
    summary.update(exporter.write(request, options))
    # the tensor names go into model.encodings; a format without it keeps them in its summary (and manifest)
    names = summary.pop("names", {}) if exporter.aimet_json != "never" else summary.get("names", {})
    summary["export_warnings"] = summary.pop("warnings", [])
    numbers = sum(e.numel() for e in enc.entries)
    floats = [e for e in enc.entries if e.is_float]
    if enc.online and exporter.aimet_json != "never":  # AIMET JSON has no place for a rotation at run time
        summary["export_warnings"].append(
            f"model.encodings (AIMET JSON) not written: the model rotates activations of "
            f"{sum(len(r.modules) for r in enc.online)} modules at run time "
            f"({', '.join(sorted({r.name for r in enc.online}))}, online), which AIMET encodings cannot describe")
    elif floats and exporter.aimet_json != "never":  # AIMET JSON holds integer grids only
        summary["export_warnings"].append(
            f"model.encodings (AIMET JSON) not written: {len(floats)} quantizer(s) are on float element grids "
            f"(FP8/FP4), which AIMET encodings cannot describe; the exported tensors hold their scales")
    elif exporter.aimet_json == "always" or (exporter.aimet_json == "if_small" and numbers <= AIMET_JSON_LIMIT):
        static = [e for e in enc.entries if not e.dynamic]
        if len(static) < len(enc.entries):  # (the aimet format itself refuses them in its check)
            summary["export_warnings"].append(
                f"model.encodings (AIMET JSON) leaves out {len(enc.entries) - len(static)} dynamic activation "
                "quantizer(s): AIMET encodings are static; the exported model computes their ranges at run time")
        static_enc = EncodingsFile(static, enc.meta, enc.data_files, enc.codes_file, enc.online)
        aimet = to_aimet(static_enc.materialized(), eopts.encoding_version, __version__, names=names)
        (out_dir / "model.encodings").write_text(dumps_indented(aimet) + "\n")
    elif exporter.aimet_json == "if_small":
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
            "checkpoint": {"path": str(checkpoint),
                           "sha256": digest,
                           **_hub(checkpoint)},
            "encodings": {"path": enc_display or str(enc_path), "sha256": sha256_file(enc_path)},
            **({"encodings_data": [{"path": f.name, "sha256": sha256_file(f)} for f in enc.data_files]}
               if enc.data_files else {}),
        },
        "outputs": {n: sha256_file(out_dir / n) for n in outputs},
        "summary": summary,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    summary["outputs"] = outputs + ["manifest.json"]
    # what was gained: the checkpoint's weight files against the model files written (encodings and manifests aside)
    model_files = [n for n in outputs if not n.startswith("calibration/")
                   and not n.endswith((".json", ".encodings", ".txt", ".model", ".jinja", ".yaml"))]
    summary["size"] = {"checkpoint_bytes": sum(f.stat().st_size for f in tensor_files(Path(checkpoint))),
                       "model_bytes": sum((out_dir / n).stat().st_size for n in model_files),
                       "model_files": model_files}
    return summary


def run_export(checkpoint: str, encodings_path: str, out: str, eopts: Optional[ExportOptions] = None,
               overwrite: bool = False, hooks: Optional[Hooks] = None) -> Dict[str, Any]:
    """``qtool export``: the chosen format plus AIMET encodings, written atomically."""
    hooks = hooks or Hooks()
    eopts = eopts or ExportOptions()
    exporter = eopts.validate()
    check_output_dir(Path(out), overwrite, _inputs(checkpoint, encodings=encodings_path, data=eopts.data))
    # the integer export reads each weight's block encodings from the sidecar when it gets to that weight
    enc = EncodingsFile.read(encodings_path, lazy=exporter.lazy_encodings)
    with atomic_output_dir(Path(out), overwrite) as tmp:
        summary = _export_into(checkpoint, enc, Path(encodings_path), tmp, eopts, hooks,
                               same_weights=not eopts.allow_other_checkpoint)
    summary["files"] = [str(Path(out) / n) for n in summary.pop("outputs")]
    return summary


def run_import_encodings(checkpoint: str, aimet_path: str, out: str, opts: CalibrateOptions,
                         overwrite: bool = False) -> Dict[str, Any]:
    """``qtool import-encodings``: an AIMET encodings file (any version) -> qtool's encodings.json."""
    from .aimet_format import from_aimet, read_aimet

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


def run_quantize(checkpoint: str, recipe_path: Union[None, str, RecipeFile], out: str, opts: CalibrateOptions,
                 overwrite: bool = False, hooks: Optional[Hooks] = None, eopts: Optional[ExportOptions] = None,
                 target: Optional[TargetOptions] = None) -> Dict[str, Any]:
    """``qtool quantize``: calibrate and export into one directory (encodings.json included). With ``target``,
    the recipe is the one a size-budget search chooses among the candidates, counted in the format written
    (``out/recipe.yaml``; the search's record in ``out/calibration/search.json``)."""
    hooks = hooks or Hooks()
    _check_resume(opts, target)
    eopts = replace(eopts or ExportOptions(), trust_pickle=opts.trust_pickle, model_class=opts.model_class,
                    trust_remote_code=opts.trust_remote_code, seq_len=opts.seq_len)
    eopts.data = eopts.data or opts.data
    exporter = eopts.validate()  # a bad --format fails here, before any calibration
    options = exporter.options(**asdict(eopts))
    recipe_path, target = _prepared(recipe_path, target)
    if target:
        if exporter.tensor_bytes(None, (1,), torch.float32, options) is None:
            raise UsageError(f"{target.flag()}: --format {exporter.name} keeps the weights float (codes live in its "
                             "encodings), so a size budget cannot be counted in it; use qtool, compressed-tensors "
                             "or gguf")
    check_output_dir(Path(out), overwrite, _inputs(checkpoint, recipe=recipe_path, data=eopts.data,
                                                   imatrix=opts.imatrix) + _search_inputs(target))
    exporter.check_checkpoint(Path(checkpoint))
    on_plan = hooks.on_plan

    def check_plan(plan):  # a plan the format cannot write fails before calibration, not after it
        exporter.admit(plan.quantizers, options, plan.rotation.online() if plan.rotation else [])
        plan.left_float.update((name, exporter.name) for name in exporter.left_float(plan.quantizers, options))
        on_plan(plan)

    hooks = Hooks(on_plan=check_plan, on_batch=hooks.on_batch, on_tensor=hooks.on_tensor, on_stage=hooks.on_stage,
                  on_block=hooks.on_block, on_step=hooks.on_step)
    with _ranks(opts.device) as group:
        if not group.is_root:  # calibrates its shard (and, searching, measures its share); rank 0 writes, exports
            return _other_rank(checkpoint, recipe_path, opts, out, hooks, group, target, exporter, options)
        with atomic_output_dir(Path(out), overwrite) as tmp:
            calib_dir = tmp / "calibration"
            calib_dir.mkdir()
            record = None
            if target:
                recipe_path, record = _searched(checkpoint, target, opts, exporter, options, tmp, hooks, group)
            if target:
                csum = _calibrate_searched(checkpoint, recipe_path, record, target, opts, calib_dir, hooks, group)
                csum["outputs"].append(SEARCH_FILE)
            else:
                csum = _calibrate_into(checkpoint, recipe_path, opts, calib_dir, hooks, group,
                                       state=_state_dir(out, opts, target))
            enc_path = calib_dir / "encodings.json"
            esum = _export_into(checkpoint, EncodingsFile.read(enc_path, lazy=exporter.lazy_encodings), enc_path,
                                tmp, eopts, hooks, checkpoint_checked=True,
                                enc_display="calibration/encodings.json")  # relative: the temp dir name is random
        _drop_state(out, opts, target, group)
    out_p = Path(out)
    files = [str(out_p / n) for n in esum.pop("outputs") if not n.startswith("calibration/")]
    calib_files = [str(out_p / "calibration" / n) for n in csum.pop("outputs")]
    if target:  # what the file really holds, beside the budget it was chosen for
        csum["target"]["model_bytes"] = esum["size"]["model_bytes"]
    return {**csum, **esum, "encodings": str(out_p / "calibration" / "encodings.json"), "files": files + calib_files}


@dataclass
class TargetOptions:
    """``--target-bpw`` / ``--target-size`` with ``--candidates``: choose each weight's setting among the
    candidates' so that the file fits the budget with the least measured damage (``qtool.mixed``)."""

    candidates: List[str]
    bits_per_weight: Optional[float] = None
    size_bytes: Optional[int] = None
    samples: int = 8  # calibration samples the damage is measured on
    data: Optional[str] = None  # the text (or tensors) the damage is measured on; None: a seeded subset of --data
    metric: str = "kl"  # what the choice minimizes: "kl" (closeness to the float model) or "nll" (causal LMs)
    recipes: Tuple[RecipeFile, ...] = ()  # the candidates read (in order), once, by :func:`_prepared`

    def flag(self) -> str:
        return (f"--target-bpw {self.bits_per_weight:g}" if self.bits_per_weight is not None
                else f"--target-size {self.size_bytes}")


SEARCH_FILE = "search.json"
_NLL_NEEDS_CAUSAL_LM = ("--search-metric nll ranks by the change in the text's next-token loss: causal language models "
                       "only (this model is not one; use kl)")


def _prepared(recipe: Union[None, str, RecipeFile], target: Optional[TargetOptions]
              ) -> Tuple[Optional[RecipeFile], Optional[TargetOptions]]:
    """A run's recipe, or its size-budget search's candidates, read once (a malformed one is one error naming its
    file and key, before anything runs); what the run hands on from here."""
    if target is not None:
        return None, replace(target, recipes=tuple(_target_candidates(target)))
    return read_recipe(recipe), None


def _target_candidates(target: TargetOptions) -> List[RecipeFile]:
    """The candidates, read (once: a prepared ``target`` holds them)."""
    if target.recipes:
        return list(target.recipes)
    if len(target.candidates) < 2:
        raise UsageError("--candidates takes two or more recipes (names or files), comma-separated")
    if (target.bits_per_weight is None) == (target.size_bytes is None):
        raise UsageError("--candidates goes with one budget: --target-bpw B or --target-size SIZE")
    if target.samples < 1:
        raise UsageError("--search-samples must be at least 1")
    return [read_recipe(c) for c in target.candidates]


@dataclass
class Measured:
    """What a size-budget search measured once, from which any budget's choice follows (``choose_recipe``)."""

    target: TargetOptions
    paths: List[str]
    plans: List[Plan]
    groups: List[Tuple[str, ...]]
    cost: Any  # mixed.Costs
    damage: List[List[float]]  # per group, per candidate: the change from the first candidate's damage
    uniform: List[Dict[str, Any]]
    loaded: LoadedModel
    exporter: str
    metric: str
    samples: int
    opts: CalibrateOptions
    base_damage: float = 0.0  # the first candidate's measured damage
    float_perplexity: Optional[float] = None  # causal LMs: the float model's on the search samples' text
    nll_damage: Optional[List[List[float]]] = None  # causal LMs: per group, per candidate, the text's NLL change

    def bpw(self, nbytes: int) -> float:
        return 8.0 * nbytes / max(self.cost.params, 1)

    def budget(self, target: TargetOptions) -> int:
        return (int(target.bits_per_weight * self.cost.params / 8) if target.bits_per_weight is not None
                else int(target.size_bytes))


def measure_candidates(checkpoint: str, target: TargetOptions, opts: CalibrateOptions, exporter, options,
                       work: Path, hooks: Optional[Hooks] = None, keep: bool = False,
                       group: Optional[Group] = None) -> Measured:
    """Calibrate every candidate (in ``work``), cost each weight group in ``exporter``'s format and measure the
    damage of each group's setting alone. Refuses ``target``'s budget before calibrating when no choice can meet
    it. ``keep``: leave each candidate's calibration in ``work/candidate-<i>``. Under torchrun (``group``) every
    rank calls it: the candidates calibrate across the ranks, each rank loads rank 0's files and measures its share
    of the search samples, and all get the same measurements."""
    import shutil

    from .io.checkpoint import CheckpointTensors
    from .mixed import costs, effective_weights, fused_groups, group_damage
    from .report import next_token_targets

    hooks = hooks or Hooks()
    group = group or Group()
    target = replace(target, recipes=tuple(_target_candidates(target)))
    paths = [r.path for r in target.recipes]
    names = list(target.candidates)
    if opts.data is None:
        raise DataError(f"{target.flag()} measures each candidate on data: pass --data PATH (text or tensors)")
    hooks.on_stage("loading checkpoint")
    loaded = load_model(checkpoint, opts.model_class, opts.device, opts.trust_pickle, opts.trust_remote_code)
    if target.metric == "nll" and not loaded.is_causal_lm:
        raise UsageError(_NLL_NEEDS_CAUSAL_LM)
    plans = []
    for read in target.recipes:
        plan = resolve_plan(read.recipe, loaded.model, source=read.path, allow_unmatched=opts.allow_unmatched,
                            importance_matrix=opts.imatrix is not None)
        exporter.admit(plan.quantizers, options, plan.rotation.online() if plan.rotation else [])
        plans.append(plan)

    def rest(plan):
        return ([(q.name, q.spec) for q in plan.activations], plan.rotation, plan.smoothing, plan.folds)

    for plan, name in zip(plans[1:], names[1:]):
        if rest(plan) != rest(plans[0]):
            raise UsageError(f"--candidates: {name} differs from {names[0]} in more than its weight settings "
                             "(activations, rotation, SmoothQuant or folds); candidates may differ in weights only")
    modules = list(dict.fromkeys(q.module for plan in plans for q in plan.weights))
    order = {m: i for i, m in enumerate(dict(loaded.model.named_modules()))}
    groups = fused_groups(sorted(modules, key=lambda m: order.get(m, len(order))))
    src = CheckpointTensors(Path(checkpoint), trust_pickle=opts.trust_pickle)
    tensors = {k: src.shape_dtype(k) for k in src.keys()}
    first: Dict[int, str] = {}
    tied = {}  # a parameter the checkpoint stores once under another name (a tied output layer)
    for name, param in loaded.model.named_parameters(remove_duplicate=False):
        if id(param) in first and name not in tensors:
            tied[name] = first[id(param)]
        first.setdefault(id(param), name)
    cost = costs(tensors, plans, groups, lambda q, shape, dtype: exporter.tensor_bytes(q, shape, dtype, options),
                 tied)
    metric = "mean per-token KL divergence (nats)" if loaded.is_causal_lm else "mean 1 - cosine of the outputs"
    state = Measured(target, paths, plans, groups, cost, [[0.0] * len(paths) for _ in groups], [], loaded,
                     exporter.name, metric, 0, opts)
    _check_budget(state, target)
    data = _search_data(target, opts, loaded.tokenizer, loaded.is_causal_lm)
    if target.metric == "nll" and not sum(int(next_token_targets(b)[1].sum()) for b in data):
        raise DataError(f"--search-metric nll: the search samples ({target.data or opts.data}) hold no next token "
                        "to score (samples of one token?); use longer samples or --search-metric kl")
    state.samples = data.num_samples
    if loaded.is_causal_lm:
        state.nll_damage = [[0.0] * len(paths) for _ in groups]
    batches = list(data)
    grouped = [m for g in groups for m in g]
    base, base_ppl = None, None
    for c, read in enumerate(target.recipes):
        hooks.on_stage(f"candidate {c + 1}/{len(paths)} ({names[c]}): calibrating")
        cdir = work / f"candidate-{c}"
        cdir.mkdir(parents=True)
        _calibrate_into(checkpoint, read, opts, cdir if group.is_root else None, hooks, group, last=False)
        _share_run(group, cdir)
        model = load_calibrated(checkpoint, str(cdir / "encodings.json"), opts.model_class, opts.device,
                                opts.trust_pickle, opts.trust_remote_code)
        if not keep:
            shutil.rmtree(cdir)
        if base is None:  # the first candidate, deployed as it is: every other option is measured against it
            base = model
            continue
        weights = effective_weights(model, grouped)
        del model
        hooks.on_stage(f"candidate {c + 1}/{len(paths)} ({names[c]}): measuring each layer's damage")
        device = next(iter(base.parameters())).device
        base_damage, deltas, together, ppl = group_damage(base, batches, groups, [weights], device,
                                                          loaded.is_causal_lm, hooks.on_tensor, group)
        del weights
        for g, d in enumerate(deltas[0]):
            state.damage[g][c] = d
            if ppl:
                state.nll_damage[g][c] = ppl["nll_changes"][0][g]
        state.base_damage = base_damage
        state.uniform.append({"damage": together[0], "predicted_damage": base_damage + sum(deltas[0]),
                              **({"perplexity": ppl["together"][0]} if ppl else {})})
        if ppl:
            state.float_perplexity, base_ppl = ppl["float"], ppl["base"]
    state.uniform.insert(0, {"damage": state.base_damage, "predicted_damage": state.base_damage,
                             **({"perplexity": base_ppl} if state.float_perplexity is not None else {})})
    for c, u in enumerate(state.uniform):
        nbytes = cost.fixed + sum(opt[c] for opt in cost.groups)
        u.update(candidate=names[c], bytes=nbytes, bits_per_weight=state.bpw(nbytes))
    return state


def _search_data(target: TargetOptions, opts: CalibrateOptions, tokenizer, causal_lm: bool):
    """The samples the search measures on: up to ``--search-samples`` of ``--search-data`` (default ``--data``),
    the same seeded subset every time it is read."""
    return load_data(target.data or opts.data, opts.batch_size, target.samples, opts.seed, opts.seq_len, tokenizer,
                     pack_text=causal_lm, at_most=True)


def _check_budget(state: Measured, target: TargetOptions) -> None:
    cost, budget = state.cost, state.budget(target)
    floor = cost.fixed + sum(min(c) for c in cost.groups)
    if budget >= cost.float_bytes:
        raise UsageError(f"{target.flag()}: at or above the float checkpoint ({cost.float_bytes} bytes, "
                         f"{state.bpw(cost.float_bytes):.2f} bits per weight); nothing needs quantizing to fit")
    if budget < floor:
        raise UsageError(f"{target.flag()}: below the smallest the candidates can make ({floor} bytes, "
                         f"{state.bpw(floor):.3f} bits per weight in {state.exporter}'s format)")


def choose_recipe(state: Measured, target: TargetOptions) -> Tuple[str, Dict[str, Any]]:
    """The recipe that fits ``target``'s budget with the least predicted damage, and the search's record (budget,
    choice, the uniform candidates, the Pareto curve)."""
    from .config import parse_recipe
    from .mixed import mixed_recipe
    from .quant.knapsack import choose, frontier

    _check_budget(state, target)
    cost, names, opts = state.cost, list(state.target.candidates), state.opts
    budget = state.budget(target)
    ranking = state.damage if target.metric == "kl" else state.nll_damage
    if ranking is None:
        raise UsageError(_NLL_NEEDS_CAUSAL_LM)
    choice = choose(ranking, cost.groups, budget - cost.fixed)
    predicted = state.base_damage + sum(state.damage[g][k] for g, k in enumerate(choice.options))
    chosen = {m: k for g, k in zip(state.groups, choice.options) for m in g}
    nbytes = cost.fixed + choice.cost
    header = (f"qtool {target.flag()} --candidates {','.join(names)}: each weight's setting chosen among "
              f"the candidates'\nfor the least measured damage within {budget} bytes ({state.exporter} format): "
              f"{nbytes} bytes, {state.bpw(nbytes):.3f} bits per weight.\nLater layers entries win; edit and rerun "
              "with -c.")
    text = mixed_recipe(state.target.recipes[0].text, state.plans, chosen, header)
    check = resolve_plan(parse_recipe(text, "the chosen recipe"), state.loaded.model, source="the chosen recipe",
                         allow_unmatched=opts.allow_unmatched, importance_matrix=opts.imatrix is not None)
    got = {q.module: replace(q, rule=None) for q in check.weights}
    for m, c in chosen.items():
        want = next((replace(q, rule=None) for q in state.plans[c].weights if q.module == m), None)
        if got.get(m) != want:
            raise UsageError(f"--candidates: {m}'s setting from {names[c]} cannot be written over {names[0]} "
                             "(is it ignored there?); put the recipe that quantizes most layers first")
    record = {
        "budget": {"flag": target.flag(), "bytes": budget, "bits_per_weight": state.bpw(budget)},
        "format": state.exporter, "params": cost.params, "float_bytes": cost.float_bytes,
        "candidates": names, "damage": state.metric, "samples": state.samples,
        **({"ranked_by": "mean per-token change in the search text's NLL (nats)"} if target.metric == "nll" else {}),
        **({"search_data": target.data} if target.data else {}),
        **({"float_perplexity": state.float_perplexity} if state.float_perplexity is not None else {}),
        "chosen": {"bytes": nbytes, "bits_per_weight": state.bpw(nbytes),
                   "predicted_damage": predicted,
                   **({"predicted_nll_change": sum(ranking[g][k] for g, k in enumerate(choice.options))}
                      if target.metric == "nll" else {}),
                   "groups": {names[c]: sum(k == c for k in choice.options) for c in range(len(names))}},
        "uniform": state.uniform,
        "frontier": [{"bytes": cost.fixed + f.cost, "bits_per_weight": state.bpw(cost.fixed + f.cost),
                      "predicted_damage": state.base_damage + f.damage} for f in frontier(state.damage, cost.groups)],
        "groups": [{"modules": list(g), "choice": names[k], "bytes": cost.groups[i], "damage_change": state.damage[i],
                    **({"nll_change": ranking[i]} if target.metric == "nll" else {})}
                   for i, (g, k) in enumerate(zip(state.groups, choice.options))],
    }
    return text, record


def _measured_damage(checkpoint: str, encodings: Path, record: Dict[str, Any], target: TargetOptions,
                     opts: CalibrateOptions, hooks: Hooks, group: Optional[Group] = None
                     ) -> Tuple[float, Optional[float]]:
    """The chosen model's damage, everything quantized at once (what the first candidate's damage plus the changes
    predicted), and for a causal LM its perplexity on the search samples' text (else None)."""
    from .mixed import group_damage

    hooks.on_stage("measuring the chosen model")
    model = load_calibrated(checkpoint, str(encodings), opts.model_class, opts.device, opts.trust_pickle,
                            opts.trust_remote_code)
    tokenizer = getattr(model, "qtool_tokenizer", None)
    causal = record["damage"].startswith("mean per-token")
    data = _search_data(target, opts, tokenizer, causal)
    damage, _, _, ppl = group_damage(model, list(data), [], [], next(iter(model.parameters())).device, causal,
                                     group=group)
    return damage, (ppl["base"] if ppl else None)


def _write_search(run_dir: Path, record: Dict[str, Any]) -> None:
    (run_dir / SEARCH_FILE).write_text(json.dumps(record, indent=1) + "\n")


def load_calibrated(checkpoint: str, encodings: str, model_class: Optional[str] = None, device: str = "cpu",
                    trust_pickle: bool = False, trust_remote_code: bool = False) -> nn.Module:
    """The checkpoint's model with fake-quant modules set from ``encodings`` (qtool's encodings.json)."""
    loaded = load_model(checkpoint, model_class, device, trust_pickle, trust_remote_code)
    make_fake_quant(loaded.model, checkpoint, encodings, trust_pickle)
    loaded.model.qtool_tokenizer = loaded.tokenizer  # handy for evaluation code
    return loaded.model


def run_report(checkpoint: str, encodings: str, opts: CalibrateOptions, sensitivity_analysis: bool = False,
               hooks: Optional[Hooks] = None) -> Dict[str, Any]:
    """``qtool report``: per-layer SQNR, end-to-end fidelity and (optionally) layer sensitivity."""
    from .report import evaluate, sensitivity

    hooks = hooks or Hooks()
    with _ranks(opts.device) as group:  # under torchrun: each rank measures its shard; every rank gets the report
        if sensitivity_analysis and group.distributed:
            raise UsageError("--sensitivity runs in one process: run it without torchrun")
        hooks.on_stage("loading checkpoint")
        loaded = load_model(checkpoint, opts.model_class, opts.device, opts.trust_pickle, opts.trust_remote_code)
        enc = make_fake_quant(loaded.model, checkpoint, encodings, opts.trust_pickle)
        if opts.data is None:
            raise DataError("qtool report runs the model: pass --data PATH (text or tensors)")
        data = load_data(opts.data, opts.batch_size, opts.num_samples, opts.seed, opts.seq_len, loaded.tokenizer,
                         pack_text=loaded.is_causal_lm)
        device = next(iter(loaded.model.parameters())).device
        hooks.on_stage("measuring")
        rep = evaluate(loaded.model, data, device, loaded.is_causal_lm, hooks.on_batch, group)
    from .report import grid_summary

    out = {"report": rep, "json": {**rep.to_json(), "grids": grid_summary(enc.entries)},
           "causal_lm": loaded.is_causal_lm, "grids": grid_summary(enc.entries)}
    if sensitivity_analysis:
        hooks.on_stage("ranking layer sensitivity")
        out["sensitivity"] = sensitivity(loaded.model, data, device, loaded.is_causal_lm, hooks.on_tensor)
        out["json"]["sensitivity"] = out["sensitivity"]
    return out


def run_imatrix(checkpoint: str, out: str, opts: CalibrateOptions, overwrite: bool = False,
                hooks: Optional[Hooks] = None) -> Dict[str, Any]:
    """``qtool imatrix``: llama.cpp's importance matrix of a Llama-family checkpoint over calibration data (per
    decoder-layer matrix, each input column's sum of x² and the token count, as ``llama-imatrix`` writes it), for
    ``llama-quantize --imatrix``. Written whole or not at all."""
    from .calibration.rounding import collect_module_inputs
    from .export.gguf_model import read_gguf_model
    from .imatrix import write_imatrix
    from .io.fs import atomic_file

    hooks = hooks or Hooks()
    target = Path(out)
    check_output_file(target, _inputs(checkpoint, data=opts.data), overwrite)
    if opts.data is None:
        raise DataError("an importance matrix is measured on text: pass --data PATH")
    gguf_model = read_gguf_model(Path(checkpoint))
    hooks.on_stage("loading checkpoint")
    loaded = load_model(checkpoint, opts.model_class, opts.device, opts.trust_pickle, opts.trust_remote_code)
    data = load_data(opts.data, opts.batch_size, opts.num_samples, opts.seed, opts.seq_len, loaded.tokenizer,
                     pack_text=True)
    modules = dict(loaded.model.named_modules())
    # the decoder matrices (what llama-imatrix collects by default): GGUF name -> row -> module (a stacked expert
    # tensor has one row per expert)
    matrices: Dict[str, Dict[int, str]] = {}
    for module, m in modules.items():
        name, row = gguf_model.matrix(loaded.model, modules, module) if isinstance(m, nn.Linear) else (None, 0)
        if name is not None and name.startswith("blk."):
            matrices.setdefault(name, {})[row] = module
    device = next(iter(loaded.model.parameters())).device
    batches = list(data)

    def run():
        for i, batch in enumerate(batches):
            b = batch.to(device)
            loaded.model(*b.args, **b.kwargs)
            if hooks.on_batch:
                hooks.on_batch(i + 1, len(batches), b.size)

    hooks.on_stage("measuring")
    measured = {m for rows in matrices.values() for m in rows.values()}
    stats = collect_module_inputs({module: False for module in modules if module in measured}, modules, run)
    by_name: Dict[str, List[Tuple[torch.Tensor, int]]] = {}
    for name in sorted(matrices):
        members = [matrices[name][row] for row in sorted(matrices[name])]
        if all(m not in stats for m in members):
            continue
        width = int(modules[members[0]].in_features)
        by_name[name] = [(stats[m].sq, stats[m].count) if m in stats else (torch.zeros(width, dtype=torch.float64), 0)
                         for m in members]
    tokens = max((n for rows in by_name.values() for _, n in rows), default=0)
    with atomic_file(target) as tmp:
        write_imatrix(tmp, by_name, [Path(opts.data).name], opts.seq_len, max(1, tokens // max(1, opts.seq_len)))
    return {"imatrix": str(target), "entries": len(by_name), "tokens": tokens, "bytes": target.stat().st_size}
