"""What every job shares: the inputs an output must not overwrite, the process group of a run (one process or
torchrun), the size-budget options, a resumable run's state directory, and the one loader of a calibrated
model."""

from __future__ import annotations

import os
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..calibration import CalibrateOptions
from ..config import Plan, RecipeFile, load_recipe, recipe_file, resolve_plan
from ..encodings import CODES_FILE, SIDECAR, calibrated_elsewhere
from ..choices import check_arguments
from ..errors import EncodingsError, QtoolError, UsageError
from ..io.checkpoint import CheckpointTensors, files_read, weight_file_hashes
from ..io.fs import atomic_output_dir, published, sampled_sha256
from ..model.apply import make_fake_quant
from ..model.load import LoadedModel, load_model
from ..parallel import Group, from_environment
from ..quant.precision import one_at_a_time


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


@one_at_a_time
def plan_for(checkpoint: str, recipe_path: str, opts: CalibrateOptions) -> Tuple[LoadedModel, Plan]:
    """The checkpoint's model and the plan the recipe resolves to on it."""
    check_arguments(checkpoint, opts, CalibrateOptions)
    checkpoint = os.fspath(checkpoint)
    opts.check()
    recipe = load_recipe(recipe_path)  # validate the recipe before the (slow) model load
    loaded = load_model(checkpoint, opts.model_class, opts.device, opts.trust_pickle, opts.trust_remote_code)
    plan = resolve_plan(recipe, loaded.model, source=str(recipe_path), allow_unmatched=opts.allow_unmatched)
    return loaded, plan


def stored_once(checkpoint: str, tied: Dict[str, str], trust_pickle: bool = False) -> Dict[str, str]:
    """``tied`` (``Plan.tied``: a tied weight's quantizer name -> the name its tensor is stored under) less the
    weights the checkpoint holds under both names, as a torch state dict does: what a format that writes the
    checkpoint's tensors by name has no tensor for."""
    if not tied:
        return tied
    keys = set(CheckpointTensors(Path(checkpoint), trust_pickle=trust_pickle).keys())
    return {name: stored for name, stored in tied.items() if not (name in keys and stored in keys)}


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


def _same_command(group: Group, checkpoint: Optional[str], opts: CalibrateOptions, recipe=None,
                  target: Optional["TargetOptions"] = None, **more) -> None:
    """Refuse ranks launched with other options than rank 0's (a launch script that gives each rank its own
    arguments): the first exchange would gather statistics of other batches, or wait for a collective another
    recipe never reaches. Every rank raises; rank 0's line names the first difference."""
    if not group.distributed:
        return

    def sha(r):  # (a recipe by its bytes: each node may install qtool, and its shipped recipes, elsewhere)
        return f"sha256 {r.sha256[:12]}" if isinstance(r, RecipeFile) else r

    options = {**opts.recorded(), "resume": opts.resume}
    options["device"] = str(options["device"]).split(":")[0]  # (cuda:LOCAL_RANK per rank is a launch's choice)
    searched = {} if target is None else {**{f"size search {k}": str(v) for k, v in vars(target).items()
                                              if k not in ("recipes", "candidates")},  # (paths: by their bytes)
                                           "candidates' bytes": [sha(r) for r in target.recipes]}
    mine = {**{f"--{k.replace('_', '-')}": v for k, v in options.items()}, "recipe": sha(recipe), **searched,
            **{k: v for k, v in more.items() if not isinstance(v, Path)}}
    # an input names the same file on every node only by its bytes (a node's stale copy of a re-saved model)
    inputs = {"checkpoint": checkpoint, "--data": opts.data, "--imatrix": opts.imatrix,
              **{f"--{k}": v for k, v in more.items() if isinstance(v, Path)}}
    for key, path in inputs.items():
        files = _files_read(key, path)
        if files is not None:
            mine[f"{key}'s bytes"] = f"sampled sha256 {sampled_sha256(files)[:12]}"
    every = group.all_gather(mine)
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            key = next(k for k in [*every[0], *theirs] if theirs.get(k) != every[0].get(k))
            raise UsageError(f"launched with another {key} than rank {rank} (rank 0: {every[0].get(key)!r}; rank "
                             f"{rank}: {theirs.get(key)!r}): every rank must run the same command")


def _files_read(what: str, path) -> Optional[List[Path]]:
    """The files a run reads of input ``what`` at ``path`` (a checkpoint's weights and config, the data files),
    or None where there is nothing to read yet (an error the reading says)."""
    from ..data import data_files

    if path is None or not Path(path).exists():
        return None
    p = Path(path)
    try:
        if what == "checkpoint":
            files = files_read(p)
        elif what == "--encodings":  # (and the chosen codes and sidecar the fake-quant model reads beside it)
            files = [p] + [f for f in (p.parent / CODES_FILE, p.parent / SIDECAR) if f.is_file()]
        else:
            files = data_files(p) if what == "--data" else [p]
        return files if all(f.is_file() for f in files) else None
    except QtoolError:
        return None


