"""The qtool command line (Typer). Thin commands: parse flags, call the library, draw progress, pick exit codes.

Exit codes: 0 success, 1 a quality gate failed, 2 bad usage or bad input, 3 internal error, 4 a rank of a
distributed run was lost. Human output and progress go to stderr; ``--json`` prints one JSON object on stdout.
Under ``torchrun`` (``WORLD_SIZE`` > 1) rank 0 alone reports; another rank speaks only for its own failure.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import typer

from . import __version__
from .choices import GGML_SCALE_DTYPES

class _Group(typer.core.TyperGroup):
    """Click's own usage errors (an unknown option, a value out of range) follow the same contract as qtool's: one
    ``error:`` line naming where help is, exit 2, and one JSON object with --json."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as e:  # typer's (vendored) click exceptions all derive from it
            if type(e).__name__ == "NoArgsIsHelpError" or not hasattr(e, "format_message"):
                e.show() if hasattr(e, "show") else err.print("interrupted: nothing was written", markup=False)
                sys.exit(getattr(e, "exit_code", 130))
            ctx = getattr(e, "ctx", None)
            where = f" (`{ctx.command_path} --help` lists the options)" if ctx is not None else ""
            message = f"error: {e.format_message()}{where}"
            err.print(message, markup=False)
            if "--json" in argv:
                _emit_json({"ok": False, "exit_code": e.exit_code, "error": message.split(": ", 1)[-1]})
            sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=_Group,
    name="qtool",
    help="Quantize PyTorch models: calibrate encodings, export integer tensors (AIMET-exact numerics).",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
config_app = typer.Typer(help="Inspect and lint recipes.", no_args_is_help=True)
app.add_typer(config_app, name="config")

class _LazyConsole:
    """rich's stderr console, made on first use: importing rich costs ~50 ms of every command's start-up, and a
    quiet command that succeeds never prints."""

    _console = None

    def _get(self):
        if _LazyConsole._console is None:
            from rich.console import Console

            _LazyConsole._console = Console(stderr=True, highlight=False, soft_wrap=True,
                                            no_color=bool(os.environ.get("NO_COLOR")))
        return _LazyConsole._console

    def __getattr__(self, name):
        return getattr(self._get(), name)


err = _LazyConsole()


def _rank() -> int:
    """This process's rank under a launcher such as torchrun (0 when not distributed)."""
    try:
        return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0
    except ValueError:
        return 0


def _version(value: bool) -> None:
    if value:
        typer.echo(f"qtool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """qtool: quantize PyTorch models."""


# ---------------------------------------------------------------------------------------------------------------
# Error handling and output
# ---------------------------------------------------------------------------------------------------------------
_SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is so outputs in progress are cleaned up like on Ctrl-C."""


# the signals this process received: an interrupt that lands inside C code (a tensor conversion, say) can come out
# as another exception (torch turns it into "ValueError: could not determine the shape ..."); it is still an
# interrupt, and reads as one
_SIGNALLED: List[str] = []


@contextmanager
def _errors(debug: bool = False, json_out: bool = False) -> Iterator[None]:
    """Turn every failure into one stderr line and an exit code (and one JSON object with --json)."""
    from .errors import QtoolError

    def fail(code: int, message: str, more=(), speak: bool = True) -> None:
        for line in [message, *more] if speak else []:
            err.print(line, markup=False)
        if json_out:  # (only rank 0 has json_out under torchrun; it reports another rank's failure too)
            _emit_json({"ok": False, "exit_code": code, "error": message.split(": ", 1)[-1],
                        **({"errors": [m.split(": ", 1)[-1] for m in [message, *more]]} if more else {})})
        raise typer.Exit(code)

    def interrupted() -> None:
        if _SIGNALLED:
            fail(_SIGNAL_EXIT[_SIGNALLED[-1]], f"interrupted: {_SIGNALLED[-1]}; nothing was written")

    try:
        yield
    except typer.Exit:
        raise
    except QtoolError as e:
        interrupted()
        # distributed: a rank that failed on its own says so (dist_rank); an error every rank meets alike (bad
        # flags, before the ranks connect) is said by rank 0; PeerFailed: another rank already said it
        dist_rank = getattr(e, "dist_rank", None)
        speak = not getattr(e, "quiet", False) and (dist_rank is not None or _rank() == 0)
        where = f"rank {dist_rank}: " if dist_rank is not None else ""
        problems = getattr(e, "problems", None) or []
        if len(problems) > 1:  # every problem of a recipe, one line each
            fail(e.exit_code, f"error: {where}{problems[0]}", [f"error: {p}" for p in problems[1:]], speak)
        fail(e.exit_code, f"error: {where}{e}", speak=speak)
    except KeyboardInterrupt as e:
        name = "SIGTERM" if isinstance(e, _Terminated) else "SIGINT"
        fail(_SIGNAL_EXIT[name], f"interrupted: {name}; nothing was written")
    except OSError as e:  # a full disk, a read-only directory, a path that vanished: the environment, not a bug
        interrupted()
        where = f"{e.filename}: " if e.filename else ""
        fail(2, f"error: {where}{e.strerror or e} (nothing was written)")
    except Exception as e:  # an internal error: one line, the traceback in a log file
        interrupted()
        import tempfile

        with tempfile.NamedTemporaryFile("w", prefix="qtool-error-", suffix=".log", delete=False) as log:
            traceback.print_exc(file=log)
        if debug:
            traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else ""
        fail(3, f"internal error: {type(e).__name__}: {first} (traceback in {log.name}; --debug shows it)")


def Table(*args, **kwargs):
    """rich's Table, imported when a command draws one."""
    from rich.table import Table as _Table

    return _Table(*args, **kwargs)


def _console():
    """A console for stdout tables and text (no highlighting; NO_COLOR respected)."""
    from rich.console import Console

    return Console(highlight=False, no_color=bool(os.environ.get("NO_COLOR")))


def _esc(text: str) -> str:
    from rich.markup import escape

    return escape(str(text))


def _emit_json(obj: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, default=str) + "\n")


