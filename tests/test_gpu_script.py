"""bench/gpu.sh's steps start: every script it names imports and accepts the arguments it is given.

A lent GPU is scarce (minutes per session) and an earlier run lost two steps to a script that could not import
qtool. This runs each step as gpu.sh would, from the repository root with its PYTHONPATH, up to the end of argument
parsing (a script without arguments: up to the end of its imports), on the CPU, in one process; and every import
of qtool or of a bench module anywhere in the script (inside functions too) must resolve."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_SH = ROOT / "bench" / "gpu.sh"

# Runs each (script, argv) given as JSON on stdin; argparse stops right after parsing (an argument the script does
# not know fails, parse_known_args too). Prints one JSON line.
_DRIVER = r"""
import argparse, json, runpy, sys, traceback
class Parsed(BaseException):
    pass
parse = argparse.ArgumentParser.parse_known_args  # (parse_args calls it)
def parsed_then_stop(self, args=None, namespace=None):
    _, unknown = parse(self, args, namespace)
    if unknown:
        raise SystemExit(f"unknown arguments {unknown}")
    raise Parsed
argparse.ArgumentParser.parse_known_args = parsed_then_stop
import ast, importlib, os
def own_imports(script):
    # every import of qtool or of a bench module anywhere in the script (functions included: several import
    # inside main, after parsing), as (module, names) that must resolve
    bench = os.path.dirname(os.path.abspath(script))
    for node in ast.walk(ast.parse(open(script).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [(node.module, [a.name for a in node.names if a.name != "*"])]
        elif isinstance(node, ast.Import):
            mods = [(a.name, []) for a in node.names]
        else:
            continue
        for module, names in mods:
            top = module.split(".")[0]
            if top == "qtool" or os.path.isfile(os.path.join(bench, top + ".py")):
                yield module, names
results = {}
base_path = list(sys.path)
for script, argv, as_main in json.load(sys.stdin):
    sys.path[:] = [os.path.dirname(os.path.abspath(script))] + base_path
    try:
        for module, names in own_imports(script):
            m = importlib.import_module(module)
            for n in names:
                if not hasattr(m, n):
                    importlib.import_module(module + "." + n)  # a submodule, else ImportError
    except Exception as e:
        results[script + " " + " ".join(argv)] = f"import: {type(e).__name__}: {e}"
        continue
    sys.argv = [script] + argv
    sys.path[:] = base_path
    try:
        runpy.run_path(script, run_name="__main__" if as_main else "gpu_sh_step")
        results[script + " " + " ".join(argv)] = "ran to the end" if as_main else "ok"
    except Parsed:
        results[script + " " + " ".join(argv)] = "ok"
    except SystemExit as e:
        results[script + " " + " ".join(argv)] = f"exit {e.code}"
    except BaseException:
        results[script + " " + " ".join(argv)] = traceback.format_exc(limit=3)
print(json.dumps(results))
"""


def _steps():
    """(name, command words) of every ``step`` line of gpu.sh, continuation lines joined, ``$R`` expanded."""
    text = GPU_SH.read_text().replace("\\\n", " ")
    steps = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("step "):
            continue
        words = shlex.split(line.replace("$R", "bench/results"))
        name, words = words[1], words[3:]  # step NAME LIMIT COMMAND...
        assert words[0] == "$PY", line
        steps.append((name, words[1:]))
    return steps


def test_every_gpu_sh_step_imports_and_parses_its_arguments():
    steps = _steps()
    assert len(steps) >= 15
    jobs, pytest_steps = [], []
    for name, words in steps:
        if words[:2] == ["-m", "pytest"]:
            pytest_steps.append(words[2:])
            continue
        script, argv = words[0], words[1:]
        assert (ROOT / script).is_file(), f"{name}: {script} is missing"
        takes_arguments = "argparse" in (ROOT / script).read_text()
        assert argv == [] or takes_arguments, f"{name}: {script} takes no arguments"
        jobs.append((script, argv, takes_arguments))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # as gpu.sh sets it: qtool from this tree
    done = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(jobs), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    bad = {k: v for k, v in results.items() if v != "ok"}
    assert not bad, bad
    assert len(results) == len(jobs)

    # the CUDA tests step: its files exist and its -k selects tests in each
    for words in pytest_steps:
        files = [w for w in words if w.startswith("tests/")]
        assert files and all((ROOT / f).is_file() for f in files), words
        k = words[words.index("-k") + 1]
        collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                    *files, "-k", k], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert collected.returncode == 0, collected.stdout[-2000:]
        for f in files:
            assert re.search(rf"^{re.escape(f)}::", collected.stdout, re.M), f"{f}: -k {k!r} selects nothing"
