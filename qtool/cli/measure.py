"""The commands that measure on data: ``report`` (fidelity of the fake-quant model, gates, sensitivity, the
search's Pareto curve), ``eval`` (the exported file in its own runtime against float and fake-quant) and
``imatrix`` (llama.cpp's importance matrix)."""

from __future__ import annotations

import math
import os
import re
from typing import List, Optional

import typer

from .core import Table, _console, _emit_json, _errors, _esc, _one_process, _rank, app, err
from .options import (_BATCH, _DEBUG, _DEVICE, _JSON, _MODEL_CLASS, _NUM, _QUIET, _REVISION, _SEED, _SEQ,
                      _TRUST_CODE, _TRUST_PICKLE, _check_early, _checkpoint, _opts)
from .output import _Progress, _print_eval


def _check_gate_values(**gates: Optional[float]) -> None:
    """The gate flags that are set (``{"--flag": value}``) are finite; a perplexity increase above -100 % (a
    negative one asks for a perplexity that falls, which a model can meet or fail), a KL and an export gap >= 0, an
    agreement within [0, 1] and a cosine within [-1, 1]."""
    from ..errors import UsageError

    for flag, value in gates.items():
        if value is not None and not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number (got {value})")
    if (gates.get("--max-ppl-increase") or 0) <= -100:
        raise UsageError(f"--max-ppl-increase must be a percentage above -100, as a perplexity falls by less "
                         f"(got {gates['--max-ppl-increase']:g})")
    for flag in ("--max-kl", "--max-export-gap"):
        if (gates.get(flag) or 0) < 0:
            raise UsageError(f"{flag} must be >= 0, as a divergence is (got {gates[flag]})")
    agreement = gates.get("--min-agreement")
    if agreement is not None and not 0 <= agreement <= 1:
        raise UsageError(f"--min-agreement must be from 0 to 1, as a share of tokens is (got {agreement})")
    cosine = gates.get("--min-cosine")
    if cosine is not None and not -1 <= cosine <= 1:
        raise UsageError(f"--min-cosine must be from -1 to 1, as a cosine is (got {cosine})")


def _suggest_flag(suggest: Optional[List[str]], sensitivity: bool):
    """``(N, OUT.yaml)`` of ``--suggest 'N OUT.yaml'`` (None without it)."""
    from ..errors import UsageError

    if suggest is not None and (len(suggest) != 1 or not sensitivity):
        raise UsageError("--suggest takes 'N OUT.yaml' together with --sensitivity")
    if not suggest:
        return None
    n_text, out_yaml = suggest[0].split(None, 1) if " " in suggest[0] else (suggest[0], None)
    if out_yaml is None or not re.fullmatch(r"-?\d+", n_text):
        raise UsageError("--suggest takes 'N OUT.yaml' (quote it as one argument: --suggest '3 keep.yaml')")
    if int(n_text) < 1:
        raise UsageError(f"--suggest {n_text}: N is how many of the most damaging layers to keep in higher precision: "
                         "1 or more")
    return int(n_text), out_yaml