def _plan_table(plan):
    t = Table(title=f"quantization plan: {len(plan.quantizers)} quantizers", title_justify="left")
    for col in ("module", "tensor", "bits", "sym", "granularity", "analyzer"):
        t.add_column(col, overflow="fold")
    for q in plan.quantizers:
        bits = str(q.bitwidth) + (f" ({q.scale_dtype.upper()})" if q.scale_dtype in GGML_SCALE_DTYPES else "")
        t.add_row(q.module, q.tensor, bits, "yes" if q.symmetric else "no", q.describe_granularity(),
                  q.analyzer_label + ("" if q.rounding == "nearest" else f" + {q.rounding}"))
    return t


def _grid_label(q) -> str:
    """A plan row's grid in a word: int4, fp8_e4m3, or a GGUF type's name (Q4_K: not "int4", which it is not)."""
    if q.scale_dtype in GGML_SCALE_DTYPES:
        return f"GGUF {q.scale_dtype.upper()}"
    return f"int{q.bitwidth}" if q.element == "int" else q.element


def _plan_summary(plan) -> str:
    from collections import Counter

    kinds = Counter((q.tensor, _grid_label(q), q.granularity + (" dynamic" if q.dynamic else ""))
                    for q in plan.quantizers if q.name not in plan.left_float)
    parts = [f"{n} x {t} {e} {g}" for (t, e, g), n in sorted(kinds.items())]
    formats = Counter(plan.left_float.values())
    parts += [f"{n} x weight left float by --format {fmt} ({next(k for k, v in plan.left_float.items() if v == fmt)}"
              + (" ..." if n > 1 else "") + ")" for fmt, n in sorted(formats.items())]
    memory = f"; {plan.memory.describe()}" if plan.memory is not None else ""
    coverage = f"; {plan.coverage.describe()}" if plan.coverage is not None else ""
    return f"plan: {len(plan.quantizers)} quantizers ({'; '.join(parts) or 'none'}){coverage}{memory}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400 else \
        f"{seconds / 3600:.1f} h"


