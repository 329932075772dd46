"""``qtool calibrate`` and ``qtool quantize``: a recipe (read once, at the edge), or the one a size-budget search
chooses, calibrated (and, for quantize, exported) into an output directory written whole or not at all, on one
process or every rank of a torchrun."""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Dict, Optional, Union

from ..calibration import CalibrateOptions
from ..choices import check_arguments
from ..config import GGUF_GRID_NOTE, GGUF_GRID_REFUSED, GGUF_STACK_NOTE, GGUF_GRID_STORED, RecipeFile
from ..data import check_data
from ..encodings import EncodingsFile
from ..errors import UsageError
from ..export.base import weight_changes
from ..hooks import Hooks
from ..io.fs import check_output_dir, scratch_dir_beside
from ..parallel import Group
from .calibrate import _calibrate_into
from .common import (TargetOptions, _check_resume, _check_state, _drop_state, _inputs, _output_dir_then_no_state,
                     _ranks, _same_command, _state_dir, one_at_a_time, stored_once)
from .export import ExportOptions, _export_into
from .search import (SEARCH_FILE, _budget_exporter, _calibrate_searched, _prepared, _search_inputs,
                     _searched)


def _other_rank(checkpoint: str, recipe_path: Optional[RecipeFile], opts: CalibrateOptions, out: str, hooks: Hooks,
                group: Group, target: Optional[TargetOptions], exporter, options, admit=None) -> Dict[str, Any]:
    """What a rank other than 0 does in ``calibrate`` and ``quantize``: calibrate its shard, and, searching
    (``target``), measure its share of the search samples, in its own scratch directory (the chosen recipe and the
    calibrations it measures, copied from rank 0: ranks need not share a filesystem) beside the output directory
    (where the model's files must fit anyway; the system's temporary directory is often small). Rank 0 writes."""
    if target is None:
        _calibrate_into(checkpoint, recipe_path, opts, None, hooks, group, state=_state_dir(out, opts, target),
                        admit=admit)
        _drop_state(out, opts, group)  # (this rank's block outputs: its calibration is done)
    else:
        with scratch_dir_beside(Path(out)) as d:  # (removed by a later run where SIGKILL leaves it)
            recipe_path, record = _searched(checkpoint, target, opts, exporter, options, Path(d), hooks, group, admit)
            _calibrate_searched(checkpoint, recipe_path, record, target, opts, Path(d) / "run", hooks, group, admit)
    return {"rank": group.rank, "world_size": group.world_size}


@one_at_a_time
def run_calibrate(checkpoint: str, recipe_path: Union[None, str, RecipeFile], out: str, opts: CalibrateOptions,
                  overwrite: bool = False, hooks: Optional[Hooks] = None,
                  target: Optional[TargetOptions] = None) -> Dict[str, Any]:
    """``qtool calibrate``: write ``out/encodings.json`` and ``out/manifest.json`` atomically. With ``target``,
    the recipe is the one a size-budget search chooses among the candidates (written as ``out/recipe.yaml``)."""
    check_arguments(checkpoint, opts, CalibrateOptions, paths={"out": out}, hooks=(hooks, Hooks),
                    target=(target, TargetOptions))
    checkpoint, out = os.fspath(checkpoint), os.fspath(out)
    hooks = hooks or Hooks()
    opts.check()
    _check_resume(opts, target)
    recipe_path, target = _prepared(recipe_path, target)
    budget_format = _budget_exporter(target) if target else None
    inputs = _inputs(checkpoint, recipe=recipe_path, data=opts.data, imatrix=opts.imatrix) + _search_inputs(target)
    check_output_dir(Path(out), overwrite, inputs)
    _check_state(out, opts, inputs)
    check_data(opts.data)  # (before the model loads: a bad data file is named in seconds, not after the load)
    with _ranks(opts.device) as group:
        _same_command(group, checkpoint, opts, recipe_path, target, out=str(out))
        if not group.is_root:  # calibrates its shard (and, searching, measures its share); rank 0 writes
            return _other_rank(checkpoint, recipe_path, opts, out, hooks, group, target,
                               *(budget_format or (None, None)))
        with _output_dir_then_no_state(out, overwrite, opts, group) as tmp:
            record = None
            if target:
                recipe_path, record = _searched(checkpoint, target, opts, *budget_format, tmp, hooks, group)
            if target:
                summary = _calibrate_searched(checkpoint, recipe_path, record, target, opts, tmp, hooks, group)
                summary["outputs"] += ["recipe.yaml", SEARCH_FILE]
            else:
                summary = _calibrate_into(checkpoint, recipe_path, opts, tmp, hooks, group,
                                          state=_state_dir(out, opts, target))
    summary["encodings"] = str(Path(out) / "encodings.json")
    summary["files"] = [str(Path(out) / n) for n in summary.pop("outputs")]
    return summary


