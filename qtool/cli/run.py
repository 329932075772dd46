"""The commands that make a quantized model: ``calibrate``, ``export`` and ``quantize`` (both in one call)."""

from __future__ import annotations

from typing import Optional

import typer

from .core import _emit_json, _errors, _one_process, _rank, app, err
from .options import (_ALL_EXPERTS, _BATCH, _CANDIDATES, _CONFIG_OR_SEARCH, _CT8, _DATA, _DEBUG, _DEVICE,
                      _ENC_VERSION, _FORMAT, _GGUF_FALLBACK, _GGUF_FLOAT, _IMATRIX, _JSON, _MATMUL_PRECISION,
                      _MODEL_CLASS, _NO_PACK, _NUM, _OVERWRITE, _QUIET, _RESUME, _REVISION, _SEARCH_DATA,
                      _SEARCH_METRIC, _SEARCH_SAMPLES, _SEED, _SEQ, _SEQUENTIAL, _SHARD, _STRICT_DATA, _TARGET_BPW,
                      _TARGET_SIZE, _TRUST_CODE, _TRUST_PICKLE, _UNMATCHED, _check_early, _checkpoint, _eopts, _opts,
                      _shard_bytes, _target)
from .output import _Progress, _print_eval, _report_files


@app.command(epilog="Examples:\n\n\b\n  qtool calibrate MODEL_DIR -c w8a8 --data calib.txt -o runs/r1\n  qtool calibrate org/name -c w8a8-dynamic -o runs/r2   (a Hub ID; this recipe needs no data)\n  qtool calibrate m.safetensors --model-class pkg.mod:build -c my.yaml --data x.npy -o runs/r3")
def calibrate(
    checkpoint: str = typer.Argument(..., metavar="CHECKPOINT", help="HF model directory or Hub ID (org/name), .pt2, .safetensors/.pt state dict."),
    revision: Optional[str] = _REVISION,
    config: Optional[str] = _CONFIG_OR_SEARCH,
    out: str = typer.Option(..., "--out", "-o", help="Run directory for encodings.json and manifest.json."),
    data: Optional[str] = _DATA,
    device: str = _DEVICE,
    batch_size: int = _BATCH,
    num_samples: Optional[int] = _NUM,
    seq_len: int = _SEQ,
    seed: int = _SEED,
    model_class: Optional[str] = _MODEL_CLASS,
    trust_pickle: bool = _TRUST_PICKLE,
    trust_remote_code: bool = _TRUST_CODE,
    allow_unmatched: bool = _UNMATCHED,
    sequential: bool = _SEQUENTIAL,
    resume: bool = _RESUME,
    all_experts: bool = _ALL_EXPERTS,
    imatrix: Optional[str] = _IMATRIX,
    strict_data: bool = _STRICT_DATA,
    matmul_precision: str = _MATMUL_PRECISION,
    candidates: Optional[str] = _CANDIDATES,
    target_bpw: Optional[float] = _TARGET_BPW,
    target_size: Optional[str] = _TARGET_SIZE,
    search_samples: int = _SEARCH_SAMPLES,
    search_data: Optional[str] = _SEARCH_DATA,
    search_metric: str = _SEARCH_METRIC,
    overwrite: bool = _OVERWRITE,
    json_out: bool = _JSON,
    quiet: bool = _QUIET,
    debug: bool = _DEBUG,
) -> None:
    """Calibrate every quantizer's range on sample data; write encodings.json and manifest.json."""
    quiet = quiet or _rank() != 0  # under torchrun, rank 0 reports
    json_out = json_out and _rank() == 0
    with _errors(debug, json_out), _Progress(quiet) as p:
        target = _target(config, candidates, target_bpw, target_size, search_samples, search_data, search_metric)
        recipe = _check_early(config, device, data=data, imatrix=imatrix, matmul_precision=matmul_precision)
        checkpoint = _checkpoint(checkpoint, revision)
        from ..pipeline import run_calibrate

        summary = run_calibrate(checkpoint, recipe, out, _opts(
            data=data, device=device, batch_size=batch_size, num_samples=num_samples, seq_len=seq_len, seed=seed,
            model_class=model_class, trust_pickle=trust_pickle, trust_remote_code=trust_remote_code,
            allow_unmatched=allow_unmatched, sequential=sequential, imatrix=imatrix,
            strict_data=strict_data, resume=resume, all_experts=all_experts,
            matmul_precision=matmul_precision), overwrite, p.hooks(),
            target=target)
    _report_files(summary, quiet, p.warnings_shown)
    if json_out:
        _emit_json({"ok": True, **summary})