class _Progress:
    """Hooks that draw a rich progress bar on stderr (only when stderr is a terminal and not --quiet)."""

    STEP_QUIET_S = 2.0  # a long step's lines (stderr not a terminal) start once it has run this long

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.enabled = not quiet and err.is_terminal
        self.progress = None  # (--quiet: rich is not even imported)
        if not quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
                                     console=err._get(), transient=False, disable=not self.enabled)
        self.tasks: Dict[str, Any] = {}
        self.samples = 0
        self.warnings_shown: Optional[int] = None  # the plan's warnings printed with it (later ones come at the end)
        self.doing = "calibrating"
        self.step_t0: Dict[str, float] = {}
        self.step_shown: Dict[str, int] = {}
        self.t0 = None

    def __enter__(self):
        if self.progress is not None:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def stage(self, text: str) -> None:
        self.doing = "measuring" if text.startswith("measuring") else "calibrating"  # what the batches are for
        if not self.quiet:
            err.print(f"[dim]{text}...[/dim]")

    def plan(self, plan) -> None:
        if self.quiet:
            return
        err.print(_plan_summary(plan))
        for w in plan.warnings:
            err.print(f"[yellow]warning:[/yellow] {_esc(w)}")
        self.warnings_shown = len(plan.warnings)

    def batch(self, done: int, total: int, samples: int) -> None:
        import time

        if self.t0 is None:
            self.t0 = time.perf_counter()
        self.samples += samples
        rate = self.samples / max(time.perf_counter() - self.t0, 1e-9)
        self._update(self.doing, self.doing, done, total, f"{rate:.1f} samples/s")
        if not self.enabled and not self.quiet and (done == total or done % max(total // 10, 1) == 0):
            err.print(f"{self.doing}: batch {done}/{total}")

    def block(self, done: int, total: int) -> None:
        self._update("block", "calibrating blocks", done, total, "")
        if not self.enabled and not self.quiet:
            err.print(f"calibrating: block {done}/{total}")

    def step(self, name: str, done: int, total: int, item: str) -> None:
        """A long step inside calibration: a bar on a terminal; otherwise, once it has run ``STEP_QUIET_S``, a
        line every tenth and at its end, with the time left (steps shorter than that stay silent)."""
        import time

        now = time.perf_counter()
        if done == 0:  # (a step may run again: once per block of a --sequential run)
            self.step_t0[name], self.step_shown[name] = now, 0
        start = self.step_t0.setdefault(name, now)
        self._update(f"step:{name}", name, done, total, item[-40:])
        if self.enabled or self.quiet or now - start < self.STEP_QUIET_S:
            return
        tenth = max(total // 10, 1)
        if done == total or done // tenth > self.step_shown.get(name, 0):
            self.step_shown[name] = done // tenth
            left = (now - start) / done * (total - done) if done else None
            err.print(_esc(f"{name}: {done}/{total}" + (f" {item}" if item else "")
                           + (f", about {_duration(left)} left" if left is not None and done < total else "")))

    def tensor(self, done: int, total: int, name: str) -> None:
        self._update("export", "exporting", done, total, "")

    def _update(self, key: str, desc: str, done: int, total: int, rate: str) -> None:
        if self.progress is None:
            return
        if key not in self.tasks:
            self.tasks[key] = self.progress.add_task(desc, total=total, rate=rate)
        self.progress.update(self.tasks[key], completed=done, rate=rate)

    def hooks(self):
        from .pipeline import Hooks

        return Hooks(on_plan=self.plan, on_batch=self.batch, on_tensor=self.tensor, on_stage=self.stage,
                     on_block=self.block, on_step=self.step)


# ---------------------------------------------------------------------------------------------------------------
# Shared options
# ---------------------------------------------------------------------------------------------------------------
def _complete_recipe(incomplete: str):
    from .config import shipped_recipes

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
_BATCH = typer.Option(8, "--batch-size", min=1, help="Samples per calibration batch.")
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
_STRICT_DATA = typer.Option(False, "--strict-data", help="Fail (exit 2, nothing written) where the calibration "
                            "data is below the documented minimum for what learns from it (512 tokens or 8 samples "
                            "for activation ranges and weighted searches, 2048 tokens or 16 samples for GPTQ and "
                            "AdaRound) or an importance matrix weighs a tensor's inputs all zero; without it: a "
                            "warning.")
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
    from .pipeline import CalibrateOptions

    return CalibrateOptions(**kw)


def _checkpoint(arg: str, revision: Optional[str]) -> str:
    """A local path for the CHECKPOINT argument (a Hugging Face Hub ID is fetched into, or found in, the cache)."""
    from .model.hub import resolve_checkpoint

    return resolve_checkpoint(arg, revision)


def _check_early(recipe: Optional[str] = None, device: Optional[str] = None, format: Optional[str] = None,
                 encoding_version: Optional[str] = None, ct_8bit_format: Optional[str] = None,
                 gguf_float: Optional[str] = None, gguf_fallback: Optional[str] = None,
                 data: Optional[str] = None, imatrix: Optional[str] = None):
    """Every choice, the data path and the recipe, checked before torch or a model is loaded (a typo costs no
    calibration). Returns the recipe read (a ``RecipeFile``, or None without one): the run takes it from here, so
    the file is read once."""
    if data is not None and not os.path.exists(data):
        from .errors import DataError

        raise DataError(f"{data}: data path not found")
    if imatrix is not None and not os.path.isfile(imatrix):
        from .errors import UsageError

        raise UsageError(f"--imatrix {imatrix}: no such file")
    from .choices import (AIMET_VERSIONS, CT_EIGHT_BIT_FORMATS, GGUF_FALLBACKS, GGUF_FLOAT_TYPES, check_choice,
                          check_device)
    from .export import format_names

    if format is not None:
        check_choice("--format", format, format_names())
    if encoding_version is not None:
        check_choice("--encoding-version", encoding_version, AIMET_VERSIONS)
    if ct_8bit_format is not None:
        check_choice("--ct-8bit-format", ct_8bit_format, CT_EIGHT_BIT_FORMATS)
    if gguf_float is not None:
        check_choice("--gguf-float", gguf_float, GGUF_FLOAT_TYPES)
    if gguf_fallback is not None:
        check_choice("--gguf-fallback", gguf_fallback, GGUF_FALLBACKS)
    if device is not None:
        check_device(device)
    if recipe is not None:
        from .config import read_recipe

        return read_recipe(recipe)
    return None


def _target(config: Optional[str], candidates: Optional[str], target_bpw: Optional[float],
            target_size: Optional[str], samples: int, search_data: Optional[str] = None, metric: str = "kl"):
    """``TargetOptions`` from the flags (None without --candidates), after checking they go together."""
    from .errors import UsageError

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
        from .io.fs import parse_size

        size = parse_size(target_size, "--target-size")
        if size is None:
            raise UsageError(f"--target-size {target_size}: give a size such as 4GB or 700MB")
    if target_bpw is not None and not (0 < target_bpw < 64):
        raise UsageError(f"--target-bpw {target_bpw:g}: bits per weight lie between 0 and 64")
    from .choices import check_choice
    from .pipeline import TargetOptions

    check_choice("--search-metric", metric, ("kl", "nll"))
    if search_data is not None and not os.path.exists(search_data):
        from .errors import DataError

        raise DataError(f"{search_data}: --search-data path not found")
    names = [c.strip() for c in candidates.split(",") if c.strip()]
    return TargetOptions(names, target_bpw, size, samples, search_data, metric)


def _report_target(summary: Dict[str, Any], quiet: bool) -> None:
    t = summary.get("target")
    if quiet or not t:
        return
    ch, b = t["chosen"], t["budget"]
    line = (f"target: {b['flag']} ({_human(b['bytes'])}, {b['bits_per_weight']:.3f} bits/weight in {t['format']}'s "
            f"format) -> chosen {_human(ch['bytes'])}, {ch['bits_per_weight']:.3f} bits/weight; "
            + ", ".join(f"{n} {k} group(s)" for n, k in ch["groups"].items()))
    if t.get("model_bytes"):
        line += f"; model files {_human(t['model_bytes'])}"
    err.print(_esc(line))
    if t.get("ranked_by"):
        err.print(_esc(f"ranked by the {t['ranked_by']}"))
    err.print(_esc(f"damage ({t['damage']}): predicted {ch['predicted_damage']:.4g}, measured {ch['damage']:.4g}; "
                   "uniform: " + ", ".join(f"{u['candidate']} {u['bits_per_weight']:.3f} bits/weight "
                                           f"{u['damage']:.4g}" for u in t["uniform"])))
    if t.get("float_perplexity") and "perplexity" in ch:  # the text's own measure, which KL need not move alike
        f = t["float_perplexity"]

        def pct(p):
            return f"{p:.4g} ({100 * (p / f - 1):+.2f}%)"

        err.print(_esc(f"perplexity of the search samples' text: float {f:.4g}; chosen {pct(ch['perplexity'])}; "
                       "uniform: " + ", ".join(f"{u['candidate']} {pct(u['perplexity'])}" for u in t["uniform"]
                                               if "perplexity" in u)))


def _report_files(summary: Dict[str, Any], quiet: bool, warnings_shown: Optional[int] = None) -> None:
    """The end of a command on stderr: warnings not printed yet (calibration's after the first
    ``warnings_shown``, which went out with the plan), what was written and how large."""
    if quiet:
        return
    _report_target(summary, quiet)
    if warnings_shown is not None:
        for w in summary.get("warnings", [])[warnings_shown:]:
            err.print(f"[yellow]warning:[/yellow] {_esc(w)}")
    for w in summary.get("uncalibrated", []):
        err.print(f"[yellow]warning:[/yellow] {_esc(w)} saw no data (its module never ran) and stays in float")
    for w in summary.get("export_warnings", []):
        err.print(f"[yellow]warning:[/yellow] {_esc(w)}")
    err.print("wrote:")
    for f in summary.get("files", []):
        err.print(f"  {_esc(f)}")
    size = summary.get("size")
    if size and size.get("model_bytes"):
        line = (f"size: {_human(size['checkpoint_bytes'])} checkpoint -> {_human(size['model_bytes'])} "
                f"{', '.join(size['model_files'])} ({size['checkpoint_bytes'] / size['model_bytes']:.2f}x smaller)")
        if summary.get("quantized_bytes"):
            line += (f"; quantized weights {_human(summary['original_bytes_of_quantized'])} -> "
                     f"{_human(summary['quantized_bytes'])} "
                     f"({summary['original_bytes_of_quantized'] / summary['quantized_bytes']:.2f}x)")
        err.print(_esc(line))


def _human(n: float) -> str:
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB"):
        n /= 1000
        if n < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} GB"


@app.command(epilog="Examples:\n\n\b\n  qtool calibrate MODEL_DIR -c w8a8 --data calib.txt -o runs/r1\n  qtool calibrate org/name -c w8a8-dynamic -o runs/r2   (a Hub ID; this recipe needs no data)\n  qtool calibrate m.safetensors --model-class pkg.mod:build -c my.yaml --data x.npy -o runs/r3")
def calibrate(
    checkpoint: str = typer.Argument(..., help="HF model directory or Hub ID (org/name), .pt2, .safetensors/.pt state dict."),
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
        recipe = _check_early(config, device, data=data, imatrix=imatrix)
        checkpoint = _checkpoint(checkpoint, revision)
        from .pipeline import run_calibrate

        summary = run_calibrate(checkpoint, recipe, out, _opts(
            data=data, device=device, batch_size=batch_size, num_samples=num_samples, seq_len=seq_len, seed=seed,
            model_class=model_class, trust_pickle=trust_pickle, trust_remote_code=trust_remote_code,
            allow_unmatched=allow_unmatched, sequential=sequential, imatrix=imatrix,
            strict_data=strict_data, resume=resume, all_experts=all_experts), overwrite, p.hooks(),
            target=target)
    _report_files(summary, quiet, p.warnings_shown)
    if json_out:
        _emit_json({"ok": True, **summary})


def _format_help() -> str:
    from .export import FORMATS

    return "; ".join(f"{name}: {text}" for name, (_, text) in FORMATS.items()) + "."


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
    from .io.fs import parse_size

    return parse_size(text, "--max-shard-size")


def _eopts(**kw):
    from .pipeline import ExportOptions

    return ExportOptions(**kw)


@app.command(epilog="Examples:\n\n\b\n  qtool export MODEL_DIR -e runs/r1/encodings.json -o out/\n  qtool export MODEL_DIR -e runs/r1/encodings.json -o out-onnx/ --format onnx --data calib.txt")
def export(
    checkpoint: str = typer.Argument(..., help="The checkpoint the encodings were calibrated on."),
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
        "weights than CHECKPOINT (by default refused: ranges of another model clip or waste this one's grid)."),
    overwrite: bool = _OVERWRITE,
    json_out: bool = _JSON,
    quiet: bool = _QUIET,
    debug: bool = _DEBUG,
) -> None:
    """Write the quantized model in FORMAT plus AIMET encodings (model.encodings) and a manifest."""
    with _errors(debug, json_out), _Progress(quiet) as p:
        _check_early(format=format, encoding_version=encoding_version, ct_8bit_format=ct_8bit_format,
                     gguf_float=gguf_float, gguf_fallback=gguf_fallback, data=data)
        checkpoint = _checkpoint(checkpoint, revision)
        from .pipeline import run_export

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
    checkpoint: str = typer.Argument(..., help="HF model directory or Hub ID (org/name), .pt2, .safetensors/.pt state dict."),
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
                                            "its defaults; an export fault exits 1)."),
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
                              data, imatrix)
        checkpoint = _checkpoint(checkpoint, revision)
        from .pipeline import run_quantize

        summary = run_quantize(checkpoint, recipe, out, _opts(
            data=data, device=device, batch_size=batch_size, num_samples=num_samples, seq_len=seq_len, seed=seed,
            model_class=model_class, trust_pickle=trust_pickle, trust_remote_code=trust_remote_code,
            allow_unmatched=allow_unmatched, sequential=sequential, imatrix=imatrix,
            strict_data=strict_data, resume=resume, all_experts=all_experts), overwrite, p.hooks(),
            _eopts(format=format, encoding_version=encoding_version, seq_len=seq_len, pack=not no_pack,
                   ct_eight_bit_format=ct_8bit_format, max_shard_bytes=_shard_bytes(max_shard_size),
                   gguf_float=gguf_float, gguf_fallback=gguf_fallback), target=target)
    _report_files(summary, quiet, p.warnings_shown)
    ev = None
    if eval_data is not None and _rank() == 0:
        from .evaluation import EvalOptions, evaluate_artifact

        with _errors(debug, json_out), _Progress(quiet) as p:
            ev = evaluate_artifact(out, checkpoint, None, EvalOptions(
                data=eval_data, device=device, model_class=model_class, trust_pickle=trust_pickle,
                trust_remote_code=trust_remote_code), hooks=p.hooks())
        if not quiet and not json_out:
            _print_eval(ev)
    if json_out:
        _emit_json({"ok": ev is None or not ev.export_fault, **summary,
                    **({"eval": ev.to_json()} if ev is not None else {})})
    if ev is not None and ev.export_fault:
        err.print(f"export fault: {ev.export_fault}", markup=False)
        raise typer.Exit(1)


