"""The qtool command line (Typer). Thin commands: parse flags, call the library, draw progress, pick exit codes.

Exit codes: 0 success, 1 a quality gate failed, 2 bad usage or bad input, 3 internal error, 4 a rank of a
distributed run was lost. Human output and progress go to stderr; ``--json`` prints one JSON object on stdout.
Under ``torchrun`` (``WORLD_SIZE`` > 1) rank 0 alone reports; another rank speaks only for its own failure.

:mod:`.core` holds the application and its error contract, :mod:`.options` the shared flags and the early checks,
:mod:`.output` what is drawn for people; the commands live in :mod:`.run` (calibrate, export, quantize),
:mod:`.measure` (report, eval, imatrix), :mod:`.files` (import-encodings, inspect) and :mod:`.recipes` (config
list/show/validate), each registering itself on ``app`` when imported here, in the order ``--help`` lists them.
"""

from . import run  # isort: skip  (commands register in the order --help lists them)
from . import measure  # isort: skip
from . import files  # isort: skip
from . import recipes  # isort: skip
from .core import app, main

__all__ = ["app", "main", "run", "measure", "files", "recipes"]
