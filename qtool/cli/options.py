"""The options several commands share (Typer option objects), and what turns flags into the library's inputs:
calibration and export options, the size-budget target, and the early checks that read the recipe once before
torch or a model is loaded."""

from __future__ import annotations

import os
from typing import Optional

import typer


def _complete_recipe(incomplete: str):
    from ..config import shipped_recipes

    return [name for name in shipped_recipes() if name.startswith(incomplete)]


_CONFIG = typer.Option(..., "--config", "-c", help="Recipe: a shipped recipe's name (qtool config list) or a YAML file.",
                       autocompletion=_complete_recipe)


_CONFIG_OR_SEARCH = typer.Option(
    None, "--config", "-c", help="Recipe: a shipped recipe's name (qtool config list) or a YAML file (or "
    "--candidates with --target-bpw/--target-size to have one chosen).", autocompletion=_complete_recipe)


_TARGET_BPW = typer.Option(None, "--target-bpw", help="With --candidates: the file's budget in bits per weight "
                           "(every stored byte over the model's number of values).")


_TARGET_SIZE = typer.Option(None, "--target-size", help="With --candidates: the file's budget, e.g. 4GB, 700MB.")


_CANDIDATES = typer.Option(None, "--candidates", help="Recipes (names or files, comma-separated) whose weight "
                           "settings each layer chooses among, for the least measured damage within the budget.")


_SEARCH_SAMPLES = typer.Option(8, "--search-samples", min=1, help="With --candidates: calibration samples the "
                               "damage of each layer's options is measured on.")


_SEARCH_DATA = typer.Option(None, "--search-data", help="With --candidates: the data the damage is measured on "
                            "(default: a seeded subset of --data). Text the calibration did not see "
                            "measures what GPTQ fitted to as it does on new text.")


_SEARCH_METRIC = typer.Option("kl", "--search-metric", help="With --candidates: what the choice minimizes: kl "
                              "(closeness to the float model's next-token distribution; 1 - cosine for other "
                              "models) or nll (the search text's own next-token loss; causal LMs).",
                              metavar="[kl|nll]")


_DATA = typer.Option(None, "--data", help="Calibration data: a file or directory (.safetensors .pt .npy .npz .txt .jsonl).")


_DEVICE = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N or auto.", metavar="[cpu|cuda|cuda:N|auto]",
                       autocompletion=lambda incomplete: [c for c in ("cpu", "cuda", "auto") if c.startswith(incomplete)])


_BATCH = typer.Option(8, "--batch-size", min=1, help="Samples per batch the model runs.")


_NUM = typer.Option(None, "--num-samples", min=1, help="Use a seeded random subset of this many samples.")


_SEQ = typer.Option(128, "--seq-len", min=1, help="Tokens per text sample.")


_SEED = typer.Option(0, "--seed", help="Seed of the sample subset (0 to 2**64 - 1).")


_MODEL_CLASS = typer.Option(None, "--model-class", help="module:callable that builds the model (state-dict checkpoints).")


_TRUST_PICKLE = typer.Option(False, "--trust-pickle", help="Allow loading pickled modules (can run code).")


_TRUST_CODE = typer.Option(False, "--trust-remote-code", help="Allow a Hugging Face model's own Python code.")


_UNMATCHED = typer.Option(False, "--allow-unmatched", help="A layers entry that matches nothing is a warning, not an error.")


_SEQUENTIAL = typer.Option(False, "--sequential",
                           help="Causal LMs: calibrate one decoder block at a time, so memory holds one block, not the "
                           "model (the plan line estimates both peaks; a run whose in-memory estimate is past the "
                           "machine's memory stops and asks for it). Also the better GPTQ: each block's statistics "
                           "come from the quantized blocks before it.")


_RESUME = typer.Option(False, "--resume", help="With --sequential: continue a run that stopped (crash, kill, "
                       "Ctrl-C) after its last finished block, from the state it kept in OUT.resume; the output is "
                       "byte-identical to an uninterrupted run. A state of another run (checkpoint, data, recipe, "
                       "options, versions or ranks changed) is refused.")


_ALL_EXPERTS = typer.Option(False, "--all-experts", help="Mixture-of-experts models: every expert sees every "
                            "calibration token (its input statistics, GPTQ and activation ranges), while each "
                            "layer's output stays routed as the model routes it; default: each expert sees the "
                            "tokens its router sends it (rarely chosen experts may see too few).")