def _print_eval(ev) -> None:
    """What ``qtool eval`` (and ``quantize --eval``) found, for people, on stderr."""
    from .evaluation import describe

    for line in describe(ev):
        err.print(_esc(line))
    for note in ev.notes:
        err.print(f"[dim]note: {_esc(note)}[/dim]")


def _check_gate_values(**gates: Optional[float]) -> None:
    """The gate flags that are set (``{"--flag": value}``) are finite; a perplexity increase is >= 0 and a cosine
    within [-1, 1]."""
    from .errors import UsageError

    for flag, value in gates.items():
        if value is not None and not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number (got {value})")
    if (gates.get("--max-ppl-increase") or 0) < 0:
        raise UsageError("--max-ppl-increase must be a percentage >= 0")
    cosine = gates.get("--min-cosine")
    if cosine is not None and not -1 <= cosine <= 1:
        raise UsageError(f"--min-cosine must be from -1 to 1, as a cosine is (got {cosine})")


def _pareto_search(pareto, encodings):
    """The search record (search.json beside ``encodings``) ``--pareto OUT`` draws, checked before the report runs."""
    if pareto is None:
        return None
    from pathlib import Path

    from .errors import UsageError
    from .report import read_search

    if Path(pareto).suffix.lower() not in (".png", ".svg"):
        raise UsageError(f"--pareto {pareto}: give a .png or .svg file name")
    found = Path(encodings).parent / "search.json"
    if not found.is_file():
        raise UsageError(f"--pareto: no search.json beside {encodings}; it is written by calibrate/quantize with "
                         "--candidates and --target-bpw/--target-size")
    return read_search(found)


