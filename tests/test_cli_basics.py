import subprocess
import sys

from typer.testing import CliRunner

from qtool import __version__
from qtool.cli import app


def test_version_and_help():
    runner = CliRunner()
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"qtool {__version__}"
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "calibrate" in r.output


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "qtool", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and __version__ in r.stdout