@app.command(epilog="Examples:\n\n\b\n  qtool export MODEL_DIR -e runs/r1/encodings.json -o out/\n  qtool export MODEL_DIR -e runs/r1/encodings.json -o out-onnx/ --format onnx --data calib.txt")
def export(
    checkpoint: str = typer.Argument(..., metavar="CHECKPOINT", help="The checkpoint the encodings were calibrated on."),
    revision: Optional[str] = _REVISION,
    encodings: str = typer.Option(..., "--encodings", "-e", help="encodings.json from qtool calibrate."),
    out: str = typer.Option(..., "--out", "-o", help="Output directory."),
    format: str = _FORMAT,
    encoding_version: str = _ENC_VERSION,
    data: Optional[str] = typer.Option(None, "--data", help="Example inputs for tracing (onnx): a data file or directory."),
    seq_len: int = _SEQ,
    no_pack: bool = _NO_PACK,
    ct_8bit_format: str = _CT8,
    gguf_float: str = _GGUF_FLOAT,
    gguf_fallback: str = _GGUF_FALLBACK,
    max_shard_size: str = _SHARD,
    model_class: Optional[str] = _MODEL_CLASS,
    trust_pickle: bool = _TRUST_PICKLE,
    trust_remote_code: bool = _TRUST_CODE,
    allow_other_checkpoint: bool = typer.Option(
        False, "--allow-other-checkpoint", help="Export even where the calibration's manifest.json records other "
        "weights than CHECKPOINT (by default refused: ranges of another model clip or waste this one's grid; codes "
        "GPTQ chose, or smoothed or rotated tensors, are written as they are, with a warning)."),
    overwrite: bool = _OVERWRITE,
    json_out: bool = _JSON,
    quiet: bool = _QUIET,
    debug: bool = _DEBUG,
) -> None:
    """Write the quantized model in FORMAT plus AIMET encodings (model.encodings) and a manifest."""
    with _errors(debug, json_out), _Progress(quiet) as p:
        _one_process("export")
        _check_early(format=format, encoding_version=encoding_version, ct_8bit_format=ct_8bit_format,
                     gguf_float=gguf_float, gguf_fallback=gguf_fallback, data=data)
        checkpoint = _checkpoint(checkpoint, revision)
        from ..pipeline import run_export

        summary = run_export(checkpoint, encodings, out, _eopts(
            format=format, encoding_version=encoding_version, trust_pickle=trust_pickle, model_class=model_class,
            trust_remote_code=trust_remote_code, data=data, seq_len=seq_len, pack=not no_pack,
            ct_eight_bit_format=ct_8bit_format, max_shard_bytes=_shard_bytes(max_shard_size), gguf_float=gguf_float,
            gguf_fallback=gguf_fallback, allow_other_checkpoint=allow_other_checkpoint), overwrite, p.hooks())
    _report_files(summary, quiet)
    if json_out:
        _emit_json({"ok": True, **summary})


