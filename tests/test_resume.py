"""``--sequential --resume``: a run killed (SIGKILL) after any block continues from its saved state and writes the
bytes of an uninterrupted run, in one process and on two ranks; a state of another run is refused in one line."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import error_lines, run_cli, tiny_llama

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = 2

# GPTQ weights, static activation ranges and a warning from a block (a tied lm_head left to round-to-nearest is
# not it: lm_head is ignored), so every kind of block result must come back from the state
RECIPE = """version: 1
defaults:
  weights: {bitwidth: 4, symmetric: true, granularity: per_block, block_size: 16, rounding: gptq}
  activations: {inputs: true, outputs: false, analyzer: minmax}
ignore: ["lm_head"]
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    tiny_llama(d / "m", num_hidden_layers=BLOCKS)
    ids = torch.randint(0, 256, (12, 16), generator=torch.Generator().manual_seed(3))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, d / "ids.safetensors")
    (d / "r.yaml").write_text(RECIPE)
    args = ["calibrate", d / "m", "-c", d / "r.yaml", "--data", d / "ids.safetensors", "--batch-size", "4",
            "--sequential", "--quiet"]
    code, _, err = run_cli(*args, "-o", d / "whole")
    assert code == 0, err
    return d, [str(a) for a in args]


def _files(run: Path):
    return {p.name: p.read_bytes() for p in sorted(run.iterdir())}


def _killed(args, out: Path, after: int, torchrun: int = 0):
    cmd = [sys.executable, str(ROOT / "tests/stop_after_block.py"), str(after), "--", *args, "-o", str(out)]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}",
               *cmd[1:]]
    # (the resume runs in this process, on its thread count, which the state records: a stop and a resume on one
    # node; torchrun gives each rank one thread, the resume's ranks too)
    threads = "1" if torchrun else str(torch.get_num_threads())
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": threads})
    assert r.returncode != 0, r.stderr[-2000:]
    if not torchrun:
        assert r.returncode == -9, r.stderr[-2000:]
    assert not out.exists()
    state = json.loads((out.with_name(out.name + ".resume") / "state.json").read_text())
    assert state["blocks_done"] == after


@pytest.mark.parametrize("after", range(1, BLOCKS + 1))
def test_a_run_killed_after_any_block_resumes_to_the_same_bytes(llama, tmp_path, after):
    d, args = llama
    out = tmp_path / "run"
    _killed(args, out, after)
    code, text, err = run_cli(*args[:-1], "--resume", "-o", out)  # (not --quiet: the stage line shows)
    assert code == 0, err
    assert f"resuming after block {after}" in text + err
    # the blocks read back are one line, not one each as if calibrated again
    assert [line for line in err.splitlines() if line.startswith("calibrating: block")] == [
        f"calibrating: block {k}/{BLOCKS}" for k in range(after, BLOCKS + 1)], err
    assert _files(out) == _files(d / "whole")  # manifest.json included
    assert not out.with_name("run.resume").exists()  # the state goes once the output is written


def test_a_kill_inside_the_safetensors_writer_still_resumes(llama, tmp_path):
    """safetensors writes a file through its own temporary (".tmpXXXXXX", Rust's tempfile) beside it; a kill that
    lands there (as it will in a real block's gigabytes of hidden states) left one that made --resume refuse the
    state as "holds '.tmp46W1kI', which no --sequential run's state holds"."""
    d, args = llama
    out = tmp_path / "run"
    _killed(args, out, 1)
    (out.with_name("run.resume") / ".tmp46W1kI").write_bytes(b"\0" * 4096)  # what the killed writer left
    code, _, err = run_cli(*args, "--resume", "-o", out)
    assert code == 0, err
    assert _files(out) == _files(d / "whole")
    assert not out.with_name("run.resume").exists()


