"""The jobs that measure a model on data: ``qtool report`` (per-layer SQNR, end-to-end fidelity, sensitivity,
and the files drawn or written from them: an SQNR chart, a search's Pareto curve, a suggested recipe) and
``qtool imatrix`` (llama.cpp's importance matrix)."""

from __future__ import annotations

import os
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..calibration import CalibrateOptions
from ..choices import check_arguments
from ..config import RecipeFile, read_recipe
from ..calibration.data_check import refuse_no_kept_token
from ..data import batch_where, check_data, load_data, longest_sample, model_takes, past_positions, unpadded_rows
from ..encodings import CODES_FILE, SIDECAR, calibrated_elsewhere
from ..errors import DataError, EncodingsError, UsageError
from ..hooks import Hooks, step_progress
from ..io.checkpoint import weight_file_hashes
from ..io.fs import check_output_file
from ..model.apply import make_fake_quant
from ..model.load import load_model, refuse_non_finite_reference
from .common import _inputs, _ranks, _same_command, one_at_a_time


@one_at_a_time
def run_report(checkpoint: str, encodings: str, opts: CalibrateOptions, sensitivity_analysis: bool = False,
               hooks: Optional[Hooks] = None, allow_other_checkpoint: bool = False,
               perplexity_gate: bool = False) -> Dict[str, Any]:
    """``qtool report``: per-layer SQNR, end-to-end fidelity and (optionally) layer sensitivity. Encodings
    calibrated on other weights are refused unless ``allow_other_checkpoint`` (then a note); a
    ``perplexity_gate`` on a model that is not a causal LM, once it is loaded (before anything is measured)."""
    from ..report import NEEDS_CAUSAL_LM, evaluate, sensitivity, tied_notes

    check_arguments(checkpoint, opts, CalibrateOptions, paths={"encodings": encodings}, hooks=(hooks, Hooks),
                    flags={"sensitivity_analysis": sensitivity_analysis, "allow_other_checkpoint": allow_other_checkpoint,
                           "perplexity_gate": perplexity_gate})
    checkpoint, encodings = os.fspath(checkpoint), os.fspath(encodings)
    hooks = hooks or Hooks()
    opts.check()
    with _ranks(opts.device) as group:  # under torchrun: each rank measures its shard; every rank gets the report
        _same_command(group, checkpoint, opts, encodings=Path(encodings))
        if sensitivity_analysis and group.distributed:
            raise UsageError("--sensitivity runs in one process: run it without torchrun")
        if opts.data is None:
            raise DataError("qtool report runs the model: pass --data PATH (text or tensors)")
        check_data(opts.data)
        hooks.on_stage("loading checkpoint")
        loaded = load_model(checkpoint, opts.model_class, opts.device, opts.trust_pickle, opts.trust_remote_code)
        refuse_non_finite_reference(loaded.model, checkpoint)
        if perplexity_gate and not loaded.is_causal_lm:
            raise UsageError(NEEDS_CAUSAL_LM)
        other = _check_calibrated_on(Path(encodings), checkpoint, allow_other_checkpoint)
        enc = make_fake_quant(loaded.model, checkpoint, encodings, opts.trust_pickle)
        data = load_data(opts.data, opts.batch_size, opts.num_samples, opts.seed, opts.seq_len, loaded.tokenizer,
                         pack_text=loaded.is_causal_lm)
        refuse_no_kept_token(data, "a report")
        device = next(iter(loaded.model.parameters())).device
        hooks.on_stage("measuring")
        rep = evaluate(loaded.model, data, device, loaded.is_causal_lm, hooks.on_batch, group, data.source)
        rep.notes += tied_notes(loaded.model) + ([other] if other else [])
        past = past_positions(getattr(loaded.model, "config", None), longest_sample(data.batches), data.files)
        rep.notes += [past] if past else []
    from ..report import grid_summary

    out = {"report": rep, "json": {**rep.to_json(), "grids": grid_summary(enc.entries)},
           "causal_lm": loaded.is_causal_lm, "grids": grid_summary(enc.entries)}
    if sensitivity_analysis:
        hooks.on_stage("ranking layer sensitivity")
        out["sensitivity"] = sensitivity(loaded.model, data, device, loaded.is_causal_lm,
                                         step_progress(hooks, "ranking layer sensitivity"))
        out["json"]["sensitivity"] = out["sensitivity"]
    return out


