"""The Typer application and its contract: one ``error:`` line and an exit code for every failure (one JSON
object with ``--json``), signals that leave nothing half-written, and the consoles human output goes to."""

from __future__ import annotations

import codecs
import errno
import io
import json
import math
import os
import sys
import traceback
import warnings
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import typer

from .. import __version__
from ..io.fs import forget_published, published, resumable


_QUIET = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


@contextmanager
def _transformers_quieted() -> Iterator[None]:
    """The CLI draws its own progress: transformers' and the Hub's bars and warnings stay off its terminal while a
    command runs, and transformers' are as they were afterwards (a command called in-process: a notebook, a test
    runner; the Hub, if the command imported it, reads its setting once and keeps its bars off). A user's own
    TRANSFORMERS_VERBOSITY or HF_HUB_DISABLE_PROGRESS_BARS wins; transformers reads both when imported, and one
    imported already is told directly."""
    env = {k: os.environ.get(k) for k in _QUIET}
    for k, v in _QUIET.items():
        os.environ.setdefault(k, v)
    logging = _transformers_logging()
    before = None if logging is None else (logging.get_verbosity(), logging.is_progress_bar_enabled())
    if logging is not None:
        _quiet(logging)
    try:
        yield
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
        logging = _transformers_logging()
        with warnings.catch_warnings():  # (the Hub, imported under our default, says it cannot enable its bars)
            warnings.simplefilter("ignore")
            if logging is not None and before is not None:
                logging.set_verbosity(before[0])
                (logging.enable_progress_bar if before[1] else logging.disable_progress_bar)()
            elif logging is not None:  # imported by the command, under our defaults: as it imports without them
                if env["TRANSFORMERS_VERBOSITY"] is None:
                    logging.set_verbosity_warning()
                if env["HF_HUB_DISABLE_PROGRESS_BARS"] is None:
                    logging.enable_progress_bar()


def _transformers_logging():
    return sys.modules["transformers"].utils.logging if "transformers" in sys.modules else None


def _quiet(logging) -> None:
    if os.environ["TRANSFORMERS_VERBOSITY"] == "error":
        logging.set_verbosity_error()
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        logging.disable_progress_bar()