def _check_report_outputs(checkpoint, encodings, data, recipe, **outputs) -> None:
    """No file ``report`` writes (``--plot``, ``--pareto`` and its .json, ``--suggest``'s recipe) may be one of its
    inputs or lie inside an input directory: checked before the (slow) report runs."""
    from pathlib import Path

    from .encodings import CODES_FILE, SIDECAR
    from .io.fs import check_output_file

    run = Path(encodings).parent
    inputs = [("checkpoint", checkpoint), ("encodings", encodings), ("encodings sidecar", str(run / SIDECAR)),
              ("codes", str(run / CODES_FILE)), ("search record", str(run / "search.json")), ("data", data),
              ("recipe", recipe)]
    for flag, out in outputs.items():
        if out is None:
            continue
        check_output_file(Path(out), inputs, flag=f"--{flag}")
        if flag == "pareto":
            check_output_file(Path(out).with_suffix(".json"), inputs, flag="--pareto's .json")


def _suggest_args(suggest, recipe, checkpoint, encodings, data):
    """``(N, OUT.yaml, base recipe text or None)`` of ``--suggest 'N OUT.yaml'`` and ``--recipe``, checked before
    the (slow) report runs: the base recipe must be valid, and OUT.yaml must not be one of the inputs."""
    from pathlib import Path

    from .config import load_recipe
    from .errors import UsageError

    if not suggest:
        return None, None, None
    n_text, out_yaml = suggest[0].split(None, 1) if " " in suggest[0] else (suggest[0], None)
    if out_yaml is None or not n_text.isdigit() or int(n_text) < 1:
        raise UsageError("--suggest takes 'N OUT.yaml' (quote it as one argument: --suggest '3 keep.yaml')")
    out = Path(out_yaml)
    base = None
    if recipe:
        load_recipe(recipe)  # a malformed base is one error naming its file and key, before anything runs
        base = Path(recipe).read_text(encoding="utf-8")
    return int(n_text), out, base


@app.command(epilog="Examples:\n\n\b\n  qtool report MODEL_DIR -e runs/r1/encodings.json --data heldout.txt\n  qtool report MODEL_DIR -e runs/r1/encodings.json --data heldout.txt --min-cosine 0.99 --json")
def report(
    checkpoint: str = typer.Argument(..., help="The checkpoint the encodings were calibrated on."),
    revision: Optional[str] = _REVISION,
    encodings: str = typer.Option(..., "--encodings", "-e", help="encodings.json from qtool calibrate."),
    data: Optional[str] = typer.Option(None, "--data", help="Evaluation data (held-out text or tensors)."),
    json_out: bool = _JSON,
    plot: Optional[str] = typer.Option(None, "--plot", help="Write a PNG bar chart of per-layer SQNR here."),
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
        None, "--suggest", help="With --sensitivity: N OUT.yaml, a recipe keeping the N most sensitive layers "
                                "at higher precision.", show_default=False),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Recipe to extend with --suggest's entries."),
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
    import math

    root = _rank() == 0  # under torchrun every rank gets the report; rank 0 prints it, every rank applies the gates
    quiet, json_out = quiet or not root, json_out and root

    from .errors import UsageError
    from .pipeline import run_report

    with _errors(debug, json_out):
        _check_early(device=device, data=data)
        if suggest is not None and (len(suggest) != 1 or not sensitivity):
            raise UsageError("--suggest takes 'N OUT.yaml' together with --sensitivity")
        suggest_n, suggest_out, base = _suggest_args(suggest, recipe, checkpoint, encodings, data)
        search = _pareto_search(pareto, encodings)
        _check_report_outputs(checkpoint, encodings, data, recipe, plot=plot, pareto=pareto, suggest=suggest_out)
        _check_gate_values(**{"--min-sqnr": min_sqnr, "--min-cosine": min_cosine,
                              "--max-ppl-increase": max_ppl_increase})
        checkpoint = _checkpoint(checkpoint, revision)
        with _Progress(quiet) as p:
            result = run_report(checkpoint, encodings, _opts(
                data=data, device=device, batch_size=batch_size, num_samples=num_samples, seq_len=seq_len,
                seed=seed, model_class=model_class, trust_pickle=trust_pickle, trust_remote_code=trust_remote_code),
                sensitivity_analysis=sensitivity, hooks=p.hooks())
        rep = result["report"]
        if plot and root:
            from .report import plot_sqnr

            from pathlib import Path as _P

            plot_sqnr(rep, plot, title=f"per-layer SQNR: {_P(checkpoint).name}")
        if pareto and root:
            import json as _json

            from pathlib import Path as _P

            from .io.fs import write_text_atomic
            from .report import pareto_points, plot_pareto

            points = pareto_points(search, rep)
            plot_pareto(points, pareto, title=f"{search['budget']['flag']} on {_P(checkpoint).name}: "
                                              f"{', '.join(search['candidates'])}")
            write_text_atomic(_P(pareto).with_suffix(".json"), _json.dumps(points, indent=1) + "\n")
            result["json"]["pareto"] = points
        if suggest and root:
            from .config import parse_recipe
            from .io.fs import write_text_atomic
            from .report import suggest_recipe

            text = suggest_recipe(result["sensitivity"], suggest_n, base)
            parse_recipe(text, source=suggest_out)  # write only what `-c` will read back
            write_text_atomic(suggest_out, text)
    from .report import check_gates, enforce_gates

    with _errors(debug, json_out):
        gates = check_gates(rep, min_sqnr, min_cosine, max_ppl_increase)
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
        if result.get("sensitivity"):
            st = Table(title="sensitivity: damage of quantizing each layer alone", title_justify="left")
            for col in ("module", "cosine", "damage"):
                st.add_column(col, justify="left" if col == "module" else "right")
            for r in result["sensitivity"]:
                st.add_row(r["module"], f"{r['cosine']:.5f}", f"{r['damage']:.4g}")
            con.print(st)
        if plot and not quiet:
            err.print(f"wrote: {_esc(plot)}")
    from .errors import GateFailed

    try:
        enforce_gates(gates)
    except GateFailed as e:
        err.print(str(e), markup=False)
        raise typer.Exit(e.exit_code)


