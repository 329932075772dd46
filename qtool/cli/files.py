"""The commands about files already written: ``import-encodings`` (an AIMET encodings file made qtool's) and
``inspect`` (what a written artifact holds)."""

from __future__ import annotations

from typing import Optional

import typer

from .core import Table, _console, _emit_json, _errors, _esc, _one_process, app, err
from .options import (_DEBUG, _JSON, _MODEL_CLASS, _OVERWRITE, _QUIET, _REVISION, _TRUST_CODE, _TRUST_PICKLE,
                      _checkpoint, _opts)
from .output import _report_files, ratio_words


@app.command("import-encodings", epilog="Examples:\n\n\b\n  qtool import-encodings MODEL_DIR model.encodings -o runs/from-aimet")
def import_encodings(
    checkpoint: str = typer.Argument(..., metavar="CHECKPOINT", help="The checkpoint the AIMET encodings belong to."),
    revision: Optional[str] = _REVISION,
    encodings_file: str = typer.Argument(..., metavar="ENCODINGS_FILE", help="AIMET encodings file (0.6.1, 1.0.0, 2.0.0 or 2.1.0)."),
    out: str = typer.Option(..., "--out", "-o", help="Run directory for qtool's encodings.json."),
    model_class: Optional[str] = _MODEL_CLASS,
    trust_pickle: bool = _TRUST_PICKLE,
    trust_remote_code: bool = _TRUST_CODE,
    overwrite: bool = _OVERWRITE,
    json_out: bool = _JSON,
    quiet: bool = _QUIET,
    debug: bool = _DEBUG,
) -> None:
    """Turn an AIMET encodings file into qtool's encodings.json (then qtool export can write any format)."""
    from ..pipeline import run_import_encodings

    with _errors(debug, json_out):
        _one_process("import-encodings")
        checkpoint = _checkpoint(checkpoint, revision)
        summary = run_import_encodings(checkpoint, encodings_file, out, _opts(
            model_class=model_class, trust_pickle=trust_pickle, trust_remote_code=trust_remote_code), overwrite)
    if not quiet:
        for w in summary["warnings"]:
            err.print(f"[yellow]warning:[/yellow] {_esc(w)}")
    _report_files(summary, quiet)
    if json_out:
        _emit_json({"ok": True, **summary})


@app.command(epilog="Examples:\n\n\b\n  qtool inspect out/\n  qtool inspect runs/r1/encodings.json --json")
def inspect(
    path: str = typer.Argument(..., metavar="PATH", help="A qtool output directory or file, an AIMET encodings file, a "
                                         "compressed-tensors model directory, or a GGUF file."),
    json_out: bool = _JSON,
    debug: bool = _DEBUG,
) -> None:
    """List quantized tensors (dtype, bitwidth, granularity, shape, bytes) and size totals."""
    from ..inspect import inspect_path

    with _errors(debug, json_out):
        _one_process("inspect")  # (every rank printed the listing: two JSON objects on one stdout)
        report = inspect_path(path)
    if json_out:
        _emit_json({"ok": True, **report})
        return
    t = Table(title=_esc(f"{report['kind']}: {report['path']}"), title_justify="left")
    for col in ("tensor", "dtype", "bits", "granularity", "shape", "bytes"):
        t.add_column(col, overflow="fold", justify="right" if col in ("bits", "bytes") else "left")
    for r in report["tensors"]:
        granularity = (r["granularity"] or "") + (f" {r['block_size']}" if r.get("block_size") else "")
        t.add_row(_esc(r["name"]), _esc(r["dtype"]), str(r["bitwidth"] or ""), _esc(granularity),
                  str(r["shape"]) if r["shape"] is not None else "",
                  f"{r['bytes']:,}" if r["bytes"] is not None else "")
    con = _console()
    con.print(t)
    tot = report["totals"]
    lines = [f"quantized tensors: {tot['quantized_tensors']} of {tot['tensors']}"]
    if tot.get("bytes") is not None:
        lines.append(f"size: {tot['bytes']:,} bytes; float32 {tot['float32_bytes']:,} "
                     f"({ratio_words(tot['float32_bytes'], tot['bytes'])}); float16 {tot['float16_bytes']:,} "
                     f"({ratio_words(tot['float16_bytes'], tot['bytes'])}); {tot['bits_per_weight']:.2f} bits per "
                     "weight")
    for key, value in (report.get("metadata") or {}).items():
        lines.append(f"{key}: {value}")
    for line in lines:
        con.print(line, markup=False)
