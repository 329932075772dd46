"""The size-budget search (``--target-bpw`` / ``--target-size`` with ``--candidates``): calibrate every
candidate, measure each weight group's damage under each, choose the mix that fits the budget with the least
(``qtool.quant.knapsack``), write it as a recipe and calibrate that."""

from __future__ import annotations

import decimal
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from ..calibration import CalibrateOptions
from ..calibration.data_check import data_amount
from ..choices import SEARCH_METRICS, check_choice, check_fields
from ..config import Plan, RecipeFile, read_recipe, resolve_plan
from ..data import load_data, longest_sample, past_positions
from ..encodings import CODES_FILE, SIDECAR
from ..errors import DataError, UsageError
from ..export import get_exporter
from ..hooks import Hooks, step_progress
from ..model.insert import QUANTIZERS_ATTR
from ..model.load import LoadedModel, load_model
from ..parallel import Group
from .calibrate import _calibrate_into, _share_run
from .common import TargetOptions, load_calibrated, one_at_a_time, stored_once


def _search_inputs(target: Optional["TargetOptions"]) -> List[Tuple[str, Optional[str]]]:
    """A size-budget search's own inputs for check_output_dir: its --search-data and the candidates' recipe files."""
    if target is None:
        return []
    return [("search data", target.data)] + [("candidate recipe", r.path) for r in _target_candidates(target)]


def _searched(checkpoint: str, target: TargetOptions, opts: CalibrateOptions, exporter, options, tmp: Path,
              hooks: Hooks, group: Optional[Group] = None, admit=None) -> Tuple[str, Dict[str, Any]]:
    """Run the size-budget search into ``tmp/recipe.yaml``: (its path, the search record). Under torchrun every
    rank runs it (each calibrates its shard and measures its share of the search samples) and gets the same
    choice; ``tmp`` is each rank's own directory."""
    import shutil

    work = tmp / ".search"
    state = measure_candidates(checkpoint, target, opts, exporter, options, work, hooks, group=group, admit=admit)
    shutil.rmtree(work, ignore_errors=True)
    text, record = choose_recipe(state, target)
    del state
    path = tmp / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path), record


def _calibrate_searched(checkpoint: str, recipe_path: str, record: Dict[str, Any], target: TargetOptions,
                        opts: CalibrateOptions, run_dir: Path, hooks: Hooks, group: Group,
                        admit=None) -> Dict[str, Any]:
    """Calibrate the searched recipe into ``run_dir`` and measure the chosen model as deployed. Where a uniform
    candidate that fits the budget measured less damage (the per-layer changes did not add up), that candidate is
    calibrated instead and ``recipe.yaml`` becomes it: the search never hands back a model it measured worse than
    one it could have picked whole. Returns the calibration summary with ``target`` (None on ranks other than 0,
    whose ``run_dir`` is their own scratch copy of rank 0's files)."""
    root = group.is_root
    summary = _calibrate_into(checkpoint, recipe_path, opts, run_dir if root else None, hooks, group, search=record,
                              last=False, admit=admit)
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
                                  search=record, admit=admit)
    else:
        group.calibrated()  # rank 0 writes the search record next: a failure there reaches the others at the end
    if not root:
        return None
    _write_search(run_dir, record)
    summary["warnings"] = summary.get("warnings", []) + record.get("warnings", [])
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


SEARCH_FILE = "search.json"


_NLL_NEEDS_CAUSAL_LM = ("--search-metric nll ranks by the change in the text's next-token loss: causal language models "
                       "only (this model is not one; use kl)")


def _as_written(model, encodings: Path, exporter, options) -> None:
    """A calibrated model as the format writes it: quantizers the format runs in float (compressed-tensors'
    embedding tables) taken out, so that the damage ranked is the file's, as the bytes counted are."""
    from ..encodings import EncodingsFile
    from ..export.base import written_float

    modules = dict(model.named_modules())
    entries = [e for e in EncodingsFile.read(encodings, lazy=True).entries if e.module in modules]
    off = written_float(exporter, options, entries, model, modules)
    for q in entries:
        held = getattr(modules[q.module], QUANTIZERS_ATTR, None)
        if q.name in off and held is not None and q.tensor in held:
            del held[q.tensor]  # (gone, not off: the damage measurement switches every quantizer on and off)


