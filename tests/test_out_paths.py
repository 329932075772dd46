"""An --out that is, holds or lies inside an input is refused before any work, for every command and format, and
every input is left byte for byte as it was (replacing --out used to delete the checkpoint and encodings)."""

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool.export import format_names
from tests.helpers import error_lines, run_cli, tiny_llama
from tests.tinymodels import mlp


def _digest(root: Path):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def world(tmp_path):
    pytest.importorskip("transformers")
    llama = tiny_llama(tmp_path / "llama")
    run = tmp_path / "run"
    code, _, err = run_cli("calibrate", llama, "-c", "w8a16", "-o", run)
    assert code == 0, err
    return tmp_path, llama, run


def _refused(code, err, root, before, what):
    assert code == 2, err
    errors = [line for line in error_lines(err) if line.startswith("error:")]
    assert len(errors) == 1 and what in errors[0], errors
    assert _digest(root) == before  # nothing deleted, nothing written


@pytest.mark.parametrize("fmt", format_names())
def test_export_into_the_run_directory_or_the_checkpoint_is_refused(world, fmt):
    root, llama, run = world
    before = _digest(root)
    for out, what in ((run, "contains the encodings"), (root, "contains the checkpoint"),
                      (llama, "is the checkpoint")):
        code, _, err = run_cli("export", llama, "-e", run / "encodings.json", "-o", out, "--format", fmt,
                               "--overwrite")
        _refused(code, err, root, before, what)


def test_calibrate_and_quantize_refuse_an_out_over_or_inside_an_input(world):
    root, llama, run = world
    before = _digest(root)
    for cmd in ("calibrate", "quantize"):
        code, _, err = run_cli(cmd, llama, "-c", "w8a16", "-o", llama, "--overwrite")
        _refused(code, err, root, before, "is the checkpoint")
        code, _, err = run_cli(cmd, llama, "-c", "w8a16", "-o", llama / "q", "--overwrite")
        _refused(code, err, root, before, "inside the checkpoint directory")


def test_an_out_holding_a_link_named_as_an_input_is_refused(world):
    """CHECKPOINT given as holder/ck, a link to the model, with -o holder --overwrite: the link was deleted (only
    the paths links resolve to were compared)."""
    import os

    root, llama, run = world
    holder = root / "holder"
    holder.mkdir()
    os.symlink(llama, holder / "ck")
    code, _, err = run_cli("export", holder / "ck", "-e", run / "encodings.json", "-o", holder, "--overwrite")
    assert code == 2 and "contains the checkpoint" in err, err
    assert os.path.islink(holder / "ck")


def test_an_out_holding_the_recipe_or_the_data_is_refused(tmp_path):
    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    work = tmp_path / "work"
    work.mkdir()
    (work / "r.yaml").write_text("version: 1\ndefaults: {activations: null}\n")
    save_file({"x": torch.randn(8, 64)}, work / "x.safetensors")
    before = _digest(tmp_path)
    code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "-c", work / "r.yaml", "--model-class",
                           "tests.tinymodels:mlp", "-o", work, "--overwrite")
    _refused(code, err, tmp_path, before, "contains the recipe")
    code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "-c", "w8a8", "--data", work / "x.safetensors",
                           "--model-class", "tests.tinymodels:mlp", "-o", work, "--overwrite")
    _refused(code, err, tmp_path, before, "contains the data")
    # quantize --eval's held-out data: the run wrote over it, then could not read it (exit 2)
    code, _, err = run_cli("quantize", tmp_path / "m.safetensors", "-c", "w8a16", "--eval", work / "x.safetensors",
                           "--model-class", "tests.tinymodels:mlp", "-o", work, "--overwrite")
    _refused(code, err, tmp_path, before, "contains the eval data")
    # and a missing one is one line before the run (the output was written whole, then "data path not found")
    code, _, err = run_cli("quantize", tmp_path / "m.safetensors", "-c", "w8a16", "--eval", work / "nope.txt",
                           "--model-class", "tests.tinymodels:mlp", "-o", tmp_path / "q")
    _refused(code, err, tmp_path, before, "--eval")


