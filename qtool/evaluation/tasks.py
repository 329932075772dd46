"""lm-evaluation-harness tasks (``qtool eval --tasks``) on any runtime: an ``lm_eval`` model over the runtime
interface (``distributions`` / ``greedy``) and the reference checkpoint's tokenizer, so the GGUF file is scored by
llama.cpp, the ONNX graph by onnxruntime, and so on. lm-eval is an optional extra (``qtool[tasks]``).

Requests are encoded as lm-eval's own Hugging Face model encodes them: no special tokens, the context's trailing
spaces moved to the continuation, the continuation's tokens those of the whole text after the context's; an
empty context starts from the end-of-text token. Inputs longer than ``max_length`` keep their last tokens.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence

from ..errors import UsageError
from ..hooks import step

INSTALL = "pip install 'qtool[tasks]' (lm-evaluation-harness)"
GENERATION_CHUNK = 16  # greedy tokens between checks for a stop string


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.api.model import LM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UsageError(f"--tasks runs lm-evaluation-harness's tasks: {INSTALL}") from None
    return lm_eval, LM, TaskManager


def task_manager(include_path: Optional[str], tasks: Sequence[str]):
    """lm-eval's task index (with ``include_path``'s YAML tasks); ``UsageError`` naming unknown tasks."""
    _, _, TaskManager = _lm_eval()
    tm = None
    if include_path:  # indexing lm-eval's own ~15,000 tasks takes a while: only when they are asked for
        tm = TaskManager(include_path=include_path, include_defaults=False)
        if any(t not in tm.all_tasks for t in tasks):
            tm = None
    tm = tm or TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        raise UsageError(f"--tasks: lm-eval knows no task {', '.join(repr(t) for t in unknown)}"
                         + ("" if include_path else " (a task of your own: --tasks-path DIR with its YAML)"))
    return tm


def _adapter(runtime, tokenizer, max_length: int, label: str):
    _, LM, _ = _lm_eval()
    eot = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id

    def encode(text: str) -> List[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    class RuntimeLM(LM):
        def _pair(self, context: str, continuation: str):
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = encode(context + continuation)
            ctx = encode(context) if context else []
            cont = whole[len(ctx):]
            return (ctx or [eot]), cont

        def _score(self, ctx: List[int], cont: List[int]):
            ids = (ctx + cont)[-max_length:]
            start = max(1, len(ids) - len(cont))
            d = runtime.distributions(ids, 1, start=start)
            return float(d.target.sum()), bool((d.top_ids[:, 0] == d.top_ids.new_tensor(ids[start:])).all())

        def loglikelihood(self, requests) -> List[tuple]:
            out = []
            for i, r in enumerate(requests):
                out.append(self._score(*self._pair(*r.args)))
                step(f"tasks ({label})", i + 1, len(requests))
            return out

        def loglikelihood_rolling(self, requests) -> List[float]:
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

            out = []
            for i, r in enumerate(requests):
                total = 0.0
                for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                        encode(r.args[0]), prefix_token=eot, max_seq_len=max_length, context_len=1)):
                    total += self._score(list(ctx), list(cont))[0]
                out.append(total)
                step(f"tasks ({label})", i + 1, len(requests))
            return out

        def generate_until(self, requests) -> List[str]:
            out = []
            for i, r in enumerate(requests):
                context, kwargs = r.args[0], dict(r.args[1] or {})
                until = kwargs.get("until") or [tokenizer.decode([eot])]
                until = [until] if isinstance(until, str) else list(until)
                budget = int(kwargs.get("max_gen_toks", 256))
                ids = encode(context)[-max_length:] or [eot]
                made: List[int] = []
                text = ""
                while len(made) < budget:
                    ask = min(GENERATION_CHUNK, budget - len(made))
                    got = runtime.greedy(ids + made, ask, [eot])
                    made += got
                    text = tokenizer.decode(made, skip_special_tokens=True)
                    if len(got) < ask or eot in made or any(u and u in text for u in until):
                        break
                for u in until:
                    if u and u in text:
                        text = text[:text.index(u)]
                out.append(text)
                step(f"tasks ({label})", i + 1, len(requests))
            return out

    return RuntimeLM()


@contextlib.contextmanager
def _lm_eval_quieted() -> Iterator[None]:
    """lm-eval's own chatter off qtool's terminal while it runs (qtool draws the tasks' progress): its loggers'
    warnings, its and the datasets library's progress bars, and the ``git describe`` it runs for its results'
    metadata (which qtool drops), whose "fatal: not a git repository" reached stderr from any other directory.
    Process-wide while it runs (module attributes swapped and restored), as a command runs one evaluation."""
    import functools
    import logging

    import lm_eval.api.task as task_module
    import lm_eval.evaluator as evaluator

    loggers = [logging.getLogger(n) for n in ("lm_eval", "lm-eval")]
    levels = [lg.level for lg in loggers]
    # (only what this lm-eval has: another version may name them otherwise, and then keeps its chatter)
    patched = [(module, name, make(getattr(module, name))) for module, name, make in (
        (evaluator, "get_git_commit_hash", lambda _: (lambda: None)),
        (task_module, "tqdm", lambda bar: functools.partial(bar, disable=True))) if hasattr(module, name)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    bars = None
    try:
        from datasets.utils import logging as datasets_logging

        bars = datasets_logging.is_progress_bar_enabled()
        datasets_logging.disable_progress_bar()
    except (ImportError, AttributeError):  # (lm-eval needs datasets; an older one lacks the switch)
        datasets_logging = None
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        for module, name, value in patched:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if bars:
            datasets_logging.enable_progress_bar()


def run_tasks(runtime, tokenizer, tasks: Sequence[str], manager, limit: Optional[int], max_length: int,
              label: str) -> Dict[str, Dict[str, float]]:
    """``{task: {metric: value}}`` of lm-eval's ``tasks`` run by ``runtime`` (stderr figures left out, and what
    lm-eval keeps beside its ``metric,filter`` figures: ``sample_len``, a count of documents, is no metric)."""
    lm_eval, _, _ = _lm_eval()
    with _lm_eval_quieted():
        res = lm_eval.simple_evaluate(model=_adapter(runtime, tokenizer, max_length, label), tasks=list(tasks),
                                      task_manager=manager, limit=limit, bootstrap_iters=0, log_samples=False)
    out: Dict[str, Dict[str, float]] = {}
    for task, metrics in (res or {}).get("results", {}).items():
        out[task] = {m.split(",")[0]: float(v) for m, v in metrics.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and "," in m and "_stderr" not in m}
    return out


def side_by_side(per_model: Dict[str, Dict[str, Dict[str, float]]]) -> Dict[str, Any]:
    """``{task: {metric: {model: value}}}`` from ``{model: {task: {metric: value}}}``."""
    out: Dict[str, Any] = {}
    for model, results in per_model.items():
        for task, metrics in results.items():
            for metric, value in metrics.items():
                out.setdefault(task, {}).setdefault(metric, {})[model] = value
    return out