@app.command("eval", epilog="Examples:\n\n\b\n  qtool eval out/ --data heldout.txt                      (the manifest names the checkpoint and encodings)\n  qtool eval out/model.gguf -r MODEL_DIR -e runs/r1/encodings.json --data heldout.txt\n  qtool eval out/ --data heldout.txt --max-ppl-increase 3 --min-agreement 0.9 --json")
def eval_(
    artifact: str = typer.Argument(..., help="What qtool export/quantize wrote: the output directory, or a .gguf / "
                                             ".onnx file, or a compressed-tensors directory."),
    reference: Optional[str] = typer.Option(None, "--reference", "-r", help="The float checkpoint (default: the "
                                            "one the artifact's manifest names)."),
    encodings: Optional[str] = typer.Option(None, "--encodings", "-e", help="encodings.json of the calibration "
                                            "(default: the manifest's): the fake-quant model the file is checked "
                                            "against."),
    data: Optional[str] = typer.Option(None, "--data", help="Held-out data (text or tensors), not the calibration's."),
    seq_len: int = typer.Option(256, "--seq-len", min=2, help="Tokens per window."),
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
                                                   "the fake-quant model <= X nats (1 - cosine for other models); "
                                                   "replaces the default export-fault check."),
    device: str = _DEVICE,
    model_class: Optional[str] = _MODEL_CLASS,
    trust_pickle: bool = _TRUST_PICKLE,
    trust_remote_code: bool = _TRUST_CODE,
    json_out: bool = _JSON,
    quiet: bool = _QUIET,
    debug: bool = _DEBUG,
) -> None:
    """Run the exported file where it is served and compare it with float and with qtool's fake-quant model."""
    from .choices import ONNX_OPTIMIZATIONS, check_choice
    from .errors import GateFailed, UsageError

    with _errors(debug, json_out):
        _check_early(device=device, data=data)
        _check_gate_values(**{"--max-ppl-increase": max_ppl_increase, "--max-kl": max_kl,
                              "--min-agreement": min_agreement, "--min-cosine": min_cosine,
                              "--max-export-gap": max_export_gap})
        check_choice("--onnx-optimization", onnx_optimization, ONNX_OPTIMIZATIONS)
        from .evaluation import EvalOptions, check_gates, evaluate_artifact

        opts = EvalOptions(data=data, seq_len=seq_len, num_samples=num_samples, seed=seed, top_k=top_k,
                           generate=generate, prompts=prompts, threads=threads, onnx_optimization=onnx_optimization,
                           device=device, model_class=model_class, trust_pickle=trust_pickle,
                           trust_remote_code=trust_remote_code,
                           tasks=tuple(t.strip() for t in (tasks or "").split(",") if t.strip()),
                           tasks_path=tasks_path, task_limit=task_limit)
        if tasks_path is not None and not os.path.isdir(tasks_path):
            raise UsageError(f"--tasks-path {tasks_path}: not a directory")
        with _Progress(quiet) as p:
            ev = evaluate_artifact(artifact, reference, encodings, opts, hooks=p.hooks())
        gates = check_gates(ev, max_ppl_increase, max_kl, min_agreement, max_export_gap, min_cosine)
    from .evaluation import enforce

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
    checkpoint: str = typer.Argument(..., help="A Llama-family Hugging Face directory (or Hub ID)."),
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
    from .pipeline import run_imatrix

    with _errors(debug, json_out):
        _check_early(device=device, data=data)
        checkpoint = _checkpoint(checkpoint, revision)
        with _Progress(quiet or json_out) as p:
            result = run_imatrix(checkpoint, out, _opts(
                data=data, device=device, batch_size=batch_size, num_samples=num_samples, seq_len=seq_len,
                seed=seed, trust_remote_code=trust_remote_code), overwrite=overwrite, hooks=p.hooks())
    if json_out:
        _emit_json({"ok": True, **result})
    elif not quiet:
        err.print(f"wrote: {_esc(result['imatrix'])} ({result['entries']} matrices, {result['tokens']} tokens)")


