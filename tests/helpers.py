import re

from typer.testing import CliRunner

from qtool.cli import app

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_cli(*args):
    """Run the CLI in-process; returns (exit_code, stdout, stderr) with stderr stripped of colour codes."""
    runner = CliRunner()
    r = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.stdout, ANSI.sub("", r.stderr)


def error_lines(stderr: str):
    return [line for line in stderr.splitlines() if line.strip()]