def test_a_file_output_that_is_a_device_or_a_pipe_is_refused(tmp_path):
    """imatrix -o /dev/null --overwrite renamed a regular file over the device (the output is written beside it)."""
    import os

    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    os.mkfifo(tmp_path / "plot.svg")
    code, _, err = run_cli("report", tmp_path / "m.safetensors", "-e", tmp_path / "none.json", "--model-class",
                           "tests.tinymodels:mlp", "--data", tmp_path / "m.safetensors", "--plot", tmp_path / "plot.svg")
    assert code == 2 and "plot.svg: --plot is not a regular file" in err, err
    assert (tmp_path / "plot.svg").is_fifo()


def test_import_encodings_refuses_an_out_holding_the_aimet_file(world):
    root, llama, run = world
    code, _, err = run_cli("export", llama, "-e", run / "encodings.json", "-o", root / "aimet", "--format", "aimet")
    assert code == 0, err
    before = _digest(root)
    code, _, err = run_cli("import-encodings", llama, root / "aimet" / "model.encodings", "-o", root / "aimet",
                           "--overwrite")
    _refused(code, err, root, before, "contains the AIMET encodings")


def test_an_out_created_by_another_process_meanwhile_is_not_replaced_without_overwrite(tmp_path):
    from qtool.errors import UsageError
    from qtool.io.fs import atomic_output_dir

    out = tmp_path / "out"
    with pytest.raises(UsageError, match="created by another process while this run was writing"):
        with atomic_output_dir(out) as tmp:
            (tmp / "mine.txt").write_text("mine")
            out.mkdir()
            (out / "theirs.txt").write_text("theirs")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["theirs.txt"]
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "mine.txt").write_text("mine")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["mine.txt"]


def test_overwriting_an_out_that_is_a_symlink_replaces_the_link_and_leaves_no_litter(tmp_path):
    """(#34 item 2) --out a symbolic link to a directory, with --overwrite: the link becomes the new output directory,
    the directory it pointed to keeps its files untouched, and nothing is left beside --out."""
    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = tmp_path / "out"
    link.symlink_to(target, target_is_directory=True)
    code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "--model-class", "tests.tinymodels:mlp", "-c",
                           "w8a16", "-o", link, "--overwrite", "--quiet")
    assert code == 0, err
    assert link.is_dir() and not link.is_symlink() and (link / "encodings.json").is_file()
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"] and (target / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "m.safetensors", "out"]


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_outputs_carry_the_umasks_permissions(tmp_path, mask):
    """Output directories and files are made as mkdir and open() would make them under the umask (they used to be
    private, 0700 / 0600, whatever the umask: a serving container under another uid could not read them)."""
    import os

    from tests.test_gguf import _tiny_llama

    llama = _tiny_llama(tmp_path / "m", False)
    ids = tmp_path / "ids.safetensors"
    save_file({"input_ids": torch.randint(1, 300, (4, 16), generator=torch.Generator().manual_seed(0))}, ids)
    old = os.umask(mask)
    try:
        code, _, err = run_cli("quantize", llama, "-c", "gguf-q8_0", "--format", "gguf", "-o", tmp_path / "out")
        assert code == 0, err
        code, _, err = run_cli("imatrix", llama, "--data", ids, "-o", tmp_path / "imatrix.gguf")
        assert code == 0, err
    finally:
        os.umask(old)
    out = tmp_path / "out"
    dirs = [out] + [p for p in out.rglob("*") if p.is_dir()]
    files = [p for p in out.rglob("*") if p.is_file()] + [tmp_path / "imatrix.gguf"]
    assert len(dirs) >= 2 and len(files) >= 4
    for d in dirs:
        assert d.stat().st_mode & 0o777 == 0o777 & ~mask, d
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f


def test_an_out_where_an_input_directorys_links_point_is_refused(world):
    """A Hugging Face cache snapshot's files are links into its blobs directory: --out blobs --overwrite deleted
    the checkpoint's weights with exit 0 (only the input directory itself was compared), as it did a --data
    directory's linked files."""
    import os
    import shutil

    root, llama, _ = world
    blobs, snap = root / "blobs", root / "snap"
    blobs.mkdir()
    shutil.copytree(llama, snap)
    (snap / "model.safetensors").rename(blobs / "abc123")
    os.symlink("../blobs/abc123", snap / "model.safetensors")
    data, store = root / "data", root / "store"
    data.mkdir()
    store.mkdir()
    (store / "c.txt").write_text("some text to calibrate on " * 40)
    os.symlink("../store/c.txt", data / "c.txt")
    before = _digest(root)
    code, _, err = run_cli("quantize", snap, "-c", "w8a16", "-o", blobs, "--overwrite")
    _refused(code, err, root, before, f"contains the checkpoint {snap / 'model.safetensors'}")
    code, _, err = run_cli("calibrate", llama, "-c", "w8a8", "--data", data, "-o", store, "--overwrite")
    _refused(code, err, root, before, f"contains the data {data / 'c.txt'}")


