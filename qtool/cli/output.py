"""What the commands draw for people on stderr: the plan line and table, progress bars and step lines, the
files written, a size-budget search's choice and an evaluation's figures."""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..choices import GGML_SCALE_DTYPES
from .core import Table, _esc, err


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
    """A plan row's grid in a word: int4, uint8 (asymmetric: the codes are unsigned, as inspect and the exported
    files have them), fp8_e4m3, or a GGUF type's name (Q4_K: not "int4", which it is not)."""
    if q.scale_dtype in GGML_SCALE_DTYPES:
        return f"GGUF {q.scale_dtype.upper()}"
    return f"{'int' if q.symmetric else 'uint'}{q.bitwidth}" if q.element == "int" else q.element


def _plan_summary(plan) -> str:
    from collections import Counter

    from ..config import granularity_word

    def layout(q) -> str:
        return granularity_word(q.tensor, q.granularity) + (" dynamic" if q.dynamic else "")

    kinds = Counter((q.tensor, _grid_label(q), layout(q)) for q in plan.quantizers if q.name not in plan.left_float)
    parts = [f"{n} x {t} {e} {g}" for (t, e, g), n in sorted(kinds.items())]
    formats = Counter(plan.left_float.values())
    parts += [f"{n} x weight {how} ({next(k for k, v in plan.left_float.items() if v == how)}"
              + (" ..." if n > 1 else "") + ")" for how, n in sorted(formats.items())]
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
            err.print(f"[dim]{_esc(text)}...[/dim]")

    def plan(self, plan) -> None:
        if self.quiet:
            return
        err.print(_plan_summary(plan), markup=False)
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
        from ..pipeline import Hooks

        return Hooks(on_plan=self.plan, on_batch=self.batch, on_tensor=self.tensor, on_stage=self.stage,
                     on_block=self.block, on_step=self.step)


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
    idle = summary.get("uncalibrated", [])
    if idle:  # (one line: a large mixture-of-experts model has thousands of experts no calibration token reached)
        named = ", ".join(idle[:3]) + (f" and {len(idle) - 3} more" if len(idle) > 3 else "")
        err.print(f"[yellow]warning:[/yellow] {_esc(named)} saw no data and stay{'s' if len(idle) == 1 else ''} "
                  "float: the module never ran (an expert no token reached, a layer the data's kind does not reach: a "
                  "cross-attention layer on text alone), or takes its input by keyword or "
                  "returns no tensor, where an activation quantizer cannot reach (the list: uncalibrated in --json)")
    for w in summary.get("export_warnings", []):
        err.print(f"[yellow]warning:[/yellow] {_esc(w)}")
    err.print("wrote:")
    for f in summary.get("files", []):
        err.print(f"  {_esc(f)}")
    size = summary.get("size")
    if size and size.get("model_bytes"):
        line = (f"size: {_human(size['checkpoint_bytes'])} checkpoint -> {_human(size['model_bytes'])} "
                f"{', '.join(size['model_files'])} ({ratio_words(size['checkpoint_bytes'], size['model_bytes'])})")
        if summary.get("quantized_bytes"):
            line += (f"; quantized weights {_human(summary['original_bytes_of_quantized'])} -> "
                     f"{_human(summary['quantized_bytes'])} "
                     f"({summary['original_bytes_of_quantized'] / summary['quantized_bytes']:.2f}x)")
        err.print(_esc(line))


def ratio_words(before: float, after: float) -> str:
    """``"2.00x smaller"``, or ``"1.50x larger"`` where ``after`` is the larger (a float16 checkpoint's float32
    export, a small model's graph); ``"the same size"`` where the ratio reads 1.00."""
    if not before or not after:  # (a listing of no tensor)
        return "no ratio: nothing to compare"
    if f"{max(before, after) / min(before, after):.2f}" == "1.00":  # ("1.00x larger" read as a contradiction)
        return "the same size" if before == after else "about the same size"
    return f"{before / after:.2f}x smaller" if after <= before else f"{after / before:.2f}x larger"


def _human(n: float) -> str:
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB"):
        n /= 1000
        if n < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} GB"


def _print_eval(ev) -> None:
    """What ``qtool eval`` (and ``quantize --eval``) found, for people, on stderr."""
    from ..evaluation import describe

    for line in describe(ev):
        err.print(_esc(line))
    for note in ev.notes:
        err.print(f"[dim]note: {_esc(note)}[/dim]")