def _check_calibrated_on(enc_path: Path, checkpoint: str, allow_other: bool) -> Optional[str]:
    """Refuse encodings whose calibration manifest records other weights than ``checkpoint``'s (same shapes, other
    numbers: every figure would measure one model's ranges, and codes, on another), as ``export`` does, unless
    ``allow_other``: then the note that says so; the note that nothing was compared where no manifest.json lies
    beside the encodings (None: the same weights, or no weight files to compare)."""
    other, unchecked = calibrated_elsewhere(enc_path, weight_file_hashes(Path(checkpoint)), checkpoint,
                                            unreadable_ok=allow_other)
    if other is None:
        return unchecked
    if not allow_other:
        raise EncodingsError(f"{enc_path}: calibrated on other weights than {checkpoint} (its manifest.json records "
                             f"{other} with other file hashes): report on that checkpoint, calibrate this one, "
                             "or pass --allow-other-checkpoint if the weights changed on purpose (a re-saved copy's "
                             "files differ too)")
    return (f"--allow-other-checkpoint: the encodings were calibrated on other weights ({other}) than "
            f"{checkpoint}'s; these figures are their ranges (and any codes they carry) on {checkpoint}")


@one_at_a_time
def run_imatrix(checkpoint: str, out: str, opts: CalibrateOptions, overwrite: bool = False,
                hooks: Optional[Hooks] = None) -> Dict[str, Any]:
    """``qtool imatrix``: llama.cpp's importance matrix of a Llama-family checkpoint over calibration data (per
    decoder-layer matrix, each input column's sum of x² and the token count, as ``llama-imatrix`` writes it), for
    ``llama-quantize --imatrix``. Written whole or not at all."""
    from ..calibration.rounding import collect_module_inputs
    from ..export.gguf_model import read_gguf_model
    from ..imatrix import write_imatrix
    from ..io.fs import atomic_file

    check_arguments(checkpoint, opts, CalibrateOptions, paths={"out": out}, hooks=(hooks, Hooks))
    checkpoint, out = os.fspath(checkpoint), os.fspath(out)
    hooks = hooks or Hooks()
    opts.check()
    target = Path(out)
    check_output_file(target, _inputs(checkpoint, data=opts.data), overwrite)
    if opts.data is None:
        raise DataError("an importance matrix is measured on text: pass --data PATH")
    check_data(opts.data)
    import gguf  # noqa: F401  (it writes the file: not installed, the CLI says so before anything is measured)

    gguf_model = read_gguf_model(Path(checkpoint))
    hooks.on_stage("loading checkpoint")
    loaded = load_model(checkpoint, opts.model_class, opts.device, opts.trust_pickle, opts.trust_remote_code)
    data = load_data(opts.data, opts.batch_size, opts.num_samples, opts.seed, opts.seq_len, loaded.tokenizer,
                     pack_text=True)
    refuse_no_kept_token(data, "an importance matrix")
    modules = dict(loaded.model.named_modules())
    # the decoder matrices (what llama-imatrix collects by default): GGUF name -> row -> module (a stacked expert
    # tensor has one row per expert)
    matrices: Dict[str, Dict[int, str]] = {}
    for module, m in modules.items():
        name, row = gguf_model.matrix(loaded.model, modules, module) if isinstance(m, nn.Linear) else (None, 0)
        if name is not None and name.startswith("blk."):
            matrices.setdefault(name, {})[row] = module
    device = next(iter(loaded.model.parameters())).device
    batches = list(data)

    def run():
        for i, batch in enumerate(batches):
            for b in unpadded_rows(batch.to(device)):  # (padding is no text: llama-imatrix counts text tokens)
                with model_takes(loaded.model, b, batch_where(data.source, "importance", i + 1)):
                    loaded.model(*b.args, **b.kwargs)
            if hooks.on_batch:
                hooks.on_batch(i + 1, len(batches), batch.size)

    hooks.on_stage("measuring")
    measured = {m for rows in matrices.values() for m in rows.values()}
    stats = collect_module_inputs({module: False for module in modules if module in measured}, modules, run)
    by_name: Dict[str, List[Tuple[torch.Tensor, int]]] = {}
    for name in sorted(matrices):
        members = [matrices[name][row] for row in sorted(matrices[name])]
        if all(m not in stats for m in members):
            continue
        width = int(modules[members[0]].in_features)
        by_name[name] = [(stats[m].sq, stats[m].count) if m in stats else (torch.zeros(width, dtype=torch.float64), 0)
                         for m in members]
    tokens = max((n for rows in by_name.values() for _, n in rows), default=0)
    # llama-imatrix's chunks are its context windows: the data's own (a token-id file's windows are its rows)
    firsts = [b.args[0] if b.args else next(iter(b.kwargs.values())) for b in batches]
    chunk_size = max((int(t.shape[-1]) for t in firsts if t.dim() >= 2), default=opts.seq_len)
    with atomic_file(target, output=True) as tmp:
        chunks = sum(r.size for b in batches for r in unpadded_rows(b))  # (a row of padding alone is no chunk)
        write_imatrix(tmp, by_name, [Path(opts.data).name], chunk_size, max(1, chunks))
    past = past_positions(getattr(loaded.model, "config", None), longest_sample(batches), data.files)
    return {"imatrix": str(target), "entries": len(by_name), "tokens": tokens, "bytes": target.stat().st_size,
            "warnings": [past] if past else []}