def test_a_directory_named_like_the_sequential_state_is_never_removed_unless_it_is_one(world):
    """--sequential keeps its state in OUT.resume and replaced whatever was there: the checkpoint, the data
    directory, or a user's own directory (exit 0, the directory gone)."""
    import shutil

    root, llama, _ = world
    ckpt = root / "victim.resume"
    shutil.copytree(llama, ckpt)
    (root / "mine.resume").mkdir()
    (root / "mine.resume" / "thesis.tex").write_text("precious")
    (root / "data.resume").mkdir()
    (root / "data.resume" / "c.txt").write_text("some text to calibrate on " * 40)
    before = _digest(root)
    seq = ("--sequential", "--num-samples", "2", "--seq-len", "16")
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a8", "--data", root / "data.resume", *seq, "-o", root / "victim")
    _refused(code, err, root, before, "OUT.resume (where --sequential keeps its state) is the checkpoint")
    code, _, err = run_cli("quantize", llama, "-c", "w8a8", "--data", root / "data.resume", *seq, "-o", root / "data")
    _refused(code, err, root, before, "OUT.resume (where --sequential keeps its state) is the data")
    code, _, err = run_cli("calibrate", llama, "-c", "w8a8", "--data", root / "data.resume", *seq, "-o", root / "mine")
    _refused(code, err, root, before, "holds 'thesis.tex', which no --sequential run's state holds")
    # a file of the state's own name that no run wrote (the directory was removed, exit 0)
    (root / "notes.resume").mkdir()
    (root / "notes.resume" / "state.json").write_text('{"my": "notes"}')
    before = _digest(root)
    code, _, err = run_cli("calibrate", llama, "-c", "w8a8", "--data", root / "data.resume", *seq, "-o", root / "notes")
    _refused(code, err, root, before, "state.json: is not the state.json a --sequential run writes")
    # an empty one is what a crash leaves of a run's own (a rename on disk before its data): a run replaces it
    (root / "notes.resume" / "state.json").write_text("")
    code, _, err = run_cli("calibrate", llama, "-c", "w8a8", "--data", root / "data.resume", *seq, "-o", root / "notes")
    assert "state.json" not in err and "the model rejected the data" in err, err  # (the run went on to the data)


def test_an_out_that_is_a_link_to_nothing_is_refused_before_any_work(world):
    """It ran the whole job, then said the directory "was created by another process while this run was
    writing"."""
    import os

    root, llama, _ = world
    os.symlink(root / "nowhere", root / "dangling")
    before = _digest(root)
    code, _, err = run_cli("quantize", llama, "-c", "w8a16", "-o", root / "dangling")
    _refused(code, err, root, before, "already exists (a link to nothing); pass --overwrite")
    code, _, err = run_cli("quantize", llama, "-c", "w8a16", "-o", root / "dangling", "--overwrite")
    assert code == 0, err
    assert (root / "dangling").is_dir() and not (root / "dangling").is_symlink()


def test_overwriting_a_mount_point_is_refused_before_any_work(world, monkeypatch):
    """A mount point cannot be renamed: --overwrite onto one calibrated, then failed with "Device or resource
    busy". (os.path.ismount stands in for a mount, which a test cannot make without privileges.)"""
    import os

    root, llama, _ = world
    mounted = root / "mnt"
    mounted.mkdir()
    (mounted / "user-file").write_text("keep")
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mounted or real(p))
    before = _digest(root)
    code, _, err = run_cli("quantize", llama, "-c", "w8a16", "-o", mounted, "--overwrite")
    _refused(code, err, root, before, "is a mount point, which qtool cannot replace")
    code, _, err = run_cli("quantize", llama, "-c", "w8a16", "-o", mounted / "q")
    assert code == 0, err