def _check_resume(opts: CalibrateOptions, target: Optional["TargetOptions"]) -> None:
    if opts.resume and not opts.sequential:
        raise UsageError("--resume continues a --sequential run (the one mode that keeps a state): add --sequential")
    if opts.resume and target is not None:
        raise UsageError("--resume does not cover a size-budget search (--target-bpw/--target-size): its "
                         "calibrations are short; run it again without --resume")


def _state_dir(out: str, opts: CalibrateOptions, target: Optional["TargetOptions"]) -> Optional[Path]:
    """Where a run writing ``out`` keeps its resumable state: ``OUT.resume`` for --sequential runs (each block's
    results; removed once the output is written), none for the others."""
    from ..calibration.resume import state_dir

    return state_dir(Path(out)) if opts.sequential and target is None else None


def _check_state(out: str, opts: CalibrateOptions, inputs: List[Tuple[str, Optional[str]]]) -> None:
    """Before any work: the state directory this run would replace is one (or none), and no input."""
    from ..calibration.resume import check_state_dir

    directory = _state_dir(out, opts, None)  # (a size-budget search keeps none, and replaces an earlier run's)
    if directory is not None:
        check_state_dir(directory, inputs)


@contextlib.contextmanager
def _output_dir_then_no_state(out: str, overwrite: bool, opts: CalibrateOptions, group: Group):
    """``atomic_output_dir(out)``; once the output is in place the run's state goes, even where an interrupt lands
    between the two (a state left beside a written output made every retry with --resume fail: the output
    exists)."""
    before = len(published())
    try:
        with atomic_output_dir(Path(out), overwrite) as tmp:
            yield tmp
    finally:
        if Path(out) in published()[before:]:
            _drop_state(out, opts, group)


def _drop_state(out: str, opts: CalibrateOptions, group: Group) -> None:
    """The run's output is written (rank 0) or its calibration is done (the others): its state goes."""
    from ..calibration.resume import remove_state

    directory = _state_dir(out, opts, None)  # (an earlier run's, beside a size-budget search's output, too: a
    if directory is not None:                 # retry with --resume then met the written output)
        remove_state(directory, group.rank, group.is_root)


@one_at_a_time
def load_calibrated(checkpoint: str, encodings: str, model_class: Optional[str] = None, device: str = "cpu",
                    trust_pickle: bool = False, trust_remote_code: bool = False,
                    allow_other_checkpoint: bool = False) -> nn.Module:
    """The checkpoint's model with fake-quant modules set from ``encodings`` (qtool's encodings.json). Encodings
    whose calibration ``manifest.json`` records other weights than ``checkpoint``'s raise ``EncodingsError``, as
    ``qtool export`` and ``qtool report`` refuse them, unless ``allow_other_checkpoint`` (weights changed on
    purpose: the ranges, and any codes or rotated tensors the encodings carry, are applied to these as they are)."""
    check_arguments(checkpoint, paths={"encodings": encodings}, flags={
        "trust_pickle": trust_pickle, "trust_remote_code": trust_remote_code,
        "allow_other_checkpoint": allow_other_checkpoint})
    checkpoint, encodings = os.fspath(checkpoint), os.fspath(encodings)
    device = str(device) if isinstance(device, torch.device) else device
    for name, value in (("model_class", model_class), ("device", device)):
        if value is not None and not isinstance(value, str):
            raise UsageError(f"{name} must be a string (got {type(value).__name__})")
    if not allow_other_checkpoint:
        other, _ = calibrated_elsewhere(Path(encodings), weight_file_hashes(Path(checkpoint)), checkpoint)
        if other is not None:
            raise EncodingsError(f"{encodings}: calibrated on other weights than {checkpoint} (its manifest.json "
                                 f"records {other} with other file hashes): load that checkpoint, calibrate this "
                                 "one, or pass allow_other_checkpoint=True if the weights changed on purpose")
    loaded = load_model(checkpoint, model_class, device, trust_pickle, trust_remote_code)
    make_fake_quant(loaded.model, checkpoint, encodings, trust_pickle)
    loaded.model.qtool_tokenizer = loaded.tokenizer  # handy for evaluation code
    return loaded.model


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
    size_given: Optional[str] = None  # --target-size as typed ("61.4MiB"), which messages repeat beside the bytes

    def flag(self) -> str:
        """The budget as the command line gave it (``--target-size 1KB``)."""
        if self.bits_per_weight is not None:
            return f"--target-bpw {self.bits_per_weight:g}"
        return f"--target-size {(self.size_given or '').strip() or self.size_bytes}"

    def flag_with_bytes(self) -> str:
        """:meth:`flag`, with the bytes a typed size is (``--target-size 1KB (1000 bytes)``), for messages."""
        typed = self.bits_per_weight is None and (self.size_given or "").strip() not in ("", str(self.size_bytes))
        return f"{self.flag()} ({self.size_bytes} bytes)" if typed else self.flag()