@dataclass
class ReportOutputs:
    """The files ``report`` writes beside its figures, checked before the (slow) report runs
    (:func:`report_outputs`): ``plot`` (a PNG bar chart of per-layer SQNR), ``pareto`` (the size-budget search's
    curve, .png or .svg, its data in the .json beside it; ``search`` is the search record it draws), and
    ``suggest`` (a recipe keeping the ``suggest_n`` most sensitive layers at higher precision, over ``base``)."""

    plot: Optional[str] = None
    pareto: Optional[str] = None
    search: Optional[Dict[str, Any]] = None
    suggest: Optional[Path] = None
    suggest_n: int = 0
    base: Optional[RecipeFile] = None
    encodings: Optional[str] = None  # (the calibrated grids a suggestion without a base recipe keeps layers above)

    def files(self) -> List[str]:
        """Every file these outputs write, in the order they are written."""
        pareto = [self.pareto, str(Path(self.pareto).with_suffix(".json"))] if self.pareto else []
        return [str(p) for p in [self.plot, *pareto, self.suggest] if p is not None]


def report_outputs(checkpoint: str, encodings: str, data: Optional[str], plot: Optional[str] = None,
                   pareto: Optional[str] = None, suggest: Optional[Tuple[int, str]] = None,
                   recipe: Optional[str] = None) -> ReportOutputs:
    """``report``'s outputs, checked: the base recipe is valid (read once), ``pareto`` is a .png/.svg with a
    search.json beside the encodings, and no output is one of the inputs or lies inside an input directory."""
    from ..report import read_search

    outs = ReportOutputs(plot=plot, pareto=pareto, encodings=encodings)
    if recipe is not None and suggest is None:
        raise UsageError("--recipe is the recipe --suggest extends: give it with --sensitivity --suggest 'N OUT.yaml'")
    if suggest is not None:
        outs.suggest_n, outs.suggest = suggest[0], Path(suggest[1])
        outs.base = read_recipe(recipe) if recipe else None  # a malformed base: one error naming file and key
    if pareto is not None:
        if Path(pareto).suffix.lower() not in (".png", ".svg"):
            raise UsageError(f"--pareto {pareto}: give a .png or .svg file name")
        found = Path(encodings).parent / "search.json"
        if not found.is_file():
            raise UsageError(f"--pareto: no search.json beside {encodings}; it is written by calibrate/quantize "
                             "with --candidates and --target-bpw/--target-size")
        outs.search = read_search(found)
    run = Path(encodings).parent
    inputs = [("checkpoint", checkpoint), ("encodings", encodings), ("encodings sidecar", str(run / SIDECAR)),
              ("codes", str(run / CODES_FILE)), ("search record", str(run / "search.json")),
              ("calibration manifest", str(run / "manifest.json")), ("data", data), ("recipe", recipe)]
    written: Dict[Path, str] = {}
    for flag, out in (("--plot", plot), ("--pareto", pareto), ("--pareto's .json", pareto and Path(pareto).with_suffix(
            ".json")), ("--suggest", outs.suggest)):
        if out is None:
            continue
        check_output_file(Path(out), inputs, flag=flag)
        same = written.setdefault(Path(out).resolve(), flag)
        if same != flag:  # (one would overwrite the other)
            raise UsageError(f"{flag} {out}: {same} writes that file too; give each output its own name")
    if plot is not None and Path(plot).suffix.lower() not in (".png", ".svg"):
        raise UsageError(f"--plot {plot}: give a .png or .svg file name")
    drawn = next((flag for flag, out in (("--plot", plot), ("--pareto", pareto)) if out is not None), None)
    if drawn is not None:  # (before measuring, which can take an hour)
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError(f"{drawn} draws with matplotlib, which is not installed: pip install 'qtool[report]'")
    return outs


