"""Which modules the compressed-tensors export writes quantized (see ``qtool.export.compressed_tensors``): the
Linear layers among the weight encodings (embeddings, other modules and one side of a tied weight stay float),
the input quantizers a config group holds, and the routers and tied parameters a checkpoint's module names
reveal."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from ..encodings import EncodingEntry
from ..errors import EncodingsError


def _routers(model: nn.Module, modules: Dict[str, nn.Module], keys: List[str]) -> List[str]:
    """Mixture-of-experts routers (transformers' ``*Router`` modules: a float 2-D weight, not an ``nn.Linear``) by
    the checkpoint's module names (Mixtral's ``block_sparse_moe.gate``): runtimes build them as Linear layers, so
    ``ignore`` lists them as llm-compressor does."""
    from ..model.checkpoint_map import CheckpointMap

    routers = [n for n, m in modules.items() if type(m).__name__.endswith("Router")
               and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2]
    if not routers:
        return []
    stored = {name: key for key, name in CheckpointMap(model, keys).renamed().items()}
    return [stored.get(f"{name}.weight", f"{name}.weight")[: -len(".weight")] for name in routers]


def _tied_params(model: nn.Module) -> Dict[str, set]:
    """For every parameter shared between modules: its name -> all names of that tensor."""
    groups: Dict[int, set] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), set()).add(name)
    return {n: g for g in groups.values() if len(g) > 1 for n in g}


def _written_input(e) -> bool:
    """A dynamic or FP8 input quantizer: the config group's ``input_activations`` hold it."""
    return e.tensor == "input" and (e.dynamic or e.is_float)


def _unwritten_activations(entries) -> list:
    """Static integer input and every output quantizer: the layout has no place for them (they run in float)."""
    written = {e.module for e in entries if _written_input(e)}
    return [e for e in entries if e.tensor in ("input", "output") and e.module not in written]


def select_linear(entries: List[EncodingEntry], model: nn.Module, modules: Dict[str, nn.Module],
                  tied_names: Dict[str, set], warnings: List[str]) -> Tuple[List[EncodingEntry], List[str], List[str]]:
    """``(linear, float_embeddings, skipped)``: the weight encodings written quantized (Linear modules whose weight
    is not shared), and the embedding and other modules left float (each said in ``warnings``)."""
    linear: List[EncodingEntry] = []
    float_embeddings: List[str] = []
    skipped: List[str] = []
    for e in entries:
        if e.tensor != "weight":
            continue
        mod = modules.get(e.module)
        if mod is None:
            raise EncodingsError(
                f"encodings quantize {e.module!r}, which this model ({type(model).__name__}) does not have; were "
                "they made for another model?"
            )
        if isinstance(mod, nn.Embedding):
            float_embeddings.append(e.module)
            continue
        if not isinstance(mod, nn.Linear):
            skipped.append(e.module)
            continue
        if f"{e.module}.weight" in tied_names:
            # compressing one side of a shared tensor would break the tie on load (llm-compressor unties first)
            others = sorted(tied_names[f"{e.module}.weight"] - {f"{e.module}.weight"})
            warnings.append(f"{e.module}: its weight is shared with {', '.join(others)}; left in float")
            skipped.append(e.module)
            continue
        linear.append(e)
    if float_embeddings:
        warnings.append(f"{len(float_embeddings)} embedding weight(s) left in float: {', '.join(float_embeddings)}")
    if skipped:
        warnings.append(f"{len(skipped)} non-Linear or tied weight(s) left in float: {', '.join(skipped)}")
    return linear, float_embeddings, skipped
