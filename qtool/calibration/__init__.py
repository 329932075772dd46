"""Calibration: recipe + checkpoint + data -> encodings entries.

One loop (:mod:`.base`) serves three modes, chosen by :func:`choose_mode` from what the run needs:

* ``sequential`` (``--sequential``, Hugging Face causal LMs): one decoder block in memory at a time;
* ``streaming`` (a weight-only recipe on a Hugging Face directory): one weight in memory at a time, no model;
* ``in_memory`` (everything else): the whole model, quantizers inserted, the data run through it.

All three give the same encodings for the same inputs (tested).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ..choices import MATMUL_PRECISIONS, check_choice, check_device, check_fields
from ..config import Plan, Recipe, resolve_plan
from ..data import CalibrationData, load_data, longest_sample, past_positions
from ..encodings import EncodingEntry, SidecarStream
from ..errors import DataError, UsageError
from ..hooks import Hooks, reporting
from ..io.checkpoint import detect_kind, files_read, tensor_files
from ..io.fs import sha256_file
from ..io.spill import SpilledTensors
from ..model.experts import LinearExperts, all_tokens_routed
from ..model.load import causal_lm_class, check_model_class
from ..parallel import Group
from ..provenance import device_label, versions
from ..quant.precision import exact, unsupported
from .collective import samples_per_rank
from .data_check import data_amount, shortfalls

__all__ = ["CalibrateOptions", "CalibrationRun", "MODES", "PreparedRun", "choose_mode", "prepare_calibration",
           "calibrate_prepared", "calibrate_checkpoint", "streams", "estimate_run"]

MODES = ("in_memory", "streaming", "sequential")


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
    imatrix: Optional[str] = None  # an importance matrix file (llama-imatrix's) weighting the searches
    strict_data: bool = False  # too little data (calibration.data_check) is an error, not a warning
    resume: bool = False  # --sequential: continue the saved state of a stopped run (calibration.resume)
    all_experts: bool = False  # MoE layers: every expert sees every calibration token (outputs stay routed)
    matmul_precision: str = "highest"  # the model's float32 products in the data passes (quant.precision)

    def check(self) -> "CalibrateOptions":
        """Raise ``UsageError`` naming the first option of the wrong type, out of range or not a known choice: a
        library caller's mistake fails at the job's edge in one line (the CLI has checked its flags already)."""
        check_fields(self, {"batch_size": 1, "num_samples": 1, "seq_len": 1})
        check_device(self.device, "CalibrateOptions.device")
        check_choice("CalibrateOptions.matmul_precision", self.matmul_precision, MATMUL_PRECISIONS)
        return self

    def recorded(self) -> Dict[str, Any]:
        """The options a manifest and a resumable state record: one added later only where it is used (so earlier
        records keep their bytes), and never ``resume`` (a resumed run writes an uninterrupted one's bytes)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if not (k == "imatrix" and v is None) and not (k in ("strict_data", "all_experts") and not v)
                and not (k == "matmul_precision" and v == "highest") and k != "resume"}


def _resolve(recipe: Recipe, model, source: str, opts: CalibrateOptions, checkpoint: str) -> Plan:
    """The recipe's plan on ``model``, weighted by ``opts.imatrix`` where one is given."""
    plan = resolve_plan(recipe, model, source=source, allow_unmatched=opts.allow_unmatched,
                        importance_matrix=opts.imatrix is not None)
    if opts.imatrix is None:
        return plan
    from .importance import apply_imatrix

    return apply_imatrix(plan, model, checkpoint, opts.imatrix, have_data=opts.data is not None,
                         strict=opts.strict_data)


def _warn_all_experts(plan: Plan, opts: CalibrateOptions, model) -> None:
    """--all-experts on a model with no expert layers says so."""
    if opts.all_experts and not any(isinstance(m, LinearExperts) for m in model.modules()):
        plan.warnings.append("--all-experts: this model has no mixture-of-experts layer qtool calibrates per expert; "
                             "it changes nothing")


