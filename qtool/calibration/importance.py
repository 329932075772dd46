"""An importance matrix file (``llama-imatrix``'s, or ``qtool imatrix``'s) as the activation weighting of a plan.

``--imatrix FILE`` does what ``llama-quantize --imatrix`` does: every searched weight (analyzer ``mse``) of a
decoder matrix the file names is searched weighted by the file's ``E[x²]`` per input column, with no calibration
data needed for it; a row the recipe weights by ``magnitude`` is searched by both multiplied
(``activations_magnitude``, as llama.cpp multiplies its magnitude term by the importances). Weights the file does
not name (the embedding, the output layer unless ``llama-imatrix --process-output`` collected it) keep their own
setting: measured from ``--data`` where they ask for an activation weighting and data is given, without the
importances otherwise (``activations_magnitude`` keeps its magnitude part; a plan warning says how many).

The file names tensors as a GGUF file does (``blk.0.attn_q.weight``), so the checkpoint must be one qtool writes
as GGUF (a Hugging Face Llama-family directory). A file whose entries name tensors the model does not have, or
whose widths differ from the weights', is refused in one line: it was measured on another model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict

import torch
from torch import nn

from ..choices import drop_activations, weighs_activations, with_activations
from ..config import Plan, QuantizerPlan
from ..errors import CheckpointError, DataError, EncodingsError, UsageError
from ..imatrix import read_imatrix
from ..model.hf import natural_key

__all__ = ["apply_imatrix"]


def apply_imatrix(plan: Plan, model: nn.Module, checkpoint: str, path: str, have_data: bool,
                  strict: bool = False) -> Plan:
    """``plan`` with its searched weights weighted by the importance matrix at ``path`` (rows marked
    ``imatrix``, their ``E[x²]`` in ``plan.importances``). ``model`` may be a meta-device skeleton."""
    from ..export.gguf_model import read_gguf_model

    if plan.rotation is not None:  # the file measured the unrotated model: its columns are not the rotated ones
        raise UsageError(f"--imatrix {path}: an importance matrix measures the model's inputs as they are, but the "
                         "recipe's rotate changes them; leave one out (without --imatrix, the weighted search "
                         "measures the rotated inputs from --data)")
    importances = read_imatrix(Path(path))
    try:
        names = read_gguf_model(Path(checkpoint))
    except CheckpointError as e:
        raise UsageError(f"--imatrix names weights as a GGUF file does, which needs a checkpoint qtool writes as "
                         f"GGUF: {e}") from None
    everything = dict(model.named_modules())
    # GGUF name -> matrix row -> module, for every matrix of the model (a stacked expert tensor: one row per expert)
    by_gguf: Dict[str, Dict[int, str]] = {}
    for module, m in everything.items():
        if isinstance(m, nn.Linear):
            try:
                name, row = names.matrix(model, everything, module)
            except CheckpointError:
                continue
            if name is not None:
                by_gguf.setdefault(name, {}).setdefault(row, module)
    for name in sorted(importances):
        if name not in by_gguf:
            raise EncodingsError(f"{path}: {name}: no Linear layer of the model has that GGUF name (an importance "
                                 "matrix weighs Linear layers' inputs; is it another model's?)")
        first = by_gguf[name][min(by_gguf[name])]
        width, matrices = _width(model, first), len(by_gguf[name])
        if importances[name].dim() == 1 and matrices > 1 and importances[name].numel() == matrices * width:
            # imatrix.dat stores a stacked expert tensor's rows one after another (llama-quantize slices them)
            importances[name] = importances[name].reshape(matrices, width)
        shape = tuple(importances[name].shape)
        if shape[-1] != width:
            raise EncodingsError(f"{path}: {name}: {shape[-1]} columns, but {first} takes {width} inputs (an "
                                 "importance matrix of another model?)")
        if len(shape) == 2 and shape[0] != matrices:
            raise EncodingsError(f"{path}: {name}: {shape[0]} experts' rows, but the model has {matrices} experts "
                                 "there (an importance matrix of another model?)")
    # module -> its importances (an expert's row of a stacked tensor's)
    module_entry = {module: (name, importances[name] if importances[name].dim() == 1 else importances[name][row])
                    for name, rows in by_gguf.items() if name in importances for row, module in rows.items()}
    gguf_of = {module: name for name, rows in by_gguf.items() for module in rows.values()}
    rows, used, unweighted, zero, missing = [], {}, 0, [], []
    for q in plan.quantizers:
        if q.tensor != "weight" or q.analyzer != "mse" or q.module_type != "Linear":
            rows.append(q)
            continue
        args = dict(q.analyzer_args)
        entry = module_entry.get(q.module)
        if entry is None and gguf_of.get(q.module, "").startswith("blk."):  # a decoder matrix: the file should
            missing.append(gguf_of[q.module])                               # name it (llama-imatrix does)
        if entry is None:
            if weighs_activations(args.get("weighting")) and not have_data:
                args = drop_activations(args)
                unweighted += 1
                q = dataclasses.replace(q, analyzer_args=tuple(args.items()))
            rows.append(q)
            continue
        entry, values = entry
        if not bool((values != 0).any()):  # nothing to weigh by (or an expert no token reached): unweighted
            zero.append(entry if values is importances[entry] else q.module)
            if weighs_activations(args.get("weighting")) and not have_data:
                args = drop_activations(args)
                q = dataclasses.replace(q, analyzer_args=tuple(args.items()))
            rows.append(q)
            continue
        args["weighting"] = with_activations(args.get("weighting"))
        rows.append(dataclasses.replace(q, analyzer_args=tuple(args.items()), imatrix=True))
        used[q.module] = _statistics(values)
    if zero:
        why = (f"{path}: every importance of {', '.join(zero[:3])}{' ...' if len(zero) > 3 else ''} is zero (no "
               "input reached it in the importance run: an expert no token was routed to, or inputs all zero): "
               f"{len(zero)} weight(s) searched without importances (with the recipe's own weighting)")
        if strict:
            raise DataError(f"{why} (--strict-data)")
    if not used:
        raise UsageError(f"--imatrix {path}: no weight the recipe searches (analyzer mse) on a matrix the file "
                         f"names{' with importances that are not all zero' if zero else ''}; nothing would use it")
    if missing:
        missing = sorted(set(missing), key=natural_key)
        lacks = (f"{path} has no entry for {len(missing)} decoder matri{'x' if len(missing) == 1 else 'ces'} the "
                 f"recipe searches ({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}): searched without "
                 "importances (an importance matrix of a model with fewer layers?)")
        if strict:
            raise DataError(f"{lacks} (--strict-data)")
    warnings = list(plan.warnings) + ([why] if zero else []) + ([lacks] if missing else [])
    if unweighted:
        warnings.append(f"{unweighted} weight(s) asking for an activation weighting have no entry in {path} and no "
                        f"--data was given: searched without importances (activations_magnitude keeps its "
                        "magnitude part)")
    return dataclasses.replace(plan, quantizers=rows, warnings=warnings, importances=used)


def _width(model: nn.Module, module: str) -> int:
    return int(model.get_submodule(module).in_features)


def _statistics(mean_square: torch.Tensor):
    from .rounding import InputStatistics

    return InputStatistics(1, mean_square.to(torch.float64))

