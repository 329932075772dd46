"""qtool as a CI pipeline runs it: separate processes, real signals, stdout/stderr contracts, exit codes."""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.tinymodels import mlp

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def qtool(*args, env=None, **kw):
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "qtool", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=full_env, timeout=300, **kw)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("proc")
    ckpt = d / "mlp.safetensors"
    save_file(mlp().state_dict(), ckpt)
    data = d / "data.safetensors"
    save_file({"x": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}, data)
    return d, ckpt, data


def test_same_inputs_same_bytes_across_processes(world, tmp_path):
    d, ckpt, data = world
    outs = []
    for name in ("a", "b"):
        r = qtool("quantize", ckpt, "-c", CONFIGS / "w4a8-block32.yaml", "--data", data, "--num-samples", "40",
                  "--seed", "7", "--model-class", "tests.tinymodels:mlp", "-o", tmp_path / name)
        assert r.returncode == 0, r.stderr
        outs.append({p.relative_to(tmp_path / name).as_posix(): p.read_bytes()
                     for p in sorted((tmp_path / name).rglob("*")) if p.is_file()})
    assert outs[0] == outs[1]
    manifest = json.loads(outs[0]["manifest.json"])
    assert manifest["outputs"]["model.safetensors"] == __import__("hashlib").sha256(outs[0]["model.safetensors"]).hexdigest()
    calib = json.loads(outs[0]["calibration/manifest.json"])
    assert calib["device"] == "cpu" and calib["versions"]["qtool"]
    assert set(calib["inputs"]["data"]["sha256"]) == {str(data)}


def test_json_prints_exactly_one_object_on_stdout(world, tmp_path):
    d, ckpt, data = world
    r = qtool("calibrate", ckpt, "-c", CONFIGS / "w8a8.yaml", "--data", data, "--model-class",
              "tests.tinymodels:mlp", "-o", tmp_path / "r", "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)  # the whole of stdout is one JSON document
    assert obj["ok"] is True and obj["quantizers"] == 6
    assert "plan:" in r.stderr and "\x1b[" not in r.stderr  # not a terminal: no colour, no progress bar
    # failures too: one JSON object on stdout, one line on stderr
    r = qtool("calibrate", ckpt, "-c", CONFIGS / "w8a8.yaml", "--model-class", "tests.tinymodels:mlp",
              "-o", tmp_path / "r2", "--json", "--quiet")
    assert r.returncode == 2
    obj = json.loads(r.stdout)
    assert obj == {"ok": False, "exit_code": 2, "error": obj["error"]} and "pass --data" in obj["error"]
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_stdout_that_takes_nothing_is_one_line_and_exit_2(world, tmp_path):
    """--json > /dev/full (a full disk), or stdout closed: a traceback and exit 1, a failed gate's code."""
    d, ckpt, data = world
    args = ("calibrate", ckpt, "--model-class", "tests.tinymodels:mlp", "-c", "w8a8", "--data", data, "-o",
            tmp_path / "r", "--json")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(*a, **kw):
        return subprocess.run([sys.executable, "-m", "qtool", *map(str, a)], stderr=subprocess.PIPE, text=True,
                              cwd=REPO, env=env, timeout=300, **kw)

    with open("/dev/full", "w") as full:
        r = run(*args, stdout=full)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == (f"error: stdout takes nothing more (No space left on device), so what the "
                                         f"command prints there is lost; {tmp_path / 'r'} had been written in full "
                                         "before it")
    for cmd in (("config", "list"), ("config", "list", "--json")):  # (a table, and a JSON object, on a closed stdout)
        r = run(*cmd, preexec_fn=lambda: os.close(1))
        assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
            "error: stdout takes nothing more (stdout is closed), so what the command prints there is lost; nothing "
            "was written"), r.stderr
        read, write = os.pipe()  # a pipe whose reader left (qtool ... | head): typer made it exit 1, a gate's code
        os.close(read)
        try:
            r = run(*cmd, stdout=write)
        finally:
            os.close(write)
        assert r.returncode == 141 and not r.stderr.strip(), r.stderr  # (as SIGPIPE ends a Unix tool)
    import resource

    for cmd in (("config", "list", "--json"), ("config", "list")):  # a file-size limit takes part of a write: Python's
        with open(tmp_path / "cut.json", "w") as cut:                # buffered stdout dropped the rest, exit 0
            r = run(*cmd, stdout=cut, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024)))
        assert r.returncode == 2 and r.stderr.splitlines() == [
            "error: stdout takes nothing more (File too large), so what the command prints there is lost; nothing "
            "was written"], (cmd, r.stderr)
    for cmd in (("--help",), ("--version",), ("config", "--help")):  # typer's own printing: a traceback (full),
        with open("/dev/full", "w") as full:                          # exit 1 (broken pipe)
            r = run(*cmd, stdout=full)
        assert r.returncode == 2 and r.stderr.splitlines() == [
            "error: stdout takes nothing more (No space left on device), so what the command prints there is lost; "
            "nothing was written"], (cmd, r.stderr)
        read, write = os.pipe()
        os.close(read)
        try:
            r = run(*cmd, stdout=write)
        finally:
            os.close(write)
        assert r.returncode == 141 and not r.stderr.strip(), (cmd, r.stderr)
    for cmd in (("--help",), ("export", "--help")):  # more than 1 KiB of help under a 1 KiB file-size limit, and a
        for fsize in (True, False):                   # closed stdout: exit 0, the help cut short or printed nowhere
            with open(tmp_path / "cut.txt", "w") as cut:
                r = run(*cmd, stdout=cut, preexec_fn=(
                    (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))) if fsize else
                    (lambda: os.close(1))))
            reason = "File too large" if fsize else "stdout is closed"
            assert r.returncode == 2 and r.stderr.splitlines() == [
                f"error: stdout takes nothing more ({reason}), so what the command prints there is lost; nothing "
                "was written"], (cmd, fsize, r.stderr)
    r = run("--version", preexec_fn=lambda: os.close(1))
    assert r.returncode == 2 and "(stdout is closed)" in r.stderr, r.stderr
    assert run("--help", stdout=subprocess.PIPE).stdout.startswith("Usage: ")  # (and in full where it fits)
    assert run("--version", stdout=subprocess.PIPE).stdout.startswith("qtool ")