def test_a_long_out_name_within_the_filesystems_limit_is_written(world):
    """A 250-byte name is legal; its temporary's name (host, pid and a random tail added) went past 255 bytes:
    "File name too long"."""
    root, llama, _ = world
    out = root / ("q" * 250)
    code, _, err = run_cli("quantize", llama, "-c", "w8a16", "-o", out)
    assert code == 0, err
    assert (out / "model.safetensors").is_file()
    assert [p.name for p in root.iterdir() if ".tmp-" in p.name] == []


def test_a_path_that_is_not_utf8_is_one_line(world):
    """Bytes the locale cannot decode (kept as surrogates) reached safetensors' reader: an internal error, exit 3."""
    root, llama, _ = world
    code, out, err = run_cli("quantize", str(root / "nu\udcff"), "-c", "w8a16", "-o", root / "x", "--json")
    assert code == 2 and "not a valid UTF-8 name" in err, err
    assert '"ok": false' in out and not (root / "x").exists()


def test_a_sequential_run_whose_state_name_would_be_too_long_is_refused_before_any_work(world):
    root, llama, _ = world
    (root / "ids.txt").write_text("some text " * 50)
    before = _digest(root)
    code, _, err = run_cli("calibrate", llama, "-c", "w8a16", "--sequential", "-o", root / ("q" * 250))
    _refused(code, err, root, before, "too long for the state a --sequential run keeps beside it")


def test_an_empty_out_or_the_working_directory_is_refused_before_any_work(world, monkeypatch):
    """-o "" (an unset shell variable) read as "."; with --overwrite the whole calibration ran, then renaming the
    working directory failed ("Device or resource busy"); a working directory that could be renamed away would
    have been replaced."""
    root, llama, run = world
    work = root / "work"
    work.mkdir()
    (work / "mine.txt").write_text("the user's file")
    monkeypatch.chdir(work)
    before = _digest(root)
    for out, what in (("", "--out is the working directory"), (".", "--out is the working directory"),
                      ("..", "--out holds the working directory")):
        code, _, err = run_cli("calibrate", llama, "-c", "w8a16", "-o", out, "--overwrite")
        _refused(code, err, root, before, what)
        assert "calibrating" not in err


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_an_interrupt_as_the_temporary_is_made_leaves_nothing(tmp_path, monkeypatch, kind):
    """A SIGTERM between mkdtemp and its chmod left an empty private .OUT.tmp-* behind ("nothing was written"); so
    did one as mkdtemp (mkstemp) returned, before the cleanup knew the temporary's name."""
    import os

    import qtool.io.fs as fs

    made_dir, made_file = os.mkdir, os.open

    def mkdir(path, *args, **kwargs):
        made_dir(path, *args, **kwargs)
        raise KeyboardInterrupt()

    def open_(path, *args, **kwargs):
        os.close(made_file(path, *args, **kwargs))
        raise KeyboardInterrupt()

    if kind == "dir":  # (one at a time: the cleanup's rmtree opens the directory)
        monkeypatch.setattr(fs.os, "mkdir", mkdir)
    else:
        monkeypatch.setattr(fs.os, "open", open_)
    with pytest.raises(KeyboardInterrupt):
        if kind == "dir":
            with fs.atomic_output_dir(tmp_path / "out"):
                pass
        else:
            with fs.atomic_file(tmp_path / "out.json"):
                pass
    assert list(tmp_path.iterdir()) == []


def test_a_rank_scratch_directory_sigkill_left_is_removed_by_the_next_run(tmp_path):
    """Under torchrun, a searching rank's scratch directory beside --out (".qtool-rank-..." before) named no
    writer, so a SIGKILLed rank's stayed there through every later run."""
    import subprocess
    import sys

    from qtool.io.fs import remove_stale_temporaries

    out = tmp_path / "out"
    code = ("import sys, time; from pathlib import Path; from qtool.io.fs import scratch_dir_beside\n"
            "with scratch_dir_beside(Path(sys.argv[1])) as d:\n"
            "    (Path(d) / 'recipe.yaml').write_text('x'); print(d, flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    made = Path(proc.stdout.readline().strip())
    assert made.parent == tmp_path and made.is_dir()
    assert remove_stale_temporaries(out) == []  # (its writer runs: left alone)
    proc.kill()
    proc.wait()
    assert remove_stale_temporaries(out) == [made] and list(tmp_path.iterdir()) == []