_MATMUL_PRECISION = typer.Option(
    "highest", "--matmul-precision", metavar="[highest|high|medium]",
    help="The model's float32 matrix products in the calibration passes, as torch.set_float32_matmul_precision: "
    "highest (float32; the default), high (TF32: CUDA GPUs from Ampere on, CPUs with AMX-FP16), medium (also "
    "bfloat16 on CPUs with AMX). Faster passes for other bytes: the ranges and statistics come from activations "
    "rounded so. qtool's own sums, searches and solves stay float32; a device without the units warns and runs "
    "float32.")


_STRICT_DATA = typer.Option(False, "--strict-data", help="Fail (exit 2, nothing written) where the calibration "
                            "data is below the documented minimum for what learns from it (512 tokens or 8 samples "
                            "for activation ranges and weighted searches, 2048 tokens or 16 samples for GPTQ, "
                            "AdaRound, SignRound and AWQ) or an importance matrix weighs a tensor's inputs all "
                            "zero; without it: a warning.")


_IMATRIX = typer.Option(None, "--imatrix", help="An importance matrix (llama-imatrix's GGUF or imatrix.dat, or "
                        "qtool imatrix's): weights the searched weights (analyzer mse) of the matrices it names, "
                        "as llama-quantize --imatrix does; no --data needed for it.")


_OVERWRITE = typer.Option(False, "--overwrite", help="Replace an existing --out directory.")


_JSON = typer.Option(False, "--json", help="Print one JSON object on stdout (human output stays on stderr).")


_QUIET = typer.Option(False, "--quiet", "-q", help="No progress or summaries on stderr.")


_DEBUG = typer.Option(False, "--debug", help="Show tracebacks of internal errors.")


_REVISION = typer.Option(None, "--revision", help="With a Hugging Face Hub ID as CHECKPOINT: a branch, tag or "
                         "commit (default main).")


def _opts(**kw):
    from ..pipeline import CalibrateOptions

    return CalibrateOptions(**kw)


def _checkpoint(arg: str, revision: Optional[str]) -> str:
    """A local path for the CHECKPOINT argument (a Hugging Face Hub ID is fetched into, or found in, the cache)."""
    from ..model.hub import resolve_checkpoint

    return resolve_checkpoint(arg, revision)


def _check_early(recipe: Optional[str] = None, device: Optional[str] = None, format: Optional[str] = None,
                 encoding_version: Optional[str] = None, ct_8bit_format: Optional[str] = None,
                 gguf_float: Optional[str] = None, gguf_fallback: Optional[str] = None,
                 data: Optional[str] = None, imatrix: Optional[str] = None,
                 matmul_precision: Optional[str] = None, eval_data: Optional[str] = None):
    """Every choice, the data path and the recipe, checked before torch or a model is loaded (a typo costs no
    calibration). Returns the recipe read (a ``RecipeFile``, or None without one): the run takes it from here, so
    the file is read once."""
    for given, flag in ((data, ""), (eval_data, "--eval ")):  # (--eval's: rank 0 reads it after the output)
        if given is not None and not os.path.exists(given):
            from ..errors import DataError

            raise DataError(f"{flag}{given}: data path not found")
    if imatrix is not None and not os.path.isfile(imatrix):
        from ..errors import UsageError

        raise UsageError(f"--imatrix {imatrix}: no such file")
    from ..choices import check_device
    from ..export import check_export_choices

    check_export_choices(format, encoding_version, ct_8bit_format, gguf_float, gguf_fallback)
    if matmul_precision is not None:
        from ..choices import MATMUL_PRECISIONS, check_choice

        check_choice("--matmul-precision", matmul_precision, MATMUL_PRECISIONS)
    if device is not None:
        check_device(device)
    if recipe is not None:
        from ..config import read_recipe

        return read_recipe(recipe)
    return None


