"""Progress callbacks a front end may set; the library calls them and never prints."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Optional

__all__ = ["Hooks", "reporting", "step", "step_progress"]


class Hooks:
    """``on_plan(plan)``, ``on_batch(done, total, samples)``, ``on_tensor(done, total, name)``, ``on_stage(text)``,
    ``on_block(done, total)``, ``on_step(step, done, total, item)`` (a long step deep in the library: the weights'
    range searches, GPTQ/AdaRound, ..., reported through :func:`step`); unset ones do nothing. Given as arguments,
    or as a subclass's methods (an argument wins). They only show progress: nothing a job decides (the format's
    admission of a plan, say) goes through them."""

    on_batch: Optional[Callable[..., None]] = None  # (None: not asked for; the library then skips its bookkeeping)
    on_tensor: Optional[Callable[..., None]] = None
    on_block: Optional[Callable[..., None]] = None
    on_step: Optional[Callable[..., None]] = None

    def __init__(self, on_plan=None, on_batch=None, on_tensor=None, on_stage=None, on_block=None, on_step=None):
        given = {"on_plan": on_plan, "on_batch": on_batch, "on_tensor": on_tensor, "on_stage": on_stage,
                 "on_block": on_block, "on_step": on_step}
        for name, callback in given.items():  # (as instance attributes they hid a subclass's own methods)
            if callback is not None:
                setattr(self, name, callback)

    def on_plan(self, plan) -> None:
        pass

    def on_stage(self, text: str) -> None:
        pass


_ACTIVE: "contextvars.ContextVar[Optional[Hooks]]" = contextvars.ContextVar("qtool_hooks", default=None)


@contextlib.contextmanager
def reporting(hooks: Optional[Hooks]) -> Iterator[None]:
    """While the block runs, :func:`step` reports to ``hooks`` (a job sets its own; the library's inner loops
    need not carry them through every call)."""
    token = _ACTIVE.set(hooks)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def step(name: str, done: int, total: int, item: str = "") -> None:
    """Progress of a long step (``name``: what it does, e.g. "searching weight ranges"; ``item``: what it is on)
    to the running job's hooks; nothing when there are none."""
    hooks = _ACTIVE.get()
    if hooks is not None and hooks.on_step is not None:
        hooks.on_step(name, done, total, item)


def step_progress(hooks: Optional["Hooks"], name: str) -> Optional[Callable[[int, int, str], None]]:
    """``progress(done, total, item)`` for a library function, reported as long step ``name`` to ``hooks``
    (a line every tenth with the time left where no bar is drawn), or None."""
    if hooks is None or hooks.on_step is None:
        return None
    return lambda done, total, item="": hooks.on_step(name, done, total, item)
