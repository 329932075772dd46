"""Progress callbacks a front end may set; the library calls them and never prints."""

from __future__ import annotations

__all__ = ["Hooks"]


class Hooks:
    """``on_plan(plan)``, ``on_batch(done, total, samples)``, ``on_tensor(done, total, name)``, ``on_stage(text)``,
    ``on_block(done, total)``; unset ones do nothing."""

    def __init__(self, on_plan=None, on_batch=None, on_tensor=None, on_stage=None, on_block=None):
        self.on_block = on_block
        self.on_plan = on_plan or (lambda plan: None)
        self.on_batch = on_batch
        self.on_tensor = on_tensor
        self.on_stage = on_stage or (lambda text: None)
