"""llama.cpp running a GGUF file, for tests and benchmarks: qtool's own runtime wrapper
(:class:`qtool.evaluation.llamacpp.LlamaCpp`), which ``qtool eval`` uses on GGUF artifacts."""

from qtool.evaluation.llamacpp import FORCE, LlamaCpp

__all__ = ["FORCE", "LlamaCpp"]