@app.command(epilog="Examples:\n\n\b\n  qtool report MODEL_DIR -e runs/r1/encodings.json --data heldout.txt\n  qtool report MODEL_DIR -e runs/r1/encodings.json --data heldout.txt --min-cosine 0.99 --json")
def report(
    checkpoint: str = typer.Argument(..., metavar="CHECKPOINT", help="The checkpoint the encodings were calibrated on."),
    revision: Optional[str] = _REVISION,
    encodings: str = typer.Option(..., "--encodings", "-e", help="encodings.json from qtool calibrate."),
    data: Optional[str] = typer.Option(None, "--data", help="Evaluation data (held-out text or tensors)."),
    json_out: bool = _JSON,
    plot: Optional[str] = typer.Option(None, "--plot", help="OUT.png or OUT.svg: a bar chart of per-layer SQNR."),
    pareto: Optional[str] = typer.Option(
        None, "--pareto", help="OUT.png or OUT.svg: the size-budget search's Pareto curve (needs search.json beside "
                               "the encodings, from --target-bpw/--target-size), with this model's held-out damage; "
                               "its data goes to OUT.json."),
    min_sqnr: Optional[float] = typer.Option(None, "--min-sqnr", help="Gate: every layer's cumulative SQNR >= DB."),
    min_cosine: Optional[float] = typer.Option(None, "--min-cosine", help="Gate: end-to-end mean cosine >= X."),
    max_ppl_increase: Optional[float] = typer.Option(
        None, "--max-ppl-increase", help="Gate: perplexity increase <= PCT percent (causal LMs)."),
    sensitivity: bool = typer.Option(False, "--sensitivity", help="Rank layers by the damage of quantizing each alone."),
    suggest: Optional[List[str]] = typer.Option(
        None, "--suggest", metavar="'N OUT.yaml'", help="With --sensitivity: N OUT.yaml, a recipe keeping the N most sensitive layers "
                                "at higher precision.", show_default=False),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Recipe to extend with --suggest's entries."),
    allow_other_checkpoint: bool = typer.Option(
        False, "--allow-other-checkpoint", help="Measure even where the calibration's manifest.json records other "
                                                "weights than CHECKPOINT's (a fine-tune, a re-saved copy): a note "
                                                "says so."),
    device: str = _DEVICE,
    batch_size: int = _BATCH,
    num_samples: Optional[int] = _NUM,
    seq_len: int = _SEQ,
    seed: int = _SEED,
    model_class: Optional[str] = _MODEL_CLASS,
    trust_pickle: bool = _TRUST_PICKLE,
    trust_remote_code: bool = _TRUST_CODE,
    quiet: bool = _QUIET,
    debug: bool = _DEBUG,
) -> None:
    """Measure where accuracy went: per-layer SQNR, end-to-end fidelity, quality gates for CI."""
    root = _rank() == 0  # under torchrun every rank gets the report; rank 0 prints it, every rank applies the gates
    quiet, json_out = quiet or not root, json_out and root

    from ..pipeline import run_report
    from ..pipeline.measure import report_outputs, write_report_outputs

    with _errors(debug, json_out):
        _check_early(device=device, data=data)
        outs = report_outputs(checkpoint, encodings, data, plot, pareto, _suggest_flag(suggest, sensitivity), recipe)
        _check_gate_values(**{"--min-sqnr": min_sqnr, "--min-cosine": min_cosine,
                              "--max-ppl-increase": max_ppl_increase})
        checkpoint = _checkpoint(checkpoint, revision)
        with _Progress(quiet) as p:
            result = run_report(checkpoint, encodings, _opts(
                data=data, device=device, batch_size=batch_size, num_samples=num_samples, seq_len=seq_len,
                seed=seed, model_class=model_class, trust_pickle=trust_pickle, trust_remote_code=trust_remote_code),
                sensitivity_analysis=sensitivity, hooks=p.hooks(), allow_other_checkpoint=allow_other_checkpoint,
                perplexity_gate=max_ppl_increase is not None)
        rep = result["report"]
        from ..report import check_gates, enforce_gates

        gates = check_gates(rep, min_sqnr, min_cosine, max_ppl_increase, result["causal_lm"])  # (a usage error
        if root:  # writes nothing; a failed gate keeps the files that show why)
            write_report_outputs(result, checkpoint, outs)
    failed = [g for g in gates if not g.passed]
    if not root:
        raise typer.Exit(1 if failed else 0)
    if json_out:
        _emit_json({"ok": not failed, **result["json"],
                    "gates": [{"gate": g.gate, "threshold": g.threshold, "value": g.value, "passed": g.passed}
                              for g in gates]})
    else:
        con = _console()
        t = Table(title="per-layer SQNR (dB), worst first", title_justify="left")
        rtn = any(r.sqnr_isolated_rtn is not None for r in rep.layers)  # codes chosen by GPTQ: show what RTN gave
        cols = ("module", "type", "cumulative", "isolated") + (("isolated, RTN",) if rtn else ())
        for col in cols:
            t.add_column(col, justify="left" if col in ("module", "type") else "right", overflow="fold")
        fmt = lambda v: "" if v is None else "inf" if math.isinf(v) else f"{v:.1f}"  # noqa: E731
        for r in rep.worst_first():
            t.add_row(r.module, r.module_type, fmt(r.sqnr_cumulative), fmt(r.sqnr_isolated),
                      *((fmt(r.sqnr_isolated_rtn),) if rtn else ()))
        con.print(t)
        con.print("grids: " + "; ".join(f"{g['tensor']}s {g['grid']} ({g['quantizers']})" for g in result["grids"]))
        con.print(f"samples: {rep.samples}; cosine (float vs quantized outputs): mean {rep.cosine:.4f}, "
                  f"min {rep.cosine_min:.4f}")
        if rep.perplexity_float is not None:
            con.print(f"perplexity: float {rep.perplexity_float:.3f}, quantized {rep.perplexity_quant:.3f} "
                      f"({rep.perplexity_increase_pct:+.2f}%)")
        if rep.top1_agreement is not None:
            con.print(f"top-1 agreement: {rep.top1_agreement:.4f}")
        for note in rep.notes:
            con.print(f"[dim]note: {_esc(note)}[/dim]")
        if result.get("sensitivity"):
            st = Table(title="sensitivity: damage of quantizing each layer alone", title_justify="left")
            unit = "perplexity +%" if "perplexity_increase_pct" in result["sensitivity"][0] else "1 - cosine"
            for col in ("module", "cosine", f"damage ({unit})"):
                st.add_column(col, justify="left" if col == "module" else "right")
            for r in result["sensitivity"]:
                st.add_row(r["module"], f"{r['cosine']:.5f}", f"{r['damage']:.4g}")
            con.print(st)
        if not quiet:
            for path in outs.files():
                err.print(f"wrote: {_esc(path)}")
    from ..errors import GateFailed

    try:
        enforce_gates(gates)
    except GateFailed as e:
        err.print(str(e), markup=False)
        raise typer.Exit(e.exit_code)