def test_a_wrapper_over_stdout_during_a_command_does_not_go_round(tmp_path):
    """While a command runs, sys.stdout writes through the descriptor; a wrapper a library puts over it (a tee)
    forwards its writes there, and the command's own JSON went wrapper -> stdout -> wrapper ... (RecursionError)."""
    script = ("import sys\nfrom qtool.cli import core\n"
              "class Tee:\n    def __init__(s, f): s.f = f\n    def write(s, t): return s.f.write(t)\n"
              "    def flush(s): s.f.flush()\n"
              "with core._stdout_whole():\n    sys.stdout = Tee(sys.stdout)\n    core._emit_json({'ok': True})\n")
    with open(tmp_path / "out.json", "w") as out:
        r = subprocess.run([sys.executable, "-c", script], stdout=out, stderr=subprocess.PIPE, text=True, cwd=REPO,
                           timeout=120)
    assert r.returncode == 0 and not r.stderr, r.stderr[-500:]
    assert json.loads((tmp_path / "out.json").read_text()) == {"ok": True}


def test_quiet_prints_nothing_on_success(world, tmp_path):
    d, ckpt, data = world
    r = qtool("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "--model-class", "tests.tinymodels:mlp",
              "-o", tmp_path / "r", "--quiet")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""


def test_quiet_prints_nothing_for_a_hugging_face_model_either(tmp_path):
    """transformers and the Hub are loaded by the command: a warning of theirs (the Hub's "cannot enable progress
    bars" when the command's quieting was undone) broke --quiet and the one-line error."""
    pytest.importorskip("transformers")
    from tests.helpers import tiny_llama

    ckpt = tiny_llama(tmp_path / "m")
    r = qtool("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "r", "--quiet")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stderr
    r = qtool("calibrate", ckpt, "-c", CONFIGS / "w8a8.yaml", "-o", tmp_path / "r2", "--quiet")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr


def test_a_damaged_torch_export_archive_is_one_line_on_stderr(world, tmp_path):
    """torch logged its own traceback of the failed read (a dozen lines) before qtool's error, --quiet or not."""
    d, ckpt, data = world
    (tmp_path / "junk.pt2").write_bytes(b"junk\n")
    r = qtool("calibrate", tmp_path / "junk.pt2", "-c", CONFIGS / "w8a16.yaml", "-o", tmp_path / "r", "--quiet")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"error: {tmp_path / 'junk.pt2'}: cannot read torch.export archive: File is "
                                     "not a zip file"], r.stderr


def _calibrate_under(probe: str, ckpt, out, *flags):
    """``qtool calibrate`` (w8a16 on the MLP) run by the Python program ``probe``, which calls main()."""
    return subprocess.run([sys.executable, "-c", probe, "calibrate", str(ckpt), "-c", str(CONFIGS / "w8a16.yaml"),
                           "--model-class", "tests.tinymodels:mlp", "-o", str(out), *flags],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          timeout=300)