@app.command("import-encodings", epilog="Examples:\n\n\b\n  qtool import-encodings MODEL_DIR model.encodings -o runs/from-aimet")
def import_encodings(
    checkpoint: str = typer.Argument(..., help="The checkpoint the AIMET encodings belong to."),
    revision: Optional[str] = _REVISION,
    encodings_file: str = typer.Argument(..., help="AIMET encodings file (0.6.1, 1.0.0, 2.0.0 or 2.1.0)."),
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
    from .pipeline import run_import_encodings

    with _errors(debug, json_out):
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
    path: str = typer.Argument(..., help="A qtool output directory or file, an AIMET encodings file, a "
                                         "compressed-tensors model directory, or a GGUF file."),
    json_out: bool = _JSON,
    debug: bool = _DEBUG,
) -> None:
    """List quantized tensors (dtype, bitwidth, granularity, shape, bytes) and size totals."""
    from .inspect import inspect_path

    with _errors(debug, json_out):
        report = inspect_path(path)
    if json_out:
        _emit_json({"ok": True, **report})
        return
    t = Table(title=f"{report['kind']}: {report['path']}", title_justify="left")
    for col in ("tensor", "dtype", "bits", "granularity", "shape", "bytes"):
        t.add_column(col, overflow="fold", justify="right" if col in ("bits", "bytes") else "left")
    for r in report["tensors"]:
        t.add_row(r["name"], r["dtype"], str(r["bitwidth"] or ""), r["granularity"] or "", str(r["shape"]),
                  f"{r['bytes']:,}" if r["bytes"] is not None else "")
    con = _console()
    con.print(t)
    tot = report["totals"]
    lines = [f"quantized tensors: {tot['quantized_tensors']} of {tot['tensors']}"]
    if tot.get("bytes") is not None:
        lines.append(f"size: {tot['bytes']:,} bytes; float32 {tot['float32_bytes']:,} "
                     f"({tot['ratio_vs_float32']:.2f}x smaller); float16 {tot['float16_bytes']:,} "
                     f"({tot['ratio_vs_float16']:.2f}x smaller); {tot['bits_per_weight']:.2f} bits per weight")
    for key, value in (report.get("metadata") or {}).items():
        lines.append(f"{key}: {value}")
    for line in lines:
        con.print(line)


@config_app.command("list", epilog="Examples:\n\n\b\n  qtool config list\n  qtool config list --json")
def config_list(json_out: bool = _JSON) -> None:
    """List the recipes that ship with qtool (use one by name: -c w8a8)."""
    from .config import load_recipe, recipe_description, recipe_needs_data, shipped_recipes, spec_label, weights_label

    rows = []
    with _errors(False, json_out):
        for name, path in shipped_recipes().items():
            recipe = load_recipe(path)
            description = recipe_description(path.read_text(encoding="utf-8"))
            rows.append({"name": name, "title": description.split(": ", 1)[0].split(". ", 1)[0].rstrip("."),
                         "weights": weights_label(recipe),
                         "activations": spec_label(recipe.defaults.activations)
                         + (" + smoothquant" if recipe.smoothquant else ""),
                         "needs_data": recipe_needs_data(recipe), "description": description, "path": str(path)})
    if json_out:
        _emit_json({"ok": True, "recipes": rows})
        return
    con = _console()
    title = "shipped recipes: qtool quantize MODEL -c NAME ...; qtool config show NAME"
    if con.width >= 120:  # one row per recipe
        t = Table(title=title, title_justify="left")
        for col in ("name", "weights", "activations", "--data", "what"):
            t.add_column(col, no_wrap=col == "name")
        for r in rows:
            t.add_row(r["name"], r["weights"], r["activations"], "yes" if r["needs_data"] else "no", _esc(r["title"]))
    else:  # narrow terminals: what it is beneath its grids, so no column is too narrow for its words
        from rich import box

        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        t.add_column("name", no_wrap=True)
        t.add_column("weights | activations | needs --data; what it is")
        for r in rows:
            t.add_row(r["name"], _esc(f"{r['weights']} | {r['activations']} | "
                                      f"{'data' if r['needs_data'] else 'no data'}\n{r['title']}"))
    con.print(t)


def _rotation_json(rotation) -> dict:
    """A plan's rotations: which, of what type, and the modules each online one runs on."""
    return {"rotations": list(rotation.rotations), "type": rotation.kind, "seed": rotation.seed,
            "online": [{**r.to_json(), "rotates": r.rotated} for r in rotation.online()]}


def _recipe_text(recipe: str, json_out: bool) -> None:
    """``config show`` without a model: what the recipe says, every default resolved."""
    import yaml

    from .config import describe_recipe, load_recipe, recipe_description, recipe_file

    with _errors(False, json_out):
        path = recipe_file(recipe)
        info = describe_recipe(load_recipe(path))
        description = recipe_description(path.read_text(encoding="utf-8"))
    if json_out:
        _emit_json({"ok": True, "recipe": str(path), "description": description, **info})
        return
    con = _console()
    con.print(_esc(f"recipe: {path}"))
    if description:
        con.print(_esc(description))
    if info["gguf_mix"]:
        con.print(_esc(f"gguf_mix: {info['gguf_mix']} (each weight's GGUF type as llama-quantize chooses it; the "
                       "weights defaults below say how its codes are chosen)"))
    con.print(_esc(yaml.safe_dump({k: info[k] for k in ("defaults", "layers", "ignore", "smoothquant",
                                                        "fold_batch_norms", "kv_cache", "rotate")
                                   if info[k] not in (None, [], False)}, sort_keys=False, width=110).rstrip()))
    types = info["default_types"]
    con.print(_esc("by default (layers entries aside) it quantizes: "
                   f"weights of {', '.join(types['weights']) or 'no module'}; "
                   f"activations of {', '.join(types['activations']) or 'no module'} (subclasses included)"))
    con.print(f"needs calibration data: {'yes' if info['needs_data'] else 'no'}")
    con.print("(pass --model CHECKPOINT to see the plan: one row per quantizer)")


