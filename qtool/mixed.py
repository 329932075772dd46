"""Mixed precision at a size budget (``--target-bpw`` / ``--target-size``): the pieces between the candidates'
calibrations and the chosen recipe.

* :func:`fused_groups`: the weights that must share one choice, because runtimes fuse them (a decoder layer's
  q/k/v projections, its gate/up projections) - one group each, every other weight a group of its own.
* :func:`group_damage`: on the first candidate's calibrated fake-quant model (everything quantized, as deployed),
  the change in end-to-end damage when one group at a time takes another candidate's weights. For causal language
  models the damage is the mean per-token KL divergence of the quantized model's next-token distribution from the
  float one (nats); for other models ``1 - cosine`` of the outputs, per sample.
* :func:`costs`: what each group costs in each candidate, in the bytes the export format writes
  (``Exporter.tensor_bytes``), and what the tensors outside every group cost.
* :func:`mixed_recipe`: the first candidate's recipe plus one ``layers`` entry per weight that takes another
  candidate's setting, as YAML a user can read, edit and rerun.

The choice itself is :func:`qtool.quant.knapsack.choose`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .config import Plan, QuantizerPlan, exact_pattern
from .config.fused import FUSED, fused_groups
from .config.loading import load_yaml
from .data import Batch
from .export.base import layout_bytes
from .model.insert import computing_with, fake_quant_weight, set_quantization
from .parallel import Group, shard_bounds
from .report import _main_output, _one_number_each, _per_sample_cosine, next_token_targets

__all__ = ["FUSED", "fused_groups", "group_damage", "Costs", "costs", "mixed_recipe"]  # (FUSED: config.fused's)


def join_tied(groups: Sequence[Tuple[str, ...]], tied: Dict[str, str]) -> List[Tuple[str, ...]]:
    """``groups`` with each tied output layer's group joined to its table's (``tied``: a weight the checkpoint does
    not store -> the stored one it shares), at the first one's place. The two are one tensor: chosen apart, a mix
    could give them settings that differ only in their analyzer, so that the pair the costs counted as one stored
    tensor is written twice."""
    groups = [tuple(g) for g in groups]
    for name, source in tied.items():
        if not name.endswith(".weight"):  # a tied bias costs and chooses nothing
            continue
        a, b = (next((i for i, g in enumerate(groups) if w.rpartition(".")[0] in g), None) for w in (name, source))
        if a is None or b is None or a == b:
            continue
        first, second = min(a, b), max(a, b)
        groups[first] += groups.pop(second)
    return groups


class _Scorer:
    """One batch's damage measures against the float model's output ``ref``: :meth:`score` gives an output's summed
    damage over the batch's tokens (KL, causal LMs) or samples (1 - cosine), how many, and (causal LMs) the summed
    next-token NLL of the batch's own text. The float model's log-probabilities are computed once per batch, not
    once per scored output (the same numbers ``report._token_kl`` gives, bit for bit)."""

    def __init__(self, ref: torch.Tensor, batch: Batch, causal_lm: bool):
        self.batch, self.causal_lm = batch, causal_lm
        if causal_lm:
            self.ref_logp = torch.log_softmax(ref.float(), dim=-1)
            self.ref_p = self.ref_logp.exp()
            mask = batch.kwargs.get("attention_mask")
            self.valid = None if mask is None else mask > 0  # KL: every unpadded position
            self.targets, self.scored = next_token_targets(batch)  # NLL: every next token of unpadded pairs
            self.float_nll, self.tokens = self._nll(self.ref_logp)
        else:
            self.ref, self.float_nll, self.tokens = ref, 0.0, 0

    def _nll(self, logq: torch.Tensor) -> Tuple[float, int]:
        nll = -logq[:, :-1].gather(-1, self.targets.to(logq.device).unsqueeze(-1)).squeeze(-1)
        nll = nll[self.scored.to(nll.device)]
        return float(nll.sum()), int(nll.numel())

    def score(self, out: torch.Tensor) -> Tuple[float, int, float]:
        if not self.causal_lm and _one_number_each(self.ref):
            # one number per sample, whose cosine is its sign: the squared error against the float outputs' mean
            # square, per sample
            ref, out = self.ref.double().reshape(-1), out.double().reshape(-1)
            scale = max(float(ref.pow(2).mean()), torch.finfo(torch.float32).tiny)
            return float((ref - out).pow(2).sum()) / scale, int(ref.numel()), 0.0
        if not self.causal_lm:
            cos = _per_sample_cosine(self.ref, out, self.batch)
            return float((1.0 - cos).sum()), int(cos.numel()), 0.0
        logq = torch.log_softmax(out.float(), dim=-1)
        kl = (self.ref_p * (self.ref_logp - logq)).sum(-1)
        valid = torch.ones_like(kl, dtype=torch.bool) if self.valid is None else self.valid.to(kl.device)
        return float(kl[valid].sum()), int(valid.sum()), self._nll(logq)[0]


def effective_weights(model: nn.Module, modules: Sequence[str]) -> Dict[str, Optional[torch.Tensor]]:
    """Each module's weight as the calibrated fake-quant ``model`` computes with it (stored codes included), or
    None where the model leaves it float."""
    named = dict(model.named_modules())
    out: Dict[str, Optional[torch.Tensor]] = {}
    for m in modules:
        w = fake_quant_weight(named[m])
        out[m] = None if w is None else w.detach().clone()
    return out


@torch.no_grad()
def group_damage(model: nn.Module, batches: Sequence[Batch], groups: Sequence[Tuple[str, ...]],
                 options: Sequence[Dict[str, Optional[torch.Tensor]]], device, causal_lm: bool,
                 progress: Optional[Callable[[int, int, str], None]] = None, group: Optional[Group] = None
                 ) -> Tuple[float, List[List[float]], List[float], Optional[Dict[str, Any]]]:
    """The damage of the base candidate's calibrated fake-quant ``model`` (everything quantized, as deployed), and,
    for each other candidate's weights (``options[c]``: module -> weight, None for float), the change in damage
    when one group at a time takes that candidate's weights (negative: better), and when every group does. For a
    causal language model also the perplexity of the batches' own text under the float model, the base and each
    option with every group, and the mean per-token change in the text's NLL when one group at a time takes each
    option (``{"float", "base", "together": [...], "nll_changes": [[...]]}``; None for other models): the damage
    ranks by closeness to the float model, which need not move the text's perplexity the same way.

    Measuring each change against the deployed base rather than a float model keeps the errors every other layer
    makes in the picture, and the base and the swapped model run the same samples, so their difference is far less
    noisy than either damage. Under torchrun (``group``) each rank runs its share of the batches and every rank gets
    the sums, added in batch order: the numbers of one process, bit for bit."""
    group = group or Group()
    named = dict(model.named_modules())
    start, stop = shard_bounds(len(batches), group.rank, group.world_size)
    steps = (stop - start) * (1 + len(options) * (len(groups) + 1))
    done = 0

    def tick(name):
        nonlocal done
        done += 1
        if progress:
            progress(done, steps, name)

    # per batch: (base damage, count, [[change per group] per option], [all groups per option],
    #             (float NLL, base NLL, [[NLL change per group] per option], [all groups' NLL per option], tokens))
    records = []
    try:
        for b in batches[start:stop]:
            b = b.to(device)
            set_quantization(model, False)
            scorer = _Scorer(_main_output(model(*b.args, **b.kwargs)), b, causal_lm)
            set_quantization(model, True)
            d0, n, nll_base = scorer.score(_main_output(model(*b.args, **b.kwargs)))
            tick("base")
            changes, together, nll_changes, nll_together = [], [], [], []
            for weights in options:
                row, nll_row = [], []
                for g in groups:
                    with computing_with({named[m]: weights[m] for m in g if m in weights}):
                        d, _, nll = scorer.score(_main_output(model(*b.args, **b.kwargs)))
                    row.append(d - d0)
                    nll_row.append(nll - nll_base)
                    tick(g[0])
                changes.append(row)
                nll_changes.append(nll_row)
                with computing_with({named[m]: w for m, w in weights.items()}):
                    d, _, nll = scorer.score(_main_output(model(*b.args, **b.kwargs)))
                together.append(d)
                nll_together.append(nll)
                tick("all groups")
            records.append((d0, n, changes, together,
                            (scorer.float_nll, nll_base, nll_changes, nll_together, scorer.tokens)))
            del scorer
    finally:
        set_quantization(model, True)
    if group.distributed:
        records = [r for from_rank in group.all_gather(records) for r in from_rank]
    base, count = 0.0, 0
    deltas = [[0.0] * len(groups) for _ in options]
    nll_deltas = [[0.0] * len(groups) for _ in options]
    together_sum = [0.0] * len(options)
    nll_sums, nll_together_sums, tokens = [0.0, 0.0], [0.0] * len(options), 0
    for d0, n, changes, together, (nll_float, nll_base, nll_changes, nll_together, t) in records:
        base += d0
        count += n
        for c, row in enumerate(changes):
            for gi, x in enumerate(row):
                deltas[c][gi] += x
                nll_deltas[c][gi] += nll_changes[c][gi]
            together_sum[c] += together[c]
            nll_together_sums[c] += nll_together[c]
        nll_sums = [nll_sums[0] + nll_float, nll_sums[1] + nll_base]
        tokens += t
    count = max(count, 1)
    perplexity = None
    if causal_lm and tokens:
        perplexity = {"float": math.exp(nll_sums[0] / tokens), "base": math.exp(nll_sums[1] / tokens),
                      "together": [math.exp(x / tokens) for x in nll_together_sums],
                      "nll_changes": [[x / tokens for x in row] for row in nll_deltas]}
    return (base / count, [[x / count for x in row] for row in deltas], [t / count for t in together_sum],
            perplexity)


@dataclass
class Costs:
    """Bytes per group per candidate (``None`` rows where a candidate leaves the group float are costed float),
    the bytes of every tensor outside the groups, the float checkpoint's bytes and its number of values."""

    groups: List[List[int]]
    fixed: int
    float_bytes: int
    params: int