@pytest.mark.parametrize("command", ["calibrate", "quantize"])
def test_an_interrupt_right_after_the_output_is_in_place_still_removes_the_state(llama, tmp_path, monkeypatch,
                                                                                  command):
    """The state was removed after the output's rename: an interrupt between the two left it, and every retry with
    --resume then failed on the output that exists."""
    import qtool.io.fs as fs

    d, args = llama
    publish = fs._publish

    def published_then_interrupted(*a, **kw):
        publish(*a, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(fs, "_publish", published_then_interrupted)
    out = tmp_path / "run"
    code, _, err = run_cli(command, *args[1:], "-o", out)
    assert code == 130 and "had been written in full before it" in err, err
    assert out.is_dir() and not out.with_name("run.resume").exists()


def test_an_interrupt_after_a_block_says_the_state_is_kept_and_how_to_go_on(llama, tmp_path, monkeypatch):
    """Ctrl-C said "nothing was written" while OUT.resume kept the finished blocks."""
    from qtool.calibration.resume import ResumeState

    d, args = llama
    save = ResumeState.save

    def saved_then_interrupted(self, i, *a, **kw):
        save(self, i, *a, **kw)
        self.wait()
        raise KeyboardInterrupt

    monkeypatch.setattr(ResumeState, "save", saved_then_interrupted)
    out = tmp_path / "run"
    code, _, err = run_cli(*args, "-o", out)
    state = out.with_name("run.resume")
    assert code == 130 and state.is_dir(), err
    assert (f"interrupted: SIGINT; nothing was written; {state} keeps the blocks finished so far: the same command "
            "with --resume continues") in err, err
    monkeypatch.setattr(ResumeState, "save", save)
    code, _, err = run_cli(*args, "--resume", "-o", out)
    assert code == 0 and _files(out) == _files(d / "whole"), err


def test_a_full_disk_while_the_state_is_written_is_one_line(llama, tmp_path):
    """safetensors' writer raises its own SafetensorError for a failed write ("File too large (os error 27)"): it
    was an internal error (exit 3, a traceback log) where the same failure in the export is one line, exit 2."""
    import resource

    d, args = llama
    out = tmp_path / "run"

    def limit():  # (Python ignores SIGXFSZ: a write past the limit fails with EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    r = subprocess.run([sys.executable, "-m", "qtool", *args[:-1], "-o", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    [line] = [x for x in error_lines(r.stderr) if x.startswith("error")]
    assert "File too large" in line and "run.resume" in line, line
    assert "internal error" not in r.stderr and not out.exists()


def test_a_run_at_a_lower_matmul_precision_resumes_to_its_own_bytes(llama, tmp_path):
    """The passes' products at bfloat16 (on a CPU with AMX; elsewhere float32, with a warning) are as repeatable
    as float32's: a stopped run resumes to the bytes of an uninterrupted one at the same setting."""
    d, args = llama
    args = args + ["--matmul-precision", "medium"]
    code, _, err = run_cli(*args, "-o", tmp_path / "whole")
    assert code == 0, err
    _killed(args, tmp_path / "run", 1)
    code, _, err = run_cli(*args, "--resume", "-o", tmp_path / "run")
    assert code == 0, err
    assert _files(tmp_path / "run") == _files(tmp_path / "whole")


def test_resume_without_a_saved_state_starts_from_the_first_block(llama, tmp_path):
    d, args = llama
    code, out, err = run_cli(*args[:-1], "--resume", "-o", tmp_path / "run")
    assert code == 0, err
    assert "resuming: no block was saved" in out + err
    assert _files(tmp_path / "run") == _files(d / "whole")


@pytest.fixture(scope="module")
def stopped(llama, tmp_path_factory):
    """The state a run killed after block 1 left (copied into each test's own directory)."""
    d, args = llama
    out = tmp_path_factory.mktemp("stopped") / "run"
    _killed(args, out, 1)
    return out.with_name("run.resume")


def test_calibration_batches_changed_behind_the_files_stamps_are_refused(llama, tmp_path):
    """Files are recognized by size and modification time; what the blocks read is checked by its digest, so a
    state is refused when the batches differ though every stamp agrees (a tokenizer edited in place gives other
    ids from the same text; here the data file is rewritten with its size and time kept)."""
    d, args = llama
    data = tmp_path / "ids.safetensors"
    shutil.copy(d / "ids.safetensors", data)
    args = list(args)
    args[args.index("--data") + 1] = str(data)
    _killed(args, tmp_path / "run", 1)
    stamp = data.stat()
    ids = torch.randint(0, 256, (12, 16), generator=torch.Generator().manual_seed(5))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, data)
    assert data.stat().st_size == stamp.st_size
    os.utime(data, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    code, _, err = run_cli(*args, "--resume", "-o", tmp_path / "run")
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1 and "(calibration batches differ)" in lines[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("change", ["recipe", "data", "model", "options", "precision", "threads"])
def test_a_state_of_another_run_is_refused_in_one_line(llama, stopped, tmp_path, change, monkeypatch):
    d, args = llama
    out = tmp_path / "run"
    shutil.copytree(stopped, tmp_path / "run.resume")
    args = list(args)
    if change == "recipe":
        (tmp_path / "r.yaml").write_text(RECIPE.replace("block_size: 16", "block_size: 32"))
        args[args.index("-c") + 1] = str(tmp_path / "r.yaml")
    elif change == "data":
        ids = torch.randint(0, 256, (12, 16), generator=torch.Generator().manual_seed(4))
        save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "ids.safetensors")
        args[args.index("--data") + 1] = str(tmp_path / "ids.safetensors")
    elif change == "model":
        m = tmp_path / "m"
        tiny_llama(m, num_hidden_layers=BLOCKS)
        weights = m / "model.safetensors"
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
        args[1] = str(m)
    elif change == "precision":  # other bytes: the model's products at another precision
        args += ["--matmul-precision", "medium"]
    elif change == "threads":  # other bytes: CPU kernels split their sums by the thread count (a node of other cores)
        threads = torch.get_num_threads()
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    else:
        args[args.index("--batch-size") + 1] = "3"
    code, _, err = run_cli(*args, "--resume", "-o", out)
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1 and "the saved state is of another run" in lines[0], err
    assert {"recipe": "(recipe differs)", "data": "(calibration batches, data, options: --data differ)",
            "model": "(checkpoint differs)",
            "options": "(calibration batches, options: --batch-size differ)", "precision": "(options: --matmul-precision differs)",
            "threads": "(CPU threads differ) (the stopped run had"}[change] in lines[0], lines
    assert "run without --resume" in lines[0]
    assert not out.exists() and (tmp_path / "run.resume/state.json").exists()  # the state stays for a rerun
    if change == "options":
        code, _, err = run_cli(*args, "-o", out)  # without --resume: a fresh run, the old state discarded
        assert code == 0, err
        assert not out.with_name("run.resume").exists()


def test_resume_needs_sequential_and_is_not_for_a_size_budget_search(llama, tmp_path):
    d, args = llama
    plain = [a for a in args if a != "--sequential"]
    code, _, err = run_cli(*plain, "--resume", "-o", tmp_path / "a")
    assert code == 2 and error_lines(err) == ["error: --resume continues a --sequential run (the one mode that "
                                              "keeps a state): add --sequential"]
    search = [a for a in args if a not in ("-c", str(d / "r.yaml"))]
    code, _, err = run_cli(*search, "--resume", "--candidates", "w8a16,w4a16", "--target-bpw", "6",
                           "-o", tmp_path / "b")
    assert code == 2 and "--resume does not cover a size-budget search" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_size_budget_search_written_where_a_state_was_left_removes_it(llama, stopped, tmp_path):
    """A --sequential size-budget search keeps no state, and left an earlier run's OUT.resume beside its output: a
    retry wrapper's --resume then met "already exists"."""
    d, args = llama
    shutil.copytree(stopped, tmp_path / "run.resume")
    search = [a for a in args if a not in ("-c", str(d / "r.yaml"))]
    code, _, err = run_cli(*search, "--candidates", "w8a16,w4a16-block32", "--target-bpw", "12", "-o",
                           tmp_path / "run")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_two_ranks_killed_after_a_block_resume_to_the_bytes_of_one_process(llama, tmp_path):
    d, args = llama
    out = tmp_path / "run"
    _killed(args, out, 1, torchrun=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "qtool",
           *args, "--resume", "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    whole, run = _files(d / "whole"), _files(out)
    manifest = json.loads(run.pop("manifest.json"))
    assert manifest["distributed"]["world_size"] == 2
    whole.pop("manifest.json")
    assert run == whole


def _restamp(path: Path) -> None:
    """Record ``path``'s present bytes in its state's ``state.json`` (a state edited consistently)."""
    from qtool.io.fs import sha256_file

    state = path.parent / "state.json"
    saved = json.loads(state.read_text())
    saved["files"][path.name] = sha256_file(path)
    state.write_text(json.dumps(saved))


@pytest.mark.parametrize("restamped", [False, True])
def test_a_damaged_saved_block_is_one_line_and_the_state_stays(llama, stopped, tmp_path, restamped):
    d, args = llama
    shutil.copytree(stopped, tmp_path / "run.resume")
    block = tmp_path / "run.resume/block-0.safetensors"
    block.write_bytes(block.read_bytes()[:40])  # truncated: safetensors' own error, not an OSError
    if restamped:
        _restamp(block)
    code, _, err = run_cli(*args, "--resume", "-o", tmp_path / "run")
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1 and "run without --resume" in lines[0], err
    assert ("cannot read the saved block" if restamped else "the saved block changed since state.json recorded its SHA-256") in lines[0]
    assert (tmp_path / "run.resume/state.json").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("what", ["block", "outputs"])
def test_a_saved_file_edited_in_place_is_refused_not_used(llama, stopped, tmp_path, what):
    """A range or a block output changed to another readable value of the same shape (a flipped bit, an edit) was
    used as it read: the state records each file's SHA-256."""
    from safetensors import safe_open

    d, args = llama
    shutil.copytree(stopped, tmp_path / "run.resume")
    [path] = (tmp_path / "run.resume").glob("block-0.safetensors" if what == "block" else "hidden-*-r0.safetensors")
    with safe_open(str(path), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    key = sorted(k for k in tensors if k.endswith(".max") or k.startswith("h."))[0]
    tensors[key] = tensors[key] * 2
    save_file(tensors, path, metadata=meta)
    code, _, err = run_cli(*args, "--resume", "-o", tmp_path / "run")
    assert code == 2, err
    [line] = error_lines(err)
    assert path.name in line and "changed since state.json recorded its SHA-256" in line and "run without --resume" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("damage", ["shape", "dtype"])
def test_saved_block_outputs_of_another_shape_or_dtype_are_one_line(llama, stopped, tmp_path, damage):
    """(an internal error from deep inside the next block: apply_rotary_pos_emb's shapes, a matmul's dtypes)"""
    from safetensors import safe_open

    d, args = llama
    shutil.copytree(stopped, tmp_path / "run.resume")
    [path] = (tmp_path / "run.resume").glob("hidden-*-r0.safetensors")
    with safe_open(str(path), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["h.1"] = tensors["h.1"][:, :8].contiguous() if damage == "shape" else tensors["h.1"].double()
    save_file(tensors, path, metadata=meta)
    _restamp(path)
    code, _, err = run_cli(*args, "--resume", "-o", tmp_path / "run")
    assert code == 2, err
    [line] = error_lines(err)
    assert "the saved block outputs of batch 1 are" in line and "run without --resume" in line, line


@pytest.mark.parametrize("done", [True, -1, "1", 1.0])
def test_a_state_json_whose_count_is_not_a_count_is_refused(tmp_path, done):
    from qtool.calibration.resume import _VERSION, ResumeState
    from qtool.errors import UsageError

    (tmp_path / "state.json").write_text(json.dumps({"version": _VERSION, "fingerprint": {}, "blocks_done": done,
                                                     "files": {}}))
    with pytest.raises(UsageError, match="not a saved state of this qtool version"):
        ResumeState._read(tmp_path)


def test_an_empty_state_json_starts_over_under_resume(llama, stopped, tmp_path):
    """An empty state.json is what a crash can leave of a run's own state (check_state_dir takes it so): a retry
    wrapper that always passes --resume met "cannot read the saved state" on every retry."""
    d, args = llama
    shutil.copytree(stopped, tmp_path / "run.resume")
    (tmp_path / "run.resume/state.json").write_text("")
    code, _, err = run_cli(*args, "--resume", "-o", tmp_path / "run")
    assert code == 0, err
    assert _files(tmp_path / "run") == _files(d / "whole") and not (tmp_path / "run.resume").exists()


def test_a_state_json_that_is_not_json_is_named_as_damaged(llama, stopped, tmp_path):
    """A truncated state.json read "no version and fingerprint" though it held both: it is not JSON at all."""
    from qtool.calibration.resume import check_state_dir
    from qtool.errors import UsageError

    shutil.copytree(stopped, tmp_path / "run.resume")
    state = tmp_path / "run.resume/state.json"
    state.write_text(state.read_text()[:40])
    with pytest.raises(UsageError, match=r"state.json: cannot be read as JSON: a damaged state, which no run can "
                                         r"resume, and a run writing run would remove it: move it away"):
        check_state_dir(tmp_path / "run.resume", [])
    assert state.exists()


def test_an_imatrix_spelled_another_way_resumes(llama, tmp_path):
    """The same --imatrix file given by another path (a retry from another directory) was "options differ",
    naming no option, while --data spelled another way resumed."""
    d, args = llama
    imat = tmp_path / "imat.gguf"
    code, _, err = run_cli("imatrix", d / "m", "--data", d / "ids.safetensors", "-o", imat, "--quiet")
    assert code == 0, err
    (tmp_path / "mse.yaml").write_text(RECIPE.replace("rounding: gptq", "analyzer: mse"))
    args = list(args)
    args[args.index("-c") + 1] = str(tmp_path / "mse.yaml")  # (the analyzer an importance matrix weights)
    args = [*args, "--imatrix", str(imat)]
    code, _, err = run_cli(*args, "-o", tmp_path / "whole")
    assert code == 0, err
    _killed(args, tmp_path / "run", 1)
    spelled = [f"{tmp_path}/./imat.gguf" if a == str(imat) else a for a in args]
    code, _, err = run_cli(*spelled, "--resume", "-o", tmp_path / "run")
    assert code == 0, err
    assert _files(tmp_path / "run")["encodings.json"] == _files(tmp_path / "whole")["encodings.json"]
    # another batch size: the line names the option
    spelled[spelled.index("--batch-size") + 1] = "3"
    _killed(args, tmp_path / "again", 1)
    code, _, err = run_cli(*spelled, "--resume", "-o", tmp_path / "again")
    assert code == 2 and "options: --batch-size differ" in err, err
