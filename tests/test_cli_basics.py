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


def test_the_packages_lazy_names_are_listed():
    """load_calibrated loads on first use, and dir(qtool) (tab completion) did not list it."""
    import qtool

    assert "load_calibrated" in dir(qtool) and callable(qtool.load_calibrated)


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "qtool", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and __version__ in r.stdout



def test_help_lists_choices_and_examples_and_completion_is_on():
    from qtool.cli.options import _complete_recipe

    runner = CliRunner()
    root = runner.invoke(app, ["--help"]).stdout
    assert "--install-completion" in root
    for cmd in (["calibrate"], ["export"], ["quantize"], ["report"], ["inspect"], ["import-encodings"],
                ["config", "list"], ["config", "show"], ["config", "validate"]):
        text = runner.invoke(app, cmd + ["--help"]).stdout
        assert "Examples:" in text and f"qtool {' '.join(cmd)}" in text, cmd
    export = runner.invoke(app, ["export", "--help"]).stdout
    assert "[qtool|aimet|onnx|compressed-tensors|gguf]" in export and "[0.6.1|1.0.0|2.0.0]" in export
    assert "[int-quantized|pack-quantized]" in export and "[none|f32|f16]" in export
    assert set(_complete_recipe("w8a8")) == {"w8a8", "w8a8-dynamic", "w8a8-dynamic-rot", "w8a8-smoothquant"}
    import click
    import typer.main

    show = typer.main.get_command(app).commands["config"].commands["show"]  # (config show w8a<TAB> offered nothing)
    recipe = next(p for p in show.params if p.name == "recipe")
    assert {c.value for c in recipe.shell_complete(click.Context(show), "w8a8")} == set(_complete_recipe("w8a8"))


def test_packaging_metadata_gives_setuptools_nothing_to_warn_about():
    """`make setup` printed setuptools' `project.license` deprecation banner three times (a TOML-table license)."""
    import warnings
    from pathlib import Path

    import pytest

    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    repo = Path(__file__).resolve().parents[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(repo / "pyproject.toml"))
    assert [str(w.message).splitlines()[0] for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
    assert "recipes/*.yaml" in str(dist.package_data)  # the shipped recipes are package data


def test_the_plan_line_names_an_asymmetric_grid_unsigned():
    """W8A8's asymmetric activations read "int8" on the plan line, where inspect, the encodings and every exported
    file have them unsigned."""
    from qtool.cli.output import _plan_summary
    from qtool.config import load_recipe, resolve_plan
    from tests.tinymodels import mlp

    line = _plan_summary(resolve_plan(load_recipe("w8a8"), mlp()))
    assert "3 x input uint8 per_tensor; 3 x weight int8 per_channel" in line, line
    assert "3 x input int8 per_token dynamic" in _plan_summary(resolve_plan(load_recipe("w8a8-dynamic"), mlp()))


def test_an_error_about_a_path_holding_a_newline_is_one_line(tmp_path):
    """The one-error-line contract broke where the path held a newline ('error: nl/ou' then 't: already exists')."""
    from tests.helpers import run_cli

    odd = tmp_path / "a\nb"
    odd.mkdir()
    code, _, err = run_cli("calibrate", odd, "-c", "w8a8", "-o", tmp_path / "out")
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("loading")]
    assert code == 2 and lines == [f"error: {tmp_path}/a\\nb: a directory checkpoint needs config.json (a Hugging "
                                   "Face model directory)"], err


def test_a_failing_terminal_stderr_under_a_progress_bar_drops_the_line(monkeypatch):
    """Under a live progress bar rich puts a proxy in sys.stderr, whose rich_proxied_file the console then wrote to
    directly, past the wrapper that drops a write stderr refuses: a line raised through (review)."""
    import io

    from qtool.cli.core import err
    from qtool.cli.output import _Progress

    class Terminal(io.TextIOBase):
        broken = False
        encoding = "utf-8"

        def isatty(self):
            return True

        def fileno(self):
            raise io.UnsupportedOperation

        def write(self, s):
            if Terminal.broken:
                raise BlockingIOError(11, "Resource temporarily unavailable")
            return len(s)

    monkeypatch.setattr(sys, "stderr", Terminal())
    with _Progress(False):
        Terminal.broken = True
        try:
            err.print("calibrating: a line")  # (dropped, not raised)
        finally:
            Terminal.broken = False