def _same_numbers(a: Optional[QuantizerPlan], b: Optional[QuantizerPlan]) -> bool:
    """Whether two rows quantizing one (tied) tensor give it the same values: same grid and analyzer, nothing
    chosen from data (then one stored tensor serves both)."""
    if a is None or b is None:
        return a is None and b is None
    blank = dict(name="", module="", module_type="", rule=None)
    return (replace(a, **blank) == replace(b, **blank) and a.rounding == "nearest" and not a.needs_inputs
            and not b.needs_inputs)


def costs(tensors: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], plans: Sequence[Plan],
          groups: Sequence[Tuple[str, ...]], tensor_bytes: Callable[[Optional[QuantizerPlan], Any, Any], int],
          tied: Optional[Dict[str, str]] = None, tied_apart: bool = False) -> Costs:
    """``tensors``: the checkpoint's stored tensors (name -> shape, dtype). A grouped module's weight is
    ``<module>.weight``. One the checkpoint does not store (``tied``: an output layer's weight -> the stored
    embedding table's) costs nothing where its setting gives the table's numbers, else its own tensor (GGUF then
    writes it apart); with ``tied_apart`` (the format writes it apart always: GGUF for an architecture whose
    loader needs ``output.weight``) it costs its own tensor, quantized or float."""
    tied = tied or {}
    rows = [{q.module: q for q in plan.weights} for plan in plans]
    grouped = {f"{m}.weight" for g in groups for m in g}
    per_group = []
    for g in groups:
        options = []
        for by_module in rows:
            total = 0
            for m in g:
                row = by_module.get(m)
                key = f"{m}.weight"
                if key in tensors:
                    shape, dtype = tensors[key]
                    total += tensor_bytes(row, shape, dtype)
                elif row is not None:
                    source = tied.get(key)
                    if tied_apart or source is None or not _same_numbers(row, by_module.get(source.rpartition(".")[0])):
                        total += tensor_bytes(row, row_shape(row), torch.float32)
                elif tied_apart and key in tied:  # left float in this candidate: the table's copy, float
                    total += tensor_bytes(None, *tensors[tied[key]])
            options.append(total)
        per_group.append(options)
    fixed = sum(tensor_bytes(None, shape, dtype) for k, (shape, dtype) in tensors.items() if k not in grouped)
    if tied_apart:  # a tied weight no candidate quantizes: written float beside its table
        fixed += sum(tensor_bytes(None, *tensors[source]) for name, source in tied.items()
                     if name not in grouped and name.endswith(".weight") and source in tensors)
    float_bytes = layout_bytes([(k, dtype, shape) for k, (shape, dtype) in tensors.items()])
    return Costs(per_group, fixed, float_bytes, sum(math.prod(shape) for shape, _ in tensors.values()))