class _Group(typer.core.TyperGroup):
    """Click's own usage errors (an unknown option, a value out of range) follow the same contract as qtool's: one
    ``error:`` line naming where help is, exit 2, and one JSON object with --json."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            self._checked(argv, prog_name, complete_var, **extra)
        except _StdoutLost as e:
            # what the command prints (its --json object, a report's table) met a stdout that takes nothing: a
            # full disk, a closed descriptor; or a pipe whose reader left, which ends it as SIGPIPE ends a Unix
            # tool: silently, 128 + 13 (not 1, a failed gate's code)
            _OVER.append(True)
            _silence_stdout()
            if e.pipe:
                sys.exit(141)
            err.print(_one_line(f"error: stdout takes nothing more ({e}), so what the command prints there is lost; "
                                f"{_written()}"), markup=False)
            sys.exit(2)

    def _checked(self, argv, prog_name, complete_var, **extra):
        from ..errors import not_utf8

        for arg in argv:
            shown = not_utf8(arg)
            if shown is not None:
                message = _one_line(f"error: {shown}: not a valid UTF-8 name; the files qtool reads and writes "
                                    "(safetensors, JSON) name paths in UTF-8: rename it")
                err.print(message, markup=False)
                if "--json" in argv:
                    _emit_json({"ok": False, "exit_code": 2, "error": message.split(": ", 1)[-1]})
                sys.exit(2)
        with _transformers_quieted():
            self._run(argv, prog_name, complete_var, **extra)

    def _run(self, argv, prog_name, complete_var, **extra):
        forget_published()  # (an earlier command of this process, under a test runner)
        _SIGNALLED.clear()
        _SAID.clear()
        _EMITTED.clear()
        _HOLDING.clear()
        _HELD.clear()
        _OVER.clear()
        _EXTRA.clear()
        if sys.stdout is None and (not argv or {"--help", "--version", "--show-completion"} & set(argv)):
            raise _StdoutLost("stdout is closed")  # (click prints typer's help into a closed stdout silently)
        try:
            _take_signals()
            try:
                with _stdout_whole():
                    rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
            except OSError as e:
                # typer's own printing (--help, --version) into a stdout that takes nothing: a traceback before (a
                # command's own errors end inside it, in _errors; any other, a completion file it could not write,
                # stays what it is)
                if e.filename is None and _printing(e):
                    raise _StdoutLost(e.strerror or str(e)) from None
                err.print(_one_line(f"error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}"), markup=False)
                sys.exit(2)  # (the environment, as a command's own OSError is: a completion file it cannot write)
            except SystemExit as e:  # (typer's end of a broken pipe it met: exit 1, a failed gate's code)
                lost = e.__context__
                if e.code == 1 and isinstance(lost, OSError) and lost.errno == errno.EPIPE:
                    raise _StdoutLost("broken pipe", pipe=True) from None
                raise
            finally:
                _OVER.append(True)  # (what follows says how it ended: a signal from here on changes nothing)
        except typer.TyperException as e:  # typer's (vendored) click exceptions all derive from it
            if type(e).__name__ == "NoArgsIsHelpError" or not hasattr(e, "format_message"):
                e.show() if hasattr(e, "show") else err.print(f"interrupted: {_written()}", markup=False)
                sys.exit(getattr(e, "exit_code", 130))
            ctx = getattr(e, "ctx", None)
            what = "commands" if "No such command" in e.format_message() else "options"
            where = f" (`{ctx.command_path} --help` lists the {what})" if ctx is not None else ""
            message = f"error: {e.format_message()}{where}"
            if _rank() != 0 and _under_torchrun():  # every rank parses the same flags: rank 0 says it, once
                _let_rank_0_speak()
                sys.exit(e.exit_code)
            err.print(message, markup=False)
            if "--json" in argv:
                _emit_json({"ok": False, "exit_code": e.exit_code, "error": message.split(": ", 1)[-1]})
            sys.exit(e.exit_code)
        if _SIGNALLED and not _SAID:  # an interrupt outside the command's _errors (while its summary is printed)
            name = _SIGNALLED[-1]
            if _under_torchrun() and _rank() != 0:  # (rank 0 says it; stdout holds rank 0's one JSON object)
                sys.exit(_SIGNAL_EXIT[name])
            message = _one_line(f"interrupted: {name}; {_written()}")
            err.print(message, markup=False)
            if "--json" in argv and not _EMITTED:  # (stdout holds one JSON object: the summary, if it got out)
                _emit_json({"ok": False, "exit_code": _SIGNAL_EXIT[name], "error": message.split(": ", 1)[-1]})
            sys.exit(_SIGNAL_EXIT[name])
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


class _Stderr:
    """``sys.stderr`` (as it is at each write) where a write that fails is dropped: messages and progress are the
    run's account, not its outcome. A stderr that takes nothing (``2>/dev/full``, a full log disk, a terminal gone
    with SIGHUP) ended a healthy run with exit 1 and no JSON object, its progress line's failure blamed on the
    output directory."""

    @staticmethod
    def _stream():
        # (under a live progress bar rich puts a proxy in sys.stderr, which writes into this console again: the
        # stream beneath it)
        stream = sys.stderr
        return getattr(stream, "rich_proxied_file", stream)

    def write(self, text: str) -> int:
        try:
            return self._stream().write(text)
        except (OSError, ValueError, AttributeError):  # (ValueError: closed; AttributeError: None, with 2>&-)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream().flush()
        except (OSError, ValueError, AttributeError):
            pass

    def isatty(self) -> bool:
        try:
            return self._stream().isatty()
        except (OSError, ValueError, AttributeError):
            return False

    def __getattr__(self, name):  # (encoding, fileno, ...: rich asks)
        if name == "rich_proxied_file":  # (rich's console would write to what it names, past this wrapper)
            raise AttributeError(name)
        return getattr(self._stream(), name)


class _LazyConsole:
    """rich's stderr console, made on first use: importing rich costs ~50 ms of every command's start-up, and a
    quiet command that succeeds never prints."""

    _console = None

    def _get(self):
        if _LazyConsole._console is None:
            from rich.console import Console

            _LazyConsole._console = Console(file=_Stderr(), highlight=False, soft_wrap=True,
                                            no_color=bool(os.environ.get("NO_COLOR")),
                                            width=None if _columns() or "COLUMNS" not in os.environ else 80)
        return _LazyConsole._console

    def __getattr__(self, name):
        return getattr(self._get(), name)


err = _LazyConsole()


def _world_size() -> int:
    """The ranks a launcher such as torchrun started (1 when not distributed, or when WORLD_SIZE is no number: the
    process group's own check names it)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _rank() -> int:
    """This process's rank under a launcher such as torchrun (0 when not distributed)."""
    try:
        return int(os.environ.get("RANK", "0")) if _world_size() > 1 else 0
    except ValueError:
        return 0


def _one_process(command: str) -> None:
    """Refuse a launch on several ranks (torchrun) of a command that runs in one process: every rank would do the
    whole of it, write the same output (one then failing on "already exists") and print its own summary."""
    world = _world_size()
    if world > 1:
        from ..errors import UsageError

        raise UsageError(f"qtool {command} runs in one process (WORLD_SIZE={world}): run it without torchrun")


def _version(value: bool) -> None:
    if value:
        _write_stdout(f"qtool {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """qtool: quantize PyTorch models."""


_SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143, "SIGHUP": 129}
# the optional packages (pyproject's extras) a command imports when it needs them: their absence is one line
_EXTRAS = {"gguf": "'qtool[gguf]'", "matplotlib": "'qtool[report]'", "xllamacpp": "'qtool[llamacpp]'",
           "lm_eval": "'qtool[tasks]'", "transformers": "'qtool[hf]'", "huggingface_hub": "'qtool[hf]'",
           "onnxruntime": "onnxruntime", "compressed_tensors": "compressed-tensors"}


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the process is so outputs in progress are cleaned up like on Ctrl-C."""

    def __init__(self, name: str = "SIGTERM"):
        super().__init__()
        self.name = name


# the signals this process received: an interrupt that lands inside C code (a tensor conversion, say) can come out
# as another exception (torch turns it into "ValueError: could not determine the shape ..."); it is still an
# interrupt, and reads as one
_SIGNALLED: List[str] = []
_EMITTED: List[bool] = []  # a JSON object went to stdout (a command prints one at most)
_SAID: List[int] = []  # the exit codes a command's _errors has reported (said and, with --json, printed)
_OVER: List[bool] = []  # the command has returned or raised: its exit is being said, and a signal is ignored
_PROCESS: List[bool] = []  # the command runs as the process's own (main), which takes the signals
_EXTRA: List[str] = []  # signals after the first, while its cleanup and report run
_HOLDING: List[bool] = []  # the JSON object is being written: a signal waits (_HELD) until it is whole
_HELD: List[str] = []


@contextmanager
def _errors(debug: bool = False, json_out: bool = False) -> Iterator[None]:
    """Turn every failure into one stderr line and an exit code (and one JSON object with --json)."""
    from ..errors import QtoolError

    def fail(code: int, message: str, more=(), speak: bool = True, alike: bool = False) -> None:
        _SAID.append(code)
        lines = [_one_line(line) for line in (message, *more)]
        if alike and _rank() != 0 and (not _under_torchrun() or _let_rank_0_speak()):
            # rank 0 did not meet it (torchrun would have stopped this rank meanwhile: a data file missing on this
            # node only, its own environment), or no launcher stops the ranks: this rank says it
            lines, speak = [line.replace(": ", f": rank {_rank()}: ", 1) for line in lines], True
        for line in lines if speak else []:
            err.print(line, markup=False)
        if json_out and not _EMITTED:  # (only rank 0 has json_out under torchrun; it reports another rank's too)
            _emit_json({"ok": False, "exit_code": code, "error": message.split(": ", 1)[-1],
                        **({"errors": [m.split(": ", 1)[-1] for m in [message, *more]]} if more else {})})
        raise typer.Exit(code)

    # under torchrun an interrupt reaches every rank (a Ctrl-C, or torchrun stopping the others once one rank
    # failed, perhaps before this one met the same error): rank 0 says it
    quiet_interrupt = _under_torchrun() and _rank() != 0

    def interrupted() -> None:
        if _SIGNALLED:
            fail(_SIGNAL_EXIT[_SIGNALLED[-1]], f"interrupted: {_SIGNALLED[-1]}; {_written()}",
                 speak=not quiet_interrupt)

    try:
        yield
    except (typer.Exit, _StdoutLost):  # (the latter: said once, by the group, with what was written)
        raise
    except QtoolError as e:
        interrupted()
        # distributed: a rank that failed on its own says so (dist_rank); an error every rank meets alike (bad
        # flags, before the ranks connect) is said by rank 0; PeerFailed: another rank already said it
        dist_rank = getattr(e, "dist_rank", None)
        speak = not getattr(e, "quiet", False) and (dist_rank is not None or _rank() == 0)
        alike = dist_rank is None and not getattr(e, "quiet", False)
        where = f"rank {dist_rank}: " if dist_rank is not None else ""
        problems = getattr(e, "problems", None) or []
        if len(problems) > 1:  # every problem of a recipe, one line each
            fail(e.exit_code, f"error: {where}{problems[0]}", [f"error: {p}" for p in problems[1:]], speak, alike)
        said = str(e)
        if getattr(e, "outcome", None) == "nothing was written":  # (a lost rank: what a --sequential run kept)
            said = said[:-len(e.outcome)] + _written()
        fail(e.exit_code, f"error: {where}{said}", speak=speak, alike=alike)
    except KeyboardInterrupt as e:
        name = e.name if isinstance(e, _Terminated) else "SIGINT"
        fail(_SIGNAL_EXIT[name], f"interrupted: {name}; {_written()}", speak=not quiet_interrupt)
    except OSError as e:  # a full disk, a read-only directory, a path that vanished: the environment, not a bug
        interrupted()
        if e.errno == errno.ENOMEM:  # (an mmap of the weights failing)
            fail(2, f"error: out of memory ({e.filename + ': ' if e.filename else ''}{e.strerror or e}): "
                    f"{_LESS_MEMORY} ({_written()})")
        dist_rank = getattr(e, "dist_rank", None)
        where = (f"rank {dist_rank}: " if dist_rank is not None else "") + (f"{e.filename}: " if e.filename else "")
        fail(2, f"error: {where}{e.strerror or e} ({_written()})")  # (every rank says its own: a rank's own disk)
    except Exception as e:  # an internal error: one line, the traceback in a log file
        interrupted()
        from ..errors import cut, out_of_memory

        if out_of_memory(e):  # (the machine's limit, not a bug: exit 2, as a full disk is)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            fail(2, f"error: out of memory ({cut(first, 160)}): {_LESS_MEMORY} ({_written()})")
        # an optional package not installed: the environment, not a bug (the package itself missing: not a name
        # it lacks, nor one of its modules, which say another version)
        extra = _EXTRAS.get(getattr(e, "name", None) or "") if isinstance(e, ModuleNotFoundError) else None
        if extra is not None:
            fail(2, f"error: this needs the optional package {e.name}: pip install {extra} ({_written()})")
        import tempfile

        with tempfile.NamedTemporaryFile("w", prefix="qtool-error-", suffix=".log", delete=False) as log:
            traceback.print_exc(file=log)
        if debug:  # (through the wrapper: a stderr that takes nothing changes no outcome)
            traceback.print_exc(file=_Stderr())
        first = str(e).splitlines()[0] if str(e) else ""
        fail(3, f"internal error: {type(e).__name__}: {first} (traceback in {log.name}; --debug shows it)")


def _under_torchrun() -> bool:
    """Launched by torchrun (its agent sets TORCHELASTIC_RUN_ID), which stops every rank once one exits non-zero; a
    RANK inherited from elsewhere, or ranks launched by hand, are not."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _let_rank_0_speak(seconds: float = 10.0) -> bool:
    """A rank other than 0 that met an error every rank meets alike (rank 0 says it) waits a little before it
    exits: torchrun stops every rank once one exits non-zero, and rank 0 stopped before it printed would leave the
    run with no line saying what was wrong. Its own SIGTERM from torchrun ends the wait quietly (False); True: the
    wait ran out, so rank 0 did not meet the error."""
    import time

    over = list(_OVER)
    try:
        _OVER.clear()  # (torchrun's SIGTERM must end the wait, after the command too: a usage error's)
        time.sleep(seconds)
    except KeyboardInterrupt:
        return False
    finally:
        _OVER[:] = over
    return True


def _one_line(text: str) -> str:
    """An error line as one line: a path holding a newline split it in two (the newline written as ``\\n``)."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _written() -> str:
    """What an interrupt leaves: nothing, or the outputs already put in place whole (an interrupt that lands after
    the output directory's rename, while the summary is printed)."""
    done, kept = published(), resumable()
    if not done:
        return "nothing was written" + "".join(
            f"; {k} keeps the blocks finished so far: the same command with --resume continues" for k in kept)
    return f"{', '.join(str(p) for p in done)} had been written in full before it"


def Table(*args, **kwargs):
    """rich's Table, imported when a command draws one."""
    from rich.table import Table as _Table

    return _Table(*args, **kwargs)


# what to change when the machine's memory runs out, whatever the command
_LESS_MEMORY = ("fewer or smaller batches (the command's --batch-size or --num-samples, where it has them), "
                "--sequential for calibrate and quantize (one decoder block at a time), or a machine with more memory")


def _columns() -> bool:
    """Whether COLUMNS gives a usable width (rich takes COLUMNS=0 as a width of 0 and prints nothing at all)."""
    value = os.environ.get("COLUMNS", "")
    return value.isdigit() and int(value) > 0


def _console():
    """A console for stdout tables and text (no highlighting; NO_COLOR respected). Not a terminal (a pipe, a CI
    log): as wide as its lines (rich's 80 columns split module names, which grep then misses), unless COLUMNS
    says otherwise."""
    from rich.console import Console

    if sys.stdout is None:  # (started with stdout closed)
        raise _StdoutLost("stdout is closed")
    wide = None if sys.stdout.isatty() or _columns() else 1000
    return Console(file=_WholeStdout(_stdout()), highlight=False, no_color=bool(os.environ.get("NO_COLOR")), width=wide)


def _esc(text: str) -> str:
    from rich.markup import escape

    return escape(str(text))


def _emit_json(obj: Dict[str, Any]) -> None:
    """One JSON object on stdout; a float that is not finite is written as "nan", "inf" or "-inf" (JSON has no
    such numbers, and strict parsers refuse the bare tokens). ``_StdoutLost`` where stdout takes nothing."""
    text = json.dumps(_json_safe(obj), indent=1, default=str) + "\n"
    # a signal while the object is written waits for its last byte: raised in the middle (a slow reader, a full
    # pipe), it left 64 KiB of the object and no other
    _HOLDING.append(True)
    try:
        _EMITTED.append(True)  # (after the text is made: an interrupt while it was made left no object at all)
        _write_stdout(text)
    finally:
        held, _HELD[:] = _HELD[:1], []
        _HOLDING.clear()
    _raise_held(held)


def _hold(name: str) -> None:
    """A signal while the JSON object is written: the first is kept for when it is whole, a second is ignored, a
    third ends the process at once (a reader that never reads: nothing else would stop it), as :func:`_again`."""
    _HELD.append(name)
    if len(_HELD) >= 3:
        _stop_now(name, _HELD[0])


def _raise_held(held: List[str]) -> None:
    """The first signal held while the JSON object was written, raised now as its handler would have (unless an
    error's report already said how the command ends)."""
    if held and not _SAID and not _OVER and not _again(held[0]):
        _SIGNALLED.append(held[0])
        raise KeyboardInterrupt() if held[0] == "SIGINT" else _Terminated(held[0])


def _write_stdout(text: str) -> None:
    """``text`` on stdout, flushed; ``_StdoutLost`` where stdout takes nothing (typer turns a broken pipe it meets
    itself into a silent exit 1, a failed gate's code)."""
    _write_to(_stdout(), text)


def _write_to(stream, text: str) -> None:
    """``text`` on ``stream`` (stdout, or what sys.stdout wraps), flushed: through its descriptor where it is the
    process's own file, every byte accounted for; ``_StdoutLost`` where it takes nothing."""
    if stream is None:  # (started with stdout closed)
        raise _StdoutLost("stdout is closed")
    try:
        fd = _stdout_fd(stream)
        if fd is not None:  # (a real descriptor: every byte accounted for)
            stream.flush()
            _write_all(fd, _encoder(stream).encode(text))
            return
        try:
            stream.write(text)
        except UnicodeEncodeError:
            encoding = stream.encoding or "ascii"
            stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        stream.flush()
    except (OSError, ValueError) as e:  # (ValueError: a file object closed under us)
        raise _StdoutLost(getattr(e, "strerror", None) or str(e), isinstance(e, BrokenPipeError)) from None


_ENCODERS: Dict[int, Any] = {}


def _encoder(stream):
    """``stream``'s encoding as one incremental encoder (a BOM, UTF-16's, written once); a character it lacks
    escaped, as Python's own stderr writes them."""
    key = id(stream)
    if key not in _ENCODERS:
        _ENCODERS.clear()
        _ENCODERS[key] = codecs.getincrementalencoder(stream.encoding or "utf-8")("backslashreplace")
    return _ENCODERS[key]


def _printing(err: OSError) -> bool:
    """Whether ``err`` was raised by a write or flush of a stream (click's echo, rich's console): typer printing
    help or a version into a stdout that takes nothing, not a file it could not write (a completion script)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_name in ("echo", "write", "flush", "_check_buffer",
                                                             "_write_buffer", "print")


def _stdout():
    """The stream sys.stdout writes to (None where the process started with it closed)."""
    return sys.stdout._stream if isinstance(sys.stdout, _WholeStdout) else sys.stdout


def _stdout_fd(stream=None):
    """stdout's (or ``stream``'s) descriptor where it is the process's own file (None under a test runner's
    capture)."""
    stream = _stdout() if stream is None else stream
    try:
        return stream.fileno() if isinstance(stream, io.TextIOWrapper) else None
    except (OSError, ValueError):
        return None


class _WholeStdout:
    """``stream`` (stdout) with each write going out through :func:`_write_to`, every byte accounted for; the
    rest is the stream's own. rich's tables print to one, and sys.stdout is one while a command runs where stdout
    is the process's own file: what typer (its help, completion scripts) and other libraries print there (Python's
    buffered stdout dropped the rest of a write cut short by a file-size limit: exit 0, help cut at 1 KiB)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        _write_to(self._stream, text)  # (not sys.stdout again: a wrapper over this one would go round)
        return len(text)

    def flush(self) -> None:
        pass  # (each write is flushed)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextmanager
def _stdout_whole() -> Iterator[None]:
    stream = sys.stdout
    if isinstance(stream, _WholeStdout) or _stdout_fd() is None:  # (a test runner's capture, or no stdout)
        yield
        return
    sys.stdout = _WholeStdout(stream)
    try:
        yield
    finally:
        if isinstance(sys.stdout, _WholeStdout):  # (a command that replaced it keeps its own)
            sys.stdout = stream


def _write_all(fd: int, data: bytes) -> None:
    """Every byte of ``data`` to ``fd``: a file-size limit or a disk filling up takes part of a write, and Python's
    buffered stdout then dropped the rest without an error (exit 0, a JSON object cut short in the file)."""
    import select

    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:  # (a non-blocking stdout whose reader is slow: wait until it takes more)
            select.select([], [fd], [])
            continue
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


class _StdoutLost(Exception):
    """stdout could not take what the command prints there (its JSON object, a table); ``pipe``: its reader left
    (``qtool ... | head``)."""

    def __init__(self, reason: str, pipe: bool = False):
        super().__init__(reason)
        self.pipe = pipe


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so what is still buffered does not fail again as the interpreter exits."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.__stdout__.fileno() if sys.__stdout__ is not None else 1)
        os.close(fd)
    except (OSError, ValueError):
        pass
    sys.stdout = open(os.devnull, "w")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _torch_importing() -> bool:
    """Whether torch itself is being imported (a command's first import of it, before any output exists): its C++
    start-up calls back into Python (torch.distributed's _c10d_init), and an exception raised there cannot leave
    the C++ frames (the process aborts: SIGABRT, a page of C++ frames). A submodule imported later (torch.onnx,
    torch._dynamo) raises as anywhere else: a temporary output may exist then (review)."""
    return bool(getattr(getattr(sys.modules.get("torch"), "__spec__", None), "_initializing", False))