@dataclass
class CalibrationRun:
    entries: List[EncodingEntry]
    plan: Plan
    mode: str
    device: torch.device
    files: List[Path]  # the checkpoint files whose bytes define the weights
    kind: str  # checkpoint kind
    data: Optional[CalibrationData] = None
    unused: List[str] = field(default_factory=list)  # activation quantizers that saw no data
    codes: Dict[str, torch.Tensor] = field(default_factory=dict)  # weight quantizer -> codes from a rounding algorithm
    floats: Dict[str, torch.Tensor] = field(default_factory=dict)  # checkpoint tensor -> value a transform gave it
    samples_per_rank: List[int] = field(default_factory=list)  # calibration samples each rank ran (rank order)


def choose_mode(checkpoint: str, recipe: Recipe, opts: CalibrateOptions, source: str):
    """``(mode, skeleton model or None, plan or None)``: sequential when asked; streaming when the checkpoint is a
    Hugging Face directory, no data is given and the recipe resolves to weights only; in memory otherwise, after
    an estimate of its peak on the directory's meta-device skeleton (refused, naming --sequential, where it is
    past the machine's memory and --sequential would fit)."""
    check_model_class(Path(checkpoint), opts.model_class)
    if opts.sequential:
        if detect_kind(Path(checkpoint)) != "hf":
            raise UsageError("--sequential needs a Hugging Face causal LM directory")
        return "sequential", None, None
    if detect_kind(Path(checkpoint)) == "hf":  # (never with --model-class: check_model_class refused it)
        from ..model.hf import meta_skeleton

        skeleton = meta_skeleton(checkpoint, opts.trust_remote_code)
        plan = _resolve(recipe, skeleton, source, opts, checkpoint)
        _refuse_learned_rounding(plan, causal_lm_class(skeleton))
        if streams(plan, opts):
            return "streaming", skeleton, plan
        _check_memory(estimate_run(skeleton, plan, "in_memory", opts))  # before the model is loaded
    return "in_memory", None, None


def _refuse_learned_rounding(plan: Plan, causal_lm: bool) -> None:
    """signround learns each decoder block on that block's own inputs: only ``--sequential`` runs blocks apart, and
    only a Hugging Face causal LM has such blocks."""
    learned = [q.name for q in plan.weights if q.learns_rounding]
    if learned:
        which = f"rounding signround ({learned[0]}{' and others' if len(learned) > 1 else ''})"
        if not causal_lm:  # (--sequential, which it asked for, then refused this model: the user went in a circle)
            raise UsageError(f"{which} learns each decoder block of a Hugging Face causal language model, and this "
                             "model is not one: use rounding gptq or adaround")
        raise UsageError(f"{which} learns each decoder block of a causal language model on its own inputs: run "
                         "with --sequential")


def _refuse_graph_statistics(plan: Plan, model, checkpoint: str) -> None:
    """A torch.export archive's module runs one flat graph: its layers are no modules qtool can watch, so no layer's
    inputs are collected (GPTQ's and AdaRound's XᵀX, an activation-weighted search's E[x²]); it said "never ran on
    the calibration data" after the data had run."""
    from ..model.insert import is_exported_graph

    needing = [q for q in plan.weights if q.needs_inputs]
    if needing and is_exported_graph(model):
        q = needing[0]
        how = f"rounding {q.rounding}" if q.rounds_layerwise else "an activation-weighted search"
        raise UsageError(f"{checkpoint}: {q.name} asks for {how}, which needs each layer's inputs, and a torch.export "
                         "archive (.pt2) runs one flat graph whose layers qtool cannot watch: save the model's "
                         "state_dict() and pass --model-class, or use a recipe without gptq, adaround or weighting: "
                         "activations")


def streams(plan: Plan, opts: CalibrateOptions) -> bool:
    """Whether a Hugging Face directory's calibration of ``plan`` streams its weights: no --data, weights only,
    no rotation (a rotation changes the whole model: in memory)."""
    return opts.data is None and not plan.needs_data() and plan.rotation is None


def estimate_run(model, plan: Plan, mode: str, opts: CalibrateOptions):
    """``calibration.memory.estimate_memory`` for ``plan`` on ``model`` with ``opts``' batches and samples."""
    from .memory import estimate_memory

    return estimate_memory(model, plan, mode, opts.batch_size, opts.seq_len, opts.num_samples,
                           causal_lm_class(model))