@app.command("eval", epilog="Examples:\n\n\b\n  qtool eval out/ --data heldout.txt                      (the manifest names the checkpoint and encodings)\n  qtool eval out/model.gguf -r MODEL_DIR -e runs/r1/encodings.json --data heldout.txt\n  qtool eval out/ --data heldout.txt --max-ppl-increase 3 --min-agreement 0.9 --json")
def eval_(
    artifact: str = typer.Argument(..., metavar="ARTIFACT", help="What qtool export/quantize wrote: the output directory, or a .gguf / "
                                             ".onnx file, or a compressed-tensors directory."),
    reference: Optional[str] = typer.Option(None, "--reference", "-r", help="The float checkpoint (default: the "
                                            "one the artifact's manifest names): a directory, a state dict or "
                                            "a Hub ID."),
    revision: Optional[str] = typer.Option(None, "--revision", help="With a Hugging Face Hub ID as --reference: a "
                                           "branch, tag or commit (default main)."),
    encodings: Optional[str] = typer.Option(None, "--encodings", "-e", help="encodings.json of the calibration "
                                            "(default: the manifest's): the fake-quant model the file is checked "
                                            "against."),
    data: Optional[str] = typer.Option(None, "--data", help="Held-out data (text or tensors), not the calibration's."),
    seq_len: int = typer.Option(256, "--seq-len", min=2, help="Tokens per window of text (token-id rows are "
                                "scored as given)."),
    num_samples: int = typer.Option(8, "--num-samples", min=1, help="Windows to score (at most; fewer if the data "
                                    "is shorter)."),
    seed: int = _SEED,
    generate: int = typer.Option(32, "--generate", min=0, help="Greedy tokens per continuation (0: none)."),
    prompts: int = typer.Option(4, "--prompts", min=0, help="Continuations, from the first windows' first tokens."),
    top_k: int = typer.Option(1000, "--top-k", min=1, help="llama.cpp: most likely tokens read per position (its KL "
                              "is over these plus one bucket for the rest)."),
    threads: int = typer.Option(0, "--threads", min=0, help="llama.cpp / onnxruntime threads (0: as torch)."),
    onnx_optimization: str = typer.Option("all", "--onnx-optimization", help="onnxruntime graph optimizations: all "
                                          "(its default, as users run it), basic or off."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="lm-evaluation-harness tasks, comma-separated, run "
                                        "on the float model and on the artifact (needs qtool[tasks])."),
    tasks_path: Optional[str] = typer.Option(None, "--tasks-path", help="A directory of task YAML of your own."),
    task_limit: Optional[int] = typer.Option(None, "--task-limit", min=1, help="Documents per task (default: all)."),
    max_ppl_increase: Optional[float] = typer.Option(None, "--max-ppl-increase", help="Gate: the artifact's "
                                                     "perplexity at most PCT percent above float's."),
    max_kl: Optional[float] = typer.Option(None, "--max-kl", help="Gate: mean per-token KL from float <= X nats."),
    min_agreement: Optional[float] = typer.Option(None, "--min-agreement", help="Gate: top-1 agreement with float "
                                                  ">= X."),
    min_cosine: Optional[float] = typer.Option(None, "--min-cosine", help="Gate (models that are not causal LMs): "
                                               "mean output cosine with float >= X."),
    max_export_gap: Optional[float] = typer.Option(None, "--max-export-gap", help="Gate: the artifact's mean KL from "
                                                   "the fake-quant model <= X nats (for other models 1 - cosine, or "
                                                   "half the pooled squared relative error where larger); replaces "
                                                   "the default export-fault check."),
    device: str = _DEVICE,
    model_class: Optional[str] = _MODEL_CLASS,
    trust_pickle: bool = _TRUST_PICKLE,
    trust_remote_code: bool = _TRUST_CODE,
    json_out: bool = _JSON,
    quiet: bool = _QUIET,
    debug: bool = _DEBUG,
) -> None:
    """Run the exported file where it is served and compare it with float and with qtool's fake-quant model."""
    from ..choices import ONNX_OPTIMIZATIONS, check_choice
    from ..errors import GateFailed, UsageError

    with _errors(debug, json_out):
        _one_process("eval")
        _check_early(device=device, data=data)
        gate_flags = {"--max-ppl-increase": max_ppl_increase, "--max-kl": max_kl, "--min-agreement": min_agreement,
                      "--min-cosine": min_cosine, "--max-export-gap": max_export_gap}
        _check_gate_values(**gate_flags)
        check_choice("--onnx-optimization", onnx_optimization, ONNX_OPTIMIZATIONS)
        from ..evaluation import EvalOptions, check_gates, evaluate_artifact

        opts = EvalOptions(data=data, seq_len=seq_len, num_samples=num_samples, seed=seed, top_k=top_k,
                           generate=generate, prompts=prompts, threads=threads, onnx_optimization=onnx_optimization,
                           device=device, model_class=model_class, trust_pickle=trust_pickle,
                           trust_remote_code=trust_remote_code,
                           tasks=tuple(t.strip() for t in (tasks or "").split(",") if t.strip()),
                           tasks_path=tasks_path, task_limit=task_limit,
                           gates=tuple(flag[2:] for flag, v in gate_flags.items() if v is not None))
        if tasks_path is not None and not os.path.isdir(tasks_path):
            raise UsageError(f"--tasks-path {tasks_path}: not a directory")
        if revision is not None and reference is None:
            raise UsageError("--revision names a version of the --reference Hub ID: pass --reference ORG/NAME")
        if reference is not None and os.path.exists(artifact):  # (a missing artifact is said first, not fetched for)
            reference = _checkpoint(reference, revision)
        with _Progress(quiet) as p:
            ev = evaluate_artifact(artifact, reference, encodings, opts, hooks=p.hooks())
        gates = check_gates(ev, max_ppl_increase, max_kl, min_agreement, max_export_gap, min_cosine)
    from ..evaluation import enforce

    failed = [g for g in gates if not g.passed] or ([True] if ev.export_fault and max_export_gap is None else [])
    if json_out:
        _emit_json({"ok": not failed, **ev.to_json(),
                    "gates": [{"gate": g.gate, "threshold": g.threshold, "value": g.value, "passed": g.passed}
                              for g in gates]})
    elif not quiet:
        _print_eval(ev)
    try:
        enforce(ev, gates, max_export_gap is not None)
    except GateFailed as e:
        err.print(str(e), markup=False)
        raise typer.Exit(e.exit_code)