def _end_while_torch_imports(name: str) -> None:
    """A signal while torch is imported ends the process at once, as one before the CLI does (entry): every command
    imports torch before it reads a weight or writes a file, so nothing was written."""
    code = _SIGNAL_EXIT[name]
    if _under_torchrun() and _rank() != 0:
        os._exit(code)  # (rank 0 says it)
    said = [(2, f"interrupted: {name}; nothing was written\n")]
    if "--json" in sys.argv[1:] and not _EMITTED:  # (the process's own command: its handlers are installed)
        said.append((1, json.dumps({"ok": False, "exit_code": code, "error": f"{name}; nothing was written"},
                                   indent=1) + "\n"))
    for fd, text in said:
        try:
            os.write(fd, text.encode())
        except OSError:
            pass
    os._exit(code)


def _terminate(signum, frame):
    import signal

    name = "SIGHUP" if signum == signal.SIGHUP else "SIGTERM"
    if _HOLDING:
        return _hold(name)
    # (once the command is over, raised now it would replace the command's exit with a traceback; after an earlier
    # signal, it would stop that one's cleanup and its report: a temporary output left behind, no JSON object)
    if _OVER or _again(name):
        return
    if _torch_importing():
        _end_while_torch_imports(name)
    _SIGNALLED.append(name)
    raise _Terminated(name)