def write_report_outputs(result: Dict[str, Any], checkpoint: str, outs: ReportOutputs) -> None:
    """Write what ``outs`` asks for from ``run_report``'s ``result`` (each file atomically; the Pareto points
    also go into ``result["json"]``). The suggested recipe is parsed before it is written: only what ``-c`` will
    read back."""
    from ..config import parse_recipe
    from ..io.fs import write_text_atomic
    from ..encodings import EncodingsFile
    from ..report import encoding_grids, pareto_points, plot_pareto, plot_sqnr, suggest_recipe

    rep, name = result["report"], Path(checkpoint).name
    text = None
    if outs.suggest is not None:  # (made and checked first: a refusal writes none of the files)
        if not result["sensitivity"]:
            raise UsageError(f"--suggest: the encodings quantize no module, so no layer can be kept at a higher "
                             f"precision; {outs.suggest} not written")
        if any(r["damage"] != r["damage"] for r in result["sensitivity"]):  # NaN: no order to choose from
            raise DataError(f"--suggest: the layers' damage is NaN (a model that gives one number per sample, "
                            f"measured on fewer than two samples or constant outputs), so nothing ranks them; give "
                            f"more --num-samples; {outs.suggest} not written")
        grids = None if outs.base else encoding_grids(EncodingsFile.read(outs.encodings, lazy=True).entries)
        text = suggest_recipe(result["sensitivity"], outs.suggest_n, outs.base.text if outs.base else None, grids)
        parse_recipe(text, source=str(outs.suggest))
    if outs.plot:
        plot_sqnr(rep, outs.plot, title=f"per-layer SQNR: {name}")
    if outs.pareto:
        points = pareto_points(outs.search, rep)
        plot_pareto(points, outs.pareto, title=f"{outs.search['budget']['flag']} on {name}: "
                                               f"{', '.join(outs.search['candidates'])}")
        write_text_atomic(Path(outs.pareto).with_suffix(".json"), json.dumps(points, indent=1) + "\n", output=True)
        result["json"]["pareto"] = points
    if text is not None:
        write_text_atomic(outs.suggest, text, output=True)