def test_the_collector_is_skipped_at_exit_and_cleanup_still_runs(world, tmp_path):
    """main() freezes what is alive when the command ends, so the interpreter's full collections at exit (~0.4 s
    with torch loaded) skip it; what cleans up at exit still does: a spill directory held only by a reference cycle
    is removed, and a --json object printed last reaches stdout whole."""
    d, ckpt, data = world
    probe = ("import atexit, gc, sys, torch\nfrom qtool.cli import main\nfrom qtool.io.spill import SpilledTensors\n"
             "s = SpilledTensors(); s['t'] = torch.ones(3); s.me = s\n"  # a cycle: only a collection would free it
             "print(s.directory, file=sys.stderr)\ndel s\n"
             "atexit.register(lambda: print('frozen:', gc.get_freeze_count() > 0, file=sys.stderr))\n"
             "sys.argv = ['qtool'] + sys.argv[1:]\nmain()\n")
    r = _calibrate_under(probe, ckpt, tmp_path / "r", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True
    lines = r.stderr.splitlines()
    spill = Path(lines[0])
    assert spill.name.startswith("qtool-spill-") and not spill.exists()
    assert "frozen: True" in lines


def test_internal_error_is_one_line_with_a_log(world, tmp_path):
    d, ckpt, data = world
    r = qtool("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "--model-class", "tests.tinymodels_slow:broken",
              "-o", tmp_path / "r", "--quiet")
    assert r.returncode == 3
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("internal error: KeyError:")
    log = Path(lines[0].split("traceback in ", 1)[1].split(";", 1)[0])
    assert "Traceback" in log.read_text() and "deliberately missing key" in log.read_text()
    r = qtool("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "--model-class", "tests.tinymodels_slow:broken",
              "-o", tmp_path / "r", "--debug")
    assert r.returncode == 3 and "Traceback (most recent call last)" in r.stderr
    assert not (tmp_path / "r").exists()


def _slow_calibration_under_way(world, out, hangup, model_class="tests.tinymodels_slow:slow"):
    """``qtool calibrate`` of the slow MLP into ``out`` as a process of its own, with SIGHUP set to ``hangup`` in it,
    returned once its temporary output exists and a couple of slow batches have run."""
    d, ckpt, data = world
    proc = subprocess.Popen(
        [sys.executable, "-m", "qtool", "calibrate", str(ckpt), "-c", str(CONFIGS / "w8a8.yaml"), "--data", str(data),
         "--batch-size", "4", "--model-class", model_class, "-o", str(out)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup))
    deadline = time.time() + 120
    while time.time() < deadline and not any(p.name.startswith(f".{out.name}.tmp-") for p in out.parent.iterdir()):
        time.sleep(0.05)
    assert any(p.name.startswith(f".{out.name}.tmp-") for p in out.parent.iterdir()), "calibration never started"
    time.sleep(1.0)  # a couple of slow batches in
    return proc


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_signal_mid_calibration_leaves_nothing(world, tmp_path, sig, code):
    """SIGHUP (the terminal closed, an ssh session dropped) killed the run as SIGKILL does: no line, the temporary
    output left behind. (SIGHUP is set to its default in the child: a test run under nohup hands it on ignored,
    which qtool keeps.)"""
    proc = _slow_calibration_under_way(world, tmp_path / "r", hangup=signal.SIG_DFL)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    assert stderr.strip().splitlines()[-1].startswith("interrupted: ")
    assert list(tmp_path.iterdir()) == []  # no output, no temp litter


def test_an_interrupt_inside_code_run_from_a_string_keeps_its_exit_code(world, tmp_path):
    """A Ctrl-C that lands in code run by exec or eval (a dataclass's generated methods, ~0.6-0.9 s into a run while
    torch imports) set CPython's "KeyboardInterrupt unhandled" mark: qtool said "interrupted" and chose 130, and the
    interpreter then ended itself by SIGINT (-2), a flaky CI failure. The model waits inside exec, so it always
    lands there (a file it touches as its wait begins says when; review: without it the signal often landed
    elsewhere)."""
    d, ckpt, data = world
    mark = tmp_path / "mark"
    proc = subprocess.Popen(
        [sys.executable, "-m", "qtool", "calibrate", str(ckpt), "-c", str(CONFIGS / "w8a8.yaml"), "--data", str(data),
         "--batch-size", "4", "--model-class", "tests.tinymodels_slow:slow_from_a_string", "-o", str(tmp_path / "r")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "QTOOL_TEST_MARK": str(mark)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not mark.exists():
        time.sleep(0.01)
    mark.unlink()
    time.sleep(0.1)  # (inside the half-second wait run from the string)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "interrupted: SIGINT; nothing was written"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_while_the_interpreter_shuts_down_leaves_the_exit_code(world, tmp_path, sig):
    """The interpreter's shutdown set a signal with a Python handler back to its default action, and torch's
    teardown takes a few tenths of a second: a signal then (a second Ctrl-C after an interrupt's report, a
    scheduler's SIGTERM as the run ends) killed the finished process, -15 or -2 in place of 0."""
    d, ckpt, _ = world
    probe = ("import atexit, os, subprocess, sys\nimport qtool.entry\n"
             "delays = [0.0, 0.05, 0.1, 0.2]\n"  # (a killer per delay, started as the interpreter begins to exit)
             f"atexit.register(lambda: [subprocess.Popen(['sh', '-c', f'sleep {{t}}; kill -{sig[3:]} {{os.getpid()}} "
             "2>/dev/null']) for t in delays])\n"
             "sys.argv = ['qtool'] + sys.argv[1:]\nqtool.entry.main()\n")
    r = subprocess.run([sys.executable, "-c", probe, "calibrate", str(ckpt), "-c", str(CONFIGS / "w8a16.yaml"),
                        "--model-class", "tests.tinymodels:mlp", "-o", str(tmp_path / "r"), "--json"],
                       capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True


SIGNAL_INSIDE_TORCHS_CPP_START_UP = """
import os, signal, sys
import qtool.entry
state = {"in": False, "sent": False}


def profile(frame, event, arg):  # the signal as Python code called back from torch._C._c10d_init runs
    if event == "c_call" and getattr(arg, "__name__", "") == "_c10d_init":
        state["in"] = True
    elif event == "call" and state["in"] and not state["sent"]:
        state["sent"] = True
        os.kill(os.getpid(), signal.SIGINT)


sys.setprofile(profile)
sys.argv = ["qtool"] + sys.argv[1:]
qtool.entry.main()
"""


def test_a_signal_inside_torchs_cpp_start_up_is_one_line(world, tmp_path):
    """A Ctrl-C landing while torch's C++ start-up called back into Python (torch.distributed's _c10d_init, as
    the command imported torch) raised KeyboardInterrupt inside pybind11, which aborted the process: SIGABRT,
    "terminate called after throwing an instance of 'python_error'" and a page of C++ frames, no JSON."""
    d, ckpt, _ = world
    r = subprocess.run([sys.executable, "-c", SIGNAL_INSIDE_TORCHS_CPP_START_UP, "calibrate", str(ckpt), "-c",
                        str(CONFIGS / "w8a16.yaml"), "--model-class", "tests.tinymodels:mlp", "-o",
                        str(tmp_path / "r"), "--json"], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert r.returncode == 130 and r.stderr == "interrupted: SIGINT; nothing was written\n", r.stderr[-2000:]
    assert json.loads(r.stdout)["exit_code"] == 130
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_a_slow_reader_takes_the_json_object_leaves_it_whole(tmp_path, sig, code):
    """A signal while the --json object was written into a full pipe raised between two writes: stdout held the
    first 64 KiB of a 600 KB object, and no other."""
    save_file({f"layer_{i}.weight": torch.zeros(2, 2) for i in range(3000)}, tmp_path / "many.safetensors")
    proc = subprocess.Popen([sys.executable, "-m", "qtool", "inspect", str(tmp_path / "many.safetensors"), "--json"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    first = os.read(proc.stdout.fileno(), 1)  # (the object has begun; the pipe fills and the writer blocks)
    time.sleep(0.5)
    proc.send_signal(sig)
    rest, stderr = proc.communicate(timeout=60)
    assert json.loads(first + rest)["kind"] == "safetensors", stderr  # (whole, and the only object)
    assert proc.returncode == code and stderr.decode().strip().splitlines()[-1].startswith("interrupted: "), stderr


def test_a_third_signal_stops_a_run_whose_reader_never_reads(tmp_path):
    """Every signal was held while the --json object was written: a reader that never read left the process
    blocked, and only SIGKILL stopped it (review). The third signal ends it at once, as after any interrupt."""
    save_file({f"layer_{i}.weight": torch.zeros(2, 2) for i in range(3000)}, tmp_path / "many.safetensors")
    proc = subprocess.Popen([sys.executable, "-m", "qtool", "inspect", str(tmp_path / "many.safetensors"), "--json"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    os.read(proc.stdout.fileno(), 1)  # (the object has begun; the pipe fills and the writer blocks)
    time.sleep(0.5)
    for _ in range(3):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
    assert proc.wait(timeout=30) == 143
    assert proc.stderr.read().decode().strip().splitlines()[-1].startswith("interrupted again: SIGTERM")


def test_a_run_under_nohup_outlives_a_hangup(world, tmp_path):
    """SIGHUP ignored as the process starts (nohup, trap '' HUP) stays ignored: qtool's own handler took it over and
    ended the protected run with 129, its output thrown away."""
    proc = _slow_calibration_under_way(world, tmp_path / "r", hangup=signal.SIG_IGN)
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert (tmp_path / "r" / "encodings.json").is_file()


def test_a_sigkilled_run_leaves_a_temporary_the_next_run_removes(world, tmp_path):
    """SIGKILL cannot be caught: the temporary directory stays, named with the writer's host and pid; the next run
    writing the same --out sees that pid is gone, removes it, and leaves a live run's temporaries alone."""
    d, ckpt, data = world
    proc = subprocess.Popen(
        [sys.executable, "-m", "qtool", "calibrate", str(ckpt), "-c", str(CONFIGS / "w8a8.yaml"), "--data", str(data),
         "--batch-size", "4", "--model-class", "tests.tinymodels_slow:slow", "-o", str(tmp_path / "r")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not any(p.name.startswith(".r.tmp-") for p in tmp_path.iterdir()):
        time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=60)
    litter = [p.name for p in tmp_path.iterdir()]
    assert len(litter) == 1 and litter[0].startswith(".r.tmp-") and f"-{proc.pid}-" in litter[0], litter
    live = tmp_path / f".r.tmp-{litter[0].split('.tmp-')[1].rsplit('-', 2)[0]}-{os.getpid()}-x"
    live.mkdir()  # this test's own process is alive: not litter
    r = qtool("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "--model-class", "tests.tinymodels:mlp",
              "-o", tmp_path / "r", "--quiet")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["r", live.name])


def test_concurrent_overwrites_both_succeed_and_out_is_never_missing(world, tmp_path):
    d, ckpt, data = world
    args = ["-c", CONFIGS / "w8a16.yaml", "--model-class", "tests.tinymodels:mlp", "-o", tmp_path / "r"]
    assert qtool("calibrate", ckpt, *args, "--quiet").returncode == 0
    procs = [subprocess.Popen([sys.executable, "-m", "qtool", "calibrate", str(ckpt), *map(str, args), "--overwrite",
                               "--quiet"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    while any(p.poll() is None for p in procs):
        assert (tmp_path / "r" / "encodings.json").exists()  # replaced by an exchange, never removed first
    for p in procs:
        assert p.returncode == 0, p.communicate()[1]
    assert [p.name for p in tmp_path.iterdir()] == ["r"]


def test_full_disk_is_one_clear_line(world, tmp_path):
    """RLIMIT_FSIZE makes writes past 10 kB fail with EFBIG, as a full disk fails with ENOSPC."""
    d, ckpt, data = world

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))

    r = qtool("quantize", ckpt, "-c", CONFIGS / "w8a16.yaml", "--model-class", "tests.tinymodels:mlp",
              "-o", tmp_path / "q", "--quiet", preexec_fn=limit)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "File too large" in lines[0]
    assert list(tmp_path.iterdir()) == []
    # ONNX's export wrote through torch.onnx, whose failure read "torch.onnx could not export this model"
    r = qtool("calibrate", ckpt, "-c", CONFIGS / "w8a8.yaml", "--model-class", "tests.tinymodels:mlp", "--data",
              data, "-o", tmp_path / "cal", "--quiet")
    assert r.returncode == 0, r.stderr
    r = qtool("export", ckpt, "-e", tmp_path / "cal/encodings.json", "--model-class", "tests.tinymodels:mlp",
              "--data", data, "-o", tmp_path / "o", "--format", "onnx", "--quiet", preexec_fn=limit)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "File too large" in lines[0], r.stderr
    assert lines[0].startswith(f"error: {tmp_path / 'o'}: ") and "torch.onnx" not in lines[0], r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["cal"]


@pytest.mark.parametrize("no_color", [True, False])
def test_no_color_is_respected(world, tmp_path, no_color):
    d, ckpt, data = world
    env = {"FORCE_COLOR": "1", "TERM": "xterm-256color"}
    if no_color:
        env["NO_COLOR"] = "1"
    # an unmatched optional pattern prints a (normally yellow) warning
    r = qtool("calibrate", ckpt, "-c", REPO / "tests" / "bad_inputs" / "recipes" / "unmatched.yaml",
              "--allow-unmatched", "--model-class", "tests.tinymodels:mlp", "-o", tmp_path / "r", env=env)
    assert r.returncode == 0, r.stderr
    assert "warning:" in r.stderr
    coloured = re.search(r"\x1b\[[0-9;]*(3[0-7]|38|9[0-7])(;[0-9]+)*m", r.stderr)
    assert (coloured is None) == no_color, repr(r.stderr)


def test_example_nightly_workflow_is_valid():
    import yaml

    wf = yaml.safe_load((REPO / "examples" / "nightly-quantize.yml").read_text())
    # PyYAML reads the bare key `on` as True
    triggers = wf.get("on", wf.get(True))
    assert "schedule" in triggers
    steps = wf["jobs"]["quantize"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "qtool config validate" in runs and "qtool quantize" in runs and "--json" in runs
    assert "qtool eval" in runs
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in steps)


def test_bad_choices_and_recipes_fail_before_torch_or_a_model_loads(tmp_path):
    """Every problem of a bad invocation is reported before anything slow happens: here the checkpoint does not
    even exist, and the process never imports torch."""
    bad = tmp_path / "r.yaml"
    bad.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 99}\nlayers:\n  - name: x\n")
    probe = ("import sys\nfrom qtool.cli import main\nsys.argv = ['qtool'] + sys.argv[1:]\n"
             "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
             "print('torch imported:', 'torch' in sys.modules, 'exit:', code)\n")
    for args, first in (
        (["quantize", tmp_path / "missing", "-c", bad, "-o", tmp_path / "o"], "defaults.weights.bitwidth"),
        (["quantize", tmp_path / "missing", "-c", "w8a8", "--format", "onxx", "-o", tmp_path / "o"], "--format"),
        (["calibrate", tmp_path / "missing", "-c", "w8a9", "-o", tmp_path / "o"], "did you mean w8a8"),
        (["calibrate", tmp_path / "missing", "-c", "w8a8", "--data", tmp_path / "nodata.txt", "-o", tmp_path / "o"],
         "nodata.txt: data path not found"),
    ):
        r = subprocess.run([sys.executable, "-c", probe, *map(str, args)], capture_output=True, text=True, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
        assert "torch imported: False exit: 2" in r.stdout, (r.stdout, r.stderr)
        assert first in r.stderr.splitlines()[0], r.stderr
    r = subprocess.run([sys.executable, "-c", probe, "quantize", str(tmp_path / "missing"), "-c", str(bad), "-o",
                        str(tmp_path / "o")], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert len([line for line in r.stderr.splitlines() if line.startswith("error:")]) == 2  # both problems at once


@pytest.mark.parametrize("raised", [ValueError("could not determine the shape of object type 'torch.Size'"),
                                    RuntimeError("boom"), OSError(5, "Input/output error")],
                         ids=["ValueError", "RuntimeError", "OSError"])
@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupt_that_surfaces_as_another_error_still_reads_as_an_interrupt(raised, name, code, capsys):
    """(#34 item 3) Ctrl-C landing inside C code (a tensor conversion) can come out as a ValueError; once the
    process received the signal, whatever it raised reads as the interrupt, exit 130/143, not an internal error."""
    import typer

    from qtool.cli import core as cli
    from qtool.io.fs import forget_published

    forget_published()  # (outputs an earlier test's command put in place, in this process)
    cli._SIGNALLED.append(name)
    try:
        with pytest.raises(typer.Exit) as e:
            with cli._errors():
                raise raised
    finally:
        cli._SIGNALLED.clear()
    assert e.value.exit_code == code
    assert capsys.readouterr().err.strip() == f"interrupted: {name}; nothing was written"


def test_without_a_signal_an_error_is_still_internal(capsys):
    import typer

    from qtool.cli import core as cli

    with pytest.raises(typer.Exit) as e:
        with cli._errors():
            raise ValueError("a real bug")
    assert e.value.exit_code == 3 and "internal error: ValueError: a real bug" in capsys.readouterr().err


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "replaced"])
def test_an_interrupt_after_the_output_is_in_place_says_it_was_written(tmp_path, overwrite, capsys):
    """An interrupt that lands once the output directory is renamed into place (while the summary is printed, or
    the old output is removed) leaves the new output whole: the exit code still says interrupted, and the line says
    what was written instead of "nothing was written"."""
    import typer

    from qtool.cli import core as cli
    from qtool.io.fs import atomic_output_dir, forget_published

    out = tmp_path / "out"
    if overwrite:
        out.mkdir()
        (out / "old").write_text("old")
    forget_published()
    with pytest.raises(typer.Exit) as e:
        with cli._errors():
            with atomic_output_dir(out, overwrite) as tmp:
                (tmp / "new").write_text("new")
            raise KeyboardInterrupt
    assert e.value.exit_code == 130 and sorted(p.name for p in out.iterdir()) == ["new"]
    assert capsys.readouterr().err.strip() == f"interrupted: SIGINT; {out} had been written in full before it"
    forget_published()
    with pytest.raises(typer.Exit):
        with cli._errors():
            raise KeyboardInterrupt
    assert capsys.readouterr().err.strip() == "interrupted: SIGINT; nothing was written"


# each probe sends a signal once the command is over, at another moment: its exit (0, silent) stands
_SIGNALS_AFTER = {
    # during the interpreter's exit: it would only interrupt an atexit handler, with a traceback
    "at exit": "import atexit\natexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n",
    # as main() replaced the handlers (the moment the output was renamed into place): a traceback and exit 1
    "as the handlers are replaced": (
        "from qtool.cli import core\nreal = signal.signal\nsent = []\n"
        "def replacing(sig, handler):\n"
        "    if handler not in (core._terminate, core._interrupt) and not sent:\n"
        "        sent.append(1)\n        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(sig, handler)\nsignal.signal = replacing\n"),
    # once the command had returned, as its exit was raised: a traceback (exit 1) in its place
    "as the exit is raised": ("real = sys.exit\ndef exiting(code=None):\n    os.kill(os.getpid(), signal.SIGTERM)\n"
                              "    real(code)\nsys.exit = exiting\n"),
}


@pytest.mark.parametrize("moment", list(_SIGNALS_AFTER))
def test_a_signal_once_the_command_is_over_keeps_its_exit(world, tmp_path, moment):
    d, ckpt, data = world
    probe = ("import os, signal, sys\nfrom qtool.cli import main\n" + _SIGNALS_AFTER[moment]
             + "sys.argv = ['qtool'] + sys.argv[1:]\nmain()\n")
    r = _calibrate_under(probe, ckpt, tmp_path / "r", "--quiet")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert (tmp_path / "r" / "encodings.json").is_file()


def _calibrate_interrupted(world, tmp_path, monkeypatch, name: str, where: str, first=None):
    """``qtool calibrate --json`` whose ``qtool.cli.run.<where>`` (after ``first``, the real one, where given)
    meets the signal ``name``: (exit code, stdout, stderr, --out)."""
    from qtool.cli import core as cli
    from qtool.cli import run as cli_run
    from tests.helpers import run_cli

    d, ckpt, data = world

    def interrupted(*args, **kwargs):
        if first is not None:
            first(*args, **kwargs)
        cli._SIGNALLED.append(name)
        raise cli._Terminated() if name == "SIGTERM" else KeyboardInterrupt()

    monkeypatch.setattr(cli_run, where, interrupted)
    out = tmp_path / "r"
    status, stdout, err = run_cli("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "--model-class",
                                  "tests.tinymodels:mlp", "-o", out, "--json")
    return status, stdout, err, out


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupt_while_the_summary_prints_names_the_signal_and_the_output(world, tmp_path, monkeypatch, name,
                                                                                 code):
    """The summary is printed after the command's error handling; an interrupt there came out as a bare exit 130
    whatever the signal, with nothing said (and no JSON object with --json)."""
    status, stdout, err, out = _calibrate_interrupted(world, tmp_path, monkeypatch, name, "_report_files")
    assert status == code and (out / "encodings.json").is_file()
    assert f"interrupted: {name}; {out} had been written in full before it" in err
    assert json.loads(stdout) == {"ok": False, "exit_code": code,
                                  "error": f"{name}; {out} had been written in full before it"}


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupt_after_the_json_summary_adds_no_second_object(world, tmp_path, monkeypatch, name, code):
    """stdout held the summary and then {"ok": false, "exit_code": 143}: two objects no JSON parser reads."""
    from qtool.cli import core as cli

    status, stdout, err, out = _calibrate_interrupted(world, tmp_path, monkeypatch, name, "_emit_json",
                                                      first=cli._emit_json)
    assert status == code and json.loads(stdout)["ok"] is True
    assert f"interrupted: {name}; {out} had been written in full before it" in err


def test_a_write_the_disk_refuses_names_the_output(world, tmp_path):
    """A full disk or a file-size limit fails a write() that names no file: the line said "File too large" and no
    more. It names the output now, and nothing is left of it."""
    import resource

    d, ckpt, data = world
    out = tmp_path / "out"
    r = qtool("quantize", ckpt, "-c", CONFIGS / "w8a16.yaml", "--model-class", "tests.tinymodels:mlp", "-o", out,
              env={"PYTHONDONTWRITEBYTECODE": "1"},
              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048)))
    assert r.returncode == 2, r.stderr
    assert f"error: {out}: File too large (nothing was written)" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_table_piped_to_a_file_keeps_each_name_on_one_line(world, tmp_path):
    """Not a terminal, rich drew tables 80 columns wide and split long module names over two lines (grep in a CI
    log missed them)."""
    d, ckpt, data = world
    long = {f"a_module_with_a_rather_long_name_{i}.weight": torch.zeros(4, 4) for i in range(2)}
    save_file(long, tmp_path / "long.safetensors")
    r = qtool("inspect", tmp_path / "long.safetensors", env={"COLUMNS": ""})
    assert r.returncode == 0, r.stderr
    assert sum("a_module_with_a_rather_long_name_" in line and ".weight" in line
               for line in r.stdout.splitlines()) == 2, r.stdout


SIGNAL_WHILE_THE_CLI_IMPORTS = """
import importlib.abc, os, signal, sys
sys.argv = ["qtool", "calibrate", "m", "-c", "w8a8", "-o", "out", "--json"]
import qtool.entry as entry


class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "{where}":  # (the signal lands while the CLI, or json in it, is being imported)
            os.kill(os.getpid(), signal.{sig})
        return None


sys.meta_path.insert(0, Interrupt())
entry.main()
"""


@pytest.mark.parametrize("where", ["qtool.cli", "json.decoder"])
@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_while_the_cli_is_imported_is_one_line_and_one_json_object(tmp_path, sig, code, where):
    """Ctrl-C in the first few tenths of a second (typer, rich and the commands importing) was a traceback from
    inside an import, and --json printed nothing; landing while json itself was half imported, the handler's own
    import of it was "partially initialized module 'json' has no attribute 'dumps'" and exit 1."""
    probe = SIGNAL_WHILE_THE_CLI_IMPORTS.replace("{where}", where)
    r = subprocess.run([sys.executable, "-c", probe.format(sig=sig)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == code, r.stderr
    assert r.stderr == f"interrupted: {sig}; nothing was written\n"
    assert json.loads(r.stdout) == {"ok": False, "exit_code": code, "error": f"{sig}; nothing was written"}
    assert not list(tmp_path.iterdir())
    # under torchrun (which SIGTERMs the other ranks once one exits) a rank other than 0 says nothing: its JSON
    # object beside rank 0's made two on the run's stdout (seen under load)
    r = subprocess.run([sys.executable, "-c", probe.format(sig=sig)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                            "TORCHELASTIC_RUN_ID": "test", "WORLD_SIZE": "2", "RANK": "1"})
    assert (r.returncode, r.stdout, r.stderr) == (code, "", "")


# each probe sends signals at moments a run's cleanup and report are exposed: the first signal ends the run, a
# later one changes nothing (it stopped the cleanup halfway, or the report before its JSON object)
_SIGNALS_AT_EDGES = {
    # a second Ctrl-C while the first one's cleanup removes the temporary output: the finished output was left in
    # .r.tmp-*, and the line said "nothing was written"
    "twice, the second in the cleanup": (
        "from qtool.io import fs\nreal_publish, real_rmtree = fs._publish, fs.shutil.rmtree\n"
        "def publish(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    real_publish(*a, **k)\n"
        "def rmtree(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    real_rmtree(*a, **k)\n"
        "fs._publish, fs.shutil.rmtree = publish, rmtree\n", "SIGINT"),
    # a SIGTERM as the temporary was made (mkdtemp returning), before the cleanup knew it: left behind
    "as the temporary is made": (
        "real = os.mkdir\n"
        "def made(path, *a, **k):\n    real(path, *a, **k)\n    if '.tmp-' in str(path):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\nos.mkdir = made\n", "SIGTERM"),
    # a second signal while the first is reported: no JSON object, and the second one's exit code
    "twice, the second in the report": (
        "from qtool.io import fs\nfrom qtool.cli import core\nreal_publish, real_emit = fs._publish, core._emit_json\n"
        "def publish(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM)\n    real_publish(*a, **k)\n"
        "def emit(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    real_emit(*a, **k)\n"
        "fs._publish, core._emit_json = publish, emit\n", "SIGTERM"),
    # a signal while typer builds the command group (after the import, before the command's own handling): a
    # traceback and exit 1, no JSON object
    "while typer sets up": (
        "import typer.main\nreal = typer.main.get_command\n"
        "def building(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return real(*a, **k)\n"
        "typer.main.get_command = building\n", "SIGTERM"),
}


@pytest.mark.parametrize("moment", list(_SIGNALS_AT_EDGES))
def test_a_signal_at_the_edges_of_a_run_is_one_line_one_object_and_nothing_left(world, tmp_path, moment):
    d, ckpt, data = world
    code, name = _SIGNALS_AT_EDGES[moment]
    probe = ("import os, signal, sys\nimport qtool.entry\n" + code
             + "sys.argv = ['qtool'] + sys.argv[1:]\nqtool.entry.main()\n")
    r = _calibrate_under(probe, ckpt, tmp_path / "r", "--json")
    want = {"SIGINT": 130, "SIGTERM": 143}[name]
    assert r.returncode == want and r.stderr.splitlines()[-1] == f"interrupted: {name}; nothing was written", r.stderr
    assert "Traceback" not in r.stderr
    assert json.loads(r.stdout) == {"ok": False, "exit_code": want, "error": f"{name}; nothing was written"}
    assert list(tmp_path.iterdir()) == []



@pytest.mark.parametrize("moment", ["as the rename returns", "while the JSON object is made"])
def test_a_signal_at_the_outputs_last_moments_says_what_is_in_place(world, tmp_path, moment):
    """A signal as the output's rename returned (before it was recorded) said "nothing was written" of an output in
    place (with --overwrite: an old output silently replaced); one while the --json object was made left no object."""
    d, ckpt, data = world
    patch = {"as the rename returns": "from qtool.io import fs\nreal = fs._renameat2\n"
                                      "def r2(*a, **k):\n    v = real(*a, **k)\n"
                                      "    os.kill(os.getpid(), signal.SIGINT)\n    return v\nfs._renameat2 = r2\n",
             "while the JSON object is made": "from qtool.cli import core\nreal = core._json_safe\n"
                                              "def js(v):\n    os.kill(os.getpid(), signal.SIGTERM)\n"
                                              "    return real(v)\ncore._json_safe = js\n"}[moment]
    probe = ("import os, signal, sys\nimport qtool.entry\n" + patch
             + "sys.argv = ['qtool'] + sys.argv[1:]\nqtool.entry.main()\n")
    r = _calibrate_under(probe, ckpt, tmp_path / "r", "--json")
    out = tmp_path / "r"
    assert (out / "encodings.json").is_file()
    code = 130 if moment == "as the rename returns" else 143
    name = "SIGINT" if code == 130 else "SIGTERM"
    assert r.returncode == code and r.stderr.splitlines()[-1] == (
        f"interrupted: {name}; {out} had been written in full before it"), r.stderr
    assert json.loads(r.stdout)["exit_code"] == code


def test_a_third_signal_ends_the_process_at_once(world, tmp_path):
    """The first signal ends the run and the second is ignored while its cleanup runs; pressing Ctrl-C a third time
    (a cleanup that hangs, an interrupt a library swallowed) ends the process now, with the first one's code."""
    d, ckpt, data = world
    probe = ("import os, signal, sys, time\nimport qtool.entry\nfrom qtool.io import fs\nreal = fs._publish\n"
             "def publish(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM)\n    real(*a, **k)\n"
             "def hangs(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    os.kill(os.getpid(), signal.SIGINT)\n"
             "    time.sleep(60)\n"
             "fs._publish, fs.shutil.rmtree = publish, hangs\n"
             "sys.argv = ['qtool'] + sys.argv[1:]\nqtool.entry.main()\n")
    r = _calibrate_under(probe, ckpt, tmp_path / "r", "--quiet")
    assert r.returncode == 143, r.stderr
    assert r.stderr.splitlines()[-1] == "interrupted again: SIGINT; stopping now (the next run removes what this one " \
        "left)", r.stderr


def test_a_stderr_that_takes_nothing_changes_no_outcome(world, tmp_path):
    """2>/dev/full (a full log disk): a healthy run ended with exit 1 and no JSON object (its first progress line's
    failure blamed on the output directory), and bad input with exit 1 instead of 2."""
    d, ckpt, data = world

    def run(*args):
        with open("/dev/full", "w") as full:
            return subprocess.run([sys.executable, "-m", "qtool", *map(str, args)], stdout=subprocess.PIPE,
                                  stderr=full, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                  timeout=300)

    r = run("quantize", ckpt, "-c", CONFIGS / "w8a16.yaml", "--model-class", "tests.tinymodels:mlp", "-o",
            tmp_path / "q", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True
    assert (tmp_path / "q" / "model.safetensors").is_file()
    r = run("inspect", tmp_path / "nothing", "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["exit_code"] == 2
    # --debug's traceback too (it went to stderr past the wrapper: exit 1, no JSON object)
    r = run("calibrate", ckpt, "-c", CONFIGS / "w8a16.yaml", "--model-class", "tests.tinymodels_slow:broken", "-o",
            tmp_path / "b", "--debug", "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["exit_code"] == 3


def test_stdout_and_stderr_hold_in_unusual_settings(world, tmp_path):
    """COLUMNS=0 made rich print nothing at all (no error line, no table); a UTF-16 stdout went around the checked
    writes (a cut-short --json was exit 0); a non-blocking stdout whose reader is slow failed as 'takes nothing
    more'; ONNX export with stdout closed failed ('NoneType' object has no attribute 'flush')."""
    import fcntl
    import threading

    from qtool.cli.core import _write_all

    r = qtool("inspect", tmp_path / "nothing", env={"COLUMNS": "0"})
    assert r.returncode == 2 and r.stderr.strip() == f"error: {tmp_path / 'nothing'}: not found", r.stderr
    assert "recipe" in qtool("config", "list", env={"COLUMNS": "0"}).stdout
    r = subprocess.run([sys.executable, "-m", "qtool", "config", "list", "--json"], capture_output=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-16"}, timeout=300)
    assert r.stdout[:2] == b"\xff\xfe" and json.loads(r.stdout.decode("utf-16"))["ok"] is True
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETFL, fcntl.fcntl(write, fcntl.F_GETFL) | os.O_NONBLOCK)
    got = []
    reader = threading.Thread(target=lambda: (time.sleep(0.3), got.append(b"".join(iter(
        lambda: os.read(read, 65536), b"")))))
    reader.start()
    _write_all(write, b"x" * 300_000)  # (more than a pipe holds)
    os.close(write)
    reader.join()
    assert len(got[0]) == 300_000
    d, ckpt, data = world
    run = subprocess.run([sys.executable, "-m", "qtool", "quantize", ckpt, "--model-class", "tests.tinymodels:mlp",
                          "-c", "w8a16", "--format", "onnx", "--data", data, "-o", tmp_path / "onnx", "--quiet"],
                         stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         timeout=300, preexec_fn=lambda: os.close(1))
    assert run.returncode == 0 and (tmp_path / "onnx" / "model.onnx").is_file(), run.stderr
