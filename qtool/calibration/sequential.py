"""Sequential calibration of Hugging Face causal LMs: one decoder block in memory at a time.

``qtool calibrate --sequential`` never loads the whole model. The model is built on the ``meta`` device (no
memory), and weights are read from the checkpoint's safetensors files module by module:

1. the embedding table is loaded and the real model runs with each decoder block standing aside (its forward
   replaced by a recorder that passes the hidden states through): the first block's inputs are captured, and
   every block's keywords (attention mask, rotary position embeddings, position ids: a model may give its blocks
   different ones, as Gemma 3 gives its sliding-window and global layers) for every calibration batch; the
   pass stops at the last block;
2. for each block in turn: its weights are loaded, its quantizers are inserted and calibrated (weights from the
   weights, activations over all batches with the captured inputs), its outputs become the next block's inputs,
   and the block is dropped again;
3. the modules after the blocks (final norm, ``lm_head``) are calibrated the same way if the recipe quantizes them.

The encodings equal those of a normal run: a block's outputs for the next block are computed during its own
calibration pass, with each batch quantized by its own range, exactly as in the all-at-once pass (tested).
Peak memory is about one block's weights (in float32) plus the captured activations
(``samples x seq_len x hidden x 4`` bytes) plus the embedding table while step 1 runs.
Supported: models whose decoder blocks live in ``model.model.layers`` (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, the
mixture-of-experts families, SmolLM, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from ..config import Plan
from ..data import CalibrationData, batch_where, model_takes
from ..encodings import EncodingEntry
from ..errors import CheckpointError, UsageError
from ..io.checkpoint import CheckpointTensors
from ..model.checkpoint_map import CheckpointMap
from ..model.expert_view import ExpertSlices, open_checkpoint
from ..model.experts import checkpoint_key
from ..model.insert import drop_weight_caches, insert_quantizers
from ..model.load import decoder_stack
from ..parallel import Group
from ..quant.precision import model_matmuls
from .collective import calibrate_activations_dp, calibrate_weights_split, merge_inputs, shard
from .heap import return_freed_memory
from .resume import BlockResult, ResumeState
from .rotation import Rotator
from .rounding import collect_inputs, importance, learn_rounding, round_weights, routed_fallbacks

__all__ = ["calibrate_sequential", "sequential_decoder"]


class _Stop(Exception):
    """Raised by the capture hook to end the forward pass at the first decoder block."""


def sequential_decoder(model: nn.Module) -> Tuple[str, nn.Module]:
    """``(name, module)`` of the decoder stack ``--sequential`` walks block by block; ``UsageError`` for a model
    it cannot walk."""
    found = decoder_stack(model)
    if found is None:
        raise UsageError("--sequential supports causal LMs whose decoder blocks are model.model.layers "
                         f"(Llama, Mistral, Qwen2, ...; a multimodal model's model.model.language_model.layers); "
                         f"{type(model).__name__} is not one")
    return found


def _materialize(module: nn.Module, prefix: str, src: Union[CheckpointTensors, ExpertSlices],
                 name_of: Callable[[str], str], device: torch.device,
                 converted: Optional[CheckpointMap] = None) -> None:
    """Load ``module``'s parameters and persistent buffers from the checkpoint (as float32 for float tensors);
    ``converted`` makes those transformers builds from other tensors at load time (fused experts). A buffer the
    checkpoint does not hold keeps the value the skeleton computed (Gemma's embedding scale)."""
    computed = {n: b.clone() for n, b in module.named_buffers() if b.device.type != "meta"}
    module.to_empty(device=device, recurse=True)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            full = f"{prefix}.{name}" if prefix else name
            key = name_of(full)
            if key is not None:
                value = src.get(key)
            elif converted is not None and full in converted:
                value = converted.get(full, src.get)
            elif isinstance(t, nn.Parameter):
                raise CheckpointError(f"{src.path}: checkpoint has no tensor for {full}")
            elif name in computed:
                value = computed[name]
            else:
                continue
            t.copy_(value.to(t.dtype) if t.is_floating_point() else value)


def _release(module: nn.Module) -> None:
    """Free a finished part: its parameters and buffers go to the meta device, and the fake-quant weights cached
    beside them (one float copy of each quantized weight) are dropped, so nothing of it stays in memory."""
    drop_weight_caches(module)
    module.to("meta")
    return_freed_memory()


def _run_to_last_input(block: nn.Module, captured: List[Tuple[tuple, dict]], needed: List[nn.Module]) -> None:
    """Run ``block`` on every captured batch for its layers' inputs only: once the first batch has shown in
    which order the ``needed`` layers run (each once), the later batches stop at the last one's input (the
    statistics hooks, registered before, have seen it), which saves the layers after it (a Llama block's
    ``down_proj``, a quarter of its multiply-adds)."""
    order: List[int] = []
    handles = [m.register_forward_pre_hook(lambda mod, args, i=i: order.append(i)) for i, m in enumerate(needed)]
    try:
        for j, (args, kwargs) in enumerate(captured):
            try:
                block(*args, **kwargs)
            except _Stop:
                pass
            if j == 0:
                for h in handles:
                    h.remove()
                handles = []
                if needed and sorted(order) == list(range(len(needed))):  # each ran exactly once
                    handles = [needed[order[-1]].register_forward_pre_hook(_stop)]
    finally:
        for h in handles:
            h.remove()


def _stop(module, args):
    raise _Stop


def calibrate_sequential(path, plan: Plan, data: CalibrationData, device: torch.device, model: nn.Module,
                         on_block: Optional[Callable[[int, int], None]] = None,
                         codes: Optional[Dict[str, torch.Tensor]] = None,
                         group: Optional[Group] = None,
                         floats: Optional[Dict[str, torch.Tensor]] = None,
                         sink: Optional[Callable[[EncodingEntry], EncodingEntry]] = None,
                         state: Optional[ResumeState] = None, precision: str = "highest") -> List[EncodingEntry]:
    """Calibrate ``plan`` on ``model`` (a meta-device skeleton from ``qtool.model.hf.meta_causal_lm``), block by
    block. Codes chosen by a rounding algorithm go into ``codes`` (quantizer name -> integer tensor), tensors a
    rotation (``plan.rotation``, fused part by part as each part is loaded) changed into ``floats``. ``sink``
    (e.g. :meth:`qtool.encodings.SidecarStream.put`) receives each weight entry as its block finishes, in plan
    order, and what it returns is kept instead (the block ranges of a large model need not stay in memory). With a
    distributed ``group`` this rank carries its shard of the batches through the blocks and the ranks combine
    each block's statistics before the next (:mod:`.collective`); activation entries come back on rank 0 only.

    ``state`` (:mod:`.resume`) records each finished block; blocks it holds already (a resumed run) are taken from
    it instead of being calibrated again, and the next block starts from their saved outputs. ``precision``: the
    model's float32 products in the data passes (:mod:`qtool.quant.precision`)."""
    group = group or Group()
    codes = {} if codes is None else codes
    floats = {} if floats is None else floats
    data = shard(data, group)
    src = open_checkpoint(path, model=model)
    keys = set(src.keys())
    tied = getattr(model.config, "tie_word_embeddings", False)

    def name_of(full: str) -> Optional[str]:
        if full in keys:
            return full
        if (key := checkpoint_key(model, full)) is not None and key in keys:  # a renamed expert (Mixtral's)
            return key
        if tied and full == "lm_head.weight" and "model.embed_tokens.weight" in keys:
            return "model.embed_tokens.weight"
        return None

    converted = CheckpointMap(model, keys)
    renamed = {name: key for key, name in converted.renamed().items()}

    def keyed(changed: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Tensors a rotation changed, by their checkpoint names (as the in-memory run names them)."""
        return {checkpoint_key(model, n) or renamed.get(n, n): t for n, t in changed.items()}
    stack_name, stack = sequential_decoder(model)
    blocks = stack.layers
    modules = dict(model.named_modules())
    block_names = [f"{stack_name}.layers.{i}" for i in range(len(blocks))]

    def rows_under(prefix: Optional[str], outside: bool = False):
        if outside:
            return [q for q in plan.quantizers if not any(q.module == b or q.module.startswith(b + ".")
                                                          for b in block_names)]
        return [q for q in plan.quantizers if q.module == prefix or q.module.startswith(prefix + ".")]

    def reduced(run: Callable[[], None]) -> Callable[[], None]:
        """``run``, a data pass, with the model's products at ``precision``."""
        def pass_():
            with model_matmuls(precision):
                run()
        return pass_

    def awq_block(prefix: str, block: nn.Module, inputs) -> Dict[str, torch.Tensor]:
        """AWQ's groups inside the block (qtool.calibration.awq), on the float block's inputs (the quantized
        blocks' outputs before it), searched and folded before its quantizers are inserted; the block's output on
        the first input must stay what it was."""
        from .awq import apply_awq, output_objective, scored_inputs
        from .in_memory import MISFIT, SMOOTH_TOLERANCE, _relative_change
        from .rounding.statistics import collect_module_inputs

        groups = tuple(g for g in plan.awq.groups if g.smooth.startswith(prefix + "."))
        if not groups:
            return {}
        outputs = plan.awq.objective == "outputs"
        scored = scored_inputs(groups, modules, hessian=not outputs)
        stats = merge_inputs(collect_module_inputs(
            scored, modules, reduced(lambda: _run_to_last_input(block, inputs, [modules[n] for n in scored]))), group)

        def output():  # (on the first input; a rank given no batch under torchrun has none, and checks nothing)
            if not inputs:
                return None
            args, kwargs = inputs[0]
            out = block(*args, **kwargs)
            return (out[0] if isinstance(out, (tuple, list)) else out).detach()

        with torch.no_grad():
            before = output()
            batches = [lambda a=a, k=k: block(*a, **k) for a, k in inputs]
            changed = apply_awq(dataclasses.replace(plan.awq, groups=groups), modules, stats,
                                {q.module: q for q in plan.weights}, plan.warnings,
                                (lambda g: output_objective(g, modules, batches, group)) if outputs else None)
            err = 0.0 if before is None else _relative_change(before, output())
        if not err <= SMOOTH_TOLERANCE:
            raise UsageError(f"awq: folding the scales changes {prefix}'s outputs (relative error {err:.2g}); a "
                             f"mapping does not fit this model: {MISFIT.format(key='awq')}")
        return changed

    entries: Dict[str, EncodingEntry] = {}
    finished: List[EncodingEntry] = []  # the entries of the block being calibrated, numbers in memory (for state)

    def keep(entry: EncodingEntry) -> None:
        """A finished entry, its large weight ranges handed to ``sink`` (which keeps them out of memory)."""
        entries[entry.name] = sink(entry) if sink is not None and entry.tensor == "weight" else entry

    def calibrate_rows(rows, run: Callable[[], None], run_float: Optional[Callable[[], None]] = None,
                       block: Optional[nn.Module] = None, inputs=(), prefix: str = ""):
        """Insert and calibrate the quantizers of ``rows``; ``run`` feeds the data. Weights chosen from data
        (GPTQ, activation weighting) first get their layers' inputs from ``run_float`` (the float block on the
        same inputs, before any quantizer is inserted), so each block's statistics come from the quantized
        outputs of the blocks before it; weights whose rounding is learned (signround) learn it on ``block``
        (named ``prefix``) over ``inputs``."""
        if not rows:
            run()
            return
        sub = Plan(rows)
        stats = collect_inputs(sub.weights, modules, run_float or run)
        if any(q.needs_inputs for q in sub.weights):
            stats = merge_inputs(stats, group)
            routed_fallbacks(sub.weights, modules, stats, plan.warnings, plan.expert_tokens)
        qs = insert_quantizers(model, sub)
        def weight_of(q):
            return modules[q.module]._parameters["weight"]

        sizes = {q.name: weight_of(q).numel() for q in sub.weights}
        calibrate_weights_split(sub.weights, sizes, lambda q: qs[q.name], weight_of, group,
                                importance_for=lambda q: importance(q, stats, weight_of(q).shape, plan.importances))
        # a weight the checkpoint stores under another module's name (a tied lm_head) was loaded as its own copy
        stored_elsewhere = [q.module for q in sub.weights if name_of(f"{q.module}.weight") not in (f"{q.module}.weight",
                                                                                                 q.name)
                            and not (plan.rotation is not None and plan.rotation.untie)]
        codes.update(round_weights([q for q in sub.weights if q.needs_inputs], modules, qs, stats, plan.warnings,
                                   tied=stored_elsewhere, group=group))
        codes.update(learn_rounding([q for q in sub.weights if q.learns_rounding], block, prefix, list(inputs),
                                    modules, qs, group, plan.warnings, plan.learned))
        calibrate_activations_dp(sub.static_activations, qs, run, group)
        for q in rows:
            if qs[q.name].is_initialized():
                entry = EncodingEntry.from_quantizer(q, qs[q.name])
                finished.append(entry)
                keep(entry)

    # 1. capture the first block's inputs
    embed = model.get_input_embeddings()
    embed_name = next(n for n, m in modules.items() if m is embed)
    _materialize(embed, embed_name, src, name_of, device, converted)
    rotator = Rotator(model, plan.rotation) if plan.rotation is not None else None
    if rotator is not None:
        floats.update(keyed(rotator.embedding()))
    captured: List[Tuple[tuple, dict]] = []  # per batch: the first block's inputs
    # per batch, per block: the keywords the model passes that block (a model may give its blocks different ones:
    # Gemma 3's sliding-window layers get other rotary embeddings and masks than its global ones)
    block_kwargs: List[List[dict]] = []

    def recorder(i: int):
        def forward(*args, **kwargs):
            if i == 0:
                captured.append((tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), dict(kwargs)))
                block_kwargs.append([])
            block_kwargs[-1].append(dict(kwargs))
            if i == len(blocks) - 1:
                raise _Stop
            return args[0] if args else kwargs["hidden_states"]  # the block is not run: its keywords are all we need
        return forward

    head_rows = [q for q in rows_under(None, outside=True) if q.module == embed_name]

    def capture():
        for i, block in enumerate(blocks):
            block.forward = recorder(i)
        try:
            for batch in data:
                b = batch.to(device)
                # (the recorder stops the pass once the first block's inputs are captured)
                where = batch_where(data.source, "calibration", data.first + len(captured) + 1)
                with model_takes(model, b, where):
                    try:
                        model(*b.args, **{**b.kwargs, "use_cache": False})
                    except _Stop:
                        pass
        finally:
            for block in blocks:
                del block.forward

    calibrate_rows(head_rows, reduced(capture))
    if len(captured) != len(data) or any(len(k) != len(blocks) for k in block_kwargs):
        raise UsageError("--sequential: the model did not pass through each of its decoder blocks for every batch")
    if not (tied and any(q.module == "lm_head" for q in plan.quantizers)):
        _release(embed)

    # 2. block by block
    tail = [q for q in rows_under(None, outside=True) if q.module != embed_name]
    rotate_head = rotator is not None and plan.rotation.rotates_head
    done = 0
    resumed = state.blocks_done if state is not None else 0
    for i in range(resumed):  # blocks a stopped run finished: their results, not their work
        if group.is_root:
            saved = state.block(i)
            for e in saved.entries:
                keep(e)
            codes.update(saved.codes)
            floats.update(saved.floats)
            plan.warnings.extend(saved.warnings)
            plan.expert_tokens.update(saved.expert_tokens)
            if plan.awq is not None:
                plan.awq.chosen.extend(saved.awq)
            plan.learned.extend(saved.learned)
        done += 1
    if resumed and on_block:  # one line for them all (one per block read as if each were calibrated again)
        on_block(done, len(blocks))
    if resumed and (resumed < len(blocks) or tail or rotate_head):
        hidden = state.hidden()
        if len(hidden) != len(captured):
            raise UsageError(f"{state.directory}: the saved state holds {len(hidden)} batches' block outputs, this run "
                             f"has {len(captured)}: run without --resume to start over")
        for j, (h, (args, _)) in enumerate(zip(hidden, captured)):  # (a block's outputs are shaped as its inputs)
            if h.shape != args[0].shape or h.dtype != args[0].dtype:
                raise UsageError(f"{state.directory}: the saved block outputs of batch {j} are {h.dtype} "
                                 f"{list(h.shape)}, this run's blocks read {args[0].dtype} {list(args[0].shape)}: "
                                 "run without --resume to start over")
        captured = [((h.to(device),) + tuple(args[1:]), kwargs) for h, (args, kwargs) in zip(hidden, captured)]
    for i, block in enumerate(blocks):
        if i < resumed:
            continue
        prefix = block_names[i]
        _materialize(block, prefix, src, name_of, device, converted)
        warned = len(plan.warnings)
        finished.clear()
        changed = {}
        if rotator is not None:
            changed = keyed(rotator.layer(prefix))
            floats.update(changed)
        outputs: List[torch.Tensor] = []
        rows = rows_under(prefix)
        # the last block's outputs feed nothing unless the parts after it are calibrated or rotated
        feeds = i + 1 < len(blocks) or bool(tail) or rotate_head
        runs = feeds or bool(Plan(rows).static_activations)

        inputs = [(args, block_kwargs[j][i]) for j, (args, _) in enumerate(captured)]

        def run_block():
            if not runs:
                return
            for args, kwargs in inputs:
                out = block(*args, **kwargs)
                outputs.append(out[0] if isinstance(out, (tuple, list)) else out)

        def run_float():
            _run_to_last_input(block, inputs, [modules[q.module] for q in rows if q.needs_inputs])

        searched = len(plan.awq.chosen) if plan.awq is not None else 0
        if plan.awq is not None:
            scaled = keyed(awq_block(prefix, block, inputs))
            changed.update(scaled)
            floats.update(scaled)
        learned = len(plan.learned)
        calibrate_rows(rows, reduced(run_block), reduced(run_float), block, inputs, prefix)
        if feeds:
            captured = [((outputs[j],) + tuple(args[1:]), kwargs) for j, (args, kwargs) in enumerate(captured)]
        if state is not None:
            names = {q.name for q in rows}
            routed = {m: n for m, n in plan.expert_tokens.items() if m.startswith(prefix + ".")}
            state.save(i, BlockResult(list(finished), {n: codes[n] for n in names if n in codes}, changed,
                                      plan.warnings[warned:], routed,
                                      plan.awq.chosen[searched:] if plan.awq is not None else [],
                                      plan.learned[learned:]),
                       outputs if feeds else None)
        _release(block)
        done += 1
        if on_block:
            on_block(done, len(blocks))

    if state is not None:
        state.wait()  # the last block's state is on disk before the run goes on
    # 3. what comes after the blocks
    if tail or rotate_head:
        norm = stack.norm
        lm_head = model.get_output_embeddings()
        _materialize(norm, f"{stack_name}.norm", src, name_of, device, converted)
        _materialize(lm_head, "lm_head", src, name_of, device, converted)
        if rotate_head:
            floats.update(keyed(rotator.head()))

        def run_tail():
            for args, _ in captured:
                lm_head(norm(args[0]))

        calibrate_rows(tail, reduced(run_tail))
        _release(norm)
        _release(lm_head)
    _release(embed)
    return [entries[q.name] for q in plan.quantizers if q.name in entries]