def _check_memory(estimate) -> None:
    """Refuse an in-memory run whose estimated peak is past the memory the machine has where ``--sequential``
    would fit: one line naming the flag, before the model is loaded (an OOM kill says nothing)."""
    from .memory import available_memory

    free = available_memory()
    if free is None or estimate.peak <= free or estimate.sequential is None or estimate.sequential > free:
        return
    raise UsageError(f"calibrating in memory needs about {estimate.peak / 1e9:.1f} GB and this machine has "
                     f"{free / 1e9:.1f} GB available: pass --sequential (about {estimate.sequential / 1e9:.1f} GB, "
                     "one decoder block at a time)")


def _data(opts: CalibrateOptions, plan: Plan, tokenizer: Any, causal: bool, hooks: Hooks,
          config: Any = None, records: bool = True) -> Optional[CalibrationData]:
    """The calibration data, where the plan or mode needs it; ``records``: this process writes the manifest, so the
    files are hashed as read (the other ranks of a torchrun do not)."""
    if not (plan.needs_data() or opts.data or opts.sequential):
        return None
    if opts.data is None:
        why = ("--sequential runs the model block by block" if opts.sequential
               else "the recipe quantizes activations" if plan.static_activations
               else "the recipe changes the float model from data (fold_batch_norms, smoothquant, awq)"
               if plan.folds or plan.smoothing or plan.awq is not None
               else "the recipe chooses weights from data (rounding gptq or adaround, or weighting: activations or "
                     "activations_magnitude)")
        raise DataError(f"{why}, which needs calibration data: pass --data PATH")
    hooks.on_stage("reading calibration data")
    data = load_data(opts.data, opts.batch_size, opts.num_samples, opts.seed, opts.seq_len, tokenizer,
                     pack_text=causal)
    if records:  # (hashed as read, for the manifest: a file rewritten while the run calibrates is recorded as used)
        data.sha256 = {str(f): sha256_file(f) for f in data.files}
    short = shortfalls(plan, data)
    if short and data_amount(data) == (0, "tokens"):  # (every attention_mask all zero): not little, nothing
        raise DataError(f"{opts.data}: the calibration data holds no token its attention_mask keeps (every mask is "
                        "0): nothing to calibrate on")
    if short and opts.strict_data:
        raise DataError(f"{opts.data}: {short[0]} (--strict-data)")
    plan.warnings.extend(short)
    past = past_positions(config, longest_sample(data.batches), data.files)
    if past is not None:
        plan.warnings.append(past)
    return data


@dataclass
class PreparedRun:
    """A calibration resolved before it runs: its mode, the plan (made once, on the model the mode runs: the
    meta-device skeleton of a sequential or streaming run, the loaded model in memory) and what the mode needs of
    the model. The job admits the plan to its format here, before any data is read (:func:`prepare_calibration`,
    then :func:`calibrate_prepared`)."""

    mode: str
    plan: Plan
    model: Any  # nn.Module: the skeleton (streaming), the meta-device model (sequential) or the loaded model
    device: torch.device
    tokenizer: Any = None
    loaded: Any = None  # model.load.LoadedModel (in memory)


def prepare_calibration(checkpoint: str, recipe: Recipe, source: str, opts: CalibrateOptions,
                        hooks: Optional[Hooks] = None) -> PreparedRun:
    """Choose the mode, load what it runs on and resolve ``recipe`` to the plan on it (with its memory estimate
    and warnings). ``source`` names the recipe in error messages."""
    from ..model.load import resolve_device

    hooks = hooks or Hooks()
    opts.check()
    hooks.on_stage("loading checkpoint")
    mode, skeleton, plan = choose_mode(checkpoint, recipe, opts, source)
    if mode == "sequential":
        from ..model.hf import meta_causal_lm
        from .sequential import sequential_decoder

        device = resolve_device(opts.device)
        model, _, tokenizer = meta_causal_lm(checkpoint, opts.trust_remote_code)
        sequential_decoder(model)  # (a model it cannot walk: refused before the plan and its estimate are shown)
        plan = _resolve(recipe, model, source, opts, checkpoint)
        _warn_all_experts(plan, opts, model)
        plan.memory = estimate_run(model, plan, "sequential", opts)
        if plan.smoothing or plan.folds:
            raise UsageError(f"{'smoothquant' if plan.smoothing else 'fold_batch_norms'} runs on the whole model: "
                             "calibrate without --sequential")
        return PreparedRun(mode, plan, model, device, tokenizer)
    if mode == "streaming":
        plan.memory = estimate_run(skeleton, plan, "streaming", opts)
        return PreparedRun(mode, plan, skeleton, resolve_device(opts.device))
    from ..model.load import load_model

    loaded = load_model(checkpoint, opts.model_class, opts.device, opts.trust_pickle, opts.trust_remote_code)
    plan = _resolve(recipe, loaded.model, source, opts, checkpoint)
    _refuse_learned_rounding(plan, loaded.is_causal_lm)
    _refuse_graph_statistics(plan, loaded.model, checkpoint)
    _warn_all_experts(plan, opts, loaded.model)
    plan.memory = estimate_run(loaded.model, plan, "in_memory", opts)
    return PreparedRun(mode, plan, loaded.model, next(iter(loaded.model.parameters())).device, loaded.tokenizer,
                       loaded)