@config_app.command("show", epilog="Examples:\n\n\b\n  qtool config show w8a8                        (the recipe, every default resolved)\n  qtool config show my.yaml --model MODEL_DIR   (the plan: one row per quantizer)")
def config_show(
    recipe: str = typer.Argument(..., help="Recipe YAML, or a shipped recipe's name (qtool config list)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Checkpoint to resolve the recipe against "
                                        "(without it: the recipe's rules with every default resolved)."),
    model_class: Optional[str] = _MODEL_CLASS,
    trust_pickle: bool = _TRUST_PICKLE,
    trust_remote_code: bool = _TRUST_CODE,
    allow_unmatched: bool = _UNMATCHED,
    json_out: bool = _JSON,
    debug: bool = _DEBUG,
) -> None:
    """Print the resolved plan: one row per quantizer (with --model), or what the recipe says (without)."""
    from dataclasses import asdict

    from .pipeline import plan_for

    if model is None:
        _recipe_text(recipe, json_out)
        return
    with _errors(debug, json_out):
        model = _checkpoint(model, None)
        opts = _opts(model_class=model_class, trust_pickle=trust_pickle, trust_remote_code=trust_remote_code,
                     allow_unmatched=allow_unmatched)
        loaded, plan = plan_for(model, recipe, opts)
    from .calibration import estimate_run, streams

    # as calibrate, without --data and at its default batches, would run it
    estimate = estimate_run(loaded.model, plan, "streaming" if loaded.kind == "hf" and streams(plan, opts)
                            else "in_memory", opts)
    if json_out:
        _emit_json({"ok": True, "quantizers": [asdict(q) for q in plan.quantizers],
                    "weights_quantized": plan.coverage.to_json(),
                    "memory": {"mode": estimate.mode, "peak_bytes": estimate.peak,
                               "sequential_bytes": estimate.sequential},
                    "smoothquant": [asdict(g) for g in plan.smoothing],
                    **({"batch_norm_folds": [asdict(f) for f in plan.folds]} if plan.folds else {}),
                    **({"rotation": _rotation_json(plan.rotation)} if plan.rotation else {}),
                    "warnings": plan.warnings})
        return
    console = _console()
    console.print(_plan_table(plan))
    console.print(plan.coverage.describe())
    console.print(f"calibrating it: {estimate.describe()}, at --batch-size {opts.batch_size} --seq-len "
                  f"{opts.seq_len}")
    if plan.smoothing:
        console.print(f"smoothquant (alpha {plan.smoothing[0].alpha}), before calibration: {len(plan.smoothing)} "
                      "groups, e.g. " + _esc(f"{plan.smoothing[0].smooth} -> {', '.join(plan.smoothing[0].balance)}"))
    if plan.folds:
        console.print(f"fold_batch_norms, before calibration: {len(plan.folds)} batch norms into the convolution "
                      "before each (each pair checked on the first batch), e.g. "
                      + _esc(f"{plan.folds[0].bn} -> {plan.folds[0].conv}"))
    if plan.rotation:
        rot = _rotation_json(plan.rotation)
        fused = [r for r in rot["rotations"] if r in ("r1", "r2")]
        console.print(_esc(f"rotate ({rot['type']}, seed {rot['seed']}), before calibration: "
                           + "; ".join(([f"{' '.join(fused)} fused into the weights"] if fused else [])
                                       + [f"{o['name']} online ({o['rotates']}) on {len(o['modules'])} modules, "
                                          f"e.g. {o['modules'][0]}" for o in rot["online"]])))
    for w in plan.warnings:
        err.print(f"warning: {w}")


@config_app.command("validate", epilog="Examples:\n\n\b\n  qtool config validate my.yaml other.yaml")
def config_validate(
    recipes: List[str] = typer.Argument(..., help="Recipe YAML files."),
    json_out: bool = _JSON,
) -> None:
    """Check recipes against the schema (no model needed)."""
    from .config import load_recipe
    from .errors import ConfigError

    failed = []
    for r in recipes:
        try:
            load_recipe(r)
            if not json_out:
                err.print(f"ok: {r}")
        except ConfigError as e:
            failed.append({"recipe": r, "error": str(e), "problems": e.problems})
            for problem in e.problems:
                err.print(f"error: {problem}", markup=False)
    if json_out:
        _emit_json({"ok": not failed, "errors": failed})
    if failed:
        raise typer.Exit(2)


def _terminate(signum, frame):
    _SIGNALLED.append("SIGTERM")
    raise _Terminated()


def _interrupt(signum, frame):
    _SIGNALLED.append("SIGINT")
    raise KeyboardInterrupt()


def main() -> None:
    import gc
    import signal

    # Start-up imports torch (and transformers for a Hugging Face model): hundreds of thousands of objects that
    # are never garbage, which the default threshold (a collection every 700 new objects) scans again and
    # again, a tenth of a second or more per command. Collections stay on, a hundred times less often.
    gc.set_threshold(70_000, 10, 10)
    # pydantic looks for plugins (observability hooks) in every installed package's entry points the first time
    # it builds a validator: ~25 ms per command for a feature the CLI's own recipe schema has no use for. A user's
    # explicit setting wins; the library (import qtool) is left alone.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        app()
    finally:
        # On exit the interpreter searches everything still alive for reference cycles, several times over, to
        # free memory the operating system takes back anyway: ~0.4 s per command once torch is loaded. Frozen
        # objects are skipped. By now every output is closed and renamed into place, and what cleans up at exit
        # (atexit handlers, weakref finalizers such as the spill directory's) still runs.
        gc.freeze()


if __name__ == "__main__":
    main()