def _interrupt(signum, frame):
    if _HOLDING:
        return _hold("SIGINT")
    if _OVER or _again("SIGINT"):  # (a second Ctrl-C while the first one's cleanup runs: the first one ends it)
        return
    if _torch_importing():
        _end_while_torch_imports("SIGINT")
    _SIGNALLED.append("SIGINT")
    raise KeyboardInterrupt()


def _again(name: str) -> bool:
    """Whether a signal came after the first one (whose cleanup and report are running): the second is ignored;
    a third ends the process at once, as a user pressing Ctrl-C again means (a cleanup that hangs, or an interrupt
    a library swallowed), with the first one's exit code; the next run removes the temporaries it leaves."""
    if not _SIGNALLED:
        return False
    _EXTRA.append(name)
    if len(_EXTRA) >= 2:
        _stop_now(name, _SIGNALLED[0])
    return True


def _stop_now(name: str, first: str) -> None:
    """End the process at once on signal ``name``, with signal ``first``'s exit code."""
    try:
        os.write(2, f"interrupted again: {name}; stopping now (the next run removes what this one left)\n".encode())
    except OSError:
        pass
    os._exit(_SIGNAL_EXIT[first])


def _ignored(signum, frame) -> None:
    """SIGINT's and SIGTERM's handler once the command is over: nothing (SIG_IGN itself would make one that
    another thread had already caught print "Signal 15 ignored due to race condition")."""


