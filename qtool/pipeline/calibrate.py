"""One recipe calibrated into a run directory: encodings.json (and its sidecar, chosen codes and transformed
floats) and the calibration's manifest. Every calibrating job ends here: ``calibrate``, ``quantize``, each
candidate of a size-budget search."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

from .. import __version__
from ..calibration import CalibrateOptions, calibrate_prepared, prepare_calibration
from ..config import Plan, RecipeFile, read_recipe
from ..encodings import CODES_FILE, SIDECAR, EncodingsFile
from ..hooks import Hooks
from ..io.fs import sha256_file
from ..parallel import Group
from ..provenance import device_label
from ..weights import write_codes
from .manifest import checkpoint_input, digests, manifest, write_manifest


def _calibrate_into(checkpoint: str, recipe_path: Union[str, RecipeFile], opts: CalibrateOptions, run_dir: Optional[Path],
                    hooks: Hooks, group: Optional[Group] = None, search: Optional[Dict[str, Any]] = None,
                    last: bool = True, state: Optional[Path] = None,
                    admit: Optional[Callable[[Plan], None]] = None):
    """Calibrate and write the run's files into ``run_dir``. In a distributed run every rank calibrates; rank 0
    alone writes (``run_dir`` is None on the others, which return None). ``search``: the record of a size-budget
    search that wrote this recipe (``recipe.yaml`` in the output directory). ``last``: no collective step follows
    but the run's end (a search's intermediate calibrations pass False: :meth:`Group.calibrated`). ``state``: where
    a sequential run keeps what it has finished (:func:`_state_dir`). ``admit``: the job's check of the plan
    against the format it will write (a plan the format cannot hold fails before any data is read)."""
    group = group or Group()
    read = read_recipe(recipe_path)  # a shipped recipe's name -> its file (hashed in the manifest)
    recipe, recipe_path = read.recipe, read.path
    # (a searched recipe is named as the output holds it: its temporary path would put a run's own directory name,
    # host and process id into the plan's warnings and the manifest)
    prepared = prepare_calibration(checkpoint, recipe, "recipe.yaml" if search else recipe_path, opts, hooks)
    if admit is not None:
        admit(prepared.plan)
    hooks.on_plan(prepared.plan)
    run = calibrate_prepared(checkpoint, prepared, recipe_path, opts,
                             run_dir / SIDECAR if run_dir is not None else None, hooks, group, state)
    group.calibrated(last)
    if not group.is_root:
        return None
    entries, plan, data, device, files, kind, unused = (run.entries, run.plan, run.data, run.device, run.files,
                                                         run.kind, run.unused)
    expert_tokens = _as_stored(plan)
    meta = {"qtool_version": __version__, "recipe": Path(recipe_path).name,
            **({"gguf_mix": recipe.gguf_mix} if recipe.gguf_mix is not None else {})}  # (the GGUF file's type)
    enc = EncodingsFile(entries, meta,
                        online=_online_rotations(plan, entries))
    if run.codes or run.floats:  # chosen codes and transformed floats: every exporter writes these (qtool.weights)
        write_codes(run_dir / CODES_FILE, entries, run.codes, run.floats)
        enc.codes_file = CODES_FILE
    enc_path = run_dir / "encodings.json"
    enc_files = enc.write(enc_path)
    inputs = {
        "checkpoint": checkpoint_input(checkpoint, digests(files), kind),
        "recipe": {"path": "recipe.yaml" if search else str(recipe_path), "sha256": read.sha256},
        "data": None if data is None else {"path": str(opts.data), "samples": data.num_samples,
                                           "sha256": data.sha256 or digests(data.files)},
        **({"imatrix": {"path": str(opts.imatrix), "sha256": sha256_file(Path(opts.imatrix)),
                        "weights": sum(q.imatrix for q in plan.weights)}} if opts.imatrix else {}),
    }
    options = opts.recorded()
    write_manifest(run_dir, manifest("calibrate", inputs, digests(enc_files, key=lambda f: f.name),
                                     device=device_label(device), options=options, tail={
        "quantizers": len(entries),
        **({"rounding": {q.name: q.rounding for q in plan.weights if q.name in run.codes}} if run.codes else {}),
        **({"batch_norm_folds": [{"conv": f.conv, "bn": f.bn} for f in plan.folds]} if plan.folds else {}),
        **({"rotation": {"rotations": list(plan.rotation.rotations), "type": plan.rotation.kind,
                         "seed": plan.rotation.seed, "untied": [plan.rotation.head] if plan.rotation.untie else [],
                         "replaced": len(run.floats),
                         **({"block_size": plan.rotation.r1_blocks} if plan.rotation.r1_blocks else {})}}
           if plan.rotation else {}),
        **({"smoothquant": {"alpha": plan.smoothing[0].alpha,
                            "groups": [{"smooth": g.smooth, "balance": list(g.balance)} for g in plan.smoothing],
                            "replaced": sorted(run.floats)}} if plan.smoothing else {}),
        **({"awq": {"grid": plan.awq.grid, "duo_scaling": plan.awq.duo_scaling,
                    "objective": plan.awq.objective, "groups": plan.awq.chosen,
                    "replaced": sorted(run.floats)}} if plan.awq is not None else {}),
        **({"signround": {"blocks": plan.learned}} if plan.learned else {}),
        **({"target": {"budget": search["budget"], "format": search["format"], "candidates": search["candidates"],
                       "chosen": search["chosen"]}} if search else {}),
        "uncalibrated": unused,
        **({"expert_tokens": expert_tokens} if expert_tokens else {}),
        "warnings": plan.warnings,
        **({"distributed": {"world_size": group.world_size, "backend": group.backend,
                            "samples_per_rank": run.samples_per_rank}} if group.distributed else {}),
    }))
    summary = {"encodings": str(enc_path), "quantizers": len(entries), "weights": len(plan.weights),
               "activations": len(plan.activations), "uncalibrated": unused,
               "weights_quantized": plan.coverage.to_json() if plan.coverage is not None else None,
               "expert_tokens": expert_tokens,
               "samples": 0 if data is None else data.num_samples, "device": str(device),
               "warnings": plan.warnings, "outputs": [f.name for f in enc_files] + ["manifest.json"],
               **({"matmul_precision": opts.matmul_precision} if opts.matmul_precision != "highest" else {}),
               **({"world_size": group.world_size, "samples_per_rank": run.samples_per_rank}
                  if group.distributed else {})}
    return summary


def _as_stored(plan: Plan) -> Dict[str, int]:
    """``plan.expert_tokens`` keyed by each expert's name in the checkpoint, as the encodings name its weights
    (Mixtral's ``block_sparse_moe.experts.3``, which transformers loads as ``mlp.experts.3``)."""
    stored = {q.module.rsplit(".", 1)[0]: q.name[: -len(".weight")].rsplit(".", 1)[0]
              for q in plan.weights if q.name.endswith(".weight") and "." in q.module}
    return {stored.get(m, m): n for m, n in plan.expert_tokens.items()}


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