def calibrate_checkpoint(checkpoint: str, recipe: Recipe, source: str, opts: CalibrateOptions,
                         sidecar: Optional[Path], hooks: Optional[Hooks] = None,
                         group: Optional[Group] = None, state: Optional[Path] = None) -> CalibrationRun:
    """:func:`prepare_calibration` then :func:`calibrate_prepared`, the plan shown through ``hooks.on_plan``."""
    hooks = hooks or Hooks()
    prepared = prepare_calibration(checkpoint, recipe, source, opts, hooks)
    hooks.on_plan(prepared.plan)
    return calibrate_prepared(checkpoint, prepared, source, opts, sidecar, hooks, group, state)


def calibrate_prepared(checkpoint: str, prepared: PreparedRun, source: str, opts: CalibrateOptions,
                       sidecar: Optional[Path], hooks: Optional[Hooks] = None, group: Optional[Group] = None,
                       state: Optional[Path] = None) -> CalibrationRun:
    """Calibrate ``prepared``'s plan on ``checkpoint``; large block encodings of a streamed run go to ``sidecar``
    as each weight is done. With a distributed ``group`` (see :mod:`qtool.parallel`) every rank calls this with the
    same arguments and calibrates its shard of the data; the entries are complete on rank 0 (``sidecar`` is only
    written there: None elsewhere). ``state``: where a sequential run keeps its resumable state (:mod:`.resume`;
    ``opts.resume`` continues the one there)."""
    hooks = hooks or Hooks()
    # the long steps inside (weight searches, GPTQ) report to the job's hooks; qtool's own products are float32
    # whatever a library caller set (the data passes take opts.matmul_precision inside)
    with reporting(hooks), exact():
        return _calibrate_prepared(checkpoint, prepared, source, opts, sidecar, hooks, group or Group(), state)


