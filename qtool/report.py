"""Where accuracy went: per-layer SQNR, end-to-end fidelity, and layer sensitivity, as data.

All measurements run one model: the calibrated fake-quant model, with quantization switched off per module to get
the float reference (``qtool.model.insert.set_quantization``), so no second copy of the weights is held.

* Per layer, for every quantized module: SQNR (dB) of its output against the float model's, (a) with everything
  before it quantized too ("cumulative": the error the layer sees in deployment) and (b) with only that layer
  quantized ("isolated": the layer's own contribution, computed by running the quantized module on the float
  model's input to it).
* End to end: cosine similarity of the final outputs (per sample, mean), perplexity float vs quantized for causal
  language models, top-1 agreement for classifiers.
* Sensitivity: the end-to-end damage (1 - cosine, or the perplexity increase) of quantizing each layer alone.

SQNR = 10 log10(sum(ref^2) / sum((ref - out)^2)), summed over all samples; infinite when the outputs are equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .config import exact_pattern, granularity_word
from .data import Batch, batch_where, model_takes
from .errors import GateFailed, UsageError
from .io.fs import atomic_file
from .model.experts import routing_of
from .model.insert import (QUANTIZERS_ATTR, CACHE_KWARGS, has_stored_weight, quantized_modules, set_quantization,
                           without_stored_weight)
from .parallel import Group, shard_bounds

__all__ = ["LayerError", "Report", "Gate", "evaluate", "sensitivity", "sqnr_db", "check_gates", "enforce_gates",
           "read_search", "pareto_points", "plot_pareto", "tied_notes", "tied_one_way", "output_cosines"]


def grid_summary(entries) -> List[Dict[str, Any]]:
    """The grids an encodings file uses, one row per (tensor kind, grid) with how many quantizers use it:
    ``{"tensor": "weight", "grid": "fp4_e2m1 per_block 16, fp8_e4m3 scales", "quantizers": 14}``."""
    counts: Dict[tuple, int] = {}
    for e in entries:
        spec = e.spec
        kind = spec.element if spec.is_float else ("int" if spec.symmetric else "uint") + str(spec.bitwidth)
        block = spec.block_size if spec.block_size else ()
        length = [b for b in block if b not in (1, -1)]
        gran = granularity_word(e.tensor, spec.granularity.value)
        gran += " " + "x".join(str(b) for b in length) if length else ""
        scales = f", {spec.scale_dtype} scales" if spec.scale_dtype != "float32" else ""
        label = f"{kind} {gran}{scales}" + (", dynamic" if spec.dynamic else "")
        if spec.ggml is not None:
            label = f"GGUF {spec.ggml.name} ({spec.ggml.bits_per_weight:g} bits per weight)"
        key = ("weight" if e.tensor == "weight" else "activation", label)
        counts[key] = counts.get(key, 0) + 1
    return [{"tensor": t, "grid": g, "quantizers": n} for (t, g), n in sorted(counts.items())]


def sqnr_db(signal: float, noise: float) -> float:
    if noise <= 0:
        return math.inf
    if signal <= 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


@dataclass
class LayerError:
    module: str
    module_type: str
    # None: a module the data never ran (an expert routed no token), or, cumulative only, an expert to which the
    # float and the quantized model never routed one same token
    sqnr_cumulative: Optional[float]
    sqnr_isolated: Optional[float]
    # isolated SQNR had the weight been rounded to nearest: only for weights whose codes an algorithm chose (GPTQ)
    sqnr_isolated_rtn: Optional[float] = None


@dataclass
class Report:
    layers: List[LayerError]
    cosine: float
    cosine_min: float
    perplexity_float: Optional[float] = None
    perplexity_quant: Optional[float] = None
    top1_agreement: Optional[float] = None
    kl_divergence: Optional[float] = None  # causal LMs: mean per-token KL of the quantized from the float model
    samples: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def perplexity_increase_pct(self) -> Optional[float]:
        if self.perplexity_float is None or self.perplexity_quant is None:
            return None
        return 100.0 * (self.perplexity_quant / self.perplexity_float - 1.0)

    def worst_first(self) -> List[LayerError]:
        """Lowest cumulative SQNR first; a NaN one (a layer whose outputs hold NaN) before every number."""
        def key(r):
            c, i = r.sqnr_cumulative, r.sqnr_isolated
            return (c is None, not _nan(c), c if c is not None and not _nan(c) else 0.0, i is None, not _nan(i),
                    0.0 if i is None or _nan(i) else i)
        return sorted(self.layers, key=key)

    def to_json(self) -> Dict[str, Any]:
        def num(x):  # JSON has no infinity or NaN: "inf", "-inf", "nan"
            return None if x is None else (str(x) if isinstance(x, float) and not math.isfinite(x) else x)

        return {
            "samples": self.samples,
            "end_to_end": {"cosine_mean": num(self.cosine), "cosine_min": num(self.cosine_min),
                           "perplexity_float": num(self.perplexity_float),
                           "perplexity_quant": num(self.perplexity_quant),
                           "perplexity_increase_pct": num(self.perplexity_increase_pct),
                           "kl_divergence": num(self.kl_divergence), "top1_agreement": num(self.top1_agreement)},
            "layers": [{"module": r.module, "type": r.module_type, "sqnr_cumulative_db": num(r.sqnr_cumulative),
                        "sqnr_isolated_db": num(r.sqnr_isolated),
                        **({} if r.sqnr_isolated_rtn is None else {"sqnr_isolated_rtn_db": num(r.sqnr_isolated_rtn)})}
                       for r in self.worst_first()],
            "notes": self.notes,
        }


def tied_one_way(model: nn.Module) -> List[Tuple[str, str, str]]:
    """``(tensor, quantizing module, other module)`` for each tied weight (one tensor two modules compute with: an
    output layer and the embedding table; ``tensor`` its first name, the one a checkpoint stores) that one of its
    modules quantizes and the other does not."""
    from .config.resolve import tied_parameters

    out = []
    for later, first in tied_parameters(model).items():
        holders = [n.rpartition(".")[0] for n in (first, later)]
        quantizes = [n for n in holders if "weight" in getattr(model.get_submodule(n), QUANTIZERS_ATTR, {})]
        if len(quantizes) == 1:
            out.append((first, quantizes[0], next(n for n in holders if n != quantizes[0])))
    return out


def tied_notes(model: nn.Module) -> List[str]:
    """A sentence per :func:`tied_one_way` weight: the fake-quant model runs the other module on the float tensor,
    which is what a GGUF file stores (the output layer written apart), not what a qtool file does."""
    notes = []
    for tensor, quantizing, other in tied_one_way(model):
        note = (f"{other} computes with {tensor} (tied), which the encodings quantize for {quantizing} only: "
                f"measured with {other} on the float tensor, as a file storing the layer apart holds it (GGUF, ONNX)")
        if quantizing == tensor.rpartition(".")[0]:  # (the table the checkpoint stores: one tensor in a qtool file)
            note += "; a qtool file holds the one quantized tensor for both (qtool eval FILE measures that)"
        notes.append(note)
    return notes


def _main_output(out) -> torch.Tensor:
    """The tensor to compare end to end: logits, else the last hidden state, else the first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        for key in ("logits", "last_hidden_state"):
            if key in out and isinstance(out[key], torch.Tensor):
                return out[key]
        return next(v for v in out.values() if isinstance(v, torch.Tensor))
    if isinstance(out, (tuple, list)):
        return next(v for v in out if isinstance(v, torch.Tensor))
    raise TypeError(f"cannot compare model outputs of type {type(out).__name__}")


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def next_token_targets(batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ids a causal LM's next-token loss scores on ``batch`` (``ids[:, 1:]``) and which of those predictions
    count (both positions unpadded). Token ids are the ``input_ids`` keyword, or the one positional input of a
    single-array tensor file."""
    ids = batch.kwargs["input_ids"] if "input_ids" in batch.kwargs else batch.args[0]
    mask = batch.kwargs.get("attention_mask", torch.ones_like(ids))
    return ids[:, 1:], (mask[:, 1:] > 0) & (mask[:, :-1] > 0)


def next_token_nll_grid(logits: torch.Tensor, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every position's next-token negative log-likelihood ``(B, T - 1)`` and which of them count (padding
    excluded), with each sequence's row kept apart."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target, scored = next_token_targets(batch)
    return -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1), scored


def token_nlls(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Each scored token's next-token negative log-likelihood, in order (padding excluded)."""
    nll, scored = next_token_nll_grid(logits, batch)
    return nll[scored]


def _token_nll(logits: torch.Tensor, batch: Batch) -> tuple:
    """Summed next-token negative log-likelihood and token count (padding excluded)."""
    nll = token_nlls(logits, batch)
    return float(nll.sum()), int(nll.numel())


def _token_kl(ref: torch.Tensor, out: torch.Tensor, batch: Batch) -> tuple:
    """Summed KL divergence of ``out``'s next-token distribution from ``ref``'s over the batch's tokens (padding
    excluded), and how many tokens."""
    logp = torch.log_softmax(ref.float(), dim=-1)
    logq = torch.log_softmax(out.float(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)  # (float32 rounding: -1e-8 for equal outputs)
    mask = batch.kwargs.get("attention_mask")
    valid = torch.ones_like(kl, dtype=torch.bool) if mask is None else mask.to(kl.device) > 0
    return float(kl[valid].sum()), int(valid.sum())


def _masked(a: torch.Tensor, b: torch.Tensor, batch: Optional[Batch]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` with padded token positions (attention_mask 0) zeroed."""
    mask = batch.kwargs.get("attention_mask") if batch is not None else None
    if mask is not None and a.dim() >= 2 and tuple(a.shape[:2]) == tuple(mask.shape):
        m = (mask > 0).to(a.dtype).reshape(tuple(mask.shape) + (1,) * (a.dim() - 2))
        a, b = a * m, b * m
    return a, b


def _per_sample_cosine(a: torch.Tensor, b: torch.Tensor, batch: Optional[Batch] = None) -> torch.Tensor:
    """Cosine per sample over the flattened output; padded token positions (attention_mask 0) are left out, and so
    is a sample they are all of (its outputs, all left out, would read cosine 0)."""
    mask = batch.kwargs.get("attention_mask") if batch is not None else None
    per_token = mask is not None and a.dim() >= 2 and tuple(a.shape[:2]) == tuple(mask.shape)
    a, b = _masked(a.float(), b.float(), batch)
    a = a.reshape(a.shape[0], -1)
    b = b.reshape(b.shape[0], -1)
    if a.shape[1] > _FLOAT32_COSINE_MAX:
        a, b = a.double(), b.double()
    # (float32 rounding can put equal outputs' cosine a few ulps above 1, which no gate or reader expects)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1).float().clamp(-1.0, 1.0)
    return cos[(mask > 0).any(1).to(cos.device)] if per_token else cos


def _one_number_each(out: torch.Tensor) -> bool:
    """Whether each sample's main output is one number (a regression or reranker head, ``[N, 1]`` or ``[N]``)."""
    return out.dim() >= 1 and out.shape[0] > 0 and out.numel() == out.shape[0]


def output_cosines(refs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                   batches: Sequence[Optional[Batch]]) -> torch.Tensor:
    """The main outputs' cosines, per sample (:func:`_per_sample_cosine`). Where each sample's output is one number
    its cosine would be its sign (1.0 whatever the error): the columns of every sample's number are compared
    instead, centred (their correlation: scores near a common mean compare by how they vary, not by that mean),
    one value; NaN for fewer than two samples or a constant column."""
    if refs and all(_one_number_each(r) for r in refs):
        a = torch.cat([r.reshape(-1) for r in refs]).double()
        b = torch.cat([o.reshape(-1) for o in outs]).double()
        if a.numel() < 2:
            return torch.tensor([float("nan")])
        a, b = a - a.mean(), b - b.mean()
        norm = float(a.norm() * b.norm())
        if norm == 0.0:
            return torch.tensor([float("nan")])
        return torch.tensor([float(a @ b) / norm]).float().clamp(-1.0, 1.0)
    return torch.cat([_per_sample_cosine(r, o, b).cpu() for r, o, b in zip(refs, outs, batches)])


def output_errors(refs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                  batches: Sequence[Optional[Batch]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(|out - ref|², |ref|²)`` per sample over the flattened main output (float64; padded token positions left
    out, as :func:`output_cosines` does): the relative error they give sees what a cosine cannot, an output scaled
    or offset as a whole. Where each sample's output is one number, one pair over the column of every sample's
    number."""
    if refs and all(_one_number_each(r) for r in refs):
        a = torch.cat([r.reshape(-1) for r in refs]).double()
        b = torch.cat([o.reshape(-1) for o in outs]).double()
        return ((b - a) ** 2).sum().reshape(1), (a ** 2).sum().reshape(1)
    errors, norms = [], []
    for ref, out, batch in zip(refs, outs, batches):
        a, b = _masked(ref.double(), out.double(), batch)
        a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        errors.append(((b - a) ** 2).sum(1).cpu())
        norms.append((a ** 2).sum(1).cpu())
    return torch.cat(errors), torch.cat(norms)


NEEDS_CAUSAL_LM = "--max-ppl-increase needs a causal language model checkpoint"

ONE_NUMBER_NOTE = ("the model gives one number per sample: its cosine is the correlation of the samples' numbers "
                   "(the centred columns; an offset or a scale common to every sample does not move it), and top-1 "
                   "agreement does not apply")


# float32's cosine of n numbers is within about 1e-6 of the exact one up to 2**16 of them (measured: 9e-7 at 32,768),
# and drifts past it beyond (a causal LM's 256 x 49,152 logits per sample read 1.0004 for identical outputs, above
# a 0.9999 gate that the exact 0.9998 fails): larger samples are summed in float64. (Small ones stay in float32,
# whose results the recorded outputs of the tests' small models hold.)
_FLOAT32_COSINE_MAX = 1 << 16


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch], device: torch.device, causal_lm: bool = False,
             progress: Optional[Callable[[int, int, int], None]] = None, group: Optional[Group] = None,
             source: str = "") -> Report:
    """Per-layer SQNR and end-to-end fidelity of a calibrated fake-quant ``model`` on ``batches`` (read from
    ``source``, which an error about a batch names).

    With a distributed ``group`` (``torchrun … qtool report``) each rank measures its contiguous shard of the
    batches and every rank gets every batch's contributions, summed in global batch order: the report is
    bit-identical to one process's."""
    group = group or Group()
    batches = list(batches)
    modules = quantized_modules(model)
    chosen = {name for name, mod in modules.items() if has_stored_weight(mod)}
    start, stop = shard_bounds(len(batches), group.rank, group.world_size)
    records = []
    for bi in range(start, stop):
        with model_takes(model, batches[bi], batch_where(source, "evaluation", bi + 1)):
            records.append(_measure_batch(model, modules, chosen, batches[bi], device, causal_lm))
        if progress:
            progress(bi - start + 1, stop - start, batches[bi].size)
    set_quantization(model, True)
    if group.distributed:
        records = [r for from_rank in group.all_gather(records) for r in from_rank]
    return _fold(records, modules, chosen)


def _measure_batch(model: nn.Module, modules: Dict[str, nn.Module], chosen, batch: Batch, device,
                   causal_lm: bool) -> Dict[str, Any]:
    """One batch's contributions, each kept as the list of terms in the order a running sum adds them."""
    b = batch.to(device)
    terms: Dict[str, Dict[str, List[float]]] = {k: {n: [] for n in modules} for k in ("sig_c", "noise_c", "sig_i",
                                                                                     "noise_i", "noise_rtn")}
    # every call's (args, kwargs, output, routed token rows): a module run more than once per forward (ALBERT's
    # shared layers, a block applied twice) is compared call by call (each call's against the last float call's
    # gave -1.9 dB where the truth was 21 dB). A call is counted by its module, an expert's by its experts module
    # (an expert given no token may not run: its own count would pair other calls)
    everything = dict(model.named_modules())
    routing = {name: r for name in modules if (r := routing_of(everything, name)) is not None}
    counter = {name: routing[name][0] if name in routing else mod for name, mod in modules.items()}
    counted: Dict[int, int] = {}  # id(module) -> its calls so far, less one

    def count(mod, args):
        counted[id(mod)] = counted.get(id(mod), -1) + 1

    def call_of(name) -> int:
        return counted.get(id(counter[name]), 0)

    captured: Dict[str, Dict[int, Any]] = {}
    inputs: Dict[str, Any] = {}

    # a module's input as its call receives it, before any pre-hook (an online rotation, qtool.model.online):
    # calling the module again on it runs those pre-hooks once more, as the model does
    def keep_input(name):
        def hook(mod, args, kwargs):
            inputs[name] = (args, kwargs)
        return hook

    def route(name):
        owner, e = routing[name]
        return owner.routed_tokens.get(e)

    def keep(name):
        def hook(mod, args, out):
            captured.setdefault(name, {})[call_of(name)] = (*inputs[name], _first_tensor(out),
                                                            route(name) if name in routing else None)
        return hook

    def watched(hook_for):
        handles = [m.register_forward_pre_hook(count) for m in {id(m): m for m in counter.values()}.values()]
        return handles + [mod.register_forward_hook(hook_for(name)) for name, mod in modules.items()]

    handles = [mod.register_forward_pre_hook(keep_input(name), with_kwargs=True, prepend=True)
               for name, mod in modules.items()]
    handles += watched(keep)
    set_quantization(model, False)
    try:
        ref_out = _main_output(model(*b.args, **b.kwargs))
    finally:
        for h in handles:
            h.remove()
    float_io = captured
    # isolated: each quantized module alone, on the float model's input to it
    for name, mod in modules.items():
        for args, kwargs, ref, _ in float_io.get(name, {}).values():
            if ref is None or not ref.numel():  # (an expert called on no token)
                continue
            # an attention layer's KV cache already holds this batch's keys from the float pass: called again with
            # it, the layer would attend to those float keys and its KV cache quantizers would change nothing
            kwargs = {k: None if k in CACHE_KWARGS else v for k, v in kwargs.items()}
            set_quantization(model, True, only={name})
            out = _first_tensor(mod(*args, **kwargs))
            terms["sig_i"][name].append(_energy(ref))
            terms["noise_i"][name].append(_energy(ref, out))
            if name in chosen:  # what round-to-nearest would have given this layer, for comparison
                with without_stored_weight(mod):
                    out = _first_tensor(mod(*args, **kwargs))
                terms["noise_rtn"][name].append(_energy(ref, out))
    # cumulative: the whole model quantized
    set_quantization(model, True)
    counted.clear()

    def compare(name):
        def hook(mod, args, out):
            _, _, ref, float_route = float_io.get(name, {}).get(call_of(name), (None, None, None, None))
            out = _first_tensor(out)
            if name in routing and ref is not None and out is not None:  # an expert: on the tokens both routed it
                rows = _common_rows(float_route, route(name))
                if rows is None:
                    return
                ref, out = ref[rows[0]], out[rows[1]]
            if ref is not None and out is not None and ref.numel():
                terms["sig_c"][name].append(_energy(ref))
                terms["noise_c"][name].append(_energy(ref, out))
        return hook

    handles = watched(compare)
    try:
        q_out = _main_output(model(*b.args, **b.kwargs))
    finally:
        for h in handles:
            h.remove()
    record: Dict[str, Any] = {"terms": terms}
    if _one_number_each(ref_out):  # compared over every batch's samples (output_cosines)
        record["column"] = (ref_out.float().reshape(-1).cpu(), q_out.float().reshape(-1).cpu())
    else:
        record["cos"] = _per_sample_cosine(ref_out, q_out, b).cpu()
    if causal_lm:
        nf, n = _token_nll(ref_out, b)
        nq, _ = _token_nll(q_out, b)
        record["nll"] = (nf, nq, n)
        record["kl"] = _token_kl(ref_out, q_out, b)
    elif ref_out.dim() == 2 and ref_out.shape[-1] > 1:
        record["top1"] = (int((ref_out.argmax(-1) == q_out.argmax(-1)).sum()), ref_out.shape[0])
    return record


def _energy(ref: torch.Tensor, out: Optional[torch.Tensor] = None) -> float:
    """``sum(ref^2)``, or ``sum((ref - out)^2)``, in float32; where finite values' squares pass float32's range
    (outputs near 1e19 and up: it read inf or NaN), the same sum in float64, a slice at a time."""
    x = ref.float() if out is None else ref.float() - out.float()
    total = float(x.pow(2).sum())
    if math.isfinite(total) or not bool(torch.isfinite(x).all()):
        return total
    return float(sum(part.double().pow(2).sum() for part in x.reshape(-1).split(1 << 22)))


def _common_rows(before: Optional[torch.Tensor], now: Optional[torch.Tensor]):
    """``(rows of before, rows of now)`` holding the tokens both lists hold, in the same token order (each list
    holds a token at most once: the tokens routed to one expert), or None when they share none."""
    if before is None or now is None:
        return None
    b_tokens, b_rows = before.sort()
    n_tokens, n_rows = now.sort()
    b_rows, n_rows = b_rows[torch.isin(b_tokens, n_tokens)], n_rows[torch.isin(n_tokens, b_tokens)]
    return (b_rows, n_rows) if b_rows.numel() else None


def _fold(records: List[Dict[str, Any]], modules: Dict[str, nn.Module], chosen) -> Report:
    """The report from per-batch records, summed in their order (the same additions a running sum makes)."""
    sums = {k: dict.fromkeys(modules, 0.0) for k in ("sig_c", "noise_c", "sig_i", "noise_i")}
    sums["noise_rtn"] = dict.fromkeys(chosen, 0.0)
    top1_same = top1_total = 0
    nll_f = nll_q = 0.0
    tokens = 0
    kl_sum, kl_tokens = 0.0, 0
    for rec in records:
        for kind, by_name in rec["terms"].items():
            for name, values in by_name.items():
                for v in values:
                    sums[kind][name] += v
        if "nll" in rec:
            nf, nq, n = rec["nll"]
            nll_f, nll_q, tokens = nll_f + nf, nll_q + nq, tokens + n
        if "kl" in rec:
            kl_sum, kl_tokens = kl_sum + rec["kl"][0], kl_tokens + rec["kl"][1]
        if "top1" in rec:
            top1_same, top1_total = top1_same + rec["top1"][0], top1_total + rec["top1"][1]
    columns = [rec["column"] for rec in records if "column" in rec]
    if columns:
        cos = output_cosines([c[0] for c in columns], [c[1] for c in columns], [None] * len(columns))
        samples = sum(c[0].numel() for c in columns)
    else:
        cos = torch.cat([rec["cos"] for rec in records]) if records else torch.zeros(0)
        samples = int(cos.numel())
    # a module the data never ran (an expert routed no token, T5's `shared` table that only its encoder's and
    # decoder's copies run) has no figure: not an infinite SQNR, which would say it loses nothing
    compared = {n for rec in records for n, values in rec["terms"]["sig_c"].items() if values}
    isolated = {n for rec in records for n, values in rec["terms"]["sig_i"].items() if values}
    layers = [LayerError(n, type(m).__name__.replace("Quantized", "", 1),
                         sqnr_db(sums["sig_c"][n], sums["noise_c"][n]) if n in compared else None,
                         sqnr_db(sums["sig_i"][n], sums["noise_i"][n]) if n in isolated else None,
                         sqnr_db(sums["sig_i"][n], sums["noise_rtn"][n]) if n in chosen and n in isolated else None)
              for n, m in modules.items()]
    rep = Report(layers, float(cos.mean()) if cos.numel() else float("nan"),
                 float(cos.min()) if cos.numel() else float("nan"), samples=samples)
    if columns:
        rep.notes.append(ONE_NUMBER_NOTE + "; the SQNR of the layer that gives it measures the error in size")
    if not modules:
        rep.notes.append("no module is quantized: the encodings leave every layer float (nothing to measure per layer)")
    if tokens:
        rep.perplexity_float = math.exp(nll_f / tokens)
        rep.perplexity_quant = math.exp(nll_q / tokens)
    if top1_total:
        rep.top1_agreement = top1_same / top1_total
    if kl_tokens:
        rep.kl_divergence = kl_sum / kl_tokens
    return rep


@torch.no_grad()
def sensitivity(model: nn.Module, batches: Iterable[Batch], device: torch.device, causal_lm: bool = False,
                progress: Optional[Callable[[int, int, str], None]] = None) -> List[Dict[str, Any]]:
    """End-to-end damage of quantizing each module alone, most damaging first.

    ``damage`` is the perplexity increase in percent for causal language models, else ``1 - mean cosine``.
    """
    batches = [b.to(device) for b in batches]
    modules = list(quantized_modules(model))
    set_quantization(model, False)
    refs = [_main_output(model(*b.args, **b.kwargs)) for b in batches]
    base_nll = None
    if causal_lm:
        parts = [_token_nll(r, b) for r, b in zip(refs, batches)]
        base_nll = (sum(p[0] for p in parts), sum(p[1] for p in parts))
    rows = []
    for i, name in enumerate(modules):
        set_quantization(model, True, only={name})
        outs = [_main_output(model(*b.args, **b.kwargs)) for b in batches]
        cos = float(output_cosines(refs, outs, batches).mean())
        row = {"module": name, "cosine": cos, "damage": 1.0 - cos,
               "has_activations": any(k != "weight" for k in getattr(dict(model.named_modules())[name],
                                                                       "qtool_quantizers", {}))}
        if causal_lm and base_nll and base_nll[1]:
            nq = sum(_token_nll(o, b)[0] for o, b in zip(outs, batches))
            row["perplexity_increase_pct"] = 100.0 * (math.exp((nq - base_nll[0]) / base_nll[1]) - 1.0)
            row["damage"] = row["perplexity_increase_pct"]
        rows.append(row)
        if progress:
            progress(i + 1, len(modules), name)
    set_quantization(model, True)
    return sorted(rows, key=lambda r: -r["damage"])


@dataclass(frozen=True)
class _Grid:
    """What :func:`_kept` reads of a weight's or an activation's grid (a recipe's defaults or a calibrated
    encoding)."""

    element: str  # "int", or a float element
    bitwidth: int
    granularity: str
    gguf: bool = False  # one of llama.cpp's K-quant / IQ4 types (a recipe's gguf_type or gguf_mix)
    dynamic: bool = False


def _kept(w: Optional[_Grid], a: Optional[_Grid]) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]], str]:
    """What a kept layer's ``weights`` and ``activations`` become over grids ``w`` and ``a`` (None: float), and in
    words: a grid above them that their format still writes (GGUF: Q8_0; integers: 8-bit symmetric weights in
    their granularity, 16-bit activations), float where the grid is a float element or 8 bits or more already (a
    setting at or below it would keep nothing)."""
    if w is not None and w.gguf:
        weights, words = {"gguf_type": "q8_0"}, "Q8_0 weights"
    elif w is None or w.element != "int" or w.bitwidth >= 8:
        weights, words = None, "float weights"
    else:  # (the blocks and scale dtype kept by the merge: a legacy GGUF grid becomes Q8_0's)
        weights, words = {"bitwidth": 8, "symmetric": True}, f"8-bit symmetric {w.granularity} weights"
    activations = None if a is None or a.element != "int" or a.dynamic or a.bitwidth >= 16 else {"bitwidth": 16}
    return weights, activations, words


def _recipe_grids(base_recipe_text: str) -> Tuple[Optional[_Grid], Optional[_Grid]]:
    """The base recipe's default weight and activation grids."""
    from .config import parse_recipe

    recipe = parse_recipe(base_recipe_text, "--recipe")
    w, a = recipe.defaults.weights, recipe.defaults.activations
    gguf = recipe.gguf_mix is not None or (w is not None and w.gguf_type is not None)
    return (None if w is None else _Grid(w.element, w.bitwidth, w.granularity, gguf),
            None if a is None else _Grid(a.element, a.bitwidth, a.granularity, dynamic=a.dynamic))


def encoding_grids(entries) -> Dict[str, Tuple[Optional[_Grid], Optional[_Grid]]]:
    """Each module's calibrated weight grid and first activation grid (encodings entries), what
    :func:`suggest_recipe` keeps a layer above without a base recipe."""
    out: Dict[str, List[Optional[_Grid]]] = {}
    for e in entries:
        s = e.spec
        grid = _Grid(s.element, s.bitwidth, s.granularity.value, s.ggml is not None, s.dynamic)
        slot = out.setdefault(e.module, [None, None])
        if e.tensor == "weight":
            slot[0] = grid
        elif e.tensor in ("input", "output") and slot[1] is None:
            slot[1] = grid
    return {m: (w, a) for m, (w, a) in out.items()}


def suggest_recipe(rows: List[Dict[str, Any]], n: int, base_recipe_text: Optional[str] = None,
                   grids: Optional[Dict[str, Tuple[Optional[_Grid], Optional[_Grid]]]] = None) -> str:
    """A recipe that keeps the ``n`` most sensitive modules (``rows``, most sensitive first) at a higher precision
    (:func:`_kept`) than the base recipe's grids or, without one, than each module's calibrated ``grids``
    (:func:`encoding_grids`), and, where they have them, their activations too; each with the modules runtimes
    fuse with it (``config.fused.fused_groups``: q/k/v, gate/up, one projection of every expert), which one
    setting must cover."""
    import yaml

    from .config.fused import fused_groups
    from .config.loading import load_yaml

    by_module = {r["module"]: r for r in rows}
    group_of = {m: g for g in fused_groups(list(by_module)) for m in g}
    chosen: List[str] = []
    for r in rows[:n]:
        chosen += [m for m in group_of.get(r["module"], (r["module"],)) if m not in chosen]
    base = _recipe_grids(base_recipe_text) if base_recipe_text is not None else None
    rules, said = [], []
    for m in chosen:  # (a dict of its own each: yaml would write one shared dict as anchors, which recipes refuse)
        weights, activations, words = _kept(*(base or (grids or {}).get(m, (None, None))))
        said += [words] if words not in said else []
        rule: Dict[str, Any] = {"match": exact_pattern(m), "weights": weights}
        if by_module.get(m, {}).get("has_activations"):
            rule["activations"] = activations
        rules.append(rule)
    kept = " or ".join(said)
    fused = f", with {len(rules) - min(n, len(rows))} layers fused with them," if len(rules) > min(n, len(rows)) else ""
    if any(r.get("activations") for r in rules):
        kept += ", 16-bit activations"
    elif any("activations" in r for r in rules):
        kept += ", float activations"
    header = (f"# qtool report --sensitivity: the {min(n, len(rows))} most sensitive layers{fused} kept at higher "
              f"precision\n# ({kept}). Later `layers` entries win.\n")
    if base_recipe_text is not None:
        base = load_yaml(base_recipe_text) or {}
        base.setdefault("version", 1)
        base["layers"] = list(base.get("layers") or []) + rules
        return header + yaml.safe_dump(base, sort_keys=False, allow_unicode=True)
    header += "# Append these entries to the `layers` of the recipe you calibrated with (or pass --recipe).\n"
    return header + yaml.safe_dump({"version": 1, "layers": rules}, sort_keys=False, allow_unicode=True)


def _save_figure(fig, path) -> None:
    """``fig`` written atomically as SVG or PNG (by ``path``'s suffix), then closed; the same figure gives the same
    bytes (an SVG holds no date, and its element ids come from a fixed salt, not a random one)."""
    import matplotlib
    import matplotlib.pyplot as plt

    svg = str(path).lower().endswith(".svg")
    try:
        with matplotlib.rc_context({"svg.hashsalt": "qtool"}), atomic_file(path, output=True) as tmp:
            fig.savefig(tmp, dpi=110, format="svg" if svg else "png", metadata={"Date": None} if svg else None)
    finally:
        plt.close(fig)


def plot_sqnr(report: Report, path, title: str = "per-layer SQNR") -> None:
    """A horizontal bar chart of cumulative and isolated SQNR per layer (model order), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.layers
    cap = 80.0  # equal outputs have infinite SQNR; draw them at the cap
    nan = float("nan")  # (no bar: a module with no figure is not 0 dB of damage)
    cum = [nan if r.sqnr_cumulative is None else min(r.sqnr_cumulative, cap) for r in rows]
    iso = [nan if r.sqnr_isolated is None else min(r.sqnr_isolated, cap) for r in rows]
    names = [r.module for r in rows]
    height = max(3.0, 0.22 * len(rows) + 1.5)
    fig, ax = plt.subplots(figsize=(10, height))
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], cum, height=0.4, label="cumulative (everything before quantized too)",
            color="#c0392b")
    ax.barh([y - 0.2 for y in ys], iso, height=0.4, label="isolated (this layer alone)", color="#2980b9")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("SQNR (dB), higher is better")
    summary = f"end-to-end cosine {report.cosine:.4f}"
    if report.perplexity_increase_pct is not None:
        summary += f", perplexity {report.perplexity_float:.2f} -> {report.perplexity_quant:.2f}"
    ax.set_title(f"{title}\n{summary}", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    _save_figure(fig, path)


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < 1e308:
        raise UsageError(f"{where} must be a finite number (got {str(value)[:40]!r})")
    return float(value)


def _mapping(where: str, value: Any) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise UsageError(f"{where} must be a JSON object (got {type(value).__name__})")
    return value


def _text(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise UsageError(f"{where} must be a string (got {type(value).__name__})")
    return value


def read_search(path) -> Dict[str, Any]:
    """A size-budget search's record (``search.json``, written by calibrate/quantize with ``--candidates``), with
    every field :func:`pareto_points` and :func:`plot_pareto` use checked: one ``UsageError`` line naming the file
    and the key otherwise."""
    from .io.jsonfile import read_json_object

    search = read_json_object(path, UsageError, "search record", strict=True)
    where = f"{path}: "
    _text(where + "format", search.get("format"))
    _text(where + "damage", search.get("damage"))
    budget = _mapping(where + "budget", search.get("budget"))
    _number(where + "budget.bits_per_weight", budget.get("bits_per_weight"))
    _text(where + "budget.flag", budget.get("flag"))
    chosen = _mapping(where + "chosen", search.get("chosen"))
    for key in ("bits_per_weight", "predicted_damage"):
        _number(f"{where}chosen.{key}", chosen.get(key))
    if chosen.get("damage") is not None:
        _number(where + "chosen.damage", chosen["damage"])
    for section, keys in (("frontier", ("bits_per_weight", "predicted_damage")),
                          ("uniform", ("bits_per_weight", "damage"))):
        rows = search.get(section)
        if not isinstance(rows, list) or not rows:
            raise UsageError(f"{where}{section} must be a non-empty list")
        for i, row in enumerate(rows):
            row = _mapping(f"{where}{section}[{i}]", row)
            for key in keys:
                _number(f"{where}{section}[{i}].{key}", row.get(key))
            if section == "uniform":
                _text(f"{where}uniform[{i}].candidate", row.get("candidate"))
    return search


def pareto_points(search: Dict[str, Any], rep: Optional[Report] = None) -> Dict[str, Any]:
    """The Pareto chart's data from a size-budget search's record (``search.json``): the searched curve (least
    predicted damage at each size), each uniform candidate and the chosen model (damage measured on the search
    samples), and, from ``rep`` (``qtool report`` on held-out data), the chosen model's held-out damage."""
    chosen = search["chosen"]
    out = {"x": "bits per weight (" + search["format"] + " format)", "y": search["damage"],
           "budget_bits_per_weight": search["budget"]["bits_per_weight"],
           "curve": [{"bits_per_weight": f["bits_per_weight"], "damage": f["predicted_damage"]}
                     for f in search["frontier"]],
           "uniform": [{"candidate": u["candidate"], "bits_per_weight": u["bits_per_weight"], "damage": u["damage"]}
                       for u in search["uniform"]],
           "chosen": {"bits_per_weight": chosen["bits_per_weight"], "damage": chosen.get("damage"),
                      "predicted_damage": chosen["predicted_damage"]}}
    if rep is not None:
        held = rep.kl_divergence if search["damage"].startswith("mean per-token") else 1.0 - rep.cosine
        out["chosen"]["held_out_damage"] = held
        if rep.perplexity_increase_pct is not None:
            out["chosen"]["held_out_perplexity_increase_pct"] = rep.perplexity_increase_pct
    return out


def plot_pareto(points: Dict[str, Any], path, title: str = "size against damage") -> None:
    """Draw :func:`pareto_points` (PNG or SVG by ``path``'s suffix), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    curve = points["curve"]
    ax.plot([c["bits_per_weight"] for c in curve], [c["damage"] for c in curve], "-", color="#2980b9",
            label="searched (predicted: the first candidate's damage + each group's change)")
    for u in points["uniform"]:
        ax.plot([u["bits_per_weight"]], [u["damage"]], "s", color="#7f8c8d")
        ax.annotate(u["candidate"], (u["bits_per_weight"], u["damage"]), fontsize=8, xytext=(4, 4),
                    textcoords="offset points")
    ch = points["chosen"]
    if ch.get("damage") is not None:
        ax.plot([ch["bits_per_weight"]], [ch["damage"]], "o", color="#c0392b", label="chosen (measured)")
    if ch.get("held_out_damage") is not None:
        ax.plot([ch["bits_per_weight"]], [ch["held_out_damage"]], "D", color="#27ae60",
                label="chosen, held-out data")
    ax.axvline(points["budget_bits_per_weight"], color="#c0392b", alpha=0.3, linestyle="--", label="budget")
    shown = [c["damage"] for c in curve] + [u["damage"] for u in points["uniform"]]
    positive = [v for v in shown if v is not None and v > 0]
    if positive and min(v for v in shown if v is not None) <= 0:  # (a predicted 0 would fall off a log axis)
        ax.set_yscale("symlog", linthresh=min(positive))
    else:
        ax.set_yscale("log")
    ax.set_xlabel(points["x"])
    ax.set_ylabel(points["y"] + ", lower is better")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save_figure(fig, path)


@dataclass
class Gate:
    """One CI quality gate and its outcome."""

    gate: str  # "min-sqnr", "min-cosine", "max-ppl-increase"
    threshold: float
    value: Optional[float]  # (None: min-sqnr where no layer has a cumulative figure)
    passed: bool
    detail: str

    def line(self) -> str:
        return f"gate failed: --{self.gate} {self.threshold}: {self.detail}"


def _nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def shown(value: float, threshold: float, spec: str) -> str:
    """``value`` formatted as ``spec`` (".4f", "+.2f", ".4g"), with as many more digits as it takes (up to 15) to
    read apart from ``threshold`` so formatted: a failed gate's value never prints as its threshold or past it
    (cosine 0.99988883734 against --min-cosine 0.99988884 read "0.9999")."""
    sign, digits, kind = spec[:-1].split(".")[0], int(spec[:-1].split(".")[1]), spec[-1]
    while True:
        text = format(value, f"{sign}.{digits}{kind}")
        if not math.isfinite(value) or value == threshold or text != format(threshold, f"{sign}.{digits}{kind}"):
            return text
        if digits >= 15:  # (0.9999999999999999 against 1.0: the shortest text that is the value)
            return f"{'+' if sign == '+' and value >= 0 else ''}{value!r}"
        digits += 1


def check_gates(rep: Report, min_sqnr: Optional[float] = None, min_cosine: Optional[float] = None,
                max_ppl_increase: Optional[float] = None, causal_lm: bool = False) -> List[Gate]:
    """Evaluate the gates that are set; ``UsageError`` for one that cannot apply (perplexity without a causal LM)."""
    gates = []
    measured = [r for r in rep.worst_first() if r.sqnr_cumulative is not None]
    worst = measured[0] if measured else None
    if min_sqnr is not None and worst is not None:
        gates.append(Gate("min-sqnr", min_sqnr, worst.sqnr_cumulative, worst.sqnr_cumulative >= min_sqnr,
                          f"{worst.module} at {shown(worst.sqnr_cumulative, min_sqnr, '.1f')} dB"))
    elif min_sqnr is not None:  # (listed, not dropped: nothing quantized ran on the data, so nothing fell short)
        gates.append(Gate("min-sqnr", min_sqnr, None, True, "no layer has a cumulative SQNR (no quantized module "
                          "ran on the data)"))
    if min_cosine is not None:
        gates.append(Gate("min-cosine", min_cosine, rep.cosine, rep.cosine >= min_cosine,
                          f"cosine {shown(rep.cosine, min_cosine, '.4f')}"))
    if max_ppl_increase is not None:
        inc = rep.perplexity_increase_pct
        if inc is None and causal_lm:
            raise UsageError("--max-ppl-increase: no next token was scored (a window of one token has nothing to "
                             "predict): give a longer --seq-len")
        if inc is None:
            raise UsageError(NEEDS_CAUSAL_LM)
        gates.append(Gate("max-ppl-increase", max_ppl_increase, inc, inc <= max_ppl_increase,
                          f"perplexity {shown(inc, max_ppl_increase, '+.2f')}%"))
    return gates


def enforce_gates(gates: List[Gate]) -> None:
    """Raise ``GateFailed`` (exit code 1) naming every failed gate, one per line."""
    failed = [g for g in gates if not g.passed]
    if failed:
        raise GateFailed("\n".join(g.line() for g in failed))