def _prepared(recipe: Union[None, str, RecipeFile], target: Optional[TargetOptions]
              ) -> Tuple[Optional[RecipeFile], Optional[TargetOptions]]:
    """A run's recipe, or its size-budget search's candidates, read once (a malformed one is one error naming its
    file and key, before anything runs); what the run hands on from here."""
    if target is not None:
        if recipe is not None:  # (the library's callers: the CLI refuses -c with --candidates)
            raise UsageError("a recipe and a size-budget search's candidates exclude each other: the search writes "
                             "the recipe (pass recipe None with target)")
        return None, replace(target, recipes=tuple(_target_candidates(target)))
    if recipe is None:
        raise UsageError("no recipe: pass one (a shipped name, a file or a RecipeFile), or a size-budget target "
                         "whose search chooses it")
    return read_recipe(recipe), None


def _target_candidates(target: TargetOptions) -> List[RecipeFile]:
    """The candidates, read (once: a prepared ``target`` holds them)."""
    if target.recipes:
        return list(target.recipes)
    if isinstance(target.candidates, (str, bytes)) or not all(isinstance(c, (str, Path, RecipeFile))
                                                              for c in target.candidates):
        raise UsageError("candidates takes a list of recipes (shipped names, files or RecipeFiles), not "
                         f"{type(target.candidates).__name__} {str(target.candidates)[:60]!r}")
    check_fields(target, {"samples": 1, "size_bytes": 1})
    check_choice("--search-metric", target.metric, SEARCH_METRICS)  # (the CLI's check, for a library caller)
    if len(target.candidates) < 2:
        raise UsageError("--candidates takes two or more recipes (names or files), comma-separated")
    if (target.bits_per_weight is None) == (target.size_bytes is None):
        raise UsageError("--candidates goes with one budget: --target-bpw B or --target-size SIZE")
    if target.samples < 1:
        raise UsageError("--search-samples must be at least 1")
    if target.bits_per_weight is not None and not 0 < target.bits_per_weight < 64:  # (NaN too: the CLI's check)
        raise UsageError(f"--target-bpw {target.bits_per_weight:g}: bits per weight lie between 0 and 64")
    read = [read_recipe(c) for c in target.candidates]
    first: Dict[str, str] = {}
    for name, r in zip(target.candidates, read):
        if r.sha256 in first:  # (calibrated and measured twice, and counted under one name)
            raise UsageError(f"--candidates: {first[r.sha256]} and {name} are the same recipe (the same bytes); list "
                             "each option once")
        first[r.sha256] = name
    return read


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
    warnings: List[str] = field(default_factory=list)  # about --search-data (calibration checks --data itself)
    format_options: Dict[str, Any] = field(default_factory=dict)  # the format's options the bytes were counted in

    def bpw(self, nbytes: int) -> float:
        return 8.0 * nbytes / max(self.cost.params, 1)

    def budget(self, target: TargetOptions) -> int:
        # (in decimal, as written: 8.008 bits of 1000 parameters are 1001 bytes, where float arithmetic gave 1000)
        return (int(decimal.Decimal(repr(target.bits_per_weight)) * self.cost.params / 8)
                if target.bits_per_weight is not None else int(target.size_bytes))


