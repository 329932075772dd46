"""The ``qtool`` command's entry point: signal handlers first, then the CLI.

Importing the CLI (typer, rich, every command) takes a few tenths of a second; a Ctrl-C or SIGTERM in that time
raised a traceback from inside an import, and ``--json`` printed nothing. Nothing has been read or written then.
"""

import os
import signal
import sys

_EXIT = {signal.SIGINT: ("SIGINT", 130), signal.SIGTERM: ("SIGTERM", 143), signal.SIGHUP: ("SIGHUP", 129)}


_HANDLING = []  # a signal's handler runs: a second one, run inside it, leaves the first one's exit standing


def _before_the_cli(signum, frame):
    if _HANDLING:
        return
    _HANDLING.append(signum)
    name, code = _EXIT[signum]
    if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("RANK", "0") != "0":
        os._exit(code)  # (torchrun stops every rank once one exits: rank 0 says why, and one JSON object is its)
    said = [(2, f"interrupted: {name}; nothing was written\n")]
    if "--json" in sys.argv[1:]:
        # (json.dumps' text, written out: importing json here met the CLI's own import of it half done, and a
        # traceback replaced the object)
        said.append((1, f'{{\n "ok": false,\n "exit_code": {code},\n "error": "{name}; nothing was written"\n}}\n'))
    for fd, text in said:  # (straight to the descriptors: a stdout that is closed, full or a broken pipe, met in
        try:               # the middle of an import, ends the process all the same)
            os.write(fd, text.encode("utf-8", "backslashreplace"))
        except OSError:
            pass
    os._exit(code)


def main() -> None:
    for signum in _EXIT:
        if signum == signal.SIGHUP and signal.getsignal(signum) is signal.SIG_IGN:
            continue  # (nohup: a run the user kept from the terminal's hangup stays kept)
        signal.signal(signum, _before_the_cli)
    from .cli import main as cli_main  # (installs the CLI's own handlers)

    try:
        cli_main()
    finally:
        # The interpreter's shutdown sets a signal whose handler is a Python function back to its default action,
        # and tearing torch down takes a few tenths of a second: a Ctrl-C or SIGTERM then (a second Ctrl-C after
        # an interrupt's report, say) killed the finished process, its exit code lost. Ignored by the kernel from
        # here on; only here, the process's own entry point (an in-process caller of qtool.cli.main keeps its
        # signals, and so do the children it starts later).
        for signum in _EXIT:
            signal.signal(signum, signal.SIG_IGN)