def _ignore_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP do nothing from here on. ``_OVER`` first: from then the installed handlers do
    nothing, so one that lands while they are replaced cannot raise (a traceback and exit 1 after a finished
    command)."""
    import signal

    _OVER.append(True)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _ignored)


def _take_signals() -> None:
    """The command's handlers: a signal raises where the process is, and the command's cleanup and report follow.
    Installed where the group's own reporting begins (before it, entry's handlers end the process: nothing has
    started; a signal raised in typer's set-up was a traceback and exit 1), and only by the process's own command
    (:func:`main`): an in-process caller's (a test runner's) handlers stay its own."""
    import signal

    if not _PROCESS:
        return

    signal.signal(signal.SIGTERM, _terminate)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # (nohup's: the run outlives the terminal)
        signal.signal(signal.SIGHUP, _terminate)
    signal.signal(signal.SIGINT, _interrupt)


def main() -> None:
    import gc

    # Start-up imports torch (and transformers for a Hugging Face model): hundreds of thousands of objects that
    # are never garbage, which the default threshold (a collection every 700 new objects) scans again and
    # again, a tenth of a second or more per command. Collections stay on, a hundred times less often.
    gc.set_threshold(70_000, 10, 10)
    # pydantic looks for plugins (observability hooks) in every installed package's entry points the first time
    # it builds a validator: ~25 ms per command for a feature the CLI's own recipe schema has no use for. A user's
    # explicit setting wins; the library (import qtool) is left alone.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    _OVER.clear()  # (an earlier main() of this process left it set)
    _PROCESS.append(True)
    try:
        app()
    finally:
        # the command is over (its outputs closed and in place, its exit code chosen): a signal now would only
        # interrupt the interpreter's exit, with a traceback from whatever atexit handler it lands in
        _ignore_signals()
        # An interrupt raised inside code run from a string (exec/eval: a dataclass's generated methods while torch
        # imports) leaves CPython's "KeyboardInterrupt unhandled" mark set although qtool handled it, and the
        # interpreter then ends itself by SIGINT (-2) instead of with the exit code the command chose; every exec of
        # a string clears that mark as it starts (CPython 3.10-3.13; later versions no longer set it from nested
        # code, and this does nothing).
        exec("")
        # On exit the interpreter searches everything still alive for reference cycles, several times over, to
        # free memory the operating system takes back anyway: ~0.4 s per command once torch is loaded. Frozen
        # objects are skipped. By now every output is closed and renamed into place, and what cleans up at exit
        # (atexit handlers, weakref finalizers such as the spill directory's) still runs.
        gc.freeze()