@one_at_a_time
def run_quantize(checkpoint: str, recipe_path: Union[None, str, RecipeFile], out: str, opts: CalibrateOptions,
                 overwrite: bool = False, hooks: Optional[Hooks] = None, eopts: Optional[ExportOptions] = None,
                 target: Optional[TargetOptions] = None, eval_data: Optional[str] = None) -> Dict[str, Any]:
    """``qtool quantize``: calibrate and export into one directory (encodings.json included). With ``target``,
    the recipe is the one a size-budget search chooses among the candidates, counted in the format written
    (``out/recipe.yaml``; the search's record in ``out/calibration/search.json``). ``eval_data``: what a caller
    reads next (``--eval``), which the output must not replace either."""
    check_arguments(checkpoint, opts, CalibrateOptions, paths={"out": out, **({} if eval_data is None else {
        "eval_data": eval_data})}, hooks=(hooks, Hooks), eopts=(eopts, ExportOptions), target=(target, TargetOptions))
    checkpoint, out = os.fspath(checkpoint), os.fspath(out)
    hooks = hooks or Hooks()
    opts.check()
    _check_resume(opts, target)
    eopts = replace(eopts or ExportOptions(), trust_pickle=opts.trust_pickle, model_class=opts.model_class,
                    trust_remote_code=opts.trust_remote_code, seq_len=opts.seq_len)
    eopts.data = eopts.data or opts.data
    exporter = eopts.validate()  # a bad --format fails here, before any calibration
    options = exporter.options(**asdict(eopts))
    recipe_path, target = _prepared(recipe_path, target)
    if target:
        if not exporter.counts_bytes(options):
            raise UsageError(f"{target.flag()}: the search does not count --format {exporter.name}'s bytes, so a "
                             "size budget cannot be held in it; use qtool, compressed-tensors or gguf")
    inputs = _inputs(checkpoint, recipe=recipe_path, data=opts.data, imatrix=opts.imatrix,
                     export_data=eopts.data, eval_data=eval_data) + _search_inputs(target)
    check_output_dir(Path(out), overwrite, inputs)
    _check_state(out, opts, inputs)
    check_data(opts.data)  # (before the model loads: a bad data file is named in seconds, not after the load)
    exporter.check_checkpoint(Path(checkpoint))

    def admit(plan):  # a plan the format cannot write fails before calibration, not after it
        exporter.admit(plan.quantizers, options, plan.rotation.online() if plan.rotation else [])
        exporter.check_weight_changes(weight_changes(plan))
        exporter.check_tied(stored_once(checkpoint, plan.tied, opts.trust_pickle))
        exporter.check_kv_cache(plan.kv_float)
        exporter.check_expert_counts(plan.quantizers, options, plan.expert_counts)
        exporter.check_example_inputs(Path(checkpoint), eopts.data)
        floats = exporter.left_float(plan.quantizers, options, plan.tied)  # (a shared Linear weight, however stored)
        plan.left_float.update((name, f"{exporter.left_float_words} by --format {exporter.name}") for name in floats)
        if plan.coverage is not None and floats:  # (the share of weights the file holds quantized)
            plan.coverage = plan.coverage.without({q.module for q in plan.quantizers
                                                   if q.name in plan.left_float and q.tensor == "weight"})
        if exporter.name != "gguf":  # (a rule off GGUF's grids matters to a GGUF export alone)
            plan.warnings[:] = [w for w in plan.warnings if GGUF_GRID_NOTE not in w and GGUF_STACK_NOTE not in w]
        elif floats:  # (not refused: written as floats)
            plan.warnings[:] = [w.replace(GGUF_GRID_REFUSED, GGUF_GRID_STORED) for w in plan.warnings]

    with _ranks(opts.device) as group:  # (every rank admits the plan to the format, and a search counts in it)
        _same_command(group, checkpoint, opts, recipe_path, target, out=str(out),
                      export=str(sorted(asdict(eopts).items())))
        if not group.is_root:  # calibrates its shard (and, searching, measures its share); rank 0 writes, exports
            return _other_rank(checkpoint, recipe_path, opts, out, hooks, group, target, exporter, options, admit)
        with _output_dir_then_no_state(out, overwrite, opts, group) as tmp:
            calib_dir = tmp / "calibration"
            calib_dir.mkdir()
            record = None
            if target:
                recipe_path, record = _searched(checkpoint, target, opts, exporter, options, tmp, hooks, group, admit)
            if target:
                csum = _calibrate_searched(checkpoint, recipe_path, record, target, opts, calib_dir, hooks, group,
                                           admit)
                csum["outputs"].append(SEARCH_FILE)
            else:
                csum = _calibrate_into(checkpoint, recipe_path, opts, calib_dir, hooks, group,
                                       state=_state_dir(out, opts, target), admit=admit)
            enc_path = calib_dir / "encodings.json"
            esum = _export_into(checkpoint, EncodingsFile.read(enc_path, lazy=exporter.lazy_encodings), enc_path,
                                tmp, eopts, hooks, checkpoint_checked=True,
                                enc_display="calibration/encodings.json")  # relative: the temp dir name is random
    out_p = Path(out)
    files = [str(out_p / n) for n in esum.pop("outputs") if not n.startswith("calibration/")]
    calib_files = [str(out_p / "calibration" / n) for n in csum.pop("outputs")]
    if target:  # what the file really holds, beside the budget it was chosen for
        csum["target"]["model_bytes"] = esum["size"]["model_bytes"]
    return {**csum, **esum, "encodings": str(out_p / "calibration" / "encodings.json"), "files": files + calib_files}