@app.command(epilog="Examples:\n\n\b\n  qtool imatrix LLAMA_DIR --data calib.txt -o imatrix.gguf\n  llama-quantize --imatrix imatrix.gguf model-f16.gguf model-q4_k_m.gguf Q4_K_M")
def imatrix(
    checkpoint: str = typer.Argument(..., metavar="CHECKPOINT", help="A Llama-family Hugging Face directory (or Hub ID)."),
    revision: Optional[str] = _REVISION,
    out: str = typer.Option(..., "--out", "-o", help="The importance matrix file to write (GGUF)."),
    data: Optional[str] = typer.Option(None, "--data", help="Calibration text (or token ids)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing file."),
    json_out: bool = _JSON,
    device: str = _DEVICE,
    batch_size: int = _BATCH,
    num_samples: Optional[int] = _NUM,
    seq_len: int = _SEQ,
    seed: int = _SEED,
    trust_remote_code: bool = _TRUST_CODE,
    quiet: bool = _QUIET,
    debug: bool = _DEBUG,
) -> None:
    """Write llama.cpp's importance matrix (what llama-imatrix writes) for llama-quantize --imatrix."""
    from ..pipeline import run_imatrix

    with _errors(debug, json_out):
        _one_process("imatrix")
        _check_early(device=device, data=data)
        checkpoint = _checkpoint(checkpoint, revision)
        with _Progress(quiet) as p:  # (--json: its stages on stderr too, as every command's)
            result = run_imatrix(checkpoint, out, _opts(
                data=data, device=device, batch_size=batch_size, num_samples=num_samples, seq_len=seq_len,
                seed=seed, trust_remote_code=trust_remote_code), overwrite=overwrite, hooks=p.hooks())
    if json_out:
        _emit_json({"ok": True, **result})
    elif not quiet:
        for w in result["warnings"]:
            err.print(f"[yellow]warning:[/yellow] {_esc(w)}")
        err.print(f"wrote: {_esc(result['imatrix'])} ({result['entries']} matrices, {result['tokens']} tokens)")