def _target(config: Optional[str], candidates: Optional[str], target_bpw: Optional[float],
            target_size: Optional[str], samples: int, search_data: Optional[str] = None, metric: str = "kl"):
    """``TargetOptions`` from the flags (None without --candidates), after checking they go together."""
    from ..errors import UsageError

    budget = target_bpw is not None or target_size is not None
    if candidates is None:
        if budget:
            raise UsageError("--target-bpw/--target-size choose among --candidates R1,R2,... (recipe names or files)")
        if search_data is not None or metric != "kl":
            raise UsageError("--search-data/--search-metric go with --candidates and a budget")
        if config is None:
            raise UsageError("pass a recipe with -c/--config (qtool config list shows the shipped ones), or "
                             "--candidates with --target-bpw/--target-size")
        return None
    if config is not None:
        raise UsageError("-c/--config and --candidates exclude each other: the search writes the recipe")
    if target_bpw is not None and target_size is not None:
        raise UsageError("give one budget: --target-bpw or --target-size")
    if not budget:
        raise UsageError("--candidates needs a budget: --target-bpw B or --target-size SIZE")
    size = None
    if target_size is not None:
        from ..io.fs import parse_size

        size = parse_size(target_size, "--target-size", unlimited=False)
    if target_bpw is not None and not (0 < target_bpw < 64):
        raise UsageError(f"--target-bpw {target_bpw:g}: bits per weight lie between 0 and 64")
    from ..choices import SEARCH_METRICS, check_choice
    from ..pipeline import TargetOptions

    check_choice("--search-metric", metric, SEARCH_METRICS)
    if search_data is not None and not os.path.exists(search_data):
        from ..errors import DataError

        raise DataError(f"{search_data}: --search-data path not found")
    names = [c.strip() for c in candidates.split(",") if c.strip()]
    return TargetOptions(names, target_bpw, size, samples, search_data, metric, size_given=target_size)


def _format_help() -> str:
    from ..export import FORMATS
    from ..families import FAMILIES

    titles = dict.fromkeys(f.title for f in FAMILIES.values() if f.gguf_arch is not None and f.title)
    text = {**{n: t for n, (_, t) in FORMATS.items()},
            "gguf": FORMATS["gguf"][1] + f" for the families of qtool.families: {', '.join(titles)}"}
    return "; ".join(f"{name}: {t}" for name, t in text.items()) + "."


def _complete(choices):
    return lambda incomplete: [c for c in choices if c.startswith(incomplete)]


_FORMAT = typer.Option("qtool", "--format", "-f", help=_format_help(),
                       metavar="[" + "|".join(__import__("qtool.export", fromlist=["FORMATS"]).format_names()) + "]",
                       autocompletion=_complete(__import__("qtool.export", fromlist=["FORMATS"]).format_names()))


_ENC_VERSION = typer.Option("1.0.0", "--encoding-version", help="AIMET encodings version: 0.6.1, 1.0.0 or 2.0.0.",
                            metavar="[0.6.1|1.0.0|2.0.0]",
                            autocompletion=_complete(("0.6.1", "1.0.0", "2.0.0")))


_NO_PACK = typer.Option(False, "--no-pack", help="Store sub-byte codes one per byte instead of packed.")


_CT8 = typer.Option("int-quantized", "--ct-8bit-format", metavar="[int-quantized|pack-quantized]",
                    autocompletion=_complete(("int-quantized", "pack-quantized")),
                    help="compressed-tensors layout of 8-bit weights: int-quantized or pack-quantized (vLLM).")


_GGUF_FLOAT = typer.Option("f32", "--gguf-float", help="gguf: dtype of the 2-D tensors the recipe leaves float: "
                           "f32 (exactly what qtool's model computes with) or f16.", metavar="[f32|f16]",
                           autocompletion=_complete(("f32", "f16")))


_GGUF_FALLBACK = typer.Option("none", "--gguf-fallback", help="gguf: a quantized weight whose grid no GGUF type "
                              "holds (GGUF types: Q8_0, Q5_0/Q5_1, Q4_0/Q4_1 per_block 32, or a recipe's gguf_type "
                              "or gguf_mix: Q2_K ... Q6_K, IQ4_NL, IQ4_XS) is refused (none) or written as its "
                              "fake-quant values in f32/f16.",
                              metavar="[none|f32|f16]",
                              autocompletion=_complete(("none", "f32", "f16")))


_SHARD = typer.Option("5GB", "--max-shard-size",
                      help="qtool format: largest output shard, e.g. 5GB, 500MB, 2GiB; 0 or none: one file.")


def _shard_bytes(text: str):
    from ..io.fs import parse_size

    return parse_size(text, "--max-shard-size")


def _eopts(**kw):
    from ..pipeline import ExportOptions

    return ExportOptions(**kw)
