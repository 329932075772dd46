"""Run the qtool CLI and SIGKILL this process right after a ``--sequential`` run has saved block K's state: the
hardest stop there is (no handler runs, nothing is cleaned up), at a chosen place. Under torchrun the rank that
is killed takes its launcher's other ranks down with it.

    python tests/stop_after_block.py K [RANK] -- calibrate ... --sequential

RANK (default 0): the rank that kills itself."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    args = sys.argv[1:]
    split = args.index("--")
    stop_after, rank = int(args[0]), int(args[1]) if split > 1 else 0
    from qtool.calibration import resume

    save = resume.ResumeState.save

    def save_then_die(self, i, result, hidden):
        save(self, i, result, hidden)
        if i + 1 == stop_after and self.group.rank == rank:
            self.wait()  # the block's files are written by a thread in one process
            os.kill(os.getpid(), signal.SIGKILL)

    resume.ResumeState.save = save_then_die
    from qtool.cli import main as cli

    sys.argv = ["qtool"] + args[split + 1:]
    cli()


if __name__ == "__main__":
    main()