def row_shape(row: QuantizerPlan) -> Tuple[int, ...]:
    """The weight's own shape, from its encoding shape and block size (per-channel / per-block rows)."""
    spec = row.spec
    if spec.block_size is None:
        raise ValueError(f"{row.name}: the weight's shape is not known from a {spec.granularity.value} row")
    return tuple(int(s) * abs(int(b)) for s, b in zip(spec.shape, spec.block_size))


def _spec_dict(spec, under_float: bool = False) -> Optional[Dict[str, Any]]:
    """A rule's ``weights`` for ``spec``; ``under_float``: the spec it merges over has a float element, which an
    integer grid must name (a rule's keys merge, so ``bitwidth: 8`` alone would keep ``fp4_e2m1``)."""
    if spec is None:
        return None
    out = spec.model_dump(mode="json", exclude_none=True)
    analyzer = {k: v for k, v in out.pop("analyzer").items() if v is not None}
    out["analyzer"] = analyzer["name"] if len(analyzer) == 1 else analyzer
    rounding = {k: v for k, v in out.pop("rounding").items() if v is not None}
    out["rounding"] = rounding["name"] if len(rounding) == 1 else rounding
    if out.get("gguf_type"):  # the type sets the grid: write it alone
        for key in ("bitwidth", "symmetric", "granularity", "block_size", "scale_dtype", "element"):
            out.pop(key, None)
    elif out.get("element") == "int" and not under_float:
        out.pop("element")
    return out


def mixed_recipe(base_text: str, plans: Sequence[Plan], chosen: Dict[str, int], header: str) -> str:
    """The first candidate's recipe with one ``layers`` entry (appended, so it wins) per weight whose chosen
    candidate (``chosen``: module -> candidate index) sets it differently from the first candidate."""
    import yaml

    recipe = load_yaml(base_text) or {}
    recipe.setdefault("version", 1)
    base_specs = plans[0].weight_specs
    defaults = ((recipe.get("defaults") or {}).get("weights") or {}) if isinstance(recipe.get("defaults"), dict) else {}
    rules = []
    for module, c in chosen.items():
        spec = plans[c].weight_specs.get(module)
        base = base_specs.get(module)
        if (None if spec is None else spec.model_dump()) == (None if base is None else base.model_dump()):
            continue
        under_float = base.element != "int" if base is not None else defaults.get("element", "int") != "int"
        rules.append({"match": exact_pattern(module), "weights": _spec_dict(spec, under_float)})
    recipe["layers"] = list(recipe.get("layers") or []) + rules
    body = yaml.safe_dump(recipe, sort_keys=False, default_flow_style=None, width=120, allow_unicode=True)
    return "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body
