"""Typed errors. The library raises these; only the CLI turns them into messages and exit codes."""

from typing import Optional


class QtoolError(Exception):
    """Base class for every error qtool reports as one line to the user."""

    exit_code = 3


class UsageError(QtoolError):
    """Bad input: a recipe, checkpoint, data file or flag that cannot be used (exit code 2)."""

    exit_code = 2


class ConfigError(UsageError):
    """A recipe that does not validate or does not fit the model. ``problems``: every problem found, one line each
    (the message is the first, with a count of the rest)."""

    def __init__(self, message: str, problems=None):
        super().__init__(message)
        self.problems = list(problems) if problems else [message]


class CheckpointError(UsageError):
    """A checkpoint that cannot be read, or that does not fit the model."""


class DataError(UsageError):
    """Calibration data that cannot be read or used."""


class EncodingsError(UsageError):
    """An encodings file that cannot be read or does not fit the model."""


class GateFailed(QtoolError):
    """A quality gate failed (exit code 1)."""

    exit_code = 1


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters for an error line: cut at a word with " ..." (another library's
    message that runs on), or, one unbroken word, at ``width``."""
    import textwrap

    short = textwrap.shorten(text, width, placeholder=" ...")
    return short if short.strip(" .") else text[:width]


def not_utf8(name: str) -> Optional[str]:
    """``name`` as it can be shown (U+FFFD for each byte the locale could not decode, kept as a surrogate) where
    it is not valid UTF-8, which the files qtool writes (JSON, safetensors) name paths in; else None."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return None


_OUT_OF_MEMORY = ("can't allocate memory", "Cannot allocate memory", "out of memory")


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` says the process ran out of memory (Python's MemoryError, torch's CPU allocator or an mmap
    failing with ENOMEM, CUDA's OutOfMemoryError): the machine's limit, not the data's fault nor qtool's bug."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in _OUT_OF_MEMORY)