def _calibrate_prepared(checkpoint: str, prepared: PreparedRun, source: str, opts: CalibrateOptions,
                        sidecar: Optional[Path], hooks: Hooks, group: Group,
                        state: Optional[Path]) -> CalibrationRun:
    mode, plan, model, device = prepared.mode, prepared.plan, prepared.model, prepared.device
    check_choice("matmul_precision", opts.matmul_precision, MATMUL_PRECISIONS)
    precision = opts.matmul_precision  # the model's products in the data passes
    if (why := unsupported(precision, device)) is not None:
        plan.warnings.append(f"--matmul-precision {precision}: {why}; the model's products stay float32")
        precision = "highest"
    if mode == "sequential":
        from .sequential import calibrate_sequential

        data = _data(opts, plan, prepared.tokenizer, True, hooks, getattr(model, "config", None), group.is_root)
        saved = _resume_state(state, checkpoint, source, opts, data, device, group, hooks)
        hooks.on_stage("calibrating")
        codes = SpilledTensors()  # block by block to disk: they would grow in memory with every block
        floats: Dict[str, torch.Tensor] = {}
        try:
            with _sidecar_stream(sidecar, plan, group) as sink, all_tokens_routed(model, opts.all_experts):
                entries = calibrate_sequential(checkpoint, plan, data, device, model, on_block=hooks.on_block,
                                               codes=codes, group=group, floats=floats, sink=sink, state=saved,
                                               precision=precision)
        except UsageError:  # bad input fails a resume the same way: its state goes with the rest of the output
            if saved is not None and saved.resumed_from == 0:  # (never a state an earlier run left)
                saved.remove()
            raise
        done = {e.name for e in entries}
        unused = [q.name for q in plan.static_activations if q.name not in done]
        return CalibrationRun(entries, plan, mode, device, tensor_files(Path(checkpoint)), "hf", data, unused, codes,
                              floats, samples_per_rank=samples_per_rank(data, group))
    if mode == "streaming":  # no --data and a weight-only plan: there is no data to read
        from .streaming import calibrate_weights_streaming

        hooks.on_stage("calibrating")
        with _sidecar_stream(sidecar, plan, group) as sink:
            entries = calibrate_weights_streaming(checkpoint, plan, model, sink=sink, group=group)
        # dynamic activation rows (no data needed) are entries too, in plan order as in the other modes
        by_name = {e.name: e for e in entries}
        by_name.update({q.name: EncodingEntry.from_quantizer(q, None) for q in plan.activations})
        entries = [by_name[q.name] for q in plan.quantizers if q.name in by_name]
        return CalibrationRun(entries, plan, mode, device, tensor_files(Path(checkpoint)), "hf", None, [],
                              samples_per_rank=samples_per_rank(None, group))
    from ..model.insert import insert_quantizers
    from .in_memory import calibrate

    loaded = prepared.loaded
    data = _data(opts, plan, loaded.tokenizer, loaded.is_causal_lm, hooks, getattr(model, "config", None),
                 group.is_root)
    hooks.on_stage("calibrating")
    quantizers = insert_quantizers(model, plan)
    with all_tokens_routed(model, opts.all_experts):
        result = calibrate(model, plan, quantizers, data if plan.needs_data() else None, device,
                           hooks.on_batch, group, precision)
    entries = [EncodingEntry.from_quantizer(q, quantizers[q.name]) for q in plan.quantizers
               if quantizers[q.name].is_initialized()]
    return CalibrationRun(entries, plan, mode, device, loaded.files, loaded.kind, data, result.unused, result.codes,
                          _checkpoint_names(result.replaced, loaded),
                          samples_per_rank(data if plan.needs_data() else None, group))


def _resume_state(directory: Optional[Path], checkpoint: str, source: str, opts: CalibrateOptions,
                  data: CalibrationData, device: torch.device, group: Group, hooks: Hooks):
    """The resumable state of a sequential run in ``directory`` (None: the run keeps none)."""
    from .resume import ResumeState, batches_digest, fingerprint

    if directory is None:
        return None
    files = files_read(Path(checkpoint))
    options = opts.recorded()
    for key in ("data", "imatrix"):  # the same file from another working directory (or spelled another way)
        if options.get(key) and Path(options[key]).exists():
            options[key] = str(Path(options[key]).resolve())
    stamp = fingerprint(versions=versions(), checkpoint_files=files,
                        data_files=data.files if data is not None else [], recipe=source, imatrix=opts.imatrix,
                        options=options, world_size=group.world_size, device=device_label(device),
                        batches=group.all_gather(batches_digest(data.batches) if data is not None else None),
                        threads=group.all_gather(torch.get_num_threads()) if device.type == "cpu" else None)
    state = ResumeState.open(directory, stamp, group, opts.resume)
    if opts.resume:
        hooks.on_stage(f"resuming after block {state.blocks_done}" if state.blocks_done else
                       "resuming: no block was saved, starting from the first")
    return state


@contextlib.contextmanager
def _sidecar_stream(sidecar: Optional[Path], plan: Plan, group: Group):
    """The sink to which a mode that finishes weights one at a time sends their entries, so that the large ones
    go to ``sidecar`` at once (None where this rank writes nothing); closed when the run ends, aborted on an
    error (the output directory is then discarded)."""
    if sidecar is None or not group.is_root:
        yield None
        return
    stream = SidecarStream(sidecar, [(q.name, tuple(q.shape), q.granularity) for q in plan.weights])
    try:
        yield stream.put
    except BaseException:
        stream.abort()
        raise
    stream.close()


def _checkpoint_names(tensors: Dict[str, torch.Tensor], loaded) -> Dict[str, torch.Tensor]:
    """Key parameters by the checkpoint's tensor names (a base-model prefix may differ from the model's)."""
    to_checkpoint = {model: ckpt for ckpt, model in loaded.name_map.items()}
    return {to_checkpoint.get(name, name): t for name, t in tensors.items()}