@one_at_a_time
def measure_candidates(checkpoint: str, target: TargetOptions, opts: CalibrateOptions, exporter, options,
                       work: Path, hooks: Optional[Hooks] = None, keep: bool = False,
                       group: Optional[Group] = None, admit=None) -> Measured:
    """Calibrate every candidate (in ``work``), cost each weight group in ``exporter``'s format and measure the
    damage of each group's setting alone. Refuses ``target``'s budget before calibrating when no choice can meet
    it. ``keep``: leave each candidate's calibration in ``work/candidate-<i>``. Under torchrun (``group``) every
    rank calls it: the candidates calibrate across the ranks, each rank loads rank 0's files and measures its share
    of the search samples, and all get the same measurements."""
    import shutil

    from ..model.expert_view import open_checkpoint
    from ..config.resolve import tied_parameters
    from ..mixed import costs, effective_weights, fused_groups, group_damage, join_tied
    from ..report import next_token_targets

    hooks = hooks or Hooks()
    opts.check()
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
        exporter.check_tied(stored_once(checkpoint, plan.tied, opts.trust_pickle))
        exporter.check_kv_cache(plan.kv_float)
        plans.append(plan)

    def rest(plan):
        return ([(q.name, q.spec) for q in plan.activations], plan.rotation, plan.smoothing, plan.folds)

    for c, (plan, name) in enumerate(zip(plans[1:], names[1:]), 1):
        if rest(plan) != rest(plans[0]):
            raise UsageError(f"--candidates: {name} differs from {names[0]} in more than its weight settings "
                             "(activations, rotation, SmoothQuant or folds); candidates may differ in weights only")
        # every layer on this candidate's setting must be writable over the first's, before any is calibrated
        _written(target.recipes[0].text, plans, {q.module: c for q in plan.weights}, names, loaded.model, opts)
    modules = list(dict.fromkeys(q.module for plan in plans for q in plan.weights))
    order = {m: i for i, m in enumerate(dict(loaded.model.named_modules()))}
    src = open_checkpoint(checkpoint, opts.trust_pickle, model=loaded.model)
    tensors = {k: src.shape_dtype(k) for k in src.keys()}
    # a parameter the checkpoint stores once under another name (a tied output layer)
    tied = {n: stored for n, stored in tied_parameters(loaded.model).items() if n not in tensors}
    groups = join_tied(fused_groups(sorted(modules, key=lambda m: order.get(m, len(order)))), tied)
    cost = costs(tensors, plans, groups, lambda q, shape, dtype: exporter.tensor_bytes(q, shape, dtype, options),
                 tied, exporter.writes_tied_apart(loaded.model))
    metric = "mean per-token KL divergence (nats)" if loaded.is_causal_lm else "mean 1 - cosine of the outputs"
    state = Measured(target, paths, plans, groups, cost, [[0.0] * len(paths) for _ in groups], [], loaded,
                     exporter.name, metric, 0, opts, format_options=asdict(options))
    _check_budget(state, target)
    data = _search_data(target, opts, loaded.tokenizer, loaded.is_causal_lm)
    if data_amount(data) == (0, "tokens"):  # (every candidate would measure damage 0: the cheapest everywhere)
        raise DataError(f"{target.data or opts.data}: the search's {data.num_samples} sample(s) hold no token their "
                        "attention_mask keeps (every mask is 0): nothing to measure damage on; give --search-data "
                        "whose samples hold text, or more --search-samples")
    if target.metric == "nll" and not sum(int(next_token_targets(b)[1].sum()) for b in data):
        raise DataError(f"--search-metric nll: the search samples ({target.data or opts.data}) hold no next token "
                        "to score (samples of one token?); use longer samples or --search-metric kl")
    state.samples = data.num_samples
    past = past_positions(getattr(loaded.model, "config", None), longest_sample(data.batches), data.files)
    if target.data and past:
        state.warnings.append(f"--search-data {target.data}: {past}")
    if loaded.is_causal_lm:
        state.nll_damage = [[0.0] * len(paths) for _ in groups]
    batches = list(data)
    grouped = [m for g in groups for m in g]
    base, base_ppl = None, None
    for c, read in enumerate(target.recipes):
        hooks.on_stage(f"candidate {c + 1}/{len(paths)} ({names[c]}): calibrating")
        cdir = work / f"candidate-{c}"
        cdir.mkdir(parents=True)
        _calibrate_into(checkpoint, read, opts, cdir if group.is_root else None, hooks, group, last=False,
                        admit=admit)
        _share_run(group, cdir)
        model = load_calibrated(checkpoint, str(cdir / "encodings.json"), opts.model_class, opts.device,
                                opts.trust_pickle, opts.trust_remote_code, allow_other_checkpoint=True)  # (its own)
        _as_written(model, cdir / "encodings.json", exporter, options)
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
                                                          loaded.is_causal_lm,
                                                          step_progress(hooks, "measuring damage"), group)
        del weights
        for g, d in enumerate(deltas[0]):
            state.damage[g][c] = d
            if ppl:
                state.nll_damage[g][c] = ppl["nll_changes"][0][g]
        state.base_damage = base_damage
        state.uniform.append({"damage": together[0], "predicted_damage": max(0.0, base_damage + sum(deltas[0])),
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
    if not cost.groups:  # (the floor is the float checkpoint: "below the smallest" said nothing of why)
        raise UsageError(f"{target.flag_with_bytes()}: the candidates ({', '.join(target.candidates)}) quantize no "
                         "weight of this model, so there is nothing to choose among")
    if budget >= cost.float_bytes:
        raise UsageError(f"{target.flag_with_bytes()}: at or above the float checkpoint ({cost.float_bytes} bytes, "
                         f"{state.bpw(cost.float_bytes):.2f} bits per weight); nothing needs quantizing to fit")
    if budget < floor:
        # (rounded up: the printed figure is a budget that fits, not "19.924 is below 19.924")
        raise UsageError(f"{target.flag_with_bytes()}: below the smallest the candidates can make ({floor} bytes, "
                         f"{math.ceil(state.bpw(floor) * 1000) / 1000:.3f} bits per weight in {state.exporter}'s "
                         "format)")


def _written(text: str, plans: List[Plan], chosen: Dict[str, int], names: List[str], model, opts: CalibrateOptions,
             header: str = "") -> str:
    """The recipe that gives each module in ``chosen`` its candidate's setting over the first candidate's recipe
    ``text``; refused where a setting cannot be written so (a layer the first candidate ignores)."""
    from ..config import parse_recipe
    from ..mixed import mixed_recipe

    mixed = mixed_recipe(text, plans, chosen, header)
    check = resolve_plan(parse_recipe(mixed, "the chosen recipe"), model, source="the chosen recipe",
                         allow_unmatched=opts.allow_unmatched, importance_matrix=opts.imatrix is not None)
    got = {q.module: replace(q, rule=None) for q in check.weights}
    for m, c in chosen.items():
        want = next((replace(q, rule=None) for q in plans[c].weights if q.module == m), None)
        if got.get(m) != want:
            raise UsageError(f"--candidates: {m}'s setting from {names[c]} cannot be written over {names[0]} "
                             "(is it ignored there?); put the recipe that quantizes most layers first")
    return mixed


def choose_recipe(state: Measured, target: TargetOptions) -> Tuple[str, Dict[str, Any]]:
    """The recipe that fits ``target``'s budget with the least predicted damage, and the search's record (budget,
    choice, the uniform candidates, the Pareto curve)."""
    from ..quant.knapsack import choose, frontier

    _check_budget(state, target)
    cost, opts = state.cost, state.opts
    names = [str(c.path if isinstance(c, RecipeFile) else c) for c in state.target.candidates]  # (a Path, a name)
    budget = state.budget(target)
    ranking = state.damage if target.metric == "kl" else state.nll_damage
    if ranking is None:
        raise UsageError(_NLL_NEEDS_CAUSAL_LM)
    choice = choose(ranking, cost.groups, budget - cost.fixed)
    # (the sum of measured changes can pass below zero, which a KL or 1 - cosine cannot)
    predicted = max(0.0, state.base_damage + sum(state.damage[g][k] for g, k in enumerate(choice.options)))
    chosen = {m: k for g, k in zip(state.groups, choice.options) for m in g}
    nbytes = cost.fixed + choice.cost
    header = (f"qtool {target.flag()} --candidates {','.join(names)}: each weight's setting chosen among "
              f"the candidates'\nfor the least measured damage within {budget} bytes ({state.exporter} format): "
              f"{nbytes} bytes, {state.bpw(nbytes):.3f} bits per weight.\nLater layers entries win; edit and rerun "
              "with -c.")
    text = _written(state.target.recipes[0].text, state.plans, chosen, names, state.loaded.model, opts, header)
    record = {
        "budget": {"flag": target.flag(), "bytes": budget, "bits_per_weight": state.bpw(budget)},
        "format": state.exporter, "format_options": state.format_options, "params": cost.params,
        "float_bytes": cost.float_bytes,
        "candidates": names, "damage": state.metric, "samples": state.samples,
        **({"ranked_by": "mean per-token change in the search text's NLL (nats)"} if target.metric == "nll" else {}),
        **({"search_data": target.data} if target.data else {}),
        **({"warnings": state.warnings} if state.warnings else {}),
        **({"float_perplexity": state.float_perplexity} if state.float_perplexity is not None else {}),
        "chosen": {"bytes": nbytes, "bits_per_weight": state.bpw(nbytes),
                   "predicted_damage": predicted,
                   **({"predicted_nll_change": sum(ranking[g][k] for g, k in enumerate(choice.options))}
                      if target.metric == "nll" else {}),
                   "groups": {names[c]: sum(k == c for k in choice.options) for c in range(len(names))}},
        "uniform": state.uniform,
        "frontier": [{"bytes": cost.fixed + f.cost, "bits_per_weight": state.bpw(cost.fixed + f.cost),
                      "predicted_damage": max(0.0, state.base_damage + f.damage)}
                     for f in frontier(state.damage, cost.groups)],
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
    from ..mixed import group_damage

    hooks.on_stage("measuring the chosen model")
    model = load_calibrated(checkpoint, str(encodings), opts.model_class, opts.device, opts.trust_pickle,
                            opts.trust_remote_code, allow_other_checkpoint=True)  # (calibrated here, just now)
    exporter = get_exporter(record["format"])
    _as_written(model, Path(encodings), exporter, exporter.Options())  # (measured as the candidates were)
    tokenizer = getattr(model, "qtool_tokenizer", None)
    causal = record["damage"].startswith("mean per-token")
    data = _search_data(target, opts, tokenizer, causal)
    damage, _, _, ppl = group_damage(model, list(data), [], [], next(iter(model.parameters())).device, causal,
                                     group=group)
    return damage, (ppl["base"] if ppl else None)


def _write_search(run_dir: Path, record: Dict[str, Any]) -> None:
    (run_dir / SEARCH_FILE).write_text(json.dumps(record, indent=1) + "\n")