@app.command(epilog="Examples:\n\n\b\n  qtool quantize MODEL_DIR -c w4a16-block32 -o out/ --eval heldout.txt\n  qtool quantize MODEL_DIR -c w8a8-dynamic -o out/ --format compressed-tensors\n  qtool quantize LLAMA_DIR -c gguf-q4_0 -o out/ --format gguf")
def quantize(
    checkpoint: str = typer.Argument(..., metavar="CHECKPOINT", help="HF model directory or Hub ID (org/name), .pt2, .safetensors/.pt state dict."),
    revision: Optional[str] = _REVISION,
    config: Optional[str] = _CONFIG_OR_SEARCH,
    out: str = typer.Option(..., "--out", "-o", help="Export directory (calibration files go to OUT/calibration)."),
    data: Optional[str] = _DATA,
    device: str = _DEVICE,
    batch_size: int = _BATCH,
    num_samples: Optional[int] = _NUM,
    seq_len: int = _SEQ,
    seed: int = _SEED,
    model_class: Optional[str] = _MODEL_CLASS,
    trust_pickle: bool = _TRUST_PICKLE,
    trust_remote_code: bool = _TRUST_CODE,
    allow_unmatched: bool = _UNMATCHED,
    sequential: bool = _SEQUENTIAL,
    resume: bool = _RESUME,
    all_experts: bool = _ALL_EXPERTS,
    imatrix: Optional[str] = _IMATRIX,
    strict_data: bool = _STRICT_DATA,
    matmul_precision: str = _MATMUL_PRECISION,
    format: str = _FORMAT,
    encoding_version: str = _ENC_VERSION,
    no_pack: bool = _NO_PACK,
    ct_8bit_format: str = _CT8,
    gguf_float: str = _GGUF_FLOAT,
    gguf_fallback: str = _GGUF_FALLBACK,
    max_shard_size: str = _SHARD,
    candidates: Optional[str] = _CANDIDATES,
    target_bpw: Optional[float] = _TARGET_BPW,
    target_size: Optional[str] = _TARGET_SIZE,
    search_samples: int = _SEARCH_SAMPLES,
    search_data: Optional[str] = _SEARCH_DATA,
    search_metric: str = _SEARCH_METRIC,
    overwrite: bool = _OVERWRITE,
    eval_data: Optional[str] = typer.Option(None, "--eval", help="Held-out data: then run the written file in its "
                                            "runtime against float and the fake-quant model (qtool eval's figures, "
                                            "its defaults, windows of at most the model's positions; an export "
                                            "fault exits 1)."),
    json_out: bool = _JSON,
    quiet: bool = _QUIET,
    debug: bool = _DEBUG,
) -> None:
    """Calibrate and export in one call."""
    quiet = quiet or _rank() != 0  # under torchrun, rank 0 reports
    json_out = json_out and _rank() == 0
    with _errors(debug, json_out), _Progress(quiet) as p:
        target = _target(config, candidates, target_bpw, target_size, search_samples, search_data, search_metric)
        recipe = _check_early(config, device, format, encoding_version, ct_8bit_format, gguf_float, gguf_fallback,
                              data, imatrix, matmul_precision, eval_data)
        checkpoint = _checkpoint(checkpoint, revision)
        if eval_data is not None:  # (before a calibration that --eval's data would then refuse)
            from ..evaluation import EvalOptions, check_held_out, within_positions

            check_held_out(checkpoint, within_positions(checkpoint, EvalOptions(
                data=eval_data, trust_remote_code=trust_remote_code)))
        from ..pipeline import run_quantize

        summary = run_quantize(checkpoint, recipe, out, _opts(
            data=data, device=device, batch_size=batch_size, num_samples=num_samples, seq_len=seq_len, seed=seed,
            model_class=model_class, trust_pickle=trust_pickle, trust_remote_code=trust_remote_code,
            allow_unmatched=allow_unmatched, sequential=sequential, imatrix=imatrix,
            strict_data=strict_data, resume=resume, all_experts=all_experts,
            matmul_precision=matmul_precision), overwrite, p.hooks(),
            _eopts(format=format, encoding_version=encoding_version, seq_len=seq_len, pack=not no_pack,
                   ct_eight_bit_format=ct_8bit_format, max_shard_bytes=_shard_bytes(max_shard_size),
                   gguf_float=gguf_float, gguf_fallback=gguf_fallback), target=target, eval_data=eval_data)
    _report_files(summary, quiet, p.warnings_shown)
    ev = None
    if eval_data is not None and _rank() == 0:
        from ..evaluation import EvalOptions, evaluate_artifact, within_positions

        with _errors(debug, json_out), _Progress(quiet) as p:
            ev = evaluate_artifact(out, checkpoint, None, within_positions(checkpoint, EvalOptions(
                data=eval_data, device=device, model_class=model_class, trust_pickle=trust_pickle,
                trust_remote_code=trust_remote_code)), hooks=p.hooks())
        if not quiet and not json_out:
            _print_eval(ev)
    if json_out:
        _emit_json({"ok": ev is None or not ev.export_fault, **summary,
                    **({"eval": ev.to_json()} if ev is not None else {})})
    if ev is not None and ev.export_fault:
        err.print(f"export fault: {ev.export_fault}", markup=False)
        raise typer.Exit(1)
